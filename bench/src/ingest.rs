//! A COPY of rows with 20% duplicates into a table attached with `dedup.attach()`, and into one attached with
//! `dedup.attach_batched()` (the bulk road), against the way people load such feeds today (COPY into a temp table,
//! then `INSERT ... SELECT ... ON CONFLICT` into a keys table and the target table, in one transaction), and against
//! a bare COPY that deduplicates nothing. Every round loads the same file into empty tables (the keys of earlier
//! rounds truncated away). The keys table has the inbox's two indexes (the key and its expiry), so both sides keep
//! the same state. Two files of the same rows: the repeats all at the end (each a key of the file's first part), and
//! the same rows shuffled, so that repeats are spread at random.
//!
//! A feed brings keys the inbox never saw, so every round starts with a filter that knows only the truncated
//! inbox's rows (`dedup.bloom_rebuild()`, untimed): without it, the bits of the earlier rounds' keys, which a
//! TRUNCATE leaves behind, would make every key a "maybe" and send it to the index, as no real feed does.

use crate::{alternate_samples, median, Goal, Row, Scale};
use pg_dedup_harness::postgres::error::SqlState;
use pg_dedup_harness::postgres::Client;
use std::time::{Duration, Instant};

/// The feed files, written and read by the server: repeats at the end, and spread at random.
const FEEDS: [(&str, &str); 2] = [
    ("repeats at the end", "/tmp/pg_dedup_bench_feed.tsv"),
    ("repeats spread at random", "/tmp/pg_dedup_bench_feed_spread.tsv"),
];

pub fn scenarios(c: &mut Client, scale: &Scale) -> Vec<Row> {
    let rows = scale.copy_rows;
    // 20% of the rows repeat a key of the file (each repeated key appears twice).
    let distinct = rows * 4 / 5;
    let [(_, feed), (_, spread)] = FEEDS;
    c.batch_execute(&format!(
        "COPY (SELECT 'ev-' || (g % {distinct}), md5(g::text) FROM generate_series(1, {rows}) g) TO '{feed}';
         COPY (SELECT 'ev-' || (g % {distinct}), md5(g::text) FROM generate_series(1, {rows}) g ORDER BY md5(g::text))
           TO '{spread}';
         CREATE TABLE copy_bare (event_id text, body text);
         CREATE TABLE copy_attached (event_id text, body text);
         SELECT dedup.create_inbox('copy_feed');
         SELECT dedup.attach('copy_attached', 'event_id', inbox => 'copy_feed');
         CREATE TABLE copy_batched (event_id text, body text);
         SELECT dedup.create_inbox('copy_batch');
         SELECT dedup.attach_batched('copy_batched', 'event_id', inbox => 'copy_batch');
         CREATE TABLE copy_hand (event_id text, body text);
         CREATE TABLE copy_hand_keys (id text COLLATE \"C\" PRIMARY KEY, expires_at timestamptz NOT NULL);
         CREATE INDEX ON copy_hand_keys (expires_at);"
    ))
    .unwrap();
    let mut out = Vec::new();
    for (i, (arrangement, feed)) in FEEDS.into_iter().enumerate() {
        // The bare COPY is the same whatever the order: measured with the first file only.
        let variants = if i == 0 { 4 } else { 3 };
        let samples = alternate_samples(scale.rounds, variants, |variant, _| load(c, variant, feed, rows));
        let [attached, hand, batched] = [0, 1, 2].map(|v| median(samples[v].clone()));
        let mut kept =
            |table: &str| -> i64 { c.query_one(&format!("SELECT count(*) FROM {table}"), &[]).unwrap().get(0) };
        assert_eq!(
            (kept("copy_attached"), kept("copy_hand"), kept("copy_batched")),
            (distinct, distinct, distinct),
            "every side kept each key once"
        );
        let label = format!("COPY of {rows} rows, 20% duplicates ({arrangement})");
        out.push(
            Row::new(
                &format!("{label}: attached table vs hand-written"),
                ("attach()", attached),
                ("temp table + ON CONFLICT", hand),
                "rows/s",
            )
            .goal(Goal::AtLeast(1.0)),
        );
        out.push(
            Row::new(
                &format!("{label}: the bulk road vs hand-written"),
                ("attach_batched()", batched),
                ("temp table + ON CONFLICT", hand),
                "rows/s",
            )
            .goal(Goal::AtLeast(1.5)),
        );
        if variants == 4 {
            out.push(Row::new(
                &format!("{label}: attached table vs bare COPY"),
                ("attach()", attached),
                ("bare COPY, no dedup", median(samples[3].clone())),
                "rows/s",
            ));
        }
        let _ = std::fs::remove_file(feed);
    }
    out
}

/// Loads `feed` one way (0: into the attached table, 1: the hand-written way, 2: into the table attached in batches,
/// 3: bare COPY) into empty tables; rows per second.
fn load(c: &mut Client, variant: usize, feed: &str, rows: i64) -> f64 {
    // What empties the tables, whether the filter is reloaded after it, and the load.
    let (reset, inbox, load) = match variant {
        0 => (
            "TRUNCATE copy_attached, dedup.inbox_copy_feed".to_owned(),
            true,
            format!("COPY copy_attached FROM '{feed}'"),
        ),
        1 => (
            "TRUNCATE copy_hand, copy_hand_keys".to_owned(),
            false,
            format!(
                "BEGIN;
                 CREATE TEMP TABLE stage (event_id text, body text) ON COMMIT DROP;
                 COPY stage FROM '{feed}';
                 WITH k AS (INSERT INTO copy_hand_keys
                            SELECT DISTINCT ON (event_id) event_id, now() + interval '3 days' FROM stage
                            ON CONFLICT DO NOTHING RETURNING id)
                 INSERT INTO copy_hand SELECT DISTINCT ON (s.event_id) s.* FROM stage s JOIN k ON k.id = s.event_id;
                 COMMIT;"
            ),
        ),
        2 => (
            "TRUNCATE copy_batched, dedup.inbox_copy_batch".to_owned(),
            true,
            format!("COPY copy_batched FROM '{feed}'"),
        ),
        _ => ("TRUNCATE copy_bare".to_owned(), false, format!("COPY copy_bare FROM '{feed}'")),
    };
    c.batch_execute(&reset).unwrap();
    if inbox {
        rebuild_filter(c);
    }
    c.batch_execute("CHECKPOINT").unwrap();
    let started = Instant::now();
    c.batch_execute(&load).unwrap();
    rows as f64 / started.elapsed().as_secs_f64()
}

/// `dedup.bloom_rebuild()`, once any load of the filter another process has under way is over. The worker loads and
/// rotates the filter on its own, and a `bloom_rebuild()` meanwhile fails with 55006 rather than wait (two full runs
/// died of it in this section, after an hour each). Retries for up to a minute, and says on stderr how long it waited.
fn rebuild_filter(c: &mut Client) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut waited = Duration::ZERO;
    loop {
        match c.batch_execute("SELECT dedup.bloom_rebuild()") {
            Ok(()) => break,
            Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
                waited += Duration::from_millis(50);
            }
            Err(e) => panic!("dedup.bloom_rebuild(): {e:?}"),
        }
    }
    if !waited.is_zero() {
        eprintln!("[bench] ingest: bloom_rebuild() waited about {:.1} s for another load", waited.as_secs_f64());
    }
}
