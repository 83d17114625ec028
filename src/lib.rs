//! pg_dedup: message deduplication (idempotent consumer / inbox pattern) inside PostgreSQL.
//!
//! Table of contents:
//! - `api`     — the SQL functions in schema `dedup` (mark, mark_many, seen, forget, inboxes, purge)
//! - `claim`   — the claim algorithm: insert, wait for concurrent claims, renew expired marks
//! - `inbox`   — inbox tables, their registry and the per-backend cache of prepared statements
//! - `purge`   — batched deletion of expired marks
//! - `input`   — validation of every argument
//! - `errors`  — `dedup:` errors with SQLSTATE and hint
//! - `sql/`    — the hand-written SQL objects (row type, registry, default inbox, views, privileges)

mod api;
mod claim;
mod errors;
mod inbox;
mod input;
mod purge;

::pgrx::pg_module_magic!();

pgrx::extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);
pgrx::extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);
