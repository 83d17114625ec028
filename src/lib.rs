//! pg_dedup: message deduplication (idempotent consumer / inbox pattern) inside PostgreSQL.
//!
//! Table of contents:
//! - `api`     — the SQL functions in schema `dedup` (mark, mark_many, seen, forget, inboxes, purge)
//! - `claim`   — the claim algorithm: ask the filter, insert, wait for concurrent claims, renew expired marks
//! - `idempotency` — idempotency keys: claim(), complete(), release(), fingerprint()
//! - `jsonb`   — a jsonb value passed through without parsing (stored results)
//! - `attach`  — attach(): deduplicating a table's inserts (INSERT, COPY, replication) by a key over its rows
//! - `positions` — advance() and position(): per-key positions of ordered streams
//! - `direct`  — inbox rows read and written without the executor: certainly-new ids, one id's row, completions
//! - `inbox`   — inbox tables: their statements, the registry, and the per-backend cache
//! - `relcache` — per-backend caches of what is built from a table, made stale by the table's invalidations
//! - `filter`  — the shared-memory Bloom filter in front of the indexes (preloaded only)
//! - `trigger` — the filter trigger on every inbox table, and the DDL watch that keeps the filter honest about it
//! - `rebuild` — loading inbox tables into the filter, and the worker's upkeep of it
//! - `shmem`   — the shared memory region: filter words, per-inbox state and counters, worker slots
//! - `worker`  — the background launcher and per-database workers (preloaded only)
//! - `purge`   — batched deletion of expired marks, by `dedup.purge()` and by the workers' cycles
//! - `stats`   — `dedup.stats`
//! - `rights`  — acting as a table's owner (the worker's purge) or as the extension's owner (creating inboxes)
//! - `catalog` — finding inbox tables in the catalogs
//! - `citus`   — inboxes distributed with Citus: distribute_inbox(), and telling them apart
//! - `clock`   — the time expiry is measured against
//! - `xact`    — brackets that undo work on error: subtransactions, and the workers' transactions
//! - `guc`     — every setting
//! - `input`   — validation of every argument
//! - `errors`  — `dedup:` errors with SQLSTATE and hint
//! - `ports`   — PostgreSQL C macros and version differences, ported once
//! - `sql/`    — the hand-written SQL objects (row type, registry, default inbox, views, privileges)

mod api;
mod attach;
mod catalog;
mod citus;
mod claim;
mod clock;
mod direct;
mod errors;
mod filter;
mod guc;
mod idempotency;
mod inbox;
mod input;
mod jsonb;
mod ports;
mod positions;
mod purge;
mod rebuild;
mod relcache;
mod rights;
mod shmem;
mod stats;
mod trigger;
mod worker;
mod xact;

#[cfg(any(test, feature = "pg_test"))]
mod testing;

::pgrx::pg_module_magic!();

pgrx::extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);
pgrx::extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // An ERROR PostgreSQL raises inside one of our calls (a lock timeout, a serialization failure) passes through
    // pgrx, which appends a Rust backtrace to its DETAIL when RUST_BACKTRACE is set in the server's environment. It
    // must reach the client as PostgreSQL raised it; RUST_LIB_BACKTRACE takes precedence for such backtraces.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    guc::init();
    // Shared memory, postmaster-level settings and the worker exist only when loaded at server start.
    // SAFETY: reads a flag the postmaster sets while it loads shared_preload_libraries.
    if unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        guc::init_preloaded();
        shmem::init_preloaded();
        worker::init_preloaded();
        guc::reserve_prefix();
    }
}

use pgrx::pg_guard;

/// `cargo pgrx test`: the server the `#[pg_test]`s run in preloads pg_dedup, so the shared filter, its counters and
/// the launcher are there; no worker serves the test database (`dedup.database` names another), so nothing loads
/// or purges behind a test's back. `track_functions` lets tests see whether the filter trigger ran.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'postgres'", "track_functions = 'all'"]
    }
}
