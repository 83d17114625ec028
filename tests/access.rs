//! Where and by whom pg_dedup may be used: read-only transactions, hot standbys, privileges, search_path.

use pg_dedup_tests::*;

#[test]
fn read_only_transactions_can_check_but_not_mark() {
    let mut c = db("read_only");
    c.batch_execute("SELECT dedup.mark('a')").unwrap();
    c.batch_execute("BEGIN READ ONLY").unwrap();
    assert!(c.query_one("SELECT dedup.seen('a')", &[]).unwrap().get::<_, bool>(0));
    assert_dedup_error(c.query_one("SELECT dedup.mark('b')", &[]), "25006");
    c.batch_execute("ROLLBACK; BEGIN READ ONLY").unwrap();
    assert_dedup_error(c.query_one("SELECT * FROM dedup.mark_many(ARRAY['b'])", &[]), "25006");
    c.batch_execute("ROLLBACK; BEGIN READ ONLY").unwrap();
    assert_dedup_error(c.query_one("SELECT dedup.forget('a')", &[]), "25006");
    c.batch_execute("ROLLBACK; BEGIN READ ONLY").unwrap();
    assert_dedup_error(c.query_one("SELECT dedup.purge()", &[]), "25006");
    c.batch_execute("ROLLBACK").unwrap();
    assert!(mark(&mut c, "b"), "nothing was marked by the refused calls");
}

#[test]
fn hot_standby_sees_replicated_marks_and_refuses_to_mark() {
    let primary = Cluster::start(&["wal_level = replica"]);
    let mut p = primary.fresh_db("standby");
    p.batch_execute("SELECT dedup.mark('before-backup')").unwrap();
    let standby = primary.standby();
    p.batch_execute("SELECT dedup.mark('after-backup')").unwrap();
    let mut s = standby.connect("standby");
    eventually("the standby sees the replicated mark", || {
        s.query_one("SELECT dedup.seen('after-backup')", &[]).unwrap().get::<_, bool>(0)
    });
    assert!(s.query_one("SELECT dedup.seen('before-backup')", &[]).unwrap().get::<_, bool>(0));
    assert!(!s.query_one("SELECT dedup.seen('never')", &[]).unwrap().get::<_, bool>(0));
    assert_dedup_error(s.query_one("SELECT dedup.mark('on-standby')", &[]), "25006");
    assert_dedup_error(s.query_one("SELECT * FROM dedup.mark_many(ARRAY['x'])", &[]), "25006");
}

#[test]
fn a_role_without_grants_can_do_nothing() {
    let mut admin = db("privileges_none");
    admin.batch_execute("DROP ROLE IF EXISTS nobody_app; CREATE ROLE nobody_app LOGIN").unwrap();
    admin.batch_execute("GRANT USAGE ON SCHEMA dedup TO nobody_app").unwrap();
    let mut c = cluster().connect_as("privileges_none", "nobody_app");
    for sql in [
        "SELECT dedup.mark('a')",
        "SELECT * FROM dedup.mark_many(ARRAY['a'])",
        "SELECT dedup.seen('a')",
        "SELECT dedup.forget('a')",
        "SELECT dedup.purge()",
        "SELECT dedup.create_inbox('mine')",
        "SELECT dedup.drop_inbox('default')",
        "SELECT * FROM dedup.inbox_default",
        "SELECT * FROM dedup.inboxes",
        "SELECT * FROM dedup.stats",
        "SELECT dedup.bloom_rebuild()",
    ] {
        let err = c.batch_execute(sql).expect_err(sql);
        assert_eq!(sqlstate(&err), "42501", "{sql}: {err}");
    }
    assert_eq!(count(&mut admin, "dedup.inbox_default"), 0);
}

/// The grants README documents for an application role, applied verbatim.
const APP_GRANTS: &str = "
    GRANT USAGE ON SCHEMA dedup TO app;
    GRANT EXECUTE ON FUNCTION dedup.mark(text, interval, text), dedup.mark_many(text[], interval, text),
                              dedup.seen(text, text) TO app;
    GRANT SELECT ON dedup.inbox_registry, dedup.inboxes TO app;
    GRANT SELECT, INSERT, UPDATE ON dedup.inbox_default TO app;";

#[test]
fn an_application_role_marks_only_in_the_inboxes_it_was_granted() {
    let mut admin = db("privileges_app");
    admin.batch_execute("DROP ROLE IF EXISTS app; CREATE ROLE app LOGIN").unwrap();
    admin.batch_execute(APP_GRANTS).unwrap();
    admin.batch_execute("SELECT dedup.create_inbox('payroll'); SELECT dedup.mark('secret', NULL, 'payroll')").unwrap();
    let mut c = cluster().connect_as("privileges_app", "app");
    assert!(mark(&mut c, "a"));
    assert!(!mark(&mut c, "a"));
    assert!(c.query_one("SELECT dedup.seen('a')", &[]).unwrap().get::<_, bool>(0));
    assert_eq!(c.query("SELECT * FROM dedup.mark_many(ARRAY['a', 'b'])", &[]).unwrap().len(), 1);
    assert_dedup_error(c.query_one("SELECT dedup.mark('x', NULL, 'payroll')", &[]), "42501");
    assert_dedup_error(c.query_one("SELECT dedup.seen('secret', 'payroll')", &[]), "42501");
    for sql in [
        "SELECT dedup.forget('a')",
        "SELECT dedup.purge()",
        "SELECT dedup.drop_inbox('payroll')",
        "SELECT dedup.create_inbox('mine')",
        "SELECT * FROM dedup.inbox_payroll",
        "DELETE FROM dedup.inbox_default",
    ] {
        let err = c.batch_execute(sql).expect_err(sql);
        assert_eq!(sqlstate(&err), "42501", "{sql}: {err}");
    }
}

#[test]
fn a_missing_grant_is_named_in_a_dedup_error() {
    let mut admin = db("privileges_partial");
    admin.batch_execute("DROP ROLE IF EXISTS partial_app; CREATE ROLE partial_app LOGIN").unwrap();
    // The application grants, less SELECT on the registry.
    let grants = APP_GRANTS.replace(" TO app;", " TO partial_app;").replace("dedup.inbox_registry, ", "");
    admin.batch_execute(&grants).unwrap();
    let mut c = cluster().connect_as("privileges_partial", "partial_app");
    let err = c.query_one("SELECT dedup.mark('a')", &[]).expect_err("the registry is not readable");
    assert!(err.as_db_error().unwrap().hint().unwrap().contains("GRANT SELECT ON dedup.inbox_registry"), "{err:?}");
    assert_dedup_error(Err::<(), _>(err), "42501");
    assert_dedup_error(c.query_one("SELECT dedup.seen('a')", &[]), "42501");
    assert_eq!(count(&mut admin, "dedup.inbox_default"), 0);
}

#[test]
fn without_preloading_a_session_is_told_once_what_it_misses() {
    db("not_preloaded");
    let (mut c, told) = connect_keeping_notices(cluster(), "not_preloaded");
    assert!(mark(&mut c, "a"));
    assert!(c.query_one("SELECT dedup.seen('a')", &[]).unwrap().get::<_, bool>(0));
    let told = told.lock().unwrap();
    assert_eq!(told.len(), 1, "once per session: {told:?}");
    assert!(told[0].0.contains("not in shared_preload_libraries"), "{:?}", told[0]);
    assert!(told[0].1.contains("Add pg_dedup to shared_preload_libraries"), "{:?}", told[0]);
}

#[test]
fn objects_on_the_callers_search_path_cannot_hijack_dedup() {
    let mut c = db("search_path");
    // Look-alikes of everything pg_dedup's statements use, each of which would raise if it were ever called.
    c.batch_execute(
        "CREATE SCHEMA evil;
         CREATE FUNCTION evil.trap(text, text) RETURNS boolean LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$;
         CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.trap);
         CREATE FUNCTION evil.unnest(anyarray) RETURNS SETOF text LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$;
         CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$;
         CREATE TEMP TABLE inbox_default (id text, expires_at timestamptz);
         SET search_path = evil, pg_temp, public, pg_catalog;",
    )
    .unwrap();
    assert!(mark(&mut c, "a"));
    assert!(!mark(&mut c, "a"));
    assert_eq!(c.query("SELECT * FROM dedup.mark_many(ARRAY['a', 'b', 'c'])", &[]).unwrap().len(), 2);
    assert!(c.query_one("SELECT dedup.seen('b')", &[]).unwrap().get::<_, bool>(0));
    assert!(c.query_one("SELECT dedup.forget('b')", &[]).unwrap().get::<_, bool>(0));
    c.batch_execute("SELECT dedup.create_inbox('other'); SELECT dedup.purge()").unwrap();
    assert_eq!(count(&mut c, "pg_temp.inbox_default"), 0, "the temp look-alike table was never written");
    assert_eq!(count(&mut c, "dedup.inbox_default"), 2);
}

#[test]
fn an_application_role_cannot_change_settings_or_the_inbox_tables() {
    // Preloaded, so that every setting is registered (without preload only dedup.bloom and dedup.batch_flush_keys
    // are).
    let server = preloaded("privileges_settings", &[]);
    let mut admin = server.fresh_db("privileges_settings");
    admin.batch_execute("CREATE ROLE app LOGIN").unwrap();
    admin.batch_execute(APP_GRANTS).unwrap();
    admin.batch_execute("SELECT dedup.mark('kept')").unwrap();
    let mut c = server.connect_as("privileges_settings", "app");
    assert!(mark(&mut c, "mine"), "the grants are enough to mark");
    // Every dedup setting is for the superuser (dedup.bloom) or the server's configuration (the rest), but one that
    // bounds only the memory of the session that sets it, as work_mem does.
    let per_session = "dedup.batch_flush_keys";
    let settings: Vec<(String, String)> = admin
        .query("SELECT name, context FROM pg_settings WHERE name LIKE 'dedup.%' ORDER BY name", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(settings.len() >= 8, "the extension's settings are registered: {settings:?}");
    assert!(settings.iter().any(|(name, _)| name == per_session), "{per_session} is registered: {settings:?}");
    for (name, context) in &settings {
        if name == per_session {
            assert_eq!(context, "user");
            c.batch_execute(&format!("SET {name} = 5000")).unwrap();
            let set: String = c.query_one(&format!("SHOW {name}"), &[]).unwrap().get(0);
            assert_eq!(set, "5000", "the role set it for its session");
            let err = c.batch_execute(&format!("ALTER SYSTEM SET {name} = 5000")).unwrap_err();
            assert_eq!(sqlstate(&err), "42501", "{err}");
            continue;
        }
        assert!(["superuser", "sighup", "postmaster"].contains(&context.as_str()), "{name} is settable by users");
        let value: String = admin.query_one(&format!("SHOW {name}"), &[]).unwrap().get(0);
        for sql in [
            format!("SET {name} = '{value}'"),
            format!("SELECT set_config('{name}', '{value}', false)"),
            format!("ALTER ROLE app SET {name} = '{value}'"),
            format!("ALTER SYSTEM SET {name} = '{value}'"),
        ] {
            let err = c.batch_execute(&sql).expect_err(&sql);
            // 42501: no privilege; 55P02: only settable at server start or in postgresql.conf.
            assert!(["42501", "55P02"].contains(&sqlstate(&err).as_str()), "{sql}: {err}");
        }
    }
    for sql in [
        "SELECT pg_reload_conf()",
        "DROP TABLE dedup.inbox_default",
        "TRUNCATE dedup.inbox_default",
        "ALTER TABLE dedup.inbox_default DISABLE TRIGGER USER",
        "ALTER TABLE dedup.inbox_default ADD COLUMN x int",
        "CREATE INDEX ON dedup.inbox_default (expires_at)",
        "DELETE FROM dedup.inbox_registry",
        "UPDATE dedup.inbox_registry SET default_ttl = '1 second'",
        "CREATE TABLE dedup.inbox_planted (id text PRIMARY KEY, expires_at timestamptz)",
        "DROP SCHEMA dedup CASCADE",
        "DROP EXTENSION pg_dedup",
    ] {
        let err = c.batch_execute(sql).expect_err(sql);
        assert_eq!(sqlstate(&err), "42501", "{sql}: {err}");
    }
    assert!(!mark(&mut admin, "kept"), "the admin's mark is still there");
    assert!(!mark(&mut admin, "mine"), "the application's mark is still there");
    assert_eq!(count(&mut admin, "dedup.inbox_default"), 2);
}
