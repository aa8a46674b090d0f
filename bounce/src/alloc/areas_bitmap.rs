//! `areas-bitmap`: per-area locks, each area tracked by its own bitmap (the whole 2022 swiotlb
//! series: bitmaps for free slots, and the global lock split into areas).
//!
//! Areas and the walk over them are those of [`areas`](super::areas): a request starts in the
//! calling worker's area (`worker & (nareas - 1)`), tries the others in increasing order and
//! fails only when all fail. Inside an area the search is the bitmap search of
//! [`bitmap`](super::bitmap), restricted to the area and starting at the area's rolling index.

use crate::alloc::bitmap::FreeBitmap;
use crate::alloc::locked::{Locked, Split};
use crate::error::Result;
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// Builds `areas-bitmap`: per-area locks, each protecting the area's bitmap, used count and
/// rolling index; every slot free and every area's index at 0.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for an inconsistent geometry.
pub(crate) fn new(geom: &Geometry) -> Result<Locked<FreeBitmap>> {
    Locked::new(
        AllocatorKind::AreasBitmap,
        geom,
        Split::PerArea,
        false,
        FreeBitmap::new,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{SlotAllocator, SlotRequest};
    use crate::geometry::PoolConfig;
    use crate::DEFAULT_SEG_BOUNDARY_MASK;

    #[test]
    fn areas_are_walked_from_the_workers_own() {
        let mut c = PoolConfig::swiotlb(512);
        c.areas = Some(4);
        c.workers = 4;
        let g = c.geometry().unwrap();
        let a = new(&g).unwrap();
        let seg = |w| SlotRequest::new(&g, 0, 128 * 2048, 0, 0, DEFAULT_SEG_BOUNDARY_MASK, w);
        let one = |w| SlotRequest::new(&g, 0, 1, 0, 0, DEFAULT_SEG_BOUNDARY_MASK, w);
        assert_eq!(a.alloc(&seg(3)), Some(384));
        assert_eq!(a.alloc(&seg(3)), Some(0));
        assert_eq!(a.alloc(&one(1)), Some(128));
        assert_eq!(a.alloc(&one(6)), Some(256));
        assert_eq!(a.area_used(), vec![128, 1, 1, 128]);
        assert_eq!(a.area_index(), vec![0, 1, 1, 0]);
        assert_eq!(a.alloc(&seg(0)), None);
        a.free(0, 128, 2);
        assert_eq!(a.alloc(&seg(2)), Some(0));
        assert_eq!(a.lock_stats().len(), 4);
        a.free(1000, 1, 0);
        a.free(129, 1, 0);
        assert_eq!(a.area_used(), vec![128, 1, 1, 128]);
    }
}
