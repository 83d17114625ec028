//! Deleting expired marks in short batches, found through the btree on `expires_at`, so a batch costs the same
//! whatever the table size. A batch never waits for a row another transaction holds (a mark() renewing it wins):
//! it first tries a plain DELETE of up to `limit` expired rows — no row locks, the cheapest purge there is — under
//! a 1 ms lock_timeout; if some row is held, that attempt fails and is undone, and the batch is redone with
//! `FOR UPDATE SKIP LOCKED`, which passes over held rows. The background worker runs each batch in a transaction of
//! its own, so undoing a failed attempt is rolling back that transaction; `dedup.purge()` runs batches in the
//! caller's transaction and wraps each attempt in a subtransaction instead (while the backend has room for one).

use crate::clock::statement_now;
use crate::errors::server_log;
use crate::guc;
use crate::inbox::{self, Access, Inbox, Stmt};
use crate::shmem::{Counter, WorkerSlot};
use crate::xact::{self, in_transaction, try_transaction};
use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;
use std::ffi::{CStr, CString};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Rows per batch for `dedup.purge()` (the worker uses `dedup.purge_batch_size`).
pub const BATCH_SIZE: i64 = 10_000;

/// Backlog counts stop here: past it, "a lot" is all an operator needs to know.
const BACKLOG_COUNT_CAP: i64 = 1_000_000;

/// How long the lock-free attempt may wait for a held row before the batch switches to skipping held rows.
const HELD_ROW_PATIENCE: &CStr = c"1ms";

/// How a batch treats rows another transaction holds.
#[derive(Clone, Copy)]
pub enum HeldRows {
    /// Plain DELETE, waiting at most `HELD_ROW_PATIENCE` for a held row, then failing with lock_not_available.
    WaitBriefly,
    /// `FOR UPDATE SKIP LOCKED`: passes over held rows, at the price of a row lock per purged row.
    Skip,
}

/// Deletes up to `limit` marks of `inbox` that expired before `now`; returns how many. With
/// `HeldRows::WaitBriefly` it may raise lock_not_available, and the caller undoes it and retries with `Skip`.
pub fn purge_batch(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64, held: HeldRows) -> i64 {
    let run = |stmt| Spi::connect(|client| inbox.run(client, stmt, &[now.into(), limit.into()]).len()) as i64;
    let deleted = match held {
        HeldRows::WaitBriefly => {
            let previous = set_lock_timeout(HELD_ROW_PATIENCE);
            let deleted = run(Stmt::PurgeBatchUnlocked);
            set_lock_timeout(&previous);
            deleted
        }
        HeldRows::Skip => run(Stmt::PurgeBatch),
    };
    inbox.count(Counter::Purged, deleted as u64);
    deleted
}

/// One batch inside the caller's transaction: the quick attempt in a subtransaction, then skipping held rows. Once
/// the backend's subtransaction cache is half full (a purge of many batches), only the latter: each batch's
/// subtransaction would otherwise stay in it, and past 64 the cache overflows.
fn purge_batch_in_place(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64) -> i64 {
    let quick = || {
        xact::undo_on(PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, || {
            purge_batch(inbox, now, limit, HeldRows::WaitBriefly)
        })
    };
    xact::has_room().then(quick).flatten().unwrap_or_else(|| purge_batch(inbox, now, limit, HeldRows::Skip))
}

/// Sets lock_timeout (undone with the (sub)transaction if it fails); returns the previous value. A C call, not a
/// SQL statement: it runs twice per batch.
fn set_lock_timeout(value: &CStr) -> CString {
    unsafe {
        let previous = CStr::from_ptr(pg_sys::GetConfigOption(c"lock_timeout".as_ptr(), false, false)).to_owned();
        pg_sys::SetConfigOption(
            c"lock_timeout".as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
        );
        previous
    }
}

/// Deletes up to `limit` expired marks of `inbox` (all of them when `None`), batch after batch, in the current
/// transaction. Returns how many were deleted.
pub fn purge_inbox(inbox: &Inbox, limit: Option<i64>) -> i64 {
    let now = statement_now();
    let mut deleted = 0;
    loop {
        let want = limit.map_or(BATCH_SIZE, |l| (l - deleted).min(BATCH_SIZE));
        if want <= 0 {
            return deleted;
        }
        let batch = purge_batch_in_place(inbox, now, want);
        deleted += batch;
        if batch < want {
            return deleted;
        }
    }
}

/// One purge cycle of the background worker over every inbox of this database, each batch in a transaction of its
/// own, run with the table owner's rights. It stops between two batches when `keep_going` says so.
pub fn purge_cycle(slot: &WorkerSlot, keep_going: impl Fn() -> bool) {
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
            if !keep_going() {
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
                    inbox::as_owner(inbox.relid, || purge_batch(&inbox, statement_now(), limit, held))
                }
            };
            // The quick attempt; if it met a row another transaction holds, it was rolled back: skip held rows.
            let deleted = match try_transaction(batch(HeldRows::WaitBriefly)) {
                Ok(deleted) => Some(deleted),
                Err((PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, _)) => {
                    in_transaction("purging a batch", batch(HeldRows::Skip))
                }
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
            Spi::connect(|client| {
                let rows = inbox.run(client, Stmt::Backlog, &[statement_now().into(), BACKLOG_COUNT_CAP.into()]);
                rows.first().get_one::<i64>().ok().flatten()
            })
            .unwrap_or(-1)
        } else {
            0
        };
        inbox.set_backlog(backlog);
    });
}
