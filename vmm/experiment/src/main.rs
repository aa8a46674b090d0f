//! `bouncevm-experiment`: rerun one LKML seed table through bouncevm's real device paths.
//!
//! ```text
//! bouncevm-experiment PRESET [--level host|guest] [--quick] [--rounds N] [--seconds S]
//!                            [--alloc LIST] [--dynamic on|off] [--out DIR] [--report FILE.md]
//!                            [--vhost PATH]
//! PRESET: seed-2022-swiotlb | seed-2021-vduse | seed-2015-iova | seed-2012-phys
//! ```
//!
//! Prints the table (Markdown, the seed's figures and claimed ratios beside ours); `--out DIR`
//! also writes table.md, results.json (machine metadata, every sample, the pool's statistics
//! per sample) and chart.svg; `--report FILE.md` writes the run's report (the command that
//! regenerates it, the question, the conditions, the tables, how to read them) and its chart as
//! FILE.svg. A progress bar with ETA goes to stderr; Ctrl-C stops after the
//! sample in progress and keeps what was measured (a second Ctrl-C quits at once). Any error is
//! one line on stderr and a non-zero exit status: 2 for bad usage, 3 for a missing
//! prerequisite (the message says what to install), 1 when samples failed.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bouncevm_experiment::{self as experiment, output, preset, Error, Level, PresetName, Settings};
use clap::Parser;

/// Rerun an LKML seed experiment on bouncevm's device paths: a table, JSON and a chart.
#[derive(Parser, Debug)]
#[command(name = "bouncevm-experiment", version, about)]
struct Cli {
    /// The seed table to rerun.
    #[arg(value_enum)]
    preset: PresetName,
    /// host: device paths at host speed (load generator, DPDK); guest: fio or iperf3 in a rig-1 guest.
    #[arg(long, value_enum, default_value = "host")]
    level: Level,
    /// Fewer cells and short samples (for CI: checks that everything runs, not the figures).
    #[arg(long)]
    quick: bool,
    /// Interleaved rounds [default: 5 at host level, 3 at guest level, 2 with --quick].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=100))]
    rounds: Option<u16>,
    /// Seconds per sample [default: per preset and level].
    #[arg(long, value_name = "S")]
    seconds: Option<f64>,
    /// Write table.md, results.json and chart.svg into this directory.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Write a Markdown report (the command that regenerates it, the question, the conditions,
    /// the tables, how to read them) to this file, and its chart next to it (FILE.svg).
    #[arg(long, value_name = "FILE.md")]
    report: Option<PathBuf>,
    /// Only these rows: allocators or variants, comma separated, as the table names them
    /// (e.g. iova-rbtree,iova-rcache). Ratios need the first row of each group, the baseline.
    #[arg(long, value_name = "LIST")]
    alloc: Option<String>,
    /// Dynamic pools (Linux CONFIG_SWIOTLB_DYNAMIC, bounce::dynamic): "off" (one static pool
    /// per row) or "on" (every row that bounces gets a dynamic pool and is marked "(dynamic)";
    /// dynamic pools are swiotlb pools searched by areas, so pick such rows with --alloc).
    #[arg(long, value_name = "on|off", default_value = "off", value_parser = ["on", "off"])]
    dynamic: String,
    /// The bouncevm-vhost binary [default: next to this one].
    #[arg(long, value_name = "PATH")]
    vhost: Option<PathBuf>,
}

fn settings(cli: &Cli) -> Result<Settings, String> {
    let seconds = cli
        .seconds
        .unwrap_or_else(|| preset::default_seconds(cli.preset, cli.level, cli.quick));
    if !(seconds > 0.0 && seconds <= 600.0) {
        return Err(format!(
            "--seconds {seconds}: expected a number of seconds in (0, 600]"
        ));
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .unwrap_or_default();
    let vhost = cli
        .vhost
        .clone()
        .unwrap_or_else(|| exe_dir.join("bouncevm-vhost"));
    // The repository, for the guest-level driver: BVM_REPO, else the source tree this binary
    // was built from.
    let repo = std::env::var_os("BVM_REPO").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .nth(2)
                .map(PathBuf::from)
                .unwrap_or_default()
        },
        PathBuf::from,
    );
    Ok(Settings {
        preset: cli.preset,
        level: cli.level,
        quick: cli.quick,
        dynamic: cli.dynamic == "on",
        rounds: cli
            .rounds
            .map_or_else(|| preset::default_rounds(cli.level, cli.quick), usize::from),
        seconds,
        vhost,
        repo,
        progress: std::io::stderr().is_terminal(),
    })
}

fn main() -> ExitCode {
    let cli: Cli = match bouncevm_common::cli::parse_args("bouncevm-experiment", " (see --help)") {
        Ok(c) => c,
        Err(code) => return code,
    };
    bouncevm_common::init_logging("warn");
    let s = match settings(&cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bouncevm-experiment: error: {e}");
            return ExitCode::from(2);
        }
    };
    bounce_tools::report::install_ctrl_c();
    let mut plan = preset::plan(s.preset, s.level, s.quick);
    if let Some(list) = &cli.alloc {
        let want: Vec<&str> = list.split(',').map(str::trim).collect();
        if let Some(bad) = want
            .iter()
            .find(|w| !plan.cells.iter().any(|c| c.series == **w))
        {
            let mut names: Vec<&str> = Vec::new();
            for c in &plan.cells {
                if !names.contains(&c.series.as_str()) {
                    names.push(&c.series);
                }
            }
            eprintln!(
                "bouncevm-experiment: error: --alloc {bad}: {} has no such row (it has: {})",
                s.preset.name(),
                names.join(", ")
            );
            return ExitCode::from(2);
        }
        plan.cells.retain(|c| want.contains(&c.series.as_str()));
    }
    if s.dynamic {
        if let Err(e) = preset::dynamic(&mut plan) {
            eprintln!("bouncevm-experiment: error: {e}");
            return ExitCode::from(2);
        }
    }
    let results = match experiment::run(&s, plan) {
        Ok(r) => r,
        Err(e @ Error::Missing(_)) => {
            eprintln!("bouncevm-experiment: error: {e}");
            return ExitCode::from(3);
        }
        Err(e) => {
            eprintln!("bouncevm-experiment: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let md = output::table(&results);
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(md.as_bytes()).and_then(|()| out.flush());
    if let Some(dir) = &cli.out {
        if let Err(e) = output::write(&results, &md, dir) {
            eprintln!("bouncevm-experiment: error: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!(
            "bouncevm-experiment: wrote {}/table.md, results.json, chart.svg",
            dir.display()
        );
    }
    if let Some(path) = &cli.report {
        if let Err(e) = output::write_report(&results, path) {
            eprintln!("bouncevm-experiment: error: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!(
            "bouncevm-experiment: wrote {} and {}",
            path.display(),
            bounce_tools::report::chart_path(path).display()
        );
    }
    let failed: usize = results
        .cells
        .iter()
        .filter(|c| c.samples.is_empty() && !results.interrupted)
        .count();
    if failed > 0 {
        eprintln!("bouncevm-experiment: error: {failed} row(s) have no sample (see the notes under the table)");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
