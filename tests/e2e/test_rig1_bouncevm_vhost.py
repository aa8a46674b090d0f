"""Rig 1 with bouncevm's own devices: `bouncevm-vhost` serving QEMU 7.2 over vhost-user.

Tests: fio --verify over vhost-user-blk with bounce forced (host statistics show the
maps and the bytes), the double bounce (guest swiotlb=force + iommu_platform=on), a qcow2 image
written by the guest, every allocator in turn, and iperf3 both ways over vhost-user-net.

The binary is `$BVM_VHOST`, else `target/release/bouncevm-vhost` (`$CARGO_TARGET_DIR` honoured);
without it the tests skip with the reason. Every test has a hard timeout (each boot has the
harness's timeout; the backend is killed with its process group on exit).
"""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import rig1
from rig1 import (Backend, NetNS, blk_vhost_user, images, make_raw_image, net_vhost_user, num,
                  out_path, record_figures, require_qemu, require_root, require_tun, run_guest,
                  skip_if_missing)

REPO = Path(__file__).resolve().parents[2]

# Short fio runs: 10 allocators x one boot each must fit the suite's budget on 2 cores.
FIO_SHORT = {"size": "16M", "iodepth": 8}


def _binary() -> str:
    return rig1.require_binary("bouncevm-vhost", "BVM_VHOST")


def _prereqs(tun: bool = False) -> str:
    require_root()
    if tun:
        require_tun()
    require_qemu()
    images()
    return _binary()


def _final_stats(path: Path, timeout: float = 10.0) -> dict:
    """Statistics once the frontend has gone (QEMU exited): the session's counters are final."""
    deadline = time.monotonic() + timeout
    while True:
        st = rig1.read_stats(path)
        if not st["server"]["connected"] or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def _served_run(backend: Backend, stats: Path | None, name: str, tests: str,
                **kw) -> tuple[rig1.GuestRun, dict | None]:
    """Boots guest `name` running `tests` (run_guest's keywords) while `backend` serves it and
    then stops the backend: the run, and the backend's final statistics read from `stats`
    (None without)."""
    with backend:
        run = run_guest(name, tests, **kw)
        assert backend.alive(), backend.log()[-2000:]
        st = _final_stats(stats) if stats else None
    return run, st


def _blk_backend(name: str, binary: str, image: Path, bounce: str | None = "policy=force",
                 fmt: str = "raw", extra: tuple[str, ...] = ()) -> tuple[Backend, Path, Path]:
    sock = out_path(name, ".sock")
    stats = out_path(name, ".stats")
    argv = [binary, "blk", "--socket", str(sock), "--file", str(image), "--format", fmt,
            "--stats-socket", str(stats), *extra]
    if bounce:
        argv += ["--bounce", bounce]
    return Backend(name, argv, socket=sock, env={"BOUNCEVM_LOG": "info"}), sock, stats


def _check_fio_verify(run) -> dict:
    """The verify pass ran over every written byte (rig1.check_fio_verify)."""
    return run.fio_verified()


def _check_host_bounce(st: dict, what: str) -> dict:
    b = st["bounce"]
    assert b is not None, f"{what}: no bounce pool in the statistics: {st}"
    assert b["maps"] > 0 and b["unmaps"] > 0, f"{what}: no maps: {b}"
    assert b["bytes_to_device"] > 0 and b["bytes_from_device"] > 0, f"{what}: no bytes: {b}"
    assert b["map_failures"] == 0, f"{what}: pool full: {b}"
    assert b["used"] == 0, f"{what}: slots leaked after the guest finished: {b}"
    return b


def _guest_hiwater(run) -> float:
    after = run.swiotlb.get("after") or {}
    assert after.get("present") == "1", f"no swiotlb pool in the guest\n{run.describe()}"
    h = num(after.get("hiwater"))
    if h != h:  # nan: 6.1 kernels have no io_tlb_used_hiwater
        pytest.fail(f"kernel {images().kernel_release} has no io_tlb_used_hiwater: {after}")
    return h


# A line QEMU prints on its stderr (merged into the serial log): "qemu-system-x86_64: ...".
_QEMU_MSG = re.compile(r"^qemu-system[^:\s]*: .*$", re.MULTILINE)


def _qemu_messages(run) -> list[str]:
    """What QEMU printed on stderr during the run (warnings, protocol errors)."""
    return _QEMU_MSG.findall(run.log.replace("\r", ""))


@skip_if_missing
def test_bvm_vhost_blk_fio_verify_bounce_forced():
    binary = _prereqs()
    img = make_raw_image(out_path("bvm_blk", ".img"), "256M")
    backend, sock, stats = _blk_backend("bvm_blk", binary, img)
    run, st = _served_run(backend, stats, "bvm_blk_fio_verify", "fio-verify,fio-randread",
                          params={"size": "32M", "runtime": 5}, devices=blk_vhost_user(sock))
    v = _check_fio_verify(run)
    rr = run.ok("fio-randread")
    assert _qemu_messages(run) == [], run.describe()
    b = _check_host_bounce(st, "bounce forced")
    assert st["device"]["metrics"]["reqs_in"] > 0 and st["device"]["metrics"]["reqs_out"] > 0, st
    record_figures("bvm_vhost_blk_forced", boot_s=run.boot_s, wall_s=run.wall_s,
                   verify_read_iops=num(v["read_iops"]), verify_write_iops=num(v["write_iops"]),
                   randread_4k_iops=num(rr["read_iops"]), host_maps=b["maps"],
                   host_bytes_to_device=b["bytes_to_device"],
                   host_bytes_from_device=b["bytes_from_device"])
    print(f"bouncevm-vhost blk (bounce forced): 4k randread {rr['read_iops']} IOPS; "
          f"host maps={b['maps']} to_dev={b['bytes_to_device']} from_dev={b['bytes_from_device']}")


@skip_if_missing
def test_bvm_vhost_blk_double_bounce():
    """Guest swiotlb=force + iommu_platform=on (ACCESS_PLATFORM offered by bouncevm-vhost) and
    host bounce forced: both pools are used and the data still verifies."""
    binary = _prereqs()
    img = make_raw_image(out_path("bvm_blk_double", ".img"), "256M")
    backend, sock, stats = _blk_backend("bvm_blk_double", binary, img)
    run, st = _served_run(backend, stats, "bvm_blk_double_bounce", "fio-verify",
                          params={"size": "32M"}, append="swiotlb=force",
                          devices=blk_vhost_user(sock, iommu=True))
    _check_fio_verify(run)
    hiwater = _guest_hiwater(run)
    assert hiwater > 0, f"guest swiotlb never used: {run.swiotlb}"
    b = _check_host_bounce(st, "double bounce")
    acked = int(st["transport"]["acked_features"] or "0", 16)
    # QEMU strips ACCESS_PLATFORM when there is no vIOMMU (ENVIRONMENT.md): addresses stay
    # guest-physical. Record what was negotiated rather than assume it.
    record_figures("bvm_vhost_blk_double", guest_hiwater=hiwater, host_maps=b["maps"],
                   host_hiwater=b["used_hiwater"], access_platform_acked=bool(acked & (1 << 33)))
    print(f"double bounce: guest hiwater {hiwater} slots, host maps {b['maps']}, "
          f"host hiwater {b['used_hiwater']} slots")


@skip_if_missing
def test_bvm_vhost_blk_qcow2_written_by_guest():
    binary = _prereqs()
    qemu_img = rig1.require_cmd("qemu-img")
    img = out_path("bvm_qcow2", ".qcow2")
    img.unlink(missing_ok=True)
    subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", str(img), "64M"], check=True,
                   timeout=60)
    offs = [0, 4096 * 7, 5 << 20, (64 << 20) - 4096]
    backend, sock, _ = _blk_backend("bvm_qcow2", binary, img, fmt="qcow2")
    # fio first (it rewrites the start of the disk), then the pattern blocks.
    run, _ = _served_run(backend, None, "bvm_qcow2_write", "fio-verify,write-pattern",
                         params={**rig1.pattern_params(offs, seed="qcow2"), "size": "8M"},
                         devices=blk_vhost_user(sock))
    # The backend is stopped: the image is closed and flushed.
    assert run.ok("write-pattern")["blocks"] == str(len(offs))
    _check_fio_verify(run)
    chk = subprocess.run([qemu_img, "check", str(img)], capture_output=True, text=True, timeout=120)
    assert chk.returncode == 0, f"qemu-img check failed:\n{chk.stdout}\n{chk.stderr}"
    raw = out_path("bvm_qcow2", ".raw")
    subprocess.run([qemu_img, "convert", "-O", "raw", str(img), str(raw)], check=True, timeout=120)
    assert rig1.check_pattern(raw, offs, seed="qcow2") == [], "guest data differs on the host"
    raw.unlink(missing_ok=True)


@skip_if_missing
def test_bvm_vhost_blk_qemu_stderr_stays_clean():
    """Every QEMU 7.2 run with bouncevm-vhost blk printed "Unexpected
    end-of-file before all data were read". The backend dropped the backend-request channel
    (SET_BACKEND_REQ_FD, negotiated because ACCESS_PLATFORM is offered) as soon as it arrived,
    and QEMU read EOF on it. A boot with I/O and a guest power-off must leave QEMU silent, and
    the session must end with the guest's writes on the disk."""
    binary = _prereqs()
    img = make_raw_image(out_path("bvm_quiet", ".img"), "64M")
    offs = [0, 1 << 20, (64 << 20) - 4096]
    backend, sock, stats = _blk_backend("bvm_quiet", binary, img, bounce=None)
    run, st = _served_run(backend, stats, "bvm_quiet", "write-pattern",
                          params=rig1.pattern_params(offs, seed="quiet"),
                          devices=blk_vhost_user(sock))
    assert run.ok("write-pattern")["blocks"] == str(len(offs)), run.describe()
    assert run.done and not run.timed_out and run.returncode == 0, run.describe()
    assert _qemu_messages(run) == [], run.describe()
    assert st["server"]["connections"] == 1 and not st["server"]["connected"], st
    assert rig1.check_pattern(img, offs, seed="quiet") == [], "guest data not on the disk"


# swiotlb allocators run a swiotlb pool; the IOVA ones an IOVA domain (VDUSE-style).
ALLOCATORS = [
    ("legacy", "swiotlb"), ("bitmap", "swiotlb"), ("areas", "swiotlb"),
    ("areas-bitmap", "swiotlb"), ("iova-rbtree", "iova"), ("iova-rcache", "iova"),
    ("genpool", "iova"), ("iova-bitmap", "iova"),
    ("areas-lifo", "swiotlb"), ("magazine", "swiotlb"),
]


@pytest.mark.parametrize("alloc,mode", ALLOCATORS, ids=[a for a, _ in ALLOCATORS])
@skip_if_missing
def test_bvm_vhost_blk_each_allocator(alloc, mode):
    binary = _prereqs()
    img = make_raw_image(out_path(f"bvm_alloc_{alloc}", ".img"), "64M")
    slots = 32768 if mode == "swiotlb" else 16384
    backend, sock, stats = _blk_backend(f"bvm_alloc_{alloc}", binary, img,
                                        bounce=f"policy=force,mode={mode},alloc={alloc},slots={slots}")
    run, st = _served_run(backend, stats, f"bvm_alloc_{alloc}", "fio-verify", params=FIO_SHORT,
                          devices=blk_vhost_user(sock))
    v = _check_fio_verify(run)
    b = _check_host_bounce(st, alloc)
    assert b["allocator"] == alloc and b["mode"] == mode, b
    record_figures(f"bvm_alloc_{alloc}", verify_read_iops=num(v["read_iops"]),
                   verify_write_iops=num(v["write_iops"]), maps=b["maps"],
                   lock_wait_ns=b["lock_wait_ns"])


@skip_if_missing
def test_bvm_vhost_net_iperf3():
    binary = _prereqs(tun=True)
    rig1.require_cmd("iperf3")
    import hashlib

    blob = os.urandom(16 << 20)
    with NetNS() as ns:
        ns.start_iperf3()
        uploaded = ns.start_sha_server(blob)
        sock = out_path("bvm_net", ".sock")
        stats = out_path("bvm_net", ".stats")
        backend = Backend("bvm_net", [binary, "net", "--socket", str(sock), "--tap", ns.tap,
                                      "--bounce", "policy=force", "--stats-socket", str(stats)],
                          socket=sock, netns=ns, env={"BOUNCEVM_LOG": "info"})
        run, st = _served_run(backend, stats, "bvm_net_iperf3", "iperf3,net-sha",
                              params={"ip": ns.guest_cidr, "server": ns.host_ip,
                                      "time": 5, "shasize": 16,
                                      "sha": hashlib.sha256(blob).hexdigest()},
                              devices=net_vhost_user(sock, extra=",speed=10000,duplex=full"))
    r = run.ok("iperf3")
    tx, rx = num(r["guest_to_host_gbps"]), num(r["host_to_guest_gbps"])
    assert tx > 0 and rx > 0, run.describe()
    assert r["link_speed_mbps"] == "10000", run.describe()
    # QEMU 7.2 sends SET_VRING_ENABLE before SET_FEATURES; the relay applied it afterwards.
    relay = st["server"]["relay"]
    assert relay["early_enables_held"] > 0 and relay["early_enables_replayed"] > 0, relay
    b = st["bounce"]
    assert b and b["maps"] > 0, f"no bounce maps for net: {b}"
    # Payload checksummed end to end through the bounce path: 16 MiB each way over HTTP.
    sha = run.ok("net-sha")
    assert sha["download_sha"] == hashlib.sha256(blob).hexdigest(), run.describe()
    assert sha["upload_sha"] == uploaded.read_text().strip() == sha["host_upload_sha"], run.describe()
    # After the traffic the pool holds nothing, and it bounced at least the bytes that moved
    # (iperf3's bytes are not reported, so this bound counts the checksummed transfers only).
    assert b["used"] == 0 and b["map_failures"] == 0, f"net bounce slots leaked: {b}"
    moved = int(sha["bytes_each_way"])
    assert b["bytes_to_device"] >= moved and b["bytes_from_device"] >= moved, b
    record_figures("bvm_vhost_net", guest_to_host_gbps=tx, host_to_guest_gbps=rx,
                   boot_s=run.boot_s, host_maps=b["maps"])
    print(f"bouncevm-vhost net (bounce forced): guest->host {tx} Gbit/s, host->guest {rx} Gbit/s")


class _StatsPoller:
    """Polls a backend's statistics socket in the background and keeps the last snapshot taken
    while a frontend was connected (per-worker counters go with the session)."""

    def __init__(self, path: Path, period: float = 0.5):
        import threading
        self.path, self.period = path, period
        self.last: dict | None = None
        # The latest entry of each net queue pair: a snapshot reports a worker that is busy at
        # that instant as "busy" (statistics never wait for a worker), so one snapshot may
        # lack a pair; the counters only grow, so the latest entry seen is the one to check.
        self.pairs: dict[int, dict] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                st = rig1.read_stats(self.path)
                if st["server"]["connected"] and st.get("workers"):
                    self.last = st
                    for w in st["workers"]:
                        if isinstance(w, dict) and "pair" in w:
                            self.pairs[w["pair"]] = w
            except (OSError, ValueError):
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=10)


@skip_if_missing
def test_bvm_vhost_net_two_queue_pairs_iperf3_parallel():
    """Multi-queue net over vhost-user with QEMU. QEMU acks MQ but not CTRL_VQ
    to the backend (it keeps the control queue and enables the pairs' rings); the device used
    to refuse that and the guest had no network. Both queue pairs must carry traffic both ways
    (per-pair worker statistics) under iperf3 -P 4."""
    binary = _prereqs(tun=True)
    rig1.require_cmd("iperf3")
    with NetNS(multi_queue=True) as ns:
        ns.start_iperf3()
        sock = out_path("bvm_net_mq", ".sock")
        stats = out_path("bvm_net_mq", ".stats")
        backend = Backend("bvm_net_mq", [binary, "net", "--socket", str(sock), "--tap", ns.tap,
                                         "--queues", "2", "--stats-socket", str(stats)],
                          socket=sock, netns=ns, env={"BOUNCEVM_LOG": "info"})
        with backend, _StatsPoller(stats) as poll:
            run = run_guest("bvm_net_mq_iperf3", "iperf3",
                            params={"ip": ns.guest_cidr, "server": ns.host_ip, "time": 5,
                                    "parallel": 4},
                            devices=net_vhost_user(sock, queues=2))
            assert backend.alive(), backend.log()[-2000:]
            st = _final_stats(stats)
    r = run.ok("iperf3")
    tx, rx = num(r["guest_to_host_gbps"]), num(r["host_to_guest_gbps"])
    assert tx > 0 and rx > 0, run.describe()
    t = st["transport"]
    assert t["activation_failures"] == 0 and t["broken_workers"] == 0, t
    seen = poll.last
    assert seen is not None, "no statistics taken during the session"
    pairs = [poll.pairs[k] for k in sorted(poll.pairs)]
    assert [w["pair"] for w in pairs] == [0, 1], (pairs, seen["workers"])
    for w in pairs:
        assert w["ring_steered"], w
        assert w["rx_frames"] > 0 and w["tx_chains"] > 0, f"pair {w['pair']} idle: {pairs}"
    record_figures("bvm_vhost_net_mq", guest_to_host_gbps=tx, host_to_guest_gbps=rx,
                   boot_s=run.boot_s)
    print(f"bouncevm-vhost net, 2 queue pairs, iperf3 -P 4: guest->host {tx} Gbit/s, "
          f"host->guest {rx} Gbit/s; per pair {[(w['rx_frames'], w['tx_chains']) for w in pairs]}")


@skip_if_missing
def test_bvm_vhost_blk_two_queues_two_fio_jobs():
    """--queues 2 with QEMU num-queues=2; two fio jobs (each its own region)
    verify at once; the guest sees 2 hardware queues; bounce forced."""
    binary = _prereqs()
    img = make_raw_image(out_path("bvm_blk_mq", ".img"), "128M")
    backend, sock, stats = _blk_backend("bvm_blk_mq", binary, img, extra=("--queues", "2"))
    run, st = _served_run(backend, stats, "bvm_blk_mq", "fio-verify",
                          params={**FIO_SHORT, "numjobs": 2},
                          devices=blk_vhost_user(sock, num_queues=2))
    v = _check_fio_verify(run)
    assert v["numjobs"] == "2" and v["hw_queues"] == "2", run.describe()
    _check_host_bounce(st, "two queues")


@pytest.mark.parametrize("qsize", [16, 256])
@skip_if_missing
def test_bvm_vhost_blk_non_default_queue_size(qsize):
    """QEMU's queue-size (default 128) at 16 (fio's iodepth 16 x bounce
    fills the ring) and 256 (the device's maximum): the guest's tag depth follows, fio verifies."""
    binary = _prereqs()
    img = make_raw_image(out_path(f"bvm_blk_q{qsize}", ".img"), "64M")
    backend, sock, stats = _blk_backend(f"bvm_blk_q{qsize}", binary, img)
    run, st = _served_run(backend, stats, f"bvm_blk_q{qsize}", "fio-verify", params=FIO_SHORT,
                          devices=blk_vhost_user(sock, extra=f",queue-size={qsize}"))
    v = _check_fio_verify(run)
    assert v["nr_tags"] == str(qsize), f"guest tag depth {v['nr_tags']} for queue-size={qsize}"
    _check_host_bounce(st, f"queue-size={qsize}")


@skip_if_missing
def test_bvm_vhost_blk_readonly():
    """--readonly over vhost-user: the guest sees a read-only disk (RO), its
    writes fail (even after blockdev --setrw), reads return the image's data, the image is
    unchanged and no write request reached the backend."""
    import hashlib

    binary = _prereqs()
    img = make_raw_image(out_path("bvm_blk_ro", ".img"), "16M")
    offs = [0, 4096, 5 << 20]
    rig1.write_pattern(img, offs, seed="ro")
    digest = hashlib.sha256(img.read_bytes()).hexdigest()
    backend, sock, stats = _blk_backend("bvm_blk_ro", binary, img, extra=("--readonly",))
    run, st = _served_run(backend, stats, "bvm_blk_ro", "readonly,read-pattern",
                          params=rig1.pattern_params(offs, seed="ro"),
                          devices=blk_vhost_user(sock))
    r = run.ok("readonly")
    assert r["ro"] == "1" and r["open_write_refused"] == "1", run.describe()
    assert r["setrw_write_refused"] == "1", run.describe()
    assert run.ok("read-pattern")["blocks"] == str(len(offs))
    assert hashlib.sha256(img.read_bytes()).hexdigest() == digest, "the read-only image changed"
    # Linux refuses writes to a disk whose device offers RO before they reach the device; the
    # device's own refusal of an OUT request is devices/tests/blk.rs readonly_refuses_writes.
    m = st["device"]["metrics"]
    assert m["reqs_out"] == 0 and m["reqs_in"] > 0, f"device metrics: {m}"
