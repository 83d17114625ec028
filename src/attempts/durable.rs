//! One id's row of `dedup.attempt_counts`, read and deleted straight through its primary key: no SQL, so neither
//! `attempt()` nor `forget()` needs the extension owner's rights to reach the table (their callers' rights on the
//! inbox were checked), and both work inside a security-restricted operation. Read with the latest snapshot, not
//! the caller's: a count the worker wrote after a REPEATABLE READ transaction began is the one to go on from.
//!
//! And the worker's rows of counts new to the table, inserted straight into its heap and indexes (`insert_new`):
//! through SQL, unnesting the statement's arrays, sorting and running the executor and the filter trigger per row
//! took a third of the worker's CPU per count, what the rows themselves cost the rest.

use super::store::{Count, Durable};
use crate::direct::{self, text};
use crate::errors::internal;
use crate::{catalog, filter, ports, shmem};
use pgrx::prelude::*;

/// What a scan of the row found.
struct Found {
    tid: pg_sys::ItemPointerData,
    count: u32,
    first: i64,
    expires: i64,
}

/// `dedup.attempt_counts`.
fn table() -> pg_sys::Oid {
    let relid = catalog::attempt_counts();
    if relid == pg_sys::InvalidOid {
        internal("reading dedup.attempt_counts", "it is missing");
    }
    relid
}

/// Runs `f` over the row of (`inbox`, `id`) of table `relid` (`table()`), if there is one, with the table open in
/// `lock` mode.
fn with_row<R>(
    relid: pg_sys::Oid,
    inbox: &str,
    id: &str,
    lock: u32,
    f: impl FnOnce(pg_sys::Relation, Option<Found>) -> R,
) -> R {
    // SAFETY: the table and its primary key are opened and locked here (the locks kept until the transaction ends),
    // scanned with a registered snapshot, and closed before returning; the values are copied out of the slot before it
    // is dropped.
    unsafe {
        let rel = pg_sys::table_open(relid, lock as pg_sys::LOCKMODE);
        let index = pg_sys::index_open(ports::primary_key_index(rel), pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let scan = ports::index_beginscan(rel, index, snapshot, 2);
        let mut keys = [pg_sys::ScanKeyData::default(), pg_sys::ScanKeyData::default()];
        // The primary key's columns: (id, inbox).
        for (i, value) in [id, inbox].into_iter().enumerate() {
            pg_sys::ScanKeyInit(
                &mut keys[i],
                i as pg_sys::AttrNumber + 1,
                pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                text(value),
            );
            keys[i].sk_collation = *(*index).rd_indcollation.add(i);
        }
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let found = pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot).then(|| {
            let column = |attnum: i32| {
                let mut null = false;
                let datum = pg_sys::slot_getattr(slot, attnum, &mut null);
                (!null).then_some(datum)
            };
            Found {
                tid: (*slot).tts_tid,
                // A count the table should not hold (its CHECK dropped, the row edited) is no count.
                count: column(3).map_or(0, |d| (d.value() as i32).max(0) as u32),
                first: column(4).map_or(0, |d| d.value() as i64),
                expires: column(6).map_or(0, |d| d.value() as i64),
            }
        });
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        let result = f(rel, found);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        result
    }
}

/// Has the worker certainly never written a row of `id` in `inbox`? The filter, which holds the key of every row of
/// the table (`trigger::Key::InboxAndId`), says so of a new id, without a read of the table.
pub fn certainly_none(inbox: &str, id: &str) -> bool {
    let filter = filter::Trusted::for_inbox(shmem::namespace(table()));
    filter.is_some_and(|f| !f.may_contain_key(&filter::attempt_key(inbox.as_bytes(), id.as_bytes())))
}

/// The row of `id` in `inbox` as the worker last wrote it (None: none; a count that lapsed before `now` is 0), read
/// from the table (ask `certainly_none` first).
pub fn read(inbox: &str, id: &str, now: i64) -> Option<Durable> {
    with_row(table(), inbox, id, pg_sys::AccessShareLock, |_, found| {
        found.map(|f| match f.expires > now && f.count > 0 {
            true => Durable { count: f.count, first: f.first },
            false => Durable { count: 0, first: now },
        })
    })
}

/// Deletes the row of `id` in `inbox` in the current transaction (`forget()`), waiting for a worker's write of the
/// same row to finish, and deleting what it wrote.
pub fn delete(inbox: &str, id: &str) {
    for _ in 0..crate::mark::MAX_ROUNDS {
        let done = with_row(table(), inbox, id, pg_sys::RowExclusiveLock, |rel, found| {
            let Some(mut found) = found else { return true };
            // SAFETY: the table is open and locked for writing; the delete goes through its access method, which
            // waits for a transaction holding the row and says what became of it.
            unsafe {
                let delete = (*(*rel).rd_tableam).tuple_delete.expect("every table access method deletes");
                let mut failure = pg_sys::TM_FailureData::default();
                let cid = pg_sys::GetCurrentCommandId(true);
                let snapshot = pg_sys::GetLatestSnapshot();
                let result = pg_sys::ffi::pg_guard_ffi_boundary(|| {
                    delete(rel, &mut found.tid, cid, snapshot, std::ptr::null_mut(), true, &mut failure, false)
                });
                pg_sys::CommandCounterIncrement();
                // Updated meanwhile (the worker wrote a newer count): look again, and delete that.
                result != pg_sys::TM_Result::TM_Updated
            }
        });
        if done {
            return;
        }
    }
    internal("deleting a count of attempts", "it kept being rewritten")
}

/// Inserts `rows` (each count with its inbox's name; counts above zero, of ids the table holds no row of as far as
/// the worker knows) straight into the table's heap and indexes, and their keys into the filter, as the filter
/// trigger would: true. A row that exists after all raises unique_violation, as an INSERT would. False, with nothing
/// written, when the table needs more than that (`plain`): the caller writes them with SQL.
pub fn insert_new(rows: &[(String, Count)]) -> bool {
    let relid = table();
    // SAFETY: locks the table by oid as an INSERT would (held until the transaction ends), which takes in the
    // invalidations that arrived meanwhile, before its shape is read.
    unsafe { pg_sys::LockRelationOid(relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) };
    // Dropped (with the extension, maybe made again) while the lock was waited for: SQL finds what there is now.
    if catalog::attempt_counts() != relid || !plain(relid) {
        return false;
    }
    // SAFETY: locked above; `plain` says the rows need nothing but themselves, their index entries and their filter
    // keys (added below), and each count is above zero (the one CHECK constraint). Each slot gets the six columns
    // `plain` checked, none NULL.
    unsafe {
        direct::insert_rows(relid, rows.len(), |i, slot| {
            let (inbox, count) = &rows[i];
            let values = [
                text(inbox),
                text(&count.id),
                pg_sys::Datum::from(count.count as i32),
                pg_sys::Datum::from(count.first),
                pg_sys::Datum::from(count.last),
                pg_sys::Datum::from(count.expires),
            ];
            direct::store_values(slot, values.into_iter().map(|v| (v, false)));
        })
    };
    let keys: Vec<_> = rows.iter().map(|(inbox, c)| filter::attempt_key(inbox.as_bytes(), c.id.as_bytes())).collect();
    filter::add_keys(shmem::namespace(relid), &keys);
    true
}

/// The table's columns, as the extension makes it.
const COLUMNS: [(&str, pg_sys::Oid); 6] = [
    ("inbox", pg_sys::TEXTOID),
    ("id", pg_sys::TEXTOID),
    ("attempts", pg_sys::INT4OID),
    ("first_attempt", pg_sys::TIMESTAMPTZOID),
    ("last_attempt", pg_sys::TIMESTAMPTZOID),
    ("expires_at", pg_sys::TIMESTAMPTZOID),
];

/// Does a row of table `relid` (`table()`, locked) need nothing but its values, index entries and filter keys, so
/// that the worker may write it without the executor? While the table is as the extension made it
/// (`direct::needs_only_rows`, its one CHECK constraint kept by every count written) and not distributed by Citus:
/// anything an owner changed since sends the rows through SQL.
fn plain(relid: pg_sys::Oid) -> bool {
    // SAFETY: the table is locked by the caller; opened only to be read, and closed again at once.
    unsafe {
        let rel = pg_sys::relation_open(relid, pg_sys::NoLock as pg_sys::LOCKMODE);
        let plain = direct::needs_only_rows(rel, &COLUMNS, |c| is_ours(c));
        pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        plain && !crate::citus::distributed(relid)
    }
}

/// Is `check` the table's CHECK constraint as the extension made it, `attempt_counts_attempts_check`, and still
/// `attempts > 0` (so every count the worker writes keeps it)?
///
/// # Safety
/// `check` must be a constraint of an open relation's tuple descriptor.
unsafe fn is_ours(check: &pg_sys::ConstrCheck) -> bool {
    use pg_sys::NodeTag::{T_Const, T_OpExpr, T_Var};
    // SAFETY: the caller vouches for the constraint; its stored expression is read into nodes of the current memory
    // context, and each node's type is checked before it is read as that type.
    unsafe {
        if std::ffi::CStr::from_ptr(check.ccname) != c"attempt_counts_attempts_check" {
            return false;
        }
        let expr = pg_sys::stringToNode(check.ccbin) as *mut pg_sys::Node;
        if (*expr).type_ != T_OpExpr {
            return false;
        }
        let op = &*(expr as *mut pg_sys::OpExpr);
        if pg_sys::get_opcode(op.opno) != pg_sys::Oid::from(pg_sys::F_INT4GT) || pg_sys::list_length(op.args) != 2 {
            return false;
        }
        let (left, right) =
            (pg_sys::list_nth(op.args, 0) as *mut pg_sys::Node, pg_sys::list_nth(op.args, 1) as *mut pg_sys::Node);
        (*left).type_ == T_Var
            && (*(left as *mut pg_sys::Var)).varattno == 3
            && (*right).type_ == T_Const
            && !(*(right as *mut pg_sys::Const)).constisnull
            && (*(right as *mut pg_sys::Const)).constvalue.value() as i32 == 0
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::super::store::Count;
    use crate::testing::*;
    use pgrx::prelude::*;

    /// `n` new counts of inbox `inbox`, ids `prefix0000`…, sorted; the i-th counted i + 1 times, lapsing in an hour.
    fn counts(inbox: &str, prefix: &str, n: usize) -> Vec<(String, Count)> {
        // SAFETY: reads the clock.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let hour = 3_600_000_000;
        (0..n)
            .map(|i| {
                let id = format!("{prefix}{i:04}");
                let count = Count {
                    ns: 0,
                    id,
                    count: i as u32 + 1,
                    first: now - 1,
                    last: now,
                    expires: now + hour,
                    stored: false,
                };
                (inbox.to_owned(), count)
            })
            .collect()
    }

    #[pg_test]
    fn durable_new_counts_go_into_the_table_its_indexes_and_the_filter() {
        // The table loaded into the filter (empty of these ids), so that it answers for it.
        run("SELECT dedup.bloom_rebuild()");
        assert!(super::certainly_none("dn", "c0007"), "the filter answers for the table, and lacks the id");
        let rows = counts("dn", "c", 20);
        assert!(super::insert_new(&rows));
        assert_eq!(count("dedup.attempt_counts WHERE inbox = 'dn'"), 20);
        assert_eq!(
            count(
                "dedup.attempt_counts WHERE inbox = 'dn' AND id = 'c0007' AND attempts = 8 \
                 AND first_attempt < last_attempt AND expires_at BETWEEN now() AND now() + interval '2 hours'"
            ),
            1,
            "the row holds the count's values"
        );
        run("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off");
        assert_eq!(count("dedup.attempt_counts WHERE id = 'c0013' AND inbox = 'dn'"), 1, "the primary key has it");
        let by_expiry = "dedup.attempt_counts WHERE inbox = 'dn' AND expires_at > now()";
        let plan = column(&format!("EXPLAIN (COSTS OFF) SELECT count(*) FROM {by_expiry}")).join("\n");
        assert!(plan.contains("attempt_counts_inbox_expires_at_idx"), "{plan}");
        assert_eq!(count(by_expiry), 20, "the (inbox, expires_at) index has them all");
        assert!(rows.iter().all(|(inbox, c)| !super::certainly_none(inbox, &c.id)), "the filter has every key");
        assert!(super::read("dn", "c0019", 0).is_some_and(|d| d.count == 20), "read through the primary key");
    }

    #[pg_test]
    fn durable_a_new_count_whose_row_exists_raises_unique_violation() {
        assert!(super::insert_new(&counts("dn_dup", "d", 3)));
        let (code, message) = crate::xact::subtransaction(|| super::insert_new(&counts("dn_dup", "d", 5)))
            .map(|_| panic!("a second row of the same id and inbox went in"))
            .unwrap_or_else(|e| {
                let report = crate::xact::report_of(&e);
                (report.sql_error_code(), report.message().to_owned())
            });
        assert_eq!(code, PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, "{message}");
        assert_eq!(count("dedup.attempt_counts WHERE inbox = 'dn_dup'"), 3, "nothing of the failed insert stays");
    }

    #[pg_test]
    fn durable_a_table_an_owner_changed_is_written_with_sql() {
        let untouched = |change: &str, undo: &str| {
            run(change);
            assert!(!super::insert_new(&counts("dn_changed", "e", 4)), "{change}: written behind the executor's back");
            assert_eq!(count("dedup.attempt_counts WHERE inbox = 'dn_changed'"), 0, "{change}");
            run(undo);
        };
        assert!(super::insert_new(&counts("dn_plain", "e", 1)), "the table as made is written directly");
        run("CREATE TABLE audit (id text); CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS \
             $$BEGIN INSERT INTO audit VALUES (NEW.id); RETURN NEW; END$$");
        untouched(
            "CREATE TRIGGER audit AFTER INSERT ON dedup.attempt_counts FOR EACH ROW EXECUTE FUNCTION audit()",
            "DROP TRIGGER audit ON dedup.attempt_counts",
        );
        untouched(
            "ALTER TABLE dedup.attempt_counts ADD CONSTRAINT short CHECK (length(id) < 30)",
            "ALTER TABLE dedup.attempt_counts DROP CONSTRAINT short",
        );
        untouched(
            "ALTER TABLE dedup.attempt_counts DROP CONSTRAINT attempt_counts_attempts_check, \
             ADD CONSTRAINT attempt_counts_attempts_check CHECK (attempts < 1000)",
            "ALTER TABLE dedup.attempt_counts DROP CONSTRAINT attempt_counts_attempts_check, \
             ADD CONSTRAINT attempt_counts_attempts_check CHECK (attempts > 0)",
        );
        assert!(super::insert_new(&counts("dn_plain_again", "e", 1)), "the CHECK made again as it was is ours");
        untouched(
            "ALTER TABLE dedup.attempt_counts ENABLE ROW LEVEL SECURITY",
            "ALTER TABLE dedup.attempt_counts DISABLE ROW LEVEL SECURITY",
        );
        untouched(
            "ALTER TABLE dedup.attempt_counts ADD COLUMN note text DEFAULT 'x'",
            "ALTER TABLE dedup.attempt_counts DROP COLUMN note",
        );
        // The dropped column stays in the row type: not the table as made either.
        untouched("SELECT 1", "SELECT 1");
    }
}
