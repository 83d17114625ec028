//! Per-key positions (docs/ingest.md): `advance(key, position)` stores a key's position only when it moves it
//! forward, for ordered streams where each event carries a per-key version (an aggregate's version, a producer's
//! sequence number) and a stale or repeated event must not be applied.
//!
//! Storage: one table for every inbox, `dedup.positions (inbox, key, position, expires_at)`, apart from the inbox
//! tables. A key of `advance()` and an id of `mark()` with the same text are different things and never meet: an
//! inbox's marks answer "seen or not", its positions "how far". Positions expire like marks (`ttl` after the last
//! successful advance) and are purged by the same worker cycle and by `dedup.purge()`.
//!
//! Access follows the inbox: `advance()` needs what `mark()` needs on the inbox's table (SELECT, INSERT, UPDATE),
//! `position()` what `seen()` needs (SELECT). The positions table itself is written and read only by the
//! extension's owner, whose rights these functions use once the caller's are checked, so a role that may write one
//! inbox cannot touch another inbox's positions.
//!
//! `advance()` first reads the stored position without a lock: a stale or repeated event (stored position live and
//! not lower) is answered `false` then and there, writing nothing. Otherwise one upsert decides, under the row
//! lock: `INSERT ... ON CONFLICT DO UPDATE ... WHERE stored < new OR expired`. A concurrent advance of the same key
//! waits for it, then compares with what it committed, so two calls never both return true for the same or a
//! lower position.

use crate::clock::{expiry, later, statement_now};
use crate::errors::{internal, raise};
use crate::inbox::{self, Access, Inbox};
use crate::input;
use crate::plans::{statements, Plans};
use crate::rights;
use crate::shmem::Counter;
use pgrx::prelude::*;
use pgrx::spi::SpiTupleTable;

statements! {
    /// $1 inbox, $2 key → (position, expires_at) of the key's row visible now.
    Read,
    /// $1 inbox, $2 key, $3 position, $4 expires_at, $5 now → a row if the position was stored.
    Upsert,
    /// $1 inbox, $2 now, $3 batch size → deletes up to that many expired positions, skipping held rows.
    PurgeBatch,
}

impl Stmt {
    fn sql(self) -> &'static str {
        match self {
            Stmt::Read => {
                "SELECT position, expires_at FROM dedup.positions \
                 WHERE inbox OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2"
            }
            Stmt::Upsert => {
                "INSERT INTO dedup.positions AS p (inbox, key, position, expires_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (inbox, key) DO UPDATE SET position = excluded.position, expires_at = excluded.expires_at \
                 WHERE p.position OPERATOR(pg_catalog.<) excluded.position OR p.expires_at OPERATOR(pg_catalog.<=) $5 \
                 RETURNING true"
            }
            // Ordered, so the cached generic plan scans the (inbox, expires_at) index: see the inbox's purge.
            Stmt::PurgeBatch => {
                "DELETE FROM dedup.positions WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT ctid \
                 FROM dedup.positions WHERE inbox OPERATOR(pg_catalog.=) $1 AND expires_at OPERATOR(pg_catalog.<=) $2 \
                 ORDER BY expires_at LIMIT $3 FOR UPDATE SKIP LOCKED))"
            }
        }
    }

    fn arg_types(self) -> Vec<PgOid> {
        use pgrx::pg_sys::BuiltinOid::*;
        let oids = match self {
            Stmt::Read => vec![TEXTOID, TEXTOID],
            Stmt::Upsert => vec![TEXTOID, TEXTOID, INT8OID, TIMESTAMPTZOID, TIMESTAMPTZOID],
            Stmt::PurgeBatch => vec![TEXTOID, TIMESTAMPTZOID, INT8OID],
        };
        oids.into_iter().map(PgOid::BuiltIn).collect()
    }
}

thread_local! {
    static PLANS: Plans<{ Stmt::COUNT }> = Plans::default();
}

/// Runs `stmt` as the extension's owner (the caller's rights on the inbox were checked when it was opened).
fn run<R>(function: &str, stmt: Stmt, args: &[pgrx::datum::DatumWithOid<'_>], f: impl FnOnce(SpiTupleTable) -> R) -> R {
    rights::as_extension_owner(function, || {
        Spi::connect(|client| {
            PLANS.with(|plans| {
                let plan = plans.get(client, stmt as usize, || stmt.sql().to_owned(), || stmt.arg_types());
                f(client.select(plan, None, args).unwrap_or_else(|e| internal("running a positions statement", e)))
            })
        })
    })
}

/// The position of `key` in `inbox` and when it expires, as this transaction sees it now.
fn stored(function: &str, inbox: &Inbox, key: &str) -> Option<(i64, TimestampWithTimeZone)> {
    run(function, Stmt::Read, &[inbox.name.as_str().into(), key.into()], |rows| {
        let row = rows.into_iter().next()?;
        Some((row.get(1).ok().flatten()?, row.get(2).ok().flatten()?))
    })
}

/// Stores `position` for `key` if it is beyond the stored one (or there is none live): true if it did.
pub fn advance_key(inbox: &Inbox, key: &str, position: i64, ttl: Option<Interval>) -> bool {
    let now = statement_now();
    let ahead = match stored("advance", inbox, key) {
        Some((current, expires_at)) if later(expires_at, now) && current >= position => false,
        _ => {
            let expires_at = expiry(now, ttl.unwrap_or_else(|| inbox.default_ttl()));
            let args = [inbox.name.as_str().into(), key.into(), position.into(), expires_at.into(), now.into()];
            run("advance", Stmt::Upsert, &args, |rows| !rows.is_empty())
        }
    };
    inbox.count(if ahead { Counter::Advances } else { Counter::StaleAdvances }, 1);
    ahead
}

/// The live position of `key` in `inbox`, None if it has none.
pub fn position_of(inbox: &Inbox, key: &str) -> Option<i64> {
    let now = statement_now();
    stored("position", inbox, key).filter(|(_, expires_at)| later(*expires_at, now)).map(|(position, _)| position)
}

/// Deletes up to `limit` positions of `inbox` that expired before `now`, skipping rows another transaction holds;
/// returns how many.
pub fn purge_batch(inbox: &Inbox, now: TimestampWithTimeZone, limit: i64) -> i64 {
    let args = [inbox.name.as_str().into(), now.into(), limit.into()];
    run("purge", Stmt::PurgeBatch, &args, |rows| rows.len() as i64)
}

/// Deletes every position of inbox `name`, which is being dropped (for `drop_inbox()`, which runs it as the
/// extension's owner).
pub fn forget_inbox(name: &str) {
    Spi::run_with_args("DELETE FROM dedup.positions WHERE inbox OPERATOR(pg_catalog.=) $1", &[name.into()])
        .unwrap_or_else(|e| internal("deleting the inbox's positions", e));
}

/// Stores `position` as the position of `key` in `inbox` if it is beyond the stored one (or the key has none live):
/// true then; false for a stale or repeated position, which changes nothing. The position lives `ttl` (NULL: the
/// inbox's default) after this advance.
#[pg_extern(volatile, parallel_unsafe)]
fn advance(
    key: Option<&str>,
    position: Option<i64>,
    inbox: default!(Option<&str>, "'default'"),
    ttl: default!(Option<Interval>, "NULL"),
) -> bool {
    input::require_writable("advance");
    crate::citus::refuse_task_on_node_state("advance()");
    let key = input::key(key);
    let position = position.unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "position must not be NULL",
            "Pass the event's position in its key's stream (a version or sequence number).",
        )
    });
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    advance_key(&inbox, key, position, ttl)
}

/// The live position of `key` in `inbox`; NULL when it has none (never advanced, or expired).
#[pg_extern(stable, parallel_restricted)]
fn position(key: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> Option<i64> {
    crate::citus::refuse_task_on_node_state("position()");
    let key = input::key(key);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Read);
    position_of(&inbox, key)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    fn advance(key: &str, position: i64) -> bool {
        one::<bool>(&format!("SELECT dedup.advance('{key}', {position})"))
    }

    fn position(key: &str) -> Option<i64> {
        Spi::get_one::<i64>(&format!("SELECT dedup.position('{key}')")).expect("position()")
    }

    #[pg_test]
    fn positions_only_move_forward() {
        run("SELECT dedup.create_inbox('pos_forward')");
        let advance = |key: &str, position: i64| {
            one::<bool>(&format!("SELECT dedup.advance('{key}', {position}, 'pos_forward')"))
        };
        let position = |key: &str| {
            Spi::get_one::<i64>(&format!("SELECT dedup.position('{key}', 'pos_forward')")).expect("position()")
        };
        assert_eq!(position("p1"), None, "never advanced");
        assert!(advance("p1", 3));
        assert!(!advance("p1", 3), "a repeated event");
        assert!(!advance("p1", 2), "a stale event");
        assert!(advance("p1", 10));
        assert_eq!(position("p1"), Some(10));
        assert!(advance("p2", -5), "any bigint is a position");
        assert_eq!(
            one::<String>(
                "SELECT format('%s %s', advances, stale_advances) FROM dedup.stats WHERE inbox = 'pos_forward'"
            ),
            "3 2"
        );
    }

    #[pg_test]
    fn positions_a_rolled_back_advance_leaves_the_old_position() {
        assert!(advance("p3", 1));
        rolled_back(|| assert!(advance("p3", 7)));
        assert_eq!(position("p3"), Some(1));
        assert!(advance("p3", 2));
    }

    #[pg_test]
    fn positions_expire_ttl_after_the_last_advance() {
        run("SELECT dedup.create_inbox('pos_ttl', '2 days')");
        assert!(one::<bool>("SELECT dedup.advance('k', 5, 'pos_ttl')"));
        assert!(one::<bool>("SELECT dedup.advance('k', 6, 'pos_ttl', '1 hour')"));
        assert!(one::<bool>(
            "SELECT expires_at = statement_timestamp() + interval '1 hour' FROM dedup.positions WHERE inbox = 'pos_ttl'"
        ));
        run("UPDATE dedup.positions SET expires_at = now() - interval '1 second' WHERE inbox = 'pos_ttl'");
        assert_eq!(Spi::get_one::<i64>("SELECT dedup.position('k', 'pos_ttl')").unwrap(), None, "expired: none");
        assert!(one::<bool>("SELECT dedup.advance('k', 1, 'pos_ttl')"), "an expired position is no position");
        assert_eq!(one::<i64>("SELECT dedup.position('k', 'pos_ttl')"), 1);
        run("UPDATE dedup.positions SET expires_at = now() - interval '1 second' WHERE inbox = 'pos_ttl'");
        assert_eq!(one::<i64>("SELECT dedup.purge('pos_ttl')"), 1, "purge() takes expired positions too");
        assert_eq!(count("dedup.positions WHERE inbox = 'pos_ttl'"), 0);
    }

    #[pg_test]
    fn positions_and_marks_of_one_inbox_never_meet() {
        assert!(one::<bool>("SELECT dedup.mark('same')"));
        assert!(advance("same", 1), "a key with the text of a marked id has no position");
        assert!(one::<bool>("SELECT dedup.seen('same')"));
        assert!(one::<bool>("SELECT dedup.forget('same')"));
        assert_eq!(position("same"), Some(1), "forget() is for marks");
        run("SELECT dedup.create_inbox('pos_other')");
        assert_eq!(Spi::get_one::<i64>("SELECT dedup.position('same', 'pos_other')").unwrap(), None, "per inbox");
    }

    #[pg_test]
    fn positions_go_with_their_inbox() {
        run("SELECT dedup.create_inbox('pos_gone'); SELECT dedup.advance('k', 1, 'pos_gone')");
        run("SELECT dedup.drop_inbox('pos_gone')");
        assert_eq!(count("dedup.positions WHERE inbox = 'pos_gone'"), 0);
    }

    #[pg_test]
    fn positions_follow_the_callers_rights_on_the_inbox() {
        run("CREATE ROLE pos_reader; GRANT USAGE ON SCHEMA dedup TO pos_reader;
             GRANT SELECT ON dedup.inbox_registry TO pos_reader;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dedup TO pos_reader;
             GRANT SELECT ON dedup.inbox_default TO pos_reader;
             SELECT dedup.advance('pr', 4)");
        run("SET LOCAL ROLE pos_reader");
        assert_eq!(position("pr"), Some(4), "SELECT on the inbox's table is enough to read");
        assert_dedup_error("SELECT dedup.advance('pr', 5)", PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
        let (code, _) = error_of("SELECT * FROM dedup.positions");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE, "the table itself is not theirs");
        run("RESET ROLE");
    }

    #[pg_test]
    fn positions_bad_input_gets_a_dedup_error() {
        assert_dedup_error("SELECT dedup.advance(NULL, 1)", PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT dedup.advance('k', NULL)", PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED);
        assert_dedup_error("SELECT dedup.advance('', 1)", PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE);
        assert_dedup_error("SELECT dedup.advance('k', 1, 'nope')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
        assert_dedup_error(
            "SELECT dedup.advance('k', 1, 'default', '-1 day')",
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
        );
        assert_dedup_error("SELECT dedup.position(repeat('x', 3000))", PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED);
    }
}
