//! `magazine`: per-worker magazines of free slot runs over per-area bitmap depots (our own
//! design; swiotlb has no per-CPU cache, `iova-rcache` shows the pattern for IOVAs).
//!
//! # Design
//! - **Depot**: one bitmap per area ([`FreeBitmap`], the `areas-bitmap` structure) behind the
//!   area's [`TimedMutex`]. Its search is complete: it fails only when no run of the area
//!   satisfies [`SlotRequest::fits`].
//! - **Magazines**: one per worker, holding free runs of `2^c` slots for each size class
//!   `c = 0..=MAX_CLASS` (1 to 128 slots, never more than a segment or an area), at most
//!   `class_capacity(c)` runs per class. A worker only ever takes its own magazine, by its
//!   `busy` flag (one uncontended compare-exchange to take it, a plain store to give it back;
//!   it never waits): a magazine found busy (two threads sharing a worker id) sends the request
//!   to the depot path instead.
//! - **Map** of `n` slots, `n` a power of two up to 128 (1, 2, 4, ... slots: 2 KiB buffers,
//!   pages, 64 KiB blocks): class `c = log2 n`. The magazine's class list is scanned from the
//!   top (most recently freed, cache-hot, first) for a run whose first slot
//!   [`fits`](SlotRequest::fits) the request. On a miss the class is loaded in bulk: one depot
//!   lock, up to half the class capacity of runs that fit the request, from the worker's own
//!   area first, then the others. Other sizes go to the depot directly.
//! - **Unmap** of a power-of-two run up to 128 slots: pushed on the releasing worker's
//!   magazine; a class that is full first flushes its older half to the depot in bulk (sorted,
//!   one lock per area). Other runs go straight to the depot.
//! - **Failure**: when neither the magazine nor the depot has a fitting run, every magazine not
//!   held at that moment is flushed to the depots and the depot search is retried across all
//!   areas; only then does the request fail.
//!
//! # Invariants
//! 1. Every slot is in exactly one state: free in its depot (bit clear); cached in exactly one
//!    magazine run (bit set); or part of exactly one live run, whose first slot records its
//!    length in `live` (bit set). Cached and live slots count as used in
//!    [`SlotAllocator::area_used`].
//! 2. Every run handed out satisfies [`SlotRequest::fits`] for its request (magazine runs are
//!    checked one by one; depot runs come from the complete bitmap search).
//! 3. A live run holds exactly the slots of its mapping (no rounding waste).
//! 4. Free accepts only `(index, nslots)` equal to a live run (`live[index]` checked and
//!    cleared): a double or partial free is refused and logged, never corrupts a depot. The
//!    check is a load and a store, not a compare-exchange: it relies on no two frees of one run
//!    running at the same time, which the pool guarantees (an unmap releases slots only after
//!    winning the compare-exchange on its mapping's head slot).
//! 5. With no other thread inside the allocator, a request fails only when no run of free
//!    slots fits it anywhere in the pool (after the flush every cached slot is back in a depot,
//!    and the depot search is complete): it never fails a request that `areas` would place on
//!    the same occupancy.
//!
//! # Sizes
//! [`MAG_CLASS_SLOTS`] (64) slots per class, at least 2 runs: 32 cached runs of a 4 KiB
//! mapping, so a block queue at depth 32 (a status slot, a header slot and a 2-slot data run
//! per request, mapped in a burst at submission and freed in a burst at completion) cycles
//! within its own magazine. With 16 slots per class the same queue loaded and flushed half a
//! class every few requests; at 64, bouncevm-vhost on tmpfs (4 KiB randread, iodepth 32, one
//! job, bouncevm-load, cache=none) went from 4.65 [4.55-5.23] to 4.21 [4.17-4.56] µs of
//! back-end CPU per I/O (median [min-max] of 5 interleaved rounds, docs/studies/blk-host-speed.md). Bigger caches scatter small mappings more: replaying the Linux 6.12
//! trace (4096 slots, whole-segment maps at ~80 % occupancy) gives 12 "buffer full" (8 with 16
//! slots per class) against the kernel's (and `areas`') 67, since the depot search is complete
//! and the caches are flushed before a map fails.
//!
//! # Hot path
//! A map or unmap served by the magazine touches only the worker's own [`Magazine`] (inline
//! arrays, aligned to 128 bytes, so no two workers share a cache line) through its uncontended
//! `busy` flag, and the run's own `live` entry. No depot lock, no shared counter. The newest
//! run of the class is checked inline; older runs, bulk loads, flushes and the depot path are
//! out of line (a hit: about 120 instructions with its `fits` check, callgrind, against 188).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::alloc::bitmap::FreeBitmap;
use crate::alloc::locked::{check_geometry, Locked, Split};
use crate::alloc::{pow2, LockSnapshot, SlotAllocator, SlotRequest};
use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// The largest size class: runs of `2^MAX_CLASS` = 128 slots (a swiotlb segment).
pub const MAX_CLASS: usize = 7;
/// Slots one class of one magazine may cache (classes of big runs hold at least 2 runs).
pub const MAG_CLASS_SLOTS: usize = 64;

/// Runs one class of a magazine may hold.
pub fn class_capacity(class: usize) -> usize {
    (MAG_CLASS_SLOTS >> class).max(2)
}

/// The size class serving `nslots` slots (`ceil(log2 nslots)`; the hot paths take
/// `trailing_zeros` of a power of two).
#[cfg(test)]
fn class_of(nslots: usize) -> usize {
    nslots.next_power_of_two().trailing_zeros() as usize
}

/// Most runs one class of a magazine may hold (`class_capacity(0)`).
const MAX_RUNS: usize = if MAG_CLASS_SLOTS > 2 {
    MAG_CLASS_SLOTS
} else {
    2
};

/// One class of a magazine: first slots of free runs, newest last, inline (no heap buffer that
/// could share a cache line with another worker's).
///
/// Atomics only so that a magazine needs no lock type: every access happens while its
/// [`Magazine::busy`] flag is held (taken with Acquire, given back with Release), so the
/// Relaxed loads and stores here are plain moves, ordered by the flag.
#[derive(Debug)]
struct ClassRuns {
    len: AtomicU32,
    runs: [AtomicU32; MAX_RUNS],
}

impl Default for ClassRuns {
    fn default() -> Self {
        Self {
            len: AtomicU32::new(0),
            runs: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }
}

impl ClassRuns {
    fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed) as usize
    }

    fn set_len(&self, n: usize) {
        // n <= MAX_RUNS.
        self.len.store(n as u32, Ordering::Relaxed);
    }

    fn get(&self, k: usize) -> usize {
        self.runs[k].load(Ordering::Relaxed) as usize
    }

    fn set(&self, k: usize, slot: usize) {
        // Slots fit u32 (checked in `MagazineAllocator::new`).
        self.runs[k].store(slot as u32, Ordering::Relaxed);
    }

    fn push(&self, slot: usize) {
        // Callers keep len < class_capacity <= MAX_RUNS.
        let n = self.len();
        self.set(n, slot);
        self.set_len(n + 1);
    }

    fn remove(&self, k: usize) -> usize {
        let (slot, n) = (self.get(k), self.len());
        for i in k + 1..n {
            self.set(i - 1, self.get(i));
        }
        self.set_len(n - 1);
        slot
    }

    /// Removes the oldest `n` runs and returns them.
    fn drain_oldest(&self, n: usize) -> Vec<usize> {
        let len = self.len();
        let n = n.min(len);
        let old: Vec<usize> = (0..n).map(|k| self.get(k)).collect();
        for i in n..len {
            self.set(i - n, self.get(i));
        }
        self.set_len(len - n);
        old
    }

    /// Reverses the runs `from..len`.
    fn reverse_from(&self, from: usize) {
        let (mut a, mut b) = (from, self.len());
        while a + 1 < b {
            b -= 1;
            let (x, y) = (self.get(a), self.get(b));
            self.set(a, y);
            self.set(b, x);
            a += 1;
        }
    }

    #[cfg(test)]
    fn contains(&self, slot: usize) -> bool {
        (0..self.len()).any(|k| self.get(k) == slot)
    }
}

/// One worker's cached runs: `runs[c]` holds first slots of free `2^c`-slot runs. Alone on its
/// cache lines (128 bytes: the adjacent-line prefetcher pairs 64-byte lines), so workers on
/// different cores never touch the same line on the hot path.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Magazine {
    /// Held by the one thread using the magazine: a compare-exchange to take it (it never
    /// waits on the hot path) and a plain Release store to give it back, one atomic
    /// read-modify-write per use where a mutex costs two.
    busy: AtomicBool,
    runs: [ClassRuns; MAX_CLASS + 1],
}

/// A held [`Magazine`]; dropping it gives the magazine back.
struct Held<'a>(&'a Magazine);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

impl std::ops::Deref for Held<'_> {
    type Target = Magazine;
    fn deref(&self) -> &Magazine {
        self.0
    }
}

impl Magazine {
    /// Takes the magazine if no other thread holds it.
    #[inline]
    fn try_hold(&self) -> Option<Held<'_>> {
        self.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Held(self))
    }

    /// Takes the magazine, yielding while another thread holds it (reports and tests only).
    fn hold(&self) -> Held<'_> {
        loop {
            if let Some(h) = self.try_hold() {
                return h;
            }
            std::thread::yield_now();
        }
    }
}

impl Held<'_> {
    /// Takes the newest cached run of `class` whose first slot fits `req`.
    ///
    /// The newest run is checked inline (it fits whenever the device's requests share their
    /// placement rules, the common case); older ones out of line.
    #[inline(always)]
    fn take(&self, geom: &Geometry, class: usize, req: &SlotRequest) -> Option<usize> {
        let list = &self.runs[class];
        let n = list.len();
        let top = n.checked_sub(1)?;
        let slot = list.get(top);
        if req.fits(geom, slot) {
            list.set_len(top);
            return Some(slot);
        }
        Self::take_older(list, geom, req)
    }

    /// [`Held::take`] past the newest run.
    #[inline(never)]
    fn take_older(list: &ClassRuns, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        let k = (0..list.len().saturating_sub(1))
            .rev()
            .find(|&k| req.fits(geom, list.get(k)))?;
        Some(list.remove(k))
    }

    /// Empties every class.
    fn drain(&self) -> Vec<(usize, usize)> {
        self.runs
            .iter()
            .enumerate()
            .flat_map(|(c, list)| {
                list.drain_oldest(MAX_RUNS)
                    .into_iter()
                    .map(move |s| (s, 1 << c))
            })
            .collect()
    }
}

/// Per-worker magazines over per-area bitmap depots.
#[derive(Debug)]
pub struct MagazineAllocator {
    geom: Geometry,
    depot: Locked<FreeBitmap>,
    mags: Box<[Magazine]>,
    /// Per slot: the length of the live run starting there, 0 when none does.
    live: Box<[AtomicU32]>,
    /// Largest class this geometry allows (a class run must fit a segment and an area).
    max_class: usize,
}

impl MagazineAllocator {
    /// Builds the allocator: every slot free in its depot, every magazine empty.
    ///
    /// # Errors
    /// [`Error::Config`] for an inconsistent geometry, or runs longer than `u32::MAX` slots.
    pub fn new(geom: &Geometry) -> Result<Self> {
        check_geometry(geom, false)?;
        if u32::try_from(geom.nslabs).is_err() {
            return Err(Error::Config(format!(
                "magazine: {} slots is more than it can track",
                geom.nslabs
            )));
        }
        let depot = Locked::new(
            AllocatorKind::Magazine,
            geom,
            Split::PerArea,
            false,
            FreeBitmap::new,
        )?;
        let limit = geom.segsize.min(geom.area_nslabs);
        let max_class = (0..=MAX_CLASS)
            .take_while(|&c| 1usize << c <= limit)
            .last()
            .unwrap_or(0);
        Ok(Self {
            geom: *geom,
            depot,
            mags: (0..geom.nworkers.max(1))
                .map(|_| Magazine::default())
                .collect(),
            live: (0..geom.nslabs).map(|_| AtomicU32::new(0)).collect(),
            max_class,
        })
    }

    /// The magazine of `worker` (workers beyond the geometry's share, modulo).
    #[inline]
    fn magazine(&self, worker: usize) -> &Magazine {
        // No division on the hot path: a worker id is normally below the worker count.
        match self.mags.get(worker) {
            Some(m) => m,
            None => &self.mags[worker % self.mags.len()],
        }
    }

    /// Marks `index..index + nslots` live.
    fn hand_out(&self, index: usize, nslots: usize) -> usize {
        // nslots <= nslabs <= u32::MAX (checked in `new`).
        self.live[index].store(nslots as u32, Ordering::Relaxed);
        index
    }

    /// The magazine path: a cached run, else a bulk load from the depots.
    #[inline(always)]
    fn take_cached(&self, mag: &Held<'_>, req: &SlotRequest, class: usize) -> Option<usize> {
        if let Some(i) = mag.take(&self.geom, class, req) {
            return Some(i);
        }
        self.load_and_take(mag, req, class)
    }

    /// [`MagazineAllocator::take_cached`] after a miss: a bulk load, then the magazine again.
    #[inline(never)]
    fn load_and_take(&self, mag: &Held<'_>, req: &SlotRequest, class: usize) -> Option<usize> {
        self.load(mag, req, class);
        mag.take(&self.geom, class, req)
    }

    /// Loads up to half a class worth of `2^class`-slot runs fitting `req`, under one depot
    /// lock, from the worker's area first.
    fn load(&self, mag: &Held<'_>, req: &SlotRequest, class: usize) {
        let cap = class_capacity(class);
        let batch = (cap / 2).max(1);
        if mag.runs[class].len() + batch > cap {
            let excess = mag.runs[class].len() + batch - cap;
            self.flush_runs(
                mag.runs[class]
                    .drain_oldest(excess)
                    .into_iter()
                    .map(|s| (s, 1 << class)),
            );
        }
        let big = SlotRequest {
            nslots: 1 << class,
            ..*req
        };
        let list = &mag.runs[class];
        let before = list.len();
        // The first area that has any fitting run fills the batch.
        self.depot.find_map(req.worker, |area| {
            while list.len() - before < batch {
                match area.alloc(&self.geom, &big) {
                    Some(s) => list.push(s),
                    None => break,
                }
            }
            (list.len() > before).then_some(0)
        });
        // Newest on top is the lowest address of the batch: hand them out in order.
        list.reverse_from(before);
    }

    /// Caches the free run of `2^class` slots at `start`, flushing the older half of a full
    /// class first.
    #[inline(always)]
    fn cache(&self, mag: &Held<'_>, start: usize, class: usize) {
        let list = &mag.runs[class];
        if list.len() >= class_capacity(class) {
            self.flush_half(list, class);
        }
        list.push(start);
    }

    /// Returns the older half of a full class to the depots.
    #[cold]
    fn flush_half(&self, list: &ClassRuns, class: usize) {
        let half = list.len() / 2;
        self.flush_runs(list.drain_oldest(half).into_iter().map(|r| (r, 1 << class)));
    }

    /// Returns runs to their depots, sorted, one lock per area.
    fn flush_runs(&self, runs: impl Iterator<Item = (usize, usize)>) {
        let mut runs: Vec<(usize, usize)> = runs.collect();
        runs.sort_unstable();
        let area_of = |s: usize| self.depot.range_of(s);
        for group in runs.chunk_by(|a, b| area_of(a.0) == area_of(b.0)) {
            let mut area = self.depot.ranges[area_of(group[0].0)].lock();
            for &(s, n) in group {
                if !area.free(s, n) {
                    tracing::error!(s, n, "magazine: a cached run was not in use in its depot");
                }
            }
        }
    }

    /// A free that matches no live run: refused and logged.
    #[cold]
    fn refuse(index: usize, nslots: usize) {
        tracing::error!(index, nslots, "magazine: free of a run not in use ignored");
    }

    /// Returns one run to its depot.
    #[inline(never)]
    fn flush_one(&self, index: usize, nslots: usize) {
        self.flush_runs(std::iter::once((index, nslots)));
    }

    /// Flushes every magazine no other thread holds right now.
    fn flush_all(&self) {
        for mag in self.mags.iter() {
            let Some(mag) = mag.try_hold() else {
                continue;
            };
            let runs = mag.drain();
            drop(mag);
            self.flush_runs(runs.into_iter());
        }
    }

    /// A request the magazine did not serve: the depots, then every magazine flushed and the
    /// depots again.
    #[inline(never)]
    fn alloc_depot(&self, req: &SlotRequest) -> Option<usize> {
        let n = req.nslots;
        if n == 0 || n > self.geom.area_nslabs || n > self.geom.segsize {
            return None;
        }
        if let Some(i) = self.search_depots(req) {
            return Some(self.hand_out(i, n));
        }
        self.flush_all();
        self.search_depots(req).map(|i| self.hand_out(i, n))
    }

    /// The complete depot search over every area, from the worker's.
    fn search_depots(&self, req: &SlotRequest) -> Option<usize> {
        self.depot
            .find_map(req.worker, |area| area.alloc(&self.geom, req))
    }
}

impl SlotAllocator for MagazineAllocator {
    fn kind(&self) -> AllocatorKind {
        AllocatorKind::Magazine
    }

    #[inline]
    fn alloc(&self, req: &SlotRequest) -> Option<usize> {
        let n = req.nslots;
        // A class run fits a segment and an area (`max_class`), so no other size check here.
        if pow2(n) && n <= 1 << self.max_class {
            if let Some(mag) = self.magazine(req.worker).try_hold() {
                let class = n.trailing_zeros() as usize;
                if let Some(i) = self.take_cached(&mag, req, class) {
                    return Some(self.hand_out(i, n));
                }
            }
        }
        self.alloc_depot(req)
    }

    #[inline]
    fn free(&self, index: usize, nslots: usize, worker: usize) {
        // A load and a store, not a compare-exchange: two frees of one run never race (the
        // pool releases a mapping only after winning the compare-exchange on its head slot),
        // so this check only has to catch frees that do not match a live run (invariant 4).
        let Some(l) = self.live.get(index) else {
            return Self::refuse(index, nslots);
        };
        // `live` holds u32 lengths: compared as usize, no conversion of `nslots` can wrap.
        if nslots == 0 || l.load(Ordering::Relaxed) as usize != nslots {
            return Self::refuse(index, nslots);
        }
        l.store(0, Ordering::Relaxed);
        if pow2(nslots) && nslots <= 1 << self.max_class {
            if let Some(mag) = self.magazine(worker).try_hold() {
                self.cache(&mag, index, nslots.trailing_zeros() as usize);
                return;
            }
        }
        self.flush_one(index, nslots);
    }

    fn flush_caches(&self) {
        self.flush_all();
    }

    // What the depot holds is what is not in use: runs cached in magazines count as used.
    fn area_used(&self) -> Vec<usize> {
        self.depot.area_used()
    }

    fn area_index(&self) -> Vec<usize> {
        self.depot.area_index()
    }

    fn lock_stats(&self) -> Vec<LockSnapshot> {
        self.depot.lock_stats()
    }

    fn reset_lock_stats(&self) {
        self.depot.reset_lock_stats();
    }
}

impl MagazineAllocator {
    /// Slots cached in magazines now.
    pub fn cached_slots(&self) -> usize {
        self.mags
            .iter()
            .map(|m| {
                let m = m.hold();
                m.runs
                    .iter()
                    .enumerate()
                    .map(|(c, l)| l.len() << c)
                    .sum::<usize>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::iova_rbtree::test_support::*;
    use crate::geometry::PoolConfig;
    use crate::DEFAULT_SEG_BOUNDARY_MASK;
    use std::sync::Arc;

    fn geom(slots: usize, areas: usize, workers: usize) -> Geometry {
        crate::alloc::test_geometry(slots, areas, workers, PoolConfig::DEFAULT_SWIOTLB_BASE)
    }

    /// Flushes the per-worker caches and checks that every slot is back in the depot.
    fn assert_all_returned(a: &MagazineAllocator) {
        a.flush_caches();
        assert_eq!(a.area_used(), vec![0]);
    }

    fn req(g: &Geometry, size: u64, worker: usize) -> SlotRequest {
        SlotRequest::new(g, 0, size, 0, 0, DEFAULT_SEG_BOUNDARY_MASK, worker)
    }

    #[test]
    fn classes() {
        assert_eq!(
            [1, 2, 3, 4, 5, 64, 65, 128].map(class_of),
            [0, 1, 2, 2, 3, 6, 7, 7]
        );
        assert_eq!(class_capacity(0), MAG_CLASS_SLOTS);
        assert_eq!(class_capacity(1), MAG_CLASS_SLOTS / 2);
        assert_eq!(class_capacity(7), 2);
    }

    #[test]
    fn a_freed_run_comes_back_first_without_touching_the_depot() {
        let (g, a) = build_ok(geom(1024, 1, 1), MagazineAllocator::new);
        let page = req(&g, 4096, 0);
        let first = a.alloc(&page).unwrap();
        // The load took half a class of 2-slot runs from the depot; one is live.
        let batch = class_capacity(1) / 2;
        assert_eq!(a.area_used(), vec![2 * batch]);
        assert_eq!(a.cached_slots(), 2 * batch - 2);
        let locks = a.lock_stats()[0].acquisitions;
        for _ in 0..100 {
            a.free(first, 2, 0);
            assert_eq!(a.alloc(&page), Some(first));
        }
        assert_eq!(
            a.lock_stats()[0].acquisitions,
            locks,
            "hot path took the depot lock"
        );
        a.free(first, 2, 0);
        assert_all_returned(&a);
    }

    #[test]
    fn an_older_cached_run_serves_a_request_the_newest_does_not_fit() {
        let (g, a) = build_ok(geom(1024, 1, 1), MagazineAllocator::new);
        let any = req(&g, 1, 0);
        let (x, y) = (a.alloc(&any).unwrap(), a.alloc(&any).unwrap());
        a.free(x, 1, 0);
        a.free(y, 1, 0); // newest on top

        // A device with min_align_mask 4 KiB: the slot's parity must match bit 11 of orig.
        let picky = [0x10_0000u64, 0x10_0800]
            .map(|orig| SlotRequest::new(&g, orig, 1, 0, 0xfff, DEFAULT_SEG_BOUNDARY_MASK, 0))
            .into_iter()
            .find(|r| r.fits(&g, x) && !r.fits(&g, y))
            .expect("x and y differ in parity");
        let locks = a.lock_stats()[0].acquisitions;
        assert_eq!(a.alloc(&picky), Some(x));
        assert_eq!(a.lock_stats()[0].acquisitions, locks, "went to the depot");
        assert!(a.magazine_has(0, y));
        a.free(x, 1, 0);
        assert_all_returned(&a);
    }

    #[test]
    fn other_sizes_bypass_the_magazines_and_frees_are_checked() {
        let (g, a) = build_ok(geom(256, 1, 1), MagazineAllocator::new);
        // 3 slots: straight from the depot, exactly 3 used, nothing cached.
        let three = req(&g, 3 * 2048 - 1, 0);
        let i = a.alloc(&three).unwrap();
        assert_eq!((a.area_used(), a.cached_slots()), (vec![3], 0));
        a.free(i, 2, 0); // wrong length refused
        a.free(i + 1, 2, 0); // not a live run's start refused
        assert_eq!(a.area_used(), vec![3]);
        a.free(i, 3, 0);
        a.free(i, 3, 0); // double free refused
        assert_eq!((a.area_used(), a.cached_slots()), (vec![0], 0));
        // A power of two is cached on free, and found on the magazine's top.
        let four = req(&g, 4 * 2048 - 1, 0);
        let j = a.alloc(&four).unwrap();
        a.free(j, 4, 0);
        assert!(a.magazine_has(0, j));
        assert_eq!(a.alloc(&four), Some(j));
        a.free(j, 4, 0);
        assert_all_returned(&a);
    }

    #[test]
    fn flush_and_retry_before_failing() {
        // Worker 1 caches freed runs; worker 0 then needs a whole segment.
        let (g, a) = build_ok(geom(256, 1, 2), MagazineAllocator::new);
        let seg = req(&g, 128 * 2048, 0);
        let s0 = a.alloc(&seg).unwrap();
        let small = alloc_n(&a, &req(&g, 4096, 1), 64);
        for &i in &small {
            a.free(i, 2, 1);
        }
        assert!(a.cached_slots() > 0);
        assert!(
            a.alloc(&seg).is_some(),
            "cached runs must be flushed and merged"
        );
        assert!(a.alloc(&req(&g, 1, 0)).is_none());
        a.free(s0, 128, 0);
    }

    #[test]
    fn alignment_and_phase() {
        for g in [iova_geom(512, 2), swiotlb_geom(1024, 2)] {
            check_alignment(&MagazineAllocator::new(&g).unwrap(), &g);
        }
    }

    #[test]
    fn exhaustion_and_recovery() {
        for g in [iova_geom(300, 2), swiotlb_geom(512, 2)] {
            let a = MagazineAllocator::new(&g).unwrap();
            check_exhaustion(&a, &g, &|| a.flush_caches());
        }
    }

    #[test]
    fn stress_eight_threads() {
        for (g, max) in [(swiotlb_geom(4096, 8), 128), (iova_geom(2048, 8), 64)] {
            let a = Arc::new(MagazineAllocator::new(&g).unwrap());
            let flush = {
                let a = a.clone();
                move || a.flush_caches()
            };
            let dyn_a: Arc<dyn SlotAllocator> = a;
            stress(dyn_a, g, max, &flush);
        }
    }

    #[test]
    fn pool_map_unmap() {
        pool_round_trip(AllocatorKind::Magazine);
    }

    impl MagazineAllocator {
        fn magazine_has(&self, worker: usize, slot: usize) -> bool {
            self.mags[worker]
                .hold()
                .runs
                .iter()
                .any(|l| l.contains(slot))
        }
    }
}
