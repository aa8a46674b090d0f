//! `bouncevm-vhost` as a user runs it: errors are one line with a non-zero status; the server
//! answers statistics, survives reconnections and stops cleanly on signals.

mod vhost_support;

use bounce::testing::wait_for_path;
use devices::virtio::spec::{feature, VIRTIO_F_ACCESS_PLATFORM};
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bouncevm-vhost");

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bouncevm-vhost-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn image(name: &str) -> PathBuf {
    let p = tmp(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    p
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn assert_one_line_error(out: &Output, needle: &str) {
    assert!(!out.status.success(), "expected failure");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("bouncevm-vhost: error: "), "{err}");
    assert!(lines[0].contains(needle), "'{needle}' not in: {err}");
}

/// A running server, killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `blk --socket SOCK --file FILE` followed by `extra`.
fn blk_args<'a>(sock: &'a str, file: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["blk", "--socket", sock, "--file", file];
    a.extend_from_slice(extra);
    a
}

fn spawn(args: &[&str]) -> Running {
    Running(
        Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill() on our own child's pid has no memory effects.
    #[allow(clippy::undocumented_unsafe_blocks)]
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0);
}

fn stats(path: &Path) -> serde_json::Value {
    let mut s = UnixStream::connect(path).unwrap();
    let mut line = String::new();
    s.read_to_string(&mut line).unwrap();
    assert!(line.ends_with('\n'));
    serde_json::from_str(line.trim()).unwrap()
}

#[test]
fn bad_flags_are_one_line() {
    assert_one_line_error(&run(&["blk", "--socket", "/tmp/x"]), "--file");
    assert_one_line_error(&run(&["frob"]), "frob");
    assert_one_line_error(
        &run(&[
            "blk", "--socket", "/tmp/x", "--file", "/x", "--format", "vmdk",
        ]),
        "vmdk",
    );
    assert_one_line_error(
        &run(&[
            "blk",
            "--socket",
            "/tmp/x",
            "--file",
            "/x",
            "--bounce",
            "alloc=best",
        ]),
        "unknown allocator",
    );
    assert_one_line_error(
        &run(&["net", "--socket", "/tmp/x", "--tap", "t0", "--mac", "zz"]),
        "MAC",
    );
    // 32 pairs are 65 vrings: more than vhost-user's 64 (refused before the tap is touched).
    assert_one_line_error(
        &run(&["net", "--socket", "/tmp/x", "--tap", "t0", "--queues", "32"]),
        "--queues 32: net serves 1..=31 queue pairs",
    );
    assert!(run(&["--help"]).status.success());
}

#[test]
fn a_missing_image_is_one_line() {
    let sock = tmp("missing.sock");
    let out = run(&blk_args(
        sock.to_str().unwrap(),
        "/nonexistent/disk.img",
        &[],
    ));
    assert_one_line_error(&out, "cannot open image '/nonexistent/disk.img'");
    assert!(!sock.exists());
}

#[test]
fn an_occupied_socket_is_refused_and_a_stale_one_replaced() {
    let img = image("occupied.img");
    let sock = tmp("occupied.sock");
    let _ = std::fs::remove_file(&sock);
    let args = [
        "blk",
        "--socket",
        sock.to_str().unwrap(),
        "--file",
        img.to_str().unwrap(),
    ];
    let first = spawn(&args);
    wait_for_path(&sock);
    assert_one_line_error(&run(&args), "in use");
    drop(first); // SIGKILL: leaves a stale socket file behind
    assert!(sock.exists());
    let _second = spawn(&args);
    // The new server answers on the replaced socket (a handshake needs a live backend).
    let mut d = vhost_support::Driver::connect(&sock, 1);
    assert!(
        d.handshake().is_ok(),
        "the stale socket was not replaced by a serving one"
    );
}

#[test]
fn stats_socket_sigusr1_reconnect_and_sigterm() {
    let img = image("stats.img");
    let sock = tmp("stats.sock");
    let stats_sock = tmp("stats.stats");
    let mut server = spawn(&blk_args(
        sock.to_str().unwrap(),
        img.to_str().unwrap(),
        &[
            "--bounce",
            "policy=force,slots=1024,alloc=bitmap",
            "--stats-socket",
            stats_sock.to_str().unwrap(),
        ],
    ));
    wait_for_path(&stats_sock);
    let s = stats(&stats_sock);
    assert_eq!(s["bounce"]["allocator"], "bitmap");
    assert_eq!(s["bounce"]["nslabs"], 1024);
    assert_eq!(s["device"]["type"], "block");
    // Two frontends one after the other: each negotiates; the device is reset between them.
    for _ in 0..2 {
        let mut d = vhost_support::Driver::connect(&sock, 1);
        let offered = d.handshake().unwrap();
        assert_ne!(offered & feature(VIRTIO_F_ACCESS_PLATFORM), 0);
        drop(d);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while stats(&stats_sock)["server"]["connections"] != 2
        || stats(&stats_sock)["server"]["connected"] != false
    {
        assert!(Instant::now() < deadline, "second connection not seen");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&server.0, libc::SIGUSR1);
    // Wait (bounded) for SIGUSR1's statistics line before stopping, instead of sleeping.
    let (rx, reader) = stderr_lines(&mut server.0);
    let mut err = String::new();
    wait_json_lines(&rx, 1, &mut err);
    let (err, json_lines) = terminate(&mut server.0, &rx, reader, err);
    assert_eq!(
        json_lines.len(),
        2,
        "SIGUSR1 and final statistics expected: {err}"
    );
    assert_eq!(json_lines[1]["server"]["connections"], 2);
    assert!(
        !sock.exists() && !stats_sock.exists(),
        "sockets removed at exit"
    );
}

#[test]
fn no_access_platform_is_honoured() {
    let img = image("noap.img");
    let sock = tmp("noap.sock");
    let _server = spawn(&blk_args(
        sock.to_str().unwrap(),
        img.to_str().unwrap(),
        &["--no-access-platform"],
    ));
    let mut d = vhost_support::Driver::connect(&sock, 1);
    let offered = d.handshake().unwrap();
    assert_eq!(offered & feature(VIRTIO_F_ACCESS_PLATFORM), 0);
}

/// --pidfile appears once the sockets accept connections and goes on exit; both sockets are
/// 0600 unless --socket-mode says otherwise.
#[test]
fn pidfile_and_socket_modes() {
    use std::os::unix::fs::PermissionsExt;
    let img = image("pid.img");
    let sock = tmp("pid.sock");
    let stats_sock = tmp("pid.stats");
    let pidfile = tmp("bvm.pid");
    for p in [&sock, &stats_sock, &pidfile] {
        let _ = std::fs::remove_file(p);
    }
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    // The server with its statistics socket and `flag value`.
    let start = |flag: &str, value: &str| {
        spawn(&blk_args(
            sock.to_str().unwrap(),
            img.to_str().unwrap(),
            &["--stats-socket", stats_sock.to_str().unwrap(), flag, value],
        ))
    };
    let mut server = start("--pidfile", pidfile.to_str().unwrap());
    wait_for_path(&pidfile);
    // Written after the bind: the sockets are there and answer.
    assert!(UnixStream::connect(&sock).is_ok());
    assert!(stats(&stats_sock)["server"].is_object());
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(pid, server.0.id());
    assert_eq!((mode(&sock), mode(&stats_sock)), (0o600, 0o600));
    signal(&server.0, libc::SIGTERM);
    assert!(server.0.wait().unwrap().success());
    assert!(!pidfile.exists(), "pid file removed on exit");

    let mut server = start("--socket-mode", "0660");
    wait_for_path(&stats_sock);
    assert_eq!((mode(&sock), mode(&stats_sock)), (0o660, 0o660));
    signal(&server.0, libc::SIGTERM);
    assert!(server.0.wait().unwrap().success());
}

#[test]
fn new_flags_are_checked_and_qcow2_needs_format() {
    let img = image("flags.img");
    let i = img.to_str().unwrap();
    let blk = |extra: &[&str]| {
        let mut a = vec!["blk", "--socket", "/tmp/bvm-never.sock", "--file", i];
        a.extend_from_slice(extra);
        run(&a)
    };
    assert_one_line_error(&blk(&["--queue-size", "100"]), "power of two");
    assert_one_line_error(&blk(&["--logical-block-size", "256"]), "power of two");
    assert_one_line_error(&blk(&["--socket-mode", "0999"]), "octal");
    assert_one_line_error(&blk(&["--queues", "0"]), "--queues");
    assert_one_line_error(&blk(&["--queues", "65"]), "--queues");
    let mut q = b"QFI\xfb".to_vec();
    q.resize(1 << 20, 0);
    let qcow = tmp("probe.qcow2");
    std::fs::write(&qcow, &q).unwrap();
    let out = run(&blk_args(
        tmp("probe.sock").to_str().unwrap(),
        qcow.to_str().unwrap(),
        &[],
    ));
    assert_one_line_error(&out, "give format=qcow2");
    // The net help names the QEMU devices that exist and documents --mac for what it is; the
    // blk help lists these flags.
    let net: &[&str] = &[
        "-netdev",
        "vhost-user",
        "virtio-net-pci",
        "does not read it",
    ];
    let blk: &[&str] = &[
        "--queue-size",
        "--logical-block-size",
        "--pidfile",
        "--socket-mode",
    ];
    for (sub, wanted) in [("net", net), ("blk", blk)] {
        let help = String::from_utf8(run(&[sub, "--help"]).stdout).unwrap();
        for w in wanted {
            assert!(help.contains(w), "{w} missing from {sub} --help:\n{help}");
        }
    }
}

/// The child's stderr, line by line, from a reader thread.
fn stderr_lines(
    child: &mut std::process::Child,
) -> (
    std::sync::mpsc::Receiver<String>,
    std::thread::JoinHandle<()>,
) {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)) {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (rx, reader)
}

/// Appends lines from `rx` to `err` until it holds `n` JSON lines (10 s per line at most).
fn wait_json_lines(rx: &std::sync::mpsc::Receiver<String>, n: usize, err: &mut String) {
    while err.lines().filter(|l| l.starts_with('{')).count() < n {
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{n} statistics lines awaited ({e}): {err}"));
        err.push_str(&line);
        err.push('\n');
    }
}

/// Stops `child` with SIGTERM and asserts a clean exit; returns its stderr (`err`, read so
/// far, and the rest) and the statistics (JSON) lines in it.
fn terminate(
    child: &mut Child,
    rx: &std::sync::mpsc::Receiver<String>,
    reader: std::thread::JoinHandle<()>,
    mut err: String,
) -> (String, Vec<serde_json::Value>) {
    signal(child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}: {err}");
    reader.join().unwrap();
    err.extend(rx.try_iter().map(|l| l + "\n"));
    let json_lines = err
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (err, json_lines)
}

/// Two block devices in one process (`--also`) on one shared bounce pool: both serve I/O, each
/// server's statistics carry its device's own counters and the shared pool under `pools`, and
/// the devices' counts sum to the pool's; SIGUSR1 to the process prints a line per device, and
/// SIGTERM stops both servers (a final line each). A second device that names the pool with other pool keys is one line.
#[test]
fn two_devices_in_one_process_share_a_bounce_pool() {
    let (img0, img1) = (image("shared0.img"), image("shared1.img"));
    let (s0, s1) = (tmp("shared0.sock"), tmp("shared1.sock"));
    let (st0, st1) = (tmp("shared0.stats"), tmp("shared1.stats"));
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let device = |sock: &PathBuf, img: &PathBuf, stats: &PathBuf, bounce: &str| {
        [
            "blk",
            "--socket",
            &p(sock),
            "--file",
            &p(img),
            "--queues",
            "1",
            "--bounce",
            bounce,
            "--stats-socket",
            &p(stats),
        ]
        .map(str::to_string)
        .to_vec()
    };
    let bounce = "policy=force,slots=1024,pool=shared";
    let conflicting = [
        device(&s0, &img0, &st0, bounce),
        vec!["--also".into()],
        device(&s1, &img1, &st1, "slots=2048,pool=shared"),
    ]
    .concat();
    let args: Vec<&str> = conflicting.iter().map(String::as_str).collect();
    assert_one_line_error(
        &run(&args),
        &format!(
            "device '{}' differs from device '{}' in slots 2048 against 1024",
            p(&s1),
            p(&s0)
        ),
    );
    let both = [
        device(&s0, &img0, &st0, bounce),
        vec!["--also".into()],
        device(&s1, &img1, &st1, bounce),
    ]
    .concat();
    let args: Vec<&str> = both.iter().map(String::as_str).collect();
    let mut server = spawn(&args);
    wait_for_path(&st1);
    vhost_support::assert_blk_served(&s0, 3);
    vhost_support::assert_blk_served(&s1, 5);
    vhost_support::assert_blk_served(&s1, 6);
    let (a, b) = (stats(&st0), stats(&st1));
    let dma = |s: &serde_json::Value, k: &str| s["device"]["dma"][k].as_u64().unwrap();
    assert!(
        dma(&a, "maps") > 0 && dma(&b, "maps") > dma(&a, "maps"),
        "{a} {b}"
    );
    assert_eq!(a["device"]["dma"]["pool"], "shared");
    assert_eq!(a["bounce"], serde_json::json!({"pool": "shared"}));
    assert_eq!(b["device"]["bounce"], serde_json::json!({"pool": "shared"}));
    let pools = &b["pools"];
    assert_eq!(pools.as_array().map(Vec::len), Some(1), "{b}");
    assert_eq!(pools[0]["devices"], serde_json::json!([p(&s0), p(&s1)]));
    for k in ["maps", "map_failures", "unmaps"] {
        assert_eq!(
            pools[0]["stats"][k].as_u64(),
            Some(dma(&a, k) + dma(&b, k)),
            "{k}: {pools} {a} {b}"
        );
    }
    let (rx, reader) = stderr_lines(&mut server.0);
    let mut err = String::new();
    signal(&server.0, libc::SIGUSR1);
    wait_json_lines(&rx, 2, &mut err);
    let (err, lines) = terminate(&mut server.0, &rx, reader, err);
    assert_eq!(
        lines.len(),
        4,
        "two SIGUSR1 lines and two final ones: {err}"
    );
    let mut want = [p(&s0), p(&s1)];
    want.sort_unstable();
    for (what, pair) in [("SIGUSR1", &lines[..2]), ("final", &lines[2..])] {
        let mut sockets: Vec<&str> = pair
            .iter()
            .map(|f| f["server"]["socket"].as_str().unwrap())
            .collect();
        sockets.sort_unstable();
        assert_eq!(sockets, want, "{what} lines");
    }
}
