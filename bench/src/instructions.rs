//! Server-side instructions per call, counted by callgrind. One `postgres --single` process (no client, no socket,
//! no WAL writer or other process to wake) runs a prepared statement N times and then 2N times, every call its own
//! transaction, each run from the same copy of the data directory (a run that writes leaves hint bits, dead rows
//! and index growth behind, which made the next run's count swing by a third: 1.02 G, 0.75 G, 0.53 G for 1,000,
//! 2,000 and 1,000 claim() + complete() requests run one after another); the difference over N is what one call
//! costs the server. Unlike throughput on a shared 2-core
//! machine it is exact from run to run, and it isolates what pg_dedup can change: Postgres's own work per
//! transaction, without the client round trip and the kernel's share, which dominate the throughput figures.
//! Skipped (with a message) when valgrind is not installed.

use crate::{Goal, Row, Scale};
use pg_dedup_harness::Cluster;
use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

const MARK: &str = "SELECT dedup.mark($1, interval '3 days')";
const RAW: &str = "INSERT INTO bench_raw (id, expires_at) VALUES ($1, now() + interval '3 days') \
                   ON CONFLICT DO NOTHING RETURNING true";
/// The same insert into the two-column table an expert writes (id and expiry, as in the clients section), holding
/// the same rows.
const EXPERT: &str = "INSERT INTO bench_expert (id, expires_at) VALUES ($1, now() + interval '3 days') \
                      ON CONFLICT DO NOTHING RETURNING true";
/// A transaction that does nothing with its id: the floor under both.
const FLOOR: &str = "SELECT $1::text IS NOT NULL";
/// Ids already in both tables (the duplicates' pool).
const PRELOADED: i64 = 100_000;

pub fn scenarios(scale: &Scale) -> Vec<Row> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!("[bench] valgrind is not installed: skipping the instruction counts (`apt-get install valgrind`)");
        return Vec::new();
    }
    let cluster = Cluster::init(
        &pg_dedup_harness::pg_config(),
        &[],
        &["shared_preload_libraries = 'pg_dedup'", "synchronous_commit = off", "shared_buffers = '256MB'"],
    );
    let setup = [
        "CREATE EXTENSION pg_dedup".to_owned(),
        "CREATE TABLE bench_raw (LIKE dedup.inbox_default INCLUDING ALL)".to_owned(),
        format!(
            "INSERT INTO dedup.inbox_default SELECT 'dup-' || g, now() + interval '30 days' \
             FROM generate_series(1, {PRELOADED}) g"
        ),
        "INSERT INTO bench_raw SELECT * FROM dedup.inbox_default".to_owned(),
        "CREATE TABLE bench_expert (id text COLLATE \"C\" PRIMARY KEY, expires_at timestamptz NOT NULL)".to_owned(),
        "CREATE INDEX ON bench_expert (expires_at)".to_owned(),
        "INSERT INTO bench_expert SELECT id, expires_at FROM dedup.inbox_default".to_owned(),
        // One line: postgres --single runs each line as one query string, its statements in order.
        crate::idempotency::setup_sql().replace('\n', " "),
        "VACUUM ANALYZE".to_owned(),
    ];
    single_user(&cluster, None, &setup.join("\n"));
    // The first session after DDL rebuilds the relation cache's init file: a one-time cost no measured run may pay.
    single_user(&cluster, None, "SELECT dedup.bloom_rebuild()");
    let start = cluster.data_dir().with_file_name("data_at_start");
    copy_dir(&cluster.data_dir(), &start);
    let n = scale.callgrind_calls;
    let mut run = 0;
    // Per request: `statements` (SQL with the id as $1) prepared once, then run in one transaction per id.
    let mut per_request = |statements: &[String], duplicates: bool| {
        let counts = [1, 2].map(|k| {
            run += 1;
            // Every run marks ids no run marked before, or draws from the preloaded ones.
            let id = |i: i64| {
                if duplicates {
                    format!("dup-{}", 1 + (i * 7919) % PRELOADED)
                } else {
                    format!("new-{run}-{i}")
                }
            };
            let mut script = String::from("SELECT dedup.bloom_rebuild()\n");
            for (s, statement) in statements.iter().enumerate() {
                writeln!(script, "PREPARE s{s}(text) AS {statement}").unwrap();
            }
            for i in 0..k * n {
                let id = id(i);
                let calls: Vec<String> = (0..statements.len()).map(|s| format!("EXECUTE s{s}('{id}')")).collect();
                match calls.as_slice() {
                    [one] => writeln!(script, "{one}").unwrap(),
                    many => writeln!(script, "BEGIN\n{}\nCOMMIT", many.join("\n")).unwrap(),
                }
            }
            std::fs::remove_dir_all(cluster.data_dir()).expect("remove the last run's data directory");
            copy_dir(&start, &cluster.data_dir());
            single_user(&cluster, Some(Path::new("valgrind")), &script)
        });
        (counts[1] as f64 - counts[0] as f64) / n as f64
    };
    let mut per_call = |statement: &str, duplicates: bool| per_request(&[statement.to_owned()], duplicates);
    let (mark, raw, floor) = (per_call(MARK, false), per_call(RAW, false), per_call(FLOOR, false));
    let expert = per_call(EXPERT, false);
    let (mark_dup, raw_dup) = (per_call(MARK, true), per_call(RAW, true));
    let claim = per_request(&crate::idempotency::ours_new("$1"), false);
    let hand = per_request(&crate::idempotency::hand_new("$1"), false);
    cluster.destroy();
    let unit = "instructions";
    vec![
        Row::new("server instructions per call, new id (callgrind)", ("mark", mark), ("raw insert", raw), unit),
        Row::new(
            "the same above the floor (a transaction doing nothing)",
            ("mark", mark - floor),
            ("raw insert", raw - floor),
            unit,
        ),
        Row::new(
            "server instructions per call, new id, vs a two-column table (callgrind)",
            ("mark", mark),
            ("raw insert", expert),
            unit,
        ),
        // A duplicate answered by reading the primary key directly costs less than ON CONFLICT's
        // pre-check and the executor around it.
        Row::new(
            "server instructions per call, duplicate (callgrind)",
            ("mark", mark_dup),
            ("raw insert", raw_dup),
            unit,
        )
        .goal(Goal::AtMost(0.8)),
        Row::new(
            "server instructions per request, claim() + complete() of a new key, 1 kB result (callgrind)",
            ("claim + complete", claim),
            ("hand-written", hand),
            unit,
        )
        .goal(Goal::AtMost(0.8)),
    ]
}

/// Copies data directory `from` to `to`, owner and permissions kept (`cp -a`).
fn copy_dir(from: &Path, to: &Path) {
    let status = Command::new("cp").arg("-a").arg(from).arg(to).status().expect("run cp");
    assert!(status.success(), "cp -a {} {} failed", from.display(), to.display());
}

/// Runs `script` (one statement per line) through `postgres --single`, under `wrapper` (valgrind's callgrind) if
/// given; returns the instructions callgrind collected (0 without it).
fn single_user(cluster: &Cluster, wrapper: Option<&Path>, script: &str) -> u64 {
    let postgres = cluster.bindir().join("postgres");
    let data = cluster.data_dir();
    let mut cmd = match wrapper {
        Some(valgrind) => {
            let mut c = cluster.as_owner(valgrind);
            c.args(["--tool=callgrind", "--callgrind-out-file=/dev/null"]).arg(&postgres);
            c
        }
        None => cluster.as_owner(&postgres),
    };
    let input = cluster.data_dir().with_file_name("single_user.sql");
    std::fs::write(&input, script).expect("write the single-user script");
    let out = cmd
        .arg("--single")
        .arg("-D")
        .arg(&data)
        .arg("postgres")
        .stdin(Stdio::from(std::fs::File::open(&input).expect("open the single-user script")))
        .output()
        .expect("run postgres --single");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !stderr.contains("ERROR:"), "postgres --single failed:\n{stdout}\n{stderr}");
    let collected =
        stderr.lines().find_map(|l| l.split("Collected :").nth(1)).map(|n| n.trim().parse().expect("a count"));
    if wrapper.is_some() {
        collected.expect("callgrind reports the instructions it collected")
    } else {
        0
    }
}
