//! `bitmap`: one lock and a bitmap of slots in use, searched with a find-next-zero-area scan
//! from a rolling index (the first patch of the 2022 swiotlb series, "use bitmap to track free
//! slots").
//!
//! Where free-run counts make "is there a run at `i`" O(1) but need count fix-ups on every
//! allocation and release, a bitmap makes allocation and release a matter of setting and
//! clearing bits, and the search skips whole 64-slot words of used (or free) slots at a time.
//!
//! # The search
//! Candidates are the slots whose address satisfies the alignment rules, computed directly as
//! "index ≡ phase (mod align)" ([`SlotRequest::align_phase`]), so unaligned slots are never
//! visited. From the rolling index to the end of the range, then from the start of the range up
//! to the rolling index, the first candidate for which
//! - the run stays inside its segment (otherwise: jump to the next segment's first candidate),
//! - the run does not cross the device's segment boundary (otherwise: jump past the boundary),
//! - no bit of the run is set (otherwise: jump past the next free slot after the set bit)
//!
//! is claimed, and the rolling index moves just past it (wrapped to 0 at the end of the range).
//! Unlike the free-run search, this one is complete: it fails only when no run anywhere in the
//! range satisfies [`SlotRequest::fits`].

use crate::alloc::locked::{Locked, SlotRange, Split};
use crate::alloc::SlotRequest;
use crate::error::Result;
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

const WORD_BITS: usize = u64::BITS as usize;

/// A bitmap over a contiguous range of slots (bit set = slot in use), with its used count and
/// rolling index: the state one lock protects. Shared by `bitmap` (one for the pool) and
/// `areas-bitmap` (one per area).
#[derive(Debug)]
pub(crate) struct FreeBitmap {
    /// Absolute index of the first slot of the range.
    pub base: usize,
    /// Slots in the range.
    pub len: usize,
    /// Bit `i` of the range is bit `i % 64` of word `i / 64`; bits past `len` stay clear.
    words: Box<[u64]>,
    /// Slots in use in the range.
    pub used: usize,
    /// Where the next search starts, relative to `base`; always `< len`.
    pub index: usize,
}

/// Smallest `y >= x` with `y % align == phase` (`align` a power of two, `phase < align`).
pub(crate) fn align_up(x: usize, align: usize, phase: usize) -> Option<usize> {
    let rem = x & (align - 1);
    if rem <= phase {
        Some(x - rem + phase)
    } else {
        (x - rem).checked_add(align)?.checked_add(phase)
    }
}

impl FreeBitmap {
    /// A fully free range of `len` slots starting at absolute slot `base`.
    pub fn new(base: usize, len: usize) -> Self {
        Self {
            base,
            len,
            words: vec![0u64; len.div_ceil(WORD_BITS)].into_boxed_slice(),
            used: 0,
            index: 0,
        }
    }

    /// First set bit in `from..to` (relative), if any.
    fn next_set(&self, from: usize, to: usize) -> Option<usize> {
        self.next_matching(from, to, false)
    }

    /// First clear bit in `from..to` (relative), if any.
    fn next_clear(&self, from: usize, to: usize) -> Option<usize> {
        self.next_matching(from, to, true)
    }

    /// First bit in `from..to` that is clear (`want_clear`) or set; whole words at a time.
    fn next_matching(&self, from: usize, to: usize, want_clear: bool) -> Option<usize> {
        let mut i = from;
        while i < to {
            let w = i / WORD_BITS;
            let word = if want_clear {
                !self.words[w]
            } else {
                self.words[w]
            };
            let bits = word >> (i % WORD_BITS);
            if bits != 0 {
                let hit = i + bits.trailing_zeros() as usize;
                return (hit < to).then_some(hit);
            }
            i = (w + 1) * WORD_BITS;
        }
        None
    }

    /// Sets (`used`) or clears the bits of `from..from + n` (relative).
    fn set_range(&mut self, from: usize, n: usize, used: bool) {
        let mut i = from;
        let end = from + n;
        while i < end {
            let w = i / WORD_BITS;
            let lo = i % WORD_BITS;
            let hi = (end - w * WORD_BITS).min(WORD_BITS);
            let mask = if hi - lo == WORD_BITS {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            if used {
                self.words[w] |= mask;
            } else {
                self.words[w] &= !mask;
            }
            i = (w + 1) * WORD_BITS;
        }
    }

    /// True when every bit of `from..from + n` (relative) is set.
    fn all_set(&self, from: usize, n: usize) -> bool {
        self.next_clear(from, from + n).is_none()
    }

    /// The first candidate in absolute slots `from..to` whose run fits and is free.
    fn find(&self, geom: &Geometry, req: &SlotRequest, from: usize, to: usize) -> Option<usize> {
        let n = req.nslots;
        let end = self.base + self.len;
        let (align, phase) = req.align_phase(geom);
        let max_slots = (req.boundary_mask >> geom.slot_shift).checked_add(1)?;
        let boundary_base = geom.nr_slots(req.tbl_base(geom));
        let mut p = align_up(from, align, phase)?;
        loop {
            if p >= to || p.checked_add(n)? > end {
                return None;
            }
            let seg_off = p % geom.segsize;
            if seg_off + n > geom.segsize {
                p = align_up(p - seg_off + geom.segsize, align, phase)?;
                continue;
            }
            if req.crosses_boundary(geom, p) {
                let pos = boundary_base.wrapping_add(p as u64) & (max_slots - 1);
                let next = usize::try_from(max_slots - pos).ok()?;
                p = align_up(p.checked_add(next)?, align, phase)?;
                continue;
            }
            if !req.aligned(geom, p) {
                // Only reachable when a mask is not of the form 2^k - 1 and the phase is not
                // exact: fall back to a linear step.
                p = align_up(p + 1, align, phase)?;
                continue;
            }
            let r = p - self.base;
            match self.next_set(r, r + n) {
                None => return Some(p),
                Some(q) => {
                    let z = self.next_clear(q + 1, self.len)?;
                    p = align_up(self.base + z, align, phase)?;
                }
            }
        }
    }

    /// Finds and claims a run for `req`, returning its absolute first slot.
    pub fn alloc(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        let n = req.nslots;
        if n == 0 || n > self.len - self.used || n > geom.segsize {
            return None;
        }
        let start = self.base + self.index;
        let end = self.base + self.len;
        let p = self
            .find(geom, req, start, end)
            .or_else(|| self.find(geom, req, self.base, start))?;
        let r = p - self.base;
        self.set_range(r, n, true);
        self.used += n;
        self.index = if r + n >= self.len { 0 } else { r + n };
        Some(p)
    }

    /// Releases `index..index + nslots` (absolute). Returns false, changing nothing, when the
    /// run is not inside this range or not entirely in use.
    pub fn free(&mut self, index: usize, nslots: usize) -> bool {
        let Some(r) = index.checked_sub(self.base) else {
            return false;
        };
        if nslots == 0 || r >= self.len || nslots > self.len - r || !self.all_set(r, nslots) {
            return false;
        }
        self.set_range(r, nslots, false);
        self.used -= nslots;
        true
    }
}

impl SlotRange for FreeBitmap {
    fn alloc(&mut self, geom: &Geometry, req: &SlotRequest) -> Option<usize> {
        FreeBitmap::alloc(self, geom, req)
    }

    fn used(&self) -> usize {
        self.used
    }

    fn index(&self) -> usize {
        self.index
    }

    fn release(&mut self, _geom: &Geometry, index: usize, nslots: usize) -> bool {
        self.free(index, nslots)
    }
}

/// Builds `bitmap`: one lock, one bitmap over the whole pool, one rolling index, every slot
/// free and the index at 0. Areas of the geometry are ignored.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for an inconsistent geometry.
pub(crate) fn new(geom: &Geometry) -> Result<Locked<FreeBitmap>> {
    Locked::new(
        AllocatorKind::Bitmap,
        geom,
        Split::Whole,
        false,
        FreeBitmap::new,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::SlotAllocator;
    use crate::DEFAULT_SEG_BOUNDARY_MASK;

    fn geom(slots: usize, base: u64) -> Geometry {
        crate::alloc::test_geometry(slots, 1, 1, base)
    }

    fn req(g: &Geometry, orig: u64, size: u64, min_align: u64) -> SlotRequest {
        SlotRequest::new(g, orig, size, 0, min_align, DEFAULT_SEG_BOUNDARY_MASK, 0)
    }

    #[test]
    fn align_up_finds_the_next_phase() {
        assert_eq!(align_up(0, 4, 0), Some(0));
        assert_eq!(align_up(1, 4, 0), Some(4));
        assert_eq!(align_up(5, 4, 3), Some(7));
        assert_eq!(align_up(7, 4, 1), Some(9));
        assert_eq!(align_up(usize::MAX - 1, 4, 0), None);
    }

    #[test]
    fn bit_ranges_across_words() {
        let mut b = FreeBitmap::new(0, 200);
        b.set_range(60, 70, true);
        assert_eq!(b.next_set(0, 200), Some(60));
        assert_eq!(b.next_clear(60, 200), Some(130));
        assert!(b.all_set(60, 70));
        assert!(!b.all_set(59, 2));
        b.set_range(64, 64, false);
        assert_eq!(b.next_clear(60, 200), Some(64));
        assert_eq!(b.next_set(64, 128), None);
        assert_eq!(b.next_set(64, 200), Some(128));
    }

    #[test]
    fn alignment_rules() {
        let g = geom(256, 0x4000_0000);
        let a = new(&g).unwrap();
        assert_eq!(a.alloc(&req(&g, 0, 16, 0)), Some(0));
        // A page or more: page aligned.
        assert_eq!(a.alloc(&req(&g, 0, 4096, 0)), Some(2));
        // min_align_mask 0xfff with bit 11 set in the original: odd slot.
        let r = req(&g, 0x1234_5800, 100, 0xfff);
        assert_eq!(a.alloc(&r), Some(5));
        // alloc_align_mask 16 KiB: multiple of 8 slots.
        let r = SlotRequest::new(&g, 0, 100, 0x3fff, 0, DEFAULT_SEG_BOUNDARY_MASK, 0);
        assert_eq!(a.alloc(&r), Some(8));
    }

    #[test]
    fn segments_and_boundaries() {
        let g = geom(256, 0x4000_0000);
        let a = new(&g).unwrap();
        assert_eq!(a.alloc(&req(&g, 0, 100 * 2048, 0)), Some(0));
        assert_eq!(a.alloc(&req(&g, 0, 64 * 2048, 0)), Some(128));
        assert_eq!(a.alloc(&req(&g, 0, 128 * 2048, 0)), None);
        // 32-slot boundary: slot 192 is free but 30..34-style crossings are refused.
        let r = SlotRequest::new(&g, 0, 3 * 2048 - 1, 0, 0, 0xffff, 0);
        assert_eq!(a.alloc(&r), Some(192));
        a.free(192, 3, 0);
        for i in 0..29 {
            let one = SlotRequest::new(&g, 0, 1, 0, 0, 0xffff, 0);
            assert_eq!(a.alloc(&one), Some(192 + 3 + i), "{i}");
        }
        // Rolling index at 224: slot 192..195 is behind it and is found after the wrap... but
        // first the run at 224 fits.
        assert_eq!(a.alloc(&r), Some(224));
    }

    #[test]
    fn search_is_complete_behind_the_rolling_index() {
        let g = geom(128, 0x4000_0000);
        let a = new(&g).unwrap();
        let one = req(&g, 0, 1, 0);
        for i in 0..128 {
            assert_eq!(a.alloc(&one), Some(i));
        }
        assert_eq!(a.area_index(), vec![0]);
        for i in [3, 4, 5, 6, 70, 71] {
            a.free(i, 1, 0);
        }
        // Three slots, a page or more: page aligned, so 4..7 and not 3..6.
        let three = req(&g, 0, 3 * 2048 - 100, 0);
        assert_eq!(a.alloc(&three), Some(4));
        assert_eq!(a.area_index(), vec![7]);
        assert_eq!(a.alloc(&req(&g, 0, 4000, 0)), Some(70));
        assert_eq!(a.area_used(), vec![127]);
        a.free(70, 2, 0);
        a.free(70, 2, 0); // double free: refused
        assert_eq!(a.area_used(), vec![125]);
    }

    #[test]
    fn impossible_requests_fail_without_panicking() {
        let g = geom(256, 0x4000_0000);
        let a = new(&g).unwrap();
        let mut r = req(&g, 0, 1, 0);
        for n in [0, 129, 256, usize::MAX] {
            r.nslots = n;
            assert_eq!(a.alloc(&r), None);
        }
        r.nslots = 1;
        r.alloc_align_mask = u64::MAX;
        assert_eq!(a.alloc(&r), None);
        r.alloc_align_mask = 0x7ff;
        r.boundary_mask = 0x7ff;
        assert_eq!(a.alloc(&r), Some(0));
        r.nslots = 2;
        assert_eq!(a.alloc(&r), None);
        for (i, n) in [(0, 0), (5, 1), (255, 2), (usize::MAX, 1)] {
            a.free(i, n, 0);
        }
        assert_eq!(a.area_used(), vec![1]);
    }
}
