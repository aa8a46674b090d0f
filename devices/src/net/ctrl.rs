//! The control-queue worker (virtio 1.2, 5.1.6.5).
//!
//! A command is `{class: u8, command: u8, data[]}` in device-readable descriptors followed by
//! an `ack: u8` in a device-writable one. What is answered:
//! - `VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET` (MQ acked, 1..=max pairs): OK, and the tap queues of
//!   the pairs beyond the new count are detached so the kernel steers nothing to them;
//! - RX mode (`VIRTIO_NET_CTRL_RX_*`) and `VIRTIO_NET_CTRL_MAC_TABLE_SET`: OK and ignored (a
//!   tap bridge sees all traffic anyway);
//! - everything else (VLAN, announce, MAC address set, guest offloads, RSS, unknown): ERR, as
//!   the features they need were not offered.
//!
//! Command bytes and the ack go through the [`Dma`] handle like any data buffer.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use bounce::Dma;
use vm_memory::GuestMemory;

use super::metrics::NetMetrics;
use super::worker::{lock, walk_rules, SharedBackend};
use crate::virtio::chain::{self, Chain, ChainHead, WalkRules};
use crate::virtio::queue::{self, Step};
use crate::virtio::spec::{
    feature, VIRTIO_NET_CTRL_MAC, VIRTIO_NET_CTRL_MAC_TABLE_SET, VIRTIO_NET_CTRL_MQ,
    VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, VIRTIO_NET_CTRL_RX, VIRTIO_NET_ERR, VIRTIO_NET_F_MQ,
    VIRTIO_NET_OK,
};
use crate::virtio::{Handled, QueueWorker, Queues, Signal, WorkerError, WorkerEvent};

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
    rules: WalkRules,
    chain: Chain,
    cmd: Vec<u8>,
    _mem: std::marker::PhantomData<fn(&M)>,
}

impl<M: GuestMemory> CtrlWorker<M> {
    // Takes the fields the struct keeps; a constructor, nothing to share.
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
            rules: walk_rules(acked),
            chain: Chain::default(),
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
            (VIRTIO_NET_CTRL_RX, 0..=5) if data.len() == 1 => VIRTIO_NET_OK,
            (VIRTIO_NET_CTRL_MAC, VIRTIO_NET_CTRL_MAC_TABLE_SET) => VIRTIO_NET_OK,
            (VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET)
                if self.acked & feature(VIRTIO_NET_F_MQ) != 0 =>
            {
                let Ok(b) = <[u8; 2]>::try_from(data) else {
                    return VIRTIO_NET_ERR;
                };
                let n = u16::from_le_bytes(b);
                if n == 0 || usize::from(n) > self.backends.len() {
                    return VIRTIO_NET_ERR;
                }
                for (i, b) in self.backends.iter().enumerate() {
                    if let Err(e) = lock(b).set_enabled(i < usize::from(n)) {
                        tracing::warn!("queue pair {i}: {e}");
                        return VIRTIO_NET_ERR;
                    }
                }
                self.active_pairs.store(n, Ordering::Relaxed);
                VIRTIO_NET_OK
            }
            _ => {
                tracing::debug!(class, cmd, "unsupported control command");
                VIRTIO_NET_ERR
            }
        }
    }

    /// Reads, executes and acks one command chain: device-readable buffers (the command,
    /// at most `MAX_CMD` bytes) then device-writable ones (the ack). Returns the used length
    /// (1 when the ack was written, 0 for a chain the guest got wrong).
    fn one(&mut self, mem: &M, at: &ChainHead) -> u32 {
        let wid = self.worker_id();
        if let Err(e) = at.walk(mem, &self.rules, &mut self.chain) {
            tracing::debug!("control chain refused: {e}");
            return self.bad();
        }
        let c = &self.chain;
        let total = c.readable_len;
        if !(2..=MAX_CMD as u64).contains(&total) || c.writable.is_empty() {
            return self.bad();
        }
        self.cmd.clear();
        // total <= MAX_CMD.
        self.cmd.resize(total as usize, 0);
        if chain::copy_from(&self.dma, mem, wid, &c.readable, 0, &mut self.cmd).is_err() {
            return self.bad();
        }
        let ack = self.execute(self.cmd[0], self.cmd[1], &self.cmd[2..]);
        if chain::copy_to(&self.dma, mem, wid, &c.writable, 0, &[ack]).is_err() {
            return self.bad();
        }
        if ack == VIRTIO_NET_OK {
            self.metrics.ctrl_ok.inc();
        } else {
            self.metrics.ctrl_err.inc();
        }
        1
    }

    fn bad(&self) -> u32 {
        self.metrics.ctrl_bad_chains.note(
            "net.ctrl_bad_chains",
            "virtio-net: a control chain the guest got wrong, completed with length 0",
        );
        0
    }
}

impl<M: GuestMemory> QueueWorker<M> for CtrlWorker<M> {
    fn queue_indexes(&self) -> Vec<u16> {
        vec![self.index]
    }

    fn handle(&mut self, event: WorkerEvent, mem: &M, queues: Queues<'_, '_>) -> Handled {
        let (WorkerEvent::Kick(0), [q]) = (event, queues) else {
            return Err(WorkerError::UnexpectedEvent(event));
        };
        let drained = queue::drain(q, mem, |at| Ok(Step::Used(self.one(mem, &at))))?;
        let mut sig = Signal::NONE;
        if drained.used > 0 {
            queue::notify(q, mem, 0, &mut sig)?;
        }
        Ok(sig)
    }
}
