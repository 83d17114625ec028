//! Expiry: pg_dedup's purge batches against a hand-written ctid-batched DELETE on the same data, the cost of
//! the `expires_at` btree on mark(), foreground marks while a backlog is purged, and table size over TTL cycles.

use crate::{alternate, timed, Row, Scale};
use pg_dedup_harness::postgres::Client;
use std::time::Duration;

/// The hand-written baseline: the batched DELETE teams write, one transaction per batch like the worker's, run on
/// the same data (the same table, loaded the same way), so only the purge code differs.
const RAW_PURGE: &str = "DO $$ DECLARE n bigint; BEGIN LOOP
      DELETE FROM dedup.inbox_purged WHERE ctid = ANY (ARRAY(
          SELECT ctid FROM dedup.inbox_purged WHERE expires_at <= now() LIMIT 10000));
      GET DIAGNOSTICS n = ROW_COUNT; COMMIT; EXIT WHEN n < 10000; END LOOP; END $$";

/// Switches the background worker's purging on or off (the benchmark's cluster starts with it off).
fn set_worker_purge(c: &mut Client, on: bool, batch_delay_ms: u32) {
    c.batch_execute(&format!("ALTER SYSTEM SET dedup.purge = {on}")).unwrap();
    c.batch_execute(&format!("ALTER SYSTEM SET dedup.purge_batch_delay = {batch_delay_ms}")).unwrap();
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
}

fn expired_left(c: &mut Client) -> i64 {
    c.query_one("SELECT count(*) FROM dedup.inbox_purged WHERE expires_at <= now()", &[]).unwrap().get(0)
}

/// Lets the worker purge the backlog of `dedup.inbox_purged`; returns its rate in the cycle that did it.
fn worker_purge_rate(c: &mut Client, rows: i64) -> f64 {
    let cycles_before: i64 = c.query_one("SELECT coalesce(max(purge_cycles), 0) FROM dedup.stats", &[]).unwrap().get(0);
    set_worker_purge(c, true, 0);
    while expired_left(c) > 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    loop {
        let row = c
            .query_one("SELECT max(purge_cycles), max(last_purge_ms), max(last_purge_rows) FROM dedup.stats", &[])
            .unwrap();
        let (cycles, ms, purged): (i64, f64, i64) = (row.get(0), row.get(1), row.get(2));
        if cycles > cycles_before && purged >= rows {
            set_worker_purge(c, false, 10);
            return purged as f64 / (ms / 1000.0);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn load_expired(c: &mut Client, table: &str, n: i64) {
    c.batch_execute(&format!(
        "INSERT INTO {table} (id, expires_at) SELECT 'x' || g, now() - interval '1 hour' FROM generate_series(1, {n}) g"
    ))
    .unwrap();
    c.batch_execute(&format!("VACUUM ANALYZE {table}")).unwrap();
}

fn size(c: &mut Client, table: &str) -> f64 {
    c.query_one(&format!("SELECT pg_total_relation_size('{table}')::float8"), &[]).unwrap().get(0)
}

pub fn scenarios(c: &mut Client, scale: &Scale) -> Vec<Row> {
    let mut rows = Vec::new();
    c.batch_execute("SELECT dedup.create_inbox('purged'), dedup.create_inbox('unindexed')").unwrap();
    c.batch_execute("DROP INDEX dedup.inbox_unindexed_expires_at_idx").unwrap();

    let n = scale.purge_rows;
    let [ours, raw] = alternate(scale.rounds, |variant, _| {
        load_expired(c, "dedup.inbox_purged", n);
        match variant {
            0 => worker_purge_rate(c, n),
            _ => timed(c, RAW_PURGE, n),
        }
    });
    rows.push(Row::new(
        "purge of expired rows, batches of 10,000",
        ("purge worker", ours),
        ("ctid-batched DELETE", raw),
        "rows/s",
    ));

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

    // Foreground marks while the worker purges a backlog (its default 10 ms pause between batches), against the
    // same marks with nothing else running.
    let [busy, idle] = alternate(scale.rounds, |variant, round| {
        let purging = variant == 0;
        if purging {
            load_expired(c, "dedup.inbox_purged", n);
            set_worker_purge(c, true, 10);
            while expired_left(c) == n {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let rate = timed(
            c,
            &format!("SELECT count(*) FROM generate_series(1, {m}) g WHERE dedup.mark('f{variant}-{round}-' || g)"),
            m,
        );
        if purging {
            assert!(expired_left(c) > 0, "the backlog outlasts the measurement, or the comparison means nothing");
            while expired_left(c) > 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            set_worker_purge(c, false, 10);
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
