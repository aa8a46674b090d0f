//! Identity page tables for the 64-bit entry: the low 4 GiB mapped with 2 MiB pages.
//!
//! Layout: one PML4 at [`PML4_START`] whose entry 0 points to the PDPT at [`PDPTE_START`],
//! whose entries 0-3 point to four page directories starting at [`PDE_START`]; PD `i` entry
//! `j` maps `(i * 512 + j) * 2 MiB` (present, writable, page size).

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{PDE_START, PDPTE_START, PML4_START};

const PRESENT_WRITABLE: u64 = 0x3;
const PAGE_SIZE_2M: u64 = 0x80;
const NUM_PDS: u64 = 4;

/// The 8-byte entries to write: `(guest address, value)`.
pub fn identity_map_entries() -> impl Iterator<Item = (u64, u64)> {
    let pml4 = std::iter::once((PML4_START, PDPTE_START | PRESENT_WRITABLE));
    let pdpt = (0..NUM_PDS).map(|i| {
        (
            PDPTE_START + i * 8,
            (PDE_START + i * 0x1000) | PRESENT_WRITABLE,
        )
    });
    let pds = (0..NUM_PDS * 512).map(|n| {
        (
            PDE_START + n * 8,
            (n << 21) | PRESENT_WRITABLE | PAGE_SIZE_2M,
        )
    });
    pml4.chain(pdpt).chain(pds)
}

/// Writes the identity map; returns the CR3 value.
///
/// # Errors
/// The page-table area is not in guest memory.
pub fn write_identity_map(mem: &GuestMemoryMmap) -> Result<u64, vm_memory::GuestMemoryError> {
    for (addr, value) in identity_map_entries() {
        mem.write_obj(value, GuestAddress(addr))?;
    }
    Ok(PML4_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks the tables like the MMU for a 2 MiB page.
    fn translate(mem: &GuestMemoryMmap, cr3: u64, va: u64) -> Option<u64> {
        let pml4e: u64 = mem
            .read_obj(GuestAddress(cr3 + ((va >> 39) & 0x1ff) * 8))
            .ok()?;
        if pml4e & 1 == 0 {
            return None;
        }
        let pdpte: u64 = mem
            .read_obj(GuestAddress((pml4e & !0xfff) + ((va >> 30) & 0x1ff) * 8))
            .ok()?;
        if pdpte & 1 == 0 {
            return None;
        }
        let pde: u64 = mem
            .read_obj(GuestAddress((pdpte & !0xfff) + ((va >> 21) & 0x1ff) * 8))
            .ok()?;
        if pde & 1 == 0 || pde & PAGE_SIZE_2M == 0 {
            return None;
        }
        Some((pde & !0x1f_ffff & 0x000f_ffff_ffff_f000) | (va & 0x1f_ffff))
    }

    #[test]
    fn maps_low_4g_identity() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let cr3 = write_identity_map(&mem).unwrap();
        for va in [
            0,
            0x1000,
            0x1f_ffff,
            0x20_0000,
            0x4000_0000,
            0xfee0_0000,
            0xffff_ffff,
        ] {
            assert_eq!(translate(&mem, cr3, va), Some(va), "{va:#x}");
        }
        assert_eq!(translate(&mem, cr3, 0x1_0000_0000), None);
        // The tables do not overlap the zero page or the GDT.
        assert!(identity_map_entries().all(|(a, _)| (0x9000..0xf000).contains(&a)));
    }
}
