//! What guest memory looks like at one moment: its regions' guest addresses, lengths and host
//! addresses. Kept by whoever derives something from the memory once and reuses it while the
//! memory stays the same: a queue's rings found inside it ([`super::dispatch`]), a clone of it
//! kept alive for in-flight I/O ([`crate::block::inflight::MemPin`]). A transport may replace
//! the memory at any time (vhost-user `SET_MEM_TABLE`); comparing the layout in place costs a
//! few loads per region and allocates nothing.

use vm_memory::{GuestMemory, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

/// The regions of a guest memory: guest address, length, host address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemLayout(Vec<(u64, u64, usize)>);

/// One region's entry of a [`MemLayout`].
fn region_entry<R: GuestMemoryRegion>(r: &R) -> (u64, u64, usize) {
    (
        r.start_addr().0,
        r.len(),
        r.get_host_address(MemoryRegionAddress(0))
            .map_or(0, |p| p as usize),
    )
}

impl MemLayout {
    /// The layout of `mem`, or `None` for a memory without a physical view (then nothing can
    /// be compared, and whatever was derived from it must be derived again each time).
    pub fn of<M: GuestMemory + ?Sized>(mem: &M) -> Option<Self> {
        let phys = mem.physical_memory()?;
        Some(Self(phys.iter().map(region_entry).collect()))
    }

    /// True when `mem`'s regions are exactly these (compared in place: no allocation).
    pub fn matches<M: GuestMemory + ?Sized>(&self, mem: &M) -> bool {
        let Some(phys) = mem.physical_memory() else {
            return false;
        };
        let mut n = 0;
        for r in phys.iter() {
            if self.0.get(n) != Some(&region_entry(r)) {
                return false;
            }
            n += 1;
        }
        n == self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    #[test]
    fn a_layout_matches_its_memory_and_clones_but_not_a_new_table() {
        let a = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let l = MemLayout::of(&a).unwrap();
        assert!(l.matches(&a));
        assert!(l.matches(&a.clone()), "a clone shares the mappings");
        let b = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        assert!(!l.matches(&b), "same guest range, another mapping");
        let c = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x20000), 0x10000),
        ])
        .unwrap();
        assert!(!MemLayout::of(&c).unwrap().matches(&a), "a region fewer");
        assert!(!l.matches(&c), "a region more");
    }
}
