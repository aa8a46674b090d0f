//! `iova-rbtree`: Linux's ordered-tree IOVA range allocator (`alloc_iova`, `free_iova` in
//! `drivers/iommu/iova.c`), under one lock.
//!
//! The domain's "pfns" are slot indices `0..nslabs`. Allocated ranges live in an ordered map
//! keyed by their first pfn (a `BTreeMap` stands in for the red-black tree). An allocation walks
//! the tree *downwards* from a cached node, looking at the gap below each node for the highest
//! start that fits, so the domain fills from the top:
//!
//! - **Cached node.** After an allocation the new range becomes the cached node, so the next walk
//!   starts just below it instead of at the top of the domain. Linux keeps two (`cached_node` and
//!   `cached32_node`, for limits above and below 4 GiB); a bounce domain is always allocated up to
//!   its own top, which is a "32-bit" limit in Linux terms (VDUSE's bounce region is far below
//!   4 GiB), so only the `cached32_node` behaviour is modelled. A missing cached node means the
//!   anchor, the sentinel above the top of the domain.
//! - **Retry above the cached node.** When the walk from the cached node reaches the bottom, the
//!   gaps above the cached node are searched once more from the top (Linux's `retry_pfn` pass).
//!   Together the two passes see every gap.
//! - **Failure cache** (`max32_alloc_size`). A failed search records its size; later requests of
//!   that size or larger fail at once, until any range is freed. Only requests whose placement
//!   depends on their size alone take part (no alignment or original-address rule of their own):
//!   for those, "size S does not fit" implies "nothing larger fits", which is what makes the cache
//!   sound; Linux applies it to every request of a domain.
//! - **Size alignment** (`size_aligned`): the first pfn is a multiple of
//!   `roundup_pow_of_two(size)`, exactly as `alloc_iova(.., size_aligned = true)` shifts its
//!   alignment mask by `fls_long(size - 1)`. Alignment is of the *device* pfn
//!   (`geom.base >> slot_shift` plus the index), as Linux aligns absolute pfns. When the
//!   request's own rules ([`SlotRequest::align_phase`]) demand a phase that the size alignment
//!   cannot give, the size alignment is dropped and the request's rules win: they are mandatory,
//!   the size alignment is only the allocator's anti-fragmentation policy.
//! - **Free** finds the range that contains the pfn (as `private_find_iova` does), moves the cached
//!   node up to the freed range's successor when the freed range is at or above it, resets the
//!   failure cache and removes the range.
//!
//! Segments and device boundaries (swiotlb-mode pools) are honoured by skipping candidates that
//! would cross one; see [`Placement`].

use std::collections::BTreeMap;

use super::{serve, LockSnapshot, SlotAllocator, SlotBatch, SlotRequest, TimedMutex};
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// The placement rules of one request, in the form the searches need: the run length, and
/// "index ≡ phase (mod align)" with the allocator's size alignment folded in.
///
/// [`SlotRequest::fits`] stays the final judge of every candidate; the arithmetic here only
/// skips candidates that cannot fit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placement {
    /// The request to check candidates against (its `nslots` is the run that is claimed).
    pub(crate) req: SlotRequest,
    /// Candidates are congruent to `phase` modulo `align` (a power of two).
    pub(crate) align: usize,
    /// See `align`.
    pub(crate) phase: usize,
}

impl Placement {
    /// The rules of `req` for a run of `req.nslots` slots, with size alignment to
    /// `roundup_pow_of_two(nslots)` when `size_aligned`. `None` when no run of that size can
    /// exist in the domain (zero or more slots than the domain has).
    pub(crate) fn new(geom: &Geometry, req: &SlotRequest, size_aligned: bool) -> Option<Self> {
        if req.nslots == 0 || req.nslots > geom.nslabs {
            return None;
        }
        let (align, phase) = req.align_phase(geom);
        let (mut align, mut phase) = (align.max(1), phase);
        if size_aligned {
            let sa = req.nslots.checked_next_power_of_two()?;
            if sa > align {
                // Index i has device pfn base_pfn + i; it is a multiple of sa when
                // i ≡ -base_pfn (mod sa).
                let base_pfn = (geom.base >> geom.slot_shift) as usize;
                let sa_phase = base_pfn.wrapping_neg() & (sa - 1);
                if sa_phase & (align - 1) == phase {
                    align = sa;
                    phase = sa_phase;
                }
            }
        }
        Some(Self {
            req: *req,
            align,
            phase,
        })
    }

    /// True when the request has no alignment rule of its own, so its placement depends on its
    /// size only (the condition for the failure cache).
    pub(crate) fn size_only(geom: &Geometry, req: &SlotRequest) -> bool {
        req.align_phase(geom).0 <= 1
    }

    /// Number of slots of the run.
    pub(crate) fn nslots(&self) -> usize {
        self.req.nslots
    }

    /// Smallest `y >= x` with `y ≡ phase (mod align)`.
    fn align_up(&self, x: usize) -> Option<usize> {
        let delta = self.phase.wrapping_sub(x) & (self.align - 1);
        x.checked_add(delta)
    }

    /// Largest `y <= x` with `y ≡ phase (mod align)`.
    fn align_down(&self, x: usize) -> Option<usize> {
        let delta = x.wrapping_sub(self.phase) & (self.align - 1);
        x.checked_sub(delta)
    }

    /// End (exclusive) of the segment or device-boundary block that a run starting at `x`
    /// would cross, or `None` when it crosses neither.
    fn crossed_block_end(&self, geom: &Geometry, x: usize) -> Option<usize> {
        let n = self.nslots();
        let mut end: Option<usize> = None;
        if geom.segsize > 0 && (x % geom.segsize) + n > geom.segsize {
            end = Some(
                (x / geom.segsize)
                    .saturating_add(1)
                    .saturating_mul(geom.segsize),
            );
        }
        if self.req.crosses_boundary(geom, x) {
            let max_slots = (self.req.boundary_mask >> geom.slot_shift).wrapping_add(1);
            if max_slots != 0 {
                let off = geom
                    .nr_slots(self.req.tbl_base(geom))
                    .wrapping_add(x as u64)
                    & (max_slots - 1);
                let left = usize::try_from(max_slots - off).unwrap_or(usize::MAX);
                let b = x.saturating_add(left);
                end = Some(end.map_or(b, |e| e.min(b)));
            }
        }
        end
    }

    /// The lowest start `x` in `from..` with `x + nslots <= end` that fits the request.
    pub(crate) fn lowest(&self, geom: &Geometry, from: usize, end: usize) -> Option<usize> {
        let n = self.nslots();
        let end = end.min(geom.nslabs);
        let mut x = self.align_up(from)?;
        loop {
            if x.checked_add(n)? > end {
                return None;
            }
            if self.req.fits(geom, x) {
                return Some(x);
            }
            // Any start between x and the end of the block x's run crosses would cross it too.
            let next = match self.crossed_block_end(geom, x) {
                Some(e) if e > x => e,
                _ => x.checked_add(1)?,
            };
            x = self.align_up(next)?;
        }
    }

    /// The highest start `x >= lo` with `x + nslots <= hi` that fits the request.
    pub(crate) fn highest(&self, geom: &Geometry, lo: usize, hi: usize) -> Option<usize> {
        let n = self.nslots();
        let mut hi = hi.min(geom.nslabs);
        loop {
            let x = self.align_down(hi.checked_sub(n)?)?;
            if x < lo {
                return None;
            }
            if self.req.fits(geom, x) {
                return Some(x);
            }
            // A run below x must end at or before the block boundary x's run crosses; that
            // boundary is at most x + n - 1, so the next candidate is strictly lower.
            hi = match self.crossed_block_end(geom, x) {
                Some(e) if e < x + n => e,
                _ => x + n - 1,
            };
        }
    }
}

/// Marks "no failure recorded" in [`IovaTree::max_alloc_size`].
const NO_FAILURE: usize = usize::MAX;

/// The tree of allocated ranges of one IOVA domain `start..end` (Linux `struct iova_domain`
/// minus its lock and caches). Not synchronised: its owner wraps it in a lock.
#[derive(Debug)]
pub(crate) struct IovaTree {
    /// First pfn the tree may hand out (Linux `start_pfn`).
    start: usize,
    /// One past the last pfn (Linux `limit_pfn + 1`; the anchor sits here).
    end: usize,
    /// Allocated ranges: first pfn -> number of pfns. Ranges never overlap.
    ranges: BTreeMap<usize, usize>,
    /// First pfn of the cached node (`cached32_node`); `None` is the anchor above `end`.
    cached: Option<usize>,
    /// Smallest size that failed since the last free (`max32_alloc_size`), or `NO_FAILURE`.
    max_alloc_size: usize,
    /// Pfns in allocated ranges.
    used: usize,
}

impl IovaTree {
    /// An empty tree over pfns `start..end`.
    pub(crate) fn new(start: usize, end: usize) -> Self {
        Self {
            start,
            end: end.max(start),
            ranges: BTreeMap::new(),
            cached: None,
            max_alloc_size: NO_FAILURE,
            used: 0,
        }
    }

    /// Pfns in allocated ranges.
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// The node below the node starting at `lo` (or below the anchor when `lo` is `None`):
    /// `(first pfn, size)`.
    fn prev_node(&self, lo: Option<usize>) -> Option<(usize, usize)> {
        let r = match lo {
            Some(lo) => self.ranges.range(..lo).next_back(),
            None => self.ranges.iter().next_back(),
        };
        r.map(|(&l, &s)| (l, s))
    }

    /// First pfn of a node, the anchor counting as `end`.
    fn node_lo(&self, node: Option<usize>) -> usize {
        node.unwrap_or(self.end)
    }

    /// Walks down from `from` (a node's first pfn, `None` = anchor) looking at the gaps below
    /// each node whose pfns are at least `low`, and returns the highest fitting start.
    fn walk_down(
        &self,
        geom: &Geometry,
        p: &Placement,
        from: Option<usize>,
        low: usize,
    ) -> Option<usize> {
        let mut high = self.node_lo(from).min(self.end);
        let mut curr = from;
        loop {
            let below = self.prev_node(curr);
            let gap_lo = below.map_or(self.start, |(l, s)| l + s).max(low);
            if gap_lo < high {
                if let Some(x) = p.highest(geom, gap_lo, high) {
                    return Some(x);
                }
            }
            let (l, _) = below?;
            if l < low {
                return None;
            }
            high = high.min(l);
            curr = Some(l);
        }
    }

    /// Allocates a range of `p.nslots()` pfns, top-down from the cached node (Linux
    /// `__alloc_and_insert_iova_range`). `size_only` says whether the failure cache applies.
    pub(crate) fn alloc(
        &mut self,
        geom: &Geometry,
        p: &Placement,
        size_only: bool,
    ) -> Option<usize> {
        let size = p.nslots();
        if size_only && size >= self.max_alloc_size {
            return None;
        }
        let cached = self.cached;
        let found = self.walk_down(geom, p, cached, self.start).or_else(|| {
            // Retry the part above the cached node, from the top.
            let retry = cached.map(|lo| lo + self.ranges.get(&lo).copied().unwrap_or(1));
            match retry {
                Some(r) if r < self.end => self.walk_down(geom, p, None, r),
                _ => None,
            }
        });
        let Some(x) = found else {
            if size_only {
                self.max_alloc_size = size;
            }
            return None;
        };
        self.ranges.insert(x, size);
        self.used += size;
        self.cached = Some(x);
        Some(x)
    }

    /// Frees the range containing `pfn` (Linux `free_iova`) and returns its `(first pfn,
    /// size)`, or `None` when no range contains it.
    pub(crate) fn free(&mut self, pfn: usize) -> Option<(usize, usize)> {
        let (lo, size) = self
            .ranges
            .range(..=pfn)
            .next_back()
            .map(|(&l, &s)| (l, s))
            .filter(|&(l, s)| pfn < l + s)?;
        // __cached_rbnode_delete_update: a free at or above the cached node moves it to the
        // freed node's successor, so the next walk starts above the new hole.
        if lo >= self.node_lo(self.cached) {
            self.cached = self.ranges.range(lo + 1..).next().map(|(&l, _)| l);
        }
        self.max_alloc_size = NO_FAILURE;
        self.ranges.remove(&lo);
        self.used -= size;
        Some((lo, size))
    }
}

/// The `iova-rbtree` allocator: one ordered tree of allocated ranges over the whole domain, under
/// one lock.
#[derive(Debug)]
pub struct IovaRbtree {
    geom: Geometry,
    size_aligned: bool,
    tree: TimedMutex<IovaTree>,
}

impl IovaRbtree {
    /// An allocator over all of `geom`'s slots. With `size_aligned`, every range starts at a
    /// multiple of `roundup_pow_of_two(size)` (device pfns) when the request's own alignment
    /// rules allow it, as `alloc_iova(.., size_aligned = true)`.
    pub fn new(geom: &Geometry, size_aligned: bool) -> Self {
        Self {
            geom: *geom,
            size_aligned,
            tree: TimedMutex::new(IovaTree::new(0, geom.nslabs)),
        }
    }
}

impl SlotAllocator for IovaRbtree {
    fn kind(&self) -> AllocatorKind {
        AllocatorKind::IovaRbtree
    }

    fn alloc(&self, req: &SlotRequest) -> Option<usize> {
        self.alloc_in(&mut self.tree.lock(), req)
    }

    fn free(&self, index: usize, nslots: usize, _worker: usize) {
        Self::free_in(&mut self.tree.lock(), index, nslots);
    }

    fn batch(&self, b: &SlotBatch<'_>, out: &mut [usize]) -> usize {
        let mut tree = self.tree.lock();
        for f in b.frees {
            Self::free_in(&mut tree, f.index, f.nslots);
        }
        serve(b.reqs, out, |req| self.alloc_in(&mut tree, req))
    }

    fn area_used(&self) -> Vec<usize> {
        vec![self.tree.lock().used()]
    }

    fn lock_stats(&self) -> Vec<LockSnapshot> {
        vec![self.tree.snapshot()]
    }

    fn reset_lock_stats(&self) {
        self.tree.reset_stats();
    }
}

impl IovaRbtree {
    /// [`SlotAllocator::alloc`] on the locked `tree`.
    fn alloc_in(&self, tree: &mut IovaTree, req: &SlotRequest) -> Option<usize> {
        let p = Placement::new(&self.geom, req, self.size_aligned)?;
        let size_only = Placement::size_only(&self.geom, req);
        tree.alloc(&self.geom, &p, size_only)
    }

    /// [`SlotAllocator::free`] on the locked `tree`.
    fn free_in(tree: &mut IovaTree, index: usize, nslots: usize) {
        match tree.free(index) {
            Some((lo, size)) if lo == index && size == nslots => {}
            Some((lo, size)) => tracing::warn!(
                index,
                nslots,
                lo,
                size,
                "iova-rbtree: freed range differs from the one allocated"
            ),
            None => tracing::warn!(index, nslots, "iova-rbtree: free of an unallocated pfn"),
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Checks shared by the tests of the four IOVA-family allocators.

    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use rand::{Rng, SeedableRng};

    use crate::alloc::{SlotAllocator, SlotRequest};
    use crate::geometry::{Geometry, PoolConfig};
    use crate::orig::HostMemory;
    use crate::pool::BouncePool;
    use crate::types::{AllocatorKind, PoolMode};
    use crate::types::{Direction, DmaAttrs, MapRequest};

    /// An iova-mode geometry of `slots` granules and `workers` workers.
    pub(crate) fn iova_geom(slots: usize, workers: usize) -> Geometry {
        let mut c = PoolConfig::iova(slots);
        c.workers = workers;
        c.geometry().unwrap()
    }

    /// A swiotlb-mode geometry (2 KiB slots, 128-slot segments).
    pub(crate) fn swiotlb_geom(slots: usize, workers: usize) -> Geometry {
        let mut c = PoolConfig::swiotlb(slots);
        c.workers = workers;
        c.areas = Some(1);
        c.geometry().unwrap()
    }

    /// A request of `nslots` slots with no alignment rules beyond the slot (and the page rule
    /// of swiotlb mode for a page or more). `nslots` is set directly after the rules are
    /// derived from the (saturated) byte size, so absurd counts such as `usize::MAX` reach the
    /// allocator as they are.
    pub(crate) fn plain(geom: &Geometry, nslots: usize, worker: usize) -> SlotRequest {
        let bytes = (nslots as u64).saturating_mul(geom.slot_size());
        let mut r = SlotRequest::new(geom, 0, bytes, 0, 0, u64::MAX, worker);
        r.nslots = nslots;
        r
    }

    /// `g` and the allocator `new` builds over it: how most allocator tests begin.
    pub(crate) fn build<A>(g: Geometry, new: impl FnOnce(&Geometry) -> A) -> (Geometry, A) {
        let a = new(&g);
        (g, a)
    }

    /// As [`build`] for an allocator whose constructor can refuse the geometry (it must not).
    pub(crate) fn build_ok<A>(
        g: Geometry,
        new: impl FnOnce(&Geometry) -> crate::Result<A>,
    ) -> (Geometry, A) {
        let a = new(&g).expect("the test geometry is valid");
        (g, a)
    }

    /// Allocates `req` once per entry of `want`, checking each answer in turn.
    pub(crate) fn expect_each(a: &dyn SlotAllocator, req: &SlotRequest, want: &[Option<usize>]) {
        for (i, &w) in want.iter().enumerate() {
            assert_eq!(a.alloc(req), w, "allocation {i} of {req:?}");
        }
    }

    /// Allocates, by worker 0 and in order, a [`plain`] request of each step's slot count,
    /// checking each answer.
    pub(crate) fn expect_plain(
        a: &dyn SlotAllocator,
        g: &Geometry,
        steps: &[(usize, Option<usize>)],
    ) {
        for (i, &(nslots, want)) in steps.iter().enumerate() {
            assert_eq!(
                a.alloc(&plain(g, nslots, 0)),
                want,
                "step {i}: {nslots} slots"
            );
        }
    }

    /// `n` allocations of `req` in a row, each of which must succeed.
    pub(crate) fn alloc_n(a: &dyn SlotAllocator, req: &SlotRequest, n: usize) -> Vec<usize> {
        (0..n).map(|_| a.alloc(req).unwrap()).collect()
    }

    /// Allocates and checks the answer against `fits` and an occupancy map.
    pub(crate) fn alloc_checked(
        a: &dyn SlotAllocator,
        geom: &Geometry,
        req: &SlotRequest,
        occ: &[AtomicBool],
    ) -> Option<usize> {
        let i = a.alloc(req)?;
        assert!(req.fits(geom, i), "{}: {i} does not fit {req:?}", a.kind());
        for s in &occ[i..i + req.nslots] {
            assert!(
                !s.swap(true, Ordering::SeqCst),
                "{}: slot handed out twice",
                a.kind()
            );
        }
        Some(i)
    }

    /// Marks a run free in the occupancy map and frees it.
    pub(crate) fn free_checked(
        a: &dyn SlotAllocator,
        i: usize,
        n: usize,
        worker: usize,
        occ: &[AtomicBool],
    ) {
        for s in &occ[i..i + n] {
            assert!(s.swap(false, Ordering::SeqCst));
        }
        a.free(i, n, worker);
    }

    /// Alignment and phase: requests with `alloc_align_mask` and `min_align_mask` get runs
    /// that `fits`, with the expected address bits.
    pub(crate) fn check_alignment(a: &dyn SlotAllocator, geom: &Geometry) {
        let occ: Vec<AtomicBool> = (0..geom.nslabs).map(|_| AtomicBool::new(false)).collect();
        let ss = geom.slot_size();
        let mut live = Vec::new();
        for (k, nslots) in [1usize, 2, 3, 5, 8].into_iter().enumerate() {
            // 4-slot alignment of the device address.
            let r = SlotRequest::new(geom, 0, nslots as u64 * ss, 4 * ss - 1, 0, u64::MAX, k);
            let i = alloc_checked(a, geom, &r, &occ).expect("aligned alloc");
            assert_eq!(geom.slot_addr(i) & (4 * ss - 1), 0);
            live.push((i, r.nslots));
            // min_align_mask of 8 slots, original in phase 3: the low bits follow the original.
            let orig = 0x10_0000 + 3 * ss + 0x10;
            let r = SlotRequest::new(geom, orig, nslots as u64 * ss, 0, 8 * ss - 1, u64::MAX, k);
            let i = alloc_checked(a, geom, &r, &occ).expect("phased alloc");
            assert_eq!(
                geom.slot_addr(i) & (8 * ss - 1),
                orig & (8 * ss - 1) & !(ss - 1)
            );
            live.push((i, r.nslots));
        }
        for (i, n) in live {
            free_checked(a, i, n, 0, &occ);
        }
    }

    /// Exhaustion and recovery: fill with single slots until failure, check a bigger request
    /// fails too, free everything (from another worker), and fill again.
    pub(crate) fn check_exhaustion(a: &dyn SlotAllocator, geom: &Geometry, flush: &dyn Fn()) {
        let occ: Vec<AtomicBool> = (0..geom.nslabs).map(|_| AtomicBool::new(false)).collect();
        for round in 0..2 {
            let mut live = Vec::new();
            while let Some(i) = alloc_checked(a, geom, &plain(geom, 1, round), &occ) {
                live.push(i);
            }
            assert_eq!(live.len(), geom.nslabs, "{}: round {round}", a.kind());
            assert!(a.alloc(&plain(geom, 2, 0)).is_none());
            assert!(a.alloc(&plain(geom, geom.nslabs + 1, 0)).is_none());
            assert!(a.alloc(&plain(geom, usize::MAX, 0)).is_none());
            assert!(a.alloc(&plain(geom, 0, 0)).is_none());
            for (k, i) in live.into_iter().enumerate() {
                free_checked(a, i, 1, k + 1, &occ);
            }
            flush();
            assert_eq!(a.area_used().iter().sum::<usize>(), 0);
        }
    }

    /// Eight threads, random sizes, frees of their own and of other threads' runs, checked
    /// against an external occupancy map; everything is free at the end.
    pub(crate) fn stress(
        a: Arc<dyn SlotAllocator>,
        geom: Geometry,
        max_slots: usize,
        flush: &dyn Fn(),
    ) {
        let occ: Arc<Vec<AtomicBool>> =
            Arc::new((0..geom.nslabs).map(|_| AtomicBool::new(false)).collect());
        let shared: Arc<Mutex<Vec<(usize, usize)>>> = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (a, occ, shared) = (a.clone(), occ.clone(), shared.clone());
                std::thread::spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64 * 7919 + 1);
                    let mut mine: Vec<(usize, usize)> = Vec::new();
                    for _ in 0..20_000 {
                        if rng.gen_bool(0.55) {
                            let n = if rng.gen_bool(0.8) {
                                rng.gen_range(1..=4)
                            } else {
                                rng.gen_range(1..=max_slots)
                            };
                            let r = if rng.gen_bool(0.2) {
                                let ss = geom.slot_size();
                                let orig = rng.gen_range(0..1u64 << 30);
                                SlotRequest::new(
                                    &geom,
                                    orig,
                                    n as u64 * ss,
                                    0,
                                    4 * ss - 1,
                                    u64::MAX,
                                    t,
                                )
                            } else {
                                plain(&geom, n, t)
                            };
                            if let Some(i) = alloc_checked(&*a, &geom, &r, &occ) {
                                if rng.gen_bool(0.3) {
                                    shared.lock().unwrap().push((i, r.nslots));
                                } else {
                                    mine.push((i, r.nslots));
                                }
                            }
                        } else {
                            let pick = if rng.gen_bool(0.5) {
                                let mut s = shared.lock().unwrap();
                                if s.is_empty() {
                                    None
                                } else {
                                    let k = rng.gen_range(0..s.len());
                                    Some(s.swap_remove(k))
                                }
                            } else if mine.is_empty() {
                                None
                            } else {
                                let k = rng.gen_range(0..mine.len());
                                Some(mine.swap_remove(k))
                            };
                            if let Some((i, n)) = pick {
                                free_checked(&*a, i, n, t, &occ);
                            }
                        }
                    }
                    for (i, n) in mine {
                        free_checked(&*a, i, n, t, &occ);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for (i, n) in shared.lock().unwrap().drain(..) {
            free_checked(&*a, i, n, 3, &occ);
        }
        flush();
        assert_eq!(a.area_used().iter().sum::<usize>(), 0, "{}", a.kind());
        assert!(occ.iter().all(|s| !s.load(Ordering::SeqCst)));
        // Every slot can be handed out again.
        let mut n = 0;
        let occ2: Vec<AtomicBool> = (0..geom.nslabs).map(|_| AtomicBool::new(false)).collect();
        while alloc_checked(&*a, &geom, &plain(&geom, 1, n % 8), &occ2).is_some() {
            n += 1;
        }
        assert_eq!(n, geom.nslabs, "{}", a.kind());
    }

    /// A `BouncePool` in iova mode with `kind` maps and unmaps with the iova copy rules.
    pub(crate) fn pool_round_trip(kind: AllocatorKind) {
        let mut c = PoolConfig::iova(256);
        c.allocator = kind;
        c.workers = 4;
        let pool = BouncePool::new(&c).unwrap();
        assert_eq!(pool.geometry().mode, PoolMode::Iova);
        let mut buf = vec![0u8; 1 << 20];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let expect = buf.clone();
        let cases = [
            (0usize, 100usize, Direction::ToDevice),
            (0x1234, 5000, Direction::Bidirectional),
            (0x8000, 4096, Direction::FromDevice),
            (0x2_0010, 40_000, Direction::ToDevice),
            (0x3_0000, 3 * 4096 + 7, Direction::FromDevice),
        ];
        {
            let mem = HostMemory::new(0x100_0000, &mut buf);
            let mut maps = Vec::new();
            for (k, &(off, size, dir)) in cases.iter().enumerate() {
                let req = MapRequest {
                    orig: 0x100_0000 + off as u64,
                    size,
                    dir,
                    attrs: DmaAttrs::default(),
                    min_align_mask: 0,
                    alloc_align_mask: 0,
                    seg_boundary_mask: crate::DEFAULT_SEG_BOUNDARY_MASK,
                    worker: k,
                };
                let m = pool.map(&mem, &req).expect("map");
                let dev = pool.device_slice(m.dev_addr, size).unwrap();
                let mut got = vec![0u8; size];
                dev.copy_to(&mut got[..]);
                if dir.device_reads() {
                    assert_eq!(&got[..], &expect[off..off + size]);
                }
                // The device writes every buffer (a to-device write must not reach the original).
                dev.copy_from(&vec![0xa5u8; size][..]);
                maps.push(m);
            }
            for (k, m) in maps.iter().enumerate() {
                pool.unmap(&mem, m, (k + 1) % 4).expect("unmap");
            }
            assert_eq!(pool.used(), 0);
        }
        // Unmap copied back exactly the buffers the device may write, and nothing else.
        for (off, size, dir) in cases {
            let range = &buf[off..off + size];
            if dir.device_writes() {
                assert!(range.iter().all(|&b| b == 0xa5), "{dir:?} at {off:#x}");
            } else {
                assert_eq!(range, &expect[off..off + size], "{dir:?} at {off:#x}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::test_support::*;
    use super::*;

    #[test]
    fn allocates_top_down_size_aligned() {
        // 64 granules, device pfns 1..=64 (base 0x1000).
        let g = iova_geom(64, 1);
        let a = IovaRbtree::new(&g, true);
        // One pfn at the very top: index 63 (pfn 64).
        assert_eq!(a.alloc(&plain(&g, 1, 0)), Some(63));
        // Four pfns aligned to 4 device pfns below it: pfns 60..=63 are indices 59..=62.
        assert_eq!(a.alloc(&plain(&g, 4, 0)), Some(59));
        // Three pfns are aligned to four as well (roundup_pow_of_two): pfns 56..=58.
        assert_eq!(a.alloc(&plain(&g, 3, 0)), Some(55));
        // Two pfns: pfns 54..=55 -> index 53, leaving index 58 (pfn 59) as a hole.
        assert_eq!(a.alloc(&plain(&g, 2, 0)), Some(53));
        // Without size alignment the 3-run goes right below the 4-run.
        let b = IovaRbtree::new(&g, false);
        assert_eq!(b.alloc(&plain(&g, 4, 0)), Some(60));
        assert_eq!(b.alloc(&plain(&g, 3, 0)), Some(57));
    }

    #[test]
    fn cached_node_and_retry_above_it() {
        let g = iova_geom(16, 1);
        let a = IovaRbtree::new(&g, false);
        let runs = alloc_n(&a, &plain(&g, 1, 0), 16);
        assert_eq!(runs, (0..16).rev().collect::<Vec<_>>());
        assert_eq!(a.tree.lock().cached, Some(0));
        // A free at or above the cached node moves the cache to the freed node's successor; a
        // free below it leaves the cache alone.
        a.free(10, 1, 0);
        assert_eq!(a.tree.lock().cached, Some(11));
        a.free(5, 1, 0);
        a.free(4, 1, 0);
        assert_eq!(a.tree.lock().cached, Some(11));
        // Two slots: the walk from 11 skips the 1-slot hole at 10 and takes 4..6.
        assert_eq!(a.alloc(&plain(&g, 2, 0)), Some(4));
        assert_eq!(a.tree.lock().cached, Some(4));
        // One slot: nothing below 4; the retry from the top above the cached node finds 10.
        assert_eq!(a.alloc(&plain(&g, 1, 0)), Some(10));
        assert_eq!(a.tree.lock().cached, Some(10));
        assert!(a.alloc(&plain(&g, 1, 0)).is_none());
    }

    #[test]
    fn failure_cache_until_free() {
        let g = iova_geom(16, 1);
        let a = IovaRbtree::new(&g, false);
        let x = a.alloc(&plain(&g, 8, 0)).unwrap();
        let y = a.alloc(&plain(&g, 7, 0)).unwrap();
        assert!(a.alloc(&plain(&g, 2, 0)).is_none());
        assert_eq!(a.tree.lock().max_alloc_size, 2);
        // Size 1 is below the failure size and still searched.
        let z = a.alloc(&plain(&g, 1, 0)).unwrap();
        assert!(a.alloc(&plain(&g, 3, 0)).is_none());
        a.free(y, 7, 0);
        assert_eq!(a.tree.lock().max_alloc_size, NO_FAILURE);
        assert!(a.alloc(&plain(&g, 7, 0)).is_some());
        let _ = (x, z);
    }

    #[test]
    fn segments_and_boundaries_are_not_crossed() {
        // swiotlb mode: 2 KiB slots, 128-slot segments.
        let g = swiotlb_geom(1024, 1);
        let a = IovaRbtree::new(&g, false);
        let occ: Vec<_> = (0..g.nslabs)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect();
        // Runs of 100 slots: at most one per segment.
        let mut n = 0;
        while alloc_checked(&a, &g, &plain(&g, 100, 0), &occ).is_some() {
            n += 1;
        }
        assert_eq!(n, 8);
        // A 64 KiB device boundary (32 slots) keeps 20-slot runs inside 32-slot blocks.
        let b = IovaRbtree::new(&g, false);
        let r = SlotRequest::new(&g, 0, 20 * 2048, 0, 0, 0xffff, 0);
        let occ: Vec<_> = (0..g.nslabs)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect();
        let mut n = 0;
        while alloc_checked(&b, &g, &r, &occ).is_some() {
            n += 1;
        }
        assert_eq!(n, 1024 / 32);
    }

    #[test]
    fn alignment_and_phase() {
        for g in [iova_geom(512, 2), swiotlb_geom(1024, 2)] {
            check_alignment(&IovaRbtree::new(&g, true), &g);
            check_alignment(&IovaRbtree::new(&g, false), &g);
        }
    }

    #[test]
    fn exhaustion_and_recovery() {
        let g = iova_geom(300, 2);
        check_exhaustion(&IovaRbtree::new(&g, true), &g, &|| {});
        let g = swiotlb_geom(512, 2);
        check_exhaustion(&IovaRbtree::new(&g, true), &g, &|| {});
    }

    #[test]
    fn bogus_frees_are_ignored() {
        let g = iova_geom(16, 1);
        let a = IovaRbtree::new(&g, true);
        a.free(5, 1, 0);
        a.free(usize::MAX, usize::MAX, 0);
        assert_eq!(a.area_used(), vec![0]);
    }

    #[test]
    fn stress_eight_threads() {
        let g = iova_geom(2048, 8);
        let a: Arc<dyn SlotAllocator> = Arc::new(IovaRbtree::new(&g, true));
        stress(a, g, 64, &|| {});
        let g = swiotlb_geom(4096, 8);
        let a: Arc<dyn SlotAllocator> = Arc::new(IovaRbtree::new(&g, true));
        stress(a, g, 128, &|| {});
    }

    #[test]
    fn pool_map_unmap() {
        pool_round_trip(AllocatorKind::IovaRbtree);
    }
}
