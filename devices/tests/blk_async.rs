//! The asynchronous block device at depth: many requests in flight per queue, completions in
//! any order, bounce mappings held for the whole I/O, back-pressure on a full pool, cache
//! modes with QEMU's semantics, FLUSH ordering. None of it depends on timing: completions are
//! awaited by polling the worker's own fds (with a generous timeout that only fails a broken
//! device).

mod common;

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use bounce::{Direction, Dma, Policy, PoolConfig, RangeCheck};
use common::{pattern, RAM};
use devices::block::io::{AioMode, CacheMode, OnFull, RawDisk};
use devices::block::request::RequestHeader;
use devices::block::{Block, BlockConfig, Disk, MemDisk, STATUS_UNSET};
use devices::testing::{dma_matrix, gate_disk, DiskHook, DiskOp, GateDisk, HookedDisk, TestDriver};
use devices::virtio::driver::{Buf, Used};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use devices::virtio::VirtioDevice;
use vm_memory::GuestMemoryMmap;

const DISK: u64 = 16 << 20;

type Drv<D> = TestDriver<Block<D>>;

fn driver<D: Disk>(disk: D, cfg: BlockConfig, dma: Dma, qsize: u16) -> Drv<D> {
    let dev = Block::new(disk, cfg, dma).expect("device");
    let mut drv = TestDriver::new(dev, RAM);
    drv.negotiate(u64::MAX);
    drv.activate(qsize).expect("activate");
    drv
}

fn cfg(aio: AioMode, cache: CacheMode) -> BlockConfig {
    BlockConfig {
        aio: Some(aio),
        cache,
        ..BlockConfig::default()
    }
}

/// Reaps queue 0 until `n` more used entries arrived, running the worker on its own fds
/// (engine completions, the retry timer) as a transport would.
fn settle<D: Disk>(drv: &mut Drv<D>, n: usize, mut used: Vec<Used>) -> Vec<Used> {
    used.extend(drv.wait_used(0, n, std::time::Duration::from_secs(20)));
    used
}

/// One posted request: head, data address, status address.
#[derive(Clone, Copy, Debug)]
struct Req {
    head: u16,
    data: u64,
    st: u64,
}

/// Posts (without kicking) a request of type `t` at `sector` with its header, `data` (if it
/// has a data buffer) and its status byte.
fn post_bufs<D: Disk>(drv: &mut Drv<D>, t: u32, sector: u64, data: Option<Buf>) -> Req {
    let h = drv.ram.alloc_bytes(&RequestHeader::encode(t, sector));
    let st = drv.ram.alloc(1, 1);
    drv.ram.write(st, &[STATUS_UNSET]);
    let mut bufs = vec![Buf::ro(h, 16)];
    bufs.extend(data);
    bufs.push(Buf::wo(st, 1));
    let head = drv.post(0, &bufs).expect("free descriptors");
    Req {
        head,
        data: data.map_or(0, |b| b.addr),
        st,
    }
}

/// Posts (without kicking) a read or write of `len` bytes at `sector` whose data buffer is
/// 4 KiB aligned plus `misalign` bytes.
fn post<D: Disk>(
    drv: &mut Drv<D>,
    t: u32,
    sector: u64,
    payload: &[u8],
    len: u32,
    misalign: u64,
) -> Req {
    let data = drv.ram.alloc(u64::from(len) + 4096, 4096) + misalign;
    let buf = match t {
        VIRTIO_BLK_T_IN => Some(Buf::wo(data, len)),
        VIRTIO_BLK_T_OUT => {
            drv.ram.write(data, payload);
            Some(Buf::ro(data, len))
        }
        _ => None,
    };
    Req {
        data,
        ..post_bufs(drv, t, sector, buf)
    }
}

/// Posts write `i`: 4 KiB of `pattern(i, 4096)` at 4 KiB block `i`.
fn write_block<D: Disk>(drv: &mut Drv<D>, i: u64) -> Req {
    post(drv, VIRTIO_BLK_T_OUT, i * 8, &pattern(i, 4096), 4096, 0)
}

fn status_of<D: Disk>(drv: &Drv<D>, r: Req) -> u8 {
    drv.ram.read(r.st, 1)[0]
}

fn stats<D: Disk>(drv: &Drv<D>) -> serde_json::Value {
    VirtioDevice::<GuestMemoryMmap>::stats(&drv.device)
}

fn raw_image(dir: &Path, cache: CacheMode) -> RawDisk {
    let p = dir.join("disk.raw");
    std::fs::File::create(&p).unwrap().set_len(DISK).unwrap();
    RawDisk::open_with(&p, false, cache).unwrap()
}

/// 32 writes of 4 KiB in flight at once, then 32 reads of them, verified, for bounce off and
/// every allocator in both pool modes, with io_uring and the thread pool. Each request keeps
/// its bounce slots until its host I/O completes: the pool's high-water mark covers all 32.
#[test]
fn depth_32_verifies_for_every_allocator_and_pool_mode() {
    let dmas = dma_matrix(4096);
    for aio in [AioMode::IoUring, AioMode::Threads] {
        for (name, dma) in &dmas {
            let dir = tempfile::tempdir().unwrap();
            let disk = raw_image(dir.path(), CacheMode::Writeback);
            let mut drv = driver(disk, cfg(aio, CacheMode::Writeback), dma.clone(), 256);
            if let Some(p) = dma.pool() {
                p.reset_hiwater();
            }
            // Scattered sectors, in an order unrelated to the heads.
            let sector = |i: u64| ((i * 37) % 64) * 16;
            let writes: Vec<Req> = (0..32)
                .map(|i| {
                    post(
                        &mut drv,
                        VIRTIO_BLK_T_OUT,
                        sector(i),
                        &pattern(i, 4096),
                        4096,
                        0,
                    )
                })
                .collect();
            drv.kick(0).unwrap();
            let used = settle(&mut drv, 32, Vec::new());
            assert_eq!(used.len(), 32);
            for w in &writes {
                assert_eq!(status_of(&drv, *w), VIRTIO_BLK_S_OK, "{aio} {name}");
            }
            if let Some(p) = dma.pool() {
                let st = p.stats();
                println!(
                    "{aio} {name}: 32 x 4 KiB in flight, pool used_hiwater {}",
                    st.used_hiwater
                );
                // 4 KiB of data plus the status byte per request, all held at once.
                let per_req = if p.is_iova() { 2 } else { 3 };
                assert!(
                    st.used_hiwater >= 32 * per_req,
                    "{aio} {name}: pool high-water {} < 32 requests' worth",
                    st.used_hiwater
                );
                assert_eq!(st.used, 0, "{aio} {name}: slots leaked");
            }
            let reads: Vec<Req> = (0..32)
                .map(|i| post(&mut drv, VIRTIO_BLK_T_IN, sector(i), &[], 4096, 0))
                .collect();
            drv.kick(0).unwrap();
            let used = settle(&mut drv, 32, Vec::new());
            for (i, r) in reads.iter().enumerate() {
                assert_eq!(status_of(&drv, *r), VIRTIO_BLK_S_OK);
                assert_eq!(
                    drv.ram.read(r.data, 4096),
                    pattern(i as u64, 4096),
                    "{aio} {name}: read {i}"
                );
                let u = used.iter().find(|u| u.id == u32::from(r.head)).unwrap();
                assert_eq!(u.len, 4097);
            }
            let s = stats(&drv);
            assert!(
                s["metrics"]["inflight_hiwater"].as_u64().unwrap() >= 32,
                "{s}"
            );
            assert_eq!(s["engine"]["aio"], aio.name());
            // io_uring registers the bounce pool once; then each request's 4 KiB data piece
            // (32 writes, 32 reads) is a fixed-buffer op. Root can always pin it.
            let regions = s["engine"]["fixed_regions"].as_u64().unwrap();
            let fixed = s["engine"]["fixed_ops"].as_u64().unwrap();
            if aio == AioMode::IoUring && dma.pool().is_some() {
                let root =
                    std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap())
                        == 0;
                if root {
                    assert_eq!(regions, 1, "{aio} {name}: pool not registered");
                }
                assert_eq!(fixed, 64 * regions, "{aio} {name}: {s}");
            } else {
                assert_eq!((regions, fixed), (0, 0), "{aio} {name}");
            }
        }
    }
}

/// A burst does not wait for its last request to be mapped before its first reaches the
/// kernel: 32 reads posted at once and kicked once enter io_uring after the 1st, 2nd, 4th,
/// 8th, 16th and 32nd (six submissions, not one), bounced or not, and all complete.
#[test]
fn a_burst_reaches_the_kernel_in_doubling_batches() {
    let dmas = dma_matrix(4096);
    for (name, dma) in dmas
        .iter()
        .filter(|(n, _)| n == "off" || n.ends_with("magazine"))
    {
        let dir = tempfile::tempdir().unwrap();
        let disk = raw_image(dir.path(), CacheMode::Writeback);
        let mut drv = driver(
            disk,
            cfg(AioMode::IoUring, CacheMode::Writeback),
            dma.clone(),
            256,
        );
        let reads: Vec<Req> = (0..32)
            .map(|i| post(&mut drv, VIRTIO_BLK_T_IN, i * 8, &[], 4096, 0))
            .collect();
        drv.kick(0).unwrap();
        settle(&mut drv, 32, Vec::new());
        for r in &reads {
            assert_eq!(status_of(&drv, *r), VIRTIO_BLK_S_OK, "{name}");
        }
        let s = stats(&drv);
        assert_eq!(s["engine"]["submitted"], 32, "{name}: {s}");
        assert_eq!(s["engine"]["submit_calls"], 6, "{name}: {s}");
    }
}

/// Completions go on the used ring in the order the host finishes them: the first request
/// posted is held by the disk and is used last, after the seven behind it; each batch of
/// completions asks for one notification.
#[test]
fn used_ring_follows_completion_order() {
    for (name, dma) in dma_matrix(4096) {
        let (disk, tx) = gated_disk();
        disk.inner.write_bytes(0, &pattern(99, 4096)).unwrap();
        let mut drv = driver(disk, cfg(AioMode::Threads, CacheMode::Writeback), dma, 64);
        let held = post(&mut drv, VIRTIO_BLK_T_IN, 0, &[], 4096, 0);
        let rest: Vec<Req> = (1..8)
            .map(|i| post(&mut drv, VIRTIO_BLK_T_IN, i * 8, &[], 4096, 0))
            .collect();
        drv.kick(0).unwrap();
        let used = settle(&mut drv, 7, Vec::new());
        assert!(
            used.iter().all(|u| u.id != u32::from(held.head)),
            "{name}: the held request completed"
        );
        assert_eq!(
            status_of(&drv, held),
            STATUS_UNSET,
            "{name}: status written early"
        );
        for r in &rest {
            assert_eq!(status_of(&drv, *r), VIRTIO_BLK_S_OK);
        }
        assert!(drv.signals(0) >= 1);
        tx.send(()).unwrap();
        let used = settle(&mut drv, 1, Vec::new());
        assert_eq!(used[0].id, u32::from(held.head), "{name}");
        assert_eq!(drv.ram.read(held.data, 4096), pattern(99, 4096));
        if let Some(p) = drv.device.dma().pool() {
            assert_eq!(p.used(), 0);
        }
    }
}

/// Counts the flushes that reach a memory disk, to check each cache mode's.
#[derive(Debug, Default)]
struct FlushCount(AtomicU64);

impl FlushCount {
    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl DiskHook<MemDisk> for FlushCount {
    fn before(&self, op: DiskOp, _: u64, len: u64) -> io::Result<u64> {
        if op == DiskOp::Flush {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        Ok(len)
    }
    fn kind(&self, _: &MemDisk) -> &'static str {
        "counting"
    }
}

fn one<D: Disk>(drv: &mut Drv<D>, t: u32, sector: u64, data: &[u8], len: u32) -> Req {
    let r = post(drv, t, sector, data, len, 0);
    drv.kick(0).unwrap();
    settle(drv, 1, Vec::new());
    r
}

/// QEMU's table: the guest sees the write cache of the mode (config `writeback`, CONFIG_WCE
/// and FLUSH offered); with it off every write is followed by a flush before it completes;
/// FLUSH syncs except with `unsafe`; the guest can switch the cache through `writeback`.
#[test]
fn cache_modes_decide_wce_and_flushes() {
    for cache in CacheMode::ALL {
        for aio in [AioMode::Threads, AioMode::Sync] {
            let disk = HookedDisk::new(MemDisk::new(DISK).unwrap(), FlushCount::default());
            let mut drv = driver(disk, cfg(aio, cache), Dma::direct(), 64);
            let offered = VirtioDevice::<GuestMemoryMmap>::avail_features(&drv.device);
            assert_ne!(offered & feature(VIRTIO_BLK_F_CONFIG_WCE), 0);
            assert_ne!(offered & feature(VIRTIO_BLK_F_FLUSH), 0);
            assert_eq!(
                drv.read_config(32, 1)[0],
                u8::from(cache.write_cache()),
                "{cache}: writeback field"
            );
            let w = one(&mut drv, VIRTIO_BLK_T_OUT, 8, &pattern(1, 4096), 4096);
            assert_eq!(status_of(&drv, w), VIRTIO_BLK_S_OK);
            let flushes = drv.device.disk().hook.get();
            assert_eq!(
                flushes,
                u64::from(!cache.write_cache()),
                "{cache} {aio}: after a write"
            );
            let f = one(&mut drv, VIRTIO_BLK_T_FLUSH, 0, &[], 0);
            assert_eq!(status_of(&drv, f), VIRTIO_BLK_S_OK);
            let after = drv.device.disk().hook.get();
            assert_eq!(
                after - flushes,
                u64::from(!cache.no_flush()),
                "{cache} {aio}: FLUSH"
            );
            // The guest turns the write cache off: writes are now synced one by one.
            VirtioDevice::<GuestMemoryMmap>::write_config(&mut drv.device, 32, &[0]);
            assert_eq!(drv.read_config(32, 1)[0], 0);
            let w = one(&mut drv, VIRTIO_BLK_T_OUT, 16, &pattern(2, 512), 512);
            assert_eq!(status_of(&drv, w), VIRTIO_BLK_S_OK);
            assert_eq!(drv.device.disk().hook.get(), after + 1, "{cache}");
        }
    }
}

/// With O_DIRECT (none, directsync) guest buffers that are not aligned for direct I/O go
/// through the engine's aligned bounce buffer (counted), aligned ones do not, and the bytes
/// are right in every mode and engine.
#[test]
fn every_cache_mode_with_unaligned_guest_buffers() {
    for cache in CacheMode::ALL {
        for aio in AioMode::ALL {
            let dir = tempfile::tempdir().unwrap();
            let disk = raw_image(dir.path(), cache);
            let mut drv = driver(disk, cfg(aio, cache), Dma::direct(), 64);
            // Aligned, then 1 byte off a page, then 3 bytes off.
            for (i, mis) in [0u64, 1, 3].into_iter().enumerate() {
                let data = pattern(10 + i as u64, 8192);
                let sector = 64 * (i as u64 + 1);
                let w = post(&mut drv, VIRTIO_BLK_T_OUT, sector, &data, 8192, mis);
                drv.kick(0).unwrap();
                settle(&mut drv, 1, Vec::new());
                assert_eq!(status_of(&drv, w), VIRTIO_BLK_S_OK, "{cache} {aio} +{mis}");
                let back = post(&mut drv, VIRTIO_BLK_T_IN, sector, &[], 8192, mis);
                drv.kick(0).unwrap();
                settle(&mut drv, 1, Vec::new());
                assert_eq!(status_of(&drv, back), VIRTIO_BLK_S_OK);
                assert_eq!(drv.ram.read(back.data, 8192), data, "{cache} {aio} +{mis}");
            }
            let s = stats(&drv);
            let bounced = s["engine"]["dio_bounced"].as_u64().unwrap();
            if cache.direct() {
                // Two writes and two reads were misaligned.
                assert_eq!(bounced, 4, "{cache} {aio}: {s}");
            } else {
                assert_eq!(bounced, 0, "{cache} {aio}");
            }
            assert_eq!(s["engine"]["cache"], cache.name());
        }
    }
}

/// The durable storage behind a memory disk that plays a volatile cache: writes land in the
/// cache, a flush copies the cache to storage; `durable` is what survives a host crash.
#[derive(Debug)]
struct Durable(Mutex<Vec<u8>>);

impl Durable {
    fn durable(&self, off: usize, len: usize) -> Vec<u8> {
        self.0.lock().unwrap()[off..off + len].to_vec()
    }
}

impl DiskHook<MemDisk> for Durable {
    fn after(&self, op: DiskOp, cache: &MemDisk) -> io::Result<()> {
        if op != DiskOp::Flush {
            return Ok(());
        }
        let mut d = self.0.lock().unwrap();
        cache.read_bytes(0, &mut d)
    }
    fn kind(&self, _: &MemDisk) -> &'static str {
        "crash"
    }
}

/// A 1 MiB cache with its durable storage.
fn crash_disk() -> HookedDisk<MemDisk, Durable> {
    let cache = MemDisk::new(1 << 20).unwrap();
    HookedDisk::new(cache, Durable(Mutex::new(vec![0; 1 << 20])))
}

/// A FLUSH covers every write completed before it: eight writes at depth complete, then a
/// FLUSH (posted together with more writes) completes, and all eight are durable. With
/// `unsafe` the FLUSH is ignored and they are not; with write-through they are durable before
/// any FLUSH.
#[test]
fn flush_covers_every_write_completed_before_it() {
    for aio in [AioMode::Threads, AioMode::Sync] {
        for cache in [
            CacheMode::Writeback,
            CacheMode::Unsafe,
            CacheMode::Writethrough,
        ] {
            let mut drv = driver(crash_disk(), cfg(aio, cache), Dma::direct(), 64);
            let writes: Vec<Req> = (0..8).map(|i| write_block(&mut drv, i)).collect();
            drv.kick(0).unwrap();
            settle(&mut drv, 8, Vec::new());
            assert!(writes
                .iter()
                .all(|w| status_of(&drv, *w) == VIRTIO_BLK_S_OK));
            let durable_before = drv.device.disk().hook.durable(0, 4096) == pattern(0, 4096);
            assert_eq!(
                durable_before,
                cache == CacheMode::Writethrough,
                "{cache}: before FLUSH"
            );
            let f = post(&mut drv, VIRTIO_BLK_T_FLUSH, 0, &[], 0, 0);
            let later: Vec<Req> = (8..12).map(|i| write_block(&mut drv, i)).collect();
            drv.kick(0).unwrap();
            settle(&mut drv, 5, Vec::new());
            assert_eq!(status_of(&drv, f), VIRTIO_BLK_S_OK);
            assert!(later.iter().all(|w| status_of(&drv, *w) == VIRTIO_BLK_S_OK));
            for i in 0..8u64 {
                let at = usize::try_from(i * 8 * 512).unwrap();
                let durable = drv.device.disk().hook.durable(at, 4096) == pattern(i, 4096);
                assert_eq!(
                    durable,
                    cache != CacheMode::Unsafe,
                    "{aio} {cache}: write {i} completed before the FLUSH"
                );
            }
        }
    }
}

fn small_pool(slots: usize) -> Dma {
    let mut c = PoolConfig::swiotlb(slots);
    c.areas = Some(1);
    Dma::bounced(
        Policy::Force,
        Arc::new(bounce::BouncePool::new(&c).unwrap()),
    )
}

/// A driver on `disk` with `aio`, a write-back cache, queues of 64 and a [`small_pool`] of
/// `slots`; with the pool's handle.
fn small_pool_driver<D: Disk>(disk: D, aio: AioMode, slots: usize) -> (Drv<D>, Dma) {
    let dma = small_pool(slots);
    let drv = driver(disk, cfg(aio, CacheMode::Writeback), dma.clone(), 64);
    (drv, dma)
}

/// A pool too small for the queue's depth: with `on-full=wait` requests that do not fit stay
/// on the ring and go in as others complete, and all succeed; with `on-full=fail` some fail
/// with IOERR at once. Both are counted.
#[test]
fn back_pressure_wait_and_fail() {
    for aio in [AioMode::IoUring, AioMode::Threads] {
        for on_full in [OnFull::Wait, OnFull::Fail] {
            let dir = tempfile::tempdir().unwrap();
            let disk = raw_image(dir.path(), CacheMode::Writeback);
            let c = BlockConfig {
                on_full,
                ..cfg(aio, CacheMode::Writeback)
            };
            // 128 slots of 2 KiB: about 40 requests of 4 KiB + status fit at once.
            let mut drv = driver(disk, c, small_pool(128), 256);
            let reqs: Vec<Req> = (0..60).map(|i| write_block(&mut drv, i)).collect();
            drv.kick(0).unwrap();
            settle(&mut drv, 60, Vec::new());
            let failed = reqs
                .iter()
                .filter(|r| status_of(&drv, **r) != VIRTIO_BLK_S_OK)
                .count();
            let s = stats(&drv);
            let m = &s["metrics"];
            match on_full {
                OnFull::Wait => {
                    assert_eq!(failed, 0, "{aio}: {s}");
                    assert!(m["pool_full_waits"].as_u64().unwrap() > 0, "{s}");
                    assert_eq!(m["pool_full_failed"], 0);
                }
                OnFull::Fail => {
                    assert!(failed > 0, "{aio}: nothing failed on a full pool");
                    assert!(m["pool_full_failed"].as_u64().unwrap() > 0);
                    assert_eq!(m["pool_full_waits"], 0);
                }
            }
            assert_eq!(drv.device.dma().pool().unwrap().used(), 0);
        }
    }
}

/// A request larger than the whole pool can never fit: it fails even with `on-full=wait`,
/// and the queue goes on.
#[test]
fn a_request_that_can_never_fit_fails() {
    let dir = tempfile::tempdir().unwrap();
    let disk = raw_image(dir.path(), CacheMode::Writeback);
    let (mut drv, _) = small_pool_driver(disk, AioMode::IoUring, 128);
    // 128 slots * 2 KiB = 256 KiB; ask for 384 KiB.
    let big = one(&mut drv, VIRTIO_BLK_T_IN, 0, &[], 384 << 10);
    assert_eq!(status_of(&drv, big), VIRTIO_BLK_S_IOERR);
    let small = one(&mut drv, VIRTIO_BLK_T_IN, 0, &[], 4096);
    assert_eq!(status_of(&drv, small), VIRTIO_BLK_S_OK);
    assert_eq!(stats(&drv)["metrics"]["pool_full_failed"], 1);
}

/// The pool is full because someone else holds it and the queue has nothing in flight of its
/// own: the request waits on the worker's retry timer and goes in once the slots are free.
#[test]
fn waiting_with_nothing_in_flight_retries_on_the_timer() {
    let dir = tempfile::tempdir().unwrap();
    let disk = raw_image(dir.path(), CacheMode::Writeback);
    let (mut drv, dma) = small_pool_driver(disk, AioMode::IoUring, 128);
    // Another user takes all but one slot.
    let hog = drv.ram.alloc(127 * 2048, 4096);
    let held = dma
        .map(
            drv.ram.mem(),
            hog,
            127 * 2048,
            Direction::ToDevice,
            1,
            RangeCheck::Here,
        )
        .unwrap();
    let r = post(&mut drv, VIRTIO_BLK_T_IN, 0, &[], 4096, 0);
    drv.kick(0).unwrap();
    assert!(drv.reap(0).is_empty(), "completed on a full pool");
    assert_eq!(status_of(&drv, r), STATUS_UNSET);
    // Timer rounds pass without progress while the pool stays full.
    for _ in 0..3 {
        let n = drv.poll_worker(0, 5000).unwrap();
        assert!(n > 0, "the retry timer never fired");
        assert!(drv.reap(0).is_empty());
    }
    dma.unmap(drv.ram.mem(), held, 1).unwrap();
    let used = settle(&mut drv, 1, Vec::new());
    assert_eq!(used[0].id, u32::from(r.head));
    assert_eq!(status_of(&drv, r), VIRTIO_BLK_S_OK);
}

/// Hostile chains among 32 good requests in one batch: each bad one gets its IOERR, the good
/// ones their data, and the device keeps serving (the hostile suite's rules hold at depth).
#[test]
fn hostile_chains_at_depth() {
    for aio in [AioMode::IoUring, AioMode::Threads] {
        for (name, dma) in dma_matrix(4096).into_iter().take(3) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("disk.raw");
            std::fs::write(&p, pattern(5, DISK as usize)).unwrap();
            let disk = RawDisk::open_with(&p, false, CacheMode::None).unwrap();
            let mut drv = driver(disk, cfg(aio, CacheMode::None), dma, 256);
            let mut good = Vec::new();
            let mut bad = Vec::new();
            for i in 0..32u64 {
                good.push((i, post(&mut drv, VIRTIO_BLK_T_IN, i * 8, &[], 4096, 0)));
                match i % 4 {
                    // Beyond the end of the disk.
                    0 => bad.push(post(&mut drv, VIRTIO_BLK_T_IN, DISK / 512, &[], 4096, 0)),
                    // Not a multiple of 512.
                    1 => bad.push(post(&mut drv, VIRTIO_BLK_T_IN, 0, &[], 700, 0)),
                    // Data buffer outside guest memory.
                    2 => {
                        let outside = Buf::wo(RAM - 512, 4096);
                        bad.push(post_bufs(&mut drv, VIRTIO_BLK_T_IN, 0, Some(outside)));
                    }
                    // Unsupported type.
                    _ => bad.push(post(&mut drv, 0x77, 0, &[], 0, 0)),
                }
            }
            drv.kick(0).unwrap();
            settle(&mut drv, 64, Vec::new());
            for (i, g) in &good {
                assert_eq!(status_of(&drv, *g), VIRTIO_BLK_S_OK, "{aio} {name}");
                let at = usize::try_from(i * 8 * 512).unwrap();
                assert_eq!(
                    drv.ram.read(g.data, 4096),
                    pattern(5, DISK as usize)[at..at + 4096].to_vec()
                );
            }
            for (k, b) in bad.iter().enumerate() {
                let want = if k % 4 == 3 {
                    VIRTIO_BLK_S_UNSUPP
                } else {
                    VIRTIO_BLK_S_IOERR
                };
                assert_eq!(status_of(&drv, *b), want, "{aio} {name}: bad request {k}");
            }
            assert!(drv.broken(0).is_none());
            if let Some(p) = drv.device.dma().pool() {
                assert_eq!(p.used(), 0);
            }
        }
    }
}

/// A device reset with requests in flight waits for their host I/O and releases every slot.
#[test]
fn reset_with_requests_in_flight_releases_the_pool() {
    let (disk, tx) = gated_disk();
    let (mut drv, dma) = small_pool_driver(disk, AioMode::Threads, 1024);
    post(&mut drv, VIRTIO_BLK_T_IN, 0, &[], 4096, 0);
    for i in 1..8 {
        post(&mut drv, VIRTIO_BLK_T_IN, i * 8, &[], 4096, 0);
    }
    drv.kick(0).unwrap();
    assert!(dma.pool().unwrap().used() > 0);
    // Release the held read from another thread once the reset is waiting for it.
    let t = std::thread::spawn(move || tx.send(()).unwrap());
    drv.reset();
    t.join().unwrap();
    assert_eq!(dma.pool().unwrap().used(), 0);
}

/// The bounce options of the competing-devices tests: a 128-slot pool that fails a request
/// it cannot fit, named `shared` when `shared`.
fn competing_opts(shared: bool) -> devices::options::BounceOptions {
    format!(
        "slots=128,areas=1,on-full=fail{}",
        if shared { ",pool=shared" } else { "" }
    )
    .parse()
    .unwrap()
}

/// The case's name, an empty pool registry and the block configuration of the
/// competing-devices tests.
fn competing(shared: bool) -> (&'static str, devices::pools::PoolRegistry, BlockConfig) {
    let name = if shared { "shared" } else { "own pools" };
    let c = BlockConfig {
        on_full: competing_opts(shared).on_full,
        ..cfg(AioMode::Threads, CacheMode::Writeback)
    };
    (name, devices::pools::PoolRegistry::default(), c)
}

/// A memory disk that holds each read of sector 0 until the returned sender lets it through
/// (or is dropped).
fn gated_disk() -> (GateDisk, mpsc::Sender<()>) {
    gate_disk(MemDisk::new(DISK).unwrap())
}

/// Two disks whose bounce options name one pool share its slots: a read one disk holds in
/// flight keeps its slots, so the other disk's read finds the pool full (IOERR under
/// `on-full=fail`); with a pool each, the same read succeeds. Each device counts what it
/// mapped, and over the devices of the shared pool the counts sum to the pool's.
#[test]
fn devices_on_one_shared_pool_compete_for_its_slots() {
    for shared in [true, false] {
        let (name, mut pools, c) = competing(shared);
        let (dma_a, pool_a) = pools.dma("disk-a", &competing_opts(shared), 1).unwrap();
        let (dma_b, pool_b) = pools.dma("disk-b", &competing_opts(shared), 1).unwrap();
        let (pool_a, pool_b) = (pool_a.unwrap(), pool_b.unwrap());
        assert_eq!(Arc::ptr_eq(&pool_a, &pool_b), shared);
        let (gated, tx) = gated_disk();
        let mut a = driver(gated, c.clone(), dma_a, 64);
        let mut b = driver(MemDisk::new(DISK).unwrap(), c, dma_b, 64);
        // Dropped before `a` if an assertion fails: the held read then goes through.
        let tx = tx;
        // A's read of 192 KiB at sector 0 waits in the disk with 96 slots and its status
        // slot mapped: 31 of the 128 slots are left.
        let held = post(&mut a, VIRTIO_BLK_T_IN, 0, &[], 192 << 10, 0);
        a.kick(0).unwrap();
        assert_eq!(status_of(&a, held), STATUS_UNSET, "{name}: completed early");
        // B's read of 96 KiB needs 48 slots.
        let r = one(&mut b, VIRTIO_BLK_T_IN, 8, &[], 96 << 10);
        let sb = stats(&b);
        if shared {
            assert_eq!(status_of(&b, r), VIRTIO_BLK_S_IOERR, "{sb}");
            assert_eq!(sb["metrics"]["pool_full_failed"], 1, "{sb}");
            assert_eq!(sb["dma"]["map_failures"], 1, "{sb}");
            assert_eq!(sb["bounce"], serde_json::json!({"pool": "shared"}));
        } else {
            assert_eq!(status_of(&b, r), VIRTIO_BLK_S_OK, "{sb}");
            assert_eq!(sb["dma"]["map_failures"], 0, "{sb}");
            assert_eq!(sb["bounce"]["maps"], sb["dma"]["maps"], "{sb}");
        }
        tx.send(()).unwrap();
        settle(&mut a, 1, Vec::new());
        assert_eq!(status_of(&a, held), VIRTIO_BLK_S_OK, "{name}");
        // B's read goes through once A's slots are back.
        let again = one(&mut b, VIRTIO_BLK_T_IN, 8, &[], 96 << 10);
        assert_eq!(status_of(&b, again), VIRTIO_BLK_S_OK, "{name}");
        let (da, db) = (stats(&a)["dma"].clone(), stats(&b)["dma"].clone());
        let count = |d: &serde_json::Value, k: &str| d[k].as_u64().unwrap();
        let pool_stats = |p: &Arc<bounce::BouncePool>| serde_json::to_value(p.stats()).unwrap();
        let sums: Vec<(serde_json::Value, u64)> = if shared {
            let listed = pools.pools_json();
            assert_eq!(listed[0]["pool"], "shared");
            assert_eq!(
                listed[0]["devices"],
                serde_json::json!(["disk-a", "disk-b"])
            );
            let k = ["maps", "map_failures", "unmaps"];
            k.iter()
                .map(|k| (listed[0]["stats"][k].clone(), count(&da, k) + count(&db, k)))
                .collect()
        } else {
            assert_eq!(pools.pools_json(), serde_json::json!([]));
            ["maps", "map_failures", "unmaps"]
                .iter()
                .flat_map(|k| {
                    [
                        (pool_stats(&pool_a)[k].clone(), count(&da, k)),
                        (pool_stats(&pool_b)[k].clone(), count(&db, k)),
                    ]
                })
                .collect()
        };
        for (pool, devices) in sums {
            assert_eq!(pool, devices, "{name}: {da} {db}");
        }
        assert!(count(&da, "maps") > 0 && count(&db, "maps") > 0, "{name}");
        assert_eq!(pool_a.used() + pool_b.used(), 0, "{name}");
    }
}

/// Linux's default pool is one pool for every device: a NIC's frames and a disk's reads
/// compete for it. A read held in the disk takes every slot of a shared 128-slot pool, so the
/// NIC's next frame cannot be bounced (dropped and counted, the chain still completed) and sent
/// once the read is done; with a pool each the frame goes out at once. The NIC's and the
/// disk's counts sum to the shared pool's.
#[test]
fn a_nic_and_a_disk_on_one_shared_pool_compete_for_its_slots() {
    use devices::net::{MemBackend, Net, NetBackend, NetConfig, VnetHeader};
    const TXQ: u16 = 1;
    for shared in [true, false] {
        let (name, mut pools, c) = competing(shared);
        let (dma_disk, _) = pools.dma("disk", &competing_opts(shared), 1).unwrap();
        let (dma_nic, _) = pools.dma("nic", &competing_opts(shared), 1).unwrap();
        let (gated, tx) = gated_disk();
        let mut disk = driver(gated, c, dma_disk, 64);
        let be = MemBackend::new().unwrap();
        let boxed: Box<dyn NetBackend> = Box::new(be.clone());
        let nic = Net::new(NetConfig::default(), vec![boxed], dma_nic).expect("net device");
        let mut nic = TestDriver::new(nic, RAM);
        nic.negotiate(u64::MAX);
        nic.activate(64).expect("activate the NIC");
        // Dropped before `disk` if an assertion fails: the held read then goes through.
        let tx = tx;
        // 252 KiB of data (126 slots) and the status byte (1 slot): one slot left, and the
        // NIC's 3000-byte frame needs two.
        let held = post(&mut disk, VIRTIO_BLK_T_IN, 0, &[], 252 << 10, 0);
        disk.kick(0).unwrap();
        assert_eq!(
            status_of(&disk, held),
            STATUS_UNSET,
            "{name}: completed early"
        );
        assert_eq!(
            disk.device.dma().pool().map(|p| p.used()),
            Some(127),
            "{name}"
        );
        let mut frame = VnetHeader::default().to_bytes().to_vec();
        frame.extend((0..3000u32).map(|i| (i * 7) as u8));
        let send = |nic: &mut TestDriver<Net>| {
            let at = nic.ram.alloc_bytes(&frame);
            let len = u32::try_from(frame.len()).unwrap();
            nic.post(TXQ, &[Buf::ro(at, len)])
                .expect("free descriptors");
            nic.kick(TXQ).unwrap();
            assert_eq!(nic.reap(TXQ).len(), 1, "{name}: the TX chain is completed");
        };
        let net = |nic: &TestDriver<Net>| VirtioDevice::<GuestMemoryMmap>::stats(&nic.device);
        send(&mut nic);
        let s = net(&nic);
        if shared {
            assert_eq!(s["net"]["tx_bounce_failures"], 1, "{s}");
            assert_eq!(s["dma"]["map_failures"], 1, "{s}");
            assert!(be.take_sent().is_empty(), "{name}: a frame went out");
        } else {
            assert_eq!(s["net"]["tx_bounce_failures"], 0, "{s}");
            let sent = be.take_sent();
            assert!(
                sent == [frame.clone()],
                "{name}: {} frames, not the one posted",
                sent.len()
            );
        }
        tx.send(()).unwrap();
        settle(&mut disk, 1, Vec::new());
        assert_eq!(status_of(&disk, held), VIRTIO_BLK_S_OK, "{name}");
        // With the read's slots back, the NIC's next frame goes out.
        send(&mut nic);
        assert_eq!(be.take_sent().len(), 1, "{name}");
        let (dd, dn) = (stats(&disk)["dma"].clone(), net(&nic)["dma"].clone());
        let count = |d: &serde_json::Value, k: &str| d[k].as_u64().unwrap();
        if shared {
            let listed = pools.pools_json();
            assert_eq!(listed[0]["devices"], serde_json::json!(["disk", "nic"]));
            for k in ["maps", "map_failures", "unmaps"] {
                assert_eq!(
                    listed[0]["stats"][k].as_u64(),
                    Some(count(&dd, k) + count(&dn, k)),
                    "{k}: {dd} {dn}"
                );
            }
            assert_eq!(listed[0]["stats"]["used"], 0, "{listed}");
        } else {
            assert_eq!(pools.pools_json(), serde_json::json!([]));
        }
        assert!(count(&dd, "maps") > 0 && count(&dn, "maps") > 0, "{name}");
    }
}
