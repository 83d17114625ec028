//! Client and server on one CPU, for diagnostic one-client rows: on this benchmark's virtual machine a round trip
//! between pgbench and its backend on two CPUs is mostly the hypervisor waking the idle one. A pgbench script of
//! `SELECT 1` ran at 19k transactions per second across two CPUs and at 150k with both pinned to one (PG 15, sync
//! off, stop 38): of the 52 µs a transaction that does nothing took, about 45 went to the wake-ups. Pinned, a
//! transaction costs what the client, the server and the kernel do for it, which is what pg_dedup can change. No
//! deployment runs that way (the client, the backend and every background process share one core), so these rows
//! carry no goals: the unpinned rows stay the measure.
//!
//! Every `postgres` process is pinned, postmasters first (the backends they start inherit it, so the run's backend
//! starts pinned), pgbench runs under `taskset` on the same CPU, and each process gets back its own CPUs afterwards.

use std::collections::HashMap;
use std::process::Command;

/// While alive, every `postgres` process runs on `cpu` only; dropping it gives each the CPUs it had.
pub struct OneCpu {
    pub cpu: u32,
    /// Each process's `Cpus_allowed_list` before, by pid.
    before: HashMap<u32, String>,
    /// What a process started since gets back when its parent was not there before either: the bench's own CPUs.
    fallback: String,
}

impl OneCpu {
    pub fn pin() -> OneCpu {
        let fallback = cpus_allowed(std::process::id()).expect("read /proc/self/status");
        // "0-1", "0,2-3": the first CPU listed.
        let cpu: u32 = fallback
            .split([',', '-'])
            .next()
            .and_then(|first| first.parse().ok())
            .unwrap_or_else(|| panic!("no CPU in Cpus_allowed_list {fallback:?}"));
        let before = processes().into_iter().filter_map(|p| Some((p.pid, cpus_allowed(p.pid)?))).collect();
        // Built before pinning, so that a failure half-way restores what was pinned.
        let pinned = OneCpu { cpu, before, fallback };
        let target = cpu.to_string();
        if let Err(why) = apply(|_| target.clone()) {
            panic!("could not put the server's processes on CPU {cpu}: {why}");
        }
        pinned
    }

    /// `program` run through `taskset` on the pinned CPU.
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut command = Command::new("taskset");
        command.args(["-c", &self.cpu.to_string()]).arg(program);
        command
    }
}

impl Drop for OneCpu {
    fn drop(&mut self) {
        let restored = apply(|p| {
            let had = self.before.get(&p.pid).or_else(|| self.before.get(&p.parent));
            had.unwrap_or(&self.fallback).clone()
        });
        // Not a panic: this may run while one unwinds, and a second panic would abort before the clusters stop.
        if let Err(why) = restored {
            eprintln!("[bench] could not give the server's processes back their CPUs: {why}");
        }
    }
}

struct Process {
    pid: u32,
    parent: u32,
}

/// Puts every thread of every `postgres` process on the CPUs `target` says, postmasters first (a child forked
/// meanwhile inherits the new setting), and checks that it took, scanning again for processes started meanwhile:
/// pinning a process of another user needs root or CAP_SYS_NICE, and a row measured unpinned must not be reported
/// as pinned. A process that ended meanwhile is no matter.
fn apply(target: impl Fn(&Process) -> String) -> Result<(), String> {
    for _ in 0..10 {
        let mut processes = processes();
        let pids: Vec<u32> = processes.iter().map(|p| p.pid).collect();
        processes.sort_by_key(|p| pids.contains(&p.parent));
        let mut all_set = true;
        for p in &processes {
            let want = target(p);
            if cpus_allowed(p.pid).is_none_or(|now| now == want) {
                continue;
            }
            all_set = false;
            let out = Command::new("taskset").args(["-a", "-p", "-c", &want]).arg(p.pid.to_string()).output();
            let out = out.map_err(|e| format!("run taskset (util-linux): {e}"))?;
            if let Some(now) = cpus_allowed(p.pid).filter(|now| *now != want) {
                return Err(format!(
                    "postgres process {} is on CPUs {now}, not {want}: {}",
                    p.pid,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        if all_set {
            return Ok(());
        }
    }
    Err("processes kept starting on other CPUs".into())
}

/// Every `postgres` process, with its parent.
fn processes() -> Vec<Process> {
    crate::cpu::postgres_pids()
        .into_iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid ...": the parent is the second field after the name's ')'.
            let parent = stat[stat.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()?;
            Some(Process { pid, parent })
        })
        .collect()
}

/// A process's `Cpus_allowed_list` ("0-1", as the kernel writes lists, and so as a restore gives it back), or None
/// when it is gone.
fn cpus_allowed(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_owned())
}
