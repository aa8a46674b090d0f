"""tests/e2e/bench_host.py, the side-by-side benchmark of docs/studies/blk-host-speed.md, runs at
a smoke scale: one round of one second on a 64 MiB memory-backed image, qemu-storage-daemon
and two bounce settings of ours, free and pinned (--pin). It checks that every variant produced
a sample and that the table and the JSON carry every column (IOPS, the CPU split, the
ceiling), never the figures themselves: this is a benchmark, not a timed test. One variant is
defined on the command line (--variant LABEL=OPTS, here an A/A twin of swiotlb-magazine). It
also checks that every `--bounce` string the benchmarks compare builds the pool it names, and
how a variant list is chosen and refused.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import builds
from bounce_variants import VARIANTS as BOUNCE_VARIANTS, select
from rig1 import Backend, read_stats, require_cmd, require_qsd, require_root, skip_if_missing

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ["qsd", "off", "swiotlb-magazine"]
# Defined with --variant: the same pool as swiotlb-magazine under another label (an A/A twin).
CUSTOM = ("mag-twin", "mode=swiotlb,alloc=magazine,policy=force")


def pin_spec():
    """--pin for this machine: the back end and the load generator on CPUs of their own when
    there are two, else both on the one."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[-1]}:{cpus[0]}"


@pytest.mark.parametrize("pin", [None, "pinned"])
@skip_if_missing
def test_bench_host_runs_and_reports_every_column(tmp_path, pin):
    qsd = require_qsd()
    env = dict(os.environ, PATH=f"{Path(qsd).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(REPO / "tests/e2e/bench_host.py"), "--rounds", "1",
            "--runtime", "1", "--jobs", "1", "--disks", "mem", "--size", "64M",
            "--variants", ",".join(VARIANTS), "--variant", "=".join(CUSTOM), "--json", str(out),
            "--profile", "release"]
    if pin:
        argv += ["--pin", pin_spec()]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("pinned: every back end on CPUs" in r.stdout) == bool(pin), r.stdout

    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines()
            if line.startswith("| mem | 1 |")]
    assert [c[2].strip() for c in rows] == VARIANTS + [CUSTOM[0]], r.stdout
    assert f"{CUSTOM[0]}: --bounce {CUSTOM[1]}" in r.stdout.splitlines(), r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("| disk |"))
    assert len(header.split("|")[1:-1]) == len(rows[0]) == 13, r.stdout
    by_name = {c[2].strip(): [x.strip() for x in c] for c in rows}
    # Ratios against off for ours (off itself 1.00x), none for qsd.
    assert by_name["off"][12] == "1.00x", r.stdout
    assert by_name["swiotlb-magazine"][12].endswith("x"), r.stdout
    assert by_name[CUSTOM[0]][12].endswith("x"), r.stdout
    assert by_name["qsd"][12] == "-", r.stdout

    report = json.loads(out.read_text())
    assert report["pin"] == (pin_spec() if pin else None)
    assert report["bounce"] == {"qsd": None, **{v: BOUNCE_VARIANTS[v] for v in VARIANTS[1:]},
                                CUSTOM[0]: CUSTOM[1]}, report["bounce"]
    samples = report["samples"]
    assert sorted(s["variant"] for s in samples) == sorted(VARIANTS + [CUSTOM[0]])
    for s in samples:
        assert s["disk"] == "mem" and s["jobs"] == 1
        assert s["iops"] > 0, s
        assert s["cpu_us"] > 0, s
        assert s["load_cpu_us"] > 0, s
        # Measured in every sample (the back end ran while the load did). io_uring workers may
        # not run at all (reads served inline); never more than the process total.
        assert s["workers_cpu_us"] is not None, s
        assert 0 <= s["workers_cpu_us"] <= s["cpu_us"], s


@pytest.mark.parametrize("spec", ["1", "a:0", "1-0:0", "0:99999", ":0"])
def test_bench_host_refuses_a_bad_pin_in_one_line(spec):
    r = subprocess.run([sys.executable, str(REPO / "tests/e2e/bench_host.py"), "--pin", spec],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_host: error: --pin"), r.stderr
    assert r.stdout == ""


def test_variants_are_chosen_in_order_with_the_defined_ones_last():
    known = {"qsd": None, **BOUNCE_VARIANTS}
    assert select(["iova", "off"], ["big=policy=force,slots=65536"]) == {
        "iova": BOUNCE_VARIANTS["iova"], "off": "policy=off", "big": "policy=force,slots=65536"}
    assert select(["qsd"], [], known) == {"qsd": None}
    assert select([], ["a=policy=off"]) == {"a": "policy=off"}


@pytest.mark.parametrize("names,custom,message", [
    (["nope"], [], "unknown variant 'nope'"),
    (["off", "off"], [], "named twice"),
    ([], ["off=policy=force"], "is taken"),
    ([], ["a=policy=off", "a=policy=force"], "is taken"),
    ([], ["qsd=policy=off"], "is taken"),
    ([], ["a"], "expected LABEL=OPTS"),
    ([], ["a="], "expected LABEL=OPTS"),
    ([], ["=policy=off"], "expected LABEL=OPTS"),
    ([], ["a:b=policy=off"], "expected LABEL=OPTS"),
    ([], ["a@b=policy=off"], "expected LABEL=OPTS"),
    ([], ["a,b=policy=off"], "expected LABEL=OPTS"),
])
def test_a_bad_variant_list_is_refused_with_the_reason(names, custom, message):
    with pytest.raises(ValueError, match=message) as e:
        select(names, custom, {"qsd": None, **BOUNCE_VARIANTS})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("script", ["bench_host.py", "bench_net_dpdk.py"])
def test_both_benchmarks_refuse_a_bad_variant_in_one_line(script):
    r = subprocess.run([sys.executable, str(REPO / "tests/e2e" / script), "--variants", "off",
                        "--variant", "off=policy=force"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is taken" in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("variant", sorted(BOUNCE_VARIANTS))
def test_every_benchmark_variant_builds_the_pool_it_names(tmp_path, variant):
    """Each `--bounce` string the benchmarks compare is accepted by bouncevm-vhost and reaches
    its pool: mode, allocator, copy rule and time accounting as the string says (a misspelt
    key would fail here, not minutes into a benchmark run)."""
    vhost = builds.bin_dir("release") / "bouncevm-vhost"
    if not vhost.is_file():
        pytest.fail(f"{vhost} is missing: cargo build --release -p bouncevm-vhost")
    opts = dict(item.split("=", 1) for item in BOUNCE_VARIANTS[variant].split(","))
    image = tmp_path / "disk.img"
    image.write_bytes(b"\0" * (1 << 20))
    stats = tmp_path / "stats.sock"
    argv = [str(vhost), "blk", "--socket", str(tmp_path / "blk.sock"), "--file", str(image),
            "--stats-socket", str(stats), "--bounce", BOUNCE_VARIANTS[variant]]
    with Backend(f"bench-variant-{variant}", argv, socket=stats):
        st = read_stats(stats)
    pool = st["bounce"]
    if opts["policy"] == "off":
        assert pool is None, st
        return
    mode = opts.get("mode", "swiotlb")
    default_rule = {"swiotlb": "always", "iova": "when-device-reads"}[mode]
    assert pool["mode"] == mode, pool
    assert pool["allocator"] == opts["alloc"], pool
    assert pool["copy_on_map"] == opts.get("copy-on-map", default_rule), pool
    assert pool["timing"]["enabled"] == (opts.get("timing", "on") == "on"), pool["timing"]


@pytest.mark.parametrize("script,profile", [("bench_host.py", "dist"), ("bench_host.py", "release"),
                                            ("bench_net_dpdk.py", "dist")])
@skip_if_missing
def test_both_benchmarks_name_the_build_they_miss_in_one_line(tmp_path, script, profile):
    """Without a build of the chosen profile (here an empty $CARGO_TARGET_DIR) a benchmark says
    which binary is missing and the cargo command that builds it, before it starts anything."""
    if script == "bench_net_dpdk.py":
        require_root()
        require_cmd("dpdk-testpmd")
    env = dict(os.environ, CARGO_TARGET_DIR=str(tmp_path))
    argv = [sys.executable, str(REPO / "tests/e2e" / script), "--variants", "off"]
    argv += [] if profile == "dist" else ["--profile", profile]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"{tmp_path / profile}/bouncevm-" in lines[0], r.stderr
    assert f"is missing: cargo build --profile {profile} -p bouncevm-" in lines[0], r.stderr
    assert r.stdout == ""
