//! Slot allocators: ten strategies behind one trait.
//!
//! A [`BouncePool`](crate::BouncePool) turns a map request into a [`SlotRequest`] (a number of
//! slots and the placement rules of Linux swiotlb) and asks its [`SlotAllocator`] for the first
//! slot of a run that satisfies it. The pool owns the per-slot metadata (original address,
//! remaining size, padding) and the copies; an allocator owns only its free-space structure and
//! its locks. On unmap the pool computes the run to release exactly as Linux does and hands it
//! back with [`SlotAllocator::free`].
//!
//! | name | models |
//! |---|---|
//! | `legacy` | one global lock, free-run counts, rolling index (Linux before 5.19/6.0) |
//! | `bitmap` | one lock, bitmap of free slots, find-next-zero-area (2022 series patch 1) |
//! | `areas` | per-area locks with free-run counts (Linux 6.x, exact) |
//! | `areas-bitmap` | per-area locks with bitmaps (the whole 2022 series) |
//! | `iova-rbtree` | ordered-tree range allocator, top-down from a cached node, one lock (`alloc_iova`) |
//! | `iova-rcache` | per-worker magazines and a depot in front of `iova-rbtree` (`alloc_iova_fast`) |
//! | `genpool` | first-fit bitmap, word-wise compare-and-swap, lock-free (`gen_pool_alloc`) |
//! | `iova-bitmap` | per-worker bitmaps for small requests, tree fallback for larger ones |
//! | `areas-lifo` | `areas`, with the most recently freed run reused first (2022 series patch 3) |
//! | `magazine` | per-worker magazines of power-of-two runs over per-area bitmap depots (ours) |
//!
//! Every allocator must return only runs for which [`SlotRequest::fits`] is true, must never
//! hand out a slot twice, and must make every freed slot available again.

/// The four checks shared by the allocators without per-worker caches (`genpool`,
/// `iova_bitmap`): alignment, exhaustion and recovery, eight-thread stress, a pool round trip.
/// `$new` builds the allocator from a geometry; the iova geometries of the exhaustion and stress
/// tests take `$exhaust_workers` and the swiotlb stress geometry `$stress_workers` workers.
/// Expands inside a test module that imports `iova_rbtree::test_support::*` and `Arc`.
#[cfg(test)]
macro_rules! uncached_allocator_tests {
    ($new:path, $kind:expr, exhaust_workers: $ew:expr, stress_workers: $sw:expr) => {
        #[test]
        fn alignment_and_phase() {
            for g in [iova_geom(512, 2), swiotlb_geom(1024, 2)] {
                check_alignment(&$new(&g), &g);
            }
        }

        #[test]
        fn exhaustion_and_recovery() {
            let g = iova_geom(300, $ew);
            check_exhaustion(&$new(&g), &g, &|| {});
            let g = swiotlb_geom(512, 2);
            check_exhaustion(&$new(&g), &g, &|| {});
        }

        #[test]
        fn stress_eight_threads() {
            let g = iova_geom(2048, 8);
            stress(Arc::new($new(&g)), g, 64, &|| {});
            let g = swiotlb_geom(4096, $sw);
            stress(Arc::new($new(&g)), g, 128, &|| {});
        }

        #[test]
        fn pool_map_unmap() {
            pool_round_trip($kind);
        }
    };
}

mod areas;
mod areas_bitmap;
mod areas_lifo;
mod bitmap;
mod genpool;
mod iova_bitmap;
mod iova_rbtree;
mod iova_rcache;
mod legacy;
mod lock;
mod locked;
mod magazine;

use std::fmt;
use std::sync::Arc;

use crate::error::Result;
use crate::geometry::Geometry;
use crate::types::{AllocatorKind, PoolMode};
use crate::PAGE_SIZE;

pub use areas_lifo::{RECENT_PROBE, RECENT_RUNS};
pub use genpool::Genpool;
pub use iova_bitmap::{IovaBitmap, SMALL_BYTES};
pub use iova_rbtree::IovaRbtree;
pub use iova_rcache::{IovaRcache, DEPOT_DELAY, IOVA_MAG_SIZE, IOVA_RANGE_CACHE_MAX_SIZE};
pub use lock::{LockSnapshot, TimedMutex};
pub use magazine::{class_capacity, MagazineAllocator, MAG_CLASS_SLOTS, MAX_CLASS};

/// One allocation request in slot units, with Linux swiotlb's placement rules already derived
/// (`swiotlb_search_pool_area`): the page-alignment rule, the slot-size floor on
/// `alloc_align_mask`, and `iotlb_align_mask = min_align_mask & !alloc_align_mask`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRequest {
    /// Number of slots (at least 1).
    pub nslots: usize,
    /// Original address; 0 means "none" and disables the `iotlb_align_mask` rule, as in Linux.
    pub orig: u64,
    /// Required zero bits of the first slot's device address (at least the slot size - 1).
    pub alloc_align_mask: u64,
    /// Bits of the first slot's device address that must equal those of `orig`.
    pub iotlb_align_mask: u64,
    /// Device segment boundary mask (`mask + 1` is a power of two, or the mask is all ones).
    pub boundary_mask: u64,
    /// The calling worker.
    pub worker: usize,
}

/// True for a power of two: a mask test, because `is_power_of_two` is a popcount, emulated
/// without the target feature, and the allocators' hot paths ask on every map and unmap.
#[inline(always)]
pub(crate) fn pow2(n: usize) -> bool {
    n != 0 && n & (n - 1) == 0
}

impl SlotRequest {
    /// Derives a request the way `swiotlb_search_pool_area` does.
    ///
    /// `alloc_size` is the allocation size in bytes, alignment padding included (what Linux
    /// passes to `swiotlb_find_slots`). The page-alignment rule (allocations of a page or more
    /// are page aligned when neither mask is set) applies in swiotlb mode only.
    #[inline]
    pub fn new(
        geom: &Geometry,
        orig: u64,
        alloc_size: u64,
        alloc_align_mask: u64,
        min_align_mask: u64,
        boundary_mask: u64,
        worker: usize,
    ) -> Self {
        let mut alloc_align_mask = alloc_align_mask;
        let mut iotlb_align_mask = min_align_mask;
        if geom.mode == PoolMode::Swiotlb
            && alloc_align_mask == 0
            && iotlb_align_mask == 0
            && alloc_size >= PAGE_SIZE
        {
            alloc_align_mask = PAGE_SIZE - 1;
        }
        alloc_align_mask |= geom.slot_size() - 1;
        iotlb_align_mask &= !alloc_align_mask;
        Self {
            nslots: geom.nr_slots(alloc_size) as usize,
            orig,
            alloc_align_mask,
            iotlb_align_mask,
            boundary_mask,
            worker,
        }
    }

    /// Device address used for alignment and boundary checks of slot 0 (Linux
    /// `tbl_dma_addr = start & boundary_mask`).
    #[inline(always)]
    pub fn tbl_base(&self, geom: &Geometry) -> u64 {
        geom.base & self.boundary_mask
    }

    /// Slots a linear search may skip once it found an aligned slot (Linux `stride`).
    pub fn stride(&self, geom: &Geometry) -> usize {
        let m = self.alloc_align_mask.max(self.iotlb_align_mask);
        ((m >> geom.slot_shift) + 1) as usize
    }

    /// True when a run starting at `index` has the required alignment and original-address
    /// bits (the first test of Linux's search loop).
    #[inline(always)]
    pub fn aligned(&self, geom: &Geometry, index: usize) -> bool {
        let tlb = self.tbl_base(geom) + ((index as u64) << geom.slot_shift);
        if tlb & self.alloc_align_mask != 0 {
            return false;
        }
        self.orig == 0 || (tlb & self.iotlb_align_mask) == (self.orig & self.iotlb_align_mask)
    }

    /// True when a run starting at `index` crosses the device segment boundary (Linux
    /// `iommu_is_span_boundary(index, nslots, nr_slots(tbl_dma_addr), max_slots)`).
    #[inline(always)]
    pub fn crosses_boundary(&self, geom: &Geometry, index: usize) -> bool {
        let max_slots = (self.boundary_mask >> geom.slot_shift).wrapping_add(1);
        if max_slots == 0 {
            // boundary_mask >> shift == u64::MAX cannot happen for shift > 0; be safe.
            return false;
        }
        let shift = geom
            .nr_slots(self.tbl_base(geom))
            .wrapping_add(index as u64)
            & (max_slots - 1);
        shift + self.nslots as u64 > max_slots
    }

    /// True when a run starting at `index` lies inside the pool and inside one segment.
    #[inline(always)]
    pub fn in_segment(&self, geom: &Geometry, index: usize) -> bool {
        // This is on every map: `pow2`, not `is_power_of_two`.
        let in_seg = if pow2(geom.segsize) {
            index & (geom.segsize - 1)
        } else {
            index % geom.segsize
        };
        index
            .checked_add(self.nslots)
            .is_some_and(|end| end <= geom.nslabs)
            && in_seg + self.nslots <= geom.segsize
    }

    /// Every placement rule at once: what any allocator's answer must satisfy.
    #[inline(always)]
    pub fn fits(&self, geom: &Geometry, index: usize) -> bool {
        self.in_segment(geom, index)
            && self.aligned(geom, index)
            && !self.crosses_boundary(geom, index)
    }

    /// The alignment rules as "index ≡ phase (mod align)", for allocators that compute
    /// candidates instead of scanning: `align` is a power of two (in slots) and `phase < align`.
    ///
    /// Exact when both masks are of the form `2^k - 1` (the pool checks that).
    pub fn align_phase(&self, geom: &Geometry) -> (usize, usize) {
        let mask = if self.orig == 0 {
            self.alloc_align_mask
        } else {
            self.alloc_align_mask | self.iotlb_align_mask
        };
        let align = (mask >> geom.slot_shift) + 1;
        let want = if self.orig == 0 {
            0
        } else {
            self.orig & self.iotlb_align_mask
        };
        let phase = (want.wrapping_sub(self.tbl_base(geom)) >> geom.slot_shift) & (align - 1);
        (align as usize, phase as usize)
    }
}

/// A run of slots to release, as [`SlotAllocator::alloc`] returned it for a request of
/// `nslots` slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// First slot.
    pub index: usize,
    /// Slots.
    pub nslots: usize,
}

/// The allocations of a [`SlotAllocator::batch`]: `alloc` on each of `reqs` in order until
/// one finds nothing, the first slots written to `out`; returns how many were served.
pub(crate) fn serve(
    reqs: &[SlotRequest],
    out: &mut [usize],
    mut alloc: impl FnMut(&SlotRequest) -> Option<usize>,
) -> usize {
    let mut served = 0;
    for (req, slot) in reqs.iter().zip(out.iter_mut()) {
        let Some(index) = alloc(req) else {
            break;
        };
        *slot = index;
        served += 1;
    }
    served
}

/// One [`SlotAllocator::batch`]: runs to release on behalf of `worker`, then requests to
/// claim runs for, in order.
#[derive(Clone, Copy, Debug)]
pub struct SlotBatch<'a> {
    /// Runs to release, in order.
    pub frees: &'a [Run],
    /// The releasing worker (per-worker caches free into its own).
    pub worker: usize,
    /// Requests to claim runs for, in order.
    pub reqs: &'a [SlotRequest],
}

/// A strategy for finding runs of free slots.
///
/// Implementations are shared between threads; each models the locking of the algorithm it is
/// named after.
pub trait SlotAllocator: Send + Sync + fmt::Debug {
    /// Which allocator this is.
    fn kind(&self) -> AllocatorKind;

    /// Finds and claims a run of `req.nslots` slots for which [`SlotRequest::fits`] holds, and
    /// returns its first slot, or `None` when there is none.
    fn alloc(&self, req: &SlotRequest) -> Option<usize>;

    /// Releases the run `index..index + nslots`, which `alloc` returned for a request of
    /// `nslots` slots. `worker` is the releasing worker (per-worker caches free into its own).
    fn free(&self, index: usize, nslots: usize, worker: usize);

    /// Releases `b.frees` in order, then claims runs for `b.reqs` in order until one finds
    /// none, writing the first slot of each claimed run to `out`; returns how many of
    /// `b.reqs` were served (`out` must hold at least `b.reqs.len()`).
    ///
    /// The result is exactly that of [`free`](SlotAllocator::free) on each of the runs and
    /// then [`alloc`](SlotAllocator::alloc) on each of the requests, stopping at the first
    /// `None`: the same slots, the same rolling indexes, the same failure. Allocators with
    /// locks take each lock once for a batch where the calls one by one would take it per
    /// call.
    fn batch(&self, b: &SlotBatch<'_>, out: &mut [usize]) -> usize {
        for f in b.frees {
            self.free(f.index, f.nslots, b.worker);
        }
        serve(b.reqs, out, |req| self.alloc(req))
    }

    /// Finds and claims a run for `req` in area `area` alone (Linux
    /// `swiotlb_search_pool_area`), for allocators with one range per area; `None` when the
    /// run is not there or the allocator has no such areas. Dynamic pools search this way.
    fn alloc_in_area(&self, _area: usize, _req: &SlotRequest) -> Option<usize> {
        None
    }

    /// Slots in use per area (one entry for allocators without areas). Slots held in
    /// per-worker caches count as used.
    fn area_used(&self) -> Vec<usize>;

    /// The rolling search index per area, for allocators that have one (empty otherwise).
    fn area_index(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Returns runs held in per-worker caches to the shared structure (nothing for
    /// allocators without caches). Afterwards, with no concurrent user, [`area_used`]
    /// counts exactly the slots of live runs.
    ///
    /// [`area_used`]: SlotAllocator::area_used
    fn flush_caches(&self) {}

    /// Lock statistics, one entry per lock (empty for lock-free allocators).
    fn lock_stats(&self) -> Vec<LockSnapshot>;

    /// Resets the lock statistics.
    fn reset_lock_stats(&self);
}

/// `areas` for a pool of one area of any length up to a segment: a transient pool, sized to
/// its one mapping.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for a geometry of more than one area.
pub(crate) fn single_area(geom: &Geometry) -> Result<impl SlotAllocator> {
    if geom.nareas != 1 || geom.nslabs > geom.segsize {
        return Err(crate::Error::Config(format!(
            "a single run of {} slots in {} areas",
            geom.nslabs, geom.nareas
        )));
    }
    areas::partial(geom)
}

/// Builds an allocator of `kind` for `geom`.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) when the allocator cannot serve this geometry.
pub fn build(kind: AllocatorKind, geom: &Geometry) -> Result<Arc<dyn SlotAllocator>> {
    match kind {
        AllocatorKind::Legacy => Ok(Arc::new(legacy::new(geom)?)),
        AllocatorKind::Bitmap => Ok(Arc::new(bitmap::new(geom)?)),
        AllocatorKind::Areas => Ok(Arc::new(areas::new(geom)?)),
        AllocatorKind::AreasBitmap => Ok(Arc::new(areas_bitmap::new(geom)?)),
        AllocatorKind::IovaRbtree => Ok(Arc::new(IovaRbtree::new(geom, true))),
        AllocatorKind::IovaRcache => Ok(Arc::new(IovaRcache::new(geom))),
        AllocatorKind::Genpool => Ok(Arc::new(Genpool::new(geom))),
        AllocatorKind::IovaBitmap => Ok(Arc::new(IovaBitmap::new(geom))),
        AllocatorKind::AreasLifo => Ok(Arc::new(areas_lifo::new(geom)?)),
        AllocatorKind::Magazine => Ok(Arc::new(MagazineAllocator::new(geom)?)),
    }
}

/// A request for the allocators' unit tests: `size` bytes for original address `orig` with
/// `min_align_mask`, no allocation alignment and the default segment boundary.
#[cfg(test)]
pub(crate) fn test_request(
    g: &Geometry,
    orig: u64,
    size: u64,
    min_align: u64,
    worker: usize,
) -> SlotRequest {
    SlotRequest::new(
        g,
        orig,
        size,
        0,
        min_align,
        crate::DEFAULT_SEG_BOUNDARY_MASK,
        worker,
    )
}

/// A swiotlb-mode geometry for the allocators' unit tests: `slots` slots in `areas` areas,
/// served by `workers` workers, the pool at `base`.
#[cfg(test)]
pub(crate) fn test_geometry(slots: usize, areas: usize, workers: usize, base: u64) -> Geometry {
    let mut c = crate::geometry::PoolConfig::swiotlb(slots);
    c.areas = Some(areas);
    c.workers = workers;
    c.base = base;
    c.geometry().expect("a test geometry")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::PoolConfig;
    use rand::{Rng, SeedableRng};

    /// Random maps and unmaps with random masks through each of `kinds`: every run fits, no slot
    /// is handed out twice, and once everything is freed every segment can be allocated whole.
    fn stress(kind: AllocatorKind, slots: usize, areas: usize, base: u64) {
        let mut c = PoolConfig::swiotlb(slots);
        c.areas = Some(areas);
        c.workers = areas;
        c.base = base;
        let g = c.geometry().unwrap();
        let a = build(kind, &g).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed ^ slots as u64);
        let mut owner = vec![usize::MAX; g.nslabs];
        let mut live: Vec<(usize, usize)> = Vec::new();
        for step in 0..20_000 {
            if !live.is_empty() && (rng.gen_bool(0.45) || live.len() > 200) {
                let (i, n) = live.swap_remove(rng.gen_range(0..live.len()));
                owner[i..i + n].fill(usize::MAX);
                a.free(i, n, rng.gen_range(0..8));
                continue;
            }
            let size = match rng.gen_range(0..4) {
                0 => rng.gen_range(1..2048),
                1 => rng.gen_range(1..16384),
                2 => rng.gen_range(1..=262_144),
                _ => 4096,
            };
            let min_align = [0, 0, 0xfff, 0x3ff][rng.gen_range(0..4)];
            let align = [0, 0, 0, 0x3fff][rng.gen_range(0..4)];
            let boundary = [u64::MAX, 0xffff_ffff, 0x3ffff, 0xffff][rng.gen_range(0..4)];
            let orig: u64 = rng.gen_range(0..1u64 << 32);
            let r = SlotRequest::new(
                &g,
                orig,
                size,
                align,
                min_align,
                boundary,
                rng.gen_range(0..8),
            );
            if let Some(i) = a.alloc(&r) {
                assert!(r.fits(&g, i), "{kind} step {step}: {r:?} at {i}");
                for (k, o) in owner[i..i + r.nslots].iter_mut().enumerate() {
                    assert_eq!(*o, usize::MAX, "{kind} step {step}: slot {} twice", i + k);
                    *o = step;
                }
                live.push((i, r.nslots));
            }
        }
        a.flush_caches();
        let used: usize = a.area_used().iter().sum();
        assert_eq!(used, live.iter().map(|l| l.1).sum::<usize>(), "{kind}");
        for (i, n) in live.drain(..) {
            a.free(i, n, 0);
        }
        a.flush_caches();
        assert_eq!(a.area_used().iter().sum::<usize>(), 0, "{kind}");
        // Slot alignment only: a pool that starts half a page in has no page-aligned segment.
        let seg = SlotRequest::new(&g, 0, 128 * 2048, 0x7ff, 0, u64::MAX, 0);
        for _ in 0..g.nslabs / 128 {
            assert!(a.alloc(&seg).is_some(), "{kind}: leaked slots");
        }
        assert!(a
            .alloc(&SlotRequest::new(&g, 0, 1, 0, 0, u64::MAX, 0))
            .is_none());
    }

    #[test]
    fn swiotlb_allocators_never_double_allocate_or_leak() {
        for kind in [
            AllocatorKind::Areas,
            AllocatorKind::AreasBitmap,
            AllocatorKind::Bitmap,
            AllocatorKind::Legacy,
            AllocatorKind::AreasLifo,
            AllocatorKind::Magazine,
        ] {
            stress(kind, 1024, 1, 0x4000_0000);
            stress(kind, 2048, 4, 0x4000_0800);
        }
    }

    /// One batch of a random workload: runs to free (positions in the live list, taken in
    /// order) and requests (size in bytes, `min_align_mask`, worker).
    type Step = (Vec<usize>, Vec<(u64, u64, usize)>, usize);

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        let req = (
            prop_oneof![1u64..4096, Just(4096u64), 4096u64..65536, 65536u64..262_144],
            prop_oneof![Just(0u64), Just(0xfffu64)],
            0usize..4,
        );
        (
            proptest::collection::vec(0usize..64, 0..4),
            proptest::collection::vec(req, 0..5),
            0usize..4,
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// A batch claims the same runs, fails at the same request and leaves the same used
        /// counts and rolling indexes as its frees and allocations one by one, for every
        /// allocator whose results do not depend on the clock (`iova-rcache` trims its depot
        /// by time; it batches through the trait's sequential default).
        #[test]
        fn a_batch_does_what_its_calls_one_by_one_do(
            steps in proptest::collection::vec(step(), 1..60),
            areas in proptest::prop_oneof![proptest::strategy::Just(1usize), proptest::strategy::Just(2usize)],
        ) {
            // A small pool, so that batches fail in the middle.
            let g = test_geometry(512, areas, 4, 0x4000_0800);
            for kind in AllocatorKind::ALL {
                if kind == AllocatorKind::IovaRcache {
                    continue;
                }
                let batched = build(kind, &g).unwrap();
                let single = build(kind, &g).unwrap();
                let mut live: Vec<Run> = Vec::new();
                for (n, (frees, reqs, worker)) in steps.iter().enumerate() {
                    let mut runs = Vec::new();
                    for &k in frees {
                        if !live.is_empty() {
                            runs.push(live.swap_remove(k % live.len()));
                        }
                    }
                    let reqs: Vec<SlotRequest> = reqs
                        .iter()
                        .map(|&(size, min_align, w)| {
                            SlotRequest::new(&g, 0x1234_5000 + size, size, 0, min_align, u64::MAX, w)
                        })
                        .collect();
                    let mut out = vec![usize::MAX; reqs.len()];
                    let served = batched.batch(
                        &SlotBatch { frees: &runs, worker: *worker, reqs: &reqs },
                        &mut out,
                    );
                    for r in &runs {
                        single.free(r.index, r.nslots, *worker);
                    }
                    let mut one_by_one = Vec::new();
                    for r in &reqs {
                        match single.alloc(r) {
                            Some(i) => one_by_one.push(i),
                            None => break,
                        }
                    }
                    proptest::prop_assert_eq!(&out[..served], &one_by_one[..], "{} step {}", kind, n);
                    proptest::prop_assert_eq!(batched.area_used(), single.area_used(), "{} step {}", kind, n);
                    proptest::prop_assert_eq!(batched.area_index(), single.area_index(), "{} step {}", kind, n);
                    live.extend(out[..served].iter().zip(&reqs).map(|(&index, r)| Run {
                        index,
                        nslots: r.nslots,
                    }));
                }
            }
        }
    }

    /// A batch of worker 1.
    fn batch<'a>(frees: &'a [Run], reqs: &'a [SlotRequest]) -> SlotBatch<'a> {
        SlotBatch {
            frees,
            worker: 1,
            reqs,
        }
    }

    #[test]
    fn a_batch_takes_each_area_lock_once() {
        let g = test_geometry(1024, 2, 2, 0x4000_0000);
        let a = build(AllocatorKind::Areas, &g).unwrap();
        let page = SlotRequest::new(&g, 0x1000, 4096, 0, 0, u64::MAX, 1);
        let byte = SlotRequest::new(&g, 0x2000, 1, 0, 0, u64::MAX, 1);
        let mut out = [0; 3];
        assert_eq!(a.batch(&batch(&[], &[byte, page, byte]), &mut out), 3);
        let locks = |a: &Arc<dyn SlotAllocator>| {
            a.lock_stats()
                .iter()
                .map(|l| l.acquisitions)
                .collect::<Vec<_>>()
        };
        assert_eq!(locks(&a), vec![0, 1]);
        let runs = [
            Run {
                index: out[0],
                nslots: 1,
            },
            Run {
                index: out[1],
                nslots: 2,
            },
            Run {
                index: out[2],
                nslots: 1,
            },
        ];
        assert_eq!(a.batch(&batch(&runs, &[]), &mut []), 0);
        assert_eq!(locks(&a), vec![0, 2]);
        assert_eq!(a.area_used(), vec![0, 0]);
    }

    #[test]
    fn every_allocator_is_built_by_name() {
        let g = PoolConfig::swiotlb(128).geometry().unwrap();
        for kind in AllocatorKind::ALL {
            let a = build(kind, &g).unwrap();
            assert_eq!(a.kind(), kind);
            assert_eq!(kind.name().parse::<AllocatorKind>().unwrap(), kind);
        }
        assert!("nope".parse::<AllocatorKind>().is_err());
    }
}
