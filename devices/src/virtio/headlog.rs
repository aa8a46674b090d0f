//! A record of the heads a queue has popped and not yet put on the used ring, kept by the
//! transport where it outlives the device's process: vhost-user's inflight region
//! (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`), which the front end holds and hands to the next
//! back end after a crash. With it, a device started again serves the requests that were in
//! flight when the last one died, in the order they were popped, and resumes the available
//! ring where it stopped.
//!
//! The queue-service loop ([`super::queue`]) writes the log, so every worker that is given one
//! ([`super::QueueWorker::track_heads`]) keeps it the same way:
//! - [`HeadLog::popped`] before the device acts on a head (a crash after any side effect of
//!   the request finds it marked);
//! - [`HeadLog::unpopped`] when a head goes back to the available ring ([`super::queue::Step::Defer`]);
//! - [`HeadLog::using`] just before its used entry is written, [`HeadLog::used`] just after
//!   (the used index the driver sees now counts it): a crash between the two is told apart by
//!   comparing the log's used index with the ring's.
//!
//! Before serving anything, a worker with a new log calls [`super::queue::resume`], which asks
//! the log for the heads still in flight ([`HeadLog::resume`], oldest first) given the used
//! ring's index, and moves the queue's next available index past them: every head popped
//! before is either counted by the used index or in flight, so the next one to pop is
//! `used index + heads in flight`, whatever position the front end sent.
//!
//! The log's storage is shared with the front end, which may write anything there at any
//! time: an implementation never trusts what it reads back, and [`HeadLog::resume`] refuses a
//! record it cannot make sense of (the worker then breaks: DEVICE_NEEDS_RESET).

use std::fmt;

/// Where a queue's popped heads are recorded (see the module docs).
pub trait HeadLog: Send + fmt::Debug {
    /// Reads the record back before the queue is served: completes the bookkeeping of a used
    /// entry that reached the ring before the process died (`used_idx` is the used ring's
    /// index), and returns the heads still in flight, in the order they were popped. Every
    /// head returned is below `queue_size`, once.
    ///
    /// # Errors
    /// A description of what is wrong with the record (a size other than `queue_size`, a used
    /// index further behind the ring's than a queue, heads out of range, an order that
    /// cannot be told).
    fn resume(&mut self, used_idx: u16, queue_size: u16) -> Result<Vec<u16>, String>;

    /// `head` was popped from the available ring; the device is about to act on it.
    fn popped(&mut self, head: u16);

    /// `head` went back to the available ring untouched.
    fn unpopped(&mut self, head: u16);

    /// `head`'s used entry is about to be written.
    fn using(&mut self, head: u16);

    /// `head`'s used entry is on the ring, whose index is now `used_idx`.
    fn used(&mut self, head: u16, used_idx: u16);
}

/// No record: what a queue without a log uses (every call does nothing).
#[derive(Clone, Copy, Debug, Default)]
pub struct Unlogged;

impl HeadLog for Unlogged {
    fn resume(&mut self, _used_idx: u16, _queue_size: u16) -> Result<Vec<u16>, String> {
        Ok(Vec::new())
    }
    fn popped(&mut self, _head: u16) {}
    fn unpopped(&mut self, _head: u16) {}
    fn using(&mut self, _head: u16) {}
    fn used(&mut self, _head: u16, _used_idx: u16) {}
}

/// A log kept in process memory, for tests: the heads in flight, in pop order, and every
/// call seen.
#[cfg(any(test, feature = "test-utils"))]
#[derive(Debug, Default, Clone)]
pub struct MemLog {
    /// Heads in flight, oldest first.
    pub in_flight: Vec<u16>,
    /// The used index last reported by [`HeadLog::used`].
    pub used_idx: u16,
    /// Heads between [`HeadLog::using`] and [`HeadLog::used`] (at most one at a time).
    pub using: Option<u16>,
}

#[cfg(any(test, feature = "test-utils"))]
impl HeadLog for MemLog {
    fn resume(&mut self, used_idx: u16, queue_size: u16) -> Result<Vec<u16>, String> {
        if let Some(h) = self.using.take() {
            if used_idx != self.used_idx {
                self.in_flight.retain(|&x| x != h);
                self.used_idx = used_idx;
            }
        }
        if let Some(h) = self.in_flight.iter().find(|&&h| h >= queue_size) {
            return Err(format!("head {h} out of a queue of {queue_size}"));
        }
        Ok(self.in_flight.clone())
    }
    fn popped(&mut self, head: u16) {
        self.in_flight.push(head);
    }
    fn unpopped(&mut self, head: u16) {
        self.in_flight.retain(|&x| x != head);
    }
    fn using(&mut self, head: u16) {
        self.using = Some(head);
    }
    fn used(&mut self, head: u16, used_idx: u16) {
        self.in_flight.retain(|&x| x != head);
        self.used_idx = used_idx;
        self.using = None;
    }
}
