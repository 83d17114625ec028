//! Inbox storage. An inbox is an independent namespace of marks: a real table `dedup.inbox_<name>` of the row
//! type `dedup.inbox_row` (id text COLLATE "C" PRIMARY KEY, expires_at timestamptz), listed with its default TTL
//! in `dedup.inbox_registry`. The UNIQUE index on `id` is the single source of truth for "already seen".
//!
//! - `stmt`     — every statement run against an inbox table
//! - `registry` — creating, dropping, finding and listing inboxes
//! - `cache`    — the per-backend cache of open inboxes and their prepared statements

mod cache;
mod registry;
mod stmt;

pub use cache::open;
pub use registry::{all_names, create, drop, relid};
pub use stmt::Stmt;

use crate::errors::internal;
use crate::ports;
use crate::shmem;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiTupleTable};
use std::cell::{Cell, OnceCell};
use stmt::STATEMENT_COUNT;

pub const SCHEMA: &str = "dedup";
pub const DEFAULT_INBOX: &str = "default";

/// What a caller is about to do with an inbox; decides the privileges checked and the lock taken.
#[derive(Clone, Copy)]
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
    pub default_ttl: Interval,
    /// The inbox's key namespace in the shared filter (database and table).
    pub ns: u64,
    /// Its state and counters in shared memory (None without preloading, or when that table is full), looked up
    /// once per backend rather than on every count.
    entry: Option<&'static shmem::Entry>,
    stale: Cell<bool>,
    plans: [OnceCell<OwnedPreparedStatement>; STATEMENT_COUNT],
}

impl Inbox {
    fn new(name: &str, relid: pg_sys::Oid, table: String, default_ttl: Interval, ns: u64) -> Inbox {
        Inbox {
            name: name.to_owned(),
            relid,
            table,
            default_ttl,
            ns,
            entry: shmem::region().and_then(|r| r.entry(ns, true)),
            stale: Cell::new(false),
            plans: Default::default(),
        }
    }

    /// Adds `n` to one of the inbox's counters in `dedup.stats` (nothing without preloading).
    pub fn count(&self, counter: shmem::Counter, n: u64) {
        if let (Some(entry), true) = (self.entry, n > 0) {
            entry.add(counter, n);
        }
    }

    /// Records the expired marks left after a purge cycle (-1: unknown).
    pub fn set_backlog(&self, backlog: i64) {
        if let Some(entry) = self.entry {
            entry.backlog.store(backlog, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The statement's plan, prepared on first use.
    pub fn plan(&self, client: &SpiClient<'_>, stmt: Stmt) -> &OwnedPreparedStatement {
        self.plans[stmt.index()].get_or_init(|| {
            client
                .prepare_mut(stmt.sql(&self.table).as_str(), &stmt.arg_types())
                .unwrap_or_else(|e| internal("preparing a statement", e))
                .keep()
        })
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

/// Runs `f` with the rights of the inbox table's owner, as a security-restricted operation, the way VACUUM and
/// autovacuum do: the background worker is a superuser, and a trigger or rule the owner put on the table must not
/// run with superuser rights.
pub fn as_owner<R>(relid: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    let owner =
        ports::relation_owner(relid).unwrap_or_else(|| internal("finding an inbox table's owner", "no such table"));
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    // SAFETY: plain reads and writes of the backend's current user; restored below, or by the transaction abort.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(owner, context | pg_sys::SECURITY_RESTRICTED_OPERATION as i32);
    }
    // On an ERROR, aborting the transaction restores the user, as it does for VACUUM.
    let result = f();
    // SAFETY: as above.
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    result
}
