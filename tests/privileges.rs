//! Who may create, drop and change what in schema dedup: an inbox administrator creates, grants
//! and drops inboxes through the functions, which check it themselves, and can neither plant code in the schema,
//! rewrite the registry, nor attach code to the inbox tables; calls qualified with `dedup.` reach pg_dedup whatever
//! overloads are planted on the caller's search_path.

use pg_dedup_harness::postgres::types::Type;
use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;

/// The grants docs/privileges.md gives an inbox administrator, verbatim but for the role's name.
const ADMIN_GRANTS: &str = "
    GRANT USAGE ON SCHEMA dedup TO {role};
    GRANT EXECUTE ON FUNCTION dedup.create_inbox(text, interval), dedup.drop_inbox(text) TO {role};
    GRANT SELECT ON dedup.inbox_registry, dedup.inboxes TO {role};";

/// The grants docs/privileges.md gives an application role (minus the per-inbox table grant).
const APP_GRANTS: &str = "
    GRANT USAGE ON SCHEMA dedup TO {role};
    GRANT EXECUTE ON FUNCTION dedup.mark(text, interval, text), dedup.mark_many(text[], interval, text),
                              dedup.seen(text, text) TO {role};
    GRANT SELECT ON dedup.inbox_registry, dedup.inboxes TO {role};";

/// A database with roles `<db>_inbox_admin`, `<db>_other_admin` (the same grants) and `<db>_app` (roles are
/// cluster-wide, and the tests of this file run side by side on one cluster).
fn with_roles(db_name: &str) -> Client {
    let mut su = db(db_name);
    let roles = [("inbox_admin", ADMIN_GRANTS), ("other_admin", ADMIN_GRANTS), ("app", APP_GRANTS)];
    for (role, grants) in roles {
        let role = format!("{db_name}_{role}");
        su.batch_execute(&format!("CREATE ROLE {role} LOGIN")).unwrap();
        su.batch_execute(&grants.replace("{role}", &role)).unwrap();
    }
    su
}

#[test]
fn an_inbox_administrator_creates_grants_and_drops_its_inboxes() {
    let mut su = with_roles("admin_lifecycle");
    let mut admin = cluster().connect_as("admin_lifecycle", "admin_lifecycle_inbox_admin");
    admin.batch_execute("SELECT dedup.create_inbox('orders', '1 day')").unwrap();
    let owner: String = su
        .query_one("SELECT relowner::regrole::text FROM pg_class WHERE oid = 'dedup.inbox_orders'::regclass", &[])
        .unwrap()
        .get(0);
    let extension_owner: String = su
        .query_one("SELECT extowner::regrole::text FROM pg_extension WHERE extname = 'pg_dedup'", &[])
        .unwrap()
        .get(0);
    assert_eq!(owner, extension_owner, "inbox tables belong to the extension's owner, not to their creator");
    // The creator grants the application its share, and the application marks.
    admin.batch_execute("GRANT SELECT, INSERT, UPDATE ON dedup.inbox_orders TO admin_lifecycle_app").unwrap();
    let mut app = cluster().connect_as("admin_lifecycle", "admin_lifecycle_app");
    assert!(app.query_one("SELECT dedup.mark('o-1', NULL, 'orders')", &[]).unwrap().get::<_, bool>(0));
    assert!(!app.query_one("SELECT dedup.mark('o-1', NULL, 'orders')", &[]).unwrap().get::<_, bool>(0));
    // Another administrator, and the application, may not drop it; its creator may.
    let mut other = cluster().connect_as("admin_lifecycle", "admin_lifecycle_other_admin");
    assert_dedup_error(other.batch_execute("SELECT dedup.drop_inbox('orders')"), "42501");
    let err = app.batch_execute("SELECT dedup.drop_inbox('orders')").expect_err("no EXECUTE on drop_inbox");
    assert_eq!(sqlstate(&err), "42501");
    admin.batch_execute("SELECT dedup.drop_inbox('orders')").unwrap();
    assert_eq!(
        count(&mut su, "dedup.inbox_registry WHERE name = 'orders'"),
        0,
        "the creator dropped its inbox and its registry row"
    );
    // The default inbox, made by CREATE EXTENSION, is the extension owner's alone.
    assert_dedup_error(admin.batch_execute("SELECT dedup.drop_inbox('default')"), "0A000");
}

#[test]
fn an_inbox_administrator_can_plant_no_code_and_rewrite_no_registry() {
    let mut su = with_roles("admin_confined");
    let mut admin = cluster().connect_as("admin_confined", "admin_confined_inbox_admin");
    admin.batch_execute("SELECT dedup.create_inbox('mine')").unwrap();
    for sql in [
        // Hijacking calls: an overload that JDBC's varchar parameters would prefer.
        "CREATE FUNCTION dedup.mark(id varchar) RETURNS boolean LANGUAGE sql AS 'SELECT true'",
        // The operator the worker would have resolved through a planted search_path.
        "CREATE FUNCTION public.eq(name, name) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE OPERATOR dedup.= (LEFTARG = name, RIGHTARG = name, FUNCTION = public.eq)",
        "CREATE TABLE dedup.inbox_planted (id text PRIMARY KEY, expires_at timestamptz)",
        // Rewriting the registry: a one-microsecond window for the default inbox.
        "DELETE FROM dedup.inbox_registry WHERE name = 'default'",
        "INSERT INTO dedup.inbox_registry (name, default_ttl) VALUES ('forged', '1 microsecond')",
        "UPDATE dedup.inbox_registry SET default_ttl = '1 microsecond'",
        // Code attached to its own inbox, which the worker and the applications would run.
        "CREATE FUNCTION public.noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN OLD; END';
         CREATE TRIGGER planted BEFORE DELETE ON dedup.inbox_mine FOR EACH ROW EXECUTE FUNCTION public.noop()",
        "CREATE RULE planted AS ON DELETE TO dedup.inbox_mine DO ALSO NOTHING",
        "ALTER TABLE dedup.inbox_mine DISABLE TRIGGER dedup_filter",
        "ALTER TABLE dedup.inbox_mine ENABLE ROW LEVEL SECURITY",
        "DROP TABLE dedup.inbox_mine",
    ] {
        let err = admin.batch_execute(&format!("BEGIN; {sql}; COMMIT")).expect_err(sql);
        assert_eq!(sqlstate(&err), "42501", "{sql}: {err}");
        admin.batch_execute("ROLLBACK").unwrap();
    }
    let planted: i64 = su
        .query_one("SELECT count(*) FROM pg_proc WHERE pronamespace = 'dedup'::regnamespace AND proname = 'mark'", &[])
        .unwrap()
        .get(0);
    assert_eq!(planted, 1, "only pg_dedup's mark() is in schema dedup");
    let ttl: String =
        su.query_one("SELECT default_ttl::text FROM dedup.inbox_registry WHERE name = 'default'", &[]).unwrap().get(0);
    assert_eq!(ttl, "3 days");
    // What it may do with its inbox: read, write and empty it, and grant that on.
    admin
        .batch_execute(
            "INSERT INTO dedup.inbox_mine VALUES ('by-hand', now() + interval '1 hour');
             DELETE FROM dedup.inbox_mine; TRUNCATE dedup.inbox_mine;
             GRANT SELECT ON dedup.inbox_mine TO admin_confined_app",
        )
        .unwrap();
}

#[test]
fn inbox_functions_refuse_to_run_inside_a_security_restricted_operation() {
    let mut su = db("restricted");
    // A maintenance command (REFRESH MATERIALIZED VIEW, like VACUUM or CREATE INDEX) runs the view's query as its
    // owner inside a security-restricted operation: create_inbox() must not act as the extension's owner there.
    su.batch_execute(
        "CREATE FUNCTION make_inbox() RETURNS int LANGUAGE plpgsql AS
           $$ BEGIN PERFORM dedup.create_inbox('sneaky'); RETURN 1; END $$;
         CREATE MATERIALIZED VIEW mv AS SELECT make_inbox() AS x WITH NO DATA;",
    )
    .unwrap();
    assert_dedup_error(su.batch_execute("REFRESH MATERIALIZED VIEW mv"), "42501");
    assert_eq!(count(&mut su, "dedup.inbox_registry WHERE name = 'sneaky'"), 0);
}

/// Every public function, called schema-qualified with varchar (or varchar[]) parameters the way JDBC binds
/// strings, while overloads taking exactly those types — which PostgreSQL would prefer to ours if they were in the
/// same schema — are planted in every other schema on the search path. Each planted function records its call.
#[test]
fn qualified_calls_reach_dedup_whatever_overloads_are_planted_on_the_search_path() {
    let mut c = db("overloads");
    c.batch_execute("CREATE SCHEMA evil; CREATE TABLE public.hijacked (f text)").unwrap();
    let planted = [
        ("mark", "varchar", "boolean", "true"),
        ("mark", "varchar, interval, varchar", "boolean", "true"),
        ("mark_many", "varchar[]", "SETOF text", "'x'"),
        ("mark_many", "varchar[], interval, varchar", "SETOF text", "'x'"),
        ("seen", "varchar", "boolean", "true"),
        ("seen", "varchar, varchar", "boolean", "true"),
        ("forget", "varchar", "boolean", "true"),
        ("forget", "varchar, varchar", "boolean", "true"),
        ("create_inbox", "varchar", "void", ""),
        ("create_inbox", "varchar, interval", "void", ""),
        ("drop_inbox", "varchar", "void", ""),
        ("purge", "varchar", "bigint", "42"),
        ("purge", "varchar, bigint", "bigint", "42"),
    ];
    for schema in ["evil", "public"] {
        for (name, args, returns, value) in planted {
            c.batch_execute(&format!(
                "CREATE FUNCTION {schema}.{name}({args}) RETURNS {returns} LANGUAGE plpgsql AS
                   $$ BEGIN INSERT INTO public.hijacked VALUES ('{schema}.{name}'); RETURN {}; END $$",
                if returns.starts_with("SETOF") { format!("QUERY SELECT {value}") } else { value.to_owned() }
            ))
            .unwrap();
        }
    }
    c.batch_execute("SET search_path = evil, public, dedup").unwrap();
    let v = Type::VARCHAR;
    let va = Type::VARCHAR_ARRAY;
    let inbox = "checked".to_owned();
    let create = c.prepare_typed("SELECT dedup.create_inbox($1, '1 day')", std::slice::from_ref(&v)).unwrap();
    c.execute(&create, &[&inbox]).unwrap();
    let mark = c.prepare_typed("SELECT dedup.mark($1, NULL, $2)", &[v.clone(), v.clone()]).unwrap();
    let id = "jdbc-1".to_owned();
    assert!(c.query_one(&mark, &[&id, &inbox]).unwrap().get::<_, bool>(0));
    assert!(!c.query_one(&mark, &[&id, &inbox]).unwrap().get::<_, bool>(0), "the second mark is a duplicate");
    let mark_default = c.prepare_typed("SELECT dedup.mark($1)", std::slice::from_ref(&v)).unwrap();
    assert!(c.query_one(&mark_default, &[&id]).unwrap().get::<_, bool>(0));
    assert!(!c.query_one(&mark_default, &[&id]).unwrap().get::<_, bool>(0));
    let mark_many = c.prepare_typed("SELECT * FROM dedup.mark_many($1, NULL, $2)", &[va.clone(), v.clone()]).unwrap();
    let ids = vec!["jdbc-1".to_owned(), "jdbc-2".to_owned()];
    assert_eq!(c.query(&mark_many, &[&ids, &inbox]).unwrap().len(), 1);
    let mark_many_default = c.prepare_typed("SELECT * FROM dedup.mark_many($1)", &[va]).unwrap();
    assert_eq!(c.query(&mark_many_default, &[&ids]).unwrap().len(), 1);
    let seen = c.prepare_typed("SELECT dedup.seen($1, $2)", &[v.clone(), v.clone()]).unwrap();
    assert!(c.query_one(&seen, &[&id, &inbox]).unwrap().get::<_, bool>(0));
    let not_seen = "never".to_owned();
    assert!(!c.query_one(&seen, &[&not_seen, &inbox]).unwrap().get::<_, bool>(0));
    let forget = c.prepare_typed("SELECT dedup.forget($1, $2)", &[v.clone(), v.clone()]).unwrap();
    assert!(c.query_one(&forget, &[&id, &inbox]).unwrap().get::<_, bool>(0));
    let purge = c.prepare_typed("SELECT dedup.purge($1)", std::slice::from_ref(&v)).unwrap();
    assert_eq!(c.query_one(&purge, &[&inbox]).unwrap().get::<_, i64>(0), 0);
    let drop = c.prepare_typed("SELECT dedup.drop_inbox($1)", &[v]).unwrap();
    c.execute(&drop, &[&inbox]).unwrap();
    assert_eq!(count(&mut c, "public.hijacked"), 0, "a planted overload ran");
    assert_eq!(count(&mut c, "dedup.inbox_registry WHERE name = 'checked'"), 0);
}
