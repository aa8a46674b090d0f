"""Live swiotlb trace capture: a rig-1 guest booted with swiotlb=<slots>,<areas>,force records
every swiotlb decision of its own kernel while fio runs on a bouncing disk (ACCESS_PLATFORM on),
writes the trace in the kernel-trace format to a second, non-bouncing disk, and a replay must
reproduce every decision of the live kernel -- 0 mismatches.

- Stock Debian 6.12 kernel, kprobes (swiotlb-kernel-trace/1): `bounce-replay --compare`
  reproduces each returned bounce address, each "buffer is full", and the area's used count and
  rolling index after each map.
- The same kernel through its `dma:` trace events instead of kprobes (bvm.capture=dma-events):
  `bounce-replay --compare` reproduces each address and failure (no area state in the events).
- The kernel of images/build-dynamic-kernel.sh (CONFIG_SWIOTLB_DYNAMIC=y) with a pool small
  enough that fio makes it grow (swiotlb-kernel-trace/2: transient pools, added pools, growth
  requests, the allocator's counters at every map): bounce/traces/check_trace.py (Linux's rules
  in Python, bounce/docs/dynamic-swiotlb.md) reproduces every decision, pool and counter.
- Without a VM: every trace committed under bounce/traces/ checks with 0 mismatches, and a
  dynamic trace whose pool additions are moved one map earlier or later does not.

The guest side is images/swiotlb-capture.sh (bvm.test=swiotlb-capture). The test appends a
second cpio archive holding the repository's images/init and the capture script to the built
initramfs (Linux unpacks it over the first), so it runs the checked-out scripts even when the
cached image predates them, and never rebuilds the shared image.

Binaries: `$BVM_VHOST` / `$BVM_REPLAY`, else target/release/{bouncevm-vhost,bounce-replay}
(`$CARGO_TARGET_DIR` honoured); missing ones skip the test with the reason.

Also a command line, which made the traces committed under bounce/traces/ (see its README):

    python3 tests/e2e/test_trace_capture.py --name NAME --append "swiotlb=256,1,force" \\
        [--dynamic] [--smp N] [--tcg single] [--param iodepth=32 ...] --out TRACE.jsonl.gz
"""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import rig1
from rig1 import (Backend, Guest, blk_builtin, blk_vhost_user, images, make_raw_image, out_path,
                  require_binary, require_qemu, require_root, skip_if_missing)

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "bounce" / "traces"
SLOTS = 1024  # small enough that 256 KiB requests at depth 16 fill it: failures get replayed too
# Counts of the capture that must be 0 for an exact trace (BVM-RESULT keys). A skipped unmap
# kprobe ("missed") is restored from dma:dma_unmap_page; one that is not ("unrecovered"), or an
# address handed out again while the trace still holds it ("reused"), makes the trace inexact.
EXACT = ("unmatched", "unpaired", "interleaved", "pending", "live", "lost", "unrecovered",
         "reused", "unparsed")
EXACT_DYNAMIC = ("head_mismatch", "unknown_pool", "unknown_free", "unpaired_apool",
                 "apool_unexpected")


def _check_trace_module():
    spec = importlib.util.spec_from_file_location("check_trace", TRACES / "check_trace.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_trace"] = mod
    spec.loader.exec_module(mod)
    return mod


check_trace = _check_trace_module()


def _cpio_newc(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A newc cpio archive of regular files {path: (data, mode)} (parent directories included)."""
    out = bytearray()
    ino = 0x4000

    def entry(name: str, mode: int, data: bytes) -> None:
        nonlocal ino
        ino += 1
        nb = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0]
        out.extend(b"070701" + b"".join(b"%08X" % f for f in fields) + nb)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    dirs = sorted({str(Path(p).parents[i]) for p in files for i in range(len(Path(p).parts) - 1)}
                  - {"."})
    for d in dirs:
        entry(d, 0o040755, b"")
    for path, (data, mode) in files.items():
        entry(path, 0o100000 | mode, data)
    entry("TRAILER!!!", 0, b"")
    out.extend(b"\0" * (-len(out) % 512))
    return bytes(out)


def _capture_initramfs() -> Path:
    """The built initramfs with the repository's init and capture script laid over it."""
    base = images().initramfs.read_bytes()
    overlay = _cpio_newc({
        "init": ((REPO / "images" / "init").read_bytes(), 0o755),
        "usr/lib/bvm/swiotlb-capture.sh": ((REPO / "images" / "swiotlb-capture.sh").read_bytes(),
                                           0o755),
    })
    path = out_path("trace_capture", ".initramfs.cpio")
    path.write_bytes(base + b"\0" * (-len(base) % 4) + overlay)
    return path


@dataclass(frozen=True)
class DynamicKernel:
    vmlinuz: Path
    release: str
    visible_at: str


def dynamic_kernel() -> DynamicKernel:
    """images/build-dynamic-kernel.sh's kernel (built on first use, cached after)."""
    try:
        r = subprocess.run(["bash", str(REPO / "images" / "build-dynamic-kernel.sh")],
                           capture_output=True, text=True, timeout=4 * 3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise rig1.Missing(f"images/build-dynamic-kernel.sh failed: {e}")
    kv = dict(line.split("=", 1) for line in r.stdout.splitlines() if line.startswith("DYN_"))
    if r.returncode != 0 or "DYN_VMLINUZ" not in kv:
        raise rig1.Missing(f"images/build-dynamic-kernel.sh failed (rc={r.returncode}): "
                           f"{r.stderr.strip()[-500:]}")
    return DynamicKernel(Path(kv["DYN_VMLINUZ"]), kv["DYN_KERNEL_RELEASE"], kv["DYN_VISIBLE_AT"])


class _CaptureGuest(Guest):
    """A rig-1 guest with the overlay initramfs and, optionally, another kernel and TCG mode."""

    def __init__(self, *a, initrd: Path, kernel: Path | None = None, tcg: str | None = None, **kw):
        super().__init__(*a, **kw)
        self.initrd, self.kernel, self.tcg = initrd, kernel, tcg

    def argv(self) -> list[str]:
        a = super().argv()
        a[a.index("-initrd") + 1] = str(self.initrd)
        if self.kernel is not None:
            a[a.index("-kernel") + 1] = str(self.kernel)
        if self.tcg is not None:
            a[a.index("-accel") + 1] = f"tcg,thread={self.tcg}"
        return a


def _read_trace_disk(img: Path) -> bytes:
    with open(img, "rb") as f:
        head = f.read(4096)
        words = head.split(b"\n", 1)[0].split()
        assert len(words) == 3 and words[0] == b"BVMTRACE1", f"no trace on the trace disk: {head[:80]!r}"
        n, want = int(words[1]), words[2].decode()
        gz = f.read(n)
    assert len(gz) == n and hashlib.sha256(gz).hexdigest() == want, "trace disk checksum differs"
    return gz


@dataclass
class Capture:
    result: dict          # the BVM-RESULT line's fields
    path: Path            # the trace (gzip)
    lines: list[str]      # its JSON lines
    header: dict
    describe: str         # the guest run, for failure messages


def capture(name: str, append: str, params: dict, *, dynamic: DynamicKernel | None = None,
            smp: int = 1, tcg: str | None = None, backend: str = "vhost",
            timeout: float = 300) -> Capture:
    """Boots a capture guest and returns its trace, after asserting that the capture is exact
    (no lost, unpaired or interleaved event; on a dynamic kernel no pool event it could not
    place). backend: "vhost" (bouncevm-vhost, ACCESS_PLATFORM offered) or "builtin" (QEMU's
    virtio-blk with iommu_platform=on). One vCPU by default: installing kprobes patches kernel
    text, and under multi-threaded TCG a second vCPU can run a stale copy of patched code
    (ENVIRONMENT.md, rig 2 int3); several vCPUs need tcg="single"."""
    require_root()
    require_qemu()
    images()
    initrd = _capture_initramfs()
    disk = make_raw_image(out_path(f"{name}_disk", ".img"), "128M")
    trace_img = make_raw_image(out_path(f"{name}_out", ".img"), "64M")
    params = dict(params)
    if dynamic is not None:
        params.setdefault("visible_at", dynamic.visible_at)
    kw = dict(initrd=initrd, params=params, append=append, timeout=timeout, smp=smp, tcg=tcg,
              kernel=dynamic.vmlinuz if dynamic else None)
    trace_dev = blk_builtin(trace_img, id="trace", extra=",serial=bvmtrace")
    if backend == "vhost":
        vhost = require_binary("bouncevm-vhost", "BVM_VHOST")
        sock = out_path(name, ".sock")
        with Backend(name, [vhost, "blk", "--socket", str(sock), "--file", str(disk),
                            "--format", "raw"], socket=sock):
            run = _CaptureGuest(name, "swiotlb-capture", devices=blk_vhost_user(
                sock, num_queues=1, iommu=True) + trace_dev, **kw).run()
    else:
        # one queue, as the vhost-user disk: every map and unmap under one virtqueue lock
        run = _CaptureGuest(name, "swiotlb-capture", devices=blk_builtin(
            disk, iommu=True, extra=",num-queues=1") + trace_dev, **kw).run()
    r = run.ok("swiotlb-capture")
    exact = EXACT + (EXACT_DYNAMIC if dynamic is not None else ())
    for k in exact:
        assert r.get(k) == "0", f"capture is not exact: {k}={r.get(k)}\n{run.describe()}"
    gz = _read_trace_disk(trace_img)
    path = out_path(name, ".jsonl.gz")
    path.write_bytes(gz)
    lines = gzip.decompress(gz).decode().splitlines()
    header = json.loads(lines[0])
    assert header["op"] == "header", header
    assert header["counts"]["map"] == int(r["maps"]) == sum('"op":"map"' in l for l in lines)
    assert header["debugfs_before"]["io_tlb_used"] == 0, "the pool was not empty when tracing began"
    return Capture(r, path, lines, header, run.describe())


def replay(trace: Path) -> dict:
    """bounce-replay --compare --quiet on a trace: its final JSON report (asserting exit 0)."""
    exe = require_binary("bounce-replay", "BVM_REPLAY")
    p = subprocess.run([exe, str(trace), "--compare", "--quiet"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"bounce-replay rc={p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def _assert_replayed(c: Capture, report: dict) -> None:
    s = report["replay"]
    maps = int(c.result["maps"])
    assert s["compared"] == maps, s
    assert s["mismatches"] == 0, s
    assert s["maps"] + s["pool_full"] == maps and s["pool_full"] == int(c.result["failed"]), s
    assert (s["map_errors"], s["other_errors"]) == (0, 0), s
    assert report["live_at_end"] == 0 and report["pool"]["used"] == 0, report


@skip_if_missing
def test_capture_fio_trace_and_replay_every_decision():
    """Every 97th unmap kprobe event is dropped (bvm.skip_unmap_probe), as the kernel drops a
    kprobe that fires inside another probe's handler: dma:dma_unmap_page must restore each one
    in its place, or the replay finds a slot still taken."""
    c = capture("trace_capture", f"swiotlb={SLOTS},1,force",
                {"runtime": 2, "size": "32M", "iodepth": 16, "bsrange": "512-256k",
                 "skip_unmap_probe": 97})
    r = c.result
    assert int(r["injected"]) >= int(r["unmaps"]) // 100, r
    assert int(r["recovered"]) == int(r["missed"]) >= int(r["injected"]), r
    assert (r["nslabs"], r["nareas"]) == (str(SLOTS), "1"), c.describe
    assert int(r["maps"]) > 1000, f"too few maps for a meaningful capture: {r}"
    assert c.header["nslabs"] == SLOTS and c.header["format"] == "swiotlb-kernel-trace/1"
    assert c.header["area_used_at_start"] == [0] and len(c.header["area_index_at_start"]) == 1
    _assert_replayed(c, replay(c.path))
    print(f"captured {r['maps']} maps ({r['failed']} buffer full), {r['unmaps']} unmaps; "
          f"replayed with 0 mismatches; trace {c.path}")


@skip_if_missing
def test_dma_events_capture_replays_every_address():
    """No kprobes: swiotlb:swiotlb_bounced + dma:dma_map_page/dma_unmap_page of the stock 6.12
    kernel carry the bounce address (dma_addr) and the failure; the replay reproduces both."""
    c = capture("trace_capture_dma_events", f"swiotlb={SLOTS},1,force",
                {"runtime": 2, "size": "32M", "iodepth": 16, "bsrange": "512-256k",
                 "capture": "dma-events"})
    r = c.result
    assert r["capture"] == "dma-events" and r["outside_default"] == "0", c.describe
    # 1 GiB guest: no "mapped [mem ...]" line, so the start comes from the bounce addresses
    assert r["start_source"] in ("dmesg", "inferred-exact"), r
    assert int(r["maps"]) > 1000, f"too few maps for a meaningful capture: {r}"
    assert '"kernel_area_used"' not in c.lines[1], "dma events carry no area state"
    _assert_replayed(c, replay(c.path))
    assert check_trace.check(str(c.path))["mismatches"] == 0


@skip_if_missing
def test_dynamic_capture_growth_every_decision():
    """CONFIG_SWIOTLB_DYNAMIC: a 256-slot default pool that fio at depth 16 with blocks up to
    256 KiB outgrows -- maps fail the pools, transient pools serve them, the worker adds pools."""
    dyn = dynamic_kernel()
    c = capture("trace_capture_dynamic", "swiotlb=256,1,force",
                {"runtime": 2, "size": "32M", "iodepth": 16, "bsrange": "512-256k"},
                dynamic=dyn)
    r, h = c.result, c.header
    assert h["format"] == "swiotlb-kernel-trace/2" and r["dynamic"] == "1", h
    assert int(r["pool_adds"]) >= 1 and int(r["transients"]) >= 1, r
    assert int(r["in_added"]) > 0 and int(r["in_transient"]) > 0, r
    assert int(r["transient_frees"]) == int(r["transients"]) - int(r["transient_search_failed"]), r
    assert h["debugfs_after"]["io_tlb_nslabs"] == 256 + int(r["added_nslabs"]), h
    assert h["debugfs_after"]["io_tlb_transient_nslabs"] == 0, h
    rep = check_trace.check(str(c.path))
    assert rep["mismatches"] == 0, rep
    assert rep["compared"] == int(r["maps"]) and rep["pool_add"] == int(r["pool_adds"]), rep
    print(f"dynamic: {r['maps']} maps, {r['pool_adds']} pools added, {r['transients']} transient "
          f"pools; 0 mismatches; trace {c.path}")


def _committed() -> list[Path]:
    return sorted(TRACES.glob("*.jsonl.gz"))


def test_committed_traces_check_with_no_mismatch():
    """Every trace under bounce/traces/ replays through Linux's rules with 0 mismatches, and
    is internally consistent (every unmap of a live map, every transient pool freed by its
    map's unmap, every pool addition after a growth request, counters as debugfs showed)."""
    traces = _committed()
    assert traces, "no trace under bounce/traces/"
    for t in traces:
        rep = check_trace.check(str(t))
        assert rep["mismatches"] == 0, (t.name, rep)
        assert rep["compared"] == rep["maps"] > 1000, (t.name, rep)


@skip_if_missing
def test_committed_traces_replay_with_no_mismatch():
    """bounce-replay --compare reproduces every committed trace: swiotlb-kernel-trace/1 through
    the static pool, /2 through bounce's dynamic pools (pools and their kinds, growth requests,
    transient pools, pool additions, counters), reaching the capture's own counts."""
    for t in _committed():
        with gzip.open(t, "rt") as f:
            header = json.loads(f.readline())
        s = replay(t)["replay"]
        assert s["mismatches"] == 0 and s["compared"] > 1000, (t.name, s)
        if header["format"] == "swiotlb-kernel-trace/2":
            c = header["counts"]
            got = (s["pools_added"], s["transient_pools"], s["grow_requests"], s["maps_in_added"])
            assert got == (c["pool_add"], c["transient_alloc"], c["grow_requests"],
                           c["maps_in_added"]), (t.name, s)


def _moved(ops: list[dict], which: int, step: int) -> list[dict]:
    """ops with the which-th pool_add moved `step` maps later (negative: earlier)."""
    ops = copy.deepcopy(ops)
    at = [i for i, o in enumerate(ops) if o["op"] == "pool_add"][which]
    add = ops.pop(at)
    maps = [i for i, o in enumerate(ops) if o["op"] == "map"]
    later = [i for i in maps if i >= at]
    earlier = [i for i in maps if i < at]
    dest = later[step - 1] + 1 if step > 0 else earlier[step]
    ops.insert(dest, add)
    return ops


def test_growth_applied_at_the_wrong_point_is_caught():
    """The dynamic traces pin each added pool to its place in the op stream: a replay that
    applies a pool addition one map early or one map late must disagree with the kernel."""
    dyn = [t for t in _committed() if '"swiotlb-kernel-trace/2"' in gzip.open(t, "rt").readline()]
    assert dyn, "no dynamic trace under bounce/traces/"
    tried = 0
    for t in dyn:
        ops = list(check_trace.read_ops(str(t)))
        header, ops = ops[0], ops[1:]
        nadd = sum(o["op"] == "pool_add" for o in ops)
        for which in range(nadd):
            for step in (-1, 1):
                try:
                    mutated = _moved(ops, which, step)
                except IndexError:
                    continue  # no map on that side
                rep = check_trace.Checker(header).run(iter(mutated))
                assert rep["mismatches"] > 0, f"{t.name}: pool_add #{which} moved {step:+d} map: no mismatch"
                tried += 1
    assert tried > 0


def main() -> int:
    ap = argparse.ArgumentParser(description="Capture one swiotlb trace in a rig-1 guest.")
    ap.add_argument("--name", required=True, help="name of the run (tests/out/NAME.*)")
    ap.add_argument("--append", required=True, help='kernel words, e.g. "swiotlb=256,1,force"')
    ap.add_argument("--dynamic", action="store_true", help="boot images/build-dynamic-kernel.sh's kernel")
    ap.add_argument("--smp", type=int, default=1)
    ap.add_argument("--tcg", choices=("multi", "single"), help="TCG threading (several vCPUs: single)")
    ap.add_argument("--backend", choices=("vhost", "builtin"), default="vhost")
    ap.add_argument("--param", action="append", default=[], metavar="K=V",
                    help="bvm.K=V for the capture (runtime, size, iodepth, bsrange, rw, numjobs, capture)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, help="copy the trace there")
    args = ap.parse_args()
    params = {"runtime": 2, "size": "32M", "iodepth": 16, "bsrange": "512-256k"}
    for p in args.param:
        k, _, v = p.partition("=")
        params[k] = v
    try:
        c = capture(args.name, args.append, params, dynamic=dynamic_kernel() if args.dynamic else None,
                    smp=args.smp, tcg=args.tcg, backend=args.backend, timeout=args.timeout)
    except rig1.Missing as e:
        print(f"test_trace_capture: {e}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_bytes(c.path.read_bytes())
    print(json.dumps({"result": c.result, "trace": str(args.out or c.path),
                      "bytes": c.path.stat().st_size, "header_counts": c.header["counts"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
