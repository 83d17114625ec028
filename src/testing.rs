//! Helpers for the `#[pg_test]`s beside each module (`cargo pgrx test`): SQL run inside the test's transaction,
//! and errors caught in a subtransaction so that a test can check their SQLSTATE and go on.

use crate::xact;
use pgrx::prelude::*;

/// Runs SQL (one or more statements), failing the test on an error.
pub fn run(sql: &str) {
    Spi::run(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The single value `sql` returns.
pub fn one<T: FromDatum + IntoDatum>(sql: &str) -> T {
    Spi::get_one::<T>(sql).unwrap_or_else(|e| panic!("{sql}: {e}")).unwrap_or_else(|| panic!("{sql}: NULL"))
}

/// The rows `sql` returns, first column as text.
pub fn column(sql: &str) -> Vec<String> {
    Spi::connect(|client| {
        client
            .select(sql, None, &[])
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .map(|row| row.get::<String>(1).ok().flatten().unwrap_or_default())
            .collect()
    })
}

/// The SQLSTATE and message of the error `sql` raises; fails the test if it raises none. What `sql` did is undone.
pub fn error_of(sql: &str) -> (PgSqlErrorCode, String) {
    match xact::subtransaction(|| Spi::run(sql)) {
        Ok(_) => panic!("{sql}: expected an error, got none"),
        Err(error) => {
            let report = xact::report_of(&error);
            (report.sql_error_code(), report.message().to_owned())
        }
    }
}

/// Asserts that `sql` raises a `dedup:` error with SQLSTATE `code` and a hint.
pub fn assert_dedup_error(sql: &str, code: PgSqlErrorCode) {
    match xact::subtransaction(|| Spi::run(sql)) {
        Ok(_) => panic!("{sql}: expected {code:?}, got no error"),
        Err(error) => {
            let report = xact::report_of(&error);
            assert_eq!(report.sql_error_code(), code, "{sql}: {}", report.message());
            assert!(report.message().starts_with("dedup: "), "{sql}: {}", report.message());
            assert!(report.hint().is_some_and(|h| !h.is_empty()), "{sql}: no hint on {}", report.message());
        }
    }
}

/// Runs `body` in a subtransaction and rolls it back, as `ROLLBACK TO SAVEPOINT` does (which SPI cannot run).
pub fn rolled_back(body: impl FnOnce()) {
    let outcome = xact::subtransaction(|| {
        body();
        pgrx::error!("rolling back the subtransaction");
    });
    assert!(outcome.is_err(), "the subtransaction was rolled back");
}

/// How many rows `from` (a table, with an optional WHERE clause) has.
pub fn count(from: &str) -> i64 {
    one::<i64>(&format!("SELECT count(*) FROM {from}"))
}

/// How often the filter trigger ran in this transaction (the executor wrote a row); needs `track_functions`.
pub fn trigger_calls() -> i64 {
    one::<i64>(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_catalog.pg_stat_xact_user_functions \
         WHERE funcname = 'inbox_filter_trigger'",
    )
}
