"""Rig 1: `bouncevm-vhost blk` killed with SIGKILL under a guest's I/O, a new one started on the
same socket, QEMU reconnecting (`reconnect=1` on the vhost-user chardev): the requests in flight
at the kill are served again from the inflight region QEMU hands back (SET_INFLIGHT_FD), so fio's
write-then-verify pass in the guest succeeds with no I/O error and no hang.

The back end runs with `--cache none` (O_DIRECT: each write takes the disk's time, so a kill
finds requests in flight) and bounce forced. The test kills it only while its statistics show
a request in flight (or a worker busy with one), and again if the new back end resubmitted
nothing (the kill fell between requests), a few times at most; at least one restart must have
resubmitted requests, so the test proves the path it is about.
"""

import os
import signal
import time

from rig1 import Guest, blk_vhost_user, make_raw_image, out_path, read_stats, skip_if_missing
from test_rig1_bouncevm_vhost import _blk_backend, _prereqs

# fio-verify's region and depth: long enough under TCG for several kills and reconnects (each
# takes 2-3 s). A kill can still catch nothing: the statistics showed a request in flight, but
# an O_DIRECT write takes the host well under a millisecond and may complete before SIGKILL
# lands, so the test needs room for several tries.
FIO = {"size": "128M", "iodepth": 32}
# Kills before the test gives up on catching requests in flight.
MAX_KILLS = 8
# The guest's own I/O error lines (printed at KERN_ERR, which `quiet` keeps): a request failed,
# or the driver saw a used entry for a head it had not posted (a request served twice).
IO_ERRORS = ("I/O error", "blk_update_request", "Buffer I/O error", "is not a head")


def _io_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(e in line for e in IO_ERRORS)]


def _stats(path) -> dict | None:
    try:
        return read_stats(path, timeout=2.0)
    except (OSError, ValueError):
        return None


def _in_flight(st: dict) -> bool:
    """A worker holds a request (or is busy serving an event, with requests popped)."""
    return any(w == "busy" or (isinstance(w, dict) and w.get("in_flight", 0) > 0)
               for w in st.get("workers", []))


def _kill_moment(stats, guest: Guest) -> str | None:
    """'kill' while the back end serves the guest's I/O (reads or writes) with a request in
    flight, 'done' once fio has reported (nothing left to catch), else None."""
    if "BVM-RESULT" in _guest_log(guest):
        return "done"
    st = _stats(stats)
    if st is None:
        return None
    m = st["device"]["metrics"]
    return "kill" if m["reqs_in"] + m["reqs_out"] > 100 and _in_flight(st) else None


def _wait_for(what: str, pred, timeout: float, guest: Guest, poll: float = 0.05):
    """pred()'s first true value within `timeout`; fails at once when QEMU exits or the guest
    reports an I/O error (its I/O would then hang or fail, and `what` never come)."""
    deadline = time.monotonic() + timeout
    checked = time.monotonic()
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if guest.proc.poll() is not None:
            raise AssertionError(f"QEMU exited while waiting for {what}")
        if time.monotonic() - checked > 0.5:
            checked = time.monotonic()
            errors = _io_errors(_guest_log(guest))
            if errors:
                raise AssertionError(f"I/O errors in the guest while waiting for {what}: {errors}")
        time.sleep(poll)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


def _guest_log(guest: Guest) -> str:
    return guest.log_path.read_bytes().decode("utf-8", "replace")


def _boot_to_fio(guest: Guest, boot_retries: int = 1) -> None:
    """Starts `guest` and waits until fio has started; a guest kernel that dies before /init
    (the multi-threaded TCG race, nothing the back end did) is booted again as rig1.Guest.run
    does (Guest.boot_again: its back ends restarted first)."""
    crashed = []
    while True:
        guest.start()
        try:
            _wait_for("fio start", lambda: "BVM-INFO start test=fio-verify" in _guest_log(guest),
                      90, guest)
            return
        except AssertionError:
            run = guest.wait(timeout=1)
            if not guest.boot_again(run, crashed, boot_retries):
                raise
            print(f"guest kernel died before /init ({run.kernel_crash}): booting again")


@skip_if_missing
def test_bvm_vhost_blk_kill9_and_reconnect_loses_no_io():
    binary = _prereqs()
    img = make_raw_image(out_path("bvm_reconnect", ".img"), "256M")
    backend, sock, stats = _blk_backend("bvm_reconnect", binary, img,
                                        extra=("--cache", "none"))
    devices = blk_vhost_user(sock)
    devices[1] += ",reconnect=1"
    resubmitted, adopted, kills = [], [], 0
    with backend:
        guest = Guest("bvm_reconnect", "fio-verify", params=FIO, devices=devices, timeout=300)
        _boot_to_fio(guest)
        try:
            while kills < MAX_KILLS:
                # I/O flowing, and a request in flight right now: kill.
                if _wait_for("requests in flight", lambda: _kill_moment(stats, guest),
                             60, guest, poll=0.002) == "done":
                    break
                os.kill(backend.proc.pid, signal.SIGKILL)
                backend.proc.wait(timeout=10)
                kills += 1
                backend.restart()
                # QEMU reconnects within a second or two (and hands the region back).
                st = _wait_for("QEMU's reconnection", lambda: (s := _stats(stats)) and
                               s["server"]["connected"] and s["transport"]["activations"] > 0
                               and s, 30, guest)
                time.sleep(1.0)
                st = _stats(stats) or st
                adopted.append(st["server"]["relay"]["inflight_regions_adopted"])
                resubmitted.append(st["device"]["metrics"]["inflight_resubmitted"])
                if resubmitted[-1] > 0:
                    break
            run = guest.wait()
        finally:
            guest.kill()
        assert backend.alive(), backend.log()[-2000:]
    run.assert_clean_end()
    run.fio_verified()
    errors = _io_errors(run.log)
    assert errors == [], f"I/O errors in the guest: {errors}\n{run.describe()}"
    assert kills > 0, f"fio finished before a kill\n{run.describe()}"
    assert all(a == 1 for a in adopted), f"QEMU did not hand the inflight region back: {adopted}"
    assert sum(resubmitted) > 0, (
        f"{kills} kill(s) and no request resubmitted ({resubmitted}): the test did not catch "
        f"requests in flight\n{run.describe()}")
    print(f"kill -9 + reconnect: {kills} kill(s), resubmitted {resubmitted}, "
          f"guest wall {run.wall_s:.0f}s")
