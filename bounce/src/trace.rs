//! Trace replay: JSON-lines traces of map/unmap/sync operations, replayed through a
//! [`BouncePool`] to compare its placement decisions with a real kernel's.
//!
//! Two formats are read, line by line, plain or gzip-compressed (detected by the gzip magic):
//!
//! - **The kernel trace format** (`swiotlb-kernel-trace/1`, see `shared/traces/README.md`): a
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

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::Deserialize;
use vm_memory::VolatileSlice;

use crate::alloc::AllocatorKind;
use crate::error::Error;
use crate::geometry::{PoolConfig, PoolMode, SizeLimit};
use crate::orig::OrigMemory;
use crate::pool::{BouncePool, Mapping};
use crate::types::{Direction, DmaAttrs, MapRequest};
use crate::DEFAULT_SEG_BOUNDARY_MASK;

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
    /// The pool described by the trace and the options cannot be built.
    #[error("cannot build the replay pool: {0}")]
    Pool(#[from] Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, TraceError>;

/// The pool geometry a kernel trace was recorded with (its `header` line).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceHeader {
    /// Slots of the kernel's pool.
    pub nslabs: Option<usize>,
    /// Areas of the kernel's pool.
    pub nareas: Option<usize>,
    /// Physical address of the pool's first slot.
    pub start: Option<u64>,
    /// The device's `min_align_mask`.
    pub min_align_mask: Option<u64>,
    /// The device's segment boundary mask.
    pub seg_boundary_mask: Option<u64>,
    /// CPUs of the traced machine.
    pub cpus: Option<usize>,
}

/// What the kernel decided for a map, when the trace recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelDecision {
    /// The bounce address returned, or `None` when the kernel reported "buffer is full".
    pub tlb_addr: Option<u64>,
    /// Each area's `used` count right after the allocation.
    pub area_used: Option<Vec<usize>>,
    /// Each area's rolling index right after the allocation.
    pub area_index: Option<Vec<usize>>,
}

/// A map operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapOp {
    /// Identifies the mapping for later unmap and sync operations.
    pub id: u64,
    /// Original address.
    pub orig: u64,
    /// Mapping size in bytes.
    pub size: usize,
    /// Calling worker (the kernel's CPU).
    pub worker: usize,
    /// Direction.
    pub dir: Direction,
    /// Attributes.
    pub attrs: DmaAttrs,
    /// `min_align_mask`; `None` takes the header's (or 0).
    pub min_align_mask: Option<u64>,
    /// `alloc_align_mask`.
    pub alloc_align_mask: u64,
    /// Segment boundary mask; `None` takes the header's (or the PCI default).
    pub seg_boundary_mask: Option<u64>,
    /// The kernel's decision, in kernel traces.
    pub kernel: Option<KernelDecision>,
}

/// One operation of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceOp {
    /// The kernel trace's header.
    Header(TraceHeader),
    /// Map a buffer.
    Map(MapOp),
    /// Unmap the mapping `id`; `attrs` overrides the map's attributes when given.
    Unmap {
        /// The map's id.
        id: u64,
        /// Releasing worker; `None` means worker 0.
        worker: Option<usize>,
        /// Attributes of the unmap.
        attrs: Option<DmaAttrs>,
    },
    /// Sync part of the mapping `id` for the CPU (`for_cpu`) or for the device.
    Sync {
        /// The map's id.
        id: u64,
        /// True for `sync_for_cpu`, false for `sync_for_device`.
        for_cpu: bool,
        /// Offset into the mapping.
        offset: usize,
        /// Bytes; `None` means to the end of the mapping.
        size: Option<usize>,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawDir {
    Num(u64),
    Name(String),
}

#[derive(Deserialize)]
struct RawLine {
    op: String,
    id: Option<u64>,
    orig: Option<u64>,
    size: Option<u64>,
    cpu: Option<usize>,
    worker: Option<usize>,
    dir: Option<RawDir>,
    attrs: Option<u64>,
    min_align_mask: Option<u64>,
    alloc_align_mask: Option<u64>,
    seg_boundary_mask: Option<u64>,
    offset: Option<u64>,
    kernel_tlb_addr: Option<u64>,
    kernel_error: Option<String>,
    kernel_area_used: Option<Vec<usize>>,
    kernel_area_index: Option<Vec<usize>>,
    nslabs: Option<usize>,
    nareas: Option<usize>,
    start: Option<u64>,
    cpus: Option<usize>,
}

fn parse_dir(raw: Option<&RawDir>) -> std::result::Result<Direction, String> {
    match raw {
        None => Err("missing dir".into()),
        Some(RawDir::Num(n)) => {
            Direction::from_linux(*n).ok_or_else(|| format!("bad dir {n} (expected 0, 1, 2)"))
        }
        Some(RawDir::Name(s)) => match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "bidirectional" => Ok(Direction::Bidirectional),
            "to-device" => Ok(Direction::ToDevice),
            "from-device" => Ok(Direction::FromDevice),
            other => Err(format!("bad dir '{other}'")),
        },
    }
}

fn to_usize(v: u64, what: &str) -> std::result::Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("{what} {v} does not fit"))
}

/// Parses one line of a trace. Blank lines give `Ok(None)`.
///
/// # Errors
/// [`TraceError::Parse`] for invalid JSON, an unknown `op` or a missing field.
pub fn parse_line(line_no: u64, line: &str) -> Result<Option<TraceOp>> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(None);
    }
    let err = |reason: String| TraceError::Parse {
        line: line_no,
        reason,
    };
    let raw: RawLine = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
    let need_id = || raw.id.ok_or_else(|| err(format!("{} without id", raw.op)));
    let op = match raw.op.as_str() {
        "header" => TraceOp::Header(TraceHeader {
            nslabs: raw.nslabs,
            nareas: raw.nareas,
            start: raw.start,
            min_align_mask: raw.min_align_mask,
            seg_boundary_mask: raw.seg_boundary_mask,
            cpus: raw.cpus,
        }),
        "map" => {
            let id = need_id()?;
            let kernel = if raw.kernel_tlb_addr.is_some() || raw.kernel_error.is_some() {
                Some(KernelDecision {
                    tlb_addr: raw.kernel_tlb_addr,
                    area_used: raw.kernel_area_used,
                    area_index: raw.kernel_area_index,
                })
            } else {
                None
            };
            TraceOp::Map(MapOp {
                id,
                orig: raw.orig.ok_or_else(|| err("map without orig".into()))?,
                size: to_usize(
                    raw.size.ok_or_else(|| err("map without size".into()))?,
                    "size",
                )
                .map_err(err)?,
                worker: raw.worker.or(raw.cpu).unwrap_or(0),
                dir: parse_dir(raw.dir.as_ref()).map_err(err)?,
                attrs: DmaAttrs::from_linux(raw.attrs.unwrap_or(0)),
                min_align_mask: raw.min_align_mask,
                alloc_align_mask: raw.alloc_align_mask.unwrap_or(0),
                seg_boundary_mask: raw.seg_boundary_mask,
                kernel,
            })
        }
        "unmap" => TraceOp::Unmap {
            id: need_id()?,
            worker: raw.worker.or(raw.cpu),
            attrs: raw.attrs.map(DmaAttrs::from_linux),
        },
        "sync_for_cpu" | "sync_for_device" => TraceOp::Sync {
            id: need_id()?,
            for_cpu: raw.op == "sync_for_cpu",
            offset: to_usize(raw.offset.unwrap_or(0), "offset").map_err(err)?,
            size: raw
                .size
                .map(|s| to_usize(s, "size"))
                .transpose()
                .map_err(err)?,
        },
        other => return Err(err(format!("unknown op '{other}'"))),
    };
    Ok(Some(op))
}

/// Opens a trace file, transparently decompressing gzip.
///
/// # Errors
/// [`TraceError::Io`] when the file cannot be opened or read.
pub fn open(path: &Path) -> Result<TraceReader<Box<dyn BufRead>>> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let magic = file.fill_buf().map_err(io)?;
    let reader: Box<dyn BufRead> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(file),
        ))
    } else {
        Box::new(file)
    };
    Ok(TraceReader::new(reader, path.display().to_string()))
}

/// Iterates over the operations of a trace, with their 1-based line numbers.
#[derive(Debug)]
pub struct TraceReader<R> {
    inner: R,
    name: String,
    line_no: u64,
    buf: String,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads operations from `inner`; `name` is used in error messages.
    pub fn new(inner: R, name: String) -> Self {
        Self {
            inner,
            name,
            line_no: 0,
            buf: String::new(),
        }
    }
}

impl<R: Read> TraceReader<BufReader<R>> {
    /// Reads operations from an unbuffered reader.
    pub fn from_reader(inner: R, name: String) -> Self {
        Self::new(BufReader::new(inner), name)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<(u64, TraceOp)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buf.clear();
            match self.inner.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(source) => {
                    return Some(Err(TraceError::Io {
                        path: self.name.clone(),
                        source,
                    }))
                }
            }
            self.line_no += 1;
            match parse_line(self.line_no, &self.buf) {
                Ok(None) => continue,
                Ok(Some(op)) => return Some(Ok((self.line_no, op))),
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Original memory that is not there: every address is accessible, reads produce zeros, writes
/// are discarded. Replays use it so they measure placement, not copies to a vanished guest.
#[derive(Clone, Copy, Debug, Default)]
pub struct NullMemory;

impl OrigMemory for NullMemory {
    fn check(&self, _addr: u64, _len: usize, _write: bool) -> bool {
        true
    }

    fn read_orig(&self, addr: u64, dst: &VolatileSlice<'_>) -> crate::Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let len = dst.len();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZEROS.len());
            dst.subslice(done, n)
                .map_err(|_| Error::OrigAccess { addr, len })?
                .copy_from(&ZEROS[..n]);
            done += n;
        }
        Ok(())
    }

    fn write_orig(&self, _addr: u64, _src: &VolatileSlice<'_>) -> crate::Result<()> {
        Ok(())
    }
}

/// How to build the replay pool; `None` fields come from the trace header, then from defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayOptions {
    /// The allocator.
    pub allocator: AllocatorKind,
    /// swiotlb or iova semantics.
    pub mode: PoolMode,
    /// Slots; default: the header's `nslabs`, else Linux's default.
    pub slots: Option<usize>,
    /// Areas; default: the header's `nareas`, else one per worker.
    pub areas: Option<usize>,
    /// Workers; default: the header's `cpus`, else 1.
    pub workers: Option<usize>,
    /// Device address of slot 0; default: the header's `start`, else the mode's default.
    pub base: Option<u64>,
    /// Compare each map with the kernel's decision when the trace has it.
    pub compare: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            allocator: AllocatorKind::Areas,
            mode: PoolMode::Swiotlb,
            slots: None,
            areas: None,
            workers: None,
            base: None,
            compare: false,
        }
    }
}

impl ReplayOptions {
    /// The pool configuration for a trace with `header` (if it has one).
    pub fn pool_config(&self, header: Option<&TraceHeader>) -> PoolConfig {
        let h = header.cloned().unwrap_or_default();
        let mut c = match self.mode {
            PoolMode::Swiotlb => {
                PoolConfig::swiotlb(self.slots.or(h.nslabs).unwrap_or(PoolConfig::DEFAULT_SLOTS))
            }
            PoolMode::Iova => {
                PoolConfig::iova(self.slots.or(h.nslabs).unwrap_or(PoolConfig::DEFAULT_SLOTS))
            }
        };
        c.allocator = self.allocator;
        // A trace records what the kernel's map accepted, which is more than the maximum
        // mapping size it advertises: accept the same band.
        c.size_limit = SizeLimit::Kernel;
        c.workers = self.workers.or(h.cpus).unwrap_or(1).max(1);
        if self.mode == PoolMode::Swiotlb {
            c.areas = self.areas.or(h.nareas);
        }
        if let Some(base) = self.base.or(h.start) {
            c.base = base;
        }
        c
    }
}

/// What one replayed operation did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A header (nothing to do).
    Header,
    /// A map succeeded.
    Mapped {
        /// The map's id.
        id: u64,
        /// Device address returned.
        dev_addr: u64,
        /// First slot of the allocation (padding included).
        slot: usize,
        /// Slots allocated.
        nslots: usize,
    },
    /// A map failed.
    MapFailed {
        /// The map's id.
        id: u64,
        /// Why.
        error: Error,
    },
    /// An unmap succeeded.
    Unmapped {
        /// The map's id.
        id: u64,
    },
    /// A sync succeeded.
    Synced {
        /// The map's id.
        id: u64,
    },
    /// An unmap or sync failed (unknown id, or a pool error).
    Failed {
        /// The map's id.
        id: u64,
        /// Why.
        reason: String,
    },
}

/// A map whose result differs from the kernel's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Trace line.
    pub line: u64,
    /// The map's id.
    pub id: u64,
    /// What differs.
    pub what: String,
}

/// Counters of a replay.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplaySummary {
    /// Operations replayed.
    pub ops: u64,
    /// Successful maps.
    pub maps: u64,
    /// Maps that failed with "pool full".
    pub pool_full: u64,
    /// Maps that failed with another error.
    pub map_errors: u64,
    /// Successful unmaps.
    pub unmaps: u64,
    /// Successful syncs.
    pub syncs: u64,
    /// Unmaps and syncs that failed.
    pub other_errors: u64,
    /// Maps compared with a kernel decision.
    pub compared: u64,
    /// Maps whose result differed from the kernel's.
    pub mismatches: u64,
}

/// Replays operations through a pool, keeping the live mappings by id.
#[derive(Debug)]
pub struct Replayer {
    pool: BouncePool,
    live: HashMap<u64, Mapping>,
    min_align_mask: u64,
    seg_boundary_mask: u64,
    compare: bool,
    summary: ReplaySummary,
}

impl Replayer {
    /// Builds the pool for `opts` and the trace's `header`.
    ///
    /// # Errors
    /// [`TraceError::Pool`] when the pool cannot be built.
    pub fn new(opts: &ReplayOptions, header: Option<&TraceHeader>) -> Result<Self> {
        let pool = BouncePool::new(&opts.pool_config(header))?;
        Ok(Self {
            pool,
            live: HashMap::new(),
            min_align_mask: header.and_then(|h| h.min_align_mask).unwrap_or(0),
            seg_boundary_mask: header
                .and_then(|h| h.seg_boundary_mask)
                .unwrap_or(DEFAULT_SEG_BOUNDARY_MASK),
            compare: opts.compare,
            summary: ReplaySummary::default(),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &BouncePool {
        &self.pool
    }

    /// The counters so far.
    pub fn summary(&self) -> &ReplaySummary {
        &self.summary
    }

    /// Mappings still live.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Applies one operation; mismatches with the kernel's decision (when comparing) are
    /// appended to `mismatches`.
    pub fn apply(&mut self, line: u64, op: &TraceOp, mismatches: &mut Vec<Mismatch>) -> Outcome {
        self.summary.ops += 1;
        match op {
            TraceOp::Header(_) => Outcome::Header,
            TraceOp::Map(m) => self.map(line, m, mismatches),
            TraceOp::Unmap { id, worker, attrs } => {
                let Some(mapping) = self.live.remove(id) else {
                    self.summary.other_errors += 1;
                    return Outcome::Failed {
                        id: *id,
                        reason: "unmap of an unknown or failed map".into(),
                    };
                };
                let worker = worker.unwrap_or(0);
                let r = self.pool.unmap_single(
                    &NullMemory,
                    mapping.dev_addr,
                    mapping.size,
                    mapping.dir,
                    attrs.unwrap_or(mapping.attrs),
                    worker,
                );
                match r {
                    Ok(()) => {
                        self.summary.unmaps += 1;
                        Outcome::Unmapped { id: *id }
                    }
                    Err(e) => {
                        self.summary.other_errors += 1;
                        Outcome::Failed {
                            id: *id,
                            reason: e.to_string(),
                        }
                    }
                }
            }
            TraceOp::Sync {
                id,
                for_cpu,
                offset,
                size,
            } => {
                let Some(mapping) = self.live.get(id) else {
                    self.summary.other_errors += 1;
                    return Outcome::Failed {
                        id: *id,
                        reason: "sync of an unknown or failed map".into(),
                    };
                };
                let size = size.unwrap_or(mapping.size.saturating_sub(*offset));
                let r = match mapping.dev_addr.checked_add(*offset as u64) {
                    None => Err(Error::OutOfPool {
                        addr: mapping.dev_addr,
                        len: size,
                    }),
                    Some(addr) if *for_cpu => {
                        self.pool.sync_for_cpu(&NullMemory, addr, size, mapping.dir)
                    }
                    Some(addr) => self
                        .pool
                        .sync_for_device(&NullMemory, addr, size, mapping.dir),
                };
                match r {
                    Ok(()) => {
                        self.summary.syncs += 1;
                        Outcome::Synced { id: *id }
                    }
                    Err(e) => {
                        self.summary.other_errors += 1;
                        Outcome::Failed {
                            id: *id,
                            reason: e.to_string(),
                        }
                    }
                }
            }
        }
    }

    fn map(&mut self, line: u64, m: &MapOp, mismatches: &mut Vec<Mismatch>) -> Outcome {
        let req = MapRequest {
            orig: m.orig,
            size: m.size,
            dir: m.dir,
            attrs: m.attrs,
            min_align_mask: m.min_align_mask.unwrap_or(self.min_align_mask),
            alloc_align_mask: m.alloc_align_mask,
            seg_boundary_mask: m.seg_boundary_mask.unwrap_or(self.seg_boundary_mask),
            worker: m.worker,
        };
        let result = self.pool.map(&NullMemory, &req);
        if self.compare {
            if let Some(k) = &m.kernel {
                self.compare_map(line, m.id, k, &result, mismatches);
            }
        }
        match result {
            Ok(mapping) => {
                self.summary.maps += 1;
                if let Some(old) = self.live.insert(m.id, mapping) {
                    // A reused id: the trace lost an unmap. Keep the pool consistent.
                    tracing::warn!(id = m.id, line, "map id reused while live; unmapping");
                    let _ = self.pool.unmap(&NullMemory, &old, m.worker);
                }
                Outcome::Mapped {
                    id: m.id,
                    dev_addr: mapping.dev_addr,
                    slot: mapping.slot,
                    nslots: mapping.nslots,
                }
            }
            Err(error) => {
                if matches!(error, Error::PoolFull { .. }) {
                    self.summary.pool_full += 1;
                } else {
                    self.summary.map_errors += 1;
                }
                Outcome::MapFailed { id: m.id, error }
            }
        }
    }

    fn compare_map(
        &mut self,
        line: u64,
        id: u64,
        k: &KernelDecision,
        result: &crate::Result<Mapping>,
        mismatches: &mut Vec<Mismatch>,
    ) {
        self.summary.compared += 1;
        let mut what = Vec::new();
        match (k.tlb_addr, result) {
            (Some(want), Ok(got)) if got.dev_addr == want => {}
            (None, Err(Error::PoolFull { .. })) => {}
            (Some(want), Ok(got)) => {
                what.push(format!("kernel {want:#x}, got {:#x}", got.dev_addr));
            }
            (Some(want), Err(e)) => what.push(format!("kernel {want:#x}, got error: {e}")),
            (None, Ok(got)) => what.push(format!("kernel full, got {:#x}", got.dev_addr)),
            (None, Err(e)) => what.push(format!("kernel full, got another error: {e}")),
        }
        let alloc = self.pool.allocator();
        if let Some(want) = &k.area_used {
            let got = alloc.area_used();
            if *want != got {
                what.push(format!("area used: kernel {want:?}, got {got:?}"));
            }
        }
        if let Some(want) = &k.area_index {
            let got = alloc.area_index();
            if !got.is_empty() && *want != got {
                what.push(format!("area index: kernel {want:?}, got {got:?}"));
            }
        }
        if !what.is_empty() {
            self.summary.mismatches += 1;
            mismatches.push(Mismatch {
                line,
                id,
                what: what.join("; "),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_formats() {
        let k = r#"{"op":"map","id":0,"orig":1049125112,"size":16,"cpu":1,"min_align_mask":0,"alloc_align_mask":0,"dir":1,"attrs":0,"ts":1,"phase":"x","kernel_area_used":[1],"kernel_area_index":[1],"kernel_tlb_addr":955252736}"#;
        let Some(TraceOp::Map(m)) = parse_line(1, k).unwrap() else {
            panic!("not a map");
        };
        assert_eq!(
            (m.id, m.size, m.worker, m.dir),
            (0, 16, 1, Direction::ToDevice)
        );
        let kd = m.kernel.unwrap();
        assert_eq!(kd.tlb_addr, Some(955252736));
        assert_eq!(kd.area_used, Some(vec![1]));
        let full = r#"{"op":"map","id":5,"orig":1,"size":262144,"cpu":0,"dir":2,"kernel_tlb_addr":null,"kernel_error":"full"}"#;
        let Some(TraceOp::Map(m)) = parse_line(2, full).unwrap() else {
            panic!("not a map");
        };
        assert_eq!(m.kernel.unwrap().tlb_addr, None);

        let u = r#"{"op":"map","id":7,"orig":4096,"size":512,"dir":"from_device","worker":3}"#;
        let Some(TraceOp::Map(m)) = parse_line(3, u).unwrap() else {
            panic!("not a map");
        };
        assert_eq!(
            (m.worker, m.dir, m.kernel),
            (3, Direction::FromDevice, None)
        );
        assert_eq!(
            parse_line(4, r#"{"op":"sync_for_cpu","id":7,"offset":8}"#).unwrap(),
            Some(TraceOp::Sync {
                id: 7,
                for_cpu: true,
                offset: 8,
                size: None
            })
        );
        assert_eq!(
            parse_line(5, r#"{"op":"unmap","id":7,"attrs":32}"#).unwrap(),
            Some(TraceOp::Unmap {
                id: 7,
                worker: None,
                attrs: Some(DmaAttrs::from_linux(32))
            })
        );
        assert_eq!(parse_line(6, "  ").unwrap(), None);
        for bad in [
            "{",
            r#"{"op":"map","id":1}"#,
            r#"{"op":"map","id":1,"orig":0,"size":1,"dir":9}"#,
            r#"{"op":"map","id":1,"orig":0,"size":1,"dir":"sideways"}"#,
            r#"{"op":"frobnicate"}"#,
            r#"{"op":"unmap"}"#,
        ] {
            assert!(parse_line(7, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn replays_a_user_trace() {
        let text = r#"{"op":"map","id":1,"orig":4096,"size":512,"dir":"to-device","worker":0}
{"op":"map","id":2,"orig":8192,"size":8192,"dir":2,"worker":1}
{"op":"sync_for_cpu","id":2,"offset":100,"size":200}
{"op":"sync_for_device","id":1}
{"op":"unmap","id":1}
{"op":"unmap","id":1}
{"op":"unmap","id":2}
"#;
        let opts = ReplayOptions {
            slots: Some(256),
            areas: Some(1),
            ..ReplayOptions::default()
        };
        let mut r = Replayer::new(&opts, None).unwrap();
        let mut mm = Vec::new();
        let outs: Vec<Outcome> = TraceReader::from_reader(text.as_bytes(), "t".into())
            .map(|x| {
                let (line, op) = x.unwrap();
                r.apply(line, &op, &mut mm)
            })
            .collect();
        let base = PoolConfig::DEFAULT_SWIOTLB_BASE;
        assert_eq!(
            outs[0],
            Outcome::Mapped {
                id: 1,
                dev_addr: base,
                slot: 0,
                nslots: 1
            }
        );
        assert_eq!(
            outs[1],
            Outcome::Mapped {
                id: 2,
                dev_addr: base + 4096,
                slot: 2,
                nslots: 4
            }
        );
        assert!(matches!(outs[5], Outcome::Failed { id: 1, .. }));
        let s = r.summary();
        assert_eq!((s.maps, s.unmaps, s.syncs, s.other_errors), (2, 2, 2, 1));
        assert_eq!(r.pool().used(), 0);
        assert!(mm.is_empty());
    }

    #[test]
    fn null_memory_reads_zeros() {
        let mut buf = [0xffu8; 5000];
        let s = VolatileSlice::from(&mut buf[..]);
        NullMemory.read_orig(0, &s).unwrap();
        NullMemory.write_orig(u64::MAX, &s).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }
}
