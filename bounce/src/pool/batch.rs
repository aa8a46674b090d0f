//! One worker's maps and unmaps in batches: the allocator's locks taken once per batch.
//!
//! Linux maps one buffer at a time. A [`PoolBatch`] does what [`BouncePool::map`] and
//! [`BouncePool::unmap_single`] on the same requests one by one would do, in the same order,
//! with the same slots and the same failures, as if no other thread came in between:
//! - an unmap checks and copies back at once; its run is released with the batch's next
//!   allocator call: before the claims of the next [`PoolBatch::map`], or at
//!   [`PoolBatch::flush`] (the batch flushes when dropped);
//! - a map batch checks its requests in order up to the first that fails its checks, claims
//!   runs for those in one [`SlotAllocator::batch`](crate::SlotAllocator::batch) (which stops
//!   at the first that finds none, as the maps one by one would), then records and copies
//!   each in; it returns the first failure, leaving the earlier mappings to the caller, as the
//!   calls one by one would.
//!
//! Two failures cannot be ordered that way, because the claims come before the copies: a
//! copy-in that fails (an original checked before the map that is no longer accessible) and
//! a run that breaks the placement rules (an allocator bug). The runs claimed after it are then
//! released again; the maps one by one would not have claimed them, so rolling indexes may
//! differ afterwards.
//!
//! A dynamic pool batches nothing: its maps and unmaps go one by one.
//!
//! Time accounting counts every map and unmap of a batch as a call; the first map's sample
//! covers the batch's claims, a deferred release is not timed.

use super::{BouncePool, Fast, Layout, Mapping, UnmapArgs};
use crate::alloc::{Run, SlotBatch, SlotRequest};
use crate::error::Result;
use crate::orig::OrigMemory;
use crate::stats::TimedOp;
use crate::types::{Direction, DmaAttrs, MapRequest, RangeCheck};

/// Requests claimed in one allocator call, and runs held for release.
const BATCH: usize = 8;

/// Maps and unmaps of one worker, batched (see the module docs). Flushes its releases when
/// dropped.
#[derive(Debug)]
pub struct PoolBatch<'p> {
    pool: &'p BouncePool,
    worker: usize,
    pending: [Run; BATCH],
    npending: usize,
}

impl BouncePool {
    /// A batch of maps and unmaps on behalf of `worker`.
    pub fn batch(&self, worker: usize) -> PoolBatch<'_> {
        PoolBatch {
            pool: self,
            worker,
            pending: [Run {
                index: 0,
                nslots: 0,
            }; BATCH],
            npending: 0,
        }
    }
}

impl PoolBatch<'_> {
    /// Maps `reqs` in order as [`BouncePool::map`] on each would, handing each mapping to
    /// `mapped`, until one fails. With [`RangeCheck::Prevalidated`] the originals are not
    /// checked (the caller did, as for [`crate::Dma::map`]).
    ///
    /// # Errors
    /// The first failure, as [`BouncePool::map`] reports it; the mappings handed out before
    /// it stay mapped.
    pub fn map<M: OrigMemory + ?Sized>(
        &mut self,
        mem: &M,
        reqs: &[MapRequest],
        check: RangeCheck,
        mut mapped: impl FnMut(Mapping),
    ) -> Result<()> {
        let check_orig = check == RangeCheck::Here;
        let pool = self.pool;
        if pool.dynamic.is_some() {
            for req in reqs {
                mapped(pool.map_timed(mem, req, check_orig).map_err(|e| *e)?);
            }
            return Ok(());
        }
        for chunk in reqs.chunks(BATCH) {
            self.map_chunk(mem, chunk, check_orig, &mut mapped)
                .map_err(|e| *e)?;
        }
        Ok(())
    }

    /// Maps at most [`BATCH`] requests with one allocator call.
    fn map_chunk<M: OrigMemory + ?Sized>(
        &mut self,
        mem: &M,
        reqs: &[MapRequest],
        check_orig: bool,
        mapped: &mut impl FnMut(Mapping),
    ) -> Fast<()> {
        let pool = self.pool;
        let t0 = pool.timing.start(TimedOp::Map);
        let mut layouts = [Layout {
            offset: 0,
            alloc_size: 0,
        }; BATCH];
        let mut sreqs = [SlotRequest {
            nslots: 0,
            orig: 0,
            alloc_align_mask: 0,
            iotlb_align_mask: 0,
            boundary_mask: 0,
            worker: self.worker,
        }; BATCH];
        let mut checked = 0;
        let mut failed = None;
        for req in reqs {
            match pool.checked_layout(mem, req, check_orig) {
                Ok(layout) => {
                    layouts[checked] = layout;
                    sreqs[checked] = pool.request_of(req, &layout);
                    checked += 1;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let mut index = [0usize; BATCH];
        let b = SlotBatch {
            frees: &self.pending[..self.npending],
            worker: self.worker,
            reqs: &sreqs[..checked],
        };
        let served = pool.tlb.alloc.batch(&b, &mut index);
        self.released();
        let mut t = t0;
        for (k, req) in reqs[..served].iter().enumerate() {
            if k > 0 {
                t = pool.timing.start(TimedOp::Map);
            }
            let r = pool
                .checked_run(&pool.tlb, &sreqs[k], index[k])
                .and_then(|i| pool.fill(&pool.tlb, i, mem, req, &sreqs[k], &layouts[k]));
            pool.timing.record(TimedOp::Map, req.dir, t, &pool.counters);
            match r {
                Ok(m) => mapped(m),
                Err(e) => {
                    // Claimed but never recorded: back to the allocator.
                    for (s, &i) in sreqs[k + 1..served].iter().zip(&index[k + 1..served]) {
                        pool.tlb.alloc.free(i, s.nslots, self.worker);
                    }
                    return Err(e);
                }
            }
        }
        if served < checked {
            // Counted and reported after the maps before it, as one by one.
            let req = &reqs[served];
            failed = Some(Box::new(
                pool.full(layouts[served].alloc_size, req.attrs.no_warn),
            ));
        }
        match failed {
            Some(e) => {
                let t = if served == 0 {
                    t0
                } else {
                    pool.timing.start(TimedOp::Map)
                };
                pool.timing
                    .record(TimedOp::Map, reqs[served].dir, t, &pool.counters);
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Unmaps a mapping returned by a map of this pool, as [`BouncePool::unmap`] does; its
    /// run is released with the batch's next allocator call.
    ///
    /// # Errors
    /// As [`BouncePool::unmap_single`].
    pub fn unmap<M: OrigMemory + ?Sized>(&mut self, mem: &M, m: &Mapping) -> Result<()> {
        self.unmap_single(mem, m.dev_addr, m.size, m.dir, m.attrs)
    }

    /// As [`BouncePool::unmap_single`]; the run is released with the batch's next allocator
    /// call.
    ///
    /// # Errors
    /// As [`BouncePool::unmap_single`].
    pub fn unmap_single<M: OrigMemory + ?Sized>(
        &mut self,
        mem: &M,
        addr: u64,
        size: usize,
        dir: Direction,
        attrs: DmaAttrs,
    ) -> Result<()> {
        let pool = self.pool;
        if pool.dynamic.is_some() {
            return pool.unmap_single(mem, addr, size, dir, attrs, self.worker);
        }
        let u = UnmapArgs {
            addr,
            size,
            dir,
            attrs,
            worker: self.worker,
        };
        pool.timed(TimedOp::Unmap, dir, || {
            pool.unmap_static(mem, u, |tlb, index, nslots, _| {
                BouncePool::forget(tlb, index, nslots);
                self.defer(Run { index, nslots });
            })
        })
        .map_err(|e| *e)
    }

    /// Releases the runs the batch holds, in one allocator call.
    pub fn flush(&mut self) {
        if self.npending == 0 {
            return;
        }
        let b = SlotBatch {
            frees: &self.pending[..self.npending],
            worker: self.worker,
            reqs: &[],
        };
        self.pool.tlb.alloc.batch(&b, &mut []);
        self.released();
    }

    /// Holds `run` for release (flushing first when the batch holds as many as it can).
    fn defer(&mut self, run: Run) {
        if self.npending == BATCH {
            self.flush();
        }
        self.pending[self.npending] = run;
        self.npending += 1;
    }

    /// Counts the held runs as released (the allocator has them back).
    fn released(&mut self) {
        let slots: usize = self.pending[..self.npending].iter().map(|r| r.nslots).sum();
        if slots > 0 {
            let counters = &self.pool.counters;
            counters.dec_used_on(counters.shard(), slots);
        }
        self.npending = 0;
    }
}

impl Drop for PoolBatch<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}
