//! The one door to an inbox's rows: the row of each id as a statement of this transaction would see it now, read
//! through the primary key directly where the table allows it (`direct::find_each`: no statement to parse, plan
//! and run), else through SQL. `mark`, `seen()` and `idempotency` read rows here, never either way themselves.

use crate::direct::{self, Found};
use crate::inbox::{Inbox, Stmt};
use crate::jsonb::Jsonb;
use pgrx::prelude::*;
use std::collections::HashMap;

/// The row of each of `ids`, in order (None: it has none).
pub fn find(inbox: &Inbox, ids: &[&str]) -> Vec<Option<Found>> {
    if direct::readable(inbox) {
        return direct::find_each(inbox, ids);
    }
    Spi::connect(|client| {
        let rows = match ids {
            [id] => inbox.run(client, Stmt::Find, &[(*id).into()]),
            _ => inbox.run(client, Stmt::FindMany, &[ids.to_vec().into()]),
        };
        let mut found: HashMap<String, Found> = rows
            .map(|row| {
                let id: String = row.get(1).ok().flatten().expect("id is NOT NULL");
                // SAFETY: inside the SPI connection, a jsonb column.
                let result = row.get::<Jsonb>(4).ok().flatten().map(|r| unsafe { Jsonb::from_spi(r.datum()) });
                let found = Found {
                    tid: None,
                    expires_at: row.get(2).ok().flatten().expect("expires_at is NOT NULL"),
                    fingerprint: row.get(3).ok().flatten(),
                    result,
                    lease_until: row.get(5).ok().flatten(),
                    completed: row.get(6).ok().flatten(),
                    mine: row.get::<bool>(7).ok().flatten().unwrap_or(false),
                };
                (id, found)
            })
            .collect();
        ids.iter().map(|id| found.remove(*id)).collect()
    })
}

/// The row of `id` (None: it has none).
pub fn find_one(inbox: &Inbox, id: &str) -> Option<Found> {
    if direct::readable(inbox) {
        return direct::find_one(inbox, id);
    }
    find(inbox, &[id]).pop().flatten()
}

/// `find_one`, read first where this transaction wrote the row if it did (`direct::own_row`): `complete()` after
/// `claim()`, a key repeated in a COPY into an attached table.
pub fn find_own_or_one(inbox: &Inbox, id: &str) -> Option<Found> {
    direct::own_row(inbox, id).or_else(|| find_one(inbox, id))
}
