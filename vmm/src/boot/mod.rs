//! Boot helpers: CPU entry state and the structures Linux reads at boot.
//!
//! * [`gdt`]: descriptor encoding and the boot GDT.
//! * [`paging`]: identity page tables for the 64-bit entry.
//! * [`regs`]: [`regs::EntryState`] (real mode, flat 32-bit/PVH, 64-bit) applied to a vCPU.
//! * [`cpuid`]: CPUID from `KVM_GET_SUPPORTED_CPUID` with per-vCPU topology.
//! * [`msr`]: boot MSRs, FPU and LAPIC LINT setup.
//! * [`mptable`]: the Intel MP table that lets Linux find every vCPU.
//! * [`e820`]: the memory map for boot_params and PVH.
//! * [`acpi`]: RSDP, XSDT, FADT, FACS, DSDT (`\_S5_`, PCI host bridge) and MADT.
//! * [`linux`]: loading bzImage / ELF (PVH) kernels, initrd, command line, boot_params.
//!
//! Everything that does not need KVM is a pure function over guest memory or plain values
//! and is unit-tested here; the parts that need a vCPU are exercised by `vmm/tests/`.

pub mod acpi;
pub mod cpuid;
pub mod e820;
pub mod gdt;
pub mod linux;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod regs;
