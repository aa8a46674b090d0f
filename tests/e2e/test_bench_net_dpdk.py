"""tests/e2e/bench_net_dpdk.py, the net benchmark of docs/studies/net-host-speed.md (DPDK
virtio_user -> bouncevm-vhost net), runs at a smoke scale: one round of two seconds, 64 B TX and RX,
bounce off, forced swiotlb and one variant defined on the command line, free and with the back
end pinned (--pin). It checks that every variant produced a row with frames/s and CPU per frame
and that the JSON carries each sample's bounce string and pinning; never the figures: this is a
benchmark, not a timed test.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import builds
from bounce_variants import VARIANTS as BOUNCE_VARIANTS
from rig1 import require_cmd, require_root, require_tun, skip_if_missing

REPO = Path(__file__).resolve().parents[2]
NAMED = ["off", "swiotlb-magazine"]
CUSTOM = ("mag-twin", "mode=swiotlb,alloc=magazine,policy=force")


@pytest.mark.parametrize("pin", [False, True])
@skip_if_missing
def test_bench_net_dpdk_runs_and_reports_every_row(tmp_path, pin):
    require_root()
    require_tun()
    require_cmd("dpdk-testpmd")
    vhost = builds.bin_dir("release") / "bouncevm-vhost"
    if not vhost.is_file():
        pytest.fail(f"{vhost} is missing: cargo build --release -p bouncevm-vhost")
    out = tmp_path / "net.json"
    argv = [sys.executable, str(REPO / "tests/e2e/bench_net_dpdk.py"), "--rounds", "1",
            "--seconds", "2", "--warmup", "1", "--sizes", "64", "--variants", ",".join(NAMED),
            "--variant", "=".join(CUSTOM), "--json", str(out), "--profile", "release"]
    argv += ["--pin"] if pin else []
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("the back end is pinned to CPU 0" in r.stdout) == pin, r.stdout

    variants = NAMED + [CUSTOM[0]]
    for d in ("tx", "rx"):
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in r.stdout.splitlines()
                if line.startswith(f"| {d} | 64 B |")]
        assert [c[2] for c in rows] == variants, r.stdout
        for c in rows:
            assert len(c) == 9, r.stdout
            assert c[5].endswith("x") and c[8].endswith("x"), r.stdout
        assert rows[0][5] == "1.00x", r.stdout
    assert f"{CUSTOM[0]}: --bounce {CUSTOM[1]}" in r.stdout.splitlines(), r.stdout

    samples = json.loads(out.read_text())
    assert sorted((s["dir"], s["variant"]) for s in samples) == sorted(
        (d, v) for d in ("tx", "rx") for v in variants)
    bounce = {**{v: BOUNCE_VARIANTS[v] for v in NAMED}, CUSTOM[0]: CUSTOM[1]}
    for s in samples:
        assert s["size"] == 64 and s["pin"] == pin, s
        assert s["bounce"] == bounce[s["variant"]], s
        assert s["fps"] > 0 and s["cpu_us"] > 0, s


@pytest.mark.parametrize("args,message", [
    (["--seconds", "1"], "--seconds must be at least 2 when RX is measured"),
    (["--seconds", "0", "--no-rx"], "--seconds must be positive"),
    (["--rounds", "0"], "--rounds at least 1"),
    (["--variants", "nope"], "unknown variant 'nope'"),
])
def test_bench_net_dpdk_refuses_bad_arguments_in_one_line(args, message):
    r = subprocess.run([sys.executable, str(REPO / "tests/e2e/bench_net_dpdk.py"), *args],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_net_dpdk: error: "), r.stderr
    assert message in lines[0], r.stderr
    assert r.stdout == ""
