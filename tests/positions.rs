//! Per-key positions (`advance()`, `position()`) against a real server: streams of positions raced by eight
//! sessions.

use pg_dedup_tests::*;
use std::collections::BTreeMap;

#[test]
fn eight_sessions_racing_positions_keep_every_keys_maximum() {
    let cluster = cluster();
    let mut c = db("ingest_positions");
    c.batch_execute("CREATE TABLE won (n bigserial PRIMARY KEY, key text, position bigint)").unwrap();
    const KEYS: usize = 100;
    const STEPS: i64 = 40;
    std::thread::scope(|s| {
        for session in 0..8u64 {
            s.spawn(move || {
                let mut c = cluster.connect("ingest_positions");
                // Every session sends every key's positions 1..STEPS, duplicated and shuffled its own way.
                let mut events: Vec<(usize, i64)> = (0..KEYS).flat_map(|k| (1..=STEPS).map(move |p| (k, p))).collect();
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (session + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                for i in (1..events.len()).rev() {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    events.swap(i, (seed % (i as u64 + 1)) as usize);
                }
                for (k, p) in events {
                    let key = format!("key-{k}");
                    let mut tx = c.transaction().unwrap();
                    let ahead: bool = tx.query_one("SELECT dedup.advance($1, $2)", &[&key, &p]).unwrap().get(0);
                    if ahead {
                        // Written under the key's row lock, so `n` orders the winners of one key as they committed.
                        tx.execute("INSERT INTO won (key, position) VALUES ($1, $2)", &[&key, &p]).unwrap();
                    }
                    tx.commit().unwrap();
                }
            });
        }
    });
    let mut won: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for row in c.query("SELECT key, position FROM won ORDER BY n", &[]).unwrap() {
        won.entry(row.get(0)).or_default().push(row.get(1));
    }
    assert_eq!(won.len(), KEYS);
    for (key, positions) in &won {
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{key}: the true answers went strictly up: {positions:?}");
        assert_eq!(positions.last(), Some(&STEPS), "{key}: the maximum won");
        let stored: i64 = c.query_one("SELECT dedup.position($1)", &[key]).unwrap().get(0);
        assert_eq!(stored, STEPS);
    }
}
