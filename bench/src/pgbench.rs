//! Client-side runs with `pgbench`: a custom script, a number of clients, a synchronous_commit setting and a
//! duration; each run reports its transactions per second and the WAL it wrote per transaction.
//!
//! Client-side, because a single mark's cost is mostly the round trip and the commit, which a server-side loop
//! never pays; pgbench (C, prepared statements) keeps the client's own cost out of the comparison.

use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::path::{Path, PathBuf};
use std::process::Command;

/// synchronous_commit for a run, set per session through PGOPTIONS (the cluster's default is off).
#[derive(Clone, Copy, PartialEq)]
pub enum Commit {
    Sync,
    Async,
}

impl Commit {
    pub fn label(self) -> &'static str {
        match self {
            Commit::Sync => "sync on",
            Commit::Async => "sync off",
        }
    }
}

pub struct Run {
    pub tps: f64,
    pub transactions: u64,
    /// WAL inserted during the run (pg_current_wal_insert_lsn() before and after) per transaction. Background
    /// records (running-xacts snapshots, a checkpoint) count too: a few bytes spread over the whole run.
    pub wal_per_tx: f64,
}

pub struct Pgbench {
    bin: PathBuf,
    host: PathBuf,
    db: String,
    /// Where the scripts are written (removed on drop).
    scripts: PathBuf,
}

impl Pgbench {
    pub fn new(cluster: &Cluster, db: &str) -> Pgbench {
        // One directory per instance: the Citus section has a Pgbench of its own, and dropping it must not take the
        // main one's scripts along (it did, and the next section found its directory gone).
        static INSTANCES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scripts = std::env::temp_dir().join(format!("pg_dedup_bench_scripts_{}_{n}", std::process::id()));
        std::fs::create_dir_all(&scripts).expect("create the pgbench script directory");
        Pgbench {
            bin: pg_dedup_harness::bindir().join("pgbench"),
            host: cluster.socket_dir().to_owned(),
            db: db.into(),
            scripts,
        }
    }

    /// Writes a pgbench script (`\set` lines and one SQL statement per line) and returns its path.
    pub fn script(&self, name: &str, text: &str) -> PathBuf {
        let path = self.scripts.join(format!("{name}.sql"));
        std::fs::write(&path, text).expect("write a pgbench script");
        path
    }

    /// Runs `script` for `secs` seconds with `clients` connections (two pgbench threads when there are several).
    /// `c` is a separate connection, used only to read the WAL position before and after.
    pub fn run(&self, c: &mut Client, script: &Path, clients: u32, commit: Commit, secs: u32) -> Run {
        let before: String = c.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).unwrap().get(0);
        let sync = if commit == Commit::Sync { "on" } else { "off" };
        let out = Command::new(&self.bin)
            .env("PGOPTIONS", format!("-c synchronous_commit={sync}"))
            .arg("-h")
            .arg(&self.host)
            .args(["-p", "5432", "-U", "postgres", "-n", "-M", "prepared", "-f"])
            .arg(script)
            .args(["-c", &clients.to_string(), "-j", if clients > 1 { "2" } else { "1" }, "-T", &secs.to_string()])
            .arg(&self.db)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.bin.display()));
        let wal: f64 = c
            .query_one("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::float8", &[&before])
            .unwrap()
            .get(0);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let failed = || -> ! {
            panic!("pgbench {} failed:\n{stdout}\n{}", script.display(), String::from_utf8_lossy(&out.stderr))
        };
        if !out.status.success() {
            failed();
        }
        let field = |prefix: &str| -> f64 {
            let line = stdout.lines().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| failed());
            // "5729" after "processed: ", "5731.2 (without initial connection time)" after "tps = ".
            line.trim().split([' ', '/']).next().and_then(|v| v.parse().ok()).unwrap_or_else(|| failed())
        };
        let transactions = field("number of transactions actually processed:") as u64;
        if transactions == 0
            || stdout.lines().any(|l| l.starts_with("number of failed transactions: ") && !l.contains(": 0 "))
        {
            failed();
        }
        Run { tps: field("tps = "), transactions, wal_per_tx: wal / transactions as f64 }
    }
}

impl Drop for Pgbench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scripts);
    }
}
