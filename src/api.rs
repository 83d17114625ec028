//! The SQL surface, schema `dedup`. Each function validates its arguments, then hands over to the module that
//! does the work. None is STRICT: a NULL argument gets a clear error (or, for `ttl`, the inbox default), never a
//! silent NULL result. All run with the caller's privileges (no SECURITY DEFINER): access to an inbox is exactly
//! access to its table.

use crate::errors::raise;
use crate::inbox::{self, Access};
use crate::{claim, input, positions, purge};
use pgrx::prelude::*;

/// Records `id` in `inbox` for `ttl` (NULL: the inbox's default) inside the current transaction. True the first
/// time within the window, false for a duplicate. Waits for a concurrent transaction marking the same id.
#[pg_extern(volatile, parallel_unsafe)]
fn mark(id: Option<&str>, ttl: default!(Option<Interval>, "NULL"), inbox: default!(Option<&str>, "'default'")) -> bool {
    input::require_writable("mark");
    let id = input::id(id);
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    claim::mark(&inbox, &[id], ttl)[0]
}

/// Marks every id in `ids`; returns the ids that were new, each once, in order of first occurrence (a repeat
/// inside the array is a duplicate of its first occurrence).
#[pg_extern(volatile, parallel_unsafe)]
fn mark_many<'a>(
    ids: Option<Array<'a, &'a str>>,
    ttl: default!(Option<Interval>, "NULL"),
    inbox: default!(Option<&str>, "'default'"),
) -> SetOfIterator<'a, &'a str> {
    input::require_writable("mark_many");
    let array = input::id_array(ids);
    let mut ids = input::ids(&array);
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    let new_at = if ids.is_empty() { Vec::new() } else { claim::mark(&inbox, &ids, ttl) };
    let mut position = 0;
    ids.retain(|_| {
        position += 1;
        new_at[position - 1]
    });
    // SAFETY: the ids point into the array's datum, which `Rows` keeps (with the array) until the last row is
    // returned; only the borrow of the `Array` handle is shorter than that.
    let new: Vec<&'a str> = unsafe { std::mem::transmute::<Vec<&str>, Vec<&'a str>>(ids) };
    SetOfIterator::new(Rows { rows: new.into_iter(), _array: array })
}

/// The rows of a set-returning call that point into one of its arguments, with that argument kept alive: an array
/// detoasted for the call is freed when its `Array` goes.
struct Rows<'a> {
    rows: std::vec::IntoIter<&'a str>,
    _array: Array<'a, &'a str>,
}

impl<'a> Iterator for Rows<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        self.rows.next()
    }
}

/// Read-only: is a live (unexpired) mark for `id` visible to this transaction?
#[pg_extern(stable, parallel_restricted)]
fn seen(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Read);
    claim::seen(&inbox, id)
}

/// Deletes the mark for `id` (operator replay: the next delivery is processed again). True if a live mark was
/// removed.
#[pg_extern(volatile, parallel_unsafe)]
fn forget(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    input::require_writable("forget");
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Delete);
    claim::forget(&inbox, id)
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
    positions::advance(&inbox, key, position, ttl)
}

/// The live position of `key` in `inbox`; NULL when it has none (never advanced, or expired).
#[pg_extern(stable, parallel_restricted)]
fn position(key: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> Option<i64> {
    let key = input::key(key);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Read);
    positions::position(&inbox, key)
}

/// Creates an inbox: an independent namespace of marks (one per consumer of the same events).
#[pg_extern(volatile, parallel_unsafe)]
fn create_inbox(name: Option<&str>, default_ttl: default!(Option<Interval>, "'3 days'")) {
    input::require_writable("create_inbox");
    input::require_utf8_database();
    let name = input::inbox_name(name);
    let Some(default_ttl) = default_ttl else {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "default_ttl must not be NULL",
            "Pass the redelivery window for this inbox, for example '3 days'.",
        )
    };
    inbox::create(name, input::ttl(default_ttl));
}

/// Drops an inbox and every mark in it.
#[pg_extern(volatile, parallel_unsafe)]
fn drop_inbox(name: Option<&str>) {
    input::require_writable("drop_inbox");
    inbox::drop(input::inbox_name(name));
}

/// Deletes expired marks (and expired positions of `advance()`) now, in `inbox` or in every inbox (NULL), at most
/// `max_rows` of them (NULL: all). Returns how many were deleted. Works without the background worker, e.g. from cron or pg_cron.
#[pg_extern(volatile, parallel_unsafe)]
fn purge(inbox: default!(Option<&str>, "NULL"), max_rows: default!(Option<i64>, "NULL")) -> i64 {
    input::require_writable("purge");
    let max_rows = input::max_rows(max_rows);
    let names = match inbox {
        Some(name) => vec![input::inbox_name(Some(name)).to_owned()],
        None => inbox::all_names(),
    };
    let mut deleted = 0;
    for name in names {
        let remaining = max_rows.map(|m| m - deleted);
        let inbox = inbox::open(&name, Access::Delete);
        deleted += purge::purge_inbox(&inbox, remaining);
    }
    deleted
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn api_mark_is_true_the_first_time_and_false_after() {
        assert!(one::<bool>("SELECT dedup.mark('api-1')"));
        assert!(!one::<bool>("SELECT dedup.mark('api-1')"));
        assert!(!one::<bool>("SELECT dedup.mark('api-1', '1 hour')"), "a ttl does not make a duplicate new");
        assert_eq!(count("dedup.inbox_default WHERE id = 'api-1'"), 1);
    }

    #[pg_test]
    fn api_mark_expires_after_its_ttl_or_the_inbox_default() {
        run("SELECT dedup.create_inbox('api_ttl', '2 days')");
        run(
            "SELECT dedup.mark('with-ttl', '90 minutes', 'api_ttl'); SELECT dedup.mark('default-ttl', NULL, 'api_ttl')",
        );
        let ttl = |id: &str| {
            one::<String>(&format!(
                "SELECT (expires_at - statement_timestamp())::text FROM dedup.inbox_api_ttl WHERE id = '{id}'"
            ))
        };
        // Measured from the start of the statement (the test's one statement, for every call inside it).
        assert_eq!(ttl("with-ttl"), "01:30:00");
        assert_eq!(ttl("default-ttl"), "2 days");
    }

    #[pg_test]
    fn api_inboxes_are_independent_namespaces() {
        run("SELECT dedup.create_inbox('api_a'); SELECT dedup.create_inbox('api_b')");
        assert!(one::<bool>("SELECT dedup.mark('same', NULL, 'api_a')"));
        assert!(one::<bool>("SELECT dedup.mark('same', NULL, 'api_b')"));
        assert!(!one::<bool>("SELECT dedup.mark('same', NULL, 'api_a')"));
        assert!(!one::<bool>("SELECT dedup.seen('same')"), "not in the default inbox");
    }

    #[pg_test]
    fn api_mark_many_returns_new_ids_once_in_first_occurrence_order() {
        run("SELECT dedup.mark('m-old')");
        let new = column("SELECT * FROM dedup.mark_many(ARRAY['m-b', 'm-old', 'm-a', 'm-b', 'm-c', 'm-a'])");
        assert_eq!(new, ["m-b", "m-a", "m-c"]);
        assert!(column("SELECT * FROM dedup.mark_many(ARRAY['m-a', 'm-b', 'm-c'])").is_empty());
        assert!(column("SELECT * FROM dedup.mark_many(ARRAY[]::text[])").is_empty());
    }

    #[pg_test]
    fn api_mark_many_works_through_a_large_array_in_chunks() {
        // More distinct ids than one chunk holds, with repeats and duplicates of earlier marks mixed in.
        run("SELECT dedup.mark('big-17'); SELECT dedup.mark('big-24999')");
        let returned = one::<i64>(
            "SELECT count(*) FROM dedup.mark_many(
               (SELECT array_agg('big-' || (g % 25000)) FROM generate_series(0, 29999) g))",
        );
        assert_eq!(returned, 24_998);
        assert_eq!(count("dedup.inbox_default WHERE id LIKE 'big-%'"), 25_000);
        let first_ten = column(
            "SELECT * FROM dedup.mark_many((SELECT array_agg('order-' || (10 - g)) FROM generate_series(1, 10) g)) \
             LIMIT 10",
        );
        assert_eq!(first_ten, (0..10).rev().map(|i| format!("order-{i}")).collect::<Vec<_>>(), "array order kept");
    }

    #[pg_test]
    fn api_seen_answers_for_live_marks_only() {
        run("SELECT dedup.mark('s-live'); SELECT dedup.mark('s-old', '1 hour')");
        run("UPDATE dedup.inbox_default SET expires_at = now() - interval '1 second' WHERE id = 's-old'");
        assert!(one::<bool>("SELECT dedup.seen('s-live')"));
        assert!(!one::<bool>("SELECT dedup.seen('s-old')"), "an expired mark is not seen");
        assert!(!one::<bool>("SELECT dedup.seen('s-never')"));
    }

    #[pg_test]
    fn api_forget_removes_a_mark_and_says_whether_it_was_live() {
        run("SELECT dedup.mark('f-live'); SELECT dedup.mark('f-old')");
        run("UPDATE dedup.inbox_default SET expires_at = now() - interval '1 second' WHERE id = 'f-old'");
        assert!(one::<bool>("SELECT dedup.forget('f-live')"));
        assert!(!one::<bool>("SELECT dedup.forget('f-old')"), "an expired mark was not live");
        assert!(!one::<bool>("SELECT dedup.forget('f-never')"));
        assert_eq!(count("dedup.inbox_default WHERE id IN ('f-live', 'f-old')"), 0, "both rows are gone");
        assert!(one::<bool>("SELECT dedup.mark('f-live')"), "forgotten: new again");
    }

    #[pg_test]
    fn api_purge_deletes_expired_marks_only_up_to_max_rows() {
        run("SELECT dedup.create_inbox('api_purge')");
        run(
            "INSERT INTO dedup.inbox_api_purge SELECT 'old-' || g, now() - interval '1 minute' FROM generate_series(1, 30) g;
             INSERT INTO dedup.inbox_api_purge SELECT 'live-' || g, now() + interval '1 hour' FROM generate_series(1, 5) g",
        );
        assert_eq!(one::<i64>("SELECT dedup.purge('api_purge', 10)"), 10);
        assert_eq!(one::<i64>("SELECT dedup.purge('api_purge', 0)"), 0);
        assert_eq!(one::<i64>("SELECT dedup.purge('api_purge')"), 20);
        assert_eq!(count("dedup.inbox_api_purge"), 5, "live marks stay");
    }

    #[pg_test]
    fn api_purge_without_an_inbox_purges_every_inbox() {
        run("SELECT dedup.create_inbox('api_p1'); SELECT dedup.create_inbox('api_p2')");
        run(
            "INSERT INTO dedup.inbox_api_p1 VALUES ('x', now() - interval '1 minute');
             INSERT INTO dedup.inbox_api_p2 VALUES ('x', now() - interval '1 minute'), ('y', now() - interval '1 minute')",
        );
        assert!(one::<i64>("SELECT dedup.purge()") >= 3);
        assert_eq!(count("dedup.inbox_api_p1") + count("dedup.inbox_api_p2"), 0);
    }

    #[pg_test]
    fn api_create_inbox_registers_an_inbox_and_drop_inbox_removes_it() {
        run("SELECT dedup.create_inbox('api_life', '5 minutes')");
        assert_eq!(one::<String>("SELECT default_ttl::text FROM dedup.inboxes WHERE name = 'api_life'"), "00:05:00");
        assert_eq!(
            one::<String>("SELECT relation::text FROM dedup.inboxes WHERE name = 'api_life'"),
            "dedup.inbox_api_life"
        );
        run("SELECT dedup.mark('x', NULL, 'api_life'); SELECT dedup.drop_inbox('api_life')");
        assert_eq!(count("dedup.inboxes WHERE name = 'api_life'"), 0);
        assert_eq!(count("pg_class WHERE relname = 'inbox_api_life'"), 0, "its table is gone");
        run("SELECT dedup.create_inbox('api_life')");
        assert!(one::<bool>("SELECT dedup.mark('x', NULL, 'api_life')"), "a re-created inbox starts empty");
    }

    #[pg_test]
    fn api_inbox_errors_name_the_problem() {
        run("SELECT dedup.create_inbox('api_twice')");
        assert_dedup_error("SELECT dedup.create_inbox('api_twice')", PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT);
        assert_dedup_error("SELECT dedup.drop_inbox('api_nope')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
        assert_dedup_error("SELECT dedup.mark('x', NULL, 'api_nope')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
        assert_dedup_error("SELECT dedup.seen('x', 'api_nope')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
        assert_dedup_error("SELECT dedup.drop_inbox('default')", PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED);
        assert_dedup_error(
            "SELECT dedup.create_inbox('api_null_ttl', NULL)",
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
        );
    }

    #[pg_test]
    fn api_an_inbox_whose_table_is_missing_says_so() {
        run("SELECT dedup.create_inbox('api_gone'); DROP TABLE dedup.inbox_api_gone");
        assert_dedup_error("SELECT dedup.mark('x', NULL, 'api_gone')", PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE);
        run("SELECT dedup.drop_inbox('api_gone')");
        assert_dedup_error("SELECT dedup.mark('x', NULL, 'api_gone')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
    }

    #[pg_test]
    fn api_a_rolled_back_savepoint_takes_its_marks() {
        // A subtransaction rolled back, as ROLLBACK TO SAVEPOINT does it.
        rolled_back(|| run("SELECT dedup.mark('sp-1'); SELECT * FROM dedup.mark_many(ARRAY['sp-2', 'sp-3'])"));
        assert!(!one::<bool>("SELECT dedup.seen('sp-1')"));
        assert_eq!(column("SELECT * FROM dedup.mark_many(ARRAY['sp-1', 'sp-2', 'sp-3'])").len(), 3);
    }
}
