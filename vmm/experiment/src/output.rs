//! What a run prints and writes: the Markdown table (one per panel, shaped like the seed's,
//! with the seed's figures and claimed ratios beside ours), `results.json`, the chart (the
//! primary metric against jobs, queues or bytes, one solid line per allocator and the seed's
//! figures dashed on the same axes, or every line normalised when the two scales are too far
//! apart to compare by eye), and the report file that puts the command, the conditions, the
//! tables and the chart together (`--report`).

use std::fmt::Write as _;
use std::path::Path;

use bounce_tools::chart::{write_chart, Chart, Line, Panel, Series, XScale};
use bounce_tools::report;

use crate::{CellResult, Error, Metric, Result, Results};

fn num(v: f64, decimals: usize) -> String {
    if v.abs() >= 10_000.0 && decimals == 0 {
        // Thousands separated, as the seeds print them.
        let s = format!("{v:.0}");
        let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        format!("{sign}{out}")
    } else {
        format!("{v:.decimals$}")
    }
}

/// The panels in table order.
fn panels(r: &Results) -> Vec<&str> {
    let mut v: Vec<&str> = Vec::new();
    for c in &r.cells {
        if !v.contains(&c.cell.panel.as_str()) {
            v.push(&c.cell.panel);
        }
    }
    v
}

/// The Markdown table as printed: the title, the seed, the conditions, then every panel's table
/// and the notes.
pub fn table(r: &Results) -> String {
    let mut s = format!("## {}\n\n", r.plan.title);
    let _ = writeln!(s, "Seed: {}.\n", r.plan.seed_source);
    let _ = writeln!(s, "{}\n", conditions(r));
    s.push_str(&tables(r));
    s
}

/// The report file (`--report FILE.md`): the command that regenerates it, the question, the
/// seed, the conditions, the tables and notes, how to read them, and the chart.
pub fn report_file(r: &Results, path: &Path) -> String {
    let body = format!(
        "**Question.** {}\n\n**Seed.** {}.\n\n**Conditions.** {}\n\n{}\n**How to read it.** {}\n",
        r.plan.question,
        r.plan.seed_source,
        conditions(r),
        tables(r),
        r.plan.reading,
    );
    report::report_markdown(&r.plan.title, &r.meta, &body, path)
}

/// How, where and when the run was measured, in one paragraph.
fn conditions(r: &Results) -> String {
    format!(
        "Measured at {} level{}{}: {} of {} (the order rotated each round), {} s per sample; {}. The machine may be shared with other work: compare the ratios (taken in the same rounds), not the absolute figures.{}",
        r.level_name(),
        if r.quick { " (--quick)" } else { "" },
        if r.dynamic {
            " with dynamic swiotlb pools (--dynamic on: the rows marked (dynamic))"
        } else {
            ""
        },
        r.rounds_done,
        report::count(r.rounds, "interleaved round"),
        r.seconds,
        r.meta.conditions(),
        if r.interrupted {
            " **Interrupted by Ctrl-C: what was measured until then.**"
        } else {
            ""
        },
    )
}

/// Every panel's table, the footnotes and the plan's notes.
fn tables(r: &Results) -> String {
    let mut s = String::new();
    let mut notes: Vec<String> = Vec::new();
    for panel in panels(r) {
        panel_table(&mut s, r, panel, &mut notes);
    }
    for (i, n) in notes.iter().enumerate() {
        let _ = writeln!(s, "[{}] {n}  ", i + 1);
    }
    if !notes.is_empty() {
        s.push('\n');
    }
    for n in &r.plan.notes {
        let _ = writeln!(s, "- {n}");
    }
    s
}

/// One panel's table: its heading, the column header and one row per cell; footnotes are
/// collected into `notes` (shared by all panels, printed once after the last).
fn panel_table(s: &mut String, r: &Results, panel: &str, notes: &mut Vec<String>) {
    let rows: Vec<&CellResult> = r.cells.iter().filter(|c| c.cell.panel == panel).collect();
    let Some(first) = rows.first() else { return };
    let primary = r.plan.primary_of(&first.cell);
    let others: Vec<Metric> = r
        .plan
        .columns()
        .into_iter()
        .filter(|c| c.key != primary.key && rows.iter().any(|x| x.summary.contains_key(c.key)))
        .collect();
    let _ = writeln!(s, "### {panel}\n");
    let mut head = format!(
        "| {} | allocator | {} median [min-max] |",
        r.plan.x_label, primary.label
    );
    for o in &others {
        let _ = write!(head, " {} |", o.label);
    }
    head.push_str(" seed | seed ratio | our ratio |");
    let _ = writeln!(s, "{head}");
    let cols = 6 + others.len();
    let _ = writeln!(s, "|{}", "---|".repeat(cols));
    for c in rows {
        s.push_str(&row(r, panel, c, &primary, &others, notes));
    }
    s.push('\n');
}

/// One cell's row: its figures, the seed's, both ratios and references to its footnotes.
fn row(
    r: &Results,
    panel: &str,
    c: &CellResult,
    primary: &Metric,
    others: &[Metric],
    notes: &mut Vec<String>,
) -> String {
    let mut line = format!("| {} | {} | ", c.cell.x, c.cell.series);
    match c.summary.get(primary.key) {
        Some(x) => {
            let _ = write!(
                line,
                "{} [{}-{}] |",
                num(x.median, primary.decimals),
                num(x.min, primary.decimals),
                num(x.max, primary.decimals)
            );
        }
        None => line.push_str("— |"),
    }
    for o in others {
        match c.summary.get(o.key) {
            Some(x) => {
                let _ = write!(line, " {} |", num(x.median, o.decimals));
            }
            None => line.push_str(" — |"),
        }
    }
    match c.cell.seed {
        Some(v) => {
            let _ = write!(line, " {} |", num(v, primary.decimals));
        }
        None => line.push_str(" — |"),
    }
    match c.cell.seed_ratio {
        Some(v) => {
            let _ = write!(line, " {v:.2}x |");
        }
        None => line.push_str(" — |"),
    }
    let refs = row_notes(r, panel, c, notes);
    let ratio = match (c.cell.shape_note.is_some(), c.ratio) {
        (true, _) => "n/a".to_string(),
        (false, Some(v)) => format!("{v:.2}x"),
        (false, None) => "—".to_string(),
    };
    let _ = writeln!(
        line,
        " {ratio}{} |",
        if refs.is_empty() {
            String::new()
        } else {
            format!(" {}", refs.join(" "))
        }
    );
    line
}

/// The footnotes a row needs (why it has no ratio, its cell's note, failed samples), added to
/// `notes` unless the same text is already there; returns the row's references (`[k]`).
fn row_notes(r: &Results, panel: &str, c: &CellResult, notes: &mut Vec<String>) -> Vec<String> {
    let mut refs = Vec::new();
    // A footnote shared by rows with the same text is printed once.
    let mut note = |text: String| {
        let k = match notes.iter().position(|n| *n == text) {
            Some(k) => k + 1,
            None => {
                notes.push(text);
                notes.len()
            }
        };
        refs.push(format!("[{k}]"));
    };
    if let Some(why) = &c.cell.shape_note {
        note(format!(
            "{panel}, {} {}: no ratio is printed (the measured one is in the results.json of `--out`): {why}.",
            r.plan.x_label, c.cell.x
        ));
    }
    if let Some(n) = &c.cell.note {
        note(format!("{} {} x={}: {n}.", panel, c.cell.series, c.cell.x));
    }
    if c.samples.is_empty() {
        note(format!(
            "{} {} x={}: no sample: {}",
            panel,
            c.cell.series,
            c.cell.x,
            c.errors
                .first()
                .map_or("interrupted before it ran", String::as_str)
        ));
    } else if !c.errors.is_empty() {
        note(format!(
            "{} {} x={}: {} sample(s) failed: {}",
            panel,
            c.cell.series,
            c.cell.x,
            c.errors.len(),
            c.errors[0]
        ));
    }
    refs
}

/// How one panel's seed figures are set beside ours.
#[derive(Debug, PartialEq)]
enum Scaling {
    /// The figures as measured, on the same axes.
    Same,
    /// Every line divided by its own value at the panel's smallest x.
    ToFirst(f64),
    /// Every line as its ratio to the baseline row at the same x (the seed's: the ratio it
    /// claims against its own baseline).
    ToBaseline,
}

/// Scales further apart than this are normalised: by eye, a line 3x below another is flat.
const MAX_SCALE_GAP: f64 = 3.0;

/// The panel's lines and how to scale them: ours from the medians, the seed's from its figures
/// (in the primary metric's base units).
fn scaling(rows: &[&CellResult], primary: &Metric) -> Scaling {
    let max = |v: &mut dyn Iterator<Item = f64>| v.fold(0.0f64, f64::max);
    let ours = max(&mut rows
        .iter()
        .filter_map(|c| c.summary.get(primary.key).map(|s| s.median)));
    let seed = max(&mut rows.iter().filter_map(|c| c.cell.seed));
    if seed <= 0.0 || ours <= 0.0 {
        return Scaling::Same;
    }
    let gap = (seed / ours).max(ours / seed);
    if gap <= MAX_SCALE_GAP {
        return Scaling::Same;
    }
    let x0 = rows.iter().map(|c| c.cell.x).min().unwrap_or(0);
    let several_x = rows.iter().any(|c| c.cell.x != x0);
    // Normalising to the first x needs every line to have a point there.
    let at_x0 = |has: &dyn Fn(&CellResult) -> bool| {
        rows.iter().filter(|c| has(c)).all(|c| {
            rows.iter()
                .any(|b| b.cell.series == c.cell.series && b.cell.x == x0 && has(b))
        })
    };
    if several_x
        && at_x0(&|c| c.summary.contains_key(primary.key))
        && at_x0(&|c| c.cell.seed.is_some())
    {
        Scaling::ToFirst(f64::from(x0))
    } else {
        Scaling::ToBaseline
    }
}

/// One panel of the chart, and the caption line that says how it is scaled.
fn chart_panel(r: &Results, panel: &str, rows: &[&CellResult]) -> Option<(Panel, String)> {
    let first = rows.first()?;
    let primary = r.plan.primary_of(&first.cell);
    let scaling = scaling(rows, &primary);
    let series = panel_series(rows, &primary, &scaling);
    let (y_label, y_unit, note) = panel_axis(r, panel, rows, &primary, &scaling);
    Some((
        Panel {
            title: panel.to_string(),
            x_label: r.plan.x_label.into(),
            x_scale: XScale::Log2,
            y_label,
            y_unit,
            series,
        },
        note,
    ))
}

/// A panel's lines, scaled: per series, ours solid and the seed's dashed, in one colour.
fn panel_series(rows: &[&CellResult], primary: &Metric, scaling: &Scaling) -> Vec<Series> {
    let mut names: Vec<&str> = Vec::new();
    for c in rows {
        if !names.contains(&c.cell.series.as_str()) {
            names.push(&c.cell.series);
        }
    }
    let ours_at = |c: &CellResult| -> Option<f64> {
        match scaling {
            Scaling::ToBaseline => c.ratio,
            _ => c.summary.get(primary.key).map(|s| s.median * primary.scale),
        }
    };
    let seed_at = |c: &CellResult| -> Option<f64> {
        match scaling {
            Scaling::ToBaseline => c.cell.seed_ratio,
            _ => c.cell.seed.map(|v| v * primary.scale),
        }
    };
    let mut series: Vec<Series> = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let line_of = |f: &dyn Fn(&CellResult) -> Option<f64>| -> Vec<(f64, f64)> {
            rows.iter()
                .filter(|c| c.cell.series == *name)
                .filter_map(|c| f(c).map(|y| (f64::from(c.cell.x), y)))
                .collect()
        };
        for (pts, line, label) in [
            (line_of(&ours_at), Line::Solid, name.to_string()),
            (line_of(&seed_at), Line::Dashed, format!("{name}, seed")),
        ] {
            if !pts.is_empty() {
                series.push(Series {
                    name: label,
                    points: pts,
                    line,
                    color: i,
                });
            }
        }
    }
    if let Scaling::ToFirst(x0) = *scaling {
        for s in &mut series {
            let base = s.points.iter().find(|p| p.0 == x0).map_or(0.0, |p| p.1);
            for p in &mut s.points {
                p.1 = if base > 0.0 { p.1 / base } else { 0.0 };
            }
        }
    }
    series
}

/// A panel's y axis (label and unit) and the caption line that says how it is scaled and
/// where its points do not compare.
fn panel_axis(
    r: &Results,
    panel: &str,
    rows: &[&CellResult],
    primary: &Metric,
    scaling: &Scaling,
) -> (String, String, String) {
    let baseline = rows
        .iter()
        .find(|c| c.cell.baseline)
        .map_or("the baseline", |c| c.cell.series.as_str());
    let x0 = rows.iter().map(|c| c.cell.x).min().unwrap_or(0);
    let (y_label, y_unit, mut note) = match scaling {
        Scaling::Same => (
            primary.quantity.to_string(),
            primary.unit.to_string(),
            String::new(),
        ),
        Scaling::ToFirst(_) => (
            format!("{}, relative to {} {x0}", primary.quantity, r.plan.x_label),
            "x".into(),
            format!(
                "{panel}: the seed's figures and ours differ in scale by more than {MAX_SCALE_GAP}x, so every line is normalised to its own value at {} {x0}.",
                r.plan.x_label
            ),
        ),
        Scaling::ToBaseline => (
            format!("{}, ratio to {baseline}", primary.quantity),
            "x".into(),
            format!(
                "{panel}: the seed's figures and ours differ in scale by more than {MAX_SCALE_GAP}x, so every line is its ratio to {baseline} at the same {} (the seed's: the ratio it claims against its own baseline).",
                r.plan.x_label
            ),
        ),
    };
    if rows
        .iter()
        .any(|c| c.cell.seed.is_some() && c.cell.shape_note.is_some())
    {
        if !note.is_empty() {
            note.push(' ');
        }
        note.push_str(&format!(
            "{panel}: where this machine cannot reproduce the seed's conditions (the rows the table marks n/a, and says why), our points and the seed's do not compare."
        ));
    }
    (y_label, y_unit, note)
}

/// The chart: one panel per table, ours solid and the seed's dashed on the same axes, and a
/// caption with the scaling and the conditions.
pub fn chart(r: &Results) -> Chart {
    let mut panels_out = Vec::new();
    let mut caption = Vec::new();
    for panel in panels(r) {
        let rows: Vec<&CellResult> = r.cells.iter().filter(|c| c.cell.panel == panel).collect();
        if let Some((p, note)) = chart_panel(r, panel, &rows) {
            panels_out.push(p);
            if !note.is_empty() {
                caption.push(note);
            }
        }
    }
    caption.insert(
        0,
        format!(
            "Solid: measured here, the median of {} of {} s per sample at {} level{}{}; dashed: the seed's figures.",
            report::count(r.rounds_done, "interleaved round"),
            r.seconds,
            r.level_name(),
            if r.quick { " (--quick)" } else { "" },
            if r.dynamic { ", dynamic pools" } else { "" },
        ),
    );
    caption.push(format!("Measured {}.", r.meta.conditions()));
    Chart {
        title: r.plan.title.clone(),
        panels: panels_out,
        caption,
    }
}

/// Writes table.md, results.json and chart.svg into `dir`.
///
/// # Errors
/// [`Error::Output`] naming the file.
pub fn write(r: &Results, table_md: &str, dir: &Path) -> Result<()> {
    let json = serde_json::to_string_pretty(r)
        .map_err(|e| Error::Output(format!("cannot serialize the results: {e}")))?;
    report::write_file(dir, "table.md", table_md).map_err(Error::Output)?;
    report::write_file(dir, "results.json", &(json + "\n")).map_err(Error::Output)?;
    write_chart(&dir.join("chart.svg"), &chart(r)).map_err(Error::Output)
}

/// Writes the report file at `path` and its chart next to it (`FILE.svg`).
///
/// # Errors
/// [`Error::Output`] naming the file.
pub fn write_report(r: &Results, path: &Path) -> Result<()> {
    report::write_text(path, &report_file(r, path)).map_err(Error::Output)?;
    write_chart(&report::chart_path(path), &chart(r)).map_err(Error::Output)
}

impl Results {
    /// The preset's command-line name.
    pub fn preset_name(&self) -> &'static str {
        self.preset.name()
    }

    /// "host" or "guest".
    pub fn level_name(&self) -> &'static str {
        match self.level {
            crate::Level::Host => "host",
            crate::Level::Guest => "guest",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cell, Level, Plan, PresetName, Workload};
    use bounce::{AllocatorKind, PoolMode};
    use bounce_tools::report::{Meta, Summary};

    use crate::preset::IOPS;

    fn cell(series: &str, x: u32, ours: f64, seed: Option<f64>, baseline: bool) -> CellResult {
        CellResult {
            cell: Cell {
                seed,
                seed_ratio: seed.map(|s| s / 100.0),
                ..Cell::new(
                    "p",
                    series,
                    x,
                    Workload::MapCost {
                        mode: PoolMode::Swiotlb,
                        alloc: AllocatorKind::Areas,
                        size: 64,
                        dynamic: false,
                    },
                    baseline,
                )
            },
            samples: Vec::new(),
            summary: [("iops".to_string(), Summary::of(&[ours]))].into(),
            ratio: Some(ours / 10.0),
            errors: Vec::new(),
        }
    }

    fn results(cells: Vec<CellResult>) -> Results {
        Results {
            tool: "bouncevm-experiment",
            preset: PresetName::Vduse2021,
            level: Level::Host,
            quick: false,
            dynamic: false,
            meta: Meta::collect(),
            rounds: 3,
            rounds_done: 3,
            seconds: 1.0,
            interrupted: false,
            plan: Plan {
                preset: PresetName::Vduse2021,
                title: "t".into(),
                seed_source: "s".into(),
                question: "q?".into(),
                reading: "r".into(),
                x_label: "jobs",
                primary: IOPS,
                metrics: Vec::new(),
                cells: Vec::new(),
                notes: Vec::new(),
            },
            cells,
        }
    }

    fn scaling_of(cells: &[CellResult]) -> Scaling {
        scaling(&cells.iter().collect::<Vec<_>>(), &IOPS)
    }

    #[test]
    fn seed_within_three_times_ours_shares_the_axes() {
        let c = [
            cell("a", 1, 100.0, Some(200.0), true),
            cell("a", 2, 300.0, Some(290.0), true),
        ];
        assert_eq!(scaling_of(&c), Scaling::Same);
        assert_eq!(
            scaling_of(&[cell("a", 1, 100.0, None, true)]),
            Scaling::Same
        );
    }

    #[test]
    fn far_apart_scales_are_normalised() {
        // Several x, every line has the first: each line over its own first value.
        let c = [
            cell("a", 1, 10.0, Some(1000.0), true),
            cell("a", 4, 30.0, Some(3000.0), true),
        ];
        assert_eq!(scaling_of(&c), Scaling::ToFirst(1.0));
        // One x, or a seed line without the first x: ratios to the baseline row.
        let one = [
            cell("a", 1, 10.0, Some(1000.0), true),
            cell("b", 1, 20.0, Some(900.0), false),
        ];
        assert_eq!(scaling_of(&one), Scaling::ToBaseline);
        let late = [
            cell("a", 1, 10.0, None, true),
            cell("a", 4, 30.0, Some(3000.0), true),
        ];
        assert_eq!(scaling_of(&late), Scaling::ToBaseline);
    }

    #[test]
    fn a_normalised_panel_starts_every_line_at_one_and_pairs_colours() {
        let r = results(vec![
            cell("a", 1, 10.0, Some(1000.0), true),
            cell("a", 4, 30.0, Some(3000.0), true),
            cell("b", 1, 20.0, Some(2000.0), false),
            cell("b", 4, 20.0, Some(8000.0), false),
        ]);
        let rows: Vec<&CellResult> = r.cells.iter().collect();
        let (p, note) = chart_panel(&r, "p", &rows).expect("a panel");
        assert_eq!(p.y_unit, "x");
        assert!(
            note.contains("normalised to its own value at jobs 1"),
            "{note}"
        );
        let names: Vec<(&str, Line, usize)> = p
            .series
            .iter()
            .map(|s| (s.name.as_str(), s.line, s.color))
            .collect();
        assert_eq!(
            names,
            [
                ("a", Line::Solid, 0),
                ("a, seed", Line::Dashed, 0),
                ("b", Line::Solid, 1),
                ("b, seed", Line::Dashed, 1)
            ]
        );
        for s in &p.series {
            assert_eq!(s.points[0], (1.0, 1.0), "{s:?}");
        }
        assert_eq!(p.series[3].points[1], (4.0, 4.0));
    }

    #[test]
    fn same_axes_keep_base_units_and_the_report_has_its_parts() {
        let r = results(vec![cell("a", 1, 100.0, Some(120.0), true)]);
        let c = chart(&r);
        assert_eq!(c.panels[0].series[1].points, [(1.0, 120.0)]);
        assert!(
            c.caption[0].starts_with("Solid: measured here, the median of 3 interleaved rounds")
        );
        assert!(c.caption.last().is_some_and(|l| l.starts_with("Measured ")));
        let md = report_file(&r, Path::new("docs/experiments/x.md"));
        for part in [
            "# t\n\nGenerated by `target/release/",
            "**Question.** q?",
            "**Seed.** s.",
            "**Conditions.** Measured at host level",
            "| jobs | allocator | IOPS median [min-max] |",
            "**How to read it.** r",
            "![t](x.svg)",
        ] {
            assert!(md.contains(part), "{part} missing from\n{md}");
        }
    }
}
