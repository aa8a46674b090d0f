#!/usr/bin/env python3
"""One guest-level sample for `bouncevm-experiment --level guest`: boots a rig-1 guest (QEMU TCG)
whose device is served by `bouncevm-vhost` with the given bounce options, runs one workload in
it, and writes one JSON object to --out with the sample's figures, the guest's boot time and the
backend's pool statistics after the guest ended ("bounce").

    blk: the image's fio random-read job on a vhost-user-blk disk (raw image under tests/out):
         iops, ios (iops x runtime), fio's fields.
    python3 tests/e2e/experiment_guest.py --vhost target/release/bouncevm-vhost \
        --bounce policy=force,mode=iova,alloc=iova-rcache [--bs 4096] [--iodepth 16] \
        [--numjobs 1] [--queues 1] [--runtime 5] --out FILE

    net: iperf3 -P PARALLEL from the guest to a server in a network namespace created for the
         sample, through vhost-user-net (bouncevm-vhost net on a tap in that namespace; QUEUES
         queue pairs): gbps (guest -> host), rx_gbps (host -> guest: the image's iperf3 test
         runs both ways, one after the other, so the pool statistics cover both), iperf3's fields.
    python3 tests/e2e/experiment_guest.py --mode net --vhost target/release/bouncevm-vhost \
        --bounce policy=force,mode=iova,alloc=iova-bitmap [--queues 2] [--parallel 4] \
        [--runtime 5] --out FILE

Prints `MISSING: <reason>` on stderr and exits 3 when the rig cannot run on this machine (root,
QEMU, guest images: tests/setup.sh builds them; net: /dev/net/tun, iperf3); exits 1 when the
guest fails.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig1  # noqa: E402
from test_rig1_bouncevm_vhost import _final_stats  # noqa: E402

NAME = "experiment_guest"


def _blk(a, sock: Path, stats: Path) -> tuple[dict, str]:
    img = rig1.make_raw_image(rig1.out_path(NAME, ".img"), "256M")
    argv = [a.vhost, "blk", "--socket", str(sock), "--file", str(img), "--format", "raw",
            "--queues", str(a.queues), "--stats-socket", str(stats), "--bounce", a.bounce]
    params = {"runtime": a.runtime, "bs": a.bs, "iodepth": a.iodepth, "numjobs": a.numjobs}
    with rig1.Backend(NAME, argv, socket=sock):
        run = rig1.run_guest(NAME, "fio-randread", params=params,
                             devices=rig1.blk_vhost_user(sock, num_queues=a.queues))
        r = run.ok("fio-randread")
        st = _final_stats(stats)
    iops = rig1.num(r["read_iops"])
    out = {"iops": iops, "ios": iops * a.runtime, "boot_s": run.boot_s, "fio": r,
           "bounce": st.get("bounce")}
    return out, f"{iops:.0f} IOPS"


def _net(a, sock: Path, stats: Path) -> tuple[dict, str]:
    with rig1.NetNS(prefix="bvmxg", multi_queue=a.queues > 1) as ns:
        ns.start_iperf3()
        argv = [a.vhost, "net", "--socket", str(sock), "--tap", ns.tap, "--queues",
                str(a.queues), "--stats-socket", str(stats), "--bounce", a.bounce]
        with rig1.Backend(NAME, argv, socket=sock, netns=ns):
            run = rig1.run_guest(NAME, "iperf3",
                                 params={"ip": ns.guest_cidr, "server": ns.host_ip,
                                         "time": a.runtime, "parallel": a.parallel},
                                 devices=rig1.net_vhost_user(sock, queues=a.queues))
            r = run.ok("iperf3")
            st = _final_stats(stats)
    tx, rx = rig1.num(r["guest_to_host_gbps"]), rig1.num(r["host_to_guest_gbps"])
    out = {"gbps": tx, "rx_gbps": rx, "boot_s": run.boot_s, "iperf3": r,
           "bounce": st.get("bounce"), "device": st.get("device")}
    return out, f"{tx:.2f} Gbit/s guest->host, {rx:.2f} host->guest"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("blk", "net"), default="blk")
    ap.add_argument("--vhost", required=True)
    ap.add_argument("--bounce", required=True)
    ap.add_argument("--bs", type=int, default=4096)
    ap.add_argument("--iodepth", type=int, default=16)
    ap.add_argument("--numjobs", type=int, default=1)
    ap.add_argument("--queues", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        rig1.require_root()
        rig1.require_qemu()
        rig1.images()
        if a.mode == "net":
            rig1.require_tun()
            rig1.require_cmd("iperf3")
            rig1.require_cmd("ip")
    except rig1.Missing as e:
        print(f"MISSING: {e}", file=sys.stderr)
        return 3
    sock, stats = rig1.out_path(NAME, ".sock"), rig1.out_path(NAME, ".stats")
    out, said = (_net if a.mode == "net" else _blk)(a, sock, stats)
    Path(a.out).write_text(json.dumps(out))
    print(f"guest: {said} (boot {out['boot_s']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
