//! The train/validation loss curves of a run, drawn to a PNG with an embedded font (no system
//! font libraries needed).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::error::{Result, write_err};
use crate::metrics::Record;

/// A named line of `(step, loss)` points and its colour.
type Series<'a> = (&'a str, &'a Vec<(f64, f64)>, RGBColor);

/// Registers the embedded DejaVu Sans as plotters' "sans-serif" (once).
pub fn register_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Draws training loss (every logged step) and train/val loss at evaluations.
pub fn loss_curves(records: &[Record], title: &str, path: &Path) -> Result<()> {
    register_fonts();
    let err = |e: &dyn std::fmt::Display| write_err(path, e);
    let logs: Vec<(f64, f64)> = records
        .iter()
        .filter(|r| r.kind == "log")
        .map(|r| (r.step as f64, r.train_loss))
        .collect();
    let evals: Vec<&Record> = records.iter().filter(|r| r.kind == "eval").collect();
    let val: Vec<(f64, f64)> = evals
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step as f64, v)))
        .collect();
    let train_eval: Vec<(f64, f64)> = evals
        .iter()
        .map(|r| (r.step as f64, r.train_loss))
        .collect();
    let all = logs.iter().chain(&val).chain(&train_eval);
    let max_step = all.clone().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = all
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let (lo, hi) = if lo.is_finite() {
        (lo * 0.95, hi * 1.05)
    } else {
        (0.0, 1.0)
    };

    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_step, lo..hi)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("cross-entropy loss (nats/token)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    let series: [Series; 3] = [
        ("train (logged)", &logs, RGBColor(160, 190, 230)),
        ("train (eval)", &train_eval, RGBColor(31, 119, 180)),
        ("val (eval)", &val, RGBColor(214, 39, 40)),
    ];
    for (name, points, color) in series {
        if points.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
