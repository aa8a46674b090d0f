//! Modern virtio-pci transport (virtio 1.2, section 4.1) for [`devices::virtio::VirtioDevice`]s.
//!
//! A [`VirtioPciDevice`] is one PCI function with QEMU's identity and layout, so the stock
//! Linux `virtio_pci` driver binds to it as it does under QEMU with `disable-legacy=on`:
//!
//! * vendor 0x1af4, device 0x1040 + virtio type (0x1041 net, 0x1042 block), revision 1,
//!   subsystem 0x1af4:0x1100, class 0x0200 (net) / 0x0100 (block), no INTx pin;
//! * BAR 1: 32-bit, 4 KiB, MSI-X table at 0 and PBA at [`MSIX_PBA_OFFSET`];
//! * BAR 4: 64-bit prefetchable, 16 KiB: common config at 0x0, ISR at 0x1000, device config
//!   at 0x2000, notifications at 0x3000 (`notify_off_multiplier` 4, queue `q` notifies at
//!   0x3000 + 4q);
//! * capabilities: MSI-X (vectors = queues + 1), then virtio COMMON_CFG, ISR_CFG, DEVICE_CFG
//!   and NOTIFY_CFG vendor capabilities (no PCI_CFG window: Linux does not need it).
//!
//! The transport owns `device_status`, feature negotiation (bits the device did not offer are
//! dropped when the driver writes them), the queue registers (validated at the register
//! boundary: a size that is zero, not a power of two or above the maximum, a ring that is not
//! inside guest memory, or a write after the queue or the device went live is logged once and
//! ignored) and the interrupts. On DRIVER_OK it calls [`VirtioDevice::activate`] and runs each
//! [`devices::virtio::QueueWorker`] on a thread of its own; notifications reach the workers
//! through ioeventfds registered on the notify addresses (with a fallback through the MMIO
//! exit path when registration fails or is disabled), and used-buffer notifications go out
//! through irqfds on per-vector MSI routes. A status write of 0 stops the workers and resets
//! the queues. A failed activation, or a worker that reports the device broken, sets
//! DEVICE_NEEDS_RESET and raises a configuration interrupt; the VMM keeps running.
//!
//! [`VirtioDevice::activate`]: devices::virtio::VirtioDevice::activate

mod common;
mod device;
pub mod msix;
mod worker;

pub use device::{SharedVirtioDevice, VirtioPciDevice, VirtioPciOptions};
pub use msix::{MsixInterrupts, NO_VECTOR};

/// PCI vendor id of virtio devices (Red Hat / Qumranet).
pub const VIRTIO_PCI_VENDOR_ID: u16 = 0x1af4;
/// Device id of a modern virtio device of type 0.
pub const VIRTIO_PCI_DEVICE_ID_BASE: u16 = 0x1040;
/// Subsystem vendor id QEMU uses.
pub const VIRTIO_PCI_SUBSYSTEM_VENDOR_ID: u16 = 0x1af4;
/// Subsystem id QEMU uses (`PCI_SUBDEVICE_ID_QEMU`).
pub const VIRTIO_PCI_SUBSYSTEM_ID: u16 = 0x1100;

/// BAR index of the MSI-X table and PBA.
pub const MSIX_BAR: usize = 1;
/// Size of the MSI-X BAR.
pub const MSIX_BAR_SIZE: u64 = 0x1000;
/// Offset of the PBA in the MSI-X BAR.
pub const MSIX_PBA_OFFSET: u64 = 0x800;
/// BAR index of the virtio structures.
pub const MODERN_BAR: usize = 4;
/// Size of the virtio structures BAR.
pub const MODERN_BAR_SIZE: u64 = 0x4000;
/// Offset of the common configuration structure.
pub const COMMON_CFG_OFFSET: u64 = 0x0;
/// Length of the common configuration structure (virtio 1.2, with queue_notify_data and
/// queue_reset).
pub const COMMON_CFG_LEN: u64 = 0x3c;
/// Offset of the ISR byte.
pub const ISR_CFG_OFFSET: u64 = 0x1000;
/// Offset of the device configuration space.
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
/// Length of the device configuration window.
pub const DEVICE_CFG_LEN: u64 = 0x1000;
/// Offset of the notification area.
pub const NOTIFY_CFG_OFFSET: u64 = 0x3000;
/// Bytes between two queues' notification addresses.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
/// Largest number of queues a function may have (MSI-X vectors = queues + 1 must fit the
/// table below the PBA, and the notification area must fit its page).
pub const MAX_QUEUES: usize = 127;

// virtio PCI capability types: constants, alike in shape only to other tables.
/// virtio PCI capability types (virtio 1.2, 4.1.4).
pub mod cap_type {
    /// Common configuration.
    pub const COMMON_CFG: u8 = 1;
    /// Notifications.
    pub const NOTIFY_CFG: u8 = 2;
    /// ISR status.
    pub const ISR_CFG: u8 = 3;
    /// Device-specific configuration.
    pub const DEVICE_CFG: u8 = 4;
}

/// Errors building a virtio-pci function.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// PCI configuration or BAR allocation.
    #[error("PCI: {0}")]
    Pci(#[from] crate::pci::Error),
    /// KVM (GSI, irqfd, ioeventfd).
    #[error("VM: {0}")]
    Vm(#[from] crate::vm::Error),
    /// Creating an eventfd failed.
    #[error("eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    /// The device has no queues or too many.
    #[error("a virtio-pci device needs 1..={MAX_QUEUES} queues, this one has {0}")]
    QueueCount(usize),
    /// The device's maximum queue size is not a power of two in 1..=32768.
    #[error("invalid maximum queue size {0}")]
    QueueSize(u16),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;
