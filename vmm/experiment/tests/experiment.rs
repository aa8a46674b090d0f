//! `bouncevm-experiment`: every preset runs with `--quick` at host level and writes what it
//! promises — a table row per cell with the seed's columns, a results.json whose samples are
//! real measurements (finite, > 0) with metadata and per-sample pool statistics, a chart whose
//! x ticks are the measured integers, and a report file (`--report`) that starts with the
//! command that regenerates it and links its chart. The figures themselves are not checked (benchmarks, not tests). Also:
//! bad usage and missing prerequisites are one line and a distinct exit status, and Ctrl-C
//! keeps what was measured.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use bounce::testing::{missing, workspace_bin, Resource};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_bouncevm-experiment");
/// Another package's binary (see `bounce::testing::workspace_bin`).
static VHOST: LazyLock<String> =
    LazyLock::new(|| workspace_bin("bouncevm-vhost").display().to_string());

struct TmpDir(PathBuf);

impl TmpDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("bvm-exp-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Self(p)
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn have(cmd: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(cmd).is_file()))
}

/// Net presets need root, a tun device and dpdk-testpmd; records the skip otherwise.
fn net_prerequisites() -> bool {
    if !is_root() {
        missing(
            Resource::Root,
            "the net presets create a network namespace and a tap",
        );
        return false;
    }
    if !Path::new("/dev/net/tun").exists() {
        missing(Resource::Tun, "/dev/net/tun is missing");
        return false;
    }
    if !have("dpdk-testpmd") {
        missing(
            Resource::Dpdk,
            "dpdk-testpmd is missing (tests/setup.sh installs it)",
        );
        return false;
    }
    true
}

fn run_quick(preset: &str, out: &Path) -> String {
    run_quick_with(preset, &[], out)
}

/// [`run_quick`] with `extra` arguments after `--quick`.
fn run_quick_with(preset: &str, extra: &[&str], out: &Path) -> String {
    let o = Command::new(BIN)
        .args([preset, "--quick"])
        .args(extra)
        .args(["--vhost", VHOST.as_str(), "--out"])
        .arg(out)
        .arg("--report")
        .arg(out.join(format!("{preset}.md")))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{preset}: {:?}\nstdout: {stdout}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// Checks table.md, results.json and chart.svg of a finished run; returns the JSON.
fn check_outputs(preset: &str, out: &Path, stdout: &str) -> Value {
    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert_eq!(table, stdout, "the table printed is the table written");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(r["tool"], "bouncevm-experiment");
    assert_eq!(r["preset"], preset);
    assert_eq!(r["level"], "host");
    assert_eq!(r["interrupted"], false);
    let meta = &r["meta"];
    assert!(meta["cpus"].as_u64().unwrap() >= 1, "{meta}");
    assert!(meta["kernel"].is_string(), "{meta}");
    assert!(meta.get("git_revision").is_some() && meta.get("cpu_model").is_some());
    let rounds = r["rounds"].as_u64().unwrap();
    assert!(rounds >= 2, "interleaved rounds: {rounds}");
    assert_eq!(r["rounds_done"], rounds);
    let primary = r["plan"]["primary"]["key"].as_str().unwrap();
    let cells = r["cells"].as_array().unwrap();
    assert!(!cells.is_empty());
    // Table header carries the seed's columns beside ours.
    assert!(
        table.contains("| seed | seed ratio | our ratio |"),
        "{table}"
    );
    for c in cells {
        let key = c["primary"]["key"].as_str().unwrap_or(primary);
        let samples = c["samples"].as_array().unwrap();
        assert_eq!(samples.len() as u64, rounds, "every round measured {c}");
        let rounds_seen: Vec<u64> = samples
            .iter()
            .map(|s| s["round"].as_u64().unwrap())
            .collect();
        assert_eq!(rounds_seen, (0..rounds).collect::<Vec<_>>());
        for s in samples {
            let v = s["metrics"][key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{key} = {v} in {s}");
            for (k, x) in s["metrics"].as_object().unwrap() {
                let x = x.as_f64().unwrap();
                assert!(x.is_finite() && x >= 0.0, "{k} = {x}");
            }
            let bounced = c["workload"]["bounce"]
                .as_str()
                .is_none_or(|b| !b.contains("policy=off"));
            if bounced {
                let p = &s["pool"];
                assert!(p["nslabs"].as_u64().unwrap() > 0, "pool geometry {s}");
                assert!(p["allocator"].is_string() && p["nareas"].is_u64());
                assert!(p["maps"].as_u64().unwrap() > 0, "the pool was used {p}");
                assert!(p["timing"]["map"].is_object(), "time accounting {p}");
            }
        }
        let sm = &c["summary"][key];
        let (min, med, max) = (
            sm["min"].as_f64().unwrap(),
            sm["median"].as_f64().unwrap(),
            sm["max"].as_f64().unwrap(),
        );
        assert!(min <= med && med <= max, "{sm}");
        // Its row: x and series, with the median printed.
        let x = c["x"].as_u64().unwrap();
        let series = c["series"].as_str().unwrap();
        let row = format!("| {x} | {series} | ");
        assert!(table.contains(&row), "no row {row} in\n{table}");
        if c["baseline"] == true && c["shape_note"].is_null() {
            assert!((c["ratio"].as_f64().unwrap() - 1.0).abs() < 1e-9, "{c}");
        }
        if !c["shape_note"].is_null() {
            let line = table.lines().find(|l| l.starts_with(&row)).unwrap();
            assert!(
                line.contains("n/a ["),
                "the reason replaces the ratio: {line}"
            );
        }
    }
    let svg = std::fs::read_to_string(out.join("chart.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("chart.svg parses");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: String = doc
        .descendants()
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join(" ");
    for c in cells {
        let series = c["series"].as_str().unwrap();
        assert!(texts.contains(series), "legend has {series}");
    }
    // The x ticks are the cells' x values as integers; no figure is printed unprefixed.
    let nodes: Vec<&str> = doc
        .descendants()
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for c in cells {
        let x = c["x"].as_u64().unwrap().to_string();
        assert!(nodes.contains(&x.as_str()), "x tick {x} in {nodes:?}");
    }
    assert!(
        nodes
            .iter()
            .all(|t| !t.ends_with(".0") && !t.contains("0000")),
        "{nodes:?}"
    );
    check_report(preset, out, &svg);
    r
}

/// The report file: the command that regenerates it first, then the question, the conditions,
/// the table, and a link to its chart, which is the run's chart.
fn check_report(preset: &str, out: &Path, svg: &str) {
    let md = std::fs::read_to_string(out.join(format!("{preset}.md"))).unwrap();
    let second = md.lines().nth(2).unwrap_or_default();
    assert!(
        second.starts_with(&format!(
            "Generated by `target/release/bouncevm-experiment {preset} --quick"
        )),
        "{md}"
    );
    for part in [
        "**Question.**",
        "**Conditions.** Measured at host level (--quick)",
        "| seed | seed ratio | our ratio |",
        "**How to read it.**",
    ] {
        assert!(md.contains(part), "{part} missing from\n{md}");
    }
    assert!(md.trim_end().ends_with(&format!("]({preset}.svg)")), "{md}");
    let chart = std::fs::read_to_string(out.join(format!("{preset}.svg"))).unwrap();
    assert_eq!(chart, svg, "the report's chart is the run's chart");
}

#[test]
fn seed_2021_vduse_quick_writes_table_json_and_chart() {
    let d = TmpDir::new("2021");
    let out = run_quick("seed-2021-vduse", &d.0);
    let r = check_outputs("seed-2021-vduse", &d.0, &out);
    // The seed's own IOPS are beside ours.
    assert!(out.contains("145,000") && out.contains("137,000"), "{out}");
    assert!(r["cells"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["workload"]["bounce"]
            .as_str()
            .unwrap()
            .contains("mode=iova")));
}

#[test]
fn seed_2022_swiotlb_quick_writes_table_json_and_chart() {
    let d = TmpDir::new("2022");
    let out = run_quick("seed-2022-swiotlb", &d.0);
    check_outputs("seed-2022-swiotlb", &d.0, &out);
    assert!(out.contains("| 885 |") && out.contains("| 2320 |"), "{out}");
    for a in ["legacy", "areas", "areas-bitmap", "areas-lifo"] {
        assert!(out.contains(&format!("| {a} |")), "{a}");
    }
}

#[test]
fn dynamic_on_runs_the_areas_rows_with_a_dynamic_pool_and_says_so() {
    let d = TmpDir::new("2022-dynamic");
    let out = run_quick_with(
        "seed-2022-swiotlb",
        &["--alloc", "areas", "--dynamic", "on"],
        &d.0,
    );
    let r = check_outputs("seed-2022-swiotlb", &d.0, &out);
    assert_eq!(r["dynamic"], true);
    assert!(out.contains("| areas (dynamic) |"), "{out}");
    assert!(out.contains("with dynamic swiotlb pools"), "{out}");
    let md = std::fs::read_to_string(d.0.join("seed-2022-swiotlb.md")).unwrap();
    assert!(
        md.contains("with dynamic swiotlb pools (--dynamic on"),
        "{md}"
    );
    for c in r["cells"].as_array().unwrap() {
        assert_eq!(c["series"], "areas (dynamic)", "{c}");
        assert!(
            c["workload"]["bounce"]
                .as_str()
                .unwrap()
                .ends_with(",dynamic=on"),
            "{c}"
        );
        for s in c["samples"].as_array().unwrap() {
            let dy = &s["pool"]["dynamic"];
            assert!(dy["io_tlb_nslabs"].as_u64().unwrap() > 0, "{s}");
            assert!(dy["transient_pools"].is_u64() && dy["pools_added"].is_u64());
            assert_eq!(
                dy["pools"].as_array().unwrap()[0]["kind"],
                "default",
                "{dy}"
            );
        }
    }
}

#[test]
fn dynamic_is_on_or_off_and_refused_for_rows_that_cannot_take_it() {
    let o = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--dynamic <on|off>"), "{help}");
    let e = usage_error(&["seed-2022-swiotlb", "--dynamic", "yes"]);
    assert!(e.contains("yes") && e.contains("on, off"), "{e}");
    // IOVA pools and the other swiotlb allocators have no dynamic pool: named, not run.
    for (preset, rows) in [
        ("seed-2015-iova", "iova-rbtree, iova-bitmap"),
        ("seed-2022-swiotlb", "legacy, areas-bitmap, areas-lifo"),
    ] {
        let e = usage_error(&[preset, "--dynamic", "on", "--vhost", "/nonexistent"]);
        assert!(e.contains(rows) && e.contains("--alloc"), "{e}");
    }
}

/// Runs the binary with `args`, checks it exits 2 with one line on stderr; that line.
fn usage_error(args: &[&str]) -> String {
    one_line_error(Command::new(BIN).args(args), 2)
}

/// Runs the binary with `args` and an empty PATH (no tool it needs can be found), checks it
/// exits 3 (missing prerequisite) with one line on stderr; that line.
fn without_path(args: &[&str]) -> String {
    one_line_error(Command::new(BIN).args(args).env("PATH", "/nonexistent"), 3)
}

/// Runs `cmd`, checks it exits with `code` and one line on stderr; that line.
fn one_line_error(cmd: &mut Command, code: i32) -> String {
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(code), "{cmd:?}: {o:?}");
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    e
}

/// Runs a network preset's quick mode (when the machine has what it needs), checks its
/// outputs and that its report says `expect`.
fn net_quick_says(preset: &str, tag: &str, expect: &str) {
    if !net_prerequisites() {
        return;
    }
    let d = TmpDir::new(tag);
    let out = run_quick(preset, &d.0);
    check_outputs(preset, &d.0, &out);
    assert!(out.contains(expect), "{expect:?} is said: {out}");
}

#[test]
fn seed_2012_phys_quick_writes_table_json_and_chart() {
    net_quick_says(
        "seed-2012-phys",
        "2012",
        "map+unmap cost in the bounce library",
    );
}

#[test]
fn seed_2015_iova_quick_writes_table_json_and_chart() {
    // The 2-core limit is said.
    net_quick_says("seed-2015-iova", "2015", "48 threads");
}

#[test]
fn bad_usage_and_missing_prerequisites_are_one_line_and_distinct_statuses() {
    let o = Command::new(BIN).arg("seed-1999-nope").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    assert!(e.contains("seed-2022-swiotlb"), "names the presets: {e}");
    let o = Command::new(BIN)
        .args(["seed-2021-vduse", "--seconds", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let o = Command::new(BIN)
        .args(["seed-2021-vduse", "--alloc", "iova-rcache,nope"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("nope") && e.contains("iova-rbtree, iova-rcache, genpool"),
        "{e}"
    );
    // A net preset without dpdk-testpmd on PATH says what to install.
    let e = without_path(&["seed-2012-phys", "--quick", "--vhost", VHOST.as_str()]);
    if is_root() && Path::new("/dev/net/tun").exists() {
        assert!(
            e.contains("apt-get install --no-install-recommends dpdk-dev librte-net-virtio23"),
            "{e}"
        );
    }
    // A guest-level net preset without python3 on PATH (the rig-1 driver): said, not run.
    let e = without_path(&[
        "seed-2015-iova",
        "--level",
        "guest",
        "--vhost",
        VHOST.as_str(),
    ]);
    assert!(e.contains("python3"), "{e}");
}

#[test]
fn ctrl_c_stops_cleanly_and_keeps_what_was_measured() {
    let d = TmpDir::new("sigint");
    let child = Command::new(BIN)
        .args([
            "seed-2021-vduse",
            "--quick",
            "--rounds",
            "50",
            "--vhost",
            VHOST.as_str(),
            "--out",
        ])
        .arg(&d.0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let a few samples finish (each is ~0.3 s plus a backend start).
    std::thread::sleep(Duration::from_secs(4));
    let pid = child.id() as libc::pid_t;
    // SAFETY: kill sends a signal to the child we started and still own.
    let rc = unsafe { libc::kill(pid, libc::SIGINT) };
    assert_eq!(rc, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut child = child;
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "did not stop within 30 s of Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(d.0.join("results.json")).unwrap()).unwrap();
    assert_eq!(r["interrupted"], true);
    let samples: usize = r["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["samples"].as_array().unwrap().len())
        .sum();
    assert!(samples > 0 && samples < 50 * 6, "kept {samples} samples");
    let table = std::fs::read_to_string(d.0.join("table.md")).unwrap();
    assert!(table.contains("Interrupted by Ctrl-C"), "{table}");
    assert!(d.0.join("chart.svg").is_file());
}
