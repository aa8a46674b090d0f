//! A disk in anonymous memory, for tests and benchmarks: the device core's cost without a
//! file system behind it.

use std::io;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{MmapRegion, VolatileMemory, VolatileSlice};

use super::Disk;
use crate::block::SECTOR_SIZE;

/// A zero-filled memory disk. Reads and writes are plain memory copies; flush does nothing.
#[derive(Debug)]
pub struct MemDisk {
    region: MmapRegion,
    capacity: u64,
}

fn range_err() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "access beyond the memory disk",
    )
}

impl MemDisk {
    /// A disk of `bytes` (rounded down to a sector, at least one sector).
    ///
    /// # Errors
    /// When the memory cannot be mapped.
    pub fn new(bytes: u64) -> io::Result<Self> {
        let capacity = (bytes - bytes % SECTOR_SIZE).max(SECTOR_SIZE);
        let len = usize::try_from(capacity).map_err(|_| range_err())?;
        let region = MmapRegion::new(len).map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Self { region, capacity })
    }

    /// The disk's bytes at `offset..offset + len`.
    ///
    /// # Errors
    /// When the range is outside the disk.
    pub fn slice(&self, offset: u64, len: usize) -> io::Result<VolatileSlice<'_>> {
        let off = usize::try_from(offset).map_err(|_| range_err())?;
        self.region.get_slice(off, len).map_err(|_| range_err())
    }

    /// Copies the disk's bytes at `offset` into `dst` (for test assertions).
    ///
    /// # Errors
    /// When the range is outside the disk.
    pub fn read_bytes(&self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        self.slice(offset, dst.len())?.copy_to(dst);
        Ok(())
    }

    /// Copies `src` into the disk at `offset` (to prepare test data).
    ///
    /// # Errors
    /// When the range is outside the disk.
    pub fn write_bytes(&self, offset: u64, src: &[u8]) -> io::Result<()> {
        self.slice(offset, src.len())?.copy_from(src);
        Ok(())
    }

    /// The slice of the disk that `offset..offset + want` covers, clipped at the end.
    fn clip(&self, offset: u64, want: usize) -> io::Result<VolatileSlice<'_>> {
        let left = self.capacity.checked_sub(offset).ok_or_else(range_err)?;
        let n = usize::try_from(left.min(want as u64)).map_err(|_| range_err())?;
        self.slice(offset, n)
    }
}

// Same `Disk` method list as RawDisk and Qcow2Disk; each serves its own backing store.
impl Disk for MemDisk {
    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn read_at<B: BitmapSlice>(
        &self,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> io::Result<usize> {
        let src = self.clip(offset, buf.len())?;
        let dst = buf.offset(0).map_err(|_| range_err())?;
        src.copy_to_volatile_slice(dst);
        Ok(src.len())
    }

    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize> {
        let dst = self.clip(offset, buf.len())?;
        buf.copy_to_volatile_slice(dst);
        Ok(dst.len())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len, true)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _unmap: bool) -> io::Result<()> {
        let n = usize::try_from(len).map_err(|_| range_err())?;
        let s = self.slice(offset, n)?;
        // Zero in bounded chunks from a small static buffer.
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut done = 0;
        while done < n {
            let k = (n - done).min(ZEROS.len());
            s.subslice(done, k)
                .map_err(|_| range_err())?
                .copy_from(&ZEROS[..k]);
            done += k;
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn may_block(&self) -> bool {
        false
    }
}
