//! One request, from the descriptor chain it came in to its used entry.
//!
//! A popped chain becomes a [`Request`], built in place in a slot of its queue worker's table
//! (slots are reused from request to request), and goes through three steps, each of which
//! can only fail into a status:
//! 1. The device's one chain walker ([`crate::virtio::chain::walk`]) reads the descriptors
//!    into the device-readable and device-writable byte streams of a [`Chain`], with the
//!    rules every device shares.
//! 2. [`RequestCtx::start`] maps the status byte first (`status.rs`: so an error can still be
//!    reported when the bounce pool fills up later in the request), reads and checks the
//!    header (`parse.rs`: type, directions, lengths, negotiated features), then maps all data
//!    buffers into the request and describes the host I/O on their device-visible pieces
//!    (`plan.rs`: a scatter-gather map, as a guest driver's `dma_map_sg`, with the sector range
//!    checked with checked arithmetic). It returns that I/O ([`Started::Submit`]: an
//!    [`IoOp`] whose buffer list was built once, at map time, and goes to the engine as it
//!    is), a finished request ([`Started::Done`]), or, with `may_wait`,
//!    [`Started::PoolFull`] when the bounce pool is momentarily full (everything released,
//!    the caller retries later).
//! 3. Once the engine completes the I/O, [`RequestCtx::finish`] unmaps the request's data in
//!    place (copying a read back through the pool), writes the status through its mapping
//!    and unmaps it; the caller puts the head on the used ring with the returned length.
//!
//! So a request holds its bounce slots exactly as long as its host I/O runs, as a real
//! device's DMA window and the guest's own swiotlb mapping do.
//!
//! virtio 1.0 devices may not assume any framing (`VIRTIO_F_ANY_LAYOUT` is implied by
//! VERSION_1): the header is the first 16 readable bytes, the status the last writable byte,
//! whatever the descriptor boundaries.

mod parse;
mod plan;
mod status;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bounce::{Dma, DmaBatch, DmaBuffer};
use smallvec::SmallVec;
use vm_memory::GuestMemory;

use super::io::IoOp;
use super::metrics::BlockMetrics;
use super::{BlockError, ID_BYTES, REQ_HEADER_LEN};
use crate::virtio::chain::{Chain, ChainHead, WalkRules};
use crate::virtio::spec::VIRTIO_BLK_S_OK;
use status::StatusBuf;

pub use parse::{RequestHeader, RequestType};
pub use status::{Completion, Unusable};

/// Discard/write-zeroes segments read at once (the advertised `max_*_seg` is at most this).
pub const MAX_DISCARD_SEGS: usize = 16;

/// What the device decided at activation: the limits and switches requests are checked
/// against.
#[derive(Clone, Debug)]
pub struct DiskParams {
    /// Capacity in sectors.
    pub capacity: u64,
    /// Writes are refused.
    pub readonly: bool,
    /// cache=unsafe: FLUSH requests sync nothing.
    pub no_flush: bool,
    /// DISCARD was negotiated.
    pub discard: bool,
    /// WRITE_ZEROES was negotiated.
    pub write_zeroes: bool,
    /// The device may unmap on write-zeroes with the UNMAP flag.
    pub may_unmap: bool,
    /// `max_discard_sectors`.
    pub max_discard_sectors: u32,
    /// `max_discard_seg`.
    pub max_discard_seg: u32,
    /// `max_write_zeroes_sectors`.
    pub max_write_zeroes_sectors: u32,
    /// `max_write_zeroes_seg`.
    pub max_write_zeroes_seg: u32,
    /// The id string, zero padded.
    pub serial: [u8; ID_BYTES],
    /// RING_INDIRECT_DESC was negotiated.
    pub indirect: bool,
    /// Largest indirect table accepted: the device's maximum queue size, which `seg_max`
    /// is derived from (not the ring size the driver chose).
    pub max_indirect: u16,
}

/// One request from parse to completion: its head, its status byte's mapping, its data
/// mappings and what its host I/O must move. It lives in its worker's table from
/// [`RequestCtx::start`] to [`RequestCtx::finish`] (or [`RequestCtx::release`]) and owns its
/// DMA mappings all that time.
#[derive(Debug)]
pub struct Request<M> {
    /// The head index (the used-ring id).
    pub head: u16,
    /// The guest memory its buffers point into, kept mapped until its I/O completes.
    pub mem: Option<Arc<M>>,
    status: Option<StatusBuf>,
    /// The data mappings, in stream order; inline for the usual one piece.
    maps: SmallVec<[DmaBuffer; 1]>,
    /// Bytes the host I/O must move.
    expected: u64,
    /// Data bytes written to the guest on success (a read's length).
    written: u64,
    kind: RequestType,
}

impl<M> Default for Request<M> {
    fn default() -> Self {
        Self {
            head: 0,
            mem: None,
            status: None,
            maps: SmallVec::new(),
            expected: 0,
            written: 0,
            kind: RequestType::Flush,
        }
    }
}

/// What [`RequestCtx::start`] did with a chain.
#[derive(Debug)]
pub enum Started {
    /// Finished at once (refused, GET_ID, a FLUSH that syncs nothing): its status is written.
    Done(Completion),
    /// Host I/O to submit; [`RequestCtx::finish`] completes the request with its result.
    Submit(IoOp),
    /// The bounce pool is momentarily full: every mapping of the request was released and
    /// nothing was written; the caller puts the head back on the ring and retries later.
    PoolFull,
}

/// What executes a queue's requests: built once per worker, by the device at activation.
#[derive(Debug)]
pub struct RequestCtx {
    /// The DMA handle.
    pub(in crate::block) dma: Dma,
    /// Limits and switches.
    pub(in crate::block) params: Arc<DiskParams>,
    /// Counters.
    pub(in crate::block) metrics: Arc<BlockMetrics>,
    /// The bounce worker id (the queue index).
    pub(in crate::block) worker: usize,
    /// Largest single mapping ([`bounce::Dma::max_mapping_size`]); larger buffers are
    /// mapped in pieces.
    pub(in crate::block) max_map: usize,
    /// The write cache the guest sees (config `writeback`), read per request: the driver
    /// may switch it at any time.
    pub(in crate::block) write_cache: Arc<AtomicBool>,
}

/// True for a mapping that failed because the bounce pool is momentarily full.
fn is_pool_full(e: &BlockError) -> bool {
    matches!(e, BlockError::Bounce(b) if b.class() == bounce::error::ErrorClass::Exhausted)
}

impl RequestCtx {
    /// The counters.
    pub fn metrics(&self) -> &BlockMetrics {
        &self.metrics
    }

    /// Walks the chain at `at` into `chain`, parses it, maps its buffers into `req` and
    /// either finishes it or returns the host I/O to submit.
    ///
    /// Every request whose status byte can be located gets a status there (now, or at
    /// [`RequestCtx::finish`]): OK, UNSUPP, or IOERR for anything refused (a malformed but
    /// enumerable chain included). With `may_wait`, a full pool gives [`Started::PoolFull`]
    /// instead of IOERR, unless the request could never fit in the pool.
    ///
    /// # Errors
    /// [`Unusable`] when the chain cannot be enumerated, has no device-writable byte, or its
    /// status byte cannot be written even directly.
    pub fn start<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        at: &ChainHead,
        chain: &mut Chain,
        req: &mut Request<R>,
        may_wait: bool,
    ) -> Result<Started, Unusable> {
        let rules = WalkRules {
            indirect: self.params.indirect,
            max_indirect: self.params.max_indirect,
        };
        let walked = at.walk(mem, &rules, chain);
        let Some(status_addr) = chain.last_writable_byte() else {
            let e = walked.err().map_or(
                BlockError::BadChain("no device-writable status byte"),
                BlockError::from,
            );
            return Err(self.unusable(e));
        };
        let waits = may_wait && walked.is_ok() && self.could_fit(chain);
        // The allocator calls of this step: the status byte and the header in one, the data
        // (with the header's release) in another.
        let mut batch = self.dma.batch(self.worker);
        // Map the status byte before anything else, so that a later failure (a full pool
        // among them) can still be reported; the header's pieces after it, in the same call.
        let header = walked.is_ok() && chain.readable_len >= REQ_HEADER_LEN as u64;
        let (mapped, header) = self.map_head(mem, chain, status_addr, header, &mut batch);
        let status = match mapped {
            Err(e)
                if waits
                    && e.class() == bounce::error::ErrorClass::Exhausted
                    && self.others_hold_slots(0) =>
            {
                self.metrics.pool_full_waits.inc();
                return Ok(Started::PoolFull);
            }
            r => self.status_buf(r, status_addr)?,
        };
        let held = usize::from(matches!(status, StatusBuf::Mapped(_)));
        req.status = Some(status);
        let planned = walked
            .map_err(BlockError::from)
            .and_then(|()| {
                // A header mapped with the status is read now; after a failed status map it
                // is mapped on its own.
                let bytes = match header {
                    Some(h) => self.read_head(mem, h, &mut batch),
                    None if chain.readable_len >= REQ_HEADER_LEN as u64 => {
                        self.read_header(mem, chain, &mut batch)
                    }
                    None => Err(BlockError::BadChain("request header shorter than 16 bytes")),
                };
                self.parse(chain, bytes)
            })
            .and_then(|parsed| self.plan(mem, chain, parsed, req, &mut batch));
        let (st, written) = match planned {
            Ok(plan::Planned::Done(written)) => (VIRTIO_BLK_S_OK, written),
            Ok(plan::Planned::Io(op)) => return Ok(Started::Submit(op)),
            Err(e) if waits && is_pool_full(&e) && self.others_hold_slots(held) => {
                // Nothing but the status byte is still mapped (the data maps were released);
                // the status mapping goes too, its byte untouched.
                self.release_status(mem, req, &mut batch);
                self.metrics.pool_full_waits.inc();
                return Ok(Started::PoolFull);
            }
            Err(e) => {
                if is_pool_full(&e) {
                    self.metrics.pool_full_failed.inc();
                }
                self.metrics.count_error(&e);
                (e.status(), 0)
            }
        };
        self.complete(mem, req, st, written, &mut batch)
            .map(Started::Done)
    }

    /// The batch a worker completes the requests of one reap through ([`RequestCtx::finish`],
    /// [`RequestCtx::release`]): their slots go back in one allocator call when it is dropped.
    pub fn batch(&self) -> DmaBatch<'_> {
        self.dma.batch(self.worker)
    }

    /// Completes a request whose host I/O ended with `result` (bytes moved, or the host
    /// error): unmaps its data in place (copying a read's bytes back through the bounce
    /// pool), writes the status and unmaps it, through `batch` ([`RequestCtx::batch`]).
    ///
    /// # Errors
    /// [`Unusable`] when the status byte cannot be written even directly.
    pub fn finish<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        req: &mut Request<R>,
        result: std::io::Result<u64>,
        batch: &mut DmaBatch<'_>,
    ) -> Result<Completion, Unusable> {
        let io = match result {
            Ok(n) if n == req.expected => Ok(()),
            Ok(n) => Err(BlockError::Short {
                expected: req.expected,
                done: n,
            }),
            Err(e) => Err(BlockError::Io(e.to_string())),
        };
        // Only a complete transfer is copied back to the guest.
        let unmapped = self.unmap_all(mem, req, io.is_ok(), batch);
        let (st, written) = match io.and(unmapped) {
            Ok(()) => {
                match req.kind {
                    RequestType::In => self.metrics.bytes_read.add(req.expected),
                    RequestType::Out => self.metrics.bytes_written.add(req.expected),
                    _ => {}
                }
                (VIRTIO_BLK_S_OK, req.written)
            }
            Err(e) => {
                self.metrics.count_error(&e);
                (e.status(), 0)
            }
        };
        self.complete(mem, req, st, written, batch)
    }

    /// Drops a request without completing it (device reset): its mappings are unmapped
    /// through `batch` and nothing is written to the guest.
    pub fn release<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        req: &mut Request<R>,
        batch: &mut DmaBatch<'_>,
    ) {
        if let Err(e) = self.unmap_all(mem, req, false, batch) {
            self.metrics.count_error(&e);
        }
        self.release_status(mem, req, batch);
    }

    /// True when the pool holds more than the `own` slots of this request: someone's unmap
    /// can make room. With nothing else mapped a failing request can never fit (its size or
    /// the allocator's placement rules exceed the pool), so waiting could never help.
    fn others_hold_slots(&self, own: usize) -> bool {
        self.dma.pool().is_some_and(|p| p.used() > own)
    }

    /// False when the chain's buffers together exceed the whole bounce pool: waiting for
    /// slots could never help.
    fn could_fit(&self, chain: &Chain) -> bool {
        let Some(pool) = self.dma.pool() else {
            return true;
        };
        let g = pool.geometry();
        let total = (g.nslabs as u64).saturating_mul(g.slot_size());
        chain
            .readable_len
            .saturating_sub(REQ_HEADER_LEN as u64)
            .saturating_add(chain.writable_len)
            <= total
    }

    /// The write cache is on now (FUA off).
    fn write_cache(&self) -> bool {
        self.write_cache.load(Ordering::Relaxed)
    }
}
