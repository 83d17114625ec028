//! The one door to the shared filter for an inbox: what it says of ids ("certainly never marked", or "maybe"), with
//! the inbox's lookup counters kept, and, once per session, a NOTICE when the installation leaves the filter out.
//! `mark`, `idempotency` and `seen()` ask here, never the filter itself.

use crate::errors;
use crate::inbox::Inbox;
use crate::shmem::Counter;
use crate::{filter, guc};
use std::cell::Cell;

thread_local! {
    static TOLD_DEGRADED: Cell<bool> = const { Cell::new(false) };
}

/// For each of `ids`, whether it may have been marked in `inbox` (false: certainly never written to it); None when no
/// filter may answer for the inbox. Counts the lookups and the "certainly new" answers.
pub fn maybe(inbox: &Inbox, ids: &[&str]) -> Option<Vec<bool>> {
    tell_once_if_degraded();
    let maybe = inbox.filter()?.maybe(ids);
    inbox.count(Counter::Lookups, ids.len() as u64);
    inbox.count(Counter::CertainlyNew, maybe.iter().filter(|m| !**m).count() as u64);
    Some(maybe)
}

/// `maybe` of one id: Some(true) if the filter vouches that `id` was never written to `inbox` (so it may go straight
/// in), Some(false) for "maybe", None when no filter answers.
pub fn certainly_new(inbox: &Inbox, id: &str) -> Option<bool> {
    tell_once_if_degraded();
    let certainly_new = !inbox.filter()?.may_contain(id);
    inbox.count(Counter::Lookups, 1);
    inbox.count(Counter::CertainlyNew, certainly_new as u64);
    Some(certainly_new)
}

/// When the installation is why no filter answers (no preloading, or no worker for this database), says so once per
/// session: everything stays correct, but the user should know.
fn tell_once_if_degraded() {
    if !TOLD_DEGRADED.with(|told| told.replace(true)) {
        if let Some((message, hint)) = degraded() {
            errors::notice(message, Some(hint));
        }
    }
}

/// What this installation leaves out for the current database, and how to get it.
fn degraded() -> Option<(String, String)> {
    if !filter::is_preloaded() {
        return Some((
            "the shared Bloom filter is off because pg_dedup is not in shared_preload_libraries; every call \
             uses the inbox index (correct, a little slower), and no background worker purges expired marks"
                .into(),
            "Add pg_dedup to shared_preload_libraries and restart the server to enable them.".into(),
        ));
    }
    if guc::serves_this_database() {
        return None;
    }
    let database = crate::catalog::current_database();
    let mut listed = guc::worker_databases();
    let setting = listed.join(", ");
    listed.push(database.clone());
    Some((
        format!(
            "no pg_dedup worker looks after database \"{database}\" (dedup.database = '{setting}'): expired \
             marks are never purged (only dedup.purge() removes them) and the shared Bloom filter is never loaded"
        ),
        format!(
            "Add it and reload: ALTER SYSTEM SET dedup.database = '{}'; SELECT pg_reload_conf();",
            listed.join(", ")
        ),
    ))
}
