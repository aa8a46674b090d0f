//! How many locks one 4 KiB read takes through vhost-user-blk, counted on the event path an
//! epoll thread of `vhost-user-backend` runs, with a real block device, io_uring engine and
//! bounce pool.
//!
//! What is counted, and how:
//! - **transport**: every lock taken on the adapter's vrings ([`crate::vring::Vring`]: the
//!   lock of a served queue, with its thread's group on the thread's first vring, and the
//!   lock of `vhost-user-backend`'s view) and on the adapter's event path, counted where it is
//!   taken ([`crate::vring::EVENT_LOCKS`]), from the epoll handler's `read_kick` (which
//!   consumes the kick: the test calls it the same way) through the back end's
//!   `handle_event`;
//! - **allocator**: every acquisition of the bounce allocator's locks (its `TimedMutex`
//!   counters, the ones the pool statistics report).
//!
//! Nothing else on the path takes a lock: guest memory is read through an `ArcSwap`
//! (`GuestMemoryAtomic::memory`), the kick and call eventfds through an `ArcSwapOption`, the
//! engine is io_uring, counters are atomics. The pool's
//! occupancy mutex is taken only when a thread's quota runs out, which the warm-up requests
//! settle.

use std::os::fd::RawFd;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use bounce::BouncePool;
use devices::block::io::{AioMode, CacheMode};
use devices::block::request::RequestHeader;
use devices::block::BlockConfig;
use devices::options::BounceOptions;
use devices::testing::{device_queue, GuestRam};
use devices::virtio::driver::{Buf, DriverQueue};
use devices::virtio::spec::{feature, VIRTIO_BLK_T_IN, VIRTIO_F_VERSION_1};
use vhost_user_backend::{VhostUserBackend, VringT};
use virtio_queue::QueueT;
use vmm_sys_util::epoll::EventSet;

use super::backend::{AtomicMemory, Listeners, Vring};
use super::vring::EVENT_LOCKS;
use super::VhostUserDevice;

/// Records the worker fds the adapter registers (the engine's completion eventfd).
#[derive(Default)]
struct Recorder(Mutex<Vec<(RawFd, u64)>>);

impl Listeners for Recorder {
    fn register(&self, fd: RawFd, data: u64) -> std::io::Result<()> {
        self.0.lock().unwrap().push((fd, data));
        Ok(())
    }
    fn unregister(&self, _fd: RawFd, _data: u64) -> std::io::Result<()> {
        Ok(())
    }
}

/// Locks counted over some requests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Count {
    requests: u64,
    kick_events: u64,
    engine_events: u64,
    transport: u64,
    allocator: u64,
}

/// A vhost-user-blk back end on a 1 MiB raw image, one queue, driven as its epoll thread
/// would be.
struct Rig {
    _dir: TempImage,
    dev: Arc<VhostUserDevice<devices::block::Block<devices::block::DiskImage>>>,
    pool: Option<Arc<BouncePool>>,
    ram: GuestRam,
    vq: DriverQueue,
    vring: Vring,
    /// The front end's end of the kick eventfd.
    kick: std::fs::File,
    engine: (RawFd, u64),
    data: u64,
}

/// An image file removed on drop.
struct TempImage(std::path::PathBuf);

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const QSIZE: u16 = 128;

impl Rig {
    fn new(bounce: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("bvm-locks-{}-{n}.img", std::process::id()));
        std::fs::write(&path, vec![0x5a; 1 << 20]).unwrap();
        let image = TempImage(path);
        let config = BlockConfig {
            aio: Some(AioMode::IoUring),
            // O_DIRECT: reads go to the disk and complete later, as in the benchmarks,
            // rather than from the page cache inside the submission.
            cache: CacheMode::None,
            queue_size: QSIZE,
            ..BlockConfig::default()
        };
        let bounce = BounceOptions::from_str(bounce).unwrap();
        let mut pools = devices::pools::PoolRegistry::default();
        let built =
            devices::builder::block(&image.0, None, false, config, &bounce, &mut pools, "blk")
                .unwrap();
        let dev = Arc::new(VhostUserDevice::new(built.device));
        let listeners = Arc::new(Recorder::default());
        dev.attach_listeners(vec![listeners.clone()]);
        let mut ram = GuestRam::new(4 << 20);
        let vq = ram.new_queue(QSIZE, false);
        let mem = AtomicMemory::new(ram.mem().clone());
        dev.update_memory(mem.clone()).unwrap();
        dev.acked_features(feature(VIRTIO_F_VERSION_1));
        let q = device_queue(&vq.layout(), QSIZE, false);
        let vring = <Vring as VringT<AtomicMemory>>::new(mem, QSIZE).unwrap();
        vring.set_queue_size(QSIZE);
        vring
            .set_queue_info(q.desc_table(), q.avail_ring(), q.used_ring())
            .unwrap();
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        let (ours, kick) = crate::vring::tests::eventfd();
        vring.set_kick(Some(ours));
        let engine = listeners.0.lock().unwrap().first().copied().unwrap();
        let data = ram.alloc(4096 * u64::from(QSIZE), 4096);
        Self {
            _dir: image,
            dev,
            pool: built.pool,
            ram,
            vq,
            vring,
            kick,
            engine,
            data,
        }
    }

    fn allocator_locks(&self) -> u64 {
        self.pool.as_ref().map_or(0, |p| {
            p.allocator()
                .lock_stats()
                .iter()
                .map(|l| l.acquisitions)
                .sum()
        })
    }

    /// Posts `n` 4 KiB reads, kicks once and serves engine events until all are used;
    /// returns the locks taken.
    fn reads(&mut self, n: u16) -> Count {
        let before_alloc = self.allocator_locks();
        let before_transport = EVENT_LOCKS.with(|c| c.get());
        let mut count = Count {
            requests: u64::from(n),
            ..Count::default()
        };
        let used_before = self.vq.used_idx(self.ram.mem()).unwrap();
        for i in 0..n {
            let hdr = RequestHeader::encode(VIRTIO_BLK_T_IN, u64::from(i % 256 * 8));
            let h = self.ram.alloc_bytes(&hdr);
            let st = self.ram.alloc(1, 1);
            let data = self.data + u64::from(i) * 4096;
            let head = self
                .vq
                .add_chain(
                    self.ram.mem(),
                    &[Buf::ro(h, 16), Buf::wo(data, 4096), Buf::wo(st, 1)],
                )
                .unwrap();
            self.vq.push(self.ram.mem(), head).unwrap();
            self.vq.publish(self.ram.mem()).unwrap();
        }
        // The kick, as the epoll handler delivers it: `read_kick` consumes the eventfd, then
        // the back end.
        crate::vring::tests::write(&self.kick, 1).unwrap();
        assert!(self.vring.read_kick().unwrap(), "the vring is enabled");
        count.kick_events += 1;
        let vrings = std::slice::from_ref(&self.vring);
        self.dev.handle_event(0, EventSet::IN, vrings, 0).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while self
            .vq
            .used_idx(self.ram.mem())
            .unwrap()
            .wrapping_sub(used_before)
            < n
        {
            assert!(
                std::time::Instant::now() < deadline,
                "reads never completed"
            );
            // An engine event only when its eventfd is readable: epoll re-checks an
            // edge-triggered fd before reporting it, so one drained by the kick's reap
            // brings no event.
            let mut p = libc::pollfd {
                fd: self.engine.0,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut p, 1, 100) };
            if r == 1 {
                count.engine_events += 1;
                let event = u16::try_from(self.engine.1).unwrap();
                self.dev
                    .handle_event(event, EventSet::IN, vrings, 0)
                    .unwrap();
            }
        }
        while self.vq.next_used(self.ram.mem()).unwrap().is_some() {}
        count.transport += EVENT_LOCKS.with(|c| c.get()) - before_transport;
        count.allocator = self.allocator_locks() - before_alloc;
        count
    }

    /// `n` reads one at a time (depth 1), after a warm-up.
    fn one_at_a_time(&mut self, n: u16) -> Count {
        for _ in 0..8 {
            self.reads(1);
        }
        let mut total = Count::default();
        for _ in 0..n {
            let c = self.reads(1);
            total.requests += c.requests;
            total.kick_events += c.kick_events;
            total.engine_events += c.engine_events;
            total.transport += c.transport;
            total.allocator += c.allocator;
        }
        total
    }
}

/// Transport locks per event type: a kick and an engine event each take the lock of the
/// thread's one vring, which holds both the queue and the thread's group (`read_kick` takes
/// none).
fn transport_by_event(c: &Count) -> u64 {
    c.kick_events + c.engine_events
}

/// Reads at depth 1 per measurement.
const N: u16 = 16;

#[test]
fn a_4k_read_takes_the_counted_locks() {
    for (bounce, allocator_per_read) in [
        // Three mappings (status, header, data) and three unmaps in three allocator calls:
        // status and header mapped together; the header released and the data mapped
        // together; data and status released together at completion.
        ("policy=force,alloc=areas", 3),
        ("policy=off", 0),
    ] {
        let mut rig = Rig::new(bounce);
        let c = rig.one_at_a_time(N);
        eprintln!(
            "{bounce}: per 4 KiB read at depth 1: {:.2} transport locks ({} kick, {} engine events for {} reads), {:.2} allocator locks",
            c.transport as f64 / f64::from(N),
            c.kick_events,
            c.engine_events,
            c.requests,
            c.allocator as f64 / f64::from(N),
        );
        assert_eq!(c.transport, transport_by_event(&c), "{bounce}: {c:?}");
        assert_eq!(c.kick_events, u64::from(N));
        assert!(
            c.engine_events <= u64::from(N),
            "{bounce}: at most one engine event per read: {c:?}"
        );
        assert!(c.transport <= 2 * u64::from(N), "{bounce}: {c:?}");
        assert_eq!(
            c.allocator,
            allocator_per_read * u64::from(N),
            "{bounce}: {c:?}"
        );
        assert!(
            c.transport + c.allocator <= 5 * u64::from(N),
            "{bounce}: at most 5 locks per 4 KiB read: {c:?}"
        );
    }
}

/// Locks per 4 KiB read at depth 1 with every allocator (and without bouncing), printed as
/// a table; the allocators with one lock per area or per pool take it once per allocator
/// call of a request.
#[test]
fn every_allocator_takes_one_lock_per_allocator_call() {
    let mut table = String::from("| bounce | transport | allocator | total |\n|---|---|---|---|\n");
    let mut configs: Vec<String> = bounce::AllocatorKind::ALL
        .iter()
        .map(|k| format!("policy=force,alloc={k}"))
        .collect();
    configs.push("policy=force,mode=iova".into());
    configs.push("policy=off".into());
    let counts: Vec<(&String, Count)> = configs
        .iter()
        .map(|bounce| (bounce, Rig::new(bounce).one_at_a_time(N)))
        .collect();
    let per = |n: u64| n as f64 / f64::from(N);
    for (bounce, c) in &counts {
        table.push_str(&format!(
            "| {bounce} | {:.2} | {:.2} | {:.2} |\n",
            per(c.transport),
            per(c.allocator),
            per(c.transport + c.allocator)
        ));
    }
    eprintln!("locks per 4 KiB read at depth 1:\n{table}");
    // One lock per call for the allocators with one lock per area or per pool.
    let one_per_call = [
        "areas",
        "areas-bitmap",
        "areas-lifo",
        "legacy",
        "bitmap",
        "iova-rbtree",
    ];
    for (bounce, c) in &counts {
        assert_eq!(c.transport, transport_by_event(c), "{bounce}: {c:?}");
        if one_per_call
            .iter()
            .any(|k| bounce.ends_with(&format!("alloc={k}")))
        {
            assert_eq!(c.allocator, 3 * u64::from(N), "{bounce}: {c:?}");
        }
    }
}

#[test]
fn a_burst_of_reads_shares_its_transport_locks() {
    let mut rig = Rig::new("policy=force,alloc=areas");
    rig.one_at_a_time(1);
    let c = rig.reads(32);
    eprintln!(
        "32 reads in one kick: {} transport locks ({} engine events), {} allocator locks",
        c.transport, c.engine_events, c.allocator
    );
    assert_eq!(c.transport, transport_by_event(&c), "{c:?}");
    // Two allocator calls to start each read, one per reap to complete what it reaped: at
    // most one per read.
    assert!(c.allocator > 2 * 32 && c.allocator <= 3 * 32, "{c:?}");
    // At most one engine event per read; in practice completions arrive in batches.
    assert!(c.engine_events <= 32, "{c:?}");
}
