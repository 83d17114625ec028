//! Loading inbox tables into the shared filter: after a restart (nothing is trusted until loaded), for inboxes
//! created by a restore, and when a rotation makes a fresh generation to shed expired marks.

use crate::errors::{internal, raise, server_log};
use crate::filter::{self, RebuildGuard};
use crate::inbox::{self, Access, Stmt};
use crate::{guc, shmem};
use pgrx::prelude::*;
use std::sync::atomic::Ordering;

/// Rows fetched per round trip of the scan cursor: bounded memory whatever the inbox size.
const FETCH: i64 = 10_000;
/// Rotate the filter when its measured rate exceeds the target by this factor.
const ROTATE_AT: f64 = 1.1;
/// Seconds between rotations that end above target, doubling from the first to the second.
const MIN_BACKOFF: u64 = 1;
const MAX_BACKOFF: u64 = 600;

/// What a rebuild did.
pub struct Rebuilt {
    pub inboxes: usize,
    pub keys: i64,
}

/// Loads this database's inboxes into the filter: all of them into a fresh generation when `rotate`, otherwise only
/// those the active generation does not cover yet. None when another process is rebuilding right now.
pub fn run(rotate: bool) -> Option<Rebuilt> {
    let guard = filter::try_begin_rebuild()?;
    let target = guard.target(rotate);
    // Everything from here reads through a snapshot taken now, after the wait in `target`: the caller's snapshot
    // (taken before it) would miss rows committed meanwhile.
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let inboxes: Vec<(String, pg_sys::Oid)> =
        inbox::all_names().into_iter().filter_map(|name| inbox::relid(&name).map(|relid| (name, relid))).collect();
    let relids: Vec<pg_sys::Oid> = inboxes.iter().map(|(_, relid)| *relid).collect();
    let wanted = if rotate { relids } else { filter::untrusted(&relids) };
    let mut done = Rebuilt { inboxes: 0, keys: 0 };
    for (name, relid) in inboxes.iter().filter(|(_, relid)| wanted.contains(relid)) {
        done.keys += load_inbox(&guard, target, name, *relid);
        done.inboxes += 1;
    }
    unsafe { pg_sys::PopActiveSnapshot() };
    guard.finish(target);
    Some(done)
}

/// Loads every row of one inbox (expired ones too: they cost bits, not correctness). The inbox is trusted only if
/// its filter trigger is in place and enabled: a restore creates the trigger after copying the rows, and rows
/// copied before it existed are only covered once a load runs after it.
fn load_inbox(guard: &RebuildGuard, target: usize, name: &str, relid: pg_sys::Oid) -> i64 {
    let inbox = inbox::open(name, Access::Read);
    let ns = inbox.ns;
    let guarded = Spi::get_one_with_args::<bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid OPERATOR(pg_catalog.=) $1 \
         AND tgname OPERATOR(pg_catalog.=) 'dedup_filter' AND tgenabled OPERATOR(pg_catalog.=) 'A')",
        &[relid.into()],
    )
    .ok()
    .flatten()
    .unwrap_or(false);
    let keys = inbox::as_owner(relid, || {
        Spi::connect(|client| {
            let plan = inbox.plan(client, Stmt::ScanIds);
            let mut cursor = client.try_open_cursor(plan, &[]).unwrap_or_else(|e| internal("scanning an inbox", e));
            let mut keys = 0;
            loop {
                let rows = cursor.fetch(FETCH).unwrap_or_else(|e| internal("scanning an inbox", e));
                if rows.is_empty() {
                    return keys;
                }
                for row in rows {
                    if let Ok(Some(id)) = row.get::<&str>(1) {
                        guard.load(target, ns, id);
                        keys += 1;
                    }
                }
                // Each fetch's rows live until the SPI connection ends unless freed: free them batch by batch.
                unsafe { pg_sys::SPI_freetuptable(pg_sys::SPI_tuptable) };
            }
        })
    });
    if guarded {
        guard.loaded(target, ns);
    }
    keys
}

/// `dedup.bloom_rebuild()`: rotate now (fresh generation, reloaded from this database's inboxes).
#[pg_extern(volatile, parallel_unsafe)]
fn bloom_rebuild() -> i64 {
    if !filter::is_preloaded() {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "the Bloom filter is off: pg_dedup is not in shared_preload_libraries",
            "Add pg_dedup to shared_preload_libraries and restart; until then every call uses the index.",
        )
    }
    if unsafe { pg_sys::RecoveryInProgress() } {
        raise(
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            "the Bloom filter cannot be rebuilt on a hot standby",
            "A standby always uses the index; the filter is rebuilt after promotion.",
        )
    }
    match run(true) {
        Some(done) => done.keys,
        None => raise(
            PgSqlErrorCode::ERRCODE_OBJECT_IN_USE,
            "another process is rebuilding the Bloom filter",
            "Wait for it to finish (dedup.stats shows filter_state 'rebuilding'), then retry.",
        ),
    }
}

/// Loads inboxes the active filter generation does not cover; rotates when expired marks have pushed the measured
/// false-positive rate above target.
pub fn look_after_filter() {
    // No inbox locks here: a rotation waits for running transactions, and holding a lock a DDL statement waits
    // for, while that statement blocks a transaction we wait for, would deadlock.
    let relids: Vec<pg_sys::Oid> = inbox::all_names().iter().filter_map(|name| inbox::relid(name)).collect();
    if !filter::untrusted(&relids).is_empty() {
        if let Some(done) = run(false) {
            server_log!(
                "pg_dedup worker: loaded {} marks of {} inbox(es) into the Bloom filter",
                done.keys,
                done.inboxes
            );
        }
        return;
    }
    let target = guc::BLOOM_FPR.get();
    let (Some(region), Some(measured)) = (shmem::region(), filter::active_fpr()) else { return };
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    if measured <= ROTATE_AT * target || now < region.next_rotation_at.load(Ordering::Relaxed) {
        return;
    }
    let Some(done) = run(true) else { return };
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
