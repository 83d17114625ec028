//! Every setting of pg_dedup, in one place. Shown by `SHOW` and `pg_settings`; documented in README ("Settings").

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;

/// Use the shared Bloom filter to answer "certainly new" without touching the index (superuser, per session).
pub static BLOOM: GucSetting<bool> = GucSetting::<bool>::new(true);
/// Live marks the filter is sized for (postmaster start).
pub static BLOOM_CAPACITY: GucSetting<i32> = GucSetting::<i32>::new(1_000_000);
/// False-positive rate the filter is sized for at capacity (postmaster start).
pub static BLOOM_FPR: GucSetting<f64> = GucSetting::<f64>::new(0.01);
/// The databases whose inboxes the background workers look after (comma-separated).
pub static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"postgres"));
/// The workers purge expired marks at all.
pub static PURGE: GucSetting<bool> = GucSetting::<bool>::new(true);
/// Seconds between the start of two purge cycles.
pub static PURGE_INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(10);
/// Rows deleted per purge transaction.
pub static PURGE_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
/// Pause between two purge batches, in milliseconds.
pub static PURGE_BATCH_DELAY: GucSetting<i32> = GucSetting::<i32>::new(10);
/// Most rows one purge cycle deletes per database (0: no cap).
pub static PURGE_MAX_ROWS_PER_CYCLE: GucSetting<i32> = GucSetting::<i32>::new(0);

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
        c"Databases whose pg_dedup inboxes the background workers look after (comma-separated).",
        c"One worker per database purges expired marks and keeps the shared Bloom filter loaded. Databases that do not \
          exist yet, or lack the extension, are waited for.",
        &DATABASE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"dedup.purge",
        c"Let the background workers delete expired marks.",
        c"Off: expired marks stay (they are still treated as new) until dedup.purge() is called.",
        &PURGE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"dedup.purge_interval",
        c"Time between the starts of two purge cycles.",
        c"Each cycle deletes the expired marks of every inbox, in batches.",
        &PURGE_INTERVAL,
        1,
        86_400,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"dedup.purge_batch_size",
        c"Expired marks deleted per purge transaction.",
        c"Smaller batches hold fewer row locks and less WAL at a time; larger ones purge faster.",
        &PURGE_BATCH_SIZE,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"dedup.purge_batch_delay",
        c"Pause between two purge batches.",
        c"Leaves room for foreground work while a large backlog is purged.",
        &PURGE_BATCH_DELAY,
        0,
        60_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"dedup.purge_max_rows_per_cycle",
        c"Most expired marks one purge cycle deletes in a database (0: no cap).",
        c"The rest waits for the next cycle; dedup.stats shows the backlog.",
        &PURGE_MAX_ROWS_PER_CYCLE,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
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

/// The databases named in `dedup.database` (a comma-separated list), each once.
pub fn worker_databases() -> Vec<String> {
    let list = DATABASE.get().and_then(|s| s.into_string().ok()).unwrap_or_default();
    let mut seen = std::collections::HashSet::new();
    list.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty() && seen.insert(s.clone())).collect()
}
