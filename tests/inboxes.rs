//! Inboxes: independent namespaces, real tables, listed in dedup.inboxes, dumped by pg_dump.

use pg_dedup_tests::*;

#[test]
fn default_inbox_exists_after_create_extension() {
    let mut c = db("inbox_default");
    let row = c.query_one("SELECT default_ttl::text, relation::text FROM dedup.inboxes WHERE name = 'default'", &[]);
    let row = row.unwrap();
    assert_eq!(row.get::<_, String>(0), "3 days");
    assert_eq!(row.get::<_, String>(1), "dedup.inbox_default");
}

#[test]
fn inboxes_are_independent_namespaces() {
    let mut c = db("inbox_independent");
    c.batch_execute("SELECT dedup.create_inbox('billing', '1 hour'); SELECT dedup.create_inbox('emails')").unwrap();
    let row = c
        .query_one(
            "SELECT dedup.mark('evt-1', NULL, 'billing'), dedup.mark('evt-1', NULL, 'emails'), dedup.mark('evt-1')",
            &[],
        )
        .unwrap();
    assert!(row.get::<_, bool>(0) && row.get::<_, bool>(1) && row.get::<_, bool>(2), "one event, three consumers");
    let names: Vec<String> =
        c.query("SELECT name FROM dedup.inboxes ORDER BY name", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(names, ["billing", "default", "emails"]);
    let ttl: String =
        c.query_one("SELECT default_ttl::text FROM dedup.inboxes WHERE name = 'billing'", &[]).unwrap().get(0);
    assert_eq!(ttl, "01:00:00");
}

#[test]
fn dropping_an_inbox_removes_its_marks_and_the_name_can_be_reused() {
    let mut c = db("inbox_drop");
    c.batch_execute("SELECT dedup.create_inbox('tmp', '1 hour'); SELECT dedup.mark('a', NULL, 'tmp')").unwrap();
    c.batch_execute("SELECT dedup.drop_inbox('tmp')").unwrap();
    assert!(c.query_one("SELECT to_regclass('dedup.inbox_tmp') IS NULL", &[]).unwrap().get::<_, bool>(0));
    assert_dedup_error(c.query_one("SELECT dedup.mark('a', NULL, 'tmp')", &[]), "42704");
    // Same name, new TTL: this session's cached inbox must not survive the drop.
    c.batch_execute("SELECT dedup.create_inbox('tmp', '5 minutes')").unwrap();
    assert!(c.query_one("SELECT dedup.mark('a', NULL, 'tmp')", &[]).unwrap().get::<_, bool>(0));
    let short: bool = c
        .query_one("SELECT expires_at < now() + interval '6 minutes' FROM dedup.inbox_tmp WHERE id = 'a'", &[])
        .unwrap()
        .get(0);
    assert!(short, "the re-created inbox's default TTL applies");
}

#[test]
fn an_inbox_dropped_by_another_session_is_noticed() {
    let mut c = db("inbox_drop_other");
    c.batch_execute("SELECT dedup.create_inbox('gone'); SELECT dedup.mark('a', NULL, 'gone')").unwrap();
    connect("inbox_drop_other").batch_execute("SELECT dedup.drop_inbox('gone')").unwrap();
    assert_dedup_error(c.query_one("SELECT dedup.mark('b', NULL, 'gone')", &[]), "42704");
}

#[test]
fn drop_extension_refuses_to_orphan_inboxes() {
    let mut c = db("inbox_drop_extension");
    c.batch_execute("SELECT dedup.create_inbox('keep')").unwrap();
    let err = c.batch_execute("DROP EXTENSION pg_dedup").expect_err("inbox tables depend on the extension");
    assert_eq!(sqlstate(&err), "2BP01");
    c.batch_execute("DROP EXTENSION pg_dedup CASCADE; CREATE EXTENSION pg_dedup").unwrap();
    assert!(c.query_one("SELECT to_regclass('dedup.inbox_keep') IS NULL", &[]).unwrap().get::<_, bool>(0));
    assert!(mark(&mut c, "fresh"), "a re-created extension starts empty");
}

#[test]
fn pg_dump_and_restore_keep_every_inbox_and_mark() {
    let mut c = db("dump_source");
    c.batch_execute(
        "SELECT dedup.create_inbox('orders', '2 days');
         SELECT dedup.mark_many(ARRAY['d1', 'd2']);
         SELECT dedup.mark_many(ARRAY['o1', 'o2', 'o3'], NULL, 'orders');",
    )
    .unwrap();
    dump_and_restore(cluster(), "dump_source", "dump_target");
    let mut r = connect("dump_target");
    let ttl: String =
        r.query_one("SELECT default_ttl::text FROM dedup.inboxes WHERE name = 'orders'", &[]).unwrap().get(0);
    assert_eq!(ttl, "2 days");
    for (id, inbox) in [("d1", "default"), ("d2", "default"), ("o1", "orders"), ("o3", "orders")] {
        let again: bool = r.query_one("SELECT dedup.mark($1, NULL, $2)", &[&id, &inbox]).unwrap().get(0);
        assert!(!again, "{id} in {inbox} must survive dump and restore");
    }
    assert!(r.query_one("SELECT dedup.mark('o4', NULL, 'orders')", &[]).unwrap().get::<_, bool>(0));
}

#[test]
fn an_inbox_whose_table_was_dropped_by_hand_can_still_be_dropped() {
    let mut c = db("inbox_table_gone");
    c.batch_execute("SELECT dedup.create_inbox('hand'); DROP TABLE dedup.inbox_hand").unwrap();
    assert_dedup_error(c.query_one("SELECT dedup.mark('a', NULL, 'hand')", &[]), "42P01");
    c.batch_execute("SELECT dedup.drop_inbox('hand'); SELECT dedup.create_inbox('hand')").unwrap();
    assert!(c.query_one("SELECT dedup.mark('a', NULL, 'hand')", &[]).unwrap().get::<_, bool>(0));
}
