//! virtio-pci on this machine's /dev/kvm: small guest programs find our virtio-blk-pci
//! function through configuration mechanism #1, walk its capability list, drive the common
//! configuration through BAR 4, and submit one virtio-blk write whose completion arrives as an
//! MSI-X interrupt (bounce forced, data checked in the backing file). Host-side tests drive
//! the same registers through the `PciDevice` trait for the state-machine corner cases.
//! Skipped (with a message) when /dev/kvm is absent.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use devices::block::io::ImageFormat;
use devices::block::request::RequestHeader;
use devices::block::{Block, BlockConfig, DiskImage, STATUS_UNSET};
use devices::options::BounceOptions;
use devices::virtio::driver::{Buf, DriverQueue, Layout};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_F_MQ, VIRTIO_BLK_T_OUT, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_RING_PACKED,
    VIRTIO_F_VERSION_1, VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_MQ,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::boot::regs::EntryState;
use vmm::exit::ExitReason;
use vmm::pci::PciDevice;
use vmm::virtio_pci::{SharedVirtioDevice, VirtioPciDevice, VirtioPciOptions};
use vmm::{Machine, MachineConfig};

const DEV: u8 = 1;

// Guest memory layout of the request.
const DESC: u64 = 0x10000;
const AVAIL: u64 = 0x11000;
const USED: u64 = 0x12000;
const HDR: u64 = 0x13000;
const DATA: u64 = 0x14000;
const STATUS: u64 = 0x15000;
const IDT: u64 = 0x3000;
const IDTR: u64 = 0x2ff0;
const HANDLER: u64 = 0x2400;
const VECTOR: u32 = 0x41;
const SECTOR: u64 = 3;

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn disk_file(tag: &str) -> TempFile {
    let p = std::env::temp_dir().join(format!("bvm-vpci-{tag}-{}.img", std::process::id()));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(1 << 20).unwrap();
    TempFile(p)
}

fn machine() -> Machine {
    Machine::new(&MachineConfig {
        mem_size: 4 << 20,
        vcpus: 1,
    })
    .expect("create machine")
}

/// The DMA path the `-bounce` options `spec` give a device of `queues` queues.
fn dma(spec: &str, queues: usize) -> bounce::Dma {
    let (dma, _pool) = spec
        .parse::<BounceOptions>()
        .unwrap()
        .build(queues)
        .unwrap();
    dma
}

fn blk_device(path: &std::path::Path) -> SharedVirtioDevice {
    let disk = DiskImage::open(path, ImageFormat::Raw, false).unwrap();
    let dma = dma("policy=force,slots=1024", 1);
    Arc::new(Mutex::new(
        Block::new(disk, BlockConfig::default(), dma).unwrap(),
    ))
}

fn add_blk(
    m: &mut Machine,
    path: &std::path::Path,
    opts: VirtioPciOptions,
) -> (Arc<Mutex<VirtioPciDevice>>, SharedVirtioDevice) {
    let pci = m.add_pci().unwrap();
    let dev = blk_device(path);
    let f = VirtioPciDevice::new("blk0", dev.clone(), m.vm().clone(), &pci, opts).unwrap();
    let f = Arc::new(Mutex::new(f));
    assert_eq!(pci.add_device(f.clone()).unwrap(), DEV);
    (f, dev)
}

/// Writes the request (OUT of one sector at SECTOR) and the rings into guest memory.
fn prepare_request(mem: &GuestMemoryMmap, pattern: &[u8]) {
    mem.write_slice(
        &RequestHeader::encode(VIRTIO_BLK_T_OUT, SECTOR),
        GuestAddress(HDR),
    )
    .unwrap();
    mem.write_slice(pattern, GuestAddress(DATA)).unwrap();
    mem.write_slice(&[STATUS_UNSET], GuestAddress(STATUS))
        .unwrap();
    let layout = Layout {
        size: 8,
        desc: DESC,
        avail: AVAIL,
        used: USED,
    };
    let mut vq = DriverQueue::new(layout, false).unwrap();
    let bufs = [Buf::ro(HDR, 16), Buf::ro(DATA, 512), Buf::wo(STATUS, 1)];
    // Head 0, published before the device is set up (the guest program only kicks).
    let head = vq.add_chain(mem, &bufs).unwrap();
    vq.push(mem, head).unwrap();
    vq.publish(mem).unwrap();
}

fn enable_lapic_and_idt(m: &Machine) {
    let fd = m.vcpus()[0].fd();
    let mut lapic = fd.get_lapic().unwrap();
    for (i, b) in 0x1ffu32.to_le_bytes().iter().enumerate() {
        lapic.regs[0xf0 + i] = *b as _;
    }
    fd.set_lapic(&lapic).unwrap();
    idt_gate(m, IDT, IDTR, HANDLER, u64::from(VECTOR));
}

/// The guest program: identify, walk capabilities, negotiate, set up queue 0 with MSI-X
/// vector 0, DRIVER_OK, kick, wait for the interrupt.
fn driver_program() -> (Asm, Asm) {
    let mut a = Asm::new();
    a.conf1_read(DEV, 0)
        .report_eax(REPORT_PORT) // 1: ids
        .conf1_read(DEV, 2)
        .report_eax(REPORT_PORT) // 2: class/revision
        .conf1_read(DEV, 11)
        .report_eax(REPORT_PORT) // 3: subsystem
        .conf1_read(DEV, 13)
        .and_eax(0xfc)
        .mov_rr(EBX, EAX);
    // Capability walk: report the first dword of each capability.
    let walk = a.here();
    a.test_rr(EBX, EBX);
    let done = a.jz_fwd();
    a.mov_eax(0x8000_0000 | u32::from(DEV) << 11)
        .or_rr(EAX, EBX)
        .mov_dx(0xcf8)
        .out_dx_eax()
        .mov_dx(0xcfc)
        .in_eax_dx()
        .report_eax(REPORT_PORT)
        .shr_eax(8)
        .and_eax(0xfc)
        .mov_rr(EBX, EAX)
        .jmp_to(walk)
        .patch_to_here(done);
    // MSI-X: enable (message control bit 15 = bit 31 of the capability's first dword at
    // 0x40), entry 0 -> APIC 0 vector VECTOR, unmasked.
    a.conf1_write(DEV, 0x40 / 4, 0x8000_0000)
        .conf1_read(DEV, 5) // BAR1 (MSI-X)
        .and_eax(!0xf)
        .mov_rr(ECX, EAX)
        .st32(ECX, 0, 0xfee0_0000)
        .st32(ECX, 4, 0)
        .st32(ECX, 8, VECTOR)
        .st32(ECX, 12, 0)
        .virtio_reset_to_driver(DEV)
        .st32(EBX, 0x00, 0)
        .ld32(EBX, 0x04)
        .report_eax(REPORT_PORT) // device features 0..31
        .st32(EBX, 0x00, 1)
        .ld32(EBX, 0x04)
        .report_eax(REPORT_PORT) // device features 32..63
        .st32(EBX, 0x08, 1)
        .st32(
            EBX,
            0x0c,
            high_word(&[
                VIRTIO_F_VERSION_1,
                VIRTIO_F_ACCESS_PLATFORM,
                VIRTIO_F_RING_PACKED,
            ]),
        ) // RING_PACKED is not offered
        .ld32(EBX, 0x0c)
        .report_eax(REPORT_PORT) // driver features 32..63 as kept
        .st8(EBX, 0x14, DRIVER_FEATURES_OK)
        .ld8(EBX, 0x14)
        .report_eax(REPORT_PORT) // status
        .ld16(EBX, 0x12)
        .report_eax(REPORT_PORT) // num_queues
        .st16(EBX, 0x16, 0)
        .ld16(EBX, 0x18)
        .report_eax(REPORT_PORT) // queue 0 max size
        .st16(EBX, 0x18, 7) // not a power of two: ignored
        .st16(EBX, 0x18, 8)
        .ld16(EBX, 0x18)
        .report_eax(REPORT_PORT) // queue size
        .st16(EBX, 0x1a, 0) // queue vector 0
        .st16(EBX, 0x10, 1) // config vector 1
        .virtio_queue_rings(DESC as u32, AVAIL as u32, USED as u32)
        .st16(EBX, 0x1c, 1)
        .ld16(EBX, 0x1c)
        .report_eax(REPORT_PORT) // queue enable
        .st8(EBX, 0x14, DRIVER_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK)
        .raw(&[0x0f, 0x01, 0x1d])
        .raw(&(IDTR as u32).to_le_bytes()) // lidt
        .st16(EBX, 0x3000, 0) // notify queue 0
        .raw(&[0xfb]) // sti
        .hlt_forever();
    let mut h = Asm::new();
    h.ld16_abs((USED + 2) as u32)
        .report_eax(REPORT_PORT) // used idx
        .ld8_abs(STATUS as u32)
        .report_eax(REPORT_PORT) // request status
        .debug_exit(0);
    (a, h)
}

fn run_request(tag: &str, opts: VirtioPciOptions) {
    if !kvm_available() {
        return;
    }
    let file = disk_file(tag);
    let mut m = machine();
    m.add_debug_exit(EXIT_PORT).unwrap();
    let log = report_ports(&m, 4);
    let (func, blk) = add_blk(&mut m, &file.0, opts);
    let pattern: Vec<u8> = (0..512u32).map(|i| (i * 7 + 3) as u8).collect();
    prepare_request(m.memory(), &pattern);
    enable_lapic_and_idt(&m);
    let (code, handler) = driver_program();
    assert!(code.code.len() < 0x1000, "program too long");
    m.memory()
        .write_slice(&code.code, GuestAddress(CODE_ADDR))
        .unwrap();
    m.memory()
        .write_slice(&handler.code, GuestAddress(HANDLER))
        .unwrap();
    EntryState::Flat32 {
        eip: CODE_ADDR as u32,
        ebx: 0,
        esp: 0x8000,
    }
    .apply(&m.vcpus()[0], m.memory())
    .unwrap();
    let t = Instant::now();
    let running = m.start().unwrap();
    // A watchdog: a lost interrupt must fail the test, not hang it.
    let exit_handle = running.exit_handle().clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        exit_handle.request(ExitReason::Error("watchdog".into()));
    });
    let exit = running.wait().unwrap();
    let took = t.elapsed();
    let got = reported(&log);
    assert_eq!(
        exit.reason,
        ExitReason::DebugExit { value: 0 },
        "reports: {got:x?}"
    );
    let expect_prefix = [
        0x1042_1af4u32, // virtio-blk modern
        0x0100_0001,    // class 01/00, revision 1
        0x1100_1af4,    // subsystem as QEMU
    ];
    assert_eq!(&got[..3], &expect_prefix);
    // Capability chain: MSI-X (table size 2 -> field 1), then COMMON, ISR, DEVICE, NOTIFY.
    assert_eq!(got[3] & 0xffff_00ff, 0x0001_0011, "MSI-X cap {:#x}", got[3]);
    let vendor: Vec<(u32, u32)> = got[4..8].iter().map(|v| (v & 0xff, v >> 24)).collect();
    assert_eq!(vendor, vec![(9, 1), (9, 3), (9, 4), (9, 2)]);
    let features_lo = got[8];
    assert_ne!(features_lo & (1 << 6), 0, "BLK_SIZE offered");
    assert_eq!(got[9] & 0x3, 0x3, "VERSION_1 and ACCESS_PLATFORM offered");
    assert_eq!(got[10], 0x3, "un-offered bit 34 dropped");
    assert_eq!(got[11], 0x0b, "FEATURES_OK accepted");
    assert_eq!(got[12], 1, "num_queues");
    assert_eq!(got[13], 256, "max queue size");
    assert_eq!(got[14], 8, "size 7 ignored, 8 taken");
    assert_eq!(got[15], 1, "queue enabled");
    assert_eq!(&got[16..], &[1, 0], "used idx 1, status OK");
    let mut on_disk = vec![0u8; 512];
    std::fs::File::open(&file.0)
        .unwrap()
        .read_exact_at(&mut on_disk, SECTOR * 512)
        .unwrap();
    assert_eq!(on_disk, pattern, "data reached the backing file");
    let stats = blk.lock().unwrap().stats();
    assert!(
        stats["bounce"]["maps"].as_u64().unwrap_or(0) >= 3,
        "bounced: {stats}"
    );
    assert_eq!(func.lock().unwrap().activations(), 1);
    eprintln!("virtio-blk request over virtio-pci ({tag}): {took:?}");
}

#[test]
fn guest_finds_virtio_blk_walks_caps_and_completes_a_request_with_msix() {
    run_request("ioeventfd", VirtioPciOptions::default());
}

#[test]
fn notifications_fall_back_to_the_mmio_exit_path() {
    run_request("mmio", VirtioPciOptions { ioeventfd: false });
}

// ---- host-side register tests (the vCPU's view through the PciDevice trait) ----

/// A machine with a virtio-blk function on a file named after `tag`, driven from the host
/// side; `None` where there is no KVM.
fn host_fixture(tag: &str) -> Option<(Machine, Arc<Mutex<VirtioPciDevice>>, TempFile)> {
    if !kvm_available() {
        return None;
    }
    let file = disk_file(tag);
    let mut m = machine();
    let (f, _) = add_blk(&mut m, &file.0, VirtioPciOptions::default());
    Some((m, f, file))
}

fn w(f: &Arc<Mutex<VirtioPciDevice>>, off: u64, data: &[u8]) {
    f.lock().unwrap().write_bar(4, off, data);
}

fn r(f: &Arc<Mutex<VirtioPciDevice>>, off: u64, len: usize) -> u64 {
    let mut b = vec![0u8; len];
    f.lock().unwrap().read_bar(4, off, &mut b);
    let mut v = [0u8; 8];
    v[..len].copy_from_slice(&b);
    u64::from_le_bytes(v)
}

#[test]
fn refused_features_and_driver_ok_without_features_ok_set_needs_reset() {
    let Some((_m, f, _file)) = host_fixture("needsreset") else {
        return;
    };
    w(&f, 0x14, &[1]);
    w(&f, 0x14, &[3]);
    // No VERSION_1: FEATURES_OK is refused, as often as the driver asks (counted each
    // time, logged once).
    let before = f.lock().unwrap().bad_writes();
    for _ in 0..3 {
        w(&f, 0x14, &[0x0b]);
        assert_eq!(r(&f, 0x14, 1), 0x03);
    }
    assert_eq!(f.lock().unwrap().bad_writes(), before + 3);
    // DRIVER_OK anyway: activation fails, NEEDS_RESET, no worker, no panic.
    w(&f, 0x14, &[0x07]);
    assert_eq!(
        r(&f, 0x14, 1) as u8,
        0x07 | VIRTIO_CONFIG_S_NEEDS_RESET,
        "needs reset"
    );
    assert_eq!(f.lock().unwrap().running_workers(), 0);
    // Reset clears it.
    w(&f, 0x14, &[0]);
    assert_eq!(r(&f, 0x14, 1), 0);
}

#[test]
fn bad_queue_writes_are_ignored() {
    let Some((_m, f, _file)) = host_fixture("badqueue") else {
        return;
    };
    w(&f, 0x16, &[0, 0]);
    for bad in [0u16, 3, 512, 1024] {
        w(&f, 0x18, &bad.to_le_bytes());
        assert_eq!(r(&f, 0x18, 2), 256, "size {bad} ignored");
    }
    // Rings outside guest memory (4 MiB): enable refused.
    w(&f, 0x20, &0x7000_0000u32.to_le_bytes());
    w(&f, 0x1c, &[1, 0]);
    assert_eq!(r(&f, 0x1c, 2), 0, "enable with bad rings refused");
    // A queue that does not exist reads size 0 and ignores writes.
    w(&f, 0x16, &[5, 0]);
    assert_eq!(r(&f, 0x18, 2), 0);
    w(&f, 0x18, &[8, 0]);
    assert_eq!(r(&f, 0x18, 2), 0);
    // Read-only fields and odd widths do not panic.
    w(&f, 0x12, &[9, 9]);
    assert_eq!(r(&f, 0x12, 2), 1);
    w(&f, 0x3000 + 4 * 40, &[0, 0]);
    w(&f, 0x0, &[1, 2, 3]);
    let _ = r(&f, 0x2000, 8);
    let _ = r(&f, 0x3ffe, 2);
    // Out-of-range MSI-X vectors read back as NO_VECTOR.
    w(&f, 0x16, &[0, 0]);
    w(&f, 0x1a, &[9, 0]);
    assert_eq!(r(&f, 0x1a, 2), 0xffff);
}

#[test]
fn reset_stops_workers_and_clears_queues() {
    let Some((m, f, _file)) = host_fixture("reset") else {
        return;
    };
    let mem = m.memory().clone();
    prepare_request(&mem, &[0u8; 512]);
    // ACKNOWLEDGE|DRIVER, feature word 1 = `high`, FEATURES_OK, queue 0 (of `size` when given)
    // on the request's rings, enabled, DRIVER_OK.
    let start = |high: u32, size: Option<u16>| {
        w(&f, 0x14, &[3]);
        w(&f, 0x08, &1u32.to_le_bytes());
        w(&f, 0x0c, &high.to_le_bytes());
        w(&f, 0x14, &[0x0b]);
        if let Some(size) = size {
            w(&f, 0x18, &size.to_le_bytes());
        }
        w(&f, 0x20, &(DESC as u32).to_le_bytes());
        w(&f, 0x28, &(AVAIL as u32).to_le_bytes());
        w(&f, 0x30, &(USED as u32).to_le_bytes());
        w(&f, 0x1c, &[1, 0]);
        w(&f, 0x14, &[0x0f]);
    };
    start(3, Some(8));
    assert_eq!(f.lock().unwrap().running_workers(), 1);
    // Writes to a live queue are ignored.
    w(&f, 0x18, &16u16.to_le_bytes());
    assert_eq!(r(&f, 0x18, 2), 8);
    w(&f, 0x14, &[0]);
    assert_eq!(f.lock().unwrap().running_workers(), 0);
    assert_eq!(r(&f, 0x14, 1), 0);
    assert_eq!(r(&f, 0x1c, 2), 0, "queue disabled");
    assert_eq!(r(&f, 0x18, 2), 256, "size back to max");
    assert_eq!(r(&f, 0x20, 8), 0, "rings cleared");
    // And it comes up again.
    start(1, None);
    assert_eq!(f.lock().unwrap().running_workers(), 1);
    assert_eq!(f.lock().unwrap().activations(), 2);
}

/// Negotiates `features`, enables every queue (size 8, rings in guest memory from `ring_base`)
/// and sets DRIVER_OK through the BAR, as a driver would.
fn bring_up(f: &Arc<Mutex<VirtioPciDevice>>, features: u64, ring_base: u64) -> u16 {
    w(f, 0x14, &[3]);
    w(f, 0x08, &0u32.to_le_bytes());
    w(f, 0x0c, &(features as u32).to_le_bytes());
    w(f, 0x08, &1u32.to_le_bytes());
    w(f, 0x0c, &((features >> 32) as u32).to_le_bytes());
    w(f, 0x14, &[0x0b]);
    assert_eq!(r(f, 0x14, 1), 0x0b);
    let nq = r(f, 0x12, 2) as u16;
    for q in 0..nq {
        let base = ring_base + u64::from(q) * 0x1000;
        w(f, 0x16, &q.to_le_bytes());
        w(f, 0x18, &8u16.to_le_bytes());
        w(f, 0x1a, &q.to_le_bytes());
        w(f, 0x20, &(base as u32).to_le_bytes());
        w(f, 0x28, &(base as u32 + 0x200).to_le_bytes());
        w(f, 0x30, &(base as u32 + 0x400).to_le_bytes());
        w(f, 0x1c, &[1, 0]);
        assert_eq!(r(f, 0x1c, 2), 1, "queue {q} enabled");
    }
    w(f, 0x14, &[0x0f]);
    assert_eq!(r(f, 0x14, 1), 0x0f, "live without NEEDS_RESET");
    nq
}

#[test]
fn several_multi_queue_devices_at_once() {
    if !kvm_available() {
        return;
    }
    use devices::net::backend::{NetBackend, NullBackend};
    use devices::net::device::{Net, NetConfig};
    let file = disk_file("multi");
    let mut m = machine();
    let pci = m.add_pci().unwrap();
    let disk = DiskImage::open(&file.0, ImageFormat::Raw, false).unwrap();
    let blk: SharedVirtioDevice = Arc::new(Mutex::new(
        Block::new(
            disk,
            BlockConfig {
                num_queues: 2,
                ..BlockConfig::default()
            },
            dma("policy=force,slots=1024", 2),
        )
        .unwrap(),
    ));
    let backends: Vec<Box<dyn NetBackend>> = vec![
        Box::new(NullBackend::default()),
        Box::new(NullBackend::default()),
    ];
    let net: SharedVirtioDevice = Arc::new(Mutex::new(
        Net::new(
            NetConfig {
                queue_pairs: 2,
                ..NetConfig::default()
            },
            backends,
            dma("policy=force,mode=iova,slots=1024", 2),
        )
        .unwrap(),
    ));
    let opts = VirtioPciOptions::default();
    let fb = Arc::new(Mutex::new(
        VirtioPciDevice::new("blk0", blk, m.vm().clone(), &pci, opts).unwrap(),
    ));
    let fnet = Arc::new(Mutex::new(
        VirtioPciDevice::new("net0", net, m.vm().clone(), &pci, opts).unwrap(),
    ));
    assert_eq!(pci.add_device(fb.clone()).unwrap(), 1);
    assert_eq!(pci.add_device(fnet.clone()).unwrap(), 2);
    // Identity and MSI-X table sizes (queues + 1) through configuration space.
    assert_eq!(pci.config_read(0, 1, 0, 0), 0x1042_1af4);
    assert_eq!(pci.config_read(0, 2, 0, 0), 0x1041_1af4);
    assert_eq!(pci.config_read(0, 2, 0, 2) >> 8, 0x02_0000, "network class");
    assert_eq!((pci.config_read(0, 1, 0, 0x40 / 4) >> 16) & 0x7ff, 2);
    assert_eq!((pci.config_read(0, 2, 0, 0x40 / 4) >> 16) & 0x7ff, 5);
    // BARs do not overlap.
    let bars: Vec<u64> = [1u8, 2]
        .iter()
        .flat_map(|&d| [5usize, 8].map(|reg| u64::from(pci.config_read(0, d, 0, reg) & !0xf)))
        .collect();
    let mut uniq = bars.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(uniq.len(), 4, "{bars:x?}");
    assert_eq!(
        bring_up(
            &fb,
            feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_BLK_F_MQ),
            0x10_0000,
        ),
        2
    );
    assert_eq!(
        bring_up(
            &fnet,
            feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_CTRL_VQ) | feature(VIRTIO_NET_F_MQ),
            0x20_0000,
        ),
        5
    );
    assert_eq!(
        fb.lock().unwrap().running_workers(),
        2,
        "one worker per blk queue"
    );
    let net_workers = fnet.lock().unwrap().running_workers();
    assert!(net_workers >= 2, "net workers: {net_workers}");
    eprintln!("blk workers 2, net workers {net_workers}");
    // Resetting one device leaves the other running.
    w(&fnet, 0x14, &[0]);
    assert_eq!(fnet.lock().unwrap().running_workers(), 0);
    assert_eq!(fb.lock().unwrap().running_workers(), 2);
}
