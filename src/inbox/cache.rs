//! The per-backend cache of open inboxes: name → table, default TTL and prepared statements, so a call neither
//! parses nor plans SQL. Relcache invalidations (DROP TABLE, ALTER TABLE, ...) mark entries stale; they are reloaded
//! at the next call, never freed from inside the invalidation callback (a plan may be running).

use super::{registry, Access, Inbox};
use crate::errors::raise;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    static CACHE: RefCell<HashMap<String, Rc<Inbox>>> = RefCell::new(HashMap::new());
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    CACHE.with(|cache| {
        if let Ok(cache) = cache.try_borrow() {
            for inbox in cache.values() {
                if relid == pg_sys::InvalidOid || relid == inbox.relid {
                    inbox.stale.set(true);
                }
            }
        }
    });
}

/// Finds an inbox, checks the caller's privileges on its table and locks it for `access`.
pub fn open(name: &str, access: Access) -> Rc<Inbox> {
    if !CALLBACK_REGISTERED.with(|r| r.replace(true)) {
        // SAFETY: registers a guarded callback for the rest of the backend's life (there is no unregistering).
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(on_relcache_invalidation), pg_sys::Datum::from(0)) };
    }
    loop {
        let cached = CACHE.with(|c| c.borrow().get(name).cloned()).filter(|inbox| !inbox.stale.get());
        let inbox = cached.unwrap_or_else(|| {
            let inbox = Rc::new(registry::load(name));
            CACHE.with(|c| c.borrow_mut().insert(name.to_owned(), inbox.clone()));
            inbox
        });
        let mask = access.acl_mask();
        // SAFETY: an ACL check of a relation that exists (just loaded or still cached and not invalidated).
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
        // Lock as the executor would, before running any plan: taking the lock processes pending invalidations,
        // so an inbox dropped concurrently shows up here as stale (and then unknown), not as a raw error deep
        // inside a cached plan.
        // SAFETY: locks a relation by oid; held until the transaction ends.
        unsafe { pg_sys::LockRelationOid(inbox.relid, access.lock_mode()) };
        if !inbox.stale.get() {
            return inbox;
        }
    }
}
