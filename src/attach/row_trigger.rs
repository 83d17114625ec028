//! The `zz_dedup_attached` trigger (BEFORE INSERT, for each row, enabled always) and the per-backend cache of what
//! it needs per table: the attachment, and its key compiled for that table (a partition gets its own). Relcache
//! invalidations of the table (attach() and detach() re-create or drop the trigger; ALTER TABLE renames or drops
//! columns) make an entry stale (`relcache`); it is rebuilt at the next row.

use super::key::Key;
use super::{qualified_name, OnDuplicate, TRIGGER};
use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::mark;
use crate::relcache::{self, Stale};
use crate::shmem::Counter;
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
    let table = qualified_name(relid).unwrap_or_else(|| internal("naming an attached table", "it has no name"));
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
        Key::compile(rel, &key, pg_sys::CacheMemoryContext, || {
            format!(
                "{table} changed since it was attached (a column renamed or dropped?): attach it again with \
                 dedup.attach('{table}', <key>), or detach it."
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

/// The attachment trigger: marks the new row's key in the attachment's inbox, with the inserting role's rights, and
/// lets the row through if the key is new; drops it (`'skip'`) or raises an error (`'error'`) if it is a duplicate.
#[pg_trigger]
fn attached_insert<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::heap_tuple::PgHeapTupleError> {
    let data = trigger.trigger_data();
    let event = data.tg_event;
    let row_before_insert = event & pg_sys::TRIGGER_EVENT_OPMASK == pg_sys::TRIGGER_EVENT_INSERT
        && event & pg_sys::TRIGGER_EVENT_ROW != 0
        && event & pg_sys::TRIGGER_EVENT_TIMINGMASK == pg_sys::TRIGGER_EVENT_BEFORE;
    if !row_before_insert {
        raise(
            PgSqlErrorCode::ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED,
            "dedup.attached_insert() must fire BEFORE INSERT, FOR EACH ROW",
            "Use dedup.attach() to set it up; it creates the trigger as it must be.",
        )
    }
    // SAFETY: a BEFORE INSERT row trigger's relation is open and its slot holds the new row.
    let new = unsafe {
        let attached = attached(data.tg_relation);
        attached.key.eval(data.tg_trigslot, &attached.table, |key| {
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
