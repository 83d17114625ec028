//! Validation of everything a caller passes in. Each rule raises a clear `dedup:` error *before* anything is
//! written, so a rejected call marks nothing.

use crate::errors::raise;
use pgrx::prelude::*;

/// Longest id accepted, in bytes. The UNIQUE btree index holds at most ~2.7 kB per entry on 8 kB pages; 2 KiB keeps
/// a wide margin so callers never meet Postgres' raw "index row size exceeds maximum" error.
pub const MAX_ID_BYTES: usize = 2048;

/// Longest inbox name: its table is called `inbox_<name>` and Postgres identifiers stop at 63 bytes.
pub const MAX_INBOX_NAME: usize = 48;

/// Longest TTL accepted. Marks are for redelivery windows (minutes to weeks); anything near this is a unit mistake.
const MAX_TTL_DAYS: i64 = 3660;

pub fn id(id: Option<&str>) -> &str {
    match id {
        None => raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "id must not be NULL",
            "Pass the message's stable unique id (for example the event id the producer assigned).",
        ),
        Some("") => raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            "id must not be empty",
            "Pass the message's stable unique id (for example the event id the producer assigned).",
        ),
        Some(s) if s.len() > MAX_ID_BYTES => raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("id is {} bytes long; the limit is {MAX_ID_BYTES} bytes", s.len()),
            "Use a shorter id, for example a hash of the message's natural key.",
        ),
        Some(s) => s,
    }
}

/// Validates an array of ids: the array itself and each element follow the same rules as a single id.
pub fn ids(ids: Option<Array<'_, &str>>) -> Vec<String> {
    let Some(ids) = ids else {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "ids must not be NULL",
            "Pass an array of message ids; an empty array marks nothing.",
        )
    };
    ids.iter()
        .enumerate()
        .map(|(i, element)| {
            if element.is_none() {
                raise(
                    PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
                    format!("ids[{}] is NULL", i + 1),
                    "Remove NULL elements from the array; every message needs an id.",
                )
            }
            id(element).to_owned()
        })
        .collect()
}

/// A time-to-live must be a positive, finite, sane interval. Mixed-sign intervals ('1 day -2 hours') are refused:
/// whether they are positive depends on the calendar, and no caller means them.
pub fn ttl(ttl: Interval) -> Interval {
    let (months, days, micros) = (ttl.months() as i64, ttl.days() as i64, ttl.micros());
    let hint = "Pass a positive interval such as '3 days' or '15 minutes', or NULL for the inbox's default.";
    if months < 0 || days < 0 || micros < 0 || (months == 0 && days == 0 && micros == 0) {
        raise(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, format!("ttl must be positive, got {ttl}"), hint)
    }
    let approx_days = months.saturating_mul(31).saturating_add(days).saturating_add(micros / 86_400_000_000);
    if approx_days > MAX_TTL_DAYS {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("ttl {ttl} is too long; the limit is {MAX_TTL_DAYS} days (about 10 years)"),
            hint,
        )
    }
    ttl
}

/// Inbox names become part of a table name, so they are plain lower-case identifiers: no quoting, no surprises.
pub fn inbox_name(name: Option<&str>) -> &str {
    let hint = "Inbox names are lower-case identifiers: a letter or _, then letters, digits or _ (at most 48).";
    let Some(name) = name else {
        raise(PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED, "inbox must not be NULL", hint)
    };
    let mut chars = name.chars();
    let valid_start = matches!(chars.next(), Some('a'..='z' | '_'));
    let valid_rest = chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'));
    if !valid_start || !valid_rest || name.len() > MAX_INBOX_NAME {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_NAME,
            format!("invalid inbox name {}", pgrx::spi::quote_literal(name)),
            hint,
        )
    }
    name
}

pub fn max_rows(max_rows: Option<i64>) -> Option<i64> {
    match max_rows {
        Some(n) if n < 0 => raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("max_rows must not be negative, got {n}"),
            "Pass NULL to purge every expired mark, or a positive row count to cap the work.",
        ),
        other => other,
    }
}
