//! What every device and transport counts and logs with: one [`Counter`] type, a [`LogOnce`]
//! latch for guest-triggerable warnings (log once, count always), the two together as a
//! [`LoggedCounter`], and [`lock`], the one poison-tolerant mutex helper.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use serde::ser::{Serialize, Serializer};

/// A relaxed atomic counter (statistics, not synchronisation) that serialises as its value.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds 1.
    pub fn inc(&self) {
        self.add(1);
    }

    /// Raises the value to at least `v` (a high-water mark).
    pub fn max(&self, v: u64) {
        self.0.fetch_max(v, Ordering::Relaxed);
    }

    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Serialize for Counter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.get())
    }
}

/// A latch for warnings a guest can trigger at will: [`LogOnce::first`] is true exactly once,
/// so the first occurrence is logged and later ones are only counted.
#[derive(Debug, Default)]
pub struct LogOnce(AtomicBool);

impl LogOnce {
    /// True the first time only.
    pub fn first(&self) -> bool {
        !self.0.swap(true, Ordering::Relaxed)
    }
}

/// A [`Counter`] of a condition a guest or front end can trigger at will, with its
/// [`LogOnce`]: [`LoggedCounter::note`] counts every occurrence and logs the first as a
/// warning (later ones at debug level). It serialises as its count.
#[derive(Debug, Default)]
pub struct LoggedCounter {
    count: Counter,
    logged: LogOnce,
}

impl LoggedCounter {
    /// Counts one occurrence of `what`; the first is logged, naming the counter `name` so the
    /// reader knows where the later ones go.
    pub fn note(&self, name: &str, what: impl std::fmt::Display) {
        self.count.inc();
        if self.logged.first() {
            tracing::warn!("{what} (logged once, counted in {name})");
        } else {
            tracing::debug!("{what}");
        }
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.count.get()
    }
}

impl Serialize for LoggedCounter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.count.serialize(s)
    }
}

/// Locks `m`; a poisoned lock (a thread panicked while holding it) still holds usable state,
/// and a device must go on serving rather than panic in turn.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_count_latches_latch_and_poison_is_tolerated() {
        let c = Counter::default();
        c.inc();
        c.add(2);
        c.max(2);
        assert_eq!(c.get(), 3);
        c.max(9);
        assert_eq!(serde_json::to_value(&c).unwrap(), 9);
        let once = LogOnce::default();
        assert!(once.first());
        assert!(!once.first());
        let noted = LoggedCounter::default();
        noted.note("x", "first");
        noted.note("x", "second");
        assert_eq!(noted.get(), 2);
        assert_eq!(serde_json::to_value(&noted).unwrap(), 2);
        let m = std::sync::Arc::new(Mutex::new(5));
        let m2 = std::sync::Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 5);
    }
}
