//! Deleting expired rows straight from the heap, found by walking the `expires_at` btree with an index scan of our
//! own: what the purge's `DELETE ... WHERE ctid = ANY (ARRAY(SELECT ctid ... ORDER BY expires_at LIMIT n))` does,
//! without a statement to plan and start, a list of ctids to collect, sort and fetch again, or the executor's work
//! per row (none of which a plain inbox row needs: no trigger fires on DELETE, no rule or row security applies).
//!
//! A row is deleted only if this transaction's snapshot sees it expired and no other transaction holds it; the
//! delete never waits. A row another transaction is changing or has changed since the snapshot (a mark renewing it,
//! a `forget()`) is passed over, as `FOR UPDATE SKIP LOCKED` would: the purge's next cycle meets it again if it is
//! still expired then. So there is no lock_timeout to set, no failed attempt to undo, and nothing to retry.

use crate::inbox::Inbox;
use crate::ports;
use crate::unguarded::{self, Guard};
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;

/// Index entries walked between two offers of the CPU (a tenth to a fifth of a millisecond of work when every
/// entry's row is deleted, less when none is), when asked to offer it. On a busy machine a batch of ten thousand rows
/// is a burst of several milliseconds, and the scheduler lets a running process finish its time slice before a
/// waking one gets the core: the marks queued behind the burst make mark()'s tail latency. Offering the core this
/// often bounds that wait to a sub-batch; it costs nothing when no one else wants the CPU, and slows the purge down
/// when someone does. Entries count, not deleted rows: a batch may walk past entries of rows deleted before it (they
/// stay in the btree until a vacuum), each a visit to the heap and none a deletion: a run of 1.67 ms without an offer
/// in one trace when only deletions counted (bench/results/profiles/issue-23.md, stop 47).
const YIELD_EVERY: i64 = 256;

/// The btree on `expires_at` of `rel` that a scan for `expires_at <= now` (and `>= from`) may walk (one key column,
/// the second column of the row type, in the default operator family of timestamptz, valid, no predicate, no
/// expression).
struct ExpiryIndex {
    oid: pg_sys::Oid,
    /// The functions of that family's `<=` and `>=`, for the scan's keys.
    at_most: pg_sys::Oid,
    at_least: pg_sys::Oid,
}

/// `rel`'s `ExpiryIndex`; None if an owner dropped or replaced it.
///
/// # Safety
/// `rel` must be an open inbox table, locked by this transaction.
unsafe fn expiry_index(rel: pg_sys::Relation) -> Option<ExpiryIndex> {
    // SAFETY: the caller vouches for the relation; each index is opened, its relcache entry only read, and closed;
    // the list is the relcache's copy, ours to free.
    unsafe {
        let opclass = pg_sys::GetDefaultOpClass(pg_sys::TIMESTAMPTZOID, pg_sys::BTREE_AM_OID);
        let family = pg_sys::get_opclass_family(opclass);
        let list = pg_sys::RelationGetIndexList(rel);
        let n = if list.is_null() { 0 } else { (*list).length as usize };
        let mut found = pg_sys::InvalidOid;
        for i in 0..n {
            let oid = (*(*list).elements.add(i)).oid_value;
            let index = pg_sys::index_open(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let form = &*(*index).rd_index;
            let none =
                |column: u32| pg_sys::heap_attisnull((*index).rd_indextuple, column as i32, std::ptr::null_mut());
            let fits = (*(*index).rd_rel).relam == pg_sys::BTREE_AM_OID
                && form.indisvalid
                && form.indnatts == 1
                && form.indkey.values.as_slice(1)[0] == 2
                && *(*index).rd_opfamily == family
                && none(pg_sys::Anum_pg_index_indexprs)
                && none(pg_sys::Anum_pg_index_indpred);
            pg_sys::index_close(index, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            if fits {
                found = oid;
                break;
            }
        }
        pg_sys::list_free(list);
        let operator = |strategy: u32| {
            let member =
                pg_sys::get_opfamily_member(family, pg_sys::TIMESTAMPTZOID, pg_sys::TIMESTAMPTZOID, strategy as i16);
            if member == pg_sys::InvalidOid {
                pg_sys::InvalidOid
            } else {
                pg_sys::get_opcode(member)
            }
        };
        let (at_most, at_least) =
            (operator(pg_sys::BTLessEqualStrategyNumber), operator(pg_sys::BTGreaterEqualStrategyNumber));
        [found, at_most, at_least].iter().all(|&oid| oid != pg_sys::InvalidOid).then_some(ExpiryIndex {
            oid: found,
            at_most,
            at_least,
        })
    }
}

/// What one call of `delete_expired` did.
pub struct Deleted {
    /// The rows it deleted.
    pub rows: i64,
    /// The `expires_at` of the last row it read from the heap (deleted or passed over), if any: where the next batch
    /// of the same purge may start (`from`).
    pub reached: Option<pg_sys::TimestampTz>,
    /// Whether it read rows and every one has that same expiry (marks written by one statement share theirs): a
    /// batch starting there walks again over the entries of all of them.
    pub all_at_reached: bool,
    /// With `keep`, the rows it deleted, for the next batch of the same purge (its `after`).
    pub gone: Option<Gone>,
    /// Index entries of `after`'s rows it met: those it asked the btree to mark dead without reading their rows (the
    /// btree does so when the walk leaves their page, unless the page changed meanwhile or the entry is a posting
    /// list with other rows in it), and those it read because their heap page had changed.
    pub rewalked: Rewalked,
}

/// See `Deleted::rewalked`.
#[derive(Default)]
pub struct Rewalked {
    pub unread: i64,
    pub read: i64,
}

/// The rows one batch deleted, kept for the batch after it: that batch walks again over their index entries (all of
/// them when the rows share one expiry, `Deleted::all_at_reached`), and each such entry costs a visit to the heap to
/// find its row dead to every transaction before the walk may mark the entry dead (`kill_prior_tuple`). With what is
/// kept here the next batch may mark such an entry dead without that visit (`Gone::dead_for_all`, `Rewalk`). On a
/// backlog of 500,000 marks of one expiry in batches of 10,000, a cycle walked over 1,005,902 entries, half of them
/// the last batch's again, and their visits took a sixth of the worker's CPU (bench/results/profiles/issue-23.md,
/// stops 60 and 61).
pub struct Gone {
    /// The deleting transaction (0 if it deleted nothing).
    xid: pg_sys::TransactionId,
    /// The next transaction id when its walk ended. Every transaction that deleted or updated a version these rows'
    /// entries lead to (this one, and the updaters of a HOT chain's older members) has an id below it; once VACUUM's
    /// horizon has reached it, no snapshot there is or will be sees any of those versions.
    next_xid: pg_sys::TransactionId,
    /// The WAL's insert position when its walk ended, before it committed. A VACUUM that frees one of the rows' line
    /// pointers, and a new row that takes it, both write WAL for the heap page and move its LSN past this (a change
    /// that moves no LSN, such as a hint bit, frees and fills no line pointer).
    wal_before_commit: pg_sys::XLogRecPtr,
    /// The table's file then: a rewrite (VACUUM FULL, CLUSTER, TRUNCATE) gives the same tids to other rows, and under
    /// `wal_level = minimal` writes its pages without moving their LSNs.
    file: pg_sys::Oid,
    /// The tids of the deleted rows' index entries (a HOT chain's root: what the entry points to), as `tid_key`s,
    /// sorted.
    tids: Vec<u64>,
}

/// The heap block a tid names.
fn tid_block(tid: &pg_sys::ItemPointerData) -> pg_sys::BlockNumber {
    (tid.ip_blkid.bi_hi as pg_sys::BlockNumber) << 16 | tid.ip_blkid.bi_lo as pg_sys::BlockNumber
}

/// A tid as one number that sorts like the tid (block, then line pointer).
fn tid_key(tid: &pg_sys::ItemPointerData) -> u64 {
    (tid_block(tid) as u64) << 16 | tid.ip_posid as u64
}

impl Gone {
    /// The deleting transaction: 0 if the batch deleted nothing (such a batch deleted fewer than its limit, and ends
    /// the purge's walk).
    pub fn xid(&self) -> pg_sys::TransactionId {
        self.xid
    }

    /// Whether the rows kept are now dead to every transaction there is or will be, so that an index entry leading
    /// to one of them, and to nothing else, may be marked dead: the deleter committed and its commit is on disk (a
    /// hint written before it could outlive it in a crash), VACUUM's horizon has reached `next_xid`, and the table is
    /// logged and has not been rewritten. Asked once per batch, in the batch after.
    ///
    /// # Safety
    /// `rel` must be the open table the rows were deleted from.
    unsafe fn dead_for_all(&self, rel: pg_sys::Relation) -> bool {
        // SAFETY: the caller vouches for the relation; the calls read shared state under their own locks. The
        // deleter has an id: it deleted the rows kept.
        unsafe {
            !self.tids.is_empty()
                && (*(*rel).rd_rel).relpersistence == pg_sys::RELPERSISTENCE_PERMANENT as std::ffi::c_char
                && (*(*rel).rd_rel).relfilenode == self.file
                && pg_sys::TransactionIdDidCommit(self.xid)
                && !pg_sys::XLogNeedsFlush(pg_sys::TransactionIdGetCommitLSN(self.xid))
                && pg_sys::TransactionIdFollowsOrEquals(
                    crate::ports::GetOldestNonRemovableTransactionId(rel),
                    self.next_xid,
                )
        }
    }
}

/// A walk over the index entries of a batch's rows that the batch before it deleted (`Gone`), once `dead_for_all`
/// said yes and the batch holds a lock that keeps VACUUM off the table until the walk ends (`Rewalk::start`). The walk
/// meets the entries of one expiry in tid order (a btree orders equal keys by tid since PostgreSQL 12; in an older
/// one carried over by pg_upgrade it meets fewer of them this way, which only means more visits), so one cursor over
/// the sorted tids finds them: a binary search for each entry walked took a seventh of the worker's samples on a
/// backlog (stop 61).
struct Rewalk<'a> {
    gone: &'a Gone,
    /// The first of `gone`'s tids not met yet.
    next: usize,
    /// The last heap block looked at, and whether it was unchanged (a block holds many rows).
    page: Option<(pg_sys::BlockNumber, bool)>,
}

impl<'a> Rewalk<'a> {
    /// A walk over `after`'s entries, if their rows are dead to all and the batch can take a SHARE UPDATE EXCLUSIVE
    /// lock on the table without waiting (held until `end`, when the walk is over). That lock keeps VACUUM off the
    /// table meanwhile, and only VACUUM frees a line pointer an index entry leads to (pruning frees only those of HOT
    /// versions, which no entry leads to): so a heap page seen unchanged once in the walk stays so for the rest of it,
    /// and its answer may be kept. The lock is not waited for, and not taken when a VACUUM, ANALYZE or CREATE INDEX
    /// CONCURRENTLY holds it or waits for it: the batch then reads those rows as before. An autovacuum that comes
    /// while a walk holds it passes the table over until its next round (and says so in the log).
    ///
    /// # Safety
    /// `rel` must be the open table the rows were deleted from.
    unsafe fn start(after: Option<&'a Gone>, rel: pg_sys::Relation) -> Option<Self> {
        // SAFETY: the caller vouches for the relation.
        let locked =
            || unsafe { pg_sys::ConditionalLockRelation(rel, pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE) };
        // SAFETY: as above.
        let gone = after.filter(|gone| unsafe { gone.dead_for_all(rel) } && locked())?;
        Some(Rewalk { gone, next: 0, page: None })
    }

    /// Lets VACUUM at the table again, once the scan has ended (the btree marks the last entries dead as it ends).
    ///
    /// # Safety
    /// `rel` must be the table `start` locked.
    unsafe fn end(self, rel: pg_sys::Relation) {
        // SAFETY: the caller vouches for the relation; the lock is the one `start` took in this transaction.
        unsafe { pg_sys::UnlockRelation(rel, pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE) }
    }

    /// Whether `tid`, the entry the walk has just read, is one of the rows kept and still the row deleted (None when
    /// not one of them): the line pointer it names has not been freed by a VACUUM and given to a new row since the
    /// deleting batch's walk, which would have moved its heap page's LSN past `wal_before_commit`. Once this says yes
    /// the entry may be marked dead; and the answer kept for its page stays true for the rest of the walk, as no line
    /// pointer an entry leads to can be freed on it while the walk holds its lock (`start`).
    ///
    /// # Safety
    /// `rel` must be the open table the rows were deleted from. It runs under the walk's one guard (`pg`): it may
    /// call no `pg_sys` function nor pgrx macro that calls PostgreSQL, and must not panic (`unguarded`).
    unsafe fn unchanged_row(
        &mut self,
        pg: &Guard,
        rel: pg_sys::Relation,
        tid: &pg_sys::ItemPointerData,
    ) -> Option<bool> {
        let (key, tids) = (tid_key(tid), &self.gone.tids);
        while self.next < tids.len() && tids[self.next] < key {
            self.next += 1;
        }
        if tids.get(self.next) != Some(&key) {
            return None;
        }
        self.next += 1;
        let block = tid_block(tid);
        Some(match self.page {
            Some((seen, unchanged)) if seen == block => unchanged,
            _ => {
                // SAFETY: the caller vouches for the relation; the block is one an index entry read in this
                // transaction points to, which exists as for any heap fetch of an index scan (VACUUM truncates a
                // table only under a lock that conflicts with this transaction's); pinned and share-locked while its
                // LSN is read.
                let lsn = unsafe {
                    let buffer = pg.ReadBuffer(rel, block);
                    pg.LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
                    let lsn = pg.BufferGetLSNAtomic(buffer);
                    pg.UnlockReleaseBuffer(buffer);
                    lsn
                };
                let unchanged = lsn <= self.gone.wal_before_commit;
                self.page = Some((block, unchanged));
                unchanged
            }
        })
    }
}

/// Deletes up to `limit` rows of `inbox` that expired at or before `now` (and, with `from`, not before it), in
/// `expires_at` order, passing over rows other transactions hold, and offering the CPU to other processes every
/// `YIELD_EVERY` index entries if `yield_cpu`; None when the table needs the executor (its shape is not `plain`) or
/// has no usable `expires_at` btree: then the caller runs the SQL purge instead.
///
/// `from` is for a purge made of batches in transactions of their own, each starting where the one before it stopped
/// (its `reached`). Without it each batch's walk would start at the btree's first entry and step again past the
/// entries of the rows the batches before it deleted: their entries stay until a vacuum, and a walk fetches each
/// one's row from the heap until some walk has found it dead to every transaction and marked the entry dead, which
/// lags behind the batches. A cycle of 5,000 rows in batches of 100 read 57,935 entries that way; in batches of
/// 1,000 the worker took 1.25-2 times the CPU per cycle of 100,000 at the default pace, and 4.6 times for 1,000,000
/// without pauses (bench/results/profiles/issue-23.md, stop 58). The entries whose expiry is `from` itself are walked
/// again: all the marks one statement wrote share their expiry, so a batch that stopped among them starts again at
/// their first. Rows that expired before `from` and are still there (held by
/// another transaction when passed over, or committed since with an expiry already past) are left to a later walk
/// that starts without it.
///
/// `after` is what the batch before this one deleted (its `gone`, which it keeps with `keep`): their entries, met
/// again from `from`, are marked dead without reading their rows where that is safe (`Gone`).
pub fn delete_expired(
    inbox: &Inbox,
    now: TimestampWithTimeZone,
    from: Option<pg_sys::TimestampTz>,
    limit: i64,
    yield_cpu: bool,
    after: Option<&Gone>,
    keep: bool,
) -> Option<Deleted> {
    if !inbox.shape().plain {
        return None;
    }
    // The scan and whatever the index allocates go into a context of their own, gone when this returns.
    let mut scratch = PgMemoryContexts::new("dedup purge");
    // SAFETY: the table was opened and locked (RowExclusiveLock) by this transaction (`inbox::open`); the index is
    // locked here. Every pointer below lives until the matching end/close/drop, all before returning.
    unsafe {
        scratch.switch_to(|_| {
            let rel = pg_sys::table_open(inbox.relid, pg_sys::NoLock as pg_sys::LOCKMODE);
            let Some(expiry) = expiry_index(rel) else {
                pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                return None;
            };
            // What the executor checks before a DELETE: a table published for deletes must say how its rows are
            // identified (an inbox has its primary key, unless an owner changed its replica identity).
            pg_sys::CheckCmdReplicaIdentity(rel, pg_sys::CmdType::CMD_DELETE);
            let index = pg_sys::index_open(expiry.oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            // As SPI does before a statement: this transaction's changes so far become visible, and a snapshot is
            // taken (a fresh one under READ COMMITTED).
            pg_sys::CommandCounterIncrement();
            let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
            let cid = pg_sys::GetCurrentCommandId(true);
            let now_datum = now.into_datum().expect("a timestamp is a datum");
            let mut keys = [pg_sys::ScanKeyData::default(), pg_sys::ScanKeyData::default()];
            pg_sys::ScanKeyInit(
                &mut keys[0],
                1,
                pg_sys::BTLessEqualStrategyNumber as pg_sys::StrategyNumber,
                expiry.at_most,
                now_datum,
            );
            let nkeys = match from {
                Some(from) => {
                    pg_sys::ScanKeyInit(
                        &mut keys[1],
                        1,
                        pg_sys::BTGreaterEqualStrategyNumber as pg_sys::StrategyNumber,
                        expiry.at_least,
                        pg_sys::Datum::from(from),
                    );
                    2
                }
                None => 1,
            };
            // Before the walk reads a page of the btree (`Rewalk::start`).
            let mut rewalk = Rewalk::start(after, rel);
            let scan = ports::index_beginscan(rel, index, snapshot, nkeys);
            pg_sys::index_rescan(scan, keys.as_mut_ptr(), nkeys, std::ptr::null_mut(), 0);
            let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
            let mut rewalked = Rewalked::default();
            let mut tids = Vec::new();
            // The tid of the entry being visited (the fetch moves the scan's own to the HOT chain's member it finds).
            let mut entry = pg_sys::ItemPointerData::default();
            let mut deleted = 0;
            let (mut first, mut reached) = (None, None);
            let mut walked: i64 = 0;
            // SAFETY: the walk, under one guard (`unguarded`): calls their pg_sys twins could make, on the scan, slot,
            // table and snapshot set up above; nothing in it has a destructor or panics (a push onto `tids` aborts the
            // process if memory runs out, as anywhere in Rust, and unwinds nothing).
            unguarded::guarded(|pg| {
                while deleted < limit {
                    // index_getnext_slot(), taken apart to count the entries walked, those of rows gone included.
                    if !(*scan).xs_heap_continue {
                        if pg.index_getnext_tid(scan, pg_sys::ScanDirection::ForwardScanDirection).is_null() {
                            break;
                        }
                        walked += 1;
                        entry = (*scan).xs_heaptid;
                        if yield_cpu && walked % YIELD_EVERY == 0 {
                            // sched_yield(): runs whoever waits for this core, then comes back.
                            std::thread::yield_now();
                        }
                        match rewalk.as_mut().and_then(|rewalk| rewalk.unchanged_row(pg, rel, &entry)) {
                            Some(true) => {
                                // What index_fetch_heap would have found, without the visit: the entry's rows are
                                // dead to all, and the btree marks it dead when the walk leaves its page.
                                (*scan).kill_prior_tuple = true;
                                rewalked.unread += 1;
                                pg.check_for_interrupts();
                                continue;
                            }
                            Some(false) => rewalked.read += 1,
                            None => {}
                        }
                    }
                    if !pg.index_fetch_heap(scan, slot) {
                        pg.check_for_interrupts();
                        continue;
                    }
                    // The version the snapshot sees, read again from the heap: expired by its own expires_at, not
                    // only by its index entry. (A timestamptz datum is its int64 microseconds, infinities included:
                    // compared as such, without a conversion per row.)
                    let mut null = false;
                    let expires_at = pg.slot_getattr(slot, 2, &mut null);
                    if null || expires_at.value() as i64 > now_datum.value() as i64 {
                        continue;
                    }
                    reached = Some(expires_at.value() as pg_sys::TimestampTz);
                    first = first.or(reached);
                    let mut tid = (*slot).tts_tid;
                    let mut failure = pg_sys::TM_FailureData::default();
                    let outcome = pg.table_tuple_delete(
                        rel,
                        &mut tid,
                        cid,
                        snapshot,
                        std::ptr::null_mut(),
                        false, // never wait: a row someone holds is theirs
                        &mut failure,
                        false,
                    );
                    if outcome == pg_sys::TM_Result::TM_Ok {
                        deleted += 1;
                        if keep {
                            tids.push(tid_key(&entry));
                        }
                    }
                    pg.check_for_interrupts();
                }
            });
            let gone = keep.then(|| {
                tids.sort_unstable();
                Gone {
                    xid: pg_sys::GetTopTransactionIdIfAny(),
                    next_xid: pg_sys::TransactionId::from(pg_sys::ReadNextFullTransactionId().value as u32),
                    wal_before_commit: pg_sys::GetXLogInsertRecPtr(),
                    file: (*(*rel).rd_rel).relfilenode,
                    tids,
                }
            });
            pg_sys::ExecDropSingleTupleTableSlot(slot);
            pg_sys::index_endscan(scan);
            if let Some(rewalk) = rewalk {
                rewalk.end(rel);
            }
            pg_sys::UnregisterSnapshot(snapshot);
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            if deleted > 0 {
                // Later statements of the transaction must not see the rows, as after any SQL delete.
                pg_sys::CommandCounterIncrement();
            }
            Some(Deleted {
                rows: deleted,
                reached,
                all_at_reached: reached.is_some() && first == reached,
                gone,
                rewalked,
            })
        })
    }
}
