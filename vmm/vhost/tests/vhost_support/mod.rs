//! Test helpers: a small echo device and a vhost-user frontend driving split virtqueues with
//! [`devices::virtio::driver`].
#![allow(dead_code, clippy::undocumented_unsafe_blocks)]

pub mod child;
pub mod inproc;
pub mod net;
pub mod qsd;

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bouncevm_vhost::Memory;
use devices::block::request::RequestHeader;
use devices::block::STATUS_UNSET;
use devices::virtio::driver::{Buf, DriverQueue, Layout};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX,
};
use devices::virtio::{
    read_config_window, ActivateError, Handled, QueueWorker, Queues, Signal, VirtioDevice,
    WorkerError, WorkerEvent,
};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::eventfd::EventFd;

/// Device type used by the echo device (not a real virtio type).
pub const ECHO_TYPE: u32 = 0xe0;
/// Token of the echo worker's own eventfd.
pub const EXTRA_TOKEN: u32 = 7;
/// The echo device's configuration space.
pub const CONFIG: &[u8; 8] = b"ECHOCONF";

/// Counters shared between a test and its echo device.
#[derive(Debug, Default)]
pub struct EchoCounters {
    pub activations: AtomicU64,
    pub resets: AtomicU64,
    pub chains: AtomicU64,
    pub extra_events: AtomicU64,
    pub config_writes: AtomicU64,
    pub acked: AtomicU64,
}

/// A device with `queues` queues; every chain's readable bytes are copied into its writable
/// buffers. One worker serves all queues (so the layout puts them on one thread).
#[derive(Debug)]
pub struct EchoDevice {
    pub queues: usize,
    pub counters: Arc<EchoCounters>,
    /// The worker's extra fd (a test writes to it to wake the worker).
    pub extra: Arc<EventFd>,
    pub active: bool,
}

impl EchoDevice {
    pub fn new(queues: usize) -> Self {
        Self {
            queues,
            counters: Arc::default(),
            extra: Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
            active: false,
        }
    }
}

impl VirtioDevice<Memory> for EchoDevice {
    fn device_type(&self) -> u32 {
        ECHO_TYPE
    }
    fn num_queues(&self) -> usize {
        self.queues
    }
    fn queue_max_size(&self) -> u16 {
        256
    }
    fn queue_groups(&self) -> Vec<Vec<u16>> {
        // One worker serves every queue.
        vec![(0..self.queues as u16).collect()]
    }
    fn avail_features(&self) -> u64 {
        feature(VIRTIO_F_VERSION_1)
            | feature(VIRTIO_RING_F_EVENT_IDX)
            | feature(VIRTIO_F_ACCESS_PLATFORM)
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_window(CONFIG, offset, data);
    }
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        self.counters.config_writes.fetch_add(1, Ordering::Relaxed);
    }
    fn activate(
        &mut self,
        acked_features: u64,
    ) -> Result<Vec<Box<dyn QueueWorker<Memory>>>, ActivateError> {
        if self.active {
            return Err(ActivateError::AlreadyActive);
        }
        self.active = true;
        self.counters.activations.fetch_add(1, Ordering::Relaxed);
        self.counters.acked.store(acked_features, Ordering::Relaxed);
        Ok(vec![Box::new(EchoWorker {
            queues: (0..self.queues as u16).collect(),
            counters: self.counters.clone(),
            extra: self.extra.clone(),
        })])
    }
    fn reset(&mut self) {
        self.active = false;
        self.counters.resets.fetch_add(1, Ordering::Relaxed);
    }
    fn stats(&self) -> serde_json::Value {
        serde_json::json!({ "chains": self.counters.chains.load(Ordering::Relaxed) })
    }
}

struct EchoWorker {
    queues: Vec<u16>,
    counters: Arc<EchoCounters>,
    extra: Arc<EventFd>,
}

impl EchoWorker {
    fn drain(&self, mem: &Memory, q: &mut Queue) -> Result<bool, WorkerError> {
        let broken = |e: virtio_queue::Error| WorkerError::Broken(e.to_string());
        let mut used = false;
        loop {
            q.disable_notification(mem).map_err(broken)?;
            while let Some(chain) = q.pop_descriptor_chain(mem) {
                let head = chain.head_index();
                let mut data = Vec::new();
                let mut written = 0u32;
                for d in chain {
                    if d.is_write_only() {
                        let n = (d.len() as usize).min(data.len() - written as usize);
                        let from = written as usize;
                        mem.write_slice(&data[from..from + n], d.addr())
                            .map_err(|e| WorkerError::Broken(e.to_string()))?;
                        written += n as u32;
                    } else {
                        let mut buf = vec![0u8; d.len() as usize];
                        mem.read_slice(&mut buf, d.addr())
                            .map_err(|e| WorkerError::Broken(e.to_string()))?;
                        data.extend_from_slice(&buf);
                    }
                }
                q.add_used(mem, head, written).map_err(broken)?;
                self.counters.chains.fetch_add(1, Ordering::Relaxed);
                used = true;
            }
            if !q.enable_notification(mem).map_err(broken)? {
                break;
            }
        }
        Ok(used && q.needs_notification(mem).map_err(broken)?)
    }
}

impl QueueWorker<Memory> for EchoWorker {
    fn queue_indexes(&self) -> Vec<u16> {
        self.queues.clone()
    }
    fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        vec![(self.extra.as_raw_fd(), EXTRA_TOKEN)]
    }
    fn handle(&mut self, event: WorkerEvent, mem: &Memory, queues: Queues<'_, '_>) -> Handled {
        let mut signal = Signal::NONE;
        match event {
            WorkerEvent::Kick(i) => {
                let q = queues
                    .get_mut(i)
                    .ok_or(WorkerError::UnexpectedEvent(event))?;
                if self.drain(mem, q)? {
                    signal.add(i);
                }
            }
            WorkerEvent::Fd(EXTRA_TOKEN) => {
                let _ = self.extra.read();
                self.counters.extra_events.fetch_add(1, Ordering::Relaxed);
                // Signal queue 0 so the test can see the event was handled.
                signal.add(0);
            }
            WorkerEvent::Fd(_) => return Err(WorkerError::UnexpectedEvent(event)),
        }
        Ok(signal)
    }
}

/// Guest memory layout of the test driver (one queue per 0x10000 block).
pub const MEM_SIZE: usize = 4 << 20;
pub const QSIZE: u16 = 16;

/// Where queue `q`'s rings are: its 0x10000 block, each part on a page of its own.
fn layout(q: usize) -> Layout {
    Layout::packed(q as u64 * 0x10000, QSIZE, 0x1000)
}
/// Data buffers of queue `q`.
pub fn data_addr(q: usize) -> u64 {
    0x20_0000 + (q as u64) * 0x10000
}

/// A vhost-user frontend with shared guest memory and split rings, as QEMU would drive it.
pub struct Driver {
    pub frontend: Frontend,
    /// A clone of the frontend's socket, for messages the `vhost` frontend refuses to send
    /// (QEMU's early SET_VRING_ENABLE).
    pub raw: UnixStream,
    pub mem: GuestMemoryMmap,
    pub kicks: Vec<EventFd>,
    pub calls: Vec<EventFd>,
    /// Vring error eventfds (SET_VRING_ERR), one per queue.
    pub errs: Vec<EventFd>,
    /// The driver side of each queue.
    vqs: Vec<DriverQueue>,
}

/// A memfd of `size` bytes (guest memory a front end shares).
pub fn memfd(size: usize) -> File {
    let name = std::ffi::CString::new("vhost-test").unwrap();
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size as u64).unwrap();
    f
}

impl Driver {
    /// Connects to `path` (retrying while the server starts).
    pub fn connect(path: &Path, queues: usize) -> Self {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("connecting to {}: {e}", path.display()),
            }
        };
        Self::from_stream(stream, queues)
    }

    /// A new connection to `path` for the same guest (memory, rings, notifiers), as QEMU's
    /// `reconnect=` makes after its back end went away; nothing is negotiated yet.
    pub fn reconnect(&mut self, path: &Path) {
        let fresh = Self::connect(path, self.vqs.len());
        self.frontend = fresh.frontend;
        self.raw = fresh.raw;
    }

    pub fn from_stream(stream: UnixStream, queues: usize) -> Self {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let raw = stream.try_clone().unwrap();
        let frontend = Frontend::from_stream(stream, queues as u64);
        let mem = GuestMemoryMmap::from_ranges_with_files(&[(
            GuestAddress(0),
            MEM_SIZE,
            Some(FileOffset::new(memfd(MEM_SIZE), 0)),
        )])
        .unwrap();
        Self {
            frontend,
            raw,
            mem,
            kicks: (0..queues).map(|_| EventFd::new(0).unwrap()).collect(),
            calls: (0..queues)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                .collect(),
            errs: (0..queues)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                .collect(),
            vqs: (0..queues).map(Self::fresh_queue).collect(),
        }
    }

    /// The driver's view of queue `q` with nothing posted (EVENT_IDX fields are written
    /// whether or not it was negotiated).
    fn fresh_queue(q: usize) -> DriverQueue {
        DriverQueue::new(layout(q), true).unwrap()
    }

    /// Sends SET_VRING_ENABLE on the raw socket, whatever was negotiated (QEMU 7.2's order).
    pub fn raw_vring_enable(&mut self, index: u32, enable: bool) {
        let mut msg = Vec::new();
        for w in [18u32, 0x1, 8, index, u32::from(enable)] {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        self.raw.write_all(&msg).unwrap();
    }

    /// SET_OWNER, GET_FEATURES, protocol features; returns the backend's virtio features.
    pub fn handshake(&mut self) -> vhost::Result<u64> {
        self.handshake_with(VhostUserProtocolFeatures::empty())
    }

    /// As [`Driver::handshake`], also acknowledging `extra` protocol features if offered.
    pub fn handshake_with(&mut self, extra: VhostUserProtocolFeatures) -> vhost::Result<u64> {
        self.frontend.set_owner()?;
        let features = self.frontend.get_features()?;
        let proto = self.frontend.get_protocol_features()?;
        self.frontend.set_protocol_features(
            proto
                & (VhostUserProtocolFeatures::CONFIG
                    | VhostUserProtocolFeatures::REPLY_ACK
                    | VhostUserProtocolFeatures::MQ
                    | extra),
        )?;
        Ok(features)
    }

    /// [`Driver::handshake_with`] `extra`, then SET_FEATURES with what the backend offers of
    /// `wanted`.
    pub fn negotiate(
        &mut self,
        extra: VhostUserProtocolFeatures,
        wanted: u64,
    ) -> vhost::Result<()> {
        let offered = self.handshake_with(extra)?;
        self.set_features(offered & wanted)
    }

    /// Sends one request on the raw socket and, when `reply` is set, reads its reply (for
    /// requests the `vhost` frontend does not send: GET_STATUS, out-of-range indexes, QEMU's
    /// early enables with NEED_REPLY).
    pub fn raw_request(
        &mut self,
        request: u32,
        flags: u32,
        body: &[u8],
        reply: bool,
    ) -> Option<bouncevm_vhost::relay::Message> {
        let msg = bouncevm_vhost::relay::Message::new(request, flags, body.to_vec());
        bouncevm_vhost::relay::send_message(&self.raw, &msg).unwrap();
        if !reply {
            return None;
        }
        let r = bouncevm_vhost::relay::recv_message(&self.raw)
            .expect("reply")
            .expect("the backend closed the connection instead of replying");
        assert_eq!(r.request, request, "reply to another request");
        Some(r)
    }

    /// GET_STATUS (needs VHOST_USER_PROTOCOL_F_STATUS).
    pub fn get_status(&mut self) -> u8 {
        let r = self.raw_request(40, 0x1, &[], true).unwrap();
        let v = u64::from_le_bytes(r.body[..8].try_into().unwrap());
        u8::try_from(v).unwrap()
    }

    /// SET_FEATURES with `features | PROTOCOL_FEATURES`.
    pub fn set_features(&mut self, features: u64) -> vhost::Result<()> {
        self.frontend
            .set_features(features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())
    }

    /// SET_MEM_TABLE with the driver's one region.
    pub fn set_mem_table(&mut self) -> vhost::Result<()> {
        let region = self.mem.find_region(GuestAddress(0)).unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(region)?;
        self.frontend.set_mem_table(&[info]).map(drop)
    }

    /// SET_MEM_TABLE and the rings of queues `0..n` (num, base, addr, kick, call, err).
    pub fn setup_rings(&mut self, n: usize) -> vhost::Result<()> {
        self.set_mem_table()?;
        (0..n).try_for_each(|q| self.configure_default_ring(q))
    }

    /// SET_VRING_NUM/BASE/ADDR/KICK/CALL/ERR of queue `q` with its rings at the given guest
    /// addresses (inside the one region; the rings themselves may reach past its end).
    pub fn configure_ring(
        &mut self,
        q: usize,
        desc: u64,
        avail: u64,
        used: u64,
    ) -> vhost::Result<()> {
        self.configure_ring_from(q, desc, avail, used, 0)
    }

    /// [`Driver::configure_ring`] starting at ring position `position` (SET_VRING_BASE before
    /// the kick fd, as QEMU sends it).
    pub fn configure_ring_from(
        &mut self,
        q: usize,
        desc: u64,
        avail: u64,
        used: u64,
        position: u16,
    ) -> vhost::Result<()> {
        // Host addresses as the frontend sees them: the region's mapping plus the offset
        // (plain arithmetic: a ring may reach past the region's end on purpose).
        let region = self.mem.find_region(GuestAddress(0)).unwrap();
        let base = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .unwrap() as u64;
        let size = self.vqs[q].layout().size;
        self.frontend.set_vring_num(q, size)?;
        self.frontend.set_vring_base(q, position)?;
        self.frontend.set_vring_addr(
            q,
            &VringConfigData {
                queue_max_size: size,
                queue_size: size,
                flags: 0,
                desc_table_addr: base + desc,
                used_ring_addr: base + used,
                avail_ring_addr: base + avail,
                log_addr: None,
            },
        )?;
        self.frontend.set_vring_kick(q, &self.kicks[q])?;
        self.frontend.set_vring_call(q, &self.calls[q])?;
        self.frontend.set_vring_err(q, &self.errs[q])
    }

    /// Restarts queue `q` after a stop (GET_VRING_BASE) at ring position `base`, with its
    /// rings where they were and their contents kept (what QEMU does on `cont`).
    pub fn resume_ring(&mut self, q: usize, base: u16) -> vhost::Result<()> {
        let l = self.vqs[q].layout();
        self.configure_ring(q, l.desc, l.avail, l.used)?;
        self.frontend.set_vring_base(q, base)
    }

    /// Starts queue `q` again at ring position `base`, its rings where they were and their
    /// contents kept, the way QEMU starts it on a new connection (base before kick).
    pub fn restart_ring(&mut self, q: usize, base: u16) -> vhost::Result<()> {
        let l = self.vqs[q].layout();
        self.configure_ring_from(q, l.desc, l.avail, l.used, base)
    }

    /// The used ring's index of queue `q` as the device last wrote it.
    pub fn used_idx(&self, q: usize) -> u16 {
        self.vqs[q].used_idx(&self.mem).unwrap()
    }

    /// Waits up to `timeout` for the error eventfd of queue `q`.
    pub fn wait_err(&self, q: usize, timeout: Duration) -> bool {
        wait_fd(self.errs[q].as_raw_fd(), timeout) && self.errs[q].read().is_ok()
    }

    /// Posts a chain (one readable buffer with `data`, one writable of `out_len`) on queue
    /// `q` and kicks it. Returns the head index.
    pub fn post(&mut self, q: usize, data: &[u8], out_len: u32) -> u16 {
        let slot = self.vqs[q].avail_idx() % QSIZE;
        let head = (slot * 2) % QSIZE;
        let inbuf = data_addr(q) + u64::from(head) * 0x800;
        let outbuf = inbuf + 0x400;
        self.mem.write_slice(data, GuestAddress(inbuf)).unwrap();
        let bufs = [Buf::ro(inbuf, data.len() as u32), Buf::wo(outbuf, out_len)];
        self.vqs[q].write_chain(&self.mem, head, &bufs).unwrap();
        self.publish(q, head);
        head
    }

    /// Posts one chain made of descriptors `first..first + bufs.len()` of queue `q` (each
    /// `(guest address, length, device-writable)`), publishes it and kicks. Returns the head.
    pub fn post_descs(&mut self, q: usize, first: u16, bufs: &[(u64, u32, bool)]) -> u16 {
        let n = u16::try_from(bufs.len()).unwrap();
        assert!(
            n > 0 && first + n <= self.vqs[q].layout().size,
            "descriptors {first}+{n} out of the table"
        );
        let bufs: Vec<Buf> = bufs
            .iter()
            .map(|&(addr, len, writable)| Buf {
                addr,
                len,
                writable,
            })
            .collect();
        self.vqs[q].write_chain(&self.mem, first, &bufs).unwrap();
        self.publish(q, first);
        first
    }

    /// Adds `head` to the avail ring of queue `q`, asks for an interrupt at the next used
    /// entry (`used_event`) and kicks, whether or not the device asked for one.
    fn publish(&mut self, q: usize, head: u16) {
        let vq = &mut self.vqs[q];
        vq.push(&self.mem, head).unwrap();
        vq.set_used_event(&self.mem, vq.last_used()).unwrap();
        vq.publish(&self.mem).unwrap();
        self.kicks[q].write(1).unwrap();
    }

    /// Waits up to `timeout` for the call eventfd of queue `q`.
    pub fn wait_call(&self, q: usize, timeout: Duration) -> bool {
        if wait_fd(self.calls[q].as_raw_fd(), timeout) {
            let _ = self.calls[q].read();
            true
        } else {
            false
        }
    }

    /// The next used element of queue `q` (id, len), if the device has produced one.
    pub fn next_used(&mut self, q: usize) -> Option<(u32, u32)> {
        let u = self.vqs[q].next_used(&self.mem).unwrap()?;
        Some((u.id, u.len))
    }

    /// Reads what the device wrote for the chain with head `head` on queue `q`.
    pub fn output(&self, q: usize, head: u16, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        let outbuf = data_addr(q) + u64::from(head) * 0x800 + 0x400;
        self.mem.read_slice(&mut buf, GuestAddress(outbuf)).unwrap();
        buf
    }

    /// Posts `data` on queue `q` and waits for its echo; returns the echoed bytes.
    pub fn echo(&mut self, q: usize, data: &[u8]) -> Option<Vec<u8>> {
        let head = self.post(q, data, 256);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some((id, len)) = self.next_used(q) {
                assert_eq!(id, u32::from(head));
                return Some(self.output(q, head, len as usize));
            }
            self.wait_call(q, Duration::from_millis(100));
        }
        None
    }
}

/// Polls `fd` for input for up to `timeout`.
pub fn wait_fd(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n == 1
}

/// Polls `fd` without waiting: its `revents` (POLLIN, POLLHUP, ...).
pub fn poll_now(fd: RawFd) -> i16 {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n == 1 {
        p.revents
    } else {
        0
    }
}

/// Waits for the first used entry of queue `q` (the back end has taken what was posted at
/// depth and is busy with the rest).
pub fn first_completion(d: &Driver, q: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.used_idx(q) == 0 {
        assert!(Instant::now() < deadline, "no request completed");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Features a test front end acknowledges when offered.
pub const WANTED: u64 = feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX);

/// Connects to `sock` for a device of `queues` queues and negotiates (REPLY_ACK, STATUS,
/// CONFIGURE_MEM_SLOTS) up to SET_FEATURES.
pub fn negotiated_on(sock: &Path, queues: usize) -> Driver {
    let mut d = Driver::connect(sock, queues);
    d.negotiate(
        VhostUserProtocolFeatures::STATUS | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS,
        WANTED,
    )
    .unwrap();
    d
}

/// Starts queue 0 with its avail ring in the last 4 bytes of guest memory, publishes a
/// request and kicks: the worker is broken, and the error fd signalled.
pub fn break_queue_0(d: &mut Driver) {
    let end = MEM_SIZE as u64;
    d.configure_ring(0, 0, end - 4, 0x2000).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    d.mem.write_obj(1u16, GuestAddress(end - 2)).unwrap();
    d.kicks[0].write(1).unwrap();
}

/// Guest memory used by block requests (above the rings and the echo buffers): 16-byte headers, status bytes, 4 KiB data buffers.
pub const BLK_HDRS: u64 = 0x30_0000;
pub const BLK_STATUS: u64 = 0x30_8000;
pub const BLK_DATA: u64 = 0x31_0000;
/// Requests per batch: 3 descriptors each in a 16-entry table.
pub const BATCH: u16 = 5;

/// The 4 KiB written at `sector` in generation `generation`.
pub fn block_pattern(sector: u64, generation: u8) -> Vec<u8> {
    (0..4096u64)
        .map(|i| (sector.wrapping_mul(31).wrapping_add(i) as u8) ^ generation)
        .collect()
}

/// Posts a 4 KiB IN or OUT request in request slot `slot` (descriptors 3 slot..3 slot + 2);
/// its status byte starts as [`STATUS_UNSET`].
pub fn blk_request(d: &mut Driver, slot: u16, kind: u32, sector: u64, data: Option<&[u8]>) -> u16 {
    let buf = BLK_DATA + u64::from(slot) * 4096;
    match data {
        Some(bytes) => d.mem.write_slice(bytes, GuestAddress(buf)).unwrap(),
        None => d.mem.write_slice(&[0u8; 4096], GuestAddress(buf)).unwrap(),
    }
    blk_request_on(d, 0, slot, kind, sector, buf, 4096)
}

/// Where the header and the status byte of request slot `slot` of queue `q` are.
fn blk_slot_addrs(q: usize, slot: u16) -> (u64, u64) {
    let n = q as u64 * u64::from(QSIZE) + u64::from(slot);
    (BLK_HDRS + n * 16, BLK_STATUS + n)
}

/// Posts an IN or OUT request in request slot `slot` of queue `q` (each queue has its own
/// headers and status bytes) whose data buffer is `len` bytes at guest address `buf` (as they
/// are); its status byte starts as [`STATUS_UNSET`].
pub fn blk_request_on(
    d: &mut Driver,
    q: usize,
    slot: u16,
    kind: u32,
    sector: u64,
    buf: u64,
    len: u32,
) -> u16 {
    let (hdr, status) = blk_slot_addrs(q, slot);
    d.mem
        .write_slice(&RequestHeader::encode(kind, sector), GuestAddress(hdr))
        .unwrap();
    d.mem.write_obj(STATUS_UNSET, GuestAddress(status)).unwrap();
    d.post_descs(
        q,
        3 * slot,
        &[
            (hdr, 16, false),
            (buf, len, kind == VIRTIO_BLK_T_IN),
            (status, 1, true),
        ],
    )
}

/// Posts a read of `len` bytes at `sector(slot)` into a zeroed buffer at `buf(slot)`, in each
/// request slot of `slots` on queue `q` (a read that leaves its buffer alone shows).
pub fn post_zeroed_reads(
    d: &mut Driver,
    q: usize,
    slots: std::ops::Range<u16>,
    sector: impl Fn(u16) -> u64,
    buf: impl Fn(u16) -> u64,
    len: u32,
) {
    let zeroes = vec![0u8; len as usize];
    for slot in slots {
        d.mem.write_slice(&zeroes, GuestAddress(buf(slot))).unwrap();
        blk_request_on(d, q, slot, VIRTIO_BLK_T_IN, sector(slot), buf(slot), len);
    }
}

/// The status byte of request slot `slot` of queue `q`.
pub fn blk_status_on(d: &Driver, q: usize, slot: u16) -> u8 {
    d.mem
        .read_obj(GuestAddress(blk_slot_addrs(q, slot).1))
        .unwrap()
}

pub fn blk_status(d: &Driver, slot: u16) -> u8 {
    blk_status_on(d, 0, slot)
}

/// Waits for `n` used entries on queue 0; returns their heads.
pub fn wait_used(d: &mut Driver, n: usize) -> Vec<u16> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut heads = Vec::new();
    while heads.len() < n {
        match d.next_used(0) {
            Some((id, _)) => heads.push(u16::try_from(id).unwrap()),
            None => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "only {heads:?} completed"
                );
                d.wait_call(0, Duration::from_millis(50));
            }
        }
    }
    heads
}

/// Connects and starts a block device the way QEMU's vhost-user-blk does.
pub fn blk_session(path: &Path, wanted: u64) -> Driver {
    let mut d = Driver::connect(path, 1);
    d.negotiate(VhostUserProtocolFeatures::empty(), wanted)
        .unwrap();
    d.setup_rings(1).unwrap();
    d.frontend.set_vring_enable(0, true).unwrap();
    d
}

/// A well-formed front end connecting to the block server at `path` writes 4 KiB (a pattern
/// of `seed`, at a sector of `seed`) and reads them back.
pub fn assert_blk_served(path: &Path, seed: u64) {
    let mut d = blk_session(
        path,
        feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX),
    );
    let sector = (seed % 2000) * 8;
    let data: Vec<u8> = (0..4096u64).map(|i| (i ^ seed) as u8).collect();
    blk_request(&mut d, 0, VIRTIO_BLK_T_OUT, sector, Some(&data));
    wait_used(&mut d, 1);
    assert_eq!(blk_status(&d, 0), 0, "seed {seed}: the write failed");
    blk_request(&mut d, 1, VIRTIO_BLK_T_IN, sector, None);
    wait_used(&mut d, 1);
    assert_eq!(blk_status(&d, 1), 0, "seed {seed}: the read failed");
    let mut got = vec![0u8; 4096];
    d.mem
        .read_slice(&mut got, GuestAddress(BLK_DATA + 4096))
        .unwrap();
    assert!(got == data, "seed {seed}: 4 KiB read back differ");
}

/// A kick, call or error fd a front end may hand over instead of an eventfd.
#[derive(Clone, Copy, Debug)]
pub enum NotEventFd {
    /// A pipe holding one byte (its write end kept open: a read of eight bytes blocks).
    PipeWithByte,
    /// A regular file.
    File,
    /// One end of a socket pair.
    Socket,
}

impl NotEventFd {
    pub const ALL: [NotEventFd; 3] = [Self::PipeWithByte, Self::File, Self::Socket];

    /// The fd, and what keeps its other end open.
    pub fn make(self) -> (std::os::fd::OwnedFd, Option<std::os::fd::OwnedFd>) {
        match self {
            Self::PipeWithByte => {
                let mut fds = [-1; 2];
                assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
                let (r, w) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
                (&w).write_all(&[1]).unwrap();
                (r.into(), Some(w.into()))
            }
            Self::File => (memfd(8).into(), None),
            Self::Socket => {
                let (a, b) = UnixStream::pair().unwrap();
                (a.into(), Some(b.into()))
            }
        }
    }
}

/// A blocking eventfd whose counter is at its maximum: a write to it blocks.
pub fn full_eventfd() -> EventFd {
    let e = EventFd::new(0).unwrap();
    e.write(u64::MAX - 1).unwrap();
    e
}

/// What a front end sees of a request it sent with NEED_REPLY.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// A success reply (REPLY_ACK value 0).
    Acked,
    /// A failure reply (a non-zero REPLY_ACK value).
    Refused,
    /// The end of the connection instead of a reply.
    Closed,
    /// Nothing within the socket's read timeout.
    Silent,
}

/// Sends `request` with NEED_REPLY and `fds` on the driver's socket and reads the answer.
pub fn reply_to(d: &Driver, request: u32, body: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> Reply {
    use bouncevm_vhost::relay::{recv_message, send_message, Message};
    let msg = Message {
        request,
        flags: 0x1 | 0x8,
        body: body.to_vec(),
        fds,
    };
    if send_message(&d.raw, &msg).is_err() {
        return Reply::Closed;
    }
    match recv_message(&d.raw) {
        Ok(Some(reply)) => {
            assert_eq!(reply.request, request, "reply to another request");
            let value = u64::from_le_bytes(reply.body[..8].try_into().unwrap());
            if value == 0 {
                Reply::Acked
            } else {
                Reply::Refused
            }
        }
        Ok(None) => Reply::Closed,
        Err(e) => Reply::instead(&e),
    }
}

impl Reply {
    /// What a failed read of a reply means: nothing within the timeout, or the end.
    fn instead(e: &std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Reply::Silent,
            _ => Reply::Closed,
        }
    }
}

/// True when the back end still answers on `d`'s connection (a GET_FEATURES within the
/// socket's read timeout).
pub fn session_answers(d: &Driver) -> bool {
    use bouncevm_vhost::relay::{recv_message, send_message, Message};
    send_message(&d.raw, &Message::new(1, 0x1, vec![])).is_ok()
        && matches!(recv_message(&d.raw), Ok(Some(r)) if r.request == 1)
}

/// Sends `request` with NEED_REPLY and `fds` on the driver's socket; true when the backend
/// refused it: a failure reply, then the end of the connection (both within the socket's
/// 10 s timeout). False when it was accepted (a success reply).
pub fn refused(d: &Driver, request: u32, body: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> bool {
    match reply_to(d, request, body, fds) {
        Reply::Acked => return false,
        Reply::Refused => {}
        other => {
            panic!("request {request}: {other:?} where a reply was due (REPLY_ACK was negotiated)")
        }
    }
    match bouncevm_vhost::relay::recv_message(&d.raw) {
        Ok(None) => true,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => true,
        other => panic!("request {request} refused but the session goes on: {other:?}"),
    }
}

/// The body of a vring state message (SET_VRING_NUM, SET_VRING_BASE, SET_VRING_ENABLE):
/// the queue index, then the value.
pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
    let mut b = index.to_le_bytes().to_vec();
    b.extend_from_slice(&num.to_le_bytes());
    b
}

/// SET_MEM_TABLE body of `regions` (guest address, size, front end address, file offset).
pub fn mem_table_body(regions: &[(u64, u64, u64, u64)]) -> Vec<u8> {
    let mut b = (regions.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&[0; 4]);
    for &(gpa, size, uaddr, offset) in regions {
        for v in [gpa, size, uaddr, offset] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
    b
}

impl Driver {
    /// The memfd behind the driver's memory and the front end's address of its start.
    pub fn memfd_and_base(&self) -> (std::os::fd::OwnedFd, u64) {
        let region = self.mem.find_region(GuestAddress(0)).unwrap();
        let file = region.file_offset().unwrap().file().try_clone().unwrap();
        let base = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .unwrap() as u64;
        (file.into(), base)
    }

    /// SET_VRING_NUM/BASE/ADDR of queue `q` at its usual rings, zeroed (a previous session
    /// may have left indexes behind), then kick, call and error fds (the driver's, or hostile
    /// ones put in their place).
    pub fn configure_default_ring(&mut self, q: usize) -> vhost::Result<()> {
        // Zero the rings (a previous session may have left indexes behind).
        self.vqs[q] = Self::fresh_queue(q);
        self.vqs[q].clear_rings(&self.mem).unwrap();
        let l = layout(q);
        self.configure_ring(q, l.desc, l.avail, l.used)
    }

    /// As [`Driver::configure_default_ring`] with a queue of `size` (at most 512, for depths
    /// the usual [`QSIZE`] cannot hold), its rings in a block of their own below the echo
    /// buffers.
    pub fn configure_sized_ring(&mut self, q: usize, size: u16) -> vhost::Result<()> {
        assert!(q < 16 && size <= 512, "queue {q} of size {size}");
        let l = Layout::packed(0x10_0000 + q as u64 * 0x8000, size, 0x1000);
        self.vqs[q] = DriverQueue::new(l, true).unwrap();
        self.vqs[q].clear_rings(&self.mem).unwrap();
        self.configure_ring(q, l.desc, l.avail, l.used)
    }

    /// GET_VRING_BASE of queue `q` on the raw socket; panics when it is not answered within
    /// 10 s (a worker blocked on a front end's fd holds what the stop needs).
    pub fn stop_ring(&mut self, q: u32) -> u32 {
        self.try_stop_ring(q)
            .expect("GET_VRING_BASE answered within the socket's timeout")
    }

    /// GET_VRING_BASE of queue `q` on the raw socket: the index it answers, or what came
    /// instead ([`Reply::Closed`] or [`Reply::Silent`]).
    pub fn try_stop_ring(&mut self, q: u32) -> Result<u32, Reply> {
        use bouncevm_vhost::relay::{recv_message, send_message, Message};
        let mut body = q.to_le_bytes().to_vec();
        body.extend_from_slice(&[0; 4]);
        send_message(&self.raw, &Message::new(11, 0x1, body)).map_err(|_| Reply::Closed)?;
        match recv_message(&self.raw) {
            Ok(Some(r)) => {
                assert_eq!(r.request, 11, "reply to another request");
                Ok(u32::from_le_bytes(r.body[4..8].try_into().unwrap()))
            }
            Ok(None) => Err(Reply::Closed),
            Err(e) => Err(Reply::instead(&e)),
        }
    }

    /// Waits up to 10 s for the next used element of queue `q` by reading the used ring,
    /// without relying on the call fd.
    pub fn poll_used(&mut self, q: usize) -> Option<(u32, u32)> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(u) = self.next_used(q) {
                return Some(u);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Driver {
    /// The driver's memory as two regions split at guest address `at`, both backed by its one
    /// memfd: what QEMU adds one by one (ADD_MEM_REG) for memory in two RAM blocks.
    pub fn regions_split_at(&self, at: u64) -> [VhostUserMemoryRegionInfo; 2] {
        let region = self.mem.find_region(GuestAddress(0)).unwrap();
        let whole = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
        assert!(at > 0 && at < whole.memory_size, "split at {at:#x}");
        let mut low = whole;
        low.memory_size = at;
        let mut high = whole;
        high.guest_phys_addr += at;
        high.memory_size -= at;
        high.userspace_addr += at;
        high.mmap_offset += at;
        [low, high]
    }
}
