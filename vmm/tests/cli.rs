//! The `bouncevm` binary: command-line errors (one line naming the flag or property, exit
//! status 1), and on /dev/kvm a stand-in PVH "kernel" booted through the real command line:
//! serial output on stdout, an i8042 reset ending with status 0 under `-no-reboot`, and the
//! QMP monitor driven by a Python standard-library client.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

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
    run_with_env(args, &[])
}

fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run bouncevm")
}

/// The stand-in kernel's run: it printed `ok` and bouncevm ended with status 0.
fn assert_printed_ok_and_exited_zero(out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
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

/// [`one_line_error`] for `-kernel KERNEL` followed by `args`.
fn refused_with_kernel(kernel: &Tmp, args: &[&str], needle: &str) {
    one_line_error(
        &[&["-kernel", kernel.0.to_str().unwrap()], args].concat(),
        needle,
    );
}

#[test]
fn unsupported_flags_and_properties_are_rejected_by_name() {
    let k = tmp("k", b"x");
    one_line_error(&["-foo"], "unsupported option -foo");
    // Usual QEMU flags with a meaning bouncevm does not have: refused naming the one
    // flag or property that differs.
    refused_with_kernel(&k, &["-machine", "pc"], "type of -machine");
    refused_with_kernel(&k, &["-M", "q35,smm=on"], "smm of -M");
    refused_with_kernel(&k, &["-display", "gtk"], "-display");
    refused_with_kernel(&k, &["-vga", "std"], "-vga");
    refused_with_kernel(&k, &["-monitor", "stdio"], "-monitor");
    refused_with_kernel(&k, &["-cpu", "qemu64"], "-cpu");
    refused_with_kernel(
        &k,
        &["-cpu", "host,-x2apic"],
        "unsupported property '-x2apic' of -cpu host",
    );
    refused_with_kernel(&k, &["-smp", "255"], "1..=254");
    refused_with_kernel(&k, &["-smp", "4,sockets=2,cores=2"], "sockets of -smp");
    refused_with_kernel(&k, &["-smp", "2,threads=2"], "threads of -smp");
    refused_with_kernel(
        &k,
        &["-accel", "kvm,dirty-ring-size=4096"],
        "'dirty-ring-size' of -accel kvm",
    );
    refused_with_kernel(&k, &["-serial", "pty"], "-serial");
    refused_with_kernel(&k, &["-accel", "tcg"], "-accel");
    refused_with_kernel(&k, &["-qmp", "tcp:localhost:4444,server"], "-qmp");
    refused_with_kernel(
        &k,
        &["-qmp", "unix:/tmp/x,server,telnet"],
        "'telnet' of -qmp",
    );
    refused_with_kernel(&k, &["--socket-mode", "0999"], "-socket-mode");
    refused_with_kernel(&k, &["-bounce", "policy=sometimes"], "-bounce");
    refused_with_kernel(&k, &["-bounce", "id=nodev,policy=force"], "id=nodev");
    refused_with_kernel(&k, &["-m", "lots"], "-m");
    refused_with_kernel(&k, &["-smp", "0"], "-smp");
    one_line_error(&["-kernel"], "option -kernel requires an argument");
    one_line_error(&["-m", "64M"], "-kernel");
}

#[test]
fn unsupported_drive_device_and_netdev_properties_are_rejected_by_name() {
    let k = tmp("k-dev", b"x");
    let d = tmp("d-dev.img", &[0u8; 4096]);
    let drive = |props: &str| format!("file={},{props}", d.0.display());
    refused_with_kernel(
        &k,
        &["-drive", &drive("snapshot=on")],
        "unsupported property 'snapshot' of -drive",
    );
    refused_with_kernel(
        &k,
        &["-drive", &drive("cache=off")],
        "unknown cache mode 'off'",
    );
    refused_with_kernel(&k, &["-drive", &drive("if=ide")], "if of -drive");
    refused_with_kernel(&k, &["-drive", &drive("format=vmdk")], "format of -drive");
    let d0 = drive("if=none,id=d0");
    refused_with_kernel(
        &k,
        &[
            "-drive",
            &d0,
            "-device",
            "virtio-blk-pci,drive=d0,discard_granularity=4096",
        ],
        "unsupported property 'discard_granularity' of -device virtio-blk-pci",
    );
    refused_with_kernel(
        &k,
        &[
            "-drive",
            &d0,
            "-device",
            "virtio-blk-pci,drive=d0,disable-legacy=off",
        ],
        "disable-legacy of -device virtio-blk-pci",
    );
    refused_with_kernel(
        &k,
        &[
            "-netdev",
            "tap,id=n0,ifname=t0",
            "-device",
            "virtio-net-pci,netdev=n0,romfile=",
        ],
        "unsupported property 'romfile' of -device virtio-net-pci",
    );
    refused_with_kernel(
        &k,
        &["-netdev", "tap,id=n0,ifname=t0,script=/etc/qemu-ifup"],
        "script of -netdev tap",
    );
    refused_with_kernel(
        &k,
        &[
            "-netdev",
            "tap,id=n0",
            "-device",
            "virtio-net-pci,netdev=n0",
            "-device",
            "virtio-net-pci,netdev=n0,id=n1",
        ],
        "netdev 'n0' is used by more than one device",
    );
    refused_with_kernel(&k, &["-nic", "tap,model=e1000"], "model of -nic tap");
    refused_with_kernel(&k, &["-netdev", "user,id=n0"], "-netdev");
    refused_with_kernel(&k, &["-device", "e1000,netdev=n0"], "'e1000'");
    refused_with_kernel(
        &k,
        &["-device", "virtio-blk-pci,drive=missing"],
        "drive 'missing'",
    );
}

#[test]
fn help_and_version_exit_zero() {
    for flag in ["--help", "-h", "-help"] {
        let out = run(&[flag]);
        assert_eq!(out.status.code(), Some(0), "{flag}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.starts_with("usage: bouncevm"), "{flag}: {text}");
        assert_eq!(text, vmm::cli::USAGE);
    }
    for flag in ["-version", "--version"] {
        let out = run(&[flag]);
        assert_eq!(out.status.code(), Some(0), "{flag}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.starts_with(&format!("bouncevm version {}", env!("CARGO_PKG_VERSION"))),
            "{text}"
        );
    }
}

/// The README's table of accepted flags and `cli::accepted_flags` agree both ways.
#[test]
fn readme_table_lists_exactly_the_accepted_flags() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("vmm/README.md");
    let start = readme
        .find("| flag | accepted |")
        .expect("the command-line table");
    let mut in_table = Vec::new();
    for line in readme[start..].lines().skip(2) {
        if !line.starts_with('|') {
            break;
        }
        let first = line.split('|').nth(1).unwrap_or("");
        // Flags are the backticked words starting with '-' in the first column.
        for (i, part) in first.split('`').enumerate() {
            if i % 2 == 1 {
                if let Some(f) = part
                    .split_whitespace()
                    .next()
                    .filter(|f| f.starts_with('-'))
                {
                    in_table.push(f.trim_start_matches('-').to_string());
                }
            }
        }
    }
    let accepted: Vec<String> = vmm::cli::accepted_flags()
        .iter()
        .map(|f| f.trim_start_matches('-').to_string())
        .collect();
    for (these, those, gap) in [
        (
            &accepted,
            &in_table,
            "is accepted but not in vmm/README.md's table",
        ),
        (
            &in_table,
            &accepted,
            "is in vmm/README.md's table but not accepted",
        ),
    ] {
        for f in these {
            assert!(those.contains(f), "-{f} {gap}");
        }
    }
}

#[test]
fn qcow2_without_format_is_refused_naming_format() {
    let k = tmp("kq", b"x");
    let mut img = b"QFI\xfb".to_vec();
    img.resize(4096, 0);
    let q = tmp("probe.qcow2", &img);
    refused_with_kernel(
        &k,
        &["-drive", &format!("file={}", q.0.display())],
        "give format=qcow2",
    );
}

#[test]
fn missing_files_give_one_clear_line() {
    one_line_error(
        &["-kernel", "/nonexistent/vmlinuz"],
        "cannot open kernel '/nonexistent/vmlinuz'",
    );
    let k = tmp("k2", b"x");
    refused_with_kernel(
        &k,
        &["-initrd", "/nonexistent/initrd"],
        "cannot open initrd '/nonexistent/initrd'",
    );
    refused_with_kernel(
        &k,
        &["-drive", "file=/nonexistent/disk.img,format=raw,if=virtio"],
        "/nonexistent/disk.img",
    );
}

/// Two devices that name one bounce pool with different pool keys: one line naming the pool,
/// both devices and the key, before anything runs.
#[test]
fn a_shared_pool_with_conflicting_keys_is_one_line() {
    if !kvm_available() {
        return;
    }
    let k = tmp("kpool", b"x");
    let d0 = tmp("pool0.img", &[0u8; 4096]);
    let d1 = tmp("pool1.img", &[0u8; 4096]);
    let drive = |id: &str, t: &Tmp| format!("file={},format=raw,if=none,id={id}", t.0.display());
    refused_with_kernel(
        &k,
        &[
            "-drive",
            &drive("d0", &d0),
            "-device",
            "virtio-blk-pci,drive=d0,id=disk0",
            "-drive",
            &drive("d1", &d1),
            "-device",
            "virtio-blk-pci,drive=d1,id=disk1",
            "-bounce",
            "id=disk0,pool=io,slots=1024",
            "-bounce",
            "id=disk1,pool=io,slots=2048",
        ],
        // The line devices/README.md shows.
        "bouncevm: -drive id=d1: bounce: bounce pool 'io': device 'disk1' differs from device \
         'disk0' in slots 2048 against 1024 (every device of one pool gives the same pool keys)",
    );
}

/// Two disks on one shared pool and a third with its own: the final statistics line lists
/// the shared pool once with its two devices, each device with its own `dma` counters, and the
/// third device's pool inside its own statistics.
#[test]
fn final_statistics_list_a_shared_pool_once() {
    if !kvm_available() {
        return;
    }
    let k = tmp("pools.elf", &stand_in_kernel(true));
    let disks: Vec<Tmp> = (0..3)
        .map(|i| tmp(&format!("fin{i}.img"), &[0u8; 4096]))
        .collect();
    let mut args: Vec<String> = ["-m", "64M", "-kernel", k.0.to_str().unwrap(), "-no-reboot"]
        .map(str::to_string)
        .to_vec();
    for (i, d) in disks.iter().enumerate() {
        args.extend([
            "-drive".into(),
            format!("file={},format=raw,if=none,id=d{i}", d.0.display()),
            "-device".into(),
            format!("virtio-blk-pci,drive=d{i},id=disk{i}"),
        ]);
    }
    args.extend(
        [
            "-bounce",
            "pool=shared,slots=1024",
            "-bounce",
            "id=disk2,slots=512",
        ]
        .map(str::to_string),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let last: serde_json::Value = err
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no final statistics line: {err}"));
    let pools = last["pools"].as_array().expect("a pools list");
    assert_eq!(pools.len(), 1, "{last}");
    assert_eq!(pools[0]["pool"], "shared");
    assert_eq!(pools[0]["devices"], serde_json::json!(["disk0", "disk1"]));
    assert_eq!(pools[0]["stats"]["nslabs"], 1024);
    let devices = &last["devices"];
    for i in 0..2 {
        let s = &devices[i]["stats"];
        assert_eq!(s["bounce"], serde_json::json!({"pool": "shared"}), "{s}");
        assert_eq!(s["dma"]["pool"], "shared", "{s}");
    }
    assert_eq!(devices[2]["stats"]["bounce"]["nslabs"], 512, "{last}");
    assert!(devices[2]["stats"]["dma"]["maps"].is_u64(), "{last}");
}

/// `kernel` at `name`.elf and a zeroed 1 MiB disk at `name`.img, or `None` (the skip recorded)
/// when this machine cannot run KVM guests.
fn kvm_kernel_and_disk(name: &str, kernel: &[u8]) -> Option<(Tmp, Tmp)> {
    kvm_available().then(|| {
        (
            tmp(&format!("{name}.elf"), kernel),
            tmp(&format!("{name}.img"), &vec![0u8; 1 << 20]),
        )
    })
}

/// A PVH kernel that prints `ok` on COM1 and then either resets through the i8042 or halts
/// forever with interrupts off.
fn stand_in_kernel(reset: bool) -> Vec<u8> {
    let mut a = Asm::new();
    a.print(b"ok\n");
    if reset {
        a.mov_al(0xfe).out_imm_al(0x64);
    }
    a.raw(&[0xfa]).hlt_forever(); // cli; hlt
    build_elf(&a.code, true)
}

#[test]
fn stand_in_kernel_prints_and_resets_with_status_zero() {
    let Some((k, d)) = kvm_kernel_and_disk("reset", &stand_in_kernel(true)) else {
        return;
    };
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
    assert_printed_ok_and_exited_zero(&out);
    eprintln!("bouncevm boot-to-reset: {:?}", t.elapsed());
}

/// The usual QEMU direct-boot line runs unchanged.
#[test]
fn a_usual_qemu_command_line_boots() {
    let Some((k, d)) = kvm_kernel_and_disk("usual", &stand_in_kernel(true)) else {
        return;
    };
    let out = run(&[
        "-machine",
        "q35,accel=kvm",
        "-cpu",
        "host",
        "-accel",
        "kvm,kernel-irqchip=on",
        "-smp",
        "2,sockets=1,cores=2,threads=1",
        "-m",
        "0.0625G",
        "-display",
        "none",
        "-vga",
        "none",
        "-nodefaults",
        "-monitor",
        "none",
        "-name",
        "usual",
        "-nographic",
        "-serial",
        "mon:stdio",
        "-no-reboot",
        "-kernel",
        k.0.to_str().unwrap(),
        "-append",
        "console=ttyS0",
        "-drive",
        &format!("file={},if=none,id=d0", d.0.display()),
        "-device",
        "virtio-blk-pci,drive=d0,disable-legacy=on,iommu_platform=on",
    ]);
    assert_printed_ok_and_exited_zero(&out);
}

/// A PVH kernel that takes the RSDP from its start info (`rsdp_paddr`), follows it to the
/// FADT and powers off through PM1a_CNT, printing `acpi` first; without an RSDP it prints
/// `fail` and executes `ud2` (no IDT: a triple fault).
fn acpi_poweroff_kernel() -> Vec<u8> {
    let mut a = Asm::new();
    a.mov_rr(EDI, EBX); // keep the start info pointer
    a.print(b"acpi\n");
    a.mov_rr(EBX, EDI);
    let fail = a.acpi_poweroff(true);
    a.raw(&[0xfa]).hlt_forever();
    a.patch_rel32_here(&fail).print(b"fail\n");
    a.raw(&[0x0f, 0x0b]); // ud2
    build_elf(&a.code, true)
}

fn run_logged(args: &[&str]) -> Output {
    run_with_env(args, &[("BOUNCEVM_LOG", "info")])
}

#[test]
fn guest_acpi_poweroff_ends_bouncevm_with_status_zero() {
    let Some((k, d)) = kvm_kernel_and_disk("acpi", &acpi_poweroff_kernel()) else {
        return;
    };
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

/// A PVH kernel that prints `up`, waits for the ACPI power button (polling PM1a_STS, as a
/// fixed-event handler would after the SCI), prints `button` and powers off through the
/// FADT's PM1a_CNT (S5).
fn power_button_kernel() -> Vec<u8> {
    let mut a = Asm::new();
    a.mov_rr(EDI, EBX); // keep the start info pointer
    a.print(b"up\n").wait_power_button().print(b"button\n");
    a.mov_rr(EBX, EDI);
    let fail = a.acpi_poweroff(true);
    a.raw(&[0xfa]).hlt_forever();
    a.patch_rel32_here(&fail).raw(&[0x0f, 0x0b]); // ud2
    build_elf(&a.code, true)
}

const QMP_CLIENT: &str = r#"
import json, os, signal, socket, sys, time
path, mode = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
for _ in range(400):
    try:
        s.connect(path); break
    except OSError:
        time.sleep(0.05)
f = s.makefile("rw")
events = []
def recv():
    return json.loads(f.readline())
def send(raw):
    f.write(raw); f.flush()
    while True:
        r = recv()
        if "event" not in r: return r
        events.append(r)
def cmd(c, **kw):
    msg = {"execute": c, "id": c}
    if kw: msg["arguments"] = kw
    return send(json.dumps(msg))
def until_shutdown():
    while not any(e["event"] == "SHUTDOWN" for e in events):
        line = f.readline()
        if not line: break
        events.append(json.loads(line))
out = {"greeting": recv()}
if mode == "full":
    out["early"] = cmd("query-status")
    out["badcap"] = cmd("qmp_capabilities", enable=["oob"])
out["caps"] = cmd("qmp_capabilities")
if mode == "full":
    for c in ["query-version", "query-commands", "query-name", "query-kvm", "query-cpus-fast",
              "query-status", "query-block", "query-blockstats", "x-query-bounce",
              "x-reset-bounce"]:
        out[c] = cmd(c)
    out["reset-unknown"] = cmd("x-reset-bounce", id="nope")
    out["bogus"] = cmd("no-such-command")
    out["badarg"] = cmd("query-status", verbose=True)
    out["syntax"] = send('{"execute": "query-status"]\n')
    out["after-syntax"] = cmd("query-kvm")
    big = '{"execute": "query-status", "arguments": {"x": "' + "a" * 70000 + '"}}'
    out["big"] = send(big)
    out["after-big"] = cmd("query-kvm")
    out["powerdown"] = cmd("system_powerdown")
elif mode == "signal":
    os.kill(int(sys.argv[3]), signal.SIGTERM)
elif mode == "exit-now":
    out["exit"] = cmd("x-exit-now")
until_shutdown()
out["events"] = events
print(json.dumps(out))
"#;

fn python3_available() -> bool {
    let ok = Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bounce::testing::missing(bounce::testing::Resource::Python3, "python3 not available");
    }
    ok
}

fn qmp_sock(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bvm-qmp-{}-{name}.sock", std::process::id()))
}

/// Starts bouncevm on `kernel` with a read-only drive and `-qmp PATH,server,nowait`.
fn spawn_vm(kernel: &Tmp, disk: &Tmp, sock: &Path, extra: &[&str]) -> std::process::Child {
    spawn_piped(
        Command::new(BIN)
            .args([
                "-m",
                "64M",
                "-name",
                "qmp-test",
                "-kernel",
                kernel.0.to_str().unwrap(),
                "-drive",
                &format!(
                    "file={},format=raw,if=none,id=disk0,readonly=on",
                    disk.0.display()
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
            .args(extra),
    )
}

/// Waits for `child` up to `secs`; kills it and panics on timeout.
fn wait_exit(mut child: std::process::Child, secs: u64, what: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: timed out; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn python_client(sock: &Path, args: &[&str]) -> serde_json::Value {
    let py = Command::new("python3")
        .arg("-c")
        .arg(QMP_CLIENT)
        .arg(sock)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_exit(py, 60, "QMP client");
    serde_json::from_slice(&out.stdout).expect("client output")
}

fn shutdown_of(v: &serde_json::Value) -> serde_json::Value {
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "SHUTDOWN")
        .map(|e| e["data"].clone())
        .unwrap_or_default()
}

/// The python client's session `v`: the greeting, capabilities negotiation and the answers
/// to the query commands and `x-reset-bounce`.
fn assert_query_answers(v: &serde_json::Value) {
    assert!(v["greeting"]["QMP"]["version"]["qemu"].is_object(), "{v}");
    assert_eq!(v["greeting"]["QMP"]["capabilities"], serde_json::json!([]));
    assert_eq!(v["early"]["error"]["class"], "CommandNotFound");
    assert_eq!(v["badcap"]["error"]["class"], "GenericError");
    assert_eq!(v["caps"]["return"], serde_json::json!({}));
    assert_eq!(v["caps"]["id"], "qmp_capabilities");
    assert_eq!(
        v["query-version"]["return"]["package"],
        format!("bouncevm-{}", env!("CARGO_PKG_VERSION"))
    );
    let names: Vec<&str> = v["query-commands"]["return"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"system_powerdown") && names.contains(&"x-exit-now"));
    assert_eq!(v["query-name"]["return"]["name"], "qmp-test");
    assert_eq!(v["query-kvm"]["return"]["enabled"], true);
    let cpu = &v["query-cpus-fast"]["return"][0];
    assert_eq!(cpu["cpu-index"], 0);
    assert!(cpu["thread-id"].as_i64().unwrap() > 0, "{cpu}");
    assert_eq!(v["query-status"]["return"]["status"], "running");
    let blk = &v["query-block"]["return"][0];
    assert_eq!(blk["device"], "disk0");
    assert_eq!(blk["inserted"]["drv"], "raw");
    assert_eq!(blk["inserted"]["ro"], true);
    assert!(blk["inserted"]["file"]
        .as_str()
        .unwrap()
        .ends_with("qmp.img"));
    let bs = &v["query-blockstats"]["return"][0];
    assert_eq!(bs["device"], "disk0");
    assert_eq!(bs["qdev"], "blk0");
    assert!(bs["stats"]["rd_bytes"].is_u64(), "{bs}");
    let b = &v["x-query-bounce"]["return"][0];
    assert_eq!(b["id"], "blk0");
    assert_eq!(b["driver"], "virtio-blk-pci");
    assert_eq!(b["stats"]["policy"], "force");
    assert!(
        b["stats"]["bounce"]["nslabs"].as_u64().unwrap() >= 256,
        "{b}"
    );
    assert_eq!(
        v["x-reset-bounce"]["return"]["reset"],
        serde_json::json!(["blk0"])
    );
    assert_eq!(v["reset-unknown"]["error"]["class"], "DeviceNotFound");
}

/// The python client's session `v`: unknown commands, bad arguments, a syntax error and an
/// oversized command are answered with errors, and the session goes on.
fn assert_error_answers(v: &serde_json::Value) {
    assert_eq!(v["bogus"]["error"]["class"], "CommandNotFound");
    assert!(v["bogus"]["error"]["desc"]
        .as_str()
        .unwrap()
        .contains("no-such-command"));
    assert_eq!(v["badarg"]["error"]["class"], "GenericError");
    assert_eq!(
        v["badarg"]["error"]["desc"],
        "Parameter 'verbose' is unexpected"
    );
    // A syntax error and an oversized command are answered and the session goes on.
    assert_eq!(v["syntax"]["error"]["class"], "GenericError");
    assert_eq!(v["after-syntax"]["return"]["enabled"], true);
    assert_eq!(v["big"]["error"]["class"], "GenericError");
    assert_eq!(v["after-big"]["return"]["enabled"], true);
}

#[test]
fn qmp_monitor_answers_a_python_client_and_powers_down() {
    let Some((k, d)) = kvm_kernel_and_disk("qmp", &power_button_kernel()) else {
        return;
    };
    if !python3_available() {
        return;
    }
    let sock = qmp_sock("full");
    let vm = spawn_vm(&k, &d, &sock, &[]);
    let v = python_client(&sock, &["full"]);
    let vm_out = wait_exit(vm, 30, "bouncevm after system_powerdown");
    let _ = std::io::stderr().write_all(&vm_out.stderr);
    assert_eq!(vm_out.status.code(), Some(0));
    // The guest saw the power button and powered itself off.
    assert_eq!(String::from_utf8_lossy(&vm_out.stdout), "up\nbutton\n");
    assert_query_answers(&v);
    // The final statistics on exit: one JSON line, as x-query-bounce answers them.
    let stderr = String::from_utf8_lossy(&vm_out.stderr);
    let last: serde_json::Value = stderr
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no final statistics line on stderr: {stderr}"));
    let d = &last["devices"][0];
    assert_eq!(d["id"], "blk0", "{last}");
    // ... and the vCPUs' exits: the guest wrote to the serial port and the ACPI registers.
    let vcpus = last["vcpus"].as_array().expect("a vcpus list");
    assert!(!vcpus.is_empty(), "{last}");
    assert!(vcpus[0]["pio_exits"].as_u64().unwrap() > 0, "{last}");
    assert!(vcpus[0]["pio_unhandled"].as_u64().is_some(), "{last}");
    assert_eq!(d["driver"], "virtio-blk-pci");
    assert!(
        d["stats"]["bounce"]["nslabs"].as_u64().unwrap() >= 256,
        "{last}"
    );
    assert_error_answers(&v);
    assert_eq!(v["powerdown"]["return"], serde_json::json!({}));
    let names: Vec<&str> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["POWERDOWN", "SHUTDOWN"], "{v}");
    assert_eq!(
        shutdown_of(&v),
        serde_json::json!({"guest": true, "reason": "guest-shutdown"})
    );
    assert!(!sock.exists(), "socket removed on exit");
}

/// SIGTERM: status 0 and a `host-signal` SHUTDOWN event; `x-exit-now`: `host-qmp-quit`.
#[test]
fn sigterm_and_x_exit_now_end_the_vm_with_qemus_causes() {
    let Some((k, d)) = kvm_kernel_and_disk("sig", &stand_in_kernel(false)) else {
        return;
    };
    if !python3_available() {
        return;
    }
    for (mode, cause) in [("signal", "host-signal"), ("exit-now", "host-qmp-quit")] {
        let sock = qmp_sock(mode);
        let vm = spawn_vm(&k, &d, &sock, &[]);
        let pid = vm.id().to_string();
        let v = python_client(&sock, &[mode, &pid]);
        let out = wait_exit(vm, 30, mode);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
        assert_eq!(
            shutdown_of(&v),
            serde_json::json!({"guest": false, "reason": cause}),
            "{mode}: {v}"
        );
        assert!(!sock.exists(), "{mode}: socket removed on exit");
    }
}

/// The QMP socket is 0600; a second VMM does not unlink it while the first serves it; a
/// client that connects and sends nothing does not delay the exit on SIGTERM.
#[test]
fn qmp_socket_is_private_kept_while_live_and_a_silent_client_does_not_block_exit() {
    let Some((k, d)) = kvm_kernel_and_disk("silent", &stand_in_kernel(false)) else {
        return;
    };
    use std::os::unix::fs::PermissionsExt;
    let sock = qmp_sock("silent");
    let vm = spawn_vm(&k, &d, &sock, &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let silent = loop {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&sock) {
            break s;
        }
        assert!(Instant::now() < deadline, "QMP socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A second bouncevm on the same path is refused and leaves the socket alone.
    let other = run(&[
        "-m",
        "64M",
        "-kernel",
        k.0.to_str().unwrap(),
        "-qmp",
        &format!("unix:{},server,nowait", sock.display()),
    ]);
    let err = String::from_utf8_lossy(&other.stderr);
    assert_eq!(other.status.code(), Some(1), "{err}");
    assert!(err.contains("in use by a running process"), "{err}");
    assert!(sock.exists());
    // SIGTERM with the silent client still connected.
    // SAFETY: kill() on our own child's pid has no memory effects.
    #[allow(clippy::undocumented_unsafe_blocks)]
    let rc = unsafe { libc::kill(vm.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let out = wait_exit(vm, 15, "bouncevm with a silent QMP client");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(silent);
    assert!(!sock.exists());
    // --socket-mode widens it.
    let sock2 = qmp_sock("mode");
    let vm = spawn_vm(&k, &d, &sock2, &["--socket-mode", "0660"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock2.exists() {
        assert!(Instant::now() < deadline, "QMP socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mode = std::fs::metadata(&sock2).unwrap().permissions().mode() & 0o777;
    // SAFETY: as above.
    #[allow(clippy::undocumented_unsafe_blocks)]
    unsafe {
        libc::kill(vm.id() as libc::pid_t, libc::SIGTERM)
    };
    let out = wait_exit(vm, 15, "bouncevm --socket-mode");
    assert_eq!(mode, 0o660);
    assert_eq!(out.status.code(), Some(0));
}

const PTY_RUNNER: &str = r#"
import json, pty, signal, subprocess, sys, termios, time
m, s = pty.openpty()
before = termios.tcgetattr(s)
p = subprocess.Popen(sys.argv[1:], stdin=s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
raw = False
deadline = time.time() + 20
while time.time() < deadline and p.poll() is None:
    if not (termios.tcgetattr(s)[3] & termios.ECHO):
        raw = True
        break
    time.sleep(0.02)
p.send_signal(signal.SIGTERM)
rc = p.wait(timeout=20)
print(json.dumps({"raw": raw, "rc": rc, "restored": termios.tcgetattr(s) == before,
                  "stderr": p.stderr.read().decode(errors="replace")}))
"#;

/// SIGTERM with stdin on a terminal: the console was in raw mode while the VM ran, and the
/// terminal's attributes are restored exactly on exit (status 0).
#[test]
fn sigterm_restores_the_terminal() {
    if !kvm_available() || !python3_available() {
        return;
    }
    let k = tmp("tty.elf", &stand_in_kernel(false));
    let out = Command::new("python3")
        .arg("-c")
        .arg(PTY_RUNNER)
        .args([
            BIN,
            "-m",
            "64M",
            "-kernel",
            k.0.to_str().unwrap(),
            "-nographic",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(v["raw"], true, "{v}");
    assert_eq!(v["rc"], 0, "{v}");
    assert_eq!(v["restored"], true, "{v}");
}
