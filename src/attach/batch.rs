//! Batched attachments (`dedup.attach_batched()`, docs/ingest.md, "The bulk road"): the row trigger
//! marks a key the filter calls "certainly new" by remembering it, lets the row through, and the keys it remembered
//! go into the inbox together — sorted, with one multi-insert per `CHUNK` — when the statement ends (the
//! `zz_dedup_attached_batch` AFTER STATEMENT trigger), when `dedup.batch_flush_keys` wait, before anything else in
//! this transaction opens the inbox (`inbox::open`), and at the latest before the transaction commits or prepares.
//!
//! Why it pays: a row trigger that marks one key at a time inserts into the primary key in the file's order, one
//! descent and one WAL record per key; sorted, the inserts walk the index's leaves in order, and the heap gets
//! one record per page.
//!
//! What it gives up: a key waits in this backend's memory, invisible to other sessions, between the row and the
//! flush. Another transaction loading the same key meanwhile is not seen; the flush's unique index then catches it
//! (after waiting for that transaction, as any insert does) and the statement fails with serialization_failure,
//! rather than the row waiting at the start for the other loader, as the unbatched trigger's does. Nothing is ever
//! kept twice: the unique index is the truth. Every other guarantee holds as for an unbatched attachment:
//! - a repeat of a remembered key is a duplicate (the key is this transaction's, as an inserted one would be);
//! - a key the filter cannot vouch for (a maybe, no filter, an inbox that is not `plain`, logical replication's
//!   apply) is marked at once, as without batching;
//! - rows that roll back leave no mark: a subtransaction's abort forgets the keys it remembered (they are tagged with
//!   the subtransaction; every subtransaction begun after the aborted one is inside it), the transaction's abort
//!   forgets all of them, and the keys already flushed go with the rows.

use crate::clock::{statement_expiry, statement_now};
use crate::errors::raise;
use crate::inbox::{self, Inbox};
use crate::shmem::Counter;
use crate::{direct, mark, xact};
use pgrx::prelude::*;
use rustc_hash::FxHashMap;
use std::cell::{Cell, RefCell};

/// A remembered key's end of window (a `TimestampTz`) and the subtransaction that remembered it (its row's).
#[derive(Clone, Copy)]
struct Remembered {
    ends: pg_sys::TimestampTz,
    by: pg_sys::SubTransactionId,
}

/// A key flushed in a subtransaction newer than its row's: if that subtransaction rolls back, its mark goes and its
/// row stays, so the key is remembered again (`at_end_of_subtransaction`).
struct Flushed {
    inbox: String,
    key: Box<str>,
    remembered: Remembered,
    /// The subtransaction the mark was written in (its parent's, once it commits).
    in_sub: pg_sys::SubTransactionId,
}

/// The keys remembered for one inbox.
type Keys = FxHashMap<Box<str>, Remembered>;

thread_local! {
    /// The remembered keys, by inbox name. Few inboxes per transaction: a list.
    static PENDING: RefCell<Vec<(String, Keys)>> = const { RefCell::new(Vec::new()) };
    static FLUSHED: RefCell<Vec<Flushed>> = const { RefCell::new(Vec::new()) };
    static CALLBACKS: Cell<bool> = const { Cell::new(false) };
}

/// Is `key` remembered for `inbox`: None if not, else whether its window has not ended yet (a row of it now is a
/// duplicate; `seen()` sees it). A remembered key whose window ended is new again, and is remembered again.
pub fn remembered(inbox: &Inbox, key: &str) -> Option<bool> {
    let now = pg_sys::TimestampTz::from(statement_now());
    PENDING.with(|p| {
        p.borrow()
            .iter()
            .find(|(name, _)| *name == inbox.name)
            .and_then(|(_, keys)| keys.get(key))
            .map(|r| r.ends > now)
    })
}

/// `remembered`, live.
pub fn holds(inbox: &Inbox, key: &str) -> bool {
    remembered(inbox, key) == Some(true)
}

/// May a key of `inbox` that the filter vouches for wait for the flush? Not in logical replication's apply (its
/// statements end with no statement trigger, and a failed flush would stop the subscription), and only where the
/// flush can write straight into the table (`direct::insert_new`).
pub fn may_wait(inbox: &Inbox) -> bool {
    inbox.shape().plain && !super::row_trigger::in_apply_worker()
}

/// Remembers `key` (certainly new to `inbox`, or remembered with a window that has ended) for a window of `ttl`
/// (None: the inbox's default) from the statement's start, and flushes the inbox's keys once `flush_at()` wait.
pub fn remember(inbox: &Inbox, key: &str, ttl: Option<Interval>) {
    if !CALLBACKS.replace(true) {
        // SAFETY: registers guarded callbacks for the rest of the backend's life.
        unsafe {
            pg_sys::RegisterXactCallback(Some(at_end_of_transaction), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(at_end_of_subtransaction), std::ptr::null_mut());
        }
    }
    // SAFETY: reads the current subtransaction's id.
    let by = unsafe { pg_sys::GetCurrentSubTransactionId() };
    let remembered = Remembered { ends: statement_expiry(ttl.unwrap_or_else(|| inbox.default_ttl())).into(), by };
    let full = with_keys(&inbox.name, |keys| {
        keys.insert(key.into(), remembered);
        keys.len() >= flush_at()
    });
    if full {
        flush_keys(inbox);
    }
}

/// Keys remembered for one inbox before they are flushed in the middle of a statement (`dedup.batch_flush_keys`):
/// bounds the memory a load takes (about 100 bytes a key of 10 bytes at the flush, which sorts them: a backend's
/// peak grew by 97 MB for 1,000,000 keys). The larger, the fewer sorted passes over the index a long load makes
/// (each flush walks the leaves its keys fall on: a file of random keys, flushed in ten parts, walks most of the
/// index ten times), and the more of the file's repeats are found in memory rather than through the index.
fn flush_at() -> usize {
    crate::guc::BATCH_FLUSH_KEYS.get() as usize
}

/// Runs `f` on the keys remembered for inbox `name` (an empty set if none were).
fn with_keys<R>(name: &str, f: impl FnOnce(&mut Keys) -> R) -> R {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        let at = p.iter().position(|(n, _)| n == name).unwrap_or_else(|| {
            p.push((name.to_owned(), FxHashMap::default()));
            p.len() - 1
        });
        f(&mut p[at].1)
    })
}

/// The keys remembered for inbox `name`, no longer remembered; those remembered before the current subtransaction
/// began are logged in FLUSHED first, so that, should it roll back while their rows stay, they are remembered again
/// (what their flush wrote, or a drop of the inbox, rolls back with it). Pure Rust, so nothing can fail between the
/// taking and the logging.
fn take_logged(name: &str) -> Keys {
    let keys = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.iter().position(|(n, _)| n == name).map(|at| p.swap_remove(at).1).unwrap_or_default()
    });
    // SAFETY: reads the current subtransaction's id.
    let now_in = unsafe { pg_sys::GetCurrentSubTransactionId() };
    FLUSHED.with(|f| {
        f.borrow_mut().extend(keys.iter().filter(|(_, r)| r.by < now_in).map(|(key, r)| Flushed {
            inbox: name.to_owned(),
            key: key.clone(),
            remembered: *r,
            in_sub: now_in,
        }))
    });
    keys
}

/// Has inbox `name` an entry in PENDING? (`flush_all` goes by the same test: an entry, empty or not, is flushed,
/// and so removed, so its loop ends.)
fn has_keys(name: &str) -> bool {
    PENDING.with(|p| p.borrow().iter().any(|(n, _)| n == name))
}

/// Flushes the keys remembered for inbox `name`, if any (for `inbox::open`: whatever this transaction writes to
/// the inbox next must find them in its table).
pub fn flush(name: &str) {
    if has_keys(name) {
        // The caller's rights were checked when each key was remembered (the row's inserter); whoever runs now
        // (a commit after RESET ROLE, another table's statement trigger) needs none.
        flush_keys(&inbox::reopen(name));
    }
}

/// Forgets the keys remembered for inbox `name`, which is being dropped (for `drop_inbox()`): its marks go too.
/// Logged as a flush would log them: a rollback of the drop brings them back.
pub fn forget(name: &str) {
    take_logged(name);
}

/// Flushes every inbox's remembered keys (at a statement's end, and before the transaction commits).
pub fn flush_all() {
    while let Some(name) = PENDING.with(|p| p.borrow().first().map(|(n, _)| n.clone())) {
        flush(&name);
    }
}

/// Inserts the keys remembered for `inbox` into it, sorted, window by window. A key that has a row after all
/// (another transaction's, committed while this one had it in memory) fails the statement. What can fail before
/// the insert is checked before the keys are taken.
fn flush_keys(inbox: &Inbox) {
    if !inbox.shape().plain {
        // Only this transaction's own DDL can have changed the table since its keys were remembered (everyone
        // else's waits for our lock).
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("inbox \"{}\" was altered in the transaction that loads keys into it in batches", inbox.name),
            "Alter the inbox's table in a transaction of its own.",
        )
    }
    let keys = take_logged(&inbox.name);
    let mut sorted: Vec<(&str, pg_sys::TimestampTz)> = keys.iter().map(|(k, r)| (&**k, r.ends)).collect();
    sorted.sort_unstable_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
    // SAFETY: reads and sets the backend's active snapshot: at commit there may be none, and the index entries of
    // a toasted key read it.
    let pushed = unsafe {
        let none = !pg_sys::ActiveSnapshotSet();
        if none {
            pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        }
        none
    };
    for window in sorted.chunk_by(|a, b| a.1 == b.1) {
        let ends = TimestampWithTimeZone::try_from(window[0].1).expect("an end of window computed by this backend");
        let ids: Vec<&str> = window.iter().map(|(k, _)| *k).collect();
        for chunk in ids.chunks(mark::CHUNK) {
            insert_or_fail(inbox, chunk, ends);
        }
    }
    if pushed {
        // SAFETY: pops what was pushed above.
        unsafe { pg_sys::PopActiveSnapshot() };
    }
    inbox.count(Counter::Marks, keys.len() as u64);
}

/// `direct::insert_new`, with a key that turned out to have a row reported as what it is. (Caught without a
/// subtransaction: nothing is resumed, the error raised in its place ends the statement all the same.)
fn insert_or_fail(inbox: &Inbox, keys: &[&str], ends: TimestampWithTimeZone) {
    // The error ends the statement: nothing of the inbox's cached state is used after it.
    let inbox = std::panic::AssertUnwindSafe(inbox);
    PgTryBuilder::new(|| direct::insert_new(&inbox, keys, &direct::Row::mark(ends)))
        .catch_when(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, |error| {
            let report = xact::report_of(&error);
            raise(
                PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
                format!(
                    "a key of this batched load into inbox \"{}\" was marked by another transaction meanwhile ({})",
                    inbox.name,
                    report.detail().unwrap_or(report.message()).trim_end_matches('.')
                ),
                "Retry the transaction: its repeats are then skipped. A batched attachment does not wait at the row \
                 for a concurrent loader of the same key; attach the table with dedup.attach() to wait there.",
            )
        })
        .execute()
}

/// # Safety
/// Called by PostgreSQL only, at the end of a transaction.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_transaction(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        // Still inside the transaction: the keys go in now, or the commit fails.
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT | pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE => flush_all(),
        // An abort forgets them; after a commit or a prepare there are none left.
        _ => {
            PENDING.with(|p| p.borrow_mut().clear());
            FLUSHED.with(|f| f.borrow_mut().clear());
        }
    }
}

/// # Safety
/// Called by PostgreSQL only, at the end of a subtransaction.
#[pg_guard]
unsafe extern "C-unwind" fn at_end_of_subtransaction(
    event: pg_sys::SubXactEvent::Type,
    sub: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    // Every subtransaction begun since `sub` is inside it, and has a greater id.
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => {
            // Keys whose rows go with `sub` are forgotten; keys whose marks go with it and whose rows stay are
            // remembered again.
            PENDING.with(|p| {
                let mut p = p.borrow_mut();
                for (_, keys) in p.iter_mut() {
                    keys.retain(|_, r| r.by < sub);
                }
                p.retain(|(_, keys)| !keys.is_empty());
            });
            let undone: Vec<Flushed> = FLUSHED.with(|f| {
                let (undone, kept) = std::mem::take(&mut *f.borrow_mut()).into_iter().partition(|f| f.in_sub >= sub);
                *f.borrow_mut() = kept;
                undone
            });
            for flushed in undone.into_iter().filter(|f| f.remembered.by < sub) {
                with_keys(&flushed.inbox, |keys| keys.insert(flushed.key, flushed.remembered));
            }
        }
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => FLUSHED.with(|f| {
            // The marks now go with the parent; once that is their rows' subtransaction (or an older one), marks
            // and rows go together.
            let mut f = f.borrow_mut();
            for flushed in f.iter_mut().filter(|f| f.in_sub >= sub) {
                flushed.in_sub = parent;
            }
            f.retain(|f| f.in_sub > f.remembered.by);
        }),
        _ => {}
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    /// Table `name` attached in batches to an inbox of its own, whose filter answers (created empty).
    fn batched(name: &str, on_duplicate: &str) {
        run(&format!(
            "CREATE TABLE {name} (event_id text, n int);
             SELECT dedup.create_inbox('{name}');
             SELECT dedup.attach_batched('{name}', 'event_id', inbox => '{name}', on_duplicate => '{on_duplicate}')"
        ));
    }

    /// The same table partitioned in two, rows inserted into its partitions directly: no statement trigger fires.
    fn batched_partitions(name: &str) {
        run(&format!(
            "CREATE TABLE {name} (event_id text, n int) PARTITION BY RANGE (n);
             CREATE TABLE {name}_1 PARTITION OF {name} FOR VALUES FROM (0) TO (100);
             CREATE TABLE {name}_2 PARTITION OF {name} FOR VALUES FROM (100) TO (200);
             SELECT dedup.create_inbox('{name}');
             SELECT dedup.attach_batched('{name}', 'event_id', inbox => '{name}')"
        ));
    }

    #[pg_test]
    fn batch_keeps_the_first_row_of_each_key_and_marks_it_by_the_statements_end() {
        batched("bat_rows", "skip");
        assert!(one::<bool>("SELECT batched FROM dedup.attachments WHERE tbl = 'bat_rows'::regclass"));
        run("INSERT INTO bat_rows VALUES ('e1', 1), ('e2', 2), ('e1', 3)");
        assert_eq!(count("dedup.inbox_bat_rows"), 2, "the statement's end flushed its keys");
        run("INSERT INTO bat_rows VALUES ('e2', 4), ('e3', 5)");
        run("INSERT INTO bat_rows SELECT * FROM (VALUES ('e3', 6), ('e4', 7), ('e4', 8)) v");
        assert_eq!(column("SELECT event_id || n FROM bat_rows ORDER BY n"), ["e11", "e22", "e35", "e47"]);
        assert_eq!(column("SELECT id FROM dedup.inbox_bat_rows ORDER BY id"), ["e1", "e2", "e3", "e4"]);
        assert_eq!(
            one::<String>(
                "SELECT format('%s %s %s', marks, rows_passed, rows_dropped) FROM dedup.stats WHERE inbox = 'bat_rows'"
            ),
            "4 4 4"
        );
        assert!(
            one::<bool>(
                "SELECT expires_at = statement_timestamp() + (SELECT default_ttl FROM dedup.inboxes WHERE name = 'bat_rows')
                   FROM dedup.inbox_bat_rows WHERE id = 'e4'"
            ),
            "the inbox's default window"
        );
        run("SELECT dedup.attach('bat_rows', 'event_id', inbox => 'bat_rows')");
        assert_eq!(count("pg_trigger WHERE tgrelid = 'bat_rows'::regclass AND tgname = 'zz_dedup_attached_batch'"), 0);
    }

    #[pg_test]
    fn batch_asks_the_filter_once_for_a_key_it_cannot_vouch_for() {
        batched("bat_asked", "skip");
        run("INSERT INTO bat_asked VALUES ('a1', 1)");
        // The statement's end flushed a1, whose bits are now set: the filter says "maybe" for it from then on, and
        // the row is marked at once (found in the table) with that answer.
        run("INSERT INTO bat_asked VALUES ('a1', 2), ('a2', 3)");
        assert_eq!(count("bat_asked"), 2);
        assert_eq!(
            one::<String>("SELECT format('%s %s', lookups, certainly_new) FROM dedup.stats WHERE inbox = 'bat_asked'"),
            "3 2",
            "one lookup per row, the repeat of a flushed key included"
        );
    }

    #[pg_test]
    fn batch_with_error_refuses_a_repeat_of_a_remembered_key() {
        batched("bat_strict", "error");
        let (code, message) = error_of("INSERT INTO bat_strict VALUES ('s1', 1), ('s2', 2), ('s1', 3)");
        assert_eq!(code, PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, "{message}");
        assert!(message.contains("key \"s1\""), "{message}");
        assert_eq!(count("bat_strict") + count("dedup.inbox_bat_strict"), 0, "nothing of the statement stays");
        run("INSERT INTO bat_strict VALUES ('s1', 4)");
        assert_eq!(count("dedup.inbox_bat_strict"), 1, "the failed statement's keys were forgotten");
    }

    #[pg_test]
    fn batch_keys_inserted_into_a_partition_are_flushed_by_the_next_use_of_the_inbox() {
        batched_partitions("bat_parts");
        run("INSERT INTO bat_parts_1 VALUES ('p1', 1), ('p2', 2)");
        assert_eq!(count("dedup.inbox_bat_parts"), 0, "no statement trigger on a partition: the keys wait");
        run("INSERT INTO bat_parts_2 VALUES ('p1', 101), ('p3', 102)");
        assert_eq!(count("bat_parts"), 3, "a repeat of a waiting key is a duplicate");
        assert!(
            !one::<bool>("SELECT dedup.mark('p2', NULL, 'bat_parts')"),
            "mark() finds the waiting keys in the table"
        );
        assert_eq!(count("dedup.inbox_bat_parts"), 3);
    }

    #[pg_test]
    fn batch_keys_of_a_rolled_back_subtransaction_are_forgotten() {
        batched_partitions("bat_sub");
        run("INSERT INTO bat_sub_1 VALUES ('kept', 1)");
        rolled_back(|| run("INSERT INTO bat_sub_1 VALUES ('gone', 2)"));
        rolled_back(|| {
            run("INSERT INTO bat_sub_2 VALUES ('gone-too', 101)");
            rolled_back(|| run("INSERT INTO bat_sub_2 VALUES ('inner', 102)"));
        });
        run("INSERT INTO bat_sub_1 VALUES ('kept', 3), ('gone', 4), ('gone-too', 5), ('inner', 6)");
        assert_eq!(column("SELECT event_id FROM bat_sub ORDER BY n"), ["kept", "gone", "gone-too", "inner"]);
        run("SELECT dedup.mark('x', NULL, 'bat_sub')");
        assert_eq!(count("dedup.inbox_bat_sub"), 5, "one mark per row that stayed, and x");
    }

    #[pg_test]
    fn batch_a_key_marked_behind_its_back_fails_the_flush_with_serialization_failure() {
        batched_partitions("bat_race");
        run("INSERT INTO bat_race_1 VALUES ('r1', 1), ('r2', 2)");
        // What another loader's committed mark looks like to the flush: a row the remembered key did not know of.
        run("INSERT INTO dedup.inbox_bat_race (id, expires_at) VALUES ('r2', now() + interval '1 day')");
        let flush = "SELECT dedup.mark('r3', NULL, 'bat_race')";
        let (code, message) = error_of(flush);
        assert_eq!(code, PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE, "{message}");
        assert!(message.starts_with("dedup: ") && message.contains("(r2)"), "{message}");
        // The error was caught (by a subtransaction, as a PL/pgSQL block would): the keys are remembered again, so
        // the transaction cannot commit with r2's row and no mark of its own.
        assert_eq!(
            error_of(flush).0,
            PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
            "flushed again, failing again"
        );
    }

    #[pg_test]
    fn batch_keys_flushed_in_a_rolled_back_subtransaction_are_remembered_again() {
        batched_partitions("bat_undo");
        run("INSERT INTO bat_undo_1 VALUES ('u1', 1), ('u2', 2)");
        // A savepoint that flushes them (any marking call does) and rolls back takes their marks, not their rows.
        rolled_back(|| {
            run("SELECT dedup.mark('other', NULL, 'bat_undo')");
            assert_eq!(count("dedup.inbox_bat_undo"), 3);
        });
        assert!(one::<bool>("SELECT dedup.seen('u1', 'bat_undo')"), "remembered again");
        run("INSERT INTO bat_undo_2 VALUES ('u2', 102)");
        assert_eq!(count("bat_undo"), 2, "still a duplicate");
        run("SELECT dedup.mark('other', NULL, 'bat_undo')");
        assert_eq!(column("SELECT id FROM dedup.inbox_bat_undo ORDER BY id"), ["other", "u1", "u2"]);
        // Flushed in a subtransaction that commits: the marks go with the rows from then on.
        run("INSERT INTO bat_undo_1 VALUES ('u3', 3)");
        let committed = crate::xact::subtransaction(|| run("SELECT dedup.mark('other2', NULL, 'bat_undo')"));
        assert!(committed.is_ok());
        assert_eq!(count("dedup.inbox_bat_undo WHERE id = 'u3'"), 1);
    }

    #[pg_test]
    fn batch_keys_of_a_rolled_back_drop_inbox_are_remembered_again() {
        batched_partitions("bat_drop");
        run("INSERT INTO bat_drop_1 VALUES ('d1', 1); SELECT dedup.detach('bat_drop')");
        rolled_back(|| run("SELECT dedup.drop_inbox('bat_drop')"));
        run("SELECT dedup.mark('x', NULL, 'bat_drop')");
        assert_eq!(
            column("SELECT id FROM dedup.inbox_bat_drop ORDER BY id"),
            ["d1", "x"],
            "d1's row stayed, and its mark"
        );
    }

    #[pg_test]
    fn batch_seen_answers_for_remembered_keys_without_writing() {
        batched_partitions("bat_seen");
        run("INSERT INTO bat_seen_1 VALUES ('w1', 1)");
        assert!(one::<bool>("SELECT dedup.seen('w1', 'bat_seen')"));
        assert_eq!(count("dedup.inbox_bat_seen"), 0, "seen() left the key in memory");
        assert!(!one::<bool>("SELECT dedup.seen('w2', 'bat_seen')"));
    }

    #[pg_test]
    fn batch_flushes_in_the_middle_of_a_long_statement() {
        batched("bat_long", "skip");
        // A trigger that runs before the attachment's reads the inbox's table at the 3,000th row: by then its
        // 2,999 keys were remembered, and flushed at 1,000 and 2,000.
        run("CREATE TABLE bat_long_probe (n int, marks bigint);
             CREATE FUNCTION bat_long_probe() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               IF NEW.n = 3000 THEN INSERT INTO bat_long_probe SELECT NEW.n, count(*) FROM dedup.inbox_bat_long; END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER a_probe BEFORE INSERT ON bat_long FOR EACH ROW EXECUTE FUNCTION bat_long_probe();
             SET dedup.batch_flush_keys = 1000");
        let rows = 6_000;
        run(&format!("INSERT INTO bat_long SELECT 'k' || (g % {}), g FROM generate_series(1, {rows}) g", rows - 1_000));
        assert_eq!(one::<i64>("SELECT marks FROM bat_long_probe WHERE n = 3000"), 2_000, "flushed every 1,000 keys");
        assert_eq!(count("bat_long"), (rows - 1_000) as i64, "repeats on both sides of a flush are dropped");
        assert_eq!(count("dedup.inbox_bat_long"), (rows - 1_000) as i64);
    }
}
