//! `make bench`: pg_dedup against its baselines, side by side in one run on one throwaway cluster.
//!
//! Every scenario runs its variants alternately (A, B, A, B, ...) and reports medians and their ratio, so the
//! machine's noise hits both sides alike. Results are printed and written to bench/results/latest.json.
//! BENCH_QUICK=1 runs fewer rounds on smaller inputs.

use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::time::Instant;

struct Scale {
    rounds: usize,
    preload: i64,
    seen_lookups: i64,
    marks: i64,
}

struct Row {
    scenario: String,
    variant_a: String,
    a: f64,
    variant_b: String,
    b: f64,
    unit: &'static str,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.a / self.b
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

/// Runs `statement(variant, round)` for both variants alternately; returns medians of `work / seconds`.
fn alternate(
    c: &mut Client,
    rounds: usize,
    work: i64,
    setups: [&str; 2],
    statement: impl Fn(usize, usize) -> String,
) -> [f64; 2] {
    let mut rates = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        for variant in 0..2 {
            c.batch_execute(setups[variant]).unwrap();
            let sql = statement(variant, round);
            let started = Instant::now();
            c.batch_execute(&sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
            rates[variant].push(work as f64 / started.elapsed().as_secs_f64());
        }
    }
    rates.map(median)
}

fn main() {
    let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1");
    let scale = if quick {
        Scale { rounds: 3, preload: 50_000, seen_lookups: 50_000, marks: 10_000 }
    } else {
        Scale { rounds: 5, preload: 500_000, seen_lookups: 200_000, marks: 50_000 }
    };
    let cluster = Cluster::start(&[
        "shared_preload_libraries = 'pg_dedup'",
        "dedup.database = 'bench'",
        "dedup.bloom_capacity = 2000000",
        "shared_buffers = '512MB'",
        "synchronous_commit = off",
        "max_wal_size = '4GB'",
        "checkpoint_timeout = '30min'",
    ]);
    let mut c = cluster.fresh_db("bench");
    c.batch_execute(&format!(
        "SELECT count(*) FROM dedup.mark_many(array(SELECT 'present-' || g FROM generate_series(1, {}) g))",
        scale.preload
    ))
    .unwrap();
    // Wait for the worker to load the default inbox, so the filter answers.
    while !c.query_one("SELECT filter_trusted FROM dedup.stats WHERE inbox = 'default'", &[]).unwrap().get::<_, bool>(0) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    c.batch_execute("VACUUM ANALYZE dedup.inbox_default").unwrap();
    let on_off = ["SET dedup.bloom = on", "SET dedup.bloom = off"];
    let mut rows = Vec::new();

    let [on, off] = alternate(&mut c, scale.rounds, scale.seen_lookups, on_off, |_, round| {
        format!(
            "SELECT count(*) FROM generate_series(1, {}) g WHERE dedup.seen('absent-{round}-' || g)",
            scale.seen_lookups
        )
    });
    rows.push(Row {
        scenario: "seen() of absent ids, server-side loop".into(),
        variant_a: "filter on".into(),
        a: on,
        variant_b: "filter off".into(),
        b: off,
        unit: "lookups/s",
    });

    let [on, off] = alternate(&mut c, scale.rounds, scale.marks, on_off, |variant, round| {
        format!(
            "SELECT count(*) FROM generate_series(1, {}) g WHERE dedup.mark('new-{variant}-{round}-' || g)",
            scale.marks
        )
    });
    rows.push(Row {
        scenario: "mark() of new ids, server-side loop".into(),
        variant_a: "filter on".into(),
        a: on,
        variant_b: "filter off".into(),
        b: off,
        unit: "marks/s",
    });

    let [on, off] = alternate(&mut c, scale.rounds, scale.marks, on_off, |_, _| {
        format!("SELECT count(*) FROM generate_series(1, {}) g WHERE dedup.mark('present-' || g)", scale.marks)
    });
    rows.push(Row {
        scenario: "mark() of duplicates, server-side loop".into(),
        variant_a: "filter on".into(),
        a: on,
        variant_b: "filter off".into(),
        b: off,
        unit: "marks/s",
    });

    let fpr = 0.01;
    let capacity = 1_000_000;
    let bits = pg_dedup_bloom::blocks_for(capacity, fpr) as f64 * 256.0 / capacity as f64;
    let optimum = pg_dedup_bloom::optimal_bits_per_key(fpr);
    rows.push(Row {
        scenario: format!("filter memory at p = {fpr} (per generation)"),
        variant_a: "split-block".into(),
        a: bits,
        variant_b: "optimum 1.44·log2(1/p)".into(),
        b: optimum,
        unit: "bits/key",
    });

    let version: String = c.query_one("SHOW server_version", &[]).unwrap().get(0);
    println!("\npg_dedup benchmark — PostgreSQL {version}, {} mode, medians of {} alternating rounds\n",
        if quick { "quick" } else { "full" }, scale.rounds);
    println!("{:<44} {:>28} {:>28} {:>8}", "scenario", "A", "B", "A / B");
    let show = |label: &str, value: f64| {
        if value < 100.0 { format!("{label} {value:.2}") } else { format!("{label} {value:.0}") }
    };
    for r in &rows {
        println!(
            "{:<44} {:>28} {:>28} {:>7.2}x  {}",
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
