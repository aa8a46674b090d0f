//! The memory regions a front end added one by one (`CONFIGURE_MEM_SLOTS`: `ADD_MEM_REG`,
//! `REM_MEM_REG`), as the relay sees them.
//!
//! QEMU up to 8.0 sends `ADD_MEM_REG` and `REM_MEM_REG` once per vhost device, and its
//! multi-queue vhost-user net keeps one vhost device per queue pair on the one connection: each
//! region is added once per queue pair, and removed as many times. `vhost-user-backend` refuses
//! the second add as overlapping and the session ends. QEMU's own back ends
//! (`libvhost-user`) accepted the copies and, on a removal, dropped every copy of the region
//! (matched by guest address, size and front-end address). Here an add identical to a region
//! already added (all four fields) is a reference more to that region: it is acknowledged
//! without mapping anything again, and only the removal of its last reference reaches the
//! backend, so the region stays mapped while any copy is registered. A region that overlaps
//! another without being identical goes to the backend, which refuses it.
//!
//! What is kept is bounded: one entry per region the backend holds, at most
//! [`MAX_MEM_SLOTS`] (the count `GET_MAX_MEM_SLOTS` answers): a new region beyond that is
//! refused.

use std::collections::BTreeMap;

use crate::checks::Region;

/// The most regions a front end may add (what `vhost-user-backend` answers to
/// `GET_MAX_MEM_SLOTS`).
pub const MAX_MEM_SLOTS: usize = 509;

/// What to do with an `ADD_MEM_REG`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Add {
    /// A new region: the backend maps it.
    New,
    /// A copy of a region already added: acknowledged here, nothing to map.
    Copy,
}

/// What to do with a `REM_MEM_REG`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remove {
    /// The last reference: the backend unmaps the region (or refuses a region it never had).
    Last,
    /// Other copies remain: acknowledged here, the region stays mapped.
    Copy,
}

/// The added regions and how many times each was added.
#[derive(Debug, Default)]
pub struct Slots {
    regions: BTreeMap<(u64, u64, u64, u64), u64>,
}

fn key(r: &Region) -> (u64, u64, u64, u64) {
    (r.gpa, r.size, r.uaddr, r.offset)
}

impl Slots {
    /// Whether an `ADD_MEM_REG` of `r` fits: a copy always does, a new region while fewer than
    /// [`MAX_MEM_SLOTS`] are held.
    pub fn fits(&self, r: &Region) -> bool {
        self.regions.contains_key(&key(r)) || self.regions.len() < MAX_MEM_SLOTS
    }

    /// An `ADD_MEM_REG` of `r` (that [`Slots::fits`]).
    pub fn add(&mut self, r: &Region) -> Add {
        let n = self.regions.entry(key(r)).or_insert(0);
        *n = n.saturating_add(1);
        if *n == 1 {
            Add::New
        } else {
            Add::Copy
        }
    }

    /// A `REM_MEM_REG` of `r`.
    pub fn remove(&mut self, r: &Region) -> Remove {
        match self.regions.get_mut(&key(r)) {
            Some(n) if *n > 1 => {
                *n -= 1;
                Remove::Copy
            }
            Some(_) => {
                self.regions.remove(&key(r));
                Remove::Last
            }
            None => Remove::Last,
        }
    }

    /// `SET_MEM_TABLE` replaces every region (and a reset forgets them with the session's
    /// memory).
    pub fn clear(&mut self) {
        self.regions.clear();
    }

    /// Regions held.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(gpa: u64, size: u64) -> Region {
        Region {
            gpa,
            size,
            uaddr: 0x7f00_0000_0000 + gpa,
            offset: 0,
        }
    }

    #[test]
    fn copies_of_a_region_are_references_and_only_the_last_removal_unmaps() {
        let mut s = Slots::default();
        let (a, b) = (region(0, 1 << 20), region(1 << 20, 1 << 20));
        // QEMU 7.2's multi-queue net, two queue pairs: every region twice.
        assert_eq!(s.add(&a), Add::New);
        assert_eq!(s.add(&b), Add::New);
        assert_eq!(s.add(&a), Add::Copy);
        assert_eq!(s.add(&b), Add::Copy);
        assert_eq!(s.len(), 2);
        assert_eq!(s.remove(&b), Remove::Copy);
        assert_eq!(s.remove(&b), Remove::Last);
        assert_eq!(s.len(), 1);
        // Unknown to the relay: the backend decides (it refuses).
        assert_eq!(s.remove(&b), Remove::Last);
        // Same guest range from another file offset or address: not a copy.
        let mut moved = a;
        moved.offset = 4096;
        assert_eq!(s.add(&moved), Add::New);
        s.clear();
        assert!(s.is_empty());
    }

    #[test]
    fn adds_beyond_the_slot_count_are_refused_and_copies_are_not_counted() {
        let mut s = Slots::default();
        for i in 0..MAX_MEM_SLOTS as u64 {
            assert!(s.fits(&region(i << 12, 4096)));
            assert_eq!(s.add(&region(i << 12, 4096)), Add::New);
        }
        assert!(!s.fits(&region(1 << 40, 4096)));
        assert!(s.fits(&region(0, 4096)));
        assert_eq!(s.add(&region(0, 4096)), Add::Copy);
        assert_eq!(s.len(), MAX_MEM_SLOTS);
    }
}
