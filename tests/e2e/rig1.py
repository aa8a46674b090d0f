"""Rig 1 harness: QEMU TCG guest (Debian cloud kernel + busybox/fio/iperf3 initramfs) with
devices given by the caller -- QEMU's own, or vhost-user backends such as bouncevm-vhost.

See tests/e2e/README.md for the API. Python 3 stdlib only (pytest only for skipping).

Everything a test starts is started in its own process group and killed as a group at the end;
network traffic only goes to loopback or to namespaces created here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import builds

REPO = Path(__file__).resolve().parents[2]
IMAGES_DIR = REPO / "images"
OUT_DIR = Path(os.environ.get("BVM_TEST_OUT", REPO / "tests" / "out"))

DEFAULT_MEM = "1G"
DEFAULT_SMP = 2
DEFAULT_TIMEOUT = float(os.environ.get("BVM_GUEST_TIMEOUT", "90"))  # per boot, host side
# TCG's vCPU threading for every rig-1 guest: "multi" (one host thread per vCPU) or "single".
TCG_THREAD = os.environ.get("BVM_RIG1_TCG", "multi")


# ----------------------------------------------------------------------------- prerequisites

def tcg_thread() -> str:
    """BVM_RIG1_TCG, checked: a typo must not silently pick a mode."""
    if TCG_THREAD not in ("multi", "single"):
        raise ValueError(f"BVM_RIG1_TCG={TCG_THREAD!r}: expected multi or single")
    return TCG_THREAD


class Missing(Exception):
    """A prerequisite is missing; tests turn this into pytest.skip(reason), or a failure when
    the machine is expected to have everything (resources_required)."""


class OptIn(Missing):
    """Not a missing resource: a suite left out on purpose (rig 2 with BVM_RIG2=0). Always a
    skip."""


def resources_required() -> bool:
    """BVM_REQUIRE_RESOURCES=all (./tests/run sets it when CI=true, the same switch as the Rust
    tests' bounce::testing): a missing prerequisite fails the test instead of skipping it."""
    return "all" in [w.strip() for w in os.environ.get("BVM_REQUIRE_RESOURCES", "").split(",")]


def skip_if_missing(fn):
    """Decorator for test functions: a Missing raised inside becomes a pytest skip (a failure
    with BVM_REQUIRE_RESOURCES=all, except for OptIn)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Missing as e:  # pragma: no cover - depends on the machine
            import pytest

            if resources_required() and not isinstance(e, OptIn):
                pytest.fail(f"required prerequisite missing (BVM_REQUIRE_RESOURCES): {e}")
            pytest.skip(str(e))

    return wrapper


def require_root() -> None:
    if os.geteuid() != 0:
        raise Missing("needs root (QEMU tap, network namespaces, image build)")


def require_tun() -> None:
    if not os.path.exists("/dev/net/tun"):
        raise Missing("no /dev/net/tun")


def require_cmd(name: str) -> str:
    p = shutil.which(name)
    if not p:
        raise Missing(f"no {name} on PATH")
    return p


def require_binary(name: str, env: str | None = None) -> str:
    """Our binary NAME of the release build (`$ENV` first when given: builds.find)."""
    found = builds.find(name, env)
    if found is None:
        also = f", or set {env}" if env else ""
        raise Missing(f"no {name} binary (cargo build --release --bins{also})")
    return str(found)


@functools.lru_cache(maxsize=None)
def _qemu_paths() -> tuple[str, str]:
    """(qemu-system-x86_64, qemu-storage-daemon or ''), via images/qemu.sh (cached per process)."""
    env_q = os.environ.get("BVM_QEMU")
    if env_q:
        return env_q, os.environ.get("BVM_QSD") or (shutil.which("qemu-storage-daemon") or "")
    out, kv = _run_images_script("qemu.sh", timeout=900)
    if out.returncode != 0 or not kv.get("QEMU"):
        raise Missing(f"no usable qemu-system-x86_64 (images/qemu.sh: {out.stderr.strip()[-300:]})")
    return kv["QEMU"], kv.get("QSD", "")


def require_qemu() -> str:
    if shutil.which("qemu-system-x86_64") is None and os.geteuid() != 0 and not os.environ.get("BVM_QEMU"):
        raise Missing("no qemu-system-x86_64 (and not root to provide one)")
    return _qemu_paths()[0]


def require_qsd() -> str:
    q = _qemu_paths()[1]
    if not q:
        raise Missing("no qemu-storage-daemon")
    return q


def _run_images_script(script: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Runs images/<script>; its result and the KEY=value lines of its stdout. A script that
    cannot be run or runs out of time is Missing."""
    try:
        r = subprocess.run(
            ["bash", str(IMAGES_DIR / script)], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Missing(f"images/{script} failed: {e}")
    return r, _parse_kv_lines(r.stdout)


def _parse_kv_lines(text: str) -> dict[str, str]:
    kv = {}
    for line in text.splitlines():
        if "=" in line and re.match(r"^[A-Z_][A-Z0-9_]*=", line):
            k, v = line.split("=", 1)
            kv[k] = v
    return kv


@dataclass(frozen=True)
class Images:
    """A guest kernel and its initramfs."""
    vmlinuz: Path
    initramfs: Path
    kernel_release: str


def build_images(script: str, prefix: str, what: str) -> Images:
    """Builds (or reuses) images/out/{p}vmlinuz and {p}initramfs.cpio via images/<script>, which
    prints <prefix>VMLINUZ=, <prefix>INITRAMFS= and <prefix>KERNEL_RELEASE= ({p} is `prefix` in
    lower case with '-' for '_'). BVM_<prefix>VMLINUZ and BVM_<prefix>INITRAMFS (with
    BVM_<prefix>KERNEL_RELEASE) name prebuilt ones instead; `what` names them in errors."""
    vm = os.environ.get(f"BVM_{prefix}VMLINUZ")
    ini = os.environ.get(f"BVM_{prefix}INITRAMFS")
    if vm and ini:
        return Images(Path(vm), Path(ini), os.environ.get(f"BVM_{prefix}KERNEL_RELEASE", "unknown"))
    out = IMAGES_DIR / "out"
    if os.geteuid() != 0 and not (out / f"{prefix.lower().replace('_', '-')}vmlinuz").exists():
        raise Missing(f"{what} images not built and not root to build them (run images/{script})")
    r, kv = _run_images_script(script, timeout=1800)
    if r.returncode != 0 or f"{prefix}VMLINUZ" not in kv:
        raise Missing(f"images/{script} failed (rc={r.returncode}): {r.stderr.strip()[-500:]}")
    return Images(Path(kv[f"{prefix}VMLINUZ"]), Path(kv[f"{prefix}INITRAMFS"]),
                  kv.get(f"{prefix}KERNEL_RELEASE", ""))


@functools.lru_cache(maxsize=None)
def images() -> Images:
    """The rig-1 guest's images (images/build.sh)."""
    return build_images("build.sh", "", "guest")


# ----------------------------------------------------------------------------- serial log parsing

# Kernel deaths and hangs: an Oops/BUG/panic, a soft or hard lockup, an RCU stall, a task
# blocked for minutes (all printed at KERN_ERR or above, so `quiet` keeps them).
_CRASH = re.compile(r"(Oops: .*|BUG: .*|Kernel panic - .*|general protection fault.*|"
                    r"watchdog: .*lockup.*|rcu: INFO: rcu_.*(?:stall|detected).*|"
                    r"INFO: task .* blocked for more than.*)")
_BVM_LINE = re.compile(r"BVM-(RESULT|SWIOTLB|BOOT|INFO|POWERDOWN|DONE|LOG)(?:\s+(.*))?$")


def first_crash(text: str, crash: re.Pattern = _CRASH) -> str:
    """The first kernel death or hang that `crash` finds in `text` (stripped), or ''."""
    m = crash.search(text)
    return m.group(0).strip() if m else ""


# RFLAGS as a crash report prints it: the flags the CPU pushed when it took the exception.
_EFLAGS = re.compile(r"EFLAGS: ([0-9a-f]+)\b")
# Bits 3, 5, 15 and 22-63 of RFLAGS read as 0 on every x86 CPU, bit 1 as 1.
_RFLAGS_ZERO = 0xFFFF_FFFF_FFC0_0000 | 1 << 15 | 1 << 5 | 1 << 3
_RFLAGS_ONE = 1 << 1


def impossible_rflags(text: str) -> str:
    """The first RFLAGS in `text`'s register dumps that no x86 CPU can hold, described
    ('EFLAGS 04b08666: reserved bits 5, 15, 23, 26 set'), or ''. Code in the guest cannot load
    those bits (popf and iret leave them alone), nor can the VMMs the rigs run: they write 0x2
    when a vCPU starts and otherwise only the RFLAGS KVM gave them. An emulated CPU that made up
    its state can (docs/studies/rig2-l1-one-vcpu.md)."""
    for m in _EFLAGS.finditer(text):
        flags = int(m.group(1), 16)
        bad = [b for b in range(64) if flags >> b & 1 and _RFLAGS_ZERO >> b & 1]
        wrong = ([f"reserved bit{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} set"]
                 if bad else []) + ([] if flags & _RFLAGS_ONE else ["bit 1 clear"])
        if wrong:
            return f"EFLAGS {m.group(1)}: {' and '.join(wrong)}"
    return ""


def first_uptime(parsed: dict[str, list], kind: str) -> float:
    """The guest's uptime on the first BVM-<kind> line of a parse_log result (nan without one)."""
    d = parsed.get(kind)
    return num(d[0].get("uptime")) if d else float("nan")


def parse_kv(text: str) -> dict[str, str]:
    """'a=1 b=x y=2' -> {'a': '1', 'b': 'x', 'y': '2'} (tokens without '=' are ignored)."""
    d = {}
    for tok in text.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            d[k] = v
    return d


def parse_log(text: str) -> dict[str, list]:
    """Collects the BVM-* lines of a serial log: {'RESULT': [dict, ...], 'SWIOTLB': [...], ...}.
    'LOG' entries are kept as plain strings."""
    out: dict[str, list] = {k: [] for k in ("RESULT", "SWIOTLB", "BOOT", "INFO", "POWERDOWN", "DONE",
                                            "LOG")}
    for raw in text.splitlines():
        line = raw.replace("\r", "").rstrip()
        m = _BVM_LINE.search(line)
        if not m:
            continue
        kind, rest = m.group(1), m.group(2) or ""
        out[kind].append(rest if kind == "LOG" else parse_kv(rest))
    return out


def num(v) -> float:
    """float() that turns 'na'/''/None into nan."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def check_fio_verify(r: dict, describe=lambda: "") -> dict:
    """Asserts that a fio-verify BVM-RESULT (rig 1 or rig 2) verified what it wrote: status ok,
    no fio or verify error, reads and writes done, and the verify pass re-read every written
    byte (verify_kib == write_kib > 0; images/init derives verify_kib from fio's byte counts).
    A fio run cut short before its verify pass exits 0 with verify_errors=0: only this last
    check tells it apart. `describe` is called for the failure message."""
    def fail(what):
        raise AssertionError(f"fio-verify: {what}: {r}\n{describe()}")
    if r.get("status") != "ok":
        fail(f"status={r.get('status')} reason={r.get('reason')}")
    if r.get("verify_errors") != "0" or r.get("fio_error") != "0":
        fail("fio or verify errors")
    if not (num(r.get("write_iops")) > 0 and num(r.get("read_iops")) > 0):
        fail("no reads or no writes")
    w, v = num(r.get("write_kib")), num(r.get("verify_kib"))  # nan when absent: fails
    if not (w > 0 and v == w):
        fail(f"the verify pass did not re-read every written block (verify_kib={r.get('verify_kib')}"
             f" write_kib={r.get('write_kib')})")
    return r


# ----------------------------------------------------------------------------- process helpers

def _kill_group(p: subprocess.Popen, grace: float = 2.0) -> None:
    if p.poll() is not None:
        # the leader is gone; children of its group may remain
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=5)


_seq = itertools.count()


def out_path(name: str, suffix: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return OUT_DIR / f"{safe}{suffix}"


def make_raw_image(path: os.PathLike | str, size: int | str = "256M") -> Path:
    """Creates (or truncates to) a sparse raw image. size: bytes or '256M'/'1G'."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(size, str):
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(size[:-1]) * mult[size[-1].upper()] if size[-1].upper() in mult else int(size)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# ----------------------------------------------------------------------------- device arguments

def _iommu(iommu: bool) -> str:
    return ",iommu_platform=on,disable-legacy=on" if iommu else ""


def blk_builtin(image, id: str = "d0", iommu: bool = False, cache_direct: bool = True,
                extra: str = "") -> list[str]:
    """QEMU's own virtio-blk-pci on a raw image."""
    cache = "cache=none,aio=native" if cache_direct else "cache=writeback,aio=threads"
    return ["-drive", f"file={image},format=raw,if=none,id={id},{cache}",
            "-device", f"virtio-blk-pci,drive={id}{_iommu(iommu)}{extra}"]


def blk_vhost_user(socket, id: str = "vu0", num_queues: int = 1, iommu: bool = False,
                   extra: str = "") -> list[str]:
    """vhost-user-blk-pci connected to a backend listening on a unix socket."""
    return ["-chardev", f"socket,id={id},path={socket}",
            "-device", f"vhost-user-blk-pci,chardev={id},num-queues={num_queues}{_iommu(iommu)}{extra}"]


def net_vhost_user(socket, id: str = "vun0", mac: str = "52:54:00:12:34:57", iommu: bool = False,
                   extra: str = "", queues: int = 1) -> list[str]:
    """virtio-net-pci backed by a vhost-user net backend (QEMU has no 'vhost-user-net-pci' device:
    it is -netdev vhost-user + -device virtio-net-pci). vectors=0 (INTx): QEMU 7.2 under TCG
    segfaults when the guest starts a vhost-user-net device with MSI-X (ENVIRONMENT.md).
    queues > 1: that many queue pairs (netdev queues=N, device mq=on)."""
    nq, mq = (f",queues={queues}", ",mq=on") if queues > 1 else ("", "")
    return ["-chardev", f"socket,id={id},path={socket}",
            "-netdev", f"vhost-user,id=net_{id},chardev={id}{nq}",
            "-device", f"virtio-net-pci,netdev=net_{id},mac={mac},vectors=0{mq}{_iommu(iommu)}{extra}"]


def net_tap(ifname: str, id: str = "n0", mac: str = "52:54:00:12:34:56", iommu: bool = False,
            vectors0: bool = True, extra: str = "") -> list[str]:
    """QEMU's own virtio-net-pci on a tap (QEMU opens it: run the guest inside the tap's netns).
    vectors=0 by default, to compare like for like with vhost-user-net."""
    vec = ",vectors=0" if vectors0 else ""
    return ["-netdev", f"tap,id={id},ifname={ifname},script=no,downscript=no,vhost=off",
            "-device", f"virtio-net-pci,netdev={id},mac={mac}{vec}{_iommu(iommu)}{extra}"]


# ----------------------------------------------------------------------------- guest clock

# The host kernel's figure for its TSC rate, in the words its log prints it: the refined
# calibration when there is one, else the rate it detected (a "MHz TSC" line follows the
# "MHz processor" one when the two differ).
_HOST_TSC_LOG = (re.compile(r"tsc: Refined TSC clocksource calibration: (\d+)\.(\d{3}) MHz"),
                 re.compile(r"tsc: Detected (\d+)\.(\d{3}) MHz TSC"),
                 re.compile(r"tsc: Detected (\d+)\.(\d{3}) MHz processor"))
_NR_PERF_EVENT_OPEN_X86_64 = 298


def tsc_khz_from_kernel_log(text: str) -> int | None:
    """The TSC rate (kHz) a kernel log states, or None (see _HOST_TSC_LOG)."""
    for pattern in _HOST_TSC_LOG:
        found = pattern.findall(text)
        if found:
            mhz, frac = found[-1]
            return int(mhz) * 1000 + int(frac)
    return None


def _tsc_khz_counted(seconds: float = 0.2) -> int | None:
    """The host TSC's rate (kHz) counted by perf's msr PMU (event tsc, CPU 0) against
    CLOCK_MONOTONIC_RAW over `seconds`; None where that cannot be done (not x86-64, no msr PMU,
    perf_event_open refused) or the clock reads around the counts were too far apart."""
    try:
        pmu = int(Path("/sys/bus/event_source/devices/msr/type").read_text())
    except (OSError, ValueError):
        return None
    if os.uname().machine != "x86_64":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = struct.pack("IIQ", pmu, 64, 0).ljust(64, b"\0")  # perf_event_attr v0, config 0: tsc
    fd = libc.syscall(_NR_PERF_EVENT_OPEN_X86_64, attr, -1, 0, -1, 0)  # every task on CPU 0
    if fd < 0:
        return None

    def sample() -> tuple[int, int, int]:
        """(count, ns at the middle of the clock reads around it, ns between them): the
        narrowest of a few tries."""
        best = (0, 0, 1 << 62)
        for _ in range(5):
            t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)
            count = struct.unpack("Q", os.read(fd, 8))[0]
            t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)
            if t1 - t0 < best[2]:
                best = (count, (t0 + t1) // 2, t1 - t0)
        return best

    try:
        c0, t0, e0 = sample()
        time.sleep(seconds)
        c1, t1, e1 = sample()
    finally:
        os.close(fd)
    if c1 <= c0 or (e0 + e1) * 1000 > t1 - t0:  # no count, or more than 0.1 % uncertain
        return None
    return round((c1 - c0) * 1_000_000 / (t1 - t0))


def host_tsc_khz() -> tuple[int | None, str]:
    """(the host TSC's rate in kHz, where it comes from), or (None, why it is unknown).

    A TCG guest's TSC is the host's (QEMU's rdtsc reads the host counter), but the guest kernel
    measures its rate at boot against the PIT, and the PIT's start and the first TSC read are two
    steps: a vCPU thread descheduled between them (a loaded host) measures too short a window and
    too low a rate, and the kernel trusts the PIT when it disagrees with the HPET. The guest's
    clock then runs fast by that factor (1.5x-10x) until its clocksource watchdog drops the TSC,
    and its soft-lockup and RCU-stall detectors take seconds of host time for minutes.
    tsc_words() passes this rate as tsc_early_khz=, which skips that measurement (the guest
    still refines the rate against its HPET, within 1 %).

    From, in order: BVM_HOST_TSC_KHZ (read at every call); the host kernel's log (dmesg); a
    count of the TSC (perf's msr PMU) over 0.2 s (those two found once per process)."""
    env = os.environ.get("BVM_HOST_TSC_KHZ")
    if env:
        if not env.isdigit() or int(env) == 0:
            raise ValueError(f"BVM_HOST_TSC_KHZ={env!r}: expected the host TSC's rate in kHz")
        return int(env), "BVM_HOST_TSC_KHZ"
    return _found_host_tsc_khz()


@functools.lru_cache(maxsize=None)
def _found_host_tsc_khz() -> tuple[int | None, str]:
    """host_tsc_khz without BVM_HOST_TSC_KHZ: the host kernel's log, else a count."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        log = ""
    khz = tsc_khz_from_kernel_log(log)
    if khz:
        return khz, "the host kernel's log"
    khz = _tsc_khz_counted()
    if khz:
        return khz, "counted with perf's msr/tsc/ event"
    return None, ("not in the host kernel's log and perf's msr/tsc/ event unavailable: the guest "
                  "measures it, which a loaded host can disturb (set BVM_HOST_TSC_KHZ)")


def tsc_words() -> list[str]:
    """The kernel command-line words that give a TCG guest the host TSC's rate (host_tsc_khz),
    for every rig-1 guest and rig 2's L1; none when that rate is unknown."""
    khz, _ = host_tsc_khz()
    return [f"tsc_early_khz={khz}"] if khz else []


# ----------------------------------------------------------------------------- guest

class ResultChecks:
    """The checks on a boot's outcome that rig 1 and rig 2 share. The subclass gives `name`,
    `results` (the BVM-RESULT dicts of the guest under test), `unclean_end` and `describe()`;
    `RUN` names the run and `GUEST` prefixes the guest's lines in the errors."""
    RUN = "guest"
    GUEST = ""

    def result(self, test: str) -> dict:
        """The BVM-RESULT dict of one test; AssertionError with the log tail if absent."""
        for r in self.results:
            if r.get("test") == test:
                return r
        raise AssertionError(f"no {self.GUEST}BVM-RESULT for test={test}\n{self.describe()}")

    def ok(self, test: str) -> dict:
        """result(test), asserting status=ok."""
        r = self.result(test)
        if r.get("status") != "ok":
            raise AssertionError(f"{self.GUEST}test={test} status={r.get('status')} "
                                 f"reason={r.get('reason')}\n{self.describe()}")
        return r

    def assert_clean_end(self):
        """AssertionError (with the log tail) unless the run ended clean (unclean_end); else
        the run itself."""
        why = self.unclean_end
        if why:
            raise AssertionError(f"{self.RUN} {self.name} did not end clean: {why}\n{self.describe()}")
        return self

    def fio_verified(self, test: str = "fio-verify") -> dict:
        """ok(test) + check_fio_verify (the verify pass re-read every written byte)."""
        return check_fio_verify(self.ok(test), self.describe)


@dataclass
class GuestRun(ResultChecks):
    """The outcome of one guest boot."""
    name: str
    argv: list[str]
    log_path: Path
    log: str
    returncode: int | None
    timed_out: bool
    wall_s: float
    parsed: dict[str, list] = field(default_factory=dict)

    @property
    def results(self) -> list[dict]:
        return self.parsed.get("RESULT", [])

    @property
    def swiotlb(self) -> dict[str, dict]:
        """{'before': {...}, 'after': {...}} from the BVM-SWIOTLB lines."""
        return {d.get("when", "?"): d for d in self.parsed.get("SWIOTLB", [])}

    @property
    def boot_s(self) -> float:
        """Seconds from kernel start to /init (the guest's own clock)."""
        return first_uptime(self.parsed, "BOOT")

    @property
    def uptime_s(self) -> float:
        """The guest's uptime at BVM-DONE (its own clock; nan without BVM-DONE). Above wall_s
        (the host's, which also counts QEMU's start and the firmware), the guest clock ran
        fast."""
        return first_uptime(self.parsed, "DONE")

    @property
    def done(self) -> bool:
        return bool(self.parsed.get("DONE"))

    @property
    def booted(self) -> bool:
        """/init started (BVM-BOOT seen)."""
        return bool(self.parsed.get("BOOT"))

    @property
    def kernel_crash(self) -> str:
        """The first Oops/BUG/panic line of the guest kernel, or ''."""
        return first_crash(self.log)

    @property
    def boot_crash(self) -> bool:
        """The guest kernel died before /init: nothing the devices under test did. Seen under
        multi-threaded TCG as 'Oops: int3' right after the kernel patched its own code (a
        static-key flip) -- a QEMU TCG race, not a bouncevm bug."""
        return not self.booted and bool(self.kernel_crash)

    retried: list["GuestRun"] = field(default_factory=list)

    @property
    def unclean_end(self) -> str:
        """Why this run did not end clean ('' if it did): a host-side timeout, a guest kernel
        crash/lockup/stall (even after the last result line), no BVM-DONE, the guest watchdog
        (reason=guest-timeout), or QEMU exiting non-zero (it crashed or was killed)."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f}s (host side)"
        if self.kernel_crash:
            return f"guest kernel crash: {self.kernel_crash}"
        if any(r.get("reason") == "guest-timeout" for r in self.results):
            return "the guest's watchdog fired (reason=guest-timeout)"
        if not self.done:
            return "the guest never reached BVM-DONE"
        if self.returncode != 0:
            return f"QEMU exited rc={self.returncode}"
        return ""

    def describe(self, tail: int = 40) -> str:
        lines = self.log.replace("\r", "").splitlines()
        crash = f" kernel_crash={self.kernel_crash!r}" if self.kernel_crash else ""
        retried = (f" after {len(self.retried)} boot crash(es) (logs: "
                   + ", ".join(str(r.log_path) for r in self.retried) + ")") if self.retried else ""
        tsc = "" if any("tsc_early_khz=" in a for a in self.argv) else \
            f"guest TSC rate: {host_tsc_khz()[1]}\n"
        return (f"guest {self.name}: rc={self.returncode} timed_out={self.timed_out} "
                f"wall={self.wall_s:.1f}s guest_uptime={self.uptime_s:.1f}s "
                f"log={self.log_path}{crash}{retried}\n"
                f"argv: {shlex.join(self.argv)}\n{tsc}{self._crash_block(lines, tail)}"
                f"--- last {tail} log lines ---\n" + "\n".join(lines[-tail:]))

    def _crash_block(self, lines: list[str], tail: int, most: int = 120) -> str:
        """The guest kernel's crash report from its first line on (registers, code bytes, call
        trace), when the log tail would cut its head off; '' without a crash."""
        first = next((i for i, line in enumerate(lines) if _CRASH.search(line)), None)
        if first is None or first >= len(lines) - tail:
            return ""
        start = max(0, first - 5)
        block = lines[start:start + most]
        return (f"--- the kernel's crash report, log lines {start + 1}-{start + len(block)} ---\n"
                + "\n".join(block) + "\n")


class Guest:
    """One rig-1 QEMU guest. Use as a context manager, or run() for start+wait.

    test: value for bvm.test= (e.g. 'fio-verify' or 'fio-verify,fio-randread');
    params: more bvm.* parameters ({'size': '64M'} -> bvm.size=64M);
    devices: extra QEMU arguments (see blk_builtin, blk_vhost_user, net_tap, net_vhost_user);
    append: extra kernel command line words (e.g. 'swiotlb=force');
    netns: a NetNS to run QEMU in (needed for tap devices living in the namespace).
    """

    def __init__(self, name: str, test: str, params: dict | None = None,
                 devices: Sequence[str] = (), append: str | Iterable[str] = "",
                 mem: str = DEFAULT_MEM, smp: int = DEFAULT_SMP, timeout: float = DEFAULT_TIMEOUT,
                 netns: "NetNS | None" = None, qemu: str | None = None, extra_qemu: Sequence[str] = ()):
        self.name = name
        self.test = test
        self.params = dict(params or {})
        self.devices = list(devices)
        self.append = append if isinstance(append, str) else " ".join(append)
        self.mem = mem
        self.smp = smp
        self.timeout = timeout
        self.netns = netns
        self.qemu = qemu
        self.extra_qemu = list(extra_qemu)
        self.proc: subprocess.Popen | None = None
        self.log_path = out_path(name, ".serial.log")
        self._t0 = 0.0
        self._logf = None
        self._attempt = 0

    def kernel_cmdline(self) -> str:
        words = ["console=ttyS0", "quiet", "panic=-1", f"bvm.test={self.test}"]
        words += tsc_words()
        # guest-side watchdog a little before the host-side timeout, so a hang still reports
        params = {"timeout": max(10, int(self.timeout) - 10), **self.params}
        for k, v in params.items():
            words.append(f"bvm.{k}={v}")
        if self.append:
            words.append(self.append)
        return " ".join(words)

    def argv(self) -> list[str]:
        img = images()
        qemu = self.qemu or require_qemu()
        a = [qemu,
             "-machine", "q35", "-accel", f"tcg,thread={tcg_thread()}", "-cpu", "max",
             "-smp", str(self.smp), "-m", self.mem,
             "-object", f"memory-backend-memfd,id=mem,size={self.mem},share=on",
             "-numa", "node,memdev=mem",
             "-kernel", str(img.vmlinuz), "-initrd", str(img.initramfs),
             "-append", self.kernel_cmdline(),
             "-nographic", "-no-reboot", "-display", "none", "-serial", "stdio",
             "-monitor", "none", "-nic", "none"]
        a += self.devices + self.extra_qemu
        if self.netns is not None:
            a = self.netns.exec_prefix() + a
        return a

    def start(self) -> "Guest":
        if self._attempt:
            self.log_path = out_path(f"{self.name}.retry{self._attempt}", ".serial.log")
        argv = self.argv()
        self._argv = argv
        self._logf = open(self.log_path, "wb")
        self._logf.write(("# " + shlex.join(argv) + "\n").encode())
        self._logf.flush()
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout: float | None = None) -> GuestRun:
        assert self.proc is not None, "start() first"
        timeout = self.timeout if timeout is None else timeout
        timed_out = False
        remaining = timeout - (time.monotonic() - self._t0)
        try:
            self.proc.wait(timeout=max(0.1, remaining))
        except subprocess.TimeoutExpired:
            timed_out = True
        wall = time.monotonic() - self._t0
        self.kill()
        log = self.log_path.read_bytes().decode("utf-8", "replace")
        run = GuestRun(self.name, self._argv, self.log_path, log, self.proc.returncode,
                       timed_out, wall, parse_log(log))
        return run

    def kill(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
        if self._logf is not None:
            self._logf.close()
            self._logf = None

    def run(self, boot_retries: int = 1, on_retry=None, clean_end: bool = True) -> GuestRun:
        """start + wait + kill. If the guest kernel crashed before /init (GuestRun.boot_crash,
        a TCG race unrelated to the devices), boot again, up to boot_retries times. Before
        booting again, every running Backend this guest's devices connect to is restarted
        (Backend.serving), so the run returned is the only session its back ends saw: their
        statistics (connections, requests, bytes) describe that run alone. Then on_retry() is
        called, for anything else to reset. The crashed runs are kept in GuestRun.retried.
        Crashes after /init are never retried. clean_end (default): assert the run ended clean
        (GuestRun.assert_clean_end); only a test that expects a bad end (e.g. the harness's
        own timeout test) turns it off."""
        crashed: list[GuestRun] = []
        while True:
            with self:
                run = self.wait()
            if not self.boot_again(run, crashed, boot_retries, on_retry):
                run.retried = crashed
                if clean_end:
                    run.assert_clean_end()
                return run

    def boot_again(self, run: GuestRun, crashed: list[GuestRun], boot_retries: int,
                   on_retry=None) -> bool:
        """After `run` ended: True when it crashed before /init and fewer than boot_retries
        boots have (`crashed`, which gets `run`); then every running Backend it connected to is
        restarted, on_retry() called, and the next start() is the next attempt. Guest.run's
        retry, for tests that drive a guest by hand."""
        if not run.boot_crash or len(crashed) >= boot_retries:
            return False
        crashed.append(run)
        self._attempt += 1
        for backend in Backend.serving(run.argv):
            backend.restart()
        if on_retry is not None:
            on_retry()
        return True

    def __enter__(self) -> "Guest":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def run_guest(name: str, test: str, boot_retries: int = 1, on_retry=None, clean_end: bool = True,
              **kw) -> GuestRun:
    """Guest(name, test, **kw).run(boot_retries, on_retry, clean_end): every run it returns
    ended clean (no crash, BVM-DONE, QEMU rc 0, no timeout) unless clean_end=False."""
    return Guest(name, test, **kw).run(boot_retries=boot_retries, on_retry=on_retry,
                                       clean_end=clean_end)


# ----------------------------------------------------------------------------- backends

def _abspath(p: os.PathLike | str) -> Path:
    """p made absolute, without resolving symlinks (how a socket path is compared)."""
    return Path(os.path.abspath(p))


class Backend:
    """A host process serving a vhost-user socket (qemu-storage-daemon, bouncevm-vhost, ...).

    Started in its own process group, with output to tests/out/NAME.backend.log; start() waits
    until the socket exists (or the process dies: Missing is NOT raised then, RuntimeError is).
    While started it is found by its socket (Backend.serving), which Guest.run uses to give a
    retried boot fresh back ends.
    """

    # socket path -> the started Backend serving it
    _started: dict[Path, "Backend"] = {}

    def __init__(self, name: str, argv: Sequence[str], socket: os.PathLike | str,
                 ready_timeout: float = 20.0, env: dict | None = None, netns: "NetNS | None" = None):
        self.name = name
        self.argv = list(argv)
        if netns is not None:
            self.argv = netns.exec_prefix() + self.argv
        self.socket = Path(socket)
        self.ready_timeout = ready_timeout
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log_path = out_path(name, ".backend.log")
        self._logf = None

    def start(self) -> "Backend":
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log_path, "wb")
        self._logf.write(("# " + shlex.join(self.argv) + "\n").encode())
        self._logf.flush()
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._logf,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + self.ready_timeout
        while not self.socket.exists():
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"backend {self.name} exited rc={self.proc.returncode} before "
                                   f"creating {self.socket}:\n{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"backend {self.name} made no socket {self.socket} in "
                                   f"{self.ready_timeout}s:\n{self.log()[-2000:]}")
            time.sleep(0.05)
        Backend._started[_abspath(self.socket)] = self
        return self

    @classmethod
    def serving(cls, qemu_argv: Sequence[str]) -> list["Backend"]:
        """The started back ends whose sockets a QEMU command line connects to (its
        `-chardev socket,...,path=SOCKET` arguments), in command-line order."""
        found = []
        for arg in qemu_argv:
            opts = arg.split(",")
            if opts[0] != "socket":
                continue
            for o in opts[1:]:
                b = cls._started.get(_abspath(o[len("path="):])) if o.startswith("path=") else None
                if b is not None and b not in found:
                    found.append(b)
        return found

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> "Backend":
        """stop() + start() (log appended to a new file NAME.restartN.backend.log)."""
        self.stop()
        self._restarts = getattr(self, "_restarts", 0) + 1
        self.log_path = out_path(f"{self.name}.restart{self._restarts}", ".backend.log")
        return self.start()

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes().decode("utf-8", "replace")
        return ""

    def stop(self) -> None:
        if Backend._started.get(_abspath(self.socket)) is self:
            del Backend._started[_abspath(self.socket)]
        if self.proc is not None:
            _kill_group(self.proc)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def __enter__(self) -> "Backend":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def read_stats(path: os.PathLike | str, timeout: float = 5.0) -> dict:
    """One JSON line from a bouncevm-vhost statistics socket (--stats-socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def qsd_vhost_user_blk(name: str, image, socket, num_queues: int = 1, direct: bool = True,
                       writable: bool = True) -> Backend:
    """qemu-storage-daemon exporting a raw image as vhost-user-blk on a unix socket."""
    qsd = require_qsd()
    cache = "cache.direct=on,aio=native" if direct else "cache.direct=off,aio=threads"
    argv = [qsd,
            "--blockdev", f"driver=file,node-name=file0,filename={image},{cache}",
            "--blockdev", "driver=raw,node-name=disk0,file=file0",
            "--export", f"type=vhost-user-blk,id=exp0,addr.type=unix,addr.path={socket},"
                        f"node-name=disk0,writable={'on' if writable else 'off'},num-queues={num_queues}"]
    return Backend(name, argv, socket)


# ----------------------------------------------------------------------------- network namespace

def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed rc={r.returncode}: {r.stderr.strip()}")
    return r


class NetNS:
    """A network namespace owned by the test, with a tap device inside for QEMU.

    host side (in the namespace): tap `tap` with `host_ip`; guest: `guest_ip` (pass
    guest_cidr as bvm.ip). QEMU must run inside (Guest(..., netns=ns)) so it can open the tap.
    start_iperf3() runs an iperf3 server bound to host_ip inside the namespace.
    Everything is removed by close() / the context manager exit.
    """

    _n = itertools.count()

    def __init__(self, prefix: str = "bvm", subnet: str = "10.213.0", tap: str = "bvmtap0",
                 multi_queue: bool = False):
        self.name = f"{prefix}{os.getpid()}x{next(self._n)}"
        self.tap = tap
        self.multi_queue = multi_queue  # a tap a multi-queue backend can open (one fd per queue)
        self.host_ip = f"{subnet}.1"
        self.guest_ip = f"{subnet}.2"
        self.guest_cidr = f"{self.guest_ip}/24"
        self._procs: list[subprocess.Popen] = []
        self._created = False

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def create(self) -> "NetNS":
        require_root()
        require_tun()
        require_cmd("ip")
        _run(["ip", "netns", "add", self.name])
        self._created = True
        try:
            ex = self.exec_prefix()
            _run(ex + ["ip", "link", "set", "lo", "up"])
            mq = ["multi_queue"] if self.multi_queue else []
            _run(ex + ["ip", "tuntap", "add", "dev", self.tap, "mode", "tap", *mq])
            _run(ex + ["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.tap])
            _run(ex + ["ip", "link", "set", self.tap, "up"])
        except Exception:
            self.close()
            raise
        return self

    def popen(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
        """Starts a process inside the namespace (own process group, log in tests/out/)."""
        logf = open(out_path(name, ".log"), "wb")
        p = subprocess.Popen(self.exec_prefix() + list(argv), stdin=subprocess.DEVNULL,
                             stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        logf.close()
        self._procs.append(p)
        return p

    def start_iperf3(self, port: int = 5201) -> subprocess.Popen:
        iperf3 = require_cmd("iperf3")
        p = self.popen(f"{self.name}.iperf3", [iperf3, "-s", "-B", self.host_ip, "-p", str(port)])
        self._wait_listening(p, port, "iperf3 server")
        return p

    def start_sha_server(self, blob: bytes, port: int = 5301) -> Path:
        """An HTTP server on host_ip:port inside the namespace for images/init's net-sha test:
        GET /blob answers `blob`; POST /up answers (and writes to the returned file) the sha256
        of the body it received."""
        blob_path = out_path(f"{self.name}.blob", ".bin")
        blob_path.write_bytes(blob)
        got = out_path(f"{self.name}.upload", ".sha256")
        got.unlink(missing_ok=True)
        script = (
            "import hashlib, http.server, sys\n"
            "blob = open(sys.argv[1], 'rb').read()\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def _send(self, body):\n"
            "        self.send_response(200); self.send_header('Content-Length', str(len(body)))\n"
            "        self.end_headers(); self.wfile.write(body)\n"
            "    def do_GET(self):\n"
            "        self._send(blob)\n"
            "    def do_POST(self):\n"
            "        n = int(self.headers.get('Content-Length', 0)); h = hashlib.sha256()\n"
            "        while n > 0:\n"
            "            c = self.rfile.read(min(n, 1 << 20))\n"
            "            if not c: break\n"
            "            h.update(c); n -= len(c)\n"
            "        d = h.hexdigest(); open(sys.argv[4], 'w').write(d); self._send(d.encode())\n"
            "http.server.HTTPServer((sys.argv[2], int(sys.argv[3])), H).serve_forever()\n")
        py = require_cmd("python3")
        p = self.popen(f"{self.name}.shaserver",
                       [py, "-c", script, str(blob_path), self.host_ip, str(port), str(got)])
        self._wait_listening(p, port, "sha server")
        return got

    def _wait_listening(self, p: subprocess.Popen, port: int, what: str) -> None:
        """Waits (at most 10 s) until `p`, named `what` in errors, listens on TCP `port` inside
        the namespace; raises if it exits or never listens."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = _run(self.exec_prefix() + ["ss", "-ltn", f"sport = :{port}"], check=False)
            if f":{port}" in r.stdout:
                return
            if p.poll() is not None:
                raise RuntimeError(f"{what} exited rc={p.returncode}")
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not start listening")

    def close(self) -> None:
        for p in self._procs:
            _kill_group(p)
        self._procs.clear()
        if self._created:
            _run(["ip", "netns", "del", self.name], check=False)
            self._created = False

    def __enter__(self) -> "NetNS":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- disk patterns

def pattern_block(seed: str, offset: int, length: int = 4096) -> bytes:
    """The bytes images/init's write-pattern puts at `offset` (same generator as the guest):
    lines 'bvm-pattern SEED OFFSET(%016d) LINE(%08d)\\n' concatenated, cut to `length`."""
    parts, n, i = [], 0, 0
    while n < length:
        s = f"bvm-pattern {seed} {offset:016d} {i:08d}\n".encode()
        parts.append(s)
        n += len(s)
        i += 1
    return b"".join(parts)[:length]


def write_pattern(image, offsets: Iterable[int], seed: str = "bvm", length: int = 4096) -> None:
    """Host side: writes pattern blocks into a raw image (for the guest's read-pattern test)."""
    with open(image, "r+b") as f:
        for o in offsets:
            f.seek(o)
            f.write(pattern_block(seed, o, length))
        f.flush()
        os.fsync(f.fileno())


def check_pattern(image, offsets: Iterable[int], seed: str = "bvm", length: int = 4096) -> list[int]:
    """Host side: offsets whose contents differ from the pattern (empty list: all match)."""
    bad = []
    with open(image, "rb") as f:
        for o in offsets:
            f.seek(o)
            if f.read(length) != pattern_block(seed, o, length):
                bad.append(o)
    return bad


def pattern_params(offsets: Iterable[int], seed: str = "bvm", length: int = 4096) -> dict:
    """bvm.* parameters for write-pattern / read-pattern."""
    return {"offsets": ",".join(str(o) for o in offsets), "seed": seed, "plen": length}


# ----------------------------------------------------------------------------- figures

def record_figures(name: str, **figures) -> Path:
    """Appends one JSON line with measured figures to tests/out/figures.jsonl."""
    p = out_path("figures", ".jsonl")
    with open(p, "a") as f:
        f.write(json.dumps({"name": name, "time": time.time(), **figures}) + "\n")
    return p
