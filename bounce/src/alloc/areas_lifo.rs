//! `areas-lifo`: Linux 6.x areas, with freed runs reused first (cache-hot).
//!
//! The areas, their locks, the free-run counts and the rolling-index search are those of
//! [`areas`](super::areas). What changes is the order in which free slots are handed out, as the
//! third patch of the 2022 swiotlb series ("swiotlb: Allocate memory in a cache-friendly way")
//! intended: the rolling index walks the whole pool before it comes back to a slot, so with the
//! default 64 MiB pool every map touches memory that left the CPU caches long ago, while the run
//! an unmap just released is still hot.
//!
//! Each area keeps, under its lock, a short list of the runs most recently released into it
//! (at most [`RECENT_RUNS`], the oldest dropped first). A request first probes the newest
//! [`RECENT_PROBE`] of them, newest first, and takes a run of exactly its slot count whose first
//! slot satisfies [`SlotRequest::fits`], is still free, and whose reuse splits no free extent
//! (`FreeRuns::reuse_keeps_extents`): the run is a whole free extent (an exact hole between used
//! slots or segment edges), or it starts the extent the rolling index is in, which the search
//! would carve anyway. When none does, the area's Linux search from the rolling index runs
//! unchanged; the reuse path never moves the rolling index.
//!
//! Reuse is exact-size, non-splitting, and the list is short on purpose. Replaying the Linux
//! 6.12 trace (4096 slots, whole-segment maps at ~80 % occupancy) gives 20 "buffer full" against
//! the kernel's (and `areas`') 67; reusing any fitting exact-size run gave 71, splitting larger
//! runs 172. A queue of in-flight requests, the case this serves, frees its oldest run between
//! two used ones (a hole) and a depth-1 loop frees the run just behind the rolling index: both
//! are reused.
//!
//! # Invariants
//! - Every run handed out satisfies [`SlotRequest::fits`] (the reuse path checks it explicitly,
//!   the fallback is the `areas` search) and consists of free slots (the free-run count).
//! - The recent list is a hint, never the truth: an entry may describe slots that were taken
//!   since by the fallback search; it is dropped when its first slot is found in use.
//! - A request fails only when the `areas` search fails in every area, so it fails no more
//!   often than `areas` would on the same occupancy.

use std::collections::VecDeque;

use crate::alloc::areas::{FreeRuns, SearchStart};
use crate::alloc::locked::{Locked, SlotRange, Split};
use crate::alloc::SlotRequest;
use crate::error::Result;
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// Released runs remembered per area.
pub const RECENT_RUNS: usize = 8;
/// Recent runs a request probes before it falls back to the rolling-index search.
pub const RECENT_PROBE: usize = 8;

/// One area: the `areas` state and the runs most recently released into it.
#[derive(Debug)]
pub(crate) struct LifoArea {
    runs: FreeRuns,
    /// `(first slot, slots)` of released runs, newest at the back.
    recent: VecDeque<(usize, usize)>,
}

impl LifoArea {
    /// Takes a run for `req` from the recent list, newest first: a released run of exactly
    /// `req.nslots` slots whose first slot fits.
    fn reuse(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        let mut k = self.recent.len();
        let stop = k.saturating_sub(RECENT_PROBE);
        while k > stop {
            k -= 1;
            let (start, len) = self.recent[k];
            if !self.runs.is_free(start) {
                // Taken since by the rolling-index search: forget it.
                self.recent.remove(k);
                continue;
            }
            if len == req.nslots
                && self.runs.reuse_keeps_extents(geom, start, len)
                && self.runs.claim_at(geom, req, start)
            {
                self.recent.remove(k);
                return Some(start);
            }
        }
        None
    }

    /// Puts a released run on the recent list, dropping the oldest when it is full.
    fn remember(&mut self, start: usize, len: usize) {
        if self.recent.len() == RECENT_RUNS {
            self.recent.pop_front();
        }
        self.recent.push_back((start, len));
    }
}

impl SlotRange for LifoArea {
    /// A recent run first, else the `areas` search from the rolling index.
    fn alloc(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        if req.nslots == 0 || req.nslots > self.runs.list.len() - self.runs.used {
            return None;
        }
        self.reuse(geom, req).or_else(|| self.runs.alloc(geom, req))
    }

    fn used(&self) -> usize {
        self.runs.used
    }

    fn index(&self) -> usize {
        self.runs.index
    }

    fn release(&mut self, geom: &Geometry, index: usize, nslots: usize) -> bool {
        let ok = self.runs.free(geom, index, nslots);
        if ok {
            self.remember(index, nslots);
        }
        ok
    }
}

/// Builds `areas-lifo`: per-area locks, free-run counts, freed runs reused first; all slots
/// free, every area's index at 0, no recent runs.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) when areas are not whole segments.
pub(crate) fn new(geom: &Geometry) -> Result<Locked<LifoArea>> {
    Locked::new(
        AllocatorKind::AreasLifo,
        geom,
        Split::PerArea,
        true,
        |base, len| LifoArea {
            runs: FreeRuns::new(base, len, geom.segsize, SearchStart::Index),
            recent: VecDeque::with_capacity(RECENT_RUNS),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::iova_rbtree::test_support::{alloc_n, build_ok};
    use crate::alloc::SlotAllocator;
    use crate::DEFAULT_SEG_BOUNDARY_MASK;

    fn geom(slots: usize, areas: usize, base: u64) -> Geometry {
        crate::alloc::test_geometry(slots, areas, areas, base)
    }

    fn req(g: &Geometry, orig: u64, size: u64, min_align: u64) -> SlotRequest {
        SlotRequest::new(g, orig, size, 0, min_align, DEFAULT_SEG_BOUNDARY_MASK, 0)
    }

    #[test]
    fn a_freed_run_is_reused_first() {
        let (g, a) = build_ok(geom(1024, 1, 0x4000_0000), new);
        let page = req(&g, 0, 4096, 0);
        let runs = alloc_n(&a, &page, 9);
        assert_eq!(runs, (0..18).step_by(2).collect::<Vec<_>>());
        // Free the oldest, map again: the same two slots come back, not slot 18.
        for round in 0..100 {
            let victim = runs[round % 9];
            a.free(victim, 2, 0);
            assert_eq!(a.alloc(&page), Some(victim), "round {round}");
        }
        // The rolling index never moved past the first nine maps.
        assert_eq!(a.area_index(), vec![18]);
        assert_eq!(a.area_used(), vec![18]);
    }

    #[test]
    fn reuse_keeps_every_placement_rule() {
        let (g, a) = build_ok(geom(256, 1, 0x4000_0000), new);
        let one = |orig, min_align| req(&g, orig, 512, min_align);
        for i in 0..16 {
            assert_eq!(a.alloc(&one(0, 0)), Some(i));
        }
        a.free(5, 1, 0);
        a.free(3, 1, 0);
        // Original bit 11 set with a 4 KiB min_align_mask: the slot must be odd. The newest
        // run (3) fits.
        assert_eq!(a.alloc(&one(0x1000_0800, 0xfff)), Some(3));
        // An even one: the recent run 5 does not fit, the rolling index gives 16.
        assert_eq!(a.alloc(&one(0x1000_1000, 0xfff)), Some(16));
        // 5 and 6 free make a 2-slot extent: neither 1-slot run is reused (that would split
        // it), the rolling index serves the request.
        a.free(6, 1, 0);
        assert_eq!(a.alloc(&one(0, 0)), Some(17));
        // A page-aligned page does not take a 1-slot run.
        assert_eq!(a.alloc(&req(&g, 0, 4096, 0)), Some(18));
        assert_eq!(a.area_used(), vec![18]);

        // A 64 KiB boundary (32 slots): a released 2-slot run at 31..33 crosses it.
        let a = new(&g).unwrap();
        let two = req(&g, 0, 3000, 0);
        for i in 0..31 {
            assert_eq!(a.alloc(&one(0, 0)), Some(i));
        }
        assert_eq!(a.alloc(&two), Some(31));
        assert_eq!(a.alloc(&one(0, 0)), Some(33));
        a.free(31, 2, 0);
        let b = SlotRequest::new(&g, 0, 3000, 0, 0, 0xffff, 0);
        assert_eq!(a.alloc(&b), Some(34));
        // Without the boundary the hole is reused.
        assert_eq!(a.alloc(&two), Some(31));
        assert_eq!(a.area_used(), vec![36]);
    }

    #[test]
    fn reuse_never_splits_a_free_extent() {
        let (g, a) = build_ok(geom(256, 1, 0x4000_0000), new);
        let page = req(&g, 0, 4096, 0);
        let runs = alloc_n(&a, &page, 8);
        // 4..6 and 6..8 freed: one 4-slot extent. A page must not take either half, as a
        // rolling index far from it would not.
        a.free(runs[2], 2, 0);
        a.free(runs[3], 2, 0);
        assert_eq!(a.alloc(&page), Some(16));
        // A run freed at the frontier (its extent holds the rolling index) is reused.
        let four = req(&g, 0, 8192, 0);
        assert_eq!(a.alloc(&four), Some(18));
        a.free(18, 4, 0);
        assert_eq!(a.alloc(&four), Some(18));
    }

    #[test]
    fn stale_recent_runs_are_skipped() {
        let (g, a) = build_ok(geom(128, 1, 0x4000_0000), new);
        let one = req(&g, 0, 1, 0);
        let two = req(&g, 0, 4095, 0);
        for i in 0..128 {
            assert_eq!(a.alloc(&one), Some(i));
        }
        a.free(8, 1, 0);
        a.free(7, 1, 0);
        // No recent run has two slots: the rolling index finds 7..9 (7 merged with 8), and
        // both recent runs are stale.
        assert_eq!(a.alloc(&two), Some(7));
        a.free(30, 1, 0);
        a.free(30, 1, 0); // refused: already free, not remembered twice
        a.free(40, 1, 0);
        let recent = || {
            a.ranges[0]
                .lock()
                .recent
                .iter()
                .copied()
                .collect::<Vec<_>>()
        };
        assert_eq!(recent(), vec![(8, 1), (7, 1), (30, 1), (40, 1)]);
        // Two slots fit nowhere: 40 and 30 are too short, 7 and 8 are in use and forgotten.
        assert_eq!(a.alloc(&two), None);
        assert_eq!(recent(), vec![(30, 1), (40, 1)]);
        assert_eq!(a.alloc(&one), Some(40));
        assert_eq!(a.alloc(&one), Some(30));
        assert_eq!(a.area_used(), vec![128]);
    }
}
