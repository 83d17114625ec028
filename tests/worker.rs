//! The purge worker on preloaded servers: expired marks go, live ones stay, renewals win, `dedup.purge()` through
//! SQL skips a held row from the batch that met it on, the worker survives being terminated, follows config reloads
//! (and stops when its database leaves the list), waits for missing databases and extensions, and outlives an ERROR.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::thread;
use std::time::Duration;

/// A preloaded server whose workers purge every second.
fn purging(databases: &str, extra: &[&str]) -> Cluster {
    let mut conf = vec!["dedup.purge_interval = '1s'"];
    conf.extend_from_slice(extra);
    preloaded(databases, &conf)
}

/// The pid of the worker serving `db`. A worker started while another still serves the database sees it and
/// leaves at once, so two may show for a moment: the one that stays is the older.
fn worker_pid(c: &mut Client, db: &str) -> Option<i32> {
    c.query_opt(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_dedup worker' AND datname = $1
         ORDER BY backend_start LIMIT 1",
        &[&db],
    )
    .unwrap()
    .map(|r| r.get(0))
}

fn launcher_pid(c: &mut Client) -> Option<i32> {
    c.query_opt("SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_dedup launcher'", &[])
        .unwrap()
        .map(|r| r.get(0))
}

fn expire_soon(c: &mut Client, prefix: &str, n: i32) {
    c.execute(
        "SELECT count(*) FROM dedup.mark_many(array(SELECT $1 || g FROM generate_series(1, $2) g), '1 second')",
        &[&prefix, &n],
    )
    .unwrap();
}

#[test]
fn expired_marks_disappear_within_a_few_cycles_and_live_ones_stay() {
    let cluster = purging("purge_basic", &["dedup.purge_batch_size = 100"]);
    let mut c = cluster.fresh_db("purge_basic");
    c.batch_execute("SELECT dedup.create_inbox('other')").unwrap();
    expire_soon(&mut c, "e", 1000);
    c.batch_execute(
        "SELECT dedup.mark_many(array(SELECT 'o' || g FROM generate_series(1, 300) g), '1 second', 'other')",
    )
    .unwrap();
    c.batch_execute("SELECT dedup.mark_many(array(SELECT 'live' || g FROM generate_series(1, 50) g), '1 hour')")
        .unwrap();
    eventually("the expired marks are purged", || {
        count(&mut c, "dedup.inbox_default") == 50 && count(&mut c, "dedup.inbox_other") == 0
    });
    let live: i64 = c.query_one("SELECT count(*) FROM dedup.inbox_default WHERE id LIKE 'live%'", &[]).unwrap().get(0);
    assert_eq!(live, 50, "live marks must stay");
    let row = c
        .query_one(
            "SELECT sum(purged)::bigint, min(purge_cycles), bool_and(last_purge_start IS NOT NULL) FROM dedup.stats",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1300, "dedup.stats counts every purged mark");
    assert!(row.get::<_, i64>(1) >= 1 && row.get::<_, bool>(2));
    // Autovacuum knows of the dead rows only through the table statistics the worker reports.
    eventually("the purged rows reach the table statistics", || {
        let deleted: i64 = c
            .query_one(
                "SELECT coalesce(sum(n_tup_del), 0)::bigint FROM pg_stat_user_tables WHERE schemaname = 'dedup'",
                &[],
            )
            .unwrap()
            .get(0);
        deleted >= 1300 // a quick attempt rolled back would count its deletes too
    });
}

/// Turns purging on for a server started with `dedup.purge = off`: its worker starts a cycle at once.
fn turn_purging_on(c: &mut Client) {
    c.batch_execute("ALTER SYSTEM SET dedup.purge = on").unwrap();
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
}

/// The marks of the default inbox the worker has purged (`dedup.stats`, counted as each batch goes).
fn purged(c: &mut Client) -> i64 {
    c.query_one("SELECT purged FROM dedup.stats WHERE inbox = 'default'", &[]).unwrap().get(0)
}

/// The purge cycles the worker has ended since it started.
fn cycles(c: &mut Client) -> i64 {
    c.query_one("SELECT coalesce(purge_cycles, 0) FROM dedup.worker_stats()", &[]).unwrap().get(0)
}

/// The index entries (`idx_tup_read` of the `expires_at` btree) one purge cycle reads to delete 5,000 marks in batches
/// of 100, the marks loaded by one INSERT with `expires_at` (of g, 1 to 5,000), in a fresh cluster named `name`.
fn entries_one_cycle_reads(name: &str, expires_at: &str) -> i64 {
    // One cycle only, once purging is turned on: the next would read the entries of the rows this one deleted.
    let cluster = purging(name, &["dedup.purge_batch_size = 100", "dedup.purge = off", "dedup.purge_interval = '1h'"]);
    let mut c = cluster.fresh_db(name);
    let read = |c: &mut Client| -> i64 {
        c.query_one(
            "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelid = 'dedup.inbox_default_expires_at_idx'::regclass",
            &[],
        )
        .unwrap()
        .get(0)
    };
    c.batch_execute(&format!(
        "INSERT INTO dedup.inbox_default SELECT 'e' || g, {expires_at} FROM generate_series(1, 5000) g"
    ))
    .unwrap();
    let before = read(&mut c);
    turn_purging_on(&mut c);
    // Not count(*): a scan of the table may read the same btree.
    eventually("the expired marks are purged and the reads counted", || {
        purged(&mut c) == 5000 && read(&mut c) - before >= 5000
    });
    // The worker reports its statistics after a cycle, at most once a second.
    thread::sleep(Duration::from_millis(1500));
    read(&mut c) - before
}

/// Each batch of a cycle starts in the `expires_at` btree where the one before it stopped: starting at the first
/// entry, it would read again the entries of the rows the batches before it deleted (they stay until a vacuum, each
/// read again until a walk marks it dead), and this cycle read 57,935 entries to delete 5,000 rows that way.
#[test]
fn a_purge_cycle_reads_each_expired_entry_about_once() {
    // Each its own expiry, as marks made one by one.
    let entries = entries_one_cycle_reads("purge_walk", "now() - interval '1 hour' + g * interval '1 ms'");
    // 5,000, the entry each batch stopped at read again by the next (49), and the last batch's look past the end.
    assert!(entries <= 5500, "{entries} index entries read to purge 5,000 marks in batches of 100");
}

/// Marks of one expiry (those of one statement) give a batch no place past the rows of the batch before it: it walks
/// over them again, and over those of every batch before whose entries no walk has marked dead yet, which a walk may
/// only do once the deletes' commits are on disk. The worker flushes the WAL before such a batch, so each
/// batch walks over its own rows and those of the last batch or two; without the flush this cycle read 98,000 to
/// 110,000 entries (debug builds, PG 13, 15 and 18), with it about 15,000.
#[test]
fn a_purge_cycle_over_marks_of_one_expiry_reads_each_entry_a_few_times() {
    let entries = entries_one_cycle_reads("purge_walk_shared", "now() - interval '1 hour'");
    // Equal keys share posting lists of about 200 entries, and a walk marks a posting list dead only once every row
    // in it is: one spans two batches of 100, so each batch walks over the last two's rows (5,000 + 49 x 200).
    assert!(entries <= 20_000, "{entries} index entries read to purge 5,000 marks of one expiry in batches of 100");
}

/// The expiry of the marks `marks_of_one_expiry` inserts.
const ONE_EXPIRY: &str = "'2000-01-01 00:00:00+00'";

/// Inserts `n` marks named `prefix` and a number, all of `ONE_EXPIRY`, padded so that a few fill a heap page; returns
/// their tids (as text) in tid order, the order a walk of the btree meets them in (equal keys go in tid order). Their
/// entries in the `expires_at` btree stay one per row: equal keys would otherwise share posting lists, which a walk
/// marks dead only once it has found every row in them dead, and a test of what is marked dead would see less.
fn marks_of_one_expiry(c: &mut Client, prefix: &str, n: i64) -> Vec<String> {
    c.batch_execute("ALTER INDEX dedup.inbox_default_expires_at_idx SET (deduplicate_items = off)").unwrap();
    let mut tids: Vec<(i32, i32, String)> = c
        .query(
            &format!(
                "INSERT INTO dedup.inbox_default
                     SELECT '{prefix}' || g || repeat('.', 200), {ONE_EXPIRY} FROM generate_series(1, {n}) g
                 RETURNING (ctid::text::point)[0]::int, (ctid::text::point)[1]::int, ctid::text"
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    tids.sort();
    tids.into_iter().map(|(_, _, tid)| tid).collect()
}

/// The marks of `ONE_EXPIRY` that a scan of the `expires_at` btree finds, and those a scan of the table finds, in
/// `c`'s transaction or snapshot: an entry marked dead while its row is still seen hides the row from the first.
fn through_btree_and_table(c: &mut Client) -> (i64, i64) {
    let mut through = |scans: &str| -> i64 {
        c.batch_execute(&format!(
            "SET enable_seqscan = off; SET enable_indexscan = off; SET enable_indexonlyscan = off;
             SET enable_bitmapscan = off; SET {scans} = on"
        ))
        .unwrap();
        let n = c
            .query_one(&format!("SELECT count(*) FROM dedup.inbox_default WHERE expires_at = {ONE_EXPIRY}"), &[])
            .unwrap()
            .get(0);
        c.batch_execute(
            "RESET enable_seqscan; RESET enable_indexscan; RESET enable_indexonlyscan; RESET enable_bitmapscan",
        )
        .unwrap();
        n
    };
    (through("enable_indexscan"), through("enable_seqscan"))
}

/// What the worker's DEBUG1 lines say its batches met of the entries of the rows the batch before each had deleted:
/// (those whose rows it did not read again, those whose rows it read because their heap page had changed).
fn rewalked(cluster: &Cluster) -> (i64, i64) {
    let number_after = |line: &str, words: &str| -> i64 {
        line.split(words).nth(1).and_then(|rest| rest.split(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    cluster
        .log()
        .lines()
        .filter(|line| line.contains("of the rows the last one deleted"))
        .map(|line| (number_after(line, " met "), number_after(line, " and read ")))
        .fold((0, 0), |(unread, read), (met, again)| (unread + met - again, read + again))
}

/// Marks of one expiry: each batch walks again over the entries of the rows the last one deleted, and marks them
/// dead without reading those rows from the heap, once their deletion is dead to every transaction.
#[test]
fn a_batch_marks_the_last_batchs_entries_dead_without_reading_their_rows() {
    let cluster = purging(
        "purge_unvisited",
        &[
            "dedup.purge_batch_size = 100",
            "dedup.purge = off",
            "dedup.purge_interval = '1h'",
            "log_min_messages = debug1",
            "autovacuum = off",
        ],
    );
    let mut c = cluster.fresh_db("purge_unvisited");
    marks_of_one_expiry(&mut c, "e", 5000);
    turn_purging_on(&mut c);
    eventually("the cycle has purged the expired marks", || cycles(&mut c) > 0);
    assert_eq!(purged(&mut c), 5000);
    let (unread, _) = rewalked(&cluster);
    // The 49 batches after the first and the last, which deletes nothing, each after 100 rows the one before deleted.
    assert!(unread >= 2_500, "{unread} entries marked dead without reading their rows, of 5,000");
    assert_eq!(through_btree_and_table(&mut c), (0, 0));
}

/// A line pointer that VACUUM freed between two batches and a new mark of the same expiry took is not the row the
/// last batch deleted: the next batch reads it, and purges it.
#[test]
fn a_row_given_the_place_of_one_the_last_batch_deleted_is_read_and_purged() {
    let cluster = purging(
        "purge_reused",
        &[
            "dedup.purge_batch_size = 100",
            "dedup.purge_batch_delay = 60000",
            "dedup.purge = off",
            "autovacuum = off",
            "log_min_messages = debug1",
        ],
    );
    let mut c = cluster.fresh_db("purge_reused");
    // The first batch's rows.
    let first_batch = &marks_of_one_expiry(&mut c, "e", 300)[..100];
    turn_purging_on(&mut c);
    // The reload that turned purging on does not cut the pause after the first batch short.
    eventually("the first batch has committed", || count(&mut c, "dedup.inbox_default") == 200);
    // Within the pause before the next batch: their line pointers freed, and new marks of the same expiry in them,
    // which the next batch meets first.
    c.batch_execute("VACUUM (INDEX_CLEANUP ON) dedup.inbox_default").unwrap();
    marks_of_one_expiry(&mut c, "n", 100);
    assert_eq!(count(&mut c, "dedup.inbox_default"), 300, "the next batch ran before the test was ready");
    let reused: i64 = c
        .query_one(
            "SELECT count(*) FROM dedup.inbox_default WHERE id LIKE 'n%' AND ctid::text = ANY ($1)",
            &[&first_batch],
        )
        .unwrap()
        .get(0);
    assert!(reused > 0, "no new mark took the place of one the first batch deleted: the test shows nothing");
    // A reload that shortens the delay ends the pause under way.
    c.batch_execute("ALTER SYSTEM SET dedup.purge_batch_delay = 10").unwrap();
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
    eventually("every mark, old and new, is purged", || through_btree_and_table(&mut c) == (0, 0));
    let (_, read) = rewalked(&cluster);
    assert!(read >= reused, "the next batch read {read} rows in places the first had emptied, of {reused}");
}

/// A transaction whose snapshot still sees the deleted rows keeps their entries alive: it finds them through the
/// `expires_at` btree as through the table.
#[test]
fn an_older_snapshot_still_finds_the_purged_rows_through_the_btree() {
    let cluster = purging(
        "purge_snapshot",
        &["dedup.purge_batch_size = 100", "dedup.purge = off", "dedup.purge_interval = '1h'", "autovacuum = off"],
    );
    let mut c = cluster.fresh_db("purge_snapshot");
    marks_of_one_expiry(&mut c, "e", 1000);
    let mut reader = cluster.connect("purge_snapshot");
    reader.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM dedup.inbox_default").unwrap();
    turn_purging_on(&mut c);
    eventually("the expired marks are purged", || purged(&mut c) == 1000);
    eventually("the cycle has ended, its last batch having walked over the last rows", || cycles(&mut c) > 0);
    assert_eq!(through_btree_and_table(&mut reader), (1000, 1000));
    reader.batch_execute("COMMIT").unwrap();
}

/// A row a batch passed over because another transaction held it is met again within the same cycle once a purge
/// interval has passed since the walk last started at the first entry: in a cycle that does not end (expired marks
/// coming as fast as it purges), waiting for the next cycle would be waiting for ever.
#[test]
fn a_row_passed_over_in_a_long_cycle_is_met_again_within_it() {
    // 1,000 expired marks in batches of 10, 100 ms apart: a cycle of about 10 s, against an interval of 1 s.
    let cluster = purging(
        "purge_revisit",
        &["dedup.purge_batch_size = 10", "dedup.purge_batch_delay = 100", "dedup.purge = off"],
    );
    let mut c = cluster.fresh_db("purge_revisit");
    c.batch_execute(
        "INSERT INTO dedup.inbox_default VALUES ('held', now() - interval '2 hours');
         INSERT INTO dedup.inbox_default
             SELECT 'e' || g, now() - interval '1 hour' + g * interval '1 ms' FROM generate_series(1, 1000) g",
    )
    .unwrap();
    let mut holder = cluster.connect("purge_revisit");
    holder.batch_execute("BEGIN; SELECT 1 FROM dedup.inbox_default WHERE id = 'held' FOR UPDATE").unwrap();
    turn_purging_on(&mut c);
    eventually("the first batches passed the held row", || purged(&mut c) >= 20);
    holder.batch_execute("COMMIT").unwrap();
    eventually("the held row is purged", || {
        !c.query_one("SELECT EXISTS (SELECT 1 FROM dedup.inbox_default WHERE id = 'held')", &[])
            .unwrap()
            .get::<_, bool>(0)
    });
    let left = count(&mut c, "dedup.inbox_default");
    assert!(left > 0, "the held row waited for the cycle's end");
}

#[test]
fn a_mark_renewing_an_expired_id_wins_against_a_purge() {
    // dedup.purge() runs the worker's batch statement; two orders of the race, each forced with row locks.
    let mut setup = db("purge_race");
    setup.batch_execute("SELECT dedup.mark('x', '1 second'); SELECT dedup.mark('y', '1 second')").unwrap();
    wait_until_expired(&mut setup, "dedup.inbox_default", &["x", "y"]);

    // The purge deletes first and holds the row; the renewing mark waits, then re-inserts: the id stays marked.
    let mut purger = connect("purge_race");
    purger.batch_execute("BEGIN").unwrap();
    let purged: i64 = purger.query_one("SELECT dedup.purge(NULL, 1)", &[]).unwrap().get(0);
    assert_eq!(purged, 1);
    let gone: String = purger
        .query_one("SELECT i FROM unnest(array['x','y']) i EXCEPT SELECT id FROM dedup.inbox_default", &[])
        .unwrap()
        .get(0);
    let mut marker = connect("purge_race");
    let pid = backend_pid(&mut marker);
    let renewing = gone.clone();
    let waiter = thread::spawn(move || {
        marker.query_one("SELECT dedup.mark($1, '1 hour')", &[&renewing]).map(|r| r.get::<_, bool>(0))
    });
    wait_until_blocked(&mut setup, pid);
    purger.batch_execute("COMMIT").unwrap();
    assert!(waiter.join().unwrap().unwrap(), "the expired id is new again");
    let live: bool = setup
        .query_one("SELECT expires_at > now() + interval '50 minutes' FROM dedup.inbox_default WHERE id = $1", &[&gone])
        .unwrap()
        .get(0);
    assert!(live, "the id stays marked with its new expiry");

    // The mark renews first and holds the row; the purge skips it without waiting.
    let other = if gone == "x" { "y" } else { "x" };
    let mut marker = connect("purge_race");
    marker.batch_execute("BEGIN").unwrap();
    assert!(marker.query_one("SELECT dedup.mark($1, '1 hour')", &[&other]).unwrap().get::<_, bool>(0));
    let purged: i64 = purger.query_one("SELECT dedup.purge()", &[]).unwrap().get(0);
    assert_eq!(purged, 0, "a row being renewed is skipped, not waited for");
    marker.batch_execute("COMMIT").unwrap();
    assert!(!mark(&mut setup, other), "the renewed id is live");
    assert_no_resource_leaks(cluster());
}

/// Through SQL (here an owner's trigger), `dedup.purge()` runs batches that double in size; once one batch met a held
/// row and had to skip it, the batches after it skip at once, rather than delete a large batch and undo it for the
/// same row.
#[test]
fn a_purge_through_sql_that_met_a_held_row_skips_from_then_on() {
    let mut setup = db("purge_held_sql");
    setup
        .batch_execute(
            "SELECT dedup.create_inbox('owned');
             CREATE FUNCTION pass() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN OLD; END $$;
             CREATE TRIGGER pass BEFORE DELETE ON dedup.inbox_owned FOR EACH ROW EXECUTE FUNCTION pass();
             INSERT INTO dedup.inbox_owned
                 SELECT 'e' || g, now() - interval '1 hour' + g * interval '1 ms' FROM generate_series(1, 60000) g;
             -- Stored last, so a batch's DELETE (in heap order) reaches it after every other row of the batch;
             -- expiring among the first rows, it is in the second batch and in each one after.
             INSERT INTO dedup.inbox_owned VALUES ('held', now() - interval '1 hour' + interval '15 s')",
        )
        .unwrap();
    let mut holder = connect("purge_held_sql");
    holder.batch_execute("BEGIN; SELECT 1 FROM dedup.inbox_owned WHERE id = 'held' FOR UPDATE").unwrap();
    let mut purger = connect("purge_held_sql");
    purger.batch_execute("BEGIN").unwrap();
    let purged: i64 = purger.query_one("SELECT dedup.purge('owned')", &[]).unwrap().get(0);
    assert_eq!(purged, 60_000, "every expired mark but the held one");
    // Deletes undone count too. Batches of 10,000, 20,000 and 40,000: the second's quick attempt deletes 19,999
    // rows, meets the held row, is undone and skips it; the third skips at once (30,000). Another quick attempt
    // there would delete and undo those 30,000 first: 109,999.
    let deletes: i64 =
        purger.query_one("SELECT pg_stat_get_xact_tuples_deleted('dedup.inbox_owned'::regclass)", &[]).unwrap().get(0);
    assert_eq!(deletes, 10_000 + 19_999 + 20_000 + 30_000);
    purger.batch_execute("COMMIT").unwrap();
    holder.batch_execute("COMMIT").unwrap();
    assert_eq!(count(&mut setup, "dedup.inbox_owned"), 1, "the held mark waits for a later purge");
}

#[test]
fn the_worker_comes_back_after_pg_terminate_backend() {
    let cluster = purging("purge_terminate", &[]);
    let mut c = cluster.fresh_db("purge_terminate");
    let mut first = None;
    eventually("the worker starts", || {
        first = worker_pid(&mut c, "purge_terminate");
        first.is_some()
    });
    c.execute("SELECT pg_terminate_backend($1)", &[&first.unwrap()]).unwrap();
    let launcher = launcher_pid(&mut c).expect("the launcher runs");
    c.execute("SELECT pg_terminate_backend($1)", &[&launcher]).unwrap();
    eventually("a new worker runs", || worker_pid(&mut c, "purge_terminate").is_some_and(|p| Some(p) != first));
    eventually("a new launcher runs", || launcher_pid(&mut c).is_some_and(|p| p != launcher));
    expire_soon(&mut c, "t", 100);
    eventually("the new worker purges", || count(&mut c, "dedup.inbox_default") == 0);
    let workers: i64 = c
        .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_dedup worker'", &[])
        .unwrap()
        .get(0);
    assert_eq!(workers, 1, "a restarted launcher must not start a second worker for the database");
}

/// A SIGTERM that arrives while a cycle pauses between two batches stops the cycle and the worker: it once stopped
/// only the cycle (pgrx clears the flag as it reads it), and the terminated worker ran on.
#[test]
fn a_worker_terminated_between_two_batches_leaves() {
    let cluster = purging("purge_midcycle", &["dedup.purge_batch_size = 10", "dedup.purge_batch_delay = 200"]);
    let mut c = cluster.fresh_db("purge_midcycle");
    expire_soon(&mut c, "m", 2000);
    eventually("the purge is under way", || count(&mut c, "dedup.inbox_default") < 1990);
    let pid = worker_pid(&mut c, "purge_midcycle").expect("the worker runs");
    c.execute("SELECT pg_terminate_backend($1)", &[&pid]).unwrap();
    eventually("the terminated worker leaves", || {
        !c.query_one("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", &[&pid])
            .unwrap()
            .get::<_, bool>(0)
    });
    eventually("a new worker goes on purging", || count(&mut c, "dedup.inbox_default") < 1900);
}

#[test]
fn a_config_reload_changes_the_interval() {
    let cluster = purging("purge_reload", &["dedup.purge_interval = '1h'"]);
    let mut c = cluster.fresh_db("purge_reload");
    eventually("the first cycle ran", || {
        c.query_one("SELECT coalesce(purge_cycles, 0) FROM dedup.stats", &[]).unwrap().get::<_, i64>(0) >= 1
    });
    expire_soon(&mut c, "r", 100);
    wait_until_expired(&mut c, "dedup.inbox_default", &["r1", "r100"]);
    thread::sleep(Duration::from_secs(2));
    assert_eq!(count(&mut c, "dedup.inbox_default"), 100, "the next cycle is an hour away");
    c.batch_execute("ALTER SYSTEM SET dedup.purge_interval = '1s'").unwrap();
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
    eventually("the reloaded interval applies", || count(&mut c, "dedup.inbox_default") == 0);
}

#[test]
fn a_worker_stops_when_its_database_leaves_dedup_database() {
    let cluster = purging("purge_leave_a, purge_leave_b", &[]);
    let mut a = cluster.fresh_db("purge_leave_a");
    let mut b = cluster.fresh_db("purge_leave_b");
    eventually("both workers run", || {
        worker_pid(&mut a, "purge_leave_a").is_some() && worker_pid(&mut a, "purge_leave_b").is_some()
    });
    // The worker of b was started by a launcher that is now gone: the new launcher did not start it.
    let launcher = launcher_pid(&mut a).expect("the launcher runs");
    a.execute("SELECT pg_terminate_backend($1)", &[&launcher]).unwrap();
    eventually("a new launcher runs", || launcher_pid(&mut a).is_some_and(|p| p != launcher));
    a.batch_execute("ALTER SYSTEM SET dedup.database = 'purge_leave_a'").unwrap();
    a.batch_execute("SELECT pg_reload_conf()").unwrap();
    eventually("the worker of b stops", || worker_pid(&mut a, "purge_leave_b").is_none());
    expire_soon(&mut b, "b", 10);
    thread::sleep(Duration::from_secs(3));
    assert!(worker_pid(&mut a, "purge_leave_b").is_none(), "nobody starts it again");
    assert_eq!(count(&mut b, "dedup.inbox_default"), 10, "b is not purged any more");
    assert!(worker_pid(&mut a, "purge_leave_a").is_some(), "the worker of a still runs");
    assert!(cluster.log().contains("\"purge_leave_b\" is no longer in dedup.database"), "{}", cluster.log());
}

#[test]
fn a_database_listed_twice_gets_one_worker() {
    let cluster = purging("purge_twice, purge_other, purge_twice", &[]);
    let mut c = cluster.fresh_db("purge_twice");
    eventually("the worker starts", || worker_pid(&mut c, "purge_twice").is_some());
    thread::sleep(Duration::from_secs(3));
    let workers: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_dedup worker' AND datname = 'purge_twice'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(workers, 1);
}

#[test]
fn a_session_in_a_database_no_worker_looks_after_is_told_once() {
    let cluster = purging("purge_served", &[]);
    cluster.fresh_db("purge_served");
    cluster.fresh_db("purge_unserved");
    let (mut served, told_served) = connect_keeping_notices(&cluster, "purge_served");
    assert!(mark(&mut served, "a"));
    assert!(told_served.lock().unwrap().is_empty(), "{:?}", told_served.lock().unwrap());
    let (mut c, told) = connect_keeping_notices(&cluster, "purge_unserved");
    assert!(mark(&mut c, "a"));
    assert!(!mark(&mut c, "a"));
    c.query("SELECT * FROM dedup.mark_many(ARRAY['b', 'c'])", &[]).unwrap();
    let told = told.lock().unwrap();
    assert_eq!(told.len(), 1, "once per session: {told:?}");
    let (message, hint) = &told[0];
    assert!(message.starts_with("dedup: no pg_dedup worker looks after database \"purge_unserved\""), "{message}");
    assert!(hint.contains("ALTER SYSTEM SET dedup.database = 'purge_served, purge_unserved'"), "{hint}");
}

#[test]
fn missing_databases_and_extensions_are_waited_for_without_a_crash_loop() {
    let cluster = purging("purge_later, purge_noext", &[]);
    let mut admin = cluster.connect("postgres");
    admin.batch_execute("CREATE DATABASE purge_noext").unwrap();
    let launcher = launcher_pid(&mut admin).expect("the launcher runs");
    eventually("the worker of the database without the extension runs", || {
        worker_pid(&mut admin, "purge_noext").is_some()
    });
    let waiting = worker_pid(&mut admin, "purge_noext");
    thread::sleep(Duration::from_secs(3));
    assert_eq!(launcher_pid(&mut admin), Some(launcher), "the launcher must not restart");
    assert_eq!(worker_pid(&mut admin, "purge_noext"), waiting, "a worker waiting for the extension must not restart");
    // Both arrive later: the database, and the extension in the other one.
    let mut later = cluster.fresh_db("purge_later");
    let mut noext = cluster.connect("purge_noext");
    noext.batch_execute("CREATE EXTENSION pg_dedup").unwrap();
    expire_soon(&mut later, "l", 50);
    expire_soon(&mut noext, "n", 50);
    eventually("both databases are purged", || {
        count(&mut later, "dedup.inbox_default") == 0 && count(&mut noext, "dedup.inbox_default") == 0
    });
}

#[test]
fn an_error_in_a_batch_is_logged_and_the_next_cycle_goes_on() {
    let cluster = purging("purge_error", &[]);
    let mut c = cluster.fresh_db("purge_error");
    c.batch_execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'not now'; END $$;
         CREATE TRIGGER refuse BEFORE DELETE ON dedup.inbox_default FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .unwrap();
    let cycles = |c: &mut Client| {
        c.query_one("SELECT coalesce(purge_cycles, 0) FROM dedup.stats", &[]).unwrap().get::<_, i64>(0)
    };
    expire_soon(&mut c, "err", 20);
    let pid = {
        let mut pid = None;
        eventually("the worker runs", || {
            pid = worker_pid(&mut c, "purge_error");
            pid.is_some()
        });
        pid
    };
    let before = cycles(&mut c);
    eventually("two more cycles ran despite the failing batches", || cycles(&mut c) >= before + 2);
    assert_eq!(count(&mut c, "dedup.inbox_default"), 20, "the failing batches deleted nothing");
    assert_eq!(worker_pid(&mut c, "purge_error"), pid, "the worker did not die");
    c.batch_execute("DROP TRIGGER refuse ON dedup.inbox_default").unwrap();
    eventually("the purge goes on once the error is gone", || count(&mut c, "dedup.inbox_default") == 0);
}

/// An inbox table owned by an ordinary role — as pg_dedup 0.2.0 made them for delegated administrators, and as
/// its upgrade leaves those that carry code of their own — is purged with that role's rights: its trigger cannot
/// borrow the worker's superuser rights, nor leave a setting behind for the worker's next statement.
#[test]
fn an_inbox_owner_cannot_borrow_the_workers_superuser_rights() {
    let cluster = purging("purge_owner", &[]);
    let mut admin = cluster.fresh_db("purge_owner");
    admin
        .batch_execute(
            "DROP ROLE IF EXISTS inbox_owner; CREATE ROLE inbox_owner LOGIN;
             CREATE SCHEMA owned AUTHORIZATION inbox_owner;
             SELECT dedup.create_inbox('mine');
             ALTER TABLE dedup.inbox_mine OWNER TO inbox_owner;
             GRANT USAGE ON SCHEMA dedup TO inbox_owner;
             CREATE TABLE public.ran (who text, superuser bool);
             GRANT INSERT ON public.ran TO inbox_owner;",
        )
        .unwrap();
    let mut owner = cluster.connect_as("purge_owner", "inbox_owner");
    // Whenever a row of its inbox is deleted, the owner's trigger leaves a search_path behind that would send an
    // unqualified `=` of the worker's to an operator of the owner's, whose function makes the owner a superuser if
    // it runs with superuser rights (the escalation 0.2.0 allowed). It also tries that directly.
    owner
        .batch_execute(
            "CREATE FUNCTION owned.escalate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
                 PERFORM set_config('search_path', 'owned, pg_catalog', false);
                 BEGIN ALTER ROLE inbox_owner SUPERUSER; EXCEPTION WHEN insufficient_privilege THEN NULL; END;
                 RETURN OLD;
             END $$;
             CREATE FUNCTION owned.planted(name, name) RETURNS bool LANGUAGE plpgsql AS $$ BEGIN
                 INSERT INTO public.ran SELECT current_user, rolsuper FROM pg_catalog.pg_roles
                  WHERE rolname OPERATOR(pg_catalog.=) current_user;
                 BEGIN ALTER ROLE inbox_owner SUPERUSER; EXCEPTION WHEN insufficient_privilege THEN NULL; END;
                 RETURN $1::text = $2::text;
             END $$;
             CREATE OPERATOR owned.= (LEFTARG = name, RIGHTARG = name, FUNCTION = owned.planted);
             CREATE TRIGGER escalate BEFORE DELETE ON dedup.inbox_mine FOR EACH ROW EXECUTE FUNCTION owned.escalate();",
        )
        .unwrap();
    admin.batch_execute("SELECT dedup.mark_many(ARRAY['a', 'b'], '1 second', 'mine')").unwrap();
    let cycles = |c: &mut Client| {
        c.query_one("SELECT coalesce(purge_cycles, 0) FROM dedup.stats LIMIT 1", &[]).unwrap().get::<_, i64>(0)
    };
    wait_until_expired(&mut admin, "dedup.inbox_mine", &["a", "b"]);
    let before = cycles(&mut admin);
    eventually("the worker tried to purge the owner's inbox", || cycles(&mut admin) >= before + 2);
    let superuser: bool =
        admin.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = 'inbox_owner'", &[]).unwrap().get(0);
    assert!(!superuser, "the owner's code ran with the worker's superuser rights");
    assert_eq!(count(&mut admin, "dedup.inbox_mine"), 0, "the worker purged the owner's inbox, as the owner");
    assert_eq!(count(&mut admin, "public.ran"), 0, "the worker ran the owner's operator");
}
