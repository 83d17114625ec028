//! One way to fail: every error a caller can cause is an `ERROR` whose message starts with `dedup:`, carries a
//! SQLSTATE a client can branch on, and a hint that says what to do about it.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use std::cell::{Cell, UnsafeCell};

/// Raises a Postgres `ERROR` (never returns). The current transaction (or savepoint) aborts, so a failing call
/// leaves nothing behind.
pub fn raise(code: PgSqlErrorCode, message: impl Into<String>, hint: impl Into<String>) -> ! {
    ErrorReport::new(code, format!("dedup: {}", message.into()), "pg_dedup").set_hint(hint).report(PgLogLevel::ERROR);
    unreachable!("an ERROR report does not return")
}

/// Sends the client a `dedup:` NOTICE (with a hint when there is one): something it should know that is not an
/// error.
pub fn notice(message: impl Into<String>, hint: Option<String>) {
    let report = ErrorReport::new(
        PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
        format!("dedup: {}", message.into()),
        "pg_dedup",
    );
    match hint {
        Some(hint) => report.set_hint(hint),
        None => report,
    }
    .report(PgLogLevel::NOTICE);
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

/// SQLSTATEs of pg_dedup's own, class PD (implementation-defined classes start with a letter from I to Z, and
/// PostgreSQL uses none starting with PD): documented in docs/reference.md.
pub mod sqlstate {
    /// claim(): the key was claimed before with another fingerprint.
    pub const FINGERPRINT_MISMATCH: &[u8; 5] = b"PD001";
}

/// The SQLSTATE an error raised with `raise_with_sqlstate` leaves with, until PostgreSQL finishes reporting it.
struct Pending {
    code: i32,
    carrier: i32,
}

thread_local! {
    static PENDING: Cell<Option<Pending>> = const { Cell::new(None) };
    /// The error context callback that puts the pending SQLSTATE in place; linked into `error_context_stack` only
    /// by `raise_with_sqlstate`, and unlinked by whoever catches the error (PostgreSQL's error recovery, or a
    /// subtransaction's catch, which restores the stack it started with).
    static OVERRIDE: UnsafeCell<pg_sys::ErrorContextCallback> = UnsafeCell::new(pg_sys::ErrorContextCallback {
        previous: std::ptr::null_mut(),
        callback: Some(put_pending_sqlstate),
        arg: std::ptr::null_mut(),
    });
}

/// The SQLSTATE pgrx carries our error with on its way out (pgrx knows only PostgreSQL's own codes): one
/// pg_dedup raises nowhere else, so the callback cannot mistake another error for ours.
const CARRIER: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_DATA_EXCEPTION;

/// `MAKE_SQLSTATE`: five characters, six bits each.
fn make_sqlstate(code: &[u8; 5]) -> i32 {
    code.iter().enumerate().fold(0, |acc, (i, c)| acc + (((*c as i32 - b'0' as i32) & 0x3F) << (6 * i)))
}

/// Raises a `dedup:` ERROR with a SQLSTATE of pg_dedup's own (never returns). pgrx reports errors only with
/// PostgreSQL's own codes, so the error leaves with a carrier code and an error context callback, which
/// PostgreSQL runs while it finishes the report, puts `code` in its place. Call it only where nothing between here
/// and the SQL function's boundary catches errors.
pub fn raise_with_sqlstate(
    code: &[u8; 5],
    message: impl Into<String>,
    detail: impl Into<String>,
    hint: impl Into<String>,
) -> ! {
    PENDING.set(Some(Pending { code: make_sqlstate(code), carrier: CARRIER as i32 }));
    OVERRIDE.with(|callback| {
        let callback = callback.get();
        // SAFETY: a thread-local with a stable address, linked at most once (we look for it first), and unlinked
        // by whoever catches the error, who restores the stack as it was before.
        unsafe {
            let mut entry = pg_sys::error_context_stack;
            while !entry.is_null() && entry != callback {
                entry = (*entry).previous;
            }
            if entry.is_null() {
                (*callback).previous = pg_sys::error_context_stack;
                pg_sys::error_context_stack = callback;
            }
        }
    });
    ErrorReport::new(CARRIER, format!("dedup: {}", message.into()), "pg_dedup")
        .set_detail(detail)
        .set_hint(hint)
        .report(PgLogLevel::ERROR);
    unreachable!("an ERROR report does not return")
}

/// The error context callback: while PostgreSQL finishes reporting our error, sets its pending SQLSTATE.
///
/// # Safety
/// Called by PostgreSQL only, from `errfinish`.
#[pg_guard]
unsafe extern "C-unwind" fn put_pending_sqlstate(_arg: *mut std::ffi::c_void) {
    extern "C-unwind" {
        /// elog.c's `errcode()`, which pgrx's bindings leave out: sets the SQLSTATE of the error being reported.
        fn errcode(sqlerrcode: std::ffi::c_int) -> std::ffi::c_int;
    }
    if let Some(pending) = PENDING.take() {
        // SAFETY: we are inside errfinish: the error being reported is the one these functions act on.
        unsafe {
            if pg_sys::geterrcode() == pending.carrier {
                errcode(pending.code);
            }
        }
    }
}
