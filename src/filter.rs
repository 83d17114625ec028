//! The shared-memory Bloom filter in front of the inbox indexes. It may only ever say "certainly new" or "maybe";
//! the UNIQUE index stays the truth.
//!
//! Design (see README, "The Bloom filter"):
//! - Two generations of split-block filter, each sized for `dedup.bloom_capacity` live marks at
//!   `dedup.bloom_false_positive_rate`. Lookups read the *active* generation only.
//! - Every key that may reach an inbox table goes into **both** generations *before* its row is written: a row
//!   trigger on every inbox table (BEFORE INSERT OR UPDATE, `ENABLE ALWAYS`, so it also fires for COPY, restores and
//!   logical replication) adds `NEW.id`, and the direct insert (direct_insert.rs), which bypasses triggers, does the
//!   same itself. Rollbacks, `forget()`, TRUNCATE and expiry only leave extra bits: false
//!   positives, never false negatives.
//! - An inbox is *trusted* in a generation only once its rows were loaded into it (a rebuild scanned the table, or
//!   the inbox was created empty in this server's lifetime). After a restart or crash the memory is new and nothing
//!   is trusted: every call goes to the index until the background worker (or `dedup.bloom_rebuild()`) has loaded
//!   the inbox. A hot standby never trusts the filter (its rows arrive by WAL replay, past the trigger).
//! - Expiry: marks expire but bits cannot be removed. When the active generation's measured false-positive rate
//!   drifts above target, a rotation clears the other generation, waits for every transaction holding a
//!   transaction id (`add` takes one before setting bits, so these are all that may have set bits in the
//!   cleared memory), reloads every inbox through a snapshot taken after that wait, and makes it active. Inboxes
//!   the rotation did not load (other databases) fall back to the index until loaded.

use crate::guc;
use crate::shmem::{namespace, region, Header};
use pg_dedup_bloom::Filter;
use pgrx::prelude::*;
use std::cell::Cell;
use std::sync::atomic::Ordering;

fn generation(h: &'static Header, gen: usize) -> Filter<'static> {
    Filter::new(h.filter_words(gen))
}

pub fn is_preloaded() -> bool {
    region().is_some()
}

/// Adds keys to both generations. Called for every row written to an inbox table, before it is written (by the
/// filter trigger, and by the direct insert, which bypasses triggers).
pub fn add<S: AsRef<str>>(ns: u64, ids: &[S]) {
    if let Some(h) = region() {
        // The rows are about to be written, which takes a transaction id anyway; taking it before the bits are set
        // is what lets a rotation find, and wait for, every transaction whose bits it may clear.
        unsafe { pg_sys::GetCurrentTransactionId() };
        let (first, second) = (generation(h, 0), generation(h, 1));
        pg_dedup_bloom::for_each_prefetched(&[&first, &second], &hashes(ns, ids), |_, hash| {
            first.insert(hash);
            second.insert(hash);
        });
    }
}

fn hashes<S: AsRef<str>>(ns: u64, ids: &[S]) -> Vec<u64> {
    ids.iter().map(|id| pg_dedup_bloom::hash_key(ns, id.as_ref().as_bytes())).collect()
}

/// A filter that can answer for one inbox right now, or None (not preloaded, switched off, standby, not loaded).
pub struct Trusted {
    header: &'static Header,
    gen: usize,
    epoch: u64,
    ns: u64,
}

impl Trusted {
    pub fn for_inbox(ns: u64) -> Option<Trusted> {
        let header = region()?;
        if !guc::BLOOM.get() || unsafe { pg_sys::RecoveryInProgress() } {
            return None;
        }
        let gen = header.active.load(Ordering::Acquire) as usize;
        let epoch = header.epoch[gen].load(Ordering::Acquire);
        let e = header.entry(ns, false)?;
        (e.loaded[gen].load(Ordering::Acquire) == epoch).then_some(Trusted { header, gen, epoch, ns })
    }

    /// False: certainly never marked. True: maybe.
    pub fn may_contain(&self, id: &str) -> bool {
        generation(self.header, self.gen).may_contain(pg_dedup_bloom::hash_key(self.ns, id.as_bytes()))
            || self.cleared_meanwhile()
    }

    /// `may_contain` of each id, the lookups' cache misses overlapped.
    pub fn maybe<S: AsRef<str>>(&self, ids: &[S]) -> Vec<bool> {
        let filter = generation(self.header, self.gen);
        let mut maybe = vec![false; ids.len()];
        pg_dedup_bloom::for_each_prefetched(&[&filter], &hashes(self.ns, ids), |i, hash| {
            maybe[i] = filter.may_contain(hash);
        });
        if maybe.contains(&false) && self.cleared_meanwhile() {
            maybe.fill(true);
        }
        maybe
    }

    /// Was this generation cleared since we trusted it? Then its "no" answers count for nothing. (A rotation
    /// bumps the epoch before it clears, and the fences order that bump before any cleared word we may have read.)
    fn cleared_meanwhile(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.header.epoch[self.gen].load(Ordering::Acquire) != self.epoch
    }
}

/// A brand-new, empty inbox table is complete in the active generation: every row it will ever get passes the
/// trigger first. Skipped while a rebuild runs (the worker then loads the inbox, which is quick: it is empty).
pub fn trust_new_inbox(ns: u64) {
    if let Some(guard) = try_begin_rebuild() {
        let gen = guard.0.active.load(Ordering::Acquire) as usize;
        guard.loaded(gen, ns);
    }
}

/// Inboxes of the current database that the active generation does not cover yet.
pub fn untrusted(inboxes: &[pg_sys::Oid]) -> Vec<pg_sys::Oid> {
    let Some(h) = region() else { return Vec::new() };
    let gen = h.active.load(Ordering::Acquire) as usize;
    let epoch = h.epoch[gen].load(Ordering::Acquire);
    inboxes
        .iter()
        .copied()
        .filter(|relid| {
            h.entry(namespace(*relid), false).is_none_or(|e| e.loaded[gen].load(Ordering::Acquire) != epoch)
        })
        .collect()
}

/// Exclusive right to rebuild, released on drop (also when an ERROR unwinds through the rebuild).
pub struct RebuildGuard(&'static Header);

impl Drop for RebuildGuard {
    fn drop(&mut self) {
        self.0.rebuilder.store(0, Ordering::Release);
    }
}

pub fn try_begin_rebuild() -> Option<RebuildGuard> {
    let h = region()?;
    let me = unsafe { pg_sys::MyProcPid } as u32;
    release_at_exit_once();
    h.rebuilder.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire).ok().map(|_| RebuildGuard(h))
}

/// A process that dies without unwinding (FATAL, e.g. pg_terminate_backend during a rebuild) must not keep the
/// rebuild right forever.
fn release_at_exit_once() {
    thread_local! {
        static REGISTERED: Cell<bool> = const { Cell::new(false) };
    }
    if !REGISTERED.replace(true) {
        // SAFETY: registers a guarded callback once per process.
        unsafe { pg_sys::before_shmem_exit(Some(release_rebuild_right), pg_sys::Datum::from(0)) };
    }
}

/// # Safety
/// Called by Postgres only, at process exit.
#[pg_guard]
unsafe extern "C-unwind" fn release_rebuild_right(_code: i32, _arg: pg_sys::Datum) {
    if let Some(h) = region() {
        // SAFETY: reads a process global.
        let me = unsafe { pg_sys::MyProcPid } as u32;
        let _ = h.rebuilder.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

impl RebuildGuard {
    /// The generation a rebuild loads into: the active one (catching up inboxes not loaded yet), or, when
    /// `rotate`, the other one, cleared first.
    pub fn target(&self, rotate: bool) -> usize {
        let h = self.0;
        let active = h.active.load(Ordering::Acquire) as usize;
        if !rotate {
            return active;
        }
        let target = 1 - active;
        h.epoch[target].store(h.next_epoch.fetch_add(1, Ordering::AcqRel), Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        generation(h, target).clear();
        // Keys set in the cleared memory before or while it was cleared belong to transactions that took their
        // transaction id before setting them (the trigger sees to that). Wait for every transaction with an id
        // running now; the reload's snapshot, taken afterwards, then sees their rows.
        wait_for_writing_transactions();
        target
    }

    pub fn load(&self, target: usize, ns: u64, id: &str) {
        generation(self.0, target).insert(pg_dedup_bloom::hash_key(ns, id.as_bytes()));
    }

    pub fn loaded(&self, target: usize, ns: u64) {
        if let Some(e) = self.0.entry(ns, true) {
            e.loaded[target].store(self.0.epoch[target].load(Ordering::Acquire), Ordering::Release);
        }
    }

    pub fn finish(self, target: usize) {
        let h = self.0;
        h.active.store(target as u32, Ordering::Release);
        h.rebuilds.fetch_add(1, Ordering::Relaxed);
        h.last_rebuild.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
    }
}

/// Waits for every transaction that has a transaction id now. A snapshot lists running ids below its xmax only, so
/// the ids handed out since (up to the next one to be assigned) are checked one by one.
fn wait_for_writing_transactions() {
    unsafe {
        let snapshot = pg_sys::GetLatestSnapshot();
        let mut running: Vec<pg_sys::TransactionId> =
            std::slice::from_raw_parts((*snapshot).xip, (*snapshot).xcnt as usize).to_vec();
        let next = pg_sys::TransactionId::from(pg_sys::ReadNextFullTransactionId().value as u32);
        let mut xid = (*snapshot).xmax;
        while xid != next {
            if xid.into_inner() >= pg_sys::FirstNormalTransactionId.into_inner()
                && pg_sys::TransactionIdIsInProgress(xid)
            {
                running.push(xid);
            }
            xid = pg_sys::TransactionId::from(xid.into_inner().wrapping_add(1));
        }
        let own = pg_sys::GetTopTransactionIdIfAny();
        for xid in running.into_iter().filter(|xid| *xid != own) {
            pg_sys::XactLockTableWait(xid, std::ptr::null_mut(), std::ptr::null_mut(), pg_sys::XLTW_Oper::XLTW_None);
        }
    }
}

/// Filter-wide figures for `dedup.stats`.
pub struct Summary {
    pub state: &'static str,
    pub memory_bytes: i64,
    pub capacity: i64,
    pub target_fpr: f64,
    pub fill_ratio: Option<f64>,
    pub estimated_fpr: Option<f64>,
    pub rebuilds: i64,
}

/// The active generation's measured false-positive rate (from a sample of blocks).
pub fn active_fpr() -> Option<f64> {
    let h = region()?;
    Some(generation(h, h.active.load(Ordering::Acquire) as usize).fill_and_fpr(4096).1)
}

pub fn summary() -> Summary {
    let target_fpr = guc::BLOOM_FPR.get();
    let Some(h) = region() else {
        return Summary {
            state: "off: pg_dedup is not in shared_preload_libraries",
            memory_bytes: 0,
            capacity: 0,
            target_fpr,
            fill_ratio: None,
            estimated_fpr: None,
            rebuilds: 0,
        };
    };
    let (fill, fpr) = generation(h, h.active.load(Ordering::Acquire) as usize).fill_and_fpr(16_384);
    let state = if h.rebuilder.load(Ordering::Acquire) != 0 {
        "rebuilding"
    } else if !guc::BLOOM.get() {
        "off: dedup.bloom = off"
    } else if unsafe { pg_sys::RecoveryInProgress() } {
        "off: hot standby"
    } else {
        "ready"
    };
    Summary {
        state,
        memory_bytes: crate::shmem::size() as i64,
        capacity: guc::BLOOM_CAPACITY.get() as i64,
        target_fpr,
        fill_ratio: Some(fill),
        estimated_fpr: Some(fpr),
        rebuilds: h.rebuilds.load(Ordering::Relaxed) as i64,
    }
}

/// Row trigger on every inbox table (BEFORE INSERT OR UPDATE, ENABLE ALWAYS): puts `NEW.id` into the filter before
/// the row is written, whoever writes it (mark(), INSERT, COPY, a restore, logical replication).
#[pg_trigger]
fn inbox_filter_trigger<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::heap_tuple::PgHeapTupleError> {
    let new = trigger.new();
    if is_preloaded() {
        if let Some(tuple) = &new {
            let id_column = std::num::NonZeroUsize::new(1).expect("1 is not zero");
            if let (Ok(Some(id)), Ok(relid)) = (tuple.get_by_index::<&str>(id_column), trigger.relid()) {
                add(namespace(relid), &[id]);
            }
        }
    }
    Ok(new)
}
