//! Pool sizing: Linux's `swiotlb=<slots>,<areas>` rounding rules, and the resolved geometry.

use serde::{Deserialize, Serialize};

use crate::dynamic::DynamicConfig;
use crate::error::{Error, Result};
use crate::types::{AllocatorKind, CopyOnMap, PoolMode};
use crate::IO_TLB_SEGSIZE;

// Field list of the pool options; alike in shape only to other option structs.
/// What a user asks for. [`PoolConfig::geometry`] applies Linux's rounding rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolConfig {
    /// swiotlb or iova semantics.
    pub mode: PoolMode,
    /// Requested number of slots (granules in iova mode).
    pub slots: usize,
    /// Requested number of areas; `None` means one per worker, as Linux uses one per CPU.
    pub areas: Option<usize>,
    /// Number of workers (CPUs in Linux): per-worker caches and the default area count.
    pub workers: usize,
    /// Device address of slot 0. Must be aligned to the slot size.
    pub base: u64,
    /// The slot allocator.
    pub allocator: AllocatorKind,
    /// Copy rule on map; `None` takes the mode's default.
    pub copy_on_map: Option<CopyOnMap>,
    /// Which mappings map accepts by size.
    #[serde(default)]
    pub size_limit: SizeLimit,
    /// Dynamic pools (Linux `CONFIG_SWIOTLB_DYNAMIC`, [`crate::dynamic`]): `None` for one
    /// static pool. The pool above is then the default pool.
    #[serde(default)]
    pub dynamic: Option<DynamicConfig>,
}

/// Which mapping sizes a pool accepts.
///
/// Linux advertises `swiotlb_max_mapping_size` (a segment less `min_align_mask` rounded up to a
/// slot) to drivers, but `swiotlb_tbl_map_single` itself only refuses an allocation whose
/// padded size does not fit in one segment: a mapping up to `min_align_mask` bytes larger than
/// the advertised maximum is still placed when its original's offset leaves room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SizeLimit {
    /// Refuse anything larger than [`max_mapping_size`](crate::BouncePool::max_mapping_size)
    /// (what devices are told and respect).
    #[default]
    MaxMappingSize,
    /// Accept exactly what `swiotlb_tbl_map_single` accepts: any mapping whose padded
    /// allocation fits in one segment (trace replay).
    Kernel,
}

impl PoolConfig {
    /// Linux's default swiotlb pool: 64 MiB (32768 slots).
    pub const DEFAULT_SLOTS: usize = 32768;
    /// Default device address of a swiotlb pool (1 GiB, as a low-memory pool would be).
    pub const DEFAULT_SWIOTLB_BASE: u64 = 0x4000_0000;
    /// Default device address of an IOVA domain: IOVA page 0 is never handed out (VDUSE starts
    /// its IOVA domain at pfn 1).
    pub const DEFAULT_IOVA_BASE: u64 = 0x1000;

    /// A swiotlb pool with Linux defaults for one worker and the `areas` allocator.
    pub fn swiotlb(slots: usize) -> Self {
        Self {
            mode: PoolMode::Swiotlb,
            slots,
            areas: None,
            workers: 1,
            base: Self::DEFAULT_SWIOTLB_BASE,
            allocator: AllocatorKind::Areas,
            copy_on_map: None,
            size_limit: SizeLimit::MaxMappingSize,
            dynamic: None,
        }
    }

    /// An IOVA domain of `granules` 4 KiB granules with the `iova-rcache` allocator.
    pub fn iova(granules: usize) -> Self {
        Self {
            mode: PoolMode::Iova,
            slots: granules,
            areas: Some(1),
            workers: 1,
            base: Self::DEFAULT_IOVA_BASE,
            allocator: AllocatorKind::IovaRcache,
            copy_on_map: None,
            size_limit: SizeLimit::MaxMappingSize,
            dynamic: None,
        }
    }

    /// The area count asked for, rounded up to a power of two (0 counts as 1; none given: one
    /// per worker): Linux's `default_nareas`, before `limit_nareas` fits it to the pool.
    ///
    /// # Errors
    /// [`Error::Config`] when it overflows.
    pub fn requested_nareas(&self) -> Result<usize> {
        self.areas
            .unwrap_or(self.workers)
            .max(1)
            .checked_next_power_of_two()
            .ok_or_else(|| Error::Config("area count overflows".into()))
    }

    /// Resolves the request into a geometry.
    ///
    /// swiotlb mode follows Linux 6.x `setup_io_tlb_npages`, `swiotlb_adjust_nareas`,
    /// `round_up_default_nslabs` and `limit_nareas`: slots are rounded up to a multiple of 128;
    /// areas to a power of two (0 counts as 1); then the pool grows to at least 128 slots per
    /// area and, when it is not a power of two, to the next power of two; finally areas are
    /// reduced if the pool is still too small for them. iova mode uses the slot count as given
    /// and one area (its allocators keep per-worker caches instead).
    ///
    /// # Errors
    /// [`Error::Config`] for zero slots or workers, a misaligned base, or a pool whose device
    /// addresses would overflow.
    pub fn geometry(&self) -> Result<Geometry> {
        if self.slots == 0 {
            return Err(Error::Config("a pool needs at least one slot".into()));
        }
        if self.workers == 0 {
            return Err(Error::Config("a pool needs at least one worker".into()));
        }
        let slot_shift = self.mode.slot_shift();
        if self.base & ((1u64 << slot_shift) - 1) != 0 {
            return Err(Error::Config(format!(
                "base {:#x} is not aligned to the slot size {}",
                self.base,
                1u64 << slot_shift
            )));
        }
        let (nslabs, nareas, segsize) = match self.mode {
            PoolMode::Swiotlb => {
                let mut nslabs = round_up(self.slots, IO_TLB_SEGSIZE)
                    .ok_or_else(|| Error::Config("slot count overflows".into()))?;
                let mut nareas = self.requested_nareas()?;
                // round_up_default_nslabs()
                let min = IO_TLB_SEGSIZE
                    .checked_mul(nareas)
                    .ok_or_else(|| Error::Config("area count overflows".into()))?;
                if nslabs < min {
                    nslabs = min;
                }
                nslabs = nslabs
                    .checked_next_power_of_two()
                    .ok_or_else(|| Error::Config("slot count overflows".into()))?;
                // limit_nareas()
                if nslabs < nareas * IO_TLB_SEGSIZE {
                    nareas = nslabs / IO_TLB_SEGSIZE;
                }
                (nslabs, nareas, IO_TLB_SEGSIZE)
            }
            PoolMode::Iova => (self.slots, 1, self.slots),
        };
        let bytes = (nslabs as u64)
            .checked_shl(slot_shift)
            .filter(|b| b >> slot_shift == nslabs as u64)
            .ok_or_else(|| Error::Config("pool size overflows".into()))?;
        if self.base.checked_add(bytes).is_none() {
            return Err(Error::Config("pool device addresses overflow".into()));
        }
        Ok(Geometry {
            mode: self.mode,
            nslabs,
            nareas,
            area_nslabs: nslabs / nareas,
            slot_shift,
            segsize,
            base: self.base,
            nworkers: self.workers,
        })
    }
}

/// A resolved pool geometry. All allocators of one pool share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// swiotlb or iova.
    pub mode: PoolMode,
    /// Number of slots (Linux `nslabs`).
    pub nslabs: usize,
    /// Number of areas, a power of two.
    pub nareas: usize,
    /// Slots per area (`nslabs / nareas`).
    pub area_nslabs: usize,
    /// log2 of the slot size.
    pub slot_shift: u32,
    /// Slots per segment: no mapping crosses a segment. Equal to `nslabs` in iova mode.
    pub segsize: usize,
    /// Device address of slot 0.
    pub base: u64,
    /// Number of workers (per-worker caches, starting areas).
    pub nworkers: usize,
}

impl Geometry {
    /// Slot size in bytes.
    pub fn slot_size(&self) -> u64 {
        1u64 << self.slot_shift
    }

    /// Pool size in bytes.
    pub fn bytes(&self) -> usize {
        self.nslabs << self.slot_shift
    }

    /// Device address of slot `index`.
    pub fn slot_addr(&self, index: usize) -> u64 {
        self.base + ((index as u64) << self.slot_shift)
    }

    /// The area a slot belongs to.
    pub fn area_of(&self, index: usize) -> usize {
        index / self.area_nslabs
    }

    /// The area a worker starts its search in (Linux: `cpu & (nareas - 1)`).
    pub fn start_area(&self, worker: usize) -> usize {
        worker & (self.nareas - 1)
    }

    /// Number of slots needed for `bytes` bytes (Linux `nr_slots`).
    pub fn nr_slots(&self, bytes: u64) -> u64 {
        // A shift, not a division: this is on every map and unmap.
        (bytes >> self.slot_shift) + u64::from(bytes & (self.slot_size() - 1) != 0)
    }
}

fn round_up(value: usize, to: usize) -> Option<usize> {
    value.checked_next_multiple_of(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(slots: usize, areas: Option<usize>, workers: usize) -> Geometry {
        let mut c = PoolConfig::swiotlb(slots);
        c.areas = areas;
        c.workers = workers;
        c.geometry().unwrap()
    }

    #[test]
    fn slots_round_to_segment_multiple_then_power_of_two() {
        // swiotlb=1000,1: ALIGN(1000,128)=1024, a power of two already.
        assert_eq!(geo(1000, Some(1), 1).nslabs, 1024);
        // swiotlb=1100,1: ALIGN -> 1152, not a power of two -> 2048.
        assert_eq!(geo(1100, Some(1), 1).nslabs, 2048);
        // swiotlb=4096,1 as in the trace.
        let g = geo(4096, Some(1), 1);
        assert_eq!((g.nslabs, g.nareas, g.area_nslabs), (4096, 1, 4096));
    }

    #[test]
    fn areas_round_to_power_of_two_and_pool_grows_to_128_per_area() {
        let g = geo(128, Some(3), 1);
        assert_eq!(g.nareas, 4);
        assert_eq!(g.nslabs, 512);
        assert_eq!(g.area_nslabs, 128);
        // zero areas counts as one
        assert_eq!(geo(256, Some(0), 1).nareas, 1);
        // default areas: one per worker
        let g = geo(32768, None, 6);
        assert_eq!((g.nareas, g.area_nslabs), (8, 4096));
    }

    #[test]
    fn iova_mode_uses_granules_as_given() {
        let g = PoolConfig::iova(1000).geometry().unwrap();
        assert_eq!(
            (g.nslabs, g.nareas, g.segsize, g.slot_shift),
            (1000, 1, 1000, 12)
        );
    }

    #[test]
    fn bad_configs_are_errors() {
        assert!(PoolConfig::swiotlb(0).geometry().is_err());
        let mut c = PoolConfig::swiotlb(128);
        c.base = 0x400;
        assert!(c.geometry().is_err());
        c.base = u64::MAX - 0xfff;
        c.base &= !0x7ff;
        assert!(c.geometry().is_err());
        c = PoolConfig::swiotlb(128);
        c.workers = 0;
        assert!(c.geometry().is_err());
    }
}
