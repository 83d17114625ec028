//! `create_inbox()` and `drop_inbox()`: the SQL face of the inbox registry (`inbox`). Dropping an inbox asks the
//! rooms that keep something of it first: an attached table refuses the drop (`attach`), and the inbox's positions
//! (`positions`) and counts of attempts (`attempts`) go with it.

use crate::errors::raise;
use crate::{attach, attempts, inbox, input, positions};
use pgrx::prelude::*;

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
    inbox::drop(
        input::inbox_name(name),
        &inbox::Dependents {
            check: &attach::refuse_to_drop_inbox,
            forget: &|name| {
                positions::forget_inbox(name);
                attempts::forget_inbox(name);
                attach::forget_batch(name);
            },
        },
    );
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn inboxes_create_inbox_registers_an_inbox_and_drop_inbox_removes_it() {
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
    fn inboxes_inbox_errors_name_the_problem() {
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
    fn inboxes_an_inbox_whose_table_is_missing_says_so() {
        run("SELECT dedup.create_inbox('api_gone'); DROP TABLE dedup.inbox_api_gone");
        assert_dedup_error("SELECT dedup.mark('x', NULL, 'api_gone')", PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE);
        run("SELECT dedup.drop_inbox('api_gone')");
        assert_dedup_error("SELECT dedup.mark('x', NULL, 'api_gone')", PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT);
    }
}
