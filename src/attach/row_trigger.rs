//! The `zz_dedup_attached` trigger (BEFORE INSERT, for each row, enabled always) and the per-backend cache of what
//! it needs per table: the attachment, and its key compiled for that table (a partition gets its own). Relcache
//! invalidations of the table (attach() and detach() re-create or drop the trigger; ALTER TABLE renames or drops
//! columns) mark an entry stale; it is rebuilt at the next row, never freed from inside the callback.

use super::key::Key;
use super::{qualified_name, OnDuplicate, TRIGGER};
use crate::claim;
use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::rights;
use crate::shmem::Counter;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// What the trigger needs for one table.
struct Attached {
    table: String,
    inbox: String,
    ttl: Option<Interval>,
    on_duplicate: OnDuplicate,
    key: Key,
    stale: Cell<bool>,
}

thread_local! {
    static CACHE: RefCell<HashMap<pg_sys::Oid, Rc<Attached>>> = RefCell::new(HashMap::new());
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
    /// Some entry went stale since the last sweep.
    static SOME_STALE: Cell<bool> = const { Cell::new(false) };
}

#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    CACHE.with(|cache| {
        if let Ok(cache) = cache.try_borrow() {
            for (table, attached) in cache.iter() {
                if relid == pg_sys::InvalidOid || relid == *table {
                    attached.stale.set(true);
                    SOME_STALE.set(true);
                }
            }
        }
    });
}

/// The attachment of table `rel` (or of the partitioned table above it: pg_partition_ancestors() lists a partition's
/// ancestors, and nothing for a table that is no partition), read from the registry as the extension's owner, with
/// its key compiled for `rel`.
///
/// # Safety
/// `rel` must be the trigger's open relation.
unsafe fn load(rel: pg_sys::Relation) -> Attached {
    // SAFETY: the caller vouches for the relation.
    let relid = unsafe { (*rel).rd_id };
    let table = qualified_name(relid).unwrap_or_else(|| internal("naming an attached table", "it has no name"));
    let row = rights::as_extension_owner(TRIGGER, || {
        Spi::connect(|client| {
            client
                .select(
                    "SELECT key, inbox, ttl, on_duplicate FROM dedup.attachment_registry \
                      WHERE tbl OPERATOR(pg_catalog.=) $1 \
                         OR tbl IN (SELECT relid FROM pg_catalog.pg_partition_ancestors($1)) LIMIT 1",
                    None,
                    &[relid.into()],
                )
                .unwrap_or_else(|e| internal("reading dedup.attachment_registry", e))
                .next()
                .map(|row| {
                    let text = |i| row.get::<String>(i).ok().flatten().unwrap_or_default();
                    (text(1), text(2), row.get::<Interval>(3).ok().flatten(), text(4))
                })
        })
    });
    let Some((key, inbox, ttl, on_duplicate)) = row else {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("{table} has pg_dedup's trigger {TRIGGER} but is not attached"),
            format!("Attach it with dedup.attach('{table}', <key>), or drop the trigger: DROP TRIGGER {TRIGGER} ON {table};"),
        )
    };
    let on_duplicate = if on_duplicate == "error" { OnDuplicate::Error } else { OnDuplicate::Skip };
    // SAFETY: the relation is open; the key lives in memory of its own under the cache's long-lived context.
    let key = unsafe { Key::compile(rel, &key, pg_sys::CacheMemoryContext) };
    Attached { table, inbox, ttl, on_duplicate, key, stale: Cell::new(false) }
}

/// The cached attachment of the trigger's table, (re)built when missing or stale.
///
/// # Safety
/// As for `load`.
unsafe fn attached(rel: pg_sys::Relation) -> Rc<Attached> {
    if !CALLBACK_REGISTERED.with(|r| r.replace(true)) {
        // SAFETY: registers a guarded callback for the rest of the backend's life (there is no unregistering).
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(on_relcache_invalidation), pg_sys::Datum::from(0)) };
    }
    // SAFETY: the caller vouches for the relation.
    let relid = unsafe { (*rel).rd_id };
    // Stale entries go first (an entry in use further up the stack lives on through its Rc).
    if SOME_STALE.replace(false) {
        CACHE.with(|c| c.borrow_mut().retain(|_, attached| !attached.stale.get()));
    }
    if let Some(attached) = CACHE.with(|c| c.borrow().get(&relid).cloned()) {
        return attached;
    }
    // SAFETY: as above.
    let attached = Rc::new(unsafe { load(rel) });
    CACHE.with(|c| c.borrow_mut().insert(relid, attached.clone()));
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
            let new = claim::mark(&inbox, &[key], attached.ttl)[0];
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
