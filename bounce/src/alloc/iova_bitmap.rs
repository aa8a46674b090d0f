//! `iova-bitmap`: per-worker bitmaps for small requests in front of an [`IovaTree`], after the
//! 2015 LKML proposal "iommu: iova: use per-cpu bitmaps for small IOVA allocations".
//!
//! The idea: most DMA mappings are one or two pages, and serving them from a bitmap private to
//! the CPU avoids the shared rbtree lock altogether; only large mappings (and small ones whose
//! CPU ran out) pay for the tree.
//!
//! **Layout.** The lower half of the domain is split into `nworkers` equal chunks, one bitmap per
//! worker, each under its own lock; the upper half (plus whatever the equal split leaves over) is
//! an [`IovaTree`] under one lock, allocated top-down with size alignment as `iova-rbtree` is.
//! Half-and-half keeps the tree big enough for the large mappings (a block device's 128 KiB–
//! 1 MiB requests) while each worker still gets a private pool of `nslabs / (2 * nworkers)`
//! small slots. When that is zero (a tiny domain or very many workers) there are no bitmaps and
//! everything goes to the tree.
//!
//! **Small** means at most [`SMALL_BYTES`] (8 KiB) in the pool's granule units:
//! `nslots * slot_size <= 8192`, i.e. one or two 4 KiB granules in iova mode, up to four 2 KiB
//! slots in swiotlb mode.
//!
//! **Allocation.** A small request searches its worker's bitmap first fit (honouring the
//! request's placement rules; no size alignment), then falls back to the tree. Before failing it
//! also tries the other workers' bitmaps in turn, as swiotlb walks its other areas: a chunk is a
//! partition, not a cache, and without this step a worker could fail while the domain still has
//! free small slots elsewhere (the proposal leaves this case open). Large requests use the tree
//! only, so the largest mapping is bounded by the tree's half of the domain.
//!
//! **Free** routes by address: an index inside a chunk clears bits in that chunk's bitmap,
//! whoever frees it; anything else is freed in the tree.
//!
//! Lock order: a bitmap lock is never held while taking another lock.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::genpool::{find_zero_area, word_mask, WORD_BITS};
use super::iova_rbtree::{IovaTree, Placement};
use super::{LockSnapshot, SlotAllocator, SlotRequest, TimedMutex};
use crate::geometry::Geometry;
use crate::types::AllocatorKind;

/// The largest request, in bytes, served from the per-worker bitmaps.
pub const SMALL_BYTES: u64 = 8192;

/// One worker's bitmap over slots `lo..hi`, stored as the global words that cover that range;
/// bits of those words outside `lo..hi` stay set so the search never picks them.
#[derive(Debug)]
struct WorkerBitmap {
    lo: usize,
    hi: usize,
    /// Global word index of `words[0]`.
    first_word: usize,
    words: Vec<u64>,
    /// Slots allocated from this bitmap.
    used: usize,
}

impl WorkerBitmap {
    fn new(lo: usize, hi: usize) -> Self {
        let first_word = lo / WORD_BITS;
        let last_word = (hi - 1) / WORD_BITS;
        let words = (first_word..=last_word)
            .map(|w| !word_mask(w, lo, hi))
            .collect();
        Self {
            lo,
            hi,
            first_word,
            words,
            used: 0,
        }
    }

    fn word(&self, w: usize) -> u64 {
        w.checked_sub(self.first_word)
            .and_then(|i| self.words.get(i))
            .copied()
            .unwrap_or(u64::MAX)
    }

    fn alloc(&mut self, geom: &Geometry, p: &Placement) -> Option<usize> {
        let x = find_zero_area(geom, p, self.lo, self.hi, |w| self.word(w))?;
        let end = x + p.nslots();
        for w in x / WORD_BITS..=(end - 1) / WORD_BITS {
            self.words[w - self.first_word] |= word_mask(w, x, end);
        }
        self.used += p.nslots();
        Some(x)
    }

    fn free(&mut self, index: usize, nslots: usize) {
        let end = index.saturating_add(nslots).min(self.hi);
        if index >= end {
            return;
        }
        for w in index / WORD_BITS..=(end - 1) / WORD_BITS {
            let mask = word_mask(w, index, end);
            let word = &mut self.words[w - self.first_word];
            let held = *word & mask;
            if held != mask {
                tracing::error!(
                    index,
                    nslots,
                    "iova-bitmap: free of slots that were not allocated"
                );
            }
            *word &= !mask;
            self.used -= held.count_ones() as usize;
        }
    }
}

/// The `iova-bitmap` allocator.
#[derive(Debug)]
pub struct IovaBitmap {
    geom: Geometry,
    /// Slots per worker chunk (0: no bitmaps).
    chunk: usize,
    /// One per worker; chunk `w` is slots `w * chunk..(w + 1) * chunk`.
    bitmaps: Vec<TimedMutex<WorkerBitmap>>,
    /// The rest of the domain, `bitmaps.len() * chunk..nslabs`.
    tree: TimedMutex<IovaTree>,
    /// Slots the tree holds, readable without its lock.
    tree_used: AtomicUsize,
}

impl IovaBitmap {
    /// An allocator for `geom`: half the domain in per-worker chunks, half in the tree.
    pub fn new(geom: &Geometry) -> Self {
        let nworkers = geom.nworkers.max(1);
        let chunk = geom.nslabs / 2 / nworkers;
        let nchunks = if chunk == 0 { 0 } else { nworkers };
        let bitmaps = (0..nchunks)
            .map(|w| TimedMutex::new(WorkerBitmap::new(w * chunk, (w + 1) * chunk)))
            .collect();
        Self {
            geom: *geom,
            chunk,
            bitmaps,
            tree: TimedMutex::new(IovaTree::new(nchunks * chunk, geom.nslabs)),
            tree_used: AtomicUsize::new(0),
        }
    }

    /// Slots per worker bitmap (0 when the domain is too small to have any).
    pub fn chunk_slots(&self) -> usize {
        self.chunk
    }

    fn is_small(&self, nslots: usize) -> bool {
        (nslots as u64)
            .checked_mul(self.geom.slot_size())
            .is_some_and(|b| b <= SMALL_BYTES)
    }

    fn bitmap_alloc(&self, w: usize, p: &Placement) -> Option<usize> {
        self.bitmaps[w].lock().alloc(&self.geom, p)
    }

    fn tree_alloc(&self, req: &SlotRequest) -> Option<usize> {
        let p = Placement::new(&self.geom, req, true)?;
        let size_only = Placement::size_only(&self.geom, req);
        let mut t = self.tree.lock();
        let x = t.alloc(&self.geom, &p, size_only)?;
        self.tree_used.store(t.used(), Ordering::Relaxed);
        Some(x)
    }
}

impl SlotAllocator for IovaBitmap {
    fn kind(&self) -> AllocatorKind {
        AllocatorKind::IovaBitmap
    }

    fn alloc(&self, req: &SlotRequest) -> Option<usize> {
        let n = self.bitmaps.len();
        let small = n > 0 && self.is_small(req.nslots);
        let p = if small {
            Some(Placement::new(&self.geom, req, false)?)
        } else {
            None
        };
        let own = req.worker % n.max(1);
        if let Some(p) = &p {
            if let Some(x) = self.bitmap_alloc(own, p) {
                return Some(x);
            }
        }
        if let Some(x) = self.tree_alloc(req) {
            return Some(x);
        }
        let p = p?;
        (1..n).find_map(|k| self.bitmap_alloc((own + k) % n, &p))
    }

    fn free(&self, index: usize, nslots: usize, _worker: usize) {
        if self.chunk > 0 && index < self.bitmaps.len() * self.chunk {
            self.bitmaps[index / self.chunk].lock().free(index, nslots);
            return;
        }
        let mut t = self.tree.lock();
        match t.free(index) {
            Some(_) => self.tree_used.store(t.used(), Ordering::Relaxed),
            None => tracing::warn!(index, nslots, "iova-bitmap: free of an unallocated pfn"),
        }
    }

    fn area_used(&self) -> Vec<usize> {
        let bitmaps: usize = self.bitmaps.iter().map(|b| b.lock().used).sum();
        vec![bitmaps + self.tree_used.load(Ordering::Relaxed)]
    }

    /// The tree lock, then one lock per worker bitmap.
    fn lock_stats(&self) -> Vec<LockSnapshot> {
        std::iter::once(&self.tree)
            .map(TimedMutex::snapshot)
            .chain(self.bitmaps.iter().map(TimedMutex::snapshot))
            .collect()
    }

    fn reset_lock_stats(&self) {
        self.tree.reset_stats();
        self.bitmaps.iter().for_each(TimedMutex::reset_stats);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::iova_rbtree::test_support::*;
    use super::*;

    #[test]
    fn small_requests_use_own_bitmap_large_ones_the_tree() {
        let (g, a) = build(iova_geom(1024, 4), IovaBitmap::new);
        assert_eq!(a.chunk_slots(), 128);
        // Worker 2's chunk is 256..384, first fit.
        assert_eq!(a.alloc(&plain(&g, 1, 2)), Some(256));
        assert_eq!(a.alloc(&plain(&g, 2, 6)), Some(257));
        // Three granules (12 KiB) are large: the tree, top-down, size-aligned to 4 device pfns.
        let x = a.alloc(&plain(&g, 3, 2)).unwrap();
        assert!(x >= 512);
        assert_eq!((x + 1) % 4, 0);
        // Size alignment places the run; the tree holds only its three slots.
        assert_eq!(a.area_used(), vec![1 + 2 + 3]);
        // Cross-worker free routes by address.
        a.free(257, 2, 0);
        a.free(x, 3, 1);
        a.free(256, 1, 3);
        assert_eq!(a.area_used(), vec![0]);
        assert_eq!(a.lock_stats().len(), 5);
    }

    #[test]
    fn full_bitmap_falls_back_to_tree_then_other_bitmaps() {
        let (g, a) = build(iova_geom(64, 2), IovaBitmap::new);
        assert_eq!(a.chunk_slots(), 16);
        // Worker 0 fills its chunk, then the tree (32..64), then worker 1's chunk.
        let xs = alloc_n(&a, &plain(&g, 1, 0), 64);
        assert!(xs[..16].iter().all(|&x| x < 16));
        assert!(xs[16..48].iter().all(|&x| x >= 32));
        assert!(xs[48..].iter().all(|&x| (16..32).contains(&x)));
        assert!(a.alloc(&plain(&g, 1, 1)).is_none());
        for (k, x) in xs.into_iter().enumerate() {
            a.free(x, 1, k);
        }
        assert_eq!(a.area_used(), vec![0]);
    }

    #[test]
    fn tiny_domain_has_no_bitmaps() {
        let (g, a) = build(iova_geom(5, 8), IovaBitmap::new);
        assert_eq!(a.chunk_slots(), 0);
        assert_eq!(a.lock_stats().len(), 1);
        check_exhaustion(&a, &g, &|| {});
    }

    #[test]
    fn unaligned_chunks() {
        // 400 slots, 3 workers: chunks of 66 at 0, 66, 132, which do not start or end on a
        // bitmap word boundary.
        let (g, a) = build(iova_geom(400, 3), IovaBitmap::new);
        assert_eq!(a.chunk_slots(), 66);
        let xs = alloc_n(&a, &plain(&g, 1, 1), 66);
        assert_eq!(xs, (66..132).collect::<Vec<_>>());
        // Worker 1's chunk is full: the next small request goes to the tree.
        assert!(a.alloc(&plain(&g, 1, 1)).unwrap() >= 198);
        check_alignment(&a, &g);
    }

    uncached_allocator_tests!(IovaBitmap::new, AllocatorKind::IovaBitmap, exhaust_workers: 3, stress_workers: 4);
}
