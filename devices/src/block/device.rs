//! The virtio-blk device: features, configuration space, lifecycle; activation hands each
//! queue to a [`BlockWorker`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bounce::Dma;
use serde_json::json;
use vm_memory::GuestMemory;

use super::inflight::SlotWaiters;
use super::io::{new_engine, Disk, EngineStats, FixedRegion};
use super::metrics::BlockMetrics;
use super::request::{DiskParams, RequestCtx, MAX_DISCARD_SEGS};
use super::worker::BlockWorker;
use super::{BlockConfig, BlockError, CONFIG_SPACE_LEN, ID_BYTES, SECTOR_SHIFT};
use crate::virtio::spec::{
    feature, virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE,
    VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO,
    VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_F_VERSION_1,
    VIRTIO_ID_BLOCK, VIRTIO_RING_F_INDIRECT_DESC,
};
use crate::virtio::{
    common_features, read_config_window, ActivateError, QueueWorker, VirtioDevice,
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
    /// The write cache the guest sees (config `writeback`): starts as the cache mode says,
    /// set by the driver through CONFIG_WCE, or by FLUSH negotiation without it (QEMU's
    /// rules); read by the workers for each request.
    write_cache: Arc<AtomicBool>,
    /// The engines of the active workers, for the statistics.
    engines: Vec<Arc<EngineStats>>,
    /// The `aio=` name of those engines.
    engine_name: &'static str,
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
        let mut f = common_features(config.access_platform)
            | feature(VIRTIO_BLK_F_SIZE_MAX)
            | feature(VIRTIO_BLK_F_SEG_MAX)
            | feature(VIRTIO_BLK_F_BLK_SIZE)
            | feature(VIRTIO_BLK_F_FLUSH)
            | feature(VIRTIO_BLK_F_CONFIG_WCE);
        if config.readonly {
            f |= feature(VIRTIO_BLK_F_RO);
        }
        if config.num_queues > 1 {
            f |= feature(VIRTIO_BLK_F_MQ);
        }
        if config.discard {
            f |= feature(VIRTIO_BLK_F_DISCARD) | feature(VIRTIO_BLK_F_WRITE_ZEROES);
        }
        let disk = Arc::new(disk);
        // Refuse an engine that cannot work here (aio=io_uring on qcow2 or on a kernel
        // without io_uring) now, with its reason, rather than at activation.
        let probe = new_engine(config.aio, &disk, 8, None)
            .map_err(|e| BlockError::Config(e.to_string()))?;
        let engine_name = probe.name();
        drop(probe);
        let write_cache = Arc::new(AtomicBool::new(config.cache.write_cache()));
        // size_max: the largest mapping the DMA handle can make for this device's constraints
        // (its alignment mask included), so no request piece is ever too large to map.
        let max_map = dma
            .max_mapping_size()
            .unwrap_or(DIRECT_SIZE_MAX as usize)
            .clamp(4096, DIRECT_SIZE_MAX as usize);
        Ok(Self {
            disk,
            write_cache,
            engines: Vec::new(),
            engine_name,
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
        // 24..32: topology (not offered); 32: writeback (CONFIG_WCE).
        put(32, &[u8::from(self.write_cache.load(Ordering::Relaxed))]);
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
            no_flush: self.config.cache.no_flush(),
            discard: acked & feature(VIRTIO_BLK_F_DISCARD) != 0,
            write_zeroes: acked & feature(VIRTIO_BLK_F_WRITE_ZEROES) != 0,
            may_unmap: true,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_discard_seg: MAX_DISCARD_SEGS as u32,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_seg: MAX_DISCARD_SEGS as u32,
            serial,
            indirect: acked & feature(VIRTIO_RING_F_INDIRECT_DESC) != 0,
            max_indirect: self.config.queue_size,
        }
    }
}

/// Offset of `writeback` (`wce`) in the configuration space.
const WRITEBACK_OFFSET: u64 = std::mem::offset_of!(virtio_blk_config, wce) as u64;

impl<D: Disk> Block<D> {
    /// The engines' counters, summed over the queues.
    fn engine_stats(&self) -> serde_json::Value {
        let sum = |f: fn(&EngineStats) -> &std::sync::atomic::AtomicU64| -> u64 {
            self.engines
                .iter()
                .map(|e| f(e).load(Ordering::Relaxed))
                .sum()
        };
        json!({
            "aio": self.engine_name,
            "cache": self.config.cache.name(),
            "write_cache": self.write_cache.load(Ordering::Relaxed),
            "on_full": self.config.on_full.name(),
            "submitted": sum(|e| &e.submitted),
            "completed": sum(|e| &e.completed),
            "submit_calls": sum(|e| &e.submit_calls),
            "dio_bounced": sum(|e| &e.dio_bounced),
            "resubmitted": sum(|e| &e.resubmitted),
            "fixed_regions": sum(|e| &e.fixed_regions),
            "fixed_ops": sum(|e| &e.fixed_ops),
            "in_flight_hiwater": self
                .engines
                .iter()
                .map(|e| e.in_flight_hiwater.load(Ordering::Relaxed))
                .max()
                .unwrap_or(0),
        })
    }
}

impl<M, D> VirtioDevice<M> for Block<D>
where
    M: GuestMemory + Clone + Send + Sync + 'static,
    D: Disk,
{
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
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
        read_config_window(&self.config_space(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        if offset == WRITEBACK_OFFSET && data.len() == 1 {
            // The one writable field (virtio 1.2, 5.2.5: with CONFIG_WCE the driver sets the
            // cache mode). Honoured at once by every worker, as QEMU's
            // blk_set_enable_write_cache.
            self.write_cache.store(data[0] != 0, Ordering::Relaxed);
            self.metrics.config_wce_writes.inc();
            return;
        }
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
        if acked & feature(VIRTIO_F_VERSION_1) == 0 {
            return Err(ActivateError::Features(
                "VERSION_1 not acknowledged (legacy drivers are not supported)".into(),
            ));
        }
        let queues = if acked & feature(VIRTIO_BLK_F_MQ) != 0 {
            self.config.num_queues
        } else {
            1
        };
        if acked & feature(VIRTIO_BLK_F_CONFIG_WCE) == 0 {
            // A driver that cannot read `writeback` gets the write cache it negotiated FLUSH
            // for (QEMU's virtio_blk_set_status).
            self.write_cache
                .store(acked & feature(VIRTIO_BLK_F_FLUSH) != 0, Ordering::Relaxed);
        }
        let params = Arc::new(self.params(acked));
        let mut workers: Vec<Box<dyn QueueWorker<M>>> = Vec::new();
        self.engines.clear();
        // The bounce pool, registered by each queue's io_uring engine (one pinning for the
        // device's life instead of one per request).
        let fixed = FixedRegion::of_dma(&self.dma);
        let waiters = Arc::new(SlotWaiters::default());
        for q in 0..queues {
            let engine = new_engine(
                self.config.aio,
                &self.disk,
                self.config.queue_size,
                fixed.as_ref(),
            )
            .map_err(|e| ActivateError::Backend(format!("queue {q}: {e}")))?;
            self.engine_name = engine.name();
            self.engines.push(Arc::clone(engine.stats()));
            let ctx = RequestCtx {
                dma: self.dma.clone(),
                params: Arc::clone(&params),
                metrics: Arc::clone(&self.metrics),
                worker: usize::from(q),
                max_map: self.max_map,
                write_cache: Arc::clone(&self.write_cache),
            };
            workers.push(Box::new(BlockWorker::new(
                q,
                ctx,
                engine,
                self.config.on_full,
                self.config.give_up_after,
                Arc::clone(&waiters),
            )));
        }
        self.state = DeviceState::Activated {
            acked_features: acked,
            queues,
        };
        Ok(workers)
    }

    fn reset(&mut self) {
        self.state = DeviceState::Inactive;
        self.write_cache
            .store(self.config.cache.write_cache(), Ordering::Relaxed);
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
            "engine": self.engine_stats(),
            "bounce": crate::pools::bounce_json(&self.dma),
            "dma": crate::pools::dma_json(&self.dma),
        })
    }
}
