//! "Dynamic on": the workload replayed through a `CONFIG_SWIOTLB_DYNAMIC` pool list
//! ([`crate::dynamic`], the model the committed `/2` traces replay through with 0 mismatches)
//! whose default pool the advisor chooses.
//!
//! What the kernel leaves to its page allocator and its scheduler is fixed here, the same on
//! every run:
//!
//! - **Memory**: pools come from a window of the guest's memory below 4 GiB (all of it when the
//!   guest's memory is not given) with the default pool at its start, in blocks of a power of
//!   two of pages aligned to their size, as `alloc_pages` gives them
//!   ([`PoolPages::HostStepped`]). Nothing else takes memory from it: a transient pool fails
//!   only when the window is full.
//! - **The growth worker** runs [`WORKER_LAG_MAPS`] maps after the map whose growth request
//!   queued it; every later map searches its pool first.
//!
//! A map fails when no pool serves it and its transient pool cannot be made (no memory in the
//! window: **capacity**) or has no fitting run (its alignment rules out the exactly-sized pool's
//! first slots: **fragmentation**).

use serde::Serialize;

use super::{Failures, Sizer};
use crate::dynamic::{Blocks, DynamicConfig, DynamicEvents, PoolPages};
use crate::geometry::PoolConfig;
use crate::pool::BouncePool;
use crate::trace::{Outcome, Replayer, Result, TraceOp};
use crate::types::AllocatorKind;

/// Maps between the one that queues a growth worker run and the first that sees its pool. The
/// twelve pool additions of the committed `/2` traces came 1 to 45 maps after the request
/// (1, 2, 2, 2, 2, 2, 3, 4, 9, 22, 23, 45; median 2.5): the worker runs when the mapping task
/// sleeps.
pub const WORKER_LAG_MAPS: u64 = 2;

/// What a dynamic replay is cached under: default slots, areas asked for, CPUs, window bytes.
pub(super) type DynamicKey = (usize, Option<usize>, usize, u64);

/// One replay through dynamic pools.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DynamicReport {
    /// Slots of the default pool.
    pub slots: usize,
    /// Areas of the default pool.
    pub areas: usize,
    /// Linux `default_nareas`: the search's bound and the areas asked of added pools.
    pub default_nareas: usize,
    /// What failed (capacity: no memory for a transient pool; fragmentation: no run in it).
    #[serde(flatten)]
    pub failures: Failures,
    /// Maps that asked for growth (no pool served them).
    pub grow_requests: u64,
    /// Transient pools made.
    pub transient_pools: u64,
    /// The most slots in transient pools at once (`io_tlb_transient_nslabs`).
    pub transient_peak_slots: u64,
    /// Pools the growth worker added.
    pub pools_added: u64,
    /// Their slots.
    pub added_slots: u64,
    /// The most memory all pools took at once (default, added and transient pools, each a
    /// power of two of pages).
    pub peak_bytes: u64,
    /// The most slots in use at once, transient ones included (`io_tlb_used_hiwater`).
    pub hiwater: u64,
}

impl Sizer {
    /// The configuration of a dynamic pool whose default pool is what the kernel makes of
    /// `swiotlb=<slots>[,<areas>]` on a guest with `cpus` CPUs (`None` areas: one per CPU),
    /// growing into a window of `memory_bytes` from the default pool's start.
    ///
    /// # Errors
    /// When the default pool cannot be built or does not fit the window.
    pub fn dynamic_config(
        &self,
        slots: usize,
        areas: Option<usize>,
        cpus: usize,
        memory_bytes: u64,
    ) -> Result<PoolConfig> {
        let mut cfg = self.config(AllocatorKind::Areas);
        cfg.slots = slots.max(1);
        cfg.areas = areas;
        cfg.workers = cpus;
        let geom = cfg.geometry()?;
        let window = usize::try_from(memory_bytes >> geom.slot_shift).unwrap_or(usize::MAX);
        if window < geom.nslabs {
            return Err(crate::Error::Config(format!(
                "a default pool of {} slots does not fit in {} MiB",
                geom.nslabs,
                memory_bytes >> 20
            ))
            .into());
        }
        cfg.dynamic = Some(DynamicConfig {
            pages: PoolPages::HostStepped { slots: window },
            can_grow: true,
        });
        Ok(cfg)
    }

    /// Replays the whole workload through the dynamic pools of
    /// [`Sizer::dynamic_config`]`(slots, areas, cpus, memory_bytes)`, the growth worker run
    /// [`WORKER_LAG_MAPS`] maps after each request. Results are kept.
    ///
    /// # Errors
    /// When the pool cannot be built.
    pub fn replay_dynamic(
        &self,
        slots: usize,
        areas: Option<usize>,
        cpus: usize,
        memory_bytes: u64,
    ) -> Result<DynamicReport> {
        let key = (slots, areas, cpus, memory_bytes);
        if let Some(r) = self.dynamic_replays.borrow().get(&key) {
            return Ok(r.clone());
        }
        let cfg = self.dynamic_config(slots, areas, cpus, memory_bytes)?;
        let r = self.run_dynamic(&cfg)?;
        self.dynamic_replays.borrow_mut().insert(key, r.clone());
        Ok(r)
    }

    fn run_dynamic(&self, cfg: &PoolConfig) -> Result<DynamicReport> {
        let geom = cfg.geometry()?;
        let pool = BouncePool::new(cfg)?;
        pool.set_timing(false);
        let mut r = Replayer::with_pool(pool, false, self.header_for(&geom).as_ref());
        r.pool().reset_hiwater();
        let events = |r: &Replayer| r.pool().dynamic().map(|d| d.events()).unwrap_or_default();
        let pages = |r: &Replayer| r.pool().dynamic().and_then(|d| d.pages_in_use());
        let mut f = Failures::default();
        let mut mismatches = Vec::new();
        let mut peak_bytes = pages(&r).unwrap_or(0);
        let mut transient_peak_slots = 0;
        // Maps since the request that queued the pending worker run.
        let mut waiting: Option<u64> = None;
        for (line, op) in &self.ops {
            let before: DynamicEvents = events(&r);
            let transient_before = r.pool().dynamic().map_or(0, |d| d.transient_nslabs());
            let outcome = r.apply(*line, op, &mut mismatches);
            // The replay notes every growth request as a difference from a trace that has no
            // pool events: nothing to compare here.
            mismatches.clear();
            let after = events(&r);
            let no_run = after.transient_search_failed > before.transient_search_failed;
            f.record(&outcome, geom.slot_size(), |_, _, _| !no_run);
            let (TraceOp::Map(_), Some(d)) = (op, r.pool().dynamic()) else {
                continue;
            };
            // A map the capturing kernel failed has no unmap: the replay releases it at once,
            // and its transient pool with it. It counts at its peak all the same.
            let mut freed_at_once = 0;
            if let (Outcome::Mapped { nslots, .. }, true) =
                (&outcome, after.transient_pools > before.transient_pools)
            {
                let peak = transient_before + *nslots as u64;
                transient_peak_slots = transient_peak_slots.max(peak);
                if d.transient_nslabs() < peak {
                    freed_at_once = Blocks::block_bytes((*nslots as u64) << geom.slot_shift);
                }
            }
            transient_peak_slots = transient_peak_slots.max(d.transient_nslabs());
            let mut grew = after.transient_pools > before.transient_pools;
            waiting = match waiting {
                Some(n) => Some(n + 1),
                None => d.growth_pending().then_some(0),
            };
            if waiting.is_some_and(|n| n >= WORKER_LAG_MAPS) {
                waiting = None;
                grew |= d.run_pending_worker().is_some();
            }
            if grew {
                let now = d.pages_in_use().unwrap_or(0);
                peak_bytes = peak_bytes.max(now + freed_at_once);
            }
        }
        let stats = r.pool().stats();
        let d = stats.dynamic.unwrap_or_default();
        Ok(DynamicReport {
            slots: geom.nslabs,
            areas: geom.nareas,
            default_nareas: d.default_nareas as usize,
            failures: f,
            grow_requests: d.grow_requests,
            transient_pools: d.transient_pools,
            transient_peak_slots,
            pools_added: d.pools_added,
            added_slots: d.added_nslabs,
            peak_bytes,
            hiwater: stats.used_hiwater,
        })
    }
}
