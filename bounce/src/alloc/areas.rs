//! `areas`: Linux 6.x swiotlb, exactly: per-area locks, free-run counts, rolling index.
//!
//! The pool is split into `nareas` areas of `area_nslabs` slots (a multiple of the segment size,
//! so no segment spans two areas). Each area has its own [`TimedMutex`] protecting what Linux's
//! `io_tlb_area.lock` protects: the area's `used` count, its rolling search `index`, and the
//! free-run counts (`io_tlb_slot.list`) of its slots. A request starts in the area of the calling
//! worker (`worker & (nareas - 1)`) and walks the others in increasing order, wrapping at the
//! last; it fails only when every area fails.
//!
//! # Free-run counts
//! `list[i]` is the number of free slots from `i` to the first used slot or the end of `i`'s
//! segment, whichever comes first; 0 means slot `i` is in use. So "a run of `n` free slots starts
//! at `i`" is the O(1) test `list[i] >= n`, at the price of fixing counts up on allocation (the
//! free slots before the run, back to the segment start) and on release (the released run, merged
//! with the free run after it if that is in the same segment, and the free slots before it).
//!
//! # The search (`swiotlb_search_pool_area`)
//! 1. Quick reject when the area has fewer free slots than requested (`used` check).
//! 2. From the area's rolling index, visit slots: a slot whose address breaks the alignment rules
//!    costs one step (index + 1); an aligned slot that crosses the segment boundary or has too
//!    short a free run costs `stride` steps (index + stride), where `stride` is the larger of the
//!    two alignments in slots. The index wraps to 0 (not modulo) when it passes the area's end.
//!    The search gives up after `area_nslabs` steps were counted.
//! 3. On success the rolling index moves just past the run (wrapped to 0 the same way).
//!
//! The step accounting is what makes this reproduce Linux's placement decisions exactly
//! (including its blind spots: after a wrap with a stride > 1 some aligned candidates are never
//! visited in that search), which the trace replay test checks against a real kernel.

use crate::alloc::locked::{Locked, SlotRange, Split};
use crate::alloc::SlotRequest;
use crate::error::Result;
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// Free-run counts of a contiguous range of slots that starts on a segment boundary, with a used
/// count and a rolling index: the state one lock protects. Shared by `areas` (one per area),
/// `areas-lifo` (one per area) and `legacy` (one for the whole pool), which differ in `start`.
#[derive(Debug)]
pub(crate) struct FreeRuns {
    /// Absolute index of the first slot of the range.
    pub base: usize,
    /// Free-run count per slot of the range (see the module docs). `u32` because an iova-mode
    /// segment may be longer than `u16::MAX` slots.
    pub list: Box<[u32]>,
    /// Slots in use in the range.
    pub used: usize,
    /// Where the next search starts, relative to `base`; always `< list.len()`.
    pub index: usize,
    /// How a search picks its first slot.
    start: SearchStart,
}

/// How a search picks its first slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SearchStart {
    /// Linux 6.x: start exactly at the rolling index.
    Index,
    /// Linux before areas (5.15): round the rolling index up to the stride first.
    AlignedIndex,
}

impl FreeRuns {
    /// A fully free range of `len` slots starting at absolute slot `base` (a segment start),
    /// searched from `start`.
    pub fn new(base: usize, len: usize, segsize: usize, start: SearchStart) -> Self {
        // Initially every slot sees the rest of its segment free (the range is a whole number of
        // segments; the `min` also covers a last, shorter segment).
        let list = (0..len)
            .map(|i| {
                let to_seg_end = segsize - (base + i) % segsize;
                u32::try_from(to_seg_end.min(len - i)).unwrap_or(u32::MAX)
            })
            .collect();
        Self {
            base,
            list,
            used: 0,
            index: 0,
            start,
        }
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    /// Linux `wrap_area_index`: past the end means back to 0 (not modulo).
    fn wrap(&self, index: usize) -> usize {
        if index >= self.len() {
            0
        } else {
            index
        }
    }

    /// True when the relative slot `i` is the last slot of its segment (Linux
    /// `io_tlb_offset(i) == IO_TLB_SEGSIZE - 1`).
    /// First slot (relative) of the segment that relative slot `i` is in, clamped to this
    /// range. The backward walks of claim and free stop there, as Linux's stop at a slot whose
    /// `io_tlb_offset` is `IO_TLB_SEGSIZE - 1`; computing the bound once keeps a division out
    /// of the per-slot loop.
    fn seg_start(&self, geom: &Geometry, i: usize) -> usize {
        i.saturating_sub((self.base + i) % geom.segsize)
    }

    /// Renumbers the free slots just before relative slot `index`, back to the segment start
    /// or the first slot in use: each gets its distance to the end of the free run, which now
    /// ends at `index` having `count` free slots from there on (0 after a claim, the merged
    /// run's length after a release).
    fn recount_before(&mut self, geom: &Geometry, index: usize, mut count: u32) {
        let seg_start = self.seg_start(geom, index);
        let mut i = index;
        while i > seg_start {
            i -= 1;
            if self.list[i] == 0 {
                break;
            }
            count += 1;
            self.list[i] = count;
        }
    }

    /// Finds and claims a run for `req`, returning its absolute first slot.
    pub fn alloc(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        let nslots = req.nslots;
        let len = self.len();
        if nslots == 0 || nslots > len - self.used {
            return None;
        }
        let stride = req.stride(geom).max(1);
        let mut index = match self.start {
            SearchStart::Index => self.index,
            SearchStart::AlignedIndex => self.wrap(
                self.index
                    .checked_next_multiple_of(stride)
                    .unwrap_or(usize::MAX),
            ),
        };
        let mut checked = 0usize;
        while checked < len {
            let slot = self.base + index;
            if !req.aligned(geom, slot) {
                index = self.wrap(index + 1);
                checked += 1;
                continue;
            }
            if !req.crosses_boundary(geom, slot) && self.list[index] as usize >= nslots {
                self.claim(geom, index, nslots);
                return Some(slot);
            }
            index = self.wrap(index.saturating_add(stride));
            checked = checked.saturating_add(stride);
        }
        None
    }

    /// Claims the run at absolute slot `slot` for `req` when it fits there and is free,
    /// without moving the rolling index (the reuse path of `areas-lifo`).
    pub fn claim_at(&mut self, geom: &Geometry, req: &SlotRequest, slot: usize) -> bool {
        let Some(r) = slot.checked_sub(self.base) else {
            return false;
        };
        if r >= self.len() || (self.list[r] as usize) < req.nslots || !req.fits(geom, slot) {
            return false;
        }
        let index = self.index;
        self.claim(geom, r, req.nslots);
        self.index = index;
        true
    }

    /// True when claiming `slot..slot + nslots` (absolute) splits no free extent more than the
    /// rolling-index search would: the run starts a free extent (a used slot or a segment edge
    /// before it) and either is that whole extent (an exact hole), or the extent holds the
    /// rolling index, so the search would carve this same extent anyway, further in.
    pub fn reuse_keeps_extents(&self, geom: &Geometry, slot: usize, nslots: usize) -> bool {
        let Some(r) = slot.checked_sub(self.base).filter(|&r| r < self.len()) else {
            return false;
        };
        let extent = self.list[r] as usize;
        let starts_extent = self.seg_start(geom, r) == r || self.list[r - 1] == 0;
        starts_extent
            && (extent == nslots || (extent > nslots && (r..r + extent).contains(&self.index)))
    }

    /// True when absolute slot `slot` of this range is free.
    pub fn is_free(&self, slot: usize) -> bool {
        slot.checked_sub(self.base)
            .and_then(|r| self.list.get(r))
            .is_some_and(|&c| c > 0)
    }

    /// Marks `index..index + nslots` (relative) used and fixes the counts before it.
    fn claim(&mut self, geom: &Geometry, index: usize, nslots: usize) {
        self.list[index..index + nslots].fill(0);
        // The free slots before the run now end at the run: recount them, back to the
        // segment start.
        self.recount_before(geom, index, 0);
        self.index = self.wrap(index + nslots);
        self.used += nslots;
    }

    /// Releases `index..index + nslots` (absolute). Returns false, changing nothing, when the
    /// run is not inside this range or not entirely in use.
    pub fn free(&mut self, geom: &Geometry, index: usize, nslots: usize) -> bool {
        let Some(r) = index.checked_sub(self.base) else {
            return false;
        };
        let len = self.len();
        if nslots == 0 || r >= len || nslots > len - r {
            return false;
        }
        if self.list[r..r + nslots].iter().any(|&c| c != 0) {
            return false;
        }
        let end = r + nslots;
        // Merge with the free run that follows, if it is in the same segment.
        let seg_end = (self.base + r) / geom.segsize * geom.segsize + geom.segsize - self.base;
        let mut count = if end < seg_end && end < len {
            self.list[end]
        } else {
            0
        };
        for i in (r..end).rev() {
            count += 1;
            self.list[i] = count;
        }
        // And with the free slots before it, back to the segment start.
        self.recount_before(geom, r, count);
        self.used -= nslots;
        true
    }
}

// Same forwarding as FreeBitmap's SlotRange (bitmap.rs); each forwards to its own search.
impl SlotRange for FreeRuns {
    fn alloc(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        FreeRuns::alloc(self, geom, req)
    }

    fn used(&self) -> usize {
        self.used
    }

    fn index(&self) -> usize {
        self.index
    }

    fn release(&mut self, geom: &Geometry, index: usize, nslots: usize) -> bool {
        self.free(geom, index, nslots)
    }
}

/// Builds `areas`, Linux 6.x swiotlb: per-area locks with free-run counts, all slots free,
/// every area's index at 0.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) when areas are not whole segments.
pub(crate) fn new(geom: &Geometry) -> Result<Locked<FreeRuns>> {
    Locked::new(
        AllocatorKind::Areas,
        geom,
        Split::PerArea,
        true,
        |base, len| FreeRuns::new(base, len, geom.segsize, SearchStart::Index),
    )
}

/// Builds `areas` for a geometry whose areas need not be whole segments (a transient pool's
/// one area, shorter than a segment: its free-run counts end at the pool's end).
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) when the areas do not split the pool evenly.
pub(crate) fn partial(geom: &Geometry) -> Result<Locked<FreeRuns>> {
    Locked::new(
        AllocatorKind::Areas,
        geom,
        Split::PerArea,
        false,
        |base, len| FreeRuns::new(base, len, geom.segsize, SearchStart::Index),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::iova_rbtree::test_support::{build_ok, expect_each};
    use crate::alloc::test_request as req;
    use crate::alloc::SlotAllocator;

    fn geom(slots: usize, areas: usize, base: u64) -> Geometry {
        crate::alloc::test_geometry(slots, areas, areas, base)
    }

    fn list(a: &Locked<FreeRuns>, area: usize) -> Vec<u32> {
        a.ranges[area].lock().list.to_vec()
    }

    #[test]
    fn first_maps_follow_the_kernel_trace() {
        // The first maps of the Linux 6.12 trace: 16 bytes, then a page (page aligned).
        let (g, a) = build_ok(geom(4096, 1, 0x38f0_0000), new);
        assert_eq!(a.alloc(&req(&g, 0x3e88_d7f8, 16, 0, 1)), Some(0));
        assert_eq!((a.area_used(), a.area_index()), (vec![1], vec![1]));
        assert_eq!(a.alloc(&req(&g, 0x1c98_e000, 4096, 0, 1)), Some(2));
        assert_eq!((a.area_used(), a.area_index()), (vec![3], vec![4]));
        // Slot 1 stays free and knows it is a run of one.
        assert_eq!(list(&a, 0)[1], 1);
        assert_eq!(a.alloc(&req(&g, 0x3e88_d808, 1, 0, 1)), Some(4));
    }

    #[test]
    fn min_align_mask_keeps_the_original_bits() {
        let (g, a) = build_ok(geom(128, 1, 0x4000_0000), new);
        // Bit 11 of the original is set: with a 4 KiB mask the slot must be odd.
        let r = req(&g, 0x1000_0800, 512, 0xfff, 0);
        let i = a.alloc(&r).unwrap();
        assert_eq!(i, 1);
        assert!(r.fits(&g, i));
        // orig 0 disables the rule.
        assert_eq!(a.alloc(&req(&g, 0, 512, 0xfff, 0)), Some(2));
    }

    #[test]
    fn runs_never_cross_a_segment() {
        let (g, a) = build_ok(geom(256, 1, 0x4000_0000), new);
        // 100 slots at 0; 64 more do not fit in the 28 left in segment 0.
        assert_eq!(a.alloc(&req(&g, 0, 100 * 2048, 0, 0)), Some(0));
        assert_eq!(a.alloc(&req(&g, 0, 64 * 2048, 0, 0)), Some(128));
        // A whole segment no longer fits anywhere.
        assert_eq!(a.alloc(&req(&g, 0, 128 * 2048, 0, 0)), None);
        assert_eq!(a.alloc(&req(&g, 0, 28 * 2048, 0, 0)), Some(192));
        assert_eq!(a.alloc(&req(&g, 0, 36 * 2048, 0, 0)), Some(220));
        // The index wrapped to 0: the tail of segment 0 is found.
        assert_eq!(a.area_index(), vec![0]);
        assert_eq!(a.alloc(&req(&g, 0, 28 * 2048, 0, 0)), Some(100));
    }

    #[test]
    fn boundary_mask_is_honoured() {
        let (g, a) = build_ok(geom(128, 1, 0x4000_0000), new);
        let small = |n: u64| {
            // Under a page: no page alignment, stride 1. 64 KiB boundary = 32 slots.
            SlotRequest::new(&g, 0, n * 2048 - 1, 0, 0, 0xffff, 0)
        };
        for i in 0..31 {
            assert_eq!(a.alloc(&small(1)), Some(i));
        }
        // Slot 31 is free but a 2-slot run there would cross the 64 KiB boundary.
        assert_eq!(a.alloc(&small(2)), Some(32));
        assert_eq!(a.alloc(&small(1)), Some(34));
    }

    #[test]
    fn index_wraps_to_zero_and_search_continues_from_the_start() {
        let (g, a) = build_ok(geom(128, 1, 0x4000_0000), new);
        let one = req(&g, 0, 1, 0, 0);
        for i in 0..128 {
            assert_eq!(a.alloc(&one), Some(i));
        }
        assert_eq!(a.area_index(), vec![0]);
        assert_eq!(a.alloc(&one), None);
        a.free(5, 1, 0);
        a.free(6, 1, 0);
        assert_eq!(list(&a, 0)[5..7], [2, 1]);
        // Index 0: walks to slot 5.
        assert_eq!(a.alloc(&req(&g, 0, 4000, 0, 0)), Some(5));
        assert_eq!(a.area_index(), vec![7]);
        // A run that ends the area sends the index back to 0.
        a.free(126, 2, 0);
        a.free(127, 1, 0); // already free: refused, nothing changes
        assert_eq!(a.alloc(&req(&g, 0, 4000, 0, 0)), Some(126));
        assert_eq!(a.area_index(), vec![0]);
        assert_eq!(a.area_used(), vec![128]);
    }

    #[test]
    fn misaligned_base_page_alignment_across_the_wrap() {
        // A pool that starts half a page in: page-aligned slots are the odd ones.
        let (g, a) = build_ok(geom(128, 1, 0x4000_0800), new);
        let page = req(&g, 0, 4096, 0, 0);
        expect_each(&a, &page, &[Some(1), Some(3)]);
        let i = a.alloc(&req(&g, 0, 2048, 0, 0)).unwrap();
        assert_eq!(i, 5);
        assert!(page.fits(&g, 7));
    }

    #[test]
    fn release_merges_with_following_and_preceding_runs() {
        let (g, a) = build_ok(geom(128, 1, 0x4000_0000), new);
        let two = req(&g, 0, 4000, 0, 0);
        expect_each(&a, &two, &[Some(0), Some(2), Some(4)]);
        assert_eq!(list(&a, 0)[..7], [0, 0, 0, 0, 0, 0, 122]);
        a.free(2, 2, 0);
        assert_eq!(list(&a, 0)[..6], [0, 0, 2, 1, 0, 0]);
        a.free(0, 2, 0);
        assert_eq!(list(&a, 0)[..6], [4, 3, 2, 1, 0, 0]);
        a.free(4, 2, 0);
        let fresh: Vec<u32> = (0..128).map(|i| 128 - i).collect();
        assert_eq!(list(&a, 0), fresh);
        assert_eq!(a.area_used(), vec![0]);
    }

    #[test]
    fn fixups_stop_at_segment_start() {
        let (g, a) = build_ok(geom(256, 1, 0x4000_0000), new);
        // Fill segment 0 except its last slot, then take slot 128..130.
        assert_eq!(a.alloc(&req(&g, 0, 127 * 2048, 0, 0)), Some(0));
        assert_eq!(a.alloc(&req(&g, 0, 4000, 0, 0)), Some(128));
        // Slot 127 ends segment 0: its count is its own, untouched by segment 1.
        assert_eq!(list(&a, 0)[127], 1);
        a.free(0, 127, 0);
        assert_eq!(list(&a, 0)[0], 128);
        a.free(128, 2, 0);
        assert_eq!(list(&a, 0)[128], 128);
    }

    #[test]
    fn requests_walk_the_areas_from_the_workers_own() {
        let g = geom(512, 4, 0x4000_0000);
        assert_eq!((g.nareas, g.area_nslabs), (4, 128));
        let a = new(&g).unwrap();
        let seg = |w| req(&g, 0, 128 * 2048, 0, w);
        assert_eq!(a.alloc(&seg(2)), Some(256));
        assert_eq!(a.alloc(&seg(2)), Some(384));
        assert_eq!(a.alloc(&seg(2)), Some(0));
        // Worker 5 starts in area 1.
        assert_eq!(a.alloc(&req(&g, 0, 1, 0, 5)), Some(128));
        assert_eq!(a.alloc(&seg(5)), None);
        assert_eq!(a.area_used(), vec![128, 1, 128, 128]);
        a.free(384, 128, 0);
        assert_eq!(a.area_used(), vec![128, 1, 128, 0]);
        assert_eq!(a.alloc(&seg(0)), Some(384));
    }

    #[test]
    fn impossible_requests_fail_without_panicking() {
        let (g, a) = build_ok(geom(256, 2, 0x4000_0000), new);
        let mut r = req(&g, 0, 1, 0, 0);
        for n in [0, 129, 200, 256, 257, usize::MAX] {
            r.nslots = n;
            assert_eq!(a.alloc(&r), None, "nslots {n}");
        }
        r.nslots = 1;
        r.alloc_align_mask = u64::MAX;
        assert_eq!(a.alloc(&r), None);
        r.alloc_align_mask = 0x7ff;
        r.worker = usize::MAX;
        assert_eq!(a.alloc(&r), Some(128));
        for (i, n) in [(0, 0), (0, 1), (255, 2), (usize::MAX, 1), (128, usize::MAX)] {
            a.free(i, n, 0);
        }
        assert_eq!(a.area_used(), vec![0, 1]);
    }
}
