//! Minimal ACPI tables: enough for Linux to find the vCPUs, the IOAPIC, the PCI host bridge
//! and the S5 (soft-off) sleep state, so a guest `poweroff` reaches
//! [`crate::legacy::AcpiPm`] and ends the VMM.
//!
//! Layout at [`ACPI_START`] (0xE0000, inside the BIOS area 0xE0000-0xFFFFF that Linux's
//! legacy RSDP scan covers; the e820 map reserves it):
//!
//! ```text
//! +0x000  RSDP (revision 2, 36 bytes; RSDT address 0, XSDT address below)
//! +0x040  XSDT -> FACP, APIC
//! +0x080  FACP (FADT revision 6, 276 bytes; not hardware-reduced)
//! +0x1c0  FACS (64 bytes, 64-byte aligned)
//! +0x200  DSDT (\_S5_ and \_SB.PCI0)
//! ...     APIC (MADT), 16-byte aligned after the DSDT
//! ```
//!
//! The FADT keeps the legacy PC: dual 8259 (MADT `PCAT_COMPAT`), ISA devices in
//! `IAPC_BOOT_ARCH`, `SMI_CMD` 0 (always in ACPI mode: the PM1a control register reads with
//! `SCI_EN` set), PM1a event block at [`PM1A_EVT_BLK`] (4 bytes), PM1a control block at
//! [`PM1A_CNT_BLK`] (2 bytes), SCI on IRQ 9, no PM timer, no GPE blocks, a fixed-feature power
//! button (QMP `system_powerdown`, see [`crate::legacy::PowerButton`]), no sleep button,
//! C2/C3 latencies that disable those states.
//!
//! `IAPC_BOOT_ARCH` says what the machine lacks, so Linux does not go looking for it: no 8042
//! (the [`crate::legacy::I8042`] is only a reset line, which Linux's `reboot=k` path uses
//! without asking ACPI) and no CMOS RTC (wall-clock time comes from kvmclock). Declared
//! present, both cost a Linux guest a storm of port I/O exits at boot, each a round trip to
//! this VMM: the i8042 driver polls the status port 10,000 times for a controller that never
//! answers, and rtc-cmos polls the update-in-progress bit through ports 0x70/0x71 (16,500
//! accesses each were counted under nested KVM), both in long loops that do not schedule,
//! which a slow or loaded host turns into soft lockups.
//!
//! The MADT matches the MP table of [`super::mptable`] and KVM's default GSI routing
//! (which bouncevm keeps, see [`crate::irq::default_routes`]): one enabled local APIC per
//! vCPU (ACPI processor UID = APIC id = vCPU id), the IOAPIC at [`IOAPIC_START`] with id =
//! vCPU count and GSI base 0, ISA IRQ n = GSI n except for the SCI, which gets an interrupt
//! source override 9 -> 9 level/active-high, and LINT1 = NMI on every local APIC. There is
//! deliberately **no** IRQ0 -> GSI2 override (the QEMU convention): KVM's in-kernel PIT
//! raises GSI 0, which KVM's default routing sends to IOAPIC pin 0 (and the MP table says
//! pin 0), so IRQ0 is identity-mapped like every other ISA IRQ. QEMU can declare IRQ0 -> GSI2
//! only because it re-routes GSI 0 to pin 2.
//!
//! The DSDT has to describe the PCI host bridge: once Linux runs with ACPI, PCI buses are
//! found only through ACPI host bridges (`pci_acpi_init` succeeds, so the legacy bus-0 probe
//! is skipped), and a bridge without `_CRS` windows leaves the BARs unclaimed.

//!
//! The tables are built with rust-vmm's `acpi_tables` crate (the one Cloud Hypervisor uses):
//! RSDP, XSDT, FADT (`FADTBuilder`), FACS, the DSDT's AML (`aml::{Name, Package, Scope,
//! Device, EISAName, ResourceTemplate, AddressSpace, IO}`) and the MADT's processor and
//! IOAPIC entries. The MADT itself is a generic `Sdt` (revision 5 with the `PCAT_COMPAT`
//! flag, which the crate's `MADT` cannot set), and its interrupt source override and local
//! APIC NMI entries, which the crate does not model, are appended as their 10 and 6 bytes.

use acpi_tables::aml::{
    AddressSpace, AddressSpaceCacheable, Device, EISAName, Name, Package, Path, ResourceTemplate,
    Scope, IO,
};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace as GasSpace, GAS};
use acpi_tables::{facs::FACS, rsdp::Rsdp, sdt::Sdt, xsdt::XSDT, Aml};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{
    ACPI_MAX_SIZE, ACPI_SCI_IRQ, ACPI_START, APIC_START, IOAPIC_START, PCI_CONFIG_IO_LEN,
    PCI_CONFIG_IO_PORT, PCI_MMIO32_SIZE, PCI_MMIO32_START, PM1A_CNT_BLK, PM1A_EVT_BLK, PM1_CNT_LEN,
    PM1_EVT_LEN,
};

/// Where the RSDP is written (the start of the ACPI area).
pub const RSDP_ADDR: u64 = ACPI_START;
// Table offsets and lengths in the ACPI area: constants, alike in shape only.
const XSDT_OFFSET: usize = 0x40;
const FADT_OFFSET: usize = 0x80;
const FACS_OFFSET: usize = 0x1c0;
const DSDT_OFFSET: usize = 0x200;

/// Length of a revision-2 RSDP.
pub const RSDP_LEN: usize = 36;
/// Length of a system description table header.
pub const HEADER_LEN: usize = 36;
/// Length of a revision-6 FADT.
pub const FADT_LEN: usize = 276;
/// Length of the FACS.
pub const FACS_LEN: usize = 64;

const OEM_ID: [u8; 6] = *b"BOUNCE";
const OEM_TABLE_ID: [u8; 8] = *b"BOUNCEVM";
const OEM_REVISION: u32 = 1;

// ACPI flag values: constants, alike in shape only to other tables.
/// `IAPC_BOOT_ARCH`: legacy (ISA) devices present.
pub const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
/// `IAPC_BOOT_ARCH`: an 8042 keyboard controller is present.
pub const IAPC_8042: u16 = 1 << 1;
/// `IAPC_BOOT_ARCH`: no CMOS real-time clock at ports 0x70/0x71 (ACPI 5.0).
pub const IAPC_NO_CMOS_RTC: u16 = 1 << 5;
/// MADT flags: the system also has dual 8259 PICs.
pub const MADT_PCAT_COMPAT: u32 = 1;
/// MPS INTI flags of the SCI override: active high (bits 0-1 = 01), level (bits 2-3 = 11).
pub const SCI_INTI_FLAGS: u16 = 0x000d;
/// The S5 sleep type value the DSDT's `\_S5_` package gives (written to `SLP_TYP`).
pub const S5_SLP_TYP: u8 = 5;

// Same variants as mptable.rs's Error; kept apart because each names its own table.
/// Errors of ACPI table setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No vCPUs, or more than the 254 APIC ids an xAPIC MADT entry can hold next to the
    /// IOAPIC id.
    #[error("cannot describe {0} vCPUs in the MADT")]
    BadCpuCount(usize),
    /// The tables do not fit the ACPI area.
    #[error("ACPI tables of {0} bytes do not fit")]
    TooLarge(usize),
    /// Writing guest memory failed.
    #[error("cannot write the ACPI tables: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

fn bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

/// A system-I/O Generic Address Structure for a port block of `len` bytes (access size
/// "undefined", as QEMU does; ACPICA derives the access width from the bit width).
fn gas_io(port: u16, len: u8) -> GAS {
    GAS::new(
        GasSpace::SystemIo,
        len * 8,
        0,
        AccessSize::Undefined,
        port.into(),
    )
}

/// The RSDP (revision 2) pointing at the XSDT.
pub fn build_rsdp(xsdt: u64) -> Vec<u8> {
    bytes(&Rsdp::new(OEM_ID, xsdt))
}

/// The XSDT listing `tables` (64-bit addresses).
pub fn build_xsdt(tables: &[u64]) -> Vec<u8> {
    let mut x = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for &t in tables {
        x.add_entry(t);
    }
    bytes(&x)
}

/// The FADT (revision 6.5, 276 bytes) for a DSDT and FACS at the given addresses.
pub fn build_fadt(dsdt: u64, facs: u64) -> Vec<u8> {
    let mut f = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .flag(Flags::Wbinvd)
        .flag(Flags::ProcC1)
        // No PwrButton flag: the fixed-feature power button exists. No sleep button.
        .flag(Flags::SlpButton);
    // The 32-bit pointers repeat the 64-bit ones (both below 4 GiB); ACPICA warns if they
    // differ. (The builder's dsdt_32/dsdt_64 set only one of each pair.)
    f.firmware_ctrl = (facs as u32).into();
    f.dsdt = (dsdt as u32).into();
    f.x_firmware_ctrl = facs.into();
    f.x_dsdt = dsdt.into();
    f.sci_int = u16::from(ACPI_SCI_IRQ).into();
    // SMI_CMD 0: no SMM, ACPI is always enabled (PM1a_CNT reads with SCI_EN).
    f.pm1a_evt_blk = u32::from(PM1A_EVT_BLK).into();
    f.pm1a_cnt_blk = u32::from(PM1A_CNT_BLK).into();
    f.pm1_evt_len = PM1_EVT_LEN;
    f.pm1_cnt_len = PM1_CNT_LEN;
    f.p_lvl2_lat = 101.into(); // > 100: C2 not supported
    f.p_lvl3_lat = 1001.into(); // > 1000: C3 not supported
                                // ISA devices (the 16550), but no 8042 and no CMOS RTC: see the module documentation.
    f.iapc_boot_arch = (IAPC_LEGACY_DEVICES | IAPC_NO_CMOS_RTC).into();
    f.x_pm1a_evt_blk = gas_io(PM1A_EVT_BLK, PM1_EVT_LEN);
    f.x_pm1a_cnt_blk = gas_io(PM1A_CNT_BLK, PM1_CNT_LEN);
    // RESET_REG: none; Linux falls back to the i8042 reset.
    bytes(&f.finalize())
}

/// The FACS (version 2): no waking vector, global lock free.
pub fn build_facs() -> Vec<u8> {
    let mut f = FACS::new();
    f.version = 2;
    bytes(&f)
}

/// The host bridge's `_CRS` resources: bus numbers 0-255, the configuration ports, I/O
/// windows around them, and the 32-bit BAR window (non-cacheable, read-write).
fn pci_crs_template<R>(f: impl FnOnce(&ResourceTemplate) -> R) -> R {
    let bus = AddressSpace::<u16>::new_bus_number(0, 0xff);
    let cf8 = IO::new(
        PCI_CONFIG_IO_PORT,
        PCI_CONFIG_IO_PORT,
        1,
        PCI_CONFIG_IO_LEN as u8,
    );
    let io_low = AddressSpace::<u16>::new_io(0, PCI_CONFIG_IO_PORT - 1, None);
    let io_high = AddressSpace::<u16>::new_io(0x0d00, 0xffff, None);
    let mem = AddressSpace::<u32>::new_memory(
        AddressSpaceCacheable::NotCacheable,
        true,
        PCI_MMIO32_START as u32,
        (PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32,
        None,
    );
    f(&ResourceTemplate::new(vec![
        &bus, &cf8, &io_low, &io_high, &mem,
    ]))
}

/// The `_CRS` resource template as AML (a Buffer).
pub fn pci_crs() -> Vec<u8> {
    pci_crs_template(|t| bytes(t))
}

/// The DSDT's AML:
///
/// ```text
/// Name (_S5_, Package (4) { 5, 0, 0, 0 })
/// Scope (\_SB) {
///   Device (PCI0) {
///     Name (_HID, EisaId ("PNP0A03"))
///     Name (_ADR, Zero)
///     Name (_UID, Zero)
///     Name (_CRS, ResourceTemplate () { bus 0-255, IO 0xCF8, IO windows, memory window })
///   }
/// }
/// ```
pub fn dsdt_aml() -> Vec<u8> {
    let zero = 0u8;
    let s5 = S5_SLP_TYP;
    let s5_pkg = Package::new(vec![&s5, &zero, &zero, &zero]);
    let mut aml = bytes(&Name::new(Path::new("_S5_"), &s5_pkg));
    let hid = EISAName::new("PNP0A03");
    pci_crs_template(|crs| {
        let hid = Name::new(Path::new("_HID"), &hid);
        let adr = Name::new(Path::new("_ADR"), &zero);
        let uid = Name::new(Path::new("_UID"), &zero);
        let crs = Name::new(Path::new("_CRS"), crs);
        let pci0 = Device::new(Path::new("PCI0"), vec![&hid, &adr, &uid, &crs]);
        aml.extend(bytes(&Scope::new(Path::new("\\_SB_"), vec![&pci0])));
    });
    aml
}

/// The DSDT (revision 2: 64-bit AML integers).
pub fn build_dsdt() -> Vec<u8> {
    let aml = dsdt_aml();
    let mut t = Sdt::new(
        *b"DSDT",
        (HEADER_LEN + aml.len()) as u32,
        2,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    t.write_bytes(HEADER_LEN, &aml);
    t.update_checksum();
    t.as_slice().to_vec()
}

/// The MADT for `num_cpus` vCPUs (see the module documentation).
///
/// # Errors
/// [`Error::BadCpuCount`].
pub fn build_madt(num_cpus: usize) -> Result<Vec<u8>> {
    use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
    if num_cpus == 0 || num_cpus > 254 {
        return Err(Error::BadCpuCount(num_cpus));
    }
    let mut t = Sdt::new(*b"APIC", 44, 5, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    t.write_u32(36, APIC_START as u32);
    t.write_u32(40, MADT_PCAT_COMPAT);
    for id in 0..num_cpus as u8 {
        // ACPI processor UID = APIC id = vCPU id.
        t.append_slice(&bytes(&ProcessorLocalApic::new(
            id,
            id,
            EnabledStatus::Enabled,
        )));
    }
    // The IOAPIC id follows the APIC ids, as in the MP table.
    t.append_slice(&bytes(&IoApic::new(num_cpus as u8, IOAPIC_START as u32, 0)));
    // Interrupt Source Override (type 2, length 10): bus 0 (ISA), source, GSI, MPS flags.
    let mut iso = vec![2, 10, 0, ACPI_SCI_IRQ];
    iso.extend(u32::from(ACPI_SCI_IRQ).to_le_bytes());
    iso.extend(SCI_INTI_FLAGS.to_le_bytes());
    t.append_slice(&iso);
    // Local APIC NMI (type 4, length 6): all processors (0xff), flags 0, LINT1.
    t.append_slice(&[4, 6, 0xff, 0, 0, 1]);
    Ok(t.as_slice().to_vec())
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Builds the whole ACPI area (see the module documentation) for placement at `base`.
///
/// # Errors
/// [`Error::BadCpuCount`], [`Error::TooLarge`].
pub fn build_acpi_tables(num_cpus: usize, base: u64) -> Result<Vec<u8>> {
    let madt = build_madt(num_cpus)?;
    let dsdt = build_dsdt();
    let madt_offset = align(DSDT_OFFSET + dsdt.len(), 16);
    let total = madt_offset + madt.len();
    if total > ACPI_MAX_SIZE {
        return Err(Error::TooLarge(total));
    }
    let at = |off: usize| base + off as u64;
    let fadt = build_fadt(at(DSDT_OFFSET), at(FACS_OFFSET));
    let xsdt = build_xsdt(&[at(FADT_OFFSET), at(madt_offset)]);
    debug_assert!(XSDT_OFFSET + xsdt.len() <= FADT_OFFSET);
    debug_assert!(FADT_OFFSET + fadt.len() <= FACS_OFFSET);
    let mut area = vec![0u8; total];
    let mut place = |off: usize, bytes: &[u8]| {
        area[off..off + bytes.len()].copy_from_slice(bytes);
    };
    place(0, &build_rsdp(at(XSDT_OFFSET)));
    place(XSDT_OFFSET, &xsdt);
    place(FADT_OFFSET, &fadt);
    place(FACS_OFFSET, &build_facs());
    place(DSDT_OFFSET, &dsdt);
    place(madt_offset, &madt);
    Ok(area)
}

/// Writes the tables for `num_cpus` vCPUs at [`ACPI_START`]; returns the RSDP address.
///
/// # Errors
/// See [`build_acpi_tables`]; [`Error::Memory`].
pub fn write_acpi_tables(mem: &GuestMemoryMmap, num_cpus: usize) -> Result<u64> {
    let area = build_acpi_tables(num_cpus, ACPI_START)?;
    mem.write_slice(&area, GuestAddress(ACPI_START))?;
    tracing::info!(rsdp = RSDP_ADDR, len = area.len(), "ACPI tables written");
    Ok(RSDP_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }
    fn u16_at(b: &[u8], o: usize) -> u16 {
        u16::from_le_bytes([b[o], b[o + 1]])
    }
    fn u32_at(b: &[u8], o: usize) -> u32 {
        u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], o: usize) -> u64 {
        u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
    }
    fn check_header(t: &[u8], sig: &[u8; 4], rev: u8) {
        assert_eq!(&t[0..4], sig);
        assert_eq!(u32_at(t, 4) as usize, t.len());
        assert_eq!(t[8], rev);
        assert_eq!(sum(t), 0, "{} checksum", String::from_utf8_lossy(sig));
        assert_eq!(&t[10..16], b"BOUNCE");
    }

    #[test]
    fn rsdp_layout_and_checksums() {
        let r = build_rsdp(0x1234_5678_9abc);
        assert_eq!(&r[..8], b"RSD PTR ");
        assert_eq!(sum(&r[..20]), 0);
        assert_eq!(sum(&r), 0);
        assert_eq!(r[15], 2);
        assert_eq!(u32_at(&r, 16), 0);
        assert_eq!(u32_at(&r, 20), 36);
        assert_eq!(u64_at(&r, 24), 0x1234_5678_9abc);
    }

    #[test]
    fn xsdt_layout() {
        let x = build_xsdt(&[0xe0080, 0xe0300]);
        check_header(&x, b"XSDT", 1);
        assert_eq!(x.len(), 36 + 16);
        assert_eq!((u64_at(&x, 36), u64_at(&x, 44)), (0xe0080, 0xe0300));
    }

    #[test]
    fn fadt_layout() {
        let f = build_fadt(0xe0200, 0xe01c0);
        check_header(&f, b"FACP", 6);
        assert_eq!(f.len(), 276);
        assert_eq!((u32_at(&f, 36), u32_at(&f, 40)), (0xe01c0, 0xe0200));
        assert_eq!(u16_at(&f, 46), 9);
        assert_eq!(u32_at(&f, 48), 0);
        assert_eq!((u32_at(&f, 56), u32_at(&f, 64)), (0x600, 0x604));
        assert_eq!(u32_at(&f, 76), 0, "no PM timer");
        assert_eq!((f[88], f[89], f[91]), (4, 2, 0));
        // ISA devices, no 8042 to probe, no CMOS RTC to poll.
        assert_eq!(u16_at(&f, 109), IAPC_LEGACY_DEVICES | IAPC_NO_CMOS_RTC);
        assert_eq!(u16_at(&f, 109) & IAPC_8042, 0);
        let flags = u32_at(&f, 112);
        assert_eq!(flags & Flags::HwReducedAcpi as u32, 0);
        assert_eq!(
            flags & Flags::PwrButton as u32,
            0,
            "a fixed power button exists"
        );
        assert_ne!(flags & Flags::SlpButton as u32, 0, "no sleep button");
        assert_ne!(flags & Flags::Wbinvd as u32, 0);
        assert_eq!((f[131], u16_at(&f, 96), u16_at(&f, 98)), (5, 101, 1001));
        assert_eq!((u64_at(&f, 132), u64_at(&f, 140)), (0xe01c0, 0xe0200));
        // X_PM1a_EVT_BLK and X_PM1a_CNT_BLK: system I/O, 32 and 16 bits wide.
        assert_eq!(&f[148..152], &[1, 32, 0, 0]);
        assert_eq!(u64_at(&f, 152), 0x600);
        assert_eq!(&f[172..176], &[1, 16, 0, 0]);
        assert_eq!(u64_at(&f, 176), 0x604);
    }

    #[test]
    fn facs_layout() {
        let f = build_facs();
        assert_eq!(&f[..4], b"FACS");
        assert_eq!(u32_at(&f, 4), 64);
    }

    #[test]
    fn dsdt_has_s5_and_the_host_bridge() {
        let d = build_dsdt();
        check_header(&d, b"DSDT", 2);
        let aml = &d[36..];
        assert_eq!(
            &aml[..13],
            &[0x08, b'_', b'S', b'5', b'_', 0x12, 0x07, 0x04, 0x0a, 0x05, 0x00, 0x00, 0x00]
        );
        // Scope(\_SB): its PkgLength covers the rest of the AML exactly.
        assert_eq!(aml[13], 0x10);
        // PkgLength: bits 6-7 of the lead byte count the bytes that follow it; it counts
        // itself and everything after it, so it covers the rest of the AML exactly.
        let lead = aml[14];
        let n = usize::from(lead >> 6);
        let mut len = usize::from(if n == 0 { lead & 0x3f } else { lead & 0x0f });
        for i in 0..n {
            len |= usize::from(aml[15 + i]) << (4 + 8 * i);
        }
        assert_eq!(len, aml.len() - 14, "scope length");
        let hid = [0x08, b'_', b'H', b'I', b'D', 0x0c, 0x41, 0xd0, 0x0a, 0x03];
        assert!(aml.windows(hid.len()).any(|w| w == hid), "PNP0A03 _HID");
        assert!(aml.windows(4).any(|w| w == b"PCI0"));
        let crs = pci_crs();
        assert!(aml.windows(crs.len()).any(|w| w == &crs[..]));
        assert_eq!(&crs[crs.len() - 2..], &[0x79, 0x00]);
        // Memory window 0xc0000000-0xdfffffff.
        let mem = crs.windows(2).position(|w| w == [0x87, 0x17]).unwrap();
        assert_eq!(u32_at(&crs, mem + 10), 0xc000_0000);
        assert_eq!(u32_at(&crs, mem + 14), 0xdfff_ffff);
        assert_eq!(u32_at(&crs, mem + 22), 0x2000_0000);
    }

    #[test]
    fn madt_layout() {
        let m = build_madt(3).unwrap();
        check_header(&m, b"APIC", 5);
        assert_eq!(u32_at(&m, 36), 0xfee0_0000);
        assert_eq!(u32_at(&m, 40), MADT_PCAT_COMPAT);
        let mut e = &m[44..];
        for id in 0..3 {
            assert_eq!(&e[..4], &[0, 8, id, id]);
            assert_eq!(u32_at(e, 4), 1);
            e = &e[8..];
        }
        assert_eq!(&e[..4], &[1, 12, 3, 0]);
        assert_eq!((u32_at(e, 4), u32_at(e, 8)), (0xfec0_0000, 0));
        e = &e[12..];
        assert_eq!(&e[..4], &[2, 10, 0, 9]);
        assert_eq!((u32_at(e, 4), u16_at(e, 8)), (9, 0x000d));
        e = &e[10..];
        assert_eq!(e, &[4, 6, 0xff, 0, 0, 1]);
        assert!(build_madt(0).is_err());
        assert!(build_madt(255).is_err());
    }

    /// Follows RSDP -> XSDT -> tables in guest memory, as an OS would.
    #[test]
    fn tables_parse_back_from_guest_memory() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        assert_eq!(write_acpi_tables(&mem, 2).unwrap(), 0xe0000);
        let read = |addr: u64, len: usize| {
            let mut v = vec![0u8; len];
            mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
            v
        };
        let table = |addr: u64| {
            let len = u32_at(&read(addr + 4, 4), 0) as usize;
            read(addr, len)
        };
        // The legacy scan: 16-byte steps over 0xE0000-0xFFFFF.
        let rsdp_addr = (0xe0000..0x10_0000u64)
            .step_by(16)
            .find(|&a| &read(a, 8)[..] == b"RSD PTR ")
            .unwrap();
        let rsdp = read(rsdp_addr, 36);
        assert_eq!(sum(&rsdp), 0);
        let xsdt = table(u64_at(&rsdp, 24));
        check_header(&xsdt, b"XSDT", 1);
        let mut sigs = Vec::new();
        for i in 0..(xsdt.len() - 36) / 8 {
            let t = table(u64_at(&xsdt, 36 + 8 * i));
            assert_eq!(sum(&t), 0);
            sigs.push(t[..4].to_vec());
            if &t[..4] == b"FACP" {
                assert_eq!(u32_at(&t, 64), 0x604);
                let dsdt = table(u64_at(&t, 140));
                check_header(&dsdt, b"DSDT", 2);
                let facs = read(u64_at(&t, 132), 64);
                assert_eq!(&facs[..4], b"FACS");
                assert_eq!(u64_at(&t, 132) % 64, 0);
            }
            if &t[..4] == b"APIC" {
                assert_eq!(t.len(), 44 + 2 * 8 + 12 + 10 + 6);
            }
        }
        assert_eq!(sigs, vec![b"FACP".to_vec(), b"APIC".to_vec()]);
        // Everything stays below the MP table.
        let end = 0xe0000 + build_acpi_tables(2, 0xe0000).unwrap().len() as u64;
        assert!(end <= crate::layout::MPTABLE_START);
    }
}
