//! The race storm: 16 connections mark ids from one shared, heavily overlapping pool — single marks, each in its
//! own transaction, mixed with `mark_many` batches in random order — on a preloaded server (filter and bulk insert
//! active). Exactly one `true` per id, no errors, and the ids that got `true` are exactly the ids stored.
//! `STORM_MARKS` sets the calls per connection (`make test`: 5,000; `make test-long`: 200,000).

use pg_dedup_tests::*;
use std::collections::HashMap;

const SESSIONS: usize = 16;

#[test]
fn sixteen_sessions_racing_on_one_pool_claim_each_id_exactly_once() {
    let calls: usize = std::env::var("STORM_MARKS").ok().and_then(|s| s.parse().ok()).unwrap_or(5_000);
    // A pool a quarter the size of all attempts: every id is tried about four times, often at the same moment.
    let pool = (SESSIONS * calls / 4).max(100) as u64;
    let cluster = preloaded("storm", &[]);
    let mut c = cluster.fresh_db("storm");
    wait_trusted(&mut c, "default");
    let cluster = &cluster;
    let wins: Vec<String> = std::thread::scope(|s| {
        let sessions: Vec<_> = (0..SESSIONS as u64)
            .map(|session| {
                s.spawn(move || {
                    let mut c = cluster.connect("storm");
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (session + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    let mut next = move || {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x % pool
                    };
                    let mut won = Vec::new();
                    for call in 0..calls {
                        if call % 10 == 9 {
                            let batch: Vec<String> = (0..20).map(|_| format!("evt-{}", next())).collect();
                            let rows = c.query("SELECT * FROM dedup.mark_many($1)", &[&batch]).expect("mark_many");
                            won.extend(rows.iter().map(|r| r.get::<_, String>(0)));
                        } else {
                            let id = format!("evt-{}", next());
                            if c.query_one("SELECT dedup.mark($1)", &[&id]).expect("mark").get::<_, bool>(0) {
                                won.push(id);
                            }
                        }
                    }
                    won
                })
            })
            .collect();
        sessions.into_iter().flat_map(|s| s.join().expect("no session may fail")).collect()
    });
    let mut claims: HashMap<&str, usize> = HashMap::new();
    for id in &wins {
        *claims.entry(id).or_default() += 1;
    }
    let doubled: Vec<_> = claims.iter().filter(|(_, &n)| n > 1).take(10).collect();
    assert!(doubled.is_empty(), "ids claimed more than once: {doubled:?}");
    let stored: Vec<String> =
        c.query("SELECT id FROM dedup.inbox_default", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(stored.len(), claims.len(), "every stored id was claimed, and every claim stored");
    assert!(stored.iter().all(|id| claims.contains_key(id.as_str())), "a stored id nobody was told was new");
    println!("{} calls per session, {} ids claimed once each out of a pool of {pool}", calls, claims.len());
    assert_no_resource_leaks(cluster);
}
