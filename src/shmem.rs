//! pg_dedup's one region of shared memory (preloaded only): the Bloom filter's generations and state, per-inbox
//! state and counters, and the per-database worker slots. Requested at postmaster start, zeroed whenever Postgres
//! creates it (start, and re-initialisation after a crash), so nothing in it survives a restart.

use crate::guc;
use crate::ports;
use pg_dedup_bloom::WORDS_PER_BLOCK;
use pgrx::prelude::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// Inboxes (across all databases) whose state and counters the region can hold at once.
pub const MAX_INBOXES: usize = 4096;
/// Databases the background workers can serve at once.
pub const MAX_DATABASES: usize = 64;
const MAGIC: u64 = 0x7067_5f64_6564_7570; // "pg_dedup"
/// The key of an entry that was freed: searches go on past it, and a new inbox may take it.
const TOMBSTONE: u64 = u64::MAX;

/// Every per-inbox counter, in one list: its variant, its column in `dedup.stats`, and what it counts. Everything
/// else is derived from it: the enum, the counters `dedup.inbox_figures()` returns by name, and the `#[pg_test]`
/// (stats.rs) that each is a column of `dedup.stats` and documented in docs/reference.md. Adding one: a line here, a
/// column of the view (sql/finalize.sql, and the upgrade script), a row in the reference (docs/architecture.md).
macro_rules! counters {
    ($($(#[doc = $doc:literal])+ $name:ident => $column:literal,)*) => {
        /// Per-inbox counters shown in `dedup.stats`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[doc = $doc])+ $name,)*
        }

        /// How many counters each inbox has.
        pub const COUNTERS: usize = [$(Counter::$name),*].len();

        impl Counter {
            /// Every counter, in the list's order.
            pub const ALL: [Counter; COUNTERS] = [$(Counter::$name),*];

            /// Its column in `dedup.stats`.
            pub fn column(self) -> &'static str {
                match self {
                    $(Counter::$name => $column,)*
                }
            }
        }
    };
}

counters! {
    /// Ids that were new: inserted, or renewed after expiring (mark(), mark_many(), rows of attached tables).
    Marks => "marks",
    /// Ids that were duplicates (repeats inside one mark_many() array included).
    Duplicates => "duplicates",
    /// Expired rows renewed in place (by a mark or a claim).
    Renewals => "renewals",
    /// Ids the filter was asked about.
    Lookups => "lookups",
    /// Of the lookups, those the filter ruled out.
    CertainlyNew => "certainly_new",
    /// Ids the filter could not rule out that turned out to be new (it said "maybe", the index said no).
    FalsePositives => "false_positives",
    /// Expired rows deleted by the workers and by purge().
    Purged => "purged",
    /// claim() answered 'new'.
    ClaimsNew => "claims_new",
    /// claim() answered 'completed' (a replay).
    ClaimsCompleted => "claims_completed",
    /// claim() answered 'in_progress'.
    ClaimsInProgress => "claims_in_progress",
    /// claim() refused with PD001: a key reused with another fingerprint.
    FingerprintMismatches => "fingerprint_mismatches",
    /// Keys claim() took over from a lease that passed.
    LeaseTakeovers => "lease_takeovers",
    /// advance() moved a position forward.
    Advances => "advances",
    /// advance() refused a stale or repeated position.
    StaleAdvances => "stale_advances",
    /// Rows of attached tables let through (their key was new).
    RowsPassed => "rows_passed",
    /// Rows of attached tables dropped or refused as duplicates.
    RowsDropped => "rows_dropped",
}

#[repr(C)]
pub struct Entry {
    /// `namespace()` of the inbox (database and table); 0 for a slot never used, TOMBSTONE for one freed.
    key: AtomicU64,
    /// For each filter generation, the generation epoch in which this inbox's rows were loaded into it.
    pub loaded: [AtomicU64; 2],
    counters: [AtomicU64; COUNTERS],
    /// Expired marks left after the worker's last cycle (it stopped at its per-cycle cap), -1 when unknown.
    pub backlog: AtomicI64,
}

impl Entry {
    /// Does this entry (still) belong to inbox `ns`? An entry is freed when its table goes, and may then be taken
    /// by another inbox.
    pub fn holds(&self, ns: u64) -> bool {
        self.key.load(Ordering::Acquire) == ns
    }

    pub fn add(&self, counter: Counter, n: u64) {
        self.counters[counter as usize].fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self, counter: Counter) -> u64 {
        self.counters[counter as usize].load(Ordering::Relaxed)
    }
}

/// What the worker of one database is doing.
#[repr(C)]
pub struct WorkerSlot {
    db: AtomicU32,
    pub pid: AtomicI32,
    /// Twice the cycles finished, plus one while the worker writes a finished cycle's figures (a sequence lock:
    /// readers retry while it is odd or changed under them).
    cycle_seq: AtomicU64,
    last_cycle_start: AtomicI64,
    last_cycle_micros: AtomicI64,
    last_cycle_rows: AtomicI64,
}

/// A finished purge cycle, as `dedup.worker_stats()` shows it.
pub struct Cycle {
    /// Cycles finished so far (this one included).
    pub count: u64,
    /// When it started (a TimestampTz), how long it took, and the rows it purged.
    pub start: i64,
    pub micros: i64,
    pub rows: i64,
}

impl WorkerSlot {
    /// Publishes a finished cycle; only the slot's worker writes. Readers see its figures together (a benchmark
    /// reading the count of one cycle with the duration of the one before timed the wrong cycle).
    pub fn record_cycle(&self, start: i64, micros: i64, rows: i64) {
        self.cycle_seq.fetch_add(1, Ordering::AcqRel);
        self.last_cycle_start.store(start, Ordering::Relaxed);
        self.last_cycle_micros.store(micros, Ordering::Relaxed);
        self.last_cycle_rows.store(rows, Ordering::Relaxed);
        self.cycle_seq.fetch_add(1, Ordering::Release);
    }

    /// The last finished cycle, its figures consistent with each other.
    pub fn last_cycle(&self) -> Cycle {
        loop {
            let before = self.cycle_seq.load(Ordering::Acquire);
            let cycle = Cycle {
                count: before / 2,
                start: self.last_cycle_start.load(Ordering::Relaxed),
                micros: self.last_cycle_micros.load(Ordering::Relaxed),
                rows: self.last_cycle_rows.load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if before.is_multiple_of(2) && self.cycle_seq.load(Ordering::Relaxed) == before {
                return cycle;
            }
            std::hint::spin_loop();
        }
    }
}

#[repr(C)]
pub struct Header {
    magic: u64,
    /// Filter words per generation.
    pub words: u64,
    /// The filter generation lookups read (0 or 1).
    pub active: AtomicU32,
    /// Changes whenever a generation is cleared, so stale `loaded` marks stop counting.
    pub epoch: [AtomicU64; 2],
    pub next_epoch: AtomicU64,
    /// pid of the process rebuilding the filter, 0 when none; rebuilds take turns.
    pub rebuilder: AtomicU32,
    pub rebuilds: AtomicU64,
    pub last_rebuild: AtomicI64,
    /// No rotation before this time (microseconds since the Postgres epoch): rotations that could not bring the
    /// rate down (marks kept pouring in, or too many live marks) back off instead of repeating every second.
    pub next_rotation_at: AtomicI64,
    /// Seconds to wait after the next rotation if it, too, ends above target.
    pub rotation_backoff: AtomicU64,
    /// Taken to claim or free entries (lookups take nothing): a spin lock, held only for a scan of the entries.
    entries_lock: AtomicBool,
    entries: [Entry; MAX_INBOXES],
    workers: [WorkerSlot; MAX_DATABASES],
}

thread_local! {
    /// The region, once attached (set in the postmaster's startup hook, inherited by every process it forks).
    static REGION: Cell<*const Header> = const { Cell::new(std::ptr::null()) };
    /// Its size, computed from the settings while preloading.
    static SIZE: Cell<usize> = const { Cell::new(0) };
    /// The hooks that were installed before ours, called first.
    static PREV_STARTUP: Cell<pg_sys::shmem_startup_hook_type> = const { Cell::new(None) };
}
#[cfg(not(any(feature = "pg13", feature = "pg14")))]
thread_local! {
    static PREV_REQUEST: Cell<pg_sys::shmem_request_hook_type> = const { Cell::new(None) };
}

/// Bytes of the region for the configured filter capacity and rate.
fn region_size() -> usize {
    let blocks = pg_dedup_bloom::blocks_for(guc::BLOOM_CAPACITY.get() as u64, guc::BLOOM_FPR.get());
    std::mem::size_of::<Header>() + 2 * blocks as usize * WORDS_PER_BLOCK * 4
}

pub fn size() -> usize {
    SIZE.get()
}

/// Called from `_PG_init` while preloading: asks for the memory and hooks its initialisation.
pub fn init_preloaded() {
    SIZE.set(region_size());
    // SAFETY: the postmaster loads preloaded libraries one at a time, before any hook can run; we chain to the
    // hooks installed before ours.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14"))]
        pg_sys::RequestAddinShmemSpace(SIZE.get());
        #[cfg(not(any(feature = "pg13", feature = "pg14")))]
        {
            PREV_REQUEST.set(pg_sys::shmem_request_hook);
            pg_sys::shmem_request_hook = Some(request_shmem);
        }
        PREV_STARTUP.set(pg_sys::shmem_startup_hook);
        pg_sys::shmem_startup_hook = Some(startup_shmem);
    }
}

/// The postmaster's `shmem_request_hook` (PostgreSQL 15 on): asks for the region's size.
///
/// # Safety
/// Called by Postgres only, once, while the postmaster sizes shared memory.
#[cfg(not(any(feature = "pg13", feature = "pg14")))]
#[pg_guard]
unsafe extern "C-unwind" fn request_shmem() {
    if let Some(prev) = PREV_REQUEST.get() {
        // SAFETY: the hook that was installed before ours, called as Postgres would have.
        unsafe { prev() };
    }
    // SAFETY: called by the postmaster in its shmem_request phase, where requests are allowed.
    unsafe { pg_sys::RequestAddinShmemSpace(SIZE.get()) };
}

/// The `shmem_startup_hook`: creates (or, in a process started with EXEC_BACKEND, finds) the region.
///
/// # Safety
/// Called by Postgres only, once shared memory exists.
#[pg_guard]
unsafe extern "C-unwind" fn startup_shmem() {
    if let Some(prev) = PREV_STARTUP.get() {
        // SAFETY: as in request_shmem.
        unsafe { prev() };
    }
    let size = SIZE.get();
    // SAFETY: called once shared memory exists; the region is initialised under AddinShmemInitLock, as the
    // documentation of ShmemInitStruct asks.
    unsafe {
        let init_lock = ports::AddinShmemInitLock();
        pg_sys::LWLockAcquire(init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let memory = pg_sys::ShmemInitStruct(c"pg_dedup".as_ptr(), size, &mut found);
        if !found {
            // New memory (postmaster start, or re-initialisation after a crash): all zero means no filter
            // generation is trusted for any inbox, and no worker is running.
            std::ptr::write_bytes(memory as *mut u8, 0, size);
            let header = memory as *mut Header;
            (*header).magic = MAGIC;
            (*header).words = ((size - std::mem::size_of::<Header>()) / 8) as u64;
            (*header).next_epoch = AtomicU64::new(3);
            (*header).epoch = [AtomicU64::new(1), AtomicU64::new(2)];
        }
        REGION.set(memory as *const Header);
        pg_sys::LWLockRelease(init_lock);
    }
}

/// The region, or None when pg_dedup was not preloaded.
pub fn region() -> Option<&'static Header> {
    // SAFETY: set in the postmaster's startup hook before any backend forks, and never freed while we run.
    unsafe { REGION.get().as_ref() }.filter(|h| h.magic == MAGIC)
}

impl Header {
    /// The words of filter generation `gen`.
    pub fn filter_words(&'static self, gen: usize) -> &'static [AtomicU32] {
        let words = self.words as usize;
        // SAFETY: the words follow the header inside the region sized by `region_size`.
        unsafe {
            let base = (self as *const Header).add(1) as *const AtomicU32;
            std::slice::from_raw_parts(base.add(gen * words), words)
        }
    }

    /// The slots an inbox's entry may occupy, in search order (open addressing with linear probing).
    fn probe(&'static self, ns: u64) -> impl Iterator<Item = &'static Entry> {
        let start = (pg_dedup_bloom::hash_key(0, &ns.to_le_bytes()) as usize) % MAX_INBOXES;
        (0..MAX_INBOXES).map(move |i| &self.entries[(start + i) % MAX_INBOXES])
    }

    /// The entry of inbox `ns`, claimed when `create` and a slot is free (None when all are taken). A search ends
    /// at a slot never used; freed slots are passed over, and reused by claims.
    pub fn entry(&'static self, ns: u64, create: bool) -> Option<&'static Entry> {
        for e in self.probe(ns) {
            match e.key.load(Ordering::Acquire) {
                key if key == ns => return Some(e),
                0 => break,
                _ => {}
            }
        }
        if !create {
            return None;
        }
        let _locked = self.lock_entries();
        let mut free = None;
        for e in self.probe(ns) {
            match e.key.load(Ordering::Acquire) {
                key if key == ns => return Some(e), // claimed meanwhile
                0 => {
                    free = free.or(Some(e));
                    break;
                }
                TOMBSTONE => free = free.or(Some(e)),
                _ => {}
            }
        }
        let e = free?;
        // A fresh start: trusted in no generation, nothing counted; published only then.
        e.loaded.iter().for_each(|l| l.store(0, Ordering::Relaxed));
        e.counters.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        e.backlog.store(-1, Ordering::Relaxed);
        e.key.store(ns, Ordering::Release);
        Some(e)
    }

    /// Frees the entries of the inboxes `gone` says no longer exist; returns how many.
    pub fn free_entries(&'static self, gone: impl Fn(u64) -> bool) -> usize {
        let _locked = self.lock_entries();
        let mut freed = 0;
        for e in &self.entries {
            let key = e.key.load(Ordering::Acquire);
            if key != 0 && key != TOMBSTONE && gone(key) {
                e.key.store(TOMBSTONE, Ordering::Release);
                freed += 1;
            }
        }
        freed
    }

    fn lock_entries(&'static self) -> EntriesLocked {
        while self.entries_lock.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
        EntriesLocked(&self.entries_lock)
    }

    /// The slot of database `db`'s worker, claimed when `create` and free slots remain.
    pub fn worker_slot(&'static self, db: pg_sys::Oid, create: bool) -> Option<&'static WorkerSlot> {
        let db = db.to_u32();
        self.workers.iter().find(|w| w.db.load(Ordering::Acquire) == db).or_else(|| {
            create
                .then(|| {
                    self.workers
                        .iter()
                        .find(|w| w.db.compare_exchange(0, db, Ordering::AcqRel, Ordering::Acquire).is_ok())
                })
                .flatten()
        })
    }
}

/// Holds `Header::entries_lock` until dropped.
struct EntriesLocked(&'static AtomicBool);

impl Drop for EntriesLocked {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The database an inbox key (`namespace()`) belongs to.
pub fn database_of(ns: u64) -> pg_sys::Oid {
    pg_sys::Oid::from((ns >> 32) as u32)
}

/// The table an inbox key (`namespace()`) stands for, in its database.
pub fn relation_of(ns: u64) -> pg_sys::Oid {
    pg_sys::Oid::from(ns as u32)
}

/// The key namespace of an inbox table of the current database: its database and table, so equal ids in two
/// inboxes are two keys and a re-created inbox (a new table) starts clean.
pub fn namespace(relid: pg_sys::Oid) -> u64 {
    // SAFETY: reads a backend global, set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    (u64::from(db.to_u32()) << 32) | u64::from(relid.to_u32())
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::*;

    /// An inbox key no real table has: relation oid 4294967290 of this database.
    fn made_up(n: u32) -> u64 {
        namespace(pg_sys::Oid::from(4_294_967_290 - n))
    }

    #[pg_test]
    fn shmem_entries_are_claimed_found_and_freed() {
        let h = region().expect("preloaded");
        let ns = made_up(0);
        assert!(h.entry(ns, false).is_none());
        let e = h.entry(ns, true).expect("a free slot");
        assert!(e.holds(ns));
        e.add(Counter::Marks, 5);
        assert_eq!(h.entry(ns, false).unwrap().get(Counter::Marks), 5);
        assert_eq!(h.free_entries(|key| key == ns), 1);
        assert!(!e.holds(ns), "a freed entry no longer belongs to the inbox");
        assert!(h.entry(ns, false).is_none());
        let again = h.entry(ns, true).unwrap();
        assert_eq!(again.get(Counter::Marks), 0, "a claimed slot starts from zero");
        assert_eq!(again.backlog.load(Ordering::Relaxed), -1);
        h.free_entries(|key| key == ns);
    }

    #[pg_test]
    fn shmem_a_search_goes_on_past_freed_slots() {
        let h = region().unwrap();
        let keys: Vec<u64> = (1..40).map(made_up).collect();
        for &k in &keys {
            h.entry(k, true).unwrap();
        }
        // Free every other one; the rest must still be found whatever slots their searches pass.
        h.free_entries(|key| keys.iter().step_by(2).any(|k| *k == key));
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(h.entry(k, false).is_some(), i % 2 == 1, "key {i}");
        }
        h.free_entries(|key| keys.contains(&key));
    }

    #[pg_test]
    fn shmem_keys_name_their_database_and_table() {
        let relid = pg_sys::Oid::from(12345);
        let ns = namespace(relid);
        assert_eq!(relation_of(ns), relid);
        // SAFETY: reads a backend global, set once connected.
        assert_eq!(database_of(ns), unsafe { pg_sys::MyDatabaseId });
    }
}
