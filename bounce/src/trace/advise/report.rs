//! The advisor's answer for one allocator: every row of the table `bounce-replay --advise`
//! prints, each from replays of the whole workload.
//!
//! - **Static pools**: the trace's own pool; the smallest pool with no "buffer is full" (in
//!   steps of one segment per area) and one step less; what the kernel makes of
//!   `swiotlb=<minimum>,<areas>`; the default pool (64 MiB), and on a confidential guest 6 % of
//!   its memory (capped at 1 GiB).
//! - **Areas**: 1, 2, 4, ... up to the CPU count (and the trace's own count): the smallest pool
//!   at that count, what the kernel makes of it, the memory of its slots and of its bookkeeping
//!   (`struct io_tlb_slot` per slot, `struct io_tlb_area` per area), and the failures and
//!   high-water mark at the trace's size.
//! - **Segment size** (`IO_TLB_SEGSIZE`, 128 slots, fixed when Linux is built): 128, 256 and
//!   512 at the trace's size and their smallest pools, when large mappings failed somewhere.
//! - **Dynamic pools** (`CONFIG_SWIOTLB_DYNAMIC`, [`super::dynamic`]): the trace's pool, the
//!   advised static pool, the defaults and the smallest pool of the trace's areas as default
//!   pools, each replayed through the dynamic model: transient pools and their peak, pools
//!   added, the peak memory of all pools, and the failures that remain.
//! - **The recommendation**: the kernel command line of the area row that costs least memory
//!   with no failure, and why, in one sentence; it names a dynamic pool when one serves every
//!   map with at least a quarter less memory.

use serde::Serialize;

use super::dynamic::{DynamicReport, WORKER_LAG_MAPS};
use super::linux::{self, Guest};
use super::{Search, SizeReport, Sizer, TraceInfo};
use crate::error::Error;
use crate::geometry::Geometry;
use crate::trace::Result;
use crate::types::{AllocatorKind, PoolMode};
use crate::IO_TLB_SEGSIZE;

/// What the advisor is told about the guest; `None` takes the trace header's, then a default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Inputs {
    /// Guest memory in bytes.
    pub guest_mem: Option<u64>,
    /// Guest CPUs.
    pub guest_cpus: Option<usize>,
    /// A confidential guest (SEV, TDX).
    pub confidential: bool,
}

/// Which static pool a row is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StaticKind {
    /// The pool the trace was captured with (or the options').
    Trace,
    /// The smallest pool with no pool-full failure, areas as the trace's.
    Minimum,
    /// One segment per area less than the minimum.
    OneSegmentLess,
    /// What the kernel makes of `swiotlb=<minimum>,<areas>`.
    Kernel,
    /// Linux's default pool on an ordinary guest: 64 MiB, one area per CPU.
    Default,
    /// Linux's default pool on a confidential guest: 6 % of memory, 64 MiB to 1 GiB.
    ConfidentialDefault,
}

impl StaticKind {
    /// The row's label in the table.
    pub fn label(self) -> &'static str {
        match self {
            StaticKind::Trace => "the trace's pool",
            StaticKind::Minimum => "smallest without failure",
            StaticKind::OneSegmentLess => "one segment per area less",
            StaticKind::Kernel => "what the kernel makes of it",
            StaticKind::Default => "default (64 MiB)",
            StaticKind::ConfidentialDefault => "default, confidential guest (6 %)",
        }
    }
}

/// One static pool and its replay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StaticRow {
    /// Which pool.
    pub kind: StaticKind,
    /// The kernel parameter that gives this pool (`"slots,areas"`); `None` for a size only a
    /// hand-built pool has.
    pub swiotlb: Option<String>,
    /// Bytes of its slots.
    pub pool_bytes: u64,
    /// The replay.
    pub replay: SizeReport,
}

/// The pools of one area count.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AreaRow {
    /// Areas.
    pub areas: usize,
    /// The smallest pool with no failure at this count.
    pub min_slots: usize,
    /// The kernel's pool for `swiotlb=<min_slots>,<areas>`, replayed.
    pub kernel: SizeReport,
    /// `swiotlb=` value giving it.
    pub swiotlb: String,
    /// Bytes of its slots.
    pub pool_bytes: u64,
    /// Bytes of its slot and area arrays.
    pub metadata_bytes: u64,
    /// The replay at the trace's pool size with this many areas; `None` when that pool is
    /// too small for them (fewer than 128 slots per area).
    pub at_trace_size: Option<SizeReport>,
}

// Field list of a report row; alike in shape only to other record structs.
/// The pools of one segment size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentRow {
    /// Slots per segment.
    pub segsize: usize,
    /// The replay at the trace's pool size; `None` when its areas do not hold whole segments
    /// of this size.
    pub at_trace_size: Option<SizeReport>,
    /// The smallest pool with no failure at this segment size, areas as the trace's.
    pub min_slots: usize,
}

/// The segment-size what-if, or why it is left out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Segments {
    /// Pool-full failures of mappings over half a segment in the static pool that had most.
    pub large_failures: u64,
    /// One row per segment size (empty when no large mapping failed).
    pub rows: Vec<SegmentRow>,
}

/// Which default pool a dynamic row starts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DynamicKind {
    /// The trace's pool (for a dynamic-pool trace, with the areas its kernel asked for).
    Trace,
    /// What the kernel makes of `swiotlb=<minimum>,<areas>` (the static table's kernel row).
    Kernel,
    /// The recommended static pool.
    Recommended,
    /// Linux's default pool on an ordinary guest.
    Default,
    /// Linux's default pool on a confidential guest.
    ConfidentialDefault,
    /// The smallest pool the kernel makes with the trace's areas (128 slots each): the pools
    /// grow.
    Smallest,
}

impl DynamicKind {
    /// The row's label in the table.
    pub fn label(self) -> &'static str {
        match self {
            DynamicKind::Trace => "the trace's pool",
            DynamicKind::Kernel => "what the kernel makes of the smallest",
            DynamicKind::Recommended => "the recommended static pool",
            DynamicKind::Default => "default (64 MiB)",
            DynamicKind::ConfidentialDefault => "default, confidential guest (6 %)",
            DynamicKind::Smallest => "smallest the kernel makes",
        }
    }
}

/// One default pool with dynamic pools on, and its replay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DynamicRow {
    /// Which default pool.
    pub kind: DynamicKind,
    /// The kernel parameter that gives it (`"slots,areas"`).
    pub swiotlb: String,
    /// Bytes of the default pool's slots.
    pub default_bytes: u64,
    /// The replay.
    pub replay: DynamicReport,
}

/// The dynamic-pool rows (`CONFIG_SWIOTLB_DYNAMIC`, [`super::dynamic`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Dynamic {
    /// Maps between a growth request and the first that sees the worker's pool.
    pub worker_lag_maps: u64,
    /// Bytes the pools may take: the guest's memory below 4 GiB.
    pub memory_bytes: u64,
    /// One row per default pool.
    pub rows: Vec<DynamicRow>,
}

/// The kernel command line to use, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Recommendation {
    /// `swiotlb=N,A[,force]`.
    pub cmdline: String,
    /// Slots.
    pub slots: usize,
    /// Areas.
    pub areas: usize,
    /// One sentence.
    pub reason: String,
}

/// Everything the advisor found for one allocator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The allocator replayed.
    pub alloc: AllocatorKind,
    /// The traces replayed (together, through one pool, when several).
    pub traces: Vec<TraceInfo>,
    /// The guest advised for.
    pub guest: Guest,
    /// Where the CPU count came from: `"--guest-cpus"`, `"trace header"` or `"default"`.
    pub cpus_from: &'static str,
    /// Static pools.
    pub static_pools: Vec<StaticRow>,
    /// One row per area count.
    pub areas: Vec<AreaRow>,
    /// The segment-size what-if.
    pub segments: Segments,
    /// What Linux makes of `swiotlb=<smallest>,<areas>` (the trace's areas): the kernel row's
    /// size, unless that pool failed and the kernel row is a doubling of it.
    pub kernel_of_minimum: usize,
    /// Dynamic pools.
    pub dynamic: Dynamic,
    /// The command line.
    pub recommendation: Recommendation,
    /// What a reader must know to read the rows (live mappings at the end, missing inputs).
    pub notes: Vec<String>,
}

/// Bytes of a pool's slots.
fn pool_bytes(g: &Geometry) -> u64 {
    g.nslabs as u64 * linux::SLOT_BYTES
}

/// `n` as MiB, as short as it reads (`2`, `2.25`, `0.5`).
pub fn mib(bytes: u64) -> String {
    let m = bytes as f64 / f64::from(1u32 << 20);
    let s = format!("{m:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s} MiB")
}

/// Builds the report for `alloc`.
///
/// # Errors
/// Bad inputs (no CPU, no memory), a trace pool the kernel cannot set up on this guest, a
/// search that passes the cap, or a pool that cannot be built.
pub fn build(sizer: &Sizer, alloc: AllocatorKind, inputs: &Inputs) -> Result<Report> {
    let (guest, cpus_from) = guest_of(sizer, inputs)?;
    let cur = sizer.current_geometry(alloc)?;
    if cur.mode != PoolMode::Swiotlb {
        return Err(
            Error::Config("the advisor sizes swiotlb pools (--mode swiotlb)".into()).into(),
        );
    }
    guest.check_pool(&cur)?;
    let mut notes = Vec::new();
    let (static_pools, kernel_of_minimum) = static_rows(sizer, alloc, &cur, &guest, &mut notes)?;
    let areas = area_rows(sizer, alloc, &cur, guest.cpus)?;
    let segments = segment_rows(sizer, alloc, &cur, &static_pools)?;
    let best = best_area(&areas, &guest)?;
    let dynamic = dynamic_rows(sizer, &cur, &static_pools, best, &guest)?;
    notes.extend(trace_notes(sizer));
    let recommendation = recommend(best, &areas, &static_pools, &dynamic, &guest)?;
    Ok(Report {
        alloc,
        traces: sizer.traces().to_vec(),
        guest,
        cpus_from,
        static_pools,
        areas,
        segments,
        kernel_of_minimum,
        dynamic,
        recommendation,
        notes,
    })
}

/// The guest advised for, and where its CPU count came from.
fn guest_of(sizer: &Sizer, inputs: &Inputs) -> Result<(Guest, &'static str)> {
    let (cpus, cpus_from) = match (inputs.guest_cpus, sizer.header().and_then(|h| h.cpus)) {
        (Some(c), _) => (c, "--guest-cpus"),
        (None, Some(c)) => (c, "trace header"),
        (None, None) => (1, "default"),
    };
    if cpus == 0 {
        return Err(Error::Config("--guest-cpus 0: a guest has at least one CPU".into()).into());
    }
    if inputs.guest_mem == Some(0) {
        return Err(Error::Config("--guest-mem 0: a guest has memory".into()).into());
    }
    let guest = Guest {
        mem_bytes: inputs.guest_mem,
        cpus,
        confidential: inputs.confidential,
    };
    Ok((guest, cpus_from))
}

/// `swiotlb=` value of a geometry.
fn swiotlb(g: &Geometry) -> String {
    format!("{},{}", g.nslabs, g.nareas)
}

/// The static pools (the trace's, the smallest and one step less, the kernel's, the defaults)
/// and what the kernel makes of `swiotlb=<smallest>,<areas>`.
fn static_rows(
    sizer: &Sizer,
    alloc: AllocatorKind,
    cur: &Geometry,
    guest: &Guest,
    notes: &mut Vec<String>,
) -> Result<(Vec<StaticRow>, usize)> {
    let cpus = guest.cpus;
    let row = |kind, g: &Geometry, named: bool| -> Result<StaticRow> {
        Ok(StaticRow {
            kind,
            swiotlb: named.then(|| swiotlb(g)),
            pool_bytes: pool_bytes(g),
            replay: sizer.replay(alloc, g)?,
        })
    };
    let mut rows = vec![row(StaticKind::Trace, cur, true)?];
    let s: Search = sizer.search(alloc, cur)?;
    let min_geom = Sizer::resized(cur, s.min_slots);
    let named = linux::is_kernel_geometry(s.min_slots, cur.nareas);
    rows.push(row(StaticKind::Minimum, &min_geom, named)?);
    if let Some(less) = &s.one_step_less {
        let g = Sizer::resized(cur, less.slots);
        let named = linux::is_kernel_geometry(g.nslabs, g.nareas);
        rows.push(row(StaticKind::OneSegmentLess, &g, named)?);
    }
    let kernel_of_minimum = sizer
        .kernel_geometry(alloc, s.min_slots, Some(cur.nareas), cpus)?
        .nslabs;
    let (kernel, _) = sizer.kernel_pool(alloc, s.min_slots, Some(cur.nareas), cpus)?;
    rows.push(row(StaticKind::Kernel, &kernel, true)?);
    let default = sizer.kernel_geometry(alloc, linux::default_slots(false, 0), None, cpus)?;
    rows.push(row(StaticKind::Default, &default, false)?);
    match guest.mem_bytes {
        Some(mem) => {
            let g = sizer.kernel_geometry(alloc, linux::default_slots(true, mem), None, cpus)?;
            rows.push(row(StaticKind::ConfidentialDefault, &g, false)?);
        }
        None => notes.push(
            "the confidential guest's default (6 % of memory) needs the guest's memory \
             (--guest-mem)"
                .into(),
        ),
    }
    Ok((rows, kernel_of_minimum))
}

/// Areas: powers of two up to the CPU count, and the trace's own count.
fn area_rows(
    sizer: &Sizer,
    alloc: AllocatorKind,
    cur: &Geometry,
    cpus: usize,
) -> Result<Vec<AreaRow>> {
    let mut counts: Vec<usize> = std::iter::successors(Some(1usize), |a| a.checked_mul(2))
        .take_while(|&a| a <= cpus.next_power_of_two())
        .collect();
    if !counts.contains(&cur.nareas) {
        counts.push(cur.nareas);
        counts.sort_unstable();
    }
    let mut areas = Vec::new();
    for a in counts {
        let base = sizer.kernel_geometry(alloc, cur.nslabs, Some(a), cpus)?;
        if base.nareas != a {
            continue;
        }
        let at_trace_size = if base.nslabs == cur.nslabs {
            Some(sizer.replay(alloc, &base)?)
        } else {
            None
        };
        let found = sizer.search(alloc, &base)?;
        let (k, kr) = sizer.kernel_pool(alloc, found.min_slots, Some(a), cpus)?;
        areas.push(AreaRow {
            areas: a,
            min_slots: found.min_slots,
            kernel: kr,
            swiotlb: swiotlb(&k),
            pool_bytes: pool_bytes(&k),
            metadata_bytes: linux::metadata_bytes(&k),
            at_trace_size,
        });
    }
    Ok(areas)
}

/// Segment sizes, when a large mapping failed in a static row.
fn segment_rows(
    sizer: &Sizer,
    alloc: AllocatorKind,
    cur: &Geometry,
    static_pools: &[StaticRow],
) -> Result<Segments> {
    let large_failures = static_pools
        .iter()
        .map(|r| r.replay.failures.large)
        .max()
        .unwrap_or(0);
    let mut segments = Segments {
        large_failures,
        rows: Vec::new(),
    };
    if large_failures == 0 {
        return Ok(segments);
    }
    for segsize in [IO_TLB_SEGSIZE, 2 * IO_TLB_SEGSIZE, 4 * IO_TLB_SEGSIZE] {
        let mut base = *cur;
        base.segsize = segsize;
        let at_trace_size = if cur.area_nslabs % segsize == 0 {
            Some(sizer.replay(alloc, &base)?)
        } else {
            None
        };
        let found = sizer.search(alloc, &base)?;
        segments.rows.push(SegmentRow {
            segsize,
            at_trace_size,
            min_slots: found.min_slots,
        });
    }
    Ok(segments)
}

/// The default pools dynamic rows start from: the trace's (the areas its kernel asked for,
/// when it had dynamic pools), the kernel's rounding of the smallest static pool, the
/// recommended static pool, Linux's defaults, and the smallest
/// pool of the trace's areas, which makes the pools grow. Each (slots, areas) once; those that
/// do not fit the guest's memory are left out.
fn dynamic_rows(
    sizer: &Sizer,
    cur: &Geometry,
    static_pools: &[StaticRow],
    recommended: &AreaRow,
    guest: &Guest,
) -> Result<Dynamic> {
    let memory_bytes = guest
        .mem_bytes
        .map_or(linux::LOW_MEMORY_LIMIT, |m| m.min(linux::LOW_MEMORY_LIMIT));
    let trace_areas = sizer
        .dynamic_header()
        .map_or(cur.nareas, |d| d.default_nareas);
    let sized = |kind| {
        static_pools
            .iter()
            .find(|r| r.kind == kind)
            .map(|r| (r.replay.slots, Some(r.replay.areas)))
    };
    let candidates = [
        (DynamicKind::Trace, Some((cur.nslabs, Some(trace_areas)))),
        (DynamicKind::Kernel, sized(StaticKind::Kernel)),
        (
            DynamicKind::Recommended,
            Some((recommended.kernel.slots, Some(recommended.areas))),
        ),
        (
            DynamicKind::Default,
            sized(StaticKind::Default).map(|(s, _)| (s, None)),
        ),
        (
            DynamicKind::ConfidentialDefault,
            sized(StaticKind::ConfidentialDefault).map(|(s, _)| (s, None)),
        ),
        (
            DynamicKind::Smallest,
            Some((IO_TLB_SEGSIZE * cur.nareas, Some(cur.nareas))),
        ),
    ];
    let mut seen = Vec::new();
    let mut rows = Vec::new();
    for (kind, at) in candidates {
        let Some((slots, areas)) = at.filter(|a| !seen.contains(a)) else {
            continue;
        };
        seen.push((slots, areas));
        let g = sizer.kernel_geometry(AllocatorKind::Areas, slots, areas, guest.cpus)?;
        if pool_bytes(&g) > memory_bytes {
            continue;
        }
        let replay = sizer.replay_dynamic(slots, areas, guest.cpus, memory_bytes)?;
        rows.push(DynamicRow {
            kind,
            swiotlb: format!("{},{}", replay.slots, replay.default_nareas),
            default_bytes: replay.slots as u64 * linux::SLOT_BYTES,
            replay,
        });
    }
    Ok(Dynamic {
        worker_lag_maps: WORKER_LAG_MAPS,
        memory_bytes,
        rows,
    })
}

/// What a reader must know about the traces themselves.
fn trace_notes(sizer: &Sizer) -> Vec<String> {
    let mut notes = Vec::new();
    let live: usize = sizer.traces().iter().map(|t| t.live_at_end).sum();
    if live > 0 {
        notes.push(format!(
            "the trace ends with {live} mappings live (the capture stopped before their \
             unmap): every replay holds their slots to the end"
        ));
    }
    if sizer.traces().len() > 1 {
        notes.push(format!(
            "several traces share one pool: their operations are interleaved in proportion \
             to their position in each (their clocks are not comparable); the trace's pool is \
             their pools added up, {} slots, as the kernel rounds it",
            sizer
                .traces()
                .iter()
                .filter_map(|t| t.nslabs)
                .sum::<usize>()
        ));
    }
    notes
}

/// The area row with the least memory (slots and bookkeeping, in whole pages) and no failure;
/// on a tie, the count nearest one area per CPU (Linux's default), then the fewer.
fn best_area<'a>(areas: &'a [AreaRow], guest: &Guest) -> Result<&'a AreaRow> {
    let per_cpu = guest.cpus.next_power_of_two();
    let distance = |r: &AreaRow| r.areas.max(per_cpu) / r.areas.min(per_cpu);
    Ok(areas
        .iter()
        .min_by(|a, b| {
            area_cost(a)
                .cmp(&area_cost(b))
                .then(distance(a).cmp(&distance(b)))
                .then(a.areas.cmp(&b.areas))
        })
        .ok_or_else(|| Error::Config("no area count fits this pool".into()))?)
}

/// The memory of an area row's pool: slots and bookkeeping, in whole pages.
fn area_cost(r: &AreaRow) -> u64 {
    (r.pool_bytes + r.metadata_bytes).next_multiple_of(4096)
}

/// The recommendation: `best` ([`best_area`]) and why, in one sentence.
fn recommend(
    best: &AreaRow,
    areas: &[AreaRow],
    statics: &[StaticRow],
    dynamic: &Dynamic,
    guest: &Guest,
) -> Result<Recommendation> {
    let force = if guest.confidential { "" } else { ",force" };
    let maps = statics.first().map_or(0, |r| r.replay.failures.maps);
    let mut reason = format!(
        "{} slots ({}) in {} area{} is the smallest pool the kernel makes that replays all \
         {maps} maps without \"buffer is full\"",
        best.kernel.slots,
        mib(best.pool_bytes),
        best.areas,
        if best.areas == 1 { "" } else { "s" },
    );
    if best.min_slots != best.kernel.slots {
        reason.push_str(&format!(
            " (the minimum, {} slots, rounded up as Linux rounds)",
            best.min_slots
        ));
    }
    let same: Vec<String> = areas
        .iter()
        .filter(|r| r.areas != best.areas && area_cost(r) == area_cost(best))
        .map(|r| r.areas.to_string())
        .collect();
    if !same.is_empty() {
        reason.push_str(&format!(
            "; {} area{} cost the same, and one area per CPU keeps CPUs off each other's lock",
            same.join(" or "),
            if same == ["1"] { "" } else { "s" }
        ));
    } else if let Some(other) = areas
        .iter()
        .filter(|r| r.areas != best.areas)
        .min_by_key(|r| area_cost(r))
    {
        reason.push_str(&format!(
            "; {} area{} would cost {} more",
            other.areas,
            if other.areas == 1 { "" } else { "s" },
            mib(area_cost(other) - area_cost(best))
        ));
    }
    if let Some(d) = statics.iter().find(|r| r.kind == StaticKind::Default) {
        if d.replay.failures.pool_full > 0 {
            reason.push_str(&format!(
                "; the default pool fails {} maps",
                d.replay.failures.pool_full
            ));
        } else if d.pool_bytes > best.pool_bytes {
            reason.push_str(&format!(
                "; the default 64 MiB pool works too, with {} more",
                mib(d.pool_bytes - best.pool_bytes)
            ));
        }
    }
    if let Some(d) = dynamic_instead(dynamic, best.pool_bytes) {
        reason.push_str(&d);
    }
    if !guest.confidential {
        reason.push_str(
            "; `force` because a guest without memory encryption bounces only when forced",
        );
    }
    reason.push('.');
    Ok(Recommendation {
        cmdline: format!("swiotlb={},{}{force}", best.kernel.slots, best.areas),
        slots: best.kernel.slots,
        areas: best.areas,
        reason,
    })
}

/// The clause naming dynamic pools when, with no failure, their peak memory is at least a
/// quarter below the static pool's (`static_bytes`): the dynamic row of least peak memory.
fn dynamic_instead(dynamic: &Dynamic, static_bytes: u64) -> Option<String> {
    let d = dynamic
        .rows
        .iter()
        .filter(|r| r.replay.failures.pool_full == 0)
        .min_by_key(|r| r.replay.peak_bytes)?;
    let r = &d.replay;
    (r.peak_bytes.saturating_mul(4) <= static_bytes.saturating_mul(3)).then(|| {
        format!(
            "; with `CONFIG_SWIOTLB_DYNAMIC`, `swiotlb={}` serves every map with at most {} of \
             pools ({} transient, {} added)",
            d.swiotlb,
            mib(r.peak_bytes),
            r.transient_pools,
            r.pools_added
        )
    })
}
