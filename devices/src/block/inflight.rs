//! Bookkeeping of a queue's requests in flight: their table, the guest memory they point
//! into, and the timer that retries a queue waiting for bounce slots.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use vm_memory::GuestMemory;
use vmm_sys_util::timerfd::TimerFd;

use crate::virtio::memlayout::MemLayout;

/// A table of in-flight entries indexed by small integers (the engine tags). A released
/// index is reused by the next entry, so the table grows only to the most entries ever held
/// at once.
#[derive(Debug)]
pub struct Slab<T> {
    entries: Vec<Option<T>>,
    free: Vec<usize>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// A fresh entry, built in place; returns its index and the entry.
    pub fn acquire(&mut self) -> (usize, &mut T)
    where
        T: Default,
    {
        self.len += 1;
        let i = self.free.pop().unwrap_or_else(|| {
            self.entries.push(None);
            self.entries.len() - 1
        });
        (i, self.entries[i].insert(T::default()))
    }

    /// The entry at `i`, if there is one.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.entries.get_mut(i)?.as_mut()
    }

    /// Drops the entry at `i`; false when there was none.
    pub fn release(&mut self, i: usize) -> bool {
        let Some(slot) = self.entries.get_mut(i) else {
            return false;
        };
        if slot.take().is_none() {
            return false;
        }
        self.free.push(i);
        self.len -= 1;
        true
    }

    /// Entries stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Keeps the guest memory that in-flight I/O points into mapped until the I/O is done.
///
/// An engine holds raw addresses into guest memory (bounce off) while the host does the I/O.
/// If the transport replaces the memory table meanwhile (vhost-user SET_MEM_TABLE), the old
/// mapping must outlive those requests: each request holds an `Arc` of the memory it was
/// submitted with (a clone of `GuestMemoryMmap` shares its regions' mappings). The clone is
/// made again only when the memory passed in changes (compared by region layout and host
/// address), not per request.
#[derive(Debug)]
pub struct MemPin<M> {
    current: Option<(MemLayout, Arc<M>)>,
}

impl<M> Default for MemPin<M> {
    fn default() -> Self {
        Self { current: None }
    }
}

impl<M: GuestMemory + Clone> MemPin<M> {
    /// An `Arc` of `mem` to keep with a request submitted now.
    pub fn pin(&mut self, mem: &M) -> Arc<M> {
        if let Some((old, arc)) = &self.current {
            if old.matches(mem) {
                return Arc::clone(arc);
            }
        }
        match MemLayout::of(mem) {
            Some(layout) => {
                let arc = Arc::new(mem.clone());
                self.current = Some((layout, Arc::clone(&arc)));
                arc
            }
            // No physical view to compare: a clone per request.
            None => Arc::new(mem.clone()),
        }
    }
}

/// A one-shot timer that wakes a queue waiting for bounce slots when none of its own requests
/// is in flight to release them (another queue or device holds the pool).
#[derive(Debug)]
pub struct RetryTimer {
    timer: Option<TimerFd>,
    armed: bool,
    /// Consecutive retries without progress.
    pub rounds: u32,
}

/// Wait between retries of a queue blocked on a full pool with nothing of its own in flight.
pub const RETRY_INTERVAL: Duration = Duration::from_millis(1);
/// Retries without progress before the waiting request fails with IOERR (about 0.1 s:
/// long enough for another queue's I/O to complete, short enough that a pool held by
/// someone else for good fails the request soon).
pub const MAX_RETRY_ROUNDS: u32 = 100;

impl RetryTimer {
    /// A timer (none if the kernel refuses one: the waiting request then fails at once).
    pub fn new() -> Self {
        let timer = TimerFd::new()
            .map_err(|e| tracing::warn!("virtio-blk: no retry timer: {e}"))
            .ok();
        Self {
            timer,
            armed: false,
            rounds: 0,
        }
    }

    /// The fd to poll, if any.
    pub fn fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// True while a wait can still be retried by the timer.
    pub fn can_arm(&self) -> bool {
        self.timer.is_some() && self.rounds < MAX_RETRY_ROUNDS
    }

    /// Arms the timer; false when there is no timer or the retries are used up.
    pub fn arm(&mut self) -> bool {
        if self.rounds >= MAX_RETRY_ROUNDS {
            return false;
        }
        let Some(t) = self.timer.as_mut() else {
            return false;
        };
        if !self.armed {
            if t.reset(RETRY_INTERVAL, None).is_err() {
                return false;
            }
            self.armed = true;
        }
        true
    }

    /// Called when the timer fired: consumes the expiry.
    pub fn fired(&mut self) {
        if let Some(t) = self.timer.as_mut() {
            // Non-blocking in effect: the poller saw it readable.
            if self.armed {
                let _ = t.wait();
            }
        }
        self.armed = false;
        self.rounds += 1;
    }

    /// Progress was made: the retry budget starts again.
    pub fn progressed(&mut self) {
        self.rounds = 0;
    }
}

impl Default for RetryTimer {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

    #[test]
    fn the_slab_builds_entries_in_place_and_reuses_released_indexes() {
        let mut slab = Slab::<Vec<u8>>::default();
        let (a, e) = slab.acquire();
        e.push(1);
        let (b, _) = slab.acquire();
        assert_ne!(a, b);
        assert_eq!(slab.get_mut(a).map(|e| e.len()), Some(1));
        assert!(slab.release(a));
        assert!(!slab.release(a), "released twice");
        assert!(slab.get_mut(a).is_none() && slab.get_mut(99).is_none());
        // The freed index comes back, with a fresh entry.
        let (c, e) = slab.acquire();
        assert_eq!((c, e.len()), (a, 0));
        assert_eq!(slab.len(), 2);
        assert!(slab.release(b) && slab.release(c) && slab.is_empty());
    }

    #[test]
    fn mem_pin_reuses_its_arc_until_the_layout_changes() {
        let a = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut pin = MemPin::default();
        let first = pin.pin(&a);
        // The same memory (a clone shares the mappings): the same pin.
        assert!(Arc::ptr_eq(&first, &pin.pin(&a.clone())));
        // A new table (other mappings, other region count): a new pin, kept from then on.
        let b = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x20000), 0x10000),
        ])
        .unwrap();
        let second = pin.pin(&b);
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(second.num_regions(), 2);
        assert!(Arc::ptr_eq(&second, &pin.pin(&b)));
        // Same layout but a different mapping (a new SET_MEM_TABLE of the same shape).
        let c = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x20000), 0x10000),
        ])
        .unwrap();
        assert!(!Arc::ptr_eq(&second, &pin.pin(&c)));
        // Fewer regions than pinned: not the same either.
        assert!(!Arc::ptr_eq(&pin.pin(&c), &pin.pin(&a)));
    }
}
