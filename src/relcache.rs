//! Per-backend caches of what is built from a table (an open inbox with its plans, an attached table's key
//! compiled for it). Any relcache invalidation of the table (DDL, DROP TABLE, Citus distributing it) makes the
//! entries built from it stale; a stale entry is rebuilt at the next lookup. Entries are never freed from inside
//! the invalidation callback (a plan of one may be running): the next lookup after an invalidation sweeps the
//! stale ones out, so a table dropped for good does not keep its entry for the life of a pooled connection.

use pgrx::prelude::*;
use rustc_hash::FxHashMap as HashMap;
use std::borrow::Borrow;
use std::cell::{Cell, RefCell};
use std::hash::Hash;
use std::rc::{Rc, Weak};

thread_local! {
    /// The table each live entry was built from, and the entry's flag.
    static WATCHED: RefCell<Vec<(pg_sys::Oid, Weak<Cell<bool>>)>> = const { RefCell::new(Vec::new()) };
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
    /// Bumped whenever some entry goes stale: a cache sweeps when it changed since its last sweep.
    static EPOCH: Cell<u64> = const { Cell::new(0) };
}

/// # Safety
/// Called by Postgres only, when it processes relcache invalidations; it only sets flags.
#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    WATCHED.with(|watched| {
        if let Ok(watched) = watched.try_borrow() {
            for (table, flag) in watched.iter() {
                if let Some(flag) = flag.upgrade().filter(|_| relid == pg_sys::InvalidOid || relid == *table) {
                    flag.set(true);
                    EPOCH.set(EPOCH.get() + 1);
                }
            }
        }
    });
}

/// Whether an entry built from a table went stale (the table changed since); `Stale::of` starts watching.
pub struct Stale(Rc<Cell<bool>>);

impl Stale {
    /// A fresh flag, set by the next invalidation of table `relid`.
    pub fn of(relid: pg_sys::Oid) -> Stale {
        if !CALLBACK_REGISTERED.replace(true) {
            // SAFETY: registers a guarded callback for the rest of the backend's life (there is no unregistering).
            unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(on_relcache_invalidation), pg_sys::Datum::from(0)) };
        }
        let flag = Rc::new(Cell::new(false));
        WATCHED.with(|w| {
            let mut w = w.borrow_mut();
            w.retain(|(_, f)| f.strong_count() > 0);
            w.push((relid, Rc::downgrade(&flag)));
        });
        Stale(flag)
    }

    pub fn get(&self) -> bool {
        self.0.get()
    }

    /// Marks the entry stale by hand (its table was found gone).
    pub fn set(&self) {
        self.0.set(true);
        EPOCH.set(EPOCH.get() + 1);
    }
}

/// What a cache holds: entries that know whether they went stale.
pub trait Entry {
    fn stale(&self) -> &Stale;
}

/// A per-backend cache of `V`s by `K`, which never answers with a stale entry. Looked up on every call of most
/// functions, so keyed by a fast non-cryptographic hash (the keys are the caller's own inbox names and tables).
pub struct Cache<K, V> {
    entries: RefCell<HashMap<K, Rc<V>>>,
    swept: Cell<u64>,
}

impl<K: Hash + Eq, V: Entry> Default for Cache<K, V> {
    fn default() -> Self {
        Cache { entries: RefCell::new(HashMap::default()), swept: Cell::new(0) }
    }
}

impl<K: Hash + Eq, V: Entry> Cache<K, V> {
    /// The live entry for `key`, after sweeping out the stale ones if any went stale since the last sweep
    /// (dropping an entry frees what it holds; one still in use up the stack goes with its last user).
    pub fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<Rc<V>>
    where
        K: Borrow<Q>,
    {
        let epoch = EPOCH.get();
        if self.swept.replace(epoch) != epoch {
            self.entries.borrow_mut().retain(|_, v| !v.stale().get());
        }
        self.entries.borrow().get(key).filter(|v| !v.stale().get()).cloned()
    }

    pub fn insert(&self, key: K, value: Rc<V>) {
        self.entries.borrow_mut().insert(key, value);
    }
}
