//! What a new connection would pay on its first call that the postmaster pays once instead. The server starts with
//! `LD_DEBUG=bindings` in its environment, so that the dynamic linker logs every symbol each process binds (a line
//! per binding, prefixed with the process's pid; the postmaster's file takes its backends' lines too).

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
    // The server's owner writes the log files (ld_debug.<pid>) into the cluster's directory, which it owns.
    let log = cluster.socket_dir().join("ld_debug");
    cluster.pg_ctl_start_with_env(&[("LD_DEBUG", "bindings"), ("LD_DEBUG_OUTPUT", log.to_str().unwrap())]);
    cluster.fresh_db("bindings");
    let mut c = cluster.connect("bindings");
    let pid = backend_pid(&mut c);
    c.batch_execute("SELECT dedup.mark('first')").unwrap();
    drop(c);
    let postmaster = cluster.postmaster_pid();
    let bound_by = |pid: i32| -> Vec<String> {
        let prefix = format!("{pid}:");
        let mut lines = Vec::new();
        for file in std::fs::read_dir(cluster.socket_dir()).unwrap().map(|entry| entry.unwrap().path()) {
            if file.file_name().unwrap().to_string_lossy().starts_with("ld_debug.") {
                let text = std::fs::read_to_string(&file).unwrap();
                lines.extend(text.lines().filter(|l| l.trim_start().starts_with(&prefix)).map(str::to_owned));
            }
        }
        lines
    };
    let lookup = |lines: &[String]| lines.iter().filter(|l| l.contains("`_dl_find_dso_for_object'")).count();
    // The control: on this machine glibc binds the symbol lazily, and the postmaster did (_PG_init).
    assert!(lookup(&bound_by(postmaster)) > 0, "the postmaster (pid {postmaster}) did not bind the symbol itself");
    let backend = bound_by(pid);
    assert!(backend.iter().any(|l| l.contains("`mark_wrapper'")), "backend {pid}'s bindings are not in the log");
    assert_eq!(lookup(&backend), 0, "backend {pid} bound what the postmaster had bound for it");
}
