//! pg_dedup: message deduplication (idempotent consumer / inbox pattern) inside PostgreSQL.
//!
//! Table of contents:
//! - `api`     — the SQL functions in schema `dedup` (mark, mark_many, seen, forget, inboxes, purge)
//! - `claim`   — the claim algorithm: ask the filter, insert, wait for concurrent claims, renew expired marks
//! - `direct_insert` — certainly-new ids straight into heap and indexes, without the executor
//! - `inbox`   — inbox tables: their statements, the registry, and the per-backend cache
//! - `filter`  — the shared-memory Bloom filter in front of the indexes (preloaded only)
//! - `rebuild` — loading inbox tables into the filter, and the worker's upkeep of it
//! - `shmem`   — the shared memory region: filter words, per-inbox state and counters, worker slots
//! - `worker`  — the background launcher and per-database workers (preloaded only)
//! - `purge`   — batched deletion of expired marks, by `dedup.purge()` and by the workers' cycles
//! - `stats`   — `dedup.stats`
//! - `clock`   — the time expiry is measured against
//! - `xact`    — brackets that undo work on error: subtransactions, and the workers' transactions
//! - `guc`     — every setting
//! - `input`   — validation of every argument
//! - `errors`  — `dedup:` errors with SQLSTATE and hint
//! - `ports`   — PostgreSQL C macros and version differences, ported once
//! - `sql/`    — the hand-written SQL objects (row type, registry, default inbox, views, privileges)

mod api;
mod claim;
mod clock;
mod direct_insert;
mod errors;
mod filter;
mod guc;
mod inbox;
mod input;
mod ports;
mod purge;
mod rebuild;
mod shmem;
mod stats;
mod worker;
mod xact;

::pgrx::pg_module_magic!();

pgrx::extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);
pgrx::extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    guc::init();
    // Shared memory, postmaster-level settings and the worker exist only when loaded at server start.
    // SAFETY: reads a flag the postmaster sets while it loads shared_preload_libraries.
    if unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        guc::init_preloaded();
        shmem::init_preloaded();
        worker::init_preloaded();
    }
}

use pgrx::pg_guard;
