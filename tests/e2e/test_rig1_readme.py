"""Every shell block of README.md, run as written (only file names replaced), or, where it cannot
run on this machine, tied to what runs the same command elsewhere.

Each ```sh block must be claimed by exactly one entry of BLOCKS
(test_every_readme_shell_block_is_covered): a new block without a test fails the suite.

- The vhost-user-blk and vhost-user-net examples run with QEMU (rig 1): disk.img, the sockets,
  tap0 and vmlinuz/initrd.img become the rig's files, and the -append string the rig's guest
  command line (which runs a short test and powers off). Nothing else is added: QEMU's defaults
  apply, in particular a bare `-device vhost-user-blk-pci,chardev=vu0` with `-smp 2`, for which
  QEMU 7.2 asks the back end for one queue per vCPU.
- The host-side tools (bounce-experiment, bouncevm-experiment, bounce-replay) run as written; a
  ```text block right after a command is its expected output, fragments separated by `...`
  that must appear in order.
- The `bouncevm` block needs VT-x/AMD-V, which these machines lack: it must be the command line
  rig 2 runs (tests/e2e/rig2.py `bouncevm_l2_argv`, test_rig2_nested.py), file names aside, so
  that a change to either fails here.
- The two commands are the test suite itself: checked to be the scripts CI runs.
"""

import os
import re
import shlex
import subprocess
from pathlib import Path

import rig1
import rig2
from rig1 import (Backend, Guest, NetNS, images, make_raw_image, out_path, require_binary,
                  require_qemu, require_root, skip_if_missing)
from test_rig1_bouncevm_vhost import _final_stats

REPO = Path(__file__).resolve().parents[2]


def readme_blocks() -> list[tuple[str, str | None]]:
    """Every ```sh block of README.md, in order, with the ```text block right after it (its
    expected output) or None."""
    text = (REPO / "README.md").read_text()
    out = []
    for m in re.finditer(r"```sh\n(.*?)```\n", text, re.S):
        after = re.match(r"\s*```text\n(.*?)```", text[m.end():], re.S)
        out.append((m.group(1), after.group(1) if after else None))
    return out


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


def run_as_written(argv: list[str], timeout: float = 600) -> str:
    """Runs a README command from the repository's top with target/release/ resolved; returns
    stdout, asserting exit status 0."""
    argv = list(argv)
    if argv[0].startswith("target/release/"):
        argv[0] = require_binary(argv[0].removeprefix("target/release/"))
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{shlex.join(argv)}: rc={r.returncode}\n{r.stderr[-3000:]}"
    return r.stdout


def assert_output(out: str, expected: str | None) -> None:
    """The fragments of an expected ```text block (split at `...`) appear in order in `out`."""
    assert expected is not None, "the README shows no output for this command"
    pos = 0
    for frag in (f.strip() for f in expected.split("...")):
        if frag:
            i = out.find(frag, pos)
            assert i >= 0, f"README's {frag!r} not in the output (from {pos}):\n{out[-3000:]}"
            pos = i + len(frag)


def tool_of(block: str) -> tuple[str, ...]:
    """The programs a block runs (their file names), e.g. ('bounce-replay',)."""
    return tuple(Path(c[0]).name for c in commands(block))


# Which test covers a block: (name, predicate over the block).
BLOCKS = [
    ("the two commands", lambda b: tool_of(b) == ("fio-check", "run")),
    ("bouncevm-vhost blk with QEMU", lambda b: "bouncevm-vhost" in tool_of(b) and " blk " in b),
    ("bouncevm-vhost net with QEMU", lambda b: "bouncevm-vhost" in tool_of(b) and " net " in b),
    ("bouncevm on a KVM host", lambda b: tool_of(b) == ("bouncevm",)),
    ("bounce-experiment", lambda b: tool_of(b) == ("bounce-experiment",)),
    ("bouncevm-experiment", lambda b: tool_of(b) == ("bouncevm-experiment",)),
    ("bounce-replay --compare", lambda b: tool_of(b) == ("bounce-replay",) and "--compare" in b),
    ("bounce-replay --advise", lambda b: tool_of(b) == ("bounce-replay",) and "--advise" in b),
]


def block(name: str) -> tuple[str, str | None]:
    pred = dict(BLOCKS)[name]
    found = [b for b in readme_blocks() if pred(b[0])]
    assert len(found) == 1, f"README.md has {len(found)} blocks for {name!r}"
    return found[0]


def test_every_readme_shell_block_is_covered():
    blocks = readme_blocks()
    assert blocks, "README.md has no ```sh block"
    for b, _ in blocks:
        claims = [name for name, pred in BLOCKS if pred(b)]
        assert len(claims) == 1, f"README block claimed by {claims} (want exactly one):\n{b}"


def test_the_two_commands_are_what_ci_runs():
    b, _ = block("the two commands")
    assert commands(b) == [["./tests/fio-check"], ["./tests/run"]], b
    for script in ("tests/fio-check", "tests/run"):
        assert os.access(REPO / script, os.X_OK), script
    ci = (REPO / ".ci/run").read_text()
    assert "\n./tests/run\n" in ci, "CI runs ./tests/run"
    assert "tests/e2e/fio_check.py" in (REPO / "tests/fio-check").read_text()


def test_the_kvm_host_example_is_the_command_rig2_runs():
    b, _ = block("bouncevm on a KVM host")
    (argv,) = commands(b)
    a = argv[argv.index("-append") + 1]
    want = rig2.bouncevm_l2_argv("target/release/bouncevm", "vmlinuz", "initrd.img", a, "disk.img")
    assert argv == want, f"README:  {shlex.join(argv)}\nrig 2:   {shlex.join(want)}"
    # rig 2's bouncevm test builds its command line with those defaults.
    nested = (REPO / "tests/e2e/test_rig2_nested.py").read_text()
    assert 'vmm="bouncevm"' in nested or "vmm='bouncevm'" in nested


def split(block_text: str) -> tuple[list[str], list[str]]:
    """(backend argv, qemu argv) of a README block."""
    cmds = commands(block_text)
    backend = [c for c in cmds if Path(c[0]).name == "bouncevm-vhost"]
    qemu = [c for c in cmds if Path(c[0]).name == "qemu-system-x86_64"]
    assert len(backend) == 1 and len(qemu) == 1, f"README block has no single example: {cmds}"
    return backend[0], qemu[0]


def test_readme_has_the_examples():
    blk_qemu = split(block("bouncevm-vhost blk with QEMU")[0])[1]
    split(block("bouncevm-vhost net with QEMU")[0])
    dev = [w for w in blk_qemu if w.startswith("vhost-user-blk-pci")]
    assert dev == ["vhost-user-blk-pci,chardev=vu0"], f"the blk example must use QEMU's defaults: {dev}"
    assert blk_qemu[blk_qemu.index("-smp") + 1] == "2"


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


def _subs(name: str) -> dict[str, str]:
    img = images()
    return {
        "target/release/bouncevm-vhost": require_binary("bouncevm-vhost"),
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
    backend_argv, qemu_argv = split(block("bouncevm-vhost blk with QEMU")[0])
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
    backend_argv, qemu_argv = split(block("bouncevm-vhost net with QEMU")[0])
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


@skip_if_missing
def test_readme_bounce_experiment_runs_as_written():
    b, _ = block("bounce-experiment")
    (argv,) = commands(b)
    out = run_as_written(argv)
    arg = lambda flag: argv[argv.index(flag) + 1].split(",")  # noqa: E731
    for a in arg("--alloc"):
        for t in arg("--threads"):
            for size in arg("--size"):
                for copy in arg("--copy"):
                    row = f"| {a} | {t} | {size} | {copy} |"
                    assert any(line.startswith(row) for line in out.splitlines()), (row, out)


@skip_if_missing
def test_readme_bouncevm_experiment_runs_as_written():
    b, _ = block("bouncevm-experiment")
    (argv,) = commands(b)
    out_dir = out_path("readme_seed", "")
    argv = substitute(argv, {"/tmp/seed-2021": str(out_dir)})
    require_binary("bouncevm-vhost")  # the experiment starts it from next to its own binary
    printed = run_as_written(argv)
    assert (out_dir / "table.md").read_text() == printed
    assert (out_dir / "chart.svg").read_text().lstrip().startswith("<svg")
    assert "| numjobs | allocator | IOPS median [min-max] |" in printed, printed


@skip_if_missing
def test_readme_replay_reproduces_the_kernel_as_shown():
    b, expected = block("bounce-replay --compare")
    (argv,) = commands(b)
    assert_output(run_as_written(argv), expected)


@skip_if_missing
def test_readme_advisor_prints_what_the_readme_shows():
    b, expected = block("bounce-replay --advise")
    (argv,) = commands(b)
    assert_output(run_as_written(argv), expected)
