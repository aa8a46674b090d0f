//! What every experiment (`bounce-experiment`, `bouncevm-experiment`) prints and writes: machine metadata, sample summaries, a progress bar
//! with ETA on stderr, a Ctrl-C that stops cleanly, SVG line charts and size labels.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;

/// The machine and build a run was measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    /// `git rev-parse HEAD` of the source tree the binary was built from, if it is there.
    pub git_revision: Option<String>,
    /// True when that tree had uncommitted changes.
    pub git_dirty: Option<bool>,
    /// `model name` of /proc/cpuinfo.
    pub cpu_model: Option<String>,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// Kernel release.
    pub kernel: Option<String>,
    /// /proc/loadavg when the run started and when it ended: the machine is shared.
    pub loadavg_start: Option<String>,
    /// See `loadavg_start`.
    pub loadavg_end: Option<String>,
    /// Start, seconds since the epoch (UTC).
    pub started_unix_s: u64,
    /// Wall time of the run.
    pub elapsed_s: f64,
    /// The command line.
    pub argv: Vec<String>,
    /// This binary's version.
    pub version: &'static str,
}

fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(["-C", env!("CARGO_MANIFEST_DIR")])
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl Meta {
    /// Collects everything but the end time; call [`Meta::finish`] at the end.
    pub fn collect() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        Self {
            git_revision: git(&["rev-parse", "HEAD"]),
            git_dirty: git(&["status", "--porcelain", "--untracked-files=no"])
                .map(|s| !s.is_empty()),
            cpu_model,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: read_trim("/proc/sys/kernel/osrelease"),
            loadavg_start: read_trim("/proc/loadavg"),
            loadavg_end: None,
            started_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            elapsed_s: 0.0,
            argv: std::env::args().collect(),
            version: env!("CARGO_PKG_VERSION"),
        }
    }

    /// Records the end of the run.
    pub fn finish(&mut self, started: Instant) {
        self.loadavg_end = read_trim("/proc/loadavg");
        self.elapsed_s = started.elapsed().as_secs_f64();
    }
}

/// Median, minimum and maximum of a set of samples, with the samples.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// The median (the upper one of an even count).
    pub median: f64,
    /// The smallest sample.
    pub min: f64,
    /// The largest sample.
    pub max: f64,
    /// Every sample, in the order measured.
    pub samples: Vec<f64>,
}

impl Summary {
    /// Summarises `samples` (all zero for none).
    pub fn of(samples: &[f64]) -> Self {
        let mut v = samples.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        Self {
            median: v.get(v.len() / 2).copied().unwrap_or(0.0),
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
            samples: samples.to_vec(),
        }
    }
}

/// Set by the first Ctrl-C: loops finish the measurement in progress, keep what was measured
/// and stop. A second Ctrl-C exits at once with status 130.
static STOP: AtomicBool = AtomicBool::new(false);
static PRESSES: AtomicU32 = AtomicU32::new(0);

/// Installs the Ctrl-C handler (once; later calls do nothing).
pub fn install_ctrl_c() {
    let _ = ctrlc::set_handler(|| {
        if PRESSES.fetch_add(1, Ordering::SeqCst) > 0 {
            eprintln!("\ninterrupted again: exiting without results");
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: finishing the current measurement and keeping what was measured (Ctrl-C again to quit now)");
        STOP.store(true, Ordering::SeqCst);
    });
}

/// True once Ctrl-C was pressed.
pub fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Sleeps `dur` unless Ctrl-C comes first; returns false when it did.
pub fn sleep_unless_stopped(dur: Duration) -> bool {
    let end = Instant::now() + dur;
    loop {
        if stopped() {
            return false;
        }
        let now = Instant::now();
        if now >= end {
            return true;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(20)));
    }
}

/// A progress bar on stderr with elapsed time and ETA (hidden when stderr is not a terminal).
pub fn progress(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} ETA {eta} {msg}",
    ) {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_string());
    bar
}

/// A size in bytes as the tables print it: `4k`, `64k`, `1m` for whole KiB/MiB, else bytes
/// (`512`, `1500`).
pub fn size_label(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{}m", bytes >> 20)
    } else if bytes >= 1024 && bytes % 1024 == 0 {
        format!("{}k", bytes >> 10)
    } else {
        bytes.to_string()
    }
}

/// One panel of a chart: lines of (x, y) points.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Panel title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// (name, points) per line.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Draws `panels` side by side (up to two per row) into an SVG file.
///
/// # Errors
/// A message when the file cannot be written or drawing fails.
pub fn write_chart(path: &Path, title: &str, panels: &[Panel]) -> Result<(), String> {
    if panels.is_empty() {
        return Ok(());
    }
    let cols = panels.len().min(2);
    let rows = panels.len().div_ceil(cols);
    let size = (560 * cols as u32, 60 + 420 * rows as u32);
    let root = SVGBackend::new(path, size).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("chart {}: {e}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(|x| e(&x))?;
    let areas = root.split_evenly((rows, cols));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        draw_panel(area, panel).map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    p: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let xs = p.series.iter().flat_map(|(_, v)| v.iter().map(|q| q.0));
    let ys = p.series.iter().flat_map(|(_, v)| v.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let y1 = ys.fold(0.0f64, f64::max);
    let (x0, x1) = if x0 >= x1 {
        (x0 - 1.0, x0 + 1.0)
    } else {
        (x0, x1)
    };
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(x0..x1, 0.0..y1)?;
    chart
        .configure_mesh()
        .x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .draw()?;
    for (i, (name, pts)) in p.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
        chart.draw_series(pts.iter().map(|&q| Circle::new(q, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}

/// Writes `text` to `dir/name`, creating `dir`.
///
/// # Errors
/// A message naming the file.
pub fn write_file(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let p = dir.join(name);
    std::fs::write(&p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))
}
