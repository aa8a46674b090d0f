//! The DMA handle devices use: direct or bounced, per a policy.
//!
//! A device never touches guest memory for its data buffers except through a [`Dma`]: it maps a
//! guest buffer ([`Dma::map`]), reads or writes the device-visible buffer ([`Dma::read`],
//! [`Dma::write`], [`Dma::read_to`], [`Dma::write_from`]), and unmaps it ([`Dma::unmap`]). With
//! policy `off` the device-visible buffer *is* the guest buffer; with `force` it is a bounce
//! pool buffer; with `mask=BITS` only guest buffers that end above the DMA mask are bounced, as
//! for a device that can address only `BITS` bits.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::bitmap::{Bitmap, BitmapSlice};
use vm_memory::{
    GuestAddress, GuestMemory, Permissions, ReadVolatile, VolatileSlice, WriteVolatile,
};

use crate::attribution::{DmaCounters, DmaStats};
use crate::error::{Error, Result};
use crate::pool::{BouncePool, Mapping};
use crate::stats::PoolStats;
use crate::types::{Direction, DmaAttrs, MapRequest, RangeCheck, SyncFor};
use crate::DEFAULT_SEG_BOUNDARY_MASK;

mod batch;

pub use batch::{DmaBatch, GuestBuf};

/// When a device's buffers are bounced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Never: the device accesses guest memory directly.
    Off,
    /// Always: every buffer goes through the bounce pool.
    Force,
    /// Only buffers that end above `2^bits - 1` (a device with a `bits`-bit DMA mask).
    Mask(u8),
}

impl Policy {
    /// True when a buffer `gpa..gpa + len` must be bounced under this policy.
    pub fn needs_bounce(self, gpa: u64, len: usize) -> bool {
        match self {
            Self::Off => false,
            Self::Force => true,
            Self::Mask(bits) => {
                let mask = if bits >= 64 {
                    u64::MAX
                } else {
                    (1u64 << bits) - 1
                };
                let last = gpa.saturating_add((len as u64).saturating_sub(1));
                last > mask
            }
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Force => f.write_str("force"),
            Self::Mask(b) => write!(f, "mask={b}"),
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Self::Off),
            "force" => Ok(Self::Force),
            _ => {
                let bits = s
                    .strip_prefix("mask=")
                    .and_then(|b| b.parse::<u8>().ok())
                    .filter(|b| (1..=64).contains(b))
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "unknown policy '{s}' (expected off, force or mask=BITS with BITS 1-64)"
                        ))
                    })?;
                Ok(Self::Mask(bits))
            }
        }
    }
}

/// A device's DMA constraints (Linux `min_align_mask`, `segment_boundary_mask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDmaParams {
    /// Address bits a bounce buffer must share with the original.
    pub min_align_mask: u64,
    /// Segment boundary mask.
    pub seg_boundary_mask: u64,
}

impl Default for DeviceDmaParams {
    fn default() -> Self {
        Self {
            min_align_mask: 0,
            seg_boundary_mask: DEFAULT_SEG_BOUNDARY_MASK,
        }
    }
}

/// A mapped buffer: what [`Dma::map`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaBuffer {
    gpa: u64,
    len: usize,
    dir: Direction,
    bounce: Option<Mapping>,
}

impl DmaBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer (which [`Dma::map`] never returns).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The guest address this buffer shadows.
    pub fn guest_addr(&self) -> u64 {
        self.gpa
    }

    /// The device-visible address (the guest address when not bounced).
    pub fn dev_addr(&self) -> u64 {
        self.bounce.map_or(self.gpa, |m| m.dev_addr)
    }

    /// Direction of the mapping.
    pub fn dir(&self) -> Direction {
        self.dir
    }

    /// True when the buffer is bounced.
    pub fn is_bounced(&self) -> bool {
        self.bounce.is_some()
    }
}

/// A device's DMA handle: a policy, a pool when the policy may bounce, and the device's own
/// counters when it has them ([`Dma::with_counters`]).
///
/// Cheap to clone (the pool and the counters are shared).
#[derive(Clone, Debug)]
pub struct Dma {
    policy: Policy,
    pool: Option<Arc<BouncePool>>,
    params: DeviceDmaParams,
    counters: Option<Arc<DmaCounters>>,
}

impl Dma {
    /// Direct access, no pool.
    pub fn direct() -> Self {
        Self {
            policy: Policy::Off,
            pool: None,
            params: DeviceDmaParams::default(),
            counters: None,
        }
    }

    /// A handle that bounces per `policy` through `pool`.
    pub fn bounced(policy: Policy, pool: Arc<BouncePool>) -> Self {
        Self {
            policy,
            pool: Some(pool),
            params: DeviceDmaParams::default(),
            counters: None,
        }
    }

    /// Sets the device's DMA constraints.
    pub fn with_params(mut self, params: DeviceDmaParams) -> Self {
        self.params = params;
        self
    }

    /// Counts this device's maps and unmaps in `counters` ([`crate::attribution`]): what
    /// the device costs a pool it shares with others.
    pub fn with_counters(mut self, counters: Arc<DmaCounters>) -> Self {
        self.counters = Some(counters);
        self
    }

    /// The device's own counters, if it has them.
    pub fn dma_stats(&self) -> Option<DmaStats> {
        self.counters.as_ref().map(|c| c.snapshot())
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The pool, if any.
    pub fn pool(&self) -> Option<&Arc<BouncePool>> {
        self.pool.as_ref()
    }

    /// The largest single buffer this handle can map, for the device's DMA constraints
    /// ([`DeviceDmaParams::min_align_mask`] costs slots of padding); `None` when it never
    /// bounces (no pool), so only the device's own limits apply.
    pub fn max_mapping_size(&self) -> Option<usize> {
        self.pool
            .as_ref()
            .map(|p| p.max_mapping_size(self.params.min_align_mask))
    }

    /// The device's DMA constraints.
    pub fn params(&self) -> DeviceDmaParams {
        self.params
    }

    /// Pool statistics, if there is a pool.
    pub fn stats(&self) -> Option<PoolStats> {
        self.pool.as_ref().map(|p| p.stats())
    }

    /// Maps guest buffer `gpa..gpa + len` for a transfer in `dir` on behalf of `worker`.
    ///
    /// With [`RangeCheck::Here`] the whole guest range is checked first (readable, and
    /// writable when the device writes): the one check of the range on this path (a bounced
    /// map does not check it again in [`BouncePool::map`]). With [`RangeCheck::Prevalidated`]
    /// the caller has checked it (the buffers of a walked descriptor chain) and nothing is
    /// checked again; a range that is not guest memory after all still fails safely, with
    /// [`Error::OrigAccess`] from the copy (bounced) or the transfer (direct).
    ///
    /// # Errors
    /// [`Error::ZeroLength`], [`Error::OrigAccess`] (not guest memory), and every error of
    /// [`BouncePool::map`] when bouncing ([`Error::PoolFull`] among them).
    pub fn map<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        gpa: u64,
        len: usize,
        dir: Direction,
        worker: usize,
        check: RangeCheck,
    ) -> Result<DmaBuffer> {
        let bounce = match (
            self.checked_request(mem, (gpa, len, dir), worker, check)?,
            &self.pool,
        ) {
            // The range was checked by `checked_request` or by the caller: the pool does not
            // again.
            (Some(req), Some(pool)) => {
                let r = pool.map_prevalidated(mem, &req);
                self.count_map(len, &r);
                Some(r?)
            }
            _ => None,
        };
        Ok(DmaBuffer {
            gpa,
            len,
            dir,
            bounce,
        })
    }

    /// Every check of a map before the pool's: the length and (unless the caller did) the
    /// guest range; then the pool request when the buffer is bounced, `None` when it is
    /// accessed directly.
    fn checked_request<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        (gpa, len, dir): GuestBuf,
        worker: usize,
        check: RangeCheck,
    ) -> Result<Option<MapRequest>> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        let perm = if dir.device_writes() {
            Permissions::ReadWrite
        } else {
            Permissions::Read
        };
        if check == RangeCheck::Here && !mem.check_range(GuestAddress(gpa), len, perm) {
            return Err(Error::OrigAccess { addr: gpa, len });
        }
        if self.pool.is_none() || !self.policy.needs_bounce(gpa, len) {
            return Ok(None);
        }
        Ok(Some(MapRequest {
            orig: gpa,
            size: len,
            dir,
            attrs: DmaAttrs::default(),
            min_align_mask: self.params.min_align_mask,
            alloc_align_mask: 0,
            seg_boundary_mask: self.params.seg_boundary_mask,
            worker,
        }))
    }

    /// Unmaps: copies back to guest memory when the device may have written and releases the
    /// bounce slots. A direct buffer needs nothing.
    ///
    /// # Errors
    /// Those of [`BouncePool::unmap`].
    pub fn unmap<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        buf: DmaBuffer,
        worker: usize,
    ) -> Result<()> {
        match (&buf.bounce, &self.pool) {
            (Some(m), Some(pool)) => {
                let r = pool.unmap(mem, m, worker);
                self.count_unmap(&r);
                r
            }
            _ => Ok(()),
        }
    }

    /// Counts the outcome of one bounced map of `len` bytes.
    fn count_map<T>(&self, len: usize, r: &Result<T>) {
        let maps = u64::from(r.is_ok());
        self.count_maps(maps, maps * len as u64, r);
    }

    fn count_maps<T>(&self, maps: u64, bytes: u64, r: &Result<T>) {
        if let Some(c) = &self.counters {
            c.count_maps(maps, bytes, r);
        }
    }

    fn count_unmap(&self, r: &Result<()>) {
        if let Some(c) = &self.counters {
            c.count_unmap(r);
        }
    }

    /// A small device read of guest bytes `gpa..gpa + dst.len()` (a request header, a
    /// command): map to-device, read, unmap, in one call. The one helper for transfers too
    /// small to keep a mapping for; `check` as for [`Dma::map`].
    ///
    /// # Errors
    /// Those of [`Dma::map`], [`Dma::read`] and [`Dma::unmap`]; the mapping is released
    /// whatever happens.
    pub fn read_guest<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        gpa: u64,
        dst: &mut [u8],
        worker: usize,
        check: RangeCheck,
    ) -> Result<()> {
        let buf = self.map(mem, gpa, dst.len(), Direction::ToDevice, worker, check)?;
        let read = self.read(mem, &buf, 0, dst);
        let unmapped = self.unmap(mem, buf, worker);
        read.and(unmapped)
    }

    /// A small device write of `src` to guest address `gpa` (a status byte, an ack, an id
    /// string): map from-device, write, unmap, in one call; `check` as for [`Dma::map`].
    ///
    /// # Errors
    /// As [`Dma::read_guest`].
    pub fn write_guest<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        gpa: u64,
        src: &[u8],
        worker: usize,
        check: RangeCheck,
    ) -> Result<()> {
        let buf = self.map(mem, gpa, src.len(), Direction::FromDevice, worker, check)?;
        let wrote = self.write(mem, &buf, 0, src);
        let unmapped = self.unmap(mem, buf, worker);
        wrote.and(unmapped)
    }

    /// Writes `src` straight to guest memory at `gpa`, bypassing the pool whatever the
    /// policy. Only for the one byte that reports a failure (a virtio-blk status) when the
    /// pool is too full to map it: without it the driver would read a stale "OK".
    ///
    /// # Errors
    /// [`Error::ZeroLength`], or [`Error::OrigAccess`] when the range is not writable guest
    /// memory (nothing is written then).
    pub fn write_direct<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        gpa: u64,
        src: &[u8],
    ) -> Result<()> {
        if src.is_empty() {
            return Err(Error::ZeroLength);
        }
        let err = || Error::OrigAccess {
            addr: gpa,
            len: src.len(),
        };
        if !mem.check_range(GuestAddress(gpa), src.len(), Permissions::Write) {
            return Err(err());
        }
        let mut done = 0;
        for s in mem
            .get_slices(GuestAddress(gpa), src.len(), Permissions::Write)
            .map_err(|_| err())?
        {
            let s = s.map_err(|_| err())?;
            s.copy_from(&src[done..done + s.len()]);
            done += s.len();
        }
        Ok(())
    }

    /// Unmaps a buffer of which the device wrote only the first `written` bytes (0 after a
    /// failed transfer): only those bytes are copied back to guest memory; the rest of the
    /// guest buffer keeps its contents. Without it, an IOVA-mode pool (no copy-in at map for
    /// device writes) would copy a previous mapping's bytes — another request's, another
    /// client's — into the guest after a failed or short read. A direct buffer needs nothing.
    ///
    /// # Errors
    /// Those of [`BouncePool::sync`] and [`BouncePool::unmap_single`]; the mapping is
    /// released whatever happens.
    pub fn unmap_written<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        buf: DmaBuffer,
        written: usize,
        worker: usize,
    ) -> Result<()> {
        let (Some(m), Some(pool)) = (&buf.bounce, &self.pool) else {
            return Ok(());
        };
        Self::unmap_prefix(pool, mem, &buf, m, written, |attrs| {
            let released = pool.unmap_single(mem, m.dev_addr, m.size, m.dir, attrs, worker);
            self.count_unmap(&released);
            released
        })
    }

    /// The copy back of [`Dma::unmap_written`] (the first `written` bytes of `buf`, bounced
    /// as `m`), then the unmap without a copy, through `unmap(attrs)`.
    fn unmap_prefix<M: GuestMemory + ?Sized>(
        pool: &BouncePool,
        mem: &M,
        buf: &DmaBuffer,
        m: &Mapping,
        written: usize,
        unmap: impl FnOnce(DmaAttrs) -> Result<()>,
    ) -> Result<()> {
        let n = written.min(buf.len);
        let copied = if n > 0 && buf.dir.device_writes() {
            pool.sync(mem, m.dev_addr, n, m.dir, SyncFor::Cpu)
        } else {
            Ok(())
        };
        let released = unmap(DmaAttrs {
            skip_cpu_sync: true,
            ..m.attrs
        });
        copied.and(released)
    }

    fn check(buf: &DmaBuffer, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > buf.len) {
            return Err(Error::OutOfPool {
                addr: buf.dev_addr().wrapping_add(offset as u64),
                len,
            });
        }
        Ok(())
    }

    /// Runs `f` on each device-visible piece of `buf[offset..offset + len]`, in order.
    fn for_each_slice<M, F>(
        &self,
        mem: &M,
        buf: &DmaBuffer,
        offset: usize,
        len: usize,
        device_writes: bool,
        mut f: F,
    ) -> Result<()>
    where
        M: GuestMemory + ?Sized,
        F: FnMut(Piece<'_, '_, M>) -> Result<()>,
    {
        Self::check(buf, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        match (&buf.bounce, &self.pool) {
            (Some(m), Some(pool)) => {
                let s = pool.device_slice(m.dev_addr + offset as u64, len)?;
                f(Piece::Pool(s))
            }
            _ => {
                let addr = buf.gpa + offset as u64;
                let err = || Error::OrigAccess { addr, len };
                let perm = if device_writes {
                    Permissions::Write
                } else {
                    Permissions::Read
                };
                let slices = mem
                    .get_slices(GuestAddress(addr), len, perm)
                    .map_err(|_| err())?;
                for s in slices {
                    f(Piece::Guest(s.map_err(|_| err())?))?;
                }
                Ok(())
            }
        }
    }

    /// Device reads `dst.len()` bytes of the buffer at `offset` (e.g. a request header).
    ///
    /// # Errors
    /// [`Error::OutOfPool`] when the range is outside the buffer; [`Error::OrigAccess`].
    pub fn read<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        buf: &DmaBuffer,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        let mut done = 0;
        self.for_each_slice(mem, buf, offset, dst.len(), false, |p| {
            let n = p.len();
            p.copy_to(&mut dst[done..done + n]);
            done += n;
            Ok(())
        })
    }

    /// Device writes `src` into the buffer at `offset` (e.g. a status byte).
    ///
    /// # Errors
    /// As [`Dma::read`].
    pub fn write<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        buf: &DmaBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()> {
        let mut done = 0;
        self.for_each_slice(mem, buf, offset, src.len(), true, |p| {
            let n = p.len();
            p.copy_from(&src[done..done + n]);
            done += n;
            Ok(())
        })
    }

    /// Calls `f(ptr, len)` for each contiguous host piece where the device sees `buf`, in
    /// order: one piece in the bounce pool, or one per guest memory region the buffer spans.
    /// For I/O that the caller runs later on those addresses (an asynchronous engine, a
    /// vectored `write`), while the mapping lives. When the device writes the buffer, the
    /// pieces of guest memory are marked dirty now (a bounced buffer's guest bytes are
    /// marked when [`Dma::unmap`] copies them back).
    ///
    /// # Errors
    /// [`Error::OrigAccess`] when a direct buffer is not guest memory.
    pub fn device_pieces<M, F>(&self, mem: &M, buf: &DmaBuffer, mut f: F) -> Result<()>
    where
        M: GuestMemory + ?Sized,
        F: FnMut(*mut u8, usize),
    {
        let device_writes = buf.dir.device_writes();
        self.for_each_slice(mem, buf, 0, buf.len, device_writes, |p| {
            let (ptr, len) = p.host_piece();
            if device_writes {
                p.mark_dirty();
            }
            f(ptr, len);
            Ok(())
        })
    }

    /// Device sends `len` bytes of the buffer at `offset` to `sink` (a file, a tap), until
    /// the sink stops taking bytes. Returns the bytes sent.
    ///
    /// # Errors
    /// As [`Dma::read`]; an I/O error of the sink is [`Error::Io`].
    pub fn read_to<M, W>(
        &self,
        mem: &M,
        buf: &DmaBuffer,
        offset: usize,
        len: usize,
        sink: &mut W,
    ) -> Result<usize>
    where
        M: GuestMemory + ?Sized,
        W: WriteVolatile,
    {
        let mut moved = Streamed::default();
        self.for_each_slice(mem, buf, offset, len, false, |p| {
            moved.piece(p.len(), || p.write_all_to(sink))
        })?;
        Ok(moved.done)
    }

    /// Device fills `len` bytes of the buffer at `offset` from `source` (a file, a tap),
    /// until the source has no more. Returns the bytes filled.
    ///
    /// # Errors
    /// As [`Dma::read_to`].
    pub fn write_from<M, R>(
        &self,
        mem: &M,
        buf: &DmaBuffer,
        offset: usize,
        len: usize,
        source: &mut R,
    ) -> Result<usize>
    where
        M: GuestMemory + ?Sized,
        R: ReadVolatile,
    {
        let mut moved = Streamed::default();
        self.for_each_slice(mem, buf, offset, len, true, |p| {
            moved.piece(p.len(), || p.read_all_from(source))
        })?;
        Ok(moved.done)
    }
}

/// The progress of [`Dma::read_to`] or [`Dma::write_from`]: the bytes moved so far, and
/// whether a piece came up short (the sink or source had no more), which ends the transfer.
#[derive(Default)]
struct Streamed {
    done: usize,
    short: bool,
}

impl Streamed {
    /// Moves the next piece, of `len` bytes, with `io` (which returns the bytes it moved),
    /// unless an earlier piece came up short.
    fn piece(&mut self, len: usize, io: impl FnOnce() -> Result<usize>) -> Result<()> {
        if !self.short {
            let n = io()?;
            self.done += n;
            self.short = n < len;
        }
        Ok(())
    }
}

/// One contiguous device-visible piece of a buffer.
enum Piece<'a, 'b, M: GuestMemory + ?Sized + 'b> {
    Pool(VolatileSlice<'a>),
    Guest(VolatileSlice<'b, vm_memory::bitmap::BS<'b, M::Bitmap>>),
}

impl<M: GuestMemory + ?Sized> Piece<'_, '_, M> {
    fn len(&self) -> usize {
        match self {
            Self::Pool(s) => s.len(),
            Self::Guest(s) => s.len(),
        }
    }

    fn copy_to(&self, dst: &mut [u8]) {
        match self {
            Self::Pool(s) => {
                s.copy_to(dst);
            }
            Self::Guest(s) => {
                s.copy_to(dst);
            }
        }
    }

    fn copy_from(&self, src: &[u8]) {
        match self {
            Self::Pool(s) => s.copy_from(src),
            Self::Guest(s) => s.copy_from(src),
        }
    }

    fn host_piece(&self) -> (*mut u8, usize) {
        match self {
            Self::Pool(s) => (s.ptr_guard_mut().as_ptr(), s.len()),
            Self::Guest(s) => (s.ptr_guard_mut().as_ptr(), s.len()),
        }
    }

    fn mark_dirty(&self) {
        if let Self::Guest(s) = self {
            s.bitmap().mark_dirty(0, s.len());
        }
    }

    fn write_all_to<W: WriteVolatile>(&self, sink: &mut W) -> Result<usize> {
        match self {
            Self::Pool(s) => write_slice(s, sink),
            Self::Guest(s) => write_slice(s, sink),
        }
    }

    fn read_all_from<R: ReadVolatile>(&self, source: &mut R) -> Result<usize> {
        match self {
            Self::Pool(s) => read_slice(s, source),
            Self::Guest(s) => read_slice(s, source),
        }
    }
}

fn write_slice<B: BitmapSlice, W: WriteVolatile>(
    s: &VolatileSlice<'_, B>,
    sink: &mut W,
) -> Result<usize> {
    pump(s, |part| sink.write_volatile(part))
}

fn read_slice<B: BitmapSlice, R: ReadVolatile>(
    s: &VolatileSlice<'_, B>,
    source: &mut R,
) -> Result<usize> {
    pump(s, |part| source.read_volatile(part))
}

/// Runs `io` on the rest of `s` until all of it is moved or `io` moves nothing (end of file,
/// a full sink); returns the bytes moved.
fn pump<'a, B: BitmapSlice>(
    s: &VolatileSlice<'a, B>,
    mut io: impl FnMut(
        &mut VolatileSlice<'a, B>,
    ) -> std::result::Result<usize, vm_memory::VolatileMemoryError>,
) -> Result<usize> {
    let mut done = 0;
    while done < s.len() {
        let mut part = s.offset(done).map_err(|e| Error::Io(e.to_string()))?;
        match io(&mut part) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) => return Err(Error::Io(e.to_string())),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::PoolConfig;
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryMmap};

    #[test]
    fn policies_parse_and_decide() {
        assert_eq!("off".parse::<Policy>().unwrap(), Policy::Off);
        assert_eq!("force".parse::<Policy>().unwrap(), Policy::Force);
        assert_eq!("mask=32".parse::<Policy>().unwrap(), Policy::Mask(32));
        for bad in ["mask=0", "mask=65", "mask=", "sometimes", ""] {
            assert!(bad.parse::<Policy>().is_err(), "{bad}");
        }
        assert!(!Policy::Off.needs_bounce(u64::MAX - 10, 4));
        assert!(Policy::Force.needs_bounce(0, 1));
        let m32 = Policy::Mask(32);
        assert!(
            !m32.needs_bounce(0xffff_f000, 0x1000),
            "ends exactly at the mask"
        );
        assert!(
            m32.needs_bounce(0xffff_f000, 0x1001),
            "one byte above the mask"
        );
        assert!(m32.needs_bounce(0x1_0000_0000, 1));
        assert!(!Policy::Mask(64).needs_bounce(u64::MAX, 1));
        assert_eq!(Policy::Mask(40).to_string(), "mask=40");
    }

    #[test]
    fn map_checks_the_range_once_and_a_prevalidated_map_still_fails_safely() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(64)).unwrap());
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool));
        let outside = 0x10_0000 - 8;
        // `map` refuses a range that leaves guest memory, before the pool is asked.
        assert!(matches!(
            dma.map(&mem, outside, 16, Direction::ToDevice, 0, RangeCheck::Here),
            Err(Error::OrigAccess { addr, len: 16 }) if addr == outside
        ));
        assert_eq!(pool.stats().map_failures, 0);
        // A caller that claims to have checked and did not: the copy-in fails, the slots are
        // given back.
        assert!(matches!(
            dma.map(
                &mem,
                outside,
                16,
                Direction::ToDevice,
                0,
                RangeCheck::Prevalidated
            ),
            Err(Error::OrigAccess { .. })
        ));
        assert!(matches!(
            dma.read_guest(&mem, outside, &mut [0u8; 16], 0, RangeCheck::Prevalidated),
            Err(Error::OrigAccess { .. })
        ));
        // Direct (no pool): the transfer fails instead.
        let direct = Dma::direct();
        let b = direct
            .map(
                &mem,
                outside,
                16,
                Direction::FromDevice,
                0,
                RangeCheck::Prevalidated,
            )
            .unwrap();
        assert!(matches!(
            direct.write(&mem, &b, 0, &[1; 16]),
            Err(Error::OrigAccess { .. })
        ));
        assert_eq!(pool.stats().used, 0, "no slot leaked");
        // Checked ranges inside memory work as with `map`.
        dma.write_guest(&mem, 0x1000, &[7; 4], 0, RangeCheck::Prevalidated)
            .unwrap();
        let mut got = [0u8; 4];
        dma.read_guest(&mem, 0x1000, &mut got, 0, RangeCheck::Prevalidated)
            .unwrap();
        assert_eq!(got, [7; 4]);
    }

    #[test]
    fn unmap_written_copies_back_only_the_written_prefix() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let pool = Arc::new(BouncePool::new(&PoolConfig::iova(64)).unwrap());
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool));
        mem.write_slice(&[0xaa; 4096], GuestAddress(0x8000))
            .unwrap();
        let map = || {
            dma.map(
                &mem,
                0x8000,
                4096,
                Direction::FromDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap()
        };
        let b = map();
        dma.write(&mem, &b, 0, &[0x11; 4096]).unwrap();
        dma.unmap_written(&mem, b, 100, 0).unwrap();
        let mut got = [0u8; 4096];
        mem.read_slice(&mut got, GuestAddress(0x8000)).unwrap();
        assert!(got[..100].iter().all(|&x| x == 0x11));
        assert!(
            got[100..].iter().all(|&x| x == 0xaa),
            "unwritten bytes copied back"
        );
        // Nothing written: nothing copied; the slots are released either way.
        let b = map();
        dma.write(&mem, &b, 0, &[0x22; 4096]).unwrap();
        dma.unmap_written(&mem, b, 0, 0).unwrap();
        mem.read_slice(&mut got, GuestAddress(0x8000)).unwrap();
        assert_eq!(got[0], 0x11);
        assert_eq!(pool.used(), 0);
        // write_direct bypasses the pool; read_guest/write_guest round-trip.
        dma.write_direct(&mem, 0x9000, &[7]).unwrap();
        let mut one = [0u8; 1];
        dma.read_guest(&mem, 0x9000, &mut one, 0, RangeCheck::Here)
            .unwrap();
        assert_eq!(one, [7]);
        dma.write_guest(&mem, 0x9001, &[8, 9], 0, RangeCheck::Here)
            .unwrap();
        assert!(dma.write_direct(&mem, 0x10_0000, &[1]).is_err());
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn bounced_copies_translate_once_and_fall_back_across_regions() {
        use vm_memory::bitmap::{AtomicBitmap, Bitmap};
        use vm_memory::GuestMemoryRegion;
        // Two adjacent regions: a buffer inside one is translated once (`OrigMemory` for guest
        // memory), a buffer across the boundary goes through the region walk; both copy the same bytes and mark
        // the same pages dirty.
        let new_mem = || {
            GuestMemoryMmap::<AtomicBitmap>::from_ranges(&[
                (GuestAddress(0), 0x10000),
                (GuestAddress(0x10000), 0x10000),
            ])
            .unwrap()
        };
        let dirty = |mem: &GuestMemoryMmap<AtomicBitmap>, a: u64| {
            let r = mem.find_region(GuestAddress(a)).unwrap();
            r.bitmap().dirty_at((a - r.start_addr().0) as usize)
        };
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(256)).unwrap());
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool));
        for gpa in [0x2000u64, 0x10000 - 0x800] {
            let mem = new_mem();
            let src: Vec<u8> = (0..4096).map(|i| (i * 7 + gpa as usize) as u8).collect();
            mem.write_slice(&src, GuestAddress(gpa)).unwrap();
            let b = dma
                .map(&mem, gpa, 4096, Direction::ToDevice, 0, RangeCheck::Here)
                .unwrap();
            let mut seen = vec![0u8; 4096];
            dma.read(&mem, &b, 0, &mut seen).unwrap();
            assert_eq!(seen, src, "copy in at {gpa:#x}");
            dma.unmap(&mem, b, 0).unwrap();
            // A device write is copied back and marks its pages dirty.
            let mem = new_mem();
            assert!(!dirty(&mem, gpa) && !dirty(&mem, gpa + 4095));
            let b = dma
                .map(&mem, gpa, 4096, Direction::FromDevice, 0, RangeCheck::Here)
                .unwrap();
            dma.write(&mem, &b, 0, &[0x5a; 4096]).unwrap();
            dma.unmap(&mem, b, 0).unwrap();
            let mut got = vec![0u8; 4096];
            mem.read_slice(&mut got, GuestAddress(gpa)).unwrap();
            assert!(got.iter().all(|&x| x == 0x5a), "copy out at {gpa:#x}");
            assert!(dirty(&mem, gpa) && dirty(&mem, gpa + 4095), "at {gpa:#x}");
            // A prefix written back only: the rest keeps the guest's bytes.
            let b = dma
                .map(&mem, gpa, 4096, Direction::FromDevice, 0, RangeCheck::Here)
                .unwrap();
            dma.write(&mem, &b, 0, &[0x11; 4096]).unwrap();
            dma.unmap_written(&mem, b, 3000, 0).unwrap();
            mem.read_slice(&mut got, GuestAddress(gpa)).unwrap();
            assert!(got[..3000].iter().all(|&x| x == 0x11));
            assert!(got[3000..].iter().all(|&x| x == 0x5a));
        }
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn streams_move_every_piece_until_one_comes_up_short() {
        // Across a region boundary: two pieces of 0x800 when direct, one when bounced.
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x10000), 0x10000),
        ])
        .unwrap();
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(64)).unwrap());
        let at = 0x10000 - 0x800;
        let data: Vec<u8> = (0..0xc00u32).map(|i| (i % 251) as u8).collect();
        for (name, dma) in [
            ("direct", Dma::direct()),
            ("bounced", Dma::bounced(Policy::Force, Arc::clone(&pool))),
        ] {
            // A source with 0xc00 bytes fills that much of 0x1000 and ends the transfer.
            let b = dma
                .map(&mem, at, 0x1000, Direction::FromDevice, 0, RangeCheck::Here)
                .unwrap();
            let mut source: &[u8] = &data;
            let filled = dma.write_from(&mem, &b, 0, 0x1000, &mut source).unwrap();
            assert_eq!(filled, 0xc00, "{name}");
            dma.unmap(&mem, b, 0).unwrap();
            let mut got = vec![0u8; 0xc00];
            mem.read_slice(&mut got, GuestAddress(at)).unwrap();
            assert_eq!(got, data, "{name}");
            // A sink with room for 0x900 bytes takes that much and ends the transfer.
            let b = dma
                .map(&mem, at, 0x1000, Direction::ToDevice, 0, RangeCheck::Here)
                .unwrap();
            let mut sink = vec![0u8; 0x900];
            let sent = dma
                .read_to(&mem, &b, 0, 0x1000, &mut &mut sink[..])
                .unwrap();
            assert_eq!(sent, 0x900, "{name}");
            assert_eq!(sink, data[..0x900], "{name}");
            dma.unmap(&mem, b, 0).unwrap();
        }
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn device_pieces_name_where_the_device_sees_a_mapping() {
        let mem = crate::orig::logged_memory(0x10000, 0x10000);
        let dirty = |a: u64| crate::orig::is_dirty(&mem, a);
        // Direct, across the region boundary: one piece per region, in order, at the guest
        // bytes' host addresses; a device write marks them dirty now.
        let direct = Dma::direct();
        // A device write of 4 KiB straddling the region boundary.
        let straddling = |d: &Dma| {
            let gpa = 0x10000 - 0x800;
            d.map(
                &mem,
                gpa,
                0x1000,
                Direction::FromDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap()
        };
        let b = straddling(&direct);
        let mut pieces = Vec::new();
        direct
            .device_pieces(&mem, &b, |p, n| pieces.push((p as usize, n)))
            .unwrap();
        let host = |a: u64| mem.get_host_address(GuestAddress(a)).unwrap() as usize;
        assert_eq!(
            pieces,
            [(host(0x10000 - 0x800), 0x800), (host(0x10000), 0x800)]
        );
        assert!(dirty(0x10000 - 0x800) && dirty(0x10000));
        // A device read marks nothing.
        let b = direct
            .map(
                &mem,
                0x4000,
                0x1000,
                Direction::ToDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap();
        direct.device_pieces(&mem, &b, |_, _| {}).unwrap();
        assert!(!dirty(0x4000));
        // Bounced: one piece inside the pool, at the mapping's device address.
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(64)).unwrap());
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool));
        let b = straddling(&dma);
        let mut pieces = Vec::new();
        dma.device_pieces(&mem, &b, |p, n| pieces.push((p as usize, n)))
            .unwrap();
        let (base, _) = pool.host_memory();
        let at = base as usize + (b.dev_addr() - pool.geometry().base) as usize;
        assert_eq!(pieces, [(at, 0x1000)]);
        dma.unmap(&mem, b, 0).unwrap();
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn mask_policy_bounces_only_buffers_above_the_mask() {
        // Guest RAM below and above 4 GiB.
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0xffff_0000), 0x1_0000),
            (GuestAddress(0x1_0000_0000), 0x1_0000),
        ])
        .unwrap();
        let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(256)).unwrap());
        let dma = Dma::bounced(Policy::Mask(32), Arc::clone(&pool));
        let low = dma
            .map(
                &mem,
                0xffff_0000,
                4096,
                Direction::FromDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap();
        assert!(!low.is_bounced());
        assert_eq!(low.dev_addr(), 0xffff_0000);
        let high = dma
            .map(
                &mem,
                0x1_0000_0000,
                4096,
                Direction::FromDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap();
        assert!(high.is_bounced());
        assert!(pool.contains(high.dev_addr(), 4096));
        // The device writes both; after unmap guest memory holds the data either way.
        dma.write(&mem, &low, 0, &[1; 4096]).unwrap();
        dma.write(&mem, &high, 0, &[2; 4096]).unwrap();
        dma.unmap(&mem, low, 0).unwrap();
        dma.unmap(&mem, high, 0).unwrap();
        let mut buf = [0u8; 4096];
        mem.read_slice(&mut buf, GuestAddress(0xffff_0000)).unwrap();
        assert_eq!(buf, [1; 4096]);
        mem.read_slice(&mut buf, GuestAddress(0x1_0000_0000))
            .unwrap();
        assert_eq!(buf, [2; 4096]);
        assert_eq!((pool.stats().maps, pool.used()), (1, 0));
        // Out-of-range offsets within a buffer are errors, not panics.
        let b = dma
            .map(
                &mem,
                0x1_0000_0000,
                16,
                Direction::ToDevice,
                0,
                RangeCheck::Here,
            )
            .unwrap();
        assert!(dma.read(&mem, &b, 8, &mut [0u8; 9]).is_err());
        assert!(dma.write(&mem, &b, usize::MAX, &[0u8; 2]).is_err());
        dma.unmap(&mem, b, 0).unwrap();
        // Not guest memory at all.
        assert!(dma
            .map(&mem, 0x5000, 16, Direction::ToDevice, 0, RangeCheck::Here)
            .is_err());
        let _ = mem.num_regions();
    }
}
