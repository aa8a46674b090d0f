//! Acknowledged writes survive a SIGKILL of `bouncevm` itself. The binary boots a stand-in
//! PVH kernel that drives its virtio-blk-pci function as a driver would (BAR 4 common
//! configuration, FLUSH and CONFIG_WCE negotiated as Linux does, one queue, bounce forced),
//! submits [`WRITES`] allocating 4 KiB writes at once, polls the used ring and prints one
//! line per completion on COM1 (`<head letter><status digit>`), then, in cache=none, a FLUSH
//! and its completion. The test SIGKILLs the VMM the moment the line that makes the data
//! durable arrives (the last write in writethrough, the FLUSH in cache=none) and reads the
//! image: raw, or qcow2 made by `qemu-img create` (then `qemu-img check` must pass).
//!
//! The same guest with cache=writeback and no FLUSH checks the other half of the contract:
//! SIGTERM and SIGINT end `bouncevm` with every disk flushed, so even a qcow2 image whose
//! allocating writes the guest never flushed is consistent and complete afterwards.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bounce::testing::qemu_img_available;
use common::*;
use devices::block::request::RequestHeader;
use devices::block::STATUS_UNSET;
use devices::testing::durable::{
    assert_acknowledged, assert_consistent, crash_offset, crash_pattern, create_image, read_back,
};
use devices::virtio::driver::{Buf, DriverQueue, Layout};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_OUT, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// The virtio-blk-pci function of the only `-drive if=virtio`: 00:01.0.
const DEV: u8 = 1;
/// Writes submitted at once (three descriptors each, plus two for the FLUSH: 26 of 32).
const WRITES: u64 = 8;
/// Bytes per write (an allocating write straddling two 4 KiB qcow2 clusters).
const LEN: usize = 4096;
const QUEUE_SIZE: u16 = 32;

// The guest's memory: the image is loaded at KERNEL_ADDR, code first, then the virtqueue,
// request headers, status bytes and data, all laid out by the host side of the test.
const K: u64 = KERNEL_ADDR;
const DESC: u64 = K + 0x1000;
const AVAIL: u64 = K + 0x2000;
const USED: u64 = K + 0x3000;
const HDR: u64 = K + 0x4000;
const STATUS: u64 = K + 0x5000;
const DATA: u64 = K + 0x6000;
const END: u64 = DATA + WRITES * LEN as u64;

/// Head descriptor of write `i`; the FLUSH is `head(WRITES)`.
fn head(i: u64) -> u16 {
    u16::try_from(3 * i).unwrap()
}

/// The line the guest prints when the request at `head` completes with `status`.
fn line(head: u16, status: u8) -> String {
    format!(
        "{}{}",
        char::from(b'A' + head as u8),
        char::from(b'0' + status)
    )
}

fn put(img: &mut [u8], addr: u64, bytes: &[u8]) {
    let at = usize::try_from(addr - K).unwrap();
    img[at..at + bytes.len()].copy_from_slice(bytes);
}

/// Waits until the used ring holds `k + 1` entries, then prints entry `k`'s head and the
/// status byte of that request.
fn print_completion(a: &mut Asm, k: u64) {
    let poll = a.here();
    a.ld16_abs((USED + 2) as u32)
        .cmp_eax(u32::try_from(k + 1).unwrap())
        .jb_to(poll)
        .load_eax(u32::try_from(USED + 4 + 8 * k).unwrap()) // used.ring[k].id
        .mov_rr(ECX, EAX)
        .add_al(b'A')
        .mov_dx(0x3f8)
        .out_dx_al()
        .shl_ecx(4)
        .ld8(ECX, STATUS as u32) // status byte of that head (16 bytes per request)
        .add_al(b'0')
        .out_dx_al()
        .mov_al(b'\n')
        .out_dx_al();
}

/// Makes the first `n` avail entries visible and notifies queue 0 (BAR 4 in ebx).
fn publish(a: &mut Asm, n: u64) {
    a.xor_rr(ECX, ECX)
        .st16(ECX, (AVAIL + 2) as u32, u16::try_from(n).unwrap())
        .st16(EBX, 0x3000, 0);
}

/// The stand-in kernel: program and data in one loadable image.
fn kernel(flush: bool) -> Vec<u8> {
    let mut a = Asm::new();
    a.conf1_read(DEV, 0).cmp_eax(0x1042_1af4);
    let found = a.jz_fwd();
    a.print(b"no virtio-blk at 00:01.0\n")
        .raw(&[0xfa])
        .hlt_forever();
    a.patch_to_here(found);
    a.conf1_write(DEV, 1, 0x6) // memory space, bus master
        .virtio_reset_to_driver(DEV)
        .st32(EBX, 0x08, 0)
        .st32(
            EBX,
            0x0c,
            (feature(VIRTIO_BLK_F_FLUSH) | feature(VIRTIO_BLK_F_CONFIG_WCE)) as u32,
        )
        .st32(EBX, 0x08, 1)
        .st32(
            EBX,
            0x0c,
            high_word(&[VIRTIO_F_VERSION_1, VIRTIO_F_ACCESS_PLATFORM]),
        )
        .st8(EBX, 0x14, DRIVER_FEATURES_OK)
        .ld8(EBX, 0x14)
        .and_eax(u32::from(VIRTIO_CONFIG_S_FEATURES_OK));
    let ok = a.jnz_fwd();
    a.print(b"features refused\n").raw(&[0xfa]).hlt_forever();
    a.patch_to_here(ok);
    a.st16(EBX, 0x16, 0) // queue 0
        .st16(EBX, 0x18, QUEUE_SIZE)
        .virtio_queue_rings(DESC as u32, AVAIL as u32, USED as u32)
        .st16(EBX, 0x1c, 1)
        .st8(EBX, 0x14, DRIVER_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK);
    publish(&mut a, WRITES);
    for k in 0..WRITES {
        print_completion(&mut a, k);
    }
    if flush {
        // A FLUSH covers the writes completed before it is submitted.
        publish(&mut a, WRITES + 1);
        print_completion(&mut a, WRITES);
    }
    a.print(b"done\n").raw(&[0xfa]).hlt_forever();
    assert!(a.code.len() < 0x1000, "program too long");

    let mut img = vec![0u8; usize::try_from(END - K).unwrap()];
    put(&mut img, K, &a.code);
    // The driver writes the chains and the avail entries (not the avail index: the program
    // publishes) into memory laid out as the image, then they are copied in.
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(K), img.len())]).unwrap();
    let layout = Layout {
        size: QUEUE_SIZE,
        desc: DESC,
        avail: AVAIL,
        used: USED,
    };
    let mut vq = DriverQueue::new(layout, false).unwrap();
    let len = u32::try_from(LEN).unwrap();
    for i in 0..=WRITES {
        let h = head(i);
        let hdr = HDR + 16 * i;
        let status = STATUS + 16 * u64::from(h);
        put(&mut img, status, &[STATUS_UNSET]);
        let chain = if i == WRITES {
            put(&mut img, hdr, &RequestHeader::encode(VIRTIO_BLK_T_FLUSH, 0));
            vec![Buf::ro(hdr, 16), Buf::wo(status, 1)]
        } else {
            let data = DATA + LEN as u64 * i;
            put(
                &mut img,
                hdr,
                &RequestHeader::encode(VIRTIO_BLK_T_OUT, crash_offset(i) / 512),
            );
            put(&mut img, data, &crash_pattern(i, LEN));
            vec![Buf::ro(hdr, 16), Buf::ro(data, len), Buf::wo(status, 1)]
        };
        vq.write_chain(&mem, h, &chain).unwrap();
        vq.push(&mem, h).unwrap();
    }
    let rings = usize::try_from(DESC - K).unwrap()..usize::try_from(USED - K).unwrap();
    mem.read_slice(&mut img[rings], GuestAddress(DESC)).unwrap();
    build_elf(&img, true)
}

struct Vm {
    child: Child,
    lines: mpsc::Receiver<String>,
    files: Vec<PathBuf>,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl Vm {
    /// Boots the stand-in kernel on a fresh `format` image with `cache=`; `test` names the
    /// files (tests run in parallel).
    fn boot(test: &str, format: &str, cache: &str, flush: bool) -> (Vm, PathBuf) {
        let dir = std::env::temp_dir();
        let tag = format!("bvm-vmcrash-{}-{test}-{format}-{cache}", std::process::id());
        let elf = dir.join(format!("{tag}.elf"));
        std::fs::write(&elf, kernel(flush)).unwrap();
        let img = dir.join(format!("{tag}.{format}"));
        create_image(&img, format);
        let mut child = spawn_piped(
            Command::new(BIN)
                .args(["-m", "64M", "-kernel"])
                .arg(&elf)
                .arg("-drive")
                .arg(format!(
                    "file={},format={format},if=virtio,cache={cache}",
                    img.display()
                ))
                .args([
                    "-bounce",
                    "policy=force,slots=1024",
                    "-nographic",
                    "-no-reboot",
                ]),
        );
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let vm = Vm {
            child,
            lines,
            files: vec![elf, img.clone()],
        };
        (vm, img)
    }

    /// Reads `n` completion lines (in the guest's used-ring order); returns the writes
    /// acknowledged OK and whether the FLUSH was.
    fn completions(&mut self, n: usize, what: &str) -> (Vec<u64>, bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        let (mut acked, mut flushed) = (Vec::new(), false);
        while seen.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(l) = self.lines.recv_timeout(left) else {
                let _ = self.child.kill();
                let mut err = String::new();
                let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("{what}: {n} completions expected; guest printed {seen:?}; stderr: {err}");
            };
            if let Some(i) = (0..WRITES).find(|&i| l == line(head(i), VIRTIO_BLK_S_OK)) {
                acked.push(i);
            }
            flushed |= l == line(head(WRITES), VIRTIO_BLK_S_OK);
            seen.push(l);
        }
        (acked, flushed)
    }

    /// Sends `signal` and waits for the exit; returns the wait status.
    fn signal(&mut self, signal: libc::c_int) -> std::process::ExitStatus {
        // SAFETY: kill() on our own child's pid has no memory effects.
        #[allow(clippy::undocumented_unsafe_blocks)]
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "bouncevm ignored signal {signal}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn crash_after_acknowledged_writes(format: &str, cache: &str) {
    let what = format!("bouncevm {format} cache={cache}");
    // writethrough: each write is durable when it completes; none: after the FLUSH.
    let flush = cache != "writethrough";
    let (mut vm, img) = Vm::boot("crash", format, cache, flush);
    let n = usize::try_from(WRITES).unwrap() + usize::from(flush);
    let (acked, flushed) = vm.completions(n, &what);
    // SIGKILL: no destructor, no exit-time flush of ours runs.
    let st = vm.signal(libc::SIGKILL);
    assert!(!st.success(), "{what}: {st:?}");
    assert_eq!(
        acked.len() as u64,
        WRITES,
        "{what}: every write completes OK"
    );
    assert_eq!(flushed, flush, "{what}: the FLUSH completes OK");
    let data = read_back(&img, format, &what);
    assert_acknowledged(&data, &acked, LEN, &what);
}

fn resources() -> bool {
    kvm_available() && qemu_img_available()
}

/// Raw, then qcow2 (when qemu-img is there).
fn each_format(cache: &str) {
    if !kvm_available() {
        return;
    }
    crash_after_acknowledged_writes("raw", cache);
    if qemu_img_available() {
        crash_after_acknowledged_writes("qcow2", cache);
    }
}

#[test]
fn writethrough_writes_survive_sigkill_of_bouncevm() {
    each_format("writethrough");
}

#[test]
fn cache_none_flushed_writes_survive_sigkill_of_bouncevm() {
    each_format("none");
}

/// cache=writeback, no FLUSH from the guest: the allocating writes' qcow2 metadata is only in
/// the VMM's caches until something flushes. SIGTERM and SIGINT must flush every disk (status
/// 0, as QEMU); the image then passes `qemu-img check` and holds every completed write.
#[test]
fn sigterm_and_sigint_flush_unflushed_qcow2_writes() {
    if !resources() {
        return;
    }
    for (name, sig) in [("SIGTERM", libc::SIGTERM), ("SIGINT", libc::SIGINT)] {
        let what = format!("bouncevm qcow2 cache=writeback {name}");
        let (mut vm, img) = Vm::boot(name, "qcow2", "writeback", false);
        let (acked, _) = vm.completions(usize::try_from(WRITES).unwrap(), &what);
        assert_eq!(acked.len() as u64, WRITES, "{what}");
        let st = vm.signal(sig);
        assert_eq!(st.code(), Some(0), "{what}: {st:?}");
        let data = read_back(&img, "qcow2", &what);
        assert_acknowledged(&data, &acked, LEN, &what);
    }
}

/// cache=writeback, no FLUSH, SIGKILL: the unflushed writes may be lost, but the image must
/// stay consistent (QEMU's guarantee: at most leaked clusters), or a later allocation could
/// reuse a cluster the image still references and overwrite flushed data.
#[test]
fn sigkill_before_a_flush_leaves_qcow2_consistent() {
    if !resources() {
        return;
    }
    let what = "bouncevm qcow2 cache=writeback SIGKILL without FLUSH";
    let (mut vm, img) = Vm::boot("noflush", "qcow2", "writeback", false);
    let (acked, _) = vm.completions(usize::try_from(WRITES).unwrap(), what);
    assert_eq!(acked.len() as u64, WRITES, "{what}");
    let st = vm.signal(libc::SIGKILL);
    assert!(!st.success(), "{what}: {st:?}");
    assert_consistent(&img, what);
}
