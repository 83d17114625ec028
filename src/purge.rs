//! Deleting expired marks in short batches, found through the btree on `expires_at`, so a batch costs the same
//! whatever the table size. A batch never waits for a row another transaction holds (a mark() renewing it wins).
//! Where the table allows (its shape is `plain`), a batch deletes straight from the heap (`direct::delete_expired`):
//! it walks the btree and passes over held rows without waiting, with no statement, no rights switch and nothing
//! to undo. Otherwise (an owner's trigger, rule or row security, a Citus table) it runs SQL: first a plain DELETE
//! of up to `limit` expired rows — no row locks — under a 1 ms lock_timeout; if some row is held, that attempt fails
//! and is undone, and the batch is redone with `FOR UPDATE SKIP LOCKED`, which passes over held rows. The
//! background worker runs each batch in a transaction of its own, so undoing a failed attempt is rolling back that
//! transaction; `dedup.purge()` runs in the caller's transaction: directly, in one walk of the btree; through SQL,
//! batch after batch, each attempt wrapped in a subtransaction (while the backend has room for one).

use crate::clock::statement_now;
use crate::errors::server_log;
use crate::inbox::{self, Access, Inbox, Stmt};
use crate::shmem::{Counter, WorkerSlot};
use crate::xact::{self, in_transaction, try_transaction};
use crate::{attempts, citus, direct, guc, input, ports, positions, rights};
use pgrx::prelude::*;
use std::ffi::CStr;
use std::time::{Duration, Instant};

/// Rows of the first batch of `dedup.purge()` through SQL (the worker uses `dedup.purge_batch_size`); each next batch
/// is twice the last, up to `LARGEST_BATCH` (`in_batches`), except on a distributed inbox.
pub const BATCH_SIZE: i64 = 10_000;

/// The largest batch of `dedup.purge()` through SQL. Its statement gathers the ctids of this many rows into an array
/// and sorts them again for its TID scan: some tens of MB of the statement's memory at its peak.
const LARGEST_BATCH: i64 = 1_280_000;

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

/// Deletes up to `limit` marks of `inbox` that expired before `now` (not before `from`, when given) straight from the
/// heap, and counts them; None when the table needs SQL (`purge_batch`). With `paced`, the batch offers the CPU to
/// other processes as it goes (`direct::delete_expired`).
fn purge_directly(
    inbox: &Inbox,
    now: TimestampWithTimeZone,
    from: Option<pg_sys::TimestampTz>,
    limit: i64,
    paced: bool,
    after: Option<&direct::Gone>,
    keep: bool,
) -> Option<direct::Deleted> {
    let deleted = direct::delete_expired(inbox, now, from, limit, paced, after, keep)?;
    inbox.count(Counter::Purged, deleted.rows as u64);
    Some(deleted)
}

/// Deletes up to `limit` marks of `inbox` that expired before `now` through SQL; returns how many. With
/// `HeldRows::WaitBriefly` it may raise lock_not_available, and the caller undoes it and retries with `Skip`.
pub fn purge_batch(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64, held: HeldRows) -> i64 {
    let run = |stmt| Spi::connect(|client| inbox.run(client, stmt, &[now.into(), limit.into()]).len()) as i64;
    let deleted = match held {
        HeldRows::WaitBriefly => inbox.with_lock_timeout(HELD_ROW_PATIENCE, || run(Stmt::PurgeBatchUnlocked)),
        HeldRows::Skip => run(Stmt::PurgeBatch),
    };
    inbox.count(Counter::Purged, deleted as u64);
    deleted
}

/// One batch through SQL inside the caller's transaction: the quick attempt in a subtransaction, then skipping held
/// rows. Once the backend's subtransaction cache is half full, only the latter: each batch's subtransaction would
/// otherwise stay in it, and past 64 the cache overflows. Once a batch had to skip, for a held row or for want of
/// room, so do the batches after it (`skipping` says so): the held row is likely still held, a large batch undone
/// for it is a lot of work lost, and room does not come back before the transaction ends.
fn purge_batch_in_place(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64, skipping: &mut bool) -> i64 {
    let quick = || xact::unless_it_waits(|| purge_batch(inbox, now, limit, HeldRows::WaitBriefly));
    let attempt = (!*skipping && xact::has_room()).then(quick).flatten();
    attempt.unwrap_or_else(|| {
        *skipping = true;
        purge_batch(inbox, now, limit, HeldRows::Skip)
    })
}

/// Deletes up to `limit` expired marks of `inbox` (all of them when `None`), then as many of its expired positions
/// (`advance()`), in the current transaction. Returns how many were deleted.
pub fn purge_inbox(inbox: &Inbox, limit: Option<i64>) -> i64 {
    if limit == Some(0) {
        return 0;
    }
    let now = statement_now();
    // Directly in one walk of the expires_at btree, not batch after batch: rows this transaction deleted keep their
    // index entries until it ends (no scan may skip them before), so each batch's walk would step again over the
    // entries of every batch before it; 500,000 expired marks took 13.25 M entries read and 5x the time.
    let direct = purge_directly(inbox, now, None, limit.unwrap_or(i64::MAX), false, None, false);
    let mut deleted = direct.map(|d| d.rows).unwrap_or_else(|| {
        let mut skipping = false;
        // Citus sends a distributed batch's ids to every shard: its size stays until larger ones are measured.
        let largest = if inbox.shape().distributed { BATCH_SIZE } else { LARGEST_BATCH };
        in_batches(limit, largest, |want| purge_batch_in_place(inbox, now, want, &mut skipping))
    });
    for (_, purge) in KEPT_APART {
        deleted += in_batches(limit.map(|l| l - deleted), LARGEST_BATCH, |want| purge(inbox, now, want));
    }
    deleted
}

/// Deletes up to a number of rows of an inbox that expired before a time; returns how many.
type PurgeBatch = fn(&Inbox, TimestampWithTimeZone, i64) -> i64;

/// What an inbox keeps apart from its table, and how to delete a batch of what expired of it before `now`: the
/// positions of `advance()` and the counts of `attempt()`, each in a table of the extension owner's (whose rights
/// they take to delete).
const KEPT_APART: [(&str, PurgeBatch); 2] =
    [("positions", positions::purge_batch), ("counts of attempts", attempts::purge_batch)];

/// Runs `batch(want)` until it deletes fewer than asked or `limit` is reached; returns the total. The batches run in
/// the caller's transaction, whose deleted rows keep their index entries until it ends, so each batch's walk of the
/// `expires_at` btree steps again over the entries of every batch before it: with batches of one size that grows as
/// the square of their number (500,000 expired marks in batches of 10,000 read 13 M entries). Each batch is
/// therefore twice the last, from `BATCH_SIZE` up to `largest`: with `LARGEST_BATCH`, the entries walked again stay
/// below the rows deleted up to 2.5 M rows, and at 3.7 times them for 10 M (in batches of 10,000: 500 times).
fn in_batches(limit: Option<i64>, largest: i64, mut batch: impl FnMut(i64) -> i64) -> i64 {
    let mut deleted = 0;
    let mut size = BATCH_SIZE;
    loop {
        let want = limit.map_or(size, |l| (l - deleted).min(size));
        if want <= 0 {
            return deleted;
        }
        let done = batch(want);
        deleted += done;
        if done < want {
            return deleted;
        }
        size = (size * 2).min(largest);
    }
}

/// One purge cycle of the background worker over every inbox of this database, each batch in a transaction of its
/// own, run with the table owner's rights. Before each batch it calls `go_on(pause)`, which waits `pause`
/// (`dedup.purge_batch_delay` after a full batch, zero otherwise) and says whether to go on.
pub fn purge_cycle(slot: &WorkerSlot, go_on: impl Fn(Duration) -> bool) {
    let started = Instant::now();
    // SAFETY: reads the clock; no state involved.
    let start = unsafe { pg_sys::GetCurrentTimestamp() };
    let (names, coordinator) =
        in_transaction("listing inboxes", || (inbox::all_names(), citus::coordinator())).unwrap_or_default();
    let cap = match guc::PURGE_MAX_ROWS_PER_CYCLE.get() {
        0 => i64::MAX,
        n => n as i64,
    };
    let mut total = 0i64;
    let mut pause = Duration::ZERO;
    for name in &names {
        // A distributed inbox's marks are purged once, through Citus, by the coordinator's worker; every node has
        // it registered (to use it there), and the others leave its marks alone. Positions are each node's own.
        let elsewhere = || {
            let inbox = inbox::open(name, Access::Read);
            inbox.shape().distributed && !coordinator
        };
        let marks_here = !in_transaction("looking at an inbox", elsewhere).unwrap_or(true);
        if marks_here {
            // Where the last direct batch stopped in the expires_at btree: the next one starts there, and at the first
            // entry again once a purge interval has passed since the walk last did, so that what a walk leaves behind
            // (a row held when it passed, one committed since with an expiry already past) waits no longer than for
            // the next cycle, even in a cycle that does not end because expired marks come as fast as it purges.
            let mut from = None;
            let mut walk_started = Instant::now();
            // The rows the last direct batch deleted, when they share one expiry and the next batch walks again over
            // all of them (`flush_commit_of`, `direct::Gone`).
            let mut last: Option<direct::Gone> = None;
            let capped = loop {
                if !go_on(std::mem::take(&mut pause)) {
                    return;
                }
                let limit = (guc::PURGE_BATCH_SIZE.get() as i64).min(cap - total);
                if limit <= 0 {
                    break true;
                }
                if let Some(gone) = &last {
                    in_transaction("flushing the WAL before a batch", || flush_commit_of(gone.xid()));
                }
                // Directly where the table allows: no code of the owner's can run, so no rights to switch to. Else
                // through SQL, as the table's owner. A worker told to leave room for foreground work between its
                // batches (`dedup.purge_batch_delay`) leaves some within them too.
                let paced = guc::PURGE_BATCH_DELAY.get() > 0;
                if walk_started.elapsed() >= guc::purge_interval() {
                    (from, walk_started) = (None, Instant::now());
                }
                let after = last.as_ref();
                let batch = |held| {
                    move || {
                        worker_batch(|| {
                            let inbox = inbox::open(name, Access::Delete);
                            let now = statement_now();
                            match purge_directly(&inbox, now, from, limit, paced, after, true) {
                                Some(deleted) => {
                                    let again = &deleted.rewalked;
                                    if again.unread + again.read > 0 {
                                        pgrx::debug1!(
                                            "pg_dedup worker: a batch of inbox \"{name}\" met {} index entries of \
                                             the rows the last one deleted and read {} of those rows again (their \
                                             pages had changed); it asked for the others to be marked dead",
                                            again.unread + again.read,
                                            again.read
                                        );
                                    }
                                    (deleted.rows, deleted.reached, deleted.gone, deleted.all_at_reached)
                                }
                                None => {
                                    let deleted =
                                        rights::as_table_owner(inbox.relid, || purge_batch(&inbox, now, limit, held));
                                    (deleted, None, None, false)
                                }
                            }
                        })
                    }
                };
                // The quick attempt (always the only one when direct); if it met a row another transaction holds,
                // it was rolled back: skip held rows. Anything else that fails (the batch timed out, say) is logged,
                // and the cycle goes on with the next inbox.
                let what = format!("purging a batch of inbox \"{name}\"");
                let deleted = match try_transaction(batch(HeldRows::WaitBriefly)) {
                    Ok(deleted) => Some(deleted),
                    Err((PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, _)) => {
                        in_transaction(&what, batch(HeldRows::Skip))
                    }
                    Err((_, message)) => {
                        server_log!("pg_dedup worker: {what} failed: {message}");
                        None
                    }
                };
                let Some((deleted, reached, gone, walked_again)) = deleted else { break false };
                // Rows of their own expiries: the next batch meets again only the one this one stopped at, not worth
                // a flush and a lock.
                (from, last) = (reached, gone.filter(|_| walked_again));
                total += deleted;
                if deleted < limit {
                    break false;
                }
                pause = Duration::from_millis(guc::PURGE_BATCH_DELAY.get() as u64);
            };
            record_backlog(name, capped);
        }
        purge_kept_apart(name, &go_on);
    }
    slot.record_cycle(start, started.elapsed().as_micros() as i64, total);
}

/// What inbox `name` keeps apart (`KEPT_APART`) that expired, batch after batch, each in a transaction of its own,
/// paced like the marks' batches.
fn purge_kept_apart(name: &str, go_on: &impl Fn(Duration) -> bool) {
    let limit = guc::PURGE_BATCH_SIZE.get() as i64;
    for (what, purge) in KEPT_APART {
        let mut pause = Duration::ZERO;
        while go_on(std::mem::take(&mut pause)) {
            let batch = || {
                worker_batch(|| {
                    let inbox = inbox::open(name, Access::Delete);
                    purge(&inbox, statement_now(), limit)
                })
            };
            match in_transaction(&format!("purging the {what} of inbox \"{name}\""), batch) {
                Some(deleted) if deleted == limit => pause = Duration::from_millis(guc::PURGE_BATCH_DELAY.get() as u64),
                _ => break,
            }
        }
    }
}

/// Runs one batch of the worker, in the transaction of its own that the worker opened for it: under
/// `dedup.purge_batch_timeout` (past it, the batch is cancelled like a statement past statement_timeout, 57014,
/// whatever it was doing: waiting for a lock, running a slow trigger), and committed without waiting for its WAL to
/// reach the disk or a synchronous standby (`SET LOCAL synchronous_commit = off`). With the server's default, `on`,
/// each batch waited for a flush of its own: about 103 WAL flushes per cycle of 100,000 rows in batches of 1,000,
/// against 10-11 this way (stop 57). A batch lost in a crash loses nothing: its rows come back, still expired, and
/// the next cycle deletes them again. On a distributed inbox this is the coordinator's commit only; the shards'
/// commits on the workers follow the workers' own setting (and a two-phase commit's steps always flush).
fn worker_batch<R>(f: impl FnOnce() -> R) -> R {
    guc::set_local(c"synchronous_commit", c"off");
    let timeout = guc::PURGE_BATCH_TIMEOUT.get();
    if timeout > 0 {
        // Disarmed below, or by `xact::try_transaction` when the batch fails.
        ports::enable_statement_timeout(timeout);
    }
    let result = f();
    ports::disable_statement_timeout();
    result
}

/// Makes sure the commit of transaction `xid` (a batch of the worker's) can be taken as done by any process reading
/// its rows, flushing the WAL that far unless the WAL writer already has: before a batch that walks again over the
/// entries of every row that batch deleted (all of one expiry, where the place it starts from cannot move past them;
/// `direct::Deleted::all_at_reached`).
///
/// Why: a walk marks an index entry dead (and the walks after it step over it within its page, without visiting the
/// heap) only when the row is surely dead, which needs the hint that its deleter committed, and that hint may not be
/// set while the commit log's LSN for the deleter (the latest asynchronous commit among the 32 transactions that share
/// its slot, `worker_batch`'s among them) is not on disk. Without this flush, one cycle over 20,000 marks of one expiry
/// in batches of 1,000 read 82,946 entries at pauses of 10 to 300 ms (each batch walked over the last three batches'
/// rows; at 1 s the WAL writer had flushed in time); with it, 42,146, its own rows and the last batch's
/// (bench/results/profiles/issue-23.md, stop 59). Marks of their own expiries need no flush: the next batch starts
/// past them.
fn flush_commit_of(xid: pg_sys::TransactionId) {
    // SAFETY: plain calls. The LSN is the end of a commit record already written to the WAL buffers (or invalid, 0,
    // for a synchronous commit), a position XLogFlush can flush to; it returns at once when that much is on disk.
    unsafe { pg_sys::XLogFlush(pg_sys::TransactionIdGetCommitLSN(xid)) }
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

/// Deletes expired marks (and expired positions of `advance()`) now, in `inbox` or in every inbox (NULL), at most
/// `max_rows` of them (NULL: all). Returns how many were deleted. Works without the background worker, e.g. from cron or pg_cron.
#[pg_extern(volatile, parallel_unsafe)]
fn purge(inbox: default!(Option<&str>, "NULL"), max_rows: default!(Option<i64>, "NULL")) -> i64 {
    input::require_writable("purge");
    let max_rows = input::max_rows(max_rows);
    let names = match inbox {
        Some(name) => vec![input::inbox_name(Some(name)).to_owned()],
        None => inbox::all_names(),
    };
    let mut deleted = 0;
    for name in names {
        let remaining = max_rows.map(|m| m - deleted);
        let inbox = inbox::open(&name, Access::Delete);
        deleted += purge_inbox(&inbox, remaining);
    }
    deleted
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    fn expired_inbox(name: &str, expired: i64, live: i64) {
        run(&format!(
            "SELECT dedup.create_inbox('{name}');
             INSERT INTO dedup.inbox_{name} SELECT 'e' || g, now() - interval '1 minute' FROM generate_series(1, {expired}) g;
             INSERT INTO dedup.inbox_{name} SELECT 'l' || g, now() + interval '1 hour' FROM generate_series(1, {live}) g"
        ));
    }

    #[pg_test]
    fn purge_works_through_batches_and_counts_what_it_deleted() {
        expired_inbox("batches", 25_000, 10);
        assert_eq!(one::<i64>("SELECT dedup.purge('batches')"), 25_000, "more than a batch of 10,000");
        assert_eq!(count("dedup.inbox_batches"), 10);
        assert_eq!(one::<i64>("SELECT purged FROM dedup.stats WHERE inbox = 'batches'"), 25_000);
    }

    #[pg_test]
    fn purge_walks_the_expiry_btree_once() {
        expired_inbox("walked", 25_000, 10);
        let read =
            || one::<i64>("SELECT pg_stat_get_xact_tuples_returned('dedup.inbox_walked_expires_at_idx'::regclass)");
        let before = read();
        assert_eq!(one::<i64>("SELECT dedup.purge('walked')"), 25_000);
        // Batch after batch, each walk would read the entries of the rows the walks before it deleted: 55,000.
        assert!(read() - before <= 25_011, "{} index entries read to purge 25,000 marks", read() - before);
    }

    #[pg_test]
    fn purge_through_sql_walks_the_expiry_btree_about_twice() {
        expired_inbox("walked_sql", 100_000, 10);
        // An owner's trigger: the table needs the executor, so the purge runs SQL, batch after batch. With the
        // table's statistics each batch's plan is the index scan that stops at the batch's size, as on a live
        // inbox (without them, a bitmap scan that reads every expired entry).
        run("CREATE FUNCTION purge_pass() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN OLD; END $$;
             CREATE TRIGGER pass BEFORE DELETE ON dedup.inbox_walked_sql FOR EACH ROW EXECUTE FUNCTION purge_pass();
             ANALYZE dedup.inbox_walked_sql");
        let read =
            || one::<i64>("SELECT pg_stat_get_xact_tuples_returned('dedup.inbox_walked_sql_expires_at_idx'::regclass)");
        let before = read();
        assert_eq!(one::<i64>("SELECT dedup.purge('walked_sql')"), 100_000);
        assert_eq!(count("dedup.inbox_walked_sql"), 10);
        // Batches of 10,000, 20,000, 40,000 and the last 30,000 read 210,000; batches of one size 10,000 would read
        // 10,000 + 20,000 + ... + 100,000 and the empty walk after them: 650,000; the direct walk, 100,000.
        let read = read() - before;
        assert!((200_000..=250_000).contains(&read), "{read} index entries read to purge 100,000 marks");
    }

    #[pg_test]
    fn purge_of_no_rows_deletes_nothing_and_checks_nothing() {
        expired_inbox("nothing", 3, 0);
        // A table published for deletes without a replica identity refuses any delete (55000): a purge of at most
        // zero rows must not start one.
        run("ALTER TABLE dedup.inbox_nothing REPLICA IDENTITY NOTHING;
             CREATE PUBLICATION purge_nothing FOR TABLE dedup.inbox_nothing");
        assert_eq!(one::<i64>("SELECT dedup.purge('nothing', 0)"), 0);
        assert_eq!(count("dedup.inbox_nothing"), 3);
    }

    #[pg_test]
    fn purge_leaves_the_callers_settings_as_they_were() {
        expired_inbox("settings", 5, 0);
        run("SET LOCAL lock_timeout = '7s'");
        run("SELECT dedup.purge('settings')");
        assert_eq!(one::<String>("SHOW lock_timeout"), "7s");
        run("SET LOCAL lock_timeout = 0");
        run("SELECT dedup.purge('settings')");
        assert_eq!(one::<String>("SHOW lock_timeout"), "0");
        // The worker's batches commit asynchronously (`worker_batch`); a caller's transaction keeps its own way.
        assert_eq!(one::<String>("SHOW synchronous_commit"), "on");
    }

    #[pg_test]
    fn purge_a_batch_of_the_worker_commits_without_waiting_for_the_disk() {
        assert_eq!(one::<String>("SHOW synchronous_commit"), "on");
        // A batch through SQL runs in nested settings (the owner's rights, lock_timeout), which end before it does.
        let inside = super::worker_batch(|| {
            crate::guc::with_setting(c"lock_timeout", c"1ms", || one::<String>("SHOW synchronous_commit"))
        });
        assert_eq!(inside, "off");
        // The worker commits the batch's transaction right after: the setting must outlive the batch (as `SET LOCAL`
        // does, which `guc::scoped` would not).
        assert_eq!(one::<String>("SHOW synchronous_commit"), "off", "still off after the batch, for its commit");
    }

    #[pg_test]
    fn purge_a_batch_deletes_only_marks_expired_before_now() {
        expired_inbox("edges", 3, 2);
        let inbox = crate::inbox::open("edges", crate::inbox::Access::Delete);
        let now = crate::clock::statement_now();
        assert_eq!(super::purge_batch(&inbox, now, 2, super::HeldRows::WaitBriefly), 2);
        assert_eq!(super::purge_batch(&inbox, now, 10, super::HeldRows::Skip), 1);
        assert_eq!(super::purge_batch(&inbox, now, 10, super::HeldRows::Skip), 0);
        assert_eq!(count("dedup.inbox_edges"), 2);
    }

    #[pg_test]
    fn a_cancel_met_in_the_walk_is_an_error() {
        expired_inbox("cancelled", 5, 0);
        let inbox = crate::inbox::open("cancelled", crate::inbox::Access::Delete);
        let now = crate::clock::statement_now();
        // SAFETY: reads a backend global.
        let context = unsafe { pg_sys::CurrentMemoryContext };
        let caught = crate::xact::subtransaction(|| {
            // A cancel asked for as its signal handler asks: nothing on the way checks for interrupts before the
            // walk does, after its first entry, under its one guard (`unguarded`).
            // SAFETY: sets the flags a signal handler sets, in this process.
            unsafe {
                pg_sys::QueryCancelPending = 1;
                pg_sys::InterruptPending = 1;
            }
            crate::direct::delete_expired(&inbox, now, None, 10, false, None, false).map(|deleted| deleted.rows)
        });
        let error = caught.expect_err("the cancel is an ERROR");
        assert_eq!(crate::xact::code_of(&error), PgSqlErrorCode::ERRCODE_QUERY_CANCELED);
        // SAFETY: reads a backend global.
        assert_eq!(unsafe { pg_sys::CurrentMemoryContext }, context, "back in the caller's memory context");
        assert_eq!(count("dedup.inbox_cancelled"), 5, "what the walk deleted was rolled back with it");
    }

    #[pg_test]
    fn purge_directly_deletes_only_expired_marks_up_to_the_limit() {
        expired_inbox("direct", 5, 3);
        run("UPDATE dedup.inbox_direct SET expires_at = now() + interval '1 hour' WHERE id = 'e1'");
        let inbox = crate::inbox::open("direct", crate::inbox::Access::Delete);
        let now = crate::clock::statement_now();
        let first = crate::direct::delete_expired(&inbox, now, None, 3, false, None, false).unwrap();
        assert_eq!(first.rows, 3);
        assert!(first.all_at_reached, "the marks of one INSERT share their expiry");
        let rest = crate::direct::delete_expired(&inbox, now, None, 10, true, None, false).unwrap();
        assert_eq!(rest.rows, 1, "the renewed mark is live");
        assert_eq!(count("dedup.inbox_direct"), 4);
        assert_eq!(one::<i64>("SELECT count(*) FROM dedup.inbox_direct WHERE expires_at <= now()"), 0);
    }

    #[pg_test]
    fn purge_directly_from_where_a_batch_stopped_leaves_what_expired_before_it_to_the_next_cycle() {
        run("SELECT dedup.create_inbox('resume')");
        let expired = |id: &str, seconds: i64| {
            run(&format!(
                "INSERT INTO dedup.inbox_resume VALUES ('{id}', now() - interval '1 hour' + {seconds} * interval '1 second')"
            ))
        };
        for (id, seconds) in [("e1", 1), ("e2", 2), ("e3", 3), ("e4", 4)] {
            expired(id, seconds);
        }
        let inbox = crate::inbox::open("resume", crate::inbox::Access::Delete);
        let now = crate::clock::statement_now();
        let first = crate::direct::delete_expired(&inbox, now, None, 2, false, None, false).unwrap();
        assert_eq!(first.rows, 2);
        assert!(first.reached.is_some(), "it says where it stopped");
        assert!(!first.all_at_reached, "e1 and e2 expire a second apart");
        // Committed since, say: one expired before where the batch stopped, one at the very same expiry.
        expired("early", 0);
        expired("e2-twin", 2);
        let next = crate::direct::delete_expired(&inbox, now, first.reached, 10, false, None, false).unwrap();
        assert_eq!(next.rows, 3, "e2-twin, e3 and e4");
        assert_eq!(one::<String>("SELECT string_agg(id, ',') FROM dedup.inbox_resume"), "early");
        let cycle_after = crate::direct::delete_expired(&inbox, now, None, 10, false, None, false).unwrap();
        assert_eq!(cycle_after.rows, 1, "the next cycle, from the start, gets it");
    }

    #[pg_test]
    fn purge_of_a_table_with_code_of_its_owner_or_without_the_expiry_btree_runs_sql() {
        expired_inbox("owned_code", 4, 1);
        run("CREATE TABLE purge_seen (id text);
             CREATE FUNCTION purge_note() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN INSERT INTO purge_seen VALUES (OLD.id); RETURN OLD; END $$;
             CREATE TRIGGER note BEFORE DELETE ON dedup.inbox_owned_code FOR EACH ROW EXECUTE FUNCTION purge_note()");
        let inbox = crate::inbox::open("owned_code", crate::inbox::Access::Delete);
        assert!(crate::direct::delete_expired(&inbox, crate::clock::statement_now(), None, 10, false, None, false)
            .is_none());
        assert_eq!(one::<i64>("SELECT dedup.purge('owned_code')"), 4);
        assert_eq!(count("purge_seen"), 4, "the owner's trigger saw every delete");
        expired_inbox("unindexed_purge", 3, 1);
        run("DROP INDEX dedup.inbox_unindexed_purge_expires_at_idx");
        let inbox = crate::inbox::open("unindexed_purge", crate::inbox::Access::Delete);
        assert!(crate::direct::delete_expired(&inbox, crate::clock::statement_now(), None, 10, false, None, false)
            .is_none());
        assert_eq!(one::<i64>("SELECT dedup.purge('unindexed_purge')"), 3);
    }

    #[pg_test]
    fn purge_a_mark_renewed_before_the_purge_survives_it() {
        expired_inbox("renewed", 1, 0);
        assert!(one::<bool>("SELECT dedup.mark('e1', '1 hour', 'renewed')"));
        assert_eq!(one::<i64>("SELECT dedup.purge('renewed')"), 0);
        assert!(one::<bool>("SELECT dedup.seen('e1', 'renewed')"));
    }

    #[pg_test]
    fn purge_deletes_expired_marks_only_up_to_max_rows() {
        run("SELECT dedup.create_inbox('api_purge')");
        run(
            "INSERT INTO dedup.inbox_api_purge SELECT 'old-' || g, now() - interval '1 minute' FROM generate_series(1, 30) g;
             INSERT INTO dedup.inbox_api_purge SELECT 'live-' || g, now() + interval '1 hour' FROM generate_series(1, 5) g",
        );
        assert_eq!(one::<i64>("SELECT dedup.purge('api_purge', 10)"), 10);
        assert_eq!(one::<i64>("SELECT dedup.purge('api_purge', 0)"), 0);
        assert_eq!(one::<i64>("SELECT dedup.purge('api_purge')"), 20);
        assert_eq!(count("dedup.inbox_api_purge"), 5, "live marks stay");
    }
    #[pg_test]
    fn purge_without_an_inbox_purges_every_inbox() {
        run("SELECT dedup.create_inbox('api_p1'); SELECT dedup.create_inbox('api_p2')");
        run(
            "INSERT INTO dedup.inbox_api_p1 VALUES ('x', now() - interval '1 minute');
             INSERT INTO dedup.inbox_api_p2 VALUES ('x', now() - interval '1 minute'), ('y', now() - interval '1 minute')",
        );
        assert!(one::<i64>("SELECT dedup.purge()") >= 3);
        assert_eq!(count("dedup.inbox_api_p1") + count("dedup.inbox_api_p2"), 0);
    }
}
