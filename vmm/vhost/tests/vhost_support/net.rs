//! A net device over in-memory backends, as `bouncevm-vhost net` configures it, the frames its
//! tap would hand over, and a net front end's steps (negotiation, rings, traffic).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use bounce::Dma;
use devices::net::{MemBackend, Net, NetBackend, NetConfig, ShaperConfig};
use devices::virtio::spec::{feature, VIRTIO_F_VERSION_1};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserFrontend;
use vm_memory::{Bytes, GuestAddress};

use super::child::Server;
use super::inproc::{start_server_with_stats, wait_stats};
use super::{data_addr, negotiated_on, Driver};

/// A net device over in-memory backends, configured as `bouncevm-vhost net` configures it
/// (the frontend steers the queue pairs).
pub fn net_device(pairs: u16) -> (Net, Vec<MemBackend>) {
    net_device_shaped(pairs, None)
}

/// [`net_device`] with each queue pair shaped by `shaper` (`--rate`).
pub fn net_device_shaped(pairs: u16, shaper: Option<ShaperConfig>) -> (Net, Vec<MemBackend>) {
    net_device_on(pairs, shaper, Dma::direct())
}

/// [`net_device_shaped`] whose guest-memory accesses go through `dma` (a bounce pool).
pub fn net_device_on(pairs: u16, shaper: Option<ShaperConfig>, dma: Dma) -> (Net, Vec<MemBackend>) {
    let bes: Vec<MemBackend> = (0..pairs).map(|_| MemBackend::new().unwrap()).collect();
    let boxed = bes
        .iter()
        .map(|b| Box::new(b.clone()) as Box<dyn NetBackend>)
        .collect();
    let cfg = NetConfig {
        queue_pairs: pairs,
        frontend_steering: true,
        shaper,
        ..NetConfig::default()
    };
    (Net::new(cfg, boxed, dma).unwrap(), bes)
}

/// A frame as the tap hands it over: a zeroed vnet header, then `len` bytes from `seed`.
pub fn net_frame(len: usize, seed: u8) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    f.extend((0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)));
    f
}

/// An in-process net server: its socket, statistics socket, thread, stop handle and backend.
pub type NetServer = (
    PathBuf,
    PathBuf,
    std::thread::JoinHandle<bouncevm_vhost::Server<Net>>,
    bouncevm_vhost::StopHandle,
    MemBackend,
);

/// An in-process net server with one queue pair.
pub fn net_server(name: &str) -> NetServer {
    net_server_shaped(name, None)
}

/// [`net_server`] with the queue pair shaped by `shaper`.
pub fn net_server_shaped(name: &str, shaper: Option<ShaperConfig>) -> NetServer {
    net_server_on(name, shaper, Dma::direct())
}

/// [`net_server_shaped`] on a device whose guest-memory accesses go through `dma`.
pub fn net_server_on(name: &str, shaper: Option<ShaperConfig>, dma: Dma) -> NetServer {
    let (net, mut bes) = net_device_on(1, shaper, dma);
    let (path, stats, server, stop) = start_server_with_stats(name, net);
    (path, stats, server, stop, bes.remove(0))
}

/// A net session negotiated (REPLY_ACK, CONFIGURE_MEM_SLOTS) up to SET_FEATURES.
pub fn net_negotiated(path: &Path) -> Driver {
    net_negotiated_with(path, VhostUserProtocolFeatures::empty())
}

/// [`net_negotiated`], also acknowledging `extra` protocol features.
pub fn net_negotiated_with(path: &Path, extra: VhostUserProtocolFeatures) -> Driver {
    let mut d = Driver::connect(path, 2);
    net_negotiate(&mut d, extra);
    d
}

/// Negotiates a net session on `d`'s connection (REPLY_ACK, CONFIGURE_MEM_SLOTS and `extra`)
/// up to SET_FEATURES.
pub fn net_negotiate(d: &mut Driver, extra: VhostUserProtocolFeatures) {
    let offered = d
        .handshake_with(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS | extra)
        .unwrap();
    d.set_features(offered & feature(VIRTIO_F_VERSION_1))
        .unwrap();
}

/// Configures and enables RX (0) and TX (1) at `size` entries, memory already set.
pub fn net_rings(d: &mut Driver, size: u16) {
    for q in 0..2 {
        d.configure_sized_ring(q, size).unwrap();
        d.frontend.set_vring_enable(q, true).unwrap();
    }
}

/// A frame sent from TX descriptor `desc` reaches the backend, and one injected lands in RX
/// descriptor `desc` (both in the data area above the middle of guest memory).
pub fn net_traffic(d: &mut Driver, be: &MemBackend, desc: u16, seed: u8) {
    let f = net_frame(100, seed);
    let tbuf = data_addr(1) + u64::from(desc) * 0x800;
    d.mem.write_slice(&f, GuestAddress(tbuf)).unwrap();
    d.post_descs(1, desc, &[(tbuf, f.len() as u32, false)]);
    assert_eq!(d.poll_used(1), Some((u32::from(desc), 0)), "TX {seed}");
    assert_eq!(be.take_sent(), vec![f], "TX frame {seed}");
    let rbuf = data_addr(0) + u64::from(desc) * 0x800;
    d.post_descs(0, desc, &[(rbuf, 2048, true)]);
    let f = net_frame(200, seed ^ 0x80);
    be.inject(f.clone());
    assert_eq!(
        d.poll_used(0),
        Some((u32::from(desc), f.len() as u32)),
        "RX {seed}"
    );
    let mut got = vec![0u8; f.len()];
    d.mem.read_slice(&mut got, GuestAddress(rbuf)).unwrap();
    assert!(got[12..] == f[12..], "RX payload {seed}");
}

/// The session on `d` ended; a well-formed net front end is served next.
pub fn net_next_served(path: &Path, stats: &Path, be: &MemBackend, d: Driver, seed: u8) {
    drop(d);
    wait_stats(stats, "the session ends", |st| {
        st["server"]["connected"] == false
    });
    let mut d = net_negotiated(path);
    d.set_mem_table().unwrap();
    net_rings(&mut d, 16);
    net_traffic(&mut d, be, 0, seed);
}

/// One queue pair of `bouncevm-vhost net` started (features, memory, both rings): the rings
/// configured with the driver's fds by `rings`, then enabled.
pub fn net_started(server: &Server, rings: impl FnOnce(&mut Driver)) -> Driver {
    let mut d = negotiated_on(&server.sock, 3);
    rings(&mut d);
    d.frontend.set_vring_enable(0, true).unwrap();
    d.frontend.set_vring_enable(1, true).unwrap();
    d
}

/// A 200-byte frame after a zeroed vnet header, sent on TX (queue 1, descriptor 0) and
/// completed.
pub fn net_tx(d: &mut Driver, seed: u8) {
    let mut f = vec![0u8; 12];
    f.extend((0..200u8).map(|i| i.wrapping_mul(7).wrapping_add(seed)));
    d.mem.write_slice(&f, GuestAddress(data_addr(1))).unwrap();
    d.post_descs(1, 0, &[(data_addr(1), f.len() as u32, false)]);
    assert_eq!(d.poll_used(1), Some((0, 0)), "TX chain {seed}");
}

/// A well-formed front end gets a frame sent through `bouncevm-vhost net`.
pub fn assert_net_served(server: &Server, seed: u8) {
    let mut d = net_started(server, |d| d.setup_rings(2).unwrap());
    net_tx(&mut d, seed);
}

/// Runs `ip args`, panicking with its stderr on failure.
pub fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Why a test that needs a tap cannot run here (not root, no `/dev/net/tun`), reported as a
/// missing resource; `None` when it can.
pub fn tap_missing() -> Option<(bounce::testing::Resource, &'static str)> {
    use bounce::testing::Resource;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some((Resource::Root, "not root"));
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some((Resource::Tun, "/dev/net/tun is missing"));
    }
    None
}

/// [`tap_missing`], or no `ip` command (a network namespace cannot be made).
pub fn netns_missing() -> Option<(bounce::testing::Resource, &'static str)> {
    tap_missing().or_else(|| {
        std::process::Command::new("ip")
            .arg("-V")
            .output()
            .is_err()
            .then_some((
                bounce::testing::Resource::Root,
                "the `ip` command is missing",
            ))
    })
}

/// A network namespace of this test process (`ip netns add`), deleted with whatever is left
/// in it (taps) when dropped.
#[derive(Debug)]
pub struct Netns(pub String);

impl Netns {
    /// A fresh namespace `prefix-PID` (one left by an earlier run of the same name is deleted).
    pub fn new(prefix: &str) -> Self {
        let name = format!("{prefix}-{}", std::process::id());
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name])
            .output();
        ip(&["netns", "add", &name]);
        Self(name)
    }

    /// Runs `f` on a thread that entered the namespace: what it creates (a tap, a socket)
    /// lives in the namespace, and its fds work from anywhere.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        use std::os::fd::AsRawFd;
        let path = format!("/var/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(path).unwrap();
            // SAFETY: `ns` is an open namespace file; setns only moves this thread.
            let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .output();
    }
}
