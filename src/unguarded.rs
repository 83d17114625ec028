//! Calls into PostgreSQL under one guard for a whole sequence, instead of pgrx's guard around each call: for the few
//! sequences on every call's path that make several calls in a row (a write handle's use begun and ended, its locks
//! taken again, a speculative insertion, the primary key's lookup set up and torn down, a claim read back where it
//! was written, what an inbox's open is compared by), and for the purge's walk, which makes several for each row it
//! deletes (7.6% of a purge's instructions went to their guards, bench/results/profiles/issue-23.md, stop 62).
//!
//! Why: pgrx wraps every `pg_sys` function in a guard of its own (a `sigsetjmp`, the thread check, and a copy of
//! the guard's code at every call site). A `claim()` + `complete()` request went through 85 of them: 6.4 k of its
//! 196 k instructions and 270 of its 6,700 instruction-cache misses (callgrind, bench/results/profiles/issue-22.md,
//! stop 54).
//!
//! How it stays sound:
//! - each function below is declared as PostgreSQL exports it (the static inline ones through the C shims pgrx's
//!   own bindings call, under the same names in every major); its argument and return types are checked when the
//!   crate compiles against pgrx's binding of the same name for the major being built, which pgrx generates from
//!   that major's headers;
//! - they are methods of `Guard`, which only `guarded` makes, so they can only be called inside it: an ERROR raised
//!   by any of them jumps back to that one guard, which turns it into a Rust panic as the per-call guard would. The
//!   frames the jump leaves are the closure's alone, so the closure must hold nothing with a destructor and must not
//!   panic (the guard is entered through an `extern "C"` frame, which a panic may not cross): these calls, plain
//!   pointers and numbers, and Rust code that cannot panic (it may change what it borrows, as the purge's walk
//!   does). Not a `pg_sys` function nor a pgrx macro that calls PostgreSQL (`check_for_interrupts!`, `debug1!`):
//!   their own guard would turn an ERROR into a panic inside the closure.

#![allow(non_snake_case)]

use pgrx::prelude::*;

/// The proof of being inside `guarded`: the functions below are its methods.
pub struct Guard(());

/// Declares each function without pgrx's guard, as a method of `Guard`, and checks its argument and return types
/// against pgrx's binding of the same name.
macro_rules! unguarded {
    ($($(#[link_name = $link:literal])? fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;)*) => {
        mod raw {
            use super::*;
            extern "C-unwind" {
                $(
                    $(#[link_name = $link])?
                    pub(super) fn $name($($arg: $ty),*) $(-> $ret)?;
                )*
            }
        }
        impl Guard {
            $(
                /// As its `pg_sys` twin, without a guard of its own.
                ///
                /// # Safety
                /// As for its `pg_sys` twin.
                #[inline(always)]
                #[allow(clippy::too_many_arguments)] // PostgreSQL's signature, as it is
                pub unsafe fn $name(&self, $($arg: $ty),*) $(-> $ret)? {
                    // SAFETY: the caller vouches for the call; `self` says a guard is around it.
                    unsafe { raw::$name($($arg),*) }
                }
            )*
        }
        $(const _: unsafe fn($($ty),*) $(-> $ret)? = pg_sys::$name;)*
    };
}

unguarded! {
    fn CommandCounterIncrement();
    fn GetCurrentTransactionId() -> pg_sys::TransactionId;
    fn GetCurrentCommandId(used: bool) -> pg_sys::CommandId;
    fn GetCurrentSubTransactionId() -> pg_sys::SubTransactionId;
    fn GetUserId() -> pg_sys::Oid;
    fn LockRelationOid(relid: pg_sys::Oid, lockmode: pg_sys::LOCKMODE);
    fn RelationIncrementReferenceCount(rel: pg_sys::Relation);
    fn RelationDecrementReferenceCount(rel: pg_sys::Relation);
    fn MemoryContextReset(context: pg_sys::MemoryContext);
    fn GetTransactionSnapshot() -> pg_sys::Snapshot;
    fn RegisterSnapshot(snapshot: pg_sys::Snapshot) -> pg_sys::Snapshot;
    fn UnregisterSnapshot(snapshot: pg_sys::Snapshot);
    fn SpeculativeInsertionLockAcquire(xid: pg_sys::TransactionId) -> u32;
    fn SpeculativeInsertionLockRelease(xid: pg_sys::TransactionId);
    fn table_open(relationId: pg_sys::Oid, lockmode: pg_sys::LOCKMODE) -> pg_sys::Relation;
    fn table_close(relation: pg_sys::Relation, lockmode: pg_sys::LOCKMODE);
    fn index_open(relationId: pg_sys::Oid, lockmode: pg_sys::LOCKMODE) -> pg_sys::Relation;
    fn index_close(relation: pg_sys::Relation, lockmode: pg_sys::LOCKMODE);
    fn index_endscan(scan: pg_sys::IndexScanDesc);
    fn table_slot_create(rel: pg_sys::Relation, reglist: *mut *mut pg_sys::List) -> *mut pg_sys::TupleTableSlot;
    fn ExecDropSingleTupleTableSlot(slot: *mut pg_sys::TupleTableSlot);
    #[link_name = "ExecClearTuple__pgrx_cshim"]
    fn ExecClearTuple(slot: *mut pg_sys::TupleTableSlot) -> *mut pg_sys::TupleTableSlot;
    #[link_name = "table_tuple_insert_speculative__pgrx_cshim"]
    fn table_tuple_insert_speculative(
        rel: pg_sys::Relation,
        slot: *mut pg_sys::TupleTableSlot,
        cid: pg_sys::CommandId,
        options: std::ffi::c_int,
        bistate: *mut pg_sys::BulkInsertStateData,
        specToken: u32,
    );
    #[link_name = "table_tuple_complete_speculative__pgrx_cshim"]
    fn table_tuple_complete_speculative(
        rel: pg_sys::Relation,
        slot: *mut pg_sys::TupleTableSlot,
        specToken: u32,
        succeeded: bool,
    );
    fn ProcessInterrupts();
    fn index_getnext_tid(scan: pg_sys::IndexScanDesc, direction: pg_sys::ScanDirection::Type) -> pg_sys::ItemPointer;
    fn index_fetch_heap(scan: pg_sys::IndexScanDesc, slot: *mut pg_sys::TupleTableSlot) -> bool;
    fn ReadBuffer(reln: pg_sys::Relation, blockNum: pg_sys::BlockNumber) -> pg_sys::Buffer;
    fn LockBuffer(buffer: pg_sys::Buffer, mode: std::ffi::c_int);
    fn BufferGetLSNAtomic(buffer: pg_sys::Buffer) -> pg_sys::XLogRecPtr;
    fn UnlockReleaseBuffer(buffer: pg_sys::Buffer);
    #[link_name = "slot_getattr__pgrx_cshim"]
    fn slot_getattr(slot: *mut pg_sys::TupleTableSlot, attnum: std::ffi::c_int, isnull: *mut bool) -> pg_sys::Datum;
    #[link_name = "table_tuple_delete__pgrx_cshim"]
    fn table_tuple_delete(
        rel: pg_sys::Relation,
        tid: pg_sys::ItemPointer,
        cid: pg_sys::CommandId,
        snapshot: pg_sys::Snapshot,
        crosscheck: pg_sys::Snapshot,
        wait: bool,
        tmfd: *mut pg_sys::TM_FailureData,
        changingPart: bool,
    ) -> pg_sys::TM_Result::Type;
    #[link_name = "table_tuple_fetch_row_version__pgrx_cshim"]
    fn table_tuple_fetch_row_version(
        rel: pg_sys::Relation,
        tid: pg_sys::ItemPointer,
        snapshot: pg_sys::Snapshot,
        slot: *mut pg_sys::TupleTableSlot,
    ) -> bool;
}

impl Guard {
    /// `CHECK_FOR_INTERRUPTS()`: serves what was asked for meanwhile (a cancel or a timeout raises an ERROR, a
    /// termination exits; most else returns).
    ///
    /// # Safety
    /// As `ProcessInterrupts`: callable wherever a query may be cancelled.
    pub unsafe fn check_for_interrupts(&self) {
        // SAFETY: reads a flag signal handlers set; the caller vouches for the call.
        unsafe {
            if pg_sys::InterruptPending != 0 {
                self.ProcessInterrupts();
            }
        }
    }
}

/// Runs `calls`, a sequence or a loop of `Guard`'s functions, under one guard: an ERROR any of them raises becomes a
/// Rust panic here, as it would at each `pg_sys` function's own guard.
///
/// # Safety
/// Each call must be one its `pg_sys` twin could make; `calls` must hold nothing with a destructor, must not panic
/// and must call no `pg_sys` function (see the module comment).
pub unsafe fn guarded<R>(calls: impl FnOnce(&Guard) -> R) -> R {
    // SAFETY: the caller vouches for the calls; this is the main thread, as for every call into PostgreSQL.
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| calls(&Guard(()))) }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::one;
    use pgrx::prelude::*;

    #[pg_test]
    fn unguarded_an_error_in_a_sequence_is_caught_at_its_one_guard() {
        let table = one::<pg_sys::Oid>("SELECT 'dedup.inbox_default'::regclass::oid");
        // SAFETY: reads a backend global.
        let context = unsafe { pg_sys::CurrentMemoryContext };
        // The second open raises an ERROR (no relation has oid 0) after the first went through. Caught at the guard,
        // it is an ordinary error that the subtransaction rolls back (the first open's reference and lock with it);
        // with no guard, PostgreSQL's jump would go past the subtransaction's catch to its own error handler.
        // SAFETY: calls their pg_sys twins could make; the closure holds oids.
        let caught = crate::xact::subtransaction(|| unsafe {
            super::guarded(|pg| {
                let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
                pg.table_open(table, lock);
                pg.table_open(pg_sys::InvalidOid, lock)
            })
        });
        let error = caught.expect_err("opening a relation that does not exist raises an ERROR");
        let message = crate::xact::report_of(&error).message();
        assert!(message.contains("could not open relation with OID 0"), "{message}");
        // SAFETY: reads a backend global.
        assert_eq!(unsafe { pg_sys::CurrentMemoryContext }, context, "back in the caller's memory context");
        assert_eq!(one::<i32>("SELECT 1"), 1, "the transaction goes on");
    }
}
