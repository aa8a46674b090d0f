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

use crate::alloc::areas::{check_geometry, FreeRuns, SearchStart};
use crate::alloc::{AllocatorKind, LockSnapshot, SlotAllocator, SlotRequest, TimedMutex};
use crate::error::Result;
use crate::geometry::Geometry;

/// One lock, one free-run list over the whole pool, one rolling index.
#[derive(Debug)]
pub struct LegacyAllocator {
    geom: Geometry,
    state: TimedMutex<FreeRuns>,
}

impl LegacyAllocator {
    /// Builds the allocator with every slot free and the index at 0. Areas of the geometry are
    /// ignored (the old kernel had none).
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for a geometry that is not whole segments.
    pub fn new(geom: &Geometry) -> Result<Self> {
        check_geometry(geom)?;
        Ok(Self {
            geom: *geom,
            state: TimedMutex::new(FreeRuns::new(0, geom.nslabs, geom.segsize)),
        })
    }
}

impl SlotAllocator for LegacyAllocator {
    fn kind(&self) -> AllocatorKind {
        AllocatorKind::Legacy
    }

    fn alloc(&self, req: &SlotRequest) -> Option<usize> {
        self.state
            .lock()
            .alloc(&self.geom, req, SearchStart::AlignedIndex)
    }

    fn free(&self, index: usize, nslots: usize, _worker: usize) {
        if !self.state.lock().free(&self.geom, index, nslots) {
            tracing::error!(index, nslots, "legacy: free of a run not in use ignored");
        }
    }

    fn area_used(&self) -> Vec<usize> {
        vec![self.state.lock().used]
    }

    fn area_index(&self) -> Vec<usize> {
        vec![self.state.lock().index]
    }

    fn lock_stats(&self) -> Vec<LockSnapshot> {
        vec![self.state.snapshot()]
    }

    fn reset_lock_stats(&self) {
        self.state.reset_stats();
    }
}
