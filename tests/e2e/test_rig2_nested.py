"""Rig 2 (nested KVM): a KVM VMM inside an L1 QEMU TCG guest boots the stock Debian cloud kernel
(L2) with virtio-blk and virtio-net; fio verify, fio randread and iperf3 (L2 -> iperf3 server in
L1) run in L2, and the host side ends the VM the ways QEMU users do (QMP system_powerdown, QMP
quit, SIGTERM). See tests/e2e/README.md ("Rig 2").

These tests run by default (BVM_RIG2=0 opts out) and take about 2 minutes each on an idle 2-core
machine. Hard timeout per test: BVM_RIG2_TIMEOUT (default 600 s) for the whole L1 run.
When L1 itself fails before the VMM under test started (its kernel dies, its QEMU exits, it
gets no /dev/kvm) it is booted once more; if it fails again rig 2 could not run: the test is
reported as skipped with that reason, never as passed. Once the VMM started, anything that goes
wrong fails the test, L1 included (a lockup, an RCU stall, an Oops or QEMU exiting may be the
VMM's doing): the L2 and VMM assertions come first, then the clean end of all three
(L1Run.assert_clean_end).
"""

import json

import pytest

import rig1
import rig2
from rig2 import num, record_figures, require_bouncevm, require_rig2, skip_if_missing

L2_TESTS = "fio-verify,fio-randread,iperf3,power-button"
L2_PARAMS = {"size": "32M", "runtime": 10, "time": 5, "wait": 60}
# QMP system_powerdown as soon as L2 waits for the power button (images/init power-button).
POWER_BUTTON = [("power-button=armed", "qmp:system_powerdown")]
# Unhandled port I/O a booting Linux may cause under bouncevm (a few probes of absent ISA
# devices); the FADT keeps Linux from polling the missing RTC and 8042, which cost ~33,000.
MAX_PIO_UNHANDLED = 500


def _check_l1(run):
    """Skips only when L1 failed before the VMM started, twice (rig 2 could not run); a
    failure after that is asserted on by the caller (L2 and VMM first, then assert_clean_end)."""
    why = run.skip_reason
    if why:
        pytest.skip(f"rig 2 could not run (L1 failed before the VMM started, "
                    f"{len(run.retried) + 1} boot(s)): {why}; log {run.log_path}")


def _check_l2(run):
    assert not run.l2_crash, f"L2 kernel crash: {run.l2_crash}\n{run.describe()}"
    v = run.fio_verified()
    rr = run.ok("fio-randread")
    assert num(rr["read_iops"]) > 0, run.describe()
    ip = run.ok("iperf3")
    assert num(ip["guest_to_host_gbps"]) > 0 and num(ip["host_to_guest_gbps"]) > 0, run.describe()
    return v, rr, ip


def _check_power_button(run):
    """QMP system_powerdown pressed the ACPI power button, L2's acpid and init powered it off
    (ACPI S5) and the VMM exited 0."""
    acts = run.l1.get("at", [])
    assert acts and acts[0].get("ok") == "1", f"system_powerdown was not sent: {acts}\n{run.describe()}"
    pb = run.ok("power-button")
    assert run.l2.get("POWERDOWN"), f"L2's init saw no power-down request\n{run.describe()}"
    assert run.l2.get("DONE"), f"L2 did not reach BVM-DONE after the button\n{run.describe()}"
    assert "reboot: Power down" in run.l2_log, f"L2 did not power off\n{run.describe()}"
    assert not run.l2_halted, run.describe()
    assert run.vmm_rc == 0, f"the VMM exited rc={run.vmm_rc} after L2 powered off\n{run.describe()}"
    return pb


def _report(name, run, v, rr, ip):
    f = run.figures()
    record_figures(name, **f, verify_read_iops=num(v["read_iops"]),
                   verify_write_iops=num(v["write_iops"]), randread_4k_iops=num(rr["read_iops"]),
                   l2_to_l1_gbps=num(ip["guest_to_host_gbps"]),
                   l1_to_l2_gbps=num(ip["host_to_guest_gbps"]))
    print(f"\n{name}: L1 /init {f['l1_boot_s']:.1f}s, /dev/kvm {f['l1_kvm_s']:.1f}s (L1 clock); "
          f"L2 kernel->init {f['l2_boot_s']:.1f}s, VMM start->L2 init {f['l2_wall_to_init_s']:.1f}s; "
          f"host: L2 init at {f['host_l2_init_s']:.1f}s, total {f['wall_s']:.0f}s; "
          f"fio randread 4k {rr['read_iops']} IOPS, verify r/w {v['read_iops']}/{v['write_iops']} IOPS; "
          f"iperf3 L2->L1 {ip['guest_to_host_gbps']} L1->L2 {ip['host_to_guest_gbps']} Gbit/s")


@skip_if_missing
def test_rig2_qemu_l2_fio():
    """Validates rig 2 itself with QEMU 7.2 (KVM) as the L2 VMM, and L2's power-button path
    against QEMU's ACPI."""
    require_rig2()
    rig2.require_root()
    run = rig2.run_l2("rig2_qemu_l2", vmm="qemu", test=L2_TESTS, params=L2_PARAMS,
                      at=POWER_BUTTON)
    _check_l1(run)
    v, rr, ip = _check_l2(run)
    q = run.qmp_done
    assert q and q.get("return", {}).get("status") == "running", \
        f"no QMP query-status answer after BVM-DONE ({q})\n{run.describe()}"
    _check_power_button(run)
    run.assert_clean_end()
    _report("rig2_qemu_l2", run, v, rr, ip)


def _bounce_stats(answer):
    """{driver: stats.bounce} from an x-query-bounce answer."""
    return {dev.get("driver", dev.get("id", "?")): (dev.get("stats") or {}).get("bounce") or {}
            for dev in (answer or {}).get("return", []) or []}


def _final_stats(run):
    """bouncevm's final statistics line (stderr, so in the L2 console log)."""
    for line in reversed(run.l2_log.splitlines()):
        if line.startswith('{"devices"'):
            try:
                return json.loads(line)
            except ValueError:
                break
    raise AssertionError(f"no final statistics line from bouncevm\n{run.describe()}")


@skip_if_missing
def test_rig2_bouncevm_l2():
    """bouncevm (bounce forced) boots L2 with virtio-blk + virtio-net inside L1: fio verify
    passes, L2 reaches iperf3 in L1, x-query-bounce shows slots in use while fio runs and the
    traffic after it, and QMP system_powerdown powers L2 off through the ACPI power button,
    which ends bouncevm with status 0."""
    require_bouncevm()
    require_rig2()
    rig2.require_root()
    # The pools' high-water marks are reset as fio-randread starts (x-reset-bounce), so the
    # answers polled while it runs show how many slots its requests held at once.
    run = rig2.run_l2("rig2_bouncevm_l2", vmm="bouncevm", test=L2_TESTS, params=L2_PARAMS,
                      bounce="policy=force",
                      at=[("start test=fio-randread", "qmp:x-reset-bounce"), *POWER_BUTTON])
    _check_l1(run)
    v, rr, ip = _check_l2(run)
    t0, t1 = run.l2_line_time("start test=fio-randread"), run.l2_line_time("test=fio-randread status=")
    during = [_bounce_stats(a).get("virtio-blk-pci", {}) for t, a in run.qmp_polls() if t0 <= t <= t1]
    assert len(during) >= 2, f"too few x-query-bounce answers while fio-randread ran ({t0}-{t1})\n{run.describe()}"
    maps = [int(b.get("maps", 0) or 0) for b in during]
    hiwater = [int(b.get("used_hiwater", 0) or 0) for b in during]
    assert maps[-1] > maps[0], f"the blk pool mapped nothing while fio ran: maps {maps}"
    assert max(hiwater) > 0, f"no slot of the blk pool in use during fio: used_hiwater {hiwater}"
    q = run.qmp_done or run.qmp_last
    assert q is not None and "return" in q, \
        f"no x-query-bounce answer over QMP (share/out/qmp-*.json)\n{run.describe()}"
    print("x-query-bounce:", json.dumps(q)[:2000])
    for drv, b in _bounce_stats(q).items():
        nbytes = int(b.get("bytes_to_device", 0) or 0) + int(b.get("bytes_from_device", 0) or 0)
        assert int(b.get("maps", 0) or 0) > 0 and nbytes > 0, f"{drv} shows no bounced traffic: {b}"
    assert {"virtio-blk-pci", "virtio-net-pci"} <= set(_bounce_stats(q)), q
    _check_power_button(run)
    # No storm of port I/O into absent legacy devices while L2 booted (FADT: no 8042, no RTC).
    assert "i8042: Can't read CTR" not in run.l2_log, run.describe()
    vcpus = _final_stats(run).get("vcpus") or []
    unhandled = sum(int(c.get("pio_unhandled", 0)) for c in vcpus)
    assert vcpus and unhandled <= MAX_PIO_UNHANDLED, f"unhandled port I/O: {vcpus}"
    run.assert_clean_end()
    _report("rig2_bouncevm_l2", run, v, rr, ip)
    print(f"blk pool during fio-randread: maps {maps}, slots in use at most {hiwater} "
          f"(since the reset); vCPU exits: {vcpus}")


# write-pattern with O_DIRECT and no fsync (bvm.wsync=0): the blocks sit in bouncevm's write
# cache (cache=writeback) until bouncevm flushes its disks on the way out.
PATTERN_OFFSETS = [0, 1 << 20, 8 << 20, 100 << 20]


def _host_end(name, action, kernel):
    """L2 writes a pattern without flushing it and waits; `action` ends bouncevm from the host.
    Asserts that bouncevm exited 0, flushed the disk (an fdatasync from its main thread, traced
    in L1) and that the disk image holds the pattern."""
    require_bouncevm()
    require_rig2()
    rig2.require_root()
    seed = name
    run = rig2.run_l2(name, vmm="bouncevm", test="fio-verify,write-pattern,wait-host",
                      params={"size": "16M", "wsync": 0, "wait": 90,
                              **rig1.pattern_params(PATTERN_OFFSETS, seed=seed)},
                      net=False, disk="share", kernel=kernel, at=[("wait-host=armed", action)],
                      host_ends_vm=True, l1_prep=rig2.SYNC_TRACE_PREP,
                      l1_post=rig2.SYNC_TRACE_POST)
    _check_l1(run)
    assert not run.l2_crash, f"L2 kernel crashed: {run.l2_crash}\n{run.describe()}"
    run.fio_verified()
    w = run.ok("write-pattern")
    assert w["wsync"] == "0", w
    assert not any(r.get("test") == "wait-host" for r in run.results), \
        f"L2 waited out bvm.wait: the host did not end the VM\n{run.describe()}"
    assert run.vmm_rc == 0, f"bouncevm exited rc={run.vmm_rc} after {action}\n{run.describe()}"
    assert run.vmm_syncs, (f"bouncevm's main thread made no fdatasync after {action} (the disk "
                           f"was not flushed)\n{run.describe()}")
    bad = rig1.check_pattern(run.share / "disk.img", PATTERN_OFFSETS, seed)
    assert not bad, f"the disk image lacks the pattern at {bad}\n{run.describe()}"
    run.assert_clean_end()
    return run


@skip_if_missing
def test_rig2_bouncevm_l2_bzimage_quit():
    """The stock kernel booted by bouncevm from the Debian bzImage (vmlinuz as shipped, the
    real-mode setup and in-kernel decompressor) passes fio verify; QMP quit then ends bouncevm
    with status 0, the disk flushed, and a SHUTDOWN event with cause host-qmp-quit."""
    run = _host_end("rig2_bouncevm_l2_bzimage_quit", "qmp-wait:quit", "bzimage")
    session = (run.share / "out" / "at-1.qmp").read_text()
    events = [json.loads(x) for x in session.splitlines() if '"event"' in x]
    assert any(e["event"] == "SHUTDOWN" and e["data"]["reason"] == "host-qmp-quit"
               for e in events), session


@skip_if_missing
def test_rig2_bouncevm_l2_sigterm():
    """SIGTERM ends bouncevm as QMP quit does: status 0, the disk flushed."""
    _host_end("rig2_bouncevm_l2_sigterm", "signal:TERM", "pvh")
