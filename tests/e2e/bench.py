#!/usr/bin/env python3
"""Side-by-side rig-1 figures, interleaved rounds, medians.

    python3 tests/e2e/bench.py [--rounds 3] [--runtime 8] [--net-time 5] [--no-net] [--no-bouncevm]

4k randread IOPS on one image: QEMU built-in virtio-blk, qemu-storage-daemon vhost-user-blk, and
bouncevm-vhost blk with bounce off, forced (swiotlb, areas) and forced (iova, iova-rcache); then
iperf3 both ways over QEMU's virtio-net (vectors=0) + tap in a netns vs bouncevm-vhost net
(bounce off, forced) on a tap in a netns.
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


def _bvm_blk(name, img, bounce):
    from test_rig1_bouncevm_vhost import _binary, _blk_backend
    backend, sock, _stats = _blk_backend(name, _binary(), img, bounce=bounce)
    return backend, rig1.blk_vhost_user(sock)


def _bvm_net(name, ns, bounce):
    from test_rig1_bouncevm_vhost import _binary
    sock = rig1.out_path(name, ".sock")
    argv = [_binary(), "net", "--socket", str(sock), "--tap", ns.tap, "--bounce", bounce]
    backend = rig1.Backend(name, argv, socket=sock, netns=ns)
    return backend, rig1.net_vhost_user(sock, extra=",speed=10000,duplex=full")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=8)
    ap.add_argument("--net-time", type=int, default=5)
    ap.add_argument("--no-net", action="store_true")
    ap.add_argument("--no-bouncevm", action="store_true", help="QEMU's own devices only")
    a = ap.parse_args()
    rig1.require_root()
    rig1.require_qemu()
    rig1.require_qsd()
    rig1.images()

    img = rig1.make_raw_image(rig1.out_path("bench", ".img"), "1G")
    sock = rig1.out_path("bench_qsd", ".sock")
    blk = ["builtin", "qsd"] + ([] if a.no_bouncevm else ["bvm-off", "bvm-force", "bvm-force-iova"])
    res = {k: [] for k in blk}
    boots = []
    for i in range(a.rounds):
        for k in blk:
            if k == "builtin":
                iops, b = randread(f"bench_builtin_{i}", rig1.blk_builtin(img), a.runtime)
            elif k == "qsd":
                with rig1.qsd_vhost_user_blk("bench_qsd", img, sock):
                    iops, b = randread(f"bench_qsd_{i}", rig1.blk_vhost_user(sock), a.runtime)
            else:
                bounce = {"bvm-off": "policy=off", "bvm-force": "policy=force,alloc=areas",
                          "bvm-force-iova": "policy=force,mode=iova,alloc=iova-rcache"}[k]
                backend, dev = _bvm_blk(f"bench_{k}", img, bounce)
                with backend:
                    iops, b = randread(f"bench_{k}_{i}", dev, a.runtime)
            res[k].append(iops)
            boots.append(b)
        print(f"round {i}: " + ", ".join(f"{k} {res[k][-1]:.0f}" for k in blk) + " IOPS", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("4k randread median IOPS: " + ", ".join(
        f"{k} {med[k]:.0f} ({med[k] / med['builtin']:.2f}x builtin, {med[k] / med['qsd']:.2f}x qsd)"
        for k in blk))
    print(f"boot to /init: median {statistics.median(boots):.1f}s (min {min(boots):.1f}, max {max(boots):.1f})")
    figs = {f"{k}_iops": v for k, v in res.items()}
    figs["boot_s"] = boots

    if not a.no_net:
        rig1.require_tun()
        nets = ["builtin"] + ([] if a.no_bouncevm else ["bvm-off", "bvm-force"])
        tx = {k: [] for k in nets}
        rx = {k: [] for k in nets}
        for i in range(a.rounds):
            for k in nets:
                with rig1.NetNS() as ns:
                    ns.start_iperf3()
                    params = {"ip": ns.guest_cidr, "server": ns.host_ip, "time": a.net_time}
                    if k == "builtin":
                        run = rig1.run_guest(f"bench_net_{i}", "iperf3", netns=ns, params=params,
                                             devices=rig1.net_tap(ns.tap))
                    else:
                        bounce = "policy=off" if k == "bvm-off" else "policy=force,alloc=areas"
                        backend, dev = _bvm_net(f"bench_net_{k}", ns, bounce)
                        with backend:
                            run = rig1.run_guest(f"bench_net_{k}_{i}", "iperf3", params=params,
                                                 devices=dev)
                r = run.ok("iperf3")
                tx[k].append(rig1.num(r["guest_to_host_gbps"]))
                rx[k].append(rig1.num(r["host_to_guest_gbps"]))
            print(f"round {i}: " + ", ".join(f"{k} {tx[k][-1]}/{rx[k][-1]}" for k in nets)
                  + " Gbit/s (guest->host/host->guest)", flush=True)
        for k in nets:
            print(f"iperf3 median {k}: guest->host {statistics.median(tx[k]):.2f} Gbit/s, "
                  f"host->guest {statistics.median(rx[k]):.2f} Gbit/s")
        figs.update({f"net_{k}_tx_gbps": tx[k] for k in nets})
        figs.update({f"net_{k}_rx_gbps": rx[k] for k in nets})
    print("figures appended to", rig1.record_figures("bench", **figs))


if __name__ == "__main__":
    try:
        main()
    except rig1.Missing as e:
        print(f"skipped: {e}")
        sys.exit(0)
