#!/usr/bin/env python3
"""Rig-2 benchmark: bouncevm against QEMU 7.2 as the L2 VMM, in the same L1, interleaved.

    python3 tests/e2e/bench_rig2.py [--rounds 3] [--runtime 10] [--net-time 5]
                                    [--variants qemu,bvm-off,bvm-force] [--json FILE]

Each round boots one L1 (tests/e2e/rig2.py) that runs every variant in turn, the order rotated
by one each round; each variant boots L2 (the PVH vmlinux, 2 vCPUs, 1 GiB) with a 256 MiB raw
disk in L1's tmpfs (cache=writeback on both VMMs) and a virtio-net on L1's tap0, and runs
fio 4 KiB randread (iodepth 32, --runtime seconds after a 1 s ramp) and iperf3 both ways
(--net-time seconds each) against L1. Variants:

    qemu       QEMU 7.2, -machine q35,accel=kvm -cpu host, virtio-blk-pci (aio=threads) and
               virtio-net-pci (tap, vhost off)
    bvm-off    bouncevm, -bounce policy=off (no bouncing; aio=io_uring, its default)
    bvm-force  bouncevm, -bounce policy=force (every DMA through the swiotlb-style pool)

The guest does not bounce (no swiotlb=force). A round whose L1 dies is reported and run again
(up to --rounds extra boots); a round in which a variant's L2 test fails is reported and left out
(only rounds in which every variant passed count). Prints per-round figures, then medians with min/max and each median's ratio to QEMU's,
and writes every sample with the machine's load to --json (default tests/out/bench_rig2.json).
Performance figures from rig 2 are the nested-TCG rig's, not a real host's: compare the
variants with each other, measured side by side, never as absolute numbers.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig1  # noqa: E402
import rig2  # noqa: E402

VARIANTS = {
    "qemu": ("qemu", ""),
    "bvm-off": ("bouncevm", "policy=off"),
    "bvm-force": ("bouncevm", "policy=force"),
}
METRICS = [("randread_iops", "fio 4k randread IOPS"), ("l2_to_l1_gbps", "iperf3 L2->L1 Gbit/s"),
           ("l1_to_l2_gbps", "iperf3 L1->L2 Gbit/s")]


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names or len(set(names)) != len(names):
        raise SystemExit(f"bench_rig2: --variants takes distinct names from "
                         f"{','.join(VARIANTS)}, not {text!r}")
    return names


def one_round(i: int, order: list[str], a) -> tuple[dict, rig2.L1Run]:
    """Boots one L1 running the variants in `order`; returns {variant: figures or error}."""
    name = f"bench_rig2_r{i}"
    share = rig2.Share(name)
    k, initrd = rig2.stage_l2(share, "pvh")
    params = {"ip": f"{rig2.L2_IP}/24", "server": rig2.L1_IP, "runtime": a.runtime,
              "time": a.net_time}
    lines = ["#!/bin/sh", "# written by tests/e2e/bench_rig2.py; run by L1's /init (l1.cmd)"]
    for v in order:
        vmm, bounce = VARIANTS[v]
        cmdline = rig2.l2_cmdline("fio-randread,iperf3", params, timeout=a.vmm_timeout - 30)
        lines += ["rm -f /tmp/disk.img", "truncate -s 256M /tmp/disk.img",
                  rig2.l2_vmm_command(share, vmm, k, initrd, cmdline, "/tmp/disk.img",
                                      bounce=bounce, vmm_timeout=a.vmm_timeout,
                                      out=f"/host/out/{v}", poll=False)]
    cmd = share.write_script("run-l2.sh", "\n".join(lines) + "\n")
    l1 = rig2.L1(name, share, cmd=cmd, iperf3=True, tcg_thread=a.tcg, smp=rig2.l1_smp_default(),
                 timeout=len(order) * a.vmm_timeout + 120)
    run = l1.run(boot_retries=1)
    res = {}
    for v in order:
        try:
            text = (share.dir / "out" / v / "l2.serial.log").read_text(errors="replace")
        except OSError:
            res[v] = {"error": "did not run (L1 ended first)"}
            continue
        parsed = rig1.parse_log(text)
        r = {x.get("test"): x for x in parsed.get("RESULT", [])}
        rr, ip = r.get("fio-randread", {}), r.get("iperf3", {})
        if rr.get("status") != "ok" or ip.get("status") != "ok":
            res[v] = {"error": f"fio-randread {rr.get('status')} {rr.get('reason', '')}, "
                               f"iperf3 {ip.get('status')} {ip.get('reason', '')}".strip()}
            continue
        res[v] = {"randread_iops": rig1.num(rr["read_iops"]),
                  "l2_to_l1_gbps": rig1.num(ip["guest_to_host_gbps"]),
                  "l1_to_l2_gbps": rig1.num(ip["host_to_guest_gbps"])}
    return res, run


def summary(samples: dict, names: list[str]) -> tuple[list[str], dict]:
    out, med = [], {}
    width = max(len(n) for n in names)
    for key, label in METRICS:
        out.append(f"{label}: median (min-max) over rounds, ratio of medians to qemu")
        for n in names:
            xs = [s[key] for s in samples[n]]
            if not xs:
                out.append(f"  {n:<{width}}  no sample")
                continue
            m = statistics.median(xs)
            med[(n, key)] = m
            ratio = ""
            q = med.get(("qemu", key))
            if n != "qemu" and q:
                ratio = f"  {m / q:.2f}x qemu"
            fmt = "{:.0f}" if key == "randread_iops" else "{:.3f}"
            out.append(f"  {n:<{width}}  {fmt.format(m)} ({fmt.format(min(xs))}-"
                       f"{fmt.format(max(xs))}, n={len(xs)}){ratio}")
    return out, med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=10, help="fio randread seconds")
    ap.add_argument("--net-time", type=int, default=5, help="iperf3 seconds each way")
    ap.add_argument("--variants", default="qemu,bvm-off,bvm-force")
    ap.add_argument("--vmm-timeout", type=int, default=300, help="per L2 run, seconds")
    ap.add_argument("--tcg", default=rig2.tcg_thread_default(), choices=["multi", "single"],
                    help="L1's TCG threading (default: BVM_RIG2_TCG, else rig 2's default)")
    ap.add_argument("--json", default=str(rig1.out_path("bench_rig2", ".json")))
    a = ap.parse_args()
    if a.rounds < 1 or a.runtime < 1 or a.net_time < 1:
        raise SystemExit("bench_rig2: --rounds, --runtime and --net-time must be at least 1")
    names = parse_variants(a.variants)
    rig2.require_root()
    rig1.images()
    rig2.l1_images()
    if any(VARIANTS[n][0] == "bouncevm" for n in names):
        rig2.require_bouncevm()
    samples = {n: [] for n in names}
    rounds, discarded, boots = [], [], 0
    i = 0
    while len(rounds) < a.rounds and boots < 2 * a.rounds:
        order = names[i % len(names):] + names[:i % len(names)]
        t0, load0 = time.time(), loadavg()
        res, run = one_round(i, order, a)
        boots += 1 + len(run.retried)
        rec = {"round": i, "order": order, "results": res, "load_start": load0,
               "load_end": loadavg(), "wall_s": round(time.time() - t0, 1),
               "l1_log": str(run.log_path), "l1_failure": run.l1_failure}
        ok = all("error" not in res[v] for v in order)
        print(f"round {i} ({' '.join(order)}; load {load0[0]:.1f}->{rec['load_end'][0]:.1f}): "
              + ", ".join(f"{v} " + (f"{res[v]['randread_iops']:.0f} IOPS "
                                     f"{res[v]['l2_to_l1_gbps']}/{res[v]['l1_to_l2_gbps']} Gbit/s"
                                     if "error" not in res[v] else f"FAILED ({res[v]['error']})")
                          for v in order)
              + (f"; L1: {run.l1_failure}" if run.l1_failure else ""), flush=True)
        # Only whole rounds count, so every variant is measured under the same conditions.
        rec["kept"] = ok
        if ok:
            for v in order:
                samples[v].append(res[v])
            rounds.append(rec)
        else:
            discarded.append(rec)
        i += 1
    lines, med = summary(samples, names)
    print("\n".join(lines))
    doc = {"command": shlex.join([sys.executable] + sys.argv), "time": time.time(),
           "cpus": os.cpu_count(), "tcg": a.tcg, "runtime": a.runtime, "net_time": a.net_time,
           "variants": {n: {"vmm": VARIANTS[n][0], "bounce": VARIANTS[n][1]} for n in names},
           "rounds": rounds, "discarded_rounds": discarded, "samples": samples,
           "medians": {f"{n}:{k}": v for (n, k), v in med.items()}}
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    print("samples in", a.json)
    if len(rounds) < a.rounds:
        print(f"bench_rig2: only {len(rounds)} of {a.rounds} rounds completed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except rig1.Missing as e:
        print(f"bench_rig2: skipped: {e}")
        sys.exit(0)
