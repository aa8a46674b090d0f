//! Records what this host's /dev/kvm offers (on the development machines: the PVM software
//! hypervisor) and checks the capabilities the VMM relies on. Run with `--nocapture` to see
//! the report.

mod common;

use kvm_ioctls::Cap;

#[test]
fn required_capabilities_and_report() {
    if !common::kvm_available() {
        return;
    }
    let kvm = vmm::vm::open_kvm().expect("KVM with the capabilities the VMM needs");
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    eprintln!(
        "KVM api {} (PVM module: {pvm}); max vCPUs {}, memslots {}",
        kvm.get_api_version(),
        kvm.get_max_vcpus(),
        kvm.get_nr_memslots()
    );
    for cap in [
        Cap::Irqchip,
        Cap::Pit2,
        Cap::Irqfd,
        Cap::Ioeventfd,
        Cap::IrqRouting,
        Cap::SignalMsi,
        Cap::SplitIrqchip,
        Cap::X2ApicApi,
        Cap::ImmediateExit,
        Cap::Xsave,
        Cap::TscDeadlineTimer,
        Cap::KvmclockCtrl,
    ] {
        eprintln!("  {cap:?}: {}", kvm.check_extension(cap));
    }
    let cpuid = vmm::boot::cpuid::supported_cpuid(&kvm).expect("KVM_GET_SUPPORTED_CPUID");
    let max_basic = cpuid.iter().find(|e| e.function == 0).map_or(0, |e| e.eax);
    let leaves = |f: u32| cpuid.iter().filter(|e| e.function == f).count();
    eprintln!(
        "  supported CPUID: {} entries, max basic leaf {max_basic:#x}, leaf 0xB x{}, leaf 0x1F x{}",
        cpuid.len(),
        leaves(0xb),
        leaves(0x1f)
    );
    assert!(!cpuid.is_empty());
    // KVM leaves the TSC-deadline bit out of its supported CPUID; the VMM offers it whenever
    // KVM can emulate it.
    let leaf1 = cpuid
        .iter()
        .find(|e| e.function == 1)
        .expect("CPUID leaf 1");
    assert_eq!(
        leaf1.ecx & (1 << 24) != 0,
        kvm.check_extension(Cap::TscDeadlineTimer),
        "CPUID.1:ECX TSC-deadline bit against KVM_CAP_TSC_DEADLINE_TIMER"
    );
    assert!(
        kvm.check_extension(Cap::Ioeventfd),
        "virtio-pci notifications need ioeventfd"
    );
    assert!(
        kvm.check_extension(Cap::IrqRouting),
        "MSI-X routing needs GSI routing"
    );
}
