//! Front ends that break the rules against `bouncevm-vhost blk` (the binary, bounce forced):
//! each hostile session costs only itself, and the next front end is served.
//!
//! - kick, call and error fds that are not eventfds (a pipe holding one byte, a regular file,
//!   a socket) are refused;
//! - a call or error eventfd whose counter is full (a blocking write would never return)
//!   blocks nothing: the request completes, GET_VRING_BASE answers, the session ends;
//! - SET_VRING_NUM with a size that is not a power of two, or above the maximum, is refused;
//! - a memory region reaching past the end of its file, in a table or added alone
//!   (ADD_MEM_REG), is refused (never mapped: no SIGBUS);
//! - a memory table listing its regions out of address order is served;
//! - GET_VRING_BASE with requests in flight at depth (every cache mode, bounce off and forced)
//!   answers only once every request it counts has its status and used entry;
//! - conditions a front end can repeat at will are logged once and counted always, and no
//!   front-end fd outlives its session (sessions with a broken queue, a refused kick pipe,
//!   a full call counter, an end mid-setup, regions added with ADD_MEM_REG, an inflight region
//!   asked for and handed back), for `bouncevm-vhost blk` and `bouncevm-vhost net` (on a tap of
//!   its own).
//!
//! The other hostile net front ends are in `vhost_net_hostile.rs` (the binary, and an
//! in-process server over memory backends for stops at depth) and `vhost_protocol.rs`.

mod vhost_support;

use std::os::fd::AsRawFd;
use std::time::Duration;

use bouncevm_vhost::relay::req::{ADD_MEM_REG, SET_MEM_TABLE, SET_VRING_KICK, SET_VRING_NUM};
use devices::block::STATUS_UNSET;
use devices::virtio::spec::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use vhost::vhost_user::message::{VhostUserInflight, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost_support::child::Server;
use vhost_support::{
    assert_blk_served, blk_request, blk_request_on, blk_status, break_queue_0, data_addr,
    full_eventfd, mem_table_body, negotiated_on, post_zeroed_reads, refused, Driver, NotEventFd,
    BATCH, BLK_DATA, BLK_HDRS, BLK_STATUS, MEM_SIZE, QSIZE, WANTED,
};
use vm_memory::{Bytes, GuestAddress};

const NEEDS_RESET: u8 = 0x40;

/// Connects and negotiates (REPLY_ACK, STATUS) up to SET_FEATURES.
fn negotiated(server: &Server) -> Driver {
    negotiated_on(&server.sock, 1)
}

/// Sends `message` (request, body, fds) on `d`, which the server must refuse, ending the
/// session; then the server is alive and the next front end is served (`seed`).
fn refused_then_next_served(
    server: &mut Server,
    d: Driver,
    message: (u32, &[u8], Vec<std::os::fd::OwnedFd>),
    what: &str,
    seed: u64,
) {
    let (code, body, fds) = message;
    assert!(refused(&d, code, body, fds), "{what} was accepted");
    ended_then_next_served(server, d, what, seed);
}

/// Ends `d`'s session; the server notices, is alive, and serves the next front end (`seed`).
fn ended_then_next_served(server: &mut Server, d: Driver, what: &str, seed: u64) {
    drop(d);
    server.wait_disconnected(what);
    server.assert_alive(what);
    assert_blk_served(&server.sock, seed);
}

/// SET_MEM_TABLE and queue 0 configured and enabled (with whatever fds the driver holds).
fn start_queue_0(d: &mut Driver) {
    d.set_mem_table().unwrap();
    d.configure_default_ring(0).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
}

/// A SET_VRING_NUM body.
fn vring_num(index: u32, num: u32) -> Vec<u8> {
    let mut body = index.to_le_bytes().to_vec();
    body.extend_from_slice(&num.to_le_bytes());
    body
}

#[test]
fn kick_call_and_error_fds_that_are_not_eventfds_are_refused() {
    let mut server = Server::start();
    let mut seed = 0;
    for (code, name) in [(12u32, "kick"), (13, "call"), (14, "error")] {
        for kind in NotEventFd::ALL {
            let what = format!("{name} fd {kind:?}");
            let mut d = negotiated(&server);
            d.set_mem_table().unwrap();
            let (fd, _other_end) = kind.make();
            seed += 1;
            let message = (code, &0u64.to_le_bytes()[..], vec![fd]);
            refused_then_next_served(&mut server, d, message, &what, seed);
        }
    }
    let st = server.stats();
    assert_eq!(st["server"]["relay"]["refused_fds"], 9, "{st}");
}

#[test]
fn a_call_eventfd_whose_counter_is_full_blocks_nothing() {
    let mut server = Server::start();
    let mut d = negotiated(&server);
    d.calls[0] = full_eventfd();
    start_queue_0(&mut d);
    write_completes(&mut d, 0x5a);
    assert_eq!(blk_status(&d, 0), VIRTIO_BLK_S_OK);
    // The worker did not block signalling the full counter: the stop answers.
    assert_eq!(d.stop_ring(0), 1);
    let st = server.stats();
    assert!(
        st["transport"]["signal_errors"].as_u64() >= Some(1),
        "the full counter was not counted: {st}"
    );
    ended_then_next_served(&mut server, d, "full call counter", 1);
}

#[test]
fn an_error_eventfd_whose_counter_is_full_blocks_nothing() {
    let mut server = Server::start();
    let mut d = negotiated(&server);
    d.errs[0] = full_eventfd();
    d.set_mem_table().unwrap();
    // The report signals the (full) error fd of the broken worker.
    break_queue_0(&mut d);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = server.stats();
        if st["transport"]["broken_workers"] == 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never broken: {st}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(d.get_status() & NEEDS_RESET, NEEDS_RESET);
    assert_eq!(d.stop_ring(0), 0);
    ended_then_next_served(&mut server, d, "full error counter", 2);
}

#[test]
fn queue_sizes_that_are_not_powers_of_two_or_above_the_maximum_are_refused() {
    let mut server = Server::start();
    for (seed, num) in [3u32, 100, 255, 512, 65535].into_iter().enumerate() {
        let what = format!("queue size {num}");
        let mut d = negotiated(&server);
        d.set_mem_table().unwrap();
        let body = vring_num(0, num);
        let message = (SET_VRING_NUM, &body[..], vec![]);
        refused_then_next_served(&mut server, d, message, &what, seed as u64);
    }
    // The largest size is accepted.
    let d = negotiated(&server);
    assert!(!refused(&d, SET_VRING_NUM, &vring_num(0, 256), vec![]));
    let st = server.stats();
    assert_eq!(st["server"]["relay"]["refused_queue_sizes"], 5, "{st}");
}

#[test]
fn a_region_past_the_end_of_its_file_is_refused() {
    let mut server = Server::start();
    let size = MEM_SIZE as u64;
    // (size, offset): one page past the end, or reaching it through the offset; in a memory
    // table, and added alone (ADD_MEM_REG, as libblkio and QEMU with CONFIGURE_MEM_SLOTS do).
    let cases = [(size + 4096, 0), (size, 4096), (4096, size)];
    let mut seed = 0;
    for (code, name) in [
        (SET_MEM_TABLE, "SET_MEM_TABLE"),
        (ADD_MEM_REG, "ADD_MEM_REG"),
    ] {
        for (len, offset) in cases {
            let what = format!("{name} of {len:#x} at offset {offset:#x}");
            let d = negotiated(&server);
            let (file, base) = d.memfd_and_base();
            let mut body = mem_table_body(&[(0, len, base, offset)]);
            if code == ADD_MEM_REG {
                // One region after 8 bytes of padding, where a table has its count.
                body[..8].fill(0);
            }
            seed += 1;
            let message = (code, &body[..], vec![file]);
            refused_then_next_served(&mut server, d, message, &what, seed);
        }
    }
    let st = server.stats();
    assert_eq!(st["server"]["relay"]["refused_mem_tables"], 6, "{st}");
}

#[test]
fn a_memory_table_out_of_address_order_is_served() {
    let server = Server::start();
    let mut d = negotiated(&server);
    let (file, base) = d.memfd_and_base();
    let half = MEM_SIZE as u64 / 2;
    // The upper half (data buffers) listed before the lower half (rings).
    let body = mem_table_body(&[(half, half, base + half, half), (0, half, base, 0)]);
    let other = file.try_clone().unwrap();
    assert!(!refused(&d, SET_MEM_TABLE, &body, vec![file, other]));
    d.configure_default_ring(0).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    assert!(BLK_DATA >= half, "the data buffers are in the upper region");
    blk_request(&mut d, 0, VIRTIO_BLK_T_OUT, 64, Some(&data));
    assert!(d.poll_used(0).is_some());
    assert_eq!(blk_status(&d, 0), VIRTIO_BLK_S_OK);
    blk_request(&mut d, 1, VIRTIO_BLK_T_IN, 64, None);
    assert!(d.poll_used(0).is_some());
    assert_eq!(blk_status(&d, 1), VIRTIO_BLK_S_OK);
    let mut got = vec![0u8; 4096];
    d.mem
        .read_slice(&mut got, GuestAddress(BLK_DATA + 4096))
        .unwrap();
    assert!(got == data, "read back differs");
    let st = server.stats();
    assert_eq!(st["server"]["relay"]["mem_tables_sorted"], 1, "{st}");
}

/// Lines of the server's log containing `needle`.
fn log_lines(server: &Server, needle: &str) -> usize {
    std::fs::read_to_string(&server.log)
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[test]
fn conditions_a_front_end_repeats_are_logged_once_and_counted_always() {
    let mut server = Server::start();
    const REPEATS: usize = 2000;
    for session in 0..2 {
        let mut d = Driver::connect(&server.sock, 1);
        d.handshake().unwrap();
        // Before SET_FEATURES: an enable for a queue the device does not have, and a
        // SET_STATUS without its status, over and over.
        let mut bad_enable = 4000u32.to_le_bytes().to_vec();
        bad_enable.extend_from_slice(&1u32.to_le_bytes());
        for _ in 0..REPEATS {
            d.raw_request(18, 0x1, &bad_enable, false);
            d.raw_request(39, 0x1, &[], false);
        }
        // Answered after everything before it was handled.
        d.raw_request(1, 0x1, &[], true);
        drop(d);
        server.wait_disconnected(&format!("session {session}"));
    }
    // Sessions the backend ends on a protocol error: features it never offered.
    for session in 0..3 {
        let mut d = Driver::connect(&server.sock, 1);
        d.handshake().unwrap();
        d.raw_request(2, 0x1, &u64::MAX.to_le_bytes(), false);
        server.wait_disconnected(&format!("refused features {session}"));
    }
    server.assert_alive("after the repeats");
    let st = server.stats();
    let relay = &st["server"]["relay"];
    assert_eq!(relay["early_enables_refused"], 2 * REPEATS, "{st}");
    assert_eq!(relay["malformed_status"], 2 * REPEATS, "{st}");
    assert_eq!(st["server"]["failed_sessions"], 3, "{st}");
    assert_eq!(log_lines(&server, "refusing early SET_VRING_ENABLE"), 1);
    assert_eq!(log_lines(&server, "SET_STATUS without a status"), 1);
    assert_eq!(log_lines(&server, "ended:"), 1);
    assert_blk_served(&server.sock, 7);
}

#[test]
fn request_errors_and_failed_signals_in_one_session_are_logged_once_and_counted_always() {
    // One session, its call eventfd at its maximum (every notification fails), and 1,000
    // each of: a header shorter than 16 bytes, a read past the end of the disk, a request of
    // an unknown type. Every one is completed with an error status and counted; each kind is
    // logged once. Then three sessions that each send a message too large to read.
    const REPEATS: u64 = 1000;
    let mut server = Server::start();
    let mut d = negotiated(&server);
    d.calls[0] = full_eventfd();
    start_queue_0(&mut d);
    let buf = BLK_DATA;
    for round in 0..REPEATS {
        let (hdr, status) = (BLK_HDRS, BLK_STATUS);
        d.mem.write_slice(&[0u8; 16], GuestAddress(hdr)).unwrap();
        d.mem.write_obj(STATUS_UNSET, GuestAddress(status)).unwrap();
        d.post_descs(0, 0, &[(hdr, 8, false), (status, 1, true)]);
        blk_request_on(&mut d, 0, 1, VIRTIO_BLK_T_IN, 1 << 40, buf, 4096);
        blk_request_on(&mut d, 0, 2, 0xff, 0, buf, 4096);
        let mut heads: Vec<u32> = (0..3)
            .map(|_| d.poll_used(0).expect("a request never completed").0)
            .collect();
        heads.sort_unstable();
        assert_eq!(heads, [0, 3, 6], "round {round}");
        assert_eq!(blk_status(&d, 0), VIRTIO_BLK_S_IOERR, "round {round}");
        assert_eq!(blk_status(&d, 1), VIRTIO_BLK_S_IOERR, "round {round}");
        assert_eq!(blk_status(&d, 2), VIRTIO_BLK_S_UNSUPP, "round {round}");
    }
    let st = server.stats();
    let metrics = &st["device"]["metrics"];
    assert_eq!(metrics["err_bad_chain"], REPEATS, "{st}");
    assert_eq!(metrics["err_out_of_range"], REPEATS, "{st}");
    assert_eq!(metrics["err_unsupported"], REPEATS, "{st}");
    let transport = &st["transport"];
    assert!(transport["signals"].as_u64() >= Some(REPEATS), "{st}");
    assert_eq!(transport["signal_errors"], transport["signals"], "{st}");
    drop(d);
    server.wait_disconnected("repeated request errors");
    for counter in [
        "metrics.err_bad_chain",
        "metrics.err_out_of_range",
        "metrics.err_unsupported",
        "signal_errors",
    ] {
        assert_eq!(
            log_lines(&server, &format!("counted in {counter})")),
            1,
            "log lines naming {counter}"
        );
    }
    // Messages that cannot be read (a body over the relay's 64 KiB), each ending its session.
    for session in 1..=3u64 {
        let d = Driver::connect(&server.sock, 1);
        let mut header = 1u32.to_le_bytes().to_vec();
        header.extend_from_slice(&1u32.to_le_bytes());
        header.extend_from_slice(&(64u32 * 1024 + 1).to_le_bytes());
        std::io::Write::write_all(&mut &d.raw, &header).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while server.stats()["server"]["relay"]["unreadable_messages"] != session {
            assert!(
                std::time::Instant::now() < deadline,
                "unreadable message {session} not counted"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        server.wait_disconnected("unreadable message");
    }
    assert_eq!(log_lines(&server, "message cannot be read"), 1);
    server.assert_alive("after the repeats");
    assert_blk_served(&server.sock, 8);
}

/// The server's open fds (`/proc/PID/fd`) by kind: the `readlink` target without its inode
/// (`socket`, `pipe`, `anon_inode:[eventfd]`, `/memfd:...`), with how many of each.
fn fds_by_kind(server: &Server) -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{}/fd", server.child.id())).unwrap() {
        let Some(target) = entry.ok().and_then(|e| std::fs::read_link(e.path()).ok()) else {
            continue; // closed between the listing and the readlink
        };
        let target = target.to_string_lossy().into_owned();
        let kind = match target.split_once(":[") {
            Some((kind, _)) if !target.starts_with("anon_inode") => kind.to_string(),
            _ => target
                .split(" (deleted)")
                .next()
                .unwrap_or_default()
                .to_string(),
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    kinds
}

/// What a front end's session is, the session (its driver left as the session ends), and the
/// seed of the benign front end served after it.
type Session = (&'static str, fn(&Server) -> Driver, u8);

/// Serves a benign front end first (`serve` with seed 1): whatever the server creates once and
/// keeps (the listening socket, its log, the disk file or tap, the bounce pool) is the
/// baseline. Then each of `sessions`: once it has ended and the next benign front end (its
/// seed) has been served, the server holds the fds of the baseline.
fn assert_no_fd_outlives(server: &mut Server, serve: fn(&Server, u8), sessions: &[Session]) {
    serve(server, 1);
    server.wait_disconnected("first session");
    let baseline = fds_by_kind(server);
    assert!(
        baseline.get("socket") >= Some(&1),
        "the listening socket is not among the server's fds: {baseline:?}"
    );
    for &(what, session, seed) in sessions {
        // The session ends with its driver.
        drop(session(server));
        server.wait_disconnected(what);
        server.assert_alive(what);
        serve(server, seed);
        server.wait_disconnected(what);
        assert_eq!(
            fds_by_kind(server),
            baseline,
            "the server keeps a front end's fd after {what}"
        );
    }
}

/// A session of a device of `queues` queues with kick, call and error eventfds on queue 0,
/// its worker broken (the error fd signalled), queues `running` configured and enabled.
fn with_error_fd(server: &Server, queues: usize, running: &[usize]) -> Driver {
    let mut d = negotiated_on(&server.sock, queues);
    d.set_mem_table().unwrap();
    for &q in running {
        d.configure_default_ring(q).unwrap();
        d.frontend.set_vring_enable(q, true).unwrap();
    }
    break_queue_0(&mut d);
    assert!(
        d.wait_err(0, Duration::from_secs(10)),
        "the error fd was not signalled"
    );
    d
}

/// A session whose kick fd for queue `index` is a pipe holding one byte, refused.
fn kick_pipe_refused(server: &Server, queues: usize, index: u64) -> Driver {
    let mut d = negotiated_on(&server.sock, queues);
    d.set_mem_table().unwrap();
    let (pipe, _write_end) = NotEventFd::PipeWithByte.make();
    assert!(
        refused(&d, SET_VRING_KICK, &index.to_le_bytes(), vec![pipe]),
        "the pipe was accepted"
    );
    d
}

/// A session that ends mid-setup: memory mapped, queue 0's fds handed over, never enabled.
fn ended_mid_setup(server: &Server, queues: usize) -> Driver {
    let mut d = negotiated_on(&server.sock, queues);
    d.set_mem_table().unwrap();
    d.configure_default_ring(0).unwrap();
    d
}

/// Writes 4 KiB of `byte` at sector 8 on queue 0 and waits for its completion.
fn write_completes(d: &mut Driver, byte: u8) {
    blk_request(d, 0, VIRTIO_BLK_T_OUT, 8, Some(&[byte; 4096]));
    assert!(d.poll_used(0).is_some(), "the write never completed");
}

/// Guest memory added region by region (ADD_MEM_REG, two halves), queue 0 running on it, and
/// a write of `byte`s served.
fn write_on_added_regions(d: &mut Driver, byte: u8) {
    for region in d.regions_split_at(MEM_SIZE as u64 / 2) {
        d.frontend.add_mem_region(&region).unwrap();
    }
    d.configure_default_ring(0).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    write_completes(d, byte);
}

#[test]
fn no_front_end_fd_outlives_its_session() {
    let mut server = Server::start();
    let sessions: [Session; 6] = [
        // Kick, call and error eventfds on its queue, its worker broken (the error fd
        // signalled).
        (
            "a session with an error fd",
            |server| with_error_fd(server, 1, &[]),
            2,
        ),
        // A kick fd that is a pipe holding one byte, refused.
        (
            "a refused kick pipe",
            |server| kick_pipe_refused(server, 1, 0),
            3,
        ),
        // A call eventfd at its maximum, the queue served, then gone.
        (
            "a full call counter",
            |server| {
                let mut d = negotiated(server);
                d.calls[0] = full_eventfd();
                start_queue_0(&mut d);
                write_completes(&mut d, 0x5a);
                d
            },
            4,
        ),
        // A session that ends mid-setup: memory mapped, the ring's fds handed over, never
        // enabled.
        (
            "a session ended mid-setup",
            |server| ended_mid_setup(server, 1),
            5,
        ),
        // Memory added region by region (ADD_MEM_REG), a queue running on it.
        (
            "a session with added regions",
            |server| {
                let mut d = negotiated(server);
                write_on_added_regions(&mut d, 0xa5);
                d
            },
            6,
        ),
        // An inflight region asked for (GET_INFLIGHT_FD: a memfd the server creates) and
        // handed back (SET_INFLIGHT_FD), memory added region by region, a queue running on
        // both.
        (
            "a session with an inflight region and added regions",
            |server| {
                let mut d = Driver::connect(&server.sock, 1);
                d.negotiate(
                    VhostUserProtocolFeatures::INFLIGHT_SHMFD
                        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS,
                    WANTED,
                )
                .unwrap();
                let (info, region) = d
                    .frontend
                    .get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE))
                    .unwrap();
                d.frontend
                    .set_inflight_fd(&info, region.as_raw_fd())
                    .unwrap();
                write_on_added_regions(&mut d, 0x3c);
                drop(region);
                let st = server.stats();
                let relay = &st["server"]["relay"];
                assert_eq!(relay["inflight_regions_created"], 1, "{st}");
                assert_eq!(relay["inflight_regions_adopted"], 1, "{st}");
                d
            },
            7,
        ),
    ];
    assert_no_fd_outlives(
        &mut server,
        |s, seed| assert_blk_served(&s.sock, u64::from(seed)),
        &sessions,
    );
}

/// One queue pair of `bouncevm-vhost net` started (features, memory, both rings): the rings
/// configured with the driver's fds by `rings`, then enabled.
fn net_started(server: &Server, rings: impl FnOnce(&mut Driver)) -> Driver {
    let mut d = negotiated_on(&server.sock, 3);
    rings(&mut d);
    d.frontend.set_vring_enable(0, true).unwrap();
    d.frontend.set_vring_enable(1, true).unwrap();
    d
}

/// A frame of `len` bytes after a zeroed vnet header, sent on TX (queue 1) and completed.
fn net_tx(d: &mut Driver, seed: u8) {
    let mut f = vec![0u8; 12];
    f.extend((0..200u8).map(|i| i.wrapping_mul(7).wrapping_add(seed)));
    d.mem.write_slice(&f, GuestAddress(data_addr(1))).unwrap();
    d.post_descs(1, 0, &[(data_addr(1), f.len() as u32, false)]);
    assert_eq!(d.poll_used(1), Some((0, 0)), "TX chain {seed}");
}

/// A well-formed front end gets a frame sent through `bouncevm-vhost net`.
fn assert_net_served(server: &Server, seed: u8) {
    let mut d = net_started(server, |d| d.setup_rings(2).unwrap());
    net_tx(&mut d, seed);
}

#[test]
fn no_front_end_fd_outlives_a_net_session() {
    use bounce::testing::{missing, Resource};
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return missing(Resource::Root, "not root");
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return missing(Resource::Tun, "/dev/net/tun is missing");
    }
    // The tap is the server's own (created, down, gone with the process); frames sent to it
    // are dropped and counted, the guest's chains complete.
    let tap = format!("bvmfd{}", std::process::id() % 1_000_000);
    let mut server = Server::start_net(&tap, &["--bounce", "policy=force,slots=1024"]);
    let sessions: [Session; 5] = [
        // RX's rings at the end of guest memory: the worker is broken, the error fd signalled.
        (
            "a net session with an error fd",
            |server| with_error_fd(server, 3, &[1]),
            2,
        ),
        // A kick fd that is a pipe holding one byte, refused.
        (
            "a refused net kick pipe",
            |server| kick_pipe_refused(server, 3, 1),
            3,
        ),
        // Call eventfds at their maximum, TX served, then gone.
        (
            "full net call counters",
            |server| {
                let mut d = net_started(server, |d| {
                    d.calls[0] = full_eventfd();
                    d.calls[1] = full_eventfd();
                    d.setup_rings(2).unwrap();
                });
                net_tx(&mut d, 4);
                d
            },
            5,
        ),
        // Memory added region by region (ADD_MEM_REG), TX running on it.
        (
            "a net session with added regions",
            |server| {
                let mut d = net_started(server, |d| {
                    for r in d.regions_split_at(MEM_SIZE as u64 / 2) {
                        d.frontend.add_mem_region(&r).unwrap();
                    }
                    d.configure_default_ring(0).unwrap();
                    d.configure_default_ring(1).unwrap();
                });
                net_tx(&mut d, 6);
                d
            },
            7,
        ),
        // A session that ends mid-setup.
        (
            "a net session ended mid-setup",
            |server| ended_mid_setup(server, 3),
            8,
        ),
    ];
    assert_no_fd_outlives(&mut server, assert_net_served, &sessions);
}

/// Bytes of each request of [`a_stop_with_requests_in_flight_returns_every_one_it_counts`]:
/// [`BATCH`] of them fill the data area.
const LARGE: u32 = 192 << 10;

/// The bytes written at `slot` in `round`.
fn large_pattern(slot: u16, round: u8) -> Vec<u8> {
    (0..LARGE)
        .map(|i| (i as u8).wrapping_mul(13) ^ (slot as u8).wrapping_mul(71) ^ round)
        .collect()
}

/// GET_VRING_BASE of queue 0: the base it answers, once it is checked that a call is pending
/// when the base counts completions (each completion is signalled before the reply).
fn stopped_and_signalled(d: &mut Driver, what: &str) -> u32 {
    let base = d.stop_ring(0);
    assert!(
        base == 0 || d.calls[0].read().is_ok(),
        "{what}: {base} counted at the stop but no call signalled before its reply"
    );
    base
}

#[test]
fn a_stop_with_requests_in_flight_returns_every_one_it_counts() {
    // QEMU sends GET_VRING_BASE on `stop`, on migration and on a device reset, and resumes
    // the ring at the index it gets back: every request that index counts must be back in
    // the used ring with its status by then, or the guest never sees it complete.
    let caches = ["none", "writeback", "writethrough", "directsync", "unsafe"];
    let bounces: [&[&str]; 2] = [&[], &["--bounce", "policy=force"]];
    for cache in caches {
        for bounce in bounces {
            let mut args = vec!["--cache", cache];
            args.extend_from_slice(bounce);
            let server = Server::start_with(&args);
            let sector = |slot: u16| u64::from(slot) * u64::from(LARGE / 512);
            let buf = |slot: u16| BLK_DATA + u64::from(slot) * u64::from(LARGE);
            let write = |d: &mut Driver, slot: u16, round: u8| {
                let data = large_pattern(slot, round);
                d.mem.write_slice(&data, GuestAddress(buf(slot))).unwrap();
                blk_request_on(d, 0, slot, VIRTIO_BLK_T_OUT, sector(slot), buf(slot), LARGE);
            };
            for round in 0..3u8 {
                let what = format!("cache={cache} {bounce:?} round {round}");
                let mut d = negotiated(&server);
                start_queue_0(&mut d);
                // Writes at depth, stopped at once: whatever the base counts is complete.
                for slot in 0..BATCH {
                    write(&mut d, slot, round);
                }
                let base = stopped_and_signalled(&mut d, &format!("{what}: writes"));
                let mut used = 0;
                while let Some((id, _)) = d.next_used(0) {
                    let slot = u16::try_from(id / 3).unwrap();
                    assert_eq!(
                        blk_status(&d, slot),
                        VIRTIO_BLK_S_OK,
                        "{what}: write {slot}"
                    );
                    used += 1;
                }
                assert_eq!(used, base, "{what}: writes counted but not returned");
                drop(d);
                server.wait_disconnected(&what);
                // Reads at depth of what every write put there (each write the stop did not
                // count is written again first), stopped at once, checked byte for byte.
                let mut d = negotiated(&server);
                start_queue_0(&mut d);
                for slot in u16::try_from(base).unwrap()..BATCH {
                    write(&mut d, slot, round);
                    assert!(d.poll_used(0).is_some(), "{what}: rewrite {slot}");
                    assert_eq!(
                        blk_status(&d, slot),
                        VIRTIO_BLK_S_OK,
                        "{what}: rewrite {slot}"
                    );
                }
                drop(d);
                server.wait_disconnected(&what);
                let mut d = negotiated(&server);
                start_queue_0(&mut d);
                post_zeroed_reads(&mut d, 0, 0..BATCH, sector, buf, LARGE);
                let base = stopped_and_signalled(&mut d, &format!("{what}: reads"));
                let mut used = 0;
                while let Some((id, len)) = d.next_used(0) {
                    let slot = u16::try_from(id / 3).unwrap();
                    assert_eq!(blk_status(&d, slot), VIRTIO_BLK_S_OK, "{what}: read {slot}");
                    assert_eq!(len, LARGE + 1, "{what}: read {slot}");
                    let mut got = vec![0u8; LARGE as usize];
                    d.mem.read_slice(&mut got, GuestAddress(buf(slot))).unwrap();
                    assert!(
                        got == large_pattern(slot, round),
                        "{what}: read {slot} differs"
                    );
                    used += 1;
                }
                assert_eq!(used, base, "{what}: reads counted but not returned");
                drop(d);
                server.wait_disconnected(&what);
            }
        }
    }
}
