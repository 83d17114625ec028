//! Background workers (preloaded only). A launcher, connected to no database, starts one worker per database named
//! in `dedup.database` once that database exists, and starts it again if it dies (a crash, `pg_terminate_backend`);
//! a worker stops by itself when a configuration reload takes its database off the list. Each database's worker
//! purges expired marks every `dedup.purge_interval`, batch by batch in short transactions, and keeps the shared
//! Bloom filter loaded for the database's inboxes. Nothing crash-loops: a missing database or extension is logged
//! once and waited for, and an ERROR in one batch is logged and the next goes on.

use crate::claim::statement_now;
use crate::errors::server_log;
use crate::inbox::{self, Access};
use crate::shmem::{self, WorkerSlot};
use crate::purge::HeldRows;
use crate::{filter, guc, purge, rebuild};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often the launcher looks at its workers, and a worker at the filter.
const NAP: Duration = Duration::from_secs(1);
/// Rotate the filter when its measured rate exceeds the target by this factor.
const ROTATE_AT: f64 = 1.1;
/// Seconds between rotations that end above target, doubling from the first to the second.
const MIN_BACKOFF: u64 = 1;
const MAX_BACKOFF: u64 = 600;
/// Backlog counts stop here: past it, "a lot" is all an operator needs to know.
const BACKLOG_COUNT_CAP: i64 = 1_000_000;

pub fn init_preloaded() {
    BackgroundWorkerBuilder::new("pg_dedup launcher")
        .set_type("pg_dedup launcher")
        .set_library("pg_dedup")
        .set_function("pg_dedup_launcher_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

/// Runs `body` in a transaction of its own. An ERROR rolls the transaction back and comes back as Err (its
/// SQLSTATE and message), so one failing step never takes the worker down.
fn try_transaction<R>(body: impl FnOnce() -> R + std::panic::UnwindSafe) -> Result<R, (PgSqlErrorCode, String)> {
    let context = unsafe { pg_sys::CurrentMemoryContext };
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    PgTryBuilder::new(|| {
        let result = body();
        unsafe {
            pg_sys::PopActiveSnapshot();
            pg_sys::CommitTransactionCommand();
        }
        Ok(result)
    })
    .catch_others(|caught| {
        let report = match &caught {
            pg_sys::panic::CaughtError::PostgresError(e) | pg_sys::panic::CaughtError::ErrorReport(e) => e,
            pg_sys::panic::CaughtError::RustPanic { ereport, .. } => ereport,
        };
        let error = (report.sql_error_code(), report.message().to_owned());
        unsafe {
            pg_sys::AbortCurrentTransaction();
            pg_sys::MemoryContextSwitchTo(context);
        }
        Err(error)
    })
    .execute()
}

/// `try_transaction`, logging an ERROR (with `what`) and turning it into None.
fn in_transaction<R>(what: &str, body: impl FnOnce() -> R + std::panic::UnwindSafe) -> Option<R> {
    try_transaction(body).map_err(|(_, message)| server_log!("pg_dedup worker: {what} failed: {message}")).ok()
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_dedup_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(None, None);
    let mut workers: HashMap<String, DynamicBackgroundWorker> = HashMap::new();
    let mut told_missing: HashSet<String> = HashSet::new();
    loop {
        reload_if_asked();
        let wanted = guc::worker_databases();
        // A worker whose database left the list stops by itself (it reloads the configuration too), whichever
        // launcher started it. One that stopped otherwise (crashed, terminated, its database dropped) is started
        // again below.
        workers.retain(|_, worker| !matches!(worker.pid(), Err(BackgroundWorkerStatus::Stopped)));
        let unserved: Vec<&String> = wanted.iter().filter(|name| !workers.contains_key(*name)).collect();
        for name in unserved {
            let oid = in_transaction("looking up a database", || database_oid(name)).flatten();
            match oid {
                // A worker an earlier launcher started (before a pg_terminate_backend of the launcher) still serves
                // it: starting another would only see that worker and leave, again every second.
                Some(oid) if worker_serving(oid) => {}
                Some(oid) => {
                    told_missing.remove(name);
                    match start_worker(name, oid) {
                        Ok(worker) => {
                            workers.insert(name.clone(), worker);
                        }
                        Err(e) => server_log!("pg_dedup launcher: could not start the worker for \"{name}\": {e:?}"),
                    }
                }
                _ => {
                    if told_missing.insert(name.clone()) {
                        server_log!("pg_dedup launcher: database \"{name}\" (in dedup.database) does not exist; waiting for it");
                    }
                }
            }
        }
        if !BackgroundWorker::wait_latch(Some(NAP)) {
            exit_for_restart();
        }
    }
}

/// Leaves on SIGTERM with exit code 1: the postmaster then starts the launcher again after its restart time (a
/// `pg_terminate_backend` is not a request to stop for good), and at server shutdown nothing is restarted anyway.
#[allow(unreachable_code)] // proc_exit is declared noreturn in some majors' headers and not in others
fn exit_for_restart() -> ! {
    unsafe { pg_sys::proc_exit(1) };
    unreachable!("proc_exit does not return")
}

/// The oid of database `name`. The launcher is connected to no database, so it can read the shared catalog
/// pg_database only by a plain heap scan (no index, no syscache), as the autovacuum launcher does.
fn database_oid(name: &str) -> Option<pg_sys::Oid> {
    unsafe {
        let rel = pg_sys::table_open(pg_sys::DatabaseRelationId, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        let mut found = None;
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let data = (*tuple).t_data;
            let form = (data as *const u8).add((*data).t_hoff as usize) as *const pg_sys::FormData_pg_database;
            if std::ffi::CStr::from_ptr((*form).datname.data.as_ptr()).to_bytes() == name.as_bytes() {
                found = Some((*form).oid);
                break;
            }
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        found
    }
}

fn start_worker(name: &str, oid: pg_sys::Oid) -> Result<DynamicBackgroundWorker, impl std::fmt::Debug> {
    BackgroundWorkerBuilder::new(&format!("pg_dedup worker for database {name}"))
        .set_type("pg_dedup worker")
        .set_library("pg_dedup")
        .set_function("pg_dedup_worker_main")
        .set_argument(oid.into_datum())
        .enable_spi_access()
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
}

/// Is a worker recorded in `db`'s slot alive?
fn worker_serving(db: pg_sys::Oid) -> bool {
    shmem::region().and_then(|r| r.worker_slot(db, false)).is_some_and(|slot| serving(slot.pid.load(Ordering::Acquire), db))
}

/// Is `pid` a live server process connected to database `db` (the worker recorded in a slot)? Looking in the
/// process array rather than asking the kernel: a pid the kernel reused for something else does not count.
fn serving(pid: i32, db: pg_sys::Oid) -> bool {
    if pid == 0 {
        return false;
    }
    let proc = unsafe { pg_sys::BackendPidGetProc(pid) };
    !proc.is_null() && unsafe { (*proc).databaseId } == db
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_dedup_worker_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let db = unsafe { pg_sys::Oid::from_datum(arg, false) }.expect("the launcher passes a database oid");
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(db), None);
    let me = unsafe { pg_sys::MyProcPid };
    let Some(slot) = shmem::region().and_then(|r| r.worker_slot(db, true)) else {
        server_log!("pg_dedup worker: no free worker slot (at most {} databases); exiting", shmem::MAX_DATABASES);
        return;
    };
    // Claim the slot, unless a live worker holds it (one an earlier launcher started); compare-and-swap, so that of
    // two workers starting at once only one stays.
    loop {
        let previous = slot.pid.load(Ordering::Acquire);
        if serving(previous, db) {
            return;
        }
        if slot.pid.compare_exchange(previous, me, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            break;
        }
    }
    let database = in_transaction("looking up the database name", || unsafe {
        let name = pg_sys::get_database_name(db);
        (!name.is_null()).then(|| std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned())
    });
    let Some(database) = database.flatten() else {
        slot.pid.store(0, Ordering::Release);
        return; // dropped meanwhile: the launcher finds no such database and starts nobody
    };
    server_log!("pg_dedup worker: looking after the inboxes of database \"{database}\"");
    let mut told_missing = false;
    let mut last_purge: Option<Instant> = None;
    loop {
        if !reload_and_still_listed(&database) {
            server_log!("pg_dedup worker: database \"{database}\" is no longer in dedup.database; stopping");
            slot.pid.store(0, Ordering::Release);
            return; // exit code 0: the postmaster does not start it again
        }
        let installed = in_transaction("checking for the extension", || {
            Spi::get_one::<bool>("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'pg_dedup')")
                .ok()
                .flatten()
                .unwrap_or(false)
        })
        .unwrap_or(false);
        if !installed && !told_missing {
            server_log!("pg_dedup worker: extension pg_dedup is not installed in database \"{database}\"; waiting for it");
        }
        told_missing = !installed;
        let interval = Duration::from_secs(guc::PURGE_INTERVAL.get().max(1) as u64);
        if installed {
            in_transaction("looking after the Bloom filter", look_after_filter);
            if guc::PURGE.get() && last_purge.is_none_or(|t| t.elapsed() >= interval) {
                last_purge = Some(Instant::now());
                purge_cycle(slot, &database);
            }
        }
        // Publish what the purges did to the table statistics, as a backend does when it goes idle: autovacuum
        // learns of the dead rows only from them. A no-op when nothing is pending; what is held back (flushed
        // less than a second ago) goes out on a later round.
        #[allow(clippy::let_unit_value)] // returns the time until the next flush from PostgreSQL 15 on
        let _ = unsafe { pg_sys::pgstat_report_stat(false) };
        // Wake for the next purge or the next look at the filter, whichever comes first (with purging off, only
        // the latter: before, an idle worker with `dedup.purge = off` woke every 10 ms).
        let until_purge = match (guc::PURGE.get(), last_purge) {
            (false, _) => NAP,
            (true, None) => Duration::ZERO,
            (true, Some(t)) => interval.saturating_sub(t.elapsed()),
        };
        if !BackgroundWorker::wait_latch(Some(until_purge.clamp(Duration::from_millis(10), NAP))) {
            // Terminated (the launcher notices and starts a new worker, unless the database left the list), or
            // the postmaster died (then nothing is restarted).
            slot.pid.store(0, Ordering::Release);
            exit_for_restart();
        }
    }
}

/// Reloads the configuration files if a SIGHUP asked for it (pg_reload_conf()).
fn reload_if_asked() {
    if BackgroundWorker::sighup_received() {
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
}

/// Reloads the configuration when asked to; is this worker's database still in `dedup.database`?
fn reload_and_still_listed(database: &str) -> bool {
    reload_if_asked();
    guc::worker_databases().iter().any(|name| name == database)
}

/// One purge cycle over every inbox of this database. It stops between two batches when the worker is asked to
/// stop, or its database has left `dedup.database` (so that a DROP DATABASE after the reload need not wait for a
/// long cycle).
fn purge_cycle(slot: &WorkerSlot, database: &str) {
    let started = Instant::now();
    slot.last_cycle_start.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
    let names = in_transaction("listing inboxes", inbox::all_names).unwrap_or_default();
    let cap = match guc::PURGE_MAX_ROWS_PER_CYCLE.get() {
        0 => i64::MAX,
        n => n as i64,
    };
    let mut total = 0i64;
    for name in &names {
        let mut capped = false;
        loop {
            if BackgroundWorker::sigterm_received() || !reload_and_still_listed(database) {
                return;
            }
            let limit = (guc::PURGE_BATCH_SIZE.get() as i64).min(cap - total);
            if limit <= 0 {
                capped = true;
                break;
            }
            let batch = |held| {
                move || {
                    let inbox = inbox::open(name, Access::Delete);
                    inbox::as_owner(inbox.relid, || purge::purge_batch(&inbox, statement_now(), limit, held))
                }
            };
            // The quick attempt; if it met a row another transaction holds, it was rolled back: skip held rows.
            let deleted = match try_transaction(batch(HeldRows::WaitBriefly)) {
                Ok(deleted) => Some(deleted),
                Err((PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, _)) => in_transaction("purging a batch", batch(HeldRows::Skip)),
                Err((_, message)) => {
                    server_log!("pg_dedup worker: purging a batch failed: {message}");
                    None
                }
            };
            let Some(deleted) = deleted else { break };
            total += deleted;
            if deleted < limit {
                break;
            }
            let delay = guc::PURGE_BATCH_DELAY.get();
            if delay > 0 && !BackgroundWorker::wait_latch(Some(Duration::from_millis(delay as u64))) {
                return; // terminated, or the postmaster died
            }
        }
        record_backlog(name, capped);
    }
    slot.cycles.fetch_add(1, Ordering::Relaxed);
    slot.last_cycle_micros.store(started.elapsed().as_micros() as i64, Ordering::Relaxed);
    slot.last_cycle_rows.store(total, Ordering::Relaxed);
}

/// After a cycle: nothing left behind, unless the cycle stopped at its cap; then count what waits (bounded).
fn record_backlog(name: &str, capped: bool) {
    in_transaction("estimating the backlog", || {
        let inbox = inbox::open(name, Access::Read);
        let backlog = if capped {
            Spi::get_one_with_args::<i64>(
                &format!(
                    "SELECT count(*) FROM (SELECT 1 FROM {} WHERE expires_at OPERATOR(pg_catalog.<=) $1 LIMIT {BACKLOG_COUNT_CAP}) s",
                    inbox.table
                ),
                &[statement_now().into()],
            )
            .ok()
            .flatten()
            .unwrap_or(-1)
        } else {
            0
        };
        inbox.set_backlog(backlog);
    });
}

/// Loads inboxes the active filter generation does not cover; rotates when expired marks have pushed the measured
/// false-positive rate above target.
fn look_after_filter() {
    // No inbox locks here: a rotation waits for running transactions, and holding a lock a DDL statement waits
    // for, while that statement blocks a transaction we wait for, would deadlock.
    let relids: Vec<pg_sys::Oid> = inbox::all_names().iter().filter_map(|name| inbox::relid(name)).collect();
    if !filter::untrusted(&relids).is_empty() {
        if let Some(done) = rebuild::run(false) {
            server_log!("pg_dedup worker: loaded {} marks of {} inbox(es) into the Bloom filter", done.keys, done.inboxes);
        }
        return;
    }
    let target = guc::BLOOM_FPR.get();
    let (Some(region), Some(measured)) = (shmem::region(), filter::active_fpr()) else { return };
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    if measured <= ROTATE_AT * target || now < region.next_rotation_at.load(Ordering::Relaxed) {
        return;
    }
    let Some(done) = rebuild::run(true) else { return };
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
