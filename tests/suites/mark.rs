//! The contract of mark() / mark_many() against a real server: transactional, blocking on concurrent marks of the
//! same id, windowed. Run by tests/mark.rs (no filter) and tests/mark_filtered.rs (the filter answers).

use pg_dedup_tests::*;
use std::collections::HashMap;
use std::thread;

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

#[test]
fn mark_commits_or_rolls_back_with_the_transaction() {
    let mut c = db("tx_atomic");
    let mut tx = c.transaction().unwrap();
    assert!(tx.query_one("SELECT dedup.mark('a')", &[]).unwrap().get::<_, bool>(0));
    tx.rollback().unwrap();
    assert!(mark(&mut c, "a"), "a rolled-back mark must leave nothing behind");
    assert!(!mark(&mut c, "a"), "a committed mark makes the next one a duplicate");
}

#[test]
fn rolled_back_savepoint_undoes_the_mark() {
    let mut c = db("tx_savepoint");
    c.batch_execute("BEGIN; SAVEPOINT s; SELECT dedup.mark('a'); ROLLBACK TO SAVEPOINT s;").unwrap();
    let again: bool = c.query_one("SELECT dedup.mark('a')", &[]).unwrap().get(0);
    c.batch_execute("COMMIT").unwrap();
    assert!(again, "the mark inside the rolled-back savepoint must be undone");
    assert!(!mark(&mut c, "a"));
}

#[test]
fn duplicate_never_aborts_the_callers_transaction() {
    let mut c = db("tx_duplicate");
    c.batch_execute("CREATE TABLE ledger (n int)").unwrap();
    let mut tx = c.transaction().unwrap();
    assert!(tx.query_one("SELECT dedup.mark('a')", &[]).unwrap().get::<_, bool>(0));
    assert!(!tx.query_one("SELECT dedup.mark('a')", &[]).unwrap().get::<_, bool>(0));
    tx.execute("INSERT INTO ledger VALUES (1)", &[]).unwrap();
    tx.commit().unwrap();
    assert_eq!(count(&mut c, "ledger"), 1);
    assert!(!mark(&mut c, "a"));
}

/// Second session marks the id the first one holds uncommitted; returns what its mark() said once released.
fn concurrent_mark(db_name: &str, finish_first: &str, sql: &'static str) -> (bool, bool) {
    let mut first = db(db_name);
    let mut observer = connect(db_name);
    first.batch_execute("BEGIN").unwrap();
    let first_said: bool = first.query_one(sql, &[]).unwrap().get(0);
    let mut second = connect(db_name);
    let pid = backend_pid(&mut second);
    let waiter = thread::spawn(move || second.query_one(sql, &[]).map(|r| r.get::<_, bool>(0)));
    wait_until_blocked(&mut observer, pid);
    first.batch_execute(finish_first).unwrap();
    (first_said, waiter.join().unwrap().expect("the waiting mark() must not fail"))
}

#[test]
fn concurrent_mark_waits_and_is_a_duplicate_if_the_first_commits() {
    let (first, second) = concurrent_mark("block_commit", "COMMIT", "SELECT dedup.mark('x')");
    assert!(first);
    assert!(!second, "the first transaction committed: the waiting mark is a duplicate");
}

#[test]
fn concurrent_mark_waits_and_is_new_if_the_first_rolls_back() {
    let (first, second) = concurrent_mark("block_rollback", "ROLLBACK", "SELECT dedup.mark('x')");
    assert!(first);
    assert!(second, "the first transaction rolled back: the waiting mark claims the id");
}

#[test]
fn concurrent_mark_many_waits_like_mark() {
    let sql = "SELECT count(*) = 2 FROM dedup.mark_many(ARRAY['p', 'q'])";
    let (first, second) = concurrent_mark("block_many_commit", "COMMIT", sql);
    assert!(first);
    assert!(!second);
    let (_, second) = concurrent_mark("block_many_rollback", "ROLLBACK", sql);
    assert!(second);
}

#[test]
fn expired_id_is_new_again_before_it_is_purged() {
    let mut c = db("window_expired");
    assert!(c.query_one("SELECT dedup.mark('e', '1 second')", &[]).unwrap().get::<_, bool>(0));
    wait_until_expired(&mut c, "dedup.inbox_default", &["e"]);
    assert_eq!(count(&mut c, "dedup.inbox_default"), 1, "the expired row is still there (nothing purged it)");
    assert!(c.query_one("SELECT dedup.mark('e', '1 hour')", &[]).unwrap().get::<_, bool>(0), "expired = new");
    assert!(!mark(&mut c, "e"), "renewed: a duplicate again");
    let renewed: bool = c
        .query_one("SELECT expires_at > now() + interval '50 minutes' FROM dedup.inbox_default WHERE id = 'e'", &[])
        .unwrap()
        .get(0);
    assert!(renewed, "the renewal set the new window");
    assert_eq!(count(&mut c, "dedup.inbox_default"), 1, "renewed in place, one row per id");
}

#[test]
fn expired_ids_in_mark_many_are_new_again() {
    let mut c = db("window_expired_many");
    c.batch_execute("SELECT dedup.mark('old', '1 second'); SELECT dedup.mark('live', '1 hour')").unwrap();
    wait_until_expired(&mut c, "dedup.inbox_default", &["old"]);
    let fresh: Vec<String> = c
        .query("SELECT * FROM dedup.mark_many(ARRAY['live', 'old', 'new'])", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(fresh, ["old", "new"]);
}

#[test]
fn duplicate_does_not_extend_the_window() {
    let mut c = db("window_fixed");
    c.batch_execute("SELECT dedup.mark('w', '1 hour')").unwrap();
    let before: String =
        c.query_one("SELECT expires_at::text FROM dedup.inbox_default WHERE id = 'w'", &[]).unwrap().get(0);
    assert!(!c.query_one("SELECT dedup.mark('w', '10 hours')", &[]).unwrap().get::<_, bool>(0));
    let after: String =
        c.query_one("SELECT expires_at::text FROM dedup.inbox_default WHERE id = 'w'", &[]).unwrap().get(0);
    assert_eq!(before, after, "a duplicate sighting must not move the expiry");
}

#[test]
fn null_ttl_means_the_inbox_default() {
    let mut c = db("window_default_ttl");
    c.batch_execute("SELECT dedup.create_inbox('short', '2 hours'); SELECT dedup.mark('a', NULL, 'short')").unwrap();
    c.batch_execute("SELECT dedup.mark('a')").unwrap();
    let expiry_within = |c: &mut pg_dedup_harness::postgres::Client, table: &str, low: &str, high: &str| -> bool {
        let sql = format!(
            "SELECT expires_at BETWEEN now() + interval '{low}' AND now() + interval '{high}' FROM {table} WHERE id = 'a'"
        );
        c.query_one(&sql, &[]).unwrap().get(0)
    };
    assert!(expiry_within(&mut c, "dedup.inbox_short", "119 minutes", "121 minutes"), "the inbox's 2 hours");
    assert!(expiry_within(&mut c, "dedup.inbox_default", "71 hours", "73 hours"), "the default inbox's 3 days");
}

#[test]
fn mark_many_returns_new_ids_once_in_first_occurrence_order() {
    let mut c = db("many_order");
    c.batch_execute("SELECT dedup.mark('c')").unwrap();
    let fresh: Vec<String> = c
        .query("SELECT * FROM dedup.mark_many(ARRAY['b', 'a', 'b', 'c', 'd', 'a'])", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(fresh, ["b", "a", "d"]);
    let empty = c.query("SELECT * FROM dedup.mark_many('{}'::text[])", &[]).unwrap();
    assert!(empty.is_empty());
    assert!(!mark(&mut c, "d"));
}

#[test]
fn read_committed_sees_a_concurrent_commit_as_a_duplicate() {
    let mut c = db("iso_read_committed");
    c.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED; SELECT 1").unwrap();
    let mut other = connect("iso_read_committed");
    assert!(mark(&mut other, "k"));
    let said: bool = c.query_one("SELECT dedup.mark('k')", &[]).unwrap().get(0);
    c.batch_execute("COMMIT").unwrap();
    assert!(!said);
}

#[test]
fn repeatable_read_and_serializable_get_a_serialization_failure_on_a_concurrent_commit() {
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let name = format!("iso_{}", level.replace(' ', "_").to_lowercase());
        let mut c = db(&name);
        // Without interference these levels behave like READ COMMITTED.
        c.batch_execute(&format!("BEGIN ISOLATION LEVEL {level}")).unwrap();
        assert!(c.query_one("SELECT dedup.mark('own')", &[]).unwrap().get::<_, bool>(0));
        assert!(!c.query_one("SELECT dedup.mark('own')", &[]).unwrap().get::<_, bool>(0));
        c.batch_execute("COMMIT").unwrap();
        // A mark committed after our snapshot was taken cannot be seen by us: Postgres reports 40001; the caller
        // retries the transaction, as for any serialization failure, and then sees a duplicate.
        c.batch_execute(&format!("BEGIN ISOLATION LEVEL {level}; SELECT 1")).unwrap();
        let mut other = connect(&name);
        assert!(mark(&mut other, "k"));
        let err = c.query_one("SELECT dedup.mark('k')", &[]).expect_err(&format!("must fail under {level}"));
        assert_eq!(sqlstate(&err), "40001", "{level}: {err}");
        c.batch_execute("ROLLBACK").unwrap();
        assert!(!mark(&mut c, "k"), "{level}: the retry sees the duplicate");
    }
}

#[test]
fn seen_is_read_only_and_honours_expiry_and_inboxes() {
    let mut c = db("seen");
    c.batch_execute("SELECT dedup.create_inbox('other'); SELECT dedup.mark('s', '1 second')").unwrap();
    let row = c.query_one("SELECT dedup.seen('s'), dedup.seen('s', 'other'), dedup.seen('nope')", &[]).unwrap();
    assert_eq!((row.get::<_, bool>(0), row.get::<_, bool>(1), row.get::<_, bool>(2)), (true, false, false));
    c.batch_execute("BEGIN READ ONLY").unwrap();
    assert!(c.query_one("SELECT dedup.seen('s')", &[]).unwrap().get::<_, bool>(0), "seen() works read-only");
    c.batch_execute("COMMIT").unwrap();
    wait_until_expired(&mut c, "dedup.inbox_default", &["s"]);
    assert!(!c.query_one("SELECT dedup.seen('s')", &[]).unwrap().get::<_, bool>(0), "expired marks are not seen");
}

#[test]
fn forget_allows_a_replay() {
    let mut c = db("forget");
    c.batch_execute("SELECT dedup.mark('f')").unwrap();
    assert!(c.query_one("SELECT dedup.forget('f')", &[]).unwrap().get::<_, bool>(0));
    assert!(!c.query_one("SELECT dedup.forget('f')", &[]).unwrap().get::<_, bool>(0), "nothing left to forget");
    assert!(mark(&mut c, "f"), "a forgotten id is processed again");
}

#[test]
fn purge_deletes_expired_marks_only() {
    let mut c = db("purge");
    c.batch_execute(
        "SELECT dedup.create_inbox('other');
         SELECT dedup.mark_many(ARRAY['e1', 'e2', 'e3'], '1 second');
         SELECT dedup.mark_many(ARRAY['o1', 'o2'], '1 second', 'other');
         SELECT dedup.mark_many(ARRAY['l1', 'l2'], '1 hour');",
    )
    .unwrap();
    wait_until_expired(&mut c, "dedup.inbox_default", &["e1", "e2", "e3"]);
    wait_until_expired(&mut c, "dedup.inbox_other", &["o1", "o2"]);
    let capped: i64 = c.query_one("SELECT dedup.purge('default', 2)", &[]).unwrap().get(0);
    assert_eq!(capped, 2, "max_rows caps the work");
    let rest: i64 = c.query_one("SELECT dedup.purge()", &[]).unwrap().get(0);
    assert_eq!(rest, 3, "the remaining expired mark of 'default' and both of 'other'");
    let left: Vec<String> =
        c.query("SELECT id FROM dedup.inbox_default ORDER BY id", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(left, ["l1", "l2"], "live marks stay");
    assert_eq!(count(&mut c, "dedup.inbox_other"), 0);
}

#[test]
fn racing_sessions_claim_each_id_exactly_once() {
    const SESSIONS: usize = 4;
    const ROUNDS: usize = 150;
    db("race").batch_execute("SELECT 1").unwrap();
    let workers: Vec<_> = (0..SESSIONS)
        .map(|s| {
            thread::spawn(move || {
                let mut c = connect("race");
                let mut won = Vec::new();
                for round in 0..ROUNDS {
                    // Overlapping ids in different orders, singles and batches, so sessions contend on every id.
                    let base = round / 3;
                    let mut ids: Vec<String> = (0..8).map(|k| format!("id-{}", (base + k * 7 + s) % 200)).collect();
                    if s % 2 == 1 {
                        ids.reverse();
                    }
                    if round % 2 == 0 {
                        for row in c.query("SELECT * FROM dedup.mark_many($1)", &[&ids]).expect("mark_many") {
                            won.push(row.get::<_, String>(0));
                        }
                    } else {
                        let mut tx = c.transaction().unwrap();
                        let id = &ids[round % ids.len()];
                        if tx.query_one("SELECT dedup.mark($1)", &[id]).expect("mark").get::<_, bool>(0) {
                            won.push(id.clone());
                        }
                        tx.commit().unwrap();
                    }
                }
                won
            })
        })
        .collect();
    let mut claims: HashMap<String, usize> = HashMap::new();
    for w in workers {
        for id in w.join().expect("no session may fail") {
            *claims.entry(id).or_default() += 1;
        }
    }
    let doubled: Vec<_> = claims.iter().filter(|(_, &n)| n > 1).collect();
    assert!(doubled.is_empty(), "ids claimed more than once: {doubled:?}");
    let mut c = connect("race");
    assert_eq!(count(&mut c, "dedup.inbox_default") as usize, claims.len(), "every stored id was claimed once");
}
