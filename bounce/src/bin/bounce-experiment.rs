//! Reruns the swiotlb/IOVA allocator experiments of the LKML threads on the host, in one
//! command: map+unmap pairs per second for each allocator, thread count, size and copy mode,
//! measured side by side in interleaved rounds (this machine is shared and noisy: ratios taken
//! in the same run are what to compare), printed as a table with the median of the rounds, the
//! ratio to a baseline allocator, the slowest and fastest round, and the time spent waiting for
//! allocator locks. With copies, two references are measured in the same rounds: a plain
//! memcpy of the same bytes (in and back out) on hot buffers, and the same copies streaming
//! through a buffer the size of the pool (a new place each time, as a rolling index hands out
//! slots).
//!
//! ```text
//! bounce-experiment --alloc legacy,areas,areas-bitmap --threads 1,2,4,8 --size 4k,64k
//! bounce-experiment --alloc all --mode iova --json
//! ```

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use bounce::{
    AllocatorKind, BouncePool, Direction, HostMemory, MapRequest, NoCopyMemory, OrigMemory,
    PoolConfig, PoolMode,
};
use clap::Parser;
use serde::Serialize;

/// Allocator experiments: map+unmap throughput per allocator, threads, size.
#[derive(Parser, Debug)]
#[command(name = "bounce-experiment", version)]
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
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Debug, Serialize)]
struct Cell {
    alloc: String,
    threads: usize,
    size: usize,
    copy: bool,
    mops: f64,
    /// Slowest and fastest round.
    min_mops: f64,
    max_mops: f64,
    ns_per_pair: f64,
    lock_wait_pct: f64,
    failures: u64,
    ratio: f64,
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

/// Runs `threads` threads for `dur`: thread `t` first builds its work with `setup(t)` (buffers
/// are allocated outside the measured window), then all start together and run until told to
/// stop. Returns the summed (pairs, failures) and the elapsed time.
fn timed<S, R>(threads: usize, dur: Duration, setup: S) -> (u64, u64, Duration)
where
    S: Fn(usize) -> R + Sync,
    R: FnOnce(&AtomicBool) -> (u64, u64),
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
        std::thread::sleep(dur);
        stop.store(true, Ordering::Relaxed);
        let (mut pairs, mut failures) = (0, 0);
        for h in handles {
            if let Ok((n, f)) = h.join() {
                pairs += n;
                failures += f;
            }
        }
        (pairs, failures, start.elapsed())
    })
}

/// One measurement: `threads` threads map and unmap for `dur`; returns (pairs, elapsed, lock
/// wait ns, failures).
fn measure(
    pool: &BouncePool,
    threads: usize,
    size: usize,
    copy: bool,
    depth: usize,
    dur: Duration,
) -> (u64, Duration, u64, u64) {
    let wait_before = pool.stats().lock_wait_ns;
    let (pairs, failures, elapsed) = timed(threads, dur, |t| {
        let orig = 0x10_0000_0000u64 * (t as u64 + 1);
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
    let wait = pool.stats().lock_wait_ns - wait_before;
    (pairs, elapsed, wait, failures)
}

fn worker<M: OrigMemory>(
    pool: &BouncePool,
    mem: &M,
    orig: u64,
    size: usize,
    depth: usize,
    t: usize,
    stop: &AtomicBool,
) -> (u64, u64) {
    let mut live = std::collections::VecDeque::with_capacity(depth + 1);
    let (mut n, mut failed) = (0u64, 0u64);
    let mut slot = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let req =
            MapRequest::new(orig + (slot * size) as u64, size, Direction::Bidirectional).worker(t);
        slot = (slot + 1) % depth.max(1);
        match pool.map(mem, &req) {
            Ok(m) => live.push_back(m),
            Err(_) => failed += 1,
        }
        if live.len() >= depth.max(1) || (failed > 0 && !live.is_empty()) {
            if let Some(m) = live.pop_front() {
                if pool.unmap(mem, &m, t).is_ok() {
                    n += 1;
                }
            }
        }
    }
    for m in live {
        let _ = pool.unmap(mem, &m, t);
    }
    (n, failed)
}

/// The physical reference: `threads` threads each copying `size` bytes in and back out (what a
/// bidirectional map+unmap pair copies) for `dur`; returns pairs per second in millions.
fn memcpy_reference(threads: usize, size: usize, dur: Duration) -> f64 {
    let (pairs, _, elapsed) = timed(threads, dur, |_| {
        let orig = vec![0x5au8; size];
        let mut bounce = vec![0u8; size];
        let mut back = vec![0u8; size];
        move |stop: &AtomicBool| {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                bounce.copy_from_slice(std::hint::black_box(&orig));
                back.copy_from_slice(std::hint::black_box(&bounce));
                std::hint::black_box(&back);
                n += 1;
            }
            (n, 0)
        }
    });
    pairs as f64 / elapsed.as_secs_f64() / 1e6
}

/// The cold reference: as [`memcpy_reference`], but each thread's bounce side walks through
/// its share of `pool_bytes`, `size` bytes further each pair (what a rolling index costs).
fn streaming_reference(threads: usize, size: usize, pool_bytes: usize, dur: Duration) -> f64 {
    let share = (pool_bytes / threads).max(size);
    let (pairs, _, elapsed) = timed(threads, dur, |_| {
        let orig = vec![0x5au8; size];
        let mut pool = vec![0u8; share];
        let mut back = vec![0u8; size];
        move |stop: &AtomicBool| {
            let mut n = 0u64;
            let mut at = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let slot = &mut pool[at..at + size];
                slot.copy_from_slice(std::hint::black_box(&orig));
                back.copy_from_slice(std::hint::black_box(slot));
                std::hint::black_box(&back);
                at = if at + 2 * size > share { 0 } else { at + size };
                n += 1;
            }
            (n, 0)
        }
    });
    pairs as f64 / elapsed.as_secs_f64() / 1e6
}

/// Smallest and largest sample.
fn spread(v: &[f64]) -> (f64, f64) {
    v.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
        (lo.min(x), hi.max(x))
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run(args: &Args) -> Result<Vec<Cell>, String> {
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
    if !(args.seconds > 0.0 && args.seconds < 60.0) || args.rounds == 0 {
        return Err("--seconds must be in (0, 60) and --rounds at least 1".into());
    }
    let dur = Duration::from_secs_f64(args.seconds);
    let mut cells = Vec::new();
    for &t in &threads {
        // One pool per allocator for this thread count, reused across rounds.
        let mut pools = Vec::new();
        for &k in &kinds {
            let mut cfg = match mode {
                PoolMode::Swiotlb => PoolConfig::swiotlb(args.slots),
                PoolMode::Iova => PoolConfig::iova(args.slots),
            };
            cfg.allocator = k;
            cfg.workers = t;
            cfg.areas = args.areas.or(match mode {
                PoolMode::Swiotlb => Some(t),
                PoolMode::Iova => Some(1),
            });
            pools.push((
                k,
                Arc::new(BouncePool::new(&cfg).map_err(|e| format!("{k}: {e}"))?),
            ));
        }
        for &size in &sizes {
            for &copy in &copies {
                let mut samples: Vec<(Vec<f64>, Vec<f64>, u64)> =
                    vec![(Vec::new(), Vec::new(), 0); kinds.len()];
                let mut reference = Vec::new();
                let mut streaming = Vec::new();
                let pool_bytes = pools.first().map_or(size, |(_, p)| p.geometry().bytes());
                for _ in 0..args.rounds {
                    if copy {
                        reference.push(memcpy_reference(t, size, dur));
                        streaming.push(streaming_reference(t, size, pool_bytes, dur));
                    }
                    // Interleave allocators inside each round.
                    for (i, (_, pool)) in pools.iter().enumerate() {
                        let (n, el, wait, f) = measure(pool, t, size, copy, args.depth, dur);
                        let secs = el.as_secs_f64();
                        samples[i].0.push(n as f64 / secs / 1e6);
                        samples[i]
                            .1
                            .push(100.0 * wait as f64 / (secs * 1e9 * t as f64));
                        samples[i].2 += f;
                    }
                }
                let meds: Vec<(f64, f64, u64)> = samples
                    .iter_mut()
                    .map(|(m, w, f)| (median(m), median(w), *f))
                    .collect();
                let base = kinds
                    .iter()
                    .position(|k| *k == baseline)
                    .map_or(1.0, |i| meds[i].0);
                let cell = |alloc: &str, v: &mut Vec<f64>, wait: f64, failures: u64| {
                    let (min_mops, max_mops) = spread(v);
                    let mops = median(v);
                    Cell {
                        alloc: alloc.to_string(),
                        threads: t,
                        size,
                        copy,
                        mops,
                        min_mops,
                        max_mops,
                        ns_per_pair: if mops > 0.0 {
                            1e3 * t as f64 / mops
                        } else {
                            f64::INFINITY
                        },
                        lock_wait_pct: wait,
                        failures,
                        ratio: if base > 0.0 { mops / base } else { 0.0 },
                    }
                };
                if copy {
                    cells.push(cell("memcpy (reference)", &mut reference, 0.0, 0));
                    cells.push(cell("streaming copy (reference)", &mut streaming, 0.0, 0));
                }
                for (i, k) in kinds.iter().enumerate() {
                    let (_, wait, failures) = meds[i];
                    cells.push(cell(k.name(), &mut samples[i].0, wait, failures));
                }
            }
        }
    }
    Ok(cells)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(cells) => {
            if args.json {
                for c in &cells {
                    println!("{}", serde_json::to_string(c).unwrap_or_default());
                }
            } else {
                println!("| allocator | threads | size | copy | M pairs/s | min-max | ns/pair/thread | x baseline | lock wait % | full |");
                println!("|---|---|---|---|---|---|---|---|---|---|");
                for c in &cells {
                    println!(
                        "| {} | {} | {}k | {} | {:.2} | {:.2}-{:.2} | {:.0} | {:.2} | {:.1} | {} |",
                        c.alloc,
                        c.threads,
                        c.size / 1024,
                        if c.copy { "copy" } else { "nocopy" },
                        c.mops,
                        c.min_mops,
                        c.max_mops,
                        c.ns_per_pair,
                        c.ratio,
                        c.lock_wait_pct,
                        c.failures
                    );
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bounce-experiment: {e}");
            ExitCode::FAILURE
        }
    }
}
