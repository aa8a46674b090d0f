//! `bounce-replay`: replays a JSON-lines trace of DMA map/unmap/sync operations (plain or gzip)
//! through a bounce pool, prints what each operation got and, at the end, the pool statistics
//! as JSON. With `--compare`, each map of a kernel trace is checked against the kernel's
//! decision and the exit status is non-zero on any mismatch. A `swiotlb-kernel-trace/2` trace
//! (a `CONFIG_SWIOTLB_DYNAMIC` kernel) replays through a dynamic pool: its pool additions
//! applied where the kernel published them, its transient pools where the kernel's page
//! allocator put them; `--compare` then also checks each map's pool and kind, growth request
//! and counters, every pool addition and transient free, and the counters at the end.
//! With `--advise`, it replays the trace at many pool sizes instead and prints, per allocator,
//! the smallest pool with no "buffer full" (as a guest `swiotlb=` value and a host `--bounce
//! slots=`), and why each failure at the current size happened. See bounce/README.md for the
//! formats.

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use bounce::trace::advise::Sizer;
use bounce::trace::{self, Mismatch, Outcome, ReplayOptions, Replayer, TraceOp};
use bounce::{AllocatorKind, PoolMode};
use clap::Parser;

/// Replay a DMA trace through a bounce pool.
#[derive(Debug, Parser)]
#[command(name = "bounce-replay", version)]
struct Args {
    /// Trace file: JSON lines, optionally gzip-compressed.
    trace: PathBuf,
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
    /// Find the smallest pool with no "buffer full" for this trace, per allocator, by
    /// replaying it at many sizes (the current size is the header's or --slots/--areas); print
    /// one JSON object.
    #[arg(long, conflicts_with_all = ["compare", "quiet"])]
    advise: bool,
    /// With --advise: the largest pool tried, in slots.
    #[arg(long, default_value_t = trace::advise::DEFAULT_MAX_SLOTS, requires = "advise")]
    max_slots: usize,
}

fn allocators(s: &str) -> Result<Vec<AllocatorKind>, String> {
    if s == "all" {
        return Ok(AllocatorKind::ALL.to_vec());
    }
    s.split(',')
        .map(|a| a.trim().parse::<AllocatorKind>().map_err(|e| e.to_string()))
        .collect()
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
    let reader = trace::open(&args.trace).map_err(|e| e.to_string())?;
    let sizer = Sizer::load(reader, &options(args, kinds[0]))
        .map_err(|e| e.to_string())?
        .max_slots(args.max_slots);
    let mut per_alloc = serde_json::Map::new();
    for k in kinds {
        let advice = sizer.advise(k).map_err(|e| format!("{k}: {e}"))?;
        per_alloc.insert(
            k.name().to_string(),
            serde_json::to_value(&advice).map_err(|e| e.to_string())?,
        );
    }
    let report = serde_json::json!({
        "trace": args.trace.display().to_string(),
        "mode": args.mode,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "advice": per_alloc,
    });
    println!("{report}");
    Ok(())
}

fn run(args: &Args) -> Result<bool, String> {
    let allocator = args
        .alloc
        .parse::<AllocatorKind>()
        .map_err(|e| e.to_string())?;
    let mut reader = trace::open(&args.trace).map_err(|e| e.to_string())?;
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
        "trace": args.trace.display().to_string(),
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
