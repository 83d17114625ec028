//! One client-side comparison: several sides (pgbench scripts, Redis, the disk's flush rate) at one setting
//! (clients, synchronous_commit, seconds per run), run alternately (every side once per round) and summarised as
//! medians, so the shared machine's noise hits every side alike. And a paired comparison of two sides, for a ratio
//! that medians of a few rounds cannot place on either side of its goal.

use crate::pgbench::{Commit, Pgbench};
use crate::redis::Redis;
use crate::{alternate_samples, median, verbose, Row, Scale};
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
    /// The same setting for a paired comparison: the scale's pairs of short runs instead of its rounds.
    pub fn paired(&self, scale: &Scale) -> Setting {
        Setting { secs: scale.pair_secs, rounds: scale.pairs, ..*self }
    }

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

/// Two sides compared pair by pair (`paired`).
pub struct Paired {
    /// The geometric means of A's and of B's rates: A / B is the geometric mean of the pairs' ratios.
    pub a: f64,
    pub b: f64,
    /// The 90% interval of A / B.
    pub low: f64,
    pub high: f64,
    /// Each pair's rates of A and of B, in order.
    pub rounds: [Vec<f64>; 2],
}

impl Paired {
    /// The row of A against B: the geometric means, each pair's rates and the interval.
    pub fn row(&self, scenario: &str, a_label: &str, b_label: &str, unit: &'static str) -> Row {
        Row::new(scenario, (a_label, self.a), (b_label, self.b), unit)
            .rounds(&self.rounds[0], &self.rounds[1])
            .interval(self.low, self.high)
    }
}

/// Runs `a` and `b` in pairs of short runs back to back, A B, B A, A B, ... (`setting.rounds` pairs of
/// `setting.secs` seconds). A side's rate moves by ±20% from one run to the next on this shared machine, and a round
/// of several sides spreads one side's runs over tens of seconds (a minute with the Citus section's eleven): medians
/// of five rounds then land anywhere within about ±10% of the truth. The two runs of a pair share the machine's
/// state of the moment, so the pair's ratio is far steadier than either rate.
pub fn paired(c: &mut Client, pgbench: &Pgbench, setting: &Setting, a: Side, b: Side) -> Paired {
    let mut m = compare(c, pgbench, setting, &[a, b]).into_iter();
    let (a, b) = (m.next().unwrap().rounds, m.next().unwrap().rounds);
    paired_ratio(a, b)
}

/// Blocks of consecutive pairs whose mean log-ratios give the interval, from 10 pairs on.
const BLOCKS: usize = 5;

/// The geometric means and the 90% interval (Student's t) of A / B, from the rates of each pair's two runs, in
/// order (`paired`'s, or those of another pair of sides, like the purge's backlogs). Neighbouring pairs are not
/// independent: the tables grow, the host's other tenants come and go, and stop 56's three batches of the same pairs
/// gave intervals that did not overlap. The means of `BLOCKS` runs of consecutive pairs carry that drift; but five of
/// them can also agree by chance (stop 57's Citus run at 1 client: blocks spread by 0.013 where pairs spread by 0.14
/// predicted about 0.05). So the interval takes the larger of the two standard errors, the blocks' and the pairs' own.
pub fn paired_ratio(a: Vec<f64>, b: Vec<f64>) -> Paired {
    let n = a.len();
    assert!(n >= 2 && b.len() == n, "a paired comparison needs two pairs or more");
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let geometric_mean = |xs: &[f64]| mean(&xs.iter().map(|x| x.ln()).collect::<Vec<_>>()).exp();
    let logs: Vec<f64> = a.iter().zip(&b).map(|(a, b)| (a / b).ln()).collect();
    let center = mean(&logs);
    // The half-width of the interval from `units`, each the mean log-ratio of some pairs.
    let half_width = |units: &[f64]| {
        let k = units.len();
        let variance = units.iter().map(|u| (u - center).powi(2)).sum::<f64>() / (k - 1) as f64;
        t90(k - 1) * (variance / k as f64).sqrt()
    };
    let blocks = if n >= 2 * BLOCKS { BLOCKS } else { n };
    let block_means: Vec<f64> = (0..blocks).map(|k| mean(&logs[k * n / blocks..(k + 1) * n / blocks])).collect();
    let half = half_width(&block_means).max(half_width(&logs));
    Paired {
        a: geometric_mean(&a),
        b: geometric_mean(&b),
        low: (center - half).exp(),
        high: (center + half).exp(),
        rounds: [a, b],
    }
}

/// Student's t at 95% (one side), i.e. the half-width of a 90% interval in standard errors, for `df` degrees of
/// freedom: the table's values up to 9, then the normal quantile with the Cornish-Fisher expansion's first two terms
/// in 1/df (within 0.001 of the table from 10 on).
fn t90(df: usize) -> f64 {
    const TABLE: [f64; 9] = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833];
    if let Some(&t) = df.checked_sub(1).and_then(|i| TABLE.get(i)) {
        return t;
    }
    let (z, df) = (1.644_853_6_f64, df as f64);
    z + (z.powi(3) + z) / (4.0 * df) + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * df * df)
}

#[cfg(test)]
mod tests {
    use super::{paired_ratio, t90};

    #[test]
    fn t90_is_near_the_table() {
        for (df, table) in [(3, 2.353), (5, 2.015), (10, 1.812), (15, 1.753), (39, 1.685), (99, 1.660)] {
            assert!((t90(df) - table).abs() < 0.002, "t90({df}) = {} against {table}", t90(df));
        }
    }

    #[test]
    fn the_ratio_is_the_geometric_mean_of_the_pairs_and_its_interval_holds_it() {
        // Ratios 0.5, 2 and 1: geometric mean 1, whatever the rates' own level.
        let p = paired_ratio(vec![50.0, 400.0, 7.0], vec![100.0, 200.0, 7.0]);
        assert!((p.a / p.b - 1.0).abs() < 1e-12, "{}", p.a / p.b);
        assert!(p.low < 1.0 && p.high > 1.0 && (p.low * p.high - 1.0).abs() < 1e-12, "{} {}", p.low, p.high);
        // The same ratio in every pair: no spread, whatever the rates do from pair to pair.
        let p = paired_ratio(vec![90.0, 9.0, 900.0], vec![100.0, 10.0, 1000.0]);
        assert!((p.a / p.b - 0.9).abs() < 1e-12 && (p.low - 0.9).abs() < 1e-12 && (p.high - 0.9).abs() < 1e-12);
    }

    #[test]
    fn a_drift_within_the_run_widens_the_interval() {
        // The first half of the pairs at 0.9, the second at 1.0, each pair ±2% around its half's ratio: pairs taken
        // as independent would give about 0.94-0.96, excluding both halves' ratios.
        let ratios: Vec<f64> =
            (0..40).map(|i| if i < 20 { 0.9 } else { 1.0 } * if i % 2 == 0 { 1.02 } else { 0.98 }).collect();
        let p = paired_ratio(ratios.iter().map(|r| r * 100.0).collect(), vec![100.0; 40]);
        assert!(p.low < 0.92 && p.high > 0.98, "{} {}", p.low, p.high);
    }

    #[test]
    fn blocks_that_agree_by_chance_do_not_narrow_the_interval_below_the_pairs_spread() {
        // Pairs at 0.8 and 1.25 by turns: every block of 8 has the same mean, yet the pairs spread widely.
        let ratios: Vec<f64> = (0..40).map(|i| if i % 2 == 0 { 0.8 } else { 1.25 }).collect();
        let p = paired_ratio(ratios.iter().map(|r| r * 100.0).collect(), vec![100.0; 40]);
        assert!(p.low < 0.95 && p.high > 1.05, "{} {}", p.low, p.high);
    }

    #[test]
    fn more_pairs_narrow_the_interval() {
        let pairs = |n: usize| {
            let a: Vec<f64> = (0..n).map(|i| if i % 2 == 0 { 110.0 } else { 90.0 }).collect();
            paired_ratio(a, vec![100.0; n])
        };
        let (few, many) = (pairs(4), pairs(40));
        assert!(
            many.high - many.low < (few.high - few.low) / 2.0,
            "{} {} / {} {}",
            few.low,
            few.high,
            many.low,
            many.high
        );
    }
}
