//! Reruns the swiotlb/IOVA allocator experiments of the LKML threads on the host, in one
//! command: map+unmap pairs per second for each allocator, thread count, size and copy mode,
//! measured side by side in interleaved rounds (this machine is shared and noisy: ratios taken
//! in the same run are what to compare), printed as a table with the median of the rounds, the
//! ratio to a baseline allocator, and the time spent waiting for allocator locks. With copies, a
//! plain memcpy of the same bytes (in and back out) is measured in the same rounds as the
//! physical reference.
//!
//! Every run collects machine metadata (git revision, CPU, kernel, load), shows a progress bar
//! with ETA on stderr, stops cleanly on Ctrl-C keeping the rounds measured so far, and with
//! `--out DIR` writes the Markdown table, a JSON document with every sample and an SVG chart
//! (pairs/s against threads, one line per allocator, one panel per size and copy mode);
//! `--report FILE.md` writes a report of the run (the command that regenerates it, conditions,
//! table, how to read it) and its chart as FILE.svg.
//!
//! `bounce-experiment map-benchmark` is Linux's `dma_map_benchmark` on the host (see
//! `map_bench.rs`).
//!
//! ```text
//! bounce-experiment --alloc legacy,areas,areas-bitmap --threads 1,2,4,8 --size 4k,64k
//! bounce-experiment --alloc all --mode iova --json
//! bounce-experiment --alloc areas --dynamic both --threads 1,2
//! bounce-experiment map-benchmark -t 2 -s 1 -g 1 --alloc all
//! ```

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use bounce::{
    AllocatorKind, BouncePool, Direction, HostMemory, MapRequest, NoCopyMemory, OrigMemory,
    PoolConfig, PoolMode,
};
use clap::{Parser, Subcommand};
use serde::Serialize;

mod map_bench;

use bounce_tools::chart::{write_chart, Chart, Line, Panel, Series, XScale};
use bounce_tools::report::{self, report_markdown, size_label, Meta, Summary};

/// Allocator experiments: map+unmap throughput per allocator, threads, size.
#[derive(Parser, Debug)]
#[command(
    name = "bounce-experiment",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    matrix: Args,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Linux's dma_map_benchmark on the host: map/unmap latency per allocator, with the kernel
    /// tool's flags and output lines.
    MapBenchmark(map_bench::Args),
}

/// The allocator matrix.
#[derive(clap::Args, Debug)]
struct Args {
    /// Allocators, comma separated, or "all".
    #[arg(long, default_value = "all")]
    alloc: String,
    /// Thread counts, comma separated (each thread is one worker).
    #[arg(long, default_value = "1,2,4,8")]
    threads: String,
    /// Mapping sizes, comma separated, with optional k/m suffix.
    #[arg(long, default_value = "4k,64k")]
    size: String,
    /// Copy modes: "copy" (bidirectional buffers: one copy in, one back), "nocopy" (placement
    /// only), or both, comma separated.
    #[arg(long, default_value = "copy,nocopy")]
    copy: String,
    /// Pool semantics.
    #[arg(long, default_value = "swiotlb")]
    mode: String,
    /// Pool slots (granules in iova mode).
    #[arg(long, default_value_t = PoolConfig::DEFAULT_SLOTS)]
    slots: usize,
    /// Areas; default one per thread, as Linux uses one per CPU.
    #[arg(long)]
    areas: Option<usize>,
    /// Mappings each thread keeps live while it maps and unmaps (models queue depth).
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 0.25)]
    seconds: f64,
    /// Interleaved rounds; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Allocator the ratios are taken against (default: the first one).
    #[arg(long)]
    baseline: Option<String>,
    /// Print the JSON document (metadata, every cell with its samples) instead of the table.
    #[arg(long)]
    json: bool,
    /// The pools' time accounting: "off" (the default: the pool's own cost alone), "on" (as
    /// devices run it: one call in 16 timed, every call counted; see bounce/README.md), or
    /// "both" (each allocator twice, with and without, in the same rounds: what the accounting
    /// costs).
    #[arg(long, default_value = "off")]
    timing: String,
    /// Dynamic pools (Linux CONFIG_SWIOTLB_DYNAMIC, bounce::dynamic): "off" (the default: one
    /// static pool), "on" (a dynamic pool whose window holds 8 pools' worth: maps that fit
    /// are served by its default pool, the dynamic fast path), or "both" (each allocator twice,
    /// static and dynamic, in the same rounds). Dynamic pools use the areas allocator.
    #[arg(long, default_value = "off")]
    dynamic: String,
    /// Also measure each allocator alone, in the same rounds: the same threads, ring depth and
    /// allocator requests (built by the pool as a map builds them), calling only the
    /// allocator's alloc and free. Adds "allocator alone" and "rest" (the pair minus the
    /// allocator alone: the pool's own path, and the copies with copy) in ns per pair.
    #[arg(long)]
    split: bool,
    /// Write table.md, results.json and chart.svg into this directory.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Write a Markdown report (the command that regenerates it, the question, the conditions,
    /// the table, how to read it) to this file, and its chart next to it (FILE.svg).
    #[arg(long, value_name = "FILE.md")]
    report: Option<std::path::PathBuf>,
}

/// One cell of the table: an allocator (or the memcpy reference) at one thread count, size and
/// copy mode, over the rounds measured.
#[derive(Clone, Debug, Serialize)]
struct Cell {
    alloc: String,
    threads: usize,
    size: usize,
    copy: bool,
    mode: PoolMode,
    /// The pool's geometry (absent for the memcpy reference).
    geometry: Option<bounce::Geometry>,
    /// Rounds measured (fewer than asked after Ctrl-C).
    rounds: usize,
    /// Million map+unmap pairs per second, per round.
    mops: Summary,
    /// Nanoseconds per pair and thread, from the median.
    ns_per_pair: f64,
    /// Share of thread time spent waiting for allocator locks, per round.
    lock_wait_pct: Summary,
    /// Maps that found the pool full, over all rounds.
    failures: u64,
    /// Median over the baseline allocator's median, in the same rounds.
    ratio: f64,
    /// With `--split`: the allocator alone, million alloc+free pairs per second, per round.
    #[serde(skip_serializing_if = "Option::is_none")]
    alone: Option<Summary>,
    /// With `--split`: nanoseconds per alloc+free pair and thread of the allocator alone,
    /// from its median.
    #[serde(skip_serializing_if = "Option::is_none")]
    alone_ns_per_pair: Option<f64>,
    /// With `--split`: `ns_per_pair - alone_ns_per_pair`, what a pair costs besides the
    /// allocator (the pool's path; with copies, the copies too).
    #[serde(skip_serializing_if = "Option::is_none")]
    rest_ns_per_pair: Option<f64>,
    /// The pool's statistics over this cell's rounds (reset before them).
    pool: Option<bounce::PoolStats>,
}

/// A whole run of either subcommand: what was asked, where, and its rows (`R`, a struct of
/// one field, names them in the JSON: `cells` for the matrix, `results` for map-benchmark).
#[derive(Debug, Serialize)]
struct Report<R> {
    tool: &'static str,
    meta: Meta,
    config: serde_json::Value,
    /// True when Ctrl-C stopped the run: the rows hold the rounds measured until then.
    interrupted: bool,
    #[serde(flatten)]
    rows: R,
}

/// The rows of a matrix run.
#[derive(Debug, Serialize)]
struct Cells {
    cells: Vec<Cell>,
}

fn parse_list<T>(s: &str, what: &str, f: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|p| f(p.trim()).ok_or_else(|| format!("bad {what} '{p}'")))
        .collect()
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.to_ascii_lowercase();
    let (num, mul) = if let Some(n) = s.strip_suffix('k') {
        (n, 1024)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 1024 * 1024)
    } else {
        (s.as_str(), 1)
    };
    num.parse::<usize>()
        .ok()
        .map(|n| n * mul)
        .filter(|n| *n > 0)
}

/// Runs `threads` threads for `dur` (less if Ctrl-C comes): thread `t` first builds its work
/// with `setup(t)` (buffers are allocated outside the measured window), then all start together
/// and run until told to stop. Returns each thread's result, the elapsed time, and whether the
/// window ran to its end (false after Ctrl-C: callers drop such a measurement).
fn timed<S, R, T>(threads: usize, dur: Duration, setup: S) -> (Vec<T>, Duration, bool)
where
    S: Fn(usize) -> R + Sync,
    R: FnOnce(&AtomicBool) -> T,
    T: Send,
{
    let stop = AtomicBool::new(false);
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, barrier, setup) = (&stop, &barrier, &setup);
                scope.spawn(move || {
                    let run = setup(t);
                    barrier.wait();
                    run(stop)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let complete = report::sleep_unless_stopped(dur);
        stop.store(true, Ordering::Relaxed);
        let results = handles.into_iter().filter_map(|h| h.join().ok()).collect();
        (results, start.elapsed(), complete)
    })
}

/// One measurement: `threads` threads map and unmap for `dur`; returns (pairs, elapsed, lock
/// wait ns, failures), or `None` when Ctrl-C cut it short.
fn measure(
    pool: &BouncePool,
    threads: usize,
    size: usize,
    copy: bool,
    depth: usize,
    dur: Duration,
) -> Option<(u64, Duration, u64, u64)> {
    let wait_before = pool.stats().lock_wait_ns;
    let (results, elapsed, complete) = timed(threads, dur, |t| {
        let orig = ORIG_BASE * (t as u64 + 1);
        let mut buf = vec![0x5au8; size * depth.max(1)];
        move |stop: &AtomicBool| {
            if copy {
                let mem = HostMemory::new(orig, &mut buf);
                worker(pool, &mem, orig, size, depth, t, stop)
            } else {
                worker(pool, &NoCopyMemory, orig, size, depth, t, stop)
            }
        }
    });
    let wait = pool.stats().lock_wait_ns.saturating_sub(wait_before);
    let (pairs, failures) = results.iter().fold((0, 0), |(p, f), (n, x)| (p + n, f + x));
    complete.then_some((pairs, elapsed, wait, failures))
}

/// Where thread 0's original buffers start (thread `t`'s at `(t + 1)` times this): far apart,
/// page aligned.
const ORIG_BASE: u64 = 0x10_0000_0000;

/// The measured loop of every cell: a ring of `depth` buffers in which taking buffer `slot`
/// is followed by giving back the oldest live one, that of the next buffer (taken depth - 1
/// turns ago), so `depth - 1` stay live between pairs and up to `depth` during one. `take`
/// returns what `give` needs back (`None`: a failure, counted); `give` says whether it
/// succeeded (a pair, counted). Everything still live is given back at the end. Returns
/// (pairs, failures).
#[inline(always)]
fn ring<T: Copy>(
    depth: usize,
    stop: &AtomicBool,
    mut take: impl FnMut(usize) -> Option<T>,
    mut give: impl FnMut(usize, T) -> bool,
) -> (u64, u64) {
    let depth = depth.max(1);
    let mut ring: Vec<Option<T>> = vec![None; depth];
    let (mut n, mut failed) = (0u64, 0u64);
    let mut slot = 0usize;
    while !stop.load(Ordering::Relaxed) {
        // No division in the loop: it is part of every measured pair.
        let next = if slot + 1 == depth { 0 } else { slot + 1 };
        ring[slot] = take(slot);
        if ring[slot].is_none() {
            failed += 1;
        }
        if let Some(oldest) = ring[next].take() {
            if give(next, oldest) {
                n += 1;
            }
        }
        slot = next;
    }
    for (slot, live) in ring.into_iter().enumerate() {
        if let Some(live) = live {
            give(slot, live);
        }
    }
    (n, failed)
}

/// A pool cell's thread: [`ring`] over the pool's map and unmap of `depth` buffers of `size`
/// bytes from `orig`. Only the device address is kept (unmap_single, as `Dma` unmaps): copying
/// whole 48-byte `Mapping`s in and out of the ring stalled store forwarding in this loop,
/// which is not the pool's cost.
fn worker<M: OrigMemory>(
    pool: &BouncePool,
    mem: &M,
    orig: u64,
    size: usize,
    depth: usize,
    t: usize,
    stop: &AtomicBool,
) -> (u64, u64) {
    let (dir, attrs) = (Direction::Bidirectional, bounce::DmaAttrs::default());
    let mut req = MapRequest::new(orig, size, dir).worker(t);
    ring(
        depth,
        stop,
        |slot| {
            req.orig = orig + (slot * size) as u64;
            pool.map(mem, &req).ok().map(|m| m.dev_addr)
        },
        |_, addr| pool.unmap_single(mem, addr, size, dir, attrs, t).is_ok(),
    )
}

/// The allocator alone: `threads` threads run the [`ring`] of a pool cell, calling only the
/// pool's allocator with the requests the pool's map would give it (all built before the window
/// opens). Returns (pairs, elapsed), `None` when Ctrl-C cut it short, or the pool's error for a
/// size it refuses (no request to time).
fn measure_alone(
    pool: &BouncePool,
    threads: usize,
    size: usize,
    depth: usize,
    dur: Duration,
) -> Result<Option<(u64, Duration)>, bounce::Error> {
    let depth = depth.max(1);
    let reqs = (0..threads)
        .map(|t| {
            let orig = ORIG_BASE * (t as u64 + 1);
            (0..depth)
                .map(|i| {
                    let at = orig + (i * size) as u64;
                    pool.slot_request(
                        &MapRequest::new(at, size, Direction::Bidirectional).worker(t),
                    )
                })
                .collect::<bounce::Result<Vec<_>>>()
        })
        .collect::<bounce::Result<Vec<_>>>()?;
    let (results, elapsed, complete) = timed(threads, dur, |t| {
        let reqs = &reqs[t];
        move |stop: &AtomicBool| {
            let alloc = pool.allocator();
            ring(
                depth,
                stop,
                |slot| alloc.alloc(&reqs[slot]),
                |slot, index| {
                    alloc.free(index, reqs[slot].nslots, t);
                    true
                },
            )
            .0
        }
    });
    let pairs = results.into_iter().sum();
    Ok(complete.then_some((pairs, elapsed)))
}

/// The physical reference: `threads` threads each copying `size` bytes in and back out (what a
/// bidirectional map+unmap pair copies) for `dur`; returns pairs per second in millions, or
/// `None` after Ctrl-C.
fn memcpy_reference(threads: usize, size: usize, dur: Duration) -> Option<f64> {
    copy_reference(threads, size, size, dur, |orig, bounce, back, _| {
        bounce.copy_from_slice(std::hint::black_box(orig));
        back.copy_from_slice(std::hint::black_box(bounce));
    })
}

/// The cold reference: as [`memcpy_reference`], but each thread's bounce side walks through its
/// share of `pool_bytes`, `size` bytes further each pair (what a rolling index costs in cache
/// misses); pairs per second in millions, or `None` after Ctrl-C.
fn streaming_reference(
    threads: usize,
    size: usize,
    pool_bytes: usize,
    dur: Duration,
) -> Option<f64> {
    let share = (pool_bytes / threads.max(1)).max(size);
    copy_reference(threads, size, share, dur, |orig, pool, back, at| {
        let slot = &mut pool[*at..*at + size];
        slot.copy_from_slice(std::hint::black_box(orig));
        back.copy_from_slice(std::hint::black_box(slot));
        *at = if *at + 2 * size > share {
            0
        } else {
            *at + size
        };
    })
}

/// Both references: `threads` threads each run `pair(orig, bounce side, back, at)` until `dur`
/// is up, with an original of `size` bytes, a bounce side of `bounce_len` bytes, a copy-back
/// buffer of `size` bytes and a position `at` (from 0) that `pair` may move. `pair` is inlined
/// into each reference's loop, so the plain one keeps a loop with no index. Pairs per second in
/// millions, or `None` after Ctrl-C.
fn copy_reference(
    threads: usize,
    size: usize,
    bounce_len: usize,
    dur: Duration,
    pair: impl Fn(&[u8], &mut [u8], &mut [u8], &mut usize) + Sync,
) -> Option<f64> {
    let pair = &pair;
    let (results, elapsed, complete) = timed(threads, dur, |_| {
        let orig = vec![0x5au8; size];
        let mut bounce = vec![0u8; bounce_len];
        let mut back = vec![0u8; size];
        move |stop: &AtomicBool| {
            let mut n = 0u64;
            let mut at = 0usize;
            while !stop.load(Ordering::Relaxed) {
                pair(&orig, &mut bounce, &mut back, &mut at);
                std::hint::black_box(&back);
                n += 1;
            }
            n
        }
    });
    let pairs: u64 = results.iter().sum();
    complete.then(|| pairs as f64 / elapsed.as_secs_f64() / 1e6)
}

/// The parsed and checked matrix.
struct Plan {
    kinds: Vec<AllocatorKind>,
    /// Time accounting per entry of `kinds` (an allocator appears twice with `--timing both`).
    timing: Vec<bool>,
    both: bool,
    /// Dynamic pool per entry of `kinds` (twice with `--dynamic both`).
    dynamic: Vec<bool>,
    dynamic_both: bool,
    threads: Vec<usize>,
    sizes: Vec<usize>,
    copies: Vec<bool>,
    mode: PoolMode,
    baseline: AllocatorKind,
    dur: Duration,
    split: bool,
}

fn plan(args: &Args) -> Result<Plan, String> {
    let kinds: Vec<AllocatorKind> = if args.alloc == "all" {
        AllocatorKind::ALL.to_vec()
    } else {
        parse_list(&args.alloc, "allocator", |s| s.parse().ok())?
    };
    let threads = parse_list(&args.threads, "thread count", |s| {
        s.parse::<usize>().ok().filter(|n| (1..=256).contains(n))
    })?;
    let sizes = parse_list(&args.size, "size", parse_size)?;
    let copies = parse_list(&args.copy, "copy mode", |s| match s {
        "copy" => Some(true),
        "nocopy" => Some(false),
        _ => None,
    })?;
    let mode: PoolMode = args.mode.parse().map_err(|e| format!("{e}"))?;
    let baseline: AllocatorKind = match &args.baseline {
        Some(b) => b.parse().map_err(|e| format!("{e}"))?,
        None => kinds[0],
    };
    if !kinds.contains(&baseline) {
        return Err(format!("baseline {baseline} is not among --alloc"));
    }
    let modes: &[bool] = match args.timing.as_str() {
        "on" => &[true],
        "off" => &[false],
        "both" => &[true, false],
        other => return Err(format!("--timing: unknown '{other}' (on, off or both)")),
    };
    let dynamic_modes: &[bool] = match args.dynamic.as_str() {
        "on" => &[true],
        "off" => &[false],
        "both" => &[false, true],
        other => return Err(format!("--dynamic: unknown '{other}' (on, off or both)")),
    };
    if dynamic_modes.contains(&true) && kinds.iter().any(|&k| k != AllocatorKind::Areas) {
        return Err("--dynamic: dynamic pools search areas as Linux does (--alloc areas)".into());
    }
    let (kinds, variants): (Vec<_>, Vec<_>) = kinds
        .iter()
        .flat_map(|&k| {
            modes
                .iter()
                .flat_map(move |&m| dynamic_modes.iter().map(move |&d| (k, (m, d))))
        })
        .unzip();
    let (timing, dynamic): (Vec<bool>, Vec<bool>) = variants.into_iter().unzip();
    if !(args.seconds > 0.0 && args.seconds < 60.0) || args.rounds == 0 {
        return Err("--seconds must be in (0, 60) and --rounds at least 1".into());
    }
    Ok(Plan {
        kinds,
        timing,
        both: modes.len() == 2,
        dynamic,
        dynamic_both: dynamic_modes.len() == 2,
        threads,
        sizes,
        copies,
        mode,
        baseline,
        dur: Duration::from_secs_f64(args.seconds),
        split: args.split,
    })
}

fn build_pools(args: &Args, p: &Plan, t: usize) -> Result<Vec<Arc<BouncePool>>, String> {
    p.kinds
        .iter()
        .zip(p.timing.iter().zip(&p.dynamic))
        .map(|(&k, (&timing, &dynamic))| {
            let mut cfg = match p.mode {
                PoolMode::Swiotlb => PoolConfig::swiotlb(args.slots),
                PoolMode::Iova => PoolConfig::iova(args.slots),
            };
            cfg.allocator = k;
            cfg.workers = t;
            cfg.areas = args.areas.or(match p.mode {
                PoolMode::Swiotlb => Some(t),
                PoolMode::Iova => Some(1),
            });
            if dynamic {
                let window = args
                    .slots
                    .saturating_mul(bounce::DynamicConfig::DEFAULT_WINDOW_FACTOR);
                cfg.dynamic = Some(bounce::DynamicConfig::host(window));
            }
            BouncePool::new(&cfg)
                .map(|pool| {
                    pool.set_timing(timing);
                    Arc::new(pool)
                })
                .map_err(|e| format!("{k}: {e}"))
        })
        .collect()
}

/// Runs the matrix; returns the cells measured and whether Ctrl-C cut the run short.
fn run(args: &Args, p: &Plan) -> Result<(Vec<Cell>, bool), String> {
    let per_round = p.kinds.len() as u64 * if p.split { 2 } else { 1 };
    let total: u64 = p.threads.len() as u64
        * p.sizes.len() as u64
        * p.copies
            .iter()
            .map(|&c| (per_round + u64::from(c)) * args.rounds as u64)
            .sum::<u64>();
    let bar = report::progress(total, "bounce-experiment");
    let mut cells = Vec::new();
    'all: for &t in &p.threads {
        // One pool per allocator for this thread count, reused across sizes and rounds.
        let pools = build_pools(args, p, t)?;
        for &size in &p.sizes {
            for &copy in &p.copies {
                bar.set_message(format!(
                    "{t} threads, {}, {}",
                    size_label(size),
                    if copy { "copy" } else { "nocopy" }
                ));
                for pool in &pools {
                    pool.reset_hiwater();
                }
                let mut mops = vec![Vec::new(); p.kinds.len()];
                let mut wait = vec![Vec::new(); p.kinds.len()];
                let mut failures = vec![0u64; p.kinds.len()];
                let mut alone = vec![Vec::new(); p.kinds.len()];
                let mut reference = Vec::new();
                let mut streaming = Vec::new();
                let pool_bytes = pools.first().map_or(size, |pool| pool.geometry().bytes());
                let mut interrupted = false;
                for _ in 0..args.rounds {
                    if copy {
                        match memcpy_reference(t, size, p.dur) {
                            Some(m) => reference.push(m),
                            None => interrupted = true,
                        }
                        if !interrupted {
                            match streaming_reference(t, size, pool_bytes, p.dur) {
                                Some(m) => streaming.push(m),
                                None => interrupted = true,
                            }
                        }
                        bar.inc(1);
                    }
                    // Interleave allocators inside each round; a round counts only if every
                    // allocator completed it.
                    let mut round = Vec::new();
                    let mut round_alone = Vec::new();
                    for pool in &pools {
                        if interrupted {
                            break;
                        }
                        match measure(pool, t, size, copy, args.depth, p.dur) {
                            Some(r) => round.push(r),
                            None => interrupted = true,
                        }
                        bar.inc(1);
                        if p.split && !interrupted {
                            match measure_alone(pool, t, size, args.depth, p.dur) {
                                Ok(Some(r)) => round_alone.push(r),
                                Ok(None) => interrupted = true,
                                Err(e) => {
                                    return Err(format!("--split: {}: {e}", size_label(size)))
                                }
                            }
                            bar.inc(1);
                        }
                    }
                    if interrupted {
                        reference.truncate(mops[0].len());
                        streaming.truncate(mops[0].len());
                        break;
                    }
                    for (i, (n, el, w, f)) in round.into_iter().enumerate() {
                        let secs = el.as_secs_f64();
                        mops[i].push(n as f64 / secs / 1e6);
                        wait[i].push(100.0 * w as f64 / (secs * 1e9 * t as f64));
                        failures[i] += f;
                    }
                    for (i, (n, el)) in round_alone.into_iter().enumerate() {
                        alone[i].push(n as f64 / el.as_secs_f64() / 1e6);
                    }
                }
                let rounds = mops[0].len();
                if rounds > 0 {
                    cells.extend(cells_of(
                        p, &pools, t, size, copy, &mops, &wait, &failures, &alone, &reference,
                        &streaming,
                    ));
                }
                if interrupted {
                    break 'all;
                }
            }
        }
    }
    bar.finish_and_clear();
    Ok((cells, report::stopped()))
}

#[allow(clippy::too_many_arguments)]
fn cells_of(
    p: &Plan,
    pools: &[Arc<BouncePool>],
    t: usize,
    size: usize,
    copy: bool,
    mops: &[Vec<f64>],
    wait: &[Vec<f64>],
    failures: &[u64],
    alone: &[Vec<f64>],
    reference: &[f64],
    streaming: &[f64],
) -> Vec<Cell> {
    let meds: Vec<Summary> = mops.iter().map(|m| Summary::of(m)).collect();
    let base = p
        .kinds
        .iter()
        .position(|k| *k == p.baseline)
        .map_or(1.0, |i| meds[i].median);
    let ratio = |m: f64| if base > 0.0 { m / base } else { 0.0 };
    let ns = |m: f64| {
        if m > 0.0 {
            1e3 * t as f64 / m
        } else {
            f64::INFINITY
        }
    };
    let mut cells = Vec::new();
    for (name, samples) in [
        ("memcpy (reference)", reference),
        ("streaming copy (reference)", streaming),
    ] {
        if !copy || samples.is_empty() {
            continue;
        }
        let s = Summary::of(samples);
        cells.push(Cell {
            alloc: name.to_string(),
            threads: t,
            size,
            copy,
            mode: p.mode,
            geometry: None,
            rounds: samples.len(),
            ns_per_pair: ns(s.median),
            ratio: ratio(s.median),
            mops: s,
            lock_wait_pct: Summary::of(&[0.0]),
            failures: 0,
            pool: None,
            alone: None,
            alone_ns_per_pair: None,
            rest_ns_per_pair: None,
        });
    }
    for (i, k) in p.kinds.iter().enumerate() {
        let alone = alone
            .get(i)
            .filter(|a| !a.is_empty())
            .map(|a| Summary::of(a));
        let alone_ns = alone.as_ref().map(|a| ns(a.median));
        cells.push(Cell {
            alloc: format!(
                "{}{}{}",
                k.name(),
                if p.dynamic_both && p.dynamic[i] {
                    " (dynamic)"
                } else {
                    ""
                },
                if p.both && !p.timing[i] {
                    " (no timing)"
                } else {
                    ""
                }
            ),
            threads: t,
            size,
            copy,
            mode: p.mode,
            geometry: Some(*pools[i].geometry()),
            rounds: mops[i].len(),
            ns_per_pair: ns(meds[i].median),
            ratio: ratio(meds[i].median),
            mops: meds[i].clone(),
            lock_wait_pct: Summary::of(&wait[i]),
            failures: failures[i],
            pool: Some(pools[i].stats()),
            alone,
            alone_ns_per_pair: alone_ns,
            rest_ns_per_pair: alone_ns.map(|a| ns(meds[i].median) - a),
        });
    }
    cells
}

fn table(cells: &[Cell]) -> String {
    let split = cells.iter().any(|c| c.alone.is_some());
    let mut s = String::from("| allocator | threads | size | copy | M pairs/s | min-max | ns/pair/thread | x baseline | lock wait % | full |");
    if split {
        s.push_str(" allocator alone ns | rest ns |");
    }
    s.push_str("\n|---|---|---|---|---|---|---|---|---|---|");
    if split {
        s.push_str("---|---|");
    }
    s.push('\n');
    for c in cells {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {:.2}-{:.2} | {:.0} | {:.2} | {:.1} | {} |",
            c.alloc,
            c.threads,
            size_label(c.size),
            if c.copy { "copy" } else { "nocopy" },
            c.mops.median,
            c.mops.min,
            c.mops.max,
            c.ns_per_pair,
            c.ratio,
            c.lock_wait_pct.median,
            c.failures
        ));
        if split {
            let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
            s.push_str(&format!(
                " {} | {} |",
                cell(c.alone_ns_per_pair),
                cell(c.rest_ns_per_pair)
            ));
        }
        s.push('\n');
    }
    s
}

/// One panel per (size, copy): map+unmap pairs per second against threads, one solid line per
/// allocator, the copy references dashed.
fn panels(cells: &[Cell]) -> Vec<Panel> {
    let mut keys: Vec<(usize, bool)> = Vec::new();
    let mut allocs: Vec<&str> = Vec::new();
    for c in cells {
        if !keys.contains(&(c.size, c.copy)) {
            keys.push((c.size, c.copy));
        }
        if c.pool.is_some() && !allocs.contains(&c.alloc.as_str()) {
            allocs.push(&c.alloc);
        }
    }
    keys.into_iter()
        .map(|(size, copy)| {
            let mut series: Vec<Series> = Vec::new();
            for c in cells.iter().filter(|c| c.size == size && c.copy == copy) {
                let pt = (c.threads as f64, c.mops.median * 1e6);
                match series.iter_mut().find(|s| s.name == c.alloc) {
                    Some(s) => s.points.push(pt),
                    None => {
                        // The references (no pool) are black and grey, dashed.
                        let (line, color) = match allocs.iter().position(|a| *a == c.alloc) {
                            Some(i) => (Line::Solid, i % 10),
                            None => (Line::Dashed, 10 + series.len() % 2),
                        };
                        series.push(Series {
                            name: c.alloc.clone(),
                            points: vec![pt],
                            line,
                            color,
                        });
                    }
                }
            }
            Panel {
                title: format!(
                    "{} mappings, {}",
                    size_label(size),
                    if copy {
                        "copied in and out (bidirectional)"
                    } else {
                        "placement only (no copies)"
                    }
                ),
                x_label: "threads".into(),
                x_scale: XScale::Log2,
                y_label: "map+unmap pairs/s".into(),
                y_unit: String::new(),
                series,
            }
        })
        .collect()
}

/// What the pools were and how each cell was measured, in one sentence.
fn setup_line(args: &Args, report: &Report<Cells>) -> String {
    let mode = report
        .rows
        .cells
        .iter()
        .find_map(|c| c.geometry.map(|_| c.mode))
        .unwrap_or(PoolMode::Swiotlb);
    format!(
        "{} pool of {} {}, {}, each thread keeping {} mappings live; {} of {} of {} s per cell (median shown); the pool's time accounting {}; dynamic pools {}.",
        if mode == PoolMode::Iova { "An iova" } else { "A swiotlb" },
        args.slots,
        if mode == PoolMode::Iova { "granules" } else { "slots" },
        args.areas
            .map_or_else(|| "one area per thread".to_string(), |a| format!("{a} areas")),
        args.depth,
        report.rows.cells.iter().map(|c| c.rounds).max().unwrap_or(0),
        report::count(args.rounds, "interleaved round"),
        args.seconds,
        args.timing,
        args.dynamic,
    )
}

/// The chart of a run: one panel per size and copy mode, the conditions in the caption.
fn chart(args: &Args, report: &Report<Cells>) -> Chart {
    let mut caption = vec![setup_line(args, report)];
    if report.rows.cells.iter().any(|c| c.copy) {
        caption.push("Dashed: the copy references, measured in the same rounds: memcpy of the same bytes in and out on hot buffers, and the same copies walking a 64 MiB buffer (a new place for every pair, as a rolling index walks the pool).".into());
    }
    caption.push(format!("Measured {}.", report.meta.conditions()));
    Chart {
        title: "bounce-experiment: map+unmap pairs per second by allocator and threads".into(),
        panels: panels(&report.rows.cells),
        caption,
    }
}

/// The report file's body: the question, the conditions, the table and how to read it.
fn report_body(args: &Args, report: &Report<Cells>, table_md: &str) -> String {
    let baseline = report
        .config
        .get("baseline")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("the first allocator");
    format!(
        "**Question.** How many map+unmap pairs per second does each allocator sustain as threads are added, with and without the copies, and how long do its threads wait for locks?\n\n**Conditions.** {} Measured {}.{}\n\n{}\n**How to read it.** \"x baseline\" is each row's median over {baseline}'s in the same rounds; \"lock wait %\" the share of thread time spent waiting for allocator locks; \"full\" the maps that found the pool full. This machine had {} CPUs: rows with more threads than that show contention and time-slicing, not more parallelism. The copy references bound what a copying allocator can reach.\n",
        setup_line(args, report),
        report.meta.conditions(),
        if report.interrupted {
            " **Interrupted by Ctrl-C: what was measured until then.**"
        } else {
            ""
        },
        table_md,
        report.meta.cpus,
    )
}

/// Prints the table or JSON; writes them with the chart under `--out`, and the report file
/// with its chart under `--report`.
fn emit(args: &Args, report: &Report<Cells>) -> Result<(), String> {
    let md = table(&report.rows.cells);
    report::print_and_save(report, &md, args.json, args.out.as_deref(), "table.md")?;
    if let Some(dir) = &args.out {
        write_chart(&dir.join("chart.svg"), &chart(args, report))?;
        eprintln!(
            "bounce-experiment: wrote table.md, results.json, chart.svg in {}",
            dir.display()
        );
    }
    if let Some(path) = &args.report {
        let title = "Allocator throughput on the host (bounce-experiment)";
        let body = report_body(args, report, &md);
        report::write_text(path, &report_markdown(title, &report.meta, &body, path))?;
        write_chart(&report::chart_path(path), &chart(args, report))?;
        eprintln!(
            "bounce-experiment: wrote {} and {}",
            path.display(),
            report::chart_path(path).display()
        );
    }
    Ok(())
}

fn matrix(args: &Args) -> Result<bool, String> {
    let p = plan(args)?;
    let started = Instant::now();
    let mut meta = Meta::collect();
    report::install_ctrl_c();
    let (cells, interrupted) = run(args, &p)?;
    meta.finish(started);
    let report = Report {
        tool: "bounce-experiment",
        meta,
        config: serde_json::json!({
            "alloc": p.kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
            "timing": p.timing,
            "dynamic": p.dynamic,
            "threads": p.threads, "sizes": p.sizes, "copy": p.copies, "mode": p.mode,
            "slots": args.slots, "areas": args.areas, "depth": args.depth,
            "seconds": args.seconds, "rounds": args.rounds, "baseline": p.baseline.name(),
            "split": p.split,
        }),
        interrupted,
        rows: Cells { cells },
    };
    emit(args, &report)?;
    Ok(!interrupted)
}

fn main() -> ExitCode {
    let cli: Cli = match bouncevm_common::cli::parse_args("bounce-experiment", " (see --help)") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let r = match &cli.cmd {
        Some(Cmd::MapBenchmark(a)) => map_bench::main(a),
        None => matrix(&cli.matrix),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bounce-experiment: interrupted; the results above are partial");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("bounce-experiment: {e}");
            ExitCode::FAILURE
        }
    }
}
