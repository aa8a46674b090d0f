//! virtio-net: a 10 Gb/s network card whose every DMA goes through a [`bounce::Dma`] handle.
//!
//! Layout (after Firecracker's `net/`):
//! - this file: feature bits, configuration-space layout, limits and the error enum;
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

/// virtio-net feature bits (virtio 1.2, 5.1.3).
pub mod features {
    /// Device handles packets with partial checksum (the guest may send them).
    pub const CSUM: u64 = 1 << 0;
    /// Driver handles packets with partial checksum (the device may deliver them).
    pub const GUEST_CSUM: u64 = 1 << 1;
    /// Control channel offloads reconfiguration (not offered).
    pub const CTRL_GUEST_OFFLOADS: u64 = 1 << 2;
    /// Device maximum MTU reporting (not offered).
    pub const MTU: u64 = 1 << 3;
    /// Device has a given MAC address.
    pub const MAC: u64 = 1 << 5;
    /// Driver can receive TSOv4.
    pub const GUEST_TSO4: u64 = 1 << 7;
    /// Driver can receive TSOv6.
    pub const GUEST_TSO6: u64 = 1 << 8;
    /// Driver can receive TSO with ECN (not offered).
    pub const GUEST_ECN: u64 = 1 << 9;
    /// Driver can receive UFO (not offered).
    pub const GUEST_UFO: u64 = 1 << 10;
    /// Device can receive TSOv4 (the guest may send it).
    pub const HOST_TSO4: u64 = 1 << 11;
    /// Device can receive TSOv6.
    pub const HOST_TSO6: u64 = 1 << 12;
    /// Device can receive TSO with ECN (not offered).
    pub const HOST_ECN: u64 = 1 << 13;
    /// Device can receive UFO (not offered).
    pub const HOST_UFO: u64 = 1 << 14;
    /// Driver can merge receive buffers.
    pub const MRG_RXBUF: u64 = 1 << 15;
    /// Configuration status field is available.
    pub const STATUS: u64 = 1 << 16;
    /// Control channel is available.
    pub const CTRL_VQ: u64 = 1 << 17;
    /// Control channel RX mode support (not offered; the commands are acked anyway).
    pub const CTRL_RX: u64 = 1 << 18;
    /// Device supports multiqueue with automatic receive steering.
    pub const MQ: u64 = 1 << 22;
    /// Device reports speed and duplex.
    pub const SPEED_DUPLEX: u64 = 1 << 63;
}

/// `status` bit: the link is up.
pub const VIRTIO_NET_S_LINK_UP: u16 = 1;
/// Speed reported in the configuration space, in Mb/s.
pub const SPEED_MBPS: u32 = 10_000;
/// `duplex` value for full duplex.
pub const DUPLEX_FULL: u8 = 1;

/// Configuration-space offsets (virtio 1.2, 5.1.4).
pub mod config_offset {
    /// `mac[6]`.
    pub const MAC: usize = 0;
    /// `status` (le16).
    pub const STATUS: usize = 6;
    /// `max_virtqueue_pairs` (le16).
    pub const MAX_VIRTQUEUE_PAIRS: usize = 8;
    /// `mtu` (le16, zero: MTU is not offered).
    pub const MTU: usize = 10;
    /// `speed` (le32).
    pub const SPEED: usize = 12;
    /// `duplex` (u8).
    pub const DUPLEX: usize = 16;
    /// Size of the configuration space we expose (up to `supported_hash_types`, zeros past
    /// `duplex`).
    pub const SIZE: usize = 24;
}

/// Length of `virtio_net_hdr_v1` (VERSION_1 always has `num_buffers`).
pub const VNET_HDR_LEN: usize = 12;
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
