"""Rig-1 baselines with QEMU's OWN devices (and qemu-storage-daemon as a vhost-user backend).

They validate the images and the harness; the project's own vhost-user backends plug into the
same harness (see README.md). Each test skips, with the reason, when a prerequisite is missing.
"""

import math

import pytest

import rig1
from rig1 import (Guest, NetNS, blk_builtin, blk_vhost_user, images, make_raw_image, net_tap,
                  num, out_path, qsd_vhost_user_blk, record_figures, require_qemu, require_qsd,
                  require_root, require_tun, run_guest, skip_if_missing)


def _prereqs(tun: bool = False, qsd: bool = False):
    require_root()
    if tun:
        require_tun()
    require_qemu()
    if qsd:
        require_qsd()
    images()


def _check_fio_verify(run):
    return run.fio_verified()


@skip_if_missing
def test_baseline_builtin_blk_fio_verify():
    _prereqs()
    img = make_raw_image(out_path("builtin_blk", ".img"), "256M")
    run = run_guest("builtin_blk_fio_verify", "fio-verify,fio-randread",
                    params={"size": "32M", "runtime": 5}, devices=blk_builtin(img))
    v = _check_fio_verify(run)
    rr = run.ok("fio-randread")
    assert num(rr["read_iops"]) > 0
    record_figures("builtin_blk", boot_s=run.boot_s, wall_s=run.wall_s,
                   verify_read_iops=num(v["read_iops"]), verify_write_iops=num(v["write_iops"]),
                   randread_4k_iops=num(rr["read_iops"]))
    print(f"builtin virtio-blk: boot {run.boot_s:.1f}s, 4k randread {rr['read_iops']} IOPS")


@skip_if_missing
def test_baseline_builtin_blk_swiotlb_force():
    _prereqs()
    img = make_raw_image(out_path("builtin_blk_swiotlb", ".img"), "256M")
    run = run_guest("builtin_blk_swiotlb_force", "fio-verify",
                    params={"size": "32M"}, append="swiotlb=force",
                    devices=blk_builtin(img, iommu=True))
    _check_fio_verify(run)
    after = run.swiotlb.get("after")
    assert after and after.get("present") == "1", f"no swiotlb pool in the guest\n{run.describe()}"
    assert num(after["nslabs"]) > 0, run.describe()
    hiwater = num(after.get("hiwater"))
    if math.isnan(hiwater):
        pytest.fail(f"kernel {images().kernel_release} has no io_tlb_used_hiwater: cannot show "
                    f"bouncing (after={after})")
    assert hiwater > 0, f"swiotlb=force + iommu_platform=on but no slot was ever used: {after}"
    record_figures("builtin_blk_swiotlb", nslabs=num(after["nslabs"]), hiwater=hiwater,
                   used_after=num(after.get("used")))
    print(f"guest swiotlb: nslabs={after['nslabs']} hiwater={after['hiwater']} used={after['used']}")


@skip_if_missing
def test_baseline_builtin_blk_pattern():
    """Host writes a pattern the guest reads; the guest writes one the host checks."""
    _prereqs()
    img = make_raw_image(out_path("builtin_blk_pattern", ".img"), "64M")
    host_offs = [0, 512 * 1001, 3 << 20]
    guest_offs = [4096, 5 << 20, (64 << 20) - 4096]
    rig1.write_pattern(img, host_offs, seed="host")
    assert rig1.check_pattern(img, host_offs, seed="other") == host_offs  # the check can fail
    run = run_guest("builtin_blk_pattern", "read-pattern,write-pattern",
                    params={**rig1.pattern_params(guest_offs, seed="guest"),
                            "read_offsets": ",".join(map(str, host_offs)), "read_seed": "host"},
                    devices=blk_builtin(img))
    assert run.ok("read-pattern")["blocks"] == str(len(host_offs))
    assert run.ok("write-pattern")["blocks"] == str(len(guest_offs))
    assert rig1.check_pattern(img, guest_offs, seed="guest") == [], run.describe()
    assert rig1.check_pattern(img, host_offs, seed="host") == []


@skip_if_missing
def test_baseline_builtin_net_iperf3():
    _prereqs(tun=True)
    rig1.require_cmd("iperf3")
    with NetNS() as ns:
        ns.start_iperf3()
        run = run_guest("builtin_net_iperf3", "iperf3", netns=ns,
                        params={"ip": ns.guest_cidr, "server": ns.host_ip, "time": 5},
                        devices=net_tap(ns.tap, extra=",speed=10000,duplex=full"))
    r = run.ok("iperf3")
    tx, rx = num(r["guest_to_host_gbps"]), num(r["host_to_guest_gbps"])
    assert tx > 0 and rx > 0, run.describe()
    assert r["link_speed_mbps"] == "10000", run.describe()
    record_figures("builtin_net", guest_to_host_gbps=tx, host_to_guest_gbps=rx, boot_s=run.boot_s)
    print(f"builtin virtio-net+tap: guest->host {tx} Gbit/s, host->guest {rx} Gbit/s")


@skip_if_missing
def test_baseline_qsd_vhost_user_blk_fio_verify():
    _prereqs(qsd=True)
    img = make_raw_image(out_path("qsd_blk", ".img"), "256M")
    sock = out_path("qsd_blk", ".sock")
    with qsd_vhost_user_blk("qsd_blk", img, sock) as backend:
        run = run_guest("qsd_blk_fio_verify", "fio-verify,fio-randread",
                        params={"size": "32M", "runtime": 5}, devices=blk_vhost_user(sock))
        assert backend.alive(), f"qemu-storage-daemon died:\n{backend.log()[-2000:]}"
    v = _check_fio_verify(run)
    rr = run.ok("fio-randread")
    record_figures("qsd_vhost_user_blk", boot_s=run.boot_s, wall_s=run.wall_s,
                   verify_read_iops=num(v["read_iops"]), verify_write_iops=num(v["write_iops"]),
                   randread_4k_iops=num(rr["read_iops"]))
    print(f"qsd vhost-user-blk: boot {run.boot_s:.1f}s, 4k randread {rr['read_iops']} IOPS")


def _qmp(sock, *commands, timeout: float = 10.0) -> list[dict]:
    """Connects to a QMP socket, negotiates, sends `commands` and returns every message read
    until the last command's answer."""
    import json
    import socket as pysocket
    out = []
    with pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        f = s.makefile("rw")
        out.append(json.loads(f.readline()))
        for c in ("qmp_capabilities", *commands):
            f.write(json.dumps({"execute": c}) + "\n")
            f.flush()
            while True:
                m = json.loads(f.readline())
                out.append(m)
                if "return" in m or "error" in m:
                    break
    return out


@skip_if_missing
def test_baseline_power_button_powers_the_guest_off():
    """QEMU's QMP system_powerdown presses the ACPI power button; the guest's acpid and init
    (images/init) power it off cleanly. Rig 2 holds bouncevm to the same."""
    import time
    _prereqs()
    sock = out_path("power_button", ".qmp")
    sock.unlink(missing_ok=True)
    g = Guest("power_button", "power-button", params={"wait": 60},
              extra_qemu=["-qmp", f"unix:{sock},server=on,wait=off"])
    with g:
        deadline = time.monotonic() + g.timeout
        while "power-button=armed" not in g.log_path.read_text(errors="replace"):
            assert g.proc.poll() is None and time.monotonic() < deadline, \
                g.log_path.read_text(errors="replace")[-2000:]
            time.sleep(0.2)
        answers = _qmp(sock, "system_powerdown")
        run = g.wait()
    assert answers[-1] == {"return": {}}, answers
    run.assert_clean_end()
    pb = run.ok("power-button")
    assert run.parsed.get("POWERDOWN"), run.describe()
    assert "reboot: Power down" in run.log, run.describe()
    print(f"power button: acted on after {pb['waited_s']} s ({pb['input']}, acpid pid {pb['acpid']})")
