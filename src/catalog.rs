//! What the catalogs say, read without a lock and without privileges: any relation's pg_class row, and the inbox
//! tables, registered or not (what the filter's loads and the DDL watch look at).

use crate::errors::internal;
use crate::ports;
use pgrx::prelude::*;

/// A relation as its pg_class row shows it.
pub struct Class {
    pub kind: u8,
    pub namespace: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    pub persistence: u8,
}

/// The pg_class row of `relid`, read from the syscache without locking the relation (None: there is none). What it
/// says can change until the relation is locked; callers that decide from it before locking decide again after.
pub fn class(relid: pg_sys::Oid) -> Option<Class> {
    // SAFETY: a syscache lookup by oid; the tuple is only read from, then released.
    unsafe {
        let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::RELOID as i32, relid.into_datum()?);
        if tuple.is_null() {
            return None;
        }
        let form = &*ports::GETSTRUCT::<pg_sys::FormData_pg_class>(tuple);
        let class = Class {
            kind: form.relkind as u8,
            namespace: form.relnamespace,
            owner: form.relowner,
            persistence: form.relpersistence as u8,
        };
        pg_sys::ReleaseSysCache(tuple);
        Some(class)
    }
}

/// The oid of schema dedup (a clean ERROR if it is gone).
pub fn dedup_namespace() -> pg_sys::Oid {
    // SAFETY: a catalog lookup by a NUL-terminated name; missing_ok = false raises a clean ERROR.
    unsafe { pg_sys::get_namespace_oid(c"dedup".as_ptr(), false) }
}

/// A relation of schema dedup by name: InvalidOid when there is none, or no schema dedup (DROP EXTENSION is under
/// way).
pub fn dedup_relation(name: &std::ffi::CStr) -> pg_sys::Oid {
    // SAFETY: catalog lookups by NUL-terminated names; missing_ok = true gives InvalidOid for a missing schema.
    unsafe {
        let schema = pg_sys::get_namespace_oid(c"dedup".as_ptr(), true);
        if schema == pg_sys::InvalidOid {
            return pg_sys::InvalidOid;
        }
        pg_sys::get_relname_relid(name.as_ptr(), schema)
    }
}

/// Every inbox table of this database (schema dedup, of type dedup.inbox_row), registered or not, distributed or
/// not, from the catalogs as this transaction sees them: no privilege on the registry is needed.
pub fn inbox_tables() -> Vec<pg_sys::Oid> {
    Spi::connect(|client| {
        client
            .select(
                "SELECT c.oid FROM pg_catalog.pg_class c \
                 WHERE c.relnamespace OPERATOR(pg_catalog.=) 'dedup'::pg_catalog.regnamespace \
                   AND c.reloftype OPERATOR(pg_catalog.=) 'dedup.inbox_row'::pg_catalog.regtype \
                   AND c.relkind OPERATOR(pg_catalog.=) 'r'",
                None,
                &[],
            )
            .unwrap_or_else(|e| internal("listing inbox tables", e))
            .filter_map(|row| row.get::<pg_sys::Oid>(1).ok().flatten())
            .collect()
    })
}

/// The inbox tables whose rows are here: those Citus distributes are left out (their rows are on other nodes, so
/// the filter neither loads nor guards them).
pub fn tables() -> Vec<pg_sys::Oid> {
    local(inbox_tables())
}

/// `dedup.attempt_counts` (InvalidOid while it is missing).
pub fn attempt_counts() -> pg_sys::Oid {
    dedup_relation(c"attempt_counts")
}

/// The tables whose rows the filter holds: `tables()`, and `dedup.attempt_counts` (`with_attempt_counts`).
pub fn filtered_tables() -> Vec<pg_sys::Oid> {
    with_attempt_counts(tables())
}

/// `tables` and `dedup.attempt_counts`, which the filter guards like an inbox table (keyed by inbox and id,
/// `trigger::Key`), so that `attempt()` of an id it certainly lacks skips reading it.
pub fn with_attempt_counts(mut tables: Vec<pg_sys::Oid>) -> Vec<pg_sys::Oid> {
    let counts = attempt_counts();
    if counts != pg_sys::InvalidOid {
        tables.push(counts);
    }
    tables
}

/// Of `tables`, those Citus does not distribute.
pub fn local(tables: Vec<pg_sys::Oid>) -> Vec<pg_sys::Oid> {
    tables.into_iter().filter(|relid| !crate::citus::distributed(*relid)).collect()
}

/// The schema-qualified, quoted name of relation `relid` (None if it is gone).
pub fn qualified_name(relid: pg_sys::Oid) -> Option<String> {
    // SAFETY: catalog lookups by oid; each returns a palloc'd copy or NULL when the relation is gone.
    unsafe {
        let name = pg_sys::get_rel_name(relid);
        let schema = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(relid));
        (!name.is_null() && !schema.is_null()).then(|| {
            pgrx::spi::quote_qualified_identifier(
                std::ffi::CStr::from_ptr(schema).to_string_lossy(),
                std::ffi::CStr::from_ptr(name).to_string_lossy(),
            )
        })
    }
}

/// The name of the database this backend is connected to.
pub fn current_database() -> String {
    // SAFETY: MyDatabaseId is set once the backend is connected; the name is a palloc'd copy.
    unsafe { std::ffi::CStr::from_ptr(pg_sys::get_database_name(pg_sys::MyDatabaseId)) }.to_string_lossy().into_owned()
}

/// The name of the inbox whose table is `relid` (`dedup.inbox_<name>`), None if there is no such table.
pub fn inbox_name_of(relid: pg_sys::Oid) -> Option<String> {
    let class = class(relid)?;
    // SAFETY: a catalog lookup by oid; a palloc'd copy of the name, or NULL.
    let name = unsafe { pg_sys::get_rel_name(relid) };
    if name.is_null() || class.namespace != dedup_namespace() {
        return None;
    }
    // SAFETY: a NUL-terminated name, checked for NULL above.
    let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
    name.strip_prefix("inbox_").map(str::to_owned)
}

/// May the current user SELECT from existing relation `relid` (table privileges; column ones do not count)?
pub fn caller_may_select(relid: pg_sys::Oid) -> bool {
    // SAFETY: an ACL check of an existing relation (the caller's promise) for the current user.
    unsafe {
        pg_sys::pg_class_aclcheck(relid, pg_sys::GetUserId(), pg_sys::ACL_SELECT as pg_sys::AclMode)
            == pg_sys::AclResult::ACLCHECK_OK
    }
}

/// Does relation `relid` exist (as the catalog snapshot sees it; the caller holds a lock on it, or accepts that it
/// may go right after)?
pub fn relation_exists(relid: pg_sys::Oid) -> bool {
    // SAFETY: a syscache lookup by oid.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            relid.into_datum().expect("an oid is a datum"),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn catalog_a_class_row_is_read_by_oid() {
        run("CREATE ROLE catalog_owner; CREATE TABLE catalog_t (x int); ALTER TABLE catalog_t OWNER TO catalog_owner");
        let relid = one::<pg_sys::Oid>("SELECT 'catalog_t'::regclass::oid");
        let class = super::class(relid).expect("the table exists");
        assert_eq!(class.owner, one::<pg_sys::Oid>("SELECT 'catalog_owner'::regrole::oid"));
        assert_eq!(class.kind, pg_sys::RELKIND_RELATION);
        assert_eq!(class.namespace, one::<pg_sys::Oid>("SELECT 'public'::regnamespace::oid"));
        assert_eq!(class.persistence, pg_sys::RELPERSISTENCE_PERMANENT);
        assert!(super::class(pg_sys::Oid::from(4_294_967_000)).is_none());
    }
}
