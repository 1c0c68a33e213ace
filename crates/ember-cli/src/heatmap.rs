//! Attention maps drawn as heatmaps (PNG or SVG): one panel per head, tokens on both axes,
//! a colour scale, and a title. Fonts are embedded, so no system libraries are needed.

use std::path::Path;

use ember_infer::AttentionMap;
use plotters::coord::Shift;
use plotters::prelude::*;

use ember_train::error::{Result, TrainError};

/// What to draw: the maps, the labels of their rows and columns, a title.
pub struct Heatmaps<'a> {
    /// Panels, drawn in a grid of `columns` per row.
    pub maps: &'a [AttentionMap],
    /// Labels of the query rows (targets).
    pub rows: &'a [String],
    /// Labels of the key columns (sources).
    pub columns: &'a [String],
    /// Panels per grid row.
    pub per_row: usize,
    /// Title of the whole picture.
    pub title: String,
}

/// Makes a token readable as an axis label: whitespace and control characters visible.
pub fn label(token: &str) -> String {
    let shown: String = token
        .chars()
        .map(|c| match c {
            ' ' => '\u{2423}',  // ␣
            '\n' => '\u{21B5}', // ↵
            '\t' => '\u{21E5}', // ⇥
            c if c.is_control() => '\u{FFFD}',
            c => c,
        })
        .collect();
    if shown.chars().count() > 12 {
        shown
            .chars()
            .take(11)
            .chain(std::iter::once('\u{2026}'))
            .collect()
    } else {
        shown
    }
}

/// Viridis, from dark purple (0) to yellow (1), by linear interpolation of a few anchors.
fn viridis(v: f64) -> RGBColor {
    const ANCHORS: [(u8, u8, u8); 6] = [
        (68, 1, 84),
        (65, 68, 135),
        (42, 120, 142),
        (34, 168, 132),
        (122, 209, 81),
        (253, 231, 37),
    ];
    let v = v.clamp(0.0, 1.0) * (ANCHORS.len() - 1) as f64;
    let i = (v.floor() as usize).min(ANCHORS.len() - 2);
    let f = v - i as f64;
    let mix = |a: u8, b: u8| (a as f64 + (b as f64 - a as f64) * f).round() as u8;
    let (a, b) = (ANCHORS[i], ANCHORS[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// Draws to `path`: SVG when it ends in `.svg`, PNG otherwise.
pub fn draw(h: &Heatmaps, path: &Path) -> Result<()> {
    ember_train::plot::register_fonts();
    let cells = h.rows.len().max(h.columns.len()).max(1);
    let panel = (120 + 14 * cells).clamp(220, 900) as u32;
    let per_row = h.per_row.max(1);
    let grid_rows = h.maps.len().div_ceil(per_row).max(1);
    let width = panel * per_row.min(h.maps.len()).max(1) as u32 + 90;
    // Wide enough for the title at 18 px (about 10 px a character).
    let size = (
        width.max(10 * h.title.chars().count() as u32 + 40),
        panel * grid_rows as u32 + 50,
    );
    // The file is made first, for the operating system's own reason where it cannot be (the
    // drawing backends wrap it in their own errors).
    std::fs::File::create(path).map_err(|e| TrainError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let result = if svg {
        render(h, SVGBackend::new(path, size).into_drawing_area())
    } else {
        render(h, BitMapBackend::new(path, size).into_drawing_area())
    };
    result.map_err(|e| TrainError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

type DrawResult = std::result::Result<(), String>;

fn render<DB: DrawingBackend>(h: &Heatmaps, root: DrawingArea<DB, Shift>) -> DrawResult {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let root = root
        .titled(&h.title, ("sans-serif", 18))
        .map_err(|x| e(&x))?;
    let (width, _) = root.dim_in_pixel();
    let (panels, scale) = root.split_horizontally(width - 80);
    let per_row = h.per_row.max(1);
    let grid = panels.split_evenly((
        h.maps.len().div_ceil(per_row).max(1),
        per_row.min(h.maps.len()).max(1),
    ));
    for (map, area) in h.maps.iter().zip(grid.iter()) {
        panel(map, h.rows, h.columns, area).map_err(|x| e(&x))?;
    }
    colour_scale(&scale).map_err(|x| e(&x))?;
    // Writes the file. Without it plotters writes when the area is dropped and loses the
    // error: a picture that could not be written was reported as written.
    root.present().map_err(|x| e(&x))
}

fn panel<DB: DrawingBackend>(
    map: &AttentionMap,
    rows: &[String],
    columns: &[String],
    area: &DrawingArea<DB, Shift>,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (t, s) = (map.weights.len(), map.weights.first().map_or(0, Vec::len));
    let caption = match map.head {
        Some(head) => format!("layer {} head {}", map.layer, head),
        None => format!("layer {} (mean of heads)", map.layer),
    };
    let font = if t.max(s) > 40 { 9 } else { 12 };
    let longest = |labels: &[String]| {
        labels
            .iter()
            .map(|l| label(l).chars().count())
            .max()
            .unwrap_or(1) as u32
    };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(6)
        .x_label_area_size(14 + font * 3 / 4 * longest(columns) + 4)
        .y_label_area_size(14 + font * 3 / 4 * longest(rows))
        .build_cartesian_2d(
            (0..s as i32).into_segmented(),
            (0..t as i32).into_segmented(),
        )?;
    let name =
        |labels: &[String], i: i32| labels.get(i as usize).map(|l| label(l)).unwrap_or_default();
    chart
        .configure_mesh()
        .disable_mesh()
        .x_labels(s)
        .y_labels(t)
        // Rotated labels are centred on their tick; trailing spaces push the text below the
        // axis instead of across it.
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => {
                let text = name(columns, *i);
                let pad = " ".repeat(2 * text.chars().count() + 1);
                format!("{text}{pad}")
            }
            _ => String::new(),
        })
        // Row 0 at the top: plotters counts y upwards.
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => name(rows, t as i32 - 1 - *i),
            _ => String::new(),
        })
        .x_label_style(
            ("sans-serif", font)
                .into_font()
                .transform(FontTransform::Rotate270),
        )
        .y_label_style(("sans-serif", font))
        .draw()?;
    chart.draw_series(map.weights.iter().enumerate().flat_map(|(i, row)| {
        let y = t as i32 - 1 - i as i32;
        row.iter().enumerate().map(move |(j, &w)| {
            let j = j as i32;
            Rectangle::new(
                [
                    (SegmentValue::Exact(j), SegmentValue::Exact(y)),
                    (SegmentValue::Exact(j + 1), SegmentValue::Exact(y + 1)),
                ],
                viridis(w as f64).filled(),
            )
        })
    }))?;
    Ok(())
}

fn colour_scale<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mut chart = ChartBuilder::on(area)
        .margin_top(40)
        .margin_bottom(60)
        .margin_right(10)
        .y_label_area_size(36)
        .build_cartesian_2d(0.0..1.0, 0.0..1.0)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(5)
        .y_label_style(("sans-serif", 12))
        .y_label_formatter(&|v| format!("{v:.2}"))
        .draw()?;
    let steps = 64;
    chart.draw_series((0..steps).map(|k| {
        let (lo, hi) = (k as f64 / steps as f64, (k + 1) as f64 / steps as f64);
        Rectangle::new([(0.0, lo), (1.0, hi)], viridis((lo + hi) / 2.0).filled())
    }))?;
    Ok(())
}
