//! The shared Bloom filter (preloaded servers): it answers "certainly new" without the index, and never hides a
//! live mark — after restarts and crashes, rows written without mark(), restores, standbys, logical replication,
//! rollbacks and many TTL cycles.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::time::Duration;

/// A preloaded cluster whose worker looks after database `worker_db`, and a fresh database `db` in it.
fn preloaded_db(db: &str, worker_db: &str, extra: &[&str]) -> (Cluster, Client) {
    let mut conf = vec!["dedup.bloom_capacity = 100000"];
    conf.extend_from_slice(extra);
    let cluster = preloaded(worker_db, &conf);
    let client = cluster.fresh_db(db);
    (cluster, client)
}

fn rebuild(c: &mut Client) {
    c.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
}

/// (lookups, certainly_new, false_positives) of an inbox.
fn counters(c: &mut Client, inbox: &str) -> (i64, i64, i64) {
    let r = c
        .query_one("SELECT lookups, certainly_new, false_positives FROM dedup.stats WHERE inbox = $1", &[&inbox])
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Every id is seen and is a duplicate, in `inbox`.
fn assert_all_marked(c: &mut Client, ids: &[String], inbox: &str) {
    let seen: i64 = c
        .query_one("SELECT count(*) FROM unnest($1::text[]) AS u(id) WHERE dedup.seen(u.id, $2)", &[&ids, &inbox])
        .unwrap()
        .get(0);
    assert_eq!(seen as usize, ids.len(), "seen() missed marks in {inbox}");
    let fresh = c.query("SELECT * FROM dedup.mark_many($1, NULL, $2)", &[&ids, &inbox]).unwrap();
    assert!(fresh.is_empty(), "{} marked ids were taken as new in {inbox}", fresh.len());
}

#[test]
fn the_filter_answers_certainly_new_and_never_hides_a_mark() {
    let (_cluster, mut c) = preloaded_db("bloom_basic", "bloom_basic", &[]);
    let marked = ids("m", 3000);
    c.query("SELECT * FROM dedup.mark_many($1)", &[&marked]).unwrap();
    wait_trusted(&mut c, "default");
    assert_all_marked(&mut c, &marked, "default");
    let (lookups, certain, _) = counters(&mut c, "default");
    let absent = ids("absent", 3000);
    let seen: i64 =
        c.query_one("SELECT count(*) FROM unnest($1::text[]) u WHERE dedup.seen(u)", &[&absent]).unwrap().get(0);
    assert_eq!(seen, 0);
    let (lookups2, certain2, _) = counters(&mut c, "default");
    assert_eq!(lookups2 - lookups, 3000);
    assert!(certain2 - certain > 2900, "the filter ruled out only {} of 3000 absent ids", certain2 - certain);
    // dedup.bloom = off: same answers, no lookups.
    c.batch_execute("SET dedup.bloom = off").unwrap();
    assert_all_marked(&mut c, &marked[..100], "default");
    assert_eq!(counters(&mut c, "default").0, lookups2, "no filter lookups with dedup.bloom = off");
}

#[test]
fn restarts_and_crashes_bypass_the_filter_until_it_is_reloaded() {
    // The worker looks after another database, so this one is only loaded when the test says so.
    let (cluster, mut c) = preloaded_db("bloom_restart", "postgres", &[]);
    let marked = ids("r", 2000);
    c.query("SELECT * FROM dedup.mark_many($1)", &[&marked]).unwrap();
    rebuild(&mut c);
    assert!(trusted(&mut c, "default"));
    cluster.restart();
    let mut c = cluster.connect("bloom_restart");
    assert!(!trusted(&mut c, "default"), "after a restart the empty filter must not be trusted");
    assert_all_marked(&mut c, &marked, "default");
    rebuild(&mut c);
    assert!(trusted(&mut c, "default"));
    assert_all_marked(&mut c, &marked, "default");

    let mut victim = cluster.connect("bloom_restart");
    let pid = backend_pid(&mut victim);
    cluster.crash_backend(pid);
    let mut c = cluster.connect("bloom_restart");
    assert!(!trusted(&mut c, "default"), "after a crash the re-created filter must not be trusted");
    assert_all_marked(&mut c, &marked, "default");
}

#[test]
fn the_worker_reloads_the_filter_after_a_restart() {
    let (cluster, mut c) = preloaded_db("bloom_worker", "bloom_worker", &[]);
    let marked = ids("w", 2000);
    c.query("SELECT * FROM dedup.mark_many($1)", &[&marked]).unwrap();
    cluster.restart();
    let mut c = cluster.connect("bloom_worker");
    wait_trusted(&mut c, "default");
    assert_all_marked(&mut c, &marked, "default");
}

#[test]
fn rows_written_without_mark_reach_the_filter() {
    let (_cluster, mut c) = preloaded_db("bloom_foreign", "bloom_foreign", &[]);
    c.batch_execute("SELECT dedup.create_inbox('other')").unwrap();
    wait_trusted(&mut c, "default");
    assert!(trusted(&mut c, "other"), "a new inbox is trusted at once");
    c.batch_execute(
        "INSERT INTO dedup.inbox_default VALUES ('inserted', now() + interval '1 hour'), ('to-update', now() + interval '1 hour');
         UPDATE dedup.inbox_default SET id = 'updated' WHERE id = 'to-update';
         INSERT INTO dedup.inbox_other SELECT 'bulk-' || g, now() + interval '1 hour' FROM generate_series(1, 500) g;",
    )
    .unwrap();
    let mut copy = c.copy_in("COPY dedup.inbox_default (id, expires_at) FROM STDIN").unwrap();
    use std::io::Write;
    copy.write_all(b"copied-1\t2999-01-01\ncopied-2\t2999-01-01\n").unwrap();
    copy.finish().unwrap();
    assert!(trusted(&mut c, "default"));
    let direct: Vec<String> = ["inserted", "updated", "copied-1", "copied-2"].map(String::from).to_vec();
    assert_all_marked(&mut c, &direct, "default");
    let bulk: Vec<String> = (1..=500).map(|i| format!("bulk-{i}")).collect();
    assert_all_marked(&mut c, &bulk, "other");
}

#[test]
fn rollbacks_forget_truncate_and_recreation_only_cause_false_positives() {
    let (_cluster, mut c) = preloaded_db("bloom_churn", "bloom_churn", &[]);
    wait_trusted(&mut c, "default");
    c.batch_execute("BEGIN; SELECT dedup.mark('rolled-back'); ROLLBACK").unwrap();
    assert!(!c.query_one("SELECT dedup.seen('rolled-back')", &[]).unwrap().get::<_, bool>(0));
    assert!(mark(&mut c, "rolled-back"), "a rolled-back mark leaves only a false positive");
    c.batch_execute("SELECT dedup.mark('f'); SELECT dedup.forget('f')").unwrap();
    assert!(mark(&mut c, "f"), "forgotten: new again");
    c.batch_execute("SELECT dedup.mark('t'); TRUNCATE dedup.inbox_default").unwrap();
    assert!(mark(&mut c, "t"), "truncated: new again");
    let (_, _, false_positives) = counters(&mut c, "default");
    assert!(false_positives >= 3, "the filter said maybe, the index said no: {false_positives}");
    c.batch_execute("SELECT dedup.create_inbox('x'); SELECT dedup.mark('a', NULL, 'x')").unwrap();
    c.batch_execute("SELECT dedup.drop_inbox('x'); SELECT dedup.create_inbox('x')").unwrap();
    assert!(c.query_one("SELECT dedup.mark('a', NULL, 'x')", &[]).unwrap().get::<_, bool>(0));
    c.batch_execute("SELECT dedup.mark('again', NULL, 'x')").unwrap();
    c.batch_execute("DROP EXTENSION pg_dedup CASCADE; CREATE EXTENSION pg_dedup").unwrap();
    assert!(mark(&mut c, "rolled-back"), "a re-created extension starts empty");
    wait_trusted(&mut c, "default");
    let marked = ids("after", 1000);
    c.query("SELECT * FROM dedup.mark_many($1)", &[&marked]).unwrap();
    assert_all_marked(&mut c, &marked, "default");
}

#[test]
fn restored_inboxes_are_not_trusted_until_loaded() {
    let (cluster, mut c) = preloaded_db("bloom_dump_src", "postgres", &[]);
    c.batch_execute("SELECT dedup.create_inbox('orders')").unwrap();
    let marked = ids("o", 1000);
    c.query("SELECT * FROM dedup.mark_many($1, NULL, 'orders')", &[&marked]).unwrap();
    dump_and_restore(&cluster, "bloom_dump_src", "bloom_dump_dst");
    let mut r = cluster.connect("bloom_dump_dst");
    assert!(!trusted(&mut r, "orders"), "a restored inbox has not been loaded");
    assert_all_marked(&mut r, &marked, "orders");
    rebuild(&mut r);
    assert!(trusted(&mut r, "orders"));
    assert_all_marked(&mut r, &marked, "orders");
}

#[test]
fn a_hot_standby_never_trusts_the_filter_and_promotion_keeps_every_mark() {
    let (primary, mut p) = preloaded_db("bloom_standby", "bloom_standby", &[]);
    let before = ids("before", 1000);
    p.query("SELECT * FROM dedup.mark_many($1)", &[&before]).unwrap();
    let standby = primary.standby();
    let after = ids("after", 1000);
    p.query("SELECT * FROM dedup.mark_many($1)", &[&after]).unwrap();
    let mut s = standby.connect("bloom_standby");
    eventually("the standby replays the marks", || {
        s.query_one("SELECT dedup.seen('after-999')", &[]).unwrap().get::<_, bool>(0)
    });
    let state: String = s.query_one("SELECT filter_state FROM dedup.stats", &[]).unwrap().get(0);
    assert_eq!(state, "off: hot standby");
    let seen: i64 = s
        .query_one(
            "SELECT count(*) FROM unnest($1::text[]) u WHERE dedup.seen(u)",
            &[&[before.clone(), after.clone()].concat()],
        )
        .unwrap()
        .get(0);
    assert_eq!(seen, 2000);
    drop(p);
    primary.stop();
    standby.promote();
    let mut s = standby.connect("bloom_standby");
    let all = [before, after].concat();
    assert_all_marked(&mut s, &all, "default");
    wait_trusted(&mut s, "default");
    assert_all_marked(&mut s, &all, "default");
}

#[test]
fn logically_replicated_rows_reach_the_subscribers_filter() {
    let (publisher, mut p) = preloaded_db("bloom_pub", "postgres", &["wal_level = logical"]);
    let (_subscriber, mut s) = preloaded_db("bloom_sub", "bloom_sub", &[]);
    let initial = ids("initial", 500);
    p.query("SELECT * FROM dedup.mark_many($1)", &[&initial]).unwrap();
    p.batch_execute("CREATE PUBLICATION marks FOR TABLE dedup.inbox_default").unwrap();
    wait_trusted(&mut s, "default");
    s.batch_execute(&format!(
        "CREATE SUBSCRIPTION marks CONNECTION '{}' PUBLICATION marks",
        publisher.conn_string("bloom_pub", "postgres")
    ))
    .unwrap();
    let streamed = ids("streamed", 500);
    p.query("SELECT * FROM dedup.mark_many($1)", &[&streamed]).unwrap();
    eventually("replication catches up", || count(&mut s, "dedup.inbox_default") >= 1000);
    assert!(trusted(&mut s, "default"), "replicated rows passed the trigger, so the filter stays trusted");
    assert_all_marked(&mut s, &[initial, streamed].concat(), "default");
    s.batch_execute("ALTER SUBSCRIPTION marks DISABLE; ALTER SUBSCRIPTION marks SET (slot_name = NONE)").unwrap();
    s.batch_execute("DROP SUBSCRIPTION marks").unwrap();
    // The publisher's walsender lets go of the slot a moment after the subscription is disabled.
    eventually("the publisher's walsender releases the slot", || {
        !p.query_one("SELECT active FROM pg_replication_slots WHERE slot_name = 'marks'", &[])
            .unwrap()
            .get::<_, bool>(0)
    });
    p.batch_execute("SELECT pg_drop_replication_slot('marks')").unwrap();
}

#[test]
fn concurrent_marks_with_the_filter_claim_each_id_once() {
    let (cluster, mut c) = preloaded_db("bloom_race", "bloom_race", &[]);
    wait_trusted(&mut c, "default");
    let cluster = &cluster;
    let wins: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|w| {
                s.spawn(move || {
                    let mut c = cluster.connect("bloom_race");
                    let mut won = Vec::new();
                    for round in 0..100 {
                        let batch: Vec<String> =
                            (0..10).map(|k| format!("id-{}", (round * 3 + k * 11 + w) % 300)).collect();
                        won.extend(
                            c.query("SELECT * FROM dedup.mark_many($1)", &[&batch]).unwrap().iter().map(|r| r.get(0)),
                        );
                    }
                    won
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    let unique: std::collections::HashSet<_> = wins.iter().collect();
    assert_eq!(unique.len(), wins.len(), "an id was claimed twice");
    assert_eq!(count(&mut c, "dedup.inbox_default") as usize, wins.len());
}

#[test]
fn the_false_positive_rate_stays_at_target_over_many_ttl_cycles() {
    const CAPACITY: usize = 20_000;
    const TARGET: f64 = 0.01;
    let (_cluster, mut c) = preloaded_db(
        "bloom_cycles",
        "bloom_cycles",
        &["dedup.bloom_capacity = 20000", "dedup.bloom_false_positive_rate = 0.01"],
    );
    wait_trusted(&mut c, "default");
    let live = CAPACITY * 3 / 4;
    for cycle in 0..6 {
        let wave = ids(&format!("cycle{cycle}"), live);
        c.query("SELECT * FROM dedup.mark_many($1, '1 second')", &[&wave]).unwrap();
        wait_until_expired(&mut c, "dedup.inbox_default", &[wave[0].as_str(), wave[live - 1].as_str()]);
    }
    let current = ids("current", live);
    c.query("SELECT * FROM dedup.mark_many($1, '1 hour')", &[&current]).unwrap();
    // Give the worker the chance to rotate (it checks every second); it must not need more than a few.
    eventually("the worker brings the false-positive rate back to target", || {
        let estimated: f64 = c.query_one("SELECT filter_estimated_fpr FROM dedup.stats", &[]).unwrap().get(0);
        estimated <= 1.1 * TARGET && trusted(&mut c, "default")
    });
    let rebuilds: i64 = c.query_one("SELECT filter_rebuilds FROM dedup.stats", &[]).unwrap().get(0);
    assert!(rebuilds >= 3, "expired marks should have forced rotations, saw {rebuilds}");
    let (lookups, certain, _) = counters(&mut c, "default");
    let trials = 50_000;
    let seen: i64 = c
        .query_one(
            "SELECT count(*) FROM generate_series(1, $1) g WHERE dedup.seen('absent-' || g)",
            &[&(trials as i32)],
        )
        .unwrap()
        .get(0);
    assert_eq!(seen, 0);
    let (lookups2, certain2, _) = counters(&mut c, "default");
    assert_eq!(lookups2 - lookups, trials);
    let measured = (trials - (certain2 - certain)) as f64 / trials as f64;
    assert!(measured <= 1.2 * TARGET, "measured false-positive rate {measured} vs target {TARGET}");
    assert_all_marked(&mut c, &current, "default");
}

#[test]
fn marks_committed_while_the_filter_rotates_are_never_hidden() {
    // Marks whose transactions straddle a rotation (their keys may land in the generation being cleared) must be
    // in the new generation all the same. The worker looks elsewhere; this test rotates by hand, over and over.
    let (cluster, mut c) = preloaded_db("bloom_rotation_race", "postgres", &[]);
    rebuild(&mut c);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let cluster = &cluster;
    let marked: Vec<String> = std::thread::scope(|s| {
        let markers: Vec<_> = (0..2)
            .map(|w| {
                let stop = &stop;
                s.spawn(move || {
                    let mut m = cluster.connect("bloom_rotation_race");
                    let mut ids = Vec::new();
                    for i in 0.. {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        let id = format!("race-{w}-{i}");
                        m.batch_execute("BEGIN").unwrap();
                        m.execute("SELECT dedup.mark($1)", &[&id]).unwrap();
                        std::thread::sleep(Duration::from_millis(3));
                        m.batch_execute("COMMIT").unwrap();
                        ids.push(id);
                    }
                    ids
                })
            })
            .collect();
        let mut r = cluster.connect("bloom_rotation_race");
        for _ in 0..30 {
            r.batch_execute("SELECT dedup.bloom_rebuild()").unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        markers.into_iter().flat_map(|m| m.join().unwrap()).collect()
    });
    assert!(trusted(&mut c, "default"));
    let hidden: Vec<&String> =
        marked.iter().filter(|id| !c.query_one("SELECT dedup.seen($1)", &[id]).unwrap().get::<_, bool>(0)).collect();
    assert!(
        hidden.is_empty(),
        "{} of {} committed marks hidden by the filter: {:?}",
        hidden.len(),
        marked.len(),
        &hidden[..hidden.len().min(5)]
    );
}

#[test]
fn an_undersized_filter_is_reported_with_the_capacity_to_set() {
    let (cluster, mut c) = preloaded_db("bloom_undersized", "bloom_undersized", &["dedup.bloom_capacity = 1000"]);
    wait_trusted(&mut c, "default");
    c.query("SELECT * FROM dedup.mark_many($1, '1 hour')", &[&ids("live", 6000)]).unwrap();
    // The measured false-positive rate is far above target now: the worker rotates, reloads 6,000 live marks
    // into room for 1,000, and says what to set.
    eventually("the worker reports the undersized filter", || cluster.log().contains("the Bloom filter is undersized"));
    let log = cluster.log();
    let line = log.lines().find(|l| l.contains("the Bloom filter is undersized")).unwrap();
    assert!(line.contains("WARNING"), "{line}");
    assert!(line.contains("6000 live marks") && line.contains("set dedup.bloom_capacity to at least 12000"), "{line}");
    assert_all_marked(&mut c, &ids("live", 6000), "default");
}
