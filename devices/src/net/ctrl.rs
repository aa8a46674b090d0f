//! The control-queue worker (virtio 1.2, 5.1.6.5).
//!
//! A command is `{class: u8, command: u8, data[]}` in device-readable descriptors followed by
//! an `ack: u8` in a device-writable one. What is answered:
//! - `VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET` (MQ acked, 1..=max pairs): OK, and the tap queues of
//!   the pairs beyond the new count are detached so the kernel steers nothing to them;
//! - RX mode (`VIRTIO_NET_CTRL_RX_*`) and `MAC_TABLE_SET`: OK and ignored (a tap bridge sees
//!   all traffic anyway);
//! - everything else (VLAN, announce, MAC address set, guest offloads, RSS, unknown): ERR, as
//!   the features they need were not offered.
//!
//! Command bytes and the ack go through the [`Dma`] handle like any data buffer.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use bounce::{Direction, Dma};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestMemory, Permissions};

use super::features;
use super::metrics::NetMetrics;
use super::worker::{lock, queue_depth, SharedBackend};
use crate::virtio::{QueueWorker, Signal, WorkerError, WorkerEvent};

/// Class: receive filtering.
pub const CLASS_RX: u8 = 0;
/// Class: MAC filtering.
pub const CLASS_MAC: u8 = 1;
/// Class: multiqueue.
pub const CLASS_MQ: u8 = 4;
/// MAC command: set the filter table.
pub const MAC_TABLE_SET: u8 = 0;
/// MQ command: set the number of queue pairs.
pub const MQ_VQ_PAIRS_SET: u8 = 0;
/// Ack: success.
pub const OK: u8 = 0;
/// Ack: failure.
pub const ERR: u8 = 1;

/// Largest command accepted (a MAC table of 4096 entries); larger ones get ERR.
const MAX_CMD: usize = 2 + 2 * (4 + 6 * 4096);

/// Serves the control queue.
#[derive(Debug)]
pub struct CtrlWorker<M> {
    index: u16,
    acked: u64,
    backends: Vec<SharedBackend>,
    active_pairs: Arc<AtomicU16>,
    dma: Dma,
    metrics: Arc<NetMetrics>,
    descs: Vec<(u64, u32)>,
    wdescs: Vec<(u64, u32)>,
    cmd: Vec<u8>,
    _mem: std::marker::PhantomData<fn(&M)>,
}

impl<M: GuestMemory> CtrlWorker<M> {
    /// A worker for control queue `index`; `backends` are the queue pairs' backends, whose
    /// receive steering `VQ_PAIRS_SET` switches; `active_pairs` is shared with the device.
    pub fn new(
        index: u16,
        acked: u64,
        backends: Vec<SharedBackend>,
        active_pairs: Arc<AtomicU16>,
        dma: Dma,
        metrics: Arc<NetMetrics>,
    ) -> Self {
        Self {
            index,
            acked,
            backends,
            active_pairs,
            dma,
            metrics,
            descs: Vec::new(),
            wdescs: Vec::new(),
            cmd: Vec::new(),
            _mem: std::marker::PhantomData,
        }
    }

    /// The bounce worker id of the control queue: after the pairs'.
    fn worker_id(&self) -> usize {
        self.backends.len()
    }

    fn execute(&self, class: u8, cmd: u8, data: &[u8]) -> u8 {
        match (class, cmd) {
            (CLASS_RX, 0..=5) if data.len() == 1 => OK,
            (CLASS_MAC, MAC_TABLE_SET) => OK,
            (CLASS_MQ, MQ_VQ_PAIRS_SET) if self.acked & features::MQ != 0 => {
                let Ok(b) = <[u8; 2]>::try_from(data) else {
                    return ERR;
                };
                let n = u16::from_le_bytes(b);
                if n == 0 || usize::from(n) > self.backends.len() {
                    return ERR;
                }
                for (i, b) in self.backends.iter().enumerate() {
                    if let Err(e) = lock(b).set_enabled(i < usize::from(n)) {
                        tracing::warn!("queue pair {i}: {e}");
                        return ERR;
                    }
                }
                self.active_pairs.store(n, Ordering::Relaxed);
                OK
            }
            _ => {
                tracing::debug!(class, cmd, "unsupported control command");
                ERR
            }
        }
    }

    /// Walks a command chain: device-readable descriptors (the command, at most
    /// `MAX_CMD` bytes) then device-writable ones (the ack), all inside guest memory, not
    /// truncated (see [`super::worker::collect_chain`]). Zero-length descriptors are skipped.
    fn walk<I>(mem: &M, chain: I, r: &mut Vec<(u64, u32)>, w: &mut Vec<(u64, u32)>) -> Option<usize>
    where
        I: Iterator<Item = virtio_queue::desc::split::Descriptor>,
    {
        r.clear();
        w.clear();
        let mut total = 0usize;
        let mut last_has_next = false;
        for d in chain {
            last_has_next = d.has_next();
            let len = usize::try_from(d.len()).ok()?;
            if len == 0 {
                continue;
            }
            let perm = if d.is_write_only() {
                Permissions::Write
            } else {
                Permissions::Read
            };
            if !mem.check_range(d.addr(), len, perm) {
                return None;
            }
            if d.is_write_only() {
                w.push((d.addr().0, d.len()));
            } else {
                if !w.is_empty() {
                    // Readable after writable (virtio 1.2 2.7.4.2 forbids it).
                    return None;
                }
                total = total.checked_add(len).filter(|t| *t <= MAX_CMD)?;
                r.push((d.addr().0, d.len()));
            }
        }
        (!last_has_next).then_some(total)
    }

    /// Reads, executes and acks one command chain. Returns the used length (1 when the ack
    /// was written, 0 for a chain the guest got wrong).
    fn one<I>(&mut self, mem: &M, chain: I) -> u32
    where
        I: Iterator<Item = virtio_queue::desc::split::Descriptor>,
    {
        let wid = self.worker_id();
        let mut wdescs = std::mem::take(&mut self.wdescs);
        let walked = Self::walk(mem, chain, &mut self.descs, &mut wdescs);
        let res = self.run(mem, walked, &wdescs, wid);
        self.wdescs = wdescs;
        res
    }

    fn run(&mut self, mem: &M, walked: Option<usize>, wdescs: &[(u64, u32)], wid: usize) -> u32 {
        let Some(total) = walked else {
            return self.bad();
        };
        if total < 2 || wdescs.is_empty() {
            return self.bad();
        }
        self.cmd.clear();
        self.cmd.resize(total, 0);
        let mut off = 0;
        for &(addr, len) in &self.descs {
            let len = len as usize;
            let r = self
                .dma
                .map(mem, addr, len, Direction::ToDevice, wid)
                .and_then(|b| {
                    let r = self.dma.read(mem, &b, 0, &mut self.cmd[off..off + len]);
                    r.and(self.dma.unmap(mem, b, wid))
                });
            if r.is_err() {
                return self.bad();
            }
            off += len;
        }
        let ack = self.execute(self.cmd[0], self.cmd[1], &self.cmd[2..]);
        let (addr, _) = wdescs[0];
        let r = self
            .dma
            .map(mem, addr, 1, Direction::FromDevice, wid)
            .and_then(|b| {
                let w = self.dma.write(mem, &b, 0, &[ack]);
                w.and(self.dma.unmap(mem, b, wid))
            });
        if r.is_err() {
            return self.bad();
        }
        if ack == OK {
            self.metrics.ctrl_ok.inc();
        } else {
            self.metrics.ctrl_err.inc();
        }
        1
    }

    fn bad(&self) -> u32 {
        self.metrics.ctrl_bad_chains.inc();
        0
    }
}

impl<M: GuestMemory> QueueWorker<M> for CtrlWorker<M> {
    fn queue_indexes(&self) -> Vec<u16> {
        vec![self.index]
    }

    fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        Vec::new()
    }

    fn handle(
        &mut self,
        event: WorkerEvent,
        mem: &M,
        queues: &mut [&mut Queue],
    ) -> Result<Signal, WorkerError> {
        let (WorkerEvent::Kick(0), [q]) = (event, queues) else {
            return Err(WorkerError::UnexpectedEvent(event));
        };
        let mut used = false;
        loop {
            if queue_depth(q, mem)? == 0 {
                if q.enable_notification(mem)
                    .map_err(|e| WorkerError::Broken(format!("ctrl notification: {e}")))?
                {
                    continue;
                }
                break;
            }
            q.disable_notification(mem)
                .map_err(|e| WorkerError::Broken(format!("ctrl notification: {e}")))?;
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let len = self.one(mem, chain);
            q.add_used(mem, head, len)
                .map_err(|e| WorkerError::Broken(format!("used ring: {e}")))?;
            used = true;
        }
        let mut sig = Signal::NONE;
        if used
            && q.needs_notification(mem)
                .map_err(|e| WorkerError::Broken(format!("used event: {e}")))?
        {
            sig.add(0);
        }
        Ok(sig)
    }
}
