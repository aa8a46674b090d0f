//! Descriptor chains to requests, requests to I/O, I/O to a status.
//!
//! A popped chain goes through three steps, each of which can only fail into a status:
//! 1. The device's one chain walker ([`crate::virtio::chain::walk`]) reads the descriptors
//!    into the device-readable and device-writable byte streams of a [`Chain`], with the
//!    rules every device shares.
//! 2. [`RequestCtx::start`] maps the status byte first (so an error can still be reported
//!    when the bounce pool fills up later in the request), reads the header through the DMA
//!    handle, parses it into a [`RequestType`], validates directions, lengths and the sector
//!    range with checked arithmetic, and maps all data buffers (a scatter-gather map, as a
//!    guest driver's `dma_map_sg`). It returns the host I/O on the device-visible buffers
//!    ([`Started::Submit`]: an [`IoOp`] and the [`Pending`] request that owns the mappings),
//!    a finished request ([`Started::Done`]), or, with `may_wait`, [`Started::PoolFull`] when
//!    the bounce pool is momentarily full (everything released, the caller retries later).
//! 3. Once the engine completes the I/O, [`RequestCtx::finish`] unmaps the data (copying a
//!    read back through the pool), writes the status through its mapping and unmaps it; the
//!    caller puts the head on the used ring with the returned length.
//!
//! So a request holds its bounce slots exactly as long as its host I/O runs, as a real
//! device's DMA window and the guest's own swiotlb mapping do.
//!
//! virtio 1.0 devices may not assume any framing (`VIRTIO_F_ANY_LAYOUT` is implied by
//! VERSION_1): the header is the first 16 readable bytes, the status the last writable byte,
//! whatever the descriptor boundaries.

use bounce::{Direction, Dma, DmaBuffer};
use vm_memory::GuestMemory;

use super::io::{IoBufCollector, IoBufs, IoOp, Range};
use super::metrics::BlockMetrics;
use super::{
    req_type, status, BlockError, Result, DISCARD_SEG_LEN, ID_BYTES, REQ_HEADER_LEN, SECTOR_SHIFT,
    SECTOR_SIZE, WRITE_ZEROES_FLAG_UNMAP,
};
use crate::virtio::chain::{self, for_each_piece, Chain, ChainHead, Seg, WalkRules};

/// Discard/write-zeroes segments read at once (the advertised `max_*_seg` is at most this).
pub const MAX_DISCARD_SEGS: usize = 16;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    /// Read sectors.
    In,
    /// Write sectors.
    Out,
    /// Flush the write cache.
    Flush,
    /// Get the id string.
    GetId,
    /// Discard ranges.
    Discard,
    /// Zero ranges.
    WriteZeroes,
    /// Anything else (the raw type).
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(t: u32) -> Self {
        match t {
            req_type::IN => Self::In,
            req_type::OUT => Self::Out,
            req_type::FLUSH => Self::Flush,
            req_type::GET_ID => Self::GetId,
            req_type::DISCARD => Self::Discard,
            req_type::WRITE_ZEROES => Self::WriteZeroes,
            t => Self::Unsupported(t),
        }
    }
}

/// A parsed request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// The request type.
    pub kind: RequestType,
    /// The first sector (512-byte units).
    pub sector: u64,
}

impl RequestHeader {
    /// Parses the 16 header bytes (little endian: type, reserved, sector).
    pub fn parse(bytes: &[u8; REQ_HEADER_LEN]) -> Self {
        let mut t = [0u8; 4];
        t.copy_from_slice(&bytes[0..4]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&bytes[8..16]);
        Self {
            kind: RequestType::from(u32::from_le_bytes(t)),
            sector: u64::from_le_bytes(s),
        }
    }
}

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

/// How a chain ended: the used length and the status written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The used length to report: data bytes written plus the status byte.
    pub used_len: u32,
    /// The status written.
    pub status: u8,
}

/// A chain whose status byte cannot be found or written: no completion can tell the driver
/// it failed, so the device must stop (DEVICE_NEEDS_RESET, as QEMU's `virtio_error`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unusable request chain: {0}")]
pub struct Unusable(pub BlockError);

/// True for a mapping that failed because the bounce pool is momentarily full.
fn is_pool_full(e: &BlockError) -> bool {
    matches!(e, BlockError::Bounce(b) if b.class() == bounce::error::ErrorClass::Exhausted)
}

/// Where the status byte goes: through a mapping made before anything else, or, when the
/// pool was full at that point, straight to guest memory.
#[derive(Debug)]
enum StatusBuf {
    Mapped(DmaBuffer),
    Direct(u64),
}

/// Executes requests for one queue worker.
#[derive(Debug)]
pub struct RequestCtx<'a> {
    /// The DMA handle.
    pub dma: &'a Dma,
    /// Limits and switches.
    pub params: &'a DiskParams,
    /// Counters.
    pub metrics: &'a BlockMetrics,
    /// The bounce worker id (the queue index).
    pub worker: usize,
    /// Largest single mapping ([`bounce::Dma::max_mapping_size`]); larger buffers are
    /// mapped in pieces.
    pub max_map: usize,
    /// Scratch list of mapped buffers, reused between requests.
    pub mapped: &'a mut Vec<DmaBuffer>,
    /// The write cache is on (the guest may see writes complete before they are durable);
    /// read per request, since the driver may switch it through the `writeback` field.
    pub write_cache: bool,
    /// A request that finds the pool full may wait for slots instead of failing
    /// (`on-full=wait` with something to wait for).
    pub may_wait: bool,
}

/// A request whose host I/O is in flight: it owns its DMA mappings (data and status) until
/// [`RequestCtx::finish`] or [`RequestCtx::release`].
#[derive(Debug)]
pub struct Pending {
    status_buf: StatusBuf,
    /// Inline for the usual one data piece: a request in flight allocates nothing.
    mapped: smallvec::SmallVec<[DmaBuffer; 1]>,
    /// Bytes the host I/O must move.
    expected: u64,
    /// Data bytes written to the guest on success (a read's length).
    written: u64,
    kind: RequestType,
}

impl Pending {
    /// Bounce mappings held (data pieces plus the status byte's).
    pub fn mappings(&self) -> usize {
        self.mapped.len() + usize::from(matches!(self.status_buf, StatusBuf::Mapped(_)))
    }
}

/// What [`RequestCtx::start`] did with a chain.
// Moved once per request into the in-flight table: boxing the large variant would bring back
// the allocation per request that the inline mappings and pieces avoid.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Started {
    /// Finished at once (refused, GET_ID, a FLUSH that syncs nothing): its status is written.
    Done(Completion),
    /// Host I/O to submit; [`RequestCtx::finish`] completes it with the I/O's result.
    Submit(Pending, IoOp),
    /// The bounce pool is momentarily full: every mapping of the request was released and
    /// nothing was written; the caller puts the head back on the ring and retries later.
    PoolFull,
}

/// The host side of a parsed request.
enum Plan {
    /// Nothing to submit; this many data bytes were written to the guest.
    Done(u64),
    /// I/O on the buffers in `RequestCtx::mapped`.
    Io {
        op: IoOp,
        expected: u64,
        written: u64,
        kind: RequestType,
    },
}

impl RequestCtx<'_> {
    /// Walks the chain at `at` into `chain`, parses it, maps its buffers and either finishes
    /// it or returns the host I/O to submit.
    ///
    /// Every request whose status byte can be located gets a status there (now, or at
    /// [`RequestCtx::finish`]): OK, UNSUPP, or IOERR for anything refused (a malformed but
    /// enumerable chain included). With `may_wait`, a full pool gives [`Started::PoolFull`]
    /// instead of IOERR, unless the request could never fit in the pool.
    ///
    /// # Errors
    /// [`Unusable`] when the chain cannot be enumerated, has no device-writable byte, or its
    /// status byte cannot be written even directly.
    pub fn start<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        at: &ChainHead,
        chain: &mut Chain,
    ) -> std::result::Result<Started, Unusable> {
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
            self.metrics.count_error(&e);
            self.metrics.no_status.inc();
            return Err(Unusable(e));
        };
        let waits = self.may_wait && walked.is_ok() && self.could_fit(chain);
        // Map the status byte before anything else, so that a later failure (a full pool
        // among them) can still be reported.
        let status_buf =
            match self
                .dma
                .map_prevalidated(mem, status_addr, 1, Direction::FromDevice, self.worker)
            {
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
        let (st, written) = match walked
            .map_err(BlockError::from)
            .and_then(|()| self.plan(mem, chain))
        {
            Ok(Plan::Done(written)) => (status::OK, written),
            Ok(Plan::Io {
                op,
                expected,
                written,
                kind,
            }) => {
                let mapped = self.mapped.drain(..).collect();
                return Ok(Started::Submit(
                    Pending {
                        status_buf,
                        mapped,
                        expected,
                        written,
                        kind,
                    },
                    op,
                ));
            }
            Err(e)
                if waits
                    && is_pool_full(&e)
                    && self.others_hold_slots(usize::from(matches!(
                        status_buf,
                        StatusBuf::Mapped(_)
                    ))) =>
            {
                // Nothing but the status byte is still mapped (map_stream released the
                // rest); the status mapping goes too, its byte untouched.
                self.release_status(mem, status_buf);
                self.metrics.pool_full_waits.inc();
                return Ok(Started::PoolFull);
            }
            Err(e) => {
                tracing::debug!("virtio-blk request failed: {e}");
                if is_pool_full(&e) {
                    self.metrics.pool_full_failed.inc();
                }
                self.metrics.count_error(&e);
                (e.status(), 0)
            }
        };
        self.complete(mem, status_buf, st, written)
            .map(Started::Done)
    }

    /// Completes a request whose host I/O ended with `result` (bytes moved, or the host
    /// error): unmaps its data (copying a read's bytes back through the bounce pool), writes
    /// the status and releases it.
    ///
    /// # Errors
    /// [`Unusable`] when the status byte cannot be written even directly.
    pub fn finish<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        p: Pending,
        result: std::io::Result<u64>,
    ) -> std::result::Result<Completion, Unusable> {
        let io = match result {
            Ok(n) if n == p.expected => Ok(()),
            Ok(n) => Err(BlockError::Short {
                expected: p.expected,
                done: n,
            }),
            Err(e) => Err(BlockError::Io(e.to_string())),
        };
        self.mapped.clear();
        self.mapped.extend(p.mapped);
        // Only a complete transfer is copied back to the guest (issue 11 item 4).
        let unmapped = self.unmap_all(mem, io.is_ok());
        let (st, written) = match io.and(unmapped) {
            Ok(()) => {
                match p.kind {
                    RequestType::In => self.metrics.bytes_read.add(p.expected),
                    RequestType::Out => self.metrics.bytes_written.add(p.expected),
                    _ => {}
                }
                (status::OK, p.written)
            }
            Err(e) => {
                tracing::debug!("virtio-blk request failed: {e}");
                self.metrics.count_error(&e);
                (e.status(), 0)
            }
        };
        self.complete(mem, p.status_buf, st, written)
    }

    /// Drops a request without completing it (device reset): its mappings are released and
    /// nothing is written to the guest.
    pub fn release<M: GuestMemory + ?Sized>(&mut self, mem: &M, p: Pending) {
        self.mapped.clear();
        self.mapped.extend(p.mapped);
        if let Err(e) = self.unmap_all(mem, false) {
            self.metrics.count_error(&e);
        }
        self.release_status(mem, p.status_buf);
    }

    fn release_status<M: GuestMemory + ?Sized>(&self, mem: &M, status_buf: StatusBuf) {
        if let StatusBuf::Mapped(b) = status_buf {
            if let Err(e) = self.dma.unmap(mem, b, self.worker) {
                self.metrics.count_error(&BlockError::from(e));
            }
        }
    }

    fn complete<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        status_buf: StatusBuf,
        st: u8,
        written: u64,
    ) -> std::result::Result<Completion, Unusable> {
        self.write_status(mem, status_buf, st)?;
        Ok(Completion {
            // written <= writable_len - 1 < u32::MAX (a chain holds at most 2^16 buffers of
            // at most 2^32 - 1 bytes; the saturation is a guard only).
            used_len: u32::try_from(written.saturating_add(1)).unwrap_or(u32::MAX),
            status: st,
        })
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

    /// Where the status byte goes, given the result of mapping it: through the mapping, or,
    /// when the pool was full, straight to guest memory.
    fn status_buf(
        &self,
        mapped: bounce::Result<DmaBuffer>,
        addr: u64,
    ) -> std::result::Result<StatusBuf, Unusable> {
        match mapped {
            Ok(b) => Ok(StatusBuf::Mapped(b)),
            Err(e) if e.class() == bounce::error::ErrorClass::Exhausted => {
                self.metrics.status_direct.inc();
                Ok(StatusBuf::Direct(addr))
            }
            Err(e) => {
                let e = BlockError::from(e);
                self.metrics.count_error(&e);
                self.metrics.no_status.inc();
                Err(Unusable(e))
            }
        }
    }

    fn write_status<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        status_buf: StatusBuf,
        st: u8,
    ) -> std::result::Result<(), Unusable> {
        let addr = match status_buf {
            StatusBuf::Mapped(b) => {
                let wrote = self.dma.write(mem, &b, 0, &[st]);
                let unmapped = self.dma.unmap(mem, b, self.worker);
                match wrote.and(unmapped) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        self.metrics.count_error(&BlockError::from(e));
                        self.metrics.status_direct.inc();
                        b.guest_addr()
                    }
                }
            }
            StatusBuf::Direct(a) => a,
        };
        self.dma.write_direct(mem, addr, &[st]).map_err(|e| {
            let e = BlockError::from(e);
            self.metrics.count_error(&e);
            self.metrics.no_status.inc();
            Unusable(e)
        })
    }

    /// Maps `start..start + len` of a stream in `dir` into `self.mapped`, in pieces of at most
    /// `max_map` bytes. On error everything mapped so far is unmapped.
    fn map_stream<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        segs: &[Seg],
        start: u64,
        len: u64,
        dir: Direction,
    ) -> Result<()> {
        self.mapped.clear();
        let dma = self.dma;
        let worker = self.worker;
        let mapped = &mut *self.mapped;
        let r = for_each_piece(segs, start, len, self.max_map as u64, |addr, n| {
            mapped.push(dma.map_prevalidated(mem, addr, n, dir, worker)?);
            Ok::<(), BlockError>(())
        });
        if r.is_err() {
            // The map error is what the request reports; a failing unmap is counted too.
            // Nothing was transferred: nothing may be copied back.
            if let Err(e) = self.unmap_all(mem, false) {
                self.metrics.count_error(&e);
            }
        }
        r
    }

    /// Unmaps every buffer in `self.mapped`; the first error is returned. Unless
    /// `transferred` (the whole I/O succeeded), nothing is copied back to the guest: after a
    /// failed or short read only the guest's own bytes stay in its buffers, never stale pool
    /// contents (issue 11 item 4).
    fn unmap_all<M: GuestMemory + ?Sized>(&mut self, mem: &M, transferred: bool) -> Result<()> {
        let mut first = Ok(());
        for b in self.mapped.drain(..) {
            let r = if transferred {
                self.dma.unmap(mem, b, self.worker)
            } else {
                self.dma.unmap_written(mem, b, 0, self.worker)
            };
            if let Err(e) = r {
                if first.is_ok() {
                    first = Err(e.into());
                }
            }
        }
        first
    }

    /// Checks `sector..sector + len/512` against the capacity.
    fn check_range(&self, sector: u64, len: u64) -> Result<()> {
        let sectors = len.div_ceil(SECTOR_SIZE);
        let err = BlockError::OutOfRange {
            sector,
            sectors,
            capacity: self.params.capacity,
        };
        match sector.checked_add(sectors) {
            Some(end) if end <= self.params.capacity => Ok(()),
            _ => Err(err),
        }
    }

    fn byte_offset(sector: u64) -> Result<u64> {
        sector
            .checked_mul(SECTOR_SIZE)
            .ok_or(BlockError::OutOfRange {
                sector,
                sectors: 0,
                capacity: 0,
            })
    }

    /// Parses and runs a request; returns the data bytes written to the guest.
    fn plan<M: GuestMemory + ?Sized>(&mut self, mem: &M, chain: &Chain) -> Result<Plan> {
        if chain.readable_len < REQ_HEADER_LEN as u64 {
            return Err(BlockError::BadChain("request header shorter than 16 bytes"));
        }
        let mut hdr = [0u8; REQ_HEADER_LEN];
        chain::copy_from(self.dma, mem, self.worker, &chain.readable, 0, &mut hdr)?;
        let hdr = RequestHeader::parse(&hdr);
        // Bytes after the header (device-readable) and before the status (device-writable).
        let out_len = chain.readable_len - REQ_HEADER_LEN as u64;
        let in_len = chain.writable_len - 1;
        let m = self.metrics;
        match hdr.kind {
            RequestType::In => {
                m.reqs_in.inc();
                if out_len != 0 {
                    return Err(BlockError::BadChain("device-readable data in a read"));
                }
                self.data_plan(mem, chain, hdr.sector, in_len, Direction::FromDevice)
            }
            RequestType::Out => {
                m.reqs_out.inc();
                if in_len != 0 {
                    return Err(BlockError::BadChain("device-writable data in a write"));
                }
                if self.params.readonly {
                    return Err(BlockError::ReadOnly);
                }
                self.data_plan(mem, chain, hdr.sector, out_len, Direction::ToDevice)
            }
            RequestType::Flush => {
                m.reqs_flush.inc();
                if out_len != 0 || in_len != 0 {
                    return Err(BlockError::BadChain("data buffers in a flush"));
                }
                if self.params.no_flush {
                    // cache=unsafe: FLUSH completes without syncing anything (QEMU's
                    // cache.no-flush).
                    return Ok(Plan::Done(0));
                }
                Ok(Plan::Io {
                    op: IoOp::Flush,
                    expected: 0,
                    written: 0,
                    kind: RequestType::Flush,
                })
            }
            RequestType::GetId => {
                m.reqs_get_id.inc();
                if out_len != 0 {
                    return Err(BlockError::BadChain("device-readable data in GET_ID"));
                }
                let n = usize::try_from(in_len.min(ID_BYTES as u64)).unwrap_or(ID_BYTES);
                let serial = self.params.serial;
                chain::copy_to(self.dma, mem, self.worker, &chain.writable, 0, &serial[..n])?;
                Ok(Plan::Done(n as u64))
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                let zeroes = hdr.kind == RequestType::WriteZeroes;
                if zeroes {
                    m.reqs_write_zeroes.inc();
                } else {
                    m.reqs_discard.inc();
                }
                let negotiated = if zeroes {
                    self.params.write_zeroes
                } else {
                    self.params.discard
                };
                if !negotiated {
                    let t = if zeroes {
                        req_type::WRITE_ZEROES
                    } else {
                        req_type::DISCARD
                    };
                    return Err(BlockError::Unsupported(t));
                }
                if in_len != 0 {
                    return Err(BlockError::BadChain("device-writable data in a discard"));
                }
                if self.params.readonly {
                    return Err(BlockError::ReadOnly);
                }
                self.discard_plan(mem, chain, out_len, zeroes)
            }
            RequestType::Unsupported(t) => {
                m.reqs_unsupported.inc();
                Err(BlockError::Unsupported(t))
            }
        }
    }

    /// Maps the data part of the chain for moving `len` bytes between it and the disk at
    /// `sector`, and describes the I/O on the device-visible buffers.
    fn data_plan<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        chain: &Chain,
        sector: u64,
        len: u64,
        dir: Direction,
    ) -> Result<Plan> {
        if len % SECTOR_SIZE != 0 {
            return Err(BlockError::Unaligned(len));
        }
        self.check_range(sector, len)?;
        let offset = Self::byte_offset(sector)?;
        let read = dir == Direction::FromDevice;
        if len == 0 {
            return Ok(Plan::Done(0));
        }
        let (segs, start) = if read {
            (&chain.writable, 0)
        } else {
            (&chain.readable, REQ_HEADER_LEN as u64)
        };
        // Every buffer was checked against guest memory, with the permission its direction
        // needs, by the chain walker; and every piece is mapped before the first byte moves.
        self.map_stream(mem, segs, start, len, dir)?;
        // Where the device-visible bytes are: the engine moves them later, while the
        // mappings stay in `self.mapped` (then in the pending request).
        let mut bufs = IoBufs::new();
        let mut collected = Ok(());
        for b in self.mapped.iter() {
            let n = b.len();
            let mut sink = IoBufCollector(&mut bufs);
            let r = if read {
                self.dma.write_from(mem, b, 0, n, &mut sink)
            } else {
                self.dma.read_to(mem, b, 0, n, &mut sink)
            };
            if let Err(e) = r {
                collected = Err(BlockError::from(e));
                break;
            }
        }
        if let Err(e) = collected {
            if let Err(u) = self.unmap_all(mem, false) {
                self.metrics.count_error(&u);
            }
            return Err(e);
        }
        let (op, kind, written) = if read {
            (IoOp::Read { offset, bufs }, RequestType::In, len)
        } else {
            (
                IoOp::Write {
                    offset,
                    bufs,
                    fua: !self.write_cache,
                },
                RequestType::Out,
                0,
            )
        };
        Ok(Plan::Io {
            op,
            expected: len,
            written,
            kind,
        })
    }

    /// Parses and checks the segments of a DISCARD or WRITE_ZEROES request (the `payload`
    /// bytes after the header) into the ranges of its host op.
    fn discard_plan<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        chain: &Chain,
        payload: u64,
        zeroes: bool,
    ) -> Result<Plan> {
        let (max_seg, max_sectors) = if zeroes {
            (
                self.params.max_write_zeroes_seg,
                self.params.max_write_zeroes_sectors,
            )
        } else {
            (self.params.max_discard_seg, self.params.max_discard_sectors)
        };
        if payload == 0 || payload % DISCARD_SEG_LEN as u64 != 0 {
            return Err(BlockError::BadChain("discard payload not a multiple of 16"));
        }
        let nseg = payload / DISCARD_SEG_LEN as u64;
        let max = u64::from(max_seg).min(MAX_DISCARD_SEGS as u64);
        if nseg > max {
            return Err(BlockError::Limits("too many segments"));
        }
        // nseg <= MAX_DISCARD_SEGS, so this fits the stack buffer.
        let bytes = nseg as usize * DISCARD_SEG_LEN;
        let mut raw = [0u8; MAX_DISCARD_SEGS * DISCARD_SEG_LEN];
        chain::copy_from(
            self.dma,
            mem,
            self.worker,
            &chain.readable,
            REQ_HEADER_LEN as u64,
            &mut raw[..bytes],
        )?;
        // Validate every segment before touching the disk.
        let mut segs = [(0u64, 0u64, false); MAX_DISCARD_SEGS];
        for (i, chunk) in raw[..bytes].chunks_exact(DISCARD_SEG_LEN).enumerate() {
            let mut s = [0u8; 8];
            s.copy_from_slice(&chunk[0..8]);
            let mut n = [0u8; 4];
            n.copy_from_slice(&chunk[8..12]);
            let mut f = [0u8; 4];
            f.copy_from_slice(&chunk[12..16]);
            let sector = u64::from_le_bytes(s);
            let num = u32::from_le_bytes(n);
            let flags = u32::from_le_bytes(f);
            let unmap = flags & WRITE_ZEROES_FLAG_UNMAP != 0;
            // virtio 1.2, 5.2.6.2: unmap on a discard, or any reserved flag, is UNSUPP.
            if flags & !WRITE_ZEROES_FLAG_UNMAP != 0 || (!zeroes && unmap) {
                let t = if zeroes {
                    req_type::WRITE_ZEROES
                } else {
                    req_type::DISCARD
                };
                return Err(BlockError::Unsupported(t));
            }
            if num > max_sectors {
                return Err(BlockError::Limits("segment larger than the maximum"));
            }
            let len = u64::from(num) << SECTOR_SHIFT;
            self.check_range(sector, len)?;
            segs[i] = (
                Self::byte_offset(sector)?,
                len,
                unmap && self.params.may_unmap,
            );
        }
        let ranges = segs[..nseg as usize]
            .iter()
            .filter(|&&(_, len, _)| len != 0)
            .map(|&(offset, len, unmap)| Range { offset, len, unmap })
            .collect();
        let fua = !self.write_cache;
        let (op, kind) = if zeroes {
            (IoOp::WriteZeroes { ranges, fua }, RequestType::WriteZeroes)
        } else {
            (IoOp::Discard { ranges, fua }, RequestType::Discard)
        };
        Ok(Plan::Io {
            op,
            expected: 0,
            written: 0,
            kind,
        })
    }
}
