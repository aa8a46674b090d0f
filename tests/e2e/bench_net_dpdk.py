#!/usr/bin/env python3
"""bouncevm-vhost net at host speed, driven by DPDK's virtio_user front end (dpdk-testpmd).

    python3 tests/e2e/bench_net_dpdk.py [--rounds 3] [--seconds 10] [--sizes 64,1500]
                                        [--variants off,swiotlb,iova] [--no-rx] [--json OUT]
                                        [--perf-dir DIR] [--backend-bin LABEL=PATH ...]
                                        [--variant LABEL=OPTS ...] [--pin]

Needs root, /dev/net/tun and `apt-get install --no-install-recommends dpdk-dev
librte-net-virtio23` (the script says so and exits if dpdk-testpmd is missing). Per sample:
a network namespace is created, bouncevm-vhost net runs inside it on a tap it creates there,
and dpdk-testpmd (--no-huge --no-pci, one forwarding core) connects to its socket:
- TX (guest -> tap): `--forward-mode=txonly --txpkts=SIZE`; frames/s = the tap's rx_packets
  delta over the measured window (what really reached the kernel), testpmd's own Tx-pps
  shown next to it;
- RX (tap -> guest): `--forward-mode=rxonly`; an AF_PACKET sender inside the namespace
  injects SIZE-byte frames for the device's MAC into the tap; frames/s = testpmd's Rx-pps
  (the sender is a Python loop on a 2-core machine, so RX is bounded by it: compare ratios).
Variants (tests/e2e/bounce_variants.py): bounce off, forced swiotlb (areas), forced iova
(iova-rcache), the forced ones with the pool's time accounting off (`swiotlb-untimed`,
`iova-untimed`: bounce option timing=off), and forced swiotlb with the allocators that reuse
cache-hot slots (`swiotlb-magazine`, `swiotlb-areas-lifo`, `swiotlb-magazine-untimed`), and
each mode with the other's copy rule (`iova-copy-in`, `swiotlb-magazine-no-copy-in`);
--variant LABEL=OPTS (repeatable) adds a row LABEL run with `--bounce OPTS`, e.g. an A/A twin
of a named variant (the same pool under another string) to see the run's own spread. Rounds are interleaved (every variant once per round, rotated, after one
discarded warm-up sample); the table gives median [min-max] and the ratio of medians vs off,
for frames/s and for the back end's CPU time per frame (user + system of the process over the
window, from /proc/PID/stat: on a loaded machine each process gets about its fair share of a
CPU, so frames/s follow the scheduler while CPU per frame says what a frame costs).
--backend-bin LABEL=PATH (repeatable) runs every variant on each of these back-end binaries
instead of the --profile build, interleaved in the same rounds (rows "LABEL:variant", "vs off"
against the same binary's off): a change measured side by side against a copy of main's.
--pin runs the back end on CPU 0, beside testpmd's mostly idle main core and off its
busy-polling forwarding core (CPU 1); unpinned, the scheduler sometimes places the back end
badly, so that a sample lands about 15 % low whatever the variant (docs/studies/net-host-speed.md
has the A/A runs that show it).
--perf-dir records `perf record -e cpu-clock -F 5000 -g` of the back end over every measured window. testpmd busy-polls one core: absolute figures depend on the
machine's load; state it with the figures. The back end is the dist build (Cargo.toml's
[profile.dist], the build to ship), --profile release the tests' build. Build first:
cargo build --profile dist -p bouncevm-vhost.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bounce_variants
import builds

MAC = "52:54:00:12:34:56"
# testpmd's lcores: its main one (statistics, mostly asleep) and the one forwarding core, which
# busy-polls. --pin puts the back end on the main one's CPU, never on the forwarding core's.
BACKEND_CPU, FORWARD_CPU = 0, 1
VARIANTS = {}  # variant label -> --bounce string, chosen by main()

INJECT = r"""
import socket, sys, time
size, secs, mac = int(sys.argv[1]), float(sys.argv[2]), bytes.fromhex(sys.argv[3].replace(":", ""))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("tap0", 0))
frame = mac + bytes.fromhex("020000000001") + b"\x88\xb5" + bytes(size - 14)
end = time.monotonic() + secs
n = 0
while time.monotonic() < end:
    for _ in range(256):
        try:
            s.send(frame)
            n += 1
        except OSError:
            pass
print(n)
"""


def die(msg):
    print(f"bench_net_dpdk: error: {msg}", file=sys.stderr)
    sys.exit(1)


def sh(*argv, check=True):
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def ns_exec(ns, *argv):
    return ["ip", "netns", "exec", ns, *argv]


def tap_counter(ns, name):
    r = sh(*ns_exec(ns, "cat", f"/sys/class/net/tap0/statistics/{name}"))
    return int(r.stdout.strip())


def cpu_seconds(pid):
    """User + system CPU time of a process so far, all its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pps_lines(text, key):
    return [int(x) for x in re.findall(rf"{key}:\s+(\d+)", text)]


def split_variant(key):
    """(binary, bounce options) of a variant key: "VARIANT" or "LABEL:VARIANT"."""
    label, _, v = key.rpartition(":")
    return BINS[label], VARIANTS[v]


BINS = {}


def sample(variant, size, direction, args, work):
    ns = f"bvmdpdk{os.getpid()}"
    sock = work / "net.sock"
    if sock.exists():
        sock.unlink()
    sh("ip", "netns", "add", ns)
    backend = testpmd = None
    try:
        sh(*ns_exec(ns, "ip", "link", "set", "lo", "up"))
        binary, bounce = split_variant(variant)
        backend = subprocess.Popen(
            ns_exec(ns, str(binary), "net", "--socket", str(sock), "--tap", "tap0",
                    "--mac", MAC, "--bounce", bounce),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=(lambda: os.sched_setaffinity(0, {BACKEND_CPU})) if args.pin else None)
        deadline = time.monotonic() + 10
        while not sock.exists():
            if backend.poll() is not None or time.monotonic() > deadline:
                die(f"bouncevm-vhost net did not start: {backend.stderr.read().decode().strip()}")
            time.sleep(0.02)
        sh(*ns_exec(ns, "ip", "link", "set", "tap0", "up"))
        mode = ["--forward-mode=txonly", f"--txpkts={size}"] if direction == "tx" \
            else ["--forward-mode=rxonly"]
        argv = ["dpdk-testpmd", "-l", f"{BACKEND_CPU},{FORWARD_CPU}", "--no-huge", "-m", "1024", "--no-pci",
                "--file-prefix", f"bvm{os.getpid()}",
                f"--vdev=net_virtio_user0,path={sock},queues=1", "--", *mode,
                "--stats-period", "1", "--auto-start", "--nb-cores=1",
                "--total-num-mbufs=16384"]
        testpmd = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(testpmd.stdout), daemon=True)
        reader.start()
        # On a loaded machine testpmd can take seconds to start forwarding: the warm-up
        # counts from its first statistics line, not from its start.
        deadline = time.monotonic() + 60
        while not any("-pps" in ln for ln in list(lines)):
            if testpmd.poll() is not None:
                reader.join(timeout=5)
                die(f"dpdk-testpmd exited: {''.join(lines)[-2000:]}")
            if time.monotonic() > deadline:
                die("dpdk-testpmd printed no statistics within 60 s")
            time.sleep(0.1)
        time.sleep(args.warmup)
        inj = None
        if direction == "rx":
            inj = subprocess.Popen(
                ns_exec(ns, sys.executable, "-c", INJECT, str(size), str(args.seconds), MAC),
                stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
        window = args.seconds - (1.0 if inj else 0)
        rec = None
        if args.perf_dir:
            out_file = Path(args.perf_dir) / f"{variant.replace(':', '-')}-{direction}-{size}-{os.getpid()}-{time.monotonic_ns()}.data"
            # cpu-clock: works without hardware counters (a VM's guest often has none).
            rec = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "5000", "-g",
                                    "-o", str(out_file), "-p", str(backend.pid),
                                    "--", "sleep", str(window)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before, t0 = tap_counter(ns, "rx_packets"), time.monotonic()
        cpu0 = cpu_seconds(backend.pid)
        first_line = len(lines)
        time.sleep(window)
        after, t1 = tap_counter(ns, "rx_packets"), time.monotonic()
        cpu1 = cpu_seconds(backend.pid)
        last_line = len(lines)
        if rec:
            rec.wait(timeout=60)
        if inj:
            inj.wait(timeout=args.seconds + 10)
        testpmd.send_signal(signal.SIGINT)
        try:
            testpmd.wait(timeout=20)
        except subprocess.TimeoutExpired:
            testpmd.kill()
            testpmd.wait()
        reader.join(timeout=5)
        key = "Tx-pps" if direction == "tx" else "Rx-pps"
        # Per-second rates printed during the measured window.
        rates = pps_lines("".join(lines[first_line:last_line]), key)
        testpmd_pps = statistics.median(rates) if rates else 0.0
        fps = (after - before) / (t1 - t0) if direction == "tx" else testpmd_pps
        if fps <= 0:
            # Never a row of zeros and nan: a sample that measured nothing is an error.
            die(f"{direction} {size} B {variant}: no frames in the {window:g} s window"
                + ("" if direction == "tx" or rates else f" (testpmd printed no {key} line in it)"))
        # Backend CPU per frame: steadier than frames/s on a loaded machine.
        cpu_us = (cpu1 - cpu0) * 1e6 / (fps * (t1 - t0))
        return {"fps": fps, "testpmd_pps": testpmd_pps, "cpu_us": cpu_us}
    finally:
        for p in (testpmd, backend):
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        sh("ip", "netns", "del", ns, check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--sizes", default="64,1500")
    ap.add_argument("--variants", default="off,swiotlb,iova")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=OPTS",
                    help="also run bouncevm-vhost with --bounce OPTS, as row LABEL (repeatable)")
    ap.add_argument("--no-rx", action="store_true")
    ap.add_argument("--pin", action="store_true",
                    help=f"run the back end on CPU {BACKEND_CPU}, beside testpmd's mostly idle main "
                         f"core, off its busy-polling forwarding core (CPU {FORWARD_CPU})")
    ap.add_argument("--json")
    ap.add_argument("--backend-bin", action="append", default=[], metavar="LABEL=PATH",
                    help="run the variants on this bouncevm-vhost binary (repeatable; replaces "
                         "the --profile build: label that one too to compare against it)")
    ap.add_argument("--perf-dir", help="also `perf record -g` the backend over each measured window, "
                                       "one file per sample in this directory")
    ap.add_argument("--profile", choices=builds.PROFILES, default="dist",
                    help="the cargo profile whose bouncevm-vhost runs without --backend-bin "
                         "(default dist)")
    args = ap.parse_args()
    try:
        VARIANTS.update(bounce_variants.select(args.variants.split(","), args.variant))
    except ValueError as e:
        die(str(e))
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1:
        die("--seconds must be positive, --warmup not negative, --rounds at least 1")
    if not args.no_rx and args.seconds < 2:
        die("--seconds must be at least 2 when RX is measured (its window is --seconds - 1 and "
            "testpmd reports once a second); add --no-rx to measure TX alone")
    if args.pin and not {BACKEND_CPU, FORWARD_CPU} <= os.sched_getaffinity(0):
        die(f"--pin needs CPUs {BACKEND_CPU} and {FORWARD_CPU} (this machine: "
            f"{sorted(os.sched_getaffinity(0))})")
    if os.geteuid() != 0:
        die("needs root (network namespaces, tap)")
    if args.perf_dir:
        if not shutil.which("perf"):
            die("--perf-dir needs perf: apt-get install linux-perf")
        try:
            Path(args.perf_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            die(f"--perf-dir {args.perf_dir}: {e}")
    if not shutil.which("dpdk-testpmd"):
        die("dpdk-testpmd is missing: apt-get install --no-install-recommends dpdk-dev librte-net-virtio23")
    for spec in args.backend_bin:
        label, eq, path = spec.partition("=")
        if not eq or not label or ":" in label or not Path(path).is_file():
            die(f"--backend-bin {spec!r}: expected LABEL=PATH of an existing binary")
        BINS[label] = Path(path).resolve()
    if not BINS:
        vhost = builds.bin_dir(args.profile) / "bouncevm-vhost"
        if not vhost.exists():
            die(f"{vhost} is missing: {builds.build_command(args.profile, 'bouncevm-vhost')}")
        BINS[""] = vhost
    sizes = [int(s) for s in args.sizes.split(",")]
    base_variants = list(VARIANTS)
    variants = [f"{b}:{v}" if b else v for b in BINS for v in base_variants]
    dirs = ["tx"] if args.no_rx else ["tx", "rx"]
    work = Path(tempfile.mkdtemp(prefix="bench-net-dpdk-"))
    samples = {}
    try:
        # The first testpmd start of a run is slow (it maps and touches its 1 GiB of memory
        # for the first time): one sample that is thrown away, so round 1 starts like the others.
        m = sample(variants[0], sizes[0], "tx", args, work)
        print(f"warm-up sample (discarded): {m['fps']:,.0f} frames/s", file=sys.stderr)
        for r in range(args.rounds):
            for d in dirs:
                for size in sizes:
                    order = variants[r % len(variants):] + variants[:r % len(variants)]
                    for v in order:
                        m = sample(v, size, d, args, work)
                        samples.setdefault((d, size, v), []).append(m)
                        print(f"round {r + 1}/{args.rounds} {d} {size} B {v}: {m['fps']:,.0f} frames/s "
                              f"(testpmd {m['testpmd_pps']:,.0f}), backend {m['cpu_us']:.2f} us CPU/frame",
                              file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nDPDK virtio_user -> bouncevm-vhost net, {args.seconds:g} s per sample after "
          f"{args.warmup:g} s warm-up, {args.rounds} interleaved rounds; load average at the end "
          f"{load[0]:.1f} ({os.cpu_count()} CPUs)")
    print(f"testpmd forwards on CPU {FORWARD_CPU}; the back end "
          + (f"is pinned to CPU {BACKEND_CPU}" if args.pin else "runs where the scheduler puts it"))
    print("| direction | frame | variant | median frames/s | min-max | vs off "
          "| backend CPU us/frame | min-max | vs off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in dirs:
        for size in sizes:
            for v in variants:
                off_key = (d, size, v.rpartition(":")[0] + (":" if ":" in v else "") + "off")
                off = statistics.median(s["fps"] for s in samples[off_key]) \
                    if off_key in samples else None
                off_cpu = statistics.median(s["cpu_us"] for s in samples[off_key]) \
                    if off_key in samples else None
                xs = [s["fps"] for s in samples[(d, size, v)]]
                med = statistics.median(xs)
                ratio = f"{med / off:.2f}x" if off else "-"
                cs = [s["cpu_us"] for s in samples[(d, size, v)]]
                cmed = statistics.median(cs)
                # CPU per frame: lower is better, so the ratio is off / this (>1 = cheaper).
                cratio = f"{off_cpu / cmed:.2f}x" if off_cpu and cmed else "-"
                print(f"| {d} | {size} B | {v} | {med:,.0f} | {min(xs):,.0f}-{max(xs):,.0f} | {ratio} "
                      f"| {cmed:.2f} | {min(cs):.2f}-{max(cs):.2f} | {cratio} |")
    for line in bounce_variants.defined_lines(VARIANTS):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"dir": d, "size": s, "variant": v, "bounce": split_variant(v)[1], "pin": args.pin,
              **m}
             for (d, s, v), ms in samples.items() for m in ms], indent=1))


if __name__ == "__main__":
    main()
