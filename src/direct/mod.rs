//! Reading and writing inbox rows straight through the heap and indexes, without SQL and the executor, where a
//! statement would spend most of its time on the statement itself (a plan started and ended, a snapshot, a
//! RETURNING row) rather than on the row:
//! - `insert`: ids the filter vouches for, into heap and indexes (and, for the worker, counts of delivery attempts
//!   new to `dedup.attempt_counts`: `insert_rows`);
//! - `delete`: expired rows, found through the `expires_at` btree, for the purge;
//! - `lookup`: the row of one id, through the primary key, as a statement of this transaction would see it (or, for
//!   the claim this transaction just wrote, where it was written);
//! - `update`: a claim this transaction wrote, completed in place.
//!
//! Only inbox tables whose `Shape` is `plain` qualify: the inbox row type exactly, and nothing the executor would have
//! to honour beyond the row itself (another trigger, a rule, row security, a CHECK constraint). Every other table is
//! left to the SQL statements of `inbox::Stmt`, which obey the same rules. `dedup.attempt_counts` qualifies on the same
//! terms (`needs_only_rows`, from `attempts::durable`), its one CHECK constraint kept by the counts the worker writes.

mod delete;
mod handle;
mod insert;
mod lookup;
mod update;

pub use delete::{delete_expired, Deleted, Gone};
pub use insert::{insert, insert_new, insert_rows};
pub use lookup::{find_each, find_one, own_row, readable, Found};
pub use update::complete_own;

use crate::jsonb::Jsonb;
use pgrx::prelude::*;

/// What goes into the row beside its id: the window, and for a claim (`idempotency`) its fingerprint, result,
/// lease and completion state (a mark leaves them NULL).
#[derive(Clone, Copy)]
pub struct Row<'a> {
    pub expires_at: TimestampWithTimeZone,
    pub fingerprint: Option<&'a str>,
    pub result: Option<Jsonb>,
    pub lease_until: Option<TimestampWithTimeZone>,
    pub completed: Option<bool>,
}

impl Row<'_> {
    /// A plain mark's row.
    pub fn mark(expires_at: TimestampWithTimeZone) -> Row<'static> {
        Row { expires_at, fingerprint: None, result: None, lease_until: None, completed: None }
    }
}

/// Does writing a row of `rel` need nothing but the row and its index entries, so that a direct write (which adds
/// the filter's keys itself) may skip the executor? An ordinary table, not a partition, whose columns are `columns`
/// (name, type) exactly, none dropped; no CHECK constraint but those `kept` accepts (which the writer's rows keep), no
/// default or generated column; no rule, no row security; no trigger but the guarding filter trigger.
///
/// # Safety
/// `rel` must be an open relation.
pub unsafe fn needs_only_rows(
    rel: pg_sys::Relation,
    columns: &[(&str, pg_sys::Oid)],
    kept: impl Fn(&pg_sys::ConstrCheck) -> bool,
) -> bool {
    // SAFETY: the caller vouches for the relation; its pg_class row, tuple descriptor, constraints, rules and triggers
    // are only read.
    unsafe {
        let form = &*(*rel).rd_rel;
        let desc = pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att);
        let columns_as_made = desc.len() == columns.len()
            && columns.iter().enumerate().all(|(i, (name, type_oid))| column_is(&desc, i, name, *type_oid));
        let constr = (*(*rel).rd_att).constr;
        let constraints_kept = constr.is_null() || {
            // (`check` may be NULL when there are none.)
            (0..(*constr).num_check as usize).all(|i| kept(&*(*constr).check.add(i)))
                && (*constr).num_defval == 0
                && !(*constr).has_generated_stored
        };
        let triggers = (*rel).trigdesc;
        let only_ours =
            triggers.is_null() || ((*triggers).numtriggers == 1 && crate::trigger::is_guarding(&*(*triggers).triggers));
        columns_as_made
            && constraints_kept
            && only_ours
            && form.relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
            && !form.relispartition
            && !form.relrowsecurity
            && (*rel).rd_rules.is_null()
    }
}

/// Is column `i` (from 0) of `desc` one of type `type_oid` named `name`, not dropped?
pub fn column_is(desc: &pgrx::PgTupleDesc, i: usize, name: &str, type_oid: pg_sys::Oid) -> bool {
    desc.get(i).is_some_and(|a| !a.attisdropped && a.atttypid == type_oid && a.name() == name)
}

/// The values of a row but its id, as datums (the fingerprint's text is allocated in the current memory context).
struct Values {
    datums: [pg_sys::Datum; 5],
    nulls: [bool; 5],
}

impl Values {
    fn of(row: &Row) -> Values {
        let values = [
            row.expires_at.into_datum(),
            row.fingerprint.map(text),
            row.result.map(|r| r.datum()),
            row.lease_until.and_then(|t| t.into_datum()),
            row.completed.and_then(|c| c.into_datum()),
        ];
        Values { datums: values.map(|v| v.unwrap_or(pg_sys::Datum::from(0))), nulls: values.map(|v| v.is_none()) }
    }
}

/// `s` as a text datum, allocated in the current memory context.
pub fn text(s: &str) -> pg_sys::Datum {
    // SAFETY: copies the bytes into a new varlena.
    pg_sys::Datum::from(unsafe {
        pg_sys::cstring_to_text_with_len(s.as_ptr() as *const std::ffi::c_char, s.len() as i32)
    })
}

/// `n` empty slots for rows of `rel` (an inbox's, or `dedup.attempt_counts`'s). They share a private copy of the row
/// type: the relation's own is reference-counted, and a thousand slots pinning it through the resource owner cost
/// more than the inserts.
///
/// # Safety
/// `rel` must be open; the slots live in the current memory context and must be dropped before it goes.
unsafe fn row_slots(rel: pg_sys::Relation, n: usize) -> Vec<*mut pg_sys::TupleTableSlot> {
    // SAFETY: the caller vouches for the relation.
    unsafe {
        let desc = pg_sys::CreateTupleDescCopy((*rel).rd_att);
        (0..n).map(|_| pg_sys::MakeSingleTupleTableSlot(desc, pg_sys::table_slot_callbacks(rel))).collect()
    }
}

/// Makes `slot` hold the row of `id` with `values`.
///
/// # Safety
/// `slot` must be a slot of the inbox row type (from `row_slots`).
unsafe fn store_row(slot: *mut pg_sys::TupleTableSlot, id: &str, values: &Values) {
    let columns = std::iter::once((text(id), false)).chain(values.datums.into_iter().zip(values.nulls));
    // SAFETY: the caller vouches for the slot; the inbox row type has six columns.
    unsafe { store_values(slot, columns) };
}

/// Makes `slot` hold a row of the column values `columns` (datum, is it NULL), in order.
///
/// # Safety
/// `slot` must be a slot made by `row_slots`, of a row type with as many columns as `columns` yields.
pub unsafe fn store_values(slot: *mut pg_sys::TupleTableSlot, columns: impl Iterator<Item = (pg_sys::Datum, bool)>) {
    // SAFETY: the caller vouches that the slot's value and null arrays have an entry for each column.
    unsafe {
        pg_sys::ExecClearTuple(slot);
        for (i, (datum, null)) in columns.enumerate() {
            *(*slot).tts_values.add(i) = datum;
            *(*slot).tts_isnull.add(i) = null;
        }
        pg_sys::ExecStoreVirtualTuple(slot);
    }
}
