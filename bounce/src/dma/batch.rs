//! [`DmaBatch`]: a device's maps and unmaps of one request step, with the pool's allocator
//! locks taken once per batch ([`PoolBatch`]) instead of once per buffer.

use vm_memory::GuestMemory;

use super::{Dma, DmaBuffer};
use crate::error::Result;
use crate::pool::{Mapping, PoolBatch};
use crate::types::{Direction, DmaAttrs, MapRequest, RangeCheck};

/// Bounced buffers handed to the pool at once.
const BATCH: usize = 8;

/// One guest buffer to map: guest address, length, direction.
pub type GuestBuf = (u64, usize, Direction);

/// Maps and unmaps of one worker through a [`Dma`], batched as [`PoolBatch`] batches them:
/// the results are those of [`Dma::map`] and [`Dma::unmap`] one by one, in the same order.
/// Releases what it unmapped when dropped (or at [`DmaBatch::flush`]).
#[derive(Debug)]
pub struct DmaBatch<'d> {
    dma: &'d Dma,
    worker: usize,
    pool: Option<PoolBatch<'d>>,
}

impl Dma {
    /// A batch of maps and unmaps on behalf of `worker`.
    pub fn batch(&self, worker: usize) -> DmaBatch<'_> {
        DmaBatch {
            dma: self,
            worker,
            pool: self.pool.as_deref().map(|p| p.batch(worker)),
        }
    }
}

impl DmaBuffer {
    /// The buffer of a bounced mapping.
    fn bounced(m: Mapping) -> Self {
        Self {
            gpa: m.orig,
            len: m.size,
            dir: m.dir,
            bounce: Some(m),
        }
    }
}

impl DmaBatch<'_> {
    /// Maps `bufs` in order as [`Dma::map`] on each would (`check` as there), handing each
    /// buffer to `mapped`, until one fails.
    ///
    /// # Errors
    /// The first failure, as [`Dma::map`] reports it; the buffers handed out before it stay
    /// mapped.
    pub fn map<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        bufs: &[GuestBuf],
        check: RangeCheck,
        mut mapped: impl FnMut(DmaBuffer),
    ) -> Result<()> {
        // Bounced requests waiting for the pool; submitted when full, before a direct buffer
        // and before a failure, so that `mapped` sees the buffers in order and the maps
        // before a failure are made, as one by one.
        let mut reqs = [MapRequest {
            orig: 0,
            size: 0,
            dir: Direction::ToDevice,
            attrs: DmaAttrs::default(),
            min_align_mask: 0,
            alloc_align_mask: 0,
            seg_boundary_mask: 0,
            worker: self.worker,
        }; BATCH];
        let mut n = 0;
        for &(gpa, len, dir) in bufs {
            let checked = self
                .dma
                .checked_request(mem, (gpa, len, dir), self.worker, check);
            if let Ok(Some(req)) = checked {
                reqs[n] = req;
                n += 1;
                if n == BATCH {
                    self.submit(mem, &reqs[..n], &mut mapped)?;
                    n = 0;
                }
                continue;
            }
            self.submit(mem, &reqs[..n], &mut mapped)?;
            n = 0;
            checked?;
            mapped(DmaBuffer {
                gpa,
                len,
                dir,
                bounce: None,
            });
        }
        self.submit(mem, &reqs[..n], &mut mapped)
    }

    /// Maps the bounced requests `reqs` through the pool batch.
    fn submit<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        reqs: &[MapRequest],
        mapped: &mut impl FnMut(DmaBuffer),
    ) -> Result<()> {
        let dma = self.dma;
        match self.pool.as_mut() {
            // The ranges were checked by `checked_request` or by the caller.
            Some(pool) if !reqs.is_empty() => {
                // Counted once for the batch: what it mapped, and how it ended.
                let (mut maps, mut bytes) = (0u64, 0u64);
                let r = pool.map(mem, reqs, RangeCheck::Prevalidated, |m| {
                    maps += 1;
                    bytes += m.size as u64;
                    mapped(DmaBuffer::bounced(m))
                });
                dma.count_maps(maps, bytes, &r);
                r
            }
            _ => Ok(()),
        }
    }

    /// Unmaps `buf` as [`Dma::unmap`] does; its slots are released with the batch's next
    /// allocator call.
    ///
    /// # Errors
    /// As [`Dma::unmap`].
    pub fn unmap<M: GuestMemory + ?Sized>(&mut self, mem: &M, buf: DmaBuffer) -> Result<()> {
        match (&buf.bounce, self.pool.as_mut()) {
            (Some(m), Some(pool)) => {
                let r = pool.unmap(mem, m);
                self.dma.count_unmap(&r);
                r
            }
            _ => Ok(()),
        }
    }

    /// Unmaps `buf` as [`Dma::unmap_written`] does; its slots are released with the batch's
    /// next allocator call.
    ///
    /// # Errors
    /// As [`Dma::unmap_written`].
    pub fn unmap_written<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        buf: DmaBuffer,
        written: usize,
    ) -> Result<()> {
        let (Some(m), Some(pool), Some(batch)) = (&buf.bounce, &self.dma.pool, self.pool.as_mut())
        else {
            return Ok(());
        };
        let dma = self.dma;
        Dma::unmap_prefix(pool, mem, &buf, m, written, |attrs| {
            let released = batch.unmap_single(mem, m.dev_addr, m.size, m.dir, attrs);
            dma.count_unmap(&released);
            released
        })
    }

    /// Releases the slots of what the batch unmapped, in one allocator call.
    pub fn flush(&mut self) {
        if let Some(pool) = self.pool.as_mut() {
            pool.flush();
        }
    }
}
