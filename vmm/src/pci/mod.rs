//! A single PCI segment (bus 0) for the VMM.
//!
//! * [`PciConfiguration`]: a type-0 configuration space with write masks, BAR sizing and a
//!   capability list: the part every PCI function shares.
//! * [`PciDevice`]: what a function implements (configuration accesses, BAR accesses). A
//!   virtio-pci transport holds a `PciConfiguration`, forwards config accesses to it (and
//!   intercepts its own capabilities, e.g. MSI-X control), and serves its BARs.
//! * [`PciRoot`]: the functions on bus 0 (slot 0 is the [`PciHostBridge`]), BAR address
//!   allocation from the 32-bit window, and BAR relocation on the MMIO bus when the guest
//!   reprograms a BAR.
//! * [`PciConfigIo`] (configuration mechanism #1, ports 0xCF8-0xCFF) and [`PciConfigMmio`]
//!   (ECAM window for bus 0) give the guest access to configuration space.
//!
//! MSI-X is a capability of the virtio-pci function (`crate::virtio_pci::msix`, with KVM GSI
//! routing), not of this bus. Not implemented: the command register's memory-space bit does
//! not gate BAR decoding (a BAR is decoded wherever it is programmed, except at address 0), I/O
//! BARs, multi-function devices, bridges, and an ACPI MCFG table (Linux without ACPI uses
//! mechanism #1, which is enough).

mod config;
mod host_bridge;
mod root;

pub use config::{BarKind, BarReprogram, PciBar, PciConfiguration, PciHeader};
pub use host_bridge::PciHostBridge;
pub use root::{PciBarRegion, PciConfigIo, PciConfigMmio, PciRoot, SharedPciDevice};

// PCI constants; alike in shape only to other constant tables.
/// Number of 32-bit registers in a PCIe configuration space (4 KiB).
pub const NUM_CONFIG_REGISTERS: usize = 1024;
/// Number of 32-bit registers reachable through configuration mechanism #1 (256 bytes).
pub const NUM_LEGACY_CONFIG_REGISTERS: usize = 64;
/// Number of BARs in a type-0 header.
pub const NUM_BARS: usize = 6;

/// Errors of the PCI segment.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// BAR index out of range, or the second half of a 64-bit BAR is past BAR 5.
    #[error("invalid BAR index {0}")]
    InvalidBarIndex(usize),
    /// The BAR slot (or the upper half of a 64-bit BAR) is already in use.
    #[error("BAR {0} is already in use")]
    BarInUse(usize),
    /// BAR size not a power of two or below the 4 KiB minimum this VMM uses.
    #[error("BAR size {0:#x} must be a power of two >= 4 KiB")]
    InvalidBarSize(u64),
    /// BAR address not aligned to its size, or a 32-bit BAR above 4 GiB.
    #[error("BAR address {addr:#x} invalid for size {size:#x}")]
    InvalidBarAddress {
        /// Address.
        addr: u64,
        /// Size.
        size: u64,
    },
    /// The 32-bit MMIO window is exhausted.
    #[error("PCI MMIO window exhausted allocating {size:#x} bytes")]
    MmioExhausted {
        /// Requested size.
        size: u64,
    },
    /// All 32 device slots of bus 0 are taken.
    #[error("no free PCI slot on bus 0")]
    NoFreeSlot,
    /// The capability does not fit in configuration space.
    #[error("capability of {len} bytes does not fit in configuration space")]
    CapabilityTooBig {
        /// Capability length.
        len: usize,
    },
    /// Registering a BAR on the MMIO bus failed.
    #[error("cannot map BAR: {0}")]
    Bus(#[from] crate::bus::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// A PCI function on bus 0.
///
/// Register indices are 32-bit register numbers (`offset / 4`) in `0..NUM_CONFIG_REGISTERS`;
/// `offset` is the byte offset within the register and `data.len()` the access width. The
/// caller guarantees `offset + data.len() <= 4`; implementations must still not panic on
/// other values (guest-controlled). `Debug` lets a [`PciBarRegion`] show the function it
/// routes to.
pub trait PciDevice: Send + std::fmt::Debug {
    /// The function's configuration space (header, BARs, capabilities).
    fn config(&self) -> &PciConfiguration;

    /// The function's configuration space, for writes.
    fn config_mut(&mut self) -> &mut PciConfiguration;

    /// Reads configuration register `reg` (by default from [`PciDevice::config`]).
    fn read_config_register(&mut self, reg: usize) -> u32 {
        self.config().read_reg(reg)
    }

    /// Writes `data` to configuration register `reg` at byte `offset` of
    /// [`PciDevice::config_mut`], then tells [`PciDevice::config_written`]. Returns the BAR
    /// move the write caused, if any; [`PciRoot`] then remaps the BAR on the MMIO bus.
    fn write_config_register(
        &mut self,
        reg: usize,
        offset: u64,
        data: &[u8],
    ) -> Option<BarReprogram> {
        let moved = self.config_mut().write_reg(reg, offset, data);
        self.config_written(reg, moved.as_ref());
        moved
    }

    /// Called after a guest write to configuration register `reg` has been stored, with the
    /// BAR move it caused, if any, for a function that follows its own registers (MSI-X
    /// enable, a moved notification area). By default nothing happens.
    fn config_written(&mut self, reg: usize, moved: Option<&BarReprogram>) {
        let _ = (reg, moved);
    }

    /// The memory BARs as currently programmed, mapped on the MMIO bus when the device is
    /// added to a [`PciRoot`].
    fn bars(&self) -> Vec<PciBar> {
        self.config().bars()
    }

    /// Reads `data.len()` bytes at `offset` within BAR `bar`.
    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        let _ = (bar, offset);
        data.fill(0xff);
    }

    /// Writes `data` at `offset` within BAR `bar`.
    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        let _ = (bar, offset, data);
    }
}
