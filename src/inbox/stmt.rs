//! Every SQL statement pg_dedup runs against an inbox table, prepared once per backend and inbox (see `cache`).
//! Names and operators are schema-qualified so that nothing on the caller's `search_path` can take their place.

use crate::plans::statements;
use pgrx::PgOid;

statements! {
    /// $1 id, $2 expires_at → a row if the id was inserted (for a distributed inbox: a processed count of 1, no row).
    Insert,
    /// $1 ids (sorted, distinct), $2 expires_at → the ids inserted.
    InsertMany,
    /// $1 id → (id, expires_at, fingerprint, result, lease_until, completed, written by this transaction) of its
    /// row visible now, live or expired (`rows::find`, for tables that cannot be read directly).
    Find,
    /// The same for $1 ids. Apart from `Find` because the plan cache never settles on a generic plan for
    /// `= ANY ($1)`, and re-planning every duplicate's lookup cost more than the lookup.
    FindMany,
    /// $1 ids, $2 new expires_at, $3 now → the ids whose expired row this call renewed (as a plain mark: what a
    /// claim had stored goes).
    Renew,
    /// $1 id, $2 now → one boolean per deleted row: was it live?
    Forget,
    /// $1 now, $2 batch size → deletes up to that many expired rows, skipping rows other transactions hold.
    PurgeBatch,
    /// The same without row locks (what a hand-written purge does): it would wait for a row another transaction
    /// holds, so it runs under a short lock_timeout and falls back to `PurgeBatch`.
    PurgeBatchUnlocked,
    /// $1 now, $2 cap → how many expired rows wait, counted up to the cap.
    Backlog,
    /// $1 id, $2 expires_at, $3 fingerprint, $4 lease_until → a row if a claim in progress was inserted.
    ClaimInsert,
    /// $1 id, $2 expires_at, $3 fingerprint, $4 lease_until, $5 now → a row if the id's row, expired or a claim
    /// whose lease has passed, was taken over as a claim in progress.
    ClaimTakeOver,
    /// $1 id, $2 result, $3 now → a row if the id's live claim in progress was completed with `result`.
    Complete,
    /// $1 id → a row if the id's claim in progress was deleted.
    Release,
}

impl Stmt {
    /// The statement's text for `table` of shape `shape`: whether it has the claim columns yet, and whether Citus
    /// distributes it (two statements then take a form Citus can run: the batch insert's RETURNING read through a
    /// CTE, which Citus's INSERT ... SELECT otherwise miscounts under SPI, and the purge by id, as Citus refuses
    /// ctids and FOR UPDATE across shards).
    pub(super) fn sql(self, table: &str, shape: &super::Shape) -> String {
        let claim_columns = shape.claim_columns;
        match self {
            // Without RETURNING: the row count SPI reports says whether the row went in (Citus counts the rows
            // the worker inserted), and Citus then neither asks the worker for a row nor keeps it in a tuplestore.
            // Without a conflict target where the key is the only unique index (the same arbiter): Citus sends the
            // statement as text, and the node holding the shard parses, infers and plans the target at every call,
            // which cost 7 points of the ratio to the hand-written INSERT at 8 clients
            // (bench/results/profiles/issue-23.md, stop 56).
            Stmt::Insert if shape.distributed => {
                format!("INSERT INTO {table} (id, expires_at) VALUES ($1, $2) ON CONFLICT{} DO NOTHING", target(shape))
            }
            Stmt::InsertMany if shape.distributed => format!(
                "WITH ins AS (INSERT INTO {table} (id, expires_at) SELECT u.id, $2 FROM pg_catalog.unnest($1) \
                 WITH ORDINALITY AS u(id, n) ORDER BY u.n ON CONFLICT{} DO NOTHING RETURNING id) SELECT id FROM ins",
                target(shape)
            ),
            // The outer test of expires_at again: a row renewed by a mark between the two (the subquery runs
            // first, as a step of its own) keeps its id, and the DELETE's recheck of the new version must see
            // that it is live. (By ctid, the new version's ctid is not in the list.)
            Stmt::PurgeBatch | Stmt::PurgeBatchUnlocked if shape.distributed => format!(
                "DELETE FROM {table} WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT id FROM {table} \
                 WHERE expires_at OPERATOR(pg_catalog.<=) $1 LIMIT $2)) AND expires_at OPERATOR(pg_catalog.<=) $1"
            ),
            Stmt::Insert => format!(
                "INSERT INTO {table} (id, expires_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING RETURNING true"
            ),
            Stmt::InsertMany => format!(
                "INSERT INTO {table} (id, expires_at) SELECT u.id, $2 FROM pg_catalog.unnest($1) WITH ORDINALITY \
                 AS u(id, n) ORDER BY u.n ON CONFLICT (id) DO NOTHING RETURNING id"
            ),
            // Whether the row is this transaction's is decided where the row is: on the node holding its shard. A
            // table without the claim columns is one of a database whose extension is still at 0.2.0, which has
            // no claims (nor dedup.xmin_is_mine()).
            Stmt::Find | Stmt::FindMany => format!(
                "SELECT id, expires_at, {} FROM {table} WHERE id OPERATOR(pg_catalog.=) {}",
                if claim_columns {
                    "fingerprint, result, lease_until, completed, dedup.xmin_is_mine(xmin)"
                } else {
                    "NULL::pg_catalog.text, NULL::pg_catalog.jsonb, NULL::pg_catalog.timestamptz, NULL::pg_catalog.bool, false"
                },
                if self == Stmt::Find { "$1" } else { "ANY ($1)" }
            ),
            Stmt::Renew => format!(
                "UPDATE {table} SET expires_at = $2{} WHERE id OPERATOR(pg_catalog.=) ANY ($1) \
                 AND expires_at OPERATOR(pg_catalog.<=) $3 RETURNING id",
                if claim_columns {
                    ", fingerprint = NULL, result = NULL, lease_until = NULL, completed = NULL"
                } else {
                    ""
                }
            ),
            Stmt::Forget => format!(
                "DELETE FROM {table} WHERE id OPERATOR(pg_catalog.=) $1 RETURNING expires_at OPERATOR(pg_catalog.>) $2"
            ),
            // ORDER BY expires_at: a cached plan turns generic after five runs, and the generic plan of a bare
            // `expires_at <= $1 LIMIT $2` (a third of the table, by the default estimate) is a sequential scan,
            // which reads every live row before the expired ones each batch: 44 ms a batch instead of 5 on an
            // inbox of 1M with a tenth expired. The order makes the generic plan an index scan that stops at
            // `$2` rows, cheaper even than the custom plan's bitmap scan (which reads every expired entry).
            Stmt::PurgeBatch => format!(
                "DELETE FROM {table} WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT ctid FROM {table} \
                 WHERE expires_at OPERATOR(pg_catalog.<=) $1 ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED))"
            ),
            Stmt::PurgeBatchUnlocked => format!(
                "DELETE FROM {table} WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT ctid FROM {table} \
                 WHERE expires_at OPERATOR(pg_catalog.<=) $1 ORDER BY expires_at LIMIT $2))"
            ),
            Stmt::ClaimInsert => format!(
                "INSERT INTO {table} (id, expires_at, fingerprint, lease_until, completed) \
                 VALUES ($1, $2, $3, $4, false) ON CONFLICT{} DO NOTHING RETURNING true",
                target(shape)
            ),
            Stmt::ClaimTakeOver => format!(
                "UPDATE {table} SET expires_at = $2, fingerprint = $3, result = NULL, lease_until = $4, \
                 completed = false WHERE id OPERATOR(pg_catalog.=) $1 AND (expires_at OPERATOR(pg_catalog.<=) $5 \
                 OR (NOT completed AND lease_until OPERATOR(pg_catalog.<=) $5)) RETURNING true"
            ),
            Stmt::Complete => format!(
                "UPDATE {table} SET result = $2, lease_until = NULL, completed = true \
                 WHERE id OPERATOR(pg_catalog.=) $1 AND NOT completed AND expires_at OPERATOR(pg_catalog.>) $3 \
                 RETURNING true"
            ),
            Stmt::Release => {
                format!("DELETE FROM {table} WHERE id OPERATOR(pg_catalog.=) $1 AND NOT completed RETURNING true")
            }
            // No ORDER BY needed here: checked after six executions of the prepared statement (inboxes of 1M
            // rows, a tenth expired, loaded in order and shuffled), the generic plan is an index(-only) scan of
            // expires_at that stops at the cap, as the count reads no column but the key.
            Stmt::Backlog => format!(
                "SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {table} \
                 WHERE expires_at OPERATOR(pg_catalog.<=) $1 LIMIT $2) s"
            ),
        }
    }

    pub(super) fn arg_types(self) -> Vec<PgOid> {
        use pgrx::pg_sys::BuiltinOid::*;
        let oids = match self {
            Stmt::Insert => vec![TEXTOID, TIMESTAMPTZOID],
            Stmt::InsertMany => vec![TEXTARRAYOID, TIMESTAMPTZOID],
            Stmt::Find => vec![TEXTOID],
            Stmt::FindMany => vec![TEXTARRAYOID],
            Stmt::Renew => vec![TEXTARRAYOID, TIMESTAMPTZOID, TIMESTAMPTZOID],
            Stmt::Forget => vec![TEXTOID, TIMESTAMPTZOID],
            Stmt::PurgeBatch | Stmt::PurgeBatchUnlocked | Stmt::Backlog => vec![TIMESTAMPTZOID, INT8OID],
            Stmt::Release => vec![TEXTOID],
            Stmt::ClaimInsert => vec![TEXTOID, TIMESTAMPTZOID, TEXTOID, TIMESTAMPTZOID],
            Stmt::ClaimTakeOver => vec![TEXTOID, TIMESTAMPTZOID, TEXTOID, TIMESTAMPTZOID, TIMESTAMPTZOID],
            Stmt::Complete => vec![TEXTOID, JSONBOID, TIMESTAMPTZOID],
        };
        oids.into_iter().map(PgOid::BuiltIn).collect()
    }
}

/// The conflict target of an insert that Citus sends to a shard as text: none where the primary key is the only
/// unique index (any conflict is then one on `id`), `(id)` otherwise, so that a conflict on another unique index
/// raises its own error (unique_violation) instead of leaving the id unwritten and `mark()` going round until it
/// gives up. A local inbox's statements keep `(id)`: their plans are cached, so the target is inferred once.
fn target(shape: &super::Shape) -> &'static str {
    if shape.key_only_unique {
        ""
    } else {
        " (id)"
    }
}
