//! Replays of a real Linux 6.12 guest's swiotlb decisions (see `traces/README.md`).
//!
//! - `kernel_trace_areas_reproduces_every_decision`: the whole trace through `areas` (4096
//!   slots, 1 area, the kernel's pool start and segment boundary, worker = CPU) must give every
//!   map the kernel's bounce address, fail exactly where the kernel failed, and leave the area's
//!   `used` count and rolling index where the kernel had them, checked after every map.
//! - `kernel_trace_through_*`: the same operations through the other swiotlb allocators must
//!   fail only with "pool full" and return every slot.
//! - `trace_head_excerpt_reproduces_every_decision`: the first 2000 lines as JSON, in
//!   `tests/data`.
//! - `live_captures_reproduce_every_decision`: every rig-1 capture in `traces/`, the stock
//!   kernel's and the `CONFIG_SWIOTLB_DYNAMIC` kernel's (`swiotlb-kernel-trace/2`), with 0
//!   mismatches: addresses, failures, area state, and for the dynamic ones each map's pool and
//!   kind, growth request and counters, transient pools, pool additions and the counters at the
//!   end; the replay's own counts of added and transient pools, growth requests and maps per
//!   kind equal the capture's.
//! - `growth_applied_one_map_early_or_late_is_caught`: each pool addition of the dynamic
//!   captures moved one map earlier or later makes the replay disagree with the kernel.
//!
//! The whole trace is committed in the compact form (`traces/*.bvmtrace.gz`, read by
//! `bounce::trace::open` like any trace), so these tests run on every clone. Two tests tie it
//! to the JSON lines the kernel's capture wrote: its first 2000 operations are those of the
//! excerpt in `tests/data` (always), and converting the whole JSON original gives the committed
//! file byte for byte, with the same operations (`compact_kernel_trace_reproduces_from_the_json_original`).
//! The JSON original (28 MB) is not in the repository: that test looks for it in
//! `BOUNCE_TRACE_DIR`, else `<workspace>/../shared/traces/`, and records a skip without it
//! (`bounce::testing::missing`, resource `kernel-trace-json`: counted by ./tests/run, a failure
//! with `BVM_REQUIRE_RESOURCES`).

#[macro_use]
mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use bounce::trace::{self, Mismatch, ReplayOptions, ReplaySummary, Replayer, TraceFile, TraceOp};
use bounce::AllocatorKind;

const COMPACT: &str = "traces/linux-6.12-swiotlb-4096slots-1area.bvmtrace.gz";
const JSON_ORIGINAL: &str = "linux-6.12-swiotlb-4096slots-1area.jsonl.gz";
const KERNEL_MAPS: u64 = 617_338;
const KERNEL_UNMAPS: u64 = 617_271;
const KERNEL_FAILURES: u64 = 67;

/// The committed kernel trace (compact form).
fn full_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(COMPACT)
}

/// The kernel capture's JSON lines the committed trace was converted from, when present.
fn json_original() -> Option<PathBuf> {
    let dir = std::env::var_os("BOUNCE_TRACE_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"),
        PathBuf::from,
    );
    let path = dir.join(JSON_ORIGINAL);
    if path.is_file() {
        return Some(path);
    }
    let why = format!(
        "the JSON original of {COMPACT} is not at {} (set BOUNCE_TRACE_DIR); the replay tests \
         read the committed compact trace and ran",
        path.display()
    );
    bounce::testing::missing(bounce::testing::Resource::KernelTraceJson, &why);
    None
}

struct Replayed {
    summary: ReplaySummary,
    mismatches: Vec<Mismatch>,
    used_at_end: usize,
    area_used_at_end: Vec<usize>,
    maps_with_area_state: u64,
    live: usize,
}

fn replay(path: &Path, allocator: AllocatorKind, compare: bool) -> Replayed {
    replay_with(path, allocator, compare, None)
}

fn replay_with(
    path: &Path,
    allocator: AllocatorKind,
    compare: bool,
    base: Option<u64>,
) -> Replayed {
    let started = Instant::now();
    let mut ops = trace::open(path).expect("open trace");
    let (_, first) = ops.next().expect("empty trace").expect("first line");
    let TraceOp::Header(header) = &first else {
        panic!("the trace does not start with a header");
    };
    assert_eq!((header.nslabs, header.nareas), (Some(4096), Some(1)));
    let opts = ReplayOptions {
        allocator,
        compare,
        base,
        ..ReplayOptions::default()
    };
    let mut r = Replayer::new(&opts, Some(header)).expect("replay pool");
    assert_eq!(r.pool().geometry().base, base.or(header.start).unwrap());
    let mut mismatches = Vec::new();
    let mut maps_with_area_state = 0;
    for item in ops {
        let (line, op) = item.expect("trace line");
        if let TraceOp::Map(m) = &op {
            if m.kernel
                .as_ref()
                .is_some_and(|k| k.area_used.is_some() && k.area_index.is_some())
            {
                maps_with_area_state += 1;
            }
        }
        r.apply(line, &op, &mut mismatches);
    }
    eprintln!(
        "{allocator}: replayed {} ops in {:.2?}",
        r.summary().ops,
        started.elapsed()
    );
    Replayed {
        summary: r.summary().clone(),
        mismatches,
        used_at_end: r.pool().used(),
        area_used_at_end: {
            // Slots cached per worker count as used until flushed.
            r.pool().allocator().flush_caches();
            r.pool().allocator().area_used()
        },
        maps_with_area_state,
        live: r.live(),
    }
}

fn assert_exact(r: &Replayed, maps: u64, failures: u64) {
    for m in r.mismatches.iter().take(10) {
        eprintln!("line {} map {}: {}", m.line, m.id, m.what);
    }
    assert!(
        r.mismatches.is_empty(),
        "{} maps differ from the kernel's decisions",
        r.mismatches.len()
    );
    let s = &r.summary;
    assert_eq!(s.compared, maps, "every map carries a kernel decision");
    assert_eq!(r.maps_with_area_state, maps, "area state recorded per map");
    assert_eq!(s.maps + s.pool_full, maps);
    assert_eq!(s.pool_full, failures);
    assert_eq!((s.map_errors, s.other_errors, s.mismatches), (0, 0, 0));
}

#[test]
fn kernel_trace_areas_reproduces_every_decision() {
    let r = replay(&full_trace(), AllocatorKind::Areas, true);
    assert_exact(&r, KERNEL_MAPS, KERNEL_FAILURES);
    assert_eq!(r.summary.unmaps, KERNEL_MAPS - KERNEL_FAILURES);
    assert_eq!((r.used_at_end, r.live), (0, 0));
    assert_eq!(r.area_used_at_end, vec![0]);
}

fn other_allocator(kind: AllocatorKind) {
    let r = replay(&full_trace(), kind, false);
    let s = &r.summary;
    assert_eq!(s.maps + s.pool_full, KERNEL_MAPS, "{kind}");
    assert_eq!(
        (s.map_errors, s.other_errors),
        (0, 0),
        "{kind}: only pool-full errors"
    );
    assert_eq!(s.unmaps, s.maps, "{kind}");
    assert_eq!((r.used_at_end, r.live), (0, 0), "{kind}");
    assert!(r.area_used_at_end.iter().all(|&u| u == 0), "{kind}");
    eprintln!(
        "{kind}: {} pool-full failures (kernel: {KERNEL_FAILURES})",
        s.pool_full
    );
}

tests_of!(other_allocator {
    kernel_trace_through_legacy: AllocatorKind::Legacy;
    kernel_trace_through_bitmap: AllocatorKind::Bitmap;
    kernel_trace_through_areas_bitmap: AllocatorKind::AreasBitmap;
});

/// An allocator that places differently from the kernel fails other maps: the trace's unmaps
/// of maps it failed (where the kernel succeeded) are "unknown map" errors, and maps it placed
/// where the kernel failed are released by the replayer at once (`kernel_failures_released`:
/// the trace has no unmap for them). Everything else must balance exactly, and the
/// allocator (caches flushed) must count exactly the slots the pool still has mapped.
fn diverging_allocator(kind: AllocatorKind) {
    let r = replay(&full_trace(), kind, false);
    let s = &r.summary;
    eprintln!(
        "{kind}: {} pool-full failures (kernel and areas: {KERNEL_FAILURES}), {} live at end",
        s.pool_full, r.live
    );
    assert_eq!(s.maps + s.pool_full, KERNEL_MAPS, "{kind}");
    assert_eq!(s.map_errors, 0, "{kind}: only pool-full errors");
    assert!(
        s.pool_full <= KERNEL_FAILURES,
        "{kind}: {} pool-full failures, more than areas' {KERNEL_FAILURES}",
        s.pool_full
    );
    let extra_failures = s.other_errors;
    assert_eq!(
        s.pool_full - extra_failures + r.live as u64 + s.kernel_failures_released,
        KERNEL_FAILURES,
        "{kind}: failures the kernel did not have are the unmaps that found no map"
    );
    assert_eq!(
        s.unmaps + r.live as u64 + s.kernel_failures_released,
        s.maps,
        "{kind}"
    );
    assert!(r.used_at_end <= r.live * 128, "{kind}");
    assert_eq!(
        r.area_used_at_end.iter().sum::<usize>(),
        r.used_at_end,
        "{kind}: slots in use that no mapping holds"
    );
}

tests_of!(diverging_allocator {
    // 20 pool-full failures against the kernel's 67: a freed run is reused only when that
    // splits no free extent (an exact hole, or the extent the rolling index is in), which
    // keeps more whole segments free than the rolling index alone.
    kernel_trace_through_areas_lifo: AllocatorKind::AreasLifo;
    // 12 pool-full failures against the kernel's 67: the depot search is complete (first fit
    // from the rolling index over the area's bitmap) and every cache is flushed before a map
    // is refused.
    kernel_trace_through_magazine: AllocatorKind::Magazine;
});

#[test]
fn trace_head_excerpt_reproduces_every_decision() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/trace-head.jsonl");
    let r = replay(&path, AllocatorKind::Areas, true);
    // 2000 lines: the header, 1023 maps and 976 unmaps.
    assert_exact(&r, 1023, 0);
    assert_eq!(r.summary.unmaps, 976);
    assert_eq!(r.live, 1023 - 976);
}

fn items(trace: impl Iterator<Item = trace::Result<(u64, TraceOp)>>) -> Vec<(u64, TraceOp)> {
    trace.collect::<trace::Result<_>>().expect("trace")
}

#[test]
fn compact_kernel_trace_starts_as_the_json_excerpt() {
    let excerpt = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/trace-head.jsonl");
    let want: Vec<_> = items(trace::open(&excerpt).unwrap())
        .into_iter()
        .map(|(line, op)| (line, trace::as_stored(op)))
        .collect();
    let compact = trace::open(&full_trace()).unwrap();
    assert!(matches!(compact, TraceFile::Compact(_)), "{compact:?}");
    let got = items(compact.take(want.len()));
    assert_eq!(got.len(), 2000);
    assert!(
        got == want,
        "the compact trace's first 2000 operations differ from the excerpt's"
    );
}

/// The fields of a kernel trace's unmap line that the compact form leaves out (the replay
/// takes them from the live mapping).
#[derive(serde::Deserialize)]
struct UnmapDropped {
    tlb_addr: u64,
    size: usize,
    dir: u64,
}

#[test]
fn compact_kernel_trace_reproduces_from_the_json_original() {
    let Some(json) = json_original() else {
        return;
    };
    let started = Instant::now();
    let TraceFile::Json(reader) = trace::open(&json).unwrap() else {
        panic!("{} is not JSON lines", json.display());
    };
    let mut converted = Vec::new();
    let summary = trace::write_compact(reader, &mut converted, "memory").expect("convert");
    assert_eq!((summary.maps, summary.unmaps), (KERNEL_MAPS, KERNEL_UNMAPS));
    let committed = std::fs::read(full_trace()).unwrap();
    assert!(
        converted == committed,
        "converting {} gives {} bytes that differ from the committed {} ({} bytes): \
         regenerate it with the compact-trace example",
        json.display(),
        converted.len(),
        COMPACT,
        committed.len()
    );

    // Every operation is the same, and every unmap's dropped fields restate its map's.
    let TraceFile::Json(mut reader) = trace::open(&json).unwrap() else {
        unreachable!()
    };
    let mut compact = trace::open(&full_trace()).unwrap();
    let mut maps: HashMap<u64, (Option<u64>, usize, u64)> = HashMap::new();
    let (mut ops, mut unmaps) = (0u64, 0u64);
    while let Some(item) = reader.next() {
        let (line, op) = item.expect("JSON line");
        let op = trace::as_stored(op);
        let (cline, cop) = compact
            .next()
            .expect("compact trace too short")
            .expect("record");
        assert!(
            (line, &op) == (cline, &cop),
            "line {line}: JSON {op:?}, compact (line {cline}) {cop:?}"
        );
        ops += 1;
        match &op {
            TraceOp::Map(m) => {
                let addr = m.kernel.as_ref().and_then(|k| k.tlb_addr);
                maps.insert(m.id, (addr, m.size, m.dir.to_linux()));
            }
            TraceOp::Unmap { id, .. } => {
                let d: UnmapDropped = serde_json::from_str(reader.last_line()).unwrap();
                let map = maps.remove(id).expect("unmap of a known map");
                assert_eq!(map, (Some(d.tlb_addr), d.size, d.dir), "line {line}");
                unmaps += 1;
            }
            _ => {}
        }
    }
    assert!(compact.next().is_none(), "compact trace too long");
    assert_eq!(
        (ops, unmaps),
        (1 + KERNEL_MAPS + KERNEL_UNMAPS, KERNEL_UNMAPS)
    );
    eprintln!(
        "compared with the JSON original in {:.2?}",
        started.elapsed()
    );
}

#[test]
fn comparison_detects_a_pool_that_differs_from_the_kernels() {
    // Half a page off: page-sized maps land on other slots, so addresses and indices differ.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/trace-head.jsonl");
    let r = replay_with(&path, AllocatorKind::Areas, true, Some(0x38f0_0800));
    assert!(r.summary.mismatches > 0);
    assert_eq!(r.summary.mismatches, r.mismatches.len() as u64);
}

// ------------------------------------------------------------------ the pool-sizing advisor

use bounce::trace::advise::Sizer;
use bounce::IO_TLB_SEGSIZE;

/// A live capture of this repository's rig-1 guest (images/swiotlb-capture.sh): fio on a
/// bouncevm-vhost disk, Linux 6.12, `swiotlb=1024,1,force`, 2430 maps of which 8 failed.
/// The advisor's sizer over the trace at `path`, with default replay options.
fn sizer_of(path: &Path) -> Sizer {
    Sizer::load(trace::open(path).unwrap(), &ReplayOptions::default()).unwrap()
}

fn sample_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/rig1-fio-1024slots-1area.jsonl.gz")
}

#[test]
fn sample_trace_reproduces_every_decision() {
    let r = replay_sample(&sample_trace());
    assert_eq!(r.summary.compared, 2430);
    assert_eq!((r.summary.pool_full, r.summary.mismatches), (8, 0));
    assert_eq!((r.summary.map_errors, r.summary.other_errors), (0, 0));
    assert_eq!((r.used_at_end, r.live), (0, 0));
}

fn replay_sample(path: &Path) -> Replayed {
    let mut ops = trace::open(path).expect("open trace");
    let (_, TraceOp::Header(header)) = ops.next().unwrap().unwrap() else {
        panic!("no header");
    };
    let opts = ReplayOptions {
        compare: true,
        ..ReplayOptions::default()
    };
    let mut r = Replayer::new(&opts, Some(&header)).unwrap();
    let mut mismatches = Vec::new();
    for item in ops {
        let (line, op) = item.unwrap();
        r.apply(line, &op, &mut mismatches);
    }
    for m in mismatches.iter().take(5) {
        eprintln!("line {} map {}: {}", m.line, m.id, m.what);
    }
    Replayed {
        summary: r.summary().clone(),
        mismatches,
        used_at_end: r.pool().used(),
        area_used_at_end: r.pool().allocator().area_used(),
        maps_with_area_state: 0,
        live: r.live(),
    }
}

/// The advisor's answer for `kind` holds: no failure at `min_slots` nor at the rounded `slots`
/// (built through `PoolConfig`, as the host and Linux would), failures one segment per area
/// below `min_slots`, and the current size's failures split into the two causes.
fn check_advice(sizer: &Sizer, kind: AllocatorKind) -> bounce::trace::advise::Advice {
    let a = sizer.advise(kind).expect("advice");
    let step = IO_TLB_SEGSIZE * a.areas;
    let at = |slots| {
        sizer
            .replay(kind, &sizer.geometry_with_slots(kind, slots).unwrap())
            .unwrap()
            .failures
    };
    assert_eq!(at(a.min_slots).pool_full, 0, "{kind}: {a:?}");
    if a.min_slots > step {
        let below = at(a.min_slots - step);
        assert!(
            below.pool_full > 0,
            "{kind}: one segment smaller: {below:?}"
        );
        assert_eq!(below.pool_full, a.failures_one_step_smaller, "{kind}");
    }
    let mut cfg = sizer.current_geometry(kind).unwrap();
    assert_eq!(cfg.nareas, a.areas);
    cfg.nslabs = a.slots;
    cfg.area_nslabs = a.slots / a.areas;
    assert_eq!(
        sizer.replay(kind, &cfg).unwrap().failures.pool_full,
        0,
        "{kind}"
    );
    // The rounded size is what Linux makes of `swiotlb=<slots>,<areas>`.
    let pc = bounce::PoolConfig {
        slots: a.slots,
        areas: Some(a.areas),
        ..bounce::PoolConfig::swiotlb(a.slots)
    };
    let g = pc.geometry().unwrap();
    assert_eq!(
        (g.nslabs, g.nareas),
        (a.slots, a.areas),
        "{kind}: not a fixed point"
    );
    assert!(a.slots >= a.min_slots && a.slots.is_power_of_two());
    assert_eq!(
        a.swiotlb.as_deref(),
        Some(format!("{},{}", a.slots, a.areas).as_str())
    );
    let c = &a.current.failures;
    assert_eq!(c.capacity + c.fragmentation, c.pool_full, "{kind}");
    a
}

#[test]
fn advisor_sizes_the_sample_trace_for_every_allocator() {
    let sizer = sizer_of(&sample_trace());
    for kind in AllocatorKind::ALL {
        let a = check_advice(&sizer, kind);
        eprintln!(
            "{kind}: min {} slots, advise swiotlb={:?}; at 1024: {:?}",
            a.min_slots, a.swiotlb, a.current.failures
        );
    }
    // The kernel's own allocator, at the kernel's size, fails where the kernel did.
    let a = sizer.advise(AllocatorKind::Areas).unwrap();
    assert_eq!((a.current.slots, a.current.failures.pool_full), (1024, 8));
    assert!(a.min_slots > 1024);
}

#[test]
fn advisor_tells_capacity_from_fragmentation() {
    // One 128-slot segment. Four 32-slot maps fill it; one more slot is a capacity failure.
    // Then two of the four go, leaving 64 free slots in two runs of 32: a 64-slot map fails
    // for fragmentation.
    let kb64 = 64 * 1024;
    let mut text = String::from(r#"{"op":"header","nslabs":128,"nareas":1,"cpus":1}"#);
    text.push('\n');
    for id in 0..4 {
        text.push_str(&format!(
            "{{\"op\":\"map\",\"id\":{id},\"orig\":{},\"size\":{kb64},\"dir\":1}}\n",
            0x10_0000 + id * kb64
        ));
    }
    text.push_str("{\"op\":\"map\",\"id\":9,\"orig\":4096,\"size\":512,\"dir\":1}\n");
    text.push_str("{\"op\":\"unmap\",\"id\":0}\n{\"op\":\"unmap\",\"id\":2}\n");
    text.push_str(&format!(
        "{{\"op\":\"map\",\"id\":10,\"orig\":0,\"size\":{},\"dir\":2}}\n",
        2 * kb64
    ));
    text.push_str(
        "{\"op\":\"unmap\",\"id\":1}\n{\"op\":\"unmap\",\"id\":3}\n{\"op\":\"unmap\",\"id\":10}\n",
    );
    let sizer = Sizer::load(
        trace::TraceReader::from_reader(text.as_bytes(), "t".into()),
        &ReplayOptions::default(),
    )
    .unwrap();
    let a = check_advice(&sizer, AllocatorKind::Areas);
    let c = a.current.failures;
    assert_eq!(
        (c.pool_full, c.capacity, c.fragmentation),
        (2, 1, 1),
        "{a:?}"
    );
    // 4 x 32 + 1 slot live at once, then 64 contiguous: two segments suffice, one does not.
    assert_eq!(
        (a.min_slots, a.slots, a.failures_one_step_smaller),
        (256, 256, 2)
    );
    assert_eq!(a.swiotlb.as_deref(), Some("256,1"));
}

#[test]
fn advisor_answer_holds_on_the_kernel_trace() {
    let sizer = sizer_of(&full_trace());
    let a = check_advice(&sizer, AllocatorKind::Areas);
    assert_eq!(a.current.failures.pool_full, KERNEL_FAILURES);
    eprintln!("kernel trace: {a:?}");
}

/// The committed live captures of the rig-1 guest (`traces/rig1-*.jsonl.gz`): the stock
/// kernel's (`swiotlb-kernel-trace/1`) and the dynamic kernel's (`/2`).
fn live_traces() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("traces/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rig1-") && n.ends_with(".jsonl.gz"))
        })
        .collect();
    v.sort();
    v
}

/// A whole trace as (line, op) pairs, header first.
fn load_ops(path: &Path) -> Vec<(u64, TraceOp)> {
    trace::open(path)
        .expect("open trace")
        .map(|i| i.expect("trace line"))
        .collect()
}

/// Replays `ops` (header first) with compare on, to the end check included.
fn replay_ops(ops: &[(u64, TraceOp)]) -> (Replayer, Vec<Mismatch>) {
    let TraceOp::Header(header) = &ops[0].1 else {
        panic!("no header");
    };
    let opts = ReplayOptions {
        compare: true,
        ..ReplayOptions::default()
    };
    let mut r = Replayer::new(&opts, Some(header)).expect("replay pool");
    let mut mismatches = Vec::new();
    for (line, op) in &ops[1..] {
        r.apply(*line, op, &mut mismatches);
    }
    r.finish(&mut mismatches);
    (r, mismatches)
}

/// The capture's own counts (the header's `counts`), which the replay must reach by itself.
fn header_counts(path: &Path) -> serde_json::Value {
    let ops = trace::open(path).expect("open trace");
    let TraceFile::Json(mut reader) = ops else {
        panic!("{}: not JSON lines", path.display());
    };
    reader.next().expect("header").expect("header line");
    let h: serde_json::Value = serde_json::from_str(reader.last_line()).expect("header JSON");
    h["counts"].clone()
}

#[test]
fn live_captures_reproduce_every_decision() {
    let traces = live_traces();
    let dynamic: Vec<&PathBuf> = traces
        .iter()
        .filter(|t| {
            let ops = load_ops(t);
            matches!(&ops[0].1, TraceOp::Header(h) if h.version == 2)
        })
        .collect();
    assert!(dynamic.len() >= 3, "the dynamic captures are committed");
    for t in &traces {
        let ops = load_ops(t);
        let (r, mismatches) = replay_ops(&ops);
        for m in mismatches.iter().take(5) {
            eprintln!("{}: line {} map {}: {}", t.display(), m.line, m.id, m.what);
        }
        let s = r.summary();
        let maps = ops
            .iter()
            .filter(|(_, o)| matches!(o, TraceOp::Map(_)))
            .count() as u64;
        assert!(
            mismatches.is_empty(),
            "{}: {} mismatches",
            t.display(),
            s.mismatches
        );
        assert_eq!(s.compared, maps, "{}: every map compared", t.display());
        assert_eq!((s.map_errors, s.other_errors), (0, 0), "{}", t.display());
        assert_eq!((r.live(), r.pool().used()), (0, 0), "{}", t.display());
        let Some(d) = r.pool().dynamic() else {
            continue;
        };
        // What the replay did by itself equals what the capture counted in the kernel.
        let c = header_counts(t);
        let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("counts.{k}"));
        assert_eq!(s.pools_added, n("pool_add"), "{}", t.display());
        assert_eq!(s.transient_pools, n("transient_alloc"), "{}", t.display());
        assert_eq!(s.grow_requests, n("grow_requests"), "{}", t.display());
        assert_eq!(s.maps_in_added, n("maps_in_added"), "{}", t.display());
        assert_eq!(
            s.maps_in_transient,
            n("maps_in_transient"),
            "{}",
            t.display()
        );
        assert!(
            s.pools_added > 0 && s.transient_pools > 0,
            "{}",
            t.display()
        );
        let stats = r.pool().stats();
        let ds = stats.dynamic.expect("dynamic stats");
        assert_eq!(ds.pools_added, s.pools_added);
        assert_eq!(ds.added_nslabs, n("added_nslabs"), "{}", t.display());
        assert_eq!((ds.transient_live, d.transient_nslabs()), (0, 0));
    }
}

/// The `which`-th `pool_add` of `ops` moved `step` maps later (negative: earlier); `None`
/// when there is no map on that side.
fn moved(ops: &[(u64, TraceOp)], which: usize, step: isize) -> Option<Vec<(u64, TraceOp)>> {
    let mut ops = ops.to_vec();
    let at = ops
        .iter()
        .enumerate()
        .filter(|(_, (_, o))| matches!(o, TraceOp::PoolAdd { .. }))
        .nth(which)?
        .0;
    let add = ops.remove(at);
    let maps: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, (_, o))| matches!(o, TraceOp::Map(_)))
        .map(|(i, _)| i)
        .collect();
    let dest = if step > 0 {
        maps.iter().filter(|&&i| i >= at).nth(step as usize - 1)? + 1
    } else {
        let earlier: Vec<usize> = maps.iter().copied().filter(|&i| i < at).collect();
        *earlier.get(earlier.len().checked_sub(step.unsigned_abs())?)?
    };
    ops.insert(dest, add);
    Some(ops)
}

#[test]
fn growth_applied_one_map_early_or_late_is_caught() {
    let mut tried = 0;
    for t in live_traces() {
        let ops = load_ops(&t);
        let adds = ops
            .iter()
            .filter(|(_, o)| matches!(o, TraceOp::PoolAdd { .. }))
            .count();
        for which in 0..adds {
            for step in [-1, 1] {
                let Some(mutated) = moved(&ops, which, step) else {
                    continue;
                };
                let (r, mismatches) = replay_ops(&mutated);
                assert!(
                    !mismatches.is_empty() && r.summary().mismatches > 0,
                    "{}: pool_add #{which} moved {step:+} map: no mismatch",
                    t.display()
                );
                tried += 1;
            }
        }
    }
    assert!(tried >= 20, "pool additions moved: {tried}");
}
