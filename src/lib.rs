//! pg_dedup: message deduplication (idempotent consumer / inbox pattern) inside PostgreSQL.
//!
//! The rule: each feature room holds its own SQL face (its `#[pg_extern]` functions) beside its logic, and the
//! floors below know nothing of the rooms above them. docs/architecture.md is the map, with recipes.
//!
//! Features, each with its SQL face:
//! - `mark`        — mark(), mark_many(), seen(), forget(), and the algorithm that marks ids (attached rows too)
//! - `idempotency` — idempotency keys: claim(), complete(), release(), fingerprint()
//! - `attach`      — attach(), detach(): deduplicating a table's inserts (INSERT, COPY, replication) by a key
//! - `positions`   — advance(), position(): per-key positions of ordered streams
//! - `attempts`    — attempt(): counts of delivery attempts that survive a rollback (poison messages)
//! - `inboxes`     — create_inbox(), drop_inbox()
//! - `purge`       — purge(), and the workers' purge cycles: batched deletion of expired marks
//! - `distribute`  — distribute_inbox(), undistribute_inbox() (Citus)
//! - `stats`       — `dedup.stats`
//! - `rebuild`     — bloom_rebuild(): loading inbox tables into the filter, and the worker's upkeep of it
//! - `worker`      — the background launcher and per-database workers (preloaded only)
//!
//! Doors the features share:
//! - `gate`    — the one door to the filter for an inbox: "certainly new" or "maybe", counted
//! - `rows`    — the one door to an inbox's rows: read directly where the table allows, else through SQL
//!
//! Storage, below the features:
//! - `inbox`   — inbox tables: their statements, the registry, and the per-backend cache
//! - `direct`  — inbox rows read and written without the executor: certainly-new ids, one id's row, completions
//! - `trigger` — the filter trigger on every inbox table, and the DDL watch that keeps the filter honest about it
//! - `citus`   — what storage needs to know of Citus: distributed tables, lock waits on the workers
//! - `catalog` — relations as the catalogs show them, and the inbox tables among them
//!
//! Shared memory:
//! - `filter`  — the shared-memory Bloom filter in front of the indexes (preloaded only)
//! - `shmem`   — the shared memory region: filter words, per-inbox state and counters, worker slots
//!
//! Foundations:
//! - `plans`   — prepared statements kept per backend: `statements!` and `Plans`
//! - `relcache` — per-backend caches of what is built from a table, made stale by the table's invalidations
//! - `rights`  — acting as a table's owner (the worker's purge) or as the extension's owner (creating inboxes)
//! - `clock`   — the time expiry is measured against
//! - `xact`    — brackets that undo work on error: subtransactions, and the workers' transactions
//! - `guc`     — every setting
//! - `input`   — validation of every argument
//! - `errors`  — `dedup:` errors with SQLSTATE and hint
//! - `jsonb`   — a jsonb value passed through without parsing (stored results)
//! - `ports`   — PostgreSQL C macros and version differences, ported once
//! - `unguarded` — calls into PostgreSQL under one guard per sequence, on the hottest paths
//! - `sql/`    — the hand-written SQL objects (row type, registry, default inbox, views, privileges)

mod attach;
mod attempts;
mod catalog;
mod citus;
mod clock;
mod direct;
mod distribute;
mod errors;
mod filter;
mod gate;
mod guc;
mod idempotency;
mod inbox;
mod inboxes;
mod input;
mod jsonb;
mod mark;
mod plans;
mod ports;
mod positions;
mod purge;
mod rebuild;
mod relcache;
mod rights;
mod rows;
mod shmem;
mod stats;
mod trigger;
mod unguarded;
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
        register_a_thread_local_destructor();
    }
}

/// Has the postmaster register one destructor of a thread-local, so that no backend pays for the first one.
///
/// The first `thread_local!` with a destructor a process touches makes Rust register it with glibc
/// (`__cxa_thread_atexit_impl`), whose call of `_dl_find_dso_for_object` goes through a lazily bound entry of libc's:
/// resolving it walks the symbol tables of every library the server has loaded, page-faulting on each (a forked
/// backend maps none of their pages yet). perf of `pgbench -C`: 49 µs of a connection's first `mark()`, about 2% of
/// a connection's wall-clock time (1.4% of its server CPU), where the raw insert pays nothing of the kind. Bound
/// here, in the postmaster, the entry is inherited by every process it forks (tests/connections.rs watches the
/// dynamic linker's log of a backend).
fn register_a_thread_local_destructor() {
    thread_local! {
        static WITH_A_DESTRUCTOR: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    // black_box: an access whose value goes unused was optimised away, registration and all.
    WITH_A_DESTRUCTOR.with(|value| std::hint::black_box(value).borrow().len());
}

use pgrx::pg_guard;

/// `cargo pgrx test`: the server the `#[pg_test]`s run in preloads pg_dedup, so the shared filter, its counters and
/// the launcher are there; but no worker runs at all (`dedup.database` names a database that does not exist): the
/// right to rebuild the filter is server-wide, and a worker of another database loading or rotating it would make
/// any test that rebuilds, or that trusts a new inbox at once, depend on who wins the race. Nothing loads or purges
/// behind a test's back. `track_functions` lets tests see whether the filter trigger ran.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'no_worker_here'", "track_functions = 'all'"]
    }
}
