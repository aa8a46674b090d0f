//! What the workspace's experiment tools share, kept out of the libraries so that a device
//! build links no chart or progress crate:
//!
//! * [`report`]: what every experiment prints and writes: machine metadata and conditions,
//!   sample summaries, a progress bar, a Ctrl-C that stops cleanly, size labels and the
//!   Markdown report file (`--report`);
//! * [`advice`]: the sizing advisor's table and occupancy chart (`bounce-replay --advise`);
//! * [`chart`]: SVG line charts (integer x ticks, SI-prefixed y labels, solid and dashed lines,
//!   a caption with the conditions).
//!
//! Command-line parsing is [`bouncevm_common::cli`], shared with the back end and the load
//! generator, which link none of this.
//!
//! The crate's binaries are `bounce-experiment` (the allocator experiments and
//! `map-benchmark` on the host) and `bounce-replay` (trace replay through [`bounce::trace`]).

#![warn(missing_docs)]

pub mod advice;
pub mod chart;
pub mod report;
