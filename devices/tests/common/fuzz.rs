//! Pieces shared by the device-core fuzz targets (`blk_fuzz`, `net_fuzz`): hostile
//! descriptors aimed at a fixed set of guest areas, and the canary check (no byte of guest
//! RAM changes outside the buffers the device may write).

use std::sync::Arc;

use bounce::{BouncePool, Dma, Policy, PoolConfig};
use devices::testing::{first_fit_pool, GuestRam};
use devices::virtio::driver::{write_table_desc, Desc};
use devices::virtio::spec::VRING_DESC_F_WRITE;
use proptest::prelude::*;

/// The canary byte guest RAM is filled with where the device must not write.
pub const CANARY: u8 = 0xa5;

/// Guest RAM from the first page to `hw` plus the last 64 KiB: what the canary check compares.
pub fn snapshot(ram: &GuestRam, hw: u64) -> (Vec<u8>, Vec<u8>) {
    let end = ram.size();
    (
        ram.read(0x1000, (hw - 0x1000) as usize),
        ram.read(end - 0x10000, 0x10000),
    )
}

/// Asserts that every byte that changed between `before` (a [`snapshot`] with the same `hw`)
/// and now lies in `allowed` (half-open guest ranges the device may write).
pub fn assert_only_writable_changed(
    ram: &GuestRam,
    hw: u64,
    before: &(Vec<u8>, Vec<u8>),
    allowed: &[(u64, u64)],
    what: &str,
) {
    let after = snapshot(ram, hw);
    let end = ram.size();
    let ok = |a: u64| allowed.iter().any(|&(s, e)| s <= a && a < e);
    for (base, b, a) in [
        (0x1000, &before.0, &after.0),
        (end - 0x10000, &before.1, &after.1),
    ] {
        for (i, (x, y)) in b.iter().zip(a.iter()).enumerate() {
            let addr = base + i as u64;
            assert!(
                x == y || ok(addr),
                "{what}: the device wrote guest RAM at {addr:#x} ({x:#04x} -> {y:#04x}), \
                 outside every device-writable buffer"
            );
        }
    }
}

/// What a table lets the device write: the write-flagged descriptors' ranges (half-open) and
/// their total length.
#[derive(Debug, Default)]
pub struct Writable {
    pub allowed: Vec<(u64, u64)>,
    pub bytes: u64,
}

impl Writable {
    /// Adds `d` if it is device-writable.
    pub fn note(&mut self, d: &Desc) {
        if d.flags & VRING_DESC_F_WRITE != 0 {
            self.allowed
                .push((d.addr, d.addr.saturating_add(u64::from(d.len))));
            self.bytes += u64::from(d.len);
        }
    }
}

/// Fills `addr..addr + len` with the canary byte.
pub fn canary(ram: &GuestRam, addr: u64, len: u64) {
    ram.write(addr, &vec![CANARY; len as usize]);
}

/// A hostile descriptor, resolved against [`Targets`].
#[derive(Clone, Debug)]
pub struct FuzzDesc {
    pub addr: u8,
    pub off: u16,
    pub len: u8,
    pub raw_len: u32,
    pub flags: u16,
    pub next: u16,
}

pub fn fuzz_desc() -> impl Strategy<Value = FuzzDesc> {
    (
        any::<u8>(),
        any::<u16>(),
        any::<u8>(),
        any::<u32>(),
        0u16..8,
        0u16..20,
    )
        .prop_map(|(addr, off, len, raw_len, flags, next)| FuzzDesc {
            addr,
            off,
            len,
            raw_len,
            flags,
            next,
        })
}

/// The guest areas hostile descriptors point at: request headers, a 64 KiB data area, an
/// indirect table, the end of RAM, outside RAM, the top of the address space.
#[derive(Clone, Debug)]
pub struct Targets {
    /// Headers (block request headers, vnet headers, control commands).
    pub hdrs: Vec<u64>,
    /// 64 KiB of data.
    pub data: u64,
    /// The indirect table and its entry count.
    pub table: u64,
    pub table_len: u32,
    /// Guest RAM size.
    pub end: u64,
}

impl Targets {
    /// Allocates the data area (canary-filled) and the indirect table of `table_len` entries
    /// in `ram`, and canary-fills the last 64 KiB of RAM; `hdrs` are already in place.
    pub fn new(ram: &mut GuestRam, hdrs: Vec<u64>, table_len: usize) -> Self {
        let end = ram.size();
        let data = ram.alloc(64 << 10, 4096);
        canary(ram, data, 64 << 10);
        canary(ram, end - 0x10000, 0x10000);
        let table = ram.alloc(16 * table_len as u64, 16);
        Self {
            hdrs,
            data,
            table,
            table_len: table_len as u32,
            end,
        }
    }

    /// The (address, length) `f` stands for.
    pub fn resolve(&self, f: &FuzzDesc) -> (u64, u32) {
        let len = match f.len % 8 {
            0 => 0,
            1 => 1,
            2 => 16,
            3 => 512,
            4 => 4096,
            5 => 16 * self.table_len,
            6 => u32::from(f.off),
            _ => f.raw_len,
        };
        let addr = match f.addr % 8 {
            0 | 1 => self.hdrs[usize::from(f.addr / 8) % self.hdrs.len()],
            2 | 3 => self.data + u64::from(f.off % 0x8000),
            4 => self.table,
            5 => self.end - u64::from(f.off % 4096),
            6 => self.end + u64::from(f.off),
            _ => u64::MAX - u64::from(f.off),
        };
        (addr, len)
    }

    /// `f` as a raw descriptor.
    pub fn raw(&self, f: &FuzzDesc) -> Desc {
        let (addr, len) = self.resolve(f);
        Desc {
            addr,
            len,
            flags: f.flags,
            next: f.next,
        }
    }

    /// Writes `entries` (at most `table_len`) as the indirect table.
    pub fn write_table(&self, ram: &GuestRam, entries: &[FuzzDesc]) {
        for (i, f) in (0u16..).zip(entries) {
            write_table_desc(ram.mem(), self.table, i, self.raw(f)).unwrap();
        }
    }
}

/// The bounced configurations, built once per test thread (the two properties run in
/// parallel; sharing pools would let one test's mappings show in the other's accounting):
/// (name, pool). Index 0 of a case's `bounce` is `off`; 1.. pick these. A pool that does not
/// build fails the test.
pub fn pools() -> Vec<(&'static str, Arc<BouncePool>)> {
    thread_local! {
        static POOLS: Vec<(&'static str, Arc<BouncePool>)> = {
            let mut areas = PoolConfig::swiotlb(4096);
            areas.allocator = bounce::AllocatorKind::Areas;
            let mut rcache = PoolConfig::iova(2048);
            rcache.allocator = bounce::AllocatorKind::IovaRcache;
            vec![
                ("swiotlb/first-fit", first_fit_pool(&PoolConfig::swiotlb(4096))),
                (
                    "swiotlb/areas",
                    Arc::new(BouncePool::new(&areas).expect("swiotlb areas pool")),
                ),
                (
                    "iova/iova-rcache",
                    Arc::new(BouncePool::new(&rcache).expect("iova rcache pool")),
                ),
            ]
        };
    }
    POOLS.with(Clone::clone)
}

/// (name, DMA handle, pool) for `bounce` (0 = off).
pub fn dma_for(bounce: u8) -> (&'static str, Dma, Option<Arc<BouncePool>>) {
    let ps = pools();
    match usize::from(bounce) % (ps.len() + 1) {
        0 => ("off", Dma::direct(), None),
        i => {
            let (name, p) = &ps[i - 1];
            (
                *name,
                Dma::bounced(Policy::Force, Arc::clone(p)),
                Some(Arc::clone(p)),
            )
        }
    }
}
