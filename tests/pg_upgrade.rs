//! pg_upgrade from each earlier supported major (13 → 15 when testing 15; 13 → 18 and 15 → 18 when testing 18),
//! with the new major's own pg_upgrade, in copy and in --link mode. The old cluster is the full product: preloaded,
//! its worker and filter in use, four inboxes with their own TTLs, 12,003 marks of which 2,000 expired (not purged
//! yet). After each upgrade the new cluster holds every inbox and mark exactly (id and expires_at), the same
//! extension version and a consistent registry; its worker loads the filter, which then calls no old id new; live
//! ids are duplicates for mark(), mark_many() and seen(); new ids work; and its worker purges exactly the expired
//! marks.

use pg_dedup_harness::postgres::Client;
use pg_dedup_tests::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime};

/// The old cluster's inboxes: name, default TTL (None: the default inbox, made by CREATE EXTENSION), live marks,
/// expired marks. `idle` stays empty.
const INBOXES: [(&str, Option<&str>, usize, usize); 4] = [
    ("default", None, 4000, 0),
    ("orders", Some("7 days"), 4000, 1000),
    ("emails", Some("1 hour"), 2000, 1000),
    ("idle", Some("5 minutes"), 0, 0),
];

/// Both clusters run pg_dedup preloaded, its worker serving `app`. Purging waits until the new cluster has been
/// compared with the old one: the expired marks must cross the upgrade, as they do between two purge cycles.
const CONF: [&str; 3] = ["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'app'", "dedup.purge = off"];

/// PG 18's initdb enables data checksums by default, 13's and 15's do not, and pg_upgrade wants both sides alike.
const INITDB: [&str; 1] = ["--data-checksums"];

fn live_ids(inbox: &str, n: usize) -> Vec<String> {
    let mut ids: Vec<String> = (0..n).map(|i| format!("{inbox}-live-{i}")).collect();
    if inbox == "default" {
        // Ids must cross byte for byte: non-ASCII, quotes and spaces, and the longest id allowed.
        ids.extend(["ünïcödé ✓".to_owned(), "with space and 'quote'".to_owned(), "x".repeat(2048)]);
    }
    ids
}

fn expired_ids(inbox: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{inbox}-expired-{i}")).collect()
}

/// Everything of pg_dedup a database holds that an upgrade must keep.
#[derive(Debug, PartialEq)]
struct State {
    version: String,
    /// name, default_ttl, relation, created_at of every inbox (dedup.inboxes).
    inboxes: Vec<(String, String, String, SystemTime)>,
    /// Per inbox: id → expires_at, every row (expired ones too).
    marks: BTreeMap<String, BTreeMap<String, SystemTime>>,
}

fn state(c: &mut Client) -> State {
    let version = c.query_one("SELECT extversion FROM pg_extension WHERE extname = 'pg_dedup'", &[]).unwrap().get(0);
    let inboxes: Vec<(String, String, String, SystemTime)> = c
        .query("SELECT name, default_ttl::text, relation::text, created_at FROM dedup.inboxes ORDER BY name", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let mut marks = BTreeMap::new();
    for (name, ..) in &inboxes {
        let rows = c.query(&format!("SELECT id, expires_at FROM dedup.inbox_{name}"), &[]).unwrap();
        marks.insert(name.clone(), rows.iter().map(|r| (r.get(0), r.get(1))).collect());
    }
    State { version, inboxes, marks }
}

/// Compares without printing 12,000 marks: counts and a few examples of what differs.
fn assert_same_state(old: &State, new: &State, mode: &str) {
    assert_eq!(old.version, new.version, "{mode}: extension version");
    assert_eq!(old.inboxes, new.inboxes, "{mode}: dedup.inboxes");
    for (inbox, before) in &old.marks {
        let after = &new.marks[inbox];
        let missing: Vec<_> = before.keys().filter(|id| !after.contains_key(*id)).take(3).collect();
        let changed: Vec<_> = before.iter().filter(|(id, t)| after.get(*id).is_some_and(|a| a != *t)).take(3).collect();
        let extra: Vec<_> = after.keys().filter(|id| !before.contains_key(*id)).take(3).collect();
        assert!(
            missing.is_empty() && changed.is_empty() && extra.is_empty() && before.len() == after.len(),
            "{mode}: inbox {inbox} had {} marks, has {}; missing {missing:?}, expires_at changed {changed:?}, \
             extra {extra:?}",
            before.len(),
            after.len()
        );
    }
}

/// The supported majors to upgrade from, with their pg_config: those below `current` that `make test` has already
/// installed pg_dedup into in this run, i.e. listed before it in PG_VERSIONS (which the Makefile exports). Where
/// each major lives is scripts/pg.sh's to say. Err says why there is none.
fn earlier_majors(current: u32) -> Result<Vec<(u32, PathBuf)>, String> {
    let versions = std::env::var("PG_VERSIONS")
        .map_err(|_| "PG_VERSIONS is not set (make test exports it; by hand: PG_VERSIONS='13 15 18')".to_owned())?;
    let listed = versions.split_whitespace().map(|v| v.parse::<u32>().expect("PG_VERSIONS lists majors"));
    let earlier: Vec<u32> = listed.take_while(|&v| v != current).filter(|&v| v < current).collect();
    if earlier.is_empty() {
        return Err(format!("no supported major below {current} comes before it in PG_VERSIONS = '{versions}'"));
    }
    let pg_config_for = |major: u32| {
        let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/pg.sh"))
            .args(["pg_config_for", &major.to_string()])
            .output()
            .expect("run scripts/pg.sh");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "scripts/pg.sh pg_config_for {major}: {stderr}");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    };
    Ok(earlier.into_iter().map(|major| (major, pg_config_for(major))).collect())
}

/// Fills the old cluster's database `app`; returns its state, taken once the expired marks have expired.
fn populate(old: &Cluster) -> State {
    let mut c = old.fresh_db("app");
    wait_trusted(&mut c, "default");
    for (inbox, ttl, live, expired) in INBOXES {
        if let Some(ttl) = ttl {
            c.execute("SELECT dedup.create_inbox($1, $2::text::interval)", &[&inbox, &ttl]).unwrap();
        }
        for (ids, ttl) in [(live_ids(inbox, live), None), (expired_ids(inbox, expired), Some("1 millisecond"))] {
            for batch in ids.chunks(1000) {
                let new = c.query("SELECT * FROM dedup.mark_many($1, $2::text::interval, $3)", &[&batch, &ttl, &inbox]);
                assert_eq!(new.unwrap().len(), batch.len(), "every id is new in {inbox}");
            }
        }
        let expired = expired_ids(inbox, expired);
        let expired: Vec<&str> = expired.iter().map(|s| s.as_str()).collect();
        wait_until_expired(&mut c, &format!("dedup.inbox_{inbox}"), &expired);
    }
    // The filter was in use: it answered "certainly new" before the inserts, and the stats counted it.
    let answered: i64 = c.query_one("SELECT sum(certainly_new)::bigint FROM dedup.stats", &[]).unwrap().get(0);
    assert!(answered >= 10_000, "the old cluster's filter answered for only {answered} ids");
    state(&mut c)
}

/// Runs the new major's pg_upgrade (as the server's owner, in the new cluster's directory); returns its report, or
/// the report and the end of its logs.
fn pg_upgrade(old: &Cluster, new: &Cluster, options: &[&str]) -> Result<String, String> {
    let (old_data, new_data) = (old.data_dir(), new.data_dir());
    let mut args = vec![
        "-b",
        old.bindir().to_str().unwrap(),
        "-B",
        new.bindir().to_str().unwrap(),
        "-d",
        old_data.to_str().unwrap(),
        "-D",
        new_data.to_str().unwrap(),
        "-U",
        "postgres",
        "--no-sync",
    ];
    args.extend_from_slice(options);
    let out = new.run("pg_upgrade", &args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("pg_upgrade {options:?} failed:\n{stdout}\n{stderr}\n{}", upgrade_logs(new)));
    }
    Ok(stdout)
}

/// The errors and the last lines of each log pg_upgrade left (PG 15+ writes them under the new data directory, which
/// the failing test removes): its report only names the file.
fn upgrade_logs(new: &Cluster) -> String {
    let mut text = String::new();
    let runs = std::fs::read_dir(new.data_dir().join("pg_upgrade_output.d")).into_iter().flatten().flatten();
    for log in runs.flat_map(|run| std::fs::read_dir(run.path().join("log")).into_iter().flatten().flatten()) {
        let content = std::fs::read_to_string(log.path()).unwrap_or_default();
        let lines: Vec<&str> = content.lines().collect();
        let errors: Vec<&str> = lines.iter().copied().filter(|l| l.contains("ERROR") || l.contains("error:")).collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        text += &format!("--- {}\nerrors:\n{}\nlast lines:\n{tail}\n", log.path().display(), errors.join("\n"));
    }
    text
}

/// Sums a dedup.stats column over the given inboxes.
fn stat(c: &mut Client, column: &str, inboxes: &[&str]) -> i64 {
    let sql = format!("SELECT coalesce(sum({column}), 0)::bigint FROM dedup.stats WHERE inbox = ANY($1)");
    c.query_one(&sql, &[&inboxes]).unwrap().get(0)
}

fn count_where(c: &mut Client, predicate: &str, ids: &[String], inbox: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM unnest($1::text[]) id WHERE {predicate}");
    c.query_one(&sql, &[&ids, &inbox]).unwrap().get(0)
}

/// Everything the upgraded cluster must do, given the old cluster's state.
fn verify(new: &Cluster, expected: &State, mode: &str) {
    let mut c = new.connect("app");
    assert_same_state(expected, &state(&mut c), mode);
    let orphans: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'dedup'::regnamespace AND relkind = 'r'
                AND relname LIKE 'inbox\\_%' AND relname <> 'inbox_registry'
                AND substr(relname, 7) NOT IN (SELECT name FROM dedup.inbox_registry)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(orphans, 0, "{mode}: inbox tables without a registry row");

    // The worker loads every inbox (expired rows too); from then on no old id may be called certainly new.
    let names: Vec<&str> = INBOXES.iter().map(|i| i.0).collect();
    for inbox in &names {
        wait_trusted(&mut c, inbox);
    }
    let (lookups, certainly_new) = (stat(&mut c, "lookups", &names), stat(&mut c, "certainly_new", &names));
    for (inbox, _, live, expired) in INBOXES {
        let (live, expired) = (live_ids(inbox, live), expired_ids(inbox, expired));
        let seen = count_where(&mut c, "dedup.seen(id, $2)", &live, inbox);
        assert_eq!(seen, live.len() as i64, "{mode}: seen() of old ids in {inbox}");
        let seen = count_where(&mut c, "dedup.seen(id, $2)", &expired, inbox);
        assert_eq!(seen, 0, "{mode}: seen() of expired ids in {inbox}");
        let new = count_where(&mut c, "dedup.mark(id, NULL, $2)", &live, inbox);
        assert_eq!(new, 0, "{mode}: mark() calls old ids of {inbox} new");
        let again = c.query("SELECT * FROM dedup.mark_many($1, NULL, $2)", &[&live, &inbox]).unwrap();
        assert!(again.is_empty(), "{mode}: mark_many() calls {} old ids of {inbox} new", again.len());
        assert!(trusted(&mut c, inbox), "{mode}: the filter stopped answering for {inbox} during the checks");
    }
    let asked = stat(&mut c, "lookups", &names) - lookups;
    assert!(asked >= 20_000, "{mode}: the filter was asked only {asked} times: the checks bypassed it");
    assert_eq!(stat(&mut c, "certainly_new", &names), certainly_new, "{mode}: the filter called an old id new");

    // New ids work in every inbox, the filter answering for them.
    for inbox in &names {
        let fresh: Vec<String> = (0..1000).map(|i| format!("{inbox}-after-{i}")).collect();
        assert_eq!(c.query("SELECT * FROM dedup.mark_many($1, NULL, $2)", &[&fresh, inbox]).unwrap().len(), 1000);
        assert_eq!(count_where(&mut c, "dedup.seen(id, $2)", &fresh, inbox), 1000, "{mode}: new marks in {inbox}");
    }
    assert!(mark(&mut c, "after-the-upgrade") && !mark(&mut c, "after-the-upgrade"));
    assert!(stat(&mut c, "certainly_new", &names) > certainly_new, "{mode}: the filter answered for no new id");

    // The worker purges exactly the expired marks; they are then new again.
    // One statement each: ALTER SYSTEM refuses the implicit transaction of a batch.
    for sql in ["ALTER SYSTEM SET dedup.purge = on", "ALTER SYSTEM SET dedup.purge_interval = '1s'"] {
        c.batch_execute(sql).unwrap();
    }
    c.batch_execute("SELECT pg_reload_conf()").unwrap();
    let total_expired: usize = INBOXES.iter().map(|i| i.3).sum();
    eventually(&format!("{mode}: the worker purges the expired marks"), || {
        stat(&mut c, "purged", &names) >= total_expired as i64
    });
    assert_eq!(stat(&mut c, "purged", &names), total_expired as i64, "{mode}: purged more than the expired marks");
    for (inbox, _, live, expired) in INBOXES {
        let left = count(&mut c, &format!("dedup.inbox_{inbox}"));
        let live_now = live_ids(inbox, live).len() as i64 + 1000 + i64::from(inbox == "default");
        assert_eq!(left, live_now, "{mode}: marks left in {inbox} after the purge");
        let expired = expired_ids(inbox, expired);
        let new = c.query("SELECT * FROM dedup.mark_many($1, NULL, $2)", &[&expired, &inbox]).unwrap();
        assert_eq!(new.len(), expired.len(), "{mode}: purged ids of {inbox} are new again");
    }
}

/// Debian's PostgreSQL 15.20 (this machine's 15) gives every column of every table an attribute option
/// `pg_attver`, which PostgreSQL 18.6 (built from Debian's source package) does not know: pg_upgrade --check passes,
/// then restoring the schema fails on the first table, any table, with pg_dedup or without. Reported as a skip of
/// that pair, so the pair is tested as soon as the two builds agree.
const UNKNOWN_ATTRIBUTE_OPTION: &str = "unrecognized parameter \"pg_attver\"";

/// Builds a full old cluster of `old_major`, then upgrades it to the major under test by copying, then by linking.
fn upgrade_from(old_major: u32, old_pg_config: &Path, current: u32) {
    let started = Instant::now();
    let old = Cluster::init(old_pg_config, &INITDB, &CONF);
    old.pg_ctl_start();
    let expected = populate(&old);
    let marks: usize = expected.marks.values().map(|m| m.len()).sum();
    old.stop();

    // Copying leaves the old cluster as it was, so --link (which hands its files to the new one) can follow. Copy is
    // pg_upgrade's default mode (PG 15's has no --copy option; 16 added it).
    for (mode, options) in [("copy", &[][..]), ("--link", &["--link"][..])] {
        let new = Cluster::init(&pg_dedup_harness::pg_config(), &INITDB, &CONF);
        if mode == "copy" {
            let report = pg_upgrade(&old, &new, &["--check"]).unwrap_or_else(|failure| panic!("{failure}"));
            assert!(report.contains("Clusters are compatible"), "pg_upgrade --check:\n{report}");
        }
        match pg_upgrade(&old, &new, options) {
            Ok(_) => {}
            Err(failure) if failure.contains(UNKNOWN_ATTRIBUTE_OPTION) => {
                println!(
                    "pg_upgrade {old_major} -> {current} SKIPPED: this machine's PostgreSQL {old_major} stamps a \
                     column option `pg_attver` that PostgreSQL {current} rejects ({UNKNOWN_ATTRIBUTE_OPTION}), for \
                     any table; not pg_dedup's doing (pg_upgrade --check passed)"
                );
                return;
            }
            Err(failure) => panic!("{failure}"),
        }
        new.pg_ctl_start();
        verify(&new, &expected, mode);
        assert_no_resource_leaks(&new);
        println!(
            "pg_upgrade {mode} {old_major} -> {current}: {} inboxes, {marks} marks kept, filter reloaded, expired ones \
             purged",
            expected.inboxes.len(),
        );
    }
    println!("pg_upgrade {old_major} -> {current}: {:.1}s", started.elapsed().as_secs_f64());
}

#[test]
fn pg_upgrade_from_each_earlier_major_keeps_every_inbox_and_mark() {
    let current = pg_dedup_harness::major(&pg_dedup_harness::pg_config());
    match earlier_majors(current) {
        Ok(earlier) => earlier.iter().for_each(|(major, pg_config)| upgrade_from(*major, pg_config, current)),
        Err(why) => println!("pg_upgrade test SKIPPED on PostgreSQL {current}: {why}"),
    }
}
