//! The vocabulary every other module shares: directions, attributes and map requests, and the
//! named choices a pool is configured with (mode, allocator, copy rule). This module imports
//! nothing of the pool, its geometry, allocators or statistics, so all of them can use it.

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::{DEFAULT_SEG_BOUNDARY_MASK, IO_TLB_SHIFT, PAGE_SHIFT};

/// Which semantics a pool follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolMode {
    /// Linux swiotlb: 2 KiB slots, 128-slot segments, always copy in on map.
    Swiotlb,
    /// VDUSE-style IOVA domain: 4 KiB granules, no segments, copy in on map only when the
    /// device reads the buffer.
    Iova,
}

crate::named_enum! {
    PoolMode, "mode", err: Error = Error::Config;
    Swiotlb => "swiotlb",
    Iova => "iova",
}

impl PoolMode {
    /// log2 of the slot (granule) size of this mode.
    pub fn slot_shift(self) -> u32 {
        match self {
            Self::Swiotlb => IO_TLB_SHIFT,
            Self::Iova => PAGE_SHIFT,
        }
    }

    /// The copy rule on map that this mode has by default.
    pub fn default_copy_on_map(self) -> CopyOnMap {
        match self {
            Self::Swiotlb => CopyOnMap::Always,
            Self::Iova => CopyOnMap::WhenDeviceReads,
        }
    }
}

/// What map copies into the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopyOnMap {
    /// Copy the original in whatever the direction (Linux swiotlb since the 2022 info-leak
    /// fix): a device that writes only part of a from-device buffer then neither exposes stale
    /// pool bytes nor clobbers the unwritten part of the original on unmap.
    Always,
    /// Copy in only when the device reads the buffer (to-device, bidirectional) and the caller
    /// did not ask to skip the CPU sync (VDUSE's bounce map).
    WhenDeviceReads,
}

crate::named_enum! {
    CopyOnMap, "copy rule", err: Error = Error::Config;
    Always => "always",
    WhenDeviceReads => "when-device-reads",
}

/// The ten slot allocators (see [`alloc`](crate::alloc)), selectable by name at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllocatorKind {
    /// One global lock, free-run counts, rolling index.
    Legacy,
    /// One lock, bitmap of free slots.
    Bitmap,
    /// Per-area locks with free-run counts: Linux 6.x.
    Areas,
    /// Per-area locks with bitmaps.
    AreasBitmap,
    /// Ordered-tree range allocator with a cached node, one lock.
    IovaRbtree,
    /// Per-worker magazines and a depot in front of the tree.
    IovaRcache,
    /// Lock-free first-fit bitmap.
    Genpool,
    /// Per-worker bitmaps for small requests, tree fallback.
    IovaBitmap,
    /// Per-area locks with free-run counts, freed runs reused first.
    AreasLifo,
    /// Per-worker magazines over per-area bitmap depots.
    Magazine,
}

crate::named_enum! {
    AllocatorKind, "allocator", err: Error = Error::Config, list: crate::names::one_of_list;
    Legacy => "legacy",
    Bitmap => "bitmap",
    Areas => "areas",
    AreasBitmap => "areas-bitmap",
    IovaRbtree => "iova-rbtree",
    IovaRcache => "iova-rcache",
    Genpool => "genpool",
    IovaBitmap => "iova-bitmap",
    AreasLifo => "areas-lifo",
    Magazine => "magazine",
}

/// The direction of a DMA transfer, from the device's point of view.
///
/// Linux's `DMA_NONE` has no variant: it is a bug there (`BUG_ON`) and unrepresentable here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// The device reads and writes the buffer (`DMA_BIDIRECTIONAL`, 0).
    Bidirectional,
    /// The device reads the buffer (`DMA_TO_DEVICE`, 1).
    ToDevice,
    /// The device writes the buffer (`DMA_FROM_DEVICE`, 2).
    FromDevice,
}

impl Direction {
    /// Decodes Linux's `enum dma_data_direction` value (0, 1, 2); `DMA_NONE` (3) and anything
    /// else give `None`.
    pub fn from_linux(value: u64) -> Option<Self> {
        match value {
            0 => Some(Self::Bidirectional),
            1 => Some(Self::ToDevice),
            2 => Some(Self::FromDevice),
            _ => None,
        }
    }

    /// Linux's numeric value of this direction.
    pub fn to_linux(self) -> u64 {
        match self {
            Self::Bidirectional => 0,
            Self::ToDevice => 1,
            Self::FromDevice => 2,
        }
    }

    /// True when the device may read the buffer (to-device or bidirectional).
    pub fn device_reads(self) -> bool {
        matches!(self, Self::ToDevice | Self::Bidirectional)
    }

    /// True when the device may write the buffer (from-device or bidirectional).
    pub fn device_writes(self) -> bool {
        matches!(self, Self::FromDevice | Self::Bidirectional)
    }
}

/// Who checks a guest (original) range against memory on a map: the callee, or the caller
/// already did with the direction's permission (a chain walker: its check is the request's
/// one check of each range). A range that is not memory after all still fails safely, with
/// [`Error::OrigAccess`] from the copy or the transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeCheck {
    /// The callee checks the whole range before anything is allocated or copied.
    Here,
    /// The caller has checked it; nothing is checked again.
    Prevalidated,
}

/// Whom a sync of a live mapping is for, as Linux's two entry points
/// (`dma_sync_single_for_device` / `_for_cpu`): the device, which must see the CPU's writes,
/// or the CPU, which must see the device's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncFor {
    /// Before the device reads: original -> pool when the device reads the buffer.
    Device,
    /// After the device wrote: pool -> original when the device writes the buffer.
    Cpu,
}

/// DMA attributes that change what the bounce module does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DmaAttrs {
    /// `DMA_ATTR_SKIP_CPU_SYNC`: unmap does not copy back.
    pub skip_cpu_sync: bool,
    /// `DMA_ATTR_NO_WARN`: a failed map logs nothing.
    pub no_warn: bool,
}

impl DmaAttrs {
    /// Linux's `DMA_ATTR_SKIP_CPU_SYNC` bit.
    pub const LINUX_SKIP_CPU_SYNC: u64 = 1 << 5;
    /// Linux's `DMA_ATTR_NO_WARN` bit.
    pub const LINUX_NO_WARN: u64 = 1 << 8;

    /// Decodes Linux's `unsigned long attrs`; bits that do not matter to bouncing are ignored.
    pub fn from_linux(bits: u64) -> Self {
        Self {
            skip_cpu_sync: bits & Self::LINUX_SKIP_CPU_SYNC != 0,
            no_warn: bits & Self::LINUX_NO_WARN != 0,
        }
    }
}

/// One request to map an original buffer for DMA.
///
/// `min_align_mask` and `seg_boundary_mask` are properties of the device in Linux; they are
/// carried per request here so one pool can serve devices with different constraints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapRequest {
    /// Original address (guest-physical, or an offset into a host buffer).
    pub orig: u64,
    /// Mapping size in bytes (Linux `mapping_size`). Must be at least 1.
    pub size: usize,
    /// Transfer direction.
    pub dir: Direction,
    /// Attributes.
    pub attrs: DmaAttrs,
    /// Address bits that the device address must share with `orig` (Linux `min_align_mask`).
    pub min_align_mask: u64,
    /// Required alignment of the allocation, as a mask (Linux `alloc_align_mask`).
    pub alloc_align_mask: u64,
    /// Device segment boundary: no mapping crosses a multiple of `mask + 1`.
    pub seg_boundary_mask: u64,
    /// The calling worker (a CPU in Linux): picks the starting area and per-worker caches.
    pub worker: usize,
}

impl MapRequest {
    /// A request with no masks, default boundary, no attributes, worker 0.
    pub fn new(orig: u64, size: usize, dir: Direction) -> Self {
        Self {
            orig,
            size,
            dir,
            attrs: DmaAttrs::default(),
            min_align_mask: 0,
            alloc_align_mask: 0,
            seg_boundary_mask: DEFAULT_SEG_BOUNDARY_MASK,
            worker: 0,
        }
    }

    // Builder setters, one per field and alike in shape: each is a one-line public method,
    // shorter than a macro that would generate them.
    /// Sets the calling worker.
    pub fn worker(mut self, worker: usize) -> Self {
        self.worker = worker;
        self
    }

    /// Sets the attributes.
    pub fn attrs(mut self, attrs: DmaAttrs) -> Self {
        self.attrs = attrs;
        self
    }

    /// Sets `min_align_mask`.
    pub fn min_align_mask(mut self, mask: u64) -> Self {
        self.min_align_mask = mask;
        self
    }

    /// Sets `alloc_align_mask`.
    pub fn alloc_align_mask(mut self, mask: u64) -> Self {
        self.alloc_align_mask = mask;
        self
    }

    /// Sets the segment boundary mask.
    pub fn seg_boundary_mask(mut self, mask: u64) -> Self {
        self.seg_boundary_mask = mask;
        self
    }
}
