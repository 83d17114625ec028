//! Deleting expired marks in short batches. One batch is one statement: it locks up to `limit` expired rows with
//! SKIP LOCKED (a row a concurrent mark() is renewing is left alone, and that mark wins) and deletes them, found
//! through the btree on `expires_at`, so a batch costs the same whatever the table size. `dedup.purge()` runs
//! batches in the caller's transaction; the background worker runs each batch in a transaction of its own.

use crate::claim::statement_now;
use crate::inbox::{Inbox, Stmt};
use crate::shmem::{self, Counter};
use pgrx::prelude::*;

/// Rows per batch for `dedup.purge()` (the worker uses `dedup.purge_batch_size`).
pub const BATCH_SIZE: i64 = 10_000;

/// Deletes up to `limit` marks of `inbox` that expired before `now`; returns how many.
pub fn purge_batch(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64) -> i64 {
    let deleted = Spi::connect(|client| inbox.run(client, Stmt::PurgeBatch, &[now.into(), limit.into()]).len()) as i64;
    shmem::count(shmem::namespace(inbox.relid), Counter::Purged, deleted as u64);
    deleted
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
        let batch = purge_batch(inbox, now, want);
        deleted += batch;
        if batch < want {
            return deleted;
        }
    }
}
