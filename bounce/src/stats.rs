//! Pool statistics, like Linux's `/sys/kernel/debug/swiotlb` and more.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::alloc::{AllocatorKind, LockSnapshot};
use crate::geometry::PoolMode;

/// Live counters of a pool. All relaxed: they are statistics, not synchronisation.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub used: AtomicU64,
    pub hiwater: AtomicU64,
    pub maps: AtomicU64,
    pub unmaps: AtomicU64,
    pub map_failures: AtomicU64,
    pub bad_unmaps: AtomicU64,
    pub bytes_to_device: AtomicU64,
    pub bytes_from_device: AtomicU64,
    pub syncs_for_device: AtomicU64,
    pub syncs_for_cpu: AtomicU64,
    pub clamped: AtomicU64,
}

impl Counters {
    /// Linux `inc_used_and_hiwater`.
    pub fn inc_used(&self, n: usize) {
        let new = self.used.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        self.hiwater.fetch_max(new, Ordering::Relaxed);
    }

    pub fn dec_used(&self, n: usize) {
        self.used.fetch_sub(n as u64, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// A snapshot of a pool's statistics, serialisable to JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// swiotlb or iova.
    pub mode: PoolMode,
    /// The allocator.
    pub allocator: AllocatorKind,
    /// Slots in the pool (`io_tlb_nslabs`).
    pub nslabs: u64,
    /// Slot size in bytes.
    pub slot_size: u64,
    /// Areas.
    pub nareas: u64,
    /// Slots in use (`io_tlb_used`).
    pub used: u64,
    /// Highest `used` since creation or the last reset (`io_tlb_used_hiwater`).
    pub used_hiwater: u64,
    /// Slots in use per area, as the allocator counts them (approximate while maps run).
    pub area_used: Vec<u64>,
    /// Successful maps.
    pub maps: u64,
    /// Successful unmaps.
    pub unmaps: u64,
    /// Maps that failed because no run of slots fitted ("buffer is full").
    pub map_failures: u64,
    /// Unmaps of addresses that were not live mappings (refused).
    pub bad_unmaps: u64,
    /// Bytes copied from original buffers into the pool (map, sync for device).
    pub bytes_to_device: u64,
    /// Bytes copied from the pool back to original buffers (unmap, sync for cpu).
    pub bytes_from_device: u64,
    /// Syncs for the device.
    pub syncs_for_device: u64,
    /// Syncs for the CPU.
    pub syncs_for_cpu: u64,
    /// Copies clamped because they ran past the end of their mapping.
    pub clamped: u64,
    /// Lock counters, one per allocator lock (empty for lock-free allocators).
    pub locks: Vec<LockSnapshot>,
    /// Sum of `wait_ns` over all locks.
    pub lock_wait_ns: u64,
}

impl PoolStats {
    /// The statistics as a JSON string.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}
