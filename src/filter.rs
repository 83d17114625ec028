//! The shared-memory Bloom filter in front of the inbox indexes. It may only ever say "certainly new" or "maybe";
//! the UNIQUE index stays the truth.
//!
//! Design (see README, "The Bloom filter"):
//! - Two generations of split-block filter, each sized for `dedup.bloom_capacity` live marks at
//!   `dedup.bloom_false_positive_rate`. Lookups read the *active* generation only.
//! - Every key written to an inbox table goes into **both** generations *right after* its row is written, before
//!   the writing statement ends: the `dedup_filter` trigger (trigger.rs: AFTER INSERT OR UPDATE OF id, `ENABLE
//!   ALWAYS`, so it also fires for COPY, restores and logical replication) adds `NEW.id`, and the direct insert
//!   (direct/insert.rs), which bypasses triggers, does the same itself. Rollbacks, `forget()`, TRUNCATE and expiry
//!   only leave extra bits: false positives, never false negatives.
//! - An inbox is *trusted* in a generation only once its rows were loaded into it (a rebuild scanned the table, or
//!   the inbox was created empty in this server's lifetime), and only while its trigger guards it (trigger.rs stops
//!   trusting it the moment DDL changes that). After a restart or crash the memory is new and nothing is trusted:
//!   every call goes to the index until the background worker (or `dedup.bloom_rebuild()`) has loaded the inbox. A
//!   hot standby never trusts the filter (its rows arrive by WAL replay, past the trigger).
//! - Loads read every row version physically in the table: committed ones, those still in progress (prepared
//!   transactions included, which a restart does not end), and those deleted or updated since the load's snapshot
//!   (an UPDATE that does not fire the trigger may move a row behind the scan), whatever the caller's snapshot;
//!   all but the versions no snapshot may see any more, which VACUUM could remove (rebuild.rs, `Version::Dead`).
//! - `dedup.attempt_counts` is guarded the same way, its rows keyed by inbox and id (`attempt_key`): an attempt at
//!   an id the filter says the table certainly lacks does not read the table.
//! - Expiry: marks expire but bits cannot be removed. When the active generation's measured false-positive rate
//!   drifts above target, a rotation clears the other generation, reloads every inbox of the database into it, and
//!   makes it active. It waits for nobody: a row written before the clear is in the table when the load reads it,
//!   and a row written after the clear sets its bits after it. Inboxes the rotation did not load (other databases,
//!   tables busy with DDL) fall back to the index until loaded.

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

/// Adds keys to both generations. Called for every row written to an inbox table, right after it is written (by
/// the filter trigger, and by the direct insert, which bypasses triggers).
pub fn add<S: AsRef<str>>(ns: u64, ids: &[S]) {
    insert(hashes(ns, ids.iter().map(|id| id.as_ref().as_bytes())))
}

/// Starts loading the blocks `add` will set for `id`, in both generations, without waiting for them. For a key the
/// filter just called new, which is written next: its bits go in after its row (a heap insert and the index
/// insertions in between), and a filter sized for millions of keys is far bigger than the CPU cache, so each block
/// is a cache miss (and a TLB miss) that would otherwise stall `add`.
pub fn prefetch(ns: u64, id: &str) {
    if let Some(h) = region() {
        let hash = pg_dedup_bloom::hash_key(ns, id.as_bytes());
        generation(h, 0).prefetch(hash);
        generation(h, 1).prefetch(hash);
    }
}

/// `add` of keys as bytes (those of `dedup.attempt_counts` are not ids alone: `attempt_key`).
pub fn add_keys<K: AsRef<[u8]>>(ns: u64, keys: &[K]) {
    insert(hashes(ns, keys.iter().map(|key| key.as_ref())))
}

fn insert(hashes: Vec<u64>) {
    if let Some(h) = region() {
        let (first, second) = (generation(h, 0), generation(h, 1));
        pg_dedup_bloom::for_each_prefetched(&[&first, &second], &hashes, |_, hash| {
            first.insert(hash);
            second.insert(hash);
        });
    }
}

fn hashes<'k>(ns: u64, keys: impl Iterator<Item = &'k [u8]>) -> Vec<u64> {
    keys.map(|key| pg_dedup_bloom::hash_key(ns, key)).collect()
}

/// The key a row of `dedup.attempt_counts` has in the filter (under that table's namespace): its inbox's name and
/// its id, apart by a NUL, which no text holds.
pub fn attempt_key(inbox: &[u8], id: &[u8]) -> Vec<u8> {
    [inbox, &[0], id].concat()
}

/// A filter that can answer for one inbox right now, or None (not preloaded, switched off, standby, not loaded).
pub struct Trusted {
    header: &'static Header,
    gen: usize,
    epoch: u64,
    ns: u64,
}

impl Trusted {
    /// The filter of the table of key `ns` (an inbox table, or `dedup.attempt_counts`), if it can answer now.
    pub fn for_inbox(ns: u64) -> Option<Trusted> {
        let header = region()?;
        // SAFETY: asks shared memory whether the server is in recovery; callable in any backend.
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
        self.may_contain_key(id.as_bytes())
    }

    /// `may_contain` of a key as bytes (`attempt_key`).
    pub fn may_contain_key(&self, key: &[u8]) -> bool {
        generation(self.header, self.gen).may_contain(pg_dedup_bloom::hash_key(self.ns, key))
            || self.cleared_meanwhile()
    }

    /// `may_contain` of each id, the lookups' cache misses overlapped.
    pub fn maybe<S: AsRef<str>>(&self, ids: &[S]) -> Vec<bool> {
        let filter = generation(self.header, self.gen);
        let mut maybe = vec![false; ids.len()];
        let hashes = hashes(self.ns, ids.iter().map(|id| id.as_ref().as_bytes()));
        pg_dedup_bloom::for_each_prefetched(&[&filter], &hashes, |i, hash| {
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

/// Stops trusting inbox `ns` in every generation (its trigger stopped guarding it); true if it was trusted in one.
/// It is trusted again only once a load has read it with the trigger guarding.
pub fn untrust(ns: u64) -> bool {
    let Some(e) = region().and_then(|h| h.entry(ns, false)) else { return false };
    let mut was = false;
    for loaded in &e.loaded {
        was |= loaded.swap(0, Ordering::AcqRel) != 0;
    }
    was
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
    // SAFETY: reads a process global, set at process start.
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
        target
    }

    /// Puts the keys of rows read by a load into generation `target`.
    pub fn load(&self, target: usize, hashes: &[u64]) {
        let filter = generation(self.0, target);
        pg_dedup_bloom::for_each_prefetched(&[&filter], hashes, |_, hash| filter.insert(hash));
    }

    pub fn loaded(&self, target: usize, ns: u64) {
        if let Some(e) = self.0.entry(ns, true) {
            e.loaded[target].store(self.0.epoch[target].load(Ordering::Acquire), Ordering::Release);
        }
    }

    /// Makes `target` the generation lookups read. A rotation, or a load that loaded something, counts as a
    /// rebuild in `dedup.stats` (a catch-up round that found nothing it could load does not).
    pub fn finish(self, target: usize, counts: bool) {
        let h = self.0;
        h.active.store(target as u32, Ordering::Release);
        if counts {
            h.rebuilds.fetch_add(1, Ordering::Relaxed);
            // SAFETY: reads the clock.
            h.last_rebuild.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
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
    // SAFETY: as in `Trusted::for_inbox`.
    let in_recovery = unsafe { pg_sys::RecoveryInProgress() };
    let state = if h.rebuilder.load(Ordering::Acquire) != 0 {
        "rebuilding"
    } else if !guc::BLOOM.get() {
        "off: dedup.bloom = off"
    } else if in_recovery {
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

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::*;
    use crate::testing::*;

    fn ns_of(inbox: &str) -> u64 {
        namespace(one::<pg_sys::Oid>(&format!("SELECT 'dedup.inbox_{inbox}'::regclass::oid")))
    }

    #[pg_test]
    fn filter_a_new_inbox_is_trusted_at_once_and_answers_certainly_new() {
        run("SELECT dedup.create_inbox('fl_new')");
        let filter = Trusted::for_inbox(ns_of("fl_new")).expect("a new, empty inbox is trusted");
        assert!(!filter.may_contain("never-marked"));
        run("SELECT dedup.mark('marked', NULL, 'fl_new')");
        assert!(filter.may_contain("marked"), "a mark's bits are set before its statement ends");
    }

    #[pg_test]
    fn filter_keys_are_namespaced_by_inbox() {
        run("SELECT dedup.create_inbox('fl_a'); SELECT dedup.create_inbox('fl_b'); SELECT dedup.mark('k', NULL, 'fl_a')");
        let a = Trusted::for_inbox(ns_of("fl_a")).unwrap();
        let b = Trusted::for_inbox(ns_of("fl_b")).unwrap();
        assert!(a.may_contain("k"));
        assert!(!b.may_contain("k"), "the same id in another inbox is another key");
    }

    #[pg_test]
    fn filter_maybe_answers_for_many_ids_at_once() {
        run("SELECT dedup.create_inbox('fl_many')");
        let marked: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
        add(ns_of("fl_many"), &marked);
        let filter = Trusted::for_inbox(ns_of("fl_many")).unwrap();
        assert!(filter.maybe(&marked).iter().all(|m| *m), "no false negative");
        let unknown: Vec<String> = (0..200).map(|i| format!("u{i}")).collect();
        let false_positives = filter.maybe(&unknown).iter().filter(|m| **m).count();
        assert!(false_positives < 20, "an almost empty filter says maybe rarely: {false_positives}/200");
    }

    #[pg_test]
    fn filter_untrust_stops_every_generation_answering() {
        run("SELECT dedup.create_inbox('fl_untrust')");
        let ns = ns_of("fl_untrust");
        assert!(untrust(ns), "it was trusted");
        assert!(Trusted::for_inbox(ns).is_none());
        assert!(!untrust(ns), "nothing left to untrust");
    }

    #[pg_test]
    fn filter_a_cleared_generation_answers_maybe_for_everything() {
        run("SELECT dedup.create_inbox('fl_epoch')");
        let filter = Trusted::for_inbox(ns_of("fl_epoch")).unwrap();
        assert!(!filter.may_contain("x"));
        // A rotation clears the other generation and bumps its epoch; make the active one look cleared.
        let h = region().unwrap();
        let gen = h.active.load(Ordering::Acquire) as usize;
        let epoch = h.epoch[gen].load(Ordering::Acquire);
        h.epoch[gen].store(epoch + 1000, Ordering::SeqCst);
        assert!(filter.may_contain("x"), "a lookup made before the clear cannot say certainly new");
        assert!(filter.maybe(&["x", "y"]).iter().all(|m| *m));
        h.epoch[gen].store(epoch, Ordering::SeqCst);
    }

    #[pg_test]
    fn filter_summary_reports_its_state() {
        let s = summary();
        assert_eq!(s.state, "ready");
        assert!(s.fill_ratio.is_some_and(|f| (0.0..=1.0).contains(&f)));
        assert!(active_fpr().is_some());
    }
}
