//! The virtio-blk device: features, configuration space, lifecycle, and the per-queue
//! workers.

use std::sync::Arc;

use bounce::{Dma, DmaBuffer};
use serde_json::json;
use virtio_queue::Queue;
use vm_memory::GuestMemory;

use super::io::Disk;
use super::metrics::BlockMetrics;
use super::request::{DiskParams, RequestCtx, MAX_DISCARD_SEGS};
use super::{features as blk, BlockConfig, BlockError, CONFIG_SPACE_LEN, ID_BYTES, SECTOR_SHIFT};
use crate::virtio::chain::Chain;
use crate::virtio::queue::{self, Step};
use crate::virtio::{
    device_type, features as vf, ActivateError, QueueWorker, Signal, VirtioDevice, WorkerError,
    WorkerEvent,
};

/// `max_discard_sectors` and `max_write_zeroes_sectors`: 2 GiB - 512 per segment (QEMU's
/// `BDRV_REQUEST_MAX_SECTORS`), well inside a u32 and inside `off_t` arithmetic.
pub const MAX_DISCARD_SECTORS: u32 = (i32::MAX as u32) >> SECTOR_SHIFT;
/// `size_max` when the device has no bounce pool.
pub const DIRECT_SIZE_MAX: u32 = 4 << 20;

/// Lifecycle of a device (Firecracker's `DeviceState`).
#[derive(Debug)]
enum DeviceState {
    Inactive,
    Activated { acked_features: u64, queues: u16 },
}

/// A virtio-blk device over a [`Disk`].
#[derive(Debug)]
pub struct Block<D: Disk> {
    disk: Arc<D>,
    config: BlockConfig,
    dma: Dma,
    avail_features: u64,
    state: DeviceState,
    metrics: Arc<BlockMetrics>,
    /// Largest single DMA mapping (the pool's, for a device without an alignment mask).
    max_map: usize,
    config_write_logged: crate::metrics::LogOnce,
}

impl<D: Disk> Block<D> {
    /// A device serving `disk` with `config`, whose every buffer goes through `dma`.
    ///
    /// # Errors
    /// [`BlockError::Config`] for a configuration [`BlockConfig::validate`] refuses, or a
    /// disk of less than one sector.
    pub fn new(disk: D, config: BlockConfig, dma: Dma) -> Result<Self, BlockError> {
        config.validate().map_err(BlockError::Config)?;
        if disk.capacity() >> SECTOR_SHIFT == 0 {
            return Err(BlockError::Config(
                "the disk is smaller than one sector".into(),
            ));
        }
        let mut f = vf::VERSION_1
            | vf::RING_EVENT_IDX
            | vf::RING_INDIRECT_DESC
            | blk::SIZE_MAX
            | blk::SEG_MAX
            | blk::BLK_SIZE
            | blk::FLUSH;
        if config.access_platform {
            f |= vf::ACCESS_PLATFORM;
        }
        if config.readonly {
            f |= blk::RO;
        }
        if config.num_queues > 1 {
            f |= blk::MQ;
        }
        if config.discard {
            f |= blk::DISCARD | blk::WRITE_ZEROES;
        }
        // size_max: the largest mapping the DMA handle can make for this device's constraints
        // (its alignment mask included), so no request piece is ever too large to map.
        let max_map = dma
            .max_mapping_size()
            .unwrap_or(DIRECT_SIZE_MAX as usize)
            .clamp(4096, DIRECT_SIZE_MAX as usize);
        Ok(Self {
            disk: Arc::new(disk),
            config,
            dma,
            avail_features: f,
            state: DeviceState::Inactive,
            metrics: Arc::new(BlockMetrics::default()),
            max_map,
            config_write_logged: crate::metrics::LogOnce::default(),
        })
    }

    /// The disk.
    pub fn disk(&self) -> &Arc<D> {
        &self.disk
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<BlockMetrics> {
        &self.metrics
    }

    /// The DMA handle.
    pub fn dma(&self) -> &Dma {
        &self.dma
    }

    /// Capacity in sectors.
    pub fn capacity(&self) -> u64 {
        self.disk.capacity() >> SECTOR_SHIFT
    }

    /// The features acknowledged at activation, while active.
    pub fn acked_features(&self) -> Option<u64> {
        match self.state {
            DeviceState::Activated { acked_features, .. } => Some(acked_features),
            DeviceState::Inactive => None,
        }
    }

    /// The configuration space (virtio 1.2, 5.2.4), little endian.
    pub fn config_space(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut c = [0u8; CONFIG_SPACE_LEN];
        let mut put = |off: usize, bytes: &[u8]| c[off..off + bytes.len()].copy_from_slice(bytes);
        put(0, &self.capacity().to_le_bytes());
        // size_max <= DIRECT_SIZE_MAX fits a u32.
        put(
            8,
            &u32::try_from(self.max_map)
                .unwrap_or(DIRECT_SIZE_MAX)
                .to_le_bytes(),
        );
        put(12, &self.seg_max().to_le_bytes());
        // 16..20: geometry (not offered).
        put(20, &self.config.blk_size.to_le_bytes());
        // 24..32: topology (not offered); 32: writeback (CONFIG_WCE not offered).
        put(34, &self.config.num_queues.to_le_bytes());
        put(36, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(40, &(MAX_DISCARD_SEGS as u32).to_le_bytes());
        put(44, &(self.config.blk_size >> SECTOR_SHIFT).to_le_bytes());
        put(48, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(52, &(MAX_DISCARD_SEGS as u32).to_le_bytes());
        put(56, &[1]);
        c
    }

    /// `seg_max`: the queue size less the header and status descriptors, as QEMU does.
    pub fn seg_max(&self) -> u32 {
        u32::from(self.config.queue_size) - 2
    }

    fn params(&self, acked: u64) -> DiskParams {
        let mut serial = [0u8; ID_BYTES];
        let s = self.config.serial.as_bytes();
        let n = s.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&s[..n]);
        DiskParams {
            capacity: self.capacity(),
            readonly: self.config.readonly,
            writeback: acked & blk::FLUSH != 0,
            discard: acked & blk::DISCARD != 0,
            write_zeroes: acked & blk::WRITE_ZEROES != 0,
            may_unmap: true,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_discard_seg: MAX_DISCARD_SEGS as u32,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_seg: MAX_DISCARD_SEGS as u32,
            serial,
            indirect: acked & vf::RING_INDIRECT_DESC != 0,
            max_indirect: self.config.queue_size,
        }
    }
}

impl<M: GuestMemory, D: Disk> VirtioDevice<M> for Block<D> {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn num_queues(&self) -> usize {
        usize::from(self.config.num_queues)
    }

    fn queue_max_size(&self) -> u16 {
        self.config.queue_size
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config_space();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| usize::try_from(o).ok())
                .and_then(|o| c.get(o).copied())
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // A driver can do this in a loop: counted always, logged once.
        self.metrics.config_write_rejected.inc();
        if self.config_write_logged.first() {
            tracing::warn!(
                "virtio-blk: driver wrote {} bytes at config offset {offset}: ignored (read-only; logged once)",
                data.len()
            );
        }
    }

    fn activate(
        &mut self,
        acked_features: u64,
    ) -> Result<Vec<Box<dyn QueueWorker<M>>>, ActivateError> {
        if matches!(self.state, DeviceState::Activated { .. }) {
            return Err(ActivateError::AlreadyActive);
        }
        let acked = acked_features & self.avail_features;
        if acked & vf::VERSION_1 == 0 {
            return Err(ActivateError::Features(
                "VERSION_1 not acknowledged (legacy drivers are not supported)".into(),
            ));
        }
        let queues = if acked & blk::MQ != 0 {
            self.config.num_queues
        } else {
            1
        };
        let params = Arc::new(self.params(acked));
        let workers = (0..queues)
            .map(|q| {
                Box::new(BlockWorker {
                    queue_index: q,
                    disk: Arc::clone(&self.disk),
                    dma: self.dma.clone(),
                    params: Arc::clone(&params),
                    metrics: Arc::clone(&self.metrics),
                    max_map: self.max_map,
                    chain: Chain::default(),
                    mapped: Vec::new(),
                }) as Box<dyn QueueWorker<M>>
            })
            .collect();
        self.state = DeviceState::Activated {
            acked_features: acked,
            queues,
        };
        Ok(workers)
    }

    fn reset(&mut self) {
        self.state = DeviceState::Inactive;
    }

    fn stats(&self) -> serde_json::Value {
        let (acked, queues) = match self.state {
            DeviceState::Activated {
                acked_features,
                queues,
            } => (Some(acked_features), queues),
            DeviceState::Inactive => (None, 0),
        };
        json!({
            "type": "block",
            "disk": self.disk.kind(),
            "capacity_sectors": self.capacity(),
            "readonly": self.config.readonly,
            "policy": self.dma.policy().to_string(),
            "acked_features": acked,
            "active_queues": queues,
            "metrics": &*self.metrics,
            "bounce": self.dma.stats(),
        })
    }
}

/// Serves one request queue. Requests complete synchronously inside [`QueueWorker::handle`],
/// through the shared queue-service loop ([`queue::drain`]): each popped head gets exactly one
/// used entry before the next is popped.
#[derive(Debug)]
pub struct BlockWorker<D: Disk> {
    queue_index: u16,
    disk: Arc<D>,
    dma: Dma,
    params: Arc<DiskParams>,
    metrics: Arc<BlockMetrics>,
    max_map: usize,
    chain: Chain,
    mapped: Vec<DmaBuffer>,
}

impl<M: GuestMemory, D: Disk> QueueWorker<M> for BlockWorker<D> {
    fn queue_indexes(&self) -> Vec<u16> {
        vec![self.queue_index]
    }

    fn handle(
        &mut self,
        event: WorkerEvent,
        mem: &M,
        queues: &mut [&mut Queue],
    ) -> Result<Signal, WorkerError> {
        let (WorkerEvent::Kick(0), [queue]) = (event, queues) else {
            return Err(WorkerError::UnexpectedEvent(event));
        };
        let mut ctx = RequestCtx {
            disk: &*self.disk,
            dma: &self.dma,
            params: &self.params,
            metrics: &self.metrics,
            worker: usize::from(self.queue_index),
            max_map: self.max_map,
            mapped: &mut self.mapped,
        };
        let chain = &mut self.chain;
        let drained = queue::drain(queue, mem, |at| match ctx.serve(mem, &at, chain) {
            Ok(c) => Ok(Step::Used(c.used_len)),
            Err(e) => Err(WorkerError::Broken(format!(
                "virtio-blk: head {}: {e}",
                at.head
            ))),
        });
        let drained = drained.map_err(|e| match e {
            WorkerError::Broken(why) if !why.starts_with("virtio-blk") => {
                WorkerError::Broken(format!("virtio-blk: {why}"))
            }
            e => e,
        })?;
        self.metrics.drains.add(drained.passes as u64);
        self.metrics
            .queue_depth_hiwater
            .max(u64::from(drained.deepest));
        let mut signal = Signal::NONE;
        if drained.used > 0 {
            queue::notify(queue, mem, 0, &mut signal)?;
        }
        Ok(signal)
    }

    fn stats(&self) -> serde_json::Value {
        json!({ "queue": self.queue_index })
    }
}
