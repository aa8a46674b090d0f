//! Segment descriptors and the boot GDT.
//!
//! A descriptor packs base (32 bits), limit (20 bits) and a 12-bit flags field (access byte
//! in bits 0-7, granularity/size/long/available nibble in bits 12-15) as the CPU defines.

use kvm_bindings::kvm_segment;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::BOOT_GDT_START;

/// Encodes a descriptor from `flags` (0xGFAA: G/D/L/AVL nibble at 12-15, access byte at
/// 0-7), `base` and `limit`.
pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = u64::from(base);
    let limit = u64::from(limit);
    let flags = u64::from(flags);
    (limit & 0xffff)
        | (base & 0xff_ffff) << 16
        | (flags & 0xff) << 40
        | ((limit >> 16) & 0xf) << 48
        | ((flags >> 12) & 0xf) << 52
        | ((base >> 24) & 0xff) << 56
}

/// Decodes descriptor `entry` at GDT index `index` into KVM's segment register form.
pub fn kvm_segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let bit = |n: u32| ((entry >> n) & 1) as u8;
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 56) & 0xff) << 24;
    let raw_limit = ((entry & 0xffff) | ((entry >> 48) & 0xf) << 16) as u32;
    let g = bit(55);
    let limit = if g == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    let present = bit(47);
    kvm_segment {
        base,
        limit,
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: bit(54),
        s: bit(44),
        l: bit(53),
        g,
        avl: bit(52),
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// GDT index of the code segment in the boot GDTs.
pub const CODE_INDEX: u8 = 1;
/// GDT index of the data segment.
pub const DATA_INDEX: u8 = 2;
/// GDT index of the TSS.
pub const TSS_INDEX: u8 = 3;

/// The 64-bit boot GDT: null, 64-bit code, data, TSS.
pub fn gdt_long_mode() -> [u64; 4] {
    [
        0,
        gdt_entry(0xa09b, 0, 0xfffff),
        gdt_entry(0xc093, 0, 0xfffff),
        gdt_entry(0x808b, 0, 0xfffff),
    ]
}

/// The flat 32-bit GDT (PVH entry): null, 32-bit code, data, TSS.
pub fn gdt_flat32() -> [u64; 4] {
    [
        0,
        gdt_entry(0xc09b, 0, 0xfffff),
        gdt_entry(0xc093, 0, 0xfffff),
        gdt_entry(0x008b, 0, 0x67),
    ]
}

/// Writes `gdt` at [`BOOT_GDT_START`].
///
/// # Errors
/// The GDT area is not in guest memory.
pub fn write_gdt(mem: &GuestMemoryMmap, gdt: &[u64]) -> Result<(), vm_memory::GuestMemoryError> {
    for (i, entry) in gdt.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(BOOT_GDT_START + 8 * i as u64))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_encodings() {
        // Classic values: flat 64-bit code and flat data.
        assert_eq!(gdt_entry(0xa09b, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(0xc093, 0, 0xfffff), 0x00cf_9300_0000_ffff);
        assert_eq!(gdt_entry(0x808b, 0x1234_5678, 0x67), 0x1280_8b34_5678_0067);
    }

    #[test]
    fn decode_roundtrip() {
        let code = kvm_segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(
            (code.selector, code.type_, code.l, code.db, code.g),
            (8, 0xb, 1, 0, 1)
        );
        assert_eq!(
            (code.present, code.s, code.dpl, code.unusable),
            (1, 1, 0, 0)
        );
        assert_eq!(code.limit, 0xffff_ffff);
        let tss = kvm_segment_from_gdt(gdt_entry(0x008b, 0x1234_5678, 0x67), 3);
        assert_eq!(
            (tss.base, tss.limit, tss.s, tss.selector),
            (0x1234_5678, 0x67, 0, 0x18)
        );
        assert_eq!(kvm_segment_from_gdt(0, 0).unusable, 1);
    }
}
