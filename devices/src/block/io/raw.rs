//! Raw image files: `pread`/`pwrite` straight into the device-visible buffer.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::RawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;

use super::engine::{AlignedBuf, DirectAlign};
use super::{CacheMode, Disk};
use crate::block::SECTOR_SIZE;

/// A raw image file (or block device). Capacity is its length rounded down to a sector.
#[derive(Debug)]
pub struct RawDisk {
    file: File,
    capacity: u64,
    readonly: bool,
    /// Set when the file was opened with O_DIRECT.
    direct: Option<DirectAlign>,
}

/// The one-line error for a file system that refuses O_DIRECT (open fails with EINVAL).
pub fn direct_io_refused(path: &Path, cache: CacheMode, err: &io::Error) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!(
            "{}: cannot open with O_DIRECT (cache={cache}): the file system does not support direct I/O ({err}); use cache=writeback or cache=writethrough",
            path.display()
        ),
    )
}

/// Direct-I/O alignment of an open file: statx `STATX_DIOALIGN` where the kernel and file
/// system report it, else the conservative 4096 for both (what QEMU's probe settles on for a
/// 4 KiB-sector disk).
pub fn probe_direct_align(file: &File) -> DirectAlign {
    const FALLBACK: DirectAlign = DirectAlign {
        mem: 4096,
        offset: 4096,
    };
    // SAFETY: statx is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open for the lifetime of `file`, the empty path with AT_EMPTY_PATH
    // names it, and `stx` is a valid buffer the kernel fills.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return FALLBACK;
    }
    let pow2 = |v: u32| {
        usize::try_from(v)
            .ok()
            .filter(|v| v.is_power_of_two())
            .unwrap_or(4096)
    };
    DirectAlign {
        mem: pow2(stx.stx_dio_mem_align.max(1)),
        offset: pow2(stx.stx_dio_offset_align),
    }
}

/// Converts a byte offset to `off_t`, refusing offsets that do not fit.
fn off_t(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset exceeds off_t"))
}

/// Runs `call` (one `pread` or `pwrite`) again for as long as it fails with EINTR: the byte
/// count it returned, or the error it failed with.
fn retry_eintr(mut call: impl FnMut() -> libc::ssize_t) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            // A count that is not negative always fits usize.
            return Ok(usize::try_from(n).unwrap_or(0));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// One `pread` into a volatile slice, retried on EINTR.
fn pread_volatile<B: BitmapSlice>(
    file: &File,
    offset: u64,
    buf: &mut VolatileSlice<B>,
) -> io::Result<usize> {
    let off = off_t(offset)?;
    let guard = buf.ptr_guard_mut();
    let r = retry_eintr(|| {
        // SAFETY: the fd is open for the lifetime of `file`; `guard` points to `buf.len()`
        // bytes that a `VolatileSlice` guarantees valid for writes while the guard lives, and
        // the kernel writes at most `buf.len()` bytes there. No Rust reference to that memory
        // exists (it is volatile memory, written here only by the kernel).
        unsafe {
            libc::pread(
                file.as_raw_fd(),
                guard.as_ptr().cast::<libc::c_void>(),
                buf.len(),
                off,
            )
        }
    });
    match r {
        // n <= buf.len() by the contract of pread.
        Ok(n) => buf.bitmap().mark_dirty(0, n),
        // A failed read may have written part of the buffer.
        Err(_) => buf.bitmap().mark_dirty(0, buf.len()),
    }
    r
}

// The call mirrors pread_volatile's; the guard (read-only here) and the SAFETY terms differ,
// so each keeps its own unsafe block.
/// One `pwrite` from a volatile slice, retried on EINTR.
fn pwrite_volatile<B: BitmapSlice>(
    file: &File,
    offset: u64,
    buf: &VolatileSlice<B>,
) -> io::Result<usize> {
    let off = off_t(offset)?;
    let guard = buf.ptr_guard();
    retry_eintr(|| {
        // SAFETY: the fd is open for the lifetime of `file`; `guard` points to `buf.len()`
        // bytes that a `VolatileSlice` guarantees valid for reads while the guard lives; the
        // kernel only reads them.
        unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                guard.as_ptr().cast::<libc::c_void>(),
                buf.len(),
                off,
            )
        }
    })
}

/// `fallocate(2)`; `Ok(false)` when the file system does not support `mode`.
fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<bool> {
    let off = off_t(offset)?;
    let len = off_t(len)?;
    // SAFETY: fallocate only takes integers; the fd is open for the lifetime of `file`.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, off, len) };
    if r == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(false),
        _ => Err(err),
    }
}

impl RawDisk {
    /// Opens `path` read-write (or read-only).
    ///
    /// # Errors
    /// The open or seek error.
    pub fn open(path: &Path, readonly: bool) -> io::Result<Self> {
        Self::open_with(path, readonly, CacheMode::Writeback)
    }

    /// Opens `path` for `cache`: with O_DIRECT for `none` and `directsync`.
    ///
    /// # Errors
    /// The open or seek error; a file system without direct I/O gets the one-line
    /// [`direct_io_refused`] error, never a silent fallback to the page cache.
    pub fn open_with(path: &Path, readonly: bool, cache: CacheMode) -> io::Result<Self> {
        let mut opts = OpenOptions::new();
        opts.read(true).write(!readonly);
        if cache.direct() {
            opts.custom_flags(libc::O_DIRECT);
        }
        let file = opts.open(path).map_err(|e| {
            if cache.direct() && e.raw_os_error() == Some(libc::EINVAL) {
                direct_io_refused(path, cache, &e)
            } else {
                e
            }
        })?;
        let direct = cache.direct().then(|| probe_direct_align(&file));
        let mut disk = Self::from_file(file, readonly)?;
        disk.direct = direct;
        Ok(disk)
    }

    /// Wraps an open file.
    ///
    /// # Errors
    /// The seek error (the length of a block device is found by seeking to its end).
    pub fn from_file(mut file: File, readonly: bool) -> io::Result<Self> {
        let len = file.seek(SeekFrom::End(0))?;
        Ok(Self {
            file,
            capacity: len - len % SECTOR_SIZE,
            readonly,
            direct: None,
        })
    }

    /// True when opened read-only.
    pub fn readonly(&self) -> bool {
        self.readonly
    }

    fn write_zero_bytes(&self, mut offset: u64, len: u64) -> io::Result<()> {
        const CHUNK: usize = 64 * 1024;
        // Page-aligned zeros, so the writes also work with O_DIRECT.
        let zeros = AlignedBuf::new(CHUNK, 4096)?;
        // SAFETY: `zeros` is ours, CHUNK bytes long, and lives to the end of this function.
        let zeros = unsafe { zeros.io_buf().as_volatile() };
        let end = offset
            .checked_add(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "range overflows"))?;
        while offset < end {
            let n = usize::try_from((end - offset).min(CHUNK as u64)).unwrap_or(CHUNK);
            let piece = zeros
                .subslice(0, n)
                .map_err(|e| io::Error::other(e.to_string()))?;
            let mut done = 0usize;
            while done < n {
                let rest = piece
                    .subslice(done, n - done)
                    .map_err(|e| io::Error::other(e.to_string()))?;
                let k = pwrite_volatile(&self.file, offset + done as u64, &rest)?;
                if k == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "write took no bytes",
                    ));
                }
                done += k;
            }
            offset += n as u64;
        }
        Ok(())
    }
}

// Same `Disk` method list as MemDisk and Qcow2Disk; each serves its own backing store.
impl Disk for RawDisk {
    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn read_at<B: BitmapSlice>(
        &self,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> io::Result<usize> {
        pread_volatile(&self.file, offset, buf)
    }

    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize> {
        if self.readonly {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only disk",
            ));
        }
        pwrite_volatile(&self.file, offset, buf)
    }

    fn flush(&self) -> io::Result<()> {
        // fdatasync: the data and the metadata needed to read it back (the file size) are on
        // stable storage when it returns.
        self.file.sync_data()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        // Discard is a hint: a file system without hole punching simply keeps the blocks.
        fallocate(
            &self.file,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
        .map(|_| ())
    }

    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        if fallocate(&self.file, mode, offset, len)? {
            return Ok(());
        }
        self.write_zero_bytes(offset, len)
    }

    fn kind(&self) -> &'static str {
        "raw"
    }

    fn raw_fd(&self) -> Option<RawFd> {
        Some(self.file.as_raw_fd())
    }

    fn direct_align(&self) -> Option<DirectAlign> {
        self.direct
    }
}
