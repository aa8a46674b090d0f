//! Acknowledged writes survive a SIGKILL of `bouncevm-vhost blk`: a vhost-user front end
//! writes through the running binary, waits for each OK status, kills the server with
//! SIGKILL the moment the last one (or the FLUSH after them) is acknowledged, and reads the
//! image: raw, and qcow2 made by `qemu-img create` whose writes allocate clusters and L2
//! tables (the image must then pass `qemu-img check` and read back through `qemu-img`).

mod vhost_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bounce::testing::qemu_img_available;
use devices::block::request::RequestHeader;
use devices::testing::durable::{
    assert_acknowledged, crash_offset, crash_pattern, create_image, read_back,
};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_OUT, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};
use vhost::vhost_user::VhostUserFrontend;
use vhost_support::child::Server;
use vhost_support::Driver;

const BIN: &str = env!("CARGO_BIN_EXE_bouncevm-vhost");
/// What Linux's virtio_blk negotiates for the cache: FLUSH, and CONFIG_WCE so the device's
/// cache mode decides the write cache (without CONFIG_WCE, negotiating FLUSH would turn the
/// write cache on even with cache=writethrough, as in QEMU).
const CACHE_FEATURES: u64 = feature(VIRTIO_BLK_F_FLUSH) | feature(VIRTIO_BLK_F_CONFIG_WCE);
/// Writes in flight at once (the test driver's queue of 16 holds 8 two-descriptor chains).
const WRITES: u64 = 8;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bouncevm-blk-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

/// A virtio-blk request: the 16-byte header (type, reserved, sector) then the data.
fn request(kind: u32, sector: u64, data: &[u8]) -> Vec<u8> {
    let mut r = RequestHeader::encode(kind, sector).to_vec();
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

fn crash_after_acknowledged_writes(format: &str, cache: &str, aio: &str, flush: bool) {
    let what = format!("{format} cache={cache} aio={aio}");
    let img = tmp(&format!("{cache}-{aio}.{format}"));
    create_image(&img, format);
    let mut server = Server::start_on(
        Some(&img),
        &[
            "--format",
            format,
            "--cache",
            cache,
            "--aio",
            aio,
            "--bounce",
            "policy=force",
        ],
    );
    let mut d = Driver::connect(&server.sock, 1);
    let offered = d.handshake().unwrap();
    assert_eq!(offered & CACHE_FEATURES, CACHE_FEATURES);
    d.set_features(
        offered & (feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX) | CACHE_FEATURES),
    )
    .unwrap();
    d.setup_rings(1).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    for i in 0..WRITES {
        d.post(
            0,
            &request(
                VIRTIO_BLK_T_OUT,
                crash_offset(i) / 512,
                &crash_pattern(i, 512),
            ),
            1,
        );
    }
    let done = wait_used(&mut d, WRITES as usize);
    assert!(
        done.iter().all(|&(_, st)| st == VIRTIO_BLK_S_OK),
        "{what}: {done:?}"
    );
    if flush {
        d.post(0, &request(VIRTIO_BLK_T_FLUSH, 0, &[]), 1);
        let f = wait_used(&mut d, 1);
        assert_eq!(f[0].1, VIRTIO_BLK_S_OK, "FLUSH failed");
    }
    // SIGKILL: no destructor, no final flush of ours runs.
    server.child.kill().unwrap();
    let status = server.child.wait().unwrap();
    assert!(!status.success());
    let data = read_back(&img, format, &what);
    let all: Vec<u64> = (0..WRITES).collect();
    assert_acknowledged(&data, &all, 512, &what);
    let _ = std::fs::remove_file(&img);
}

fn exists(p: &Path) -> bool {
    p.exists()
}

/// [`crash_after_acknowledged_writes`] with each of `aios` (qcow2 only where `qemu-img` is).
fn crash_with_each_aio(format: &str, cache: &str, aios: [&str; 2], flush: bool) {
    if format == "qcow2" && !qemu_img_available() {
        return;
    }
    for aio in aios {
        crash_after_acknowledged_writes(format, cache, aio, flush);
    }
}

/// One test per case: `name: format, cache, aios, flush`.
macro_rules! crash_tests {
    ($($(#[$doc:meta])* $name:ident: $format:literal, $cache:literal, $aios:expr, $flush:literal;)*) => {
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                crash_with_each_aio($format, $cache, $aios, $flush);
            }
        )*
    };
}

crash_tests! {
    writethrough_writes_survive_sigkill_without_a_flush:
        "raw", "writethrough", ["io_uring", "threads"], false;
    cache_none_writes_survive_sigkill_after_flush: "raw", "none", ["io_uring", "threads"], true;
    /// qcow2: every write allocates (a data cluster, an L2 table, refcounts), so the metadata
    /// must be durable too, and the image must pass `qemu-img check` after the kill.
    qcow2_writethrough_writes_survive_sigkill_without_a_flush:
        "qcow2", "writethrough", ["threads", "sync"], false;
    qcow2_cache_none_writes_survive_sigkill_after_flush:
        "qcow2", "none", ["threads", "sync"], true;
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
