//! C macros and version differences of PostgreSQL, ported once and named as in C, so the rest of the code calls
//! one function whatever the major.

#![allow(non_snake_case)]

use pgrx::prelude::*;

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

/// The owner of relation `relid` (`pg_class.relowner`), looked up in the syscache; None if there is no such
/// relation.
pub fn relation_owner(relid: pg_sys::Oid) -> Option<pg_sys::Oid> {
    // SAFETY: a syscache lookup by oid; the tuple is released before returning and only copied from meanwhile.
    unsafe {
        let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::RELOID as i32, relid.into_datum()?);
        if tuple.is_null() {
            return None;
        }
        let owner = (*GETSTRUCT::<pg_sys::FormData_pg_class>(tuple)).relowner;
        pg_sys::ReleaseSysCache(tuple);
        Some(owner)
    }
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
) {
    let no_dup_err = conflict.is_some();
    let conflict = conflict.map_or(std::ptr::null_mut(), |c| c as *mut bool);
    let arbiters = std::ptr::null_mut();
    // SAFETY: the caller vouches for the executor state, result relation and slot.
    unsafe {
        #[cfg(feature = "pg13")]
        {
            // 13 finds the result relation in the executor state.
            (*estate).es_result_relation_info = result_rel;
            pg_sys::ExecInsertIndexTuples(slot, estate, no_dup_err, conflict, arbiters);
        }
        #[cfg(any(feature = "pg14", feature = "pg15"))]
        pg_sys::ExecInsertIndexTuples(result_rel, slot, estate, false, no_dup_err, conflict, arbiters);
        #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
        pg_sys::ExecInsertIndexTuples(result_rel, slot, estate, false, no_dup_err, conflict, arbiters, false);
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
