//! C macros and version differences of PostgreSQL, ported once and named as in C, so the rest of the code calls
//! one function whatever the major.

#![allow(non_snake_case)]

use pgrx::prelude::*;

/// `GetOldestNonRemovableTransactionId(rel)` (`GetOldestXmin(rel, PROCARRAY_FLAGS_VACUUM)` in 13): VACUUM's
/// horizon for `rel`, below which a committed deleter's versions are seen by no snapshot of a backend that can read
/// `rel`.
///
/// # Safety
/// `rel` must be an open relation.
pub unsafe fn GetOldestNonRemovableTransactionId(rel: pg_sys::Relation) -> pg_sys::TransactionId {
    // SAFETY: the caller vouches for the relation; the function reads the process array under its own lock.
    unsafe {
        #[cfg(feature = "pg13")]
        {
            pg_sys::GetOldestXmin(rel, pg_sys::PROCARRAY_FLAGS_VACUUM as i32)
        }
        #[cfg(not(feature = "pg13"))]
        {
            pg_sys::GetOldestNonRemovableTransactionId(rel)
        }
    }
}

/// `GETSTRUCT(tuple)`: the fixed-size struct at the start of a catalog tuple's data.
///
/// # Safety
/// `tuple` must be a valid heap tuple of a catalog whose form struct is `T`.
pub unsafe fn GETSTRUCT<T>(tuple: pg_sys::HeapTuple) -> *const T {
    // SAFETY: the caller vouches for the tuple; t_hoff is the offset of the data within the tuple header.
    unsafe {
        let data = (*tuple).t_data;
        (data as *const u8).add((*data).t_hoff as usize) as *const T
    }
}

/// Which row `ExecInsertIndexTuples` adds index entries for: a new row, or the new version of an updated row (all
/// indexes, or since 16 only the summarizing ones, BRIN, after a HOT update).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Entries {
    Inserted,
    Updated,
    #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
    UpdatedSummarizing,
}

/// `ExecInsertIndexTuples` (its signature changed in 14 and 16). Without `conflict` a duplicate key raises
/// unique_violation; with it, a possible duplicate in a unique index sets `*conflict` instead (speculative insertion).
/// All unique indexes are arbiters (NIL), as for ON CONFLICT without a conflict target.
///
/// # Safety
/// `result_rel` must have its indexes open (`ExecOpenIndices`) in `estate`, and `slot` must hold a row stored in
/// the relation (its tid set).
pub unsafe fn ExecInsertIndexTuples(
    result_rel: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
    conflict: Option<&mut bool>,
    entries: Entries,
) {
    let no_dup_err = conflict.is_some();
    let conflict = conflict.map_or(std::ptr::null_mut(), |c| c as *mut bool);
    let arbiters = std::ptr::null_mut();
    // SAFETY: the caller vouches for the executor state, result relation and slot.
    unsafe {
        #[cfg(feature = "pg13")]
        {
            // 13 finds the result relation in the executor state, and makes no difference for updates.
            let _ = entries;
            (*estate).es_result_relation_info = result_rel;
            pg_sys::ExecInsertIndexTuples(slot, estate, no_dup_err, conflict, arbiters);
        }
        #[cfg(any(feature = "pg14", feature = "pg15"))]
        {
            let update = entries == Entries::Updated;
            pg_sys::ExecInsertIndexTuples(result_rel, slot, estate, update, no_dup_err, conflict, arbiters);
        }
        #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
        {
            let update = entries != Entries::Inserted;
            let only_summarizing = entries == Entries::UpdatedSummarizing;
            pg_sys::ExecInsertIndexTuples(
                result_rel,
                slot,
                estate,
                update,
                no_dup_err,
                conflict,
                arbiters,
                only_summarizing,
            );
        }
    }
}

/// `simple_table_tuple_update` (its last argument became an enum in 16): replaces the row at `otid` with the one
/// `slot` holds, raising an error if another transaction changed it meanwhile. Returns the index entries the new
/// version needs, None after a HOT update that needs none.
///
/// # Safety
/// `rel` must be open with a lock that allows updating, `slot` one of its slots holding the new row.
pub unsafe fn simple_table_tuple_update(
    rel: pg_sys::Relation,
    otid: &mut pg_sys::ItemPointerData,
    slot: *mut pg_sys::TupleTableSlot,
    snapshot: pg_sys::Snapshot,
) -> Option<Entries> {
    // SAFETY: the caller vouches for the relation and slot.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15"))]
        {
            let mut update_indexes = false;
            pg_sys::simple_table_tuple_update(rel, otid, slot, snapshot, &mut update_indexes);
            update_indexes.then_some(Entries::Updated)
        }
        #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
        {
            let mut update_indexes = pg_sys::TU_UpdateIndexes::TU_None;
            pg_sys::simple_table_tuple_update(rel, otid, slot, snapshot, &mut update_indexes);
            match update_indexes {
                pg_sys::TU_UpdateIndexes::TU_All => Some(Entries::Updated),
                pg_sys::TU_UpdateIndexes::TU_Summarizing => Some(Entries::UpdatedSummarizing),
                _ => None,
            }
        }
    }
}

/// `index_beginscan` (18 added instrumentation, which we leave out).
///
/// # Safety
/// `heap` and `index` must be open and locked, `snapshot` registered for as long as the scan lasts.
pub unsafe fn index_beginscan(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    nkeys: i32,
) -> pg_sys::IndexScanDesc {
    // SAFETY: the caller vouches for the relations and snapshot.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        return pg_sys::index_beginscan(heap, index, snapshot, nkeys, 0);
        #[cfg(feature = "pg18")]
        return pg_sys::index_beginscan(heap, index, snapshot, std::ptr::null_mut(), nkeys, 0);
    }
}

/// The primary key index of `rel` (`RelationGetPrimaryKeyIndex`, whose signature changed in 17), InvalidOid if
/// it has none.
///
/// # Safety
/// `rel` must be an open relation.
pub unsafe fn primary_key_index(rel: pg_sys::Relation) -> pg_sys::Oid {
    // SAFETY: the caller vouches for the relation; the list is the relcache's copy, ours to free.
    unsafe {
        pg_sys::list_free(pg_sys::RelationGetIndexList(rel));
        (*rel).rd_pkindex
    }
}

/// The backend's cache of subtransaction ids: how many it holds, and whether it overflowed (`MyProc->subxidStatus`,
/// `MyPgXact` on 13).
pub fn subxidStatus() -> (u8, bool) {
    // SAFETY: MyProc (MyPgXact) is set for every backend and worker connected to shared memory.
    unsafe {
        #[cfg(feature = "pg13")]
        return ((*pg_sys::MyPgXact).nxids, (*pg_sys::MyPgXact).overflowed);
        #[cfg(not(feature = "pg13"))]
        return ((*pg_sys::MyProc).subxidStatus.count, (*pg_sys::MyProc).subxidStatus.overflowed);
    }
}

/// `AddinShmemInitLock`: slot 21 of the main LWLock array (a C macro bindgen cannot see).
///
/// # Safety
/// Shared memory must be attached (MainLWLockArray set).
pub unsafe fn AddinShmemInitLock() -> *mut pg_sys::LWLock {
    // SAFETY: the caller vouches that the array exists; 21 is the lock's fixed index in lwlocknames.txt.
    unsafe { &raw mut (*pg_sys::MainLWLockArray.add(21)).lock }
}

/// `utils/timeout.h`, which pgrx's bindings leave out. `STATEMENT_TIMEOUT` is the fourth `TimeoutId` in every
/// supported major (13 to 18).
mod timeout {
    pub const STATEMENT_TIMEOUT: std::ffi::c_int = 3;
    extern "C-unwind" {
        pub fn enable_timeout_after(id: std::ffi::c_int, delay_ms: std::ffi::c_int);
        pub fn disable_timeout(id: std::ffi::c_int, keep_indicator: bool);
    }
}

/// Arms the statement timeout, as postgres.c does at the start of a client's statement (a background worker's
/// work is not one): after `delay_ms`, the next interrupt check raises 57014 "canceling statement due to statement
/// timeout".
pub fn enable_statement_timeout(delay_ms: i32) {
    // SAFETY: the timeout is registered for every process connected to a database (InitPostgres); any ERROR is
    // caught at the FFI boundary.
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| timeout::enable_timeout_after(timeout::STATEMENT_TIMEOUT, delay_ms))
    }
}

/// Disarms the statement timeout (nothing happens if it is not armed).
pub fn disable_statement_timeout() {
    // SAFETY: as above.
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| timeout::disable_timeout(timeout::STATEMENT_TIMEOUT, false)) }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn ports_a_statement_timeout_armed_by_hand_cancels_like_statement_timeout() {
        super::enable_statement_timeout(50);
        let (code, message) = error_of("SELECT pg_sleep(5)");
        super::disable_statement_timeout();
        assert_eq!(code, PgSqlErrorCode::ERRCODE_QUERY_CANCELED);
        assert_eq!(message, "canceling statement due to statement timeout");
        run("SELECT pg_sleep(0.1)");
    }
}

/// `raw_parser` of a string of SQL statements (14 added a parse mode; the default one parses statements).
///
/// # Safety
/// `sql` must be a NUL-terminated string; the parse tree is allocated in the current memory context.
pub unsafe fn raw_parser(sql: *const std::ffi::c_char) -> *mut pg_sys::List {
    // SAFETY: the caller vouches for the string.
    unsafe {
        #[cfg(feature = "pg13")]
        return pg_sys::raw_parser(sql);
        #[cfg(not(feature = "pg13"))]
        return pg_sys::raw_parser(sql, pg_sys::RawParseMode::RAW_PARSE_DEFAULT);
    }
}

/// Does `role` own relation `relid` (or act for its owner, or is it a superuser)? (`pg_class_ownercheck`, which 16
/// generalised into `object_ownercheck`.)
pub fn owns_relation(role: pg_sys::Oid, relid: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup by oids; raises a clean ERROR for a relation that is gone.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15"))]
        return pg_sys::pg_class_ownercheck(relid, role);
        #[cfg(not(any(feature = "pg13", feature = "pg14", feature = "pg15")))]
        return pg_sys::object_ownercheck(pg_sys::RelationRelationId, relid, role);
    }
}
