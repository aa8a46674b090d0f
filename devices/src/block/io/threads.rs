//! `aio=threads`: blocking I/O on a pool of threads, for any [`Disk`] (qcow2 through `imago`,
//! and raw images on hosts without io_uring).
//!
//! As QEMU's thread pool: ops queue up, idle threads take them, and a thread is started when
//! ops wait and none is idle, up to a limit. A finished op goes on the completion list and
//! raises the eventfd the transport polls. Ops run concurrently, so they complete in any
//! order.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::engine::{run_blocking, EngineStats, IoDone, IoEngine, IoOp, Tag};
use super::Disk;

/// Threads per engine at most (QEMU's pool allows 64 per AioContext; this machine class has
/// a few cores, and each queue has a pool of its own).
pub const MAX_THREADS: usize = 16;

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<(Tag, IoOp)>,
    done: Vec<IoDone>,
    idle: usize,
    shutdown: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when an op is queued or at shutdown.
    work: Condvar,
    /// Signalled when an op finished.
    finished: Condvar,
    eventfd: EventFd,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock left consistent data (every update
        // is a single push or pop), so the poison is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How long the engine's drop waits for threads whose ops make no progress.
const DROP_IDLE: Duration = Duration::from_secs(1);

/// A thread-pool engine.
#[derive(Debug)]
pub struct ThreadEngine<D: Disk> {
    disk: Arc<D>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    max_threads: usize,
    /// Ops submitted since the last kick.
    batch: Vec<(Tag, IoOp)>,
    ops: usize,
    stats: Arc<EngineStats>,
}

impl<D: Disk> ThreadEngine<D> {
    /// An engine on `disk` for `depth` ops in flight, with up to `min(depth, MAX_THREADS)`
    /// threads.
    ///
    /// # Errors
    /// The eventfd cannot be created.
    pub fn new(disk: Arc<D>, depth: u16) -> io::Result<Self> {
        let eventfd = EventFd::new(EFD_NONBLOCK)?;
        Ok(Self {
            disk,
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                work: Condvar::new(),
                finished: Condvar::new(),
                eventfd,
            }),
            threads: Vec::new(),
            max_threads: usize::from(depth).clamp(1, MAX_THREADS),
            batch: Vec::new(),
            ops: 0,
            stats: Arc::default(),
        })
    }

    /// Threads started so far.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    fn spawn(&mut self) {
        let disk = Arc::clone(&self.disk);
        let shared = Arc::clone(&self.shared);
        let n = self.threads.len();
        match std::thread::Builder::new()
            .name(format!("blk-io-{n}"))
            .spawn(move || worker(&*disk, &shared))
        {
            Ok(h) => self.threads.push(h),
            // The ops wait for the threads that exist; with none at all they would wait
            // forever, so the first failure to start one is worth an error.
            Err(e) => tracing::error!("virtio-blk: cannot start I/O thread {n}: {e}"),
        }
    }
}

fn worker<D: Disk>(disk: &D, shared: &Shared) {
    let mut st = shared.lock();
    loop {
        if let Some((tag, op)) = st.queue.pop_front() {
            drop(st);
            let result = run_blocking(disk, &op);
            // The op (and its buffers' addresses) is dropped before the completion is
            // published: nothing touches the buffers once the submitter sees it.
            drop(op);
            st = shared.lock();
            st.done.push(IoDone { tag, result });
            shared.finished.notify_all();
            // Best effort: a full counter (2^64 - 2 unread writes) still reads as readable.
            let _ = shared.eventfd.write(1);
            continue;
        }
        if st.shutdown {
            return;
        }
        st.idle += 1;
        st = shared.work.wait(st).unwrap_or_else(|p| p.into_inner());
        st.idle -= 1;
    }
}

impl<D: Disk> IoEngine for ThreadEngine<D> {
    fn name(&self) -> &'static str {
        "threads"
    }

    unsafe fn submit(&mut self, tag: Tag, op: IoOp) {
        self.ops += 1;
        self.stats.note_submit(self.ops);
        self.batch.push((tag, op));
    }

    fn kick(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let n = self.batch.len();
        let (waiting, idle) = {
            let mut st = self.shared.lock();
            st.queue.extend(self.batch.drain(..));
            (st.queue.len(), st.idle)
        };
        if n == 1 {
            self.shared.work.notify_one();
        } else {
            self.shared.work.notify_all();
        }
        let mut missing = waiting.saturating_sub(idle);
        while missing > 0 && self.threads.len() < self.max_threads {
            self.spawn();
            missing -= 1;
        }
    }

    fn reap(&mut self, out: &mut Vec<IoDone>) {
        let _ = self.shared.eventfd.read();
        let mut st = self.shared.lock();
        let n = st.done.len();
        out.append(&mut st.done);
        drop(st);
        self.ops -= n;
        self.stats.completed.fetch_add(n as u64, Ordering::Relaxed);
    }

    fn wait(&mut self) {
        if self.ops == 0 {
            return;
        }
        self.kick();
        let st = self.shared.lock();
        if st.done.is_empty() {
            // A completion (or a spurious wake-up) ends the wait, or the slice does.
            let _ = self
                .shared
                .finished
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    fn in_flight(&self) -> usize {
        self.ops
    }

    fn notifier(&self) -> Option<RawFd> {
        Some(self.shared.eventfd.as_raw_fd())
    }

    fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}

impl<D: Disk> Drop for ThreadEngine<D> {
    fn drop(&mut self) {
        // Queued ops still run (their buffers are the submitter's until completion), then the
        // threads see the shutdown and exit. A thread whose op stays in the host (a disk that
        // never answers) is left running, detached, once no op has finished for DROP_IDLE:
        // the submitter gave that op's memory up (kept it) before dropping the engine.
        self.kick();
        let mut st = self.shared.lock();
        st.shutdown = true;
        self.shared.work.notify_all();
        let mut progress = Instant::now();
        loop {
            // A finished thread's handle is dropped: it has exited, nothing is left to join.
            self.threads.retain(|t| !t.is_finished());
            if self.threads.is_empty() || progress.elapsed() >= DROP_IDLE {
                break;
            }
            let before = st.done.len();
            // Exits are not signalled: look again every few milliseconds.
            st = self
                .shared
                .finished
                .wait_timeout(st, Duration::from_millis(5))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if st.done.len() != before {
                progress = Instant::now();
            }
        }
        drop(st);
        if !self.threads.is_empty() {
            tracing::error!(
                "virtio-blk: {} I/O threads still in the host when the engine closed; left running",
                self.threads.len()
            );
            self.threads.clear();
        }
    }
}
