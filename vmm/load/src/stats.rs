//! Completion statistics: counts, bytes and a latency histogram of bounded size.
//!
//! Latencies go into a log-linear histogram (64 linear buckets, then 32 per power of two:
//! at most 1.6 % relative error, 1920 counters whatever the run length), as fio's own
//! latency bins do; mean, minimum and maximum are exact.

use std::time::Duration;

use serde::Serialize;

const SUB_BITS: u32 = 6;
const LINEAR: u64 = 1 << SUB_BITS;
const HALF: u64 = LINEAR / 2;
const BUCKETS: usize = (LINEAR + (64 - SUB_BITS as u64) * HALF) as usize;

fn bucket(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let g = msb - (SUB_BITS - 1);
    let sub = (v >> g) - HALF;
    (LINEAR + u64::from(g - 1) * HALF + sub) as usize
}

/// The smallest and largest value of bucket `i`.
fn bucket_range(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < LINEAR {
        return (i, i);
    }
    let g = (i - LINEAR) / HALF + 1;
    let sub = (i - LINEAR) % HALF + HALF;
    let lo = sub << g;
    (lo, lo.saturating_add((1u64 << g) - 1))
}

/// A latency histogram in nanoseconds.
#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    n: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            n: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

impl Histogram {
    /// Records one latency.
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[bucket(ns)] += 1;
        self.n += 1;
        self.sum += u128::from(ns);
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
    }

    /// Adds `other`'s samples.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.n += other.n;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// The `p`-th percentile (0 < p <= 100), in ns: the middle of the bucket holding it,
    /// clamped to the exact minimum and maximum.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.n == 0 {
            return 0;
        }
        // Rank of the sample (1-based), at least 1.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((p / 100.0 * self.n as f64).ceil() as u64).clamp(1, self.n);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (lo, hi) = bucket_range(i);
                return (lo + (hi - lo) / 2).clamp(self.min, self.max);
            }
        }
        self.max
    }

    /// Summary for reports.
    pub fn summary(&self) -> LatencySummary {
        #[allow(clippy::cast_precision_loss)]
        let mean = if self.n == 0 {
            0.0
        } else {
            self.sum as f64 / self.n as f64
        };
        LatencySummary {
            mean,
            min: if self.n == 0 { 0 } else { self.min },
            max: self.max,
            p50: self.percentile(50.0),
            p99: self.percentile(99.0),
            p99_9: self.percentile(99.9),
        }
    }
}

/// Completion latency figures, in nanoseconds.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct LatencySummary {
    /// Mean.
    pub mean: f64,
    /// Minimum.
    pub min: u64,
    /// Maximum.
    pub max: u64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    #[serde(rename = "p99.9")]
    pub p99_9: u64,
}

/// What one direction (reads or writes) of a job did.
#[derive(Clone, Debug, Default)]
pub struct DirStats {
    /// Requests completed.
    pub ios: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Completion latency (submission to reaping).
    pub lat: Histogram,
}

impl DirStats {
    /// Adds `other`.
    pub fn merge(&mut self, other: &DirStats) {
        self.ios += other.ios;
        self.bytes += other.bytes;
        self.lat.merge(&other.lat);
    }

    /// Figures over `elapsed`.
    pub fn report(&self, elapsed: Duration) -> DirReport {
        let secs = elapsed.as_secs_f64().max(1e-9);
        #[allow(clippy::cast_precision_loss)]
        DirReport {
            ios: self.ios,
            bytes: self.bytes,
            iops: self.ios as f64 / secs,
            bw_bytes: self.bytes as f64 / secs,
            lat_ns: self.lat.summary(),
        }
    }
}

/// Figures of one direction, as printed and in `--json`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DirReport {
    /// Requests completed.
    pub ios: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Requests per second.
    pub iops: f64,
    /// Bytes per second.
    pub bw_bytes: f64,
    /// Completion latency.
    pub lat_ns: LatencySummary,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut last = 0;
        for i in 0..BUCKETS {
            let (lo, hi) = bucket_range(i);
            assert!(lo <= hi);
            if i > 0 {
                assert_eq!(lo, last + 1, "bucket {i}");
            }
            assert_eq!(bucket(lo), i);
            assert_eq!(bucket(hi), i);
            last = hi;
        }
        assert_eq!(last, u64::MAX);
    }

    #[test]
    fn percentiles_are_within_the_bucket_error() {
        let mut h = Histogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.summary();
        assert_eq!(s.min, 1000);
        assert_eq!(s.max, 1_000_000);
        assert!((s.mean - 500_500.0).abs() < 1.0);
        for (p, want) in [(s.p50, 500_000.0), (s.p99, 990_000.0), (s.p99_9, 999_000.0)] {
            #[allow(clippy::cast_precision_loss)]
            let err = (p as f64 - want).abs() / want;
            assert!(err < 0.02, "{p} vs {want}");
        }
        let mut both = Histogram::default();
        both.merge(&h);
        both.merge(&h);
        assert_eq!(both.count(), 2000);
        assert_eq!(both.summary().p50, s.p50);
    }
}
