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
        name!(lookups, Option<i64>),
        name!(certainly_new, Option<i64>),
        name!(false_positives, Option<i64>),
        name!(filter_trusted, bool),
    ),
> {
    let rows: Vec<_> = inbox::all_names()
        .into_iter()
        .map(|name| {
            let relid = inbox::open(&name, Access::Read).relid;
            match filter::inbox_figures(filter::namespace(relid)) {
                Some((c, trusted)) => (name, Some(c[0]), Some(c[1]), Some(c[2]), Some(c[3]), Some(c[4]), Some(c[5]), trusted),
                None => (name, None, None, None, None, None, None, false),
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
