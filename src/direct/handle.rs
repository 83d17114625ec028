//! Write handles on inbox tables (and on `dedup.attempt_counts`, for the worker), one per table, kept for the life of
//! the backend: the table, its indexes open for insertion, an executor state and a slot, set up at the first direct
//! write and reused by every later one, in this transaction and the next ones.
//!
//! Why: setting them up is most of a single row's work outside the heap and the btree. An attached table's row
//! trigger wrote each row of a COPY through a fresh executor state, ResultRelInfo and index opens (ExecOpenIndices
//! with an IndexInfo per index, a lock taken and dropped per index, a tuple descriptor copied for the slot): about a
//! fifth of its instructions (callgrind). Set up once per transaction instead, it was still 8.9 thousand
//! instructions of every transaction that marks one new id or claims one key, 4% of a `claim()` + `complete()`
//! request.
//!
//! How it stays sound between uses, when it holds no relcache reference (so the transaction's own DDL on the inbox,
//! whose `CheckTableNotInUse` counts references, and the resource owners' leak checks at the end of a statement
//! see nothing open):
//! - the locks (RowExclusiveLock on the table and each index, as INSERT takes them) are taken again before the
//!   first use after anything that may have released them: the end of a transaction, and a subtransaction's
//!   rollback (which releases those it took, and a cursor's taken before it began, whose portal it aborts). Taking
//!   a lock anew processes the invalidations that arrived meanwhile, as any relation open does;
//! - the relcache entries of the table and its indexes are watched (`relcache::Stale`): an invalidation of any of
//!   them (DDL of this or another transaction, another session's VACUUM or concurrent index build, a rolled-back
//!   transaction's DDL undone, a reset of the whole cache) drops the handle before its pointers could be used, and
//!   the next write sets up a new one;
//! - every use takes a reference to each relation for its duration, as an open would;
//! - what an index access method caches between insertions (ii_AmCache, in ii_Context) is the use's, freed after
//!   it; and a table with an index on an expression or with a predicate keeps its handle for one transaction only,
//!   as the executor state that holds their compiled expressions is not for another transaction to run.
//!
//! A use that would nest inside another use of the same handle (a function of an index expression writing to the
//! inbox) gets a handle of its own, set up and dropped around it.

use crate::relcache::Stale;
use crate::unguarded;
use pgrx::prelude::*;
use rustc_hash::{FxBuildHasher, FxHashMap};
use std::cell::{Cell, RefCell};
use std::hash::BuildHasher;
use std::rc::Rc;

/// What a use gets: the open table, its executor state and ResultRelInfo (indexes open), and an empty slot of the
/// row type.
pub struct Handle {
    pub rel: pg_sys::Relation,
    pub estate: *mut pg_sys::EState,
    pub result_rel: *mut pg_sys::ResultRelInfo,
    pub slot: *mut pg_sys::TupleTableSlot,
    /// Where this transaction wrote ids one at a time through the handle, by a hash of the id (`place_key`), so
    /// that a later call of the same transaction reads the row there rather than descending the primary key again
    /// (`lookup::own_row`): `complete()` after `claim()`, a key repeated further on in a COPY into an attached table.
    /// The reader checks the row's id, so two ids of one hash cost only a lookup through the index. Forgotten when
    /// locks may be gone (`locks_may_be_gone`: the end of the transaction, a subtransaction's rollback, which may
    /// leave a dead row there); a TRUNCATE or any rewrite invalidates the table and so drops the handle with it.
    written: RefCell<FxHashMap<u64, pg_sys::ItemPointerData>>,
}

/// A handle and what keeps it sound.
struct Held {
    relid: pg_sys::Oid,
    handle: Handle,
    /// Holds the executor state, the slot and `per_use`; a child of TopMemoryContext.
    context: pg_sys::MemoryContext,
    /// Reset after every use: what a write allocates (datums, index tuples).
    per_use: pg_sys::MemoryContext,
    /// The table and each index, with whether its relcache entry went stale.
    relations: Vec<(pg_sys::Oid, Stale)>,
    /// The `LOCKS` generation in which the locks were last taken.
    locked: Cell<u64>,
    /// Kept for its transaction only: an index on an expression or with a predicate, whose compiled expressions
    /// (built in the executor state at the first insertion) are not for another transaction to run.
    per_transaction: bool,
    busy: Cell<bool>,
}

/// Handles kept at most: a backend writing to more inboxes than this sets some up again now and then.
const MAX_HELD: usize = 16;

/// Places the handles remember per transaction at most, all together (`Handle::written`): a COPY of more new keys
/// than this into attached tables finds the repeats of the later ones through the index. 7/8 of 2^20, so that one
/// map holding them all stays at 2^20 slots of 17 bytes: 18 MB (27 MB for a moment while it grows to that). Split
/// over several inboxes' maps, each rounds its slots up to a power of two: up to 36 MB together (two maps of just
/// over 2^19 places each), more for a moment while one grows.
const MAX_PLACES: usize = 917_504;
/// A map of remembered places that grew past this many is freed at the end of its transaction, not kept empty.
const KEPT_PLACES: usize = 1024;

thread_local! {
    /// The handles, the one used last at the end.
    static HELD: RefCell<Vec<Rc<Held>>> = const { RefCell::new(Vec::new()) };
    /// Bumped whenever locks may have been released (a transaction's end, a subtransaction's rollback): a handle
    /// locked in an earlier generation takes its locks again before its next use.
    static LOCKS: Cell<u64> = const { Cell::new(1) };
    static CALLBACKS: Cell<bool> = const { Cell::new(false) };
    /// Places remembered by all handles since they were last forgotten (`MAX_PLACES`).
    static PLACES: Cell<usize> = const { Cell::new(0) };
}

impl Held {
    /// Sets up a handle on table `relid` (an inbox's, or `dedup.attempt_counts`), locked in this transaction.
    ///
    /// # Safety
    /// `relid` must be a table this transaction may insert into.
    unsafe fn open(relid: pg_sys::Oid) -> Held {
        // SAFETY: everything is allocated in a context of our own, under the transaction's until the handle is set
        // up (a failure half-way, a lock wait cancelled, frees it with the transaction) and then under
        // TopMemoryContext until the handle is dropped; the references taken by the opens are given back at the
        // end, the locks kept.
        unsafe {
            let context = memory_context(pg_sys::TopTransactionContext, c"pg_dedup write handle");
            let per_use = memory_context(context, c"pg_dedup write");
            let caller = pg_sys::MemoryContextSwitchTo(context);
            let rel = pg_sys::table_open(relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
            // Watched before the indexes are opened: taking their locks may process invalidations of any of them.
            let mut relations = vec![(relid, Stale::of(relid))];
            let indexes = pg_sys::RelationGetIndexList(rel);
            for i in 0..pg_sys::list_length(indexes) {
                let index = pg_sys::list_nth_oid(indexes, i);
                relations.push((index, Stale::of(index)));
            }
            pg_sys::list_free(indexes);
            let estate = pg_sys::CreateExecutorState();
            pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
            let result_rel =
                pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>()) as *mut pg_sys::ResultRelInfo;
            (*result_rel).type_ = pg_sys::NodeTag::T_ResultRelInfo;
            // Range-table index 0: there is no query, hence no range table.
            pg_sys::InitResultRelInfo(result_rel, rel, 0, std::ptr::null_mut(), 0);
            pg_sys::ExecOpenIndices(result_rel, false);
            let mut per_transaction = false;
            for i in 0..(*result_rel).ri_NumIndices.max(0) as usize {
                let info = *(*result_rel).ri_IndexRelationInfo.add(i);
                // What an index access method keeps between insertions (BRIN's descriptor and revmap, GIN's and
                // GiST's state) lives in ii_Context: the per-use memory, reset with it after every use (`run`).
                (*info).ii_Context = per_use;
                per_transaction |= !(*info).ii_Expressions.is_null() || !(*info).ii_Predicate.is_null();
            }
            let slot = super::row_slots(rel, 1)[0];
            pg_sys::MemoryContextSwitchTo(caller);
            let handle = Handle { rel, estate, result_rel, slot, written: RefCell::default() };
            for r in handle.relations() {
                pg_sys::RelationDecrementReferenceCount(r);
            }
            pg_sys::MemoryContextSetParent(context, pg_sys::TopMemoryContext);
            Held {
                relid,
                handle,
                context,
                per_use,
                relations,
                locked: Cell::new(LOCKS.get()),
                per_transaction,
                busy: Cell::new(false),
            }
        }
    }

    fn sound(&self) -> bool {
        !self.relations.iter().any(|(_, stale)| stale.get())
    }

    /// Takes the locks again if they may have been released since they were taken, which processes the
    /// invalidations that arrived meanwhile; then whether the handle is still sound.
    fn relocked(&self) -> bool {
        let generation = LOCKS.get();
        if self.locked.replace(generation) != generation && self.sound() {
            let relations = &self.relations;
            // SAFETY: locks relations by oid, as the executor's opens do (held until the transaction ends); the loop
            // holds a borrowed slice and oids.
            unsafe {
                unguarded::guarded(|pg| {
                    for (relid, _) in relations {
                        pg.LockRelationOid(*relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
                    }
                })
            };
        }
        self.sound()
    }

    /// One use: a reference to each relation for its duration, `write` in the per-use memory, and whatever it left
    /// reset, on every way out (an ERROR included).
    ///
    /// # Safety
    /// The handle must be sound and not busy.
    unsafe fn run<R>(&self, write: impl FnOnce(&Handle) -> R) -> R {
        struct InUse<'a>(&'a Held, pg_sys::MemoryContext);
        impl Drop for InUse<'_> {
            fn drop(&mut self) {
                let InUse(held, caller) = self;
                // SAFETY: gives back what `run` took, in the same resource owner (an ERROR unwinds through here
                // before its transaction aborts); the slot and the per-use memory hold only this use's values. One
                // guard for the lot: the closure holds pointers only.
                unsafe {
                    // Back in the caller's memory context first, where an ERROR below would leave it too.
                    pg_sys::MemoryContextSwitchTo(*caller);
                    let (handle, per_use) = (&held.handle, held.per_use);
                    unguarded::guarded(|pg| {
                        pg.ExecClearTuple(handle.slot);
                        let per_tuple = (*handle.estate).es_per_tuple_exprcontext;
                        if !per_tuple.is_null() {
                            pg.MemoryContextReset((*per_tuple).ecxt_per_tuple_memory);
                        }
                        // What the index access methods cached is in the per-use memory (ii_Context): forgotten
                        // with it (`inserting` let BRIN's buffers go already).
                        let r = &*handle.result_rel;
                        for i in 0..r.ri_NumIndices.max(0) as usize {
                            (**r.ri_IndexRelationInfo.add(i)).ii_AmCache = std::ptr::null_mut();
                        }
                        pg.MemoryContextReset(per_use);
                        for r in handle.relations() {
                            pg.RelationDecrementReferenceCount(r);
                        }
                    })
                }
                held.busy.set(false);
            }
        }
        // SAFETY: the handle is sound (the relcache entries are those it was set up with), so its pointers are
        // valid; a reference to each is taken, as an open would.
        let caller = unsafe {
            unguarded::guarded(|pg| {
                for r in self.handle.relations() {
                    pg.RelationIncrementReferenceCount(r);
                }
            });
            pg_sys::MemoryContextSwitchTo(self.per_use)
        };
        self.busy.set(true);
        let _in_use = InUse(self, caller);
        write(&self.handle)
    }

    /// Frees the handle's memory. Its relations are not touched: their entries may be gone.
    fn drop_memory(&self) {
        // SAFETY: the context is ours, and nothing of it is in use (the callers drop only handles not busy).
        unsafe { pg_sys::MemoryContextDelete(self.context) };
    }
}

impl Handle {
    /// Runs `insert` (index insertions of this handle), then lets each index end what it keeps between the
    /// insertions of one command: from PostgreSQL 17, BRIN keeps its revmap's buffers pinned in `ii_AmCache`, and
    /// those pins belong to the resource owner of the moment (a subtransaction's, the statement's), so they must go
    /// before it ends, as ExecCloseIndices lets them go after every statement. If `insert` fails, the abort releases
    /// the pins: the cached state is forgotten instead, and the next insertion builds a new one.
    ///
    /// # Safety
    /// The handle must be in use (`with`).
    pub unsafe fn inserting<R>(&self, insert: impl FnOnce() -> R) -> R {
        #[cfg_attr(not(any(feature = "pg17", feature = "pg18")), allow(dead_code))]
        struct Cleanup<'a>(&'a Handle);
        impl Drop for Cleanup<'_> {
            fn drop(&mut self) {
                #[cfg(any(feature = "pg17", feature = "pg18"))]
                // SAFETY: the ResultRelInfo's arrays have ri_NumIndices entries, open (the handle is in use).
                unsafe {
                    let r = &*self.0.result_rel;
                    for i in 0..r.ri_NumIndices.max(0) as usize {
                        let (index, info) = (*r.ri_IndexRelationDescs.add(i), *r.ri_IndexRelationInfo.add(i));
                        if std::thread::panicking() {
                            (*info).ii_AmCache = std::ptr::null_mut();
                        } else {
                            pg_sys::index_insert_cleanup(index, info);
                        }
                    }
                }
            }
        }
        let _cleanup = Cleanup(self);
        insert()
    }

    /// Remembers that this transaction just wrote the row of `id` at `tid` (up to `MAX_PLACES` places). Only a
    /// shortcut: when the memory for one more is not there, nothing is remembered (Rust's allocator would abort the
    /// whole server where palloc raises an ERROR).
    pub fn remember(&self, id: &str, tid: pg_sys::ItemPointerData) {
        let mut written = self.written.borrow_mut();
        if PLACES.get() < MAX_PLACES && written.try_reserve(1).is_ok() && written.insert(place_key(id), tid).is_none() {
            PLACES.set(PLACES.get() + 1);
        }
    }

    /// The table, then each index.
    fn relations(&self) -> impl Iterator<Item = pg_sys::Relation> + '_ {
        // SAFETY: the ResultRelInfo's index array has ri_NumIndices entries.
        let indexes = unsafe {
            let r = &*self.result_rel;
            (0..r.ri_NumIndices.max(0) as usize).map(move |i| *r.ri_IndexRelationDescs.add(i))
        };
        std::iter::once(self.rel).chain(indexes)
    }
}

/// A memory context of default sizes under `parent`.
///
/// # Safety
/// `parent` must be a live memory context.
unsafe fn memory_context(parent: pg_sys::MemoryContext, name: &'static std::ffi::CStr) -> pg_sys::MemoryContext {
    // SAFETY: the caller vouches for the parent; the name is static.
    unsafe {
        pg_sys::AllocSetContextCreateExtended(
            parent,
            name.as_ptr(),
            pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
        )
    }
}

/// May `held` be freed: not in use, and not held by anyone but `HELD` (a caller between finding it and using it)?
fn unused(held: &Rc<Held>) -> bool {
    !held.busy.get() && Rc::strong_count(held) == 1
}

/// The handle on `relid`, if one is held, made the one used last.
fn find(relid: pg_sys::Oid) -> Option<Rc<Held>> {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        let at = held.iter().position(|h| h.relid == relid)?;
        let found = held.remove(at);
        held.push(found.clone());
        Some(found)
    })
}

/// Runs `write` with the backend's handle on table `relid` (an inbox's, or `dedup.attempt_counts`), set up if it has
/// none yet (or its handle went stale). What `write` allocates in the current memory context goes when it returns.
///
/// # Safety
/// `relid` must be an inbox table or `dedup.attempt_counts`, locked by this transaction (RowExclusiveLock); `write`
/// must not keep the handle's pointers, nor return anything allocated in the current memory context.
pub unsafe fn with<R>(relid: pg_sys::Oid, write: impl FnOnce(&Handle) -> R) -> R {
    register_callbacks();
    // Locked again first: that may find it stale, and then it goes below with the others.
    let found = find(relid).filter(|h| h.busy.get() || h.relocked());
    // Stale handles go on the way (one in use stays with its use), and the least recently used beyond MAX_HELD.
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        held.retain(|h| {
            let keep = !unused(h) || h.sound();
            if !keep {
                h.drop_memory();
            }
            keep
        });
        // Room for one more, if one is set up below.
        while held.len() >= MAX_HELD {
            let Some(oldest) = held.iter().position(unused) else { break };
            held.remove(oldest).drop_memory();
        }
    });
    match found {
        // SAFETY: sound and locked (just checked), and free.
        Some(held) if !held.busy.get() => unsafe { held.run(write) },
        Some(_) => {
            // A nested use: a handle of its own, for this use only (its memory freed on every way out).
            struct Own(Held);
            impl Drop for Own {
                fn drop(&mut self) {
                    self.0.drop_memory();
                }
            }
            // SAFETY: the caller vouches for the table; the new handle is sound and free.
            unsafe {
                let own = Own(Held::open(relid));
                own.0.run(write)
            }
        }
        None => {
            // SAFETY: the caller vouches for the table; the new handle is sound and free.
            let held = Rc::new(unsafe { Held::open(relid) });
            HELD.with(|h| h.borrow_mut().push(held.clone()));
            // SAFETY: as above.
            unsafe { held.run(write) }
        }
    }
}

/// The hash a handle remembers the place of an id by.
fn place_key(id: &str) -> u64 {
    FxBuildHasher.hash_one(id)
}

/// Where this transaction last wrote `id` through the handle on inbox table `relid`, if it remembers (a row of
/// another id, when two ids share a hash: the reader checks). Takes no lock and sets nothing up: a duplicate mark,
/// which asks first, pays a search of the few handles and nothing else.
pub fn written_at(relid: pg_sys::Oid, id: &str) -> Option<pg_sys::ItemPointerData> {
    HELD.with(|held| {
        let held = held.borrow();
        let written = held.iter().find(|h| h.relid == relid)?.handle.written.borrow();
        if written.is_empty() {
            return None;
        }
        written.get(&place_key(id)).copied()
    })
}

/// Runs `read` with the backend's handle on inbox table `relid` if it has a sound one not in use (None
/// otherwise: nothing is set up for it). For what a handle remembers between uses.
///
/// # Safety
/// As for `with`.
pub unsafe fn with_held<R>(relid: pg_sys::Oid, read: impl FnOnce(&Handle) -> R) -> Option<R> {
    let held = find(relid)?;
    // SAFETY: checked sound, locked and free; the caller vouches for the rest.
    (!held.busy.get() && held.relocked()).then(|| unsafe { held.run(read) })
}

fn register_callbacks() {
    if !CALLBACKS.replace(true) {
        // SAFETY: registers guarded callbacks for the rest of the backend's life.
        unsafe {
            pg_sys::RegisterXactCallback(Some(at_end_of_transaction), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(at_end_of_subtransaction), std::ptr::null_mut());
        }
    }
}

/// The places a handle remembers are where this transaction wrote rows: forgotten when the transaction ends (no lock
/// is held on the table then, and a VACUUM may remove a row and cut its place off) and when a subtransaction rolls
/// back (a row may have been its, a dead row now, whose place pruning may give to another row).
fn locks_may_be_gone() {
    LOCKS.set(LOCKS.get() + 1);
    PLACES.set(0);
    HELD.with(|held| {
        // (Never borrowed across a call into PostgreSQL, so free here; checked all the same, at an abort.)
        if let Ok(held) = held.try_borrow() {
            for h in held.iter() {
                if let Ok(mut written) = h.handle.written.try_borrow_mut() {
                    if written.capacity() > KEPT_PLACES {
                        *written = FxHashMap::default();
                    } else {
                        written.clear();
                    }
                }
            }
        }
    });
}

/// # Safety
/// Called by PostgreSQL only, at the end of a transaction.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_transaction(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    if matches!(
        event,
        XACT_EVENT_COMMIT
            | XACT_EVENT_ABORT
            | XACT_EVENT_PREPARE
            | XACT_EVENT_PARALLEL_COMMIT
            | XACT_EVENT_PARALLEL_ABORT
    ) {
        // The locks go with the transaction's resource owner; the handles stay, for the next transaction, but
        // those kept for their transaction only.
        locks_may_be_gone();
        HELD.with(|held| {
            if let Ok(mut held) = held.try_borrow_mut() {
                held.retain(|h| {
                    let keep = !h.per_transaction || !unused(h);
                    if !keep {
                        h.drop_memory();
                    }
                    keep
                })
            }
        });
    }
}

/// # Safety
/// Called by PostgreSQL only, at the end of a subtransaction.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_subtransaction(
    event: pg_sys::SubXactEvent::Type,
    _sub: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        // Locks may have gone with it. A busy handle is the use that began the rolled-back subtransaction (a
        // multi-insert undone), whose locks were taken before and stay; the next use takes them again anyway.
        locks_may_be_gone();
    }
}
