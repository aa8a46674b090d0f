//! The per-queue worker of a block device: submission from the available ring, completion
//! from the engine, back-pressure on a full bounce pool.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use virtio_queue::Queue;
use vm_memory::GuestMemory;

use super::inflight::{MemPin, PoolWait, Slab, SlotWaiters};
use super::io::{IoDone, IoEngine, OnFull};
use super::request::{Request, RequestCtx, Started};
use crate::virtio::chain::{Chain, ChainHead};
use crate::virtio::headlog::{HeadLog, Unlogged};
use crate::virtio::queue::{self, Step};
use crate::virtio::{Handled, QueueWorker, Queues, Signal, WorkerError, WorkerEvent};

/// Worker fd token of the engine's completion eventfd.
pub const ENGINE_TOKEN: u32 = 0;
/// Worker fd token of the backstop timer of a queue waiting for bounce slots.
pub const RETRY_TOKEN: u32 = 1;
/// Worker fd token of the wake-up of a queue waiting for bounce slots (another queue of the
/// device released some).
pub const WAKE_TOKEN: u32 = 2;

/// When a drain pass hands its prepared requests to the kernel: after the 1st, 2nd, 4th,
/// 8th, ... request of the pass, and the rest at its end.
///
/// One submission per pass made a burst a convoy: a driver that refills the ring a whole
/// completion batch at a time and a disk that completes in batches lock into step, and every
/// request of the burst waited until the last one was mapped before any reached the disk, so
/// the device's own time per burst was added whole to each cycle (with 32 in flight, every
/// request was submitted 32 at a time). Handing over the first request at once starts the
/// disk while the rest are mapped; doubling keeps a burst of n to about log2(n) + 1 system
/// calls.
#[derive(Debug, Default)]
struct KickPacer {
    /// Requests prepared since the last hand-over.
    waiting: usize,
    /// Requests handed over in this pass.
    handed: usize,
}

impl KickPacer {
    /// One more request prepared; true when the engine should be kicked now.
    fn prepared(&mut self) -> bool {
        self.waiting += 1;
        if self.waiting < self.handed.max(1) {
            return false;
        }
        self.handed += self.waiting;
        self.waiting = 0;
        true
    }
}

/// Serves one request queue through the shared queue-service loop ([`queue::drain`]) and an
/// [`IoEngine`]: a kick pops chains, maps them and submits their I/O (up to the queue size in
/// flight); the engine's eventfd brings completions, which are unmapped, given their status
/// and put on the used ring in completion order, one notification per batch. A request that
/// finds the bounce pool full stays on the ring (`on-full=wait`) until completions release
/// slots: this queue's own, or (when none of its requests is in flight) another queue's,
/// which wakes it ([`PoolWait`]); it waits as long as others hold slots.
///
/// Given a log of heads in flight ([`QueueWorker::track_heads`]: vhost-user's inflight
/// region), the worker records every head it pops and uses there, and its first event after
/// getting one resumes the queue from it ([`queue::resume`]): the heads the log lists are
/// submitted again, in the order they were first popped, before anything new (counted as
/// `inflight_resubmitted`).
///
/// Each event reaps the engine once, after any submission: completions that arrived while
/// the pass submitted (the synchronous engine's, a fast disk's) are used in the same event.
/// The reap resets the engine's eventfd before it looks for completions, so one posted after
/// it raises the (edge-triggered) eventfd again and comes with the next event. Only a queue
/// waiting for bounce slots reaps before it submits too, so that the slots its completions
/// release are free when the pass runs again.
#[derive(Debug)]
pub struct BlockWorker<M: GuestMemory> {
    queue_index: u16,
    ctx: RequestCtx,
    chain: Chain,
    engine: Box<dyn IoEngine>,
    /// The requests in flight, by engine tag.
    requests: Slab<Request<M>>,
    mem: MemPin<M>,
    done: Vec<IoDone>,
    on_full: OnFull,
    /// How long a quiesce or the drop waits for requests in flight.
    give_up_after: Duration,
    /// A submission pass stopped on a full pool: run one again when slots may be free.
    deferred: bool,
    retry: PoolWait,
    /// Where the queue's heads in flight are recorded ([`Unlogged`] unless the transport keeps
    /// them).
    log: Box<dyn HeadLog>,
    /// The log is new: resume from it before serving.
    resume: bool,
    /// Heads in flight before a restart, not yet submitted again (oldest first).
    resubmit: VecDeque<u16>,
}

fn broken(e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Broken(format!("virtio-blk: {e}"))
}

impl<M: GuestMemory> BlockWorker<M> {
    /// The worker of queue `queue_index`, executing requests through `ctx` and `engine`;
    /// `waiters` are the device's queues waiting for bounce slots.
    pub(super) fn new(
        queue_index: u16,
        ctx: RequestCtx,
        engine: Box<dyn IoEngine>,
        on_full: OnFull,
        give_up_after: Duration,
        waiters: Arc<SlotWaiters>,
    ) -> Self {
        Self {
            queue_index,
            ctx,
            chain: Chain::default(),
            engine,
            requests: Slab::default(),
            mem: MemPin::default(),
            done: Vec::new(),
            on_full,
            give_up_after,
            deferred: false,
            retry: PoolWait::new(waiters),
            log: Box::new(Unlogged),
            resume: false,
            resubmit: VecDeque::new(),
        }
    }
}

impl<M: GuestMemory + Clone + Send + Sync + 'static> BlockWorker<M> {
    /// Pops chains and submits them; returns the used entries added (requests finished at
    /// once).
    fn submit(&mut self, mem: &M, queue: &mut Queue) -> Result<usize, WorkerError> {
        self.deferred = false;
        let pin = self.mem.pin(mem);
        let wait_mode = self.on_full == OnFull::Wait;
        let Self {
            ctx,
            chain,
            engine,
            requests,
            deferred,
            retry,
            log,
            resubmit,
            ..
        } = self;
        let mut pacer = KickPacer::default();
        let serve = |at: ChainHead| {
            // Waiting needs something that will retry: one of our own requests completing,
            // or a wake-up when another queue's request releases slots.
            let may_wait = wait_mode && (!requests.is_empty() || retry.can_arm());
            let (tag, req) = requests.acquire();
            let step = match ctx.start(mem, &at, chain, req, may_wait) {
                Ok(Started::Submit(op)) => {
                    req.head = at.head;
                    req.mem = Some(Arc::clone(&pin));
                    // SAFETY: the op's buffers are the device-visible side of the mappings
                    // now owned by `requests[tag]` (bounce slots, or guest memory kept mapped
                    // by its `mem`); they are unmapped only after the engine returned this
                    // tag's completion, or after the engine is dropped (which waits).
                    unsafe { engine.submit(tag as u64, op) };
                    if pacer.prepared() {
                        engine.kick();
                    }
                    return Ok(Step::Held);
                }
                Ok(Started::Done(c)) => Ok(Step::Used(c.used_len)),
                Ok(Started::PoolFull) => Ok(Step::Defer),
                Err(e) => Err(broken(format_args!("head {}: {e}", at.head))),
            };
            requests.release(tag);
            if matches!(step, Ok(Step::Defer)) {
                if requests.is_empty() {
                    retry.arm();
                }
                *deferred = true;
            }
            step
        };
        // Heads in flight before a restart go first; new ones only once they are all taken.
        let drained = queue::drain_logged(queue, mem, log.as_mut(), resubmit, serve);
        // What the pacer left waiting, and anything an engine holds back.
        engine.kick();
        let drained = drained.map_err(|e| match e {
            WorkerError::Broken(why) if !why.starts_with("virtio-blk") => broken(why),
            e => e,
        })?;
        let m = ctx.metrics();
        m.drains.add(drained.passes as u64);
        m.queue_depth_hiwater.max(u64::from(drained.deepest));
        m.inflight_hiwater.max(requests.len() as u64);
        Ok(drained.used)
    }

    /// Reaps the engine's completions and puts them on the used ring, in completion order;
    /// returns how many.
    fn complete(&mut self, mem: &M, queue: &mut Queue) -> Result<usize, WorkerError> {
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        self.engine.reap(&mut done);
        let mut used = 0;
        let mut released = false;
        let mut result = Ok(());
        // The slots of every request of this reap go back in one allocator call.
        let mut batch = self.ctx.batch();
        for d in done.drain(..) {
            let tag = usize::try_from(d.tag).unwrap_or(usize::MAX);
            let Some(req) = self.requests.get_mut(tag) else {
                tracing::error!("virtio-blk: completion for unknown tag {}", d.tag);
                continue;
            };
            // The request's data is unmapped through the memory it was submitted with: a
            // region the front end removed meanwhile is still mapped there (and only there).
            let pinned = req.mem.clone();
            let submitted: &M = pinned.as_deref().unwrap_or(mem);
            if result.is_err() {
                // The device is already broken: release what is left.
                self.ctx.release(submitted, req, &mut batch);
            } else {
                let log = self.log.as_mut();
                result = match self.ctx.finish(submitted, req, d.result, &mut batch) {
                    Ok(c) => queue::add_used_logged(queue, mem, log, req.head, c.used_len)
                        .map(|()| used += 1),
                    Err(e) => Err(broken(format_args!("head {}: {e}", req.head))),
                };
            }
            self.requests.release(tag);
            released = true;
        }
        self.done = done;
        if released {
            self.retry.released();
        }
        result.map(|()| used)
    }
}

impl<M: GuestMemory + Clone + Send + Sync + 'static> QueueWorker<M> for BlockWorker<M> {
    fn queue_indexes(&self) -> Vec<u16> {
        vec![self.queue_index]
    }

    fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        let mut v = Vec::new();
        if let Some(fd) = self.engine.notifier() {
            v.push((fd, ENGINE_TOKEN));
        }
        if let Some(fd) = self.retry.timer_fd() {
            v.push((fd, RETRY_TOKEN));
        }
        if let Some(fd) = self.retry.wake_fd() {
            v.push((fd, WAKE_TOKEN));
        }
        v
    }

    fn handle(&mut self, event: WorkerEvent, mem: &M, queues: Queues<'_, '_>) -> Handled {
        let [queue] = queues else {
            return Err(WorkerError::UnexpectedEvent(event));
        };
        let mut pass = match event {
            WorkerEvent::Kick(0) => true,
            WorkerEvent::Fd(ENGINE_TOKEN) => false,
            WorkerEvent::Fd(RETRY_TOKEN | WAKE_TOKEN) => {
                self.retry.fired();
                true
            }
            _ => return Err(WorkerError::UnexpectedEvent(event)),
        };
        if self.resume {
            self.resume = false;
            self.resubmit = queue::resume(queue, mem, self.log.as_mut())?;
            self.ctx
                .metrics()
                .inflight_resubmitted
                .add(self.resubmit.len() as u64);
            pass = true;
        }
        let mut used = 0;
        if self.deferred {
            // A pass stopped on a full pool: the completions waiting free the slots it needs,
            // so they are reaped before it runs again.
            used += self.complete(mem, queue)?;
        }
        if pass || self.deferred {
            used += self.submit(mem, queue)?;
        }
        loop {
            // The reap after the submission (the only one of an event unless a pass was
            // waiting for slots). If a pass stopped on a full pool and these completions
            // freed slots, the next pass must run now: the eventfd they raised was consumed
            // by this reap, so no event would bring it.
            let freed = self.complete(mem, queue)?;
            used += freed;
            if !(self.deferred && freed > 0) {
                break;
            }
            used += self.submit(mem, queue)?;
        }
        let mut signal = Signal::NONE;
        if used > 0 {
            queue::notify(queue, mem, 0, &mut signal)?;
        }
        Ok(signal)
    }

    fn quiesce(&mut self, mem: &M, queues: &mut [&mut Queue]) -> Result<Signal, WorkerError> {
        let [queue] = queues else {
            return Ok(Signal::NONE);
        };
        // Every popped request is in `requests` (a chain deferred on a full pool was given
        // back to the ring); the same bounds on waits as the drop's.
        let mut used = self.complete(mem, queue)?;
        let mut waits = self.waits();
        while !self.requests.is_empty() && waits.next().is_some() {
            self.engine.kick();
            self.engine.wait();
            used += self.complete(mem, queue)?;
        }
        let mut signal = Signal::NONE;
        if used > 0 {
            queue::notify(queue, mem, 0, &mut signal)?;
        }
        Ok(signal)
    }

    fn track_heads(&mut self, mut logs: Vec<Box<dyn HeadLog>>) -> bool {
        match (logs.pop(), logs.is_empty()) {
            (Some(log), true) => {
                self.log = log;
                self.resume = true;
                self.resubmit.clear();
                true
            }
            _ => false,
        }
    }

    fn stats(&self) -> serde_json::Value {
        json!({
            "queue": self.queue_index,
            "in_flight": self.requests.len(),
            "slot_wakeups": self.retry.rounds,
        })
    }
}

/// Engine waits a quiesce or a drop spends on requests in flight before giving up on them,
/// at most (each wait ends with a completion, a signal or a short time slice); the time limit
/// is [`BlockConfig::give_up_after`](super::BlockConfig::give_up_after).
const QUIESCE_ROUNDS: u32 = 100_000;

impl<M: GuestMemory> BlockWorker<M> {
    /// The waits a quiesce or the drop may still spend: one item per wait, ending at
    /// [`QUIESCE_ROUNDS`] waits or at `give_up_after` from now.
    fn waits(&self) -> impl Iterator<Item = ()> {
        let deadline = Instant::now() + self.give_up_after;
        (0..QUIESCE_ROUNDS)
            .map(|_| ())
            .take_while(move |()| Instant::now() < deadline)
    }
}

impl<M: GuestMemory> Drop for BlockWorker<M> {
    fn drop(&mut self) {
        // Device reset or teardown with I/O in flight: wait for the host to finish with the
        // buffers, then release every mapping (nothing is written to the guest any more).
        let mut done = Vec::new();
        let mut waits = self.waits();
        while !self.requests.is_empty() && waits.next().is_some() {
            self.engine.kick();
            self.engine.wait();
            self.engine.reap(&mut done);
            let mut batch = self.ctx.batch();
            for d in done.drain(..) {
                let tag = usize::try_from(d.tag).unwrap_or(usize::MAX);
                if let Some(req) = self.requests.get_mut(tag) {
                    if let Some(mem) = req.mem.take() {
                        self.ctx.release(&*mem, req, &mut batch);
                    }
                }
                self.requests.release(tag);
            }
            if self.engine.in_flight() == 0 {
                break;
            }
        }
        if !self.requests.is_empty() {
            // The engine gave up waiting: the kernel may still write into these requests'
            // buffers. Their memory (the guest memory they pin, their bounce slots) is kept
            // for good rather than unmapped under it.
            let leaked = std::mem::take(&mut self.requests);
            self.ctx.metrics().leaked_requests.add(leaked.len() as u64);
            tracing::error!(
                "virtio-blk: {} requests still pending at reset; their memory is kept (leaked) for the kernel that may still write into it",
                leaked.len()
            );
            std::mem::forget(leaked);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KickPacer;

    #[test]
    fn the_pacer_hands_over_the_first_request_at_once_then_doubling_batches() {
        let mut p = KickPacer::default();
        let kicked_after: Vec<usize> = (1..=40).filter(|_| p.prepared()).collect();
        // Requests 33-40 wait for the end of the pass.
        assert_eq!(kicked_after, [1, 2, 4, 8, 16, 32]);
        // A new pass starts over.
        let mut p = KickPacer::default();
        assert!(p.prepared());
    }
}
