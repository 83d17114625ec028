//! `make bench`: pg_dedup against its baselines, side by side in one run on one throwaway cluster.
//!
//! Every scenario runs its two variants alternately (A, B, A, B, ...) and reports medians and their ratio, so the
//! machine's noise hits both sides alike. Results are printed and written to bench/results/latest.json.
//! BENCH_QUICK=1 runs fewer rounds on smaller inputs.

mod expiry;
mod filter;

use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::time::Instant;

pub struct Scale {
    pub rounds: usize,
    pub preload: i64,
    pub seen_lookups: i64,
    pub marks: i64,
    pub purge_rows: i64,
    pub cycle_rows: i64,
    /// One tick of the steady-rate size scenario (a fifth of the TTL).
    pub cycle_tick_ms: u64,
}

pub struct Row {
    pub scenario: String,
    pub variant_a: String,
    pub a: f64,
    pub variant_b: String,
    pub b: f64,
    pub unit: &'static str,
}

impl Row {
    pub fn new(scenario: &str, (variant_a, a): (&str, f64), (variant_b, b): (&str, f64), unit: &'static str) -> Row {
        Row { scenario: scenario.into(), variant_a: variant_a.into(), a, variant_b: variant_b.into(), b, unit }
    }

    fn ratio(&self) -> f64 {
        self.a / self.b
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

/// Runs `round(variant, round_number)` for variants 0 and 1 alternately; each returns a rate. Medians of both.
pub fn alternate(rounds: usize, mut round: impl FnMut(usize, usize) -> f64) -> [f64; 2] {
    let mut rates = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        for (variant, rate) in rates.iter_mut().enumerate() {
            rate.push(round(variant, r));
        }
    }
    rates.map(median)
}

/// Runs `sql` and returns `work` per second.
pub fn timed(c: &mut Client, sql: &str, work: i64) -> f64 {
    let started = Instant::now();
    c.batch_execute(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    work as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1");
    let scale = if quick {
        Scale { rounds: 3, preload: 50_000, seen_lookups: 50_000, marks: 10_000, purge_rows: 100_000, cycle_rows: 20_000, cycle_tick_ms: 200 }
    } else {
        Scale { rounds: 5, preload: 500_000, seen_lookups: 200_000, marks: 50_000, purge_rows: 500_000, cycle_rows: 100_000, cycle_tick_ms: 400 }
    };
    let cluster = Cluster::start(&[
        "shared_preload_libraries = 'pg_dedup'",
        "dedup.database = 'bench'",
        // The benchmark drives purging itself, batch by batch as the worker would, to time it.
        "dedup.purge = off",
        // When the expiry scenarios switch the worker on, it starts a cycle within a second rather than ten (the
        // figures come from the cycle itself; only the wait for it shrinks).
        "dedup.purge_interval = '1s'",
        // Room for every key the run adds, so no filter rotation competes with a timed scenario.
        "dedup.bloom_capacity = 10000000",
        "shared_buffers = '512MB'",
        "synchronous_commit = off",
        // The harness turns fsync off for speed; a benchmark must pay for its flushes like a real server does.
        "fsync = on",
        "max_wal_size = '4GB'",
        "checkpoint_timeout = '30min'",
    ]);
    let mut c = cluster.fresh_db("bench");
    let mut rows = filter::scenarios(&mut c, &scale);
    rows.extend(expiry::scenarios(&mut c, &scale));

    let version: String = c.query_one("SHOW server_version", &[]).unwrap().get(0);
    println!(
        "\npg_dedup benchmark — PostgreSQL {version}, {} mode, medians of {} alternating rounds\n",
        if quick { "quick" } else { "full" },
        scale.rounds
    );
    println!("{:<50} {:>30} {:>30} {:>8}", "scenario", "A", "B", "A / B");
    let show = |label: &str, value: f64| {
        if value < 100.0 { format!("{label} {value:.2}") } else { format!("{label} {value:.0}") }
    };
    for r in &rows {
        println!(
            "{:<50} {:>30} {:>30} {:>7.2}x  {}",
            r.scenario,
            show(&r.variant_a, r.a),
            show(&r.variant_b, r.b),
            r.ratio(),
            r.unit
        );
    }
    let json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "  {{\"scenario\": \"{}\", \"a\": \"{}\", \"a_value\": {:.3}, \"b\": \"{}\", \"b_value\": {:.3}, \"unit\": \"{}\", \"ratio\": {:.3}}}",
                r.scenario, r.variant_a, r.a, r.variant_b, r.b, r.unit, r.ratio()
            )
        })
        .collect();
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results/latest.json");
    std::fs::write(&out, format!("[\n{}\n]\n", json.join(",\n"))).expect("write results");
    println!("\nwritten to {}", out.display());
    drop(c);
    cluster.destroy();
}
