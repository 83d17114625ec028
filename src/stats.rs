//! `dedup.stats`: one row per inbox of this database with its counters, plus the filter-wide figures. Counters live
//! in shared memory and last until the server restarts, like pg_stat_statements (NULL without preloading).

use crate::filter;
use crate::inbox::{self, Access};
use pgrx::prelude::*;

#[pg_extern(volatile, parallel_safe)]
fn inbox_stats() -> TableIterator<
    'static,
    (
        name!(inbox, String),
        name!(marks, Option<i64>),
        name!(duplicates, Option<i64>),
        name!(renewals, Option<i64>),
        name!(purged, Option<i64>),
        name!(backlog, Option<i64>),
        name!(lookups, Option<i64>),
        name!(certainly_new, Option<i64>),
        name!(false_positives, Option<i64>),
        name!(filter_trusted, bool),
    ),
> {
    let rows: Vec<_> = inbox::all_names()
        .into_iter()
        .map(|name| {
            match filter::inbox_figures(inbox::open(&name, Access::Read).ns) {
                Some((c, backlog, trusted)) => {
                    let backlog = (backlog >= 0).then_some(backlog);
                    (name, Some(c[0]), Some(c[1]), Some(c[2]), Some(c[6]), backlog, Some(c[3]), Some(c[4]), Some(c[5]), trusted)
                }
                None => (name, None, None, None, None, None, None, None, None, false),
            }
        })
        .collect();
    TableIterator::new(rows)
}

#[pg_extern(volatile, parallel_safe)]
fn filter_stats() -> TableIterator<
    'static,
    (
        name!(filter_state, String),
        name!(filter_memory_bytes, i64),
        name!(filter_capacity, i64),
        name!(filter_target_fpr, f64),
        name!(filter_fill_ratio, Option<f64>),
        name!(filter_estimated_fpr, Option<f64>),
        name!(filter_rebuilds, i64),
    ),
> {
    let s = filter::summary();
    TableIterator::once((
        s.state.to_owned(),
        s.memory_bytes,
        s.capacity,
        s.target_fpr,
        s.fill_ratio,
        s.estimated_fpr,
        s.rebuilds,
    ))
}

/// The purge worker of this database: its pid (NULL when none runs) and its last cycle.
#[pg_extern(volatile, parallel_safe)]
fn worker_stats() -> TableIterator<
    'static,
    (
        name!(worker_pid, Option<i32>),
        name!(purge_cycles, Option<i64>),
        name!(last_purge_start, Option<TimestampWithTimeZone>),
        name!(last_purge_ms, Option<f64>),
        name!(last_purge_rows, Option<i64>),
    ),
> {
    use std::sync::atomic::Ordering::Relaxed;
    let slot = crate::shmem::region().and_then(|r| r.worker_slot(unsafe { pg_sys::MyDatabaseId }, false));
    let row = match slot {
        Some(w) => {
            let pid = w.pid.load(Relaxed);
            let cycles = w.cycles.load(Relaxed) as i64;
            let ran = cycles > 0;
            (
                (pid != 0).then_some(pid),
                Some(cycles),
                ran.then(|| TimestampWithTimeZone::try_from(w.last_cycle_start.load(Relaxed)).ok()).flatten(),
                ran.then(|| w.last_cycle_micros.load(Relaxed) as f64 / 1000.0),
                ran.then(|| w.last_cycle_rows.load(Relaxed)),
            )
        }
        None => (None, None, None, None, None),
    };
    TableIterator::once(row)
}
