//! Reading and writing inbox rows straight through the heap and indexes, without SQL and the executor, where a
//! statement would spend most of its time on the statement itself (a plan started and ended, a snapshot, a
//! RETURNING row) rather than on the row:
//! - `insert`: ids the filter vouches for, into heap and indexes;
//! - `delete`: expired rows, found through the `expires_at` btree, for the purge;
//! - `lookup`: the row of one id, through the primary key, as a statement of this transaction would see it (or, for
//!   the claim this transaction just wrote, where it was written);
//! - `update`: a claim this transaction wrote, completed in place.
//!
//! Only tables whose `Shape` is `plain` qualify: the inbox row type exactly, and nothing the executor would have to
//! honour beyond the row itself (another trigger, a rule, row security, a CHECK constraint). Every other table is
//! left to the SQL statements of `inbox::Stmt`, which obey the same rules.

mod delete;
mod handle;
mod insert;
mod lookup;
mod update;

pub use delete::delete_expired;
pub use insert::{insert, insert_new};
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
fn text(s: &str) -> pg_sys::Datum {
    // SAFETY: copies the bytes into a new varlena.
    pg_sys::Datum::from(unsafe {
        pg_sys::cstring_to_text_with_len(s.as_ptr() as *const std::ffi::c_char, s.len() as i32)
    })
}

/// `n` empty slots for inbox rows. They share a private copy of the row type: the relation's own is
/// reference-counted, and a thousand slots pinning it through the resource owner cost more than the inserts.
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
    // SAFETY: the slot has the row type's six columns, so its value and null arrays have six entries.
    unsafe {
        pg_sys::ExecClearTuple(slot);
        *(*slot).tts_values.add(0) = text(id);
        *(*slot).tts_isnull.add(0) = false;
        for (i, (datum, null)) in values.datums.iter().zip(values.nulls).enumerate() {
            *(*slot).tts_values.add(i + 1) = *datum;
            *(*slot).tts_isnull.add(i + 1) = null;
        }
        pg_sys::ExecStoreVirtualTuple(slot);
    }
}
