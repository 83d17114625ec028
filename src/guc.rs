//! Every setting of pg_dedup, in one place. Shown by `SHOW` and `pg_settings`; documented in README ("Settings").

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;
use std::ffi::{CStr, CString};

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
/// Rows deleted per purge transaction. Batches of 1,000 at the default pause keep mark()'s p99 while the worker
/// purges within issue 23's goal of 1.3 times idle, where batches of 10,000 did not in the runs before the change
/// (`make bench`, the p99 rows); they purge at most about 75,000-80,000 rows a second (the pauses cap it at
/// 100,000).
pub static PURGE_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1_000);
/// Pause between two purge batches, in milliseconds.
pub static PURGE_BATCH_DELAY: GucSetting<i32> = GucSetting::<i32>::new(10);
/// Most rows one purge cycle deletes per database (0: no cap).
pub static PURGE_MAX_ROWS_PER_CYCLE: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Ids whose counts of delivery attempts shared memory holds at once (postmaster start).
pub static ATTEMPTS_MAX: GucSetting<i32> = GucSetting::<i32>::new(10_000);
/// How often the workers make counts of delivery attempts durable, in milliseconds.
pub static ATTEMPTS_FLUSH_INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(1_000);
/// Keys a batched attachment remembers per inbox before it inserts them in the middle of a statement.
pub static BATCH_FLUSH_KEYS: GucSetting<i32> = GucSetting::<i32>::new(1_000_000);
/// Longest a purge batch of the workers may take, in milliseconds (0: no limit).
pub static PURGE_BATCH_TIMEOUT: GucSetting<i32> = GucSetting::<i32>::new(30_000);

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
    GucRegistry::define_int_guc(
        c"dedup.attempts_max",
        c"Ids whose counts of delivery attempts (dedup.attempt()) shared memory holds at once.",
        c"About 190 bytes each (ids up to 128 bytes; a 64th as many slots, at least 16, for longer ids, about 2.1 kB \
          each). A count waits there until the worker makes it durable (dedup.attempts_flush_interval); when every slot \
          holds one, dedup.attempt() raises an error.",
        &ATTEMPTS_MAX,
        16,
        10_000_000,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"dedup.attempts_flush_interval",
        c"How often the background workers make counts of delivery attempts durable.",
        c"A crash of the server loses the counts made since the last time (a count can then be lower than the truth, \
          never higher); a clean shutdown loses none.",
        &ATTEMPTS_FLUSH_INTERVAL,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
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
        c"Smaller batches hold fewer row locks and less WAL at a time and cost foreground queries less latency; larger \
          ones purge faster.",
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
    GucRegistry::define_int_guc(
        c"dedup.purge_batch_timeout",
        c"Longest a purge batch of the background workers may take (0: no limit).",
        c"A batch that takes longer (a lock held by another transaction, a slow trigger on the inbox table) is rolled \
          back and logged, and the worker goes on with the next inbox.",
        &PURGE_BATCH_TIMEOUT,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
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
    GucRegistry::define_int_guc(
        c"dedup.batch_flush_keys",
        c"Keys a batched attachment (dedup.attach_batched()) remembers per inbox before it inserts them, in the middle \
          of a statement.",
        c"They wait in the loading session's memory, about 100 bytes a key of 10 bytes at the flush. A statement's keys \
          go in at its end anyway; a larger value inserts a long load's keys in fewer sorted passes over the index.",
        &BATCH_FLUSH_KEYS,
        1_000,
        // About 1 GB at the flush: the keys are in Rust's heap, outside PostgreSQL's memory contexts, where
        // running out would take the server's other sessions down with the backend.
        10_000_000,
        GucContext::Userset,
        GucFlags::default(),
    );
}

/// The time between the start of two purge cycles (`dedup.purge_interval`), never less than a second.
pub fn purge_interval() -> std::time::Duration {
    std::time::Duration::from_secs(PURGE_INTERVAL.get().max(1) as u64)
}

/// The databases named in `dedup.database` (a comma-separated list), each once.
pub fn worker_databases() -> Vec<String> {
    let list = DATABASE.get().and_then(|s| s.into_string().ok()).unwrap_or_default();
    let mut seen = std::collections::HashSet::new();
    list.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty() && seen.insert(s.clone())).collect()
}

/// Is the database this backend is connected to named in `dedup.database`, so that a worker looks after it? Asked by
/// every `attempt()`: the answer is kept while the setting reads the same (a backend's database never changes), and
/// then costs a comparison of the setting's text, where working it out again costs a catalog lookup of the
/// database's name and a parse of the list.
pub fn serves_this_database() -> bool {
    thread_local! {
        /// The setting's text when last asked, and the answer then.
        static AS_OF: std::cell::RefCell<Option<(CString, bool)>> = const { std::cell::RefCell::new(None) };
    }
    // SAFETY: the setting's current value, a NUL-terminated string PostgreSQL owns (or NULL), read before anything
    // could change it.
    let current = unsafe {
        let raw = *DATABASE.as_ptr();
        if raw.is_null() {
            c""
        } else {
            CStr::from_ptr(raw)
        }
    };
    AS_OF.with_borrow_mut(|as_of| match as_of {
        Some((text, served)) if text.as_c_str() == current => *served,
        _ => {
            let text = current.to_owned();
            let served = worker_databases().contains(&crate::catalog::current_database());
            *as_of = Some((text, served));
            served
        }
    })
}

/// Claims the `dedup.` prefix (preloaded servers, once every setting is defined), so a misspelt one (`dedup.purge_intervall`) is
/// reported instead of silently becoming a placeholder that nothing reads: an ERROR for `SET` from PostgreSQL 15 on
/// (`MarkGUCPrefixReserved`), and on 13 and 14 a WARNING for those already set when the library loads (from
/// postgresql.conf), which is all `EmitWarningsOnPlaceholders` can do.
pub fn reserve_prefix() {
    // SAFETY: called from _PG_init, after our settings are defined.
    unsafe {
        #[cfg(any(feature = "pg13", feature = "pg14"))]
        pg_sys::EmitWarningsOnPlaceholders(c"dedup".as_ptr());
        #[cfg(not(any(feature = "pg13", feature = "pg14")))]
        pg_sys::MarkGUCPrefixReserved(c"dedup".as_ptr());
    }
}

/// Runs `f` with `settings` (name, value) changed for its duration only, the way a function's `SET` clause does it:
/// on return, every setting changed meanwhile — by `f` too, even with `set_config(..., false)` — is rolled back
/// (`NewGUCNestLevel` / `AtEOXact_GUC`), and a `SET LOCAL` made before stays local. If `f` raises an ERROR, the
/// (sub)transaction's abort rolls them back instead.
pub fn scoped<R>(settings: &[(&CStr, &CStr)], f: impl FnOnce() -> R) -> R {
    // SAFETY: opens a GUC nesting level, closed below (or by the abort of the enclosing (sub)transaction).
    let level = unsafe { pg_sys::NewGUCNestLevel() };
    for (name, value) in settings {
        set(name, value, pg_sys::GucAction::GUC_ACTION_SAVE);
    }
    let result = f();
    // SAFETY: closes the level opened above; `false` rolls back what changed in it.
    unsafe { pg_sys::AtEOXact_GUC(false, level) };
    result
}

/// `SET LOCAL name = value`: for the rest of the current transaction, its commit included (which `scoped` does
/// not reach: it has rolled its settings back by then).
pub fn set_local(name: &CStr, value: &CStr) {
    set(name, value, pg_sys::GucAction::GUC_ACTION_LOCAL);
}

/// Sets `name` as a session's `SET` would, `action` saying until when.
fn set(name: &CStr, value: &CStr, action: pg_sys::GucAction::Type) {
    // SAFETY: valid NUL-terminated strings; an invalid value raises a clean ERROR. The nesting level or the
    // transaction that `action` names undoes it.
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            action,
            true,
            0,
            false,
        )
    };
}

/// `scoped` with one setting.
pub fn with_setting<R>(name: &CStr, value: &CStr, f: impl FnOnce() -> R) -> R {
    scoped(&[(name, value)], f)
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn guc_a_scoped_setting_is_rolled_back_with_everything_set_inside() {
        run("SET LOCAL lock_timeout = '7s'; SET LOCAL statement_timeout = '8s'");
        super::with_setting(c"lock_timeout", c"1ms", || {
            assert_eq!(one::<String>("SHOW lock_timeout"), "1ms");
            run("SELECT set_config('statement_timeout', '9s', false)");
        });
        assert_eq!(one::<String>("SHOW lock_timeout"), "7s");
        assert_eq!(one::<String>("SHOW statement_timeout"), "8s", "a session-wide change inside was rolled back too");
    }

    #[pg_test]
    fn guc_every_setting_is_registered_when_preloaded() {
        let names = column("SELECT name FROM pg_settings WHERE name LIKE 'dedup.%' ORDER BY name");
        assert_eq!(
            names,
            [
                "dedup.attempts_flush_interval",
                "dedup.attempts_max",
                "dedup.batch_flush_keys",
                "dedup.bloom",
                "dedup.bloom_capacity",
                "dedup.bloom_false_positive_rate",
                "dedup.database",
                "dedup.purge",
                "dedup.purge_batch_delay",
                "dedup.purge_batch_size",
                "dedup.purge_batch_timeout",
                "dedup.purge_interval",
                "dedup.purge_max_rows_per_cycle",
            ]
        );
        assert_eq!(super::worker_databases(), ["no_worker_here"], "as lib.rs's pg_test configuration sets it");
    }

    #[pg_test]
    fn guc_whether_a_worker_serves_this_database_follows_the_setting() {
        // What a reload of the configuration files does to the setting, in this backend only.
        let reload = |value: &str| {
            let value = std::ffi::CString::new(value).unwrap();
            // SAFETY: sets a SIGHUP setting as the configuration files would; NUL-terminated strings.
            unsafe {
                pg_sys::SetConfigOption(
                    c"dedup.database".as_ptr(),
                    value.as_ptr(),
                    pg_sys::GucContext::PGC_SIGHUP,
                    pg_sys::GucSource::PGC_S_FILE,
                )
            };
        };
        assert!(!super::serves_this_database(), "lib.rs's pg_test configuration names another database");
        let database = crate::catalog::current_database();
        reload(&format!("other, {database}"));
        assert!(super::serves_this_database(), "the answer follows the setting at once");
        reload("other");
        assert!(!super::serves_this_database());
        reload(&format!(" {database} "));
        assert!(super::serves_this_database());
        reload("no_worker_here");
        assert!(!super::serves_this_database());
    }

    #[pg_test]
    fn guc_a_misspelt_setting_is_refused() {
        // From PostgreSQL 15 the prefix is reserved: a setting under it that pg_dedup does not define is an error.
        #[cfg(not(any(feature = "pg13", feature = "pg14")))]
        {
            let (code, message) = error_of("SET dedup.purge_intervall = 5");
            assert_eq!(code, PgSqlErrorCode::ERRCODE_INVALID_NAME, "{message}");
        }
        // On 13 and 14 only settings already present when the library loads are reported (a WARNING in the log).
        #[cfg(any(feature = "pg13", feature = "pg14"))]
        run("SET dedup.purge_intervall = 5");
        assert_eq!(one::<String>("SHOW dedup.purge_interval"), "10s");
    }
}
