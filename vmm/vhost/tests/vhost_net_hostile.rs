//! vhost-user-net front ends that break the rules, or stop the device with chains in flight,
//! against `bouncevm-vhost net` (the binary, on a tap of its own or in a network namespace) and
//! against its net device in process (over memory backends, where every frame can be counted):
//!
//! - an error eventfd whose counter is full blocks nothing: the broken pair is reported, the
//!   stop answers, the session ends, the next front end is served; logged once, counted;
//! - a region reaching past the end of its file, added alone (ADD_MEM_REG), is refused with a
//!   failure reply (never mapped: no SIGBUS), and the next front end is served;
//! - a disconnect and a RESET_DEVICE with TX and RX chains posted at depth, the worker busy with
//!   them: every chain the device took has its used entry (a TX frame sent, an RX frame
//!   written) and is signalled before the session ends or the reset is answered, nothing is
//!   written after; a new session resuming at the used index serves the rest, each chain once;
//! - the binary in a network namespace: after those sessions, a UDP datagram goes from the
//!   guest to a socket behind the tap and its answer comes back; the statistics (socket and
//!   SIGUSR1 line) count the traffic and still show what the ended hostile sessions did,
//!   for `net` and for `blk`.

mod vhost_support;

use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use devices::net::ShaperConfig;
use devices::virtio::spec::{VIRTIO_BLK_T_OUT, VIRTIO_CONFIG_S_NEEDS_RESET};
use vhost::vhost_user::message::{FrontendReq, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vhost_support::child::Server;
use vhost_support::inproc::wait_stats;
use vhost_support::net::{
    assert_net_served, ip, net_frame, net_negotiate, net_negotiated_with, net_next_served,
    net_rings, net_server_on, netns_missing, tap_missing, Netns,
};
use vhost_support::{
    assert_blk_served, blk_request, break_queue_0, data_addr, first_completion, full_eventfd,
    mem_table_body, negotiated_on, poll_now, refused, reply_to, Driver, Reply, MEM_SIZE,
};
use vm_memory::{Bytes, GuestAddress};

const ADD_MEM_REG: u32 = FrontendReq::ADD_MEM_REG as u32;
const RESET_DEVICE: u32 = FrontendReq::RESET_DEVICE as u32;
/// Chains posted on each of TX and RX in the cases at depth, half before the device is seen
/// busy and half while it is, and the size of their rings.
const DEPTH: u16 = 32;
const DEEP_QUEUE: u16 = 128;

/// `bouncevm-vhost net` (bounce forced) on a tap of its own (created, down: frames sent to it
/// are dropped and counted, the guest's chains complete); `None` without root or a tun device.
fn net_binary(name: &str) -> Option<Server> {
    if let Some((resource, why)) = tap_missing() {
        bounce::testing::missing(resource, why);
        return None;
    }
    let tap = format!("{name}{}", std::process::id() % 1_000_000);
    Some(Server::start_net(
        &tap,
        &["--bounce", "policy=force,slots=1024"],
    ))
}

/// A net session whose error eventfds are full breaks its queue pair (RX's avail ring at the
/// end of guest memory); the report signals both full counters without blocking, the stop
/// answers on both queues, the session ends and the next front end is served (`seed`).
fn broken_with_full_error_fds(server: &mut Server, what: &str, seed: u8) {
    let mut d = negotiated_on(&server.sock, 3);
    d.errs[0] = full_eventfd();
    d.errs[1] = full_eventfd();
    d.set_mem_table().unwrap();
    d.configure_default_ring(1).unwrap();
    d.frontend.set_vring_enable(1, true).unwrap();
    break_queue_0(&mut d);
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.get_status() & VIRTIO_CONFIG_S_NEEDS_RESET == 0 {
        assert!(Instant::now() < deadline, "{what}: the pair never broke");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(d.stop_ring(0), 0, "{what}");
    assert_eq!(d.stop_ring(1), 0, "{what}");
    ended_then_net_served(server, d, what, seed);
}

/// Ends `d`'s session; the server notices, is alive, and serves the next front end (`seed`).
fn ended_then_net_served(server: &mut Server, d: Driver, what: &str, seed: u8) {
    drop(d);
    server.wait_disconnected(what);
    server.assert_alive(what);
    assert_net_served(server, seed);
    server.wait_disconnected(what);
}

#[test]
fn a_full_error_eventfd_blocks_no_net_session_and_is_logged_once_and_counted() {
    let Some(mut server) = net_binary("bvmne") else {
        return;
    };
    const SESSIONS: u64 = 3;
    for session in 0..SESSIONS {
        broken_with_full_error_fds(&mut server, &format!("session {session}"), session as u8);
    }
    let st = server.stats();
    assert_eq!(st["transport"]["broken_workers"], SESSIONS, "{st}");
    assert_eq!(
        st["transport"]["error_signal_failures"],
        2 * SESSIONS,
        "{st}"
    );
    assert_eq!(server.log_lines("counted in error_signal_failures"), 1);
}

/// Regions reaching past the end of their file (guest address, size, file offset), each
/// added alone: a page past the end, the end reached through the offset, and the upper half
/// of memory, one page too long, added after the lower half was (memory hot-plug).
fn short_regions() -> [(u64, u64, u64); 4] {
    let size = MEM_SIZE as u64;
    let half = size / 2;
    [
        (0, size + 4096, 0),
        (0, size, 4096),
        (0, 4096, size),
        (half, half + 4096, half),
    ]
}

/// Sends `region` (guest address, size, file offset) alone with ADD_MEM_REG on a new net
/// session (after the lower half of memory when the region starts above it): refused, then
/// the next front end is served (`seed`).
fn short_region_refused(server: &mut Server, region: (u64, u64, u64), seed: u8) {
    let (gpa, len, offset) = region;
    let what = format!("ADD_MEM_REG of {len:#x} bytes at {gpa:#x}, file offset {offset:#x}");
    let mut d = negotiated_on(&server.sock, 3);
    if gpa > 0 {
        let [low, _] = d.regions_split_at(gpa);
        d.frontend.add_mem_region(&low).unwrap();
    }
    let (file, base) = d.memfd_and_base();
    let mut body = mem_table_body(&[(gpa, len, base + gpa, offset)]);
    // One region after 8 bytes of padding, where a table has its count.
    body[..8].fill(0);
    assert!(
        refused(&d, ADD_MEM_REG, &body, vec![file]),
        "{what} was accepted"
    );
    ended_then_net_served(server, d, &what, seed);
}

#[test]
fn a_net_region_past_the_end_of_its_file_added_alone_is_refused() {
    let Some(mut server) = net_binary("bvmnr") else {
        return;
    };
    for (seed, region) in short_regions().into_iter().enumerate() {
        short_region_refused(&mut server, region, seed as u8);
    }
    let st = server.stats();
    assert_eq!(st["server"]["relay"]["refused_mem_tables"], 4, "{st}");
    let refusals = format!("refusing request {ADD_MEM_REG} of a front end");
    assert_eq!(server.log_lines(&refusals), 1);
}

// ------------------------------------------------------------ chains in flight at depth

/// Where the frame of TX slot `slot` is (2 KiB a slot, above the middle of guest memory).
fn tx_buf(slot: u16) -> u64 {
    data_addr(1) + u64::from(slot) * 0x800
}

/// The buffer of RX slot `slot`.
fn rx_buf(slot: u16) -> u64 {
    data_addr(0) + u64::from(slot) * 0x800
}

/// The frame the guest sends from TX slot `slot`.
fn tx_frame(slot: u16) -> Vec<u8> {
    net_frame(1500, slot as u8)
}

/// The `id`th frame the backend hands over (its length says which).
fn rx_frame(id: u16) -> Vec<u8> {
    net_frame(RX_FRAME_BASE + usize::from(id), !(id as u8))
}

/// Bytes of the 0th RX frame after its vnet header.
const RX_FRAME_BASE: usize = 1000;

/// Posts a TX chain and an RX buffer in each slot of `slots`, kicking each, and calls
/// `inject(slot)` once slot's RX buffer is posted.
fn post_at_depth(d: &mut Driver, slots: std::ops::Range<u16>, inject: impl Fn(u16)) {
    for slot in slots {
        let f = tx_frame(slot);
        d.mem.write_slice(&f, GuestAddress(tx_buf(slot))).unwrap();
        d.post_descs(1, slot, &[(tx_buf(slot), f.len() as u32, false)]);
        d.post_descs(0, slot, &[(rx_buf(slot), 2048, true)]);
        inject(slot);
    }
}

/// Takes the pending calls, posts the first half of [`DEPTH`] on both queues, waits until
/// the device has returned a chain of each queue it is given frames for (`busy`) and posts
/// the second half. Returns the used indexes read once the calls were taken: a used entry
/// past them must have been signalled.
fn at_depth(d: &mut Driver, busy: &[usize], inject: impl Fn(u16)) -> [u16; 2] {
    let seen = [0, 1].map(|q| {
        let _ = d.calls[q].read();
        d.used_idx(q)
    });
    post_at_depth(d, 0..DEPTH / 2, &inject);
    for &q in busy {
        first_completion(d, q);
    }
    post_at_depth(d, DEPTH / 2..DEPTH, &inject);
    seen
}

/// Each queue whose used index moved past `seen` has a call pending.
fn assert_signalled(d: &Driver, seen: [u16; 2], what: &str) {
    for (q, seen) in seen.into_iter().enumerate() {
        let now = d.used_idx(q);
        if now != seen {
            assert_ne!(
                poll_now(d.calls[q].as_raw_fd()) & libc::POLLIN,
                0,
                "{what}: queue {q}'s used entries {seen}..{now} were never signalled"
            );
        }
    }
}

/// The used entries of queue `q` the device has written and the driver not read yet.
fn used_now(d: &mut Driver, q: usize) -> Vec<(u32, u32)> {
    std::iter::from_fn(|| d.next_used(q)).collect()
}

/// The next `n` used entries of queue `q` (each within 10 s).
fn used_next(d: &mut Driver, q: usize, n: u16, what: &str) -> Vec<(u32, u32)> {
    (0..n)
        .map(|i| {
            d.poll_used(q)
                .unwrap_or_else(|| panic!("{what}: queue {q}: {i} of {n} chains came back"))
        })
        .collect()
}

/// Checks that TX's used entries `used` are slots `from..` in order, each of length 0 (the
/// device writes nothing into a TX chain), and that the backend got exactly their frames;
/// returns the slot after them.
fn check_tx(used: &[(u32, u32)], sent: &[Vec<u8>], from: u16, what: &str) -> u16 {
    let to = from + u16::try_from(used.len()).unwrap();
    let expected: Vec<(u32, u32)> = (from..to).map(|s| (u32::from(s), 0)).collect();
    assert_eq!(used, expected, "{what}: TX used entries");
    let frames: Vec<Vec<u8>> = (from..to).map(tx_frame).collect();
    assert!(
        sent == frames,
        "{what}: {} frames sent for TX chains {from}..{to}",
        sent.len()
    );
    to
}

/// Where the RX used entries stand: the next slot, the next frame id, frames skipped.
#[derive(Clone, Copy, Debug, Default)]
struct RxSeen {
    slot: u16,
    frame: u16,
    skipped: u16,
}

/// Checks that RX's used entries `used` are the slots after `seen` in order, each holding a
/// whole frame, the frames in the order the backend had them (none twice); returns where
/// they end.
fn check_rx(d: &Driver, used: &[(u32, u32)], mut seen: RxSeen, what: &str) -> RxSeen {
    for &(slot, len) in used {
        assert_eq!(
            slot,
            u32::from(seen.slot),
            "{what}: RX used entry out of order"
        );
        let id = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_sub(12 + RX_FRAME_BASE))
            .and_then(|id| u16::try_from(id).ok())
            .unwrap_or_else(|| panic!("{what}: RX slot {slot}: {len} bytes"));
        assert!(
            id >= seen.frame,
            "{what}: RX slot {slot} holds frame {id}, after frame {}",
            seen.frame
        );
        let f = rx_frame(id);
        let mut got = vec![0u8; f.len()];
        d.mem
            .read_slice(&mut got, GuestAddress(rx_buf(seen.slot)))
            .unwrap();
        assert!(got[12..] == f[12..], "{what}: RX frame {id} in slot {slot}");
        seen.skipped += id - seen.frame;
        seen = RxSeen {
            slot: seen.slot + 1,
            frame: id + 1,
            ..seen
        };
    }
    seen
}

/// Starts the same rings on a new connection at their used indexes, as QEMU starts a net
/// device again once its back end went away (a chain taken and not returned is taken again),
/// and kicks both queues.
fn resume_on_a_new_connection(d: &mut Driver, path: &Path) {
    d.reconnect(path);
    net_negotiate(d, VhostUserProtocolFeatures::empty());
    d.set_mem_table().unwrap();
    for q in 0..2 {
        let base = d.used_idx(q);
        d.restart_ring(q, base).unwrap();
        d.frontend.set_vring_enable(q, true).unwrap();
    }
    for kick in &d.kicks {
        kick.write(1).unwrap();
    }
}

/// A line rate that lets a burst of a few frames through, then about one frame each 60 ms
/// each way: a stop finds most chains of [`DEPTH`] still posted (the rest takes some 1.6 s,
/// room for a test thread descheduled on a loaded machine).
fn slow_line() -> ShaperConfig {
    ShaperConfig {
        rate_bps: 200_000,
        burst_bytes: 8192,
    }
}

/// [`stopped_at_depth_on`] with bounce off, then forced through a swiotlb and an iova pool.
fn stopped_at_depth(
    name: &str,
    extra: VhostUserProtocolFeatures,
    stop: impl Fn(&mut Driver, &Path),
) {
    for (bounce, dma) in devices::testing::forced_dmas(1024, 1) {
        let name = format!("{}-{name}", bounce.replace('/', "-"));
        stopped_at_depth_on(&name, dma, extra, &stop);
    }
}

/// An in-process net session at depth (shaped: [`slow_line`]; guest memory through `dma`)
/// stopped by `stop` (given the statistics socket) once each queue returned a chain: every
/// chain returned by then is complete and signalled, nothing is written after, and a new
/// connection resuming at the used indexes serves the rest: every chain once, in order; the
/// frames in order, none twice, at most the one the shaper held in the worker lost.
fn stopped_at_depth_on(
    name: &str,
    dma: bounce::Dma,
    extra: VhostUserProtocolFeatures,
    stop: &impl Fn(&mut Driver, &Path),
) {
    let (path, stats, server, stop_server, be) = net_server_on(name, Some(slow_line()), dma);
    let mut d = net_negotiated_with(&path, extra);
    d.set_mem_table().unwrap();
    net_rings(&mut d, DEEP_QUEUE);
    let seen = at_depth(&mut d, &[0, 1], |slot| be.inject(rx_frame(slot)));
    stop(&mut d, &stats);
    assert_signalled(&d, seen, name);
    let (tx, rx) = (used_now(&mut d, 1), used_now(&mut d, 0));
    eprintln!(
        "{name}: {} TX and {} RX chains of {DEPTH} each returned before the stop",
        tx.len(),
        rx.len()
    );
    let tx_next = check_tx(&tx, &be.take_sent(), 0, name);
    let rx_seen = check_rx(&d, &rx, RxSeen::default(), name);
    // The session ends (if it has not); nothing more is written into guest memory.
    end_session(&d, &stats);
    assert_eq!(
        [d.used_idx(0), d.used_idx(1)],
        [rx_seen.slot, tx_next],
        "{name}: used entries written after the stop"
    );
    assert!(
        tx_next < DEPTH && rx_seen.slot < DEPTH,
        "{name}: the stop found no chain still posted"
    );
    resume_on_a_new_connection(&mut d, &path);
    // Frames for the chains the lost one would have filled.
    be.inject(rx_frame(DEPTH));
    be.inject(rx_frame(DEPTH + 1));
    let what = format!("{name}, resumed");
    let tx = used_next(&mut d, 1, DEPTH - tx_next, &what);
    assert_eq!(check_tx(&tx, &be.take_sent(), tx_next, &what), DEPTH);
    let rx = used_next(&mut d, 0, DEPTH - rx_seen.slot, &what);
    let rx_seen = check_rx(&d, &rx, rx_seen, &what);
    assert!(rx_seen.skipped <= 1, "{what}: {rx_seen:?}");
    // Nothing used twice: the rings hold exactly DEPTH entries each once the device answers.
    d.frontend.get_features().unwrap();
    assert_eq!(used_now(&mut d, 0), [], "{what}: RX");
    assert_eq!(used_now(&mut d, 1), [], "{what}: TX");
    net_next_served(&path, &stats, &be, d, 40);
    stop_server.stop();
    server.join().unwrap();
}

/// Closes the front end's socket (QEMU quits or crashes) and waits for the session to end.
fn end_session(d: &Driver, stats: &Path) {
    // The socket may be shut down already.
    let _ = d.raw.shutdown(Shutdown::Both);
    wait_stats(stats, "the session ends", |st| {
        st["server"]["connected"] == false
    });
}

#[test]
fn a_net_disconnect_at_depth_returns_every_chain_it_took_and_the_next_session_serves_the_rest() {
    stopped_at_depth(
        "netdepth-disconnect.sock",
        VhostUserProtocolFeatures::empty(),
        |d, stats| end_session(d, stats),
    );
}

#[test]
fn a_net_device_reset_at_depth_returns_every_chain_it_took_before_its_answer() {
    stopped_at_depth(
        "netdepth-reset.sock",
        VhostUserProtocolFeatures::RESET_DEVICE,
        |d, _| {
            assert_eq!(reply_to(d, RESET_DEVICE, &[], vec![]), Reply::Acked);
            // Kicks a reset device must not serve; a device still running after its answer
            // would return a chain within this window (a frame's worth of the line refills).
            for kick in &d.kicks {
                kick.write(1).unwrap();
            }
            std::thread::sleep(Duration::from_millis(100));
        },
    );
}

// ------------------------------------------------------------ the binary end to end

const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const HOST_PORT: u16 = 4789;
const GUEST_PORT: u16 = 5555;

/// The MAC address of `dev` in the namespace `ns`.
fn mac_of(ns: &str, dev: &str) -> [u8; 6] {
    let out = std::process::Command::new("ip")
        .args(["-j", "-n", ns, "link", "show", "dev", dev])
        .output()
        .expect("run ip");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    let text = v[0]["address"].as_str().expect("an address").to_string();
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    bytes.try_into().unwrap()
}

/// The internet checksum of `bytes` (an IPv4 header).
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap()
}

/// A vnet header (no offloads), then an Ethernet frame from the guest to `dst` carrying a UDP
/// datagram from the guest's port to the host's (no UDP checksum, as IPv4 allows).
fn guest_datagram(dst: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    f.extend_from_slice(&dst);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let udp_len = u16::try_from(8 + payload.len()).unwrap();
    let mut iph = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
    iph[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    iph.extend_from_slice(&GUEST_IP.octets());
    iph.extend_from_slice(&HOST_IP.octets());
    let sum = checksum(&iph);
    iph[10..12].copy_from_slice(&sum.to_be_bytes());
    f.extend_from_slice(&iph);
    for v in [GUEST_PORT, HOST_PORT, udp_len, 0] {
        f.extend_from_slice(&v.to_be_bytes());
    }
    f.extend_from_slice(payload);
    f
}

/// The payload of a UDP datagram to the guest's port in `frame` (vnet header first), if it is
/// one.
fn datagram_to_guest(frame: &[u8]) -> Option<&[u8]> {
    let eth = frame.get(12..)?;
    let ip = eth.get(14..)?;
    let ihl = usize::from(*ip.first()? & 0xf) * 4;
    let udp = ip.get(ihl..)?;
    let to_guest = eth.get(12..14)? == [0x08, 0x00]
        && ip.get(9) == Some(&17)
        && ip.get(16..20)? == GUEST_IP.octets()
        && udp.get(2..4)? == GUEST_PORT.to_be_bytes();
    let len = usize::from(u16::from_be_bytes(udp.get(4..6)?.try_into().ok()?));
    to_guest.then(|| udp.get(8..len)).flatten()
}

/// Frames the device sent to the tap, or dropped because the tap would not take them.
fn tx_handled(st: &serde_json::Value) -> u64 {
    let net = &st["device"]["net"];
    net["tx_frames"].as_u64().unwrap() + net["tx_dropped_backend"].as_u64().unwrap()
}

/// The statistics lines the server printed to its log (SIGUSR1).
fn printed_stats(server: &Server) -> Vec<serde_json::Value> {
    let log = std::fs::read_to_string(&server.log).unwrap();
    // The last line may be half written: only lines with their newline count.
    let complete = log.rsplit_once('\n').map_or("", |(lines, _)| lines);
    complete
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON statistics line"))
        .collect()
}

/// What the statistics must show after the hostile sessions and the traffic of
/// [`the_net_binary_in_a_namespace_passes_traffic_both_ways_and_counts_ended_hostile_sessions`].
fn assert_counted(st: &serde_json::Value, tx_frames: u64) {
    let net = &st["device"]["net"];
    assert!(net["tx_frames"].as_u64() >= Some(tx_frames), "{st}");
    assert!(net["rx_frames"].as_u64() >= Some(1), "{st}");
    assert_eq!(st["transport"]["broken_workers"], 1, "{st}");
    assert_eq!(st["transport"]["error_signal_failures"], 2, "{st}");
    assert_eq!(st["server"]["relay"]["refused_mem_tables"], 1, "{st}");
}

#[test]
fn the_net_binary_in_a_namespace_passes_traffic_both_ways_and_counts_ended_hostile_sessions() {
    if let Some((resource, why)) = netns_missing() {
        return bounce::testing::missing(resource, why);
    }
    let ns = Netns::new("bvm-netfe");
    let tap = "bvmnf0";
    let mut server = Server::start_net_in(&ns.0, tap, &["--bounce", "policy=force,slots=1024"]);
    // The host's side: an address on the tap, the guest's MAC known (no ARP), no IPv6 chatter.
    let no_v6 = format!("net.ipv6.conf.{tap}.disable_ipv6=1");
    ip(&["netns", "exec", &ns.0, "sysctl", "-q", "-w", &no_v6]);
    ip(&[
        "-n",
        &ns.0,
        "addr",
        "add",
        &format!("{HOST_IP}/24"),
        "dev",
        tap,
    ]);
    ip(&["-n", &ns.0, "link", "set", tap, "up"]);
    let guest_mac = GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
    let guest_ip = GUEST_IP.to_string();
    ip(&[
        "-n",
        &ns.0,
        "neigh",
        "replace",
        &guest_ip,
        "lladdr",
        &guest_mac,
        "dev",
        tap,
        "nud",
        "permanent",
    ]);
    let tap_mac = mac_of(&ns.0, tap);

    // Hostile sessions: full error counters, a short region, a disconnect with TX at depth.
    broken_with_full_error_fds(&mut server, "full error counters", 1);
    short_region_refused(&mut server, short_regions()[3], 2);
    let before = tx_handled(&server.stats());
    // Without EVENT_IDX: every pass that returns a chain signals.
    let mut d = net_negotiated_with(&server.sock, VhostUserProtocolFeatures::empty());
    d.set_mem_table().unwrap();
    net_rings(&mut d, DEEP_QUEUE);
    let seen = at_depth(&mut d, &[1], |_| {});
    d.raw.shutdown(Shutdown::Both).unwrap();
    server.wait_disconnected("a disconnect at depth");
    assert_signalled(&d, seen, "a disconnect at depth");
    let tx = used_now(&mut d, 1);
    let expected: Vec<(u32, u32)> = (0..u32::try_from(tx.len()).unwrap())
        .map(|slot| (slot, 0))
        .collect();
    assert_eq!(tx, expected, "TX used entries at the disconnect");
    let handled = tx_handled(&server.stats()) - before;
    assert_eq!(
        handled,
        tx.len() as u64,
        "frames sent for the TX chains returned"
    );
    drop(d);

    // A well-formed session: a datagram to a socket behind the tap, and its answer.
    let host = ns.run(|| UdpSocket::bind(SocketAddrV4::new(HOST_IP, HOST_PORT)).unwrap());
    host.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut d = negotiated_on(&server.sock, 3);
    d.setup_rings(2).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    d.frontend.set_vring_enable(1, true).unwrap();
    const RX_BUFFERS: u16 = 8;
    for slot in 0..RX_BUFFERS {
        d.post_descs(0, slot, &[(rx_buf(slot), 2048, true)]);
    }
    let frame = guest_datagram(tap_mac, b"from the guest");
    d.mem.write_slice(&frame, GuestAddress(tx_buf(0))).unwrap();
    d.post_descs(1, 0, &[(tx_buf(0), frame.len() as u32, false)]);
    assert_eq!(d.poll_used(1), Some((0, 0)), "the datagram's TX chain");
    let mut buf = [0u8; 64];
    let (n, from) = host
        .recv_from(&mut buf)
        .expect("the datagram reaches the host");
    assert_eq!(&buf[..n], b"from the guest");
    assert_eq!(from.to_string(), format!("{GUEST_IP}:{GUEST_PORT}"));
    host.send_to(b"from the host", from).unwrap();
    let answer = (0..RX_BUFFERS).find_map(|_| {
        let (id, len) = d.poll_used(0).expect("a frame for the guest");
        let mut got = vec![0u8; len as usize];
        d.mem
            .read_slice(&mut got, GuestAddress(rx_buf(u16::try_from(id).unwrap())))
            .unwrap();
        datagram_to_guest(&got).map(<[u8]>::to_vec)
    });
    assert_eq!(answer.as_deref(), Some(&b"from the host"[..]));

    // The statistics count the traffic, and still show the hostile sessions.
    let tx_frames = handled + 1;
    assert_counted(&server.stats(), tx_frames);
    let printed = printed_stats(&server).len();
    let pid = libc::pid_t::try_from(server.child.id()).unwrap();
    // SAFETY: kill has no memory effects; the pid is our child's.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        if let Some(st) = printed_stats(&server).into_iter().nth(printed) {
            break st;
        }
        assert!(Instant::now() < deadline, "no statistics line on SIGUSR1");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_counted(&line, tx_frames);
    drop(d);
    server.assert_alive("after the traffic");
}

#[test]
fn transport_counters_of_an_ended_blk_session_stay_in_the_statistics() {
    let mut server = Server::start();
    let mut d = negotiated_on(&server.sock, 1);
    d.calls[0] = full_eventfd();
    d.set_mem_table().unwrap();
    d.configure_default_ring(0).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    blk_request(&mut d, 0, VIRTIO_BLK_T_OUT, 8, Some(&[0x5a; 4096]));
    assert!(d.poll_used(0).is_some(), "the write never completed");
    let during = server.stats()["transport"]["signal_errors"].as_u64();
    assert!(during >= Some(1), "the full counter was not counted");
    drop(d);
    server.wait_disconnected("full call counter");
    server.assert_alive("full call counter");
    assert_blk_served(&server.sock, 1);
    let st = server.stats();
    assert_eq!(st["transport"]["signal_errors"].as_u64(), during, "{st}");
    assert!(st["transport"]["activations"].as_u64() >= Some(2), "{st}");
}
