//! The vhost-user server against the `vhost` crate's frontend, in QEMU 7.2's message order.

mod vhost_support;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use devices::virtio::features;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserVirtioFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vhost::VhostUserMemoryRegionInfo;
use vhost_support::{Driver, EchoDevice, CONFIG, EXTRA_TOKEN};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestAddress, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap};
use vmm::vhost::{Server, VhostUserDevice};

fn socket_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bouncevm-vhost-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

/// Starts a server for an echo device; returns the join handle (giving the server back) and a
/// stop handle.
fn start_server(
    name: &str,
    device: EchoDevice,
) -> (
    PathBuf,
    thread::JoinHandle<Server<EchoDevice>>,
    vmm::vhost::StopHandle,
) {
    let path = socket_path(name);
    let mut server = Server::bind("echo", device, &path).unwrap();
    let stop = server.stop_handle().unwrap();
    let t = thread::spawn(move || {
        server.run().unwrap();
        server
    });
    (path, t, stop)
}

const WANTED: u64 = features::VERSION_1 | features::RING_EVENT_IDX;

/// QEMU 7.2's vhost-user-net start: SET_VRING_ENABLE before SET_FEATURES, never again.
fn qemu_net_order(d: &mut Driver) -> vhost::Result<()> {
    let offered = d.handshake()?;
    assert_ne!(
        offered & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
        0
    );
    assert_ne!(offered & features::ACCESS_PLATFORM, 0);
    d.frontend.get_queue_num()?;
    d.raw_vring_enable(0, true);
    d.set_features(offered & WANTED)?;
    d.setup_rings(1)
}

#[test]
fn early_vring_enable_is_applied_after_set_features() {
    let device = EchoDevice::new(1);
    let counters = device.counters.clone();
    let (path, server, stop) = start_server("early.sock", device);
    let mut d = Driver::connect(&path, 1);
    qemu_net_order(&mut d).expect("QEMU's order must be accepted");
    assert_eq!(
        d.echo(0, b"hello vhost").as_deref(),
        Some(&b"hello vhost"[..])
    );
    assert_eq!(d.echo(0, b"again").as_deref(), Some(&b"again"[..]));
    assert_eq!(counters.chains.load(Ordering::Relaxed), 2);
    // The device saw the acked features without the vhost-user bit.
    assert_eq!(counters.acked.load(Ordering::Relaxed), WANTED);
    drop(d);
    stop.stop();
    let server = server.join().unwrap();
    let stats = server.stats();
    assert_eq!(stats["server"]["relay"]["early_enables_replayed"], 1);
    assert_eq!(stats["server"]["connections"], 1);
}

#[test]
fn worker_events_before_the_rings_are_ready_are_not_delivered() {
    // Regression: with QEMU's net order the device is activated at SET_FEATURES, before the
    // rings have addresses. A worker fd that became readable then (a frame arriving on the
    // tap) was delivered to the net worker, which read the unconfigured ring ("avail index
    // 61440 ahead"), declared itself broken and never received again.
    let device = EchoDevice::new(1);
    let counters = device.counters.clone();
    let extra = device.extra.clone();
    let (path, server, stop) = start_server("notready.sock", device);
    let mut d = Driver::connect(&path, 1);
    let offered = d.handshake().unwrap();
    d.frontend.get_queue_num().unwrap();
    // QEMU sends the memory table before the rings; the worker can run from then on.
    let region = d.mem.find_region(GuestAddress(0)).unwrap();
    let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
    d.frontend.set_mem_table(&[info]).unwrap();
    d.raw_vring_enable(0, true);
    d.set_features(offered & WANTED).unwrap();
    // Let the server take the messages (SET_FEATURES has no reply), then the fd fires while
    // the ring is not set up yet.
    d.frontend.get_features().unwrap();
    extra.write(1).unwrap();
    thread::sleep(Duration::from_millis(300));
    assert_eq!(
        counters.extra_events.load(Ordering::Relaxed),
        0,
        "a worker saw an event for a queue that was not ready"
    );
    d.setup_rings(1).unwrap();
    assert_eq!(
        d.echo(0, b"still works").as_deref(),
        Some(&b"still works"[..])
    );
    // Once ready, the worker's fd is delivered.
    extra.write(1).unwrap();
    assert!(
        d.wait_call(0, Duration::from_secs(5)),
        "extra fd event not handled"
    );
    assert_eq!(counters.extra_events.load(Ordering::Relaxed), 1);
    drop(d);
    stop.stop();
    server.join().unwrap();
}

#[test]
fn plain_vhost_user_backend_drops_the_early_enable() {
    // The same order against vhost-user-backend's own serve() (no relay): the connection is
    // dropped. This is the bug the relay exists for; if this test starts failing, the crates
    // fixed it and the relay may go.
    let path = socket_path("plain.sock");
    let adapter = Arc::new(VhostUserDevice::new(EchoDevice::new(1)));
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let mut daemon = VhostUserDaemon::new("plain".into(), adapter, mem).unwrap();
    let p = path.clone();
    let t = thread::spawn(move || daemon.serve(&p));
    let mut d = Driver::connect(&path, 1);
    let result = qemu_net_order(&mut d);
    // The daemon ends the session on the early enable; requests that need an answer fail.
    let refused = result.is_err() || d.frontend.get_features().is_err();
    drop(d);
    let served = t.join().unwrap();
    assert!(
        refused,
        "the plain daemon unexpectedly accepted the early enable"
    );
    assert!(served.is_err(), "serve() should report the refused request");
}

#[test]
fn blk_order_config_space_and_worker_fds() {
    let device = EchoDevice::new(1);
    let counters = device.counters.clone();
    let extra = device.extra.clone();
    let (path, server, stop) = start_server("blk.sock", device);
    let mut d = Driver::connect(&path, 1);
    let offered = d.handshake().unwrap();
    let (_, cfg) = d
        .frontend
        .get_config(0, 8, VhostUserConfigFlags::WRITABLE, &[0u8; 8])
        .unwrap();
    assert_eq!(&cfg[..], &CONFIG[..]);
    d.frontend
        .set_config(0, VhostUserConfigFlags::WRITABLE, &[1, 2])
        .unwrap();
    d.set_features(offered & WANTED).unwrap();
    d.setup_rings(1).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    assert_eq!(d.echo(0, b"blk").as_deref(), Some(&b"blk"[..]));
    assert_eq!(counters.config_writes.load(Ordering::Relaxed), 1);
    // The worker's own fd is polled on its thread.
    extra.write(1).unwrap();
    assert!(
        d.wait_call(0, Duration::from_secs(5)),
        "extra fd event not handled"
    );
    assert_eq!(counters.extra_events.load(Ordering::Relaxed), 1);
    drop(d);
    stop.stop();
    let server = server.join().unwrap();
    assert_eq!(server.stats()["server"]["relay"]["early_enables_held"], 0);
    let _ = EXTRA_TOKEN;
}

#[test]
fn reconnect_resets_the_device_and_serves_again() {
    let device = EchoDevice::new(1);
    let counters = device.counters.clone();
    let (path, server, stop) = start_server("reconnect.sock", device);
    for round in 0..3 {
        let mut d = Driver::connect(&path, 1);
        qemu_net_order(&mut d).unwrap();
        let msg = format!("round {round}");
        assert_eq!(d.echo(0, msg.as_bytes()), Some(msg.into_bytes()));
        drop(d);
        // Wait for the session to end (the device is reset).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while counters.resets.load(Ordering::Relaxed) < round + 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "device not reset after disconnect"
            );
            thread::sleep(Duration::from_millis(10));
        }
    }
    assert_eq!(counters.activations.load(Ordering::Relaxed), 3);
    stop.stop();
    let server = server.join().unwrap();
    assert_eq!(server.stats()["server"]["connections"], 3);
    drop(server);
    assert!(!path.exists(), "socket removed at exit");
}

#[test]
fn guest_reset_stops_and_restarts_the_device() {
    // QEMU on a guest reset: GET_VRING_BASE, then a new start with SET_FEATURES.
    let device = EchoDevice::new(1);
    let counters = device.counters.clone();
    let (path, server, stop) = start_server("restart.sock", device);
    let mut d = Driver::connect(&path, 1);
    qemu_net_order(&mut d).unwrap();
    assert!(d.echo(0, b"one").is_some());
    d.frontend.get_vring_base(0).unwrap();
    assert_eq!(counters.resets.load(Ordering::Relaxed), 1);
    let offered = d.frontend.get_features().unwrap();
    d.set_features(offered & WANTED).unwrap();
    d.setup_rings(1).unwrap();
    assert_eq!(d.echo(0, b"two").as_deref(), Some(&b"two"[..]));
    assert_eq!(counters.activations.load(Ordering::Relaxed), 2);
    drop(d);
    stop.stop();
    server.join().unwrap();
}

#[test]
fn a_live_socket_is_refused_and_a_stale_one_replaced() {
    let (path, server, stop) = start_server("live.sock", EchoDevice::new(1));
    // Wait until it listens.
    drop(Driver::connect(&path, 1));
    let e = Server::bind("echo", EchoDevice::new(1), &path).unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    stop.stop();
    drop(server.join().unwrap());
    // A stale socket file (no listener) is replaced.
    let stale = socket_path("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    Server::bind("echo", EchoDevice::new(1), &stale).unwrap();
    // A regular file is not a socket and is left alone.
    let file = socket_path("file.sock");
    std::fs::write(&file, b"x").unwrap();
    let e = Server::bind("echo", EchoDevice::new(1), &file).unwrap_err();
    assert!(e.to_string().contains("not a socket"), "{e}");
}
