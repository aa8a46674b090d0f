#!/usr/bin/env python3
"""Side-by-side vhost-user-blk figures at host speed: bouncevm-load against qemu-storage-daemon
and bouncevm-vhost blk (bounce off / forced swiotlb / forced iova), interleaved rounds, medians.

    python3 tests/e2e/bench_host.py [--rounds 3] [--runtime 5] [--jobs 1,2] [--disks file,mem]
                                    [--variants qsd,off,swiotlb,iova,swiotlb-untimed,iova-untimed]
                                    [--variant LABEL=OPTS ...]
                                    [--size 1G] [--file-dir /var/tmp] [--json OUT]
                                    [--backend-bin NAME=PATH ...] [--pin 1:0]
                                    [--profile dist|release]

Same client, same image, same cache mode for every variant: qemu-storage-daemon runs with
cache.direct=on,aio=io_uring (O_DIRECT), bouncevm-vhost with `--cache none --aio io_uring`
(a binary without those flags would read through the page cache: the table says so). "file" is a fully written raw image on a real filesystem (--file-dir,
default /var/tmp); "mem" is the same on tmpfs (/dev/shm). Workload: 4 KiB randread, iodepth
32 per job, 1 and 2 jobs (one queue each). Each round runs every variant once, in a rotated
order; the table gives median [min-max] IOPS over the rounds, ratios of medians vs qsd and
vs bounce off, the back end's CPU time per I/O (user + system of the whole process,
io_uring workers included: steadier than IOPS on a loaded machine) and the part of it in the
io_uring workers, the load generator's CPU per I/O, and the CPU ceiling: the IOPS the
machine's CPUs allow at those costs, and its ratio to off. Variants: qsd, off,
swiotlb, iova, and swiotlb-untimed / iova-untimed (the pool's time accounting off,
bounce option timing=off), and swiotlb with the reusing allocators
(swiotlb-magazine, swiotlb-areas-lifo, swiotlb-magazine-untimed), and each mode with the
other's copy rule on map (iova-copy-in: iova copying every original in, as swiotlb does;
swiotlb-magazine-no-copy-in: swiotlb copying in only what the device reads, as VDUSE does).
--variant LABEL=OPTS (repeatable) adds a row LABEL of bouncevm-vhost with `--bounce OPTS`
after the named ones: any bounce setting, or an A/A twin of a named one (the same pool under
another string) to see how far apart two identical set-ups land in this run.
--backend-bin NAME=PATH
(repeatable) runs every bouncevm-vhost variant with each of those binaries too, in the same
rounds (rows "VARIANT@NAME", ratios against the same binary's "off"): two builds side by side
with the same load generator (ours, of the --profile build). --pin BACKEND_CPUS:LOAD_CPUS (e.g.
1:0) runs every back end, qsd and ours alike, io_uring workers included, on the first CPUs and
the load generator on the others: the scheduler then no longer moves the three kinds of thread
about, and a row's rounds repeat more closely. A benchmark, not a test: run it on a quiet
machine and report the spread. The binaries are the dist build (Cargo.toml's [profile.dist], the
build to ship), --profile release the tests' build. Build first:
cargo build --profile dist -p bouncevm-vhost -p bouncevm-load.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bounce_variants
import builds

# The variants --variants may name: qemu-storage-daemon and our back end with each bounce setting.
KNOWN = {"qsd": None, **bounce_variants.VARIANTS}
VARIANTS = {}  # variant label -> --bounce string (None: qsd), chosen by main()


def die(msg):
    print(f"bench_host: error: {msg}", file=sys.stderr)
    sys.exit(1)


def wait_socket(path, proc, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            die(f"{what} exited with {proc.returncode}: {proc.stderr.read().decode(errors='replace').strip()}")
        if path.exists():
            # bouncevm-load retries while the listener is not ready yet.
            return
        time.sleep(0.02)
    die(f"{what} did not create {path}")


def ours_flags(vhost):
    """The cache/aio flags bouncevm-vhost blk supports, and the cache mode that gives."""
    out = subprocess.run([str(vhost), "blk", "--help"], capture_output=True,
                         text=True, check=True).stdout
    flags, mode = [], "page cache (bouncevm-vhost has no --cache yet)"
    if "--cache" in out:
        flags += ["--cache", "none"]
        mode = "cache=none (O_DIRECT)"
    if "--aio" in out:
        flags += ["--aio", "io_uring"]
    return flags, mode


def split_variant(label):
    """'swiotlb@main' -> ('swiotlb', 'main'); 'swiotlb' -> ('swiotlb', None)."""
    v, _, b = label.partition("@")
    return v, (b or None)


def parse_cpus(text, what):
    """A CPU list as taskset takes it ("1", "0-1", "0,2"), checked against the CPUs this
    script may use."""
    cpus = set()
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            die(f"--pin: bad CPU list '{text}' for the {what}")
        if a > b:
            die(f"--pin: bad CPU range '{part}' for the {what}")
        cpus.update(range(a, b + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        die(f"--pin: CPUs {sorted(cpus - allowed)} of the {what} are not available "
            f"(this machine: {sorted(allowed)})")
    return cpus


def parse_pin(spec):
    """--pin BACKEND_CPUS:LOAD_CPUS -> (backend cpus, load generator cpus), or (None, None)."""
    if spec is None:
        return None, None
    back, sep, load = spec.partition(":")
    if not sep:
        die(f"--pin: expected BACKEND_CPUS:LOAD_CPUS, got '{spec}'")
    return parse_cpus(back, "back end"), parse_cpus(load, "load generator")


def pinned(cpus):
    """A preexec_fn placing the child on `cpus` (threads it creates later, io_uring workers
    included, inherit the mask), or None."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def start(label, img, sock, queues, backends, cpus=None):
    variant, bin_name = split_variant(label)
    if sock.exists():
        sock.unlink()
    if variant == "qsd":
        argv = ["qemu-storage-daemon", "--blockdev",
                f"driver=file,node-name=f0,filename={img},cache.direct=on,aio=io_uring",
                "--export",
                f"type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={sock},"
                f"writable=on,num-queues={queues}"]
    else:
        vhost, extra, _ = backends[bin_name]
        argv = [str(vhost), "blk", "--socket", str(sock), "--file", str(img),
                "--queues", str(queues), "--bounce", VARIANTS[variant]] + extra
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=pinned(cpus))
    wait_socket(sock, p, label)
    return p


def stop(p):
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def stat_ticks(stat):
    """User + system clock ticks from a /proc .../stat file (a process: all its threads)."""
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_seconds(pid):
    """User + system CPU time of a process so far, all its threads (io_uring workers too)."""
    return stat_ticks(f"/proc/{pid}/stat") / os.sysconf("SC_CLK_TCK")


def thread_runtimes(pid):
    """{tid: (name, ns on a CPU so far)} of the process's threads alive now, from the
    scheduler's own count (/proc/PID/task/TID/schedstat, nanoseconds; /proc's stat ticks are
    10 ms apart)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[task.name] = ((task / "comm").read_text().strip(),
                              int((task / "schedstat").read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue  # the thread exited meanwhile
    return out


def workers_share(pid, running, every=0.05):
    """Share of the back end's CPU time spent in its io_uring worker threads (`iou-wrk-*`,
    `iou-sqp-*`) while running() holds, or None if its threads spent no time on a CPU then.
    The threads are read every `every` seconds and each one's last reading counts: workers
    come and go, and they exit with the ring when the front end disconnects, so they cannot be
    read after the run (a worker's last moments before it exits are missed)."""
    first = thread_runtimes(pid)
    last = dict(first)
    while running():
        time.sleep(every)
        last.update(thread_runtimes(pid))
    spent = {tid: ns - first.get(tid, ("", 0))[1] for tid, (_, ns) in last.items()}
    total = sum(spent.values())
    workers = sum(ns for tid, ns in spent.items() if last[tid][0].startswith("iou-"))
    return workers / total if total > 0 else None


def children_cpu_seconds():
    """User + system CPU time of this script's waited-for children so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(variant, img, sock, jobs, args, backends):
    p = start(variant, img, sock, max(args.jobs), backends, args.pin_backend)
    try:
        argv = [str(args.bin_dir / "bouncevm-load"), "--socket", str(sock), "--json", "--rw", "randread",
                "--bs", "4k", "--iodepth", "32", "--numjobs", str(jobs),
                "--runtime", str(args.runtime), "--size", args.size]
        cpu0, load0 = cpu_seconds(p.pid), children_cpu_seconds()
        deadline = time.monotonic() + args.runtime + 60
        # Its output goes to files: the io_uring workers' share is read while it runs, from
        # its start to its exit (connection set-up included, a few ms).
        with tempfile.TemporaryFile("w+") as outf, tempfile.TemporaryFile("w+") as errf:
            load = subprocess.Popen(argv, stdout=outf, stderr=errf, text=True,
                                    preexec_fn=pinned(args.pin_load))
            share = workers_share(p.pid, lambda: load.poll() is None
                                  and time.monotonic() < deadline)
            if load.poll() is None:
                load.kill()
                load.wait()
                die(f"{variant}: bouncevm-load did not finish")
            outf.seek(0)
            errf.seek(0)
            out, err = outf.read(), errf.read()
        cpu1, load1 = cpu_seconds(p.pid), children_cpu_seconds()
        if load.returncode != 0:
            die(f"{variant}: {err.strip()}")
        rep = json.loads(out)
        t = rep["total"]["read"]
        ios = t["iops"] * args.runtime

        def per_io(seconds):
            return seconds * 1e6 / ios if ios else float("nan")

        # Backend CPU per I/O (connection set-up included, a few ms): on a loaded machine it
        # varies far less than IOPS, which follow the scheduler. The share of it in io_uring
        # workers and the load generator's own CPU per I/O (the only child waited for
        # meanwhile) say where the time goes and what the machine's CPUs allow at most.
        cpu_us = per_io(cpu1 - cpu0)
        return {"iops": t["iops"], "p50_us": t["lat_ns"]["p50"] / 1000,
                "p99_us": t["lat_ns"]["p99"] / 1000,
                "cpu_us": cpu_us,
                # None (JSON null, "n/a" in the table): its threads were never seen on a CPU.
                "workers_cpu_us": cpu_us * share if share is not None else None,
                "load_cpu_us": per_io(load1 - load0)}
    finally:
        stop(p)


def make_image(path, size_bytes):
    """A fully written image: O_DIRECT reads of holes or unwritten extents never reach the disk."""
    if path.exists() and path.stat().st_size == size_bytes:
        return
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size_bytes >> 20):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def parse_size(s):
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().lower()
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def fmt_row(name, xs, ref_q, ref_off):
    med = statistics.median(xs)
    cells = [name, f"{med:,.0f}", f"{min(xs):,.0f}-{max(xs):,.0f}"]
    cells.append(f"{med / ref_q:.2f}x" if ref_q else "-")
    cells.append(f"{med / ref_off:.2f}x" if ref_off and name != "qsd" else "-")
    return cells


def median_measured(xs):
    """Median of the values that are not None; None if there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt_us(x):
    """Microseconds with two decimals, or n/a for a figure that could not be measured."""
    return "n/a" if x is None else f"{x:.2f}"


def parse_backend_bins(specs):
    """--backend-bin NAME=PATH (a bouncevm-vhost binary, or a directory holding one)."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or "@" in name or "," in name:
            die(f"bad --backend-bin '{spec}' (expected NAME=PATH)")
        if name in out:
            die(f"--backend-bin {name} given twice")
        p = Path(path)
        if p.is_dir():
            p = p / "bouncevm-vhost"
        if not (p.is_file() and os.access(p, os.X_OK)):
            die(f"--backend-bin {name}: {p} is not an executable")
        out[name] = p
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5, help="seconds per measurement")
    ap.add_argument("--jobs", default="1,2")
    ap.add_argument("--disks", default="file,mem")
    ap.add_argument("--variants", default="qsd,off,swiotlb,iova")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=OPTS",
                    help="also run bouncevm-vhost with --bounce OPTS, as row LABEL (repeatable)")
    ap.add_argument("--size", default="1G", help="image size (and --size of the load)")
    ap.add_argument("--file-dir", default="/var/tmp", help="a directory on a real filesystem")
    ap.add_argument("--json", help="also write every sample to this file")
    ap.add_argument("--backend-bin", action="append", default=[], metavar="NAME=PATH",
                    help="also run every bouncevm-vhost variant with this binary (or directory)")
    ap.add_argument("--pin", metavar="BACKEND_CPUS:LOAD_CPUS",
                    help="run every back end (qsd and ours alike) on BACKEND_CPUS and the load "
                         "generator on LOAD_CPUS, e.g. 1:0")
    ap.add_argument("--profile", choices=builds.PROFILES, default="dist",
                    help="the cargo profile whose bouncevm-load and bouncevm-vhost run (default dist)")
    args = ap.parse_args()
    args.bin_dir = builds.bin_dir(args.profile)
    args.pin_backend, args.pin_load = parse_pin(args.pin)
    args.jobs = [int(j) for j in args.jobs.split(",")]
    disks = args.disks.split(",")
    try:
        VARIANTS.update(bounce_variants.select(args.variants.split(","), args.variant, KNOWN))
    except ValueError as e:
        die(str(e))
    variants = list(VARIANTS)
    for d in disks:
        if d not in ("file", "mem"):
            die(f"unknown disk {d} (expected file, mem)")
    for b in ("bouncevm-load", "bouncevm-vhost"):
        if not (args.bin_dir / b).exists():
            die(f"{args.bin_dir / b} is missing: {builds.build_command(args.profile, b)}")
    if "qsd" in variants and not shutil.which("qemu-storage-daemon"):
        die("qemu-storage-daemon is not on PATH (apt-get install qemu-utils)")
    # bin name -> (bouncevm-vhost, its cache/aio flags, the cache mode they give)
    vhost = args.bin_dir / "bouncevm-vhost"
    backends = {None: (vhost,) + ours_flags(vhost)}
    for name, path in parse_backend_bins(args.backend_bin).items():
        backends[name] = (path,) + ours_flags(path)
    variants = [v if v == "qsd" or b is None else f"{v}@{b}"
                for v in variants for b in backends if not (v == "qsd" and b is not None)]
    ours_mode = "; ".join(sorted({m for _, _, m in backends.values()}))
    size = parse_size(args.size)

    work = Path(tempfile.mkdtemp(prefix="bench-host-"))
    imgs = {}
    for d in disks:
        base = Path(args.file_dir) if d == "file" else Path("/dev/shm")
        imgs[d] = base / f"bench-host-{os.getpid()}.img"
        print(f"writing {size >> 20} MiB image {imgs[d]} ...", file=sys.stderr)
        make_image(imgs[d], size)
    samples = {}
    try:
        for r in range(args.rounds):
            for d in disks:
                for j in args.jobs:
                    order = variants[r % len(variants):] + variants[:r % len(variants)]
                    for v in order:
                        m = measure(v, imgs[d], work / "vu.sock", j, args, backends)
                        samples.setdefault((d, j, v), []).append(m)
                        print(f"round {r + 1}/{args.rounds} {d} jobs={j} {v}: "
                              f"{m['iops']:,.0f} IOPS p50 {m['p50_us']:.0f} us p99 {m['p99_us']:.0f} us, "
                              f"backend {m['cpu_us']:.2f} us CPU/IO "
                              f"({fmt_us(m['workers_cpu_us'])} in io_uring workers), "
                              f"load gen {m['load_cpu_us']:.2f}",
                              file=sys.stderr)
    finally:
        for p in imgs.values():
            p.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)

    # The CPUs the processes may use. Pinned to disjoint sets, each side is bounded by its
    # own CPUs; otherwise both share them all.
    cpus = (args.pin_backend | args.pin_load) if args.pin else os.sched_getaffinity(0)
    ncpu = len(cpus)
    apart = bool(args.pin) and not args.pin_backend & args.pin_load
    if apart:
        ceiling_rule = (f"the smaller of {len(args.pin_backend)} CPU(s) / back-end CPU per I/O "
                        f"and {len(args.pin_load)} / load-generator CPU per I/O (medians)")
    else:
        ceiling_rule = (f"{ncpu} CPUs divided by the medians of back-end plus load-generator "
                        "CPU per I/O")

    def ceiling(ss):
        back = statistics.median(s["cpu_us"] for s in ss)
        load = statistics.median(s["load_cpu_us"] for s in ss)
        if apart:
            if back <= 0 or load <= 0:
                return float("nan")
            return min(len(args.pin_backend) * 1e6 / back, len(args.pin_load) * 1e6 / load)
        return ncpu * 1e6 / (back + load) if back + load > 0 else float("nan")

    load = os.getloadavg()
    print(f"\n4 KiB randread, iodepth 32 per job, {args.runtime} s per sample, {args.rounds} "
          f"interleaved rounds, image {args.size}; load average at the end {load[0]:.1f} "
          f"({ncpu} CPUs)")
    print(f"qsd: cache.direct=on,aio=io_uring; bouncevm-vhost: {ours_mode}")
    if args.pin:
        print(f"pinned: every back end on CPUs {sorted(args.pin_backend)}, the load generator "
              f"on CPUs {sorted(args.pin_load)}")
    print("| disk | jobs | variant | median IOPS | min-max | vs qsd | vs off "
          "| backend CPU us/IO | min-max | in io_uring workers | load gen CPU us/IO "
          "| CPU ceiling (IOPS) | ceiling vs off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in disks:
        for j in args.jobs:
            med = {v: statistics.median(s["iops"] for s in samples[(d, j, v)]) for v in variants}
            ceil = {v: ceiling(samples[(d, j, v)]) for v in variants}
            for v in variants:
                ss = samples[(d, j, v)]
                b = split_variant(v)[1]
                off = "off" if b is None else f"off@{b}"
                cells = fmt_row(v, [s["iops"] for s in ss], med.get("qsd"), med.get(off))
                cs = [s["cpu_us"] for s in ss]
                cells += [f"{statistics.median(cs):.2f}", f"{min(cs):.2f}-{max(cs):.2f}",
                          fmt_us(median_measured(s["workers_cpu_us"] for s in ss)),
                          f"{statistics.median(s['load_cpu_us'] for s in ss):.2f}",
                          f"{ceil[v]:,.0f}",
                          f"{ceil[v] / ceil[off]:.2f}x" if off in ceil and v != "qsd" else "-"]
                print(f"| {d} | {j} | " + " | ".join(cells) + " |")
    print(f"Ceiling: {ceiling_rule}, the IOPS the machine could reach if its CPUs were kept "
          "busy and nothing else ran; its ratio to off bounds the bounced variants' ratio "
          "whenever the run is CPU-bound.")
    if any(s["workers_cpu_us"] is None for ss in samples.values() for s in ss):
        print("n/a in io_uring workers: no thread of the back end showed time on a CPU in "
              "/proc/PID/task/TID/schedstat while the load ran (a kernel without "
              "CONFIG_SCHED_INFO has no such file).")
    for line in bounce_variants.defined_lines(VARIANTS, KNOWN):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cache_ours": ours_mode, "runtime": args.runtime, "rounds": args.rounds,
             "pin": args.pin, "bounce": VARIANTS,
             "backend_bins": {k: str(v[0]) for k, v in backends.items() if k},
             "samples": [{"disk": d, "jobs": j, "variant": v, **s}
                         for (d, j, v), ss in samples.items() for s in ss]}, indent=1))


if __name__ == "__main__":
    main()
