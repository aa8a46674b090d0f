//! `legacy`: swiotlb before areas (Linux 5.15-era): one global lock, free-run counts over the
//! whole pool, one rolling index.
//!
//! This is the "vanilla" of the 2022 bitmap and lock-splitting series: every map and unmap of
//! every worker takes the same lock, which is what those series measured. The free-run counts and
//! their fix-ups on allocation and release are the same as in `areas` (see
//! [`areas`](super::areas)); the search differs in two ways that follow the old code:
//! - the rolling index is first rounded up to the stride (the old code relied on that to find
//!   page-aligned slots in a page-aligned pool);
//! - there is one index for the whole pool, wrapped to 0 past the last slot.
//!
//! Two later upstream fixes are included because without them the old search is not safe to
//! run: every candidate's address is checked against the alignment masks (the old loop could
//! return a slot that was not page aligned once a `min_align_mask` step had shifted the phase),
//! and the search stops after it has accounted for every slot once (the old `index != wrap` test
//! could spin forever under the lock when the phase never came back to the start).

use crate::alloc::areas::{FreeRuns, SearchStart};
use crate::alloc::locked::{Locked, Split};
use crate::error::Result;
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// Builds `legacy`: one lock, one free-run list over the whole pool, one rolling index, every
/// slot free and the index at 0. Areas of the geometry are ignored (the old kernel had none).
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for a geometry that is not whole segments.
pub(crate) fn new(geom: &Geometry) -> Result<Locked<FreeRuns>> {
    Locked::new(
        AllocatorKind::Legacy,
        geom,
        Split::Whole,
        true,
        |base, len| FreeRuns::new(base, len, geom.segsize, SearchStart::AlignedIndex),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::test_request as req;
    use crate::alloc::SlotAllocator;
    use crate::geometry::PoolConfig;

    fn geom(slots: usize, areas: usize) -> Geometry {
        crate::alloc::test_geometry(slots, areas, areas, PoolConfig::DEFAULT_SWIOTLB_BASE)
    }

    #[test]
    fn one_index_for_all_workers_and_areas() {
        let g = geom(512, 4);
        let a = new(&g).unwrap();
        assert_eq!(a.alloc(&req(&g, 0, 1, 0, 3)), Some(0));
        assert_eq!(a.alloc(&req(&g, 0, 1, 0, 1)), Some(1));
        assert_eq!(a.area_used(), vec![2]);
        assert_eq!(a.lock_stats().len(), 1);
    }

    #[test]
    fn rolling_index_is_rounded_up_to_the_stride() {
        let g = geom(256, 1);
        let a = new(&g).unwrap();
        assert_eq!(a.alloc(&req(&g, 0, 1, 0, 0)), Some(0));
        a.free(0, 1, 0);
        // Index 1, a page-aligned request: starts at 2, not at 0 (which is free).
        assert_eq!(a.alloc(&req(&g, 0, 4096, 0, 0)), Some(2));
        // min_align_mask with bit 11 set: odd slots, found by single steps.
        let r = req(&g, 0x800, 10, 0xfff, 0);
        assert_eq!(a.alloc(&r), Some(5));
        assert!(r.fits(&g, 5));
    }

    #[test]
    fn segment_crossing_wrap_and_merging() {
        let g = geom(256, 1);
        let a = new(&g).unwrap();
        assert_eq!(a.alloc(&req(&g, 0, 100 * 2048, 0, 0)), Some(0));
        assert_eq!(a.alloc(&req(&g, 0, 128 * 2048, 0, 0)), Some(128));
        assert_eq!(a.area_index(), vec![0]);
        assert_eq!(a.alloc(&req(&g, 0, 30 * 2048, 0, 0)), None);
        assert_eq!(a.alloc(&req(&g, 0, 28 * 2048, 0, 0)), Some(100));
        a.free(100, 28, 0);
        a.free(0, 100, 0);
        a.free(128, 128, 0);
        assert_eq!(a.area_used(), vec![0]);
        // The index is still past the last run.
        assert_eq!(a.alloc(&req(&g, 0, 128 * 2048, 0, 0)), Some(128));
    }

    #[test]
    fn impossible_requests_fail_without_panicking() {
        let g = geom(128, 1);
        let a = new(&g).unwrap();
        let mut r = req(&g, 0, 1, 0, 0);
        for n in [0, 129, usize::MAX] {
            r.nslots = n;
            assert_eq!(a.alloc(&r), None);
        }
        r.nslots = 1;
        r.alloc_align_mask = u64::MAX;
        assert_eq!(a.alloc(&r), None);
        a.free(3, 1, 0);
        a.free(usize::MAX, 2, 0);
        assert_eq!(a.area_used(), vec![0]);
    }
}
