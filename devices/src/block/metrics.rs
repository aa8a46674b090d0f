//! Per-device counters.
//!
//! All counters are relaxed atomics shared by the device and its queue workers. The JSON a
//! device's `stats()` returns looks like:
//!
//! ```json
//! {
//!   "type": "block", "disk": "raw", "capacity_sectors": 2048, "readonly": false,
//!   "policy": "force", "acked_features": 4563402822, "active_queues": 1,
//!   "metrics": {
//!     "reqs_in": 10, "reqs_out": 4, "reqs_flush": 1, "reqs_get_id": 0,
//!     "reqs_discard": 0, "reqs_write_zeroes": 0, "reqs_unsupported": 0,
//!     "bytes_read": 40960, "bytes_written": 16384,
//!     "err_bad_chain": 0, "err_guest_access": 0, "err_bounce": 0, "err_io": 0,
//!     "err_out_of_range": 0, "err_readonly": 0, "err_unsupported": 0,
//!     "no_status": 0, "status_direct": 0, "config_write_rejected": 0, "config_wce_writes": 0,
//!     "pool_full_waits": 0, "pool_full_failed": 0, "inflight_hiwater": 32,
//!     "drains": 3, "queue_depth_hiwater": 8, "inflight_resubmitted": 0,
//!     "leaked_requests": 0
//!   },
//!   "bounce": { "mode": "swiotlb", "nslabs": 32768, "used": 0, ... },
//!   "dma": { "maps": 12, "bytes": 57344, "map_failures": 0, "unmaps": 12 }
//! }
//! ```
//! `bounce` is `null` when the device has no pool (policy `off`), and `{"pool": NAME}` when
//! it shares the pool NAME (listed once with the process's pools); `dma` is what the device
//! itself mapped ([`crate::pools::dma_json`]).

use serde::Serialize;

use super::BlockError;
pub use crate::metrics::{Counter, LoggedCounter};

/// Counters of one block device (all its queues).
#[derive(Debug, Default, Serialize)]
pub struct BlockMetrics {
    /// IN (read) requests.
    pub reqs_in: Counter,
    /// OUT (write) requests.
    pub reqs_out: Counter,
    /// FLUSH requests.
    pub reqs_flush: Counter,
    /// GET_ID requests.
    pub reqs_get_id: Counter,
    /// DISCARD requests.
    pub reqs_discard: Counter,
    /// WRITE_ZEROES requests.
    pub reqs_write_zeroes: Counter,
    /// Requests of unknown or unnegotiated types.
    pub reqs_unsupported: Counter,
    /// Bytes read from the disk into guest buffers.
    pub bytes_read: Counter,
    /// Bytes written from guest buffers to the disk.
    pub bytes_written: Counter,
    /// Malformed descriptor chains.
    pub err_bad_chain: LoggedCounter,
    /// Buffers outside guest memory.
    pub err_guest_access: LoggedCounter,
    /// Bounce mappings refused (pool full and others).
    pub err_bounce: LoggedCounter,
    /// Backend I/O errors and short transfers.
    pub err_io: LoggedCounter,
    /// Sector ranges beyond the disk, unaligned lengths, discard limits.
    pub err_out_of_range: LoggedCounter,
    /// Writes to a read-only disk.
    pub err_readonly: LoggedCounter,
    /// Requests completed with UNSUPP.
    pub err_unsupported: LoggedCounter,
    /// Chains whose status byte could not be located or written (the device then stops:
    /// DEVICE_NEEDS_RESET).
    pub no_status: Counter,
    /// Status bytes written straight to guest memory because the bounce pool was full.
    pub status_direct: Counter,
    /// Driver writes to the (read-only) configuration space, ignored.
    pub config_write_rejected: Counter,
    /// Driver writes of `writeback` (CONFIG_WCE) applied.
    pub config_wce_writes: Counter,
    /// Submission passes that stopped on a full bounce pool and left the request on the ring
    /// (`on-full=wait`).
    pub pool_full_waits: Counter,
    /// Requests completed with IOERR because the pool was full (`on-full=fail`, a request
    /// larger than the pool, or a full pool with nothing else holding slots).
    pub pool_full_failed: Counter,
    /// Most requests in flight at once on one queue.
    pub inflight_hiwater: Counter,
    /// Queue drains (passes over the available ring).
    pub drains: Counter,
    /// Most chains popped in one drain.
    pub queue_depth_hiwater: Counter,
    /// Requests found in flight by a log of heads (vhost-user's inflight region) when a
    /// queue resumed, and submitted again.
    pub inflight_resubmitted: Counter,
    /// Requests whose host I/O never completed when their queue was torn down: their memory
    /// (guest memory pinned for them, bounce slots) is kept for good, since the kernel may
    /// still write into it.
    pub leaked_requests: Counter,
}

impl BlockMetrics {
    /// Counts an error by kind; the first of each kind is logged (log once per device, count
    /// always: a guest can repeat any of them at will).
    pub fn count_error(&self, e: &BlockError) {
        let (counter, name) = match e {
            BlockError::BadChain(_) | BlockError::Chain(_) => {
                (&self.err_bad_chain, "metrics.err_bad_chain")
            }
            BlockError::GuestAccess { .. } => (&self.err_guest_access, "metrics.err_guest_access"),
            BlockError::Bounce(_) => (&self.err_bounce, "metrics.err_bounce"),
            BlockError::Io(_) | BlockError::Short { .. } => (&self.err_io, "metrics.err_io"),
            BlockError::OutOfRange { .. } | BlockError::Unaligned(_) | BlockError::Limits(_) => {
                (&self.err_out_of_range, "metrics.err_out_of_range")
            }
            BlockError::ReadOnly => (&self.err_readonly, "metrics.err_readonly"),
            BlockError::Unsupported(_) => (&self.err_unsupported, "metrics.err_unsupported"),
            BlockError::Config(_) => return,
        };
        counter.note(name, format_args!("virtio-blk request failed: {e}"));
    }
}
