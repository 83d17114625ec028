//! A throwaway Citus cluster on one machine: a coordinator and two workers, each a `Cluster` of its own with Citus
//! and pg_dedup preloaded, talking to each other over their unix sockets (a node's name is its socket directory).
//! Every database a test uses gets Citus and pg_dedup on every node, and the workers added to its metadata.

use crate::{pg_config, pg_config_value, Cluster};
use postgres::Client;
use std::path::Path;
use std::sync::Mutex;

pub struct CitusCluster {
    pub coordinator: Cluster,
    pub workers: Vec<Cluster>,
    /// Held while a database is set up: adding a node propagates the cluster-wide roles to it (`ALTER ROLE` on a
    /// shared catalog), and two databases doing so at once fail on a worker with "tuple concurrently updated".
    setting_up: Mutex<()>,
}

/// Is Citus installed into the PostgreSQL under test? (When not, the Citus tests say so and skip.)
pub fn available() -> bool {
    available_in(&pg_config())
}

/// Is Citus installed into the PostgreSQL that `pg_config` belongs to?
pub fn available_in(pg_config: &Path) -> bool {
    let sharedir = pg_config_value(pg_config, "--sharedir");
    Path::new(&sharedir).join("extension/citus.control").exists()
}

impl CitusCluster {
    /// Starts the three nodes of the PostgreSQL under test; pg_dedup's background workers look after `databases`
    /// on each.
    pub fn start(databases: &str, extra: &[&str]) -> CitusCluster {
        CitusCluster::start_of(&pg_config(), databases, extra)
    }

    /// The same, of the PostgreSQL that `pg_config` belongs to (the benchmark's Citus runs on another major).
    pub fn start_of(pg_config: &Path, databases: &str, extra: &[&str]) -> CitusCluster {
        let dedup_database = format!("dedup.database = '{databases}'");
        let mut conf = vec![
            "shared_preload_libraries = 'citus, pg_dedup'",
            dedup_database.as_str(),
            "max_prepared_transactions = 50",
            // Tests call recover_prepared_transactions() themselves, and count pg_dist_transaction undisturbed.
            "citus.recover_2pc_interval = -1",
            "max_connections = 100",
            // Citus runs a maintenance daemon, a background worker, for every database it is created in, and keeps
            // it: with a database per test, the default of 8 ran out, and pg_dedup's own worker could not start.
            "max_worker_processes = 64",
            // Citus connects between nodes over unix sockets here, where SSL does not apply.
            "citus.node_conninfo = 'sslmode=disable'",
        ];
        conf.extend_from_slice(extra);
        let start = || {
            let node = Cluster::init(pg_config, &[], &conf);
            node.pg_ctl_start();
            node
        };
        let coordinator = start();
        let workers = vec![start(), start()];
        let cluster = CitusCluster { coordinator, workers, setting_up: Mutex::new(()) };
        // A node connects to itself too (moving a shard, for one) by `citus.local_hostname`: its own socket.
        for node in cluster.nodes() {
            let mut c = node.connect("postgres");
            c.batch_execute(&format!("ALTER SYSTEM SET citus.local_hostname = '{}'", node.socket_dir().display()))
                .expect("set citus.local_hostname");
            c.batch_execute("SELECT pg_reload_conf()").expect("reload");
        }
        cluster
    }

    /// Every node, coordinator first.
    pub fn nodes(&self) -> impl Iterator<Item = &Cluster> {
        std::iter::once(&self.coordinator).chain(&self.workers)
    }

    /// Creates database `name` on every node with Citus then pg_dedup, and adds the workers to its metadata.
    /// Returns a connection to the coordinator.
    pub fn fresh_db(&self, name: &str) -> Client {
        // A test that failed while holding it poisoned nothing this needs.
        let _one_at_a_time = self.setting_up.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for node in self.nodes() {
            let mut admin = node.connect("postgres");
            admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).expect("drop db");
            admin.batch_execute(&format!("CREATE DATABASE {name}")).expect("create db");
            node.connect(name).batch_execute("CREATE EXTENSION citus").expect("CREATE EXTENSION citus");
        }
        let mut c = self.coordinator.connect(name);
        c.batch_execute(&format!(
            "SELECT pg_catalog.citus_set_coordinator_host('{}', 5432)",
            self.coordinator.socket_dir().display()
        ))
        .expect("citus_set_coordinator_host");
        for worker in &self.workers {
            if let Err(e) =
                c.batch_execute(&format!("SELECT pg_catalog.citus_add_node('{}', 5432)", worker.socket_dir().display()))
            {
                panic!("citus_add_node: {e:?}\n{}", self.logs());
            }
        }
        // Propagated to the workers by Citus.
        c.batch_execute("CREATE EXTENSION pg_dedup").expect("CREATE EXTENSION pg_dedup");
        c
    }

    /// Every node's server log so far, each under a heading (for failure messages: a remote error is only
    /// in the log of the node it happened on).
    pub fn logs(&self) -> String {
        self.nodes().map(|node| format!("--- {}\n{}", node.socket_dir().display(), node.log())).collect()
    }

    pub fn destroy(&self) {
        for node in self.nodes() {
            node.destroy();
        }
    }
}
