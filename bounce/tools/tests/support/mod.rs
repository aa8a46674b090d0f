//! What the command-line tests share: running one of the crate's binaries as a user would.

use std::process::{Command, Output};

/// Runs `bin` with `args` and returns what it did.
pub fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{bin} runs: {e}"))
}

/// Runs `bin` with `args`, asserts it succeeded and returns its stdout.
pub fn ok(bin: &str, args: &[&str]) -> String {
    let out = run(bin, args);
    assert!(
        out.status.success(),
        "{args:?}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}
