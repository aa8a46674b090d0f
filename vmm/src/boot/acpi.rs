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
//! The FADT keeps the legacy PC: dual 8259 (MADT `PCAT_COMPAT`), i8042 and ISA devices in
//! `IAPC_BOOT_ARCH`, `SMI_CMD` 0 (always in ACPI mode: the PM1a control register reads with
//! `SCI_EN` set), PM1a event block at [`PM1A_EVT_BLK`] (4 bytes), PM1a control block at
//! [`PM1A_CNT_BLK`] (2 bytes), SCI on IRQ 9, no PM timer, no GPE blocks, no fixed power or
//! sleep buttons, C2/C3 latencies that disable those states.
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

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{
    ACPI_MAX_SIZE, ACPI_SCI_IRQ, ACPI_START, APIC_START, IOAPIC_START, PCI_CONFIG_IO_LEN,
    PCI_CONFIG_IO_PORT, PCI_MMIO32_SIZE, PCI_MMIO32_START, PM1A_CNT_BLK, PM1A_EVT_BLK, PM1_CNT_LEN,
    PM1_EVT_LEN,
};

/// Where the RSDP is written (the start of the ACPI area).
pub const RSDP_ADDR: u64 = ACPI_START;
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
const CREATOR_ID: [u8; 4] = *b"BVMM";
const CREATOR_REVISION: u32 = 1;

/// FADT `Flags`: WBINVD works.
pub const FADT_F_WBINVD: u32 = 1 << 0;
/// FADT `Flags`: C1 supported on all processors.
pub const FADT_F_PROC_C1: u32 = 1 << 2;
/// FADT `Flags`: no fixed-feature power button.
pub const FADT_F_PWR_BUTTON: u32 = 1 << 4;
/// FADT `Flags`: no fixed-feature sleep button.
pub const FADT_F_SLP_BUTTON: u32 = 1 << 5;
/// FADT `Flags`: hardware-reduced ACPI (never set here).
pub const FADT_F_HW_REDUCED_ACPI: u32 = 1 << 20;
/// `IAPC_BOOT_ARCH`: legacy (ISA) devices present.
pub const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
/// `IAPC_BOOT_ARCH`: an 8042 keyboard controller is present.
pub const IAPC_8042: u16 = 1 << 1;
/// MADT flags: the system also has dual 8259 PICs.
pub const MADT_PCAT_COMPAT: u32 = 1;
/// MPS INTI flags of the SCI override: active high (bits 0-1 = 01), level (bits 2-3 = 11).
pub const SCI_INTI_FLAGS: u16 = 0x000d;
/// The S5 sleep type value the DSDT's `\_S5_` package gives (written to `SLP_TYP`).
pub const S5_SLP_TYP: u8 = 5;

/// Generic Address Structure address space: system I/O.
const GAS_SYSTEM_IO: u8 = 1;

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

/// The byte that makes `bytes` sum to 0 (mod 256) when stored in their checksum field
/// (which must be 0 while this is computed).
pub fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// A system description table: 36-byte header then `body`; length and checksum filled in.
fn sdt(signature: &[u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let len = HEADER_LEN + body.len();
    let mut t = Vec::with_capacity(len);
    t.extend(signature);
    t.extend((len as u32).to_le_bytes());
    t.push(revision);
    t.push(0); // checksum, below
    t.extend(OEM_ID);
    t.extend(OEM_TABLE_ID);
    t.extend(OEM_REVISION.to_le_bytes());
    t.extend(CREATOR_ID);
    t.extend(CREATOR_REVISION.to_le_bytes());
    t.extend(body);
    t[9] = checksum(&t);
    t
}

/// A 12-byte Generic Address Structure for an I/O port block of `len` bytes (access size
/// 0: "undefined", as QEMU does; ACPICA derives the access width from the bit width).
fn gas_io(port: u16, len: u8) -> [u8; 12] {
    let mut g = [0u8; 12];
    g[0] = GAS_SYSTEM_IO;
    g[1] = len * 8; // register bit width
    g[2] = 0; // bit offset
    g[3] = 0; // access size
    g[4..12].copy_from_slice(&u64::from(port).to_le_bytes());
    g
}

/// The RSDP (revision 2) pointing at the XSDT.
pub fn build_rsdp(xsdt: u64) -> [u8; RSDP_LEN] {
    let mut r = [0u8; RSDP_LEN];
    r[0..8].copy_from_slice(b"RSD PTR ");
    r[9..15].copy_from_slice(&OEM_ID);
    r[15] = 2; // revision: ACPI 2.0+ (XSDT)
               // [16..20] RSDT address: none; revision-2 readers use the XSDT.
    r[20..24].copy_from_slice(&(RSDP_LEN as u32).to_le_bytes());
    r[24..32].copy_from_slice(&xsdt.to_le_bytes());
    r[8] = checksum(&r[..20]);
    r[32] = checksum(&r);
    r
}

/// The XSDT listing `tables` (64-bit addresses).
pub fn build_xsdt(tables: &[u64]) -> Vec<u8> {
    let body: Vec<u8> = tables.iter().flat_map(|a| a.to_le_bytes()).collect();
    sdt(b"XSDT", 1, &body)
}

/// The FADT (revision 6.5 layout, 276 bytes) for a DSDT and FACS at the given addresses.
pub fn build_fadt(dsdt: u64, facs: u64) -> Vec<u8> {
    // Offsets below are from the start of the table (header included).
    let mut b = vec![0u8; FADT_LEN - HEADER_LEN];
    let mut put = |off: usize, bytes: &[u8]| {
        b[off - HEADER_LEN..off - HEADER_LEN + bytes.len()].copy_from_slice(bytes);
    };
    // The 32-bit pointers repeat the 64-bit ones (both below 4 GiB); ACPICA warns if they
    // differ.
    put(36, &(facs as u32).to_le_bytes()); // FIRMWARE_CTRL
    put(40, &(dsdt as u32).to_le_bytes()); // DSDT
    put(45, &[0]); // Preferred_PM_Profile: unspecified
    put(46, &u16::from(ACPI_SCI_IRQ).to_le_bytes()); // SCI_INT
    put(48, &0u32.to_le_bytes()); // SMI_CMD: none, ACPI is always enabled
    put(56, &u32::from(PM1A_EVT_BLK).to_le_bytes()); // PM1a_EVT_BLK
    put(64, &u32::from(PM1A_CNT_BLK).to_le_bytes()); // PM1a_CNT_BLK
    put(88, &[PM1_EVT_LEN]); // PM1_EVT_LEN
    put(89, &[PM1_CNT_LEN]); // PM1_CNT_LEN
    put(96, &101u16.to_le_bytes()); // P_LVL2_LAT > 100: C2 not supported
    put(98, &1001u16.to_le_bytes()); // P_LVL3_LAT > 1000: C3 not supported
    put(109, &(IAPC_LEGACY_DEVICES | IAPC_8042).to_le_bytes()); // IAPC_BOOT_ARCH
                                                                // PWR_BUTTON clear: the fixed-feature power button exists (QMP system_powerdown).
    let flags = FADT_F_WBINVD | FADT_F_PROC_C1 | FADT_F_SLP_BUTTON;
    put(112, &flags.to_le_bytes()); // Flags
                                    // RESET_REG (116) / RESET_VALUE (128): none; Linux falls back to the i8042 reset.
    put(131, &[5]); // FADT minor version: 6.5
    put(132, &facs.to_le_bytes()); // X_FIRMWARE_CTRL
    put(140, &dsdt.to_le_bytes()); // X_DSDT
    put(148, &gas_io(PM1A_EVT_BLK, PM1_EVT_LEN)); // X_PM1a_EVT_BLK
    put(172, &gas_io(PM1A_CNT_BLK, PM1_CNT_LEN)); // X_PM1a_CNT_BLK
                                                  // Hypervisor vendor identity (268): left 0.
    sdt(b"FACP", 6, &b)
}

/// The FACS: no checksum; hardware signature 0, no waking vector, global lock free.
pub fn build_facs() -> [u8; FACS_LEN] {
    let mut f = [0u8; FACS_LEN];
    f[0..4].copy_from_slice(b"FACS");
    f[4..8].copy_from_slice(&(FACS_LEN as u32).to_le_bytes());
    f[32] = 2; // version
    f
}

/// Encodes an AML PkgLength for `content_len` bytes that follow it (the encoding counts its
/// own bytes): one byte up to 63, else a lead byte with the byte count in bits 6-7 and the
/// low nibble, then the remaining bits 8 at a time.
pub fn aml_pkg_length(content_len: usize) -> Vec<u8> {
    for n in 1..=4usize {
        let total = content_len + n;
        let fits = match n {
            1 => total < 0x40,
            _ => total < 1 << (4 + 8 * (n - 1)),
        };
        if fits {
            if n == 1 {
                return vec![total as u8];
            }
            let mut v = vec![(((n - 1) as u8) << 6) | (total & 0xf) as u8];
            for i in 0..n - 1 {
                v.push((total >> (4 + 8 * i)) as u8);
            }
            return v;
        }
    }
    // 2^28 bytes of AML is far beyond anything built here.
    vec![0xff, 0xff, 0xff, 0xff]
}

/// `Name(NAME, data)`: NameOp 0x08, the 4-character NameSeg, the data object.
fn aml_name(name: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut v = vec![0x08];
    v.extend(name);
    v.extend(data);
    v
}

/// `Package(n){ints...}` of small integers: PackageOp 0x12, PkgLength, NumElements, then
/// each element as ZeroOp (0x00), OneOp (0x01) or BytePrefix (0x0A) + byte.
fn aml_package_bytes(items: &[u8]) -> Vec<u8> {
    let mut body = vec![items.len() as u8];
    for &i in items {
        match i {
            0 => body.push(0x00),
            1 => body.push(0x01),
            _ => body.extend([0x0a, i]),
        }
    }
    let mut v = vec![0x12];
    v.extend(aml_pkg_length(body.len()));
    v.extend(body);
    v
}

/// `Buffer(){bytes}`: BufferOp 0x11, PkgLength, BufferSize (WordPrefix 0x0B + u16), bytes.
fn aml_buffer(bytes: &[u8]) -> Vec<u8> {
    let mut body = vec![0x0b];
    body.extend((bytes.len() as u16).to_le_bytes());
    body.extend(bytes);
    let mut v = vec![0x11];
    v.extend(aml_pkg_length(body.len()));
    v.extend(body);
    v
}

/// A scope-like term: `prefix`, PkgLength, NameString, `terms`.
fn aml_scoped(prefix: &[u8], name: &[u8], terms: &[u8]) -> Vec<u8> {
    let mut v = prefix.to_vec();
    v.extend(aml_pkg_length(name.len() + terms.len()));
    v.extend(name);
    v.extend(terms);
    v
}

/// A 32-bit EISA id ("PNP0A03" -> 0x030AD041) as a DWordConst (0x0C + u32).
fn aml_eisa_id(id: &[u8; 7]) -> Vec<u8> {
    let c = |b: u8| u16::from(b.wrapping_sub(0x40) & 0x1f);
    let vendor = (c(id[0]) << 10) | (c(id[1]) << 5) | c(id[2]);
    let hex = |b: u8| (b as char).to_digit(16).unwrap_or(0) as u8;
    let product = [
        (hex(id[3]) << 4) | hex(id[4]),
        (hex(id[5]) << 4) | hex(id[6]),
    ];
    let mut v = vec![0x0c];
    v.extend(vendor.to_be_bytes());
    v.extend(product);
    v
}

/// Word Address Space Descriptor (large item 0x88): `kind` 1 = I/O, 2 = bus number;
/// producer, min and max fixed, positive decode.
fn word_address(kind: u8, type_flags: u8, min: u16, max: u16) -> Vec<u8> {
    let mut v = vec![0x88, 0x0d, 0x00, kind, 0x0c, type_flags];
    for x in [0u16, min, max, 0, max - min + 1] {
        v.extend(x.to_le_bytes());
    }
    v
}

/// The host bridge's `_CRS` resource template: bus numbers 0-255, the configuration ports
/// (consumed), I/O windows around them, and the 32-bit BAR window; then the end tag.
pub fn pci_crs() -> Vec<u8> {
    let mut r = word_address(2, 0, 0, 0xff);
    // I/O port descriptor (small item 0x47): 16-bit decode, min, max, alignment, length.
    let cf8 = PCI_CONFIG_IO_PORT.to_le_bytes();
    r.extend([0x47, 0x01, cf8[0], cf8[1], cf8[0], cf8[1], 0x01]);
    r.push(PCI_CONFIG_IO_LEN as u8);
    // I/O windows: type-specific flags 3 = ISA and non-ISA ranges.
    r.extend(word_address(1, 3, 0, PCI_CONFIG_IO_PORT - 1));
    r.extend(word_address(1, 3, 0x0d00, 0xffff));
    // DWord Address Space Descriptor (large item 0x87, 23 bytes): memory, producer,
    // min/max fixed, read-write, non-cacheable.
    let min = PCI_MMIO32_START as u32;
    let max = (PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32;
    r.extend([0x87, 0x17, 0x00, 0x00, 0x0c, 0x01]);
    for x in [0u32, min, max, 0, max - min + 1] {
        r.extend(x.to_le_bytes());
    }
    // End tag (small item 0x79) with checksum 0 ("treat as valid").
    r.extend([0x79, 0x00]);
    r
}

/// The DSDT's AML:
///
/// ```text
/// Name (_S5_, Package (4) { 5, 0, 0, 0 })
///     08 '_S5_' 12 07 04 0A 05 00 00 00
///     NameOp, NameSeg, PackageOp, PkgLength 7 (itself + the 6 bytes after it),
///     NumElements 4, BytePrefix 5 (SLP_TYPa), ZeroOp (SLP_TYPb), ZeroOp, ZeroOp
/// Scope (\_SB) {                           10 PkgLength '\' '_SB_' ...
///   Device (PCI0) {                        5B 82 PkgLength 'PCI0' ...
///     Name (_HID, EisaId ("PNP0A03"))      08 '_HID' 0C 41 D0 0A 03
///     Name (_ADR, Zero)                    08 '_ADR' 00
///     Name (_UID, Zero)                    08 '_UID' 00
///     Name (_CRS, ResourceTemplate () {..})  08 '_CRS' 11 PkgLength 0B len16 bytes
///   }
/// }
/// ```
pub fn dsdt_aml() -> Vec<u8> {
    let mut aml = aml_name(b"_S5_", &aml_package_bytes(&[S5_SLP_TYP, 0, 0, 0]));
    let mut dev = aml_name(b"_HID", &aml_eisa_id(b"PNP0A03"));
    dev.extend(aml_name(b"_ADR", &[0x00]));
    dev.extend(aml_name(b"_UID", &[0x00]));
    dev.extend(aml_name(b"_CRS", &aml_buffer(&pci_crs())));
    let pci0 = aml_scoped(&[0x5b, 0x82], b"PCI0", &dev);
    aml.extend(aml_scoped(&[0x10], b"\\_SB_", &pci0));
    aml
}

/// The DSDT (revision 2: 64-bit AML integers).
pub fn build_dsdt() -> Vec<u8> {
    sdt(b"DSDT", 2, &dsdt_aml())
}

/// The MADT for `num_cpus` vCPUs (see the module documentation).
///
/// # Errors
/// [`Error::BadCpuCount`].
pub fn build_madt(num_cpus: usize) -> Result<Vec<u8>> {
    if num_cpus == 0 || num_cpus > 254 {
        return Err(Error::BadCpuCount(num_cpus));
    }
    let mut b = Vec::new();
    b.extend((APIC_START as u32).to_le_bytes());
    b.extend(MADT_PCAT_COMPAT.to_le_bytes());
    for id in 0..num_cpus as u8 {
        // Processor Local APIC: type 0, length 8, UID, APIC id, flags (enabled).
        b.extend([0, 8, id, id]);
        b.extend(1u32.to_le_bytes());
    }
    // I/O APIC: type 1, length 12, id (as in the MP table), reserved, address, GSI base.
    b.extend([1, 12, num_cpus as u8, 0]);
    b.extend((IOAPIC_START as u32).to_le_bytes());
    b.extend(0u32.to_le_bytes());
    // Interrupt Source Override: type 2, length 10, bus 0 (ISA), source, GSI, flags.
    b.extend([2, 10, 0, ACPI_SCI_IRQ]);
    b.extend(u32::from(ACPI_SCI_IRQ).to_le_bytes());
    b.extend(SCI_INTI_FLAGS.to_le_bytes());
    // Local APIC NMI: type 4, length 6, all processors (0xff), flags 0, LINT1.
    b.extend([4, 6, 0xff, 0, 0, 1]);
    Ok(sdt(b"APIC", 5, &b))
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
        assert_eq!(u16_at(&f, 109) & IAPC_8042, IAPC_8042);
        assert_eq!(u32_at(&f, 112) & FADT_F_HW_REDUCED_ACPI, 0);
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
    fn pkg_length_encoding() {
        assert_eq!(aml_pkg_length(6), vec![7]);
        assert_eq!(aml_pkg_length(62), vec![63]);
        // 63 + 2 = 65 = 0x41: lead 0x40 | 1, then 0x41 >> 4 = 4.
        assert_eq!(aml_pkg_length(63), vec![0x41, 0x04]);
        assert_eq!(aml_pkg_length(0xffd), vec![0x4f, 0xff]);
        assert_eq!(aml_pkg_length(0xffe), vec![0x81, 0x00, 0x01]);
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
        let rest = aml.len() - 14;
        let pl = aml_pkg_length(rest - 2);
        assert_eq!(&aml[14..14 + pl.len()], &pl[..], "scope length");
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
