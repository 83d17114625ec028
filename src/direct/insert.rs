//! Writing ids the filter vouches for straight into an inbox table's heap and indexes, instead of through
//! `INSERT ... ON CONFLICT` and the executor (and, the same way, the worker's rows of counts new to
//! `dedup.attempt_counts`: `insert_rows`).
//!
//! Why it pays: for an id the filter calls "certainly new" (or a suspect the lookup just failed to find), ON
//! CONFLICT's pre-check — a descent of the primary key in search of the id — finds nothing, and the executor
//! around the insert (a plan started and ended, a trigger call, a RETURNING row) does nothing the row needs. Two
//! ways, by size:
//! - a batch of `MIN_IDS` or more goes in with one multi-insert (one WAL record per heap page) and one index
//!   insertion per row, in a subtransaction. If any id exists after all (a concurrent claim of the same id, or a
//!   filter that was wrong), the unique index raises unique_violation — after waiting for an in-progress claim,
//!   like ON CONFLICT does — and the whole attempt is undone;
//! - otherwise (fewer ids, a failed batch, a transaction already holding many subtransactions) each id goes in
//!   with the speculative-insertion protocol that ON CONFLICT itself uses, minus the pre-check: the row carries a
//!   speculative token while its index entries go in, and if the unique index already holds the id (committed or
//!   in progress) the row is killed on the spot, before anyone could wait for it. No subtransaction, so no second
//!   transaction id.
//!
//! Either way the unique index stays the truth, and an id that did not go in is left to the caller's ordinary
//! path, whose pre-check waits for the other claim.

use super::handle::{self, Handle};
use super::{row_slots, store_row, Row, Values};
use crate::inbox::Inbox;
use crate::{filter, ports, unguarded, xact};
use pgrx::prelude::*;

/// Batches of this many ids or more try the multi-insert: its subtransaction costs a second transaction id,
/// which pays for itself only over a batch (and a mark per transaction must not double the rate at which the
/// cluster consumes xids).
const MIN_IDS: usize = 8;

/// Inserts what it can of `ids` (sorted, distinct) with the values of `row` and returns how many it inserted: the
/// ids inserted are that prefix of `ids`. Nothing was written for the others: the table needs the executor, or an
/// id had a row after all (and the ids after it were left alone; see `insert_each`).
pub fn insert(inbox: &Inbox, ids: &[&str], row: &Row) -> usize {
    if !inbox.shape().plain {
        return 0;
    }
    let values = Values::of(row);
    let write = |table: &Handle| {
        if ids.len() >= MIN_IDS && xact::has_room() && insert_all(table, inbox.ns, ids, &values) {
            ids.len()
        } else {
            // SAFETY: the table is open, with RowExclusiveLock, and its shape `plain`.
            let inserted = unsafe { insert_each(table, inbox.ns, ids, &values) };
            if let ([id], 1) = (ids, inserted) {
                // A later call of this transaction may read this id (complete() after claim(), a repeat of the key
                // in a COPY into an attached table). The slot still holds the row just inserted, and so where it
                // went.
                // SAFETY: the handle's slot, in use.
                table.remember(id, unsafe { (*table.slot).tts_tid });
            }
            inserted
        }
    };
    // SAFETY: the inbox was opened (and locked) by this transaction.
    unsafe { with_table(inbox.relid, write) }
}

/// Inserts all of `ids` (sorted, distinct, certainly new to the inbox as far as the caller knows; the table's shape
/// `plain`) with the values of `row`, in one multi-insert and without a subtransaction: an id that has a row after
/// all raises unique_violation (after waiting for a transaction still inserting it), and the caller's statement
/// fails with it. For the flush of a batched attachment (`attach::batch`), whose rows are already in.
pub fn insert_new(inbox: &Inbox, ids: &[&str], row: &Row) {
    let values = Values::of(row);
    // SAFETY: the inbox was opened (and locked) by this transaction, and (the caller vouches) its shape is `plain`.
    unsafe {
        with_table(inbox.relid, |table| {
            write_ids(table, inbox.ns, ids, &values);
            ids.len()
        })
    };
}

/// Inserts `n` rows into table `relid`, which is not an inbox's (`dedup.attempt_counts`), as `insert_new` does: one
/// multi-insert, then each row's index entries, unique_violation for a key that exists. `fill(i, slot)` puts the
/// i-th row into an empty slot of the table's row type, its values allocated in the current memory context.
///
/// # Safety
/// This transaction must hold RowExclusiveLock on the table, and writing a row of it must need nothing but the row
/// and its index entries (no trigger, rule, row security or constraint the rows could break: the caller vouches for
/// the table and the rows), the filter's keys excepted, which the caller adds.
pub unsafe fn insert_rows(relid: pg_sys::Oid, n: usize, fill: impl Fn(usize, *mut pg_sys::TupleTableSlot)) {
    // SAFETY: the caller vouches for the table and its lock.
    unsafe {
        with_table(relid, |table| {
            write_rows(table, n, fill);
            n
        })
    };
}

/// Runs `write` with the transaction's write handle on table `relid` (`handle`) and makes the rows it wrote (it
/// returns how many) visible to the rest of the transaction.
///
/// # Safety
/// This transaction must hold RowExclusiveLock on the table.
unsafe fn with_table(relid: pg_sys::Oid, write: impl FnOnce(&Handle) -> usize) -> usize {
    // SAFETY: the caller vouches for the lock; `write` returns a count.
    let written = unsafe { handle::with(relid, write) };
    if written > 0 {
        // Later statements of this call (and of the transaction) must see the rows, as after any SQL insert.
        // SAFETY: no preconditions.
        unsafe { pg_sys::CommandCounterIncrement() };
    }
    written
}

/// All of `ids` in one multi-insert, or (when one of them has a row) none.
fn insert_all(table: &Handle, ns: u64, ids: &[&str], values: &Values) -> bool {
    // SAFETY: `table` is the open, qualifying inbox table of `insert`.
    xact::undo_on(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, || unsafe { write_ids(table, ns, ids, values) }).is_some()
}

/// Each of `ids` (sorted) on its own, by speculative insertion, up to the first that has a row: returns how many
/// went in (a prefix of `ids`). It stops there because the caller's ordinary path then waits for that id's
/// concurrent claim: holding rows of greater ids meanwhile would break the sorted order in which every claim takes
/// its ids, and two claims could deadlock (one waiting here for the other's smaller id, the other in its batch
/// for one of ours).
///
/// # Safety
/// `table` must be a handle on an inbox table (locked with RowExclusiveLock) whose shape is `plain`.
unsafe fn insert_each(table: &Handle, ns: u64, ids: &[&str], values: &Values) -> usize {
    // SAFETY: the caller vouches for the handle.
    unsafe { table.inserting(|| ids.iter().take_while(|id| insert_one(table, ns, id, values)).count()) }
}

/// What `INSERT ... ON CONFLICT DO NOTHING` does for a row once its pre-check found nothing (ExecInsert in
/// nodeModifyTable.c): the row goes in under a speculative token, so a concurrent inserter of the same id waits
/// only for our decision; if the unique index reports a conflict the row is killed rather than confirmed.
///
/// # Safety
/// As for `insert_each`.
unsafe fn insert_one(table: &Handle, ns: u64, id: &str, values: &Values) -> bool {
    let Handle { rel, estate, result_rel, slot, .. } = *table;
    // SAFETY: the caller vouches for the handle; the speculative token is taken and released around the row's index
    // entries, as ExecInsert does.
    unsafe {
        store_row(slot, id, values);
        // Each run of calls under one guard (`unguarded`): they hold pointers and numbers only.
        let (xid, token) = unguarded::guarded(|pg| {
            let xid = pg.GetCurrentTransactionId();
            let token = pg.SpeculativeInsertionLockAcquire(xid);
            let cid = pg.GetCurrentCommandId(true);
            pg.table_tuple_insert_speculative(rel, slot, cid, 0, std::ptr::null_mut(), token);
            (xid, token)
        });
        let mut conflict = false;
        ports::ExecInsertIndexTuples(result_rel, slot, estate, Some(&mut conflict), ports::Entries::Inserted);
        unguarded::guarded(|pg| {
            pg.table_tuple_complete_speculative(rel, slot, token, !conflict);
            pg.SpeculativeInsertionLockRelease(xid);
        });
        if !conflict {
            // What the filter trigger does for the executor: the bits, once the row exists (a killed row needs none).
            filter::add(ns, &[id]);
        }
        !conflict
    }
}

/// The rows of `ids`, then their filter bits (a unique violation undoes the rows, and then no bits are needed).
///
/// # Safety
/// As for `insert_each`.
unsafe fn write_ids(table: &Handle, ns: u64, ids: &[&str], values: &Values) {
    // SAFETY: the caller vouches for the handle; each slot gets a row of the inbox row type.
    unsafe { write_rows(table, ids.len(), |i, slot| store_row(slot, ids[i], values)) };
    // What the filter trigger does for the executor: the bits, once the rows exist.
    filter::add(ns, ids);
}

/// One multi-insert of `n` rows into the heap (`fill` puts the i-th into its slot), then each row's index entries
/// (raising unique_violation for a key that exists).
///
/// # Safety
/// `table` must be a handle in use on a table locked with RowExclusiveLock whose rows need nothing of the executor.
unsafe fn write_rows(table: &Handle, n: usize, fill: impl Fn(usize, *mut pg_sys::TupleTableSlot)) {
    let Handle { rel, estate, result_rel, .. } = *table;
    // SAFETY: the caller vouches for the handle; the slots are made, filled and dropped here, in the handle's per-use
    // memory, and the table access method's multi_insert is called as COPY calls it.
    unsafe {
        let slots = row_slots(rel, n);
        for (i, &slot) in slots.iter().enumerate() {
            fill(i, slot);
        }
        let multi_insert = (*(*rel).rd_tableam).multi_insert.expect("every table access method can multi-insert");
        let cid = pg_sys::GetCurrentCommandId(true);
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            multi_insert(rel, slots.as_ptr() as *mut _, slots.len() as i32, cid, 0, std::ptr::null_mut())
        });
        table.inserting(|| {
            for &slot in &slots {
                ports::ExecInsertIndexTuples(result_rel, slot, estate, None, ports::Entries::Inserted);
                pg_sys::ExecDropSingleTupleTableSlot(slot);
            }
        });
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::inbox::{open, Access};
    use crate::testing::*;
    use pgrx::prelude::*;

    fn ids(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}{i:04}")).collect()
    }

    fn refs(ids: &[String]) -> Vec<&str> {
        ids.iter().map(String::as_str).collect()
    }

    #[pg_test]
    fn direct_insert_writes_rows_their_index_entries_and_filter_bits() {
        run("SELECT dedup.create_inbox('di_rows')");
        let inbox = open("di_rows", Access::Mark);
        let row = super::Row::mark(one::<TimestampWithTimeZone>("SELECT now() + interval '1 hour'"));
        let batch = ids("b", 20);
        assert_eq!(super::insert(&inbox, &refs(&batch), &row), batch.len(), "a batch goes in whole");
        assert_eq!(super::insert(&inbox, &["single"], &row), 1);
        assert_eq!(count("dedup.inbox_di_rows"), 21);
        run("SET LOCAL enable_seqscan = off");
        assert_eq!(count("dedup.inbox_di_rows WHERE id = 'b0007'"), 1, "the primary key has the row");
        let filter = inbox.filter().expect("trusted");
        assert!(filter.maybe(&batch).iter().all(|m| *m));
        assert!(filter.may_contain("single"));
    }

    #[pg_test]
    fn direct_insert_leaves_ids_that_have_a_row_to_the_caller() {
        run("SELECT dedup.create_inbox('di_conflict'); SELECT dedup.mark('b0005', NULL, 'di_conflict')");
        let inbox = open("di_conflict", Access::Mark);
        let row = super::Row::mark(one::<TimestampWithTimeZone>("SELECT now() + interval '1 hour'"));
        let batch = ids("b", 12);
        let inserted = super::insert(&inbox, &refs(&batch), &row);
        assert_eq!(inserted, 5, "the undone batch went in id by id, up to the one with a row");
        assert_eq!(count("dedup.inbox_di_conflict"), 6, "nothing after it: the caller takes those in order");
        assert_eq!(count("dedup.inbox_di_conflict WHERE id = 'b0005'"), 1);
        assert_eq!(
            column("SELECT * FROM dedup.mark_many((SELECT array_agg('b' || lpad(g::text, 4, '0')) FROM generate_series(0, 11) g), NULL, 'di_conflict')").len(),
            6,
            "the rest goes in the ordinary way"
        );
    }

    #[pg_test]
    fn direct_insert_refuses_a_table_that_needs_the_executor() {
        run("SELECT dedup.create_inbox('di_reshaped');
             ALTER TABLE dedup.inbox_di_reshaped NOT OF;
             ALTER TABLE dedup.inbox_di_reshaped ADD COLUMN note text DEFAULT 'default'");
        let inbox = open("di_reshaped", Access::Mark);
        assert!(!inbox.shape().plain);
        let row = super::Row::mark(one::<TimestampWithTimeZone>("SELECT now() + interval '1 hour'"));
        assert_eq!(super::insert(&inbox, &refs(&ids("x", 10)), &row), 0, "nothing written behind the executor's back");
        assert_eq!(column("SELECT * FROM dedup.mark_many(ARRAY['x1','x2'], NULL, 'di_reshaped')").len(), 2);
        assert_eq!(count("dedup.inbox_di_reshaped WHERE note = 'default'"), 2);
    }
}
