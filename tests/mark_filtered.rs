//! The tests of suites/mark.rs on a preloaded server, where the Bloom filter answers and certainly-new ids go
//! straight into heap and indexes.

#[path = "suites/mark.rs"]
mod suite;

fn server() -> &'static pg_dedup_tests::Cluster {
    pg_dedup_tests::preloaded_server()
}
