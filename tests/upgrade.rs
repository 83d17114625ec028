//! Extension upgrades: the install script of every earlier release (sql/releases/) still installs, its marks
//! survive `ALTER EXTENSION pg_dedup UPDATE`, and the upgraded database ends up with exactly the objects of a fresh
//! install of the current version — so a change to the SQL surface without an upgrade script fails here.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;

/// A fresh database with pg_dedup at `version`.
fn database_at(name: &str, version: &str) -> Client {
    let mut c = db(name);
    c.batch_execute(&format!("DROP EXTENSION pg_dedup; CREATE EXTENSION pg_dedup VERSION '{version}'")).unwrap();
    c
}

fn installed_version(c: &mut Client) -> String {
    c.query_one("SELECT extversion FROM pg_extension WHERE extname = 'pg_dedup'", &[]).unwrap().get(0)
}

/// Everything a database's pg_dedup consists of, one line per object and property, sorted.
fn surface(c: &mut Client) -> Vec<String> {
    c.query(
        "SELECT pg_describe_object(d.classid, d.objid, 0) FROM pg_depend d JOIN pg_extension e ON d.refobjid = e.oid
          WHERE e.extname = 'pg_dedup' AND d.deptype = 'e'
         UNION ALL
         SELECT format('%s (%s) -> %s [%s] volatile=%s parallel=%s secdef=%s strict=%s acl=%s', p.oid::regprocedure,
                       pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.prosrc, p.provolatile,
                       p.proparallel, p.prosecdef, p.proisstrict, p.proacl)
           FROM pg_proc p WHERE p.pronamespace = 'dedup'::regnamespace
         UNION ALL
         SELECT format('%s %s (%s) acl=%s options=%s', c.relkind, c.oid::regclass,
                       (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                          || coalesce(' collate ' || co.collname, ''), ', ' ORDER BY a.attnum)
                          FROM pg_attribute a LEFT JOIN pg_collation co ON co.oid = a.attcollation
                                                                        AND a.attcollation <> 100
                         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
                       c.relacl, c.reloptions)
           FROM pg_class c WHERE c.relnamespace = 'dedup'::regnamespace
         UNION ALL
         SELECT 'view ' || v.oid::regclass || ': ' || pg_get_viewdef(v.oid)
           FROM pg_class v WHERE v.relnamespace = 'dedup'::regnamespace AND v.relkind = 'v'
         UNION ALL
         SELECT pg_get_triggerdef(t.oid) || ' enabled=' || t.tgenabled::text FROM pg_trigger t
           JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = 'dedup'::regnamespace AND NOT t.tgisinternal
         UNION ALL
         SELECT 'schema acl ' || coalesce(nspacl::text, '') FROM pg_namespace WHERE nspname = 'dedup'
         UNION ALL
         SELECT 'dumped ' || u.tbl::regclass || ' where ' || coalesce(u.cond, '')
           FROM pg_extension e, unnest(e.extconfig, e.extcondition) AS u(tbl, cond) WHERE e.extname = 'pg_dedup'
         ORDER BY 1",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[test]
fn every_earlier_release_upgrades_keeping_its_marks_and_ends_up_like_a_fresh_install() {
    let mut fresh = db("upgrade_fresh");
    let current = installed_version(&mut fresh);
    let earlier: Vec<String> = fresh
        .query(
            "SELECT version FROM pg_available_extension_versions WHERE name = 'pg_dedup' AND version <> $1 ORDER BY 1",
            &[&current],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(earlier.contains(&"0.1.0".to_owned()), "the 0.1.0 install script is installed: {earlier:?}");
    let expected = surface(&mut fresh);
    let ids: Vec<String> = (0..500).map(|i| format!("order-{i}-created")).collect();
    for version in &earlier {
        let name = format!("upgrade_from_{}", version.replace('.', "_"));
        let mut c = database_at(&name, version);
        assert_eq!(&installed_version(&mut c), version);
        // Before the update, the old SQL reads its stats through the functions the library keeps for it.
        c.query("SELECT * FROM dedup.stats", &[]).unwrap_or_else(|e| panic!("dedup.stats of {version}: {e}"));
        c.batch_execute("SELECT dedup.create_inbox('orders', '7 days')").unwrap();
        assert_eq!(c.query("SELECT * FROM dedup.mark_many($1)", &[&ids]).unwrap().len(), 500);
        assert!(c.query_one("SELECT dedup.mark('o-1', NULL, 'orders')", &[]).unwrap().get::<_, bool>(0));

        c.batch_execute("ALTER EXTENSION pg_dedup UPDATE").unwrap();
        assert_eq!(installed_version(&mut c), current, "updated from {version}");
        assert!(c.query("SELECT * FROM dedup.mark_many($1)", &[&ids]).unwrap().is_empty(), "marks kept from {version}");
        assert!(!c.query_one("SELECT dedup.mark('o-1', NULL, 'orders')", &[]).unwrap().get::<_, bool>(0));
        assert!(mark(&mut c, "after-the-upgrade"));
        let ttl: String =
            c.query_one("SELECT default_ttl::text FROM dedup.inboxes WHERE name = 'orders'", &[]).unwrap().get(0);
        assert_eq!(ttl, "7 days");
        // Compare with a fresh install, leaving out the inbox this test created.
        let upgraded: Vec<String> = surface(&mut c).into_iter().filter(|l| !l.contains("inbox_orders")).collect();
        let only_upgraded: Vec<_> = upgraded.iter().filter(|l| !expected.contains(l)).collect();
        let only_fresh: Vec<_> = expected.iter().filter(|l| !upgraded.contains(l)).collect();
        assert!(
            only_upgraded.is_empty() && only_fresh.is_empty(),
            "after upgrading from {version}, not as in a fresh install:\n{only_upgraded:#?}\nmissing:\n{only_fresh:#?}"
        );
    }
}

/// 0.2.0's docs had inbox administrators granted CREATE on schema dedup, INSERT and DELETE on the registry and
/// EXECUTE on the trigger function, and their inboxes were tables they owned: the update takes all of that back
/// keeps their inboxes working, and says what it could not hand over or remove.
#[test]
fn an_update_from_0_2_0_takes_back_what_its_docs_granted() {
    let (mut c, warnings) = {
        let c = database_at("upgrade_grants", "0.2.0");
        drop(c);
        let (c, notices) = connect_keeping_notices(cluster(), "upgrade_grants");
        (c, notices)
    };
    c.batch_execute(
        "CREATE ROLE legacy_admin LOGIN; CREATE ROLE legacy_app LOGIN;
         GRANT USAGE, CREATE ON SCHEMA dedup TO legacy_admin;
         GRANT SELECT, INSERT, DELETE ON dedup.inbox_registry TO legacy_admin;
         GRANT EXECUTE ON FUNCTION dedup.create_inbox(text, interval), dedup.drop_inbox(text),
                                   dedup.inbox_filter_trigger() TO legacy_admin;
         GRANT USAGE ON SCHEMA dedup TO legacy_app;
         GRANT EXECUTE ON FUNCTION dedup.mark(text, interval, text) TO legacy_app;
         GRANT SELECT ON dedup.inbox_registry TO legacy_app;",
    )
    .unwrap();
    // What 0.2.0's create_inbox() made for its caller, as that caller, and what such a caller could then do.
    let legacy_inbox = |name: &str| {
        format!(
            "CREATE TABLE dedup.inbox_{name} OF dedup.inbox_row (id WITH OPTIONS PRIMARY KEY, expires_at WITH OPTIONS NOT NULL);
             CREATE INDEX ON dedup.inbox_{name} (expires_at);
             CREATE TRIGGER dedup_filter BEFORE INSERT OR UPDATE ON dedup.inbox_{name}
               FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger();
             ALTER TABLE dedup.inbox_{name} ENABLE ALWAYS TRIGGER dedup_filter;
             INSERT INTO dedup.inbox_registry (name, default_ttl) VALUES ('{name}', '1 day');"
        )
    };
    c.batch_execute(&format!(
        "SET ROLE legacy_admin;
         {}
         {}
         CREATE FUNCTION dedup.audit() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
         CREATE TRIGGER audit BEFORE INSERT ON dedup.inbox_legacy_code FOR EACH ROW EXECUTE FUNCTION dedup.audit();
         CREATE FUNCTION dedup.mark(id varchar) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         GRANT SELECT, INSERT, UPDATE ON dedup.inbox_legacy TO legacy_app;
         RESET ROLE;",
        legacy_inbox("legacy"),
        legacy_inbox("legacy_code")
    ))
    .unwrap();
    let mut app = cluster().connect_as("upgrade_grants", "legacy_app");
    assert!(app.query_one("SELECT dedup.mark('before', NULL, 'legacy')", &[]).unwrap().get::<_, bool>(0));

    warnings.lock().unwrap().clear();
    c.batch_execute("ALTER EXTENSION pg_dedup UPDATE").unwrap();
    let warned: Vec<String> = warnings.lock().unwrap().iter().map(|(m, h)| format!("{m} / {h}")).collect();

    let yes = |c: &mut Client, sql: &str| c.query_one(&format!("SELECT {sql}"), &[]).unwrap().get::<_, bool>(0);
    assert!(!yes(&mut c, "has_schema_privilege('legacy_admin', 'dedup', 'CREATE')"), "CREATE on the schema revoked");
    for privilege in ["INSERT", "UPDATE", "DELETE", "TRUNCATE"] {
        assert!(
            !yes(&mut c, &format!("has_table_privilege('legacy_admin', 'dedup.inbox_registry', '{privilege}')")),
            "{privilege} on the registry revoked"
        );
    }
    assert!(yes(&mut c, "has_table_privilege('legacy_admin', 'dedup.inbox_registry', 'SELECT')"));
    assert!(!yes(&mut c, "has_function_privilege('legacy_admin', 'dedup.inbox_filter_trigger()', 'EXECUTE')"));
    // The plain inbox was handed over; its creator keeps what it needs, its application too.
    let owner = |c: &mut Client, table: &str| {
        c.query_one(&format!("SELECT relowner::regrole::text FROM pg_class WHERE oid = '{table}'::regclass"), &[])
            .unwrap()
            .get::<_, String>(0)
    };
    assert_eq!(owner(&mut c, "dedup.inbox_legacy"), "postgres");
    assert!(yes(&mut c, "has_table_privilege('legacy_admin', 'dedup.inbox_legacy', 'DELETE WITH GRANT OPTION')"));
    assert!(!yes(&mut c, "has_table_privilege('legacy_admin', 'dedup.inbox_legacy', 'TRIGGER')"));
    assert!(!app.query_one("SELECT dedup.mark('before', NULL, 'legacy')", &[]).unwrap().get::<_, bool>(0));
    assert!(app.query_one("SELECT dedup.mark('after', NULL, 'legacy')", &[]).unwrap().get::<_, bool>(0));
    let trigger: String = c
        .query_one(
            "SELECT pg_get_triggerdef(oid) || ' ' || tgenabled::text FROM pg_trigger WHERE tgname = 'dedup_filter'
               AND tgrelid = 'dedup.inbox_legacy'::regclass",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(trigger.contains("AFTER INSERT OR UPDATE OF id") && trigger.ends_with(" A"), "{trigger}");
    // The inbox with code of its own keeps its owner, and the update says so; so for the planted overload.
    assert_eq!(owner(&mut c, "dedup.inbox_legacy_code"), "legacy_admin");
    assert!(warned.iter().any(|w| w.contains("dedup.inbox_legacy_code stays owned by legacy_admin")), "{warned:#?}");
    assert!(
        warned.iter().any(|w| w.contains("function dedup.mark(id character varying)") && w.contains("DROP FUNCTION")),
        "{warned:#?}"
    );
    // Nothing more can be planted.
    let mut admin = cluster().connect_as("upgrade_grants", "legacy_admin");
    let err =
        admin.batch_execute("CREATE FUNCTION dedup.seen(id varchar) RETURNS boolean LANGUAGE sql AS 'SELECT true'");
    assert_eq!(sqlstate(&err.expect_err("no CREATE on schema dedup")), "42501");
    let err = admin.batch_execute("DELETE FROM dedup.inbox_registry WHERE name = 'default'");
    assert_eq!(sqlstate(&err.expect_err("no DELETE on the registry")), "42501");
}

/// An attachment made by 0.3.0 (its trigger without the WHEN clause that names the key) is made again by the update,
/// so PostgreSQL records what its key uses; one whose table went without pg_dedup seeing it is removed.
#[test]
fn an_update_from_0_3_0_records_what_attached_keys_depend_on() {
    let mut c = database_at("upgrade_attach", "0.3.0");
    // As 0.3.0's attach() left them: the trigger, enabled always, and the registry row.
    let attached_as_in_0_3_0 = |table: &str, key: &str| {
        format!(
            "CREATE TABLE {table} (event_id text);
             CREATE TRIGGER zz_dedup_attached BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION dedup.attached_insert();
             ALTER TABLE {table} ENABLE ALWAYS TRIGGER zz_dedup_attached;
             INSERT INTO dedup.attachment_registry (tbl, key, inbox, on_duplicate) VALUES ('{table}', '{key}', 'default', 'skip');"
        )
    };
    c.batch_execute(&format!(
        "CREATE FUNCTION public.norm(t text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN lower(t); END $$;
         {}
         {}
         ALTER EVENT TRIGGER dedup_watch_drop DISABLE; DROP TABLE gone; ALTER EVENT TRIGGER dedup_watch_drop ENABLE ALWAYS;
         INSERT INTO feed VALUES ('A'), ('a');",
        attached_as_in_0_3_0("feed", "public.norm(event_id)"),
        attached_as_in_0_3_0("gone", "event_id"),
    ))
    .unwrap();
    // A key 0.3.0 let through that 0.4.0 refuses (a system column): the update goes on, and says which table.
    c.batch_execute(&attached_as_in_0_3_0("by_ctid", "(ctid)::text")).unwrap();
    assert_eq!(count(&mut c, "feed"), 1);
    assert_eq!(count(&mut c, "dedup.attachments"), 3);
    // A monitoring role as docs/privileges.md of 0.3.0 set it up.
    c.batch_execute(
        "DROP ROLE IF EXISTS monitor_030; CREATE ROLE monitor_030 LOGIN; GRANT USAGE ON SCHEMA dedup TO monitor_030;
         GRANT SELECT ON dedup.stats, dedup.inbox_registry, dedup.inbox_default TO monitor_030;
         GRANT EXECUTE ON FUNCTION dedup.inbox_counters(), dedup.worker_stats(), dedup.filter_stats() TO monitor_030;
         DROP ROLE IF EXISTS api_030; CREATE ROLE api_030 LOGIN; GRANT USAGE ON SCHEMA dedup TO api_030;
         GRANT SELECT, INSERT, UPDATE ON dedup.inbox_default TO api_030; GRANT SELECT ON dedup.inbox_registry TO api_030;
         GRANT EXECUTE ON FUNCTION dedup.claim(text, text, interval, text, boolean, interval) TO api_030;
         DROP ROLE IF EXISTS \"Api Team\"; CREATE ROLE \"Api Team\";
         GRANT EXECUTE ON FUNCTION dedup.claim(text, text, interval, text, boolean, interval)
           TO \"Api Team\" WITH GRANT OPTION;",
    )
    .unwrap();
    drop(c);
    let (mut c, warnings) = connect_keeping_notices(cluster(), "upgrade_attach");
    c.batch_execute("ALTER EXTENSION pg_dedup UPDATE").unwrap();
    let warned: Vec<String> = warnings.lock().unwrap().iter().map(|(m, _)| m.clone()).collect();
    assert!(
        warned.iter().any(|w| w.contains("by_ctid stays attached as pg_dedup 0.3.0 attached it") && w.contains("ctid")),
        "{warned:#?}"
    );
    let mut monitor = cluster().connect_as("upgrade_attach", "monitor_030");
    let inboxes: i64 = monitor.query_one("SELECT count(*) FROM dedup.stats", &[]).unwrap().get(0);
    assert_eq!(inboxes, 1, "the monitoring role still reads dedup.stats (EXECUTE on inbox_figures() came along)");
    // claim() was made again to return one row of dedup.claim_result: its grant came along, and it reads as before.
    let mut api = cluster().connect_as("upgrade_attach", "api_030");
    let row = api.query_one("SELECT state, result FROM dedup.claim('k-030')", &[]).unwrap();
    assert_eq!(row.get::<_, String>(0), "new");
    let states: Vec<String> =
        api.query("SELECT * FROM dedup.claim('k-030')", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(states, ["completed"], "a mark of another transaction (autocommit) without complete()");
    let kept: bool = c
        .query_one(
            "SELECT has_function_privilege('Api Team', 'dedup.claim(text, text, interval, text, boolean, interval)',
                                           'EXECUTE WITH GRANT OPTION')",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(kept, "a grant to a role whose name needs quoting came along, with its grant option");
    let attached: Vec<String> =
        c.query("SELECT tbl::text FROM dedup.attachments ORDER BY 1", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(attached, ["by_ctid", "feed"], "the attachment of the table that is gone went");
    let err = c.batch_execute("DROP FUNCTION public.norm(text)").unwrap_err();
    assert_eq!(sqlstate(&err), "2BP01", "the key's function is now a recorded dependency: {err}");
    c.batch_execute("INSERT INTO feed VALUES ('A')").unwrap();
    assert_eq!(count(&mut c, "feed"), 1, "still deduplicated");
}
