//! Expiry: pg_dedup's purge batches against a hand-written ctid-batched DELETE on the same data, the cost of
//! the `expires_at` btree on mark(), foreground marks while a backlog is purged, and table size over TTL cycles.

use crate::clients::{mark_sql, one_id_script};
use crate::compare::paired_ratio;
use crate::pgbench::{epoch_now, percentile, span, Pgbench};
use crate::{alternate, alternate_samples, median, timed, verbose, Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;
use std::time::{Duration, Instant};

/// The worker against the hand-written batched DELETE, on a backlog and in the steady state (issue 23's goals: 1.2×,
/// and no less than the 1.19× the steady state had when it was filed).
const BACKLOG_GOAL: Goal = Goal::AtLeast(1.2);
const STEADY_GOAL: Goal = Goal::AtLeast(1.19);
/// Foreground mark() p99 while the worker purges, against idle.
const P99_GOAL: Goal = Goal::AtMost(1.3);
/// Rows per transaction of the hand-written DELETE, and of the worker when their rates are compared (the worker's
/// default batch is compared too: `default_batch`).
const BATCH_ROWS: u32 = 10_000;
/// Clients marking while the steady state is purged.
const MARKERS: u32 = 4;

/// The hand-written baseline: the batched DELETE teams write, one transaction per batch like the worker's, run on
/// the same data (the same table, loaded the same way), so only the purge code differs. Ordered by expires_at, as
/// the worker's batch is: without the order, the planner chose a sequential scan on the steady-state inbox (a
/// tenth expired) and the baseline purged at ~90k rows/s, a figure that flattered the worker six-fold.
fn raw_purge(table: &str, batch: u32) -> String {
    format!(
        "DO $$ DECLARE n bigint; BEGIN LOOP
          DELETE FROM {table} WHERE ctid = ANY (ARRAY(
              SELECT ctid FROM {table} WHERE expires_at <= now() ORDER BY expires_at LIMIT {batch}));
          GET DIAGNOSTICS n = ROW_COUNT; COMMIT; EXIT WHEN n < {batch}; END LOOP; END $$"
    )
}

/// How the worker purges.
#[derive(Clone, Copy)]
enum Pace {
    /// As fast as it can, in batches of this many rows (the hand-written DELETE's): the rates compared.
    Full(u32),
    /// At its defaults (`dedup.purge_batch_size`, `dedup.purge_batch_delay`): the pace whose cost to the clients is
    /// measured.
    Default,
    /// At the default pause, in the DELETE's batches (the default before 0.4.0): what the smaller default buys.
    LargeBatches,
}

/// Sets the server's `dedup.` settings (`None`: back to the configuration file's), then reloads. One statement per
/// call: ALTER SYSTEM refuses to run in the implicit transaction of a multi-statement string.
fn set_system(c: &mut Client, settings: &[(&str, Option<String>)]) {
    for (name, value) in settings {
        let sql = match value {
            Some(value) => format!("ALTER SYSTEM SET dedup.{name} = {value}"),
            None => format!("ALTER SYSTEM RESET dedup.{name}"),
        };
        c.batch_execute(&sql).unwrap();
    }
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
}

/// Switches the background worker's purging on or off (the benchmark's cluster starts with it off), at `pace`.
fn set_worker_purge(c: &mut Client, on: bool, pace: Pace) {
    let (batch_size, batch_delay) = match pace {
        Pace::Full(batch) => (Some(batch.to_string()), Some("0".to_owned())),
        Pace::Default => (None, None),
        Pace::LargeBatches => (Some(BATCH_ROWS.to_string()), None),
    };
    set_system(
        c,
        &[("purge", Some(on.to_string())), ("purge_batch_size", batch_size), ("purge_batch_delay", batch_delay)],
    );
}

/// The worker's default batch (`dedup.purge_batch_size` as the extension defines it).
fn default_batch(c: &mut Client) -> u32 {
    let rows: i32 =
        c.query_one("SELECT boot_val::int FROM pg_settings WHERE name = 'dedup.purge_batch_size'", &[]).unwrap().get(0);
    rows as u32
}

fn expired_left(c: &mut Client, table: &str) -> i64 {
    c.query_one(&format!("SELECT count(*) FROM {table} WHERE expires_at <= now()"), &[]).unwrap().get(0)
}

/// What the worker's cycle that purged a backlog did.
struct Cycle {
    /// Rows per second over the whole cycle (every inbox of the database, from the cycle's start to its end).
    rate: f64,
    /// When it started and ended, in seconds since the Unix epoch.
    window: (f64, f64),
}

/// Lets the worker purge a backlog of `rows` expired rows at `pace`; what the cycle that did it did, or None when
/// that cycle's record was overwritten before it was read. Watches only the worker's own record (a cheap read of
/// shared memory, every 100 ms): polling the table would load the machine on one side of the comparison only. A
/// cycle that lasts longer than `dedup.purge_interval` (1 s for the backlog; 5 s in the steady state, longer than
/// any of its cycles) is followed at once by the next, which finds nothing and may end within the same 100 ms: the
/// record is then that second cycle's.
fn worker_purge(c: &mut Client, rows: i64, pace: Pace) -> Option<Cycle> {
    let last_cycle = |c: &mut Client| {
        let row = c
            .query_one(
                "SELECT coalesce(purge_cycles, 0), last_purge_ms, last_purge_rows,
                        extract(epoch FROM last_purge_start)::float8
                   FROM dedup.worker_stats()",
                &[],
            )
            .unwrap();
        let figures: (i64, Option<f64>, Option<i64>, Option<f64>) = (row.get(0), row.get(1), row.get(2), row.get(3));
        figures
    };
    let before = last_cycle(c).0;
    set_worker_purge(c, true, pace);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        // Purging was off, so the first cycle after it went on is the one that met the whole backlog.
        if let (cycles, Some(ms), Some(purged), Some(start)) = last_cycle(c) {
            if cycles > before {
                set_worker_purge(c, false, Pace::Default);
                if cycles > before + 1 && purged < rows {
                    return None;
                }
                assert!(purged >= rows, "the worker's cycle purged {purged} rows of a backlog of {rows}");
                return Some(Cycle { rate: purged as f64 / (ms / 1000.0), window: (start, start + ms / 1000.0) });
            }
        }
        assert!(Instant::now() < deadline, "the worker finished no purge cycle in 5 minutes");
    }
}

/// How the expiries of a backlog's rows lie.
#[derive(Clone, Copy)]
enum Expiries {
    /// One for all: the rows of one statement (a COPY through `attach()`, a `mark_many()`) share theirs.
    Shared,
    /// One per row, a microsecond apart, in the order of the rows: marks made one by one.
    OnePerMark,
}

fn load_expired(c: &mut Client, table: &str, n: i64, expiries: Expiries) {
    let spread = match expiries {
        Expiries::Shared => "",
        Expiries::OnePerMark => " + g * interval '1 microsecond'",
    };
    c.batch_execute(&format!(
        "INSERT INTO {table} (id, expires_at)
              SELECT 'x' || g, now() - interval '1 hour'{spread} FROM generate_series(1, {n}) g"
    ))
    .unwrap();
    c.batch_execute(&format!("VACUUM ANALYZE {table}")).unwrap();
}

fn size(c: &mut Client, table: &str) -> f64 {
    c.query_one(&format!("SELECT pg_total_relation_size('{table}')::float8"), &[]).unwrap().get(0)
}

pub fn scenarios(c: &mut Client, pgbench: &Pgbench, scale: &Scale) -> Vec<Row> {
    let mut rows = Vec::new();
    c.batch_execute("SELECT dedup.create_inbox('purged'), dedup.create_inbox('unindexed')").unwrap();
    c.batch_execute("DROP INDEX dedup.inbox_unindexed_expires_at_idx").unwrap();

    let n = scale.purge_rows;
    // A backlog in the DELETE's batches; then in the worker's default batches, which walk the btree from where the
    // last one stopped (a statement's shared expiry gives them no such place: there they walk as the DELETE does).
    // The goal's row is paired (`compare::paired_ratio`): a purge of the same backlog ran anywhere from 0.37 to 0.75 s
    // on this host, on either side and with the same entries read (the DELETE bimodal), and medians of five rounds
    // put the ratio anywhere from 1.07x to 1.79x between runs of the same code (bench/results/profiles/issue-23.md,
    // stops 56, 58 and 60).
    let default = default_batch(c);
    for (batch, expiries, what, goal) in [
        (
            BATCH_ROWS,
            Expiries::Shared,
            "purge of expired rows, batches of 10,000, paired".to_owned(),
            Some(BACKLOG_GOAL),
        ),
        (default, Expiries::OnePerMark, format!("purge of expired rows, one expiry each, batches of {default}"), None),
    ] {
        let mut purge = |variant: usize, _: usize| -> f64 {
            match variant {
                // Loaded again, and measured again, when the record of the cycle that purged it was overwritten.
                0 => {
                    std::iter::repeat_with(|| {
                        load_expired(c, "dedup.inbox_purged", n, expiries);
                        worker_purge(c, n, Pace::Full(batch))
                    })
                    .take(3)
                    .flatten()
                    .next()
                    .expect("the worker's cycle was read in one of three tries")
                    .rate
                }
                _ => {
                    load_expired(c, "dedup.inbox_purged", n, expiries);
                    timed(c, &raw_purge("dedup.inbox_purged", batch), n)
                }
            }
        };
        let (ours, raw) = ("purge worker", "ctid-batched DELETE");
        rows.push(match goal {
            Some(goal) => {
                let [a, b] = <[Vec<f64>; 2]>::try_from(alternate_samples(scale.pairs, 2, &mut purge)).unwrap();
                paired_ratio(a, b).row(&what, ours, raw, "rows/s").goal(goal)
            }
            None => {
                let [a, b] = alternate(scale.rounds, &mut purge);
                Row::new(&what, (ours, a), (raw, b), "rows/s")
            }
        });
    }
    rows.extend(under_load(c, pgbench, scale));

    let m = scale.marks;
    let [indexed, bare] = alternate(scale.rounds, |variant, round| {
        let inbox = ["purged", "unindexed"][variant];
        timed(
            c,
            &format!(
                "SELECT count(*) FROM generate_series(1, {m}) g WHERE dedup.mark('i{round}-' || g, NULL, '{inbox}')"
            ),
            m,
        )
    });
    rows.push(Row::new("mark() cost of the expires_at btree", ("with btree", indexed), ("without", bare), "marks/s"));

    // Foreground marks while the worker purges a backlog at its default pace, against the same marks with nothing
    // else running.
    let [busy, idle] = alternate(scale.rounds, |variant, round| {
        let purging = variant == 0;
        if purging {
            load_expired(c, "dedup.inbox_purged", n, Expiries::Shared);
            set_worker_purge(c, true, Pace::Default);
            while expired_left(c, "dedup.inbox_purged") == n {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let rate = timed(
            c,
            &format!("SELECT count(*) FROM generate_series(1, {m}) g WHERE dedup.mark('f{variant}-{round}-' || g)"),
            m,
        );
        if purging {
            assert!(
                expired_left(c, "dedup.inbox_purged") > 0,
                "the backlog outlasts the measurement, or the comparison means nothing"
            );
            while expired_left(c, "dedup.inbox_purged") > 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            set_worker_purge(c, false, Pace::Default);
        }
        rate
    });
    rows.push(Row::new("foreground mark() while the worker purges", ("purging", busy), ("idle", idle), "marks/s"));

    // Table size over TTL cycles at a steady rate: every tick (400 ms; 200 in quick mode) a fifth of a window's
    // marks arrive with a TTL of 5 ticks (random ids, like event UUIDs), expired ones are purged, and the table is
    // vacuumed (autovacuum's job, done here explicitly so the result does not depend on its timing). Compared:
    // after 5 TTLs against a table freshly loaded with the same rows, and after 10 TTLs against after 5 (does it
    // keep growing?).
    let step = scale.cycle_rows / 5;
    let (tick_ms, ttl_ms) = (scale.cycle_tick_ms, 5 * scale.cycle_tick_ms);
    c.batch_execute("SELECT dedup.create_inbox('steady'), dedup.create_inbox('fresh')").unwrap();
    let mut after_five = 0.0;
    for tick in 0..50 {
        let started = std::time::Instant::now();
        c.batch_execute(&format!(
            "SELECT count(*) FROM dedup.mark_many(array(SELECT md5('{tick}-' || g) FROM generate_series(1, {step}) g), '{ttl_ms} ms', 'steady')"
        ))
        .unwrap();
        c.batch_execute("SELECT dedup.purge('steady')").unwrap();
        c.batch_execute("VACUUM dedup.inbox_steady").unwrap();
        if tick == 24 {
            after_five = size(c, "dedup.inbox_steady");
            c.batch_execute("INSERT INTO dedup.inbox_fresh SELECT id, expires_at FROM dedup.inbox_steady ORDER BY id")
                .unwrap();
            rows.push(Row::new(
                "inbox size after 5 TTL cycles vs freshly loaded",
                ("steady state MB", after_five / 1e6),
                ("fresh MB", size(c, "dedup.inbox_fresh") / 1e6),
                "MB",
            ));
        }
        std::thread::sleep(Duration::from_millis(tick_ms).saturating_sub(started.elapsed()));
    }
    rows.push(Row::new(
        "inbox size after 10 TTL cycles vs after 5",
        ("10 cycles MB", size(c, "dedup.inbox_steady") / 1e6),
        ("5 cycles MB", after_five / 1e6),
        "MB",
    ));
    rows
}

/// The steady state users live in: an inbox of `scale.steady_rows` marks of which a tenth has expired, purged while
/// `MARKERS` pgbench clients mark new ids into it — by the worker without pauses and by the hand-written DELETE (the
/// rates compared: same batches, one transaction each), by the worker at its default pace (`dedup.purge_batch_size`
/// rows at a time, `dedup.purge_batch_delay` apart), by the worker at the default pause in batches of 10,000 (the
/// default before 0.4.0), or not at all (idle). Each round starts from the same table: the clients' marks are deleted
/// and the expired tenth loaded again. Latencies while purging are those of the transactions that ended within the
/// purge (the worker's cycle, the DELETE's run); idle, those that ended within a window as long as the paced worker's
/// of the same round, starting a second and a half into the run (when the purges start, give or take the worker's wait
/// for its next cycle). A side's percentiles are taken over its rounds' latencies pooled.
fn under_load(c: &mut Client, pgbench: &Pgbench, scale: &Scale) -> Vec<Row> {
    let (table, expired) = ("dedup.inbox_busy", scale.steady_rows / 10);
    c.batch_execute(&format!(
        "SELECT dedup.create_inbox('busy');
         INSERT INTO {table} (id, expires_at)
              SELECT 'l' || g, now() + interval '3 days' FROM generate_series(1, {}) g",
        scale.steady_rows - expired
    ))
    .unwrap();
    let script = pgbench.script("mark_busy", &one_id_script(&mark_sql("busy"), 0, 0));
    // Long enough that the purge, which starts a second in, ends before the clients do (checked below).
    let secs = scale.run_secs + 5;
    assert!(secs > 5, "a round must outlast the 5 s between two purge cycles");
    // Cycles 5 s apart instead of 1: a cycle at the default pace (batches of 1,000, 10 ms apart) lasts over a second
    // in full mode, and one longer than the interval is followed at once by an empty one whose record could be read
    // instead of its own. A round lasts longer than 5 s (its clients alone run `secs`), so each cycle still starts
    // as soon as purging goes on.
    set_system(c, &[("purge_interval", Some("'5s'".to_owned()))]);
    let mut paced_window = 0.0;
    let samples = alternate_samples(scale.rounds, 5, |variant, _| {
        c.batch_execute(&format!("DELETE FROM {table} WHERE id LIKE 'evt-%'")).unwrap();
        load_expired(c, table, expired, Expiries::Shared);
        c.batch_execute("CHECKPOINT").unwrap();
        let (txns, rate, window) = std::thread::scope(|s| {
            let clients = s.spawn(|| pgbench.logged(&script, MARKERS, secs));
            std::thread::sleep(Duration::from_secs(1));
            let (rate, window) = match variant {
                0 | 2 | 4 => {
                    let pace = match variant {
                        0 => Pace::Full(BATCH_ROWS),
                        2 => Pace::Default,
                        _ => Pace::LargeBatches,
                    };
                    let cycle = worker_purge(c, expired, pace).expect("the worker's cycle was read");
                    (cycle.rate, Some(cycle.window))
                }
                1 => {
                    let start = epoch_now();
                    let rate = timed(c, &raw_purge(table, BATCH_ROWS), expired);
                    (rate, Some((start, epoch_now())))
                }
                _ => (0.0, None),
            };
            (clients.join().unwrap(), rate, window)
        });
        if variant == 3 {
            c.batch_execute(&raw_purge(table, BATCH_ROWS)).unwrap();
        }
        let (first, last) = span(&txns);
        if let Some((from, to)) = window {
            assert!(to < last, "the purge outlasted the clients' run: its latencies were not all measured");
            if variant == 2 {
                paced_window = to - from;
            }
        }
        // Idle, the window is as long as the last paced cycle: this round's, or an earlier round's when this
        // round runs idle first (`round_order`).
        let (from, to) = window.unwrap_or((first + 1.5, first + 1.5 + paced_window));
        let during: Vec<f64> = txns.iter().filter(|t| t.end >= from && t.end <= to).map(|t| t.latency_ms).collect();
        assert!(during.len() >= 100, "{} transactions in a window: too few for a p99", during.len());
        if verbose() {
            let side =
                ["worker, no pause", "DELETE", "worker, default pace", "idle", "worker, batches of 10,000"][variant];
            eprintln!(
                "[bench]   steady purge, {side}: {rate:.0} rows/s, {} transactions in {:.2} s, p50 {:.3} ms, p99 {:.3} ms",
                during.len(),
                to - from,
                percentile(during.clone(), 50.0),
                percentile(during.clone(), 99.0)
            );
        }
        (rate, during)
    });
    set_system(c, &[("purge_interval", None)]);
    // A side's rate is the median of its rounds'. Its latencies are pooled over its rounds: a paced cycle lasted
    // about 0.2 s in batches of 10,000, so one round's p99 rested on its slowest few dozen marks, and the median of
    // such p99s followed whichever side's rounds happened to be quiet (1.87x, then 0.99x, in two full runs).
    // Pooled, a round with a bad tail also counts, where the median of rounds would drop it.
    let [worker, raw, paced, idle, large] = [0, 1, 2, 3, 4].map(|v| {
        let pooled: Vec<f64> = samples[v].iter().flat_map(|(_, during)| during.iter().copied()).collect();
        (
            median(samples[v].iter().map(|(rate, _)| *rate).collect()),
            percentile(pooled.clone(), 50.0),
            percentile(pooled, 99.0),
        )
    });
    let at = format!("10%-expired inbox of {} marks, {MARKERS} clients marking", scale.steady_rows);
    let latency = |what: &str, label: &str, side: (f64, f64, f64), p99: bool| {
        let (p, value, idle) = if p99 { ("p99", side.2, idle.2) } else { ("p50", side.1, idle.1) };
        Row::new(&format!("mark() {p} latency while {what} a {at}"), (label, value), ("idle", idle), "ms")
    };
    // A p99 is the tail of the marks that end while a cycle runs, and a slower pace runs longer, over more marks:
    // this counts the slow marks a whole cycle costs, those over idle's p99 beyond the 1% that idle has anyway, per
    // round (one cycle each).
    let slow_marks = |v: usize| {
        let excess = samples[v].iter().map(|(_, during)| {
            during.iter().filter(|&&latency| latency > idle.2).count() as f64 - 0.01 * during.len() as f64
        });
        excess.sum::<f64>() / samples[v].len() as f64
    };
    vec![
        Row::new(&format!("purge of a {at}"), ("purge worker", worker.0), ("ctid-batched DELETE", raw.0), "rows/s")
            .goal(STEADY_GOAL),
        latency("the worker (default pace) purges", "worker purging", paced, false),
        latency("the worker (default pace) purges", "worker purging", paced, true).goal(P99_GOAL),
        latency("the worker (batches of 10,000, default pause) purges", "worker purging", large, true),
        latency("the worker (no pause) purges", "worker purging", worker, true),
        latency("the DELETE purges", "DELETE purging", raw, true),
        Row::new(
            &format!("marks over idle's p99 beyond idle's 1%, per worker cycle purging a {at}"),
            ("default pace", slow_marks(2)),
            ("batches of 10,000, default pause", slow_marks(4)),
            "marks",
        ),
    ]
}
