"""Where this repository's binaries are: target/PROFILE/ under $CARGO_TARGET_DIR, else under the
repository's target/.

The tests run the release build (./tests/run builds it). The benchmarks default to the dist build
(Cargo.toml's [profile.dist]: the release profile with the whole program optimised as one unit),
the build to ship and to measure; `--profile release` measures the build the tests use.
"""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROFILES = ("dist", "release")


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR") or (REPO / "target"))


def bin_dir(profile: str = "release") -> Path:
    return target_dir() / profile


def build_command(profile: str, *packages: str) -> str:
    """The cargo command that builds PACKAGES in PROFILE, for an error message."""
    return " ".join(["cargo build --profile", profile] + [f"-p {p}" for p in packages])


def find(name: str, env: str | None = None, profile: str = "release") -> Path | None:
    """An executable NAME: $ENV when set, else target_dir()/PROFILE/NAME, else the repository's
    own target/PROFILE/NAME (a $CARGO_TARGET_DIR that holds no build falls back to it)."""
    candidates = [Path(os.environ[env])] if env and os.environ.get(env) else []
    candidates += [bin_dir(profile) / name, REPO / "target" / profile / name]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None
