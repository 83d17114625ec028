//! mark() and mark_many() on a server without the Bloom filter (not preloaded): every call goes to the index. The tests are in
//! suites/mark.rs; mark_filtered.rs runs them on a preloaded server.

#[path = "suites/mark.rs"]
mod suite;

fn server() -> &'static pg_dedup_tests::Cluster {
    pg_dedup_tests::plain_server()
}
