//! Loading inbox tables into the shared filter: after a restart (nothing is trusted until loaded), for inboxes
//! created by a restore or whose trigger was repaired, and when a rotation makes a fresh generation to shed expired
//! marks. Also the background worker's upkeep of the filter (`repair_triggers`, then `look_after_filter`).

use crate::errors::{self, raise, server_log};
use crate::filter::{self, RebuildGuard};
use crate::shmem::{self, namespace};
use crate::trigger::{self, State};
use crate::{catalog, guc, ports};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Keys hashed per round of prefetched filter inserts, and rows read between two resets of the scan's memory.
const BATCH: usize = 4096;
/// Rotate the filter when its measured rate exceeds the target by this factor.
const ROTATE_AT: f64 = 1.1;
/// Seconds between rotations that end above target, doubling from the first to the second.
const MIN_BACKOFF: u64 = 1;
const MAX_BACKOFF: u64 = 600;

/// What a rebuild did.
pub struct Rebuilt {
    pub inboxes: usize,
    pub keys: i64,
    /// Inboxes left for a later round: their table was busy, or its trigger is not guarding.
    pub skipped: Vec<(pg_sys::Oid, Skipped)>,
}

/// Why an inbox was not loaded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Skipped {
    /// Another transaction holds the table in a mode that excludes ours (DDL, TRUNCATE; perhaps prepared).
    Busy,
    /// Its filter trigger is not guarding it.
    Unguarded(State),
    /// Shared memory holds no more inboxes (`shmem::MAX_INBOXES`).
    NoRoom,
}

/// Loads this database's inboxes into the filter: all of them into a fresh generation when `rotate`, otherwise only
/// those the active generation does not cover yet. None when another process is rebuilding right now. Never waits
/// for another transaction: a table it cannot lock at once is skipped (and stays untrusted until a later load).
pub fn run(rotate: bool) -> Option<Rebuilt> {
    let guard = filter::try_begin_rebuild()?;
    let target = guard.target(rotate);
    let tables = catalog::filtered_tables();
    let wanted = if rotate { tables } else { filter::untrusted(&tables) };
    let mut done = Rebuilt { inboxes: 0, keys: 0, skipped: Vec::new() };
    for relid in wanted {
        match load_inbox(&guard, target, relid) {
            Ok(keys) => {
                done.keys += keys;
                done.inboxes += 1;
            }
            Err(why) => done.skipped.push((relid, why)),
        }
    }
    guard.finish(target, rotate || done.inboxes > 0);
    Some(done)
}

/// Loads every row of one inbox table (expired ones too: they cost bits, not correctness) and trusts it in
/// generation `target`, provided its trigger guards it.
fn load_inbox(guard: &RebuildGuard, target: usize, relid: pg_sys::Oid) -> Result<i64, Skipped> {
    // RowExclusiveLock, taken only if free right now: while the table is read no one can change its trigger (that
    // takes ShareRowExclusiveLock), and writers are not held up. The lock lasts until the transaction ends.
    // SAFETY: a conditional lock by oid; then a check that the table still exists under it.
    let locked = unsafe { pg_sys::ConditionalLockRelationOid(relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) }
        && catalog::relation_exists(relid);
    if !locked {
        return Err(Skipped::Busy);
    }
    let ns = namespace(relid);
    // SAFETY: the table exists and is locked by this transaction; closed before returning, the lock kept.
    unsafe {
        let rel = pg_sys::table_open(relid, pg_sys::NoLock as pg_sys::LOCKMODE);
        let loaded = match State::of(rel) {
            State::Guarding if shmem::region().and_then(|h| h.entry(ns, true)).is_some() => {
                Ok(scan_keys(rel, trigger::Key::of(relid), |hashes| guard.load(target, hashes)))
            }
            State::Guarding => Err(Skipped::NoRoom),
            state => Err(Skipped::Unguarded(state)),
        };
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        if loaded.is_ok() {
            guard.loaded(target, ns);
        }
        loaded
    }
}

/// Reads every row version of `rel` that is physically there and some snapshot may still see — not only the committed
/// rows and those of transactions still in progress (prepared ones included), but also versions deleted or updated
/// since this transaction's snapshot was taken, which no one may prune while it is held — and hands the hashes of their
/// keys (`key`) to `load` in batches. The dead versions are what makes a load safe against an UPDATE that does not fire
/// the trigger (a renewal sets `expires_at`, the worker rewrites a count): its new version may land on a page the scan
/// has passed, and its old one die before the scan gets there; the old version is still read. Versions that VACUUM
/// could already remove are skipped (`Version::Dead`). Straight from the heap: no SQL runs, so nothing an owner
/// attached to the table runs either. Returns how many rows it read that are live or in progress (a dirty snapshot's
/// view), the figure logs and `bloom_rebuild()` report.
///
/// # Safety
/// `rel` must be an open table the filter guards, keyed as `key` says.
unsafe fn scan_keys(rel: pg_sys::Relation, key: trigger::Key, mut load: impl FnMut(&[u64])) -> i64 {
    // SAFETY: the caller vouches for the relation; the scan, its slot and the memory context are made and released here,
    // and each id is detoasted into that context, which is reset only once its hash is taken.
    unsafe {
        let ns = namespace((*rel).rd_id);
        let mut any: pg_sys::SnapshotData = std::mem::zeroed();
        any.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_ANY;
        let mut dirty: pg_sys::SnapshotData = std::mem::zeroed();
        dirty.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        // Detoasted ids (a long one can be compressed) live here, freed every batch.
        let memory = pg_sys::AllocSetContextCreateExtended(
            pg_sys::CurrentMemoryContext,
            c"pg_dedup filter load".as_ptr(),
            pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
        );
        // VACUUM's horizon: a version whose deleter committed below it is seen by no snapshot of a backend that can
        // read this table (this database's, the caller's included), and since every transaction of this database
        // below it had ended, any version its UPDATE made was already there. Every transaction that writes during
        // the scan is at or above it.
        let horizon = ports::GetOldestNonRemovableTransactionId(rel);
        let scan = pg_sys::table_beginscan(rel, &mut any, 0, std::ptr::null_mut());
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let mut hashes = Vec::with_capacity(BATCH);
        let mut rows = 0i64;
        loop {
            let more = pg_sys::table_scan_getnextslot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot);
            // The version read, unless there is none or it is dead.
            let read = more.then(|| version(slot, &mut dirty, horizon)).filter(|v| *v != Version::Dead);
            if let Some(version) = read {
                let caller = pg_sys::MemoryContextSwitchTo(memory);
                let column = |attnum: i32| {
                    let mut isnull = false;
                    let datum = pg_sys::slot_getattr(slot, attnum, &mut isnull);
                    (!isnull).then(|| {
                        pgrx::varlena::varlena_to_byte_slice(pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr()))
                    })
                };
                let hash = match key {
                    trigger::Key::Id => column(1).map(|id| pg_dedup_bloom::hash_key(ns, id)),
                    trigger::Key::InboxAndId => column(1)
                        .zip(column(2))
                        .map(|(inbox, id)| pg_dedup_bloom::hash_key(ns, &filter::attempt_key(inbox, id))),
                };
                pg_sys::MemoryContextSwitchTo(caller);
                if let Some(hash) = hash {
                    hashes.push(hash);
                    rows += i64::from(version == Version::Live);
                }
            }
            if hashes.len() == BATCH || (!more && !hashes.is_empty()) {
                load(&hashes);
                hashes.clear();
                pg_sys::MemoryContextReset(memory);
                pg_sys::check_for_interrupts!();
            }
            if !more {
                break;
            }
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::table_endscan(scan);
        pg_sys::MemoryContextDelete(memory);
        rows
    }
}

/// What a load makes of a row version its scan read.
#[derive(PartialEq, Eq)]
enum Version {
    /// Seen by a dirty snapshot (committed and not deleted, or of a transaction in progress): loaded and counted.
    Live,
    /// Deleted by a transaction that committed below VACUUM's horizon, or inserted by one that aborted: seen by no
    /// snapshot, removable by any process at any moment, so no load can count on finding it. Skipped: a purge in
    /// small batches leaves thousands of them unpruned until VACUUM (a page pruned once, between two batches, is
    /// not pruned again on the way), and loaded they filled a fresh generation past its target rate.
    Dead,
    /// Anything else (deleted by a transaction at or above VACUUM's horizon: since the scan began, or while some
    /// snapshot that may still see the version was open; or by one in progress): loaded, not counted.
    Other,
}

/// What a load makes of the row version in `slot`, read by a scan of its heap table. A slot of another table
/// access method counts as live.
///
/// # Safety
/// `slot` must hold a version just returned by a table scan of an open table; `dirty` must be a dirty snapshot;
/// `horizon` VACUUM's horizon for the table, taken before the scan began.
unsafe fn version(
    slot: *mut pg_sys::TupleTableSlot,
    dirty: &mut pg_sys::SnapshotData,
    horizon: pg_sys::TransactionId,
) -> Version {
    // SAFETY: a slot of the buffer-heap kind is a BufferHeapTupleTableSlot holding a pin on its tuple's buffer; the
    // visibility checks are made under a share lock on that buffer, as the heap's own scans make them.
    unsafe {
        if !std::ptr::eq((*slot).tts_ops, &pg_sys::TTSOpsBufferHeapTuple) {
            return Version::Live;
        }
        let heap = slot as *mut pg_sys::BufferHeapTupleTableSlot;
        let (tuple, buffer) = ((*heap).base.tuple, (*heap).buffer);
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
        let version = if pg_sys::HeapTupleSatisfiesVisibility(tuple, dirty, buffer) {
            Version::Live
        } else if pg_sys::HeapTupleSatisfiesVacuum(tuple, horizon, buffer) == pg_sys::HTSV_Result::HEAPTUPLE_DEAD {
            Version::Dead
        } else {
            Version::Other
        };
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
        version
    }
}

/// `dedup.bloom_rebuild()`: rotate now (fresh generation, reloaded from this database's inboxes).
#[pg_extern(volatile, parallel_unsafe)]
fn bloom_rebuild() -> i64 {
    if !filter::is_preloaded() {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "the Bloom filter is off: pg_dedup is not in shared_preload_libraries",
            "Add pg_dedup to shared_preload_libraries and restart; until then every call uses the index.",
        )
    }
    // SAFETY: reads shared state; no preconditions.
    if unsafe { pg_sys::RecoveryInProgress() } {
        raise(
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            "the Bloom filter cannot be rebuilt on a hot standby",
            "A standby always uses the index; the filter is rebuilt after promotion.",
        )
    }
    match run(true) {
        Some(done) => {
            for (relid, why) in &done.skipped {
                let table = catalog::qualified_name(*relid).unwrap_or_default();
                let why = match why {
                    Skipped::Busy => "it is locked by another transaction".to_owned(),
                    Skipped::Unguarded(state) => format!("its {} trigger is {}", trigger::NAME, state.label()),
                    Skipped::NoRoom => format!("shared memory holds at most {} inboxes", shmem::MAX_INBOXES),
                };
                errors::notice(
                    format!("{table} was not loaded into the Bloom filter: {why}; the worker tries again"),
                    None,
                );
            }
            done.keys
        }
        None => raise(
            PgSqlErrorCode::ERRCODE_OBJECT_IN_USE,
            "another process is rebuilding the Bloom filter",
            "Wait for it to finish (dedup.stats shows filter_state 'rebuilding'), then retry.",
        ),
    }
}

thread_local! {
    /// What the worker last said about each inbox it could not load: said again only when it changes.
    static TOLD: RefCell<HashMap<pg_sys::Oid, Skipped>> = RefCell::new(HashMap::new());
}

/// The first half of the background worker's round of filter upkeep, in a transaction of its own: frees the
/// shared state of inbox tables that are gone, and repairs the filter triggers of untrusted inboxes that stopped
/// guarding. (A repair holds the table in SHARE ROW EXCLUSIVE mode, which writers wait for, until its transaction
/// ends: it must not last as long as the load that follows.)
pub fn repair_triggers() {
    let Some(region) = shmem::region() else { return };
    let tables = catalog::inbox_tables();
    // SAFETY: reads a backend global, set once connected.
    let database = unsafe { pg_sys::MyDatabaseId };
    // Distributed inboxes keep theirs: their counters count the calls made here.
    let kept = catalog::with_attempt_counts(tables.clone());
    region.free_entries(|ns| shmem::database_of(ns) == database && !kept.contains(&shmem::relation_of(ns)));
    for relid in filter::untrusted(&catalog::with_attempt_counts(catalog::local(tables))) {
        repair_trigger(relid);
    }
}

/// The second half, in a transaction of its own: loads inboxes the active generation does not cover, and rotates
/// when expired marks have pushed the measured false-positive rate above target. Waits for no other transaction.
pub fn look_after_filter() {
    let Some(region) = shmem::region() else { return };
    if !filter::untrusted(&catalog::filtered_tables()).is_empty() {
        if let Some(done) = run(false) {
            if done.inboxes > 0 {
                server_log!(
                    "pg_dedup worker: loaded {} keys of {} table(s) into the Bloom filter",
                    done.keys,
                    done.inboxes
                );
            }
            report(&done);
        }
    }
    let target = guc::BLOOM_FPR.get();
    let Some(measured) = filter::active_fpr() else { return };
    // SAFETY: reads the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    if measured <= ROTATE_AT * target || now < region.next_rotation_at.load(Ordering::Relaxed) {
        return;
    }
    let Some(done) = run(true) else { return };
    report(&done);
    let after = filter::active_fpr().unwrap_or(0.0);
    // A rotation that ends above target (marks arriving faster than it reloads, or more live marks than the filter
    // holds) is not repeated at once: the wait doubles, from MIN_BACKOFF up to MAX_BACKOFF, until one succeeds.
    let backoff = if after <= target {
        MIN_BACKOFF
    } else {
        (region.rotation_backoff.load(Ordering::Relaxed) * 2).clamp(MIN_BACKOFF, MAX_BACKOFF)
    };
    region.rotation_backoff.store(backoff, Ordering::Relaxed);
    region.next_rotation_at.store(now + backoff as i64 * 1_000_000, Ordering::Relaxed);
    server_log!(
        "pg_dedup worker: rotated the Bloom filter ({} live marks reloaded; false-positive rate {measured:.4} -> {after:.4})",
        done.keys
    );
    let capacity = guc::BLOOM_CAPACITY.get() as i64;
    if done.keys > capacity {
        warning!(
            "dedup: the Bloom filter is undersized: {} live marks in this database alone, capacity {capacity}; set \
             dedup.bloom_capacity to at least {} and restart",
            done.keys,
            done.keys * 2
        );
    }
}

/// Puts the filter trigger of table `relid` right if it stopped guarding, and says so.
fn repair_trigger(relid: pg_sys::Oid) {
    let state = State::of_table(relid);
    if state == State::Guarding {
        return;
    }
    let Some(table) = catalog::qualified_name(relid) else { return };
    if trigger::repair(&table, trigger::Key::of(relid), state) {
        server_log!(
            "pg_dedup worker: repaired the {} trigger of {table} (it was {}); reloading it",
            trigger::NAME,
            state.label()
        );
        TOLD.with(|told| told.borrow_mut().remove(&relid));
    }
}

/// Logs why inboxes were skipped, once per inbox and reason.
fn report(done: &Rebuilt) {
    for &(relid, why) in &done.skipped {
        if TOLD.with(|told| told.borrow_mut().insert(relid, why)) == Some(why) {
            continue;
        }
        let table = catalog::qualified_name(relid).unwrap_or_else(|| format!("relation {}", relid.to_u32()));
        match why {
            Skipped::Busy => server_log!(
                "pg_dedup worker: {table} is locked by another transaction; the Bloom filter does not answer for it \
                 until a later load can read it"
            ),
            Skipped::Unguarded(state) => server_log!(
                "pg_dedup worker: the {} trigger of {table} is {} and could not be repaired yet; the Bloom filter \
                 does not answer for it meanwhile",
                trigger::NAME,
                state.label()
            ),
            Skipped::NoRoom => server_log!(
                "pg_dedup worker: shared memory holds state for at most {} inboxes; the Bloom filter does not answer \
                 for {table} and its counters stay empty (drop unused inboxes)",
                shmem::MAX_INBOXES
            ),
        }
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    fn trusted(inbox: &str) -> bool {
        one::<bool>(&format!("SELECT filter_trusted FROM dedup.stats WHERE inbox = '{inbox}'"))
    }

    #[pg_test]
    fn rebuild_a_rotation_reloads_every_inbox_into_a_fresh_generation() {
        run("SELECT dedup.create_inbox('rb_rotate')");
        run("SELECT * FROM dedup.mark_many((SELECT array_agg('r' || g) FROM generate_series(1, 500) g), NULL, 'rb_rotate')");
        let rebuilds = one::<i64>("SELECT filter_rebuilds FROM dedup.filter_stats()");
        let keys = one::<i64>("SELECT dedup.bloom_rebuild()");
        assert!(keys >= 500, "the rows of this transaction are read too: {keys}");
        assert_eq!(one::<i64>("SELECT filter_rebuilds FROM dedup.filter_stats()"), rebuilds + 1);
        assert!(trusted("rb_rotate"));
        assert_eq!(count("generate_series(1, 500) g WHERE NOT dedup.seen('r' || g, 'rb_rotate')"), 0);
    }

    #[pg_test]
    fn rebuild_a_catch_up_load_trusts_only_what_it_loaded() {
        run("SELECT dedup.create_inbox('rb_catch_up')");
        let relid = one::<pg_sys::Oid>("SELECT 'dedup.inbox_rb_catch_up'::regclass::oid");
        crate::filter::untrust(crate::shmem::namespace(relid));
        assert!(!trusted("rb_catch_up"));
        assert!(crate::filter::untrusted(&[relid]) == [relid]);
        let done = super::run(false).expect("no other rebuild runs");
        assert!(done.inboxes >= 1);
        assert!(trusted("rb_catch_up"));
        assert!(crate::filter::untrusted(&[relid]).is_empty());
    }

    #[pg_test]
    fn rebuild_only_one_process_rebuilds_at_a_time() {
        let guard = crate::filter::try_begin_rebuild().expect("free");
        assert!(super::run(false).is_none(), "a second rebuild steps aside");
        assert_dedup_error("SELECT dedup.bloom_rebuild()", PgSqlErrorCode::ERRCODE_OBJECT_IN_USE);
        assert_eq!(one::<String>("SELECT filter_state FROM dedup.filter_stats()"), "rebuilding");
        drop(guard);
        assert!(super::run(false).is_some());
    }
}
