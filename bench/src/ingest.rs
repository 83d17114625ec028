//! A COPY of rows with 20% duplicates into a table attached with `dedup.attach()`, against the way people
//! load such feeds today (COPY into a temp table, then `INSERT ... SELECT ... ON CONFLICT` into a keys table and
//! the target table, in one transaction), and against a bare COPY that deduplicates nothing. Every round loads the
//! same file into empty tables (the keys of earlier rounds truncated away). The keys table has the inbox's two
//! indexes (the key and its expiry), so both sides keep the same state.

use crate::{alternate_samples, median, Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;
use std::time::Instant;

/// The feed file, written and read by the server.
const FEED: &str = "/tmp/pg_dedup_bench_feed.tsv";

pub fn scenarios(c: &mut Client, scale: &Scale) -> Vec<Row> {
    let rows = scale.copy_rows;
    // 20% of the rows repeat a key of the file (each repeated key appears twice).
    let distinct = rows * 4 / 5;
    c.batch_execute(&format!(
        "COPY (SELECT 'ev-' || (g % {distinct}), md5(g::text) FROM generate_series(1, {rows}) g) TO '{FEED}';
         CREATE TABLE copy_bare (event_id text, body text);
         CREATE TABLE copy_attached (event_id text, body text);
         SELECT dedup.create_inbox('copy_feed');
         SELECT dedup.attach('copy_attached', 'event_id', inbox => 'copy_feed');
         CREATE TABLE copy_hand (event_id text, body text);
         CREATE TABLE copy_hand_keys (id text COLLATE \"C\" PRIMARY KEY, expires_at timestamptz NOT NULL);
         CREATE INDEX ON copy_hand_keys (expires_at);"
    ))
    .unwrap();
    let mut load = |variant: usize| -> f64 {
        let (reset, load) = match variant {
            0 => (
                "TRUNCATE copy_attached, dedup.inbox_copy_feed".to_owned(),
                format!("COPY copy_attached FROM '{FEED}'"),
            ),
            1 => (
                "TRUNCATE copy_hand, copy_hand_keys".to_owned(),
                format!(
                    "BEGIN;
                     CREATE TEMP TABLE stage (event_id text, body text) ON COMMIT DROP;
                     COPY stage FROM '{FEED}';
                     WITH k AS (INSERT INTO copy_hand_keys
                                SELECT DISTINCT ON (event_id) event_id, now() + interval '3 days' FROM stage
                                ON CONFLICT DO NOTHING RETURNING id)
                     INSERT INTO copy_hand SELECT DISTINCT ON (s.event_id) s.* FROM stage s JOIN k ON k.id = s.event_id;
                     COMMIT;"
                ),
            ),
            _ => ("TRUNCATE copy_bare".to_owned(), format!("COPY copy_bare FROM '{FEED}'")),
        };
        c.batch_execute(&format!("{reset}; CHECKPOINT")).unwrap();
        let started = Instant::now();
        c.batch_execute(&load).unwrap();
        rows as f64 / started.elapsed().as_secs_f64()
    };
    let samples = alternate_samples(scale.rounds, 3, |variant, _| load(variant));
    let [attached, hand, bare] = [0, 1, 2].map(|v| median(samples[v].clone()));
    let mut kept = |table: &str| -> i64 { c.query_one(&format!("SELECT count(*) FROM {table}"), &[]).unwrap().get(0) };
    assert_eq!((kept("copy_attached"), kept("copy_hand")), (distinct, distinct), "both sides kept each key once");
    let _ = std::fs::remove_file(FEED);
    let label = format!("COPY of {rows} rows, 20% duplicates");
    vec![
        Row::new(
            &format!("{label}: attached table vs hand-written"),
            ("attach()", attached),
            ("temp table + ON CONFLICT", hand),
            "rows/s",
        )
        .goal(Goal::AtLeast(1.5)),
        Row::new(
            &format!("{label}: attached table vs bare COPY"),
            ("attach()", attached),
            ("bare COPY, no dedup", bare),
            "rows/s",
        ),
    ]
}
