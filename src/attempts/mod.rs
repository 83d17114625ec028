//! Delivery attempts (docs/poison-messages.md): `attempt(id, inbox)` counts one attempt to process message `id` and
//! returns how many have been counted, this one included. Not in the caller's transaction, on purpose: a consumer
//! that fails on a message and rolls back (or dies) finds the attempt counted the next time the message comes, and
//! can park a message that keeps failing ("poison") after N tries, inside its transaction.
//!
//! Where counts live: in shared memory (`store`), where an attempt is one increment under a short lock (no row and no
//! WAL on the caller's path), and in `dedup.attempt_counts`, where the database's worker writes every count that
//! changed, every `dedup.attempts_flush_interval` and when it stops (a clean shutdown stops it first), in
//! transactions of its own. A count the store does not hold (evicted, or after a restart) starts from the table.
//! After a crash of the server the counts made since the worker last wrote are lost, so a count may come out lower
//! than the truth (by at most what was counted in that interval), never higher.
//!
//! What resets a count: `forget()` of the id (at its commit), the inbox's default TTL passing since the last attempt,
//! and `drop_inbox()`. Marks and claims never touch it. A full store (every slot holds a count the worker has not
//! written yet) refuses the attempt with a `dedup:` error rather than lose a count or wait.

mod durable;
mod lock;
mod store;

use crate::clock::{expiry, statement_now};
use crate::errors::{internal, raise};
use crate::inbox::{self, Access, Inbox};
use crate::plans::{statements, Plans};
use crate::shmem::{self, Counter};
use crate::{catalog, guc, input, rights, xact};
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
pub use store::Store;

/// Bytes of shared memory the counts of `max` ids take.
pub fn store_size(max: usize) -> usize {
    store::size(max)
}

statements! {
    /// $1 inboxes, $2 ids, $3 counts, $4 first, $5 last, $6 expires → writes the counts (a count of zero deletes).
    Write,
    /// The same arguments → inserts rows of ids the table holds none of (no look for a conflicting row first).
    Insert,
    /// $1 inbox, $2 now, $3 batch size → deletes up to that many lapsed counts.
    PurgeBatch,
}

/// The rows `Stmt::Write` and `Stmt::Insert` write, from their six array arguments (`write_args`).
macro_rules! counts_from_arrays {
    () => {
        "SELECT * FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2), pg_catalog.unnest($3), \
         pg_catalog.unnest($4), pg_catalog.unnest($5), pg_catalog.unnest($6)) \
         AS w(inbox, id, attempts, first_attempt, last_attempt, expires_at)"
    };
}

impl Stmt {
    fn sql(self) -> &'static str {
        match self {
            Stmt::Write => concat!(
                "WITH w AS (",
                counts_from_arrays!(),
                "), \
                 gone AS (DELETE FROM dedup.attempt_counts a USING w \
                           WHERE w.attempts OPERATOR(pg_catalog.=) 0 AND a.inbox OPERATOR(pg_catalog.=) w.inbox \
                             AND a.id OPERATOR(pg_catalog.=) w.id) \
                 INSERT INTO dedup.attempt_counts AS a \
                 SELECT * FROM w WHERE w.attempts OPERATOR(pg_catalog.>) 0 \
                 ON CONFLICT (id, inbox) DO UPDATE SET attempts = excluded.attempts, \
                   first_attempt = excluded.first_attempt, last_attempt = excluded.last_attempt, \
                   expires_at = excluded.expires_at"
            ),
            Stmt::Insert => concat!("INSERT INTO dedup.attempt_counts ", counts_from_arrays!()),
            // Ordered, so the cached generic plan scans the (inbox, expires_at) index: see the inbox's purge.
            Stmt::PurgeBatch => {
                "DELETE FROM dedup.attempt_counts WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT ctid \
                 FROM dedup.attempt_counts WHERE inbox OPERATOR(pg_catalog.=) $1 \
                 AND expires_at OPERATOR(pg_catalog.<=) $2 ORDER BY expires_at LIMIT $3 FOR UPDATE SKIP LOCKED))"
            }
        }
    }

    fn arg_types(self) -> Vec<PgOid> {
        use pgrx::pg_sys::BuiltinOid::*;
        let oids = match self {
            Stmt::Write | Stmt::Insert => vec![
                TEXTARRAYOID,
                TEXTARRAYOID,
                INT4ARRAYOID,
                TIMESTAMPTZARRAYOID,
                TIMESTAMPTZARRAYOID,
                TIMESTAMPTZARRAYOID,
            ],
            Stmt::PurgeBatch => vec![TEXTOID, TIMESTAMPTZOID, INT8OID],
        };
        oids.into_iter().map(PgOid::BuiltIn).collect()
    }
}

thread_local! {
    static PLANS: Plans<{ Stmt::COUNT }> = Plans::default();
}

/// Runs `stmt` on `dedup.attempt_counts` (its caller has the rights to) and returns how many rows it touched.
fn run(stmt: Stmt, args: &[pgrx::datum::DatumWithOid<'_>]) -> usize {
    Spi::connect(|client| {
        PLANS.with(|plans| {
            let plan = plans.get(client, stmt as usize, || stmt.sql().to_owned(), || stmt.arg_types());
            // `select` on a plan prepared with `prepare_mut` runs it read-write.
            client.select(plan, None, args).unwrap_or_else(|e| internal("writing dedup.attempt_counts", e)).len()
        })
    })
}

/// The store, and a worker that makes its counts durable, for this database; otherwise the `dedup:` error that says
/// what the installation lacks.
fn store() -> &'static Store {
    let Some(store) = shmem::region().map(|r| r.attempts()) else {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "attempt() needs pg_dedup in shared_preload_libraries",
            "Counts of attempts live in shared memory until the background worker makes them durable: add pg_dedup to \
             shared_preload_libraries and restart the server.",
        )
    };
    if !guc::serves_this_database() {
        let database = catalog::current_database();
        let listed = guc::worker_databases();
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("attempt() needs the pg_dedup worker of database \"{database}\" to make its counts durable"),
            format!(
                "Add the database to dedup.database and reload: ALTER SYSTEM SET dedup.database = {}; SELECT \
                 pg_reload_conf();",
                pgrx::spi::quote_literal(listed.into_iter().chain([database.clone()]).collect::<Vec<_>>().join(", "))
            ),
        )
    }
    store
}

/// Counts one delivery attempt of `id` in `inbox` and returns the number of attempts counted for it so far, this one
/// included (1 the first time). Not undone by the caller's ROLLBACK: see the module comment.
#[pg_extern(volatile, parallel_unsafe)]
fn attempt(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> i32 {
    input::require_writable("attempt");
    crate::citus::refuse_task_on_node_state("attempt()");
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    let store = store();
    let now = statement_now();
    let expires = expiry(now, inbox.default_ttl());
    let (now_us, expires_us) = (now.into_inner(), expires.into_inner());
    let count = loop {
        // Read before the durable count is: see `Store::bump_new`.
        let seen = store.evictions();
        // A new id, which the durable table certainly lacks (the usual case), takes the store's lock once: the store
        // holds its count if anyone's attempt or forget came first.
        let durable = match durable::certainly_none(&inbox.name, id) {
            true => None,
            false => match store.bump_held(inbox.ns, id, now_us, expires_us) {
                Some(count) => break count,
                None => durable::read(&inbox.name, id, now_us),
            },
        };
        match store.bump_new(inbox.ns, id, now_us, expires_us, durable, seen) {
            Ok(Some(count)) => break count,
            Ok(None) => continue, // a slot was freed meanwhile: the durable count may be stale
            Err(store::Full) => raise(
                PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
                format!(
                    "shared memory holds no more counts of delivery attempts: all {} are waiting for the worker to \
                     make them durable",
                    guc::ATTEMPTS_MAX.get()
                ),
                "The worker writes them every dedup.attempts_flush_interval: raise dedup.attempts_max (a restart), or \
                 lower dedup.attempts_flush_interval; check that the worker of this database runs (dedup.stats).",
            ),
        }
    };
    inbox.count(Counter::Attempts, 1);
    count as i32
}

/// The counts shared memory holds now for this database, of the inboxes whose table the caller may read (so the
/// function may be anyone's: it shows nothing a caller could not read anyway), with when each lapses. The view
/// `dedup.attempts` shows these, and the durable rows of ids shared memory holds no count for.
#[pg_extern(volatile, parallel_safe)]
fn attempts_in_memory() -> TableIterator<
    'static,
    (
        name!(inbox, String),
        name!(id, String),
        name!(attempts, i32),
        name!(first_attempt, TimestampWithTimeZone),
        name!(last_attempt, TimestampWithTimeZone),
        name!(expires_at, TimestampWithTimeZone),
    ),
> {
    let Some(store) = shmem::region().map(|r| r.attempts()) else { return TableIterator::new(Vec::new()) };
    // SAFETY: reads a backend global, set once connected.
    let counts = store.counts(unsafe { pg_sys::MyDatabaseId }, false);
    let at = |t: i64| TimestampWithTimeZone::try_from(t).expect("a timestamp the store kept");
    let mut rows = Vec::with_capacity(counts.len());
    for c in counts {
        let relid = shmem::relation_of(c.ns);
        // A count of an inbox dropped since is left out: the worker sweeps the inbox's counts once it finds one of
        // them dirty; a clean one also goes when it lapses or when its slot is taken for another id.
        let Some(inbox) = catalog::inbox_name_of(relid) else { continue };
        if !catalog::caller_may_select(relid) {
            continue;
        }
        rows.push((inbox, c.id, c.count as i32, at(c.first), at(c.last), at(c.expires)));
    }
    TableIterator::new(rows)
}

thread_local! {
    /// `forget()`s of this transaction whose counts go at its commit: inbox key, id, subtransaction level.
    static FORGOTTEN: RefCell<Vec<(u64, String, i32)>> = const { RefCell::new(Vec::new()) };
    static CALLBACKS: Cell<bool> = const { Cell::new(false) };
}

/// `forget()` of `id`: its durable count goes now (in the caller's transaction), the one in shared memory when the
/// transaction commits (a forget that rolls back resets nothing).
pub fn forget(inbox: &Inbox, id: &str) {
    durable::delete(&inbox.name, id);
    if shmem::region().is_none() {
        return;
    }
    if !CALLBACKS.replace(true) {
        // SAFETY: registers guarded callbacks for the rest of the backend's life.
        unsafe {
            pg_sys::RegisterXactCallback(Some(at_end_of_transaction), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(at_end_of_subtransaction), std::ptr::null_mut());
        }
    }
    // SAFETY: reads the backend's transaction nesting level.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    FORGOTTEN.with(|f| f.borrow_mut().push((inbox.ns, id.to_owned(), level)));
}

/// # Safety
/// Called by PostgreSQL only, at the end of a transaction.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_transaction(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    if event == pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE && FORGOTTEN.with(|f| !f.borrow().is_empty()) {
        // The reset would have to wait for COMMIT PREPARED, in whatever session runs it: not supported.
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "cannot PREPARE a transaction that called forget(): its reset of the counts of attempts could not follow \
             the prepared transaction's outcome",
            "Call forget() in a transaction that commits directly.",
        )
    }
    let forgotten = FORGOTTEN.with(|f| std::mem::take(&mut *f.borrow_mut()));
    let committed =
        event == pg_sys::XactEvent::XACT_EVENT_COMMIT || event == pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT;
    if committed {
        if let Some(store) = shmem::region().map(|r| r.attempts()) {
            // SAFETY: reads the clock.
            let now = unsafe { pg_sys::GetCurrentTimestamp() };
            // A full store cannot hold the reset; the durable count went with the transaction, and no count of the
            // id waits in the store (else it would have had a slot).
            for (ns, id, _) in forgotten {
                let _ = store.reset(ns, &id, now);
            }
        }
    } else if event == pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT
        || event == pg_sys::XactEvent::XACT_EVENT_PARALLEL_PRE_COMMIT
    {
        // Before commit: keep them for the end.
        FORGOTTEN.with(|f| *f.borrow_mut() = forgotten);
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
    // SAFETY: reads the backend's transaction nesting level (still the ending subtransaction's).
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    FORGOTTEN.with(|f| {
        let mut f = f.borrow_mut();
        match event {
            pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => f.retain(|(_, _, l)| *l < level),
            pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => {
                f.iter_mut().filter(|(_, _, l)| *l >= level).for_each(|(_, _, l)| *l = level - 1)
            }
            _ => {}
        }
    });
}

/// Deletes every durable count of inbox `name`, which is being dropped (for `drop_inbox()`, which runs it as the
/// extension's owner). Its counts in shared memory go at the worker's next round if dirty (their table is gone),
/// else when they lapse or their slots serve other ids; nobody sees them meanwhile.
pub fn forget_inbox(name: &str) {
    Spi::run_with_args("DELETE FROM dedup.attempt_counts WHERE inbox OPERATOR(pg_catalog.=) $1", &[name.into()])
        .unwrap_or_else(|e| internal("deleting the inbox's attempts", e));
}

/// Deletes up to `limit` lapsed counts of `inbox`, skipping rows another transaction holds; returns how many.
pub fn purge_batch(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64) -> i64 {
    rights::as_extension_owner("purge", || {
        run(Stmt::PurgeBatch, &[inbox.name.as_str().into(), now.into(), limit.into()]) as i64
    })
}

/// The worker's round: writes the counts of this database that changed since it last wrote them, in a transaction of
/// its own (as the worker, a superuser), then lets their slots serve other ids. While no count of this database changed
/// since a round that left none of it dirty, there is nothing to write: only lapsed counts to sweep, when some are due.
pub fn make_durable() {
    thread_local! {
        /// When a failed round was last logged: a round that keeps failing is logged once a minute, not every time.
        static LOGGED: Cell<Option<std::time::Instant>> = const { Cell::new(None) };
        /// `Store::changes` of this database as it was before the last round that left no count of it dirty.
        static CLEAN_AS_OF: Cell<Option<u64>> = const { Cell::new(None) };
    }
    let Some(store) = shmem::region().map(|r| r.attempts()) else { return };
    // SAFETY: reads a backend global, set once connected.
    let changes = store.changes(unsafe { pg_sys::MyDatabaseId });
    if CLEAN_AS_OF.get() == Some(changes) {
        sweep_lapsed(store);
        return;
    }
    match xact::try_transaction(|| write_changed(store)) {
        Ok((written, all)) => {
            mark_written(store, &written);
            if all {
                CLEAN_AS_OF.set(Some(changes));
            }
            LOGGED.set(None);
        }
        Err((_, message)) => {
            if LOGGED.get().is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(60)) {
                LOGGED.set(Some(std::time::Instant::now()));
                crate::errors::server_log!(
                    "pg_dedup worker: making counts of delivery attempts durable failed (tried again every \
                     dedup.attempts_flush_interval): {message}"
                );
            }
        }
    }
}

/// Writes the counts of this database that changed, and returns them, and whether they were all there were (none
/// waits for an inbox someone else holds).
fn write_changed(store: &store::Store) -> (Vec<store::Count>, bool) {
    // SAFETY: reads a backend global, set once connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    let changed = store.counts(db, true);
    let mut gone = Vec::new();
    // Each count with its inbox's name.
    let mut rows = Vec::new();
    let mut looked_up = std::collections::HashMap::new();
    let mut all = true;
    for count in changed {
        match looked_up.entry(count.ns).or_insert_with(|| inbox_to_write(count.ns)) {
            Lookup::Inbox(inbox) => rows.push((inbox.clone(), count)),
            Lookup::Gone => gone.push(count.ns),
            Lookup::Busy => all = false, // dirty still: the next round
        }
    }
    // Rows of ids the table holds none of (the store knows them: `stored`) are inserted without a look for a
    // conflicting row first, which ON CONFLICT's speculative insertion would cost about as much again. Should one be
    // there anyway (written by hand), its chunk is undone and written the other way. Sorted by id and inbox, bytewise
    // (the primary key's order), in chunks small enough for the statement's arrays to stay in memory.
    let is_new = |c: &store::Count| !c.stored && c.count > 0;
    rows.sort_unstable_by(|(a, x), (b, y)| (is_new(x), &x.id, a).cmp(&(is_new(y), &y.id, b)));
    let first_new = rows.partition_point(|(_, c)| !is_new(c));
    for chunk in rows[..first_new].chunks(WRITE_CHUNK) {
        run(Stmt::Write, &write_args(chunk));
    }
    for chunk in rows[first_new..].chunks(WRITE_CHUNK) {
        // Each insert is a subtransaction: past the backend's cache of their ids, the rest go the other way. Straight
        // into the heap and indexes where the table allows it, with SQL otherwise.
        let inserted = xact::has_room()
            && xact::undo_on(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, || {
                if !durable::insert_new(chunk) {
                    run(Stmt::Insert, &write_args(chunk));
                }
            })
            .is_some();
        if !inserted {
            run(Stmt::Write, &write_args(chunk));
        }
    }
    if !gone.is_empty() {
        // SAFETY: reads the clock.
        store.sweep(unsafe { pg_sys::GetCurrentTimestamp() }, &gone);
    }
    (rows.into_iter().map(|(_, count)| count).collect(), all)
}

/// Counts the worker writes per statement.
const WRITE_CHUNK: usize = 4096;

/// The arguments of `Stmt::Write` and `Stmt::Insert` for `rows` (each count with its inbox's name).
fn write_args(rows: &[(String, store::Count)]) -> [pgrx::datum::DatumWithOid<'static>; 6] {
    let at = |t: i64| TimestampWithTimeZone::try_from(t).expect("a timestamp the store kept");
    let column = |f: fn(&store::Count) -> i64| rows.iter().map(|(_, c)| at(f(c))).collect::<Vec<_>>();
    [
        rows.iter().map(|(inbox, _)| inbox.clone()).collect::<Vec<_>>().into(),
        rows.iter().map(|(_, c)| c.id.clone()).collect::<Vec<_>>().into(),
        rows.iter().map(|(_, c)| c.count as i32).collect::<Vec<_>>().into(),
        column(|c| c.first).into(),
        column(|c| c.last).into(),
        column(|c| c.expires).into(),
    ]
}

/// What the worker found of the inbox whose key is `ns`.
enum Lookup {
    /// Its name, with its table locked until the write commits.
    Inbox(String),
    /// Dropped: its counts go.
    Gone,
    /// Its table is locked by someone else (a drop, an ALTER TABLE): its counts wait for the next round.
    Busy,
}

/// Looks up the inbox of key `ns` for a write of its counts, and locks its table (ACCESS SHARE, without waiting):
/// a `drop_inbox()` holds the table from its start, so a write never lands between its delete of the inbox's counts
/// and its commit (the drop waits for the write instead, then deletes what it wrote).
fn inbox_to_write(ns: u64) -> Lookup {
    let relid = shmem::relation_of(ns);
    if catalog::inbox_name_of(relid).is_none() {
        return Lookup::Gone;
    }
    // SAFETY: takes a relation lock by oid, held until the transaction ends.
    let locked = unsafe { pg_sys::ConditionalLockRelationOid(relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    if !locked {
        return Lookup::Busy;
    }
    // Locking took in the invalidations: a drop that committed meanwhile is seen now.
    catalog::inbox_name_of(relid).map_or(Lookup::Gone, Lookup::Inbox)
}

/// The extension is not installed in this database (dropped since): no count of it made before `before` can ever
/// be written, so their slots serve other databases' ids.
pub fn drop_database_counts(before: pg_sys::TimestampTz) {
    if let Some(store) = shmem::region().map(|r| r.attempts()) {
        // SAFETY: reads a backend global, set once connected.
        store.drop_database(unsafe { pg_sys::MyDatabaseId }, before);
    }
}

/// Once the counts `written` are committed: they are clean (their slots may then serve other ids), and lapsed ones go
/// from shared memory.
fn mark_written(store: &store::Store, written: &[store::Count]) {
    store.written(written);
    sweep_lapsed(store);
}

/// Frees the slots of clean counts that lapsed, if any may have.
fn sweep_lapsed(store: &store::Store) {
    // SAFETY: reads the clock.
    store.sweep(unsafe { pg_sys::GetCurrentTimestamp() }, &[]);
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn attempts_need_a_worker_for_the_database() {
        // No worker serves the pgrx test database (lib.rs): counts could never be made durable.
        let (code, message) = error_of("SELECT dedup.attempt('a')");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE, "{message}");
        assert!(message.contains("needs the pg_dedup worker of database"), "{message}");
        assert_dedup_error("SELECT dedup.attempt('a')", PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE);
    }

    #[pg_test]
    fn attempts_bad_input_gets_a_dedup_error() {
        use PgSqlErrorCode::*;
        assert_dedup_error("SELECT dedup.attempt(NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT dedup.attempt('')", ERRCODE_INVALID_PARAMETER_VALUE);
        assert_dedup_error("SELECT dedup.attempt(repeat('x', 2049))", ERRCODE_PROGRAM_LIMIT_EXCEEDED);
        assert_dedup_error("SELECT dedup.attempt('a', NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT dedup.attempt('a', 'nope')", ERRCODE_UNDEFINED_OBJECT);
        run("SET LOCAL transaction_read_only = on");
        assert_dedup_error("SELECT dedup.attempt('a')", ERRCODE_READ_ONLY_SQL_TRANSACTION);
    }
}
