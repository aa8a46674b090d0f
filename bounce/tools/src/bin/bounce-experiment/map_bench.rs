//! `bounce-experiment map-benchmark`: Linux's `dma_map_benchmark` (kernel/dma/map_benchmark.c
//! and tools/testing/selftests/dma/dma_map_benchmark.c) on the host, against bounce pools.
//!
//! As in the kernel module, each thread owns a buffer of `granule` pages and loops: fill it with
//! 0x66 unless the direction is from-device (so the copy in is of real data), time one map, wait
//! `-x` ns ("pretend DMA is transmitting", a busy wait as `ndelay`), time one unmap. The kernel's
//! two result lines are computed the kernel's way -- each latency truncated to 100 ns units, the
//! average and the standard deviation (`sqrt(E[x^2] - E[x]^2)`) in integer 100 ns units, printed
//! divided by 10 as microseconds -- so they can be put next to the tool's output from a guest.
//! Host maps take tens of nanoseconds, which those units round to 0.0, so the same samples are
//! also given at nanosecond resolution (mean, p50, p99 from a log-linear histogram).
//!
//! Differences from the kernel tool, by design: no `-n` (NUMA node; the host threads are not
//! placed), `--alloc` picks the allocators (each runs in its own pool, interleaved over
//! `--rounds`), and `-b` is the device's DMA mask: the pool must lie below it, and with
//! `--policy mask` only buffers above it bounce (the buffers sit at 4 GiB and up), as with
//! dma-direct; with the default `--policy force` every map bounces, as in a guest booted with
//! `swiotlb=force`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bounce::stats::{Histogram, LatencySummary};
use bounce::{
    AllocatorKind, BouncePool, Direction, HostMemory, MapRequest, Policy, PoolConfig, PoolMode,
};
use serde::Serialize;

use bounce_tools::report::{self, Meta};

/// The kernel's limits (include/linux/map_benchmark.h).
const MAX_THREADS: u32 = 1024;
const MAX_SECONDS: f64 = 300.0;
const MAX_TRANS_DELAY_NS: u64 = 10_000_000;
const PAGE: usize = 4096;

/// Flags of dma_map_benchmark, plus the allocator choice.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Threads, each with its own buffer and worker id (kernel -t).
    #[arg(short = 't', default_value_t = 1)]
    threads: u32,
    /// Seconds per allocator and round (kernel -s; fractions allowed here).
    #[arg(short = 's', default_value_t = 20.0)]
    seconds: f64,
    /// Direction: 0 bidirectional, 1 to device, 2 from device (kernel -d).
    #[arg(short = 'd', default_value_t = 0)]
    dir: u32,
    /// Buffer size in 4 KiB pages (kernel -g).
    #[arg(short = 'g', default_value_t = 1)]
    granule: u32,
    /// Delay between map and unmap, ns: the DMA "transfer" (kernel -x).
    #[arg(short = 'x', default_value_t = 0)]
    delay_ns: u64,
    /// Device DMA mask bits (kernel -b).
    #[arg(short = 'b', default_value_t = 32)]
    bits: u32,
    /// Allocators, comma separated, or "all".
    #[arg(long, default_value = "all")]
    alloc: String,
    /// Pool semantics.
    #[arg(long, default_value = "swiotlb")]
    mode: PoolMode,
    /// Pool slots (granules in iova mode).
    #[arg(long, default_value_t = PoolConfig::DEFAULT_SLOTS)]
    slots: usize,
    /// Areas; default one per thread, as Linux uses one per CPU.
    #[arg(long)]
    areas: Option<usize>,
    /// "force": every map bounces (swiotlb=force); "mask": only buffers above the -b mask.
    #[arg(long, default_value = "force")]
    policy: String,
    /// Interleaved rounds (allocator after allocator, then again).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Print one JSON document instead of the text.
    #[arg(long)]
    json: bool,
    /// Write map-benchmark.txt and results.json into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
}

const DIRECTIONS: [&str; 3] = ["BIDIRECTIONAL", "TO_DEVICE", "FROM_DEVICE"];

/// Sums as the kernel keeps them: 100 ns units, and their squares.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct KernelSums {
    loops: u64,
    sum_map_100ns: u64,
    sum_unmap_100ns: u64,
    sum_sq_map: u64,
    sum_sq_unmap: u64,
}

impl KernelSums {
    fn add(&mut self, o: &KernelSums) {
        self.loops += o.loops;
        self.sum_map_100ns += o.sum_map_100ns;
        self.sum_unmap_100ns += o.sum_unmap_100ns;
        self.sum_sq_map += o.sum_sq_map;
        self.sum_sq_unmap += o.sum_sq_unmap;
    }

    /// (average, standard deviation) in 100 ns units, with the kernel's integer arithmetic.
    fn avg_stddev(&self, sum: u64, sum_sq: u64) -> (u64, u64) {
        if self.loops == 0 {
            return (0, 0);
        }
        let avg = sum / self.loops;
        let var = (sum_sq / self.loops).saturating_sub(avg * avg);
        (avg, var.isqrt())
    }
}

/// One allocator's result.
#[derive(Debug, Serialize)]
struct AllocResult {
    alloc: String,
    geometry: bounce::Geometry,
    bounced: bool,
    rounds: usize,
    kernel: KernelSums,
    avg_map_us: f64,
    map_stddev_us: f64,
    avg_unmap_us: f64,
    unmap_stddev_us: f64,
    map_ns: LatencySummary,
    unmap_ns: LatencySummary,
    /// Map+unmap loops per second, per round (all threads).
    loops_per_s: report::Summary,
    failures: u64,
    pool: bounce::PoolStats,
}

/// The rows of a map-benchmark run.
#[derive(Debug, Serialize)]
struct Results {
    results: Vec<AllocResult>,
}

struct ThreadOut {
    sums: KernelSums,
    map: Histogram,
    unmap: Histogram,
    failures: u64,
    error: Option<String>,
}

/// Busy-waits `ns` nanoseconds (Linux `ndelay`).
fn ndelay(ns: u64) {
    if ns == 0 {
        return;
    }
    let end = Instant::now() + Duration::from_nanos(ns);
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

fn check(a: &Args) -> Result<(Vec<AllocatorKind>, Direction, Policy), String> {
    if a.threads == 0 || a.threads > MAX_THREADS {
        return Err(format!(
            "invalid number of threads, must be in 1-{MAX_THREADS}"
        ));
    }
    if !(a.seconds > 0.0 && a.seconds <= MAX_SECONDS) {
        return Err(format!(
            "invalid number of seconds, must be in (0, {MAX_SECONDS}]"
        ));
    }
    if a.delay_ns > MAX_TRANS_DELAY_NS {
        return Err(format!(
            "invalid transmit delay, must be in 0-{MAX_TRANS_DELAY_NS}"
        ));
    }
    if !(20..=64).contains(&a.bits) {
        return Err("invalid dma mask bit, must be in 20-64".into());
    }
    if !(1..=1024).contains(&a.granule) {
        return Err("invalid granule size, must be in 1-1024".into());
    }
    if a.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let dir = Direction::from_linux(u64::from(a.dir)).ok_or("invalid dma direction")?;
    let policy = match a.policy.as_str() {
        "force" => Policy::Force,
        "mask" => Policy::Mask(a.bits as u8),
        other => return Err(format!("--policy: unknown '{other}' (force or mask)")),
    };
    let kinds = if a.alloc == "all" {
        AllocatorKind::ALL.to_vec()
    } else {
        a.alloc
            .split(',')
            .map(|s| s.trim().parse().map_err(|e| format!("{e}")))
            .collect::<Result<_, _>>()?
    };
    Ok((kinds, dir, policy))
}

fn build_pool(a: &Args, kind: AllocatorKind) -> Result<BouncePool, String> {
    let mut cfg = match a.mode {
        PoolMode::Swiotlb => PoolConfig::swiotlb(a.slots),
        PoolMode::Iova => PoolConfig::iova(a.slots),
    };
    cfg.allocator = kind;
    cfg.workers = a.threads as usize;
    cfg.areas = a.areas.or(match a.mode {
        PoolMode::Swiotlb => Some(a.threads as usize),
        PoolMode::Iova => Some(1),
    });
    let pool = BouncePool::new(&cfg).map_err(|e| format!("{kind}: {e}"))?;
    // The benchmark times each call itself; the pool's own accounting would add to it.
    pool.set_timing(false);
    let g = pool.geometry();
    let last = g.base + g.bytes() as u64 - 1;
    if a.bits < 64 && last >> a.bits != 0 {
        return Err(format!(
            "the pool ends at {last:#x}, above a {}-bit DMA mask: the device could not reach it",
            a.bits
        ));
    }
    let size = a.granule as usize * PAGE;
    if size > pool.max_mapping_size(0) {
        return Err(format!(
            "a granule of {} pages ({size} bytes) is larger than the largest mapping of this pool \
             ({} bytes): Linux's dma_map_single fails the same way",
            a.granule,
            pool.max_mapping_size(0)
        ));
    }
    Ok(pool)
}

/// One round for one pool: every thread loops map / delay / unmap for `dur`.
fn round(
    a: &Args,
    pool: &BouncePool,
    dir: Direction,
    policy: Policy,
    dur: Duration,
) -> Option<(Vec<ThreadOut>, Duration)> {
    let size = a.granule as usize * PAGE;
    let (outs, elapsed, complete) = crate::timed(a.threads as usize, dur, |t| {
        // Buffers at 4 GiB and up: above a 32-bit mask, as a highmem buffer would be.
        let orig = (1u64 << 32) + (t as u64) * (1 << 30);
        let mut buf = vec![0u8; size];
        let delay = a.delay_ns;
        move |stop: &AtomicBool| {
            let out = ThreadOut {
                sums: KernelSums::default(),
                map: Histogram::default(),
                unmap: Histogram::default(),
                failures: 0,
                error: None,
            };
            thread_loop(pool, &mut buf, orig, dir, policy, delay, t, stop, out)
        }
    });
    complete.then_some((outs, elapsed))
}

#[allow(clippy::too_many_arguments)]
fn thread_loop(
    pool: &BouncePool,
    buf: &mut [u8],
    orig: u64,
    dir: Direction,
    policy: Policy,
    delay: u64,
    t: usize,
    stop: &AtomicBool,
    mut out: ThreadOut,
) -> ThreadOut {
    let req = MapRequest::new(orig, buf.len(), dir).worker(t);
    let bounce = policy.needs_bounce(orig, buf.len());
    while !stop.load(Ordering::Relaxed) {
        if dir != Direction::FromDevice {
            buf.fill(0x66);
        }
        let mem = &HostMemory::new(orig, buf);
        let t0 = Instant::now();
        let mapped = if bounce {
            match pool.map(mem, &req) {
                Ok(m) => Some(m),
                Err(e) => {
                    out.failures += 1;
                    out.error.get_or_insert_with(|| e.to_string());
                    continue;
                }
            }
        } else {
            // dma-direct: the device uses the buffer's own address.
            std::hint::black_box(orig);
            None
        };
        let map_ns = t0.elapsed().as_nanos() as u64;
        ndelay(delay);
        let t1 = Instant::now();
        if let Some(m) = &mapped {
            if let Err(e) = pool.unmap(mem, m, t) {
                out.error.get_or_insert_with(|| e.to_string());
            }
        }
        let unmap_ns = t1.elapsed().as_nanos() as u64;
        let (m100, u100) = (map_ns / 100, unmap_ns / 100);
        let s = &mut out.sums;
        s.loops += 1;
        s.sum_map_100ns += m100;
        s.sum_unmap_100ns += u100;
        s.sum_sq_map += m100 * m100;
        s.sum_sq_unmap += u100 * u100;
        out.map.record(map_ns);
        out.unmap.record(unmap_ns);
    }
    out
}

fn text(a: &Args, r: &AllocResult) -> String {
    let g = &r.geometry;
    format!(
        "=== {} ({:?} pool, {} slots, {} areas, {}) ===\n\
         dma mapping benchmark: threads:{} seconds:{} node:-1 dir:{} granule: {}\n\
         average map latency(us):{:.1} standard deviation:{:.1}\n\
         average unmap latency(us):{:.1} standard deviation:{:.1}\n\
         map latency(ns): mean:{} p50:{} p99:{} max:{} loops:{}\n\
         unmap latency(ns): mean:{} p50:{} p99:{} max:{}\n",
        r.alloc,
        g.mode,
        g.nslabs,
        g.nareas,
        if r.bounced {
            "bounced"
        } else {
            "direct: below the DMA mask"
        },
        a.threads,
        a.seconds,
        DIRECTIONS[a.dir as usize],
        a.granule,
        r.avg_map_us,
        r.map_stddev_us,
        r.avg_unmap_us,
        r.unmap_stddev_us,
        r.map_ns.mean_ns,
        r.map_ns.p50_ns,
        r.map_ns.p99_ns,
        r.map_ns.max_ns,
        r.kernel.loops,
        r.unmap_ns.mean_ns,
        r.unmap_ns.p50_ns,
        r.unmap_ns.p99_ns,
        r.unmap_ns.max_ns,
    )
}

/// Runs the benchmark; Ok(false) when Ctrl-C cut it short.
pub fn main(a: &Args) -> Result<bool, String> {
    let (kinds, dir, policy) = check(a)?;
    let pools: Vec<BouncePool> = kinds
        .iter()
        .map(|&k| build_pool(a, k))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let mut meta = Meta::collect();
    report::install_ctrl_c();
    let dur = Duration::from_secs_f64(a.seconds);
    let bar = report::progress((a.rounds * pools.len()) as u64, "map-benchmark");
    let n = pools.len();
    let mut sums = vec![KernelSums::default(); n];
    let maps: Vec<Histogram> = (0..n).map(|_| Histogram::default()).collect();
    let unmaps: Vec<Histogram> = (0..n).map(|_| Histogram::default()).collect();
    let mut rates = vec![Vec::new(); n];
    let mut failures = vec![0u64; n];
    let mut interrupted = false;
    'rounds: for _ in 0..a.rounds {
        for (i, pool) in pools.iter().enumerate() {
            bar.set_message(kinds[i].name());
            let Some((outs, elapsed)) = round(a, pool, dir, policy, dur) else {
                interrupted = true;
                break 'rounds;
            };
            bar.inc(1);
            let mut loops = 0;
            for o in &outs {
                if let Some(e) = &o.error {
                    return Err(format!("{}: dma_map_single failed: {e}", kinds[i]));
                }
                sums[i].add(&o.sums);
                loops += o.sums.loops;
                maps[i].merge(&o.map);
                unmaps[i].merge(&o.unmap);
                failures[i] += o.failures;
            }
            rates[i].push(loops as f64 / elapsed.as_secs_f64());
        }
    }
    bar.finish_and_clear();
    meta.finish(started);
    let results: Vec<AllocResult> = (0..n)
        .filter(|&i| !rates[i].is_empty())
        .map(|i| {
            let s = sums[i];
            let (am, sm) = s.avg_stddev(s.sum_map_100ns, s.sum_sq_map);
            let (au, su) = s.avg_stddev(s.sum_unmap_100ns, s.sum_sq_unmap);
            AllocResult {
                alloc: kinds[i].name().to_string(),
                geometry: *pools[i].geometry(),
                bounced: policy.needs_bounce(1 << 32, a.granule as usize * PAGE),
                rounds: rates[i].len(),
                kernel: s,
                avg_map_us: am as f64 / 10.0,
                map_stddev_us: sm as f64 / 10.0,
                avg_unmap_us: au as f64 / 10.0,
                unmap_stddev_us: su as f64 / 10.0,
                map_ns: maps[i].summary(),
                unmap_ns: unmaps[i].summary(),
                loops_per_s: report::Summary::of(&rates[i]),
                failures: failures[i],
                pool: pools[i].stats(),
            }
        })
        .collect();
    let body: String = results.iter().map(|r| text(a, r)).collect();
    let rep = crate::Report {
        tool: "bounce-experiment map-benchmark",
        meta,
        config: serde_json::json!({
            "threads": a.threads, "seconds": a.seconds, "dir": a.dir, "granule": a.granule,
            "delay_ns": a.delay_ns, "bits": a.bits, "alloc": a.alloc, "mode": a.mode,
            "slots": a.slots, "areas": a.areas, "policy": a.policy, "rounds": a.rounds,
        }),
        interrupted,
        rows: Results { results },
    };
    report::print_and_save(&rep, &body, a.json, a.out.as_deref(), "map-benchmark.txt")?;
    Ok(!interrupted)
}
