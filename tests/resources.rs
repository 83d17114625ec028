//! Memory, encodings and errors: `mark_many()` of a million ids stays within 3× the memory of the hand-written
//! insert, a transaction remembers where it wrote at most 917,504 ids, dropped inboxes do not leak per-backend
//! memory, a non-UTF8 database is refused with a clear error, `dedup.purge()` leaves a `SET LOCAL` local, concurrent
//! drop/create of an inbox answers "does not exist", errors PostgreSQL raises reach the client without a Rust
//! backtrace, and a purge cancelled within its walk is an ordinary error.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Runs `sql` on a fresh connection and returns how far the backend's heap grew above where it started, at its
/// peak (sampled every millisecond while the statement runs).
fn peak_growth(cluster: &Cluster, db: &str, setup: &str, sql: &str) -> u64 {
    let mut c = cluster.connect(db);
    c.batch_execute(setup).unwrap();
    let pid = backend_pid(&mut c);
    let start = anonymous_bytes(pid);
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = start;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(anonymous_bytes(pid));
                std::thread::sleep(Duration::from_millis(1));
            }
            peak.max(anonymous_bytes(pid))
        })
    };
    c.batch_execute(sql).unwrap();
    done.store(true, Ordering::Relaxed);
    sampler.join().unwrap().saturating_sub(start)
}

const HAND_WRITTEN: &str = "INSERT INTO keys (id, expires_at) SELECT u, now() + interval '1 day' FROM unnest(
    (SELECT ids FROM batch)) u ON CONFLICT (id) DO NOTHING RETURNING id";

#[test]
fn mark_many_of_a_million_ids_stays_within_three_times_the_hand_written_memory() {
    let cluster = preloaded("postgres", &[]);
    let mut c = cluster.fresh_db("mem_many");
    c.batch_execute(
        "CREATE TABLE keys (id text COLLATE \"C\" PRIMARY KEY, expires_at timestamptz NOT NULL);
         CREATE TABLE batch AS SELECT array_agg(md5(g::text) || '-' || g) AS ids FROM generate_series(1, 1000000) g;
         CREATE TABLE small AS SELECT array_agg(md5(g::text) || '-' || g) AS ids FROM generate_series(1, 100000) g;
         SELECT dedup.bloom_rebuild();",
    )
    .unwrap();
    // Returning every new id, as mark_many() does, and reading them as a client would.
    let ours_sql = "SELECT count(*) FROM dedup.mark_many((SELECT ids FROM batch))";
    let hand_sql = &format!("WITH i AS ({HAND_WRITTEN}) SELECT count(*) FROM i");
    let hand_new = peak_growth(&cluster, "mem_many", "", hand_sql);
    let ours_new = peak_growth(&cluster, "mem_many", "", ours_sql);
    let hand_dup = peak_growth(&cluster, "mem_many", "", hand_sql);
    let ours_dup = peak_growth(&cluster, "mem_many", "", ours_sql);
    let ours_small =
        peak_growth(&cluster, "mem_many", "", "SELECT count(*) FROM dedup.mark_many((SELECT ids FROM small))");
    let mb = |b: u64| b as f64 / 1048576.0;
    eprintln!(
        "peak heap growth, 1M ids: new {:.1} MB (hand-written {:.1} MB), duplicates {:.1} MB (hand-written {:.1} MB); \
         100k new ids {:.1} MB",
        mb(ours_new),
        mb(hand_new),
        mb(ours_dup),
        mb(hand_dup),
        mb(ours_small)
    );
    assert!(ours_new <= 3 * hand_new.max(1 << 20), "new ids: {:.1} MB vs {:.1} MB", mb(ours_new), mb(hand_new));
    assert!(ours_dup <= 3 * hand_dup.max(1 << 20), "duplicates: {:.1} MB vs {:.1} MB", mb(ours_dup), mb(hand_dup));
    assert!(ours_new <= 15 * ours_small.max(1 << 20), "a cliff between 100k and 1M ids");
}

/// A transaction remembers where it wrote each id, so that a repeat in the same load is read there instead of
/// through the index, but at most 917,504 places for all inboxes together (src/direct/handle.rs, `MAX_PLACES`):
/// past that, repeats are found through the index, and the load goes on. Two attached tables, each half the cap
/// and 50 keys more, fill it together: a cap per inbox would remember every key of both.
#[test]
fn a_transaction_remembers_where_it_wrote_at_most_917504_ids_for_all_inboxes_together() {
    const HALF: i64 = 917_504 / 2 + 50;
    let cluster = preloaded("postgres", &[]);
    let mut c = cluster.fresh_db("places_cap");
    c.batch_execute(
        "SELECT dedup.create_inbox('a'), dedup.create_inbox('b');
         CREATE TABLE feed_a (event_id text NOT NULL); CREATE TABLE feed_b (event_id text NOT NULL);
         SELECT dedup.attach('feed_a', 'event_id', inbox => 'a'), dedup.attach('feed_b', 'event_id', inbox => 'b')",
    )
    .unwrap();
    let scans = |c: &mut Client, inbox: &str| -> i64 {
        let sql = format!("SELECT pg_stat_get_xact_numscans('dedup.inbox_{inbox}_pkey'::regclass)");
        c.query_one(&sql, &[]).unwrap().get(0)
    };
    let load = |c: &mut Client, feed: &str, from: i64, to: i64| {
        let sql = format!("INSERT INTO {feed} SELECT 'k' || g FROM generate_series({from}, {to}) g");
        c.batch_execute(&sql).unwrap();
    };
    c.batch_execute("BEGIN").unwrap();
    load(&mut c, "feed_a", 1, HALF);
    load(&mut c, "feed_b", 1, HALF);
    let (a, b) = (scans(&mut c, "a"), scans(&mut c, "b"));
    load(&mut c, "feed_a", 1, 100);
    load(&mut c, "feed_b", 1, 100);
    assert_eq!((scans(&mut c, "a") - a, scans(&mut c, "b") - b), (0, 0), "repeats within the cap: no index scan");
    load(&mut c, "feed_a", HALF - 99, HALF);
    assert_eq!(scans(&mut c, "a") - a, 0, "the first inbox's last keys are within the cap");
    load(&mut c, "feed_b", HALF - 99, HALF);
    assert_eq!(scans(&mut c, "b") - b, 100, "the last 100 keys of the two loads are past the cap: one scan each");
    c.batch_execute("COMMIT").unwrap();
    assert_eq!((count(&mut c, "feed_a"), count(&mut c, "feed_b")), (HALF, HALF), "every key once");
}

#[test]
fn dropped_inboxes_leave_no_memory_behind_in_a_pooled_connection() {
    let mut c = db("mem_names");
    let pid = backend_pid(&mut c);
    let round = |c: &mut Client, from: usize| {
        for i in from..from + 300 {
            c.batch_execute(&format!(
                "SELECT dedup.create_inbox('n{i}'); SELECT dedup.mark('x', NULL, 'n{i}'); \
                 SELECT dedup.seen('x', 'n{i}'); SELECT dedup.drop_inbox('n{i}')"
            ))
            .unwrap();
        }
    };
    round(&mut c, 0);
    let after_first = anonymous_bytes(pid);
    round(&mut c, 300);
    round(&mut c, 600);
    let growth = anonymous_bytes(pid).saturating_sub(after_first);
    assert!(growth < 1 << 20, "600 more dropped inboxes kept {} kB of this backend's memory", growth / 1024);
}

#[test]
fn a_database_not_in_utf8_is_refused_with_a_clear_error() {
    let mut admin = cluster().connect("postgres");
    admin.batch_execute("DROP DATABASE IF EXISTS latin1").unwrap();
    admin
        .batch_execute("CREATE DATABASE latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
        .unwrap();
    let mut c = cluster().connect("latin1");
    let err = c.batch_execute("CREATE EXTENSION pg_dedup").expect_err("pg_dedup needs UTF8");
    assert_dedup_error::<()>(Err(err), "0A000");
    let err = c.batch_execute("CREATE EXTENSION pg_dedup").expect_err("pg_dedup needs UTF8");
    assert!(err.as_db_error().unwrap().message().contains("LATIN1"), "{err}");
}

#[test]
fn purge_leaves_a_set_local_local() {
    let mut c = db("purge_local");
    c.batch_execute("BEGIN; SET LOCAL lock_timeout = '7s'; SELECT dedup.purge()").unwrap();
    let inside: String = c.query_one("SHOW lock_timeout", &[]).unwrap().get(0);
    assert_eq!(inside, "7s", "the caller's SET LOCAL holds inside its transaction");
    c.batch_execute("COMMIT").unwrap();
    let after: String = c.query_one("SHOW lock_timeout", &[]).unwrap().get(0);
    assert_eq!(after, "0", "purge() turned a SET LOCAL into a session setting");
    c.batch_execute("SET lock_timeout = '3s'; SELECT dedup.purge()").unwrap();
    let session: String = c.query_one("SHOW lock_timeout", &[]).unwrap().get(0);
    assert_eq!(session, "3s", "purge() changed the session's own setting");
}

#[test]
fn concurrent_drop_and_create_of_an_inbox_answer_does_not_exist() {
    let mut c = db("drop_race");
    c.batch_execute("SELECT dedup.create_inbox('flux')").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        let mut c = connect("drop_race");
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                c.batch_execute("SELECT dedup.drop_inbox('flux')").unwrap();
                c.batch_execute("SELECT dedup.create_inbox('flux')").unwrap();
            }
        })
    };
    let markers: Vec<_> = (0..4)
        .map(|t| {
            let mut c = connect("drop_race");
            std::thread::spawn(move || {
                let mut codes = Vec::new();
                for i in 0..200 {
                    match c.query_one("SELECT dedup.mark($1, NULL, 'flux')", &[&format!("{t}-{i}")]) {
                        Ok(_) => codes.push("ok".to_owned()),
                        Err(e) => {
                            codes.push(format!("{}: {}", sqlstate(&e), e.as_db_error().map_or("", |d| d.message())))
                        }
                    }
                }
                codes
            })
        })
        .collect();
    let codes: Vec<String> = markers.into_iter().flat_map(|m| m.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    let unexpected: Vec<&String> = codes.iter().filter(|c| *c != "ok" && !c.starts_with("42704:")).collect();
    assert!(unexpected.is_empty(), "only 42704 may answer a mark racing drop/create: {unexpected:?}");
    assert!(codes.iter().any(|c| c == "ok"), "some marks went through");
}

#[test]
fn errors_postgres_raises_reach_the_client_without_a_rust_backtrace() {
    // The server's environment asks for Rust backtraces, as this machine's does.
    std::env::set_var("RUST_BACKTRACE", "1");
    let cluster = preloaded("backtrace", &[]);
    let mut holder = cluster.fresh_db("backtrace");
    let mut c = cluster.connect("backtrace");
    holder.batch_execute("BEGIN; SELECT dedup.mark('held')").unwrap();
    let checks = [
        ("SET lock_timeout = '100ms'", "SELECT dedup.mark('held')", "55P03", "canceling statement due to lock timeout"),
        (
            "SET statement_timeout = '100ms'",
            "SELECT dedup.mark('held')",
            "57014",
            "canceling statement due to statement timeout",
        ),
    ];
    for (setup, sql, code, message) in checks {
        c.batch_execute(&format!("RESET ALL; {setup}")).unwrap();
        let err = c.batch_execute(sql).expect_err(sql);
        let db = err.as_db_error().expect("a server error");
        assert_eq!(db.code().code(), code, "{err}");
        assert_eq!(db.message(), message);
        assert_eq!(db.detail(), None, "PostgreSQL's error was reported with a DETAIL of ours: {:?}", db.detail());
    }
    // A serialization failure, raised by the unique index under REPEATABLE READ.
    c.batch_execute("RESET ALL; BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1").unwrap();
    holder.batch_execute("COMMIT; SELECT dedup.mark('late')").unwrap();
    let err = c.batch_execute("SELECT dedup.mark('late')").expect_err("40001");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "40001", "{err}");
    assert!(!db.detail().unwrap_or("").contains("backtrace"), "{:?}", db.detail());
    assert!(!db.detail().unwrap_or("").contains("rust_begin_unwind"), "{:?}", db.detail());
}

/// A purge cancelled as it runs (500,000 rows take far longer than the timeout, so the cancel most likely comes
/// where the walk checks for interrupts, inside the one guard around its calls into PostgreSQL) is an ordinary
/// error: the client gets 57014, nothing is deleted, and the server goes on without restarting. The pg_test
/// `a_cancel_met_in_the_walk_is_an_error` makes the cancel land in the walk for certain.
#[test]
fn a_purge_cancelled_within_its_walk_is_an_ordinary_error() {
    // The worker leaves the database alone: its cycles would purge the rows first.
    let cluster = preloaded("purge_cancel", &["dedup.purge = off"]);
    let mut c = cluster.fresh_db("purge_cancel");
    c.batch_execute(
        "INSERT INTO dedup.inbox_default (id, expires_at)
             SELECT 'x' || g, now() - interval '1 hour' FROM generate_series(1, 500000) g",
    )
    .unwrap();
    c.batch_execute("VACUUM ANALYZE dedup.inbox_default").unwrap();
    let before = postmaster_started(&mut c);
    c.batch_execute("SET statement_timeout = '20ms'").unwrap();
    let err = c.batch_execute("SELECT dedup.purge()").expect_err("500,000 rows take longer than 20 ms to purge");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "57014", "{err}");
    assert_eq!(db.message(), "canceling statement due to statement timeout");
    assert_eq!(db.detail(), None, "a Rust backtrace or panic reached the client: {:?}", db.detail());
    let mut other = cluster.connect("purge_cancel");
    assert_eq!(postmaster_started(&mut other), before, "the server restarted");
    assert_eq!(count(&mut other, "dedup.inbox_default"), 500_000, "the cancelled purge deleted rows");
    c.batch_execute("RESET statement_timeout").unwrap();
    let purged: i64 = c.query_one("SELECT dedup.purge()", &[]).unwrap().get(0);
    assert_eq!(purged, 500_000);
}
