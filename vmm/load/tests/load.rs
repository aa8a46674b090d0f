//! `bouncevm-load` against real back ends (ours and qemu-storage-daemon) and against
//! misbehaving ones: verify at depth, ACCESS_PLATFORM, a back end that disconnects mid-run,
//! one that never completes, one that names heads it was not given, one that loses writes,
//! and bad arguments. Nothing here measures speed: every run is a fixed amount of I/O.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread;
use std::time::{Duration, Instant};

use bounce::testing::{wait_for_path, workspace_bin};
use bouncevm_load::{Error, LoadConfig, Rw};
use bouncevm_vhost::{Memory, Server};
use devices::block::request::{RequestHeader, RequestType};
use devices::block::REQ_HEADER_LEN;
use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1,
    VIRTIO_ID_BLOCK, VIRTIO_RING_F_EVENT_IDX,
};
use devices::virtio::{
    read_config_window, ActivateError, Handled, QueueWorker, Queues, Signal, VirtioDevice,
    WorkerError, WorkerEvent,
};
use serde_json::Value;
use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;

const LOAD: &str = env!("CARGO_BIN_EXE_bouncevm-load");
/// Another package's binary (see `bounce::testing::workspace_bin`).
static VHOST: LazyLock<String> =
    LazyLock::new(|| workspace_bin("bouncevm-vhost").display().to_string());

fn dir() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "bouncevm-load-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn image(dir: &Path, mib: u64) -> PathBuf {
    let p = dir.join("disk.img");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    p
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn ours(dir: &Path, img: &Path, queues: u16) -> (Proc, PathBuf, PathBuf) {
    let sock = dir.join("ours.sock");
    let stats = dir.join("ours.stats");
    let child = Command::new(VHOST.as_str())
        .args(["blk", "--socket"])
        .arg(&sock)
        .arg("--file")
        .arg(img)
        .args(["--queues", &queues.to_string(), "--stats-socket"])
        .arg(&stats)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let p = Proc(child);
    wait_for_path(&sock);
    wait_for_path(&stats);
    (p, sock, stats)
}

fn qsd(dir: &Path, img: &Path, queues: u16) -> (Proc, PathBuf) {
    let sock = dir.join("qsd.sock");
    let child = Command::new("qemu-storage-daemon")
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f0,filename={},cache.direct=on,aio=io_uring",
            img.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on,num-queues={queues}",
            sock.display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-storage-daemon must be on PATH (tests/setup.sh installs qemu-utils)");
    let p = Proc(child);
    wait_for_path(&sock);
    (p, sock)
}

fn load(args: &[&str]) -> Output {
    Command::new(LOAD).args(args).output().unwrap()
}

fn json_run(sock: &Path, args: &[&str]) -> Value {
    let mut all = vec!["--socket", sock.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let out = load(&all);
    assert!(
        out.status.success(),
        "bouncevm-load {all:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// randrw with --verify at depth 32 on two queues, one pass: every block is prefilled, half
/// the pass reads and checks, the rest rewrites, and everything is read back at the end.
fn verify_at_depth(sock: &Path) -> Value {
    let r = json_run(
        sock,
        &[
            "--rw",
            "randrw",
            "--verify",
            "--iodepth",
            "32",
            "--numjobs",
            "2",
            "--size",
            "8m",
        ],
    );
    let blocks_per_job = (8u64 << 20) / 4096 / 2;
    assert_eq!(r["jobs"].as_array().unwrap().len(), 2);
    for j in r["jobs"].as_array().unwrap() {
        let v = &j["verify"];
        assert_eq!(v["prefilled"], blocks_per_job, "{j}");
        assert_eq!(v["checked"], blocks_per_job, "{j}");
        assert_eq!(v["unwritten"], 0);
        assert!(v["verified_reads"].as_u64().unwrap() > 0, "{j}");
        let ios = j["read"]["ios"].as_u64().unwrap() + j["write"]["ios"].as_u64().unwrap();
        assert_eq!(ios, blocks_per_job);
    }
    r
}

#[test]
fn verify_at_depth_against_our_backend() {
    let d = dir();
    let img = image(&d, 16);
    let (_b, sock, stats) = ours(&d, &img, 2);
    let r = verify_at_depth(&sock);
    assert_eq!(r["device"]["queues"], 2);
    // Sequential writes then a write-only random pass; blocks never rewritten are reported.
    let r = json_run(
        &sock,
        &[
            "--rw",
            "write",
            "--verify",
            "--iodepth",
            "8",
            "--size",
            "1m",
        ],
    );
    assert_eq!(r["jobs"][0]["verify"]["checked"], 256);
    assert_eq!(r["jobs"][0]["verify"]["prefilled"], 0);
    // The back end saw requests of both kinds on both queues.
    let mut s = String::new();
    UnixStream::connect(&stats)
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    let v: Value = serde_json::from_str(&s).unwrap();
    let m = &v["device"]["metrics"];
    assert!(m["reqs_in"].as_u64().unwrap() > 0 && m["reqs_out"].as_u64().unwrap() > 0);
}

#[test]
fn verify_at_depth_against_qemu_storage_daemon() {
    let d = dir();
    let img = image(&d, 16);
    let (_b, sock) = qsd(&d, &img, 2);
    verify_at_depth(&sock);
    // Without EVENT_IDX and indirect descriptors: 3 descriptors per request, queue of 128.
    let r = json_run(
        &sock,
        &[
            "--rw",
            "randread",
            "--iodepth",
            "32",
            "--size",
            "4m",
            "--no-event-idx",
            "--no-indirect",
        ],
    );
    assert_eq!(r["queue_size"], 128);
    assert_eq!(r["event_idx"], false);
    assert_eq!(r["total"]["read"]["ios"], 1024);
}

#[test]
fn access_platform_is_negotiated_when_offered_and_refused_otherwise() {
    let d = dir();
    let img = image(&d, 4);
    let (_b, sock, _) = ours(&d, &img, 1);
    let r = json_run(
        &sock,
        &["--access-platform", "--size", "1m", "--iodepth", "4"],
    );
    let acked = r["device"]["acked"].as_u64().unwrap();
    assert_ne!(acked & feature(VIRTIO_F_ACCESS_PLATFORM), 0);
    let (_q, qsock) = qsd(&d, &img, 1);
    let out = load(&["--socket", qsock.to_str().unwrap(), "--access-platform"]);
    assert!(!out.status.success());
    let err = one_line(&out);
    assert!(err.contains("ACCESS_PLATFORM"), "{err}");
}

fn one_line(out: &Output) -> String {
    let s = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(s.lines().count(), 1, "stderr is not one line: {s:?}");
    assert!(s.starts_with("bouncevm-load: error: "), "{s:?}");
    assert!(out.stdout.is_empty());
    s
}

fn stats_reads(stats: &Path) -> u64 {
    let Ok(mut c) = UnixStream::connect(stats) else {
        return 0;
    };
    let mut s = String::new();
    let _ = c.read_to_string(&mut s);
    serde_json::from_str::<Value>(&s)
        .ok()
        .and_then(|v| v["device"]["metrics"]["reqs_in"].as_u64())
        .unwrap_or(0)
}

#[test]
fn a_backend_killed_mid_run_gives_one_line_and_a_failure() {
    let d = dir();
    let img = image(&d, 4);
    let (mut b, sock, stats) = ours(&d, &img, 1);
    let mut child = Command::new(LOAD)
        .args([
            "--socket",
            sock.to_str().unwrap(),
            "--iodepth",
            "8",
            "--runtime",
            "120",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the back end once I/O is flowing.
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats_reads(&stats) < 100 {
        assert!(Instant::now() < deadline, "no I/O reached the back end");
        thread::sleep(Duration::from_millis(20));
    }
    b.0.kill().unwrap();
    let _ = b.0.wait();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("bouncevm-load did not exit after its back end died");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(!status.success());
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.contains("disconnected"), "{err}");
}

#[test]
fn bad_arguments_give_one_line_and_a_failure() {
    let d = dir();
    let missing = d.join("missing.sock");
    let m = missing.to_str().unwrap();
    for (args, word) in [
        (vec!["--socket", m, "--bs", "1000"], "--bs"),
        (vec!["--socket", m, "--bs", "lots"], "lots"),
        (vec!["--socket", m, "--iodepth", "0"], "--iodepth"),
        (vec!["--socket", m, "--iodepth=-3"], "iodepth"),
        (vec!["--socket", m, "--numjobs", "65"], "--numjobs"),
        (vec!["--socket", m, "--rw", "sideways"], "sideways"),
        (vec!["--socket", m, "--rwmixread", "70"], "randrw"),
        (vec!["--socket", m, "--runtime", "0"], "--runtime"),
        (vec!["--socket", m, "--queue-size", "100"], "--queue-size"),
        (vec!["--socket", m, "--timeout=-1"], "--timeout"),
        (vec!["--rw", "read"], "--socket"),
        (vec!["--socket", m, "--timeout", "0.2"], "cannot connect"),
    ] {
        let out = load(&args);
        assert!(!out.status.success(), "{args:?}");
        let err = one_line(&out);
        assert!(err.contains(word), "{args:?}: {err}");
    }
    // A socket that is not a vhost-user back end (it never answers) times out.
    let not_vhost = d.join("mute.sock");
    let listener = std::os::unix::net::UnixListener::bind(&not_vhost).unwrap();
    let keep = thread::spawn(move || listener.accept().map(|(s, _)| s));
    let t = Instant::now();
    let out = load(&["--socket", not_vhost.to_str().unwrap(), "--timeout", "0.5"]);
    assert!(t.elapsed() < Duration::from_secs(10));
    let err = one_line(&out);
    assert!(err.contains("GET_FEATURES: no answer"), "{err}");
    drop(keep);
    // The device is smaller than --size.
    let img = image(&d, 1);
    let (_b, sock, _) = ours(&d, &img, 1);
    let out = load(&["--socket", sock.to_str().unwrap(), "--size", "2m"]);
    let err = one_line(&out);
    assert!(err.contains("larger than the device"), "{err}");
    let out = load(&["--socket", sock.to_str().unwrap(), "--numjobs", "2"]);
    let err = one_line(&out);
    assert!(err.contains("queues"), "{err}");
}

/// How the fake block device misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Serves reads and writes correctly (a control: the same device without a fault passes).
    None,
    /// Takes requests and never completes them.
    Silent,
    /// Completes with a head index it was never given.
    WrongHead,
    /// Completes without writing the status byte.
    NoStatus,
    /// Completes every request with IOERR.
    IoErr,
    /// Acknowledges writes without storing them.
    LoseWrites,
}

const FAKE_SECTORS: u64 = 2048; // 1 MiB

#[derive(Debug)]
struct FakeBlk {
    fault: Fault,
    disk: Arc<std::sync::Mutex<Vec<u8>>>,
    active: bool,
}

impl VirtioDevice<Memory> for FakeBlk {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }
    fn num_queues(&self) -> usize {
        1
    }
    fn queue_max_size(&self) -> u16 {
        256
    }
    fn avail_features(&self) -> u64 {
        feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX)
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut c = [0u8; 60];
        c[0..8].copy_from_slice(&FAKE_SECTORS.to_le_bytes());
        read_config_window(&c, offset, data);
    }
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    fn activate(
        &mut self,
        _acked: u64,
    ) -> Result<Vec<Box<dyn QueueWorker<Memory>>>, ActivateError> {
        if self.active {
            return Err(ActivateError::AlreadyActive);
        }
        self.active = true;
        Ok(vec![Box::new(FakeWorker {
            fault: self.fault,
            disk: self.disk.clone(),
        })])
    }
    fn reset(&mut self) {
        self.active = false;
    }
    fn stats(&self) -> Value {
        Value::Null
    }
}

struct FakeWorker {
    fault: Fault,
    disk: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl FakeWorker {
    fn serve(&self, mem: &Memory, q: &mut Queue) -> Result<bool, WorkerError> {
        let broken = |e: String| WorkerError::Broken(e);
        let mut used = false;
        loop {
            q.disable_notification(mem)
                .map_err(|e| broken(e.to_string()))?;
            while let Some(chain) = q.pop_descriptor_chain(mem) {
                if self.fault == Fault::Silent {
                    continue;
                }
                let head = chain.head_index();
                let descs: Vec<_> = chain.collect();
                let (Some(h), Some(st)) = (descs.first(), descs.last()) else {
                    return Err(broken("empty chain".into()));
                };
                let mut hdr = [0u8; REQ_HEADER_LEN];
                mem.read_slice(&mut hdr, h.addr())
                    .map_err(|e| broken(e.to_string()))?;
                let hdr = RequestHeader::parse(&hdr);
                let mut at = usize::try_from(hdr.sector * 512).unwrap();
                let mut disk = self.disk.lock().unwrap();
                for d in &descs[1..descs.len() - 1] {
                    let len = d.len() as usize;
                    let range = at..at + len;
                    if hdr.kind == RequestType::In {
                        mem.write_slice(&disk[range], d.addr())
                            .map_err(|e| broken(e.to_string()))?;
                    } else if self.fault != Fault::LoseWrites {
                        mem.read_slice(&mut disk[range], d.addr())
                            .map_err(|e| broken(e.to_string()))?;
                    }
                    at += len;
                }
                let s = if self.fault == Fault::IoErr {
                    VIRTIO_BLK_S_IOERR
                } else {
                    VIRTIO_BLK_S_OK
                };
                if self.fault != Fault::NoStatus {
                    mem.write_obj(s, st.addr())
                        .map_err(|e| broken(e.to_string()))?;
                }
                let id = if self.fault == Fault::WrongHead {
                    head.wrapping_add(1) % q.size()
                } else {
                    head
                };
                q.add_used(mem, id, 1).map_err(|e| broken(e.to_string()))?;
                used = true;
            }
            if !q
                .enable_notification(mem)
                .map_err(|e| broken(e.to_string()))?
            {
                break;
            }
        }
        Ok(used
            && q.needs_notification(mem)
                .map_err(|e| broken(e.to_string()))?)
    }
}

impl QueueWorker<Memory> for FakeWorker {
    fn queue_indexes(&self) -> Vec<u16> {
        vec![0]
    }
    fn handle(&mut self, event: WorkerEvent, mem: &Memory, queues: Queues<'_, '_>) -> Handled {
        let mut signal = Signal::NONE;
        if let WorkerEvent::Kick(i) = event {
            let q = queues
                .get_mut(i)
                .ok_or(WorkerError::UnexpectedEvent(event))?;
            if self.serve(mem, q)? {
                signal.add(i);
            }
        }
        Ok(signal)
    }
}

/// Runs `cfg` against a fake device with `fault`, bounded in time.
fn against_fake(
    fault: Fault,
    cfg: impl FnOnce(PathBuf) -> LoadConfig,
) -> bouncevm_load::Result<bouncevm_load::Report> {
    let d = dir();
    let sock = d.join("fake.sock");
    let device = FakeBlk {
        fault,
        disk: Arc::new(std::sync::Mutex::new(vec![
            0u8;
            (FAKE_SECTORS * 512) as usize
        ])),
        active: false,
    };
    let mut server = Server::bind("fake-blk", device, &sock).unwrap();
    let stop = server.stop_handle().unwrap();
    let t = thread::spawn(move || {
        let _ = server.run();
    });
    let started = Instant::now();
    let r = bouncevm_load::run(&cfg(sock));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{fault:?} took too long"
    );
    stop.stop();
    let _ = t.join();
    r
}

fn verifying(sock: PathBuf) -> LoadConfig {
    LoadConfig {
        rw: Rw::RandRw,
        verify: true,
        iodepth: 16,
        timeout: Duration::from_secs(1),
        ..LoadConfig::new(sock)
    }
}

#[test]
fn a_faithful_fake_device_passes_verify() {
    let r = against_fake(Fault::None, verifying).unwrap();
    let v = r.jobs[0].verify.unwrap();
    assert_eq!((v.prefilled, v.checked), (256, 256));
}

#[test]
fn a_backend_that_loses_writes_fails_verify() {
    let e = against_fake(Fault::LoseWrites, verifying).unwrap_err();
    assert!(matches!(e, Error::Verify { .. }), "{e}");
    // Zeroes were never written by this run.
    assert!(e.to_string().contains("not written by this run"), "{e}");
}

#[test]
fn a_backend_that_never_completes_times_out() {
    let e = against_fake(Fault::Silent, verifying).unwrap_err();
    assert!(matches!(e, Error::Timeout { inflight: 16, .. }), "{e}");
}

#[test]
fn a_backend_that_names_a_wrong_head_is_refused() {
    let e = against_fake(Fault::WrongHead, |s| LoadConfig {
        iodepth: 1,
        ..verifying(s)
    })
    .unwrap_err();
    assert!(matches!(e, Error::Misbehaved(_)), "{e}");
    assert!(e.to_string().contains("head"), "{e}");
}

#[test]
fn a_completion_without_status_is_refused() {
    let e = against_fake(Fault::NoStatus, verifying).unwrap_err();
    assert!(e.to_string().contains("without a status"), "{e}");
}

#[test]
fn an_io_error_status_fails_the_run() {
    let e = against_fake(Fault::IoErr, |s| LoadConfig {
        rw: Rw::RandRead,
        ..verifying(s)
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Io {
                status: 1,
                op: "write",
                ..
            }
        ),
        "{e}"
    );
}
