//! `bouncevm-experiment`: one preset per seed table of the LKML threads that shaped Linux's
//! swiotlb and IOVA allocators, run through bouncevm's real device paths.
//!
//! A preset ([`preset::plan`]) is a list of [`Cell`]s: one allocator (a bounce setting) at one
//! job or queue count, with the seed's own figure and claimed ratio beside it. The runner
//! measures every cell once per round, rotating the order each round (interleaved rounds: the
//! machine is shared, so only ratios taken in the same run count), and reports the median with
//! [min-max] per metric, the ratio to the cell's baseline, and, where this machine cannot show
//! the seed's shape (fewer CPUs than the seed's threads), the reason instead of a ratio.
//!
//! Drivers, per [`Workload`] and [`Level`]:
//! - [`block`]: `bouncevm-vhost blk` on a tmpfs image, driven in-process by the load generator
//!   ([`bouncevm_load::run`]); host CPU per I/O from `/proc/PID/stat`, pool statistics (lock wait,
//!   map/copy/unmap time) from the backend's statistics socket.
//! - [`net`]: `bouncevm-vhost net` on a tap inside a network namespace created for the sample,
//!   driven by DPDK's `virtio_user` front end (`dpdk-testpmd`, txonly).
//! - [`mapcost`]: the bounce library's own map/unmap cost per frame size.
//! - [`guest`]: fio (block presets) or iperf3 (net presets) in a rig-1 guest (QEMU TCG +
//!   `bouncevm-vhost blk` or `net`) through `tests/e2e/experiment_guest.py`.
//!
//! [`output`] writes the Markdown table, the JSON (machine metadata, every sample, the pool's
//! statistics per sample) and the SVG chart. Progress, Ctrl-C and metadata come from
//! [`bounce_tools::report`], shared with `bounce-experiment`.

#![warn(missing_docs)]

pub mod block;
pub mod guest;
pub mod host;
pub mod mapcost;
pub mod net;
pub mod output;
pub mod preset;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bounce_tools::report::{self, Meta, Summary};
use serde::Serialize;

use bouncevm_load::Rw;

/// Errors of an experiment run. Each is one line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tool, privilege or file the run needs is missing; the message says what to install.
    #[error("{0}")]
    Missing(String),
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Os {
        /// What was done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// The load generator failed.
    #[error("load generator: {0}")]
    Load(#[from] bouncevm_load::Error),
    /// A backend, front end or guest misbehaved or gave no figures.
    #[error("{0}")]
    Run(String),
    /// Writing the outputs failed.
    #[error("{0}")]
    Output(String),
}

/// Result of the experiment runner.
pub type Result<T> = std::result::Result<T, Error>;

/// The seed tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum PresetName {
    /// The 2022 swiotlb series: legacy vs areas vs areas-bitmap (and areas-lifo), 4 KiB
    /// sequential read/write, 1 and 4 jobs, bounce forced.
    #[value(name = "seed-2022-swiotlb")]
    #[serde(rename = "seed-2022-swiotlb")]
    Swiotlb2022,
    /// The 2021 VDUSE IOVA allocator discussion: iova-rcache vs iova-rbtree vs genpool, 4 KiB
    /// randread, iodepth 16, numjobs 1/2/4/8 on a memory-backed disk.
    #[value(name = "seed-2021-vduse")]
    #[serde(rename = "seed-2021-vduse")]
    Vduse2021,
    /// The 2015 IOVA bitmap proposal: iova-bitmap vs iova-rbtree under parallel flows through
    /// the net device.
    #[value(name = "seed-2015-iova")]
    #[serde(rename = "seed-2015-iova")]
    Iova2015,
    /// The 2012 physical-address rework: 64 B frame rate, bounce off vs forced, and the
    /// per-map cost.
    #[value(name = "seed-2012-phys")]
    #[serde(rename = "seed-2012-phys")]
    Phys2012,
}

impl PresetName {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Swiotlb2022 => "seed-2022-swiotlb",
            Self::Vduse2021 => "seed-2021-vduse",
            Self::Iova2015 => "seed-2015-iova",
            Self::Phys2012 => "seed-2012-phys",
        }
    }
}

/// Where the device paths run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Device paths at host speed: the load generator or DPDK drives the backend directly.
    Host,
    /// fio or iperf3 in a rig-1 guest (QEMU TCG) on the backend: end-to-end confirmation,
    /// slower.
    Guest,
}

/// What one cell runs.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Workload {
    /// `bouncevm-vhost blk` with `bounce`, driven fio-style.
    Block {
        /// The backend's `--bounce` options.
        bounce: String,
        /// Access pattern.
        rw: Rw,
        /// Block size.
        bs: u32,
        /// Requests in flight per job.
        iodepth: u16,
        /// Jobs (one queue each).
        numjobs: u16,
        /// Queues the backend serves (the pool has one worker, and one area, per queue).
        queues: u16,
    },
    /// `bouncevm-vhost net` with `bounce`, DPDK txonly frames of `frame` bytes on `queues`
    /// queue pairs.
    Net {
        /// The backend's `--bounce` options.
        bounce: String,
        /// Queue pairs (flows).
        queues: u16,
        /// Frame size in bytes.
        frame: u32,
    },
    /// `bouncevm-vhost net` with `bounce` on `queues` queue pairs, iperf3 with `parallel`
    /// flows from a rig-1 guest to the host (guest level only).
    Iperf3 {
        /// The backend's `--bounce` options.
        bounce: String,
        /// Queue pairs.
        queues: u16,
        /// iperf3 -P.
        parallel: u16,
    },
    /// map + unmap of `size` bytes to the device through a pool of the bounce library.
    MapCost {
        /// Pool semantics ("swiotlb" or "iova").
        mode: bounce::PoolMode,
        /// Allocator.
        alloc: bounce::AllocatorKind,
        /// Bytes per mapping.
        size: usize,
        /// A dynamic pool ([`bounce::dynamic`]) instead of one static pool.
        dynamic: bool,
    },
}

impl Workload {
    /// How many threads would have to run at once to show the seed's contention.
    fn parallelism(&self) -> usize {
        match self {
            Self::Block { numjobs, .. } => usize::from(*numjobs),
            // testpmd busy-polls one core on top of the backend's queue threads.
            Self::Net { queues, .. } => usize::from(*queues) + 1,
            // The backend's queue-pair workers are the pool's concurrent users.
            Self::Iperf3 { queues, .. } => usize::from(*queues),
            Self::MapCost { .. } => 1,
        }
    }
}

// Field list of a table row; alike in shape only to other record structs.
/// One row of a preset's table.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// The chart panel and table group (e.g. "4 KiB sequential read").
    pub panel: String,
    /// The line in the chart: allocator or variant.
    pub series: String,
    /// The x value (jobs, queues, bytes).
    pub x: u32,
    /// What runs.
    pub workload: Workload,
    /// The row the ratio of this (panel, x) is taken against.
    pub baseline: bool,
    /// The metric of this row's ratio and chart, when not the plan's primary one.
    pub primary: Option<Metric>,
    /// The seed's own figure for the primary metric, in the table's unit.
    pub seed: Option<f64>,
    /// The ratio the seed claims for this row against its baseline.
    pub seed_ratio: Option<f64>,
    /// Why this machine cannot show the seed's shape for this row (set by the runner or the
    /// preset); the table then prints the reason instead of a ratio.
    pub shape_note: Option<String>,
    /// A remark printed with the row (the ratio stays).
    pub note: Option<String>,
}

impl Cell {
    /// A row of `series` at `x` in `panel` that runs `workload`, the ratio baseline of its
    /// panel and x when `baseline`: no seed figures, notes or metric of its own (set those
    /// fields on the result).
    pub fn new(
        panel: impl Into<String>,
        series: impl Into<String>,
        x: u32,
        workload: Workload,
        baseline: bool,
    ) -> Self {
        Self {
            panel: panel.into(),
            series: series.into(),
            x,
            workload,
            baseline,
            primary: None,
            seed: None,
            seed_ratio: None,
            shape_note: None,
            note: None,
        }
    }
}

/// A column of the table.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Metric {
    /// Key in [`Sample::metrics`].
    pub key: &'static str,
    /// Column header, with unit.
    pub label: &'static str,
    /// Decimals printed.
    pub decimals: usize,
    /// What the chart's y axis calls it.
    pub quantity: &'static str,
    /// The table's figure times `scale` is in `unit` (MB/s to B/s: 1e6), which the chart
    /// labels with SI prefixes.
    pub scale: f64,
    /// The base unit of the chart's labels (`B/s`, `bit/s`, `s`; empty for counts).
    pub unit: &'static str,
}

/// What a preset runs and how it is printed.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// The preset.
    pub preset: PresetName,
    /// Table title.
    pub title: String,
    /// Where the seed's figures come from and what they measured.
    pub seed_source: String,
    /// The question the run answers.
    pub question: String,
    /// How to read the table on a machine like this one: which comparisons it can make.
    pub reading: String,
    /// X axis label.
    pub x_label: &'static str,
    /// The ratio's and the chart's metric (first column).
    pub primary: Metric,
    /// Further columns.
    pub metrics: Vec<Metric>,
    /// Rows, in table order.
    pub cells: Vec<Cell>,
    /// Notes printed under the table.
    pub notes: Vec<String>,
}

impl Plan {
    /// The metric `cell`'s ratio and chart line use.
    pub fn primary_of(&self, cell: &Cell) -> Metric {
        cell.primary.unwrap_or(self.primary)
    }

    /// Every metric, primary first.
    pub fn columns(&self) -> Vec<Metric> {
        std::iter::once(self.primary)
            .chain(self.metrics.iter().copied())
            .collect()
    }
}

/// One measurement of a cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    /// Round (0-based).
    pub round: usize,
    /// Figures by metric key.
    pub metrics: BTreeMap<String, f64>,
    /// The bounce pool's statistics for this sample alone (fresh backend or pool per sample):
    /// geometry, allocator, counters, lock wait, map/copy/unmap time accounting.
    pub pool: Option<serde_json::Value>,
    /// Driver details (load report, testpmd rate, guest boot time).
    pub detail: Option<serde_json::Value>,
}

impl Sample {
    /// A sample of `metrics` plus the figures every sample takes from the pool's statistics
    /// (`pool`, when the run had a pool) over `ios` I/Os or frames.
    pub fn with_pool(
        mut metrics: BTreeMap<String, f64>,
        pool: Option<serde_json::Value>,
        ios: f64,
        detail: Option<serde_json::Value>,
    ) -> Self {
        if let Some(p) = &pool {
            pool_metrics(p, ios, &mut metrics);
        }
        Self {
            round: 0,
            metrics,
            pool,
            detail,
        }
    }
}

/// The bounce pool's statistics in a backend's stats document (`bounce`; absent or null when
/// the backend has no pool).
pub fn backend_pool(stats: &serde_json::Value) -> Option<serde_json::Value> {
    stats.get("bounce").cloned().filter(|p| !p.is_null())
}

/// A cell with what was measured.
#[derive(Clone, Debug, Serialize)]
pub struct CellResult {
    /// The row.
    #[serde(flatten)]
    pub cell: Cell,
    /// Every sample, in the order measured.
    pub samples: Vec<Sample>,
    /// Median, min, max and samples per metric.
    pub summary: BTreeMap<String, Summary>,
    /// Primary-metric median over the baseline row's median (same panel and x, same rounds).
    pub ratio: Option<f64>,
    /// Errors of samples that failed.
    pub errors: Vec<String>,
}

/// A whole run, as written to results.json.
#[derive(Debug, Serialize)]
pub struct Results {
    /// "bouncevm-experiment".
    pub tool: &'static str,
    /// The preset.
    pub preset: PresetName,
    /// Host or guest.
    pub level: Level,
    /// `--quick`.
    pub quick: bool,
    /// `--dynamic on`: every bouncing row's pool is a dynamic one ([`bounce::dynamic`]).
    pub dynamic: bool,
    /// Machine and build.
    pub meta: Meta,
    /// Rounds asked.
    pub rounds: usize,
    /// Rounds completed by every cell.
    pub rounds_done: usize,
    /// Seconds per sample.
    pub seconds: f64,
    /// True when Ctrl-C stopped the run: the cells hold what was measured until then.
    pub interrupted: bool,
    /// The plan (title, seed source, columns, notes).
    pub plan: Plan,
    /// Every row with its samples.
    pub cells: Vec<CellResult>,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The preset.
    pub preset: PresetName,
    /// Host or guest.
    pub level: Level,
    /// Fewer cells and shorter samples (CI).
    pub quick: bool,
    /// Dynamic pools for every bouncing row (the plan made so by [`preset::dynamic`]).
    pub dynamic: bool,
    /// Interleaved rounds.
    pub rounds: usize,
    /// Seconds per sample.
    pub seconds: f64,
    /// Where `bouncevm-vhost` is (default: next to this binary).
    pub vhost: PathBuf,
    /// The repository (for the guest-level python driver).
    pub repo: PathBuf,
    /// Show a progress bar.
    pub progress: bool,
}

/// Runs `plan` under `settings`: interleaved rounds, rotated order, Ctrl-C keeps what was
/// measured.
///
/// # Errors
/// A missing prerequisite before anything runs ([`Error::Missing`]); a failed sample is
/// recorded in its cell instead, and the run goes on.
pub fn run(settings: &Settings, mut plan: Plan) -> Result<Results> {
    let started = Instant::now();
    let mut meta = Meta::collect();
    let cpus = meta.cpus;
    for c in &mut plan.cells {
        let need = c.workload.parallelism();
        if c.shape_note.is_none() && need > cpus {
            c.shape_note = Some(format!(
                "needs {need} CPUs at once for {need}-way contention; this machine has {cpus} (shared with the load generator): the ratio would show time-slicing, not the seed's contention"
            ));
        }
    }
    let mut drivers = Drivers::new(settings, &plan)?;
    let n = plan.cells.len();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); n];
    let mut errors: Vec<Vec<String>> = vec![Vec::new(); n];
    let bar = if settings.progress {
        report::progress((settings.rounds * n) as u64, plan.preset.name())
    } else {
        indicatif_hidden()
    };
    let mut rounds_done = 0;
    'rounds: for round in 0..settings.rounds {
        for i in 0..n {
            let idx = (i + round) % n;
            if report::stopped() {
                break 'rounds;
            }
            let c = &plan.cells[idx];
            bar.set_message(format!("{} {} x={}", c.panel, c.series, c.x));
            let r = drivers.measure(&c.workload);
            if report::stopped() {
                // The measurement in progress may have been cut short: keep only whole ones.
                break 'rounds;
            }
            match r {
                Ok(mut s) => {
                    s.round = round;
                    samples[idx].push(s);
                }
                Err(e @ Error::Missing(_)) => return Err(e),
                Err(e) => {
                    bar.suspend(|| {
                        eprintln!(
                            "bouncevm-experiment: {} {} x={}: {e}",
                            c.panel, c.series, c.x
                        )
                    });
                    errors[idx].push(e.to_string());
                }
            }
            bar.inc(1);
        }
        rounds_done = round + 1;
    }
    bar.finish_and_clear();
    meta.finish(started);
    let cells = results(&plan, samples, errors);
    Ok(Results {
        tool: "bouncevm-experiment",
        preset: plan.preset,
        level: settings.level,
        quick: settings.quick,
        dynamic: settings.dynamic,
        meta,
        rounds: settings.rounds,
        rounds_done,
        seconds: settings.seconds,
        interrupted: report::stopped(),
        plan,
        cells,
    })
}

fn indicatif_hidden() -> indicatif::ProgressBar {
    indicatif::ProgressBar::hidden()
}

/// Summaries and ratios.
fn results(plan: &Plan, samples: Vec<Vec<Sample>>, errors: Vec<Vec<String>>) -> Vec<CellResult> {
    let columns = plan.columns();
    let mut out: Vec<CellResult> = plan
        .cells
        .iter()
        .zip(samples)
        .zip(errors)
        .map(|((cell, samples), errors)| {
            let summary = columns
                .iter()
                .filter_map(|m| {
                    let v: Vec<f64> = samples
                        .iter()
                        .filter_map(|s| s.metrics.get(m.key).copied())
                        .collect();
                    (!v.is_empty()).then(|| (m.key.to_string(), Summary::of(&v)))
                })
                .collect();
            CellResult {
                cell: cell.clone(),
                samples,
                summary,
                ratio: None,
                errors,
            }
        })
        .collect();
    let medians: Vec<Option<f64>> = out
        .iter()
        .map(|c| {
            c.summary
                .get(plan.primary_of(&c.cell).key)
                .map(|s| s.median)
        })
        .collect();
    for i in 0..out.len() {
        let base = out.iter().enumerate().find(|(_, b)| {
            b.cell.baseline && b.cell.panel == out[i].cell.panel && b.cell.x == out[i].cell.x
        });
        if let (Some((j, _)), Some(v)) = (base, medians[i]) {
            if let Some(b) = medians[j].filter(|b| *b > 0.0) {
                out[i].ratio = Some(v / b);
            }
        }
    }
    out
}

/// The drivers a plan needs, set up once per run.
struct Drivers {
    level: Level,
    seconds: f64,
    block: Option<block::BlockDriver>,
    net: Option<net::NetDriver>,
    guest: Option<guest::GuestDriver>,
}

impl Drivers {
    fn new(settings: &Settings, plan: &Plan) -> Result<Self> {
        let has = |f: fn(&Workload) -> bool| plan.cells.iter().any(|c| f(&c.workload));
        let blk = has(|w| matches!(w, Workload::Block { .. }));
        let net = has(|w| matches!(w, Workload::Net { .. }));
        let iperf3 = has(|w| matches!(w, Workload::Iperf3 { .. }));
        let mut d = Self {
            level: settings.level,
            seconds: settings.seconds,
            block: None,
            net: None,
            guest: None,
        };
        match settings.level {
            Level::Host => {
                if blk {
                    d.block = Some(block::BlockDriver::new(&settings.vhost, settings.quick)?);
                }
                if net {
                    d.net = Some(net::NetDriver::new(&settings.vhost, settings.quick)?);
                }
            }
            Level::Guest => {
                if net {
                    return Err(Error::Run(format!(
                        "{}: the plan has DPDK rows at guest level",
                        plan.preset.name()
                    )));
                }
                if blk || iperf3 {
                    d.guest = Some(guest::GuestDriver::new(
                        &settings.repo,
                        &settings.vhost,
                        settings.quick,
                    )?);
                }
            }
        }
        Ok(d)
    }

    fn measure(&mut self, w: &Workload) -> Result<Sample> {
        let dur = Duration::from_secs_f64(self.seconds);
        match (w, self.level) {
            (
                Workload::MapCost {
                    mode,
                    alloc,
                    size,
                    dynamic,
                },
                _,
            ) => mapcost::measure(*mode, *alloc, *size, *dynamic, dur),
            (Workload::Block { .. }, Level::Host) => self
                .block
                .as_mut()
                .ok_or_else(|| Error::Run("no block driver".into()))?
                .measure(w, dur),
            (Workload::Block { .. }, Level::Guest) | (Workload::Iperf3 { .. }, _) => self
                .guest
                .as_mut()
                .ok_or_else(|| Error::Run("no guest driver".into()))?
                .measure(w, dur),
            (
                Workload::Net {
                    bounce,
                    queues,
                    frame,
                },
                _,
            ) => self
                .net
                .as_mut()
                .ok_or_else(|| Error::Run("no net driver".into()))?
                .measure(bounce, *queues, *frame, dur),
        }
    }
}

/// Pulls the figures every sample reports from the pool's statistics: lock wait per I/O and the
/// p50 of map and unmap calls (ns), whichever direction carried the I/O.
pub fn pool_metrics(pool: &serde_json::Value, ios: f64, m: &mut BTreeMap<String, f64>) {
    let get = |p: &[&str]| {
        p.iter()
            .try_fold(pool, |v, k| v.get(*k))
            .and_then(serde_json::Value::as_f64)
    };
    if let Some(w) = get(&["lock_wait_ns"]) {
        if ios > 0.0 {
            m.insert("lock_wait_ns_per_io".into(), w / ios);
        }
    }
    for op in ["map", "unmap"] {
        let best = ["to_device", "from_device", "bidirectional"]
            .iter()
            .filter_map(|d| {
                let count = get(&["timing", op, d, "count"])?;
                let p50 = get(&["timing", op, d, "p50_ns"])?;
                (count > 0.0).then_some((count, p50))
            })
            .max_by(|a, b| a.0.total_cmp(&b.0));
        if let Some((_, p50)) = best {
            m.insert(format!("{op}_p50_ns"), p50);
        }
    }
}
