//! Completing, in place, a claim this transaction wrote: `complete()` in the claim's own transaction, its usual
//! place. The row is this transaction's own and not committed, so no other transaction can see it, let alone
//! change it: none of UPDATE's handling of concurrent changes is needed (what `simple_table_tuple_update` raises an
//! error for cannot happen), and the id does not change, so neither the filter nor the filter trigger has work.

use super::handle::{self, Handle};
use super::{store_row, Found, Row, Values};
use crate::inbox::Inbox;
use crate::jsonb::Jsonb;
use crate::ports;
use pgrx::prelude::*;

/// Replaces the row of `id` that `found` read (this transaction's claim, in progress) with its completed version:
/// `result` stored, the lease cleared. Only for an inbox of `plain` shape, opened by this transaction.
pub fn complete_own(inbox: &Inbox, id: &str, found: &Found, result: Option<Jsonb>) {
    let mut tid = match found.tid {
        Some(tid) if found.mine && inbox.shape().plain => tid,
        _ => panic!("direct update of a row that is not this transaction's own claim in a plain inbox"),
    };
    let row = Row {
        expires_at: found.expires_at,
        fingerprint: found.fingerprint.as_deref(),
        result,
        lease_until: None,
        completed: Some(true),
    };
    // SAFETY: the table was opened and locked (RowExclusiveLock) by this transaction.
    unsafe {
        handle::with(inbox.relid, |table| {
            let Handle { rel, estate, result_rel, slot, .. } = *table;
            store_row(slot, id, &Values::of(&row));
            if let Some(entries) = ports::simple_table_tuple_update(rel, &mut tid, slot, pg_sys::GetActiveSnapshot()) {
                table.inserting(|| ports::ExecInsertIndexTuples(result_rel, slot, estate, None, entries));
            }
        });
        // Later statements of the transaction must see the new version, as after any SQL update.
        pg_sys::CommandCounterIncrement();
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn direct_a_completion_that_moves_the_row_indexes_its_new_version() {
        run("SELECT dedup.create_inbox('du_moved')");
        // A full first page: the completed version, a kilobyte bigger, cannot stay on it (no HOT update), so both
        // indexes need entries for it.
        run("SELECT dedup.claim('k' || g, inbox => 'du_moved') FROM generate_series(1, 200) g");
        let before = one::<String>("SELECT ctid::text FROM dedup.inbox_du_moved WHERE id = 'k1'");
        let body = "jsonb_build_object('body', (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 40) g))";
        run(&format!("SELECT dedup.complete('k1', {body}, 'du_moved')"));
        let after = one::<String>("SELECT ctid::text FROM dedup.inbox_du_moved WHERE id = 'k1'");
        assert_ne!(before.split(',').next(), after.split(',').next(), "the new version is on another page");
        run("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off");
        assert!(
            one::<bool>(&format!("SELECT completed AND result = {body} FROM dedup.inbox_du_moved WHERE id = 'k1'")),
            "the primary key finds the completed version"
        );
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM dedup.inbox_du_moved WHERE expires_at > now() AND id = 'k1' AND completed"
            ),
            1
        );
        assert!(one::<bool>(&format!(
            "SELECT state = 'completed' AND result = {body} FROM dedup.claim('k1', inbox => 'du_moved')"
        )));
    }
}
