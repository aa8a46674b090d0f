"""Rig 2 harness: nested KVM. A QEMU TCG guest (L1: Debian generic 6.12 kernel with kvm-amd
nested=1, built by images/build-l1.sh) runs a KVM VMM -- QEMU 7.2 or bouncevm -- that boots the
stock Debian cloud kernel (L2) with the rig-1 fio/iperf3 initramfs.

Payloads go to L1 over a 9p share (tests/out/NAME.share, mounted at /host in L1): the L2 kernel
(an uncompressed PVH vmlinux extracted here from the Debian vmlinuz), the fio initramfs, the VMM
binary with its shared libraries, and run-l2.sh, the script L1 runs (l1.cmd=/host/run-l2.sh).
L1 prints `BVM-L1 ...` lines (images/l1-init, images/l1-vmm); the L2 console is forwarded on
L1's console as `L2 T| <line>` (T = L1 uptime) and saved as NAME.share/out/l2.serial.log.

See tests/e2e/README.md ("Rig 2"). Python 3 stdlib only (pytest only for skipping).
"""

from __future__ import annotations

import contextlib
import functools
import json
import lzma
import os
import re
import bz2
import gzip
import shlex
import shutil
import socket
import struct
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import builds
import rig1
from rig1 import (IMAGES_DIR, Missing, OptIn, _kill_group, images, make_raw_image,
                  num, out_path, parse_kv, parse_log, record_figures, require_qemu, require_root,
                  skip_if_missing)

__all__ = ["Missing", "skip_if_missing", "record_figures", "num", "require_root", "l1_images",
           "l2_vmlinux", "Share", "L1", "L1Run", "RigFault", "qemu_l2_argv", "bouncevm_l2_argv",
           "run_l2", "require_bouncevm", "require_rig2", "L2_IP", "L1_IP", "stage_l2",
           "l2_vmm_command"]

L1_IP = "192.168.100.1"          # tap0 inside L1 (L1's own isolated network)
L2_IP = "192.168.100.2"
DEFAULT_TIMEOUT = float(os.environ.get("BVM_RIG2_TIMEOUT", "600"))  # whole L1 run, host side
# L1's console silent this long: the host records L1's state (NAME.l1.hang), then ends the run.
HANG_DUMP_S = float(os.environ.get("BVM_RIG2_HANG_DUMP_S", "240"))
HANG_END_S = float(os.environ.get("BVM_RIG2_HANG_END_S", "300"))
HANG_GAP_S = 20.0
L1_MEM = "2G"
# One vCPU: QEMU 7.2's multi-threaded TCG corrupts guest state now and then when two emulated
# CPUs run nested SVM at the same time (README "L1 has one vCPU"); BVM_RIG2_L1_SMP=2 for two.
L1_SMP = 1


# ----------------------------------------------------------------------------- prerequisites

def require_rig2() -> None:
    """Rig-2 tests run by default; BVM_RIG2=0 opts out (they then skip, saying so). Any other
    value than 0 or 1 is an error, so a typo does not silently skip the rig."""
    v = os.environ.get("BVM_RIG2", "1")
    if v == "0":
        raise OptIn("rig-2 (nested KVM under TCG) tests opted out with BVM_RIG2=0 "
                    "(about 2 min per test)")
    if v != "1":
        raise ValueError(f"BVM_RIG2 must be 0 (skip rig 2) or 1 (run it, the default), not {v!r}")


def bouncevm_path() -> Path:
    if os.environ.get("BVM_BOUNCEVM"):
        return Path(os.environ["BVM_BOUNCEVM"])
    return builds.bin_dir("release") / "bouncevm"


def require_bouncevm() -> Path:
    p = bouncevm_path()
    if not p.exists():
        raise Missing(f"no bouncevm binary at {p} (build it with `cargo build --release --bin "
                      f"bouncevm`, or set BVM_BOUNCEVM=PATH)")
    if not os.access(p, os.X_OK):
        raise Missing(f"{p} is not executable")
    return p


@functools.lru_cache(maxsize=None)
def l1_images() -> rig1.Images:
    """The L1 guest's images (images/build-l1.sh)."""
    return rig1.build_images("build-l1.sh", "L1_", "L1")


# ----------------------------------------------------------------------------- L2 kernel

_MAGICS = [  # (name, magic) as scripts/extract-vmlinux tries them
    ("gzip", b"\x1f\x8b\x08"), ("xz", b"\xfd7zXZ\x00"), ("bzip2", b"BZh"),
    ("lzma", b"\x5d\x00\x00\x00"), ("zstd", b"\x28\xb5\x2f\xfd"),
]


def _decompress(kind: str, data: bytes) -> bytes:
    if kind == "gzip":
        return gzip.GzipFile(fileobj=__import__("io").BytesIO(data)).read()
    if kind == "xz":
        return lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(data)
    if kind == "lzma":
        return lzma.LZMADecompressor(lzma.FORMAT_ALONE).decompress(data)
    if kind == "bzip2":
        return bz2.BZ2Decompressor().decompress(data)
    if kind == "zstd":  # no zstd in the Python 3.11 stdlib: the zstd CLI (Debian package zstd)
        zstd = shutil.which("zstd")
        if not zstd:
            raise Missing("the L2 vmlinuz is zstd-compressed and there is no zstd on PATH")
        r = subprocess.run([zstd, "-dcq"], input=data, capture_output=True)
        # a trailing size word after the frame makes zstd complain; the output is still whole
        return r.stdout
    raise ValueError(kind)


def _is_elf(b: bytes) -> bool:
    return b[:4] == b"\x7fELF"


def pvh_entry(elf: bytes) -> int | None:
    """The XEN_ELFNOTE_PHYS32_ENTRY (type 18, owner 'Xen') of an ELF64 image, or None."""
    if not _is_elf(elf) or elf[4] != 2:
        return None
    e_phoff, = struct.unpack_from("<Q", elf, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(e_phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf, e_phoff + i * e_phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, off)
            name = elf[off + 12: off + 12 + namesz].rstrip(b"\0")
            doff = off + 12 + ((namesz + 3) & ~3)
            if name == b"Xen" and ntype == 18:
                return struct.unpack_from("<I" if descsz == 4 else "<Q", elf, doff)[0]
            off = doff + ((descsz + 3) & ~3)
    return None


def extract_vmlinux(bzimage: bytes) -> bytes:
    """scripts/extract-vmlinux in Python: the ELF vmlinux inside a bzImage. Uses the setup
    header's payload_offset/payload_length when present (boot protocol >= 2.08), else scans
    for each compressor's magic and tries to decompress from there."""
    cands = []
    if bzimage[0x202:0x206] == b"HdrS" and struct.unpack_from("<H", bzimage, 0x206)[0] >= 0x208:
        setup_sects = bzimage[0x1f1] or 4
        pm = (setup_sects + 1) * 512
        poff, plen = struct.unpack_from("<II", bzimage, 0x248)
        payload = bzimage[pm + poff: pm + poff + plen]
        for kind, magic in _MAGICS:
            if payload.startswith(magic):
                cands.append((kind, payload))
    for kind, magic in _MAGICS:
        pos = bzimage.find(magic)
        while pos >= 0 and len(cands) < 12:
            cands.append((kind, bzimage[pos:]))
            pos = bzimage.find(magic, pos + 1)
            if kind in ("lzma", "bzip2"):
                break
    for kind, data in cands:
        with contextlib.suppress(Exception):
            out = _decompress(kind, data)
            if _is_elf(out):
                return out
    raise Missing("could not extract an ELF vmlinux from the L2 vmlinuz")


@functools.lru_cache(maxsize=None)
def l2_vmlinux() -> Path:
    """images/out/vmlinux: the rig-1 cloud kernel (images/build.sh) uncompressed, for the PVH
    entry (fastest L2 boot). Cached next to the vmlinuz; checked for the PVH note."""
    src = images().vmlinuz
    dst = src.with_name("vmlinux")
    stamp = src.with_name("vmlinux.src")
    key = f"{src} {src.stat().st_size} {src.stat().st_mtime_ns}"
    if not (dst.exists() and stamp.exists() and stamp.read_text() == key):
        elf = extract_vmlinux(src.read_bytes())
        if pvh_entry(elf) is None:
            raise Missing(f"the vmlinux extracted from {src} has no PVH entry note")
        tmp = dst.with_suffix(".tmp")
        tmp.write_bytes(elf)
        tmp.replace(dst)
        stamp.write_text(key)
    return dst


# ----------------------------------------------------------------------------- the 9p share

def _ldd(path: Path) -> list[Path]:
    r = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    if "not a dynamic executable" in r.stdout + r.stderr:
        return []
    if r.returncode != 0 or "not found" in r.stdout:
        raise Missing(f"ldd {path}: {r.stdout.strip()} {r.stderr.strip()}")
    libs = []
    for line in r.stdout.splitlines():
        m = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s+(/\S+)", line)
        if m:
            libs.append(Path(m.group(1)))
    return libs


def _place(src: Path, dst: Path) -> None:
    """Hard link when possible (same filesystem), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        dst.unlink()
    src = src.resolve()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class RigFault(UserWarning):
    """A rig-2 run that said nothing about the VMM under test, and was run again."""


class Share:
    """The directory shared into L1 as /host (tests/out/NAME.share). out/ collects what L1
    writes (L2 serial log, QMP answers)."""

    def __init__(self, name: str):
        self.name = name
        self.dir = out_path(name, ".share")
        if self.dir.exists():
            shutil.rmtree(self.dir)
        (self.dir / "out").mkdir(parents=True)

    def guest(self, rel: str) -> str:
        return f"/host/{rel}"

    def add(self, src: os.PathLike | str, rel: str) -> str:
        _place(Path(src), self.dir / rel)
        return self.guest(rel)

    def add_binary(self, src: os.PathLike | str, name: str, env: dict | None = None,
                   pre_args: Sequence[str] = ()) -> str:
        """Stages a dynamically linked host binary with its libraries under NAME/ and writes a
        wrapper NAME/run that starts it through the staged dynamic loader (L1 has only the few
        libraries iperf3/socat need). Returns the wrapper's path inside L1."""
        src = Path(src)
        d = self.dir / name
        (d / "lib").mkdir(parents=True, exist_ok=True)
        _place(src, d / "bin" / src.name)
        loader = None
        for lib in _ldd(src):
            _place(lib, d / "lib" / lib.name)
            if lib.name.startswith("ld-linux"):
                loader = lib.name
        g = self.guest(name)
        envs = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        pre = " ".join(shlex.quote(a) for a in pre_args)
        if loader:
            cmd = f'exec {g}/lib/{loader} --library-path {g}/lib {g}/bin/{src.name} {pre} "$@"'
        else:
            cmd = f'exec {g}/bin/{src.name} {pre} "$@"'
        (d / "run").write_text(f"#!/bin/sh\n# staged by tests/e2e/rig2.py from {src}\n{envs}{cmd}\n")
        (d / "run").chmod(0o755)
        return f"{g}/run"

    def add_qemu(self) -> str:
        """QEMU 7.2 (the rig-1 binary, images/qemu.sh) + libraries + the firmware a -kernel boot
        needs; returns the wrapper path inside L1."""
        wrapper = Path(require_qemu())
        real = IMAGES_DIR / "cache" / "qemu" / "root" / "usr" / "bin" / "qemu-system-x86_64"
        if not real.exists():
            real = wrapper  # a real qemu-system-x86_64 on PATH
            with contextlib.suppress(OSError):
                if wrapper.read_bytes()[:2] == b"#!":
                    raise Missing(f"cannot find the QEMU binary behind {wrapper}")
        fw = self.dir / "qemu" / "fw"
        fw.mkdir(parents=True, exist_ok=True)
        for f in ["/usr/share/seabios/bios-256k.bin", "/usr/share/qemu/pvh.bin",
                  "/usr/share/qemu/linuxboot_dma.bin", "/usr/share/qemu/linuxboot.bin",
                  "/usr/share/qemu/kvmvapic.bin", "/usr/share/qemu/multiboot_dma.bin"]:
            if os.path.exists(f):
                _place(Path(f), fw / os.path.basename(f))
        (self.dir / "qemu" / "modules").mkdir(exist_ok=True)
        return self.add_binary(real, "qemu", env={"QEMU_MODULE_DIR": "/host/qemu/modules"},
                               pre_args=["-L", "/host/qemu/fw"])

    def write_script(self, rel: str, text: str) -> str:
        p = self.dir / rel
        p.write_text(text)
        p.chmod(0o755)
        return self.guest(rel)

    def out(self, rel: str) -> Path:
        return self.dir / "out" / rel


# ----------------------------------------------------------------------------- L1 run results

_CRASH = re.compile(r"(Oops: .*|BUG: .*|Kernel panic - .*|general protection fault.*|"
                    r"watchdog: BUG: soft lockup.*|rcu: INFO: rcu_.* self-detected stall.*)")
_L2_LINE = re.compile(r"^L2 ([0-9.]+)\| ?(.*)$")


def _strip(line: str) -> str:
    return line.replace("\r", "").rstrip()


@dataclass
class L1Run(rig1.ResultChecks):
    """The outcome of one L1 boot."""
    RUN = "rig2"
    GUEST = "L2 "
    name: str
    argv: list[str]
    log_path: Path
    log: str                        # L1 console, L2 lines included (prefixed "L2 T| ")
    l2_log: str                     # L2 console (share/out/l2.serial.log, else the forwarded lines)
    share: Path
    returncode: int | None
    timed_out: bool
    wall_s: float
    host_times: dict[str, float]    # host seconds since QEMU start at which markers were seen
    l1: dict[str, list[dict]] = field(default_factory=dict)   # BVM-L1 <kind> k=v ...
    l2: dict[str, list] = field(default_factory=dict)         # rig1.parse_log of the L2 console
    l2_times: dict[str, float] = field(default_factory=dict)  # L1 uptime of L2 marker lines
    retried: list["L1Run"] = field(default_factory=list)
    # The host ends the VM (an --at action: QMP quit, a signal): L2 never prints BVM-DONE.
    host_ends_vm: bool = False
    # The host ended L1 after its console was silent this many seconds (L1 stopped); what L1's
    # emulated CPU and QEMU's threads were doing then is in hang_path.
    hung_s: int | None = None
    hang_path: Path | None = None

    # ---- L1 facts
    def l1_event(self, kind: str) -> dict:
        ev = self.l1.get(kind) or []
        return ev[-1] if ev else {}

    @property
    def l1_lines(self) -> list[str]:
        return [_strip(x) for x in self.log.splitlines() if not _L2_LINE.match(_strip(x))]

    @property
    def l1_crash(self) -> str:
        """First Oops/BUG/panic of the L1 kernel (L2 lines excluded), or ''."""
        for line in self.l1_lines:
            crash = rig1.first_crash(line, _CRASH)
            if crash:
                return crash
        return ""

    @property
    def l2_crash(self) -> str:
        return rig1.first_crash(self.l2_log, _CRASH)

    @property
    def l1_booted(self) -> bool:
        return bool(self.l1.get("boot"))

    @property
    def l1_done(self) -> bool:
        return bool(self.l1.get("done"))

    @property
    def l1_failure(self) -> str:
        """Why L1 could not do its part ('' if it did): missing /dev/kvm, share, ..."""
        if self.l1_crash:
            return f"L1 kernel died: {self.l1_crash}"
        if not self.l1_booted:
            return "L1 never reached /init"
        f = self.l1_event("fail")
        if f:
            return f"L1 failed: {f.get('reason')}"
        if self.l1_event("kvm").get("present") != "1":
            return "no /dev/kvm in L1 (kvm-amd did not load)"
        if self.l1_event("share").get("ok") != "1":
            return "9p share not mounted in L1"
        if self.timed_out and self.hung_s is not None:
            return (f"L1 stopped: its console was silent for {self.hung_s} s, heartbeat included "
                    f"(host side; L1's CPU state: {self.hang_path})")
        if self.timed_out:
            quiet = self.l1.get("quiet", [])
            if quiet:
                q = quiet[-1]
                return (f"timed out (host side); L2 silent since L1 uptime {q.get('l2_last')}, "
                        f"L1 still running at {q.get('uptime')} (BVM-L1 quiet: the VMM's threads)")
            return "timed out (host side)"
        if not self.l1_done:
            return (f"L1's QEMU exited rc={self.returncode} before L1 finished, without an "
                    f"Oops/panic in its log (the TCG QEMU itself died?)")
        return ""

    @property
    def vmm_started(self) -> bool:
        """l1-vmm started the VMM under test (BVM-L1 vmm start). From then on anything that goes
        wrong, in L1 too (a lockup, a stall, an Oops, QEMU exiting), may be the VMM's doing."""
        return any(d.get("start") == "1" for d in self.l1.get("vmm", []))

    @property
    def skip_reason(self) -> str:
        """Why rig 2 could not run at all ('' if it could): L1 failed before the VMM started.
        A failure after that is never a skip (see unclean_end)."""
        return "" if self.vmm_started else self.l1_failure

    @property
    def emulation_fault(self) -> str:
        """A register dump of L1's or L2's kernel with RFLAGS no x86 CPU can hold ('' if none):
        the emulated CPU made the state up (QEMU 7.2's nested SVM hands it over on VMRUN and
        #VMEXIT), and neither the kernel nor the VMM under test can load it."""
        for who, text in (("L1", "\n".join(self.l1_lines)), ("L2", self.l2_log)):
            bad = rig1.impossible_rflags(text)
            if bad:
                return f"{who}'s CPU held {bad}, a state the emulation made up"
        return ""

    @property
    def retry_reason(self) -> str:
        """Why this run says nothing about the VMM under test ('' if it does): L1 failed before
        the VMM started (skip_reason), or a kernel's register dump shows the emulation made up a
        CPU state (emulation_fault). Any other failure is the VMM's to answer for."""
        if self.skip_reason:
            return f"L1 failed before the VMM started: {self.skip_reason}"
        return self.emulation_fault

    @property
    def unclean_end(self) -> str:
        """Why the run did not end clean ('' if it did): L2 crashed or never reached BVM-DONE
        (or, when the host ends the VM, the host's action did not run), the VMM did not exit 0
        (killed by the timeout, halted, crashed), the L2 watchdog fired, or L1 failed (died,
        stalled, timed out, its QEMU exited) after the VMM started."""
        if self.l2_crash:
            return f"L2 kernel crash: {self.l2_crash}"
        if self.hung_s is not None:  # L1 stopped: what L2 and the VMM did not finish follows
            return f"L1 failed after the VMM started: {self.l1_failure}"
        if any(r.get("reason") == "guest-timeout" for r in self.results):
            return "the L2 watchdog fired (reason=guest-timeout)"
        if self.host_ends_vm:
            acts = self.l1.get("at", [])
            if not acts or any(a.get("ok") != "1" for a in acts):
                return f"the host was to end the VM but its action did not run: {acts}"
        elif not self.l2.get("DONE"):
            return "L2 never reached BVM-DONE"
        if self.vmm.get("timed_out") == "1":
            return "l1-vmm killed the VMM at its timeout"
        if self.vmm_rc != 0:
            return f"the VMM exited rc={self.vmm_rc}"
        if self.l1_failure:
            return f"L1 failed after the VMM started: {self.l1_failure}"
        return ""

    # ---- VMM / L2 facts
    @property
    def vmm(self) -> dict:
        """BVM-L1 vmm rc=... (the end line; {} if the VMM never ended)."""
        for d in reversed(self.l1.get("vmm", [])):
            if "rc" in d:
                return d
        return {}

    @property
    def vmm_rc(self) -> int | None:
        v = self.vmm.get("rc")
        return int(v) if v not in (None, "") else None

    @property
    def vmm_syncs(self) -> list[str]:
        """The fdatasync/fsync calls the VMM's main thread made (SYNC_TRACE_PREP/POST): the
        flush of its disks on the way out (the guest's own FLUSH requests are served by the
        device's I/O threads or io_uring, not the main thread)."""
        pid = self.vmm.get("pid")
        if not pid:
            return []
        out = []
        for d in self.l1.get("log", []):
            t = d.get("text", "")
            m = re.match(r"trace:\s+\S*?-(\d+)\s+\[", t)
            if m and m.group(1) == pid:
                out.append(t)
        return out

    @property
    def l2_halted(self) -> bool:
        """L2 printed "System halted" (e.g. poweroff without an ACPI power-off path) and l1-vmm
        killed the still-running VMM after its grace period."""
        return bool(self.l1.get("l2-halted")) or self.vmm.get("l2_halted") == "1"

    @property
    def results(self) -> list[dict]:
        return self.l2.get("RESULT", [])

    @property
    def l1_boot_s(self) -> float:
        """L1 kernel start -> /init (L1 clock)."""
        return num(self.l1_event("boot").get("uptime"))

    @property
    def l1_kvm_s(self) -> float:
        """L1 kernel start -> /dev/kvm ready (L1 clock)."""
        return num(self.l1_event("kvm").get("uptime"))

    @property
    def l2_boot_s(self) -> float:
        """L2 kernel start -> L2 /init (L2 clock)."""
        return rig1.first_uptime(self.l2, "BOOT")

    @property
    def l2_wall_to_init_s(self) -> float:
        """VMM start -> L2 /init, L1 clock (includes loading the kernel + initramfs over 9p)."""
        start = None
        for d in self.l1.get("vmm", []):
            if "start" in d and "uptime" in d:
                start = num(d["uptime"])
        return self.l2_times.get("BOOT", float("nan")) - (start if start is not None else float("nan"))

    def l2_line_time(self, text: str) -> float:
        """L1 uptime at which the first L2 console line containing `text` arrived (nan if none)."""
        for raw in self.log.splitlines():
            m = _L2_LINE.match(_strip(raw))
            if m and text in m.group(2):
                return num(m.group(1))
        return float("nan")

    def qmp_polls(self) -> list[tuple[float, dict]]:
        """Every answer l1-vmm's QMP polls got while the VMM ran: (L1 uptime, answer)."""
        out = []
        with contextlib.suppress(OSError):
            # QMP answers end in \r\n and l1-vmm keeps the \r inside each record: records are
            # split on \n only (no newline translation).
            raw = (self.share / "out" / "qmp-polls.jsonl").read_bytes().decode("utf-8", "replace")
            for line in raw.split("\n"):
                with contextlib.suppress(ValueError):
                    d = json.loads(line)
                    out.append((num(d.get("uptime")), d.get("answer") or {}))
        return out

    @property
    def qmp_done(self) -> dict | None:
        """The VMM's QMP answer taken right after L2 printed BVM-DONE (share/out/qmp-done.json)."""
        return self._json("qmp-done.json")

    @property
    def qmp_last(self) -> dict | None:
        return self._json("qmp-last.json")

    def _json(self, rel: str) -> dict | None:
        p = self.share / "out" / rel
        with contextlib.suppress(OSError, ValueError):
            return json.loads(p.read_text())
        return None

    def describe(self, tail: int = 50) -> str:
        lines = self.log.replace("\r", "").splitlines()
        why = self.l1_failure
        extra = f" L1-problem={why!r}" if why else ""
        if self.l2_crash:
            extra += f" L2-crash={self.l2_crash!r}"
        ret = (" after run(s) that said nothing about the VMM: " +
               ", ".join(f"{r.retry_reason} ({r.log_path})" for r in self.retried)
               if self.retried else "")
        return (f"rig2 {self.name}: rc={self.returncode} timed_out={self.timed_out} "
                f"wall={self.wall_s:.1f}s vmm={self.vmm} log={self.log_path} "
                f"share={self.share}{extra}{ret}\nargv: {shlex.join(self.argv)}\n"
                f"--- last {tail} L1 console lines ---\n" + "\n".join(lines[-tail:]))

    def figures(self) -> dict:
        return {"l1_boot_s": self.l1_boot_s, "l1_kvm_s": self.l1_kvm_s,
                "host_l1_init_s": self.host_times.get("l1_init", float("nan")),
                "host_l1_kvm_s": self.host_times.get("l1_kvm", float("nan")),
                "host_l2_init_s": self.host_times.get("l2_init", float("nan")),
                "l2_boot_s": self.l2_boot_s, "l2_wall_to_init_s": self.l2_wall_to_init_s,
                "vmm_elapsed_s": num(self.vmm.get("elapsed_s")), "wall_s": self.wall_s}


def parse_l1(text: str) -> tuple[dict[str, list[dict]], dict[str, list], dict[str, float]]:
    """(BVM-L1 events by kind, L2 parse_log of the forwarded lines, L1 uptime of the first L2
    BVM-<KIND> lines)."""
    l1: dict[str, list[dict]] = {}
    l2_lines, l2_times = [], {}
    for raw in text.splitlines():
        line = _strip(raw)
        m = _L2_LINE.match(line)
        if m:
            l2_lines.append(m.group(2))
            k = re.search(r"BVM-([A-Z]+)", m.group(2))
            if k and k.group(1) not in l2_times:
                l2_times[k.group(1)] = num(m.group(1))
            continue
        i = line.find("BVM-L1 ")
        if i < 0:
            continue
        rest = line[i + 7:].split(None, 1)
        if not rest:
            continue
        kind, body = rest[0], (rest[1] if len(rest) > 1 else "")
        if kind == "log":
            l1.setdefault("log", []).append({"text": body})
        else:
            d = parse_kv(body)
            if kind == "vmm" and body.startswith("start"):
                d["start"] = "1"
                d["argv"] = body.split("argv=", 1)[-1]
            l1.setdefault(kind, []).append(d)
    return l1, parse_log("\n".join(l2_lines)), l2_times


# ----------------------------------------------------------------------------- L1

class L1:
    """One L1 QEMU TCG guest with the 9p share. run() = start + wait + kill.

    cmd: l1.cmd (a script in the share, e.g. share.write_script('run-l2.sh', ...));
    iperf3: start an iperf3 server on tap0's address in L1;
    tcg_thread: 'multi' (default, ENVIRONMENT's rig) or 'single' (avoids the int3 race, slower).
    """

    def __init__(self, name: str, share: Share, cmd: str | None = None, iperf3: bool = False,
                 timeout: float = DEFAULT_TIMEOUT, tcg_thread: str = "multi", mem: str = L1_MEM,
                 smp: int = L1_SMP, cpu: str = "max", append: str = "", hold: bool = True,
                 qemu_debug: str | None = None):
        self.name, self.share, self.cmd, self.iperf3 = name, share, cmd, iperf3
        self.qemu_debug = qemu_debug if qemu_debug is not None else os.environ.get("BVM_RIG2_L1_DEBUG", "")
        self.timeout, self.tcg_thread, self.mem, self.smp, self.cpu = timeout, tcg_thread, mem, smp, cpu
        self.append, self.hold = append, hold
        self.log_path = out_path(name, ".l1.log")
        # QEMU's human monitor of L1, for a look at a hung L1 from the host (`info registers`:
        # HLT and IF; `info lapic`: pending vectors), e.g. with rig2.monitor(PATH, "info lapic").
        self.monitor_path = out_path(name, ".l1.mon")
        self.hang_path: Path | None = None   # NAME.l1.hang, written when L1 went silent
        self.hung_s: int | None = None       # the silence (s) after which the host ended L1
        self._attempt = 0

    def kernel_cmdline(self) -> str:
        # L1 is a TCG guest like rig 1's: it gets the host TSC's rate rather than measuring it
        # on a loaded host (its clock, and the kvmclock L2 reads from it, would run fast).
        w = ["console=ttyS0", "quiet", "panic=-1", *rig1.tsc_words(),
             f"l1.timeout={max(30, int(self.timeout) - 15)}"]
        if self.cmd:
            w.append(f"l1.cmd={self.cmd}")
        if self.iperf3:
            w.append("l1.iperf3=1")
        if not self.hold:
            w.append("l1.hold=0")
        if self.append:
            w.append(self.append)
        return " ".join(w)

    def argv(self) -> list[str]:
        img = l1_images()
        return [require_qemu(),
                "-machine", "q35", "-accel", f"tcg,thread={self.tcg_thread}", "-cpu", self.cpu,
                "-smp", str(self.smp), "-m", self.mem,
                "-kernel", str(img.vmlinuz), "-initrd", str(img.initramfs),
                "-append", self.kernel_cmdline(),
                "-nographic", "-no-reboot", "-display", "none", "-serial", "stdio",
                "-monitor", f"unix:{self.monitor_path},server=on,wait=off", "-nic", "none",
                "-virtfs", f"local,path={self.share.dir},mount_tag=host,security_model=none",
                *self.debug_args()]

    def debug_args(self) -> list[str]:
        """QEMU's own log of L1 (`-d ITEMS -D NAME.l1-qemu.log`) when qemu_debug names items
        (BVM_RIG2_L1_DEBUG, e.g. cpu_reset,guest_errors: what reset L1 and its registers)."""
        if not self.qemu_debug:
            return []
        return ["-d", self.qemu_debug, "-D", str(self.log_path.with_suffix("").with_suffix(".l1-qemu.log"))]

    def _once(self) -> L1Run:
        if self._attempt:
            self.log_path = out_path(f"{self.name}.retry{self._attempt}", ".l1.log")
        self.hang_path, self.hung_s = None, None
        argv = self.argv()
        times: dict[str, float] = {}
        t0 = time.monotonic()
        last_line = [t0]
        with open(self.log_path, "wb") as logf:
            logf.write(("# " + shlex.join(argv) + "\n").encode())
            logf.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)

            def reader():
                marks = [("l1_init", "BVM-L1 boot"), ("l1_kvm", "BVM-L1 kvm"),
                         ("l1_cmd", "BVM-L1 cmd start"), ("vmm_start", "BVM-L1 vmm start"),
                         ("l2_init", "BVM-BOOT"), ("l2_done", "BVM-DONE"),
                         ("vmm_end", "BVM-L1 vmm rc="), ("l1_done", "BVM-L1 done")]
                for raw in iter(proc.stdout.readline, b""):
                    last_line[0] = time.monotonic()
                    logf.write(raw)
                    logf.flush()
                    s = raw.decode("utf-8", "replace")
                    for key, pat in marks:
                        if key not in times and pat in s:
                            times[key] = round(time.monotonic() - t0, 2)

            th = threading.Thread(target=reader, daemon=True)
            th.start()
            timed_out = self._wait(proc, t0, last_line)
            _kill_group(proc)
            th.join(timeout=10)
        wall = time.monotonic() - t0
        log = self.log_path.read_bytes().decode("utf-8", "replace")
        l1, l2_fwd, l2_times = parse_l1(log)
        l2_path = self.share.out("l2.serial.log")
        l2_log = ""
        with contextlib.suppress(OSError):
            l2_log = l2_path.read_bytes().decode("utf-8", "replace")
        if not l2_log:
            l2_log = "\n".join(m.group(2) for m in (_L2_LINE.match(_strip(x)) for x in log.splitlines()) if m)
        l2 = parse_log(l2_log) if l2_log else l2_fwd
        return L1Run(self.name, argv, self.log_path, log, l2_log, self.share.dir, proc.returncode,
                     timed_out, wall, times, l1, l2, l2_times, hung_s=self.hung_s,
                     hang_path=self.hang_path)

    def _wait(self, proc: subprocess.Popen, t0: float, last_line: list[float]) -> bool:
        """Waits for L1's QEMU to exit; True when the host had to end it: at the run's timeout,
        or once L1's console has been silent for HANG_END_S. While L2 runs, l1-vmm prints a
        `BVM-L1 quiet` line at least every ~2 minutes, so a longer silence means L1 itself
        stopped: at HANG_DUMP_S of silence the host records the emulated CPU's state through
        QEMU's monitor and the host threads of QEMU (NAME.l1.hang), twice, HANG_GAP_S apart."""
        dumped = False
        while True:
            try:
                proc.wait(timeout=5)
                return False
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            silent = now - last_line[0]
            if now - t0 >= self.timeout:
                return True
            if not dumped and silent >= HANG_DUMP_S:
                dumped = True
                self.hang_path = self.log_path.with_suffix("").with_suffix(".l1.hang")
                hang_dump(self.hang_path, proc.pid, self.monitor_path, silent)
            if silent >= HANG_END_S:
                self.hung_s = round(silent)
                return True

    def run(self, boot_retries: int = 1) -> L1Run:
        """Boots L1 again (up to boot_retries times) when a run says nothing about the VMM under
        test (L1Run.retry_reason): L1 failed before the VMM started (its kernel died, its QEMU
        exited, no /dev/kvm, ...), or a kernel's register dump holds RFLAGS the emulation made
        up. Any other failure is reported, never retried. Each run booted again is named in a
        warning, which pytest prints in its summary, and kept in L1Run.retried."""
        failed: list[L1Run] = []
        while True:
            run = self._once()
            if not run.retry_reason or len(failed) >= boot_retries:
                run.retried = failed
                return run
            warnings.warn(f"rig2 {run.name}: booting L1 again: {run.retry_reason} "
                          f"({run.log_path})", RigFault, stacklevel=2)
            failed.append(run)
            self._attempt += 1


def _host_threads(pid: int) -> str:
    """Each host thread of process `pid`: TID, name, state, CPU ticks, wait channel, syscall."""
    rows = []
    for t in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda p: int(p.name)):
        def rd(name: str) -> str:
            try:
                return (t / name).read_text(errors="replace").strip()
            except OSError:
                return "?"
        stat = rd("stat")
        fields = stat.rsplit(")", 1)[-1].split()
        state, ticks = (fields[0], int(fields[11]) + int(fields[12])) if len(fields) > 12 else ("?", -1)
        rows.append(f"{t.name} {rd('comm')} state={state} ticks={ticks} wchan={rd('wchan')} "
                    f"syscall={rd('syscall').split(' ')[0]}")
    return "\n".join(rows)


def hang_dump(path: Path, pid: int, monitor_path: Path, silent_s: float) -> None:
    """Writes what a silent L1 was doing to `path`: QEMU's view of the emulated CPU (registers,
    local APIC, interrupt controller, status) and the host threads of QEMU, twice HANG_GAP_S
    apart so that a CPU still executing (RIP and the tick counts move) can be told from one
    stopped."""
    cmds = ("info status", "info cpus", "info registers", "info lapic", "info pic", "info irq")
    with open(path, "w") as f:
        for i in range(2):
            if i:
                time.sleep(HANG_GAP_S)
            f.write(f"=== sample {i + 1}: console silent {silent_s + HANG_GAP_S * i:.0f} s, "
                    f"host load {os.getloadavg()}\n--- host threads of QEMU (pid {pid})\n")
            f.write(_host_threads(pid) + "\n--- QEMU monitor\n")
            try:
                f.write(monitor(monitor_path, *cmds, wait=3.0) + "\n")
            except OSError as e:
                f.write(f"monitor unavailable: {e}\n")
            f.flush()


def monitor(path: os.PathLike | str, *commands: str, wait: float = 2.0) -> str:
    """Sends `commands` to an L1's QEMU monitor socket (L1.monitor_path) and returns what it
    printed, read until it is quiet for `wait` seconds."""
    out = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.settimeout(wait)
        for c in commands:
            s.sendall(c.encode() + b"\n")
        with contextlib.suppress(socket.timeout):
            while chunk := s.recv(65536):
                out += chunk
    return out.decode("utf-8", "replace")


# ----------------------------------------------------------------------------- L2 VMM command lines

L2_MEM = "1G"


def l2_cmdline(test: str, params: dict | None = None, append: str = "", timeout: int = 600) -> str:
    w = ["console=ttyS0", "quiet", "panic=-1", f"bvm.test={test}"]
    p = {"timeout": timeout, "hold": 6, **(params or {})}
    w += [f"bvm.{k}={v}" for k, v in p.items()]
    if append:
        w.append(append)
    return " ".join(w)


def qemu_l2_argv(qemu: str, kernel: str, initrd: str, append: str, disk: str | None,
                 net: bool = True, qmp: str | None = "/tmp/qmp.sock", mem: str = L2_MEM,
                 smp: int = 2, aio: str = "threads") -> list[str]:
    """QEMU 7.2 with KVM inside L1: virtio-blk-pci on `disk`, virtio-net-pci on L1's tap0."""
    a = [qemu, "-machine", "q35,accel=kvm", "-cpu", "host", "-smp", str(smp), "-m", mem,
         "-kernel", kernel, "-initrd", initrd, "-append", append,
         "-nographic", "-no-reboot", "-display", "none", "-vga", "none", "-serial", "stdio",
         "-monitor", "none", "-nic", "none"]
    if disk:
        a += ["-drive", f"file={disk},format=raw,if=none,id=d0,cache=writeback,aio={aio}",
              "-device", "virtio-blk-pci,drive=d0"]
    if net:
        a += ["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no",
              "-device", "virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56,romfile="]
    if qmp:
        a += ["-qmp", f"unix:{qmp},server=on,wait=off"]
    return a


def bouncevm_l2_argv(bvm: str, kernel: str, initrd: str, append: str, disk: str | None,
                     net: bool = True, qmp: str | None = "/tmp/qmp.sock", mem: str = L2_MEM,
                     smp: int = 2, bounce: str = "policy=force", aio: str | None = None) -> list[str]:
    """The bouncevm command line (QEMU-compatible; cache=writeback is bouncevm's default, as in
    qemu_l2_argv)."""
    a = [bvm, "-m", mem, "-smp", str(smp), "-kernel", kernel, "-initrd", initrd, "-append", append]
    if disk:
        a += ["-drive", f"file={disk},format=raw,if=virtio" + (f",aio={aio}" if aio else "")]
    if net:
        a += ["-netdev", "tap,id=n0,ifname=tap0", "-device", "virtio-net-pci,netdev=n0"]
    if bounce:
        a += ["-bounce", bounce]
    if qmp:
        a += ["-qmp", f"unix:{qmp},server,nowait"]
    a += ["-nographic", "-no-reboot"]
    return a


# l1_prep / l1_post of run_l2 for a test that wants to see the VMM flush its disks: every
# fdatasync/fsync system call in L1 is traced (tracepoints enabled before the VMM starts, so no
# kernel text is patched while it runs) and printed after it ended as "BVM-L1 log trace: ..."
# (L1Run.vmm_syncs).
SYNC_TRACE_PREP = """T=/sys/kernel/tracing
mount -t tracefs nodev $T 2>/dev/null
for e in sys_enter_fdatasync sys_enter_fsync; do
    echo 1 > $T/events/syscalls/$e/enable || echo "BVM-L1 log cannot trace $e"
done
"""
SYNC_TRACE_POST = """grep -E 'sys_(fdatasync|fsync)\\(' /sys/kernel/tracing/trace | sed 's/^/BVM-L1 log trace: /'
"""


# Part of every run_l2 script unless apic_trace=False: L1's KVM traces the interrupts it delivers
# to L2 (IPIs, INIT/SIPI included, and every accepted interrupt) into a 4 MiB ring from before the
# VMM starts; if L2 falls silent, l1-vmm prints the last of them ("BVM-L1 log apic: ...").
APIC_TRACE_PREP = """T=/sys/kernel/tracing
mount -t tracefs nodev $T 2>/dev/null
echo 4096 > $T/buffer_size_kb 2>/dev/null
for e in kvm_apic_ipi kvm_apic_accept_irq; do
    echo 1 > $T/events/kvm/$e/enable || echo "BVM-L1 log cannot trace kvm:$e"
done
"""


def stage_l2(share: Share, kernel: str = "pvh") -> tuple[str, str]:
    """Puts the L2 kernel ('pvh': the uncompressed vmlinux, PVH entry; 'bzimage': the Debian
    vmlinuz as it is) and the fio/iperf3 initramfs into the share; returns their L1 paths."""
    img = images()
    if kernel == "bzimage":
        k = share.add(img.vmlinuz, "l2/vmlinuz")
    elif kernel == "pvh":
        k = share.add(l2_vmlinux(), "l2/vmlinux")
    else:
        raise ValueError(f"kernel must be 'pvh' or 'bzimage', not {kernel!r}")
    return k, share.add(img.initramfs, "l2/initramfs.cpio")


def l2_vmm_command(share: Share, vmm: str, kernel: str, initrd: str, cmdline: str,
                   disk: str | None, net: bool = True, query: str | None = None,
                   bounce: str = "policy=force", at: Sequence[tuple[str, str]] = (),
                   vmm_timeout: int = 360, out: str = "/host/out", aio: str | None = None,
                   poll: bool = True) -> str:
    """The l1-vmm line that runs one L2 VMM inside L1 (see run_l2; `out` is where l1-vmm writes
    the L2 console and the QMP answers; `aio` the drive's aio= for either VMM, else each one's
    rig default: threads for QEMU, bouncevm's own default; poll=False: no QMP polling, as a
    benchmark wants, and no `at` actions over QMP)."""
    if vmm == "qemu":
        exe = share.add_qemu()
        argv = qemu_l2_argv(exe, kernel, initrd, cmdline, disk, net=net, aio=aio or "threads")
        query = query or "query-status"
    else:
        path = require_bouncevm() if vmm == "bouncevm" else Path(vmm)
        exe = share.add_binary(path, "bouncevm")
        argv = bouncevm_l2_argv(exe, kernel, initrd, cmdline, disk, net=net, bounce=bounce, aio=aio)
        query = query or "x-query-bounce"
    ats = "".join(f"--at {shlex.quote(m)} {shlex.quote(a)} " for m, a in at)
    qmp = f"--qmp /tmp/qmp.sock --query {shlex.quote(query)} " if poll else ""
    return (f"l1-vmm --timeout {vmm_timeout} {qmp}"
            f"--log {out}/l2.serial.log --out {out} {ats}-- " + shlex.join(argv))


def tcg_thread_default() -> str:
    """L1's TCG threading: BVM_RIG2_TCG, else multi (see README "Rig 2")."""
    return os.environ.get("BVM_RIG2_TCG", "multi")


def l1_smp_default() -> int:
    """L1's vCPU count: BVM_RIG2_L1_SMP, else L1_SMP (README "L1 has one vCPU")."""
    v = os.environ.get("BVM_RIG2_L1_SMP", str(L1_SMP))
    if v not in ("1", "2"):
        raise ValueError(f"BVM_RIG2_L1_SMP must be 1 or 2, not {v!r}")
    return int(v)


def run_l2(name: str, vmm: str = "qemu", test: str = "fio-verify", params: dict | None = None,
           append: str = "", disk: str = "tmpfs", disk_size: str = "256M", net: bool = True,
           query: str | None = None, timeout: float = DEFAULT_TIMEOUT, vmm_timeout: int | None = None,
           bounce: str = "policy=force", boot_retries: int = 1, tcg_thread: str | None = None,
           kernel: str = "pvh", at: Sequence[tuple[str, str]] = (), host_ends_vm: bool = False,
           l1_prep: str = "", l1_post: str = "", l1_debug: str | None = None,
           apic_trace: bool = True) -> L1Run:
    """Boots L1, which runs `vmm` ('qemu' or 'bouncevm' or a path to a bouncevm-compatible
    binary) booting L2 = Debian cloud kernel (PVH vmlinux) + the fio/iperf3 initramfs with the
    images/init test(s) `test`.

    disk: 'tmpfs' (a sparse raw image created in L1's RAM: the block figures are L2's path only)
          or 'share' (tests/out/NAME.share/disk.img over 9p) or None (no disk);
    query: QMP command polled by l1-vmm (default: x-query-bounce for bouncevm, query-status
           for QEMU), answers in NAME.share/out/qmp-*.json (L1Run.qmp_done / qmp_last);
    kernel: 'pvh' (the uncompressed vmlinux, PVH entry) or 'bzimage' (the Debian vmlinuz as
           it is: real-mode setup header, 64-bit entry, in-kernel decompression);
    at: (MARKER, ACTION) pairs for l1-vmm --at (ACTION qmp:CMD, qmp-wait:CMD or signal:SIG,
        done once when an L2 console line contains MARKER; reported as L1Run.l1["at"]);
    host_ends_vm: an `at` action ends the VM (QMP quit, SIGTERM), so L2 prints no BVM-DONE
        (L1Run.unclean_end then asks for the action instead);
    l1_prep / l1_post: shell lines run-l2.sh runs in L1 before the VMM / after it ended (with
        $vmm_rc and $vmm_pid set);
    l1_debug: QEMU -d items for L1 (default BVM_RIG2_L1_DEBUG; log in NAME.l1-qemu.log);
    apic_trace: APIC_TRACE_PREP in L1 (what L1's KVM delivered to L2, printed if L2 falls
        silent)."""
    require_root()
    images()
    l1_images()
    share = Share(name)
    k, i = stage_l2(share, kernel)
    prep = ""
    if disk == "tmpfs":
        dpath = "/tmp/disk.img"
        prep = f"truncate -s {disk_size} {dpath}\n"
    elif disk == "share":
        make_raw_image(share.dir / "disk.img", disk_size)
        dpath = "/host/disk.img"
    else:
        dpath = None
    ptimeout = int(vmm_timeout or max(60, timeout - 120))
    p = {"ip": f"{L2_IP}/24", "server": L1_IP, **(params or {})}
    cmdline = l2_cmdline(test, p, append, timeout=max(30, ptimeout - 30))
    line = l2_vmm_command(share, vmm, k, i, cmdline, dpath, net=net, query=query, bounce=bounce,
                          at=at, vmm_timeout=ptimeout)
    if apic_trace:
        prep += APIC_TRACE_PREP
    script = ("#!/bin/sh\n# written by tests/e2e/rig2.py; run by L1's /init (l1.cmd)\n" + prep + l1_prep +
              line + "\nvmm_rc=$?\nvmm_pid=\"$(cat /tmp/vmm.pid 2>/dev/null)\"\n" + l1_post +
              "\nexit $vmm_rc\n")
    cmd = share.write_script("run-l2.sh", script)
    run = L1(name, share, cmd=cmd, iperf3=net, timeout=timeout,
             tcg_thread=tcg_thread or tcg_thread_default(), smp=l1_smp_default(),
             qemu_debug=l1_debug).run(boot_retries=boot_retries)
    run.host_ends_vm = host_ends_vm
    return run
