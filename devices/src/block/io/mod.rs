//! Disk backends.
//!
//! A [`Disk`] does positional I/O on `vm-memory` volatile slices, so the device can hand it the
//! device-visible buffers of its [`bounce::Dma`] handle (guest memory or bounce pool) without
//! ever forming a Rust reference over them. [`DiskIo`] turns a disk and a byte offset into the
//! `ReadVolatile`/`WriteVolatile` source and sink that [`bounce::Dma::write_from`] and
//! [`bounce::Dma::read_to`] take.
//!
//! Backends: [`RawDisk`] (a raw image file, `pread`/`pwrite`, `fdatasync`, hole punching),
//! [`Qcow2Disk`] (qcow2 through `imago` in sync mode) and [`MemDisk`] (anonymous memory, for
//! tests and benchmarks). [`DiskImage`] is the one the VMM opens from a `-drive`.
//!
//! Host I/O runs through an [`IoEngine`] ([`engine`]): io_uring for raw images, a thread pool
//! for anything, or the synchronous path; [`new_engine`] picks one for an `aio=` mode. How the
//! image is opened and flushed follows its [`CacheMode`] (QEMU's `cache=`).

mod cache;
pub mod engine;
mod mem;
mod qcow2;
mod raw;
mod threads;
mod uring;

#[cfg(test)]
mod tests;

use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile};

pub use cache::{AioMode, CacheMode, OnFull};
pub use engine::{
    AlignedBuf, AlignedEngine, DirectAlign, EngineStats, FixedRegion, IoBuf, IoBufs, IoDone,
    IoEngine, IoOp, Range, SyncEngine, Tag,
};
pub use mem::MemDisk;
pub use qcow2::Qcow2Disk;
pub use raw::{direct_io_refused, probe_direct_align, RawDisk};
pub use threads::ThreadEngine;
pub use uring::UringEngine;

/// A disk: positional I/O on volatile slices, shared by all the queues of a device.
///
/// Offsets and lengths are in bytes; the device checks every request against
/// [`Disk::capacity`] before calling in, so implementations may treat out-of-range accesses as
/// errors.
pub trait Disk: Send + Sync + fmt::Debug + 'static {
    /// Size in bytes (a multiple of 512: the device ignores a partial last sector).
    fn capacity(&self) -> u64;

    /// Reads into `buf` from `offset`; returns the bytes read (fewer only at the end of the
    /// disk).
    ///
    /// # Errors
    /// The backend's I/O error.
    fn read_at<B: BitmapSlice>(&self, offset: u64, buf: &mut VolatileSlice<B>)
        -> io::Result<usize>;

    /// Writes `buf` at `offset`; returns the bytes written.
    ///
    /// # Errors
    /// The backend's I/O error.
    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize>;

    /// Returns once everything written so far is on stable storage.
    ///
    /// # Errors
    /// The backend's I/O error.
    fn flush(&self) -> io::Result<()>;

    /// Deallocates `offset..offset + len` if the backend can; the contents afterwards are
    /// unspecified (zeros for every backend here). Doing nothing is a valid implementation.
    ///
    /// # Errors
    /// The backend's I/O error.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Makes `offset..offset + len` read as zeros; with `unmap`, deallocating it is allowed.
    ///
    /// # Errors
    /// The backend's I/O error.
    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()>;

    /// A short name for stats and logs ("raw", "qcow2", "memory").
    fn kind(&self) -> &'static str;

    /// The file descriptor an io_uring engine can do I/O on, for a backend that is one file
    /// (raw images). `None` for the others.
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }

    /// The alignment buffers need when the disk was opened with O_DIRECT and the backend
    /// does not align them itself (raw images); `None` otherwise.
    fn direct_align(&self) -> Option<DirectAlign> {
        None
    }

    /// False for a backend whose I/O never blocks (memory): with no `aio=` given it runs on
    /// the synchronous path, where a thread pool would only add hand-offs.
    fn may_block(&self) -> bool {
        true
    }
}

/// The engine for `aio` on `disk`, sized for `depth` requests in flight. An io_uring engine
/// registers `fixed` (the bounce pool) with the kernel; the others have no use for it.
///
/// With no `aio` given, a disk with a file descriptor gets io_uring and falls back to the
/// thread pool (with a warning) where the kernel refuses io_uring; other disks get the thread
/// pool. An explicit `aio=io_uring` that cannot work is an error. A disk opened with O_DIRECT
/// gets the [`AlignedEngine`] in front.
///
/// # Errors
/// `aio=io_uring` on a disk without a file or on a kernel without io_uring; the eventfd of
/// the thread pool cannot be created.
pub fn new_engine<D: Disk>(
    aio: Option<AioMode>,
    disk: &Arc<D>,
    depth: u16,
    fixed: Option<&FixedRegion>,
) -> io::Result<Box<dyn IoEngine>> {
    let engine: Box<dyn IoEngine> = match aio {
        Some(AioMode::IoUring) => Box::new(UringEngine::new(Arc::clone(disk), depth, fixed)?),
        Some(AioMode::Threads) => Box::new(ThreadEngine::new(Arc::clone(disk), depth)?),
        Some(AioMode::Sync) => Box::new(SyncEngine::new(Arc::clone(disk))),
        None if disk.raw_fd().is_some() => match UringEngine::new(Arc::clone(disk), depth, fixed) {
            Ok(e) => Box::new(e),
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!("virtio-blk: {e}; using aio=threads");
                });
                Box::new(ThreadEngine::new(Arc::clone(disk), depth)?)
            }
        },
        None if !disk.may_block() => Box::new(SyncEngine::new(Arc::clone(disk))),
        None => Box::new(ThreadEngine::new(Arc::clone(disk), depth)?),
    };
    Ok(match disk.direct_align() {
        Some(align) => Box::new(AlignedEngine::new(engine, align)),
        None => engine,
    })
}

/// The engine [`new_engine`] would pick for `aio` on `disk` (for stats and logs).
pub fn engine_name<D: Disk>(aio: Option<AioMode>, disk: &D) -> &'static str {
    match aio {
        Some(m) => m.name(),
        None if disk.raw_fd().is_some() => "io_uring",
        None if !disk.may_block() => "sync",
        None => "threads",
    }
}

/// A cursor on a disk: reads and writes at a byte offset that advances with each transfer.
#[derive(Debug)]
pub struct DiskIo<'a, D: Disk> {
    disk: &'a D,
    offset: u64,
}

impl<'a, D: Disk> DiskIo<'a, D> {
    /// A cursor at `offset`.
    pub fn new(disk: &'a D, offset: u64) -> Self {
        Self { disk, offset }
    }

    /// The current offset.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Runs `op` (a read or a write at the current offset) and moves past the bytes it moved.
    fn transfer(
        &mut self,
        op: impl FnOnce(&D, u64) -> io::Result<usize>,
    ) -> Result<usize, VolatileMemoryError> {
        let n = op(self.disk, self.offset).map_err(VolatileMemoryError::IOError)?;
        self.offset = self.offset.checked_add(n as u64).ok_or_else(|| {
            VolatileMemoryError::IOError(io::Error::other("disk offset overflows"))
        })?;
        Ok(n)
    }
}

impl<D: Disk> ReadVolatile for DiskIo<'_, D> {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        self.transfer(|disk, offset| disk.read_at(offset, buf))
    }
}

impl<D: Disk> WriteVolatile for DiskIo<'_, D> {
    fn write_volatile<B: BitmapSlice>(
        &mut self,
        buf: &VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        self.transfer(|disk, offset| disk.write_at(offset, buf))
    }
}

/// Image formats a `-drive` can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageFormat {
    /// A raw image file.
    Raw,
    /// A qcow2 image.
    Qcow2,
}

bounce::named_enum! {
    ImageFormat, "image format", err: String = String::from;
    Raw => "raw",
    Qcow2 => "qcow2",
}

/// Any of the backends, chosen at run time.
#[derive(Debug)]
pub enum DiskImage {
    /// A raw file.
    Raw(RawDisk),
    /// A qcow2 image.
    Qcow2(Qcow2Disk),
    /// Memory.
    Memory(MemDisk),
}

impl DiskImage {
    /// Opens an image file.
    ///
    /// # Errors
    /// The open error.
    pub fn open(path: &Path, format: ImageFormat, readonly: bool) -> io::Result<Self> {
        Self::open_with(path, format, readonly, CacheMode::Writeback)
    }

    /// Opens an image file for a cache mode (O_DIRECT for `none` and `directsync`).
    ///
    /// # Errors
    /// The open error; a file system without direct I/O gets a one-line error naming
    /// O_DIRECT and the cache mode.
    pub fn open_with(
        path: &Path,
        format: ImageFormat,
        readonly: bool,
        cache: CacheMode,
    ) -> io::Result<Self> {
        Ok(match format {
            ImageFormat::Raw => Self::Raw(RawDisk::open_with(path, readonly, cache)?),
            ImageFormat::Qcow2 => Self::Qcow2(Qcow2Disk::open_with(path, readonly, cache)?),
        })
    }
}

macro_rules! dispatch {
    ($self:ident, $d:ident => $e:expr) => {
        match $self {
            DiskImage::Raw($d) => $e,
            DiskImage::Qcow2($d) => $e,
            DiskImage::Memory($d) => $e,
        }
    };
}

impl Disk for DiskImage {
    fn capacity(&self) -> u64 {
        dispatch!(self, d => d.capacity())
    }
    fn read_at<B: BitmapSlice>(
        &self,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> io::Result<usize> {
        dispatch!(self, d => d.read_at(offset, buf))
    }
    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize> {
        dispatch!(self, d => d.write_at(offset, buf))
    }
    fn flush(&self) -> io::Result<()> {
        dispatch!(self, d => d.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        dispatch!(self, d => d.discard(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        dispatch!(self, d => d.write_zeroes(offset, len, unmap))
    }
    fn kind(&self) -> &'static str {
        dispatch!(self, d => d.kind())
    }
    fn raw_fd(&self) -> Option<RawFd> {
        dispatch!(self, d => d.raw_fd())
    }
    fn direct_align(&self) -> Option<DirectAlign> {
        dispatch!(self, d => d.direct_align())
    }
    fn may_block(&self) -> bool {
        dispatch!(self, d => d.may_block())
    }
}
