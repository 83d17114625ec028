//! Nothing a transaction or an inbox owner does may stall pg_dedup: a rebuild never waits for its
//! own transaction, a prepared or long transaction stops neither purging nor filter rotations, a slow trigger on one
//! inbox does not hold up the others' purge, and creating and dropping thousands of inboxes leaves room in shared
//! memory for the next.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[test]
fn a_rebuild_never_waits_for_its_own_transaction() {
    let cluster = preloaded("postgres", &[]);
    let mut c = cluster.fresh_db("stall_own");
    // mark_many()'s multi-insert and a savepoint each give the transaction a subtransaction id of its own.
    c.batch_execute(
        "BEGIN;
         SET LOCAL statement_timeout = '30s';
         SELECT count(*) FROM dedup.mark_many(ARRAY['a1', 'a2', 'a3', 'a4', 'a5', 'a6', 'a7', 'a8', 'a9', 'a10']);
         SAVEPOINT s;
         SELECT dedup.mark('b');
         SELECT dedup.bloom_rebuild();
         COMMIT;",
    )
    .expect("the rebuild waited for its own transaction until statement_timeout");
    assert!(trusted(&mut c, "default"));
    let all: Vec<String> = ["a1", "a5", "a10", "b"].map(String::from).to_vec();
    let seen: i64 =
        c.query_one("SELECT count(*) FROM unnest($1::text[]) u WHERE dedup.seen(u)", &[&all]).unwrap().get(0);
    assert_eq!(seen, 4);
}

fn rebuilds(c: &mut Client) -> i64 {
    c.query_one("SELECT filter_rebuilds FROM dedup.stats LIMIT 1", &[]).unwrap().get(0)
}

#[test]
fn a_prepared_transaction_stops_neither_purging_nor_filter_rotations() {
    // A small filter, so that expired marks soon push its false-positive rate above target and the worker rotates.
    let cluster = preloaded(
        "stall_prepared",
        &["max_prepared_transactions = 2", "dedup.bloom_capacity = 1000", "dedup.purge_interval = 1"],
    );
    let mut c = cluster.fresh_db("stall_prepared");
    wait_trusted(&mut c, "default");
    c.batch_execute("BEGIN; SELECT dedup.mark('held'); PREPARE TRANSACTION 'held'").unwrap();
    let before = rebuilds(&mut c);
    for round in 0..4 {
        c.query("SELECT * FROM dedup.mark_many($1, '1 second')", &[&ids(&format!("short-{round}"), 1500)]).unwrap();
    }
    eventually("the worker rotates the filter though a prepared transaction holds a transaction id", || {
        rebuilds(&mut c) > before
    });
    eventually("the worker purges every expired mark though a prepared transaction is open", || {
        count(&mut c, "dedup.inbox_default") == 0
    });
    c.batch_execute("COMMIT PREPARED 'held'").unwrap();
    assert!(c.query_one("SELECT dedup.seen('held')", &[]).unwrap().get::<_, bool>(0));
}

#[test]
fn a_slow_trigger_on_one_inbox_does_not_stop_the_purge_of_the_others() {
    let cluster = preloaded("stall_slow", &["dedup.purge_interval = 1", "dedup.purge_batch_timeout = '1s'"]);
    let mut c = cluster.fresh_db("stall_slow");
    // Inboxes are purged in name order: the slow one comes first.
    c.batch_execute(
        "SELECT dedup.create_inbox('a_slow'); SELECT dedup.create_inbox('z_fast');
         CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_sleep(30); RETURN OLD; END $$;
         CREATE TRIGGER slow BEFORE DELETE ON dedup.inbox_a_slow FOR EACH ROW EXECUTE FUNCTION slow();
         SELECT dedup.mark_many(ARRAY['s1', 's2', 's3'], '1 second', 'a_slow');
         SELECT dedup.mark_many(ARRAY['f1', 'f2', 'f3'], '1 second', 'z_fast');",
    )
    .unwrap();
    wait_until_expired(&mut c, "dedup.inbox_z_fast", &["f1", "f2", "f3"]);
    eventually("the worker purges the other inbox", || count(&mut c, "dedup.inbox_z_fast") == 0);
    assert_eq!(count(&mut c, "dedup.inbox_a_slow"), 3, "the slow inbox's batches were cancelled, not committed");
    assert!(
        cluster
            .log()
            .contains("purging a batch of inbox \"a_slow\" failed: canceling statement due to statement timeout"),
        "the cancelled batch is logged:\n{}",
        cluster.log()
    );
}

#[test]
fn thousands_of_created_and_dropped_inboxes_leave_room_for_the_next() {
    let cluster = preloaded("stall_churn", &[]);
    let mut c = cluster.fresh_db("stall_churn");
    wait_trusted(&mut c, "default");
    // More inboxes than shared memory has slots (4096), 100 per transaction.
    for batch in 0..45 {
        c.batch_execute(&format!(
            "DO $$ BEGIN
               FOR i IN {from}..{to} LOOP
                 PERFORM dedup.create_inbox('churn_' || i);
                 PERFORM dedup.mark('x', NULL, 'churn_' || i);
                 PERFORM dedup.drop_inbox('churn_' || i);
               END LOOP;
             END $$",
            from = batch * 100,
            to = batch * 100 + 99
        ))
        .unwrap();
    }
    c.batch_execute("SELECT dedup.create_inbox('after_churn')").unwrap();
    wait_trusted(&mut c, "after_churn");
    c.query("SELECT * FROM dedup.mark_many($1, NULL, 'after_churn')", &[&ids("n", 10)]).unwrap();
    let marks: i64 = c.query_one("SELECT marks FROM dedup.stats WHERE inbox = 'after_churn'", &[]).unwrap().get(0);
    assert_eq!(marks, 10, "the new inbox has shared state of its own");
    let loads = cluster.log().matches("into the Bloom filter").count();
    assert!(loads < 20, "the worker kept re-loading inboxes it could not keep: {loads} loads logged");
}
