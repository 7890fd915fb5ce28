//! Learning-curve plots of a run: reads `<run>/metrics.jsonl` and draws one SVG
//! (`<run>/learning_curves.svg`, via plotters) with four panels against the training step:
//! success (train and validation, per env tag), trajectory reward, token entropy, and gradient
//! norm (actor and critic). This module owns the drawing only; metric names come from the trainer.

use crate::train::run::metrics::{read_jsonl, MetricsError};
use crate::train::Scalars;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Errors while plotting; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Reading the metrics failed.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The metric file holds no rows.
    #[error("{path}: no metrics to plot")]
    Empty {
        /// The metric file (`metrics.jsonl`).
        path: PathBuf,
    },
    /// Drawing the SVG failed.
    #[error("{path}: drawing failed: {msg}")]
    Draw {
        /// The SVG being drawn.
        path: PathBuf,
        /// The plotting library's error.
        msg: String,
    },
}

/// One panel: a title and which metric names it shows.
struct Panel {
    title: &'static str,
    wants: fn(&str) -> bool,
}

const PANELS: [Panel; 4] = [
    Panel {
        title: "success",
        wants: |k| (k.starts_with("env/") || k.starts_with("val/")) && k.ends_with("/success"),
    },
    Panel {
        title: "trajectory reward",
        wants: |k| (k.starts_with("env/") || k.starts_with("val/")) && k.ends_with("/reward"),
    },
    Panel {
        title: "token entropy",
        wants: |k| k == "actor/entropy",
    },
    Panel {
        title: "grad norm (pre-clip)",
        wants: |k| k == "actor/grad_norm" || k == "critic/grad_norm",
    },
];

/// The file `plot_run` writes.
pub fn plot_path(run_dir: &Path) -> PathBuf {
    run_dir.join(PLOT_FILE)
}

/// File name of a run's learning-curve plot.
pub const PLOT_FILE: &str = "learning_curves.svg";

/// Draws `<run>/learning_curves.svg` from `<run>/metrics.jsonl`; returns the SVG path.
pub fn plot_run(run_dir: &Path) -> Result<PathBuf, PlotError> {
    let metrics = run_dir.join("metrics.jsonl");
    let rows = read_jsonl(&metrics)?;
    if rows.is_empty() {
        return Err(PlotError::Empty { path: metrics });
    }
    let out = plot_path(run_dir);
    draw(&rows, &out).map_err(|msg| PlotError::Draw {
        path: out.clone(),
        msg,
    })?;
    Ok(out)
}

/// Every series of `rows` whose name `wants` accepts, as (name, points) sorted by name.
fn series(rows: &[(u64, Scalars)], wants: fn(&str) -> bool) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
    for (step, scalars) in rows {
        for (name, &v) in scalars.iter().filter(|(k, _)| wants(k)) {
            if v.is_finite() {
                out.entry(name.clone()).or_default().push((*step as f64, v));
            }
        }
    }
    out.into_iter().collect()
}

fn draw(rows: &[(u64, Scalars)], out: &Path) -> Result<(), String> {
    let root = SVGBackend::new(out, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max_step = rows.iter().map(|(s, _)| *s).max().unwrap_or(1).max(1) as f64;
    for (area, panel) in root.split_evenly((2, 2)).iter().zip(PANELS.iter()) {
        draw_panel(area, panel, &series(rows, panel.wants), max_step)?;
    }
    root.present().map_err(|e| e.to_string())
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    panel: &Panel,
    lines: &[(String, Vec<(f64, f64)>)],
    max_step: f64,
) -> Result<(), String> {
    let values = lines.iter().flat_map(|(_, pts)| pts.iter().map(|p| p.1));
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..max_step, (lo - pad)..(hi + pad))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    if !lines.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::run::metrics::JsonlSink;

    #[test]
    fn plots_every_panel_series_from_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = JsonlSink::open(&dir.path().join("metrics.jsonl")).unwrap();
        for step in 1..=5u64 {
            let s = step as f64;
            let scalars: Scalars = [
                ("env/SimpleFrozenLake/success", s / 5.0),
                ("val/SimpleFrozenLake/success", s / 6.0),
                ("env/SimpleFrozenLake/reward", s),
                ("actor/entropy", 1.0 / s),
                ("actor/grad_norm", 0.5),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect();
            sink.write(step, &scalars).unwrap();
        }
        let svg = std::fs::read_to_string(plot_run(dir.path()).unwrap()).unwrap();
        for name in [
            "val/SimpleFrozenLake/success",
            "env/SimpleFrozenLake/reward",
            "actor/entropy",
            "actor/grad_norm",
        ] {
            assert!(svg.contains(name), "legend lacks {name}");
        }
        assert!(svg.contains("<polyline"), "no line drawn");
    }

    #[test]
    fn empty_metrics_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        let err = plot_run(dir.path()).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl"), "{err}");
    }
}
