//! The registry of inboxes (`dedup.inbox_registry`) and their tables: creating, dropping, finding and listing them.

use super::{Inbox, DEFAULT_INBOX, SCHEMA};
use crate::errors::{internal, raise};
use crate::{filter, shmem};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

fn table_name(name: &str) -> String {
    format!("inbox_{name}")
}

pub(super) fn qualified(name: &str) -> String {
    pgrx::spi::quote_qualified_identifier(SCHEMA, &table_name(name))
}

fn schema_oid() -> pg_sys::Oid {
    let schema = std::ffi::CString::new(SCHEMA).expect("no NUL in schema name");
    // SAFETY: a NUL-terminated name; missing_ok = false raises a clean ERROR if the schema is gone.
    unsafe { pg_sys::get_namespace_oid(schema.as_ptr(), false) }
}

/// The table of inbox `name`, looked up without locking it (None if it has none).
pub fn relid(name: &str) -> Option<pg_sys::Oid> {
    Some(relation_oid(name)).filter(|oid| *oid != pg_sys::InvalidOid)
}

fn relation_oid(name: &str) -> pg_sys::Oid {
    dedup_relation_oid(&table_name(name))
}

/// A relation of schema dedup by name (InvalidOid if there is none).
fn dedup_relation_oid(relname: &str) -> pg_sys::Oid {
    let rel = std::ffi::CString::new(relname).expect("validated names have no NUL");
    // SAFETY: a NUL-terminated name and a schema oid; returns InvalidOid when there is no such relation.
    unsafe { pg_sys::get_relname_relid(rel.as_ptr(), schema_oid()) }
}

/// Finding an inbox (once per inbox and session) or listing them reads the registry: a caller who may not read it
/// gets a dedup error saying which grant is missing, instead of a raw permission error from inside SPI. (Column privileges on
/// the registry do not count: grant SELECT on the table.)
fn check_registry_readable() {
    let relid = dedup_relation_oid("inbox_registry");
    // SAFETY: an ACL check of an existing relation (the registry belongs to the extension) for the current user.
    let readable =
        unsafe { pg_sys::pg_class_aclcheck(relid, pg_sys::GetUserId(), pg_sys::ACL_SELECT as pg_sys::AclMode) };
    if readable != pg_sys::AclResult::ACLCHECK_OK {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "permission denied for dedup.inbox_registry, where every call looks up its inbox",
            "An administrator can run: GRANT SELECT ON dedup.inbox_registry TO <role>; (see docs/privileges.md).",
        )
    }
}

fn unknown_inbox(name: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
        format!("inbox \"{name}\" does not exist"),
        format!("Create it first: SELECT dedup.create_inbox('{name}', '3 days'); existing ones are in dedup.inboxes."),
    )
}

/// Reads inbox `name` from the registry and finds its table.
pub(super) fn load(name: &str) -> Inbox {
    check_registry_readable();
    let default_ttl = Spi::connect(|client| {
        client
            .select(
                "SELECT default_ttl FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1",
                None,
                &[name.into()],
            )
            .and_then(|rows| if rows.is_empty() { Ok(None) } else { rows.first().get_one::<Interval>() })
            .unwrap_or_else(|e| internal("reading dedup.inbox_registry", e))
    });
    let Some(default_ttl) = default_ttl else { unknown_inbox(name) };
    let relid = relation_oid(name);
    if relid == pg_sys::InvalidOid {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!("inbox \"{name}\" is registered but its table {} is missing", qualified(name)),
            format!("Recreate it: SELECT dedup.drop_inbox('{name}'); SELECT dedup.create_inbox('{name}');"),
        )
    }
    let ns = shmem::namespace(relid);
    Inbox::new(name, relid, qualified(name), default_ttl, ns)
}

/// Creates the inbox's table and registers it. The table is an ordinary (non-extension) table so pg_dump keeps its
/// definition and rows; being typed `OF dedup.inbox_row`, it depends on the extension, so `DROP EXTENSION` refuses
/// to orphan it (and `DROP EXTENSION ... CASCADE` removes it). The btree on `expires_at` lets a purge batch find
/// expired marks without scanning the table; autovacuum runs early because purging leaves dead rows steadily.
pub fn create(name: &str, default_ttl: Interval) {
    let table = qualified(name);
    Spi::connect_mut(|client| {
        serialize_registry_changes(client);
        if is_registered(client, name) || relation_oid(name) != pg_sys::InvalidOid {
            raise(
                PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT,
                format!("inbox \"{name}\" already exists"),
                "Pick another name, or drop the old inbox first with dedup.drop_inbox().",
            )
        }
        client
            .update(
                &format!(
                    "CREATE TABLE {table} OF dedup.inbox_row \
                     (id WITH OPTIONS PRIMARY KEY, expires_at WITH OPTIONS NOT NULL) \
                     WITH (autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_insert_scale_factor = 0.05); \
                     CREATE INDEX ON {table} (expires_at)"
                ),
                None,
                &[],
            )
            .unwrap_or_else(|e| internal("creating the inbox table", e));
        client
            .update(
                &format!(
                    "CREATE TRIGGER dedup_filter BEFORE INSERT OR UPDATE ON {table} \
                     FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger(); \
                     ALTER TABLE {table} ENABLE ALWAYS TRIGGER dedup_filter"
                ),
                None,
                &[],
            )
            .unwrap_or_else(|e| internal("creating the inbox trigger", e));
        client
            .update(
                "INSERT INTO dedup.inbox_registry (name, default_ttl) VALUES ($1, $2)",
                None,
                &[name.into(), default_ttl.into()],
            )
            .unwrap_or_else(|e| internal("registering the inbox", e));
    });
    // Empty, and every future row passes the trigger: the filter can answer for it at once.
    filter::trust_new_inbox(shmem::namespace(relation_oid(name)));
}

pub fn drop(name: &str) {
    if name == DEFAULT_INBOX {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "the default inbox cannot be dropped",
            "Empty it instead with TRUNCATE dedup.inbox_default, or use your own inboxes.",
        )
    }
    Spi::connect_mut(|client| {
        serialize_registry_changes(client);
        if !is_registered(client, name) {
            unknown_inbox(name)
        }
        // A table someone dropped by hand must not make the inbox impossible to unregister.
        let relid = relation_oid(name);
        if relid != pg_sys::InvalidOid {
            let table = qualified(name);
            let owner = client
                .select(
                    "SELECT pg_catalog.pg_has_role(relowner, 'USAGE') FROM pg_catalog.pg_class \
                     WHERE oid OPERATOR(pg_catalog.=) $1",
                    None,
                    &[relid.into()],
                )
                .and_then(|rows| rows.first().get_one::<bool>())
                .unwrap_or_else(|e| internal("checking the inbox owner", e));
            if owner != Some(true) {
                raise(
                    PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                    format!("only the owner of {table} can drop inbox \"{name}\""),
                    "Run dedup.drop_inbox() as the role that created the inbox, or as a superuser.",
                )
            }
            client
                .update(&format!("DROP TABLE {table}"), None, &[])
                .unwrap_or_else(|e| internal("dropping the inbox table", e));
        }
        client
            .update("DELETE FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1", None, &[name.into()])
            .unwrap_or_else(|e| internal("unregistering the inbox", e));
    });
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
