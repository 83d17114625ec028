//! Throughput as the inbox grows: single new-id marks (1 client, sync off) against the raw insert on an identical
//! table, with both tables filled to each size in turn (up to 10 million live rows; 1 million in quick mode).
//!
//! The inbox is its own (`growth`), so the earlier scenarios' rows do not count, and it was created empty, so the
//! filter trusts it from the start. The fill (one INSERT ... SELECT per size) goes straight into the inbox table: its trigger adds every row to
//! the filter, as a mark() would. The cluster's `dedup.bloom_capacity` covers every row, so no filter rotation
//! runs mid-measurement.

use crate::clients::{mark_sql, one_id_script, raw_sql, raw_twin, row, settle};
use crate::compare::{compare, Setting, Side};
use crate::pgbench::{Commit, Pgbench};
use crate::{Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;

/// Throughput at one size.
pub struct Point {
    /// The size the tables were filled to.
    pub rows: i64,
    /// Rows actually in the inbox and the raw table when the measurement started (the measurement adds more).
    pub mark_rows: i64,
    pub raw_rows: i64,
    pub mark: f64,
    pub raw: f64,
}

/// The fill's g-th id: `evt-` and a number spread over the same range as the measured marks' random ids
/// (g times a prime, modulo 10^15: distinct for every g), so new marks land all over the filled index, as event
/// ids do, not beside it. Expiry times rise with g, as they do for marks arriving over time.
const FILL_ID: &str = "'evt-' || (g::bigint * 982451653 % 1000000000000000)";

pub fn human(n: i64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

pub fn scenarios(c: &mut Client, pgbench: &Pgbench, scale: &Scale) -> (Vec<Row>, Vec<Point>) {
    c.batch_execute("SELECT dedup.create_inbox('growth', '30 days')").unwrap();
    raw_twin(c, "dedup.inbox_growth", "growth_raw");
    let tables = ["dedup.inbox_growth", "growth_raw"];
    let sides = [
        Side::Sql { script: pgbench.script("growth_mark", &one_id_script(&mark_sql("growth"), 0, 0)), ids: 1 },
        Side::Sql { script: pgbench.script("growth_raw", &one_id_script(&raw_sql("growth_raw"), 0, 0)), ids: 1 },
    ];
    let setting = Setting {
        clients: 1,
        commit: Commit::Async,
        secs: scale.run_secs,
        rounds: scale.rounds,
        connect_per_tx: false,
        one_cpu: false,
    };
    // Rows in each table: the fill's plus the measurements' (all new ids).
    let mut filled = [0i64; 2];
    let mut size = [0i64; 2];
    let mut points = Vec::new();
    let mut rows = Vec::new();
    for &target in &scale.growth_steps {
        for (t, table) in tables.iter().enumerate() {
            let more = target - size[t];
            if more > 0 {
                c.batch_execute(&format!(
                    "INSERT INTO {table} (id, expires_at) SELECT {FILL_ID}, now() + interval '30 days' + g * interval '1 ms' \
                     FROM generate_series({}, {}) g ON CONFLICT DO NOTHING",
                    filled[t] + 1,
                    filled[t] + more
                ))
                .unwrap();
                filled[t] += more;
                size[t] += more;
            }
        }
        settle(c, &tables);
        let m = compare(c, pgbench, &setting, &sides);
        let scenario = format!("mark() of a new id per tx, inbox of {} rows, {}", human(target), setting.label());
        rows.push(row(scenario, ("mark", &m[0]), ("raw insert", &m[1]), "tx/s"));
        points.push(Point { rows: target, mark_rows: size[0], raw_rows: size[1], mark: m[0].rate, raw: m[1].rate });
        size[0] += m[0].ids as i64;
        size[1] += m[1].ids as i64;
    }
    let (first, last) = (&points[0], &points[points.len() - 1]);
    let (small, large) = (human(first.rows), human(last.rows));
    rows.push(
        Row::new(
            &format!("growth: mark() at {large} rows vs at {small}"),
            (&large, last.mark),
            (&small, first.mark),
            "tx/s",
        )
        .goal(Goal::AtLeast(0.7)),
    );
    rows.push(Row::new(
        &format!("growth: raw insert at {large} rows vs at {small}"),
        (&large, last.raw),
        (&small, first.raw),
        "tx/s",
    ));
    (rows, points)
}
