//! virtio-net: a 10 Gb/s network card whose every DMA goes through a [`bounce::Dma`] handle.
//!
//! Layout (after Firecracker's `net/`):
//! - this file: configuration-space layout, limits and the error enum;
//! - [`header`]: the 12-byte `virtio_net_hdr_v1` and its checks against the acked features;
//! - [`tap`]: the Linux tap (vnet headers, offloads, multi-queue) and its ioctls;
//! - [`backend`]: the small [`NetBackend`] trait a queue pair talks to (tap, in-memory, null);
//! - [`rate_limiter`]: the token-bucket shaper with a timerfd refill;
//! - [`device`]: the [`Net`] device (features, config space, activation, stats);
//! - [`worker`]: one worker per rx/tx queue pair (the rx and tx paths);
//! - [`ctrl`]: the control-queue worker;
//! - [`metrics`]: counters, serialised to JSON.
//!
//! Rules every path keeps: every popped head gets exactly one `add_used`; a chain the guest
//! got wrong is completed with length 0 and counted; a frame that is too large, malformed or
//! cannot be bounced is dropped and counted, and the device keeps serving.

pub mod backend;
pub mod ctrl;
pub mod device;
pub mod header;
pub mod metrics;
pub mod rate_limiter;
pub mod tap;
pub mod worker;

#[cfg(test)]
mod test_utils;
#[cfg(test)]
mod tests;

pub use backend::{MemBackend, NetBackend, NullBackend};
pub use device::{Net, NetConfig};
pub use header::VnetHeader;
pub use metrics::NetMetrics;
pub use rate_limiter::{Clock, RateLimiter, ShaperConfig};
pub use tap::Tap;

/// Speed reported in the configuration space, in Mb/s.
pub const SPEED_MBPS: u32 = 10_000;
/// `duplex` value for full duplex.
pub const DUPLEX_FULL: u8 = 1;

/// Configuration-space offsets (virtio 1.2, 5.1.4), from `struct virtio_net_config`.
pub mod config_offset {
    use std::mem::{offset_of, size_of};

    use crate::virtio::spec::virtio_net_config;

    /// `mac[6]`.
    pub const MAC: usize = offset_of!(virtio_net_config, mac);
    /// `status` (le16).
    pub const STATUS: usize = offset_of!(virtio_net_config, status);
    /// `max_virtqueue_pairs` (le16).
    pub const MAX_VIRTQUEUE_PAIRS: usize = offset_of!(virtio_net_config, max_virtqueue_pairs);
    /// `mtu` (le16, zero: MTU is not offered).
    pub const MTU: usize = offset_of!(virtio_net_config, mtu);
    /// `speed` (le32).
    pub const SPEED: usize = offset_of!(virtio_net_config, speed);
    /// `duplex` (u8).
    pub const DUPLEX: usize = offset_of!(virtio_net_config, duplex);
    /// Size of the configuration space we expose (up to `supported_hash_types`, zeros past
    /// `duplex`).
    pub const SIZE: usize = size_of::<virtio_net_config>();
}

// Net device limits: constants, alike in shape only to other tables.
/// Length of `virtio_net_hdr_v1` (VERSION_1 always has `num_buffers`).
pub const VNET_HDR_LEN: usize = std::mem::size_of::<crate::virtio::spec::virtio_net_hdr_v1>();
/// Largest frame (without the vnet header) the device sends or receives: 64 KiB of IP
/// datagram plus an Ethernet header with a VLAN tag, as in Firecracker (65550).
pub const MAX_FRAME_LEN: usize = 65_550;
/// Largest buffer a frame plus its vnet header needs: 65562 bytes.
pub const MAX_BUFFER_LEN: usize = MAX_FRAME_LEN + VNET_HDR_LEN;
/// Smallest frame the device sends: an Ethernet header.
pub const MIN_FRAME_LEN: usize = 14;
/// Largest queue size the device accepts.
pub const QUEUE_MAX_SIZE: u16 = 256;
/// Most queue pairs the device supports (`VIRTIO_NET_CTRL_MQ_VQ_PAIRS_MAX` is 0x8000; a tap
/// allows 256 queues).
pub const MAX_QUEUE_PAIRS: u16 = 256;

/// Errors of the net device outside the data path (the data path counts, it does not fail).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tap device could not be opened or configured.
    #[error("tap {name}: {reason}")]
    Tap {
        /// Interface name.
        name: String,
        /// One-line reason.
        reason: String,
    },
    /// A backend I/O error.
    #[error("backend I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The device configuration is invalid.
    #[error("invalid net configuration: {0}")]
    Config(String),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;
