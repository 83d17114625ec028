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
