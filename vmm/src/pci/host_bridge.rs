//! The PCI host bridge at 00:00.0.

use super::{PciConfiguration, PciDevice, PciHeader};

/// Vendor id of the host bridge (Intel).
pub const HOST_BRIDGE_VENDOR_ID: u16 = 0x8086;
/// Device id of the host bridge (the id Cloud Hypervisor also uses for its virtual bridge).
pub const HOST_BRIDGE_DEVICE_ID: u16 = 0x0d57;

/// A host bridge: class 06/00, no BARs, read-only apart from the standard fields.
#[derive(Debug, Clone)]
pub struct PciHostBridge {
    config: PciConfiguration,
}

impl Default for PciHostBridge {
    fn default() -> Self {
        Self::new()
    }
}

impl PciHostBridge {
    /// A new host bridge.
    pub fn new() -> Self {
        PciHostBridge {
            config: PciConfiguration::new(&PciHeader {
                vendor_id: HOST_BRIDGE_VENDOR_ID,
                device_id: HOST_BRIDGE_DEVICE_ID,
                class: 0x06,
                subclass: 0x00,
                ..Default::default()
            }),
        }
    }
}

impl PciDevice for PciHostBridge {
    fn config(&self) -> &PciConfiguration {
        &self.config
    }

    fn config_mut(&mut self) -> &mut PciConfiguration {
        &mut self.config
    }
}
