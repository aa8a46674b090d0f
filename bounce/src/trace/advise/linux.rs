//! Linux 6.12's rules for the default swiotlb pool, as far as sizing advice needs them: what
//! `swiotlb=N,A` becomes, the default size on an ordinary and on a confidential guest, what the
//! pool's bookkeeping costs, and which pools the kernel cannot set up.
//!
//! The rounding itself lives in one place, [`crate::PoolConfig::geometry`] (`setup_io_tlb_npages`,
//! `swiotlb_adjust_nareas`, `round_up_default_nslabs`, `limit_nareas` in
//! `kernel/dma/swiotlb.c`); this module only feeds it the numbers the kernel would.

use serde::Serialize;

use crate::error::Error;
use crate::geometry::Geometry;
use crate::IO_TLB_SEGSIZE;

/// Bytes of one slot (`IO_TLB_SIZE`, `1 << IO_TLB_SHIFT`).
pub const SLOT_BYTES: u64 = 2048;
/// Linux's default pool, `IO_TLB_DEFAULT_SIZE`: 64 MiB.
pub const DEFAULT_POOL_BYTES: u64 = 64 << 20;
/// The cap of a confidential guest's default pool (`SZ_1G` in `mem_encrypt_setup_arch`).
pub const CONFIDENTIAL_POOL_CAP: u64 = 1 << 30;
/// `sizeof(struct io_tlb_slot)` on a 64-bit kernel: `phys_addr_t orig_addr`, `size_t
/// alloc_size`, `unsigned short list`, `unsigned short pad_slots` (20 bytes, padded to 8).
pub const SLOT_STRUCT_BYTES: u64 = 24;
/// `sizeof(struct io_tlb_area)`: `unsigned long used`, `unsigned int index`, `spinlock_t lock`
/// (4 bytes without lock debugging).
pub const AREA_STRUCT_BYTES: u64 = 16;
/// The kernel allocates the default pool with `memblock_alloc_low`: below 4 GiB on x86-64.
pub const LOW_MEMORY_LIMIT: u64 = 4 << 30;
const PAGE_BYTES: u64 = 4096;

/// The slots of the default pool: 64 MiB, or on a confidential guest (`CC_ATTR_GUEST_MEM_ENCRYPT`:
/// SEV, TDX) 6 % of `guest_mem` clamped to 64 MiB..1 GiB, as `mem_encrypt_setup_arch`
/// (arch/x86/mm/mem_encrypt.c) computes it and `swiotlb_adjust_size` turns it into slots
/// (aligned to a slot, then to a segment); the power-of-two rounding follows in
/// `PoolConfig::geometry`. The kernel takes the memory it found (`memblock_phys_mem_size`), a
/// little less than the VM's size.
pub fn default_slots(confidential: bool, guest_mem: u64) -> usize {
    let bytes = if confidential {
        let six_percent = u128::from(guest_mem) * 6 / 100;
        u64::try_from(six_percent)
            .unwrap_or(u64::MAX)
            .clamp(DEFAULT_POOL_BYTES, CONFIDENTIAL_POOL_CAP)
    } else {
        DEFAULT_POOL_BYTES
    };
    let slots = bytes.div_ceil(SLOT_BYTES) as usize;
    slots.next_multiple_of(IO_TLB_SEGSIZE)
}

/// The memory a pool's bookkeeping takes besides its slots, as `swiotlb_init_remap` allocates
/// it: the slot array, page-aligned, and the area array.
pub fn metadata_bytes(geom: &Geometry) -> u64 {
    (geom.nslabs as u64 * SLOT_STRUCT_BYTES).next_multiple_of(PAGE_BYTES)
        + geom.nareas as u64 * AREA_STRUCT_BYTES
}

/// What a guest is: its memory and CPUs, and whether its memory is encrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Guest {
    /// Guest memory in bytes, when known.
    pub mem_bytes: Option<u64>,
    /// CPUs.
    pub cpus: usize,
    /// A confidential guest (SEV, TDX): every DMA bounces without `force`, and the default pool
    /// is 6 % of memory.
    pub confidential: bool,
}

impl Guest {
    /// Refuses a pool the kernel cannot set up on this guest: larger than the memory below
    /// 4 GiB it is allocated from, or than the guest's memory.
    ///
    /// # Errors
    /// [`Error::Config`] naming the pool and the limit.
    pub fn check_pool(&self, geom: &Geometry) -> Result<(), Error> {
        let bytes = geom.nslabs as u64 * SLOT_BYTES;
        let (limit, what) = match self.mem_bytes {
            Some(m) if m < LOW_MEMORY_LIMIT => (m, "the guest's memory"),
            _ => (
                LOW_MEMORY_LIMIT,
                "the 4 GiB below which the kernel allocates it",
            ),
        };
        if bytes > limit {
            return Err(Error::Config(format!(
                "a pool of {} slots ({} MiB) is larger than {what} ({} MiB): the kernel \
                 cannot allocate it",
                geom.nslabs,
                bytes >> 20,
                limit >> 20
            )));
        }
        Ok(())
    }
}

/// True when `nslabs` slots in `nareas` areas is a pool Linux's rounding can produce (a power
/// of two of slots, a power of two of areas, at least one segment per area).
pub fn is_kernel_geometry(nslabs: usize, nareas: usize) -> bool {
    nslabs.is_power_of_two()
        && nareas.is_power_of_two()
        && nslabs >= IO_TLB_SEGSIZE.saturating_mul(nareas)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::PoolConfig;

    fn kernel_geometry(slots: usize, areas: Option<usize>, cpus: usize) -> crate::Result<Geometry> {
        let mut c = PoolConfig::swiotlb(slots);
        c.areas = areas;
        c.workers = cpus;
        c.geometry()
    }

    #[test]
    fn defaults_follow_mem_encrypt_setup_arch() {
        assert_eq!(default_slots(false, 0), 32768);
        // 6 % of 1 GiB is under 64 MiB: clamped up.
        assert_eq!(default_slots(true, 1 << 30), 32768);
        // 6 % of 4 GiB is 245.76 MiB: 125830 slots, 125952 after the segment alignment, and
        // the kernel rounds that up to 131072 (256 MiB).
        assert_eq!(default_slots(true, 4 << 30), 125_952);
        assert_eq!(kernel_geometry(125_952, None, 4).unwrap().nslabs, 131_072);
        // 6 % of 64 GiB is over 1 GiB: capped.
        assert_eq!(default_slots(true, 64 << 30), 524_288);
    }

    #[test]
    fn kernel_rounding_and_metadata() {
        let g = kernel_geometry(4224, Some(1), 2).unwrap();
        assert_eq!((g.nslabs, g.nareas), (8192, 1));
        // 8192 slots x 24 bytes = 48 pages; one area of 16 bytes.
        assert_eq!(metadata_bytes(&g), 48 * 4096 + 16);
        let g = kernel_geometry(1000, None, 3).unwrap();
        assert_eq!((g.nslabs, g.nareas), (1024, 4));
        assert!(is_kernel_geometry(1024, 4) && !is_kernel_geometry(1000, 1));
        assert!(!is_kernel_geometry(256, 4) && !is_kernel_geometry(1024, 3));
    }

    #[test]
    fn pools_the_kernel_cannot_allocate_are_refused() {
        let small = Guest {
            mem_bytes: Some(256 << 20),
            cpus: 1,
            confidential: false,
        };
        let g = kernel_geometry(262_144, Some(1), 1).unwrap();
        let e = small.check_pool(&g).unwrap_err().to_string();
        assert!(
            e.contains("262144 slots (512 MiB)") && e.contains("(256 MiB)"),
            "{e}"
        );
        assert!(small
            .check_pool(&kernel_geometry(4096, Some(1), 1).unwrap())
            .is_ok());
        let big = Guest {
            mem_bytes: None,
            ..small
        };
        let g = kernel_geometry(4 << 20, Some(1), 1).unwrap();
        assert!(big
            .check_pool(&g)
            .unwrap_err()
            .to_string()
            .contains("4 GiB"));
    }
}
