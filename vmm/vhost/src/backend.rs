//! [`VhostUserDevice`]: any [`VirtioDevice`] served through `vhost-user-backend`.
//!
//! The adapter maps the vhost-user life cycle onto the device boundary of
//! [`devices::virtio`]:
//! - feature negotiation: the device's features plus `VHOST_USER_F_PROTOCOL_FEATURES`; the
//!   device is activated with the acknowledged bits (the vhost-user bit stripped) when the
//!   frontend sends `SET_FEATURES`, and again lazily after it was stopped;
//! - one epoll thread of `vhost-user-backend` per queue group ([`QueueLayout`]); each
//!   [`QueueWorker`] lives on the thread whose group holds all its queues, and its own file
//!   descriptors (tap, timers) are registered on that thread's epoll handler with tokens above
//!   the range `vhost-user-backend` reserves;
//! - `GET_VRING_BASE` on every queue (the frontend stopped the device, e.g. on a guest reset)
//!   and `RESET_DEVICE` let the workers finish what they popped ([`QueueWorker::quiesce`]:
//!   the base the frontend gets back counts only requests it got back), then drop them and
//!   reset the device; the next `SET_FEATURES` or kick re-activates it.
//!
//! Every event reaches its worker through the shared [`Dispatcher`], which enforces the worker
//! contract as for virtio-pci and the test driver: only ready, valid (`Queue::is_valid`,
//! checked again whenever the ring addresses or the memory table change, so a ring at a
//! region's edge is refused before a worker can spin on it) and enabled queues; a worker that reports [`WorkerError::Broken`] or whose rings are not inside guest
//! memory is logged once and parked (its kicks are consumed and ignored) until the device is
//! reset, and reported to the frontend through the [`Report`] (vring error eventfds,
//! DEVICE_NEEDS_RESET in `GET_STATUS`). Nothing the guest or the frontend controls may stop the
//! epoll threads: [`VhostUserBackend::handle_event`] never returns an error. The statistics
//! never wait for a worker (a busy one is reported as such).
//!
//! A block device also offers `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD` ([`crate::inflight`]): each
//! worker gets its queue's log of the session's inflight region before it serves anything
//! (at activation, or at its first event after the relay took a region), resumes from it and
//! keeps it. A region that arrives once a worker has served is used from the next activation
//! (logged once, counted in `late_inflight_regions`).
//!
//! Locks: an event on an active device takes its thread's own [`Group`] mutex (the workers,
//! their fds and the guest memory, placed there at activation and by `SET_MEM_TABLE`) and the
//! `vhost-user-backend` locks of its worker's vrings; nothing else. The negotiation mutex is
//! taken only while the device is inactive (an [`AtomicBool`] mirrors its state), to activate
//! it lazily after a stop.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use devices::virtio::dispatch::{Dispatcher, Outcome};
use devices::virtio::spec::{feature, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_ID_BLOCK};
use devices::virtio::{VirtioDevice, WorkerEvent};
use serde_json::json;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Backend;
use vhost_user_backend::{VhostUserBackend, VringEpollHandler, VringRwLock, VringT};
use virtio_queue::Queue;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::inflight::Inflight;
use crate::layout::QueueLayout;
use crate::report::Report;

/// Guest memory as the vhost-user backend maps it (no dirty-page bitmap).
pub type Memory = GuestMemoryMmap<()>;
/// The shared, replaceable view of guest memory that `vhost-user-backend` hands out.
pub type AtomicMemory = GuestMemoryAtomic<Memory>;
/// The vring type of the adapter.
pub type Vring = VringRwLock<AtomicMemory>;
/// An epoll handler of the adapter (one per worker thread).
pub type EpollHandler<D> = VringEpollHandler<Arc<VhostUserDevice<D>>>;

/// How worker file descriptors are polled: edge-triggered, as [`QueueWorker::extra_fds`]
/// requires (a net worker leaves its tap readable while the guest has no receive buffers).
const WORKER_FD_EVENTS: EventSet = EventSet::IN.union(EventSet::EDGE_TRIGGERED);

/// What the adapter needs of an epoll handler: registering worker file descriptors.
pub trait Listeners: Send + Sync {
    /// Polls `fd` for input; events come back with `data`.
    ///
    /// # Errors
    /// The epoll registration failed.
    fn register(&self, fd: RawFd, data: u64) -> io::Result<()>;
    /// Stops polling `fd`.
    ///
    /// # Errors
    /// The fd was not registered.
    fn unregister(&self, fd: RawFd, data: u64) -> io::Result<()>;
}

impl<T> Listeners for VringEpollHandler<T>
where
    T: VhostUserBackend,
    VringEpollHandler<T>: Send + Sync,
{
    fn register(&self, fd: RawFd, data: u64) -> io::Result<()> {
        self.register_listener(fd, WORKER_FD_EVENTS, data)
    }

    fn unregister(&self, fd: RawFd, data: u64) -> io::Result<()> {
        self.unregister_listener(fd, WORKER_FD_EVENTS, data)
    }
}

/// Transport counters (atomics: read by the stats reporter while the threads run).
#[derive(Debug, Default)]
struct Counters {
    kicks: AtomicU64,
    fd_events: AtomicU64,
    signals: AtomicU64,
    signal_errors: AtomicU64,
    activations: AtomicU64,
    activation_failures: AtomicU64,
    resets: AtomicU64,
    broken_workers: AtomicU64,
    ignored_events: AtomicU64,
    not_ready_events: AtomicU64,
    /// Workers given their queue's inflight log.
    inflight_logs: AtomicU64,
    /// Inflight regions that arrived after a worker had served (used from the next activation).
    late_inflight_regions: AtomicU64,
    /// A front end may ask for features the device refuses, again and again.
    activation_failure_logged: devices::metrics::LogOnce,
    late_inflight_logged: devices::metrics::LogOnce,
    /// A front end may hand over a call eventfd whose counter is full, or close it.
    signal_error_logged: devices::metrics::LogOnce,
}

impl Counters {
    fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A used-buffer notification of the queue at `position` failed: counted, the first
    /// logged (a full counter is already readable, so the front end sees it anyway).
    fn signal_failed(&self, position: usize, e: &io::Error) {
        Self::inc(&self.signal_errors);
        if self.signal_error_logged.first() {
            tracing::info!(
                "signalling the queue at position {position}: {e} (a call eventfd full or gone; logged once per session, counted in signal_errors)"
            );
        } else {
            tracing::debug!("signalling the queue at position {position}: {e}");
        }
    }
}

/// One worker as its thread holds it: behind the shared dispatcher (the worker contract),
/// with the positions of its queues in the thread's vring slice, in the worker's queue order.
struct Placed {
    worker: Dispatcher<Memory>,
    positions: Vec<usize>,
    /// The inflight generation the worker last looked at ([`Inflight::generation`]).
    inflight_seen: u64,
    /// The worker has served an event (a new inflight log would come too late for it).
    served: bool,
}

impl Placed {
    /// Locks the worker's vrings among its thread's `vrings`, in the worker's queue order;
    /// `None` when one is missing.
    fn lock_vrings<'a>(
        &self,
        vrings: &'a [Vring],
    ) -> Option<Vec<std::sync::RwLockWriteGuard<'a, vhost_user_backend::VringState<AtomicMemory>>>>
    {
        self.positions
            .iter()
            .map(|&p| {
                vrings.get(p).map(|v| {
                    event_lock();
                    v.get_mut()
                })
            })
            .collect()
    }
}

/// A worker file descriptor registered on a thread's epoll handler.
#[derive(Clone, Copy, Debug)]
struct ExtraFd {
    fd: RawFd,
    /// The epoll data value (above the range reserved by `vhost-user-backend`).
    data: u64,
    /// Index of the worker in its thread's group.
    worker: usize,
    /// The worker's own token.
    token: u32,
}

/// Everything one epoll thread touches on an event, behind that thread's own mutex: its
/// workers (set at activation, dropped at a stop), their file descriptors and the guest
/// memory of the session (set by `SET_MEM_TABLE`).
#[derive(Default)]
struct Group {
    workers: Vec<Placed>,
    extra: Vec<ExtraFd>,
    mem: Option<AtomicMemory>,
    /// The thread's vrings (from its first event), for a stop to let workers finish.
    vrings: Vec<Vring>,
}

/// Negotiation state of the current connection.
#[derive(Debug, Default)]
struct NegState {
    /// Features the frontend acknowledged (with the vhost-user bits), once it did.
    acked: Option<u64>,
    /// True while the device has live workers.
    active: bool,
    /// Set when activation failed for `acked`: not retried until the features change.
    failed: bool,
}

/// Serves a [`VirtioDevice`] through `vhost-user-backend`.
///
/// Wrap it in an [`Arc`] and hand it to [`vhost_user_backend::VhostUserDaemon::new`]; then
/// give the daemon's epoll handlers to [`VhostUserDevice::attach`] so worker file descriptors
/// can be registered, and call [`VhostUserDevice::detach`] when the connection ends.
pub struct VhostUserDevice<D> {
    device: Arc<Mutex<D>>,
    layout: QueueLayout,
    num_queues: usize,
    max_queue_size: usize,
    features: u64,
    protocol_features: VhostUserProtocolFeatures,
    neg: Mutex<NegState>,
    /// Mirrors `NegState::active` (written under the negotiation lock), so that an event on an
    /// active device does not take that lock.
    active: AtomicBool,
    groups: Vec<Mutex<Group>>,
    handlers: Mutex<Vec<Arc<dyn Listeners>>>,
    event_idx: AtomicBool,
    /// The backend request channel (`SET_BACKEND_REQ_FD`), kept open for the session: QEMU
    /// watches it, and reads a closed one as "Unexpected end-of-file before all data were
    /// read" (it printed that for every session when the channel was dropped on arrival).
    backend_req: Mutex<Option<Backend>>,
    /// Broken workers reported to the frontend (shared with the relay).
    report: Arc<Report>,
    /// The session's inflight region (shared with the relay), for a device that offers
    /// INFLIGHT_SHMFD (block).
    inflight: Option<Arc<Inflight>>,
    /// The exit-event consumers handed to `vhost-user-backend` ([`VhostUserBackend::exit_event`]):
    /// it registers each on its epoll fd through `into_raw_fd` and never closes it, one
    /// eventfd per epoll thread per daemon. [`VhostUserDevice::take_exit_consumers`] gives them
    /// to whoever drops the daemon (the server closes them).
    exit_consumers: Mutex<Vec<RawFd>>,
    counters: Counters,
}

impl<D> std::fmt::Debug for VhostUserDevice<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserDevice")
            .field("layout", &self.layout)
            .field("num_queues", &self.num_queues)
            .field("features", &format_args!("{:#x}", self.features))
            .finish_non_exhaustive()
    }
}

/// Locks a mutex, recovering the data of a poisoned one (a panicking worker must not take
/// the whole server down with it).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
thread_local! {
    /// Locks the event path of this thread took (the lock-count test reads it).
    pub(crate) static EVENT_LOCKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one lock taken on the event path (in tests; nothing otherwise).
#[inline(always)]
fn event_lock() {
    #[cfg(test)]
    EVENT_LOCKS.with(|c| c.set(c.get() + 1));
}

impl<D: VirtioDevice<Memory> + 'static> VhostUserDevice<D> {
    /// Wraps `device`, with its queues grouped onto threads by the device's [`VirtioDevice::queue_groups`].
    pub fn new(device: D) -> Self {
        Self::shared(Arc::new(Mutex::new(device)))
    }

    /// Wraps a device shared with others (the server makes one adapter per connection around
    /// the same device), with the layout of its [`VirtioDevice::queue_groups`].
    pub fn shared(device: Arc<Mutex<D>>) -> Self {
        // The device declares which queues one worker serves together, before activation.
        let layout = {
            let d = lock(&device);
            let groups = d.queue_groups();
            QueueLayout::new(d.num_queues(), &groups).unwrap_or_else(|e| {
                tracing::error!(
                    "the device's queue groups {groups:?} are not a layout ({e}); one thread per queue"
                );
                QueueLayout::one_per_queue(d.num_queues())
            })
        };
        Self::with_layout(device, layout)
    }

    /// Wraps a shared device with an explicit thread layout. Workers whose queues are not all
    /// in one group of `layout` cannot be served: their activation fails (and is logged).
    pub fn with_layout(device: Arc<Mutex<D>>, layout: QueueLayout) -> Self {
        let (num_queues, max_queue_size, features, is_block) = {
            let d = lock(&device);
            (
                d.num_queues(),
                usize::from(d.queue_max_size()),
                d.avail_features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
                d.device_type() == VIRTIO_ID_BLOCK,
            )
        };
        // MQ is offered whatever the queue count: it is what lets the frontend ask for it
        // (GET_QUEUE_NUM), and QEMU checks its own queue count against the answer.
        // STATUS: SET_STATUS/GET_STATUS are answered by the relay (see `report`).
        // CONFIGURE_MEM_SLOTS: libblkio registers memory only with ADD_MEM_REG/REM_MEM_REG,
        // and QEMU uses them for memory hot-plug (vhost-user-backend maps and unmaps them; the
        // relay checks each added region and answers for the copies QEMU's multi-queue net
        // adds, see `slots`).
        let mut protocol_features = VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::STATUS;
        // INFLIGHT_SHMFD, for block: a block request can be served again after a crash (a
        // read re-read, a write rewritten); a net frame cannot be taken back.
        if is_block {
            protocol_features |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        }
        if features & feature(VIRTIO_F_ACCESS_PLATFORM) != 0 {
            // QEMU refuses a backend that offers ACCESS_PLATFORM without the backend request
            // channel ("IOMMU support requires reply-ack and slave-req protocol features"):
            // it is where device-IOTLB misses would go with a vIOMMU. Without a vIOMMU QEMU
            // sends no IOTLB message and addresses stay guest-physical.
            protocol_features |= VhostUserProtocolFeatures::BACKEND_REQ;
        }
        let groups = (0..layout.threads()).map(|_| Mutex::default()).collect();
        Self {
            device,
            layout,
            num_queues,
            max_queue_size,
            features,
            protocol_features,
            neg: Mutex::default(),
            active: AtomicBool::new(false),
            groups,
            handlers: Mutex::default(),
            event_idx: AtomicBool::new(false),
            backend_req: Mutex::default(),
            report: Arc::new(Report::new(num_queues)),
            inflight: is_block.then(Arc::default),
            exit_consumers: Mutex::default(),
            counters: Counters::default(),
        }
    }

    /// Error reporting of this connection (give it to the relay).
    pub fn report(&self) -> Arc<Report> {
        self.report.clone()
    }

    /// The exit-event consumer fds given to the daemon so far, forgotten here: the daemon
    /// leaves them open. Close them once the daemon has been dropped (its epoll threads
    /// joined), never before: an epoll thread waits on them to exit.
    pub fn take_exit_consumers(&self) -> Vec<RawFd> {
        std::mem::take(&mut *lock(&self.exit_consumers))
    }

    /// The number of queues offered to the frontend (`GET_QUEUE_NUM`).
    pub fn num_queues_offered(&self) -> usize {
        self.num_queues
    }

    /// What the relay checks this device's messages against.
    pub fn limits(&self) -> crate::relay::Limits {
        crate::relay::Limits {
            num_queues: self.num_queues,
            max_queue_size: self.max_queue_size,
            inflight: self.inflight.clone(),
        }
    }

    /// The thread layout.
    pub fn layout(&self) -> &QueueLayout {
        &self.layout
    }

    /// Gives the adapter the epoll handlers of a new daemon (one per layout group), so that
    /// worker file descriptors can be registered on them.
    pub fn attach(&self, handlers: Vec<Arc<EpollHandler<D>>>) {
        self.attach_listeners(
            handlers
                .into_iter()
                .map(|h| h as Arc<dyn Listeners>)
                .collect(),
        );
    }

    /// Gives the adapter what registers worker file descriptors, one per layout group.
    pub(crate) fn attach_listeners(&self, listeners: Vec<Arc<dyn Listeners>>) {
        *lock(&self.handlers) = listeners;
    }

    /// Ends a connection: drops the workers, resets the device, forgets the negotiation, the
    /// memory and the epoll handlers, and closes the kept error fds (no front-end fd outlives
    /// its session). The daemon's threads must have been told to exit.
    pub fn detach(&self) {
        let mut neg = lock(&self.neg);
        self.deactivate(&mut neg);
        *neg = NegState::default();
        drop(neg);
        lock(&self.handlers).clear();
        *lock(&self.backend_req) = None;
        self.report.close_fds();
        for g in &self.groups {
            let mut g = lock(g);
            g.mem = None;
            g.vrings.clear();
        }
        self.event_idx.store(false, Ordering::Relaxed);
    }

    /// Statistics: the device's own (with its bounce pool's), its workers', and the
    /// transport's counters.
    ///
    /// Never waits for a worker or the negotiation: a thread busy in a worker (or a stop
    /// waiting for one) shows as `"busy"`, so the statistics socket and SIGUSR1 always answer.
    pub fn stats(&self) -> serde_json::Value {
        let device = match self.device.try_lock() {
            Ok(d) => d.stats(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().stats(),
            Err(std::sync::TryLockError::WouldBlock) => json!("busy"),
        };
        let mut workers = Vec::new();
        for g in &self.groups {
            match g.try_lock() {
                Ok(g) => workers.extend(g.workers.iter().map(|w| w.worker.stats())),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    workers.extend(p.into_inner().workers.iter().map(|w| w.worker.stats()))
                }
                Err(std::sync::TryLockError::WouldBlock) => workers.push(json!("busy")),
            }
        }
        let c = &self.counters;
        let (active, acked) = match self.neg.try_lock() {
            Ok(n) => (json!(n.active), json!(n.acked.map(|f| format!("{f:#x}")))),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                let n = p.into_inner();
                (json!(n.active), json!(n.acked.map(|f| format!("{f:#x}"))))
            }
            Err(std::sync::TryLockError::WouldBlock) => (json!("busy"), json!("busy")),
        };
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "device": device,
            "workers": workers,
            "report": self.report.stats(),
            "transport": {
                "active": active,
                "acked_features": acked,
                "event_idx": self.event_idx.load(Ordering::Relaxed),
                "kicks": get(&c.kicks),
                "fd_events": get(&c.fd_events),
                "signals": get(&c.signals),
                "signal_errors": get(&c.signal_errors),
                "activations": get(&c.activations),
                "activation_failures": get(&c.activation_failures),
                "resets": get(&c.resets),
                "broken_workers": get(&c.broken_workers),
                "ignored_events": get(&c.ignored_events),
                "not_ready_events": get(&c.not_ready_events),
                "inflight_logs": get(&c.inflight_logs),
                "late_inflight_regions": get(&c.late_inflight_regions),
            }
        })
    }

    /// Activates the device with `acked` (vhost-user bits stripped) and places its workers.
    /// Called with the negotiation lock held; takes the device and thread locks.
    fn activate(&self, neg: &mut NegState, acked: u64) {
        let device_features = acked & !VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let workers = match lock(&self.device).activate(device_features) {
            Ok(w) => w,
            Err(e) => {
                if self.counters.activation_failure_logged.first() {
                    tracing::error!(
                        "activating the device failed: {e} (logged once per session, counted in activation_failures)"
                    );
                } else {
                    tracing::debug!("activating the device failed: {e}");
                }
                Counters::inc(&self.counters.activation_failures);
                neg.failed = true;
                return;
            }
        };
        let mut placed: Vec<Vec<Placed>> = (0..self.groups.len()).map(|_| Vec::new()).collect();
        for worker in workers {
            let queues = worker.queue_indexes();
            let Some((thread, positions)) = self.layout.place(&queues) else {
                tracing::error!(
                    "device worker serves queues {queues:?}, which no thread of layout {:?} holds together",
                    self.layout
                );
                Counters::inc(&self.counters.activation_failures);
                neg.failed = true;
                lock(&self.device).reset();
                return;
            };
            let mut placed_worker = Placed {
                worker: Dispatcher::new(worker),
                positions,
                inflight_seen: 0,
                served: false,
            };
            self.give_inflight_log(&mut placed_worker);
            placed[thread].push(placed_worker);
        }
        let handlers = lock(&self.handlers).clone();
        // Tokens above `num_queues` are free for backend listeners (vhost-user-backend
        // reserves 0..=num_queues for queues, the exit event and its own vring-enable event).
        let mut next_data = self.num_queues as u64 + 1;
        for (thread, workers) in placed.into_iter().enumerate() {
            let mut extra = Vec::new();
            for (index, w) in workers.iter().enumerate() {
                for (fd, token) in w.worker.extra_fds() {
                    next_data += 1;
                    let Some(h) = handlers.get(thread) else {
                        tracing::error!(
                            "no epoll handler for thread {thread}: fd {fd} is not polled"
                        );
                        continue;
                    };
                    if let Err(e) = h.register(fd, next_data) {
                        tracing::error!("registering worker fd {fd} (token {token}): {e}");
                        continue;
                    }
                    extra.push(ExtraFd {
                        fd,
                        data: next_data,
                        worker: index,
                        token,
                    });
                }
            }
            let mut group = lock(&self.groups[thread]);
            group.workers = workers;
            group.extra = extra;
        }
        neg.active = true;
        self.active.store(true, Ordering::Release);
        neg.failed = false;
        self.report.clear();
        Counters::inc(&self.counters.activations);
    }
}

impl<D: VirtioDevice<Memory> + 'static> VhostUserDevice<D> {
    /// Drops the workers (unregistering their file descriptors) and resets the device.
    /// Called with the negotiation lock held.
    fn deactivate(&self, neg: &mut NegState) {
        if !neg.active {
            return;
        }
        self.active.store(false, Ordering::Release);
        let handlers = lock(&self.handlers).clone();
        for (thread, group) in self.groups.iter().enumerate() {
            let mut group = lock(group);
            for extra in group.extra.drain(..) {
                if let Some(h) = handlers.get(thread) {
                    // The fd may already be gone from the set (a hang-up); nothing to do then.
                    let _ = h.unregister(extra.fd, extra.data);
                }
            }
            group.workers.clear();
        }
        lock(&self.device).reset();
        neg.active = false;
        Counters::inc(&self.counters.resets);
    }

    /// Gives `w` its queues' logs of the session's inflight region, if there is one and `w`
    /// has not served yet; remembers the region's generation either way.
    fn give_inflight_log(&self, w: &mut Placed) {
        let Some(inflight) = &self.inflight else {
            return;
        };
        let generation = inflight.generation();
        if generation == w.inflight_seen {
            return;
        }
        w.inflight_seen = generation;
        if w.served {
            Counters::inc(&self.counters.late_inflight_regions);
            if self.counters.late_inflight_logged.first() {
                tracing::warn!(
                    "an inflight region arrived after queues {:?} started; used from their next start (logged once, counted in late_inflight_regions)",
                    w.worker.queue_indexes()
                );
            }
            return;
        }
        if let Some(logs) = inflight.logs(w.worker.queue_indexes()) {
            if w.worker.track_heads(logs) {
                Counters::inc(&self.counters.inflight_logs);
            }
        }
    }

    /// Activates the device if features were acknowledged and it is not running (after a
    /// stop, a kick or a worker fd restarts it). Takes the negotiation lock only when the
    /// device is inactive.
    fn ensure_active(&self) {
        if self.active.load(Ordering::Acquire) {
            return;
        }
        let mut neg = lock(&self.neg);
        if !neg.active && !neg.failed {
            if let Some(acked) = neg.acked {
                self.activate(&mut neg, acked);
            }
        }
    }

    /// Handles one epoll event of thread `thread_id`: finds the worker in the thread's group,
    /// runs it through the dispatcher with its vrings and acts on the outcome.
    fn dispatch(&self, device_event: u16, evset: EventSet, vrings: &[Vring], thread_id: usize) {
        let Some(group) = self.groups.get(thread_id) else {
            Counters::inc(&self.counters.ignored_events);
            return;
        };
        self.ensure_active();
        let mut group = lock(group);
        event_lock();
        if group.vrings.is_empty() {
            group.vrings = vrings.to_vec();
        }
        let Some((index, event)) =
            self.find_worker(&mut group, device_event, evset, vrings, thread_id)
        else {
            return;
        };
        let Some(mem) = group.mem.as_ref().map(GuestAddressSpace::memory) else {
            // No memory table yet: nothing can be done; the frontend sends it before it
            // starts the rings.
            Counters::inc(&self.counters.ignored_events);
            return;
        };
        let Some(w) = group.workers.get_mut(index) else {
            return;
        };
        self.give_inflight_log(w);
        let Some(mut states) = w.lock_vrings(vrings) else {
            Counters::inc(&self.counters.ignored_events);
            return;
        };
        // A worker only sees queues the frontend has finished setting up: addresses, base and
        // kick fd (vhost-user-backend marks the queue ready then) and enabled. Events before
        // that (a tap that became readable between SET_FEATURES and the rings being
        // configured) are dropped by the dispatcher; nothing is lost: the fds are
        // edge-triggered and the workers go back to their fds on the first kick.
        let enabled = states.iter().all(|s| s.is_enabled());
        let mut queues: Vec<&mut Queue> = states.iter_mut().map(|s| s.get_queue_mut()).collect();
        let outcome = w.worker.dispatch(event, &*mem, &mut queues, enabled);
        drop(queues);
        if matches!(outcome, Outcome::Served(_) | Outcome::Refused(_)) {
            w.served = true;
        }
        self.act(outcome, &states, &w.worker);
    }

    /// Lets every worker finish the requests it popped ([`Dispatcher::quiesce`]) and signals
    /// what they completed: before a stop or a reset drops them, so the ring positions the
    /// frontend gets back count only requests it got back. Called with the negotiation lock.
    fn quiesce(&self) {
        for g in &self.groups {
            let mut group = lock(g);
            let Some(mem) = group.mem.as_ref().map(GuestAddressSpace::memory) else {
                continue;
            };
            let vrings = group.vrings.clone();
            for w in &mut group.workers {
                let Some(mut states) = w.lock_vrings(&vrings) else {
                    continue;
                };
                let mut queues: Vec<&mut Queue> =
                    states.iter_mut().map(|s| s.get_queue_mut()).collect();
                let outcome = w.worker.quiesce(&*mem, &mut queues);
                drop(queues);
                self.act(outcome, &states, &w.worker);
            }
        }
    }

    /// Acts on a worker's outcome: signals the queues it asks for, reports it broken.
    fn act<S: std::ops::Deref<Target = vhost_user_backend::VringState<AtomicMemory>>>(
        &self,
        outcome: Outcome,
        states: &[S],
        worker: &Dispatcher<Memory>,
    ) {
        match outcome {
            Outcome::Served(signal) => {
                for (i, state) in states.iter().enumerate() {
                    if signal.has(i) {
                        Counters::inc(&self.counters.signals);
                        if let Err(e) = state.signal_used_queue() {
                            // The call fd may be gone while the frontend reconfigures.
                            self.counters.signal_failed(i, &e);
                        }
                    }
                }
            }
            Outcome::NotReady => Counters::inc(&self.counters.not_ready_events),
            Outcome::Parked | Outcome::Refused(_) => {
                Counters::inc(&self.counters.ignored_events);
            }
            Outcome::Broken(_) => {
                // The dispatcher logged why; report it to the frontend: DEVICE_NEEDS_RESET
                // and the error eventfds of its queues (so the guest's I/O fails instead of
                // hanging).
                Counters::inc(&self.counters.broken_workers);
                self.report.broken(worker.queue_indexes());
            }
        }
    }

    /// The worker of `device_event` in `group` and its event: a kick of the vring at that
    /// position, or one of the worker's own file descriptors (dropped from the epoll set when
    /// it hung up). `None` (counted) when nobody serves it.
    fn find_worker(
        &self,
        group: &mut Group,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> Option<(usize, WorkerEvent)> {
        if usize::from(device_event) < vrings.len() {
            Counters::inc(&self.counters.kicks);
            let pos = usize::from(device_event);
            let found = group.workers.iter().enumerate().find_map(|(i, w)| {
                w.positions
                    .iter()
                    .position(|&p| p == pos)
                    .map(|k| (i, WorkerEvent::Kick(k)))
            });
            if found.is_none() {
                Counters::inc(&self.counters.ignored_events);
            }
            return found;
        }
        Counters::inc(&self.counters.fd_events);
        let Some(k) = group
            .extra
            .iter()
            .position(|e| e.data == u64::from(device_event))
        else {
            Counters::inc(&self.counters.ignored_events);
            return None;
        };
        let extra = group.extra[k];
        if !evset.contains(EventSet::IN) && evset.intersects(EventSet::HANG_UP | EventSet::ERROR) {
            // The fd is dead (a tap whose device went away): stop polling it.
            tracing::warn!(
                "worker fd {} (token {}) hung up; no longer polled",
                extra.fd,
                extra.token
            );
            if let Some(h) = lock(&self.handlers).get(thread_id) {
                let _ = h.unregister(extra.fd, extra.data);
            }
            group.extra.remove(k);
            return None;
        }
        Some((extra.worker, WorkerEvent::Fd(extra.token)))
    }
}

impl<D: VirtioDevice<Memory> + 'static> VhostUserBackend for VhostUserDevice<D> {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.num_queues
    }

    fn max_queue_size(&self) -> usize {
        self.max_queue_size
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn acked_features(&self, features: u64) {
        let mut neg = lock(&self.neg);
        if neg.acked == Some(features) && (neg.active || neg.failed) {
            return;
        }
        self.deactivate(&mut neg);
        neg.acked = Some(features);
        neg.failed = false;
        self.activate(&mut neg, features);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.protocol_features
    }

    fn reset_device(&self) {
        let mut neg = lock(&self.neg);
        if neg.active {
            self.quiesce();
        }
        self.deactivate(&mut neg);
        *neg = NegState::default();
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // vhost bounds the size by its message limit; bound it again rather than trust that.
        let size = size.min(vhost::vhost_user::message::VHOST_USER_CONFIG_SIZE) as usize;
        let mut buf = vec![0u8; size];
        lock(&self.device).read_config(u64::from(offset), &mut buf);
        buf
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        lock(&self.device).write_config(u64::from(offset), buf);
        Ok(())
    }

    fn update_memory(&self, mem: AtomicMemory) -> io::Result<()> {
        // Each thread reads the memory from its own group (no shared lock on the kick path).
        for g in &self.groups {
            lock(g).mem = Some(mem.clone());
        }
        Ok(())
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        // Nothing is sent on it yet (no IOTLB misses without a vIOMMU), but it must stay open.
        *lock(&self.backend_req) = Some(backend);
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        self.layout.masks()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok(pair) => {
                lock(&self.exit_consumers).push(pair.0.as_raw_fd());
                Some(pair)
            }
            Err(e) => {
                tracing::error!("creating an exit event: {e}");
                None
            }
        }
    }

    fn stop_vring(&self, _queue_index: u32) -> io::Result<()> {
        // GET_VRING_BASE: the frontend stops the device (guest reset, driver unload, VM
        // stop). Drop the workers so no request runs on rings being torn down; the next
        // SET_FEATURES (QEMU sends it on every start) or kick activates the device again.
        // Requests in flight are finished first: the base the frontend gets back counts
        // them, so their status and used entry must be written before it is.
        let mut neg = lock(&self.neg);
        if neg.active {
            self.quiesce();
        }
        self.deactivate(&mut neg);
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        self.dispatch(device_event, evset, vrings, thread_id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devices::virtio::spec::VIRTIO_F_VERSION_1;
    use devices::virtio::{ActivateError, QueueWorker, Signal, WorkerError};
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;
    use vm_memory::GuestAddress;

    /// One queue, one worker that counts its kicks and asks for the interrupt.
    struct Counting(Arc<AtomicUsize>);

    impl VirtioDevice<Memory> for Counting {
        fn device_type(&self) -> u32 {
            0xfff0
        }
        fn num_queues(&self) -> usize {
            1
        }
        fn queue_max_size(&self) -> u16 {
            16
        }
        fn avail_features(&self) -> u64 {
            feature(VIRTIO_F_VERSION_1)
        }
        fn read_config(&self, _offset: u64, _data: &mut [u8]) {}
        fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
        fn activate(&mut self, _: u64) -> Result<Vec<Box<dyn QueueWorker<Memory>>>, ActivateError> {
            Ok(vec![Box::new(Counting(Arc::clone(&self.0)))])
        }
        fn reset(&mut self) {}
        fn stats(&self) -> serde_json::Value {
            serde_json::Value::Null
        }
    }

    impl QueueWorker<Memory> for Counting {
        fn queue_indexes(&self) -> Vec<u16> {
            vec![0]
        }
        fn handle(
            &mut self,
            _event: WorkerEvent,
            _mem: &Memory,
            _queues: &mut [&mut Queue],
        ) -> Result<Signal, WorkerError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Signal::default())
        }
    }

    #[test]
    fn a_kick_on_an_active_device_does_not_take_the_negotiation_lock() {
        let kicks = Arc::new(AtomicUsize::new(0));
        let dev = Arc::new(VhostUserDevice::new(Counting(Arc::clone(&kicks))));
        let mem = AtomicMemory::new(Memory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap());
        dev.update_memory(mem.clone()).unwrap();
        dev.acked_features(feature(VIRTIO_F_VERSION_1));
        let vring = <Vring as VringT<AtomicMemory>>::new(mem, 16).unwrap();
        vring.set_queue_size(16);
        vring.set_queue_info(0x1000, 0x2000, 0x3000).unwrap();
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        // The frontend's message thread holds the negotiation (a slow SET_FEATURES elsewhere).
        let neg = lock(&dev.neg);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = Arc::clone(&dev);
        std::thread::spawn(move || {
            d.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0)
                .unwrap();
            tx.send(()).unwrap();
        });
        let served = rx.recv_timeout(Duration::from_secs(10));
        drop(neg);
        assert!(served.is_ok(), "the kick waited for the negotiation lock");
        assert_eq!(kicks.load(Ordering::SeqCst), 1);
    }
}
