"""The README's "Use it with your own QEMU" examples, run as written on rig 1.

Issue 12, point 1: the vhost-user-blk and vhost-user-net examples are read out of README.md
(the ```sh blocks of that section) and run with only file names replaced (disk.img, the
sockets, tap0, vmlinuz/initrd.img -> the rig's images, and the -append string -> the rig's
guest command line, which runs a short test and powers off). Nothing else is added: QEMU's
defaults apply -- in particular a bare `-device vhost-user-blk-pci,chardev=vu0` with
`-smp 2`, for which QEMU 7.2 asks the backend for one queue per vCPU.
"""

import re
import shlex
from pathlib import Path

import rig1
from rig1 import (Backend, Guest, NetNS, images, make_raw_image, out_path, require_qemu,
                  require_root, skip_if_missing)
from test_rig1_bouncevm_vhost import _binary, _final_stats

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Use it with your own QEMU"


def readme_blocks() -> list[str]:
    """The ```sh blocks of the README section, in order."""
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end > 0 else len(text)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def commands(block: str) -> list[list[str]]:
    """Shell commands of a block: continuations joined, comments and a trailing & dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[-1] == "&":
            words = words[:-1]
        if words:
            out.append(words)
    return out


def substitute(argv: list[str], subs: dict[str, str]) -> list[str]:
    out = []
    for w in argv:
        for old, new in subs.items():
            w = re.sub(rf"(?<![\w/.-]){re.escape(old)}(?![\w.-])", new, w)
        out.append(w)
    return out


class ReadmeGuest(Guest):
    """A Guest whose QEMU command line is the README's (after substitution)."""

    def __init__(self, name: str, test: str, qemu_argv: list[str], params: dict, netns=None):
        super().__init__(name, test, params=params, netns=netns)
        self.qemu_argv = qemu_argv

    def argv(self) -> list[str]:
        a = list(self.qemu_argv)
        a[0] = require_qemu()
        # -append's value becomes the rig's guest command line (test, then power off); the
        # README boots to a console.
        a[a.index("-append") + 1] = self.kernel_cmdline()
        # -no-reboot: the rig's guest ends with poweroff; keep QEMU from rebooting on a panic.
        a.append("-no-reboot")
        return (self.netns.exec_prefix() if self.netns else []) + a


def split(block: str) -> tuple[list[str], list[str]]:
    """(backend argv, qemu argv) of a README block."""
    cmds = commands(block)
    backend = [c for c in cmds if Path(c[0]).name == "bouncevm-vhost"]
    qemu = [c for c in cmds if Path(c[0]).name == "qemu-system-x86_64"]
    assert len(backend) == 1 and len(qemu) == 1, f"README block has no single example: {cmds}"
    return backend[0], qemu[0]


def test_readme_has_the_examples():
    blocks = readme_blocks()
    kinds = [split(b)[0][1] for b in blocks if "bouncevm-vhost" in b]
    assert kinds == ["blk", "net"], kinds
    blk_qemu = split(blocks[kinds.index("blk")])[1]
    dev = [w for w in blk_qemu if w.startswith("vhost-user-blk-pci")]
    assert dev == ["vhost-user-blk-pci,chardev=vu0"], f"the blk example must use QEMU's defaults: {dev}"
    assert blk_qemu[blk_qemu.index("-smp") + 1] == "2"


def _subs(name: str) -> dict[str, str]:
    img = images()
    return {
        "target/release/bouncevm-vhost": _binary(),
        "vmlinuz": str(img.vmlinuz),
        "initrd.img": str(img.initramfs),
        "disk.img": str(out_path(f"{name}", ".img")),
        "/tmp/blk.sock": str(out_path(f"{name}.blk", ".sock")),
        "/tmp/blk.stats": str(out_path(f"{name}.blk", ".stats")),
        "/tmp/net.sock": str(out_path(f"{name}.net", ".sock")),
        "/tmp/net.stats": str(out_path(f"{name}.net", ".stats")),
    }


def _qemu_clean(log: str) -> None:
    assert "maximum number of queues" not in log, log[-3000:]


@skip_if_missing
def test_readme_vhost_user_blk_example_runs_with_qemu_defaults():
    require_root()
    require_qemu()
    blocks = [b for b in readme_blocks() if "bouncevm-vhost blk" in b]
    backend_argv, qemu_argv = split(blocks[0])
    subs = _subs("readme_blk")
    make_raw_image(subs["disk.img"], "256M")
    backend_argv = substitute(backend_argv, subs)
    qemu_argv = substitute(qemu_argv, subs)
    backend = Backend("readme_blk", backend_argv, socket=subs["/tmp/blk.sock"])
    with backend:
        run = ReadmeGuest("readme_blk", "fio-verify", qemu_argv,
                          params={"size": "16M", "iodepth": 8}).run()
        assert backend.alive(), backend.log()[-2000:]
        st = _final_stats(Path(subs["/tmp/blk.stats"])) if "--stats-socket" in backend_argv else None
    _qemu_clean(run.log)
    r = run.ok("fio-verify")
    assert r["verify_errors"] == "0", run.describe()
    if st is not None:
        assert st["bounce"] and st["bounce"]["maps"] > 0, st


@skip_if_missing
def test_readme_vhost_user_net_example_runs_with_qemu_defaults():
    require_root()
    require_qemu()
    rig1.require_cmd("iperf3")
    blocks = [b for b in readme_blocks() if "bouncevm-vhost net" in b]
    backend_argv, qemu_argv = split(blocks[0])
    with NetNS() as ns:
        ns.start_iperf3()
        subs = {**_subs("readme_net"), "tap0": ns.tap}
        backend_argv = substitute(backend_argv, subs)
        qemu_argv = substitute(qemu_argv, subs)
        backend = Backend("readme_net", backend_argv, socket=subs["/tmp/net.sock"], netns=ns)
        with backend:
            run = ReadmeGuest("readme_net", "iperf3", qemu_argv, netns=ns,
                              params={"ip": ns.guest_cidr, "server": ns.host_ip, "time": 2}).run()
            assert backend.alive(), backend.log()[-2000:]
    _qemu_clean(run.log)
    r = run.ok("iperf3")
    assert rig1.num(r["guest_to_host_gbps"]) > 0, run.describe()
