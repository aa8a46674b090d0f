//! The driver side of a split virtqueue (virtio 1.2, 2.7): what a guest driver writes (the
//! descriptor table, indirect tables, the available ring and `used_event`) and reads (the used
//! ring and `avail_event`). The one driver in the tree: the device tests
//! ([`crate::testing`]), the vhost-user tests and `bouncevm-load` all drive queues with it.
//!
//! ```text
//! desc  : size * 16 bytes     { addr: u64, len: u32, flags: u16, next: u16 }
//! avail : 4 + 2 * size + 2    { flags: u16, idx: u16, ring: [u16; size], used_event: u16 }
//! used  : 4 + 8 * size + 2    { flags: u16, idx: u16, ring: [{ id: u32, len: u32 }; size], avail_event: u16 }
//! ```
//!
//! A [`DriverQueue`] holds what the driver knows of one queue: its [`Layout`], the index it
//! has pushed to, the one the device was last told about and the used entries consumed, and
//! the free descriptors. Every method that touches the rings takes the guest memory, as
//! `virtio_queue::Queue` does on the device side.
//!
//! Building chains:
//! - [`DriverQueue::add_chain`] and [`DriverQueue::add_indirect`] pick free descriptors, and
//!   [`DriverQueue::next_used`] frees them when the chain comes back;
//! - [`DriverQueue::write_chain`] and [`DriverQueue::write_indirect`] write at indexes the
//!   caller chose (a load generator that gives each request slot fixed descriptors);
//! - [`DriverQueue::write_desc`] writes any descriptor as is, and
//!   [`DriverQueue::set_avail_idx`] any available index: the escape hatches hostile tests
//!   use to post loops, bad indexes or a runaway ring.
//!
//! Then [`DriverQueue::push`] puts heads on the available ring and [`DriverQueue::publish`]
//! makes them visible and says whether the device must be kicked (EVENT_IDX or
//! `VRING_USED_F_NO_NOTIFY`); [`DriverQueue::next_used`] takes completions in order and
//! [`DriverQueue::arm`] asks for an interrupt at the next one.
//!
//! The device may be another process and is not trusted: a used index that runs more than a
//! queue size ahead of what was consumed is [`DriverError::UsedRunaway`], a used entry naming a
//! head the driver did not post is returned as is (the caller decides), and nothing here
//! panics or loops on what the device wrote. Nothing allocates after [`DriverQueue::new`].

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};

use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryError};

use super::chain::DESC_SIZE;
use super::spec::{
    VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    VRING_USED_F_NO_NOTIFY,
};

/// Errors of the driver side: a layout that cannot be, a chain that does not fit, guest memory
/// that cannot be accessed, or a device that broke the ring.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A queue size that is not a power of two in `1..=32768`.
    #[error("queue size {0} is not a power of two of at most 32768")]
    BadSize(u16),
    /// A ring whose end is past the end of the address space.
    #[error("ring at {addr:#x} of {len} bytes wraps the address space")]
    Wraps {
        /// Start of the ring.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A chain with no buffer.
    #[error("a chain needs at least one buffer")]
    EmptyChain,
    /// More descriptors asked for than are free.
    #[error("a chain of {want} descriptors, {free} free")]
    NoDescriptors {
        /// Descriptors the chain needs.
        want: usize,
        /// Descriptors free.
        free: usize,
    },
    /// Descriptor indexes past the end of the table (or of `u16`).
    #[error("descriptors {first}+{len} are past the table of {size}")]
    OutOfTable {
        /// First index.
        first: u16,
        /// Descriptors.
        len: usize,
        /// Entries in the table.
        size: u32,
    },
    /// The used index moved further than the queue size since it was last read.
    #[error("backend moved the used index from {seen} to {idx}, more than the queue size {size}")]
    UsedRunaway {
        /// Used index last seen.
        seen: u16,
        /// Used index read now.
        idx: u16,
        /// Queue size.
        size: u16,
    },
    /// Guest memory access failed.
    #[error("ring memory at {addr:#x}: {source}")]
    Memory {
        /// Guest address accessed.
        addr: u64,
        /// The access error.
        source: GuestMemoryError,
    },
}

/// Result of driver operations.
pub type Result<T> = std::result::Result<T, DriverError>;

fn mem_err(addr: u64) -> impl FnOnce(GuestMemoryError) -> DriverError {
    move |source| DriverError::Memory { addr, source }
}

/// A descriptor as the driver writes it (no rule is applied: hostile tests write loops, bad
/// indexes and nested tables with it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    /// Buffer address (guest physical).
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// `VRING_DESC_F_*` flags.
    pub flags: u16,
    /// Next descriptor index in the same table.
    pub next: u16,
}

/// A used-ring entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    /// The head of the completed chain, as the device wrote it (not validated here).
    pub id: u32,
    /// Bytes the device says it wrote.
    pub len: u32,
}

/// One buffer of a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    /// Guest address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// The device writes it (`VRING_DESC_F_WRITE`).
    pub writable: bool,
}

impl Buf {
    /// A device-readable buffer.
    pub fn ro(addr: u64, len: u32) -> Self {
        Self {
            addr,
            len,
            writable: false,
        }
    }

    /// A device-writable buffer.
    pub fn wo(addr: u64, len: u32) -> Self {
        Self {
            addr,
            len,
            writable: true,
        }
    }
}

/// Writes descriptor `index` of the table at `table` (a queue's table or an indirect one).
///
/// # Errors
/// When the descriptor is outside guest memory.
pub fn write_table_desc<M: GuestMemory>(mem: &M, table: u64, index: u16, d: Desc) -> Result<()> {
    let at = u64::from(index)
        .checked_mul(DESC_SIZE)
        .and_then(|o| table.checked_add(o))
        .ok_or(DriverError::Wraps {
            addr: table,
            len: (u64::from(index) + 1) * DESC_SIZE,
        })?;
    let raw = RawDescriptor::from(Descriptor::new(d.addr, d.len, d.flags, d.next));
    mem.write_obj(raw, GuestAddress(at)).map_err(mem_err(at))
}

/// Writes `bufs` as one chain into the table at `table`, at indexes `first`, `first + 1`, ...
/// (`VRING_DESC_F_NEXT` on all but the last, `VRING_DESC_F_WRITE` on the writable ones).
///
/// # Errors
/// [`DriverError::EmptyChain`], [`DriverError::OutOfTable`] when the indexes pass `table_len`,
/// or a memory error.
pub fn write_table_chain<M: GuestMemory>(
    mem: &M,
    table: u64,
    table_len: u32,
    first: u16,
    bufs: &[Buf],
) -> Result<()> {
    let Some(last) = bufs.len().checked_sub(1) else {
        return Err(DriverError::EmptyChain);
    };
    let fits = u32::try_from(bufs.len())
        .ok()
        .and_then(|n| n.checked_add(u32::from(first)))
        .is_some_and(|end| end <= table_len);
    if !fits {
        return Err(DriverError::OutOfTable {
            first,
            len: bufs.len(),
            size: table_len,
        });
    }
    let mut index = first;
    for (i, b) in bufs.iter().enumerate() {
        // first + bufs.len() <= table_len <= 65536: index + 1 overflows only past the last.
        let next = index.wrapping_add(1);
        let more = i != last;
        write_table_desc(mem, table, index, chain_desc(b, more, next))?;
        index = next;
    }
    Ok(())
}

/// The descriptor of buffer `b` in a chain, linked to `next` when `more` follow.
fn chain_desc(b: &Buf, more: bool, next: u16) -> Desc {
    let mut flags = if b.writable { VRING_DESC_F_WRITE } else { 0 };
    if more {
        flags |= VRING_DESC_F_NEXT;
    }
    Desc {
        addr: b.addr,
        len: b.len,
        flags,
        next: if more { next } else { 0 },
    }
}

/// The descriptor pointing to an indirect table of `n` descriptors at `table`.
fn indirect_desc(table: u64, n: usize) -> Result<Desc> {
    let len = u64::try_from(n)
        .ok()
        .and_then(|n| n.checked_mul(DESC_SIZE))
        .and_then(|l| u32::try_from(l).ok())
        .ok_or(DriverError::OutOfTable {
            first: 0,
            len: n,
            size: u32::from(u16::MAX) + 1,
        })?;
    Ok(Desc {
        addr: table,
        len,
        flags: VRING_DESC_F_INDIRECT,
        next: 0,
    })
}

/// Where one queue's three parts are in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Queue size (a power of two).
    pub size: u16,
    /// Descriptor table.
    pub desc: u64,
    /// Available ring.
    pub avail: u64,
    /// Used ring.
    pub used: u64,
}

impl Layout {
    /// Bytes of the descriptor table of a queue of `size`.
    pub fn desc_table_bytes(size: u16) -> u64 {
        u64::from(size) * DESC_SIZE
    }

    /// Bytes of the available ring of a queue of `size` (with `used_event`).
    pub fn avail_ring_bytes(size: u16) -> u64 {
        6 + 2 * u64::from(size)
    }

    /// Bytes of the used ring of a queue of `size` (with `avail_event`).
    pub fn used_ring_bytes(size: u16) -> u64 {
        6 + 8 * u64::from(size)
    }

    /// The three parts one after the other from `base`, each starting at a multiple of `align`
    /// (a power of two, at least the parts' own 16/2/4 alignment when `base` is aligned).
    pub fn packed(base: u64, size: u16, align: u64) -> Self {
        let round = |b: u64| b.next_multiple_of(align);
        let desc = base;
        let avail = desc + round(Self::desc_table_bytes(size));
        let used = avail + round(Self::avail_ring_bytes(size));
        Self {
            size,
            desc,
            avail,
            used,
        }
    }

    /// Bytes [`Layout::packed`] occupies, the used ring rounded up to `align` too.
    pub fn packed_bytes(size: u16, align: u64) -> u64 {
        let round = |b: u64| b.next_multiple_of(align);
        round(Self::desc_table_bytes(size))
            + round(Self::avail_ring_bytes(size))
            + round(Self::used_ring_bytes(size))
    }

    /// Checks the size and that no part wraps the address space, so every offset inside a
    /// part is a plain addition.
    fn check(&self) -> Result<()> {
        if !self.size.is_power_of_two() || self.size > 1 << 15 {
            return Err(DriverError::BadSize(self.size));
        }
        for (addr, len) in [
            (self.desc, Self::desc_table_bytes(self.size)),
            (self.avail, Self::avail_ring_bytes(self.size)),
            (self.used, Self::used_ring_bytes(self.size)),
        ] {
            if addr.checked_add(len).is_none() {
                return Err(DriverError::Wraps { addr, len });
            }
        }
        Ok(())
    }

    /// The available ring's entry for free-running index `idx`.
    fn avail_entry(&self, idx: u16) -> u64 {
        self.avail + 4 + 2 * u64::from(idx % self.size)
    }

    /// The used ring's entry for free-running index `idx`.
    fn used_entry(&self, idx: u16) -> u64 {
        self.used + 4 + 8 * u64::from(idx % self.size)
    }

    /// `used_event`, the last word of the available ring.
    fn used_event(&self) -> u64 {
        self.avail + 4 + 2 * u64::from(self.size)
    }

    /// `avail_event`, the last word of the used ring.
    fn avail_event(&self) -> u64 {
        self.used + 4 + 8 * u64::from(self.size)
    }
}

/// The driver's view of one split virtqueue.
#[derive(Debug)]
pub struct DriverQueue {
    layout: Layout,
    event_idx: bool,
    /// Shadow of the available index (what has been pushed, published or not).
    avail_idx: Wrapping<u16>,
    /// Available index the device was last told about.
    published: Wrapping<u16>,
    /// Used entries consumed so far.
    last_used: Wrapping<u16>,
    /// Free descriptors, taken from the end.
    free: Vec<u16>,
    /// Per descriptor index: the next descriptor of the chain it was added in.
    link: Vec<u16>,
    /// Per head: descriptors of the chain `add_chain`/`add_indirect` put there (0: none).
    chain_len: Vec<u16>,
}

impl DriverQueue {
    /// The driver's view of a queue at `layout`, nothing posted; `event_idx` when
    /// VIRTIO_RING_F_EVENT_IDX is negotiated. The rings are not touched (see
    /// [`DriverQueue::clear_rings`]).
    ///
    /// # Errors
    /// A size that is not a power of two, or a part that wraps the address space.
    pub fn new(layout: Layout, event_idx: bool) -> Result<Self> {
        layout.check()?;
        let n = usize::from(layout.size);
        Ok(Self {
            layout,
            event_idx,
            avail_idx: Wrapping(0),
            published: Wrapping(0),
            last_used: Wrapping(0),
            free: (0..layout.size).rev().collect(),
            link: vec![0; n],
            chain_len: vec![0; n],
        })
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Zeroes the three parts of the queue (a fresh queue in memory a previous user wrote).
    ///
    /// # Errors
    /// When a part is outside guest memory.
    pub fn clear_rings<M: GuestMemory>(&self, mem: &M) -> Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let l = &self.layout;
        for (addr, len) in [
            (l.desc, Layout::desc_table_bytes(l.size)),
            (l.avail, Layout::avail_ring_bytes(l.size)),
            (l.used, Layout::used_ring_bytes(l.size)),
        ] {
            // The layout was checked: addr + len does not wrap.
            let end = addr + len;
            let mut at = addr;
            while at < end {
                let n = usize::try_from(end - at).map_or(ZEROS.len(), |n| n.min(ZEROS.len()));
                mem.write_slice(&ZEROS[..n], GuestAddress(at))
                    .map_err(mem_err(at))?;
                // n <= 4096.
                at += n as u64;
            }
        }
        Ok(())
    }

    /// Free descriptors left for [`DriverQueue::add_chain`].
    pub fn free_descs(&self) -> usize {
        self.free.len()
    }

    /// Writes descriptor `index` of the queue's table as is (no bookkeeping).
    ///
    /// # Errors
    /// When the descriptor is outside guest memory.
    pub fn write_desc<M: GuestMemory>(&self, mem: &M, index: u16, d: Desc) -> Result<()> {
        write_table_desc(mem, self.layout.desc, index, d)
    }

    /// Writes `bufs` as one chain at descriptors `first..first + bufs.len()` of the queue's
    /// table; `first` is its head (not yet pushed). No bookkeeping: the caller owns those
    /// descriptors.
    ///
    /// # Errors
    /// An empty chain, indexes past the table, or a memory error.
    pub fn write_chain<M: GuestMemory>(&self, mem: &M, first: u16, bufs: &[Buf]) -> Result<()> {
        let size = u32::from(self.layout.size);
        write_table_chain(mem, self.layout.desc, size, first, bufs)
    }

    /// Writes `bufs` as an indirect table at `table` and descriptor `head` of the queue's
    /// table pointing to it; `head` is the chain's head (not yet pushed). No bookkeeping.
    ///
    /// # Errors
    /// An empty or too long chain, or a memory error.
    pub fn write_indirect<M: GuestMemory>(
        &self,
        mem: &M,
        head: u16,
        table: u64,
        bufs: &[Buf],
    ) -> Result<()> {
        write_table_chain(mem, table, u32::from(u16::MAX) + 1, 0, bufs)?;
        self.write_desc(mem, head, indirect_desc(table, bufs.len())?)
    }

    /// Writes `bufs` as a chain of free descriptors and returns its head (not yet pushed).
    /// The descriptors are free again once [`DriverQueue::next_used`] returns the head.
    ///
    /// # Errors
    /// An empty chain, fewer free descriptors than buffers, or a memory error (nothing is
    /// taken).
    pub fn add_chain<M: GuestMemory>(&mut self, mem: &M, bufs: &[Buf]) -> Result<u16> {
        if bufs.is_empty() {
            return Err(DriverError::EmptyChain);
        }
        let n = self.take(bufs.len())?;
        let head = self.free[self.free.len() - 1];
        // The chain is the last `n` free entries, from the end: head first.
        let mut at = head;
        for (i, b) in bufs.iter().enumerate() {
            let more = i + 1 < bufs.len();
            let next = if more {
                self.free[self.free.len() - 2 - i]
            } else {
                0
            };
            self.link[usize::from(at)] = next;
            self.write_desc(mem, at, chain_desc(b, more, next))?;
            at = next;
        }
        let keep = self.free.len() - bufs.len();
        self.free.truncate(keep);
        self.chain_len[usize::from(head)] = n;
        Ok(head)
    }

    /// Writes `bufs` as an indirect table at `table` (guest memory the caller set aside for
    /// it) and one free descriptor pointing to it; returns the head (not yet pushed).
    ///
    /// # Errors
    /// An empty or too long chain, no free descriptor, or a memory error.
    pub fn add_indirect<M: GuestMemory>(
        &mut self,
        mem: &M,
        table: u64,
        bufs: &[Buf],
    ) -> Result<u16> {
        let d = indirect_desc(table, bufs.len())?;
        self.take(1)?;
        write_table_chain(mem, table, u32::from(u16::MAX) + 1, 0, bufs)?;
        let head = self.free[self.free.len() - 1];
        self.write_desc(mem, head, d)?;
        self.free.pop();
        self.chain_len[usize::from(head)] = 1;
        Ok(head)
    }

    /// Checks that `n` descriptors are free; returns `n` as a chain length.
    fn take(&self, n: usize) -> Result<u16> {
        let free = self.free.len();
        u16::try_from(n)
            .ok()
            .filter(|_| n <= free)
            .ok_or(DriverError::NoDescriptors { want: n, free })
    }

    /// Returns the descriptors of the chain at `head` (if `add_chain` or `add_indirect` put one
    /// there and it is not back yet) to the free list, in chain order.
    fn release(&mut self, head: u32) {
        let Some(h) = u16::try_from(head).ok().filter(|&h| h < self.layout.size) else {
            return;
        };
        let n = std::mem::take(&mut self.chain_len[usize::from(h)]);
        let mut at = h;
        for _ in 0..n {
            self.free.push(at);
            at = self.link[usize::from(at)];
        }
    }

    /// Puts `head` on the available ring; it becomes visible with [`DriverQueue::publish`].
    ///
    /// # Errors
    /// On a memory error.
    pub fn push<M: GuestMemory>(&mut self, mem: &M, head: u16) -> Result<()> {
        let at = self.layout.avail_entry(self.avail_idx.0);
        mem.write_obj(head.to_le(), GuestAddress(at))
            .map_err(mem_err(at))?;
        self.avail_idx += 1;
        Ok(())
    }

    /// Makes every pushed head visible to the device; returns whether it must be kicked
    /// (virtio 1.2, 2.7.13: `avail_event` with EVENT_IDX, `VRING_USED_F_NO_NOTIFY` without).
    ///
    /// # Errors
    /// On a memory error.
    pub fn publish<M: GuestMemory>(&mut self, mem: &M) -> Result<bool> {
        if self.avail_idx == self.published {
            return Ok(false);
        }
        let at = self.layout.avail + 2;
        // Release: descriptors and ring entries are visible before the index.
        mem.store(
            self.avail_idx.0.to_le(),
            GuestAddress(at),
            Ordering::Release,
        )
        .map_err(mem_err(at))?;
        // The index store must be ordered before the read of avail_event / used flags, or
        // the device may go to sleep on the old index while we skip the kick.
        fence(Ordering::SeqCst);
        let old = self.published;
        self.published = self.avail_idx;
        if self.event_idx {
            let event = Wrapping(self.avail_event(mem)?);
            // vring_need_event(event, new, old): new - event - 1 < new - old.
            Ok((self.avail_idx - event - Wrapping(1)) < (self.avail_idx - old))
        } else {
            let at = self.layout.used;
            let flags: u16 = mem
                .load(GuestAddress(at), Ordering::Acquire)
                .map_err(mem_err(at))?;
            Ok(u16::from_le(flags) & VRING_USED_F_NO_NOTIFY == 0)
        }
    }

    /// The driver's shadow of the available index (pushed heads, published or not).
    pub fn avail_idx(&self) -> u16 {
        self.avail_idx.0
    }

    /// Writes the available index as is, whatever was pushed (hostile tests: a runaway or
    /// stale index). The shadow does not move.
    ///
    /// # Errors
    /// On a memory error.
    pub fn set_avail_idx<M: GuestMemory>(&self, mem: &M, idx: u16) -> Result<()> {
        let at = self.layout.avail + 2;
        mem.store(idx.to_le(), GuestAddress(at), Ordering::Release)
            .map_err(mem_err(at))
    }

    /// Sets `used_event`: with EVENT_IDX the device interrupts when its used index passes
    /// this value.
    ///
    /// # Errors
    /// On a memory error.
    pub fn set_used_event<M: GuestMemory>(&self, mem: &M, v: u16) -> Result<()> {
        let at = self.layout.used_event();
        mem.store(v.to_le(), GuestAddress(at), Ordering::Release)
            .map_err(mem_err(at))
    }

    /// Sets or clears `VRING_AVAIL_F_NO_INTERRUPT` (interrupt suppression without EVENT_IDX).
    ///
    /// # Errors
    /// On a memory error.
    pub fn set_no_interrupt<M: GuestMemory>(&self, mem: &M, on: bool) -> Result<()> {
        let f = if on { VRING_AVAIL_F_NO_INTERRUPT } else { 0 };
        let at = self.layout.avail;
        mem.store(f.to_le(), GuestAddress(at), Ordering::Release)
            .map_err(mem_err(at))
    }

    /// `avail_event`: with EVENT_IDX the driver kicks when its available index passes it.
    ///
    /// # Errors
    /// On a memory error.
    pub fn avail_event<M: GuestMemory>(&self, mem: &M) -> Result<u16> {
        let at = self.layout.avail_event();
        let v: u16 = mem
            .load(GuestAddress(at), Ordering::Acquire)
            .map_err(mem_err(at))?;
        Ok(u16::from_le(v))
    }

    /// The device's used index as it is in memory.
    ///
    /// # Errors
    /// On a memory error.
    pub fn used_idx<M: GuestMemory>(&self, mem: &M) -> Result<u16> {
        let at = self.layout.used + 2;
        let v: u16 = mem
            .load(GuestAddress(at), Ordering::Acquire)
            .map_err(mem_err(at))?;
        Ok(u16::from_le(v))
    }

    /// The used entry at free-running index `idx`, whatever the used index says.
    ///
    /// # Errors
    /// On a memory error.
    pub fn used_entry<M: GuestMemory>(&self, mem: &M, idx: u16) -> Result<Used> {
        let at = self.layout.used_entry(idx);
        let e: [u8; 8] = mem.read_obj(GuestAddress(at)).map_err(mem_err(at))?;
        let [a, b, c, d, e, f, g, h] = e;
        Ok(Used {
            id: u32::from_le_bytes([a, b, c, d]),
            len: u32::from_le_bytes([e, f, g, h]),
        })
    }

    /// Used entries consumed so far (the free-running index of the next one).
    pub fn last_used(&self) -> u16 {
        self.last_used.0
    }

    fn checked_used_idx<M: GuestMemory>(&self, mem: &M) -> Result<Wrapping<u16>> {
        let idx = self.used_idx(mem)?;
        if (Wrapping(idx) - self.last_used).0 > self.layout.size {
            return Err(DriverError::UsedRunaway {
                seen: self.last_used.0,
                idx,
                size: self.layout.size,
            });
        }
        Ok(Wrapping(idx))
    }

    /// The next used entry, if the device has produced one. The descriptors of a chain
    /// [`DriverQueue::add_chain`] or [`DriverQueue::add_indirect`] put at its head are free
    /// again.
    ///
    /// # Errors
    /// [`DriverError::UsedRunaway`] when the used index is not credible, or a memory error.
    pub fn next_used<M: GuestMemory>(&mut self, mem: &M) -> Result<Option<Used>> {
        if self.checked_used_idx(mem)? == self.last_used {
            return Ok(None);
        }
        // The Acquire load of the index orders this read after it.
        let u = self.used_entry(mem, self.last_used.0)?;
        self.last_used += 1;
        self.release(u.id);
        Ok(Some(u))
    }

    /// Asks for an interrupt at the next completion (EVENT_IDX: `used_event` = the entries
    /// consumed; without it interrupts are never suppressed here). Returns whether completions
    /// arrived meanwhile, in which case the caller must reap instead of sleeping.
    ///
    /// # Errors
    /// On a memory error or a runaway used index.
    pub fn arm<M: GuestMemory>(&mut self, mem: &M) -> Result<bool> {
        if self.event_idx {
            self.set_used_event(mem, self.last_used.0)?;
            // used_event must be visible before the used index is read again (2.7.10).
            fence(Ordering::SeqCst);
        }
        Ok(self.checked_used_idx(mem)? != self.last_used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn desc_at(m: &GuestMemoryMmap, table: u64, i: u64) -> Desc {
        let b: [u8; 16] = m.read_obj(GuestAddress(table + 16 * i)).unwrap();
        Desc {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes(b[12..14].try_into().unwrap()),
            next: u16::from_le_bytes(b[14..16].try_into().unwrap()),
        }
    }

    #[test]
    fn layout_of_a_queue_of_eight() {
        assert_eq!(
            (
                Layout::desc_table_bytes(8),
                Layout::avail_ring_bytes(8),
                Layout::used_ring_bytes(8)
            ),
            (128, 22, 70)
        );
        let l = Layout::packed(0, 8, 2);
        assert_eq!((l.desc, l.avail, l.used), (0, 128, 150));
        assert_eq!((l.avail_entry(9), l.used_entry(9)), (128 + 6, 150 + 12));
        assert_eq!((l.used_event(), l.avail_event()), (128 + 20, 150 + 68));
    }

    #[test]
    fn packed_layouts_are_aligned_and_disjoint() {
        let l = Layout::packed(0x1000, 256, 4096);
        assert_eq!((l.desc, l.avail, l.used), (0x1000, 0x2000, 0x3000));
        assert_eq!(Layout::packed_bytes(256, 4096), 0x3000);
        assert_eq!(Layout::packed_bytes(1024, 4096), 0x4000 + 0x1000 + 0x3000);
    }

    #[test]
    fn bad_layouts_are_refused() {
        for size in [0, 3, 100] {
            let l = Layout::packed(0, size, 16);
            assert!(matches!(
                DriverQueue::new(l, false),
                Err(DriverError::BadSize(_))
            ));
        }
        let l = Layout {
            size: 16,
            desc: u64::MAX - 100,
            avail: 0,
            used: 0x1000,
        };
        assert!(matches!(
            DriverQueue::new(l, false),
            Err(DriverError::Wraps { .. })
        ));
    }

    #[test]
    fn chains_are_linked_and_their_descriptors_come_back_in_order() {
        let m = mem();
        let l = Layout::packed(0, 4, 16);
        let mut q = DriverQueue::new(l, false).unwrap();
        let bufs = [
            Buf::ro(0x8000, 16),
            Buf::wo(0x9000, 512),
            Buf::wo(0xa000, 1),
        ];
        let head = q.add_chain(&m, &bufs).unwrap();
        assert_eq!(head, 0);
        assert_eq!(q.free_descs(), 1);
        assert_eq!(
            [0, 1, 2].map(|i| desc_at(&m, l.desc, i)),
            [
                Desc {
                    addr: 0x8000,
                    len: 16,
                    flags: VRING_DESC_F_NEXT,
                    next: 1
                },
                Desc {
                    addr: 0x9000,
                    len: 512,
                    flags: VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
                    next: 2
                },
                Desc {
                    addr: 0xa000,
                    len: 1,
                    flags: VRING_DESC_F_WRITE,
                    next: 0
                },
            ]
        );
        assert!(matches!(
            q.add_chain(&m, &bufs),
            Err(DriverError::NoDescriptors { want: 3, free: 1 })
        ));
        assert!(matches!(q.add_chain(&m, &[]), Err(DriverError::EmptyChain)));
        q.push(&m, head).unwrap();
        q.publish(&m).unwrap();
        // The device completes the chain.
        m.write_obj(0u32, GuestAddress(l.used + 4)).unwrap();
        m.write_obj(1u16, GuestAddress(l.used + 2)).unwrap();
        assert_eq!(q.next_used(&m).unwrap(), Some(Used { id: 0, len: 0 }));
        assert_eq!(q.free_descs(), 4);
        // A head returned twice frees nothing the second time.
        m.write_obj(0u32, GuestAddress(l.used + 12)).unwrap();
        m.write_obj(2u16, GuestAddress(l.used + 2)).unwrap();
        assert_eq!(q.next_used(&m).unwrap(), Some(Used { id: 0, len: 0 }));
        assert_eq!(q.free_descs(), 4);
        // Freed descriptors are taken again last-freed first.
        assert_eq!(q.add_chain(&m, &bufs[..1]).unwrap(), 2);
    }

    #[test]
    fn explicit_and_indirect_chains() {
        let m = mem();
        let l = Layout::packed(0, 8, 16);
        let q = DriverQueue::new(l, false).unwrap();
        let bufs = [Buf::ro(0x8000, 16), Buf::wo(0xa000, 1)];
        q.write_chain(&m, 6, &bufs).unwrap();
        assert_eq!(desc_at(&m, l.desc, 6).next, 7);
        assert!(matches!(
            q.write_chain(&m, 7, &bufs),
            Err(DriverError::OutOfTable {
                first: 7,
                len: 2,
                size: 8
            })
        ));
        q.write_indirect(&m, 3, 0x4000, &bufs).unwrap();
        assert_eq!(
            desc_at(&m, l.desc, 3),
            Desc {
                addr: 0x4000,
                len: 32,
                flags: VRING_DESC_F_INDIRECT,
                next: 0
            }
        );
        assert_eq!(desc_at(&m, 0x4000, 0).next, 1);
        assert_eq!(desc_at(&m, 0x4000, 1).flags, VRING_DESC_F_WRITE);
    }

    #[test]
    fn publish_honours_avail_event_and_no_notify() {
        let m = mem();
        let l = Layout::packed(0, 8, 4096);
        let mut r = DriverQueue::new(l, true).unwrap();
        // avail_event 0: the first publish (0 -> 1) must kick.
        r.push(&m, 0).unwrap();
        assert!(r.publish(&m).unwrap());
        // The device says "kick me when idx passes 5": 1 -> 2 must not kick.
        m.write_obj(5u16, GuestAddress(l.used + 4 + 8 * 8)).unwrap();
        r.push(&m, 1).unwrap();
        assert!(!r.publish(&m).unwrap());
        // 2 -> 7 crosses 5+1.
        for h in 2..7 {
            r.push(&m, h).unwrap();
        }
        assert!(r.publish(&m).unwrap());
        // Nothing new: no kick.
        assert!(!r.publish(&m).unwrap());

        let mut r = DriverQueue::new(l, false).unwrap();
        m.write_obj(VRING_USED_F_NO_NOTIFY, GuestAddress(l.used))
            .unwrap();
        r.push(&m, 0).unwrap();
        assert!(!r.publish(&m).unwrap());
        m.write_obj(0u16, GuestAddress(l.used)).unwrap();
        r.push(&m, 1).unwrap();
        assert!(r.publish(&m).unwrap());
    }

    #[test]
    fn used_entries_are_read_in_order_and_a_runaway_index_is_refused() {
        let m = mem();
        let l = Layout::packed(0, 4, 4096);
        let mut r = DriverQueue::new(l, true).unwrap();
        assert_eq!(r.next_used(&m).unwrap(), None);
        for (i, id) in [3u32, 1].iter().enumerate() {
            m.write_obj(*id, GuestAddress(l.used + 4 + 8 * i as u64))
                .unwrap();
            m.write_obj(10 + *id, GuestAddress(l.used + 8 + 8 * i as u64))
                .unwrap();
        }
        m.write_obj(2u16, GuestAddress(l.used + 2)).unwrap();
        assert_eq!(r.next_used(&m).unwrap(), Some(Used { id: 3, len: 13 }));
        assert!(!r.arm(&m).is_ok_and(|pending| !pending));
        assert_eq!(r.next_used(&m).unwrap(), Some(Used { id: 1, len: 11 }));
        assert!(!r.arm(&m).unwrap());
        // used_event now says "interrupt after 2".
        let ue: u16 = m.read_obj(GuestAddress(l.avail + 4 + 2 * 4)).unwrap();
        assert_eq!(ue, 2);
        m.write_obj(7u16, GuestAddress(l.used + 2)).unwrap();
        assert!(matches!(
            r.next_used(&m),
            Err(DriverError::UsedRunaway {
                seen: 2,
                idx: 7,
                size: 4
            })
        ));
    }

    #[test]
    fn rings_are_cleared_and_raw_indexes_written_as_is() {
        let m = mem();
        let l = Layout::packed(0x1000, 16, 4096);
        m.write_slice(&[0xee; 0x3000], GuestAddress(0x1000))
            .unwrap();
        let mut q = DriverQueue::new(l, true).unwrap();
        q.clear_rings(&m).unwrap();
        assert_eq!(q.used_idx(&m).unwrap(), 0);
        assert_eq!(q.avail_event(&m).unwrap(), 0);
        q.set_avail_idx(&m, 40).unwrap();
        let idx: u16 = m.read_obj(GuestAddress(l.avail + 2)).unwrap();
        assert_eq!((idx, q.avail_idx()), (40, 0));
        q.set_no_interrupt(&m, true).unwrap();
        let flags: u16 = m.read_obj(GuestAddress(l.avail)).unwrap();
        assert_eq!(flags, VRING_AVAIL_F_NO_INTERRUPT);
        q.push(&m, 5).unwrap();
        let entry: u16 = m.read_obj(GuestAddress(l.avail + 4)).unwrap();
        assert_eq!(entry, 5);
        let past = Layout::packed(1 << 20, 16, 16);
        let q = DriverQueue::new(past, false).unwrap();
        assert!(matches!(q.clear_rings(&m), Err(DriverError::Memory { .. })));
    }
}
