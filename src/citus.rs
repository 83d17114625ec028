//! What storage needs to know of Citus (docs/scale-out.md): whether it is installed, whether an inbox table is
//! distributed, how to bound lock waits where the rows are, and how to run a command on every worker. The SQL
//! face that distributes inboxes is `distribute`.
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
use crate::guc;
use pgrx::prelude::*;
use std::ffi::CStr;

/// Is Citus installed in this database?
pub fn installed() -> bool {
    // SAFETY: a catalog lookup by name; missing_ok = true gives InvalidOid.
    unsafe { pg_sys::get_extension_oid(c"citus".as_ptr(), true) != pg_sys::InvalidOid }
}

/// Does Citus hold table `relid`'s rows elsewhere (a distributed, reference or Citus-local table: any entry in
/// `pg_dist_partition`)? Read from the catalog directly, with no SQL and no privilege needed. Without Citus its
/// catalog is not there, which two syscache lookups tell; asking `installed()` first would open pg_extension, and
/// build its relcache entries, in every backend's first call (75 thousand instructions, callgrind, PG 15).
pub fn distributed(relid: pg_sys::Oid) -> bool {
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

/// The `application_name` Citus gives the connections it opens to run tasks: a query pushed down to a node's
/// shards, or a function call it delegates (`IsCitusInternalBackend()` in Citus tests this prefix). Its
/// `run_command_on_*()` connections carry another (`citus_run_command gpid=`).
const TASK_BACKEND_PREFIX: &[u8] = b"citus_internal gpid=";

/// Is this a backend Citus opened to run a task on this node (by its `application_name`, and Citus is here)?
pub fn task_backend() -> bool {
    // SAFETY: reads the application_name GUC's current value, a NUL-terminated string or NULL.
    let named = unsafe {
        let value = pg_sys::application_name;
        !value.is_null() && CStr::from_ptr(value).to_bytes().starts_with(TASK_BACKEND_PREFIX)
    };
    named && installed()
}

/// How a call reached this node in a task backend, for the errors that refuse it there.
const THROUGH_CITUS: &str = "this call reached a node through Citus (a query pushed down to the shards of a \
                             distributed table, or a delegated function call)";

/// Refuses to serve inbox `name`, whose table is not distributed, in a task backend (`task_backend()`). Such a
/// call was routed to this node by the statement's other arguments, never by the inbox: Citus pushes
/// `SELECT dedup.mark(key) FROM <distributed table>` down into every shard's query, and sends a function distributed
/// with `create_distributed_function()` to the node of its distribution argument whatever inbox it names. The table
/// it would find here is this node's own inbox of that name, not the one the caller meant: its marks would answer
/// "new" there and be missed where the caller looks (on the coordinator, a false negative). A distributed inbox is
/// one table on every node, whose rows Citus finds by id, so those are served.
pub fn refuse_task_on_local_inbox(name: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        format!(
            "inbox \"{name}\" is not distributed, and {THROUGH_CITUS}, where its table is that node's own, not the \
             one the statement meant"
        ),
        "Read the ids from the distributed table first, then mark them where the inbox is: WITH ids AS \
         MATERIALIZED (SELECT ... FROM <table>) SELECT dedup.mark(id, inbox => ...) FROM ids. Or distribute the \
         inbox (dedup.distribute_inbox()); see docs/scale-out.md.",
    )
}

/// Refuses `function` (`advance()`, `position()`, `attempt()`, `forget()`) in a task backend (`task_backend()`),
/// whatever inbox it names: what it keeps — the positions table, the counts of delivery attempts in shared memory and their
/// durable rows — is the node's own and is never distributed, so on a worker it would read and write that worker's
/// state, not the coordinator's, where the caller's other calls look (a position that seems never advanced, a
/// count that starts again at 1).
pub fn refuse_task_on_node_state(function: &str) {
    if task_backend() {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!(
                "{function} keeps its state on the node it runs on, and {THROUGH_CITUS}, whose state is not the one \
                 the statement meant"
            ),
            format!(
                "Read the ids from the distributed table first, then call {function} on the coordinator: WITH ids AS \
                 MATERIALIZED (SELECT ... FROM <table>) SELECT ... FROM ids; see docs/scale-out.md."
            ),
        )
    }
}

/// Is this node the Citus coordinator (where Citus is installed)?
pub fn coordinator() -> bool {
    installed()
        && Spi::get_one::<i32>("SELECT groupid FROM pg_catalog.pg_dist_local_group")
            .unwrap_or_else(|e| internal("reading pg_dist_local_group", e))
            == Some(0)
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
pub fn on_workers(client: &mut pgrx::spi::SpiClient<'_>, command: &str, what: &str) {
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
    fn citus_a_one_node_inbox_is_not_distributed() {
        run("SELECT dedup.create_inbox('citus_plain')");
        assert!(!one::<bool>("SELECT distributed FROM dedup.inboxes WHERE name = 'citus_plain'"));
        assert!(!one::<bool>("SELECT dedup.is_distributed(NULL)"));
        assert!(
            one::<String>("SELECT filter_trigger FROM dedup.stats WHERE inbox = 'citus_plain'") != "none: distributed"
        );
    }
}
