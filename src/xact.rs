//! Brackets that undo work on error: a subtransaction, the way a PL/pgSQL exception block does it (if the body
//! fails with the one error the caller expects, everything it did is undone and the caller takes another road), and
//! the background worker's own top-level transactions (an ERROR rolls back that transaction and comes back as a
//! value, so one failing step never takes the worker down).

use crate::errors::server_log;
use crate::ports;
use pgrx::prelude::*;

/// A subtransaction that wrote something leaves its xid in the backend's cache of subtransaction ids until the
/// top-level transaction ends. Past 64 that cache overflows and snapshots all over the cluster get slower (the
/// classic subtransaction-overflow trap), so our optional subtransactions (the batch insert, purge's quick attempt)
/// step aside once half of it is used, by us or by the application's own savepoints.
const SUBXID_ROOM: u8 = 32;

/// May we open one more subtransaction without pushing the cache towards overflow?
pub fn has_room() -> bool {
    let (count, overflowed) = ports::subxidStatus();
    !overflowed && count < SUBXID_ROOM
}

/// Runs `body` in a subtransaction. If it raises `expected`, the subtransaction is rolled back — undoing
/// everything `body` did — and None is returned; any other error rolls it back too and propagates.
pub fn undo_on<R>(expected: PgSqlErrorCode, body: impl FnOnce() -> R) -> Option<R> {
    match subtransaction(body) {
        Ok(result) => Some(result),
        Err(error) if code_of(&error) == expected => None,
        Err(error) => (*error).rethrow(),
    }
}

/// Runs `body`, which gives up waiting for a lock once its short lock_timeout passes, in a subtransaction: None, with
/// everything it did undone, when it gave up.
pub fn unless_it_waits<R>(body: impl FnOnce() -> R) -> Option<R> {
    undo_on(PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, body)
}

/// The SQLSTATE of a caught error.
pub fn code_of(error: &pg_sys::panic::CaughtError) -> PgSqlErrorCode {
    report_of(error).sql_error_code()
}

/// The report of a caught error, whatever raised it.
pub fn report_of(error: &pg_sys::panic::CaughtError) -> &pg_sys::panic::ErrorReportWithLevel {
    match error {
        pg_sys::panic::CaughtError::PostgresError(e) | pg_sys::panic::CaughtError::ErrorReport(e) => e,
        pg_sys::panic::CaughtError::RustPanic { ereport, .. } => ereport,
    }
}

/// Runs `body` in a subtransaction: kept if it returns, rolled back — undoing everything it did — if it raises an
/// ERROR, which comes back as Err (the transaction goes on as it was before).
pub fn subtransaction<R>(body: impl FnOnce() -> R) -> Result<R, Box<pg_sys::panic::CaughtError>> {
    // Whatever `body` touched in Postgres is undone by the rollback; Rust state it shares (the plan cache) stays
    // valid across an unwind.
    let body = std::panic::AssertUnwindSafe(body);
    // SAFETY: reads backend globals.
    let (context, owner, error_context) =
        unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner, pg_sys::error_context_stack) };
    // Like PL/pgSQL: the body allocates in the caller's memory context, but what it acquires (buffer pins, locks,
    // relation references) belongs to the subtransaction's resource owner, so the rollback releases it. The
    // caller's owner comes back only once the subtransaction is over.
    // SAFETY: puts back what was read above; both outlive the subtransaction.
    let restore = move || unsafe {
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
        // As PG_CATCH does: an error caught here leaves no error context callback of the failed code linked.
        pg_sys::error_context_stack = error_context;
    };
    // SAFETY: inside a transaction (every caller runs in one); ended on every path below.
    unsafe {
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
    }
    PgTryBuilder::new(|| {
        let result = body();
        // SAFETY: the subtransaction begun above is the current one.
        unsafe { pg_sys::ReleaseCurrentSubTransaction() };
        restore();
        Ok(result)
    })
    .catch_others(|error| {
        // SAFETY: as above.
        unsafe { pg_sys::RollbackAndReleaseCurrentSubTransaction() };
        restore();
        Err(Box::new(error))
    })
    .execute()
}

/// Runs `body` in a transaction of its own (background workers only: there is no transaction around it). An ERROR
/// rolls the transaction back and comes back as Err (its SQLSTATE and message).
pub fn try_transaction<R>(body: impl FnOnce() -> R + std::panic::UnwindSafe) -> Result<R, (PgSqlErrorCode, String)> {
    // SAFETY: reads a backend global.
    let context = unsafe { pg_sys::CurrentMemoryContext };
    // SAFETY: a worker between transactions may start one; it is committed or aborted on every path below.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    PgTryBuilder::new(|| {
        let result = body();
        // SAFETY: the snapshot and transaction begun above.
        unsafe {
            pg_sys::PopActiveSnapshot();
            pg_sys::CommitTransactionCommand();
        }
        Ok(result)
    })
    .catch_others(|caught| {
        let report = report_of(&caught);
        let error = (report.sql_error_code(), report.message().to_owned());
        // A statement timeout the body armed (purge batches) must not fire in the next transaction.
        ports::disable_statement_timeout();
        // SAFETY: aborting releases the snapshot and everything else the transaction held.
        unsafe {
            pg_sys::AbortCurrentTransaction();
            pg_sys::MemoryContextSwitchTo(context);
        }
        Err(error)
    })
    .execute()
}

/// `try_transaction`, logging an ERROR (with `what`) and turning it into None.
pub fn in_transaction<R>(what: &str, body: impl FnOnce() -> R + std::panic::UnwindSafe) -> Option<R> {
    try_transaction(body).map_err(|(_, message)| server_log!("pg_dedup worker: {what} failed: {message}")).ok()
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::*;
    use crate::testing::*;

    #[pg_test]
    fn xact_a_subtransaction_keeps_its_work_or_undoes_it() {
        run("CREATE TABLE xact_t (x int)");
        subtransaction(|| run("INSERT INTO xact_t VALUES (1)")).expect("no error");
        let failed = subtransaction(|| run("INSERT INTO xact_t VALUES (2); SELECT 1 / 0"));
        assert_eq!(code_of(&failed.expect_err("division by zero")), PgSqlErrorCode::ERRCODE_DIVISION_BY_ZERO);
        assert_eq!(count("xact_t"), 1, "the failed subtransaction's insert was undone");
    }

    #[pg_test]
    fn xact_undo_on_swallows_only_the_expected_error() {
        run("CREATE TABLE xact_u (x int PRIMARY KEY); INSERT INTO xact_u VALUES (1)");
        let undone = undo_on(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, || run("INSERT INTO xact_u VALUES (2), (1)"));
        assert!(undone.is_none());
        assert_eq!(count("xact_u"), 1);
        let other = subtransaction(|| undo_on(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, || run("SELECT 1 / 0")));
        assert_eq!(code_of(&other.expect_err("propagated")), PgSqlErrorCode::ERRCODE_DIVISION_BY_ZERO);
    }

    #[pg_test]
    fn xact_room_for_subtransactions_runs_out_at_half_the_cache() {
        assert!(has_room());
        run("CREATE TABLE xact_room (x int)");
        // Subtransactions that wrote keep their ids in the backend's cache until the transaction ends.
        for i in 0..40 {
            subtransaction(|| run(&format!("INSERT INTO xact_room VALUES ({i})"))).unwrap();
        }
        assert!(!has_room(), "32 of 64 slots used: no room for optional subtransactions");
    }
}
