//! The sizing advisor (`bounce::trace::advise`) against independent replays.
//!
//! Every row of the report for the committed rig-1 traces is checked by replaying the trace
//! straight through a `Replayer` (no `Sizer`: its loading, renumbering, caching and search are
//! what is checked) at the row's geometry: the same failures and high-water mark; every
//! "smallest without failure" has none there and some one segment per area below; the
//! recommended command line, built as Linux builds it, replays without a failure.
//!
//! Every "dynamic on" row is checked the same way: the test builds the dynamic pool itself
//! (`PoolConfig::dynamic`, memory of its own, the growth worker run by the test
//! `WORKER_LAG_MAPS` maps after each request), replays the trace through it and compares the
//! failures, growth requests, transient pools, pools added and high-water mark, on a `/1` and
//! a `/2` trace and on a guest whose memory runs out.
//!
//! The 4-area trace (8192 slots, 2 CPUs) also compares the allocators that keep Linux's
//! semantics at its size and below, where failures appear (`magazine_against_areas_*`).

use std::path::{Path, PathBuf};

use bounce::trace::advise::dynamic::WORKER_LAG_MAPS;
use bounce::trace::advise::report::{self, DynamicRow, Inputs, Report, StaticKind};
use bounce::trace::advise::{SizeReport, Sizer};
use bounce::trace::{self, ReplayOptions, Replayer, TraceOp};
use bounce::{
    alloc, AllocatorKind, BouncePool, DynamicConfig, Geometry, PoolConfig, PoolPages, SizeLimit,
    IO_TLB_SEGSIZE,
};

fn trace_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("traces")
        .join(name)
}

const SAMPLE: &str = "rig1-fio-1024slots-1area.jsonl.gz";
const FOUR_AREAS: &str = "rig1-fio-8192slots-4areas-2cpus.jsonl.gz";
const KERNEL: &str = "linux-6.12-swiotlb-4096slots-1area.bvmtrace.gz";
const DYNAMIC: &str = "rig1-fio-dynamic-512slots-4areas-2cpus.jsonl.gz";

/// What an independent replay found: pool-full failures and the high-water mark.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    pool_full: u64,
    hiwater: u64,
}

/// Replays the trace at `path` through `kind` on a pool of geometry `geom`, straight from the
/// file.
fn replay(path: &Path, kind: AllocatorKind, geom: &Geometry) -> Seen {
    let mut ops = trace::open(path).expect("open trace");
    let (_, TraceOp::Header(header)) = ops.next().unwrap().unwrap() else {
        panic!("no header");
    };
    let mut pool =
        BouncePool::with_allocator(*geom, alloc::build(kind, geom).unwrap(), None).expect("pool");
    pool.set_size_limit(SizeLimit::Kernel);
    let mut r = Replayer::with_pool(pool, false, Some(&header));
    r.pool().reset_hiwater();
    let mut mm = Vec::new();
    for item in ops {
        let (line, op) = item.unwrap();
        r.apply(line, &op, &mut mm);
    }
    assert_eq!(r.summary().map_errors, 0, "{kind} {geom:?}");
    Seen {
        pool_full: r.summary().pool_full,
        hiwater: r.pool().stats().used_hiwater,
    }
}

/// The trace's header.
fn header(path: &Path) -> trace::TraceHeader {
    match trace::open(path).unwrap().next().unwrap().unwrap().1 {
        TraceOp::Header(h) => h,
        _ => panic!("no header"),
    }
}

/// A geometry of `slots` slots, `areas` areas and `segsize` slots per segment at the trace's
/// pool start, built by hand (any whole number of segments per area).
fn geometry(path: &Path, slots: usize, areas: usize, segsize: usize) -> Geometry {
    let h = header(path);
    let mut c = PoolConfig::swiotlb(IO_TLB_SEGSIZE * areas);
    c.areas = Some(areas);
    c.base = h.start.unwrap();
    let mut g = c.geometry().unwrap();
    assert_eq!(slots % (segsize * areas), 0);
    g.nslabs = slots;
    g.area_nslabs = slots / areas;
    g.segsize = segsize;
    g
}

/// What Linux makes of `swiotlb=<slots>,<areas>` with `cpus` CPUs at the trace's pool start.
fn kernel_geometry(path: &Path, slots: usize, areas: usize, cpus: usize) -> Geometry {
    let mut c = PoolConfig::swiotlb(slots);
    c.areas = Some(areas);
    c.workers = cpus;
    c.base = header(path).start.unwrap();
    c.geometry().unwrap()
}

fn same(path: &Path, kind: AllocatorKind, g: &Geometry, row: &SizeReport, what: &str) {
    let seen = replay(path, kind, g);
    assert_eq!(
        seen,
        Seen {
            pool_full: row.failures.pool_full,
            hiwater: row.hiwater
        },
        "{what}: {row:?}"
    );
    let f = &row.failures;
    assert_eq!(f.capacity + f.fragmentation, f.pool_full, "{what}");
}

/// `min` slots (areas, segment size as given) replay without a failure and one segment per
/// area less fails.
fn smallest(
    path: &Path,
    kind: AllocatorKind,
    min: usize,
    areas: usize,
    segsize: usize,
    what: &str,
) {
    let at = replay(path, kind, &geometry(path, min, areas, segsize));
    assert_eq!(at.pool_full, 0, "{what}: {min} slots");
    let step = segsize * areas;
    if min > step {
        let below = replay(path, kind, &geometry(path, min - step, areas, segsize));
        assert!(
            below.pool_full > 0,
            "{what}: {} slots do not fail",
            min - step
        );
    }
}

fn check_report(name: &str, inputs: &Inputs) -> Report {
    let path = trace_path(name);
    let sizer = Sizer::load(trace::open(&path).unwrap(), &ReplayOptions::default()).unwrap();
    let kind = AllocatorKind::Areas;
    let r = report::build(&sizer, kind, inputs).expect("report");
    let cpus = r.guest.cpus;
    for row in &r.static_pools {
        let rp = &row.replay;
        let what = format!("{name}: {:?}", row.kind);
        let g = match row.kind {
            StaticKind::Trace | StaticKind::Minimum | StaticKind::OneSegmentLess => {
                geometry(&path, rp.slots, rp.areas, rp.segsize)
            }
            StaticKind::Kernel => {
                let (slots, areas) = row.swiotlb.as_deref().unwrap().split_once(',').unwrap();
                let g =
                    kernel_geometry(&path, slots.parse().unwrap(), areas.parse().unwrap(), cpus);
                assert_eq!((g.nslabs, g.nareas), (rp.slots, rp.areas), "{what}");
                assert_eq!(rp.failures.pool_full, 0, "{what}");
                g
            }
            StaticKind::Default | StaticKind::ConfidentialDefault => {
                let mut c = PoolConfig::swiotlb(rp.slots);
                c.workers = cpus;
                c.base = header(&path).start.unwrap();
                let g = c.geometry().unwrap();
                assert_eq!((g.nslabs, g.nareas), (rp.slots, rp.areas), "{what}");
                g
            }
        };
        same(&path, kind, &g, rp, &what);
        if row.kind == StaticKind::Minimum {
            smallest(&path, kind, rp.slots, rp.areas, rp.segsize, &what);
        }
    }
    for a in &r.areas {
        let what = format!("{name}: {} areas", a.areas);
        smallest(&path, kind, a.min_slots, a.areas, IO_TLB_SEGSIZE, &what);
        let k = kernel_geometry(&path, a.min_slots, a.areas, cpus);
        assert_eq!(format!("{},{}", k.nslabs, k.nareas), a.swiotlb, "{what}");
        same(&path, kind, &k, &a.kernel, &what);
        assert_eq!(a.kernel.failures.pool_full, 0, "{what}");
        // The next smaller pool the kernel makes at this area count fails: this is the
        // smallest.
        if k.nslabs / 2 >= IO_TLB_SEGSIZE * a.areas {
            let half = kernel_geometry(&path, k.nslabs / 2, a.areas, cpus);
            assert_eq!((half.nslabs, half.nareas), (k.nslabs / 2, a.areas));
            assert!(replay(&path, kind, &half).pool_full > 0, "{what}: {half:?}");
        }
        if let Some(t) = &a.at_trace_size {
            same(
                &path,
                kind,
                &geometry(&path, t.slots, a.areas, IO_TLB_SEGSIZE),
                t,
                &what,
            );
        }
        // 24 bytes per slot, page-aligned, and 16 per area.
        assert_eq!(
            a.metadata_bytes,
            (k.nslabs as u64 * 24).next_multiple_of(4096) + 16 * k.nareas as u64
        );
    }
    let trace_areas = r.static_pools[0].replay.areas;
    for s in &r.segments.rows {
        let what = format!("{name}: segment {}", s.segsize);
        smallest(&path, kind, s.min_slots, trace_areas, s.segsize, &what);
        if let Some(t) = &s.at_trace_size {
            same(
                &path,
                kind,
                &geometry(&path, t.slots, trace_areas, s.segsize),
                t,
                &what,
            );
        }
    }
    let rec = &r.recommendation;
    let k = kernel_geometry(&path, rec.slots, rec.areas, cpus);
    assert_eq!((k.nslabs, k.nareas), (rec.slots, rec.areas));
    assert_eq!(
        replay(&path, kind, &k).pool_full,
        0,
        "{name}: {}",
        rec.cmdline
    );
    assert!(rec
        .cmdline
        .starts_with(&format!("swiotlb={},{}", rec.slots, rec.areas)));
    assert_eq!(rec.cmdline.ends_with(",force"), !inputs.confidential);
    r
}

/// The advisor's inputs for a guest of 1 GiB, the rest as default.
fn one_gib_guest() -> Inputs {
    Inputs {
        guest_mem: Some(1 << 30),
        ..Inputs::default()
    }
}

#[test]
fn every_row_of_the_sample_trace_holds_on_an_independent_replay() {
    let r = check_report(SAMPLE, &one_gib_guest());
    // The kernel failed 8 maps at its size; so does the replay, all fragmentation, all large.
    let t = &r.static_pools[0].replay.failures;
    assert_eq!(
        (t.pool_full, t.capacity, t.fragmentation, t.large),
        (8, 0, 8, 8)
    );
    assert!(
        !r.segments.rows.is_empty(),
        "large maps failed: the what-if is shown"
    );
    assert_eq!(r.recommendation.cmdline, "swiotlb=2048,1,force");
}

#[test]
fn every_row_of_the_four_area_trace_holds_on_an_independent_replay() {
    let r = check_report(
        FOUR_AREAS,
        &Inputs {
            confidential: true,
            ..one_gib_guest()
        },
    );
    assert_eq!(r.guest.cpus, 2);
    let counts: Vec<usize> = r.areas.iter().map(|a| a.areas).collect();
    assert_eq!(
        counts,
        [1, 2, 4],
        "up to the CPU count, and the trace's own 4"
    );
    assert_eq!(r.static_pools[0].replay.failures.pool_full, 0);
}

#[test]
fn two_areas_serve_the_kernel_trace_at_its_size() {
    // The 6.12 trace failed 67 maps in one area of 4096 slots on 2 CPUs; the advisor finds
    // that two areas of 2048 serve every map at the same size.
    let path = trace_path(KERNEL);
    let sizer = Sizer::load(trace::open(&path).unwrap(), &ReplayOptions::default()).unwrap();
    let g = sizer
        .kernel_geometry(AllocatorKind::Areas, 4096, Some(2), 2)
        .unwrap();
    let found = sizer.search(AllocatorKind::Areas, &g).unwrap();
    assert_eq!(found.min_slots, 4096);
    assert_eq!(replay(&path, AllocatorKind::Areas, &g).pool_full, 0);
    let below = replay(
        &path,
        AllocatorKind::Areas,
        &geometry(&path, 3840, 2, IO_TLB_SEGSIZE),
    );
    assert!(below.pool_full > 0);
    let one = replay(
        &path,
        AllocatorKind::Areas,
        &geometry(&path, 4096, 1, IO_TLB_SEGSIZE),
    );
    assert_eq!(one.pool_full, 67);
}

/// (slots, areas failures, magazine failures, areas-lifo failures) of the 4-area trace.
fn allocator_sweep() -> Vec<(usize, u64, u64, u64)> {
    let path = trace_path(FOUR_AREAS);
    (4096..=8192)
        .step_by(512)
        .map(|slots| {
            let g = geometry(&path, slots, 4, IO_TLB_SEGSIZE);
            let f = |k| replay(&path, k, &g).pool_full;
            (
                slots,
                f(AllocatorKind::Areas),
                f(AllocatorKind::Magazine),
                f(AllocatorKind::AreasLifo),
            )
        })
        .collect()
}

/// `magazine` fails more maps than `areas` on the 4-area trace at every size below the
/// trace's where `areas` fails at all (and one where it does not): its magazines hand a
/// worker's recently freed runs back first and bulk-load runs from every area, which scatters
/// small mappings across the areas that large ones then need whole. `areas-lifo` matches
/// `areas`. bounce/README.md ("Allocators") and docs/studies/sizing-advisor.md quote these
/// figures; this test keeps them true.
#[test]
fn magazine_against_areas_on_the_four_area_trace() {
    let sweep = allocator_sweep();
    for (slots, areas, magazine, lifo) in &sweep {
        eprintln!("{slots} slots, 4 areas: areas {areas}, magazine {magazine}, areas-lifo {lifo}");
    }
    assert_eq!(
        sweep,
        [
            (4096, 32, 40, 32),
            (4608, 8, 18, 8),
            (5120, 2, 4, 2),
            (5632, 0, 1, 0),
            (6144, 0, 0, 0),
            (6656, 0, 0, 0),
            (7168, 0, 0, 0),
            (7680, 0, 0, 0),
            (8192, 0, 0, 0),
        ]
    );
}

#[test]
fn the_timeline_marks_every_failure_and_peaks_at_the_high_water_mark() {
    let path = trace_path(SAMPLE);
    let sizer = Sizer::load(trace::open(&path).unwrap(), &ReplayOptions::default()).unwrap();
    let g = sizer.current_geometry(AllocatorKind::Areas).unwrap();
    let (r, t) = sizer.timeline(AllocatorKind::Areas, &g, 500).unwrap();
    assert_eq!(t.failures.len() as u64, r.failures.pool_full);
    assert_eq!(r.failures.pool_full, 8);
    assert!(
        t.occupancy.len() <= 500 && t.occupancy.len() > 400,
        "{}",
        t.occupancy.len()
    );
    assert_eq!(t.occupancy.iter().map(|p| p.1).max(), Some(r.hiwater));
    assert!(t
        .failures
        .iter()
        .all(|&(_, used, need)| used + need > 0 && need > 64));
}

/// What an independent replay through dynamic pools found.
#[derive(Debug, PartialEq, Eq)]
struct DynamicSeen {
    pool_full: u64,
    grow_requests: u64,
    transient_pools: u64,
    pools_added: u64,
    added_slots: u64,
    hiwater: u64,
}

/// Replays the trace at `path` through a dynamic pool of its own: a default pool of `slots`
/// slots asking for `areas` areas on `cpus` CPUs, growing into `memory` bytes, the growth
/// worker run `WORKER_LAG_MAPS` maps after the map that queued it. The trace's own pool events
/// (what its kernel's page allocator and worker did) are left out. Also returns the most
/// transient slots seen after any operation.
fn replay_dynamic(
    path: &Path,
    slots: usize,
    areas: usize,
    cpus: usize,
    memory: u64,
) -> (DynamicSeen, u64) {
    let mut ops = trace::open(path).expect("open trace");
    let (_, TraceOp::Header(header)) = ops.next().unwrap().unwrap() else {
        panic!("no header");
    };
    let mut c = PoolConfig::swiotlb(slots);
    c.areas = Some(areas);
    c.workers = cpus;
    c.base = header.start.unwrap();
    c.size_limit = SizeLimit::Kernel;
    c.dynamic = Some(DynamicConfig {
        pages: PoolPages::HostStepped {
            slots: (memory / 2048) as usize,
        },
        can_grow: true,
    });
    let mut r = Replayer::with_pool(BouncePool::new(&c).expect("pool"), false, Some(&header));
    r.pool().reset_hiwater();
    let mut mm = Vec::new();
    let (mut maps, mut queued_at, mut transient_max) = (0u64, None, 0);
    for item in ops {
        let (line, op) = item.unwrap();
        if op.is_dynamic() {
            continue;
        }
        r.apply(line, &op, &mut mm);
        let d = r.pool().dynamic().unwrap();
        transient_max = transient_max.max(d.transient_nslabs());
        if !matches!(op, TraceOp::Map(_)) {
            continue;
        }
        maps += 1;
        if queued_at.is_none() && d.growth_pending() {
            queued_at = Some(maps);
        }
        if queued_at.is_some_and(|q| maps - q == WORKER_LAG_MAPS) {
            d.run_pending_worker();
            queued_at = None;
        }
    }
    assert_eq!(r.summary().map_errors, 0, "{path:?} {slots},{areas}");
    let stats = r.pool().stats();
    let d = stats.dynamic.unwrap();
    let seen = DynamicSeen {
        pool_full: r.summary().pool_full,
        grow_requests: d.grow_requests,
        transient_pools: d.transient_pools,
        pools_added: d.pools_added,
        added_slots: d.added_nslabs,
        hiwater: stats.used_hiwater,
    };
    (seen, transient_max)
}

/// Every dynamic row of `name`'s report for a guest of `guest_mem` bytes against
/// [`replay_dynamic`]; returns the rows, the trace's own pool (`own`, `"slots,areas"`) first.
fn check_dynamic_rows(name: &str, guest_mem: u64, own: &str) -> Vec<DynamicRow> {
    let inputs = &Inputs {
        guest_mem: Some(guest_mem),
        ..Inputs::default()
    };
    let path = trace_path(name);
    let sizer = Sizer::load(trace::open(&path).unwrap(), &ReplayOptions::default()).unwrap();
    let r = report::build(&sizer, AllocatorKind::Areas, inputs).expect("report");
    let memory = r.dynamic.memory_bytes;
    assert_eq!(
        memory,
        inputs.guest_mem.unwrap_or(4 << 30).min(4 << 30),
        "the guest's memory below 4 GiB"
    );
    assert!(!r.dynamic.rows.is_empty());
    for row in &r.dynamic.rows {
        let x = &row.replay;
        let what = format!("{name}: {:?} {}", row.kind, row.swiotlb);
        let (seen, transient_max) =
            replay_dynamic(&path, x.slots, x.default_nareas, r.guest.cpus, memory);
        assert_eq!(
            seen,
            DynamicSeen {
                pool_full: x.failures.pool_full,
                grow_requests: x.grow_requests,
                transient_pools: x.transient_pools,
                pools_added: x.pools_added,
                added_slots: x.added_slots,
                hiwater: x.hiwater,
            },
            "{what}"
        );
        let f = &x.failures;
        assert_eq!(f.capacity + f.fragmentation, f.pool_full, "{what}");
        assert_eq!(row.swiotlb, format!("{},{}", x.slots, x.default_nareas));
        assert_eq!(row.default_bytes, x.slots as u64 * 2048, "{what}");
        // The peak counts maps the capturing kernel failed, which the replay releases at once:
        // at least what was seen between operations.
        assert!(x.transient_peak_slots >= transient_max, "{what}");
        // Added pools stay to the end; the default pool is there at the transient peak.
        let floor = x.slots as u64 + x.added_slots.max(x.transient_peak_slots);
        assert!(
            x.peak_bytes >= floor * 2048 && x.peak_bytes <= memory,
            "{what}: peak {} bytes",
            x.peak_bytes
        );
        assert_eq!(
            x.transient_pools == 0,
            x.transient_peak_slots == 0,
            "{what}"
        );
    }
    assert_eq!(r.dynamic.rows[0].swiotlb, own);
    r.dynamic.rows
}

#[test]
fn every_dynamic_row_of_a_static_trace_holds_on_an_independent_replay() {
    let rows = check_dynamic_rows(SAMPLE, 1 << 30, "1024,1");
    // The trace's own pool failed 8 maps as a static pool; grown, it fails none.
    let own = &rows[0];
    assert_eq!(own.replay.failures.pool_full, 0);
    assert!(own.replay.grow_requests > 0 && own.replay.pools_added > 0);
    let small = rows
        .iter()
        .find(|r| r.swiotlb == "128,1")
        .expect("smallest");
    assert!(small.replay.transient_pools > 0, "{small:?}");
}

#[test]
fn every_dynamic_row_of_a_dynamic_trace_holds_on_an_independent_replay() {
    let rows = check_dynamic_rows(DYNAMIC, 1 << 30, "512,4");
    // The kernel's own configuration: 512 slots in 4 areas, growing in pools of 512.
    let own = &rows[0];
    assert!(own.replay.pools_added > 0);
    assert_eq!(own.replay.added_slots, 512 * own.replay.pools_added);
}

#[test]
fn a_guest_whose_memory_runs_out_keeps_capacity_failures() {
    // 2 MiB of memory: the trace's 1024-slot pool takes all of it, so no pool can be made.
    let rows = check_dynamic_rows(SAMPLE, 2 << 20, "1024,1");
    let own = &rows[0];
    let f = &own.replay.failures;
    assert!(f.pool_full > 0 && f.capacity == f.pool_full, "{f:?}");
    assert_eq!(own.replay.pools_added, 0);
    // Pools that do not fit the guest's memory have no row.
    assert!(rows.iter().all(|r| r.default_bytes <= 2 << 20), "{rows:?}");
}

#[test]
fn the_recommendation_names_dynamic_pools_that_save_a_quarter() {
    let path = trace_path(SAMPLE);
    let sizer = Sizer::load(trace::open(&path).unwrap(), &ReplayOptions::default()).unwrap();
    let r = report::build(&sizer, AllocatorKind::Areas, &one_gib_guest()).unwrap();
    let rec = &r.recommendation;
    let best = r
        .dynamic
        .rows
        .iter()
        .filter(|d| d.replay.failures.pool_full == 0)
        .min_by_key(|d| d.replay.peak_bytes)
        .unwrap();
    // 4 MiB static against the 128-slot default pool's peak.
    assert_eq!((rec.slots, best.swiotlb.as_str()), (2048, "128,1"));
    assert!(best.replay.peak_bytes * 4 <= 3 * (rec.slots as u64 * 2048));
    let clause = format!(
        "with `CONFIG_SWIOTLB_DYNAMIC`, `swiotlb=128,1` serves every map with at most {} of pools",
        report::mib(best.replay.peak_bytes)
    );
    assert!(rec.reason.contains(&clause), "{}", rec.reason);
    assert_eq!(
        rec.reason.matches(". ").count(),
        0,
        "one sentence: {}",
        rec.reason
    );
    // The 6.12 trace's dynamic pools save less than a quarter of its 8 MiB: not named.
    let kernel = Sizer::load(
        trace::open(&trace_path(KERNEL)).unwrap(),
        &ReplayOptions::default(),
    )
    .unwrap();
    let r = report::build(&kernel, AllocatorKind::Areas, &Inputs::default()).unwrap();
    assert!(
        !r.recommendation.reason.contains("DYNAMIC"),
        "{}",
        r.recommendation.reason
    );
}
