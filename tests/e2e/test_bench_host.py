"""tests/e2e/bench_host.py, the README's side-by-side benchmark, runs as the README shows it, at
a smoke scale: one round of one second on a 64 MiB memory-backed image, qemu-storage-daemon
and two bounce settings of ours, free and pinned (--pin). It checks that every variant produced
a sample and that the table and the JSON carry every column (IOPS, the CPU split, the
ceiling), never the figures themselves: this is a benchmark, not a timed test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rig1 import require_qsd, skip_if_missing

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ["qsd", "off", "swiotlb-magazine"]


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
            "--variants", ",".join(VARIANTS), "--json", str(out)]
    if pin:
        argv += ["--pin", pin_spec()]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("pinned: every back end on CPUs" in r.stdout) == bool(pin), r.stdout

    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines()
            if line.startswith("| mem | 1 |")]
    assert [c[2].strip() for c in rows] == VARIANTS, r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("| disk |"))
    assert len(header.split("|")[1:-1]) == len(rows[0]) == 13, r.stdout
    by_name = {c[2].strip(): [x.strip() for x in c] for c in rows}
    # Ratios against off for ours (off itself 1.00x), none for qsd.
    assert by_name["off"][12] == "1.00x", r.stdout
    assert by_name["swiotlb-magazine"][12].endswith("x"), r.stdout
    assert by_name["qsd"][12] == "-", r.stdout

    report = json.loads(out.read_text())
    assert report["pin"] == (pin_spec() if pin else None)
    samples = report["samples"]
    assert sorted(s["variant"] for s in samples) == sorted(VARIANTS)
    for s in samples:
        assert s["disk"] == "mem" and s["jobs"] == 1
        assert s["iops"] > 0, s
        assert s["cpu_us"] > 0, s
        assert s["load_cpu_us"] > 0, s
        # io_uring workers may not run at all (reads served inline); never more than the
        # process total, up to rounding (per-thread and per-process times are scaled apart).
        assert 0 <= s["workers_cpu_us"] <= s["cpu_us"] * 1.05, s


@pytest.mark.parametrize("spec", ["1", "a:0", "1-0:0", "0:99999", ":0"])
def test_bench_host_refuses_a_bad_pin_in_one_line(spec):
    r = subprocess.run([sys.executable, str(REPO / "tests/e2e/bench_host.py"), "--pin", spec],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_host: error: --pin"), r.stderr
    assert r.stdout == ""
