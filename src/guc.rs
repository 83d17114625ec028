//! Every setting of pg_dedup, in one place. Shown by `SHOW` and `pg_settings`; documented in README ("Settings").

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;

/// Use the shared Bloom filter to answer "certainly new" without touching the index (superuser, per session).
pub static BLOOM: GucSetting<bool> = GucSetting::<bool>::new(true);
/// Live marks the filter is sized for (postmaster start).
pub static BLOOM_CAPACITY: GucSetting<i32> = GucSetting::<i32>::new(1_000_000);
/// False-positive rate the filter is sized for at capacity (postmaster start).
pub static BLOOM_FPR: GucSetting<f64> = GucSetting::<f64>::new(0.01);
/// The database whose inboxes the background worker looks after (rebuilding the filter).
pub static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"postgres"));

/// Settings that only make sense with shared memory: defined only while `shared_preload_libraries` loads us
/// (a postmaster-context setting defined later would be FATAL).
pub fn init_preloaded() {
    GucRegistry::define_int_guc(
        c"dedup.bloom_capacity",
        c"Number of live marks (all inboxes) the shared Bloom filter is sized for.",
        c"Memory is about 1.5 bytes per mark at a 1% false-positive rate, times two generations. Past capacity the filter \
          still never hides a mark, it only says \"maybe\" more often.",
        &BLOOM_CAPACITY,
        1_000,
        i32::MAX,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_float_guc(
        c"dedup.bloom_false_positive_rate",
        c"Target false-positive rate of the shared Bloom filter at capacity.",
        c"Lower rates cost more memory: bits per mark grow with log2(1/rate).",
        &BLOOM_FPR,
        0.000_001,
        0.5,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"dedup.database",
        c"Database whose pg_dedup inboxes the background worker looks after.",
        c"The worker rebuilds the shared Bloom filter from this database's inboxes after a restart and as marks expire.",
        &DATABASE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
}

/// Settings that work with or without preloading.
pub fn init() {
    GucRegistry::define_bool_guc(
        c"dedup.bloom",
        c"Use the shared Bloom filter in front of the inbox indexes.",
        c"Off: every call goes to the index. For benchmarks and debugging; the filter is kept up to date either way.",
        &BLOOM,
        GucContext::Suset,
        GucFlags::default(),
    );
}
