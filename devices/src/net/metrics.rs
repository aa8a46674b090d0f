//! Counters of a net device, shared by its workers and serialised to JSON.
//!
//! All counters are relaxed atomics: they are statistics, not synchronisation. The JSON of
//! [`crate::virtio::VirtioDevice::stats`] looks like:
//!
//! ```json
//! {"net": {"tx_frames": 10, "tx_bytes": 15000, "tx_dropped_oversized": 0, ...,
//!          "rx_queue_depth_hiwater": 256},
//!  "bounce": {"mode": "swiotlb", "used": 0, ...},
//!  "dma": {"maps": 40, "bytes": 61440, "map_failures": 0, "unmaps": 40},
//!  "acked_features": 12345, "active_pairs": 1}
//! ```
//! `bounce` and `dma` are as a block device's ([`crate::block::metrics`]).

pub use crate::metrics::{Counter, LoggedCounter};

/// The counters of one net device (all queue pairs together).
#[derive(Debug, Default, serde::Serialize)]
pub struct NetMetrics {
    /// Frames sent to the backend.
    pub tx_frames: Counter,
    /// Frame bytes sent (vnet headers excluded).
    pub tx_bytes: Counter,
    /// TX chains whose frame exceeded 65562 bytes with its header: dropped.
    pub tx_dropped_oversized: LoggedCounter,
    /// TX chains the guest got wrong (writable descriptors, bad addresses, loops, too short):
    /// dropped.
    pub tx_dropped_malformed: LoggedCounter,
    /// TX frames whose vnet header asked for an offload not acked or pointed outside the
    /// frame: dropped.
    pub tx_dropped_bad_header: LoggedCounter,
    /// TX frames the backend refused: dropped.
    pub tx_dropped_backend: Counter,
    /// TX frames dropped because a buffer could not be bounced.
    pub tx_bounce_failures: Counter,
    /// Times the shaper held TX back.
    pub tx_throttled: Counter,
    /// Highest number of TX chains seen waiting in the ring.
    pub tx_queue_depth_hiwater: Counter,
    /// Frames delivered to the guest.
    pub rx_frames: Counter,
    /// Frame bytes delivered (vnet headers excluded).
    pub rx_bytes: Counter,
    /// Guest buffers (chains) used for delivered frames; above `rx_frames` with MRG_RXBUF.
    pub rx_buffers_used: Counter,
    /// RX frames that did not fit the guest's buffer (no MRG_RXBUF, or every buffer held
    /// and still too small): dropped.
    pub rx_dropped_too_small: Counter,
    /// RX frames shorter than a vnet header, or whose header the guest may not receive:
    /// dropped.
    pub rx_dropped_malformed: Counter,
    /// RX frames dropped because a buffer could not be bounced.
    pub rx_bounce_failures: Counter,
    /// RX chains the guest got wrong (readable descriptors, bad addresses, loops, smaller
    /// than a header): completed with length 0.
    pub rx_bad_chains: LoggedCounter,
    /// Times a frame had to wait for the guest to post buffers (the tap is not read then).
    pub rx_no_buffers: Counter,
    /// RX chains put back on the available ring at the end of a pass (held for a frame that
    /// still waits, or left over by a dropped one): popped again by the next pass.
    pub rx_chains_returned: Counter,
    /// Held RX chains that could not go back on the ring (a refused chain was completed after
    /// them): completed with length 0.
    pub rx_chains_returned_empty: Counter,
    /// Backend read errors.
    pub rx_backend_errors: Counter,
    /// Times the shaper held RX back.
    pub rx_throttled: Counter,
    /// Highest number of RX chains seen available in the ring.
    pub rx_queue_depth_hiwater: Counter,
    /// Times a ring-steered queue pair attached or detached its backend queue.
    pub steering_changes: Counter,
    /// Times the backend refused such a change.
    pub steering_errors: Counter,
    /// Control commands answered OK.
    pub ctrl_ok: Counter,
    /// Control commands answered ERR.
    pub ctrl_err: Counter,
    /// Control chains the guest got wrong: completed with length 0.
    pub ctrl_bad_chains: LoggedCounter,
    /// Guest writes to the (read-only) configuration space: ignored.
    pub config_writes_ignored: Counter,
}

impl NetMetrics {
    /// The counters as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}
