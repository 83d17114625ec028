//! The row of one id, read through the primary key with an index scan of our own: what
//! `SELECT ... WHERE id = $1` through SPI would return, without parsing, planning or running a statement.
//!
//! It sees what a statement of this transaction would see: a fresh snapshot under READ COMMITTED (the
//! transaction's own under REPEATABLE READ and SERIALIZABLE), this transaction's own rows included. A row another
//! transaction is inserting is invisible, as it is to a SELECT: whoever must wait for it (an insert that may not
//! go ahead) still goes through the unique index.

use crate::inbox::Inbox;
use crate::jsonb::Jsonb;
use crate::ports;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;

/// The row of a key, as this transaction sees it now.
pub struct Found {
    /// Where this version of the row is, for `complete_own` (None when read through SQL).
    pub tid: Option<pg_sys::ItemPointerData>,
    pub expires_at: TimestampWithTimeZone,
    pub fingerprint: Option<String>,
    /// A copy in the caller's memory context.
    pub result: Option<Jsonb>,
    pub lease_until: Option<TimestampWithTimeZone>,
    pub completed: Option<bool>,
    /// Written by this transaction (or one of its subtransactions): its claim, not committed yet.
    pub mine: bool,
}

/// May `inbox` (opened by this transaction) be read directly? Its shape must be `plain` (row security, say, would
/// have to be applied by the executor) with its primary key in place.
pub fn readable(inbox: &Inbox) -> bool {
    inbox.shape().plain && inbox.shape().pkey != pg_sys::InvalidOid
}

/// The row of each of `ids`, in order, read with one snapshot.
pub fn find_each(inbox: &Inbox, ids: &[&str]) -> Vec<Option<Found>> {
    assert!(readable(inbox), "direct lookup of an inbox that needs the executor");
    // The scan, its keys and whatever the index allocates go into a context of their own, gone when this returns
    // (a `mark_many()` of a million duplicates looks up ten thousand ids at a time); the rows found are copied
    // into the caller's.
    let mut scratch = PgMemoryContexts::new("dedup lookup");
    // SAFETY: the table was opened and locked by this transaction (`inbox::open`); the index is locked here. Every
    // pointer below lives until the matching end/close/drop, all before returning; the values copied out of the
    // slot are copied before the slot lets go of its buffer.
    unsafe {
        let caller = pg_sys::CurrentMemoryContext;
        scratch.switch_to(|_| {
            // What SPI does before a statement: this transaction's own changes so far become visible (a no-op
            // when there are none), and a snapshot is taken (a fresh one under READ COMMITTED).
            pg_sys::CommandCounterIncrement();
            let rel = pg_sys::table_open(inbox.relid, pg_sys::NoLock as pg_sys::LOCKMODE);
            let index = pg_sys::index_open(inbox.shape().pkey, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
            let scan = ports::index_beginscan(rel, index, snapshot, 1);
            let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
            let found = ids
                .iter()
                .map(|id| {
                    let mut key = pg_sys::ScanKeyData::default();
                    pg_sys::ScanKeyInit(
                        &mut key,
                        1,
                        pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
                        pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                        super::text(id),
                    );
                    key.sk_collation = *(*index).rd_indcollation;
                    pg_sys::index_rescan(scan, &mut key, 1, std::ptr::null_mut(), 0);
                    pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot).then(|| {
                        let scratch = pg_sys::MemoryContextSwitchTo(caller);
                        let row = read(slot);
                        pg_sys::MemoryContextSwitchTo(scratch);
                        row
                    })
                })
                .collect();
            pg_sys::ExecDropSingleTupleTableSlot(slot);
            pg_sys::index_endscan(scan);
            pg_sys::UnregisterSnapshot(snapshot);
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            found
        })
    }
}

/// The row `slot` holds, copied out of it.
///
/// # Safety
/// `slot` must hold a row of an inbox table of `plain` shape, read from the heap.
unsafe fn read(slot: *mut pg_sys::TupleTableSlot) -> Found {
    // SAFETY: the caller vouches for the slot; attribute numbers 2..6 are the row type's columns.
    unsafe {
        let column = |attnum: i32| {
            let mut null = false;
            let datum = pg_sys::slot_getattr(slot, attnum, &mut null);
            (!null).then_some(datum)
        };
        let mut null = false;
        let getsysattr = (*(*slot).tts_ops).getsysattr.expect("a heap slot has system columns");
        let xmin =
            pg_sys::ffi::pg_guard_ffi_boundary(|| getsysattr(slot, pg_sys::MinTransactionIdAttributeNumber, &mut null));
        Found {
            tid: Some((*slot).tts_tid),
            expires_at: column(2).and_then(|d| TimestampWithTimeZone::from_datum(d, false)).expect("NOT NULL"),
            fingerprint: column(3).and_then(|d| String::from_datum(d, false)),
            // A detoasted copy: the slot's value points into a shared buffer.
            result: column(4).map(|d| Jsonb::copy_of(d)),
            lease_until: column(5).and_then(|d| TimestampWithTimeZone::from_datum(d, false)),
            completed: column(6).map(|d| d.value() != 0),
            mine: pg_sys::TransactionIdIsCurrentTransactionId(pg_sys::TransactionId::from(xmin.value() as u32)),
        }
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::inbox::{open, Access};
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn direct_lookup_sees_what_a_statement_of_this_transaction_sees() {
        run("SELECT dedup.create_inbox('dl_seen');
             INSERT INTO dedup.inbox_dl_seen (id, expires_at) VALUES ('old', now() - interval '1 hour');
             SELECT dedup.claim('mine', 'fp', inbox => 'dl_seen')");
        let inbox = open("dl_seen", Access::Mark);
        let found = super::find_each(&inbox, &["mine", "old", "none"]);
        let mine = found[0].as_ref().expect("this transaction's own claim");
        assert!(mine.mine && mine.completed == Some(false) && mine.fingerprint.as_deref() == Some("fp"));
        let old = found[1].as_ref().expect("an expired row is still a row");
        assert!(old.expires_at < one::<TimestampWithTimeZone>("SELECT now()"));
        assert!(old.completed.is_none() && old.fingerprint.is_none() && old.result.is_none(), "a mark's row");
        assert!(found[2].is_none());
        // A change made by SQL a moment ago is seen at once, as by the next statement.
        run("DELETE FROM dedup.inbox_dl_seen WHERE id = 'mine'");
        assert!(super::find_each(&inbox, &["mine"])[0].is_none());
    }
}
