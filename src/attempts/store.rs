//! The counts of delivery attempts in shared memory, before and after the worker makes them durable: a fixed number of
//! slots (`dedup.attempts_max` for ids of at most `SHORT_ID` bytes, a 64th of that, at least 16, for longer ones),
//! found through an open-addressing index, all behind one lock (`lock.rs`) that is held only for a probe and a few
//! stores (no I/O and no call into PostgreSQL while it is held). The index's cells carry part of their slot's hash, so
//! a probe reads only the slot that matches. The worker's passes (copying the dirty counts, sweeping lapsed ones) take
//! the lock for about `PASS_CHUNK` slots at a time (the copy: as many slots read, or words of dirty bits), so attempts
//! wait for a chunk, never for a whole pass; only building the index again (when three quarters of its cells are taken)
//! holds it longer.
//!
//! A slot is *dirty* while it holds what the worker has not written: its count differs from `flushed`, which an
//! attempt or a forget sets to `u32::MAX` (each changes the durable row: its count, or at least its last attempt
//! and window) and the worker to the count it wrote, once the slot still holds all it wrote. Only a clean slot may
//! be taken for another id, so no count waits for the worker in a slot that could be lost to someone else. Every
//! eviction bumps `evictions`: a caller that read an id's durable count before taking the lock knows, by it, whether
//! that count may have gone stale meanwhile (the id's slot flushed and evicted in between).
//!
//! Every slot that turns dirty has its bit set in `dirty` (a bit per slot), so the worker's copy reads the bits and
//! the slots they point to, not every slot: at a million slots a pass over all of them reads a head in each of
//! ~240 MB and took the callers' lock a thousand times a round, which cost `attempt()` at 8 clients about a tenth of
//! its rate (bench/results/profiles/issue-24.md). A bit may outlive its slot's dirtiness (the slot written, or
//! freed): the copy clears it when it finds the slot clean or free.
//!
//! The worker's passes run only when they may find something: the copy of dirty counts when some count of its
//! database changed since a round that left none of its database dirty (`changes`, counted per bucket of databases:
//! a busy database does not have every other database's worker copy in every round), the sweep once the earliest
//! expiry of a clean slot may have come (`next_lapse`). An idle store costs the worker two takings of the lock per
//! round, not a read of every slot (1,000,000 slots, about 240 MB, took ~13 ms per pass). Dirty slots, which no
//! sweep frees, do not hold the bound back (a lapsed one the worker cannot write, of a database it no longer serves,
//! would otherwise have every round sweep the whole store): a slot that turns clean lowers it. A slot may turn clean
//! during a sweep in a chunk the sweep has passed, unseen: each sweep under way keeps the earliest expiry of a slot
//! that turned clean since it began (`changed_low`), and the bound it leaves is that and what its pass saw. (Keeping
//! the old bound whenever anything changed would, under a steady stream of attempts, never let it rise once a sweep
//! had run: every round would sweep the whole store.)
//!
//! The memory is zeroed when PostgreSQL creates it (start, and re-initialisation after a crash): all zero is an
//! empty store. Everything after a crash starts again from what the worker had written.

use super::lock::Lock;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Ids up to this many bytes take a short slot; longer ones (up to 2048, the limit of an id) a long one.
pub const SHORT_ID: usize = 128;
const LONG_ID: usize = crate::input::MAX_ID_BYTES;
/// An index cell that no slot ever used.
const EMPTY: u64 = 0;
/// An index cell whose slot was freed: a probe goes on past it, an insert may take it.
const FREED: u64 = u64::MAX;
/// Slots the worker's passes look at per taking of the lock.
const PASS_CHUNK: usize = 1024;

/// The index cell of slot `n` whose id hashes to `hash`: the slot's number plus one in the low half (never 0, and
/// never all ones, since there are fewer than 2^32 - 1 slots), the hash's high half above it.
fn cell_of(n: usize, hash: u64) -> u64 {
    (hash & !0xffff_ffff) | (n as u64 + 1)
}

/// The slot a used index cell points to.
fn slot_of(cell: u64) -> usize {
    (cell & 0xffff_ffff) as usize - 1
}

/// What a slot holds, beside its id's bytes.
#[repr(C)]
struct Head {
    used: bool,
    /// The inbox's key (database and table, `shmem::namespace`).
    ns: u64,
    hash: u64,
    count: u32,
    /// What the worker last wrote of `count` (a slot is clean when they are equal); `u32::MAX` when the slot holds
    /// something it has not written (see the module comment).
    flushed: u32,
    first: i64,
    last: i64,
    /// When the count lapses: the inbox's default TTL after the last attempt.
    expires: i64,
    /// The durable table may hold a row of this id. False when it held none when the slot was taken and the worker
    /// has not written one since: the worker then inserts it without looking first (a row written by hand meanwhile
    /// makes that insert fail, and the worker writes it the other way).
    stored: bool,
    id_len: u32,
}

impl Head {
    /// Does the durable table hold all this slot holds (see `flushed`)?
    fn clean(&self) -> bool {
        self.count == self.flushed
    }
}

/// One id's count as the store holds it, copied out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Count {
    pub ns: u64,
    pub id: String,
    pub count: u32,
    pub first: i64,
    pub last: i64,
    pub expires: i64,
    /// As `Head::stored`.
    pub stored: bool,
}

/// An id's row in the durable table (what `bump` starts from when the store has no slot for the id); a row whose
/// count lapsed is one of count 0.
#[derive(Clone, Copy)]
pub struct Durable {
    pub count: u32,
    pub first: i64,
}

/// The store has no clean slot left for another id: counts wait for the worker in all of them.
#[derive(Debug)]
pub struct Full;

/// The store's first bytes: its lock and the atomic count of evictions, which any process reads or writes at any
/// time; the sizes, fixed when the memory is created; and the rest, which only the lock's holder reads or writes,
/// in a cell of its own (so that the holder's `&mut` of it never covers what others touch without the lock).
#[repr(C)]
struct StoreHeader {
    lock: Lock,
    evictions: AtomicU64,
    short: u32,
    long: u32,
    index_len: u32,
    guarded: UnsafeCell<Guarded>,
}

/// What the store's lock guards in its header.
#[repr(C)]
struct Guarded {
    /// Index cells that are not EMPTY (used or FREED): past three quarters, the index is built again.
    filled: u32,
    /// Where the next search for a slot to take starts, among the short slots and among the long ones (a clock).
    hands: [u32; 2],
    /// Changes of a count (attempts and forgets) so far, in the databases of each bucket (`bucket`): a worker's pass
    /// for dirty counts finds none while its database's bucket holds what it did before a round of that worker's
    /// that left none of its database dirty.
    changes: [u64; CHANGE_BUCKETS],
    /// No clean slot expires before this (it may be lower than the earliest such expiry, never higher): a sweep
    /// before it would free nothing. Zero, when the memory is created: the first sweep runs.
    next_lapse: i64,
    /// The entries of `changed_low` in use, a bit each: one per sweep under way (every database's worker sweeps
    /// the one store), given back however the sweep ends (`SweepEntry`).
    sweeping: u8,
    /// For each sweep under way, the earliest expiry of a slot that turned clean since it began: what its pass may
    /// not have seen.
    changed_low: [i64; SWEEPS],
}

/// Buckets of `Guarded::changes`. Databases whose oids agree modulo this share one, and so each other's copies (a read
/// of the dirty bits and of the slots they point to, perhaps for nothing of its own); a cluster has rarely more than a
/// few databases with workers.
const CHANGE_BUCKETS: usize = 64;

/// The bucket of `Guarded::changes` that counts the changes of database `db`.
fn bucket(db: pgrx::pg_sys::Oid) -> usize {
    db.to_u32() as usize % CHANGE_BUCKETS
}

/// Sweeps that may be under way at once, each with what changed since it began; one more leaves the bound no later
/// than it stands at its end.
const SWEEPS: usize = 8;
const _: () = assert!(SWEEPS <= u8::BITS as usize, "a bit of `sweeping` per entry");

/// A sweep's entry of `changed_low`, if it got one: given back at the sweep's end, or when a panic unwinds through
/// it (a lost entry would be one fewer for every later sweep, until the memory is created again).
struct SweepEntry<'a> {
    store: &'a Store,
    index: Option<usize>,
}

impl SweepEntry<'_> {
    /// Gives the entry back under `locked`, with the earliest expiry of a slot that turned clean since the sweep
    /// began; None without an entry.
    fn give_back(&mut self, locked: &Locked) -> Option<i64> {
        let i = self.index.take()?;
        let h = self.store.guarded(locked);
        h.sweeping &= !(1 << i);
        Some(h.changed_low[i])
    }
}

impl Drop for SweepEntry<'_> {
    fn drop(&mut self) {
        if self.index.is_some() {
            // Unwinding: the pass's lock was given back before this.
            let locked = self.store.lock();
            self.give_back(&locked);
        }
    }
}

/// The store in shared memory.
pub struct Store {
    base: *mut u8,
}

// SAFETY: the store's memory is shared by every process of the server; within a process it is only reached through
// `&Store` and the lock (Postgres backends run one thread).
unsafe impl Sync for Store {}

fn stride(id_bytes: usize) -> usize {
    (std::mem::size_of::<Head>() + id_bytes).next_multiple_of(8)
}

/// The slots for `max` short ids and their index, and the long ones.
fn shape(max: usize) -> (usize, usize, usize) {
    let long = (max / 64).max(16);
    let index_len = ((max + long) * 2).next_power_of_two();
    (max, long, index_len)
}

/// Words of the dirty bits of `slots` slots.
fn dirty_words(slots: usize) -> usize {
    slots.div_ceil(64)
}

/// Where the index, the dirty bits and the slots start in a store of `slots` slots and `index_len` index cells: they
/// follow the header in that order, 8-aligned.
fn offsets(index_len: usize, slots: usize) -> (usize, usize, usize) {
    let index = std::mem::size_of::<StoreHeader>().next_multiple_of(8);
    let bits = index + index_len * 8;
    (index, bits, bits + dirty_words(slots) * 8)
}

/// Bytes of a store of `max` short slots (and its long ones).
pub fn size(max: usize) -> usize {
    let (short, long, index_len) = shape(max);
    offsets(index_len, short + long).2 + short * stride(SHORT_ID) + long * stride(LONG_ID)
}

/// One more attempt than `count`, up to the largest an `integer` holds (where a count stays: it never wraps).
fn bump(count: u32) -> u32 {
    count.saturating_add(1).min(i32::MAX as u32)
}

/// The id's hash in the index (never 0, so a zeroed slot is never mistaken for one).
fn hash(ns: u64, id: &[u8]) -> u64 {
    pg_dedup_bloom::hash_key(ns, id) | 1
}

/// Holds the store's lock until dropped.
struct Locked<'a>(&'a Store);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.0.header().lock.release();
    }
}

impl Store {
    /// The store at `base`, `bytes` long, laid out for `max` short slots when its memory is still zero.
    ///
    /// # Safety
    /// `base` must point to `bytes` (at least `size(max)`) bytes of shared memory, 8-aligned, zeroed when created and
    /// used only through stores made with the same `max`, for the life of the server.
    pub unsafe fn at(base: *mut u8, max: usize) -> Store {
        let store = Store { base };
        let header = base as *mut StoreHeader;
        // SAFETY: the caller vouches for the memory; the sizes are written before any process uses the store (the
        // postmaster makes it, under AddinShmemInitLock), and are the same for every process.
        unsafe {
            if (*header).index_len == 0 {
                let (short, long, index_len) = shape(max);
                (*header).short = short as u32;
                (*header).long = long as u32;
                (*header).index_len = index_len as u32;
            }
        }
        store
    }

    fn header(&self) -> &StoreHeader {
        // SAFETY: the store starts with its header (`at`).
        unsafe { &*(self.base as *const StoreHeader) }
    }

    fn lock(&self) -> Locked<'_> {
        self.header().lock.acquire();
        Locked(self)
    }

    // The lock (held, as the `Locked` passed in proves) makes the access exclusive; each caller keeps the
    // reference only while it works on that part of the store, never two of the same part at once.
    #[allow(clippy::mut_from_ref)]
    fn index(&self, _: &Locked) -> &mut [u64] {
        let len = self.header().index_len as usize;
        let (at, _, _) = offsets(len, self.slots());
        // SAFETY: the index lies inside the store (`size`), 8-aligned; the lock is held, so no one else reads or
        // writes it.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(at) as *mut u64, len) }
    }

    fn slots(&self) -> usize {
        (self.header().short + self.header().long) as usize
    }

    /// A bit per slot, set when the slot turns dirty (see the module comment).
    // The lock (held, as the `Locked` passed in proves) makes the access exclusive; each caller keeps the
    // reference only while it works on that part of the store, never two of the same part at once.
    #[allow(clippy::mut_from_ref)]
    fn dirty(&self, _: &Locked) -> &mut [u64] {
        let (_, at, _) = offsets(self.header().index_len as usize, self.slots());
        // SAFETY: the bits lie inside the store (`size`), 8-aligned; the lock is held.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(at) as *mut u64, dirty_words(self.slots())) }
    }

    /// Slot `n`'s head and id bytes (short slots first, then long ones).
    // The lock (held, as the `Locked` passed in proves) makes the access exclusive; each caller keeps the
    // reference only while it works on that part of the store, never two of the same part at once.
    #[allow(clippy::mut_from_ref)]
    fn slot(&self, _: &Locked, n: usize) -> (&mut Head, &mut [u8]) {
        let h = self.header();
        let short = h.short as usize;
        let (offset, capacity) = {
            let (_, _, start) = offsets(h.index_len as usize, self.slots());
            if n < short {
                (start + n * stride(SHORT_ID), SHORT_ID)
            } else {
                (start + short * stride(SHORT_ID) + (n - short) * stride(LONG_ID), LONG_ID)
            }
        };
        // SAFETY: slot `n` lies inside the store (`size`); the lock is held.
        unsafe {
            let head = &mut *(self.base.add(offset) as *mut Head);
            let id = std::slice::from_raw_parts_mut(self.base.add(offset + std::mem::size_of::<Head>()), capacity);
            (head, id)
        }
    }

    fn matches(&self, locked: &Locked, n: usize, ns: u64, hash: u64, id: &[u8]) -> bool {
        let (head, bytes) = self.slot(locked, n);
        head.used && head.ns == ns && head.hash == hash && &bytes[..head.id_len as usize] == id
    }

    /// The index cell and slot of `id`, if it has one.
    fn find(&self, locked: &Locked, ns: u64, hash: u64, id: &[u8]) -> Option<(usize, usize)> {
        let len = self.header().index_len as usize;
        let index = self.index(locked);
        let start = hash as usize & (len - 1);
        let tag = hash & !0xffff_ffff;
        for probe in 0..len {
            let cell = (start + probe) & (len - 1);
            match index[cell] {
                EMPTY => return None,
                FREED => {}
                c if c & !0xffff_ffff == tag && self.matches(locked, slot_of(c), ns, hash, id) => {
                    return Some((cell, slot_of(c)))
                }
                _ => {}
            }
        }
        None
    }

    /// Frees used slot `n` for another id, and counts the eviction (see the module comment).
    fn evict(&self, locked: &Locked, n: usize) {
        let (head, bytes) = self.slot(locked, n);
        let (ns, hash, id) = (head.ns, head.hash, bytes[..head.id_len as usize].to_vec());
        let (cell, _) = self.find(locked, ns, hash, &id).expect("a used slot is in the index");
        self.index(locked)[cell] = FREED;
        self.slot(locked, n).0.used = false;
        self.header().evictions.fetch_add(1, Ordering::AcqRel);
    }

    /// Counts one more attempt of `id` if the store holds its count, and returns the new count. An expired count
    /// starts again at 1.
    pub fn bump_held(&self, ns: u64, id: &str, now: i64, expires: i64) -> Option<u32> {
        let locked = self.lock();
        let (_, n) = self.find(&locked, ns, hash(ns, id.as_bytes()), id.as_bytes())?;
        Some(self.bump_slot(&locked, n, now, expires))
    }

    /// Counts one more attempt in used slot `n`, and returns the new count (see `bump_held`).
    fn bump_slot(&self, locked: &Locked, n: usize, now: i64, expires: i64) -> u32 {
        let (head, _) = self.slot(locked, n);
        if head.expires <= now {
            head.count = 0;
            head.first = now;
        }
        head.count = bump(head.count);
        head.last = now;
        head.expires = expires;
        let count = head.count;
        // Dirty even when the count equals what the worker wrote (one that started again and climbed back to it, or
        // one at the top): the row's last attempt and window changed.
        self.changed(locked, n);
        count
    }

    /// Slot `n`'s count changed under `locked`: the slot is dirty, its bit set for the worker's copy, and the change
    /// counted for its database (`changes`). (Its expiry does not concern the sweeps until the slot turns clean:
    /// `cleaned`.)
    fn changed(&self, locked: &Locked, n: usize) {
        let (head, _) = self.slot(locked, n);
        head.flushed = u32::MAX;
        let db = crate::shmem::database_of(head.ns);
        self.dirty(locked)[n / 64] |= 1 << (n % 64);
        self.guarded(locked).changes[bucket(db)] += 1;
    }

    /// A slot turned clean under `locked`, expiring at `expires`: a sweep may free it from then on (see `next_lapse`
    /// and `changed_low`).
    fn cleaned(&self, locked: &Locked, expires: i64) {
        let h = self.guarded(locked);
        h.next_lapse = h.next_lapse.min(expires);
        for (i, low) in h.changed_low.iter_mut().enumerate() {
            if h.sweeping & (1 << i) != 0 {
                *low = (*low).min(expires);
            }
        }
    }

    /// How many times a count of database `db` (or of a database in its bucket) changed so far (`Guarded::changes`).
    pub fn changes(&self, db: pgrx::pg_sys::Oid) -> u64 {
        self.guarded(&self.lock()).changes[bucket(db)]
    }

    /// How many slots were freed for other ids so far: read before the durable count, compared by `bump_new`.
    pub fn evictions(&self) -> u64 {
        self.header().evictions.load(Ordering::Acquire)
    }

    /// Counts one more attempt of `id`: in its slot if the store holds one, else starting from `durable` (its row in
    /// the durable table, None if it has none, read after `evictions()` returned `seen`) in a slot taken for it.
    /// Ok(None) when that reading may be stale (a slot was freed since: read again); Err(Full) when there is no slot
    /// to take.
    pub fn bump_new(
        &self,
        ns: u64,
        id: &str,
        now: i64,
        expires: i64,
        durable: Option<Durable>,
        seen: u64,
    ) -> Result<Option<u32>, Full> {
        let bytes = id.as_bytes();
        let hash = hash(ns, bytes);
        let locked = self.lock();
        if let Some((_, n)) = self.find(&locked, ns, hash, bytes) {
            // Made meanwhile, or before a caller that did not look (the durable table lacks the id: a count not
            // written yet, or a forget's): its count is the one that counts.
            return Ok(Some(self.bump_slot(&locked, n, now, expires)));
        }
        if self.evictions() != seen {
            return Ok(None);
        }
        let n = self.take_slot(&locked, bytes.len()).ok_or(Full)?;
        let (head, slot_id) = self.slot(&locked, n);
        let stored = durable.is_some();
        let durable = durable.unwrap_or(Durable { count: 0, first: now });
        let count = bump(durable.count);
        *head = Head {
            used: true,
            ns,
            hash,
            count,
            // Dirty, also for a count at the top that stays there (its row's last attempt and window change).
            flushed: u32::MAX,
            first: durable.first,
            last: now,
            expires,
            stored,
            id_len: bytes.len() as u32,
        };
        slot_id[..bytes.len()].copy_from_slice(bytes);
        self.link(&locked, hash, n);
        self.changed(&locked, n);
        Ok(Some(count))
    }

    /// Puts slot `n` into the index; builds the index again first if too few cells are EMPTY (a probe for an id
    /// the store does not hold stops only at one).
    fn link(&self, locked: &Locked, hash: u64, n: usize) {
        let len = self.header().index_len as usize;
        if self.guarded(locked).filled as usize >= len / 4 * 3 {
            self.rebuild_index(locked);
        }
        let index = self.index(locked);
        let start = hash as usize & (len - 1);
        for probe in 0..len {
            let cell = (start + probe) & (len - 1);
            if index[cell] == EMPTY || index[cell] == FREED {
                if index[cell] == EMPTY {
                    self.guarded(locked).filled += 1;
                }
                index[cell] = cell_of(n, hash);
                return;
            }
        }
        unreachable!("the index has twice as many cells as there are slots");
    }

    // The lock (held, as the `Locked` passed in proves) makes the access exclusive; each caller keeps the
    // reference only while it works on that part of the store, never two of the same part at once.
    #[allow(clippy::mut_from_ref)]
    fn guarded(&self, locked: &Locked) -> &mut Guarded {
        debug_assert!(std::ptr::eq(locked.0, self), "the lock of another store");
        // SAFETY: the lock is held: no other process or thread reads or writes these fields meanwhile.
        unsafe { &mut *self.header().guarded.get() }
    }

    /// The index anew, from the used slots.
    fn rebuild_index(&self, locked: &Locked) {
        self.index(locked).fill(EMPTY);
        self.guarded(locked).filled = 0;
        for n in 0..self.slots() {
            let (head, _) = self.slot(locked, n);
            if head.used {
                let hash = head.hash;
                let len = self.header().index_len as usize;
                let index = self.index(locked);
                let start = hash as usize & (len - 1);
                let cell = (0..len).map(|p| (start + p) & (len - 1)).find(|c| index[*c] == EMPTY).expect("room");
                index[cell] = cell_of(n, hash);
                self.guarded(locked).filled += 1;
            }
        }
    }

    /// A slot for an id of `len` bytes: a free one, else a clean one, whose id is then forgotten here (its count is
    /// in the durable table). The search goes round the slots from where the last one stopped.
    fn take_slot(&self, locked: &Locked, len: usize) -> Option<usize> {
        let short = self.header().short as usize;
        let (which, first, count) = if len <= SHORT_ID { (0, 0, short) } else { (1, short, self.slots() - short) };
        let hand = self.guarded(locked).hands[which] as usize;
        let n = (0..count).map(|i| first + (hand + i) % count).find(|&n| {
            let (head, _) = self.slot(locked, n);
            !head.used || head.clean()
        })?;
        self.guarded(locked).hands[which] = ((n - first + 1) % count) as u32;
        if self.slot(locked, n).0.used {
            self.evict(locked, n);
        }
        Some(n)
    }

    /// The counts of database `db` (its inboxes' keys are `ns`es of it, `shmem::database_of`): all of them, or only
    /// the dirty ones.
    pub fn counts(&self, db: pgrx::pg_sys::Oid, dirty_only: bool) -> Vec<Count> {
        let mut counts = Vec::new();
        let visit = |locked: &Locked, n| {
            let (head, bytes) = self.slot(locked, n);
            let wanted = head.used && crate::shmem::database_of(head.ns) == db && (!dirty_only || !head.clean());
            if wanted {
                counts.push(Count {
                    ns: head.ns,
                    id: String::from_utf8_lossy(&bytes[..head.id_len as usize]).into_owned(),
                    count: head.count,
                    first: head.first,
                    last: head.last,
                    expires: head.expires,
                    stored: head.stored,
                });
            }
        };
        if dirty_only {
            self.dirty_pass(visit);
        } else {
            self.pass(visit);
        }
        counts
    }

    /// Calls `visit` for every slot, holding the lock for `PASS_CHUNK` slots at a time. A slot may change between
    /// two chunks; what `visit` takes from one is as of its chunk, which the worker's uses allow (`written` and
    /// `sweep` look at each slot again under the lock).
    fn pass(&self, mut visit: impl FnMut(&Locked, usize)) {
        let slots = self.slots();
        for chunk in (0..slots).step_by(PASS_CHUNK) {
            let locked = self.lock();
            for n in chunk..(chunk + PASS_CHUNK).min(slots) {
                visit(&locked, n);
            }
        }
    }

    /// Calls `visit` for every used, dirty slot, found by its bit, and clears the bits of the slots it finds clean or
    /// free. The lock is held for `PASS_CHUNK` words of bits or about as many slots read (dirty or not: a round's
    /// written counts are runs of bits whose slots turned clean), whichever comes first. A slot that turns dirty
    /// during the pass in a word already passed is left for the next one (its change is counted: `changes`).
    fn dirty_pass(&self, mut visit: impl FnMut(&Locked, usize)) {
        let words = dirty_words(self.slots());
        let mut w = 0;
        while w < words {
            let locked = self.lock();
            let (mut words_read, mut slots_read) = (0, 0);
            while w < words && words_read < PASS_CHUNK && slots_read < PASS_CHUNK {
                let mut bits = self.dirty(&locked)[w];
                slots_read += bits.count_ones() as usize;
                while bits != 0 {
                    let n = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let (head, _) = self.slot(&locked, n);
                    if head.used && !head.clean() {
                        visit(&locked, n);
                    } else {
                        self.dirty(&locked)[w] &= !(1 << (n % 64));
                    }
                }
                (w, words_read) = (w + 1, words_read + 1);
            }
        }
    }

    /// The worker wrote `written`: each slot that still holds what was written is clean, and each id written with
    /// a count has its row. The lock is taken for `PASS_CHUNK` counts at a time.
    pub fn written(&self, written: &[Count]) {
        for chunk in written.chunks(PASS_CHUNK) {
            let locked = self.lock();
            for w in chunk {
                let bytes = w.id.as_bytes();
                if let Some((_, n)) = self.find(&locked, w.ns, hash(w.ns, bytes), bytes) {
                    let (head, _) = self.slot(&locked, n);
                    head.stored |= w.count > 0;
                    let same =
                        (head.count, head.first, head.last, head.expires) == (w.count, w.first, w.last, w.expires);
                    if same {
                        head.flushed = w.count;
                        let expires = head.expires;
                        self.cleaned(&locked, expires);
                    }
                }
            }
        }
    }

    /// Sets `id`'s count to zero (`forget()`, at its commit): a dirty slot the worker deletes the durable row for.
    /// Err(Full) when the id has no slot and none can be taken; the caller deletes the row itself then.
    pub fn reset(&self, ns: u64, id: &str, now: i64) -> Result<(), Full> {
        let bytes = id.as_bytes();
        let hash = hash(ns, bytes);
        let locked = self.lock();
        let n = match self.find(&locked, ns, hash, bytes) {
            Some((_, n)) => n,
            None => {
                let n = self.take_slot(&locked, bytes.len()).ok_or(Full)?;
                let (head, slot_id) = self.slot(&locked, n);
                *head = Head {
                    used: true,
                    ns,
                    hash,
                    count: 0,
                    flushed: u32::MAX,
                    first: now,
                    last: now,
                    expires: now,
                    stored: true,
                    id_len: bytes.len() as u32,
                };
                slot_id[..bytes.len()].copy_from_slice(bytes);
                self.link(&locked, hash, n);
                self.changed(&locked, n);
                return Ok(());
            }
        };
        let (head, _) = self.slot(&locked, n);
        head.count = 0;
        head.first = now;
        head.expires = now;
        // Dirty whatever the worker wrote last (a count of zero is written as a delete).
        self.changed(&locked, n);
        Ok(())
    }

    /// Frees every slot of database `db` last counted before `before`, dirty or not: the extension is gone from it,
    /// and with it the table the counts were for (a dirty slot nobody can write would otherwise be lost to every
    /// database).
    pub fn drop_database(&self, db: pgrx::pg_sys::Oid, before: i64) {
        self.pass(|locked, n| {
            let (head, _) = self.slot(locked, n);
            if head.used && crate::shmem::database_of(head.ns) == db && head.last < before {
                self.evict(locked, n);
            }
        });
    }

    /// Frees the slots that are clean and expired, of whichever database (their rows hold their counts, as when
    /// `take_slot` frees a clean slot; a database no worker serves any more would otherwise keep `next_lapse` in the
    /// past), and those whose inbox is one of `gone`. Without `gone`, only once some slot may have expired
    /// (`next_lapse`); the pass then finds the earliest expiry of a clean slot left.
    pub fn sweep(&self, now: i64, gone: &[u64]) {
        let mut entry = {
            let locked = self.lock();
            let h = self.guarded(&locked);
            if gone.is_empty() && now < h.next_lapse {
                return;
            }
            let index = (0..SWEEPS).find(|i| h.sweeping & (1 << i) == 0);
            if let Some(i) = index {
                h.sweeping |= 1 << i;
                h.changed_low[i] = i64::MAX;
            }
            SweepEntry { store: self, index }
        };
        let mut next_lapse = i64::MAX;
        self.pass(|locked, n| {
            let (head, _) = self.slot(locked, n);
            if !head.used {
                return;
            }
            let clean = head.clean();
            if (clean && head.expires <= now) || gone.contains(&head.ns) {
                self.evict(locked, n);
            } else if clean {
                next_lapse = next_lapse.min(head.expires);
            }
        });
        let locked = self.lock();
        // A slot that turned clean during the pass may sit in a chunk already passed, unseen: this sweep's
        // `changed_low` has its expiry; without an entry of its own, the bound as it stands (which `cleaned` keeps
        // sound) has it.
        let changed_low = entry.give_back(&locked).unwrap_or(self.guarded(&locked).next_lapse);
        let h = self.guarded(&locked);
        h.next_lapse = next_lapse.min(changed_low);
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::pg_sys::Oid;
    use pgrx::prelude::*;
    use std::sync::atomic::AtomicBool;

    /// The key of an inbox (table 1) of database 1, and of one of database 2.
    const NS: u64 = (1 << 32) | 1;
    const OTHER_NS: u64 = (2 << 32) | 1;

    /// A store of 16 short slots in this process's memory (zeroed, as shared memory is when created), with it.
    fn store() -> (Vec<u64>, Store) {
        let mut memory = vec![0u64; size(16) / 8 + 1];
        // SAFETY: the vector is zeroed, 8-aligned, at least `size(16)` bytes, and outlives the store (the caller
        // keeps both; moving the vector does not move its buffer).
        let store = unsafe { Store::at(memory.as_mut_ptr() as *mut u8, 16) };
        (memory, store)
    }

    fn dirty(store: &Store, db: u32) -> Vec<(String, u32)> {
        store.counts(Oid::from(db), true).into_iter().map(|c| (c.id, c.count)).collect()
    }

    fn held(store: &Store) -> usize {
        store.counts(Oid::from(1), false).len() + store.counts(Oid::from(2), false).len()
    }

    /// Sweeps under way, as `sweeping`'s bits say, each of whose entries holds `low`.
    fn under_way(store: &Store, sweeping: u8, low: i64) {
        let locked = store.lock();
        let h = store.guarded(&locked);
        h.sweeping = sweeping;
        h.changed_low = [low; SWEEPS];
    }

    fn new_count(store: &Store, ns: u64, id: &str, now: i64, expires: i64, durable: Option<Durable>) -> u32 {
        store.bump_new(ns, id, now, expires, durable, store.evictions()).unwrap().unwrap()
    }

    #[pg_test]
    fn a_count_that_starts_again_or_stays_at_the_top_is_dirty() {
        let (_memory, store) = store();
        assert_eq!(new_count(&store, NS, "y", 0, 10, None), 1);
        store.written(&store.counts(Oid::from(1), true));
        assert!(dirty(&store, 1).is_empty(), "written: clean");
        // Its window passed: counted afresh, 1 again, what the worker wrote; its row's window must still be written.
        assert_eq!(store.bump_held(NS, "y", 20, 30), Some(1));
        assert_eq!(dirty(&store, 1), [("y".to_owned(), 1)]);
        // A count at the top stays there; its row's last attempt and window must still be written.
        let top = Durable { count: i32::MAX as u32, first: 0 };
        assert_eq!(new_count(&store, NS, "top", 40, 50, Some(top)), i32::MAX as u32);
        assert!(dirty(&store, 1).iter().any(|(id, _)| id == "top"), "{:?}", dirty(&store, 1));
        // The worker's copy is clean only if the slot still holds all of it.
        let copy = store.counts(Oid::from(1), true);
        assert_eq!(store.bump_held(NS, "top", 45, 55), Some(i32::MAX as u32));
        store.written(&copy);
        assert_eq!(dirty(&store, 1), [("top".to_owned(), i32::MAX as u32)], "the window after the copy is unwritten");
    }

    #[pg_test]
    fn the_copy_finds_every_dirty_count_by_its_bit_and_clears_the_bits_of_clean_ones() {
        // More slots than a taking of the lock reads the bits of (`PASS_CHUNK` words), all written (clean), then dirty
        // again here and there in each way a count changes: the copy stops for the lock both at dirty slots read and
        // at words read.
        let max = 64 * PASS_CHUNK + 640;
        let mut memory = vec![0u64; size(max) / 8 + 1];
        // SAFETY: as in `store`.
        let store = unsafe { Store::at(memory.as_mut_ptr() as *mut u8, max) };
        for i in 0..max {
            new_count(&store, if i % 3 == 0 { OTHER_NS } else { NS }, &format!("c{i}"), 0, 100, None);
        }
        store.written(&store.counts(Oid::from(1), true));
        store.written(&store.counts(Oid::from(2), true));
        assert!(dirty(&store, 1).is_empty() && dirty(&store, 2).is_empty());
        let bits_set = || store.dirty(&store.lock()).iter().map(|w| w.count_ones()).sum::<u32>();
        assert_eq!(bits_set(), 0, "the copies cleared the bits of the slots they found written");
        for i in (0..max).step_by(7) {
            store.bump_held(if i % 3 == 0 { OTHER_NS } else { NS }, &format!("c{i}"), 1, 100).unwrap();
        }
        for i in (5..max).step_by(11) {
            store.reset(if i % 3 == 0 { OTHER_NS } else { NS }, &format!("c{i}"), 1).unwrap();
        }
        // Every slot is held and clean or dirty: a new id takes a clean one (the first from the clock's hand).
        new_count(&store, NS, "new", 1, 100, None);
        // What a look at every slot finds dirty, of inbox `ns`.
        let every_slot = |ns: u64| {
            let mut found = Vec::new();
            store.pass(|locked, n| {
                let (head, bytes) = store.slot(locked, n);
                if head.used && !head.clean() && head.ns == ns {
                    found.push((String::from_utf8_lossy(&bytes[..head.id_len as usize]).into_owned(), head.count));
                }
            });
            found.sort();
            found
        };
        let sorted = |mut counts: Vec<(String, u32)>| {
            counts.sort();
            counts
        };
        let expected = every_slot(NS);
        assert!(expected.len() > max / 10, "{} dirty", expected.len());
        assert_eq!(sorted(dirty(&store, 1)), expected);
        assert_eq!(sorted(dirty(&store, 1)), expected, "a copy leaves the bits of counts not written yet");
        // Written: the next copy finds nothing of database 1 and clears those bits; database 2's stay.
        store.written(&store.counts(Oid::from(1), true));
        assert!(dirty(&store, 1).is_empty());
        let others = every_slot(OTHER_NS);
        assert_eq!(sorted(dirty(&store, 2)), others);
        assert_eq!(bits_set() as usize, others.len());
    }

    #[pg_test]
    fn a_sweep_frees_lapsed_clean_counts_of_every_database_once_one_may_have_lapsed() {
        let (_memory, store) = store();
        new_count(&store, NS, "a", 0, 100, None);
        new_count(&store, OTHER_NS, "b", 0, 50, None);
        store.written(&store.counts(Oid::from(1), true));
        store.written(&store.counts(Oid::from(2), true));
        store.sweep(49, &[]);
        assert_eq!(held(&store), 2, "nothing lapsed yet");
        store.sweep(50, &[]);
        assert_eq!(held(&store), 1, "database 2's clean count lapsed: freed by any database's worker");
        store.sweep(100, &[]);
        assert_eq!(held(&store), 0);
        // Empty, the store's next lapse is the end of time: a count made since brings it back.
        new_count(&store, NS, "c", 100, 150, None);
        store.written(&store.counts(Oid::from(1), true));
        store.sweep(149, &[]);
        assert_eq!(held(&store), 1);
        store.sweep(150, &[]);
        assert_eq!(held(&store), 0, "the count made after the last sweep lowered the next lapse");
        // A dirty count is never swept, lapsed or not.
        new_count(&store, NS, "d", 200, 210, None);
        store.sweep(300, &[]);
        assert_eq!(dirty(&store, 1), [("d".to_owned(), 1)]);
    }

    /// Runs `sweeps` sweeps over a store of many chunks while a second thread, standing for backends and their
    /// worker, makes counts and writes them at once (clean) whenever a sweep runs. Sweep `i` runs at `now` =
    /// (i + 1) × 2^32: before it a count of the first thread's lapses at `now` - 100, so that it runs, and the search
    /// for a free slot starts again at the first one. The second thread waits for the pass's first eviction (what
    /// lapsed sits in the first chunk, which the pass holds the lock for at once), so that its counts land in a chunk
    /// the pass has left, which only the sweep's entry accounts for. They expire at `now` + 1, `now` + 2, ... in the
    /// order they are written, so that the next sweep frees them, and so that one written after the sweep's end (the
    /// last of a sweep's counts often is), which lowers the bound to its own expiry, cannot hide a bound the sweep
    /// left after an earlier one's. For each sweep: `now`, the bound it left, the earliest expiry of a clean slot
    /// then, and the counts made meanwhile (during its pass or around it: which of them landed in a chunk already
    /// passed, the test cannot tell). One sweep at a time, so each takes the first entry: the tests below are of what
    /// one sweep leaves. A harness whose counts all expired alike missed the bug below: nearly every sweep's bound
    /// was lowered again by a count written after it.
    fn sweeps_while_counts_are_made(sweeps: usize) -> Vec<(i64, i64, Option<i64>, u64)> {
        let max = 32 * PASS_CHUNK;
        let mut memory = vec![0u64; size(max) / 8 + 1];
        // SAFETY: as in `store`; both threads use the store within the scope, while `memory` lives.
        let store = unsafe { Store::at(memory.as_mut_ptr() as *mut u8, max) };
        let (sweeping, idle, stop) = (AtomicBool::new(false), AtomicBool::new(true), AtomicBool::new(false));
        let next_expiry = std::sync::atomic::AtomicI64::new(0);
        let evicted_before = AtomicU64::new(0);
        // A new count of `id`, written at once (clean). Tried again while slots are being freed, as a backend reads
        // the durable table again then.
        let attempted = |id: String, now: i64, expires: i64| {
            let count = loop {
                if let Some(count) = store.bump_new(NS, &id, now, expires, None, store.evictions()).unwrap() {
                    break count;
                }
            };
            store.written(&[Count { ns: NS, id, count, first: now, last: now, expires, stored: false }]);
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0.. {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // Busy before looking again, so that the sweeper, once it stopped sweeping, waits for this
                    // attempt to be over (both orders are SeqCst).
                    idle.store(false, Ordering::SeqCst);
                    let passing = store.evictions() > evicted_before.load(Ordering::SeqCst);
                    if !sweeping.load(Ordering::SeqCst) || !passing {
                        idle.store(true, Ordering::SeqCst);
                        std::hint::spin_loop();
                        continue;
                    }
                    let expires = next_expiry.fetch_add(1, Ordering::SeqCst);
                    attempted(format!("z{i}"), expires - 1, expires);
                }
            });
            let left = (0..sweeps)
                .map(|i| {
                    let now = (i as i64 + 1) << 32;
                    attempted(format!("a{i}"), now - 200, now - 100);
                    store.guarded(&store.lock()).hands[0] = 0;
                    next_expiry.store(now + 1, Ordering::SeqCst);
                    evicted_before.store(store.evictions(), Ordering::SeqCst);
                    let changes = store.changes(Oid::from(1));
                    sweeping.store(true, Ordering::SeqCst);
                    store.sweep(now, &[]);
                    sweeping.store(false, Ordering::SeqCst);
                    while !idle.load(Ordering::SeqCst) {
                        std::hint::spin_loop();
                    }
                    let locked = store.lock();
                    let clean = |n| Some(store.slot(&locked, n).0).filter(|h| h.used && h.clean()).map(|h| h.expires);
                    let earliest = (0..store.slots()).filter_map(clean).min();
                    (
                        now,
                        store.guarded(&locked).next_lapse,
                        earliest,
                        store.guarded(&locked).changes[bucket(Oid::from(1))] - changes,
                    )
                })
                .collect();
            stop.store(true, Ordering::SeqCst);
            left
        })
    }

    #[pg_test]
    fn a_sweep_without_an_entry_of_its_own_leaves_the_bound_no_later_than_it_was() {
        let (_memory, store) = store();
        new_count(&store, NS, "a", 0, 100, None);
        store.written(&store.counts(Oid::from(1), true));
        // Seven sweeps under way, whose entries hold an expiry long past: this one takes the eighth entry (a bound
        // taken from theirs would stay at 0), and gives it back.
        under_way(&store, 0x7f, 0);
        store.sweep(100, &[]);
        assert_eq!(held(&store), 0);
        assert_eq!(
            store.guarded(&store.lock()).next_lapse,
            i64::MAX,
            "nothing is held: the bound rises to the end of time"
        );
        assert_eq!(store.guarded(&store.lock()).sweeping, 0x7f);
        // All eight taken: nothing tells what turned clean during the pass, so the bound stays where `written` left
        // it.
        new_count(&store, NS, "b", 100, 150, None);
        store.written(&store.counts(Oid::from(1), true));
        store.guarded(&store.lock()).sweeping = 0xff;
        store.sweep(150, &[]);
        assert_eq!(held(&store), 0);
        assert_eq!(store.guarded(&store.lock()).next_lapse, 150);
    }

    #[pg_test]
    fn a_sweep_that_panics_gives_its_entry_back() {
        let (_memory, store) = store();
        new_count(&store, NS, "a", 0, 100, None);
        store.written(&store.counts(Oid::from(1), true));
        // The slot's index cell lost: freeing the slot finds none, a bug the sweep panics on.
        store.index(&store.lock()).fill(EMPTY);
        let swept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.sweep(100, &[])));
        assert!(swept.is_err(), "the sweep went through a slot missing from the index");
        assert_eq!(store.guarded(&store.lock()).sweeping, 0, "its entry is free for the next sweep");
    }

    #[pg_test]
    fn a_slot_turning_clean_lowers_the_entry_of_every_sweep_under_way() {
        let (_memory, store) = store();
        under_way(&store, 0b1001, i64::MAX);
        new_count(&store, NS, "a", 0, 40, None);
        assert_eq!(store.guarded(&store.lock()).changed_low, [i64::MAX; SWEEPS], "dirty, no sweep frees it yet");
        store.written(&store.counts(Oid::from(1), true));
        let mut expected = [i64::MAX; SWEEPS];
        (expected[0], expected[3]) = (40, 40);
        assert_eq!(store.guarded(&store.lock()).changed_low, expected);
    }

    #[pg_test]
    fn a_change_is_counted_for_its_own_database() {
        let (_memory, store) = store();
        let (one, two) = (Oid::from(1), Oid::from(2));
        new_count(&store, NS, "a", 0, 100, None);
        assert_eq!((store.changes(one), store.changes(two)), (1, 0));
        new_count(&store, OTHER_NS, "b", 0, 100, None);
        store.bump_held(OTHER_NS, "b", 1, 100).unwrap();
        store.reset(OTHER_NS, "b", 2).unwrap();
        // A forget of an id the store holds no count of takes a slot for it.
        store.reset(OTHER_NS, "c", 2).unwrap();
        assert_eq!((store.changes(one), store.changes(two)), (1, 4), "database 1's worker has nothing to copy");
        // A database whose oid shares database 1's bucket sees its changes (its worker copies and finds nothing).
        store.bump_held(NS, "a", 3, 100).unwrap();
        assert_eq!(store.changes(Oid::from(1 + CHANGE_BUCKETS as u32)), 2);
    }

    #[pg_test]
    fn a_lapsed_dirty_count_does_not_hold_the_bound_back() {
        let (_memory, store) = store();
        // Of a database no worker writes any more: dirty for good, and lapsed at 50.
        new_count(&store, OTHER_NS, "stale", 0, 50, None);
        new_count(&store, NS, "a", 0, 100, None);
        store.written(&store.counts(Oid::from(1), true));
        store.sweep(60, &[]);
        assert_eq!(held(&store), 2, "nothing clean lapsed");
        assert_eq!(store.guarded(&store.lock()).next_lapse, 100, "a bound at 50 would have every round sweep again");
        // Written after all, it turns clean, lapsed: the next round's sweep frees it.
        store.written(&store.counts(Oid::from(2), true));
        assert_eq!(store.guarded(&store.lock()).next_lapse, 50);
        store.sweep(61, &[]);
        assert_eq!(held(&store), 1);
    }

    #[pg_test]
    fn a_count_written_in_a_chunk_the_sweep_passed_keeps_the_next_lapse_at_or_before_its_expiry() {
        let left = sweeps_while_counts_are_made(1_000);
        let with_counts = left.iter().filter(|(_, _, _, made)| *made > 0).count();
        assert!(with_counts >= 20, "counts were made during only {with_counts} of 1,000 sweeps");
        let too_late = left.iter().filter(|(_, bound, earliest, _)| earliest.is_some_and(|e| *bound > e)).count();
        // Such a bound has the sweeps skip a lapsed count until some later change.
        assert_eq!(too_late, 0, "sweeps that left the next lapse after a clean count's expiry");
    }

    #[pg_test]
    fn counts_written_during_a_sweep_let_its_bound_rise_to_their_expiry() {
        let left = sweeps_while_counts_are_made(1_000);
        let with_counts: Vec<_> = left.iter().filter(|(_, _, _, made)| *made > 0).collect();
        assert!(with_counts.len() >= 20, "counts were made during only {} of 1,000 sweeps", with_counts.len());
        // Nothing held lapses before `now` + 1: a bound before it (`now` - 100, where the old rule left it) would have
        // every round sweep again.
        let stuck = with_counts.iter().filter(|(now, bound, _, _)| *bound <= *now).count();
        assert_eq!(stuck, 0, "sweeps during which counts were made that kept the bound where it was");
    }
}
