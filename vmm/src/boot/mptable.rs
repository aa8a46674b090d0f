//! The Intel MultiProcessor Specification 1.4 table: how Linux (without ACPI) finds every
//! vCPU, the IOAPIC and the ISA interrupt routing.
//!
//! Layout at [`MPTABLE_START`] (scanned by Linux in the BIOS area 0xF0000-0xFFFFF):
//! floating pointer (16 bytes), then the configuration table: header (44 bytes), one
//! processor entry (20 bytes) per vCPU (APIC id = vCPU id, vCPU 0 is the BSP), an ISA bus
//! entry, the IOAPIC (id = vCPU count), one I/O interrupt entry per IOAPIC pin (pin 0 ExtINT,
//! the rest INT, ISA IRQ n -> pin n, matching KVM's default GSI routing), and two local
//! interrupt entries (LINT0 ExtINT, LINT1 NMI). Both structures carry checksums that make
//! their bytes sum to 0.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{APIC_START, IOAPIC_START, MPTABLE_MAX_SIZE, MPTABLE_START};

// MP table values: constants, alike in shape only to other tables.
/// Number of IOAPIC pins described (KVM's IOAPIC has 24).
pub const IOAPIC_PINS: u8 = 24;
const MP_SPEC_REV: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
/// CPU signature (family 6) and feature flags (FPU, APIC) reported per processor.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IOINT: u8 = 3;
const ENTRY_LINT: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
const ISA_BUS_ID: u8 = 0;

// Same variants as acpi.rs's Error; kept apart because each names its own table.
/// Errors of MP table setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No vCPUs, or more than the 254 APIC ids an xAPIC MP table can describe.
    #[error("cannot describe {0} vCPUs in an MP table")]
    BadCpuCount(usize),
    /// The table does not fit the BIOS area.
    #[error("MP table of {0} bytes does not fit")]
    TooLarge(usize),
    /// Writing guest memory failed.
    #[error("cannot write the MP table: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer and configuration table for `num_cpus` vCPUs, to be placed
/// at guest address `base`.
///
/// # Errors
/// [`Error::BadCpuCount`], [`Error::TooLarge`].
pub fn build_mptable(num_cpus: usize, base: u64) -> Result<Vec<u8>> {
    if num_cpus == 0 || num_cpus > 254 {
        return Err(Error::BadCpuCount(num_cpus));
    }
    let ioapic_id = num_cpus as u8;
    let table_addr = u32::try_from(base + 16).map_err(|_| Error::TooLarge(0))?;

    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..num_cpus as u8 {
        entries.extend([ENTRY_PROCESSOR, id, APIC_VERSION]);
        entries.push(CPU_ENABLED | if id == 0 { CPU_BSP } else { 0 });
        entries.extend(CPU_SIGNATURE.to_le_bytes());
        entries.extend(CPU_FEATURES.to_le_bytes());
        entries.extend([0u8; 8]);
        count += 1;
    }
    entries.extend([ENTRY_BUS, ISA_BUS_ID]);
    entries.extend(*b"ISA   ");
    count += 1;
    entries.extend([ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend((IOAPIC_START as u32).to_le_bytes());
    count += 1;
    for pin in 0..IOAPIC_PINS {
        let kind = if pin == 0 {
            INT_TYPE_EXTINT
        } else {
            INT_TYPE_INT
        };
        // type, irq type, flags (conforming polarity/trigger, 2 bytes), source bus, source
        // IRQ, destination IOAPIC, destination pin.
        entries.extend([ENTRY_IOINT, kind, 0, 0, ISA_BUS_ID, pin, ioapic_id, pin]);
        count += 1;
    }
    // LINT0 of the BSP is ExtINT; LINT1 of all local APICs (0xff) is NMI.
    entries.extend([ENTRY_LINT, INT_TYPE_EXTINT, 0, 0, ISA_BUS_ID, 0, 0, 0]);
    entries.extend([ENTRY_LINT, INT_TYPE_NMI, 0, 0, ISA_BUS_ID, 0, 0xff, 1]);
    count += 2;

    let table_len = 44 + entries.len();
    let total = 16 + table_len;
    if total > MPTABLE_MAX_SIZE {
        return Err(Error::TooLarge(total));
    }

    let mut table = Vec::with_capacity(table_len);
    table.extend(*b"PCMP");
    table.extend((table_len as u16).to_le_bytes());
    table.push(MP_SPEC_REV);
    table.push(0); // checksum, patched below
    table.extend(*b"BOUNCEVM");
    table.extend(*b"000000000000");
    table.extend(0u32.to_le_bytes()); // OEM table pointer
    table.extend(0u16.to_le_bytes()); // OEM table size
    table.extend(count.to_le_bytes());
    table.extend((APIC_START as u32).to_le_bytes());
    table.extend([0u8; 4]); // extended table length, checksum, reserved
    table.extend(entries);
    table[7] = checksum(&table);

    let mut fp = Vec::with_capacity(16);
    fp.extend(*b"_MP_");
    fp.extend(table_addr.to_le_bytes());
    fp.push(1); // length in 16-byte units
    fp.push(MP_SPEC_REV);
    fp.push(0); // checksum, patched below
    fp.extend([0u8; 5]); // feature bytes: 0 = configuration table present
    fp[10] = checksum(&fp);

    fp.extend(table);
    Ok(fp)
}

/// Writes the MP table for `num_cpus` vCPUs at [`MPTABLE_START`].
///
/// # Errors
/// See [`build_mptable`]; [`Error::Memory`].
pub fn write_mptable(mem: &GuestMemoryMmap, num_cpus: usize) -> Result<()> {
    let bytes = build_mptable(num_cpus, MPTABLE_START)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_header() {
        for cpus in [1, 2, 8, 254] {
            let t = build_mptable(cpus, MPTABLE_START).unwrap();
            assert_eq!(&t[..4], b"_MP_");
            assert_eq!(sum(&t[..16]), 0, "floating pointer checksum, {cpus} cpus");
            let phys = u32::from_le_bytes(t[4..8].try_into().unwrap());
            assert_eq!(u64::from(phys), MPTABLE_START + 16);
            let table = &t[16..];
            assert_eq!(&table[..4], b"PCMP");
            let len = usize::from(u16::from_le_bytes(table[4..6].try_into().unwrap()));
            assert_eq!(len, table.len());
            assert_eq!(sum(table), 0, "table checksum, {cpus} cpus");
            let count = u16::from_le_bytes(table[34..36].try_into().unwrap());
            assert_eq!(usize::from(count), cpus + 1 + 1 + 24 + 2);
            assert_eq!(len, 44 + 20 * cpus + 8 + 8 + 24 * 8 + 2 * 8);
        }
    }

    #[test]
    fn processors_and_ioapic() {
        let t = build_mptable(3, MPTABLE_START).unwrap();
        let entries = &t[16 + 44..];
        for id in 0..3u8 {
            let e = &entries[20 * usize::from(id)..][..20];
            assert_eq!((e[0], e[1]), (ENTRY_PROCESSOR, id));
            assert_eq!(e[3] & CPU_BSP != 0, id == 0);
            assert_eq!(e[3] & CPU_ENABLED, CPU_ENABLED);
        }
        let ioapic = &entries[60 + 8..][..8];
        assert_eq!((ioapic[0], ioapic[1]), (ENTRY_IOAPIC, 3));
        assert_eq!(
            u32::from_le_bytes(ioapic[4..8].try_into().unwrap()),
            0xfec0_0000
        );
        let pin4 = &entries[60 + 16 + 4 * 8..][..8];
        assert_eq!(
            (pin4[0], pin4[1], pin4[5], pin4[6], pin4[7]),
            (ENTRY_IOINT, 0, 4, 3, 4)
        );
    }

    #[test]
    fn bad_counts() {
        assert!(matches!(
            build_mptable(0, MPTABLE_START),
            Err(Error::BadCpuCount(0))
        ));
        assert!(build_mptable(255, MPTABLE_START).is_err());
    }

    #[test]
    fn written_to_memory() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        write_mptable(&mem, 2).unwrap();
        let mut sig = [0u8; 4];
        mem.read_slice(&mut sig, GuestAddress(MPTABLE_START))
            .unwrap();
        assert_eq!(&sig, b"_MP_");
    }
}
