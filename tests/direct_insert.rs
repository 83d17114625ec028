//! The direct insert (preloaded servers): ids the filter calls certainly new go straight into the heap and
//! indexes — a batch by one multi-insert, fewer ids by speculative insertion — without the executor and without
//! firing the table's filter trigger; and anything it cannot vouch for (a concurrent claim of the same id, another
//! trigger on the table) goes the ordinary way, with the same answers.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;

/// A fresh database on a preloaded server that counts calls of C functions (so a test can tell whether the filter
/// trigger ran, i.e. whether the executor wrote the rows).
fn server(db: &str) -> (Cluster, Client) {
    let cluster = preloaded(db, &["track_functions = 'all'"]);
    let mut client = cluster.fresh_db(db);
    wait_trusted(&mut client, "default");
    (cluster, client)
}

/// How often the filter trigger has run in the current transaction.
fn trigger_calls(c: &mut Client) -> i64 {
    c.query_one(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_xact_user_functions WHERE funcname = 'inbox_filter_trigger'",
        &[],
    )
    .unwrap()
    .get(0)
}

fn mark_many(c: &mut Client, ids: &[&str], inbox: &str) -> Vec<String> {
    c.query("SELECT * FROM dedup.mark_many($1, NULL, $2)", &[&ids, &inbox]).unwrap().iter().map(|r| r.get(0)).collect()
}

/// `n` ids `prefix-0`, `prefix-1`, ...: enough for the bulk insert from 8 on.
fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

fn strs(ids: &[String]) -> Vec<&str> {
    ids.iter().map(String::as_str).collect()
}

#[test]
fn certainly_new_ids_bypass_the_executor_and_still_reach_the_filter() {
    let (cluster, mut c) = server("bulk_fast");
    let batch = ids("n", 200);
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(mark_many(&mut c, &strs(&batch), "default").len(), 200);
    assert_eq!(trigger_calls(&mut c), 0, "the bulk insert wrote the rows, not the executor");
    // A single id goes in by speculative insertion, without the executor either (and without a subtransaction).
    assert!(mark(&mut c, "single"));
    assert_eq!(trigger_calls(&mut c), 0, "the speculative insertion wrote the row, not the executor");
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_default"), 201);
    // The filter knows every id: all are "maybe" now, and duplicates.
    assert!(mark_many(&mut c, &strs(&batch), "default").is_empty());
    let certain: i64 =
        c.query_one("SELECT certainly_new FROM dedup.stats WHERE inbox = 'default'", &[]).unwrap().get(0);
    assert_eq!(certain, 201, "the second call found every id in the filter");
    assert_no_resource_leaks(&cluster);
}

/// Session A marks `hidden` and holds its transaction open; session B marks ten new ids and `hidden` in one call.
/// B's lookup cannot see A's row, so all eleven go to the multi-insert, whose unique check waits for A. Returns B's
/// new ids, the rows of the table afterwards, and how often B's executor fired the filter trigger.
fn batch_behind_an_open_claim(db: &str, finish_first: &str) -> (Vec<String>, i64, i64) {
    let (cluster, mut first) = server(db);
    let mut observer = cluster.connect(db);
    first.batch_execute("BEGIN").unwrap();
    assert!(mark(&mut first, "hidden"));
    let mut second = cluster.connect(db);
    let pid = backend_pid(&mut second);
    let waiter = std::thread::spawn(move || {
        let new = ids("new", 10);
        let mut call = strs(&new);
        call.insert(5, "hidden");
        second.batch_execute("BEGIN; CREATE TABLE ledger (id text)").unwrap();
        let said = mark_many(&mut second, &call, "default");
        let calls = trigger_calls(&mut second);
        // The caller's transaction goes on unharmed after the undone batch.
        second.batch_execute("INSERT INTO ledger VALUES ('done'); COMMIT").unwrap();
        assert_eq!(count(&mut second, "ledger"), 1);
        (said, calls)
    });
    wait_until_blocked(&mut observer, pid);
    first.batch_execute(finish_first).unwrap();
    let (said, calls) = waiter.join().expect("the waiting mark_many() must not fail");
    assert_no_resource_leaks(&cluster);
    (said, count(&mut observer, "dedup.inbox_default"), calls)
}

#[test]
fn a_batch_that_meets_a_concurrent_claim_is_undone_and_goes_id_by_id() {
    // A commits: the unique check raises unique_violation, the batch is undone, and the ids are tried on their own
    // in sorted order up to the first that has a row, `hidden` (the first of them): that one and all after it take
    // the ordinary way, in order, so this claim never holds a greater id while it waits for a smaller one.
    let (said, rows, calls) = batch_behind_an_open_claim("bulk_fallback_commit", "COMMIT");
    assert_eq!(said, ids("new", 10), "every new id, and not `hidden`");
    assert_eq!(rows, 11, "one row per id, none twice");
    assert_eq!(calls, 10, "after the conflict, the ten new ids were written by the executor");
    // A rolls back: the unique check finds nothing once A is gone, and the batch goes through whole.
    let (said, rows, calls) = batch_behind_an_open_claim("bulk_fallback_rollback", "ROLLBACK");
    let mut all = ids("new", 10);
    all.insert(5, "hidden".to_owned());
    assert_eq!(said, all);
    assert_eq!(rows, 11);
    assert_eq!(calls, 0, "the batch wrote every row");
}

/// Session A marks `x` directly and holds its transaction open; session B then marks `x`. B's filter says "maybe"
/// (A set the bits), B's lookup sees no committed row, so B tries the speculative insertion: the unique index holds
/// A's entry, B's row is killed on the spot and B's ordinary claim waits for A. Returns B's answer and how often
/// B's executor fired the filter trigger (it fires only for a row the executor wrote).
fn claim_behind_an_open_direct_insert(db: &str, finish_first: &str) -> (bool, i64) {
    let (cluster, mut first) = server(db);
    let mut observer = cluster.connect(db);
    first.batch_execute("BEGIN").unwrap();
    assert!(mark(&mut first, "x"));
    assert_eq!(trigger_calls(&mut first), 0, "the first mark went in directly");
    let mut second = cluster.connect(db);
    let pid = backend_pid(&mut second);
    let waiter = std::thread::spawn(move || {
        second.batch_execute("BEGIN").unwrap();
        let said = mark(&mut second, "x");
        let calls = trigger_calls(&mut second);
        second.batch_execute("COMMIT").unwrap();
        (said, calls)
    });
    wait_until_blocked(&mut observer, pid);
    first.batch_execute(finish_first).unwrap();
    let answer = waiter.join().expect("the waiting mark() must not fail");
    assert_eq!(count(&mut observer, "dedup.inbox_default"), 1, "one row for x, whoever won");
    answer
}

#[test]
fn a_concurrent_claim_of_the_same_id_waits_behind_a_speculative_insertion() {
    let (second, executor_calls) = claim_behind_an_open_direct_insert("spec_commit", "COMMIT");
    assert!(!second, "the first transaction committed: the waiting mark is a duplicate");
    assert_eq!(executor_calls, 0, "a duplicate writes no row");
    let (second, executor_calls) = claim_behind_an_open_direct_insert("spec_rollback", "ROLLBACK");
    assert!(second, "the first transaction rolled back: the waiting mark claims the id");
    assert_eq!(executor_calls, 1, "the killed speculative row sent the second claim the ordinary way, which wrote it");
}

#[test]
fn an_inbox_with_another_trigger_is_written_by_the_executor() {
    let (_cluster, mut c) = server("bulk_triggers");
    c.batch_execute(
        "SELECT dedup.create_inbox('audited');
         CREATE TABLE audit (id text);
         CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO audit VALUES (NEW.id); RETURN NEW; END $$;
         CREATE TRIGGER audit AFTER INSERT ON dedup.inbox_audited FOR EACH ROW EXECUTE FUNCTION audit();",
    )
    .unwrap();
    let batch = ids("x", 20);
    assert_eq!(mark_many(&mut c, &strs(&batch), "audited"), batch);
    assert_eq!(count(&mut c, "audit"), 20, "the user's trigger saw every row");
}

#[test]
fn an_inbox_table_its_owner_reshaped_is_written_by_the_executor() {
    let (_cluster, mut c) = server("bulk_reshaped");
    c.batch_execute(
        "SELECT dedup.create_inbox('reshaped');
         ALTER TABLE dedup.inbox_reshaped NOT OF;
         ALTER TABLE dedup.inbox_reshaped ADD COLUMN note text DEFAULT 'from the default';",
    )
    .unwrap();
    let batch = ids("r", 20);
    assert_eq!(mark_many(&mut c, &strs(&batch), "reshaped"), batch);
    let defaulted: i64 =
        c.query_one("SELECT count(*) FROM dedup.inbox_reshaped WHERE note = 'from the default'", &[]).unwrap().get(0);
    assert_eq!(defaulted, 20, "every row got the column's default");
}

#[test]
fn bulk_inserted_marks_belong_to_the_transaction() {
    let (_cluster, mut c) = server("bulk_tx");
    let (first, second, third) = (ids("p", 10), ids("q", 10), ids("r", 10));
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(mark_many(&mut c, &strs(&first), "default").len(), 10);
    assert_eq!(count(&mut c, "dedup.inbox_default"), 10, "later statements see the rows");
    assert!(c.query_one("SELECT dedup.seen('p-3')", &[]).unwrap().get::<_, bool>(0));
    assert!(!mark(&mut c, "p-4"));
    c.batch_execute("SAVEPOINT s").unwrap();
    assert_eq!(mark_many(&mut c, &strs(&second), "default").len(), 10);
    c.batch_execute("ROLLBACK TO SAVEPOINT s").unwrap();
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_default"), 10);
    assert_eq!(mark_many(&mut c, &strs(&second), "default").len(), 10, "the rolled-back savepoint took its marks");
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(mark_many(&mut c, &strs(&third), "default").len(), 10);
    c.batch_execute("ROLLBACK").unwrap();
    assert_eq!(mark_many(&mut c, &strs(&third), "default").len(), 10);
}

#[test]
fn a_transaction_that_marks_in_a_loop_does_not_overflow_the_subtransaction_cache() {
    let (_cluster, mut c) = server("bulk_loop");
    c.batch_execute("BEGIN").unwrap();
    let fresh: i64 = c
        .query_one(
            "SELECT sum((SELECT count(*) FROM dedup.mark_many(array(SELECT 'loop-' || b || '-' || g
                                                                  FROM generate_series(1, 10) g))))::int8
             FROM generate_series(1, 100) b",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(fresh, 1000);
    assert_subtransaction_cache_has_room(&mut c, "a loop of mark_many()", 1);
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_default"), 1000);
}

#[test]
fn a_purge_of_many_batches_does_not_overflow_the_subtransaction_cache() {
    let (_cluster, mut c) = server("bulk_purge");
    // 40 batches of dedup.purge() (10,000 rows each). On an inbox table as create_inbox() made it, the batches delete
    // straight from the heap, with no subtransaction at all; a table that needs the executor takes a quick attempt
    // per batch, in a subtransaction.
    c.batch_execute(
        "INSERT INTO dedup.inbox_default SELECT 'expired-' || g, now() - interval '1 hour'
         FROM generate_series(1, 400000) g",
    )
    .unwrap();
    c.batch_execute("BEGIN").unwrap();
    let purged: i64 = c.query_one("SELECT dedup.purge()", &[]).unwrap().get(0);
    assert_eq!(purged, 400_000);
    assert_subtransaction_cache_has_room(&mut c, "dedup.purge()", 0);
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_default"), 0);
}

/// Our subtransactions (the bulk insert's, purge's quick attempts) keep their ids in the backend's cache until
/// commit; it holds 64, and we stop at 32 (and `after` took at least `at_least`). Postgres shows the count from
/// version 16 on (the guard is the same code on every version).
fn assert_subtransaction_cache_has_room(c: &mut Client, after: &str, at_least: i32) {
    let version: i32 = c.query_one("SELECT current_setting('server_version_num')::int", &[]).unwrap().get(0);
    if version < 160000 {
        return;
    }
    let row = c
        .query_one(
            "SELECT s.subxact_count, s.subxact_overflowed
             FROM pg_stat_get_backend_idset() b, pg_stat_get_backend_subxact(b) s
             WHERE pg_stat_get_backend_pid(b) = pg_backend_pid()",
            &[],
        )
        .unwrap();
    let (subxids, overflowed): (i32, bool) = (row.get(0), row.get(1));
    assert!(
        (at_least..=32).contains(&subxids) && !overflowed,
        "{after}: {subxids} subtransactions kept, overflowed {overflowed}"
    );
}

fn mark_in(c: &mut Client, id: &str, inbox: &str) -> bool {
    c.query_one("SELECT dedup.mark($1, NULL, $2)", &[&id, &inbox]).unwrap().get(0)
}

/// A transaction writes an inbox through one handle (src/direct/handle.rs) that holds no reference between writes:
/// its own DDL on the inbox, which PostgreSQL refuses while a reference is open ("being used by active queries"),
/// runs between two marks, and the next mark sees what it changed (a new index gets its entry, a truncated table
/// its new file). A savepoint rolled back after the first write of an inbox takes that inbox's handle with it.
#[test]
fn a_transaction_writes_through_one_handle_and_sees_its_own_ddl() {
    let (cluster, mut c) = server("one_handle");
    // A BRIN index keeps buffers pinned between insertions of one command (PostgreSQL 17 on): they must not outlive
    // it, nor the subtransaction that took them.
    c.batch_execute(
        "SELECT dedup.create_inbox('h'); SELECT dedup.create_inbox('h2');
         CREATE INDEX h2_brin ON dedup.inbox_h2 USING brin (expires_at)",
    )
    .unwrap();
    wait_trusted(&mut c, "h");
    wait_trusted(&mut c, "h2");
    c.batch_execute("BEGIN").unwrap();
    assert!(mark_in(&mut c, "a", "h"));
    c.batch_execute("CREATE INDEX h_doubled ON dedup.inbox_h ((id || id))").unwrap();
    assert!(mark_in(&mut c, "b", "h"));
    c.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off").unwrap();
    for id in ["aa", "bb"] {
        let found = c.query("SELECT id FROM dedup.inbox_h WHERE id || id = $1", &[&id]).unwrap();
        assert_eq!(found.len(), 1, "the index made between the marks has the entry of {id}");
    }
    c.batch_execute("RESET enable_seqscan; RESET enable_bitmapscan; TRUNCATE dedup.inbox_h").unwrap();
    assert!(mark_in(&mut c, "a", "h"), "new again after the truncate");
    assert!(!mark_in(&mut c, "a", "h"));
    c.batch_execute("SAVEPOINT s").unwrap();
    assert!(mark_in(&mut c, "x", "h2"));
    c.batch_execute("ROLLBACK TO SAVEPOINT s").unwrap();
    assert!(mark_in(&mut c, "y", "h2"));
    assert!(mark_in(&mut c, "x", "h2"), "the rolled-back mark is gone");
    let batch = ids("brin", 20);
    assert_eq!(mark_many(&mut c, &strs(&batch), "h2").len(), 20);
    assert_eq!(trigger_calls(&mut c), 0, "every mark was written directly");
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_h"), 1);
    assert_eq!(count(&mut c, "dedup.inbox_h2"), 22);
    assert_no_resource_leaks(&cluster);
}

/// A write handle outlives its transaction (src/direct/handle.rs): the next transaction takes its locks again, which
/// processes what other sessions changed meanwhile, and a handle whose table or indexes changed is set up anew. A
/// handle that wrote through a dropped index, missed a new one or kept a rewritten table's old file would crash,
/// fail or leave an index without the new row.
#[test]
fn a_handle_kept_across_transactions_sees_what_others_changed_meanwhile() {
    let (cluster, mut c) = server("kept_handle");
    let mut other = cluster.connect("kept_handle");
    c.batch_execute("SELECT dedup.create_inbox('kept')").unwrap();
    wait_trusted(&mut c, "kept");
    let by_index = |c: &mut Client, doubled: &str| -> i64 {
        c.batch_execute("BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off").unwrap();
        let n = c.query_one("SELECT count(*) FROM dedup.inbox_kept WHERE id || id = $1", &[&doubled]).unwrap().get(0);
        c.batch_execute("COMMIT").unwrap();
        n
    };
    assert!(mark_in(&mut c, "a", "kept"));
    other.batch_execute("CREATE INDEX kept_doubled ON dedup.inbox_kept ((id || id))").unwrap();
    assert!(mark_in(&mut c, "b", "kept"));
    assert_eq!(by_index(&mut c, "bb"), 1, "the index another session made meanwhile has the new row");
    other.batch_execute("DROP INDEX dedup.kept_doubled").unwrap();
    other.batch_execute("VACUUM FULL dedup.inbox_kept").unwrap();
    assert!(mark_in(&mut c, "c", "kept"), "written without the dropped index, into the rewritten table");
    assert!(!mark_in(&mut c, "b", "kept"));
    // In a transaction of its own, the handle holds the locks an INSERT would: on the table and on each index.
    c.batch_execute("BEGIN").unwrap();
    assert!(mark_in(&mut c, "d", "kept"));
    let locked: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_class r ON r.oid = l.relation
              WHERE l.pid = pg_backend_pid() AND l.granted AND l.mode = 'RowExclusiveLock'
                AND r.relname IN ('inbox_kept', 'inbox_kept_pkey', 'inbox_kept_expires_at_idx')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(locked, 3, "the table and both indexes are locked again in the new transaction");
    assert_eq!(trigger_calls(&mut c), 0, "the mark was written through the handle, not by the executor");
    c.batch_execute("COMMIT").unwrap();
    other.batch_execute("SELECT dedup.drop_inbox('kept'); SELECT dedup.create_inbox('kept')").unwrap();
    wait_trusted(&mut c, "kept");
    assert!(mark_in(&mut c, "a", "kept"), "the inbox made again is empty");
    assert_eq!(count(&mut c, "dedup.inbox_kept"), 1);
    assert_no_resource_leaks(&cluster);
}

/// Write handles live as long as the backend (src/direct/handle.rs), so nothing a write leaves in them may pile
/// up: not what an index access method caches between insertions (BRIN's descriptor, built again for every use
/// from PostgreSQL 17 on), not a handle per inbox beyond the few kept, not the compiled expressions of an
/// expression index (its table's handle is kept for one transaction only). Marks one new id per transaction, as a
/// pooled consumer does, in inboxes with such indexes and in more inboxes than handles are kept.
#[test]
fn write_handles_leave_no_memory_behind_across_transactions() {
    let (_cluster, mut c) = server("handle_memory");
    let inboxes: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
    for inbox in &inboxes {
        c.batch_execute(&format!("SELECT dedup.create_inbox('{inbox}')")).unwrap();
    }
    c.batch_execute(
        "CREATE INDEX ON dedup.inbox_m0 USING brin (expires_at);
         CREATE INDEX ON dedup.inbox_m1 ((lower(id)));
         CREATE INDEX ON dedup.inbox_m2 (expires_at) WHERE fingerprint IS NOT NULL",
    )
    .unwrap();
    for inbox in &inboxes {
        wait_trusted(&mut c, inbox);
    }
    let pid = backend_pid(&mut c);
    let mut next = 0;
    let mut round = |c: &mut Client| {
        for _ in 0..600 {
            next += 1;
            for inbox in &inboxes[..3] {
                assert!(mark_in(c, &format!("id-{next}"), inbox));
            }
            if next % 20 == 0 {
                for inbox in &inboxes[3..] {
                    assert!(mark_in(c, &format!("id-{next}"), inbox));
                }
            }
        }
    };
    round(&mut c);
    let after_first = anonymous_bytes(pid);
    round(&mut c);
    round(&mut c);
    let growth = anonymous_bytes(pid).saturating_sub(after_first);
    assert!(growth < 1 << 20, "3,600 more marks kept {} kB of this backend's memory", growth / 1024);
    // The backend's memory contexts are shown from PostgreSQL 14 on.
    let version: i32 = c.query_one("SELECT current_setting('server_version_num')::int", &[]).unwrap().get(0);
    if version >= 140000 {
        let handles: i64 = c
            .query_one("SELECT count(*) FROM pg_backend_memory_contexts WHERE name = 'pg_dedup write handle'", &[])
            .unwrap()
            .get(0);
        assert!(handles <= 16, "{handles} write handles kept");
    }
}

/// A rollback to a savepoint can release locks taken before the savepoint: a cursor's, whose portal it aborts
/// (the cursor failed inside it). The next mark of the inbox must take its lock again, not trust an earlier open
/// of the same transaction (`inbox::cache`) or write through a handle set up under that lock (`direct::handle`).
#[test]
fn a_mark_after_a_cursor_rolled_back_holds_its_lock_again() {
    let (cluster, mut c) = server("cursor_locks");
    c.batch_execute("SELECT dedup.create_inbox('cur')").unwrap();
    wait_trusted(&mut c, "cur");
    let locked = |c: &mut Client| -> i64 {
        c.query_one(
            "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND granted
               AND relation = 'dedup.inbox_cur'::regclass AND mode = 'RowExclusiveLock'",
            &[],
        )
        .unwrap()
        .get(0)
    };
    c.batch_execute(
        "BEGIN;
         DECLARE c CURSOR FOR
           SELECT CASE WHEN i = 2 THEN 1 / (i - 2) = 0 ELSE dedup.mark('k' || i, NULL, 'cur') END
           FROM generate_series(1, 2) i;
         FETCH 1 FROM c;",
    )
    .unwrap();
    assert_eq!(locked(&mut c), 1, "the cursor's mark locked the inbox");
    c.batch_execute("SAVEPOINT s").unwrap();
    assert!(c.batch_execute("FETCH 1 FROM c").is_err(), "the cursor fails on its second row");
    // Back in the transaction's own subtransaction, where the cursor's mark ran.
    c.batch_execute("ROLLBACK TO SAVEPOINT s; RELEASE SAVEPOINT s").unwrap();
    assert_eq!(locked(&mut c), 0, "the rollback released the cursor's lock");
    // A duplicate: the mark writes nothing, so only the open can take the lock (a write would take it too).
    assert!(!mark_in(&mut c, "k1", "cur"));
    assert_eq!(locked(&mut c), 1, "the mark after it holds the lock again");
    assert!(mark_in(&mut c, "y", "cur"));
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut c, "dedup.inbox_cur"), 2);
    assert_no_resource_leaks(&cluster);
}
