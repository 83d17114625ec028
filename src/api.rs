//! The SQL surface, schema `dedup`. Each function validates its arguments, then hands over to the module that
//! does the work. None is STRICT: a NULL argument gets a clear error (or, for `ttl`, the inbox default), never a
//! silent NULL result. All run with the caller's privileges (no SECURITY DEFINER): access to an inbox is exactly
//! access to its table.

use crate::errors::raise;
use crate::inbox::{self, Access};
use crate::{claim, input, purge};
use pgrx::prelude::*;
use rustc_hash::FxHashSet as HashSet;

/// Writes need a read-write transaction on a primary; say so plainly instead of Postgres' generic error.
fn require_writable(function: &str) {
    // SAFETY: reads backend-local state; no preconditions.
    let (standby, read_only) = unsafe { (pg_sys::RecoveryInProgress(), pg_sys::XactReadOnly) };
    if standby {
        raise(
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            format!("{function}() cannot run on a hot standby"),
            "Marks are written on the primary; dedup.seen() works on a standby.",
        )
    }
    if read_only {
        raise(
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            format!("{function}() cannot run in a read-only transaction"),
            "Call it in a read-write transaction; dedup.seen() works in read-only ones.",
        )
    }
}

/// Records `id` in `inbox` for `ttl` (NULL: the inbox's default) inside the current transaction. True the first
/// time within the window, false for a duplicate. Waits for a concurrent transaction marking the same id.
#[pg_extern(volatile, parallel_unsafe)]
fn mark(id: Option<&str>, ttl: default!(Option<Interval>, "NULL"), inbox: default!(Option<&str>, "'default'")) -> bool {
    require_writable("mark");
    let id = input::id(id);
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    !claim::mark(&inbox, &[id.to_owned()], ttl).is_empty()
}

/// Marks every id in `ids`; returns the ids that were new, each once, in order of first occurrence (a repeat
/// inside the array is a duplicate of its first occurrence).
#[pg_extern(volatile, parallel_unsafe)]
fn mark_many(
    ids: Option<Array<'_, &str>>,
    ttl: default!(Option<Interval>, "NULL"),
    inbox: default!(Option<&str>, "'default'"),
) -> SetOfIterator<'static, String> {
    require_writable("mark_many");
    let ids = input::ids(ids);
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    let fresh = if ids.is_empty() { HashSet::default() } else { claim::mark(&inbox, &ids, ttl) };
    let mut reported = HashSet::default();
    let new_in_order: Vec<String> =
        ids.iter().filter(|id| fresh.contains(*id) && reported.insert(id.as_str())).cloned().collect();
    SetOfIterator::new(new_in_order)
}

/// Read-only: is a live (unexpired) mark for `id` visible to this transaction?
#[pg_extern(stable, parallel_restricted)]
fn seen(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Read);
    claim::seen(&inbox, id)
}

/// Deletes the mark for `id` (operator replay: the next delivery is processed again). True if a live mark was
/// removed.
#[pg_extern(volatile, parallel_unsafe)]
fn forget(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    require_writable("forget");
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Delete);
    claim::forget(&inbox, id)
}

/// Creates an inbox: an independent namespace of marks (one per consumer of the same events).
#[pg_extern(volatile, parallel_unsafe)]
fn create_inbox(name: Option<&str>, default_ttl: default!(Option<Interval>, "'3 days'")) {
    require_writable("create_inbox");
    let name = input::inbox_name(name);
    let Some(default_ttl) = default_ttl else {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "default_ttl must not be NULL",
            "Pass the redelivery window for this inbox, for example '3 days'.",
        )
    };
    inbox::create(name, input::ttl(default_ttl));
}

/// Drops an inbox and every mark in it.
#[pg_extern(volatile, parallel_unsafe)]
fn drop_inbox(name: Option<&str>) {
    require_writable("drop_inbox");
    inbox::drop(input::inbox_name(name));
}

/// Deletes expired marks now, in `inbox` or in every inbox (NULL), at most `max_rows` of them (NULL: all).
/// Returns how many were deleted. Works without the background worker, e.g. from cron or pg_cron.
#[pg_extern(volatile, parallel_unsafe)]
fn purge(inbox: default!(Option<&str>, "NULL"), max_rows: default!(Option<i64>, "NULL")) -> i64 {
    require_writable("purge");
    let max_rows = input::max_rows(max_rows);
    let names = match inbox {
        Some(name) => vec![input::inbox_name(Some(name)).to_owned()],
        None => inbox::all_names(),
    };
    let mut deleted = 0;
    for name in names {
        let remaining = max_rows.map(|m| m - deleted);
        let inbox = inbox::open(&name, Access::Delete);
        deleted += purge::purge_inbox(&inbox, remaining);
    }
    deleted
}
