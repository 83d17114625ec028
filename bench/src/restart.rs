//! Restart to ready (issue 17): after a restart the shared filter is empty, and every call goes through the index
//! until the worker has reloaded it. On a cluster of its own, so that its marks weigh on no other section (and no
//! other section's on its reloads): `scale.restart_marks` live marks in 4 inboxes, then, alternately,
//! - clients marking with the filter off (the floor a reload must not fall far below),
//! - a restart with the same clients marking from the moment the server accepts connections,
//! - a restart with nobody marking,
//!
//! and from them: seconds from the postmaster's start until the filter answers for all four inboxes, and the
//! clients' throughput while it reloads and after, against the filter off.

use crate::pgbench::{epoch_now, Pgbench, Txn};
use crate::{alternate_samples, median, Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::time::Duration;

const INBOXES: i64 = 4;
const CLIENTS: u32 = 4;
/// Issue 17's budget: ready within 15 s per 10 million marks on this machine kind.
const SECONDS_PER_10M: f64 = 15.0;
/// Throughput while the filter reloads, against the filter off.
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

/// Restarts `cluster`; with `clients`, runs them (logged) from the moment it accepts connections. Seconds from the
/// postmaster's start until the filter is ready, and the clients' throughput before and after that moment.
fn restart(cluster: &Cluster, pgbench: &Pgbench, script: &std::path::Path, secs: u32, clients: bool) -> [f64; 3] {
    cluster.stop();
    let started = epoch_now();
    cluster.pg_ctl_start();
    std::thread::scope(|s| {
        let run = clients.then(|| s.spawn(|| pgbench.logged(script, CLIENTS, secs)));
        let mut c = cluster.connect("restart");
        while !ready(&mut c) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let at = epoch_now();
        let Some(run) = run else { return [at - started, 0.0, 0.0] };
        let txns = run.join().unwrap();
        let first = txns.iter().map(|t| t.end).fold(f64::INFINITY, f64::min);
        let last = txns.iter().map(|t| t.end).fold(0.0, f64::max);
        assert!(at + 1.0 < last, "the clients stopped before the filter was ready: raise their run time");
        [at - started, rate(&txns, first, at), rate(&txns, at + 0.5, last)]
    })
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
    let pgbench = Pgbench::new(&cluster, "restart");
    let script = pgbench.script(
        "mark_restart",
        &format!(
            "\\set r random(1, 1000000000000000)\n\\set i random(1, {INBOXES})\n\
             SELECT dedup.mark('evt-' || :r, interval '3 days', 'r' || :i);\n"
        ),
    );
    let secs = scale.restart_secs;
    let samples = alternate_samples(scale.rounds.min(3), 3, |variant, _| match variant {
        0 => {
            c.batch_execute("ALTER DATABASE restart SET dedup.bloom = off").unwrap();
            let txns = pgbench.logged(&script, CLIENTS, secs);
            c.batch_execute("ALTER DATABASE restart RESET dedup.bloom").unwrap();
            let first = txns.iter().map(|t| t.end).fold(f64::INFINITY, f64::min);
            let last = txns.iter().map(|t| t.end).fold(0.0, f64::max);
            [0.0, rate(&txns, first, last), 0.0]
        }
        _ => {
            let measured = restart(&cluster, &pgbench, &script, secs, variant == 1);
            c = cluster.connect("restart");
            measured
        }
    });
    let of = |variant: usize, i: usize| median(samples[variant].iter().map(|s| s[i]).collect());
    let what = format!("{n} marks in {INBOXES} inboxes");
    let rows = vec![
        Row::new(
            &format!("restart to filter ready, {what}"),
            (&format!("{CLIENTS} clients marking s"), of(1, 0)),
            ("nobody marking s", of(2, 0)),
            "s",
        )
        .goal(Goal::Within(SECONDS_PER_10M * n as f64 / 1e7)),
        Row::new(
            &format!("mark() while the filter reloads vs filter off, {what}, {CLIENTS} clients"),
            ("reloading", of(1, 1)),
            ("filter off", of(0, 1)),
            "tx/s",
        )
        .goal(DURING_GOAL),
        Row::new(
            &format!("mark() once the filter is ready vs filter off, {what}, {CLIENTS} clients"),
            ("ready", of(1, 2)),
            ("filter off", of(0, 1)),
            "tx/s",
        ),
    ];
    drop(c);
    cluster.destroy();
    rows
}
