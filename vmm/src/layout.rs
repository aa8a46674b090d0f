//! The guest physical address map.
//!
//! ```text
//! 0x0000_0500  GDT (boot)                      0x0000_0520  IDT (boot, empty)
//! 0x0000_6000  PVH hvm_start_info + memmap     0x0000_7000  Linux zero page (boot_params)
//! 0x0000_8ff0  boot stack pointer              0x0000_9000  PML4, PDPT, 4 PDs (to 0xf000)
//! 0x0002_0000  kernel command line (64 KiB)    0x0009_fc00  EBDA start (end of low RAM in e820)
//! 0x000e_0000  ACPI RSDP + tables (64 KiB)     0x000f_0000  MP floating pointer + table
//! 0x0010_0000  kernel (HIMEM)
//! 0xc000_0000  MMIO hole start: PCI 32-bit BAR window (to 0xe000_0000)
//! 0xe000_0000  PCIe ECAM, bus 0 only (1 MiB used of the 256 MiB window)
//! 0xfec0_0000  IOAPIC                          0xfee0_0000  local APIC
//! 0xfeff_c000  KVM identity-map page           0xfeff_d000  KVM TSS (3 pages)
//! 0x1_0000_0000  RAM above 4 GiB when RAM is larger than the hole start
//! ```
//!
//! Port I/O: 0x60/0x64 i8042, 0x3f8 COM1, 0x501 debug exit, 0x600-0x605 ACPI PM1a event and
//! control blocks, 0xcf8-0xcff PCI conf1.

/// Start of the boot GDT.
pub const BOOT_GDT_START: u64 = 0x500;
/// Start of the (empty) boot IDT.
pub const BOOT_IDT_START: u64 = 0x520;
/// PVH `hvm_start_info` structure.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH memory map entries follow the start info.
pub const PVH_MEMMAP_START: u64 = 0x6040;
/// Maximum number of PVH memmap entries that fit before the zero page.
pub const PVH_MEMMAP_MAX_ENTRIES: usize = ((ZERO_PAGE_START - PVH_MEMMAP_START) / 24) as usize;
/// The Linux zero page (`struct boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Top-level page table.
pub const PML4_START: u64 = 0x9000;
/// Page directory pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// First of four page directories (2 MiB pages) covering the low 4 GiB.
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Maximum command line size, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 0x10000;
/// Start of the extended BIOS data area; low RAM in the e820 map ends here.
pub const EBDA_START: u64 = 0x9fc00;
// Guest physical address map: constants, alike in shape only.
/// ACPI RSDP and tables: the first 64 KiB of the BIOS area 0xE0000-0xFFFFF that Linux scans
/// for the RSDP (reserved in the e820 map, up to 1 MiB).
pub const ACPI_START: u64 = 0xe0000;
/// Size of the ACPI table area (it ends where the MP table starts).
pub const ACPI_MAX_SIZE: usize = 0x10000;
/// MP floating pointer structure and configuration table (BIOS ROM area, scanned by Linux).
pub const MPTABLE_START: u64 = 0xf0000;
/// Size of the MP table area.
pub const MPTABLE_MAX_SIZE: usize = 0x10000;
/// Where the kernel is loaded (1 MiB).
pub const HIMEM_START: u64 = 0x10_0000;

/// Start of the 32-bit MMIO hole; RAM above this address is moved above 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// End of the 32-bit MMIO hole (exclusive).
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
/// Start of the window from which PCI 32-bit memory BARs are allocated.
pub const PCI_MMIO32_START: u64 = MMIO_HOLE_START;
/// Size of the PCI 32-bit BAR window.
pub const PCI_MMIO32_SIZE: u64 = 0x2000_0000;
/// Start of the PCIe ECAM window (bus 0 only).
pub const PCI_ECAM_START: u64 = 0xe000_0000;
/// Size of the part of the ECAM window that is decoded (bus 0: 32 devices x 8 functions x 4 KiB).
pub const PCI_ECAM_SIZE: u64 = 0x10_0000;
/// IOAPIC base address.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC base address.
pub const APIC_START: u64 = 0xfee0_0000;
/// KVM identity-map page (needed by KVM for real mode on some hosts).
pub const KVM_IDENTITY_MAP_START: u64 = 0xfeff_c000;
/// KVM TSS (three pages, must be below 4 GiB and outside RAM).
pub const KVM_TSS_START: u64 = 0xfeff_d000;

/// Start of RAM above 4 GiB.
pub const HIGH_RAM_START: u64 = MMIO_HOLE_END;

/// I/O port of the first serial port (COM1).
pub const COM1_PORT: u16 = 0x3f8;
/// Number of I/O ports of a 16550.
pub const SERIAL_PORT_LEN: u16 = 8;
/// Interrupt line of COM1.
pub const COM1_IRQ: u32 = 4;
/// i8042 data port.
pub const I8042_DATA_PORT: u16 = 0x60;
/// i8042 command/status port.
pub const I8042_COMMAND_PORT: u16 = 0x64;
/// Default debug-exit port (as QEMU's `isa-debug-exit`).
pub const DEBUG_EXIT_PORT: u16 = 0x501;
/// PCI configuration mechanism #1: address port (data port is +4).
pub const PCI_CONFIG_IO_PORT: u16 = 0xcf8;
/// Number of ports decoded by configuration mechanism #1.
pub const PCI_CONFIG_IO_LEN: u16 = 8;
/// ACPI PM1a event block (status at +0, enable at +2; 4 bytes).
pub const PM1A_EVT_BLK: u16 = 0x600;
/// Length of the PM1a event block.
pub const PM1_EVT_LEN: u8 = 4;
/// ACPI PM1a control block (2 bytes).
pub const PM1A_CNT_BLK: u16 = 0x604;
/// Length of the PM1a control block.
pub const PM1_CNT_LEN: u8 = 2;
/// The ACPI System Control Interrupt (ISA IRQ and GSI 9, level, active high).
pub const ACPI_SCI_IRQ: u8 = 9;
