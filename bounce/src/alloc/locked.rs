//! Ranges of slots behind their own locks: what every lock-based swiotlb allocator is made of.
//!
//! `areas`, `areas-bitmap`, `areas-lifo` and `magazine`'s depot keep one range per area; `legacy`
//! and `bitmap` keep one range over the whole pool. [`Locked`] holds the ranges, walks them the
//! way Linux walks areas (from the calling worker's, wrapping), routes a release to the range of
//! its first slot, and reports per-range used counts, rolling indexes and lock counters.

use std::fmt;

use crate::alloc::{LockSnapshot, TimedMutex};
use crate::error::{Error, Result};
use crate::geometry::Geometry;

/// The state one lock protects: a range of slots with a used count and a rolling index.
pub(crate) trait SlotRange: Send + fmt::Debug {
    /// Slots in use in the range.
    fn used(&self) -> usize;
    /// Where the next search starts, relative to the range.
    fn index(&self) -> usize;
    /// Releases the absolute run `index..index + nslots`; false, changing nothing, when it is
    /// not inside the range or not entirely in use.
    fn release(&mut self, geom: &Geometry, index: usize, nslots: usize) -> bool;
}

/// Slot ranges of `span` slots each, each behind its own [`TimedMutex`].
#[derive(Debug)]
pub(crate) struct Locked<T> {
    pub geom: Geometry,
    /// Slots per range.
    span: usize,
    pub ranges: Box<[TimedMutex<T>]>,
    /// The allocator's name, for logs.
    name: &'static str,
}

/// What a geometry must satisfy for ranges of whole areas.
///
/// `whole_segments`: areas must also be whole segments (the free-run counts need it; a bitmap
/// does not).
pub(crate) fn check_geometry(geom: &Geometry, whole_segments: bool) -> Result<()> {
    if geom.nareas == 0
        || !geom.nareas.is_power_of_two()
        || geom.segsize == 0
        || geom.area_nslabs == 0
        || (whole_segments && geom.area_nslabs % geom.segsize != 0)
        || geom.area_nslabs.checked_mul(geom.nareas) != Some(geom.nslabs)
    {
        return Err(Error::Config(format!(
            "geometry {} slots / {} areas / segments of {} cannot be served by areas{}",
            geom.nslabs,
            geom.nareas,
            geom.segsize,
            if whole_segments {
                " of whole segments"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

impl<T: SlotRange> Locked<T> {
    /// One range per area of `geom`, built by `make(first slot, slots)`.
    pub fn per_area(geom: &Geometry, name: &'static str, make: impl Fn(usize, usize) -> T) -> Self {
        let span = geom.area_nslabs;
        Self {
            geom: *geom,
            span,
            ranges: (0..geom.nareas)
                .map(|a| TimedMutex::new(make(a * span, span)))
                .collect(),
            name,
        }
    }

    /// One range over the whole pool (the areas of `geom` are ignored).
    pub fn whole(geom: &Geometry, name: &'static str, make: impl Fn(usize, usize) -> T) -> Self {
        Self {
            geom: *geom,
            span: geom.nslabs.max(1),
            ranges: Box::new([TimedMutex::new(make(0, geom.nslabs))]),
            name,
        }
    }

    /// Tries `f` on each range under its lock, from the calling worker's area and wrapping
    /// (Linux's walk over areas), and returns the first answer.
    pub fn find_map(
        &self,
        worker: usize,
        mut f: impl FnMut(&mut T) -> Option<usize>,
    ) -> Option<usize> {
        let n = self.ranges.len();
        let start = self.geom.start_area(worker);
        (0..n).find_map(|k| f(&mut self.ranges[(start + k) % n].lock()))
    }

    /// The range slot `index` is in.
    pub fn range_of(&self, index: usize) -> usize {
        index / self.span
    }

    /// Releases a run into its range; a run outside the pool or not in use is logged and
    /// ignored (false).
    pub fn free(&self, index: usize, nslots: usize) -> bool {
        let Some(range) = self.ranges.get(self.range_of(index)) else {
            tracing::error!(
                allocator = self.name,
                index,
                nslots,
                "free of a slot outside the pool ignored"
            );
            return false;
        };
        let ok = range.lock().release(&self.geom, index, nslots);
        if !ok {
            tracing::error!(
                allocator = self.name,
                index,
                nslots,
                "free of a run not in use ignored"
            );
        }
        ok
    }

    /// Slots in use per range.
    pub fn used(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.lock().used()).collect()
    }

    /// Rolling index per range.
    pub fn index(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.lock().index()).collect()
    }

    /// Lock counters per range.
    pub fn lock_stats(&self) -> Vec<LockSnapshot> {
        self.ranges.iter().map(TimedMutex::snapshot).collect()
    }

    /// Zeroes the lock counters.
    pub fn reset_lock_stats(&self) {
        self.ranges.iter().for_each(TimedMutex::reset_stats);
    }
}

/// The [`SlotAllocator`](crate::alloc::SlotAllocator) methods that report a [`Locked`]'s ranges:
/// `area_used`, `area_index`, `lock_stats`, `reset_lock_stats`, from the field `$f`.
macro_rules! report_ranges {
    ($f:ident) => {
        fn area_used(&self) -> Vec<usize> {
            self.$f.used()
        }

        fn area_index(&self) -> Vec<usize> {
            self.$f.index()
        }

        fn lock_stats(&self) -> Vec<crate::alloc::LockSnapshot> {
            self.$f.lock_stats()
        }

        fn reset_lock_stats(&self) {
            self.$f.reset_lock_stats();
        }
    };
}
pub(crate) use report_ranges;
