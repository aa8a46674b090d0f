//! One line of a trace, in either format, parsed into a [`TraceOp`].

use serde::Deserialize;

use super::{Result, TraceError};
use crate::dynamic::PoolKind;
use crate::types::{Direction, DmaAttrs};

/// The newest kernel trace format this reader knows (`swiotlb-kernel-trace/2`: dynamic pools).
pub const FORMAT_VERSION: u32 = 2;

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
    /// Each area's rolling index when the capture began (a live kernel's pool has been used
    /// before tracing starts); a replay starts its areas there.
    pub area_index_at_start: Option<Vec<usize>>,
    /// Each area's used count when the capture began.
    pub area_used_at_start: Option<Vec<usize>>,
    /// The format's version (`swiotlb-kernel-trace/N`; 1 when the header does not say).
    pub version: u32,
    /// The kernel's dynamic pools (format 2).
    pub dynamic: Option<DynamicHeader>,
    /// `io_tlb_used_hiwater` when the capture began.
    pub hiwater_at_start: Option<u64>,
    /// The counters debugfs showed when the capture ended.
    pub counters_at_end: Option<DebugfsCounters>,
}

/// What a dynamic kernel fixed at boot (the header's `dynamic`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DynamicHeader {
    /// Linux `default_nareas`: the search loop's bound, the area count asked of added pools.
    pub default_nareas: usize,
    /// Linux `default_nslabs`: what the growth worker asks for.
    pub default_nslabs: usize,
    /// Linux `mem->can_grow`.
    pub can_grow: bool,
    /// The highest physical address pools may use.
    pub phys_limit: u64,
}

/// The swiotlb counters debugfs shows (`T`: each one's value, or whether the trace has it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwiotlbCounters<T> {
    /// `io_tlb_nslabs`.
    pub nslabs: T,
    /// `io_tlb_used`.
    pub used: T,
    /// `io_tlb_used_hiwater`.
    pub hiwater: T,
    /// `io_tlb_transient_nslabs`.
    pub transient_nslabs: T,
}

/// The four counters at a map's return (format 2).
pub type KernelCounters = SwiotlbCounters<u64>;

/// The counters of a header's `debugfs_before`/`debugfs_after`, each when the capture read it.
pub type DebugfsCounters = SwiotlbCounters<Option<u64>>;

/// What the kernel decided for a map, when the trace recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelDecision {
    /// The bounce address returned, or `None` when the kernel reported "buffer is full".
    pub tlb_addr: Option<u64>,
    /// Each area's `used` count right after the allocation.
    pub area_used: Option<Vec<usize>>,
    /// Each area's rolling index right after the allocation.
    pub area_index: Option<Vec<usize>>,
    /// Start and kind of the pool the bounce buffer is in (format 2, successful maps).
    pub pool: Option<(u64, PoolKind)>,
    /// The map asked the growth worker for a pool (format 2).
    pub grow: bool,
    /// The counters at the map's return (format 2, when no other operation overlapped it).
    pub counters: Option<KernelCounters>,
}

// Field list of a map record; alike in shape only to other record structs.
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
    /// When the map was entered and when it returned (kernel clock), when the trace says.
    pub time: Option<(u64, u64)>,
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
    /// The growth worker's pool became visible to maps here (format 2): every later map
    /// searches it first.
    PoolAdd {
        /// Start address.
        start: u64,
        /// Slots.
        nslabs: usize,
        /// Areas.
        nareas: usize,
        /// When the worker run that made it started (kernel clock).
        worker_ts: Option<u64>,
    },
    /// The transient pool the kernel's page allocator gave the next map `id` (format 2): an
    /// input of that map, as its CPU is.
    TransientAlloc {
        /// The map it is for.
        id: u64,
        /// Start address; `None` when the allocation failed.
        start: Option<u64>,
        /// Slots.
        nslabs: usize,
        /// Areas.
        nareas: usize,
    },
    /// The kernel freed the transient pool of map `id` (format 2): after its unmap, or with
    /// `search_failed` right before the map, whose slot search failed in the fresh pool.
    TransientFree {
        /// The map it was for.
        id: u64,
        /// Start address.
        start: u64,
        /// Slots.
        nslabs: usize,
        /// No slot fitted in the fresh pool (the map failed).
        search_failed: bool,
    },
}

impl TraceOp {
    /// The op's name in the format: `header`, `map`, ...
    pub fn name(&self) -> &'static str {
        match self {
            TraceOp::Header(_) => "header",
            TraceOp::Map(_) => "map",
            TraceOp::Unmap { .. } => "unmap",
            TraceOp::Sync { for_cpu: true, .. } => "sync_for_cpu",
            TraceOp::Sync { .. } => "sync_for_device",
            TraceOp::PoolAdd { .. } => "pool_add",
            TraceOp::TransientAlloc { .. } => "transient_alloc",
            TraceOp::TransientFree { .. } => "transient_free",
        }
    }

    /// True for the ops of format 2 (dynamic pools).
    pub fn is_dynamic(&self) -> bool {
        matches!(
            self,
            TraceOp::PoolAdd { .. }
                | TraceOp::TransientAlloc { .. }
                | TraceOp::TransientFree { .. }
        )
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawDir {
    Num(u64),
    Name(String),
}

/// Every field either format may carry, as serde reads it (its runs of same-shape lines are
/// the format's field list, not logic written twice).
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
    area_index_at_start: Option<Vec<usize>>,
    area_used_at_start: Option<Vec<usize>>,
    format: Option<String>,
    dynamic: Option<RawDynamic>,
    debugfs_before: Option<RawDebugfs>,
    debugfs_after: Option<RawDebugfs>,
    kernel_pool: Option<u64>,
    kernel_pool_kind: Option<String>,
    kernel_grow: Option<bool>,
    kernel_nslabs: Option<u64>,
    kernel_used: Option<u64>,
    kernel_hiwater: Option<u64>,
    kernel_transient_nslabs: Option<u64>,
    failed: Option<bool>,
    search_failed: Option<bool>,
    ts: Option<serde_json::Value>,
    ret_ts: Option<serde_json::Value>,
    worker_ts: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawDynamic {
    default_nareas: usize,
    default_nslabs: usize,
    can_grow: serde_json::Value,
    phys_limit: Option<u64>,
}

/// debugfs values as the capture wrote them: numbers, or the file's text.
#[derive(Deserialize)]
struct RawDebugfs {
    io_tlb_nslabs: Option<serde_json::Value>,
    io_tlb_used: Option<serde_json::Value>,
    io_tlb_used_hiwater: Option<serde_json::Value>,
    io_tlb_transient_nslabs: Option<serde_json::Value>,
}

/// A counter as a number, or as the decimal text debugfs printed; anything else (`"na"`) is
/// none.
fn counter(v: Option<&serde_json::Value>) -> Option<u64> {
    match v? {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

impl RawDebugfs {
    fn counters(&self) -> DebugfsCounters {
        DebugfsCounters {
            nslabs: counter(self.io_tlb_nslabs.as_ref()),
            used: counter(self.io_tlb_used.as_ref()),
            hiwater: counter(self.io_tlb_used_hiwater.as_ref()),
            transient_nslabs: counter(self.io_tlb_transient_nslabs.as_ref()),
        }
    }
}

/// The version of a `format` string: `swiotlb-kernel-trace/N`.
fn format_version(format: Option<&str>) -> std::result::Result<u32, String> {
    let Some(f) = format else {
        return Ok(1);
    };
    let v = f
        .strip_prefix("swiotlb-kernel-trace/")
        .and_then(|v| v.parse::<u32>().ok())
        .ok_or_else(|| format!("unknown trace format '{f}'"))?;
    if v == 0 || v > FORMAT_VERSION {
        return Err(format!(
            "trace format '{f}': this reader knows swiotlb-kernel-trace/1 to /{FORMAT_VERSION}"
        ));
    }
    Ok(v)
}

/// The kernel trace format this build reads (a header without `format` is taken as it).
pub const KERNEL_TRACE_FORMAT: &str = "swiotlb-kernel-trace/1";

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

/// `v`, or the reason an `op` line without `field` is refused.
fn required<T>(v: Option<T>, op: &str, field: &str) -> std::result::Result<T, String> {
    v.ok_or_else(|| format!("{op} without {field}"))
}

fn pool_kind(s: &str) -> std::result::Result<PoolKind, String> {
    match s {
        "default" => Ok(PoolKind::Default),
        "added" => Ok(PoolKind::Added),
        "transient" => Ok(PoolKind::Transient),
        other => Err(format!("bad kernel_pool_kind '{other}'")),
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
    serde_json::from_str::<RawLine>(line)
        .map_err(|e| format!("not a trace operation: {e}"))
        .and_then(RawLine::into_op)
        .map(Some)
        .map_err(|reason| TraceError::Parse {
            line: line_no,
            reason,
        })
}

/// Each step gives the reason a line is refused; [`parse_line`] adds the line number.
impl RawLine {
    /// The operation the line holds.
    fn into_op(mut self) -> std::result::Result<TraceOp, String> {
        let op = std::mem::take(&mut self.op);
        let op = op.as_str();
        let id = || required(self.id, op, "id");
        Ok(match op {
            "header" => TraceOp::Header(self.header()?),
            "map" => TraceOp::Map(self.map(op)?),
            "pool_add" => TraceOp::PoolAdd {
                start: required(self.start, op, "start")?,
                nslabs: required(self.nslabs, op, "nslabs")?,
                nareas: required(self.nareas, op, "nareas")?,
                worker_ts: self.worker_ts.as_ref().and_then(serde_json::Value::as_u64),
            },
            "transient_alloc" => TraceOp::TransientAlloc {
                id: id()?,
                start: if self.failed.unwrap_or(false) {
                    None
                } else {
                    Some(required(self.start, op, "start")?)
                },
                nslabs: required(self.nslabs, op, "nslabs")?,
                nareas: self.nareas.unwrap_or(1),
            },
            "transient_free" => TraceOp::TransientFree {
                id: id()?,
                start: required(self.start, op, "start")?,
                nslabs: required(self.nslabs, op, "nslabs")?,
                search_failed: self.search_failed.unwrap_or(false),
            },
            "unmap" => TraceOp::Unmap {
                id: id()?,
                worker: self.worker.or(self.cpu),
                attrs: self.attrs.map(DmaAttrs::from_linux),
            },
            "sync_for_cpu" | "sync_for_device" => TraceOp::Sync {
                id: id()?,
                for_cpu: op == "sync_for_cpu",
                offset: to_usize(self.offset.unwrap_or(0), "offset")?,
                size: self.size.map(|s| to_usize(s, "size")).transpose()?,
            },
            other => return Err(format!("unknown op '{other}'")),
        })
    }

    /// A `header` line: the geometry and the dynamic-pool settings of the traced kernel.
    fn header(self) -> std::result::Result<TraceHeader, String> {
        Ok(TraceHeader {
            nslabs: self.nslabs,
            nareas: self.nareas,
            start: self.start,
            min_align_mask: self.min_align_mask,
            seg_boundary_mask: self.seg_boundary_mask,
            cpus: self.cpus,
            area_index_at_start: self.area_index_at_start,
            area_used_at_start: self.area_used_at_start,
            version: format_version(self.format.as_deref())?,
            dynamic: self.dynamic.as_ref().map(RawDynamic::header),
            hiwater_at_start: self
                .debugfs_before
                .as_ref()
                .and_then(|d| counter(d.io_tlb_used_hiwater.as_ref())),
            counters_at_end: self.debugfs_after.as_ref().map(RawDebugfs::counters),
        })
    }

    /// A `map` line: the request and, where recorded, what the kernel decided.
    fn map(mut self, op: &str) -> std::result::Result<MapOp, String> {
        let id = required(self.id, op, "id")?;
        let kernel = self.kernel_decision()?;
        Ok(MapOp {
            id,
            orig: required(self.orig, op, "orig")?,
            size: to_usize(required(self.size, op, "size")?, "size")?,
            worker: self.worker.or(self.cpu).unwrap_or(0),
            dir: parse_dir(self.dir.as_ref())?,
            attrs: DmaAttrs::from_linux(self.attrs.unwrap_or(0)),
            min_align_mask: self.min_align_mask,
            alloc_align_mask: self.alloc_align_mask.unwrap_or(0),
            seg_boundary_mask: self.seg_boundary_mask,
            kernel,
            time: self
                .ts
                .as_ref()
                .and_then(serde_json::Value::as_u64)
                .map(|ts| {
                    let ret = self.ret_ts.as_ref().and_then(serde_json::Value::as_u64);
                    (ts, ret.unwrap_or(ts))
                }),
        })
    }

    /// The kernel's own decision on a `map` line (none when the capture did not record one).
    fn kernel_decision(&mut self) -> std::result::Result<Option<KernelDecision>, String> {
        if self.kernel_tlb_addr.is_none() && self.kernel_error.is_none() {
            return Ok(None);
        }
        let pool = match (self.kernel_pool, self.kernel_pool_kind.as_deref()) {
            (Some(start), Some(kind)) => Some((start, pool_kind(kind)?)),
            _ => None,
        };
        Ok(Some(KernelDecision {
            tlb_addr: self.kernel_tlb_addr,
            area_used: self.kernel_area_used.take(),
            area_index: self.kernel_area_index.take(),
            pool,
            grow: self.kernel_grow.unwrap_or(false),
            counters: self.kernel_counters(),
        }))
    }

    /// The kernel's pool counters after a `map`, when all four were recorded.
    fn kernel_counters(&self) -> Option<KernelCounters> {
        Some(KernelCounters {
            nslabs: self.kernel_nslabs?,
            used: self.kernel_used?,
            hiwater: self.kernel_hiwater?,
            transient_nslabs: self.kernel_transient_nslabs?,
        })
    }
}

impl RawDynamic {
    fn header(&self) -> DynamicHeader {
        DynamicHeader {
            default_nareas: self.default_nareas,
            default_nslabs: self.default_nslabs,
            can_grow: match &self.can_grow {
                serde_json::Value::Bool(b) => *b,
                v => v.as_u64().is_some_and(|n| n != 0),
            },
            phys_limit: self.phys_limit.unwrap_or(u64::from(u32::MAX)),
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
            r#"{"op":"header","format":"swiotlb-kernel-trace/9"}"#,
        ] {
            assert!(parse_line(7, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_the_dynamic_format() {
        let h = r#"{"op":"header","format":"swiotlb-kernel-trace/2","nslabs":512,"nareas":4,"debugfs_before":{"io_tlb_used_hiwater":"5","io_tlb_nslabs":512},"debugfs_after":{"io_tlb_used":0,"io_tlb_used_hiwater":"na"},"dynamic":{"default_nareas":4,"default_nslabs":512,"can_grow":1,"phys_limit":4294967295}}"#;
        let Some(TraceOp::Header(h)) = parse_line(1, h).unwrap() else {
            panic!("not a header");
        };
        assert_eq!(h.version, 2);
        assert_eq!(h.hiwater_at_start, Some(5));
        let end = h.counters_at_end.unwrap();
        assert_eq!((end.used, end.hiwater, end.nslabs), (Some(0), None, None));
        let d = h.dynamic.unwrap();
        assert_eq!(
            (d.default_nareas, d.default_nslabs, d.can_grow),
            (4, 512, true)
        );
        let m = r#"{"op":"map","id":9,"orig":1,"size":4096,"cpu":1,"dir":2,"ts":10,"ret_ts":12,"kernel_tlb_addr":8192,"kernel_pool":8192,"kernel_pool_kind":"transient","kernel_grow":true,"kernel_nslabs":512,"kernel_used":2,"kernel_hiwater":5,"kernel_transient_nslabs":2}"#;
        let Some(TraceOp::Map(m)) = parse_line(2, m).unwrap() else {
            panic!("not a map");
        };
        assert_eq!(m.time, Some((10, 12)));
        let k = m.kernel.unwrap();
        assert_eq!((k.pool, k.grow), (Some((8192, PoolKind::Transient)), true));
        assert_eq!(
            k.counters.map(|c| (c.used, c.transient_nslabs)),
            Some((2, 2))
        );
        assert_eq!(
            parse_line(
                3,
                r#"{"op":"pool_add","start":4096,"nslabs":512,"nareas":4,"worker_ts":7}"#
            )
            .unwrap(),
            Some(TraceOp::PoolAdd {
                start: 4096,
                nslabs: 512,
                nareas: 4,
                worker_ts: Some(7)
            })
        );
        assert_eq!(
            parse_line(
                4,
                r#"{"op":"transient_alloc","id":3,"failed":true,"nslabs":2}"#
            )
            .unwrap(),
            Some(TraceOp::TransientAlloc {
                id: 3,
                start: None,
                nslabs: 2,
                nareas: 1
            })
        );
        let free = r#"{"op":"transient_free","id":3,"start":8192,"nslabs":2,"search_failed":true}"#;
        assert!(matches!(
            parse_line(5, free).unwrap(),
            Some(TraceOp::TransientFree {
                search_failed: true,
                ..
            })
        ));
        for bad in [
            r#"{"op":"header","format":"swiotlb-kernel-trace/3"}"#,
            r#"{"op":"header","format":"something-else/1"}"#,
            r#"{"op":"pool_add","start":4096,"nareas":4}"#,
            r#"{"op":"transient_alloc","id":3,"nslabs":2}"#,
            r#"{"op":"map","id":1,"orig":0,"size":1,"dir":1,"kernel_tlb_addr":0,"kernel_pool":0,"kernel_pool_kind":"borrowed"}"#,
        ] {
            assert!(parse_line(6, bad).is_err(), "{bad}");
        }
    }
}
