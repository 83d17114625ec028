//! Failover: a primary under load (each transaction `mark_many()` + a business insert) streams synchronously to a
//! hot standby. While the load runs, the standby must see every committed mark (its filter is off there, so it can
//! never hide one) and must refuse to mark. Then the primary is killed with SIGKILL and the standby promoted: every
//! id whose COMMIT returned on the old primary is a duplicate on the new one, marks and business rows still match
//! one for one, and once the new primary's filter is loaded it still calls none of them new.
//!
//! Only synchronous replication gives "committed on the primary" ⇒ "present after failover"; with asynchronous
//! replication the last commits before a crash can be lost with the primary (README, Reliability).

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const WRITERS: usize = 4;
const MIN_COMMITTED: usize = 1000;

/// Kills the primary when dropped.
struct KillOnDrop<'a>(&'a Cluster);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        self.0.kill_postmaster();
    }
}

/// Writes until the primary goes away, adding the ids of every transaction whose COMMIT returned to `committed`.
fn write_until_killed(primary: &Cluster, writer: usize, committed: &Mutex<Vec<String>>, started: &AtomicUsize) {
    let mut c = primary.connect("failover");
    // COMMIT returns only once the standby has replayed it, so the standby can be asked about it right away.
    c.batch_execute("SET synchronous_commit = remote_apply").unwrap();
    started.fetch_add(1, Ordering::SeqCst);
    for n in 0.. {
        let ids = transaction_ids(&format!("w{writer}"), n);
        match mark_and_record(&mut c, &ids) {
            Ok(()) => committed.lock().unwrap().extend(ids),
            Err(_) => return, // the primary is gone
        }
    }
}

/// Until `stop`, asks the standby about the latest committed ids; returns how many it checked.
fn check_standby(standby: &mut Client, committed: &Mutex<Vec<String>>, stop: &AtomicBool) -> usize {
    let mut checked = 0;
    while !stop.load(Ordering::SeqCst) {
        let recent: Vec<String> = {
            let all = committed.lock().unwrap();
            all[all.len().saturating_sub(50)..].to_vec()
        };
        let seen: i64 = standby
            .query_one("SELECT count(*) FROM unnest($1::text[]) id WHERE dedup.seen(id)", &[&recent])
            .unwrap()
            .get(0);
        assert_eq!(seen as usize, recent.len(), "the standby did not see marks committed on the primary");
        assert_dedup_error(standby.query_one("SELECT dedup.mark('on-the-standby')", &[]), "25006");
        checked += recent.len();
        std::thread::sleep(Duration::from_millis(20));
    }
    checked
}

fn ids_of(c: &mut Client, sql: &str) -> BTreeSet<String> {
    c.query(sql, &[]).unwrap().iter().map(|r| r.get(0)).collect()
}

#[test]
fn after_a_failover_every_id_committed_on_the_old_primary_is_a_duplicate() {
    let primary = preloaded("failover", &[]);
    let mut p = primary.fresh_db("failover");
    p.batch_execute("CREATE TABLE ledger (id text PRIMARY KEY)").unwrap();
    let standby = primary.standby();
    // Set after the base backup, so the promoted standby does not wait for a standby of its own.
    p.batch_execute("ALTER SYSTEM SET synchronous_standby_names = '*'").unwrap();
    p.batch_execute("SELECT pg_reload_conf()").unwrap();
    eventually("the standby replicates synchronously", || {
        let sync = p.query("SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'", &[]).unwrap();
        !sync.is_empty()
    });
    let mut s = standby.connect("failover");
    let state: String = s.query_one("SELECT filter_state FROM dedup.stats", &[]).unwrap().get(0);
    assert_eq!(state, "off: hot standby");

    let committed = Mutex::new(Vec::new());
    let (started, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    // The kill comes after at least MIN_COMMITTED ids, and a random moment later.
    let kill_after = Duration::from_millis(u64::from(std::process::id() % 1000));
    let checked = std::thread::scope(|scope| {
        let (primary, committed, started, stop) = (&primary, &committed, &started, &stop);
        // The writers stop only when the primary dies: kill it however this closure ends (a failed check panics
        // here), or the scope would wait for them forever.
        let primary_dies = KillOnDrop(primary);
        let writers: Vec<_> =
            (0..WRITERS).map(|w| scope.spawn(move || write_until_killed(primary, w, committed, started))).collect();
        eventually("the writers are running", || started.load(Ordering::SeqCst) == WRITERS);
        let reader = scope.spawn(|| check_standby(&mut s, committed, stop));
        eventually("the writers have committed enough", || committed.lock().unwrap().len() >= MIN_COMMITTED);
        std::thread::sleep(kill_after);
        stop.store(true, Ordering::SeqCst);
        let checked = reader.join();
        drop(primary_dies);
        for w in writers {
            w.join().expect("a writer failed other than by the primary's death");
        }
        checked.expect("the standby reader failed")
    });
    drop(p);
    standby.promote();

    let mut c = standby.connect("failover");
    let committed: Vec<String> = committed.into_inner().unwrap();
    let marks = ids_of(&mut c, "SELECT id FROM dedup.inbox_default");
    assert_eq!(marks, ids_of(&mut c, "SELECT id FROM ledger"), "marks and business rows differ after failover");
    let lost: Vec<_> = committed.iter().filter(|id| !marks.contains(*id)).take(5).collect();
    assert!(lost.is_empty(), "ids committed on the old primary are missing on the new one: {lost:?}");
    let assert_all_duplicates = |c: &mut Client, when: &str| {
        let seen: i64 = c
            .query_one("SELECT count(*) FROM unnest($1::text[]) id WHERE dedup.seen(id)", &[&committed])
            .unwrap()
            .get(0);
        assert_eq!(seen as usize, committed.len(), "{when}: seen() missed committed ids");
        let mut tx = c.transaction().unwrap();
        let fresh = tx.query("SELECT * FROM dedup.mark_many($1)", &[&committed]).unwrap().len();
        assert_eq!(fresh, 0, "{when}: committed ids were marked new again");
        tx.rollback().unwrap();
    };
    assert_all_duplicates(&mut c, "right after promotion");
    wait_trusted(&mut c, "default");
    assert_all_duplicates(&mut c, "with the new primary's filter loaded");
    assert!(mark(&mut c, "after-failover"), "the new primary marks new ids");
    println!(
        "failover {:.1}s after the first {MIN_COMMITTED} commits: {} committed ids ({} checked on the standby while streaming), none lost, none new again",
        kill_after.as_secs_f64(),
        committed.len(),
        checked
    );
}
