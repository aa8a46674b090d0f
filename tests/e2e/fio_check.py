#!/usr/bin/env python3
"""The main job: boot a Linux guest (rig 1: QEMU TCG) whose disk is served by bouncevm-vhost
with every DMA bounced, run fio with --verify=crc32c in it, and print the guest's figures and the
host bounce statistics.

    python3 tests/e2e/fio_check.py [--alloc areas] [--mode swiotlb|iova] [--size 64M] [--swiotlb-force]

Exit status 0 when fio verified every block; 1 otherwise (the serial log path is printed).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rig1  # noqa: E402
from rig1 import blk_vhost_user, make_raw_image, out_path, run_guest  # noqa: E402
from test_rig1_bouncevm_vhost import _binary, _blk_backend, _final_stats  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alloc", default="areas", help="bounce allocator (default areas)")
    ap.add_argument("--mode", default="swiotlb", choices=["swiotlb", "iova"])
    ap.add_argument("--size", default="64M", help="fio file size in the guest")
    ap.add_argument("--swiotlb-force", action="store_true",
                    help="also bounce in the guest (swiotlb=force, iommu_platform=on)")
    a = ap.parse_args()
    try:
        rig1.require_root()
        rig1.require_qemu()
        rig1.images()
        binary = _binary()
    except rig1.Missing as e:
        print(f"fio-check: cannot run: {e}", file=sys.stderr)
        return 1
    img = make_raw_image(out_path("fio_check", ".img"), "512M")
    bounce = f"policy=force,alloc={a.alloc},mode={a.mode}"
    backend, sock, stats = _blk_backend("fio_check", binary, img, bounce=bounce)
    with backend:
        run = run_guest("fio_check", "fio-verify,fio-randread" + (",swiotlb" if a.swiotlb_force else ""),
                        params={"size": a.size, "runtime": 10},
                        append="swiotlb=force" if a.swiotlb_force else "",
                        devices=blk_vhost_user(sock, iommu=a.swiotlb_force))
        st = _final_stats(stats)
    by_test = {r.get("test"): r for r in run.results}
    v = by_test.get("fio-verify", {})
    rr = by_test.get("fio-randread", {})
    b = st.get("bounce") or {}
    print(f"guest: kernel booted in {run.boot_s:.1f} s; fio verify: {v.get('status', 'missing')} "
          f"(read {v.get('read_iops', '?')} IOPS, write {v.get('write_iops', '?')} IOPS, "
          f"verify errors {v.get('verify_errors', '?')}); 4k randread {rr.get('read_iops', '?')} IOPS")
    print(f"host bounce ({bounce}): " + json.dumps(
        {k: b.get(k) for k in ("maps", "unmaps", "map_failures", "bytes_to_device",
                               "bytes_from_device", "used", "used_hiwater", "lock_wait_ns")}))
    if b.get("nslabs") and b.get("slot_size"):
        mib = lambda slots: slots * b["slot_size"] / (1 << 20)  # noqa: E731
        print(f"host pool: {b['nslabs']} slots x {b['slot_size']} B = {mib(b['nslabs']):.0f} MiB; "
              f"high-water {b.get('used_hiwater', 0)} slots = {mib(b.get('used_hiwater', 0)):.2f} MiB "
              f"({100 * b.get('used_hiwater', 0) / b['nslabs']:.2f} % of the pool); "
              f"{b.get('bytes_to_device', 0) / (1 << 20):.0f} MiB copied to the device, "
              f"{b.get('bytes_from_device', 0) / (1 << 20):.0f} MiB back")
    if v.get("status") != "ok" or v.get("verify_errors") != "0" or b.get("maps", 0) == 0:
        print(f"fio-check: FAILED; serial log: {run.log_path}", file=sys.stderr)
        return 1
    print("fio-check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
