//! The virtio-net device: features, configuration space, activation, statistics.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use bounce::Dma;
use serde::{Deserialize, Serialize};
use vm_memory::GuestMemory;

use super::backend::NetBackend;
use super::ctrl::CtrlWorker;
use super::metrics::NetMetrics;
use super::rate_limiter::{RateLimiter, ShaperConfig};
use super::tap::Tap;
use super::worker::{lock, PairWorker, SharedBackend};
use super::{
    config_offset as off, Error, Result, DUPLEX_FULL, MAX_QUEUE_PAIRS, QUEUE_MAX_SIZE, SPEED_MBPS,
};
use crate::virtio::spec::{
    feature, VIRTIO_F_VERSION_1, VIRTIO_ID_NET, VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_VQ,
    VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ,
    VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_SPEED_DUPLEX, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP,
};
use crate::virtio::{
    common_features, read_config_window, ActivateError, QueueWorker, VirtioDevice,
};

/// How a net device is set up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// The MAC address offered in the configuration space.
    pub mac: [u8; 6],
    /// Queue pairs (one backend, e.g. one tap queue, each).
    pub queue_pairs: u16,
    /// Largest queue size accepted.
    pub queue_size: u16,
    /// Offer VIRTIO_F_ACCESS_PLATFORM.
    pub access_platform: bool,
    /// Shape each queue pair's traffic to a line rate.
    pub shaper: Option<ShaperConfig>,
    /// The transport's frontend may keep the control queue to itself and steer the queue
    /// pairs through the rings' enable state instead. A vhost-user frontend does: QEMU acks
    /// MQ but not CTRL_VQ to its backend, answers the guest's `VQ_PAIRS_SET` itself, and
    /// enables the pairs in use with `SET_VRING_ENABLE`. With this set, MQ without CTRL_VQ
    /// is accepted and each pair receives from its backend queue while its rings are
    /// enabled ([`crate::virtio::QueueWorker::queues_disabled`]); without it (virtio-pci,
    /// where the driver itself must ack CTRL_VQ with MQ, virtio 1.2 5.1.3.1) it is refused.
    #[serde(default)]
    pub frontend_steering: bool,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            mac: [0x52, 0x54, 0x00, 0x12, 0x34, 0x56],
            queue_pairs: 1,
            queue_size: QUEUE_MAX_SIZE,
            access_platform: true,
            shaper: None,
            frontend_steering: false,
        }
    }
}

/// Lifecycle (Firecracker's `DeviceState`).
#[derive(Debug)]
enum DeviceState {
    Inactive,
    Activated,
}

/// A virtio-net device whose every DMA goes through a [`Dma`] handle.
#[derive(Debug)]
pub struct Net {
    config: NetConfig,
    avail_features: u64,
    acked_features: u64,
    state: DeviceState,
    backends: Vec<SharedBackend>,
    active_pairs: Arc<AtomicU16>,
    dma: Dma,
    metrics: Arc<NetMetrics>,
    config_space: [u8; off::SIZE],
    config_write_logged: crate::metrics::LogOnce,
}

impl Net {
    /// The features a device with `config` offers.
    pub fn features_for(config: &NetConfig) -> u64 {
        common_features(config.access_platform)
            | feature(VIRTIO_NET_F_MAC)
            | feature(VIRTIO_NET_F_STATUS)
            | feature(VIRTIO_NET_F_SPEED_DUPLEX)
            | feature(VIRTIO_NET_F_CTRL_VQ)
            | feature(VIRTIO_NET_F_MQ)
            | feature(VIRTIO_NET_F_MRG_RXBUF)
            | feature(VIRTIO_NET_F_CSUM)
            | feature(VIRTIO_NET_F_GUEST_CSUM)
            | feature(VIRTIO_NET_F_HOST_TSO4)
            | feature(VIRTIO_NET_F_HOST_TSO6)
            | feature(VIRTIO_NET_F_GUEST_TSO4)
            | feature(VIRTIO_NET_F_GUEST_TSO6)
    }

    /// A device over one backend per queue pair.
    ///
    /// # Errors
    /// [`Error::Config`] when the backend count does not match, or the pair count or queue
    /// size is out of range.
    pub fn new(config: NetConfig, backends: Vec<Box<dyn NetBackend>>, dma: Dma) -> Result<Self> {
        if config.queue_pairs == 0 || config.queue_pairs > MAX_QUEUE_PAIRS {
            return Err(Error::Config(format!(
                "queue pairs {} not in 1..={MAX_QUEUE_PAIRS}",
                config.queue_pairs
            )));
        }
        if backends.len() != usize::from(config.queue_pairs) {
            return Err(Error::Config(format!(
                "{} backends for {} queue pairs",
                backends.len(),
                config.queue_pairs
            )));
        }
        if !config.queue_size.is_power_of_two() || config.queue_size > QUEUE_MAX_SIZE {
            return Err(Error::Config(format!(
                "queue size {} is not a power of two up to {QUEUE_MAX_SIZE}",
                config.queue_size
            )));
        }
        let mut cs = [0u8; off::SIZE];
        cs[off::MAC..off::MAC + 6].copy_from_slice(&config.mac);
        cs[off::STATUS..off::STATUS + 2].copy_from_slice(&VIRTIO_NET_S_LINK_UP.to_le_bytes());
        cs[off::MAX_VIRTQUEUE_PAIRS..off::MAX_VIRTQUEUE_PAIRS + 2]
            .copy_from_slice(&config.queue_pairs.to_le_bytes());
        cs[off::SPEED..off::SPEED + 4].copy_from_slice(&SPEED_MBPS.to_le_bytes());
        cs[off::DUPLEX] = DUPLEX_FULL;
        Ok(Self {
            avail_features: Self::features_for(&config),
            config,
            acked_features: 0,
            state: DeviceState::Inactive,
            backends: backends
                .into_iter()
                .map(|b| Arc::new(Mutex::new(b)))
                .collect(),
            active_pairs: Arc::new(AtomicU16::new(1)),
            dma,
            metrics: Arc::new(NetMetrics::default()),
            config_space: cs,
            config_write_logged: crate::metrics::LogOnce::default(),
        })
    }

    /// A device over the tap `ifname`, one tap queue per queue pair.
    ///
    /// # Errors
    /// [`Error::Tap`] when the tap cannot be opened; those of [`Net::new`].
    pub fn with_tap(config: NetConfig, ifname: &str, dma: Dma) -> Result<Self> {
        let taps = Tap::open(ifname, usize::from(config.queue_pairs))?;
        let backends = taps
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn NetBackend>)
            .collect();
        Self::new(config, backends, dma)
    }

    /// The shared counters.
    pub fn metrics(&self) -> &Arc<NetMetrics> {
        &self.metrics
    }

    /// The features the driver acknowledged at activation (0 while inactive).
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Queue pairs in use (changed by the control command `VQ_PAIRS_SET`).
    pub fn active_pairs(&self) -> u16 {
        self.active_pairs.load(Ordering::Relaxed)
    }

    /// Checks the dependencies of virtio 1.2 5.1.3.1 among the acked features (MQ needs
    /// CTRL_VQ unless the frontend steers, see [`NetConfig::frontend_steering`]).
    fn check_features(
        acked: u64,
        frontend_steering: bool,
    ) -> std::result::Result<(), ActivateError> {
        let deps = [
            (
                feature(VIRTIO_NET_F_GUEST_TSO4),
                feature(VIRTIO_NET_F_GUEST_CSUM),
                "GUEST_TSO4 needs GUEST_CSUM",
            ),
            (
                feature(VIRTIO_NET_F_GUEST_TSO6),
                feature(VIRTIO_NET_F_GUEST_CSUM),
                "GUEST_TSO6 needs GUEST_CSUM",
            ),
            (
                feature(VIRTIO_NET_F_HOST_TSO4),
                feature(VIRTIO_NET_F_CSUM),
                "HOST_TSO4 needs CSUM",
            ),
            (
                feature(VIRTIO_NET_F_HOST_TSO6),
                feature(VIRTIO_NET_F_CSUM),
                "HOST_TSO6 needs CSUM",
            ),
            (
                feature(VIRTIO_NET_F_MQ),
                feature(VIRTIO_NET_F_CTRL_VQ),
                "MQ needs CTRL_VQ",
            ),
        ];
        if acked & feature(VIRTIO_F_VERSION_1) == 0 {
            return Err(ActivateError::Features(
                "VERSION_1 is required (no legacy interface)".into(),
            ));
        }
        for (f, needs, what) in deps {
            if f == feature(VIRTIO_NET_F_MQ) && frontend_steering {
                continue;
            }
            if acked & f != 0 && acked & needs == 0 {
                return Err(ActivateError::Features(what.into()));
            }
        }
        Ok(())
    }
}

impl<M: GuestMemory + 'static> VirtioDevice<M> for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn num_queues(&self) -> usize {
        2 * usize::from(self.config.queue_pairs) + 1
    }

    fn queue_max_size(&self) -> u16 {
        self.config.queue_size
    }

    /// One group per rx/tx pair (`2i`, `2i + 1`) and, when offered, the control queue alone
    /// (queue `2 * max_pairs`). Without MQ the control queue is queue 2, which is in pair 1's
    /// group: still one group.
    fn queue_groups(&self) -> Vec<Vec<u16>> {
        // queue_pairs <= MAX_QUEUE_PAIRS = 256: 2 * pairs + 1 fits a u16.
        let pairs = self.config.queue_pairs;
        let mut groups: Vec<Vec<u16>> = (0..pairs).map(|p| vec![2 * p, 2 * p + 1]).collect();
        groups.push(vec![2 * pairs]);
        groups
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_window(&self.config_space, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Every field is read-only for a modern driver (the MAC may only be set through the
        // control queue with CTRL_MAC_ADDR, which is not offered).
        // A driver can do this in a loop: counted always, logged once.
        self.metrics.config_writes_ignored.inc();
        if self.config_write_logged.first() {
            tracing::warn!(
                offset,
                len = data.len(),
                "ignored write to net config space (logged once)"
            );
        }
    }

    fn activate(
        &mut self,
        acked_features: u64,
    ) -> std::result::Result<Vec<Box<dyn QueueWorker<M>>>, ActivateError> {
        if matches!(self.state, DeviceState::Activated) {
            return Err(ActivateError::AlreadyActive);
        }
        let acked = acked_features & self.avail_features;
        Self::check_features(acked, self.config.frontend_steering)?;
        let mq = acked & feature(VIRTIO_NET_F_MQ) != 0;
        // MQ without a control queue of ours: the frontend steers through the rings' enable
        // state (only accepted with `frontend_steering`).
        let ring_steered = mq && acked & feature(VIRTIO_NET_F_CTRL_VQ) == 0;
        let pairs = if mq { self.config.queue_pairs } else { 1 };
        let multi = self.backends.len() > 1;
        for (i, b) in self.backends.iter().enumerate() {
            let mut b = lock(b);
            b.configure(acked)
                .map_err(|e| ActivateError::Backend(format!("queue pair {i}: {e}")))?;
            // Until the driver sends VQ_PAIRS_SET only the first pair receives (5.1.6.5.5).
            if multi {
                b.set_enabled(i == 0)
                    .map_err(|e| ActivateError::Backend(format!("queue pair {i}: {e}")))?;
            }
        }
        self.active_pairs.store(1, Ordering::Relaxed);
        let mut workers: Vec<Box<dyn QueueWorker<M>>> = Vec::new();
        for i in 0..pairs {
            let shaper = match self.config.shaper {
                Some(c) => Some(
                    RateLimiter::new(c)
                        .map_err(|e| ActivateError::Backend(format!("shaper: {e}")))?,
                ),
                None => None,
            };
            let worker = PairWorker::<M>::new(
                i,
                acked,
                self.backends[usize::from(i)].clone(),
                self.dma.clone(),
                self.metrics.clone(),
                shaper,
            );
            workers.push(Box::new(if ring_steered {
                worker.steered_by_rings()
            } else {
                worker
            }));
        }
        if acked & feature(VIRTIO_NET_F_CTRL_VQ) != 0 {
            // The control queue follows the last pair's queues: 2N with MQ, else 2 (5.1.2).
            let index = 2 * pairs;
            workers.push(Box::new(CtrlWorker::<M>::new(
                index,
                acked,
                self.backends[..usize::from(pairs)].to_vec(),
                self.active_pairs.clone(),
                self.dma.clone(),
                self.metrics.clone(),
            )));
        }
        self.acked_features = acked;
        self.state = DeviceState::Activated;
        Ok(workers)
    }

    fn reset(&mut self) {
        for (i, b) in self.backends.iter().enumerate() {
            if let Err(e) = lock(b).configure(0) {
                tracing::warn!("queue pair {i}: clearing offloads on reset: {e}");
            }
        }
        self.acked_features = 0;
        self.active_pairs.store(1, Ordering::Relaxed);
        self.state = DeviceState::Inactive;
    }

    fn stats(&self) -> serde_json::Value {
        serde_json::json!({
            "net": self.metrics.to_json(),
            "bounce": crate::pools::bounce_json(&self.dma),
            "dma": crate::pools::dma_json(&self.dma),
            "policy": self.dma.policy().to_string(),
            "acked_features": self.acked_features,
            "active_pairs": self.active_pairs(),
        })
    }
}
