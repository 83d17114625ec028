//! The `dedup_filter` trigger on every inbox table, and on `dedup.attempt_counts`: whatever writes a row through
//! SQL (mark()'s executor path, the worker's counts, INSERT, COPY, a restore, logical replication) puts its key into
//! the filter, right after the row is written. An inbox's rows are keyed by id; the counts' by inbox and id (`Key`,
//! which the trigger's one argument says).
//!
//! It is an AFTER INSERT OR UPDATE OF id (of inbox, id) row trigger, `ENABLE ALWAYS` (so it fires for COPY, restores
//! and logical replication too). AFTER, because:
//! - it hashes the id as stored, after any BEFORE trigger an owner added has rewritten it;
//! - the row exists before its bits are set. A filter rotation clears a generation and then scans every table,
//!   every row version physically there (rows of transactions still in progress, and versions updated since the
//!   scan's snapshot, included: rebuild.rs): a row written before the clear is seen by the scan, a row written after
//!   it sets its bits after it. No rotation needs to wait for anyone.
//!
//! The filter may trust a table only while this trigger is in place, enabled always, AFTER and keyed as the table
//! is (`State::Guarding`).
//! Every DDL command that can change that (ALTER TABLE, CREATE/DROP/ALTER TRIGGER) ends with `watch_ddl`, an event
//! trigger that stops trusting any inbox whose trigger is no longer guarding, at once, inside the very transaction
//! that changed it: rows that transaction writes without the trigger can then never be missed. The background worker
//! puts the trigger right (`repair`) and reloads the inbox.

use crate::errors::{internal, server_log};
use crate::shmem::namespace;
use crate::{catalog, filter};
use pgrx::prelude::*;

pub const NAME: &str = "dedup_filter";

/// How an inbox table's filter trigger stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum State {
    /// In place, AFTER, enabled always: every row written through SQL reaches the filter.
    Guarding,
    Missing,
    /// `ALTER TABLE ... DISABLE TRIGGER`.
    Disabled,
    /// `ENABLE TRIGGER` (origin mode, what `pg_restore --disable-triggers` leaves): silent under
    /// `session_replication_role = replica`, i.e. for logical replication and some restores.
    OnOrigin,
    /// `ENABLE REPLICA TRIGGER`: fires only under `session_replication_role = replica`.
    OnReplica,
    /// A BEFORE trigger (as pg_dedup 0.2.0 made it, e.g. restored from its dump): its bits are set before the row
    /// exists, which a rotation that does not wait cannot rely on.
    Before,
    /// It keys the rows otherwise than the table's `Key` (its argument is not the table's): the loads and the
    /// trigger would disagree on what a row's key is.
    WrongKey,
}

impl State {
    /// What `dedup.stats` shows.
    pub fn label(self) -> &'static str {
        match self {
            State::Guarding => "ok",
            State::Missing => "missing",
            State::Disabled => "disabled",
            State::OnOrigin => "enabled on origin only",
            State::OnReplica => "enabled on replica only",
            State::Before => "fires before the row is written",
            State::WrongKey => "keyed by the wrong columns",
        }
    }

    /// The state of relation `rel` from its relcache entry.
    ///
    /// # Safety
    /// `rel` must be an open relation.
    pub unsafe fn of(rel: pg_sys::Relation) -> State {
        // SAFETY: the caller vouches for the relation; its trigger descriptor is only read.
        unsafe {
            let triggers = (*rel).trigdesc;
            if triggers.is_null() {
                return State::Missing;
            }
            let all = std::slice::from_raw_parts((*triggers).triggers, (*triggers).numtriggers as usize);
            let Some(ours) = all.iter().find(|t| is_named_ours(t)) else { return State::Missing };
            let kind = ours.tgtype as u32;
            let row_after_insert_update = kind & pg_sys::TRIGGER_TYPE_ROW != 0
                && kind & (pg_sys::TRIGGER_TYPE_BEFORE | pg_sys::TRIGGER_TYPE_INSTEAD) == 0
                && kind & pg_sys::TRIGGER_TYPE_INSERT != 0
                && kind & pg_sys::TRIGGER_TYPE_UPDATE != 0;
            match ours.tgenabled as u8 {
                _ if !row_after_insert_update => State::Before,
                _ if Key::of_trigger(ours) != Some(Key::of((*rel).rd_id)) => State::WrongKey,
                pg_sys::TRIGGER_FIRES_ALWAYS => State::Guarding,
                pg_sys::TRIGGER_FIRES_ON_ORIGIN => State::OnOrigin,
                pg_sys::TRIGGER_FIRES_ON_REPLICA => State::OnReplica,
                _ => State::Disabled,
            }
        }
    }

    /// The state of table `relid`, read from its relcache entry without taking a lock (the caller holds one, or
    /// accepts a state that may change right after).
    pub fn of_table(relid: pg_sys::Oid) -> State {
        // SAFETY: opened and closed here; NoLock is allowed for a relation the caller locked or merely inspects.
        unsafe {
            let rel = pg_sys::RelationIdGetRelation(relid);
            if rel.is_null() {
                return State::Missing;
            }
            let state = State::of(rel);
            pg_sys::RelationClose(rel);
            state
        }
    }
}

/// Is this trigger `dedup_filter` calling our trigger function (whatever its timing and mode)?
///
/// # Safety
/// `t` must be a trigger of an open relation's trigger descriptor.
unsafe fn is_named_ours(t: &pg_sys::Trigger) -> bool {
    // SAFETY: the caller vouches for the trigger; its name and the function's are NUL-terminated strings (a missing
    // function's name is NULL, checked first).
    unsafe {
        std::ffi::CStr::from_ptr(t.tgname).to_bytes() == NAME.as_bytes() && {
            let function = pg_sys::get_func_name(t.tgfoid);
            !function.is_null() && std::ffi::CStr::from_ptr(function).to_bytes() == b"inbox_filter_trigger"
        }
    }
}

/// Is this the filter trigger, guarding (the one trigger the direct insert may bypass, doing its work itself)?
///
/// # Safety
/// As for `is_named_ours`.
pub unsafe fn is_guarding(t: &pg_sys::Trigger) -> bool {
    // SAFETY: as for is_named_ours; the other fields are plain values.
    unsafe {
        is_named_ours(t)
            && t.tgenabled == pg_sys::TRIGGER_FIRES_ALWAYS as std::ffi::c_char
            && (t.tgtype as u32) & (pg_sys::TRIGGER_TYPE_BEFORE | pg_sys::TRIGGER_TYPE_INSTEAD) == 0
    }
}

/// The argument of the filter trigger of `dedup.attempt_counts`.
const INBOX_AND_ID: &str = "inbox_and_id";

/// What the rows of a table the filter guards are known by in it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Key {
    /// An inbox table's rows: their `id` (column 1).
    Id,
    /// `dedup.attempt_counts`'s rows: their inbox and id (columns 1 and 2, `filter::attempt_key`), so that
    /// `attempt()` of an id the table certainly lacks need not read it. Its trigger says so by its one argument.
    InboxAndId,
}

impl Key {
    /// How a filter trigger keys the rows, by its argument (None: an argument it does not know).
    ///
    /// # Safety
    /// `t` must be a trigger of an open relation's trigger descriptor.
    pub unsafe fn of_trigger(t: &pg_sys::Trigger) -> Option<Key> {
        // SAFETY: the caller vouches for the trigger; its tgnargs arguments are NUL-terminated strings.
        unsafe {
            match t.tgnargs {
                0 => Some(Key::Id),
                1 if std::ffi::CStr::from_ptr(*t.tgargs).to_bytes() == INBOX_AND_ID.as_bytes() => Some(Key::InboxAndId),
                _ => None,
            }
        }
    }

    /// How table `relid` (an inbox table, or `dedup.attempt_counts`) is keyed.
    pub fn of(relid: pg_sys::Oid) -> Key {
        if relid == catalog::attempt_counts() {
            Key::InboxAndId
        } else {
            Key::Id
        }
    }
}

/// The statements that put a guarding trigger on `table` (schema-qualified and quoted), keyed by `key`.
/// sql/finalize.sql writes the one of `dedup.attempt_counts` again, for a new installation.
pub fn create_sql(table: &str, key: Key) -> String {
    let (columns, argument) = match key {
        Key::Id => ("id", String::new()),
        Key::InboxAndId => ("inbox, id", format!("'{INBOX_AND_ID}'")),
    };
    format!(
        "CREATE TRIGGER {NAME} AFTER INSERT OR UPDATE OF {columns} ON {table} \
         FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger({argument}); \
         ALTER TABLE {table} ENABLE ALWAYS TRIGGER {NAME}"
    )
}

/// Puts the trigger of `table` right (re-created, or re-enabled always), without waiting for a lock longer than a
/// moment: true when it was repaired, false when the table is busy (try again later). Runs as the caller (the
/// background worker, a superuser).
pub fn repair(table: &str, key: Key, state: State) -> bool {
    let sql = match state {
        State::Guarding => return true,
        State::Disabled | State::OnOrigin | State::OnReplica => {
            format!("ALTER TABLE {table} ENABLE ALWAYS TRIGGER {NAME}")
        }
        State::Missing | State::Before | State::WrongKey => {
            format!("DROP TRIGGER IF EXISTS {NAME} ON {table}; {}", create_sql(table, key))
        }
    };
    crate::xact::unless_it_waits(|| {
        crate::guc::with_setting(c"lock_timeout", c"100ms", || {
            Spi::run(&sql).unwrap_or_else(|e| internal("repairing the filter trigger", e))
        })
    })
    .is_some()
}

/// Row trigger on every inbox table (AFTER INSERT OR UPDATE OF id, ENABLE ALWAYS) and on `dedup.attempt_counts`
/// (OF inbox, id, with the argument `'inbox_and_id'`): puts the new row's key into the filter once the row is
/// written, whoever writes it through the executor (INSERT, COPY, a restore, logical replication, the SQL roads of
/// mark() and of the worker). The direct writes (`direct`), which bypass it, add the keys themselves.
#[pg_trigger]
fn inbox_filter_trigger<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::heap_tuple::PgHeapTupleError> {
    let new = trigger.new();
    if filter::is_preloaded() {
        if let (Some(tuple), Ok(relid)) = (&new, trigger.relid()) {
            let column = |n: usize| tuple.get_by_index::<&str>(std::num::NonZeroUsize::new(n).expect("not zero"));
            // SAFETY: the trigger of the firing event, from its trigger data.
            match unsafe { Key::of_trigger(trigger.trigger()) } {
                Some(Key::Id) => {
                    if let Ok(Some(id)) = column(1) {
                        filter::add(namespace(relid), &[id]);
                    }
                }
                Some(Key::InboxAndId) => {
                    if let (Ok(Some(inbox)), Ok(Some(id))) = (column(1), column(2)) {
                        filter::add_keys(namespace(relid), &[filter::attempt_key(inbox.as_bytes(), id.as_bytes())]);
                    }
                }
                // Not the table's key (State::WrongKey): the filter does not answer for the table.
                None => {}
            }
        }
    }
    Ok(new)
}

/// The event trigger `dedup_watch_ddl` (ddl_command_end of ALTER TABLE and CREATE, DROP and ALTER TRIGGER): the
/// filter stops trusting every inbox table of this database whose filter trigger is no longer guarding. Reads only
/// pg_catalog and takes no lock, so it cannot make anyone's DDL fail or wait; it runs as whoever ran the command.
#[pg_extern(sql = "
    CREATE FUNCTION dedup.watch_ddl() RETURNS event_trigger LANGUAGE c
    AS 'MODULE_PATHNAME', 'watch_ddl_wrapper';
")]
fn watch_ddl(_fcinfo: pg_sys::FunctionCallInfo) {
    if !filter::is_preloaded() {
        return;
    }
    for relid in catalog::filtered_tables() {
        let state = State::of_table(relid);
        if state != State::Guarding && filter::untrust(namespace(relid)) {
            let table = catalog::qualified_name(relid).unwrap_or_default();
            server_log!(
                "pg_dedup: the Bloom filter stops answering for {table} until its {NAME} trigger is repaired (it is {})",
                state.label()
            );
        }
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::State;
    use crate::testing::*;
    use pgrx::prelude::*;

    fn state(inbox: &str) -> State {
        State::of_table(one::<pg_sys::Oid>(&format!("SELECT 'dedup.inbox_{inbox}'::regclass::oid")))
    }

    fn trusted(inbox: &str) -> bool {
        one::<bool>(&format!("SELECT filter_trusted FROM dedup.stats WHERE inbox = '{inbox}'"))
    }

    #[pg_test]
    fn trigger_states_are_read_from_the_relcache() {
        run("SELECT dedup.create_inbox('tg_states')");
        assert_eq!(state("tg_states"), State::Guarding);
        for (ddl, expected) in [
            ("DISABLE TRIGGER dedup_filter", State::Disabled),
            ("ENABLE TRIGGER dedup_filter", State::OnOrigin),
            ("ENABLE REPLICA TRIGGER dedup_filter", State::OnReplica),
            ("ENABLE ALWAYS TRIGGER dedup_filter", State::Guarding),
            ("DISABLE TRIGGER ALL", State::Disabled),
            ("ENABLE TRIGGER ALL", State::OnOrigin),
        ] {
            run(&format!("ALTER TABLE dedup.inbox_tg_states {ddl}"));
            assert_eq!(state("tg_states"), expected, "after {ddl}");
        }
        run("DROP TRIGGER dedup_filter ON dedup.inbox_tg_states");
        assert_eq!(state("tg_states"), State::Missing);
        run("CREATE TRIGGER dedup_filter BEFORE INSERT OR UPDATE ON dedup.inbox_tg_states
               FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger();
             ALTER TABLE dedup.inbox_tg_states ENABLE ALWAYS TRIGGER dedup_filter");
        assert_eq!(state("tg_states"), State::Before, "as pg_dedup 0.2.0 made it");
    }

    #[pg_test]
    fn trigger_keyed_otherwise_than_its_table_is_not_guarding_and_is_repaired() {
        let counts = || State::of_table(one::<pg_sys::Oid>("SELECT 'dedup.attempt_counts'::regclass::oid"));
        assert_eq!(counts(), State::Guarding);
        // An inbox's trigger copied onto the counts' table would key their rows by id alone.
        run("DROP TRIGGER dedup_filter ON dedup.attempt_counts;
             CREATE TRIGGER dedup_filter AFTER INSERT OR UPDATE OF id ON dedup.attempt_counts
               FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger();
             ALTER TABLE dedup.attempt_counts ENABLE ALWAYS TRIGGER dedup_filter");
        assert_eq!(counts(), State::WrongKey);
        assert!(super::repair("dedup.attempt_counts", super::Key::InboxAndId, State::WrongKey));
        assert_eq!(counts(), State::Guarding);
        run("SELECT dedup.create_inbox('tg_key');
             DROP TRIGGER dedup_filter ON dedup.inbox_tg_key;
             CREATE TRIGGER dedup_filter AFTER INSERT OR UPDATE OF id ON dedup.inbox_tg_key
               FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger('something');
             ALTER TABLE dedup.inbox_tg_key ENABLE ALWAYS TRIGGER dedup_filter");
        assert_eq!(state("tg_key"), State::WrongKey);
        assert!(!trusted("tg_key"), "the event trigger stopped trusting it");
    }

    #[pg_test]
    fn trigger_ddl_that_stops_it_guarding_stops_the_filter_at_once() {
        run("SELECT dedup.create_inbox('tg_watch')");
        assert!(trusted("tg_watch"));
        run("ALTER TABLE dedup.inbox_tg_watch DISABLE TRIGGER dedup_filter");
        run("ALTER TABLE dedup.inbox_tg_watch ENABLE ALWAYS TRIGGER dedup_filter");
        // Guarding again, but rows could have been written meanwhile: only a load trusts it again.
        assert_eq!(state("tg_watch"), State::Guarding);
        assert!(!trusted("tg_watch"), "the event trigger stopped trusting the inbox when its trigger was disabled");
        crate::rebuild::run(false).expect("no other rebuild runs");
        assert!(trusted("tg_watch"));
    }

    #[pg_test]
    fn trigger_rows_written_while_it_was_off_are_loaded_and_seen() {
        run("SELECT dedup.create_inbox('tg_quiet')");
        run("ALTER TABLE dedup.inbox_tg_quiet DISABLE TRIGGER ALL;
             INSERT INTO dedup.inbox_tg_quiet SELECT 'q' || g, now() + interval '1 hour' FROM generate_series(1, 100) g;
             ALTER TABLE dedup.inbox_tg_quiet ENABLE TRIGGER ALL");
        assert_eq!(count("generate_series(1, 100) g WHERE NOT dedup.seen('q' || g, 'tg_quiet')"), 0);
        let done = crate::rebuild::run(false).expect("no other rebuild runs");
        assert!(
            done.skipped.iter().any(|(_, why)| *why == crate::rebuild::Skipped::Unguarded(State::OnOrigin)),
            "an inbox whose trigger is in origin mode is not loaded"
        );
        assert!(!trusted("tg_quiet"));
        assert!(super::repair("dedup.inbox_tg_quiet", super::Key::Id, State::OnOrigin));
        assert_eq!(state("tg_quiet"), State::Guarding);
        crate::rebuild::run(false).expect("no other rebuild runs");
        assert!(trusted("tg_quiet"));
        assert_eq!(count("generate_series(1, 100) g WHERE NOT dedup.seen('q' || g, 'tg_quiet')"), 0);
    }

    #[pg_test]
    fn trigger_repair_re_creates_a_missing_or_before_trigger() {
        run("SELECT dedup.create_inbox('tg_repair'); DROP TRIGGER dedup_filter ON dedup.inbox_tg_repair");
        assert!(super::repair("dedup.inbox_tg_repair", super::Key::Id, State::Missing));
        assert_eq!(state("tg_repair"), State::Guarding);
        run("ALTER TABLE dedup.inbox_tg_repair RENAME TO inbox_tg_renamed");
        assert_eq!(state("tg_renamed"), State::Guarding, "a trigger follows its table");
    }

    #[pg_test]
    fn trigger_hashes_the_id_as_stored_after_other_triggers_rewrote_it() {
        run("SELECT dedup.create_inbox('tg_rewrite');
             CREATE FUNCTION tg_upper() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN NEW.id := upper(NEW.id); RETURN NEW; END $$;
             CREATE TRIGGER zzz_upper BEFORE INSERT ON dedup.inbox_tg_rewrite FOR EACH ROW EXECUTE FUNCTION tg_upper();
             INSERT INTO dedup.inbox_tg_rewrite VALUES ('lower', now() + interval '1 hour');");
        assert!(trusted("tg_rewrite"));
        assert!(one::<bool>("SELECT dedup.seen('LOWER', 'tg_rewrite')"));
    }
}
