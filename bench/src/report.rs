//! The results: a table on the terminal, and bench/results/latest.{json,md,svg} (JSON for tools, Markdown and the
//! chart for reading on GitHub). Written by hand: a few lines of formatting spare a serialisation dependency.

use crate::growth::{human, Point};
use crate::machine::Machine;
use crate::Row;
use std::path::Path;

fn value(label: &str, v: f64) -> String {
    if v < 100.0 {
        format!("{label} {v:.2}")
    } else {
        format!("{label} {v:.0}")
    }
}

fn ratio(r: &Row) -> String {
    r.ratio().map_or("n/a".into(), |x| format!("{x:.2}x"))
}

/// A paired row's 90% interval, after its ratio.
fn interval(r: &Row) -> String {
    r.interval.map_or(String::new(), |[low, high]| format!(" (90%: {low:.2}–{high:.2})"))
}

fn verdict(r: &Row) -> &'static str {
    match r.met() {
        Some(true) => "✓",
        Some(false) => "✗",
        None => "",
    }
}

fn wal(r: &Row) -> String {
    r.wal.map_or(String::new(), |[a, b]| format!("WAL {a:.0} / {b:.0} B"))
}

/// The server's CPU per id of A and B, and their ratio (the row's rate ratio's counterpart, inverted: below 1, A
/// costs the server less).
fn cpu(r: &Row) -> String {
    let ratio = |a: f64, b: f64| if b > 0.0 { format!(" ({:.2}x)", a / b) } else { String::new() };
    r.cpu.map_or(String::new(), |[a, b]| format!("{a:.1} / {b:.1} µs{}", ratio(a, b)))
}

fn field<'a>(machine: &'a Machine, name: &str) -> &'a str {
    machine.iter().find(|(k, _)| *k == name).map_or("", |(_, v)| v.as_str())
}

pub fn print(rows: &[Row], machine: &Machine) {
    println!(
        "\npg_dedup {} benchmark — PostgreSQL {}, {} mode, {}\n",
        field(machine, "commit"),
        field(machine, "postgresql"),
        field(machine, "mode"),
        field(machine, "rounds")
    );
    println!("{:<68} {:>30} {:>30} {:>8} {:>7}", "scenario", "A", "B", "A / B", "goal");
    for r in rows {
        println!(
            "{:<68} {:>30} {:>30} {:>8} {:>7} {:1}  {:<9} {}  {}{}",
            r.scenario,
            value(&r.variant_a, r.a),
            value(&r.variant_b, r.b),
            ratio(r),
            r.goal.map_or(String::new(), |g| g.label()),
            verdict(r),
            r.unit,
            wal(r),
            r.cpu.map_or(String::new(), |_| format!("server CPU {}", cpu(r))),
            interval(r)
        );
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_number(x: Option<f64>) -> String {
    x.filter(|x| x.is_finite()).map_or("null".into(), |x| format!("{x:.3}"))
}

fn json_numbers(xs: &[f64]) -> String {
    let xs: Vec<String> = xs.iter().map(|&x| json_number(Some(x))).collect();
    format!("[{}]", xs.join(", "))
}

fn json(rows: &[Row], curve: &[Point], machine: &Machine) -> String {
    let machine: Vec<String> =
        machine.iter().map(|(k, v)| format!("    {}: {}", json_string(k), json_string(v))).collect();
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"scenario\": {}, \"a\": {}, \"a_value\": {}, \"b\": {}, \"b_value\": {}, \"unit\": {}, \"ratio\": {}, \
                 \"goal\": {}, \"goal_met\": {}, \"wal_bytes_per_id\": {}, \"server_cpu_us_per_id\": {}, \
                 \"rounds\": {}, \"interval\": {}}}",
                json_string(&r.scenario),
                json_string(&r.variant_a),
                json_number(Some(r.a)),
                json_string(&r.variant_b),
                json_number(Some(r.b)),
                json_string(r.unit),
                json_number(r.ratio()),
                r.goal.map_or("null".into(), |g| json_string(&g.label())),
                r.met().map_or("null".into(), |m| m.to_string()),
                r.wal.map_or("null".into(), |wal| json_numbers(&wal)),
                r.cpu.map_or("null".into(), |cpu| json_numbers(&cpu)),
                r.rounds.as_ref().map_or("null".into(), |[a, b]| format!("[{}, {}]", json_numbers(a), json_numbers(b))),
                r.interval.map_or("null".into(), |interval| json_numbers(&interval)),
            )
        })
        .collect();
    let curve: Vec<String> = curve
        .iter()
        .map(|p| {
            format!(
                "    {{\"rows\": {}, \"mark_rows_at_start\": {}, \"raw_rows_at_start\": {}, \"mark_tps\": {}, \"raw_tps\": {}}}",
                p.rows,
                p.mark_rows,
                p.raw_rows,
                json_number(Some(p.mark)),
                json_number(Some(p.raw))
            )
        })
        .collect();
    format!(
        "{{\n  \"machine\": {{\n{}\n  }},\n  \"rows\": [\n{}\n  ],\n  \"growth\": [\n{}\n  ]\n}}\n",
        machine.join(",\n"),
        rows.join(",\n"),
        curve.join(",\n")
    )
}

fn markdown(rows: &[Row], curve: &[Point], machine: &Machine) -> String {
    let cell = |s: &str| s.replace('|', "\\|");
    let mut md = String::from("# pg_dedup benchmark results\n\nWritten by `make bench`. Every row compares two variants measured alternately in the same run \
        (A, B, B, A, …; more than two in an order that changes from round to round, each after each other equally often) on one throwaway cluster; figures are medians, and the ratio is what to compare across machines. A paired row runs its two sides only, in short runs back to back, \
        and gives geometric means, so that its ratio is the geometric mean of the pairs' ratios, followed by its 90% interval.\n\n");
    md.push_str("| machine | |\n|---|---|\n");
    for (k, v) in machine {
        md.push_str(&format!("| {k} | {} |\n", cell(v)));
    }
    md.push_str(
        "\n| scenario | A | B | A / B | goal | | unit | WAL per id (A / B) | server CPU per id (A / B) |\n\
         |---|---:|---:|---:|---|---|---|---|---|\n",
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | **{}**{} | {} | {} | {} | {} | {} |\n",
            cell(&r.scenario),
            cell(&value(&r.variant_a, r.a)),
            cell(&value(&r.variant_b, r.b)),
            ratio(r),
            interval(r),
            r.goal.map_or(String::new(), |g| g.label()),
            verdict(r),
            r.unit,
            r.wal.map_or(String::new(), |[a, b]| format!("{a:.0} / {b:.0} B")),
            cpu(r)
        ));
    }
    if !curve.is_empty() {
        md.push_str("\nGrowth (1 client, sync off, single new-id marks; rows when the measurement started):\n\n");
        md.push_str("| inbox size | mark() tx/s | raw insert tx/s | mark / raw |\n|---:|---:|---:|---:|\n");
        for p in curve {
            md.push_str(&format!(
                "| {} ({} / {}) | {:.0} | {:.0} | {:.2}x |\n",
                human(p.rows),
                p.mark_rows,
                p.raw_rows,
                p.mark,
                p.raw,
                p.mark / p.raw
            ));
        }
    }
    md.push_str("\n![A / B ratios and the growth curve](latest.svg)\n");
    md
}

pub fn write(dir: &Path, rows: &[Row], curve: &[Point], machine: &Machine) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("latest.json"), json(rows, curve, machine))?;
    std::fs::write(dir.join("latest.md"), markdown(rows, curve, machine))?;
    let title = format!(
        "pg_dedup, {} mode, {} ({} cores), PostgreSQL {}",
        field(machine, "mode"),
        field(machine, "cpu"),
        field(machine, "cores"),
        field(machine, "postgresql")
    );
    std::fs::write(dir.join("latest.svg"), crate::chart::svg(rows, curve, &title))
}

#[cfg(test)]
mod tests {
    use super::json;
    use crate::Row;

    #[test]
    fn json_gives_each_rounds_rates_and_the_interval_when_the_row_has_them() {
        let with = Row::new("with", ("a", 2.0), ("b", 1.0), "tx/s")
            .rounds(&[1.0, 2.0, 3.0], &[1.5, 1.0, 0.5])
            .wal(1.0, 2.5)
            .interval(1.5, 2.5);
        let without = Row::new("without", ("a", 2.0), ("b", 1.0), "tx/s");
        let out = json(&[with, without], &[], &vec![("cpu", "x".to_owned())]);
        assert!(out.contains("\"wal_bytes_per_id\": [1.000, 2.500], "), "{out}");
        assert!(
            out.contains("\"rounds\": [[1.000, 2.000, 3.000], [1.500, 1.000, 0.500]], \"interval\": [1.500, 2.500]}"),
            "{out}"
        );
        assert!(
            out.contains("\"scenario\": \"without\"") && out.contains("\"rounds\": null, \"interval\": null}"),
            "{out}"
        );
    }
}
