//! The `zz_dedup_attached` trigger (BEFORE INSERT, for each row, enabled always) and the per-backend cache of what
//! it needs per table: the attachment, and its key compiled for that table (a partition gets its own). Relcache
//! invalidations of the table (attach() and detach() re-create or drop the trigger; ALTER TABLE renames or drops
//! columns) make an entry stale (`relcache`); it is rebuilt at the next row.

use super::key::Key;
use super::{OnDuplicate, TRIGGER};
use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::relcache::{self, Stale};
use crate::shmem::Counter;
use crate::{input, mark};
use pgrx::prelude::*;
use std::cell::Cell;
use std::rc::Rc;

/// What the trigger needs for one table.
struct Attached {
    table: String,
    inbox: String,
    ttl: Option<Interval>,
    on_duplicate: OnDuplicate,
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
    let Some(super::registry::Attachment { key, inbox, ttl, on_duplicate, .. }) = super::registry::first_of(&tables)
    else {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("{table} has pg_dedup's trigger {TRIGGER} but is not attached"),
            format!("Attach it with dedup.attach('{table}', <key>), or drop the trigger: DROP TRIGGER {TRIGGER} ON {table};"),
        )
    };
    let on_duplicate = if on_duplicate == "error" { OnDuplicate::Error } else { OnDuplicate::Skip };
    // SAFETY: the relation is open; the key lives in memory of its own under the cache's long-lived context.
    let key = unsafe {
        Key::compile(rel, &key, &table, pg_sys::CacheMemoryContext, || {
            format!(
                "{table} changed since it was attached (a column renamed, or a function of the key renamed or moved?): \
                 attach it again with dedup.attach('{table}', <key>), or detach it."
            )
        })
    };
    Attached { table, inbox, ttl, on_duplicate, key, stale: Stale::of(relid), functions: FUNCTIONS.get() }
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

/// A row leaving a partition of an attached table: PostgreSQL runs an UPDATE that moves a row to another partition as
/// a DELETE from the old one and an INSERT into the new one (logical replication's apply too), and the INSERT must not
/// take the row's own key for a duplicate of itself (nor drop a row that exists, whatever the inbox of the partition
/// it moves to). Its keys (after the UPDATE, and before it), noted by the row's BEFORE UPDATE and BEFORE DELETE, are
/// let through by the very next BEFORE INSERT into a partition in the same statement, which fires right after them.
struct Moving {
    /// The transaction's and the statement's start: a later statement never matches.
    statement: (i64, i64),
    keys: Vec<String>,
    /// Its BEFORE DELETE has fired: it did leave its partition.
    deleted: bool,
}

thread_local! {
    static MOVING: std::cell::RefCell<Option<Moving>> = const { std::cell::RefCell::new(None) };
}

fn statement() -> (i64, i64) {
    // SAFETY: reads the backend's transaction and statement start times.
    unsafe { (pg_sys::GetCurrentTransactionStartTimestamp(), pg_sys::GetCurrentStatementStartTimestamp()) }
}

/// The BEFORE UPDATE or BEFORE DELETE of a row of a partition: what `Moving` needs. Never raises for a key it
/// cannot compute (an UPDATE is not deduplicated): such a row is simply not noted.
///
/// # Safety
/// `slot` must hold the row (the new one for an UPDATE, the old one for a DELETE) of `attached`'s table.
unsafe fn note_leaving(attached: &Attached, slot: *mut pg_sys::TupleTableSlot, deleting: bool) {
    // SAFETY: the caller vouches for the slot.
    let key = unsafe { attached.key.eval(slot, &attached.table, |key| key.map(str::to_owned)) };
    MOVING.with(|moving| {
        let mut moving = moving.borrow_mut();
        let same = moving.as_ref().is_some_and(|m| m.statement == statement() && !m.deleted);
        match (deleting, same) {
            // The DELETE half of a moving UPDATE: add the key before the UPDATE.
            (true, true) => {
                let m = moving.as_mut().expect("checked");
                m.keys.extend(key);
                m.deleted = true;
            }
            _ => *moving = Some(Moving { statement: statement(), keys: key.into_iter().collect(), deleted: deleting }),
        }
    });
}

/// Is the row being inserted into a partition with `key` a row moving between partitions (see `Moving`)? Either way
/// the note is used up.
fn moving_in(key: &str) -> bool {
    MOVING.with(|moving| {
        moving
            .borrow_mut()
            .take()
            .is_some_and(|m| m.deleted && m.statement == statement() && m.keys.iter().any(|k| k == key))
    })
}

/// The attachment trigger, BEFORE INSERT OR UPDATE OR DELETE, for each row. For an insert it marks the row's key in
/// the attachment's inbox, with the inserting role's rights, and lets the row through if the key is new; drops it
/// (`'skip'`) or raises an error (`'error'`) if it is a duplicate. Updates and deletes are not deduplicated: on a
/// partition they are noted so that a row moving to another partition is not taken for a duplicate of itself.
#[pg_trigger]
fn attached_insert<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::heap_tuple::PgHeapTupleError> {
    let data = trigger.trigger_data();
    let event = data.tg_event;
    let row_before = event & pg_sys::TRIGGER_EVENT_ROW != 0
        && event & pg_sys::TRIGGER_EVENT_TIMINGMASK == pg_sys::TRIGGER_EVENT_BEFORE;
    let operation = event & pg_sys::TRIGGER_EVENT_OPMASK;
    if !row_before || operation == pg_sys::TRIGGER_EVENT_TRUNCATE {
        raise(
            PgSqlErrorCode::ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED,
            "dedup.attached_insert() must fire BEFORE INSERT OR UPDATE OR DELETE, FOR EACH ROW",
            "Use dedup.attach() to set it up; it creates the trigger as it must be.",
        )
    }
    // SAFETY: a BEFORE row trigger's relation is open.
    let partition = unsafe { (*(*data.tg_relation).rd_rel).relispartition };
    if operation != pg_sys::TRIGGER_EVENT_INSERT {
        if partition {
            let deleting = operation == pg_sys::TRIGGER_EVENT_DELETE;
            // SAFETY: as above; the trigger's slot holds the old row, the new slot the updated one.
            unsafe {
                let attached = attached(data.tg_relation);
                note_leaving(&attached, if deleting { data.tg_trigslot } else { data.tg_newslot }, deleting);
            }
        }
        return Ok(if operation == pg_sys::TRIGGER_EVENT_DELETE { trigger.old() } else { trigger.new() });
    }
    // SAFETY: a BEFORE INSERT row trigger's relation is open and its slot holds the new row.
    let new = unsafe {
        let attached = attached(data.tg_relation);
        attached.key.eval(data.tg_trigslot, &attached.table, |key| {
            let key = input::key_of_row(key, &attached.table);
            if partition && moving_in(key) {
                return true;
            }
            let inbox = inbox::open(&attached.inbox, Access::Mark);
            let new = mark::mark_ids(&inbox, &[key], attached.ttl)[0];
            inbox.count(if new { Counter::RowsPassed } else { Counter::RowsDropped }, 1);
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
