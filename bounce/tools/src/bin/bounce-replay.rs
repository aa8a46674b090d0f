//! `bounce-replay`: replays a JSON-lines trace of DMA map/unmap/sync operations (plain or gzip)
//! through a bounce pool, prints what each operation got and, at the end, the pool statistics
//! as JSON. With `--compare`, each map of a kernel trace is checked against the kernel's
//! decision and the exit status is non-zero on any mismatch. A `swiotlb-kernel-trace/2` trace
//! (a `CONFIG_SWIOTLB_DYNAMIC` kernel) replays through a dynamic pool: its pool additions
//! applied where the kernel published them, its transient pools where the kernel's page
//! allocator put them; `--compare` then also checks each map's pool and kind, growth request
//! and counters, every pool addition and transient free, and the counters at the end.
//! With `--advise`, it replays the trace (or several traces through one shared pool, `/1` or
//! `/2`) at many pool geometries instead and prints the sizing table
//! (`bounce::trace::advise::report`): static pools, area counts, segment sizes, dynamic pools,
//! the recommended `swiotlb=` and why; `--json` prints the same as one JSON
//! object, `--chart` draws the pool's occupancy. See bounce/README.md for the formats.

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use bounce::trace::advise::report::{self, Inputs};
use bounce::trace::advise::Sizer;
use bounce::trace::{self, Mismatch, Outcome, ReplayOptions, Replayer, TraceOp};
use bounce::{AllocatorKind, PoolMode};
use bounce_tools::advice;
use clap::Parser;

/// Replay a DMA trace through a bounce pool.
#[derive(Debug, Parser)]
#[command(name = "bounce-replay", version)]
struct Args {
    /// Trace file: JSON lines or compact, optionally gzip-compressed. With --advise, several
    /// are replayed together through one shared pool.
    #[arg(required = true, num_args = 1..)]
    traces: Vec<PathBuf>,
    /// Slot allocator (legacy, bitmap, areas, areas-bitmap, iova-rbtree, iova-rcache, genpool,
    /// iova-bitmap, areas-lifo, magazine); with --advise also a comma-separated list or "all".
    #[arg(long = "alloc", default_value = "areas")]
    alloc: String,
    /// Slots in the pool (default: the trace header's nslabs, else 32768).
    #[arg(long)]
    slots: Option<usize>,
    /// Areas (default: the trace header's nareas, else one per worker).
    #[arg(long)]
    areas: Option<usize>,
    /// Workers (default: the trace header's cpus, else 1).
    #[arg(long)]
    workers: Option<usize>,
    /// Device address of slot 0, decimal or 0x-hex (default: the header's start).
    #[arg(long, value_parser = parse_u64)]
    base: Option<u64>,
    /// Pool semantics.
    #[arg(long, default_value = "swiotlb")]
    mode: PoolMode,
    /// Compare each map with the kernel's decision; exit with status 1 on any mismatch.
    #[arg(long)]
    compare: bool,
    /// Print no per-operation lines.
    #[arg(long)]
    quiet: bool,
    /// Mismatches printed in detail (all are counted).
    #[arg(long, default_value_t = 20)]
    show_mismatches: usize,
    /// Size the pool for this workload: replay it at many geometries (the current one is the
    /// header's or --slots/--areas) and print the sizing table, per allocator.
    #[arg(long, conflicts_with_all = ["compare", "quiet"])]
    advise: bool,
    /// With --advise: the largest pool tried, in slots.
    #[arg(long, default_value_t = trace::advise::DEFAULT_MAX_SLOTS, requires = "advise")]
    max_slots: usize,
    /// With --advise: print one JSON object instead of the table.
    #[arg(long, requires = "advise")]
    json: bool,
    /// With --advise: the guest's memory in MiB, or with a G (GiB) or M suffix (the
    /// confidential default pool is 6 % of it; a pool must fit in it).
    #[arg(long, value_parser = parse_mem, requires = "advise")]
    guest_mem: Option<u64>,
    /// With --advise: the guest's CPUs (default: the trace header's `cpus`, else 1).
    #[arg(long, requires = "advise")]
    guest_cpus: Option<usize>,
    /// With --advise: the guest is confidential (SEV, TDX): no `force` needed.
    #[arg(long, requires = "advise")]
    confidential: bool,
    /// With --advise: draw the pool's occupancy over the trace, at the trace's size and at the
    /// recommended one, with every failure marked, into this SVG file (first allocator).
    #[arg(long, requires = "advise")]
    chart: Option<PathBuf>,
}

fn allocators(s: &str) -> Result<Vec<AllocatorKind>, String> {
    if s == "all" {
        return Ok(AllocatorKind::ALL.to_vec());
    }
    s.split(',')
        .map(|a| a.trim().parse::<AllocatorKind>().map_err(|e| e.to_string()))
        .collect()
}

/// Guest memory as QEMU's `-m` reads it: MiB, or with an `M` or `G` suffix.
fn parse_mem(s: &str) -> Result<u64, String> {
    let (num, shift) = match s.strip_suffix(['G', 'g']) {
        Some(n) => (n, 30),
        None => (s.strip_suffix(['M', 'm']).unwrap_or(s), 20),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("'{s}' is not a memory size (e.g. 2048, 2048M, 2G)"))
}

fn parse_u64(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("'{s}': {e}"))
}

fn print_outcome(out: &mut impl Write, line: u64, o: &Outcome) -> std::io::Result<()> {
    match o {
        Outcome::Header => Ok(()),
        Outcome::Mapped {
            id,
            dev_addr,
            slot,
            nslots,
        } => writeln!(
            out,
            "{line} map {id} addr={dev_addr:#x} slot={slot} nslots={nslots}"
        ),
        Outcome::MapFailed { id, error } => writeln!(out, "{line} map {id} error: {error}"),
        Outcome::Unmapped { id } => writeln!(out, "{line} unmap {id}"),
        Outcome::Synced { id } => writeln!(out, "{line} sync {id}"),
        Outcome::PoolAdded {
            start,
            nslabs,
            nareas,
        } => writeln!(
            out,
            "{line} pool_add start={start:#x} nslabs={nslabs} nareas={nareas}"
        ),
        Outcome::Transient { id } => writeln!(out, "{line} transient pool of map {id}"),
        Outcome::Failed { id, reason } => writeln!(out, "{line} op on {id} error: {reason}"),
    }
}

fn options(args: &Args, allocator: AllocatorKind) -> ReplayOptions {
    ReplayOptions {
        allocator,
        mode: args.mode,
        slots: args.slots,
        areas: args.areas,
        workers: args.workers,
        base: args.base,
        compare: args.compare,
    }
}

fn advise(args: &Args) -> Result<(), String> {
    let kinds = allocators(&args.alloc)?;
    let started = Instant::now();
    let files = args
        .traces
        .iter()
        .map(|p| Ok((p.display().to_string(), trace::open(p)?)))
        .collect::<trace::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    let sizer = Sizer::load_many(files, &options(args, kinds[0]))
        .map_err(|e| e.to_string())?
        .max_slots(args.max_slots);
    let inputs = Inputs {
        guest_mem: args.guest_mem,
        guest_cpus: args.guest_cpus,
        confidential: args.confidential,
    };
    let reports = kinds
        .iter()
        .map(|&k| report::build(&sizer, k, &inputs).map_err(|e| format!("{k}: {e}")))
        .collect::<Result<Vec<_>, String>>()?;
    if let (Some(path), Some(r)) = (&args.chart, reports.first()) {
        chart(&sizer, r, path)?;
    }
    let text = if args.json {
        let report = serde_json::json!({
            "traces": args.traces.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "mode": args.mode,
            "elapsed_s": started.elapsed().as_secs_f64(),
            "reports": reports,
        });
        format!("{report}\n")
    } else {
        reports.iter().map(|r| advice::table(r) + "\n").collect()
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing output: {e}"))
}

/// The occupancy chart of the report's allocator at the trace's pool and at the recommended one.
fn chart(sizer: &Sizer, r: &report::Report, path: &std::path::Path) -> Result<(), String> {
    let cur = sizer.current_geometry(r.alloc).map_err(|e| e.to_string())?;
    let cpus = r.guest.cpus;
    let rec = sizer
        .kernel_geometry(
            r.alloc,
            r.recommendation.slots,
            Some(r.recommendation.areas),
            cpus,
        )
        .map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for (name, g) in [("trace", cur), ("advised", rec)] {
        if name == "advised" && (g.nslabs, g.nareas) == (cur.nslabs, cur.nareas) {
            continue;
        }
        let (_, t) = sizer
            .timeline(r.alloc, &g, 2000)
            .map_err(|e| e.to_string())?;
        runs.push((format!("{name} {},{}", g.nslabs, g.nareas), g.nslabs, t));
    }
    let names: Vec<&str> = r.traces.iter().map(|t| t.name.as_str()).collect();
    advice::occupancy_chart(
        path,
        &format!("Swiotlb occupancy: {}", names.join(" + ")),
        &runs,
        vec![format!(
            "bounce-replay --advise, allocator {}: slots in use (the most in each bucket of \
             consecutive operations) in each pool, and each \"buffer is full\" at the slots in use \
             when it happened. Recommended: {}.",
            r.alloc, r.recommendation.cmdline
        )],
    )
}

fn run(args: &Args) -> Result<bool, String> {
    let allocator = args
        .alloc
        .parse::<AllocatorKind>()
        .map_err(|e| e.to_string())?;
    let [path] = args.traces.as_slice() else {
        return Err("several traces are replayed together only with --advise".into());
    };
    let mut reader = trace::open(path).map_err(|e| e.to_string())?;
    let opts = options(args, allocator);
    let first = reader.next().transpose().map_err(|e| e.to_string())?;
    let header = match &first {
        Some((_, TraceOp::Header(h))) => Some(h.clone()),
        _ => None,
    };
    let mut replayer = Replayer::new(&opts, header.as_ref()).map_err(|e| e.to_string())?;
    let stdout = std::io::stdout();
    let mut out = BufWriter::with_capacity(1 << 16, stdout.lock());
    let mut mismatches: Vec<Mismatch> = Vec::new();
    let mut shown = 0;
    let started = Instant::now();
    let io = |e: std::io::Error| format!("writing output: {e}");
    for item in first.into_iter().map(Ok).chain(reader) {
        let (line, op) = item.map_err(|e| e.to_string())?;
        let outcome = replayer.apply(line, &op, &mut mismatches);
        if !args.quiet {
            print_outcome(&mut out, line, &outcome).map_err(io)?;
        }
        for m in mismatches.drain(..) {
            if shown < args.show_mismatches {
                writeln!(out, "MISMATCH line {} map {}: {}", m.line, m.id, m.what).map_err(io)?;
                shown += 1;
            }
        }
    }
    replayer.finish(&mut mismatches);
    for m in mismatches.drain(..) {
        if shown < args.show_mismatches {
            writeln!(out, "MISMATCH at the end: {}", m.what).map_err(io)?;
            shown += 1;
        }
    }
    let elapsed = started.elapsed();
    let summary = replayer.summary().clone();
    let report = serde_json::json!({
        "trace": path.display().to_string(),
        "elapsed_s": elapsed.as_secs_f64(),
        "live_at_end": replayer.live(),
        "replay": summary,
        "area_index": replayer.pool().allocator().area_index(),
        "pool": replayer.pool().stats(),
    });
    writeln!(out, "{report}").map_err(io)?;
    out.flush().map_err(io)?;
    Ok(summary.mismatches == 0)
}

fn main() -> ExitCode {
    let args: Args = match bouncevm_common::cli::parse_args("bounce-replay", " (see --help)") {
        Ok(a) => a,
        Err(code) => return code,
    };
    if args.advise {
        return match advise(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bounce-replay: {e}");
                ExitCode::from(2)
            }
        };
    }
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bounce-replay: the replay differs from the kernel's decisions");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("bounce-replay: {e}");
            ExitCode::from(2)
        }
    }
}
