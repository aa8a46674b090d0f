//! A vhost-user message relay that accepts `SET_VRING_ENABLE` before `SET_FEATURES`.
//!
//! QEMU 7.2 starts a vhost-user-net device by sending `VHOST_USER_SET_VRING_ENABLE` for its
//! queues *before* `VHOST_USER_SET_FEATURES`, and never again afterwards. Both the `vhost`
//! crate's request dispatcher and `vhost-user-backend`'s handler refuse that request until
//! `VHOST_USER_F_PROTOCOL_FEATURES` has been acknowledged, and `vhost-user-backend` then drops
//! the connection. The check sits in the dispatcher itself (before any handler of ours runs),
//! and the handler type is private, so neither can be wrapped.
//!
//! The relay sits between the frontend's socket and the backend's request handler and passes
//! every message through unchanged (header, body and attached file descriptors), except:
//! - a `SET_VRING_ENABLE` that arrives before `SET_FEATURES` is held (the last value per
//!   queue) and acknowledged by the relay itself if the frontend asked for a reply; one the
//!   backend would refuse (a queue index the device does not have, a value other than 0 or 1)
//!   is refused (a failure reply if one was asked for) and never held, so what is held is
//!   bounded by the device's queue count;
//! - right after forwarding a `SET_FEATURES` that acknowledges `PROTOCOL_FEATURES`, the held
//!   requests are forwarded (without the need-reply flag, as their reply was already given),
//!   so the rings end up enabled exactly as the frontend asked. Without `PROTOCOL_FEATURES`
//!   the spec says rings start enabled, and the held requests are dropped;
//! - `SET_VRING_ERR` is forwarded, and a duplicate of its eventfd kept in the [`Report`],
//!   so a broken worker can signal it (`vhost-user-backend` keeps its copy private);
//! - `SET_STATUS` and `GET_STATUS` (`VHOST_USER_PROTOCOL_F_STATUS`) are answered by the relay
//!   from the [`Report`], which adds DEVICE_NEEDS_RESET while a worker is broken;
//! - `GET_INFLIGHT_FD` and `SET_INFLIGHT_FD` (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`, offered
//!   for block) are answered by the relay: a new region, or the front end's checked, mapped
//!   and kept in the session's [`Inflight`] for the adapter ([`crate::inflight`]); a region
//!   the checks refuse ends the session;
//! - `RESET_OWNER` and `RESET_DEVICE` return the relay to its initial state (and forget the
//!   inflight region);
//! - `SET_VRING_NUM`, `SET_VRING_KICK`/`CALL`/`ERR`, `SET_MEM_TABLE` and `ADD_MEM_REG` pass
//!   the [`checks`]
//!   (queue sizes, eventfds made non-blocking, regions inside their files and sorted) or are
//!   refused: a failure reply if one was asked for, then the end of the session, as the
//!   backend ends it on its own errors;
//! - an `ADD_MEM_REG` of a region already added, and a `REM_MEM_REG` of a region added more
//!   than once, are acknowledged by the relay: each copy is a reference (see [`slots`]).
//!
//! The counters ([`RelayCounters`]) belong to the server and add up over its sessions; each
//! condition a front end can trigger at will is logged once per server and counted always.
//!
//! # What a front end can trigger, where it is counted, how often it is logged
//!
//! Every condition a front end (or the guest through it) can repeat at will, across the
//! crate and the device cores it serves. Statistics paths are those of the statistics JSON
//! (`--stats-socket`, SIGUSR1). "Server" counters and latches live as long as the process
//! serves the device (all sessions; the `transport` counters too, so a session that ended
//! still shows); "device" ones are the device core's (all sessions); `report` and `workers`
//! describe the current connection. Later occurrences go to debug level.
//!
//! | condition | counter | logged |
//! |---|---|---|
//! | `SET_VRING_ENABLE` before `SET_FEATURES` for a missing queue or a value over 1 | `server.relay.early_enables_refused` | once per server |
//! | `SET_VRING_ENABLE` before `SET_FEATURES` (QEMU's order: held) | `early_enables_held`, `_replayed`, `_dropped` | no (normal) |
//! | `SET_STATUS` without a status | `server.relay.malformed_status` | once per server |
//! | `SET_VRING_NUM` not a power of two, or over `--queue-size` | `server.relay.refused_queue_sizes` | once per server |
//! | kick, call or error fd not an eventfd, or not made non-blocking | `server.relay.refused_fds` | once per server |
//! | memory table or added region malformed, empty, wrapping, past its file's end, not mappable; a region beyond the slots | `server.relay.refused_mem_tables` | once per server |
//! | memory table out of address order (served sorted) | `server.relay.mem_tables_sorted` | once per server (info) |
//! | a region added again (a copy) or a copy removed | `server.relay.region_copies` | once per server (info) |
//! | `GET_INFLIGHT_FD`/`SET_INFLIGHT_FD` not negotiated, malformed, or a bad region | `server.relay.refused_inflight` | once per server |
//! | a message body over [`MAX_BODY`], or a message cut short | `server.relay.unreadable_messages` | once per server |
//! | a message `vhost-user-backend` refuses (features never offered, a queue index out of range, the removal of an unknown region, a malformed body) | `server.failed_sessions` | once per server |
//! | features the device cannot be activated with | `transport.activation_failures` | once per server |
//! | an inflight region after a queue started | `transport.late_inflight_regions` | once per server |
//! | a call eventfd full or closed (the notification fails) | `transport.signal_errors` | once per server (info) |
//! | a kick before the queue is ready and enabled | `transport.not_ready_events` | no (normal during setup) |
//! | an event nobody serves (a kick before the memory table) | `transport.ignored_events` | no |
//! | rings outside guest memory or misaligned, an avail index far ahead, a status byte that cannot be found or written (`device.metrics.no_status`), a bad inflight record: the worker is broken (NEEDS_RESET, error fds) | `transport.broken_workers`, `transport.errors_signalled` | once per worker start (an error line each time the front end starts the queues again) |
//! | an error eventfd full or closed | `transport.error_signal_failures` | once per server (info) |
//! | blk: a malformed chain (loop, too long, header short, bad indirect table) | `device.metrics.err_bad_chain` | once per device |
//! | blk: a buffer outside guest memory | `device.metrics.err_guest_access` | once per device |
//! | blk: sectors past the end, unaligned lengths, discard or write-zeroes over the limits | `device.metrics.err_out_of_range` | once per device |
//! | blk: a write to a read-only disk | `device.metrics.err_readonly` | once per device |
//! | blk: an unknown or unnegotiated request type | `device.metrics.err_unsupported` | once per device |
//! | blk: a mapping the bounce pool refused; a host I/O error | `device.metrics.err_bounce`, `err_io` | once per device |
//! | blk: a write to the configuration space | `device.metrics.config_write_rejected` | once per device |
//! | net: a TX chain malformed, too short, or outside guest memory | `device.net.tx_dropped_malformed` | once per device |
//! | net: a TX frame over 65,562 bytes with its header; a TX vnet header asking for what was not negotiated | `device.net.tx_dropped_oversized`, `tx_dropped_bad_header` | once per device |
//! | net: an RX or control chain malformed | `device.net.rx_bad_chains`, `ctrl_bad_chains` | once per device |
//! | net: a write to the configuration space | `device.net.config_writes_ignored` | once per device |
//! | net: a control command the device does not support | `device.net.ctrl_err` | no (answered ERR) |
//!
//! Only the control path goes through the relay: the rings, kicks and calls are shared memory
//! and eventfds between the frontend and the backend.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};

use serde::Serialize;

use crate::checks::{self, CheckError};
use crate::inflight::{Description, Inflight, InflightError, Region};
use crate::report::Report;
use crate::slots::{self, Slots, MAX_MEM_SLOTS};
use devices::metrics::LogOnce;
use vhost::vhost_user::message::{
    VhostUserProtocolFeatures, VhostUserVirtioFeatures, MAX_ATTACHED_FD_ENTRIES,
};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Size of a vhost-user message header (request, flags, size; little-endian u32s).
pub const HEADER_LEN: usize = 12;
/// Largest body the relay accepts (the vhost crate's limit is 4 KiB; memory tables of many
/// regions stay far below this).
pub const MAX_BODY: usize = 64 * 1024;
/// Header flag: protocol version 1.
pub const FLAG_VERSION: u32 = 0x1;
/// Header flag: this message is a reply.
pub const FLAG_REPLY: u32 = 0x4;
/// Header flag: the sender wants a reply (REPLY_ACK).
pub const FLAG_NEED_REPLY: u32 = 0x8;

/// One vhost-user message with its file descriptors.
#[derive(Debug)]
pub struct Message {
    /// Request code.
    pub request: u32,
    /// Flags.
    pub flags: u32,
    /// Body (its length is the header's size field).
    pub body: Vec<u8>,
    /// Attached file descriptors (closed when the message is dropped).
    pub fds: Vec<OwnedFd>,
}

impl Message {
    /// A message without file descriptors.
    pub fn new(request: u32, flags: u32, body: Vec<u8>) -> Self {
        Self {
            request,
            flags,
            body,
            fds: Vec::new(),
        }
    }

    /// The encoded header.
    fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&self.request.to_le_bytes());
        h[4..8].copy_from_slice(&self.flags.to_le_bytes());
        // Bodies are bounded by MAX_BODY when received and built small otherwise.
        let size = u32::try_from(self.body.len()).unwrap_or(u32::MAX);
        h[8..12].copy_from_slice(&size.to_le_bytes());
        h
    }

    /// The first little-endian u32 of the body, if there is one.
    fn body_u32(&self, at: usize) -> Option<u32> {
        let b = self.body.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(b.try_into().ok()?))
    }

    /// The body as a u64 (SET_FEATURES).
    fn body_u64(&self) -> Option<u64> {
        let b = self.body.get(0..8)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    }
}

/// Receives up to `buf.len()` bytes and any file descriptors sent with them.
fn recv_some(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut raw = [-1 as RawFd; MAX_ATTACHED_FD_ENTRIES];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the iovec points to `buf`, valid and writable for its whole length for the
    // duration of the call; `raw` has room for MAX_ATTACHED_FD_ENTRIES descriptors.
    let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut raw) }
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    for &fd in raw.iter().take(nfds) {
        if fd >= 0 {
            // SAFETY: the kernel just installed this descriptor for us; nothing else owns it.
            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
    Ok(n)
}

/// Fills `buf` completely; `Ok(false)` on end of stream before the first byte.
fn recv_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match recv_some(sock, &mut buf[got..], fds) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Receives one message; `Ok(None)` at a clean end of stream.
///
/// # Errors
/// I/O errors, a truncated message, or a body larger than [`MAX_BODY`].
pub fn recv_message(sock: &UnixStream) -> io::Result<Option<Message>> {
    let mut fds = Vec::new();
    let mut hdr = [0u8; HEADER_LEN];
    if !recv_exact(sock, &mut hdr, &mut fds)? {
        return Ok(None);
    }
    let word = |i: usize| u32::from_le_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
    let (request, flags, size) = (word(0), word(4), word(8) as usize);
    if size > MAX_BODY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message {request} has a {size}-byte body (limit {MAX_BODY})"),
        ));
    }
    let mut body = vec![0u8; size];
    if size > 0 && !recv_exact(sock, &mut body, &mut fds)? {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(Message {
        request,
        flags,
        body,
        fds,
    }))
}

/// Sends one message with its file descriptors.
///
/// # Errors
/// I/O errors.
pub fn send_message(sock: &UnixStream, msg: &Message) -> io::Result<()> {
    let hdr = msg.header();
    let raw: Vec<RawFd> = msg.fds.iter().map(AsRawFd::as_raw_fd).collect();
    let bufs: [&[u8]; 2] = [&hdr, &msg.body];
    let total = HEADER_LEN + msg.body.len();
    let sent = loop {
        match sock.send_with_fds(&bufs, &raw) {
            Ok(n) => break n,
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) => return Err(io::Error::from_raw_os_error(e.errno())),
        }
    };
    if sent < total {
        // A stream socket may take part of a message; the descriptors went with the first
        // byte, the rest is plain data.
        let mut rest = Vec::with_capacity(total - sent);
        rest.extend_from_slice(&hdr);
        rest.extend_from_slice(&msg.body);
        (&*sock).write_all(&rest[sent..])?;
    }
    Ok(())
}

/// Counters of a relay.
#[derive(Debug, Default, Serialize, Clone, Copy, PartialEq, Eq)]
pub struct RelayStats {
    /// Messages passed from the frontend to the backend.
    pub to_backend: u64,
    /// Messages passed from the backend to the frontend.
    pub to_frontend: u64,
    /// `SET_VRING_ENABLE` requests held because they came before `SET_FEATURES`.
    pub early_enables_held: u64,
    /// Held requests forwarded after `SET_FEATURES`.
    pub early_enables_replayed: u64,
    /// Held requests dropped (features without `PROTOCOL_FEATURES`, or a reset).
    pub early_enables_dropped: u64,
    /// Early requests refused (queue index out of range, or a value other than 0/1).
    pub early_enables_refused: u64,
    /// Messages refused by the [`checks`] (each ended its session): queue sizes.
    pub refused_queue_sizes: u64,
    /// Kick, call or error fds that are not eventfds.
    pub refused_fds: u64,
    /// Memory tables and added regions (a region past its file, empty, wrapping, or not a
    /// file; a new region while every memory slot is taken).
    pub refused_mem_tables: u64,
    /// Memory tables whose regions were not in guest-address order (sorted, then served).
    pub mem_tables_sorted: u64,
    /// SET_STATUS messages without a status (ignored).
    pub malformed_status: u64,
    /// Inflight regions created (`GET_INFLIGHT_FD`).
    pub inflight_regions_created: u64,
    /// Inflight regions taken from the front end (`SET_INFLIGHT_FD`).
    pub inflight_regions_adopted: u64,
    /// Inflight requests or regions refused (each ended its session).
    pub refused_inflight: u64,
    /// ADD_MEM_REG and REM_MEM_REG of a copy of a region already added (see [`slots`]).
    pub region_copies: u64,
    /// Messages from a front end that could not be read (a body over [`MAX_BODY`], a message
    /// cut short); each ended its session.
    pub unreadable_messages: u64,
}

/// The relay counters of a server, shared by its sessions, with the latches that keep each
/// front-end-triggered warning to one line per server.
#[derive(Debug, Default)]
pub struct RelayCounters {
    to_backend: AtomicU64,
    to_frontend: AtomicU64,
    held: AtomicU64,
    replayed: AtomicU64,
    dropped: AtomicU64,
    refused: AtomicU64,
    refused_queue_sizes: AtomicU64,
    refused_fds: AtomicU64,
    refused_mem_tables: AtomicU64,
    mem_tables_sorted: AtomicU64,
    malformed_status: AtomicU64,
    inflight_created: AtomicU64,
    inflight_adopted: AtomicU64,
    refused_inflight: AtomicU64,
    inflight_logged: LogOnce,
    region_copies: AtomicU64,
    unreadable_messages: AtomicU64,
    unreadable_logged: LogOnce,
    early_enable_logged: LogOnce,
    status_logged: LogOnce,
    queue_size_logged: LogOnce,
    fd_logged: LogOnce,
    mem_table_logged: LogOnce,
    sorted_logged: LogOnce,
    copies_logged: LogOnce,
}

impl RelayCounters {
    /// The counters so far.
    pub fn snapshot(&self) -> RelayStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayStats {
            to_backend: g(&self.to_backend),
            to_frontend: g(&self.to_frontend),
            early_enables_held: g(&self.held),
            early_enables_replayed: g(&self.replayed),
            early_enables_dropped: g(&self.dropped),
            early_enables_refused: g(&self.refused),
            refused_queue_sizes: g(&self.refused_queue_sizes),
            refused_fds: g(&self.refused_fds),
            refused_mem_tables: g(&self.refused_mem_tables),
            mem_tables_sorted: g(&self.mem_tables_sorted),
            malformed_status: g(&self.malformed_status),
            inflight_regions_created: g(&self.inflight_created),
            inflight_regions_adopted: g(&self.inflight_adopted),
            refused_inflight: g(&self.refused_inflight),
            region_copies: g(&self.region_copies),
            unreadable_messages: g(&self.unreadable_messages),
        }
    }

    /// Counts a refusal and logs the first of its kind (later ones at debug level).
    fn refusal(&self, request: u32, e: &CheckError) {
        let (counter, latch) = match e {
            CheckError::QueueSize { .. } => (&self.refused_queue_sizes, &self.queue_size_logged),
            CheckError::NotAnEventFd { .. } | CheckError::NonBlocking { .. } => {
                (&self.refused_fds, &self.fd_logged)
            }
            _ => (&self.refused_mem_tables, &self.mem_table_logged),
        };
        add(counter, 1);
        if latch.first() {
            tracing::warn!(
                "refusing request {request} of a front end: {e}; its session ends (logged once, counted in the relay statistics)"
            );
        } else {
            tracing::debug!("refusing request {request}: {e}");
        }
    }
}

fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// The frontend-to-backend direction's state.
#[derive(Debug)]
struct Sequencer {
    /// Error fds and the device status, shared with the adapter.
    report: Arc<Report>,
    /// The device's queue count: early enables for queues at or above it are refused.
    num_queues: u32,
    /// True once `SET_FEATURES` went through (until a reset).
    features_set: bool,
    /// REPLY_ACK was acknowledged (`SET_PROTOCOL_FEATURES`) and the features asked for
    /// (`GET_FEATURES`; the backend always offers PROTOCOL_FEATURES): only then does a request
    /// with NEED_REPLY get an ack, as the `vhost` crate decides for the backend's own replies.
    /// An unasked-for reply would be taken by the frontend as the answer to its next request
    /// (found by `tests/vhost_fuzz.rs`).
    reply_ack: bool,
    features_asked: bool,
    /// Early `SET_VRING_ENABLE` values by queue index (indexes below `num_queues`, values 0
    /// or 1: at most `num_queues` entries).
    held: BTreeMap<u32, u32>,
    /// The device's largest queue size (SET_VRING_NUM above it is refused).
    max_queue_size: usize,
    /// The session's inflight region, when the device offers INFLIGHT_SHMFD.
    inflight: Option<Arc<Inflight>>,
    /// INFLIGHT_SHMFD was acknowledged (`SET_PROTOCOL_FEATURES`).
    inflight_acked: bool,
    /// Regions added one by one, with their copies (see [`slots`]).
    slots: Slots,
}

/// A reply to `request` carrying the u64 `value` (REPLY_ACK: 0 success, else failure).
fn u64_reply(request: u32, value: u64) -> Message {
    Message::new(
        request,
        FLAG_VERSION | FLAG_REPLY,
        value.to_le_bytes().to_vec(),
    )
}

/// What to do with a message from the frontend.
#[derive(Debug)]
enum Action {
    /// Pass these messages to the backend, in order.
    Forward(Vec<Message>),
    /// Answer the frontend with this reply (nothing goes to the backend).
    Reply(Message),
    /// Nothing to send.
    Nothing,
    /// Refuse the message: send the failure reply if there is one, then end the session.
    Refuse(Option<Message>),
}

/// The vhost-user request numbers as a message header carries them.
pub mod req {
    use vhost::vhost_user::message::FrontendReq;

    /// Acks virtio features.
    pub const SET_FEATURES: u32 = FrontendReq::SET_FEATURES as u32;
    /// Acks vhost-user protocol features.
    pub const SET_PROTOCOL_FEATURES: u32 = FrontendReq::SET_PROTOCOL_FEATURES as u32;
    /// Asks for the offered virtio features.
    pub const GET_FEATURES: u32 = FrontendReq::GET_FEATURES as u32;
    /// Enables or disables a vring.
    pub const SET_VRING_ENABLE: u32 = FrontendReq::SET_VRING_ENABLE as u32;
    /// Resets the session (the older request that RESET_DEVICE replaces).
    pub const RESET_OWNER: u32 = FrontendReq::RESET_OWNER as u32;
    /// Resets the device.
    pub const RESET_DEVICE: u32 = FrontendReq::RESET_DEVICE as u32;
    /// Hands over a vring's error eventfd.
    pub const SET_VRING_ERR: u32 = FrontendReq::SET_VRING_ERR as u32;
    /// Sets the virtio device status.
    pub const SET_STATUS: u32 = FrontendReq::SET_STATUS as u32;
    /// Asks for the virtio device status.
    pub const GET_STATUS: u32 = FrontendReq::GET_STATUS as u32;
    /// Sets a vring's size.
    pub const SET_VRING_NUM: u32 = FrontendReq::SET_VRING_NUM as u32;
    /// Hands over a vring's kick eventfd.
    pub const SET_VRING_KICK: u32 = FrontendReq::SET_VRING_KICK as u32;
    /// Hands over a vring's call eventfd.
    pub const SET_VRING_CALL: u32 = FrontendReq::SET_VRING_CALL as u32;
    /// Replaces the guest memory table.
    pub const SET_MEM_TABLE: u32 = FrontendReq::SET_MEM_TABLE as u32;
    /// Adds one guest memory region.
    pub const ADD_MEM_REG: u32 = FrontendReq::ADD_MEM_REG as u32;
    /// Asks the back end for an inflight region.
    pub const GET_INFLIGHT_FD: u32 = FrontendReq::GET_INFLIGHT_FD as u32;
    /// Hands an inflight region to the back end.
    pub const SET_INFLIGHT_FD: u32 = FrontendReq::SET_INFLIGHT_FD as u32;
    /// Removes one guest memory region.
    pub const REM_MEM_REG: u32 = FrontendReq::REM_MEM_REG as u32;
}
use req::*;

/// SET_VRING_ERR/KICK/CALL body: the queue index's bits.
const VRING_INDEX_MASK: u64 = 0xff;
/// SET_VRING_ERR/KICK/CALL body: no fd attached.
const VRING_NOFD_MASK: u64 = 0x100;

impl Sequencer {
    fn new(num_queues: usize, max_queue_size: usize, report: Arc<Report>) -> Self {
        Self {
            report,
            num_queues: u32::try_from(num_queues).unwrap_or(u32::MAX),
            features_set: false,
            reply_ack: false,
            features_asked: false,
            held: BTreeMap::new(),
            max_queue_size,
            inflight: None,
            inflight_acked: false,
            slots: Slots::default(),
        }
    }

    /// Whether the front end asked for a reply to `msg` and gets one (REPLY_ACK negotiated).
    fn wants_ack(&self, msg: &Message) -> bool {
        msg.flags & FLAG_NEED_REPLY != 0 && self.acks()
    }

    /// Answers the inflight requests with `inflight` (a device that offers INFLIGHT_SHMFD).
    fn with_inflight(mut self, inflight: Option<Arc<Inflight>>) -> Self {
        self.inflight = inflight;
        self
    }

    /// `GET_INFLIGHT_FD` and `SET_INFLIGHT_FD`: a new region for the front end, or the one it
    /// hands over, checked and kept for the adapter.
    fn inflight_request(&mut self, mut msg: Message, stats: &RelayCounters) -> Action {
        let result = (|| {
            let slot = match (&self.inflight, self.inflight_acked) {
                (Some(slot), true) => slot,
                _ => {
                    return Err(InflightError::Os(
                        "INFLIGHT_SHMFD was not negotiated".to_string(),
                    ))
                }
            };
            let desc = Description::decode(&msg.body, msg.fds.len())?;
            let max_queues = self.num_queues as usize;
            if msg.request == GET_INFLIGHT_FD {
                let (reply, fd) = Region::create(&desc, max_queues, self.max_queue_size)?;
                add(&stats.inflight_created, 1);
                let mut r = Message::new(msg.request, FLAG_VERSION | FLAG_REPLY, reply.encode());
                r.fds.push(fd);
                return Ok(Action::Reply(r));
            }
            let fd = match (msg.fds.pop(), msg.fds.is_empty()) {
                (Some(fd), true) => fd,
                _ => {
                    return Err(InflightError::Malformed {
                        body: msg.body.len(),
                        fds: msg.fds.len() + 1,
                    })
                }
            };
            let region = Region::adopt(&desc, fd, max_queues, self.max_queue_size)?;
            slot.set(Some(region));
            add(&stats.inflight_adopted, 1);
            Ok(if self.wants_ack(&msg) {
                Action::Reply(u64_reply(msg.request, 0))
            } else {
                Action::Nothing
            })
        })();
        result.unwrap_or_else(|e| {
            add(&stats.refused_inflight, 1);
            if stats.inflight_logged.first() {
                tracing::warn!(
                    "refusing request {} of a front end: {e}; its session ends (logged once, counted in the relay statistics)",
                    msg.request
                );
            } else {
                tracing::debug!("refusing request {}: {e}", msg.request);
            }
            Action::Refuse(self.failure(&msg))
        })
    }

    /// The reply that refuses `msg` (failure), if the front end asked for one.
    fn failure(&self, msg: &Message) -> Option<Message> {
        self.wants_ack(msg).then(|| u64_reply(msg.request, 1))
    }

    /// The ack of `msg` with `value` (0 success, 1 failure) if the front end asked for one,
    /// else nothing.
    fn ack(&self, msg: &Message, value: u64) -> Action {
        if self.wants_ack(msg) {
            Action::Reply(u64_reply(msg.request, value))
        } else {
            Action::Nothing
        }
    }

    /// Runs the [`checks`] that apply to `msg` (it may be rewritten: a sorted memory table).
    fn check(&self, msg: &mut Message, stats: &RelayCounters) -> Result<(), CheckError> {
        match msg.request {
            SET_VRING_NUM => match msg.body_u32(4) {
                Some(num) => checks::vring_num(num, self.max_queue_size),
                // Malformed: the backend's dispatcher rejects it.
                None => Ok(()),
            },
            SET_VRING_KICK | SET_VRING_CALL | SET_VRING_ERR => {
                let what = match msg.request {
                    SET_VRING_KICK => "kick",
                    SET_VRING_CALL => "call",
                    _ => "error",
                };
                msg.fds.iter().try_for_each(|fd| checks::vring_fd(what, fd))
            }
            SET_MEM_TABLE => {
                let before = msg.body.clone();
                checks::mem_table(&mut msg.body, &mut msg.fds)?;
                if msg.body != before {
                    add(&stats.mem_tables_sorted, 1);
                    if stats.sorted_logged.first() {
                        tracing::info!(
                            "a memory table's regions came out of address order; served sorted (logged once)"
                        );
                    }
                }
                Ok(())
            }
            ADD_MEM_REG => {
                let r = checks::add_mem_reg(&msg.body, &msg.fds)?;
                if self.slots.fits(&r) {
                    Ok(())
                } else {
                    Err(CheckError::NoFreeSlot { max: MAX_MEM_SLOTS })
                }
            }
            _ => Ok(()),
        }
    }

    /// Whether NEED_REPLY gets an ack.
    fn acks(&self) -> bool {
        self.reply_ack && self.features_asked
    }

    fn on_message(&mut self, mut msg: Message, stats: &RelayCounters) -> Action {
        if let Err(e) = self.check(&mut msg, stats) {
            stats.refusal(msg.request, &e);
            return Action::Refuse(self.failure(&msg));
        }
        match msg.request {
            SET_VRING_ENABLE if !self.features_set => self.early_enable(msg, stats),
            SET_FEATURES => self.set_features(msg, stats),
            SET_VRING_ERR => {
                self.keep_err_fd(&msg);
                Action::Forward(vec![msg])
            }
            SET_STATUS => self.set_status(&msg, stats),
            GET_FEATURES => {
                self.features_asked = true;
                Action::Forward(vec![msg])
            }
            SET_PROTOCOL_FEATURES => {
                let acked = msg.body_u64().unwrap_or(0);
                self.reply_ack = acked & VhostUserProtocolFeatures::REPLY_ACK.bits() != 0;
                self.inflight_acked = acked & VhostUserProtocolFeatures::INFLIGHT_SHMFD.bits() != 0;
                Action::Forward(vec![msg])
            }
            GET_INFLIGHT_FD | SET_INFLIGHT_FD => self.inflight_request(msg, stats),
            ADD_MEM_REG | REM_MEM_REG => self.on_slot(msg, stats),
            SET_MEM_TABLE => {
                self.slots.clear();
                Action::Forward(vec![msg])
            }
            GET_STATUS => Action::Reply(u64_reply(msg.request, u64::from(self.report.status()))),
            RESET_OWNER | RESET_DEVICE => {
                self.report.reset();
                if let Some(slot) = &self.inflight {
                    slot.set(None);
                }
                self.features_set = false;
                add(&stats.dropped, self.held.len() as u64);
                self.held.clear();
                Action::Forward(vec![msg])
            }
            _ => Action::Forward(vec![msg]),
        }
    }

    /// SET_VRING_ENABLE before SET_FEATURES: held until the features say whether rings start
    /// enabled, or refused when the backend would refuse it later.
    fn early_enable(&mut self, msg: Message, stats: &RelayCounters) -> Action {
        let (Some(index), Some(num)) = (msg.body_u32(0), msg.body_u32(4)) else {
            // Malformed: let the backend's dispatcher reject it.
            return Action::Forward(vec![msg]);
        };
        if index >= self.num_queues || num > 1 {
            // What the backend refuses once features are set: refused now too, and
            // never held. A front end can send these at will: logged once.
            if stats.early_enable_logged.first() {
                tracing::warn!(
                    "refusing early SET_VRING_ENABLE({index}, {num}): the device has {} queues and the value must be 0 or 1 (logged once, counted in the relay statistics)",
                    self.num_queues
                );
            }
            add(&stats.refused, 1);
            return self.ack(&msg, 1);
        }
        tracing::debug!("holding SET_VRING_ENABLE({index}, {num}) received before SET_FEATURES");
        self.held.insert(index, num);
        add(&stats.held, 1);
        self.ack(&msg, 0)
    }

    /// SET_FEATURES, followed by the held SET_VRING_ENABLEs when PROTOCOL_FEATURES is on.
    fn set_features(&mut self, msg: Message, stats: &RelayCounters) -> Action {
        self.features_set = true;
        let protocol = msg
            .body_u64()
            .is_some_and(|f| f & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0);
        let held = std::mem::take(&mut self.held);
        let mut out = vec![msg];
        if protocol {
            for (index, num) in held {
                tracing::debug!(
                    "applying early SET_VRING_ENABLE({index}, {num}) after SET_FEATURES"
                );
                let mut body = index.to_le_bytes().to_vec();
                body.extend_from_slice(&num.to_le_bytes());
                out.push(Message::new(SET_VRING_ENABLE, FLAG_VERSION, body));
                add(&stats.replayed, 1);
            }
        } else {
            // Without PROTOCOL_FEATURES every ring starts enabled.
            add(&stats.dropped, held.len() as u64);
        }
        Action::Forward(out)
    }

    /// SET_VRING_ERR: keeps a copy of the ring's error fd (or forgets it: no fd attached).
    fn keep_err_fd(&self, msg: &Message) {
        let Some(v) = msg.body_u64() else {
            return;
        };
        // The index is 8 bits: it fits usize.
        let index = (v & VRING_INDEX_MASK) as usize;
        let fd = match msg.fds.first() {
            Some(fd) if v & VRING_NOFD_MASK == 0 => match fd.try_clone() {
                Ok(dup) => Some(dup),
                Err(e) => {
                    tracing::warn!("keeping the error fd of vring {index}: {e}");
                    None
                }
            },
            _ => None,
        };
        self.report.set_err_fd(index, fd);
    }

    /// SET_STATUS: kept by the relay (the backend does not see it).
    fn set_status(&self, msg: &Message, stats: &RelayCounters) -> Action {
        match msg.body_u64() {
            // virtio status is one byte; higher bits mean nothing.
            Some(v) => self.report.set_status((v & 0xff) as u8),
            None => {
                add(&stats.malformed_status, 1);
                if stats.status_logged.first() {
                    tracing::warn!(
                        "SET_STATUS without a status: ignored (logged once, counted in the relay statistics)"
                    );
                }
            }
        }
        self.ack(msg, 0)
    }
}

/// The next message on `sock`, or none when the `side` connection ended or failed.
fn receive(sock: &UnixStream, side: &str) -> Option<Message> {
    recv_message(sock).unwrap_or_else(|e| {
        tracing::debug!("{side} connection: {e}");
        None
    })
}

/// The request thread: each message from the front end goes through `seq` and on to the
/// backend, or is answered or refused here; returns when either connection ends.
fn relay_requests(
    mut seq: Sequencer,
    fe_in: &UnixStream,
    be_out: &UnixStream,
    writer: &Mutex<UnixStream>,
    st: &RelayCounters,
) {
    loop {
        let msg = match recv_message(fe_in) {
            Ok(Some(msg)) => msg,
            Ok(None) => break,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof
                ) =>
            {
                add(&st.unreadable_messages, 1);
                if st.unreadable_logged.first() {
                    tracing::warn!(
                        "a front end's message cannot be read: {e}; its session ends (logged once, counted in the relay statistics)"
                    );
                } else {
                    tracing::debug!("frontend connection: {e}");
                }
                break;
            }
            Err(e) => {
                tracing::debug!("frontend connection: {e}");
                break;
            }
        };
        let result = match seq.on_message(msg, st) {
            Action::Forward(msgs) => msgs.iter().try_for_each(|m| {
                add(&st.to_backend, 1);
                send_message(be_out, m)
            }),
            Action::Reply(reply) => {
                let w = writer.lock().unwrap_or_else(|e| e.into_inner());
                send_message(&w, &reply)
            }
            Action::Nothing => Ok(()),
            Action::Refuse(reply) => {
                if let Some(reply) = reply {
                    let w = writer.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = send_message(&w, &reply);
                }
                break;
            }
        };
        if let Err(e) = result {
            tracing::debug!("relaying a request: {e}");
            break;
        }
    }
}

/// The reply thread: copies each backend message to the front end; returns when either
/// connection ends.
fn relay_replies(be_in: &UnixStream, writer: &Mutex<UnixStream>, st: &RelayCounters) {
    while let Some(msg) = receive(be_in, "backend") {
        add(&st.to_frontend, 1);
        let w = writer.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = send_message(&w, &msg) {
            tracing::debug!("relaying a reply: {e}");
            break;
        }
    }
}

impl Sequencer {
    /// ADD_MEM_REG or REM_MEM_REG (the add already checked): a copy of a region added before
    /// is acknowledged here; a new region, and the removal of a region's last copy, go to the
    /// backend.
    fn on_slot(&mut self, msg: Message, stats: &RelayCounters) -> Action {
        let Some(r) = checks::single_region(&msg.body) else {
            // Malformed: the backend's dispatcher rejects it.
            return Action::Forward(vec![msg]);
        };
        let copy = if msg.request == ADD_MEM_REG {
            self.slots.add(&r) == slots::Add::Copy
        } else {
            self.slots.remove(&r) == slots::Remove::Copy
        };
        if !copy {
            return Action::Forward(vec![msg]);
        }
        add(&stats.region_copies, 1);
        if stats.copies_logged.first() {
            tracing::info!(
                "a front end adds the same memory region more than once (QEMU's multi-queue net does, once per queue pair): each copy is a reference, the region is unmapped with the last (logged once, counted in the relay statistics)"
            );
        }
        if msg.flags & FLAG_NEED_REPLY != 0 && self.acks() {
            Action::Reply(u64_reply(msg.request, 0))
        } else {
            Action::Nothing
        }
    }
}

/// A running relay: two threads copying messages between a frontend and a backend socket.
#[derive(Debug)]
pub struct Relay {
    frontend: UnixStream,
    backend: UnixStream,
    stats: Arc<RelayCounters>,
    threads: Vec<JoinHandle<()>>,
}

/// What the relay checks messages against: the device's queue count and largest queue size,
/// and where a device that offers INFLIGHT_SHMFD keeps the session's inflight region.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Queues of the device.
    pub num_queues: usize,
    /// Largest queue size the device accepts.
    pub max_queue_size: usize,
    /// The session's inflight region (`None`: the device does not offer INFLIGHT_SHMFD).
    pub inflight: Option<Arc<Inflight>>,
}

impl Relay {
    /// Starts relaying between `frontend` (the VMM's connection) and `backend` (the request
    /// handler's connection) for a device of `limits`, keeping error fds and the status in
    /// `report`, counting in `stats`.
    ///
    /// # Errors
    /// Socket cloning or thread creation failed.
    pub fn start(
        frontend: UnixStream,
        backend: UnixStream,
        limits: Limits,
        report: Arc<Report>,
        stats: Arc<RelayCounters>,
    ) -> io::Result<Self> {
        let fe_writer = Arc::new(Mutex::new(frontend.try_clone()?));

        let (fe_in, be_out, st, writer) = (
            frontend.try_clone()?,
            backend.try_clone()?,
            stats.clone(),
            fe_writer.clone(),
        );
        let down = thread::Builder::new()
            .name("vu-relay-req".into())
            .spawn(move || {
                let seq = Sequencer::new(limits.num_queues, limits.max_queue_size, report)
                    .with_inflight(limits.inflight);
                relay_requests(seq, &fe_in, &be_out, &writer, &st);
                // The backend sees the end of the connection and winds down.
                let _ = be_out.shutdown(Shutdown::Both);
                let _ = fe_in.shutdown(Shutdown::Read);
            })?;

        let (be_in, st, writer, fe_shut) = (
            backend.try_clone()?,
            stats.clone(),
            fe_writer,
            frontend.try_clone()?,
        );
        let up = thread::Builder::new()
            .name("vu-relay-rep".into())
            .spawn(move || {
                relay_replies(&be_in, &writer, &st);
                // The backend ended the session (disconnect or protocol error): so does the
                // frontend's connection.
                let _ = fe_shut.shutdown(Shutdown::Both);
            })?;

        Ok(Self {
            frontend,
            backend,
            stats,
            threads: vec![down, up],
        })
    }

    /// Ends the session: shuts both connections down, which stops both threads and the
    /// backend's request handler.
    pub fn shutdown(&self) {
        let _ = self.frontend.shutdown(Shutdown::Both);
        let _ = self.backend.shutdown(Shutdown::Both);
    }

    /// A clone of the frontend connection, to shut the session down from elsewhere.
    ///
    /// # Errors
    /// The socket could not be cloned.
    pub fn frontend_handle(&self) -> io::Result<UnixStream> {
        self.frontend.try_clone()
    }

    /// The counters so far (of every session sharing them).
    pub fn stats(&self) -> RelayStats {
        self.stats.snapshot()
    }

    /// Shuts down and waits for both threads.
    pub fn join(mut self) {
        self.shutdown();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enable(index: u32, num: u32, flags: u32) -> Message {
        let mut body = index.to_le_bytes().to_vec();
        body.extend_from_slice(&num.to_le_bytes());
        Message::new(SET_VRING_ENABLE, flags, body)
    }

    fn features(f: u64) -> Message {
        Message::new(SET_FEATURES, FLAG_VERSION, f.to_le_bytes().to_vec())
    }

    #[test]
    fn early_enable_is_held_and_replayed_after_features() {
        let st = RelayCounters::default();
        let mut seq = Sequencer::new(4, 256, Arc::new(Report::new(4)));
        assert!(matches!(
            seq.on_message(enable(0, 1, FLAG_VERSION), &st),
            Action::Nothing
        ));
        assert!(matches!(
            seq.on_message(enable(1, 0, FLAG_VERSION), &st),
            Action::Nothing
        ));
        assert!(matches!(
            seq.on_message(enable(1, 1, FLAG_VERSION), &st),
            Action::Nothing
        ));
        let Action::Forward(out) = seq.on_message(
            features(VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()),
            &st,
        ) else {
            panic!("features must be forwarded");
        };
        let got: Vec<_> = out
            .iter()
            .map(|m| (m.request, m.body_u32(0), m.body_u32(4), m.flags))
            .collect();
        assert_eq!(
            got,
            vec![
                (SET_FEATURES, Some(0x4000_0000), Some(0), FLAG_VERSION),
                (SET_VRING_ENABLE, Some(0), Some(1), FLAG_VERSION),
                (SET_VRING_ENABLE, Some(1), Some(1), FLAG_VERSION),
            ]
        );
        // Later enables pass straight through.
        assert!(matches!(
            seq.on_message(enable(0, 0, FLAG_VERSION), &st),
            Action::Forward(v) if v.len() == 1
        ));
        let s = st.snapshot();
        assert_eq!((s.early_enables_held, s.early_enables_replayed), (3, 2));
    }

    /// GET_FEATURES, then SET_PROTOCOL_FEATURES acknowledging REPLY_ACK.
    fn ack_reply_ack(seq: &mut Sequencer, st: &RelayCounters) {
        let get = Message::new(GET_FEATURES, FLAG_VERSION, vec![]);
        assert!(matches!(seq.on_message(get, st), Action::Forward(v) if v.len() == 1));
        let bits = VhostUserProtocolFeatures::REPLY_ACK.bits();
        let m = Message::new(
            SET_PROTOCOL_FEATURES,
            FLAG_VERSION,
            bits.to_le_bytes().to_vec(),
        );
        assert!(matches!(seq.on_message(m, st), Action::Forward(v) if v.len() == 1));
    }

    #[test]
    fn early_enable_needing_a_reply_is_acknowledged_by_the_relay() {
        let st = RelayCounters::default();
        let mut seq = Sequencer::new(4, 256, Arc::new(Report::new(4)));
        // Without REPLY_ACK acknowledged, NEED_REPLY asks for nothing (found by vhost_fuzz:
        // the frontend took the unasked-for ack as the answer to its next request).
        assert!(matches!(
            seq.on_message(enable(0, 1, FLAG_VERSION | FLAG_NEED_REPLY), &st),
            Action::Nothing
        ));
        ack_reply_ack(&mut seq, &st);
        let Action::Reply(r) = seq.on_message(enable(0, 1, FLAG_VERSION | FLAG_NEED_REPLY), &st)
        else {
            panic!("a reply was requested");
        };
        assert_eq!(r.request, SET_VRING_ENABLE);
        assert_eq!(r.flags, FLAG_VERSION | FLAG_REPLY);
        assert_eq!(r.body_u64(), Some(0));
    }

    #[test]
    fn held_enables_are_dropped_without_protocol_features_or_on_reset() {
        let st = RelayCounters::default();
        let mut seq = Sequencer::new(4, 256, Arc::new(Report::new(4)));
        seq.on_message(enable(0, 1, FLAG_VERSION), &st);
        let Action::Forward(out) = seq.on_message(features(1 << 32), &st) else {
            panic!();
        };
        assert_eq!(out.len(), 1);
        seq.on_message(Message::new(RESET_OWNER, FLAG_VERSION, vec![]), &st);
        seq.on_message(enable(0, 1, FLAG_VERSION), &st);
        seq.on_message(Message::new(RESET_OWNER, FLAG_VERSION, vec![]), &st);
        assert_eq!(st.snapshot().early_enables_dropped, 2);
    }

    #[test]
    fn early_enables_the_backend_would_refuse_are_refused_and_not_held() {
        // Regression: vring 4000 before SET_FEATURES was held (without bound)
        // and acknowledged as a success.
        let st = RelayCounters::default();
        let mut seq = Sequencer::new(2, 256, Arc::new(Report::new(2)));
        ack_reply_ack(&mut seq, &st);
        let need = FLAG_VERSION | FLAG_NEED_REPLY;
        for (index, num) in [(2, 1), (4000, 1), (u32::MAX, 0), (0, 2), (1, u32::MAX)] {
            let Action::Reply(r) = seq.on_message(enable(index, num, need), &st) else {
                panic!("({index}, {num}): a reply was requested");
            };
            assert_eq!(r.body_u64(), Some(1), "({index}, {num}) must be refused");
            assert!(matches!(
                seq.on_message(enable(index, num, FLAG_VERSION), &st),
                Action::Nothing
            ));
        }
        assert!(seq.held.is_empty());
        // Valid ones are still held, one entry per queue however many arrive.
        for i in 0..1000u32 {
            seq.on_message(enable(i % 2, i & 1, FLAG_VERSION), &st);
        }
        assert_eq!(seq.held.len(), 2);
        let s = st.snapshot();
        assert_eq!((s.early_enables_refused, s.early_enables_held), (10, 1000));
    }

    #[test]
    fn status_is_answered_with_needs_reset_and_error_fds_are_kept() {
        let report = Arc::new(Report::new(2));
        let st = RelayCounters::default();
        let mut seq = Sequencer::new(2, 256, report.clone());
        ack_reply_ack(&mut seq, &st);
        let ev = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut m = Message::new(SET_VRING_ERR, FLAG_VERSION, 1u64.to_le_bytes().to_vec());
        // SAFETY: the clone is a new descriptor; the OwnedFd takes it over from the EventFd.
        m.fds.push(unsafe {
            OwnedFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(ev.try_clone().unwrap()))
        });
        assert!(matches!(seq.on_message(m, &st), Action::Forward(v) if v.len() == 1));
        assert!(report.has_err_fd(1));
        let set = Message::new(
            SET_STATUS,
            FLAG_VERSION | FLAG_NEED_REPLY,
            0x0fu64.to_le_bytes().to_vec(),
        );
        assert!(matches!(seq.on_message(set, &st), Action::Reply(r) if r.body_u64() == Some(0)));
        let get = || Message::new(GET_STATUS, FLAG_VERSION, vec![]);
        assert!(
            matches!(seq.on_message(get(), &st), Action::Reply(r) if r.body_u64() == Some(0x0f))
        );
        report.broken(&[1]);
        assert_eq!(ev.read().unwrap(), 1);
        assert!(
            matches!(seq.on_message(get(), &st), Action::Reply(r) if r.body_u64() == Some(0x4f))
        );
        seq.on_message(Message::new(RESET_DEVICE, FLAG_VERSION, vec![]), &st);
        assert!(!report.has_err_fd(1));
        assert!(matches!(seq.on_message(get(), &st), Action::Reply(r) if r.body_u64() == Some(0)));
    }

    #[test]
    fn messages_and_fds_cross_a_socket_pair_intact() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let mut m = Message::new(5, FLAG_VERSION, vec![7u8; 300]);
        m.fds.push(OwnedFd::from(file));
        send_message(&a, &m).unwrap();
        send_message(&a, &Message::new(1, FLAG_VERSION, vec![])).unwrap();
        let r = recv_message(&b).unwrap().unwrap();
        assert_eq!(
            (r.request, r.flags, r.body.len(), r.fds.len()),
            (5, 1, 300, 1)
        );
        let r = recv_message(&b).unwrap().unwrap();
        assert_eq!((r.request, r.body.len(), r.fds.len()), (1, 0, 0));
        drop(a);
        assert!(recv_message(&b).unwrap().is_none());
    }

    #[test]
    fn oversized_bodies_are_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut hdr = [0u8; HEADER_LEN];
        hdr[8..12].copy_from_slice(&(MAX_BODY as u32 + 1).to_le_bytes());
        (&a).write_all(&hdr).unwrap();
        assert_eq!(
            recv_message(&b).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }
}
