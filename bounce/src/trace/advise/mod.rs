//! Pool sizing from traces: the smallest pool with no "buffer is full" for a workload, found by
//! replaying it, what Linux makes of it, and why each failure happened.
//!
//! A [`Sizer`] loads one trace, or several replayed together through one shared pool (as the
//! devices of one guest share Linux's default pool), checks that every unmap and sync refers to
//! a map the trace made, and replays the operations at any geometry.
//!
//! The search ([`Sizer::search`]) works in steps of one segment per area, so every area holds
//! whole segments: it doubles the pool from its starting size until a replay has no pool-full
//! failure, then bisects down to the step where one step less fails. That size, `min_slots`, is
//! reachable only with a hand-built geometry. Linux and `PoolConfig` round a pool up (to a
//! multiple of 128 slots, at least 128 per area, then to a power of two), so the advice for a
//! guest (`swiotlb=<slots>,<areas>`) and for the host (`--bounce slots=`) is `min_slots` after
//! that rounding, replayed once more to confirm it (placement differs with the pool size, so a
//! larger pool is not assumed to be as good).
//!
//! A failure is **capacity** when fewer slots were free in the whole pool than the request
//! needed, and **fragmentation** when enough were free but no run of them fitted the request's
//! rules (contiguity inside one segment and area, alignment).
//!
//! Several traces are interleaved in proportion to their position in each (their clocks are
//! different guests' and cannot be compared): operation `k` of a trace of `n` comes at `k / n`
//! of the merged stream, as if every trace spanned the same time. Map ids are renumbered so that
//! they do not collide; each map keeps its own trace's `min_align_mask` and segment boundary.
//!
//! [`report`] builds the advisor's table from these replays; [`linux`] holds the kernel's sizing
//! rules it applies.

pub mod dynamic;
pub mod linux;
pub mod report;

use std::cell::RefCell;
use std::collections::HashMap;

use serde::Serialize;

use super::parse::{DynamicHeader, MapOp, TraceHeader, TraceOp};
use super::replay::{Outcome, ReplayOptions, Replayer};
use super::{Result, TraceError};
use crate::alloc;
use crate::dynamic::limit_nareas;
use crate::error::Error;
use crate::geometry::{Geometry, PoolConfig};
use crate::pool::BouncePool;
use crate::types::{AllocatorKind, PoolMode};
use crate::IO_TLB_SEGSIZE;

/// A mapping of more than this many slots (half a Linux segment, 128 KiB) is "large": the
/// segment size decides whether it finds room.
pub const LARGE_MAP_SLOTS: u64 = (IO_TLB_SEGSIZE / 2) as u64;

/// Pool-full failures of one replay, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Failures {
    /// Maps that failed with "pool full".
    pub pool_full: u64,
    /// ... with fewer free slots in the pool than the request needed.
    pub capacity: u64,
    /// ... with enough free slots but no fitting run.
    pub fragmentation: u64,
    /// ... of mappings larger than [`LARGE_MAP_SLOTS`] slots.
    pub large: u64,
    /// Maps that failed for another reason (too large for any pool, bad masks): no pool size
    /// helps them.
    pub other_errors: u64,
    /// Maps replayed.
    pub maps: u64,
}

impl Failures {
    /// Counts one replayed operation's outcome (maps only). A pool-full failure is capacity
    /// when `capacity(need, total, used)` says so (`need`: the slots the map needed; `total`,
    /// `used`: the pool's slots and those in use, as the error reports them), else
    /// fragmentation. Returns (slots in use, slots needed) of a pool-full failure.
    fn record(
        &mut self,
        outcome: &Outcome,
        slot_bytes: u64,
        capacity: impl FnOnce(u64, usize, usize) -> bool,
    ) -> Option<(u64, u64)> {
        match outcome {
            Outcome::Mapped { .. } => self.maps += 1,
            Outcome::MapFailed {
                error: Error::PoolFull { size, total, used },
                ..
            } => {
                self.maps += 1;
                self.pool_full += 1;
                let need = (*size as u64).div_ceil(slot_bytes);
                if capacity(need, *total, *used) {
                    self.capacity += 1;
                } else {
                    self.fragmentation += 1;
                }
                if need > LARGE_MAP_SLOTS {
                    self.large += 1;
                }
                return Some((*used as u64, need));
            }
            Outcome::MapFailed { .. } => {
                self.maps += 1;
                self.other_errors += 1;
            }
            _ => {}
        }
        None
    }
}

/// One replay at one size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SizeReport {
    /// Slots of the pool.
    pub slots: usize,
    /// Areas of the pool.
    pub areas: usize,
    /// Slots per segment.
    pub segsize: usize,
    /// What failed.
    #[serde(flatten)]
    pub failures: Failures,
    /// The most slots in use at once (Linux `io_tlb_used_hiwater`).
    pub hiwater: u64,
}

/// The smallest pool of one shape (allocator, areas, segment size) with no pool-full failure.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Search {
    /// The smallest pool with no pool-full failure, in steps of one segment per area.
    pub min_slots: usize,
    /// The replay at `min_slots`.
    pub at_min: SizeReport,
    /// The replay one step (one segment per area) smaller; `None` when `min_slots` is already
    /// the smallest pool of that shape.
    pub one_step_less: Option<SizeReport>,
}

/// The advice for one allocator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Advice {
    /// The allocator.
    pub alloc: AllocatorKind,
    /// Host pool size: `--bounce slots=` (Linux's rounding applied, so the pool built is this).
    pub slots: usize,
    /// Areas of that pool.
    pub areas: usize,
    /// The guest kernel parameter value, `swiotlb=<this>` (`"slots,areas"`); `None` in iova
    /// mode.
    pub swiotlb: Option<String>,
    /// The smallest pool with no pool-full failure, in steps of one segment per area, before
    /// rounding; one step less fails (`failures_one_step_smaller` says how often).
    pub min_slots: usize,
    /// Pool-full failures with one step (one segment per area) less than `min_slots`; 0 when
    /// `min_slots` is already the smallest possible pool.
    pub failures_one_step_smaller: u64,
    /// The replay at the current size (the trace header's or the options').
    pub current: SizeReport,
}

// Field list of a trace summary; alike in shape only to other record structs.
/// One trace of a [`Sizer`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceInfo {
    /// Its name (the file).
    pub name: String,
    /// Map operations.
    pub maps: u64,
    /// Maps the capturing kernel failed ("buffer is full").
    pub kernel_failures: u64,
    /// Unmap operations.
    pub unmaps: u64,
    /// Mappings still live at the end of the trace: the capture stopped before their unmap,
    /// and they hold their slots to the end of the replay.
    pub live_at_end: usize,
    /// Slots of the pool it was captured with (its header's), when known.
    pub nslabs: Option<usize>,
    /// Areas of that pool, when known.
    pub nareas: Option<usize>,
    /// CPUs of the traced guest, when known.
    pub cpus: Option<usize>,
    /// Captured from a kernel with dynamic pools (`swiotlb-kernel-trace/2`).
    pub dynamic: bool,
    /// Pools that kernel's growth worker added during the capture.
    pub kernel_pools_added: u64,
    /// Transient pools that kernel made during the capture.
    pub kernel_transient_pools: u64,
}

/// Occupancy over a replay, for a chart: the most slots in use in each bucket of consecutive
/// operations, and every pool-full failure with the slots in use when it happened.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Timeline {
    /// Operations per bucket.
    pub ops_per_bucket: u64,
    /// (first operation of the bucket, most slots in use in it), 0-based operation numbers.
    pub occupancy: Vec<(u64, u64)>,
    /// (operation, slots in use, slots the map needed) of each pool-full failure, up to
    /// [`Timeline::MAX_FAILURES`].
    pub failures: Vec<(u64, u64, u64)>,
}

impl Timeline {
    /// Failures kept for the chart (all are counted in the [`SizeReport`]).
    pub const MAX_FAILURES: usize = 10_000;
}

/// Where a sizing search stops: pools larger than this many slots are not tried.
pub const DEFAULT_MAX_SLOTS: usize = 1 << 20;

/// What a replay result is cached under: the allocator and what of the geometry placement
/// depends on (slots, areas, segment, workers, base).
type ReplayKey = (AllocatorKind, usize, usize, usize, usize, u64);

/// Traces loaded once and replayed at many sizes.
#[derive(Debug)]
pub struct Sizer {
    ops: Vec<(u64, TraceOp)>,
    header: Option<TraceHeader>,
    opts: ReplayOptions,
    max_slots: usize,
    traces: Vec<TraceInfo>,
    replays: RefCell<HashMap<ReplayKey, SizeReport>>,
    /// What the capturing kernel's dynamic pools were fixed at, for one dynamic-pool trace.
    dynamic_header: Option<DynamicHeader>,
    dynamic_replays: RefCell<HashMap<dynamic::DynamicKey, dynamic::DynamicReport>>,
}

/// One trace, checked and renumbered.
struct Loaded {
    info: TraceInfo,
    header: Option<TraceHeader>,
    ops: Vec<(u64, TraceOp)>,
}

fn invalid(name: &str, line: u64, reason: String) -> TraceError {
    TraceError::Invalid {
        path: name.to_string(),
        line,
        reason,
    }
}

/// Reads a whole trace and checks it can be replayed: at most one header, first; a header pool
/// Linux could make; every unmap and sync of a live map; no id mapped twice while live; pool
/// events only in a dynamic-pool trace. Map ids are renumbered from `next_id` on, and every map
/// gets its trace's masks. A dynamic-pool trace's pool events (what the capturing kernel's page
/// allocator and growth worker did) are counted and left out: every replay decides them itself.
fn load_one(
    name: String,
    ops: impl IntoIterator<Item = Result<(u64, TraceOp)>>,
    next_id: &mut u64,
) -> Result<Loaded> {
    let mut loader = Loader::new(name, next_id);
    let mut last_line = 0;
    for item in ops {
        let (line, op) = item.map_err(|e| match e {
            TraceError::Parse { line, reason } => invalid(&loader.info.name, line, reason),
            e => e,
        })?;
        last_line = line;
        loader.op(line, op)?;
    }
    loader.finish(last_line)
}

/// One trace being read by [`load_one`].
struct Loader<'a> {
    info: TraceInfo,
    header: Option<TraceHeader>,
    ops: Vec<(u64, TraceOp)>,
    /// Trace id -> (renumbered id, line of its map) of every map the trace holds live.
    live: HashMap<u64, (u64, u64)>,
    next_id: &'a mut u64,
}

impl<'a> Loader<'a> {
    fn new(name: String, next_id: &'a mut u64) -> Self {
        Self {
            info: TraceInfo {
                name,
                maps: 0,
                kernel_failures: 0,
                unmaps: 0,
                live_at_end: 0,
                nslabs: None,
                nareas: None,
                cpus: None,
                dynamic: false,
                kernel_pools_added: 0,
                kernel_transient_pools: 0,
            },
            header: None,
            ops: Vec::new(),
            live: HashMap::new(),
            next_id,
        }
    }

    fn invalid(&self, line: u64, reason: String) -> TraceError {
        invalid(&self.info.name, line, reason)
    }

    /// Checks one operation and keeps it (renumbered) when a replay applies it.
    fn op(&mut self, line: u64, mut op: TraceOp) -> Result<()> {
        match &mut op {
            TraceOp::Header(h) => return self.header(line, h),
            TraceOp::Map(m) => self.map(line, m)?,
            TraceOp::Unmap { id, .. } => {
                let Some((new, _)) = self.live.remove(id) else {
                    return Err(self.invalid(
                        line,
                        format!(
                            "unmap of map id {id}, which the trace never mapped (or already \
                             unmapped)"
                        ),
                    ));
                };
                self.info.unmaps += 1;
                *id = new;
            }
            TraceOp::Sync { id, .. } => {
                let Some(&(new, _)) = self.live.get(id) else {
                    return Err(self.invalid(
                        line,
                        format!("sync of map id {id}, which the trace does not hold mapped"),
                    ));
                };
                *id = new;
            }
            TraceOp::PoolAdd { .. }
            | TraceOp::TransientAlloc { .. }
            | TraceOp::TransientFree { .. } => return self.pool_event(line, &op),
        }
        self.ops.push((line, op));
        Ok(())
    }

    /// The header: first, once, of a pool Linux makes.
    fn header(&mut self, line: u64, h: &TraceHeader) -> Result<()> {
        if self.header.is_some() || !self.ops.is_empty() {
            return Err(self.invalid(line, "a header after the first operation".into()));
        }
        if let Some(n) = h.nslabs {
            let a = h.nareas.unwrap_or(1);
            if !linux::is_kernel_geometry(n, a) {
                return Err(self.invalid(
                    line,
                    format!(
                        "header: {n} slots in {a} areas is not a pool Linux makes (a power of \
                         two of slots, at least {IO_TLB_SEGSIZE} per area, and a power of two \
                         of areas)"
                    ),
                ));
            }
        }
        if h.cpus == Some(0) {
            return Err(self.invalid(line, "header: cpus 0".into()));
        }
        if let Some(start) = h.start {
            let bytes = h.nslabs.unwrap_or(0) as u64 * linux::SLOT_BYTES;
            if start % linux::SLOT_BYTES != 0 || start.checked_add(bytes).is_none() {
                return Err(self.invalid(
                    line,
                    format!("header: start {start:#x} is not where a pool of {bytes} bytes can be"),
                ));
            }
        }
        if let Some(d) = &h.dynamic {
            // The default pool's areas are limit_nareas(default_nareas, nslabs).
            let (n, a) = (h.nslabs.unwrap_or(0), h.nareas.unwrap_or(1));
            if !d.default_nareas.is_power_of_two() || limit_nareas(d.default_nareas, n) != a {
                return Err(self.invalid(
                    line,
                    format!(
                        "header: dynamic default_nareas {} does not give {n} slots in {a} \
                         areas (a power of two that limit_nareas fits to the pool)",
                        d.default_nareas
                    ),
                ));
            }
        }
        self.info.nslabs = h.nslabs;
        self.info.nareas = h.nareas;
        self.info.cpus = h.cpus;
        self.info.dynamic = h.dynamic.is_some();
        self.header = Some(h.clone());
        Ok(())
    }

    /// A map: a fresh id, renumbered, with its trace's masks.
    fn map(&mut self, line: u64, m: &mut MapOp) -> Result<()> {
        self.info.maps += 1;
        if let Some((_, at)) = self.live.get(&m.id) {
            return Err(self.invalid(
                line,
                format!("map id {} is already live (mapped at line {at})", m.id),
            ));
        }
        let id = *self.next_id;
        *self.next_id += 1;
        if m.kernel.as_ref().is_some_and(|k| k.tlb_addr.is_none()) {
            self.info.kernel_failures += 1;
        } else {
            self.live.insert(m.id, (id, line));
        }
        let h = self.header.as_ref();
        m.id = id;
        m.min_align_mask = m.min_align_mask.or(h.and_then(|h| h.min_align_mask));
        m.seg_boundary_mask = m.seg_boundary_mask.or(h.and_then(|h| h.seg_boundary_mask));
        Ok(())
    }

    /// A dynamic-pool trace's pool event: counted, not replayed.
    fn pool_event(&mut self, line: u64, op: &TraceOp) -> Result<()> {
        if !self.info.dynamic {
            return Err(self.invalid(
                line,
                format!(
                    "{} in a trace without a dynamic-pool header (swiotlb-kernel-trace/2 with \
                     `dynamic`)",
                    op.name()
                ),
            ));
        }
        match op {
            TraceOp::PoolAdd { .. } => self.info.kernel_pools_added += 1,
            TraceOp::TransientAlloc { start: Some(_), .. } => {
                self.info.kernel_transient_pools += 1;
            }
            _ => {}
        }
        Ok(())
    }

    fn finish(self, last_line: u64) -> Result<Loaded> {
        if self.info.maps == 0 {
            return Err(self.invalid(last_line, "the trace has no map".into()));
        }
        let mut info = self.info;
        info.live_at_end = self.live.len();
        Ok(Loaded {
            info,
            header: self.header,
            ops: self.ops,
        })
    }
}

/// The header of several traces replayed through one pool: their pools' slots added up, the
/// most areas and CPUs of any, the first one's pool start.
fn merged_header(loaded: &[Loaded]) -> Option<TraceHeader> {
    if let [one] = loaded {
        return one.header.clone();
    }
    let headers: Vec<&TraceHeader> = loaded.iter().filter_map(|l| l.header.as_ref()).collect();
    let first = headers.first()?;
    let nslabs = if headers.len() == loaded.len() {
        headers.iter().map(|h| h.nslabs).sum::<Option<usize>>()
    } else {
        None
    };
    Some(TraceHeader {
        nslabs,
        nareas: headers.iter().filter_map(|h| h.nareas).max(),
        start: first.start,
        cpus: headers.iter().filter_map(|h| h.cpus).max(),
        ..TraceHeader::default()
    })
}

impl Sizer {
    /// Loads every operation of one trace (`ops` as a [`super::TraceReader`] yields them).
    /// `opts` gives the mode, workers, base and the current size (slots, areas); its allocator
    /// and `compare` are ignored.
    ///
    /// # Errors
    /// The first read or parse error of the trace, or [`TraceError::Invalid`] where it cannot
    /// be replayed as it stands.
    pub fn load(
        ops: impl IntoIterator<Item = Result<(u64, TraceOp)>>,
        opts: &ReplayOptions,
    ) -> Result<Self> {
        Self::load_many([("trace".to_string(), ops)], opts)
    }

    /// Loads several traces to be replayed together through one pool (see the module's docs
    /// for how they are interleaved); each comes with its name for messages.
    ///
    /// # Errors
    /// As [`Sizer::load`], for any of them.
    pub fn load_many<I>(
        traces: impl IntoIterator<Item = (String, I)>,
        opts: &ReplayOptions,
    ) -> Result<Self>
    where
        I: IntoIterator<Item = Result<(u64, TraceOp)>>,
    {
        let mut next_id = 0;
        let loaded = traces
            .into_iter()
            .map(|(name, ops)| load_one(name, ops, &mut next_id))
            .collect::<Result<Vec<Loaded>>>()?;
        let mut header = merged_header(&loaded);
        // Static replays build static pools; the dynamic ones build theirs from the sizes they
        // are asked for ([`dynamic`]).
        let dynamic_header = header.as_mut().and_then(|h| h.dynamic.take());
        let traces: Vec<TraceInfo> = loaded.iter().map(|l| l.info.clone()).collect();
        let ops = if loaded.len() == 1 {
            loaded.into_iter().flat_map(|l| l.ops).collect()
        } else {
            let mut keyed: Vec<(f64, (u64, TraceOp))> = loaded
                .into_iter()
                .flat_map(|l| {
                    let n = l.ops.len() as f64;
                    l.ops
                        .into_iter()
                        .enumerate()
                        .map(move |(k, op)| (k as f64 / n, op))
                })
                .collect();
            // Stable: at equal positions the earlier trace goes first.
            keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
            keyed.into_iter().map(|(_, op)| op).collect()
        };
        Ok(Self {
            ops,
            header,
            opts: ReplayOptions {
                compare: false,
                ..opts.clone()
            },
            max_slots: DEFAULT_MAX_SLOTS,
            traces,
            replays: RefCell::new(HashMap::new()),
            dynamic_header,
            dynamic_replays: RefCell::new(HashMap::new()),
        })
    }

    /// Caps the search (default [`DEFAULT_MAX_SLOTS`]).
    pub fn max_slots(mut self, max: usize) -> Self {
        self.max_slots = max.max(IO_TLB_SEGSIZE);
        self
    }

    /// The header the replays use (the trace's, or the merged one of several), if any.
    pub fn header(&self) -> Option<&TraceHeader> {
        self.header.as_ref()
    }

    /// What the capturing kernel's dynamic pools were fixed at, for one dynamic-pool trace.
    pub fn dynamic_header(&self) -> Option<&DynamicHeader> {
        self.dynamic_header.as_ref()
    }

    /// The traces loaded.
    pub fn traces(&self) -> &[TraceInfo] {
        &self.traces
    }

    /// The options the replays use.
    pub fn options(&self) -> &ReplayOptions {
        &self.opts
    }

    fn config(&self, alloc: AllocatorKind) -> PoolConfig {
        let mut c = self.opts.pool_config(self.header.as_ref());
        c.allocator = alloc;
        c
    }

    /// The geometry the current options and header give (Linux's rounding applied).
    ///
    /// # Errors
    /// When that pool cannot be built.
    pub fn current_geometry(&self, alloc: AllocatorKind) -> Result<Geometry> {
        Ok(self.config(alloc).geometry()?)
    }

    /// One search step: the slots of one segment in every area (swiotlb), one granule (iova).
    fn step(geom: &Geometry) -> usize {
        match geom.mode {
            PoolMode::Swiotlb => geom.segsize * geom.nareas,
            PoolMode::Iova => 1,
        }
    }

    /// `geom` resized to `slots` slots (a multiple of [`Sizer::step`]), areas unchanged.
    pub fn resized(geom: &Geometry, slots: usize) -> Geometry {
        let mut g = *geom;
        g.nslabs = slots;
        g.area_nslabs = slots / g.nareas;
        if g.mode == PoolMode::Iova {
            g.segsize = slots;
        }
        g
    }

    /// Replays the whole trace through `alloc` on a pool of geometry `geom` and counts the
    /// pool-full failures by cause. Results are kept: the same allocator and shape is replayed
    /// once.
    ///
    /// # Errors
    /// When the pool cannot be built.
    pub fn replay(&self, alloc: AllocatorKind, geom: &Geometry) -> Result<SizeReport> {
        let key = (
            alloc,
            geom.nslabs,
            geom.nareas,
            geom.segsize,
            geom.nworkers,
            geom.base,
        );
        if let Some(r) = self.replays.borrow().get(&key) {
            return Ok(r.clone());
        }
        let r = self.run(alloc, geom, None)?;
        self.replays.borrow_mut().insert(key, r.clone());
        Ok(r)
    }

    /// Replays as [`Sizer::replay`] and records the occupancy in at most `buckets` buckets.
    ///
    /// # Errors
    /// When the pool cannot be built.
    pub fn timeline(
        &self,
        alloc: AllocatorKind,
        geom: &Geometry,
        buckets: usize,
    ) -> Result<(SizeReport, Timeline)> {
        let mut t = Timeline {
            ops_per_bucket: (self.ops.len() as u64)
                .div_ceil(buckets.max(1) as u64)
                .max(1),
            ..Timeline::default()
        };
        let r = self.run(alloc, geom, Some(&mut t))?;
        Ok((r, t))
    }

    /// The header a replay at `geom` starts from: the starting area indices of a capture only
    /// mean something in a pool whose areas hold them.
    fn header_for(&self, geom: &Geometry) -> Option<TraceHeader> {
        let mut header = self.header.clone();
        if let Some(h) = header.as_mut() {
            if h.area_index_at_start
                .as_ref()
                .is_some_and(|i| i.len() != geom.nareas || i.iter().any(|&x| x >= geom.area_nslabs))
            {
                h.area_index_at_start = None;
            }
        }
        header
    }

    fn run(
        &self,
        alloc: AllocatorKind,
        geom: &Geometry,
        mut timeline: Option<&mut Timeline>,
    ) -> Result<SizeReport> {
        let allocator = alloc::build(alloc, geom)?;
        let config = self.config(alloc);
        let mut pool = BouncePool::with_allocator(*geom, allocator, config.copy_on_map)?;
        // What the kernel's map accepted, as a replay of the same trace through the
        // configured pool does (`ReplayOptions::pool_config`).
        pool.set_size_limit(config.size_limit);
        pool.set_timing(false);
        let mut r = Replayer::with_pool(pool, false, self.header_for(geom).as_ref());
        // Moving the areas' indices maps and unmaps: not part of the workload.
        r.pool().reset_hiwater();
        let mut f = Failures::default();
        let mut mismatches = Vec::new();
        let slot = geom.slot_size();
        for (n, (line, op)) in self.ops.iter().enumerate() {
            let outcome = r.apply(*line, op, &mut mismatches);
            let failed = f.record(&outcome, slot, |need, total, used| {
                (total.saturating_sub(used) as u64) < need
            });
            if let Some(t) = timeline.as_deref_mut() {
                if let Some((used, need)) = failed {
                    if t.failures.len() < Timeline::MAX_FAILURES {
                        t.failures.push((n as u64, used, need));
                    }
                }
                let start = n as u64 / t.ops_per_bucket * t.ops_per_bucket;
                let used = r.pool().used() as u64;
                match t.occupancy.last_mut() {
                    Some((s, u)) if *s == start => *u = (*u).max(used),
                    _ => t.occupancy.push((start, used)),
                }
            }
        }
        Ok(SizeReport {
            slots: geom.nslabs,
            areas: geom.nareas,
            segsize: geom.segsize,
            failures: f,
            hiwater: r.pool().stats().used_hiwater,
        })
    }

    /// The smallest pool of `base`'s shape (allocator, areas, segment size, base) with no
    /// pool-full failure, searched from `base.nslabs`.
    ///
    /// # Errors
    /// When a pool cannot be built, or no pool up to the cap avoids every failure.
    pub fn search(&self, alloc: AllocatorKind, base: &Geometry) -> Result<Search> {
        let step = Self::step(base);
        let at = |slots: usize| self.replay(alloc, &Self::resized(base, slots));
        // Double from the starting size (made a whole number of steps) until a replay has no
        // failure.
        let mut hi = base.nslabs.next_multiple_of(step).max(step);
        while at(hi)?.failures.pool_full != 0 {
            hi = hi
                .checked_mul(2)
                .filter(|&s| s <= self.max_slots)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "no pool up to {} slots replays this trace without \"buffer full\"",
                        self.max_slots
                    ))
                })?;
        }
        // Bisect in steps: `lo` failed (or is 0), `hi` did not.
        let mut lo = 0;
        while hi - lo > step {
            let mid = lo + (hi - lo) / step / 2 * step;
            if at(mid)?.failures.pool_full == 0 {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(Search {
            min_slots: hi,
            at_min: at(hi)?,
            one_step_less: if hi > step {
                Some(at(hi - step)?)
            } else {
                None
            },
        })
    }

    /// What Linux and `PoolConfig` make of `slots` in `areas` areas on a guest with `cpus`
    /// CPUs, grown by doublings until a replay confirms it has no failure (placement differs
    /// with the size, so a larger pool is replayed, not assumed to be as good). `None` areas:
    /// one per CPU.
    ///
    /// # Errors
    /// When a pool cannot be built or the doublings pass the cap.
    pub fn kernel_pool(
        &self,
        alloc: AllocatorKind,
        slots: usize,
        areas: Option<usize>,
        cpus: usize,
    ) -> Result<(Geometry, SizeReport)> {
        let mut slots = slots;
        loop {
            let g = self.kernel_geometry(alloc, slots, areas, cpus)?;
            let r = self.replay(alloc, &g)?;
            if r.failures.pool_full == 0 {
                return Ok((g, r));
            }
            slots = g
                .nslabs
                .checked_mul(2)
                .filter(|&s| s <= self.max_slots)
                .ok_or_else(|| Error::Config("rounded pool size overflows the cap".into()))?;
        }
    }

    /// What the kernel makes of `swiotlb=<slots>[,<areas>]` on a guest with `cpus` CPUs
    /// (`PoolConfig`'s rounding, which is Linux's), at the trace's pool start. `None` areas:
    /// one per CPU, as `swiotlb_init_remap` takes when the parameter names none.
    ///
    /// # Errors
    /// When the pool cannot be built.
    pub fn kernel_geometry(
        &self,
        alloc: AllocatorKind,
        slots: usize,
        areas: Option<usize>,
        cpus: usize,
    ) -> Result<Geometry> {
        let mut cfg = self.config(alloc);
        cfg.slots = slots.max(1);
        cfg.areas = areas;
        cfg.workers = cpus;
        Ok(cfg.geometry()?)
    }

    /// Finds the smallest pool for `alloc` with no pool-full failure, at the current area
    /// count.
    ///
    /// # Errors
    /// When a pool cannot be built, or no pool up to the cap avoids every failure.
    pub fn advise(&self, alloc: AllocatorKind) -> Result<Advice> {
        let cur = self.current_geometry(alloc)?;
        let current = self.replay(alloc, &cur)?;
        let s = self.search(alloc, &cur)?;
        let (rounded, _) = self.kernel_pool(alloc, s.min_slots, Some(cur.nareas), cur.nworkers)?;
        Ok(Advice {
            alloc,
            slots: rounded.nslabs,
            areas: rounded.nareas,
            swiotlb: (cur.mode == PoolMode::Swiotlb)
                .then(|| format!("{},{}", rounded.nslabs, rounded.nareas)),
            min_slots: s.min_slots,
            failures_one_step_smaller: s.one_step_less.map_or(0, |r| r.failures.pool_full),
            current,
        })
    }

    /// The same pool as the current one (areas, base, allocator) with `slots` slots, for
    /// checking an answer: `slots` must be a multiple of one segment per area.
    ///
    /// # Errors
    /// When the current pool cannot be built or `slots` is not a whole number of steps.
    pub fn geometry_with_slots(&self, alloc: AllocatorKind, slots: usize) -> Result<Geometry> {
        let cur = self.current_geometry(alloc)?;
        let step = Self::step(&cur);
        if slots == 0 || slots % step != 0 {
            return Err(Error::Config(format!(
                "{slots} slots is not a positive multiple of {step}"
            ))
            .into());
        }
        Ok(Self::resized(&cur, slots))
    }
}
