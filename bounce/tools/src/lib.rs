//! What the workspace's command-line tools share, kept out of the libraries so that a device
//! build links no CLI, chart or progress crate:
//!
//! * [`cli`]: command-line parsing with clap, a usage error as one line and exit status 2
//!   (`bounce-*` here, `bouncevm-vhost`, `bouncevm-load`, `bouncevm-experiment`);
//! * [`report`]: what every experiment prints and writes: machine metadata and conditions,
//!   sample summaries, a progress bar, a Ctrl-C that stops cleanly, size labels and the
//!   Markdown report file (`--report`);
//! * [`chart`]: SVG line charts (integer x ticks, SI-prefixed y labels, solid and dashed lines,
//!   a caption with the conditions).
//!
//! The crate's binaries are `bounce-experiment` (the allocator experiments and
//! `map-benchmark` on the host) and `bounce-replay` (trace replay through [`bounce::trace`]).

#![warn(missing_docs)]

pub mod chart;
pub mod cli;
pub mod report;
