//! Disks for tests. [`HookedDisk`] puts a [`DiskHook`] in front of another disk, so a test
//! disk that holds, counts, fails or shortens I/O writes only the operations it changes;
//! [`GateDisk`] (reads of sector 0 held until the test lets them through) and [`SocketDisk`]
//! (io_uring on a socket) are the ones several test files share.

use std::io;
use std::sync::{mpsc, Mutex};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;

use crate::block::{Disk, MemDisk};

/// The operations a [`DiskHook`] sees: discard and write-zeroes count as writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskOp {
    /// [`Disk::read_at`].
    Read,
    /// [`Disk::write_at`], [`Disk::discard`], [`Disk::write_zeroes`].
    Write,
    /// [`Disk::flush`].
    Flush,
}

/// What a [`HookedDisk`] does around each operation on the disk it wraps.
pub trait DiskHook<D: Disk>: Send + Sync + std::fmt::Debug + 'static {
    /// Called before `op` on `len` bytes at `offset` (0 and 0 for a flush) reaches the disk.
    /// `Ok(n)` lets it through with a read or write cut to its first `n` bytes (`len` for
    /// all of it); an error fails it without reaching the disk.
    ///
    /// # Errors
    /// Whatever the hook fails the operation with.
    fn before(&self, op: DiskOp, offset: u64, len: u64) -> io::Result<u64> {
        let _ = (op, offset);
        Ok(len)
    }

    /// Called after `op` succeeded on `disk`.
    ///
    /// # Errors
    /// Whatever the hook fails the operation with.
    fn after(&self, op: DiskOp, disk: &D) -> io::Result<()> {
        let _ = (op, disk);
        Ok(())
    }

    /// [`Disk::kind`].
    fn kind(&self, disk: &D) -> &'static str {
        disk.kind()
    }
}

/// `inner` with `hook` around each of its operations. It has no file descriptor and may
/// block, so a device runs it on the thread pool (or the synchronous path when `aio=sync`
/// asks for it): io_uring would go to a file behind the hook's back.
#[derive(Debug)]
pub struct HookedDisk<D, H> {
    /// The disk the operations reach.
    pub inner: D,
    /// What is done around them.
    pub hook: H,
}

impl<D: Disk, H: DiskHook<D>> HookedDisk<D, H> {
    /// `inner` behind `hook`.
    pub fn new(inner: D, hook: H) -> Self {
        Self { inner, hook }
    }

    /// Runs `f` (given the disk and the length the hook allows) between the hook's calls.
    fn run<T>(
        &self,
        op: DiskOp,
        offset: u64,
        len: u64,
        f: impl FnOnce(&D, u64) -> io::Result<T>,
    ) -> io::Result<T> {
        let allowed = self.hook.before(op, offset, len)?.min(len);
        let r = f(&self.inner, allowed)?;
        self.hook.after(op, &self.inner)?;
        Ok(r)
    }
}

/// The first `n` bytes of `buf` (`n` is at most its length: [`HookedDisk::run`] caps it).
fn head<'a, B: BitmapSlice>(
    buf: &VolatileSlice<'a, B>,
    n: u64,
) -> io::Result<VolatileSlice<'a, B>> {
    let n = usize::try_from(n).map_err(io::Error::other)?;
    buf.subslice(0, n).map_err(io::Error::other)
}

impl<D: Disk, H: DiskHook<D>> Disk for HookedDisk<D, H> {
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    fn read_at<B: BitmapSlice>(
        &self,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> io::Result<usize> {
        self.run(DiskOp::Read, offset, buf.len() as u64, |d, n| {
            d.read_at(offset, &mut head(buf, n)?)
        })
    }

    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize> {
        self.run(DiskOp::Write, offset, buf.len() as u64, |d, n| {
            d.write_at(offset, &head(buf, n)?)
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.run(DiskOp::Flush, 0, 0, |d, _| d.flush())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.run(DiskOp::Write, offset, len, |d, n| d.discard(offset, n))
    }

    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.run(DiskOp::Write, offset, len, |d, n| {
            d.write_zeroes(offset, n, unmap)
        })
    }

    fn kind(&self) -> &'static str {
        self.hook.kind(&self.inner)
    }
}

/// Holds each read of sector 0 until the test sends one message on the other end.
#[derive(Debug)]
pub struct ReadGate(Mutex<mpsc::Receiver<()>>);

impl DiskHook<MemDisk> for ReadGate {
    fn before(&self, op: DiskOp, offset: u64, len: u64) -> io::Result<u64> {
        if op == DiskOp::Read && offset == 0 {
            // A dropped sender (a test that failed while a read was held) lets the read
            // through, so the device can wind down instead of waiting for it for ever.
            let _ = self.0.lock().unwrap().recv();
        }
        Ok(len)
    }

    fn kind(&self, _: &MemDisk) -> &'static str {
        "gate"
    }
}

/// A memory disk whose reads of sector 0 wait for the test: see [`gate_disk`].
pub type GateDisk = HookedDisk<MemDisk, ReadGate>;

/// `mem` with its reads of sector 0 held until the test sends on the returned sender (one
/// message releases one read; dropping the sender releases them all): a slow request, to
/// see what the engine and the worker do behind it.
pub fn gate_disk(mem: MemDisk) -> (GateDisk, mpsc::Sender<()>) {
    let (tx, rx) = mpsc::channel();
    (HookedDisk::new(mem, ReadGate(Mutex::new(rx))), tx)
}

/// A disk that is one end of a socket pair, for io_uring only: a read waits for the peer (for
/// ever, if the peer never sends), a write goes to the peer at once.
#[derive(Debug)]
pub struct SocketDisk(pub std::os::unix::net::UnixStream);

impl Disk for SocketDisk {
    fn capacity(&self) -> u64 {
        1 << 20
    }
    fn read_at<B: BitmapSlice>(&self, _: u64, _: &mut VolatileSlice<B>) -> io::Result<usize> {
        Err(io::Error::other("io_uring only"))
    }
    fn write_at<B: BitmapSlice>(&self, _: u64, _: &VolatileSlice<B>) -> io::Result<usize> {
        Err(io::Error::other("io_uring only"))
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn discard(&self, _: u64, _: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> io::Result<()> {
        Ok(())
    }
    fn kind(&self) -> &'static str {
        "socket"
    }
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(&self.0))
    }
}
