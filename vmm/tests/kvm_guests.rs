//! Small guest programs run on this machine's /dev/kvm through the VMM's own vCPU threads,
//! buses and devices. Skipped (with a message) when /dev/kvm is absent.
//!
//! Guest code runs at CPL0 in protected, long or real mode; on the PVM software hypervisor
//! of the development machines every such instruction is emulated (~0.5 M instr/s), so each
//! program is a few dozen instructions and every result leaves the guest through a port.

mod common;

use std::time::{Duration, Instant};

use common::*;
use vm_memory::{Bytes, GuestAddress};
use vmm::boot::regs::EntryState;
use vmm::exit::ExitReason;
use vmm::layout::{PCI_ECAM_START, PCI_MMIO32_START};
use vmm::pci::{BarKind, PciBar, PciConfiguration, PciDevice, PciHeader};
use vmm::{Machine, MachineConfig};

/// Where the interrupt tests put their IDT, the IDTR image `lidt` loads, and the handler.
const IDT: u64 = 0x3000;
const IDTR: u64 = 0x2ff0;
const HANDLER: u64 = 0x1800;

/// Installs `handler` for `vector`: a 32-bit interrupt gate to [`HANDLER`] in the code
/// segment (0x08) at its place in the IDT, the IDTR image at [`IDTR`], the code at [`HANDLER`].
fn interrupt_handler(m: &Machine, vector: u64, handler: &Asm) {
    idt_gate(m, IDT, IDTR, HANDLER, vector);
    load(m, HANDLER, handler);
}

fn long64(m: &Machine, vcpu: usize, rip: u64, rsp: u64) {
    EntryState::Long64 { rip, rsi: 0, rsp }
        .apply(&m.vcpus()[vcpu], m.memory())
        .expect("entry state");
}

/// Loads `code` at CODE_ADDR and starts vCPU 0 there in flat 32-bit mode.
fn load_flat32(m: &Machine, code: &Asm) {
    load(m, CODE_ADDR, code);
    flat32(m, 0, CODE_ADDR);
}

/// Loads `code` at CODE_ADDR on vCPU 0 in flat 32-bit mode and runs the machine.
fn run_flat32(mut m: Machine, code: &Asm) -> (vmm::machine::MachineExit, Duration) {
    m.add_debug_exit(EXIT_PORT).unwrap();
    load_flat32(&m, code);
    let t = Instant::now();
    let exit = m.run().expect("run");
    (exit, t.elapsed())
}

#[test]
fn pio_dispatch_reads_and_writes_a_test_port() {
    let Some(m) = kvm_machine(1) else {
        return;
    };
    let (dev, log) = Recorder::new(0xcafe_babe);
    m.pio_bus().insert(dev, REPORT_PORT.into(), 8).unwrap();
    let mut a = Asm::new();
    a.mov_eax(0x1234_5678)
        .report_eax(REPORT_PORT)
        .mov_al(0x5a)
        .out_imm_al(REPORT_PORT as u8 + 1)
        .mov_dx(REPORT_PORT + 4)
        .in_eax_dx()
        .report_eax(REPORT_PORT + 4)
        // An unclaimed port reads as all ones.
        .mov_dx(0x2f0)
        .in_eax_dx()
        .report_eax(REPORT_PORT)
        .debug_exit(0x10);
    let (exit, took) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0x10 });
    assert_eq!(exit.reason.exit_code(), 0x21);
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 4, "{log:x?}");
    assert_eq!((log[0].0, u32_of(&log[0])), (0xe0, 0x1234_5678));
    assert_eq!(log[1], (0xe1, vec![0x5a]));
    assert_eq!((log[2].0, u32_of(&log[2])), (0xe4, 0xcafe_babe));
    assert_eq!(u32_of(&log[3]), 0xffff_ffff);
    let s = exit.vcpu_stats[0];
    assert_eq!((s.pio_exits, s.pio_unhandled), (7, 1));
    eprintln!("pio test: {took:?}");
}

#[test]
fn mmio_dispatch_reaches_a_device_in_the_hole() {
    let Some(m) = kvm_machine(1) else {
        return;
    };
    let base = 0xd000_0000u32;
    let (dev, log) = Recorder::new(0x600d_f00d);
    m.mmio_bus().insert(dev, base.into(), 0x1000).unwrap();
    let mut a = Asm::new();
    a.mov_eax(0xdead_beef)
        .store_eax(base + 0x10)
        .load_eax(base + 0x20)
        .store_eax(base + 0x30)
        // Unclaimed MMIO reads as all ones.
        .load_eax(0xd800_0000)
        .store_eax(base + 0x40)
        .debug_exit(0);
    let (exit, _) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    let log = log.lock().unwrap();
    let got: Vec<(u64, u32)> = log.iter().map(|a| (a.0, u32_of(a))).collect();
    assert_eq!(
        got,
        vec![
            (0xd000_0010, 0xdead_beef),
            (0xd000_0030, 0x600d_f00d),
            (0xd000_0040, 0xffff_ffff)
        ]
    );
    let s = exit.vcpu_stats[0];
    assert_eq!((s.mmio_exits, s.mmio_unhandled), (5, 1));
}

/// A PCI function with one 4 KiB memory BAR whose reads return `0xb0000000 | offset`.
#[derive(Debug)]
struct BarFunction {
    config: PciConfiguration,
}

impl PciDevice for BarFunction {
    fn config(&self) -> &PciConfiguration {
        &self.config
    }
    fn config_mut(&mut self) -> &mut PciConfiguration {
        &mut self.config
    }
    fn read_bar(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
        let v = (0xb000_0000 | offset as u32).to_le_bytes();
        data.copy_from_slice(&v[..data.len().min(4)]);
    }
}

#[test]
fn pci_config_space_finds_host_bridge_and_a_bar() {
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    let log = report_ports(&m, 4);
    let pci = m.add_pci().unwrap();
    let bar_addr = pci.allocate_mmio32(0x1000).unwrap();
    assert_eq!(bar_addr, PCI_MMIO32_START);
    let mut config = PciConfiguration::new(&PciHeader {
        vendor_id: 0x1af4,
        device_id: 0x1042,
        class: 0x01,
        ..Default::default()
    });
    config
        .add_bar(PciBar {
            index: 0,
            addr: bar_addr,
            size: 0x1000,
            kind: BarKind::Memory32,
            prefetchable: false,
        })
        .unwrap();
    let func = std::sync::Arc::new(std::sync::Mutex::new(BarFunction { config }));
    assert_eq!(pci.add_device(func).unwrap(), 1);

    let moved = bar_addr as u32 + 0x10_0000;
    let mut a = Asm::new();
    a.conf1_read(0, 0)
        .report_eax(REPORT_PORT) // host bridge ids
        .conf1_read(0, 2)
        .report_eax(REPORT_PORT) // class/revision
        .conf1_read(1, 0)
        .report_eax(REPORT_PORT) // our function's ids
        .conf1_read(2, 0)
        .report_eax(REPORT_PORT) // empty slot
        .load_eax(PCI_ECAM_START as u32)
        .report_eax(REPORT_PORT) // host bridge ids through ECAM
        .conf1_read(1, 4)
        .report_eax(REPORT_PORT) // BAR0
        .load_eax(bar_addr as u32 + 0x24)
        .report_eax(REPORT_PORT) // BAR0 contents
        .conf1_write(1, 4, moved)
        .load_eax(moved + 0x8)
        .report_eax(REPORT_PORT) // BAR0 contents at its new address
        .debug_exit(0);
    let (exit, took) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(
        reported(&log),
        vec![
            0x0d57_8086,
            0x0600_0000,
            0x1042_1af4,
            0xffff_ffff,
            0x0d57_8086,
            bar_addr as u32,
            0xb000_0024,
            0xb000_0008
        ]
    );
    eprintln!("pci test: {took:?}");
}

#[test]
fn serial_output_reaches_the_sink() {
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    let sink = SharedBuf::default();
    m.add_serial(sink.clone()).unwrap();
    let mut a = Asm::new();
    a.print(b"hello\n").debug_exit(0);
    let (exit, _) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(sink.0.lock().unwrap().as_slice(), b"hello\n");
}

/// The UART's interrupt travels eventfd -> irqfd -> in-kernel PIC -> LAPIC LINT0 (ExtINT)
/// -> guest IDT vector 0x24, also after the VMM rewrote the GSI routing table.
#[test]
fn serial_interrupt_reaches_the_guest_through_irqfd() {
    const VECTOR: u64 = 0x24;
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    m.add_serial(SharedBuf::default()).unwrap();
    let log = report_ports(&m, 4);
    vmm::boot::msr::setup_lapic(&m.vcpus()[0]).unwrap();
    // Committing an MSI route replaces KVM's routing table: GSI 4 must still reach the PIC.
    let gsi = m.vm().allocate_msi_gsi().unwrap();
    m.vm().set_msi_route(gsi, 0xfee0_0000, 0x50).unwrap();
    let mut handler = Asm::new();
    handler
        .mov_eax(VECTOR as u32)
        .report_eax(REPORT_PORT)
        .debug_exit(0);
    interrupt_handler(&m, VECTOR, &handler);

    let mut a = Asm::new();
    // The master PIC alone, everything masked but IRQ 4.
    a.init_pics(0xef, None)
        .lidt(IDTR as u32)
        .raw(&[0xfb]) // sti
        .mov_dx(0x3f9)
        .mov_al(0x02)
        .out_dx_al() // IER: THR-empty interrupt, raised at once
        .hlt_forever();
    let (exit, took) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(reported(&log), vec![0x24]);
    eprintln!("serial interrupt round trip test: {took:?}");
}

#[test]
fn i8042_reset_ends_the_vm_with_status_zero() {
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    m.add_i8042().unwrap();
    let mut a = Asm::new();
    a.mov_al(0xfe).out_imm_al(0x64).hlt_forever();
    let (exit, _) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::Reset);
    assert_eq!(exit.reason.exit_code(), 0);
}

#[test]
fn real_mode_program_runs() {
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    m.add_debug_exit(EXIT_PORT).unwrap();
    let log = report_ports(&m, 1);
    // 16-bit code at 0x100:0 (linear 0x1000): mov al,0x42; out 0xe0,al; mov dx,0x501;
    // out dx,al.
    let code = [0xb0, 0x42, 0xe6, 0xe0, 0xba, 0x01, 0x05, 0xee];
    m.memory().write_slice(&code, GuestAddress(0x1000)).unwrap();
    EntryState::Real {
        cs_selector: 0x100,
        ip: 0,
        sp: 0x8000,
    }
    .apply(&m.vcpus()[0], m.memory())
    .unwrap();
    let exit = m.run().unwrap();
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0x42 });
    assert_eq!(log.lock().unwrap().as_slice(), &[(0xe0, vec![0x42])]);
}

#[test]
fn two_vcpus_start_and_stop_cleanly() {
    let Some(m) = kvm_machine(2) else {
        return;
    };
    let log = report_ports_stopping_after(&m, 4, 2);
    // vCPU 0 reports and then spins in guest code; vCPU 1 reports and halts (blocked in the
    // in-kernel LAPIC). Both must be kicked out of KVM_RUN.
    let mut a0 = Asm::new();
    a0.mov_eax(0).report_eax(REPORT_PORT).spin();
    let mut a1 = Asm::new();
    a1.mov_eax(1).report_eax(REPORT_PORT).hlt_forever();
    load(&m, 0x1000, &a0);
    load(&m, 0x2000, &a1);
    flat32(&m, 0, 0x1000);
    flat32(&m, 1, 0x2000);
    m.vcpus()[1].set_runnable().unwrap();
    let t = Instant::now();
    let running = m.start().unwrap();
    let exit = running.wait().unwrap();
    let took = t.elapsed();
    assert_eq!(exit.reason, ExitReason::Stopped);
    assert_eq!(exit.vcpu_stats.len(), 2);
    assert!(exit.vcpu_stats.iter().all(|s| s.pio_exits >= 1));
    let mut ids = reported(&log);
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1]);
    eprintln!("2-vCPU start/report/stop: {took:?}");
}

#[test]
fn host_stop_ends_a_spinning_guest() {
    let Some(m) = kvm_machine(1) else {
        return;
    };
    let mut a = Asm::new();
    a.spin();
    load_flat32(&m, &a);
    let running = m.start().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    let exit = running.stop().unwrap();
    assert_eq!(exit.reason, ExitReason::Stopped);
    eprintln!("stop of a spinning vCPU: {:?}", t.elapsed());
}

#[test]
fn long_mode_entry_with_patched_cpuid_on_two_vcpus() {
    let Some(m) = kvm_machine(2) else {
        return;
    };
    let log = report_ports_stopping_after(&m, 0x10, 4);
    m.configure_linux_vcpus().unwrap();
    // Each vCPU reports CPUID.1:EBX[31:24] and CPUID.0xB.0:EDX (its APIC ids) on its own ports.
    for id in 0..2u16 {
        let port = REPORT_PORT + 8 * id;
        let mut a = Asm::new();
        a.mov_eax(1)
            .cpuid()
            .mov_rr(EAX, EBX)
            .shr_eax(24)
            .report_eax(port)
            .mov_eax(0xb)
            .xor_rr(ECX, ECX)
            .cpuid()
            .mov_rr(EAX, EDX)
            .report_eax(port + 4)
            .hlt_forever();
        let rip = 0x1000 + 0x100 * u64::from(id);
        load(&m, rip, &a);
        long64(&m, usize::from(id), rip, 0x8000 - 0x100 * u64::from(id));
    }
    m.vcpus()[1].set_runnable().unwrap();
    let exit = m.run().unwrap();
    assert_eq!(exit.reason, ExitReason::Stopped);
    let mut got: Vec<(u64, u32)> = log
        .lock()
        .unwrap()
        .iter()
        .map(|a| (a.0, u32_of(a)))
        .collect();
    got.sort_unstable();
    assert_eq!(got, vec![(0xe0, 0), (0xe4, 0), (0xe8, 1), (0xec, 1)]);
}

/// Times N loop iterations with and without an `out` to a bus device: the difference is the
/// cost of one PIO exit round trip through KVM, the vCPU loop and the bus (printed; run with
/// `--nocapture`).
#[test]
fn pio_exit_round_trip_cost() {
    if !kvm_available() {
        return;
    }
    const N: u32 = 2000;
    let run = |with_out: bool| {
        let t = Instant::now();
        let m = machine(1);
        let created = t.elapsed();
        let log = report_ports(&m, 1);
        let mut a = Asm::new();
        a.mov_ecx(N).mov_dx(REPORT_PORT).mov_al(7);
        let top = a.here();
        if with_out {
            a.out_dx_al();
        } else {
            a.raw(&[0x90]); // nop, so both loops execute two instructions per iteration
        }
        a.loop_to(top).debug_exit(0);
        let (exit, took) = run_flat32(m, &a);
        assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
        let n = log.lock().unwrap().len();
        assert_eq!(n, if with_out { N as usize } else { 0 });
        (created, took)
    };
    let (created, plain) = run(false);
    let (_, with_out) = run(true);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(N);
    eprintln!(
        "machine create {created:?}; {N} iterations: nop+loop {plain:?} ({:.1} us/iter), \
         out+loop {with_out:?} ({:.1} us/iter) => ~{:.1} us per PIO exit",
        per(plain),
        per(with_out),
        per(with_out) - per(plain)
    );
}

/// With more RAM than the hole start, RAM continues at 4 GiB: the guest writes just below
/// the hole and just above 4 GiB (through an extra 2 MiB mapping), and reads the hole, which
/// exits as MMIO.
#[test]
fn large_memory_is_split_around_the_mmio_hole() {
    if !kvm_available() {
        return;
    }
    let mut m = Machine::new(&MachineConfig {
        mem_size: (3 << 30) + (64 << 20),
        vcpus: 1,
    })
    .unwrap();
    assert_eq!(m.ram_ranges().len(), 2);
    m.add_debug_exit(EXIT_PORT).unwrap();
    long64(&m, 0, CODE_ADDR, 0x8000);
    // PDPT[4] -> a page directory at 0xf000 whose entry 0 maps 4 GiB as a 2 MiB page.
    m.memory()
        .write_obj(
            0xf000u64 | 0x3,
            GuestAddress(vmm::layout::PDPTE_START + 4 * 8),
        )
        .unwrap();
    m.memory()
        .write_obj((1u64 << 32) | 0x83, GuestAddress(0xf000))
        .unwrap();
    let below_hole = vmm::layout::MMIO_HOLE_START - 0x10;
    let mut a = Asm::new();
    a.raw(&[0x48, 0xb8])
        .raw(&below_hole.to_le_bytes()) // mov rax, below_hole
        .raw(&[0xc7, 0x00])
        .raw(&0x1111_1111u32.to_le_bytes()) // mov dword [rax], imm32
        .raw(&[0x48, 0xb8])
        .raw(&(1u64 << 32).to_le_bytes()) // mov rax, 4 GiB
        .raw(&[0xc7, 0x00])
        .raw(&0x2222_2222u32.to_le_bytes())
        .raw(&[0xa1])
        .raw(&vmm::layout::MMIO_HOLE_START.to_le_bytes()) // mov eax, [moffs64]: in the hole
        .debug_exit(0);
    load(&m, CODE_ADDR, &a);
    let mem = m.memory().clone();
    let exit = m.run().unwrap();
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(exit.vcpu_stats[0].mmio_unhandled, 1);
    let low: u32 = mem.read_obj(GuestAddress(below_hole)).unwrap();
    let high: u32 = mem.read_obj(GuestAddress(1 << 32)).unwrap();
    assert_eq!((low, high), (0x1111_1111, 0x2222_2222));
}

/// An MSI route (what a virtio-pci MSI-X vector becomes): irqfd on an MSI GSI -> local APIC
/// fixed interrupt -> guest IDT vector 0x41.
#[test]
fn msi_route_delivers_an_irqfd_as_a_vector() {
    const VECTOR: u32 = 0x41;
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    m.add_debug_exit(EXIT_PORT).unwrap();
    let log = report_ports(&m, 4);
    // Software-enable the local APIC (SVR bit 8, spurious vector 0xff): fixed interrupts
    // are dropped while it is disabled.
    let fd = m.vcpus()[0].fd();
    let mut lapic = fd.get_lapic().unwrap();
    for (i, b) in 0x1ffu32.to_le_bytes().iter().enumerate() {
        lapic.regs[0xf0 + i] = *b as _;
    }
    fd.set_lapic(&lapic).unwrap();
    let mut handler = Asm::new();
    handler
        .mov_eax(VECTOR)
        .report_eax(REPORT_PORT)
        .debug_exit(0);
    interrupt_handler(&m, u64::from(VECTOR), &handler);
    let mut a = Asm::new();
    a.lidt(IDTR as u32)
        .raw(&[0xfb]) // sti
        .hlt_forever();
    load_flat32(&m, &a);

    let vm = m.vm().clone();
    let gsi = vm.allocate_msi_gsi().unwrap();
    assert!(gsi >= vmm::irq::FIRST_MSI_GSI);
    // Destination APIC id 0, fixed delivery, edge, vector 0x41.
    vm.set_msi_route(gsi, 0xfee0_0000, VECTOR).unwrap();
    let evt = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
    vm.register_irqfd(&evt, gsi).unwrap();
    let running = m.start().unwrap();
    evt.write(1).unwrap();
    let exit = running.wait().unwrap();
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(reported(&log), vec![VECTOR]);
}

/// A 16-bit doorbell write that matches an ioeventfd signals it inside KVM without an exit;
/// a non-matching value still exits to the MMIO bus.
#[test]
fn ioeventfd_catches_a_doorbell_without_an_exit() {
    let Some(m) = kvm_machine(1) else {
        return;
    };
    let doorbell = 0xd000_0000u32;
    let evt = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
    m.vm()
        .ioeventfd(
            vmm::vm::IoeventOp::Register,
            &evt,
            kvm_ioctls::IoEventAddress::Mmio(doorbell.into()),
            vmm::vm::IoeventMatch::U16(3),
        )
        .unwrap();
    let (dev, log) = Recorder::new(0);
    m.mmio_bus().insert(dev, doorbell.into(), 0x1000).unwrap();
    let mut a = Asm::new();
    for v in [3u16, 5, 3] {
        a.raw(&[0x66, 0xb8])
            .raw(&v.to_le_bytes()) // mov ax, v
            .raw(&[0x66, 0xa3])
            .raw(&doorbell.to_le_bytes()); // mov [doorbell], ax
    }
    a.debug_exit(0);
    let (exit, _) = run_flat32(m, &a);
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    assert_eq!(evt.read().unwrap(), 2);
    assert_eq!(exit.vcpu_stats[0].mmio_exits, 1);
    assert_eq!(
        log.lock().unwrap().as_slice(),
        &[(u64::from(doorbell), vec![5, 0])]
    );
}

/// The guest of the ACPI tests: the legacy RSDP scan and S5 power-off; debug exit 2 after
/// the power-off writes, 1 on any failure.
fn acpi_poweroff_guest() -> Asm {
    let mut a = Asm::new();
    let fail = a.acpi_poweroff(false);
    // Not reached when the power-off works (the first exit request wins anyway).
    a.debug_exit(2);
    a.patch_rel32_here(&fail).debug_exit(1);
    a
}

/// The guest finds "RSD PTR " in 0xE0000-0xFFFFF, follows RSDP -> XSDT -> FACP, reads
/// PM1a_CNT_BLK from the FADT and writes SLP_TYP=5|SLP_EN to it: the VM ends with the
/// power-off reason and status 0.
#[test]
fn acpi_s5_from_the_fadt_powers_off() {
    let Some(mut m) = kvm_machine(2) else {
        return;
    };
    m.add_acpi().expect("ACPI");
    assert_eq!(m.acpi_rsdp(), Some(0xe0000));
    let (exit, took) = run_flat32(m, &acpi_poweroff_guest());
    assert_eq!(exit.reason, ExitReason::PowerOff);
    assert_eq!(exit.reason.exit_code(), 0);
    eprintln!("ACPI power-off guest: {took:?}");
}

/// Without ACPI the same guest finds no RSDP.
#[test]
fn without_acpi_the_guest_finds_no_rsdp() {
    let Some(m) = kvm_machine(1) else {
        return;
    };
    let (exit, _) = run_flat32(m, &acpi_poweroff_guest());
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 1 });
}

/// QMP `system_powerdown`'s power button at the register level: the guest enables
/// PWRBTN_EN, the host presses the button, PM1a_STS gets PWRBTN_STS and the SCI (IRQ 9,
/// through the slave PIC) reaches the guest's IDT vector, whose handler reads PM1a_STS.
#[test]
fn acpi_power_button_sets_pwrbtn_sts_and_raises_the_sci() {
    const VECTOR: u64 = 0x29; // slave PIC base 0x28 + IRQ 9 - 8
    const READY: u32 = 0x11;
    let Some(mut m) = kvm_machine(1) else {
        return;
    };
    m.add_acpi().unwrap();
    m.add_debug_exit(EXIT_PORT).unwrap();
    let log = report_ports(&m, 4);
    vmm::boot::msr::setup_lapic(&m.vcpus()[0]).unwrap();
    let mut handler = Asm::new();
    handler
        .mov_dx(0x600)
        .in_eax_dx() // PM1a_STS | PM1a_EN << 16
        .report_eax(REPORT_PORT)
        .debug_exit(0);
    interrupt_handler(&m, VECTOR, &handler);

    let mut a = Asm::new();
    // Both PICs, everything masked but the cascade (master) and IRQ 9 (slave).
    a.init_pics(0xfb, Some(0xfd))
        .lidt(IDTR as u32)
        .mov_dx(0x602)
        .mov_eax(u32::from(vmm::legacy::PWRBTN))
        .raw(&[0x66, 0xef]) // out dx, ax: PM1a_EN = PWRBTN_EN
        .mov_eax(READY)
        .report_eax(REPORT_PORT)
        .raw(&[0xfb]) // sti
        .hlt_forever();
    load_flat32(&m, &a);
    let button = m.power_button().cloned().expect("ACPI has a power button");
    let running = m.start().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log.lock().unwrap().iter().any(|x| u32_of(x) == READY) {
        assert!(Instant::now() < deadline, "guest never got ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    button.press();
    // A watchdog: an SCI that never arrives must fail the test, not hang it.
    let watchdog = running.exit_handle().clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(30));
        watchdog.request(ExitReason::Error("no SCI within 30 s".into()));
    });
    let exit = running.wait().unwrap();
    assert_eq!(exit.reason, ExitReason::DebugExit { value: 0 });
    let seen = reported(&log);
    assert_eq!(seen.len(), 2, "{seen:x?}");
    let pwrbtn = u32::from(vmm::legacy::PWRBTN);
    assert_eq!(seen[1] & pwrbtn, pwrbtn, "PWRBTN_STS: {:#x}", seen[1]);
    assert_eq!(
        (seen[1] >> 16) & pwrbtn,
        pwrbtn,
        "PWRBTN_EN: {:#x}",
        seen[1]
    );
}
