//! The filter's one promise, `seen()` never denies a committed mark, in the four places a hostile pass broke it
//! (every way one was found): prepared transactions across a restart, a rebuild run inside an old snapshot, an owner's
//! trigger that rewrites ids, and a filter trigger disabled or left in origin mode (`pg_restore --disable-triggers`);
//! and a fifth that a review found in a change before it landed: a rebuild that skipped marks an open snapshot sees.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::process::Command;

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// How many of `ids` `seen()` denies in `inbox`.
fn denied(c: &mut Client, ids: &[String], inbox: &str) -> i64 {
    c.query_one("SELECT count(*) FROM unnest($1::text[]) AS u(id) WHERE NOT dedup.seen(u.id, $2)", &[&ids, &inbox])
        .unwrap()
        .get(0)
}

fn filter_trigger(c: &mut Client, inbox: &str) -> String {
    c.query_one("SELECT filter_trigger FROM dedup.stats WHERE inbox = $1", &[&inbox]).unwrap().get(0)
}

/// A restart leaves prepared transactions in progress; the load after it must cover their rows, which no snapshot
/// shows, or `COMMIT PREPARED` later commits marks the filter calls certainly new.
fn prepared_marks_survive(restart: impl Fn(&Cluster), db_name: &str) {
    let cluster = preloaded(db_name, &["max_prepared_transactions = 4"]);
    let mut c = cluster.fresh_db(db_name);
    wait_trusted(&mut c, "default");
    let batch = ids("prepared", 20);
    c.batch_execute("BEGIN").unwrap();
    assert!(mark(&mut c, "x"));
    c.query("SELECT * FROM dedup.mark_many($1)", &[&batch]).unwrap();
    c.batch_execute("PREPARE TRANSACTION 'p'").unwrap();
    restart(&cluster);
    let mut c = cluster.connect(db_name);
    wait_trusted(&mut c, "default");
    c.batch_execute("COMMIT PREPARED 'p'").unwrap();
    let mut all = batch.clone();
    all.push("x".into());
    assert_eq!(denied(&mut c, &all, "default"), 0, "seen() denied marks committed from a prepared transaction");
    assert!(!mark(&mut c, "x"));
}

#[test]
fn marks_of_a_prepared_transaction_are_in_the_filter_after_a_restart() {
    prepared_marks_survive(|cluster| cluster.restart(), "fn_prepared_restart");
}

#[test]
fn marks_of_a_prepared_transaction_are_in_the_filter_after_a_crash() {
    prepared_marks_survive(|cluster| cluster.crash_postmaster(), "fn_prepared_crash");
}

/// S1 holds an old snapshot, S2 commits a mark, S1 rebuilds the filter: the rebuild must read the table as it is,
/// not as S1's snapshot shows it.
fn rebuild_in_old_snapshot(isolation: &str, db_name: &str) {
    // The worker looks after another database: only the rebuild below loads this one.
    let cluster = preloaded("postgres", &[]);
    let mut s1 = cluster.fresh_db(db_name);
    s1.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
    assert!(trusted(&mut s1, "default"));
    let mut s2 = cluster.connect(db_name);
    s1.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}; SELECT txid_current()")).unwrap();
    assert!(mark(&mut s2, "x"));
    let batch = ids("later", 20);
    s2.query("SELECT * FROM dedup.mark_many($1)", &[&batch]).unwrap();
    s1.batch_execute("SELECT dedup.bloom_rebuild(); COMMIT").unwrap();
    assert!(trusted(&mut s2, "default"));
    let mut all = batch;
    all.push("x".into());
    assert_eq!(denied(&mut s2, &all, "default"), 0, "the rebuild read through the caller's {isolation} snapshot");
}

#[test]
fn a_rebuild_in_a_repeatable_read_transaction_loads_marks_committed_since() {
    rebuild_in_old_snapshot("REPEATABLE READ", "fn_rebuild_rr");
}

#[test]
fn a_rebuild_in_a_serializable_transaction_loads_marks_committed_since() {
    rebuild_in_old_snapshot("SERIALIZABLE", "fn_rebuild_serializable");
}

/// S1 holds a snapshot that still sees marks S2 deletes after it was taken; a rebuild then, by another session (as
/// the worker's rotation would be) or by S1 itself, must load them: S1's `seen()` answers from its snapshot, and the
/// filter must not call certainly new what that snapshot sees. (A load skips the row versions no snapshot sees.)
#[test]
fn a_rebuild_loads_marks_deleted_since_an_open_snapshot_was_taken() {
    let db_name = "fn_rebuild_deleted";
    // The worker looks after another database: only the rebuilds below load this one.
    let cluster = preloaded("postgres", &[]);
    let mut s1 = cluster.fresh_db(db_name);
    let mut s2 = cluster.connect(db_name);
    let batch = ids("forgotten", 20);
    s2.query("SELECT * FROM dedup.mark_many($1)", &[&batch]).unwrap();
    s2.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
    s1.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ").unwrap();
    assert_eq!(denied(&mut s1, &batch, "default"), 0, "S1's snapshot sees the marks");
    s2.query("SELECT dedup.forget(u.id) FROM unnest($1::text[]) AS u(id)", &[&batch]).unwrap();
    s2.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
    assert!(trusted(&mut s1, "default"));
    assert_eq!(denied(&mut s1, &batch, "default"), 0, "another session's rebuild dropped marks S1's snapshot sees");
    s1.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
    assert!(trusted(&mut s1, "default"));
    assert_eq!(denied(&mut s1, &batch, "default"), 0, "S1's own rebuild dropped marks its snapshot sees");
    s1.batch_execute("COMMIT").unwrap();
    assert_eq!(denied(&mut s2, &batch, "default"), batch.len() as i64, "the marks were deleted");
}

#[test]
fn an_owners_trigger_that_rewrites_ids_cannot_hide_them() {
    let cluster = preloaded("fn_rewrite", &[]);
    let mut c = cluster.fresh_db("fn_rewrite");
    wait_trusted(&mut c, "default");
    // Triggers of one kind fire in name order: one before `dedup_filter`, one after it.
    c.batch_execute(
        "CREATE FUNCTION lower_id() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN NEW.id := lower(NEW.id); RETURN NEW; END $$;
         CREATE FUNCTION suffix_id() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN NEW.id := NEW.id || '!'; RETURN NEW; END $$;
         CREATE TRIGGER a_lower BEFORE INSERT OR UPDATE ON dedup.inbox_default FOR EACH ROW EXECUTE FUNCTION lower_id();
         CREATE TRIGGER z_suffix BEFORE INSERT OR UPDATE ON dedup.inbox_default FOR EACH ROW EXECUTE FUNCTION suffix_id();",
    )
    .unwrap();
    assert!(mark(&mut c, "ABC"));
    c.batch_execute("INSERT INTO dedup.inbox_default VALUES ('DEF', now() + interval '1 hour')").unwrap();
    assert!(trusted(&mut c, "default"), "the filter answers for the inbox");
    let stored: Vec<String> =
        c.query("SELECT id FROM dedup.inbox_default ORDER BY id", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert!(stored.contains(&"abc!".to_owned()), "the triggers rewrote the ids: {stored:?}");
    assert_eq!(denied(&mut c, &stored, "default"), 0, "seen() denied an id as stored");
}

#[test]
fn a_filter_trigger_disabled_and_enabled_again_in_one_transaction_hides_nothing() {
    let cluster = preloaded("fn_toggle", &[]);
    let mut c = cluster.fresh_db("fn_toggle");
    wait_trusted(&mut c, "default");
    c.batch_execute(
        "BEGIN;
         ALTER TABLE dedup.inbox_default DISABLE TRIGGER dedup_filter;
         INSERT INTO dedup.inbox_default SELECT 'quiet-' || g, now() + interval '1 hour' FROM generate_series(0, 99) g;
         ALTER TABLE dedup.inbox_default ENABLE ALWAYS TRIGGER dedup_filter;
         COMMIT;",
    )
    .unwrap();
    let quiet = ids("quiet", 100);
    assert_eq!(denied(&mut c, &quiet, "default"), 0, "seen() denied rows written while the trigger was off");
    // The worker reloads the inbox (its trigger guards again), and then the filter answers for every row.
    wait_trusted(&mut c, "default");
    assert_eq!(denied(&mut c, &quiet, "default"), 0);
    assert!(c.query("SELECT * FROM dedup.mark_many($1)", &[&quiet]).unwrap().is_empty());
}

/// `pg_restore --data-only --disable-triggers` loads rows with every trigger off and ends with `ENABLE TRIGGER
/// ALL`, which leaves `dedup_filter` in origin mode. Where no worker runs, the filter stops answering for the inbox
/// and dedup.stats says why until someone repairs the trigger; where the worker runs, it repairs it and reloads.
#[test]
fn a_restore_with_disabled_triggers_hides_nothing_and_the_trigger_is_repaired() {
    let cluster = preloaded("fn_restore_worker", &[]);
    let mut src = cluster.fresh_db("fn_restore_src");
    src.batch_execute("SELECT dedup.create_inbox('orders')").unwrap();
    let restored = ids("o", 300);
    src.query("SELECT * FROM dedup.mark_many($1, NULL, 'orders')", &[&restored]).unwrap();
    let bindir = pg_dedup_harness::bindir();
    let dump = std::env::temp_dir().join(format!("fn_restore_{}.dump", std::process::id()));
    let out = Command::new(bindir.join("pg_dump"))
        .args(["-Fc", "--data-only", "-t", "dedup.inbox_orders", "-f", dump.to_str().unwrap()])
        .args(["-d", &cluster.conn_string("fn_restore_src", "postgres")])
        .output()
        .unwrap();
    assert!(out.status.success(), "pg_dump: {}", String::from_utf8_lossy(&out.stderr));
    for (db_name, served) in [("fn_restore_unserved", false), ("fn_restore_worker", true)] {
        let mut c = cluster.fresh_db(db_name);
        c.batch_execute("SELECT dedup.create_inbox('orders'); SELECT dedup.bloom_rebuild()").unwrap();
        assert!(trusted(&mut c, "orders"));
        let out = Command::new(bindir.join("pg_restore"))
            .args(["--data-only", "--disable-triggers", "-d", &cluster.conn_string(db_name, "postgres")])
            .arg(&dump)
            .output()
            .unwrap();
        assert!(out.status.success(), "pg_restore: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(denied(&mut c, &restored, "orders"), 0, "seen() denied restored rows ({db_name})");
        if served {
            eventually("the worker repairs the trigger", || filter_trigger(&mut c, "orders") == "ok");
            wait_trusted(&mut c, "orders");
            assert_eq!(denied(&mut c, &restored, "orders"), 0);
            assert!(cluster.log().contains("repaired the dedup_filter trigger of dedup.inbox_orders"));
        } else {
            assert_eq!(filter_trigger(&mut c, "orders"), "enabled on origin only");
            assert!(!trusted(&mut c, "orders"), "the filter must not answer for an inbox its trigger no longer guards");
            c.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
            assert!(!trusted(&mut c, "orders"), "a rebuild must not trust it either");
            c.batch_execute("ALTER TABLE dedup.inbox_orders ENABLE ALWAYS TRIGGER dedup_filter").unwrap();
            c.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
            assert!(trusted(&mut c, "orders"));
            assert_eq!(denied(&mut c, &restored, "orders"), 0);
        }
    }
    let _ = std::fs::remove_file(&dump);
    let told = cluster.log().matches("stops answering for dedup.inbox_orders").count();
    assert!((1..=4).contains(&told), "the log says so once per change of the trigger, not every second: {told}");
}
