//! Trying something in a subtransaction, the way a PL/pgSQL exception block does: if it fails with the one error
//! the caller expects, everything it did is undone and the caller takes another road.

use pgrx::prelude::*;

/// A subtransaction that wrote something leaves its xid in the backend's cache of subtransaction ids until the
/// top-level transaction ends. Past 64 that cache overflows and snapshots all over the cluster get slower (the
/// classic subtransaction-overflow trap), so our optional subtransactions (the batch insert, purge's quick attempt)
/// step aside once half of it is used, by us or by the application's own savepoints.
const SUBXID_ROOM: u8 = 32;

/// May we open one more subtransaction without pushing the cache towards overflow?
pub fn has_room() -> bool {
    #[cfg(feature = "pg13")]
    let (count, overflowed) = unsafe { ((*pg_sys::MyPgXact).nxids, (*pg_sys::MyPgXact).overflowed) };
    #[cfg(not(feature = "pg13"))]
    let (count, overflowed) = unsafe { ((*pg_sys::MyProc).subxidStatus.count, (*pg_sys::MyProc).subxidStatus.overflowed) };
    !overflowed && count < SUBXID_ROOM
}

/// Runs `body` in a subtransaction. If it raises `expected`, the subtransaction is rolled back — undoing
/// everything `body` did — and None is returned; any other error rolls it back too and propagates.
pub fn undo_on<R>(expected: PgSqlErrorCode, body: impl FnOnce() -> R) -> Option<R> {
    // Whatever `body` touched in Postgres is undone by the rollback; Rust state it shares (the plan cache) stays
    // valid across an unwind.
    let body = std::panic::AssertUnwindSafe(body);
    let (context, owner) = unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner) };
    // Like PL/pgSQL: the body allocates in the caller's memory context, but what it acquires (buffer pins, locks,
    // relation references) belongs to the subtransaction's resource owner, so the rollback releases it. The
    // caller's owner comes back only once the subtransaction is over.
    let restore = move || unsafe {
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    };
    unsafe {
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
    }
    PgTryBuilder::new(|| {
        let result = body();
        unsafe { pg_sys::ReleaseCurrentSubTransaction() };
        restore();
        Some(result)
    })
    .catch_when(expected, |_| {
        unsafe { pg_sys::RollbackAndReleaseCurrentSubTransaction() };
        restore();
        None
    })
    .catch_others(|error| {
        // Leave the transaction as we found it, then let the error go on to the caller.
        unsafe { pg_sys::RollbackAndReleaseCurrentSubTransaction() };
        restore();
        error.rethrow()
    })
    .execute()
}
