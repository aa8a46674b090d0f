//! Bookkeeping of a queue's requests in flight: their table, the guest memory they point
//! into, and how a queue waiting for bounce slots is woken.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use vm_memory::GuestMemory;
use vmm_sys_util::eventfd::EventFd;
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

/// The queues of one device waiting for bounce slots, woken when one of the device's requests
/// releases its slots.
///
/// A queue whose request found the pool full while none of its own requests is in flight
/// (the slots are held by the device's other queues) registers its wake eventfd here; the next
/// completion on any queue of the device writes every registered eventfd and forgets them.
/// Completions with nobody waiting cost one atomic load.
#[derive(Debug, Default)]
pub struct SlotWaiters {
    /// Registered eventfds (a mirror of `fds.len()`, read without the lock).
    waiting: AtomicUsize,
    fds: Mutex<Vec<Arc<EventFd>>>,
}

impl SlotWaiters {
    /// Wakes `fd` at the next release of slots (once; registering it again is a no-op).
    fn register(&self, fd: &Arc<EventFd>) {
        let mut fds = self.fds.lock().unwrap_or_else(PoisonError::into_inner);
        if !fds.iter().any(|f| Arc::ptr_eq(f, fd)) {
            fds.push(Arc::clone(fd));
            self.waiting.store(fds.len(), Ordering::Release);
        }
    }

    /// Slots were released: wakes every registered queue.
    pub fn wake(&self) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut fds = self.fds.lock().unwrap_or_else(PoisonError::into_inner);
        for fd in fds.drain(..) {
            // Non-blocking: a counter that is already raised wakes the queue all the same.
            let _ = fd.write(1);
        }
        self.waiting.store(0, Ordering::Release);
    }
}

/// How a queue waits for bounce slots when none of its own requests is in flight to release
/// them: woken through the device's [`SlotWaiters`] when another queue's request releases
/// slots, and by a slow backstop timer for holders that do not wake it (another device
/// sharing the pool, a release that came between the failed attempt and the registration).
///
/// Nothing here fails a request: waiting ends when slots are free, and a request gives up only
/// when it could never fit in the pool or nothing else holds slots (`RequestCtx::start`
/// decides both on every attempt).
#[derive(Debug)]
pub struct PoolWait {
    wake: Option<Arc<EventFd>>,
    timer: Option<TimerFd>,
    armed: bool,
    shared: Arc<SlotWaiters>,
    /// Wake-ups so far (the statistics show how long queues waited).
    pub rounds: u64,
}

/// The backstop interval of a queue waiting for bounce slots.
pub const BACKSTOP_INTERVAL: Duration = Duration::from_millis(20);

impl PoolWait {
    /// A waiter of a device's queue, woken through `shared`. Without an eventfd and a timer
    /// (the kernel refused both) a waiting request fails at once.
    pub fn new(shared: Arc<SlotWaiters>) -> Self {
        let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
            .map_err(|e| tracing::warn!("virtio-blk: no slot wake-up eventfd: {e}"))
            .ok()
            .map(Arc::new);
        let timer = TimerFd::new()
            .map_err(|e| tracing::warn!("virtio-blk: no slot backstop timer: {e}"))
            .ok();
        Self {
            wake,
            timer,
            armed: false,
            shared,
            rounds: 0,
        }
    }

    /// The wake-up eventfd to poll, if any.
    pub fn wake_fd(&self) -> Option<RawFd> {
        self.wake.as_ref().map(|w| w.as_raw_fd())
    }

    /// The backstop timer to poll, if any.
    pub fn timer_fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// True when something can wake a waiting queue.
    pub fn can_arm(&self) -> bool {
        self.wake.is_some() || self.timer.is_some()
    }

    /// Waits for slots: registers the wake-up and arms the backstop; false when nothing can
    /// wake the queue.
    pub fn arm(&mut self) -> bool {
        if let Some(w) = &self.wake {
            self.shared.register(w);
        }
        if !self.armed {
            if let Some(t) = self.timer.as_mut() {
                self.armed = t.reset(BACKSTOP_INTERVAL, None).is_ok();
            }
        }
        self.armed || self.wake.is_some()
    }

    /// Called when the wake-up or the backstop fired: consumes both.
    pub fn fired(&mut self) {
        if let Some(w) = &self.wake {
            // Non-blocking: an empty counter returns at once.
            let _ = w.read();
        }
        if let Some(t) = self.timer.as_mut() {
            if self.armed {
                // Disarmed before the wait only returns when it expired.
                let _ = t.clear();
            }
        }
        self.armed = false;
        self.rounds = self.rounds.saturating_add(1);
    }

    /// This queue's requests released slots: wakes the device's waiting queues.
    pub fn released(&self) {
        self.shared.wake();
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
