"""Harness self-tests (most need no QEMU)."""

import re
import sys

import pytest

import rig1


def test_parse_log():
    log = ("\x1bc\x1b[?7l\x1b[2JBVM-BOOT uptime=3.92 kernel=6.12\r\n"
           "[    1.0] some kernel line\n"
           "BVM-SWIOTLB when=after present=1 nslabs=32768 used=0 hiwater=80\n"
           "BVM-RESULT test=fio-verify status=ok read_iops=3812 write_iops=2986\n"
           "BVM-LOG verify: bad magic header\n"
           "BVM-DONE uptime=14.5\n")
    p = rig1.parse_log(log)
    assert p["BOOT"][0]["uptime"] == "3.92"
    assert p["RESULT"] == [{"test": "fio-verify", "status": "ok", "read_iops": "3812",
                            "write_iops": "2986"}]
    assert p["SWIOTLB"][0]["hiwater"] == "80"
    assert p["LOG"] == ["verify: bad magic header"]
    run = rig1.GuestRun("x", [], rig1.OUT_DIR / "x", log, 0, False, 1.0, p)
    assert run.boot_s == 3.92 and run.done
    assert run.ok("fio-verify")["read_iops"] == "3812"


def _run(log, rc=0, timed_out=False):
    return rig1.GuestRun("x", [], rig1.OUT_DIR / "x", log, rc, timed_out, 1.0, rig1.parse_log(log))


CLEAN = ("BVM-BOOT uptime=3.9 kernel=6.12\n"
         "BVM-RESULT test=fio-verify status=ok fio_error=0 read_kib=8192 read_iops=10 "
         "write_kib=4216 write_iops=9 verify_errors=0 verify_kib=4216 size_kib=8192\n"
         "BVM-DONE uptime=14.5\n")


def test_clean_end_detects_every_bad_end():
    assert _run(CLEAN).assert_clean_end().unclean_end == ""
    bad = {
        "oops after the last result": _run(CLEAN + "[ 15.0] Oops: general protection fault\n"),
        "soft lockup": _run(CLEAN.replace("BVM-DONE", "watchdog: BUG: soft lockup - CPU#0 stuck\nBVM-DONE")),
        "rcu stall": _run(CLEAN + "rcu: INFO: rcu_preempt self-detected stall on CPU\n"),
        "qemu crashed": _run(CLEAN, rc=-11),
        "no BVM-DONE": _run(CLEAN.replace("BVM-DONE uptime=14.5\n", "")),
        "host timeout": _run(CLEAN, timed_out=True),
        "guest watchdog": _run(CLEAN.replace("BVM-DONE", "BVM-RESULT test=x status=fail reason=guest-timeout\nBVM-DONE")),
    }
    for what, run in bad.items():
        assert run.unclean_end, what
        try:
            run.assert_clean_end()
        except AssertionError:
            continue
        raise AssertionError(f"assert_clean_end passed on: {what}")


def test_a_crash_report_longer_than_the_tail_is_shown_from_its_first_line():
    trace = [f"[    5.4] frame{i}+0x1/0x2" for i in range(60)]
    log = CLEAN.replace("BVM-DONE uptime=14.5\n", "") + "\n".join(
        ["[    5.4] Oops: double fault: 0000 [#1] PREEMPT SMP NOPTI", "[    5.4] Call Trace:"]
        + trace + ["[    5.4] Kernel panic - not syncing: Fatal exception"]) + "\n"
    text = _run(log).describe()
    assert "Oops: double fault" in text.split("--- last 40 log lines ---")[0], text
    assert "frame0+" in text and "frame59+" in text and "Kernel panic" in text
    # A crash inside the tail, or none: no separate block.
    assert "crash report" not in _run(CLEAN + "[ 15.0] Oops: general protection fault\n").describe()
    assert "crash report" not in _run(CLEAN).describe()


def test_fio_verify_check_needs_the_verify_pass():
    assert _run(CLEAN).fio_verified()["verify_kib"] == "4216"
    # fio cut short by a runtime before its verify pass: exit 0, no errors, nothing verified
    cut = CLEAN.replace("read_kib=8192", "read_kib=1024").replace("write_kib=4216", "write_kib=1024") \
               .replace("verify_kib=4216", "verify_kib=-6144")
    partial = CLEAN.replace("verify_kib=4216", "verify_kib=4212")
    old_init = CLEAN.replace(" verify_kib=4216", "")
    for what, log in {"cut": cut, "partial": partial, "no verify_kib": old_init}.items():
        try:
            _run(log).fio_verified()
        except AssertionError as e:
            assert "verify pass" in str(e), (what, e)
            continue
        raise AssertionError(f"fio_verified passed on: {what}")


def test_pattern_block():
    b = rig1.pattern_block("s", 4096, 100)
    assert len(b) == 100
    assert b.startswith(b"bvm-pattern s 0000000000004096 00000000\nbvm-pattern s 0000000000004096 00000001\n")
    assert rig1.pattern_block("s", 0, 4096) != rig1.pattern_block("s", 4096, 4096)


def test_pattern_roundtrip(tmp_path):
    img = rig1.make_raw_image(tmp_path / "p.img", "1M")
    rig1.write_pattern(img, [0, 8192], seed="a", length=512)
    assert rig1.check_pattern(img, [0, 8192], seed="a", length=512) == []
    assert rig1.check_pattern(img, [0, 8192, 4096], seed="a", length=512) == [4096]


@rig1.skip_if_missing
def test_harness_reports_guest_failure():
    """A guest-side check that fails must come back as status=fail, not as a pass."""
    rig1.require_root()
    rig1.require_qemu()
    rig1.images()
    img = rig1.make_raw_image(rig1.out_path("harness_fail", ".img"), "16M")
    run = rig1.run_guest("harness_fail", "read-pattern",
                         params=rig1.pattern_params([0, 4096], seed="absent"),
                         devices=rig1.blk_builtin(img))
    r = run.result("read-pattern")
    assert r["status"] == "fail" and r["reason"] == "pattern-mismatch", run.describe()
    assert r["bad_blocks"] == "2"
    assert any("pattern mismatch" in l for l in run.parsed["LOG"])


@rig1.skip_if_missing
def test_harness_timeout_kills_guest():
    rig1.require_root()
    rig1.require_qemu()
    rig1.images()
    # bvm.shell=1 keeps the guest alive after the test; the host-side timeout must end it
    g = rig1.Guest("harness_timeout", "none", params={"shell": 1, "timeout": 600}, timeout=3)
    run = g.run(clean_end=False)
    assert run.timed_out and g.proc.poll() is not None
    assert "timed out" in run.unclean_end


def test_tcg_threading_is_checked(monkeypatch):
    for mode in ("multi", "single"):
        monkeypatch.setattr(rig1, "TCG_THREAD", mode)
        assert rig1.tcg_thread() == mode
    monkeypatch.setattr(rig1, "TCG_THREAD", "Multi")
    with pytest.raises(ValueError, match="BVM_RIG1_TCG"):
        rig1.tcg_thread()


def _fake_backend(name: str, sock) -> rig1.Backend:
    """A process that only listens on a unix socket: a back end as far as the harness knows."""
    listen = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
              "s.listen(); time.sleep(120)")
    return rig1.Backend(name, [sys.executable, "-c", listen, str(sock)], socket=sock)


def test_back_ends_are_found_by_the_sockets_a_guest_connects_to(tmp_path):
    with _fake_backend("harness_fake_blk", tmp_path / "blk.sock") as blk, \
            _fake_backend("harness_fake_net", tmp_path / "net.sock") as net:
        argv = ["qemu-system-x86_64", "-m", "1G",
                *rig1.net_vhost_user(tmp_path / "net.sock"),
                *rig1.blk_vhost_user(tmp_path / "blk.sock"),
                *rig1.blk_vhost_user(tmp_path / "nobody.sock", id="vu9")]
        assert rig1.Backend.serving(argv) == [net, blk]
        blk.stop()
        assert rig1.Backend.serving(argv) == [net]
    assert rig1.Backend.serving(argv) == []


# A QEMU wrapper whose first run boots the guest kernel with an init that does not exist: the
# kernel panics before /init, which the harness takes for a boot crash and retries.
_CRASH_FIRST_BOOT = """#!{python}
import os, sys
marker, real, args = {marker!r}, {qemu!r}, sys.argv[1:]
if not os.path.exists(marker):
    open(marker, "w").close()
    args[args.index("-append") + 1] += " rdinit=/no-such-init"
os.execv(real, [real] + args)
"""


def _crash_first_boot_rig(tmp_path, name: str, size: str):
    """A QEMU (a wrapper in tmp_path) whose first boot has no /init, so the guest kernel dies
    before /init as in the TCG race (later boots are QEMU's own), and a `bouncevm-vhost blk`
    back end (bounce off) on a fresh `size` image: (wrapper, backend, socket, stats socket)."""
    from test_rig1_bouncevm_vhost import _blk_backend, _prereqs

    wrapper = tmp_path / "qemu-crash-first-boot"
    wrapper.write_text(_CRASH_FIRST_BOOT.format(python=sys.executable, qemu=rig1.require_qemu(),
                                                marker=str(tmp_path / "crashed")))
    wrapper.chmod(0o755)
    img = rig1.make_raw_image(rig1.out_path(name, ".img"), size)
    return (wrapper, *_blk_backend(name, _prereqs(), img, bounce=None))


@rig1.skip_if_missing
def test_a_retried_boot_gets_fresh_back_ends(tmp_path):
    """A boot that crashes before /init is retried. The crashed boot has already connected to
    the vhost-user back end (QEMU connects when it starts), so the retry must get a restarted
    back end: then the run returned is the only session its statistics count. A reused back end
    counts two connections, and a test that asserts one session (as
    test_bvm_vhost_blk_qemu_stderr_stays_clean does) fails whenever the TCG boot race hits."""
    from test_rig1_bouncevm_vhost import _final_stats

    wrapper, backend, sock, stats = _crash_first_boot_rig(tmp_path, "harness_retry", "16M")
    with backend:
        first_log = backend.log_path
        run = rig1.run_guest("harness_retry", "write-pattern", qemu=str(wrapper),
                             params=rig1.pattern_params([0], seed="retry"),
                             devices=rig1.blk_vhost_user(sock))
        st = _final_stats(stats)
    assert [r.boot_crash for r in run.retried] == [True], run.describe()
    assert run.retried[0].kernel_crash.startswith("Kernel panic"), run.retried[0].describe()
    assert run.ok("write-pattern")["blocks"] == "1", run.describe()
    assert "frontend connected (connection 1)" in first_log.read_text(), \
        "the crashed boot never reached the back end: nothing was tested"
    assert st["server"]["connections"] == 1 and not st["server"]["connected"], st["server"]
    assert backend.log_path != first_log, "the back end was not restarted"


@rig1.skip_if_missing
def test_the_reconnect_test_boots_again_after_a_boot_crash(tmp_path):
    """test_rig1_vhost_reconnect drives its guest by hand (it kills the back end while fio
    runs), so it retries a boot that died before /init itself (_boot_to_fio), as Guest.run does:
    a second boot, on a restarted back end."""
    from test_rig1_vhost_reconnect import _boot_to_fio

    wrapper, backend, sock, _ = _crash_first_boot_rig(tmp_path, "harness_fio_retry", "64M")
    with backend:
        first_log = backend.log_path
        guest = rig1.Guest("harness_fio_retry", "fio-verify", qemu=str(wrapper),
                           params={"size": "8M"}, devices=rig1.blk_vhost_user(sock))
        _boot_to_fio(guest)
        run = guest.wait()
    assert guest._attempt == 1 and run.log_path.name.endswith(".retry1.serial.log"), run.describe()
    assert backend.log_path != first_log, "the back end was not restarted"
    run.assert_clean_end()
    run.fio_verified()


def test_the_tsc_rate_is_read_from_a_kernel_log():
    detected = "[    0.000057] tsc: Detected 2600.000 MHz processor\n"
    assert rig1.tsc_khz_from_kernel_log(detected) == 2600000
    # The refined calibration wins; a separate TSC rate wins over the processor's.
    assert rig1.tsc_khz_from_kernel_log(
        detected + "[    1.2] tsc: Refined TSC clocksource calibration: 2599.987 MHz\n") == 2599987
    assert rig1.tsc_khz_from_kernel_log(
        "tsc: Detected 3000.000 MHz processor\ntsc: Detected 2899.998 MHz TSC\n") == 2899998
    assert rig1.tsc_khz_from_kernel_log("[    0.1] clocksource: tsc-early: mask: 0xff\n") is None


def test_the_guest_command_line_carries_the_host_tsc_rate(monkeypatch):
    monkeypatch.setenv("BVM_HOST_TSC_KHZ", "2345678")
    assert rig1.host_tsc_khz() == (2345678, "BVM_HOST_TSC_KHZ")
    assert "tsc_early_khz=2345678" in rig1.Guest("x", "none").kernel_cmdline().split()
    for bad in ("2.6GHz", "0", "-5"):
        monkeypatch.setenv("BVM_HOST_TSC_KHZ", bad)
        try:
            rig1.host_tsc_khz()
        except ValueError as e:
            assert "BVM_HOST_TSC_KHZ" in str(e)
        else:
            raise AssertionError(f"BVM_HOST_TSC_KHZ={bad} was accepted")


@rig1.skip_if_missing
def test_the_host_tsc_rate_is_the_counted_one():
    """The host kernel's figure and a count of the TSC against the host clock agree (each is
    the fallback of the other)."""
    rig1.require_root()
    import subprocess

    logged = rig1.tsc_khz_from_kernel_log(subprocess.run(["dmesg"], capture_output=True,
                                                         text=True).stdout)
    if logged is None:
        raise rig1.Missing("the host kernel's log no longer holds its TSC rate")
    counted = rig1._tsc_khz_counted()
    if counted is None:
        raise rig1.Missing("perf's msr/tsc/ event cannot be read here")
    assert abs(counted - logged) <= logged / 1000, (counted, logged)


@rig1.skip_if_missing
def test_the_guest_takes_its_tsc_rate_from_the_host():
    """The guest kernel does not measure its TSC rate (a loaded host disturbs that measurement
    and the guest clock then runs fast): it uses the host's, and its clock never runs ahead of
    the host's."""
    rig1.require_root()
    rig1.require_qemu()
    rig1.images()
    khz, source = rig1.host_tsc_khz()
    if khz is None:
        raise rig1.Missing(f"the host TSC's rate: {source}")
    run = rig1.run_guest("harness_tsc", "none", append="loglevel=7")
    # The kernel still calibrates its CPU rate (cpu_khz, the "processor" line) but takes the TSC
    # rate from tsc_early_khz; it prints a separate "MHz TSC" line only when the two differ.
    tsc = re.findall(r"tsc: Detected (\d+\.\d{3}) MHz TSC", run.log)
    cpu = re.findall(r"tsc: Detected (\d+\.\d{3}) MHz processor", run.log)
    assert tsc or cpu, run.describe()
    assert (tsc or cpu)[0] == f"{khz // 1000}.{khz % 1000:03d}", run.describe()
    assert "Using PIT calibration value" not in run.log, run.describe()
    assert run.uptime_s < run.wall_s, run.describe()
