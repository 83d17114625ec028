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

/// Microseconds in a day.
const USECS_PER_DAY: i64 = 86_400_000_000;
/// timestamptz's finite range, PostgreSQL's MIN_TIMESTAMP (inclusive) to END_TIMESTAMP (exclusive): a sum whose
/// steps leave it is left to Postgres, which raises its own "out of range" error.
const FINITE: std::ops::Range<i64> = -211_813_488_000_000_000..9_223_371_331_200_000_000;

/// `now + ttl` with Postgres' own calendar arithmetic (months and days follow the session time zone).
pub fn expiry(now: TimestampWithTimeZone, ttl: Interval) -> TimestampWithTimeZone {
    // In a time zone without daylight-saving changes (UTC, the usual server zone, or any fixed offset) a day is
    // always 24 hours, so a TTL of days and time is a plain sum. `timestamptz_pl_interval` breaks the timestamp
    // into calendar fields and back even then: over a thousand instructions, which every new mark and claim of a
    // transaction paid (callgrind). Months always go through the calendar.
    // Postgres adds the days, checks the range, then adds the time and checks again: so does the sum (and an
    // infinite `now`, which Postgres returns as it is, goes to Postgres).
    let start = pg_sys::TimestampTz::from(now);
    if ttl.months() == 0 && FINITE.contains(&start) {
        let mut offset: std::ffi::c_long = 0;
        // SAFETY: the session's time zone is set once the backend runs SQL; the call only reads it.
        if unsafe { pg_sys::pg_get_timezone_offset(pg_sys::session_timezone, &mut offset) } {
            let sum = (ttl.days() as i64)
                .checked_mul(USECS_PER_DAY)
                .and_then(|days| start.checked_add(days))
                .filter(|day| FINITE.contains(day))
                .and_then(|day| day.checked_add(ttl.micros()))
                .filter(|end| FINITE.contains(end));
            if let Some(end) = sum.and_then(|end| TimestampWithTimeZone::try_from(end).ok()) {
                return end;
            }
        }
    }
    // SAFETY: timestamptz_pl_interval takes exactly these two non-NULL arguments.
    unsafe {
        pgrx::direct_function_call::<TimestampWithTimeZone>(
            pg_sys::timestamptz_pl_interval,
            &[now.into_datum(), ttl.into_datum()],
        )
    }
    .expect("timestamptz + interval is never NULL")
}

/// `expiry(statement_now(), ttl)`, worked out once per statement, TTL and session time zone rather than once per
/// call: the calendar arithmetic is a tenth of a new id's work for an attached table's row trigger (callgrind).
pub fn statement_expiry(ttl: Interval) -> TimestampWithTimeZone {
    /// The statement's start, the TTL's fields (an interval's `=` would take `'1 mon'` for `'30 days'`), the time
    /// zone, and the end of window worked out for them.
    type Last = Option<(pg_sys::TimestampTz, (i32, i32, i64), usize, TimestampWithTimeZone)>;
    thread_local! {
        static LAST: std::cell::Cell<Last> = const { std::cell::Cell::new(None) };
    }
    let now = statement_now();
    let fields = (ttl.months(), ttl.days(), ttl.micros());
    // SAFETY: reads the session's time zone pointer (a SET TIME ZONE swaps it), compared and never dereferenced.
    let zone = unsafe { pg_sys::session_timezone } as usize;
    let key = (pg_sys::TimestampTz::from(now), fields, zone);
    if let Some((at, last_fields, last_zone, ends)) = LAST.get() {
        if (at, last_fields, last_zone) == key {
            return ends;
        }
    }
    let ends = expiry(now, ttl);
    LAST.set(Some((key.0, key.1, key.2, ends)));
    ends
}

/// Is `a` later than `b`? A timestamptz is an i64 of microseconds (its infinities at the ends of the range), and
/// Postgres's own `timestamp_cmp` compares exactly that; pgrx's `Ord` calls it through fmgr, about 500
/// instructions a comparison: a duplicate `mark()` does one, a `claim()` several.
pub fn later(a: TimestampWithTimeZone, b: TimestampWithTimeZone) -> bool {
    pg_sys::TimestampTz::from(a) > pg_sys::TimestampTz::from(b)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn clock_later_orders_as_postgres_does() {
        let at = |sql: &str| one::<TimestampWithTimeZone>(&format!("SELECT {sql}::timestamptz"));
        let points =
            ["'-infinity'", "'1999-12-31 23:59:59.999999+00'", "'2000-01-01 00:00:00+00'", "now()", "'infinity'"];
        for a in points {
            for b in points {
                let postgres = one::<bool>(&format!("SELECT {a}::timestamptz > {b}::timestamptz"));
                assert_eq!(super::later(at(a), at(b)), postgres, "{a} > {b}");
            }
        }
    }

    #[pg_test]
    fn clock_statement_expiry_is_now_plus_exactly_that_ttl() {
        // Intervals that `=` takes for one another ('1 mon' = '30 days'): each TTL gets its own end of window, the
        // one PostgreSQL computes (some month length differs from 30 days, whatever today is).
        let now = super::statement_now();
        for ttl in ["1 mon", "28 days", "29 days", "30 days", "31 days", "1 mon", "720 hours"] {
            let ttl = one::<Interval>(&format!("SELECT interval '{ttl}'"));
            assert_eq!(super::statement_expiry(ttl), super::expiry(now, ttl), "{ttl:?}");
        }
    }

    #[pg_test]
    fn clock_now_is_the_start_of_the_statement() {
        let now = super::statement_now();
        assert_eq!(now, one::<TimestampWithTimeZone>("SELECT statement_timestamp()"));
        run("SELECT pg_sleep(0.01)");
        assert_eq!(super::statement_now(), now, "the same reading for every call of one statement");
    }

    #[pg_test]
    fn clock_expiry_is_what_postgres_computes_in_every_kind_of_zone() {
        // Zones without daylight saving (UTC, a fixed offset) take the sum; the others, and months, the calendar.
        // Around a DST change a day is 23 or 25 hours in Europe/Berlin and exactly 24 in the fixed zones.
        let starts = ["'2024-03-30 12:00:00+00'", "'2024-10-26 23:30:00+00'", "now()", "'-infinity'", "'infinity'"];
        let ttls = ["1 day", "3 days", "36 hours", "1 day 02:00:00.000001", "1 mon", "-1 day", "-10 days", "3660 days"];
        for zone in ["UTC", "+05:30", "Europe/Berlin", "America/Sao_Paulo", "Asia/Kolkata"] {
            run(&format!("SET LOCAL TIME ZONE '{zone}'"));
            for start in starts {
                for ttl in ttls {
                    let now = one::<TimestampWithTimeZone>(&format!("SELECT {start}::timestamptz"));
                    let expected =
                        one::<TimestampWithTimeZone>(&format!("SELECT {start}::timestamptz + interval '{ttl}'"));
                    let ttl_value = one::<Interval>(&format!("SELECT interval '{ttl}'"));
                    assert_eq!(super::expiry(now, ttl_value), expected, "{start} + {ttl} in {zone}");
                }
            }
        }
        run("RESET TIME ZONE");
        // At the end of the range Postgres raises "out of range" when a step leaves it, even if the next comes back.
        let near_end = one::<TimestampWithTimeZone>("SELECT '294276-12-30 00:00:00+00'::timestamptz");
        for ttl in ["3 days", "2 days -25 hours"] {
            let ttl = one::<Interval>(&format!("SELECT interval '{ttl}'"));
            let raised = crate::xact::subtransaction(|| super::expiry(near_end, ttl))
                .err()
                .map(|e| crate::xact::report_of(&e).sql_error_code());
            assert_eq!(raised, Some(PgSqlErrorCode::ERRCODE_DATETIME_FIELD_OVERFLOW), "{ttl:?}");
        }
    }

    #[pg_test]
    fn clock_expiry_follows_the_calendar() {
        let start = one::<TimestampWithTimeZone>("SELECT '2024-01-31 12:00:00+00'::timestamptz");
        let month = one::<Interval>("SELECT interval '1 month'");
        assert_eq!(
            super::expiry(start, month),
            one::<TimestampWithTimeZone>("SELECT '2024-01-31 12:00:00+00'::timestamptz + interval '1 month'")
        );
        let day = one::<Interval>("SELECT interval '36 hours'");
        assert_eq!(
            super::expiry(start, day),
            one::<TimestampWithTimeZone>("SELECT '2024-02-02 00:00:00+00'::timestamptz")
        );
    }
}
