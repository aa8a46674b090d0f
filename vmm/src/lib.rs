//! bouncevm's KVM virtual machine monitor core.
//!
//! This crate owns everything between `/dev/kvm` and the device models:
//!
//! * [`vm`]: the KVM VM (memory slots, in-kernel irqchip and PIT, TSS and identity map).
//! * [`memory`]: the guest physical address map and guest RAM allocation.
//! * [`bus`]: PIO and MMIO buses that route exits to range-registered [`bus::BusDevice`]s.
//! * [`vcpu`]: vCPU wrappers and the per-vCPU thread run loop.
//! * [`irq`]: GSI routing (default irqchip routes plus MSI routes for MSI-X).
//! * [`exit`]: how a VM ends ([`exit::ExitReason`]) and the handle that asks it to end.
//! * [`legacy`]: the 16550 serial console, the i8042 reset line and a debug-exit port.
//! * [`pci`]: a PCI segment with a host bridge, configuration mechanism #1 and ECAM, and the
//!   [`pci::PciDevice`] trait a virtio-pci function implements.
//! * [`boot`]: Linux boot helpers (bzImage and PVH loading, boot_params/e820, page tables,
//!   GDT, CPUID topology, MSRs, MP table).
//! * [`virtio_pci`]: the modern virtio-pci transport (MSI-X through irqfd, notifications
//!   through ioeventfd) for `devices::virtio::VirtioDevice`s.
//! * [`cli`]: the `bouncevm` command line; [`qmp`]: the QMP monitor.
//! * [`machine`]: a [`machine::Machine`] that wires all of the above together and runs it.
//!
//! The devices and how they are built from the command line's options (`devices::options`,
//! `devices::builder`) live in the `devices` crate; safely bound sockets, the signalfd and the
//! logger in `bouncevm-common`.
//!
//! The crate is x86_64-only.

#![cfg(target_arch = "x86_64")]
#![warn(missing_docs)]

pub mod boot;
pub mod bus;
pub mod cli;
pub mod exit;
pub mod irq;
pub mod layout;
pub mod legacy;
pub mod machine;
pub mod memory;
pub mod pci;
pub mod qmp;
pub mod vcpu;
pub mod virtio_pci;
pub mod vm;

pub use bus::{Bus, BusDevice};

pub use exit::{ExitHandle, ExitReason};
pub use machine::{Machine, MachineConfig, RunningMachine};
