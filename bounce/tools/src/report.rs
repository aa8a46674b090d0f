//! What every experiment (`bounce-experiment`, `bouncevm-experiment`) prints and writes:
//! machine metadata and the conditions line made from it, sample summaries, a progress bar with
//! ETA on stderr, a Ctrl-C that stops cleanly, size labels, and the Markdown report that
//! carries a run's command, conditions, table and chart (charts themselves: [`crate::chart`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

// Field list of the run's conditions; alike in shape only to other record structs.
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

impl Meta {
    /// The command line as run from the repository's top: the binary as
    /// `target/release/NAME`, then every argument as given, quoted where the shell needs it.
    pub fn command(&self) -> String {
        let mut words = self.argv.iter();
        let bin = words.next().map_or_else(String::new, |b| {
            let name = Path::new(b)
                .file_name()
                .map_or_else(|| b.clone(), |n| n.to_string_lossy().into_owned());
            format!("target/release/{name}")
        });
        std::iter::once(bin)
            .chain(words.map(|w| shell_quote(w)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// What a figure of this run depends on, in one line: when (UTC) and for how long, the CPU
    /// and how many this process could use, the kernel, the load average at the start and the
    /// end (the machine may be shared), and the git revision of the build.
    pub fn conditions(&self) -> String {
        let first = |l: &Option<String>| {
            l.as_deref()
                .and_then(|l| l.split(' ').next())
                .unwrap_or("?")
                .to_string()
        };
        format!(
            "{}, {:.0} s; {} ({} CPUs), kernel {}; load average {} -> {}; git {}{}",
            utc(self.started_unix_s),
            self.elapsed_s,
            self.cpu_model.as_deref().unwrap_or("unknown CPU"),
            self.cpus,
            self.kernel.as_deref().unwrap_or("?"),
            first(&self.loadavg_start),
            first(&self.loadavg_end),
            self.git_revision
                .as_deref()
                .map_or("?", |g| &g[..g.len().min(12)]),
            if self.git_dirty == Some(true) {
                " (with local changes)"
            } else {
                ""
            },
        )
    }
}

/// `n` and `noun`, plural unless `n` is 1: `1 round`, `3 rounds`.
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// A Markdown table whose columns are padded to their widest cell, so that it reads as well
/// in a terminal as rendered. Numbers are right-aligned (`---:`) when every cell of the column
/// starts with a digit or is `-`.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let width = |c: usize| {
        rows.iter()
            .filter_map(|r| r.get(c))
            .map(|x| x.chars().count())
            .chain([header[c].chars().count(), 3])
            .max()
            .unwrap_or(3)
    };
    let widths: Vec<usize> = (0..cols).map(width).collect();
    let numeric: Vec<bool> = (0..cols)
        .map(|c| {
            !rows.is_empty()
                && rows.iter().all(|r| {
                    r.get(c)
                        .is_some_and(|x| x == "-" || x.starts_with(|ch: char| ch.is_ascii_digit()))
                })
        })
        .collect();
    let line = |cells: &mut dyn Iterator<Item = (usize, &str)>| {
        let mut s = String::from("|");
        for (c, x) in cells {
            let pad = widths[c] - x.chars().count();
            if numeric[c] {
                s.push_str(&format!(" {}{x} |", " ".repeat(pad)));
            } else {
                s.push_str(&format!(" {x}{} |", " ".repeat(pad)));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&mut header.iter().copied().enumerate());
    out.push('|');
    for (w, num) in widths.iter().zip(&numeric) {
        if *num {
            out.push_str(&format!("{}:|", "-".repeat(w + 1)));
        } else {
            out.push_str(&format!("{}|", "-".repeat(w + 2)));
        }
    }
    out.push('\n');
    for r in rows {
        out.push_str(&line(
            &mut (0..cols).map(|c| (c, r.get(c).map_or("", String::as_str))),
        ));
    }
    out
}

/// `word` as a shell reads it back: unchanged when it holds only safe characters, else in
/// single quotes.
fn shell_quote(word: &str) -> String {
    let safe = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@%".contains(c));
    if safe {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A Unix time as `YYYY-MM-DD HH:MM UTC`.
pub fn utc(unix_s: u64) -> String {
    let days = unix_s / 86_400;
    let secs = unix_s % 86_400;
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm, proleptic Gregorian).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        secs / 3600,
        secs % 3600 / 60
    )
}

/// Where a report's chart goes: `FILE.svg` next to `FILE.md`.
pub fn chart_path(report: &Path) -> PathBuf {
    report.with_extension("svg")
}

/// A report file: the title, the command that wrote it (run it again to regenerate the report
/// and its chart), then `body` (question, conditions, tables, how to read them), then the
/// chart, linked by its file name next to the report.
pub fn report_markdown(title: &str, meta: &Meta, body: &str, report: &Path) -> String {
    let chart = chart_path(report);
    let chart = chart
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    format!(
        "# {title}\n\nGenerated by `{}`; run it again from the repository's top to regenerate this file and its chart.\n\n{}\n\n![{title}]({chart})\n",
        meta.command(),
        body.trim_end(),
    )
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

/// Writes `text` to the file at `path`, creating its directory.
///
/// # Errors
/// A message naming the file.
pub fn write_text(path: &Path, text: &str) -> Result<(), String> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Writes `text` to `dir/name`, creating `dir`.
///
/// # Errors
/// A message naming the file.
pub fn write_file(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    write_text(&dir.join(name), text)
}

/// Prints `report` as JSON (`json`) or `text` to stdout, and under `out` writes `text` as
/// `text_name` and the JSON as `results.json`.
///
/// # Errors
/// A message naming the file that could not be written, or the JSON error.
pub fn print_and_save<T: Serialize>(
    report: &T,
    text: &str,
    json: bool,
    out: Option<&Path>,
    text_name: &str,
) -> Result<(), String> {
    let doc = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    if json {
        println!("{doc}");
    } else {
        print!("{text}");
    }
    if let Some(dir) = out {
        write_file(dir, text_name, text)?;
        write_file(dir, "results.json", &doc)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00 UTC");
        assert_eq!(utc(1_796_536_800 + 3_660), "2026-12-06 07:01 UTC");
    }

    #[test]
    fn command_is_run_from_the_top_and_quoted() {
        let mut m = Meta::collect();
        m.argv = vec![
            "/x/y/target/release/bouncevm-experiment".into(),
            "seed-2021-vduse".into(),
            "--report".into(),
            "docs/experiments/seed-2021-vduse.md".into(),
            "a b".into(),
            "it's".into(),
        ];
        assert_eq!(
            m.command(),
            r"target/release/bouncevm-experiment seed-2021-vduse --report docs/experiments/seed-2021-vduse.md 'a b' 'it'\''s'"
        );
    }

    #[test]
    fn report_links_its_chart() {
        let m = Meta::collect();
        let md = report_markdown("T", &m, "body\n", Path::new("docs/x/seed.md"));
        assert!(
            md.starts_with("# T\n\nGenerated by `target/release/"),
            "{md}"
        );
        assert!(md.ends_with("\n\n![T](seed.svg)\n"), "{md}");
        assert_eq!(
            chart_path(Path::new("docs/x/seed.md")),
            Path::new("docs/x/seed.svg")
        );
    }
}
