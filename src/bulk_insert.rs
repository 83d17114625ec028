//! Writing ids the filter vouches for straight into an inbox table's heap and indexes, the way COPY does, instead
//! of through `INSERT ... ON CONFLICT`.
//!
//! Why it pays: for an id the filter calls "certainly new", ON CONFLICT's speculative insertion is pure overhead —
//! a pre-check descent of the primary key, a speculative token and a confirmation WAL record per row — and the
//! executor adds a plan, a trigger call and a RETURNING row per id. Here the rows go in with one multi-insert (one
//! WAL record per heap page) and one index insertion each, whose ordinary uniqueness check remains the truth.
//!
//! Why it is safe: the insertion runs in a subtransaction. If any id exists after all (a concurrent claim of the
//! same id, or a filter that was wrong), the unique index raises unique_violation — after waiting for an
//! in-progress claim, like ON CONFLICT does — the whole attempt is undone, and the caller claims the ids the
//! ordinary way. Tables with anything the executor would have to honour beyond the row itself (another trigger,
//! a rule, row security, a CHECK constraint) are left to the executor.

use crate::filter;
use crate::inbox::Inbox;
use crate::subxact;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;
use std::cell::Cell;

/// Bulk inserts allowed per top-level transaction. Each one commits a subtransaction, whose xid stays in the
/// backend's subxid cache until the transaction ends; past 64 that cache overflows and snapshots all over the
/// cluster get slower (the classic subtransaction-overflow trap). A transaction that marks in a loop therefore
/// gets this many, leaving room for the application's own savepoints, and the executor for the rest.
const PER_TRANSACTION: u32 = 16;

thread_local! {
    /// (top-level transaction id, bulk inserts it has committed).
    static SPENT: Cell<(pg_sys::TransactionId, u32)> = const { Cell::new((pg_sys::InvalidTransactionId, 0)) };
}

/// Inserts every id in `ids` (sorted, distinct) with `expires_at`, or nothing. True if they were all inserted;
/// false if the table or the transaction needs the executor, or some id already had a row — then nothing was
/// written.
pub fn insert_all(inbox: &Inbox, ids: &[String], expires_at: TimestampWithTimeZone) -> bool {
    if ids.is_empty() {
        return true;
    }
    let top = unsafe { pg_sys::GetTopTransactionIdIfAny() };
    let (spent_by, spent) = SPENT.get();
    if top != pg_sys::InvalidTransactionId && top == spent_by && spent >= PER_TRANSACTION {
        return false;
    }
    let rel = unsafe { pg_sys::table_open(inbox.relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) };
    let inserted = unsafe { only_the_row_matters(rel) }
        && subxact::undo_on(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, || {
            let mut scratch = PgMemoryContexts::new("dedup bulk insert");
            unsafe { scratch.switch_to(|_| write_rows(rel, inbox.ns, ids, expires_at)) };
        })
        .is_some();
    if inserted {
        // Writing gave the transaction an id if it had none: a transaction is known by it from now on.
        let top = unsafe { pg_sys::GetTopTransactionId() };
        SPENT.set((top, if top == spent_by { spent + 1 } else { 1 }));
    }
    unsafe {
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        // Later statements of this call (and of the transaction) must see the rows, as after any SQL insert.
        pg_sys::CommandCounterIncrement();
    }
    inserted
}

/// Does writing a row need nothing but the row and its index entries? The only trigger allowed is our own filter
/// trigger, whose work `write_rows` does itself.
unsafe fn only_the_row_matters(rel: pg_sys::Relation) -> bool {
    let form = &*(*rel).rd_rel;
    let constr = (*(*rel).rd_att).constr;
    let triggers = (*rel).trigdesc;
    let only_ours = triggers.is_null()
        || ((*triggers).numtriggers == 1
            && std::ffi::CStr::from_ptr((*(*triggers).triggers).tgname).to_bytes() == b"dedup_filter");
    form.relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
        && !form.relrowsecurity
        && (*rel).rd_rules.is_null()
        && (constr.is_null() || (*constr).num_check == 0)
        && only_ours
}

/// The filter bits, then one multi-insert into the heap, then each row's index entries (raising unique_violation
/// for an id that exists).
unsafe fn write_rows(rel: pg_sys::Relation, ns: u64, ids: &[String], expires_at: TimestampWithTimeZone) {
    // What the filter trigger does for the executor: take the transaction id, then set the bits, before any row
    // exists (see filter.rs: a rotation finds every writer by its transaction id).
    pg_sys::GetCurrentTransactionId();
    for id in ids {
        filter::add(ns, id);
    }
    let estate = pg_sys::CreateExecutorState();
    let result_rel = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>()) as *mut pg_sys::ResultRelInfo;
    (*result_rel).type_ = pg_sys::NodeTag::T_ResultRelInfo;
    pg_sys::InitResultRelInfo(result_rel, rel, 1, std::ptr::null_mut(), 0);
    pg_sys::ExecOpenIndices(result_rel, false);
    #[cfg(feature = "pg13")]
    {
        (*estate).es_result_relation_info = result_rel;
    }
    let expires_at = expires_at.into_datum().expect("a timestamp is a datum");
    // A private copy of the row type: the relation's own is reference-counted, and a thousand slots pinning it
    // through the resource owner cost more than the inserts themselves.
    let desc = pg_sys::CreateTupleDescCopy((*rel).rd_att);
    let slots: Vec<*mut pg_sys::TupleTableSlot> = ids
        .iter()
        .map(|id| {
            let slot = pg_sys::MakeSingleTupleTableSlot(desc, pg_sys::table_slot_callbacks(rel));
            let text = pg_sys::cstring_to_text_with_len(id.as_ptr() as *const std::ffi::c_char, id.len() as i32);
            *(*slot).tts_values.add(0) = pg_sys::Datum::from(text);
            *(*slot).tts_values.add(1) = expires_at;
            *(*slot).tts_isnull.add(0) = false;
            *(*slot).tts_isnull.add(1) = false;
            pg_sys::ExecStoreVirtualTuple(slot)
        })
        .collect();
    let multi_insert = (*(*rel).rd_tableam).multi_insert.expect("every table access method can multi-insert");
    let cid = pg_sys::GetCurrentCommandId(true);
    multi_insert(rel, slots.as_ptr() as *mut _, slots.len() as i32, cid, 0, std::ptr::null_mut());
    for &slot in &slots {
        insert_index_entries(result_rel, slot, estate);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
    }
    pg_sys::ExecCloseIndices(result_rel);
    pg_sys::FreeExecutorState(estate);
}

/// Index entries for one stored row; a duplicate key raises unique_violation (no index here is deferrable: a
/// deferrable constraint would have brought its own trigger, and the table would not qualify).
unsafe fn insert_index_entries(result_rel: *mut pg_sys::ResultRelInfo, slot: *mut pg_sys::TupleTableSlot, estate: *mut pg_sys::EState) {
    let no_dup_err = false;
    #[cfg(feature = "pg13")]
    let _ = result_rel;
    #[cfg(feature = "pg13")]
    pg_sys::ExecInsertIndexTuples(slot, estate, no_dup_err, std::ptr::null_mut(), std::ptr::null_mut());
    #[cfg(any(feature = "pg14", feature = "pg15"))]
    pg_sys::ExecInsertIndexTuples(result_rel, slot, estate, false, no_dup_err, std::ptr::null_mut(), std::ptr::null_mut());
    #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
    pg_sys::ExecInsertIndexTuples(result_rel, slot, estate, false, no_dup_err, std::ptr::null_mut(), std::ptr::null_mut(), false);
}
