//! The Linux boot path (`Machine::load_linux`) on this machine's /dev/kvm, with stand-in
//! "kernels": a hand-built ELF with a PVH note, an ELF without one (64-bit entry) and a
//! minimal bzImage. Each stand-in reads the boot structures the VMM prepared (start info,
//! zero page, command line, initrd, MP table) and reports them through a port. A real Linux
//! kernel cannot boot on the PVM software hypervisor in reasonable time (ENVIRONMENT.md).

mod common;

use std::path::PathBuf;

use common::*;
use vmm::boot::linux::LinuxBootConfig;
use vmm::exit::ExitReason;
use vmm::{Machine, MachineConfig};

const MEM: u64 = 4 << 20;
const CMDLINE: &str = "console=ttyS0 reboot=k";

/// A bzImage with one setup sector whose protected-mode part has `code64` at its 64-bit
/// entry (+0x200).
fn build_bzimage(code64: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 1024];
    f[0x1f1] = 1; // setup_sects
    f[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    f[0x202..0x206].copy_from_slice(b"HdrS");
    f[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
    f[0x211] = 1; // LOADED_HIGH
    f[0x214..0x218].copy_from_slice(&(KERNEL_ADDR as u32).to_le_bytes());
    f[0x22c..0x230].copy_from_slice(&0x37ff_ffffu32.to_le_bytes());
    f.extend(vec![0u8; 0x200]);
    f.extend_from_slice(code64);
    f
}

struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, bytes: &[u8]) -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("vmm-test-{}-{n}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Boots `kernel` with an optional `initrd` on 2 vCPUs; returns the reported dwords.
fn boot(kernel: &[u8], initrd: Option<&[u8]>, prefer_pvh: bool) -> Vec<u32> {
    let k = TempFile::new("kernel", kernel);
    let i = initrd.map(|b| TempFile::new("initrd", b));
    let mut m = Machine::new(&MachineConfig {
        mem_size: MEM,
        vcpus: 2,
    })
    .unwrap();
    m.add_debug_exit(EXIT_PORT).unwrap();
    let log = report_ports(&m, 4);
    m.load_linux(&LinuxBootConfig {
        kernel: k.0.clone(),
        initrd: i.as_ref().map(|f| f.0.clone()),
        cmdline: CMDLINE.into(),
        prefer_pvh,
    })
    .unwrap();
    // The AP stays in wait-for-SIPI; stopping must still end its thread.
    let exit = m.run().unwrap();
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(exit.vcpu_stats.len(), 2);
    reported(&log)
}

fn le(s: &[u8]) -> u32 {
    u32::from_le_bytes(s[..4].try_into().unwrap())
}

#[test]
fn pvh_entry_sees_start_info_cmdline_initrd_and_mptable() {
    if !kvm_available() {
        return;
    }
    // 32-bit flat code, EBX = hvm_start_info.
    let mut a = Asm::new();
    a.raw(&[0x8b, 0x03]) // mov eax, [ebx]           magic
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x43, 0x30]) // mov eax, [ebx+0x30]  memmap_entries
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x43, 0x18, 0x8b, 0x00]) // mov eax, [ebx+0x18]; mov eax, [eax]  cmdline
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x43, 0x10, 0x8b, 0x00]) // modlist_paddr -> module paddr
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x00]) // first dword of the initrd
        .report_eax(REPORT_PORT)
        .load_eax(0xf0000) // MP floating pointer signature
        .report_eax(REPORT_PORT)
        .debug_exit(0);
    let initrd = vec![0xa5u8; 4096];
    let got = boot(&build_elf(&a.code, true), Some(&initrd), true);
    assert_eq!(
        got,
        vec![
            0x336e_c578,
            4,
            le(CMDLINE.as_bytes()),
            (MEM - 4096) as u32,
            0xa5a5_a5a5,
            le(b"_MP_")
        ]
    );
}

/// 64-bit code reading the zero page at RSI.
fn zero_page_reader() -> Asm {
    let mut a = Asm::new();
    a.raw(&[0x8b, 0x86, 0xe8, 0x01, 0, 0]) // mov eax, [rsi+0x1e8]  e820_entries
        .raw(&[0x25, 0xff, 0, 0, 0]) // and eax, 0xff
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x86, 0x02, 0x02, 0, 0]) // header magic
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x86, 0x28, 0x02, 0, 0, 0x8b, 0x00]) // cmd_line_ptr -> text
        .report_eax(REPORT_PORT)
        .raw(&[0x8b, 0x86, 0x18, 0x02, 0, 0]) // ramdisk_image
        .report_eax(REPORT_PORT)
        .debug_exit(0);
    a
}

/// An ELF without a PVH note, and a PVH ELF booted without preferring PVH, are entered at
/// their 64-bit entry with the zero page.
#[test]
fn elf_64bit_entry_sees_boot_params() {
    if !kvm_available() {
        return;
    }
    for (case, pvh_note, prefer_pvh) in [
        ("ELF without a PVH note", false, true),
        ("PVH ELF entered at its 64-bit entry", true, false),
    ] {
        let got = boot(
            &build_elf(&zero_page_reader().code, pvh_note),
            None,
            prefer_pvh,
        );
        assert_eq!(
            got,
            vec![4, le(b"HdrS"), le(CMDLINE.as_bytes()), 0],
            "{case}"
        );
    }
}

#[test]
fn bzimage_64bit_entry_sees_boot_params_and_initrd() {
    if !kvm_available() {
        return;
    }
    let initrd = vec![1u8; 8192];
    let got = boot(
        &build_bzimage(&zero_page_reader().code),
        Some(&initrd),
        true,
    );
    assert_eq!(
        got,
        vec![4, le(b"HdrS"), le(CMDLINE.as_bytes()), (MEM - 8192) as u32]
    );
}
