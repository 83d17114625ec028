//! Distributed inboxes on a real three-node Citus cluster (a coordinator and two workers on this machine).
//! Needs Citus installed into the PostgreSQL under test (scripts/setup.sh builds it into PostgreSQL 18 from
//! ../shared/vendor/citus-14.0.1.tar.gz, or CITUS_SOURCE); without it every test here says so and passes.

use pg_dedup_harness::citus::{self, CitusCluster};
use pg_dedup_harness::postgres::{self, Client};
use pg_dedup_tests::{connect_keeping_notices, eventually, sqlstate};
use std::collections::HashMap;
use std::sync::{Arc, Barrier, OnceLock};
use std::thread;
use std::time::Duration;

/// The databases whose pg_dedup worker runs on every node (the test that watches the worker purge uses it).
const DATABASES: &str = "purge_worker";

static CLUSTER: OnceLock<Option<CitusCluster>> = OnceLock::new();

extern "C" fn destroy_cluster() {
    if let Some(Some(cluster)) = CLUSTER.get() {
        cluster.destroy();
    }
}

/// The cluster shared by this binary's tests (each takes its own database), or None when Citus is not installed.
fn cluster() -> Option<&'static CitusCluster> {
    CLUSTER
        .get_or_init(|| {
            if !citus::available() {
                let why = "Citus is not installed into this PostgreSQL; scripts/setup.sh builds it into PostgreSQL 18 \
                           when ../shared/vendor/citus-14.0.1.tar.gz (or CITUS_SOURCE) is there";
                // CI sets it where Citus must be there (PostgreSQL 16 and later): a missing build fails, not skips.
                let required = std::env::var("PG_DEDUP_REQUIRE_CITUS").is_ok_and(|v| v == "1");
                assert!(!(required && pg_dedup_harness::major(&pg_dedup_harness::pg_config()) >= 16), "{why}");
                eprintln!("SKIPPED (tests/citus.rs): {why}");
                return None;
            }
            // SAFETY: registering a plain extern "C" function with no captured state.
            unsafe { libc::atexit(destroy_cluster) };
            Some(CitusCluster::start(DATABASES, &[]))
        })
        .as_ref()
}

/// The server's message of an error.
fn message(err: &postgres::Error) -> String {
    err.as_db_error().map(|e| e.message().to_owned()).unwrap_or_else(|| err.to_string())
}

/// A fresh database on every node with inbox `orders` distributed from the coordinator; the coordinator's connection.
fn distributed_db(cluster: &CitusCluster, name: &str) -> Client {
    let mut c = cluster.fresh_db(name);
    c.batch_execute("SELECT dedup.create_inbox('orders', '1 hour'); SELECT dedup.distribute_inbox('orders')")
        .expect("distribute_inbox");
    c
}

fn mark(c: &mut Client, id: &str) -> bool {
    c.query_one("SELECT dedup.mark($1, inbox => 'orders')", &[&id]).expect("mark").get(0)
}

fn seen(c: &mut Client, id: &str) -> bool {
    c.query_one("SELECT dedup.seen($1, inbox => 'orders')", &[&id]).expect("seen").get(0)
}

/// Rows in the shards of distributed table `table`, counted on the workers that hold them.
fn rows_in_shards(c: &mut Client, table: &str) -> i64 {
    c.query_one(
        "SELECT coalesce(sum(result::bigint), 0)::bigint FROM run_command_on_shards($1::text::regclass, 'SELECT count(*) FROM %s')",
        &[&table],
    )
    .expect("count rows in shards")
    .get(0)
}

/// Bytes in the coordinator's own heap of `table` (its shell, which no write may reach: Citus holds the rows).
fn shell_bytes(c: &mut Client, table: &str) -> i64 {
    c.query_one("SELECT pg_relation_size($1::text::regclass)", &[&table]).expect("shell size").get(0)
}

#[test]
fn a_distributed_inbox_keeps_the_whole_contract() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "contract");
    let distributed: bool =
        c.query_one("SELECT distributed FROM dedup.inboxes WHERE name = 'orders'", &[]).unwrap().get(0);
    assert!(distributed, "dedup.inboxes shows the inbox as distributed");

    assert!(mark(&mut c, "o1"), "first mark");
    assert!(!mark(&mut c, "o1"), "second mark");
    assert!(seen(&mut c, "o1"), "seen right after (the issue's reproduction answered false here)");
    assert!(!seen(&mut c, "o2"));
    let new: Vec<String> = c
        .query("SELECT * FROM dedup.mark_many(ARRAY['o1', 'o2', 'o3', 'o2', 'o4'], inbox => 'orders')", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(new, ["o2", "o3", "o4"], "mark_many: the new ids, each once, in order");
    assert_eq!(rows_in_shards(&mut c, "dedup.inbox_orders"), 4, "the marks live in the shards");

    // A rolled-back mark leaves nothing, on whichever worker it went to.
    c.batch_execute("BEGIN; SELECT dedup.mark('r1', inbox => 'orders'); ROLLBACK").unwrap();
    assert!(!seen(&mut c, "r1"));
    assert!(mark(&mut c, "r1"));

    let forgot: bool = c.query_one("SELECT dedup.forget('o3', 'orders')", &[]).unwrap().get(0);
    assert!(forgot && !seen(&mut c, "o3") && mark(&mut c, "o3"), "forget, then the id is new again");

    // Idempotency keys: a claim and its stored result, a fingerprint mismatch, a lease, a release.
    let claim = |c: &mut Client, id: &str, fp: Option<&str>| -> (String, Option<String>) {
        let row = c
            .query_one(
                "SELECT state, result::text FROM dedup.claim($1, fingerprint => $2, inbox => 'orders')",
                &[&id, &fp],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    c.batch_execute("BEGIN").unwrap();
    assert_eq!(claim(&mut c, "k1", Some("fp-a")).0, "new");
    c.batch_execute(r#"SELECT dedup.complete('k1', '{"status": 201}', 'orders'); COMMIT"#).unwrap();
    assert_eq!(claim(&mut c, "k1", Some("fp-a")), ("completed".to_owned(), Some(r#"{"status": 201}"#.to_owned())));
    let err =
        c.query_one("SELECT * FROM dedup.claim('k1', fingerprint => 'fp-b', inbox => 'orders')", &[]).unwrap_err();
    assert!(message(&err).contains("dedup:"), "{err:?}");
    assert_ne!(sqlstate(&err), "23505");
    let state: String =
        c.query_one("SELECT state FROM dedup.claim('l1', lease => '1 hour', inbox => 'orders')", &[]).unwrap().get(0);
    assert_eq!(state, "new");
    let mut other = cluster.coordinator.connect("contract");
    assert_eq!(claim(&mut other, "l1", None).0, "in_progress", "a live lease, seen from another session");
    c.batch_execute(r#"SELECT dedup.complete('l1', '"done"', 'orders')"#).unwrap();
    assert_eq!(claim(&mut other, "l1", None), ("completed".to_owned(), Some(r#""done""#.to_owned())));
    // Another transaction's uncommitted claim, answered without waiting; then released.
    c.batch_execute("BEGIN; SELECT * FROM dedup.claim('w1', inbox => 'orders')").unwrap();
    let state: String =
        other.query_one("SELECT state FROM dedup.claim('w1', inbox => 'orders', wait => false)", &[]).unwrap().get(0);
    assert_eq!(state, "in_progress");
    let released: bool = c.query_one("SELECT dedup.release('w1', 'orders')", &[]).unwrap().get(0);
    assert!(released);
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(claim(&mut other, "w1", None).0, "new", "released");

    // Expired marks go with purge(); live ones stay.
    c.batch_execute(
        "SELECT dedup.mark_many(array(SELECT 'e' || g FROM generate_series(1, 500) g), '1 millisecond', 'orders')",
    )
    .unwrap();
    thread::sleep(Duration::from_millis(20));
    let purged: i64 = c.query_one("SELECT dedup.purge('orders')", &[]).unwrap().get(0);
    assert_eq!(purged, 500);
    assert!(seen(&mut c, "o1"));

    let row =
        c.query_one("SELECT marks, duplicates, filter_trigger FROM dedup.stats WHERE inbox = 'orders'", &[]).unwrap();
    assert!(row.get::<_, i64>(0) > 0 && row.get::<_, i64>(1) > 0, "dedup.stats counts the distributed inbox");
    assert!(row.get::<_, String>(2).contains("distributed"), "{}", row.get::<_, String>(2));
    assert_eq!(shell_bytes(&mut c, "dedup.inbox_orders"), 0, "nothing was written around Citus");
}

#[test]
fn what_cannot_be_distributed_is_refused() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "refusals");
    let err = c.batch_execute("SELECT dedup.distribute_inbox('orders')").unwrap_err();
    assert!(message(&err).contains(r#"dedup: inbox "orders" is distributed already"#), "{err:?}");
    assert_eq!(sqlstate(&err), "55000");
    let err = c.batch_execute("SELECT dedup.distribute_inbox('nosuch')").unwrap_err();
    assert!(message(&err).contains("dedup:"), "{err:?}");
    // Co-location with what cannot hold the same keys: a local table, a table distributed on another collation.
    c.batch_execute(
        "SELECT dedup.create_inbox('more');
         CREATE TABLE local_table (key text);
         CREATE TABLE default_collation (key text PRIMARY KEY);
         SELECT create_distributed_table('default_collation', 'key');",
    )
    .unwrap();
    let err = c.batch_execute("SELECT dedup.distribute_inbox('more', 'local_table')").unwrap_err();
    assert!(message(&err).contains("does not distribute it by hash"), "{err:?}");
    assert_eq!(sqlstate(&err), "55000");
    let err = c.batch_execute("SELECT dedup.distribute_inbox('more', 'default_collation')").unwrap_err();
    assert!(message(&err).contains(r#"an inbox's id is text COLLATE "C""#), "{err:?}");
    assert_eq!(sqlstate(&err), "42804");
    let err = c.batch_execute("SELECT dedup.distribute_inbox('default')").unwrap_err();
    assert!(message(&err).contains("default inbox cannot be distributed"), "{err:?}");
    // Dropping a distributed inbox unregisters it on the workers too.
    c.batch_execute("SELECT dedup.create_inbox('gone'); SELECT dedup.distribute_inbox('gone')").unwrap();
    let registered_on_workers = |c: &mut Client| -> i64 {
        c.query_one(
            "SELECT sum(result::bigint)::bigint FROM run_command_on_workers(
                 $$SELECT count(*) FROM dedup.inbox_registry WHERE name = 'gone'$$)",
            &[],
        )
        .unwrap()
        .get(0)
    };
    assert_eq!(registered_on_workers(&mut c), 2);
    c.batch_execute("SELECT dedup.drop_inbox('gone')").unwrap();
    assert_eq!(registered_on_workers(&mut c), 0, "drop_inbox() unregistered it on the workers");
    let mut w = cluster.workers[0].connect("refusals");
    w.batch_execute("SELECT dedup.create_inbox('local')").unwrap();
    let err = w.batch_execute("SELECT dedup.distribute_inbox('local')").unwrap_err();
    assert!(message(&err).contains("worker node"), "{err:?}");
    assert_eq!(sqlstate(&err), "0A000");
}

#[test]
fn marks_made_on_a_worker_node_are_the_same_marks() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "on_workers");
    let mut w = cluster.workers[1].connect("on_workers");
    assert!(mark(&mut w, "from-worker"), "Citus's metadata is synced: the worker routes the mark too");
    assert!(!mark(&mut c, "from-worker"));
    assert!(mark(&mut c, "from-coordinator"));
    assert!(seen(&mut w, "from-coordinator") && !mark(&mut w, "from-coordinator"));
    assert_eq!(shell_bytes(&mut w, "dedup.inbox_orders"), 0, "nothing was written around Citus on the worker");
}

/// Sixteen sessions on the coordinator mark the same 300 ids in different orders: exactly one `true` per id.
#[test]
fn sixteen_sessions_mark_each_id_once() {
    let Some(cluster) = cluster() else { return };
    distributed_db(cluster, "storm");
    let ids: Vec<String> = (0..300).map(|i| format!("s{i}")).collect();
    let barrier = Arc::new(Barrier::new(16));
    let sessions: Vec<_> = (0..16)
        .map(|n| {
            let mut c = cluster.coordinator.connect("storm");
            let barrier = barrier.clone();
            let mut order = ids.clone();
            order.rotate_left(n * 19);
            if n % 2 == 1 {
                order.reverse();
            }
            thread::spawn(move || {
                barrier.wait();
                order.into_iter().filter(|id| mark(&mut c, id)).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut firsts: HashMap<String, usize> = HashMap::new();
    for s in sessions {
        for id in s.join().unwrap() {
            *firsts.entry(id).or_default() += 1;
        }
    }
    assert_eq!(firsts.len(), ids.len(), "every id was new to some session");
    let twice: Vec<_> = firsts.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "ids new to more than one session: {twice:?}");
    let mut c = cluster.coordinator.connect("storm");
    assert_eq!(rows_in_shards(&mut c, "dedup.inbox_orders"), 300);
}

/// The blocking claim holds across the cluster: a second mark of an id waits for the first transaction, and answers
/// by its outcome.
#[test]
fn a_concurrent_mark_waits_for_the_first_and_answers_by_its_outcome() {
    let Some(cluster) = cluster() else { return };
    let mut first = distributed_db(cluster, "blocking");
    for (outcome, expected) in [("ROLLBACK", true), ("COMMIT", false)] {
        let id = format!("b-{outcome}");
        first.batch_execute("BEGIN").unwrap();
        assert!(mark(&mut first, &id));
        let mut second = cluster.coordinator.connect("blocking");
        let gpid: i64 = second.query_one("SELECT citus_backend_gpid()", &[]).unwrap().get(0);
        let waiter = thread::spawn(move || mark(&mut second, &id));
        // The wait is on the worker that holds the shard, in the backend working for the second session.
        let mut observer = cluster.coordinator.connect("blocking");
        eventually("the second mark waits for a lock on a worker", || {
            observer
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM citus_stat_activity WHERE global_pid = $1 AND wait_event_type = 'Lock')",
                    &[&gpid],
                )
                .unwrap()
                .get(0)
        });
        first.batch_execute(outcome).unwrap();
        assert_eq!(waiter.join().unwrap(), expected, "after {outcome}");
    }
}

/// A mark and a business write in one coordinator transaction, usually on different workers (Citus's two-phase
/// commit), while a worker is killed -9 and brought back: once Citus has recovered its prepared transactions, an id
/// is marked iff its ledger row exists, and redelivering every message applies each exactly once.
#[test]
fn a_mark_and_a_distributed_write_commit_together_through_a_worker_crash() {
    if cluster().is_none() {
        return;
    }
    // A cluster of its own: the other tests' sessions would not survive the crash.
    let cluster = CitusCluster::start("", &[]);
    let mut c = distributed_db(&cluster, "two_phase");
    // Distributed on a bigint: not co-located with the inbox, so mark and write often land on different workers.
    c.batch_execute(
        "CREATE TABLE ledger (n bigint PRIMARY KEY, id text NOT NULL);
         SELECT create_distributed_table('ledger', 'n', colocate_with => 'none')",
    )
    .unwrap();
    const MESSAGES: i64 = 400;
    let loaders: Vec<_> = (0..4)
        .map(|k| {
            let conn = cluster.coordinator.conn_string("two_phase", "postgres");
            thread::spawn(move || {
                let mut c = Client::connect(&conn, postgres::NoTls).unwrap();
                for n in (k..MESSAGES).step_by(4) {
                    // An error (the worker is down) leaves the message for redelivery.
                    if deliver(&mut c, n).is_err() && c.is_closed() {
                        c = Client::connect(&conn, postgres::NoTls).unwrap();
                    }
                }
            })
        })
        .collect();
    eventually("the load is under way", || {
        c.query_one("SELECT count(*) FROM ledger", &[]).map(|r| r.get::<_, i64>(0) > 40).unwrap_or(false)
    });
    cluster.workers[0].crash_postmaster();
    for l in loaders {
        l.join().unwrap();
    }
    // A new session: the old one's connection to the crashed worker is broken, and fails once when used.
    let mut c = cluster.coordinator.connect("two_phase");
    let two_phase_commits: i64 = c.query_one("SELECT count(*) FROM pg_dist_transaction", &[]).unwrap().get(0);
    assert!(two_phase_commits > 0, "the load committed through two-phase commit");
    let recovered: i32 = c.query_one("SELECT recover_prepared_transactions()", &[]).unwrap().get(0);
    eprintln!("two_phase: Citus recovered {recovered} prepared transactions");
    let in_doubt: i64 = c
        .query_one(
            "SELECT coalesce(sum(result::bigint), 0)::bigint
               FROM run_command_on_workers('SELECT count(*) FROM pg_prepared_xacts')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(in_doubt, 0, "Citus's recovery left no prepared transaction behind");
    for n in 0..MESSAGES {
        let id = format!("m{n}");
        let written: bool = c.query_one("SELECT EXISTS (SELECT 1 FROM ledger WHERE n = $1)", &[&n]).unwrap().get(0);
        assert_eq!(seen(&mut c, &id), written, "{id}: marked iff its ledger row exists");
    }
    // Redelivery of everything: each message applied exactly once in the end.
    for n in 0..MESSAGES {
        deliver(&mut c, n).unwrap();
    }
    let row = c.query_one("SELECT count(*), count(DISTINCT id) FROM ledger", &[]).unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (MESSAGES, MESSAGES), "nothing lost, nothing twice");
    assert_eq!(rows_in_shards(&mut c, "dedup.inbox_orders"), MESSAGES, "marks == ledger rows");
    cluster.destroy();
}

/// One consumer's delivery of message `n`: mark, and write the ledger row only when new, in one transaction.
fn deliver(c: &mut Client, n: i64) -> Result<(), postgres::Error> {
    let id = format!("m{n}");
    let mut tx = c.transaction()?;
    let new: bool = tx.query_one("SELECT dedup.mark($1, inbox => 'orders')", &[&id])?.get(0);
    if new {
        tx.execute("INSERT INTO ledger VALUES ($1, $2)", &[&n, &id])?;
    }
    tx.commit()
}

/// An inbox co-located with the business table: a mark and the write of the same key go to one shard group, so
/// the transaction commits on one worker, without two-phase commit.
#[test]
fn a_colocated_mark_and_write_are_one_single_shard_transaction() {
    let Some(cluster) = cluster() else { return };
    let mut c = cluster.fresh_db("colocated");
    c.batch_execute(
        r#"CREATE TABLE events (key text COLLATE "C" PRIMARY KEY, body text);
           SELECT create_distributed_table('events', 'key');
           SELECT dedup.create_inbox('orders');
           SELECT dedup.distribute_inbox('orders', colocate_with => 'events')"#,
    )
    .unwrap();
    let same: bool = c
        .query_one(
            "SELECT (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = 'dedup.inbox_orders'::regclass)
                  = (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = 'events'::regclass)",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(same, "one co-location group");
    let two_phase =
        |c: &mut Client| -> i64 { c.query_one("SELECT count(*) FROM pg_dist_transaction", &[]).unwrap().get(0) };
    let before = two_phase(&mut c);
    for k in 0..40 {
        let key = format!("key-{k}");
        let mut tx = c.transaction().unwrap();
        assert!(tx.query_one("SELECT dedup.mark($1, inbox => 'orders')", &[&key]).unwrap().get::<_, bool>(0));
        tx.execute("INSERT INTO events VALUES ($1, 'x')", &[&key]).unwrap();
        tx.commit().unwrap();
    }
    assert_eq!(two_phase(&mut c), before, "no transaction needed two-phase commit: each stayed on one shard group");
}

/// The inserts that a distributed `mark()`, `mark_many()` and `claim()` have Citus send to the shards name no
/// conflict target while the primary key is the inbox's only unique index: the node holding a shard parses the
/// statement at every call, and inferring the target cost about 7 points of the ratio to the hand-written INSERT at
/// 8 clients (bench/results/profiles/issue-23.md, stop 56). With another unique index, made by another session,
/// they name `(id)` again, and the keys keep their answers either way.
#[test]
fn the_shard_insert_names_no_conflict_target_while_the_key_is_the_only_unique_index() {
    let Some(cluster) = cluster() else { return };
    let mut admin = distributed_db(cluster, "conflict_target");
    let (mut c, notices) = connect_keeping_notices(&cluster.coordinator, "conflict_target");
    c.batch_execute("SET citus.log_remote_commands = on").unwrap();
    // The INSERTs Citus sent while `call` (a mark or claim of new ids, $1 and $1 || 'b') ran.
    let mut sent = |call: &str, id: &str| -> Vec<String> {
        notices.lock().unwrap().clear();
        let new: bool = c.query_one(call, &[&id]).unwrap().get(0);
        assert!(new, "{id} is new");
        let notices = notices.lock().unwrap();
        let inserts: Vec<String> =
            notices.iter().map(|(m, _)| m).filter(|m| m.starts_with("issuing INSERT INTO")).cloned().collect();
        assert!(!inserts.is_empty(), "no INSERT sent for {id}: {notices:?}");
        inserts
    };
    let calls = [
        "SELECT dedup.mark($1, inbox => 'orders')",
        "SELECT count(*) = 2 FROM dedup.mark_many(ARRAY[$1, $1 || 'b'], inbox => 'orders')",
        "SELECT state = 'new' FROM dedup.claim($1, inbox => 'orders')",
    ];
    for (i, call) in calls.iter().enumerate() {
        for insert in sent(call, &format!("alone-{i}")) {
            assert!(
                insert.contains("ON CONFLICT DO NOTHING"),
                "no target while the key is the only unique index: {insert}"
            );
        }
    }
    admin.batch_execute("CREATE UNIQUE INDEX ON dedup.inbox_orders (id, expires_at)").unwrap();
    for (i, call) in calls.iter().enumerate() {
        for insert in sent(call, &format!("another-{i}")) {
            assert!(insert.contains("ON CONFLICT(id) DO NOTHING"), "the target with another unique index: {insert}");
        }
    }
    for id in ["alone-0", "alone-1", "alone-1b", "alone-2", "another-0", "another-1", "another-1b", "another-2"] {
        assert!(!mark(&mut c, id), "{id} is a duplicate");
    }
}

/// Expired marks are purged on every shard, in batches, by the coordinator's background worker.
#[test]
fn expired_marks_are_purged_on_every_shard() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "purge_worker");
    c.batch_execute(
        "SELECT dedup.mark_many(array(SELECT 'e' || g FROM generate_series(1, 2000) g), '1 second', 'orders');
         SELECT dedup.mark_many(array(SELECT 'live' || g FROM generate_series(1, 100) g), '1 hour', 'orders')",
    )
    .unwrap();
    let shards_with_expired = |c: &mut Client| -> i64 {
        c.query_one(
            "SELECT count(*) FROM run_command_on_shards('dedup.inbox_orders',
                                                         $$SELECT count(*) FROM %s WHERE id LIKE 'e%%'$$)
              WHERE result::bigint > 0",
            &[],
        )
        .unwrap()
        .get(0)
    };
    assert!(shards_with_expired(&mut c) > 16, "the expiring marks are spread over the shards");
    eventually("the worker purged every shard", || shards_with_expired(&mut c) == 0);
    assert_eq!(rows_in_shards(&mut c, "dedup.inbox_orders"), 100, "live marks stay");
    let purged = |c: &mut Client| -> i64 {
        c.query_one("SELECT purged FROM dedup.stats WHERE inbox = 'orders'", &[]).unwrap().get(0)
    };
    assert_eq!(purged(&mut c), 2000);
    // The worker looks after the filter every second, and once freed the counters of every inbox it does not load.
    thread::sleep(Duration::from_millis(2500));
    assert_eq!(purged(&mut c), 2000, "the distributed inbox's counters were kept");
}

/// Two sessions marking overlapping batches, in opposite orders, over and over: no deadlock, each id new once.
#[test]
fn overlapping_mark_many_calls_do_not_deadlock() {
    let Some(cluster) = cluster() else { return };
    distributed_db(cluster, "batches");
    let barrier = Arc::new(Barrier::new(2));
    let sessions: Vec<_> = (0..2)
        .map(|k| {
            let conn = cluster.coordinator.conn_string("batches", "postgres");
            let barrier = barrier.clone();
            thread::spawn(move || {
                let mut c = Client::connect(&conn, postgres::NoTls).unwrap();
                let mut new = Vec::new();
                for round in 0..40 {
                    barrier.wait();
                    let mut ids: Vec<String> = (0..50).map(|i| format!("r{round}-{i}")).collect();
                    if k == 1 {
                        ids.reverse();
                    }
                    let rows = c
                        .query("SELECT * FROM dedup.mark_many($1, inbox => 'orders')", &[&ids])
                        .unwrap_or_else(|e| panic!("mark_many, round {round}: {e:?}"));
                    new.extend(rows.iter().map(|r| r.get::<_, String>(0)));
                }
                new
            })
        })
        .collect();
    let mut firsts: HashMap<String, usize> = HashMap::new();
    for s in sessions {
        for id in s.join().unwrap() {
            *firsts.entry(id).or_default() += 1;
        }
    }
    assert_eq!(firsts.len(), 40 * 50);
    assert!(firsts.values().all(|&n| n == 1));
}

/// Shards moved to the other worker while sessions mark: no id answers new twice, no committed mark is lost, and
/// every one is still seen afterwards.
#[test]
fn a_shard_move_under_load_loses_no_mark() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "shard_move");
    c.batch_execute(
        "SELECT dedup.mark_many(array(SELECT 'before' || g FROM generate_series(1, 1000) g), inbox => 'orders')",
    )
    .unwrap();
    let load: Vec<_> = (0..2)
        .map(|k| {
            let conn = cluster.coordinator.conn_string("shard_move", "postgres");
            thread::spawn(move || {
                let mut c = Client::connect(&conn, postgres::NoTls).unwrap();
                let mut firsts = Vec::new();
                for i in 0..600 {
                    // Both sessions mark the same new ids, and re-mark old ones (which must be duplicates).
                    let id = format!("during{i}");
                    if mark(&mut c, &id) {
                        firsts.push(id);
                    }
                    let old = format!("before{}", (i * 7 + k) % 1000 + 1);
                    assert!(!mark(&mut c, &old), "{old} was marked before the move, and answered new");
                }
                firsts
            })
        })
        .collect();
    let moved: i64 = c
        .query_one(
            "WITH s AS (SELECT shardid, nodename, nodeport FROM citus_shards
                         WHERE table_name = 'dedup.inbox_orders'::regclass ORDER BY shardid LIMIT 4)
             SELECT count(citus_move_shard_placement(s.shardid, s.nodename, s.nodeport, n.nodename, n.nodeport,
                                                      shard_transfer_mode => 'block_writes'))
               FROM s JOIN pg_dist_node n ON n.nodename <> s.nodename AND n.groupid <> 0 AND n.isactive",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(moved, 4, "four shards moved");
    let mut firsts: HashMap<String, usize> = HashMap::new();
    for l in load {
        for id in l.join().unwrap() {
            *firsts.entry(id).or_default() += 1;
        }
    }
    assert_eq!(firsts.len(), 600);
    assert!(firsts.values().all(|&n| n == 1), "an id answered new twice across the move");
    let unseen: i64 = c
        .query_one("SELECT count(*) FROM generate_series(1, 1000) g WHERE NOT dedup.seen('before' || g, 'orders')", &[])
        .unwrap()
        .get(0);
    assert_eq!(unseen, 0, "no false negative after the move");
    assert_eq!(rows_in_shards(&mut c, "dedup.inbox_orders"), 1600);
}

/// `undistribute_inbox()` brings the rows back to the coordinator's table, where the single-node paths (the filter
/// among them) take over again.
#[test]
fn undistribute_brings_the_inbox_back() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "undistribute");
    c.batch_execute("SELECT dedup.mark_many(array(SELECT 'u' || g FROM generate_series(1, 200) g), inbox => 'orders')")
        .unwrap();
    c.batch_execute("SELECT dedup.undistribute_inbox('orders')").unwrap();
    let row = c
        .query_one(
            "SELECT distributed, (SELECT count(*) FROM dedup.inbox_orders) FROM dedup.inboxes WHERE name = 'orders'",
            &[],
        )
        .unwrap();
    assert_eq!((row.get::<_, bool>(0), row.get::<_, i64>(1)), (false, 200));
    assert!(!mark(&mut c, "u7") && mark(&mut c, "u201") && seen(&mut c, "u201"));
    let typed: bool = c
        .query_one(
            "SELECT reloftype = 'dedup.inbox_row'::regtype FROM pg_class WHERE oid = 'dedup.inbox_orders'::regclass",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(typed, "an inbox table again (of the inbox row type), which the filter and the direct paths serve");
    let on_worker: i64 = cluster.workers[0]
        .connect("undistribute")
        .query_one("SELECT count(*) FROM dedup.inbox_registry WHERE name = 'orders'", &[])
        .unwrap()
        .get(0);
    assert_eq!(on_worker, 0, "unregistered on the workers");
    let trigger: String =
        c.query_one("SELECT filter_trigger FROM dedup.stats WHERE inbox = 'orders'", &[]).unwrap().get(0);
    assert!(!trigger.contains("distributed"), "{trigger}");
    let err = c.batch_execute("SELECT dedup.undistribute_inbox('orders')").unwrap_err();
    assert!(message(&err).contains("is not distributed"), "{err:?}");
}

/// pg_dump of the coordinator holds the marks too (Citus routes the dump's COPY to the shards), and restores as an
/// inbox on one node, marks and all: distribute it again with `distribute_inbox()` (docs/scale-out.md).
#[test]
fn pg_dump_of_the_coordinator_restores_as_a_one_node_inbox() {
    let Some(cluster) = cluster() else { return };
    let mut c = distributed_db(cluster, "dump");
    assert!(mark(&mut c, "dumped-id"));
    let socket = cluster.coordinator.socket_dir().to_str().unwrap().to_owned();
    let file = cluster.coordinator.socket_dir().join("dump.sql");
    let out =
        cluster.coordinator.run("pg_dump", &["-h", &socket, "-U", "postgres", "-f", file.to_str().unwrap(), "dump"]);
    assert!(out.status.success(), "pg_dump: {}", String::from_utf8_lossy(&out.stderr));
    let mut admin = cluster.coordinator.connect("postgres");
    admin.batch_execute("DROP DATABASE IF EXISTS dump_restored").unwrap();
    admin.batch_execute("CREATE DATABASE dump_restored").unwrap();
    let out = cluster.coordinator.run(
        "psql",
        &[
            "-h",
            &socket,
            "-U",
            "postgres",
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-f",
            file.to_str().unwrap(),
            "dump_restored",
        ],
    );
    assert!(out.status.success(), "restore: {}", String::from_utf8_lossy(&out.stderr));
    let mut r = cluster.coordinator.connect("dump_restored");
    let distributed: bool =
        r.query_one("SELECT distributed FROM dedup.inboxes WHERE name = 'orders'", &[]).unwrap().get(0);
    assert!(!distributed, "restored as a table of this node");
    assert!(!mark(&mut r, "dumped-id"), "the mark came through the dump");
    assert!(mark(&mut r, "after-restore"));
}

/// Rows of inbox `inbox`'s own table on each worker (not its shards: a one-node inbox's table there).
fn rows_on_workers(c: &mut Client, inbox: &str) -> i64 {
    c.query_one(
        "SELECT coalesce(sum(result::bigint), 0)::bigint FROM run_command_on_workers(
             format('SELECT count(*) FROM dedup.%I', 'inbox_' || $1::text))",
        &[&inbox],
    )
    .expect("count rows on the workers")
    .get(0)
}

/// Citus pushes `SELECT dedup.mark(key) FROM <distributed table>` down into every shard's query. On a worker, an
/// inbox that is not distributed is that worker's own table (here the workers have one of each name): the marks
/// went there and answered "new", and the coordinator's inbox, where the caller looks, never saw them. Refused now,
/// on the worker, with a dedup: error.
#[test]
fn a_mark_pushed_down_to_the_shards_never_marks_a_worker_s_own_inbox() {
    let Some(cluster) = cluster() else { return };
    let mut c = cluster.fresh_db("pushdown");
    c.batch_execute(
        r#"CREATE TABLE events (key text COLLATE "C" PRIMARY KEY);
           SELECT create_distributed_table('events', 'key');
           INSERT INTO events SELECT 'p' || g FROM generate_series(1, 20) g;
           SELECT dedup.create_inbox('coordinator_only');
           SELECT run_command_on_workers($$SELECT dedup.create_inbox('coordinator_only')$$);"#,
    )
    .unwrap();
    for inbox in ["default", "coordinator_only"] {
        let err = c.query("SELECT dedup.mark(key, inbox => $1) FROM events", &[&inbox]).unwrap_err();
        assert!(message(&err).contains(&format!(r#"dedup: inbox "{inbox}" is not distributed"#)), "{err:?}");
        assert_eq!(sqlstate(&err), "0A000");
    }
    for inbox in ["default", "coordinator_only"] {
        assert_eq!(rows_on_workers(&mut c, inbox), 0, "nothing was marked in the workers' own inbox {inbox}");
    }
    // Positions and counts of delivery attempts are the node's own, even for a distributed inbox: pushed down,
    // they would be the workers' (a position that seems never advanced, a count that starts again at 1).
    c.batch_execute("SELECT dedup.create_inbox('spread'); SELECT dedup.distribute_inbox('spread');").unwrap();
    for (call, function) in [
        ("dedup.advance(key, 1, inbox => 'spread')::text", "advance()"),
        ("dedup.position(key, inbox => 'spread')::text", "position()"),
        ("dedup.attempt(key, inbox => 'spread')::text", "attempt()"),
        ("dedup.forget(key, inbox => 'spread')::text", "forget()"),
    ] {
        let err = c.query(&format!("SELECT {call} FROM events"), &[]).unwrap_err();
        assert!(message(&err).contains(&format!("dedup: {function} keeps its state on the node")), "{err:?}");
        assert_eq!(sqlstate(&err), "0A000");
    }
    // Counts of attempts outlive the statement's rollback: had a worker counted, its memory would show it.
    let counted: i64 = c
        .query_one(
            "SELECT coalesce(sum(result::bigint), 0)::bigint FROM run_command_on_workers(
                 'SELECT count(*) FROM dedup.attempts_in_memory()')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(counted, 0, "no worker counted an attempt of its own");
    // The hint's form: the ids are read first, and marked where the inbox is.
    let new: i64 = c
        .query_one(
            "WITH ids AS MATERIALIZED (SELECT key FROM events)
             SELECT count(*) FILTER (WHERE dedup.mark(key, inbox => 'coordinator_only')) FROM ids",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(new, 20);
    let err = c.query("SELECT key FROM events WHERE dedup.seen(key, 'coordinator_only')", &[]).unwrap_err();
    assert!(message(&err).contains("is not distributed"), "seen() pushed down is refused too: {err:?}");
    let on_coordinator: i64 =
        c.query_one("SELECT count(*) FROM dedup.inbox_coordinator_only WHERE id LIKE 'p%'", &[]).unwrap().get(0);
    assert_eq!(on_coordinator, 20, "the marks are in the coordinator's inbox");
    // A worker's own inbox stays usable on the worker, by a client of its own or through run_command_on_workers().
    let marked: i64 = c
        .query_one("SELECT count(*) FROM run_command_on_workers($$SELECT dedup.mark('own')$$) WHERE result = 't'", &[])
        .unwrap()
        .get(0);
    assert_eq!(marked, 2);
}

/// Citus's function delegation of mark() (docs/scale-out.md, "Function delegation"): done by hand with
/// create_distributed_function(), co-located with the inbox. A delegated mark runs on the worker that holds the id's
/// shard, inside the coordinator's transaction: it commits or vanishes with the business write, the shard's unique
/// index decides, the filter stays out of it. Citus routes by the id alone, whatever inbox the call names: a call
/// for an inbox of this node's own is refused on the worker (it would mark the worker's table), one for an inbox
/// distributed in another co-location group is refused by Citus.
#[test]
fn a_delegated_mark_keeps_the_contract_or_is_refused() {
    let Some(cluster) = cluster() else { return };
    let mut c = cluster.fresh_db("delegation");
    c.batch_execute(
        r#"CREATE TABLE events (key text COLLATE "C" PRIMARY KEY, body text);
           SELECT create_distributed_table('events', 'key');
           CREATE TABLE ledger (n bigint PRIMARY KEY, key text NOT NULL);
           SELECT create_distributed_table('ledger', 'n', colocate_with => 'none');
           SELECT dedup.create_inbox('orders');
           SELECT dedup.distribute_inbox('orders', colocate_with => 'events');
           SELECT create_distributed_function('dedup.mark(text,interval,text)', 'id', colocate_with => 'events',
                                              force_delegation => true);"#,
    )
    .unwrap();
    let deliver = |c: &mut Client, key: &str, outcome: &str| -> bool {
        let mut tx = c.transaction().unwrap();
        let new: bool = tx.query_one("SELECT dedup.mark($1, inbox => 'orders')", &[&key]).unwrap().get(0);
        if new {
            tx.execute("INSERT INTO events VALUES ($1, 'x')", &[&key]).unwrap();
            // On another distribution key: usually another worker, so the transaction commits in two phases.
            tx.execute("INSERT INTO ledger VALUES (hashtext($1), $1)", &[&key]).unwrap();
        }
        if outcome == "COMMIT" {
            tx.commit().unwrap()
        } else {
            tx.rollback().unwrap()
        }
        new
    };
    for k in 0..30 {
        let key = format!("d{k}");
        assert!(deliver(&mut c, &key, "ROLLBACK"), "{key}: new");
        assert!(deliver(&mut c, &key, "COMMIT"), "{key}: new again after the rollback took the mark");
        assert!(!deliver(&mut c, &key, "COMMIT"), "{key}: a duplicate");
    }
    let row = c.query_one("SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM ledger)", &[]).unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (30, 30), "each written once, with its mark");
    assert_eq!(rows_in_shards(&mut c, "dedup.inbox_orders"), 30);
    // The calls ran on the workers: their counters moved, the coordinator's did not; no filter was asked there.
    let coordinator_marks: i64 =
        c.query_one("SELECT marks + duplicates FROM dedup.stats WHERE inbox = 'orders'", &[]).unwrap().get(0);
    assert_eq!(coordinator_marks, 0, "delegated: mark() ran on the workers");
    let on_workers = |c: &mut Client, column: &str| -> i64 {
        c.query_one(
            &format!(
                "SELECT coalesce(sum(result::bigint), 0)::bigint FROM run_command_on_workers(
                     $$SELECT {column} FROM dedup.stats WHERE inbox = 'orders'$$)"
            ),
            &[],
        )
        .unwrap()
        .get(0)
    };
    assert_eq!(on_workers(&mut c, "marks"), 60, "each key new twice: rolled back, then committed");
    assert_eq!(on_workers(&mut c, "lookups"), 0, "the workers' filters never answered for the distributed inbox");

    // Inboxes outside the function's co-location group: delegated all the same, by the id. The workers have an
    // inbox named `local` of their own: the case where a delegated call would mark the wrong table.
    c.batch_execute(
        "SELECT dedup.create_inbox('local');
         SELECT run_command_on_workers($$SELECT dedup.create_inbox('local')$$);
         SET citus.shard_count = 7;
         SELECT dedup.create_inbox('apart');
         SELECT dedup.distribute_inbox('apart');
         RESET citus.shard_count",
    )
    .unwrap();
    for inbox in ["default", "local"] {
        let err = c.query_one("SELECT dedup.mark('x1', inbox => $1)", &[&inbox]).unwrap_err();
        assert!(message(&err).contains(&format!(r#"dedup: inbox "{inbox}" is not distributed"#)), "{err:?}");
        assert_eq!(sqlstate(&err), "0A000");
    }
    for inbox in ["default", "local"] {
        assert_eq!(rows_on_workers(&mut c, inbox), 0, "no worker marked its own inbox {inbox}");
    }
    let err = c.query_one("SELECT dedup.mark('x1', inbox => 'apart')", &[]).unwrap_err();
    assert!(message(&err).contains("distribution argument in the same colocation group"), "{err:?}");
    // A statement Citus does not delegate still marks them, on the coordinator.
    let new: bool = c.query_one("SELECT dedup.mark('x1', inbox => 'local') IS TRUE", &[]).unwrap().get(0);
    assert!(new);
}
