//! The claim contract tests again, on a preloaded server where the Bloom filter answers and certainly-new ids take
//! the bulk insert (`common::cluster` starts a preloaded server for a binary whose name ends in `_filtered`).

#[path = "claim.rs"]
mod claim;
