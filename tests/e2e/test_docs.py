"""The documentation keeps its shape: README.md is a user's page of at most 250 lines that starts
with the two commands and lists every crate and binary; every README stays at most 250 lines;
every study in docs/ has its question, command, conditions and reading; every generated report
is the output of a command docs/README.md lists; links resolve; and no Markdown file narrates
how the project was developed (that belongs in git log).
"""

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_LIMIT = 250

# Words that tell how the work went rather than what the project is. They are assembled from
# parts so that this file, which the tree-wide check also reads, does not itself contain them.
_WORK_UNIT = "st" + "op"
_TRACKER = "iss" + "ue"
_DISCARDED = "throw" + "away"
NARRATION = re.compile(
    rf"\bthis {_WORK_UNIT}\b|\b(?:last|previous|earlier|next) {_WORK_UNIT}s?\b|\b{_DISCARDED}\b"
    rf"|\b{_TRACKER} \d+\b|\b{_TRACKER}-\d+\b|\bearlier runs?\b|\bpreviously\b"
    r"|\bin earlier (?:builds|versions)\b",
    re.I,
)


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                          pattern], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.split()]


def markdown_files() -> list[Path]:
    return [p for p in tracked("*.md") if p.is_file()]


def test_readme_is_a_page_that_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_LIMIT, f"README.md has {len(lines)} lines (limit {README_LIMIT})"
    body = [l for l in lines[1:] if l.strip()]
    assert lines[0].startswith("# ") and body[0] == "```sh", "README.md starts with a sh block"
    first = text.split("```sh\n", 1)[1].split("```", 1)[0]
    cmds = [shlex.split(l, comments=True)[0] for l in first.splitlines() if l.strip()]
    assert cmds == ["./tests/fio-check", "./tests/run"], first


def test_every_readme_fits_the_limit():
    readmes = [p for p in markdown_files() if p.name == "README.md"]
    assert len(readmes) >= 10, readmes
    for p in readmes:
        n = len(p.read_text().splitlines())
        assert n <= README_LIMIT, f"{p.relative_to(REPO)}: {n} lines (limit {README_LIMIT})"


def test_no_markdown_narrates_development():
    bad = []
    for p in markdown_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if NARRATION.search(line):
                bad.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_narration_pattern_catches_what_it_must():
    for s in [f"this {_WORK_UNIT}'s change", f"a {_DISCARDED} build", f"{_TRACKER} 10 item 6",
              "earlier runs", f"{_TRACKER}-10 targets", f"the last {_WORK_UNIT}"]:
        assert NARRATION.search(s), s
    for s in ["the VM stops", "swiotlb stops after", "cloud-hypervisor #8184", "a stop eventfd"]:
        assert not NARRATION.search(s), s


def crates() -> list[tuple[str, str, list[str]]]:
    """(folder, package, binaries) of every workspace member."""
    members = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["members"]
    out = []
    for m in members:
        pkg = tomllib.loads((REPO / m / "Cargo.toml").read_text())["package"]["name"]
        bins = [pkg] if (REPO / m / "src/main.rs").exists() else []
        bindir = REPO / m / "src/bin"
        if bindir.is_dir():
            bins += sorted(p.stem for p in bindir.iterdir())
        out.append((m, pkg, bins))
    return out


def test_readme_layout_lists_every_crate_and_binary():
    text = (REPO / "README.md").read_text()
    rows = {r.split("|")[1].strip().strip("`").rstrip("/"): r
            for r in text.splitlines() if r.startswith("| `")}
    for folder, pkg, bins in crates():
        assert folder in rows, f"the layout table has no row for {folder}/"
        for name in [pkg, *bins]:
            assert f"`{name}`" in rows[folder], f"{folder}/ row lacks `{name}`: {rows[folder]}"


def links(p: Path) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", p.read_text())
            if not re.match(r"[a-z]+:", m)]


def test_relative_links_resolve():
    for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in links(p):
            assert (p.parent / target).exists(), f"{p.relative_to(REPO)} links to missing {target}"


def regen_commands() -> list[list[str]]:
    """The commands of docs/README.md's first sh block: the headline reports."""
    text = (REPO / "docs/README.md").read_text()
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(l) for l in block.splitlines() if l.strip()]


def without_scale(argv: list[str]) -> list[str]:
    """argv without --rounds/--seconds and their values (a smaller run of the same report)."""
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w in ("--rounds", "--seconds"):
            skip = True
        else:
            out.append(w)
    return out


def test_every_generated_report_comes_from_a_listed_command():
    listed = {tuple(without_scale(c)) for c in regen_commands()}
    reports = {c[c.index("--report") + 1] for c in regen_commands()}
    for r in reports:
        assert (REPO / r).is_file(), f"docs/README.md lists {r}, which is missing"
    generated = sorted((REPO / "docs/experiments").glob("*.md"))
    assert generated, "docs/experiments has no report"
    for p in generated:
        lines = p.read_text().splitlines()
        assert lines[0].startswith("# "), p
        m = re.match(r"Generated by `([^`]+)`", lines[2])
        assert m, f"{p.relative_to(REPO)} does not start with the command that made it"
        argv = shlex.split(m.group(1))
        rel = str(p.relative_to(REPO))
        assert argv[argv.index("--report") + 1] == rel, f"{rel} was written as another file"
        assert tuple(without_scale(argv)) in listed, f"{rel}: {m.group(1)} is not in docs/README.md"
        assert p.with_suffix(".svg").is_file(), f"{rel} has no chart"
        assert f"]({p.with_suffix('.svg').name})" in p.read_text(), f"{rel} does not show its chart"


def test_every_study_has_its_parts_and_is_indexed():
    index = (REPO / "docs/README.md").read_text()
    studies = sorted((REPO / "docs/studies").glob("*.md"))
    assert studies
    for p in studies:
        text = p.read_text()
        for part in ("**Question.**", "**Command.**", "**Conditions.**", "## Reading"):
            assert part in text, f"{p.relative_to(REPO)} lacks {part}"
        assert f"(studies/{p.name})" in index, f"docs/README.md does not list {p.name}"
