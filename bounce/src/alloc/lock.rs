//! A mutex that measures how long callers wait for it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Counters of one lock at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockSnapshot {
    /// Times the lock was taken.
    pub acquisitions: u64,
    /// Times a caller found it held and had to wait.
    pub contended: u64,
    /// Total nanoseconds spent waiting.
    pub wait_ns: u64,
}

/// A `std::sync::Mutex` that counts acquisitions and contention.
///
/// An uncontended acquisition costs one `try_lock` and one relaxed increment; the clock is read
/// only when the lock is found held, so the measurement does not slow the fast path much.
/// A poisoned lock is recovered (the data it protects is kept consistent by its users, who never
/// panic while holding it).
///
/// Aligned to 128 bytes (the adjacent-line prefetcher pairs 64-byte lines): the allocators keep
/// one per area in a slice, and areas exist so that workers do not share anything. Packed, two
/// areas' locks, counters and state shared lines, and two threads on their own areas slowed
/// each other down: `areas-lifo` took 93-121 ns per alloc+free pair at two threads against 43
/// at one, `iova-bitmap` 103-135 against 41 (`bounce-experiment --split`, docs/studies/allocators-host.md);
/// aligned, both take the same at two threads as at one.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct TimedMutex<T> {
    inner: Mutex<T>,
    acquisitions: AtomicU64,
    contended: AtomicU64,
    wait_ns: AtomicU64,
}

impl<T> TimedMutex<T> {
    /// Wraps `value`.
    pub fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(value),
            acquisitions: AtomicU64::new(0),
            contended: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
        }
    }

    /// Takes the lock, recording the wait if there was one.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.acquisitions.fetch_add(1, Ordering::Relaxed);
        match self.inner.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                let start = Instant::now();
                let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                let waited = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
                self.contended.fetch_add(1, Ordering::Relaxed);
                self.wait_ns.fetch_add(waited, Ordering::Relaxed);
                guard
            }
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> LockSnapshot {
        LockSnapshot {
            acquisitions: self.acquisitions.load(Ordering::Relaxed),
            contended: self.contended.load(Ordering::Relaxed),
            wait_ns: self.wait_ns.load(Ordering::Relaxed),
        }
    }

    /// Zeroes the counters.
    pub fn reset_stats(&self) {
        self.acquisitions.store(0, Ordering::Relaxed);
        self.contended.store(0, Ordering::Relaxed);
        self.wait_ns.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_in_a_slice_never_share_a_line_pair() {
        let locks: Box<[TimedMutex<[u8; 40]>]> = (0..4).map(|_| TimedMutex::new([0; 40])).collect();
        for pair in locks.windows(2) {
            let (a, b) = (&pair[0] as *const _ as usize, &pair[1] as *const _ as usize);
            assert_eq!(a % 128, 0);
            assert!(b - a >= 128 && b % 128 == 0);
        }
    }
}
