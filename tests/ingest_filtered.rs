//! The ingest tests again, on a preloaded server where the Bloom filter answers (see `claim_filtered`).

#[path = "ingest.rs"]
mod ingest;
