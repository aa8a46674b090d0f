//! Per-device DMA counters: what one device's maps cost a pool it may share with others.
//!
//! A [`crate::Dma`] handle given [`DmaCounters`] ([`crate::Dma::with_counters`]) counts every
//! bounced map it makes (and the bytes), every map the pool refused as full, and every unmap
//! the pool accepted, exactly as the pool counts them: over the devices of one pool, the
//! devices' `maps`, `map_failures` and `unmaps` sum to the pool's [`crate::PoolStats`]
//! counters of the same names (when every user of the pool maps through a counted handle).
//! Maps a policy does not bounce never reach the pool and are not counted.
//!
//! The counters are sharded per thread as the pool's own are ([`crate::stats::ThreadShards`]):
//! a thread adds to its own shard with a plain load and store, so counting adds no atomic
//! read-modify-write and no shared cache line to a map or an unmap.

use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::stats::ThreadShards;

/// One thread's counters of a device, alone on its cache lines (128 bytes: the adjacent-line
/// prefetcher pairs 64-byte lines).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    maps: AtomicU64,
    bytes: AtomicU64,
    map_failures: AtomicU64,
    unmaps: AtomicU64,
}

/// Live DMA counters of one device (see the module documentation).
#[derive(Debug)]
pub struct DmaCounters {
    pool: Option<String>,
    shards: ThreadShards<Shard>,
}

/// A snapshot of one device's [`DmaCounters`], serialisable to JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmaStats {
    /// The named pool the device maps through (absent for a pool of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Bounced maps the pool served.
    pub maps: u64,
    /// Bytes of those maps.
    pub bytes: u64,
    /// Maps the pool refused as full ([`Error::PoolFull`]).
    pub map_failures: u64,
    /// Unmaps the pool accepted (every unmap except one of an address that is no live
    /// mapping, [`Error::NotMapped`]).
    pub unmaps: u64,
}

impl DmaStats {
    /// Mappings the device holds: maps not unmapped yet.
    pub fn live(&self) -> u64 {
        self.maps.saturating_sub(self.unmaps)
    }
}

impl DmaCounters {
    /// Counters of a device whose maps go to the pool named `pool` (`None`: a pool of its
    /// own, or a pool that has no name).
    pub fn new(pool: Option<String>) -> Self {
        Self {
            pool,
            shards: ThreadShards::default(),
        }
    }

    /// The pool's name, if it has one.
    pub fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    /// Counts `maps` bounced maps of `bytes` bytes in all, made by one call (a map or a batch)
    /// whose outcome is `r`: a full pool counts one failure.
    #[inline]
    pub(crate) fn count_maps<T>(&self, maps: u64, bytes: u64, r: &Result<T>) {
        let s = self.shards.local();
        if maps > 0 {
            s.add_to(|s| &s.maps, maps);
            s.add_to(|s| &s.bytes, bytes);
        }
        if let Err(Error::PoolFull { .. }) = r {
            s.add_to(|s| &s.map_failures, 1);
        }
    }

    /// Counts the outcome of an unmap (the pool released the slots unless the address was no
    /// live mapping).
    #[inline]
    pub(crate) fn count_unmap(&self, r: &Result<()>) {
        if !matches!(r, Err(Error::NotMapped { .. })) {
            self.shards.local().add_to(|s| &s.unmaps, 1);
        }
    }

    /// The counters now (exact when no map or unmap is running).
    pub fn snapshot(&self) -> DmaStats {
        DmaStats {
            pool: self.pool.clone(),
            maps: self.shards.sum(|s| &s.maps),
            bytes: self.shards.sum(|s| &s.bytes),
            map_failures: self.shards.sum(|s| &s.map_failures),
            unmaps: self.shards.sum(|s| &s.unmaps),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vm_memory::{GuestAddress, GuestMemoryMmap};

    use super::*;
    use crate::{BouncePool, Direction, Dma, Policy, PoolConfig, RangeCheck};

    #[test]
    fn two_devices_on_one_pool_sum_to_the_pools_counters() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        // 128 slots of 2 KiB (one segment): 256 KiB in all.
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(128)).unwrap());
        assert_eq!(pool.stats().nslabs, 128);
        let counted = |name: &str, policy| {
            let c = Arc::new(DmaCounters::new(Some(name.into())));
            (
                Dma::bounced(policy, Arc::clone(&pool)).with_counters(c.clone()),
                c,
            )
        };
        let (a, ca) = counted("shared", Policy::Force);
        // B bounces only above 1 MiB - 1: its low buffers never reach the pool.
        let (b, cb) = counted("shared", Policy::Mask(20));
        let (c, cc) = counted("shared", Policy::Force);
        let mut held = Vec::new();
        for i in 0..3u64 {
            held.push(
                a.map(
                    &mem,
                    i * 0x1_0000,
                    0x1_0000,
                    Direction::ToDevice,
                    0,
                    RangeCheck::Here,
                )
                .unwrap(),
            );
        }
        // 96 of 128 slots held by A: C's 80 KiB map finds no room, then a 16 KiB one fits.
        assert!(matches!(
            c.map(
                &mem,
                0x8_0000,
                0x1_4000,
                Direction::FromDevice,
                3,
                RangeCheck::Here
            ),
            Err(Error::PoolFull { .. })
        ));
        let cbuf = c
            .map(
                &mem,
                0x8_0000,
                0x4000,
                Direction::FromDevice,
                17,
                RangeCheck::Here,
            )
            .unwrap();
        // Not bounced under B's mask: the pool never sees it.
        let direct = b
            .map(
                &mem,
                0x1000,
                0x1000,
                Direction::ToDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap();
        assert!(!direct.is_bounced());
        b.unmap(&mem, direct, 0).unwrap();
        assert!(matches!(
            b.map(&mem, 0x1000, 16, Direction::ToDevice, 1, RangeCheck::Here),
            Ok(buf) if !buf.is_bounced()
        ));
        c.unmap_written(&mem, cbuf, 100, 17).unwrap();
        // A second unmap of the same buffer is refused and not counted.
        assert!(matches!(
            c.unmap(&mem, cbuf, 17),
            Err(Error::NotMapped { .. })
        ));
        a.write_guest(&mem, 0x9_0000, &[1, 2, 3], 5, RangeCheck::Here)
            .unwrap();
        for buf in held.drain(..2) {
            a.unmap(&mem, buf, 0).unwrap();
        }
        let (sa, sb, sc) = (ca.snapshot(), cb.snapshot(), cc.snapshot());
        assert_eq!(
            (sa.maps, sa.bytes, sa.map_failures, sa.unmaps, sa.live()),
            (4, 3 * 0x1_0000 + 3, 0, 3, 1)
        );
        assert_eq!(
            sb,
            DmaStats {
                pool: Some("shared".into()),
                ..DmaStats::default()
            }
        );
        assert_eq!(
            (sc.maps, sc.bytes, sc.map_failures, sc.unmaps, sc.live()),
            (1, 0x4000, 1, 1, 0)
        );
        let p = pool.stats();
        assert_eq!(p.maps, sa.maps + sb.maps + sc.maps);
        assert_eq!(
            p.map_failures,
            sa.map_failures + sb.map_failures + sc.map_failures
        );
        assert_eq!(p.unmaps, sa.unmaps + sb.unmaps + sc.unmaps);
        assert_eq!(p.bad_unmaps, 1);
        let json = serde_json::to_value(&sa).unwrap();
        assert_eq!(json["pool"], "shared");
        assert!(serde_json::to_value(DmaCounters::new(None).snapshot())
            .unwrap()
            .get("pool")
            .is_none());
    }

    #[test]
    fn threads_of_one_device_count_exactly() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(1024)).unwrap());
        let counters = Arc::new(DmaCounters::new(None));
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool)).with_counters(counters.clone());
        // More threads than exclusive shards, so some add on the shared overflow shard; all
        // of them pass worker index 0, so only the thread picks the shard.
        let threads = crate::stats::EXCLUSIVE_SHARDS as u64 + 4;
        std::thread::scope(|s| {
            for t in 0..threads {
                let (dma, mem) = (&dma, &mem);
                s.spawn(move || {
                    for _ in 0..50 {
                        let gpa = (t % 16) * 0x1000;
                        let buf = dma
                            .map(mem, gpa, 100, Direction::ToDevice, 0, RangeCheck::Here)
                            .unwrap();
                        dma.unmap(mem, buf, 0).unwrap();
                    }
                });
            }
        });
        let got = counters.snapshot();
        assert_eq!(
            (got.maps, got.bytes, got.unmaps, got.live()),
            (threads * 50, threads * 50 * 100, threads * 50, 0)
        );
        let p = pool.stats();
        assert_eq!((p.maps, p.unmaps), (got.maps, got.unmaps));
    }
}
