//! `bounce-experiment` as a user runs it, at smoke scale: the JSON document, the table and the
//! files of `--out` hold what they promise (every allocator cell a real measurement, the
//! references only with copies, `--split`'s allocator-alone and rest figures and nothing of
//! them without it), `map-benchmark` prints the kernel tool's lines, and bad usage is one line
//! and a non-zero exit. The figures themselves are not checked (benchmarks, not tests).

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_bounce-experiment");
const REPLAY: &str = env!("CARGO_BIN_EXE_bounce-replay");

fn run(args: &[&str]) -> Output {
    support::run(BIN, args)
}

fn ok(args: &[&str]) -> String {
    support::ok(BIN, args)
}

/// The smoke matrix: two allocators, one and two threads, 4 KiB, with and without copies.
const SMOKE: &[&str] = &[
    "--alloc",
    "areas,magazine",
    "--threads",
    "1,2",
    "--size",
    "4k",
    "--copy",
    "copy,nocopy",
    "--rounds",
    "2",
    "--seconds",
    "0.02",
];

fn smoke_json(extra: &[&str]) -> Value {
    let mut args = SMOKE.to_vec();
    args.extend_from_slice(extra);
    args.push("--json");
    serde_json::from_str(&ok(&args)).expect("one JSON document")
}

fn positive(v: &Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

fn is_reference(c: &Value) -> bool {
    c["alloc"]
        .as_str()
        .is_some_and(|a| a.ends_with("(reference)"))
}

#[test]
fn every_cell_of_the_matrix_is_measured_and_split_adds_the_allocator_alone() {
    let doc = smoke_json(&["--split"]);
    assert_eq!(doc["tool"], "bounce-experiment");
    assert_eq!(doc["interrupted"], false);
    assert_eq!(doc["config"]["split"], true);
    let cells = doc["cells"].as_array().expect("cells");
    // Per thread count: with copies the two references and two allocators, without copies the
    // two allocators.
    assert_eq!(cells.len(), 2 * (4 + 2), "{cells:#?}");
    for c in cells {
        let name = c["alloc"].as_str().expect("alloc name");
        let copy = c["copy"].as_bool().expect("copy flag");
        positive(&c["mops"]["median"], &format!("{name} M pairs/s"));
        assert_eq!(c["rounds"], 2, "{name}");
        if is_reference(c) {
            assert!(copy, "{name} in a cell without copies");
            for field in ["alone", "alone_ns_per_pair", "rest_ns_per_pair"] {
                assert!(c.get(field).is_none(), "{name} has {field}");
            }
            continue;
        }
        assert!(["areas", "magazine"].contains(&name), "{name}");
        assert_eq!(c["failures"], 0, "{name}");
        assert_eq!(c["mops"]["samples"].as_array().map(Vec::len), Some(2));
        assert_eq!(c["alone"]["samples"].as_array().map(Vec::len), Some(2));
        positive(&c["alone"]["median"], &format!("{name} alone"));
        let pair = positive(&c["ns_per_pair"], &format!("{name} ns per pair"));
        let alone = positive(&c["alone_ns_per_pair"], &format!("{name} alone ns"));
        let rest = c["rest_ns_per_pair"].as_f64().expect("rest ns");
        assert!(
            (pair - alone - rest).abs() < 1e-6,
            "{name}: {pair} - {alone} != {rest}"
        );
        // The pool saw the maps of the pool rounds only: the allocator-alone rounds bypass it.
        let stats = &c["pool"];
        assert_eq!(stats["allocator"], name);
        positive(&stats["maps"], &format!("{name} maps"));
        assert_eq!(stats["maps"], stats["unmaps"], "{name}: every map unmapped");
        assert_eq!(stats["used"], 0, "{name}: every slot back");
    }
    let baseline: Vec<f64> = cells
        .iter()
        .filter(|c| c["alloc"] == "areas")
        .map(|c| c["ratio"].as_f64().expect("ratio"))
        .collect();
    // The baseline (the first allocator) in every cell: 2 thread counts x 2 copy modes.
    assert_eq!(baseline, [1.0; 4]);
}

#[test]
fn dynamic_both_measures_the_static_and_the_dynamic_pool_side_by_side() {
    let doc: Value = serde_json::from_str(&ok(&[
        "--alloc",
        "areas",
        "--threads",
        "1,2",
        "--size",
        "4k",
        "--copy",
        "nocopy",
        "--rounds",
        "2",
        "--seconds",
        "0.02",
        "--dynamic",
        "both",
        "--json",
    ]))
    .expect("one JSON document");
    assert_eq!(doc["config"]["dynamic"], serde_json::json!([false, true]));
    let cells = doc["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 2 * 2, "{cells:#?}");
    for c in cells {
        let name = c["alloc"].as_str().expect("alloc name");
        positive(&c["mops"]["median"], &format!("{name} M pairs/s"));
        let stats = &c["pool"];
        assert_eq!(stats["maps"], stats["unmaps"], "{name}: every map unmapped");
        match name {
            "areas" => assert!(stats.get("dynamic").is_none(), "{name}"),
            "areas (dynamic)" => {
                // Every map fitted the default pool: the dynamic fast path, no growth.
                let d = &stats["dynamic"];
                assert_eq!(d["grow_requests"], 0, "{name}");
                assert_eq!(d["io_tlb_nslabs"], stats["nslabs"], "{name}");
            }
            other => panic!("unexpected cell {other}"),
        }
    }
}

#[test]
fn without_split_there_are_no_allocator_alone_figures() {
    let doc = smoke_json(&[]);
    assert_eq!(doc["config"]["split"], false);
    for c in doc["cells"].as_array().expect("cells") {
        for field in ["alone", "alone_ns_per_pair", "rest_ns_per_pair"] {
            assert!(c.get(field).is_none(), "{} has {field}", c["alloc"]);
        }
    }
}

/// The table's rows, split into cells (header first, the separator dropped).
fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

#[test]
fn the_table_has_a_row_per_cell_and_split_columns_only_with_split() {
    let plain = rows(&ok(SMOKE));
    assert_eq!(plain[0].len(), 10, "{:?}", plain[0]);
    assert_eq!(plain.len(), 1 + 12);
    let mut args = SMOKE.to_vec();
    args.push("--split");
    let split = rows(&ok(&args));
    assert_eq!(
        split[0][10..],
        ["allocator alone ns".to_string(), "rest ns".to_string()]
    );
    assert_eq!(split.len(), 1 + 12);
    for row in &split[1..] {
        assert_eq!(row.len(), 12, "{row:?}");
        let (alone, rest) = (&row[10], &row[11]);
        if row[0].ends_with("(reference)") {
            assert_eq!((alone.as_str(), rest.as_str()), ("-", "-"), "{row:?}");
        } else {
            let alone: f64 = alone.parse().expect("allocator alone ns");
            assert!(alone > 0.0, "{row:?}");
            rest.parse::<f64>().expect("rest ns");
        }
    }
}

#[test]
fn out_writes_the_table_the_json_and_a_chart() {
    let dir: PathBuf = std::env::temp_dir().join(format!("bounce-exp-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut args = SMOKE.to_vec();
    let report = dir.join("allocators.md");
    args.extend_from_slice(&[
        "--split",
        "--out",
        dir.to_str().expect("utf-8 path"),
        "--report",
        report.to_str().expect("utf-8 path"),
    ]);
    let printed = ok(&args);
    let table = std::fs::read_to_string(dir.join("table.md")).expect("table.md");
    assert_eq!(table, printed);
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).expect("json"))
            .expect("results.json parses");
    assert_eq!(doc["cells"].as_array().map(Vec::len), Some(12));
    let svg = std::fs::read_to_string(dir.join("chart.svg")).expect("chart.svg");
    assert!(svg.contains("<svg") && svg.contains("</svg>"), "not an SVG");
    // The report: the command that regenerates it, the conditions, the table, its chart.
    let md = std::fs::read_to_string(&report).expect("allocators.md");
    assert!(
        md.lines().nth(2).is_some_and(
            |l| l.starts_with("Generated by `target/release/bounce-experiment --alloc")
        ),
        "{md}"
    );
    assert!(md.contains("**Conditions.** A swiotlb pool of"), "{md}");
    assert!(md.contains(&table), "the report holds the table: {md}");
    assert!(md.trim_end().ends_with("(allocators.svg)"), "{md}");
    assert_eq!(
        std::fs::read_to_string(dir.join("allocators.svg")).expect("allocators.svg"),
        svg
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn map_benchmark_prints_the_kernel_tools_lines_per_allocator() {
    let out = ok(&[
        "map-benchmark",
        "-t",
        "1",
        "-s",
        "0.05",
        "-g",
        "1",
        "--alloc",
        "areas,magazine",
    ]);
    for alloc in ["areas", "magazine"] {
        assert!(out.contains(&format!("=== {alloc} (")), "{out}");
    }
    for line in [
        "dma mapping benchmark: threads:1 seconds:0.05",
        "average map latency(us):",
        "average unmap latency(us):",
        "map latency(ns): mean:",
        "unmap latency(ns): mean:",
    ] {
        let n = out.lines().filter(|l| l.starts_with(line)).count();
        assert_eq!(n, 2, "{line}\n{out}");
    }
}

#[test]
fn bad_usage_is_one_line_and_a_failure() {
    let quick = ["--rounds", "1", "--seconds", "0.02"];
    let cases: &[(&[&str], &str)] = &[
        (&["--alloc", "nosuch"], "bad allocator 'nosuch'"),
        (&["--threads", "0"], "bad thread count '0'"),
        (&["--size", "0k"], "bad size '0k'"),
        (&["--copy", "maybe"], "bad copy mode 'maybe'"),
        (&["--seconds", "0"], "--seconds must be in (0, 60)"),
        (&["--timing", "sometimes"], "--timing: unknown 'sometimes'"),
        (&["--dynamic", "maybe"], "--dynamic: unknown 'maybe'"),
        (
            &["--alloc", "areas,magazine", "--dynamic", "on"],
            "--dynamic: dynamic pools search areas",
        ),
        (
            &["--alloc", "areas", "--baseline", "legacy"],
            "baseline legacy is not among --alloc",
        ),
        (
            &[
                "--alloc", "areas", "--size", "1m", "--copy", "nocopy", "--split",
            ],
            "--split: 1m: mapping of 1048576 bytes exceeds the maximum mapping size",
        ),
        (&["map-benchmark", "-t", "0"], "threads"),
        // clap's own errors, one line too.
        (&["--nosuch"], "error: unexpected argument '--nosuch' found"),
        (
            &["--rounds", "2", "--rounds", "1"],
            "error: the argument '--rounds <ROUNDS>' cannot be used",
        ),
        (
            &["map-benchmark", "-t", "x"],
            "error: invalid value 'x' for '-t <THREADS>'",
        ),
    ];
    for (args, says) in cases {
        // Quick rounds for a case that would get as far as measuring, unless it sets them.
        let mut all = args.to_vec();
        if args[0] != "map-benchmark" {
            for pair in quick.chunks(2) {
                if !args.contains(&pair[0]) {
                    all.extend_from_slice(pair);
                }
            }
        }
        let out = run(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("bounce-experiment: ") && err.contains(says),
            "{args:?}: {err}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed a table");
    }
}

#[test]
fn bounce_replay_usage_errors_are_one_line_too() {
    for (args, says) in [
        (
            &["--nosuch", "t"][..],
            "unexpected argument '--nosuch' found",
        ),
        (
            &[][..],
            "the following required arguments were not provided: <TRACES>",
        ),
    ] {
        let out = Command::new(REPLAY)
            .args(args)
            .output()
            .expect("bounce-replay runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("bounce-replay: error: ") && err.contains(says),
            "{args:?}: {err}"
        );
    }
}
