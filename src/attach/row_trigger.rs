//! The `zz_dedup_attached` trigger (BEFORE INSERT, for each row, enabled always) and the per-backend cache of what
//! it needs per table: the attachment, and its key compiled for that table (a partition gets its own). Relcache
//! invalidations of the table (attach() and detach() re-create or drop the trigger; ALTER TABLE renames or drops
//! columns) make an entry stale (`relcache`); it is rebuilt at the next row.

use super::key::Key;
use super::{batch, OnDuplicate, TRIGGER};
use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::relcache::{self, Stale};
use crate::shmem::Counter;
use crate::{gate, input, mark};
use pgrx::prelude::*;
use std::cell::Cell;
use std::rc::Rc;

/// What the trigger needs for one table.
struct Attached {
    table: String,
    inbox: String,
    ttl: Option<Interval>,
    on_duplicate: OnDuplicate,
    /// Certainly-new keys wait in memory for a flush (`batch`).
    batched: bool,
    key: Key,
    stale: Stale,
    /// `FUNCTIONS` when the key was compiled.
    functions: u64,
}

impl relcache::Entry for Attached {
    fn stale(&self) -> &Stale {
        &self.stale
    }
}

thread_local! {
    static CACHE: relcache::Cache<pg_sys::Oid, Attached> = relcache::Cache::default();
    /// Bumped whenever a function changes or goes (a syscache invalidation of pg_proc): a compiled key has
    /// resolved its functions, and inlined the SQL ones, so every key compiled before is compiled again. (Dropping
    /// a function a key calls is refused, see the module comment of `attach`; replacing one is not.)
    static FUNCTIONS: Cell<u64> = const { Cell::new(0) };
}

/// # Safety
/// Called by Postgres only, when it processes invalidations of pg_proc; it only bumps a counter.
#[pg_guard]
unsafe extern "C-unwind" fn on_function_change(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    FUNCTIONS.set(FUNCTIONS.get() + 1);
}

/// The attachment of table `rel` (or of the partitioned table above it), with its key compiled for `rel`.
///
/// # Safety
/// `rel` must be the trigger's open relation.
unsafe fn load(rel: pg_sys::Relation) -> Attached {
    // SAFETY: the caller vouches for the relation.
    let relid = unsafe { (*rel).rd_id };
    let table =
        crate::catalog::qualified_name(relid).unwrap_or_else(|| internal("naming an attached table", "it has no name"));
    // The table itself, then (a partition) its ancestors, nearest first: pg_partition_ancestors() lists a
    // partition itself and its ancestors, and nothing for a table that is no partition. It needs no privilege.
    let mut tables = vec![relid];
    tables.extend(Spi::connect(|client| {
        client
            .select("SELECT relid FROM pg_catalog.pg_partition_ancestors($1)", None, &[relid.into()])
            .unwrap_or_else(|e| internal("finding the partitioned tables above a partition", e))
            .filter_map(|row| row.get::<pg_sys::Oid>(1).ok().flatten())
            .collect::<Vec<_>>()
    }));
    // What a hint names: the table at the top of the partition tree, where the trigger was made.
    let top = tables.last().and_then(|t| crate::catalog::qualified_name(*t)).unwrap_or_else(|| table.clone());
    let Some(super::registry::Attachment { tbl, key, inbox, ttl, on_duplicate, batched }) =
        super::registry::first_of(&tables)
    else {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("{table} has pg_dedup's trigger {TRIGGER} but is not attached"),
            format!(
                "Attach it with dedup.attach('{top}', <key>) (a schema-only restore leaves the attachment out), or drop \
                 the trigger: DROP TRIGGER {TRIGGER} ON {top};"
            ),
        )
    };
    let attached_table = crate::catalog::qualified_name(tbl).unwrap_or_else(|| top.clone());
    let on_duplicate = if on_duplicate == "error" { OnDuplicate::Error } else { OnDuplicate::Skip };
    // SAFETY: the relation is open; the key lives in memory of its own under the cache's long-lived context.
    let key = unsafe {
        Key::compile(rel, &key, &table, pg_sys::CacheMemoryContext, || {
            format!(
                "{table} changed since it was attached (a column renamed, or a function of the key renamed or moved?): \
                 attach {attached_table} again with dedup.attach('{attached_table}', <key>), or detach it."
            )
        })
    };
    Attached { table, inbox, ttl, on_duplicate, batched, key, stale: Stale::of(relid), functions: FUNCTIONS.get() }
}

/// The cached attachment of the trigger's table, (re)built when missing or stale.
///
/// # Safety
/// As for `load`.
unsafe fn attached(rel: pg_sys::Relation) -> Rc<Attached> {
    // SAFETY: the caller vouches for the relation.
    let relid = unsafe { (*rel).rd_id };
    thread_local! {
        static WATCHING: Cell<bool> = const { Cell::new(false) };
    }
    if !WATCHING.replace(true) {
        // SAFETY: registers a guarded callback for the rest of the backend's life (there is no unregistering).
        unsafe {
            pg_sys::CacheRegisterSyscacheCallback(
                pg_sys::SysCacheIdentifier::PROCOID as i32,
                Some(on_function_change),
                pg_sys::Datum::from(0),
            )
        };
    }
    if let Some(attached) = CACHE.with(|c| c.get(&relid)).filter(|a| a.functions == FUNCTIONS.get()) {
        return attached;
    }
    // SAFETY: as above.
    let attached = Rc::new(unsafe { load(rel) });
    CACHE.with(|c| c.insert(relid, attached.clone()));
    attached
}

/// A row leaving a partition: PostgreSQL runs an UPDATE (or MERGE) that moves a row to another partition as a DELETE
/// from the old partition and an INSERT into the new one, and logical replication's apply does the same for such an
/// update; the INSERT must not take the row for a duplicate of itself. The row's BEFORE UPDATE notes where its old
/// version is (the apply's BEFORE DELETE, as it fires no BEFORE UPDATE); the next BEFORE INSERT into a partition of
/// the same partitioned table lets the row through unmarked if that old version is, by then, deleted by this very
/// transaction as one that moved to another partition (PostgreSQL marks it so; the apply deletes it in the same
/// command as it inserts the new one). A row deleted by a DELETE, or updated in place, is never taken for a move.
#[derive(Clone, Copy)]
struct Leaving {
    relid: pg_sys::Oid,
    tid: pg_sys::ItemPointerData,
    /// For the apply's delete: the command it ran in, which its insert shares.
    apply_command: Option<pg_sys::CommandId>,
}

thread_local! {
    static LEAVING: Cell<Option<Leaving>> = const { Cell::new(None) };
}

/// Is this process logical replication's apply?
pub(super) fn in_apply_worker() -> bool {
    // SAFETY: reads the background worker entry of this process (NULL in a backend).
    unsafe {
        let entry = pg_sys::MyBgworkerEntry;
        !entry.is_null()
            && std::ffi::CStr::from_ptr((*entry).bgw_type.as_ptr()).to_bytes().starts_with(b"logical replication")
    }
}

/// What became of the old version at `leaving`: Some(true) it left by a move (see `Leaving`), Some(false) it went
/// otherwise (or is gone) and never will move, None not yet changed.
fn left_by_move(leaving: &Leaving) -> Option<bool> {
    // SAFETY: the partition is locked by the statement that changes it (or is gone: then None from the open); the
    // tuple version is fetched with SnapshotAny into a slot of our own and its header only read, then dropped.
    unsafe {
        let rel = pg_sys::try_relation_open(leaving.relid, pg_sys::NoLock as pg_sys::LOCKMODE);
        if rel.is_null() {
            return Some(false);
        }
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let mut tid = leaving.tid;
        let outcome = if pg_sys::table_tuple_fetch_row_version(rel, &mut tid, &raw mut pg_sys::SnapshotAnyData, slot) {
            let mut free = false;
            let tuple = pg_sys::ExecFetchSlotHeapTuple(slot, false, &mut free);
            let header = (*tuple).t_data;
            let infomask = (*header).t_infomask as u32;
            if infomask & pg_sys::HEAP_XMAX_INVALID != 0 || infomask & pg_sys::HEAP_XMAX_LOCK_ONLY != 0 {
                None
            } else {
                let xmax = if infomask & pg_sys::HEAP_XMAX_IS_MULTI != 0 {
                    pg_sys::HeapTupleGetUpdateXid(header)
                } else {
                    (*header).t_choice.t_heap.t_xmax
                };
                let ctid = (*header).t_ctid;
                let moved = ctid.ip_posid as u32 == pg_sys::MovedPartitionsOffsetNumber
                    && ctid.ip_blkid.bi_hi == u16::MAX
                    && ctid.ip_blkid.bi_lo == u16::MAX;
                let same_command = leaving.apply_command.is_some_and(|c| c == pg_sys::GetCurrentCommandId(false));
                Some(pg_sys::TransactionIdIsCurrentTransactionId(xmax) && (moved || same_command))
            }
        } else {
            Some(false)
        };
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        outcome
    }
}

/// The partitioned table at the top of `relid`'s partition tree.
fn partition_root(relid: pg_sys::Oid) -> Option<pg_sys::Oid> {
    Spi::get_one_with_args::<pg_sys::Oid>("SELECT pg_catalog.pg_partition_root($1)", &[relid.into()]).ok().flatten()
}

/// Is the row being inserted into partition `relid` a row moving from another partition of its table (`Leaving`)?
/// Only then is the note used up; one that can no longer be a move is dropped.
fn moving_in(relid: pg_sys::Oid) -> bool {
    let Some(leaving) = LEAVING.get() else { return false };
    match left_by_move(&leaving) {
        Some(true) if partition_root(leaving.relid) == partition_root(relid) => {
            LEAVING.set(None);
            true
        }
        Some(false) => {
            LEAVING.set(None);
            false
        }
        _ => false,
    }
}

/// The attachment trigger, BEFORE INSERT OR UPDATE OR DELETE, for each row. For an insert it marks the row's key in
/// the attachment's inbox, with the inserting role's rights, and lets the row through if the key is new; drops it
/// (`'skip'`) or raises an error (`'error'`) if it is a duplicate. Updates and deletes are not deduplicated, and run
/// no key: on a partition, where the old version of the row is is noted (`Leaving`), so that a row moving to another
/// partition is not taken for a duplicate of itself. A batched attachment (`batch`) also has it AFTER INSERT, for
/// each statement: the statement's remembered keys go into their inboxes.
#[pg_trigger]
fn attached_insert<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::heap_tuple::PgHeapTupleError> {
    let data = trigger.trigger_data();
    let event = data.tg_event;
    let timing = event & pg_sys::TRIGGER_EVENT_TIMINGMASK;
    let row = event & pg_sys::TRIGGER_EVENT_ROW != 0;
    let operation = event & pg_sys::TRIGGER_EVENT_OPMASK;
    if !row && timing == pg_sys::TRIGGER_EVENT_AFTER && operation == pg_sys::TRIGGER_EVENT_INSERT {
        batch::flush_all();
        return Ok(None);
    }
    if !row || timing != pg_sys::TRIGGER_EVENT_BEFORE || operation == pg_sys::TRIGGER_EVENT_TRUNCATE {
        raise(
            PgSqlErrorCode::ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED,
            "dedup.attached_insert() must fire BEFORE INSERT OR UPDATE OR DELETE, FOR EACH ROW (or, for a batched \
             attachment, AFTER INSERT, FOR EACH STATEMENT)",
            "Use dedup.attach() to set it up; it creates the triggers as they must be.",
        )
    }
    // SAFETY: a BEFORE row trigger's relation is open.
    let (relid, partition) = unsafe { ((*data.tg_relation).rd_id, (*(*data.tg_relation).rd_rel).relispartition) };
    if operation != pg_sys::TRIGGER_EVENT_INSERT {
        let deleting = operation == pg_sys::TRIGGER_EVENT_DELETE;
        // The executor's move fires BEFORE UPDATE on the old partition; the apply's fires only BEFORE DELETE.
        if partition && (!deleting || in_apply_worker()) {
            // SAFETY: the trigger's slot holds the old row, read from its partition (its tid set).
            let tid = unsafe { (*data.tg_trigslot).tts_tid };
            // SAFETY: reads the current command id.
            let apply_command = deleting.then(|| unsafe { pg_sys::GetCurrentCommandId(false) });
            LEAVING.set(Some(Leaving { relid, tid, apply_command }));
        }
        return Ok(if deleting { trigger.old() } else { trigger.new() });
    }
    if partition && moving_in(relid) {
        return Ok(trigger.new());
    }
    // SAFETY: a BEFORE INSERT row trigger's relation is open and its slot holds the new row.
    let new = unsafe {
        let attached = attached(data.tg_relation);
        attached.key.eval(data.tg_trigslot, &attached.table, |key| {
            let key = input::key_of_row(key, &attached.table);
            let new = if attached.batched { mark_batched(&attached, key) } else { mark_now(&attached, key) };
            if !new && attached.on_duplicate == OnDuplicate::Error {
                raise(
                    PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION,
                    format!(
                        "duplicate row for {}: key \"{key}\" was inserted before, within its window (inbox \"{}\")",
                        attached.table, attached.inbox
                    ),
                    "Leave repeats out of what you insert, or attach the table with on_duplicate => 'skip'.",
                )
            }
            new
        })
    };
    Ok(if new { trigger.new() } else { None })
}

/// Marks a row's key at once; whether it was new.
fn mark_now(attached: &Attached, key: &str) -> bool {
    let inbox = inbox::open(&attached.inbox, Access::Mark);
    let new = mark::mark_ids(&inbox, &[key], attached.ttl)[0];
    inbox.count(if new { Counter::RowsPassed } else { Counter::RowsDropped }, 1);
    new
}

/// Marks a row's key for a batched attachment: remembered for the flush when the filter vouches for it, a duplicate
/// when it is remembered already, else marked at once; whether it was new.
fn mark_batched(attached: &Attached, key: &str) -> bool {
    let inbox = inbox::open_unflushed(&attached.inbox, Access::Mark);
    let new = match batch::remembered(&inbox, key) {
        Some(true) => {
            inbox.count(Counter::Duplicates, 1);
            false
        }
        // Its window ended: new again, and remembered again.
        Some(false) => {
            batch::remember(&inbox, key, attached.ttl);
            true
        }
        None if !batch::may_wait(&inbox) => mark::mark_ids(&inbox, &[key], attached.ttl)[0],
        None => match gate::certainly_new(&inbox, key) {
            Some(true) => {
                batch::remember(&inbox, key, attached.ttl);
                true
            }
            // Marked at once, with the answer the filter gave (asked again, it would count the lookup twice).
            answer => mark::mark_answered(&inbox, key, attached.ttl, answer),
        },
    };
    inbox.count(if new { Counter::RowsPassed } else { Counter::RowsDropped }, 1);
    new
}
