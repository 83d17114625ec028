//! Claiming ids: the heart of `mark()` and `mark_many()`, plus `seen()` and `forget()`.
//!
//! One algorithm serves one id or many, so both obey the same contract:
//! 1. insert the pending ids with `ON CONFLICT DO NOTHING`. A conflict with a row another transaction is still
//!    inserting *waits* for that transaction (the blocking claim): if it commits the id is a duplicate, if it
//!    rolls back our insert goes through. A duplicate writes no WAL and takes no lock.
//! 2. probe the ids that conflicted: a live row means duplicate; an expired row (not purged yet) is renewed in
//!    place, atomically (`UPDATE ... WHERE expires_at <= now`), so the id is new again.
//! 3. anything left vanished between statements (a concurrent purge or forget) or lost a renewal race; go round.
//!
//! When the shared filter says "maybe" for an id, step 2 comes first (a likely duplicate is answered by one
//! lookup, with no insert attempt); when it says "certainly new", the insert goes first and is usually all it takes:
//! those ids (and suspects the lookup did not find) go straight into heap and indexes (`direct_insert`), and only
//! what that could not settle takes the rounds.
//!
//! Ids are processed in sorted order, so two `mark_many()` calls with overlapping ids lock rows in the same order
//! and cannot deadlock each other.

use crate::clock::{expiry, statement_now};
use crate::errors::raise;
use crate::filter::{self, Trusted};
use crate::inbox::{Inbox, Stmt};
use crate::shmem::Counter;
use crate::{direct_insert, guc};
use pgrx::prelude::*;
use rustc_hash::FxHashSet as HashSet;
use std::cell::Cell;

/// Rounds of insert/probe/renew before giving up. Each extra round needs a concurrent purge or forget of the very
/// same id between two statements, so more than a couple of rounds means something is badly wrong.
const MAX_ROUNDS: usize = 16;

thread_local! {
    static TOLD_DEGRADED: Cell<bool> = const { Cell::new(false) };
}

/// The filter that may answer for `inbox`, if any. When the installation is why there is none (no preloading, or no
/// worker for this database), says so once per session: everything stays correct, but the user should know.
fn trusted_filter(inbox: &Inbox) -> Option<Trusted> {
    if !TOLD_DEGRADED.with(|told| told.replace(true)) {
        if let Some((message, hint)) = degraded() {
            pgrx::pg_sys::panic::ErrorReport::new(PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION, message, "pg_dedup")
                .set_hint(hint)
                .report(PgLogLevel::NOTICE);
        }
    }
    Trusted::for_inbox(inbox.ns)
}

/// What this installation leaves out for the current database, and how to get it.
fn degraded() -> Option<(String, String)> {
    if !filter::is_preloaded() {
        return Some((
            "dedup: the shared Bloom filter is off because pg_dedup is not in shared_preload_libraries; every call \
             uses the inbox index (correct, a little slower), and no background worker purges expired marks"
                .into(),
            "Add pg_dedup to shared_preload_libraries and restart the server to enable them.".into(),
        ));
    }
    // SAFETY: MyDatabaseId is set once the backend is connected, which it is when a function runs.
    let database = unsafe { std::ffi::CStr::from_ptr(pg_sys::get_database_name(pg_sys::MyDatabaseId)) }
        .to_string_lossy()
        .into_owned();
    let mut listed = guc::worker_databases();
    if listed.contains(&database) {
        return None;
    }
    let setting = listed.join(", ");
    listed.push(database.clone());
    Some((
        format!(
            "dedup: no pg_dedup worker looks after database \"{database}\" (dedup.database = '{setting}'): expired \
             marks are never purged (only dedup.purge() removes them) and the shared Bloom filter is never loaded"
        ),
        format!(
            "Add it and reload: ALTER SYSTEM SET dedup.database = '{}'; SELECT pg_reload_conf();",
            listed.join(", ")
        ),
    ))
}

/// The ids the filter cannot rule out ("maybe"), or None when there is no filter to ask.
fn suspects<'a>(inbox: &Inbox, ids: &'a [String]) -> Option<HashSet<&'a str>> {
    let filter = trusted_filter(inbox)?;
    let maybe = filter.maybe(ids);
    let suspects: HashSet<&str> = ids.iter().zip(maybe).filter(|(_, m)| *m).map(|(id, _)| id.as_str()).collect();
    inbox.count(Counter::Lookups, ids.len() as u64);
    inbox.count(Counter::CertainlyNew, (ids.len() - suspects.len()) as u64);
    Some(suspects)
}

/// When a mark made now expires: `ttl` (already validated) or the inbox's default (validated when created).
fn window_end(inbox: &Inbox, ttl: Option<Interval>) -> TimestampWithTimeZone {
    expiry(statement_now(), ttl.unwrap_or(inbox.default_ttl))
}

/// Marks `ids` in `inbox` for `ttl` (None: the inbox's default), asking the filter first, and keeps the inbox's
/// counters. Returns the ids that were new.
pub fn mark(inbox: &Inbox, ids: &[String], ttl: Option<Interval>) -> HashSet<String> {
    let suspects = suspects(inbox, ids);
    let out = claim(inbox, ids, suspects.as_ref(), window_end(inbox, ttl));
    inbox.count(Counter::Marks, out.fresh.len() as u64);
    inbox.count(Counter::Duplicates, (ids.len() - out.fresh.len()) as u64);
    inbox.count(Counter::Renewals, out.renewals);
    inbox.count(Counter::FalsePositives, out.false_positives);
    out.fresh
}

/// What a claim found.
#[derive(Default)]
struct Outcome {
    /// Ids that were new: inserted, or renewed after expiring.
    fresh: HashSet<String>,
    renewals: u64,
    /// Ids the filter could not rule out that turned out to be new (it said "maybe", the index said no).
    false_positives: u64,
}

/// Claims `ids` for the window ending at `expires_at`. `suspects` is what the filter said: None when no filter
/// answered, else the ids it could not call "certainly new". Suspects are probed before any insert is tried, so a
/// duplicate costs one index lookup. When a filter answered, what is left is most likely all new and goes straight
/// into heap and indexes; whatever that cannot settle takes the ordinary rounds, whose conflict check is the
/// truth either way.
fn claim(
    inbox: &Inbox,
    ids: &[String],
    suspects: Option<&HashSet<&str>>,
    expires_at: TimestampWithTimeZone,
) -> Outcome {
    let now = statement_now();
    let mut pending: Vec<String> = ids.to_vec();
    pending.sort_unstable();
    pending.dedup();
    let mut out = Outcome::default();
    if let Some(suspects) = suspects {
        let probe_first: Vec<String> = pending.iter().filter(|id| suspects.contains(id.as_str())).cloned().collect();
        if !probe_first.is_empty() {
            let before = pending.len();
            settle(inbox, &probe_first, now, expires_at, &mut pending, &mut out);
            let duplicates = before - pending.len() - out.renewals as usize;
            out.false_positives = (probe_first.len() - duplicates) as u64;
        }
        if !pending.is_empty() {
            let inserted = direct_insert::insert(inbox, &pending, expires_at);
            if inserted.len() == pending.len() {
                pending.clear();
            } else {
                pending.retain(|id| inserted.binary_search(id).is_err());
            }
            out.fresh.extend(inserted);
        }
    }
    for _ in 0..MAX_ROUNDS {
        if pending.is_empty() {
            return out;
        }
        out.fresh.extend(insert(inbox, &pending, expires_at));
        pending.retain(|id| !out.fresh.contains(id));
        if pending.is_empty() {
            return out;
        }
        let conflicted = pending.clone();
        settle(inbox, &conflicted, now, expires_at, &mut pending, &mut out);
    }
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!("could not claim {} id(s) in inbox \"{}\" after {MAX_ROUNDS} rounds", pending.len(), inbox.name),
        "Another session kept deleting and re-creating the same ids; retry the transaction.",
    )
}

/// Looks up `ids` (rows visible now): live ones are duplicates and leave `pending`; expired ones are renewed in
/// place and become fresh. What is left in `pending` had no row (or lost a renewal race) and goes to the insert.
fn settle(
    inbox: &Inbox,
    ids: &[String],
    now: TimestampWithTimeZone,
    expires_at: TimestampWithTimeZone,
    pending: &mut Vec<String>,
    out: &mut Outcome,
) {
    let (live, expired) = probe(inbox, ids, now);
    pending.retain(|id| !live.contains(id));
    if !expired.is_empty() {
        let renewed = returned_ids(inbox, Stmt::Renew, &[expired.into(), expires_at.into(), now.into()]);
        pending.retain(|id| !renewed.contains(id));
        out.renewals += renewed.len() as u64;
        out.fresh.extend(renewed);
    }
}

fn insert(inbox: &Inbox, ids: &[String], expires_at: TimestampWithTimeZone) -> HashSet<String> {
    if let [id] = ids {
        // The common case (one new id per transaction) gets the plain single-row INSERT plan.
        let inserted = Spi::connect(|client| {
            !inbox.run(client, Stmt::Insert, &[id.as_str().into(), expires_at.into()]).is_empty()
        });
        return if inserted { HashSet::from_iter([id.clone()]) } else { HashSet::default() };
    }
    returned_ids(inbox, Stmt::InsertMany, &[ids.to_vec().into(), expires_at.into()])
}

/// Splits the rows visible now into live ids and (sorted) expired ids.
fn probe(inbox: &Inbox, ids: &[String], now: TimestampWithTimeZone) -> (HashSet<String>, Vec<String>) {
    let (mut live, mut expired) = (HashSet::default(), Vec::new());
    Spi::connect(|client| {
        let rows = match ids {
            [id] => inbox.run(client, Stmt::ProbeOne, &[id.as_str().into()]),
            _ => inbox.run(client, Stmt::Probe, &[ids.to_vec().into()]),
        };
        for row in rows {
            let id: String = row.get(1).ok().flatten().expect("id is NOT NULL");
            let expires: TimestampWithTimeZone = row.get(2).ok().flatten().expect("expires_at is NOT NULL");
            if expires > now {
                live.insert(id);
            } else {
                expired.push(id);
            }
        }
    });
    expired.sort_unstable();
    (live, expired)
}

fn returned_ids(inbox: &Inbox, stmt: Stmt, args: &[pgrx::datum::DatumWithOid<'_>]) -> HashSet<String> {
    Spi::connect(|client| inbox.run(client, stmt, args).filter_map(|row| row.get::<String>(1).ok().flatten()).collect())
}

/// Is there a live mark for `id` visible to this transaction? The filter answers "certainly not" when it can.
pub fn seen(inbox: &Inbox, id: &str) -> bool {
    let Some(filter) = trusted_filter(inbox) else { return live_row(inbox, id) };
    inbox.count(Counter::Lookups, 1);
    if !filter.may_contain(id) {
        inbox.count(Counter::CertainlyNew, 1);
        return false;
    }
    let seen = live_row(inbox, id);
    if !seen {
        inbox.count(Counter::FalsePositives, 1);
    }
    seen
}

/// Does the index hold a live mark for `id`, visible to this transaction?
fn live_row(inbox: &Inbox, id: &str) -> bool {
    Spi::connect(|client| !inbox.run(client, Stmt::Seen, &[id.into(), statement_now().into()]).is_empty())
}

/// Deletes the row for `id`, live or expired; true if a live mark was removed.
pub fn forget(inbox: &Inbox, id: &str) -> bool {
    Spi::connect(|client| {
        inbox
            .run(client, Stmt::Forget, &[id.into(), statement_now().into()])
            .any(|row| row.get::<bool>(1).ok().flatten() == Some(true))
    })
}
