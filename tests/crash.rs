//! Crashes in the middle of a load: writers do `mark()` (or `mark_many()`) + a business insert per transaction
//! while the postmaster (even rounds) or one backend (odd rounds) is killed with SIGKILL at a random moment, ten
//! times over. After each recovery: every transaction whose COMMIT returned is there, marks and business rows
//! match one for one (no mark without its row, no row without its mark), and once the filter is reloaded it never
//! calls a committed id new.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const ROUNDS: usize = 10;
const WRITERS: usize = 4;

/// Writes until its connection breaks; returns the ids of every transaction whose COMMIT succeeded.
fn write_until_crash(cluster: &Cluster, round: usize, writer: usize, started: &AtomicUsize) -> Vec<String> {
    let mut committed = Vec::new();
    let Ok(mut c) = cluster.try_connect("crash") else { return committed };
    started.fetch_add(1, Ordering::SeqCst);
    for n in 0.. {
        let ids = transaction_ids(&format!("r{round}-w{writer}"), n);
        match mark_and_record(&mut c, &ids) {
            Ok(()) => committed.extend(ids),
            Err(_) => return committed, // the crash
        }
    }
    unreachable!()
}

fn ids_of(c: &mut Client, sql: &str) -> BTreeSet<String> {
    c.query(sql, &[]).unwrap().iter().map(|r| r.get(0)).collect()
}

#[test]
fn killing_the_postmaster_or_a_backend_mid_load_loses_and_doubles_nothing() {
    let cluster = preloaded("crash", &[]);
    cluster.fresh_db("crash").batch_execute("CREATE TABLE ledger (id text PRIMARY KEY)").unwrap();
    let committed_total = Mutex::new(BTreeSet::new());
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for round in 0..ROUNDS {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let started = AtomicUsize::new(0);
        std::thread::scope(|s| {
            let (cluster, started) = (&cluster, &started);
            let writers: Vec<_> =
                (0..WRITERS).map(|w| s.spawn(move || write_until_crash(cluster, round, w, started))).collect();
            eventually("the writers are running", || started.load(Ordering::SeqCst) == WRITERS);
            std::thread::sleep(Duration::from_millis(50 + seed % 400));
            if round % 2 == 0 {
                cluster.crash_postmaster();
            } else {
                let mut observer = cluster.connect("postgres");
                let victim: i32 = observer
                    .query_one(
                        "SELECT pid FROM pg_stat_activity WHERE datname = 'crash' AND backend_type = 'client backend'
                         ORDER BY random() LIMIT 1",
                        &[],
                    )
                    .unwrap()
                    .get(0);
                drop(observer);
                cluster.crash_backend(victim);
            }
            for w in writers {
                committed_total.lock().unwrap().extend(w.join().expect("a writer failed other than by the crash"));
            }
        });

        let mut c = cluster.connect("crash");
        let marks = ids_of(&mut c, "SELECT id FROM dedup.inbox_default");
        let ledger = ids_of(&mut c, "SELECT id FROM ledger");
        assert_eq!(marks, ledger, "round {round}: marks and business rows differ");
        let committed = committed_total.lock().unwrap().clone();
        let lost: Vec<_> = committed.difference(&marks).take(5).collect();
        assert!(lost.is_empty(), "round {round}: committed transactions lost: {lost:?}");
        wait_trusted(&mut c, "default");
        let committed: Vec<String> = committed.into_iter().collect();
        let seen: i64 = c
            .query_one("SELECT count(*) FROM unnest($1::text[]) id WHERE dedup.seen(id)", &[&committed])
            .unwrap()
            .get(0);
        assert_eq!(seen as usize, committed.len(), "round {round}: the filter hid committed marks");
        assert!(c.query("SELECT * FROM dedup.mark_many($1)", &[&committed]).unwrap().is_empty());
    }
    let total = committed_total.lock().unwrap().len();
    println!("{ROUNDS} crashes injected; {total} committed ids checked after each; none lost, none doubled");
    assert!(total > 100, "the load committed too little to mean anything: {total}");
}
