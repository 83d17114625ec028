//! Rows deduplicated where they arrive (`attach()`: INSERT, COPY, logical replication), against real servers: COPY of
//! data with repeats, eight sessions loading overlapping keys at once, a load killed mid-COPY, a logical-replication
//! subscriber that is sent the same rows twice, pg_dump and restore, and the concurrency of attach(), detach(),
//! drop_inbox() and DROP. Run by tests/attach.rs (no filter) and tests/attach_filtered.rs (the filter answers).

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::io::Write;

/// The server this suite runs on: the root file that includes it says which (`server()`).
fn cluster() -> &'static Cluster {
    super::server()
}

/// A fresh database with pg_dedup installed, on this suite's server.
fn db(name: &str) -> pg_dedup_harness::postgres::Client {
    cluster().fresh_db(name)
}

/// A table of events attached to inbox `inbox` by `event_id`.
fn attached_events(c: &mut Client, table: &str, inbox: &str, on_duplicate: &str) {
    c.batch_execute(&format!(
        "CREATE TABLE {table} (event_id text NOT NULL, body text);
         SELECT dedup.attach('{table}', 'event_id', inbox => '{inbox}', on_duplicate => '{on_duplicate}');"
    ))
    .unwrap();
}

/// COPY of `rows` (event_id, body) into `table` through the client protocol, as a loader does.
fn copy_rows(c: &mut Client, table: &str, rows: &[(String, String)]) -> Result<u64, postgres::Error> {
    let mut copy = c.copy_in(&format!("COPY {table} (event_id, body) FROM STDIN"))?;
    for (id, body) in rows {
        writeln!(copy, "{id}\t{body}").unwrap();
    }
    copy.finish()
}

fn rows(ids: impl IntoIterator<Item = usize>, tag: &str) -> Vec<(String, String)> {
    ids.into_iter().map(|i| (format!("ev-{i}"), format!("{tag}-{i}"))).collect()
}

#[test]
fn copy_with_repeats_keeps_the_first_of_each_key() {
    let mut c = db("ingest_copy");
    attached_events(&mut c, "feed", "default", "skip");
    // 1,000 rows, keys 0..700 (300 repeats inside the file, at both ends of it).
    let file: Vec<_> = rows((0..700).chain(0..150).chain(550..700), "first");
    assert_eq!(copy_rows(&mut c, "feed", &file).unwrap(), 700, "COPY reports the rows it kept");
    // Loaded again, as a loader re-run after a failure: nothing new.
    assert_eq!(copy_rows(&mut c, "feed", &rows(0..700, "again")).unwrap(), 0);
    let kept: i64 =
        c.query_one("SELECT count(DISTINCT event_id) FROM feed WHERE body LIKE 'first-%'", &[]).unwrap().get(0);
    assert_eq!((count(&mut c, "feed"), kept), (700, 700));
    // Counted where there are counters (a preloaded server: `attach_filtered`).
    let stats: Option<String> = c
        .query_one("SELECT rows_passed || ' ' || rows_dropped FROM dedup.stats WHERE inbox = 'default'", &[])
        .unwrap()
        .get(0);
    assert!(stats.as_deref().is_none_or(|s| s == "700 1000"), "{stats:?}");
    // With 'error', the first repeat fails the whole COPY: nothing of it stays, not even its marks.
    c.batch_execute(
        "SELECT dedup.create_inbox('strict'); CREATE TABLE strict_feed (event_id text, body text);
                     SELECT dedup.attach('strict_feed', 'event_id', inbox => 'strict', on_duplicate => 'error')",
    )
    .unwrap();
    let err = copy_rows(&mut c, "strict_feed", &rows([1, 2, 3, 2], "x")).unwrap_err();
    assert_eq!(sqlstate(&err), "23505");
    let message = err.as_db_error().map(|e| e.message().to_owned()).unwrap_or_default();
    assert!(message.contains("key \"ev-2\""), "{message}");
    assert_eq!(count(&mut c, "strict_feed") + count(&mut c, "dedup.inbox_strict"), 0);
}

#[test]
fn eight_sessions_loading_overlapping_keys_land_each_key_exactly_once() {
    eight_sessions_loading_overlapping_keys("ingest_race", false);
}

/// The same, attached with `attach_batched()`: a session whose flush finds a key another session loaded meanwhile
/// fails with serialization_failure (or, waiting in a cycle, deadlock_detected) and retries, as the docs say.
#[test]
fn eight_sessions_loading_overlapping_keys_in_batches_land_each_key_exactly_once() {
    eight_sessions_loading_overlapping_keys("ingest_race_batched", true);
}

fn eight_sessions_loading_overlapping_keys(database: &str, batched: bool) {
    let cluster = cluster();
    let mut c = db(database);
    c.batch_execute(&format!(
        "CREATE TABLE feed (event_id text NOT NULL, body text);
         SELECT dedup.{attach}('feed', 'event_id');
         CREATE TABLE parted (event_id text, body text) PARTITION BY HASH (event_id);
         CREATE TABLE parted_0 PARTITION OF parted FOR VALUES WITH (MODULUS 2, REMAINDER 0);
         CREATE TABLE parted_1 PARTITION OF parted FOR VALUES WITH (MODULUS 2, REMAINDER 1);
         SELECT dedup.create_inbox('parted');
         SELECT dedup.{attach}('parted', 'event_id', inbox => 'parted')",
        attach = if batched { "attach_batched" } else { "attach" }
    ))
    .unwrap();
    const KEYS: usize = 2_000;
    let retries = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for session in 0..8 {
            let retries = &retries;
            s.spawn(move || {
                let mut c = cluster.connect(database);
                // Each session loads three quarters of the keys, starting at its own offset, in batches of 250.
                let mine: Vec<usize> = (0..KEYS * 3 / 4).map(|i| (i + session * KEYS / 8) % KEYS).collect();
                for (n, chunk) in mine.chunks(250).enumerate() {
                    let batch = rows(chunk.iter().copied(), &format!("s{session}"));
                    let (first, second) = if n % 2 == 0 { ("feed", "parted") } else { ("parted", "feed") };
                    // Only a batched attachment may fail a load, and only so; each load is its own transaction.
                    let mut retried = |load: &mut dyn FnMut(&mut Client) -> Result<u64, postgres::Error>| loop {
                        match load(&mut c) {
                            Err(e) if batched && ["40001", "40P01"].contains(&sqlstate(&e).as_str()) => {
                                retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            outcome => return outcome.unwrap(),
                        }
                    };
                    retried(&mut |c| copy_rows(c, first, &batch));
                    let inserted = retried(&mut |c| {
                        c.execute(
                            &format!("INSERT INTO {second} SELECT * FROM unnest($1::text[], $2::text[])"),
                            &[
                                &batch.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
                                &batch.iter().map(|r| r.1.clone()).collect::<Vec<_>>(),
                            ],
                        )
                    });
                    assert!(inserted <= batch.len() as u64);
                }
            });
        }
    });
    eprintln!("{database}: {} load(s) retried", retries.into_inner());
    for table in ["feed", "parted"] {
        let (rows, keys): (i64, i64) = c
            .query_one(&format!("SELECT count(*), count(DISTINCT event_id) FROM {table}"), &[])
            .map(|r| (r.get(0), r.get(1)))
            .unwrap();
        assert_eq!((rows, keys), (KEYS as i64, KEYS as i64), "{table}: every key once, none lost");
    }
    let marks = count(&mut c, "dedup.inbox_default") + count(&mut c, "dedup.inbox_parted");
    assert_eq!(marks, 2 * KEYS as i64, "one mark per row, no orphan");
}

#[test]
fn a_load_killed_mid_copy_leaves_neither_rows_nor_marks_of_it() {
    // A server of its own: SIGKILL of a backend restarts every backend of the cluster.
    let server = Cluster::start(&[]);
    let mut c = server.fresh_db("ingest_kill");
    attached_events(&mut c, "feed", "default", "skip");
    copy_rows(&mut c, "feed", &rows(0..100, "before")).unwrap();
    let mut loader = server.connect("ingest_kill");
    let pid = backend_pid(&mut loader);
    let copy = std::thread::spawn(move || {
        let mut copy = loader.copy_in("COPY feed (event_id, body) FROM STDIN").unwrap();
        // Rows go out until the server is gone: the COPY never finishes.
        for i in 100.. {
            if writeln!(copy, "ev-{i}\tduring-{i}").and_then(|_| copy.flush()).is_err() {
                return i;
            }
        }
        unreachable!()
    });
    eventually("the COPY has sent rows", || {
        let mut observer = server.connect("ingest_kill");
        observer
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND query LIKE 'COPY%'", &[&pid])
            .unwrap()
            .get::<_, i64>(0)
            == 1
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    server.crash_backend(pid);
    let sent = copy.join().unwrap();
    assert!(sent > 100, "rows were on their way");
    let mut c = server.connect("ingest_kill");
    assert_eq!(count(&mut c, "feed"), 100, "nothing of the killed COPY");
    assert_eq!(count(&mut c, "dedup.inbox_default"), 100, "no orphan marks");
    // The same file loaded again goes in whole.
    assert_eq!(copy_rows(&mut c, "feed", &rows(100..200, "again")).unwrap(), 100);
    server.destroy();
}

#[test]
fn a_logical_replication_subscriber_drops_what_it_is_sent_twice() {
    let server = Cluster::start(&["wal_level = logical", "max_replication_slots = 4", "max_wal_senders = 4"]);
    let mut publisher = server.fresh_db("ingest_pub");
    publisher
        .batch_execute(
            "CREATE TABLE orders (seq int PRIMARY KEY, order_id text NOT NULL, amount int);
             CREATE TABLE moves (id int, event_id text, day int); ALTER TABLE moves REPLICA IDENTITY FULL;
             CREATE PUBLICATION orders_pub FOR TABLE orders, moves;",
        )
        .unwrap();
    // Made apart: a subscription to its own cluster cannot create its slot (it would wait for itself).
    publisher.batch_execute("SELECT pg_create_logical_replication_slot('orders_sub', 'pgoutput')").unwrap();
    let mut subscriber = server.fresh_db("ingest_sub");
    // The table belongs to an application role, the subscription to a superuser: from PostgreSQL 16 on, changes are
    // applied as the table's owner inside a security-restricted operation, where the trigger must work too.
    subscriber
        .batch_execute(&format!(
            "CREATE ROLE app;
             GRANT USAGE ON SCHEMA dedup TO app; GRANT SELECT ON dedup.inbox_registry TO app;
             GRANT SELECT, INSERT, UPDATE ON dedup.inbox_default TO app;
             CREATE TABLE orders (seq int PRIMARY KEY, order_id text NOT NULL, amount int);
             ALTER TABLE orders OWNER TO app;
             SELECT dedup.attach('orders', 'order_id');
             CREATE TABLE moves (id int, event_id text, day int) PARTITION BY RANGE (day);
             CREATE TABLE moves_1 PARTITION OF moves FOR VALUES FROM (1) TO (2);
             CREATE TABLE moves_2 PARTITION OF moves FOR VALUES FROM (2) TO (3);
             ALTER TABLE moves REPLICA IDENTITY FULL; ALTER TABLE moves_1 REPLICA IDENTITY FULL;
             ALTER TABLE moves_2 REPLICA IDENTITY FULL;
             SELECT dedup.attach('moves', 'event_id');
             CREATE SUBSCRIPTION orders_sub CONNECTION '{}' PUBLICATION orders_pub
               WITH (create_slot = false, slot_name = 'orders_sub', copy_data = false);",
            server.conn_string("ingest_pub", "postgres")
        ))
        .unwrap();
    // The source sends every order twice under different sequence numbers (a producer retrying).
    publisher
        .batch_execute(
            "INSERT INTO orders SELECT g, 'order-' || (g % 50), g FROM generate_series(1, 100) g;
             INSERT INTO orders VALUES (1000, 'last', 0);",
        )
        .unwrap();
    eventually("the subscriber applied everything", || count(&mut subscriber, "orders WHERE order_id = 'last'") == 1);
    assert_eq!(count(&mut subscriber, "orders"), 51, "each order once");
    let first: i64 =
        subscriber.query_one("SELECT max(seq)::bigint FROM orders WHERE order_id <> 'last'", &[]).unwrap().get(0);
    assert_eq!(first, 50, "the first delivery of each order was kept");
    // An UPDATE that moves a row to another of the subscriber's partitions is applied as a delete and an insert: the
    // row must not be dropped as a duplicate of itself.
    publisher
        .batch_execute(
            "INSERT INTO moves VALUES (1, 'm1', 1), (2, 'm2', 1); UPDATE moves SET day = 2 WHERE id = 1;
             INSERT INTO orders VALUES (1001, 'last-after-moves', 0);",
        )
        .unwrap();
    eventually("the subscriber applied the move", || {
        count(&mut subscriber, "orders WHERE order_id = 'last-after-moves'") == 1
    });
    let moves: Vec<String> = subscriber
        .query("SELECT event_id || '@' || day FROM moves ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(moves, ["m1@2", "m2@1"]);
    subscriber.batch_execute("DROP SUBSCRIPTION orders_sub").unwrap();
    server.destroy();
}

#[test]
fn dump_and_restore_keep_attachments_and_every_row() {
    let cluster = cluster();
    let mut c = db("ingest_dump");
    attached_events(&mut c, "feed", "default", "skip");
    c.batch_execute("SELECT dedup.create_inbox('streams'); SELECT dedup.advance('order-1', 7, 'streams')").unwrap();
    copy_rows(&mut c, "feed", &rows(0..300, "kept")).unwrap();
    dump_and_restore(cluster, "ingest_dump", "ingest_restored");
    let mut r = cluster.connect("ingest_restored");
    assert_eq!(count(&mut r, "feed"), 300, "no row was taken for a duplicate of itself");
    let attached: String =
        r.query_one("SELECT format('%s %s %s', tbl, key, on_duplicate) FROM dedup.attachments", &[]).unwrap().get(0);
    assert_eq!(attached, "feed event_id skip");
    assert_eq!(copy_rows(&mut r, "feed", &rows(250..350, "more")).unwrap(), 50, "the marks came along too");
    let position: i64 = r.query_one("SELECT dedup.position('order-1', 'streams')", &[]).unwrap().get(0);
    assert_eq!(position, 7);
}

#[test]
fn a_refused_attach_or_detach_returns_at_once_instead_of_queueing_a_lock() {
    let cluster = cluster();
    let mut admin = db("ingest_lock_first");
    // A role that may call attach() and detach() and nothing else; roles are cluster-wide, databases per test.
    admin
        .batch_execute(
            "DROP ROLE IF EXISTS lock_intruder; CREATE ROLE lock_intruder LOGIN;
             GRANT USAGE ON SCHEMA dedup TO lock_intruder;
             GRANT EXECUTE ON FUNCTION dedup.attach(regclass, text, interval, text, text), dedup.detach(regclass)
               TO lock_intruder;
             CREATE TABLE victim (id text); CREATE VIEW victim_view AS SELECT * FROM victim",
        )
        .unwrap();
    // Writers hold the table (and, creating a table, pg_class), as an application does all day.
    let mut writer = cluster.connect("ingest_lock_first");
    writer
        .batch_execute(
            "BEGIN; INSERT INTO victim VALUES ('x'); CREATE TABLE scratch (x int);
             LOCK TABLE victim_view, dedup.inbox_default IN ACCESS EXCLUSIVE MODE",
        )
        .unwrap();
    // Before the fix each of these queued behind the writer (and every later writer behind it): here they would
    // fail with lock_timeout (55P03) instead of their refusal.
    let mut intruder = cluster.connect_as("ingest_lock_first", "lock_intruder");
    intruder.batch_execute("SET lock_timeout = '3s'").unwrap();
    for (sql, code) in [
        ("SELECT dedup.attach('public.victim', 'id')", "42501"),
        ("SELECT dedup.detach('public.victim')", "42501"),
        ("SELECT dedup.attach('pg_catalog.pg_class', 'relname::text')", "42809"),
    ] {
        assert_dedup_error(intruder.batch_execute(sql), code);
    }
    admin.batch_execute("SET lock_timeout = '3s'").unwrap();
    for sql in [
        "SELECT dedup.attach('public.victim_view', 'id')",
        "SELECT dedup.attach('dedup.inbox_default', 'id')",
        "SELECT dedup.detach('dedup.inbox_default')",
    ] {
        assert_dedup_error(admin.batch_execute(sql), "42809");
    }
    writer.batch_execute("ROLLBACK").unwrap();
    admin.batch_execute("DROP OWNED BY lock_intruder; DROP ROLE lock_intruder").unwrap();
}

#[test]
fn a_function_the_key_calls_is_kept_or_replaced_for_every_session() {
    let cluster = cluster();
    let mut c = db("ingest_key_function");
    c.batch_execute(
        "CREATE FUNCTION public.norm_pl(t text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS
           $$ BEGIN RETURN lower(t); END $$;
         CREATE FUNCTION public.norm_sql(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT lower(t)';
         CREATE TABLE pl (event_id text); CREATE TABLE inlined (event_id text);
         SELECT dedup.create_inbox('pl'); SELECT dedup.create_inbox('inlined');
         SELECT dedup.attach('pl', 'public.norm_pl(event_id)', inbox => 'pl');
         SELECT dedup.attach('inlined', 'public.norm_sql(event_id)', inbox => 'inlined');",
    )
    .unwrap();
    // Session S compiles both keys.
    let mut s = cluster.connect("ingest_key_function");
    s.batch_execute("INSERT INTO pl VALUES ('A'); INSERT INTO inlined VALUES ('A')").unwrap();
    // Before the fix the DROP went through and S failed with XX000 "cache lookup failed" until it reconnected.
    let err = c.batch_execute("DROP FUNCTION public.norm_pl(text)").unwrap_err();
    assert_eq!(sqlstate(&err), "2BP01", "{err}");
    // Replaced in place: S uses the new body at its next row (an SQL function was inlined into S's compiled key).
    c.batch_execute(
        "CREATE OR REPLACE FUNCTION public.norm_sql(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT upper(t)'",
    )
    .unwrap();
    s.batch_execute("INSERT INTO pl VALUES ('a'); INSERT INTO inlined VALUES ('b')").unwrap();
    assert_eq!(count(&mut s, "pl"), 1, "'a' is a duplicate of 'A'");
    let upper: bool = s.query_one("SELECT dedup.seen('B', 'inlined')", &[]).unwrap().get(0);
    assert!(upper, "the replaced function computed the key");
    // Dropped with CASCADE, the attachment goes with its trigger: S inserts without deduplication, without an error.
    c.batch_execute("DROP FUNCTION public.norm_pl(text) CASCADE").unwrap();
    s.batch_execute("INSERT INTO pl VALUES ('a')").unwrap();
    assert_eq!(count(&mut s, "pl"), 2);
    let left: i64 = s.query_one("SELECT count(*) FROM dedup.attachments", &[]).unwrap().get(0);
    assert_eq!(left, 1, "only `inlined` is attached still");
}

/// A DROP prunes attachments left without their trigger; it must never wait for another session's open transaction
/// that pruned (or holds) the same registry row.
#[test]
fn a_drop_never_waits_for_someone_elses_prune() {
    let cluster = cluster();
    let mut owner = db("ingest_prune_wait");
    owner
        .batch_execute(
            "CREATE TABLE own_t (id text); SELECT dedup.attach('own_t', 'id');
             ALTER TRIGGER zz_dedup_attached ON own_t RENAME TO zz_renamed;
             CREATE TABLE unrelated (x int);",
        )
        .unwrap();
    // The renamed trigger left a stale attachment; this session's DROP prunes it and stays open.
    let mut holder = cluster.connect("ingest_prune_wait");
    holder.batch_execute("BEGIN; CREATE TABLE scratch (x int); DROP TABLE scratch").unwrap();
    let mut other = cluster.connect("ingest_prune_wait");
    // Before the fix: 55P03 after 3 s, waiting on the holder's transaction.
    other.batch_execute("SET lock_timeout = '3s'; DROP TABLE unrelated").unwrap();
    holder.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut owner, "dedup.attachments"), 0, "pruned by the holder");
}

/// drop_inbox() waits for an attach() of the same inbox that is in progress, then sees its attachment and refuses.
#[test]
fn drop_inbox_sees_an_attachment_committed_while_it_waited() {
    let cluster = cluster();
    let mut a = db("ingest_drop_race");
    a.batch_execute("SELECT dedup.create_inbox('dix'); CREATE TABLE di (e text)").unwrap();
    a.batch_execute("BEGIN; SELECT dedup.attach('di', 'e', inbox => 'dix')").unwrap();
    let dropper = std::thread::spawn(move || {
        let mut b = cluster.connect("ingest_drop_race");
        b.batch_execute("SELECT dedup.drop_inbox('dix')").map_err(|e| sqlstate(&e))
    });
    let mut observer = cluster.connect("ingest_drop_race");
    eventually("drop_inbox() waits for the attach()", || {
        observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%drop_inbox%' AND wait_event_type = 'Lock'",
                &[],
            )
            .unwrap()
            .get::<_, i64>(0)
            == 1
    });
    a.batch_execute("COMMIT").unwrap();
    // Before the fix the drop went through, and every insert into di then failed (its inbox was gone).
    assert_eq!(dropper.join().unwrap(), Err("2BP01".to_owned()));
    a.batch_execute("INSERT INTO di VALUES ('x'), ('x')").unwrap();
    assert_eq!(count(&mut a, "di"), 1);
}
