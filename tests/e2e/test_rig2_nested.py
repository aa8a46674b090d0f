"""Rig 2 (nested KVM): a KVM VMM inside an L1 QEMU TCG guest boots the stock Debian cloud kernel
(L2) with virtio-blk and virtio-net; fio verify, fio randread and iperf3 (L2 -> iperf3 server in
L1) run in L2. See tests/e2e/README.md ("Rig 2").

These tests take 1-2 minutes each on an idle 2-core machine and run only with BVM_RIG2=1
(otherwise they skip and say why: the rig flakes now and then under multi-threaded TCG). Hard timeout per test: BVM_RIG2_TIMEOUT (default 480 s) for the whole L1 run.
When L1 itself fails before the VMM under test started (its kernel dies, its QEMU exits, it
gets no /dev/kvm) rig 2 could not run: the test is reported as skipped with that reason, never as
passed. Once the VMM started, anything that goes wrong fails the test, L1 included (a lockup, an
RCU stall, an Oops or QEMU exiting may be the VMM's doing): the L2 and VMM assertions come
first, then the clean end of all three (L1Run.assert_clean_end).
"""

import json

import pytest

import rig2
from rig2 import num, record_figures, require_bouncevm, require_rig2, skip_if_missing

L2_TESTS = "fio-verify,fio-randread,iperf3"
L2_PARAMS = {"size": "32M", "runtime": 10, "time": 5}


def _check_l1(run):
    """Skips only when L1 failed before the VMM started (rig 2 could not run); a failure after
    that is asserted on by the caller (L2 and VMM first, then assert_clean_end)."""
    why = run.skip_reason
    if why:
        pytest.skip(f"rig 2 could not run (L1 failed before the VMM started): {why}; "
                    f"log {run.log_path}")


def _check_l2(run):
    assert not run.l2_crash, f"L2 kernel crash: {run.l2_crash}\n{run.describe()}"
    v = run.fio_verified()
    rr = run.ok("fio-randread")
    assert num(rr["read_iops"]) > 0, run.describe()
    ip = run.ok("iperf3")
    assert num(ip["guest_to_host_gbps"]) > 0 and num(ip["host_to_guest_gbps"]) > 0, run.describe()
    assert run.l2.get("DONE"), f"L2 did not reach BVM-DONE\n{run.describe()}"
    return v, rr, ip


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
    """Validates rig 2 itself with QEMU 7.2 (KVM) as the L2 VMM."""
    require_rig2()
    rig2.require_root()
    run = rig2.run_l2("rig2_qemu_l2", vmm="qemu", test=L2_TESTS, params=L2_PARAMS)
    _check_l1(run)
    assert run.vmm_rc == 0, f"QEMU in L1 exited rc={run.vmm_rc}\n{run.describe()}"
    v, rr, ip = _check_l2(run)
    q = run.qmp_done
    assert q and q.get("return", {}).get("status") == "running", \
        f"no QMP query-status answer after BVM-DONE ({q})\n{run.describe()}"
    run.assert_clean_end()
    _report("rig2_qemu_l2", run, v, rr, ip)


def _bounce_traffic(answer):
    """{driver: (maps, bytes_to_device + bytes_from_device)} from an x-query-bounce answer."""
    out = {}
    for dev in (answer or {}).get("return", []) or []:
        b = (dev.get("stats") or {}).get("bounce") or {}
        out[dev.get("driver", dev.get("id", "?"))] = (
            int(b.get("maps", 0) or 0),
            int(b.get("bytes_to_device", 0) or 0) + int(b.get("bytes_from_device", 0) or 0))
    return out


@skip_if_missing
def test_rig2_bouncevm_l2():
    """Issue 5 point 6: bouncevm (bounce forced) boots L2 with virtio-blk + virtio-net inside L1;
    fio verify passes, L2 reaches iperf3 in L1, x-query-bounce shows the traffic, and the VMM
    exits 0 when L2 powers off."""
    require_bouncevm()
    require_rig2()
    rig2.require_root()
    run = rig2.run_l2("rig2_bouncevm_l2", vmm="bouncevm", test=L2_TESTS, params=L2_PARAMS,
                      bounce="policy=force")
    _check_l1(run)
    v, rr, ip = _check_l2(run)
    q = run.qmp_done or run.qmp_last
    assert q is not None and "return" in q, \
        f"no x-query-bounce answer over QMP (share/out/qmp-*.json)\n{run.describe()}"
    traffic = _bounce_traffic(q)
    print("x-query-bounce:", json.dumps(q)[:2000])
    for drv in ("virtio-blk-pci", "virtio-net-pci"):
        assert drv in traffic, f"x-query-bounce lists no {drv}: {traffic}\n{run.describe()}"
        maps, nbytes = traffic[drv]
        assert maps > 0 and nbytes > 0, f"{drv} shows no bounced traffic: {traffic}\n{q}"
    assert not run.l2_halted, (
        "L2's poweroff halted the machine ('System halted': no power-off path the guest can "
        "use, e.g. no ACPI) and bouncevm kept running; l1-vmm killed it\n" + run.describe())
    assert run.vmm_rc == 0, f"bouncevm exited rc={run.vmm_rc} after L2 powered off\n{run.describe()}"
    run.assert_clean_end()
    _report("rig2_bouncevm_l2", run, v, rr, ip)


@skip_if_missing
def test_rig2_bouncevm_l2_bzimage():
    """Issue 5 point 1: the same stock kernel booted by bouncevm from the Debian bzImage
    (vmlinuz as shipped) rather than the PVH vmlinux; a short fio verify passes and the VMM exits
    0 when L2 powers off."""
    require_bouncevm()
    require_rig2()
    rig2.require_root()
    run = rig2.run_l2("rig2_bouncevm_l2_bzimage", vmm="bouncevm", test="fio-verify",
                      params={"size": "16M"}, bounce="policy=force", net=False, kernel="bzimage")
    _check_l1(run)
    assert not run.l2_crash, f"L2 kernel crashed: {run.l2_crash}\n{run.describe()}"
    run.fio_verified()
    assert not run.l2_halted, "L2's poweroff halted the machine and bouncevm kept running\n" + run.describe()
    assert run.vmm_rc == 0, f"bouncevm exited rc={run.vmm_rc}\n{run.describe()}"
    run.assert_clean_end()
