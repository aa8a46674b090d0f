//! Converts a JSON-lines swiotlb trace (plain or gzip) into the compact form that
//! `bounce::trace::open`, `bounce-replay` and the replay tests read (`bounce::trace::compact`).
//!
//! ```text
//! cargo run --release -p bounce --example compact-trace -- IN.jsonl.gz OUT.bvmtrace.gz
//! ```
//!
//! The output is written next to OUT and renamed into place once complete; the same input
//! always gives the same bytes. Prints one line: the operations written and the file's size.

use std::path::PathBuf;
use std::process::ExitCode;

use bounce::trace::{self, TraceFile};
use clap::Parser;

/// Convert a JSON-lines swiotlb trace into the compact trace format.
#[derive(Debug, Parser)]
struct Args {
    /// The JSON-lines trace (plain or gzip).
    input: PathBuf,
    /// The compact trace to write (replaced if it exists).
    output: PathBuf,
}

fn run(args: &Args) -> Result<String, String> {
    let json = match trace::open(&args.input).map_err(|e| e.to_string())? {
        TraceFile::Json(r) => r,
        TraceFile::Compact(_) => {
            return Err(format!(
                "{} is already a compact trace",
                args.input.display()
            ))
        }
    };
    let mut tmp = args.output.clone().into_os_string();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp)
        .map_err(|e| format!("cannot create {}: {e}", tmp.display()))
        .and_then(|f| {
            trace::write_compact(json, std::io::BufWriter::new(f), &tmp.display().to_string())
                .map_err(|e| e.to_string())
        })
        .and_then(|summary| {
            std::fs::rename(&tmp, &args.output)
                .map_err(|e| format!("cannot rename {} into place: {e}", tmp.display()))?;
            Ok(summary)
        });
    let summary = written.inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    let bytes = std::fs::metadata(&args.output).map_or(0, |m| m.len());
    Ok(format!(
        "{}: {} operations ({} maps, {} unmaps), {bytes} bytes",
        args.output.display(),
        summary.ops,
        summary.maps,
        summary.unmaps
    ))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("compact-trace: {e}");
            ExitCode::FAILURE
        }
    }
}
