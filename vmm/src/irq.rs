//! GSI routing for the in-kernel irqchip: the default PIC/IOAPIC routes plus MSI routes.
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, including KVM's built-in routes of GSIs
//! 0-23 to the PIC and IOAPIC. [`IrqRouting`] therefore keeps the full table (starting from
//! [`default_routes`], which mirrors KVM's defaults) and every change re-commits all of it.
//! MSI routes get GSIs from [`FIRST_MSI_GSI`] upward; an irqfd registered on such a GSI
//! delivers the MSI (this is how a virtio-pci MSI-X vector reaches the guest).

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};

/// Number of IOAPIC pins (GSIs 0-23 are irqchip lines).
pub const IOAPIC_PINS: u32 = 24;
/// First GSI handed out for MSI routes.
pub const FIRST_MSI_GSI: u32 = IOAPIC_PINS;
/// KVM's limit on routing entries (KVM_MAX_IRQ_ROUTES).
pub const MAX_ROUTES: usize = 4096;

/// Where a GSI goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// A pin of an in-kernel interrupt controller (`KVM_IRQCHIP_*`).
    Irqchip {
        /// Controller.
        chip: u32,
        /// Pin.
        pin: u32,
    },
    /// A message-signalled interrupt.
    Msi {
        /// Message address (0xFEEx_xxxx for the local APICs).
        address: u64,
        /// Message data (vector and delivery mode).
        data: u32,
    },
}

// Same thiserror shape as the boot tables' Error enums; different failures.
/// Errors of GSI routing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No GSI left for MSI routes.
    #[error("no free GSI for an MSI route")]
    GsiExhausted,
    /// The GSI is an irqchip line or was never allocated.
    #[error("GSI {0} is not an allocated MSI GSI")]
    NotMsiGsi(u32),
    /// The routing table exceeds KVM's limit.
    #[error("routing table of {0} entries exceeds the limit")]
    TooManyRoutes(usize),
    /// KVM_SET_GSI_ROUTING failed.
    #[error("KVM_SET_GSI_ROUTING: {0}")]
    Commit(#[source] kvm_ioctls::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// KVM's default routes: GSI 0-15 to both PICs' pins and the IOAPIC pin of the same number,
/// GSI 16-23 to the IOAPIC only.
pub fn default_routes() -> BTreeMap<u32, Vec<Route>> {
    (0..IOAPIC_PINS)
        .map(|gsi| {
            let mut r = vec![Route::Irqchip {
                chip: KVM_IRQCHIP_IOAPIC,
                pin: gsi,
            }];
            if gsi < 16 {
                let (chip, pin) = if gsi < 8 {
                    (KVM_IRQCHIP_PIC_MASTER, gsi)
                } else {
                    (KVM_IRQCHIP_PIC_SLAVE, gsi - 8)
                };
                r.insert(0, Route::Irqchip { chip, pin });
            }
            (gsi, r)
        })
        .collect()
}

/// Converts a table into KVM routing entries.
pub fn routing_entries(routes: &BTreeMap<u32, Vec<Route>>) -> Vec<kvm_irq_routing_entry> {
    let mut out = Vec::new();
    for (&gsi, rs) in routes {
        for r in rs {
            let mut e = kvm_irq_routing_entry {
                gsi,
                ..Default::default()
            };
            match *r {
                Route::Irqchip { chip, pin } => {
                    e.type_ = KVM_IRQ_ROUTING_IRQCHIP;
                    e.u.irqchip.irqchip = chip;
                    e.u.irqchip.pin = pin;
                }
                Route::Msi { address, data } => {
                    e.type_ = KVM_IRQ_ROUTING_MSI;
                    e.u.msi.address_lo = address as u32;
                    e.u.msi.address_hi = (address >> 32) as u32;
                    e.u.msi.data = data;
                }
            }
            out.push(e);
        }
    }
    out
}

/// The routing table of one VM (see the module documentation).
#[derive(Debug)]
pub struct IrqRouting {
    routes: BTreeMap<u32, Vec<Route>>,
    allocated: std::collections::BTreeSet<u32>,
}

impl Default for IrqRouting {
    fn default() -> Self {
        IrqRouting {
            routes: default_routes(),
            allocated: Default::default(),
        }
    }
}

impl IrqRouting {
    /// Reserves a GSI for an MSI route (no route until [`IrqRouting::set_msi`]).
    ///
    /// # Errors
    /// [`Error::GsiExhausted`].
    pub fn allocate_msi_gsi(&mut self) -> Result<u32> {
        let gsi = (FIRST_MSI_GSI..FIRST_MSI_GSI + MAX_ROUTES as u32)
            .find(|g| !self.allocated.contains(g))
            .ok_or(Error::GsiExhausted)?;
        self.allocated.insert(gsi);
        Ok(gsi)
    }

    /// Points MSI GSI `gsi` at `address`/`data` (replacing any previous route). Commit with
    /// [`crate::vm::Vm::set_msi_route`], which calls this and `KVM_SET_GSI_ROUTING`.
    ///
    /// # Errors
    /// [`Error::NotMsiGsi`], [`Error::TooManyRoutes`].
    pub fn set_msi(&mut self, gsi: u32, address: u64, data: u32) -> Result<()> {
        if !self.allocated.contains(&gsi) {
            return Err(Error::NotMsiGsi(gsi));
        }
        self.routes.insert(gsi, vec![Route::Msi { address, data }]);
        let n = self.routes.values().map(Vec::len).sum();
        if n > MAX_ROUTES {
            self.routes.remove(&gsi);
            return Err(Error::TooManyRoutes(n));
        }
        Ok(())
    }

    /// Removes the route of MSI GSI `gsi` (the GSI stays allocated). Returns whether there
    /// was one.
    pub fn clear(&mut self, gsi: u32) -> bool {
        self.allocated.contains(&gsi) && self.routes.remove(&gsi).is_some()
    }

    /// Releases MSI GSI `gsi` and its route.
    pub fn release(&mut self, gsi: u32) {
        if self.allocated.remove(&gsi) {
            self.routes.remove(&gsi);
        }
    }

    /// The table as KVM routing entries.
    ///
    /// # Errors
    /// [`Error::TooManyRoutes`] if the FAM wrapper refuses the size.
    pub fn to_kvm(&self) -> Result<KvmIrqRouting> {
        let entries = routing_entries(&self.routes);
        KvmIrqRouting::from_entries(&entries).map_err(|_| Error::TooManyRoutes(entries.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn irqchip_of(e: &kvm_irq_routing_entry) -> (u32, u32, u32) {
        assert_eq!(e.type_, KVM_IRQ_ROUTING_IRQCHIP);
        // SAFETY: the entry has type IRQCHIP (checked above), so `u.irqchip` is the member
        // `routing_entries` initialised; it is plain integers.
        let c = unsafe { e.u.irqchip };
        (e.gsi, c.irqchip, c.pin)
    }

    #[test]
    fn defaults_mirror_kvm() {
        let e = routing_entries(&default_routes());
        assert_eq!(e.len(), 16 * 2 + 8);
        let pins: Vec<(u32, u32, u32)> = e.iter().map(irqchip_of).collect();
        assert!(pins.contains(&(10, KVM_IRQCHIP_PIC_SLAVE, 2)));
        assert!(pins.contains(&(10, KVM_IRQCHIP_IOAPIC, 10)));
        assert!(pins.contains(&(20, KVM_IRQCHIP_IOAPIC, 20)));
        assert!(!pins.contains(&(20, KVM_IRQCHIP_PIC_SLAVE, 12)));
    }

    #[test]
    fn msi_routes() {
        let mut r = IrqRouting::default();
        assert!(r.set_msi(24, 0xfee0_0000, 0x30).is_err());
        let a = r.allocate_msi_gsi().unwrap();
        let b = r.allocate_msi_gsi().unwrap();
        assert_eq!((a, b), (24, 25));
        r.set_msi(b, 0xfee0_1000, 0x41).unwrap();
        let e = routing_entries(&r.routes);
        let msi = e.iter().find(|e| e.gsi == b).unwrap();
        assert_eq!(msi.type_, KVM_IRQ_ROUTING_MSI);
        // SAFETY: the entry has type MSI, so the msi member is the initialised one.
        let (lo, hi, data) =
            unsafe { (msi.u.msi.address_lo, msi.u.msi.address_hi, msi.u.msi.data) };
        assert_eq!((lo, hi, data), (0xfee0_1000, 0, 0x41));
        assert!(r.clear(b));
        assert!(!r.clear(b));
        r.release(a);
        assert_eq!(r.allocate_msi_gsi().unwrap(), 24);
        assert_eq!(r.to_kvm().unwrap().as_slice().len(), 40);
    }
}
