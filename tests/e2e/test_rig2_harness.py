"""Fast checks of the rig-2 harness (no L1 boot): log parsing, the VMM command lines, the L2
kernel extraction."""

import rig2
from rig2 import skip_if_missing

SAMPLE = """\
c\x1b[?7lBVM-L1 boot uptime=5.68 kernel=6.12.118+deb12-amd64
BVM-L1 modules ok=1 uptime=9.44
BVM-L1 kvm present=1 svm=2 nested=1 npt=Y uptime=9.64
BVM-L1 share ok=1 uptime=9.91
BVM-L1 cmd start=/host/run-l2.sh uptime=10.21
BVM-L1 vmm start uptime=10.42 argv=/host/qemu/run -m 1G
L2 68.07| Booting from ROM..BVM-BOOT uptime=17.80 kernel=6.12.118+deb12-cloud-amd64
L2 83.97| BVM-RESULT test=fio-verify status=ok read_iops=214 verify_errors=0
L2 90.00| [   40.1] Oops: general protection fault
L2 111.80| BVM-DONE uptime=61.45
BVM-L1 vmm rc=0 start=10.42 end=120.20 elapsed_s=109.8 timed_out=0
BVM-L1 done uptime=120.28
"""


def _run(text):
    l1, l2, t = rig2.parse_l1(text)
    l2_log = "\n".join(m.group(2) for m in map(rig2._L2_LINE.match, text.splitlines()) if m)
    return rig2.L1Run("x", [], rig2.out_path("x", ".log"), text, l2_log, rig2.out_path("x", ".share"),
                      0, False, 1.0, {}, l1, l2, t)


def test_parse_l1_and_l2_lines():
    r = _run(SAMPLE)
    assert r.l1_boot_s == 5.68 and r.l1_kvm_s == 9.64
    assert r.vmm_rc == 0 and r.vmm["elapsed_s"] == "109.8"
    assert r.ok("fio-verify")["read_iops"] == "214"
    assert r.l2_boot_s == 17.80
    assert abs(r.l2_wall_to_init_s - (68.07 - 10.42)) < 1e-6
    # an Oops on an L2 line is not an L1 death
    assert r.l1_crash == "" and r.l1_failure == ""


def test_l1_oops_is_l1_death():
    r = _run(SAMPLE.replace("BVM-L1 done", "[  50.0] Oops: int3 SMP NOPTI\nxx"))
    assert r.l1_crash.startswith("Oops: int3")
    assert "L1 kernel died" in r.l1_failure


def test_bouncevm_command_line():
    a = rig2.bouncevm_l2_argv("/host/bouncevm/run", "K", "I", "quiet", "/tmp/disk.img")
    assert a == ["/host/bouncevm/run", "-m", "1G", "-smp", "2", "-kernel", "K", "-initrd", "I",
                 "-append", "quiet", "-drive", "file=/tmp/disk.img,format=raw,if=virtio",
                 "-netdev", "tap,id=n0,ifname=tap0", "-device", "virtio-net-pci,netdev=n0",
                 "-bounce", "policy=force", "-qmp", "unix:/tmp/qmp.sock,server,nowait",
                 "-nographic", "-no-reboot"]


@skip_if_missing
def test_l2_vmlinux_has_pvh_entry():
    rig2.require_root()
    p = rig2.l2_vmlinux()
    assert rig2.pvh_entry(p.read_bytes()) is not None


def test_l2_halt_is_reported():
    r = _run(SAMPLE.replace("BVM-L1 vmm rc=0 start=10.42 end=120.20 elapsed_s=109.8 timed_out=0",
                            "BVM-L1 l2-halted uptime=100 vmm_killed=1\n"
                            "BVM-L1 vmm rc=137 start=10.42 end=120.20 elapsed_s=109.8 timed_out=0 l2_halted=1"))
    assert r.l2_halted and r.vmm_rc == 137


CLEAN = SAMPLE.replace("L2 90.00| [   40.1] Oops: general protection fault\n", "")


def test_skip_only_before_the_vmm_started():
    # L1 dies before l1-vmm started the VMM: rig 2 could not run -> a skip reason
    before = SAMPLE[:SAMPLE.index("BVM-L1 vmm start")] + "[  11.0] Oops: int3 SMP NOPTI\n"
    r = _run(before)
    assert not r.vmm_started and "L1 kernel died" in r.skip_reason
    # the same death (or a lockup/stall) after the VMM started is a failure, never a skip
    for death in ("[  50.0] Oops: int3 SMP NOPTI", "watchdog: BUG: soft lockup - CPU#1 stuck for 26s!",
                  "rcu: INFO: rcu_preempt self-detected stall on CPU"):
        r = _run(CLEAN.replace("BVM-L1 done uptime=120.28", death))
        assert r.vmm_started and r.skip_reason == "", death
        assert "L1 failed after the VMM started" in r.unclean_end, (death, r.unclean_end)


def test_clean_end_of_l2_and_vmm():
    clean = CLEAN
    assert _run(clean).assert_clean_end().unclean_end == ""
    assert "L2 kernel crash" in _run(SAMPLE).unclean_end
    assert "rc=1" in _run(clean.replace("vmm rc=0", "vmm rc=1")).unclean_end
    assert "timeout" in _run(clean.replace("timed_out=0", "timed_out=1")).unclean_end
    assert "BVM-DONE" in _run(clean.replace("L2 111.80| BVM-DONE uptime=61.45\n", "")).unclean_end
    # a fio-verify line without its verify pass (verify_kib) is not verified
    try:
        _run(clean).fio_verified()
    except AssertionError as e:
        assert str(e).startswith("fio-verify:")
    else:
        raise AssertionError("fio_verified passed without verify_kib")
