//! `bounce-replay --advise` as a user runs it: the table's sections on a committed trace, the
//! JSON form, the chart, several traces through one pool, a dynamic-pool (`/2`) trace alone and
//! with a static one, and every kind of bad input — a truncated, malformed or unknown-format
//! trace (a malformed pool event too), an unmap of a map never made, a pool the
//! kernel would not make or could not allocate — refused with one line that names the line or
//! the value, a non-zero exit and nothing on stdout (never a partial table). A trace that ends
//! with mappings live is replayed and the table says so.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const REPLAY: &str = env!("CARGO_BIN_EXE_bounce-replay");

fn traces() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces")
}

fn sample() -> String {
    traces()
        .join("rig1-fio-1024slots-1area.jsonl.gz")
        .display()
        .to_string()
}

fn run(args: &[&str]) -> Output {
    support::run(REPLAY, args)
}

fn ok(args: &[&str]) -> String {
    support::ok(REPLAY, args)
}

/// A file of this test's own in the temporary directory.
fn temp(name: &str, bytes: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("bounce-replay-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).expect("write test file");
    p
}

/// Runs `--advise` on `path` (plus `extra`) and returns its one-line error: the exit status is
/// 2, stdout is empty and stderr is one line.
fn refused(path: &Path, extra: &[&str]) -> String {
    let p = path.display().to_string();
    let mut args = vec![p.as_str(), "--advise"];
    args.extend_from_slice(extra);
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        out.stdout.is_empty(),
        "{args:?} printed a table: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(err.starts_with("bounce-replay: "), "{err}");
    err
}

/// A trace of `ls` is refused with a line that says `says`.
fn refused_with(name: &str, ls: &[String], says: &str) {
    let t = temp(name, &lines(ls));
    let err = refused(&t, &[]);
    let _ = std::fs::remove_file(&t);
    assert!(err.contains(says), "{name}: {err}");
}

const HEADER: &str =
    r#"{"op":"header","format":"swiotlb-kernel-trace/1","nslabs":256,"nareas":1,"cpus":1}"#;

fn map(id: u64, size: u64) -> String {
    format!(
        r#"{{"op":"map","id":{id},"orig":{},"size":{size},"dir":1}}"#,
        0x10_0000 + id * 0x4_0000
    )
}

fn unmap(id: u64) -> String {
    format!(r#"{{"op":"unmap","id":{id}}}"#)
}

/// `out` holds every one of `wants`.
fn has_all(out: &str, wants: &[&str]) {
    for want in wants {
        assert!(out.contains(want), "{want:?} missing:\n{out}");
    }
}

/// The cells of the first line of `text` that starts with `label` (a table row).
fn row_cells<'a>(text: &'a str, label: &str) -> Vec<&'a str> {
    let row = text
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no row {label:?}:\n{text}"));
    row.split('|').map(str::trim).collect()
}

fn lines(ls: &[String]) -> Vec<u8> {
    let mut s = ls.join("\n");
    s.push('\n');
    s.into_bytes()
}

#[test]
fn the_table_has_every_section_and_the_recommendation() {
    let out = ok(&[&sample(), "--advise", "--guest-mem", "2G"]);
    has_all(
        &out,
        &[
            "### Static pools",
            "| the trace's pool ",
            "| smallest without failure ",
            "| one segment per area less ",
            "| what the kernel makes of it ",
            "| default (64 MiB) ",
            "| default, confidential guest (6 %) ",
            "### Areas",
            "### Segment size",
            "| slots per segment ",
            "### Dynamic pools (`CONFIG_SWIOTLB_DYNAMIC`)",
            "| smallest the kernel makes ",
            "### Recommendation",
            "`swiotlb=2048,1,force`: ",
            "2430 maps (8 failed in the capturing kernel)",
        ],
    );
    // The trace's own pool, as the kernel had it: 8 failures, all fragmentation.
    let cells = row_cells(&out, "| the trace's pool ");
    assert_eq!(
        &cells[2..9],
        ["1024,1", "1024", "1", "2 MiB", "8", "0", "8"],
        "{cells:?}"
    );
    // A confidential guest needs no force.
    let conf = ok(&[&sample(), "--advise", "--guest-mem", "2G", "--confidential"]);
    assert!(conf.contains("`swiotlb=2048,1`: "), "{conf}");
}

#[test]
fn json_and_chart_hold_the_same_report() {
    let svg = std::env::temp_dir().join(format!("bounce-replay-{}-chart.svg", std::process::id()));
    let s = svg.display().to_string();
    let out = ok(&[&sample(), "--advise", "--json", "--chart", &s]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    let r = &v["reports"][0];
    assert_eq!(r["alloc"], "areas");
    assert_eq!(r["recommendation"]["cmdline"], "swiotlb=2048,1,force");
    assert_eq!(r["static_pools"][0]["replay"]["pool_full"], 8);
    let dynamic = r["dynamic"]["rows"].as_array().expect("dynamic rows");
    assert_eq!(dynamic[0]["kind"], "trace");
    assert_eq!(dynamic[0]["replay"]["pool_full"], 0, "{r}");
    let chart = std::fs::read_to_string(&svg).expect("chart written");
    let _ = std::fs::remove_file(&svg);
    assert!(
        chart.starts_with("<svg"),
        "{}",
        &chart[..100.min(chart.len())]
    );
    assert!(
        chart.contains("trace 1024,1: 8 failed"),
        "the failures are in the legend"
    );
}

#[test]
fn several_traces_share_one_pool() {
    let a = temp(
        "share-a.jsonl",
        &lines(&[HEADER.into(), map(1, 128 * 2048), unmap(1)]),
    );
    let b = temp(
        "share-b.jsonl",
        &lines(&[HEADER.into(), map(1, 128 * 2048), unmap(1)]),
    );
    let (pa, pb) = (a.display().to_string(), b.display().to_string());
    let out = ok(&[&pa, &pb, "--advise", "--json"]);
    let _ = (std::fs::remove_file(&a), std::fs::remove_file(&b));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let r = &v["reports"][0];
    assert_eq!(r["traces"].as_array().unwrap().len(), 2);
    // Both maps are live at once in the merged stream: two whole segments.
    let min = r["static_pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["kind"] == "minimum")
        .unwrap();
    assert_eq!(min["replay"]["slots"], 256, "{r}");
    assert_eq!(
        r["static_pools"][0]["replay"]["slots"], 512,
        "the traces' pools added up"
    );
    // Without --advise, one trace only.
    let out = run(&[&sample(), &sample()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("only with --advise"));
}

#[test]
fn a_dynamic_pool_trace_is_advised_alone_and_with_a_static_one() {
    let dynamic = traces()
        .join("rig1-fio-dynamic-512slots-4areas-2cpus.jsonl.gz")
        .display()
        .to_string();
    let out = ok(&[&dynamic, "--advise", "--guest-mem", "1G"]);
    has_all(
        &out,
        &[
            "was captured with dynamic pools: its kernel added 3 pools and made 15 transient pools",
            "### Dynamic pools (`CONFIG_SWIOTLB_DYNAMIC`)",
            "### Recommendation",
        ],
    );
    // The dynamic row of the trace's own pool: 512 slots in 4 areas, grown, no failure.
    let section = out.split("### Dynamic pools").nth(1).unwrap();
    let cells = row_cells(section, "| the trace's pool ");
    assert_eq!(
        (cells[2], cells[3], cells[9]),
        ("512,4", "1 MiB", "0"),
        "{cells:?}"
    );
    // With a static trace, through one pool, as JSON.
    let out = ok(&[
        &dynamic,
        &sample(),
        "--advise",
        "--json",
        "--guest-mem",
        "1G",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let r = &v["reports"][0];
    assert_eq!(r["traces"][0]["dynamic"], true);
    assert_eq!(r["traces"][1]["dynamic"], false);
    assert_eq!(r["traces"][0]["kernel_pools_added"], 3);
    let rows = r["dynamic"]["rows"].as_array().unwrap();
    assert!(rows.iter().any(|x| x["kind"] == "smallest"), "{r}");
    assert!(rows
        .iter()
        .all(|x| x["replay"]["peak_bytes"].as_u64() > Some(0)));
}

#[test]
fn malformed_dynamic_pool_lines_are_refused_at_their_line() {
    let header = r#"{"op":"header","format":"swiotlb-kernel-trace/2","nslabs":256,"nareas":1,"cpus":1,"dynamic":{"default_nareas":1,"default_nslabs":256,"can_grow":1,"phys_limit":4294967295}}"#;
    for (name, ls, says) in [
        (
            "pool-add.jsonl",
            vec![
                header.to_string(),
                map(1, 512),
                r#"{"op":"pool_add","start":1048576,"nareas":1}"#.into(),
            ],
            "line 3: pool_add without nslabs",
        ),
        (
            "transient.jsonl",
            vec![
                header.to_string(),
                r#"{"op":"transient_alloc","start":1048576,"nslabs":1,"nareas":1}"#.into(),
                map(1, 512),
            ],
            "line 2: transient_alloc without id",
        ),
        (
            "static-with-pool-add.jsonl",
            vec![
                HEADER.into(),
                map(1, 512),
                r#"{"op":"pool_add","start":1048576,"nslabs":256,"nareas":1}"#.into(),
            ],
            "line 3: pool_add in a trace without a dynamic-pool header",
        ),
        (
            "default-nareas.jsonl",
            vec![
                header.replace(r#""default_nareas":1"#, r#""default_nareas":4"#),
                map(1, 512),
            ],
            "line 1: header: dynamic default_nareas 4 does not give 256 slots in 1 areas",
        ),
        (
            "start.jsonl",
            vec![
                header.replace(r#""cpus":1"#, r#""cpus":1,"start":18446744073709547520"#),
                map(1, 512),
            ],
            "line 1: header: start 0xfffffffffffff000",
        ),
    ] {
        refused_with(name, &ls, says);
    }
}

#[test]
fn a_trace_ending_with_live_mappings_is_replayed_and_says_so() {
    let t = temp(
        "live.jsonl",
        &lines(&[HEADER.into(), map(1, 4096), map(2, 4096), unmap(1)]),
    );
    let out = ok(&[&t.display().to_string(), "--advise"]);
    let _ = std::fs::remove_file(&t);
    assert!(out.contains("1 unmaps, 1 live at the end"), "{out}");
    assert!(out.contains("the trace ends with 1 mappings live"), "{out}");
}

#[test]
fn a_truncated_trace_is_refused_at_its_line() {
    let whole = std::fs::read(sample()).unwrap();
    let t = temp("truncated.jsonl.gz", &whole[..whole.len() / 2]);
    let err = refused(&t, &[]);
    let _ = std::fs::remove_file(&t);
    assert!(
        err.contains(", line ") && err.contains("cannot read it"),
        "{err}"
    );
    // A line cut in the middle is a parse error at that line.
    let t = temp(
        "cut.jsonl",
        format!("{HEADER}\n{}\n{{\"op\":\"map\",\"id\":2,\"or", map(1, 512)).as_bytes(),
    );
    let err = refused(&t, &[]);
    let _ = std::fs::remove_file(&t);
    assert!(err.contains("line 3"), "{err}");
}

#[test]
fn malformed_and_unknown_format_traces_are_refused_at_their_line() {
    for (name, text, says) in [
        (
            "malformed.jsonl",
            format!("{HEADER}\n{}\n{{\"op\":\"map\",\"id\":2}}\n", map(1, 512)),
            "line 3: map without orig",
        ),
        (
            "bad-op.jsonl",
            format!("{HEADER}\n{{\"op\":\"frobnicate\"}}\n"),
            "line 2: unknown op 'frobnicate'",
        ),
        (
            "format9.jsonl",
            r#"{"op":"header","format":"swiotlb-kernel-trace/9","nslabs":256}"#.to_string() + "\n",
            "line 1: trace format 'swiotlb-kernel-trace/9'",
        ),
        (
            "other-format.jsonl",
            r#"{"op":"header","format":"perf-script/1","nslabs":256}"#.to_string() + "\n",
            "'perf-script/1'",
        ),
        (
            "binary.bin",
            "\u{7f}ELF\u{0}\u{1}\u{2}".to_string(),
            "line 1",
        ),
        ("empty.jsonl", format!("{HEADER}\n"), "the trace has no map"),
    ] {
        let t = temp(name, text.as_bytes());
        let err = refused(&t, &[]);
        let _ = std::fs::remove_file(&t);
        assert!(
            err.contains(says) && err.contains(", line "),
            "{name}: {err}"
        );
    }
}

#[test]
fn an_unmap_of_a_map_never_made_is_refused() {
    for (name, ls, says) in [
        (
            "never.jsonl",
            vec![HEADER.into(), map(1, 512), unmap(7)],
            "line 3: unmap of map id 7, which the trace never mapped",
        ),
        (
            "twice.jsonl",
            vec![HEADER.into(), map(1, 512), unmap(1), unmap(1)],
            "line 4: unmap of map id 1",
        ),
        (
            "reused.jsonl",
            vec![HEADER.into(), map(1, 512), map(1, 512)],
            "line 3: map id 1 is already live (mapped at line 2)",
        ),
        (
            "sync.jsonl",
            vec![
                HEADER.into(),
                r#"{"op":"sync_for_cpu","id":3}"#.into(),
                map(1, 512),
            ],
            "line 2: sync of map id 3",
        ),
    ] {
        refused_with(name, &ls, says);
    }
}

#[test]
fn pools_the_kernel_would_not_make_are_refused_with_the_value() {
    let bad_header = r#"{"op":"header","nslabs":1000,"nareas":1,"cpus":1}"#;
    let t = temp(
        "geometry.jsonl",
        &lines(&[bad_header.into(), map(1, 512), unmap(1)]),
    );
    let err = refused(&t, &[]);
    assert!(
        err.contains("line 1: header: 1000 slots in 1 areas is not a pool Linux makes"),
        "{err}"
    );
    let _ = std::fs::remove_file(&t);
    let s = sample();
    for (extra, says) in [
        (
            &["--slots", "262144", "--guest-mem", "256"][..],
            "262144 slots (512 MiB) is larger than the guest's memory (256 MiB)",
        ),
        (
            &["--slots", "4194304"][..],
            "4194304 slots (8192 MiB) is larger than the 4 GiB",
        ),
        (&["--guest-cpus", "0"][..], "--guest-cpus 0"),
    ] {
        let err = refused(Path::new(&s), extra);
        assert!(err.contains(says), "{extra:?}: {err}");
    }
    // A memory size that is not one is a usage error naming it.
    let out = run(&[&s, "--advise", "--guest-mem", "lots"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("'lots' is not a memory size"));
}

#[test]
fn a_closed_stdout_is_an_error_not_a_panic() {
    let mut child = Command::new(REPLAY)
        .args([&sample(), "--advise", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(2), "{err}");
    let _ = std::io::stderr().flush();
}

/// The commands of the study's first sh block, each with its printed table: the page shows
/// exactly what the advisor prints (charts are not redrawn).
#[test]
fn the_study_shows_what_the_advisor_prints() {
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let study = std::fs::read_to_string(top.join("docs/studies/sizing-advisor.md")).unwrap();
    let block = study
        .split("```sh\n")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let mut n = 0;
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let mut argv: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(argv[0], "target/release/bounce-replay", "{line}");
        if let Some(i) = argv.iter().position(|a| *a == "--chart") {
            argv.drain(i..i + 2);
        }
        let out = Command::new(REPLAY)
            .args(&argv[1..])
            .current_dir(&top)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{line}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            study.contains(text.trim_end()),
            "docs/studies/sizing-advisor.md does not show what `{line}` prints now:\n{text}"
        );
        n += 1;
    }
    assert_eq!(n, 5);
}
