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
//! Locks: the adapter's vring type ([`crate::vring`]) consumes a kick and signals a call
//! without a lock and keeps each queue behind one mutex; a thread's [`Group`] (its workers,
//! their fds and the guest memory, placed there at activation and by `SET_MEM_TABLE`) lives
//! behind the mutex of the thread's first vring. An event on an active device takes that
//! mutex and the mutex of every other vring its worker serves: one lock for a thread of one
//! queue (block), two for a net queue pair; nothing else. Every eventfd of the front end is
//! read and written with no lock held. Until a thread's first event hands the adapter its
//! vrings, its group waits in a mutex of the adapter's own ([`ThreadSlot`]), which events take
//! no more once they have been handed over. The negotiation mutex is taken only while the
//! device is inactive (an [`AtomicBool`] mirrors its state), to activate it lazily after a
//! stop.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use devices::metrics::{lock, Counter, LogOnce};
use devices::virtio::dispatch::{Dispatcher, Outcome};
use devices::virtio::spec::{feature, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_ID_BLOCK};
use devices::virtio::{Signal, VirtioDevice, WorkerEvent};
use serde::Serialize;
use serde_json::json;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Backend;
use vhost_user_backend::{VhostUserBackend, VringEpollHandler};
use virtio_queue::Queue;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::inflight::Inflight;
use crate::layout::QueueLayout;
use crate::report::Report;
use crate::vring::{count_lock, try_lock, Call};
use smallvec::SmallVec;

/// Guest memory as the vhost-user backend maps it (no dirty-page bitmap).
pub type Memory = GuestMemoryMmap<()>;
/// The shared, replaceable view of guest memory that `vhost-user-backend` hands out.
pub type AtomicMemory = GuestMemoryAtomic<Memory>;
/// The vring type of the adapter: each thread's [`Group`] lives with its first vring.
pub type Vring = crate::vring::Vring<Group>;
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

/// Transport counters (atomics: read by the stats reporter while the threads run); they
/// serialise as the `transport` statistics' counters. The server hands one set to the adapter
/// of each of its connections ([`VhostUserDevice::counting_into`]), so they add up over its
/// sessions: what a session that ended did stays in the statistics.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Counters {
    kicks: Counter,
    fd_events: Counter,
    signals: Counter,
    signal_errors: Counter,
    activations: Counter,
    activation_failures: Counter,
    resets: Counter,
    broken_workers: Counter,
    ignored_events: Counter,
    not_ready_events: Counter,
    /// Workers given their queue's inflight log.
    inflight_logs: Counter,
    /// Inflight regions that arrived after a worker had served (used from the next activation).
    late_inflight_regions: Counter,
    /// A front end may ask for features the device refuses, again and again.
    #[serde(skip)]
    activation_failure_logged: LogOnce,
    #[serde(skip)]
    late_inflight_logged: LogOnce,
    /// A front end may hand over a call eventfd whose counter is full, or close it.
    #[serde(skip)]
    signal_error_logged: LogOnce,
    /// Vring error eventfds signalled for broken workers ([`Report::broken`]).
    errors_signalled: Counter,
    /// Vring error eventfds that could not be signalled (a counter full, an fd closed).
    error_signal_failures: Counter,
    #[serde(skip)]
    error_signal_failure_logged: LogOnce,
}

/// The `transport` statistics: the negotiation's state and the counters.
#[derive(Serialize)]
struct TransportStats<'a> {
    /// Whether the device is active, or `"busy"`.
    active: serde_json::Value,
    /// The acked features in hex (null before SET_FEATURES), or `"busy"`.
    acked_features: serde_json::Value,
    event_idx: bool,
    #[serde(flatten)]
    counters: &'a Counters,
}

impl Counters {
    /// A used-buffer notification of the queue at `position` failed: counted, the first
    /// logged (a full counter is already readable, so the front end sees it anyway).
    fn signal_failed(&self, position: usize, e: &io::Error) {
        self.signal_errors.inc();
        if self.signal_error_logged.first() {
            tracing::info!(
                "signalling the queue at position {position}: {e} (a call eventfd full or gone; logged once, counted in signal_errors)"
            );
        } else {
            tracing::debug!("signalling the queue at position {position}: {e}");
        }
    }

    /// Counts what signalling a broken worker's error eventfds did; the first failure is
    /// logged (a full counter is already readable, so the front end sees the error anyway).
    fn error_signals(&self, sent: crate::report::ErrorSignals) {
        self.errors_signalled.add(sent.signalled);
        self.error_signal_failures.add(sent.failed);
        let Some((queue, e)) = sent.last_failure else {
            return;
        };
        if self.error_signal_failure_logged.first() {
            tracing::info!(
                "signalling the error fd of queue {queue}: {e} (an error eventfd full or gone; logged once, counted in error_signal_failures)"
            );
        } else {
            tracing::debug!("signalling the error fd of queue {queue}: {e}");
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
    /// Runs `f` on the worker with its queues in the worker's order: `first` is the queue of
    /// the thread's first vring (locked by the caller, with the group), the others are locked
    /// here in ascending position. Returns what to do once every lock is released; `None`
    /// when a position is missing or repeated.
    fn run(
        &mut self,
        first: &mut Queue,
        vrings: &[Vring],
        f: impl FnOnce(&mut Dispatcher<Memory>, &mut [&mut Queue], bool) -> Outcome,
    ) -> Option<After> {
        let enabled = self
            .positions
            .iter()
            .all(|&p| vrings.get(p).is_some_and(Vring::is_enabled));
        let outcome = if let [0] = self.positions[..] {
            // One queue, the first: nothing more to lock, nothing to allocate.
            f(&mut self.worker, &mut [first], enabled)
        } else {
            let mut others: Vec<usize> =
                self.positions.iter().copied().filter(|&p| p != 0).collect();
            others.sort_unstable();
            others.dedup();
            let mut guards = others
                .iter()
                .map(|&p| vrings.get(p).map(|v| (p, v.lock())))
                .collect::<Option<Vec<_>>>()?;
            let mut lent: Vec<(usize, Option<&mut Queue>)> = std::iter::once((0, Some(first)))
                .chain(guards.iter_mut().map(|(p, g)| (*p, Some(g.queue_mut()))))
                .collect();
            let mut queues = self
                .positions
                .iter()
                .map(|p| {
                    lent.iter_mut()
                        .find(|(q, _)| q == p)
                        .and_then(|(_, r)| r.take())
                })
                .collect::<Option<Vec<_>>>()?;
            f(&mut self.worker, &mut queues, enabled)
        };
        if matches!(outcome, Outcome::Served(_) | Outcome::Refused(_)) {
            self.served = true;
        }
        Some(match outcome {
            Outcome::Served(signal) => After::Signal(
                // The worker's queue order to the thread's vring positions; the call fds as
                // they are while the queues are locked.
                self.positions
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| signal.has(i))
                    .filter_map(|(_, &p)| vrings.get(p).map(|v| (p, v.call())))
                    .collect(),
            ),
            Outcome::NotReady => After::NotReady,
            Outcome::Parked | Outcome::Refused(_) => After::Ignored,
            Outcome::Broken(_) => After::Broken(self.worker.queue_indexes().to_vec()),
        })
    }
}

/// What is left to do after a worker ran, once the locks are released.
#[derive(Debug)]
enum After {
    /// Signal these call fds (with the vring positions they belong to).
    Signal(SmallVec<[(usize, Call); 2]>),
    NotReady,
    Ignored,
    /// Nothing (what happened is counted already).
    Nothing,
    /// The worker of these device queues broke.
    Broken(Vec<u16>),
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

/// Everything one epoll thread touches on an event besides its queues, kept with the thread's
/// first vring ([`Vring::lock`]): its workers (set at activation, dropped at a stop), their
/// file descriptors and the guest memory of the session (set by `SET_MEM_TABLE`).
#[derive(Default)]
pub struct Group {
    workers: Vec<Placed>,
    extra: Vec<ExtraFd>,
    mem: Option<AtomicMemory>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("workers", &self.workers.len())
            .field("extra", &self.extra)
            .finish_non_exhaustive()
    }
}

impl Group {
    /// True when nothing was placed in it.
    fn is_empty(&self) -> bool {
        self.workers.is_empty() && self.extra.is_empty() && self.mem.is_none()
    }
}

/// Where the adapter finds a thread's [`Group`].
#[derive(Default)]
struct ThreadSlot {
    /// The thread's vrings were handed over (by its first event): the group lives with the
    /// first of them. Read by every event without a lock; set and cleared under `early`.
    known: AtomicBool,
    early: Mutex<Early>,
}

/// A thread's group before its vrings are known, and the vrings once they are.
#[derive(Default)]
struct Early {
    /// The group while the vrings are not known (empty once they are).
    group: Group,
    /// The thread's vrings, in the order its events index them (empty until its first event).
    vrings: Vec<Vring>,
    /// The session ended ([`VhostUserDevice::detach`]): vrings are no longer taken, so that
    /// no front-end fd outlives it.
    closed: bool,
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
    threads: Vec<ThreadSlot>,
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
    counters: Arc<Counters>,
}

// By hand, as Server's is (`D` need not be Debug); each names its own identifying fields.
impl<D> std::fmt::Debug for VhostUserDevice<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserDevice")
            .field("layout", &self.layout)
            .field("num_queues", &self.num_queues)
            .field("features", &format_args!("{:#x}", self.features))
            .finish_non_exhaustive()
    }
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
        let threads = (0..layout.threads())
            .map(|_| ThreadSlot::default())
            .collect();
        Self {
            device,
            layout,
            num_queues,
            max_queue_size,
            features,
            protocol_features,
            neg: Mutex::default(),
            active: AtomicBool::new(false),
            threads,
            handlers: Mutex::default(),
            event_idx: AtomicBool::new(false),
            backend_req: Mutex::default(),
            report: Arc::new(Report::new(num_queues)),
            inflight: is_block.then(Arc::default),
            exit_consumers: Mutex::default(),
            counters: Arc::default(),
        }
    }

    /// Counts into `counters` (the server's, shared by the adapters of all its connections)
    /// instead of a set of its own.
    pub(crate) fn counting_into(mut self, counters: Arc<Counters>) -> Self {
        self.counters = counters;
        self
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
        for t in &self.threads {
            lock(&t.early).closed = false;
        }
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
        for t in &self.threads {
            let mut early = lock(&t.early);
            early.closed = true;
            t.known.store(false, Ordering::Release);
            if let Some(first) = early.vrings.first() {
                *first.lock().parts().1 = Group::default();
            }
            early.vrings.clear();
            early.group = Group::default();
        }
        self.event_idx.store(false, Ordering::Relaxed);
    }

    /// Statistics: the device's own (with its bounce pool's), its workers', and the
    /// transport's counters.
    ///
    /// Never waits for a worker or the negotiation: a thread busy in a worker (or a stop
    /// waiting for one) shows as `"busy"`, so the statistics socket and SIGUSR1 always answer.
    pub fn stats(&self) -> serde_json::Value {
        let device = try_lock(&self.device).map_or_else(|| json!("busy"), |d| d.stats());
        let mut workers = Vec::new();
        let of = |g: &Group| {
            g.workers
                .iter()
                .map(|w| w.worker.stats())
                .collect::<Vec<_>>()
        };
        for t in &self.threads {
            let Some(early) = try_lock(&t.early) else {
                workers.push(json!("busy"));
                continue;
            };
            match early.vrings.first() {
                None => workers.extend(of(&early.group)),
                Some(first) => match first.try_lock() {
                    Some(mut s) => workers.extend(of(s.parts().1)),
                    None => workers.push(json!("busy")),
                },
            }
        }
        let (active, acked) = try_lock(&self.neg).map_or_else(
            || (json!("busy"), json!("busy")),
            |n| (json!(n.active), json!(n.acked.map(|f| format!("{f:#x}")))),
        );
        json!({
            "device": device,
            "workers": workers,
            "report": self.report.stats(),
            "transport": TransportStats {
                active,
                acked_features: acked,
                event_idx: self.event_idx.load(Ordering::Relaxed),
                counters: &self.counters,
            },
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
                        "activating the device failed: {e} (logged once, counted in activation_failures)"
                    );
                } else {
                    tracing::debug!("activating the device failed: {e}");
                }
                self.counters.activation_failures.inc();
                neg.failed = true;
                return;
            }
        };
        let mut placed: Vec<Vec<Placed>> = (0..self.threads.len()).map(|_| Vec::new()).collect();
        for worker in workers {
            let queues = worker.queue_indexes();
            let Some((thread, positions)) = self.layout.place(&queues) else {
                tracing::error!(
                    "device worker serves queues {queues:?}, which no thread of layout {:?} holds together",
                    self.layout
                );
                self.counters.activation_failures.inc();
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
            self.with_group(thread, |group, _| {
                group.workers = workers;
                group.extra = extra;
            });
        }
        neg.active = true;
        self.active.store(true, Ordering::Release);
        neg.failed = false;
        self.report.clear();
        self.counters.activations.inc();
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
        for thread in 0..self.threads.len() {
            self.with_group(thread, |group, _| {
                for extra in group.extra.drain(..) {
                    if let Some(h) = handlers.get(thread) {
                        // The fd may already be gone from the set (a hang-up); nothing to do
                        // then.
                        let _ = h.unregister(extra.fd, extra.data);
                    }
                }
                group.workers.clear();
            });
        }
        lock(&self.device).reset();
        neg.active = false;
        self.counters.resets.inc();
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
            self.counters.late_inflight_regions.inc();
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
                self.counters.inflight_logs.inc();
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

    /// Runs `f` on thread `thread`'s group wherever it is, with the thread's vrings and the
    /// queue of the first of them once they are known. Takes the thread's slot mutex, then
    /// the first vring's: for the control path and activation, never for serving an event.
    fn with_group<R>(
        &self,
        thread: usize,
        f: impl FnOnce(&mut Group, Option<(&mut Queue, &[Vring])>) -> R,
    ) -> Option<R> {
        let mut early = lock(&self.threads.get(thread)?.early);
        let early = &mut *early;
        Some(match early.vrings.first() {
            Some(first) => {
                let mut serving = first.lock();
                let (queue, group) = serving.parts();
                f(group, Some((queue, &early.vrings)))
            }
            None => f(&mut early.group, None),
        })
    }

    /// Takes the vrings a thread's first event hands over, and moves the group placed so far
    /// to the first of them. False when the session ended or the thread has no vring.
    fn learn_vrings(&self, slot: &ThreadSlot, vrings: &[Vring]) -> bool {
        let mut early = lock(&slot.early);
        count_lock();
        if early.closed {
            return false;
        }
        if early.vrings.is_empty() {
            let Some(first) = vrings.first() else {
                return false;
            };
            let group = std::mem::take(&mut early.group);
            if !group.is_empty() {
                *first.lock().parts().1 = group;
            }
            early.vrings = vrings.to_vec();
            slot.known.store(true, Ordering::Release);
        }
        true
    }

    /// Handles one epoll event of thread `thread_id`: finds the worker in the thread's group,
    /// runs it through the dispatcher with its vrings and acts on the outcome once every lock
    /// is released.
    fn dispatch(&self, device_event: u16, evset: EventSet, vrings: &[Vring], thread_id: usize) {
        let Some(slot) = self.threads.get(thread_id) else {
            self.counters.ignored_events.inc();
            return;
        };
        if !slot.known.load(Ordering::Acquire) && !self.learn_vrings(slot, vrings) {
            self.counters.ignored_events.inc();
            return;
        }
        self.ensure_active();
        let Some(first) = vrings.first() else {
            self.counters.ignored_events.inc();
            return;
        };
        let after = {
            let mut serving = first.lock();
            let (queue, group) = serving.parts();
            self.serve(group, queue, device_event, evset, vrings, thread_id)
        };
        match after {
            Some(after) => self.act(after),
            None => self.counters.ignored_events.inc(),
        }
    }

    /// Runs the worker of one event in `group` (`first`: the queue of the thread's first
    /// vring); `None` when nobody can serve it.
    fn serve(
        &self,
        group: &mut Group,
        first: &mut Queue,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> Option<After> {
        let Some((index, event)) = self.find_worker(group, device_event, evset, vrings, thread_id)
        else {
            return Some(After::Nothing);
        };
        // No memory table yet: nothing can be done; the frontend sends it before it starts
        // the rings.
        let mem = group.mem.as_ref().map(GuestAddressSpace::memory)?;
        let w = group.workers.get_mut(index)?;
        self.give_inflight_log(w);
        // A worker only sees queues the frontend has finished setting up: addresses, base and
        // kick fd (vhost-user-backend marks the queue ready then) and enabled. Events before
        // that (a tap that became readable between SET_FEATURES and the rings being
        // configured) are dropped by the dispatcher; nothing is lost: the fds are
        // edge-triggered and the workers go back to their fds on the first kick.
        w.run(first, vrings, |d, queues, enabled| {
            d.dispatch(event, &*mem, queues, enabled)
        })
    }

    /// Lets every worker finish the requests it popped ([`Dispatcher::quiesce`]) and signals
    /// each of its queues: before a stop or a reset drops them, so the ring positions the
    /// frontend gets back count only requests it got back, and every completion is signalled
    /// before the reply. Called with the negotiation lock.
    fn quiesce(&self) {
        for thread in 0..self.threads.len() {
            let done = self.with_group(thread, |group, known| {
                // Without vrings the thread never had an event: nothing was popped.
                let (first, vrings) = known?;
                let mem = group.mem.as_ref().map(GuestAddressSpace::memory)?;
                let afters: Vec<After> = group
                    .workers
                    .iter_mut()
                    .filter_map(|w| {
                        w.run(first, vrings, |d, queues, _| {
                            match d.quiesce(&*mem, queues) {
                                // Every queue of the worker is signalled, whatever this pass
                                // completed: an event thread may have written used entries
                                // just before and not signalled them yet (it signals once its
                                // locks are released), and the frontend must have every
                                // completion signalled before the reply. A spurious
                                // notification is harmless.
                                Outcome::Served(_) => Outcome::Served(Signal::first(queues.len())),
                                other => other,
                            }
                        })
                    })
                    .collect();
                Some(afters)
            });
            for after in done.flatten().into_iter().flatten() {
                self.act(after);
            }
        }
    }

    /// Acts on what a worker left to do: signals the vrings it asks for, reports it broken.
    fn act(&self, after: After) {
        match after {
            After::Signal(calls) => {
                for (i, call) in calls {
                    self.counters.signals.inc();
                    if let Err(e) = call.signal() {
                        // The counter may be full, or the fd gone, while the frontend
                        // reconfigures.
                        self.counters.signal_failed(i, &e);
                    }
                }
            }
            After::NotReady => self.counters.not_ready_events.inc(),
            After::Ignored => self.counters.ignored_events.inc(),
            After::Nothing => {}
            After::Broken(queues) => {
                // The dispatcher logged why; report it to the frontend: DEVICE_NEEDS_RESET
                // and the error eventfds of its queues (so the guest's I/O fails instead of
                // hanging).
                self.counters.broken_workers.inc();
                self.counters.error_signals(self.report.broken(&queues));
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
            self.counters.kicks.inc();
            let pos = usize::from(device_event);
            let found = group.workers.iter().enumerate().find_map(|(i, w)| {
                w.positions
                    .iter()
                    .position(|&p| p == pos)
                    .map(|k| (i, WorkerEvent::Kick(k)))
            });
            if found.is_none() {
                self.counters.ignored_events.inc();
            }
            return found;
        }
        self.counters.fd_events.inc();
        let Some(k) = group
            .extra
            .iter()
            .position(|e| e.data == u64::from(device_event))
        else {
            self.counters.ignored_events.inc();
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
        for thread in 0..self.threads.len() {
            self.with_group(thread, |g, _| g.mem = Some(mem.clone()));
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
    use std::time::Duration;
    use vhost_user_backend::VringT;
    use virtio_queue::QueueT;
    use vm_memory::GuestAddress;

    /// A device whose queues are all on one thread, served by one worker that takes them in
    /// `order`: it records the sizes of the queues it is lent on each event and asks for the
    /// interrupt of the first of them.
    #[derive(Clone, Debug)]
    struct Counting {
        order: Vec<u16>,
        seen: Arc<Mutex<Vec<Vec<u16>>>>,
    }

    impl Counting {
        fn new(order: &[u16]) -> Self {
            Self {
                order: order.to_vec(),
                seen: Arc::default(),
            }
        }
    }

    impl VirtioDevice<Memory> for Counting {
        fn device_type(&self) -> u32 {
            0xfff0
        }
        fn num_queues(&self) -> usize {
            self.order.len()
        }
        fn queue_groups(&self) -> Vec<Vec<u16>> {
            vec![(0..u16::try_from(self.order.len()).unwrap()).collect()]
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
            Ok(vec![Box::new(self.clone())])
        }
        fn reset(&mut self) {}
        fn stats(&self) -> serde_json::Value {
            serde_json::Value::Null
        }
    }

    impl QueueWorker<Memory> for Counting {
        fn queue_indexes(&self) -> Vec<u16> {
            self.order.clone()
        }
        fn handle(
            &mut self,
            _event: WorkerEvent,
            _mem: &Memory,
            queues: &mut [&mut Queue],
        ) -> Result<Signal, WorkerError> {
            lock(&self.seen).push(queues.iter().map(|q| q.size()).collect());
            let mut signal = Signal::default();
            signal.add(0);
            Ok(signal)
        }
    }

    /// An active device on 1 MiB of guest memory, and its thread's vrings set up with
    /// `sizes`, ready and enabled.
    fn active(dev: &VhostUserDevice<Counting>, sizes: &[u16]) -> Vec<Vring> {
        let mem = AtomicMemory::new(Memory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap());
        dev.update_memory(mem.clone()).unwrap();
        dev.acked_features(feature(VIRTIO_F_VERSION_1));
        (0u64..)
            .zip(sizes)
            .map(|(i, &size)| {
                let vring = <Vring as VringT<AtomicMemory>>::new(mem.clone(), 16).unwrap();
                let base = 0x1_0000 * (i + 1);
                vring.set_queue_size(size);
                vring
                    .set_queue_info(base, base + 0x1000, base + 0x2000)
                    .unwrap();
                vring.set_queue_ready(true);
                vring.set_enabled(true);
                vring
            })
            .collect()
    }

    #[test]
    fn a_kick_on_an_active_device_does_not_take_the_negotiation_lock() {
        let device = Counting::new(&[0]);
        let seen = Arc::clone(&device.seen);
        let dev = Arc::new(VhostUserDevice::new(device));
        let vrings = active(&dev, &[16]);
        // The frontend's message thread holds the negotiation (a slow SET_FEATURES elsewhere).
        let neg = lock(&dev.neg);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = Arc::clone(&dev);
        std::thread::spawn(move || {
            d.handle_event(0, EventSet::IN, &vrings, 0).unwrap();
            tx.send(()).unwrap();
        });
        let served = rx.recv_timeout(Duration::from_secs(10));
        drop(neg);
        assert!(served.is_ok(), "the kick waited for the negotiation lock");
        assert_eq!(lock(&seen).len(), 1);
    }

    #[test]
    fn a_worker_of_two_queues_is_lent_them_in_its_order_under_two_locks_and_signals_its_first() {
        // Device queue 1 first, as a worker may list them.
        let device = Counting::new(&[1, 0]);
        let seen = Arc::clone(&device.seen);
        let dev = VhostUserDevice::new(device);
        let vrings = active(&dev, &[8, 16]);
        let (ours0, call0) = crate::vring::tests::eventfd();
        let (ours1, call1) = crate::vring::tests::eventfd();
        vrings[0].set_call(Some(ours0));
        vrings[1].set_call(Some(ours1));
        // The first event hands the thread's vrings over; the second is counted.
        dev.handle_event(0, EventSet::IN, &vrings, 0).unwrap();
        let before = crate::vring::EVENT_LOCKS.with(|c| c.get());
        dev.handle_event(1, EventSet::IN, &vrings, 0).unwrap();
        let locks = crate::vring::EVENT_LOCKS.with(|c| c.get()) - before;
        assert_eq!(locks, 2, "the two vrings' locks, the group's among them");
        assert_eq!(*lock(&seen), vec![vec![16, 8], vec![16, 8]]);
        // The worker's first queue is device queue 1: its call fd has both signals.
        assert_eq!(crate::vring::tests::read(&call1).unwrap(), 2);
        assert_eq!(
            crate::vring::tests::read(&call0).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }
}
