//! Host-side DMA bounce buffers with Linux swiotlb semantics.
//!
//! Every device DMA of bouncevm goes through this crate. A device asks a [`BouncePool`] to map an
//! *original* buffer (a guest address, or a host buffer) in a [`Direction`]; the pool allocates
//! slots from its own memory with one of ten [`alloc`] strategies, copies the original in as
//! the rules say, and hands back a *device address* inside the pool. The device does its I/O on
//! that address ([`BouncePool::device_slice`]); unmapping copies the data back as the rules say
//! and releases the slots.
//!
//! Two modes share one implementation ([`PoolMode`]):
//! - **swiotlb**: 2 KiB slots grouped in 128-slot segments, padding slots for `min_align_mask`,
//!   page alignment for mappings of 4 KiB or more when no mask is given, and an always-copy-in
//!   map (Linux `kernel/dma/swiotlb.c`, 6.x).
//! - **iova**: a VDUSE-style IOVA domain: 4 KiB granules, no segments, and a copy-in on map only
//!   for to-device and bidirectional buffers.
//!
//! The copy rules, for the record (see [`CopyOnMap`] for the one switch):
//!
//! | operation | copies | when |
//! |---|---|---|
//! | map | original -> bounce | swiotlb: always; iova: to-device or bidirectional |
//! | unmap | bounce -> original | from-device or bidirectional, unless skip-cpu-sync |
//! | sync for device | original -> bounce | to-device or bidirectional |
//! | sync for cpu | bounce -> original | from-device or bidirectional |
//!
//! Rust references are never formed over the pool or over guest memory: both are only accessed
//! through `vm-memory` volatile slices.

#![warn(missing_docs)]

pub mod alloc;
pub mod attribution;
pub mod dma;
pub mod dynamic;
pub mod error;
pub mod geometry;
pub mod names;
pub mod orig;
pub mod pool;
pub mod stats;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod trace;
pub mod types;

pub use alloc::{Run, SlotAllocator, SlotBatch, SlotRequest};
pub use attribution::{DmaCounters, DmaStats};
pub use dma::{DeviceDmaParams, Dma, DmaBatch, DmaBuffer, GuestBuf, Policy};
pub use dynamic::{
    DynamicConfig, DynamicEvents, DynamicPools, DynamicStats, PoolInfo, PoolKind, PoolPages,
};
pub use error::{Error, Result};
pub use geometry::{Geometry, PoolConfig, SizeLimit};
pub use orig::{HostMemory, NoCopyMemory, OrigMemory};
pub use pool::{BouncePool, Mapping, PoolBatch};
pub use stats::PoolStats;
pub use types::{
    AllocatorKind, CopyOnMap, Direction, DmaAttrs, MapRequest, PoolMode, RangeCheck, SyncFor,
};

/// log2 of the swiotlb slot size (Linux `IO_TLB_SHIFT`).
pub const IO_TLB_SHIFT: u32 = 11;
/// The swiotlb slot size in bytes (Linux `IO_TLB_SIZE`).
pub const IO_TLB_SIZE: u64 = 1 << IO_TLB_SHIFT;
/// Slots per segment: no swiotlb mapping crosses a segment (Linux `IO_TLB_SEGSIZE`).
pub const IO_TLB_SEGSIZE: usize = 128;
/// log2 of the page size, used for the page-alignment rule and the IOVA granule.
pub const PAGE_SHIFT: u32 = 12;
/// The page size.
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
/// The default segment boundary mask of a PCI device (Linux sets 0xffffffff).
pub const DEFAULT_SEG_BOUNDARY_MASK: u64 = 0xffff_ffff;
