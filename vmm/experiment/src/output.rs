//! What a run prints and writes: the Markdown table (one per panel, shaped like the seed's,
//! with the seed's figures and claimed ratios beside ours), `results.json`, and `chart.svg`
//! (the primary metric against jobs/queues/size, one line per allocator, one panel per table,
//! with the seed's own figures in a panel beside ours).

use std::fmt::Write as _;
use std::path::Path;

use bounce_tools::report::{self, Panel};

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

/// The Markdown report.
pub fn table(r: &Results) -> String {
    let mut s = header(r);
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

/// The report's title, seed and the paragraph saying how, where and when it was measured.
fn header(r: &Results) -> String {
    let m = &r.meta;
    let mut s = String::new();
    let _ = writeln!(s, "## {}\n", r.plan.title);
    let _ = writeln!(s, "Seed: {}.\n", r.plan.seed_source);
    let _ = writeln!(
        s,
        "Measured: `{}` at {} level{}, {} of {} interleaved rounds (order rotated each round), {:.1} s per sample; {} ({} CPUs), kernel {}, load average {} -> {}, git {}{}. This machine is shared with other work: compare the ratios (taken in the same rounds), not the absolute figures.{}\n",
        m.argv.join(" "),
        match r.level {
            crate::Level::Host => "host",
            crate::Level::Guest => "guest",
        },
        if r.quick { " (--quick)" } else { "" },
        r.rounds_done,
        r.rounds,
        r.seconds,
        m.cpu_model.as_deref().unwrap_or("unknown CPU"),
        m.cpus,
        m.kernel.as_deref().unwrap_or("?"),
        m.loadavg_start.as_deref().and_then(|l| l.split(' ').next()).unwrap_or("?"),
        m.loadavg_end.as_deref().and_then(|l| l.split(' ').next()).unwrap_or("?"),
        m.git_revision.as_deref().map_or("?", |g| &g[..g.len().min(12)]),
        if m.git_dirty == Some(true) { " (with local changes)" } else { "" },
        if r.interrupted { " **Interrupted by Ctrl-C: what was measured until then.**" } else { "" },
    );
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
            "{panel}, {} {}: no ratio is printed (each row's measured ratio is in results.json): {why}.",
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

/// The chart's panels: ours per table, and the seed's own figures beside them.
pub fn chart_panels(r: &Results) -> Vec<Panel> {
    let mut out = Vec::new();
    for panel in panels(r) {
        let rows: Vec<&CellResult> = r.cells.iter().filter(|c| c.cell.panel == panel).collect();
        let Some(first) = rows.first() else { continue };
        let primary = r.plan.primary_of(&first.cell);
        let mut ours: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        let mut seed: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for c in &rows {
            let x = f64::from(c.cell.x);
            let add = |v: &mut Vec<(String, Vec<(f64, f64)>)>, y: f64| match v
                .iter_mut()
                .find(|(n, _)| *n == c.cell.series)
            {
                Some((_, pts)) => pts.push((x, y)),
                None => v.push((c.cell.series.clone(), vec![(x, y)])),
            };
            if let Some(sm) = c.summary.get(primary.key) {
                add(&mut ours, sm.median);
            }
            if let Some(sv) = c.cell.seed {
                add(&mut seed, sv);
            }
        }
        out.push(Panel {
            title: format!("{panel}: measured here"),
            x_label: r.plan.x_label.into(),
            y_label: primary.label.into(),
            series: ours,
        });
        if !seed.is_empty() {
            out.push(Panel {
                title: format!("{panel}: the seed's figures"),
                x_label: r.plan.x_label.into(),
                y_label: primary.label.into(),
                series: seed,
            });
        }
    }
    out
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
    report::write_chart(
        &dir.join("chart.svg"),
        &format!("{} ({} level)", r.preset_name(), r.level_name()),
        &chart_panels(r),
    )
    .map_err(Error::Output)
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
