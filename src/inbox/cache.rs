//! The per-backend cache of open inboxes: name → table, default TTL and prepared statements, so a call neither
//! parses nor plans SQL. Relcache invalidations (DROP TABLE, ALTER TABLE, ...) make entries stale (`relcache`);
//! they are reloaded at the next call.

use super::{registry, Access, Inbox};
use crate::errors::raise;
use crate::{relcache, unguarded};
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

thread_local! {
    static CACHE: relcache::Cache<String, Inbox> = relcache::Cache::default();
    /// The last inbox opened, and how (`Opened`): the same open again needs neither the lock (held) nor the
    /// privilege check (nothing it depends on changed).
    static LAST: RefCell<Option<(Opened, Rc<Inbox>)>> = const { RefCell::new(None) };
    /// Bumped by whatever can change a repeated open's answer: an invalidation of what a table privilege check
    /// reads (pg_class: a table's ACL and owner; pg_authid: superuser; pg_auth_members: role membership;
    /// pg_database: its owner, whom `pg_database_owner` stands for), a subtransaction's rollback (which may release
    /// locks taken before it began: a cursor's, whose portal it aborts), and a transaction's end.
    static EPOCH: Cell<u64> = const { Cell::new(0) };
    static WATCHING: Cell<bool> = const { Cell::new(false) };
}

/// # Safety
/// Called by Postgres only, when it processes syscache invalidations; it only bumps a counter.
#[pg_guard]
unsafe extern "C-unwind" fn on_privileges_change(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    EPOCH.set(EPOCH.get() + 1);
}

/// # Safety
/// Called by Postgres only, at the end of a subtransaction; it only bumps a counter.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_subtransaction(
    event: pg_sys::SubXactEvent::Type,
    _sub: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        EPOCH.set(EPOCH.get() + 1);
    }
}

/// # Safety
/// Called by Postgres only, at the end of a transaction; it only bumps a counter.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_transaction(_event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    EPOCH.set(EPOCH.get() + 1);
}

/// An open of an inbox, as far as repeating it is concerned: for what, whether privileges were checked, by whom,
/// in which (sub)transaction, and in which `EPOCH`. The lock is still held while the subtransaction it was taken
/// in is the current one (a subtransaction's id is never reused in its transaction) and nothing rolled back since.
#[derive(PartialEq)]
struct Opened {
    access: Access,
    checked: bool,
    transaction: pg_sys::LocalTransactionId,
    subtransaction: pg_sys::SubTransactionId,
    user: pg_sys::Oid,
    epoch: u64,
}

impl Opened {
    fn now(access: Access, checked: bool) -> Opened {
        if !WATCHING.replace(true) {
            // SAFETY: registers guarded callbacks for the rest of the backend's life.
            unsafe {
                pg_sys::RegisterXactCallback(Some(at_end_of_transaction), std::ptr::null_mut());
                pg_sys::RegisterSubXactCallback(Some(at_end_of_subtransaction), std::ptr::null_mut());
            }
            for cache in [
                pg_sys::SysCacheIdentifier::RELOID,
                pg_sys::SysCacheIdentifier::AUTHOID,
                pg_sys::SysCacheIdentifier::AUTHMEMROLEMEM,
                pg_sys::SysCacheIdentifier::DATABASEOID,
            ] {
                // SAFETY: registers a guarded callback for the rest of the backend's life.
                unsafe {
                    pg_sys::CacheRegisterSyscacheCallback(
                        cache as i32,
                        Some(on_privileges_change),
                        pg_sys::Datum::from(0),
                    )
                };
            }
        }
        // SAFETY: reads backend-local state; MyProc is set in every backend that runs SQL. The two calls under one
        // guard (`unguarded`): the closure holds numbers only.
        unsafe {
            #[cfg(any(feature = "pg17", feature = "pg18"))]
            let transaction = (*pg_sys::MyProc).vxid.lxid;
            #[cfg(not(any(feature = "pg17", feature = "pg18")))]
            let transaction = (*pg_sys::MyProc).lxid;
            let (subtransaction, user) = unguarded::guarded(|pg| (pg.GetCurrentSubTransactionId(), pg.GetUserId()));
            Opened { access, checked, transaction, subtransaction, user, epoch: EPOCH.get() }
        }
    }
}

/// Finds an inbox, checks the caller's privileges on its table and locks it for `access`. To mark or delete, the
/// keys a batched attachment still holds in memory for it go into its table first (`attach::batch`), so that what
/// the caller writes meets them there; reading needs no flush (`seen()` asks the batch itself), and must not write.
pub fn open(name: &str, access: Access) -> Rc<Inbox> {
    if access != Access::Read {
        crate::attach::flush_batch(name);
    }
    open_unflushed(name, access)
}

/// The inbox for a batched attachment's flush: opened and locked for marking, its privileges not checked again
/// (each key's inserter passed `open_unflushed` for it when the key was remembered).
pub fn reopen(name: &str) -> Rc<Inbox> {
    open_checked(name, Access::Mark, false)
}

/// `open`, leaving a batched attachment's keys in memory (for that attachment's own trigger).
pub fn open_unflushed(name: &str, access: Access) -> Rc<Inbox> {
    open_checked(name, access, true)
}

fn open_checked(name: &str, access: Access, check: bool) -> Rc<Inbox> {
    // A row trigger opens its inbox for every row of a COPY, a loop of mark() for every id: the lock and the
    // privilege check were 1.2 k instructions a row (callgrind), for an answer that cannot have changed.
    let opened = Opened::now(access, check);
    let again = LAST.with(|last| {
        last.borrow()
            .as_ref()
            .filter(|(o, inbox)| *o == opened && inbox.name == name && !inbox.stale.get())
            .map(|(_, i)| i.clone())
    });
    if let Some(inbox) = again {
        return inbox;
    }
    let inbox = lock_and_check(name, access, check);
    LAST.with(|last| *last.borrow_mut() = Some((opened, inbox.clone())));
    inbox
}

fn lock_and_check(name: &str, access: Access, check: bool) -> Rc<Inbox> {
    loop {
        let cached = CACHE.with(|c| c.get(name));
        let loaded = cached.is_none();
        let inbox = cached.unwrap_or_else(|| {
            let inbox = Rc::new(registry::load(name));
            CACHE.with(|c| c.insert(name.to_owned(), inbox.clone()));
            inbox
        });
        // Lock as the executor would, before running any plan. Taking the lock waits for a transaction dropping
        // or creating the table to finish, and then processes its invalidations: an inbox dropped concurrently
        // shows up here as stale (its table's invalidation, or a lost one's reset, reached the entry), or, when
        // it went after the catalogs were read for a fresh entry, as a table that no longer exists; the loop then
        // looks it up again (then: "does not exist"), instead of a raw error deep inside a cached plan or the
        // privilege check. (A cached entry needs no such catalog lookup on every call: its table's drop reaches
        // it as an invalidation.)
        // SAFETY: locks a relation by oid (held until the transaction ends).
        unsafe { pg_sys::LockRelationOid(inbox.relid, access.lock_mode()) };
        if loaded && !crate::catalog::relation_exists(inbox.relid) {
            inbox.stale.set();
        }
        if inbox.stale.get() {
            continue;
        }
        // The cheap test first: one-node inboxes outside Citus's task backends pay one prefix comparison.
        if crate::citus::task_backend() && !inbox.shape().distributed {
            crate::citus::refuse_task_on_local_inbox(name);
        }
        if !check {
            return inbox;
        }
        let mask = access.acl_mask();
        // SAFETY: an ACL check of a relation that exists and is locked.
        let granted = unsafe {
            pg_sys::pg_class_aclmask(inbox.relid, pg_sys::GetUserId(), mask, pg_sys::AclMaskHow::ACLMASK_ALL)
        };
        if granted != mask {
            raise(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!("permission denied for inbox \"{name}\""),
                access.grant_hint(&inbox.table),
            )
        }
        return inbox;
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::inbox::{open, Access};
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn cache_an_inbox_is_opened_once_and_reloaded_after_ddl() {
        run("SELECT dedup.create_inbox('cached')");
        let first = open("cached", Access::Read);
        let again = open("cached", Access::Read);
        assert!(std::rc::Rc::ptr_eq(&first, &again), "the second open is served from the cache");
        run("ALTER TABLE dedup.inbox_cached SET (fillfactor = 90)");
        let after = open("cached", Access::Read);
        assert!(!std::rc::Rc::ptr_eq(&first, &after), "DDL on the table reloads the entry");
        assert!(first.stale.get());
    }

    #[pg_test]
    fn cache_entries_of_dropped_inboxes_are_freed_at_the_next_call() {
        run("SELECT dedup.create_inbox('short_lived')");
        let weak = std::rc::Rc::downgrade(&open("short_lived", Access::Read));
        run("SELECT dedup.drop_inbox('short_lived')");
        let _ = open("default", Access::Read);
        assert!(weak.upgrade().is_none(), "the dropped inbox's entry (and its plans) were freed");
    }

    #[pg_test]
    fn cache_privileges_are_checked_on_every_open() {
        run(
            "CREATE ROLE cache_reader; GRANT USAGE ON SCHEMA dedup TO cache_reader;
             GRANT SELECT ON dedup.inbox_registry TO cache_reader; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dedup TO cache_reader;
             GRANT SELECT ON dedup.inbox_default TO cache_reader;
             SELECT dedup.seen('warm-the-cache')",
        );
        run("SET LOCAL ROLE cache_reader");
        assert!(!one::<bool>("SELECT dedup.seen('x')"), "reading is granted");
        assert_dedup_error("SELECT dedup.mark('x')", PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
        let (_, message) = error_of("SELECT dedup.forget('x')");
        run("RESET ROLE");
        assert!(message.contains("permission denied for inbox \"default\""), "{message}");
    }

    #[pg_test]
    fn cache_a_repeated_open_sees_a_privilege_revoked_since() {
        // Granted through a group: revoking the membership changes nothing on the table (no invalidation of the
        // inbox's entry), only what the privilege check reads.
        run("CREATE ROLE cache_group; CREATE ROLE cache_writer IN ROLE cache_group;
             GRANT USAGE ON SCHEMA dedup TO cache_writer; GRANT SELECT ON dedup.inbox_registry TO cache_writer;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dedup TO cache_writer;
             SELECT dedup.create_inbox('revoked');
             GRANT SELECT, INSERT, UPDATE ON dedup.inbox_revoked TO cache_group");
        // Both marks in one subtransaction (the block's), as a statement's rows are: a repeated open.
        run("DO $$ BEGIN
               SET LOCAL ROLE cache_writer;
               PERFORM dedup.mark('first', NULL, 'revoked');
               RESET ROLE;
               REVOKE cache_group FROM cache_writer;
               SET LOCAL ROLE cache_writer;
               PERFORM dedup.mark('second', NULL, 'revoked');
               RAISE EXCEPTION 'the second mark was let through';
             EXCEPTION WHEN insufficient_privilege THEN RESET ROLE;
             END $$");
    }
}
