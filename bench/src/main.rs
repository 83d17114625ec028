//! `make bench`: pg_dedup against its baselines, side by side in one run on one throwaway cluster.
//!
//! Every scenario runs its variants alternately (A, B, B, A, A, B, ...; with more than two, in an order that changes
//! from round to round, `round_order`) and reports medians and their ratio, so the machine's noise hits both sides
//! alike. Results are printed and written to bench/results/latest.json, .md (the
//! table, for GitHub) and .svg (the ratios and the growth curve).
//!
//! BENCH_QUICK=1 runs fewer rounds on smaller inputs (about four minutes); BENCH_ONLY=clients,growth runs only the
//! sections named (filter, expiry, clients, attempts, idempotency, ingest, instructions, citus, restart, growth)
//! and writes its results beside the full run's, in bench/results/only/<sections>/ (<sections>-pg18/ on PostgreSQL 18; latest.* stay the full run's); BENCH_VERBOSE=1 prints every client-side run;
//! BENCH_ROUNDS=N sets the number of alternating rounds (full mode 5, quick 3; the restart section takes at most 3).

mod attempts;
mod chart;
mod citus;
mod clients;
mod compare;
mod cpu;
mod expiry;
mod filter;
mod fsync;
mod growth;
mod idempotency;
mod ingest;
mod instructions;
mod machine;
mod pgbench;
mod pin;
mod redis;
mod report;
mod restart;

use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::time::Instant;

pub struct Scale {
    pub rounds: usize,
    pub preload: i64,
    /// Rows of the COPY scenario (ingest).
    pub copy_rows: i64,
    pub seen_lookups: i64,
    pub marks: i64,
    pub purge_rows: i64,
    /// Live marks (over 4 inboxes) the restart-to-ready scenario reloads, and its clients' seconds per run.
    pub restart_marks: i64,
    pub restart_secs: u32,
    /// Marks in the inbox whose expired tenth is purged while clients mark (the steady state).
    pub steady_rows: i64,
    pub cycle_rows: i64,
    /// One tick of the steady-rate size scenario (a fifth of the TTL).
    pub cycle_tick_ms: u64,
    /// Seconds per pgbench (or redis-benchmark) run.
    pub run_secs: u32,
    /// Client counts of the single-mark scenarios, per synchronous_commit setting.
    pub clients_async: Vec<u32>,
    pub clients_sync: Vec<u32>,
    pub clients_duplicates: Vec<u32>,
    /// Shares of duplicate ids (%) the duplicate scenarios run with.
    pub duplicate_shares: Vec<u32>,
    /// Client counts at which mark() is also compared with Redis.
    pub clients_redis: Vec<u32>,
    pub clients_batches: Vec<u32>,
    /// Ids already marked (and in the raw table) that the duplicate scenarios draw from.
    pub duplicate_ids: i64,
    /// Inbox sizes the growth scenario measures at.
    pub growth_steps: Vec<i64>,
    /// Calls per callgrind run (the runs do this many, then twice as many).
    pub callgrind_calls: i64,
    /// Pairs of runs, and seconds per run, of a paired row (`compare::paired`): two sides only, in short runs
    /// back to back, for a ratio whose goal lies closer to it than a run of several sides can resolve. The purge of
    /// a backlog takes the pairs only: each of its runs is one purge.
    pub pairs: usize,
    pub pair_secs: u32,
}

/// What a row's A / B should be (or, for `Zero`, what A should be).
#[derive(Clone, Copy)]
pub enum Goal {
    AtLeast(f64),
    AtMost(f64),
    /// A is 0 where B, measured alternately with it, is known to be 0 (WAL bytes per duplicate: the raw insert
    /// writes none, so what B shows is background WAL, autovacuum's and checkpoints', spread over the run's
    /// transactions). Met when A exceeds B by less than half a byte.
    Zero,
    /// A itself (seconds to ready after a restart) is at most this; B is context.
    Within(f64),
}

impl Goal {
    pub fn label(self) -> String {
        match self {
            Goal::AtLeast(g) => format!("≥ {g:.2}"),
            Goal::AtMost(g) => format!("≤ {g:.2}"),
            Goal::Zero => "A = 0".into(),
            Goal::Within(g) => format!("A ≤ {g}"),
        }
    }
}

pub struct Row {
    pub scenario: String,
    pub variant_a: String,
    pub a: f64,
    pub variant_b: String,
    pub b: f64,
    pub unit: &'static str,
    pub goal: Option<Goal>,
    /// WAL bytes per id of A and B (client-side scenarios).
    pub wal: Option<[f64; 2]>,
    /// The server's CPU microseconds per id of A and B (client-side scenarios).
    pub cpu: Option<[f64; 2]>,
    /// Each round's value of A and of B, in round order (client-side scenarios; A and B are their medians, or
    /// their geometric means in a paired row).
    pub rounds: Option<[Vec<f64>; 2]>,
    /// A paired row's 90% interval of A / B (`compare::paired`).
    pub interval: Option<[f64; 2]>,
}

impl Row {
    pub fn new(scenario: &str, (variant_a, a): (&str, f64), (variant_b, b): (&str, f64), unit: &'static str) -> Row {
        Row {
            scenario: scenario.into(),
            variant_a: variant_a.into(),
            a,
            variant_b: variant_b.into(),
            b,
            unit,
            goal: None,
            wal: None,
            cpu: None,
            rounds: None,
            interval: None,
        }
    }

    pub fn goal(self, goal: Goal) -> Row {
        Row { goal: Some(goal), ..self }
    }

    pub fn wal(self, a: f64, b: f64) -> Row {
        Row { wal: Some([a, b]), ..self }
    }

    pub fn cpu(self, a: f64, b: f64) -> Row {
        Row { cpu: Some([a, b]), ..self }
    }

    pub fn rounds(self, a: &[f64], b: &[f64]) -> Row {
        Row { rounds: Some([a.to_vec(), b.to_vec()]), ..self }
    }

    pub fn interval(self, low: f64, high: f64) -> Row {
        Row { interval: Some([low, high]), ..self }
    }

    /// A / B; none when B is 0, or when the goal is A = 0 (WAL bytes of duplicates: a fraction of a byte of
    /// background records on both sides, whose ratio means nothing).
    pub fn ratio(&self) -> Option<f64> {
        (self.b != 0.0 && !matches!(self.goal, Some(Goal::Zero))).then(|| self.a / self.b)
    }

    /// Whether the goal is met, judged at the precision shown (a ratio printed as 1.00 meets "≤ 1.00"); none
    /// without a goal (or a ratio to judge).
    pub fn met(&self) -> Option<bool> {
        let shown = |ratio: f64| (ratio * 100.0).round() / 100.0;
        match self.goal? {
            Goal::AtLeast(g) => Some(shown(self.ratio()?) >= g),
            Goal::AtMost(g) => Some(shown(self.ratio()?) <= g),
            Goal::Zero => Some(self.a - self.b < 0.5),
            Goal::Within(g) => Some(self.a <= g),
        }
    }
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

/// Runs `round(variant, round_number)` for each of `variants` in turn, `rounds` times over; every sample, per
/// variant, in round order. Each round runs the variants in the order `round_order` gives it.
pub fn alternate_samples<T>(rounds: usize, variants: usize, mut round: impl FnMut(usize, usize) -> T) -> Vec<Vec<T>> {
    let mut samples: Vec<Vec<T>> = (0..variants).map(|_| Vec::new()).collect();
    for r in 0..rounds {
        for variant in round_order(variants, r) {
            samples[variant].push(round(variant, r));
        }
    }
    samples
}

/// The order in which round `round` runs `n` variants: a row of a balanced Latin square (Williams' design), so that
/// over `n` rounds (`2n` when `n` is odd) each variant runs right after each other one equally often. A run leaves
/// work behind it (autovacuum of the rows it inserted, dirty buffers to write, WAL to flush) that lands on the run
/// after it: with one fixed order, a side that always follows a writing side (100% duplicates after 20%) pays for
/// it in every round, and one that always follows a side writing nothing never does. For two variants this is
/// A B, B A, A B, ... The rows are relabelled so that round 0 runs 0, 1, ..., n-1: a variant that uses what an
/// earlier one of its round measured (a window's length) finds it from round 0 on, later from an earlier round.
fn round_order(n: usize, round: usize) -> Vec<usize> {
    // Williams' first row, 0, 1, n-1, 2, n-2, ...; row r adds r to each entry (mod n); for odd n, rows n..2n-1
    // are rows 0..n-1 reversed.
    let first: Vec<usize> = (0..n).map(|i| if i % 2 == 1 { i.div_ceil(2) } else { (n - i / 2) % n }).collect();
    let mut relabel = vec![0; n];
    for (i, &v) in first.iter().enumerate() {
        relabel[v] = i;
    }
    let shift = round % n;
    let mut order: Vec<usize> = first.iter().map(|&v| relabel[(v + shift) % n]).collect();
    if n % 2 == 1 && (round / n) % 2 == 1 {
        order.reverse();
    }
    order
}

/// Runs `round(variant, round_number)` for variants 0 and 1 alternately; each returns a rate. Medians of both.
pub fn alternate(rounds: usize, round: impl FnMut(usize, usize) -> f64) -> [f64; 2] {
    let mut medians = alternate_samples(rounds, 2, round).into_iter().map(median);
    [medians.next().unwrap(), medians.next().unwrap()]
}

/// BENCH_VERBOSE=1: print every client-side run.
pub fn verbose() -> bool {
    std::env::var("BENCH_VERBOSE").is_ok_and(|v| v == "1")
}

/// Runs `sql` and returns `work` per second.
pub fn timed(c: &mut Client, sql: &str, work: i64) -> f64 {
    let started = Instant::now();
    c.batch_execute(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    work as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let started = Instant::now();
    let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1");
    let mut scale = if quick {
        Scale {
            rounds: 3,
            preload: 50_000,
            copy_rows: 200_000,
            seen_lookups: 50_000,
            marks: 10_000,
            purge_rows: 100_000,
            steady_rows: 200_000,
            restart_marks: 1_000_000,
            restart_secs: 8,
            cycle_rows: 20_000,
            cycle_tick_ms: 200,
            run_secs: 1,
            clients_async: vec![1, 8],
            clients_sync: vec![1],
            clients_duplicates: vec![1],
            duplicate_shares: vec![100],
            clients_redis: vec![1],
            clients_batches: vec![1],
            duplicate_ids: 20_000,
            growth_steps: vec![100_000, 1_000_000],
            callgrind_calls: 200,
            pairs: 4,
            pair_secs: 1,
        }
    } else {
        Scale {
            rounds: 5,
            preload: 500_000,
            copy_rows: 1_000_000,
            seen_lookups: 200_000,
            marks: 50_000,
            purge_rows: 500_000,
            steady_rows: 1_000_000,
            restart_marks: 10_000_000,
            restart_secs: 30,
            cycle_rows: 100_000,
            cycle_tick_ms: 400,
            run_secs: 5,
            clients_async: vec![1, 2, 8],
            clients_sync: vec![1, 2, 8],
            clients_duplicates: vec![1, 8],
            duplicate_shares: vec![20, 100],
            clients_redis: vec![1, 8],
            clients_batches: vec![1, 2],
            duplicate_ids: 100_000,
            growth_steps: vec![100_000, 1_000_000, 3_000_000, 10_000_000],
            callgrind_calls: 1000,
            pairs: 40,
            pair_secs: 3,
        }
    };
    // BENCH_ROUNDS=15: more alternating rounds than the mode's, for rows whose ratio moves more between runs than
    // the difference being measured (the machine's description records the number used).
    if let Ok(rounds) = std::env::var("BENCH_ROUNDS") {
        scale.rounds = rounds
            .parse()
            .ok()
            .filter(|&r| r > 0)
            .unwrap_or_else(|| panic!("BENCH_ROUNDS={rounds:?}: a whole number of rounds, 1 or more"));
    }
    // BENCH_ONLY=clients,growth runs only those sections (its results go to results/only/clients+growth/).
    let only = std::env::var("BENCH_ONLY").ok();
    let runs = |section: &str| only.as_deref().is_none_or(|o| o.split(',').any(|s| s.trim() == section));
    let cluster = Cluster::start(&[
        "shared_preload_libraries = 'pg_dedup'",
        "dedup.database = 'bench'",
        // The benchmark drives purging itself, batch by batch as the worker would, to time it.
        "dedup.purge = off",
        // When the expiry scenarios switch the worker on, it starts a cycle within a second rather than ten (the
        // figures come from the cycle itself; only the wait for it shrinks).
        "dedup.purge_interval = '1s'",
        // Room for every key the run adds, so no filter rotation competes with a timed scenario: a full run marks
        // about 44 million ids (the growth scenario's 10 million fill, batches of 1,000 at 200k+ ids/s; the paired
        // rows of new ids about 9 million; the steady-state purge's clients about 4 million, deleted between rounds
        // but not from the filter). 130 MB.
        "dedup.bloom_capacity = 50000000",
        "shared_buffers = '512MB'",
        // attempt() of new ids at pgbench speed: up to ~50k ids per flush interval (1 s) wait in shared memory for
        // the worker, so the store needs that many slots and more (docs/poison-messages.md, "Sizing"). 260 MB.
        "dedup.attempts_max = 1000000",
        "synchronous_commit = off",
        // The harness turns fsync off for speed; here synchronous_commit = on runs must really wait for the disk.
        "fsync = on",
        "max_wal_size = '4GB'",
        "checkpoint_timeout = '30min'",
    ]);
    let commit = machine::commit();
    let mut c = cluster.fresh_db("bench");
    let pgbench = pgbench::Pgbench::new(&cluster, "bench");
    let mut rows = Vec::new();
    let mut curve = Vec::new();
    let mut section = |name: &str, run: &mut dyn FnMut(&mut Client) -> Vec<Row>| {
        if runs(name) {
            let at = Instant::now();
            rows.extend(run(&mut c));
            eprintln!("[bench] {name}: {:.0} s", at.elapsed().as_secs_f64());
        }
    };
    section("filter", &mut |c| filter::scenarios(c, &scale));
    section("expiry", &mut |c| expiry::scenarios(c, &pgbench, &scale));
    section("clients", &mut |c| clients::scenarios(c, &pgbench, cluster.socket_dir(), &scale));
    section("attempts", &mut |c| attempts::scenarios(c, &pgbench, &scale));
    section("idempotency", &mut |c| idempotency::scenarios(c, &pgbench, &scale));
    section("ingest", &mut |c| ingest::scenarios(c, &scale));
    section("instructions", &mut |_| instructions::scenarios(&scale));
    section("citus", &mut |_| citus::scenarios(&scale));
    section("restart", &mut |_| restart::scenarios(&scale));
    section("growth", &mut |c| {
        let (rows, points) = growth::scenarios(c, &pgbench, &scale);
        curve = points;
        rows
    });

    let machine = machine::describe(&mut c, quick, &scale, commit);
    report::print(&rows, &machine);
    let mut dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    if let Some(only) = &only {
        let sections: Vec<&str> = only.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        // On another PostgreSQL than make bench's (15), beside them: only/instructions-pg18/.
        let major = pg_dedup_harness::major(&pg_dedup_harness::pg_config());
        let suffix = if major == 15 { String::new() } else { format!("-pg{major}") };
        dir = dir.join("only").join(sections.join("+") + &suffix);
    }
    report::write(&dir, &rows, &curve, &machine).expect("write results");
    println!("\nwritten to {}/latest.{{json,md,svg}}", dir.display());
    eprintln!("[bench] total: {:.0} s", started.elapsed().as_secs_f64());
    drop(c);
    cluster.destroy();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_follows_every_other_equally_often() {
        for n in 1..=6 {
            let period = if n % 2 == 0 { n } else { 2 * n };
            let mut follows = vec![vec![0; n]; n];
            for round in 0..period {
                let order = round_order(n, round);
                let mut sorted = order.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "round {round} of {n} runs each variant once");
                for pair in order.windows(2) {
                    follows[pair[1]][pair[0]] += 1;
                }
            }
            assert_eq!(round_order(n, 0), (0..n).collect::<Vec<_>>(), "round 0 runs the variants in order");
            let times = if n % 2 == 0 { 1 } else { 2 };
            for (b, row) in follows.iter().enumerate() {
                for (a, &count) in row.iter().enumerate() {
                    assert_eq!(count, if a == b { 0 } else { times }, "{b} after {a}, {n} variants");
                }
            }
        }
    }

    #[test]
    fn samples_come_back_per_variant_in_round_order() {
        let mut calls = Vec::new();
        let samples = alternate_samples(3, 2, |variant, round| {
            calls.push(variant);
            (variant, round)
        });
        assert_eq!(calls, [0, 1, 1, 0, 0, 1]);
        for (variant, runs) in samples.iter().enumerate() {
            assert_eq!(runs, &[(variant, 0), (variant, 1), (variant, 2)]);
        }
    }
}
