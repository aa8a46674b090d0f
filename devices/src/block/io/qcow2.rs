//! qcow2 images through `imago` (sync mode), compatible with `qemu-img`.

use std::io;
use std::path::Path;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use imago::file::File as ImagoFile;
use imago::format::gate::ImplicitOpenGate;
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::{FormatAccess, FormatDriverBuilder, Storage, StorageOpenOptions};
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
        check_header(path)?;
        let qcow2 = Qcow2::<ImagoFile>::builder_path(path)
            .storage_open_options(StorageOpenOptions::new().direct(cache.direct()))
            .write(!readonly)
            .open(BoundedGate::default())
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

/// The deepest backing chain opened.
const MAX_BACKING_DEPTH: usize = 32;

/// `imago`'s permissive gate (backing files open as the image names them) with a bound on
/// the chain: an image that names itself, or any loop, recursed until the stack overflowed
/// (found by `tests/qcow2_fuzz.rs`).
#[derive(Clone, Copy, Debug, Default)]
struct BoundedGate {
    depth: usize,
}

impl<S: Storage + 'static> ImplicitOpenGate<S> for BoundedGate {
    fn open_format<F: FormatDriverBuilder<S>>(
        &mut self,
        builder: F,
    ) -> io::Result<FormatAccess<S>> {
        if self.depth >= MAX_BACKING_DEPTH {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("backing chain deeper than {MAX_BACKING_DEPTH} images (a loop?)"),
            ));
        }
        let inner = builder.open(BoundedGate {
            depth: self.depth + 1,
        })?;
        Ok(FormatAccess::new(inner))
    }

    fn open_storage(&mut self, builder: StorageOpenOptions) -> io::Result<S> {
        S::open(builder)
    }
}

/// Refuses what `imago` accepts but cannot serve: refcount structures that do not count the
/// header cluster (no refcount table, `refcount_table_clusters` 0, a table past the end of the
/// file, no refcount block for cluster 0, or a refcount of 0 for it). Such an image is corrupt
/// (`qemu-img check` says so), and imago's first cluster allocation on it recursed until the
/// stack overflowed, killing the process (found by `tests/qcow2_fuzz.rs`). A file too short
/// for the header is left to imago's own checks.
fn check_header(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let mut h = [0u8; 100];
    if f.read_exact_at(&mut h, 0).is_err() || h[0..4] != *b"QFI\xfb" {
        return Ok(());
    }
    let be32 = |o: usize| u32::from_be_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let be64 = |b: &[u8]| b.iter().fold(0u64, |v, &x| (v << 8) | u64::from(x));
    let corrupt = |why: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: corrupt qcow2 image: {why}", path.display()),
        ))
    };
    if be32(56) == 0 {
        return corrupt("it does not contain a reference count table");
    }
    let mut e = [0u8; 8];
    if f.read_exact_at(&mut e, be64(&h[48..56])).is_err() {
        return corrupt("the reference count table lies outside the file");
    }
    let rb = be64(&e) & 0x00ff_ffff_ffff_fe00;
    // v2 images have 16-bit refcounts; v3 name the order (imago checks its range).
    let order = if be32(4) >= 3 { be32(96).min(6) } else { 4 };
    let bits = 1u32 << order;
    let mut first = [0u8; 8];
    let n = (bits as usize).div_ceil(8);
    if rb == 0 || f.read_exact_at(&mut first[..n], rb).is_err() {
        return corrupt("no refcount block covers the header");
    }
    let refcount = if bits < 8 {
        u64::from(first[0] & ((1u8 << bits) - 1))
    } else {
        be64(&first[..n])
    };
    if refcount == 0 {
        return corrupt("the header cluster has a refcount of 0");
    }
    Ok(())
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
