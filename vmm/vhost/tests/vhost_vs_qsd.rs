//! Hostile front ends against `bouncevm-vhost blk` and against qemu-storage-daemon: each
//! case runs the same front end (the same messages, the same driver code) against both and
//! compares what a front end observes: which messages are acknowledged, refused or answered
//! by the end of the connection, which requests complete with which status and which bytes,
//! and that a fresh session on the same server is served afterwards. Where qemu-storage-daemon
//! does something we deliberately do not copy, the case says so and asserts ours alone.

mod vhost_support;

use std::path::Path;
use std::time::{Duration, Instant};

use bouncevm_vhost::relay::req::{
    ADD_MEM_REG, REM_MEM_REG, RESET_DEVICE, SET_MEM_TABLE, SET_VRING_CALL, SET_VRING_KICK,
    SET_VRING_NUM,
};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX,
};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostUserMemoryRegionInfo;
use vhost_support::child::Server;
use vhost_support::inproc::stats as stats_of;
use vhost_support::net::{
    net_frame, net_negotiated, net_next_served, net_rings, net_server, net_traffic,
};
use vhost_support::qsd::{qsd, qsd_on, slow_image, Qsd};
use vhost_support::{
    assert_blk_served, blk_request, blk_request_on, blk_status, blk_status_on, data_addr,
    first_completion, full_eventfd, mem_table_body, memfd, refused, reply_to, session_answers,
    vring_state, Driver, NotEventFd, Reply, BLK_DATA, MEM_SIZE,
};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};

const WANTED: u64 = feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX);
/// The largest queue size both back ends accept (libvhost-user's VIRTQUEUE_MAX_SIZE; ours
/// is started with `--queue-size` of it).
const MAX_QUEUE: u32 = 1024;
/// Requests in flight in the cases at depth, and the queue that holds them (3 descriptors each).
const DEPTH: u16 = 32;
const DEEP_QUEUE: u16 = 128;
/// Bytes of each request at depth.
const CHUNK: u32 = 16 << 10;

/// One back end under test.
enum Peer {
    Ours(Server),
    Qsd(Qsd),
}

impl Peer {
    fn sock(&self) -> &Path {
        match self {
            Peer::Ours(s) => &s.sock,
            Peer::Qsd(q) => &q.path,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Peer::Ours(_) => "bouncevm-vhost",
            Peer::Qsd(_) => "qemu-storage-daemon",
        }
    }
}

/// `bouncevm-vhost blk` (bounce forced) and qemu-storage-daemon, one queue each, on fresh
/// images (or both on `img`); `None` without qemu-storage-daemon (a missing resource).
fn peers(img: Option<&Path>) -> Option<[Peer; 2]> {
    let theirs = match img {
        Some(img) => qsd_on(img, 1)?,
        None => qsd(1)?,
    };
    let queue_size = MAX_QUEUE.to_string();
    let mut args = vec!["--queues", "1", "--queue-size", &queue_size];
    args.extend(["--bounce", "policy=force,slots=1024"]);
    if img.is_some() {
        // O_DIRECT on a thread pool, as qemu-storage-daemon's cache.direct=on with its default
        // aio=threads: every request reaches the disk.
        args.extend(["--cache", "none", "--aio", "threads"]);
    }
    Some([Peer::Ours(Server::start_on(img, &args)), Peer::Qsd(theirs)])
}

/// Connects and negotiates (REPLY_ACK, CONFIGURE_MEM_SLOTS, RESET_DEVICE if offered) up to
/// SET_FEATURES; the socket answers within `timeout` or counts as silent.
fn negotiated(sock: &Path, timeout: Duration) -> Driver {
    let mut d = Driver::connect(sock, 1);
    d.raw.set_read_timeout(Some(timeout)).unwrap();
    d.negotiate(
        VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS | VhostUserProtocolFeatures::RESET_DEVICE,
        WANTED,
    )
    .unwrap();
    d
}

/// The next used entry of queue 0 within `wait` (id, len).
fn used_within(d: &mut Driver, wait: Duration) -> Option<(u32, u32)> {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(u) = d.next_used(0) {
            return Some(u);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Ends `d`'s session and shows a well-formed front end is served next (`seed`).
fn next_served(peer: &Peer, d: Driver, seed: u64) {
    drop(d);
    assert_blk_served(peer.sock(), seed);
}

/// Runs `case` against both back ends and returns what each saw (ours first).
fn against_both<T: std::fmt::Debug>(
    img: Option<&Path>,
    case: impl Fn(&Peer) -> T,
) -> Option<(T, T)> {
    let [ours, theirs] = peers(img)?;
    let a = case(&ours);
    let b = case(&theirs);
    eprintln!("{}: {a:?}\n{}: {b:?}", ours.name(), theirs.name());
    if let Peer::Ours(mut s) = ours {
        s.assert_alive("after the case");
    }
    Some((a, b))
}

/// [`against_both`] on one image behind a throttle of 40 requests a second: a request at
/// depth waits up to a second for the disk.
fn on_a_slow_disk<T: std::fmt::Debug>(case: impl Fn(&Peer) -> T) -> Option<(T, T)> {
    let slow = slow_image(40)?;
    against_both(Some(&slow.path), case)
}

/// What a front end saw of a kick fd that is a pipe holding one byte.
#[derive(Debug, PartialEq, Eq)]
struct KickPipe {
    reply: Reply,
    /// The status of a write posted and "kicked" through the pipe, if it completed.
    write: Option<u8>,
    /// The session still answered a request afterwards.
    answers: bool,
}

#[test]
fn a_kick_pipe_holding_one_byte() {
    let Some((ours, theirs)) = against_both(None, |peer| {
        let mut d = negotiated(peer.sock(), Duration::from_secs(2));
        d.set_mem_table().unwrap();
        d.configure_default_ring(0).unwrap();
        let (pipe, write_end) = NotEventFd::PipeWithByte.make();
        let reply = reply_to(&d, SET_VRING_KICK, &0u64.to_le_bytes(), vec![pipe]);
        let mut write = None;
        if reply == Reply::Acked && d.frontend.set_vring_enable(0, true).is_ok() {
            blk_request(&mut d, 0, VIRTIO_BLK_T_OUT, 8, Some(&[0x5a; 4096]));
            let _ = std::io::Write::write_all(&mut std::fs::File::from(write_end.unwrap()), &[1]);
            write = used_within(&mut d, Duration::from_secs(1)).map(|_| blk_status(&d, 0));
        }
        let answers = reply != Reply::Closed && session_answers(&d);
        next_served(peer, d, 1);
        KickPipe {
            reply,
            write,
            answers,
        }
    }) else {
        return;
    };
    assert_eq!(
        ours,
        KickPipe {
            reply: Reply::Refused,
            write: None,
            answers: false
        }
    );
    // qemu-storage-daemon acknowledges the pipe, then its first read of it fails (vu_panic
    // "kick eventfd_read()") and the device is broken without telling the front end; we
    // refuse the fd at once, so the front end knows. Both lose only that session.
    assert_eq!(theirs.reply, Reply::Acked);
    assert_eq!((ours.write, ours.answers), (theirs.write, theirs.answers));
}

/// Replies nobody asked for, waiting up to 200 ms for each.
fn stray_replies(d: &Driver) -> Vec<u32> {
    let timeout = d.raw.read_timeout().unwrap();
    d.raw
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut stray = Vec::new();
    while let Ok(Some(m)) = bouncevm_vhost::relay::recv_message(&d.raw) {
        stray.push(m.request);
    }
    d.raw.set_read_timeout(timeout).unwrap();
    stray
}

/// What a front end saw of a call eventfd whose counter is at its maximum.
#[derive(Debug, PartialEq, Eq)]
struct FullCall {
    /// Requests answered without NEED_REPLY.
    stray: Vec<u32>,
    /// The status of a write, if it completed.
    write: Option<u8>,
    /// GET_VRING_BASE's answer.
    base: Result<u32, Reply>,
}

#[test]
fn a_call_eventfd_whose_counter_is_full() {
    let Some((ours, theirs)) = against_both(None, |peer| {
        let mut d = negotiated(peer.sock(), Duration::from_secs(2));
        d.calls[0] = full_eventfd();
        d.set_mem_table().unwrap();
        d.configure_default_ring(0).unwrap();
        d.frontend.set_vring_enable(0, true).unwrap();
        blk_request(&mut d, 0, VIRTIO_BLK_T_OUT, 8, Some(&[0x5a; 4096]));
        let write = used_within(&mut d, Duration::from_secs(3)).map(|_| blk_status(&d, 0));
        let stray = stray_replies(&d);
        let base = d.try_stop_ring(0);
        next_served(peer, d, 2);
        FullCall { stray, write, base }
    }) else {
        return;
    };
    assert_eq!(
        ours,
        FullCall {
            stray: vec![],
            write: Some(VIRTIO_BLK_S_OK),
            base: Ok(1)
        }
    );
    // qemu-storage-daemon answers SET_VRING_CALL unasked (a reply the front end reads as the
    // answer to its next request) when its wake-up write to the full counter fails; we send
    // no reply that was not asked for.
    assert_eq!(theirs.stray, vec![SET_VRING_CALL]);
    assert_eq!((ours.write, ours.base), (theirs.write, theirs.base));
}

#[test]
fn queue_sizes_not_a_power_of_two_and_over_the_maximum() {
    let Some((ours, theirs)) = against_both(None, |peer| {
        [100, MAX_QUEUE + 1, MAX_QUEUE]
            .into_iter()
            .enumerate()
            .map(|(seed, num)| {
                let mut d = negotiated(peer.sock(), Duration::from_secs(5));
                d.set_mem_table().unwrap();
                let reply = reply_to(&d, SET_VRING_NUM, &vring_state(0, num), vec![]);
                let answers = reply != Reply::Closed && session_answers(&d);
                next_served(peer, d, 10 + seed as u64);
                (num, reply, answers)
            })
            .collect::<Vec<_>>()
    }) else {
        return;
    };
    let max = MAX_QUEUE;
    assert_eq!(
        ours,
        [
            (100, Reply::Refused, false),
            (max + 1, Reply::Refused, false),
            (max, Reply::Acked, true)
        ]
    );
    // qemu-storage-daemon acknowledges any size (libvhost-user does not check SET_VRING_NUM);
    // a split ring's size is a power of two no larger than the maximum the device offers, and
    // we size the rings we read by it, so we refuse the others.
    assert_eq!(
        theirs,
        [
            (100, Reply::Acked, true),
            (max + 1, Reply::Acked, true),
            ours[2]
        ]
    );
}

#[test]
fn a_region_larger_than_its_file() {
    let Some((ours, theirs)) = against_both(None, |peer| {
        let d = negotiated(peer.sock(), Duration::from_secs(5));
        let (file, base) = d.memfd_and_base();
        let body = mem_table_body(&[(0, MEM_SIZE as u64 + 4096, base, 0)]);
        let reply = reply_to(&d, SET_MEM_TABLE, &body, vec![file]);
        let answers = reply != Reply::Closed && session_answers(&d);
        next_served(peer, d, 20);
        (reply, answers)
    }) else {
        return;
    };
    assert_eq!(ours, (Reply::Refused, false));
    // qemu-storage-daemon maps the region as it is (mmap does not check the file's size) and
    // takes SIGBUS at its first access past the end; we check it against fstat and refuse.
    assert_eq!(theirs, (Reply::Acked, true));
}

/// Writes `data` at `sector` from the data buffer of request slot 0 and reads it back into
/// slot 1's: the two statuses and whether the bytes read back are the bytes written.
fn round_trip(d: &mut Driver, sector: u64, data: &[u8]) -> (Option<u8>, Option<u8>, bool) {
    let wait = Duration::from_secs(5);
    blk_request(d, 0, VIRTIO_BLK_T_OUT, sector, Some(data));
    let write = used_within(d, wait).map(|_| blk_status(d, 0));
    blk_request(d, 1, VIRTIO_BLK_T_IN, sector, None);
    let read = used_within(d, wait).map(|_| blk_status(d, 1));
    let mut got = vec![0u8; data.len()];
    d.mem
        .read_slice(&mut got, GuestAddress(BLK_DATA + 4096))
        .unwrap();
    (write, read, got == data)
}

#[test]
fn a_memory_table_in_descending_address_order() {
    let Some((ours, theirs)) = against_both(None, |peer| {
        let mut d = negotiated(peer.sock(), Duration::from_secs(5));
        let (file, base) = d.memfd_and_base();
        let half = MEM_SIZE as u64 / 2;
        let body = mem_table_body(&[(half, half, base + half, half), (0, half, base, 0)]);
        let other = file.try_clone().unwrap();
        let reply = reply_to(&d, SET_MEM_TABLE, &body, vec![file, other]);
        d.configure_default_ring(0).unwrap();
        d.frontend.set_vring_enable(0, true).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let trip = round_trip(&mut d, 64, &data);
        next_served(peer, d, 30);
        (reply, trip)
    }) else {
        return;
    };
    let ok = Some(VIRTIO_BLK_S_OK);
    assert_eq!(ours, (Reply::Acked, (ok, ok, true)));
    assert_eq!(ours, theirs);
}

/// Disk sector and guest buffer of request slot `slot` at depth.
fn deep_sector(slot: u16) -> u64 {
    u64::from(slot) * u64::from(CHUNK / 512)
}
fn deep_buf(slot: u16) -> u64 {
    BLK_DATA + u64::from(slot) * u64::from(CHUNK)
}

/// The bytes written at depth by request slot `slot`.
fn deep_pattern(slot: u16) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (i as u8).wrapping_mul(13) ^ (slot as u8).wrapping_mul(71) ^ 0x3c)
        .collect()
}

/// A session on `sock` with queue 0 at [`DEEP_QUEUE`] entries, enabled.
fn deep_session(sock: &Path) -> Driver {
    let mut d = negotiated(sock, Duration::from_secs(5));
    d.set_mem_table().unwrap();
    d.configure_sized_ring(0, DEEP_QUEUE).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    d
}

/// Posts [`DEPTH`] writes (each its [`deep_pattern`]) or reads (into zeroed buffers) of
/// [`CHUNK`] bytes on queue 0.
fn post_deep(d: &mut Driver, kind: u32) {
    for slot in 0..DEPTH {
        let data = if kind == VIRTIO_BLK_T_OUT {
            deep_pattern(slot)
        } else {
            vec![0; CHUNK as usize]
        };
        d.mem
            .write_slice(&data, GuestAddress(deep_buf(slot)))
            .unwrap();
        blk_request_on(d, 0, slot, kind, deep_sector(slot), deep_buf(slot), CHUNK);
    }
}

/// The used entries of queue 0 there are now: for each, its slot, whether its status is OK,
/// and (for reads) whether its buffer holds the slot's pattern.
fn used_now(d: &mut Driver) -> Vec<(u16, bool, bool)> {
    let mut seen = Vec::new();
    while let Some((id, _)) = d.next_used(0) {
        let slot = u16::try_from(id / 3).unwrap();
        let mut got = vec![0u8; CHUNK as usize];
        d.mem
            .read_slice(&mut got, GuestAddress(deep_buf(slot)))
            .unwrap();
        let ok = blk_status_on(d, 0, slot) == VIRTIO_BLK_S_OK;
        seen.push((slot, ok, got == deep_pattern(slot)));
    }
    seen.sort_unstable();
    seen
}

/// Waits until `n` requests of queue 0 completed, each with status OK.
fn all_done(d: &mut Driver, n: usize, what: &str) {
    let mut done = 0;
    while done < n {
        let (id, _) = used_within(d, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{what}: {done} of {n} completed"));
        let slot = u16::try_from(id / 3).unwrap();
        assert_eq!(blk_status_on(d, 0, slot), VIRTIO_BLK_S_OK, "{what}: {slot}");
        done += 1;
    }
}

/// Writes [`DEPTH`] patterns, then, on a new session, reads them back at depth: the session,
/// once the first read is back and the slow disk holds most of the others.
fn reads_held_at_depth(sock: &Path) -> Driver {
    let mut d = deep_session(sock);
    post_deep(&mut d, VIRTIO_BLK_T_OUT);
    all_done(&mut d, usize::from(DEPTH), "writes");
    drop(d);
    let mut d = deep_session(sock);
    post_deep(&mut d, VIRTIO_BLK_T_IN);
    first_completion(&d, 0);
    d
}

/// What a front end saw of a disconnect with [`DEPTH`] writes in flight on a slow disk.
#[derive(Debug, PartialEq, Eq)]
struct Disconnect {
    /// Used entries in the ring once the back end is done, all with status OK.
    returned: usize,
    all_ok: bool,
    /// Writes whose bytes a later session reads back.
    on_disk: usize,
}

#[test]
fn a_disconnect_with_requests_in_flight_at_depth() {
    let Some((ours, theirs)) = on_a_slow_disk(|peer| {
        let mut d = deep_session(peer.sock());
        post_deep(&mut d, VIRTIO_BLK_T_OUT);
        first_completion(&d, 0);
        d.raw.shutdown(std::net::Shutdown::Both).unwrap();
        // Whatever the back end completes after the end, within the time the disk needs.
        let deadline = Instant::now() + Duration::from_secs(3);
        while d.used_idx(0) < DEPTH && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let used = used_now(&mut d);
        drop(d);
        let mut r = deep_session(peer.sock());
        post_deep(&mut r, VIRTIO_BLK_T_IN);
        all_done(&mut r, usize::from(DEPTH), "reading back");
        let on_disk = (0..DEPTH)
            .filter(|&slot| {
                let mut got = vec![0u8; CHUNK as usize];
                r.mem
                    .read_slice(&mut got, GuestAddress(deep_buf(slot)))
                    .unwrap();
                got == deep_pattern(slot)
            })
            .count();
        next_served(peer, r, 40);
        Disconnect {
            returned: used.len(),
            all_ok: used.iter().all(|&(_, ok, _)| ok),
            on_disk,
        }
    }) else {
        return;
    };
    assert!(ours.returned < usize::from(DEPTH), "{ours:?}");
    assert_eq!((ours.all_ok, ours.on_disk), (true, usize::from(DEPTH)));
    // qemu-storage-daemon returns every request into the ring of a front end that has gone;
    // we finish the I/O (every write is on disk) and write no used entry once the session
    // has ended: requests in flight then are the front end's inflight region's
    // (INFLIGHT_SHMFD), which the next back end serves again.
    assert_eq!((ours.all_ok, ours.on_disk), (theirs.all_ok, theirs.on_disk));
}

/// What a front end saw of GET_VRING_BASE with [`DEPTH`] reads in flight on a slow disk.
#[derive(Debug, PartialEq, Eq)]
struct Stop {
    base: Result<u32, Reply>,
    /// Used entries when the answer came: (slot, status OK, bytes read are the slot's).
    used: Vec<(u16, bool, bool)>,
}

#[test]
fn a_stop_with_requests_in_flight_at_depth() {
    let Some((ours, theirs)) = on_a_slow_disk(|peer| {
        let mut d = reads_held_at_depth(peer.sock());
        let base = d.try_stop_ring(0);
        let used = used_now(&mut d);
        next_served(peer, d, 50);
        Stop { base, used }
    }) else {
        return;
    };
    // Every request the base counts is back, with its status and its bytes; the stop came
    // while the disk held most of them.
    let returned = u32::try_from(ours.used.len()).unwrap();
    assert_eq!(ours.base, Ok(returned), "{ours:?}");
    assert!(
        ours.used.iter().all(|&(_, ok, bytes)| ok && bytes),
        "{ours:?}"
    );
    assert!(returned > 1, "{ours:?}");
    // qemu-storage-daemon answers with a base that counts requests still in flight, whose used
    // entries come after the answer or never; QEMU resumes the ring from the base, so ours are
    // all in the ring first. Both answer, and what both return is complete and correct.
    assert!(theirs.base.is_ok(), "{theirs:?}");
    assert!(
        theirs.used.iter().all(|&(_, ok, bytes)| ok && bytes),
        "{theirs:?}"
    );
}

/// SET_MEM_TABLE-style body of one region for ADD_MEM_REG and REM_MEM_REG (8 bytes of
/// padding where a table has its count).
fn one_region(r: &VhostUserMemoryRegionInfo) -> Vec<u8> {
    let mut body = mem_table_body(&[(
        r.guest_phys_addr,
        r.memory_size,
        r.userspace_addr,
        r.mmap_offset,
    )]);
    body[..8].fill(0);
    body
}

/// What a front end saw of a region added and removed while its queue runs.
#[derive(Debug, PartialEq, Eq)]
struct HotPlug {
    add: Reply,
    /// A write from the added region and a read into it: statuses, bytes read back equal.
    in_added: (Option<u8>, Option<u8>, bool),
    remove: Reply,
    /// A round trip in the region that stays, after the removal.
    after: (Option<u8>, Option<u8>, bool),
}

#[test]
fn a_region_added_and_removed_while_a_queue_runs() {
    const ADDED: u64 = MEM_SIZE as u64;
    const ADDED_SIZE: usize = 1 << 20;
    let Some((ours, theirs)) = against_both(None, |peer| {
        let mut d = negotiated(peer.sock(), Duration::from_secs(5));
        // The rings below 3 MiB, request headers and data above, each region added alone.
        for region in d.regions_split_at(3 << 20) {
            let (fd, _) = d.memfd_and_base();
            let reply = reply_to(&d, ADD_MEM_REG, &one_region(&region), vec![fd]);
            assert_eq!(reply, Reply::Acked, "{}: the first regions", peer.name());
        }
        d.configure_default_ring(0).unwrap();
        d.frontend.set_vring_enable(0, true).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 11) as u8).collect();
        assert_eq!(round_trip(&mut d, 72, &data), (Some(0), Some(0), true));
        // One more region, past the others, while the queue runs.
        let extra = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
            GuestAddress(ADDED),
            ADDED_SIZE,
            Some(FileOffset::new(memfd(ADDED_SIZE), 0)),
        )])
        .unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(
            extra.find_region(GuestAddress(ADDED)).unwrap(),
        )
        .unwrap();
        let fd = extra
            .find_region(GuestAddress(ADDED))
            .unwrap()
            .file_offset()
            .unwrap()
            .file()
            .try_clone()
            .unwrap();
        let add = reply_to(&d, ADD_MEM_REG, &one_region(&info), vec![fd.into()]);
        extra.write_slice(&data, GuestAddress(ADDED)).unwrap();
        let wait = Duration::from_secs(5);
        blk_request_on(&mut d, 0, 0, VIRTIO_BLK_T_OUT, 80, ADDED, 4096);
        let write = used_within(&mut d, wait).map(|_| blk_status(&d, 0));
        blk_request_on(&mut d, 0, 1, VIRTIO_BLK_T_IN, 80, ADDED + 4096, 4096);
        let read = used_within(&mut d, wait).map(|_| blk_status(&d, 1));
        let mut got = vec![0u8; 4096];
        extra
            .read_slice(&mut got, GuestAddress(ADDED + 4096))
            .unwrap();
        let remove = reply_to(&d, REM_MEM_REG, &one_region(&info), vec![]);
        let after = round_trip(&mut d, 88, &data);
        next_served(peer, d, 60);
        HotPlug {
            add,
            in_added: (write, read, got == data),
            remove,
            after,
        }
    }) else {
        return;
    };
    let ok = Some(VIRTIO_BLK_S_OK);
    assert_eq!(
        ours,
        HotPlug {
            add: Reply::Acked,
            in_added: (ok, ok, true),
            remove: Reply::Acked,
            after: (ok, ok, true)
        }
    );
    assert_eq!(ours, theirs);
}

// The same classes for net, against `bouncevm-vhost`'s net device alone (in process, over
// memory backends): qemu-storage-daemon has no net export.

#[test]
fn net_refuses_bad_queue_sizes_and_short_regions_and_serves_regions_in_any_order() {
    let (path, stats, server, stop, be) = net_server("vsqsd-net.sock");
    let mut seed = 0;
    for num in [100, 257] {
        let mut d = net_negotiated(&path);
        d.set_mem_table().unwrap();
        assert!(
            refused(&d, SET_VRING_NUM, &vring_state(0, num), vec![]),
            "{num}"
        );
        seed += 1;
        net_next_served(&path, &stats, &be, d, seed);
    }
    let d = net_negotiated(&path);
    let (file, base) = d.memfd_and_base();
    let body = mem_table_body(&[(0, MEM_SIZE as u64 + 4096, base, 0)]);
    assert!(refused(&d, SET_MEM_TABLE, &body, vec![file]), "short file");
    net_next_served(&path, &stats, &be, d, 10);
    // Descending order, the data buffers in the upper region.
    let mut d = net_negotiated(&path);
    let (file, base) = d.memfd_and_base();
    let half = MEM_SIZE as u64 / 2;
    assert!(data_addr(0) >= half);
    let body = mem_table_body(&[(half, half, base + half, half), (0, half, base, 0)]);
    let other = file.try_clone().unwrap();
    assert!(!refused(&d, SET_MEM_TABLE, &body, vec![file, other]));
    net_rings(&mut d, 16);
    net_traffic(&mut d, &be, 0, 11);
    net_next_served(&path, &stats, &be, d, 12);
    let st = stats_of(&stats);
    assert_eq!(st["server"]["relay"]["refused_queue_sizes"], 2, "{st}");
    assert_eq!(st["server"]["relay"]["refused_mem_tables"], 1, "{st}");
    stop.stop();
    server.join().unwrap();
}

#[test]
fn net_stop_at_depth_returns_every_chain_it_counts() {
    let (path, stats, server, stop, be) = net_server("vsqsd-netdeep.sock");
    let mut d = net_negotiated(&path);
    d.set_mem_table().unwrap();
    net_rings(&mut d, DEEP_QUEUE);
    // DEPTH frames sent and DEPTH received, then both queues stopped at once.
    let slots = 0..DEPTH;
    for slot in slots.clone() {
        let f = net_frame(64, slot as u8);
        let buf = data_addr(1) + u64::from(slot) * 0x800;
        d.mem.write_slice(&f, GuestAddress(buf)).unwrap();
        d.post_descs(1, slot, &[(buf, f.len() as u32, false)]);
        let rbuf = data_addr(0) + u64::from(slot) * 0x800;
        d.post_descs(0, slot, &[(rbuf, 2048, true)]);
        be.inject(net_frame(64, !(slot as u8)));
    }
    // Stopped once each queue has returned a chain, the worker busy with the others.
    first_completion(&d, 0);
    first_completion(&d, 1);
    let rx_base = d.stop_ring(0);
    let tx_base = d.stop_ring(1);
    let mut used = [0u32; 2];
    for (q, n) in used.iter_mut().enumerate() {
        while d.next_used(q).is_some() {
            *n += 1;
        }
    }
    assert_eq!(used, [rx_base, tx_base], "chains counted but not returned");
    assert_eq!(be.take_sent().len(), tx_base as usize);
    net_next_served(&path, &stats, &be, d, 20);
    stop.stop();
    server.join().unwrap();
}

/// What a front end saw of RESET_DEVICE with [`DEPTH`] reads in flight on a slow disk.
#[derive(Debug, PartialEq, Eq)]
struct Reset {
    reply: Reply,
    /// Used entries when the answer came: (slot, status OK, bytes read are the slot's).
    used: Vec<(u16, bool, bool)>,
    /// Used entries written after the answer.
    later: usize,
}

#[test]
fn a_device_reset_with_requests_in_flight_at_depth() {
    let Some((ours, theirs)) = on_a_slow_disk(|peer| {
        let mut d = reads_held_at_depth(peer.sock());
        let reply = reply_to(&d, RESET_DEVICE, &[], vec![]);
        let used = used_now(&mut d);
        // The time the disk needs for whatever is left.
        std::thread::sleep(Duration::from_secs(1));
        let later = used_now(&mut d).len();
        next_served(peer, d, 70);
        Reset { reply, used, later }
    }) else {
        return;
    };
    // Every request is back, with its status and its bytes, before the answer; nothing is
    // written into guest memory after it.
    assert_eq!(ours.reply, Reply::Acked);
    assert_eq!(ours.later, 0, "{ours:?}");
    assert!(
        ours.used.iter().all(|&(_, ok, bytes)| ok && bytes),
        "{ours:?}"
    );
    assert!(ours.used.len() > 1, "{ours:?}");
    // qemu-storage-daemon acknowledges RESET_DEVICE without handling it (vu_panic "Unhandled
    // request: 34"): its device breaks and the requests not back by then never come back.
    // What both return is complete and correct.
    assert_eq!(theirs.reply, Reply::Acked);
    assert!(
        theirs.used.iter().all(|&(_, ok, bytes)| ok && bytes),
        "{theirs:?}"
    );
}
