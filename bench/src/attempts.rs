//! Delivery attempts (issue 24): `attempt()` of a new id against `mark()` of a new id, which it must undercut: it
//! writes no heap row and no WAL on the caller's path (the worker writes the counts that changed once per
//! `dedup.attempts_flush_interval`, and that WAL counts here too, since it falls inside the runs). One
//! transaction per call from pgbench, 1 and 8 clients, sync off, with `SELECT 1` as the ceiling at 1 client (what
//! any call costs a pgbench client); and the same calls in a server-side loop, where the client's round trip is
//! gone.

use crate::clients::{mark_sql, one_id_script, row};
use crate::compare::{compare, Setting, Side};
use crate::pgbench::{Commit, Pgbench};
use crate::{alternate, timed, Goal, Row, Scale};
use pg_dedup_harness::postgres::Client;

const GOAL: Goal = Goal::AtLeast(1.5);

pub fn scenarios(c: &mut Client, pgbench: &Pgbench, scale: &Scale) -> Vec<Row> {
    let attempt = |id: &str| format!("SELECT dedup.attempt({id})");
    let mark = mark_sql("default");
    let script = |name: &str, statement: &dyn Fn(&str) -> String| Side::Sql {
        script: pgbench.script(name, &one_id_script(statement, 0, 1)),
        ids: 1,
    };
    let mut rows = Vec::new();
    for clients in [1, 8] {
        let mut sides = vec![script("attempt_new", &attempt), script("mark_new_for_attempt", &mark)];
        if clients == 1 {
            sides.push(Side::Sql { script: pgbench.script("select_1_for_attempt", "SELECT 1;\n"), ids: 1 });
        }
        let setting = Setting {
            clients,
            commit: Commit::Async,
            secs: scale.run_secs,
            rounds: scale.rounds,
            connect_per_tx: false,
            one_cpu: false,
        };
        let m = compare(c, pgbench, &setting, &sides);
        let at = setting.label();
        rows.push(
            row(format!("attempt() of a new id per tx vs mark(), {at}"), ("attempt", &m[0]), ("mark", &m[1]), "tx/s")
                .goal(GOAL),
        );
        if clients == 1 {
            rows.push(row(
                format!("ceiling: SELECT 1 per tx vs mark(), {at}"),
                ("SELECT 1", &m[2]),
                ("mark", &m[1]),
                "tx/s",
            ));
        }
    }
    let n = scale.marks;
    let [a, m] = alternate(scale.rounds, |variant, round| {
        let call = ["dedup.attempt", "dedup.mark"][variant];
        timed(c, &format!("SELECT count({call}('loop-{variant}-{round}-' || g)) FROM generate_series(1, {n}) g"), n)
    });
    rows.push(
        Row::new("attempt() vs mark() of new ids, server-side loop", ("attempt", a), ("mark", m), "calls/s").goal(GOAL),
    );
    rows
}
