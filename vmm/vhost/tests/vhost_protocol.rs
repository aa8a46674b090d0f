//! The vhost-user server against the `vhost` crate's frontend, in QEMU 7.2's message order.

mod vhost_support;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use bounce::Dma;
use bouncevm_vhost::relay::req::SET_VRING_ENABLE;
use bouncevm_vhost::relay::{FLAG_NEED_REPLY, FLAG_VERSION};
use bouncevm_vhost::{Server, VhostUserDevice};
use devices::block::STATUS_UNSET;
use devices::net::{MemBackend, Net, NetConfig};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MQ, VIRTIO_NET_F_MRG_RXBUF,
    VIRTIO_RING_F_EVENT_IDX,
};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vhost::VhostUserMemoryRegionInfo;
use vhost_support::inproc::{socket_path, start_server_with_stats, stats, wait_stats};
use vhost_support::net::{ip, net_device, net_frame, netns_missing, Netns};
use vhost_support::vring_state;
use vhost_support::{
    blk_request, blk_session, blk_status, block_pattern, data_addr, full_eventfd, poll_now,
    refused, wait_fd, wait_used, Driver, EchoCounters, EchoDevice, NotEventFd, BATCH, BLK_DATA,
    CONFIG, EXTRA_TOKEN, MEM_SIZE, QSIZE,
};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// Starts a server for an echo device; returns the device's counters, the socket, the join
/// handle (giving the server back) and a stop handle.
fn start_server(
    name: &str,
    device: EchoDevice,
) -> (
    Arc<EchoCounters>,
    PathBuf,
    thread::JoinHandle<Server<EchoDevice>>,
    bouncevm_vhost::StopHandle,
) {
    let counters = device.counters.clone();
    let path = socket_path(name);
    let mut server = Server::bind("echo", device, &path).unwrap();
    let stop = server.stop_handle().unwrap();
    let t = thread::spawn(move || {
        server.run().unwrap();
        server
    });
    (counters, path, t, stop)
}

const WANTED: u64 = feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX);

/// QEMU 7.2's vhost-user-net start: SET_VRING_ENABLE before SET_FEATURES, never again.
fn qemu_net_order(d: &mut Driver) -> vhost::Result<()> {
    let offered = d.handshake()?;
    assert_ne!(
        offered & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
        0
    );
    assert_ne!(offered & feature(VIRTIO_F_ACCESS_PLATFORM), 0);
    d.frontend.get_queue_num()?;
    d.raw_vring_enable(0, true);
    d.set_features(offered & WANTED)?;
    d.setup_rings(1)
}

/// An event on the echo worker's own fd (`extra`) reaches the worker (its first), which
/// answers with a call on queue 0.
fn assert_extra_event_handled(d: &Driver, extra: &EventFd, counters: &EchoCounters) {
    extra.write(1).unwrap();
    assert!(
        d.wait_call(0, Duration::from_secs(5)),
        "extra fd event not handled"
    );
    assert_eq!(counters.extra_events.load(Ordering::Relaxed), 1);
}

#[test]
fn early_vring_enable_is_applied_after_set_features() {
    let (counters, path, server, stop) = start_server("early.sock", EchoDevice::new(1));
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
    let (path, stats_path, server, stop) = start_server_with_stats("notready.sock", device);
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
    // The event reached the adapter, which dropped it (counted) instead of handing it over.
    wait_stats(&stats_path, "the early event was never seen", |st| {
        st["transport"]["not_ready_events"] == 1
    });
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
    assert_extra_event_handled(&d, &extra, &counters);
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
    let extra = device.extra.clone();
    let (counters, path, server, stop) = start_server("blk.sock", device);
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
    assert_extra_event_handled(&d, &extra, &counters);
    drop(d);
    stop.stop();
    let server = server.join().unwrap();
    assert_eq!(server.stats()["server"]["relay"]["early_enables_held"], 0);
    let _ = EXTRA_TOKEN;
}

#[test]
fn reconnect_resets_the_device_and_serves_again() {
    let (counters, path, server, stop) = start_server("reconnect.sock", EchoDevice::new(1));
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
    let (counters, path, server, stop) = start_server("restart.sock", EchoDevice::new(1));
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
    let (_, path, server, stop) = start_server("live.sock", EchoDevice::new(1));
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

#[test]
fn rings_at_a_region_edge_break_the_worker_and_the_backend_keeps_answering() {
    // Regression: the adapter never checked `Queue::is_valid`. With
    // the avail index in the last 4 bytes of guest memory the worker read the index but no
    // entry and spun (notifications re-armed, "more buffers" forever) holding the vring lock:
    // GET_VRING_BASE, the statistics socket and the signals hung, and nothing was reported.
    let end = MEM_SIZE as u64;
    let qs = u64::from(QSIZE);
    // (what, desc, avail, used): one ring at a time reaches past the end of guest memory.
    let cases = [
        ("avail ring", 0, end - 4, 0x2000),
        ("descriptor table", end - 16 * qs + 16, 0x1000, 0x2000),
        ("used ring", 0, 0x1000, end - 8),
    ];
    for (what, desc, avail, used) in cases {
        let device = EchoDevice::new(1);
        let counters = device.counters.clone();
        let (path, stats_path, server, stop) = start_server_with_stats("edge.sock", device);
        let mut d = Driver::connect(&path, 1);
        d.handshake_with(VhostUserProtocolFeatures::STATUS).unwrap();
        // Without EVENT_IDX: re-arming notifications writes only the used flags, inside memory.
        d.set_features(feature(VIRTIO_F_VERSION_1)).unwrap();
        d.set_mem_table().unwrap();
        d.configure_ring(0, desc, avail, used).unwrap();
        d.frontend.set_vring_enable(0, true).unwrap();
        // One buffer published: avail idx = 1, head 0.
        d.mem.write_obj(1u16, GuestAddress(avail + 2)).unwrap();
        if avail + 6 <= end {
            d.mem.write_obj(0u16, GuestAddress(avail + 4)).unwrap();
        }
        d.kicks[0].write(1).unwrap();
        assert!(
            d.wait_err(0, Duration::from_secs(10)),
            "{what}: the vring error fd was not signalled"
        );
        assert_eq!(
            d.get_status() & VIRTIO_CONFIG_S_NEEDS_RESET,
            VIRTIO_CONFIG_S_NEEDS_RESET,
            "{what}"
        );
        let st = stats(&stats_path);
        assert_eq!(st["transport"]["broken_workers"], 1, "{what}: {st}");
        assert_eq!(st["report"]["needs_reset"], true, "{what}: {st}");
        assert_eq!(counters.chains.load(Ordering::Relaxed), 0, "{what}");
        // The frontend stops the device: GET_VRING_BASE answers (nothing was consumed).
        assert_eq!(d.frontend.get_vring_base(0).unwrap(), 0, "{what}");
        // Restarted with good rings, the device serves again and the flag clears.
        d.set_features(feature(VIRTIO_F_VERSION_1)).unwrap();
        d.setup_rings(1).unwrap();
        d.frontend.set_vring_enable(0, true).unwrap();
        assert_eq!(
            d.echo(0, b"after").as_deref(),
            Some(&b"after"[..]),
            "{what}"
        );
        assert_eq!(d.get_status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0, "{what}");
        drop(d);
        stop.stop();
        server.join().unwrap();
    }
}

#[test]
fn early_enables_the_backend_would_refuse_are_refused() {
    // Regression: SET_VRING_ENABLE for vring 4000 before SET_FEATURES was
    // held (no bound) and acknowledged as a success.
    let device = EchoDevice::new(1);
    let (path, stats_path, server, stop) = start_server_with_stats("refuse.sock", device);
    let mut d = Driver::connect(&path, 1);
    let offered = d.handshake().unwrap();
    for (index, num) in [(4000, 1), (1, 1), (0, 2)] {
        let r = d
            .raw_request(
                SET_VRING_ENABLE,
                FLAG_VERSION | FLAG_NEED_REPLY,
                &vring_state(index, num),
                true,
            )
            .unwrap();
        assert_eq!(
            r.body,
            1u64.to_le_bytes(),
            "SET_VRING_ENABLE({index}, {num}) must fail"
        );
    }
    let ok = d
        .raw_request(
            SET_VRING_ENABLE,
            FLAG_VERSION | FLAG_NEED_REPLY,
            &vring_state(0, 1),
            true,
        )
        .unwrap();
    assert_eq!(ok.body, 0u64.to_le_bytes());
    // The connection goes on and the valid early enable was applied.
    d.set_features(offered & WANTED).unwrap();
    d.setup_rings(1).unwrap();
    assert_eq!(d.echo(0, b"on").as_deref(), Some(&b"on"[..]));
    drop(d);
    let st = wait_stats(&stats_path, "session end", |st| {
        st["server"]["connected"] == false
    });
    let relay = &st["server"]["relay"];
    assert_eq!(relay["early_enables_refused"], 3, "{st}");
    assert_eq!(relay["early_enables_held"], 1, "{st}");
    assert_eq!(relay["early_enables_replayed"], 1, "{st}");
    stop.stop();
    server.join().unwrap();
}

#[test]
fn the_backend_request_channel_stays_open_for_the_session() {
    // Regression: the adapter dropped the SET_BACKEND_REQ_FD channel on
    // arrival; QEMU 7.2 then read EOF on it and printed "Unexpected end-of-file before all
    // data were read" on every run with ACCESS_PLATFORM offered.
    let (_, path, server, stop) = start_server("backreq.sock", EchoDevice::new(1));
    let mut d = Driver::connect(&path, 1);
    d.handshake_with(VhostUserProtocolFeatures::BACKEND_REQ)
        .unwrap();
    let (ours, theirs) = UnixStream::pair().unwrap();
    d.frontend.set_backend_request_fd(&theirs).unwrap();
    drop(theirs);
    // Requests are handled in order: once this is answered, SET_BACKEND_REQ_FD was handled
    // (and the relay has dropped its copy of the fd).
    d.frontend.get_features().unwrap();
    let revents = poll_now(ours.as_raw_fd());
    assert_eq!(
        revents & (libc::POLLHUP | libc::POLLIN),
        0,
        "the backend closed its request channel (revents {revents:#x})"
    );
    // It closes with the session.
    drop(d);
    assert!(
        wait_fd(ours.as_raw_fd(), Duration::from_secs(10)),
        "request channel still open after the session ended"
    );
    let mut buf = [0u8; 1];
    assert_eq!((&ours).read(&mut buf).unwrap(), 0);
    stop.stop();
    server.join().unwrap();
}

#[test]
fn a_device_with_more_queues_than_vhost_user_serves_is_refused_up_front() {
    // Regression: 65 queues (net with 32 pairs) were silently cut to the
    // 64-bit thread masks; queue 64 could never be served and activation failed later.
    let path = socket_path("toomany.sock");
    let e = Server::bind("echo", EchoDevice::new(65), &path).unwrap_err();
    assert!(e.to_string().contains("65 queues"), "{e}");
    assert!(!path.exists(), "the socket must not be created");
    assert!(Server::bind("echo", EchoDevice::new(64), &path).is_ok());
}

#[test]
fn a_frontend_that_disconnects_mid_io_loses_nothing_acknowledged_and_leaks_no_slot() {
    // The real block device with bounce forced; the
    // frontend vanishes with writes in flight, then a new one connects.
    use devices::block::io::ImageFormat;
    use devices::block::{Block, BlockConfig, DiskImage};
    let dir = socket_path("midio.img");
    std::fs::File::create(&dir)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let disk = DiskImage::open(&dir, ImageFormat::Raw, false).unwrap();
    let opts: devices::options::BounceOptions = "policy=force,slots=1024".parse().unwrap();
    let (dma, pool) = opts.build(1).unwrap();
    let pool = pool.unwrap();
    let device = Block::new(disk, BlockConfig::default(), dma).unwrap();
    let (path, stats_path, server, stop) = start_server_with_stats("midio.sock", device);

    // Session 1: a batch acknowledged, then a batch in flight when the frontend vanishes.
    let mut d = blk_session(&path, WANTED);
    let sector = |batch: u16, slot: u16| u64::from(batch * BATCH + slot) * 8;
    for slot in 0..BATCH {
        let data = block_pattern(sector(0, slot), 1);
        blk_request(&mut d, slot, VIRTIO_BLK_T_OUT, sector(0, slot), Some(&data));
    }
    wait_used(&mut d, usize::from(BATCH));
    for slot in 0..BATCH {
        assert_eq!(
            blk_status(&d, slot),
            0,
            "write {slot} of the first batch failed"
        );
    }
    for slot in 0..BATCH {
        let data = block_pattern(sector(1, slot), 2);
        blk_request(&mut d, slot, VIRTIO_BLK_T_OUT, sector(1, slot), Some(&data));
    }
    d.raw.shutdown(std::net::Shutdown::Both).unwrap();
    let st = wait_stats(&stats_path, "session end", |st| {
        st["server"]["connected"] == false && st["server"]["connections"] == 1
    });
    assert_eq!(
        pool.stats().used,
        0,
        "bounce slots leaked by the dead session: {st}"
    );
    // What the device completed before it noticed is acknowledged: status 0. The rest was
    // never claimed (status untouched) - nothing in between.
    let mut acknowledged = vec![0u16; 0];
    while let Some((id, _)) = d.next_used(0) {
        let slot = u16::try_from(id).unwrap() / 3;
        assert_eq!(
            blk_status(&d, slot),
            VIRTIO_BLK_S_OK,
            "completed write {slot} failed"
        );
        acknowledged.push(slot);
    }
    for slot in (0..BATCH).filter(|s| !acknowledged.contains(s)) {
        assert_eq!(
            blk_status(&d, slot),
            STATUS_UNSET,
            "unacknowledged write {slot} got a status"
        );
    }
    drop(d);

    // Session 2: everything acknowledged reads back intact; the backend serves on.
    let mut d = blk_session(&path, WANTED);
    let mut expect: Vec<(u64, Vec<u8>)> = (0..BATCH)
        .map(|slot| (sector(0, slot), block_pattern(sector(0, slot), 1)))
        .collect();
    expect.extend(
        acknowledged
            .iter()
            .map(|&slot| (sector(1, slot), block_pattern(sector(1, slot), 2))),
    );
    for chunk in expect.chunks(usize::from(BATCH)) {
        for (slot, (sec, _)) in (0u16..).zip(chunk) {
            blk_request(&mut d, slot, VIRTIO_BLK_T_IN, *sec, None);
        }
        wait_used(&mut d, chunk.len());
        for (slot, (sec, want)) in (0u16..).zip(chunk) {
            assert_eq!(blk_status(&d, slot), 0, "read of sector {sec} failed");
            let mut got = vec![0u8; 4096];
            d.mem
                .read_slice(&mut got, GuestAddress(BLK_DATA + u64::from(slot) * 4096))
                .unwrap();
            assert!(got == *want, "sector {sec}: acknowledged data lost");
        }
    }
    drop(d);
    wait_stats(&stats_path, "second session end", |st| {
        st["server"]["connected"] == false && st["server"]["connections"] == 2
    });
    assert_eq!(pool.stats().used, 0);
    stop.stop();
    server.join().unwrap();
    let _ = std::fs::remove_file(&dir);
}

// ---------------------------------------------------------------- net over vhost-user

/// Waits for the next used element of queue `q`.
fn wait_next_used(d: &mut Driver, q: usize) -> (u32, u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(u) = d.next_used(q) {
            return u;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "queue {q}: no used entry"
        );
        d.wait_call(q, Duration::from_millis(50));
    }
}

/// Waits until the backend has handled every request sent so far (they are not answered:
/// one that is answered comes back after them).
fn sync(d: &mut Driver) {
    d.frontend.get_features().unwrap();
}

/// A net device served in-process with its statistics socket, and the memory backends of
/// its queue pairs (none for a tap).
struct NetServer {
    path: PathBuf,
    stats_path: PathBuf,
    bes: Vec<MemBackend>,
    /// Queues a front end drives: two per pair and the control queue.
    queues: usize,
    server: thread::JoinHandle<Server<Net>>,
    stop: bouncevm_vhost::StopHandle,
}

impl NetServer {
    /// A device of `pairs` queue pairs on memory backends, served on `name`.
    fn start(name: &str, pairs: u16) -> Self {
        let (net, bes) = net_device(pairs);
        Self::serve(name, net, bes, 2 * usize::from(pairs) + 1)
    }

    /// `net` (of `queues` queues, backends `bes`) served on `name`.
    fn serve(name: &str, net: Net, bes: Vec<MemBackend>, queues: usize) -> Self {
        let (path, stats_path, server, stop) = start_server_with_stats(name, net);
        Self {
            path,
            stats_path,
            bes,
            queues,
            server,
            stop,
        }
    }

    /// A new front end (nothing negotiated).
    fn connect(&self) -> Driver {
        Driver::connect(&self.path, self.queues)
    }

    /// Ends the session of `d`, then stops the server; it must shut down cleanly.
    fn end(self, d: Driver) {
        drop(d);
        self.stop.stop();
        self.server.join().expect("clean shutdown");
    }
}

/// QEMU 7.2's start of a vhost-user-net device: the enables it keeps, then SET_FEATURES.
fn net_start(d: &mut Driver, enables: &[(u32, bool)], acked: u64) {
    for &(q, on) in enables {
        d.raw_vring_enable(q, on);
    }
    d.set_features(acked).unwrap();
}

#[test]
fn rx_buffers_a_waiting_frame_holds_survive_a_stop_and_are_served_after_it() {
    // Regression: the RX chains the worker held for a frame waiting for
    // more buffers (MRG_RXBUF) were counted in the base GET_VRING_BASE reported, so the
    // frontend resumed after them and the guest lost them on every stop/cont or migration.
    let s = NetServer::start("netstop.sock", 1);
    let mut d = s.connect();
    let offered = d.handshake().unwrap();
    let acked = offered & (feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_MRG_RXBUF));
    net_start(&mut d, &[(0, true), (1, true)], acked);
    d.setup_rings(2).unwrap();
    // One 600-byte buffer for a 3000-byte frame: the worker holds it and waits for more.
    d.post_descs(0, 0, &[(data_addr(0), 600, true)]);
    s.bes[0].inject(net_frame(3000, 1));
    wait_stats(&s.stats_path, "the frame waits for buffers", |st| {
        st["device"]["net"]["rx_no_buffers"].as_u64() >= Some(1)
    });
    // The frontend stops the device (`stop`, or a migration).
    let rx_base = d.frontend.get_vring_base(0).unwrap();
    assert_eq!(
        rx_base, 0,
        "the base counts a buffer the guest never got back"
    );
    assert_eq!(d.frontend.get_vring_base(1).unwrap(), 0);
    assert!(d.next_used(0).is_none());
    // `cont`: the same rings, resumed from the reported bases. The waiting frame went with
    // the stopped device; the next one fills the guest's first buffer, then the new one.
    net_start(&mut d, &[(0, true), (1, true)], acked);
    d.resume_ring(0, u16::try_from(rx_base).unwrap()).unwrap();
    d.resume_ring(1, 0).unwrap();
    sync(&mut d);
    let second = data_addr(0) + 0x1000;
    d.post_descs(0, 1, &[(second, 2048, true)]);
    let f = net_frame(2000, 2);
    s.bes[0].inject(f.clone());
    assert_eq!(
        wait_next_used(&mut d, 0),
        (0, 600),
        "the first buffer is used first"
    );
    assert_eq!(wait_next_used(&mut d, 0), (1, (f.len() - 600) as u32));
    let mut got = vec![0u8; f.len()];
    d.mem
        .read_slice(&mut got[..600], GuestAddress(data_addr(0)))
        .unwrap();
    d.mem
        .read_slice(&mut got[600..], GuestAddress(second))
        .unwrap();
    assert_eq!(u16::from_le_bytes([got[10], got[11]]), 2, "num_buffers");
    assert!(got[12..] == f[12..], "payload");
    s.end(d);
}

#[test]
fn mq_net_is_served_as_qemu_negotiates_it_pairs_follow_vring_enable() {
    // Regression: QEMU acks MQ but not CTRL_VQ to a vhost-user-net
    // backend (it answers the guest's VQ_PAIRS_SET itself and enables the pairs' rings);
    // the device refused to activate. Pair 1 starts disabled, as QEMU starts it.
    let s = NetServer::start("netmq.sock", 2);
    let mut d = s.connect();
    let offered = d.handshake().unwrap();
    assert_eq!(d.frontend.get_queue_num().unwrap(), 5);
    let mq = feature(VIRTIO_NET_F_MQ);
    assert_ne!(offered & mq, 0);
    let acked = offered & (feature(VIRTIO_F_VERSION_1) | mq);
    net_start(
        &mut d,
        &[(0, true), (1, true), (2, false), (3, false)],
        acked,
    );
    d.setup_rings(4).unwrap();
    let st = stats(&s.stats_path);
    assert_eq!(st["transport"]["activation_failures"], 0, "{st}");
    assert_eq!(st["transport"]["active"], true, "{st}");
    // Pair 0 receives; pair 1's tap queue stays detached while its rings are disabled.
    d.post_descs(0, 0, &[(data_addr(0), 2048, true)]);
    s.bes[0].inject(net_frame(100, 1));
    assert_eq!(wait_next_used(&mut d, 0), (0, 112));
    assert!(!s.bes[1].state().enabled);
    // The guest asks for two pairs: QEMU enables pair 1's rings.
    d.frontend.set_vring_enable(2, true).unwrap();
    d.frontend.set_vring_enable(3, true).unwrap();
    sync(&mut d);
    d.post_descs(2, 0, &[(data_addr(2), 2048, true)]);
    let f = net_frame(200, 2);
    s.bes[1].inject(f.clone());
    assert_eq!(wait_next_used(&mut d, 2), (0, f.len() as u32));
    assert!(s.bes[1].state().enabled, "pair 1 attached its tap queue");
    // Pair 1 transmits too.
    let tx = net_frame(300, 3);
    d.mem.write_slice(&tx, GuestAddress(data_addr(3))).unwrap();
    d.post_descs(3, 0, &[(data_addr(3), tx.len() as u32, false)]);
    assert_eq!(wait_next_used(&mut d, 3), (0, 0));
    assert_eq!(s.bes[1].take_sent(), vec![tx]);
    let st = stats(&s.stats_path);
    let per_pair: Vec<_> = st["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["rx_frames"].clone(), w["tx_chains"].clone()))
        .collect();
    assert_eq!(
        per_pair,
        vec![(1.into(), 0.into()), (1.into(), 1.into())],
        "{st}"
    );
    // Back to one pair: the next frame on pair 1's tap queue detaches it (the tap then
    // steers to pair 0); the frontend keeps answering.
    d.frontend.set_vring_enable(2, false).unwrap();
    d.frontend.set_vring_enable(3, false).unwrap();
    sync(&mut d);
    s.bes[1].inject(net_frame(100, 4));
    wait_stats(&s.stats_path, "pair 1 detached", |st| {
        st["workers"][1]["receiving"] == false
    });
    assert!(!s.bes[1].state().enabled);
    assert!(s.bes[0].state().enabled);
    s.end(d);
}

#[test]
fn hostile_net_front_ends_cost_only_their_session() {
    // A front end's kick, call or error fd that is not an eventfd is refused; a call eventfd
    // whose counter is full (a blocking write would never return) blocks neither the
    // worker nor the stop; after each such session the next front end is served.
    let s = NetServer::start("nethostile.sock", 1);
    let ended = |what: &str| {
        wait_stats(&s.stats_path, what, |st| st["server"]["connected"] == false);
    };
    let start = |d: &mut Driver| {
        d.handshake().unwrap();
        net_start(d, &[(0, true), (1, true)], feature(VIRTIO_F_VERSION_1));
    };
    // TX of one frame on a started session; the chain completes (read from the used ring).
    let tx = |d: &mut Driver, seed: u8| {
        let f = net_frame(100, seed);
        d.mem.write_slice(&f, GuestAddress(data_addr(1))).unwrap();
        d.post_descs(1, 0, &[(data_addr(1), f.len() as u32, false)]);
        assert_eq!(d.poll_used(1), Some((0, 0)), "TX chain {seed}");
        assert_eq!(s.bes[0].take_sent(), vec![f], "frame {seed}");
    };
    for (code, kind) in [
        (12u32, NotEventFd::PipeWithByte),
        (13, NotEventFd::Socket),
        (14, NotEventFd::File),
    ] {
        let mut d = s.connect();
        start(&mut d);
        d.set_mem_table().unwrap();
        let (fd, _other_end) = kind.make();
        assert!(
            refused(&d, code, &1u64.to_le_bytes(), vec![fd]),
            "{kind:?} accepted"
        );
        drop(d);
        ended(&format!("{kind:?}"));
    }
    let mut d = s.connect();
    start(&mut d);
    d.calls[0] = full_eventfd();
    d.calls[1] = full_eventfd();
    d.setup_rings(2).unwrap();
    sync(&mut d);
    tx(&mut d, 1);
    // RX too: a frame into the guest's buffer, signalled into the full counter.
    d.post_descs(0, 0, &[(data_addr(0), 2048, true)]);
    s.bes[0].inject(net_frame(64, 2));
    assert_eq!(d.poll_used(0), Some((0, 76)));
    assert_eq!(d.stop_ring(0), 1);
    assert_eq!(d.stop_ring(1), 1);
    let st = stats(&s.stats_path);
    assert!(st["transport"]["signal_errors"].as_u64() >= Some(2), "{st}");
    drop(d);
    ended("full call counters");
    let mut d = s.connect();
    start(&mut d);
    d.setup_rings(2).unwrap();
    sync(&mut d);
    tx(&mut d, 3);
    let st = stats(&s.stats_path);
    assert_eq!(st["server"]["relay"]["refused_fds"], 3, "{st}");
    s.end(d);
}

#[test]
fn net_regions_added_once_per_queue_pair_and_removed_while_running_are_served() {
    // QEMU 7.2's multi-queue vhost-user net adds (ADD_MEM_REG) and removes (REM_MEM_REG)
    // every region once per queue pair on the one connection. The copies are references to
    // one mapping: traffic goes on while any copy is registered, and a region removed for
    // good and added again (memory hot-unplug, then hot-plug) is served again.
    let s = NetServer::start("netslots.sock", 2);
    let mut d = s.connect();
    let offered = d
        .handshake_with(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
        .unwrap();
    let proto = d.frontend.get_protocol_features().unwrap();
    assert!(
        proto.contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS),
        "net must offer CONFIGURE_MEM_SLOTS: {proto:?}"
    );
    assert_eq!(d.frontend.get_max_mem_slots().unwrap(), 509);
    let acked = offered & (feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_MQ));
    net_start(&mut d, &[(0, true), (1, true), (2, true), (3, true)], acked);
    // Rings in the low region, data buffers (data_addr) in the high one.
    let half = MEM_SIZE as u64 / 2;
    assert!(data_addr(0) >= half);
    let [low, high] = d.regions_split_at(half);
    for _pair in 0..2 {
        d.frontend.add_mem_region(&low).unwrap();
        d.frontend.add_mem_region(&high).unwrap();
    }
    for q in 0..4 {
        d.configure_default_ring(q).unwrap();
    }
    sync(&mut d);
    // RX on pair `pair` into descriptor `desc` of its RX queue, TX of one frame on its TX
    // queue (descriptor `desc` too).
    let traffic = |d: &mut Driver, pair: usize, desc: u16, seed: u8| {
        let (rxq, txq) = (2 * pair, 2 * pair + 1);
        let buf = data_addr(rxq) + u64::from(desc) * 0x800;
        d.post_descs(rxq, desc, &[(buf, 2048, true)]);
        let f = net_frame(100, seed);
        s.bes[pair].inject(f.clone());
        assert_eq!(wait_next_used(d, rxq), (u32::from(desc), f.len() as u32));
        let mut got = vec![0u8; f.len()];
        d.mem.read_slice(&mut got, GuestAddress(buf)).unwrap();
        assert!(got[12..] == f[12..], "RX payload {seed}");
        let tx = net_frame(80, seed ^ 0x80);
        let tbuf = data_addr(txq) + u64::from(desc) * 0x800;
        d.mem.write_slice(&tx, GuestAddress(tbuf)).unwrap();
        d.post_descs(txq, desc, &[(tbuf, tx.len() as u32, false)]);
        assert_eq!(wait_next_used(d, txq), (u32::from(desc), 0));
        assert_eq!(s.bes[pair].take_sent(), vec![tx], "TX frame {seed}");
    };
    traffic(&mut d, 0, 0, 1);
    traffic(&mut d, 1, 0, 2);
    // Pair 1's device removes the data region: pair 0's copy keeps it mapped.
    d.frontend.remove_mem_region(&high).unwrap();
    traffic(&mut d, 0, 1, 3);
    traffic(&mut d, 1, 1, 4);
    // Both copies gone (hot-unplug), then added again by both pairs (hot-plug).
    d.frontend.remove_mem_region(&high).unwrap();
    sync(&mut d);
    d.frontend.add_mem_region(&high).unwrap();
    d.frontend.add_mem_region(&high).unwrap();
    sync(&mut d);
    traffic(&mut d, 0, 2, 5);
    traffic(&mut d, 1, 2, 6);
    let st = stats(&s.stats_path);
    // Copies: two adds at the start, one removal, one add after the hot-plug.
    assert_eq!(st["server"]["relay"]["region_copies"], 4, "{st}");
    assert_eq!(st["server"]["connected"], true, "{st}");
    assert_eq!(st["server"]["failed_sessions"], 0, "{st}");
    s.end(d);
}

/// A net device (front-end steering) on a new tap `bvmvh0` in the namespace `ns`: the tap is
/// created inside the namespace; its fds work from anywhere.
fn net_with_tap_in(ns: &Netns) -> Net {
    ns.run(|| {
        let cfg = NetConfig {
            frontend_steering: true,
            ..NetConfig::default()
        };
        Net::with_tap(cfg, "bvmvh0", Dma::direct())
    })
    .expect("tap in the namespace")
}

#[test]
fn a_tap_deleted_under_the_backend_is_counted_and_the_backend_keeps_serving() {
    // The tap of `bouncevm-vhost net` deleted under it (`ip link del`, or
    // its namespace removed). Its fd polls as EPOLLERR: the adapter must stop polling it (no
    // busy loop), the guest's frames are dropped and counted, and the control path, the
    // statistics and the shutdown keep working.
    if let Some((resource, why)) = netns_missing() {
        return bounce::testing::missing(resource, why);
    }
    let netns = Netns::new("bvm-vhtap");
    let ns = netns.0.clone();
    let net = net_with_tap_in(&netns);
    {
        ip(&["-n", &ns, "link", "set", "bvmvh0", "up"]);
        let s = NetServer::serve("nettapgone.sock", net, Vec::new(), 3);
        let mut d = s.connect();
        d.handshake().unwrap();
        net_start(&mut d, &[(0, true), (1, true)], feature(VIRTIO_F_VERSION_1));
        d.setup_rings(2).unwrap();
        sync(&mut d);
        let tx = |d: &mut Driver, i: u16| {
            let f = net_frame(100, 5);
            let a = data_addr(1) + u64::from(i) * 0x200;
            d.mem.write_slice(&f, GuestAddress(a)).unwrap();
            d.post_descs(1, i, &[(a, f.len() as u32, false)]);
            assert_eq!(wait_next_used(d, 1), (u32::from(i), 0), "TX chain {i}");
        };
        tx(&mut d, 0);
        let net_stat = |st: &serde_json::Value, k: &str| st["device"]["net"][k].as_u64().unwrap();
        assert_eq!(net_stat(&stats(&s.stats_path), "tx_frames"), 1);

        ip(&["-n", &ns, "link", "del", "bvmvh0"]);
        // TX keeps completing the guest's chains, counted as dropped.
        tx(&mut d, 1);
        tx(&mut d, 2);
        // RX: a buffer and a kick; the read error is counted, the buffer stays the guest's.
        d.post_descs(0, 0, &[(data_addr(0), 2048, true)]);
        let st = wait_stats(&s.stats_path, "rx error counted", |st| {
            net_stat(st, "rx_backend_errors") >= 1
        });
        assert_eq!(net_stat(&st, "tx_frames"), 1, "{st}");
        assert_eq!(net_stat(&st, "tx_dropped_backend"), 2, "{st}");
        assert_eq!(st["transport"]["broken_workers"], 0, "{st}");
        // No busy loop on the dead fd: the event counters stand still.
        let events = |st: &serde_json::Value| {
            (
                st["transport"]["fd_events"].clone(),
                st["transport"]["kicks"].clone(),
            )
        };
        let before = events(&stats(&s.stats_path));
        thread::sleep(Duration::from_millis(300));
        let after = events(&stats(&s.stats_path));
        assert_eq!(before, after, "events keep coming from the dead tap");
        // The control path answers: the stop counts the 3 TX chains, and on RX only a buffer
        // the guest got back (a frame the tap sent before it went, e.g. IPv6 neighbour
        // discovery, or none).
        let rx_used = std::iter::from_fn(|| d.next_used(0)).count();
        assert_eq!(d.frontend.get_vring_base(0).unwrap() as usize, rx_used);
        assert_eq!(d.frontend.get_vring_base(1).unwrap(), 3);
        s.end(d);
    }
}
