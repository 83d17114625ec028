//! Inbox storage. An inbox is an independent namespace of marks: a real table `dedup.inbox_<name>` of the row
//! type `dedup.inbox_row` (id text COLLATE "C" PRIMARY KEY, expires_at timestamptz NOT NULL, and for idempotency
//! keys fingerprint, result, lease_until and completed, which a mark leaves NULL), with an index on `expires_at`,
//! listed with its default TTL in `dedup.inbox_registry`. The UNIQUE index on `id` is the single source of truth
//! for "already seen".
//!
//! - `stmt`     — every statement run against an inbox table
//! - `registry` — creating, dropping, finding and listing inboxes
//! - `cache`    — the per-backend cache of open inboxes and their prepared statements

mod cache;
mod registry;
mod stmt;

pub use cache::{open, open_unflushed, reopen};
pub use registry::{all_names, create, drop, require_administrator, Dependents};
pub use stmt::Stmt;

use crate::errors::internal;
use crate::filter::Trusted;
use crate::plans::Plans;
use crate::shmem;
use crate::trigger::State;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiTupleTable};
use std::cell::OnceCell;

pub const SCHEMA: &str = "dedup";
pub const DEFAULT_INBOX: &str = "default";

/// What a caller is about to do with an inbox; decides the privileges checked and the lock taken.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Mark,
    Delete,
}

impl Access {
    fn acl_mask(self) -> pg_sys::AclMode {
        (match self {
            Access::Read => pg_sys::ACL_SELECT,
            Access::Mark => pg_sys::ACL_SELECT | pg_sys::ACL_INSERT | pg_sys::ACL_UPDATE,
            Access::Delete => pg_sys::ACL_SELECT | pg_sys::ACL_DELETE | pg_sys::ACL_UPDATE,
        }) as pg_sys::AclMode
    }

    fn lock_mode(self) -> pg_sys::LOCKMODE {
        (match self {
            Access::Read => pg_sys::AccessShareLock,
            Access::Mark | Access::Delete => pg_sys::RowExclusiveLock,
        }) as pg_sys::LOCKMODE
    }

    fn grant_hint(self, table: &str) -> String {
        let privileges = match self {
            Access::Read => "SELECT",
            Access::Mark => "SELECT, INSERT, UPDATE",
            Access::Delete => "SELECT, UPDATE, DELETE",
        };
        format!("An administrator can run: GRANT {privileges} ON {table} TO <role>; (see README, \"Privileges\").")
    }
}

pub struct Inbox {
    pub name: String,
    pub relid: pg_sys::Oid,
    /// Schema-qualified, quoted table name, ready to splice into SQL.
    pub table: String,
    /// The TTL of a mark made without one: read from the registry when first needed
    /// (`registry::default_ttl`), unless `registry::load` read it already.
    default_ttl: OnceCell<Interval>,
    /// The inbox's key namespace in the shared filter (database and table).
    pub ns: u64,
    /// Its state and counters in shared memory (None without preloading, or when that table is full), looked up
    /// once per backend rather than on every count.
    entry: Option<&'static shmem::Entry>,
    stale: crate::relcache::Stale,
    plans: Plans<{ Stmt::COUNT }>,
    shape: OnceCell<Shape>,
}

/// The columns of `dedup.inbox_row`, in order: a mark fills the first two, a claim (`idempotency`) the rest.
pub(crate) const COLUMNS: [(&str, pg_sys::Oid); 6] = [
    ("id", pg_sys::TEXTOID),
    ("expires_at", pg_sys::TIMESTAMPTZOID),
    ("fingerprint", pg_sys::TEXTOID),
    ("result", pg_sys::JSONBOID),
    ("lease_until", pg_sys::TIMESTAMPTZOID),
    ("completed", pg_sys::BOOLOID),
];

/// What the relcache says about an inbox table that decides how it may be written and whether the filter may
/// answer for it. Read once per backend and inbox, after the table is locked; any DDL on the table invalidates the
/// cache entry (and this with it).
pub struct Shape {
    /// How the filter trigger stands: the filter answers for the inbox only while it guards it.
    pub trigger: State,
    /// Does writing a row need nothing but its two values and index entries, so that the direct insert may skip
    /// the executor? The table must still be the inbox row type exactly (no columns an owner added after `NOT OF`,
    /// no CHECK constraint, rule or row security), and its one trigger the guarding filter trigger, whose work the
    /// direct insert does itself.
    pub plain: bool,
    /// Has the table the claim columns (`fingerprint` and the rest)? Not yet in a database whose extension is
    /// still at 0.2.0 while the 0.3.0 library runs (between the restart and `ALTER EXTENSION pg_dedup UPDATE`).
    pub claim_columns: bool,
    /// The primary key's index (InvalidOid if an owner dropped it), which `direct::find_each` reads.
    pub pkey: pg_sys::Oid,
    /// Distributed by Citus (`citus`): its rows live in shards elsewhere, and only SQL reaches them.
    pub distributed: bool,
    /// Distributed, and the primary key on `id` its only unique index, with no exclusion constraint? Then `ON
    /// CONFLICT DO NOTHING` without a conflict target means `ON CONFLICT (id)`, and the inserts Citus sends to the
    /// shards as text go without one (`stmt::target`). Not asked of a local inbox, whose statements keep the target.
    pub key_only_unique: bool,
}

impl Shape {
    /// # Safety
    /// `rel` must be an open relation.
    unsafe fn of(rel: pg_sys::Relation) -> Shape {
        // SAFETY: the caller vouches for the relation; its pg_class row, tuple descriptor, constraints, rules and triggers
        // are only read.
        unsafe {
            let desc = pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att);
            let distributed = crate::citus::distributed((*rel).rd_id);
            // Of the inbox row type (a typed table), with no CHECK constraint at all.
            let plain = !distributed
                && (*(*rel).rd_rel).reloftype != pg_sys::InvalidOid
                && crate::direct::needs_only_rows(rel, &COLUMNS, |_| false);
            let claim_columns =
                (0..desc.len()).any(|i| crate::direct::column_is(&desc, i, "completed", pg_sys::BOOLOID));
            let pkey = crate::ports::primary_key_index(rel);
            Shape {
                trigger: State::of(rel),
                plain,
                claim_columns,
                pkey,
                distributed,
                key_only_unique: distributed && key_only_unique(rel, pkey),
            }
        }
    }
}

/// Is `pkey`, `rel`'s primary key (InvalidOid: none), its only unique index, on `id` alone, and is there no exclusion
/// constraint either?
///
/// # Safety
/// `rel` must be an open relation.
unsafe fn key_only_unique(rel: pg_sys::Relation, pkey: pg_sys::Oid) -> bool {
    // SAFETY: the caller vouches for the relation; each index's pg_index row is read from the syscache and released,
    // and the list is the relcache's copy, ours to free.
    unsafe {
        let indexes = pg_sys::RelationGetIndexList(rel);
        let mut only = pkey != pg_sys::InvalidOid;
        for i in 0..pg_sys::list_length(indexes) {
            let index = pg_sys::list_nth_oid(indexes, i);
            let tuple =
                pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::INDEXRELID as i32, pg_sys::Datum::from(index));
            if tuple.is_null() {
                only = false;
                continue;
            }
            let form = &*crate::ports::GETSTRUCT::<pg_sys::FormData_pg_index>(tuple);
            if index == pkey {
                // On `id` (the row type's first column) alone: under a key an owner widened, say to (id, fingerprint),
                // no target would let a second row of an id in, where `ON CONFLICT (id)` fails (no index matches it).
                only &= form.indnatts == 1 && form.indkey.values.as_slice(1)[0] == 1;
            } else if form.indisunique || form.indisexclusion {
                only = false;
            }
            pg_sys::ReleaseSysCache(tuple);
        }
        pg_sys::list_free(indexes);
        only
    }
}

impl crate::relcache::Entry for Inbox {
    fn stale(&self) -> &crate::relcache::Stale {
        &self.stale
    }
}

impl Inbox {
    fn new(name: &str, relid: pg_sys::Oid, table: String, default_ttl: Option<Interval>, ns: u64) -> Inbox {
        Inbox {
            name: name.to_owned(),
            relid,
            table,
            default_ttl: default_ttl.map(OnceCell::from).unwrap_or_default(),
            ns,
            entry: shmem::region().and_then(|r| r.entry(ns, true)),
            stale: crate::relcache::Stale::of(relid),
            plans: Default::default(),
            shape: OnceCell::new(),
        }
    }

    /// The TTL of a mark made without one. Only for an inbox returned by `open`, which locked the table.
    pub fn default_ttl(&self) -> Interval {
        *self.default_ttl.get_or_init(|| registry::default_ttl(&self.name))
    }

    /// The table's shape. Only for an inbox returned by `open`, which locked the table.
    pub fn shape(&self) -> &Shape {
        self.shape.get_or_init(|| {
            // SAFETY: the table is locked by this transaction (see `open`); closed again at once.
            unsafe {
                let rel = pg_sys::relation_open(self.relid, pg_sys::NoLock as pg_sys::LOCKMODE);
                let shape = Shape::of(rel);
                pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                shape
            }
        })
    }

    /// The filter, if it may answer for this inbox right now: loaded, and guarded by the trigger.
    pub fn filter(&self) -> Option<Trusted> {
        if self.shape().trigger != State::Guarding || self.shape().distributed {
            return None;
        }
        Trusted::for_inbox(self.ns)
    }

    /// Runs `f` waiting at most `timeout` for a lock: where the inbox's rows are, so on the Citus workers for a
    /// distributed inbox (`citus::with_lock_timeout`), here otherwise.
    pub fn with_lock_timeout<R>(&self, timeout: &std::ffi::CStr, f: impl FnOnce() -> R) -> R {
        if self.shape().distributed {
            crate::citus::with_lock_timeout(timeout, f)
        } else {
            crate::guc::with_setting(c"lock_timeout", timeout, f)
        }
    }

    /// Adds `n` to one of the inbox's counters in `dedup.stats` (nothing without preloading).
    pub fn count(&self, counter: shmem::Counter, n: u64) {
        if let (Some(entry), true) = (self.entry, n > 0) {
            // The entry is freed if the table goes, and may then serve another inbox.
            if entry.holds(self.ns) {
                entry.add(counter, n);
            }
        }
    }

    /// Records the expired marks left after a purge cycle (-1: unknown).
    pub fn set_backlog(&self, backlog: i64) {
        if let Some(entry) = self.entry.filter(|e| e.holds(self.ns)) {
            entry.backlog.store(backlog, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The statement's plan, prepared on first use.
    pub fn plan(&self, client: &SpiClient<'_>, stmt: Stmt) -> &OwnedPreparedStatement {
        self.plans.get(client, stmt as usize, || stmt.sql(&self.table, self.shape()), || stmt.arg_types())
    }

    /// Runs one of the inbox's statements through its cached plan.
    pub fn run<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stmt: Stmt,
        args: &[pgrx::datum::DatumWithOid<'_>],
    ) -> SpiTupleTable<'conn> {
        // `select` on a plan prepared with `prepare_mut` runs it read-write (a fresh snapshot per statement under
        // READ COMMITTED) without forcing a transaction id onto duplicates, which must write no WAL.
        client.select(self.plan(client, stmt), None, args).unwrap_or_else(|e| internal("running a statement", e))
    }
}
