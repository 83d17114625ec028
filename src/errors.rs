//! One way to fail: every error a caller can cause is an `ERROR` whose message starts with `dedup:`, carries a
//! SQLSTATE a client can branch on, and a hint that says what to do about it.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

/// Raises a Postgres `ERROR` (never returns). The current transaction (or savepoint) aborts, so a failing call
/// leaves nothing behind.
pub fn raise(code: PgSqlErrorCode, message: impl Into<String>, hint: impl Into<String>) -> ! {
    ErrorReport::new(code, format!("dedup: {}", message.into()), "pg_dedup").set_hint(hint).report(PgLogLevel::ERROR);
    unreachable!("an ERROR report does not return")
}

/// For SPI failures that can only mean a bug or a damaged installation: still a clean ERROR, never a panic
/// message about `unwrap`.
pub fn internal(context: &str, err: impl std::fmt::Display) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("{context}: {err}"),
        "This is a bug in pg_dedup or a damaged installation; please report it with the statement that failed.",
    )
}

/// A LOG line for the server log (the workers' messages). pgrx's `log!` first asks `is_interesting()`, which on
/// PostgreSQL 13 compares levels numerically and so drops LOG under the default `log_min_messages = warning` (for
/// the server log, LOG ranks above WARNING); Postgres' own `errstart` decides correctly on every major.
macro_rules! server_log {
    ($($arg:tt)*) => {
        pgrx::pg_sys::panic::ErrorReport::new(
            pgrx::prelude::PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
            format!($($arg)*),
            "pg_dedup",
        )
        .report(pgrx::prelude::PgLogLevel::LOG)
    };
}
pub(crate) use server_log;
