//! Running code with another role's rights, bracketed the way PostgreSQL brackets it:
//! - `as_table_owner`: the background worker (a superuser) purges an inbox as its table's owner, inside a
//!   security-restricted operation, the way VACUUM does: a trigger or rule on the table never runs with more
//!   rights than its owner's, and whatever settings it changes (`set_config('search_path', ..., false)` included)
//!   are rolled back when the section ends.
//! - `as_extension_owner`: `create_inbox()` and `drop_inbox()` write schema `dedup` and its registry, which only the
//!   extension's owner may; they check their caller themselves, then act as that owner the way a SECURITY DEFINER
//!   function with `SET search_path = pg_catalog, pg_temp` does.
//!
//! Inside both, `search_path` is `pg_catalog, pg_temp`; every statement is schema-qualified anyway.

use crate::errors::{internal, raise};
use crate::{catalog, guc};
use pgrx::prelude::*;

const SAFE_SEARCH_PATH: &std::ffi::CStr = c"pg_catalog, pg_temp";

/// Runs `f` as role `role` with `extra` security-context flags, restoring the caller's role afterwards (an ERROR
/// aborts the (sub)transaction, which restores it too), with every setting `f` changes rolled back.
fn as_role<R>(role: pg_sys::Oid, extra: u32, f: impl FnOnce() -> R) -> R {
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    // SAFETY: reads the backend's current user and security context.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    guc::with_setting(c"search_path", SAFE_SEARCH_PATH, || {
        // SAFETY: switches the current user; put back below.
        unsafe { pg_sys::SetUserIdAndSecContext(role, context | extra as i32) };
        let result = f();
        // SAFETY: as above.
        unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
        result
    })
}

/// Runs `f` with the rights of the owner of table `relid`, as a security-restricted operation.
pub fn as_table_owner<R>(relid: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    let owner = catalog::class(relid)
        .map(|c| c.owner)
        .unwrap_or_else(|| internal("finding an inbox table's owner", "no such table"));
    as_role(owner, pg_sys::SECURITY_RESTRICTED_OPERATION, f)
}

/// The extension's owner: the role that ran CREATE EXTENSION, owner of schema dedup and of the registry.
pub fn extension_owner() -> pg_sys::Oid {
    let relid = catalog::dedup_relation(c"inbox_registry");
    catalog::class(relid).map(|c| c.owner).unwrap_or_else(|| internal("finding the extension's owner", "no registry"))
}

/// Runs `f` as the extension's owner, for a caller who may (EXECUTE on the calling function is the grant; the
/// caller's own rights are checked by the function before). Refused inside a security-restricted operation (a
/// maintenance command or the worker's purge running someone's trigger), as PostgreSQL refuses other changes there.
pub fn as_extension_owner<R>(function: &str, f: impl FnOnce() -> R) -> R {
    // SAFETY: reads the backend's security context.
    if unsafe { pg_sys::InSecurityRestrictedOperation() } {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!("{function}() cannot run inside a security-restricted operation"),
            "Call it directly, not from code that a maintenance command (VACUUM, REFRESH MATERIALIZED VIEW, CREATE \
             INDEX) or pg_dedup's purge runs as a table's owner.",
        )
    }
    as_role(extension_owner(), pg_sys::SECURITY_LOCAL_USERID_CHANGE, f)
}

/// The role calling us right now (before any switch).
pub fn caller() -> pg_sys::Oid {
    // SAFETY: reads the backend's current user.
    unsafe { pg_sys::GetUserId() }
}

/// The name of role `role`, quoted for SQL.
pub fn role_name(role: pg_sys::Oid) -> String {
    // SAFETY: raises a clean ERROR for a role that does not exist (noerr = false).
    let name = unsafe { std::ffi::CStr::from_ptr(pg_sys::GetUserNameFromId(role, false)) };
    pgrx::spi::quote_identifier(name.to_string_lossy())
}

/// Has `role` the privileges of role `of` (is it a member of it, or a superuser)?
pub fn acts_for(role: pg_sys::Oid, of: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup of two roles by oid.
    unsafe { pg_sys::has_privs_of_role(role, of) }
}

/// Is `role` a superuser?
pub fn is_superuser(role: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup of a role by oid.
    unsafe { pg_sys::superuser_arg(role) }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::*;
    use crate::testing::*;

    #[pg_test]
    fn rights_a_table_owner_section_runs_as_the_owner_and_restores_everything() {
        run("CREATE ROLE rights_owner; CREATE TABLE rights_t (x int); ALTER TABLE rights_t OWNER TO rights_owner");
        let relid = one::<pg_sys::Oid>("SELECT 'rights_t'::regclass::oid");
        let path_before = one::<String>("SHOW search_path");
        let (user, path, restricted) = as_table_owner(relid, || {
            // What an owner's trigger would try: a session-wide search_path.
            run("SELECT set_config('search_path', 'public, pg_catalog', false)");
            (
                one::<String>("SELECT current_user::text"),
                one::<String>("SHOW search_path"),
                // SAFETY: reads the backend's security context.
                unsafe { pg_sys::InSecurityRestrictedOperation() },
            )
        });
        assert_eq!(user, "rights_owner");
        assert_eq!(path, "public, pg_catalog", "the owner's code may set what it likes inside");
        assert!(restricted, "inside a security-restricted operation");
        assert_eq!(one::<String>("SELECT current_user::text"), "postgres");
        assert_eq!(one::<String>("SHOW search_path"), path_before, "the owner's setting did not outlive the section");
    }

    #[pg_test]
    fn rights_the_extensions_owner_is_the_registrys() {
        let owner = extension_owner();
        assert_eq!(
            role_name(owner),
            one::<String>("SELECT quote_ident(extowner::regrole::text) FROM pg_extension WHERE extname = 'pg_dedup'")
        );
        assert!(is_superuser(owner));
        let (user, path) = as_extension_owner("test", || {
            (one::<String>("SELECT current_user::text"), one::<String>("SHOW search_path"))
        });
        assert_eq!(user, one::<String>("SELECT extowner::regrole::text FROM pg_extension WHERE extname = 'pg_dedup'"));
        assert_eq!(path, "pg_catalog, pg_temp");
    }

    #[pg_test]
    fn rights_acting_as_the_extensions_owner_is_refused_in_a_restricted_operation() {
        run("CREATE ROLE rights_restricted; CREATE TABLE rights_r (x int); ALTER TABLE rights_r OWNER TO rights_restricted");
        let relid = one::<pg_sys::Oid>("SELECT 'rights_r'::regclass::oid");
        let refused = as_table_owner(relid, || crate::xact::subtransaction(|| as_extension_owner("test", || ())));
        let error = refused.expect_err("refused");
        assert_eq!(crate::xact::code_of(&error), PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
    }
}
