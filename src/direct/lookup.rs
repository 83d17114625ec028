//! The row of one id, read through the primary key with an index scan of our own: what
//! `SELECT ... WHERE id = $1` through SPI would return, without parsing, planning or running a statement.
//!
//! It sees what a statement of this transaction would see: a fresh snapshot under READ COMMITTED (the
//! transaction's own under REPEATABLE READ and SERIALIZABLE), this transaction's own rows included. A row another
//! transaction is inserting is invisible, as it is to a SELECT: whoever must wait for it (an insert that may not
//! go ahead) still goes through the unique index.

use crate::inbox::Inbox;
use crate::jsonb::Jsonb;
use crate::{ports, unguarded};
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
    /// A claim in progress (`completed` false) written by this transaction (or one of its subtransactions): its
    /// claim, not committed yet. Read directly, it is looked up only for claims in progress (false for any other
    /// row), the only rows whose writer anything asks about.
    pub mine: bool,
}

/// May `inbox` (opened by this transaction) be read directly? Its shape must be `plain` (row security, say, would
/// have to be applied by the executor) with its primary key in place.
pub fn readable(inbox: &Inbox) -> bool {
    inbox.shape().plain && inbox.shape().pkey != pg_sys::InvalidOid
}

/// The row of `id`: `find_each` of one id (a single mark, claim or seen), without the list.
pub fn find_one(inbox: &Inbox, id: &str) -> Option<Found> {
    assert!(readable(inbox), "direct lookup of an inbox that needs the executor");
    // SAFETY: as `with_scan` requires, the inbox is readable and was opened by this transaction. The scan, slot and
    // snapshot are freed again as they end, and what stays behind (a scan key, a few hundred bytes) goes with the
    // caller's context: a context of its own would cost a tenth of a duplicate mark's work (callgrind).
    unsafe { with_scan(inbox, pg_sys::CurrentMemoryContext, |scan| scan.one(id)) }
}

/// The row of `id` that this transaction wrote last through the inbox's write handle (`Handle::remember`), read at
/// the place it was written instead of through the primary key: `complete()` in the claim's own transaction, its
/// usual case, and a key repeated further on in a COPY into an attached table skip a descent and an index scan's
/// set-up. It is read under a fresh snapshot as `find_one` would read it, so a version that a later statement of
/// the transaction changed or deleted is invisible there, and the caller looks the id up as usual (None); so is
/// anything else (no place remembered, another id's row there).
pub fn own_row(inbox: &Inbox, id: &str) -> Option<Found> {
    if !readable(inbox) {
        return None;
    }
    let mut tid = super::handle::written_at(inbox.relid, id)?;
    // SAFETY: `pg_sys::CurrentMemoryContext` is the caller's, live after this returns.
    let caller = unsafe { pg_sys::CurrentMemoryContext };
    // SAFETY: the inbox was opened and locked by this transaction. The remembered place is in the table the handle
    // has open (a TRUNCATE or any rewrite invalidates the table and so drops the handle with what it remembered),
    // and holds a row this very transaction inserted: never dead while the transaction runs unless a subtransaction
    // that inserted it rolled back, which forgets the place (so no VACUUM or pruning can have freed it or given it
    // to another row). The snapshot is registered for the fetch only; the row is copied into the caller's memory
    // context before the slot lets go of its buffer.
    unsafe {
        // First, so that invalidations it processes (the transaction's own DDL) are seen by `with_held`'s check.
        pg_sys::CommandCounterIncrement();
        super::handle::with_held(inbox.relid, |table| {
            // One guard for the fetch (`unguarded`): pointers only.
            let (rel, slot, tid) = (table.rel, table.slot, &mut tid);
            let visible = unguarded::guarded(|pg| {
                let snapshot = pg.RegisterSnapshot(pg.GetTransactionSnapshot());
                let visible = pg.table_tuple_fetch_row_version(rel, tid, snapshot, slot);
                pg.UnregisterSnapshot(snapshot);
                visible
            });
            // The place holds this id's row, or another id's of the same hash: checked.
            if !visible || entry_id(table.slot) != id.as_bytes() {
                return None;
            }
            let scratch = pg_sys::MemoryContextSwitchTo(caller);
            let row = read(table.slot);
            pg_sys::MemoryContextSwitchTo(scratch);
            Some(row)
        })
        .flatten()
    }
}

/// The id of the inbox row `slot` holds, as bytes.
///
/// # Safety
/// `slot` must hold a row of an inbox table of `plain` shape; the bytes live as long as the slot holds it.
unsafe fn entry_id<'a>(slot: *mut pg_sys::TupleTableSlot) -> &'a [u8] {
    // SAFETY: the caller vouches for the slot; id is the first column, NOT NULL.
    unsafe {
        pg_sys::slot_getsomeattrs(slot, 1);
        text_bytes(*(*slot).tts_values)
    }
}

/// The bytes of a text datum (detoasted if it was stored compressed).
///
/// # Safety
/// `datum` must be a non-NULL text datum; the bytes live as long as it does (or, when it was compressed, as long as
/// the current memory context).
unsafe fn text_bytes<'a>(datum: pg_sys::Datum) -> &'a [u8] {
    // SAFETY: the caller vouches for the datum.
    unsafe {
        let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
        std::slice::from_raw_parts(
            pgrx::varlena::vardata_any(text) as *const u8,
            pgrx::varlena::varsize_any_exhdr(text),
        )
    }
}

/// The row of each of `ids`, in order, read with one snapshot.
///
/// Ids in ascending byte order (what `mark()`'s algorithm probes) are found by walking the index forward from the
/// first (`walk`), which reads the leaf pages they are on once instead of descending from the root for each id;
/// any other list is looked up id by id.
pub fn find_each(inbox: &Inbox, ids: &[&str]) -> Vec<Option<Found>> {
    assert!(readable(inbox), "direct lookup of an inbox that needs the executor");
    // SAFETY: as `with_scan` requires. The scan, its keys and whatever the index allocates go into a context of
    // their own, gone when this returns (a `mark_many()` of a million duplicates looks up ten thousand ids at a
    // time); the rows found are copied into the caller's.
    unsafe {
        let caller = pg_sys::CurrentMemoryContext;
        PgMemoryContexts::new("dedup lookup").switch_to(|_| with_scan(inbox, caller, |scan| scan.each(ids)))
    }
}

/// An equality scan of an inbox's primary key under one snapshot, with the slot its rows are read into.
struct Scan {
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    slot: *mut pg_sys::TupleTableSlot,
    scan: pg_sys::IndexScanDesc,
    /// Where the rows found are copied to.
    caller: pg_sys::MemoryContext,
}

/// Runs `f` with a `Scan` of `inbox`, ended again before returning.
///
/// # Safety
/// `inbox` must be `readable`, opened and locked by this transaction; `caller` a live memory context.
unsafe fn with_scan<R>(inbox: &Inbox, caller: pg_sys::MemoryContext, f: impl FnOnce(&Scan) -> R) -> R {
    // SAFETY: the table was opened and locked by this transaction (`inbox::open`); the index is locked here. Every
    // pointer lives until the matching end/close/drop, all before returning.
    unsafe {
        // Set up and torn down each under one guard (`unguarded`): the closures hold pointers and numbers only.
        let (relid, pkey) = (inbox.relid, inbox.shape().pkey);
        let (rel, index, snapshot, slot) = unguarded::guarded(|pg| {
            // What SPI does before a statement: this transaction's own changes so far become visible (a no-op
            // when there are none), and a snapshot is taken (a fresh one under READ COMMITTED).
            pg.CommandCounterIncrement();
            let rel = pg.table_open(relid, pg_sys::NoLock as pg_sys::LOCKMODE);
            let index = pg.index_open(pkey, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let snapshot = pg.RegisterSnapshot(pg.GetTransactionSnapshot());
            (rel, index, snapshot, pg.table_slot_create(rel, std::ptr::null_mut()))
        });
        let scan = ports::index_beginscan(rel, index, snapshot, 1);
        let found = f(&Scan { rel, index, snapshot, slot, scan, caller });
        unguarded::guarded(|pg| {
            pg.ExecDropSingleTupleTableSlot(slot);
            pg.index_endscan(scan);
            pg.UnregisterSnapshot(snapshot);
            pg.index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            pg.table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        });
        found
    }
}

impl Scan {
    /// The visible row the slot holds, copied into the caller's memory context (before the slot lets go of its
    /// buffer).
    fn copy(&self) -> Found {
        // SAFETY: the slot holds a row just fetched; both contexts are live.
        unsafe {
            let scratch = pg_sys::MemoryContextSwitchTo(self.caller);
            let row = read(self.slot);
            pg_sys::MemoryContextSwitchTo(scratch);
            row
        }
    }

    /// The row of `id`: one descent.
    fn one(&self, id: &str) -> Option<Found> {
        // SAFETY: the scan is open on the primary key (one text column) under the registered snapshot.
        unsafe {
            let mut key = scan_key(self.index, pg_sys::BTEqualStrategyNumber, pg_sys::F_TEXTEQ, id);
            pg_sys::index_rescan(self.scan, &mut key, 1, std::ptr::null_mut(), 0);
            pg_sys::index_getnext_slot(self.scan, pg_sys::ScanDirection::ForwardScanDirection, self.slot)
                .then(|| self.copy())
        }
    }

    /// The rows of `ids`, in order: walked where they are ascending, else one by one.
    fn each(&self, ids: &[&str]) -> Vec<Option<Found>> {
        // SAFETY: as for `one`; the range scan ends before returning.
        unsafe {
            // Byte order is the index's order only under the "C" collation (every inbox's; checked all the same).
            let walkable = *(*self.index).rd_indcollation == pg_sys::C_COLLATION_OID
                && ids.len() > 1
                && ids.windows(2).all(|pair| pair[0].as_bytes() < pair[1].as_bytes());
            if !walkable {
                return ids.iter().map(|id| self.one(id)).collect();
            }
            let range = ports::index_beginscan(self.rel, self.index, self.snapshot, 2);
            let found = walk(range, self.slot, ids, || self.copy(), |id| self.one(id));
            pg_sys::index_endscan(range);
            found
        }
    }
}

/// Index entries a range scan steps over without meeting a wanted id before it gives up and descends again:
/// stepping over an entry costs a comparison, a descent from the root a few dozen and a buffer lookup per level.
const MAX_SKIPPED: usize = 16;
/// The most ids one range scan covers.
const MAX_WINDOW: usize = 1024;
/// Ids looked up one by one after a range scan gave up: four times as many each time one gives up again, up to
/// `MAX_BACKOFF` (a range scan that gives up has read a leaf page or two for nothing: over a thousand random ids
/// that happens about five times).
const FIRST_BACKOFF: usize = 4;
const MAX_BACKOFF: usize = 1024;

/// The rows of `ids` (ascending in byte order, the "C" collation's), found by range scans over the index that each
/// cover a window of consecutive ids: `id >= first AND id <= last`, read forward, each entry's key compared with
/// the wanted ids (an index-only read of the key) and the heap visited only for entries of a wanted id. Ids that
/// sit close together in the index (a redelivered batch of consecutive ids) are found in one pass over their leaf
/// pages. Ids spread over the index (random UUIDs) make a range scan step over entries nobody wants: past
/// `MAX_SKIPPED` of them it gives up, and the ids after it are looked up one by one by `one` (an equality scan: a
/// descent each), for four times as many ids each time a range scan gives up, before a window is tried again.
///
/// # Safety
/// `scan` must be a scan begun with two keys on the primary key of the table `slot` is made for, under a
/// registered snapshot; `copy` copies the visible row `slot` holds; `one` looks up one id under the same snapshot.
unsafe fn walk(
    scan: pg_sys::IndexScanDesc,
    slot: *mut pg_sys::TupleTableSlot,
    ids: &[&str],
    copy: impl Fn() -> Found,
    one: impl Fn(&str) -> Option<Found>,
) -> Vec<Option<Found>> {
    // SAFETY: the caller vouches for the scan and the slot; an entry's key is read while the scan holds it.
    unsafe {
        // The scan hands back each entry's key (btree can: it is what an index-only scan reads).
        (*scan).xs_want_itup = true;
        let index = (*scan).indexRelation;
        let mut found: Vec<Option<Found>> = ids.iter().map(|_| None).collect();
        let mut next = 0; // the first id not settled
        let mut window = 2;
        let (mut backoff, mut singles) = (0usize, 0usize);
        while next < ids.len() {
            if singles > 0 {
                found[next] = one(ids[next]);
                next += 1;
                singles -= 1;
                continue;
            }
            let last = (next + window).min(ids.len()) - 1;
            let mut keys = [
                scan_key(index, pg_sys::BTGreaterEqualStrategyNumber, pg_sys::F_TEXT_GE, ids[next]),
                scan_key(index, pg_sys::BTLessEqualStrategyNumber, pg_sys::F_TEXT_LE, ids[last]),
            ];
            pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
            let mut skipped = 0;
            let mut gave_up = false;
            while !pg_sys::index_getnext_tid(scan, pg_sys::ScanDirection::ForwardScanDirection).is_null() {
                let key = entry_key(scan);
                // Every entry is within [ids[next], ids[last]]: ids before this key have no entry.
                while next < last && ids[next].as_bytes() < key {
                    next += 1;
                }
                if ids[next].as_bytes() == key {
                    skipped = 0;
                    // One entry per version of the row: the first visible one is the row.
                    if found[next].is_none() && pg_sys::index_fetch_heap(scan, slot) {
                        found[next] = Some(copy());
                        if next == last {
                            // Nothing more is wanted: reading on would only find the range's end (on the next
                            // leaf page, when this entry was its page's last).
                            break;
                        }
                    }
                } else {
                    skipped += 1;
                    if skipped > MAX_SKIPPED {
                        gave_up = true;
                        break;
                    }
                }
            }
            if gave_up {
                // `next` and what follows are not settled; the scan resumes at `next`.
                backoff = (backoff * 4).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                singles = backoff;
                window = 2;
            } else {
                next = last + 1;
                window = (window * 2).min(MAX_WINDOW);
                backoff = 0;
            }
        }
        found
    }
}

/// The key of the index entry `scan` returned last, as bytes.
///
/// # Safety
/// `scan` must be an index scan of a one-column text index, begun with `xs_want_itup`, that just returned an entry;
/// the bytes live until the next entry (or until the scan's memory goes, when the key was compressed).
unsafe fn entry_key<'a>(scan: pg_sys::IndexScanDesc) -> &'a [u8] {
    // SAFETY: the caller vouches for the scan; the primary key's column is never NULL.
    unsafe {
        // A long id may be stored compressed in the index.
        text_bytes(pg_sys::nocache_index_getattr((*scan).xs_itup, 1, (*scan).xs_itupdesc))
    }
}

/// A scan key on the index's one column: `column <strategy> id`, under the index's collation.
///
/// # Safety
/// `index` must be an open index on one text column; `procedure` the operator's function for `strategy`.
unsafe fn scan_key(index: pg_sys::Relation, strategy: u32, procedure: u32, id: &str) -> pg_sys::ScanKeyData {
    let mut key = pg_sys::ScanKeyData::default();
    // SAFETY: the caller vouches for the index.
    unsafe {
        pg_sys::ScanKeyInit(
            &mut key,
            1,
            strategy as pg_sys::StrategyNumber,
            pg_sys::Oid::from(procedure),
            super::text(id),
        );
        key.sk_collation = *(*index).rd_indcollation;
    }
    key
}

/// The row `slot` holds, copied out of it.
///
/// # Safety
/// `slot` must hold a row of an inbox table of `plain` shape, read from the heap.
unsafe fn read(slot: *mut pg_sys::TupleTableSlot) -> Found {
    // SAFETY: the caller vouches for the slot; attribute numbers 2..6 are the row type's columns.
    unsafe {
        // Every column deformed at once: one call into Postgres rather than one per column.
        pg_sys::slot_getsomeattrs(slot, crate::inbox::COLUMNS.len() as i32);
        let column = |attnum: usize| {
            let i = attnum - 1;
            (!*(*slot).tts_isnull.add(i)).then(|| *(*slot).tts_values.add(i))
        };
        let completed = column(6).map(|d| d.value() != 0);
        // Who wrote the row matters only for a claim in progress (see `Found::mine`); asking costs two calls into
        // Postgres, a duplicate mark's largest avoidable share after the lookup itself.
        let mine = completed == Some(false) && {
            let mut null = false;
            let getsysattr = (*(*slot).tts_ops).getsysattr.expect("a heap slot has system columns");
            let xmin = pg_sys::ffi::pg_guard_ffi_boundary(|| {
                getsysattr(slot, pg_sys::MinTransactionIdAttributeNumber, &mut null)
            });
            pg_sys::TransactionIdIsCurrentTransactionId(pg_sys::TransactionId::from(xmin.value() as u32))
        };
        Found {
            tid: Some((*slot).tts_tid),
            expires_at: column(2).and_then(|d| TimestampWithTimeZone::from_datum(d, false)).expect("NOT NULL"),
            fingerprint: column(3).and_then(|d| String::from_datum(d, false)),
            // A detoasted copy: the slot's value points into a shared buffer.
            result: column(4).map(|d| Jsonb::copy_of(d)),
            lease_until: column(5).and_then(|d| TimestampWithTimeZone::from_datum(d, false)),
            completed,
            mine,
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

    #[pg_test]
    fn direct_walk_finds_what_a_lookup_of_each_id_finds() {
        // Ids close together and far apart in the index, long ones (stored compressed in it), rows with several
        // versions (an update of expires_at adds index entries; the old ones are invisible), deleted rows.
        run("SELECT dedup.create_inbox('dl_walk');
             INSERT INTO dedup.inbox_dl_walk (id, expires_at)
               SELECT 'k-' || g, now() + g * interval '1 second' FROM generate_series(1, 5000) g;
             INSERT INTO dedup.inbox_dl_walk (id, expires_at)
               SELECT md5(g::text), now() + interval '1 day' FROM generate_series(1, 5000) g;
             INSERT INTO dedup.inbox_dl_walk (id, expires_at)
               SELECT 'long-' || g || repeat('x', 3000), now() + interval '1 day' FROM generate_series(1, 50) g;
             UPDATE dedup.inbox_dl_walk SET expires_at = expires_at + interval '1 hour' WHERE id LIKE 'k-1%';
             UPDATE dedup.inbox_dl_walk SET expires_at = expires_at + interval '1 hour' WHERE id LIKE 'k-1%';
             DELETE FROM dedup.inbox_dl_walk WHERE id LIKE 'k-2%'");
        // Wanted: runs of neighbours (present, deleted, past the end), ids between neighbours, ids dozens of
        // entries apart (half of them absent), and long ids.
        let wanted = column(
            "SELECT id FROM (
               SELECT 'k-' || g FROM generate_series(1, 6000) g
               UNION SELECT 'k-' || g || 'z' FROM generate_series(1, 300) g
               UNION SELECT md5(g::text) FROM generate_series(1, 10000, 37) g
               UNION SELECT 'long-' || g || repeat('x', 3000) FROM generate_series(1, 60, 3) g) s(id)
             ORDER BY id COLLATE \"C\"",
        );
        let ids: Vec<&str> = wanted.iter().map(String::as_str).collect();
        let inbox = open("dl_walk", Access::Mark);
        let found = super::find_each(&inbox, &ids);
        let mut rows = 0;
        for (id, row) in ids.iter().zip(&found) {
            let expected: Option<TimestampWithTimeZone> = Spi::get_one_with_args(
                "SELECT (SELECT expires_at FROM dedup.inbox_dl_walk WHERE id = $1)",
                &[(*id).into()],
            )
            .unwrap();
            assert_eq!(row.as_ref().map(|r| r.expires_at), expected, "{}", &id[..id.len().min(20)]);
            rows += row.is_some() as usize;
        }
        assert_eq!(rows, 5000 - 1111 + 136 + 17, "present: k- but k-2*, the md5 ids up to 5000, the long ones");
        // The same ids one at a time (no walk) agree.
        for (id, row) in ids.iter().zip(&found).step_by(97) {
            let alone = super::find_each(&inbox, &[id]).pop().flatten();
            assert_eq!(alone.map(|r| r.expires_at), row.as_ref().map(|r| r.expires_at));
        }
    }
}
