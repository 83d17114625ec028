//! One client-side comparison: several sides (pgbench scripts, Redis, the disk's flush rate) at one setting
//! (clients, synchronous_commit, seconds per run), run alternately (every side once per round) and summarised as
//! medians, so the shared machine's noise hits every side alike.

use crate::pgbench::{Commit, Pgbench};
use crate::redis::Redis;
use crate::{alternate_samples, median, verbose};
use pg_dedup_harness::postgres::Client;
use std::path::PathBuf;

/// What one side runs.
pub enum Side<'a> {
    /// A pgbench script whose transactions handle `ids` ids each.
    Sql { script: PathBuf, ids: u32 },
    /// The same against the database of `pgbench` instead of the comparison's (on the same server, so the WAL
    /// figures still read the one server's position): a variant that needs a database of its own, such as
    /// Citus's function delegation, which holds for every call of the function in its database.
    SqlOn { pgbench: &'a Pgbench, script: PathBuf, ids: u32 },
    /// Redis `SET key 1 NX EX` (one id per request).
    Redis(&'a Redis),
    /// pg_test_fsync's fdatasync rate on this file (flushes per second; the setting's clients do not apply).
    Fsync(PathBuf),
}

pub struct Setting {
    pub clients: u32,
    pub commit: Commit,
    pub secs: u32,
    pub rounds: usize,
    /// A new connection for every transaction (`pgbench -C`): what connect-per-request applications pay.
    pub connect_per_tx: bool,
    /// pgbench and every server process on one CPU (`crate::pin`): the server's work per round trip without this
    /// machine's wake-ups of another CPU.
    pub one_cpu: bool,
}

impl Setting {
    /// "1 client, sync off", as rows name it (", a connection per tx" when each transaction connects, ", client
    /// and server on one CPU" when pinned).
    pub fn label(&self) -> String {
        let connect = if self.connect_per_tx { ", a connection per tx" } else { "" };
        let pinned = if self.one_cpu { ", client and server on one CPU" } else { "" };
        let clients = format!("{} client{}", self.clients, if self.clients == 1 { "" } else { "s" });
        format!("{clients}, {}{connect}{pinned}", self.commit.label())
    }
}

/// One side's medians over the rounds.
pub struct Measured {
    /// ids (or requests, or flushes) per second.
    pub rate: f64,
    /// WAL bytes per id (pgbench sides only).
    pub wal_per_id: Option<f64>,
    /// The server's CPU microseconds per id (pgbench sides only).
    pub cpu_per_id: Option<f64>,
    /// ids processed over all rounds (pgbench sides), i.e. the rows a side of all-new ids added to its table.
    pub ids: u64,
    /// Each round's rate, in round order: the median hides a round that went wrong, these show it.
    pub rounds: Vec<f64>,
}

struct Sample {
    rate: f64,
    wal_per_id: Option<f64>,
    cpu_per_id: Option<f64>,
    ids: u64,
}

fn sample(c: &mut Client, pgbench: &Pgbench, setting: &Setting, side: &Side) -> Sample {
    match side {
        Side::Sql { script, ids } | Side::SqlOn { script, ids, .. } => {
            let on = match side {
                Side::SqlOn { pgbench: other, .. } => *other,
                _ => pgbench,
            };
            let run = on.run(c, script, setting);
            let ids = *ids as f64;
            Sample {
                rate: run.tps * ids,
                wal_per_id: Some(run.wal_per_tx / ids),
                cpu_per_id: Some(run.cpu_per_tx * 1e6 / ids),
                ids: run.transactions * ids as u64,
            }
        }
        // Pinning applies to pgbench sides only: a pinned row with another side would be labelled wrongly.
        Side::Redis(_) | Side::Fsync(_) if setting.one_cpu => panic!("{} cannot run on one CPU", side.name()),
        Side::Redis(redis) => Sample {
            rate: redis.set_nx_rate(setting.clients, setting.secs),
            wal_per_id: None,
            cpu_per_id: None,
            ids: 0,
        },
        Side::Fsync(file) => {
            let rate = crate::fsync::fdatasync_rate(file, setting.secs.min(2));
            Sample { rate, wal_per_id: None, cpu_per_id: None, ids: 0 }
        }
    }
}

impl Side<'_> {
    fn name(&self) -> String {
        match self {
            Side::Sql { script, .. } | Side::SqlOn { script, .. } => {
                script.file_stem().unwrap_or_default().to_string_lossy().into_owned()
            }
            Side::Redis(_) => "redis".into(),
            Side::Fsync(_) => "pg_test_fsync".into(),
        }
    }
}

/// Runs `sides` alternately at `setting`; one result per side, in order. BENCH_VERBOSE=1 prints every run.
pub fn compare(c: &mut Client, pgbench: &Pgbench, setting: &Setting, sides: &[Side]) -> Vec<Measured> {
    let samples = alternate_samples(setting.rounds, sides.len(), |side, _| {
        let s = sample(c, pgbench, setting, &sides[side]);
        if verbose() {
            let wal = s.wal_per_id.map_or(String::new(), |w| format!(", WAL {w:.1} B/id"));
            let cpu = s.cpu_per_id.map_or(String::new(), |c| format!(", server CPU {c:.1} µs/id"));
            eprintln!("[bench]   {} ({}): {:.0}/s{wal}{cpu}", sides[side].name(), setting.label(), s.rate);
        }
        s
    });
    samples
        .into_iter()
        .map(|runs| Measured {
            rate: median(runs.iter().map(|s| s.rate).collect()),
            wal_per_id: runs.iter().map(|s| s.wal_per_id).collect::<Option<Vec<_>>>().map(median),
            cpu_per_id: runs.iter().map(|s| s.cpu_per_id).collect::<Option<Vec<_>>>().map(median),
            ids: runs.iter().map(|s| s.ids).sum(),
            rounds: runs.iter().map(|s| s.rate).collect(),
        })
        .collect()
}
