"""Fast checks of the rig-2 harness (no L1 boot): log parsing, the VMM command lines, the L2
kernel extraction."""

import socket
import threading
import types

import pytest

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


def test_a_silent_l2_under_a_running_l1_is_told_apart():
    hung = SAMPLE.split("L2 83.97|")[0] + (
        "BVM-L1 quiet uptime=150.2 l2_last=68.1 load=1.0/1.0/0.9 "
        "threads=181/181:run:S:do_wait,190/190:bouncevm:S:futex_wait_queue,\n"
        "BVM-L1 quiet uptime=210.7 l2_last=68.1 load=1.0/1.0/1.0 "
        "threads=181/181:run:S:do_wait,190/190:bouncevm:S:futex_wait_queue,\n")
    l1, l2, t = rig2.parse_l1(hung)
    r = rig2.L1Run("x", [], rig2.out_path("x", ".log"), hung, "", rig2.out_path("x", ".share"),
                   0, True, 600.0, {}, l1, l2, t)
    assert r.l1["quiet"][-1]["threads"].startswith("181/181:run:S:do_wait,190/190:bouncevm")
    assert "L2 silent since L1 uptime 68.1, L1 still running at 210.7" in r.l1_failure
    r = rig2.L1Run("x", [], rig2.out_path("x", ".log"), SAMPLE, "", rig2.out_path("x", ".share"),
                   0, True, 600.0, {}, *rig2.parse_l1(SAMPLE))
    assert r.l1_failure == "timed out (host side)"


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


def test_rig2_runs_by_default_and_opts_out(monkeypatch):
    monkeypatch.delenv("BVM_RIG2", raising=False)
    rig2.require_rig2()
    monkeypatch.setenv("BVM_RIG2", "1")
    rig2.require_rig2()
    monkeypatch.setenv("BVM_RIG2", "0")
    try:
        rig2.require_rig2()
    except rig2.OptIn as e:
        assert "BVM_RIG2=0" in str(e)
    else:
        raise AssertionError("BVM_RIG2=0 did not opt out")
    monkeypatch.setenv("BVM_RIG2", "yes")
    try:
        rig2.require_rig2()
    except ValueError:
        pass
    else:
        raise AssertionError("BVM_RIG2=yes was accepted")


BEFORE_VMM = SAMPLE[:SAMPLE.index("BVM-L1 vmm start")]


def _l1_with(runs):
    """An L1 whose boots return the given L1Runs in turn (no QEMU)."""
    l1 = rig2.L1.__new__(rig2.L1)
    l1._attempt = 0
    seq = iter(runs)
    l1._once = lambda: next(seq)
    return l1


def test_l1_failing_before_the_vmm_is_booted_once_more():
    # its QEMU exits (no Oops) before the VMM started: retried, and the second boot counts
    died = _run(BEFORE_VMM)
    assert died.skip_reason.startswith("L1's QEMU exited")
    good = _run(CLEAN)
    with pytest.warns(rig2.RigFault, match="before the VMM started"):
        r = _l1_with([died, good]).run(boot_retries=1)
    assert r is good and r.retried == [died] and r.skip_reason == ""
    # failing twice: reported (as a skip, by the tests) with the first failure remembered
    died2 = _run(BEFORE_VMM + "[  11.0] Oops: int3 SMP NOPTI\n")
    with pytest.warns(rig2.RigFault, match="before the VMM started"):
        r = _l1_with([died, died2]).run(boot_retries=1)
    assert r is died2 and r.retried == [died] and "L1 kernel died" in r.skip_reason
    assert "before the VMM started" in r.describe()
    # a death after the VMM started is never retried
    late = _run(CLEAN.replace("BVM-L1 done uptime=120.28", "[  50.0] Oops: int3 SMP NOPTI"))
    r = _l1_with([late, good]).run(boot_retries=1)
    assert r is late and r.retried == [] and r.unclean_end


def test_a_state_the_emulation_made_up_is_run_again_with_a_warning():
    # L2 faults with RFLAGS no CPU can hold (reserved bits 5, 15, 23 and 26 set), the way QEMU's
    # nested SVM makes them: a NULL dereference in down_write during L2's boot
    made_up = CLEAN.replace("L2 111.80| BVM-DONE uptime=61.45\n",
                            "L2 21.40| [    1.07] BUG: kernel NULL pointer dereference, address: 0060\n"
                            "L2 21.61| [    1.07] RSP: 0018:ffffc90000013a00 EFLAGS: 04b08666\n")
    bad = _run(made_up)
    assert bad.vmm_started and bad.skip_reason == "" and "L2 kernel crash" in bad.unclean_end
    assert bad.emulation_fault == ("L2's CPU held EFLAGS 04b08666: reserved bits 5, 15, 23, 26 "
                                   "set, a state the emulation made up")
    assert bad.retry_reason == bad.emulation_fault
    good = _run(CLEAN)
    with pytest.warns(rig2.RigFault, match="booting L1 again: L2's CPU held EFLAGS 04b08666"):
        r = _l1_with([bad, good]).run(boot_retries=1)
    assert r is good and r.retried == [bad]
    assert "said nothing about the VMM: L2's CPU held" in r.describe()
    # twice in a row: the second is reported as it is
    with pytest.warns(rig2.RigFault):
        r = _l1_with([bad, bad]).run(boot_retries=1)
    assert r is bad and r.retried == [bad] and "L2 kernel crash" in r.unclean_end
    # the same crash with flags a CPU can hold is the VMM's to answer for: never run again
    held = _run(made_up.replace("EFLAGS: 04b08666", "EFLAGS: 00010246"))
    assert held.emulation_fault == "" and held.retry_reason == ""
    r = _l1_with([held, good]).run(boot_retries=1)
    assert r is held and r.retried == [] and "L2 kernel crash" in r.unclean_end
    # an L1 register dump counts too; and bit 1 clear is as impossible as a reserved bit set
    l1 = _run(CLEAN.replace("BVM-L1 done uptime=120.28", "[  50.0] Oops: double fault\n"
                            "[  50.0] RSP: 0018:ffffc9 EFLAGS: 00000200"))
    assert l1.emulation_fault.startswith("L1's CPU held EFLAGS 00000200: bit 1 clear")


def test_host_ended_vm_needs_its_action_not_bvm_done():
    no_done = CLEAN.replace("L2 111.80| BVM-DONE uptime=61.45\n", "")
    r = _run(no_done)
    assert "BVM-DONE" in r.unclean_end
    r.host_ends_vm = True
    assert "action did not run" in r.unclean_end
    acted = no_done.replace("BVM-L1 vmm rc=0",
                            "BVM-L1 at n=1 marker=wait-host=armed action=qmp:quit ok=1 uptime=99\n"
                            "BVM-L1 vmm rc=0")
    r = _run(acted)
    r.host_ends_vm = True
    assert r.unclean_end == "" and r.l1["at"][0]["marker"] == "wait-host=armed"
    r = _run(acted.replace("ok=1 uptime=99", "ok=0 uptime=99"))
    r.host_ends_vm = True
    assert "action did not run" in r.unclean_end


def test_vmm_syncs_are_the_vmm_main_threads():
    text = CLEAN.replace(
        "timed_out=0\n", "timed_out=0 l2_halted=0 pid=206\n"
        "BVM-L1 log trace:  ld-linux-x86-64-206     [001] .....   120.1: sys_fdatasync(fd: 0x7)\n"
        "BVM-L1 log trace:  ld-linux-x86-64-211     [000] .....   60.0: sys_fdatasync(fd: 0x7)\n"
        "BVM-L1 log trace:  busybox-2060     [000] .....   60.0: sys_fsync(fd: 0x3)\n")
    r = _run(text)
    assert r.vmm["pid"] == "206"
    assert len(r.vmm_syncs) == 1 and "-206 " in r.vmm_syncs[0]
    assert _run(CLEAN).vmm_syncs == []


def test_l2_line_times_and_qmp_polls(tmp_path):
    r = _run(SAMPLE)
    assert r.l2_line_time("test=fio-verify status=ok") == 83.97
    assert r.l2_line_time("no such line") != r.l2_line_time("no such line")  # nan
    r.share = tmp_path
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "qmp-polls.jsonl").write_text(
        '{"uptime": 80.5, "answer": {"return": []}\r}\nnot json\n'
        '{"uptime": 82.0, "answer": {"return": [{"driver": "virtio-blk-pci"}]}}\n')
    assert r.qmp_polls() == [(80.5, {"return": []}),
                            (82.0, {"return": [{"driver": "virtio-blk-pci"}]})]


def test_bench_rig2_variants_and_summary():
    import bench_rig2
    assert bench_rig2.parse_variants("bvm-force, qemu") == ["bvm-force", "qemu"]
    for bad in ("", "qemu,qemu", "qemu,vhost"):
        try:
            bench_rig2.parse_variants(bad)
        except SystemExit as e:
            assert "--variants" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")
    s = {"qemu": [{"randread_iops": 900.0, "l2_to_l1_gbps": 0.1, "l1_to_l2_gbps": 0.2},
                  {"randread_iops": 1100.0, "l2_to_l1_gbps": 0.3, "l1_to_l2_gbps": 0.2},
                  {"randread_iops": 1000.0, "l2_to_l1_gbps": 0.2, "l1_to_l2_gbps": 0.2}],
         "bvm-force": [{"randread_iops": 3000.0, "l2_to_l1_gbps": 0.1, "l1_to_l2_gbps": 0.4}]}
    lines, med = bench_rig2.summary(s, ["qemu", "bvm-force"])
    assert med[("qemu", "randread_iops")] == 1000.0
    text = "\n".join(lines)
    assert "qemu       1000 (900-1100, n=3)" in text
    assert "bvm-force  3000 (3000-3000, n=1)  3.00x qemu" in text
    assert "bvm-force  0.400 (0.400-0.400, n=1)  2.00x qemu" in text


def test_l1_has_one_vcpu_unless_asked(monkeypatch):
    monkeypatch.delenv("BVM_RIG2_L1_SMP", raising=False)
    assert rig2.l1_smp_default() == 1 == rig2.L1_SMP
    monkeypatch.setenv("BVM_RIG2_L1_SMP", "2")
    assert rig2.l1_smp_default() == 2
    monkeypatch.setenv("BVM_RIG2_L1_SMP", "4")
    try:
        rig2.l1_smp_default()
    except ValueError as e:
        assert "BVM_RIG2_L1_SMP" in str(e)
    else:
        raise AssertionError("BVM_RIG2_L1_SMP=4 accepted")


def test_l1_gets_the_host_tsc_rate(monkeypatch):
    # a rate no host has, so that only the variable can have put it there
    monkeypatch.setenv("BVM_HOST_TSC_KHZ", "2345678")
    l1 = rig2.L1("tsc", rig2.Share("tsc"), cmd="/host/run-l2.sh")
    assert "tsc_early_khz=2345678" in l1.kernel_cmdline().split()


def test_l1_monitor_socket_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(rig2, "require_qemu", lambda: "qemu-system-x86_64")
    monkeypatch.setattr(rig2, "l1_images", lambda: types.SimpleNamespace(vmlinuz="k", initramfs="i"))
    l1 = rig2.L1("mon", rig2.Share("mon"), cmd="/host/run-l2.sh")
    assert f"unix:{l1.monitor_path},server=on,wait=off" in l1.argv()
    path = tmp_path / "l1.mon"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    got = []

    def serve():
        c, _ = srv.accept()
        with c:
            got.append(c.recv(100))
            c.sendall(b"EIP=ffffffff81000000 HLT=1\n(qemu) ")

    th = threading.Thread(target=serve)
    th.start()
    out = rig2.monitor(path, "info registers", wait=0.5)
    th.join()
    srv.close()
    assert got == [b"info registers\n"]
    assert "HLT=1" in out


def test_a_silent_l1_is_recorded_and_ended(tmp_path, monkeypatch):
    """L1's console silent past HANG_DUMP_S: its state is written to NAME.l1.hang (QEMU's host
    threads; the monitor's answer or why there is none), and past HANG_END_S the host ends the
    run and says L1 stopped, well before the run's timeout."""
    import subprocess
    import sys
    import time
    monkeypatch.setattr(rig2, "HANG_DUMP_S", 1.0)
    monkeypatch.setattr(rig2, "HANG_END_S", 3.0)
    monkeypatch.setattr(rig2, "HANG_GAP_S", 0.1)
    l1 = rig2.L1("hang", rig2.Share("hang"), cmd="/host/run-l2.sh", timeout=60)
    l1.monitor_path = tmp_path / "absent.mon"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    try:
        assert l1._wait(proc, t0, [t0]) is True
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - t0 < 30
    assert l1.hung_s is not None and l1.hung_s >= 3
    dump = l1.hang_path.read_text()
    assert dump.count("=== sample") == 2
    assert f"host threads of QEMU (pid {proc.pid})" in dump and "state=" in dump
    assert "monitor unavailable" in dump
    r = rig2.L1Run("hang", [], l1.log_path, SAMPLE.split("L2 83.97|")[0], "", l1.share.dir,
                   None, True, 5.0, {}, *rig2.parse_l1(SAMPLE.split("L2 83.97|")[0]),
                   hung_s=l1.hung_s, hang_path=l1.hang_path)
    assert r.l1_failure.startswith(f"L1 stopped: its console was silent for {l1.hung_s} s")
    assert "L1 failed after the VMM started: L1 stopped" in r.unclean_end


def test_a_quick_l1_is_not_a_hang(tmp_path):
    import subprocess
    import sys
    import time
    l1 = rig2.L1("quick", rig2.Share("quick"), cmd="/host/run-l2.sh", timeout=60)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    t0 = time.monotonic()
    assert l1._wait(proc, t0, [t0]) is False
    assert l1.hung_s is None and l1.hang_path is None
