//! The header and what it asks for: the request type, checked against the chain's layout,
//! the negotiated features and the disk's switches.

use std::mem::offset_of;

use bounce::{Direction, DmaBatch, DmaBuffer, GuestBuf, RangeCheck};
use smallvec::SmallVec;
use vm_memory::GuestMemory;

use super::RequestCtx;
use crate::block::{BlockError, Result, ID_BYTES, REQ_HEADER_LEN};
use crate::virtio::chain::{self, Chain, CopyError};
use crate::virtio::spec::{
    virtio_blk_outhdr, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};

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
            VIRTIO_BLK_T_IN => Self::In,
            VIRTIO_BLK_T_OUT => Self::Out,
            VIRTIO_BLK_T_FLUSH => Self::Flush,
            VIRTIO_BLK_T_GET_ID => Self::GetId,
            VIRTIO_BLK_T_DISCARD => Self::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => Self::WriteZeroes,
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

impl From<RequestType> for u32 {
    fn from(t: RequestType) -> Self {
        match t {
            RequestType::In => VIRTIO_BLK_T_IN,
            RequestType::Out => VIRTIO_BLK_T_OUT,
            RequestType::Flush => VIRTIO_BLK_T_FLUSH,
            RequestType::GetId => VIRTIO_BLK_T_GET_ID,
            RequestType::Discard => VIRTIO_BLK_T_DISCARD,
            RequestType::WriteZeroes => VIRTIO_BLK_T_WRITE_ZEROES,
            RequestType::Unsupported(t) => t,
        }
    }
}

/// Where the header's fields are (`struct virtio_blk_outhdr`, little endian).
const TYPE_AT: usize = offset_of!(virtio_blk_outhdr, type_);
const SECTOR_AT: usize = offset_of!(virtio_blk_outhdr, sector);

impl RequestHeader {
    /// Parses the 16 header bytes (little endian: type, reserved, sector).
    pub fn parse(bytes: &[u8; REQ_HEADER_LEN]) -> Self {
        let mut t = [0u8; 4];
        t.copy_from_slice(&bytes[TYPE_AT..TYPE_AT + 4]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&bytes[SECTOR_AT..SECTOR_AT + 8]);
        Self {
            kind: RequestType::from(u32::from_le_bytes(t)),
            sector: u64::from_le_bytes(s),
        }
    }

    /// The 16 header bytes a driver writes for a request of raw type `kind` (any value, so a
    /// test can send a type the device does not know) at `sector`: what [`Self::parse`] reads.
    pub fn encode(kind: u32, sector: u64) -> [u8; REQ_HEADER_LEN] {
        let mut h = [0u8; REQ_HEADER_LEN];
        h[TYPE_AT..TYPE_AT + 4].copy_from_slice(&kind.to_le_bytes());
        h[SECTOR_AT..SECTOR_AT + 8].copy_from_slice(&sector.to_le_bytes());
        h
    }

    /// This header's 16 bytes.
    pub fn to_bytes(&self) -> [u8; REQ_HEADER_LEN] {
        Self::encode(self.kind.into(), self.sector)
    }
}

/// A request whose header was read and whose layout fits its type: what [`super::plan`]
/// turns into mappings and host I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    /// Move `len` bytes between the disk at `sector` and the data buffers, in `dir`.
    Data {
        sector: u64,
        len: u64,
        dir: Direction,
    },
    /// Flush the write cache.
    Flush,
    /// Answer the id string into the first `len` device-writable bytes.
    GetId { len: usize },
    /// Discard (or, with `zeroes`, write zeroes to) the segments in the `payload` bytes after
    /// the header.
    Ranges { payload: u64, zeroes: bool },
}

/// The header's pieces as a request's first allocator call mapped them (after its status
/// byte), and the failure that stopped the mapping, if one did.
#[derive(Debug)]
pub(super) struct HeadMaps {
    maps: SmallVec<[DmaBuffer; 4]>,
    failed: Option<BlockError>,
}

/// The guest buffers of a request's first allocator call.
type HeadBufs = SmallVec<[GuestBuf; 4]>;

impl RequestCtx {
    /// Maps the status byte at `status_addr` and, with `header`, the pieces of the request
    /// header after it, in one call of `batch`: the status mapping (or why it failed) and,
    /// when the status was mapped and `header` asked for, the header's mappings.
    pub(super) fn map_head<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        chain: &Chain,
        status_addr: u64,
        header: bool,
        batch: &mut DmaBatch<'_>,
    ) -> (bounce::Result<DmaBuffer>, Option<HeadMaps>) {
        let mut bufs: HeadBufs = SmallVec::new();
        bufs.push((status_addr, 1, Direction::FromDevice));
        let listed = if header {
            header_bufs(chain, &mut bufs)
        } else {
            Ok(())
        };
        let mut status = None;
        let mut maps = SmallVec::new();
        let mapped = batch.map(mem, &bufs, RangeCheck::Prevalidated, |b| match status {
            None => status = Some(b),
            Some(_) => maps.push(b),
        });
        match (status, mapped) {
            (Some(b), r) => {
                let failed = r.err().map(BlockError::from).or(listed.err());
                (Ok(b), header.then_some(HeadMaps { maps, failed }))
            }
            (None, Err(e)) => (Err(e), None),
            // A batch maps every buffer or reports a failure: not reached.
            (None, Ok(())) => (Err(bounce::Error::NotMapped { addr: status_addr }), None),
        }
    }

    /// Maps the request header's pieces on their own (after a failed status map) and reads
    /// it.
    pub(super) fn read_header<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        chain: &Chain,
        batch: &mut DmaBatch<'_>,
    ) -> Result<[u8; REQ_HEADER_LEN]> {
        let mut bufs = HeadBufs::new();
        let listed = header_bufs(chain, &mut bufs);
        let mut maps = SmallVec::new();
        let mapped = batch.map(mem, &bufs, RangeCheck::Prevalidated, |b| maps.push(b));
        let failed = mapped.err().map(BlockError::from).or(listed.err());
        self.read_head(mem, HeadMaps { maps, failed }, batch)
    }

    /// Reads the header from its mappings and unmaps them through `batch` (released with its
    /// next allocator call).
    pub(super) fn read_head<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        head: HeadMaps,
        batch: &mut DmaBatch<'_>,
    ) -> Result<[u8; REQ_HEADER_LEN]> {
        let mut hdr = [0u8; REQ_HEADER_LEN];
        let mut done = 0;
        let mut r = Ok(());
        for b in head.maps {
            let n = b.len();
            if r.is_ok() {
                r = match hdr.get_mut(done..done + n) {
                    Some(dst) => self.dma.read(mem, &b, 0, dst).map_err(BlockError::from),
                    None => Err(BlockError::BadChain("request header pieces overrun")),
                };
            }
            done += n;
            if let Err(e) = batch.unmap(mem, b) {
                r = r.and(Err(e.into()));
            }
        }
        r?;
        match head.failed {
            Some(e) => Err(e),
            None => Ok(hdr),
        }
    }

    /// Counts the request by the type in its header `bytes` (as read, or why they could not
    /// be) and checks its data lengths, directions and feature against its type.
    pub(super) fn parse(
        &self,
        chain: &Chain,
        bytes: Result<[u8; REQ_HEADER_LEN]>,
    ) -> Result<Parsed> {
        if chain.readable_len < REQ_HEADER_LEN as u64 {
            return Err(BlockError::BadChain("request header shorter than 16 bytes"));
        }
        let hdr = RequestHeader::parse(&bytes?);
        // Bytes after the header (device-readable) and before the status (device-writable).
        let out_len = chain.readable_len - REQ_HEADER_LEN as u64;
        let in_len = chain.writable_len - 1;
        let m = &self.metrics;
        let p = &self.params;
        let (sector, kind) = (hdr.sector, hdr.kind);
        let refuse = |what| Err(BlockError::BadChain(what));
        match kind {
            RequestType::In => {
                m.reqs_in.inc();
                if out_len != 0 {
                    return refuse("device-readable data in a read");
                }
                Ok(Parsed::Data {
                    sector,
                    len: in_len,
                    dir: Direction::FromDevice,
                })
            }
            RequestType::Out => {
                m.reqs_out.inc();
                if in_len != 0 {
                    return refuse("device-writable data in a write");
                }
                if p.readonly {
                    return Err(BlockError::ReadOnly);
                }
                Ok(Parsed::Data {
                    sector,
                    len: out_len,
                    dir: Direction::ToDevice,
                })
            }
            RequestType::Flush => {
                m.reqs_flush.inc();
                if out_len != 0 || in_len != 0 {
                    return refuse("data buffers in a flush");
                }
                Ok(Parsed::Flush)
            }
            RequestType::GetId => {
                m.reqs_get_id.inc();
                if out_len != 0 {
                    return refuse("device-readable data in GET_ID");
                }
                let len = usize::try_from(in_len.min(ID_BYTES as u64)).unwrap_or(ID_BYTES);
                Ok(Parsed::GetId { len })
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                self.parse_ranges(kind == RequestType::WriteZeroes, out_len, in_len)
            }
            RequestType::Unsupported(t) => {
                m.reqs_unsupported.inc();
                Err(BlockError::Unsupported(t))
            }
        }
    }

    /// The checks of a DISCARD or WRITE_ZEROES request before its segments are read.
    fn parse_ranges(&self, zeroes: bool, out_len: u64, in_len: u64) -> Result<Parsed> {
        let (negotiated, t) = if zeroes {
            self.metrics.reqs_write_zeroes.inc();
            (self.params.write_zeroes, VIRTIO_BLK_T_WRITE_ZEROES)
        } else {
            self.metrics.reqs_discard.inc();
            (self.params.discard, VIRTIO_BLK_T_DISCARD)
        };
        if !negotiated {
            return Err(BlockError::Unsupported(t));
        }
        if in_len != 0 {
            return Err(BlockError::BadChain("device-writable data in a discard"));
        }
        if self.params.readonly {
            return Err(BlockError::ReadOnly);
        }
        Ok(Parsed::Ranges {
            payload: out_len,
            zeroes,
        })
    }
}

/// Appends the pieces of the request header (the first 16 readable bytes) to `bufs`, as
/// device reads.
fn header_bufs(chain: &Chain, bufs: &mut HeadBufs) -> Result<()> {
    chain::for_each_piece(
        &chain.readable,
        0,
        REQ_HEADER_LEN as u64,
        u64::MAX,
        |addr, n| {
            bufs.push((addr, n, Direction::ToDevice));
            Ok::<(), CopyError>(())
        },
    )
    .map_err(BlockError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_headers_parse_back() {
        for kind in [
            RequestType::In,
            RequestType::Out,
            RequestType::Flush,
            RequestType::GetId,
            RequestType::Discard,
            RequestType::WriteZeroes,
            RequestType::Unsupported(0xdead_beef),
        ] {
            for sector in [0, 1, 0x0123_4567_89ab_cdef, u64::MAX] {
                let h = RequestHeader { kind, sector };
                assert_eq!(RequestHeader::parse(&h.to_bytes()), h);
            }
        }
    }

    #[test]
    fn the_encoding_is_the_wire_layout() {
        let h = RequestHeader::encode(VIRTIO_BLK_T_OUT, 0x0102_0304_0506_0708);
        assert_eq!(
            h,
            [1, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1],
            "type, reserved, sector; little endian"
        );
    }
}
