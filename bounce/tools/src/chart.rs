//! SVG line charts made to be read: x ticks only at the measured x values, labelled as
//! integers (job counts, queue pairs, bytes) on an evenly spaced or a log2 axis (or, for
//! thousands of points such as a trace's operations, a few round ticks and thin lines, with
//! events as crosses); SI-prefixed y
//! labels (`450k`, `2.3 GB/s`, `590 ns`) in a label area sized to the widest of them, so the
//! axis title never overlaps them; solid and dashed lines in one colour per allocator (what was
//! measured and a reference, such as a seed's figures, on the same axes); the legend beside
//! each plot, never over the data; and caption lines under the panels saying how the figures
//! were measured.

use std::path::Path;

use std::ops::Range;

use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

/// How the x axis is spaced. Ticks are at the x values of the points, whatever the spacing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XScale {
    /// Equal steps of x are equal distances.
    Linear,
    /// Each doubling of x is the same distance (1, 2, 4, 8 jobs; 64 B to 4 KiB). Needs x > 0;
    /// a panel with any other x falls back to linear.
    Log2,
    /// Equal steps are equal distances, with about six ticks at round values (1, 2 or 5 times
    /// a power of ten) instead of one per point: for thousands of points, such as the
    /// operations of a trace.
    Span,
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Line {
    /// A solid line with filled markers: what was measured.
    Solid,
    /// A dashed line with hollow markers: a reference (a seed's figures, a memcpy).
    Dashed,
    /// A thin line without markers: a quantity over thousands of points.
    Thin,
    /// Crosses only, no line: events (a failure at an operation).
    Marks,
}

/// One line of a panel.
#[derive(Clone, Debug)]
pub struct Series {
    /// The legend entry.
    pub name: String,
    /// (x, y) points, in the order drawn.
    pub points: Vec<(f64, f64)>,
    /// Solid or dashed.
    pub line: Line,
    /// Index into the chart's palette: series with the same index share a colour (an
    /// allocator's measured line and the seed's line for it).
    pub color: usize,
}

/// One plot of a chart.
#[derive(Clone, Debug)]
pub struct Panel {
    /// The plot's title.
    pub title: String,
    /// X axis title.
    pub x_label: String,
    /// X axis spacing.
    pub x_scale: XScale,
    /// Y axis title.
    pub y_label: String,
    /// The unit of the y values, which are in base units: `"B/s"` labels 2.3e9 as `2.3 GB/s`,
    /// `"s"` labels 5.9e-7 as `590 ns`, `""` (counts) labels 450000 as `450k`, and `"x"`
    /// (ratios) labels 1.5 as `1.5x`, without a prefix.
    pub y_unit: String,
    /// The lines.
    pub series: Vec<Series>,
}

// Field list of a chart; alike in shape only to other record structs.
/// A chart: a title, panels one above the other, and caption lines under them.
#[derive(Clone, Debug)]
pub struct Chart {
    /// The title over every panel.
    pub title: String,
    /// The plots, top to bottom.
    pub panels: Vec<Panel>,
    /// Lines under the plots: what the lines are and how they were measured.
    pub caption: Vec<String>,
}

/// Width of a chart in pixels.
const WIDTH: u32 = 960;
/// Height of one panel.
const PANEL_HEIGHT: u32 = 400;
/// Height of the chart's title.
const TITLE_HEIGHT: u32 = 40;
/// Caption font size and line height.
const CAPTION_FONT: u32 = 13;
const CAPTION_LINE: u32 = 19;
/// Tick label font size, and the width of one of its characters as an estimate of text width
/// (sans-serif digits and letters average about 0.55 em).
const LABEL_FONT: u32 = 13;
const LABEL_CHAR_W: f64 = 7.5;
/// Axis title font size.
const DESC_FONT: u32 = 15;

/// Ten well-separated colours (Tableau's), then black and dark grey, as 0xRRGGBB.
const PALETTE: [u32; 12] = [
    0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd, 0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22,
    0x17becf, 0x000000, 0x555555,
];

/// The palette's colour `i` (cycling).
pub fn color(i: usize) -> RGBColor {
    let [_, r, g, b] = PALETTE[i % PALETTE.len()].to_be_bytes();
    RGBColor(r, g, b)
}

/// `x` rounded to three significant digits.
fn round3(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(2 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// `x` with at most three significant digits and no trailing zeros (`2.3`, `125`, `0.05`).
fn sig3(x: f64) -> String {
    let x = round3(x);
    if x == 0.0 {
        return "0".into();
    }
    let decimals = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{x:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `v` (in base units of `unit`) with an SI prefix and three significant digits: `si(450e3,
/// "")` is `450k`, `si(2.3e9, "B/s")` is `2.3 GB/s`, `si(5.9e-7, "s")` is `590 ns`, `si(0.0,
/// u)` is `0`. The unit `"x"` marks a ratio: `si(1.5, "x")` is `1.5x`, never prefixed.
pub fn si(v: f64, unit: &str) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    if unit == "x" {
        return format!("{}x", sig3(v));
    }
    if v == 0.0 {
        return "0".into();
    }
    const PREFIXES: [(f64, &str); 9] = [
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
        (1.0, ""),
        (1e-3, "m"),
        (1e-6, "µ"),
        (1e-9, "n"),
        (1e-12, "p"),
    ];
    // The largest prefix under which the rounded mantissa is at least 1 (so 999.7 is `1k`).
    let (scale, prefix) = PREFIXES
        .iter()
        .copied()
        .find(|&(p, _)| round3(v.abs() / p) >= 1.0)
        .unwrap_or(PREFIXES[PREFIXES.len() - 1]);
    let m = sig3(v / scale);
    if unit.is_empty() {
        format!("{m}{prefix}")
    } else {
        format!("{m} {prefix}{unit}")
    }
}

/// An x value as its tick label: an integer when it is one (they are: jobs, queues, bytes).
fn x_label(x: f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{}", x.round() as i64)
    } else {
        sig3(x)
    }
}

impl Panel {
    /// The spacing actually used: log2 only when every x is positive.
    fn scale(&self) -> XScale {
        let positive = self.points().all(|(x, _)| x > 0.0);
        match self.x_scale {
            XScale::Log2 if positive => XScale::Log2,
            XScale::Span => XScale::Span,
            _ => XScale::Linear,
        }
    }

    fn points(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.series.iter().flat_map(|s| s.points.iter().copied())
    }

    /// Where `x` is drawn on the axis.
    fn place(&self, x: f64) -> f64 {
        match self.scale() {
            XScale::Log2 => x.log2(),
            XScale::Linear | XScale::Span => x,
        }
    }

    /// The x ticks: (position on the axis, label), one per distinct x value, in order.
    pub fn x_ticks(&self) -> Vec<(f64, String)> {
        if self.scale() == XScale::Span {
            return self.span_ticks();
        }
        let mut xs: Vec<f64> = self.points().map(|(x, _)| x).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
        xs.into_iter()
            .map(|x| (self.place(x), x_label(x)))
            .collect()
    }

    /// Round ticks from the smallest to the largest x: the step is the 1, 2 or 5 times a power
    /// of ten that gives at most seven.
    fn span_ticks(&self) -> Vec<(f64, String)> {
        let (lo, hi) = self
            .points()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (x, _)| {
                (a.min(x), b.max(x))
            });
        if !(lo.is_finite() && hi.is_finite()) || hi <= lo {
            return if lo.is_finite() {
                vec![(lo, x_label(lo))]
            } else {
                Vec::new()
            };
        }
        let raw = (hi - lo) / 6.0;
        let pow = 10f64.powi(raw.log10().floor() as i32);
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * pow)
            .find(|&st| (hi - lo) / st <= 7.0)
            .unwrap_or(10.0 * pow);
        let first = (lo / step).ceil() as i64;
        let last = (hi / step).floor() as i64;
        (first..=last)
            .map(|k| {
                let x = k as f64 * step;
                (x, si(x, ""))
            })
            .collect()
    }

    /// The top of the y axis: 10% above the largest value (1 when there is none).
    fn y_top(&self) -> f64 {
        let y1 = self.points().map(|(_, y)| y).fold(0.0f64, f64::max);
        if y1 > 0.0 {
            y1 * 1.1
        } else {
            1.0
        }
    }

    /// The width, in pixels, the y tick labels need: the longest label of a tick anywhere on
    /// the axis (ticks are round fractions of the top), estimated per character.
    pub fn y_label_width(&self) -> u32 {
        let top = self.y_top();
        let longest = (0..=20)
            .map(|k| si(top * f64::from(k) / 20.0, &self.y_unit).chars().count())
            .max()
            .unwrap_or(1);
        (longest as f64 * LABEL_CHAR_W).ceil() as u32
    }

    fn legend_width(&self) -> u32 {
        let longest = self
            .series
            .iter()
            .map(|s| s.name.chars().count())
            .max()
            .unwrap_or(0);
        (longest as f64 * LABEL_CHAR_W) as u32 + 60
    }
}

/// The x axis of a panel: linear over `range` (positions, log2 of x on a log2 axis), with its
/// ticks and their labels exactly at the panel's x values.
struct TickAxis {
    range: Range<f64>,
    ticks: Vec<(f64, String)>,
}

impl Ranged for TickAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        let frac = if span > 0.0 {
            (v - self.range.start) / span
        } else {
            0.5
        };
        limit.0 + (frac * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Bold points only: no light mesh lines between the measured x values.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.iter().map(|t| t.0).collect()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

impl ValueFormatter<f64> for TickAxis {
    fn format_ext(&self, v: &f64) -> String {
        self.ticks
            .iter()
            .find(|(x, _)| (x - v).abs() < 1e-9)
            .map_or_else(String::new, |(_, l)| l.clone())
    }
}

/// Splits `text` into lines of at most `width` characters at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// Draws `chart` into an SVG file at `path`.
///
/// # Errors
/// A message naming the file when it cannot be written or drawing fails.
pub fn write_chart(path: &Path, chart: &Chart) -> Result<(), String> {
    if chart.panels.is_empty() {
        return Ok(());
    }
    // Caption text averages about half an em per character.
    let chars = ((WIDTH - 30) as f64 / (f64::from(CAPTION_FONT) * 0.5)) as usize;
    let caption: Vec<String> = chart.caption.iter().flat_map(|c| wrap(c, chars)).collect();
    let caption_h = if caption.is_empty() {
        0
    } else {
        CAPTION_LINE * caption.len() as u32 + 16
    };
    let height = TITLE_HEIGHT + PANEL_HEIGHT * chart.panels.len() as u32 + caption_h;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    let e = |x: &dyn std::fmt::Display| format!("chart {}: {x}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (body, foot) = root.split_vertically(height - caption_h);
    let body = body
        .titled(&chart.title, ("sans-serif", 20))
        .map_err(|x| e(&x))?;
    // One legend width for every panel, so that their plots line up.
    let legend_w = chart
        .panels
        .iter()
        .map(Panel::legend_width)
        .max()
        .unwrap_or(0);
    for (panel, area) in chart
        .panels
        .iter()
        .zip(body.split_evenly((chart.panels.len(), 1)).iter())
    {
        draw_panel(area, panel, legend_w).map_err(|x| e(&x))?;
    }
    for (i, line) in caption.iter().enumerate() {
        let y = 6 + CAPTION_LINE as i32 * i as i32;
        foot.draw(&Text::new(
            line.as_str(),
            (15, y),
            ("sans-serif", CAPTION_FONT).into_font().color(&BLACK),
        ))
        .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
    legend_w: u32,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (w, _) = area.dim_in_pixel();
    let (plot, legend) = area.split_horizontally(w.saturating_sub(legend_w));
    let ticks = p.x_ticks();
    let (lo, hi) = match (ticks.first(), ticks.last()) {
        (Some(a), Some(b)) => (a.0, b.0),
        _ => (0.0, 1.0),
    };
    // Room on both sides so that no point sits on the frame: 8% of the span, or half a unit
    // (half a doubling on a log2 axis) around a single value.
    let pad = if hi > lo { (hi - lo) * 0.08 } else { 0.5 };
    let unit = p.y_unit.clone();
    let y_fmt = move |v: &f64| si(*v, &unit);
    let mut chart = ChartBuilder::on(&plot)
        .caption(&p.title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(LABEL_FONT + DESC_FONT + 22)
        .y_label_area_size(p.y_label_width() + DESC_FONT + 22)
        .build_cartesian_2d(
            TickAxis {
                range: (lo - pad)..(hi + pad),
                ticks,
            },
            0.0..p.y_top(),
        )?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .y_labels(6)
        .x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .label_style(("sans-serif", LABEL_FONT))
        .axis_desc_style(("sans-serif", DESC_FONT))
        .y_label_formatter(&y_fmt)
        .draw()?;
    for s in &p.series {
        let c = color(s.color);
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (p.place(x), y)).collect();
        match s.line {
            Line::Solid => {
                chart.draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?;
                chart.draw_series(pts.iter().map(|&q| Circle::new(q, 4, c.filled())))?;
            }
            Line::Dashed => {
                chart.draw_series(DashedLineSeries::new(
                    pts.iter().copied(),
                    8,
                    5,
                    c.stroke_width(2),
                ))?;
                chart.draw_series(pts.iter().map(|&q| Circle::new(q, 5, c.stroke_width(2))))?;
            }
            Line::Thin => {
                chart.draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(1)))?;
            }
            Line::Marks => {
                chart.draw_series(pts.iter().map(|&q| Cross::new(q, 4, c.stroke_width(2))))?;
            }
        }
    }
    draw_legend(&legend, p)
}

/// The legend, in its own area right of the plot: a line sample, a marker and the name.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    for (i, s) in p.series.iter().enumerate() {
        let y = 50 + 22 * i as i32;
        let c = color(s.color);
        match s.line {
            Line::Solid => {
                area.draw(&PathElement::new(vec![(6, y), (36, y)], c.stroke_width(2)))?;
                area.draw(&Circle::new((21, y), 4, c.filled()))?;
            }
            Line::Dashed => {
                for x in [6, 18, 30] {
                    area.draw(&PathElement::new(
                        vec![(x, y), (x + 6, y)],
                        c.stroke_width(2),
                    ))?;
                }
                area.draw(&Circle::new((21, y), 5, c.stroke_width(2)))?;
            }
            Line::Thin => {
                area.draw(&PathElement::new(vec![(6, y), (36, y)], c.stroke_width(1)))?;
            }
            Line::Marks => {
                area.draw(&Cross::new((21, y), 4, c.stroke_width(2)))?;
            }
        }
        area.draw(&Text::new(
            s.name.as_str(),
            (44, y - 7),
            ("sans-serif", LABEL_FONT).into_font().color(&BLACK),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn si_prefixes_counts_rates_and_times() {
        assert_eq!(si(450_000.0, ""), "450k");
        assert_eq!(si(2.3e9, "B/s"), "2.3 GB/s");
        assert_eq!(si(5.9e-7, "s"), "590 ns");
        assert_eq!(si(1.25e5, ""), "125k");
        assert_eq!(si(0.0, "B/s"), "0");
        assert_eq!(si(999.0, ""), "999");
        assert_eq!(si(999.7, ""), "1k");
        assert_eq!(si(1e6, "bit/s"), "1 Mbit/s");
        assert_eq!(si(2e5 + 3e-11, ""), "200k");
        assert_eq!(si(-4.5e3, ""), "-4.5k");
        assert_eq!(si(12.0, "frames/s"), "12 frames/s");
    }

    #[test]
    fn si_ratios_have_no_prefix() {
        assert_eq!(si(1.5, "x"), "1.5x");
        assert_eq!(si(2000.0, "x"), "2000x");
        assert_eq!(si(0.25, "x"), "0.25x");
    }

    fn panel(xs: &[f64], scale: XScale) -> Panel {
        Panel {
            title: "t".into(),
            x_label: "jobs".into(),
            x_scale: scale,
            y_label: "IOPS".into(),
            y_unit: String::new(),
            series: vec![Series {
                name: "a".into(),
                points: xs.iter().map(|&x| (x, 1000.0 * x)).collect(),
                line: Line::Solid,
                color: 0,
            }],
        }
    }

    #[test]
    fn job_ticks_are_the_measured_integers() {
        let p = panel(&[1.0, 2.0, 4.0, 8.0], XScale::Log2);
        let t = p.x_ticks();
        let labels: Vec<&str> = t.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(labels, ["1", "2", "4", "8"]);
        // Log2: each doubling is one unit.
        let pos: Vec<f64> = t.iter().map(|(x, _)| *x).collect();
        assert_eq!(pos, [0.0, 1.0, 2.0, 3.0]);
        let lin = panel(&[1.0, 4.0], XScale::Linear).x_ticks();
        assert_eq!(lin, [(1.0, "1".to_string()), (4.0, "4".to_string())]);
    }

    #[test]
    fn span_ticks_are_few_and_round() {
        let mut p = panel(&[0.0, 1.0], XScale::Span);
        p.series[0].points = (0..=617_338).step_by(97).map(|x| (x as f64, 1.0)).collect();
        let t = p.x_ticks();
        let labels: Vec<&str> = t.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(
            labels,
            ["0", "100k", "200k", "300k", "400k", "500k", "600k"]
        );
    }

    #[test]
    fn log2_falls_back_to_linear_for_zero() {
        let p = panel(&[0.0, 2.0], XScale::Log2);
        assert_eq!(p.x_ticks()[0], (0.0, "0".to_string()));
    }

    #[test]
    fn label_area_fits_the_widest_tick() {
        let mut p = panel(&[1.0, 8.0], XScale::Log2);
        p.y_unit = "B/s".into();
        for s in &mut p.series {
            for q in &mut s.points {
                q.1 *= 1e6;
            }
        }
        // Ticks up to 8.8 GB/s: "8.36 GB/s" is the longest kind of label there.
        assert!(p.y_label_width() >= (9.0 * LABEL_CHAR_W) as u32);
    }

    /// Text nodes of an SVG: (text, x, font size, anchor, rotated).
    fn texts(svg: &str) -> Vec<(String, f64, f64, String, bool)> {
        let doc = roxmltree::Document::parse(svg).expect("the chart parses as XML");
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| {
                let num = |a: &str| n.attribute(a).and_then(|v| v.parse().ok()).unwrap_or(0.0);
                (
                    n.text().unwrap_or("").trim().to_string(),
                    num("x"),
                    num("font-size"),
                    n.attribute("text-anchor").unwrap_or("").to_string(),
                    n.attribute("transform").is_some(),
                )
            })
            .collect()
    }

    #[test]
    fn rendered_chart_reads_as_promised() {
        let mut p = panel(&[1.0, 2.0, 4.0, 8.0], XScale::Log2);
        for s in &mut p.series {
            for q in &mut s.points {
                q.1 *= 60.0; // up to 480k IOPS
            }
        }
        p.series.push(Series {
            name: "a, seed".into(),
            points: vec![(1.0, 100e3), (8.0, 300e3)],
            line: Line::Dashed,
            color: 0,
        });
        let path =
            std::env::temp_dir().join(format!("bounce-chart-test-{}.svg", std::process::id()));
        let chart = Chart {
            title: "title".into(),
            panels: vec![p],
            caption: vec!["Measured somewhere.".into()],
        };
        write_chart(&path, &chart).expect("chart written");
        let svg = std::fs::read_to_string(&path).expect("chart read");
        let _ = std::fs::remove_file(&path);
        let t = texts(&svg);
        let all: Vec<&str> = t.iter().map(|x| x.0.as_str()).collect();
        for want in [
            "1",
            "2",
            "4",
            "8",
            "jobs",
            "IOPS",
            "a",
            "a, seed",
            "Measured somewhere.",
        ] {
            assert!(all.contains(&want), "{want} missing from {all:?}");
        }
        // No fractional job count, no unprefixed large figure.
        for x in &all {
            assert!(!x.contains(".0") && !x.contains("00000"), "label {x}");
        }
        // The y tick labels are SI-prefixed, and the y axis title is clear of every one.
        let ticks: Vec<_> = t.iter().filter(|x| x.3 == "end").collect();
        assert!(
            ticks.len() >= 4 && ticks.iter().any(|x| x.0.ends_with('k')),
            "{ticks:?}"
        );
        let title = t
            .iter()
            .find(|x| x.0 == "IOPS" && x.4)
            .expect("a rotated y title");
        for tick in ticks {
            // Left edge of a right-anchored label: at most 0.6 em per character.
            let left = tick.1 - tick.0.chars().count() as f64 * 0.6 * tick.2;
            assert!(title.1 + title.2 < left, "{title:?} overlaps {tick:?}");
        }
    }

    #[test]
    fn wrap_keeps_words_whole() {
        assert_eq!(wrap("aa bb cc", 5), ["aa bb", "cc"]);
        assert_eq!(wrap("abcdefgh", 3), ["abcdefgh"]);
    }
}
