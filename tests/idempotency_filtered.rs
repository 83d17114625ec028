//! The idempotency-key tests again, on a preloaded server where the Bloom filter answers (see `claim_filtered`).

#[path = "idempotency.rs"]
mod idempotency;
