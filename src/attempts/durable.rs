//! One id's row of `dedup.attempt_counts`, read and deleted straight through its primary key: no SQL, so neither
//! `attempt()` nor `forget()` needs the extension owner's rights to reach the table (their callers' rights on the
//! inbox were checked), and both work inside a security-restricted operation. Read with the latest snapshot, not
//! the caller's: a count the worker wrote after a REPEATABLE READ transaction began is the one to go on from.

use super::store::Durable;
use crate::errors::internal;
use crate::{catalog, filter, ports, shmem};
use pgrx::prelude::*;

/// What a scan of the row found.
struct Found {
    tid: pg_sys::ItemPointerData,
    count: u32,
    first: i64,
    expires: i64,
}

/// `dedup.attempt_counts`.
fn table() -> pg_sys::Oid {
    let relid = catalog::attempt_counts();
    if relid == pg_sys::InvalidOid {
        internal("reading dedup.attempt_counts", "it is missing");
    }
    relid
}

/// Runs `f` over the row of (`inbox`, `id`) of table `relid` (`table()`), if there is one, with the table open in
/// `lock` mode.
fn with_row<R>(
    relid: pg_sys::Oid,
    inbox: &str,
    id: &str,
    lock: u32,
    f: impl FnOnce(pg_sys::Relation, Option<Found>) -> R,
) -> R {
    let text = |s: &str| {
        // SAFETY: copies the bytes into a new varlena in the current memory context.
        pg_sys::Datum::from(unsafe {
            pg_sys::cstring_to_text_with_len(s.as_ptr() as *const std::ffi::c_char, s.len() as i32)
        })
    };
    // SAFETY: the table and its primary key are opened and locked here (the locks kept until the transaction ends),
    // scanned with a registered snapshot, and closed before returning; the values are copied out of the slot before it
    // is dropped.
    unsafe {
        let rel = pg_sys::table_open(relid, lock as pg_sys::LOCKMODE);
        let index = pg_sys::index_open(ports::primary_key_index(rel), pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let scan = ports::index_beginscan(rel, index, snapshot, 2);
        let mut keys = [pg_sys::ScanKeyData::default(), pg_sys::ScanKeyData::default()];
        // The primary key's columns: (id, inbox).
        for (i, value) in [id, inbox].into_iter().enumerate() {
            pg_sys::ScanKeyInit(
                &mut keys[i],
                i as pg_sys::AttrNumber + 1,
                pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                text(value),
            );
            keys[i].sk_collation = *(*index).rd_indcollation.add(i);
        }
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let found = pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot).then(|| {
            let column = |attnum: i32| {
                let mut null = false;
                let datum = pg_sys::slot_getattr(slot, attnum, &mut null);
                (!null).then_some(datum)
            };
            Found {
                tid: (*slot).tts_tid,
                // A count the table should not hold (its CHECK dropped, the row edited) is no count.
                count: column(3).map_or(0, |d| (d.value() as i32).max(0) as u32),
                first: column(4).map_or(0, |d| d.value() as i64),
                expires: column(6).map_or(0, |d| d.value() as i64),
            }
        });
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        let result = f(rel, found);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        result
    }
}

/// Has the worker certainly never written a row of `id` in `inbox`? The filter, which holds the key of every row of
/// the table (`trigger::Key::InboxAndId`), says so of a new id, without a read of the table.
pub fn certainly_none(inbox: &str, id: &str) -> bool {
    let filter = filter::Trusted::for_inbox(shmem::namespace(table()));
    filter.is_some_and(|f| !f.may_contain_key(&filter::attempt_key(inbox.as_bytes(), id.as_bytes())))
}

/// The row of `id` in `inbox` as the worker last wrote it (None: none; a count that lapsed before `now` is 0), read
/// from the table (ask `certainly_none` first).
pub fn read(inbox: &str, id: &str, now: i64) -> Option<Durable> {
    with_row(table(), inbox, id, pg_sys::AccessShareLock, |_, found| {
        found.map(|f| match f.expires > now && f.count > 0 {
            true => Durable { count: f.count, first: f.first },
            false => Durable { count: 0, first: now },
        })
    })
}

/// Deletes the row of `id` in `inbox` in the current transaction (`forget()`), waiting for a worker's write of the
/// same row to finish, and deleting what it wrote.
pub fn delete(inbox: &str, id: &str) {
    for _ in 0..crate::mark::MAX_ROUNDS {
        let done = with_row(table(), inbox, id, pg_sys::RowExclusiveLock, |rel, found| {
            let Some(mut found) = found else { return true };
            // SAFETY: the table is open and locked for writing; the delete goes through its access method, which
            // waits for a transaction holding the row and says what became of it.
            unsafe {
                let delete = (*(*rel).rd_tableam).tuple_delete.expect("every table access method deletes");
                let mut failure = pg_sys::TM_FailureData::default();
                let cid = pg_sys::GetCurrentCommandId(true);
                let snapshot = pg_sys::GetLatestSnapshot();
                let result = pg_sys::ffi::pg_guard_ffi_boundary(|| {
                    delete(rel, &mut found.tid, cid, snapshot, std::ptr::null_mut(), true, &mut failure, false)
                });
                pg_sys::CommandCounterIncrement();
                // Updated meanwhile (the worker wrote a newer count): look again, and delete that.
                result != pg_sys::TM_Result::TM_Updated
            }
        });
        if done {
            return;
        }
    }
    internal("deleting a count of attempts", "it kept being rewritten")
}
