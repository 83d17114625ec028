//! The clock every expiry is measured against: the start of the current statement, so every id in one call (and
//! the renewal check against a stored expiry) uses the same reading, and `now + ttl` in Postgres' own calendar
//! arithmetic.

use pgrx::prelude::*;

/// The instant a call measures expiry against: the start of the current statement.
pub fn statement_now() -> TimestampWithTimeZone {
    // SAFETY: reads a backend-local timestamp; no preconditions.
    let now = unsafe { pg_sys::GetCurrentStatementStartTimestamp() };
    TimestampWithTimeZone::try_from(now).expect("the statement start time is a valid timestamp")
}

/// `now + ttl` with Postgres' own calendar arithmetic (months and days follow the session time zone).
pub fn expiry(now: TimestampWithTimeZone, ttl: Interval) -> TimestampWithTimeZone {
    // SAFETY: timestamptz_pl_interval takes exactly these two non-NULL arguments.
    unsafe {
        pgrx::direct_function_call::<TimestampWithTimeZone>(
            pg_sys::timestamptz_pl_interval,
            &[now.into_datum(), ttl.into_datum()],
        )
    }
    .expect("timestamptz + interval is never NULL")
}
