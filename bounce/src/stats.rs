//! Pool statistics, like Linux's `/sys/kernel/debug/swiotlb` and more.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::alloc::{AllocatorKind, LockSnapshot};
use crate::geometry::PoolMode;

/// Live counters of a pool. All relaxed: they are statistics, not synchronisation.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub used: AtomicU64,
    pub hiwater: AtomicU64,
    pub maps: AtomicU64,
    pub unmaps: AtomicU64,
    pub map_failures: AtomicU64,
    pub bad_unmaps: AtomicU64,
    pub bytes_to_device: AtomicU64,
    pub bytes_from_device: AtomicU64,
    pub syncs_for_device: AtomicU64,
    pub syncs_for_cpu: AtomicU64,
    pub clamped: AtomicU64,
}

impl Counters {
    /// Linux `inc_used_and_hiwater`.
    pub fn inc_used(&self, n: usize) {
        let new = self.used.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        self.hiwater.fetch_max(new, Ordering::Relaxed);
    }

    pub fn dec_used(&self, n: usize) {
        self.used.fetch_sub(n as u64, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// A snapshot of a pool's statistics, serialisable to JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// swiotlb or iova.
    pub mode: PoolMode,
    /// The allocator.
    pub allocator: AllocatorKind,
    /// Slots in the pool (`io_tlb_nslabs`).
    pub nslabs: u64,
    /// Slot size in bytes.
    pub slot_size: u64,
    /// Areas.
    pub nareas: u64,
    /// Slots in use (`io_tlb_used`).
    pub used: u64,
    /// Highest `used` since creation or the last reset (`io_tlb_used_hiwater`).
    pub used_hiwater: u64,
    /// Slots in use per area, as the allocator counts them (approximate while maps run).
    pub area_used: Vec<u64>,
    /// Successful maps.
    pub maps: u64,
    /// Successful unmaps.
    pub unmaps: u64,
    /// Maps that failed because no run of slots fitted ("buffer is full").
    pub map_failures: u64,
    /// Unmaps of addresses that were not live mappings (refused).
    pub bad_unmaps: u64,
    /// Bytes copied from original buffers into the pool (map, sync for device).
    pub bytes_to_device: u64,
    /// Bytes copied from the pool back to original buffers (unmap, sync for cpu).
    pub bytes_from_device: u64,
    /// Syncs for the device.
    pub syncs_for_device: u64,
    /// Syncs for the CPU.
    pub syncs_for_cpu: u64,
    /// Copies clamped because they ran past the end of their mapping.
    pub clamped: u64,
    /// Lock counters, one per allocator lock (empty for lock-free allocators).
    pub locks: Vec<LockSnapshot>,
    /// Sum of `wait_ns` over all locks.
    pub lock_wait_ns: u64,
}

impl PoolStats {
    /// The statistics as a JSON string.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// Sub-buckets per power of two in [`Histogram`] (2^4: a bucket spans at most 1/16 of its
/// value, so a quantile read from it is within ~3 % of the true one).
const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
/// Buckets: values below `SUB` exactly, then `SUB` per power of two up to 2^64.
const BUCKETS: usize = SUB + (64 - SUB_BITS as usize) * SUB;

/// A log-linear histogram of durations in nanoseconds, updated with relaxed atomics from any
/// thread (no lock on the hot path), with count, sum and maximum.
#[derive(Debug)]
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }
}

fn bucket_of(ns: u64) -> usize {
    if ns < SUB as u64 {
        return ns as usize;
    }
    let e = 63 - ns.leading_zeros(); // >= SUB_BITS
    let sub = ((ns >> (e - SUB_BITS)) as usize) & (SUB - 1);
    SUB + (e - SUB_BITS) as usize * SUB + sub
}

/// The middle of bucket `i` (its exact value below `SUB`).
fn bucket_mid(i: usize) -> u64 {
    if i < SUB {
        return i as u64;
    }
    let e = ((i - SUB) / SUB) as u32 + SUB_BITS;
    let sub = ((i - SUB) % SUB) as u64;
    let width = 1u64 << (e - SUB_BITS);
    ((SUB as u64 + sub) << (e - SUB_BITS)).saturating_add(width / 2)
}

impl Histogram {
    /// Records one duration.
    pub fn record(&self, ns: u64) {
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// Adds everything `other` recorded.
    pub fn merge(&self, other: &Histogram) {
        for (a, b) in self.buckets.iter().zip(other.buckets.iter()) {
            a.fetch_add(b.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.count
            .fetch_add(other.count.load(Ordering::Relaxed), Ordering::Relaxed);
        self.sum_ns
            .fetch_add(other.sum_ns.load(Ordering::Relaxed), Ordering::Relaxed);
        self.max_ns
            .fetch_max(other.max_ns.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Forgets everything (not atomic with respect to concurrent records: a record racing
    /// with the reset may be half kept, which statistics tolerate).
    pub fn reset(&self) {
        for b in self.buckets.iter() {
            b.store(0, Ordering::Relaxed);
        }
        self.count.store(0, Ordering::Relaxed);
        self.sum_ns.store(0, Ordering::Relaxed);
        self.max_ns.store(0, Ordering::Relaxed);
    }

    /// The `q` quantile (0..=1) in ns, from the bucket it falls in; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count.load(Ordering::Relaxed);
        if n == 0 {
            return 0;
        }
        let target = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Ordering::Relaxed);
            if seen >= target {
                return bucket_mid(i).min(self.max_ns.load(Ordering::Relaxed));
            }
        }
        self.max_ns.load(Ordering::Relaxed)
    }

    /// A snapshot: count, total, mean, p50, p99, max.
    pub fn summary(&self) -> LatencySummary {
        let count = self.count.load(Ordering::Relaxed);
        let total_ns = self.sum_ns.load(Ordering::Relaxed);
        LatencySummary {
            count,
            total_ns,
            mean_ns: total_ns.checked_div(count).unwrap_or(0),
            p50_ns: self.quantile(0.5),
            p99_ns: self.quantile(0.99),
            max_ns: self.max_ns.load(Ordering::Relaxed),
        }
    }
}

/// What a [`Histogram`] holds, summarised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Durations recorded.
    pub count: u64,
    /// Their sum, ns.
    pub total_ns: u64,
    /// `total_ns / count`.
    pub mean_ns: u64,
    /// Median, ns (within ~3 %).
    pub p50_ns: u64,
    /// 99th percentile, ns (within ~3 %).
    pub p99_ns: u64,
    /// Largest, ns.
    pub max_ns: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_the_bucket_resolution() {
        let h = Histogram::default();
        for ns in 1..=100_000u64 {
            h.record(ns);
        }
        let s = h.summary();
        assert_eq!((s.count, s.max_ns), (100_000, 100_000));
        assert_eq!(s.mean_ns, 50_000);
        for (q, want) in [(0.5, 50_000.0), (0.99, 99_000.0)] {
            let got = h.quantile(q) as f64;
            assert!((got - want).abs() / want < 0.04, "q{q}: {got} vs {want}");
        }
        // Small values are exact.
        let h = Histogram::default();
        h.record(3);
        assert_eq!(h.summary().p50_ns, 3);
        let other = Histogram::default();
        other.record(7);
        h.merge(&other);
        assert_eq!((h.summary().count, h.quantile(1.0)), (2, 7));
        h.reset();
        assert_eq!(h.summary(), LatencySummary::default());
    }
}
