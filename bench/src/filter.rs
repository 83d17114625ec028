//! The shared Bloom filter against the index alone (`dedup.bloom = on / off`), and its memory against the optimum.

use crate::{alternate, timed, Row, Scale};
use pg_dedup_harness::postgres::Client;

pub fn scenarios(c: &mut Client, scale: &Scale) -> Vec<Row> {
    c.batch_execute(&format!(
        "SELECT count(*) FROM dedup.mark_many(array(SELECT 'present-' || g FROM generate_series(1, {}) g))",
        scale.preload
    ))
    .unwrap();
    // Wait for the worker to load the default inbox, so the filter answers.
    while !c.query_one("SELECT filter_trusted FROM dedup.stats WHERE inbox = 'default'", &[]).unwrap().get::<_, bool>(0)
    {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    c.batch_execute("VACUUM ANALYZE dedup.inbox_default").unwrap();
    let on_off = ["SET dedup.bloom = on", "SET dedup.bloom = off"];
    let on_off_run = |c: &mut Client, work: i64, sql: &dyn Fn(usize, usize) -> String| {
        alternate(scale.rounds, |variant, round| {
            c.batch_execute(on_off[variant]).unwrap();
            timed(c, &sql(variant, round), work)
        })
    };
    let mut rows = Vec::new();
    let n = scale.seen_lookups;
    let [on, off] = on_off_run(c, n, &|_, round| {
        format!("SELECT count(*) FROM generate_series(1, {n}) g WHERE dedup.seen('absent-{round}-' || g)")
    });
    rows.push(Row::new("seen() of absent ids, server-side loop", ("filter on", on), ("filter off", off), "lookups/s"));
    let n = scale.marks;
    let [on, off] = on_off_run(c, n, &|variant, round| {
        format!("SELECT count(*) FROM generate_series(1, {n}) g WHERE dedup.mark('new-{variant}-{round}-' || g)")
    });
    rows.push(Row::new("mark() of new ids, server-side loop", ("filter on", on), ("filter off", off), "marks/s"));
    let [on, off] = on_off_run(c, n, &|_, _| {
        format!("SELECT count(*) FROM generate_series(1, {n}) g WHERE dedup.mark('present-' || g)")
    });
    rows.push(Row::new("mark() of duplicates, server-side loop", ("filter on", on), ("filter off", off), "marks/s"));
    c.batch_execute("RESET dedup.bloom").unwrap();

    let fpr = 0.01;
    let capacity = 1_000_000;
    let bits = pg_dedup_bloom::blocks_for(capacity, fpr) as f64 * 256.0 / capacity as f64;
    let optimum = pg_dedup_bloom::optimal_bits_per_key(fpr);
    rows.push(Row::new(
        "filter memory at p = 0.01 (per generation)",
        ("split-block", bits),
        ("optimum 1.44·log2(1/p)", optimum),
        "bits/key",
    ));
    rows
}
