//! Idempotency keys: claim() / complete() / release() across transactions and sessions — states,
//! transitions, blocking and non-blocking claims, leases and their take-over, fingerprint mismatches, killed
//! holders, result sizes, and what a replay costs. The same tests run on a preloaded server in
//! `idempotency_filtered` (the filter answers, new keys go in directly): tests/idempotency.rs and
//! tests/idempotency_filtered.rs include this suite, each with its server.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::thread;
use std::time::{Duration, Instant};

/// The server this suite runs on: the root file that includes it says which (`server()`).
fn cluster() -> &'static Cluster {
    super::server()
}

/// A fresh database with pg_dedup installed, on this suite's server.
fn db(name: &str) -> pg_dedup_harness::postgres::Client {
    cluster().fresh_db(name)
}

/// A connection to database `name` of this suite's server.
fn connect(name: &str) -> pg_dedup_harness::postgres::Client {
    cluster().connect(name)
}

/// (state, result as text) of a claim.
fn claim(c: &mut Client, sql: &str) -> (String, Option<String>) {
    let row =
        c.query_one(&format!("SELECT state, result::text FROM {sql}"), &[]).unwrap_or_else(|e| panic!("{sql}: {e}"));
    (row.get(0), row.get(1))
}

fn state(c: &mut Client, sql: &str) -> String {
    claim(c, sql).0
}

#[test]
fn a_claim_completed_in_its_transaction_is_replayed_with_its_result() {
    let mut c = db("idem_replay");
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(claim(&mut c, "dedup.claim('k1', 'fp')"), ("new".into(), None));
    c.batch_execute("SELECT dedup.complete('k1', '{\"status\": 201, \"body\": {\"id\": 7}}'); COMMIT").unwrap();
    let mut other = connect("idem_replay");
    assert_eq!(
        claim(&mut other, "dedup.claim('k1', 'fp')"),
        ("completed".into(), Some("{\"body\": {\"id\": 7}, \"status\": 201}".into()))
    );
    assert_eq!(
        claim(&mut other, "dedup.claim('k1')"),
        ("completed".into(), Some("{\"body\": {\"id\": 7}, \"status\": 201}".into())),
        "NULL: not checked"
    );
    // Interplay with marks: a claimed key is a duplicate for mark(), seen, and forget() removes it.
    assert!(!mark(&mut other, "k1"));
    assert!(other.query_one("SELECT dedup.seen('k1')", &[]).unwrap().get::<_, bool>(0));
    assert!(other.query_one("SELECT dedup.forget('k1')", &[]).unwrap().get::<_, bool>(0));
    assert_eq!(state(&mut other, "dedup.claim('k1')"), "new");
}

#[test]
fn a_claim_committed_without_complete_or_a_mark_is_completed_without_a_result() {
    let mut c = db("idem_bare");
    assert_eq!(state(&mut c, "dedup.claim('k')"), "new");
    assert_eq!(claim(&mut c, "dedup.claim('k')"), ("completed".into(), None));
    assert!(mark(&mut c, "m"));
    assert_eq!(claim(&mut c, "dedup.claim('m', 'fp')"), ("completed".into(), None));
}

#[test]
fn a_rolled_back_claim_leaves_the_key_free() {
    let mut c = db("idem_rollback");
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('k')"), "new");
    c.batch_execute("SELECT dedup.complete('k', '1'); ROLLBACK").unwrap();
    c.batch_execute("BEGIN; SAVEPOINT s").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('k')"), "new");
    c.batch_execute("ROLLBACK TO SAVEPOINT s").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('k')"), "new", "the rolled-back savepoint took the claim");
    c.batch_execute("COMMIT").unwrap();
}

/// Session A claims `k` and holds its transaction open; session B claims `k` with `b_sql`. Returns B's answer
/// once A ends with `finish`, and whether B had to wait for it.
fn behind_an_open_claim(db_name: &str, b_sql: &'static str, finish: &str) -> ((String, Option<String>), bool) {
    let mut a = db(db_name);
    let mut observer = connect(db_name);
    a.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut a, "dedup.claim('k', 'fp')"), "new");
    a.batch_execute("SELECT dedup.complete('k', '{\"ok\": true}')").unwrap();
    let mut b = connect(db_name);
    b.batch_execute("SET statement_timeout = '20s'").unwrap();
    let pid = backend_pid(&mut b);
    let started = Instant::now();
    let waiter = thread::spawn(move || claim(&mut b, b_sql));
    let blocked = {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if waiter.is_finished() {
                break false;
            }
            // No row: the second session answered and left meanwhile.
            let waiting: String = observer
                .query_opt("SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1", &[&pid])
                .unwrap()
                .map_or(String::new(), |r| r.get(0));
            if waiting == "Lock" {
                break true;
            }
            assert!(Instant::now() < deadline, "the second claim neither answered nor waited");
            thread::sleep(Duration::from_millis(20));
        }
    };
    a.batch_execute(finish).unwrap();
    let answer = waiter.join().expect("the second claim must not fail");
    assert!(started.elapsed() < Duration::from_secs(15));
    (answer, blocked)
}

#[test]
fn a_waiting_claim_answers_with_the_outcome_of_the_claim_it_waited_for() {
    let (answer, blocked) = behind_an_open_claim("idem_wait_commit", "dedup.claim('k', 'fp')", "COMMIT");
    assert!(blocked, "wait => true waits for the holder");
    assert_eq!(answer, ("completed".into(), Some("{\"ok\": true}".into())), "the holder's result");
    let (answer, blocked) = behind_an_open_claim("idem_wait_rollback", "dedup.claim('k', 'fp')", "ROLLBACK");
    assert!(blocked);
    assert_eq!(answer, ("new".into(), None), "the holder rolled back: the waiter holds the key");
}

#[test]
fn a_claim_that_may_not_wait_answers_in_progress_at_once() {
    let (answer, blocked) = behind_an_open_claim("idem_nowait", "dedup.claim('k', 'fp', wait => false)", "COMMIT");
    assert!(!blocked, "wait => false never waits");
    assert_eq!(answer, ("in_progress".into(), None));
}

#[test]
fn eight_sessions_claiming_one_key_get_one_new_and_the_holders_result() {
    let mut c = db("idem_eight");
    c.batch_execute("SELECT 1").unwrap();
    for wait in [true, false] {
        let key = format!("k-{wait}");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
        let sessions: Vec<_> = (0..8)
            .map(|_| {
                let (key, barrier) = (key.clone(), barrier.clone());
                thread::spawn(move || {
                    let mut s = connect("idem_eight");
                    s.batch_execute("SET statement_timeout = '30s'").unwrap();
                    barrier.wait();
                    let mut tx = s.transaction().unwrap();
                    let row = tx
                        .query_one("SELECT state, result::text FROM dedup.claim($1, 'fp', wait => $2)", &[&key, &wait])
                        .unwrap();
                    let answer: (String, Option<String>) = (row.get(0), row.get(1));
                    if answer.0 == "new" {
                        thread::sleep(Duration::from_millis(300)); // the work
                        tx.execute("SELECT dedup.complete($1, '{\"n\": 1}')", &[&key]).unwrap();
                    }
                    tx.commit().unwrap();
                    answer
                })
            })
            .collect();
        let answers: Vec<(String, Option<String>)> = sessions.into_iter().map(|s| s.join().unwrap()).collect();
        let new = answers.iter().filter(|a| a.0 == "new").count();
        assert_eq!(new, 1, "exactly one session holds the key (wait => {wait}): {answers:?}");
        for (state, result) in answers.iter().filter(|a| a.0 != "new") {
            if wait {
                assert_eq!((state.as_str(), result.as_deref()), ("completed", Some("{\"n\": 1}")));
            } else {
                assert!(state == "in_progress" || (state == "completed" && result.as_deref() == Some("{\"n\": 1}")));
            }
        }
    }
}

#[test]
fn a_lease_keeps_a_key_in_progress_across_commits_until_complete_or_it_passes() {
    let mut c = db("idem_lease");
    let mut other = connect("idem_lease");
    other.batch_execute("SET statement_timeout = '5s'").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('pay', 'fp', lease => '30 seconds')"), "new");
    // Committed: the external call is under way. Another claim neither waits nor gets the key.
    assert_eq!(claim(&mut other, "dedup.claim('pay', 'fp')"), ("in_progress".into(), None));
    assert_eq!(claim(&mut other, "dedup.claim('pay', 'fp', wait => false)"), ("in_progress".into(), None));
    c.batch_execute("SELECT dedup.complete('pay', '{\"charge\": \"ch_1\"}')").unwrap();
    assert_eq!(
        claim(&mut other, "dedup.claim('pay', 'fp')"),
        ("completed".into(), Some("{\"charge\": \"ch_1\"}".into()))
    );
    // A lease that passes without complete(): the next claim takes the key over.
    assert_eq!(state(&mut c, "dedup.claim('pay2', 'fp', lease => '1 second')"), "new");
    assert_eq!(state(&mut other, "dedup.claim('pay2', 'fp')"), "in_progress");
    thread::sleep(Duration::from_millis(1200));
    let err = c.batch_execute("SELECT dedup.complete('pay2', '1')").expect_err("the lease passed");
    assert_dedup_error::<()>(Err(err), "55000");
    assert_eq!(state(&mut other, "dedup.claim('pay2', 'fp', lease => '30 seconds')"), "new", "taken over");
    let takeovers: i64 = c
        .query_one("SELECT coalesce(lease_takeovers, 1) FROM dedup.stats WHERE inbox = 'default'", &[])
        .unwrap()
        .get(0);
    assert!(takeovers >= 1);
    // release() gives a key up at once; a completed key is never released.
    assert!(other.query_one("SELECT dedup.release('pay2')", &[]).unwrap().get::<_, bool>(0));
    assert_eq!(state(&mut c, "dedup.claim('pay2', 'fp')"), "new");
    assert!(!c.query_one("SELECT dedup.release('pay')", &[]).unwrap().get::<_, bool>(0), "completed: kept");
    assert!(!c.query_one("SELECT dedup.release('never')", &[]).unwrap().get::<_, bool>(0));
}

#[test]
fn complete_refuses_keys_it_does_not_hold() {
    let mut c = db("idem_complete");
    assert_dedup_error(c.batch_execute("SELECT dedup.complete('never', '1')"), "55000");
    c.batch_execute("SELECT dedup.mark('marked')").unwrap();
    assert_dedup_error(c.batch_execute("SELECT dedup.complete('marked', '1')"), "55000");
    assert_eq!(state(&mut c, "dedup.claim('done')"), "new");
    assert_dedup_error(c.batch_execute("SELECT dedup.complete('done', '1')"), "55000");
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('twice')"), "new");
    c.batch_execute("SELECT dedup.complete('twice', '1')").unwrap();
    assert_dedup_error(c.batch_execute("SELECT dedup.complete('twice', '2')"), "55000");
    c.batch_execute("ROLLBACK").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_default WHERE id = 'never'"), 0, "complete() never creates a key");
}

#[test]
fn a_key_reused_for_another_request_is_refused_with_its_own_sqlstate() {
    let mut c = db("idem_mismatch");
    assert_eq!(state(&mut c, "dedup.claim('k', dedup.fingerprint('{\"amount\": 10}'::jsonb))"), "new");
    let err = c
        .query_one("SELECT * FROM dedup.claim('k', dedup.fingerprint('{\"amount\": 99}'::jsonb))", &[])
        .expect_err("another payload");
    let db_err = err.as_db_error().unwrap();
    assert_eq!(db_err.code().code(), "PD001", "{err}");
    assert!(db_err.message().starts_with("dedup: key \"k\" of inbox \"default\""), "{}", db_err.message());
    let detail = db_err.detail().unwrap_or_default();
    assert!(detail.contains("Stored fingerprint") && detail.contains("this request's"), "{detail}");
    assert!(db_err.hint().is_some());
    // The same payload, however written, is the same request.
    assert_eq!(state(&mut c, "dedup.claim('k', dedup.fingerprint('{ \"amount\":10 }'::jsonb))"), "completed");
    // Under concurrency: the second claim waits for the first, then finds the other fingerprint.
    let mut a = connect("idem_mismatch");
    let mut observer = connect("idem_mismatch");
    a.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut a, "dedup.claim('c', 'A')"), "new");
    let mut b = connect("idem_mismatch");
    let pid = backend_pid(&mut b);
    let waiter = thread::spawn(move || b.query_one("SELECT * FROM dedup.claim('c', 'B')", &[]).map(|_| ()));
    wait_until_blocked(&mut observer, pid);
    a.batch_execute("COMMIT").unwrap();
    let err = waiter.join().unwrap().expect_err("a mismatch after the wait");
    assert_eq!(sqlstate(&err), "PD001");
    let mismatches: i64 = c
        .query_one("SELECT coalesce(fingerprint_mismatches, 2) FROM dedup.stats WHERE inbox = 'default'", &[])
        .unwrap()
        .get(0);
    assert!(mismatches >= 2);
}

#[test]
fn results_up_to_the_limit_are_stored_whole_and_larger_ones_refused() {
    let mut c = db("idem_size");
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('big')"), "new");
    c.batch_execute("SELECT dedup.complete('big', jsonb_build_object('body', repeat('x', 1048576))); COMMIT").unwrap();
    let length: i32 = c.query_one("SELECT length(result->>'body') FROM dedup.claim('big')", &[]).unwrap().get(0);
    assert_eq!(length, 1_048_576, "a 1 MB result comes back whole");
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('huge')"), "new");
    let err = c.batch_execute("SELECT dedup.complete('huge', jsonb_build_object('body', repeat('x', 9000000)))");
    assert_dedup_error(err, "54000");
    c.batch_execute("ROLLBACK").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_default WHERE id = 'huge'"), 0, "nothing half-written");
}

#[test]
fn a_replay_writes_no_wal_and_takes_no_transaction_id() {
    // A server of its own, not preloaded: nothing else writes WAL meanwhile (no other test, no worker).
    let server = Cluster::start(&[]);
    let mut c = server.fresh_db("idem_replay_cost");
    c.batch_execute("ALTER TABLE dedup.inbox_default SET (autovacuum_enabled = false)").unwrap();
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut c, "dedup.claim('r', 'fp')"), "new");
    c.batch_execute("SELECT dedup.complete('r', '{\"x\": 1}'); COMMIT").unwrap();
    // A first read sets the row's hint bits; WAL is counted from then on. VACUUM first: catalog pages holding dead
    // rows (creating the extension leaves some) are pruned by whichever read reaches them first, and that WAL
    // would be no replay's doing.
    assert_eq!(state(&mut c, "dedup.claim('r', 'fp')"), "completed");
    c.batch_execute("VACUUM").unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
    let before: String = c.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).unwrap().get(0);
    c.batch_execute("BEGIN").unwrap();
    for _ in 0..20 {
        assert_eq!(state(&mut c, "dedup.claim('r', 'fp')"), "completed");
    }
    let xid: Option<String> = c.query_one("SELECT txid_current_if_assigned()::text", &[]).unwrap().get(0);
    c.batch_execute("COMMIT").unwrap();
    let after: String = c.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).unwrap().get(0);
    assert_eq!(xid, None, "a replay took a transaction id");
    assert_eq!(before, after, "a replay wrote WAL");
}

#[test]
fn a_holder_killed_mid_transaction_leaves_the_key_free_and_mid_lease_until_the_lease_passes() {
    // A server of its own: killing a backend with SIGKILL makes the postmaster restart every backend.
    let server = Cluster::start(&[]);
    server.fresh_db("idem_killed");
    let mut holder = server.connect("idem_killed");
    holder.batch_execute("BEGIN").unwrap();
    assert_eq!(state(&mut holder, "dedup.claim('tx')"), "new");
    server.crash_backend(backend_pid(&mut holder));
    let mut c = server.connect("idem_killed");
    assert_eq!(state(&mut c, "dedup.claim('tx')"), "new", "the claim vanished with its transaction");
    let mut holder = server.connect("idem_killed");
    assert_eq!(state(&mut holder, "dedup.claim('lease', lease => '2 seconds')"), "new");
    server.crash_backend(backend_pid(&mut holder));
    let mut c = server.connect("idem_killed");
    assert_eq!(state(&mut c, "dedup.claim('lease')"), "in_progress", "the lease outlives its holder");
    thread::sleep(Duration::from_millis(2200));
    assert_eq!(state(&mut c, "dedup.claim('lease')"), "new", "taken over once the lease passed");
}

#[test]
fn claim_arguments_are_checked() {
    let mut c = db("idem_input");
    for (sql, code) in [
        ("SELECT * FROM dedup.claim(NULL)", "22004"),
        ("SELECT * FROM dedup.claim('')", "22023"),
        ("SELECT * FROM dedup.claim('k', '')", "22023"),
        ("SELECT * FROM dedup.claim('k', repeat('f', 1025))", "54000"),
        ("SELECT * FROM dedup.claim('k', NULL, '-1 day')", "22023"),
        ("SELECT * FROM dedup.claim('k', wait => NULL)", "22004"),
        ("SELECT * FROM dedup.claim('k', lease => '0 seconds')", "22023"),
        ("SELECT * FROM dedup.claim('k', NULL, '1 minute', lease => '1 hour')", "22023"),
        ("SELECT * FROM dedup.claim('k', inbox => 'nope')", "42704"),
        ("SELECT dedup.fingerprint(NULL::jsonb)", "22004"),
    ] {
        assert_dedup_error(c.batch_execute(sql), code);
    }
    assert_eq!(count(&mut c, "dedup.inbox_default"), 0);
}
