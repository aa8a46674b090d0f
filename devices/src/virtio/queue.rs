//! The one queue-service loop every device uses: pop chains from the available ring, hand each
//! to the device, put completions on the used ring, decide whether the driver needs an
//! interrupt.
//!
//! # The loop ([`drain`])
//! - Notifications are disabled while the ring is drained and re-enabled only once it is found
//!   empty; after re-enabling, the ring is checked again and drained on if the driver added
//!   chains in between (with EVENT_IDX a kick would otherwise be lost).
//! - Each pass pops at most one queue's worth of heads, and every pass must make progress: an
//!   available index that runs more than a queue ahead, an available-ring entry that cannot be
//!   read, or a head index outside the queue is [`WorkerError::Broken`], never a retry. So the
//!   loop ends whatever the guest wrote, and only runs on while the driver really adds chains.
//! - The device answers each popped head with a [`Step`]: [`Step::Used`] puts it on the used
//!   ring at once; [`Step::Held`] keeps it (the device completes it later with [`add_used`]);
//!   [`Step::Enough`] keeps it and stops popping; [`Step::Defer`] puts it back on the available
//!   ring and stops (throttling, a full engine). Every head popped therefore gets exactly one
//!   used entry, now or later, or goes back to the ring.
//! - [`notify`] decides once per batch whether the driver wants an interrupt: `used_event` with
//!   EVENT_IDX, otherwise the avail ring's VRING_AVAIL_F_NO_INTERRUPT flag (virtio 1.2, 2.7.10),
//!   which `virtio-queue` does not look at.
//!
//! # Synchronous devices
//! Block (with a synchronous disk), net TX and the control queue serve each chain inside the
//! callback and return [`Step::Used`]; net RX pops chains into its own list with [`Step::Held`]
//! / [`Step::Enough`] until a frame fills them, then completes them with [`add_used`].
//!
//! # How an asynchronous engine plugs in
//! Submission and completion are two separate calls, as in QEMU's `block/io_uring.c` and
//! Firecracker's `block/virtio/io/async_io.rs`:
//! 1. **Submission** (on a queue kick, and after completions freed room): `drain` with a
//!    callback that walks and parses the chain ([`super::chain::ChainHead::walk`]), maps its
//!    buffers, queues the I/O in the engine's submission queue and returns [`Step::Held`]; a
//!    request that fails to parse is answered at once with [`Step::Used`] (its status written);
//!    when the engine is full (no free in-flight slot, the bounce pool momentarily full) it
//!    returns [`Step::Defer`], which leaves the head on the ring for the next submission pass.
//!    Submit the batch to the kernel once `drain` returns. The pending request owns its DMA
//!    mappings and the head.
//! 2. **Completion** (on the engine's eventfd, one of the worker's
//!    [`super::QueueWorker::extra_fds`]): for each reaped I/O, in completion order, unmap, write
//!    the status, then [`add_used`]; after the batch, one [`notify`]. If submission had
//!    deferred, run a submission pass again.
//!
//! Since `Defer` leaves notifications disabled, a deferred queue is resumed by the device
//! itself (a completion, a timer), not by a kick.
//!
//! # A log of the heads in flight
//! [`drain_logged`] and [`add_used_logged`] keep a [`HeadLog`] (vhost-user's inflight region)
//! as the loop pops, gives back and uses heads; after a restart [`resume`] reads back the heads
//! it recorded as in flight, which `drain_logged` serves before popping anything new. [`drain`]
//! and [`add_used`] are the same loop without a log.

use std::collections::VecDeque;
use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use super::chain::ChainHead;
use super::headlog::{HeadLog, Unlogged};
use super::spec::VRING_AVAIL_F_NO_INTERRUPT;
use super::{Signal, WorkerError};

/// What the device did with a popped head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Done: put it on the used ring with this length now.
    Used(u32),
    /// Kept by the device, which completes it later with [`add_used`]; go on popping.
    Held,
    /// Kept by the device; stop popping (it has what it needs).
    Enough,
    /// Not taken: put it back on the available ring and stop.
    Defer,
}

/// What one [`drain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drained {
    /// Heads popped (a deferred one not included).
    pub popped: usize,
    /// Used entries added by the loop ([`Step::Used`]).
    pub used: usize,
    /// Passes over the ring.
    pub passes: usize,
    /// The most chains found waiting at the start of a pass (a queue-depth high-water mark).
    pub deepest: u16,
    /// The loop stopped on [`Step::Enough`] or [`Step::Defer`] rather than on an empty ring.
    pub stopped: bool,
}

fn broken(what: &str, e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Broken(format!("{what}: {e}"))
}

/// Chains waiting in `queue` (available index minus the next one to pop).
///
/// # Errors
/// [`WorkerError::Broken`] when the available index cannot be read or runs more than a queue
/// ahead (virtio 1.2, 2.7.6: the driver broke the ring).
pub fn waiting<M: GuestMemory>(queue: &Queue, mem: &M) -> Result<u16, WorkerError> {
    let avail = queue
        .avail_idx(mem, Ordering::Acquire)
        .map_err(|e| broken("available index", e))?;
    let depth = (avail - Wrapping(queue.next_avail())).0;
    if depth > queue.size() {
        return Err(WorkerError::Broken(format!(
            "available index {} is {depth} ahead of {} in a queue of {}",
            avail.0,
            queue.next_avail(),
            queue.size()
        )));
    }
    Ok(depth)
}

/// Pops one head, or `None` when the ring is empty.
fn pop<M: GuestMemory>(queue: &mut Queue, mem: &M) -> Result<Option<ChainHead>, WorkerError> {
    let size = queue.size();
    let desc_table = queue.desc_table();
    // Read the available index before the iterator does: it only grows, so if chains were
    // waiting by this read and the iterator still yields nothing, the entry really cannot be
    // read. (Reading it after would race with a driver that publishes a chain between the
    // iterator's read and ours, and break a healthy device.)
    let waiting_before = waiting(queue, mem)?;
    let head = {
        let mut iter = queue.iter(mem).map_err(|e| broken("available ring", e))?;
        iter.next().map(|c| c.head_index())
    };
    match head {
        Some(head) if head < size => Ok(Some(ChainHead {
            head,
            desc_table,
            queue_size: size,
        })),
        // No used entry can name this head (its id would be out of range).
        Some(head) => Err(WorkerError::Broken(format!(
            "head index {head} out of range (queue of {size})"
        ))),
        None if waiting_before != 0 => Err(WorkerError::Broken(
            "available ring entry cannot be read".into(),
        )),
        None => Ok(None),
    }
}

/// Drains `queue` through `serve` (see the module docs).
///
/// # Errors
/// [`WorkerError::Broken`] when the rings cannot be read or written, or the driver broke
/// them; `serve`'s error.
pub fn drain<M, F>(queue: &mut Queue, mem: &M, serve: F) -> Result<Drained, WorkerError>
where
    M: GuestMemory,
    F: FnMut(ChainHead) -> Result<Step, WorkerError>,
{
    drain_logged(queue, mem, &mut Unlogged, &mut VecDeque::new(), serve)
}

/// [`drain`], recording in `log` each head popped (before `serve` sees it), given back
/// ([`Step::Defer`]) or used ([`Step::Used`]); first serves `again`, the heads [`resume`]
/// found in flight, in order (they are still recorded as popped). A head of `again` the device
/// defers stays first there and the call stops; nothing new is popped before `again` is empty.
///
/// # Errors
/// As [`drain`].
pub fn drain_logged<M, L, F>(
    queue: &mut Queue,
    mem: &M,
    log: &mut L,
    again: &mut VecDeque<u16>,
    mut serve: F,
) -> Result<Drained, WorkerError>
where
    M: GuestMemory,
    L: HeadLog + ?Sized,
    F: FnMut(ChainHead) -> Result<Step, WorkerError>,
{
    let mut out = Drained::default();
    let (desc_table, queue_size) = (queue.desc_table(), queue.size());
    while let Some(&head) = again.front() {
        if head >= queue_size {
            return Err(WorkerError::Broken(format!(
                "in-flight head {head} out of range (queue of {queue_size})"
            )));
        }
        let at = ChainHead {
            head,
            desc_table,
            queue_size,
        };
        match serve(at)? {
            Step::Used(len) => {
                add_used_logged(queue, mem, log, head, len)?;
                out.used += 1;
            }
            Step::Held | Step::Enough => {}
            Step::Defer => {
                out.stopped = true;
                return Ok(out);
            }
        }
        again.pop_front();
        out.popped += 1;
    }
    loop {
        queue
            .disable_notification(mem)
            .map_err(|e| broken("disable notification", e))?;
        out.passes += 1;
        let depth = waiting(queue, mem)?;
        out.deepest = out.deepest.max(depth);
        let mut left = queue.size();
        let mut progressed = false;
        while left > 0 {
            let Some(at) = pop(queue, mem)? else {
                break;
            };
            left -= 1;
            log.popped(at.head);
            match serve(at)? {
                Step::Used(len) => {
                    add_used_logged(queue, mem, log, at.head, len)?;
                    out.used += 1;
                }
                Step::Held => {}
                Step::Enough => {
                    out.popped += 1;
                    out.stopped = true;
                    return Ok(out);
                }
                Step::Defer => {
                    log.unpopped(at.head);
                    queue.go_to_previous_position();
                    out.stopped = true;
                    return Ok(out);
                }
            }
            out.popped += 1;
            progressed = true;
        }
        if left == 0 {
            // A full queue's worth in one pass: look again before re-arming.
            continue;
        }
        if !queue
            .enable_notification(mem)
            .map_err(|e| broken("enable notification", e))?
        {
            return Ok(out);
        }
        if !progressed && waiting(queue, mem)? == 0 {
            // The index moved back: nothing to do (pop reports a real inconsistency).
            return Ok(out);
        }
    }
}

/// Puts `head` on the used ring with `len` bytes written.
///
/// # Errors
/// [`WorkerError::Broken`] when the used ring cannot be written.
pub fn add_used<M: GuestMemory>(
    queue: &mut Queue,
    mem: &M,
    head: u16,
    len: u32,
) -> Result<(), WorkerError> {
    add_used_logged(queue, mem, &mut Unlogged, head, len)
}

/// [`add_used`], recorded in `log`: [`HeadLog::using`] before the entry is written,
/// [`HeadLog::used`] with the new used index once the driver can see it.
///
/// # Errors
/// As [`add_used`].
pub fn add_used_logged<M: GuestMemory, L: HeadLog + ?Sized>(
    queue: &mut Queue,
    mem: &M,
    log: &mut L,
    head: u16,
    len: u32,
) -> Result<(), WorkerError> {
    log.using(head);
    queue
        .add_used(mem, head, len)
        .map_err(|e| broken("used ring", e))?;
    log.used(head, queue.next_used());
    Ok(())
}

/// Resumes `queue` from `log` before it is served (a worker given a new log): the heads still
/// in flight, oldest first, to serve again ([`drain_logged`]) before anything new; the
/// queue's next used index is the used ring's, and its next available index that plus the
/// heads in flight (each head popped before is either used or in flight).
///
/// # Errors
/// [`WorkerError::Broken`] when the used ring cannot be read or the log refuses its record.
pub fn resume<M: GuestMemory, L: HeadLog + ?Sized>(
    queue: &mut Queue,
    mem: &M,
    log: &mut L,
) -> Result<VecDeque<u16>, WorkerError> {
    let used = queue
        .used_idx(mem, Ordering::Acquire)
        .map_err(|e| broken("used index", e))?;
    let heads = log
        .resume(used.0, queue.size())
        .map_err(|e| WorkerError::Broken(format!("in-flight record: {e}")))?;
    // The log returns at most one entry per head, each below the queue size (<= 32768).
    let in_flight = u16::try_from(heads.len()).map_err(|_| {
        WorkerError::Broken(format!("in-flight record lists {} heads", heads.len()))
    })?;
    queue.set_next_used(used.0);
    queue.set_next_avail((used + Wrapping(in_flight)).0);
    Ok(heads.into())
}

/// Whether the driver wants a used-buffer notification now: `used_event` with EVENT_IDX,
/// otherwise the avail ring's VRING_AVAIL_F_NO_INTERRUPT flag.
///
/// # Errors
/// [`WorkerError::Broken`] when the rings cannot be read.
pub fn needs_notification<M: GuestMemory>(queue: &mut Queue, mem: &M) -> Result<bool, WorkerError> {
    let needed = queue
        .needs_notification(mem)
        .map_err(|e| broken("used event", e))?;
    if !needed || queue.event_idx_enabled() {
        return Ok(needed);
    }
    let flags: u16 = mem
        .load(GuestAddress(queue.avail_ring()), Ordering::Acquire)
        .map_err(|e| broken("avail flags", e))?;
    Ok(u16::from_le(flags) & VRING_AVAIL_F_NO_INTERRUPT == 0)
}

/// Ends a batch of used entries on the queue at `position` of the worker: adds it to `sig`
/// when the driver wants a notification. Call once per batch, after the last [`add_used`].
///
/// # Errors
/// As [`needs_notification`].
pub fn notify<M: GuestMemory>(
    queue: &mut Queue,
    mem: &M,
    position: usize,
    sig: &mut Signal,
) -> Result<(), WorkerError> {
    if needs_notification(queue, mem)? {
        sig.add(position);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{device_queue, GuestRam};
    use crate::virtio::driver::{Buf, DriverQueue, Used};

    fn setup(event_idx: bool) -> (GuestRam, DriverQueue, Queue) {
        let mut ram = GuestRam::new(1 << 20);
        let vq = ram.new_queue(8, event_idx);
        let q = device_queue(&vq.layout(), 8, event_idx);
        (ram, vq, q)
    }

    fn post(ram: &GuestRam, vq: &mut DriverQueue, n: usize) -> Vec<u16> {
        (0..n)
            .map(|i| {
                let h = vq
                    .add_chain(ram.mem(), &[Buf::wo(0x8000 + 64 * i as u64, 64)])
                    .unwrap();
                vq.push(ram.mem(), h).unwrap();
                vq.publish(ram.mem()).unwrap();
                h
            })
            .collect()
    }

    fn reap(ram: &GuestRam, vq: &mut DriverQueue) -> Vec<Used> {
        std::iter::from_fn(|| vq.next_used(ram.mem()).unwrap()).collect()
    }

    #[test]
    fn every_popped_head_gets_one_used_entry_and_one_notification_per_batch() {
        let (ram, mut vq, mut q) = setup(false);
        let heads = post(&ram, &mut vq, 5);
        let mut seen = Vec::new();
        let d = drain(&mut q, ram.mem(), |at| {
            seen.push(at.head);
            Ok(Step::Used(7))
        })
        .unwrap();
        assert_eq!(seen, heads);
        assert_eq!((d.popped, d.used, d.deepest, d.stopped), (5, 5, 5, false));
        let used = reap(&ram, &mut vq);
        assert_eq!(used.len(), 5);
        assert!(used.iter().all(|u| u.len == 7));
        let mut sig = Signal::NONE;
        notify(&mut q, ram.mem(), 3, &mut sig).unwrap();
        assert!(sig.has(3));
    }

    #[test]
    fn no_interrupt_is_honoured_without_event_idx() {
        let (ram, mut vq, mut q) = setup(false);
        post(&ram, &mut vq, 1);
        vq.set_no_interrupt(ram.mem(), true).unwrap();
        drain(&mut q, ram.mem(), |_| Ok(Step::Used(0))).unwrap();
        assert!(!needs_notification(&mut q, ram.mem()).unwrap());
        vq.set_no_interrupt(ram.mem(), false).unwrap();
        assert!(needs_notification(&mut q, ram.mem()).unwrap());
    }

    #[test]
    fn event_idx_re_arms_at_the_next_head_and_used_event_decides() {
        let (ram, mut vq, mut q) = setup(true);
        post(&ram, &mut vq, 3);
        vq.set_used_event(ram.mem(), 5).unwrap();
        drain(&mut q, ram.mem(), |_| Ok(Step::Used(0))).unwrap();
        assert_eq!(
            vq.avail_event(ram.mem()).unwrap(),
            3,
            "avail_event re-armed at next_avail"
        );
        assert!(
            !needs_notification(&mut q, ram.mem()).unwrap(),
            "used index 3 has not passed used_event 5"
        );
        reap(&ram, &mut vq);
        post(&ram, &mut vq, 3);
        drain(&mut q, ram.mem(), |_| Ok(Step::Used(0))).unwrap();
        assert!(needs_notification(&mut q, ram.mem()).unwrap());
    }

    #[test]
    fn chains_added_while_serving_are_drained_in_the_same_call() {
        let (ram, mut vq, mut q) = setup(true);
        post(&ram, &mut vq, 1);
        let mut more = 2;
        let mut served = 0;
        // The "driver" adds chains from inside the callback, i.e. while notifications are
        // off: the re-check after enable_notification must find them.
        drain(&mut q, ram.mem(), |_| {
            served += 1;
            if more > 0 {
                more -= 1;
                post(&ram, &mut vq, 1);
            }
            Ok(Step::Used(0))
        })
        .unwrap();
        assert_eq!(served, 3);
    }

    #[test]
    fn defer_puts_the_head_back_and_held_heads_complete_later() {
        let (ram, mut vq, mut q) = setup(false);
        let heads = post(&ram, &mut vq, 3);
        let mut n = 0;
        let d = drain(&mut q, ram.mem(), |_| {
            n += 1;
            Ok(if n < 3 { Step::Held } else { Step::Defer })
        })
        .unwrap();
        assert_eq!((d.popped, d.used, d.stopped), (2, 0, true));
        assert_eq!(q.next_avail(), 2, "the deferred head is back on the ring");
        add_used(&mut q, ram.mem(), heads[1], 1).unwrap();
        add_used(&mut q, ram.mem(), heads[0], 1).unwrap();
        let ids: Vec<u32> = reap(&ram, &mut vq).iter().map(|u| u.id).collect();
        assert_eq!(ids, vec![u32::from(heads[1]), u32::from(heads[0])]);
        let d = drain(&mut q, ram.mem(), |_| Ok(Step::Enough)).unwrap();
        assert_eq!((d.popped, d.stopped), (1, true));
    }

    #[test]
    fn a_log_sees_every_pop_give_back_and_use_and_a_restart_serves_the_heads_in_flight_first() {
        use crate::virtio::headlog::MemLog;
        let (ram, mut vq, mut q) = setup(false);
        let heads = post(&ram, &mut vq, 4);
        let mut log = MemLog::default();
        let mut n = 0;
        // Heads 0 and 1 held, 2 used at once, 3 deferred (back on the ring).
        drain_logged(&mut q, ram.mem(), &mut log, &mut VecDeque::new(), |_| {
            n += 1;
            Ok(match n {
                1 | 2 => Step::Held,
                3 => Step::Used(1),
                _ => Step::Defer,
            })
        })
        .unwrap();
        assert_eq!(log.in_flight, vec![heads[0], heads[1]]);
        assert_eq!(log.used_idx, 1);
        add_used_logged(&mut q, ram.mem(), &mut log, heads[1], 1).unwrap();
        assert_eq!(log.in_flight, vec![heads[0]]);
        // The device dies; a new queue starts wherever the front end says (0 here).
        let mut q = device_queue(&vq.layout(), 8, false);
        let mut again = resume(&mut q, ram.mem(), &mut log).unwrap();
        assert_eq!(again, [heads[0]]);
        assert_eq!((q.next_used(), q.next_avail()), (2, 3));
        let mut served = Vec::new();
        drain_logged(&mut q, ram.mem(), &mut log, &mut again, |at| {
            served.push(at.head);
            Ok(Step::Used(1))
        })
        .unwrap();
        assert!(again.is_empty());
        // The held head first, then the deferred one: each head used exactly once.
        assert_eq!(served, [heads[0], heads[3]]);
        assert!(log.in_flight.is_empty());
        let mut ids: Vec<u32> = reap(&ram, &mut vq).iter().map(|u| u.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, heads.iter().map(|&h| u32::from(h)).collect::<Vec<_>>());
    }

    #[test]
    fn a_crash_between_the_used_entry_and_the_log_is_completed_not_served_again() {
        use crate::virtio::headlog::MemLog;
        let (ram, mut vq, mut q) = setup(false);
        let heads = post(&ram, &mut vq, 2);
        let mut log = MemLog::default();
        drain_logged(&mut q, ram.mem(), &mut log, &mut VecDeque::new(), |_| {
            Ok(Step::Held)
        })
        .unwrap();
        // The used entry of heads[1] reaches the ring, the log is not told.
        log.using(heads[1]);
        add_used(&mut q, ram.mem(), heads[1], 1).unwrap();
        let mut q = device_queue(&vq.layout(), 8, false);
        let again = resume(&mut q, ram.mem(), &mut log).unwrap();
        assert_eq!(again, [heads[0]]);
        assert_eq!((q.next_used(), q.next_avail()), (1, 2));
        // A log that refuses its record breaks the worker.
        let mut bad = MemLog {
            in_flight: vec![100],
            ..MemLog::default()
        };
        assert!(matches!(
            resume(&mut q, ram.mem(), &mut bad),
            Err(WorkerError::Broken(_))
        ));
    }

    #[test]
    fn hostile_rings_break_instead_of_spinning() {
        // An available index far ahead.
        let (ram, vq, mut q) = setup(true);
        vq.set_avail_idx(ram.mem(), 100).unwrap();
        assert!(matches!(
            drain(&mut q, ram.mem(), |_| Ok(Step::Used(0))),
            Err(WorkerError::Broken(_))
        ));
        // A head index outside the queue.
        let (ram, mut vq, mut q) = setup(true);
        vq.push(ram.mem(), 200).unwrap();
        vq.publish(ram.mem()).unwrap();
        assert!(matches!(
            drain(&mut q, ram.mem(), |_| Ok(Step::Used(0))),
            Err(WorkerError::Broken(_))
        ));
    }
}
