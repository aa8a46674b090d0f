//! The e820 memory map handed to Linux (boot_params) and to PVH (hvm_memmap_table).
//!
//! ```text
//! [0, EBDA_START)            RAM
//! [EBDA_START, 0xa0000)      reserved (EBDA)
//! [ACPI_START, 1 MiB)        reserved (BIOS area: ACPI tables at 0xE0000, MP table at 0xF0000)
//! [1 MiB, end of low RAM)    RAM
//! [4 GiB, ...)               RAM, when guest RAM is larger than the MMIO hole start
//! ```

use crate::layout::{ACPI_START, EBDA_START, HIMEM_START};
use crate::memory::RamRange;

/// Usable RAM.
pub const E820_RAM: u32 = 1;
/// Reserved.
pub const E820_RESERVED: u32 = 2;

/// One e820 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// Start address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// [`E820_RAM`] or [`E820_RESERVED`].
    pub kind: u32,
}

/// Errors of e820 construction.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// Guest RAM must start at 0 and extend past 1 MiB (the kernel loads there).
    #[error("guest RAM must start at 0 and exceed 1 MiB")]
    TooLittleRam,
}

/// Builds the map for the RAM ranges of [`crate::memory::ram_ranges`].
///
/// # Errors
/// [`Error::TooLittleRam`].
pub fn e820_map(ram: &[RamRange]) -> Result<Vec<E820Entry>, Error> {
    let low = ram.first().ok_or(Error::TooLittleRam)?;
    if low.start != 0 || low.end() <= HIMEM_START {
        return Err(Error::TooLittleRam);
    }
    let mut map = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        E820Entry {
            addr: EBDA_START,
            size: 0xa0000 - EBDA_START,
            kind: E820_RESERVED,
        },
        E820Entry {
            addr: ACPI_START,
            size: HIMEM_START - ACPI_START,
            kind: E820_RESERVED,
        },
        E820Entry {
            addr: HIMEM_START,
            size: low.end() - HIMEM_START,
            kind: E820_RAM,
        },
    ];
    map.extend(ram[1..].iter().map(|r| E820Entry {
        addr: r.start,
        size: r.len,
        kind: E820_RAM,
    }));
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram_ranges;

    #[test]
    fn small_vm() {
        let m = e820_map(&ram_ranges(512 << 20).unwrap()).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(
            m[0],
            E820Entry {
                addr: 0,
                size: 0x9fc00,
                kind: E820_RAM
            }
        );
        assert_eq!(
            m[3],
            E820Entry {
                addr: 0x10_0000,
                size: (512 << 20) - 0x10_0000,
                kind: E820_RAM
            }
        );
        // Sorted and non-overlapping.
        for w in m.windows(2) {
            assert!(w[0].addr + w[0].size <= w[1].addr);
        }
    }

    #[test]
    fn large_vm_has_high_ram_and_a_hole() {
        let m = e820_map(&ram_ranges(6 << 30).unwrap()).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m[3].addr + m[3].size, 0xc000_0000);
        assert_eq!(
            m[4],
            E820Entry {
                addr: 1 << 32,
                size: 3 << 30,
                kind: E820_RAM
            }
        );
        let ram: u64 = m
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum();
        // Everything except the 384 KiB below 1 MiB that is not listed as RAM.
        assert_eq!(ram, (6 << 30) - (HIMEM_START - EBDA_START));
    }

    #[test]
    fn tiny_vm_rejected() {
        assert_eq!(
            e820_map(&ram_ranges(1 << 20).unwrap()),
            Err(Error::TooLittleRam)
        );
        assert_eq!(e820_map(&[]), Err(Error::TooLittleRam));
    }
}
