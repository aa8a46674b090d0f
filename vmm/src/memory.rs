//! Guest RAM: where it lives in the guest physical address space and how it is allocated.
//!
//! RAM fills the address space from 0 up to [`MMIO_HOLE_START`]; whatever does not fit below
//! the hole continues at [`HIGH_RAM_START`] (4 GiB), leaving the 32-bit MMIO hole (PCI BARs,
//! ECAM, IOAPIC, LAPIC, KVM's TSS) unbacked so accesses there exit to the VMM.

use vm_memory::{GuestAddress, GuestMemoryMmap};

use crate::layout::{HIGH_RAM_START, MMIO_HOLE_START};

/// Errors of guest memory setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The size is zero or not a multiple of the page size.
    #[error("guest memory size {size:#x} must be a non-zero multiple of 4 KiB")]
    InvalidSize {
        /// Requested size in bytes.
        size: u64,
    },
    /// The size does not fit in the guest physical address space or the host's `usize`.
    #[error("guest memory size {size:#x} is too large")]
    TooLarge {
        /// Requested size in bytes.
        size: u64,
    },
    /// Mapping the memory failed.
    #[error("cannot allocate {size:#x} bytes of guest memory: {source}")]
    Allocate {
        /// Requested size in bytes.
        size: u64,
        /// Underlying error.
        source: vm_memory::mmap::FromRangesError,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// A contiguous range of guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamRange {
    /// Guest physical start address.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RamRange {
    /// First address after the range (cannot overflow: ranges are built by [`ram_ranges`]).
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Splits `size` bytes of RAM around the 32-bit MMIO hole.
///
/// Returns one range when `size <= MMIO_HOLE_START`, otherwise `[0, hole)` and
/// `[4 GiB, 4 GiB + size - hole)`.
///
/// # Errors
/// [`Error::InvalidSize`] for zero or unaligned sizes, [`Error::TooLarge`] when the high range
/// would overflow the address space.
pub fn ram_ranges(size: u64) -> Result<Vec<RamRange>> {
    const PAGE: u64 = 4096;
    if size == 0 || size % PAGE != 0 {
        return Err(Error::InvalidSize { size });
    }
    if size <= MMIO_HOLE_START {
        return Ok(vec![RamRange {
            start: 0,
            len: size,
        }]);
    }
    let high = size - MMIO_HOLE_START;
    // Keep the top of RAM within 46 bits of physical address space (a common host limit).
    match HIGH_RAM_START.checked_add(high) {
        Some(end) if end <= 1 << 46 => {}
        _ => return Err(Error::TooLarge { size }),
    }
    Ok(vec![
        RamRange {
            start: 0,
            len: MMIO_HOLE_START,
        },
        RamRange {
            start: HIGH_RAM_START,
            len: high,
        },
    ])
}

/// Allocates anonymous guest RAM of `size` bytes laid out by [`ram_ranges`].
///
/// # Errors
/// See [`ram_ranges`]; [`Error::Allocate`] when mmap fails.
pub fn create_guest_memory(size: u64) -> Result<GuestMemoryMmap> {
    let ranges = ram_ranges(size)?
        .into_iter()
        .map(|r| {
            let len = usize::try_from(r.len).map_err(|_| Error::TooLarge { size })?;
            Ok((GuestAddress(r.start), len))
        })
        .collect::<Result<Vec<_>>>()?;
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| Error::Allocate { size, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_memory_is_one_range() {
        assert_eq!(
            ram_ranges(1 << 30).unwrap(),
            vec![RamRange {
                start: 0,
                len: 1 << 30
            }]
        );
        assert_eq!(ram_ranges(MMIO_HOLE_START).unwrap().len(), 1);
    }

    #[test]
    fn large_memory_skips_the_hole() {
        let r = ram_ranges(4 << 30).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].end(), MMIO_HOLE_START);
        assert_eq!(r[1].start, 1 << 32);
        assert_eq!(r[0].len + r[1].len, 4 << 30);
    }

    #[test]
    fn bad_sizes_are_rejected() {
        assert!(matches!(ram_ranges(0), Err(Error::InvalidSize { .. })));
        assert!(matches!(ram_ranges(4097), Err(Error::InvalidSize { .. })));
        assert!(matches!(ram_ranges(!0xfff), Err(Error::TooLarge { .. })));
    }
}
