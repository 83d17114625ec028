//! Scale-out: `mark()` on an inbox distributed with Citus against the hand-written distributed
//! `INSERT ... ON CONFLICT DO NOTHING` through Citus, new ids, at 1 and 8 clients, sync off, on a three-node cluster
//! on this machine (a coordinator and two workers); in a transaction, the row with the goal is paired
//! (`compare::paired`: the two sides alone, short runs back to back, with a 90% interval). And, for
//! docs/scale-out.md, what the hop through the coordinator costs a mark: the distributed mark against a mark into an
//! inbox of the coordinator itself. And the same mark with Citus's function delegation
//! (`create_distributed_function(..., force_delegation => true)`, in a database of its own: it holds for every call
//! of the function there), which runs `mark()` on the worker holding the id's shard; docs/scale-out.md says why
//! pg_dedup does not offer it. Beside them, in a transaction, four ceilings for a function in the mark's place: the
//! hand-written `INSERT` run by a PL/pgSQL function (what the form of a call costs: a `SELECT` around a function, the
//! statement inside it), and three delegated functions: one doing nothing (the floor of the delegated road), one
//! running the hand-written `INSERT` (delegation as Citus offers it: the insert through Citus's local execution, with
//! its cached plan), and one inserting into a plain table of the worker (the cheapest write a delegated call could
//! make, with no Citus executor in between).
//!
//! Citus supports PostgreSQL 16 and later, and the benchmark's main cluster is PostgreSQL 15: this section runs on
//! the PostgreSQL that CITUS_PG_CONFIG names (the Makefile passes PostgreSQL 18's, where scripts/setup.sh builds
//! Citus, and installs the release build of pg_dedup there). Without it, or without Citus there, it says so and
//! adds no rows.

use crate::compare::{compare, paired, Setting, Side};
use crate::pgbench::{Commit, Pgbench};
use crate::{Goal, Row, Scale};
use pg_dedup_harness::citus::{self, CitusCluster};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The Citus cluster's PostgreSQL and Citus versions, once the section has run: the machine's description names
/// them beside the main cluster's (they differ: `make bench` runs this section on PostgreSQL 18).
pub static VERSIONS: OnceLock<String> = OnceLock::new();

/// The hand-written table of keys, `name`: the inbox's id column and its `expires_at` index (the purge's, which the
/// inbox's shards carry), so that every side pays for the same indexes.
fn keys_table(name: &str) -> [String; 2] {
    [
        format!(r#"CREATE TABLE {name} (id text COLLATE "C" PRIMARY KEY, expires_at timestamptz NOT NULL)"#),
        format!("CREATE INDEX ON {name} (expires_at)"),
    ]
}

/// A PL/pgSQL function `name(id)` running the hand-written statement into `table` through its cached plan.
fn insert_function(name: &str, table: &str) -> String {
    format!(
        "CREATE FUNCTION {name}(id text) RETURNS boolean LANGUAGE plpgsql AS $$
           BEGIN INSERT INTO {table} VALUES (id, now() + interval '3 days') ON CONFLICT DO NOTHING; RETURN FOUND; END
         $$"
    )
}

pub fn scenarios(scale: &Scale) -> Vec<Row> {
    let Some(pg_config) = std::env::var_os("CITUS_PG_CONFIG").map(PathBuf::from) else {
        eprintln!("[bench] citus: skipped (CITUS_PG_CONFIG is not set; `make bench` sets it)");
        return Vec::new();
    };
    if !citus::available_in(&pg_config) {
        eprintln!("[bench] citus: skipped (Citus is not installed into {})", pg_config.display());
        return Vec::new();
    }
    let cluster = CitusCluster::start_of(&pg_config, "", &["max_connections = 200"]);
    let mut c = cluster.fresh_db("bench");
    let versions = c
        .query_one(
            "SELECT current_setting('server_version'), extversion FROM pg_extension WHERE extname = 'citus'",
            &[],
        )
        .unwrap();
    VERSIONS
        .get_or_init(|| format!("PostgreSQL {}, Citus {}", versions.get::<_, String>(0), versions.get::<_, String>(1)));
    let [hand_keys, hand_keys_index] = keys_table("hand_keys");
    c.batch_execute(&format!(
        "SELECT dedup.create_inbox('dist', '3 days');
         SELECT dedup.distribute_inbox('dist');
         SELECT dedup.create_inbox('local', '3 days');
         {hand_keys};
         {hand_keys_index};
         SELECT create_distributed_table('hand_keys', 'id');"
    ))
    .unwrap();
    // Separate statements: Citus refuses to propagate a function in a transaction that already ran a parallel
    // operation on a distributed table.
    c.batch_execute(&insert_function("hand_insert", "hand_keys")).unwrap();
    // Function delegation (docs/scale-out.md): Citus sends `SELECT dedup.mark(...)` itself to the worker that holds
    // the id's shard, for every call of the function in the database, so it gets a database of its own.
    let mut d = cluster.fresh_db("bench_delegated");
    d.batch_execute(
        "SELECT dedup.create_inbox('dist', '3 days');
         SELECT dedup.distribute_inbox('dist');
         SELECT create_distributed_function('dedup.mark(text,interval,text)', 'id', colocate_with => 'dedup.inbox_dist',
                                            force_delegation => true);",
    )
    .unwrap();
    // The delegated road's ceilings: a call doing nothing, the hand-written INSERT into a table co-located with the
    // inbox, and the same INSERT into a plain table of the worker (not a shard: no Citus executor), each through
    // PL/pgSQL's cached plan. The first says where it ran, checked below: a call Citus did not delegate would run
    // on the coordinator and make the floor look lower than it is.
    d.batch_execute(&format!(
        "{hand_keys};
         {hand_keys_index};
         SELECT create_distributed_table('hand_keys', 'id', colocate_with => 'dedup.inbox_dist');"
    ))
    .unwrap();
    d.batch_execute(&format!(
        "CREATE FUNCTION delegated_nothing(id text) RETURNS boolean LANGUAGE plpgsql
           AS $$BEGIN RETURN NOT pg_catalog.citus_is_coordinator(); END$$;
         {};
         {};",
        insert_function("delegated_hand_insert", "hand_keys"),
        insert_function("delegated_local_insert", "local_keys"),
    ))
    .unwrap();
    // run_command_on_workers reports a failure in its result, not as an error.
    for command in keys_table("local_keys") {
        let done: bool =
            d.query_one("SELECT bool_and(success) FROM run_command_on_workers($1)", &[&command]).unwrap().get(0);
        assert!(done, "run_command_on_workers({command:?}) failed on a worker");
    }
    for function in ["delegated_nothing", "delegated_hand_insert", "delegated_local_insert"] {
        d.batch_execute(&format!(
            "SELECT create_distributed_function('{function}(text)', 'id', colocate_with => 'dedup.inbox_dist',
                                                force_delegation => true);"
        ))
        .unwrap();
    }
    let mut tx = d.transaction().unwrap();
    let on_a_worker: bool = tx.query_one("SELECT delegated_nothing('n-1')", &[]).unwrap().get(0);
    tx.commit().unwrap();
    assert!(on_a_worker, "Citus ran delegated_nothing() on the coordinator: the delegated rows would mean nothing");
    drop(d);
    let pgbench = Pgbench::new(&cluster.coordinator, "bench");
    let delegated = Pgbench::new(&cluster.coordinator, "bench_delegated");
    let new_id = "\\set r random(1, 1000000000000000)\n";
    let mark = "SELECT dedup.mark('n-' || :r, NULL, 'dist');\n";
    let insert = "INSERT INTO hand_keys VALUES ('n-' || :r, now() + interval '3 days') ON CONFLICT DO NOTHING;\n";
    // In a transaction, as a consumer runs them (with its business write): Citus opens the worker's transaction,
    // runs the statement and commits it, three round trips, on both sides.
    let in_tx =
        |on: &Pgbench, name: &str, statement: &str| on.script(name, &format!("{new_id}BEGIN;\n{statement}COMMIT;\n"));
    let ours_tx = in_tx(&pgbench, "citus_mark_tx", mark);
    let hand_tx = in_tx(&pgbench, "citus_hand_tx", insert);
    // Alone in autocommit: Citus sends the bare INSERT as one single-shard command (one round trip), but a statement
    // run by a function as a transaction of its own (three), since the statement around the function may still fail.
    let ours = pgbench.script("citus_mark", &format!("{new_id}{mark}"));
    let hand = pgbench.script("citus_hand", &format!("{new_id}{insert}"));
    let one_node = pgbench.script("citus_local", &format!("{new_id}SELECT dedup.mark('n-' || :r, NULL, 'local');\n"));
    let delegated_tx = in_tx(&delegated, "citus_delegated_tx", mark);
    let delegated_alone = delegated.script("citus_delegated", &format!("{new_id}{mark}"));
    let call = |function: &str| format!("SELECT {function}('n-' || :r);\n");
    let function_tx = in_tx(&pgbench, "citus_function_tx", &call("hand_insert"));
    let nothing_tx = in_tx(&delegated, "citus_delegated_nothing_tx", &call("delegated_nothing"));
    let hand_delegated_tx = in_tx(&delegated, "citus_delegated_hand_tx", &call("delegated_hand_insert"));
    let local_tx = in_tx(&delegated, "citus_delegated_local_tx", &call("delegated_local_insert"));
    let mut rows = Vec::new();
    for clients in [1, 8] {
        let setting = Setting {
            clients,
            commit: Commit::Async,
            secs: scale.run_secs,
            rounds: scale.rounds,
            connect_per_tx: false,
            one_cpu: false,
        };
        let mut sides: Vec<Side> =
            [ours_tx.clone(), hand_tx.clone(), ours.clone(), hand.clone(), one_node.clone(), function_tx.clone()]
                .map(|script| Side::Sql { script, ids: 1 })
                .into();
        for script in [
            delegated_tx.clone(),
            delegated_alone.clone(),
            nothing_tx.clone(),
            local_tx.clone(),
            hand_delegated_tx.clone(),
        ] {
            sides.push(Side::SqlOn { pgbench: &delegated, script, ids: 1 });
        }
        let m = compare(&mut c, &pgbench, &setting, &sides);
        let at = setting.label();
        // A row of side `a` against side `b` (indexes into `sides`), with each round's rates. Not `clients::row`:
        // its WAL and CPU figures would be the coordinator's alone, little of what a three-node cluster does.
        let row = |scenario: String, (a_label, a): (&str, usize), (b_label, b): (&str, usize)| {
            Row::new(&scenario, (a_label, m[a].rate), (b_label, m[b].rate), "ids/s").rounds(&m[a].rounds, &m[b].rounds)
        };
        // The goal's row: the two sides alone, paired. Among eleven sides, one side's runs lie a minute apart and
        // its medians of five rounds spread by ±10%, around a ratio a few points from its goal.
        let p = paired(
            &mut c,
            &pgbench,
            &setting.paired(scale),
            Side::Sql { script: ours_tx.clone(), ids: 1 },
            Side::Sql { script: hand_tx.clone(), ids: 1 },
        );
        let scenario =
            "mark() on a distributed inbox vs INSERT ... ON CONFLICT through Citus, in a transaction, paired";
        rows.push(
            p.row(&format!("Citus: {scenario}, {at}"), "mark, distributed", "hand-written", "ids/s")
                .goal(Goal::AtLeast(0.95)),
        );
        // The rows against the hand-written INSERT in a transaction, all measured in the same rounds.
        let in_tx_row = |scenario: &str, side: (&str, usize)| {
            row(format!("Citus: {scenario} in a transaction, {at}"), side, ("hand-written", 1))
        };
        rows.push(in_tx_row("the same in the rounds of the ceilings below,", ("mark, distributed", 0)));
        rows.push(in_tx_row(
            "ceiling: the hand-written INSERT run by a PL/pgSQL function vs hand-written,",
            ("in a function", 5),
        ));
        rows.push(row(
            format!("Citus: the same, each alone in autocommit, {at}"),
            ("mark, distributed", 2),
            ("hand-written", 3),
        ));
        rows.push(
            in_tx_row(
                "mark() delegated to the worker (create_distributed_function) vs hand-written,",
                ("mark, delegated", 6),
            )
            .goal(Goal::AtLeast(1.0)),
        );
        rows.push(in_tx_row("ceiling: a delegated function doing nothing vs hand-written,", ("delegated, nothing", 8)));
        rows.push(in_tx_row(
            "ceiling: the hand-written INSERT run by a delegated PL/pgSQL function vs hand-written,",
            ("delegated, hand-written", 10),
        ));
        rows.push(in_tx_row(
            "ceiling: a delegated function inserting into a plain table of the worker vs hand-written,",
            ("delegated, plain table", 9),
        ));
        rows.push(row(
            format!("Citus: mark() delegated vs hand-written, each alone in autocommit, {at}"),
            ("mark, delegated", 7),
            ("hand-written", 3),
        ));
        rows.push(row(
            format!("Citus: mark() distributed vs into the coordinator's own inbox, autocommit, {at}"),
            ("distributed", 2),
            ("one node", 4),
        ));
    }
    drop(c);
    cluster.destroy();
    rows
}
