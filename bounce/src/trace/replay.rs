//! Replaying operations through a [`BouncePool`], with the comparison against the kernel's
//! decisions.

use std::collections::HashMap;

use vm_memory::VolatileSlice;

use super::parse::{KernelCounters, KernelDecision, MapOp, TraceHeader, TraceOp};
use super::Result;
use crate::dynamic::{worker_sizes, DynamicConfig, DynamicEvents, PoolKind, PoolPages};
use crate::error::Error;
use crate::geometry::{PoolConfig, SizeLimit};
use crate::orig::OrigMemory;
use crate::pool::{BouncePool, Mapping};
use crate::types::{AllocatorKind, DmaAttrs, MapRequest, PoolMode, SyncFor};
use crate::DEFAULT_SEG_BOUNDARY_MASK;

/// Original memory that is not there: every address is accessible, reads produce zeros, writes
/// are discarded. Replays use it so they measure placement, not copies to a vanished guest.
#[derive(Clone, Copy, Debug, Default)]
pub struct NullMemory;

impl OrigMemory for NullMemory {
    fn check(&self, _addr: u64, _len: usize, _write: bool) -> bool {
        true
    }

    fn read_orig(&self, addr: u64, dst: &VolatileSlice<'_>) -> crate::Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let len = dst.len();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZEROS.len());
            dst.subslice(done, n)
                .map_err(|_| Error::OrigAccess { addr, len })?
                .copy_from(&ZEROS[..n]);
            done += n;
        }
        Ok(())
    }

    fn write_orig(&self, _addr: u64, _src: &VolatileSlice<'_>) -> crate::Result<()> {
        Ok(())
    }
}

// Field list of the replay options; alike in shape only to other option structs.
/// How to build the replay pool; `None` fields come from the trace header, then from defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayOptions {
    /// The allocator.
    pub allocator: AllocatorKind,
    /// swiotlb or iova semantics.
    pub mode: PoolMode,
    /// Slots; default: the header's `nslabs`, else Linux's default.
    pub slots: Option<usize>,
    /// Areas; default: the header's `nareas`, else one per worker.
    pub areas: Option<usize>,
    /// Workers; default: the header's `cpus`, else 1.
    pub workers: Option<usize>,
    /// Device address of slot 0; default: the header's `start`, else the mode's default.
    pub base: Option<u64>,
    /// Compare each map with the kernel's decision when the trace has it.
    pub compare: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            allocator: AllocatorKind::Areas,
            mode: PoolMode::Swiotlb,
            slots: None,
            areas: None,
            workers: None,
            base: None,
            compare: false,
        }
    }
}

impl ReplayOptions {
    /// The pool configuration for a trace with `header` (if it has one).
    pub fn pool_config(&self, header: Option<&TraceHeader>) -> PoolConfig {
        let h = header.cloned().unwrap_or_default();
        let mut c = match self.mode {
            PoolMode::Swiotlb => {
                PoolConfig::swiotlb(self.slots.or(h.nslabs).unwrap_or(PoolConfig::DEFAULT_SLOTS))
            }
            PoolMode::Iova => {
                PoolConfig::iova(self.slots.or(h.nslabs).unwrap_or(PoolConfig::DEFAULT_SLOTS))
            }
        };
        c.allocator = self.allocator;
        // A trace records what the kernel's map accepted, which is more than the maximum
        // mapping size it advertises: accept the same band.
        c.size_limit = SizeLimit::Kernel;
        c.workers = self.workers.or(h.cpus).unwrap_or(1).max(1);
        if self.mode == PoolMode::Swiotlb {
            c.areas = self.areas.or(h.nareas);
        }
        if let Some(base) = self.base.or(h.start) {
            c.base = base;
        }
        if let Some(d) = h.dynamic.filter(|_| self.mode == PoolMode::Swiotlb) {
            // The kernel's dynamic pools: its area count before limit_nareas, every address
            // up to its physical limit backed, and the page allocator's answers given by the
            // trace.
            c.areas = Some(self.areas.unwrap_or(d.default_nareas));
            c.dynamic = Some(DynamicConfig {
                pages: PoolPages::Given {
                    window_base: 0,
                    window_bytes: d.phys_limit.saturating_add(1),
                },
                can_grow: d.can_grow,
            });
        }
        c
    }
}

/// What one replayed operation did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A header (nothing to do).
    Header,
    /// A map succeeded.
    Mapped {
        /// The map's id.
        id: u64,
        /// Device address returned.
        dev_addr: u64,
        /// First slot of the allocation (padding included).
        slot: usize,
        /// Slots allocated.
        nslots: usize,
    },
    /// A map failed.
    MapFailed {
        /// The map's id.
        id: u64,
        /// Why.
        error: Error,
    },
    /// An unmap succeeded.
    Unmapped {
        /// The map's id.
        id: u64,
    },
    /// A sync succeeded.
    Synced {
        /// The map's id.
        id: u64,
    },
    /// A pool was added (format 2).
    PoolAdded {
        /// Start address.
        start: u64,
        /// Slots.
        nslabs: usize,
        /// Areas.
        nareas: usize,
    },
    /// A transient pool allocation or free of the kernel was noted for the map `id` (format
    /// 2).
    Transient {
        /// The map's id.
        id: u64,
    },
    /// An unmap or sync failed (unknown id, or a pool error).
    Failed {
        /// The map's id.
        id: u64,
        /// Why.
        reason: String,
    },
}

/// A map whose result differs from the kernel's (or, in a dynamic trace, a pool event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Trace line.
    pub line: u64,
    /// The map's id (0 for a pool addition).
    pub id: u64,
    /// What differs.
    pub what: String,
}

/// Counters of a replay.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplaySummary {
    /// Operations replayed.
    pub ops: u64,
    /// Successful maps.
    pub maps: u64,
    /// Maps that failed with "pool full".
    pub pool_full: u64,
    /// Maps that failed with another error.
    pub map_errors: u64,
    /// Successful unmaps.
    pub unmaps: u64,
    /// Successful syncs.
    pub syncs: u64,
    /// Unmaps and syncs that failed.
    pub other_errors: u64,
    /// Maps compared with a kernel decision.
    pub compared: u64,
    /// Maps whose result differed from the kernel's.
    pub mismatches: u64,
    /// Maps the kernel failed ("buffer is full") that succeeded here: the trace has no unmap
    /// for them (the driver gave up on that request and retried it later, which the trace
    /// shows as new maps), so they are unmapped at once.
    pub kernel_failures_released: u64,
    /// Pools added where the trace published them (format 2).
    pub pools_added: u64,
    /// Transient pools the replay made (format 2).
    pub transient_pools: u64,
    /// Maps that asked for growth in the replay (format 2).
    pub grow_requests: u64,
    /// Maps placed in added pools (format 2).
    pub maps_in_added: u64,
    /// Maps placed in transient pools (format 2).
    pub maps_in_transient: u64,
}

/// What the kernel's page allocator gave a map's transient pool (a `transient_alloc`, and the
/// `transient_free` of a failed slot search).
#[derive(Clone, Copy, Debug)]
struct GivenTransient {
    start: Option<u64>,
    nslabs: usize,
    nareas: usize,
    search_failed: bool,
}

/// A dynamic replay's view of the pool events around the maps.
#[derive(Debug, Default)]
struct DynamicReplay {
    /// `transient_alloc`s waiting for their map.
    pending: HashMap<u64, GivenTransient>,
    /// The transient pool the last unmap deleted.
    last_freed: Option<u64>,
    /// The replay's growth requests: when each map that made one ran (entry, return).
    requests: Vec<Option<(u64, u64)>>,
    /// When the last worker run started.
    last_worker_ts: Option<u64>,
    /// The last map asked for growth.
    grew: bool,
}

/// Replays operations through a pool, keeping the live mappings by id.
#[derive(Debug)]
pub struct Replayer {
    pool: BouncePool,
    live: HashMap<u64, Mapping>,
    min_align_mask: u64,
    seg_boundary_mask: u64,
    compare: bool,
    summary: ReplaySummary,
    /// For a dynamic pool.
    dynamic: Option<DynamicReplay>,
    /// The counters debugfs showed at the end of the capture, compared by
    /// [`Replayer::finish`].
    counters_at_end: Option<super::parse::DebugfsCounters>,
}

impl Replayer {
    /// Builds the pool for `opts` and the trace's `header`.
    ///
    /// # Errors
    /// [`TraceError::Pool`] when the pool cannot be built.
    pub fn new(opts: &ReplayOptions, header: Option<&TraceHeader>) -> Result<Self> {
        let pool = BouncePool::new(&opts.pool_config(header))?;
        Ok(Self::with_pool(pool, opts.compare, header))
    }

    /// Replays through a pool built elsewhere (a geometry [`PoolConfig`] cannot express, as the
    /// sizing search uses). When the header records where each area's rolling index stood at
    /// the start of the capture, the areas are moved there first (see
    /// [`Replayer::start_areas_at`]).
    pub fn with_pool(pool: BouncePool, compare: bool, header: Option<&TraceHeader>) -> Self {
        let mut r = Self {
            pool,
            live: HashMap::new(),
            min_align_mask: header.and_then(|h| h.min_align_mask).unwrap_or(0),
            seg_boundary_mask: header
                .and_then(|h| h.seg_boundary_mask)
                .unwrap_or(DEFAULT_SEG_BOUNDARY_MASK),
            compare,
            summary: ReplaySummary::default(),
            dynamic: None,
            counters_at_end: header.and_then(|h| h.counters_at_end),
        };
        if r.pool.dynamic().is_some() {
            r.dynamic = Some(DynamicReplay::default());
        }
        if let Some(index) = header.and_then(|h| h.area_index_at_start.as_deref()) {
            let used = header.and_then(|h| h.area_used_at_start.as_deref());
            if used.is_some_and(|u| u.iter().any(|&n| n != 0)) {
                tracing::warn!(
                    ?used,
                    "the trace began with slots in use; its first decisions cannot be reproduced"
                );
            } else {
                r.start_areas_at(index);
            }
        }
        if let Some(hw) = header.and_then(|h| h.hiwater_at_start) {
            r.pool.raise_hiwater(hw);
        }
        r
    }

    /// Moves each area's rolling index to `index[area]` on an empty pool, as a live kernel's
    /// pool stands after boot: area `a` gets `index[a]` one-slot maps (each lands on the slot
    /// at the index and moves it one on), each unmapped at once, which leaves every slot free
    /// and the free-run counts as they were. These maps do not count in the replay summary (the
    /// pool's own counters include them). Skipped, with a warning, when the area count differs
    /// from the pool's or an index is out of its area.
    pub fn start_areas_at(&mut self, index: &[usize]) {
        let g = *self.pool.geometry();
        if index.len() != g.nareas || index.iter().any(|&i| i >= g.area_nslabs) {
            tracing::warn!(
                ?index,
                nareas = g.nareas,
                area_nslabs = g.area_nslabs,
                "the trace's starting area indices do not fit this pool; starting at 0"
            );
            return;
        }
        for (area, &n) in index.iter().enumerate() {
            let req = MapRequest::new(0, 1, crate::types::Direction::ToDevice).worker(area);
            for _ in 0..n {
                match self.pool.map(&NullMemory, &req) {
                    Ok(m) => {
                        let _ = self.pool.unmap(&NullMemory, &m, area);
                    }
                    Err(e) => {
                        tracing::warn!(area, "moving the area index failed: {e}");
                        return;
                    }
                }
            }
        }
    }

    /// The pool.
    pub fn pool(&self) -> &BouncePool {
        &self.pool
    }

    /// The counters so far.
    pub fn summary(&self) -> &ReplaySummary {
        &self.summary
    }

    /// Mappings still live.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Applies one operation; mismatches with the kernel's decision (when comparing) are
    /// appended to `mismatches`.
    pub fn apply(&mut self, line: u64, op: &TraceOp, mismatches: &mut Vec<Mismatch>) -> Outcome {
        self.summary.ops += 1;
        match op {
            TraceOp::Header(_) => Outcome::Header,
            TraceOp::Map(m) => self.map(line, m, mismatches),
            TraceOp::PoolAdd {
                start,
                nslabs,
                nareas,
                worker_ts,
            } => self.pool_add(line, *start, *nslabs, *nareas, *worker_ts, mismatches),
            TraceOp::TransientAlloc {
                id,
                start,
                nslabs,
                nareas,
            } => {
                let given = GivenTransient {
                    start: *start,
                    nslabs: *nslabs,
                    nareas: *nareas,
                    search_failed: false,
                };
                self.transient_alloc(*id, given, op)
            }
            TraceOp::TransientFree {
                id,
                start,
                search_failed,
                ..
            } => self.transient_free(line, *id, *start, *search_failed, mismatches),
            TraceOp::Unmap { id, worker, attrs } => self.unmap(*id, worker.unwrap_or(0), *attrs),
            TraceOp::Sync {
                id,
                for_cpu,
                offset,
                size,
            } => self.sync(*id, *for_cpu, *offset, *size),
        }
    }

    /// Records the kernel's transient pool for the `map` of `id` to take.
    fn transient_alloc(&mut self, id: u64, given: GivenTransient, op: &TraceOp) -> Outcome {
        match &mut self.dynamic {
            Some(d) => {
                d.pending.insert(id, given);
                Outcome::Transient { id }
            }
            None => self.not_dynamic(id, op),
        }
    }

    fn unmap(&mut self, id: u64, worker: usize, attrs: Option<DmaAttrs>) -> Outcome {
        let Some(mapping) = self.live.remove(&id) else {
            return self.failed(id, "unmap of an unknown or failed map".into());
        };
        let transient = self
            .dynamic
            .as_ref()
            .and_then(|_| self.pool.pool_of(mapping.dev_addr))
            .filter(|p| p.kind == PoolKind::Transient);
        let r = self.pool.unmap_single(
            &NullMemory,
            mapping.dev_addr,
            mapping.size,
            mapping.dir,
            attrs.unwrap_or(mapping.attrs),
            worker,
        );
        if let Some(d) = &mut self.dynamic {
            d.last_freed = transient.filter(|_| r.is_ok()).map(|p| p.start);
        }
        match r {
            Ok(()) => {
                self.summary.unmaps += 1;
                Outcome::Unmapped { id }
            }
            Err(e) => self.failed(id, e.to_string()),
        }
    }

    fn sync(&mut self, id: u64, for_cpu: bool, offset: usize, size: Option<usize>) -> Outcome {
        let Some(mapping) = self.live.get(&id) else {
            return self.failed(id, "sync of an unknown or failed map".into());
        };
        let size = size.unwrap_or(mapping.size.saturating_sub(offset));
        let r = match mapping.dev_addr.checked_add(offset as u64) {
            None => Err(Error::OutOfPool {
                addr: mapping.dev_addr,
                len: size,
            }),
            Some(addr) => {
                let target = if for_cpu {
                    SyncFor::Cpu
                } else {
                    SyncFor::Device
                };
                self.pool.sync(&NullMemory, addr, size, mapping.dir, target)
            }
        };
        match r {
            Ok(()) => {
                self.summary.syncs += 1;
                Outcome::Synced { id }
            }
            Err(e) => self.failed(id, e.to_string()),
        }
    }

    /// An operation on `id` that failed for `reason`, counted.
    fn failed(&mut self, id: u64, reason: String) -> Outcome {
        self.summary.other_errors += 1;
        Outcome::Failed { id, reason }
    }

    fn map(&mut self, line: u64, m: &MapOp, mismatches: &mut Vec<Mismatch>) -> Outcome {
        let req = MapRequest {
            orig: m.orig,
            size: m.size,
            dir: m.dir,
            attrs: m.attrs,
            min_align_mask: m.min_align_mask.unwrap_or(self.min_align_mask),
            alloc_align_mask: m.alloc_align_mask,
            seg_boundary_mask: m.seg_boundary_mask.unwrap_or(self.seg_boundary_mask),
            worker: m.worker,
        };
        let given = self.dynamic.as_mut().and_then(|d| d.pending.remove(&m.id));
        let before = self.pool.dynamic().map(|d| d.events());
        if let (Some(d), Some(g)) = (self.pool.dynamic(), given) {
            d.give_transient(g.start);
        }
        let result = self.pool.map(&NullMemory, &req);
        if self.dynamic.is_some() {
            self.after_dynamic_map(line, m, given, before, &result, mismatches);
        }
        if self.compare {
            if let Some(k) = &m.kernel {
                self.compare_map(line, m.id, k, &result, mismatches);
            }
        }
        match result {
            Ok(mapping) => {
                self.summary.maps += 1;
                if m.kernel.as_ref().is_some_and(|k| k.tlb_addr.is_none()) {
                    self.summary.kernel_failures_released += 1;
                    let _ = self.pool.unmap(&NullMemory, &mapping, m.worker);
                    return Outcome::Mapped {
                        id: m.id,
                        dev_addr: mapping.dev_addr,
                        slot: mapping.slot,
                        nslots: mapping.nslots,
                    };
                }
                if let Some(old) = self.live.insert(m.id, mapping) {
                    // A reused id: the trace lost an unmap. Keep the pool consistent.
                    tracing::warn!(id = m.id, line, "map id reused while live; unmapping");
                    let _ = self.pool.unmap(&NullMemory, &old, m.worker);
                }
                Outcome::Mapped {
                    id: m.id,
                    dev_addr: mapping.dev_addr,
                    slot: mapping.slot,
                    nslots: mapping.nslots,
                }
            }
            Err(error) => {
                if matches!(error, Error::PoolFull { .. }) {
                    self.summary.pool_full += 1;
                } else {
                    self.summary.map_errors += 1;
                }
                Outcome::MapFailed { id: m.id, error }
            }
        }
    }

    /// A map's pool events in a dynamic replay: whether it asked for growth, whether it took
    /// the transient pool the trace gave it (and only then), and where it landed.
    fn after_dynamic_map(
        &mut self,
        line: u64,
        m: &MapOp,
        given: Option<GivenTransient>,
        before: Option<DynamicEvents>,
        result: &crate::Result<Mapping>,
        mismatches: &mut Vec<Mismatch>,
    ) {
        let (Some(d), Some(before), Some(r)) = (self.pool.dynamic(), before, self.dynamic.as_mut())
        else {
            return;
        };
        let after = d.events();
        let unused = d.take_unused_given();
        r.grew = after.grow_requests > before.grow_requests;
        let mut what = Vec::new();
        if r.grew {
            self.summary.grow_requests += 1;
            r.requests.push(m.time);
            if given.is_none() {
                what.push("the replay needs a transient pool; the trace has none for it".into());
            }
        }
        if unused > 0 {
            what.push(
                "the kernel made a transient pool; the replay served the map from its pools".into(),
            );
        }
        if let Some(g) = given.filter(|_| unused == 0) {
            let want = result.as_ref().map_or(0, |mm| mm.nslots);
            if g.start.is_some() && (g.nslabs, g.nareas) != (want, 1) && result.is_ok() {
                what.push(format!(
                    "transient pool: kernel {} slots in {} areas, replay {want} in 1",
                    g.nslabs, g.nareas
                ));
            }
            let search_failed = after.transient_search_failed > before.transient_search_failed;
            if search_failed != g.search_failed {
                what.push(format!(
                    "slot search in the fresh transient pool failed: kernel {}, replay \
                     {search_failed}",
                    g.search_failed
                ));
            }
        }
        if after.transient_pools > before.transient_pools {
            self.summary.transient_pools += 1;
        }
        if let Ok(mm) = result {
            match self.pool.pool_of(mm.dev_addr).map(|p| p.kind) {
                Some(PoolKind::Added) => self.summary.maps_in_added += 1,
                Some(PoolKind::Transient) => self.summary.maps_in_transient += 1,
                _ => {}
            }
        }
        if !what.is_empty() {
            self.summary.mismatches += 1;
            mismatches.push(Mismatch {
                line,
                id: m.id,
                what: what.join("; "),
            });
        }
    }

    /// A `pool_add`: checked against the growth worker's rules (sizes, areas, a request it
    /// answers), then applied here, so every later map searches it first.
    fn pool_add(
        &mut self,
        line: u64,
        start: u64,
        nslabs: usize,
        nareas: usize,
        worker_ts: Option<u64>,
        mismatches: &mut Vec<Mismatch>,
    ) -> Outcome {
        let (Some(d), Some(r)) = (self.pool.dynamic(), self.dynamic.as_mut()) else {
            return self.not_dynamic(
                0,
                &TraceOp::PoolAdd {
                    start,
                    nslabs,
                    nareas,
                    worker_ts,
                },
            );
        };
        let mut what = Vec::new();
        let sizes = worker_sizes(d.default_nslabs(), d.default_nareas());
        if !sizes.contains(&(nslabs, nareas)) {
            what.push(format!(
                "pool {start:#x} of {nslabs} slots in {nareas} areas; the worker makes one of \
                 {sizes:?}"
            ));
        }
        // The work's PENDING bit is cleared when a run starts: a run answers a request whose
        // map returned after the previous run started and was entered before this one did.
        let answered = match worker_ts {
            Some(w) => r.requests.iter().any(|t| match t {
                Some((ts, ret)) => r.last_worker_ts.is_none_or(|l| *ret > l) && *ts < w,
                None => true,
            }),
            None => !r.requests.is_empty(),
        };
        if !answered {
            what.push(format!(
                "pool {start:#x} added by a worker run that no growth request of the replay \
                 asked for"
            ));
        }
        r.last_worker_ts = worker_ts.or(r.last_worker_ts);
        if let Err(e) = d.add_pool(start, nslabs, nareas) {
            what.push(format!("pool {start:#x} cannot be added: {e}"));
        } else {
            self.summary.pools_added += 1;
        }
        if !what.is_empty() {
            self.summary.mismatches += 1;
            mismatches.push(Mismatch {
                line,
                id: 0,
                what: what.join("; "),
            });
        }
        Outcome::PoolAdded {
            start,
            nslabs,
            nareas,
        }
    }

    /// A `transient_free`: a failed slot search is an input of the map it precedes; any
    /// other must be the pool the last unmap deleted.
    fn transient_free(
        &mut self,
        line: u64,
        id: u64,
        start: u64,
        search_failed: bool,
        mismatches: &mut Vec<Mismatch>,
    ) -> Outcome {
        let Some(r) = self.dynamic.as_mut() else {
            return self.not_dynamic(
                id,
                &TraceOp::TransientFree {
                    id,
                    start,
                    nslabs: 0,
                    search_failed,
                },
            );
        };
        let what = if search_failed {
            match r.pending.get_mut(&id) {
                Some(g) if g.start == Some(start) => {
                    g.search_failed = true;
                    None
                }
                _ => Some(format!(
                    "transient pool {start:#x} freed after a failed search without its \
                     transient_alloc"
                )),
            }
        } else if r.last_freed != Some(start) {
            Some(format!(
                "the kernel freed transient pool {start:#x} at this unmap; the replay freed {}",
                r.last_freed
                    .map_or_else(|| "none".to_string(), |s| format!("{s:#x}"))
            ))
        } else {
            None
        };
        if let Some(what) = what {
            self.summary.mismatches += 1;
            mismatches.push(Mismatch { line, id, what });
        }
        Outcome::Transient { id }
    }

    /// A format-2 op in a replay without dynamic pools.
    fn not_dynamic(&mut self, id: u64, op: &TraceOp) -> Outcome {
        let reason = format!(
            "{} needs a dynamic pool (a swiotlb-kernel-trace/2 header)",
            op.name()
        );
        self.failed(id, reason)
    }

    /// Ends a replay: in a dynamic replay, `transient_alloc`s no map took, and the counters
    /// debugfs showed at the end against the replay's (`io_tlb_used` only when nothing is
    /// live). Returns the mismatches found, also counted in the summary.
    pub fn finish(&mut self, mismatches: &mut Vec<Mismatch>) -> u64 {
        let (Some(d), Some(r)) = (self.pool.dynamic(), self.dynamic.as_mut()) else {
            return 0;
        };
        let mut what = Vec::new();
        if !r.pending.is_empty() {
            let mut ids: Vec<u64> = r.pending.keys().copied().collect();
            ids.sort_unstable();
            what.push(format!("transient_alloc without its map: {ids:?}"));
        }
        if let Some(end) = self.counters_at_end {
            let got = [
                ("io_tlb_nslabs", end.nslabs, d.nslabs()),
                (
                    "io_tlb_transient_nslabs",
                    end.transient_nslabs,
                    d.transient_nslabs(),
                ),
                (
                    "io_tlb_used",
                    end.used.filter(|_| self.live.is_empty()),
                    self.pool.used() as u64,
                ),
            ];
            for (name, want, got) in got {
                if want.is_some_and(|w| w != got) {
                    what.push(format!("{name} at the end: kernel {want:?}, got {got}"));
                }
            }
        }
        let n = what.len() as u64;
        self.summary.mismatches += n;
        mismatches.extend(what.into_iter().map(|what| Mismatch {
            line: 0,
            id: 0,
            what,
        }));
        n
    }

    fn compare_map(
        &mut self,
        line: u64,
        id: u64,
        k: &KernelDecision,
        result: &crate::Result<Mapping>,
        mismatches: &mut Vec<Mismatch>,
    ) {
        self.summary.compared += 1;
        let mut what = Vec::new();
        match (k.tlb_addr, result) {
            (Some(want), Ok(got)) if got.dev_addr == want => {}
            (None, Err(Error::PoolFull { .. })) => {}
            (Some(want), Ok(got)) => {
                what.push(format!("kernel {want:#x}, got {:#x}", got.dev_addr));
            }
            (Some(want), Err(e)) => what.push(format!("kernel {want:#x}, got error: {e}")),
            (None, Ok(got)) => what.push(format!("kernel full, got {:#x}", got.dev_addr)),
            (None, Err(e)) => what.push(format!("kernel full, got another error: {e}")),
        }
        let alloc = self.pool.allocator();
        if let Some(want) = &k.area_used {
            let got = alloc.area_used();
            if *want != got {
                what.push(format!("area used: kernel {want:?}, got {got:?}"));
            }
        }
        if let Some(want) = &k.area_index {
            let got = alloc.area_index();
            if !got.is_empty() && *want != got {
                what.push(format!("area index: kernel {want:?}, got {got:?}"));
            }
        }
        if let Some(d) = self.pool.dynamic() {
            if let (Some((start, kind)), Ok(got)) = (k.pool, result) {
                match self.pool.pool_of(got.dev_addr) {
                    Some(p) if p.start == start && p.kind == kind => {}
                    Some(p) => what.push(format!(
                        "pool: kernel {} {start:#x}, got {} {:#x}",
                        kind.name(),
                        p.kind.name(),
                        p.start
                    )),
                    None => what.push(format!("pool: kernel {} {start:#x}, got none", kind.name())),
                }
            }
            let grew = self.dynamic.as_ref().is_some_and(|r| r.grew);
            if k.grow != grew {
                what.push(format!("growth request: kernel {}, got {grew}", k.grow));
            }
            if let Some(want) = k.counters {
                let got = KernelCounters {
                    nslabs: d.nslabs(),
                    used: self.pool.used() as u64,
                    hiwater: self.pool.hiwater(),
                    transient_nslabs: d.transient_nslabs(),
                };
                if want != got {
                    what.push(format!(
                        "counters nslabs/used/hiwater/transient: kernel {}/{}/{}/{}, got \
                         {}/{}/{}/{}",
                        want.nslabs,
                        want.used,
                        want.hiwater,
                        want.transient_nslabs,
                        got.nslabs,
                        got.used,
                        got.hiwater,
                        got.transient_nslabs
                    ));
                }
            }
        }
        if !what.is_empty() {
            self.summary.mismatches += 1;
            mismatches.push(Mismatch {
                line,
                id,
                what: what.join("; "),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceReader;
    use vm_memory::VolatileSlice;

    #[test]
    fn replays_a_user_trace() {
        let text = r#"{"op":"map","id":1,"orig":4096,"size":512,"dir":"to-device","worker":0}
{"op":"map","id":2,"orig":8192,"size":8192,"dir":2,"worker":1}
{"op":"sync_for_cpu","id":2,"offset":100,"size":200}
{"op":"sync_for_device","id":1}
{"op":"unmap","id":1}
{"op":"unmap","id":1}
{"op":"unmap","id":2}
"#;
        let opts = ReplayOptions {
            slots: Some(256),
            areas: Some(1),
            ..ReplayOptions::default()
        };
        let mut r = Replayer::new(&opts, None).unwrap();
        let mut mm = Vec::new();
        let outs: Vec<Outcome> = TraceReader::from_reader(text.as_bytes(), "t".into())
            .map(|x| {
                let (line, op) = x.unwrap();
                r.apply(line, &op, &mut mm)
            })
            .collect();
        let base = PoolConfig::DEFAULT_SWIOTLB_BASE;
        assert_eq!(
            outs[0],
            Outcome::Mapped {
                id: 1,
                dev_addr: base,
                slot: 0,
                nslots: 1
            }
        );
        assert_eq!(
            outs[1],
            Outcome::Mapped {
                id: 2,
                dev_addr: base + 4096,
                slot: 2,
                nslots: 4
            }
        );
        assert!(matches!(outs[5], Outcome::Failed { id: 1, .. }));
        let s = r.summary();
        assert_eq!((s.maps, s.unmaps, s.syncs, s.other_errors), (2, 2, 2, 1));
        assert_eq!(r.pool().used(), 0);
        assert!(mm.is_empty());
    }

    #[test]
    fn null_memory_reads_zeros() {
        let mut buf = [0xffu8; 5000];
        let s = VolatileSlice::from(&mut buf[..]);
        NullMemory.read_orig(0, &s).unwrap();
        NullMemory.write_orig(u64::MAX, &s).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }
}
