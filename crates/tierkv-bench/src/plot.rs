//! Plots (plotters), written as SVG and PNG next to the JSON report (file names prefixed
//! with `<stem>-` when the JSON is not `results.json`, e.g. `paper-throughput-1024.svg`
//! for `paper.json`, so runs sharing a directory keep their own plots):
//! - `throughput-<value size>.{svg,png}`: grouped bars per workload, one bar per engine,
//!   throughput normalised to LevelDB's (the papers' presentation) — or to the first engine
//!   when LevelDB did not run — with each bar's ratio written above it; `limit` is a black
//!   line across its workload's group, not a bar (it would dwarf the others), labelled
//!   with its ratio and clipped to the top edge when above the axis; a capped workload's
//!   bars are hatched-out with a `*`;
//! - `latency-cdf-<workload>-<value size>.{svg,png}`: latency CDFs for `readwhilewriting`.
//!
//! Colours: one per engine, the same in every plot ([`color_of`]), from Paul Tol's
//! colour-blind-safe "muted" qualitative scheme; `limit` is black.
//!
//! Text needs a TrueType font: DejaVu Sans (Debian `fonts-dejavu-core`, installed by
//! `scripts/deps.sh`).

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::Report;
use crate::run::Workload;

const FONT_PATHS: &[&str] =
    &["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"];

fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = FONT_PATHS.iter().find_map(|p| std::fs::read(p).ok()).ok_or_else(|| {
            format!("no TrueType font found (looked for {}); install fonts-dejavu-core", FONT_PATHS.join(", "))
        })?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| "font could not be parsed".to_string())
    })
    .clone()
}

/// Paul Tol's "muted" qualitative scheme: nine colours distinguishable with the common
/// colour-vision deficiencies (<https://personal.sron.nl/~pault/#sec:qualitative>).
pub const PALETTE: [RGBColor; 9] = [
    RGBColor(51, 34, 136),   // indigo
    RGBColor(136, 204, 238), // cyan
    RGBColor(68, 170, 153),  // teal
    RGBColor(17, 119, 51),   // green
    RGBColor(153, 153, 51),  // olive
    RGBColor(204, 102, 119), // rose
    RGBColor(136, 34, 85),   // wine
    RGBColor(221, 204, 119), // sand
    RGBColor(170, 68, 153),  // purple
];

/// Engines with a fixed colour (index into [`PALETTE`]); `limit` is black.
const FIXED: [&str; 8] = ["pmekv", "slmdb", "hpdk", "lightkv", "hoakv", "leveldb", "rocksdb", "native"];

/// The colour of each engine of `engines` (in that order): the named engines keep theirs
/// in every plot, others (variants such as `hpdk/nt`) take the free colours in order of
/// appearance, then repeat them.
pub fn colors(engines: &[String]) -> Vec<RGBColor> {
    let mut spare = (FIXED.len()..PALETTE.len()).cycle();
    engines
        .iter()
        .map(|e| match FIXED.iter().position(|f| f == e) {
            Some(i) => PALETTE[i],
            None if e == "limit" => BLACK,
            None => PALETTE[spare.next().unwrap_or(0)],
        })
        .collect()
}

/// The colour of `engine` among `engines`.
pub fn color_of(engines: &[String], engine: &str) -> RGBColor {
    let c = colors(engines);
    engines.iter().position(|e| e == engine).and_then(|i| c.get(i).copied()).unwrap_or(BLACK)
}

/// The plot file prefix for a JSON report at `out`: empty for `results.json` (the default
/// run), `<stem>-` otherwise.
pub fn prefix_for(out: &Path) -> String {
    match out.file_stem().and_then(|s| s.to_str()) {
        Some("results") | None => String::new(),
        Some(stem) => format!("{stem}-"),
    }
}

/// A bar's ratio as printed above it.
fn ratio_label(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn e<E: std::fmt::Debug>(x: E) -> String {
    format!("{x:?}")
}

/// Write every plot of `r` into `dir`, file names starting with `prefix`; returns the
/// files written.
pub fn write_all(r: &Report, dir: &Path, prefix: &str) -> Result<Vec<PathBuf>, String> {
    register_font()?;
    let mut files = Vec::new();
    let mut sizes: Vec<usize> = r.outcomes.iter().map(|o| o.value_size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for vs in sizes {
        for ext in ["svg", "png"] {
            let path = dir.join(format!("{prefix}throughput-{vs}.{ext}"));
            throughput(r, vs, &path)?;
            files.push(path);
            let path = dir.join(format!("{prefix}latency-cdf-readwhilewriting-{vs}.{ext}"));
            if cdf(r, Workload::Readwhilewriting, vs, &path)? {
                files.push(path);
            }
        }
    }
    Ok(files)
}

fn engines(r: &Report) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for o in &r.outcomes {
        if !v.contains(&o.engine) {
            v.push(o.engine.clone());
        }
    }
    v
}

struct Bars {
    title: String,
    ylabel: String,
    workloads: Vec<String>,
    /// (engine, colour, value per workload)
    series: Vec<(String, RGBColor, Vec<Option<f64>>)>,
    /// `limit`'s value per workload, drawn as a line.
    limit: Option<Vec<Option<f64>>>,
    /// The axis: `ymin..ymax` in the plotted unit (the ratio, or its log10 when `log`).
    ymin: f64,
    ymax: f64,
    /// Values are plotted as log10 (ratios spanning more than [`LOG_SPAN`]).
    log: bool,
}

/// Ratios spanning more than this factor go on a log axis (the papers' regime spans
/// 0.2× to 2,000× LevelDB: on a linear axis the small bars vanish).
const LOG_SPAN: f64 = 50.0;

fn throughput(r: &Report, vs: usize, path: &Path) -> Result<(), String> {
    let engines = engines(r);
    let mut workloads: Vec<Workload> = Vec::new();
    for o in r.outcomes.iter().filter(|o| o.value_size == vs) {
        if !workloads.contains(&o.workload) {
            workloads.push(o.workload);
        }
    }
    let base = if engines.iter().any(|x| x == "leveldb") {
        "leveldb".to_string()
    } else {
        engines.first().cloned().unwrap_or_default()
    };
    let value = |w: Workload, eng: &str| {
        let get = |name: &str| {
            r.outcomes.iter().find(|o| o.workload == w && o.value_size == vs && o.engine == name).map(|o| o.ops_per_sec)
        };
        match (get(eng), get(&base)) {
            (Some(x), Some(b)) if b > 0.0 => Some(x / b),
            _ => None,
        }
    };
    let palette = colors(&engines);
    let series: Vec<(String, RGBColor, Vec<Option<f64>>)> = engines
        .iter()
        .zip(&palette)
        .filter(|(eng, _)| *eng != "limit")
        .map(|(eng, c)| (eng.clone(), *c, workloads.iter().map(|w| value(*w, eng)).collect()))
        .collect();
    let limit: Option<Vec<Option<f64>>> =
        engines.iter().any(|x| x == "limit").then(|| workloads.iter().map(|w| value(*w, "limit")).collect());
    // Over the positive, finite ratios (a workload at 0 ops/s has no bar on a log axis).
    let (lo, hi) = series
        .iter()
        .flat_map(|s| s.2.iter().flatten().copied())
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let log = lo <= hi && hi / lo > LOG_SPAN;
    let (series, limit, ymin, ymax) = if log {
        // Everything (the limit too) fits a log axis from the power of ten below the lowest bar.
        let top = limit.iter().flatten().flatten().copied().filter(|v| v.is_finite()).fold(hi, f64::max);
        let l = |v: &Option<f64>| v.filter(|x| x.is_finite() && *x > 0.0).map(f64::log10);
        let series = series.into_iter().map(|(n, c, v)| (n, c, v.iter().map(l).collect())).collect();
        let limit = limit.map(|v| v.iter().map(l).collect());
        // The axis starts below the lowest bar even when it is a power of ten (the baseline
        // engine's 1.0 included), so every bar has a height.
        (series, limit, (lo.log10() - 0.15).floor(), top.log10() + 0.25)
    } else {
        // The axis fits the bars (and their labels); a higher `limit` is clipped to the top.
        (series, limit, 0.0, hi.max(1.0) * 1.3)
    };
    let capped = |w: Workload| r.outcomes.iter().any(|o| o.workload == w && o.value_size == vs && o.capped);
    let b = Bars {
        title: format!("throughput relative to {base} ({vs} B values)"),
        ylabel: format!("x {base}"),
        workloads: workloads.iter().map(|w| format!("{}{}", w.name(), if capped(*w) { "*" } else { "" })).collect(),
        series,
        limit,
        ymin,
        ymax,
        log,
    };
    let size = (18 * (b.series.len() as u32 + 1) * b.workloads.len().max(1) as u32 + 300, 600);
    if path.extension().is_some_and(|x| x == "svg") {
        draw_bars(SVGBackend::new(path, size).into_drawing_area(), &b)
    } else {
        draw_bars(BitMapBackend::new(path, size).into_drawing_area(), &b)
    }
}

fn draw_bars<DB: DrawingBackend>(root: DrawingArea<DB, plotters::coord::Shift>, b: &Bars) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let n = b.workloads.len().max(1);
    root.fill(&WHITE).map_err(e)?;
    // The legend gets its own column on the right, so it never hides a bar.
    let (w, _) = root.dim_in_pixel();
    let (root, legend) = root.split_horizontally(w.saturating_sub(130));
    let mut chart = ChartBuilder::on(&root)
        .caption(&b.title, ("sans-serif", 22))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n as f64, b.ymin..b.ymax)
        .map_err(e)?;
    let labels = &b.workloads;
    let log = b.log;
    // The plotted unit back to the ratio.
    let ratio = move |y: f64| if log { 10f64.powf(y) } else { y };
    let span = b.ymax - b.ymin;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_labels(if log { ((b.ymax - b.ymin).ceil() as usize + 1).max(2) } else { 10 })
        .y_label_formatter(&|y| if log { ratio_label(ratio(*y)) } else { format!("{y:.1}") })
        .y_desc(if log { format!("{} (log scale)", b.ylabel) } else { b.ylabel.clone() })
        .draw()
        .map_err(e)?;
    let width = 0.8 / b.series.len().max(1) as f64;
    let label_font = ("sans-serif", 11).into_font().transform(FontTransform::Rotate270).color(&BLACK);
    for (ei, (_, color, vals)) in b.series.iter().enumerate() {
        let color = *color;
        let bars: Vec<Rectangle<(f64, f64)>> = vals
            .iter()
            .enumerate()
            .filter_map(|(wi, v)| {
                let x0 = wi as f64 + 0.1 + ei as f64 * width;
                Some(Rectangle::new([(x0, b.ymin), (x0 + width * 0.9, (*v)?)], color.filled()))
            })
            .collect();
        chart.draw_series(bars).map_err(e)?;
        // The ratio above each bar, written upwards.
        let labels: Vec<Text<(f64, f64), String>> = vals
            .iter()
            .enumerate()
            .filter_map(|(wi, v)| {
                let v = (*v)?;
                let x = wi as f64 + 0.1 + ei as f64 * width + width * 0.15;
                Some(Text::new(ratio_label(ratio(v)), (x, v + span * 0.01), label_font.clone()))
            })
            .collect();
        chart.draw_series(labels).map_err(e)?;
    }
    if let Some(limit) = &b.limit {
        let top = b.ymin + span * 0.97;
        let lines: Vec<PathElement<(f64, f64)>> = limit
            .iter()
            .enumerate()
            .filter_map(|(wi, v)| {
                let y = v.as_ref()?.min(top);
                Some(PathElement::new(vec![(wi as f64 + 0.05, y), (wi as f64 + 0.95, y)], BLACK.stroke_width(3)))
            })
            .collect();
        chart.draw_series(lines).map_err(e)?;
        let texts: Vec<Text<(f64, f64), String>> = limit
            .iter()
            .enumerate()
            .filter_map(|(wi, v)| {
                let v = (*v)?;
                let clipped = if v > top { " (off scale)" } else { "" };
                let y = v.min(top) + span * 0.004;
                // Above the line (anchored at the text's bottom).
                let style = ("sans-serif", 11).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Bottom));
                Some(Text::new(format!("limit {}{clipped}", ratio_label(ratio(v))), (wi as f64 + 0.1, y), style))
            })
            .collect();
        chart.draw_series(texts).map_err(e)?;
    }
    let mut entries: Vec<(String, RGBColor, bool)> = b.series.iter().map(|(n, c, _)| (n.clone(), *c, false)).collect();
    if b.limit.is_some() {
        entries.push(("limit".into(), BLACK, true));
    }
    for (i, (name, color, line)) in entries.iter().enumerate() {
        let y = 60 + 22 * i as i32;
        if *line {
            legend.draw(&PathElement::new(vec![(4, y + 6), (20, y + 6)], color.stroke_width(3))).map_err(e)?;
        } else {
            legend.draw(&Rectangle::new([(4, y), (18, y + 12)], color.filled())).map_err(e)?;
        }
        legend.draw(&Text::new(name.clone(), (26, y), ("sans-serif", 14).into_font().color(&BLACK))).map_err(e)?;
    }
    root.present().map_err(e)
}

/// An engine, its colour, and its (ns, percentile) points.
type CdfLine = (String, RGBColor, Vec<(f64, f64)>);

struct Cdf {
    title: String,
    xmax: f64,
    /// (engine, colour, (ns, percentile) points)
    lines: Vec<CdfLine>,
}

/// Returns false when no engine ran `w` at `vs`.
fn cdf(r: &Report, w: Workload, vs: usize, path: &Path) -> Result<bool, String> {
    let runs: Vec<_> =
        r.outcomes.iter().filter(|o| o.workload == w && o.value_size == vs && !o.cdf.is_empty()).collect();
    if runs.is_empty() {
        return Ok(false);
    }
    let xmax = runs.iter().flat_map(|o| o.cdf.iter().map(|p| p.1)).max().unwrap_or(1).max(100) as f64 * 1.5;
    let all = engines(r);
    let c = Cdf {
        title: format!("{} read latency CDF ({vs} B values)", w.name()),
        xmax,
        lines: runs
            .iter()
            .map(|o| {
                let pts = o.cdf.iter().map(|&(q, ns)| ((ns as f64).max(50.0), q * 100.0)).collect();
                (o.engine.clone(), color_of(&all, &o.engine), pts)
            })
            .collect(),
    };
    if path.extension().is_some_and(|x| x == "svg") {
        draw_cdf(SVGBackend::new(path, (800, 480)).into_drawing_area(), &c)?;
    } else {
        draw_cdf(BitMapBackend::new(path, (800, 480)).into_drawing_area(), &c)?;
    }
    Ok(true)
}

fn draw_cdf<DB: DrawingBackend>(root: DrawingArea<DB, plotters::coord::Shift>, c: &Cdf) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&c.title, ("sans-serif", 22))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((50f64..c.xmax).log_scale(), 0.0..100.0)
        .map_err(e)?;
    chart.configure_mesh().x_desc("latency (ns, log scale)").y_desc("percentile").draw().map_err(e)?;
    for (eng, color, pts) in &c.lines {
        let color = *color;
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(e)?
            .label(eng.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_gets_its_own_colour_in_every_plot() {
        let mut all: Vec<String> = ["pmekv", "slmdb", "hpdk", "lightkv", "hoakv", "limit", "leveldb", "rocksdb"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        all.push("hpdk/nt".into());
        let c = colors(&all);
        for i in 0..c.len() {
            for j in 0..i {
                assert_ne!(c[i], c[j], "{} and {} share a colour", all[i], all[j]);
            }
        }
        // Stable: an engine's colour does not depend on which others ran.
        let some: Vec<String> = vec!["rocksdb".into(), "pmekv".into()];
        assert_eq!(color_of(&some, "rocksdb"), color_of(&all, "rocksdb"));
        assert_eq!(color_of(&all, "limit"), BLACK);
        assert_eq!(prefix_for(Path::new("bench-results/results.json")), "");
        assert_eq!(prefix_for(Path::new("bench-results/paper.json")), "paper-");
    }
}
