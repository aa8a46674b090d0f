//! Pool statistics, like Linux's `/sys/kernel/debug/swiotlb` and more.

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

use crate::alloc::LockSnapshot;
use crate::types::{AllocatorKind, CopyOnMap, PoolMode};

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
/// Shard entries: the `Stat`s, then the timed calls per [`TimedOp`] and direction.
const ENTRIES: usize = STATS + 9;

/// The shard entry counting calls of `op` in `dir` while timing is on.
fn call_entry(op: TimedOp, dir: crate::Direction) -> usize {
    STATS + op as usize * 3 + dir.to_linux() as usize
}

/// One thread group's event counters, alone on its cache lines (128 bytes: the adjacent-line
/// prefetcher pairs 64-byte lines).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Shard {
    counts: [AtomicU64; ENTRIES],
    /// Occupancy quota this shard holds and does not use (see [`Counters`]): a map takes from
    /// it, an unmap gives back to it. Negative never at rest (a map that finds too little
    /// takes the rest from the pool's free quota under [`Occupancy::lock`]).
    slack: AtomicI64,
}

/// Occupancy quota not held by any shard, and the high-water mark, on their own cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Occupancy {
    /// Serialises quota transfers between shards and every rise of `hiwater`.
    lock: std::sync::Mutex<()>,
    /// The high-water mark, which is also the quota handed out in all: `hiwater = used + free +
    /// the shards' slack`.
    hiwater: AtomicU64,
    /// Quota no shard holds (changed only under `lock`).
    free: AtomicI64,
}

/// Quota a map that had to take from the pool's free quota keeps beyond its own need, so that
/// a worker settles at a steady occupancy without coming back for each map.
const GRANT: i64 = 64;

/// Live counters of a pool. All relaxed: they are statistics, not synchronisation.
///
/// Event counters (maps, bytes, syncs, ...) are per-thread shards ([`ThreadShards`]).
///
/// `used` and `hiwater` (Linux `total_used`, `used_hiwater`) are kept as a quota, so that a
/// pool at a steady occupancy writes no shared cache line (one shared atomic `used` written by
/// every map and unmap capped the two-thread throughput of every allocator). The mark `hiwater`
/// is the quota handed out in all; each shard holds some as `slack`, the rest is `free`, and at
/// every moment `used = hiwater - free - sum(slack)`:
/// - a map of `n` slots takes `n` from its own shard's slack (one uncontended compare-exchange
///   on the thread's own line) when the slack suffices;
/// - otherwise, under the occupancy lock, it takes its shard's slack and the free quota, and if
///   those are short, every shard's slack; only if all the quota there is cannot cover `n` does
///   the mark rise, by exactly what is missing: to the occupancy after this map. So the mark
///   rises exactly when `used` exceeds it, as Linux's `inc_used_and_hiwater` does, and it is
///   the largest occupancy reached, with one reservation: an unmap that completes on another
///   thread while the lock holder is collecting slack (after its shard was collected) is not
///   seen, so the mark may then exceed the true maximum by the slots those unmaps released;
/// - an unmap gives `n` back to its own shard's slack (one atomic add on its own line).
///
/// `used` is read as that difference (exact whenever no map or unmap is running, like the event
/// counters). [`Counters::reset_hiwater`] restarts the mark at the current occupancy (Linux
/// shows 0 until the next map, which sets it to the occupancy after that map: the same value
/// unless unmaps ran in between).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    occupancy: Occupancy,
    shards: ThreadShards<Shard>,
}

/// Threads that get a single-writer shard in every [`ThreadShards`].
pub(crate) const EXCLUSIVE_SHARDS: usize = 64;

/// Counters sharded per thread, one shard of `S` per thread number: each live thread holds a
/// process-wide number of its own ([`thread_number`], recycled when the thread exits), and the
/// first [`EXCLUSIVE_SHARDS`] numbers each own a shard, which `S` keeps alone on its cache
/// lines. A thread is the only writer of its shard, so it adds with a plain load and store (no
/// atomic read-modify-write, no cache line shared with another core); threads beyond those
/// numbers add atomically to one shared overflow shard. A read sums the shards. The sum is
/// exact: every add lands in exactly one shard and no two writers race on a plain add (a shard
/// changes hands only through the number's release and reuse, which a mutex orders), so it
/// counts every event that completed before the read, as a single counter would.
#[derive(Debug)]
pub(crate) struct ThreadShards<S> {
    /// `EXCLUSIVE_SHARDS` single-writer shards, then the shared overflow shard.
    shards: Box<[S]>,
}

impl<S: Default> Default for ThreadShards<S> {
    fn default() -> Self {
        Self {
            shards: (0..=EXCLUSIVE_SHARDS).map(|_| S::default()).collect(),
        }
    }
}

impl<S> ThreadShards<S> {
    /// This thread's shard.
    #[inline]
    pub fn local(&self) -> ShardRef<'_, S> {
        let t = thread_number();
        let exclusive = t < EXCLUSIVE_SHARDS;
        ShardRef {
            // The overflow shard is the last one.
            shard: &self.shards[if exclusive { t } else { EXCLUSIVE_SHARDS }],
            exclusive,
        }
    }

    /// Every shard, the overflow shard included.
    pub fn iter(&self) -> std::slice::Iter<'_, S> {
        self.shards.iter()
    }

    /// The sum over the shards of the counter `counter` picks.
    pub fn sum(&self, counter: impl Fn(&S) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .map(|s| counter(s).load(Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add)
    }
}

/// Numbers of threads that exited, for reuse (lowest first keeps numbers small).
static FREE_NUMBERS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
static NEXT_NUMBER: AtomicUsize = AtomicUsize::new(0);

/// `Local::number` before the thread took a number.
const UNNUMBERED: usize = usize::MAX;
/// `Local::number` once the thread's number went back (thread teardown): the overflow shard.
const EXITED: usize = usize::MAX - 1;

/// Per-thread state of the hot path, in one constant-initialised thread local without a
/// destructor (an access is one thread-pointer-relative load, no lazy-init or teardown check):
/// the thread's number, which picks its counter shard, and the timing countdowns.
struct Local {
    number: Cell<usize>,
    /// Per [`TimedOp`]: calls left until the next timed one.
    countdown: [Cell<u32>; 3],
    /// xorshift32 state for the sampling intervals.
    rng: Cell<u32>,
}

thread_local! {
    static LOCAL: Local = const {
        Local {
            number: Cell::new(UNNUMBERED),
            countdown: [Cell::new(0), Cell::new(0), Cell::new(0)],
            rng: Cell::new(0),
        }
    };
    /// Holds the number while the thread lives and gives it back when it exits.
    static GUARD: ThreadNumber = ThreadNumber::take();
}

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
        // From now on this thread counts on the overflow shard.
        let _ = LOCAL.try_with(|l| l.number.set(EXITED));
        FREE_NUMBERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.0);
    }
}

/// This thread's number: unique among live threads (`usize::MAX`, the overflow shard, during
/// thread teardown).
#[inline]
fn thread_number() -> usize {
    match LOCAL.try_with(|l| l.number.get()) {
        Ok(n) if n < EXITED => n,
        Ok(UNNUMBERED) => first_number(),
        _ => usize::MAX,
    }
}

#[cold]
fn first_number() -> usize {
    let n = GUARD.try_with(|g| g.0).unwrap_or(usize::MAX);
    let _ = LOCAL.try_with(|l| {
        l.number.set(if n == usize::MAX { EXITED } else { n });
    });
    n
}

/// A thread's shard of a [`ThreadShards`], looked up once per call: adds through it cost a
/// plain load and store (or one atomic add on the shared overflow shard).
pub(crate) struct ShardRef<'a, S = Shard> {
    shard: &'a S,
    exclusive: bool,
}

impl<S> Clone for ShardRef<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for ShardRef<'_, S> {}

impl<'a, S> ShardRef<'a, S> {
    /// Adds `n` to the counter of this shard that `counter` picks.
    #[inline]
    pub fn add_to(self, counter: impl FnOnce(&'a S) -> &'a AtomicU64, n: u64) {
        let c = counter(self.shard);
        if self.exclusive {
            // Single writer (see [`ThreadShards`]): a plain add.
            c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        } else {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }
}

impl ShardRef<'_> {
    /// Adds `n` to `stat`.
    #[inline]
    pub fn add(self, stat: Stat, n: u64) {
        self.add_entry(stat as usize, n);
    }

    #[inline]
    fn add_entry(self, entry: usize, n: u64) {
        self.add_to(|s| &s.counts[entry], n);
    }
}

impl Counters {
    /// This thread's shard.
    #[inline]
    pub fn shard(&self) -> ShardRef<'_> {
        self.shards.local()
    }

    /// Adds `n` to `stat` on this thread's shard.
    #[inline]
    pub fn add(&self, stat: Stat, n: u64) {
        self.shard().add(stat, n);
    }

    /// The sum of `stat` over the shards.
    pub fn get(&self, stat: Stat) -> u64 {
        self.get_entry(stat as usize)
    }

    fn get_entry(&self, entry: usize) -> u64 {
        self.shards.sum(|s| &s.counts[entry])
    }

    /// Linux `inc_used_and_hiwater`: `n` more slots in use (see the type's docs).
    #[cfg(test)]
    pub fn inc_used(&self, n: usize) {
        self.inc_used_on(self.shard(), n);
    }

    /// `n` more slots in use (Linux `inc_used_and_hiwater`, see the type's docs), on this
    /// thread's shard `shard`, looked up already.
    #[inline]
    pub fn inc_used_on(&self, shard: ShardRef<'_>, n: usize) {
        let n = n as i64;
        let slack = &shard.shard.slack;
        let have = slack.load(Ordering::Relaxed);
        if have >= n
            && slack
                .compare_exchange(have, have - n, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return;
        }
        self.take_quota(slack, n);
    }

    /// The slow path of [`Counters::inc_used`]: `n` more slots in use, from the free quota,
    /// from every shard's slack, or by raising the mark.
    #[cold]
    fn take_quota(&self, own: &AtomicI64, n: i64) {
        let o = &self.occupancy;
        let _g = o.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut free = o.free.load(Ordering::Relaxed) + own.swap(0, Ordering::Relaxed);
        if free < n {
            free += self.collect_slack();
        }
        if free >= n {
            let keep = (free - n).min(GRANT);
            own.fetch_add(keep, Ordering::Relaxed);
            free -= n + keep;
        } else {
            // All the quota there is covers `free` of the `n` slots: the occupancy after this
            // map is the old mark plus the rest.
            o.hiwater.fetch_add((n - free) as u64, Ordering::Relaxed);
            free = 0;
        }
        o.free.store(free, Ordering::Relaxed);
    }

    /// Takes every shard's slack (under the occupancy lock); returns the sum.
    fn collect_slack(&self) -> i64 {
        self.shards
            .iter()
            .map(|s| s.slack.swap(0, Ordering::Relaxed))
            .sum()
    }

    /// Linux `dec_used`: `n` fewer slots in use.
    #[cfg(test)]
    pub fn dec_used(&self, n: usize) {
        self.dec_used_on(self.shard(), n);
    }

    /// `n` fewer slots in use (Linux `dec_used`), on this thread's shard `shard`, looked up
    /// already.
    #[inline]
    pub fn dec_used_on(&self, shard: ShardRef<'_>, n: usize) {
        shard.shard.slack.fetch_add(n as i64, Ordering::Relaxed);
    }

    /// Slots in use.
    pub fn used(&self) -> u64 {
        let o = &self.occupancy;
        let slack: i64 = self
            .shards
            .iter()
            .map(|s| s.slack.load(Ordering::Relaxed))
            .sum();
        let used =
            o.hiwater.load(Ordering::Relaxed) as i64 - o.free.load(Ordering::Relaxed) - slack;
        used.max(0) as u64
    }

    /// The high-water mark of [`Counters::used`].
    pub fn hiwater(&self) -> u64 {
        self.occupancy.hiwater.load(Ordering::Relaxed)
    }

    /// Raises the high-water mark to `n` when it is lower: the quota it adds is free, so
    /// `used` does not change.
    pub fn raise_hiwater(&self, n: u64) {
        let o = &self.occupancy;
        let _g = o.lock.lock().unwrap_or_else(|p| p.into_inner());
        let hw = o.hiwater.load(Ordering::Relaxed);
        if n > hw {
            o.free.fetch_add((n - hw) as i64, Ordering::Relaxed);
            o.hiwater.store(n, Ordering::Relaxed);
        }
    }

    /// Restarts the high-water mark at the current occupancy (Linux accepts only 0 for
    /// `io_tlb_used_hiwater`; see the type's docs).
    pub fn reset_hiwater(&self) {
        let o = &self.occupancy;
        let _g = o.lock.lock().unwrap_or_else(|p| p.into_inner());
        let unused = o.free.load(Ordering::Relaxed) + self.collect_slack();
        let used = (o.hiwater.load(Ordering::Relaxed) as i64 - unused).max(0);
        o.hiwater.store(used as u64, Ordering::Relaxed);
        o.free.store(0, Ordering::Relaxed);
    }
}

/// A snapshot of a pool's statistics, serialisable to JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// swiotlb or iova.
    pub mode: PoolMode,
    /// What map copies in (the mode's rule unless the configuration chose the other).
    pub copy_on_map: CopyOnMap,
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
    /// A dynamic pool's pools and counters (`None` for a static pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic: Option<crate::dynamic::DynamicStats>,
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
            sampled: count,
            total_ns,
            mean_ns: total_ns.checked_div(count).unwrap_or(0),
            p50_ns: self.quantile(0.5),
            p99_ns: self.quantile(0.99),
            max_ns: self.max_ns.load(Ordering::Relaxed),
        }
    }
}

/// What a [`Histogram`] holds, summarised.
///
/// From a histogram, `count` and `sampled` are both the durations recorded. In a pool's
/// [`TimingStats`], `count` is every call made while timing was on, `sampled` the calls that
/// were timed, and `total_ns` the sum of the timed durations scaled by `count / sampled`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Calls (durations recorded, for a bare histogram).
    pub count: u64,
    /// Durations recorded (timed calls).
    #[serde(default)]
    pub sampled: u64,
    /// Their sum, ns (estimated for every call in a sampled pool, see above).
    pub total_ns: u64,
    /// Mean of the recorded durations, ns.
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
    fn hiwater_is_exact_when_one_thread_maps_and_another_unmaps() {
        let c = Counters::default();
        // Two live threads (so two shards), taking turns: in step k, the producer runs
        // `produce[k]` and the consumer `consume[k]`, then the main thread checks.
        let produce: [&(dyn Fn() + Sync); 4] = [
            // 10 runs of 2 slots.
            &|| (0..10).for_each(|_| c.inc_used(2)),
            &|| {},
            // Again: the quota is in the consumer's shard; the mark must not rise.
            &|| (0..10).for_each(|_| c.inc_used(2)),
            // Exactly past the mark.
            &|| c.inc_used(3),
        ];
        let consume: [&(dyn Fn() + Sync); 4] = [
            &|| {},
            &|| (0..10).for_each(|_| c.dec_used(2)),
            &|| {},
            &|| {},
        ];
        let want = [(20, 20), (0, 20), (20, 20), (23, 23)];
        let step = std::sync::Barrier::new(3);
        std::thread::scope(|s| {
            for side in [&produce, &consume] {
                let step = &step;
                s.spawn(move || {
                    for f in side.iter() {
                        f();
                        step.wait();
                        step.wait();
                    }
                });
            }
            // Asserted after the scope: a failure here must not leave the others waiting.
            let seen: Vec<_> = want
                .iter()
                .map(|_| {
                    step.wait();
                    let now = (c.used(), c.hiwater());
                    step.wait();
                    now
                })
                .collect();
            assert_eq!(seen, want);
        });
        // A reset restarts the mark at the occupancy.
        c.reset_hiwater();
        assert_eq!((c.used(), c.hiwater()), (23, 23));
        c.dec_used(23);
        c.reset_hiwater();
        assert_eq!((c.used(), c.hiwater()), (0, 0));
        c.inc_used(1);
        assert_eq!((c.used(), c.hiwater()), (1, 1));
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
/// a rate measured once per process against `Instant`), `Instant` elsewhere.
///
/// **Sampling.** Each thread times about one call in [`Timing::sample_every`] of each kind
/// ([`DEFAULT_SAMPLE_EVERY`] by default; 1 times every call): the gap to the next timed call is
/// drawn uniformly from `1..=2n-1` (mean `n`) per thread and kind, so a periodic pattern of
/// calls (a queue's map, copy, unmap cycle) cannot alias with the sampling and every kind of
/// call is timed in proportion. A timed call reads the clock twice and does two relaxed atomic
/// adds on the histogram (and an atomic max when the maximum rises); an untimed call only
/// counts itself, with a plain add on the calling thread's counter shard ([`Counters`]), so the
/// call counts stay exact. Quantiles, mean and maximum come from the timed calls; `total_ns` is
/// their sum scaled to every call (exact with `sample_every` 1). [`Timing::set_enabled`] turns
/// it off (one relaxed load per call is then all that remains); `bounce-experiment --timing
/// both` measures the difference side by side.
#[derive(Debug)]
pub struct Timing {
    enabled: std::sync::atomic::AtomicBool,
    /// One call in this many is timed (per thread and kind, on average).
    sample_every: std::sync::atomic::AtomicU32,
    /// [op][dir]: op 0 map, 1 copy, 2 unmap; dir as [`crate::Direction`]'s Linux number.
    hist: [[Histogram; 3]; 3],
    /// [op][dir]: the call counts at the last reset (counts are shard sums, never zeroed).
    base: [[AtomicU64; 3]; 3],
}

/// The default of [`Timing::sample_every`].
pub const DEFAULT_SAMPLE_EVERY: u32 = 16;

impl Default for Timing {
    fn default() -> Self {
        #[cfg(target_arch = "x86_64")]
        ns_per_tick();
        Self {
            enabled: std::sync::atomic::AtomicBool::new(true),
            sample_every: std::sync::atomic::AtomicU32::new(DEFAULT_SAMPLE_EVERY),
            hist: Default::default(),
            base: Default::default(),
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

/// What [`Timing::start`] decided for one call.
#[derive(Clone, Copy, Debug)]
pub enum Timed {
    /// Timing is off: nothing is recorded.
    Off,
    /// Counted, not timed.
    Counted,
    /// Counted and timed from this instant.
    Sampled(Ticks),
}

/// True when this thread's next call of `op` is to be timed; draws the next gap when it is.
#[inline]
fn sample_now(op: TimedOp, every: u32) -> bool {
    LOCAL
        .try_with(|l| {
            let c = &l.countdown[op as usize];
            let left = c.get();
            if left > 1 {
                c.set(left - 1);
                return false;
            }
            c.set(next_gap(l, every));
            true
        })
        .unwrap_or(false)
}

/// A gap uniform in `1..=2 * every - 1` (mean `every`), from the thread's xorshift32.
#[cold]
fn next_gap(l: &Local, every: u32) -> u32 {
    let mut x = l.rng.get();
    if x == 0 {
        // Seed from the thread's stack address: distinct per thread, never 0 after the or.
        x = (&x as *const u32 as usize as u32) | 1;
    }
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    l.rng.set(x);
    let span = every.max(1).saturating_mul(2) - 1;
    1 + x % span
}

impl Timing {
    /// Starts a call of `op`: off, counted only, or counted and timed (see the type's docs).
    #[inline(always)]
    pub fn start(&self, op: TimedOp) -> Timed {
        if !self.enabled.load(Ordering::Relaxed) {
            return Timed::Off;
        }
        let every = self.sample_every.load(Ordering::Relaxed);
        if every <= 1 || sample_now(op, every) {
            Timed::Sampled(Ticks::now())
        } else {
            Timed::Counted
        }
    }

    /// Records the call of `op` in `dir` that `start` began: its count on this thread's shard
    /// of `counters`, and its duration when it was timed.
    #[inline(always)]
    pub(crate) fn record(
        &self,
        op: TimedOp,
        dir: crate::Direction,
        start: Timed,
        counters: &Counters,
    ) {
        match start {
            Timed::Off => {}
            Timed::Counted => counters.shard().add_entry(call_entry(op, dir), 1),
            Timed::Sampled(t0) => self.record_sample(op, dir, t0, counters),
        }
    }

    #[inline(never)]
    fn record_sample(&self, op: TimedOp, dir: crate::Direction, t0: Ticks, counters: &Counters) {
        let ns = t0.elapsed_ns();
        counters.shard().add_entry(call_entry(op, dir), 1);
        self.hist[op as usize][dir.to_linux() as usize].record(ns);
    }

    /// Turns timing on or off.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Times one call in `n` per thread and kind on average (1: every call; 0 counts as 1).
    pub fn set_sample_every(&self, n: u32) {
        self.sample_every.store(n.max(1), Ordering::Relaxed);
    }

    /// One call in how many is timed.
    pub fn sample_every(&self) -> u32 {
        self.sample_every.load(Ordering::Relaxed)
    }

    /// Forgets every duration and count (`counters` holds the counts).
    pub(crate) fn reset(&self, counters: &Counters) {
        self.hist.iter().flatten().for_each(Histogram::reset);
        for op in [TimedOp::Map, TimedOp::Copy, TimedOp::Unmap] {
            for dir in DIRS {
                self.base[op as usize][dir.to_linux() as usize]
                    .store(counters.get_entry(call_entry(op, dir)), Ordering::Relaxed);
            }
        }
    }

    /// A snapshot (`counters` holds the counts).
    pub(crate) fn stats(&self, counters: &Counters) -> TimingStats {
        let one = |op: TimedOp, dir: crate::Direction| {
            let d = dir.to_linux() as usize;
            let calls = counters
                .get_entry(call_entry(op, dir))
                .wrapping_sub(self.base[op as usize][d].load(Ordering::Relaxed));
            let mut s = self.hist[op as usize][d].summary();
            s.sampled = s.count;
            s.count = calls;
            if s.sampled > 0 && s.sampled != calls {
                s.total_ns = (s.total_ns as f64 * calls as f64 / s.sampled as f64) as u64;
            }
            s
        };
        let per = |op: TimedOp| DirectionTimes {
            bidirectional: one(op, crate::Direction::Bidirectional),
            to_device: one(op, crate::Direction::ToDevice),
            from_device: one(op, crate::Direction::FromDevice),
        };
        TimingStats {
            enabled: self.enabled.load(Ordering::Relaxed),
            sample_every: self.sample_every(),
            map: per(TimedOp::Map),
            copy: per(TimedOp::Copy),
            unmap: per(TimedOp::Unmap),
        }
    }
}

const DIRS: [crate::Direction; 3] = [
    crate::Direction::Bidirectional,
    crate::Direction::ToDevice,
    crate::Direction::FromDevice,
];

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
    /// One call in this many (per thread and kind, on average) is timed; counts are of every
    /// call (0 in a snapshot from before sampling existed).
    #[serde(default)]
    pub sample_every: u32,
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
    use crate::{BouncePool, Direction, HostMemory, MapRequest, PoolConfig};

    /// Maps `size` bytes at 0x10000 of `mem` for `dir`, then unmaps them.
    fn map_unmap(pool: &BouncePool, mem: &HostMemory<'_>, size: usize, dir: Direction) {
        let m = pool.map(mem, &MapRequest::new(0x10000, size, dir)).unwrap();
        pool.unmap(mem, &m, 0).unwrap();
    }

    #[test]
    fn pool_times_map_copy_and_unmap_per_direction() {
        let pool = BouncePool::new(&PoolConfig::swiotlb(1024)).unwrap();
        let mut buf = vec![7u8; 8192];
        let mem = HostMemory::new(0x10000, &mut buf);
        map_unmap(&pool, &mem, 4096, Direction::FromDevice);
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
        map_unmap(&pool, &mem, 512, Direction::ToDevice);
        let t = pool.stats().timing;
        assert!(!t.enabled);
        assert_eq!(t.map.to_device.count, 0);
    }

    #[test]
    fn sampled_timing_keeps_exact_counts_and_times_every_kind() {
        let pool = BouncePool::new(&PoolConfig::swiotlb(1024)).unwrap();
        let mut buf = vec![7u8; 8192];
        let mem = HostMemory::new(0x10000, &mut buf);
        let pairs = 4000u64;
        // A strictly periodic pattern (map, copy in, copy back, unmap): one countdown shared by
        // every kind would time only some kinds; each kind has its own.
        for _ in 0..pairs {
            map_unmap(&pool, &mem, 4096, Direction::Bidirectional);
        }
        let t = pool.stats().timing;
        assert_eq!(t.sample_every, DEFAULT_SAMPLE_EVERY);
        let every = u64::from(DEFAULT_SAMPLE_EVERY);
        for (what, s) in [
            ("map", t.map.bidirectional),
            ("unmap", t.unmap.bidirectional),
            ("copy in", t.copy.to_device),
            ("copy back", t.copy.from_device),
        ] {
            assert_eq!(s.count, pairs, "{what}: every call counted");
            // About one in `every` timed (mean gap `every`): well inside half to twice that.
            let want = pairs / every;
            assert!(
                (want / 2..=want * 2).contains(&s.sampled),
                "{what}: {} timed of {pairs}",
                s.sampled
            );
            // The total is scaled to every call: the mean times the count, to rounding.
            let scaled = s.mean_ns * s.count;
            assert!(s.total_ns + s.count >= scaled && s.total_ns <= scaled + s.count);
        }
        // Every call timed on request; a reset forgets counts too.
        pool.reset_hiwater();
        pool.set_timing_sample_every(1);
        map_unmap(&pool, &mem, 100, Direction::ToDevice);
        let t = pool.stats().timing;
        assert_eq!(t.sample_every, 1);
        assert_eq!((t.map.to_device.count, t.map.to_device.sampled), (1, 1));
        assert_eq!(t.map.bidirectional.count, 0);
    }
}
