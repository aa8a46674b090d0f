//! The lock-based allocators' one shell: ranges of slots, each behind its own lock.
//!
//! `areas`, `areas-bitmap` and `areas-lifo` keep one range per area; `legacy` and `bitmap` keep
//! one range over the whole pool; `magazine` keeps its depot as one range per area. [`Locked`]
//! holds the ranges, walks them the way Linux walks areas (from the calling worker's, wrapping),
//! routes a release to the range of its first slot, and reports per-range used counts, rolling
//! indexes and lock counters. With the range's own search ([`SlotRange::alloc`]) that is a whole
//! [`SlotAllocator`]: each of those five allocators is a `Locked` of its range type, and what
//! tells them apart is the range type and whether there is one range or one per area.

use std::fmt;
use std::sync::MutexGuard;

use crate::alloc::{serve, LockSnapshot, SlotAllocator, SlotBatch, SlotRequest, TimedMutex};
use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// The state one lock protects: a range of slots with its search, a used count and a rolling
/// index.
pub(crate) trait SlotRange: Send + fmt::Debug {
    /// Finds and claims a run for `req` inside the range, returning its absolute first slot.
    fn alloc(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize>;
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
    /// Which allocator this is (and its name in logs).
    kind: AllocatorKind,
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

/// How a [`Locked`] divides the pool into ranges, one lock each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// One range per area of the geometry.
    PerArea,
    /// One range over the whole pool (the areas of the geometry are ignored, but must be
    /// consistent).
    Whole,
}

impl<T: SlotRange> Locked<T> {
    /// The ranges `split` asks for, each built by `make(first slot, slots)`; `whole_segments`
    /// as for [`check_geometry`].
    ///
    /// # Errors
    /// [`Error::Config`] for a geometry [`check_geometry`] refuses.
    pub fn new(
        kind: AllocatorKind,
        geom: &Geometry,
        split: Split,
        whole_segments: bool,
        make: impl Fn(usize, usize) -> T,
    ) -> Result<Self> {
        check_geometry(geom, whole_segments)?;
        // Both non-zero: check_geometry refuses empty areas.
        let (span, count) = match split {
            Split::PerArea => (geom.area_nslabs, geom.nareas),
            Split::Whole => (geom.nslabs, 1),
        };
        Ok(Self {
            geom: *geom,
            span,
            ranges: (0..count)
                .map(|i| TimedMutex::new(make(i * span, span)))
                .collect(),
            kind,
        })
    }

    /// Tries `f` on each range under its lock, from the calling worker's area and wrapping
    /// (Linux's walk over areas), and returns the first answer.
    pub fn find_map(&self, worker: usize, f: impl FnMut(&mut T) -> Option<usize>) -> Option<usize> {
        self.find_map_held(&mut Held::new(self), worker, f)
    }

    /// [`Locked::find_map`] with the locks of `held`.
    fn find_map_held(
        &self,
        held: &mut Held<'_, T>,
        worker: usize,
        mut f: impl FnMut(&mut T) -> Option<usize>,
    ) -> Option<usize> {
        let n = self.ranges.len();
        let start = self.geom.start_area(worker);
        (0..n).find_map(|k| f(held.get((start + k) % n)))
    }

    /// The range slot `index` is in.
    pub fn range_of(&self, index: usize) -> usize {
        index / self.span
    }

    /// Releases a run into its range; a run outside the pool or not in use is logged and
    /// ignored.
    pub fn release(&self, index: usize, nslots: usize) {
        self.release_held(&mut Held::new(self), index, nslots);
    }

    /// [`Locked::release`] with the locks of `held`.
    fn release_held(&self, held: &mut Held<'_, T>, index: usize, nslots: usize) {
        let range = self.range_of(index);
        if range >= self.ranges.len() {
            tracing::error!(
                allocator = self.kind.name(),
                index,
                nslots,
                "free of a slot outside the pool ignored"
            );
            return;
        }
        if !held.get(range).release(&self.geom, index, nslots) {
            tracing::error!(
                allocator = self.kind.name(),
                index,
                nslots,
                "free of a run not in use ignored"
            );
        }
    }
}

/// The lock of at most one range at a time, kept while consecutive steps of a batch stay in
/// that range: a batch takes a range's lock once where its calls one by one would take it per
/// call, and never holds two (no lock order to keep).
struct Held<'a, T> {
    locked: &'a Locked<T>,
    at: Option<(usize, MutexGuard<'a, T>)>,
}

impl<'a, T: SlotRange> Held<'a, T> {
    fn new(locked: &'a Locked<T>) -> Self {
        Self { locked, at: None }
    }

    /// Range `range`, under its lock (taken now unless it is the one held; the one held
    /// before is released first). `range` must be a valid range number.
    fn get(&mut self, range: usize) -> &mut T {
        if !matches!(&self.at, Some((held, _)) if *held == range) {
            self.at = None;
        }
        let ranges = &self.locked.ranges;
        &mut self
            .at
            .get_or_insert_with(|| (range, ranges[range].lock()))
            .1
    }
}

impl<T: SlotRange> SlotAllocator for Locked<T> {
    fn kind(&self) -> AllocatorKind {
        self.kind
    }

    fn alloc(&self, req: &SlotRequest) -> Option<usize> {
        self.find_map(req.worker, |r| r.alloc(&self.geom, req))
    }

    fn batch(&self, b: &SlotBatch<'_>, out: &mut [usize]) -> usize {
        let mut held = Held::new(self);
        for f in b.frees {
            self.release_held(&mut held, f.index, f.nslots);
        }
        serve(b.reqs, out, |req| {
            self.find_map_held(&mut held, req.worker, |r| r.alloc(&self.geom, req))
        })
    }

    fn alloc_in_area(&self, area: usize, req: &SlotRequest) -> Option<usize> {
        if self.ranges.len() != self.geom.nareas {
            return None;
        }
        self.ranges.get(area)?.lock().alloc(&self.geom, req)
    }

    fn free(&self, index: usize, nslots: usize, _worker: usize) {
        self.release(index, nslots);
    }

    fn area_used(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.lock().used()).collect()
    }

    fn area_index(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.lock().index()).collect()
    }

    fn lock_stats(&self) -> Vec<LockSnapshot> {
        self.ranges.iter().map(TimedMutex::snapshot).collect()
    }

    fn reset_lock_stats(&self) {
        self.ranges.iter().for_each(TimedMutex::reset_stats);
    }
}
