//! Where original buffers live: guest memory, or a host buffer.

use vm_memory::{GuestAddress, GuestMemory, Permissions, VolatileSlice};

use crate::error::{Error, Result};

/// Memory holding the original (not bounced) buffers.
///
/// Implemented for every `vm-memory` [`GuestMemory`] (plain guest RAM, or an IOMMU-translated
/// view of it) and for [`HostMemory`]. Ranges are checked whole before the first byte is copied.
pub trait OrigMemory {
    /// True when `addr..addr + len` can be read (and written, if `write`).
    fn check(&self, addr: u64, len: usize, write: bool) -> bool;

    /// Copies `dst.len()` bytes starting at original address `addr` into `dst`.
    ///
    /// # Errors
    /// [`Error::OrigAccess`] when the range is not entirely accessible; nothing is copied then.
    fn read_orig(&self, addr: u64, dst: &VolatileSlice<'_>) -> Result<()>;

    /// Copies `src` to original address `addr`.
    ///
    /// # Errors
    /// [`Error::OrigAccess`] when the range is not entirely accessible; nothing is copied then.
    fn write_orig(&self, addr: u64, src: &VolatileSlice<'_>) -> Result<()>;
}

impl<M: GuestMemory + ?Sized> OrigMemory for M {
    fn check(&self, addr: u64, len: usize, write: bool) -> bool {
        let perm = if write {
            Permissions::ReadWrite
        } else {
            Permissions::Read
        };
        len == 0 || GuestMemory::check_range(self, GuestAddress(addr), len, perm)
    }

    fn read_orig(&self, addr: u64, dst: &VolatileSlice<'_>) -> Result<()> {
        let len = dst.len();
        let err = || Error::OrigAccess { addr, len };
        if !self.check(addr, len, false) {
            return Err(err());
        }
        let mut done = 0;
        let slices = self
            .get_slices(GuestAddress(addr), len, Permissions::Read)
            .map_err(|_| err())?;
        for s in slices {
            let s = s.map_err(|_| err())?;
            let part = dst.subslice(done, s.len()).map_err(|_| err())?;
            s.copy_to_volatile_slice(part);
            done += s.len();
        }
        if done == len {
            Ok(())
        } else {
            Err(err())
        }
    }

    fn write_orig(&self, addr: u64, src: &VolatileSlice<'_>) -> Result<()> {
        let len = src.len();
        let err = || Error::OrigAccess { addr, len };
        if !self.check(addr, len, true) {
            return Err(err());
        }
        let mut done = 0;
        let slices = self
            .get_slices(GuestAddress(addr), len, Permissions::Write)
            .map_err(|_| err())?;
        for s in slices {
            let s = s.map_err(|_| err())?;
            let n = s.len();
            let part = src.subslice(done, n).map_err(|_| err())?;
            part.copy_to_volatile_slice(s);
            done += n;
        }
        if done == len {
            Ok(())
        } else {
            Err(err())
        }
    }
}

/// A host buffer used as original memory: addresses `base..base + len` map onto it.
#[derive(Debug)]
pub struct HostMemory<'a> {
    base: u64,
    mem: VolatileSlice<'a>,
}

impl<'a> HostMemory<'a> {
    /// Original addresses `base..base + buf.len()` refer to `buf`.
    pub fn new(base: u64, buf: &'a mut [u8]) -> Self {
        Self {
            base,
            mem: VolatileSlice::from(buf),
        }
    }

    fn range(&self, addr: u64, len: usize) -> Option<VolatileSlice<'a>> {
        let off = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        self.mem.subslice(off, len).ok()
    }
}

impl OrigMemory for HostMemory<'_> {
    fn check(&self, addr: u64, len: usize, _write: bool) -> bool {
        self.range(addr, len).is_some()
    }

    fn read_orig(&self, addr: u64, dst: &VolatileSlice<'_>) -> Result<()> {
        let len = dst.len();
        let src = self
            .range(addr, len)
            .ok_or(Error::OrigAccess { addr, len })?;
        src.copy_to_volatile_slice(*dst);
        Ok(())
    }

    fn write_orig(&self, addr: u64, src: &VolatileSlice<'_>) -> Result<()> {
        let len = src.len();
        let dst = self
            .range(addr, len)
            .ok_or(Error::OrigAccess { addr, len })?;
        src.copy_to_volatile_slice(dst);
        Ok(())
    }
}

/// Original memory that is not there and costs nothing: every address is accessible, and
/// nothing is copied either way (a read leaves the bounce buffer as it was, a write is
/// discarded). For measuring placement without the cost of copies (the `nocopy` rows of the
/// benchmarks). Unlike [`crate::trace::NullMemory`], which hands out zeros, it never touches
/// the pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCopyMemory;

impl OrigMemory for NoCopyMemory {
    fn check(&self, _addr: u64, _len: usize, _write: bool) -> bool {
        true
    }

    fn read_orig(&self, _addr: u64, _dst: &VolatileSlice<'_>) -> Result<()> {
        Ok(())
    }

    fn write_orig(&self, _addr: u64, _src: &VolatileSlice<'_>) -> Result<()> {
        Ok(())
    }
}
