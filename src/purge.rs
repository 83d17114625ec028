//! Deleting expired marks in short batches. `dedup.purge()` runs it in the caller's transaction; the background
//! worker (when preloaded) runs the same batches, each in its own transaction.

use crate::claim::statement_now;
use crate::inbox::{Inbox, Stmt};
use pgrx::prelude::*;

/// Rows deleted per statement. Small enough that one batch holds few row locks and little WAL at a time.
pub const BATCH_SIZE: i64 = 10_000;

/// Deletes up to `limit` expired rows of `inbox` (all of them when `None`), skipping rows that another
/// transaction holds (for example a `mark()` renewing them right now). Returns how many were deleted.
pub fn purge_inbox(inbox: &Inbox, limit: Option<i64>) -> i64 {
    let now = statement_now();
    let mut deleted = 0;
    loop {
        let want = limit.map_or(BATCH_SIZE, |l| (l - deleted).min(BATCH_SIZE));
        if want <= 0 {
            return deleted;
        }
        let batch = Spi::connect(|client| inbox.run(client, Stmt::PurgeBatch, &[now.into(), want.into()]).len());
        deleted += batch as i64;
        if (batch as i64) < want {
            return deleted;
        }
    }
}
