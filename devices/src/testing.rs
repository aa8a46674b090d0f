//! A test harness that drives a device in-process: guest memory, feature negotiation, the
//! driver side of every queue ([`DriverQueue`]), kicks and used-ring reaping.
//!
//! Compiled for this crate's tests and, for other crates and integration tests, with the
//! `test-utils` feature. It plays both the guest driver and the transport: it writes chains
//! with [`crate::virtio::driver`], programs a [`virtio_queue::Queue`] the way virtio-pci or
//! vhost-user would, and calls the device's workers the way the transport's event loop would.
//!
//! # Using it
//! ```no_run
//! # #[cfg(feature = "test-utils")] {
//! use devices::testing::TestDriver;
//! use devices::virtio::driver::Buf;
//! # fn dev() -> devices::block::Block<devices::block::MemDisk> { unimplemented!() }
//! let mut drv = TestDriver::new(dev(), 1 << 24);          // 16 MiB of guest RAM
//! drv.negotiate(u64::MAX);                                // ack everything offered
//! drv.activate(256).unwrap();                             // queues of 256, workers started
//! let hdr = drv.ram.alloc_bytes(&[0u8; 16]);              // buffers come from a bump allocator
//! let data = drv.ram.alloc(4096, 4096);
//! let status = drv.ram.alloc(1, 1);
//! let head = drv
//!     .post(0, &[Buf::ro(hdr, 16), Buf::wo(data, 4096), Buf::wo(status, 1)])
//!     .unwrap();
//! drv.kick(0).unwrap();                                   // runs the worker synchronously
//! let used = drv.reap(0);                                 // [(head, len)]
//! assert_eq!(used[0].id, u32::from(head));
//! # }
//! ```
//!
//! - [`GuestRam`]: guest memory (one region at 0, or several with holes) with a bump
//!   allocator ([`GuestRam::alloc`]) and byte helpers ([`GuestRam::write`],
//!   [`GuestRam::read`]). Addresses at or above [`GuestRam::size`] are outside guest memory.
//!   [`GuestRam::new_queue`] lays out a queue and returns its [`DriverQueue`], which writes
//!   chains (or any raw descriptor, for hostile tests), publishes heads and reads the used
//!   ring; [`device_queue`] programs the device's [`virtio_queue::Queue`] for the same layout.
//! - [`TestDriver`]: a device, its guest RAM, its queues (both the device's
//!   [`virtio_queue::Queue`] and the driver's [`DriverQueue`]) and its workers.
//!   [`TestDriver::negotiate`] acks features, [`TestDriver::activate`] lays out the queues
//!   and calls [`VirtioDevice::activate`], [`TestDriver::post`] / [`TestDriver::post_indirect`]
//!   add and publish chains, [`TestDriver::kick`] runs the owning worker with
//!   [`WorkerEvent::Kick`], [`TestDriver::fd_event`] with [`WorkerEvent::Fd`] (net: tap
//!   readable), [`TestDriver::reap`] returns used entries, and [`TestDriver::signals`] counts
//!   the notifications workers asked for, per queue.
//!
//! Workers run through [`Dispatcher`], the transports' dispatcher, so tests see the worker
//! contract of production (only ready, valid, enabled queues). A worker that breaks is parked
//! ([`TestDriver::broken`]) and not called again, as a transport would set DEVICE_NEEDS_RESET.
//!
//! [`HookedDisk`] builds the disks tests need (holding, counting, failing I/O) around another
//! with a [`DiskHook`]; [`GateDisk`] and [`SocketDisk`] are shared ones.
//!
//! [`durable`] holds the crash-durability checks of block images (raw and qcow2) that the
//! SIGKILL tests of both transports' binaries share.

mod disk;
pub mod durable;

pub use disk::{gate_disk, DiskHook, DiskOp, GateDisk, HookedDisk, ReadGate, SocketDisk};

use std::collections::HashMap;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

use crate::net::header::VnetHeader;
use crate::virtio::dispatch::{Dispatcher, Outcome};
use crate::virtio::driver::{Buf, DriverQueue, Layout, Used};
use crate::virtio::spec::{
    feature, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_RING_F_EVENT_IDX,
    VRING_AVAIL_ALIGN_SIZE, VRING_DESC_ALIGN_SIZE, VRING_USED_ALIGN_SIZE,
};
use crate::virtio::{ActivateError, Signal, VirtioDevice, WorkerError, WorkerEvent};

/// Guest memory with a bump allocator.
#[derive(Debug)]
pub struct GuestRam {
    mem: GuestMemoryMmap,
    size: u64,
    next: u64,
}

impl GuestRam {
    /// One region of `size` bytes at guest address 0. The first page is never allocated (so a
    /// buffer at address 0 is always a deliberate test).
    ///
    /// # Panics
    /// When the memory cannot be mapped (a test setup failure).
    pub fn new(size: u64) -> Self {
        let len = usize::try_from(size).expect("guest RAM size fits usize");
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), len)])
            .expect("cannot map test guest memory");
        Self {
            mem,
            size,
            next: 0x1000,
        }
    }

    /// Guest memory.
    pub fn mem(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// Bytes of guest RAM; every address at or above is outside guest memory.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Allocates `len` bytes aligned to `align` (a power of two).
    ///
    /// # Panics
    /// When guest RAM is exhausted (a test setup failure).
    pub fn alloc(&mut self, len: u64, align: u64) -> u64 {
        let start = self.next.next_multiple_of(align.max(1));
        let end = start.checked_add(len.max(1)).expect("allocation overflows");
        assert!(end <= self.size, "test guest RAM exhausted");
        self.next = end;
        start
    }

    /// Allocates a buffer holding `bytes`.
    pub fn alloc_bytes(&mut self, bytes: &[u8]) -> u64 {
        let a = self.alloc(bytes.len() as u64, 16);
        self.write(a, bytes);
        a
    }

    /// Lays out a queue of `size` (a power of two) in fresh guest RAM, each part with the
    /// alignment the specification asks for, and returns the driver's view of it.
    ///
    /// # Panics
    /// When guest RAM is exhausted or `size` is not a power of two (a test setup failure).
    pub fn new_queue(&mut self, size: u16, event_idx: bool) -> DriverQueue {
        let layout = Layout {
            size,
            desc: self.alloc(Layout::desc_table_bytes(size), VRING_DESC_ALIGN_SIZE.into()),
            avail: self.alloc(
                Layout::avail_ring_bytes(size),
                VRING_AVAIL_ALIGN_SIZE.into(),
            ),
            used: self.alloc(Layout::used_ring_bytes(size), VRING_USED_ALIGN_SIZE.into()),
        };
        DriverQueue::new(layout, event_idx).expect("valid test queue layout")
    }

    /// Writes `bytes` at `addr`.
    ///
    /// # Panics
    /// When the range is outside guest memory.
    pub fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem
            .write_slice(bytes, GuestAddress(addr))
            .expect("test write outside guest memory");
    }

    /// Reads `len` bytes at `addr`.
    ///
    /// # Panics
    /// When the range is outside guest memory.
    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem
            .read_slice(&mut v, GuestAddress(addr))
            .expect("test read outside guest memory");
        v
    }
}

/// A [`Queue`] programmed as a transport would for a queue at `layout`: size, ring
/// addresses, EVENT_IDX per the negotiated features, ready.
///
/// # Panics
/// When the device's maximum is smaller than the queue (a test setup failure).
pub fn device_queue(layout: &Layout, max_size: u16, event_idx: bool) -> Queue {
    let mut q = Queue::new(max_size).expect("valid max queue size");
    q.try_set_size(layout.size)
        .expect("test queue size is a power of two within the device's maximum");
    let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
    let (l, h) = split(layout.desc);
    q.set_desc_table_address(l, h);
    let (l, h) = split(layout.avail);
    q.set_avail_ring_address(l, h);
    let (l, h) = split(layout.used);
    q.set_used_ring_address(l, h);
    q.set_event_idx(event_idx);
    q.set_ready(true);
    q
}

/// A device, its guest RAM, queues and workers, driven synchronously.
pub struct TestDriver<D: VirtioDevice<GuestMemoryMmap>> {
    /// Guest RAM.
    pub ram: GuestRam,
    /// The device.
    pub device: D,
    /// The driver side of each queue.
    pub vqs: Vec<DriverQueue>,
    /// The device side of each queue (what the transport holds).
    pub queues: Vec<Queue>,
    workers: Vec<Dispatcher<GuestMemoryMmap>>,
    /// For each device queue: (worker, position in its `queue_indexes`).
    owner: HashMap<u16, (usize, usize)>,
    acked: u64,
    signals: Vec<u64>,
}

impl<D: VirtioDevice<GuestMemoryMmap>> std::fmt::Debug for TestDriver<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDriver")
            .field("acked", &format_args!("{:#x}", self.acked))
            .field("queues", &self.vqs.len())
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl<D: VirtioDevice<GuestMemoryMmap>> TestDriver<D> {
    /// A driver for `device` with `ram_size` bytes of guest RAM.
    pub fn new(device: D, ram_size: u64) -> Self {
        Self {
            ram: GuestRam::new(ram_size),
            device,
            vqs: Vec::new(),
            queues: Vec::new(),
            workers: Vec::new(),
            owner: HashMap::new(),
            acked: 0,
            signals: Vec::new(),
        }
    }

    /// Acks `wanted & offered` and returns it.
    pub fn negotiate(&mut self, wanted: u64) -> u64 {
        self.acked = wanted & self.device.avail_features();
        self.acked
    }

    /// The acked features.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Lays out all the device's queues with `queue_size` entries and activates the device.
    ///
    /// # Errors
    /// The device's activation error.
    pub fn activate(&mut self, queue_size: u16) -> Result<(), ActivateError> {
        let n = self.device.num_queues();
        let max = self.device.queue_max_size();
        let event_idx = self.acked & feature(VIRTIO_RING_F_EVENT_IDX) != 0;
        self.vqs = (0..n)
            .map(|_| self.ram.new_queue(queue_size, event_idx))
            .collect();
        self.queues = self
            .vqs
            .iter()
            .map(|v| device_queue(&v.layout(), max, event_idx))
            .collect();
        for q in &self.queues {
            assert!(q.is_valid(self.ram.mem()), "test queue layout is invalid");
        }
        self.signals = vec![0; n];
        self.workers = self
            .device
            .activate(self.acked)?
            .into_iter()
            .map(Dispatcher::new)
            .collect();
        self.owner.clear();
        let groups = self.device.queue_groups();
        for (w, worker) in self.workers.iter().enumerate() {
            let qs = worker.queue_indexes();
            assert!(
                groups.iter().any(|g| qs.iter().all(|q| g.contains(q))),
                "worker {w} serves queues {qs:?} across the declared groups {groups:?}"
            );
            for (pos, &qi) in qs.iter().enumerate() {
                self.owner.insert(qi, (w, pos));
            }
        }
        Ok(())
    }

    /// Drops the workers and resets the device.
    pub fn reset(&mut self) {
        self.workers.clear();
        self.owner.clear();
        self.device.reset();
    }

    /// Number of workers the device returned.
    pub fn num_workers(&self) -> usize {
        self.workers.len()
    }

    /// The queue indexes of worker `w`.
    pub fn worker_queues(&self, w: usize) -> Vec<u16> {
        self.workers[w].queue_indexes().to_vec()
    }

    /// Worker `w`'s extra file descriptors.
    pub fn worker_fds(&self, w: usize) -> Vec<(std::os::fd::RawFd, u32)> {
        self.workers[w].extra_fds()
    }

    /// The error a worker stopped with, if it did.
    pub fn broken(&self, w: usize) -> Option<&str> {
        self.workers.get(w).and_then(Dispatcher::broken)
    }

    /// The worker owning device queue `q`, if any (queues beyond the active ones have none).
    pub fn owner(&self, q: u16) -> Option<usize> {
        self.owner.get(&q).map(|&(w, _)| w)
    }

    /// Notifications the workers asked for on queue `q` so far.
    pub fn signals(&self, q: u16) -> u64 {
        self.signals.get(usize::from(q)).copied().unwrap_or(0)
    }

    /// Adds and publishes a direct chain on queue `q`; returns its head, `None` when `bufs` is
    /// empty or the queue has too few free descriptors.
    ///
    /// # Panics
    /// When a ring is outside guest memory (a test setup failure).
    pub fn post(&mut self, q: u16, bufs: &[Buf]) -> Option<u16> {
        let vq = &mut self.vqs[usize::from(q)];
        if bufs.is_empty() || vq.free_descs() < bufs.len() {
            return None;
        }
        let head = vq.add_chain(self.ram.mem(), bufs).expect("test chain");
        self.publish_raw(q, head);
        Some(head)
    }

    /// Adds and publishes an indirect chain on queue `q` (its table in fresh guest RAM);
    /// `None` when `bufs` is empty or the queue has no free descriptor.
    ///
    /// # Panics
    /// As [`TestDriver::post`].
    pub fn post_indirect(&mut self, q: u16, bufs: &[Buf]) -> Option<u16> {
        if bufs.is_empty() {
            return None;
        }
        let table = self.ram.alloc(16 * bufs.len() as u64, 16);
        let vq = &mut self.vqs[usize::from(q)];
        if vq.free_descs() == 0 {
            return None;
        }
        let head = vq
            .add_indirect(self.ram.mem(), table, bufs)
            .expect("test chain");
        self.publish_raw(q, head);
        Some(head)
    }

    /// Puts `head` on queue `q`'s available ring and publishes it: for chains the test wrote
    /// itself with [`DriverQueue::write_desc`].
    ///
    /// # Panics
    /// When the ring is outside guest memory (a test setup failure).
    pub fn publish_raw(&mut self, q: u16, head: u16) {
        let vq = &mut self.vqs[usize::from(q)];
        vq.push(self.ram.mem(), head)
            .expect("avail ring in guest memory");
        vq.publish(self.ram.mem())
            .expect("avail ring in guest memory");
    }

    /// Runs worker `w` through the transports' [`Dispatcher`], so tests run under the
    /// production worker contract.
    fn run(&mut self, w: usize, event: WorkerEvent) -> Result<Signal, WorkerError> {
        let Some(worker) = self.workers.get_mut(w) else {
            return Err(WorkerError::UnexpectedEvent(event));
        };
        let idxs = worker.queue_indexes().to_vec();
        let mut lent: Vec<Option<&mut Queue>> = self.queues.iter_mut().map(Some).collect();
        let mut qs: Vec<&mut Queue> = Vec::with_capacity(idxs.len());
        for &qi in &idxs {
            match lent.get_mut(usize::from(qi)).and_then(Option::take) {
                Some(q) => qs.push(q),
                None => {
                    return Err(WorkerError::Broken(format!(
                        "worker {w} names queue {qi} twice or out of range"
                    )))
                }
            }
        }
        match worker.dispatch(event, self.ram.mem(), &mut qs, true) {
            Outcome::Served(sig) => {
                for (pos, &qi) in idxs.iter().enumerate() {
                    if sig.has(pos) {
                        if let Some(c) = self.signals.get_mut(usize::from(qi)) {
                            *c += 1;
                        }
                    }
                }
                Ok(sig)
            }
            Outcome::NotReady => Ok(Signal::NONE),
            Outcome::Parked => Err(WorkerError::Broken(format!(
                "already broken: {}",
                worker.broken().unwrap_or_default()
            ))),
            Outcome::Broken(why) => Err(WorkerError::Broken(why)),
            Outcome::Refused(ev) => Err(WorkerError::UnexpectedEvent(ev)),
        }
    }

    /// Kicks device queue `q`: runs its worker with [`WorkerEvent::Kick`]. A kick of a queue
    /// no worker owns returns `Ok(Signal::NONE)`, as a transport would ignore it.
    ///
    /// # Errors
    /// The worker's error.
    pub fn kick(&mut self, q: u16) -> Result<Signal, WorkerError> {
        match self.owner.get(&q).copied() {
            Some((w, pos)) => self.run(w, WorkerEvent::Kick(pos)),
            None => Ok(Signal::NONE),
        }
    }

    /// Tells worker `w` that its fd with `token` is readable.
    ///
    /// # Errors
    /// The worker's error.
    pub fn fd_event(&mut self, w: usize, token: u32) -> Result<Signal, WorkerError> {
        self.run(w, WorkerEvent::Fd(token))
    }

    /// New used entries of queue `q`; their descriptors are free again.
    ///
    /// # Panics
    /// When the used ring is outside guest memory or its index runs away.
    pub fn reap(&mut self, q: u16) -> Vec<Used> {
        let vq = &mut self.vqs[usize::from(q)];
        let mut out = Vec::new();
        while let Some(u) = vq.next_used(self.ram.mem()).expect("used ring") {
            out.push(u);
        }
        out
    }

    /// Reaps queue `q` until `n` used entries arrived, running its worker on each of the
    /// worker's own fds that becomes readable (an I/O engine's completions, timers), as a
    /// transport's event loop would. Waits at most `timeout` in all (a hung device fails the
    /// test instead of hanging it). Returns the entries reaped, possibly more than `n`.
    ///
    /// # Panics
    /// When `timeout` passes first, or the worker fails.
    pub fn wait_used(&mut self, q: u16, n: usize, timeout: std::time::Duration) -> Vec<Used> {
        let deadline = std::time::Instant::now() + timeout;
        let mut used = self.reap(q);
        let Some((w, _)) = self.owner.get(&q).copied() else {
            return used;
        };
        while used.len() < n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(
                !left.is_zero(),
                "queue {q}: {} of {n} completions",
                used.len()
            );
            let ms = libc::c_int::try_from(left.as_millis().min(1000)).unwrap_or(1000);
            if let Err(e) = self.poll_worker(w, ms) {
                panic!("worker {w}: {e}");
            }
            used.extend(self.reap(q));
        }
        used
    }

    /// Waits up to `timeout_ms` for worker `w`'s own fds (an I/O engine's completions,
    /// timers) and runs the worker on each that became readable, as a transport's event loop
    /// would. Returns how many did.
    ///
    /// # Errors
    /// The worker's error for one of the events.
    ///
    /// # Panics
    /// When `poll` itself fails.
    pub fn poll_worker(&mut self, w: usize, timeout_ms: libc::c_int) -> Result<usize, WorkerError> {
        let fds = self.worker_fds(w);
        // pollfd setup as in the vhost server's poll (server.rs); a test driver's own copy.
        let mut p: Vec<libc::pollfd> = fds
            .iter()
            .map(|&(fd, _)| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `p` is a valid, exclusively borrowed array of `p.len()` pollfds.
        let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
        assert!(r >= 0, "poll: {}", std::io::Error::last_os_error());
        let mut fired = 0;
        for (i, pfd) in p.iter().enumerate() {
            if pfd.revents & libc::POLLIN != 0 {
                fired += 1;
                self.fd_event(w, fds[i].1)?;
            }
        }
        Ok(fired)
    }

    /// Reads `len` bytes of configuration space at `offset`.
    pub fn read_config(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.device.read_config(offset, &mut v);
        v
    }

    /// True when guest address `a` is inside guest RAM.
    pub fn in_ram(&self, a: u64) -> bool {
        GuestAddress(a).raw_value() < self.ram.size()
    }
}

/// A deliberately simple slot allocator for tests: one mutex, a linear first-fit scan that
/// honours every placement rule ([`bounce::SlotRequest::fits`]). It lets bounced device tests
/// run whatever state the real allocators are in, and is a reference for them.
#[derive(Debug)]
pub struct FirstFitAllocator {
    geom: bounce::Geometry,
    used: std::sync::Mutex<Vec<bool>>,
    fail: bool,
}

impl FirstFitAllocator {
    /// An allocator for `geom`, all slots free.
    pub fn new(geom: bounce::Geometry) -> Self {
        Self {
            used: std::sync::Mutex::new(vec![false; geom.nslabs]),
            geom,
            fail: false,
        }
    }

    /// An allocator that refuses every request, as a pool that is always full ("bounce
    /// buffer is full"), to test how devices survive it.
    pub fn always_full(geom: bounce::Geometry) -> Self {
        Self {
            fail: true,
            ..Self::new(geom)
        }
    }
}

impl bounce::SlotAllocator for FirstFitAllocator {
    fn kind(&self) -> bounce::AllocatorKind {
        // There is no kind for a test allocator; it behaves as one global lock.
        bounce::AllocatorKind::Legacy
    }

    fn alloc(&self, req: &bounce::SlotRequest) -> Option<usize> {
        if self.fail {
            return None;
        }
        let mut used = crate::metrics::lock(&self.used);
        let n = req.nslots;
        let found = (0..self.geom.nslabs)
            .find(|&i| req.fits(&self.geom, i) && used[i..i + n].iter().all(|u| !u))?;
        used[found..found + n].iter_mut().for_each(|u| *u = true);
        Some(found)
    }

    fn free(&self, index: usize, nslots: usize, _worker: usize) {
        let mut used = crate::metrics::lock(&self.used);
        if let Some(run) = used.get_mut(index..index.saturating_add(nslots)) {
            run.iter_mut().for_each(|u| *u = false);
        }
    }

    fn area_used(&self) -> Vec<usize> {
        let used = crate::metrics::lock(&self.used);
        vec![used.iter().filter(|u| **u).count()]
    }

    fn lock_stats(&self) -> Vec<bounce::alloc::LockSnapshot> {
        Vec::new()
    }

    fn reset_lock_stats(&self) {}
}

/// A bounce pool built from `config`, with [`FirstFitAllocator`] instead of
/// `config.allocator`.
///
/// # Panics
/// When the configuration is invalid (a test setup failure).
pub fn first_fit_pool(config: &bounce::PoolConfig) -> std::sync::Arc<bounce::BouncePool> {
    let geom = config.geometry().expect("valid test pool configuration");
    let alloc = std::sync::Arc::new(FirstFitAllocator::new(geom));
    std::sync::Arc::new(
        bounce::BouncePool::with_allocator(geom, alloc, config.copy_on_map)
            .expect("test pool memory"),
    )
}

/// DMA handles to run a device test under: `off`, forced swiotlb and forced iova with the
/// test allocator, then forced swiotlb and iova with every real allocator
/// (`2 + 2 * AllocatorKind::ALL.len()` bounced configurations). `slots` sizes each pool.
///
/// # Panics
/// When a pool cannot be built: an allocator that stops building for a mode must fail the
/// tests that run under this matrix, never drop out of it.
pub fn dma_matrix(slots: usize) -> Vec<(String, bounce::Dma)> {
    use bounce::{AllocatorKind, BouncePool, Dma, Policy, PoolConfig};
    let mut out = vec![("off".to_string(), Dma::direct())];
    let configs = [
        ("swiotlb", PoolConfig::swiotlb(slots)),
        ("iova", PoolConfig::iova(slots)),
    ];
    for (mode, cfg) in &configs {
        out.push((
            format!("force/{mode}/first-fit"),
            Dma::bounced(Policy::Force, first_fit_pool(cfg)),
        ));
    }
    for (mode, cfg) in &configs {
        for kind in AllocatorKind::ALL {
            let mut c = cfg.clone();
            c.allocator = kind;
            let pool = BouncePool::new(&c)
                .unwrap_or_else(|e| panic!("bounce configuration force/{mode}/{kind}: {e}"));
            out.push((
                format!("force/{mode}/{kind}"),
                Dma::bounced(Policy::Force, std::sync::Arc::new(pool)),
            ));
        }
    }
    out
}

/// The DMA handles a net test runs under: `off`, then forced `force/swiotlb` and
/// `force/iova` pools of `slots` for `workers` workers, each with its mode's allocator.
///
/// # Panics
/// When a pool cannot be built (a test setup failure).
pub fn forced_dmas(slots: usize, workers: usize) -> Vec<(&'static str, bounce::Dma)> {
    use bounce::{BouncePool, Dma, Policy, PoolConfig};
    let mut out = vec![("off", Dma::direct())];
    for (name, mut cfg) in [
        ("force/swiotlb", PoolConfig::swiotlb(slots)),
        ("force/iova", PoolConfig::iova(slots)),
    ] {
        cfg.workers = workers;
        let pool = BouncePool::new(&cfg).unwrap_or_else(|e| panic!("{name} pool: {e}"));
        out.push((name, Dma::bounced(Policy::Force, std::sync::Arc::new(pool))));
    }
    out
}

/// A TCP over IPv4 segmentation header as Linux sends it for a large frame (Ethernet, IPv4 and
/// TCP headers of 54 bytes, MSS 1448, the TCP checksum left to the device).
pub fn tso4_header() -> VnetHeader {
    VnetHeader {
        flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
        gso_type: VIRTIO_NET_HDR_GSO_TCPV4,
        hdr_len: 54,
        gso_size: 1448,
        csum_start: 34,
        csum_offset: 16,
        num_buffers: 0,
    }
}
