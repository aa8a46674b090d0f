//! Pool statistics, like Linux's `/sys/kernel/debug/swiotlb` and more.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

use crate::alloc::{AllocatorKind, LockSnapshot};
use crate::geometry::PoolMode;

/// One event counter of a pool (an index into a [`Counters`] shard).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stat {
    Maps,
    Unmaps,
    MapFailures,
    BadUnmaps,
    BytesToDevice,
    BytesFromDevice,
    SyncsForDevice,
    SyncsForCpu,
    Clamped,
}

const STATS: usize = Stat::Clamped as usize + 1;

/// One thread group's event counters, alone on its cache lines (128 bytes: the adjacent-line
/// prefetcher pairs 64-byte lines).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard([AtomicU64; STATS]);

/// The occupancy count and its high-water mark, on their own cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Occupancy {
    used: AtomicU64,
    hiwater: AtomicU64,
}

/// Live counters of a pool. All relaxed: they are statistics, not synchronisation.
///
/// Event counters (maps, bytes, syncs, ...) are sharded per thread: each live thread holds a
/// process-wide number of its own ([`thread_number`], recycled when the thread exits), and the
/// first [`EXCLUSIVE_SHARDS`] numbers each own a shard of every pool, alone on its cache lines.
/// A thread is the only writer of its shard, so it adds with a plain load and store (no atomic
/// read-modify-write, no cache line shared with another core); threads beyond those numbers add
/// atomically to one shared overflow shard. A read sums the shards. The sum is exact: every add
/// lands in exactly one shard and no two writers race on a plain add (a shard changes hands only
/// through the number's release and reuse, which a mutex orders), so it counts every event that
/// completed before the read, as a single counter would.
///
/// `used` and `hiwater` are not sharded: a high-water mark is only exact when every change of
/// `used` is ordered against every other, which shards cannot give without reading all of them
/// on every map. They are kept as Linux keeps `total_used` and `used_hiwater`
/// (`inc_used_and_hiwater`): an atomic add whose result is the exact occupancy after this map,
/// then a compare with the mark (a load of the same cache line), and an atomic max only when the
/// mark rises. So the mark is the largest value `used` ever took, exactly; a pool at a steady
/// occupancy pays one shared add per map and one per unmap, nothing more.
#[derive(Debug)]
pub(crate) struct Counters {
    occupancy: Occupancy,
    /// `EXCLUSIVE_SHARDS` single-writer shards, then the shared overflow shard.
    shards: Box<[Shard]>,
}

/// Threads that get a single-writer shard in every pool.
pub(crate) const EXCLUSIVE_SHARDS: usize = 64;

impl Default for Counters {
    fn default() -> Self {
        Self {
            occupancy: Occupancy::default(),
            shards: (0..=EXCLUSIVE_SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

/// Numbers of threads that exited, for reuse (lowest first keeps numbers small).
static FREE_NUMBERS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
static NEXT_NUMBER: AtomicUsize = AtomicUsize::new(0);

/// A thread's number, returned to [`FREE_NUMBERS`] when the thread exits.
struct ThreadNumber(usize);

impl ThreadNumber {
    fn take() -> Self {
        let mut free = FREE_NUMBERS.lock().unwrap_or_else(|p| p.into_inner());
        // The smallest free number, so short-lived threads keep reusing exclusive shards.
        match free.iter().enumerate().min_by_key(|(_, n)| **n) {
            Some((i, _)) => Self(free.swap_remove(i)),
            None => Self(NEXT_NUMBER.fetch_add(1, Ordering::Relaxed)),
        }
    }
}

impl Drop for ThreadNumber {
    fn drop(&mut self) {
        FREE_NUMBERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.0);
    }
}

/// This thread's number: unique among live threads.
fn thread_number() -> usize {
    thread_local! {
        static NUMBER: ThreadNumber = ThreadNumber::take();
    }
    // During thread teardown (after NUMBER was dropped) count on the overflow shard.
    NUMBER.try_with(|n| n.0).unwrap_or(usize::MAX)
}

impl Counters {
    /// Adds `n` to `stat` on this thread's shard.
    #[inline]
    pub fn add(&self, stat: Stat, n: u64) {
        let t = thread_number();
        match self.shards.get(t).filter(|_| t < EXCLUSIVE_SHARDS) {
            Some(own) => {
                // Single writer (see the type's docs): a plain add.
                let c = &own.0[stat as usize];
                c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
            }
            None => {
                self.shards[EXCLUSIVE_SHARDS].0[stat as usize].fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// The sum of `stat` over the shards.
    pub fn get(&self, stat: Stat) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0[stat as usize].load(Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add)
    }

    /// Linux `inc_used_and_hiwater`.
    #[inline]
    pub fn inc_used(&self, n: usize) {
        let o = &self.occupancy;
        let new = o.used.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        if new > o.hiwater.load(Ordering::Relaxed) {
            o.hiwater.fetch_max(new, Ordering::Relaxed);
        }
    }

    /// Linux `dec_used`.
    #[inline]
    pub fn dec_used(&self, n: usize) {
        self.occupancy.used.fetch_sub(n as u64, Ordering::Relaxed);
    }

    /// Slots in use.
    pub fn used(&self) -> u64 {
        self.occupancy.used.load(Ordering::Relaxed)
    }

    /// The high-water mark of [`Counters::used`].
    pub fn hiwater(&self) -> u64 {
        self.occupancy.hiwater.load(Ordering::Relaxed)
    }

    /// Zeroes the high-water mark (Linux accepts only 0 for `io_tlb_used_hiwater`).
    pub fn reset_hiwater(&self) {
        self.occupancy.hiwater.store(0, Ordering::Relaxed);
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
    /// Map, copy and unmap durations per direction since creation or the last reset.
    #[serde(default)]
    pub timing: TimingStats,
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
///
/// A record is two atomic adds (its bucket and the sum) and a load of the maximum (an atomic max
/// only when it rises); the count is the sum of the buckets, computed on read.
#[derive(Debug)]
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
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
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        if ns > self.max_ns.load(Ordering::Relaxed) {
            self.max_ns.fetch_max(ns, Ordering::Relaxed);
        }
    }

    /// Adds everything `other` recorded.
    pub fn merge(&self, other: &Histogram) {
        for (a, b) in self.buckets.iter().zip(other.buckets.iter()) {
            a.fetch_add(b.load(Ordering::Relaxed), Ordering::Relaxed);
        }
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
        self.sum_ns.store(0, Ordering::Relaxed);
        self.max_ns.store(0, Ordering::Relaxed);
    }

    /// Durations recorded: the sum of the buckets.
    pub fn count(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    /// The `q` quantile (0..=1) in ns, from the bucket it falls in; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
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
        let count = self.count();
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
    fn sharded_counters_are_exact_with_more_threads_than_shards() {
        let c = Counters::default();
        let threads = EXCLUSIVE_SHARDS + 6;
        // All live at once: some share the overflow shard.
        let barrier = std::sync::Barrier::new(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (c, barrier) = (&c, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for _ in 0..1000 {
                        c.add(Stat::Maps, 1);
                        c.add(Stat::BytesToDevice, t as u64);
                        c.inc_used(2);
                        c.dec_used(2);
                    }
                });
            }
        });
        // Then short-lived threads one after another: numbers are reused, counts kept.
        for _ in 0..200 {
            std::thread::scope(|s| {
                s.spawn(|| c.add(Stat::Maps, 1));
            });
        }
        assert_eq!(c.get(Stat::Maps), threads as u64 * 1000 + 200);
        let bytes: u64 = (0..threads as u64).sum::<u64>() * 1000;
        assert_eq!(c.get(Stat::BytesToDevice), bytes);
        assert_eq!(c.used(), 0);
        assert!((2..=2 * threads as u64).contains(&c.hiwater()));
        c.inc_used(5);
        c.reset_hiwater();
        c.inc_used(1);
        assert_eq!((c.used(), c.hiwater()), (6, 6));
        assert!(thread_number() < EXCLUSIVE_SHARDS, "numbers are recycled");
    }

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

/// Time accounting of a pool: a histogram of map, copy and unmap durations per direction.
///
/// Map and unmap durations are whole calls (their copies included); copies are also counted on
/// their own, by the direction the data flows (`to_device`: original -> pool, `from_device`:
/// pool -> original). The clock is the TSC on x86-64 ([`Ticks`]: `rdtsc`, converted to ns with
/// a rate measured once per process against `Instant`), `Instant` elsewhere; each timed call
/// reads it twice and does four relaxed atomic updates. [`Timing::set_enabled`] turns it off (one relaxed load per call is then all that
/// remains); `bounce-experiment --timing both` measures the difference side by side.
#[derive(Debug)]
pub struct Timing {
    enabled: std::sync::atomic::AtomicBool,
    /// [op][dir]: op 0 map, 1 copy, 2 unmap; dir as [`crate::Direction`]'s Linux number.
    hist: [[Histogram; 3]; 3],
}

impl Default for Timing {
    fn default() -> Self {
        #[cfg(target_arch = "x86_64")]
        ns_per_tick();
        Self {
            enabled: std::sync::atomic::AtomicBool::new(true),
            hist: Default::default(),
        }
    }
}

/// A cheap timestamp: the TSC on x86-64, `Instant` elsewhere.
#[derive(Clone, Copy, Debug)]
pub struct Ticks(
    #[cfg(target_arch = "x86_64")] u64,
    #[cfg(not(target_arch = "x86_64"))] std::time::Instant,
);

#[cfg(target_arch = "x86_64")]
#[inline]
fn rdtsc() -> u64 {
    // SAFETY: rdtsc reads the time-stamp counter; it touches no memory and every x86-64 CPU
    // has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// Nanoseconds per TSC tick, measured once against `Instant` over 20 ms.
#[cfg(target_arch = "x86_64")]
fn ns_per_tick() -> f64 {
    static RATE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *RATE.get_or_init(|| {
        let (i0, t0) = (std::time::Instant::now(), rdtsc());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (ns, ticks) = (i0.elapsed().as_nanos() as f64, rdtsc().wrapping_sub(t0));
        if ticks == 0 {
            1.0
        } else {
            ns / ticks as f64
        }
    })
}

impl Ticks {
    /// Now.
    #[inline]
    pub fn now() -> Self {
        #[cfg(target_arch = "x86_64")]
        return Self(rdtsc());
        #[cfg(not(target_arch = "x86_64"))]
        return Self(std::time::Instant::now());
    }

    /// Nanoseconds since `self`.
    #[inline]
    pub fn elapsed_ns(self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        return (rdtsc().wrapping_sub(self.0) as f64 * ns_per_tick()) as u64;
        #[cfg(not(target_arch = "x86_64"))]
        return u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    }
}

/// What [`Timing`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimedOp {
    /// A whole map call.
    Map,
    /// One copy between the original and the pool.
    Copy,
    /// A whole unmap call.
    Unmap,
}

impl Timing {
    /// The start of a timed call, or `None` when timing is off.
    #[inline]
    pub fn start(&self) -> Option<Ticks> {
        self.enabled.load(Ordering::Relaxed).then(Ticks::now)
    }

    /// Records the call started at `start` (nothing when it is `None`).
    #[inline]
    pub fn record(&self, op: TimedOp, dir: crate::Direction, start: Option<Ticks>) {
        if let Some(t0) = start {
            self.hist[op as usize][dir.to_linux() as usize].record(t0.elapsed_ns());
        }
    }

    /// Turns timing on or off.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Forgets every duration.
    pub fn reset(&self) {
        self.hist.iter().flatten().for_each(Histogram::reset);
    }

    /// A snapshot.
    pub fn stats(&self) -> TimingStats {
        let per = |op: TimedOp| DirectionTimes {
            bidirectional: self.hist[op as usize][0].summary(),
            to_device: self.hist[op as usize][1].summary(),
            from_device: self.hist[op as usize][2].summary(),
        };
        TimingStats {
            enabled: self.enabled.load(Ordering::Relaxed),
            map: per(TimedOp::Map),
            copy: per(TimedOp::Copy),
            unmap: per(TimedOp::Unmap),
        }
    }
}

/// Durations of one operation per direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionTimes {
    /// Bidirectional mappings (for copies: unused).
    pub bidirectional: LatencySummary,
    /// To-device mappings (for copies: original -> pool).
    pub to_device: LatencySummary,
    /// From-device mappings (for copies: pool -> original).
    pub from_device: LatencySummary,
}

/// [`Timing`] as [`PoolStats`] reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimingStats {
    /// Whether durations are being recorded.
    pub enabled: bool,
    /// Whole map calls.
    pub map: DirectionTimes,
    /// Copies, by data flow.
    pub copy: DirectionTimes,
    /// Whole unmap calls.
    pub unmap: DirectionTimes,
}

#[cfg(test)]
mod timing_tests {
    use super::*;

    #[test]
    fn pool_times_map_copy_and_unmap_per_direction() {
        use crate::{BouncePool, Direction, HostMemory, MapRequest, PoolConfig};
        let pool = BouncePool::new(&PoolConfig::swiotlb(1024)).unwrap();
        let mut buf = vec![7u8; 8192];
        let mem = HostMemory::new(0x10000, &mut buf);
        let m = pool
            .map(&mem, &MapRequest::new(0x10000, 4096, Direction::FromDevice))
            .unwrap();
        pool.unmap(&mem, &m, 0).unwrap();
        let t = pool.stats().timing;
        assert!(t.enabled);
        assert_eq!(t.map.from_device.count, 1);
        assert_eq!(t.unmap.from_device.count, 1);
        assert_eq!(t.map.to_device.count, 0);
        // The copy in on map (always, in swiotlb) and the copy back on unmap.
        assert_eq!((t.copy.to_device.count, t.copy.from_device.count), (1, 1));
        assert!(t.map.from_device.total_ns > 0);
        pool.reset_hiwater();
        assert_eq!(pool.stats().timing.map, DirectionTimes::default());
        pool.set_timing(false);
        let m = pool
            .map(&mem, &MapRequest::new(0x10000, 512, Direction::ToDevice))
            .unwrap();
        pool.unmap(&mem, &m, 0).unwrap();
        let t = pool.stats().timing;
        assert!(!t.enabled);
        assert_eq!(t.map.to_device.count, 0);
    }
}
