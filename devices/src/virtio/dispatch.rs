//! The one transport-side dispatcher: event → worker → its queues → [`QueueWorker::handle`] →
//! interrupts → broken worker. virtio-pci, vhost-user and the test driver all call workers
//! through it, so the worker contract is enforced in one place:
//!
//! **`handle` only sees queues that are set up (`Queue::ready`), valid (`Queue::is_valid`:
//! every ring inside guest memory) and enabled.** The rings are checked when the worker first
//! runs and again whenever a queue's ring addresses or size, or the guest memory's regions,
//! differ from the last check (a transport may move either at any time: vhost-user
//! `SET_VRING_ADDR`, `SET_MEM_TABLE`), not on every event: what was inside the memory stays
//! inside while neither changes. An event for a worker whose queues are not
//! all ready and enabled yet is dropped ([`Outcome::NotReady`]: a tap can become readable
//! before the vhost-user front end has configured the rings; nothing is lost, worker fds are
//! edge-triggered and a kick follows); a queue that is ready and enabled but whose rings are
//! not in guest memory breaks the worker ([`Outcome::Broken`]), as does a worker's own
//! [`WorkerError::Broken`]. A broken worker is parked: it is never called again
//! ([`Outcome::Parked`]) until the transport drops it at reset.
//!
//! The dispatcher holds no transport types: the caller maps its own event source (an eventfd
//! position, a vring index, a test kick) to a [`WorkerEvent`], lends the worker's queues in
//! [`QueueWorker::queue_indexes`] order, and acts on the [`Outcome`] (raise the interrupts of
//! [`Outcome::Served`]; set DEVICE_NEEDS_RESET and signal a configuration change, or the
//! vhost-user vring error fd, on [`Outcome::Broken`]).

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemory;

use super::memlayout::MemLayout;
use super::{QueueWorker, Signal, WorkerError, WorkerEvent};

/// What became of one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The worker ran; raise the interrupt of every queue position in the signal.
    Served(Signal),
    /// Not every queue of the worker is ready and enabled: the event was dropped.
    NotReady,
    /// The worker was broken before this event and is parked: dropped.
    Parked,
    /// The worker just broke (it said so, or one of its rings is not in guest memory): set
    /// DEVICE_NEEDS_RESET. Reported once; the worker is parked from now on.
    Broken(String),
    /// The worker did not expect this event (logged once, counted by the caller).
    Refused(WorkerEvent),
}

/// A queue's descriptor table, available and used ring addresses and size.
type Rings = (u64, u64, u64, u16);

fn rings(q: &Queue) -> Rings {
    (q.desc_table(), q.avail_ring(), q.used_ring(), q.size())
}

/// The rings of a worker's queues as last found inside guest memory, and that memory.
#[derive(Debug)]
struct CheckedRings {
    rings: Vec<Rings>,
    mem: MemLayout,
}

impl CheckedRings {
    /// True when neither the rings nor the memory moved since the check.
    fn still_hold<M: GuestMemory>(&self, mem: &M, queues: &[&mut Queue]) -> bool {
        self.rings.len() == queues.len()
            && self.rings.iter().zip(queues).all(|(r, q)| *r == rings(q))
            && self.mem.matches(mem)
    }
}

/// A worker as a transport holds it.
pub struct Dispatcher<M: GuestMemory> {
    worker: Box<dyn QueueWorker<M>>,
    indexes: Vec<u16>,
    broken: Option<String>,
    refused_logged: bool,
    /// The last ring check that passed (none before the first, or for a memory without a
    /// physical view to compare: then every event checks).
    checked: Option<CheckedRings>,
}

impl<M: GuestMemory> std::fmt::Debug for Dispatcher<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("queues", &self.indexes)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl<M: GuestMemory> Dispatcher<M> {
    /// Wraps `worker`.
    pub fn new(worker: Box<dyn QueueWorker<M>>) -> Self {
        let indexes = worker.queue_indexes();
        Self {
            worker,
            indexes,
            broken: None,
            refused_logged: false,
            checked: None,
        }
    }

    /// The device queue indexes the worker serves, in the order [`Dispatcher::dispatch`]
    /// wants them.
    pub fn queue_indexes(&self) -> &[u16] {
        &self.indexes
    }

    /// The worker's extra file descriptors ([`QueueWorker::extra_fds`]).
    pub fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        self.worker.extra_fds()
    }

    /// The worker's statistics.
    pub fn stats(&self) -> serde_json::Value {
        self.worker.stats()
    }

    /// Hands the worker its logs of heads in flight ([`QueueWorker::track_heads`]); false
    /// when it keeps none.
    pub fn track_heads(&mut self, logs: Vec<Box<dyn super::headlog::HeadLog>>) -> bool {
        self.worker.track_heads(logs)
    }

    /// Why the worker broke, once it has.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Runs the worker for `event`. `queues[i]` is device queue `queue_indexes()[i]`;
    /// `enabled` says whether the transport has every one of them enabled (virtio-pci starts
    /// workers for enabled queues only and passes `true`; vhost-user passes the vrings'
    /// enable state).
    pub fn dispatch(
        &mut self,
        event: WorkerEvent,
        mem: &M,
        queues: &mut [&mut Queue],
        enabled: bool,
    ) -> Outcome {
        if self.broken.is_some() {
            return Outcome::Parked;
        }
        if queues.len() != self.indexes.len() {
            return self.break_with(format!(
                "the transport lent {} queues to a worker of {}",
                queues.len(),
                self.indexes.len()
            ));
        }
        if !enabled || queues.iter().any(|q| !q.ready()) {
            if queues.iter().all(|q| q.ready()) {
                // Set up but disabled (vhost-user SET_VRING_ENABLE 0): the worker may stop
                // its backend (a net pair detaches its tap queue).
                self.worker.queues_disabled();
            }
            return Outcome::NotReady;
        }
        if !self
            .checked
            .as_ref()
            .is_some_and(|c| c.still_hold(mem, queues))
        {
            self.checked = None;
            if let Some(pos) = queues.iter().position(|q| !q.is_valid(mem)) {
                return self.break_with(format!(
                    "queue {} has rings outside guest memory or misaligned",
                    self.indexes[pos]
                ));
            }
            self.checked = MemLayout::of(mem).map(|mem| CheckedRings {
                rings: queues.iter().map(|q| rings(q)).collect(),
                mem,
            });
        }
        match self.worker.handle(event, mem, queues) {
            Ok(sig) => Outcome::Served(sig),
            Err(WorkerError::Broken(why)) => self.break_with(why),
            Err(WorkerError::UnexpectedEvent(ev)) => {
                if !self.refused_logged {
                    self.refused_logged = true;
                    tracing::warn!(queues = ?self.indexes, "worker refused event {ev:?} (logged once)");
                }
                Outcome::Refused(ev)
            }
        }
    }

    /// Lets the worker finish what it popped before its queues stop
    /// ([`QueueWorker::quiesce`]); nothing for a parked worker or queues it was not lent.
    /// The queues may already be marked not ready (the transport is stopping them): only
    /// used entries are written, each through a checked guest-memory access.
    pub fn quiesce(&mut self, mem: &M, queues: &mut [&mut Queue]) -> Outcome {
        if self.broken.is_some() {
            return Outcome::Parked;
        }
        if queues.len() != self.indexes.len() {
            return Outcome::NotReady;
        }
        match self.worker.quiesce(mem, queues) {
            Ok(sig) => Outcome::Served(sig),
            Err(WorkerError::Broken(why)) => self.break_with(why),
            Err(WorkerError::UnexpectedEvent(ev)) => Outcome::Refused(ev),
        }
    }

    fn break_with(&mut self, why: String) -> Outcome {
        // A guest or front end can break a worker, reset the device and break it again at
        // will: the first breaks of the process are errors, later ones debug lines (the
        // transports count every one).
        let n = BREAKS_SEEN.fetch_add(1, Ordering::Relaxed);
        if n < BREAKS_LOGGED {
            tracing::error!(queues = ?self.indexes, "device worker broken, parked until reset: {why}");
            if n + 1 == BREAKS_LOGGED {
                tracing::error!(
                    "{BREAKS_LOGGED} device workers broken in this process: later ones are logged at debug level"
                );
            }
        } else {
            tracing::debug!(queues = ?self.indexes, "device worker broken, parked until reset: {why}");
        }
        self.broken = Some(why.clone());
        Outcome::Broken(why)
    }
}

/// Broken workers logged as errors per process; the rest go to the debug level.
const BREAKS_LOGGED: u64 = 16;

/// Workers broken in this process so far.
static BREAKS_SEEN: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{device_queue, GuestRam};
    use crate::virtio::{Handled, Queues};
    use vm_memory::GuestMemoryMmap;

    /// Counts calls; breaks on `Fd(9)`.
    struct Probe(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl QueueWorker<GuestMemoryMmap> for Probe {
        fn queue_indexes(&self) -> Vec<u16> {
            vec![0]
        }
        fn handle(
            &mut self,
            event: WorkerEvent,
            _mem: &GuestMemoryMmap,
            _queues: Queues<'_, '_>,
        ) -> Handled {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match event {
                WorkerEvent::Fd(9) => Err(WorkerError::Broken("asked to".into())),
                WorkerEvent::Fd(_) => Err(WorkerError::UnexpectedEvent(event)),
                WorkerEvent::Kick(_) => Ok(Signal(1)),
            }
        }
    }

    /// A dispatcher around a [`Probe`], one queue of 8 in 1 MiB of guest RAM, and the
    /// probe's call count.
    struct Rig {
        ram: GuestRam,
        q: Queue,
        d: Dispatcher<GuestMemoryMmap>,
        calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Rig {
        fn new() -> Self {
            let mut ram = GuestRam::new(1 << 20);
            let q = device_queue(&ram.new_queue(8, false).layout(), 8, false);
            let calls = std::sync::Arc::default();
            let d = Dispatcher::new(Box::new(Probe(std::sync::Arc::clone(&calls))));
            Self { ram, q, d, calls }
        }

        /// Dispatches `ev` with the rig's memory and queue, the device `enabled` or not.
        fn send(&mut self, ev: WorkerEvent, enabled: bool) -> Outcome {
            self.d
                .dispatch(ev, self.ram.mem(), &mut [&mut self.q], enabled)
        }

        fn calls(&self) -> usize {
            self.calls.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    const KICK: WorkerEvent = WorkerEvent::Kick(0);

    #[test]
    fn the_worker_only_sees_ready_valid_enabled_queues() {
        let mut r = Rig::new();
        assert_eq!(r.send(KICK, true), Outcome::Served(Signal(1)));
        assert_eq!(r.send(KICK, false), Outcome::NotReady);
        r.q.set_ready(false);
        assert_eq!(r.send(KICK, true), Outcome::NotReady);
        assert_eq!(r.calls(), 1);
        // Ready and enabled, but the used ring is outside guest memory: broken, parked.
        r.q.set_ready(true);
        r.q.set_used_ring_address(Some(0xfff0_0000), Some(0));
        assert!(matches!(r.send(KICK, true), Outcome::Broken(_)));
        assert_eq!(r.send(KICK, true), Outcome::Parked);
        assert_eq!(r.calls(), 1, "never called with an invalid queue");
        assert!(r.d.broken().is_some());
    }

    #[test]
    fn rings_are_checked_again_when_the_memory_changes() {
        let mut r = Rig::new();
        assert_eq!(r.send(KICK, true), Outcome::Served(Signal(1)));
        // The same rings, in a new memory table that ends where the used ring starts: the
        // ring sits at the region's edge, outside it.
        let short = GuestMemoryMmap::<()>::from_ranges(&[(
            vm_memory::GuestAddress(0),
            usize::try_from(r.q.used_ring()).unwrap(),
        )])
        .unwrap();
        assert!(matches!(
            r.d.dispatch(KICK, &short, &mut [&mut r.q], true),
            Outcome::Broken(_)
        ));
        assert_eq!(r.calls(), 1, "never called with rings outside memory");
    }

    #[test]
    fn a_broken_worker_is_parked_and_refusals_are_reported() {
        let mut r = Rig::new();
        assert_eq!(
            r.send(WorkerEvent::Fd(1), true),
            Outcome::Refused(WorkerEvent::Fd(1))
        );
        assert!(matches!(
            r.send(WorkerEvent::Fd(9), true),
            Outcome::Broken(w) if w == "asked to"
        ));
        assert_eq!(r.send(KICK, true), Outcome::Parked);
        assert_eq!(r.calls(), 2);
        // A transport that lends the wrong number of queues breaks the worker, not the VMM.
        let mut r = Rig::new();
        assert!(matches!(
            r.d.dispatch(KICK, r.ram.mem(), &mut [], true),
            Outcome::Broken(_)
        ));
    }

    #[test]
    fn workers_broken_again_and_again_are_not_logged_every_time() {
        /// Appends what it is given to the test's log.
        struct Sink(&'static std::sync::Mutex<Vec<u8>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                crate::metrics::lock(self.0).extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        // The log of this thread, in memory for the life of the test process.
        let buf: &'static std::sync::Mutex<Vec<u8>> = Box::leak(Box::default());
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Sink(buf))
            .with_ansi(false)
            .with_max_level(tracing::Level::ERROR)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..40 {
                let out = Rig::new().send(WorkerEvent::Fd(9), true);
                assert!(matches!(out, Outcome::Broken(_)), "{out:?}");
            }
        });
        let text = String::from_utf8_lossy(&crate::metrics::lock(buf)).into_owned();
        let lines = text
            .lines()
            .filter(|l| l.contains("device worker broken"))
            .count();
        // Other tests of this process may have used some of the logged breaks already.
        assert!(
            lines <= 16,
            "{lines} error lines for 40 broken workers:\n{text}"
        );
    }
}
