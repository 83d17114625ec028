//! Shared by every integration test binary: one throwaway cluster per binary (each test takes its own database),
//! and helpers to assert on `dedup:` errors. A suite run twice (tests/suites/, once on each server) gets its server
//! from the root file that includes it, not from here.

use pg_dedup_harness::postgres::{self, Client};
pub use pg_dedup_harness::Cluster;
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

static PLAIN: OnceLock<Cluster> = OnceLock::new();
static PRELOADED: OnceLock<Cluster> = OnceLock::new();
/// Every shared server a test binary started, destroyed when it exits (statics are never dropped).
static SHARED: Mutex<Vec<&'static OnceLock<Cluster>>> = Mutex::new(Vec::new());

extern "C" fn destroy_shared() {
    let cells = SHARED.lock().map(|cells| cells.clone()).unwrap_or_default();
    for cluster in cells.into_iter().filter_map(|c| c.get()) {
        cluster.destroy();
    }
}

/// The server in `cell`, started by `start` the first time, and stopped and removed when the test process exits:
/// for a binary that needs a shared server of its own settings.
pub fn shared(cell: &'static OnceLock<Cluster>, start: impl FnOnce() -> Cluster) -> &'static Cluster {
    cell.get_or_init(|| {
        let mut cells = SHARED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if cells.is_empty() {
            // SAFETY: registering a plain extern "C" function with no captured state, once per process.
            unsafe { libc::atexit(destroy_shared) };
        }
        cells.push(cell);
        drop(cells);
        start()
    })
}

/// The server a test binary shares (each test takes its own database), pg_dedup not preloaded: every call goes to
/// the index. Stopped when the test process exits.
pub fn plain_server() -> &'static Cluster {
    shared(&PLAIN, || Cluster::start(&[]))
}

/// The same with pg_dedup preloaded, its worker looking after database `postgres` only (so not after the tests'
/// databases): the Bloom filter answers, and certainly-new ids go straight into heap and indexes. The `_filtered`
/// binaries run their suite on it.
pub fn preloaded_server() -> &'static Cluster {
    shared(&PRELOADED, || preloaded("postgres", &[]))
}

/// The server of the binaries that are no suite: `plain_server()`.
pub fn cluster() -> &'static Cluster {
    plain_server()
}

/// A fresh database with pg_dedup installed, on the shared cluster.
pub fn db(name: &str) -> Client {
    cluster().fresh_db(name)
}

pub fn connect(db: &str) -> Client {
    cluster().connect(db)
}

/// The notices a connection received: (message, hint) each.
pub type Notices = Arc<Mutex<Vec<(String, String)>>>;

/// A connection as `postgres` that keeps every NOTICE the server sends it (message, hint).
pub fn connect_keeping_notices(cluster: &Cluster, db: &str) -> (Client, Notices) {
    let notices = Arc::new(Mutex::new(Vec::new()));
    let kept = notices.clone();
    let client = cluster
        .conn_string(db, "postgres")
        .parse::<postgres::Config>()
        .unwrap()
        .notice_callback(move |n| {
            kept.lock().unwrap().push((n.message().to_owned(), n.hint().unwrap_or("").to_owned()))
        })
        .connect(postgres::NoTls)
        .unwrap();
    (client, notices)
}

/// Asserts that `result` failed with SQLSTATE `code` and a `dedup:` message that has a hint.
pub fn assert_dedup_error<T: std::fmt::Debug>(result: Result<T, postgres::Error>, code: &str) {
    let err = result.expect_err("the call should have failed");
    let db = err.as_db_error().unwrap_or_else(|| panic!("not a server error: {err}"));
    assert_eq!(db.code().code(), code, "SQLSTATE of: {}", db.message());
    assert!(db.message().starts_with("dedup: "), "message does not name dedup: {}", db.message());
    assert!(db.hint().is_some_and(|h| !h.is_empty()), "no hint on: {}", db.message());
}

pub fn sqlstate(err: &postgres::Error) -> String {
    err.as_db_error().map(|e| e.code().code().to_owned()).unwrap_or_else(|| format!("not a db error: {err}"))
}

pub fn mark(client: &mut Client, id: &str) -> bool {
    client.query_one("SELECT dedup.mark($1)", &[&id]).expect("mark").get(0)
}

pub fn count(client: &mut Client, table: &str) -> i64 {
    client.query_one(&format!("SELECT count(*) FROM {table}"), &[]).expect("count").get(0)
}

/// The anonymous (heap) memory of server process `pid`, in bytes: palloc'd and Rust memory, not shared buffers.
pub fn anonymous_bytes(pid: i32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    rollup
        .lines()
        .find_map(|l| l.strip_prefix("Anonymous:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// When the server last started: a backend that crashed makes the postmaster restart every session, so a test
/// compares this before and after.
pub fn postmaster_started(client: &mut Client) -> String {
    client.query_one("SELECT pg_postmaster_start_time()::text", &[]).expect("start time").get(0)
}

/// The backend pid of a connection, to watch it from another one.
pub fn backend_pid(client: &mut Client) -> i32 {
    client.query_one("SELECT pg_backend_pid()", &[]).expect("pid").get(0)
}

/// Polls `done` until it holds; fails the test after a minute. Tests wait for outcomes, never for fixed times.
pub fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Does the shared filter answer for `inbox` (preloaded servers)?
pub fn trusted(c: &mut Client, inbox: &str) -> bool {
    c.query_one("SELECT filter_trusted FROM dedup.stats WHERE inbox = $1", &[&inbox]).unwrap().get(0)
}

/// Waits until the filter answers for `inbox`: the worker has loaded it (after a start, restart or crash).
pub fn wait_trusted(c: &mut Client, inbox: &str) {
    eventually(&format!("the worker loads inbox {inbox}"), || trusted(c, inbox));
}

/// Fails if the server warned about a resource left open (a buffer pin, relation or lock that a rolled-back
/// subtransaction should have released): "... reference leak ..." up to PostgreSQL 16, "resource was not closed"
/// from 17 on.
pub fn assert_no_resource_leaks(cluster: &Cluster) {
    let log = cluster.log();
    let leaks: Vec<&str> = log.lines().filter(|l| l.contains(" leak") || l.contains("was not closed")).collect();
    assert!(leaks.is_empty(), "resources left open:\n{}", leaks.join("\n"));
}

/// A server with pg_dedup preloaded, its background workers looking after `worker_databases`, plus `extra` lines.
pub fn preloaded(worker_databases: &str, extra: &[&str]) -> Cluster {
    let workers = format!("dedup.database = '{worker_databases}'");
    let mut conf = vec!["shared_preload_libraries = 'pg_dedup'", workers.as_str()];
    conf.extend_from_slice(extra);
    Cluster::start(&conf)
}

/// Waits until backend `pid` is blocked on a lock (a heavyweight lock wait, as seen in pg_stat_activity). This is
/// how a test proves that a concurrent mark() *waits*, without guessing at timings.
pub fn wait_until_blocked(observer: &mut Client, pid: i32) {
    eventually(&format!("backend {pid} blocks on a lock"), || {
        let row = observer
            .query_one("SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .expect("pg_stat_activity");
        row.get::<_, String>(0) == "Lock"
    });
}

/// Sleeps until the server clock has passed `expires_at` of the given ids in `table`: they are expired.
pub fn wait_until_expired(client: &mut Client, table: &str, ids: &[&str]) {
    let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    let sql = format!("SELECT count(*) FROM {table} WHERE id = ANY($1) AND expires_at > clock_timestamp()");
    eventually(&format!("the marks in {table} expire"), || {
        client.query_one(&sql, &[&ids]).expect("count live").get::<_, i64>(0) == 0
    });
}

/// Copies database `from` into a new database `to` of the same cluster with pg_dump and psql, as an operator would.
pub fn dump_and_restore(cluster: &Cluster, from: &str, to: &str) {
    let bindir = Command::new(pg_dedup_harness::pg_config()).arg("--bindir").output().unwrap();
    let bindir = String::from_utf8(bindir.stdout).unwrap().trim().to_owned();
    let dump = std::env::temp_dir().join(format!("pg_dedup_dump_{}_{from}.sql", std::process::id()));
    let out = Command::new(format!("{bindir}/pg_dump"))
        .args(["-d", &cluster.conn_string(from, "postgres"), "-f", dump.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "pg_dump: {}", String::from_utf8_lossy(&out.stderr));
    let mut admin = cluster.connect("postgres");
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {to}")).unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {to}")).unwrap();
    let out = Command::new(format!("{bindir}/psql"))
        .args(["-X", "-v", "ON_ERROR_STOP=1", "-q", "-d", &cluster.conn_string(to, "postgres")])
        .args(["-f", dump.to_str().unwrap()])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&dump);
    assert!(out.status.success(), "restore: {}", String::from_utf8_lossy(&out.stderr));
}

/// The ids of a load's `n`-th business transaction: one id, and every fifth time a batch of ten (`mark_many`'s
/// bulk insert path).
pub fn transaction_ids(prefix: &str, n: usize) -> Vec<String> {
    match n % 5 {
        4 => (0..10).map(|k| format!("{prefix}-{n}-{k}")).collect(),
        _ => vec![format!("{prefix}-{n}")],
    }
}

/// One business transaction of the crash and failover loads: marks `ids` (all must be new) and inserts them into
/// table `ledger`, committing both or neither. An Err is the server going away mid-transaction.
pub fn mark_and_record(c: &mut Client, ids: &[String]) -> Result<(), postgres::Error> {
    let mut tx = c.transaction()?;
    let fresh = tx.query("SELECT * FROM dedup.mark_many($1)", &[&ids])?.len();
    assert_eq!(fresh, ids.len(), "every id is new");
    tx.execute("INSERT INTO ledger SELECT unnest($1::text[])", &[&ids])?;
    tx.commit()
}

/// Names the seed of a randomised run, and the variable that replays it, when dropped by a panic:
/// `let _seed = SeedOnFailure("consumer chaos", "CHAOS_SEED", seed);`.
pub struct SeedOnFailure(pub &'static str, pub &'static str, pub u64);

impl Drop for SeedOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let SeedOnFailure(what, variable, seed) = *self;
            eprintln!("{what} failed in the run with seed {seed}: replay it with {variable}={seed}");
        }
    }
}
