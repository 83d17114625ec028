//! The background worker (registered when preloaded): keeps the shared filter loaded for the inboxes of
//! `dedup.database`. It loads inboxes the active generation does not cover (after a restart, a restore, a
//! promotion), and rotates to a fresh generation when expired marks have pushed the false-positive rate above
//! target.

use crate::{filter, guc, inbox, rebuild};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags};
use pgrx::prelude::*;
use std::time::Duration;

/// How often the worker looks at the filter.
const NAP: Duration = Duration::from_secs(1);
/// Rotate when the measured rate exceeds the target (or what the last rotation achieved) by this factor.
const ROTATE_AT: f64 = 1.1;

pub fn init_preloaded() {
    BackgroundWorkerBuilder::new("pg_dedup worker")
        .set_type("pg_dedup worker")
        .set_library("pg_dedup")
        .set_function("pg_dedup_worker_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_dedup_worker_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let database = guc::DATABASE.get().and_then(|db| db.into_string().ok()).unwrap_or_default();
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    log!("pg_dedup worker: looking after the inboxes of database \"{database}\"");
    // The false-positive rate right after the last rotation: rotating again only helps once it has grown.
    let mut floor = 0.0;
    let mut told_missing = false;
    while BackgroundWorker::wait_latch(Some(NAP)) {
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let last_floor = floor;
        let (installed, new_floor) = BackgroundWorker::transaction(move || {
            let installed = Spi::get_one::<bool>("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_dedup')")
                .ok()
                .flatten()
                .unwrap_or(false);
            (installed, if installed { look_after_filter(last_floor) } else { last_floor })
        });
        floor = new_floor;
        if !installed && !told_missing {
            log!("pg_dedup worker: extension pg_dedup is not installed in database \"{database}\"; waiting");
        }
        told_missing = !installed;
    }
}

/// One look at the filter; returns the false-positive floor (updated after a rotation).
fn look_after_filter(floor: f64) -> f64 {
    let relids: Vec<pg_sys::Oid> =
        inbox::all_names().iter().map(|name| inbox::open(name, inbox::Access::Read).relid).collect();
    if !filter::untrusted(&relids).is_empty() {
        if let Some(done) = rebuild::run(false) {
            log!("pg_dedup worker: loaded {} marks of {} inbox(es) into the Bloom filter", done.keys, done.inboxes);
        }
        return floor;
    }
    let target = guc::BLOOM_FPR.get();
    let Some(measured) = filter::active_fpr() else { return floor };
    if measured > ROTATE_AT * target.max(floor) {
        if let Some(done) = rebuild::run(true) {
            let floor = filter::active_fpr().unwrap_or(0.0);
            log!(
                "pg_dedup worker: rotated the Bloom filter ({} live marks reloaded; false-positive rate {:.4} -> {:.4})",
                done.keys,
                measured,
                floor
            );
            if floor > target {
                warning!(
                    "dedup: the Bloom filter is undersized: {} live marks give a false-positive rate of {:.4} \
                     (target {target}); set dedup.bloom_capacity to at least {} and restart",
                    done.keys,
                    floor,
                    done.keys * 2
                );
            }
            return floor;
        }
    }
    floor
}
