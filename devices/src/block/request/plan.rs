//! From a parsed request to its host I/O: the sector range checked, the data buffers mapped
//! into the request, and the [`IoOp`] on their device-visible pieces, built once here and
//! handed to the engine as it is.

use bounce::{Direction, DmaBatch, GuestBuf, RangeCheck};
use smallvec::SmallVec;
use vm_memory::GuestMemory;

use super::parse::{Parsed, RequestType};
use super::{Request, RequestCtx, MAX_DISCARD_SEGS};
use crate::block::io::{IoBuf, IoBufs, IoOp, Range};
use crate::block::{
    BlockError, Result, DISCARD_SEG_LEN, REQ_HEADER_LEN, SECTOR_SHIFT, SECTOR_SIZE,
};
use crate::virtio::chain::{self, for_each_piece, Chain, Seg};
use crate::virtio::spec::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};

/// The host side of a parsed request.
#[derive(Debug)]
pub(super) enum Planned {
    /// Nothing to submit; this many data bytes were written to the guest.
    Done(u64),
    /// I/O on the device-visible pieces of the request's mappings.
    Io(IoOp),
}

impl RequestCtx {
    /// Maps what `parsed` moves into `req` and describes its host I/O (or does the request
    /// at once when there is none).
    pub(super) fn plan<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        chain: &Chain,
        parsed: Parsed,
        req: &mut Request<R>,
        batch: &mut DmaBatch<'_>,
    ) -> Result<Planned> {
        req.written = 0;
        req.expected = 0;
        match parsed {
            Parsed::Data { sector, len, dir } => {
                self.data_plan(mem, chain, (sector, len, dir), req, batch)
            }
            Parsed::Flush if self.params.no_flush => {
                // cache=unsafe: FLUSH completes without syncing anything (QEMU's
                // cache.no-flush).
                Ok(Planned::Done(0))
            }
            Parsed::Flush => {
                req.kind = RequestType::Flush;
                Ok(Planned::Io(IoOp::Flush))
            }
            Parsed::GetId { len } => {
                // What `batch` unmapped goes back before the id's own map, as one by one.
                batch.flush();
                let serial = self.params.serial;
                chain::copy_to(
                    &self.dma,
                    mem,
                    self.worker,
                    &chain.writable,
                    0,
                    &serial[..len],
                )?;
                Ok(Planned::Done(len as u64))
            }
            Parsed::Ranges { payload, zeroes } => {
                batch.flush();
                let op = self.ranges_op(mem, chain, payload, zeroes)?;
                req.kind = if zeroes {
                    RequestType::WriteZeroes
                } else {
                    RequestType::Discard
                };
                Ok(Planned::Io(op))
            }
        }
    }

    /// Maps the data part of the chain into `req` for moving `len` bytes between it and the
    /// disk at `sector` in `dir`, in one call of `batch`, and describes the I/O on the
    /// device-visible pieces.
    fn data_plan<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        chain: &Chain,
        (sector, len, dir): (u64, u64, Direction),
        req: &mut Request<R>,
        batch: &mut DmaBatch<'_>,
    ) -> Result<Planned> {
        if len % SECTOR_SIZE != 0 {
            return Err(BlockError::Unaligned(len));
        }
        self.check_range(sector, len)?;
        let offset = byte_offset(sector)?;
        if len == 0 {
            return Ok(Planned::Done(0));
        }
        let read = dir == Direction::FromDevice;
        let (segs, start) = if read {
            (&chain.writable, 0)
        } else {
            (&chain.readable, REQ_HEADER_LEN as u64)
        };
        // Every buffer was checked against guest memory, with the permission its direction
        // needs, by the chain walker; and every piece is mapped before the first byte moves.
        self.map_stream(mem, (segs, start, len, dir), req, batch)?;
        let bufs = match self.device_pieces(mem, req) {
            Ok(bufs) => bufs,
            Err(e) => {
                if let Err(u) = self.unmap_all(mem, req, false, batch) {
                    self.metrics.count_error(&u);
                }
                return Err(e);
            }
        };
        req.expected = len;
        let op = if read {
            req.kind = RequestType::In;
            req.written = len;
            IoOp::Read { offset, bufs }
        } else {
            req.kind = RequestType::Out;
            IoOp::Write {
                offset,
                bufs,
                fua: !self.write_cache(),
            }
        };
        Ok(Planned::Io(op))
    }

    /// Where the device sees the request's mappings: the pieces the engine moves the bytes
    /// of, while the mappings stay in the request.
    fn device_pieces<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        req: &Request<R>,
    ) -> Result<IoBufs> {
        let mut bufs = IoBufs::new();
        for b in &req.maps {
            self.dma
                .device_pieces(mem, b, |ptr, len| bufs.push(IoBuf::new(ptr, len)))?;
        }
        Ok(bufs)
    }

    /// Maps `start..start + len` of a stream in `dir` into `req`, in pieces of at most
    /// `max_map` bytes, in one call of `batch` (which releases what it unmapped first). On
    /// error everything mapped so far is unmapped.
    fn map_stream<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        (segs, start, len, dir): (&[Seg], u64, u64, Direction),
        req: &mut Request<R>,
        batch: &mut DmaBatch<'_>,
    ) -> Result<()> {
        req.maps.clear();
        let mut pieces: SmallVec<[GuestBuf; 4]> = SmallVec::new();
        let listed = for_each_piece(segs, start, len, self.max_map as u64, |addr, n| {
            pieces.push((addr, n, dir));
            Ok::<(), BlockError>(())
        });
        let maps = &mut req.maps;
        let r = batch
            .map(mem, &pieces, RangeCheck::Prevalidated, |b| maps.push(b))
            .map_err(BlockError::from)
            .and(listed);
        if r.is_err() {
            // The map error is what the request reports; a failing unmap is counted too.
            // Nothing was transferred: nothing may be copied back.
            if let Err(e) = self.unmap_all(mem, req, false, batch) {
                self.metrics.count_error(&e);
            }
        }
        r
    }

    /// Unmaps every data mapping of `req` through `batch` (released with its next allocator
    /// call); the first error is returned. Unless `transferred`
    /// (the whole I/O succeeded), nothing is copied back to the guest: after a failed or
    /// short read only the guest's own bytes stay in its buffers, never stale pool contents.
    pub(super) fn unmap_all<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        req: &mut Request<R>,
        transferred: bool,
        batch: &mut DmaBatch<'_>,
    ) -> Result<()> {
        let mut first = Ok(());
        for b in req.maps.drain(..) {
            let r = if transferred {
                batch.unmap(mem, b)
            } else {
                batch.unmap_written(mem, b, 0)
            };
            if let Err(e) = r {
                if first.is_ok() {
                    first = Err(e.into());
                }
            }
        }
        first
    }

    /// Reads and checks the segments of a DISCARD or WRITE_ZEROES request (the `payload`
    /// bytes after the header) into the ranges of its host op.
    fn ranges_op<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        chain: &Chain,
        payload: u64,
        zeroes: bool,
    ) -> Result<IoOp> {
        let max_seg = if zeroes {
            self.params.max_write_zeroes_seg
        } else {
            self.params.max_discard_seg
        };
        if payload == 0 || payload % DISCARD_SEG_LEN as u64 != 0 {
            return Err(BlockError::BadChain("discard payload not a multiple of 16"));
        }
        let nseg = payload / DISCARD_SEG_LEN as u64;
        if nseg > u64::from(max_seg).min(MAX_DISCARD_SEGS as u64) {
            return Err(BlockError::Limits("too many segments"));
        }
        // nseg <= MAX_DISCARD_SEGS, so this fits the stack buffer.
        let bytes = nseg as usize * DISCARD_SEG_LEN;
        let mut raw = [0u8; MAX_DISCARD_SEGS * DISCARD_SEG_LEN];
        chain::copy_from(
            &self.dma,
            mem,
            self.worker,
            &chain.readable,
            REQ_HEADER_LEN as u64,
            &mut raw[..bytes],
        )?;
        // Validate every segment before touching the disk.
        let mut ranges = Vec::with_capacity(nseg as usize);
        for chunk in raw[..bytes].chunks_exact(DISCARD_SEG_LEN) {
            if let Some(r) = self.segment(chunk, zeroes)? {
                ranges.push(r);
            }
        }
        let fua = !self.write_cache();
        Ok(if zeroes {
            IoOp::WriteZeroes { ranges, fua }
        } else {
            IoOp::Discard { ranges, fua }
        })
    }

    /// One 16-byte discard / write-zeroes segment (sector, sectors, flags), checked; `None`
    /// for an empty one.
    fn segment(&self, chunk: &[u8], zeroes: bool) -> Result<Option<Range>> {
        let field = |at: usize, n: usize| {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&chunk[at..at + n]);
            u64::from_le_bytes(b)
        };
        let sector = field(0, 8);
        // Four-byte fields: they fit a u32.
        let num = field(8, 4) as u32;
        let flags = field(12, 4) as u32;
        let unmap = flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
        // virtio 1.2, 5.2.6.2: unmap on a discard, or any reserved flag, is UNSUPP.
        if flags & !VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 || (!zeroes && unmap) {
            let t = if zeroes {
                VIRTIO_BLK_T_WRITE_ZEROES
            } else {
                VIRTIO_BLK_T_DISCARD
            };
            return Err(BlockError::Unsupported(t));
        }
        let max_sectors = if zeroes {
            self.params.max_write_zeroes_sectors
        } else {
            self.params.max_discard_sectors
        };
        if num > max_sectors {
            return Err(BlockError::Limits("segment larger than the maximum"));
        }
        let len = u64::from(num) << SECTOR_SHIFT;
        self.check_range(sector, len)?;
        let offset = byte_offset(sector)?;
        Ok((len != 0).then_some(Range {
            offset,
            len,
            unmap: unmap && self.params.may_unmap,
        }))
    }

    /// Checks `sector..sector + len/512` against the capacity.
    fn check_range(&self, sector: u64, len: u64) -> Result<()> {
        let sectors = len.div_ceil(SECTOR_SIZE);
        match sector.checked_add(sectors) {
            Some(end) if end <= self.params.capacity => Ok(()),
            _ => Err(BlockError::OutOfRange {
                sector,
                sectors,
                capacity: self.params.capacity,
            }),
        }
    }
}

/// The byte offset of `sector`.
fn byte_offset(sector: u64) -> Result<u64> {
    sector
        .checked_mul(SECTOR_SIZE)
        .ok_or(BlockError::OutOfRange {
            sector,
            sectors: 0,
            capacity: 0,
        })
}
