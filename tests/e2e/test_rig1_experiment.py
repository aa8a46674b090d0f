"""bouncevm-experiment --level guest: a block preset runs end to end in rig-1 guests (QEMU TCG +
bouncevm-vhost blk, fio in the guest) and writes its table, JSON and chart. Two guest boots:
seed-2021-vduse, --quick (numjobs 1), one round, the tree and the cached IOVA allocators."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import rig1
from rig1 import images, require_qemu, require_root, skip_if_missing

REPO = Path(__file__).resolve().parents[2]


def _binary(name: str) -> str:
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for c in (target / "release" / name, REPO / "target" / "release" / name):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise rig1.Missing(f"no {name} binary (cargo build --release --bins)")


@skip_if_missing
def test_guest_level_block_preset_writes_table_json_and_chart():
    require_root()
    require_qemu()
    images()
    exp = _binary("bouncevm-experiment")
    with tempfile.TemporaryDirectory(prefix="bvm-exp-guest-") as out:
        r = subprocess.run([exp, "seed-2021-vduse", "--level", "guest", "--quick", "--rounds", "1",
                            "--alloc", "iova-rbtree,iova-rcache", "--vhost",
                            _binary("bouncevm-vhost"), "--out", out],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "BVM_REPO": str(REPO)})
        assert r.returncode == 0, f"rc={r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
        res = json.loads(Path(out, "results.json").read_text())
        assert res["level"] == "guest" and res["rounds_done"] == 1
        cells = res["cells"]
        assert [c["series"] for c in cells] == ["iova-rbtree", "iova-rcache"], cells
        for c in cells:
            (s,) = c["samples"]
            assert s["metrics"]["iops"] > 0, s
            # The guest's I/O went through the backend's IOVA pool.
            assert s["pool"]["mode"] == "iova" and s["pool"]["maps"] > 0, s["pool"]
            assert s["detail"]["boot_s"] > 0
            assert f"| 1 | {c['series']} | " in r.stdout
        assert "Guest level" in r.stdout
        svg = Path(out, "chart.svg").read_text()
        assert svg.lstrip().startswith("<svg") and svg.rstrip().endswith("</svg>")
