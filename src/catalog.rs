//! Inbox tables as the catalogs show them, registered or not: what the filter's loads and the DDL watch look at
//! (they need no privilege on the registry).

use crate::errors::internal;
use pgrx::prelude::*;

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

/// Of `tables`, those Citus does not distribute.
pub fn local(tables: Vec<pg_sys::Oid>) -> Vec<pg_sys::Oid> {
    tables.into_iter().filter(|relid| !crate::citus::distributed(*relid)).collect()
}

/// The schema-qualified, quoted name of table `relid` of schema dedup (None if it is gone).
pub fn table_name_of(relid: pg_sys::Oid) -> Option<String> {
    // SAFETY: returns a palloc'd copy of the name, or NULL for a relation that is gone.
    let name = unsafe { pg_sys::get_rel_name(relid) };
    // SAFETY: a NUL-terminated name, checked for NULL first.
    (!name.is_null())
        .then(|| unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned())
        .map(|name| pgrx::spi::quote_qualified_identifier("dedup", &name))
}
