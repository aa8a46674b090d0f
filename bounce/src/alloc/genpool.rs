//! `genpool`: a lock-free first-fit bitmap, after Linux `lib/genalloc.c` (`gen_pool_alloc`
//! with `gen_pool_first_fit`, `gen_pool_free`).
//!
//! One bit per slot in `AtomicU64` words, set while the slot is allocated. An allocation searches
//! from slot 0 for the first run of clear bits that satisfies the request's placement rules
//! (Linux `bitmap_find_next_zero_area_off`: find the next clear bit, move up to the next aligned
//! start, look for a set bit inside the run, restart after it), then claims the run word by word,
//! each word with a compare-and-swap that fails if any bit of the run in that word is already set
//! (Linux `set_bits_ll`). If another thread got there first, the words already claimed are
//! cleared again (`bitmap_clear_ll` of the part that was set) and the search restarts from the
//! same start. A free clears the run's bits word by word atomically. No lock anywhere: the search
//! reads words without ordering guarantees and the compare-and-swap is the only arbiter.
//!
//! Memory ordering: a claim is an acquire (it must see the previous owner's writes to the slot
//! metadata, made before that owner's release), a free is a release.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::iova_rbtree::Placement;
use super::{LockSnapshot, SlotAllocator, SlotRequest};
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// Bits per bitmap word.
pub(crate) const WORD_BITS: usize = 64;

/// The bits of word `w` that lie in `from..to` (global bit indices).
pub(crate) fn word_mask(w: usize, from: usize, to: usize) -> u64 {
    let base = w.saturating_mul(WORD_BITS);
    let lo = from.saturating_sub(base).min(WORD_BITS);
    let hi = to.saturating_sub(base).min(WORD_BITS);
    if hi <= lo {
        return 0;
    }
    let ones = if hi - lo == WORD_BITS {
        u64::MAX
    } else {
        (1u64 << (hi - lo)) - 1
    };
    ones << lo
}

/// The first bit in `from..to` that is set (`want_set`) or clear (`!want_set`), reading words
/// through `word` (global word index -> bits).
fn find_bit(word: &impl Fn(usize) -> u64, from: usize, to: usize, want_set: bool) -> Option<usize> {
    if from >= to {
        return None;
    }
    let mut w = from / WORD_BITS;
    while w * WORD_BITS < to {
        let bits = if want_set { word(w) } else { !word(w) };
        let hit = bits & word_mask(w, from, to);
        if hit != 0 {
            return Some(w * WORD_BITS + hit.trailing_zeros() as usize);
        }
        w += 1;
    }
    None
}

/// The lowest run in `from..end` whose bits are all clear and that satisfies `p` (Linux
/// `bitmap_find_next_zero_area_off`, generalised to the request's placement rules).
pub(crate) fn find_zero_area(
    geom: &Geometry,
    p: &Placement,
    from: usize,
    end: usize,
    word: impl Fn(usize) -> u64,
) -> Option<usize> {
    let mut x = from;
    loop {
        let zero = find_bit(&word, x, end, false)?;
        let start = p.lowest(geom, zero, end)?;
        match find_bit(&word, start, start + p.nslots(), true) {
            None => return Some(start),
            Some(b) => x = b + 1,
        }
    }
}

/// The `genpool` allocator.
#[derive(Debug)]
pub struct Genpool {
    geom: Geometry,
    /// Bit `i % 64` of word `i / 64` is set while slot `i` is allocated.
    bits: Box<[AtomicU64]>,
    /// Slots allocated (Linux keeps the opposite, `avail`, per chunk).
    used: AtomicUsize,
}

impl Genpool {
    /// An allocator over all of `geom`'s slots.
    pub fn new(geom: &Geometry) -> Self {
        let nwords = geom.nslabs.div_ceil(WORD_BITS);
        Self {
            geom: *geom,
            bits: (0..nwords).map(|_| AtomicU64::new(0)).collect(),
            used: AtomicUsize::new(0),
        }
    }

    /// Sets the bits of `start..end`, all of which must have been clear. On a conflict, clears
    /// what it set and returns false (Linux `bitmap_set_ll` then `bitmap_clear_ll`).
    fn claim(&self, start: usize, end: usize) -> bool {
        let (first, last) = (start / WORD_BITS, (end - 1) / WORD_BITS);
        for w in first..=last {
            let mask = word_mask(w, start, end);
            let word = &self.bits[w];
            let mut old = word.load(Ordering::Relaxed);
            loop {
                if old & mask != 0 {
                    // Roll back the words claimed so far; nobody else touched their run bits.
                    for v in first..w {
                        self.bits[v].fetch_and(!word_mask(v, start, end), Ordering::Relaxed);
                    }
                    return false;
                }
                match word.compare_exchange_weak(
                    old,
                    old | mask,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => old = now,
                }
            }
        }
        true
    }
}

impl SlotAllocator for Genpool {
    fn kind(&self) -> AllocatorKind {
        AllocatorKind::Genpool
    }

    fn alloc(&self, req: &SlotRequest) -> Option<usize> {
        let p = Placement::new(&self.geom, req, false)?;
        let n = p.nslots();
        let nslabs = self.geom.nslabs;
        let word = |w: usize| {
            self.bits
                .get(w)
                .map_or(u64::MAX, |b| b.load(Ordering::Relaxed))
        };
        let mut from = 0;
        loop {
            let start = find_zero_area(&self.geom, &p, from, nslabs, word)?;
            if self.claim(start, start + n) {
                self.used.fetch_add(n, Ordering::Relaxed);
                return Some(start);
            }
            // Lost a race: search again from the same place; the winner's bits are set now.
            from = start;
        }
    }

    fn free(&self, index: usize, nslots: usize, _worker: usize) {
        let Some(end) = index
            .checked_add(nslots)
            .filter(|&e| e <= self.geom.nslabs && nslots > 0)
        else {
            tracing::warn!(index, nslots, "genpool: free outside the pool");
            return;
        };
        let mut cleared = 0;
        for w in index / WORD_BITS..=(end - 1) / WORD_BITS {
            let mask = word_mask(w, index, end);
            let old = self.bits[w].fetch_and(!mask, Ordering::Release);
            cleared += (old & mask).count_ones() as usize;
            if old & mask != mask {
                tracing::error!(
                    index,
                    nslots,
                    "genpool: free of slots that were not allocated"
                );
            }
        }
        self.used.fetch_sub(cleared, Ordering::Relaxed);
    }

    fn area_used(&self) -> Vec<usize> {
        vec![self.used.load(Ordering::Relaxed)]
    }

    fn lock_stats(&self) -> Vec<LockSnapshot> {
        Vec::new()
    }

    fn reset_lock_stats(&self) {}
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::iova_rbtree::test_support::*;
    use super::*;

    #[test]
    fn masks() {
        assert_eq!(word_mask(0, 0, 64), u64::MAX);
        assert_eq!(word_mask(0, 3, 5), 0b11000);
        assert_eq!(word_mask(1, 60, 70), 0b11_1111);
        assert_eq!(word_mask(2, 60, 70), 0);
        assert_eq!(word_mask(0, 70, 80), 0);
        assert_eq!(word_mask(1, 0, 200), u64::MAX);
    }

    #[test]
    fn first_fit_from_the_bottom() {
        let (g, a) = build(iova_geom(200, 1), Genpool::new);
        expect_plain(&a, &g, &[(3, Some(0)), (70, Some(3)), (1, Some(73))]);
        a.free(0, 3, 0);
        expect_plain(&a, &g, &[(2, Some(0)), (2, Some(74)), (1, Some(2))]);
        assert_eq!(a.area_used(), vec![3 + 70 + 1 + 2 + 2 + 1 - 3]);
        assert!(a.lock_stats().is_empty());
    }

    #[test]
    fn claim_rolls_back_on_conflict() {
        let (g, a) = build(iova_geom(256, 1), Genpool::new);
        // Someone holds slot 130: a claim of 60..140 sets words 0 and 1, fails on word 2, and
        // leaves nothing set behind.
        a.bits[2].store(1 << 2, Ordering::Relaxed);
        assert!(!a.claim(60, 140));
        assert_eq!(a.bits[0].load(Ordering::Relaxed), 0);
        assert_eq!(a.bits[1].load(Ordering::Relaxed), 0);
        assert_eq!(a.bits[2].load(Ordering::Relaxed), 1 << 2);
        // The search steps over the held slot.
        assert_eq!(a.alloc(&plain(&g, 80, 0)), Some(0));
        assert_eq!(a.alloc(&plain(&g, 60, 0)), Some(131));
    }

    #[test]
    fn double_free_is_reported_not_fatal() {
        let (g, a) = build(iova_geom(64, 1), Genpool::new);
        let x = a.alloc(&plain(&g, 4, 0)).unwrap();
        a.free(x, 4, 0);
        a.free(x, 4, 0);
        a.free(60, 10, 0);
        a.free(usize::MAX, 2, 0);
        assert_eq!(a.area_used(), vec![0]);
    }

    #[test]
    fn segments_are_not_crossed() {
        let (g, a) = build(swiotlb_geom(512, 1), Genpool::new);
        // The second 100 do not fit in segment 0 (28 left): they start at segment 1 (page
        // aligned).
        expect_plain(&a, &g, &[(100, Some(0)), (100, Some(128)), (28, Some(100))]);
    }

    uncached_allocator_tests!(Genpool::new, AllocatorKind::Genpool, exhaust_workers: 2, stress_workers: 8);
}
