//! What a new connection would pay on its first call that the postmaster pays once instead. A test binary of its
//! own: it starts its server with `LD_DEBUG=bindings` in the environment, so that the dynamic linker logs every
//! symbol each process binds (a line per binding, prefixed with the process's pid; the postmaster's file takes its
//! backends' lines too).

use pg_dedup_tests::*;

/// The first thread-local with a destructor a process touches has glibc bind `_dl_find_dso_for_object` lazily, a
/// walk over every loaded library's symbol tables that took 49 µs of a connection's first `mark()` (perf, `pgbench
/// -C`). `_PG_init` registers one such destructor in the postmaster, whose binding every backend then inherits: a
/// backend whose first call is `mark()` binds `mark()`'s own symbols, and not that one.
#[test]
fn a_new_connection_does_not_bind_what_the_postmaster_bound_for_it() {
    let cluster = Cluster::init(
        &pg_dedup_harness::pg_config(),
        &[],
        &["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'postgres'"],
    );
    // The server's owner writes the log files into the cluster's directory, which it owns.
    let log = cluster.socket_dir().join("ld_debug");
    std::env::set_var("LD_DEBUG", "bindings");
    std::env::set_var("LD_DEBUG_OUTPUT", &log);
    cluster.pg_ctl_start();
    std::env::remove_var("LD_DEBUG");
    std::env::remove_var("LD_DEBUG_OUTPUT");
    cluster.fresh_db("bindings");
    let mut c = cluster.connect("bindings");
    let pid = backend_pid(&mut c);
    c.batch_execute("SELECT dedup.mark('first')").unwrap();
    drop(c);
    let prefix = format!("{pid}:");
    let mut bound = Vec::new();
    for file in std::fs::read_dir(cluster.socket_dir()).unwrap().map(|entry| entry.unwrap().path()) {
        if file.file_name().unwrap().to_string_lossy().starts_with("ld_debug.") {
            let text = std::fs::read_to_string(&file).unwrap();
            bound.extend(text.lines().filter(|l| l.trim_start().starts_with(&prefix)).map(str::to_owned));
        }
    }
    assert!(bound.iter().any(|l| l.contains("`mark_wrapper'")), "backend {pid}'s bindings are not in the log");
    let lazy: Vec<&String> = bound.iter().filter(|l| l.contains("_dl_find_dso_for_object")).collect();
    assert!(lazy.is_empty(), "backend {pid} bound what the postmaster should have: {lazy:?}");
}
