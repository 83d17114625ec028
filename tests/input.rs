//! Bad input: every rejected call raises a `dedup:` ERROR with a SQLSTATE and a hint, and marks nothing.

use pg_dedup_tests::*;

/// (statement, expected SQLSTATE)
const REJECTED: &[(&str, &str)] = &[
    ("SELECT dedup.mark(NULL)", "22004"),
    ("SELECT dedup.mark('')", "22023"),
    ("SELECT dedup.mark(repeat('x', 2049))", "54000"),
    ("SELECT dedup.mark(repeat('é', 1500))", "54000"),
    ("SELECT dedup.mark('a', interval '0')", "22023"),
    ("SELECT dedup.mark('a', interval '-1 day')", "22023"),
    ("SELECT dedup.mark('a', interval '1 day -2 hours')", "22023"),
    ("SELECT dedup.mark('a', interval '11 years')", "22023"),
    ("SELECT dedup.mark('a', interval '178000000 years')", "22023"),
    ("SELECT dedup.mark('a', NULL, NULL)", "22004"),
    ("SELECT dedup.mark('a', NULL, 'missing')", "42704"),
    ("SELECT dedup.mark('a', NULL, 'Orders')", "42602"),
    ("SELECT dedup.mark('a', NULL, 'x; DROP TABLE dedup.inbox_default')", "42602"),
    ("SELECT dedup.mark('a', NULL, 'x\"y')", "42602"),
    ("SELECT dedup.mark('a', NULL, 'ünicode')", "42602"),
    ("SELECT dedup.mark('a', NULL, '')", "42602"),
    ("SELECT * FROM dedup.mark_many(NULL)", "22004"),
    ("SELECT * FROM dedup.mark_many(ARRAY['a', NULL])", "22004"),
    ("SELECT * FROM dedup.mark_many(ARRAY['a', ''])", "22023"),
    ("SELECT * FROM dedup.mark_many(ARRAY['a', repeat('x', 3000)])", "54000"),
    ("SELECT * FROM dedup.mark_many(ARRAY['a'], interval '-1 second')", "22023"),
    ("SELECT * FROM dedup.mark_many(ARRAY['a'], NULL, 'missing')", "42704"),
    ("SELECT dedup.seen(NULL)", "22004"),
    ("SELECT dedup.seen('a', 'missing')", "42704"),
    ("SELECT dedup.forget(NULL)", "22004"),
    ("SELECT dedup.forget('a', NULL)", "22004"),
    ("SELECT dedup.create_inbox(NULL)", "22004"),
    ("SELECT dedup.create_inbox('default')", "42710"),
    ("SELECT dedup.create_inbox('a''; DROP SCHEMA dedup CASCADE; --')", "42602"),
    ("SELECT dedup.create_inbox(repeat('a', 49))", "42602"),
    ("SELECT dedup.create_inbox('fine', NULL)", "22004"),
    ("SELECT dedup.create_inbox('fine', interval '-3 days')", "22023"),
    ("SELECT dedup.drop_inbox('missing')", "42704"),
    ("SELECT dedup.drop_inbox('default')", "0A000"),
    ("SELECT dedup.drop_inbox(NULL)", "22004"),
    ("SELECT dedup.purge('missing')", "42704"),
    ("SELECT dedup.purge(NULL, -1)", "22023"),
];

#[test]
fn bad_input_gets_a_clear_error_and_marks_nothing() {
    let mut c = db("bad_input");
    for (sql, code) in REJECTED {
        eprintln!("checking: {sql}");
        let mut tx = c.transaction().unwrap();
        assert_dedup_error(tx.batch_execute(sql), code);
        tx.rollback().unwrap();
    }
    assert_eq!(count(&mut c, "dedup.inbox_default"), 0, "no rejected call left a mark");
    let inboxes: i64 = c.query_one("SELECT count(*) FROM dedup.inboxes", &[]).unwrap().get(0);
    assert_eq!(inboxes, 1, "no rejected call created an inbox");
}

#[test]
fn infinite_ttl_is_rejected_where_postgres_has_it() {
    let mut c = db("bad_infinity");
    // PostgreSQL 17 added infinite intervals; older majors reject the literal themselves.
    if c.query_one("SELECT 'infinity'::interval", &[]).is_ok() {
        assert_dedup_error(c.query_one("SELECT dedup.mark('a', 'infinity'::interval)", &[]), "22023");
        assert_dedup_error(c.query_one("SELECT dedup.mark('a', '-infinity'::interval)", &[]), "22023");
    }
    assert_eq!(count(&mut c, "dedup.inbox_default"), 0);
}

#[test]
fn ids_up_to_the_limit_work() {
    let mut c = db("long_ids");
    // Incompressible 2 KiB ids (random hex) must fit the unique index; repeated text would compress and hide it.
    let sql = "SELECT dedup.mark(left(string_agg(md5(random()::text), ''), 2048)) FROM generate_series(1, 70)";
    assert!(c.query_one(sql, &[]).unwrap().get::<_, bool>(0));
    let long = "é".repeat(1024); // 2048 bytes, multi-byte characters
    assert!(mark(&mut c, &long));
    assert!(!mark(&mut c, &long));
    assert_eq!(count(&mut c, "dedup.inbox_default"), 2);
}
