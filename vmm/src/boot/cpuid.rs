//! CPUID for the guest: `KVM_GET_SUPPORTED_CPUID` with the topology of this VM filled in.
//!
//! Topology: `n` vCPUs are `n` cores of one socket, one thread per core; vCPU `i` has APIC id
//! `i`. [`patch_cpuid`] rewrites:
//! * leaf 0x1: EBX\[31:24\] initial APIC id, EBX\[23:16\] logical processors per package, ECX bit
//!   31 (hypervisor present), EDX bit 28 (HTT) when there is more than one vCPU;
//! * leaf 0x4 (Intel deterministic cache parameters): EAX\[31:26\] cores per package - 1 and
//!   EAX\[25:14\] sharing (L3 shared by all vCPUs, lower levels private);
//! * leaves 0xB and 0x1F (extended topology): SMT level (1 thread, shift 0), core level
//!   (`n` cores, shift `ceil(log2 n)`), then an invalid level; EDX = x2APIC id. 0xB is added
//!   if KVM did not report it while the max basic leaf allows it;
//! * leaf 0x8000_0008 ECX (AMD): NC = `n - 1` and ApicIdCoreIdSize.
//!
//! [`supported_cpuid`] also sets CPUID.1:ECX bit 24 (TSC-deadline mode of the LAPIC timer) when
//! KVM has `KVM_CAP_TSC_DEADLINE_TIMER`: KVM emulates that mode in its in-kernel LAPIC (which
//! every bouncevm VM has) but leaves the bit out of `KVM_GET_SUPPORTED_CPUID`, since it depends on
//! the VMM's irqchip choice; QEMU, Cloud Hypervisor and Firecracker set it the same way. Without
//! it a Linux guest runs its LAPIC timers in one-shot mode calibrated against the PIT at boot,
//! and falls back to the PIT's periodic interrupts (broadcast to the other CPUs) when that
//! calibration fails, as it does under nested virtualization on a loaded host.

use kvm_bindings::{
    kvm_cpuid_entry2, CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm};

/// Errors of CPUID setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("KVM_GET_SUPPORTED_CPUID: {0}")]
    Supported(#[source] kvm_ioctls::Error),
    /// The patched table does not fit KVM's entry limit.
    #[error("CPUID table too large: {0:?}")]
    TooLarge(vmm_sys_util::fam::Error),
    /// KVM_SET_CPUID2 failed.
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::Error),
    /// Zero vCPUs or a vCPU id outside the VM.
    #[error("invalid topology: vCPU {id} of {count}")]
    InvalidTopology {
        /// vCPU id.
        id: u8,
        /// Number of vCPUs.
        count: u8,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

// CPUID leaf and bit numbers: constants, alike in shape only to other tables.
const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE: u32 = 0x4;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_AMD_SIZES: u32 = 0x8000_0008;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Bits needed to hold ids `0..n` (`ceil(log2 n)`).
fn id_bits(n: u8) -> u32 {
    match n {
        0 | 1 => 0,
        n => u32::BITS - (u32::from(n) - 1).leading_zeros(),
    }
}

fn topology_entry(function: u32, index: u32, apic_id: u32, count: u8) -> kvm_cpuid_entry2 {
    let (eax, ebx, ecx) = match index {
        0 => (0, 1, LEVEL_SMT << 8),
        1 => (id_bits(count), u32::from(count), LEVEL_CORE << 8 | 1),
        i => (0, 0, i & 0xff),
    };
    kvm_cpuid_entry2 {
        function,
        index,
        flags: KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
        eax,
        ebx,
        ecx,
        edx: apic_id,
        ..Default::default()
    }
}

/// Rewrites `entries` for vCPU `id` of `count` (see the module documentation).
///
/// # Errors
/// [`Error::InvalidTopology`] when `count == 0` or `id >= count`.
pub fn patch_cpuid(entries: &mut Vec<kvm_cpuid_entry2>, id: u8, count: u8) -> Result<()> {
    if count == 0 || id >= count {
        return Err(Error::InvalidTopology { id, count });
    }
    let apic_id = u32::from(id);
    let max_basic = entries
        .iter()
        .find(|e| e.function == 0)
        .map(|e| e.eax)
        .unwrap_or(0);
    for e in entries.iter_mut() {
        match e.function {
            LEAF_FEATURES => {
                e.ebx = (e.ebx & 0x0000_ffff) | apic_id << 24 | u32::from(count) << 16;
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            // Cache type 0 marks the end of the subleaf list.
            LEAF_CACHE if e.eax & 0x1f != 0 => {
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { u32::from(count) - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | (sharing & 0xfff) << 14 | (u32::from(count) - 1) << 26;
            }
            LEAF_AMD_SIZES => {
                e.ecx = (e.ecx & !0xf0ff) | id_bits(count) << 12 | (u32::from(count) - 1);
            }
            _ => {}
        }
    }
    for leaf in [LEAF_TOPOLOGY, LEAF_TOPOLOGY_V2] {
        let present = entries.iter().any(|e| e.function == leaf);
        if present || (leaf == LEAF_TOPOLOGY && max_basic >= LEAF_TOPOLOGY) {
            entries.retain(|e| e.function != leaf);
            entries.extend((0..3).map(|i| topology_entry(leaf, i, apic_id, count)));
        }
    }
    Ok(())
}

/// The supported CPUID of this host's KVM, with the TSC-deadline timer bit set when KVM can
/// emulate it (see the module documentation).
///
/// # Errors
/// [`Error::Supported`].
pub fn supported_cpuid(kvm: &Kvm) -> Result<Vec<kvm_cpuid_entry2>> {
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::Supported)?;
    let mut entries = cpuid.as_slice().to_vec();
    if kvm.check_extension(Cap::TscDeadlineTimer) {
        offer_tsc_deadline(&mut entries);
    }
    Ok(entries)
}

/// Sets CPUID.1:ECX bit 24, the TSC-deadline mode of the in-kernel LAPIC timer.
fn offer_tsc_deadline(entries: &mut [kvm_cpuid_entry2]) {
    for e in entries.iter_mut().filter(|e| e.function == LEAF_FEATURES) {
        e.ecx |= ECX_TSC_DEADLINE;
    }
}

/// Patches `base` for `vcpu` and sets it with KVM_SET_CPUID2.
///
/// # Errors
/// [`Error::InvalidTopology`], [`Error::TooLarge`], [`Error::Vcpu`].
pub fn configure_vcpu_cpuid(
    vcpu: &crate::vcpu::Vcpu,
    base: &[kvm_cpuid_entry2],
    count: u8,
) -> Result<()> {
    let mut entries = base.to_vec();
    patch_cpuid(&mut entries, vcpu.id(), count)?;
    let cpuid = CpuId::from_entries(&entries).map_err(Error::TooLarge)?;
    vcpu.fd()
        .set_cpuid2(&cpuid)
        .map_err(vcpu.ioctl_err("KVM_SET_CPUID2"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        function: u32,
        index: u32,
        eax: u32,
        ebx: u32,
        ecx: u32,
        edx: u32,
    ) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    fn base() -> Vec<kvm_cpuid_entry2> {
        vec![
            entry(0, 0, 0xd, 0, 0, 0),
            // Leaf 1 with a CLFLUSH size of 8 in EBX[15:8] and stale APIC id 0x55.
            entry(1, 0, 0x906ea, 0x5501_0800, 0, 0x1000_0000),
            entry(4, 0, 0x0000_0121, 0, 0, 0),
            entry(4, 3, 0x0000_0163, 0, 0, 0),
            entry(4, 4, 0, 0, 0, 0),
            entry(0x8000_0008, 0, 0x3030, 0, 0x0000_70ff, 0),
        ]
    }

    #[test]
    fn leaf1_apic_id_and_count() {
        let mut e = base();
        patch_cpuid(&mut e, 3, 4).unwrap();
        let l1 = e.iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800);
        assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
        assert_ne!(l1.edx & EDX_HTT, 0);
        let mut e = base();
        patch_cpuid(&mut e, 0, 1).unwrap();
        assert_eq!(e.iter().find(|e| e.function == 1).unwrap().edx & EDX_HTT, 0);
    }

    #[test]
    fn extended_topology_added() {
        let mut e = base();
        patch_cpuid(&mut e, 2, 3).unwrap();
        let b: Vec<_> = e.iter().filter(|e| e.function == 0xb).collect();
        assert_eq!(b.len(), 3);
        assert_eq!((b[0].eax, b[0].ebx, b[0].ecx, b[0].edx), (0, 1, 0x100, 2));
        assert_eq!((b[1].eax, b[1].ebx, b[1].ecx, b[1].edx), (2, 3, 0x201, 2));
        assert_eq!((b[2].ebx, b[2].ecx & 0xff00), (0, 0));
        assert!(b
            .iter()
            .all(|e| e.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX != 0));
        // 0x1F only mirrors 0xB when KVM reported it.
        assert!(!e.iter().any(|e| e.function == 0x1f));
        let mut with_1f = base();
        with_1f.push(entry(0x1f, 0, 0, 0, 0, 0));
        patch_cpuid(&mut with_1f, 1, 2).unwrap();
        assert_eq!(with_1f.iter().filter(|e| e.function == 0x1f).count(), 3);
    }

    #[test]
    fn cache_and_amd_sizes() {
        let mut e = base();
        patch_cpuid(&mut e, 0, 4).unwrap();
        let l1d = e.iter().find(|e| e.function == 4 && e.index == 0).unwrap();
        assert_eq!(l1d.eax >> 26, 3);
        assert_eq!((l1d.eax >> 14) & 0xfff, 0);
        let l3 = e.iter().find(|e| e.function == 4 && e.index == 3).unwrap();
        assert_eq!((l3.eax >> 14) & 0xfff, 3);
        assert_eq!(l3.eax & 0x3fff, 0x163);
        let end = e.iter().find(|e| e.function == 4 && e.index == 4).unwrap();
        assert_eq!(end.eax, 0);
        let amd = e.iter().find(|e| e.function == 0x8000_0008).unwrap();
        assert_eq!(amd.ecx & 0xff, 3);
        assert_eq!((amd.ecx >> 12) & 0xf, 2);
    }

    #[test]
    fn tsc_deadline_offered_on_leaf_1_only() {
        let mut e = base();
        offer_tsc_deadline(&mut e);
        for x in &e {
            let want = if x.function == 1 { ECX_TSC_DEADLINE } else { 0 };
            assert_eq!(x.ecx & ECX_TSC_DEADLINE, want, "leaf {:#x}", x.function);
        }
        // The topology patch keeps it.
        patch_cpuid(&mut e, 1, 2).unwrap();
        let l1 = e.iter().find(|e| e.function == 1).unwrap();
        assert_ne!(l1.ecx & ECX_TSC_DEADLINE, 0);
    }

    #[test]
    fn id_bits_values() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9].map(id_bits), [0, 1, 2, 2, 3, 3, 4]);
    }

    #[test]
    fn bad_topology() {
        assert!(patch_cpuid(&mut base(), 2, 2).is_err());
        assert!(patch_cpuid(&mut base(), 0, 0).is_err());
    }
}
