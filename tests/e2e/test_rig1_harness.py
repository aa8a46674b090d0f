"""Harness self-tests (no QEMU needed)."""

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
    run = g.run()
    assert run.timed_out and g.proc.poll() is not None
