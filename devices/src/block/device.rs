//! The virtio-blk device: features, configuration space, lifecycle, and the per-queue
//! workers.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bounce::{Dma, DmaBuffer};
use serde_json::json;
use virtio_queue::Queue;
use vm_memory::GuestMemory;

use super::inflight::{MemPin, RetryTimer, Slab};
use super::io::{new_engine, Disk, EngineStats, FixedRegion, IoDone, IoEngine, OnFull};
use super::metrics::BlockMetrics;
use super::request::{DiskParams, Pending, RequestCtx, Started, MAX_DISCARD_SEGS};
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
    /// The write cache the guest sees (config `writeback`): starts as the cache mode says,
    /// set by the driver through CONFIG_WCE, or by FLUSH negotiation without it (QEMU's
    /// rules); read by the workers for each request.
    write_cache: Arc<AtomicBool>,
    /// The engines of the active workers, for the statistics.
    engines: Vec<Arc<EngineStats>>,
    /// The `aio=` name of those engines.
    engine_name: &'static str,
}

/// Worker fd token of the engine's completion eventfd.
pub const ENGINE_TOKEN: u32 = 0;
/// Worker fd token of the retry timer (a queue waiting for bounce slots).
pub const RETRY_TOKEN: u32 = 1;

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
            | blk::FLUSH
            | blk::CONFIG_WCE;
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

/// Offset of `writeback` in the configuration space.
const WRITEBACK_OFFSET: u64 = 32;

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
        if acked & blk::CONFIG_WCE == 0 {
            // A driver that cannot read `writeback` gets the write cache it negotiated FLUSH
            // for (QEMU's virtio_blk_set_status).
            self.write_cache
                .store(acked & blk::FLUSH != 0, Ordering::Relaxed);
        }
        let params = Arc::new(self.params(acked));
        let mut workers: Vec<Box<dyn QueueWorker<M>>> = Vec::new();
        self.engines.clear();
        // The bounce pool, registered by each queue's io_uring engine (one pinning for the
        // device's life instead of one per request).
        let fixed = FixedRegion::of_dma(&self.dma);
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
            workers.push(Box::new(BlockWorker {
                queue_index: q,
                dma: self.dma.clone(),
                params: Arc::clone(&params),
                metrics: Arc::clone(&self.metrics),
                max_map: self.max_map,
                chain: Chain::default(),
                mapped: Vec::new(),
                engine,
                pending: Slab::default(),
                mem: MemPin::default(),
                done: Vec::new(),
                write_cache: Arc::clone(&self.write_cache),
                on_full: self.config.on_full,
                deferred: false,
                retry: RetryTimer::new(),
            }) as Box<dyn QueueWorker<M>>);
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
            "bounce": self.dma.stats(),
        })
    }
}

/// A request whose host I/O is in flight.
#[derive(Debug)]
struct InFlight<M: GuestMemory> {
    head: u16,
    req: Pending,
    /// The guest memory its buffers point into, kept mapped until it completes.
    mem: Arc<M>,
}

/// When a drain pass hands its prepared requests to the kernel: after the 1st, 2nd, 4th,
/// 8th, ... request of the pass, and the rest at its end.
///
/// One submission per pass made a burst a convoy: a driver that refills the ring a whole
/// completion batch at a time and a disk that completes in batches lock into step, and every
/// request of the burst waited until the last one was mapped before any reached the disk, so
/// the device's own time per burst was added whole to each cycle (with 32 in flight, every
/// request was submitted 32 at a time). Handing over the first request at once starts the
/// disk while the rest are mapped; doubling keeps a burst of n to about log2(n) + 1 system
/// calls.
#[derive(Debug, Default)]
struct KickPacer {
    /// Requests prepared since the last hand-over.
    waiting: usize,
    /// Requests handed over in this pass.
    handed: usize,
}

impl KickPacer {
    /// One more request prepared; true when the engine should be kicked now.
    fn prepared(&mut self) -> bool {
        self.waiting += 1;
        if self.waiting < self.handed.max(1) {
            return false;
        }
        self.handed += self.waiting;
        self.waiting = 0;
        true
    }
}

/// Serves one request queue through the shared queue-service loop ([`queue::drain`]) and an
/// [`IoEngine`]: a kick pops chains, maps them and submits their I/O (up to the queue size in
/// flight); the engine's eventfd brings completions, which are unmapped, given their status
/// and put on the used ring in completion order, one notification per batch. A request that
/// finds the bounce pool full stays on the ring (`on-full=wait`) until completions release
/// slots, or the retry timer fires when none of this queue's requests is in flight.
#[derive(Debug)]
pub struct BlockWorker<M: GuestMemory> {
    queue_index: u16,
    dma: Dma,
    params: Arc<DiskParams>,
    metrics: Arc<BlockMetrics>,
    max_map: usize,
    chain: Chain,
    mapped: Vec<DmaBuffer>,
    engine: Box<dyn IoEngine>,
    pending: Slab<InFlight<M>>,
    mem: MemPin<M>,
    done: Vec<IoDone>,
    write_cache: Arc<AtomicBool>,
    on_full: OnFull,
    /// A submission pass stopped on a full pool: run one again when slots may be free.
    deferred: bool,
    retry: RetryTimer,
}

fn broken(e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Broken(format!("virtio-blk: {e}"))
}

impl<M: GuestMemory + Clone + Send + Sync + 'static> BlockWorker<M> {
    fn ctx(&mut self, may_wait: bool) -> (RequestCtx<'_>, &mut Chain) {
        (
            RequestCtx {
                dma: &self.dma,
                params: &self.params,
                metrics: &self.metrics,
                worker: usize::from(self.queue_index),
                max_map: self.max_map,
                mapped: &mut self.mapped,
                write_cache: self.write_cache.load(Ordering::Relaxed),
                may_wait,
            },
            &mut self.chain,
        )
    }

    /// Pops chains and submits them; returns the used entries added (requests finished at
    /// once).
    fn submit(&mut self, mem: &M, queue: &mut Queue) -> Result<usize, WorkerError> {
        self.deferred = false;
        let pin = self.mem.pin(mem);
        let wait_mode = self.on_full == OnFull::Wait;
        let write_cache = self.write_cache.load(Ordering::Relaxed);
        let Self {
            queue_index,
            dma,
            params,
            metrics,
            max_map,
            chain,
            mapped,
            engine,
            pending,
            deferred,
            retry,
            ..
        } = self;
        let mut ctx = RequestCtx {
            dma,
            params,
            metrics,
            worker: usize::from(*queue_index),
            max_map: *max_map,
            mapped,
            write_cache,
            may_wait: false,
        };
        let mut pacer = KickPacer::default();
        let drained = queue::drain(queue, mem, |at| {
            // Waiting needs something that will retry: one of our own requests completing,
            // or the retry timer.
            ctx.may_wait = wait_mode && (!pending.is_empty() || retry.can_arm());
            match ctx.start(mem, &at, chain) {
                Ok(Started::Done(c)) => Ok(Step::Used(c.used_len)),
                Ok(Started::Submit(req, op)) => {
                    let tag = pending.insert(InFlight {
                        head: at.head,
                        req,
                        mem: Arc::clone(&pin),
                    });
                    // SAFETY: the op's buffers are the device-visible side of the mappings
                    // now owned by `pending[tag]` (bounce slots, or guest memory kept mapped
                    // by its `mem`); they are unmapped only after the engine returned this
                    // tag's completion, or after the engine is dropped (which waits).
                    unsafe { engine.submit(tag as u64, op) };
                    if pacer.prepared() {
                        engine.kick();
                    }
                    Ok(Step::Held)
                }
                Ok(Started::PoolFull) => {
                    if pending.is_empty() {
                        retry.arm();
                    }
                    *deferred = true;
                    Ok(Step::Defer)
                }
                Err(e) => Err(broken(format_args!("head {}: {e}", at.head))),
            }
        });
        // What the pacer left waiting, and anything an engine holds back.
        engine.kick();
        let drained = drained.map_err(|e| match e {
            WorkerError::Broken(why) if !why.starts_with("virtio-blk") => broken(why),
            e => e,
        })?;
        if drained.popped > 0 {
            retry.progressed();
        }
        metrics.drains.add(drained.passes as u64);
        metrics.queue_depth_hiwater.max(u64::from(drained.deepest));
        metrics.inflight_hiwater.max(pending.len() as u64);
        Ok(drained.used)
    }

    /// Reaps the engine's completions and puts them on the used ring, in completion order;
    /// returns how many.
    fn complete(&mut self, mem: &M, queue: &mut Queue) -> Result<usize, WorkerError> {
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        self.engine.reap(&mut done);
        let mut used = 0;
        let mut result = Ok(());
        for d in done.drain(..) {
            let Some(f) = self
                .pending
                .remove(usize::try_from(d.tag).unwrap_or(usize::MAX))
            else {
                tracing::error!("virtio-blk: completion for unknown tag {}", d.tag);
                continue;
            };
            if result.is_err() {
                // The device is already broken: release what is left.
                let (mut ctx, _) = self.ctx(false);
                ctx.release(mem, f.req);
                continue;
            }
            let (mut ctx, _) = self.ctx(false);
            match ctx.finish(mem, f.req, d.result) {
                Ok(c) => match queue::add_used(queue, mem, f.head, c.used_len) {
                    Ok(()) => used += 1,
                    Err(e) => result = Err(e),
                },
                Err(e) => result = Err(broken(format_args!("head {}: {e}", f.head))),
            }
        }
        self.done = done;
        result.map(|()| used)
    }
}

impl<M: GuestMemory + Clone + Send + Sync + 'static> QueueWorker<M> for BlockWorker<M> {
    fn queue_indexes(&self) -> Vec<u16> {
        vec![self.queue_index]
    }

    fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        let mut v = Vec::new();
        if let Some(fd) = self.engine.notifier() {
            v.push((fd, ENGINE_TOKEN));
        }
        if let Some(fd) = self.retry.fd() {
            v.push((fd, RETRY_TOKEN));
        }
        v
    }

    fn handle(
        &mut self,
        event: WorkerEvent,
        mem: &M,
        queues: &mut [&mut Queue],
    ) -> Result<Signal, WorkerError> {
        let [queue] = queues else {
            return Err(WorkerError::UnexpectedEvent(event));
        };
        let pass = match event {
            WorkerEvent::Kick(0) => true,
            WorkerEvent::Fd(ENGINE_TOKEN) => false,
            WorkerEvent::Fd(RETRY_TOKEN) => {
                self.retry.fired();
                true
            }
            _ => return Err(WorkerError::UnexpectedEvent(event)),
        };
        // Completions first: they release bounce slots a submission may need.
        let mut used = self.complete(mem, queue)?;
        if pass || self.deferred {
            loop {
                used += self.submit(mem, queue)?;
                // Engines that finish inside submit (aio=sync), or very fast I/O. Their
                // eventfd was consumed by this reap, so if the pass stopped on a full pool
                // and these completions freed slots, the next pass must run now: no event
                // would bring it.
                let freed = self.complete(mem, queue)?;
                used += freed;
                if !(self.deferred && freed > 0) {
                    break;
                }
            }
        }
        let mut signal = Signal::NONE;
        if used > 0 {
            queue::notify(queue, mem, 0, &mut signal)?;
        }
        Ok(signal)
    }

    fn quiesce(&mut self, mem: &M, queues: &mut [&mut Queue]) -> Result<Signal, WorkerError> {
        let [queue] = queues else {
            return Ok(Signal::NONE);
        };
        // Every popped request is in `pending` (a chain deferred on a full pool was given
        // back to the ring); the same bound on waits as the drop's.
        let mut used = self.complete(mem, queue)?;
        let mut rounds = 0u32;
        while !self.pending.is_empty() && rounds < QUIESCE_ROUNDS {
            rounds += 1;
            self.engine.kick();
            self.engine.wait();
            used += self.complete(mem, queue)?;
        }
        let mut signal = Signal::NONE;
        if used > 0 {
            queue::notify(queue, mem, 0, &mut signal)?;
        }
        Ok(signal)
    }

    fn stats(&self) -> serde_json::Value {
        json!({ "queue": self.queue_index, "in_flight": self.pending.len() })
    }
}

/// Engine waits a quiesce or a drop spends on requests in flight before giving up on them.
const QUIESCE_ROUNDS: u32 = 100_000;

impl<M: GuestMemory> Drop for BlockWorker<M> {
    fn drop(&mut self) {
        // Device reset or teardown with I/O in flight: wait for the host to finish with the
        // buffers, then release every mapping (nothing is written to the guest any more).
        let mut done = Vec::new();
        let mut rounds = 0u32;
        while !self.pending.is_empty() && rounds < QUIESCE_ROUNDS {
            rounds += 1;
            self.engine.kick();
            self.engine.wait();
            self.engine.reap(&mut done);
            for d in done.drain(..) {
                if let Some(f) = self
                    .pending
                    .remove(usize::try_from(d.tag).unwrap_or(usize::MAX))
                {
                    let mut ctx = RequestCtx {
                        dma: &self.dma,
                        params: &self.params,
                        metrics: &self.metrics,
                        worker: usize::from(self.queue_index),
                        max_map: self.max_map,
                        mapped: &mut self.mapped,
                        write_cache: false,
                        may_wait: false,
                    };
                    ctx.release(&*f.mem, f.req);
                }
            }
            if self.engine.in_flight() == 0 {
                break;
            }
        }
        if !self.pending.is_empty() {
            tracing::error!(
                "virtio-blk: {} requests still pending at reset; their mappings are leaked",
                self.pending.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KickPacer;

    #[test]
    fn the_pacer_hands_over_the_first_request_at_once_then_doubling_batches() {
        let mut p = KickPacer::default();
        let kicked_after: Vec<usize> = (1..=40).filter(|_| p.prepared()).collect();
        // Requests 33-40 wait for the end of the pass.
        assert_eq!(kicked_after, [1, 2, 4, 8, 16, 32]);
        // A new pass starts over.
        let mut p = KickPacer::default();
        assert!(p.prepared());
    }
}
