//! One worker per rx/tx queue pair: the TX and RX paths.
//!
//! **TX** (guest to backend): pop a chain, check its shape (device-readable descriptors only,
//! guest-memory addresses, no loop, at most 65562 bytes), ask the shaper, then map its
//! buffers through the [`Dma`] handle (to-device: copied into the pool when bouncing, as a
//! guest's `dma_map` would), check a copy of the vnet header against the acked features and
//! hand the frame to the backend as the header plus the device-visible pieces of the rest
//! (one `writev` on a tap, straight from guest memory or the pool: no copy into a host
//! buffer, no allocation per frame), then unmap. Every popped head gets exactly one
//! `add_used` (length 0: the device writes nothing); a throttled chain is put back
//! (`go_to_previous_position`) instead. A kick drains the whole ring before one notification.
//!
//! **RX** (backend to guest): read one frame from the backend into the worker's host buffer,
//! take enough guest chains for it (one; or, with MRG_RXBUF, as many as it needs), and scatter
//! it through the [`Dma`] handle (map from-device, write, unmap), with `num_buffers` filled in.
//! Chains are popped and checked first (device-writable only, inside guest memory, at least a
//! header long) and *held* by the worker until a frame fills them, so a frame that waits for
//! buffers, or is dropped on a bounce failure, leaves the guest's buffers usable. When the
//! guest has no buffers the frame stays pending and the backend is not read until the guest
//! posts some (an RX kick).
//!
//! Held chains never outlive an RX pass: at its end they go back to the available ring
//! (`next_avail` is moved back over them, see [`PairWorker::return_rx_chains`]) and are popped
//! again by the next pass. So the ring position a transport reports when it stops the device
//! (vhost-user `GET_VRING_BASE`, read between two events) never counts a buffer the guest did
//! not get back: a stop/cont or a migration loses none (with MRG_RXBUF a waiting frame may
//! hold many). A held chain popped before a refused one cannot go back (the refused one is
//! already on the used ring): it is completed with length 0 instead, as the refused one was.
//!
//! Polling contract: the backend fd is read until `WouldBlock`, except while a frame waits for
//! guest buffers or for the shaper. A transport polling it level-triggered would then spin, so
//! it must poll the worker's extra fds edge-triggered (`EPOLLET`); the RX kick or the shaper
//! timer resumes reading.

use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use bounce::error::ErrorClass;
use bounce::{Direction, Dma, DmaBuffer, RangeCheck};
use smallvec::SmallVec;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestMemory, VolatileSlice};

use super::backend::NetBackend;
use super::header::VnetHeader;
use super::metrics::NetMetrics;
use super::rate_limiter::{Dir, RateLimiter};
use super::{MAX_BUFFER_LEN, MIN_FRAME_LEN, QUEUE_MAX_SIZE, VNET_HDR_LEN};
use crate::virtio::chain::{Chain, ChainHead, Seg, WalkRules};
use crate::virtio::iobuf::{IoBuf, IoBufs};
use crate::virtio::queue::{self, Step};
use crate::virtio::spec::{feature, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_RING_F_INDIRECT_DESC};
use crate::virtio::{Handled, QueueWorker, Queues, Signal, WorkerError, WorkerEvent};

/// Token of the backend's fd in [`QueueWorker::extra_fds`].
pub const TOKEN_BACKEND: u32 = 0;
/// Token of the shaper's timerfd.
pub const TOKEN_SHAPER: u32 = 1;

/// Position of the RX queue in a pair worker's queues.
const RX: usize = 0;
/// Position of the TX queue.
const TX: usize = 1;

/// A backend shared between the device (which configures it) and its worker.
pub type SharedBackend = Arc<Mutex<Box<dyn NetBackend>>>;

pub(crate) use crate::metrics::lock;

/// The chain rules of a net worker: indirect tables when negotiated, up to the device's
/// largest queue size.
pub(crate) fn walk_rules(acked: u64) -> WalkRules {
    WalkRules {
        indirect: acked & feature(VIRTIO_RING_F_INDIRECT_DESC) != 0,
        max_indirect: QUEUE_MAX_SIZE,
    }
}

/// An RX chain popped, checked and held until a frame fills it.
#[derive(Debug)]
struct HeldChain {
    head: u16,
    descs: Vec<Seg>,
    capacity: usize,
}

/// What became of a TX chain.
enum TxOutcome {
    Sent,
    Dropped,
    Throttled,
}

/// What became of a pending RX frame.
enum RxOutcome {
    Delivered,
    Dropped,
    NoBuffers,
}

/// Serves one rx/tx queue pair.
#[derive(Debug)]
pub struct PairWorker<M> {
    pair: u16,
    acked: u64,
    mrg: bool,
    backend: SharedBackend,
    backend_fd: Option<RawFd>,
    dma: Dma,
    metrics: Arc<NetMetrics>,
    shaper: Option<RateLimiter>,
    rules: WalkRules,
    /// The mappings of the TX frame being sent (kept to reuse their storage).
    tx_mapped: Vec<DmaBuffer>,
    /// Where the device sees the bytes of those mappings.
    tx_pieces: IoBufs,
    tx_chain: Chain,
    rx_chain: Chain,
    rx_buf: Vec<u8>,
    /// Length of the frame in `rx_buf` waiting for delivery, and whether the shaper was
    /// already paid for it.
    rx_pending: Option<(usize, bool)>,
    rx_held: Vec<HeldChain>,
    /// How many of the last `rx_held` chains were popped after the last refused RX chain:
    /// those sit right behind `next_avail` and can be put back on the ring.
    rx_returnable: usize,
    /// Receive steering follows the rings' enable state ([`PairWorker::steered_by_rings`]).
    ring_steered: bool,
    /// Whether this pair's backend queue takes traffic (its tap queue is attached).
    receiving: bool,
    /// Frames delivered and TX chains served by this pair (per-pair statistics).
    pair_rx_frames: u64,
    pair_tx_chains: u64,
    /// Set once the worker handled an event.
    served: bool,
    /// A backend I/O error was logged (a tap deleted under the device fails every read and
    /// write from then on: logged once, counted always).
    backend_error_logged: crate::metrics::LogOnce,
    _mem: PhantomData<fn(&M)>,
}

impl<M: GuestMemory> PairWorker<M> {
    /// A worker for queue pair `pair` (queues `2 * pair` and `2 * pair + 1`); `pair` is also
    /// its bounce worker id.
    pub fn new(
        pair: u16,
        acked: u64,
        backend: SharedBackend,
        dma: Dma,
        metrics: Arc<NetMetrics>,
        shaper: Option<RateLimiter>,
    ) -> Self {
        let backend_fd = lock(&backend).rx_fd();
        Self {
            pair,
            acked,
            mrg: acked & feature(VIRTIO_NET_F_MRG_RXBUF) != 0,
            backend,
            backend_fd,
            dma,
            metrics,
            shaper,
            rules: walk_rules(acked),
            tx_mapped: Vec::new(),
            tx_pieces: IoBufs::new(),
            tx_chain: Chain::default(),
            rx_chain: Chain::default(),
            rx_buf: vec![0; MAX_BUFFER_LEN],
            rx_pending: None,
            rx_held: Vec::new(),
            rx_returnable: 0,
            ring_steered: false,
            receiving: pair == 0,
            pair_rx_frames: 0,
            pair_tx_chains: 0,
            served: false,
            backend_error_logged: crate::metrics::LogOnce::default(),
            _mem: PhantomData,
        }
    }

    /// Receive steering follows the rings' enable state rather than a control queue (a
    /// vhost-user frontend that keeps the control queue, see
    /// [`super::NetConfig::frontend_steering`]): the pair's backend queue is attached on the
    /// first event the transport delivers (its rings are enabled then) and detached when the
    /// transport reports them disabled ([`QueueWorker::queues_disabled`]). The device
    /// activates pair 0 attached and the others detached.
    #[must_use]
    pub fn steered_by_rings(mut self) -> Self {
        self.ring_steered = true;
        self
    }

    /// Attaches or detaches this pair's backend queue (ring-steered pairs).
    fn set_receiving(&mut self, on: bool) {
        if let Err(e) = lock(&self.backend).set_enabled(on) {
            // The frontend can toggle this in a loop: counted, at debug level.
            tracing::debug!(pair = self.pair, on, "steering: {e}");
            self.metrics.steering_errors.inc();
            return;
        }
        self.receiving = on;
        self.metrics.steering_changes.inc();
    }

    /// Logs a backend I/O error the first time (a tap that disappeared fails every read
    /// and write: the frames are dropped and counted, the device keeps serving); later ones
    /// at debug level.
    fn log_backend_error(&self, dir: &str, e: &std::io::Error) {
        if self.backend_error_logged.first() {
            tracing::warn!(
                pair = self.pair,
                "{dir} backend: {e}; frames are dropped and counted from now on (logged once)"
            );
        } else {
            tracing::debug!(pair = self.pair, "{dir} backend: {e}");
        }
    }

    fn worker_id(&self) -> usize {
        usize::from(self.pair)
    }

    /// Drains the TX queue.
    fn process_tx(&mut self, mem: &M, q: &mut Queue, sig: &mut Signal) -> Result<(), WorkerError> {
        let backend = self.backend.clone();
        let mut backend = lock(&backend);
        let drained = queue::drain(q, mem, |at| {
            if self.shaper.as_ref().is_some_and(|s| s.is_blocked(Dir::Tx)) {
                return Ok(Step::Defer);
            }
            Ok(match self.tx_one(mem, &at, backend.as_mut()) {
                TxOutcome::Throttled => {
                    self.metrics.tx_throttled.inc();
                    Step::Defer
                }
                TxOutcome::Sent | TxOutcome::Dropped => Step::Used(0),
            })
        })?;
        self.metrics
            .tx_queue_depth_hiwater
            .max(u64::from(drained.deepest));
        self.pair_tx_chains += drained.used as u64;
        if drained.used > 0 {
            queue::notify(q, mem, TX, sig)?;
        }
        Ok(())
    }

    fn tx_one(&mut self, mem: &M, at: &ChainHead, backend: &mut dyn NetBackend) -> TxOutcome {
        let m = &self.metrics;
        let c = &mut self.tx_chain;
        if let Err(e) = at.walk(mem, &self.rules, c) {
            m.tx_dropped_malformed.note(
                "net.tx_dropped_malformed",
                format_args!("virtio-net: tx chain refused: {e}"),
            );
            return TxOutcome::Dropped;
        }
        if !c.writable.is_empty() {
            m.tx_dropped_malformed.note(
                "net.tx_dropped_malformed",
                "virtio-net: tx chain refused: device-writable buffers",
            );
            return TxOutcome::Dropped;
        }
        if c.readable_len > MAX_BUFFER_LEN as u64 {
            m.tx_dropped_oversized.note(
                "net.tx_dropped_oversized",
                format_args!("virtio-net: a tx chain of {} bytes", c.readable_len),
            );
            return TxOutcome::Dropped;
        }
        // readable_len <= MAX_BUFFER_LEN: fits a usize.
        let total = c.readable_len as usize;
        if total < VNET_HDR_LEN + MIN_FRAME_LEN {
            m.tx_dropped_malformed.note(
                "net.tx_dropped_malformed",
                format_args!("virtio-net: a tx chain of {total} bytes"),
            );
            return TxOutcome::Dropped;
        }
        let frame_len = total - VNET_HDR_LEN;
        if let Some(s) = self.shaper.as_mut() {
            if !s.consume(Dir::Tx, frame_len as u64) {
                return TxOutcome::Throttled;
            }
        }
        // Map every buffer (to-device), then find where the device sees the bytes. The walk
        // checked each buffer against guest memory: that was the frame's one translation of
        // its ranges, the mapping does not check again.
        let worker = usize::from(self.pair);
        self.tx_mapped.clear();
        self.tx_pieces.clear();
        let mut mapped = Ok(());
        for seg in &c.readable {
            match self.dma.map(
                mem,
                seg.addr,
                seg.len as usize,
                Direction::ToDevice,
                worker,
                RangeCheck::Prevalidated,
            ) {
                Ok(b) => self.tx_mapped.push(b),
                Err(e) => {
                    mapped = Err(e);
                    break;
                }
            }
        }
        if mapped.is_ok() {
            for b in &self.tx_mapped {
                let pieces = &mut self.tx_pieces;
                let found = self
                    .dma
                    .device_pieces(mem, b, |ptr, len| pieces.push(IoBuf::new(ptr, len)));
                if let Err(e) = found {
                    mapped = Err(e);
                    break;
                }
            }
        }
        let outcome = match mapped {
            Ok(()) => self.tx_send(frame_len, backend),
            Err(e) => {
                if e.class() == ErrorClass::GuestFault {
                    m.tx_dropped_malformed.note(
                        "net.tx_dropped_malformed",
                        format_args!("virtio-net: tx map: {e}"),
                    );
                } else {
                    m.tx_bounce_failures.inc();
                    tracing::debug!(pair = self.pair, "tx map: {e}");
                }
                TxOutcome::Dropped
            }
        };
        // To-device mappings: unmapping copies nothing back, it only frees the slots.
        for b in self.tx_mapped.drain(..) {
            if let Err(e) = self.dma.unmap(mem, b, worker) {
                tracing::debug!(pair = self.pair, "tx unmap: {e}");
                m.tx_bounce_failures.inc();
            }
        }
        self.tx_pieces.clear();
        outcome
    }

    /// Checks the vnet header of the mapped frame in `tx_pieces` and sends it.
    fn tx_send(&self, frame_len: usize, backend: &mut dyn NetBackend) -> TxOutcome {
        let m = &self.metrics;
        // SAFETY: the pieces are the device-visible bytes of the mappings in `tx_mapped`,
        // which stay mapped (and their memory valid) until `tx_one` unmaps them after this
        // returns; the slices do not outlive this call.
        let slices: SmallVec<[VolatileSlice<'_>; 8]> = self
            .tx_pieces
            .iter()
            .map(|p| unsafe { p.as_volatile() })
            .collect();
        // A copy of the header (it may span pieces); the body is the rest of the pieces.
        let mut hdr_bytes = [0u8; VNET_HDR_LEN];
        let mut got = 0usize;
        let mut body: SmallVec<[VolatileSlice<'_>; 8]> = SmallVec::new();
        for s in &slices {
            let take = (VNET_HDR_LEN - got).min(s.len());
            if take > 0 {
                s.copy_to(&mut hdr_bytes[got..got + take]);
                got += take;
            }
            if take < s.len() {
                match s.subslice(take, s.len() - take) {
                    Ok(rest) => body.push(rest),
                    Err(_) => return TxOutcome::Dropped,
                }
            }
        }
        let hdr = VnetHeader::from_bytes(&hdr_bytes);
        if let Err(e) = hdr.check_tx(self.acked, frame_len) {
            m.tx_dropped_bad_header.note(
                "net.tx_dropped_bad_header",
                format_args!("virtio-net: tx header: {e}"),
            );
            return TxOutcome::Dropped;
        }
        // num_buffers means nothing on transmit; the tap ignores it, clear it anyway.
        hdr_bytes[10..12].fill(0);
        match backend.send_slices(&hdr_bytes, &body) {
            Ok(()) => {
                m.tx_frames.inc();
                m.tx_bytes.add(frame_len as u64);
                TxOutcome::Sent
            }
            Err(e) => {
                self.log_backend_error("tx", &e);
                m.tx_dropped_backend.inc();
                TxOutcome::Dropped
            }
        }
    }

    fn rx_enough(&self, need: usize) -> bool {
        if self.mrg {
            self.rx_held.iter().map(|c| c.capacity).sum::<usize>() >= need
        } else {
            !self.rx_held.is_empty()
        }
    }

    /// Pops RX chains into `rx_held` until they hold `need` bytes (or, without MRG_RXBUF,
    /// until one chain is held). Bad chains are completed with length 0. Returns false when
    /// the ring ran dry first (notifications are then re-enabled, so the guest kicks when it
    /// posts more).
    fn hold_rx_chains(
        &mut self,
        mem: &M,
        q: &mut Queue,
        need: usize,
        used: &mut bool,
    ) -> Result<bool, WorkerError> {
        if self.rx_enough(need) {
            return Ok(true);
        }
        let drained = queue::drain(q, mem, |at| {
            let c = &mut self.rx_chain;
            let walked = at.walk(mem, &self.rules, c);
            let refused = match walked {
                Err(e) => Some(e.to_string()),
                Ok(()) if !c.readable.is_empty() => Some("device-readable buffers".into()),
                Ok(()) if c.writable_len < VNET_HDR_LEN as u64 => {
                    Some("shorter than a vnet header".into())
                }
                Ok(()) => None,
            };
            if let Some(why) = refused {
                self.metrics.rx_bad_chains.note(
                    "net.rx_bad_chains",
                    format_args!("virtio-net: rx chain refused: {why}"),
                );
                // The chains held so far are now behind a used entry: they cannot go back.
                self.rx_returnable = 0;
                return Ok(Step::Used(0));
            }
            self.rx_returnable += 1;
            self.rx_held.push(HeldChain {
                head: at.head,
                descs: c.writable.clone(),
                // A chain holds at most 2^16 buffers of < 2^32 bytes: fits a 64-bit usize.
                capacity: usize::try_from(c.writable_len).unwrap_or(usize::MAX),
            });
            Ok(if self.rx_enough(need) {
                Step::Enough
            } else {
                Step::Held
            })
        })?;
        self.metrics
            .rx_queue_depth_hiwater
            .max(u64::from(drained.deepest));
        if drained.used > 0 {
            *used = true;
        }
        Ok(self.rx_enough(need))
    }

    /// Delivers the pending frame of `len` bytes (header included).
    fn deliver(
        &mut self,
        mem: &M,
        q: &mut Queue,
        len: usize,
        used: &mut bool,
    ) -> Result<RxOutcome, WorkerError> {
        let m = self.metrics.clone();
        if !self.hold_rx_chains(mem, q, len, used)? {
            // Every buffer of the ring is held and they still cannot take the frame: it can
            // never be delivered.
            if self.rx_held.len() >= usize::from(q.size()) {
                m.rx_dropped_too_small.inc();
                return Ok(RxOutcome::Dropped);
            }
            return Ok(RxOutcome::NoBuffers);
        }
        // Chains the frame spans: the shortest prefix of the held ones that holds it.
        let mut count = 0usize;
        let mut cap = 0usize;
        for c in &self.rx_held {
            count += 1;
            cap = cap.saturating_add(c.capacity);
            if cap >= len {
                break;
            }
        }
        if cap < len {
            // Only without MRG_RXBUF: the one chain is too small for this frame. The chain
            // stays held for the next frame.
            m.rx_dropped_too_small.inc();
            return Ok(RxOutcome::Dropped);
        }
        // count <= held chains <= queue size <= 32768: fits a u16.
        let num_buffers = u16::try_from(count).unwrap_or(u16::MAX);
        let mut hdr_bytes = [0u8; VNET_HDR_LEN];
        hdr_bytes.copy_from_slice(&self.rx_buf[..VNET_HDR_LEN]);
        let mut hdr = VnetHeader::from_bytes(&hdr_bytes);
        if let Err(e) = hdr.sanitize_rx(self.acked, num_buffers) {
            tracing::debug!(pair = self.pair, "rx header: {e}");
            m.rx_dropped_malformed.inc();
            return Ok(RxOutcome::Dropped);
        }
        self.rx_buf[..VNET_HDR_LEN].copy_from_slice(&hdr.to_bytes());

        // Scatter. Nothing is completed until every byte is in place, so a bounce failure
        // leaves the chains held (their contents are the guest's to overwrite anyway).
        let mut off = 0usize;
        let mut written = Vec::with_capacity(count);
        for c in &self.rx_held[..count] {
            let start = off;
            for seg in &c.descs {
                if off == len {
                    break;
                }
                let n = (seg.len as usize).min(len - off);
                // The walk checked the buffer (writable guest memory): no second check.
                let r = self.dma.write_guest(
                    mem,
                    seg.addr,
                    &self.rx_buf[off..off + n],
                    self.worker_id(),
                    RangeCheck::Prevalidated,
                );
                if let Err(e) = r {
                    tracing::debug!(pair = self.pair, "rx scatter: {e}");
                    m.rx_bounce_failures.inc();
                    return Ok(RxOutcome::Dropped);
                }
                off += n;
            }
            // At most MAX_BUFFER_LEN: fits a u32.
            written.push((c.head, (off - start) as u32));
        }
        for (head, n) in written {
            queue::add_used(q, mem, head, n)?;
        }
        self.rx_held.drain(..count);
        self.rx_returnable = self.rx_returnable.min(self.rx_held.len());
        *used = true;
        m.rx_frames.inc();
        self.pair_rx_frames += 1;
        m.rx_bytes.add((len - VNET_HDR_LEN) as u64);
        m.rx_buffers_used.add(count as u64);
        Ok(RxOutcome::Delivered)
    }

    /// Delivers pending frames and reads the backend until it is empty, the guest runs out
    /// of buffers, or the shaper says wait.
    fn process_rx(&mut self, mem: &M, q: &mut Queue, sig: &mut Signal) -> Result<(), WorkerError> {
        let backend = self.backend.clone();
        let mut used = false;
        loop {
            let (len, paid) = match self.rx_pending {
                Some(p) => p,
                None => {
                    if self.shaper.as_ref().is_some_and(|s| s.is_blocked(Dir::Rx)) {
                        break;
                    }
                    match lock(&backend).recv(&mut self.rx_buf) {
                        Ok(n) if n < VNET_HDR_LEN + MIN_FRAME_LEN => {
                            self.metrics.rx_dropped_malformed.inc();
                            continue;
                        }
                        Ok(n) => (n, false),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            self.log_backend_error("rx", &e);
                            self.metrics.rx_backend_errors.inc();
                            break;
                        }
                    }
                }
            };
            self.rx_pending = Some((len, paid));
            if !paid {
                if let Some(s) = self.shaper.as_mut() {
                    if !s.consume(Dir::Rx, (len - VNET_HDR_LEN) as u64) {
                        self.metrics.rx_throttled.inc();
                        break;
                    }
                }
                self.rx_pending = Some((len, true));
            }
            match self.deliver(mem, q, len, &mut used)? {
                RxOutcome::Delivered | RxOutcome::Dropped => self.rx_pending = None,
                RxOutcome::NoBuffers => {
                    // The ring ran dry with notifications re-enabled (and re-checked): the
                    // guest's next RX kick resumes delivery.
                    self.metrics.rx_no_buffers.inc();
                    break;
                }
            }
        }
        self.return_rx_chains(mem, q, &mut used)?;
        if used {
            queue::notify(q, mem, RX, sig)?;
        }
        Ok(())
    }

    /// Gives the held RX chains back at the end of a pass: those popped since the last refused
    /// chain go back on the available ring (`next_avail` moves back over them; they are the
    /// last entries popped), the others are completed with length 0 (a driver that posts
    /// broken chains sees an empty buffer, as for the broken chain itself).
    ///
    /// The event index the driver reads (`avail_event`) is left where the pass put it, at the
    /// ring's end: the driver still kicks for the next buffer it posts, and the next pass pops
    /// the returned chains again first.
    fn return_rx_chains(
        &mut self,
        mem: &M,
        q: &mut Queue,
        used: &mut bool,
    ) -> Result<(), WorkerError> {
        let n = self.rx_held.len();
        if n == 0 {
            return Ok(());
        }
        let back = self.rx_returnable.min(n);
        for c in self.rx_held.drain(..n - back) {
            queue::add_used(q, mem, c.head, 0)?;
            self.metrics.rx_chains_returned_empty.inc();
            *used = true;
        }
        // back <= held chains <= queue size <= 32768: fits a u16.
        let back16 = u16::try_from(back).unwrap_or(u16::MAX);
        q.set_next_avail(q.next_avail().wrapping_sub(back16));
        self.metrics.rx_chains_returned.add(back as u64);
        self.rx_held.clear();
        self.rx_returnable = 0;
        Ok(())
    }

    /// Frames waiting in the worker (0 or 1) and RX chains it holds (tests, stats).
    pub fn rx_state(&self) -> (bool, usize) {
        (self.rx_pending.is_some(), self.rx_held.len())
    }
}

impl<M: GuestMemory> QueueWorker<M> for PairWorker<M> {
    fn queue_indexes(&self) -> Vec<u16> {
        // pair < MAX_QUEUE_PAIRS = 256: no overflow.
        vec![2 * self.pair, 2 * self.pair + 1]
    }

    fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        let mut v = Vec::new();
        if let Some(fd) = self.backend_fd {
            v.push((fd, TOKEN_BACKEND));
        }
        if let Some(s) = &self.shaper {
            v.push((s.timer_fd(), TOKEN_SHAPER));
        }
        v
    }

    fn handle(&mut self, event: WorkerEvent, mem: &M, queues: Queues<'_, '_>) -> Handled {
        let [rx, tx] = queues else {
            return Err(WorkerError::Broken(format!(
                "a pair worker needs 2 queues, got {}",
                queues.len()
            )));
        };
        // The transport delivers events only once both rings are set up and enabled, and
        // drops those that come earlier (an RX kick while the TX ring is not ready yet, or the
        // backend's edge-triggered fd). So the first event of a worker, and the first after
        // its rings were disabled, serves both directions whatever it was.
        let resumed = self.ring_steered && !self.receiving;
        if resumed {
            self.set_receiving(true);
        }
        let catch_up = resumed || !self.served;
        self.served = true;
        let mut sig = Signal::NONE;
        match event {
            WorkerEvent::Kick(RX) | WorkerEvent::Fd(TOKEN_BACKEND) => {
                self.process_rx(mem, rx, &mut sig)?
            }
            WorkerEvent::Kick(TX) => self.process_tx(mem, tx, &mut sig)?,
            WorkerEvent::Fd(TOKEN_SHAPER) if self.shaper.is_some() => {
                if let Some(s) = self.shaper.as_mut() {
                    s.on_timer();
                }
                self.process_tx(mem, tx, &mut sig)?;
                self.process_rx(mem, rx, &mut sig)?;
            }
            other => return Err(WorkerError::UnexpectedEvent(other)),
        }
        if catch_up {
            match event {
                WorkerEvent::Kick(TX) => self.process_rx(mem, rx, &mut sig)?,
                WorkerEvent::Kick(RX) | WorkerEvent::Fd(TOKEN_BACKEND) => {
                    self.process_tx(mem, tx, &mut sig)?
                }
                _ => {}
            }
        }
        Ok(sig)
    }

    fn queues_disabled(&mut self) {
        if self.ring_steered && self.receiving {
            self.set_receiving(false);
        }
    }

    fn stats(&self) -> serde_json::Value {
        serde_json::json!({
            "pair": self.pair,
            "rx_pending": self.rx_pending.is_some(),
            "rx_held_chains": self.rx_held.len(),
            "rx_frames": self.pair_rx_frames,
            "tx_chains": self.pair_tx_chains,
            "ring_steered": self.ring_steered,
            "receiving": if self.ring_steered { serde_json::json!(self.receiving) } else { serde_json::Value::Null },
        })
    }
}
