//! The registry of inboxes (`dedup.inbox_registry`) and their tables: creating, dropping, finding and listing them.

use super::{Inbox, DEFAULT_INBOX, SCHEMA};
use crate::errors::{internal, raise};
use crate::{filter, rights, shmem, trigger};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

fn table_name(name: &str) -> String {
    format!("inbox_{name}")
}

pub(super) fn qualified(name: &str) -> String {
    pgrx::spi::quote_qualified_identifier(SCHEMA, &table_name(name))
}

fn relation_oid(name: &str) -> pg_sys::Oid {
    let relname = std::ffi::CString::new(table_name(name)).expect("validated names have no NUL");
    crate::catalog::dedup_relation(&relname)
}

/// The registry's oid. It belongs to the extension: it exists.
fn registry() -> pg_sys::Oid {
    crate::catalog::dedup_relation(c"inbox_registry")
}

/// Finding an inbox (once per inbox and session) or listing them needs SELECT on the registry, which holds the
/// inboxes' default TTLs, whether or not this call reads it: a caller who may not read it gets a dedup error saying
/// which grant is missing, at once rather than at the first call that needs a default TTL, and instead of a raw
/// permission error from inside SPI. (Column privileges on the registry do not count: grant SELECT on the table.)
/// Returns the registry's oid.
fn check_registry_readable() -> pg_sys::Oid {
    let relid = registry();
    if !crate::catalog::caller_may_select(relid) {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "permission denied for dedup.inbox_registry, which every call needs",
            "An administrator can run: GRANT SELECT ON dedup.inbox_registry TO <role>; (see docs/privileges.md).",
        )
    }
    relid
}

fn unknown_inbox(name: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
        format!("inbox \"{name}\" does not exist"),
        format!("Create it first: SELECT dedup.create_inbox('{name}', '3 days'); existing ones are in dedup.inboxes."),
    )
}

/// Finds inbox `name`'s table, as the latest snapshot sees the catalogs, whatever this transaction's isolation
/// level: an inbox dropped or created while this runs is found whole or not at all ("does not exist"). (The
/// syscache could not be trusted for this: a committing transaction is visible to snapshots a moment before its
/// cache invalidations are sent.) The caller locks the table, which waits for its creator's commit to finish.
///
/// A table of schema dedup named for the inbox and of the inbox row type is the inbox: `create` makes the two
/// together with its registry row, and `drop` removes them together (as `catalog::inbox_tables` counts inboxes).
/// Its default TTL is then read from the registry only when a call needs it (`Inbox::default_ttl`). Reading the
/// registry here would build its relcache entry and its primary key's in every new backend, about 0.5 million of
/// the 1.3 million instructions a connection's first `mark()` took beyond a `SELECT 1` (callgrind, PG 15), which
/// connect-per-request clients pay on every request. Any other table (a Citus worker's untyped shell table, an
/// owner's `NOT OF`) is an inbox only if the registry says so, through the same snapshot.
pub(super) fn load(name: &str) -> Inbox {
    let registry = check_registry_readable();
    let table = std::ffi::CString::new(table_name(name)).expect("validated names have no NUL");
    let namespace = crate::catalog::dedup_namespace();
    // `registered`: None when the table is of the inbox row type (its TTL is read on demand), else what the registry
    // says, through the same snapshot.
    let (class, registered) = with_latest_snapshot(|snapshot| {
        // SAFETY: the snapshot is registered (`with_latest_snapshot`).
        let class = unsafe { class_of(&table, namespace, snapshot) };
        let typed = class.as_ref().is_some_and(|c| {
            c.relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
                && c.reloftype != pg_sys::InvalidOid
                && c.reloftype == inbox_row_type(namespace)
        });
        // SAFETY: as above.
        (class, (!typed).then(|| unsafe { registered_ttl(registry, name, snapshot) }))
    });
    let default_ttl = match registered {
        Some(None) => unknown_inbox(name),
        read => read.flatten(),
    };
    let Some(class) = class else {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!("inbox \"{name}\" is registered but its table {} is missing", qualified(name)),
            format!("Recreate it: SELECT dedup.drop_inbox('{name}'); SELECT dedup.create_inbox('{name}');"),
        )
    };
    let ns = shmem::namespace(class.oid);
    Inbox::new(name, class.oid, qualified(name), default_ttl, ns)
}

/// The default TTL of inbox `name`, read from the registry through the latest snapshot: for an inbox `load` found
/// by its table, whose lock (held by the caller) keeps `drop` from removing the row meanwhile. The privilege was
/// checked when the inbox was loaded, as for the TTL read then.
pub(super) fn default_ttl(name: &str) -> Interval {
    let registry = registry();
    // SAFETY: the snapshot is registered (`with_latest_snapshot`).
    let ttl = with_latest_snapshot(|snapshot| unsafe { registered_ttl(registry, name, snapshot) });
    ttl.unwrap_or_else(|| unknown_inbox(name))
}

/// Runs `f` with the latest snapshot (not this transaction's), registered for it.
fn with_latest_snapshot<R>(f: impl FnOnce(pg_sys::Snapshot) -> R) -> R {
    // SAFETY: the snapshot is registered before `f` uses it and unregistered after; if `f` raises an ERROR, the
    // (sub)transaction's resource owner releases it.
    unsafe {
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let result = f(snapshot);
        pg_sys::UnregisterSnapshot(snapshot);
        result
    }
}

/// The oid of type dedup.inbox_row (`namespace`: schema dedup's oid); it belongs to the extension, so it exists.
fn inbox_row_type(namespace: pg_sys::Oid) -> pg_sys::Oid {
    // SAFETY: a syscache lookup by a NUL-terminated name and a schema oid; InvalidOid if there is none.
    unsafe {
        pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::TYPENAMENSP as i32,
            pg_sys::Anum_pg_type_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(c"inbox_row".as_ptr()),
            pg_sys::Datum::from(namespace),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

/// The default TTL of registered inbox `name` as `snapshot` sees the registry (None: not registered).
///
/// An index scan of the registry's primary key rather than a query: a query through SPI is parsed, analysed and
/// planned again in every new backend.
///
/// # Safety
/// `snapshot` must be a registered MVCC snapshot.
unsafe fn registered_ttl(registry: pg_sys::Oid, name: &str, snapshot: pg_sys::Snapshot) -> Option<Interval> {
    // SAFETY: the registry is opened (and locked, as a query would lock it) for its scan only, and the scan ends
    // before it closes. The value is copied out of the tuple before the scan ends.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(registry, lock);
        let mut key = pg_sys::ScanKeyData::default();
        pg_sys::ScanKeyInit(
            &mut key,
            1, // name: the primary key's column (systable_beginscan applies the index's collation)
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_TEXTEQ),
            name.into_datum().expect("text is a datum"),
        );
        // Without its primary key (only a superuser could drop it) the registry's few rows are scanned instead.
        let pkey = crate::ports::primary_key_index(rel);
        let scan = pg_sys::systable_beginscan(rel, pkey, pkey != pg_sys::InvalidOid, snapshot, 1, &mut key);
        let row = pg_sys::systable_getnext(scan);
        let ttl = (!row.is_null()).then(|| {
            let mut isnull = false;
            let ttl = pg_sys::heap_getattr(row, 2, (*rel).rd_att, &mut isnull);
            Interval::from_polymorphic_datum(ttl, isnull, pg_sys::INTERVALOID).expect("default_ttl is NOT NULL")
        });
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, lock);
        ttl
    }
}

/// What `load` reads of a relation's pg_class row.
struct Class {
    oid: pg_sys::Oid,
    relkind: std::ffi::c_char,
    reloftype: pg_sys::Oid,
}

/// Relation `relname` of schema `namespace` as `snapshot` sees pg_class (None: there is none).
///
/// # Safety
/// `snapshot` must be a registered MVCC snapshot.
unsafe fn class_of(relname: &std::ffi::CStr, namespace: pg_sys::Oid, snapshot: pg_sys::Snapshot) -> Option<Class> {
    // SAFETY: pg_class and its name index always exist; the scan ends and the relation closes before returning, and
    // the values are read from the tuple before that.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(pg_sys::RelationRelationId, lock);
        let mut relname_key = pg_sys::NameData::default();
        pg_sys::namestrcpy(&mut relname_key, relname.as_ptr());
        let mut keys = [pg_sys::ScanKeyData::default(), pg_sys::ScanKeyData::default()];
        pg_sys::ScanKeyInit(
            &mut keys[0],
            pg_sys::Anum_pg_class_relname as pg_sys::AttrNumber,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_NAMEEQ),
            pg_sys::Datum::from(&mut relname_key as *mut pg_sys::NameData),
        );
        pg_sys::ScanKeyInit(
            &mut keys[1],
            pg_sys::Anum_pg_class_relnamespace as pg_sys::AttrNumber,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_OIDEQ),
            pg_sys::Datum::from(namespace),
        );
        let index = pg_sys::Oid::from(pg_sys::ClassNameNspIndexId);
        let scan = pg_sys::systable_beginscan(rel, index, true, snapshot, 2, keys.as_mut_ptr());
        let tuple = pg_sys::systable_getnext(scan);
        let class = (!tuple.is_null()).then(|| {
            let form = &*crate::ports::GETSTRUCT::<pg_sys::FormData_pg_class>(tuple);
            Class { oid: form.oid, relkind: form.relkind, reloftype: form.reloftype }
        });
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, lock);
        class
    }
}

/// Creates the inbox's table and registers it, for a caller with EXECUTE on `dedup.create_inbox()`.
///
/// The table belongs to the extension's owner, like the rest of schema dedup, so no other role can alter it, add
/// a trigger to it or drop it: nothing runs on it but what the extension put there, whoever writes to it (the
/// background worker included). The caller gets every privilege on it but TRIGGER and REFERENCES, each WITH GRANT
/// OPTION: it grants the applications their share, and holding the grant option is what lets it drop the inbox.
///
/// The table is an ordinary (non-extension) table so pg_dump keeps its definition, rows and grants; being typed
/// `OF dedup.inbox_row`, it depends on the extension, so `DROP EXTENSION` refuses to orphan it (and `DROP
/// EXTENSION ... CASCADE` removes it). The btree on `expires_at` lets a purge batch find expired marks without
/// scanning the table; autovacuum runs early because purging leaves dead rows steadily.
pub fn create(name: &str, default_ttl: Interval) {
    let table = qualified(name);
    let caller = rights::caller();
    rights::as_extension_owner("create_inbox", || {
        Spi::connect_mut(|client| {
            serialize_registry_changes(client);
            if is_registered(client, name) || relation_oid(name) != pg_sys::InvalidOid {
                raise(
                    PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT,
                    format!("inbox \"{name}\" already exists"),
                    "Pick another name, or drop the old inbox first with dedup.drop_inbox().",
                )
            }
            let mut statements = vec![
                format!(
                    "CREATE TABLE {table} OF dedup.inbox_row \
                     (id WITH OPTIONS PRIMARY KEY, expires_at WITH OPTIONS NOT NULL) \
                     WITH (autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_insert_scale_factor = 0.05)"
                ),
                format!("CREATE INDEX ON {table} (expires_at)"),
                trigger::create_sql(&table, trigger::Key::Id),
            ];
            if caller != rights::extension_owner() && !rights::is_superuser(caller) {
                statements.push(format!(
                    "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON {table} TO {} WITH GRANT OPTION",
                    rights::role_name(caller)
                ));
            }
            client
                .update(&statements.join("; "), None, &[])
                .unwrap_or_else(|e| internal("creating the inbox table", e));
            client
                .update(
                    "INSERT INTO dedup.inbox_registry (name, default_ttl) VALUES ($1, $2)",
                    None,
                    &[name.into(), default_ttl.into()],
                )
                .unwrap_or_else(|e| internal("registering the inbox", e));
        })
    });
    // Empty, and every future row passes the trigger: the filter can answer for it at once.
    filter::trust_new_inbox(shmem::namespace(relation_oid(name)));
}

/// What the rooms above storage keep of an inbox, for `drop`: `check` may refuse the drop (it raises) before
/// anything is dropped, and `forget` deletes what they keep of the inbox, in the same transaction. Both run as the
/// extension's owner, with the registry locked.
pub struct Dependents<'a> {
    pub check: &'a dyn Fn(&str),
    pub forget: &'a dyn Fn(&str),
}

/// Drops an inbox, for a caller with EXECUTE on `dedup.drop_inbox()` who administers it: holds DELETE on its table
/// WITH GRANT OPTION (its creator does, as do the table's owner and superusers).
pub fn drop(name: &str, dependents: &Dependents) {
    if name == DEFAULT_INBOX {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "the default inbox cannot be dropped",
            "Empty it instead with TRUNCATE dedup.inbox_default, or use your own inboxes.",
        )
    }
    let caller = rights::caller();
    rights::as_extension_owner("drop_inbox", || {
        Spi::connect_mut(|client| {
            serialize_registry_changes(client);
            if !is_registered(client, name) {
                unknown_inbox(name)
            }
            // A table someone dropped by hand must not make the inbox impossible to unregister; with no table to
            // hold grants, only the extension's owner (and superusers) may.
            let relid = relation_oid(name);
            if relid == pg_sys::InvalidOid && !rights::acts_for(caller, rights::extension_owner()) {
                raise(
                    PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                    format!("permission denied to drop inbox \"{name}\", whose table is missing"),
                    "Ask the extension's owner or a superuser to drop it.",
                )
            }
            if relid != pg_sys::InvalidOid {
                require_administrator(client, caller, relid, name, "drop");
                // Before the dependents look: an attach() of this inbox that holds the table commits first, and
                // its attachment is then seen (and refuses the drop).
                // SAFETY: locks a relation by oid until the transaction ends.
                unsafe { pg_sys::LockRelationOid(relid, pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE) };
            }
            (dependents.check)(name);
            if relid != pg_sys::InvalidOid {
                let table = qualified(name);
                if crate::citus::distributed(relid) {
                    crate::citus::unregister_on_workers(client, name);
                }
                client
                    .update(&format!("DROP TABLE {table}"), None, &[])
                    .unwrap_or_else(|e| internal("dropping the inbox table", e));
            }
            client
                .update("DELETE FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1", None, &[name.into()])
                .unwrap_or_else(|e| internal("unregistering the inbox", e));
            (dependents.forget)(name);
        })
    });
}

/// Refuses `caller` the administration (`verb`: drop, distribute, ...) of inbox `name`, table `relid`, unless it is
/// the role that created the inbox (it holds `DELETE ... WITH GRANT OPTION` on the table), the extension's owner or
/// a superuser.
pub fn require_administrator(client: &SpiClient<'_>, caller: pg_sys::Oid, relid: pg_sys::Oid, name: &str, verb: &str) {
    let administers = client
        .select(
            "SELECT pg_catalog.has_table_privilege($1, $2, 'DELETE WITH GRANT OPTION')",
            None,
            &[caller.into(), relid.into()],
        )
        .and_then(|rows| rows.first().get_one::<bool>())
        .unwrap_or_else(|e| internal("checking who administers the inbox", e));
    if administers != Some(true) {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!("permission denied to {verb} inbox \"{name}\""),
            format!(
                "An inbox is administered by the role that created it (it holds DELETE ON {} WITH GRANT OPTION), by \
                 the extension's owner or by a superuser.",
                qualified(name)
            ),
        )
    }
}

fn is_registered(client: &SpiClient<'_>, name: &str) -> bool {
    client
        .select("SELECT 1 FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1", None, &[name.into()])
        .map(|rows| !rows.is_empty())
        .unwrap_or_else(|e| internal("reading dedup.inbox_registry", e))
}

/// Creating and dropping inboxes take turns (readers are not blocked), so two sessions creating the same inbox
/// get a clean "already exists" instead of a raw catalog error.
fn serialize_registry_changes(client: &mut SpiClient<'_>) {
    client
        .update("LOCK TABLE dedup.inbox_registry IN SHARE ROW EXCLUSIVE MODE", None, &[])
        .unwrap_or_else(|e| internal("locking dedup.inbox_registry", e));
}

/// Names of every registered inbox, for `purge()` over all of them.
pub fn all_names() -> Vec<String> {
    check_registry_readable();
    Spi::connect(|client| {
        client
            .select("SELECT name FROM dedup.inbox_registry ORDER BY name", None, &[])
            .map(|rows| rows.filter_map(|row| row.get::<String>(1).ok().flatten()).collect())
            .unwrap_or_else(|e| internal("reading dedup.inbox_registry", e))
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn registry_the_default_inbox_exists_after_create_extension() {
        assert_eq!(
            one::<String>("SELECT default_ttl::text FROM dedup.inbox_registry WHERE name = 'default'"),
            "3 days"
        );
        assert_eq!(count("dedup.inbox_default"), count("dedup.inbox_default"), "its table can be read");
    }

    #[pg_test]
    fn registry_an_inbox_table_has_the_shape_marks_rely_on() {
        run("SELECT dedup.create_inbox('shape')");
        let rel = "'dedup.inbox_shape'::regclass";
        assert_eq!(
            one::<String>(&format!("SELECT reloftype::regtype::text FROM pg_class WHERE oid = {rel}")),
            "dedup.inbox_row"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = {rel} AND indisprimary"
            )),
            "CREATE UNIQUE INDEX inbox_shape_pkey ON dedup.inbox_shape USING btree (id)"
        );
        assert_eq!(count(&format!("pg_index WHERE indrelid = {rel} AND NOT indisprimary")), 1, "the expires_at btree");
        assert_eq!(
            one::<String>(&format!(
                "SELECT pg_get_triggerdef(oid) || ' ' || tgenabled::text FROM pg_trigger WHERE tgrelid = {rel}"
            )),
            "CREATE TRIGGER dedup_filter AFTER INSERT OR UPDATE OF id ON dedup.inbox_shape FOR EACH ROW EXECUTE \
             FUNCTION dedup.inbox_filter_trigger() A"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT attcollation::regcollation::text FROM pg_attribute WHERE attrelid = {rel} AND attname = 'id'"
            )),
            "\"C\""
        );
    }

    #[pg_test]
    fn registry_inbox_tables_belong_to_the_extensions_owner_and_their_creator_gets_grant_options() {
        run("CREATE ROLE reg_admin; GRANT USAGE ON SCHEMA dedup TO reg_admin;
             GRANT EXECUTE ON FUNCTION dedup.create_inbox(text, interval), dedup.drop_inbox(text) TO reg_admin;
             GRANT SELECT ON dedup.inbox_registry TO reg_admin;
             SET LOCAL ROLE reg_admin; SELECT dedup.create_inbox('delegated'); RESET ROLE;");
        assert_eq!(
            one::<String>("SELECT relowner::regrole::text FROM pg_class WHERE oid = 'dedup.inbox_delegated'::regclass"),
            one::<String>("SELECT extowner::regrole::text FROM pg_extension WHERE extname = 'pg_dedup'")
        );
        for (privilege, expected) in [
            ("SELECT WITH GRANT OPTION", true),
            ("INSERT WITH GRANT OPTION", true),
            ("UPDATE WITH GRANT OPTION", true),
            ("DELETE WITH GRANT OPTION", true),
            ("TRUNCATE WITH GRANT OPTION", true),
            ("TRIGGER", false),
            ("REFERENCES", false),
        ] {
            let has = one::<bool>(&format!(
                "SELECT has_table_privilege('reg_admin', 'dedup.inbox_delegated', '{privilege}')"
            ));
            assert_eq!(has, expected, "{privilege}");
        }
        run("SET LOCAL ROLE reg_admin; SELECT dedup.drop_inbox('delegated'); RESET ROLE");
        assert_eq!(count("dedup.inbox_registry WHERE name = 'delegated'"), 0);
    }

    #[pg_test]
    fn registry_only_an_inbox_administrator_may_drop_it() {
        run("CREATE ROLE reg_stranger; GRANT USAGE ON SCHEMA dedup TO reg_stranger;
             GRANT EXECUTE ON FUNCTION dedup.drop_inbox(text) TO reg_stranger;
             GRANT SELECT ON dedup.inbox_registry TO reg_stranger;
             SELECT dedup.create_inbox('guarded_drop');
             GRANT SELECT, INSERT, UPDATE, DELETE ON dedup.inbox_guarded_drop TO reg_stranger;");
        run("SET LOCAL ROLE reg_stranger");
        assert_dedup_error("SELECT dedup.drop_inbox('guarded_drop')", PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
        run("RESET ROLE");
        assert_eq!(count("dedup.inbox_registry WHERE name = 'guarded_drop'"), 1);
    }

    #[pg_test]
    fn registry_listing_returns_every_inbox_in_name_order() {
        run("SELECT dedup.create_inbox('list_b'); SELECT dedup.create_inbox('list_a')");
        let names = super::all_names();
        let ours: Vec<&String> = names.iter().filter(|n| n.starts_with("list_") || *n == "default").collect();
        assert_eq!(ours, ["default", "list_a", "list_b"]);
    }

    #[pg_test]
    fn registry_a_caller_who_cannot_read_it_is_told_which_grant_is_missing() {
        run("CREATE ROLE reg_blind; GRANT USAGE ON SCHEMA dedup TO reg_blind;
             GRANT EXECUTE ON FUNCTION dedup.mark(text, interval, text) TO reg_blind;
             SET LOCAL ROLE reg_blind");
        let (code, message) = error_of("SELECT dedup.mark('x', NULL, 'never_opened')");
        run("RESET ROLE");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
        assert!(message.contains("dedup.inbox_registry"), "{message}");
    }

    #[pg_test]
    fn registry_a_typed_table_is_its_inbox_and_anything_else_needs_a_registry_row() {
        // Typed: found by its table, the default TTL read from the registry when a mark needs it.
        run("SELECT dedup.create_inbox('reg_typed', '7 minutes')");
        assert!(one::<bool>("SELECT dedup.mark('a', '1 day', 'reg_typed')"));
        assert!(one::<bool>("SELECT dedup.mark('b', NULL, 'reg_typed')"));
        let ttl = "SELECT (expires_at - statement_timestamp())::text FROM dedup.inbox_reg_typed WHERE id = 'b'";
        assert_eq!(one::<String>(ttl), "00:07:00");
        // Untyped (an owner's NOT OF, a Citus worker's shell): an inbox while registered, through the registry.
        run("SELECT dedup.create_inbox('reg_untyped', '5 minutes'); ALTER TABLE dedup.inbox_reg_untyped NOT OF");
        assert!(one::<bool>("SELECT dedup.mark('c', NULL, 'reg_untyped')"));
        let ttl = "SELECT (expires_at - statement_timestamp())::text FROM dedup.inbox_reg_untyped WHERE id = 'c'";
        assert_eq!(one::<String>(ttl), "00:05:00");
        run("CREATE TABLE dedup.inbox_reg_stray (LIKE dedup.inbox_default INCLUDING ALL)");
        assert_dedup_error("SELECT dedup.mark('d', '1 day', 'reg_stray')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
        // The registry itself is dedup.inbox_registry, and no inbox.
        assert_dedup_error("SELECT dedup.mark('e', '1 day', 'registry')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
        // A typed table whose registry row is gone is still found; a mark that needs its TTL is told it is gone.
        run("SELECT dedup.create_inbox('reg_orphan'); DELETE FROM dedup.inbox_registry WHERE name = 'reg_orphan'");
        assert!(one::<bool>("SELECT dedup.mark('f', '1 day', 'reg_orphan')"));
        assert_dedup_error("SELECT dedup.mark('g', NULL, 'reg_orphan')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
    }
}
