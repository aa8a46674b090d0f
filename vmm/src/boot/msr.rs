//! MSRs, FPU and local APIC state Linux expects at entry.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_msr_entry, Msrs};

use crate::vcpu::Vcpu;

/// IA32_TSC.
pub const MSR_IA32_TSC: u32 = 0x10;
/// IA32_SYSENTER_CS.
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// IA32_SYSENTER_ESP.
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// IA32_SYSENTER_EIP.
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// IA32_MISC_ENABLE.
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MTRR_DEF_TYPE.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// STAR.
pub const MSR_STAR: u32 = 0xc000_0081;
/// LSTAR.
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// CSTAR.
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// SYSCALL_MASK.
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// KERNEL_GS_BASE.
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

/// MISC_ENABLE: fast string operations.
pub const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRR default type: MTRRs enabled, default write-back.
pub const MTRR_DEF_TYPE_ENABLED_WB: u64 = (1 << 11) | 6;

/// Errors of MSR/FPU/LAPIC setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An ioctl failed.
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::Error),
    /// KVM_SET_MSRS set fewer MSRs than given; `index` is the first one it refused.
    #[error("KVM_SET_MSRS refused MSR {index:#x} ({set} of {total} set)")]
    MsrRefused {
        /// The refused MSR.
        index: u32,
        /// How many were set.
        set: usize,
        /// How many were given.
        total: usize,
    },
    /// Building the MSR list failed.
    #[error("MSR list: {0:?}")]
    List(vmm_sys_util::fam::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// The boot MSR values: syscall/sysenter state cleared, TSC 0, fast strings on, MTRRs enabled
/// with write-back default (Linux otherwise maps all memory uncached).
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    let msr = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        msr(MSR_IA32_SYSENTER_CS, 0),
        msr(MSR_IA32_SYSENTER_ESP, 0),
        msr(MSR_IA32_SYSENTER_EIP, 0),
        msr(MSR_STAR, 0),
        msr(MSR_CSTAR, 0),
        msr(MSR_KERNEL_GS_BASE, 0),
        msr(MSR_SYSCALL_MASK, 0),
        msr(MSR_LSTAR, 0),
        msr(MSR_IA32_TSC, 0),
        msr(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        msr(MSR_MTRR_DEF_TYPE, MTRR_DEF_TYPE_ENABLED_WB),
    ]
}

/// Sets [`boot_msrs`] on `vcpu`.
///
/// # Errors
/// [`Error::MsrRefused`] names the first MSR KVM did not accept.
pub fn setup_msrs(vcpu: &Vcpu) -> Result<()> {
    let entries = boot_msrs();
    let msrs = Msrs::from_entries(&entries).map_err(Error::List)?;
    let set = vcpu
        .fd()
        .set_msrs(&msrs)
        .map_err(vcpu.ioctl_err("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(Error::MsrRefused {
            index: entries.get(set).map_or(0, |e| e.index),
            set,
            total: entries.len(),
        });
    }
    Ok(())
}

/// The initial FPU state: FCW 0x37f (all exceptions masked), MXCSR 0x1f80.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// Sets [`boot_fpu`] on `vcpu`.
///
/// # Errors
/// [`Error::Vcpu`].
pub fn setup_fpu(vcpu: &Vcpu) -> Result<()> {
    vcpu.fd()
        .set_fpu(&boot_fpu())
        .map_err(vcpu.ioctl_err("KVM_SET_FPU"))?;
    Ok(())
}

/// LAPIC LVT LINT0 register offset.
pub(crate) const APIC_LVT0: usize = 0x350;
/// LAPIC LVT LINT1 register offset.
pub(crate) const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// The 32-bit LAPIC register at `offset` of a `KVM_GET_LAPIC` image.
pub(crate) fn lapic_reg(state: &kvm_lapic_state, offset: usize) -> u32 {
    let mut b = [0u8; 4];
    for (i, byte) in b.iter_mut().enumerate() {
        *byte = state.regs[offset + i] as u8;
    }
    u32::from_le_bytes(b)
}

/// Sets the 32-bit LAPIC register at `offset` of a `KVM_SET_LAPIC` image.
pub(crate) fn set_lapic_reg(state: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().iter().enumerate() {
        state.regs[offset + i] = *byte as _;
    }
}

fn with_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// Routes LINT0 as ExtINT (the PIC) and LINT1 as NMI, as firmware does for Linux.
pub fn configure_lint(state: &mut kvm_lapic_state) {
    let lvt0 = lapic_reg(state, APIC_LVT0);
    set_lapic_reg(state, APIC_LVT0, with_delivery_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(state, APIC_LVT1);
    set_lapic_reg(state, APIC_LVT1, with_delivery_mode(lvt1, APIC_MODE_NMI));
}

/// Applies [`configure_lint`] to the in-kernel LAPIC of `vcpu`.
///
/// # Errors
/// [`Error::Vcpu`].
pub fn setup_lapic(vcpu: &Vcpu) -> Result<()> {
    let fd = vcpu.fd();
    let mut state = fd.get_lapic().map_err(vcpu.ioctl_err("KVM_GET_LAPIC"))?;
    configure_lint(&mut state);
    fd.set_lapic(&state)
        .map_err(vcpu.ioctl_err("KVM_SET_LAPIC"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lint_modes() {
        let mut s = kvm_lapic_state::default();
        set_lapic_reg(&mut s, APIC_LVT0, 0x0001_0700);
        configure_lint(&mut s);
        assert_eq!(lapic_reg(&s, APIC_LVT0), 0x0001_0700);
        assert_eq!(lapic_reg(&s, APIC_LVT1), 0x400);
    }

    #[test]
    fn msr_list() {
        let m = boot_msrs();
        assert!(m
            .iter()
            .any(|e| e.index == MSR_MTRR_DEF_TYPE && e.data == 0x806));
        let mut idx: Vec<u32> = m.iter().map(|e| e.index).collect();
        idx.sort_unstable();
        idx.dedup();
        assert_eq!(idx.len(), m.len());
    }
}
