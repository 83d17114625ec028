//! Client and server on one CPU, for diagnostic one-client rows: on this benchmark's virtual machine a round trip
//! between pgbench and its backend on two CPUs is mostly the hypervisor waking the idle one. A pgbench script of
//! `SELECT 1` ran at 19k transactions per second across two CPUs and at 150k with both pinned to one (PG 15, sync
//! off, stop 38): of the 52 µs a transaction that does nothing took, about 45 went to the wake-ups. Pinned, a
//! transaction costs what the client, the server and the kernel do for it, which is what pg_dedup can change. No
//! deployment runs that way (the client, the backend and every background process share one core), so these rows
//! carry no goals: the unpinned rows stay the measure.
//!
//! The bench cluster's postmaster is pinned first (the backends it starts inherit it, so the run's backend starts
//! pinned), then its other processes; pgbench runs under `taskset` on the same CPU, and each process gets back its
//! own CPUs afterwards. Other servers on the machine are left alone.

use crate::cpu::Process;
use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set when a restore failed: every later run would be partly pinned, so no pgbench starts (`check_restored`).
static RESTORE_FAILED: AtomicBool = AtomicBool::new(false);

/// Panics if an earlier pinned run could not give the server its CPUs back (before any pgbench run).
pub fn check_restored() {
    assert!(!RESTORE_FAILED.load(Ordering::Relaxed), "the server's processes are still pinned (see above)");
}

/// While alive, the cluster's processes run on `cpu` only; dropping it gives each the CPUs it had.
pub struct OneCpu {
    pub cpu: u32,
    postmaster: u32,
    /// Each process's `Cpus_allowed_list` before, by pid.
    before: HashMap<u32, String>,
    /// What a process started since gets back when its parent was not there before either: the bench's own CPUs.
    fallback: String,
}

impl OneCpu {
    /// Pins the cluster whose postmaster is `postmaster`.
    pub fn pin(postmaster: u32) -> OneCpu {
        let fallback = cpus_allowed(std::process::id()).expect("read /proc/self/status");
        // "0-1", "0,2-3": the first CPU listed.
        let cpu: u32 = fallback
            .split([',', '-'])
            .next()
            .and_then(|first| first.parse().ok())
            .unwrap_or_else(|| panic!("no CPU in Cpus_allowed_list {fallback:?}"));
        let before: HashMap<u32, String> =
            processes(postmaster).into_iter().filter_map(|p| Some((p.pid, cpus_allowed(p.pid)?))).collect();
        // A postmaster that is gone (a cluster restarted since its pid was read) would pin nothing, silently.
        assert!(before.contains_key(&postmaster), "postmaster {postmaster} is not running: nothing to pin");
        // Built before pinning, so that a failure half-way restores what was pinned.
        let pinned = OneCpu { cpu, postmaster, before, fallback };
        let target = cpu.to_string();
        if let Err(why) = apply(postmaster, |_| target.clone()) {
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
        let restored = apply(self.postmaster, |p| {
            let had = self.before.get(&p.pid).or_else(|| self.before.get(&p.parent));
            had.unwrap_or(&self.fallback).clone()
        });
        // Not a panic: this may run while one unwinds, and a second panic would abort before the clusters stop.
        // The next run refuses to start instead (`check_restored`).
        if let Err(why) = restored {
            eprintln!("[bench] could not give the server's processes back their CPUs: {why}");
            RESTORE_FAILED.store(true, Ordering::Relaxed);
        }
    }
}

/// Puts every thread of the cluster's processes on the CPUs `target` says, the postmaster first (a child forked
/// meanwhile inherits the new setting), and checks that it took, scanning again for processes started meanwhile:
/// pinning a process of another user needs root or CAP_SYS_NICE, and a row measured unpinned must not be reported
/// as pinned. A process that ended meanwhile is no matter.
fn apply(postmaster: u32, target: impl Fn(&Process) -> String) -> Result<(), String> {
    for _ in 0..10 {
        let mut processes = processes(postmaster);
        processes.sort_by_key(|p| p.pid != postmaster);
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

/// The postmaster `postmaster` and its children.
fn processes(postmaster: u32) -> Vec<Process> {
    let mut processes = crate::cpu::postgres_processes();
    processes.retain(|p| p.pid == postmaster || p.parent == postmaster);
    processes
}

/// A process's `Cpus_allowed_list` ("0-1", as the kernel writes lists, and so as a restore gives it back), or None
/// when it is gone.
fn cpus_allowed(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_owned())
}
