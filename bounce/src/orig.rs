//! Where original buffers live: guest memory, or a host buffer.

use vm_memory::bitmap::MS;
use vm_memory::{
    GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryRegion, Permissions, VolatileSlice,
};

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

/// The slice of plain guest memory (no IOMMU in between) behind `addr..addr + len` when the
/// range lies in one region: one region lookup and nothing else, the hot path of every bounce
/// copy (no slice iterator, no per-piece results). Plain memory has no per-access permissions
/// (`GuestMemory` ignores them for it), so this is exactly what [`whole_slice`] would give.
#[inline]
fn region_slice<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    len: usize,
) -> Option<VolatileSlice<'_, MS<'_, M::PhysicalMemory>>> {
    let (region, off) = mem.physical_memory()?.to_region_addr(GuestAddress(addr))?;
    region.get_slice(off, len).ok()
}

/// The one slice of guest memory behind `addr..addr + len`, when the range lies in one
/// region (the common case): a single translation serves both the check and the copy.
fn whole_slice<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    len: usize,
    perm: Permissions,
) -> Option<VolatileSlice<'_, vm_memory::bitmap::BS<'_, M::Bitmap>>> {
    let mut slices = mem.get_slices(GuestAddress(addr), len, perm).ok()?;
    match slices.next() {
        Some(Ok(s)) if s.len() == len => Some(s),
        _ => None,
    }
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
        if let Some(s) = region_slice(self, addr, len) {
            s.copy_to_volatile_slice(*dst);
            return Ok(());
        }
        if let Some(s) = whole_slice(self, addr, len, Permissions::Read) {
            s.copy_to_volatile_slice(*dst);
            return Ok(());
        }
        copy_piecewise(self, addr, len, false, |s, done| {
            s.copy_to_volatile_slice(dst.subslice(done, s.len()).ok()?);
            Some(())
        })
    }

    // Mirror of read_orig's two one-slice paths: the copy runs the other way and the whole
    // slice is asked for ReadWrite, so each direction spells its own.
    fn write_orig(&self, addr: u64, src: &VolatileSlice<'_>) -> Result<()> {
        let len = src.len();
        if let Some(s) = region_slice(self, addr, len) {
            // Marks the region's dirty bitmap, as the copy through `whole_slice` would.
            src.copy_to_volatile_slice(s);
            return Ok(());
        }
        // ReadWrite: what `check` asks of a written range.
        if let Some(s) = whole_slice(self, addr, len, Permissions::ReadWrite) {
            src.copy_to_volatile_slice(s);
            return Ok(());
        }
        copy_piecewise(self, addr, len, true, |s, done| {
            src.subslice(done, s.len()).ok()?.copy_to_volatile_slice(s);
            Some(())
        })
    }
}

/// The copy of a range across regions (or not plain guest memory): checks the whole range
/// (for writing, when `write`), then hands `copy` each piece with its offset in the range.
/// `copy` returns `None` when the piece does not fit the caller's buffer.
fn copy_piecewise<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    len: usize,
    write: bool,
    mut copy: impl FnMut(VolatileSlice<'_, vm_memory::bitmap::BS<'_, M::Bitmap>>, usize) -> Option<()>,
) -> Result<()> {
    let err = || Error::OrigAccess { addr, len };
    if !mem.check(addr, len, write) {
        return Err(err());
    }
    let perm = if write {
        Permissions::Write
    } else {
        Permissions::Read
    };
    let mut done = 0;
    for s in mem
        .get_slices(GuestAddress(addr), len, perm)
        .map_err(|_| err())?
    {
        let s = s.map_err(|_| err())?;
        let n = s.len();
        copy(s, done).ok_or_else(err)?;
        done += n;
    }
    if done == len {
        Ok(())
    } else {
        Err(err())
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

/// Guest memory of two adjacent regions (`first` bytes at 0, then `second` bytes) with a dirty
/// log, for the tests that check which copies mark guest pages dirty.
#[cfg(test)]
pub(crate) fn logged_memory(
    first: usize,
    second: usize,
) -> vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap> {
    vm_memory::GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), first),
        (GuestAddress(first as u64), second),
    ])
    .unwrap()
}

/// True when the dirty log of `mem` marks the page of guest address `addr`.
#[cfg(test)]
pub(crate) fn is_dirty(
    mem: &vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>,
    addr: u64,
) -> bool {
    use vm_memory::bitmap::Bitmap;
    let (r, off) = mem.to_region_addr(GuestAddress(addr)).unwrap();
    r.bitmap().dirty_at(off.0 as usize)
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestMemoryMmap};

    use super::*;

    /// Two adjacent regions (0..0x1000, 0x1000..0x2000), then a hole, then 0x3000..0x4000.
    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x3000), 0x1000),
        ])
        .unwrap()
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn copies_inside_one_region_and_across_adjacent_regions() {
        let m = mem();
        // Inside one region, and across the 0x1000 boundary (two slices).
        for (addr, len) in [(0x100u64, 76usize), (0xfc0, 0x80), (0x3ff0, 0x10)] {
            let data = pattern(len);
            m.write_orig(addr, &VolatileSlice::from(&mut data.clone()[..]))
                .unwrap();
            let mut back = vec![0u8; len];
            m.read_slice(&mut back, GuestAddress(addr)).unwrap();
            assert_eq!(back, data, "write_orig at {addr:#x}+{len:#x}");
            let mut got = vec![0u8; len];
            m.read_orig(addr, &VolatileSlice::from(&mut got[..]))
                .unwrap();
            assert_eq!(got, data, "read_orig at {addr:#x}+{len:#x}");
        }
    }

    #[test]
    fn a_range_into_a_hole_fails_and_copies_nothing() {
        let m = mem();
        m.write_slice(&[0xaa; 0x40], GuestAddress(0x1fc0)).unwrap();
        // 0x1fc0..0x2040 runs into the hole at 0x2000, and 0x2800 is in it.
        for addr in [0x1fc0u64, 0x2800] {
            let mut src = [0x55u8; 0x80];
            let e = m.write_orig(addr, &VolatileSlice::from(&mut src[..]));
            assert!(matches!(e, Err(Error::OrigAccess { .. })), "{e:?}");
            let mut dst = [0x11u8; 0x80];
            let e = m.read_orig(addr, &VolatileSlice::from(&mut dst[..]));
            assert!(matches!(e, Err(Error::OrigAccess { .. })), "{e:?}");
            assert_eq!(dst, [0x11; 0x80], "read_orig at {addr:#x} copied");
        }
        let mut back = [0u8; 0x40];
        m.read_slice(&mut back, GuestAddress(0x1fc0)).unwrap();
        assert_eq!(back, [0xaa; 0x40], "a failed write_orig wrote guest memory");
    }

    #[test]
    fn copies_into_guest_memory_mark_its_dirty_bitmap() {
        // One region with a dirty log of 4 KiB pages (vhost-user's), and a range across two
        // regions: both the one-region fast path and the piecewise path must log the write.
        let m = logged_memory(0x4000, 0x2000);
        let dirty = |addr: u64| is_dirty(&m, addr);
        let data = pattern(0x100);
        m.write_orig(0x1080, &VolatileSlice::from(&mut data.clone()[..]))
            .unwrap();
        assert!(
            dirty(0x1080) && dirty(0x117f),
            "one-region write not logged"
        );
        assert!(
            !dirty(0x0) && !dirty(0x2000),
            "pages not written were logged"
        );
        m.write_orig(0x3f80, &VolatileSlice::from(&mut data.clone()[..]))
            .unwrap();
        assert!(
            dirty(0x3f80) && dirty(0x4000),
            "cross-region write not logged"
        );
        // Reads log nothing.
        let mut got = vec![0u8; 0x100];
        m.read_orig(0x5000, &VolatileSlice::from(&mut got[..]))
            .unwrap();
        assert!(!dirty(0x5000), "a read was logged as a write");
    }
}
