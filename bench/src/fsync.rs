//! The disk's flush rate, from `pg_test_fsync`: a durable single-row commit (synchronous_commit = on, one
//! client) waits for one WAL flush, so fdatasync operations per second bound what any mark() can reach there.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// fdatasync ops/s of one 8 kB write, measured on `file` (put it on the cluster's filesystem) for `secs` seconds.
/// pg_test_fsync goes on to test other write patterns for many more seconds; it is stopped once the figure needed
/// is out.
pub fn fdatasync_rate(file: &Path, secs: u32) -> f64 {
    let bin = pg_dedup_harness::bindir().join("pg_test_fsync");
    let mut child = Command::new(&bin)
        .args(["-s", &secs.to_string(), "-f"])
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
    let mut in_one_write_section = false;
    let mut rate = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.expect("read pg_test_fsync's output");
        if line.starts_with("Compare file sync methods using") {
            in_one_write_section = line.contains("one 8kB write");
        } else if let Some(rest) = line.trim().strip_prefix("fdatasync").filter(|_| in_one_write_section) {
            // "fdatasync      12017.073 ops/sec      83 usecs/op"
            rate = rest.split_whitespace().next().and_then(|v| v.parse().ok());
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(file);
    rate.unwrap_or_else(|| panic!("no fdatasync figure in the output of {}", bin.display()))
}
