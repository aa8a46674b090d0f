//! I/O engines: the host side of a block request, submitted now and completed later.
//!
//! A queue worker turns a request into an [`IoOp`] on device-visible buffers ([`IoBuf`]s:
//! guest memory, or the bounce pool) and hands it to its [`IoEngine`] with a tag. Completions
//! come back from [`IoEngine::reap`] in whatever order the host finishes them. Three engines,
//! named as QEMU's `aio=` ([`super::AioMode`]):
//! - [`super::UringEngine`] (`io_uring`): raw images; submissions are queued in the submission
//!   ring and handed to the kernel in one `io_uring_enter` per batch ([`IoEngine::kick`]);
//!   completions raise an eventfd ([`IoEngine::notifier`]) that the transport polls as one of
//!   the worker's extra fds.
//! - [`super::ThreadEngine`] (`threads`): any [`Disk`] (qcow2 among them), a pool of threads
//!   doing blocking I/O; completions raise an eventfd the same way.
//! - [`SyncEngine`] (`sync`): the I/O runs inside `submit`, completions are ready at once (the
//!   old synchronous path, kept for debugging).
//!
//! [`AlignedEngine`] sits in front of any of them when the image is opened with O_DIRECT: a
//! read or write whose buffers are not aligned as direct I/O requires goes through an aligned
//! buffer of its own (QEMU's `qemu_blockalign` bounce), counted in [`EngineStats`].
//!
//! Contract (the one `unsafe` of the interface, [`IoEngine::submit`]): the memory behind every
//! [`IoBuf`] of a submitted op stays valid, and is not touched by anyone else, until the
//! completion with its tag has been returned by [`IoEngine::reap`]. Dropping an engine waits
//! for everything in flight, so dropping it first is always safe.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::Serialize;

use super::Disk;
pub use crate::virtio::iobuf::{IoBuf, IoBufs};

/// Identifies a submitted op in its completion (the caller's choice; unique while in flight).
pub type Tag = u64;

/// Host memory an engine may register with the kernel once, so that I/O on it needs no page
/// pinning per request (io_uring fixed buffers): the bounce pool, which is every bounced
/// request's data buffer and never moves while its owner lives. Guest memory is not
/// registered, as QEMU does not: it can be many GiB, and pinning all of it would defeat
/// ballooning and overcommit.
#[derive(Clone)]
pub struct FixedRegion {
    start: usize,
    len: usize,
    /// Keeps the memory mapped while an engine has it registered.
    _owner: Arc<dyn Send + Sync>,
}

impl fmt::Debug for FixedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FixedRegion")
            .field("start", &format_args!("{:#x}", self.start))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl FixedRegion {
    /// The memory `ptr..ptr + len`, kept mapped by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be one readable and writable mapping that stays mapped, at that
    /// address, as long as `owner` lives.
    pub unsafe fn new(ptr: *mut u8, len: usize, owner: Arc<dyn Send + Sync>) -> Self {
        Self {
            start: ptr as usize,
            len,
            _owner: owner,
        }
    }

    /// The bounce pool of `dma`, when it has a static one. A dynamic pool's window is mostly
    /// pages no pool uses yet; registering it would pin all of them, so it is not registered
    /// (its I/O goes through plain READV/WRITEV).
    pub fn of_dma(dma: &bounce::Dma) -> Option<Self> {
        let pool = dma.pool()?;
        if pool.dynamic().is_some() {
            return None;
        }
        let (ptr, len) = pool.host_memory();
        let owner: Arc<dyn Send + Sync> = Arc::clone(pool) as Arc<dyn Send + Sync>;
        // SAFETY: a pool's memory is one mapping, readable and writable, that lives as long
        // as the pool, which `owner` keeps.
        Some(unsafe { Self::new(ptr, len, owner) })
    }

    /// Start address.
    pub fn start(&self) -> *mut u8 {
        self.start as *mut u8
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where `buf` lies in the region: its byte offset, when all of it is inside.
    pub fn offset_of(&self, buf: &IoBuf) -> Option<usize> {
        let off = (buf.ptr() as usize).checked_sub(self.start)?;
        (off.checked_add(buf.len())? <= self.len).then_some(off)
    }
}

/// A byte range of a discard or write-zeroes op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Write-zeroes only: deallocating is allowed.
    pub unmap: bool,
}

/// What an engine does for one request.
#[derive(Debug)]
pub enum IoOp {
    /// Read `offset..` into the buffers, in order.
    Read {
        /// Byte offset on the disk.
        offset: u64,
        /// Destination pieces.
        bufs: IoBufs,
    },
    /// Write the buffers at `offset..`; with `fua`, complete only once the data is on stable
    /// storage (write cache off: a flush follows the write, as QEMU emulates FUA).
    Write {
        /// Byte offset on the disk.
        offset: u64,
        /// Source pieces.
        bufs: IoBufs,
        /// Sync before completing.
        fua: bool,
    },
    /// Everything completed before this op was submitted reaches stable storage.
    Flush,
    /// Deallocate the ranges (a hint: a backend that cannot still succeeds).
    Discard {
        /// The ranges.
        ranges: Vec<Range>,
        /// Sync before completing.
        fua: bool,
    },
    /// Make the ranges read as zeros.
    WriteZeroes {
        /// The ranges.
        ranges: Vec<Range>,
        /// Sync before completing.
        fua: bool,
    },
}

impl IoOp {
    /// Bytes a read or write moves (0 for the others).
    pub fn data_len(&self) -> u64 {
        match self {
            Self::Read { bufs, .. } | Self::Write { bufs, .. } => {
                bufs.iter().map(|b| b.len as u64).sum()
            }
            _ => 0,
        }
    }
}

/// A finished op: its tag and the bytes moved (fewer than asked only at the end of the disk).
#[derive(Debug)]
pub struct IoDone {
    /// The tag given to [`IoEngine::submit`].
    pub tag: Tag,
    /// Bytes transferred, or the host error.
    pub result: io::Result<u64>,
}

/// Counters shared by an engine and whoever reports it.
#[derive(Debug, Default, Serialize)]
pub struct EngineStats {
    /// Ops submitted.
    pub submitted: AtomicU64,
    /// Ops completed.
    pub completed: AtomicU64,
    /// Calls into the kernel that handed a batch of submissions over (io_uring only).
    pub submit_calls: AtomicU64,
    /// Largest number of ops in flight at once.
    pub in_flight_hiwater: AtomicU64,
    /// Reads and writes that went through the engine's aligned bounce buffer (O_DIRECT with
    /// buffers not aligned for it).
    pub dio_bounced: AtomicU64,
    /// Short transfers resubmitted for their remainder.
    pub resubmitted: AtomicU64,
    /// Engines that registered a [`FixedRegion`] with the kernel (io_uring only; 0 when the
    /// kernel refused it, e.g. over `RLIMIT_MEMLOCK`, and I/O on it then pins per request).
    pub fixed_regions: AtomicU64,
    /// Reads and writes whose data went through a registered [`FixedRegion`].
    pub fixed_ops: AtomicU64,
}

impl EngineStats {
    pub(crate) fn note_submit(&self, in_flight: usize) {
        self.submitted.fetch_add(1, Ordering::Relaxed);
        self.in_flight_hiwater
            .fetch_max(in_flight as u64, Ordering::Relaxed);
    }
}

/// The host side of a queue: submits ops, reports their completions in any order.
pub trait IoEngine: Send + fmt::Debug {
    /// The `aio=` name.
    fn name(&self) -> &'static str;

    /// Queues `op`; it reaches the host at the latest on the next [`IoEngine::kick`]. Errors
    /// come back as completions, never from here.
    ///
    /// # Safety
    /// Every [`IoBuf`] of `op` must stay valid (for reads by the engine in a write, for writes
    /// in a read) and must not be accessed by anyone else until [`IoEngine::reap`] has
    /// returned the completion with `tag` (or the engine is dropped, which waits).
    unsafe fn submit(&mut self, tag: Tag, op: IoOp);

    /// Hands what was queued since the last kick to the host, in one batch.
    fn kick(&mut self);

    /// Appends the completions available now to `out` (never blocks). Call it when the
    /// [`IoEngine::notifier`] fired, and after submitting.
    fn reap(&mut self, out: &mut Vec<IoDone>);

    /// Blocks until at least one completion can be reaped, or a short while passes (at most
    /// about 100 ms where the host allows a timeout; returns at once when nothing is in
    /// flight). For tests and for quiescing, which check their own time limit between waits.
    fn wait(&mut self);

    /// Ops submitted and not yet reaped.
    fn in_flight(&self) -> usize;

    /// An eventfd that becomes readable when completions arrive; poll it edge-triggered.
    /// `None` when completions are always ready right after `submit` ([`SyncEngine`]).
    fn notifier(&self) -> Option<RawFd>;

    /// The engine's counters.
    fn stats(&self) -> &Arc<EngineStats>;
}

/// Reads into `buf` from `offset` until it is full or the disk ends; returns the bytes read.
fn read_full<D: Disk>(disk: &D, mut offset: u64, buf: IoBuf) -> io::Result<u64> {
    // SAFETY: the engine contract (IoEngine::submit) keeps `buf` valid and ours until the
    // completion is reaped, which happens after this returns.
    let whole = unsafe { buf.as_volatile() };
    let mut done = 0usize;
    while done < whole.len() {
        let mut rest = whole
            .subslice(done, whole.len() - done)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let n = disk.read_at(offset, &mut rest)?;
        if n == 0 {
            break;
        }
        done += n;
        offset = offset
            .checked_add(n as u64)
            .ok_or_else(|| io::Error::other("disk offset overflows"))?;
    }
    Ok(done as u64)
}

/// Writes all of `buf` at `offset`; returns the bytes written.
fn write_full<D: Disk>(disk: &D, mut offset: u64, buf: IoBuf) -> io::Result<u64> {
    // SAFETY: as in `read_full`.
    let whole = unsafe { buf.as_volatile() };
    let mut done = 0usize;
    while done < whole.len() {
        let rest = whole
            .subslice(done, whole.len() - done)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let n = disk.write_at(offset, &rest)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "disk took no bytes",
            ));
        }
        done += n;
        offset = offset
            .checked_add(n as u64)
            .ok_or_else(|| io::Error::other("disk offset overflows"))?;
    }
    Ok(done as u64)
}

/// Runs `op` to the end with blocking calls on `disk` (the sync and thread-pool engines).
pub(crate) fn run_blocking<D: Disk>(disk: &D, op: &IoOp) -> io::Result<u64> {
    match op {
        IoOp::Read { offset, bufs } => {
            let mut off = *offset;
            let mut total = 0u64;
            for b in bufs {
                let n = read_full(disk, off, *b)?;
                total += n;
                if n < b.len as u64 {
                    break;
                }
                off += n;
            }
            Ok(total)
        }
        IoOp::Write { offset, bufs, fua } => {
            let mut off = *offset;
            let mut total = 0u64;
            for b in bufs {
                let n = write_full(disk, off, *b)?;
                total += n;
                off += n;
            }
            if *fua {
                disk.flush()?;
            }
            Ok(total)
        }
        IoOp::Flush => disk.flush().map(|()| 0),
        IoOp::Discard { ranges, fua } => {
            for r in ranges {
                disk.discard(r.offset, r.len)?;
            }
            if *fua {
                disk.flush()?;
            }
            Ok(0)
        }
        IoOp::WriteZeroes { ranges, fua } => {
            for r in ranges {
                disk.write_zeroes(r.offset, r.len, r.unmap)?;
            }
            if *fua {
                disk.flush()?;
            }
            Ok(0)
        }
    }
}

/// `aio=sync`: every op runs to the end inside [`IoEngine::submit`].
#[derive(Debug)]
pub struct SyncEngine<D: Disk> {
    disk: Arc<D>,
    done: Vec<IoDone>,
    stats: Arc<EngineStats>,
}

impl<D: Disk> SyncEngine<D> {
    /// An engine on `disk`.
    pub fn new(disk: Arc<D>) -> Self {
        Self {
            disk,
            done: Vec::new(),
            stats: Arc::default(),
        }
    }
}

impl<D: Disk> IoEngine for SyncEngine<D> {
    fn name(&self) -> &'static str {
        "sync"
    }

    unsafe fn submit(&mut self, tag: Tag, op: IoOp) {
        self.stats.note_submit(self.done.len() + 1);
        let result = run_blocking(&*self.disk, &op);
        self.done.push(IoDone { tag, result });
    }

    fn kick(&mut self) {}

    fn reap(&mut self, out: &mut Vec<IoDone>) {
        self.stats
            .completed
            .fetch_add(self.done.len() as u64, Ordering::Relaxed);
        out.append(&mut self.done);
    }

    fn wait(&mut self) {}

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn notifier(&self) -> Option<RawFd> {
        None
    }

    fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}

/// A zeroed heap buffer aligned for direct I/O.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is owned memory with no thread affinity.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (at least 1) aligned to `align` (a power of two).
    ///
    /// # Errors
    /// An impossible layout, or the allocation failing.
    pub fn new(len: usize, align: usize) -> io::Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), align)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "aligned buffer"))?;
        Ok(Self { ptr, layout })
    }

    /// The whole buffer as one piece.
    pub fn io_buf(&self) -> IoBuf {
        IoBuf::new(self.ptr.as_ptr(), self.layout.size())
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout and not freed since.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Copies the first `limit` bytes between the pieces `bufs` and the contiguous `flat`, in
/// order: into `flat` when `gather`, out of it otherwise.
///
/// # Safety
/// Every piece and `flat` must be valid memory that nobody else accesses during the call.
unsafe fn copy_pieces(bufs: &[IoBuf], flat: IoBuf, gather: bool, limit: usize) {
    // SAFETY: validity is the caller's duty.
    let flat = unsafe { flat.as_volatile() };
    let mut off = 0usize;
    for b in bufs {
        let n = b.len.min(limit.saturating_sub(off));
        if n == 0 {
            return;
        }
        // SAFETY: as above.
        let piece = unsafe { b.as_volatile() };
        let (Ok(window), Ok(piece)) = (flat.subslice(off, n), piece.subslice(0, n)) else {
            return;
        };
        if gather {
            piece.copy_to_volatile_slice(window);
        } else {
            window.copy_to_volatile_slice(piece);
        }
        off += n;
    }
}

/// Direct-I/O alignment of an image: buffer addresses and lengths must be multiples of
/// `mem`, file offsets and total lengths multiples of `offset` (statx `STATX_DIOALIGN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectAlign {
    /// Memory alignment.
    pub mem: usize,
    /// Offset and length alignment.
    pub offset: usize,
}

struct Bounced {
    flat: AlignedBuf,
    orig: IoBufs,
    read: bool,
}

/// Puts reads and writes whose buffers are not aligned for O_DIRECT through an aligned bounce
/// buffer of its own, in front of any engine (QEMU bounces a whole request when one of its
/// iovecs is not aligned, `bdrv_qiov_is_aligned`).
pub struct AlignedEngine {
    inner: Box<dyn IoEngine>,
    align: DirectAlign,
    pending: HashMap<Tag, Bounced>,
    /// Ops that failed before reaching the inner engine, reported on the next reap.
    failed: Vec<IoDone>,
}

impl fmt::Debug for AlignedEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedEngine")
            .field("inner", &self.inner)
            .field("align", &self.align)
            .field("bounced_in_flight", &self.pending.len())
            .finish()
    }
}

impl AlignedEngine {
    /// Wraps `inner` for an image with direct-I/O alignment `align`.
    pub fn new(inner: Box<dyn IoEngine>, align: DirectAlign) -> Self {
        Self {
            inner,
            align,
            pending: HashMap::new(),
            failed: Vec::new(),
        }
    }

    /// Swaps the pieces of a misaligned read or write for one aligned buffer.
    fn bounce(&mut self, tag: Tag, op: &mut IoOp) -> io::Result<()> {
        let (bufs, read) = match op {
            IoOp::Read { bufs, .. } => (bufs, true),
            IoOp::Write { bufs, .. } => (bufs, false),
            _ => return Ok(()),
        };
        let mem = self.align.mem.max(1);
        if bufs.iter().all(|b| b.is_aligned(mem)) {
            return Ok(());
        }
        let len: usize = bufs.iter().map(|b| b.len).sum();
        let flat = AlignedBuf::new(len, mem.max(self.align.offset).max(4096))?;
        let window = IoBuf::new(flat.io_buf().ptr, len);
        if !read {
            // SAFETY: the pieces are valid by the submit contract; `flat` is ours and `len`
            // long.
            unsafe { copy_pieces(bufs, window, true, len) };
        }
        let orig = std::mem::replace(bufs, smallvec::smallvec![window]);
        self.pending.insert(tag, Bounced { flat, orig, read });
        self.inner
            .stats()
            .dio_bounced
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl IoEngine for AlignedEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    unsafe fn submit(&mut self, tag: Tag, mut op: IoOp) {
        if let Err(e) = self.bounce(tag, &mut op) {
            // No aligned buffer could be allocated: the op fails like an I/O error, reported
            // on the next reap.
            self.failed.push(IoDone {
                tag,
                result: Err(e),
            });
            return;
        }
        // SAFETY: the original pieces keep the caller's guarantee; a bounced op's only piece
        // is `flat`, owned by `self.pending` until its completion is reaped.
        unsafe { self.inner.submit(tag, op) }
    }

    fn kick(&mut self) {
        self.inner.kick();
    }

    fn reap(&mut self, out: &mut Vec<IoDone>) {
        let start = out.len();
        self.inner.reap(out);
        for d in &out[start..] {
            if let Some(b) = self.pending.remove(&d.tag) {
                if b.read {
                    if let Ok(n) = d.result {
                        // n <= the flat length; copy back what was read (the rest of the
                        // pieces stay as they were, as after a short read).
                        let n = usize::try_from(n).unwrap_or(0).min(b.flat.layout.size());
                        // SAFETY: the original pieces are still the caller's by the submit
                        // contract (their completion is being returned now); `flat` is ours.
                        unsafe { copy_pieces(&b.orig, b.flat.io_buf(), false, n) };
                    }
                }
            }
        }
        out.append(&mut self.failed);
    }

    fn wait(&mut self) {
        if self.failed.is_empty() {
            self.inner.wait();
        }
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.failed.len()
    }

    fn notifier(&self) -> Option<RawFd> {
        self.inner.notifier()
    }

    fn stats(&self) -> &Arc<EngineStats> {
        self.inner.stats()
    }
}
