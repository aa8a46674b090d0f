//! Helpers for the net unit tests: guest memory with split rings laid out through
//! `virtio-queue`'s mock driver, and DMA handles (direct, forced swiotlb, forced iova, always
//! full) built on [`crate::testing`]'s test allocator.

#![allow(missing_docs)]

use std::sync::Arc;

use bounce::{BouncePool, Dma, Policy, PoolConfig};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

pub const MEM_SIZE: usize = 16 << 20;
pub const QSIZE: u16 = 256;
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
/// Not a virtio flag: marks the last descriptor of an avail entry even though NEXT is set
/// (to post loops). Stripped before the descriptor is written.
pub const LAST: u16 = 0x8000;
/// Ring areas: one 64 KiB window per queue.
pub const RING_BASE: u64 = 0;
pub const RING_STRIDE: u64 = 0x1_0000;
/// Data buffers are carved from here up.
pub const DATA_BASE: u64 = 0x10_0000;

/// A pool for `cfg`: its real allocator, or the crate's test allocator when that one does
/// not build for `cfg`.
pub fn pool(cfg: &PoolConfig) -> Arc<BouncePool> {
    BouncePool::new(cfg).map_or_else(|_| crate::testing::first_fit_pool(cfg), Arc::new)
}

/// A forced-bounce handle whose every map fails ("buffer is full").
pub fn failing_dma() -> Dma {
    let geom = PoolConfig::swiotlb(1024).geometry().unwrap();
    let alloc = Arc::new(crate::testing::FirstFitAllocator::always_full(geom));
    Dma::bounced(
        Policy::Force,
        Arc::new(BouncePool::with_allocator(geom, alloc, None).unwrap()),
    )
}

/// The three DMA setups every data test runs with.
pub fn dmas() -> Vec<(&'static str, Dma)> {
    let mut sw = PoolConfig::swiotlb(4096);
    sw.workers = 4;
    let mut iova = PoolConfig::iova(4096);
    iova.workers = 4;
    vec![
        ("off", Dma::direct()),
        ("swiotlb-force", Dma::bounced(Policy::Force, pool(&sw))),
        ("iova-force", Dma::bounced(Policy::Force, pool(&iova))),
    ]
}

/// Guest memory, rings for `nqueues` queues, and a bump allocator for data buffers.
pub struct Guest {
    pub mem: GuestMemoryMmap,
    pub queues: Vec<Queue>,
    next_desc: Vec<u16>,
    next_data: u64,
}

impl Guest {
    pub fn new(nqueues: usize) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let queues = (0..nqueues)
            .map(|i| {
                let m = MockSplitQueue::create(&mem, Self::ring(i), QSIZE);
                m.create_queue::<Queue>().unwrap()
            })
            .collect();
        Self {
            mem,
            queues,
            next_desc: vec![0; nqueues],
            next_data: DATA_BASE,
        }
    }

    fn ring(i: usize) -> GuestAddress {
        GuestAddress(RING_BASE + RING_STRIDE * i as u64)
    }

    /// Allocates `len` bytes of guest memory (16-byte aligned) holding `data` (zeros if
    /// shorter).
    pub fn alloc(&mut self, len: usize, data: &[u8]) -> u64 {
        let a = self.next_data;
        self.next_data = (a + len as u64 + 15) & !15;
        assert!(
            self.next_data < MEM_SIZE as u64,
            "test guest memory exhausted"
        );
        self.mem
            .write_slice(&vec![0u8; len], GuestAddress(a))
            .unwrap();
        self.mem.write_slice(data, GuestAddress(a)).unwrap();
        a
    }

    /// Ring addresses of queue `q`: (descriptor table, avail ring, used ring).
    pub fn rings(&self, q: usize) -> (u64, u64, u64) {
        let qu = &self.queues[q];
        (qu.desc_table(), qu.avail_ring(), qu.used_ring())
    }

    /// Posts raw descriptors `(addr, len, flags, next)`, with `next` relative to the first
    /// one; a descriptor without NEXT (or with [`LAST`]) ends a chain and the next one starts another. Returns
    /// the head indexes.
    pub fn post_raw(&mut self, q: usize, descs: &[(u64, u32, u16, u16)]) -> Vec<u16> {
        let base = self.next_desc[q];
        let (dt, avail, _) = self.rings(q);
        let mut heads = vec![base];
        for (i, &(a, l, f, n)) in descs.iter().enumerate() {
            let idx = (base + i as u16) % QSIZE;
            let d = Descriptor::new(a, l, f & !LAST, (base + n) % QSIZE);
            self.mem
                .write_obj(
                    RawDescriptor::from(d),
                    GuestAddress(dt + 16 * u64::from(idx)),
                )
                .unwrap();
            if (f & F_NEXT == 0 || f & LAST != 0) && i + 1 < descs.len() {
                heads.push((base + i as u16 + 1) % QSIZE);
            }
        }
        let mut aidx: u16 = self.mem.read_obj(GuestAddress(avail + 2)).unwrap();
        for &h in &heads {
            let slot = avail + 4 + 2 * u64::from(aidx % QSIZE);
            self.mem.write_obj(h, GuestAddress(slot)).unwrap();
            aidx = aidx.wrapping_add(1);
        }
        self.mem.write_obj(aidx, GuestAddress(avail + 2)).unwrap();
        self.next_desc[q] = base + descs.len() as u16;
        heads
    }

    /// Sets the avail index of queue `q` (hostile tests).
    pub fn set_avail_idx(&self, q: usize, idx: u16) {
        let (_, avail, _) = self.rings(q);
        self.mem.write_obj(idx, GuestAddress(avail + 2)).unwrap();
    }

    /// Posts a device-readable chain holding `parts` (one descriptor each).
    pub fn post_readable(&mut self, q: usize, parts: &[&[u8]]) -> u16 {
        let descs: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let a = self.alloc(p.len(), p);
                let f = if i + 1 < parts.len() { F_NEXT } else { 0 };
                (a, p.len() as u32, f, i as u16 + 1)
            })
            .collect();
        self.post_raw(q, &descs)[0]
    }

    /// Posts a device-writable chain of buffers of `sizes`; returns the head and buffer
    /// addresses.
    pub fn post_writable(&mut self, q: usize, sizes: &[usize]) -> (u16, Vec<u64>) {
        let mut addrs = Vec::new();
        let descs: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let a = self.alloc(s, &[0xee; 0]);
                addrs.push(a);
                let f = F_WRITE | if i + 1 < sizes.len() { F_NEXT } else { 0 };
                (a, s as u32, f, i as u16 + 1)
            })
            .collect();
        (self.post_raw(q, &descs)[0], addrs)
    }

    /// The used ring of queue `q` so far: `(id, len)`.
    pub fn used(&self, q: usize) -> Vec<(u32, u32)> {
        let (_, _, base) = self.rings(q);
        let idx: u16 = self.mem.read_obj(GuestAddress(base + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let e = base + 4 + 8 * u64::from(i % QSIZE);
                let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
                let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
                (id, len)
            })
            .collect()
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    /// Mutable references to queues `idx` in order (for `QueueWorker::handle`).
    pub fn split(&mut self, idx: &[u16]) -> (&GuestMemoryMmap, Vec<&mut Queue>) {
        let mut refs: Vec<Option<&mut Queue>> = self.queues.iter_mut().map(Some).collect();
        let qs = idx
            .iter()
            .map(|&i| refs[usize::from(i)].take().expect("queue asked twice"))
            .collect();
        (&self.mem, qs)
    }

    pub fn next_avail(&self, q: usize) -> u16 {
        self.queues[q].next_avail()
    }
}

/// A frame: a vnet header then `len` payload bytes of a pattern seeded by `seed`.
pub fn frame(hdr: &super::VnetHeader, len: usize, seed: u8) -> Vec<u8> {
    let mut v = hdr.to_bytes().to_vec();
    v.extend((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    v
}
