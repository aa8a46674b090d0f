//! The `bouncevm` binary: command-line errors (one line naming the flag or property, exit
//! status 1), and on /dev/kvm a stand-in PVH "kernel" booted through the real command line:
//! serial output on stdout, an i8042 reset ending with status 0 under `-no-reboot`, and the
//! QMP monitor driven by a Python standard-library client.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_bouncevm");

struct Tmp(PathBuf);
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn tmp(name: &str, bytes: &[u8]) -> Tmp {
    let p = std::env::temp_dir().join(format!("bvm-cli-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    Tmp(p)
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run bouncevm")
}

fn one_line_error(args: &[&str], needle: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: one line, got {err:?}");
    assert!(err.starts_with("bouncevm: "), "{err}");
    assert!(
        err.contains(needle),
        "{args:?}: {err:?} should name {needle:?}"
    );
}

#[test]
fn unsupported_flags_and_properties_are_rejected_by_name() {
    let k = tmp("k", b"x");
    let d = tmp("d.img", &[0u8; 4096]);
    let k = k.0.to_str().unwrap();
    let file = format!("file={}", d.0.display());
    one_line_error(&["-foo"], "unsupported option -foo");
    one_line_error(
        &["-kernel", k, "-machine", "q35"],
        "unsupported option -machine",
    );
    one_line_error(
        &["-kernel", k, "-display", "none"],
        "unsupported option -display",
    );
    one_line_error(&["-kernel", k, "-cpu", "host"], "unsupported option -cpu");
    one_line_error(
        &["-kernel", k, "-drive", &format!("{file},snapshot=on")],
        "unsupported property 'snapshot' of -drive",
    );
    one_line_error(
        &["-kernel", k, "-drive", &format!("{file},cache=off")],
        "unknown cache mode 'off'",
    );
    one_line_error(
        &["-kernel", k, "-drive", &format!("{file},if=ide")],
        "if of -drive",
    );
    one_line_error(
        &["-kernel", k, "-drive", &format!("{file},format=vmdk")],
        "format of -drive",
    );
    one_line_error(
        &[
            "-kernel",
            k,
            "-drive",
            &format!("{file},if=none,id=d0"),
            "-device",
            "virtio-blk-pci,drive=d0,logical_block_size=4096",
        ],
        "unsupported property 'logical_block_size' of -device virtio-blk-pci",
    );
    one_line_error(
        &[
            "-kernel",
            k,
            "-netdev",
            "tap,id=n0,ifname=t0",
            "-device",
            "virtio-net-pci,netdev=n0,romfile=",
        ],
        "unsupported property 'romfile' of -device virtio-net-pci",
    );
    one_line_error(
        &[
            "-kernel",
            k,
            "-netdev",
            "tap,id=n0,ifname=t0,script=/etc/qemu-ifup",
        ],
        "script of -netdev tap",
    );
    one_line_error(&["-kernel", k, "-netdev", "user,id=n0"], "-netdev");
    one_line_error(&["-kernel", k, "-device", "e1000,netdev=n0"], "'e1000'");
    one_line_error(
        &["-kernel", k, "-device", "virtio-blk-pci,drive=missing"],
        "drive 'missing'",
    );
    one_line_error(&["-kernel", k, "-serial", "pty"], "-serial");
    one_line_error(&["-kernel", k, "-accel", "tcg"], "-accel");
    one_line_error(&["-kernel", k, "-qmp", "tcp:localhost:4444,server"], "-qmp");
    one_line_error(
        &["-kernel", k, "-qmp", "unix:/tmp/x,server,telnet"],
        "'telnet' of -qmp",
    );
    one_line_error(&["-kernel", k, "-bounce", "policy=sometimes"], "-bounce");
    one_line_error(
        &["-kernel", k, "-bounce", "id=nodev,policy=force"],
        "id=nodev",
    );
    one_line_error(&["-kernel", k, "-m", "lots"], "-m");
    one_line_error(&["-kernel", k, "-smp", "0"], "-smp");
    one_line_error(&["-kernel"], "option -kernel requires an argument");
    one_line_error(&["-m", "64M"], "-kernel");
}

#[test]
fn missing_files_give_one_clear_line() {
    one_line_error(
        &["-kernel", "/nonexistent/vmlinuz"],
        "cannot open kernel '/nonexistent/vmlinuz'",
    );
    let k = tmp("k2", b"x");
    let k = k.0.to_str().unwrap();
    one_line_error(
        &["-kernel", k, "-initrd", "/nonexistent/initrd"],
        "cannot open initrd '/nonexistent/initrd'",
    );
    one_line_error(
        &[
            "-kernel",
            k,
            "-drive",
            "file=/nonexistent/disk.img,format=raw,if=virtio",
        ],
        "/nonexistent/disk.img",
    );
}

/// A PVH kernel that prints `ok` on COM1 and then either resets through the i8042 or halts
/// forever with interrupts off.
fn stand_in_kernel(reset: bool) -> Vec<u8> {
    let mut a = Asm::new();
    a.mov_dx(0x3f8);
    for c in b"ok\n" {
        a.mov_al(*c).out_dx_al();
    }
    if reset {
        a.mov_al(0xfe).out_imm_al(0x64);
    }
    a.raw(&[0xfa]).hlt_forever(); // cli; hlt
    build_elf(&a.code, true)
}

#[test]
fn stand_in_kernel_prints_and_resets_with_status_zero() {
    if !kvm_available() {
        return;
    }
    let k = tmp("reset.elf", &stand_in_kernel(true));
    let d = tmp("disk.img", &vec![0u8; 1 << 20]);
    let t = Instant::now();
    let out = run(&[
        "-m",
        "64M",
        "-smp",
        "2",
        "-kernel",
        k.0.to_str().unwrap(),
        "-append",
        "console=ttyS0",
        "-drive",
        &format!("file={},format=raw,if=virtio", d.0.display()),
        "-bounce",
        "policy=force,slots=1024,alloc=areas",
        "-nographic",
        "-serial",
        "stdio",
        "-no-reboot",
        "-accel",
        "kvm",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    eprintln!("bouncevm boot-to-reset: {:?}", t.elapsed());
}

/// A PVH kernel that takes the RSDP from its start info (`rsdp_paddr`), follows it to the
/// FADT and powers off through PM1a_CNT, printing `acpi` first; without an RSDP it prints
/// `fail` and executes `ud2` (no IDT: a triple fault).
fn acpi_poweroff_kernel() -> Vec<u8> {
    let mut a = Asm::new();
    a.raw(&[0x89, 0xdf]); // mov edi, ebx (keep the start info pointer)
    a.mov_dx(0x3f8);
    for c in b"acpi\n" {
        a.mov_al(*c).out_dx_al();
    }
    a.raw(&[0x89, 0xfb]); // mov ebx, edi
    let fail = a.acpi_poweroff(true);
    a.raw(&[0xfa]).hlt_forever();
    a.patch_rel32_here(&fail).mov_dx(0x3f8);
    for c in b"fail\n" {
        a.mov_al(*c).out_dx_al();
    }
    a.raw(&[0x0f, 0x0b]); // ud2
    build_elf(&a.code, true)
}

fn run_logged(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("BOUNCEVM_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .expect("run bouncevm")
}

#[test]
fn guest_acpi_poweroff_ends_bouncevm_with_status_zero() {
    if !kvm_available() {
        return;
    }
    let k = tmp("acpi.elf", &acpi_poweroff_kernel());
    let d = tmp("acpi-disk.img", &vec![0u8; 1 << 20]);
    let drive = format!("file={},format=raw,if=virtio", d.0.display());
    let args = [
        "-m",
        "64M",
        "-smp",
        "2",
        "-kernel",
        k.0.to_str().unwrap(),
        "-drive",
        &drive,
        "-nographic",
        "-no-reboot",
    ];
    let out = run_logged(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "acpi\n",
        "stderr: {err}"
    );
    assert!(err.contains("ACPI S5"), "stderr: {err}");
    assert!(err.contains("PowerOff"), "stderr: {err}");

    // -no-acpi: no RSDP in the start info, the kernel says so and triple-faults.
    let mut no_acpi = args.to_vec();
    no_acpi.push("-no-acpi");
    let out = run_logged(&no_acpi);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "acpi\nfail\n",
        "stderr: {err}"
    );
    assert!(!err.contains("PowerOff"), "stderr: {err}");
}

const QMP_CLIENT: &str = r#"
import json, socket, sys, time
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
for _ in range(200):
    try:
        s.connect(path); break
    except OSError:
        time.sleep(0.05)
f = s.makefile("rw")
def recv():
    return json.loads(f.readline())
def cmd(c, **kw):
    msg = {"execute": c}
    if kw: msg["arguments"] = kw
    msg["id"] = c
    f.write(json.dumps(msg)); f.flush()
    while True:
        r = recv()
        if "event" not in r: return r
out = {"greeting": recv()}
out["early"] = cmd("query-status")
out["caps"] = cmd("qmp_capabilities")
out["status"] = cmd("query-status")
out["block"] = cmd("query-block")
out["bounce"] = cmd("x-query-bounce")
out["bogus"] = cmd("no-such-command")
out["powerdown"] = cmd("system_powerdown")
print(json.dumps(out))
"#;

#[test]
fn qmp_monitor_answers_a_python_client_and_powers_down() {
    if !kvm_available() {
        return;
    }
    if Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .is_err()
    {
        eprintln!("SKIPPED: python3 not available");
        return;
    }
    let k = tmp("hlt.elf", &stand_in_kernel(false));
    let d = tmp("qmp.img", &vec![0u8; 1 << 20]);
    let sock = std::env::temp_dir().join(format!("bvm-qmp-{}.sock", std::process::id()));
    let mut vm = Command::new(BIN)
        .args([
            "-m",
            "64M",
            "-kernel",
            k.0.to_str().unwrap(),
            "-drive",
            &format!(
                "file={},format=raw,if=none,id=disk0,readonly=on",
                d.0.display()
            ),
            "-device",
            "virtio-blk-pci,drive=disk0,id=blk0,serial=s1",
            "-bounce",
            "id=blk0,policy=force,slots=256",
            "-nographic",
            "-no-reboot",
            "-qmp",
            &format!("unix:{},server,nowait", sock.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut py = Command::new("python3")
        .arg("-c")
        .arg(QMP_CLIENT)
        .arg(&sock)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while py.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if py.try_wait().unwrap().is_none() {
        let _ = py.kill();
        let _ = vm.kill();
        panic!("QMP client timed out");
    }
    let py_out = py.wait_with_output().unwrap();
    while vm.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if vm.try_wait().unwrap().is_none() {
        let _ = vm.kill();
        panic!("bouncevm did not exit after system_powerdown");
    }
    let vm_out = vm.wait_with_output().unwrap();
    let _ = std::io::stderr().write_all(&vm_out.stderr);
    assert_eq!(vm_out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&py_out.stdout).expect("client output");
    assert!(v["greeting"]["QMP"]["version"].is_object(), "{v}");
    assert_eq!(v["greeting"]["QMP"]["capabilities"], serde_json::json!([]));
    assert_eq!(v["early"]["error"]["class"], "CommandNotFound");
    assert_eq!(v["caps"]["return"], serde_json::json!({}));
    assert_eq!(v["caps"]["id"], "qmp_capabilities");
    assert_eq!(v["status"]["return"]["status"], "running");
    let blk = &v["block"]["return"][0];
    assert_eq!(blk["device"], "disk0");
    assert_eq!(blk["inserted"]["drv"], "raw");
    assert_eq!(blk["inserted"]["ro"], true);
    assert!(blk["inserted"]["file"]
        .as_str()
        .unwrap()
        .ends_with("qmp.img"));
    let b = &v["bounce"]["return"][0];
    assert_eq!(b["id"], "blk0");
    assert_eq!(b["driver"], "virtio-blk-pci");
    assert_eq!(b["stats"]["policy"], "force");
    assert!(
        b["stats"]["bounce"]["nslabs"].as_u64().unwrap() >= 256,
        "{b}"
    );
    assert_eq!(v["bogus"]["error"]["class"], "CommandNotFound");
    assert!(v["bogus"]["error"]["desc"]
        .as_str()
        .unwrap()
        .contains("no-such-command"));
    assert_eq!(v["powerdown"]["return"], serde_json::json!({}));
    assert_eq!(String::from_utf8_lossy(&vm_out.stdout), "ok\n");
    assert!(!sock.exists(), "socket removed on exit");
}
