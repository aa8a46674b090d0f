//! Trace replay: JSON-lines traces of map/unmap/sync operations, replayed through a
//! [`BouncePool`] to compare its placement decisions with a real kernel's.
//!
//! Two formats of JSON lines are read, plain or gzip-compressed (detected by the gzip magic),
//! and a compact binary form of them ([`compact`], detected by its own magic):
//!
//! - **The kernel trace format** (`swiotlb-kernel-trace/1`, see `bounce/README.md`): a
//!   `header` line with the pool geometry (`nslabs`, `nareas`, `start`, `seg_boundary_mask`,
//!   `cpus`), then `map` lines (`id`, `orig`, `size`, `cpu`, `dir` as 0/1/2, `attrs` as Linux
//!   bits, `min_align_mask`, `alloc_align_mask`, and what the kernel decided:
//!   `kernel_tlb_addr` or `kernel_error: "full"`, plus `kernel_area_used`/`kernel_area_index`)
//!   and `unmap` lines (`id` of the map they release).
//! - **A simple user format** for hand-written or generated workloads:
//!   `{"op":"map","id":1,"orig":4096,"size":512,"dir":"to-device","worker":0,"min_align_mask":0}`,
//!   `{"op":"unmap","id":1}`, `{"op":"sync_for_cpu","id":1,"offset":0,"size":512}`,
//!   `{"op":"sync_for_device","id":1}`. `dir` is `"bidirectional"`, `"to-device"`,
//!   `"from-device"` (or `_` instead of `-`) or Linux's number 0/1/2; `worker` and `cpu` are
//!   synonyms; optional fields: `attrs`, `alloc_align_mask`, `seg_boundary_mask`; a sync's
//!   `offset` defaults to 0 and its `size` to the rest of the mapping.
//!
//! Both formats mix freely (the op names are the same); unknown fields are ignored, so kernel
//! bookkeeping fields (`ts`, `phase`, ...) cost nothing.
//!
//! Original addresses of a trace are guest-physical addresses of a machine that is gone, so a
//! replay uses [`NullMemory`]: every original address is accessible, reads produce zeros and
//! writes are discarded. A replay therefore measures placement (and the pool's own copies into
//! and out of its slots), not guest memory.
//!
//! The module is split by job: [`parse`] turns one line of either format into a [`TraceOp`],
//! [`reader`] opens files (JSON or compact, plain or gzip) and iterates over their lines,
//! [`compact`] writes and reads the compact form, [`replay`] runs operations through a pool
//! and compares with the kernel, and [`advise`] searches the smallest pool a trace needs.

pub mod advise;
pub mod compact;
pub mod parse;
pub mod reader;
pub mod replay;

pub use compact::{as_stored, write_compact, CompactReader, CompactSummary};
pub use parse::{
    parse_line, DebugfsCounters, DynamicHeader, KernelCounters, KernelDecision, MapOp,
    SwiotlbCounters, TraceHeader, TraceOp, FORMAT_VERSION,
};
pub use reader::{open, TraceFile, TraceReader};
pub use replay::{Mismatch, NullMemory, Outcome, ReplayOptions, ReplaySummary, Replayer};

use crate::error::Error;

/// Errors of reading and replaying traces.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// A line is not a valid operation.
    #[error("trace line {line}: {reason}")]
    Parse {
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A compact trace is corrupt, truncated or of a version this build does not read. `offset`
    /// is the byte of the record stream (the file's content, decompressed) where the failing
    /// record starts; `record` its 1-based number (0: the stream's magic and version).
    #[error("compact trace {path}: record {record} at byte {offset}: {reason}")]
    Compact {
        /// The file.
        path: String,
        /// Byte of the record stream.
        offset: u64,
        /// 1-based record number.
        record: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A trace is well-formed but cannot be replayed as it stands: an unmap or sync of a map
    /// it never made, a map id reused while live, a header Linux could not have written.
    #[error("{path}, line {line}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// The pool described by the trace and the options cannot be built.
    #[error("cannot build the replay pool: {0}")]
    Pool(#[from] Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, TraceError>;
