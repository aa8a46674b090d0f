//! `bouncevm-load`: drive any vhost-user-blk back end at host speed, fio-style.
//!
//! ```text
//! bouncevm-load --socket PATH [--rw randread|randwrite|read|write|randrw] [--bs 4k]
//!               [--iodepth N] [--numjobs N] [--runtime SECS] [--size BYTES] [--verify]
//!               [--rwmixread PCT] [--access-platform] [--json] [--timeout SECS]
//! ```
//!
//! Prints a fio-style summary (IOPS, bandwidth, completion latency mean/p50/p99/p99.9, per
//! job and in total), or with `--json` one JSON object. Any error is one line on stderr and a
//! non-zero exit status; every wait is bounded by `--timeout`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bouncevm_load::session::Wanted;
use bouncevm_load::{format_report, parse_bytes, LoadConfig, Rw};
use clap::Parser;

/// A vhost-user-blk front end that runs fio-like jobs against a back end.
#[derive(Parser, Debug)]
#[command(name = "bouncevm-load", version, about)]
struct Cli {
    /// The back end's vhost-user socket.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Access pattern.
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    /// Block size (bytes; k/m/g suffixes).
    #[arg(long, value_parser = parse_bytes, default_value = "4k")]
    bs: u64,
    /// Requests in flight per job.
    #[arg(long, default_value_t = 1)]
    iodepth: u16,
    /// Jobs: one queue and one thread each.
    #[arg(long, default_value_t = 1)]
    numjobs: u16,
    /// Run for this many seconds (time based); without it each job does one pass of --size.
    #[arg(long, value_name = "SECS")]
    runtime: Option<f64>,
    /// Bytes of the device used, from its start (default: all of it).
    #[arg(long, value_parser = parse_bytes)]
    size: Option<u64>,
    /// Check every byte read back: offset + generation pattern, prefill, final read-back.
    #[arg(long)]
    verify: bool,
    /// Percentage of reads in randrw.
    #[arg(long, value_name = "PCT", default_value_t = 50)]
    rwmixread: u8,
    /// Negotiate VIRTIO_F_ACCESS_PLATFORM (fail if the back end does not offer it).
    #[arg(long)]
    access_platform: bool,
    /// Do not negotiate VIRTIO_RING_F_EVENT_IDX.
    #[arg(long)]
    no_event_idx: bool,
    /// Do not negotiate VIRTIO_RING_F_INDIRECT_DESC (three descriptors per request).
    #[arg(long)]
    no_indirect: bool,
    /// Queue size (default: the smallest power of two holding --iodepth requests).
    #[arg(long, value_name = "N")]
    queue_size: Option<u16>,
    /// Bound, in seconds, of every wait: connecting, each vhost-user reply, each completion.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    timeout: f64,
    /// Seed of random offsets and of the verify pattern.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

fn secs(name: &str, v: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(v).map_err(|_| format!("--{name} {v} is not a number of seconds"))
}

fn config(cli: Cli) -> Result<(LoadConfig, bool), String> {
    if cli.rwmixread != 50 && cli.rw != Rw::RandRw {
        return Err("--rwmixread only applies to --rw randrw".into());
    }
    let bs = u32::try_from(cli.bs).map_err(|_| format!("--bs {} is too large", cli.bs))?;
    let cfg = LoadConfig {
        socket: cli.socket,
        rw: cli.rw,
        bs,
        iodepth: cli.iodepth,
        numjobs: cli.numjobs,
        runtime: cli.runtime.map(|r| secs("runtime", r)).transpose()?,
        size: cli.size,
        verify: cli.verify,
        rwmixread: cli.rwmixread,
        timeout: secs("timeout", cli.timeout)?,
        queue_size: cli.queue_size,
        wanted: Wanted {
            access_platform: cli.access_platform,
            no_event_idx: cli.no_event_idx,
            no_indirect: cli.no_indirect,
            writes: false,
        },
        seed: cli.seed,
    };
    Ok((cfg, cli.json))
}

fn main() -> ExitCode {
    let cli: Cli = match bouncevm_common::cli::parse_args("bouncevm-load", "") {
        Ok(c) => c,
        Err(code) => return code,
    };
    bouncevm_common::init_logging("warn");
    let (cfg, json) = match config(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bouncevm-load: error: {e}");
            return ExitCode::from(2);
        }
    };
    match bouncevm_load::run(&cfg) {
        Ok(report) => {
            let text = if json {
                match serde_json::to_string(&report) {
                    Ok(s) => s + "\n",
                    Err(e) => {
                        eprintln!("bouncevm-load: error: cannot serialize the report: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                format_report(&report)
            };
            // A closed stdout (a pipe to head) is not worth a panic.
            let mut out = std::io::stdout().lock();
            if out
                .write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .is_err()
            {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bouncevm-load: error: {e}");
            ExitCode::FAILURE
        }
    }
}
