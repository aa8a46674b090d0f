//! The KVM virtual machine: creation, memory slots, in-kernel irqchip and PIT.
//!
//! Checked on this project's development machines, whose `/dev/kvm` is the software PVM
//! hypervisor (see ENVIRONMENT.md): `KVM_CREATE_IRQCHIP`, `KVM_CREATE_PIT2`, `KVM_SET_TSS_ADDR`,
//! `KVM_SET_IDENTITY_MAP_ADDR`, memory slots and irqfd all succeed there. When a host lacks
//! one of them, [`Vm::new`] fails with the variant naming the step ([`Error::IrqChip`],
//! [`Error::Pit`], ...) rather than running a VM without interrupts.

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use std::sync::Mutex;

use kvm_ioctls::{Cap, IoEventAddress, Kvm, NoDatamatch, VcpuFd, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::irq::IrqRouting;
use crate::layout::{KVM_IDENTITY_MAP_START, KVM_TSS_START};

/// Errors of VM setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `/dev/kvm` cannot be opened.
    #[error("cannot open /dev/kvm: {0}")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// The KVM API version is not 12.
    #[error("unsupported KVM API version {0}")]
    ApiVersion(i32),
    /// A capability the VMM relies on is missing.
    #[error("KVM lacks required capability {0:?}")]
    MissingCap(Cap),
    /// KVM_CREATE_VM failed.
    #[error("KVM_CREATE_VM: {0}")]
    CreateVm(#[source] kvm_ioctls::Error),
    /// KVM_SET_TSS_ADDR failed.
    #[error("KVM_SET_TSS_ADDR: {0}")]
    TssAddress(#[source] kvm_ioctls::Error),
    /// KVM_SET_IDENTITY_MAP_ADDR failed.
    #[error("KVM_SET_IDENTITY_MAP_ADDR: {0}")]
    IdentityMap(#[source] kvm_ioctls::Error),
    /// KVM_CREATE_IRQCHIP failed.
    #[error("KVM_CREATE_IRQCHIP (in-kernel PIC/IOAPIC/LAPIC): {0}")]
    IrqChip(#[source] kvm_ioctls::Error),
    /// KVM_CREATE_PIT2 failed.
    #[error("KVM_CREATE_PIT2: {0}")]
    Pit(#[source] kvm_ioctls::Error),
    /// A guest memory region has no host mapping or a size KVM cannot take.
    #[error("guest memory region at {gpa:#x} cannot be registered")]
    BadRegion {
        /// Guest physical start of the region.
        gpa: u64,
    },
    /// There are more memory regions than KVM slots.
    #[error("{regions} memory regions but KVM has only {slots} slots")]
    TooManyRegions {
        /// Regions to register.
        regions: usize,
        /// Slots KVM offers.
        slots: usize,
    },
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error("KVM_SET_USER_MEMORY_REGION slot {slot} at {gpa:#x}: {source}")]
    MemorySlot {
        /// Slot number.
        slot: u32,
        /// Guest physical start.
        gpa: u64,
        /// Underlying error.
        source: kvm_ioctls::Error,
    },
    /// KVM_IRQFD failed.
    #[error("KVM_IRQFD gsi {gsi}: {source}")]
    Irqfd {
        /// The GSI.
        gsi: u32,
        /// Underlying error.
        source: kvm_ioctls::Error,
    },
    /// GSI routing.
    #[error(transparent)]
    Routing(#[from] crate::irq::Error),
    /// KVM_IOEVENTFD failed.
    #[error("KVM_IOEVENTFD at {addr:?}: {source}")]
    Ioeventfd {
        /// The address.
        addr: IoEventAddress,
        /// Underlying error.
        source: kvm_ioctls::Error,
    },
    /// KVM_CREATE_VCPU failed.
    #[error("KVM_CREATE_VCPU {id}: {source}")]
    CreateVcpu {
        /// vCPU id.
        id: u8,
        /// Underlying error.
        source: kvm_ioctls::Error,
    },
    /// More vCPUs were requested than KVM supports.
    #[error("{requested} vCPUs requested but KVM supports {max}")]
    TooManyVcpus {
        /// Requested count.
        requested: usize,
        /// KVM's limit.
        max: usize,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// Opens `/dev/kvm` and checks the API version and the capabilities this VMM needs.
///
/// # Errors
/// [`Error::OpenKvm`], [`Error::ApiVersion`], [`Error::MissingCap`].
pub fn open_kvm() -> Result<Kvm> {
    let kvm = Kvm::new().map_err(Error::OpenKvm)?;
    let version = kvm.get_api_version();
    if version != 12 {
        return Err(Error::ApiVersion(version));
    }
    for cap in [
        Cap::Irqchip,
        Cap::Pit2,
        Cap::UserMemory,
        Cap::SetTssAddr,
        Cap::Irqfd,
        Cap::ExtCpuid,
    ] {
        if !kvm.check_extension(cap) {
            return Err(Error::MissingCap(cap));
        }
    }
    Ok(kvm)
}

/// A KVM VM with its guest memory registered.
///
/// `Vm` is `Sync`: devices that program interrupts or doorbells at run time (a virtio-pci
/// function when the guest enables MSI-X or a queue) share it as `Arc<Vm>`.
#[derive(Debug)]
pub struct Vm {
    fd: VmFd,
    memory: GuestMemoryMmap,
    routing: Mutex<IrqRouting>,
}

/// What an ioeventfd matches on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoeventMatch {
    /// Any write of any length.
    Any,
    /// A 2-byte write of this value (virtio-pci modern notifications write the queue index
    /// as 16 bits).
    U16(u16),
    /// A 4-byte write of this value.
    U32(u32),
}

/// Whether [`Vm::ioeventfd`] adds or removes an ioeventfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoeventOp {
    /// KVM_IOEVENTFD: start signalling the eventfd.
    Register,
    /// KVM_IOEVENTFD with the deassign flag: stop signalling it.
    Unregister,
}

impl Vm {
    /// Creates the VM: TSS and identity-map addresses, in-kernel irqchip, PIT2 (with a dummy
    /// speaker port so 0x61 reads work), and one memory slot per region of `memory`.
    ///
    /// # Errors
    /// The variant of the first step that fails.
    pub fn new(kvm: &Kvm, memory: GuestMemoryMmap) -> Result<Vm> {
        let fd = kvm.create_vm().map_err(Error::CreateVm)?;
        fd.set_tss_address(KVM_TSS_START as usize)
            .map_err(Error::TssAddress)?;
        fd.set_identity_map_address(KVM_IDENTITY_MAP_START)
            .map_err(Error::IdentityMap)?;
        fd.create_irq_chip().map_err(Error::IrqChip)?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(Error::Pit)?;
        let vm = Vm {
            fd,
            memory,
            routing: Mutex::new(IrqRouting::default()),
        };
        vm.register_memory(kvm.get_nr_memslots())?;
        Ok(vm)
    }

    fn register_memory(&self, max_slots: usize) -> Result<()> {
        let regions = self.memory.num_regions();
        if regions > max_slots {
            return Err(Error::TooManyRegions {
                regions,
                slots: max_slots,
            });
        }
        for (slot, region) in self.memory.iter().enumerate() {
            let gpa = region.start_addr().raw_value();
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|_| Error::BadRegion { gpa })?;
            let slot = u32::try_from(slot).map_err(|_| Error::BadRegion { gpa })?;
            let mr = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: gpa,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: `host` maps `region.len()` bytes owned by `self.memory`. The fd field is
            // declared first so it is dropped before the mapping, and every vCPU created by
            // `Machine` holds its own clone of the (Arc-backed) memory, so the mapping outlives
            // any vCPU that could still reach it through this slot.
            unsafe { self.fd.set_user_memory_region(mr) }.map_err(|source| Error::MemorySlot {
                slot,
                gpa,
                source,
            })?;
            tracing::debug!(slot, gpa, len = region.len(), "memory slot registered");
        }
        Ok(())
    }

    /// The KVM VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// Routes `evt` to `gsi` of the in-kernel irqchip: each write to `evt` raises the line
    /// (edge; for the IOAPIC/PIC a pulse).
    ///
    /// # Errors
    /// [`Error::Irqfd`].
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<()> {
        self.fd
            .register_irqfd(evt, gsi)
            .map_err(|source| Error::Irqfd { gsi, source })
    }

    /// Drives the in-kernel irqchip line `irq` (PIC and IOAPIC pin of the same number) to
    /// `high` with `KVM_IRQ_LINE`: a level that stays until changed (the ACPI SCI).
    ///
    /// # Errors
    /// [`Error::Irqfd`] (the interrupt-injection error).
    pub fn set_irq_line(&self, irq: u32, high: bool) -> Result<()> {
        self.fd
            .set_irq_line(irq, high)
            .map_err(|source| Error::Irqfd { gsi: irq, source })
    }

    /// Unregisters an irqfd registered with [`Vm::register_irqfd`].
    ///
    /// # Errors
    /// [`Error::Irqfd`].
    pub fn unregister_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<()> {
        self.fd
            .unregister_irqfd(evt, gsi)
            .map_err(|source| Error::Irqfd { gsi, source })
    }

    /// Reserves a GSI for an MSI route.
    ///
    /// # Errors
    /// [`Error::Routing`].
    pub fn allocate_msi_gsi(&self) -> Result<u32> {
        Ok(self.lock_routing().allocate_msi_gsi()?)
    }

    /// Routes MSI GSI `gsi` to `address`/`data` and commits the whole table to KVM. Pair it
    /// with [`Vm::register_irqfd`] on the same GSI to deliver the MSI from an eventfd.
    ///
    /// # Errors
    /// [`Error::Routing`].
    pub fn set_msi_route(&self, gsi: u32, address: u64, data: u32) -> Result<()> {
        let mut r = self.lock_routing();
        r.set_msi(gsi, address, data)?;
        self.commit_routing(&r)
    }

    /// Removes the MSI route of `gsi` (an irqfd on it then raises nothing) and commits.
    ///
    /// # Errors
    /// [`Error::Routing`].
    pub fn clear_msi_route(&self, gsi: u32) -> Result<()> {
        let mut r = self.lock_routing();
        if r.clear(gsi) {
            self.commit_routing(&r)?;
        }
        Ok(())
    }

    fn lock_routing(&self) -> std::sync::MutexGuard<'_, IrqRouting> {
        self.routing.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn commit_routing(&self, r: &IrqRouting) -> Result<()> {
        let table = r.to_kvm()?;
        self.fd
            .set_gsi_routing(&table)
            .map_err(|e| Error::Routing(crate::irq::Error::Commit(e)))
    }

    /// [`IoeventOp::Register`]: makes guest writes to `addr` that match `datamatch` signal
    /// `evt` inside KVM, without an exit to the VMM. [`IoeventOp::Unregister`] undoes that
    /// (same `evt`, `addr` and `datamatch`).
    ///
    /// # Errors
    /// [`Error::Ioeventfd`].
    pub fn ioeventfd(
        &self,
        op: IoeventOp,
        evt: &EventFd,
        addr: IoEventAddress,
        datamatch: IoeventMatch,
    ) -> Result<()> {
        // kvm-ioctls takes the datamatch width as a type parameter: one call per width.
        let r = match datamatch {
            IoeventMatch::Any => self.ioevent(op, evt, &addr, NoDatamatch),
            IoeventMatch::U16(v) => self.ioevent(op, evt, &addr, v),
            IoeventMatch::U32(v) => self.ioevent(op, evt, &addr, v),
        };
        r.map_err(|source| Error::Ioeventfd { addr, source })
    }

    fn ioevent<T: Into<u64>>(
        &self,
        op: IoeventOp,
        evt: &EventFd,
        addr: &IoEventAddress,
        datamatch: T,
    ) -> std::result::Result<(), kvm_ioctls::Error> {
        match op {
            IoeventOp::Register => self.fd.register_ioevent(evt, addr, datamatch),
            IoeventOp::Unregister => self.fd.unregister_ioevent(evt, addr, datamatch),
        }
    }

    /// Creates vCPU `id`.
    ///
    /// # Errors
    /// [`Error::CreateVcpu`].
    pub fn create_vcpu(&self, id: u8) -> Result<VcpuFd> {
        self.fd
            .create_vcpu(u64::from(id))
            .map_err(|source| Error::CreateVcpu { id, source })
    }
}
