//! bench/results/latest.svg, drawn by hand (plain SVG text, no plotting dependency): the A / B ratios as
//! horizontal bars on a log scale around 1.0 with the goals marked, and the growth curve.

use crate::growth::{human, Point};
use crate::{Goal, Row};
use std::fmt::Write;

const WIDTH: f64 = 1000.0;
const LABEL_RIGHT: f64 = 540.0;
const PLOT_LEFT: f64 = 550.0;
const PLOT_RIGHT: f64 = 960.0;
const ROW_HEIGHT: f64 = 22.0;
const GREEN: &str = "#2e7d32";
const RED: &str = "#c62828";
const BLUE: &str = "#4a6fa5";
const ORANGE: &str = "#d9822b";

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn text(svg: &mut String, x: f64, y: f64, anchor: &str, extra: &str, s: &str) {
    let _ = writeln!(svg, r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" {extra}>{}</text>"#, escape(s));
}

fn line(svg: &mut String, (x1, y1): (f64, f64), (x2, y2): (f64, f64), style: &str) {
    let _ = writeln!(svg, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#);
}

fn goal_value(goal: Goal) -> Option<f64> {
    match goal {
        Goal::AtLeast(g) | Goal::AtMost(g) => Some(g),
        Goal::Zero | Goal::Within(_) => None,
    }
}

/// The ratio bars, from `top`; returns the y below them.
fn ratios(svg: &mut String, rows: &[Row], top: f64) -> f64 {
    // Log2 scale over whole powers of two covering every ratio, every goal and 1.0 (within 1/64 .. 64).
    let values = rows.iter().filter_map(Row::ratio).chain(rows.iter().filter_map(|r| r.goal.and_then(goal_value)));
    let values: Vec<f64> = values.filter(|v| *v > 0.0).map(|v| v.clamp(1.0 / 64.0, 64.0)).chain([1.0]).collect();
    let lo = values.iter().cloned().fold(f64::MAX, f64::min).log2().floor();
    let hi = values.iter().cloned().fold(f64::MIN, f64::max).log2().ceil().max(lo + 1.0);
    let x = |r: f64| PLOT_LEFT + (r.clamp(1.0 / 64.0, 64.0).log2() - lo) / (hi - lo) * (PLOT_RIGHT - PLOT_LEFT);
    let bottom = top + 20.0 + rows.len() as f64 * ROW_HEIGHT;
    text(svg, 10.0, top, "start", r#"font-weight="bold""#, "A / B (log scale; right of 1.0: A is faster or larger)");
    for p in lo as i32..=hi as i32 {
        let r = 2f64.powi(p);
        let style = if p == 0 { r##"stroke="#222" stroke-width="1.5""## } else { r##"stroke="#ddd""## };
        line(svg, (x(r), top + 10.0), (x(r), bottom), style);
        let label = if r >= 1.0 { format!("{r:.0}×") } else { format!("1/{:.0}×", 1.0 / r) };
        text(svg, x(r), bottom + 14.0, "middle", r##"fill="#555""##, &label);
    }
    for (i, r) in rows.iter().enumerate() {
        let y = top + 20.0 + i as f64 * ROW_HEIGHT;
        let mid = y + ROW_HEIGHT / 2.0;
        text(svg, LABEL_RIGHT, mid + 4.0, "end", "", &r.scenario);
        let color = match r.met() {
            Some(true) => GREEN,
            Some(false) => RED,
            None => BLUE,
        };
        // Text starts right of the bar and of the goal marker, whichever ends later.
        let goal_x = r.goal.and_then(goal_value).map_or(0.0, |g| x(g) + 2.0);
        match r.ratio().filter(|v| *v > 0.0) {
            Some(v) => {
                let (x0, x1) = (x(1.0).min(x(v)), x(1.0).max(x(v)));
                let _ = writeln!(
                    svg,
                    r#"<rect x="{x0:.1}" y="{:.1}" width="{:.1}" height="14" fill="{color}"/>"#,
                    mid - 7.0,
                    (x1 - x0).max(1.0)
                );
                text(svg, x1.max(goal_x) + 4.0, mid + 4.0, "start", r##"fill="#222""##, &format!("{v:.2}"));
            }
            None => {
                let note = format!("n/a: A {:.2}, B {:.2} {}", r.a, r.b, r.unit);
                text(svg, x(1.0) + 4.0, mid + 4.0, "start", &format!(r#"fill="{color}""#), &note);
            }
        }
        if let Some(g) = r.goal.and_then(goal_value) {
            line(svg, (x(g), mid - 10.0), (x(g), mid + 10.0), r##"stroke="#000" stroke-width="2.5""##);
        }
    }
    let legend = bottom + 34.0;
    for (i, (color, what)) in [(GREEN, "goal met"), (RED, "goal missed"), (BLUE, "no goal")].iter().enumerate() {
        let lx = PLOT_LEFT + i as f64 * 110.0;
        let _ = writeln!(svg, r#"<rect x="{lx}" y="{:.1}" width="12" height="12" fill="{color}"/>"#, legend - 10.0);
        text(svg, lx + 16.0, legend, "start", "", what);
    }
    line(
        svg,
        (PLOT_LEFT + 340.0, legend - 12.0),
        (PLOT_LEFT + 340.0, legend + 2.0),
        r##"stroke="#000" stroke-width="2.5""##,
    );
    text(svg, PLOT_LEFT + 346.0, legend, "start", "", "goal");
    legend + 20.0
}

/// Rounds `x` up to 1, 2 or 5 times a power of ten (axis steps).
fn nice(x: f64) -> f64 {
    let p = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|s| *s >= x).unwrap()
}

/// The growth curve, from `top`; returns the y below it.
fn growth(svg: &mut String, curve: &[Point], top: f64) -> f64 {
    let (left, right, plot_top, plot_bottom) = (90.0, PLOT_RIGHT, top + 30.0, top + 250.0);
    text(
        svg,
        10.0,
        top,
        "start",
        r#"font-weight="bold""#,
        "Growth: single new-id marks per second as the table grows (1 client, sync off)",
    );
    let lx = |rows: i64| (rows as f64).log10();
    let (x_lo, x_hi) = (lx(curve[0].rows) - 0.15, lx(curve[curve.len() - 1].rows) + 0.15);
    let x = |rows: i64| left + (lx(rows) - x_lo) / (x_hi - x_lo) * (right - left);
    let step = nice(curve.iter().map(|p| p.mark.max(p.raw)).fold(0.0, f64::max) / 5.0);
    let ticks = (curve.iter().map(|p| p.mark.max(p.raw)).fold(0.0, f64::max) * 1.1 / step).ceil() as i32;
    let y_hi = step * ticks as f64;
    let y = |v: f64| plot_bottom - v / y_hi * (plot_bottom - plot_top);
    for i in 0..=ticks {
        let v = step * i as f64;
        line(svg, (left, y(v)), (right, y(v)), r##"stroke="#ddd""##);
        text(svg, left - 6.0, y(v) + 4.0, "end", r##"fill="#555""##, &format!("{v:.0}"));
    }
    for p in curve {
        text(svg, x(p.rows), plot_bottom + 16.0, "middle", r##"fill="#555""##, &human(p.rows));
    }
    text(svg, (left + right) / 2.0, plot_bottom + 34.0, "middle", "", "live rows in the table (log scale)");
    let y_mid = (plot_top + plot_bottom) / 2.0;
    text(svg, 20.0, y_mid, "middle", &format!(r#"transform="rotate(-90 20 {y_mid:.1})""#), "tx/s");
    for (i, (color, name, pick)) in
        [(BLUE, "mark()", (|p: &Point| p.mark) as fn(&Point) -> f64), (ORANGE, "raw insert", |p: &Point| p.raw)]
            .into_iter()
            .enumerate()
    {
        let points: Vec<String> = curve.iter().map(|p| format!("{:.1},{:.1}", x(p.rows), y(pick(p)))).collect();
        let _ =
            writeln!(svg, r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#, points.join(" "));
        for p in curve {
            let _ = writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"/>"#, x(p.rows), y(pick(p)));
        }
        let ly = plot_top + 4.0 + i as f64 * 18.0;
        line(svg, (right - 140.0, ly), (right - 115.0, ly), &format!(r#"stroke="{color}" stroke-width="2""#));
        text(svg, right - 110.0, ly + 4.0, "start", "", name);
    }
    plot_bottom + 50.0
}

pub fn svg(rows: &[Row], curve: &[Point], title: &str) -> String {
    let mut body = String::new();
    text(&mut body, 10.0, 24.0, "start", r#"font-size="15" font-weight="bold""#, title);
    let mut y = ratios(&mut body, rows, 52.0);
    if !curve.is_empty() {
        y = growth(&mut body, curve, y + 10.0);
    }
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{y:.0}\" viewBox=\"0 0 {WIDTH} {y:.0}\" \
         font-family=\"Helvetica, Arial, sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{body}</svg>\n"
    )
}
