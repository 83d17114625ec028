//! Inboxes distributed with Citus (docs/scale-out.md): `distribute_inbox()` makes an inbox's table a Citus
//! hash-distributed table on `id` (optionally co-located with a business table), `undistribute_inbox()` brings it
//! back to one node.
//!
//! A distributed inbox's rows live in shards on the worker nodes; the table on the coordinator (and the copy of it
//! on each worker) is a shell that holds none of them. So every path that touches the local heap or indexes stands
//! aside for it, and everything goes through SQL, which Citus plans and routes:
//! - `Shape` says `distributed`; such an inbox is never `plain` (no direct insert, lookup or update);
//! - the Bloom filter never answers for it (its rows are written on other nodes, where no trigger of ours sets
//!   bits): its filter trigger is dropped when it is distributed, it is never loaded, and the worker does not
//!   repair its trigger;
//! - the statements Citus cannot run take a form it can (`inbox::Stmt`): the batch insert inside a CTE, the purge
//!   by id instead of by ctid.
//!
//! Whether a table is distributed is read from `pg_dist_partition`, which Citus keeps on the coordinator and, with
//! metadata synced, on every worker. Citus invalidates a table's relcache entry when that changes, which drops the
//! inbox's cached shape with it.

use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::{guc, input, rights, trigger};
use pgrx::prelude::*;
use std::ffi::CStr;

/// Is Citus installed in this database?
pub fn installed() -> bool {
    // SAFETY: a catalog lookup by name; missing_ok = true gives InvalidOid.
    unsafe { pg_sys::get_extension_oid(c"citus".as_ptr(), true) != pg_sys::InvalidOid }
}

/// Does Citus hold table `relid`'s rows elsewhere (a distributed, reference or Citus-local table: any entry in
/// `pg_dist_partition`)? Read from the catalog directly, with no SQL and no privilege needed.
pub fn distributed(relid: pg_sys::Oid) -> bool {
    if !installed() {
        return false;
    }
    // SAFETY: looks up Citus's catalog table and its index by name (both exist where the extension does), scans the
    // index for `relid` with a catalog snapshot, and closes everything before returning.
    unsafe {
        let catalog =
            pg_sys::get_relname_relid(c"pg_dist_partition".as_ptr(), pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE));
        let index = pg_sys::get_relname_relid(
            c"pg_dist_partition_logical_relid_index".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        );
        if catalog == pg_sys::InvalidOid || index == pg_sys::InvalidOid {
            return false;
        }
        let rel = pg_sys::table_open(catalog, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let mut key = pg_sys::ScanKeyData::default();
        pg_sys::ScanKeyInit(
            &mut key,
            1,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_OIDEQ),
            pg_sys::Datum::from(relid),
        );
        let scan = pg_sys::systable_beginscan(rel, index, true, std::ptr::null_mut(), 1, &mut key);
        let found = !pg_sys::systable_getnext(scan).is_null();
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        found
    }
}

/// Is this node the Citus coordinator (where Citus is installed)?
pub fn coordinator() -> bool {
    installed()
        && Spi::get_one::<i32>("SELECT groupid FROM pg_catalog.pg_dist_local_group")
            .unwrap_or_else(|e| internal("reading pg_dist_local_group", e))
            == Some(0)
}

/// Refuses what `distribute_inbox()` and `undistribute_inbox()` cannot do here: no Citus, or not its coordinator.
fn require_coordinator(function: &str) {
    if !installed() {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!("{function}() needs Citus, which is not installed in this database"),
            "Install Citus (CREATE EXTENSION citus) on every node first; see docs/scale-out.md.",
        )
    }
    if !coordinator() {
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
    (inbox.relid, inbox.table.clone(), inbox.default_ttl)
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
                .update(&trigger::create_sql(&table), None, &[])
                .unwrap_or_else(|e| internal("re-creating the filter trigger", e));
            unregister_on_workers(client, name);
        })
    });
}

/// Runs `f` with `lock_timeout` at `timeout` on this node and on every worker its statements reach: a distributed
/// inbox's rows, and so the waits for them, are on the workers, where a setting made here does not apply. A
/// `SET LOCAL` does, with `citus.propagate_set_commands = 'local'`: Citus sends it to the workers already in the
/// transaction and to those it opens later in it. It stays until the transaction ends, so the previous value is put
/// back the same way; when `f` fails, the caller's subtransaction (rolled back here and on the workers) undoes both.
pub fn with_lock_timeout<R>(timeout: &CStr, f: impl FnOnce() -> R) -> R {
    let set = |value: &str| {
        Spi::run(&format!("SET LOCAL lock_timeout = {}", pgrx::spi::quote_literal(value)))
            .unwrap_or_else(|e| internal("setting lock_timeout on the workers", e))
    };
    guc::with_setting(c"citus.propagate_set_commands", c"local", || {
        let previous = Spi::get_one::<String>("SELECT pg_catalog.current_setting('lock_timeout')")
            .unwrap_or_else(|e| internal("reading lock_timeout", e))
            .unwrap_or_default();
        set(&timeout.to_string_lossy());
        let result = f();
        set(&previous);
        result
    })
}

/// Runs `command` on every worker (Citus's `run_command_on_workers`, each in a transaction of its own there); a
/// worker where it failed makes a `dedup:` error naming it.
fn on_workers(client: &mut pgrx::spi::SpiClient<'_>, command: &str, what: &str) {
    let failed = client
        .select(
            "SELECT pg_catalog.string_agg(nodename || ':' || nodeport || ': ' || result, '; ')
               FROM pg_catalog.run_command_on_workers($1) WHERE NOT success",
            None,
            &[command.into()],
        )
        .and_then(|rows| rows.first().get_one::<String>())
        .unwrap_or_else(|e| internal("running a command on the workers", e));
    if let Some(failed) = failed {
        raise(
            PgSqlErrorCode::ERRCODE_CONNECTION_FAILURE,
            format!("could not {what} every worker node: {failed}"),
            "Every node needs pg_dedup (CREATE EXTENSION on the coordinator creates it on the workers Citus knows); \
             fix the node and call the function again.",
        )
    }
}

/// Removes inbox `name` from the workers' registries (it was undistributed or dropped on the coordinator).
pub fn unregister_on_workers(client: &mut pgrx::spi::SpiClient<'_>, name: &str) {
    let unregister = format!("DELETE FROM dedup.inbox_registry WHERE name = {}", pgrx::spi::quote_literal(name));
    on_workers(client, &unregister, "unregister the inbox on");
}

/// `dedup.inboxes.distributed`: is inbox table `relid` distributed by Citus?
#[pg_extern(stable, parallel_safe, name = "is_distributed")]
fn is_distributed(relid: Option<pg_sys::Oid>) -> bool {
    relid.is_some_and(distributed)
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn citus_distributing_without_citus_is_refused() {
        assert!(!super::installed(), "these tests run without Citus (tests/citus.rs has a cluster with it)");
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

    #[pg_test]
    fn citus_a_one_node_inbox_is_not_distributed() {
        run("SELECT dedup.create_inbox('citus_plain')");
        assert!(!one::<bool>("SELECT distributed FROM dedup.inboxes WHERE name = 'citus_plain'"));
        assert!(!one::<bool>("SELECT dedup.is_distributed(NULL)"));
        assert!(
            one::<String>("SELECT filter_trigger FROM dedup.stats WHERE inbox = 'citus_plain'") != "none: distributed"
        );
    }
}
