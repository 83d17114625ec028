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
//! a rule, row security, a CHECK constraint, columns an owner added after `NOT OF`) are left to the executor, and
//! so are calls of fewer than `MIN_IDS` ids and transactions already holding many subtransactions.

use crate::filter;
use crate::inbox::Inbox;
use crate::subxact;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;

/// Fewer ids than this take the executor's ON CONFLICT plan: the bulk insert's subtransaction costs a second
/// transaction id, which pays for itself only over a batch (and a mark per transaction must not double the rate
/// at which the cluster consumes xids).
const MIN_IDS: usize = 8;

/// Inserts every id in `ids` (sorted, distinct) with `expires_at`, or nothing. True if they were all inserted;
/// false if the call, the table or the transaction needs the executor, or some id already had a row — then
/// nothing was written.
pub fn insert_all(inbox: &Inbox, ids: &[String], expires_at: TimestampWithTimeZone) -> bool {
    if ids.len() < MIN_IDS || !subxact::has_room() {
        return false;
    }
    let rel = unsafe { pg_sys::table_open(inbox.relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) };
    let inserted = unsafe { only_the_row_matters(rel) }
        && subxact::undo_on(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, || {
            let mut scratch = PgMemoryContexts::new("dedup bulk insert");
            unsafe { scratch.switch_to(|_| write_rows(rel, inbox.ns, ids, expires_at)) };
        })
        .is_some();
    unsafe {
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        if inserted {
            // Later statements of this call (and of the transaction) must see the rows, as after any SQL insert.
            pg_sys::CommandCounterIncrement();
        }
    }
    inserted
}

/// Does writing a row need nothing but the two values and their index entries? The table must still be the
/// inbox row type exactly (its owner could have made it `NOT OF` and added columns with defaults), and the only
/// trigger allowed is our own filter trigger, whose work `write_rows` does itself.
unsafe fn only_the_row_matters(rel: pg_sys::Relation) -> bool {
    let form = &*(*rel).rd_rel;
    let desc = pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att);
    let column_is = |i: usize, name: &str, type_oid: pg_sys::Oid| {
        desc.get(i).is_some_and(|a| !a.attisdropped && a.atttypid == type_oid && a.name() == name)
    };
    let constr = (*(*rel).rd_att).constr;
    let triggers = (*rel).trigdesc;
    let only_ours = triggers.is_null() || ((*triggers).numtriggers == 1 && is_filter_trigger(&*(*triggers).triggers));
    form.relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
        && form.reloftype != pg_sys::InvalidOid
        && !form.relispartition
        && !form.relrowsecurity
        && desc.len() == 2
        && column_is(0, "id", pg_sys::TEXTOID)
        && column_is(1, "expires_at", pg_sys::TIMESTAMPTZOID)
        // No CHECK constraints, defaults or generated columns (none can be added to a typed table's own columns
        // but CHECK; the rest is belt and braces).
        && (constr.is_null() || ((*constr).num_check == 0 && (*constr).num_defval == 0 && !(*constr).has_generated_stored))
        && (*rel).rd_rules.is_null()
        && only_ours
}

/// Is this the `dedup_filter` trigger as created by `create_inbox()`: our function, firing always?
unsafe fn is_filter_trigger(t: &pg_sys::Trigger) -> bool {
    let function = pg_sys::get_func_name(t.tgfoid);
    !function.is_null()
        && std::ffi::CStr::from_ptr(function).to_bytes() == b"inbox_filter_trigger"
        && std::ffi::CStr::from_ptr(t.tgname).to_bytes() == b"dedup_filter"
        && t.tgenabled == pg_sys::TRIGGER_FIRES_ALWAYS as std::ffi::c_char
}

/// The filter bits, then one multi-insert into the heap, then each row's index entries (raising unique_violation
/// for an id that exists).
unsafe fn write_rows(rel: pg_sys::Relation, ns: u64, ids: &[String], expires_at: TimestampWithTimeZone) {
    // What the filter trigger does for the executor: the bits, before any row exists.
    filter::add(ns, ids);
    let estate = pg_sys::CreateExecutorState();
    let result_rel = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>()) as *mut pg_sys::ResultRelInfo;
    (*result_rel).type_ = pg_sys::NodeTag::T_ResultRelInfo;
    // Range-table index 0: there is no query, hence no range table.
    pg_sys::InitResultRelInfo(result_rel, rel, 0, std::ptr::null_mut(), 0);
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
