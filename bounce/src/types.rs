//! Directions, attributes and map requests.

use serde::{Deserialize, Serialize};

use crate::DEFAULT_SEG_BOUNDARY_MASK;

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
