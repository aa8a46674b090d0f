//! Shared helpers for the KVM guest tests: a skip check, a tiny x86 assembler, a recording
//! bus device and a shared serial sink.

#![allow(dead_code)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use devices::virtio::spec::{
    feature, VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_FEATURES_OK,
};
use vmm::bus::BusDevice;
use vmm::exit::{ExitHandle, ExitReason};

/// Returns `false` when this machine cannot run KVM guests, after recording the skip
/// (`bounce::testing::missing`: counted by ./tests/run, a failure with BVM_REQUIRE_RESOURCES).
pub fn kvm_available() -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            bounce::testing::missing(
                bounce::testing::Resource::Kvm,
                &format!("/dev/kvm not usable ({e})"),
            );
            false
        }
    }
}

/// The `bouncevm` binary this package builds.
pub const BIN: &str = env!("CARGO_BIN_EXE_bouncevm");

/// Starts `cmd` (a `bouncevm` line) with stdin from /dev/null and stdout and stderr piped.
pub fn spawn_piped(cmd: &mut std::process::Command) -> std::process::Child {
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn bouncevm")
}

/// A port for test results.
pub const REPORT_PORT: u16 = 0xe0;
/// The debug-exit port used by the tests.
pub const EXIT_PORT: u16 = 0x501;
/// Where guest code is loaded.
pub const CODE_ADDR: u64 = 0x1000;

/// A byte-level assembler for the handful of instructions the tests use. Encodings are for
/// 32-bit protected mode unless noted; the ones marked "any" are identical in 64-bit mode.
#[derive(Default)]
pub struct Asm {
    pub code: Vec<u8>,
}

impl Asm {
    pub fn new() -> Self {
        Self::default()
    }
    fn b(&mut self, bytes: &[u8]) -> &mut Self {
        self.code.extend_from_slice(bytes);
        self
    }
    /// `mov eax, imm32` (any).
    pub fn mov_eax(&mut self, v: u32) -> &mut Self {
        self.b(&[0xb8]).b(&v.to_le_bytes())
    }
    /// `mov ecx, imm32` (any).
    pub fn mov_ecx(&mut self, v: u32) -> &mut Self {
        self.b(&[0xb9]).b(&v.to_le_bytes())
    }
    /// `mov dx, imm16` (32/64-bit mode: operand-size prefix).
    pub fn mov_dx(&mut self, v: u16) -> &mut Self {
        self.b(&[0x66, 0xba]).b(&v.to_le_bytes())
    }
    /// `mov al, imm8` (any).
    pub fn mov_al(&mut self, v: u8) -> &mut Self {
        self.b(&[0xb0, v])
    }
    /// `out dx, eax` (any).
    pub fn out_dx_eax(&mut self) -> &mut Self {
        self.b(&[0xef])
    }
    /// `out dx, al` (any).
    pub fn out_dx_al(&mut self) -> &mut Self {
        self.b(&[0xee])
    }
    /// `out imm8, al` (any).
    pub fn out_imm_al(&mut self, port: u8) -> &mut Self {
        self.b(&[0xe6, port])
    }
    /// `in eax, dx` (any).
    pub fn in_eax_dx(&mut self) -> &mut Self {
        self.b(&[0xed])
    }
    /// `mov [moffs32], eax` (32-bit mode only).
    pub fn store_eax(&mut self, addr: u32) -> &mut Self {
        self.b(&[0xa3]).b(&addr.to_le_bytes())
    }
    /// `mov eax, [moffs32]` (32-bit mode only).
    pub fn load_eax(&mut self, addr: u32) -> &mut Self {
        self.b(&[0xa1]).b(&addr.to_le_bytes())
    }
    /// `cpuid` (any).
    pub fn cpuid(&mut self) -> &mut Self {
        self.b(&[0x0f, 0xa2])
    }
    /// `op r/m32, r32` between two registers (ModRM mod 11): `dst` is the r/m operand, `src`
    /// the reg operand, both register numbers ([`EAX`] ...).
    fn rr(&mut self, op: u8, dst: u8, src: u8) -> &mut Self {
        self.b(&[op, 0xc0 | src << 3 | dst])
    }
    /// `mov dst, src` (any).
    pub fn mov_rr(&mut self, dst: u8, src: u8) -> &mut Self {
        self.rr(0x89, dst, src)
    }
    /// `or dst, src` (any).
    pub fn or_rr(&mut self, dst: u8, src: u8) -> &mut Self {
        self.rr(0x09, dst, src)
    }
    /// `xor dst, src` (any).
    pub fn xor_rr(&mut self, dst: u8, src: u8) -> &mut Self {
        self.rr(0x31, dst, src)
    }
    /// `test a, b` (any).
    pub fn test_rr(&mut self, a: u8, b: u8) -> &mut Self {
        self.rr(0x85, a, b)
    }
    /// `shr eax, imm8` (any).
    pub fn shr_eax(&mut self, n: u8) -> &mut Self {
        self.b(&[0xc1, 0xe8, n])
    }
    /// Raw bytes.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.b(bytes)
    }
    /// Current position (a label).
    pub fn here(&self) -> usize {
        self.code.len()
    }
    /// `loop label` (rel8, any).
    pub fn loop_to(&mut self, label: usize) -> &mut Self {
        let rel = label as isize - (self.code.len() as isize + 2);
        let rel = i8::try_from(rel).expect("loop target out of rel8 range");
        self.b(&[0xe2, rel as u8])
    }
    /// `hlt; jmp back to hlt` (any).
    pub fn hlt_forever(&mut self) -> &mut Self {
        self.b(&[0xf4, 0xeb, 0xfd])
    }
    /// `jmp $` (any).
    pub fn spin(&mut self) -> &mut Self {
        self.b(&[0xeb, 0xfe])
    }
    /// Writes eax to `port` (clobbers dx).
    pub fn report_eax(&mut self, port: u16) -> &mut Self {
        self.mov_dx(port).out_dx_eax()
    }
    /// Ends the VM through the debug-exit port with `value` (clobbers eax, dx).
    pub fn debug_exit(&mut self, value: u32) -> &mut Self {
        self.mov_eax(value).mov_dx(EXIT_PORT).out_dx_eax()
    }
    /// Reads PCI config register `reg` of 00:`dev`.0 through 0xCF8/0xCFC into eax.
    pub fn conf1_read(&mut self, dev: u8, reg: u8) -> &mut Self {
        let addr = 0x8000_0000 | u32::from(dev) << 11 | u32::from(reg) << 2;
        self.mov_eax(addr)
            .mov_dx(0xcf8)
            .out_dx_eax()
            .mov_dx(0xcfc)
            .in_eax_dx()
    }
    /// `and eax, imm32` (any).
    pub fn and_eax(&mut self, v: u32) -> &mut Self {
        self.b(&[0x25]).b(&v.to_le_bytes())
    }
    /// `jz rel8` with a placeholder; returns the position to patch with [`Asm::patch_to_here`].
    pub fn jz_fwd(&mut self) -> usize {
        self.b(&[0x74, 0]);
        self.code.len() - 1
    }
    /// Points the rel8 at `at` to the current position.
    pub fn patch_to_here(&mut self, at: usize) -> &mut Self {
        let rel = self.code.len() as isize - (at as isize + 1);
        self.code[at] = i8::try_from(rel).expect("rel8") as u8;
        self
    }
    /// `jz label` (backward, rel8).
    pub fn jz_to(&mut self, label: usize) -> &mut Self {
        let rel = label as isize - (self.code.len() as isize + 2);
        self.b(&[0x74, i8::try_from(rel).expect("rel8") as u8])
    }
    /// `jmp label` (rel8).
    pub fn jmp_to(&mut self, label: usize) -> &mut Self {
        let rel = label as isize - (self.code.len() as isize + 2);
        self.b(&[0xeb, i8::try_from(rel).expect("rel8") as u8])
    }
    /// `mov dword [base + disp32], imm32`; `base` is a register number (ebx 3, ecx 1).
    pub fn st32(&mut self, base: u8, disp: u32, v: u32) -> &mut Self {
        self.b(&[0xc7, 0x80 | base])
            .b(&disp.to_le_bytes())
            .b(&v.to_le_bytes())
    }
    /// `mov word [base + disp32], imm16`.
    pub fn st16(&mut self, base: u8, disp: u32, v: u16) -> &mut Self {
        self.b(&[0x66, 0xc7, 0x80 | base])
            .b(&disp.to_le_bytes())
            .b(&v.to_le_bytes())
    }
    /// `mov byte [base + disp32], imm8`.
    pub fn st8(&mut self, base: u8, disp: u32, v: u8) -> &mut Self {
        self.b(&[0xc6, 0x80 | base]).b(&disp.to_le_bytes()).b(&[v])
    }
    /// `mov eax, dword [base + disp32]`.
    pub fn ld32(&mut self, base: u8, disp: u32) -> &mut Self {
        self.b(&[0x8b, 0x80 | base]).b(&disp.to_le_bytes())
    }
    /// `movzx eax, word [base + disp32]`.
    pub fn ld16(&mut self, base: u8, disp: u32) -> &mut Self {
        self.b(&[0x0f, 0xb7, 0x80 | base]).b(&disp.to_le_bytes())
    }
    /// `movzx eax, byte [base + disp32]`.
    pub fn ld8(&mut self, base: u8, disp: u32) -> &mut Self {
        self.b(&[0x0f, 0xb6, 0x80 | base]).b(&disp.to_le_bytes())
    }
    /// `movzx eax, word [abs32]` (32-bit mode).
    pub fn ld16_abs(&mut self, addr: u32) -> &mut Self {
        self.b(&[0x0f, 0xb7, 0x05]).b(&addr.to_le_bytes())
    }
    /// `movzx eax, byte [abs32]` (32-bit mode).
    pub fn ld8_abs(&mut self, addr: u32) -> &mut Self {
        self.b(&[0x0f, 0xb6, 0x05]).b(&addr.to_le_bytes())
    }
    /// Emits a 32-bit-mode ACPI power-off: finds the RSDP (by the legacy 16-byte scan of
    /// 0xE0000-0xFFFFF, or from the PVH start info's `rsdp_paddr` at [ebx+32] when
    /// `from_pvh_start_info`), follows RSDP -> XSDT -> FACP, reads PM1a_CNT_BLK (FADT offset
    /// 64), checks that PM1a_CNT reads with SCI_EN set, and writes SLP_TYP=5 alone and then
    /// with SLP_EN, as ACPICA does. Falls through after the writes. Returns the rel32 sites
    /// of every failure jump: emit the failure code, then [`Asm::patch_rel32_here`].
    pub fn acpi_poweroff(&mut self, from_pvh_start_info: bool) -> Vec<usize> {
        let mut fail = Vec::new();
        let rel32 = |a: &mut Self, op: &[u8], fail: &mut Vec<usize>| {
            a.b(op).b(&[0; 4]);
            fail.push(a.code.len() - 4);
        };
        if from_pvh_start_info {
            self.b(&[0x8b, 0x5b, 0x20]); // mov ebx, [ebx+32]
            self.b(&[0x81, 0x3b]).b(b"RSD "); // cmp dword [ebx], "RSD "
            rel32(self, &[0x0f, 0x85], &mut fail); // jne fail
        } else {
            self.b(&[0xbb]).b(&0xe0000u32.to_le_bytes()); // mov ebx, 0xe0000
            let scan = self.here();
            self.b(&[0x81, 0x3b]).b(b"RSD "); // cmp dword [ebx], "RSD "
            self.b(&[0x75, 0x09]); // jne next (skips the next 9 bytes)
            self.b(&[0x81, 0x7b, 0x04]).b(b"PTR "); // cmp dword [ebx+4], "PTR "
            let je_found = self.here();
            self.b(&[0x74, 0x00]); // je found
            self.b(&[0x83, 0xc3, 0x10]); // next: add ebx, 16
            self.b(&[0x81, 0xfb]).b(&0x10_0000u32.to_le_bytes()); // cmp ebx, 1 MiB
            let rel = scan as isize - (self.code.len() as isize + 2);
            self.b(&[0x72, i8::try_from(rel).expect("rel8") as u8]); // jb scan
            rel32(self, &[0xe9], &mut fail); // jmp fail
            let found = self.here();
            self.code[je_found + 1] = (found - je_found - 2) as u8;
        }
        self.b(&[0x8b, 0x5b, 0x18]); // mov ebx, [ebx+24]   (XSDT)
        self.b(&[0x8b, 0x73, 0x04]); // mov esi, [ebx+4]    (XSDT length)
        self.b(&[0x01, 0xde]); // add esi, ebx               (XSDT end)
        self.b(&[0x8d, 0x4b, 0x24]); // lea ecx, [ebx+36]   (first entry)
        let entries = self.here();
        self.b(&[0x39, 0xf1]); // cmp ecx, esi
        rel32(self, &[0x0f, 0x83], &mut fail); // jae fail
        self.b(&[0x8b, 0x01]); // mov eax, [ecx]
        self.b(&[0x81, 0x38]).b(b"FACP"); // cmp dword [eax], "FACP"
        self.b(&[0x74, 0x05]); // je got
        self.b(&[0x83, 0xc1, 0x08]); // add ecx, 8
        self.jmp_to(entries);
        self.b(&[0x8b, 0x50, 0x40]); // got: mov edx, [eax+64]  (PM1a_CNT_BLK)
        self.b(&[0x66, 0xed]); // in ax, dx
        self.b(&[0xa8, 0x01]); // test al, 1 (SCI_EN)
        rel32(self, &[0x0f, 0x84], &mut fail); // jz fail
        self.b(&[0x66, 0xb8]).b(&(5u16 << 10).to_le_bytes()); // mov ax, SLP_TYP=5
        self.b(&[0x66, 0xef]); // out dx, ax
        self.b(&[0x66, 0xb8])
            .b(&((5u16 << 10) | (1 << 13)).to_le_bytes()); // | SLP_EN
        self.b(&[0x66, 0xef]); // out dx, ax
        fail
    }
    /// Enables the ACPI power button (PWRBTN_EN in PM1a_EN, 0x602), polls PM1a_STS (0x600)
    /// until PWRBTN_STS is set, then clears it (write 1), as an OS's fixed-event handler
    /// does. Clobbers eax, dx.
    pub fn wait_power_button(&mut self) -> &mut Self {
        self.mov_dx(0x602).mov_eax(0x100).b(&[0x66, 0xef]); // out dx, ax
        let poll = self.here();
        self.mov_dx(0x600).b(&[0x66, 0xed]); // in ax, dx
        self.b(&[0xf3, 0x90]); // pause
        self.b(&[0x66, 0xa9, 0x00, 0x01]); // test ax, 0x100
        self.jz_to(poll);
        self.mov_eax(0x100).b(&[0x66, 0xef]) // out dx, ax: write 1 to clear
    }
    /// Points every rel32 at `sites` (from [`Asm::acpi_poweroff`]) to the current position.
    pub fn patch_rel32_here(&mut self, sites: &[usize]) -> &mut Self {
        let here = self.code.len();
        for &s in sites {
            let rel = here as i64 - (s as i64 + 4);
            let rel = i32::try_from(rel).expect("rel32");
            self.code[s..s + 4].copy_from_slice(&rel.to_le_bytes());
        }
        self
    }
    /// `cmp eax, imm32` (any).
    pub fn cmp_eax(&mut self, v: u32) -> &mut Self {
        self.b(&[0x3d]).b(&v.to_le_bytes())
    }
    /// `jb label` (backward, rel8).
    pub fn jb_to(&mut self, label: usize) -> &mut Self {
        let rel = label as isize - (self.code.len() as isize + 2);
        self.b(&[0x72, i8::try_from(rel).expect("rel8") as u8])
    }
    /// `jnz rel8` with a placeholder; returns the position to patch with [`Asm::patch_to_here`].
    pub fn jnz_fwd(&mut self) -> usize {
        self.b(&[0x75, 0]);
        self.code.len() - 1
    }
    /// `shl ecx, imm8` (any).
    pub fn shl_ecx(&mut self, n: u8) -> &mut Self {
        self.b(&[0xc1, 0xe1, n])
    }
    /// `add al, imm8` (any).
    pub fn add_al(&mut self, v: u8) -> &mut Self {
        self.b(&[0x04, v])
    }
    /// Prints `text` on COM1 (clobbers al, dx).
    pub fn print(&mut self, text: &[u8]) -> &mut Self {
        self.mov_dx(0x3f8);
        for &c in text {
            self.mov_al(c).out_dx_al();
        }
        self
    }
    /// `lidt [idtr]` (32-bit mode: absolute address).
    pub fn lidt(&mut self, idtr: u32) -> &mut Self {
        self.b(&[0x0f, 0x01, 0x1d]).b(&idtr.to_le_bytes())
    }
    /// Programs the master 8259 PIC (ICW1 edge/cascade/ICW4, ICW2 vector base 0x20, ICW3 slave
    /// on IR2, ICW4 8086 mode) and masks it with `master_mask`; with `Some(slave_mask)` then the
    /// slave the same way (vector base 0x28, cascade identity 2). Clobbers al.
    pub fn init_pics(&mut self, master_mask: u8, slave_mask: Option<u8>) -> &mut Self {
        let mut writes = vec![
            (0x20, 0x11),
            (0x21, 0x20),
            (0x21, 0x04),
            (0x21, 0x01),
            (0x21, master_mask),
        ];
        if let Some(mask) = slave_mask {
            writes.extend([
                (0xa0, 0x11),
                (0xa1, 0x28),
                (0xa1, 0x02),
                (0xa1, 0x01),
                (0xa1, mask),
            ]);
        }
        for (port, v) in writes {
            self.mov_al(v).out_imm_al(port);
        }
        self
    }
    /// Writes eax... to PCI config register `reg` of 00:`dev`.0 (value in `v`).
    pub fn conf1_write(&mut self, dev: u8, reg: u8, v: u32) -> &mut Self {
        let addr = 0x8000_0000 | u32::from(dev) << 11 | u32::from(reg) << 2;
        self.mov_eax(addr)
            .mov_dx(0xcf8)
            .out_dx_eax()
            .mov_eax(v)
            .mov_dx(0xcfc)
            .out_dx_eax()
    }
    /// Puts the address of 00:`dev`.0's BAR 4 (its virtio-pci structures) in ebx, then resets
    /// the device and sets ACKNOWLEDGE and DRIVER in its status.
    pub fn virtio_reset_to_driver(&mut self, dev: u8) -> &mut Self {
        self.conf1_read(dev, 8)
            .and_eax(!0xf)
            .mov_rr(EBX, EAX)
            .st8(EBX, 0x14, 0) // reset
            .st8(EBX, 0x14, VIRTIO_CONFIG_S_ACKNOWLEDGE)
            .st8(
                EBX,
                0x14,
                VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
            )
    }
    /// Writes the selected queue's ring addresses (32-bit: the high halves are 0) into the
    /// common configuration at ebx.
    pub fn virtio_queue_rings(&mut self, desc: u32, avail: u32, used: u32) -> &mut Self {
        self.st32(EBX, 0x20, desc)
            .st32(EBX, 0x24, 0)
            .st32(EBX, 0x28, avail)
            .st32(EBX, 0x2c, 0)
            .st32(EBX, 0x30, used)
            .st32(EBX, 0x34, 0)
    }
}

/// Register numbers of [`Asm`]'s register operands and of the `base` operands of its loads
/// and stores.
pub const EAX: u8 = 0;
pub const ECX: u8 = 1;
pub const EDX: u8 = 2;
pub const EBX: u8 = 3;
pub const EDI: u8 = 7;

/// One recorded write: absolute address and bytes.
pub type Access = (u64, Vec<u8>);

/// A bus device that records writes, answers reads with `read_value`, and optionally
/// requests [`ExitReason::Stopped`] once it has seen `stop_after` writes.
pub struct Recorder {
    pub log: Log,
    pub read_value: u32,
    pub stop_after: Option<(usize, ExitHandle)>,
}

impl Recorder {
    pub fn new(read_value: u32) -> (Arc<Mutex<Recorder>>, Log) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = Recorder {
            log: log.clone(),
            read_value,
            stop_after: None,
        };
        (Arc::new(Mutex::new(r)), log)
    }
}

impl BusDevice for Recorder {
    fn read(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        let v = u64::from(self.read_value).to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = v.get(i).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
        let mut log = self.log.lock().unwrap();
        log.push((base + offset, data.to_vec()));
        if let Some((n, exit)) = &self.stop_after {
            if log.len() >= *n {
                exit.request(ExitReason::Stopped);
            }
        }
    }
}

/// What a [`Recorder`] logs.
pub type Log = Arc<Mutex<Vec<Access>>>;

/// Puts a [`Recorder`] reading 0 on the `len` ports from [`REPORT_PORT`] of `m`'s PIO bus and
/// returns its log.
pub fn report_ports(m: &vmm::Machine, len: u64) -> Log {
    insert_reporter(m, len, None)
}

/// [`report_ports`] whose recorder stops the machine once it has seen `writes` writes.
pub fn report_ports_stopping_after(m: &vmm::Machine, len: u64, writes: usize) -> Log {
    insert_reporter(m, len, Some((writes, m.exit_handle().clone())))
}

fn insert_reporter(m: &vmm::Machine, len: u64, stop_after: Option<(usize, ExitHandle)>) -> Log {
    let (dev, log) = Recorder::new(0);
    dev.lock().unwrap().stop_after = stop_after;
    m.pio_bus().insert(dev, REPORT_PORT.into(), len).unwrap();
    log
}

/// The 4-byte writes logged so far, decoded.
pub fn reported(log: &Log) -> Vec<u32> {
    log.lock().unwrap().iter().map(u32_of).collect()
}

/// Decodes a recorded 4-byte write.
pub fn u32_of(a: &Access) -> u32 {
    u32::from_le_bytes(a.1.as_slice().try_into().expect("4-byte access"))
}

/// A `Write` sink shared with the test.
#[derive(Clone, Default)]
pub struct SharedBuf(pub Arc<Mutex<Vec<u8>>>);

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Where the stand-in kernels load.
pub const KERNEL_ADDR: u64 = 0x10_0000;

/// An ELF64 executable loading `code` at `KERNEL_ADDR` with entry `KERNEL_ADDR`, and with a
/// Xen PHYS32_ENTRY note pointing there when `pvh`.
pub fn build_elf(code: &[u8], pvh: bool) -> Vec<u8> {
    const NOTE_OFF: u64 = 0x180;
    const CODE_OFF: u64 = 0x200;
    let phnum: u16 = if pvh { 2 } else { 1 };
    let mut f = vec![0u8; CODE_OFF as usize];
    let mut ehdr = Vec::new();
    ehdr.extend([0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    ehdr.extend([0u8; 8]);
    ehdr.extend(2u16.to_le_bytes()); // ET_EXEC
    ehdr.extend(0x3eu16.to_le_bytes()); // x86-64
    ehdr.extend(1u32.to_le_bytes());
    ehdr.extend(KERNEL_ADDR.to_le_bytes()); // e_entry
    ehdr.extend(64u64.to_le_bytes()); // e_phoff
    ehdr.extend(0u64.to_le_bytes()); // e_shoff
    ehdr.extend(0u32.to_le_bytes()); // e_flags
    ehdr.extend(64u16.to_le_bytes()); // e_ehsize
    ehdr.extend(56u16.to_le_bytes()); // e_phentsize
    ehdr.extend(phnum.to_le_bytes());
    ehdr.extend([0u8; 6]); // shentsize, shnum, shstrndx
    assert_eq!(ehdr.len(), 64);
    f[..64].copy_from_slice(&ehdr);
    let phdr = |ty: u32, off: u64, paddr: u64, size: u64| {
        let mut p = Vec::new();
        p.extend(ty.to_le_bytes());
        p.extend(5u32.to_le_bytes()); // R+X
        p.extend(off.to_le_bytes());
        p.extend(paddr.to_le_bytes()); // vaddr
        p.extend(paddr.to_le_bytes()); // paddr
        p.extend(size.to_le_bytes()); // filesz
        p.extend(size.to_le_bytes()); // memsz
        p.extend(0x1000u64.to_le_bytes());
        p
    };
    f[64..120].copy_from_slice(&phdr(1, CODE_OFF, KERNEL_ADDR, code.len() as u64));
    if pvh {
        f[120..176].copy_from_slice(&phdr(4, NOTE_OFF, 0, 20));
        let mut note = Vec::new();
        note.extend(4u32.to_le_bytes()); // namesz
        note.extend(4u32.to_le_bytes()); // descsz
        note.extend(18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
        note.extend(*b"Xen\0");
        note.extend((KERNEL_ADDR as u32).to_le_bytes());
        f[NOTE_OFF as usize..NOTE_OFF as usize + 20].copy_from_slice(&note);
    }
    f.extend_from_slice(code);
    f
}

/// Writes a 32-bit interrupt gate for `vector` to `handler` in the code segment (0x08) into the
/// IDT at `idt`, and the IDTR image `lidt` loads (limit 0x7ff, base `idt`) at `idtr`.
pub fn idt_gate(m: &vmm::Machine, idt: u64, idtr: u64, handler: u64, vector: u64) {
    use vm_memory::{Bytes, GuestAddress};
    let mut gate = Vec::new();
    gate.extend((handler as u16).to_le_bytes());
    gate.extend(0x08u16.to_le_bytes());
    gate.extend([0, 0x8e]);
    gate.extend(((handler >> 16) as u16).to_le_bytes());
    m.memory()
        .write_slice(&gate, GuestAddress(idt + 8 * vector))
        .unwrap();
    let mut image = 0x7ffu16.to_le_bytes().to_vec();
    image.extend((idt as u32).to_le_bytes());
    m.memory().write_slice(&image, GuestAddress(idtr)).unwrap();
}

/// The device status a driver writes once its features are set: ACKNOWLEDGE, DRIVER and
/// FEATURES_OK.
pub const DRIVER_FEATURES_OK: u8 =
    VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;

/// The upper feature word (bits 32..63, what a driver writes with feature select 1) with the
/// feature bits `bits` set.
pub fn high_word(bits: &[u32]) -> u32 {
    let mask = bits.iter().fold(0, |m, &b| m | feature(b));
    (mask >> 32) as u32
}

/// Guest RAM of the small-guest machines.
pub const MEM: u64 = 4 << 20;

/// A machine of `vcpus` vCPUs, or `None` (the skip recorded) when KVM cannot run guests.
pub fn kvm_machine(vcpus: u8) -> Option<vmm::Machine> {
    kvm_available().then(|| machine(vcpus))
}

/// A machine of `vcpus` vCPUs and [`MEM`] of RAM.
pub fn machine(vcpus: u8) -> vmm::Machine {
    vmm::Machine::new(&vmm::MachineConfig {
        mem_size: MEM,
        vcpus,
    })
    .expect("create machine")
}

/// Writes `code` into guest memory at `addr`.
pub fn load(m: &vmm::Machine, addr: u64, code: &Asm) {
    use vm_memory::Bytes;
    m.memory()
        .write_slice(&code.code, vm_memory::GuestAddress(addr))
        .expect("load code");
}

/// Starts vCPU `vcpu` at `eip` in flat 32-bit protected mode (stack at 0x8000).
pub fn flat32(m: &vmm::Machine, vcpu: usize, eip: u64) {
    vmm::boot::regs::EntryState::Flat32 {
        eip: eip as u32,
        ebx: 0,
        esp: 0x8000,
    }
    .apply(&m.vcpus()[vcpu], m.memory())
    .expect("entry state");
}
