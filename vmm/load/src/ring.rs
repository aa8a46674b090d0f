//! The driver's side of one split virtqueue (virtio 1.2, 2.7) in shared guest memory.
//!
//! The load generator is the guest driver here: it writes descriptors and the available ring,
//! and reads the used ring the backend writes. The backend is another process and is not
//! trusted: a used index that runs more than a queue size ahead of what was seen, or a used
//! entry naming a head the driver did not post, is a [`RingError`], never a panic or a loop.
//!
//! The layout of a queue is [`devices::virtio::ring`]'s, each part 4 KiB aligned here, so a
//! whole ring never shares a page with data buffers.

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};

use devices::virtio::ring;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Descriptor flag: the chain continues at `next`.
pub const DESC_F_NEXT: u16 = 1;
/// Descriptor flag: the device writes this buffer.
pub const DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer is a table of descriptors.
pub const DESC_F_INDIRECT: u16 = 4;
/// Used ring flag: the device does not want kicks (without EVENT_IDX).
pub const USED_F_NO_NOTIFY: u16 = 1;
/// Bytes of one descriptor.
pub const DESC_LEN: u64 = devices::virtio::chain::DESC_SIZE;

const PAGE: u64 = 4096;

/// Errors of the ring: what the backend did wrong, or guest memory that cannot be accessed.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
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
    /// Guest memory access failed (a layout bug: every ring address is inside the memfd).
    #[error("ring memory at {addr:#x}: {source}")]
    Memory {
        /// Guest address accessed.
        addr: u64,
        /// The access error.
        source: vm_memory::GuestMemoryError,
    },
}

/// Result of ring operations.
pub type Result<T> = std::result::Result<T, RingError>;

/// Where one queue's rings are in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// Queue size (a power of two).
    pub size: u16,
    /// Descriptor table.
    pub desc: u64,
    /// Available ring.
    pub avail: u64,
    /// Used ring.
    pub used: u64,
}

impl RingLayout {
    /// Bytes a queue of `size` occupies (page aligned).
    pub fn bytes(size: u16) -> u64 {
        let round = |b: u64| b.div_ceil(PAGE) * PAGE;
        round(ring::desc_table_bytes(size))
            + round(ring::avail_ring_bytes(size))
            + round(ring::used_ring_bytes(size))
    }

    /// The layout of a queue of `size` starting at `base` (page aligned).
    pub fn at(base: u64, size: u16) -> Self {
        let round = |b: u64| b.div_ceil(PAGE) * PAGE;
        let desc = base;
        let avail = desc + round(ring::desc_table_bytes(size));
        let used = avail + round(ring::avail_ring_bytes(size));
        Self {
            size,
            desc,
            avail,
            used,
        }
    }
}

pub use devices::virtio::ring::{Desc, Used};

/// The driver's view of one split virtqueue.
#[derive(Debug)]
pub struct SplitRing {
    mem: GuestMemoryMmap,
    layout: RingLayout,
    event_idx: bool,
    /// Shadow of the available index (what has been pushed, published or not).
    avail_idx: Wrapping<u16>,
    /// Available index the backend was last told about (by a kick, or by not needing one).
    published: Wrapping<u16>,
    /// Used entries consumed so far.
    last_used: Wrapping<u16>,
}

impl SplitRing {
    /// Zeroes the rings at `layout` and returns the driver's view of them.
    ///
    /// # Errors
    /// When the layout is outside `mem`.
    pub fn new(mem: GuestMemoryMmap, layout: RingLayout, event_idx: bool) -> Result<Self> {
        let zero = vec![0u8; usize::try_from(RingLayout::bytes(layout.size)).unwrap_or(0)];
        mem.write_slice(&zero, GuestAddress(layout.desc))
            .map_err(|source| RingError::Memory {
                addr: layout.desc,
                source,
            })?;
        Ok(Self {
            mem,
            layout,
            event_idx,
            avail_idx: Wrapping(0),
            published: Wrapping(0),
            last_used: Wrapping(0),
        })
    }

    /// The layout.
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    fn mem_err(addr: u64) -> impl FnOnce(vm_memory::GuestMemoryError) -> RingError {
        move |source| RingError::Memory { addr, source }
    }

    /// Writes descriptor `index` of the table at `table` (the ring's own table or an
    /// indirect one).
    ///
    /// # Errors
    /// When the table is outside guest memory.
    pub fn write_desc(&self, table: u64, index: u16, d: Desc) -> Result<()> {
        let at = table + u64::from(index) * DESC_LEN;
        self.mem
            .write_slice(&d.to_bytes(), GuestAddress(at))
            .map_err(Self::mem_err(at))
    }

    /// Puts `head` on the available ring; it becomes visible with [`SplitRing::publish`].
    ///
    /// # Errors
    /// On a memory error.
    pub fn push(&mut self, head: u16) -> Result<()> {
        let at = self.layout.avail + ring::avail_entry(self.layout.size, self.avail_idx.0);
        self.mem
            .write_obj(head, GuestAddress(at))
            .map_err(Self::mem_err(at))?;
        self.avail_idx += 1;
        Ok(())
    }

    /// Makes every pushed head visible to the backend; returns whether it must be kicked
    /// (virtio 1.2, 2.7.13: `avail_event` with EVENT_IDX, `VIRTQ_USED_F_NO_NOTIFY` without).
    ///
    /// # Errors
    /// On a memory error.
    pub fn publish(&mut self) -> Result<bool> {
        if self.avail_idx == self.published {
            return Ok(false);
        }
        let at = self.layout.avail + 2;
        // Release: descriptors and ring entries are visible before the index.
        self.mem
            .store(self.avail_idx.0, GuestAddress(at), Ordering::Release)
            .map_err(Self::mem_err(at))?;
        // The index store must be ordered before the read of avail_event / used flags, or
        // the backend may go to sleep on the old index while we skip the kick.
        fence(Ordering::SeqCst);
        let old = self.published;
        self.published = self.avail_idx;
        if self.event_idx {
            let at = self.layout.used + ring::avail_event(self.layout.size);
            let event: u16 = self
                .mem
                .load(GuestAddress(at), Ordering::Acquire)
                .map_err(Self::mem_err(at))?;
            // vring_need_event(event, new, old): new - event - 1 < new - old.
            Ok((self.avail_idx - Wrapping(event) - Wrapping(1)) < (self.avail_idx - old))
        } else {
            let at = self.layout.used;
            let flags: u16 = self
                .mem
                .load(GuestAddress(at), Ordering::Acquire)
                .map_err(Self::mem_err(at))?;
            Ok(flags & USED_F_NO_NOTIFY == 0)
        }
    }

    fn used_idx(&self) -> Result<Wrapping<u16>> {
        let at = self.layout.used + 2;
        let idx: u16 = self
            .mem
            .load(GuestAddress(at), Ordering::Acquire)
            .map_err(Self::mem_err(at))?;
        let ahead = Wrapping(idx) - self.last_used;
        if ahead.0 > self.layout.size {
            return Err(RingError::UsedRunaway {
                seen: self.last_used.0,
                idx,
                size: self.layout.size,
            });
        }
        Ok(Wrapping(idx))
    }

    /// The next used entry, if the backend has produced one.
    ///
    /// # Errors
    /// [`RingError::UsedRunaway`] when the backend's used index is not credible.
    pub fn next_used(&mut self) -> Result<Option<Used>> {
        if self.used_idx()? == self.last_used {
            return Ok(None);
        }
        let at = self.layout.used + ring::used_entry(self.layout.size, self.last_used.0);
        // The Acquire load of the index orders these reads after it.
        let id: u32 = self
            .mem
            .read_obj(GuestAddress(at))
            .map_err(Self::mem_err(at))?;
        let len: u32 = self
            .mem
            .read_obj(GuestAddress(at + 4))
            .map_err(Self::mem_err(at + 4))?;
        self.last_used += 1;
        Ok(Some(Used { id, len }))
    }

    /// Asks for an interrupt at the next completion (EVENT_IDX: `used_event` = what was
    /// seen; without it interrupts are never suppressed). Returns whether completions
    /// arrived meanwhile, in which case the caller must reap instead of sleeping.
    ///
    /// # Errors
    /// On a memory error or a runaway used index.
    pub fn arm(&mut self) -> Result<bool> {
        if self.event_idx {
            let at = self.layout.avail + ring::used_event(self.layout.size);
            self.mem
                .store(self.last_used.0, GuestAddress(at), Ordering::Release)
                .map_err(Self::mem_err(at))?;
            // used_event must be visible before we re-read the used index (2.7.10).
            fence(Ordering::SeqCst);
        }
        Ok(self.used_idx()? != self.last_used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn layout_is_page_aligned_and_disjoint() {
        let l = RingLayout::at(0x1000, 256);
        assert_eq!(l.desc, 0x1000);
        assert_eq!(l.avail, 0x2000);
        assert_eq!(l.used, 0x3000);
        assert_eq!(RingLayout::bytes(256), 0x1000 + 0x1000 + 0x1000);
        assert_eq!(RingLayout::bytes(1024), 0x4000 + 0x1000 + 0x3000);
    }

    #[test]
    fn publish_honours_avail_event_and_no_notify() {
        let m = mem();
        let l = RingLayout::at(0, 8);
        let mut r = SplitRing::new(m.clone(), l, true).unwrap();
        // avail_event 0: the first publish (0 -> 1) must kick.
        r.push(0).unwrap();
        assert!(r.publish().unwrap());
        // The backend says "kick me when idx passes 5": 1 -> 2 must not kick.
        m.write_obj(5u16, GuestAddress(l.used + 4 + 8 * 8)).unwrap();
        r.push(1).unwrap();
        assert!(!r.publish().unwrap());
        // 2 -> 7 crosses 5+1.
        for h in 2..7 {
            r.push(h).unwrap();
        }
        assert!(r.publish().unwrap());
        // Nothing new: no kick.
        assert!(!r.publish().unwrap());

        let mut r = SplitRing::new(m.clone(), l, false).unwrap();
        m.write_obj(USED_F_NO_NOTIFY, GuestAddress(l.used)).unwrap();
        r.push(0).unwrap();
        assert!(!r.publish().unwrap());
        m.write_obj(0u16, GuestAddress(l.used)).unwrap();
        r.push(1).unwrap();
        assert!(r.publish().unwrap());
    }

    #[test]
    fn used_entries_are_read_in_order_and_a_runaway_index_is_refused() {
        let m = mem();
        let l = RingLayout::at(0, 4);
        let mut r = SplitRing::new(m.clone(), l, true).unwrap();
        assert_eq!(r.next_used().unwrap(), None);
        for (i, id) in [3u32, 1].iter().enumerate() {
            m.write_obj(*id, GuestAddress(l.used + 4 + 8 * i as u64))
                .unwrap();
            m.write_obj(10 + *id, GuestAddress(l.used + 8 + 8 * i as u64))
                .unwrap();
        }
        m.write_obj(2u16, GuestAddress(l.used + 2)).unwrap();
        assert_eq!(r.next_used().unwrap(), Some(Used { id: 3, len: 13 }));
        assert!(!r.arm().is_ok_and(|pending| !pending));
        assert_eq!(r.next_used().unwrap(), Some(Used { id: 1, len: 11 }));
        assert!(!r.arm().unwrap());
        // used_event now says "interrupt after 2".
        let ue: u16 = m.read_obj(GuestAddress(l.avail + 4 + 2 * 4)).unwrap();
        assert_eq!(ue, 2);
        m.write_obj(7u16, GuestAddress(l.used + 2)).unwrap();
        assert!(matches!(
            r.next_used(),
            Err(RingError::UsedRunaway {
                seen: 2,
                idx: 7,
                size: 4
            })
        ));
    }
}
