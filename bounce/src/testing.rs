//! Skip accounting for tests that need a resource some machines lack (`/dev/kvm`, root, a tun
//! device, `qemu-img`, the kernel trace's JSON original, ...). Shared by the workspace's test crates
//! (feature `test-utils`), so a missing resource is never reported as a silent pass:
//!
//! - [`missing`] is what such a test calls, and then returns, when the resource is absent. It
//!   names the test (the test harness's thread name), the [`Resource`] and why on stderr, and
//!   appends one line `SKIPPED <test> resource=<name> <why>` to the file named by
//!   `BVM_SKIP_LOG` when that is set: `./tests/run` sets it, counts the lines and prints them
//!   after `cargo test`.
//! - `BVM_REQUIRE_RESOURCES` makes the same call a failure: `all`, or a comma list of
//!   [`Resource::name`]s (`kvm,root,tun,qemu-img,kernel-trace-json,python3,dpdk`). `./tests/run` sets it
//!   to `all` when `CI=true` (`.ci/run`), where every one of them is expected to exist.
//!
//! And the configuration every property-based fuzz target of the workspace runs with
//! ([`fuzz_config`]): `BVM_FUZZ_CASES` and `BVM_FUZZ_SEED`; and where another package's
//! binary is ([`workspace_bin`]), and [`wait_for_path`] for what a child process creates.

use std::io::Write;

/// What a test may find missing. [`Resource::name`] is the word used in `BVM_REQUIRE_RESOURCES`
/// and in the skip log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// A usable `/dev/kvm`.
    Kvm,
    /// Running as root (network namespaces, taps).
    Root,
    /// `/dev/net/tun`.
    Tun,
    /// `qemu-img` on PATH.
    QemuImg,
    /// The JSON lines the committed kernel trace (`bounce/traces/*.bvmtrace.gz`) was converted
    /// from, next to the repository (`../shared/traces`): only the check that the conversion
    /// reproduces the committed file needs it.
    KernelTraceJson,
    /// `python3` on PATH.
    Python3,
    /// DPDK's `dpdk-testpmd` on PATH (`tests/setup.sh` installs it).
    Dpdk,
    /// `qemu-storage-daemon` on PATH (the peer vhost-user-blk back end).
    QemuStorageDaemon,
}

impl Resource {
    /// The resource's name in `BVM_REQUIRE_RESOURCES` and the skip log.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Kvm => "kvm",
            Resource::Root => "root",
            Resource::Tun => "tun",
            Resource::QemuImg => "qemu-img",
            Resource::KernelTraceJson => "kernel-trace-json",
            Resource::Python3 => "python3",
            Resource::Dpdk => "dpdk",
            Resource::QemuStorageDaemon => "qemu-storage-daemon",
        }
    }
}

/// True when `BVM_REQUIRE_RESOURCES` (`all` or a comma list of names) says `resource` must exist.
pub fn required(resource: Resource) -> bool {
    std::env::var("BVM_REQUIRE_RESOURCES").is_ok_and(|v| listed(&v, resource))
}

/// `list` (`all` or comma-separated names) covers `resource`.
fn listed(list: &str, resource: Resource) -> bool {
    list.split(',')
        .map(str::trim)
        .any(|w| w == "all" || w == resource.name())
}

/// Records that the calling test cannot run because `resource` is missing (`why`); the caller
/// then returns. Panics instead when the resource is [`required`].
///
/// # Panics
/// When `BVM_REQUIRE_RESOURCES` covers `resource`: a test that needs it must fail, not skip.
pub fn missing(resource: Resource, why: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_string();
    let name = resource.name();
    if required(resource) {
        panic!("{test}: required resource {name} is missing: {why} (BVM_REQUIRE_RESOURCES)");
    }
    let line = format!("SKIPPED {test} resource={name} {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("BVM_SKIP_LOG") {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            panic!("{test}: cannot record the skip in BVM_SKIP_LOG: {e}");
        }
    }
}

/// `true` when `qemu-img` runs; otherwise records it [`missing`] and returns `false`.
pub fn qemu_img_available() -> bool {
    let runs = std::process::Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !runs {
        missing(
            Resource::QemuImg,
            "qemu-img is not installed (apt-get install qemu-utils)",
        );
    }
    runs
}

/// The path of `name`, a binary of another package of the workspace, in the target directory
/// the calling test runs from (`target/<profile>/`, the parent of the test's `deps/`). An
/// integration test gets `CARGO_BIN_EXE_<name>` only for its own package's binaries; `cargo
/// test --workspace` and `./tests/run` (`cargo build --workspace --release --bins` first) put
/// every binary there.
///
/// # Panics
/// When the binary is not there: the test cannot run it, and a missing build is not a
/// missing resource of the machine.
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("a test executable lives in target/<profile>/deps");
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: build the workspace's binaries with this test's profile first \
         (cargo build --workspace --bins, with --release for a release test)",
        bin.display()
    );
    bin
}

/// Waits up to ten seconds for `path` to exist (a socket or file a child process creates).
///
/// # Panics
/// When it does not appear in time.
pub fn wait_for_path(path: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The seed every fuzz target runs with unless `BVM_FUZZ_SEED` says otherwise.
pub const FUZZ_SEED: u64 = 0x5eed_b10c;

/// The proptest configuration of a fuzz target: `default_cases` cases (`BVM_FUZZ_CASES`
/// overrides) from the fixed seed [`FUZZ_SEED`], so `./tests/run` runs the same cases every
/// time; `BVM_FUZZ_SEED=N` picks another fixed seed, `BVM_FUZZ_SEED=random` a fresh one (long
/// runs). Failures are written next to the test's source file
/// (`<target>.proptest-regressions`) and replayed first on every later run.
pub fn fuzz_config(default_cases: u32) -> proptest::test_runner::Config {
    use proptest::test_runner::RngSeed;
    let cases = std::env::var("BVM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let rng_seed = match std::env::var("BVM_FUZZ_SEED").as_deref() {
        Ok("random") => RngSeed::Random,
        Ok(v) => RngSeed::Fixed(v.parse().unwrap_or(FUZZ_SEED)),
        Err(_) => RngSeed::Fixed(FUZZ_SEED),
    };
    proptest::test_runner::Config {
        cases,
        rng_seed,
        ..proptest::test_runner::Config::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_lists_parse() {
        assert!(listed("all", Resource::Kvm));
        assert!(listed("tun, kvm", Resource::Kvm));
        assert!(!listed("tun,qemu-img", Resource::Kvm));
        assert!(!listed("", Resource::Root));
        let all = [
            Resource::Kvm,
            Resource::Root,
            Resource::Tun,
            Resource::QemuImg,
            Resource::KernelTraceJson,
            Resource::Python3,
        ];
        let mut names: Vec<_> = all.iter().map(|r| r.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }
}
