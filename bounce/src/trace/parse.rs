//! One line of a trace, in either format, parsed into a [`TraceOp`].

use serde::Deserialize;

use super::{Result, TraceError};
use crate::types::{Direction, DmaAttrs};

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
    area_index_at_start: Option<Vec<usize>>,
    area_used_at_start: Option<Vec<usize>>,
    format: Option<String>,
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
    let raw: RawLine =
        serde_json::from_str(line).map_err(|e| err(format!("not a trace operation: {e}")))?;
    let need_id = || raw.id.ok_or_else(|| err(format!("{} without id", raw.op)));
    let op = match raw.op.as_str() {
        "header" => {
            if let Some(f) = raw.format.as_deref().filter(|f| *f != KERNEL_TRACE_FORMAT) {
                return Err(err(format!(
                    "trace format '{f}' is not one this build reads ({KERNEL_TRACE_FORMAT})"
                )));
            }
            TraceOp::Header(TraceHeader {
                nslabs: raw.nslabs,
                nareas: raw.nareas,
                start: raw.start,
                min_align_mask: raw.min_align_mask,
                seg_boundary_mask: raw.seg_boundary_mask,
                cpus: raw.cpus,
                area_index_at_start: raw.area_index_at_start,
                area_used_at_start: raw.area_used_at_start,
            })
        }
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
}
