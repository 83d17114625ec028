//! The CPU time PostgreSQL's processes spend during a client-side run, from /proc: beside the rate, what a
//! transaction costs the server, whatever the client and the round trips add to its wall-clock time. (It is no cure
//! for this shared machine's noise: in a run of the clients and idempotency sections of 9c09fc9, the CPU per id of a
//! side moved from round to round by about as much as its rate, 4% at the median; at one client somewhat less,
//! 5–12% against 12–16%.)
//!
//! Every process named `postgres` on the machine counts (the bench's clusters are the only ones while it runs): the
//! processes' own user+system time and, for a postmaster, that of its children already gone (`cutime`, `cstime`:
//! the run's backends, once reaped). The difference of that sum over a run is the run's server CPU: a process alive
//! at both ends counts its growth, one that ended counts its time since the start inside its parent's children's
//! time, provided no process ends while a reading is being taken (`read`).

use std::time::{Duration, Instant};

/// /proc's clock ticks per second (USER_HZ): 100 on every Linux `getconf CLK_TCK` has been asked on.
const TICKS_PER_SECOND: f64 = 100.0;

/// A reading: the summed CPU ticks, and which `postgres` processes there were.
pub struct Reading {
    ticks: u64,
    processes: Vec<Process>,
}

/// A `postgres` process, with its parent (`crate::pin` tells a cluster's processes by their postmaster).
#[derive(PartialEq)]
pub struct Process {
    pub pid: u32,
    pub parent: u32,
}

/// One pass over /proc, and whether a process it listed was gone before its stat could be read.
fn scan() -> (Reading, bool) {
    let mut reading = Reading { ticks: 0, processes: Vec::new() };
    let mut vanished = false;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            vanished = true;
            continue;
        };
        // "pid (comm) state ppid ...": the name may hold spaces, so the fields are counted after its ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if &stat[open + 1..close] != "postgres" {
            continue;
        }
        // After ')': state (field 3 of stat) first, then ppid; utime, stime, cutime, cstime are fields 14 to 17.
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        reading.ticks += fields[11..15].iter().map(|f| f.parse::<u64>().unwrap_or(0)).sum::<u64>();
        reading.processes.push(Process { pid, parent: fields[1].parse().unwrap_or(0) });
    }
    (reading, vanished)
}

/// Every `postgres` process now.
pub fn postgres_processes() -> Vec<Process> {
    scan().0.processes
}

/// Every `postgres` process's CPU ticks (own and reaped children's), from a pass over /proc during which no process
/// ended: one reaped between the reading of its parent and its own would count for nothing (parent first; it
/// happened, a round read 2.0 µs a duplicate instead of 32) or twice (itself first). A pass is taken when none of
/// its processes was missing at its own reading and the next pass lists the same ones (at most 100 tries).
pub fn read() -> Reading {
    let (mut this, mut vanished) = scan();
    for _ in 0..100 {
        let (next, next_vanished) = scan();
        if !vanished && next.processes == this.processes {
            break;
        }
        (this, vanished) = (next, next_vanished);
    }
    this
}

/// Server CPU seconds since `before`, read once the processes started since (the run's backends) are gone, so that
/// their time has reached their postmaster's. Waits at most a second: an autovacuum worker may still be at work, and
/// counts as it stands. (Background work lands on the side that runs when it happens, whichever side caused it:
/// autovacuum, the checkpointer, pg_dedup's worker; the medians of alternating rounds even that out.)
pub fn since(before: &Reading) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut now = read();
    while now.processes.iter().any(|p| !before.processes.contains(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        now = read();
    }
    now.ticks.saturating_sub(before.ticks) as f64 / TICKS_PER_SECOND
}
