//! `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD` against the binary (`bouncevm-vhost blk`), driven the
//! way QEMU's vhost-user-blk drives it with `reconnect=`: the front end asks for the inflight
//! region once, hands it back at every start, and after the back end died starts a new one on
//! the same socket from the used ring's index.
//!
//! - writes in flight when the back end is killed with SIGKILL complete exactly once after the
//!   restart, with their data on disk (repeated until a kill has caught requests in flight);
//! - heads a crashed back end left in flight are served again in the order they were popped;
//! - a region the front end hands back is refused when it is too small, cannot be sealed
//!   against shrinking, or holds a record that makes no sense; one corrupted after it was
//!   taken stops the queue (DEVICE_NEEDS_RESET, the error eventfd) instead of serving a loop;
//!   each time the server lives on and serves the next front end.

mod vhost_support;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use bouncevm_vhost::relay::req::{GET_INFLIGHT_FD, SET_INFLIGHT_FD};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use vhost::vhost_user::message::{VhostUserInflight, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost_support::child::Server;
use vhost_support::{
    assert_blk_served, blk_request, blk_status, block_pattern, refused, Driver, BATCH, BLK_DATA,
    QSIZE,
};
use vm_memory::{Bytes, GuestAddress};

/// The region's layout (vhost-user specification, "Inflight I/O tracking"): queue 0's header
/// fields, then 16 bytes per head (inflight flag, padding, next, counter).
const VERSION: u64 = 8;
const DESC_NUM: u64 = 10;
const LAST_BATCH_HEAD: u64 = 12;
const USED_IDX: u64 = 14;
const HEADS: u64 = 16;
const HEAD_LEN: u64 = 16;
const NEXT: u64 = 6;
const COUNTER: u64 = 8;
/// Kill rounds before giving up on catching requests in flight.
const ROUNDS: u8 = 12;

/// The 4 KiB sector of request slot `slot`.
fn sector(slot: u16) -> u64 {
    8 * u64::from(slot)
}

/// The inflight region of queue 0 as a front end holds it.
struct Region {
    info: VhostUserInflight,
    file: File,
}

impl Region {
    fn head(&self, h: u16) -> u64 {
        HEADS + HEAD_LEN * u64::from(h)
    }

    fn poke(&self, at: u64, bytes: &[u8]) {
        self.file.write_all_at(bytes, at).unwrap();
    }

    /// Records `heads` in flight, popped in this order, as a back end that died would leave
    /// them.
    fn mark_in_flight(&self, heads: &[u16]) {
        self.poke(VERSION, &1u16.to_le_bytes());
        self.poke(DESC_NUM, &QSIZE.to_le_bytes());
        for (n, &h) in heads.iter().enumerate() {
            self.poke(self.head(h) + COUNTER, &(100 + n as u64).to_le_bytes());
            self.poke(self.head(h), &[1]);
        }
    }

    /// True when some head of queue 0 is marked in flight.
    fn any_in_flight(&self) -> bool {
        (0..QSIZE).any(|h| {
            let mut b = [0u8];
            self.file.read_exact_at(&mut b, self.head(h)).unwrap();
            b[0] == 1
        })
    }
}

/// Handshake and SET_FEATURES with INFLIGHT_SHMFD, then the region: asked for (GET_INFLIGHT_FD)
/// on the first start, handed back (SET_INFLIGHT_FD) on every one, as QEMU does.
fn negotiate(d: &mut Driver, region: Option<&Region>) -> Region {
    d.handshake_with(VhostUserProtocolFeatures::INFLIGHT_SHMFD)
        .unwrap();
    d.set_features(feature(VIRTIO_F_VERSION_1)).unwrap();
    let region = match region {
        Some(r) => Region {
            info: r.info,
            file: r.file.try_clone().unwrap(),
        },
        None => {
            let (info, file) = d
                .frontend
                .get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE))
                .unwrap();
            Region { info, file }
        }
    };
    d.frontend
        .set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    region
}

/// A start of queue 0 with `region` handed back if given: on rings zeroed for a new guest
/// (`fresh`), or where they were at ring position `base` (after the back end went away QEMU
/// sends the used ring's index).
fn start(d: &mut Driver, region: Option<&Region>, fresh: bool, base: u16) -> Region {
    let region = negotiate(d, region);
    d.set_mem_table().unwrap();
    if fresh {
        d.configure_default_ring(0).unwrap();
    } else {
        d.restart_ring(0, base).unwrap();
    }
    d.frontend.set_vring_enable(0, true).unwrap();
    region
}

/// Every used entry of queue 0 until `n` arrived, then any more within `grace`: (head,
/// status byte) each.
fn collect_used(d: &mut Driver, n: usize, grace: Duration) -> Vec<(u16, u8)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    let mut extra_until = None;
    loop {
        while let Some((id, _)) = d.next_used(0) {
            let head = u16::try_from(id).unwrap();
            out.push((head, blk_status(d, head / 3)));
        }
        if out.len() >= n && extra_until.is_none() {
            extra_until = Some(Instant::now() + grace);
        }
        match extra_until {
            Some(t) if Instant::now() >= t => return out,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "only {out:?} of {n} completions within 20 s"
        );
        d.wait_call(0, Duration::from_millis(20));
    }
}

/// Reads back the BATCH slots' sectors and compares them with generation `generation`.
fn assert_read_back(d: &mut Driver, generation: u8, what: &str) {
    let heads: Vec<u16> = (0..BATCH)
        .map(|slot| blk_request(d, slot, VIRTIO_BLK_T_IN, sector(slot), None))
        .collect();
    let used = collect_used(d, heads.len(), Duration::ZERO);
    assert!(used.iter().all(|&(_, s)| s == 0), "{what}: reads {used:?}");
    for slot in 0..BATCH {
        let mut got = vec![0u8; 4096];
        d.mem
            .read_slice(&mut got, GuestAddress(BLK_DATA + u64::from(slot) * 4096))
            .unwrap();
        assert!(
            got == block_pattern(sector(slot), generation),
            "{what}: slot {slot} does not hold generation {generation}"
        );
    }
}

#[test]
fn writes_in_flight_at_a_sigkill_complete_exactly_once_after_a_restart() {
    // O_DIRECT: the writes take the disk's time, so a kill finds some in flight.
    let mut srv = Server::start_with(&["--cache", "none", "--bounce", "policy=force,slots=1024"]);
    let mut d = Driver::connect(&srv.sock, 1);
    let mut region = start(&mut d, None, true, 0);
    let mut caught = 0;
    for round in 0..ROUNDS {
        let generation = round + 1;
        let mut heads: Vec<u16> = (0..BATCH)
            .map(|slot| {
                let data = block_pattern(sector(slot), generation);
                blk_request(&mut d, slot, VIRTIO_BLK_T_OUT, sector(slot), Some(&data))
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(1);
        while !region.any_in_flight() && Instant::now() < deadline {
            std::hint::spin_loop();
        }
        srv.kill_and_restart();
        d.reconnect(&srv.sock);
        let used_idx = d.used_idx(0);
        region = start(&mut d, Some(&region), false, used_idx);
        let mut used = collect_used(&mut d, heads.len(), Duration::from_millis(300));
        used.sort_unstable();
        heads.sort_unstable();
        assert_eq!(
            used,
            heads.iter().map(|&h| (h, 0)).collect::<Vec<_>>(),
            "round {round}: each write must complete once, with status OK"
        );
        assert_read_back(&mut d, generation, &format!("round {round}"));
        let st = srv.stats();
        let resubmitted = st["device"]["metrics"]["inflight_resubmitted"]
            .as_u64()
            .unwrap();
        assert_eq!(st["server"]["relay"]["inflight_regions_adopted"], 1, "{st}");
        if resubmitted > 0 {
            caught += 1;
            if caught == 2 {
                return;
            }
        }
    }
    assert!(
        caught > 0,
        "no kill in {ROUNDS} rounds caught a write in flight: nothing was resubmitted"
    );
}

#[test]
fn heads_left_in_flight_are_served_again_in_the_order_they_were_popped() {
    // The synchronous engine completes each request as it is submitted: the used ring's
    // order is the submission order.
    let mut srv = Server::start_with(&["--aio", "sync"]);
    let mut d = Driver::connect(&srv.sock, 1);
    let region = start(&mut d, None, true, 0);
    srv.kill_and_restart();
    // While no back end serves it, the guest posts five writes; the record says a back end
    // popped them in the order of slots 3, 0, 4, 1, 2 and died before any completed.
    let heads: Vec<u16> = (0..BATCH)
        .map(|slot| {
            let data = block_pattern(sector(slot), 7);
            blk_request(&mut d, slot, VIRTIO_BLK_T_OUT, sector(slot), Some(&data))
        })
        .collect();
    let popped: Vec<u16> = [3usize, 0, 4, 1, 2].iter().map(|&s| heads[s]).collect();
    region.mark_in_flight(&popped);
    d.reconnect(&srv.sock);
    let _region = start(&mut d, Some(&region), false, 0);
    let used = collect_used(&mut d, heads.len(), Duration::from_millis(300));
    assert_eq!(
        used,
        popped.iter().map(|&h| (h, 0)).collect::<Vec<_>>(),
        "served again once each, in pop order"
    );
    assert_read_back(&mut d, 7, "after the restart");
    let st = srv.stats();
    assert_eq!(st["device"]["metrics"]["inflight_resubmitted"], 5, "{st}");
}

/// A memfd of `size` bytes; without `sealable` it is sealed shut at creation and can never be
/// sealed against shrinking.
fn memfd(size: u64, sealable: bool) -> File {
    let flags = libc::MFD_CLOEXEC | if sealable { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: memfd_create reads the NUL-terminated name; the fd it returns is ours.
    let fd = unsafe { libc::memfd_create(c"inflight-test".as_ptr(), flags) };
    assert!(fd >= 0);
    // SAFETY: `fd` was just created and nothing else owns it.
    let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

#[test]
fn hostile_inflight_regions_are_refused_and_the_next_front_end_is_served() {
    let mut srv = Server::start_with(&["--aio", "sync"]);
    let body = |size: u64, queue_size: u16| {
        let mut b = size.to_le_bytes().to_vec();
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&queue_size.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b
    };
    // GET_INFLIGHT_FD for a queue size the device would refuse.
    let needed = {
        let mut d = Driver::connect(&srv.sock, 1);
        d.handshake_with(VhostUserProtocolFeatures::INFLIGHT_SHMFD)
            .unwrap();
        let (info, _) = d
            .frontend
            .get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE))
            .unwrap();
        assert!(refused(&d, GET_INFLIGHT_FD, &body(0, 12), vec![]));
        info.mmap_size
    };
    assert_blk_served(&srv.sock, 1);
    // SET_INFLIGHT_FD with: a description smaller than its queue; a file smaller than its
    // description; a file that cannot be sealed against shrinking (it could SIGBUS us); two
    // heads in flight with one counter; an inflight flag of 2.
    let in_flight_twice = |r: &Region| {
        r.mark_in_flight(&[1, 2]);
        r.poke(r.head(2) + COUNTER, &100u64.to_le_bytes());
    };
    let flag_2 = |r: &Region| {
        r.mark_in_flight(&[1]);
        r.poke(r.head(1), &[2]);
    };
    type Case<'a> = (&'a str, u64, File, Option<&'a dyn Fn(&Region)>);
    let cases: [Case; 5] = [
        ("description too small", 64, memfd(needed, true), None),
        ("file too small", needed, memfd(64, true), None),
        ("unsealable", needed, memfd(needed, false), None),
        (
            "one counter for two heads",
            needed,
            memfd(needed, true),
            Some(&in_flight_twice),
        ),
        ("flag 2", needed, memfd(needed, true), Some(&flag_2)),
    ];
    for (i, (what, size, file, corrupt)) in cases.into_iter().enumerate() {
        let mut d = Driver::connect(&srv.sock, 1);
        d.handshake_with(VhostUserProtocolFeatures::INFLIGHT_SHMFD)
            .unwrap();
        let r = Region {
            info: VhostUserInflight::new(size, 0, 1, QSIZE),
            file,
        };
        if let Some(corrupt) = corrupt {
            corrupt(&r);
        }
        assert!(
            refused(&d, SET_INFLIGHT_FD, &body(size, QSIZE), vec![r.file.into()]),
            "{what} was accepted"
        );
        srv.assert_alive(what);
        assert_blk_served(&srv.sock, 10 + i as u64);
    }
    let st = srv.stats();
    assert_eq!(st["server"]["relay"]["refused_inflight"], 6, "{st}");
}

#[test]
fn a_record_corrupted_after_it_was_handed_over_stops_the_queue_instead_of_looping() {
    let mut srv = Server::start_with(&["--aio", "sync"]);
    let mut d = Driver::connect(&srv.sock, 1);
    d.handshake_with(VhostUserProtocolFeatures::INFLIGHT_SHMFD | VhostUserProtocolFeatures::STATUS)
        .unwrap();
    d.set_features(feature(VIRTIO_F_VERSION_1)).unwrap();
    let (info, file) = d
        .frontend
        .get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE))
        .unwrap();
    let r = Region { info, file };
    r.mark_in_flight(&[1, 2]);
    d.frontend
        .set_inflight_fd(&r.info, r.file.as_raw_fd())
        .unwrap();
    // Once handed over, the front end links the last batch into a loop (1 -> 2 -> 1) and puts
    // the record's used index three behind the ring's 0 (a batch of three: 1, 2, then 1 again).
    r.poke(LAST_BATCH_HEAD, &1u16.to_le_bytes());
    r.poke(USED_IDX, &65533u16.to_le_bytes());
    r.poke(r.head(1) + NEXT, &2u16.to_le_bytes());
    r.poke(r.head(2) + NEXT, &1u16.to_le_bytes());
    d.set_mem_table().unwrap();
    d.configure_default_ring(0).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    blk_request(&mut d, 0, VIRTIO_BLK_T_OUT, 0, Some(&[1u8; 4096]));
    assert!(
        d.wait_err(0, Duration::from_secs(10)),
        "the queue's error eventfd was not signalled"
    );
    assert_eq!(
        d.get_status() & VIRTIO_CONFIG_S_NEEDS_RESET,
        VIRTIO_CONFIG_S_NEEDS_RESET
    );
    srv.assert_alive("a looping batch list");
    drop(d);
    assert_blk_served(&srv.sock, 99);
}
