//! Block I/O that the disk holds for as long as a test wants, against what a front end does
//! meanwhile:
//! - a memory region removed (REM_MEM_REG) while reads into it are in flight stays mapped
//!   until no request uses it; the reads complete with their data and status (bounce off and
//!   forced), nothing faults;
//! - with `on-full=wait`, requests that find the bounce pool full wait for as long as the disk
//!   holds the slots, and complete without an error.

mod vhost_support;

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bounce::Dma;
use devices::block::{Block, BlockConfig, MemDisk};
use devices::testing::{DiskHook, DiskOp, HookedDisk};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_F_MQ, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_IN, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX,
};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vhost_support::inproc::{start_server_with_stats, stats, wait_stats};
use vhost_support::{
    blk_request_on, blk_status, blk_status_on, post_zeroed_reads, wait_used, Driver, BLK_DATA,
    MEM_SIZE,
};
use vm_memory::{Bytes, GuestAddress};

const WANTED: u64 = feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX);
const DISK_SIZE: u64 = 8 << 20;

/// Holds every read and write while closed.
#[derive(Debug, Default)]
struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
    /// Operations that reached the disk (held or not).
    arrived: AtomicUsize,
}

impl Gate {
    fn pass(&self) {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.opened.wait(closed).unwrap();
        }
    }

    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }

    /// Waits until `n` operations reached the disk.
    fn wait_arrived(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.arrived.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "the I/O never reached the disk");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A memory disk whose reads and writes wait at a [`Gate`] (it may block: the device runs it
/// on its thread pool); flushes pass.
type HeldDisk = HookedDisk<MemDisk, Held>;

/// The hook of [`HeldDisk`].
#[derive(Debug)]
struct Held(Arc<Gate>);

impl DiskHook<MemDisk> for Held {
    fn before(&self, op: DiskOp, _: u64, len: u64) -> std::io::Result<u64> {
        if op != DiskOp::Flush {
            self.0.pass();
        }
        Ok(len)
    }

    fn kind(&self, _: &MemDisk) -> &'static str {
        "held"
    }
}

/// The bytes of the disk at `sector`, `len` of them.
fn disk_pattern(sector: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(29) ^ sector.wrapping_mul(131)) as u8)
        .collect()
}

/// A held disk whose every 4 KiB at sector `s` holds `disk_pattern(s, 4096)`.
fn held_disk() -> (HeldDisk, Arc<Gate>) {
    let inner = MemDisk::new(DISK_SIZE).unwrap();
    for s in (0..DISK_SIZE / 512).step_by(8) {
        inner.write_bytes(s * 512, &disk_pattern(s, 4096)).unwrap();
    }
    let gate = Arc::new(Gate::default());
    (HookedDisk::new(inner, Held(Arc::clone(&gate))), gate)
}

/// Mappings of the file behind `fd` in this process (`/proc/self/maps`, by inode).
fn mappings_of(fd: &impl AsRawFd) -> usize {
    // SAFETY: fstat fills the zeroed struct for a descriptor the caller owns.
    let ino = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(fd.as_raw_fd(), &mut st), 0);
        st.st_ino
    };
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(&ino.to_string()))
        .count()
}

#[test]
fn a_region_removed_with_reads_in_flight_stays_mapped_until_they_complete() {
    // Memory hot-unplug with DMA in flight: the reads the disk holds write into the region
    // after the front end removed it. The back end keeps the mapping (each request holds the
    // memory it was submitted with) until the last of them is done, then lets it go.
    const READS: u16 = 5;
    for bounce in [None, Some("policy=force,slots=1024")] {
        let what = format!("bounce {bounce:?}");
        let (disk, gate) = held_disk();
        gate.set(true);
        let dma = match bounce {
            Some(o) => {
                let opts: devices::options::BounceOptions = o.parse().unwrap();
                opts.build(1).unwrap().0
            }
            None => Dma::direct(),
        };
        let device = Block::new(disk, BlockConfig::default(), dma).unwrap();
        let (path, stats_path, server, stop) = start_server_with_stats("held-rem.sock", device);
        let mut d = Driver::connect(&path, 1);
        d.negotiate(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS, WANTED)
            .unwrap();
        // Rings, headers and status bytes below BLK_DATA; the data buffers above it.
        let [low, high] = d.regions_split_at(BLK_DATA);
        d.frontend.add_mem_region(&low).unwrap();
        d.frontend.add_mem_region(&high).unwrap();
        d.configure_default_ring(0).unwrap();
        d.frontend.set_vring_enable(0, true).unwrap();
        let memfd = d.memfd_and_base().0;
        // The driver's mapping and the server's two (once it handled the messages: a request
        // it answers comes back after them).
        d.frontend.get_features().unwrap();
        assert_eq!(mappings_of(&memfd), 3, "{what}");
        let sector = |slot: u16| u64::from(slot) * 8;
        let buf = |slot: u16| BLK_DATA + u64::from(slot) * 4096;
        post_zeroed_reads(&mut d, 0, 0..READS, sector, buf, 4096);
        // Every read popped and held in the disk (the thread pool runs up to 16 at once): a
        // read popped after the removal would find its buffer outside memory.
        gate.wait_arrived(usize::from(READS));
        d.frontend.remove_mem_region(&high).unwrap();
        d.frontend.get_features().unwrap();
        assert_eq!(
            mappings_of(&memfd),
            3,
            "{what}: the region was unmapped under reads in flight"
        );
        gate.set(false);
        let heads = wait_used(&mut d, usize::from(READS));
        assert_eq!(heads.len(), usize::from(READS));
        for slot in 0..READS {
            assert_eq!(blk_status(&d, slot), 0, "{what}: read {slot}");
            let mut got = vec![0u8; 4096];
            d.mem.read_slice(&mut got, GuestAddress(buf(slot))).unwrap();
            assert!(
                got == disk_pattern(sector(slot), 4096),
                "{what}: read {slot} differs"
            );
        }
        // A read into the region still there: the removed one is let go once no request
        // holds it.
        let low_buf = 0x20_0000;
        assert!(low_buf + 4096 <= BLK_DATA);
        blk_request_on(&mut d, 0, 0, VIRTIO_BLK_T_IN, 64, low_buf, 4096);
        wait_used(&mut d, 1);
        assert_eq!(blk_status(&d, 0), 0, "{what}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while mappings_of(&memfd) != 2 {
            assert!(
                Instant::now() < deadline,
                "{what}: the removed region is still mapped"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let st = stats(&stats_path);
        assert_eq!(st["server"]["connected"], true, "{what}: {st}");
        drop(d);
        stop.stop();
        server.join().unwrap();
    }
}

/// The block counter `name`, wherever the statistics put it.
fn counter(st: &serde_json::Value, name: &str) -> u64 {
    match st {
        serde_json::Value::Object(m) => m
            .get(name)
            .and_then(|v| v.as_u64())
            .unwrap_or_else(|| m.values().map(|v| counter(v, name)).max().unwrap_or(0)),
        serde_json::Value::Array(a) => a.iter().map(|v| counter(v, name)).max().unwrap_or(0),
        _ => 0,
    }
}

#[test]
fn requests_that_find_the_pool_full_wait_as_long_as_the_disk_holds_its_slots() {
    // A bounce pool of 256 slots of 2 KiB (the smallest the options make) and reads of
    // 128 KiB (65 slots each with the status byte): three fit. Queue 0 takes the pool with
    // three reads, then queue 1 posts three with none of its own in flight; the disk holds
    // everything for two seconds. Every read waits its turn and completes: back-pressure,
    // not an I/O error.
    const READS: u16 = 3;
    const LEN: u32 = 128 << 10;
    const HOLD: Duration = Duration::from_secs(2);
    let (disk, gate) = held_disk();
    gate.set(true);
    let opts: devices::options::BounceOptions = "policy=force,slots=128".parse().unwrap();
    let (dma, pool) = opts.build(2).unwrap();
    let pool = pool.unwrap();
    let config = BlockConfig {
        num_queues: 2,
        ..BlockConfig::default()
    };
    let device = Block::new(disk, config, dma).unwrap();
    let (path, stats_path, server, stop) = start_server_with_stats("held-full.sock", device);
    let mut d = Driver::connect(&path, 2);
    d.negotiate(
        VhostUserProtocolFeatures::empty(),
        WANTED | feature(VIRTIO_BLK_F_MQ),
    )
    .unwrap();
    d.setup_rings(2).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    d.frontend.set_vring_enable(1, true).unwrap();
    let sector = |q: usize, slot: u16| (q as u64 * u64::from(READS) + u64::from(slot)) * 256;
    let buf = |q: usize, slot: u16| {
        BLK_DATA + (q as u64 * u64::from(READS) + u64::from(slot)) * u64::from(LEN)
    };
    assert!(buf(1, READS) <= MEM_SIZE as u64);
    let post = |d: &mut Driver, q: usize| {
        for slot in 0..READS {
            let (s, b) = (sector(q, slot), buf(q, slot));
            blk_request_on(d, q, slot, VIRTIO_BLK_T_IN, s, b, LEN);
        }
    };
    post(&mut d, 0);
    gate.wait_arrived(1);
    post(&mut d, 1);
    let st = wait_stats(&stats_path, "queue 1 waits for slots", |st| {
        counter(st, "pool_full_waits") >= 1 && st["workers"][1]["in_flight"] == 0
    });
    assert!(pool.stats().used > 0, "{st}");
    let opened = {
        let gate = Arc::clone(&gate);
        std::thread::spawn(move || {
            std::thread::sleep(HOLD);
            gate.set(false);
        })
    };
    for q in 0..2 {
        let mut seen = 0;
        while seen < READS {
            let Some((id, len)) = d.poll_used(q) else {
                panic!("queue {q}: {seen} of {READS} reads completed");
            };
            let slot = u16::try_from(id / 3).unwrap();
            assert_eq!(blk_status_on(&d, q, slot), 0, "queue {q} read {slot}");
            assert_eq!(len, LEN + 1, "queue {q} read {slot}");
            let mut got = vec![0u8; LEN as usize];
            d.mem
                .read_slice(&mut got, GuestAddress(buf(q, slot)))
                .unwrap();
            for (i, chunk) in got.chunks(4096).enumerate() {
                let s = sector(q, slot) + 8 * i as u64;
                assert!(
                    chunk == disk_pattern(s, 4096),
                    "queue {q} read {slot} differs"
                );
            }
            seen += 1;
        }
    }
    opened.join().unwrap();
    let st = stats(&stats_path);
    assert_eq!(counter(&st, "pool_full_failed"), 0, "{st}");
    // Queue 1 was woken by queue 0's completions.
    assert!(st["workers"][1]["slot_wakeups"].as_u64() >= Some(1), "{st}");
    assert_eq!(pool.stats().used, 0, "{st}");
    // A request that can never fit (larger than the whole pool) fails at once.
    let big = 768 << 10;
    assert!(BLK_DATA + u64::from(big) <= MEM_SIZE as u64);
    blk_request_on(&mut d, 0, 0, VIRTIO_BLK_T_IN, 0, BLK_DATA, big);
    assert!(d.poll_used(0).is_some());
    assert_eq!(blk_status_on(&d, 0, 0), VIRTIO_BLK_S_IOERR);
    drop(d);
    stop.stop();
    server.join().unwrap();
}
