//! `dedup.attachment_registry`, read and pruned straight through the heap, with no privilege on it and no role
//! switch: the row trigger reads its table's attachment there (a security-restricted operation refuses a role
//! switch, and logical replication applies changes in one from PostgreSQL 16 on, as the table's owner), and the
//! attachments of tables that are gone are removed there by whoever dropped them, in whatever context (the DROP
//! event trigger must not make anyone's DDL fail).
//!
//! An attachment lives exactly as long as its trigger: a row whose table is gone, or whose table no longer has the
//! `zz_dedup_attached` trigger (DROP TABLE, DROP TRIGGER, DROP ... CASCADE of a function its key calls, a table that
//! went without an event trigger seeing it, an oid reused by an unrelated table), is stale and is pruned.

use super::TRIGGER;
use crate::catalog;
use crate::errors::internal;
use pgrx::prelude::*;

/// An attachment as the registry holds it.
pub struct Attachment {
    pub tbl: pg_sys::Oid,
    pub key: String,
    pub inbox: String,
    pub ttl: Option<Interval>,
    pub on_duplicate: String,
    /// Keys wait in memory for a flush (`batch`). False in a registry of before 0.4.0, which lacks the column.
    pub batched: bool,
}

/// Every row of the registry that a statement starting now would see, each with its position, read with the
/// registry locked in `lock` mode (until the transaction ends) and closed again before returning.
fn scan(lock: u32) -> Vec<(pg_sys::ItemPointerData, Attachment)> {
    let relid = catalog::dedup_relation(c"attachment_registry");
    if relid == pg_sys::InvalidOid {
        internal("reading dedup.attachment_registry", "it is missing");
    }
    // SAFETY: opens the registry (locked until the transaction ends), scans it with a registered snapshot, and
    // copies every value it keeps out of the slot before the next row; everything is closed before returning.
    unsafe {
        let rel = pg_sys::table_open(relid, lock as pg_sys::LOCKMODE);
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let scan = pg_sys::table_beginscan(rel, snapshot, 0, std::ptr::null_mut());
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let mut rows = Vec::new();
        while pg_sys::table_scan_getnextslot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            let column = |attnum| {
                let mut null = false;
                let datum = pg_sys::slot_getattr(slot, attnum, &mut null);
                (!null).then_some(datum)
            };
            let text = |attnum| column(attnum).and_then(|d| String::from_datum(d, false)).unwrap_or_default();
            let columns = (*(*slot).tts_tupleDescriptor).natts;
            let Some(tbl) = column(1).and_then(|d| pg_sys::Oid::from_datum(d, false)) else { continue };
            let row = Attachment {
                tbl,
                key: text(2),
                inbox: text(3),
                ttl: column(4).and_then(|d| Interval::from_datum(d, false)),
                on_duplicate: text(5),
                batched: columns >= 6 && column(6).and_then(|d| bool::from_datum(d, false)).unwrap_or(false),
            };
            rows.push(((*slot).tts_tid, row));
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::table_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        rows
    }
}

/// Every attachment.
pub fn all() -> Vec<Attachment> {
    scan(pg_sys::AccessShareLock).into_iter().map(|(_, row)| row).collect()
}

/// The attachment of the first of `tables` that has one.
pub fn first_of(tables: &[pg_sys::Oid]) -> Option<Attachment> {
    scan(pg_sys::AccessShareLock)
        .into_iter()
        .filter_map(|(_, row)| Some((tables.iter().position(|t| *t == row.tbl)?, row)))
        .min_by_key(|(rank, _)| *rank)
        .map(|(_, row)| row)
}

/// The trigger named `name` on table `relid` itself (not a partition's clone of its parent's), if the table exists
/// and has one: whether it runs `dedup.attached_insert()`.
fn named_trigger(relid: pg_sys::Oid, name: &str) -> Option<bool> {
    // SAFETY: the relcache entry is opened without a lock (a table being dropped by another transaction still
    // counts as there) and closed here; its trigger descriptor is only read.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return None;
        }
        let triggers = (*rel).trigdesc;
        let found = (!triggers.is_null())
            .then(|| std::slice::from_raw_parts((*triggers).triggers, (*triggers).numtriggers as usize))
            .into_iter()
            .flatten()
            .find(|t| std::ffi::CStr::from_ptr(t.tgname).to_bytes() == name.as_bytes() && !t.tgisclone)
            .map(|t| {
                let function = pg_sys::get_func_name(t.tgfoid);
                !function.is_null() && std::ffi::CStr::from_ptr(function).to_bytes() == b"attached_insert"
            });
        pg_sys::RelationClose(rel);
        found
    }
}

/// Does table `relid` exist and carry the attachment trigger itself?
fn has_trigger(relid: pg_sys::Oid) -> bool {
    named_trigger(relid, TRIGGER) == Some(true)
}

/// Has table `relid` a trigger of someone else's named `name` (attach() must not replace it)?
pub fn foreign_trigger(relid: pg_sys::Oid, name: &str) -> bool {
    named_trigger(relid, name) == Some(false)
}

/// Removes the stale attachments (see the module comment) and returns their tables. A row another transaction
/// holds (removes, replaces, or prunes, and has not committed yet) is left to it, without waiting: a DROP must never
/// wait for someone else's open transaction because of pg_dedup.
pub fn prune() -> Vec<pg_sys::Oid> {
    let stale: Vec<_> = scan(pg_sys::RowExclusiveLock).into_iter().filter(|(_, row)| !has_trigger(row.tbl)).collect();
    if stale.is_empty() {
        return Vec::new();
    }
    let relid = catalog::dedup_relation(c"attachment_registry");
    // SAFETY: the registry is open and locked (RowExclusiveLock, taken by the scan above) for the rest of the
    // transaction; each delete goes through the table access method, told not to wait, which reports what it did.
    unsafe {
        let rel = pg_sys::table_open(relid, pg_sys::NoLock as pg_sys::LOCKMODE);
        let delete = (*(*rel).rd_tableam).tuple_delete.expect("every table access method deletes");
        let mut pruned = Vec::new();
        for (mut tid, row) in stale {
            let mut failure = pg_sys::TM_FailureData::default();
            let cid = pg_sys::GetCurrentCommandId(true);
            let snapshot = pg_sys::GetLatestSnapshot();
            let result = pg_sys::ffi::pg_guard_ffi_boundary(|| {
                delete(rel, &mut tid, cid, snapshot, std::ptr::null_mut(), false, &mut failure, false)
            });
            if result == pg_sys::TM_Result::TM_Ok {
                pruned.push(row.tbl);
            }
        }
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::CommandCounterIncrement();
        pruned
    }
}
