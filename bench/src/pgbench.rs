//! Client-side runs with `pgbench`: a custom script, a number of clients, a synchronous_commit setting and a
//! duration; each run reports its transactions per second and the WAL it wrote per transaction.
//!
//! Client-side, because a single mark's cost is mostly the round trip and the commit, which a server-side loop
//! never pays; pgbench (C, prepared statements) keeps the client's own cost out of the comparison.

use crate::compare::Setting;
use crate::pin::OneCpu;
use pg_dedup_harness::postgres::Client;
use pg_dedup_harness::Cluster;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
    /// The server's CPU seconds per transaction during the run (crate::cpu: every `postgres` process).
    pub cpu_per_tx: f64,
}

pub struct Pgbench {
    bin: PathBuf,
    host: PathBuf,
    /// The server's postmaster, for pinned runs (`crate::pin`; read here, so a pinned run after a restart of the
    /// cluster is refused there).
    postmaster: u32,
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
            postmaster: cluster.postmaster_pid() as u32,
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

    /// Runs `script` at `setting` (its seconds, clients, synchronous_commit, and a connection per transaction or
    /// not). `c` is a separate connection, used only to read the WAL position before and after.
    pub fn run(&self, c: &mut Client, script: &Path, setting: &Setting) -> Run {
        let before: String = c.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).unwrap().get(0);
        let pin = setting.one_cpu.then(|| OneCpu::pin(self.postmaster));
        let mut command = self.command(script, setting.clients, setting.commit, setting.secs, pin.as_ref());
        if setting.connect_per_tx {
            command.arg("-C");
        }
        let cpu = crate::cpu::read();
        let out = command.arg(&self.db).output();
        let cpu = crate::cpu::since(&cpu);
        drop(pin);
        let wal: f64 = c
            .query_one("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::float8", &[&before])
            .unwrap()
            .get(0);
        let (transactions, tps) = self.summary(script, out);
        Run { tps, transactions, wal_per_tx: wal / transactions as f64, cpu_per_tx: cpu / transactions as f64 }
    }

    /// Runs `script` like `run` (sync off) and returns every transaction, from pgbench's per-transaction log: for
    /// latencies, and for rates over a part of the run (while something else happened).
    pub fn logged(&self, script: &Path, clients: u32, secs: u32) -> Vec<Txn> {
        static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!("log{}", RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let prefix = self.scripts.join(&name);
        let out = self
            .command(script, clients, Commit::Async, secs, None)
            .arg("--log")
            .arg("--log-prefix")
            .arg(&prefix)
            .arg(&self.db)
            .output();
        self.summary(script, out);
        // One file per pgbench thread: <prefix>.<pid>, <prefix>.<pid>.1, ...
        let mut txns = Vec::new();
        for file in std::fs::read_dir(&self.scripts).unwrap().map(|e| e.unwrap().path()) {
            if !file.file_name().unwrap().to_string_lossy().starts_with(&format!("{name}.")) {
                continue;
            }
            // "client_id transaction_no time script_no time_epoch time_us": the latency (µs), then when the
            // transaction ended (epoch seconds and microseconds).
            for line in std::fs::read_to_string(&file).unwrap().lines() {
                let f: Vec<f64> = line.split_whitespace().map(|v| v.parse().unwrap()).collect();
                txns.push(Txn { latency_ms: f[2] / 1000.0, end: f[4] + f[5] / 1e6 });
            }
            std::fs::remove_file(&file).unwrap();
        }
        assert!(!txns.is_empty(), "pgbench logged no transaction of {}", script.display());
        txns
    }

    /// pgbench with its options: `clients` connections (two threads when there are several) for `secs` seconds,
    /// on the pinned CPU if `pin`; the database goes last.
    fn command(&self, script: &Path, clients: u32, commit: Commit, secs: u32, pin: Option<&OneCpu>) -> Command {
        crate::pin::check_restored();
        let sync = if commit == Commit::Sync { "on" } else { "off" };
        let mut command = pin.map_or_else(|| Command::new(&self.bin), |pin| pin.command(&self.bin));
        command
            .env("PGOPTIONS", format!("-c synchronous_commit={sync}"))
            .arg("-h")
            .arg(&self.host)
            .args(["-p", "5432", "-U", "postgres", "-n", "-M", "prepared", "-f"])
            .arg(script)
            .args(["-c", &clients.to_string(), "-j", if clients > 1 { "2" } else { "1" }, "-T", &secs.to_string()]);
        command
    }

    /// Transactions and tps of a finished run; panics (with pgbench's output) when it failed or had failures.
    fn summary(&self, script: &Path, out: std::io::Result<Output>) -> (u64, f64) {
        let out = out.unwrap_or_else(|e| panic!("run {}: {e}", self.bin.display()));
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
        (transactions, field("tps = "))
    }
}

/// One transaction of a logged run.
pub struct Txn {
    pub latency_ms: f64,
    /// When it ended, in seconds since the Unix epoch.
    pub end: f64,
}

/// When the first and the last of `txns` ended.
pub fn span(txns: &[Txn]) -> (f64, f64) {
    let ends = txns.iter().map(|t| t.end);
    (ends.clone().fold(f64::INFINITY, f64::min), ends.fold(0.0, f64::max))
}

/// Seconds since the Unix epoch now, comparable with `Txn::end`.
pub fn epoch_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The `p`-th percentile (0..100) of `xs`, nearest rank.
pub fn percentile(mut xs: Vec<f64>, p: f64) -> f64 {
    assert!(!xs.is_empty(), "a percentile of nothing");
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = ((p / 100.0) * xs.len() as f64).ceil() as usize;
    xs[rank.clamp(1, xs.len()) - 1]
}

impl Drop for Pgbench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scripts);
    }
}
