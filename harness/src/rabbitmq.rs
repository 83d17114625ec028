//! A throwaway RabbitMQ node for the demo's broker mode and its test: Debian's `rabbitmq-server`, run as our child on
//! loopback ports picked free, with its own Erlang port mapper (epmd), cookie, data and logs in a temporary
//! directory. So it neither needs nor disturbs the system RabbitMQ that Debian starts after installing the package
//! (node `rabbit`, ports 5672 and 4369). Stopped, with its epmd, and its directory removed when dropped.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The server script itself, not Debian's /usr/sbin wrapper (which switches to the `rabbitmq` user and its
/// /var/lib/rabbitmq). RabbitMQ runs as root as well, so the node belongs to whoever runs the demo.
const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

static NODES: AtomicUsize = AtomicUsize::new(0);

pub struct RabbitMq {
    dir: PathBuf,
    /// The AMQP port, on 127.0.0.1.
    pub port: u16,
    server: Child,
    epmd: Child,
}

impl RabbitMq {
    /// Starts a node and returns once it answers the AMQP handshake (about 6 seconds on 2 cores).
    pub fn start() -> RabbitMq {
        assert!(
            Path::new(SERVER).exists(),
            "{SERVER} is missing: install Debian's rabbitmq-server (scripts/setup.sh does)"
        );
        let name = format!("pg_dedup_{}_{}", std::process::id(), NODES.fetch_add(1, Ordering::SeqCst));
        let dir = std::env::temp_dir().join(format!("{name}_rabbitmq"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("home")).expect("create the node's directory");
        // No plugins: the management plugin would open another port and add seconds to the start.
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("write enabled_plugins");
        let [port, dist_port, epmd_port] = free_ports();

        // Our own epmd, as our child: the node registers with it rather than starting a daemon that outlives us.
        let epmd_log = std::fs::File::create(dir.join("epmd.out")).expect("create epmd.out");
        let mut epmd = Command::new("epmd")
            .args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(epmd_log.try_clone().unwrap())
            .stderr(epmd_log)
            .spawn()
            .expect("run epmd (Debian's erlang-base, a dependency of rabbitmq-server)");
        // Listening before the node looks for it, or the node would start a daemon of its own on that port.
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, epmd_port)).is_err() {
            if Instant::now() > deadline {
                let _ = epmd.kill();
                let _ = epmd.wait();
                let _ = std::fs::remove_dir_all(&dir);
                panic!("epmd did not listen on port {epmd_port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = std::fs::File::create(dir.join("server.out")).expect("create server.out");
        let in_dir = |name: &str| dir.join(name).into_os_string();
        let server = Command::new(SERVER)
            .current_dir(&dir)
            // The Erlang cookie goes into $HOME: a throwaway one.
            .env("HOME", in_dir("home"))
            .env("RABBITMQ_NODENAME", format!("{name}@localhost"))
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "-kernel inet_dist_use_interface {127,0,0,1}")
            .env("ERL_EPMD_PORT", epmd_port.to_string())
            // Nothing from /etc/rabbitmq: no rabbitmq-env.conf, no config file.
            .env("RABBITMQ_CONF_ENV_FILE", "/dev/null")
            .env("RABBITMQ_CONFIG_FILE", in_dir("rabbitmq"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", in_dir("advanced.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", in_dir("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", in_dir("mnesia"))
            .env("RABBITMQ_LOG_BASE", in_dir("log"))
            .env("RABBITMQ_PID_FILE", in_dir("rabbitmq.pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("run {SERVER}: {e}"));
        let mut node = RabbitMq { dir, port, server, epmd };
        node.wait_until_ready();
        node
    }

    /// The URL to connect to, as the default user `guest` (allowed from loopback only).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The node's directory: its data, logs and cookie, and the working directory of its processes.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the server printed, and its log (for failure messages).
    pub fn log(&self) -> String {
        let mut text = std::fs::read_to_string(self.dir.join("server.out")).unwrap_or_default();
        for entry in std::fs::read_dir(self.dir.join("log")).into_iter().flatten().flatten() {
            text += &std::fs::read_to_string(entry.path()).unwrap_or_default();
        }
        text
    }

    /// Waits until the node answers an AMQP 0-9-1 protocol header with a method frame (Connection.Start): the
    /// listener opens at the end of the boot, and only then is the broker ready.
    fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.server.try_wait().expect("wait for rabbitmq-server") {
                panic!("rabbitmq-server exited with {status}:\n{}", self.log());
            }
            if self.answers_amqp() {
                return;
            }
            assert!(Instant::now() < deadline, "RabbitMQ did not start in 2 minutes:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn answers_amqp(&self) -> bool {
        let Ok(mut socket) = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)) else { return false };
        let _ = socket.set_read_timeout(Some(Duration::from_secs(5)));
        let mut frame_type = [0u8];
        socket.write_all(b"AMQP\x00\x00\x09\x01").is_ok()
            && socket.read_exact(&mut frame_type).is_ok()
            && frame_type[0] == 1
    }

    /// Stops the node (SIGTERM: the script stops the broker cleanly) and its epmd, and removes the directory.
    fn stop(&mut self) {
        // SAFETY: kill has no memory preconditions; the pid is our child, not yet reaped.
        unsafe { libc::kill(self.server.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.server.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                // The Erlang VM is the script's child: kill both.
                let pid =
                    std::fs::read_to_string(self.dir.join("rabbitmq.pid")).ok().and_then(|p| p.trim().parse().ok());
                if let Some(pid) = pid.filter(|&pid: &i32| pid > 1) {
                    // SAFETY: as above; the VM is still running (its script has not returned), so the pid is its.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                let _ = self.server.kill();
                let _ = self.server.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.epmd.kill();
        let _ = self.epmd.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Three distinct loopback ports free right now (all held at once, so they differ, then released for the node).
fn free_ports() -> [u16; 3] {
    let listeners: Vec<TcpListener> =
        (0..3).map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port")).collect();
    let port = |i: usize| listeners[i].local_addr().unwrap().port();
    [port(0), port(1), port(2)]
}
