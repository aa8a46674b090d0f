//! qcow2 images through `imago` (sync mode), compatible with `qemu-img`.

use std::io;
use std::path::Path;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use imago::file::File as ImagoFile;
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::{FormatAccess, FormatDriverBuilder, PermissiveImplicitOpenGate, StorageOpenOptions};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;

use super::{CacheMode, Disk};
use crate::block::SECTOR_SIZE;

/// A qcow2 image.
///
/// Reads, writes and write-zeroes without unmapping share the image (`imago` serialises what
/// needs it internally); discards take it exclusively, because `imago` requires that no data
/// mapping is in use while clusters are freed.
pub struct Qcow2Disk {
    image: RwLock<FormatAccess<ImagoFile>>,
    capacity: u64,
    readonly: bool,
}

impl std::fmt::Debug for Qcow2Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Disk")
            .field("capacity", &self.capacity)
            .field("readonly", &self.readonly)
            .finish_non_exhaustive()
    }
}

fn poisoned() -> io::Error {
    io::Error::other("qcow2 image lock poisoned")
}

impl Qcow2Disk {
    /// Opens a qcow2 image (and, as qemu does, the backing files it names).
    ///
    /// # Errors
    /// The open error (not a qcow2 image, unsupported features, ...).
    pub fn open(path: &Path, readonly: bool) -> io::Result<Self> {
        Self::open_with(path, readonly, CacheMode::Writeback)
    }

    /// Opens a qcow2 image for `cache`: with O_DIRECT for `none` and `directsync` (the image
    /// and its backing files; `imago` aligns buffers and requests for direct I/O itself).
    ///
    /// # Errors
    /// As [`Qcow2Disk::open`]; a file system without direct I/O gets the one-line
    /// [`super::raw::direct_io_refused`] error.
    pub fn open_with(path: &Path, readonly: bool, cache: CacheMode) -> io::Result<Self> {
        let qcow2 = Qcow2::<ImagoFile>::builder_path(path)
            .storage_open_options(StorageOpenOptions::new().direct(cache.direct()))
            .write(!readonly)
            .open(PermissiveImplicitOpenGate::default())
            .map_err(|e| {
                if cache.direct() && e.raw_os_error() == Some(libc::EINVAL) {
                    super::raw::direct_io_refused(path, cache, &e)
                } else {
                    e
                }
            })?;
        let image = FormatAccess::new(qcow2);
        let size = image.size();
        Ok(Self {
            image: RwLock::new(image),
            capacity: size - size % SECTOR_SIZE,
            readonly,
        })
    }

    fn shared(&self) -> io::Result<RwLockReadGuard<'_, FormatAccess<ImagoFile>>> {
        self.image.read().map_err(|_| poisoned())
    }

    fn exclusive(&self) -> io::Result<RwLockWriteGuard<'_, FormatAccess<ImagoFile>>> {
        self.image.write().map_err(|_| poisoned())
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.readonly {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only disk",
            ));
        }
        Ok(())
    }
}

impl Disk for Qcow2Disk {
    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn read_at<B: BitmapSlice>(
        &self,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> io::Result<usize> {
        let len = buf.len();
        let slice: &VolatileSlice<B> = buf;
        // The guard keeps the memory behind the vector mapped while imago uses it.
        let (vec, _guard) = IoVectorMut::from_volatile_slice_one(slice);
        self.shared()?.readv(vec, offset)?;
        Ok(len)
    }

    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize> {
        self.check_writable()?;
        let (vec, _guard) = IoVector::from_volatile_slice_one(buf);
        self.shared()?.writev(vec, offset)?;
        Ok(buf.len())
    }

    fn flush(&self) -> io::Result<()> {
        if self.readonly {
            return Ok(());
        }
        let image = self.shared()?;
        // Write out imago's metadata caches, then make data and metadata durable.
        image.flush()?;
        image.sync()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        match self.exclusive()?.discard_to_any(offset, len) {
            // Discard is a hint.
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            r => r,
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.check_writable()?;
        if unmap {
            self.exclusive()?.discard_to_zero(offset, len)
        } else {
            self.shared()?.write_zeroes(offset, len)
        }
    }

    fn kind(&self) -> &'static str {
        "qcow2"
    }
}
