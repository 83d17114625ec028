//! `dedup.stats`: one row per inbox of this database with its counters, plus the filter-wide figures. Counters live
//! in shared memory and last until the server restarts, like pg_stat_statements (NULL without preloading).

use crate::filter;
use crate::inbox::{self, Access};
use crate::jsonb::Jsonb;
use crate::shmem::{self, Counter, COUNTERS};
use pgrx::prelude::*;
use std::sync::atomic::Ordering;

/// What `dedup.stats` shows of one inbox.
struct Figures {
    name: String,
    /// Expired marks left after the worker's last cycle (None: unknown, none counted yet, or no shared memory).
    backlog: Option<i64>,
    trusted: bool,
    trigger: String,
    /// Its counters, by `Counter` (None without shared memory).
    counters: Option<[i64; COUNTERS]>,
}

impl Figures {
    fn of(name: String) -> Figures {
        let inbox = inbox::open(&name, Access::Read);
        let trigger = if inbox.shape().distributed {
            "none: distributed".to_owned()
        } else {
            inbox.shape().trigger.label().to_owned()
        };
        let entry = shmem::region().map(|region| region.entry(inbox.ns, false).filter(|e| e.holds(inbox.ns)));
        let counters = entry.map(|entry| Counter::ALL.map(|c| entry.map_or(0, |e| e.get(c) as i64)));
        let backlog = entry.flatten().map(|e| e.backlog.load(Ordering::Relaxed)).filter(|b| *b >= 0);
        let trusted = entry.is_some() && inbox.filter().is_some();
        Figures { name, backlog, trusted, trigger, counters }
    }

    fn get(&self, counter: Counter) -> Option<i64> {
        self.counters.map(|counters| counters[counter as usize])
    }

    /// The counters as one jsonb object, each under its column's name.
    fn counters_json(&self) -> Option<Jsonb> {
        let counters = self.counters?;
        let fields: Vec<String> =
            Counter::ALL.iter().zip(counters).map(|(c, n)| format!("\"{}\": {n}", c.column())).collect();
        Some(Jsonb::parse(&format!("{{{}}}", fields.join(", "))))
    }
}

/// Every inbox of this database.
fn all_figures() -> Vec<Figures> {
    inbox::all_names().into_iter().map(Figures::of).collect()
}

/// One row per inbox of this database: its state, and its counters by name (`dedup.stats` spreads them into
/// columns).
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe)]
fn inbox_figures() -> TableIterator<
    'static,
    (
        name!(inbox, String),
        name!(backlog, Option<i64>),
        name!(filter_trusted, bool),
        name!(filter_trigger, String),
        name!(counters, Option<Jsonb>),
    ),
> {
    TableIterator::new(
        all_figures().into_iter().map(|f| (f.name.clone(), f.backlog, f.trusted, f.trigger.clone(), f.counters_json())),
    )
}

/// A row of 0.3.0's `inbox_counters()`, the first ten columns of which are a row of 0.1.0's `inbox_stats()`.
type LegacyRow = (
    String,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    bool,
    String,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

fn legacy_rows() -> Vec<LegacyRow> {
    use Counter::*;
    all_figures()
        .into_iter()
        .map(|f| {
            (
                f.name.clone(),
                f.get(Marks),
                f.get(Duplicates),
                f.get(Renewals),
                f.get(Purged),
                f.backlog,
                f.get(Lookups),
                f.get(CertainlyNew),
                f.get(FalsePositives),
                f.trusted,
                f.trigger.clone(),
                f.get(ClaimsNew),
                f.get(ClaimsCompleted),
                f.get(ClaimsInProgress),
                f.get(FingerprintMismatches),
                f.get(LeaseTakeovers),
                f.get(Advances),
                f.get(StaleAdvances),
                f.get(RowsPassed),
                f.get(RowsDropped),
            )
        })
        .collect()
}

/// `dedup.inbox_counters()` of pg_dedup 0.3.0, which its install script names and whose row `dedup.stats` read there
/// (not part of 0.4.0's schema): a database whose extension is not updated yet reads its stats through it. Frozen:
/// new counters go into `inbox_figures()` only.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe, sql = false)]
fn inbox_counters() -> TableIterator<
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
        name!(filter_trigger, String),
        name!(claims_new, Option<i64>),
        name!(claims_completed, Option<i64>),
        name!(claims_in_progress, Option<i64>),
        name!(fingerprint_mismatches, Option<i64>),
        name!(lease_takeovers, Option<i64>),
        name!(advances, Option<i64>),
        name!(stale_advances, Option<i64>),
        name!(rows_passed, Option<i64>),
        name!(rows_dropped, Option<i64>),
    ),
> {
    TableIterator::new(legacy_rows())
}

/// `dedup.inbox_stats()` of pg_dedup 0.1.0 and 0.2.0 (not part of 0.3.0's schema or later): their install scripts
/// name it, and a database whose extension is not updated yet reads `dedup.stats` through it. Frozen, like
/// `inbox_counters()`.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe, sql = false)]
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
    TableIterator::new(legacy_rows().into_iter().map(|r| (r.0, r.1, r.2, r.3, r.4, r.5, r.6, r.7, r.8, r.9)))
}

// The result columns are spelt out in the signature: that is how pgrx names them.
#[allow(clippy::type_complexity)]
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
// The result columns are spelt out in the signature: that is how pgrx names them.
#[allow(clippy::type_complexity)]
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
    // SAFETY: reads a backend global, set once connected.
    let database = unsafe { pg_sys::MyDatabaseId };
    let slot = shmem::region().and_then(|r| r.worker_slot(database, false));
    let row = match slot {
        Some(w) => {
            let pid = w.pid.load(Relaxed);
            let last = w.last_cycle();
            let ran = last.count > 0;
            (
                (pid != 0).then_some(pid),
                Some(last.count as i64),
                ran.then(|| TimestampWithTimeZone::try_from(last.start).ok()).flatten(),
                ran.then(|| last.micros as f64 / 1000.0),
                ran.then_some(last.rows),
            )
        }
        None => (None, None, None, None, None),
    };
    TableIterator::once(row)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn stats_show_one_row_per_inbox_with_its_counters() {
        run("SELECT dedup.create_inbox('st_one'); SELECT dedup.create_inbox('st_two')");
        run("SELECT dedup.mark('a', NULL, 'st_one'); SELECT dedup.mark('a', NULL, 'st_one'); SELECT dedup.mark('b', NULL, 'st_one')");
        assert_eq!(count("dedup.stats WHERE inbox IN ('st_one', 'st_two')"), 2);
        let row = |inbox: &str| {
            one::<String>(&format!(
                "SELECT format('%s %s %s %s %s', marks, duplicates, renewals, purged, filter_trigger) FROM dedup.stats \
                 WHERE inbox = '{inbox}'"
            ))
        };
        assert_eq!(row("st_one"), "2 1 0 0 ok");
        assert_eq!(row("st_two"), "0 0 0 0 ok");
    }

    #[pg_test]
    fn stats_show_the_filter_and_the_worker() {
        assert_eq!(one::<String>("SELECT filter_state FROM dedup.filter_stats()"), "ready");
        assert!(one::<i64>("SELECT filter_memory_bytes FROM dedup.filter_stats()") > 0);
        assert_eq!(one::<i64>("SELECT filter_capacity FROM dedup.filter_stats()"), 1_000_000);
        assert!(one::<f64>("SELECT filter_target_fpr FROM dedup.filter_stats()") > 0.0);
        // No worker serves the test database (dedup.database names another).
        assert_eq!(count("dedup.worker_stats() WHERE worker_pid IS NULL"), 1);
    }

    #[pg_test]
    fn stats_say_when_the_filter_trigger_stopped_guarding() {
        run("SELECT dedup.create_inbox('st_trigger')");
        run("ALTER TABLE dedup.inbox_st_trigger DISABLE TRIGGER dedup_filter");
        assert_eq!(
            one::<String>("SELECT filter_trigger || ' ' || filter_trusted FROM dedup.stats WHERE inbox = 'st_trigger'"),
            "disabled false"
        );
    }

    #[pg_test]
    fn stats_every_counter_is_a_column_of_dedup_stats_and_documented() {
        run("SELECT dedup.create_inbox('st_all')");
        let inbox = crate::inbox::open("st_all", crate::inbox::Access::Mark);
        // A value of its own for each counter: a column that reads another counter shows the wrong one.
        for (i, counter) in super::Counter::ALL.iter().enumerate() {
            inbox.count(*counter, 100 + i as u64);
        }
        let reference = include_str!("../docs/reference.md");
        let stats_section = &reference[reference.find("## `dedup.stats`").expect("documented")..];
        for (i, counter) in super::Counter::ALL.iter().enumerate() {
            let column = counter.column();
            let shown = one::<i64>(&format!("SELECT {column} FROM dedup.stats WHERE inbox = 'st_all'"));
            assert_eq!(shown, 100 + i as i64, "dedup.stats.{column} shows counter {counter:?}");
            assert!(
                stats_section.contains(&format!("| `{column}` | bigint |")),
                "{column} is not in docs/reference.md"
            );
        }
    }
}
