//! Validation of everything a caller passes in. Each rule raises a clear `dedup:` error *before* anything is
//! written, so a rejected call marks nothing.

use crate::errors::raise;
use pgrx::prelude::*;

/// Writes need a read-write transaction on a primary; say so plainly instead of Postgres' generic error.
pub fn require_writable(function: &str) {
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

/// Longest id accepted, in bytes. The UNIQUE btree index holds at most ~2.7 kB per entry on 8 kB pages; 2 KiB keeps
/// a wide margin so callers never meet Postgres' raw "index row size exceeds maximum" error.
pub const MAX_ID_BYTES: usize = 2048;

/// Longest inbox name: its table is called `inbox_<name>` and Postgres identifiers stop at 63 bytes.
pub const MAX_INBOX_NAME: usize = 48;

/// Longest TTL accepted. Marks are for redelivery windows (minutes to weeks); anything near this is a unit mistake.
const MAX_TTL_DAYS: i64 = 3660;

pub fn id(id: Option<&str>) -> &str {
    key_like("id", id, "Pass the message's stable unique id (for example the event id the producer assigned).")
}

/// A key of `advance()` / `position()`: the same rules as an id.
pub fn key(key: Option<&str>) -> &str {
    key_like("key", key, "Pass the stream's key (for example the aggregate's id) whose position the event carries.")
}

/// The key an attached table's key expression gave for a row (None: NULL): the same rules as an id.
pub fn key_of_row<'a>(key: Option<&'a str>, table: &str) -> &'a str {
    // Every row of a COPY comes here: the message is built only for a key that fails.
    if let Some(valid) = key.filter(|k| !k.is_empty() && k.len() <= MAX_ID_BYTES) {
        return valid;
    }
    key_like(
        &format!("the key of a row inserted into {table}"),
        key,
        "Every row needs a key: fix the row, or the table's key expression (dedup.attachments) with dedup.attach().",
    )
}

/// An id or key: not NULL, not empty, at most `MAX_ID_BYTES`.
fn key_like<'a>(what: &str, value: Option<&'a str>, hint: &str) -> &'a str {
    match value {
        None => raise(PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED, format!("{what} must not be NULL"), hint),
        Some("") => raise(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, format!("{what} must not be empty"), hint),
        Some(s) if s.len() > MAX_ID_BYTES => raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("{what} is {} bytes long; the limit is {MAX_ID_BYTES} bytes", s.len()),
            "Use a shorter one, for example a hash of the message's natural key.",
        ),
        Some(s) => s,
    }
}

/// An array of ids must not be NULL.
pub fn id_array<'a>(ids: Option<Array<'a, &'a str>>) -> Array<'a, &'a str> {
    ids.unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "ids must not be NULL",
            "Pass an array of message ids; an empty array marks nothing.",
        )
    })
}

/// Validates the elements of an array of ids: each follows the same rules as a single id. They are borrowed from
/// the array, not copied.
pub fn ids<'arr>(ids: &'arr Array<'_, &str>) -> Vec<&'arr str> {
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
            id(element)
        })
        .collect()
}

/// A time-to-live must be a positive, finite, sane interval. Mixed-sign intervals ('1 day -2 hours') are refused:
/// whether they are positive depends on the calendar (a day is 23 or 25 hours across a daylight-saving change, a
/// month 28 to 31 days), and one positive unit says the same without doubt ('22 hours').
pub fn ttl(ttl: Interval) -> Interval {
    positive_interval(
        "ttl",
        ttl,
        "Pass a positive interval such as '3 days' or '15 minutes', or NULL for the inbox's default.",
    )
}

/// A lease, like a ttl, is a positive, sane interval.
pub fn lease(lease: Interval) -> Interval {
    positive_interval(
        "lease",
        lease,
        "Pass a positive interval such as '30 seconds', as long as the work outside the database may take.",
    )
}

/// The longest `value` can last, in microseconds: a month counted as 31 days, a day as 24 hours (exact: no part is
/// rounded away, so '3660 days 00:00:00.000001' is longer than '3660 days').
fn longest_micros(value: &Interval) -> i128 {
    const DAY: i128 = 86_400_000_000;
    (value.months() as i128 * 31 + value.days() as i128) * DAY + value.micros() as i128
}

fn positive_interval(name: &str, value: Interval, hint: &str) -> Interval {
    let parts = [value.months() as i64, value.days() as i64, value.micros()];
    if parts.iter().any(|p| *p < 0) && parts.iter().any(|p| *p > 0) {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("{name} {value} mixes positive and negative parts"),
            format!(
                "Whether such an interval is positive depends on the calendar; write it as one positive interval \
                 (e.g. '22 hours' for '1 day -2 hours'). {hint}"
            ),
        )
    }
    if parts.iter().all(|p| *p <= 0) {
        raise(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, format!("{name} must be positive, got {value}"), hint)
    }
    if longest_micros(&value) > MAX_TTL_DAYS as i128 * 86_400_000_000 {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "{name} {value} is too long; the limit is {MAX_TTL_DAYS} days (about 10 years, a month counted as 31 \
                 days)"
            ),
            hint,
        )
    }
    value
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

/// Ids are text in the database's encoding, and pg_dedup handles them as UTF-8 (its Rust code, and the hashes the
/// filter keeps). Inboxes are refused elsewhere, and since `CREATE EXTENSION` creates the default inbox, so is the
/// extension: a clear error instead of failing on the first non-ASCII id.
pub fn require_utf8_database() {
    // SAFETY: reads the database encoding, fixed for the life of the database.
    let encoding = unsafe { pg_sys::GetDatabaseEncoding() };
    if encoding != pg_sys::pg_enc::PG_UTF8 as i32 {
        // SAFETY: the name of a valid encoding id, a static string.
        let name = unsafe { std::ffi::CStr::from_ptr(pg_sys::GetDatabaseEncodingName()) }.to_string_lossy();
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!("pg_dedup needs a UTF8 database; this one is {name}"),
            "Create the database with ENCODING 'UTF8' (clients may use any client_encoding).",
        )
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;
    use PgSqlErrorCode::*;

    #[pg_test]
    fn input_an_id_must_be_present_and_not_empty() {
        assert_dedup_error("SELECT dedup.mark(NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT dedup.mark('')", ERRCODE_INVALID_PARAMETER_VALUE);
        assert_dedup_error("SELECT dedup.seen(NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT dedup.forget('')", ERRCODE_INVALID_PARAMETER_VALUE);
    }

    #[pg_test]
    fn input_ids_are_at_most_2048_bytes() {
        assert!(one::<bool>("SELECT dedup.mark(repeat('x', 2048))"), "2048 bytes is allowed");
        assert_dedup_error("SELECT dedup.mark(repeat('x', 2049))", ERRCODE_PROGRAM_LIMIT_EXCEEDED);
        // Bytes, not characters: 683 three-byte characters are 2049 bytes.
        assert_dedup_error("SELECT dedup.mark(repeat('€', 683))", ERRCODE_PROGRAM_LIMIT_EXCEEDED);
        let (_, message) = error_of("SELECT dedup.mark(repeat('x', 3000))");
        assert!(message.contains("3000 bytes"), "{message}");
    }

    #[pg_test]
    fn input_an_array_of_ids_and_each_element_are_checked() {
        assert_dedup_error("SELECT * FROM dedup.mark_many(NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT * FROM dedup.mark_many(ARRAY['a', NULL])", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        let (_, message) = error_of("SELECT * FROM dedup.mark_many(ARRAY['a', 'b', NULL])");
        assert!(message.contains("ids[3]"), "the element is named: {message}");
        assert_dedup_error("SELECT * FROM dedup.mark_many(ARRAY['a', ''])", ERRCODE_INVALID_PARAMETER_VALUE);
        assert_eq!(count("dedup.inbox_default WHERE id = 'a'"), 0, "a rejected call marks nothing");
    }

    #[pg_test]
    fn input_a_ttl_must_be_positive_and_sane() {
        for ttl in ["'0 seconds'", "'-1 hour'", "'-1 day -2 hours'", "'3661 days'", "'119 months 1 day'"] {
            assert_dedup_error(&format!("SELECT dedup.mark('t', {ttl})"), ERRCODE_INVALID_PARAMETER_VALUE);
        }
        assert!(one::<bool>("SELECT dedup.mark('t', '3660 days')"), "the limit itself is allowed");
        assert!(one::<bool>("SELECT dedup.mark('t2', '3659 days 24:00:00')"), "the limit, spelt in hours");
        assert!(one::<bool>("SELECT dedup.mark('t3', '118 months 2 days')"), "118 x 31 + 2 = 3660 days");
        assert_dedup_error("SELECT dedup.create_inbox('bad_ttl', '-1 day')", ERRCODE_INVALID_PARAMETER_VALUE);
    }

    #[pg_test]
    fn input_the_ttl_and_lease_limit_is_exact_for_every_function() {
        // Past the limit by less than a day, an hour, a microsecond: each was let through when the check rounded
        // microseconds down to whole days.
        for over in
            ["'3660 days 23:00:00'", "'3660 days 23:59:59'", "'3660 days 00:00:00.000001'", "'3659 days 24:00:01'"]
        {
            for sql in [
                format!("SELECT dedup.mark('x', {over})"),
                format!("SELECT * FROM dedup.mark_many(ARRAY['x'], {over})"),
                format!("SELECT dedup.advance('x', 1, 'default', {over})"),
                format!("SELECT * FROM dedup.claim('x', ttl => {over})"),
                format!("SELECT * FROM dedup.claim('x', lease => {over})"),
                format!("SELECT dedup.create_inbox('too_long', {over})"),
                format!("CREATE TABLE lim_{n} (k text); SELECT dedup.attach('lim_{n}', 'k', {over})", n = over.len()),
            ] {
                assert_dedup_error(&sql, ERRCODE_INVALID_PARAMETER_VALUE);
            }
        }
    }

    #[pg_test]
    fn input_a_mixed_sign_interval_is_refused_saying_so() {
        for ttl in ["'1 day -2 hours'", "'1 month -1 day'", "'-1 day 25:00:00'"] {
            assert_dedup_error(&format!("SELECT dedup.mark('t', {ttl})"), ERRCODE_INVALID_PARAMETER_VALUE);
            let (_, message) = error_of(&format!("SELECT dedup.mark('t', {ttl})"));
            assert!(message.contains("mixes positive and negative parts"), "{message}");
        }
        let (_, message) = error_of("SELECT dedup.mark('t', '-1 hour')");
        assert!(message.contains("must be positive"), "{message}");
    }

    #[pg_test]
    fn input_inbox_names_are_lower_case_identifiers() {
        for name in ["'Upper'", "'1starts_with_digit'", "'has-dash'", "'has space'", "''", "repeat('a', 49)"] {
            assert_dedup_error(&format!("SELECT dedup.create_inbox({name})"), ERRCODE_INVALID_NAME);
        }
        assert_dedup_error("SELECT dedup.mark('x', NULL, 'Robert''); DROP TABLE x; --')", ERRCODE_INVALID_NAME);
        assert_dedup_error("SELECT dedup.mark('x', NULL, NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        run("SELECT dedup.create_inbox('_ok_9'); SELECT dedup.create_inbox(repeat('a', 48))");
    }

    #[pg_test]
    fn input_max_rows_must_not_be_negative() {
        assert_dedup_error("SELECT dedup.purge(NULL, -1)", ERRCODE_INVALID_PARAMETER_VALUE);
        assert_eq!(one::<i64>("SELECT dedup.purge(NULL, 0)"), 0);
    }

    #[pg_test]
    fn input_a_utf8_database_is_accepted() {
        assert_eq!(one::<String>("SELECT pg_catalog.getdatabaseencoding()::text"), "UTF8");
        super::require_utf8_database();
        assert!(one::<bool>("SELECT dedup.mark('café-ünïcode-✓')"));
        assert!(one::<bool>("SELECT dedup.seen('café-ünïcode-✓')"));
    }
}

/// Longest fingerprint accepted, in bytes (`dedup.fingerprint()` gives 64).
pub const MAX_FINGERPRINT_BYTES: usize = 1024;

/// A fingerprint is optional (NULL: not checked), but not empty and not longer than `MAX_FINGERPRINT_BYTES`.
pub fn fingerprint(fingerprint: Option<&str>) -> Option<&str> {
    let hint = "Pass dedup.fingerprint(<request payload>), any text of at most 1024 bytes, or NULL not to check.";
    match fingerprint {
        Some("") => raise(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, "fingerprint must not be empty", hint),
        Some(f) if f.len() > MAX_FINGERPRINT_BYTES => raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("fingerprint is {} bytes long; the limit is {MAX_FINGERPRINT_BYTES} bytes", f.len()),
            hint,
        ),
        other => other,
    }
}

/// A flag that must not be NULL.
pub fn flag(name: &str, value: Option<bool>) -> bool {
    value.unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            format!("{name} must not be NULL"),
            format!("Pass true or false, or leave {name} out for its default."),
        )
    })
}
