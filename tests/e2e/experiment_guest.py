#!/usr/bin/env python3
"""One guest-level sample for `bouncevm-experiment --level guest`: boots a rig-1 guest (QEMU TCG)
whose disk is served by `bouncevm-vhost blk` with the given bounce options, runs the image's fio
random-read job in it, and writes one JSON object to --out: iops, ios (iops x runtime), boot_s,
fio's fields and the backend's pool statistics after the guest ended.

    python3 tests/e2e/experiment_guest.py --vhost target/release/bouncevm-vhost \
        --bounce policy=force,mode=iova,alloc=iova-rcache [--bs 4096] [--iodepth 16] \
        [--numjobs 1] [--queues 1] [--runtime 5] --out FILE

Prints `MISSING: <reason>` on stderr and exits 3 when the rig cannot run on this machine (root,
QEMU, guest images: tests/setup.sh builds them); exits 1 when the guest fails.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig1  # noqa: E402
from test_rig1_bouncevm_vhost import _final_stats  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vhost", required=True)
    ap.add_argument("--bounce", required=True)
    ap.add_argument("--bs", type=int, default=4096)
    ap.add_argument("--iodepth", type=int, default=16)
    ap.add_argument("--numjobs", type=int, default=1)
    ap.add_argument("--queues", type=int, default=1)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        rig1.require_root()
        rig1.require_qemu()
        rig1.images()
    except rig1.Missing as e:
        print(f"MISSING: {e}", file=sys.stderr)
        return 3
    name = "experiment_guest"
    img = rig1.make_raw_image(rig1.out_path(name, ".img"), "256M")
    sock = rig1.out_path(name, ".sock")
    stats = rig1.out_path(name, ".stats")
    argv = [a.vhost, "blk", "--socket", str(sock), "--file", str(img), "--format", "raw",
            "--queues", str(a.queues), "--stats-socket", str(stats), "--bounce", a.bounce]
    params = {"runtime": a.runtime, "bs": a.bs, "iodepth": a.iodepth, "numjobs": a.numjobs}
    with rig1.Backend(name, argv, socket=sock):
        run = rig1.run_guest(name, "fio-randread", params=params,
                             devices=rig1.blk_vhost_user(sock, num_queues=a.queues))
        r = run.ok("fio-randread")
        st = _final_stats(stats)
    iops = rig1.num(r["read_iops"])
    out = {"iops": iops, "ios": iops * a.runtime, "boot_s": run.boot_s, "fio": r,
           "bounce": st.get("bounce")}
    Path(a.out).write_text(json.dumps(out))
    print(f"guest: {iops:.0f} IOPS (boot {run.boot_s:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
