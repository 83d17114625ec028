//! Client and server on one CPU, for the one-client rows: there, on this benchmark's virtual machine, a round trip
//! between pgbench and its backend on two CPUs is mostly the hypervisor waking the idle one. The same pgbench script
//! of `SELECT 1` ran at 19k transactions per second across two CPUs and at 150k with both pinned to one (PG 15,
//! sync off, stop 38): of the 52 µs a trivial transaction took, about 45 were the two wake-ups, the same for
//! whatever statement runs, and varying from run to run with the host. Pinned, a transaction costs what the client,
//! the server and the kernel do for it, which is what pg_dedup can change; the unpinned rows stay, as what a
//! client on another CPU sees here.
//!
//! Every `postgres` process is pinned (the postmaster's backends inherit it, so the run's backend starts pinned),
//! pgbench runs under `taskset` on the same CPU, and everything is put back afterwards.

use std::process::Command;

/// While alive, every `postgres` process runs on `cpu` only; dropping it gives them the CPUs they had.
pub struct OneCpu {
    pub cpu: u32,
    /// The bench's own CPUs (`Cpus_allowed_list`), which the server's processes had before.
    allowed: String,
}

impl OneCpu {
    pub fn pin() -> OneCpu {
        let allowed = cpus_allowed("self").expect("read /proc/self/status");
        // "0-1", "0,2-3": the first CPU listed.
        let cpu: u32 = allowed
            .split([',', '-'])
            .next()
            .and_then(|first| first.parse().ok())
            .unwrap_or_else(|| panic!("no CPU in Cpus_allowed_list {allowed:?}"));
        set(&cpu.to_string());
        OneCpu { cpu, allowed }
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
        set(&self.allowed);
    }
}

/// Puts every thread of every `postgres` process on CPUs `list`, and checks that it took: pinning a process of
/// another user needs root or CAP_SYS_NICE, and a row measured unpinned must not be reported as pinned.
fn set(list: &str) {
    for pid in crate::cpu::postgres_pids() {
        let out = Command::new("taskset").args(["-a", "-p", "-c", list]).arg(pid.to_string()).output();
        let out = out.unwrap_or_else(|e| panic!("run taskset (util-linux): {e}"));
        // A backend that ended meanwhile is no matter; any other process must now be on `list`.
        match cpus_allowed(&pid.to_string()) {
            Some(now) if now != list => panic!(
                "could not put postgres process {pid} on CPUs {list} (it is on {now}): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            _ => {}
        }
    }
}

/// A process's `Cpus_allowed_list` ("0-1"), or None when it is gone.
fn cpus_allowed(pid: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_owned())
}
