//! Plots (plotters), written as SVG and PNG next to the JSON report:
//! - `throughput-<value size>.{svg,png}`: grouped bars per workload, one bar per engine,
//!   throughput normalised to LevelDB's (the papers' presentation) — or to the first engine
//!   when LevelDB did not run;
//! - `latency-cdf-<workload>-<value size>.{svg,png}`: latency CDFs for `readwhilewriting`.
//!
//! Text needs a TrueType font: DejaVu Sans (Debian `fonts-dejavu-core`, installed by
//! `scripts/deps.sh`).

use std::path::{Path, PathBuf};

use plotters::prelude::*;

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

const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

fn e<E: std::fmt::Debug>(x: E) -> String {
    format!("{x:?}")
}

/// Write every plot of `r` into `dir`; returns the files written.
pub fn write_all(r: &Report, dir: &Path) -> Result<Vec<PathBuf>, String> {
    register_font()?;
    let mut files = Vec::new();
    let mut sizes: Vec<usize> = r.outcomes.iter().map(|o| o.value_size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for vs in sizes {
        for ext in ["svg", "png"] {
            let path = dir.join(format!("throughput-{vs}.{ext}"));
            throughput(r, vs, &path)?;
            files.push(path);
            let path = dir.join(format!("latency-cdf-readwhilewriting-{vs}.{ext}"));
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
    workloads: Vec<&'static str>,
    /// (engine, value per workload)
    series: Vec<(String, Vec<Option<f64>>)>,
    ymax: f64,
}

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
    let series: Vec<(String, Vec<Option<f64>>)> =
        engines.iter().map(|eng| (eng.clone(), workloads.iter().map(|w| value(*w, eng)).collect())).collect();
    let ymax = series.iter().flat_map(|s| s.1.iter().flatten().copied()).fold(1.0f64, f64::max) * 1.15;
    let b = Bars {
        title: format!("throughput relative to {base} ({vs} B values)"),
        ylabel: format!("x {base}"),
        workloads: workloads.iter().map(|w| w.name()).collect(),
        series,
        ymax,
    };
    let size = (160 * b.workloads.len().max(1) as u32 + 200, 480);
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
    let mut chart = ChartBuilder::on(&root)
        .caption(&b.title, ("sans-serif", 22))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n as f64, 0.0..b.ymax)
        .map_err(e)?;
    let labels = &b.workloads;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 {
                labels.get(i).map(|s| s.to_string()).unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(&b.ylabel)
        .draw()
        .map_err(e)?;
    let width = 0.8 / b.series.len().max(1) as f64;
    for (ei, (eng, vals)) in b.series.iter().enumerate() {
        let color = COLORS[ei % COLORS.len()];
        let bars: Vec<Rectangle<(f64, f64)>> = vals
            .iter()
            .enumerate()
            .filter_map(|(wi, v)| {
                let x0 = wi as f64 + 0.1 + ei as f64 * width;
                Some(Rectangle::new([(x0, 0.0), (x0 + width * 0.9, (*v)?)], color.filled()))
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(e)?
            .label(eng.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(e)?;
    root.present().map_err(e)
}

struct Cdf {
    title: String,
    xmax: f64,
    /// (engine, (ns, percentile) points)
    lines: Vec<(String, Vec<(f64, f64)>)>,
}

/// Returns false when no engine ran `w` at `vs`.
fn cdf(r: &Report, w: Workload, vs: usize, path: &Path) -> Result<bool, String> {
    let runs: Vec<_> =
        r.outcomes.iter().filter(|o| o.workload == w && o.value_size == vs && !o.cdf.is_empty()).collect();
    if runs.is_empty() {
        return Ok(false);
    }
    let xmax = runs.iter().flat_map(|o| o.cdf.iter().map(|p| p.1)).max().unwrap_or(1).max(100) as f64 * 1.5;
    let c = Cdf {
        title: format!("{} read latency CDF ({vs} B values)", w.name()),
        xmax,
        lines: runs
            .iter()
            .map(|o| (o.engine.clone(), o.cdf.iter().map(|&(q, ns)| ((ns as f64).max(50.0), q * 100.0)).collect()))
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
    for (i, (eng, pts)) in c.lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
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
