//! Acknowledged writes survive a SIGKILL of `bouncevm-vhost blk`: a vhost-user front end
//! writes through the running binary, waits for each OK status, kills the server with
//! SIGKILL the moment the last one (or the FLUSH after them) is acknowledged, and reads the
//! image file.

mod vhost_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use devices::virtio::features;
use vhost::vhost_user::VhostUserFrontend;
use vhost_support::Driver;

const BIN: &str = env!("CARGO_BIN_EXE_bouncevm-vhost");
/// VIRTIO_BLK_F_FLUSH.
const F_FLUSH: u64 = 1 << 9;
/// Writes in flight at once (the test driver's queue of 16 holds 8 two-descriptor chains).
const WRITES: u64 = 8;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bouncevm-blk-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pattern(i: u64) -> Vec<u8> {
    (0..512u64)
        .map(|b| ((b * 13 + i * 71 + 5) % 251) as u8)
        .collect()
}

/// A virtio-blk request: the 16-byte header (type, reserved, sector) then the data.
fn request(kind: u32, sector: u64, data: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(16 + data.len());
    r.extend_from_slice(&kind.to_le_bytes());
    r.extend_from_slice(&0u32.to_le_bytes());
    r.extend_from_slice(&sector.to_le_bytes());
    r.extend_from_slice(data);
    r
}

/// Waits for `n` used entries on queue 0; returns (head, status byte) for each.
fn wait_used(d: &mut Driver, n: usize) -> Vec<(u16, u8)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} completions",
            out.len()
        );
        while let Some((id, len)) = d.next_used(0) {
            assert_eq!(len, 1, "a write's used length is its status byte");
            let head = u16::try_from(id).unwrap();
            out.push((head, d.output(0, head, 1)[0]));
        }
        d.wait_call(0, Duration::from_millis(100));
    }
    out
}

fn crash_after_acknowledged_writes(cache: &str, aio: &str, flush: bool) {
    let img = tmp(&format!("{cache}-{aio}.img"));
    std::fs::File::create(&img)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let sock = tmp(&format!("{cache}-{aio}.sock"));
    let server = Running(
        Command::new(BIN)
            .args([
                "blk",
                "--socket",
                sock.to_str().unwrap(),
                "--file",
                img.to_str().unwrap(),
                "--cache",
                cache,
                "--aio",
                aio,
                "--bounce",
                "policy=force",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut d = Driver::connect(&sock, 1);
    let offered = d.handshake().unwrap();
    assert_ne!(offered & F_FLUSH, 0);
    d.set_features(offered & (features::VERSION_1 | features::RING_EVENT_IDX | F_FLUSH))
        .unwrap();
    d.setup_rings(1).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    for i in 0..WRITES {
        d.post(0, &request(1, i * 8 + 1, &pattern(i)), 1);
    }
    let done = wait_used(&mut d, WRITES as usize);
    assert!(done.iter().all(|&(_, st)| st == 0), "{cache}: {done:?}");
    if flush {
        d.post(0, &request(4, 0, &[]), 1);
        let f = wait_used(&mut d, 1);
        assert_eq!(f[0].1, 0, "FLUSH failed");
    }
    // SIGKILL: no destructor, no final flush of ours runs.
    let mut server = server;
    server.0.kill().unwrap();
    let status = server.0.wait().unwrap();
    assert!(!status.success());
    let data = std::fs::read(&img).unwrap();
    for i in 0..WRITES {
        let at = usize::try_from((i * 8 + 1) * 512).unwrap();
        assert_eq!(
            &data[at..at + 512],
            &pattern(i)[..],
            "cache={cache} aio={aio}: acknowledged write {i} lost"
        );
    }
    let _ = std::fs::remove_file(&img);
    let _ = std::fs::remove_file(&sock);
}

fn exists(p: &Path) -> bool {
    p.exists()
}

#[test]
fn writethrough_writes_survive_sigkill_without_a_flush() {
    for aio in ["io_uring", "threads"] {
        crash_after_acknowledged_writes("writethrough", aio, false);
    }
}

#[test]
fn cache_none_writes_survive_sigkill_after_flush() {
    for aio in ["io_uring", "threads"] {
        crash_after_acknowledged_writes("none", aio, true);
    }
}

#[test]
fn cache_none_without_o_direct_support_is_one_line() {
    let sock = tmp("proc.sock");
    let out = Command::new(BIN)
        .args([
            "blk",
            "--socket",
            sock.to_str().unwrap(),
            "--file",
            "/proc/self/status",
            "--readonly",
            "--cache",
            "none",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("O_DIRECT"), "{err}");
    assert!(!exists(&sock));
    let out = Command::new(BIN)
        .args([
            "blk", "--socket", "/tmp/x", "--file", "/x", "--aio", "native",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("native"));
}
