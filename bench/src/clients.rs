//! What an application sees: one transaction per mark (or per batch of 1,000) sent by pgbench clients, pg_dedup
//! against the hand-written SQL on an identical table (`bench_raw`), at the same client counts and
//! synchronous_commit, alternating; new ids also against the two-column table an expert writes, on long-lived
//! connections and with a connection per transaction. Around them: the ceiling (a transaction doing nothing but `SELECT 1`), the
//! disk's flush rate (pg_test_fsync) and Redis `SET NX EX` at matching durability. And the one-client rows again
//! with pgbench and the server on one CPU (`crate::pin`), without this machine's cross-CPU wake-ups. The goals of a
//! new id and of a duplicate are judged on paired rows (`compare::paired`): the two sides alone, short runs back to
//! back.

use crate::compare::{compare, paired, Measured, Setting, Side};
use crate::pgbench::{Commit, Pgbench};
use crate::redis::{Durability, Redis};
use crate::{Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;
use std::path::Path;

/// The goal of a single new-id mark against the raw insert (sync off; at the client counts listed).
const SINGLE_GOAL: Goal = Goal::AtLeast(1.1);
const SINGLE_GOAL_CLIENTS: [u32; 2] = [1, 8];
/// A duplicate, at the same client counts: the direct read of the primary key against ON CONFLICT's.
const DUPLICATE_GOAL: Goal = Goal::AtLeast(1.05);

/// Creates `raw`, a table identical to the inbox table `inbox` (columns, collation, indexes, reloptions; no
/// trigger: the filter's trigger is part of what pg_dedup costs) holding the same rows.
pub fn raw_twin(c: &mut Client, inbox: &str, raw: &str) {
    c.batch_execute(&format!("CREATE TABLE {raw} (LIKE {inbox} INCLUDING ALL); {}", same_storage(inbox, raw))).unwrap();
    c.batch_execute(&format!("INSERT INTO {raw} SELECT * FROM {inbox}")).unwrap();
}

/// SQL giving table `to` the storage options (reloptions) of table `from`: an inbox's autovacuum settings, which
/// make autovacuum visit it four times as often as a table without them, and whose work (and the free space it
/// leaves all over the table for later inserts) counts on our side of a comparison.
pub fn same_storage(from: &str, to: &str) -> String {
    format!(
        "DO $$ DECLARE options text := (SELECT array_to_string(reloptions, ', ') FROM pg_class \
                                         WHERE oid = '{from}'::regclass); \
         BEGIN IF options <> '' THEN EXECUTE format('ALTER TABLE {to} SET (%s)', options); END IF; END $$"
    )
}

/// Vacuums the freshly loaded `tables` (so autovacuum does not pick them up mid-measurement) and checkpoints (so
/// the load's dirty pages are not written during it).
pub fn settle(c: &mut Client, tables: &[&str]) {
    c.batch_execute(&format!("VACUUM ANALYZE {}", tables.join(", "))).unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
}

/// A pgbench script running `statement(id)` once per transaction. The id is new (a random `evt-` id), or with
/// probability `duplicates`% one of the `dup-1` .. `dup-<preloaded>` ids already in both tables.
pub fn one_id_script(statement: &dyn Fn(&str) -> String, duplicates: u32, preloaded: i64) -> String {
    let new = format!("\\set r random(1, 1000000000000000)\n{};\n", statement("'evt-' || :r"));
    let dup = format!("\\set p random(1, {preloaded})\n{};\n", statement("'dup-' || :p"));
    match duplicates {
        0 => new,
        100 => dup,
        pct => format!("\\if random(1, 100) <= {pct}\n{dup}\\else\n{new}\\endif\n"),
    }
}

pub fn mark_sql(inbox: &str) -> impl Fn(&str) -> String + '_ {
    move |id| match inbox {
        "default" => format!("SELECT dedup.mark({id}, interval '3 days')"),
        _ => format!("SELECT dedup.mark({id}, interval '3 days', '{inbox}')"),
    }
}

pub fn raw_sql(table: &str) -> impl Fn(&str) -> String + '_ {
    move |id| {
        format!("INSERT INTO {table} (id, expires_at) VALUES ({id}, now() + interval '3 days') ON CONFLICT DO NOTHING RETURNING true")
    }
}

/// Row "A vs B" from two measured sides, with their WAL and server CPU per id when both have them.
pub fn row(
    scenario: String,
    (a_label, a): (&str, &Measured),
    (b_label, b): (&str, &Measured),
    unit: &'static str,
) -> Row {
    let mut row = Row::new(&scenario, (a_label, a.rate), (b_label, b.rate), unit).rounds(&a.rounds, &b.rounds);
    if let (Some(wa), Some(wb)) = (a.wal_per_id, b.wal_per_id) {
        row = row.wal(wa, wb);
    }
    if let (Some(ca), Some(cb)) = (a.cpu_per_id, b.cpu_per_id) {
        row = row.cpu(ca, cb);
    }
    row
}

/// The scenarios' shared parts: the connection, pgbench, the scale and the scripts' building blocks.
struct Bench<'a> {
    c: &'a mut Client,
    pgbench: &'a Pgbench,
    scale: &'a Scale,
}

impl Bench<'_> {
    fn setting(&self, clients: u32, commit: Commit) -> Setting {
        Setting {
            clients,
            commit,
            secs: self.scale.run_secs,
            rounds: self.scale.rounds,
            connect_per_tx: false,
            one_cpu: false,
        }
    }

    /// A side running one id per transaction, `statement` with `duplicates`% duplicate ids.
    fn one_id(&self, name: &str, statement: &dyn Fn(&str) -> String, duplicates: u32) -> Side<'static> {
        let text = one_id_script(statement, duplicates, self.scale.duplicate_ids);
        Side::Sql { script: self.pgbench.script(name, &text), ids: 1 }
    }
}

/// The table an expert writes by hand for the same job: the id (`COLLATE "C"`, as the inbox's) and its expiry, with
/// the index a purge needs; none of the claim columns the inbox (and its raw twin) carry.
const EXPERT: &str = "bench_expert";
/// The inbox marked against `EXPERT`: filled exactly as it is, so that both sides insert into indexes of one size.
/// (`dedup.inbox_default` has taken millions of marks from the scenarios before by then: against the small table it
/// paid for a large index, a full-page image per leaf after each checkpoint, 0.36x with 1,244 B of WAL per mark.)
const EXPERT_TWIN: &str = "expert_twin";

pub fn scenarios(c: &mut Client, pgbench: &Pgbench, cluster_dir: &Path, scale: &Scale) -> Vec<Row> {
    raw_twin(c, "dedup.inbox_default", "bench_raw");
    c.batch_execute(&format!(
        "CREATE TABLE {EXPERT} (id text COLLATE \"C\" PRIMARY KEY, expires_at timestamptz NOT NULL); \
         CREATE INDEX ON {EXPERT} (expires_at); SELECT dedup.create_inbox('{EXPERT_TWIN}', '3 days')"
    ))
    .unwrap();
    let twin = format!("dedup.inbox_{EXPERT_TWIN}");
    let tables = ["dedup.inbox_default", "bench_raw", EXPERT, twin.as_str()];
    for table in tables {
        c.batch_execute(&format!(
            "INSERT INTO {table} (id, expires_at) SELECT 'dup-' || g, now() + interval '30 days' \
             FROM generate_series(1, {}) g",
            scale.duplicate_ids
        ))
        .unwrap();
    }
    // The same pool again as UUIDs (`uuid_dup`): ids a batch draws at random places of the index.
    for table in tables {
        c.batch_execute(&format!(
            "INSERT INTO {table} (id, expires_at) SELECT {}, now() + interval '30 days' FROM generate_series(1, {}) g",
            uuid_dup("g"),
            scale.duplicate_ids
        ))
        .unwrap();
    }
    settle(c, &tables);
    let redis = crate::redis::version().map(|_| [Redis::start(Durability::None), Redis::start(Durability::Fsync)]);
    if redis.is_none() {
        eprintln!(
            "[bench] redis-server or redis-benchmark is not installed: skipping the Redis rows \
             (`apt-get install redis-server redis-tools`, or scripts/setup.sh)"
        );
    }
    let mut b = Bench { c, pgbench, scale };
    let (mut rows, wal_new) = single_marks(&mut b, cluster_dir, redis.as_ref());
    let (duplicates, wal_duplicate) = duplicates(&mut b);
    rows.extend(duplicates);
    // Before the batches, which add millions of ids to the inbox and fewer to its twin (mark_many() runs faster).
    rows.extend(one_cpu(&mut b));
    rows.extend(paired_goals(&mut b));
    rows.extend(batches(&mut b));
    rows.extend(expert(&mut b));
    rows.push(wal_new);
    rows.extend(wal_duplicate);
    rows
}

/// (a) One new id per transaction, at each client count and both synchronous_commit settings, with the sides
/// that only make sense at some of them run in the same rounds: the ceiling (`SELECT 1`) at 1 client sync off,
/// the disk's flush rate at 1 client sync on, Redis at matching durability. Also returns the WAL per new mark.
fn single_marks(b: &mut Bench, cluster_dir: &Path, redis: Option<&[Redis; 2]>) -> (Vec<Row>, Row) {
    let (mark, raw) = (mark_sql("default"), raw_sql("bench_raw"));
    let mut rows = Vec::new();
    let mut wal = None;
    for (commit, client_counts) in [(Commit::Async, &b.scale.clients_async), (Commit::Sync, &b.scale.clients_sync)] {
        for &clients in client_counts {
            let mut sides = vec![b.one_id("mark_new", &mark, 0), b.one_id("raw_new", &raw, 0)];
            let ceiling = clients == 1 && commit == Commit::Async;
            if ceiling {
                sides.push(Side::Sql { script: b.pgbench.script("select_1", "SELECT 1;\n"), ids: 1 });
            }
            let flush_rate = clients == 1 && commit == Commit::Sync;
            if flush_rate {
                sides.push(Side::Fsync(cluster_dir.join("pg_test_fsync.tmp")));
            }
            let redis_side = redis.filter(|_| b.scale.clients_redis.contains(&clients)).map(|r| match commit {
                Commit::Async => &r[0],
                Commit::Sync => &r[1],
            });
            if let Some(redis) = redis_side {
                sides.push(Side::Redis(redis));
            }
            let setting = b.setting(clients, commit);
            let m = compare(b.c, b.pgbench, &setting, &sides);
            let at = setting.label();
            rows.push(row(format!("mark() of a new id per tx, {at}"), ("mark", &m[0]), ("raw insert", &m[1]), "tx/s"));
            if ceiling {
                rows.push(row(
                    format!("ceiling: SELECT 1 per tx vs raw insert, {at}"),
                    ("SELECT 1", &m[2]),
                    ("raw insert", &m[1]),
                    "tx/s",
                ));
                let (a, b) = (m[0].wal_per_id.unwrap(), m[1].wal_per_id.unwrap());
                wal =
                    Some(Row::new("WAL per new mark", ("mark", a), ("raw insert", b), "B/id").goal(Goal::AtMost(1.0)));
            }
            if flush_rate {
                rows.push(
                    row(
                        format!("mark() per tx vs disk flushes, {at}"),
                        ("mark", &m[0]),
                        ("pg_test_fsync fdatasync", &m[2]),
                        "/s",
                    )
                    .goal(Goal::AtLeast(0.9)),
                );
            }
            if redis_side.is_some() {
                let what = match commit {
                    Commit::Async => "no persistence",
                    Commit::Sync => "appendfsync always",
                };
                rows.push(row(
                    format!("mark() vs Redis SET NX EX ({what}), {at}"),
                    ("mark", &m[0]),
                    ("redis", m.last().unwrap()),
                    "/s",
                ));
            }
        }
    }
    (rows, wal.expect("the single-mark scenarios include 1 client, sync off"))
}

/// (b) Duplicates: a share of the ids (20%, 100%) is already marked, and already in bench_raw; sync off. Also
/// returns the WAL per duplicate (at 100%, at the first client count).
fn duplicates(b: &mut Bench) -> (Vec<Row>, Option<Row>) {
    let (mark, raw) = (mark_sql("default"), raw_sql("bench_raw"));
    let mut rows = Vec::new();
    let mut wal = None;
    for &clients in &b.scale.clients_duplicates {
        let shares = &b.scale.duplicate_shares;
        let sides: Vec<Side> = (shares.iter())
            .flat_map(|&pct| {
                [b.one_id(&format!("mark_dup{pct}"), &mark, pct), b.one_id(&format!("raw_dup{pct}"), &raw, pct)]
            })
            .collect();
        let setting = b.setting(clients, Commit::Async);
        let m = compare(b.c, b.pgbench, &setting, &sides);
        let at = setting.label();
        for (pair, &pct) in m.chunks(2).zip(shares) {
            rows.push(row(
                format!("mark(), {pct}% duplicates, {at}"),
                ("mark", &pair[0]),
                ("raw insert", &pair[1]),
                "tx/s",
            ));
            if pct == 100 && wal.is_none() {
                let (a, b) = (pair[0].wal_per_id.unwrap(), pair[1].wal_per_id.unwrap());
                wal = Some(Row::new("WAL per duplicate", ("mark", a), ("raw insert", b), "B/id").goal(Goal::Zero));
            }
        }
    }
    (rows, wal)
}

/// The goals of a new id and of a duplicate (sync off, at the client counts listed), judged on the two sides alone,
/// paired (`compare::paired`): those goals lie a few points from their ratios, which medians of five rounds of
/// the sides above place anywhere within about ±10%. After the rows above, so that the millions of new ids the
/// paired runs add (about 9 million in a full run, about as many to either table) do not change the tables they measured;
/// the duplicates first, on the tables as those rows had them.
fn paired_goals(b: &mut Bench) -> Vec<Row> {
    let (mark, raw) = (mark_sql("default"), raw_sql("bench_raw"));
    let mut rows = Vec::new();
    let goals = [
        ("mark(), 100% duplicates", 100, DUPLICATE_GOAL, &b.scale.clients_duplicates),
        ("mark() of a new id per tx", 0, SINGLE_GOAL, &b.scale.clients_async),
    ];
    for (what, duplicates, goal, client_counts) in goals {
        for &clients in client_counts.iter().filter(|c| SINGLE_GOAL_CLIENTS.contains(c)) {
            let ours = b.one_id(&format!("mark_paired{duplicates}"), &mark, duplicates);
            let hand = b.one_id(&format!("raw_paired{duplicates}"), &raw, duplicates);
            let setting = b.setting(clients, Commit::Async);
            let p = paired(b.c, b.pgbench, &setting.paired(b.scale), ours, hand);
            rows.push(p.row(&format!("{what}, paired, {}", setting.label()), "mark", "raw insert", "tx/s").goal(goal));
        }
    }
    rows
}

/// Duplicate `n` of the pool as a UUID's text (random order in the index, as real message ids are).
fn uuid_dup(n: &str) -> String {
    format!("md5('dup-' || {n})::uuid::text")
}

/// (c) Batches of 1,000 ids per transaction, sync off: mark_many() against INSERT ... SELECT FROM unnest(), for
/// new ids and for ids that are all duplicates (a redelivered batch): consecutive ones, and UUIDs spread over the
/// index.
fn batches(b: &mut Bench) -> Vec<Row> {
    let batch = |ids: &str| {
        let mark_many = format!("SELECT count(*) FROM dedup.mark_many({ids}, interval '3 days');\n");
        let unnest = format!(
            "WITH ins AS (INSERT INTO bench_raw (id, expires_at) SELECT u, now() + interval '3 days' \
             FROM unnest({ids}) u ON CONFLICT DO NOTHING RETURNING id) SELECT count(*) FROM ins;\n"
        );
        (mark_many, unnest)
    };
    let new = batch("array(SELECT 'evt-' || :r || '-' || g FROM generate_series(1, 1000) g)");
    // 1,000 consecutive ids of the pool both tables hold.
    let dup = batch("array(SELECT 'dup-' || (:p + g) FROM generate_series(1, 1000) g)");
    let uuid = batch(&format!("array(SELECT {} FROM generate_series(1, 1000) g)", uuid_dup("(:p + g)")));
    let new_key = "\\set r random(1, 1000000000000000)\n";
    let dup_key = format!("\\set p random(0, {})\n", b.scale.duplicate_ids - 1000);
    let sides = [
        Side::Sql { script: b.pgbench.script("mark_many", &format!("{new_key}{}", new.0)), ids: 1000 },
        Side::Sql { script: b.pgbench.script("unnest", &format!("{new_key}{}", new.1)), ids: 1000 },
        Side::Sql { script: b.pgbench.script("mark_many_dup", &format!("{dup_key}{}", dup.0)), ids: 1000 },
        Side::Sql { script: b.pgbench.script("unnest_dup", &format!("{dup_key}{}", dup.1)), ids: 1000 },
        Side::Sql { script: b.pgbench.script("mark_many_uuid", &format!("{dup_key}{}", uuid.0)), ids: 1000 },
        Side::Sql { script: b.pgbench.script("unnest_uuid", &format!("{dup_key}{}", uuid.1)), ids: 1000 },
    ];
    let mut rows = Vec::new();
    for &clients in &b.scale.clients_batches {
        let setting = b.setting(clients, Commit::Async);
        let m = compare(b.c, b.pgbench, &setting, &sides);
        let at = setting.label();
        rows.push(
            row(
                format!("mark_many() of 1,000 new ids per tx, {at}"),
                ("mark_many", &m[0]),
                ("unnest insert", &m[1]),
                "ids/s",
            )
            .goal(Goal::AtLeast(1.5)),
        );
        rows.push(
            row(
                format!("mark_many() of 1,000 duplicates per tx, {at}"),
                ("mark_many", &m[2]),
                ("unnest insert", &m[3]),
                "ids/s",
            )
            .goal(Goal::AtLeast(2.0)),
        );
        rows.push(
            row(
                format!("mark_many() of 1,000 duplicate UUIDs (random ids) per tx, {at}"),
                ("mark_many", &m[4]),
                ("unnest insert", &m[5]),
                "ids/s",
            )
            .goal(Goal::AtLeast(1.3)),
        );
    }
    rows
}

/// (d) New ids into `EXPERT_TWIN` against the table an expert writes (`EXPERT`), 1 client, sync off: on a
/// long-lived connection, and with a new connection per transaction, where the first call of a backend is every call (connect-per-request
/// applications: PHP, serverless functions, short scripts), with `SELECT 1` on a new connection as the ceiling.
fn expert(b: &mut Bench) -> Vec<Row> {
    let (mark, raw) = (mark_sql(EXPERT_TWIN), raw_sql(EXPERT));
    let mut rows = Vec::new();
    for connect_per_tx in [false, true] {
        let mut sides = vec![b.one_id("mark_new_twin", &mark, 0), b.one_id("expert_new", &raw, 0)];
        if connect_per_tx {
            sides.push(Side::Sql { script: b.pgbench.script("select_1", "SELECT 1;\n"), ids: 1 });
        }
        let setting = Setting { connect_per_tx, ..b.setting(1, Commit::Async) };
        let m = compare(b.c, b.pgbench, &setting, &sides);
        let at = setting.label();
        let goal = Goal::AtLeast(if connect_per_tx { 0.95 } else { 1.0 });
        let scenario = format!("mark() of a new id per tx vs a two-column table, {at}");
        rows.push(row(scenario, ("mark", &m[0]), ("raw insert", &m[1]), "tx/s").goal(goal));
        if connect_per_tx {
            let ceiling = format!("ceiling: SELECT 1 per tx vs raw insert, {at}");
            rows.push(row(ceiling, ("SELECT 1", &m[2]), ("raw insert", &m[1]), "tx/s"));
        }
    }
    rows
}

/// (e) The one-client rows of (a), (b) and (d) again with pgbench and the server on one CPU (`crate::pin`): what a
/// transaction costs them there, without the wake-ups of another CPU that make most of an unpinned round trip on
/// this machine (the ceiling row shows how much: `SELECT 1` here against the unpinned one above). Diagnostic: no
/// deployment runs that way, so no goals.
fn one_cpu(b: &mut Bench) -> Vec<Row> {
    let sides = [
        b.one_id("mark_new", &mark_sql("default"), 0),
        b.one_id("raw_new", &raw_sql("bench_raw"), 0),
        Side::Sql { script: b.pgbench.script("select_1", "SELECT 1;\n"), ids: 1 },
        b.one_id("mark_dup100", &mark_sql("default"), 100),
        b.one_id("raw_dup100", &raw_sql("bench_raw"), 100),
        b.one_id("mark_new_twin", &mark_sql(EXPERT_TWIN), 0),
        b.one_id("expert_new", &raw_sql(EXPERT), 0),
    ];
    let setting = Setting { one_cpu: true, ..b.setting(1, Commit::Async) };
    let m = compare(b.c, b.pgbench, &setting, &sides);
    let at = setting.label();
    let raw = ("raw insert", &m[1]);
    vec![
        row(format!("mark() of a new id per tx, {at}"), ("mark", &m[0]), raw, "tx/s"),
        row(format!("ceiling: SELECT 1 per tx vs raw insert, {at}"), ("SELECT 1", &m[2]), raw, "tx/s"),
        row(format!("mark(), 100% duplicates, {at}"), ("mark", &m[3]), ("raw insert", &m[4]), "tx/s"),
        row(
            format!("mark() of a new id per tx vs a two-column table, {at}"),
            ("mark", &m[5]),
            ("raw insert", &m[6]),
            "tx/s",
        ),
    ]
}
