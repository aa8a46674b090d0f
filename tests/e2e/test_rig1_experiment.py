"""bouncevm-experiment --level guest: a block and a net preset run end to end in rig-1 guests
(QEMU TCG + bouncevm-vhost blk / net, fio / iperf3 in the guest) and write their table, JSON and
chart. Two guest boots each, --quick, one round:
- seed-2021-vduse (numjobs 1): the tree and the cached IOVA allocators, fio;
- seed-2015-iova: iova-rbtree and iova-bitmap, 2 queue pairs, iperf3 -P 4."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import rig1
from rig1 import images, require_binary, require_qemu, require_root, skip_if_missing

REPO = Path(__file__).resolve().parents[2]


def _run_guest_level(preset: str, *args: str) -> tuple[str, dict]:
    """Runs PRESET --level guest --quick --rounds 1 [args]; returns stdout and results.json after
    checking the common shape (exit 0, level, one round, a well-formed chart)."""
    require_root()
    require_qemu()
    images()
    exp = require_binary("bouncevm-experiment")
    with tempfile.TemporaryDirectory(prefix="bvm-exp-guest-") as out:
        r = subprocess.run([exp, preset, "--level", "guest", "--quick", "--rounds", "1", *args,
                            "--vhost", require_binary("bouncevm-vhost"), "--out", out],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "BVM_REPO": str(REPO)})
        assert r.returncode == 0, f"rc={r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
        res = json.loads(Path(out, "results.json").read_text())
        assert res["level"] == "guest" and res["rounds_done"] == 1, res
        assert "Guest level" in r.stdout and "TCG" in r.stdout, r.stdout
        svg = Path(out, "chart.svg").read_text()
        assert svg.lstrip().startswith("<svg") and svg.rstrip().endswith("</svg>")
    return r.stdout, res


@skip_if_missing
def test_guest_level_block_preset_writes_table_json_and_chart():
    stdout, res = _run_guest_level("seed-2021-vduse", "--alloc", "iova-rbtree,iova-rcache")
    cells = res["cells"]
    assert [c["series"] for c in cells] == ["iova-rbtree", "iova-rcache"], cells
    for c in cells:
        (s,) = c["samples"]
        assert s["metrics"]["iops"] > 0, s
        # The guest's I/O went through the backend's IOVA pool.
        assert s["pool"]["mode"] == "iova" and s["pool"]["maps"] > 0, s["pool"]
        assert s["detail"]["boot_s"] > 0
        assert f"| 1 | {c['series']} | " in stdout


@skip_if_missing
def test_guest_level_net_preset_runs_iperf3_over_two_queue_pairs():
    rig1.require_tun()
    rig1.require_cmd("iperf3")
    stdout, res = _run_guest_level("seed-2015-iova")
    cells = res["cells"]
    assert [c["series"] for c in cells] == ["iova-rbtree", "iova-bitmap"], cells
    assert "| Gbit/s median [min-max] | host->guest Gbit/s |" in stdout, stdout
    for c in cells:
        assert c["workload"] == {"kind": "iperf3", "bounce": c["workload"]["bounce"],
                                 "queues": 2, "parallel": 4}, c["workload"]
        assert c["workload"]["bounce"].endswith(f"alloc={c['series']}")
        (s,) = c["samples"]
        assert s["metrics"]["gbps"] > 0 and s["metrics"]["rx_gbps"] > 0, s["metrics"]
        # Every frame went through the backend's IOVA pool with the row's allocator, and the
        # pool holds nothing once the guest has gone.
        p = s["pool"]
        assert p and p["mode"] == "iova" and p["allocator"] == c["series"], p
        assert p["maps"] > 0 and p["used"] == 0 and p["map_failures"] == 0, p
        assert s["detail"]["iperf3"]["parallel"] == "4", s["detail"]["iperf3"]
        assert s["detail"]["boot_s"] > 0
        assert f"| 4 | {c['series']} | " in stdout, stdout
        # 48 threads on bare metal vs a TCG guest: the reason, not a ratio.
        assert "48 threads" in c["shape_note"], c
