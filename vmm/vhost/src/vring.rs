//! [`Vring`]: the adapter's vring type, with one lock for everything an event touches.
//!
//! `vhost-user-backend` keeps a queue in a `VringState` behind the lock of its vring type; its
//! epoll handler takes that lock to consume a kick, and a back end takes it again to serve the
//! queue, besides whatever lock guards its own per-thread state. Here a vring splits what
//! `VringState` holds by who needs it:
//! - the kick eventfd is consumed, and the call eventfd signalled, without a lock (each sits
//!   behind an [`ArcSwapOption`]; a kick consumed while `SET_VRING_KICK` replaces the fd reads
//!   the fd it loaded, which stays open until the read is done), and the enable state is an
//!   atomic;
//! - the queue the workers serve sits behind the vring's one mutex ([`Vring::lock`]) together
//!   with a payload of the back end's choosing (the adapter keeps its thread's workers with
//!   the first vring of the thread, so an event on a one-queue thread takes exactly one lock);
//! - `vhost-user-backend`'s request handler reads a `VringState` through
//!   [`VringT::get_ref`] to register the kick fd on its epoll set (the kick fd, the ready and
//!   enable states): that view is a `VringMutex` of its own, which the event path never takes,
//!   and which holds a duplicate of the kick fd and the error fd (it keeps no call fd and no
//!   queue of its own: every queue operation of [`VringT`] goes to the served queue).

use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwapOption;
use vhost_user_backend::{VringMutex, VringState, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::{Error as QueueError, Queue, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace};

use crate::backend::AtomicMemory;

#[cfg(test)]
thread_local! {
    /// Locks this thread took on a vring or on the adapter's event path (the lock-count test
    /// reads it).
    pub(crate) static EVENT_LOCKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one lock taken (in tests; nothing otherwise).
#[inline(always)]
pub(crate) fn count_lock() {
    #[cfg(test)]
    EVENT_LOCKS.with(|c| c.set(c.get() + 1));
}

/// `m` if nobody holds it, poison recovered (the statistics never wait, and a panicking
/// worker must not take the server down with it).
pub(crate) fn try_lock<T: ?Sized>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// What [`Vring::lock`] guards: the queue the workers serve and the back end's payload.
#[derive(Debug)]
pub struct Serving<T> {
    queue: Queue,
    payload: T,
}

impl<T> Serving<T> {
    /// The served queue.
    pub fn queue_mut(&mut self) -> &mut Queue {
        &mut self.queue
    }

    /// The served queue and the payload, borrowed together.
    pub fn parts(&mut self) -> (&mut Queue, &mut T) {
        (&mut self.queue, &mut self.payload)
    }
}

struct Shared<T> {
    /// The guest memory `vhost-user-backend` hands every vring (replaced in place by
    /// `SET_MEM_TABLE`).
    mem: AtomicMemory,
    /// `vhost-user-backend`'s view: the kick fd it polls, ready and enabled.
    view: VringMutex<AtomicMemory>,
    kick: ArcSwapOption<File>,
    call: ArcSwapOption<File>,
    enabled: AtomicBool,
    serving: Mutex<Serving<T>>,
}

/// A vring's call eventfd, kept open while it is held ([`Vring::call`]).
#[derive(Debug)]
pub struct Call(Option<Arc<File>>);

impl Call {
    /// Signals the eventfd, if there is one. It is non-blocking (the relay's checks): a
    /// counter already full returns `WouldBlock`, and the front end sees the notification
    /// either way.
    pub fn signal(&self) -> io::Result<()> {
        match &self.0 {
            Some(call) => (&**call).write_all(&1u64.to_ne_bytes()),
            None => Ok(()),
        }
    }
}

/// A vring of the adapter: cheap to clone (all clones are the same vring).
pub struct Vring<T>(Arc<Shared<T>>);

impl<T> Clone for Vring<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> std::fmt::Debug for Vring<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vring")
            .field("enabled", &self.is_enabled())
            .finish_non_exhaustive()
    }
}

impl<T> Vring<T> {
    /// Locks the served queue and the payload (poison recovered: a panicking worker must not
    /// take the server down with it).
    pub fn lock(&self) -> MutexGuard<'_, Serving<T>> {
        count_lock();
        self.0
            .serving
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The served queue and payload if nobody holds them (statistics never wait).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, Serving<T>>> {
        try_lock(&self.0.serving)
    }

    /// Whether the front end enabled the vring (`SET_VRING_ENABLE`, or `SET_FEATURES` without
    /// `VHOST_USER_F_PROTOCOL_FEATURES`).
    pub fn is_enabled(&self) -> bool {
        self.0.enabled.load(Ordering::Acquire)
    }

    /// Signals the call eventfd, if there is one ([`Call::signal`]).
    pub fn signal(&self) -> io::Result<()> {
        self.call().signal()
    }

    /// The call eventfd as it is now, to signal later with no lock held: taken while the
    /// queue is still locked, it is the fd that was current when the used entries were
    /// written, even if `GET_VRING_BASE` clears it in between.
    pub fn call(&self) -> Call {
        Call(self.0.call.load_full())
    }

    /// Runs `f` on the served queue with the current guest memory.
    fn with_queue<R>(&self, f: impl FnOnce(&mut Queue, &crate::backend::Memory) -> R) -> R {
        let mem = self.0.mem.memory();
        f(self.lock().queue_mut(), &mem)
    }
}

impl<'a, T> VringStateGuard<'a, AtomicMemory> for Vring<T> {
    type G = MutexGuard<'a, VringState<AtomicMemory>>;
}

impl<'a, T> VringStateMutGuard<'a, AtomicMemory> for Vring<T> {
    type G = MutexGuard<'a, VringState<AtomicMemory>>;
}

impl<T: Default + Send + 'static> VringT<AtomicMemory> for Vring<T> {
    fn new(mem: AtomicMemory, max_queue_size: u16) -> Result<Self, QueueError> {
        Ok(Self(Arc::new(Shared {
            view: VringMutex::new(mem.clone(), max_queue_size)?,
            mem,
            kick: ArcSwapOption::empty(),
            call: ArcSwapOption::empty(),
            enabled: AtomicBool::new(false),
            serving: Mutex::new(Serving {
                queue: Queue::new(max_queue_size)?,
                payload: T::default(),
            }),
        })))
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, AtomicMemory>>::G {
        count_lock();
        self.0.view.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, AtomicMemory>>::G {
        count_lock();
        self.0.view.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), QueueError> {
        self.with_queue(|q, mem| q.add_used(mem, desc_index, len))
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.signal()
    }

    fn enable_notification(&self) -> Result<bool, QueueError> {
        self.with_queue(|q, mem| q.enable_notification(mem))
    }

    fn disable_notification(&self) -> Result<(), QueueError> {
        self.with_queue(|q, mem| q.disable_notification(mem))
    }

    fn needs_notification(&self) -> Result<bool, QueueError> {
        self.with_queue(|q, mem| q.needs_notification(mem))
    }

    fn set_enabled(&self, enabled: bool) {
        self.0.view.set_enabled(enabled);
        self.0.enabled.store(enabled, Ordering::Release);
    }

    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), QueueError> {
        let mut s = self.lock();
        let q = s.queue_mut();
        q.try_set_desc_table_address(GuestAddress(desc_table))?;
        q.try_set_avail_ring_address(GuestAddress(avail_ring))?;
        q.try_set_used_ring_address(GuestAddress(used_ring))
    }

    fn queue_next_avail(&self) -> u16 {
        self.lock().queue.next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.lock().queue.set_next_avail(base);
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.lock().queue.set_next_used(idx);
    }

    fn queue_used_idx(&self) -> Result<u16, QueueError> {
        self.with_queue(|q, mem| q.used_idx(mem, Ordering::Relaxed).map(|i| i.0))
    }

    fn set_queue_size(&self, num: u16) {
        self.lock().queue.set_size(num);
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.lock().queue.set_event_idx(enabled);
    }

    fn set_queue_ready(&self, ready: bool) {
        self.0.view.set_queue_ready(ready);
        self.lock().queue.set_ready(ready);
    }

    fn set_kick(&self, file: Option<File>) {
        // The view's copy is what the request handler registers on its epoll set; ours is
        // read by `read_kick`. Without a duplicate the kick is not registered at all (a
        // registered kick nobody can consume would wake the epoll thread forever).
        let (view, ours) = match file {
            Some(f) => match f.try_clone() {
                Ok(dup) => (Some(dup), Some(Arc::new(f))),
                Err(e) => {
                    tracing::error!("duplicating a kick fd: {e}; its queue is not polled");
                    (None, Some(Arc::new(f)))
                }
            },
            None => (None, None),
        };
        self.0.view.set_kick(view);
        self.0.kick.store(ours);
    }

    fn read_kick(&self) -> io::Result<bool> {
        if let Some(kick) = &*self.0.kick.load() {
            let mut buf = [0u8; 8];
            match (&**kick).read_exact(&mut buf) {
                // A kick another reader took (the fd is non-blocking): nothing to consume,
                // and the queue is looked at anyway.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => r?,
            }
        }
        Ok(self.is_enabled())
    }

    fn set_call(&self, file: Option<File>) {
        self.0.call.store(file.map(Arc::new));
    }

    fn set_err(&self, file: Option<File>) {
        self.0.view.set_err(file);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::Memory;
    use std::os::fd::{FromRawFd, OwnedFd};

    fn vring() -> Vring<()> {
        let mem = AtomicMemory::new(Memory::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap());
        <Vring<()> as VringT<AtomicMemory>>::new(mem, 16).unwrap()
    }

    /// A non-blocking eventfd, as the relay's checks leave a front end's: (the copy handed to
    /// the vring, the front end's copy).
    pub(crate) fn eventfd() -> (File, File) {
        // SAFETY: eventfd takes no pointers; the fd it returns is ours.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(raw >= 0);
        // SAFETY: `raw` was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        (File::from(fd.try_clone().unwrap()), File::from(fd))
    }

    pub(crate) fn write(f: &File, n: u64) -> io::Result<()> {
        (&*f).write_all(&n.to_ne_bytes())
    }

    pub(crate) fn read(f: &File) -> io::Result<u64> {
        let mut b = [0u8; 8];
        (&*f).read_exact(&mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    #[test]
    fn a_kick_is_consumed_without_a_lock_and_one_another_reader_took_is_no_error() {
        let v = vring();
        let (ours, kick) = eventfd();
        v.set_kick(Some(ours));
        v.set_enabled(true);
        write(&kick, 1).unwrap();
        let before = EVENT_LOCKS.with(|c| c.get());
        assert!(v.read_kick().unwrap());
        assert_eq!(
            EVENT_LOCKS.with(|c| c.get()),
            before,
            "read_kick took a lock"
        );
        // Consumed: the counter is empty now.
        assert_eq!(
            read(&kick).unwrap_err().kind(),
            io::ErrorKind::WouldBlock,
            "the kick was not consumed"
        );
        // Nothing left to consume (the front end read its own kick): not an error.
        assert!(v.read_kick().unwrap());
        v.set_enabled(false);
        assert!(!v.read_kick().unwrap());
    }

    #[test]
    fn the_request_handler_sees_the_kick_ready_and_enabled_states_and_queue_calls_reach_the_served_queue(
    ) {
        let v = vring();
        let (ours, _kick) = eventfd();
        assert!(v.get_ref().get_kick().is_none());
        v.set_kick(Some(ours));
        v.set_queue_ready(true);
        v.set_enabled(true);
        {
            let view = v.get_ref();
            assert!(view.get_kick().is_some());
            assert!(view.get_queue().ready());
            assert!(view.is_enabled());
        }
        v.set_queue_size(8);
        v.set_queue_info(0x1000, 0x2000, 0x3000).unwrap();
        v.set_queue_next_avail(5);
        let mut s = v.lock();
        let q = s.queue_mut();
        assert!(q.ready());
        assert_eq!(
            (q.size(), q.desc_table(), q.avail_ring(), q.used_ring()),
            (8, 0x1000, 0x2000, 0x3000)
        );
        assert_eq!(q.next_avail(), 5);
        drop(s);
        assert_eq!(v.queue_next_avail(), 5);
        v.set_kick(None);
        assert!(v.get_ref().get_kick().is_none());
    }

    #[test]
    fn a_signal_writes_the_call_eventfd_and_a_full_counter_is_reported() {
        let v = vring();
        v.signal().unwrap();
        let (ours, call) = eventfd();
        v.set_call(Some(ours));
        v.signal().unwrap();
        assert_eq!(read(&call).unwrap(), 1);
        write(&call, u64::MAX - 1).unwrap();
        assert_eq!(v.signal().unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }
}
