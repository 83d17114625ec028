//! `dedup.attach()` (docs/ingest.md): deduplicating every row inserted into a table — INSERT, multi-row VALUES,
//! INSERT ... SELECT, COPY FROM, logical replication's apply — by a key computed from the row, marked in an inbox in
//! the inserting transaction. A duplicate row is dropped (`on_duplicate => 'skip'`: the statement goes on without
//! it) or refused (`'error'`).
//!
//! How: a BEFORE INSERT row trigger, `zz_dedup_attached` (`row_trigger`), enabled ALWAYS so that it also fires
//! under `session_replication_role = replica` (logical replication, some restores). Its name sorts after the
//! usual names of triggers, and BEFORE triggers fire in name order: the key is computed from the row as the other
//! BEFORE triggers left it, and a trigger that drops the row fires before ours has marked anything. On a
//! partitioned table the trigger is cloned onto every partition, present and future. Its WHEN clause names the key
//! (and is always true): so PostgreSQL records what the key depends on, as for an index expression, and refuses to
//! drop a function or column the key uses (`key`).
//!
//! Attachments are rows of `dedup.attachment_registry` (`registry`), written by the extension's owner: `attach()`
//! and `detach()` check their caller (the table's owner, who must also be allowed to mark in the inbox) and then
//! act as that owner. The trigger finds its attachment by table, never by its arguments, so a trigger someone
//! creates by hand with our function cannot point it at another inbox; and it marks with the rights of the role
//! inserting the row, who needs what `mark()` needs on the inbox's table. An attachment lives as long as its
//! trigger: `watch_drop`, an event trigger, removes it when a DROP takes the table or the trigger, and every
//! `attach()`, `detach()` and `drop_inbox()` prunes attachments whose table went some other way.

mod batch;
mod key;
mod registry;
mod row_trigger;

pub use batch::{flush as flush_batch, forget as forget_batch, holds as batch_holds};

use crate::errors::{internal, raise};
use crate::inbox::{self, Access};
use crate::{catalog, guc, input, ports, rights};
use pgrx::prelude::*;

/// The trigger's name (see the module comment for why it sorts last).
pub const TRIGGER: &str = "zz_dedup_attached";

/// The statement trigger of a batched attachment (`batch`), which flushes the statement's keys.
const BATCH_TRIGGER: &str = "zz_dedup_attached_batch";

/// What happens to a row whose key was already marked.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnDuplicate {
    Skip,
    Error,
}

impl OnDuplicate {
    fn parse(value: Option<&str>) -> OnDuplicate {
        match value {
            Some("skip") => OnDuplicate::Skip,
            Some("error") => OnDuplicate::Error,
            other => raise(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!(
                    "on_duplicate must be 'skip' or 'error', got {}",
                    other.map_or("NULL".into(), |v| format!("'{v}'"))
                ),
                "'skip' drops a duplicate row and goes on; 'error' raises an error naming its key.",
            ),
        }
    }

    fn label(self) -> &'static str {
        match self {
            OnDuplicate::Skip => "skip",
            OnDuplicate::Error => "error",
        }
    }
}

/// Why `attach()` or `detach()` opens a table: a temporary table may be detached (an attachment pg_dedup 0.3.0
/// let through), never attached.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Attach,
    Detach,
}

impl Purpose {
    fn function(self) -> &'static str {
        match self {
            Purpose::Attach => "attach",
            Purpose::Detach => "detach",
        }
    }
}

/// Refuses what `attach()` or `detach()` must not touch, from the table's pg_class row: not a table, a system
/// catalog, one of pg_dedup's own, a temporary table (for attach), or one the caller does not own. Decided before any
/// lock is taken, as ALTER TABLE and LOCK TABLE do, so that a refused caller returns at once instead of queueing a
/// lock behind the table's writers (and every later writer behind that lock); and again once the table is locked,
/// as what the row says may have changed meanwhile. Returns the table's qualified name.
fn check_table(purpose: Purpose, relid: pg_sys::Oid) -> String {
    let function = purpose.function();
    let Some(class) = catalog::class(relid) else {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!("relation with OID {} does not exist", relid.to_u32()),
            "dedup.attachments lists the attached tables.",
        )
    };
    let name = catalog::qualified_name(relid).unwrap_or_else(|| internal("naming the table", "it has no name"));
    if class.kind != pg_sys::RELKIND_RELATION && class.kind != pg_sys::RELKIND_PARTITIONED_TABLE {
        let what = match class.kind {
            pg_sys::RELKIND_VIEW => "a view",
            pg_sys::RELKIND_FOREIGN_TABLE => "a foreign table",
            pg_sys::RELKIND_MATVIEW => "a materialized view",
            _ => "not a table",
        };
        raise(
            PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE,
            format!("{name} is {what}; {function}() works on tables and partitioned tables"),
            "Attach the table the rows are inserted into (for a partitioned table, its parent).",
        )
    }
    // SAFETY: namespace tests by oid.
    if unsafe { pg_sys::IsCatalogNamespace(class.namespace) || pg_sys::IsToastNamespace(class.namespace) } {
        raise(
            PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE,
            format!("{name} is a system catalog; {function}() works on the tables of applications"),
            "Attach the tables your rows are inserted into.",
        )
    }
    if class.namespace == catalog::dedup_namespace() {
        raise(
            PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE,
            format!("{name} is one of pg_dedup's own tables"),
            "Attach the tables your rows are inserted into; inbox tables are deduplicated by their primary key.",
        )
    }
    // SAFETY: a syscache lookup by oid.
    if purpose == Purpose::Attach && unsafe { pg_sys::get_rel_relispartition(relid) } {
        raise(
            PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE,
            format!("{name} is a partition; attach() works on the partitioned table at the top of its tree"),
            "Attach the partitioned table: its partitions, present and future, are covered (a partition attached on \
             its own would take a row an UPDATE moves into it for a duplicate of itself).",
        )
    }
    if purpose == Purpose::Attach && class.persistence == pg_sys::RELPERSISTENCE_TEMP {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!("{name} is a temporary table; attach() works on permanent and unlogged tables"),
            "A temporary table goes at the end of its session (or transaction) without a DROP that pg_dedup could \
             follow; deduplicate its rows with dedup.mark_many() instead, or attach a permanent table.",
        )
    }
    if !ports::owns_relation(rights::caller(), relid) {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!("must be owner of table {name} to {function}() it"),
            "Ask the table's owner (or a superuser) to do it.",
        )
    }
    // The trigger goes onto every partition too, which CREATE TRIGGER allows only with TRIGGER on each (the
    // extension's owner, which creates it, would skip that check).
    if purpose == Purpose::Attach && class.kind == pg_sys::RELKIND_PARTITIONED_TABLE {
        let refused: Option<String> = Spi::get_one_with_args(
            "SELECT pg_catalog.string_agg(t.relid::pg_catalog.regclass::pg_catalog.text, ', ')
               FROM pg_catalog.pg_partition_tree($1) t
              WHERE t.relid OPERATOR(pg_catalog.<>) $1
                AND NOT pg_catalog.has_table_privilege($2, t.relid, 'TRIGGER')",
            &[relid.into(), rights::caller().into()],
        )
        .unwrap_or_else(|e| internal("checking the partitions' privileges", e));
        if let Some(refused) = refused {
            raise(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!("permission denied to attach {name}: its trigger would go onto partitions {refused}"),
                "The caller needs TRIGGER on every partition (their owners have it), as CREATE TRIGGER on the \
                 partitioned table requires.",
            )
        }
    }
    name
}

/// Opens table `relid` for attach() or detach(), locked as CREATE TRIGGER locks it, once `check_table` lets the
/// caller in (before the lock and again after it). Returns it with its name.
fn open_table(purpose: Purpose, relid: pg_sys::Oid) -> (pg_sys::Relation, String) {
    check_table(purpose, relid);
    // SAFETY: opens (and locks, until the transaction ends) a relation by oid; NULL if it went while we waited.
    let rel = unsafe { pg_sys::try_relation_open(relid, pg_sys::ShareRowExclusiveLock as pg_sys::LOCKMODE) };
    if rel.is_null() {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!("relation with OID {} was dropped while {}() waited for it", relid.to_u32(), purpose.function()),
            "Nothing was changed.",
        )
    }
    (rel, check_table(purpose, relid))
}

fn required_table(function: &str, tbl: Option<pg_sys::Oid>) -> pg_sys::Oid {
    tbl.unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "tbl must not be NULL",
            format!("Pass the table, e.g. dedup.{function}('public.events')."),
        )
    })
}

/// Deduplicates the rows inserted into `tbl` by `key`, an SQL expression over its columns, marked in `inbox` for
/// `ttl` (NULL: the inbox's default). A duplicate row is dropped (`'skip'`) or refused (`'error'`). Attaching an
/// attached table again replaces its attachment.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = "
    CREATE FUNCTION dedup.attach(tbl regclass, key text, ttl interval DEFAULT NULL, inbox text DEFAULT 'default',
                                 on_duplicate text DEFAULT 'skip') RETURNS void
    VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'attach_wrapper';
"
)]
fn attach(
    tbl: Option<pg_sys::Oid>,
    key: Option<&str>,
    ttl: Option<Interval>,
    inbox: Option<&str>,
    on_duplicate: Option<&str>,
) {
    attach_table("attach", tbl, key, ttl, inbox, on_duplicate, false);
}

/// `attach()`, batched (`batch`, docs/ingest.md, "The bulk road"): keys the filter vouches for wait in memory and go
/// into the inbox together, sorted, at the statement's end. Its one difference: a concurrent loader of the same key
/// makes a statement fail with serialization_failure instead of making the row wait.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = "
    CREATE FUNCTION dedup.attach_batched(tbl regclass, key text, ttl interval DEFAULT NULL,
                                         inbox text DEFAULT 'default', on_duplicate text DEFAULT 'skip') RETURNS void
    VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'attach_batched_wrapper';
"
)]
fn attach_batched(
    tbl: Option<pg_sys::Oid>,
    key: Option<&str>,
    ttl: Option<Interval>,
    inbox: Option<&str>,
    on_duplicate: Option<&str>,
) {
    attach_table("attach_batched", tbl, key, ttl, inbox, on_duplicate, true);
}

fn attach_table(
    function: &str,
    tbl: Option<pg_sys::Oid>,
    key: Option<&str>,
    ttl: Option<Interval>,
    inbox: Option<&str>,
    on_duplicate: Option<&str>,
    batched: bool,
) {
    input::require_writable(function);
    let relid = required_table(function, tbl);
    let key = key.unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "key must not be NULL",
            "Pass an SQL expression over the table's columns, e.g. 'event_id'.",
        )
    });
    let ttl = ttl.map(input::ttl);
    let inbox_name = input::inbox_name(inbox);
    let on_duplicate = OnDuplicate::parse(on_duplicate);
    let (rel, table) = open_table(Purpose::Attach, relid);
    // The caller must be allowed to mark in the inbox, as the rows' inserters will have to be.
    inbox::open(inbox_name, Access::Mark);
    // SAFETY: the relation is open and locked.
    let key = unsafe {
        let key = key::canonical(rel, key, &table);
        pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        key
    };
    registry::prune();
    rights::as_extension_owner("attach", || {
        Spi::connect_mut(|client| {
            let related: Option<String> = client
                .select(
                    "SELECT a.tbl::pg_catalog.text FROM dedup.attachment_registry a \
                      WHERE a.tbl OPERATOR(pg_catalog.<>) $1 \
                        AND (a.tbl IN (SELECT relid FROM pg_catalog.pg_partition_ancestors($1)) \
                             OR a.tbl IN (SELECT relid FROM pg_catalog.pg_partition_tree($1))) LIMIT 1",
                    None,
                    &[relid.into()],
                )
                .unwrap_or_else(|e| internal("reading dedup.attachment_registry", e))
                .first()
                .get_one()
                .unwrap_or_default();
            if let Some(related) = related {
                raise(
                    PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                    format!("{table} is a partition or a parent of {related}, which is attached already"),
                    "Attach only the partitioned table at the top: its partitions are covered. Detach the other first.",
                )
            }
            for name in [TRIGGER, BATCH_TRIGGER] {
                if registry::foreign_trigger(relid, name) {
                    raise(
                        PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT,
                        format!("{table} has a trigger named {name} that is not pg_dedup's"),
                        format!("Rename or drop that trigger first (ALTER TRIGGER {name} ON {table} RENAME TO ...)."),
                    )
                }
            }
            // Re-created even when it exists: every backend's compiled key for the table goes with the relcache
            // invalidation this causes (also on each partition, whose clone is re-created too). Before the registry
            // row is written: dropping the old trigger prunes the old row (`watch_drop`). UPDATE and DELETE: see
            // `row_trigger::Moving`.
            // A batched attachment's statement trigger fires on the table the statement names (PostgreSQL clones
            // no statement trigger onto partitions): rows inserted into a partition directly are flushed by the
            // next use of the inbox or the commit (`batch`).
            let mut ddl = format!(
                "DROP TRIGGER IF EXISTS {TRIGGER} ON {table}; DROP TRIGGER IF EXISTS {BATCH_TRIGGER} ON {table}; \
                 CREATE TRIGGER {TRIGGER} BEFORE INSERT OR UPDATE OR DELETE ON {table} FOR EACH ROW \
                   EXECUTE FUNCTION dedup.attached_insert(); \
                 ALTER TABLE {table} ENABLE ALWAYS TRIGGER {TRIGGER}"
            );
            if batched {
                ddl += &format!(
                    "; CREATE TRIGGER {BATCH_TRIGGER} AFTER INSERT ON {table} FOR EACH STATEMENT \
                       EXECUTE FUNCTION dedup.attached_insert(); \
                     ALTER TABLE {table} ENABLE ALWAYS TRIGGER {BATCH_TRIGGER}"
                );
            }
            // (Without "trigger ... does not exist, skipping" for a first attach.)
            guc::with_setting(c"client_min_messages", c"warning", || {
                client.update(&ddl, None, &[]).unwrap_or_else(|e| internal("creating the attachment's trigger", e))
            });
            let args = [
                relid.into(),
                key.text.as_str().into(),
                inbox_name.into(),
                ttl.into(),
                on_duplicate.label().into(),
                batched.into(),
            ];
            client
                .update(
                    "INSERT INTO dedup.attachment_registry (tbl, key, inbox, ttl, on_duplicate, batched) \
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tbl) DO UPDATE SET key = excluded.key, \
                     inbox = excluded.inbox, ttl = excluded.ttl, on_duplicate = excluded.on_duplicate, \
                     batched = excluded.batched",
                    None,
                    &args,
                )
                .unwrap_or_else(|e| internal("registering the attachment", e));
            // SAFETY: the trigger was just created on the locked table; the expression was analysed against it.
            unsafe { key::record_dependencies(relid, &key, &table) };
        })
    });
}

/// Stops deduplicating the inserts of `tbl`: its trigger and its attachment go (the marks stay in the inbox). The
/// attachment of a table that is gone is removed too.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = "
    CREATE FUNCTION dedup.detach(tbl regclass) RETURNS void
    VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'detach_wrapper';
"
)]
fn detach(tbl: Option<pg_sys::Oid>) {
    input::require_writable("detach");
    let relid = required_table("detach", tbl);
    // A table that is gone has nobody left to protect: whatever its attachment was, it is pruned now.
    if catalog::class(relid).is_none() && registry::prune().contains(&relid) {
        return;
    }
    let (rel, table) = open_table(Purpose::Detach, relid);
    // SAFETY: closes what open_table opened, keeping the lock.
    unsafe { pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE) };
    rights::as_extension_owner("detach", || {
        Spi::connect_mut(|client| {
            let removed = client
                .update(
                    "DELETE FROM dedup.attachment_registry WHERE tbl OPERATOR(pg_catalog.=) $1 RETURNING true",
                    None,
                    &[relid.into()],
                )
                .unwrap_or_else(|e| internal("removing the attachment", e))
                .len();
            if removed == 0 {
                raise(
                    PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
                    format!("{table} is not attached"),
                    "dedup.attachments lists the attached tables.",
                )
            }
            client
                .update(
                    &format!("DROP TRIGGER IF EXISTS {TRIGGER} ON {table}; DROP TRIGGER IF EXISTS {BATCH_TRIGGER} ON {table}"),
                    None,
                    &[],
                )
                .unwrap_or_else(|e| internal("dropping the attachment's trigger", e));
        })
    });
}

/// The event trigger `dedup_watch_drop` (sql_drop): when a DROP took relations or triggers, the attachments left
/// without their table or trigger go (`registry::prune`, which needs no privilege and switches no role, so that
/// nobody's DDL fails because of it, in a security-restricted operation too). Any other drop returns at once.
#[pg_extern(sql = "
    CREATE FUNCTION dedup.watch_drop() RETURNS event_trigger LANGUAGE c
    AS 'MODULE_PATHNAME', 'watch_drop_wrapper';
")]
fn watch_drop(_fcinfo: pg_sys::FunctionCallInfo) {
    let relevant = Spi::connect(|client| {
        !client
            .select(
                "SELECT 1 FROM pg_catalog.pg_event_trigger_dropped_objects() \
                  WHERE classid OPERATOR(pg_catalog.=) ANY \
                        (ARRAY['pg_catalog.pg_class'::pg_catalog.regclass, 'pg_catalog.pg_trigger'::pg_catalog.regclass]) \
                  LIMIT 1",
                None,
                &[],
            )
            .unwrap_or_else(|e| internal("listing dropped objects", e))
            .is_empty()
    });
    // DROP EXTENSION pg_dedup (or DROP SCHEMA dedup CASCADE) drops the registry itself: nothing left to clean.
    if relevant && catalog::dedup_relation(c"attachment_registry") != pg_sys::InvalidOid {
        registry::prune();
    }
}

/// Refuses to drop inbox `name` while attached tables keep their keys in it (for `drop_inbox()`), once stale
/// attachments are pruned.
pub fn refuse_to_drop_inbox(name: &str) {
    registry::prune();
    let mut tables: Vec<String> = registry::all()
        .into_iter()
        .filter(|a| a.inbox == name)
        .map(|a| catalog::qualified_name(a.tbl).unwrap_or_else(|| a.tbl.to_u32().to_string()))
        .collect();
    if !tables.is_empty() {
        tables.sort();
        raise(
            PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
            format!("inbox \"{name}\" holds the keys of attached tables: {}", tables.join(", ")),
            "Detach them first with dedup.detach(), or attach them to another inbox.",
        )
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    fn events(name: &str) {
        run(&format!("CREATE TABLE {name} (event_id text, source text, n int, payload jsonb)"));
    }

    #[pg_test]
    fn attach_drops_duplicate_rows_of_every_insert() {
        events("att_rows");
        run("SELECT dedup.create_inbox('att_rows'); SELECT dedup.attach('att_rows', 'event_id', inbox => 'att_rows')");
        run("INSERT INTO att_rows (event_id, n) VALUES ('e1', 1)");
        run("INSERT INTO att_rows (event_id, n) VALUES ('e1', 2), ('e2', 3), ('e2', 4)");
        assert_eq!(
            column("SELECT event_id || n FROM att_rows ORDER BY n"),
            ["e11", "e23"],
            "repeats in one statement too"
        );
        let returned = column("INSERT INTO att_rows (event_id, n) VALUES ('e3', 5), ('e1', 6) RETURNING n::text");
        assert_eq!(returned, ["5"], "RETURNING leaves the dropped row out");
        run("INSERT INTO att_rows (event_id, n) SELECT 'e' || g, g FROM generate_series(1, 10) g");
        assert_eq!(count("att_rows"), 10, "e1..e3 were in already");
        rolled_back(|| run("INSERT INTO att_rows (event_id) VALUES ('e-rolled-back')"));
        assert!(!one::<bool>("SELECT dedup.seen('e-rolled-back', 'att_rows')"), "a rolled-back row leaves no mark");
        assert_eq!(
            one::<String>(
                "SELECT format('%s %s', rows_passed, rows_dropped) FROM dedup.stats WHERE inbox = 'att_rows'"
            ),
            "11 6"
        );
    }

    /// A key repeated further on in a load is read where this transaction wrote its mark (`direct::own_row`), not
    /// looked up through the inbox's primary key; a mark gone meanwhile lets the row through again.
    #[pg_test]
    fn attach_a_key_repeated_in_a_load_is_read_where_its_mark_went() {
        events("att_rep");
        run("SELECT dedup.create_inbox('att_rep'); SELECT dedup.attach('att_rep', 'event_id', inbox => 'att_rep')");
        let scans = "SELECT pg_stat_get_xact_numscans('dedup.inbox_att_rep_pkey'::regclass)";
        let before = one::<i64>(scans);
        run("INSERT INTO att_rep (event_id, n) SELECT 'r' || (g % 50), g FROM generate_series(1, 200) g");
        assert_eq!(count("att_rep"), 50, "each key once");
        assert_eq!(one::<i64>(scans), before, "150 repeats, no index scan");
        run("SELECT dedup.forget('r7', 'att_rep'); DELETE FROM dedup.inbox_att_rep WHERE id = 'r8'");
        run("INSERT INTO att_rep (event_id, n) VALUES ('r7', 1000), ('r8', 1001), ('r9', 1002), ('r7', 1003)");
        assert_eq!(
            column("SELECT n::text FROM att_rep WHERE n >= 1000 ORDER BY n"),
            ["1000", "1001"],
            "a forgotten and a deleted mark let their keys through once more"
        );
    }

    #[pg_test]
    fn attach_on_duplicate_error_names_the_key() {
        events("att_err");
        run("SELECT dedup.create_inbox('att_err'); SELECT dedup.attach('att_err', 'event_id', '1 hour', 'att_err', 'error')");
        run("INSERT INTO att_err (event_id) VALUES ('x1')");
        let (code, message) = error_of("INSERT INTO att_err (event_id) VALUES ('x2'), ('x1')");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION);
        assert!(message.starts_with("dedup: duplicate row for public.att_err: key \"x1\""), "{message}");
        assert_eq!(count("att_err"), 1, "the statement failed whole");
        assert!(one::<bool>(
            "SELECT expires_at = statement_timestamp() + interval '1 hour' FROM dedup.inbox_att_err WHERE id = 'x1'"
        ));
    }

    #[pg_test]
    fn attach_keys_are_expressions_over_the_row() {
        events("att_expr");
        run("SELECT dedup.attach('att_expr', 'source || '':'' || event_id')");
        run("INSERT INTO att_expr (event_id, source) VALUES ('1', 'a'), ('1', 'b'), ('1', 'a')");
        assert_eq!(count("att_expr"), 2);
        assert!(one::<bool>("SELECT dedup.seen('b:1')"));
        events("att_content");
        run("SELECT dedup.attach('att_content', 'dedup.fingerprint(payload)')");
        run(r#"INSERT INTO att_content (payload) VALUES ('{"a": 1, "b": 2}'), ('{"b": 2, "a": 1}'), ('{"a": 2}')"#);
        assert_eq!(count("att_content"), 2, "the same content in another key order is a duplicate");
        assert_dedup_error(
            "INSERT INTO att_content (payload) VALUES (NULL)",
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
        );
    }

    #[pg_test]
    fn attach_stores_the_key_as_postgres_prints_it_and_it_means_the_same_on_any_search_path() {
        run("CREATE SCHEMA att_fns;
             CREATE FUNCTION att_fns.norm(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT lower(t)';
             SET LOCAL search_path = att_fns, public;
             CREATE TABLE public.att_path (event_id text, source text);
             SELECT dedup.attach('public.att_path', 'norm(source) || '':'' || event_id')");
        assert_eq!(
            one::<String>("SELECT key FROM dedup.attachments"),
            "((att_fns.norm(source) || ':'::text) || event_id)"
        );
        run("SET LOCAL search_path = ''");
        run("INSERT INTO public.att_path VALUES ('1', 'A'), ('1', 'a')");
        assert_eq!(count("public.att_path"), 1, "the same function, wherever the session looks for names");
    }

    #[pg_test]
    fn attach_refuses_what_it_cannot_dedup() {
        events("att_bad");
        run("CREATE VIEW att_view AS SELECT * FROM att_bad");
        use PgSqlErrorCode::*;
        for (sql, code) in [
            ("SELECT dedup.attach('att_view', 'event_id')", ERRCODE_WRONG_OBJECT_TYPE),
            ("SELECT dedup.attach('dedup.inbox_default', 'id')", ERRCODE_WRONG_OBJECT_TYPE),
            ("SELECT dedup.attach('att_bad', 'evnt_id')", ERRCODE_UNDEFINED_COLUMN),
            ("SELECT dedup.attach('att_bad', 'n')", ERRCODE_INVALID_PARAMETER_VALUE),
            ("SELECT dedup.attach('att_bad', 'event_id || random()::text')", ERRCODE_INVALID_PARAMETER_VALUE),
            ("SELECT dedup.attach('att_bad', '(SELECT event_id)')", ERRCODE_FEATURE_NOT_SUPPORTED),
            ("SELECT dedup.attach('att_bad', 'event_id, source')", ERRCODE_INVALID_PARAMETER_VALUE),
            ("SELECT dedup.attach('att_bad', 'event_id FROM att_bad')", ERRCODE_INVALID_PARAMETER_VALUE),
            ("SELECT dedup.attach('att_bad', 'event_id); DROP TABLE att_bad; --')", ERRCODE_SYNTAX_ERROR),
            ("SELECT dedup.attach('att_bad', NULL)", ERRCODE_NULL_VALUE_NOT_ALLOWED),
            ("SELECT dedup.attach(NULL, 'event_id')", ERRCODE_NULL_VALUE_NOT_ALLOWED),
            ("SELECT dedup.attach('att_bad', 'event_id', on_duplicate => 'ignore')", ERRCODE_INVALID_PARAMETER_VALUE),
            ("SELECT dedup.attach('att_bad', 'event_id', inbox => 'nope')", ERRCODE_UNDEFINED_OBJECT),
            ("SELECT dedup.detach('att_bad')", ERRCODE_UNDEFINED_OBJECT),
        ] {
            assert_dedup_error(sql, code);
        }
        assert_eq!(count("dedup.attachments"), 0, "nothing was attached");
        assert_eq!(count("att_bad"), 0);
    }

    #[pg_test]
    fn attach_only_the_tables_owner_may() {
        events("att_owned");
        run("CREATE ROLE att_stranger; GRANT USAGE ON SCHEMA dedup TO att_stranger;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dedup TO att_stranger;
             GRANT SELECT ON dedup.inbox_registry TO att_stranger;
             GRANT SELECT, INSERT, UPDATE ON dedup.inbox_default TO att_stranger;
             GRANT INSERT, SELECT ON att_owned TO att_stranger");
        run("SET LOCAL ROLE att_stranger");
        assert_dedup_error(
            "SELECT dedup.attach('att_owned', 'event_id')",
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        );
        run("RESET ROLE");
        run("SELECT dedup.attach('att_owned', 'event_id')");
        run("SET LOCAL ROLE att_stranger");
        assert_dedup_error("SELECT dedup.detach('att_owned')", PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
        run("INSERT INTO att_owned (event_id) VALUES ('s1'), ('s1')");
        assert_eq!(count("att_owned"), 1, "an inserter with rights on the inbox is deduplicated");
        run("RESET ROLE");
        run("REVOKE INSERT, UPDATE ON dedup.inbox_default FROM att_stranger; SET LOCAL ROLE att_stranger");
        let (code, message) = error_of("INSERT INTO att_owned (event_id) VALUES ('s2')");
        run("RESET ROLE");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE, "{message}");
        // A trigger made by hand with our function finds no attachment: it cannot aim at another inbox.
        events("att_forged");
        run("CREATE TRIGGER forged BEFORE INSERT ON att_forged FOR EACH ROW EXECUTE FUNCTION dedup.attached_insert('default')");
        assert_dedup_error(
            "INSERT INTO att_forged (event_id) VALUES ('f')",
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        );
    }

    #[pg_test]
    fn attach_a_partitioned_table_covers_every_partition() {
        run("CREATE TABLE att_parts (event_id text, day int) PARTITION BY RANGE (day);
             CREATE TABLE att_parts_1 PARTITION OF att_parts FOR VALUES FROM (1) TO (2);
             SELECT dedup.attach('att_parts', 'event_id');
             CREATE TABLE att_parts_2 (day int, extra text, event_id text);
             ALTER TABLE att_parts_2 DROP COLUMN extra;
             ALTER TABLE att_parts ATTACH PARTITION att_parts_2 FOR VALUES FROM (2) TO (3)");
        run("INSERT INTO att_parts VALUES ('p1', 1), ('p1', 2), ('p2', 2)");
        run("INSERT INTO att_parts_2 (event_id, day) VALUES ('p2', 2), ('p3', 2)");
        run("INSERT INTO att_parts_1 VALUES ('p3', 1)");
        assert_eq!(column("SELECT event_id || '@' || day FROM att_parts ORDER BY 1"), ["p1@1", "p2@2", "p3@2"]);
        assert_dedup_error("SELECT dedup.attach('att_parts_1', 'event_id')", PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE);
    }

    #[pg_test]
    fn attach_detach_drop_and_reattach() {
        events("att_life");
        run("SELECT dedup.create_inbox('att_life'); SELECT dedup.attach('att_life', 'event_id', NULL, 'att_life')");
        assert_eq!(
            one::<String>("SELECT format('%s %s %s %s %s', tbl, key, inbox, ttl, on_duplicate) FROM dedup.attachments"),
            "att_life event_id att_life  skip",
            "no ttl: the inbox's default"
        );
        assert_dedup_error(
            "SELECT dedup.drop_inbox('att_life')",
            PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
        );
        run("SELECT dedup.attach('att_life', 'source', NULL, 'att_life')");
        run("INSERT INTO att_life VALUES ('a', 's'), ('b', 's')");
        assert_eq!(count("att_life"), 1, "the new key counts");
        run("SELECT dedup.detach('att_life')");
        run("INSERT INTO att_life VALUES ('a', 's')");
        assert_eq!(count("att_life"), 2, "detached: no dedup");
        assert_eq!(count("dedup.attachments"), 0);
        run("SELECT dedup.attach('att_life', 'event_id', NULL, 'att_life'); DROP TABLE att_life");
        assert_eq!(count("dedup.attachments"), 0, "DROP TABLE took the attachment with it");
        run("SELECT dedup.drop_inbox('att_life')");
    }

    #[pg_test]
    fn attach_refuses_keys_on_system_columns_naming_them() {
        events("att_sys");
        for (key, column) in
            [("ctid::text", "ctid"), ("xmin::text", "xmin"), ("event_id || tableoid::text", "tableoid")]
        {
            let sql = format!("SELECT dedup.attach('att_sys', '{key}')");
            assert_dedup_error(&sql, PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE);
            let (_, message) = error_of(&sql);
            assert!(message.contains(&format!("system column {column}")), "{message}");
        }
        assert_eq!(count("dedup.attachments"), 0);
    }

    #[pg_test]
    fn attach_refuses_keys_on_generated_columns_saying_what_to_use() {
        run("CREATE TABLE att_gen (raw text, k text GENERATED ALWAYS AS (lower(raw)) STORED)");
        assert_dedup_error("SELECT dedup.attach('att_gen', 'k')", PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE);
        let (_, message) = error_of("SELECT dedup.attach('att_gen', 'k || raw')");
        assert!(message.contains("generated column k") && message.contains("lower(raw)"), "{message}");
        run("SELECT dedup.attach('att_gen', 'lower(raw)')");
        run("INSERT INTO att_gen (raw) VALUES ('A'), ('a'), ('b')");
        assert_eq!(count("att_gen"), 2, "the expression it is generated from works");
    }

    #[pg_test]
    fn attach_refuses_temporary_tables_and_system_catalogs() {
        run("CREATE TEMP TABLE att_tmp (event_id text)");
        let sql = "SELECT dedup.attach('att_tmp', 'event_id')";
        assert_dedup_error(sql, PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED);
        let (_, message) = error_of(sql);
        assert!(message.contains("is a temporary table"), "{message}");
        let catalog = "SELECT dedup.attach('pg_catalog.pg_class', 'relname::text')";
        assert_dedup_error(catalog, PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE);
        assert_eq!(count("dedup.attachments"), 0);
    }

    #[pg_test]
    fn attach_an_attachment_whose_table_went_unseen_is_pruned_not_stuck() {
        // A table that goes without the DROP event trigger seeing it (here: the event trigger is off), as a
        // temporary table attached with pg_dedup 0.3.0 did at the end of its session.
        let unseen_drop = |table: &str| {
            run(&format!(
                "ALTER EVENT TRIGGER dedup_watch_drop DISABLE; DROP TABLE {table};
                 ALTER EVENT TRIGGER dedup_watch_drop ENABLE ALWAYS"
            ))
        };
        events("att_gone");
        run("SELECT dedup.create_inbox('att_gone'); SELECT dedup.attach('att_gone', 'event_id', inbox => 'att_gone')");
        let relid = one::<pg_sys::Oid>("SELECT 'att_gone'::regclass::oid").to_u32();
        unseen_drop("att_gone");
        assert_eq!(count("dedup.attachments"), 1, "left behind");
        run(&format!("SELECT dedup.detach({relid})"));
        assert_eq!(count("dedup.attachments"), 0, "detach() of a table that is gone removes its attachment");
        assert_dedup_error(&format!("SELECT dedup.detach({relid})"), PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE);
        // And drop_inbox() does not point at an impossible detach.
        events("att_gone2");
        run("SELECT dedup.attach('att_gone2', 'event_id', inbox => 'att_gone')");
        unseen_drop("att_gone2");
        run("SELECT dedup.drop_inbox('att_gone')");
        assert_eq!(count("dedup.attachments"), 0);
    }

    #[pg_test]
    fn attach_the_attachment_goes_with_its_trigger() {
        events("att_trig");
        run("SELECT dedup.attach('att_trig', 'event_id')");
        run("DROP TRIGGER zz_dedup_attached ON att_trig");
        assert_eq!(count("dedup.attachments"), 0, "no trigger, no attachment");
        run("INSERT INTO att_trig (event_id) VALUES ('t'), ('t')");
        assert_eq!(count("att_trig"), 2);
    }

    #[pg_test]
    fn attach_what_the_key_uses_cannot_be_dropped_from_under_it() {
        run("CREATE FUNCTION att_norm(t text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS
               $$ BEGIN RETURN lower(t); END $$");
        events("att_dep");
        run("SELECT dedup.attach('att_dep', 'att_norm(event_id)')");
        run("INSERT INTO att_dep (event_id) VALUES ('A'), ('a')");
        assert_eq!(count("att_dep"), 1);
        let (code, message) = error_of("DROP FUNCTION att_norm(text)");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST, "{message}");
        let (code, message) = error_of("ALTER TABLE att_dep DROP COLUMN event_id");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST, "{message}");
        let (code, message) = error_of("ALTER TABLE att_dep ALTER COLUMN event_id TYPE varchar(100)");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED, "{message}");
        run("ALTER TABLE att_dep DROP COLUMN source");
        run("DROP FUNCTION att_norm(text) CASCADE");
        assert_eq!(count("dedup.attachments"), 0, "the cascade took the trigger, and the attachment with it");
        run("INSERT INTO att_dep (event_id) VALUES ('a')");
        assert_eq!(count("att_dep"), 2, "no longer deduplicated, and no error");
    }

    #[pg_test]
    fn attach_a_replaced_function_is_used_at_once() {
        // An SQL function is inlined into the compiled key: replacing it must compile the key again.
        run("CREATE FUNCTION att_fold(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT lower(t)'");
        events("att_repl");
        run("SELECT dedup.attach('att_repl', 'att_fold(event_id)')");
        run("INSERT INTO att_repl (event_id) VALUES ('X')");
        assert!(one::<bool>("SELECT dedup.seen('x')"));
        run("CREATE OR REPLACE FUNCTION att_fold(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT upper(t) || '!' $$");
        run("INSERT INTO att_repl (event_id) VALUES ('y')");
        assert!(one::<bool>("SELECT dedup.seen('Y!')"), "the new body, not the inlined old one");
    }

    #[pg_test]
    fn attach_a_drop_inside_a_restricted_operation_works() {
        // REFRESH MATERIALIZED VIEW runs the view's query as its owner in a security-restricted operation.
        run("CREATE TABLE att_scratch (x int);
             CREATE FUNCTION att_drops(t text) RETURNS int LANGUAGE plpgsql VOLATILE AS
               $$ BEGIN EXECUTE format('DROP TABLE IF EXISTS %s', t); RETURN 1; END $$;
             CREATE MATERIALIZED VIEW att_mv AS SELECT att_drops('public.att_scratch') AS x WITH NO DATA");
        run("REFRESH MATERIALIZED VIEW att_mv");
        assert_eq!(count("pg_class WHERE relname = 'att_scratch'"), 0, "dropped inside the refresh");
        // An attached table dropped there loses its attachment too.
        events("att_scratch2");
        run("SELECT dedup.attach('att_scratch2', 'event_id')");
        run("CREATE MATERIALIZED VIEW att_mv2 AS SELECT att_drops('public.att_scratch2') AS x WITH NO DATA");
        run("REFRESH MATERIALIZED VIEW att_mv2");
        assert_eq!(count("dedup.attachments"), 0);
    }

    #[pg_test]
    fn attach_never_runs_what_a_key_parses_into_with_anyone_elses_rights() {
        // A constant of a domain runs the domain's CHECK while the key is parsed; the check here records who it ran
        // as. A table owner's key must only ever be parsed as that owner (never as the extension's owner, a
        // superuser), and in a security-restricted operation, so that it cannot raise its own rights either.
        run("CREATE ROLE att_esc; GRANT USAGE ON SCHEMA dedup TO att_esc;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dedup TO att_esc;
             GRANT SELECT ON dedup.inbox_registry TO att_esc;
             GRANT SELECT, INSERT, UPDATE ON dedup.inbox_default TO att_esc;
             CREATE TABLE att_esc_log (who text, restricted boolean); GRANT INSERT ON att_esc_log TO PUBLIC;
             CREATE FUNCTION att_esc_check(t text) RETURNS boolean LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO att_esc_log VALUES (current_user, false); RETURN true; END $$;
             CREATE DOMAIN att_esc_d AS text CHECK (att_esc_check(VALUE));
             CREATE TABLE att_esc_t (event_id text); ALTER TABLE att_esc_t OWNER TO att_esc");
        run("SET LOCAL ROLE att_esc");
        run("SELECT dedup.attach('att_esc_t', 'event_id || array_to_string(''{x}''::att_esc_d[], '''')')");
        run("RESET ROLE");
        assert_eq!(column("SELECT DISTINCT who FROM att_esc_log"), ["att_esc"], "parsed as the table's owner only");
        // A superuser attaching the same table (or the extension's update attaching it again) parses it as its owner.
        run("DELETE FROM att_esc_log; SELECT dedup.attach('att_esc_t', 'event_id || array_to_string(''{x}''::att_esc_d[], '''')')");
        assert_eq!(column("SELECT DISTINCT who FROM att_esc_log"), ["att_esc"]);
    }

    #[pg_test]
    fn attach_refuses_a_star_and_whole_row_keys() {
        events("att_star");
        for key in ["*", "att_star.*", "att_star::text", "att_star.*::text", "to_jsonb(att_star)::text"] {
            let sql = format!("SELECT dedup.attach('att_star', '{key}')");
            assert_dedup_error(&sql, PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE);
        }
        let (_, message) = error_of("SELECT dedup.attach('att_star', 'att_star::text')");
        assert!(message.contains("whole row") && message.contains("att_star"), "{message}");
    }

    #[pg_test]
    fn attach_an_update_that_moves_a_row_to_another_partition_keeps_it() {
        for on_duplicate in ["skip", "error"] {
            let t = format!("att_move_{on_duplicate}");
            run(&format!(
                "CREATE TABLE {t} (event_id text, day int) PARTITION BY RANGE (day);
                 CREATE TABLE {t}_1 PARTITION OF {t} FOR VALUES FROM (1) TO (2);
                 CREATE TABLE {t}_2 PARTITION OF {t} FOR VALUES FROM (2) TO (3);
                 SELECT dedup.create_inbox('{t}');
                 SELECT dedup.attach('{t}', 'event_id', inbox => '{t}', on_duplicate => '{on_duplicate}');
                 INSERT INTO {t} VALUES ('a', 1), ('b', 1), ('c', 1);"
            ));
            assert_eq!(
                one::<i64>(&format!(
                    "WITH u AS (UPDATE {t} SET day = 2 WHERE event_id <> 'c' RETURNING 1) SELECT count(*) FROM u"
                )),
                2
            );
            run(&format!("UPDATE {t} SET day = 2, event_id = 'c2' WHERE event_id = 'c'"));
            assert_eq!(
                column(&format!("SELECT event_id || day FROM {t} ORDER BY 1")),
                ["a2", "b2", "c22"],
                "{on_duplicate}"
            );
            // Inserts are deduplicated as before, also right after a move.
            if on_duplicate == "skip" {
                run(&format!("INSERT INTO {t} VALUES ('a', 1), ('d', 1)"));
                assert_eq!(count(&t), 4, "'a' is still a duplicate");
            } else {
                assert_dedup_error(
                    &format!("INSERT INTO {t} VALUES ('a', 1)"),
                    PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION,
                );
            }
        }
    }

    #[pg_test]
    fn attach_a_key_that_inserts_into_its_own_table_is_refused_cleanly() {
        // A stable key function that calls a volatile one, which PostgreSQL does not look into.
        run("CREATE TABLE att_reent (event_id text);
             CREATE FUNCTION att_reent_ins(t text) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
             BEGIN
               IF t NOT LIKE 'inner%' THEN INSERT INTO att_reent VALUES ('inner-' || t); END IF;
               RETURN t;
             END $$;
             CREATE FUNCTION att_reent_key(t text) RETURNS text LANGUAGE plpgsql STABLE AS
               $$ BEGIN RETURN att_reent_ins(t); END $$;
             SELECT dedup.attach('att_reent', 'upper(event_id) || att_reent_key(event_id)')");
        assert_dedup_error(
            "INSERT INTO att_reent VALUES ('outer')",
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        );
        assert_eq!(count("att_reent"), 0);
        run("INSERT INTO att_reent VALUES ('inner-1')");
        assert_eq!(count("att_reent"), 1, "the key works where it does not re-enter");
    }

    #[pg_test]
    fn attach_refuses_keys_on_temporary_objects() {
        events("att_tmpfn");
        run("CREATE FUNCTION pg_temp.att_norm(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT lower(t)'");
        assert_dedup_error(
            "SELECT dedup.attach('att_tmpfn', 'pg_temp.att_norm(event_id)')",
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        );
        assert_eq!(count("dedup.attachments"), 0);
        assert_eq!(count("pg_trigger WHERE tgrelid = 'att_tmpfn'::regclass"), 0, "the trigger went with the refusal");
    }

    #[pg_test]
    fn attach_a_partitioned_table_needs_trigger_rights_on_every_partition() {
        run("CREATE ROLE att_parent_owner; CREATE ROLE att_part_owner;
             GRANT USAGE ON SCHEMA dedup TO att_parent_owner; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dedup TO att_parent_owner;
             GRANT SELECT ON dedup.inbox_registry TO att_parent_owner;
             GRANT SELECT, INSERT, UPDATE ON dedup.inbox_default TO att_parent_owner;
             CREATE TABLE att_pp (event_id text, day int) PARTITION BY RANGE (day);
             CREATE TABLE att_pp_1 PARTITION OF att_pp FOR VALUES FROM (1) TO (2);
             ALTER TABLE att_pp OWNER TO att_parent_owner; ALTER TABLE att_pp_1 OWNER TO att_part_owner");
        run("SET LOCAL ROLE att_parent_owner");
        assert_dedup_error("SELECT dedup.attach('att_pp', 'event_id')", PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE);
        run("RESET ROLE; GRANT TRIGGER ON att_pp_1 TO att_parent_owner; SET LOCAL ROLE att_parent_owner");
        run("SELECT dedup.attach('att_pp', 'event_id')");
        run("RESET ROLE");
    }

    // pg_backend_memory_contexts is there from PostgreSQL 14 on.
    #[cfg(not(feature = "pg13"))]
    #[pg_test]
    fn attach_a_key_that_does_not_compile_leaves_no_memory_behind() {
        events("att_leak");
        run("SELECT dedup.attach('att_leak', 'event_id'); ALTER TABLE att_leak RENAME COLUMN event_id TO ev");
        let contexts = || count("pg_backend_memory_contexts WHERE name = 'dedup attachment key'");
        let before = contexts();
        for _ in 0..20 {
            assert_dedup_error("INSERT INTO att_leak (ev) VALUES ('x')", PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN);
        }
        assert_eq!(contexts(), before, "each failed compilation freed its memory");
    }

    #[pg_test]
    fn attach_does_not_replace_someone_elses_trigger_of_the_same_name() {
        events("att_named");
        run("CREATE FUNCTION att_named_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;
             CREATE TRIGGER zz_dedup_attached BEFORE INSERT ON att_named FOR EACH ROW EXECUTE FUNCTION att_named_fn()");
        assert_dedup_error("SELECT dedup.attach('att_named', 'event_id')", PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT);
        assert_eq!(count("pg_trigger WHERE tgrelid = 'att_named'::regclass AND tgfoid = 'att_named_fn'::regproc"), 1);
    }

    /// A partitioned table `name` (event_id text, day int, n int) with partitions for days 1 and 2, attached.
    fn parted(name: &str, inbox: &str) {
        run(&format!(
            "CREATE TABLE {name} (event_id text, day int, n int) PARTITION BY RANGE (day);
             CREATE TABLE {name}_1 PARTITION OF {name} FOR VALUES FROM (1) TO (2);
             CREATE TABLE {name}_2 PARTITION OF {name} FOR VALUES FROM (2) TO (3);
             SELECT dedup.create_inbox('{inbox}');
             SELECT dedup.attach('{name}', 'event_id', inbox => '{inbox}');"
        ));
    }

    #[pg_test]
    fn attach_a_new_insert_is_never_taken_for_a_moving_row() {
        parted("att_mv", "att_mv");
        run("INSERT INTO att_mv VALUES ('a', 1, 0), ('b', 1, 0), ('c', 1, 0), ('d', 1, 0), ('e', 1, 0)");
        // An update in place, a delete, then an insert of the updated key: a duplicate.
        run("DO $$ BEGIN
               UPDATE att_mv SET n = n + 1 WHERE event_id = 'a';
               DELETE FROM att_mv WHERE event_id = 'b';
               INSERT INTO att_mv VALUES ('a', 1, 99);
             END $$");
        // A delete rolled back, then an insert of its key.
        run("DO $$ BEGIN
               BEGIN DELETE FROM att_mv WHERE event_id = 'c'; RAISE EXCEPTION 'x';
               EXCEPTION WHEN others THEN NULL; END;
               INSERT INTO att_mv VALUES ('c', 2, 99);
             END $$");
        // One statement that updates, deletes and inserts.
        run("WITH u AS (UPDATE att_mv SET n = 5 WHERE event_id = 'd' RETURNING 1),
                  del AS (DELETE FROM att_mv WHERE event_id = 'e' RETURNING 1)
             INSERT INTO att_mv SELECT 'd', 2, 77 FROM u, del");
        // A delete then an insert of the same key.
        run("DELETE FROM att_mv WHERE event_id = 'a'; INSERT INTO att_mv VALUES ('a', 2, 7)");
        assert_eq!(count("att_mv WHERE n IN (99, 77, 7)"), 0, "every later insert was a duplicate");
        assert_eq!(column("SELECT event_id FROM att_mv ORDER BY 1"), ["c", "d"]);
    }

    #[pg_test]
    fn attach_a_move_of_another_table_lends_nothing_to_this_ones_inserts() {
        parted("att_ev", "att_ev");
        parted("att_arch", "att_arch");
        run("INSERT INTO att_arch VALUES ('x', 1, 0); INSERT INTO att_ev VALUES ('x', 1, 0), ('y', 1, 0)");
        run("WITH d AS (DELETE FROM att_ev RETURNING *) INSERT INTO att_arch SELECT * FROM d");
        assert_eq!(count("att_arch WHERE event_id = 'x'"), 1, "the copy of x was a duplicate in att_arch's inbox");
        assert!(one::<bool>("SELECT dedup.seen('y', 'att_arch')"), "y was marked in att_arch's inbox");
        // A move whose new partition's BEFORE INSERT trigger writes into another attached table in between.
        parted("att_hist", "att_hist");
        run("SELECT dedup.attach('att_hist', 'event_id || '':'' || day::text', inbox => 'att_hist');
             CREATE FUNCTION att_hist_log() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO att_hist VALUES (NEW.event_id, NEW.day, 0); RETURN NEW; END $$;
             CREATE TRIGGER history BEFORE INSERT ON att_ev FOR EACH ROW EXECUTE FUNCTION att_hist_log();
             INSERT INTO att_ev VALUES ('h1', 1, 0)");
        assert_eq!(
            one::<i64>(
                "WITH u AS (UPDATE att_ev SET day = 2 WHERE event_id = 'h1' RETURNING 1) SELECT count(*) FROM u"
            ),
            1
        );
        assert_eq!(
            column("SELECT event_id || '@' || day FROM att_ev WHERE event_id = 'h1'"),
            ["h1@2"],
            "the row moved"
        );
    }

    #[pg_test]
    fn attach_updates_and_deletes_run_no_key() {
        // A key that no longer compiles (a column renamed), or fails for old rows, or that the role updating and
        // deleting may not run: none of that is an update's or a delete's business.
        parted("att_nokey", "att_nokey");
        run("INSERT INTO att_nokey VALUES ('k', 1, 0), ('l', 1, 0);
             ALTER TABLE att_nokey RENAME COLUMN event_id TO ev");
        run("UPDATE att_nokey SET n = 1; UPDATE att_nokey SET day = 2 WHERE ev = 'k'; DELETE FROM att_nokey WHERE ev = 'l'");
        assert_eq!(column("SELECT ev || '@' || day FROM att_nokey"), ["k@2"]);
        assert_dedup_error("INSERT INTO att_nokey VALUES ('m', 1, 0)", PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN);
        let (_, message) = error_of("INSERT INTO att_nokey VALUES ('m', 1, 0)");
        assert!(message.contains("att_nokey_1"), "{message}");
    }

    #[pg_test]
    fn attach_refuses_a_partition_on_its_own() {
        run("CREATE TABLE att_lone (event_id text, day int) PARTITION BY RANGE (day);
             CREATE TABLE att_lone_1 PARTITION OF att_lone FOR VALUES FROM (1) TO (2)");
        assert_dedup_error("SELECT dedup.attach('att_lone_1', 'event_id')", PgSqlErrorCode::ERRCODE_WRONG_OBJECT_TYPE);
    }

    // BEGIN ATOMIC bodies are there from PostgreSQL 14 on.
    #[cfg(not(feature = "pg13"))]
    #[pg_test]
    fn attach_refuses_a_key_that_reaches_a_temporary_object_through_another() {
        events("att_atomic");
        run("CREATE FUNCTION pg_temp.att_tnorm(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT lower(t)';
             CREATE FUNCTION public.att_pnorm(t text) RETURNS text LANGUAGE sql IMMUTABLE
               BEGIN ATOMIC SELECT pg_temp.att_tnorm(t); END");
        assert_dedup_error(
            "SELECT dedup.attach('att_atomic', 'public.att_pnorm(event_id)')",
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        );
    }
}
