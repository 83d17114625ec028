//! Redis, the usual dedup store beside the database: a throwaway `redis-server` on a unix socket (like the
//! Postgres cluster's), driven by `redis-benchmark` with the command teams use for dedup keys, `SET key 1 NX EX`.
//!
//! Two durability settings, each compared with mark() at the matching synchronous_commit: `appendfsync always`
//! (every write flushed before the reply, like a durable commit) and no persistence at all.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
pub enum Durability {
    /// `--appendonly yes --appendfsync always`: flushed before the reply (compare with synchronous_commit = on).
    Fsync,
    /// `--save '' --appendonly no`: memory only (compare with synchronous_commit = off).
    None,
}

/// A running redis-server, killed and its directory removed when dropped (also when the benchmark panics).
pub struct Redis {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    /// Requests per second of the last run at each client count, to size the next run.
    last_rate: std::cell::RefCell<Vec<(u32, f64)>>,
}

/// The installed Redis version (`redis-server --version`), or none when redis-server or redis-benchmark is missing.
pub fn version() -> Option<String> {
    let runs = |program: &str| Command::new(program).arg("--version").output().ok().filter(|o| o.status.success());
    let out = runs("redis-server").filter(|_| runs("redis-benchmark").is_some())?;
    // "Redis server v=7.0.15 sha=... malloc=..."
    String::from_utf8_lossy(&out.stdout).split_whitespace().find_map(|w| w.strip_prefix("v=")).map(str::to_owned)
}

impl Redis {
    /// Starts redis-server in a new directory under the system temp dir (the filesystem the Postgres cluster
    /// lives on, so both flush to the same disk).
    pub fn start(durability: Durability) -> Redis {
        let name = match durability {
            Durability::Fsync => "fsync",
            Durability::None => "memory",
        };
        let dir = std::env::temp_dir().join(format!("pg_dedup_bench_redis_{name}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the redis directory");
        let socket = dir.join("redis.sock");
        let persistence: &[&str] = match durability {
            Durability::Fsync => &["--appendonly", "yes", "--appendfsync", "always"],
            Durability::None => &["--save", "", "--appendonly", "no"],
        };
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .arg("--dir")
            .arg(&dir)
            .args(persistence)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let redis = Redis { child, dir, socket, last_rate: Default::default() };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !redis.socket.exists() {
            assert!(Instant::now() < deadline, "redis-server did not open its socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }

    /// `SET evt:<random> 1 NX EX 259200` (3 days) from `clients` connections for about `secs` seconds;
    /// requests per second.
    pub fn set_nx_rate(&self, clients: u32, secs: u32) -> f64 {
        let known = self.last_rate.borrow().iter().find(|(c, _)| *c == clients).map(|&(_, r)| r);
        // redis-benchmark counts requests, not seconds: a short probe sizes the first run at a client count.
        let expected = known.unwrap_or_else(|| self.benchmark(clients, 200 * clients as u64));
        let rate = self.benchmark(clients, ((expected * secs as f64) as u64).max(100));
        let mut rates = self.last_rate.borrow_mut();
        rates.retain(|(c, _)| *c != clients);
        rates.push((clients, rate));
        rate
    }

    fn benchmark(&self, clients: u32, requests: u64) -> f64 {
        let out = Command::new("redis-benchmark")
            .arg("-s")
            .arg(&self.socket)
            .args(["-c", &clients.to_string(), "-n", &requests.to_string(), "-r", "1000000000", "--csv"])
            .args(["SET", "evt:__rand_int__", "1", "NX", "EX", "259200"])
            .output()
            .expect("run redis-benchmark");
        let stdout = String::from_utf8_lossy(&out.stdout);
        // "test","rps",...  then  "SET evt:__rand_int__ 1 NX EX 259200","23837.90",...
        stdout
            .lines()
            .nth(1)
            .and_then(|l| l.split(',').nth(1))
            .and_then(|v| v.trim_matches('"').parse().ok())
            .unwrap_or_else(|| {
                panic!("redis-benchmark printed no rate:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr))
            })
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
