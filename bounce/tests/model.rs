//! Randomized model test: long sequences of map / device write / CPU write / sync / unmap with
//! random sizes, masks, directions and workers, checked against a simple reference model.
//!
//! The model keeps the expected bytes of the original memory and of every live mapping's device
//! buffer, and applies the copy rules of DESIGN.md itself. After every step the test checks: no
//! two live mappings share a slot; the pool's used count equals the model's; every placement
//! rule holds for every new mapping; device buffers and the original memory hold exactly what
//! the model says. At the end everything is unmapped and the whole pool must be usable again.

use bounce::{
    AllocatorKind, BouncePool, Direction, DmaAttrs, Error, HostMemory, MapRequest, Mapping,
    OrigMemory, PoolConfig, PoolMode,
};
use proptest::prelude::*;
use vm_memory::VolatileSlice;

const ORIG_BASE: u64 = 0x20_0000;
const ORIG_LEN: usize = 512 * 1024;

#[derive(Clone, Debug)]
enum Op {
    Map {
        off: usize,
        size: usize,
        dir: u8,
        mask: u8,
        worker: usize,
    },
    DeviceWrite {
        pick: usize,
        at: usize,
        len: usize,
        seed: u8,
    },
    CpuWrite {
        off: usize,
        len: usize,
        seed: u8,
    },
    SyncForDevice {
        pick: usize,
        at: usize,
        len: usize,
    },
    SyncForCpu {
        pick: usize,
        at: usize,
        len: usize,
    },
    Unmap {
        pick: usize,
        skip: bool,
        worker: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..ORIG_LEN, prop_oneof![1usize..64, 64usize..5000, 5000usize..70_000, 70_000usize..262_144], 0u8..3, 0u8..4, 0usize..4)
            .prop_map(|(off, size, dir, mask, worker)| Op::Map { off, size, dir, mask, worker }),
        2 => (any::<usize>(), any::<usize>(), 1usize..9000, any::<u8>())
            .prop_map(|(pick, at, len, seed)| Op::DeviceWrite { pick, at, len, seed }),
        1 => (0..ORIG_LEN, 1usize..9000, any::<u8>()).prop_map(|(off, len, seed)| Op::CpuWrite { off, len, seed }),
        1 => (any::<usize>(), any::<usize>(), 1usize..9000).prop_map(|(pick, at, len)| Op::SyncForDevice { pick, at, len }),
        1 => (any::<usize>(), any::<usize>(), 1usize..9000).prop_map(|(pick, at, len)| Op::SyncForCpu { pick, at, len }),
        3 => (any::<usize>(), any::<bool>(), 0usize..4).prop_map(|(pick, skip, worker)| Op::Unmap { pick, skip, worker }),
    ]
}

struct Live {
    m: Mapping,
    /// Expected device-visible bytes.
    dev: Vec<u8>,
    /// Bytes the device may legitimately hold that the model does not know (iova mode,
    /// from-device buffers are not copied in): positions not yet written are "unknown".
    known: Vec<bool>,
    min_align_mask: u64,
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed ^ (i as u8).wrapping_mul(31))
        .collect()
}

fn run(kind: AllocatorKind, mode: PoolMode, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut cfg = match mode {
        PoolMode::Swiotlb => PoolConfig::swiotlb(1024),
        PoolMode::Iova => PoolConfig::iova(512),
    };
    cfg.allocator = kind;
    cfg.areas = Some(2);
    cfg.workers = 4;
    let pool = BouncePool::new(&cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let geom = *pool.geometry();
    let mut orig = bytes(3, ORIG_LEN);
    let mut model = orig.clone();
    let mut live: Vec<Live> = Vec::new();
    let mut occupied = vec![false; geom.nslabs];

    for op in ops {
        let mem = HostMemory::new(ORIG_BASE, &mut orig);
        match *op {
            Op::Map {
                off,
                size,
                dir,
                mask,
                worker,
            } => {
                let size = size.min(ORIG_LEN - off).max(1);
                let dir = Direction::from_linux(dir.into()).unwrap();
                let min_align_mask = [0u64, 0x7ff, 0xfff, 0x3ff][mask as usize];
                let addr = ORIG_BASE + off as u64;
                let req = MapRequest::new(addr, size, dir)
                    .min_align_mask(min_align_mask)
                    .worker(worker);
                match pool.map(&mem, &req) {
                    Ok(m) => {
                        prop_assert_eq!(m.dev_addr & min_align_mask, addr & min_align_mask);
                        if mode == PoolMode::Swiotlb {
                            prop_assert_eq!(
                                m.slot / 128,
                                (m.slot + m.nslots - 1) / 128,
                                "crossed a segment"
                            );
                            if min_align_mask == 0 && size >= 4096 {
                                prop_assert_eq!(m.dev_addr % 4096, 0);
                            }
                        }
                        for (s, occ) in occupied.iter_mut().enumerate().skip(m.slot).take(m.nslots)
                        {
                            prop_assert!(!*occ, "{kind}: slot {} handed out twice", s);
                            *occ = true;
                        }
                        let copied = mode == PoolMode::Swiotlb || dir.device_reads();
                        let dev = model[off..off + size].to_vec();
                        let known = vec![copied; size];
                        check_dev(&pool, &m, &dev, &known)?;
                        live.push(Live {
                            m,
                            dev,
                            known,
                            min_align_mask,
                        });
                    }
                    Err(Error::PoolFull { used, total, .. }) => {
                        prop_assert_eq!(total, geom.nslabs);
                        prop_assert!(used <= total);
                    }
                    Err(Error::TooLarge { size: s, max }) => {
                        prop_assert!(s > max || mode == PoolMode::Swiotlb);
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("{kind}: {e}"))),
                }
            }
            Op::DeviceWrite {
                pick,
                at,
                len,
                seed,
            } => {
                if live.is_empty() {
                    continue;
                }
                let n = live.len();
                let l = &mut live[pick % n];
                let at = at % l.m.size;
                let len = len.min(l.m.size - at);
                let data = bytes(seed, len);
                pool.device_slice(l.m.dev_addr + at as u64, len)
                    .unwrap()
                    .copy_from(&data[..]);
                l.dev[at..at + len].copy_from_slice(&data);
                l.known[at..at + len].iter_mut().for_each(|k| *k = true);
            }
            Op::CpuWrite { off, len, seed } => {
                let len = len.min(ORIG_LEN - off);
                let data = bytes(seed, len);
                mem.write_orig(
                    ORIG_BASE + off as u64,
                    &VolatileSlice::from(&mut data.clone()[..]),
                )
                .unwrap();
                model[off..off + len].copy_from_slice(&data);
            }
            Op::SyncForDevice { pick, at, len } => {
                if live.is_empty() {
                    continue;
                }
                let n = live.len();
                let l = &mut live[pick % n];
                let at = at % l.m.size;
                let len = len.min(l.m.size - at);
                pool.sync_for_device(&mem, l.m.dev_addr + at as u64, len, l.m.dir)
                    .unwrap();
                if l.m.dir.device_reads() {
                    let o = (l.m.orig - ORIG_BASE) as usize + at;
                    l.dev[at..at + len].copy_from_slice(&model[o..o + len]);
                    l.known[at..at + len].iter_mut().for_each(|k| *k = true);
                }
                check_dev(&pool, &l.m, &l.dev, &l.known)?;
            }
            Op::SyncForCpu { pick, at, len } => {
                if live.is_empty() {
                    continue;
                }
                let l = &live[pick % live.len()];
                let at = at % l.m.size;
                let len = len.min(l.m.size - at);
                if l.m.dir.device_writes() && !l.known[at..at + len].iter().all(|k| *k) {
                    continue; // the model cannot predict unknown bytes
                }
                pool.sync_for_cpu(&mem, l.m.dev_addr + at as u64, len, l.m.dir)
                    .unwrap();
                if l.m.dir.device_writes() {
                    let o = (l.m.orig - ORIG_BASE) as usize + at;
                    model[o..o + len].copy_from_slice(&l.dev[at..at + len]);
                }
            }
            Op::Unmap { pick, skip, worker } => {
                if live.is_empty() {
                    continue;
                }
                let i = pick % live.len();
                if live[i].m.dir.device_writes() && !skip && !live[i].known.iter().all(|k| *k) {
                    // Write the unknown bytes so the copy back is predictable.
                    let l = &mut live[i];
                    for (j, k) in l.known.iter_mut().enumerate() {
                        if !*k {
                            l.dev[j] = 0x5e;
                            *k = true;
                        }
                    }
                    pool.device_slice(l.m.dev_addr, l.m.size)
                        .unwrap()
                        .copy_from(&l.dev[..]);
                }
                let l = live.swap_remove(i);
                let attrs = DmaAttrs {
                    skip_cpu_sync: skip,
                    no_warn: true,
                };
                pool.unmap_single(&mem, l.m.dev_addr, l.m.size, l.m.dir, attrs, worker)
                    .unwrap();
                occupied[l.m.slot..l.m.slot + l.m.nslots].fill(false);
                if l.m.dir.device_writes() && !skip {
                    let o = (l.m.orig - ORIG_BASE) as usize;
                    model[o..o + l.m.size].copy_from_slice(&l.dev);
                }
                let _ = l.min_align_mask;
            }
        }
        prop_assert_eq!(
            pool.used(),
            occupied.iter().filter(|o| **o).count(),
            "{}: used count",
            kind
        );
        prop_assert!(
            orig == model,
            "{kind}: original memory differs from the model after {op:?}"
        );
    }

    let mem = HostMemory::new(ORIG_BASE, &mut orig);
    for l in live.drain(..) {
        pool.unmap_single(
            &mem,
            l.m.dev_addr,
            l.m.size,
            l.m.dir,
            DmaAttrs {
                skip_cpu_sync: true,
                no_warn: true,
            },
            0,
        )
        .unwrap();
    }
    prop_assert_eq!(pool.used(), 0);
    // Nothing leaked: every slot can be mapped again, one slot per mapping.
    let slot = geom.slot_size() as usize;
    let mut again = Vec::new();
    for i in 0..geom.nslabs {
        let m = pool
            .map(
                &mem,
                &MapRequest::new(ORIG_BASE, slot, Direction::ToDevice).worker(i % 4),
            )
            .map_err(|e| TestCaseError::fail(format!("{kind}: refill {i}/{}: {e}", geom.nslabs)))?;
        again.push(m);
    }
    for m in again.drain(..) {
        pool.unmap(&mem, &m, 0).unwrap();
    }
    // In swiotlb mode segments are aligned, so maximal mappings tile the pool exactly (the
    // iova-bitmap allocator serves large requests from half of the pool only).
    if mode == PoolMode::Swiotlb {
        let max = pool.max_mapping_size(0);
        let mut want = geom.bytes() / max;
        if kind == AllocatorKind::IovaBitmap {
            want /= 2;
        }
        for i in 0..want {
            let m = pool
                .map(
                    &mem,
                    &MapRequest::new(ORIG_BASE, max, Direction::ToDevice).worker(i % 4),
                )
                .map_err(|e| TestCaseError::fail(format!("{kind}: refill {i}/{want}: {e}")))?;
            again.push(m);
        }
        for m in &again {
            pool.unmap(&mem, m, 0).unwrap();
        }
    }
    Ok(())
}

fn check_dev(
    pool: &BouncePool,
    m: &Mapping,
    dev: &[u8],
    known: &[bool],
) -> Result<(), TestCaseError> {
    let mut got = vec![0u8; m.size];
    pool.device_slice(m.dev_addr, m.size)
        .unwrap()
        .copy_to(&mut got[..]);
    for i in 0..m.size {
        if known[i] && got[i] != dev[i] {
            return Err(TestCaseError::fail(format!(
                "device byte {i} of {m:?}: {} != {}",
                got[i], dev[i]
            )));
        }
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("BOUNCE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

macro_rules! model_tests {
    ($($name:ident: $kind:expr, $mode:expr;)*) => {$(
        proptest! {
            #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]
            #[test]
            fn $name(ops in proptest::collection::vec(op(), 1..400)) {
                run($kind, $mode, &ops)?;
            }
        }
    )*};
}

model_tests! {
    model_legacy: AllocatorKind::Legacy, PoolMode::Swiotlb;
    model_bitmap: AllocatorKind::Bitmap, PoolMode::Swiotlb;
    model_areas: AllocatorKind::Areas, PoolMode::Swiotlb;
    model_areas_bitmap: AllocatorKind::AreasBitmap, PoolMode::Swiotlb;
    model_iova_rbtree: AllocatorKind::IovaRbtree, PoolMode::Swiotlb;
    model_iova_rcache: AllocatorKind::IovaRcache, PoolMode::Swiotlb;
    model_genpool: AllocatorKind::Genpool, PoolMode::Swiotlb;
    model_iova_bitmap: AllocatorKind::IovaBitmap, PoolMode::Swiotlb;
    model_iova_mode_rbtree: AllocatorKind::IovaRbtree, PoolMode::Iova;
    model_iova_mode_rcache: AllocatorKind::IovaRcache, PoolMode::Iova;
    model_iova_mode_genpool: AllocatorKind::Genpool, PoolMode::Iova;
    model_iova_mode_bitmap: AllocatorKind::IovaBitmap, PoolMode::Iova;
    model_iova_mode_areas: AllocatorKind::Areas, PoolMode::Iova;
}
