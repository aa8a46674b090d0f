//! What bouncevm's binaries share that is not device code: unix sockets bound safely
//! ([`sock`]) and signals read through a signalfd ([`SignalFd`]), for `bouncevm` and
//! `bouncevm-vhost`; the stderr logger ([`init_logging`], filter from [`LOG_ENV`]) for every
//! `bouncevm*` binary; clap parsing with a one-line usage error ([`cli`]) for every clap
//! binary of the workspace (`bounce-*` too).
//!
//! No KVM and no architecture gate: the vhost-user back end builds anywhere Linux does.

#![warn(missing_docs)]

pub mod cli;
pub mod signal;
pub mod sock;

pub use signal::SignalFd;

/// The environment variable the binaries read their log filter from (tracing env-filter
/// syntax, e.g. `BOUNCEVM_LOG=info` or `BOUNCEVM_LOG=bouncevm_vhost=debug`).
pub const LOG_ENV: &str = "BOUNCEVM_LOG";

/// Installs the stderr logger of the binaries: the filter from [`LOG_ENV`], else `default`.
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .init();
}
