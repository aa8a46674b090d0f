#!/usr/bin/env python3
"""Side-by-side rig-1 figures with QEMU's own devices, interleaved rounds, medians.

    python3 tests/e2e/bench.py [--rounds 3] [--runtime 8] [--net-time 5] [--no-net]

4k randread IOPS: QEMU built-in virtio-blk vs qemu-storage-daemon vhost-user-blk (same image,
O_DIRECT on the host for both), then iperf3 over QEMU virtio-net (vectors=0) + tap in a netns.
One QEMU at a time. Absolute figures drift between runs under TCG; the ratio is steadier.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig1  # noqa: E402


def randread(name, devices, runtime):
    run = rig1.run_guest(name, "fio-randread", params={"runtime": runtime}, devices=devices)
    return rig1.num(run.ok("fio-randread")["read_iops"]), run.boot_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=8)
    ap.add_argument("--net-time", type=int, default=5)
    ap.add_argument("--no-net", action="store_true")
    a = ap.parse_args()
    rig1.require_root()
    rig1.require_qemu()
    rig1.require_qsd()
    rig1.images()

    img = rig1.make_raw_image(rig1.out_path("bench", ".img"), "1G")
    sock = rig1.out_path("bench_qsd", ".sock")
    res = {"builtin": [], "qsd": []}
    boots = []
    for i in range(a.rounds):
        iops, b = randread(f"bench_builtin_{i}", rig1.blk_builtin(img), a.runtime)
        res["builtin"].append(iops)
        boots.append(b)
        with rig1.qsd_vhost_user_blk("bench_qsd", img, sock):
            iops, b = randread(f"bench_qsd_{i}", rig1.blk_vhost_user(sock), a.runtime)
        res["qsd"].append(iops)
        boots.append(b)
        print(f"round {i}: builtin {res['builtin'][-1]:.0f} IOPS, qsd {res['qsd'][-1]:.0f} IOPS",
              flush=True)
    mb, mq = statistics.median(res["builtin"]), statistics.median(res["qsd"])
    print(f"4k randread median: builtin {mb:.0f} IOPS, qsd vhost-user-blk {mq:.0f} IOPS, "
          f"ratio qsd/builtin {mq / mb:.2f}")
    print(f"boot to /init: median {statistics.median(boots):.1f}s (min {min(boots):.1f}, max {max(boots):.1f})")
    figs = {"builtin_iops": res["builtin"], "qsd_iops": res["qsd"], "boot_s": boots}

    if not a.no_net:
        rig1.require_tun()
        tx, rx = [], []
        for i in range(a.rounds):
            with rig1.NetNS() as ns:
                ns.start_iperf3()
                run = rig1.run_guest(f"bench_net_{i}", "iperf3", netns=ns,
                                     params={"ip": ns.guest_cidr, "server": ns.host_ip,
                                             "time": a.net_time},
                                     devices=rig1.net_tap(ns.tap))
            r = run.ok("iperf3")
            tx.append(rig1.num(r["guest_to_host_gbps"]))
            rx.append(rig1.num(r["host_to_guest_gbps"]))
            print(f"round {i}: guest->host {tx[-1]} Gbit/s, host->guest {rx[-1]} Gbit/s", flush=True)
        print(f"iperf3 median: guest->host {statistics.median(tx):.2f} Gbit/s, "
              f"host->guest {statistics.median(rx):.2f} Gbit/s")
        figs.update(guest_to_host_gbps=tx, host_to_guest_gbps=rx)
    print("figures appended to", rig1.record_figures("bench", **figs))


if __name__ == "__main__":
    try:
        main()
    except rig1.Missing as e:
        print(f"skipped: {e}")
        sys.exit(0)
