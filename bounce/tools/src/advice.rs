//! The sizing advisor's output: the table a person reads and the occupancy chart, from a
//! [`bounce::trace::advise::report::Report`] (the rows are computed by the library).

use std::path::Path;

use bounce::trace::advise::linux::SLOT_BYTES;
use bounce::trace::advise::report::{mib, Report, StaticKind};
use bounce::trace::advise::{SizeReport, Timeline, LARGE_MAP_SLOTS};

use crate::chart::{write_chart, Chart, Line, Panel, Series, XScale};
use crate::report::{count, markdown_table};

/// The failure columns of a replay: total, capacity, fragmentation, high-water.
fn failure_cells(r: &SizeReport) -> [String; 4] {
    let f = &r.failures;
    [
        f.pool_full.to_string(),
        f.capacity.to_string(),
        f.fragmentation.to_string(),
        r.hiwater.to_string(),
    ]
}

fn no_cells() -> [String; 4] {
    ["-".into(), "-".into(), "-".into(), "-".into()]
}

/// The headers of the cells [`failure_cells`] gives.
const FAILURE_COLUMNS: [&str; 4] = ["failures", "capacity", "fragmentation", "high-water"];

/// `row` followed by the failure cells of `r`, or dashes when there is no replay.
fn with_failures(mut row: Vec<String>, r: Option<&SizeReport>) -> Vec<String> {
    row.extend(r.map_or_else(no_cells, failure_cells));
    row
}

/// The header `head`, then [`FAILURE_COLUMNS`], then `tail`.
fn failure_header<'a>(head: &[&'a str], tail: &[&'a str]) -> Vec<&'a str> {
    [head, &FAILURE_COLUMNS[..], tail].concat()
}

/// A table of one row per item: the cells `cells` gives (under `head`), then the failure
/// cells of the replay it names (dashes for none).
fn failure_table<T>(
    out: &mut String,
    head: &[&str],
    items: &[T],
    cells: impl Fn(&T) -> (Vec<String>, Option<&SizeReport>),
) {
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|item| {
            let (row, replay) = cells(item);
            with_failures(row, replay)
        })
        .collect();
    out.push_str(&markdown_table(&failure_header(head, &[]), &rows));
}

/// The report as Markdown: a line on the inputs, then one table per section, the
/// recommendation and the notes.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    inputs_section(r, &mut out);
    static_section(r, &mut out);
    areas_section(r, &mut out);
    segment_section(r, &mut out);
    dynamic_section(r, &mut out);
    out.push_str(&format!(
        "\n### Recommendation\n\n`{}`: {}\n",
        r.recommendation.cmdline, r.recommendation.reason
    ));
    if !r.notes.is_empty() {
        out.push('\n');
        for n in &r.notes {
            out.push_str(&format!("- {n}\n"));
        }
    }
    out
}

/// The title and the line on the traces and the guest.
fn inputs_section(r: &Report, out: &mut String) {
    let names: Vec<&str> = r.traces.iter().map(|t| t.name.as_str()).collect();
    out.push_str(&format!("## Sizing `{}`\n\n", names.join("` + `")));
    let maps: u64 = r.traces.iter().map(|t| t.maps).sum();
    let unmaps: u64 = r.traces.iter().map(|t| t.unmaps).sum();
    let kernel_failed: u64 = r.traces.iter().map(|t| t.kernel_failures).sum();
    let live: usize = r.traces.iter().map(|t| t.live_at_end).sum();
    let mem = r
        .guest
        .mem_bytes
        .map_or("memory not given".to_string(), |m| {
            format!("{} of memory", mib(m))
        });
    out.push_str(&format!(
        "{maps} maps ({kernel_failed} failed in the capturing kernel), {unmaps} unmaps, {live} \
         live at the end; allocator `{}`; guest: {} ({}), {mem}, {}.\n",
        r.alloc,
        count(r.guest.cpus, "CPU"),
        r.cpus_from,
        if r.guest.confidential {
            "confidential"
        } else {
            "not confidential"
        }
    ));
    for t in r.traces.iter().filter(|t| t.dynamic) {
        out.push_str(&format!(
            "\n`{}` was captured with dynamic pools: its kernel added {} and made {}.\n",
            t.name,
            count(t.kernel_pools_added as usize, "pool"),
            count(t.kernel_transient_pools as usize, "transient pool"),
        ));
    }
    out.push('\n');
}

/// The static pools and how Linux rounds the minimum.
fn static_section(r: &Report, out: &mut String) {
    out.push_str("### Static pools\n\n");
    let head = ["pool", "swiotlb=", "slots", "areas", "memory"];
    failure_table(out, &head, &r.static_pools, |s| {
        let row = vec![
            s.kind.label().to_string(),
            s.swiotlb.clone().unwrap_or_else(|| "-".into()),
            s.replay.slots.to_string(),
            s.replay.areas.to_string(),
            mib(s.pool_bytes),
        ];
        (row, Some(&s.replay))
    });
    let kind = |k| r.static_pools.iter().find(|s| s.kind == k);
    let (Some(k), Some(m)) = (kind(StaticKind::Kernel), kind(StaticKind::Minimum)) else {
        return;
    };
    out.push_str(&format!(
        "\n`swiotlb=` is rounded by Linux (a multiple of 128 slots, at least 128 per area, then \
         a power of two): `swiotlb={},{}` gives {} slots",
        m.replay.slots, m.replay.areas, r.kernel_of_minimum
    ));
    if r.kernel_of_minimum != k.replay.slots {
        out.push_str(&format!(
            ", which fail (placement changes with the size); {} is the first power of two above \
             that replays clean",
            k.replay.slots
        ));
    }
    out.push_str(".\n");
}

// Begins as static_section does; its own columns and cells, the table is failure_table's.
/// One row per area count.
fn areas_section(r: &Report, out: &mut String) {
    out.push_str("\n### Areas\n\nEach area count with the smallest pool that has no failure, as the kernel rounds it; its memory is the slots and the bookkeeping (24 bytes of `struct io_tlb_slot` per slot, page-aligned, and 16 of `struct io_tlb_area` per area). Failures and high-water: at the trace's pool size.\n\n");
    let head = ["areas", "smallest", "swiotlb=", "pool", "metadata"];
    failure_table(out, &head, &r.areas, |a| {
        let row = vec![
            a.areas.to_string(),
            a.min_slots.to_string(),
            a.swiotlb.clone(),
            mib(a.pool_bytes),
            format!("{} KiB", a.metadata_bytes.div_ceil(1024)),
        ];
        (row, a.at_trace_size.as_ref())
    });
}

/// The segment-size what-if, or why it is left out.
fn segment_section(r: &Report, out: &mut String) {
    out.push_str(
        "\n### Segment size\n\nLinux builds `IO_TLB_SEGSIZE` in: 128 slots (256 KiB), the \
         largest mapping and the unit no mapping crosses; 256 and 512 need a rebuilt kernel.\n\n",
    );
    if r.segments.rows.is_empty() {
        out.push_str(&format!(
            "Not shown: no mapping over {LARGE_MAP_SLOTS} slots ({} KiB) failed in the static \
             pools' replays.\n",
            LARGE_MAP_SLOTS * 2
        ));
        return;
    }
    out.push_str(&format!(
        "Up to {} failures of mappings over {LARGE_MAP_SLOTS} slots in one static pool.\n\n",
        r.segments.large_failures
    ));
    let rows: Vec<Vec<String>> = r
        .segments
        .rows
        .iter()
        .map(|s| {
            let mut row = with_failures(vec![s.segsize.to_string()], s.at_trace_size.as_ref());
            row.push(s.min_slots.to_string());
            row
        })
        .collect();
    let head = failure_header(&["slots per segment"], &["smallest without failure"]);
    out.push_str(&markdown_table(&head, &rows));
}

/// One row per default pool with dynamic pools on.
fn dynamic_section(r: &Report, out: &mut String) {
    let d = &r.dynamic;
    out.push_str(&format!(
        "\n### Dynamic pools (`CONFIG_SWIOTLB_DYNAMIC`)\n\nEach default pool replayed through \
         Linux 6.12's dynamic pools: a map no pool serves gets a transient pool of its own size \
         (freed at its unmap) and queues the growth worker, whose pool (at most 2048 slots) \
         every map after the next {} searches first. Pools come from {} of memory in \
         blocks of a power of two of pages. Peak memory: all pools at once; a failure remains \
         when a transient pool finds no memory (capacity) or no fitting run (fragmentation).\n\n",
        d.worker_lag_maps,
        mib(d.memory_bytes)
    ));
    let rows: Vec<Vec<String>> = d
        .rows
        .iter()
        .map(|row| {
            let x = &row.replay;
            let f = &x.failures;
            vec![
                row.kind.label().to_string(),
                row.swiotlb.clone(),
                mib(row.default_bytes),
                x.transient_pools.to_string(),
                format!(
                    "{} ({})",
                    x.transient_peak_slots,
                    mib(x.transient_peak_slots * SLOT_BYTES)
                ),
                format!("{} ({} slots)", x.pools_added, x.added_slots),
                mib(x.peak_bytes),
                f.pool_full.to_string(),
                f.capacity.to_string(),
                f.fragmentation.to_string(),
                x.hiwater.to_string(),
            ]
        })
        .collect();
    out.push_str(&markdown_table(
        &[
            "default pool",
            "swiotlb=",
            "default",
            "transient pools",
            "transient peak",
            "pools added",
            "peak memory",
            "failures",
            "capacity",
            "fragmentation",
            "high-water",
        ],
        &rows,
    ));
}

/// Draws the occupancy of each replay in `runs` (a short name such as `trace 1024,1`, the
/// pool's slots, its timeline) over the trace, with its failures as crosses, into an SVG at
/// `path`.
///
/// # Errors
/// A message naming the file when it cannot be written.
pub fn occupancy_chart(
    path: &Path,
    title: &str,
    runs: &[(String, usize, Timeline)],
    caption: Vec<String>,
) -> Result<(), String> {
    let mut series = Vec::new();
    for (i, (name, slots, t)) in runs.iter().enumerate() {
        let last = t.occupancy.last().map_or(0, |p| p.0 + t.ops_per_bucket);
        series.push(Series {
            name: format!("{name}: in use"),
            points: t
                .occupancy
                .iter()
                .map(|&(x, y)| (x as f64, y as f64))
                .collect(),
            line: Line::Thin,
            color: 2 * i,
        });
        series.push(Series {
            name: format!("{name}: pool size"),
            points: vec![(0.0, *slots as f64), (last as f64, *slots as f64)],
            line: Line::Thin,
            color: 7 + i,
        });
        if !t.failures.is_empty() {
            series.push(Series {
                name: format!("{name}: {} failed", t.failures.len()),
                points: t
                    .failures
                    .iter()
                    .map(|&(x, used, _)| (x as f64, used as f64))
                    .collect(),
                line: Line::Marks,
                color: if i % 2 == 0 { 3 } else { 1 },
            });
        }
    }
    let chart = Chart {
        title: title.to_string(),
        panels: vec![Panel {
            title: "pool occupancy over the trace".into(),
            x_label: "operation".into(),
            x_scale: XScale::Span,
            y_label: "slots".into(),
            y_unit: String::new(),
            series,
        }],
        caption,
    };
    write_chart(path, &chart)
}
