//! Initial register state of the boot vCPU.
//!
//! [`EntryState`] names the three ways this VMM starts a guest:
//! * [`EntryState::Real`]: real mode at `cs:ip` (test programs).
//! * [`EntryState::Flat32`]: 32-bit protected mode, flat segments, paging off. This is the
//!   PVH entry state (`ebx` = physical address of `hvm_start_info`), also used by tests.
//! * [`EntryState::Long64`]: 64-bit long mode with the identity map of [`super::paging`]; the
//!   Linux 64-bit boot protocol entry (`rsi` = zero page).
//!
//! The `*_sregs` builders are pure functions over a `kvm_sregs` (so they are unit-tested);
//! [`EntryState::apply`] also writes the GDT (and page tables) and sets the vCPU registers.

use kvm_bindings::{kvm_regs, kvm_sregs};
use vm_memory::GuestMemoryMmap;

use super::gdt::{self, CODE_INDEX, DATA_INDEX, TSS_INDEX};
use super::paging;
use crate::layout::{BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER};
use crate::vcpu::Vcpu;

/// CR0.PE: protected mode.
pub const X86_CR0_PE: u64 = 1 << 0;
/// CR0.ET: extension type (always 1 on modern CPUs).
pub const X86_CR0_ET: u64 = 1 << 4;
/// CR0.PG: paging.
pub const X86_CR0_PG: u64 = 1 << 31;
/// CR4.PAE.
pub const X86_CR4_PAE: u64 = 1 << 5;
/// EFER.LME: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER.LMA: long mode active.
pub const EFER_LMA: u64 = 1 << 10;
/// RFLAGS bit 1 is reserved and always set.
pub const RFLAGS_RESERVED: u64 = 1 << 1;

/// Errors of register setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Writing the GDT or page tables to guest memory failed.
    #[error("cannot write boot tables to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    /// A register ioctl failed.
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// Where and how the vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    /// Real mode at `cs_selector:ip` (CS base = selector * 16), data segments 0.
    Real {
        /// CS selector.
        cs_selector: u16,
        /// Instruction pointer.
        ip: u16,
        /// Stack pointer (SS = 0).
        sp: u16,
    },
    /// Flat 32-bit protected mode, paging off.
    Flat32 {
        /// Entry point.
        eip: u32,
        /// EBX (PVH: `hvm_start_info` address).
        ebx: u32,
        /// Stack pointer.
        esp: u32,
    },
    /// 64-bit long mode, identity-mapped low 4 GiB.
    Long64 {
        /// Entry point.
        rip: u64,
        /// RSI (Linux: zero page address).
        rsi: u64,
        /// Stack pointer.
        rsp: u64,
    },
}

impl EntryState {
    /// The PVH entry state for entry point `entry` and start info at `start_info`.
    pub fn pvh(entry: u32, start_info: u32) -> Self {
        EntryState::Flat32 {
            eip: entry,
            ebx: start_info,
            esp: 0,
        }
    }

    /// The Linux 64-bit boot protocol entry for a kernel entered at `entry` with the zero
    /// page at `zero_page`.
    pub fn linux64(entry: u64, zero_page: u64) -> Self {
        EntryState::Long64 {
            rip: entry,
            rsi: zero_page,
            rsp: BOOT_STACK_POINTER,
        }
    }

    /// General-purpose registers for this state.
    pub fn regs(&self) -> kvm_regs {
        let mut r = kvm_regs {
            rflags: RFLAGS_RESERVED,
            ..Default::default()
        };
        match *self {
            EntryState::Real { ip, sp, .. } => {
                r.rip = u64::from(ip);
                r.rsp = u64::from(sp);
            }
            EntryState::Flat32 { eip, ebx, esp } => {
                r.rip = u64::from(eip);
                r.rbx = u64::from(ebx);
                r.rsp = u64::from(esp);
            }
            EntryState::Long64 { rip, rsi, rsp } => {
                r.rip = rip;
                r.rsi = rsi;
                r.rsp = rsp;
                r.rbp = rsp;
            }
        }
        r
    }

    /// Writes the tables this state needs and sets the vCPU's registers.
    ///
    /// # Errors
    /// [`Error::Memory`] when low memory is missing, [`Error::Vcpu`] on ioctl failure.
    pub fn apply(&self, vcpu: &Vcpu, mem: &GuestMemoryMmap) -> Result<()> {
        let fd = vcpu.fd();
        let base = fd.get_sregs().map_err(vcpu.ioctl_err("KVM_GET_SREGS"))?;
        let sregs = match *self {
            EntryState::Real { cs_selector, .. } => real_mode_sregs(base, cs_selector),
            EntryState::Flat32 { .. } => {
                let table = gdt::gdt_flat32();
                gdt::write_gdt(mem, &table)?;
                flat32_sregs(base, &table)
            }
            EntryState::Long64 { .. } => {
                let table = gdt::gdt_long_mode();
                gdt::write_gdt(mem, &table)?;
                let cr3 = paging::write_identity_map(mem)?;
                long_mode_sregs(base, &table, cr3)
            }
        };
        fd.set_sregs(&sregs)
            .map_err(vcpu.ioctl_err("KVM_SET_SREGS"))?;
        fd.set_regs(&self.regs())
            .map_err(vcpu.ioctl_err("KVM_SET_REGS"))?;
        Ok(())
    }
}

/// Real mode with CS = `cs_selector` and zero data segments.
pub fn real_mode_sregs(mut s: kvm_sregs, cs_selector: u16) -> kvm_sregs {
    s.cs.selector = cs_selector;
    s.cs.base = u64::from(cs_selector) << 4;
    for seg in [&mut s.ds, &mut s.es, &mut s.fs, &mut s.gs, &mut s.ss] {
        seg.selector = 0;
        seg.base = 0;
    }
    s.cr0 &= !(X86_CR0_PE | X86_CR0_PG);
    s
}

fn load_segments(s: &mut kvm_sregs, table: &[u64; 4]) {
    let code = gdt::kvm_segment_from_gdt(table[usize::from(CODE_INDEX)], CODE_INDEX);
    let data = gdt::kvm_segment_from_gdt(table[usize::from(DATA_INDEX)], DATA_INDEX);
    let tss = gdt::kvm_segment_from_gdt(table[usize::from(TSS_INDEX)], TSS_INDEX);
    s.gdt.base = BOOT_GDT_START;
    s.gdt.limit = (std::mem::size_of_val(table) - 1) as u16;
    s.idt.base = BOOT_IDT_START;
    s.idt.limit = 7;
    s.cs = code;
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
    s.tr = tss;
}

/// Flat 32-bit protected mode from `table` (see [`gdt::gdt_flat32`]), paging off.
pub fn flat32_sregs(mut s: kvm_sregs, table: &[u64; 4]) -> kvm_sregs {
    load_segments(&mut s, table);
    s.cr0 = (s.cr0 | X86_CR0_PE | X86_CR0_ET) & !X86_CR0_PG;
    s.cr4 = 0;
    s.efer = 0;
    s
}

/// Long mode from `table` (see [`gdt::gdt_long_mode`]) with page tables at `cr3`.
pub fn long_mode_sregs(mut s: kvm_sregs, table: &[u64; 4], cr3: u64) -> kvm_sregs {
    load_segments(&mut s, table);
    s.cr3 = cr3;
    s.cr4 |= X86_CR4_PAE;
    s.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    s.efer |= EFER_LME | EFER_LMA;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_mode_state() {
        let s = long_mode_sregs(kvm_sregs::default(), &gdt::gdt_long_mode(), 0x9000);
        assert_eq!(s.cr3, 0x9000);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_ne!(s.cr0 & X86_CR0_PE, 0);
        assert_ne!(s.cr4 & X86_CR4_PAE, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!((s.cs.l, s.cs.db, s.cs.selector), (1, 0, 0x08));
        assert_eq!(s.ds.selector, 0x10);
        assert_eq!(s.tr.type_, 0xb);
        assert_eq!(s.gdt.base, BOOT_GDT_START);
        assert_eq!(s.gdt.limit, 31);
    }

    #[test]
    fn flat32_state() {
        let s = flat32_sregs(kvm_sregs::default(), &gdt::gdt_flat32());
        assert_eq!(s.cr0 & (X86_CR0_PE | X86_CR0_PG), X86_CR0_PE);
        assert_eq!(s.efer, 0);
        assert_eq!(
            (s.cs.l, s.cs.db, s.cs.limit, s.cs.base),
            (0, 1, 0xffff_ffff, 0)
        );
        assert_eq!((s.ss.db, s.ss.type_), (1, 0x3));
        let r = EntryState::pvh(0x100_0000, 0x6000).regs();
        assert_eq!((r.rip, r.rbx, r.rflags), (0x100_0000, 0x6000, 2));
    }

    #[test]
    fn real_mode_state() {
        let s = real_mode_sregs(kvm_sregs::default(), 0x100);
        assert_eq!((s.cs.base, s.cs.selector), (0x1000, 0x100));
        assert_eq!(s.cr0 & X86_CR0_PE, 0);
    }
}
