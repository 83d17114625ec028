//! Throwaway PostgreSQL clusters for pg_dedup's integration tests, demo and benchmarks.
//!
//! A cluster lives in its own temporary directory (data + unix socket, no TCP port), belongs to an unprivileged
//! user (Postgres refuses to run as root: under root the server runs as `postgres` via `runuser`), and is stopped
//! and removed when dropped. Which Postgres to run comes from `PG_CONFIG` (default: Debian's PostgreSQL 15); the
//! extension must already be installed into it (`make test` and `make demo` do that).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub use postgres;

pub mod citus;
pub mod kafka;
pub mod rabbitmq;
pub mod replay;

use postgres::{Client, NoTls};

/// The `pg_config` of the Postgres under test.
pub fn pg_config() -> PathBuf {
    std::env::var_os("PG_CONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin/pg_config"))
}

/// The directory of the Postgres programs (`pg_config --bindir`): initdb and pg_ctl, and pgbench or pg_test_fsync
/// for the benchmarks.
pub fn bindir() -> PathBuf {
    PathBuf::from(pg_config_value(&pg_config(), "--bindir"))
}

/// The major version (e.g. 15) of the Postgres that `pg_config` belongs to.
pub fn major(pg_config: &Path) -> u32 {
    pg_config_value(pg_config, "--version")
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').next())
        .and_then(|v| v.parse().ok())
        .expect("pg_config --version looks like 'PostgreSQL 15.x'")
}

fn pg_config_value(pg_config: &Path, flag: &str) -> String {
    let out = Command::new(pg_config).arg(flag).output().expect("run pg_config (is PG_CONFIG right?)");
    assert!(out.status.success(), "{} {flag} failed", pg_config.display());
    String::from_utf8(out.stdout).expect("pg_config prints UTF-8").trim().to_owned()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn check(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

static CLUSTERS: AtomicUsize = AtomicUsize::new(0);

/// An empty directory for one cluster's data and socket, owned by the server's user.
fn new_cluster_dir() -> PathBuf {
    let n = CLUSTERS.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("pg_dedup_{}_{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create cluster dir");
    if is_root() {
        check(Command::new("chown").args(["postgres:"]).arg(&dir).output().unwrap(), "chown cluster dir");
    }
    dir
}

pub struct Cluster {
    dir: PathBuf,
    bindir: PathBuf,
    /// Server major version, e.g. 15.
    pub major: u32,
    running: AtomicBool,
}

impl Cluster {
    /// initdb + start with extra `postgresql.conf` lines (e.g. `shared_preload_libraries = 'pg_dedup'`).
    pub fn start(conf: &[&str]) -> Cluster {
        let cluster = Cluster::init(&pg_config(), &[], conf);
        cluster.pg_ctl_start();
        cluster
    }

    /// initdb only (plus `initdb_args`), of the Postgres that `pg_config` belongs to — any installed major, not
    /// just `PG_CONFIG`'s — with extra `postgresql.conf` lines. The server is left stopped (start it with
    /// `pg_ctl_start`): pg_upgrade wants an empty, stopped cluster of the new major.
    pub fn init(pg_config: &Path, initdb_args: &[&str], conf: &[&str]) -> Cluster {
        let dir = new_cluster_dir();
        let bindir = PathBuf::from(pg_config_value(pg_config, "--bindir"));
        let cluster = Cluster { dir, bindir, major: major(pg_config), running: AtomicBool::new(false) };
        let data = cluster.data_dir();
        let mut args = vec!["-D", data.to_str().unwrap(), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"];
        args.extend_from_slice(initdb_args);
        check(cluster.run("initdb", &args), "initdb");
        let mut settings = vec![
            "listen_addresses = ''".to_owned(),
            format!("unix_socket_directories = '{}'", cluster.dir.display()),
            "fsync = off".to_owned(),
            "max_connections = 60".to_owned(),
            "log_min_messages = warning".to_owned(),
        ];
        settings.extend(conf.iter().map(|s| s.to_string()));
        cluster.append_conf(&settings);
        cluster
    }

    /// The directory of this cluster's Postgres programs.
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// Runs one of this cluster's Postgres programs (`initdb`, `pg_ctl`, `pg_upgrade`, ...) as the server's owner
    /// (`postgres` when we are root, ourselves otherwise), in the cluster's directory: pg_upgrade writes its
    /// sockets, logs and scripts into its working directory, which must belong to that user.
    pub fn run(&self, program: &str, args: &[&str]) -> Output {
        self.run_with_env(program, args, &[])
    }

    /// `run` with `env` added to the program's environment.
    fn run_with_env(&self, program: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
        let program = self.bindir.join(program);
        let mut command = self.as_owner(&program);
        command.args(args).envs(env.iter().copied());
        command.output().unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
    }

    /// A command running `program` (any path, e.g. valgrind) as the server's owner, in the cluster's directory.
    pub fn as_owner(&self, program: &Path) -> Command {
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        cmd.current_dir(&self.dir);
        cmd
    }

    /// A hot standby of this cluster, streaming from it (pg_basebackup -R).
    pub fn standby(&self) -> Cluster {
        let dir = new_cluster_dir();
        let standby = Cluster { dir, bindir: self.bindir.clone(), major: self.major, running: AtomicBool::new(false) };
        let data = standby.data_dir();
        check(
            standby.run(
                "pg_basebackup",
                &[
                    "-D",
                    data.to_str().unwrap(),
                    "-h",
                    self.dir.to_str().unwrap(),
                    "-U",
                    "postgres",
                    "-R",
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                ],
            ),
            "pg_basebackup",
        );
        standby.append_conf(&[format!("unix_socket_directories = '{}'", standby.dir.display())]);
        standby.pg_ctl_start();
        standby
    }

    fn append_conf(&self, lines: &[String]) {
        let conf = self.data_dir().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("read postgresql.conf");
        for line in lines {
            text.push_str(line);
            text.push('\n');
        }
        // Written by us (maybe root) into a directory owned by the server user: keep it readable for the server.
        std::fs::write(&conf, text).expect("write postgresql.conf");
    }

    /// Starts the server (after `init` or `stop`) and waits until it accepts connections.
    pub fn pg_ctl_start(&self) {
        check(self.try_pg_ctl_start(&[]), "pg_ctl start");
    }

    /// `pg_ctl_start` with `env` added to the server's environment (e.g. the dynamic linker's `LD_DEBUG`).
    pub fn pg_ctl_start_with_env(&self, env: &[(&str, &str)]) {
        check(self.try_pg_ctl_start(env), "pg_ctl start");
    }

    fn try_pg_ctl_start(&self, env: &[(&str, &str)]) -> Output {
        let log = self.dir.join("server.log");
        let out = self.run_with_env(
            "pg_ctl",
            &["-D", self.data_dir().to_str().unwrap(), "-l", log.to_str().unwrap(), "-w", "-t", "60", "start"],
            env,
        );
        self.running.store(out.status.success(), Ordering::SeqCst);
        out
    }

    /// Kills the postmaster with SIGKILL — to Postgres, the same as the machine losing power — and starts the
    /// server again, which replays the WAL (crash recovery). Returns once it accepts connections.
    pub fn crash_postmaster(&self) {
        self.kill_postmaster();
        // Orphaned backends leave once they notice the postmaster is gone; until then the old shared memory is
        // in use and a new postmaster refuses to start.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !self.try_pg_ctl_start(&[]).status.success() {
            assert!(std::time::Instant::now() < deadline, "the server did not start after the crash:\n{}", self.log());
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// Kills the postmaster with SIGKILL and leaves the server down (a primary lost for good, as in a failover).
    pub fn kill_postmaster(&self) {
        let pid = self.postmaster_pid().to_string();
        let killed = Command::new("kill").args(["-9", &pid]).status().expect("run kill");
        assert!(killed.success(), "kill -9 {pid} failed");
        self.running.store(false, Ordering::SeqCst);
    }

    /// The running postmaster's pid (the first line of postmaster.pid).
    pub fn postmaster_pid(&self) -> i32 {
        let pid_file = std::fs::read_to_string(self.data_dir().join("postmaster.pid")).expect("postmaster.pid");
        pid_file.lines().next().and_then(|l| l.trim().parse().ok()).expect("a pid in postmaster.pid")
    }

    /// The cluster's own directory: its unix socket (the `host` to connect to) and its data directory live here.
    pub fn socket_dir(&self) -> &Path {
        &self.dir
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The server log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    pub fn conn_string(&self, db: &str, user: &str) -> String {
        format!("host={} port=5432 user={user} dbname={db}", self.dir.display())
    }

    pub fn connect_as(&self, db: &str, user: &str) -> Client {
        Client::connect(&self.conn_string(db, user), NoTls)
            .unwrap_or_else(|e| panic!("connect to {db} as {user}: {e}\n{}", self.log()))
    }

    pub fn connect(&self, db: &str) -> Client {
        self.connect_as(db, "postgres")
    }

    /// A connection as `postgres`, or the error (for clients that race a crash).
    pub fn try_connect(&self, db: &str) -> Result<Client, postgres::Error> {
        Client::connect(&self.conn_string(db, "postgres"), NoTls)
    }

    /// Creates database `name` with pg_dedup installed; each test gets its own, so tests run side by side.
    pub fn fresh_db(&self, name: &str) -> Client {
        let mut admin = self.connect("postgres");
        // Two statements: DROP/CREATE DATABASE refuse to run inside the implicit transaction of a batch.
        admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).expect("drop db");
        admin.batch_execute(&format!("CREATE DATABASE {name}")).expect("create db");
        let mut client = self.connect(name);
        client.batch_execute("CREATE EXTENSION pg_dedup").expect("CREATE EXTENSION pg_dedup");
        client
    }

    /// Restarts the server (fast shutdown, then start): shared memory starts empty again.
    pub fn restart(&self) {
        self.stop();
        self.pg_ctl_start();
    }

    /// Promotes a standby to primary and waits until it accepts writes.
    pub fn promote(&self) {
        check(self.run("pg_ctl", &["-D", self.data_dir().to_str().unwrap(), "-w", "promote"]), "pg_ctl promote");
    }

    /// Kills one server process with SIGKILL, as a crash would; the postmaster then restarts every backend and
    /// re-creates shared memory. Returns once the server accepts connections again.
    pub fn crash_backend(&self, pid: i32) {
        // A bystander connection: the postmaster's crash handling terminates it, which is how we know the crash
        // was noticed (a connection attempt alone could race ahead of it).
        let mut bystander = self.connect("postgres");
        let killed = Command::new("kill").args(["-9", &pid.to_string()]).status().expect("run kill");
        assert!(killed.success(), "kill -9 {pid} failed");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while bystander.simple_query("SELECT 1").is_ok() {
            assert!(std::time::Instant::now() < deadline, "the server never noticed the crash");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        loop {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let recovered = Client::connect(&self.conn_string("postgres", "postgres"), NoTls)
                .and_then(|mut c| c.simple_query("SELECT 1").map(|_| ()));
            if recovered.is_ok() {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the server did not recover:\n{}", self.log());
        }
    }

    /// Stops the server (fast shutdown).
    pub fn stop(&self) {
        if self.running.swap(false, Ordering::SeqCst) {
            let _ = self.run("pg_ctl", &["-D", self.data_dir().to_str().unwrap(), "-m", "fast", "-w", "stop"]);
        }
    }

    /// Stops the server and removes its directory.
    pub fn destroy(&self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.destroy();
    }
}
