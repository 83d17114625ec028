//! The tests of suites/idempotency.rs on a preloaded server, where the Bloom filter answers and certainly-new ids go
//! straight into heap and indexes.

#[path = "suites/idempotency.rs"]
mod suite;

fn server() -> &'static pg_dedup_tests::Cluster {
    pg_dedup_tests::preloaded_server()
}
