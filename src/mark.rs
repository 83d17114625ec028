//! `mark()`, `mark_many()`, `seen()` and `forget()`: the inbox pattern's SQL face, and the algorithm that claims
//! ids for them (and for attached tables' rows).
//!
//! One algorithm serves one id or many, so both obey the same contract:
//! 1. insert the pending ids with `ON CONFLICT DO NOTHING`. A conflict with a row another transaction is still
//!    inserting *waits* for that transaction (the blocking claim): if it commits the id is a duplicate, if it
//!    rolls back our insert goes through. A duplicate writes no WAL and takes no lock.
//! 2. probe the ids that conflicted: a live row means duplicate; an expired row (not purged yet) is renewed in
//!    place, atomically (`UPDATE ... WHERE expires_at <= now`), so the id is new again.
//! 3. anything left vanished between statements (a concurrent purge or forget) or lost a renewal race; go round.
//!
//! When the shared filter says "maybe" for an id, step 2 comes first (a likely duplicate is answered by one
//! lookup, with no insert attempt); when it says "certainly new", the insert goes first and is usually all it takes:
//! those ids (and suspects the lookup did not find) go straight into heap and indexes (`direct`), and only
//! what that could not settle takes the rounds.
//!
//! Ids are processed in sorted order, so two `mark_many()` calls with overlapping ids lock rows in the same order
//! and cannot deadlock each other.

use crate::clock::{later, statement_expiry, statement_now};
use crate::errors::raise;
use crate::inbox::{self, Access, Inbox, Stmt};
use crate::shmem::Counter;
use crate::{attempts, direct, gate, input, rows};
use pgrx::prelude::*;
use rustc_hash::FxHashSet as HashSet;
use std::cell::OnceCell;

/// Rounds of insert/probe/renew before giving up. Each extra round needs a concurrent purge or forget of the very
/// same id between two statements, so more than a couple of rounds means something is badly wrong.
pub const MAX_ROUNDS: usize = 16;

/// When a mark made now expires: `ttl` (already validated) or the inbox's default (validated when created). Worked
/// out when first needed (calendar arithmetic in the session's time zone): a call whose ids are all duplicates never
/// needs it.
struct WindowEnd<'a> {
    inbox: &'a Inbox,
    ttl: Option<Interval>,
    at: OnceCell<TimestampWithTimeZone>,
}

impl WindowEnd<'_> {
    fn get(&self) -> TimestampWithTimeZone {
        *self.at.get_or_init(|| statement_expiry(self.ttl.unwrap_or_else(|| self.inbox.default_ttl())))
    }
}

/// Distinct ids claimed together: past this, a call works through its ids in chunks, in sorted order, so its
/// memory stays bounded whatever the array's size. A large array is cut into at most `MAX_CHUNKS` chunks (each
/// chunk's multi-insert takes a subtransaction, and the backend keeps room for only so many).
pub const CHUNK: usize = 10_000;
const MAX_CHUNKS: usize = 16;

/// Marks `ids` in `inbox` for `ttl` (None: the inbox's default), asking the filter first, and keeps the inbox's
/// counters. Returns, for each position of `ids`, whether it is the first occurrence of an id that was new.
pub fn mark_ids(inbox: &Inbox, ids: &[&str], ttl: Option<Interval>) -> Vec<bool> {
    if let [id] = ids {
        return vec![mark_one(inbox, id, ttl)];
    }
    // The distinct ids in sorted order (two calls with overlapping ids then lock rows in the same order and cannot
    // deadlock each other), each by the position of its first occurrence. Positions, not copies: an array of a
    // million ids must not cost a million strings.
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| ids[a as usize].cmp(ids[b as usize]).then(a.cmp(&b)));
    order.dedup_by(|later, first| ids[*later as usize] == ids[*first as usize]);
    let expires_at = WindowEnd { inbox, ttl, at: OnceCell::new() };
    let mut new_at = vec![false; ids.len()];
    let mut fresh = 0;
    for chunk in order.chunks(CHUNK.max(order.len().div_ceil(MAX_CHUNKS))) {
        let chunk_ids: Vec<&str> = chunk.iter().map(|&i| ids[i as usize]).collect();
        let maybe = gate::maybe(inbox, &chunk_ids);
        let out = mark_sorted(inbox, &chunk_ids, maybe.as_deref(), &expires_at);
        for (&i, &new) in chunk.iter().zip(&out.fresh) {
            new_at[i as usize] = new;
            fresh += new as u64;
        }
        out.count(inbox);
    }
    inbox.count(Counter::Marks, fresh);
    inbox.count(Counter::Duplicates, ids.len() as u64 - fresh);
    new_at
}

/// `mark_ids` of one id.
fn mark_one(inbox: &Inbox, id: &str, ttl: Option<Interval>) -> bool {
    mark_answered(inbox, id, ttl, gate::certainly_new(inbox, id))
}

/// `mark_ids` of one id whose filter answer the caller has already asked for (`gate::certainly_new`), so that the
/// lookup is made and counted once. The two common cases take none of the sorting and bookkeeping of many ids: a
/// redelivery (the filter's "maybe", and a live row) is answered by one lookup, a tenth of a duplicate's work; a
/// certainly-new id (each new row of a COPY into an attached table) goes straight into heap and indexes, as
/// `mark_sorted` would send it, without its allocations (2% of such a row's instructions, callgrind). Anything else
/// takes the algorithm, with the filter's answer passed on (a "maybe" whose row is expired or gone is looked up
/// again there).
pub fn mark_answered(inbox: &Inbox, id: &str, ttl: Option<Interval>, certainly_new: Option<bool>) -> bool {
    let expires_at = WindowEnd { inbox, ttl, at: OnceCell::new() };
    let mut maybe = certainly_new.map(|new| !new);
    if maybe == Some(false) {
        crate::filter::prefetch(inbox.ns, id);
        if direct::insert(inbox, &[id], &direct::Row::mark(expires_at.get())) == 1 {
            inbox.count(Counter::Marks, 1);
            return true;
        }
        // Not written (the table needs the executor, or the id has a row after all, maybe another transaction's
        // in progress): the rounds decide, and wait for that transaction, without a second direct attempt.
        maybe = None;
    }
    if maybe == Some(true) && rows::find_own_or_one(inbox, id).is_some_and(|row| later(row.expires_at, statement_now()))
    {
        inbox.count(Counter::Duplicates, 1);
        return false;
    }
    let out = mark_sorted(inbox, &[id], maybe.as_ref().map(std::slice::from_ref), &expires_at);
    let new = out.fresh[0];
    out.count(inbox);
    inbox.count(if new { Counter::Marks } else { Counter::Duplicates }, 1);
    new
}

/// What a claim found. Ids are known by their position in the claim's sorted ids: a thousand duplicates cost no
/// copy of any of them.
struct Outcome {
    /// For each id, whether it was new: inserted, or renewed after expiring.
    fresh: Vec<bool>,
    renewals: u64,
    /// Ids the filter could not rule out that turned out to be new (it said "maybe", the index said no).
    false_positives: u64,
}

/// Claims `ids` (sorted, distinct) for the window ending at `expires_at`. `maybe` is what the filter said of each:
/// None when no filter answered. Ids it could not call "certainly new" are probed before any insert is tried, so
/// a duplicate costs one index lookup (and a batch of neighbours one walk over their leaf pages). When a filter
/// answered, what is left is most likely all new and goes straight into heap and indexes; whatever that cannot
/// settle takes the ordinary rounds, whose conflict check is the truth either way.
fn mark_sorted(inbox: &Inbox, ids: &[&str], maybe: Option<&[bool]>, expires_at: &WindowEnd) -> Outcome {
    let now = statement_now();
    let mut out = Outcome { fresh: vec![false; ids.len()], renewals: 0, false_positives: 0 };
    // The positions of the ids not settled yet, ascending.
    let mut pending: Vec<usize> = (0..ids.len()).collect();
    if let Some(maybe) = maybe {
        let probe_first: Vec<usize> = pending.iter().copied().filter(|&k| maybe[k]).collect();
        if !probe_first.is_empty() {
            let before = pending.len();
            settle(inbox, ids, &probe_first, now, expires_at, &mut pending, &mut out);
            let duplicates = before - pending.len() - out.renewals as usize;
            out.false_positives = (probe_first.len() - duplicates) as u64;
        }
        if !pending.is_empty() {
            let rest: Vec<&str> = pending.iter().map(|&k| ids[k]).collect();
            let inserted = direct::insert(inbox, &rest, &direct::Row::mark(expires_at.get()));
            for k in pending.drain(..inserted) {
                out.fresh[k] = true;
            }
        }
    }
    for _ in 0..MAX_ROUNDS {
        if pending.is_empty() {
            return out;
        }
        let rest: Vec<String> = pending.iter().map(|&k| ids[k].to_owned()).collect();
        out.returned_fresh(ids, insert(inbox, &rest, expires_at.get()));
        pending.retain(|&k| !out.fresh[k]);
        if pending.is_empty() {
            return out;
        }
        let conflicted = pending.clone();
        settle(inbox, ids, &conflicted, now, expires_at, &mut pending, &mut out);
    }
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!("could not claim {} id(s) in inbox \"{}\" after {MAX_ROUNDS} rounds", pending.len(), inbox.name),
        "Another session kept deleting and re-creating the same ids; retry the transaction.",
    )
}

impl Outcome {
    /// Adds the claim's renewals and the filter's false positives to the inbox's counters.
    fn count(&self, inbox: &Inbox) {
        inbox.count(Counter::Renewals, self.renewals);
        inbox.count(Counter::FalsePositives, self.false_positives);
    }

    /// Records as new the ids a statement of this claim returned (`ids`: the claim's, sorted).
    fn returned_fresh(&mut self, ids: &[&str], returned: HashSet<String>) {
        for id in returned {
            let k = ids.binary_search(&id.as_str()).expect("a statement returns only the ids it was given");
            self.fresh[k] = true;
        }
    }
}

/// Looks up the ids at positions `which` (ascending) as rows visible now: live ones are duplicates and leave
/// `pending`; expired ones are renewed in place and become fresh. What is left in `pending` had no row (or lost a
/// renewal race) and goes to the insert.
fn settle(
    inbox: &Inbox,
    ids: &[&str],
    which: &[usize],
    now: TimestampWithTimeZone,
    expires_at: &WindowEnd,
    pending: &mut Vec<usize>,
    out: &mut Outcome,
) {
    let wanted: Vec<&str> = which.iter().map(|&k| ids[k]).collect();
    let mut live = vec![false; ids.len()];
    // Sorted, as `which` is.
    let mut expired: Vec<String> = Vec::new();
    for (&k, row) in which.iter().zip(rows::find(inbox, &wanted)) {
        match row {
            Some(row) if later(row.expires_at, now) => live[k] = true,
            Some(_) => expired.push(ids[k].to_owned()),
            None => {}
        }
    }
    pending.retain(|&k| !live[k]);
    if !expired.is_empty() {
        let renewed = returned_ids(inbox, Stmt::Renew, &[expired.into(), expires_at.get().into(), now.into()]);
        out.renewals += renewed.len() as u64;
        out.returned_fresh(ids, renewed);
        pending.retain(|&k| !out.fresh[k]);
    }
}

fn insert(inbox: &Inbox, ids: &[String], expires_at: TimestampWithTimeZone) -> HashSet<String> {
    if let [id] = ids {
        // The common case (one new id per transaction) gets the plain single-row INSERT plan. Whether the row went
        // in is the count SPI reports: the rows returned, or the rows inserted where the statement returns none.
        let inserted = Spi::connect(|client| {
            !inbox.run(client, Stmt::Insert, &[id.as_str().into(), expires_at.into()]).is_empty()
        });
        return if inserted { HashSet::from_iter([id.clone()]) } else { HashSet::default() };
    }
    returned_ids(inbox, Stmt::InsertMany, &[ids.to_vec().into(), expires_at.into()])
}

fn returned_ids(inbox: &Inbox, stmt: Stmt, args: &[pgrx::datum::DatumWithOid<'_>]) -> HashSet<String> {
    Spi::connect(|client| inbox.run(client, stmt, args).filter_map(|row| row.get::<String>(1).ok().flatten()).collect())
}

/// Is there a live mark for `id` visible to this transaction? The filter answers "certainly not" when it can.
pub fn seen_id(inbox: &Inbox, id: &str) -> bool {
    // A key a batched attachment remembered is this transaction's mark, not in the table yet (`attach::batch`).
    if crate::attach::batch_holds(inbox, id) {
        return true;
    }
    let certainly_new = gate::certainly_new(inbox, id);
    if certainly_new == Some(true) {
        return false;
    }
    let seen = rows::find_one(inbox, id).is_some_and(|row| later(row.expires_at, statement_now()));
    if !seen && certainly_new == Some(false) {
        inbox.count(Counter::FalsePositives, 1);
    }
    seen
}

/// Deletes the row for `id`, live or expired; true if a live mark was removed.
pub fn forget_id(inbox: &Inbox, id: &str) -> bool {
    Spi::connect(|client| {
        inbox
            .run(client, Stmt::Forget, &[id.into(), statement_now().into()])
            .any(|row| row.get::<bool>(1).ok().flatten() == Some(true))
    })
}

/// Records `id` in `inbox` for `ttl` (NULL: the inbox's default) inside the current transaction. True the first
/// time within the window, false for a duplicate. Waits for a concurrent transaction marking the same id.
#[pg_extern(volatile, parallel_unsafe)]
fn mark(id: Option<&str>, ttl: default!(Option<Interval>, "NULL"), inbox: default!(Option<&str>, "'default'")) -> bool {
    input::require_writable("mark");
    let id = input::id(id);
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    mark_one(&inbox, id, ttl)
}

/// Marks every id in `ids`; returns the ids that were new, each once, in order of first occurrence (a repeat
/// inside the array is a duplicate of its first occurrence).
#[pg_extern(volatile, parallel_unsafe)]
fn mark_many<'a>(
    ids: Option<Array<'a, &'a str>>,
    ttl: default!(Option<Interval>, "NULL"),
    inbox: default!(Option<&str>, "'default'"),
) -> SetOfIterator<'a, &'a str> {
    input::require_writable("mark_many");
    let array = input::id_array(ids);
    let mut ids = input::ids(&array);
    let ttl = ttl.map(input::ttl);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    let new_at = if ids.is_empty() { Vec::new() } else { mark_ids(&inbox, &ids, ttl) };
    let mut position = 0;
    ids.retain(|_| {
        position += 1;
        new_at[position - 1]
    });
    // SAFETY: the ids point into the array's datum, which `Rows` keeps (with the array) until the last row is
    // returned; only the borrow of the `Array` handle is shorter than that.
    let new: Vec<&'a str> = unsafe { std::mem::transmute::<Vec<&str>, Vec<&'a str>>(ids) };
    SetOfIterator::new(Rows { rows: new.into_iter(), _array: array })
}

/// The rows of a set-returning call that point into one of its arguments, with that argument kept alive: an array
/// detoasted for the call is freed when its `Array` goes.
struct Rows<'a> {
    rows: std::vec::IntoIter<&'a str>,
    _array: Array<'a, &'a str>,
}

impl<'a> Iterator for Rows<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        self.rows.next()
    }
}

/// Read-only: is a live (unexpired) mark for `id` visible to this transaction?
#[pg_extern(stable, parallel_restricted)]
fn seen(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Read);
    seen_id(&inbox, id)
}

/// Deletes the mark for `id` (operator replay: the next delivery is processed again). True if a live mark was
/// removed.
#[pg_extern(volatile, parallel_unsafe)]
fn forget(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    input::require_writable("forget");
    // It resets the id's count of attempts, which is the node's own.
    crate::citus::refuse_task_on_node_state("forget()");
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Delete);
    attempts::forget(&inbox, id);
    forget_id(&inbox, id)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    /// A fresh inbox: created empty, so the filter answers for it at once.
    fn fresh_inbox(name: &str) {
        run(&format!("SELECT dedup.create_inbox('{name}', '1 day')"));
        assert!(one::<bool>(&format!("SELECT filter_trusted FROM dedup.stats WHERE inbox = '{name}'")));
    }

    fn counter(inbox: &str, column: &str) -> i64 {
        one::<i64>(&format!("SELECT {column} FROM dedup.stats WHERE inbox = '{inbox}'"))
    }

    /// Index scans of inbox `name`'s primary key in this transaction so far.
    fn key_scans(name: &str) -> i64 {
        one::<i64>(&format!("SELECT pg_stat_get_xact_numscans('dedup.inbox_{name}_pkey'::regclass)"))
    }

    /// A repeat of an id this transaction wrote is read where the row went (`direct::own_row`), no index scan; and
    /// whatever the transaction did to that row since (forgot, deleted, expired it, or wrote it in a subtransaction
    /// that rolled back), the answer is the index's.
    #[pg_test]
    fn mark_an_id_this_transaction_wrote_is_read_where_it_went_while_it_is_there() {
        fresh_inbox("own");
        assert!(one::<bool>("SELECT dedup.mark('o1', NULL, 'own')"));
        let scans = key_scans("own");
        assert!(!one::<bool>("SELECT dedup.mark('o1', NULL, 'own')"), "a duplicate of its own write");
        assert_eq!(key_scans("own"), scans, "read where it went, not through the primary key");
        run("SELECT dedup.forget('o1', 'own')");
        assert!(one::<bool>("SELECT dedup.mark('o1', NULL, 'own')"), "forgotten: new again");
        run("DELETE FROM dedup.inbox_own WHERE id = 'o1'");
        assert!(one::<bool>("SELECT dedup.mark('o1', NULL, 'own')"), "deleted: new again");
        run("UPDATE dedup.inbox_own SET expires_at = now() - interval '1 second' WHERE id = 'o1'");
        assert!(one::<bool>("SELECT dedup.mark('o1', NULL, 'own')"), "expired: renewed");
        assert!(!one::<bool>("SELECT dedup.mark('o1', NULL, 'own')"), "renewed: a duplicate again");
        assert_eq!(count("dedup.inbox_own WHERE id = 'o1'"), 1);
        run("DO $$ BEGIN PERFORM dedup.mark('o2', NULL, 'own'); RAISE EXCEPTION 'undo'; \
             EXCEPTION WHEN raise_exception THEN NULL; END $$");
        assert!(one::<bool>("SELECT dedup.mark('o2', NULL, 'own')"), "its subtransaction rolled back: new");
        assert!(!one::<bool>("SELECT dedup.mark('o2', NULL, 'own')"));
    }

    #[pg_test]
    fn mark_an_expired_mark_is_renewed_in_place() {
        fresh_inbox("renew");
        run("INSERT INTO dedup.inbox_renew VALUES ('r', now() - interval '1 second')");
        let before = one::<String>("SELECT ctid::text FROM dedup.inbox_renew WHERE id = 'r'");
        assert!(one::<bool>("SELECT dedup.mark('r', '1 hour', 'renew')"), "an expired mark is new again");
        assert_eq!(count("dedup.inbox_renew"), 1, "renewed, not inserted twice");
        assert!(one::<bool>("SELECT expires_at = statement_timestamp() + interval '1 hour' FROM dedup.inbox_renew"));
        assert_ne!(
            one::<String>("SELECT ctid::text FROM dedup.inbox_renew WHERE id = 'r'"),
            before,
            "a new row version"
        );
        assert_eq!(counter("renew", "renewals"), 1);
        assert!(!one::<bool>("SELECT dedup.mark('r', NULL, 'renew')"));
    }

    #[pg_test]
    fn mark_mark_many_renews_expired_ids_among_new_and_live_ones() {
        fresh_inbox("renew_many");
        run("INSERT INTO dedup.inbox_renew_many VALUES ('old-1', now() - interval '1 minute'),
                 ('old-2', now() - interval '1 minute'), ('live', now() + interval '1 hour')");
        let new = column(
            "SELECT * FROM dedup.mark_many(ARRAY['n1','old-1','live','n2','n3','n4','n5','n6','n7','old-2'], NULL, 'renew_many')",
        );
        assert_eq!(new, ["n1", "old-1", "n2", "n3", "n4", "n5", "n6", "n7", "old-2"]);
        assert_eq!(counter("renew_many", "renewals"), 2);
        assert_eq!(count("dedup.inbox_renew_many WHERE expires_at < now()"), 0);
    }

    #[pg_test]
    fn mark_a_duplicate_does_not_extend_the_window() {
        fresh_inbox("window");
        run("SELECT dedup.mark('w', '1 hour', 'window')");
        let first = one::<String>("SELECT expires_at::text FROM dedup.inbox_window");
        assert!(!one::<bool>("SELECT dedup.mark('w', '5 days', 'window')"));
        assert_eq!(one::<String>("SELECT expires_at::text FROM dedup.inbox_window"), first);
    }

    #[pg_test]
    fn mark_certainly_new_ids_go_straight_into_heap_and_indexes() {
        fresh_inbox("direct");
        let calls = trigger_calls();
        assert!(one::<bool>("SELECT dedup.mark('single', NULL, 'direct')"));
        assert_eq!(column("SELECT * FROM dedup.mark_many((SELECT array_agg('b' || g) FROM generate_series(1, 50) g), NULL, 'direct')").len(), 50);
        assert_eq!(trigger_calls(), calls, "the speculative and the multi-insert wrote the rows, not the executor");
        assert_eq!(count("dedup.inbox_direct"), 51);
        assert_eq!(counter("direct", "certainly_new"), 51);
        assert_eq!(counter("direct", "marks"), 51);
        // Both indexes got every row.
        run("SET LOCAL enable_seqscan = off");
        assert_eq!(count("dedup.inbox_direct WHERE id = 'b17'"), 1);
        assert_eq!(count("dedup.inbox_direct WHERE expires_at > now()"), 51);
    }

    #[pg_test]
    fn mark_duplicates_are_answered_by_a_lookup_and_counted() {
        fresh_inbox("dups");
        run("SELECT * FROM dedup.mark_many(ARRAY['d1', 'd2', 'd3'], NULL, 'dups')");
        assert!(column("SELECT * FROM dedup.mark_many(ARRAY['d1', 'd2', 'd3', 'd1'], NULL, 'dups')").is_empty());
        assert_eq!(counter("dups", "marks"), 3);
        assert_eq!(counter("dups", "duplicates"), 4, "a repeat inside an array counts as a duplicate too");
        assert_eq!(counter("dups", "false_positives"), 0);
    }

    #[pg_test]
    fn mark_a_false_positive_is_counted_and_the_id_is_new() {
        fresh_inbox("fp");
        run("SELECT dedup.mark('gone', NULL, 'fp'); SELECT dedup.forget('gone', 'fp')");
        assert!(one::<bool>("SELECT dedup.mark('gone', NULL, 'fp')"), "the filter said maybe, the index said no");
        assert_eq!(counter("fp", "false_positives"), 1);
    }

    #[pg_test]
    fn mark_an_inbox_with_another_trigger_is_written_by_the_executor() {
        fresh_inbox("audited");
        run("CREATE TABLE claim_audit (id text);
             CREATE FUNCTION claim_audit() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO claim_audit VALUES (NEW.id); RETURN NEW; END $$;
             CREATE TRIGGER audit AFTER INSERT ON dedup.inbox_audited FOR EACH ROW EXECUTE FUNCTION claim_audit()");
        let calls = trigger_calls();
        assert!(one::<bool>("SELECT dedup.mark('a', NULL, 'audited')"));
        assert_eq!(
            column("SELECT * FROM dedup.mark_many(ARRAY['b','c','d','e','f','g','h','i','j'], NULL, 'audited')").len(),
            9
        );
        assert_eq!(count("claim_audit"), 10, "the owner's trigger saw every row");
        assert_eq!(trigger_calls(), calls + 10, "the filter trigger ran for every row the executor wrote");
        assert!(one::<bool>("SELECT filter_trusted FROM dedup.stats WHERE inbox = 'audited'"));
        assert!(one::<bool>("SELECT dedup.seen('j', 'audited')"));
    }

    #[pg_test]
    fn mark_without_a_trusted_filter_the_index_answers_alone() {
        run("SET LOCAL dedup.bloom = off");
        assert!(!one::<bool>("SELECT filter_trusted FROM dedup.stats WHERE inbox = 'default'"));
        assert!(one::<bool>("SELECT dedup.mark('i1')"));
        assert!(!one::<bool>("SELECT dedup.mark('i1')"));
        assert_eq!(
            column("SELECT * FROM dedup.mark_many(ARRAY['i1','i2','i3','i4','i5','i6','i7','i8','i9'])").len(),
            8
        );
        assert!(one::<bool>("SELECT dedup.seen('i9')"));
    }

    #[pg_test]
    fn mark_mark_is_true_the_first_time_and_false_after() {
        assert!(one::<bool>("SELECT dedup.mark('api-1')"));
        assert!(!one::<bool>("SELECT dedup.mark('api-1')"));
        assert!(!one::<bool>("SELECT dedup.mark('api-1', '1 hour')"), "a ttl does not make a duplicate new");
        assert_eq!(count("dedup.inbox_default WHERE id = 'api-1'"), 1);
    }
    #[pg_test]
    fn mark_mark_expires_after_its_ttl_or_the_inbox_default() {
        run("SELECT dedup.create_inbox('api_ttl', '2 days')");
        run(
            "SELECT dedup.mark('with-ttl', '90 minutes', 'api_ttl'); SELECT dedup.mark('default-ttl', NULL, 'api_ttl')",
        );
        let ttl = |id: &str| {
            one::<String>(&format!(
                "SELECT (expires_at - statement_timestamp())::text FROM dedup.inbox_api_ttl WHERE id = '{id}'"
            ))
        };
        // Measured from the start of the statement (the test's one statement, for every call inside it).
        assert_eq!(ttl("with-ttl"), "01:30:00");
        assert_eq!(ttl("default-ttl"), "2 days");
    }
    #[pg_test]
    fn mark_inboxes_are_independent_namespaces() {
        run("SELECT dedup.create_inbox('api_a'); SELECT dedup.create_inbox('api_b')");
        assert!(one::<bool>("SELECT dedup.mark('same', NULL, 'api_a')"));
        assert!(one::<bool>("SELECT dedup.mark('same', NULL, 'api_b')"));
        assert!(!one::<bool>("SELECT dedup.mark('same', NULL, 'api_a')"));
        assert!(!one::<bool>("SELECT dedup.seen('same')"), "not in the default inbox");
    }
    #[pg_test]
    fn mark_mark_many_returns_new_ids_once_in_first_occurrence_order() {
        run("SELECT dedup.mark('m-old')");
        let new = column("SELECT * FROM dedup.mark_many(ARRAY['m-b', 'm-old', 'm-a', 'm-b', 'm-c', 'm-a'])");
        assert_eq!(new, ["m-b", "m-a", "m-c"]);
        assert!(column("SELECT * FROM dedup.mark_many(ARRAY['m-a', 'm-b', 'm-c'])").is_empty());
        assert!(column("SELECT * FROM dedup.mark_many(ARRAY[]::text[])").is_empty());
    }
    #[pg_test]
    fn mark_mark_many_works_through_a_large_array_in_chunks() {
        // More distinct ids than one chunk holds, with repeats and duplicates of earlier marks mixed in.
        run("SELECT dedup.mark('big-17'); SELECT dedup.mark('big-24999')");
        let returned = one::<i64>(
            "SELECT count(*) FROM dedup.mark_many(
               (SELECT array_agg('big-' || (g % 25000)) FROM generate_series(0, 29999) g))",
        );
        assert_eq!(returned, 24_998);
        assert_eq!(count("dedup.inbox_default WHERE id LIKE 'big-%'"), 25_000);
        let first_ten = column(
            "SELECT * FROM dedup.mark_many((SELECT array_agg('order-' || (10 - g)) FROM generate_series(1, 10) g)) \
             LIMIT 10",
        );
        assert_eq!(first_ten, (0..10).rev().map(|i| format!("order-{i}")).collect::<Vec<_>>(), "array order kept");
    }
    #[pg_test]
    fn mark_seen_answers_for_live_marks_only() {
        run("SELECT dedup.mark('s-live'); SELECT dedup.mark('s-old', '1 hour')");
        run("UPDATE dedup.inbox_default SET expires_at = now() - interval '1 second' WHERE id = 's-old'");
        assert!(one::<bool>("SELECT dedup.seen('s-live')"));
        assert!(!one::<bool>("SELECT dedup.seen('s-old')"), "an expired mark is not seen");
        assert!(!one::<bool>("SELECT dedup.seen('s-never')"));
    }
    #[pg_test]
    fn mark_forget_removes_a_mark_and_says_whether_it_was_live() {
        run("SELECT dedup.mark('f-live'); SELECT dedup.mark('f-old')");
        run("UPDATE dedup.inbox_default SET expires_at = now() - interval '1 second' WHERE id = 'f-old'");
        assert!(one::<bool>("SELECT dedup.forget('f-live')"));
        assert!(!one::<bool>("SELECT dedup.forget('f-old')"), "an expired mark was not live");
        assert!(!one::<bool>("SELECT dedup.forget('f-never')"));
        assert_eq!(count("dedup.inbox_default WHERE id IN ('f-live', 'f-old')"), 0, "both rows are gone");
        assert!(one::<bool>("SELECT dedup.mark('f-live')"), "forgotten: new again");
    }
    #[pg_test]
    fn mark_a_rolled_back_savepoint_takes_its_marks() {
        // A subtransaction rolled back, as ROLLBACK TO SAVEPOINT does it.
        rolled_back(|| run("SELECT dedup.mark('sp-1'); SELECT * FROM dedup.mark_many(ARRAY['sp-2', 'sp-3'])"));
        assert!(!one::<bool>("SELECT dedup.seen('sp-1')"));
        assert_eq!(column("SELECT * FROM dedup.mark_many(ARRAY['sp-1', 'sp-2', 'sp-3'])").len(), 3);
    }
}
