//! Background workers (preloaded only). A launcher, connected to no database, starts one worker per database named
//! in `dedup.database` once that database exists, and starts it again if it dies (a crash, `pg_terminate_backend`);
//! a worker stops by itself when a configuration reload takes its database off the list. Each database's worker
//! purges expired marks every `dedup.purge_interval`, batch by batch in short transactions, and keeps the shared
//! Bloom filter loaded for the database's inboxes. Nothing crash-loops: a missing database or extension is logged
//! once and waited for, and an ERROR in one batch is logged and the next goes on.

use crate::errors::server_log;
use crate::shmem;
use crate::xact::in_transaction;
use crate::{attempts, guc, ports, purge, rebuild};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often the launcher looks at its workers, and a worker at the filter.
const NAP: Duration = Duration::from_secs(1);

/// Has this process been asked to stop? pgrx's `sigterm_received()` (which `wait_latch()` reads too) clears the flag
/// as it reads it, so the first reader remembers it here for the others: a SIGTERM that stopped a purge cycle between
/// two batches must still make the worker leave.
static STOPPING: AtomicBool = AtomicBool::new(false);

fn stopping() -> bool {
    if BackgroundWorker::sigterm_received() {
        STOPPING.store(true, Ordering::Relaxed);
    }
    STOPPING.load(Ordering::Relaxed)
}

/// Waits up to `timeout` for a signal; false once the process must stop (terminated, or the postmaster died).
fn nap(timeout: Duration) -> bool {
    if !BackgroundWorker::wait_latch(Some(timeout)) {
        STOPPING.store(true, Ordering::Relaxed);
    }
    !stopping()
}

/// Is the postmaster alive (else there is no server left to write to)?
fn postmaster_alive() -> bool {
    // SAFETY: polls for the postmaster's death, without waiting (timeout 0) and without the latch.
    let events = unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_TIMEOUT | pg_sys::WL_POSTMASTER_DEATH) as i32,
            0,
            pg_sys::PG_WAIT_EXTENSION,
        )
    };
    events & pg_sys::WL_POSTMASTER_DEATH as i32 == 0
}

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

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_dedup_launcher_main(_arg: pg_sys::Datum) {
    // SAFETY: a postmaster global, set from its options before any worker is forked.
    if unsafe { pg_sys::IsBinaryUpgrade } {
        // pg_upgrade restores the schema into a server started with -b: a worker would race it, repairing the
        // filter trigger of dedup.attempt_counts between the table's creation and the restore of that very
        // trigger ("already exists"). Exiting with 0, the launcher is not started again until a normal start.
        return;
    }
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
        let Some(databases) = in_transaction("listing databases", databases) else {
            if !nap(NAP) {
                exit_for_restart();
            }
            continue;
        };
        // Inbox state in shared memory of databases that were dropped (each database's worker frees that of its
        // own dropped tables).
        if let Some(region) = shmem::region() {
            region.free_entries(|ns| !databases.iter().any(|(_, oid)| *oid == shmem::database_of(ns)));
        }
        let unserved: Vec<&String> = wanted.iter().filter(|name| !workers.contains_key(*name)).collect();
        for name in unserved {
            let oid = databases.iter().find(|(db, _)| db == name).map(|(_, oid)| *oid);
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
                        server_log!(
                            "pg_dedup launcher: database \"{name}\" (in dedup.database) does not exist; waiting for it"
                        );
                    }
                }
            }
        }
        if !nap(NAP) {
            exit_for_restart();
        }
    }
}

/// Leaves on SIGTERM with exit code 1: the postmaster then starts the launcher again after its restart time (a
/// `pg_terminate_backend` is not a request to stop for good), and at server shutdown nothing is restarted anyway.
#[allow(unreachable_code)] // proc_exit is declared noreturn in some majors' headers and not in others
fn exit_for_restart() -> ! {
    // SAFETY: ends this background process, as Postgres's own workers do; nothing of ours is left to clean up.
    unsafe { pg_sys::proc_exit(1) };
    unreachable!("proc_exit does not return")
}

/// Every database: name and oid. The launcher is connected to no database, so it can read the shared catalog
/// pg_database only by a plain heap scan (no index, no syscache), as the autovacuum launcher does.
fn databases() -> Vec<(String, pg_sys::Oid)> {
    // SAFETY: a catalog scan in a transaction, opened and closed here; tuples are only read while the scan is on
    // them.
    unsafe {
        let rel = pg_sys::table_open(pg_sys::DatabaseRelationId, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        let mut found = Vec::new();
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let form = ports::GETSTRUCT::<pg_sys::FormData_pg_database>(tuple);
            let name = std::ffi::CStr::from_ptr((*form).datname.data.as_ptr()).to_string_lossy().into_owned();
            found.push((name, (*form).oid));
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
        // SAFETY: reads a process global, set at process start.
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
}

/// Is a worker recorded in `db`'s slot alive?
fn worker_serving(db: pg_sys::Oid) -> bool {
    shmem::region()
        .and_then(|r| r.worker_slot(db, false))
        .is_some_and(|slot| serving(slot.pid.load(Ordering::Acquire), db))
}

/// Is `pid` a live server process connected to database `db` (the worker recorded in a slot)? Looking in the
/// process array rather than asking the kernel: a pid the kernel reused for something else does not count.
fn serving(pid: i32, db: pg_sys::Oid) -> bool {
    if pid == 0 {
        return false;
    }
    // SAFETY: looks the pid up in the shared process array (under its lock); the PGPROC it returns stays in shared
    // memory, and only its database is read.
    let proc = unsafe { pg_sys::BackendPidGetProc(pid) };
    // SAFETY: a PGPROC found above, in shared memory for the life of the server.
    !proc.is_null() && unsafe { (*proc).databaseId } == db
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_dedup_worker_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // SAFETY: the launcher passes an oid datum, never NULL.
    let db = unsafe { pg_sys::Oid::from_datum(arg, false) }.expect("the launcher passes a database oid");
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(db), None);
    // Whatever `ALTER DATABASE ... SET search_path` says, the worker (a superuser) resolves names in pg_catalog
    // only; every statement it runs is schema-qualified besides.
    // SAFETY: sets a setting of this process, before any transaction.
    unsafe {
        pg_sys::SetConfigOption(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        )
    };
    // SAFETY: reads a process global, set at process start.
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
    // SAFETY: a catalog lookup in a transaction; the name, when there is one, is a NUL-terminated palloc'd copy.
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
    let mut installed = false;
    let mut last_purge: Option<Instant> = None;
    // Counts of delivery attempts are made durable every dedup.attempts_flush_interval, also between the batches of
    // a long purge cycle, and once more before the worker stops (a clean shutdown stops it first).
    let last_flush = std::cell::Cell::new(Instant::now());
    let flush_interval = || Duration::from_millis(guc::ATTEMPTS_FLUSH_INTERVAL.get().max(1) as u64);
    let flush = |installed: bool| {
        if installed {
            last_flush.set(Instant::now());
            attempts::make_durable();
        }
    };
    // When the extension was first seen missing (DROP EXTENSION, or not created yet): from the next round on,
    // counts made before that can never be written, and their slots go back to the other databases.
    let mut missing_since: Option<pg_sys::TimestampTz> = None;
    let flush_if_due = |installed: bool| {
        if last_flush.get().elapsed() >= flush_interval() {
            flush(installed);
        }
    };
    loop {
        if !reload_and_still_listed(&database) {
            flush(installed);
            server_log!("pg_dedup worker: database \"{database}\" is no longer in dedup.database; stopping");
            slot.pid.store(0, Ordering::Release);
            return; // exit code 0: the postmaster does not start it again
        }
        // SAFETY: reads the clock.
        let checked_at = unsafe { pg_sys::GetCurrentTimestamp() };
        installed = in_transaction("checking for the extension", || {
            Spi::get_one::<bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'pg_dedup')",
            )
            .ok()
            .flatten()
            .unwrap_or(false)
        })
        .unwrap_or(false);
        if !installed && !told_missing {
            server_log!(
                "pg_dedup worker: extension pg_dedup is not installed in database \"{database}\"; waiting for it"
            );
        }
        told_missing = !installed;
        match (installed, missing_since) {
            (true, _) => missing_since = None,
            (false, None) => missing_since = Some(checked_at),
            // Missing at two checks: a count older than the first belongs to an extension dropped since (one made
            // after a CREATE EXTENSION that came in between is newer, and a DROP since would be seen by this check).
            (false, Some(since)) => attempts::drop_database_counts(since),
        }
        let interval = guc::purge_interval();
        if installed {
            in_transaction("repairing filter triggers", rebuild::repair_triggers);
            in_transaction("looking after the Bloom filter", rebuild::look_after_filter);
            if guc::PURGE.get() && last_purge.is_none_or(|t| t.elapsed() >= interval) {
                last_purge = Some(Instant::now());
                // A cycle pauses between two batches, and stops there when the worker is asked to stop, or its
                // database has left `dedup.database` (so that a DROP DATABASE after the reload need not wait for a
                // long cycle).
                purge::purge_cycle(slot, |pause| {
                    flush_if_due(installed);
                    wait_out(pause, &database)
                });
            }
            flush_if_due(installed);
        }
        // Publish what the purges did to the table statistics, as a backend does when it goes idle: autovacuum
        // learns of the dead rows only from them. A no-op when nothing is pending; what is held back (flushed
        // less than a second ago) goes out on a later round.
        #[allow(clippy::let_unit_value)] // returns the time until the next flush from PostgreSQL 15 on
        // SAFETY: called outside any transaction, as a backend does when it goes idle.
        let _ = unsafe { pg_sys::pgstat_report_stat(false) };
        // Wake for the next purge or the next look at the filter, whichever comes first (with purging off, only
        // the latter).
        let until_purge = match (guc::PURGE.get(), last_purge) {
            (false, _) => NAP,
            (true, None) => Duration::ZERO,
            (true, Some(t)) => interval.saturating_sub(t.elapsed()),
        };
        let until_flush = flush_interval().saturating_sub(last_flush.get().elapsed());
        if !nap(until_purge.min(until_flush).clamp(Duration::from_millis(10), NAP)) {
            // Terminated (the launcher notices and starts a new worker, unless the database left the list; a clean
            // shutdown terminates the workers first), or the postmaster died (then nothing is restarted, and there
            // is no server left to write to).
            if postmaster_alive() {
                flush(installed);
            }
            slot.pid.store(0, Ordering::Release);
            exit_for_restart();
        }
    }
}

/// Reloads the configuration files if a SIGHUP asked for it (pg_reload_conf()).
fn reload_if_asked() {
    if BackgroundWorker::sighup_received() {
        // SAFETY: rereads the configuration files between transactions, as a SIGHUP asks.
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
}

/// Waits `pause` between two batches of a purge, rereading the configuration when asked to; false when the worker
/// is to stop or its database has left `dedup.database`. A wake-up for anything else does not end the pause: the
/// latch is also set by signals the worker has no use for here (most likely the shared invalidation queue asking a
/// process that lags behind to catch up, after DDL elsewhere; not traced), and the first pause of a cycle was seen to
/// end at once that way, where `dedup.purge_batch_delay` is the room a batch promises to leave. A reload that
/// shortens the delay shortens the pause under way.
fn wait_out(pause: Duration, database: &str) -> bool {
    let start = Instant::now();
    loop {
        if stopping() || !reload_and_still_listed(database) {
            return false;
        }
        let end = start + pause.min(Duration::from_millis(guc::PURGE_BATCH_DELAY.get() as u64));
        // What is left, to the millisecond a latch's wait counts in.
        let left = end.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            return true;
        }
        if !nap(left) {
            return false;
        }
    }
}

/// Reloads the configuration when asked to; is this worker's database still in `dedup.database`?
fn reload_and_still_listed(database: &str) -> bool {
    reload_if_asked();
    guc::worker_databases().iter().any(|name| name == database)
}
