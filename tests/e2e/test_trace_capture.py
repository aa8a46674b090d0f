"""Live swiotlb trace capture (issue 9, point 6): a rig-1 guest with swiotlb=<slots>,1,force
records every swiotlb map and unmap of its own kernel with kprobes while fio runs on a
bouncevm-vhost vhost-user-blk disk (ACCESS_PLATFORM on, so the guest bounces), writes the
trace in the kernel-trace format to a second, non-bouncing disk, and `bounce-replay --compare`
must reproduce every decision of the live kernel: each returned bounce address, each "buffer is
full", and the area's used count and rolling index after each map -- 0 mismatches.

The guest side is images/swiotlb-capture.sh (bvm.test=swiotlb-capture). The test appends a
second cpio archive holding the repository's images/init and the capture script to the built
initramfs (Linux unpacks it over the first), so it runs the checked-out scripts even when the
cached image predates them, and never rebuilds the shared image.

Binaries: `$BVM_VHOST` / `$BVM_REPLAY`, else target/release/{bouncevm-vhost,bounce-replay}
(`$CARGO_TARGET_DIR` honoured); missing ones skip the test with the reason.
"""

import gzip
import hashlib
import json
import os
import subprocess
from pathlib import Path

import rig1
from rig1 import (Backend, Guest, blk_builtin, blk_vhost_user, images, make_raw_image, out_path,
                  require_qemu, require_root, skip_if_missing)

REPO = Path(__file__).resolve().parents[2]
SLOTS = 1024  # small enough that 256 KiB requests at depth 16 fill it: failures get replayed too


def _target_binary(name: str, env: str) -> str:
    candidates = [Path(os.environ[env])] if os.environ.get(env) else []
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    candidates += [target / "release" / name, REPO / "target" / "release" / name]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise rig1.Missing(f"no {name} binary (cargo build --release --bins, or set {env})")


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


class _OverlayGuest(Guest):
    def __init__(self, *a, initrd: Path, **kw):
        super().__init__(*a, **kw)
        self.initrd = initrd

    def argv(self) -> list[str]:
        a = super().argv()
        a[a.index("-initrd") + 1] = str(self.initrd)
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


@skip_if_missing
def test_capture_fio_trace_and_replay_every_decision():
    require_root()
    require_qemu()
    images()
    vhost = _target_binary("bouncevm-vhost", "BVM_VHOST")
    replay = _target_binary("bounce-replay", "BVM_REPLAY")
    initrd = _capture_initramfs()
    disk = make_raw_image(out_path("trace_capture_disk", ".img"), "128M")
    trace_img = make_raw_image(out_path("trace_capture_out", ".img"), "64M")
    sock = out_path("trace_capture", ".sock")
    backend = Backend("trace_capture", [vhost, "blk", "--socket", str(sock), "--file", str(disk),
                                        "--format", "raw"], socket=sock)
    with backend:
        guest = _OverlayGuest(
            "trace_capture", "swiotlb-capture", initrd=initrd,
            params={"runtime": 2, "size": "32M", "iodepth": 16, "bsrange": "512-256k"},
            devices=blk_vhost_user(sock, num_queues=1, iommu=True)
            + blk_builtin(trace_img, id="trace", extra=",serial=bvmtrace"),
            append=f"swiotlb={SLOTS},1,force", timeout=240,
            # One vCPU: installing kprobes patches kernel text, and under multi-threaded TCG a
            # second vCPU can run a stale copy of patched code (ENVIRONMENT.md, rig 2 int3).
            smp=1)
        run = guest.run()
    r = run.ok("swiotlb-capture")
    for k in ("unmatched", "unpaired", "interleaved", "pending", "live", "lost", "missed",
              "unparsed"):
        assert r[k] == "0", f"capture is not exact: {k}={r[k]}\n{run.describe()}"
    assert (r["nslabs"], r["nareas"]) == (str(SLOTS), "1"), run.describe()
    assert int(r["maps"]) > 1000, f"too few maps for a meaningful capture: {r}"

    gz = _read_trace_disk(trace_img)
    trace = out_path("trace_capture", ".jsonl.gz")
    trace.write_bytes(gz)
    lines = gzip.decompress(gz).decode().splitlines()
    header = json.loads(lines[0])
    assert header["op"] == "header" and header["nslabs"] == SLOTS, header
    assert header["counts"]["map"] == int(r["maps"]) == sum('"op":"map"' in l for l in lines)
    assert header["debugfs_before"]["io_tlb_used"] == 0, "the pool was not empty when tracing began"
    assert header["area_used_at_start"] == [0] and len(header["area_index_at_start"]) == 1, header

    p = subprocess.run([replay, str(trace), "--compare", "--quiet"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, f"bounce-replay rc={p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}"
    report = json.loads(p.stdout.strip().splitlines()[-1])
    s = report["replay"]
    maps = int(r["maps"])
    assert s["compared"] == maps, s
    assert s["mismatches"] == 0, s
    assert s["maps"] + s["pool_full"] == maps and s["pool_full"] == int(r["failed"]), s
    assert (s["map_errors"], s["other_errors"]) == (0, 0), s
    assert report["live_at_end"] == 0 and report["pool"]["used"] == 0, report
    print(f"captured {maps} maps ({r['failed']} buffer full), {r['unmaps']} unmaps; "
          f"replayed with 0 mismatches; trace {trace} ({len(gz)} bytes)")
