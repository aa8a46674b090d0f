//! Helpers for the net unit tests: guest memory with split rings driven by
//! [`crate::virtio::driver`], and DMA handles (direct, forced swiotlb and iova from
//! [`crate::testing::forced_dmas`], and one whose pool is always full, built on
//! [`crate::testing`]'s test allocator).

#![allow(missing_docs)]

use std::sync::Arc;

use bounce::{BouncePool, Dma, Policy, PoolConfig};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::testing::device_queue;
use crate::virtio::driver::{Desc, DriverQueue, Layout};
pub use crate::virtio::spec::{VRING_DESC_F_NEXT as F_NEXT, VRING_DESC_F_WRITE as F_WRITE};

pub const MEM_SIZE: usize = 16 << 20;
pub const QSIZE: u16 = 256;
/// Not a virtio flag: marks the last descriptor of an avail entry even though NEXT is set
/// (to post loops). Stripped before the descriptor is written.
pub const LAST: u16 = 0x8000;
/// Ring areas: one 64 KiB window per queue.
pub const RING_BASE: u64 = 0;
pub const RING_STRIDE: u64 = 0x1_0000;
/// Data buffers are carved from here up.
pub const DATA_BASE: u64 = 0x10_0000;

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
    crate::testing::forced_dmas(4096, 4)
}

/// Guest memory, rings for `nqueues` queues (the driver's and the device's side of each),
/// and a bump allocator for data buffers.
pub struct Guest {
    pub mem: GuestMemoryMmap,
    pub queues: Vec<Queue>,
    vqs: Vec<DriverQueue>,
    next_desc: Vec<u16>,
    next_data: u64,
}

impl Guest {
    pub fn new(nqueues: usize) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        // Each part aligned to what the specification asks (16 / 2 / 4) as in a packed
        // window: the avail ring right after the table, the used ring right after it.
        let vqs: Vec<DriverQueue> = (0..nqueues)
            .map(|i| {
                let l = Layout::packed(RING_BASE + RING_STRIDE * i as u64, QSIZE, 4);
                DriverQueue::new(l, false).unwrap()
            })
            .collect();
        let queues = vqs
            .iter()
            .map(|v| device_queue(&v.layout(), QSIZE, false))
            .collect();
        Self {
            mem,
            queues,
            vqs,
            next_desc: vec![0; nqueues],
            next_data: DATA_BASE,
        }
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

    /// Posts raw descriptors `(addr, len, flags, next)`, with `next` relative to the first
    /// one; a descriptor without NEXT (or with [`LAST`]) ends a chain and the next one starts another. Returns
    /// the head indexes.
    pub fn post_raw(&mut self, q: usize, descs: &[(u64, u32, u16, u16)]) -> Vec<u16> {
        let base = self.next_desc[q];
        let vq = &mut self.vqs[q];
        let mut heads = vec![base];
        for (i, &(addr, len, f, n)) in descs.iter().enumerate() {
            let idx = (base + i as u16) % QSIZE;
            let d = Desc {
                addr,
                len,
                flags: f & !LAST,
                next: (base + n) % QSIZE,
            };
            vq.write_desc(&self.mem, idx, d).unwrap();
            if (f & F_NEXT == 0 || f & LAST != 0) && i + 1 < descs.len() {
                heads.push((base + i as u16 + 1) % QSIZE);
            }
        }
        for &h in &heads {
            vq.push(&self.mem, h).unwrap();
        }
        vq.publish(&self.mem).unwrap();
        self.next_desc[q] = base + descs.len() as u16;
        heads
    }

    /// Sets the avail index of queue `q` (hostile tests).
    pub fn set_avail_idx(&self, q: usize, idx: u16) {
        self.vqs[q].set_avail_idx(&self.mem, idx).unwrap();
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
        let vq = &self.vqs[q];
        (0..vq.used_idx(&self.mem).unwrap())
            .map(|i| {
                let u = vq.used_entry(&self.mem, i).unwrap();
                (u.id, u.len)
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
