//! The vhost-user front end of the load generator: connection, feature negotiation, the
//! config space, the shared memfd and the virtqueues, in the order QEMU uses for a
//! vhost-user-blk device.

use std::fs::File;
use std::mem::offset_of;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use devices::virtio::driver::Layout;
use devices::virtio::spec::{
    feature, virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_F_ACCESS_PLATFORM,
    VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use serde::Serialize;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::{Error, Result};

/// Bytes of the config space read: up to and including `num_queues` (virtio 1.2, 5.2.4).
const CONFIG_LEN: usize = offset_of!(virtio_blk_config, max_discard_sectors);

/// What the front end asks for beyond the basics.
#[derive(Clone, Copy, Debug, Default)]
pub struct Wanted {
    /// Negotiate VIRTIO_F_ACCESS_PLATFORM (fail if not offered).
    pub access_platform: bool,
    /// Refuse VIRTIO_RING_F_EVENT_IDX even if offered.
    pub no_event_idx: bool,
    /// Refuse VIRTIO_RING_F_INDIRECT_DESC even if offered.
    pub no_indirect: bool,
    /// Writes will be issued (fail on a read-only device).
    pub writes: bool,
}

// Field list of the negotiated device; alike in shape only to other record structs.
/// The device as negotiated and as its config space describes it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct DeviceInfo {
    /// Features the backend offered.
    pub offered: u64,
    /// Features acknowledged.
    pub acked: u64,
    /// Protocol features acknowledged.
    pub protocol: u64,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Logical block size (512 unless VIRTIO_BLK_F_BLK_SIZE).
    pub blk_size: u32,
    /// Largest segment (VIRTIO_BLK_F_SIZE_MAX), if limited.
    pub size_max: Option<u32>,
    /// Most data segments per request (VIRTIO_BLK_F_SEG_MAX), if limited.
    pub seg_max: Option<u32>,
    /// Queues the device serves (GET_QUEUE_NUM and, with VIRTIO_BLK_F_MQ, `num_queues`).
    pub queues: u16,
}

impl DeviceInfo {
    /// Whether `feature` was acknowledged.
    pub fn has(&self, feature: u64) -> bool {
        self.acked & feature != 0
    }
}

/// One queue as the front end programs it.
#[derive(Debug)]
pub struct QueueSetup {
    /// The rings in guest memory.
    pub layout: Layout,
    /// Kick eventfd (front end writes).
    pub kick: EventFd,
    /// Call eventfd (backend writes).
    pub call: EventFd,
}

/// A connected, negotiated vhost-user-blk back end.
pub struct Session {
    frontend: Frontend,
    wd: Watchdog,
    /// A clone of the socket, polled by the job threads to notice a disconnect.
    watch: UnixStream,
    info: DeviceInfo,
    queues: usize,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("info", &self.info)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

/// Bounds every vhost-user request: the `vhost` crate's front end blocks on the socket (and
/// retries a receive timeout forever), so a back end that does not answer is cut off here by
/// shutting the socket down when the deadline passes; the blocked call then fails.
struct Watchdog {
    shared: Arc<(Mutex<WatchState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
    timeout: Duration,
}

#[derive(Default)]
struct WatchState {
    deadline: Option<Instant>,
    fired: bool,
    exit: bool,
}

impl Watchdog {
    fn new(sock: UnixStream, timeout: Duration) -> std::io::Result<Self> {
        let shared = Arc::new((Mutex::new(WatchState::default()), Condvar::new()));
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("load-watchdog".into())
            .spawn(move || {
                let (lock, cv) = &*s;
                let Ok(mut st) = lock.lock() else { return };
                while !st.exit {
                    st = match st.deadline {
                        None => match cv.wait(st) {
                            Ok(g) => g,
                            Err(_) => return,
                        },
                        Some(d) if Instant::now() >= d => {
                            let _ = sock.shutdown(std::net::Shutdown::Both);
                            st.fired = true;
                            st.deadline = None;
                            st
                        }
                        Some(d) => {
                            match cv.wait_timeout(st, d.saturating_duration_since(Instant::now())) {
                                Ok((g, _)) => g,
                                Err(_) => return,
                            }
                        }
                    };
                }
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
            timeout,
        })
    }

    fn set(&self, deadline: Option<Instant>) -> bool {
        let (lock, cv) = &*self.shared;
        let fired = match lock.lock() {
            Ok(mut st) => {
                st.deadline = deadline;
                st.fired
            }
            Err(_) => true,
        };
        cv.notify_one();
        fired
    }

    /// Runs request `f` named `what` within the timeout.
    fn call<T>(&self, what: &'static str, f: impl FnOnce() -> vhost::Result<T>) -> Result<T> {
        if self.set(Some(Instant::now() + self.timeout)) {
            return Err(Error::NoAnswer {
                step: what,
                secs: self.timeout.as_secs_f64(),
            });
        }
        let r = f();
        let fired = self.set(None);
        match r {
            _ if fired => Err(Error::NoAnswer {
                step: what,
                secs: self.timeout.as_secs_f64(),
            }),
            Ok(v) => Ok(v),
            Err(source) => Err(Error::Protocol { step: what, source }),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.shared;
        if let Ok(mut st) = lock.lock() {
            st.exit = true;
        }
        cv.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn step(what: &'static str) -> impl FnOnce(vhost::Error) -> Error {
    move |source| Error::Protocol { step: what, source }
}

fn get_u32(c: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&c[at..at + 4]);
    u32::from_le_bytes(b)
}

/// Creates the shared guest memory: a memfd of `size` bytes mapped at guest address 0.
///
/// # Errors
/// When the memfd cannot be created, sized or mapped.
pub fn guest_memory(size: u64) -> Result<GuestMemoryMmap> {
    let name = c"bouncevm-load";
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1
    // and touches no memory of ours.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Memory(format!(
            "memfd_create: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: fd is a new, valid file descriptor owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| Error::Memory(format!("sizing the memfd to {size} bytes: {e}")))?;
    let len = usize::try_from(size).map_err(|_| Error::Memory(format!("{size} bytes")))?;
    GuestMemoryMmap::from_ranges_with_files(&[(
        GuestAddress(0),
        len,
        Some(FileOffset::new(file, 0)),
    )])
    .map_err(|e| Error::Memory(format!("mapping {size} bytes: {e}")))
}

impl Session {
    /// Connects to `path` (retrying while the socket does not exist or refuses, up to
    /// `timeout`), negotiates features and reads the config space. Every reply is awaited at
    /// most `timeout`.
    ///
    /// # Errors
    /// A connection, protocol or feature error.
    pub fn connect(path: &Path, timeout: Duration, wanted: Wanted) -> Result<Self> {
        let stream = connect_retrying(path, Instant::now() + timeout)?;
        let io = |e| Error::Connect {
            path: path.display().to_string(),
            source: e,
        };
        let watch = stream.try_clone().map_err(io)?;
        let wd = Watchdog::new(stream.try_clone().map_err(io)?, timeout).map_err(io)?;
        let mut frontend = Frontend::from_stream(stream, 1);

        wd.call("SET_OWNER", || frontend.set_owner())?;
        let offered = wd.call("GET_FEATURES", || frontend.get_features())?;
        check_offered(offered, wanted)?;
        let (proto, queues) = negotiate_protocol(&wd, &mut frontend)?;
        let acked = acked_features(offered, wanted);
        let info = read_config(&wd, &mut frontend, offered, acked, proto, queues)?;
        tracing::debug!(?info, "negotiated");
        Ok(Self {
            frontend,
            wd,
            watch,
            info,
            queues: 0,
        })
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The socket, for polling (POLLRDHUP means the backend went away).
    pub fn watch_fd(&self) -> std::os::fd::RawFd {
        self.watch.as_raw_fd()
    }

    /// Acks the features, shares `mem` and sets up and enables `queues`.
    ///
    /// # Errors
    /// A protocol error (a refusal is seen through REPLY_ACK when the backend offers it).
    pub fn start(&mut self, mem: &GuestMemoryMmap, queues: &[QueueSetup]) -> Result<()> {
        self.wd.call("SET_FEATURES", || {
            self.frontend.set_features(self.info.acked)
        })?;
        let region = mem
            .find_region(GuestAddress(0))
            .ok_or_else(|| Error::Memory("no guest memory region".into()))?;
        let info =
            VhostUserMemoryRegionInfo::from_guest_region(region).map_err(step("SET_MEM_TABLE"))?;
        self.wd
            .call("SET_MEM_TABLE", || self.frontend.set_mem_table(&[info]))?;
        // Ring addresses are the front end's virtual addresses (what QEMU sends).
        let base = region.as_ptr() as u64;
        for (i, q) in queues.iter().enumerate() {
            let l = q.layout;
            self.wd
                .call("SET_VRING_NUM", || self.frontend.set_vring_num(i, l.size))?;
            self.wd
                .call("SET_VRING_BASE", || self.frontend.set_vring_base(i, 0))?;
            self.wd.call("SET_VRING_ADDR", || {
                self.frontend.set_vring_addr(
                    i,
                    &VringConfigData {
                        queue_max_size: l.size,
                        queue_size: l.size,
                        flags: 0,
                        desc_table_addr: base + l.desc,
                        used_ring_addr: base + l.used,
                        avail_ring_addr: base + l.avail,
                        log_addr: None,
                    },
                )
            })?;
            self.wd.call("SET_VRING_KICK", || {
                self.frontend.set_vring_kick(i, &q.kick)
            })?;
            self.wd.call("SET_VRING_CALL", || {
                self.frontend.set_vring_call(i, &q.call)
            })?;
        }
        for i in 0..queues.len() {
            self.wd.call("SET_VRING_ENABLE", || {
                self.frontend.set_vring_enable(i, true)
            })?;
        }
        self.queues = queues.len();
        Ok(())
    }

    /// Stops every queue (GET_VRING_BASE, as QEMU does when the guest stops the device);
    /// returns each queue's final available index as the backend saw it.
    ///
    /// # Errors
    /// A protocol error.
    pub fn stop(&mut self) -> Result<Vec<u32>> {
        (0..self.queues)
            .map(|i| {
                self.wd
                    .call("GET_VRING_BASE", || self.frontend.get_vring_base(i))
            })
            .collect()
    }
}

/// Connects to `path`, retrying while the socket does not exist or refuses until `deadline`.
fn connect_retrying(path: &Path, deadline: Instant) -> Result<UnixStream> {
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(Error::Connect {
                    path: path.display().to_string(),
                    source: e,
                })
            }
        }
    }
}

/// Refuses a backend that does not offer what the job needs.
fn check_offered(offered: u64, wanted: Wanted) -> Result<()> {
    let proto_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if offered & feature(VIRTIO_F_VERSION_1) == 0 {
        return Err(Error::Feature(
            "the backend does not offer VIRTIO_F_VERSION_1".into(),
        ));
    }
    if offered & proto_bit == 0 {
        return Err(Error::Feature(
            "the backend does not offer VHOST_USER_F_PROTOCOL_FEATURES".into(),
        ));
    }
    if wanted.access_platform && offered & feature(VIRTIO_F_ACCESS_PLATFORM) == 0 {
        return Err(Error::Feature(
            "the backend does not offer VIRTIO_F_ACCESS_PLATFORM (--access-platform)".into(),
        ));
    }
    if wanted.writes && offered & feature(VIRTIO_BLK_F_RO) != 0 {
        return Err(Error::Feature(
            "the device is read-only (VIRTIO_BLK_F_RO) and the job writes".into(),
        ));
    }
    Ok(())
}

/// Negotiates the protocol features (MQ, CONFIG, REPLY_ACK); returns them and the number of
/// queues the backend serves.
fn negotiate_protocol(
    wd: &Watchdog,
    frontend: &mut Frontend,
) -> Result<(VhostUserProtocolFeatures, u16)> {
    let proto_offered = wd.call("GET_PROTOCOL_FEATURES", || frontend.get_protocol_features())?;
    if !proto_offered.contains(VhostUserProtocolFeatures::CONFIG) {
        return Err(Error::Feature(
            "the backend does not offer VHOST_USER_PROTOCOL_F_CONFIG (the capacity cannot be read)"
                .into(),
        ));
    }
    let proto = proto_offered
        & (VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK);
    wd.call("SET_PROTOCOL_FEATURES", || {
        frontend.set_protocol_features(proto)
    })?;
    if proto.contains(VhostUserProtocolFeatures::REPLY_ACK) {
        // Every request is acknowledged: a backend that refuses a ring setting says so.
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    }
    let mut queues: u16 = 1;
    if proto.contains(VhostUserProtocolFeatures::MQ) {
        let n = wd.call("GET_QUEUE_NUM", || frontend.get_queue_num())?;
        queues = u16::try_from(n.max(1)).unwrap_or(u16::MAX);
    }
    Ok((proto, queues))
}

/// The features the load generator acknowledges of `offered`.
fn acked_features(offered: u64, wanted: Wanted) -> u64 {
    let mut acked = feature(VIRTIO_F_VERSION_1)
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | feature(VIRTIO_BLK_F_SIZE_MAX)
        | feature(VIRTIO_BLK_F_SEG_MAX)
        | feature(VIRTIO_BLK_F_BLK_SIZE)
        | feature(VIRTIO_BLK_F_FLUSH)
        | feature(VIRTIO_BLK_F_MQ)
        | feature(VIRTIO_BLK_F_RO);
    if !wanted.no_event_idx {
        acked |= feature(VIRTIO_RING_F_EVENT_IDX);
    }
    if !wanted.no_indirect {
        acked |= feature(VIRTIO_RING_F_INDIRECT_DESC);
    }
    if wanted.access_platform {
        acked |= feature(VIRTIO_F_ACCESS_PLATFORM);
    }
    acked & offered
}

/// Reads the configuration space and checks it: capacity, block size, limits, queues.
fn read_config(
    wd: &Watchdog,
    frontend: &mut Frontend,
    offered: u64,
    acked: u64,
    proto: VhostUserProtocolFeatures,
    mut queues: u16,
) -> Result<DeviceInfo> {
    let (_, config) = wd.call("GET_CONFIG", || {
        frontend.get_config(
            0,
            CONFIG_LEN as u32,
            VhostUserConfigFlags::empty(),
            &[0u8; CONFIG_LEN],
        )
    })?;
    if config.len() < CONFIG_LEN {
        return Err(Error::Misbehaved(format!(
            "GET_CONFIG answered {} bytes of {CONFIG_LEN}",
            config.len()
        )));
    }
    let mut cap = [0u8; 8];
    let at = offset_of!(virtio_blk_config, capacity);
    cap.copy_from_slice(&config[at..at + 8]);
    let sectors = u64::from_le_bytes(cap);
    let capacity = sectors
        .checked_mul(devices::block::SECTOR_SIZE)
        .ok_or_else(|| Error::Misbehaved(format!("capacity of {sectors} sectors")))?;
    let limit = |f: u64, at: usize| (acked & f != 0).then(|| get_u32(&config, at));
    let blk_size = limit(
        feature(VIRTIO_BLK_F_BLK_SIZE),
        offset_of!(virtio_blk_config, blk_size),
    )
    .unwrap_or(512);
    if !blk_size.is_power_of_two() || blk_size < 512 {
        return Err(Error::Misbehaved(format!("blk_size {blk_size}")));
    }
    if acked & feature(VIRTIO_BLK_F_MQ) != 0 {
        let mut b = [0u8; 2];
        let at = offset_of!(virtio_blk_config, num_queues);
        b.copy_from_slice(&config[at..at + 2]);
        queues = queues.min(u16::from_le_bytes(b).max(1));
    } else {
        queues = 1;
    }
    Ok(DeviceInfo {
        offered,
        acked,
        protocol: proto.bits(),
        capacity,
        blk_size,
        size_max: limit(
            feature(VIRTIO_BLK_F_SIZE_MAX),
            offset_of!(virtio_blk_config, size_max),
        )
        .filter(|&s| s > 0),
        seg_max: limit(
            feature(VIRTIO_BLK_F_SEG_MAX),
            offset_of!(virtio_blk_config, seg_max),
        )
        .filter(|&s| s > 0),
        queues,
    })
}
