//! The machine a run was measured on (and the commit), written beside the results: ratios travel between
//! machines better than absolute figures, but both mean more with the machine named.

use crate::Scale;
use pg_dedup_harness::postgres::Client;
use std::process::Command;

/// (field, value) pairs, in the order they are shown.
pub type Machine = Vec<(&'static str, String)>;

fn first_line_with(path: &str, prefix: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(prefix))?;
    Some(line.split_once(':')?.1.trim().to_owned())
}

fn command(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok().filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The checkout the extension and the bench were built from (`--dirty` if it has changes). Read before the first
/// section: a commit made while a run lasts (an hour) is not what it measured.
pub fn commit() -> String {
    command("git", &["-C", env!("CARGO_MANIFEST_DIR"), "describe", "--always", "--dirty"])
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The machine and the run; `commit` as `commit()` read it when the run began.
pub fn describe(c: &mut Client, quick: bool, scale: &Scale, commit: String) -> Machine {
    let unknown = || "unknown".to_owned();
    let memory = first_line_with("/proc/meminfo", "MemTotal")
        .and_then(|kb| kb.trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0));
    let mut machine = vec![
        ("cpu", first_line_with("/proc/cpuinfo", "model name").unwrap_or_else(unknown)),
        ("cores", std::thread::available_parallelism().map_or_else(|_| unknown(), |n| n.to_string())),
        ("memory", memory.unwrap_or_else(unknown)),
        (
            "kernel",
            std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| unknown(), |k| k.trim().to_owned()),
        ),
        ("postgresql", c.query_one("SHOW server_version", &[]).unwrap().get(0)),
        ("redis", crate::redis::version().unwrap_or_else(|| "not installed".into())),
        ("date", command("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_else(unknown)),
        // The code measured: the checkout make bench built and installed the extension from.
        ("commit", commit),
        ("mode", if quick { "quick (BENCH_QUICK=1)" } else { "full" }.into()),
        (
            "rounds",
            format!(
                "medians of {} alternating rounds, {} s per client-side run; paired rows: {} pairs ({}-s runs; the \
                 backlog's purge: one purge a side)",
                scale.rounds, scale.run_secs, scale.pairs, scale.pair_secs
            ),
        ),
    ];
    if let Some(versions) = crate::citus::VERSIONS.get() {
        // Beside the main cluster's version, wherever that stands in the list.
        let at = machine.iter().position(|(field, _)| *field == "postgresql").map_or(machine.len(), |i| i + 1);
        machine.insert(at, ("citus cluster", versions.clone()));
    }
    machine
}
