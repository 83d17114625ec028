//! Restart to ready: after a restart the shared filter is empty, and every call goes through the index
//! until the worker has reloaded it. On a cluster of its own, so that its marks weigh on no other section (and no
//! other section's on its reloads): `scale.restart_marks` live marks in 4 inboxes, then, alternately, three
//! restarts:
//! - with clients marking from the moment the server accepts connections, while the worker reloads the filter;
//! - the same with no filter at all (no worker serves the database, and the sessions have `dedup.bloom = off`):
//!   the floor a reload must not push the clients far below, from the same cold start;
//! - with nobody marking;
//!
//! and from them: seconds from the postmaster's start until the filter answers for all four inboxes, and the
//! clients' throughput in that time and after it, each against the run without a filter over the same seconds
//! since its own start. Every run starts from the same `restart_marks` (the clients' marks are deleted).

use crate::pgbench::{epoch_now, span, Pgbench, Txn};
use crate::{alternate_samples, median, Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::path::Path;
use std::time::{Duration, Instant};

const INBOXES: i64 = 4;
const CLIENTS: u32 = 4;
/// The budget: ready within 15 s per 10 million marks on this machine kind.
const SECONDS_PER_10M: f64 = 15.0;
/// Throughput while the filter reloads, against no filter.
const DURING_GOAL: Goal = Goal::AtLeast(0.8);

/// Does the filter answer for every inbox (loaded, and no rebuild running)?
fn ready(c: &mut Client) -> bool {
    c.query_one(
        "SELECT bool_and(filter_trusted) AND (SELECT filter_state FROM dedup.filter_stats()) = 'ready'
           FROM dedup.stats WHERE inbox LIKE 'r_'",
        &[],
    )
    .unwrap()
    .get(0)
}

/// Transactions per second that ended within [from, to].
fn rate(txns: &[Txn], from: f64, to: f64) -> f64 {
    txns.iter().filter(|t| t.end >= from && t.end <= to).count() as f64 / (to - from)
}

/// One restart: when the postmaster started, when the filter was ready (if waited for), and the clients'
/// transactions (none when nobody marked).
struct Restart {
    started: f64,
    ready: Option<f64>,
    txns: Vec<Txn>,
}

/// Restarts `cluster` (without the clients' marks of the run before); with `clients`, runs them (logged) from the
/// moment it accepts connections; with `wait_for_filter`, notes when the filter is ready.
fn restart(
    cluster: &Cluster,
    pgbench: &Pgbench,
    script: &Path,
    secs: u32,
    clients: bool,
    wait_for_filter: bool,
) -> Restart {
    let mut c = cluster.connect("restart");
    for i in 1..=INBOXES {
        c.batch_execute(&format!("DELETE FROM dedup.inbox_r{i} WHERE id LIKE 'evt-%'")).unwrap();
    }
    c.batch_execute("VACUUM").unwrap();
    drop(c);
    cluster.stop();
    let started = epoch_now();
    cluster.pg_ctl_start();
    std::thread::scope(|s| {
        let run = clients.then(|| s.spawn(|| pgbench.logged(script, CLIENTS, secs)));
        let ready = wait_for_filter.then(|| wait_until_ready(&mut cluster.connect("restart")));
        Restart { started, ready, txns: run.map(|r| r.join().unwrap()).unwrap_or_default() }
    })
}

/// Waits until the filter answers for every inbox; returns when that was (epoch seconds).
fn wait_until_ready(c: &mut Client) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !ready(c) {
        assert!(Instant::now() < deadline, "the filter was not ready 10 minutes after a restart");
        std::thread::sleep(Duration::from_millis(100));
    }
    epoch_now()
}

pub fn scenarios(scale: &Scale) -> Vec<Row> {
    let n = scale.restart_marks;
    let capacity = (2 * n).to_string();
    let cluster = Cluster::start(&[
        "shared_preload_libraries = 'pg_dedup'",
        "dedup.database = 'restart'",
        "dedup.purge = off",
        &format!("dedup.bloom_capacity = {capacity}"),
        "shared_buffers = '512MB'",
        "synchronous_commit = off",
        "max_wal_size = '4GB'",
        "checkpoint_timeout = '30min'",
    ]);
    let mut c = cluster.fresh_db("restart");
    for i in 1..=INBOXES {
        c.batch_execute(&format!(
            "SELECT dedup.create_inbox('r{i}');
             INSERT INTO dedup.inbox_r{i} (id, expires_at)
                  SELECT 'm' || g, now() + interval '3 days' FROM generate_series(1, {}) g",
            n / INBOXES
        ))
        .unwrap();
    }
    c.batch_execute("VACUUM ANALYZE").unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
    drop(c);
    let pgbench = Pgbench::new(&cluster, "restart");
    let script = pgbench.script(
        "mark_restart",
        &format!(
            "\\set r random(1, 1000000000000000)\n\\set i random(1, {INBOXES})\n\
             SELECT dedup.mark('evt-' || :r, interval '3 days', 'r' || :i);\n"
        ),
    );
    let secs = scale.restart_secs;
    let mut reload = 0.0;
    let samples = alternate_samples(scale.rounds.min(3), 3, |variant, _| match variant {
        0 => {
            let run = restart(&cluster, &pgbench, &script, secs, true, true);
            let at = run.ready.unwrap();
            reload = at - run.started;
            let (_, last) = span(&run.txns);
            assert!(at + 1.0 < last, "the clients stopped before the filter was ready: raise restart_secs");
            [reload, rate(&run.txns, run.started, at), rate(&run.txns, at + 0.5, last)]
        }
        1 => {
            let no_filter = |set: bool| {
                let mut c = cluster.connect("restart");
                let (system, database) = if set {
                    ("SET dedup.database = ''", "SET dedup.bloom = off")
                } else {
                    ("RESET dedup.database", "RESET dedup.bloom")
                };
                c.batch_execute(&format!("ALTER SYSTEM {system}")).unwrap();
                c.batch_execute(&format!("ALTER DATABASE restart {database}")).unwrap();
            };
            no_filter(true);
            let run = restart(&cluster, &pgbench, &script, secs, true, false);
            no_filter(false);
            let (_, last) = span(&run.txns);
            // The last reload measured: this round's, or an earlier round's when this round runs it later.
            let at = run.started + reload;
            [0.0, rate(&run.txns, run.started, at), rate(&run.txns, at + 0.5, last)]
        }
        _ => {
            let run = restart(&cluster, &pgbench, &script, secs, false, true);
            [run.ready.unwrap() - run.started, 0.0, 0.0]
        }
    });
    let of = |variant: usize, i: usize| median(samples[variant].iter().map(|s| s[i]).collect());
    let what = format!("{n} marks in {INBOXES} inboxes");
    let rows = vec![
        Row::new(
            &format!("restart to filter ready, {what}"),
            (&format!("{CLIENTS} clients marking s"), of(0, 0)),
            ("nobody marking s", of(2, 0)),
            "s",
        )
        .goal(Goal::Within(SECONDS_PER_10M * n as f64 / 1e7)),
        Row::new(
            &format!("mark() after a restart, while the filter reloads vs no filter, {what}, {CLIENTS} clients"),
            ("reloading", of(0, 1)),
            ("no filter", of(1, 1)),
            "tx/s",
        )
        .goal(DURING_GOAL),
        Row::new(
            &format!("mark() after a restart, once the filter is ready vs no filter, {what}, {CLIENTS} clients"),
            ("ready", of(0, 2)),
            ("no filter", of(1, 2)),
            "tx/s",
        ),
    ];
    cluster.destroy();
    rows
}
