//! `distribute_inbox()` and `undistribute_inbox()` (docs/scale-out.md): an inbox's table made a Citus table
//! hash-distributed on `id` (optionally co-located with a business table), and brought back to one node. What the
//! rest of pg_dedup needs to know of distributed inboxes is in `citus`.

use crate::citus::{distributed, installed, on_workers, unregister_on_workers};
use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::{citus, input, rights, trigger};
use pgrx::prelude::*;

/// Refuses what `distribute_inbox()` and `undistribute_inbox()` cannot do here: no Citus, or not its coordinator.
fn require_coordinator(function: &str) {
    if !installed() {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!("{function}() needs Citus, which is not installed in this database"),
            "Install Citus (CREATE EXTENSION citus) on every node first; see docs/scale-out.md.",
        )
    }
    if !citus::coordinator() {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!("{function}() runs on the Citus coordinator, and this is a worker node"),
            "Connect to the coordinator and call it there.",
        )
    }
}

/// The inbox's table and default ttl, for a caller allowed to administer it (as `drop_inbox()` requires).
fn administered(verb: &str, name: &str) -> (pg_sys::Oid, String, Interval) {
    let inbox = inbox::open(name, Access::Delete);
    let caller = rights::caller();
    Spi::connect(|client| inbox::require_administrator(client, caller, inbox.relid, name, verb));
    (inbox.relid, inbox.table.clone(), inbox.default_ttl())
}

/// Makes inbox `name`'s table a Citus table distributed by hash on `id`, co-located with `colocate_with` (a table
/// distributed on a `text COLLATE "C"` column) when given, so that a mark and a write to the same key are one
/// single-shard transaction.
#[pg_extern(sql = "
    CREATE FUNCTION dedup.distribute_inbox(name text, colocate_with regclass DEFAULT NULL) RETURNS void
    VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'distribute_inbox_wrapper';
")]
fn distribute_inbox(name: Option<&str>, colocate_with: Option<pg_sys::Oid>) {
    input::require_writable("distribute_inbox");
    require_coordinator("distribute_inbox");
    let name = input::inbox_name(name);
    if name == inbox::DEFAULT_INBOX {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "the default inbox cannot be distributed",
            "It belongs to the extension (pg_dump keeps it with it); create an inbox of your own with \
             dedup.create_inbox() and distribute that.",
        )
    }
    let (relid, table, ttl) = administered("distribute", name);
    if distributed(relid) {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("inbox \"{name}\" is distributed already"),
            "dedup.inboxes shows which inboxes are; dedup.undistribute_inbox() brings one back to this node.",
        )
    }
    let colocate = match colocate_with {
        Some(table) => colocation_target(name, table),
        None => "default".to_owned(),
    };
    rights::as_extension_owner("distribute_inbox", || {
        Spi::connect_mut(|client| {
            // Its rows will be written on the workers, where the filter trigger would set nothing that answers here.
            client
                .update(&format!("DROP TRIGGER IF EXISTS {} ON {table}", trigger::NAME), None, &[])
                .unwrap_or_else(|e| internal("dropping the filter trigger", e));
            client
                .update(
                    "SELECT pg_catalog.create_distributed_table($1::pg_catalog.regclass, 'id', colocate_with => $2)",
                    None,
                    &[relid.into(), colocate.as_str().into()],
                )
                .unwrap_or_else(|e| internal("distributing the inbox table", e));
            // Rows the table held were copied into the shards; the copies left in the shell are dead weight.
            client
                .update(
                    "SELECT pg_catalog.truncate_local_data_after_distributing_table($1::pg_catalog.regclass)",
                    None,
                    &[relid.into()],
                )
                .unwrap_or_else(|e| internal("emptying the local table", e));
            // Workers with Citus's metadata have the shell too: registered there, the inbox works there as well.
            let register = format!(
                "INSERT INTO dedup.inbox_registry (name, default_ttl) VALUES ({}, {}) \
                 ON CONFLICT (name) DO UPDATE SET default_ttl = excluded.default_ttl",
                pgrx::spi::quote_literal(name),
                pgrx::spi::quote_literal(ttl.to_string())
            );
            on_workers(client, &register, "register the inbox on");
        })
    });
}

/// The qualified name of `table`, which inbox `name` can be co-located with: a table Citus distributes by hash on
/// a column of the inbox id's type and collation (`text COLLATE "C"`); otherwise a `dedup:` error that says what
/// is wrong (Citus would refuse too, with less to go on). Qualified, since it is resolved again under the extension
/// owner's search_path.
fn colocation_target(name: &str, table: pg_sys::Oid) -> String {
    // Co-location ties the inbox's shards to the table's (they move together): only for the table's owners.
    let owns = Spi::get_one_with_args::<bool>(
        "SELECT pg_catalog.pg_has_role($1, c.relowner, 'USAGE') FROM pg_catalog.pg_class c
          WHERE c.oid OPERATOR(pg_catalog.=) $2",
        &[rights::caller().into(), table.into()],
    )
    .unwrap_or_else(|e| internal("checking who owns the co-location table", e));
    if owns != Some(true) {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!("permission denied to co-locate inbox \"{name}\" with a table the caller does not own"),
            "Co-locate it with a table you own, or ask the table's owner to call dedup.distribute_inbox().",
        )
    }
    let row = Spi::get_three_with_args::<String, String, bool>(
        "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname),
                pg_catalog.format_type(a.atttypid, a.atttypmod) || coalesce(' COLLATE ' || pg_catalog.quote_ident(co.collname), ''),
                a.atttypid OPERATOR(pg_catalog.=) 'pg_catalog.text'::pg_catalog.regtype
                  AND co.collname OPERATOR(pg_catalog.=) 'C'
           FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
           LEFT JOIN pg_catalog.pg_dist_partition p
                  ON p.logicalrelid OPERATOR(pg_catalog.=) c.oid AND p.partmethod OPERATOR(pg_catalog.=) 'h'
           LEFT JOIN pg_catalog.pg_attribute a
                  ON a.attrelid OPERATOR(pg_catalog.=) c.oid
                 AND a.attname OPERATOR(pg_catalog.=) pg_catalog.column_to_column_name(c.oid, p.partkey)
           LEFT JOIN pg_catalog.pg_collation co ON co.oid OPERATOR(pg_catalog.=) a.attcollation
          WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[table.into()],
    )
    .unwrap_or_else(|e| internal("looking at the co-location table", e));
    match row {
        (Some(qualified), _, Some(true)) => qualified,
        (Some(qualified), None, _) => raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("cannot co-locate inbox \"{name}\" with {qualified}: Citus does not distribute it by hash"),
            "Distribute it first, on a text COLLATE \"C\" column: SELECT create_distributed_table('<table>', '<column>').",
        ),
        (qualified, column_type, _) => raise(
            PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
            format!(
                "cannot co-locate inbox \"{name}\" with {}: it is distributed on a column of type {}, and an \
                 inbox's id is text COLLATE \"C\"",
                qualified.unwrap_or_default(),
                column_type.unwrap_or_default()
            ),
            "Co-located rows need equal distribution values: distribute the table on a text COLLATE \"C\" column \
             (docs/scale-out.md).",
        ),
    }
}

/// Brings distributed inbox `name` back to this node: its rows come back into the local table (Citus's
/// `undistribute_table()`), and its filter trigger is put back.
#[pg_extern(volatile, parallel_unsafe)]
fn undistribute_inbox(name: Option<&str>) {
    input::require_writable("undistribute_inbox");
    require_coordinator("undistribute_inbox");
    let name = input::inbox_name(name);
    let (relid, table, _) = administered("undistribute", name);
    if !distributed(relid) {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("inbox \"{name}\" is not distributed"),
            "dedup.inboxes shows which inboxes are.",
        )
    }
    rights::as_extension_owner("undistribute_inbox", || {
        Spi::connect_mut(|client| {
            client
                .update("SELECT pg_catalog.undistribute_table($1::pg_catalog.regclass)", None, &[relid.into()])
                .unwrap_or_else(|e| internal("undistributing the inbox table", e));
            // Citus re-creates the table from its columns, untyped: an inbox table is of the inbox row type (the
            // catalog finds inboxes by it, and the direct paths want it).
            client
                .update(&format!("ALTER TABLE {table} OF dedup.inbox_row"), None, &[])
                .unwrap_or_else(|e| internal("typing the undistributed table", e));
            client
                .update(&trigger::create_sql(&table, trigger::Key::Id), None, &[])
                .unwrap_or_else(|e| internal("re-creating the filter trigger", e));
            unregister_on_workers(client, name);
        })
    });
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn distribute_without_citus_is_refused() {
        assert!(!crate::citus::installed(), "these tests run without Citus (tests/citus.rs has a cluster with it)");
        run("SELECT dedup.create_inbox('citus_none')");
        assert_dedup_error(
            "SELECT dedup.distribute_inbox('citus_none')",
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        );
        assert_dedup_error(
            "SELECT dedup.undistribute_inbox('citus_none')",
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        );
        let (_, message) = error_of("SELECT dedup.distribute_inbox('citus_none')");
        assert!(message.contains("needs Citus"), "{message}");
    }
}
