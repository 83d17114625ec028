//! Idempotency keys (docs/idempotency-keys.md): `claim()`, `complete()`, `release()` and `fingerprint()`.
//!
//! A claim is a row of the inbox like a mark, written in the caller's transaction, with three more things: the
//! request's fingerprint, the result `complete()` stores, and for work outside the database a lease (the key stays
//! in progress until `lease_until`, across the caller's commits). `completed` tells a claim still in progress
//! (false) from a completed one (true) and from a plain mark (NULL). What another claim of the key sees:
//! - no live row: the key is free (`new`); a row being inserted by another transaction is waited for (`wait`), or
//!   answered `in_progress` at once (`wait => false`);
//! - a committed row of a claim still in progress with a live lease: `in_progress`; with a lease that has passed:
//!   taken over, `new`;
//! - any other committed row (a mark, a completed claim, a claim whose transaction committed without a lease):
//!   `completed`, with the stored result.
//!
//! A live key reused with another fingerprint is refused with SQLSTATE PD001 (an expired one is simply taken over).

use crate::clock::{expiry, later, statement_now};
use crate::direct::{self, Found, Row};
use crate::errors::{internal, raise, raise_with_sqlstate, sqlstate};
use crate::inbox::{self, Access, Inbox, Stmt};
use crate::jsonb::Jsonb;
use crate::shmem::Counter;
use crate::{gate, input, mark, rows, xact};
use pgrx::callconv::{BoxRet, FcInfo};
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;

/// Largest result `complete()` stores: jsonb, its size decompressed.
pub const MAX_RESULT_BYTES: usize = 8 * 1024 * 1024;

/// How a claim was answered.
enum Answer {
    New,
    Completed(Option<Jsonb>),
    InProgress,
}

/// Runs `stmt`; true if it returned a row.
fn wrote(inbox: &Inbox, stmt: Stmt, args: &[pgrx::datum::DatumWithOid<'_>]) -> bool {
    Spi::connect(|client| !inbox.run(client, stmt, args).is_empty())
}

/// Runs `stmt` without waiting for a row or key another transaction holds: None if it would have had to wait.
fn wrote_at_once(inbox: &Inbox, stmt: Stmt, args: &[pgrx::datum::DatumWithOid<'_>]) -> Option<bool> {
    xact::unless_it_waits(|| inbox.with_lock_timeout(c"1ms", || wrote(inbox, stmt, args)))
}

/// The first characters of a fingerprint, for an error's DETAIL.
fn prefix(fingerprint: &str) -> String {
    fingerprint.chars().take(12).collect()
}

/// A key claimed before with another fingerprint must never be answered with that request's result.
fn check_fingerprint(inbox: &Inbox, id: &str, found: &Found, given: Option<&str>) {
    if let (Some(stored), Some(given)) = (&found.fingerprint, given) {
        if stored != given {
            inbox.count(Counter::FingerprintMismatches, 1);
            raise_with_sqlstate(
                sqlstate::FINGERPRINT_MISMATCH,
                format!("key \"{id}\" of inbox \"{}\" was claimed for another request", inbox.name),
                format!("Stored fingerprint {}..., this request's {}...", prefix(stored), prefix(given)),
                "An idempotency key must not be reused for a different request: send a new key (or, if the old \
                 request is abandoned, dedup.forget() its key first).",
            )
        }
    }
}

/// Claims key `id` for `row` (its window, fingerprint and lease): the algorithm in the module comment.
fn claim_key(inbox: &Inbox, id: &str, row: &Row, now: TimestampWithTimeZone, wait: bool) -> Answer {
    let args = |now: Option<TimestampWithTimeZone>| {
        let mut args = vec![id.into(), row.expires_at.into(), row.fingerprint.into(), row.lease_until.into()];
        args.extend(now.map(Into::into));
        args
    };
    // A key the filter vouches for goes straight in (a speculative insertion, which never waits either).
    let says_new = gate::certainly_new(inbox, id);
    if says_new == Some(true) && direct::insert(inbox, &[id], row) == 1 {
        return Answer::New;
    }
    // The filter said "maybe" and the key turns out to have no row: a false positive.
    let false_positive = || {
        if says_new == Some(false) {
            inbox.count(Counter::FalsePositives, 1);
        }
    };
    // Set once an insert that may not wait met a key another transaction is inserting.
    let mut held = false;
    for _ in 0..mark::MAX_ROUNDS {
        let Some(found) = rows::find_one(inbox, id) else {
            if held {
                return Answer::InProgress;
            }
            let inserted = if wait {
                wrote(inbox, Stmt::ClaimInsert, &args(None))
            } else if inbox.shape().plain {
                direct::insert(inbox, &[id], row) == 1
            } else {
                wrote_at_once(inbox, Stmt::ClaimInsert, &args(None)).unwrap_or(false)
            };
            if inserted {
                false_positive();
                return Answer::New;
            }
            held = !wait;
            continue;
        };
        let live = later(found.expires_at, now);
        if live {
            check_fingerprint(inbox, id, &found, row.fingerprint);
            match (found.completed, found.lease_until) {
                (Some(false), Some(until)) if later(until, now) => return Answer::InProgress,
                (Some(false), Some(_)) => {} // the lease passed
                (Some(false), None) if found.mine => return Answer::InProgress,
                _ => return Answer::Completed(found.result),
            }
        }
        // An expired row, or a claim whose lease passed without complete(): this claim takes the key over.
        let taken = if wait {
            Some(wrote(inbox, Stmt::ClaimTakeOver, &args(Some(now))))
        } else {
            wrote_at_once(inbox, Stmt::ClaimTakeOver, &args(Some(now)))
        };
        match taken {
            Some(true) => {
                inbox.count(if live { Counter::LeaseTakeovers } else { Counter::Renewals }, 1);
                return Answer::New;
            }
            None => return Answer::InProgress,
            Some(false) => {} // someone else changed the row meanwhile: look again
        }
    }
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!("could not claim key \"{id}\" in inbox \"{}\" after {} rounds", inbox.name, mark::MAX_ROUNDS),
        "Another session kept deleting and re-creating the same key; retry the transaction.",
    )
}

/// Claims idempotency key `id`: one row, `state` 'new' (the caller now holds the key), 'completed' (with the
/// stored result) or 'in_progress' (someone else holds it; only with `wait => false` or a live lease).
#[pg_extern(sql = "
    CREATE FUNCTION dedup.claim(id text, fingerprint text DEFAULT NULL, ttl interval DEFAULT NULL,
                                inbox text DEFAULT 'default', wait boolean DEFAULT true, lease interval DEFAULT NULL)
    RETURNS dedup.claim_result VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'claim_wrapper';
")]
fn claim(
    id: Option<&str>,
    fingerprint: Option<&str>,
    ttl: Option<Interval>,
    inbox: Option<&str>,
    wait: Option<bool>,
    lease: Option<Interval>,
) -> Claimed {
    input::require_writable("claim");
    let id = input::id(id);
    let fingerprint = input::fingerprint(fingerprint);
    let ttl = ttl.map(input::ttl);
    let wait = input::flag("wait", wait);
    let lease = lease.map(input::lease);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    let now = statement_now();
    let expires_at = expiry(now, ttl.unwrap_or_else(|| inbox.default_ttl()));
    let lease_until = lease.map(|lease| expiry(now, lease));
    if lease_until.is_some_and(|until| later(until, expires_at)) {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            "lease must not outlast the key's window (ttl)",
            "Pass a lease shorter than the ttl (the inbox's default ttl when NULL).",
        )
    }
    let row = Row { expires_at, fingerprint, result: None, lease_until, completed: Some(false) };
    let (state, result, counter) = match claim_key(&inbox, id, &row, now, wait) {
        Answer::New => ("new", None, Counter::ClaimsNew),
        Answer::Completed(result) => ("completed", result, Counter::ClaimsCompleted),
        Answer::InProgress => ("in_progress", None, Counter::ClaimsInProgress),
    };
    inbox.count(counter, 1);
    Claimed { state, result }
}

/// `claim()`'s answer, one row of `dedup.claim_result` (bootstrap.sql). Not a set: a set-returning function with
/// OUT parameters had its result descriptor built from pg_proc's argument arrays twice per call (by the function and
/// by the executor starting the scan) and was entered twice (value per call); for a named composite type it is a
/// copy of the type cache's.
struct Claimed {
    state: &'static str,
    result: Option<Jsonb>,
}

// SAFETY: returns a composite datum of the function's declared result type, formed in the caller's memory context.
unsafe impl BoxRet for Claimed {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        // SAFETY: `fcinfo` is this call's; the descriptor is the declared type's (two columns: text, jsonb), and the
        // tuple is formed from datums that live in the current memory context or longer.
        unsafe {
            let mut desc: pg_sys::TupleDesc = std::ptr::null_mut();
            let class = pg_sys::get_call_result_type(fcinfo.as_mut_ptr(), std::ptr::null_mut(), &mut desc);
            if class != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE || (*desc).natts != 2 {
                internal("claim()'s result type", "dedup.claim() must return dedup.claim_result (state, result)")
            }
            let values = [self.state.into_datum(), self.result.and_then(Jsonb::into_datum)];
            let mut nulls = values.map(|v| v.is_none());
            let mut datums = values.map(|v| v.unwrap_or(pg_sys::Datum::from(0)));
            let tuple = pg_sys::heap_form_tuple(desc, datums.as_mut_ptr(), nulls.as_mut_ptr());
            fcinfo.return_raw_datum(pg_sys::HeapTupleHeaderGetDatum((*tuple).t_data))
        }
    }
}

// SAFETY: maps to the composite type claim() is declared to return (its SQL is written out in `claim`'s pg_extern).
unsafe impl SqlTranslatable for Claimed {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(Claimed);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> = Err(ArgumentError::NotValidAsArgument("Claimed"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::One(SqlMappingRef::literal("dedup.claim_result")));
}

/// Stores `result` for key `id`, claimed and still in progress: in the transaction that claimed it, or (a lease)
/// while its lease lasts. The key is then completed: later claims get 'completed' with this result.
#[pg_extern(volatile, parallel_unsafe)]
fn complete(id: Option<&str>, result: default!(Option<Jsonb>, "NULL"), inbox: default!(Option<&str>, "'default'")) {
    input::require_writable("complete");
    let id = input::id(id);
    if let Some(size) = result.map(|r| r.size()).filter(|size| *size > MAX_RESULT_BYTES) {
        raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("result is {size} bytes; the limit is {MAX_RESULT_BYTES} bytes"),
            "Store a smaller result (a reference to where the full response is kept, say).",
        )
    }
    let inbox = inbox::open(input::inbox_name(inbox), Access::Mark);
    let now = statement_now();
    let name = &inbox.name;
    let not_in_progress = |why: String, hint: &str| -> ! {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("key \"{id}\" of inbox \"{name}\" {why}"),
            hint,
        )
    };
    let Some(found) = rows::find_own_or_one(&inbox, id) else {
        not_in_progress(
            "is not claimed".into(),
            "Claim it with dedup.claim() first, in this transaction or with a lease.",
        )
    };
    let holds =
        found.completed == Some(false) && (found.mine || found.lease_until.is_some_and(|until| later(until, now)));
    if !later(found.expires_at, now) {
        not_in_progress("expired".into(), "Its window (ttl) ended before complete(); claim it again.")
    } else if found.completed.is_none() {
        not_in_progress("was marked, not claimed".into(), "Use dedup.claim() for keys whose result you store.")
    } else if !holds && found.lease_until.is_some() && found.completed == Some(false) {
        not_in_progress(
            "has a lease that passed: another claim may take it over".into(),
            "Claim it again (with a new lease) before completing, or lease for longer.",
        )
    } else if !holds {
        not_in_progress("is already completed".into(), "A completed key keeps its first result; claim() returns it.")
    } else if found.tid.is_some() && found.mine {
        direct::complete_own(&inbox, id, &found, result);
    } else if !wrote(&inbox, Stmt::Complete, &[id.into(), result.into(), now.into()]) {
        not_in_progress(
            "is no longer in progress: it was completed, released or forgotten meanwhile".into(),
            "Claim it again to see its state.",
        )
    }
}

/// Gives up the claim in progress of key `id` (its work failed and may be retried): true if it was removed. A
/// completed key is never removed (`forget()` does that).
#[pg_extern(volatile, parallel_unsafe)]
fn release(id: Option<&str>, inbox: default!(Option<&str>, "'default'")) -> bool {
    input::require_writable("release");
    let id = input::id(id);
    let inbox = inbox::open(input::inbox_name(inbox), Access::Delete);
    match rows::find_one(&inbox, id) {
        Some(found) if found.completed == Some(false) && (found.mine || found.lease_until.is_some()) => {
            wrote(&inbox, Stmt::Release, &[id.into()])
        }
        _ => false,
    }
}

/// Internal (`claim()`'s statement form): was a row with this `xmin` written by the current transaction or one of
/// its subtransactions? Evaluated where the row is, which for a Citus-distributed inbox is the node holding its
/// shard, inside that node's part of the transaction.
#[pg_extern(volatile, parallel_unsafe)]
fn xmin_is_mine(xmin: Option<pg_sys::TransactionId>) -> bool {
    // SAFETY: compares a transaction id with the backend's own.
    xmin.is_some_and(|xmin| unsafe { pg_sys::TransactionIdIsCurrentTransactionId(xmin) })
}

/// Lower-case hex SHA-256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn payload_required<T>(payload: Option<T>) -> T {
    payload.unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "payload must not be NULL",
            "Pass the request's payload (jsonb, text or bytea); pass NULL as claim()'s fingerprint not to check.",
        )
    })
}

/// The fingerprint of a jsonb payload: SHA-256 of its canonical text, jsonb's own output (keys sorted, one space
/// after ':' and ','), so key order and whitespace do not matter.
#[pg_extern(immutable, parallel_safe, name = "fingerprint")]
fn fingerprint_jsonb(payload: Option<Jsonb>) -> String {
    let payload = payload_required(payload);
    // SAFETY: jsonb_out of a jsonb datum returns a palloc'd C string.
    let text = unsafe {
        let cstring = pgrx::direct_function_call::<&std::ffi::CStr>(pg_sys::jsonb_out, &[Some(payload.datum())])
            .expect("jsonb_out returns text");
        cstring.to_bytes().to_vec()
    };
    sha256_hex(&text)
}

/// The fingerprint of a text payload: SHA-256 of its bytes (UTF-8).
#[pg_extern(immutable, parallel_safe, name = "fingerprint")]
fn fingerprint_text(payload: Option<&str>) -> String {
    sha256_hex(payload_required(payload).as_bytes())
}

/// The fingerprint of a bytea payload: SHA-256 of its bytes.
#[pg_extern(immutable, parallel_safe, name = "fingerprint")]
fn fingerprint_bytea(payload: Option<&[u8]>) -> String {
    sha256_hex(payload_required(payload))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::*;
    use pgrx::prelude::*;

    fn claimed(sql: &str) -> String {
        one::<String>(&format!("SELECT state || ' ' || coalesce(result::text, '-') FROM {sql}"))
    }

    #[pg_test]
    fn idem_a_claim_is_new_then_in_progress_then_completed_in_its_transaction() {
        assert_eq!(claimed("dedup.claim('c1', 'fp')"), "new -");
        assert_eq!(claimed("dedup.claim('c1', 'fp')"), "in_progress -", "held by this very transaction");
        run("SELECT dedup.complete('c1', '{\"b\": 2, \"a\": 1}')");
        assert_eq!(claimed("dedup.claim('c1', 'fp')"), "completed {\"a\": 1, \"b\": 2}");
        assert_eq!(
            one::<String>("SELECT format('%s %s', fingerprint, completed) FROM dedup.inbox_default WHERE id = 'c1'"),
            "fp t"
        );
    }

    #[pg_test]
    fn idem_claims_and_marks_are_the_same_keys() {
        run("SELECT dedup.mark('m1')");
        assert_eq!(claimed("dedup.claim('m1')"), "completed -", "a mark is a completed key without a result");
        assert_eq!(claimed("dedup.claim('c2')"), "new -");
        assert!(!one::<bool>("SELECT dedup.mark('c2')"), "a claimed key is a duplicate");
        assert!(one::<bool>("SELECT dedup.seen('c2')"));
        assert!(one::<bool>("SELECT dedup.forget('c2')"));
        assert_eq!(claimed("dedup.claim('c2')"), "new -");
    }

    #[pg_test]
    fn idem_an_expired_key_or_a_passed_lease_is_taken_over() {
        run("SELECT dedup.create_inbox('idem_over')");
        assert_eq!(claimed("dedup.claim('old', inbox => 'idem_over')"), "new -");
        run("UPDATE dedup.inbox_idem_over SET expires_at = now() - interval '1 second' WHERE id = 'old'");
        assert_eq!(claimed("dedup.claim('old', 'fp2', inbox => 'idem_over')"), "new -", "expired: new again");
        assert_eq!(one::<String>("SELECT fingerprint FROM dedup.inbox_idem_over WHERE id = 'old'"), "fp2");
        assert_eq!(claimed("dedup.claim('leased', inbox => 'idem_over', lease => '1 minute')"), "new -");
        run("UPDATE dedup.inbox_idem_over SET lease_until = now() - interval '1 second' WHERE id = 'leased'");
        assert_eq!(claimed("dedup.claim('leased', inbox => 'idem_over')"), "new -");
        let stats = one::<String>(
            "SELECT format('%s %s %s', claims_new, lease_takeovers, renewals) FROM dedup.stats WHERE inbox = 'idem_over'",
        );
        assert_eq!(stats, "4 1 1");
    }

    #[pg_test]
    fn idem_a_lease_is_recorded_and_cleared_by_complete() {
        assert_eq!(claimed("dedup.claim('l1', lease => '30 seconds')"), "new -");
        assert!(one::<bool>(
            "SELECT lease_until = statement_timestamp() + interval '30 seconds' FROM dedup.inbox_default WHERE id = 'l1'"
        ));
        run("SELECT dedup.complete('l1')");
        assert_eq!(
            one::<String>(
                "SELECT format('%s %s', lease_until IS NULL, completed) FROM dedup.inbox_default WHERE id = 'l1'"
            ),
            "t t"
        );
        assert_eq!(claimed("dedup.claim('l1')"), "completed -");
    }

    #[pg_test]
    fn idem_a_mismatched_fingerprint_raises_pd001() {
        assert_eq!(claimed("dedup.claim('fm', 'aaaaaaaaaaaaaaaaaaaaaaaa')"), "new -");
        assert_eq!(claimed("dedup.claim('fm')"), "in_progress -", "no fingerprint: not checked");
        // Caught by PL/pgSQL, after PostgreSQL finished the error: the SQLSTATE it carries to the client.
        run("CREATE TEMP TABLE caught (state text, message text, detail text)");
        run("DO $$ BEGIN PERFORM dedup.claim('fm', 'bbbbbbbbbbbbbbbbbbbbbbbb');
             EXCEPTION WHEN OTHERS THEN INSERT INTO caught VALUES (SQLSTATE, SQLERRM, NULL);
             END $$");
        assert_eq!(
            one::<String>("SELECT state || ' ' || message FROM caught"),
            "PD001 dedup: key \"fm\" of inbox \"default\" was claimed for another request"
        );
        assert!(one::<i64>("SELECT fingerprint_mismatches FROM dedup.stats WHERE inbox = 'default'") >= 1);
    }

    #[pg_test]
    fn idem_another_error_keeps_its_own_sqlstate_after_a_mismatch() {
        run("CREATE TEMP TABLE codes (code text)");
        run(
            "SELECT dedup.claim('fx', 'one');
             DO $$ BEGIN PERFORM dedup.claim('fx', 'two'); EXCEPTION WHEN OTHERS THEN INSERT INTO codes VALUES (SQLSTATE); END $$;
             DO $$ BEGIN PERFORM 1 / 0; EXCEPTION WHEN OTHERS THEN INSERT INTO codes VALUES (SQLSTATE); END $$;
             DO $$ BEGIN RAISE EXCEPTION 'plain' USING ERRCODE = 'data_exception'; EXCEPTION WHEN OTHERS THEN INSERT INTO codes VALUES (SQLSTATE); END $$;",
        );
        assert_eq!(column("SELECT code FROM codes"), ["PD001", "22012", "22000"]);
    }

    #[pg_test]
    fn idem_complete_and_release_refuse_what_the_caller_does_not_hold() {
        use PgSqlErrorCode::*;
        assert_dedup_error("SELECT dedup.complete('none')", ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE);
        run("SELECT dedup.mark('mk')");
        assert_dedup_error("SELECT dedup.complete('mk')", ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE);
        assert!(!one::<bool>("SELECT dedup.release('mk')"), "a mark is never released");
        run("SELECT dedup.claim('cc'); SELECT dedup.complete('cc', '1')");
        assert_dedup_error("SELECT dedup.complete('cc', '2')", ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE);
        assert!(!one::<bool>("SELECT dedup.release('cc')"), "a completed key is never released");
        run("SELECT dedup.claim('rr')");
        assert!(one::<bool>("SELECT dedup.release('rr')"));
        assert_eq!(count("dedup.inbox_default WHERE id = 'rr'"), 0);
        assert_eq!(claimed("dedup.claim('rr')"), "new -");
        assert_dedup_error(
            "SELECT dedup.complete('rr', jsonb_build_object('x', repeat('y', 9000000)))",
            ERRCODE_PROGRAM_LIMIT_EXCEEDED,
        );
    }

    #[pg_test]
    fn idem_fingerprints_are_sha256_of_a_canonical_form() {
        assert_eq!(
            one::<String>("SELECT dedup.fingerprint('abc'::text)"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            one::<String>("SELECT dedup.fingerprint('abc'::bytea)"),
            one::<String>("SELECT dedup.fingerprint('abc'::text)")
        );
        assert_eq!(
            one::<String>("SELECT dedup.fingerprint('{\"b\": [1, 2], \"a\": {\"y\": null, \"x\": true}}'::jsonb)"),
            one::<String>("SELECT dedup.fingerprint('{\"a\":{\"x\":true,\"y\":null},   \"b\":[1,2]}'::jsonb)"),
            "key order and whitespace do not matter"
        );
        assert_eq!(
            one::<String>("SELECT dedup.fingerprint('{\"a\": 1}'::jsonb)"),
            one::<String>("SELECT encode(sha256(convert_to('{\"a\": 1}', 'UTF8')), 'hex')"),
            "the canonical form is jsonb's text"
        );
        assert_ne!(
            one::<String>("SELECT dedup.fingerprint('[1, 2]'::jsonb)"),
            one::<String>("SELECT dedup.fingerprint('[2, 1]'::jsonb)")
        );
    }

    #[pg_test]
    fn idem_an_inbox_that_needs_the_executor_gets_the_same_answers_through_sql() {
        // Row security (here permissive for everyone) makes the table need the executor: no direct reads or writes.
        run("SELECT dedup.create_inbox('idem_sql');
             ALTER TABLE dedup.inbox_idem_sql ENABLE ROW LEVEL SECURITY;
             CREATE POLICY everyone ON dedup.inbox_idem_sql USING (true)");
        assert!(!crate::inbox::open("idem_sql", crate::inbox::Access::Mark).shape().plain);
        assert_eq!(claimed("dedup.claim('s1', 'fp', inbox => 'idem_sql')"), "new -");
        assert_eq!(claimed("dedup.claim('s1', 'fp', inbox => 'idem_sql')"), "in_progress -");
        run("SELECT dedup.complete('s1', '{\"r\": 1}', 'idem_sql')");
        assert_eq!(claimed("dedup.claim('s1', 'fp', inbox => 'idem_sql')"), "completed {\"r\": 1}");
        assert_dedup_error(
            "SELECT dedup.complete('s1', NULL, 'idem_sql')",
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        );
        assert_eq!(claimed("dedup.claim('s2', inbox => 'idem_sql', lease => '1 minute')"), "new -");
        assert!(one::<bool>("SELECT dedup.release('s2', 'idem_sql')"));
        assert!(!one::<bool>("SELECT dedup.mark('s1', NULL, 'idem_sql')"), "a duplicate through the statements");
        assert!(one::<bool>("SELECT dedup.seen('s1', 'idem_sql')"));
    }

    #[pg_test]
    fn idem_complete_reads_the_claim_of_its_transaction_where_claim_wrote_it() {
        run("SELECT dedup.create_inbox('idem_own')");
        let scans = || one::<i64>("SELECT pg_stat_get_xact_numscans('dedup.inbox_idem_own_pkey'::regclass)");
        assert_eq!(claimed("dedup.claim('k1', 'fp', inbox => 'idem_own')"), "new -");
        let before = scans();
        run("SELECT dedup.complete('k1', '{\"ok\": 1}', 'idem_own')");
        assert_eq!(scans(), before, "no scan of the primary key: the claim was read where it was written");
        assert_eq!(claimed("dedup.claim('k1', inbox => 'idem_own')"), "completed {\"ok\": 1}");
        assert!(error_of("SELECT dedup.complete('k1', NULL, 'idem_own')").1.contains("is already completed"));
        // What the transaction did to the claim since is seen, as by a lookup: deleted, moved, rolled back, emptied.
        assert_eq!(claimed("dedup.claim('k2', inbox => 'idem_own')"), "new -");
        run("DELETE FROM dedup.inbox_idem_own WHERE id = 'k2'");
        assert!(error_of("SELECT dedup.complete('k2', NULL, 'idem_own')").1.contains("is not claimed"));
        assert_eq!(claimed("dedup.claim('k3', inbox => 'idem_own')"), "new -");
        run("UPDATE dedup.inbox_idem_own SET id = 'k3-moved' WHERE id = 'k3'");
        assert!(error_of("SELECT dedup.complete('k3', NULL, 'idem_own')").1.contains("is not claimed"));
        run("SELECT dedup.complete('k3-moved', '1', 'idem_own')");
        rolled_back(|| assert_eq!(claimed("dedup.claim('k4', inbox => 'idem_own')"), "new -"));
        assert!(error_of("SELECT dedup.complete('k4', NULL, 'idem_own')").1.contains("is not claimed"));
        assert_eq!(claimed("dedup.claim('k5', inbox => 'idem_own')"), "new -");
        run("TRUNCATE dedup.inbox_idem_own");
        assert!(error_of("SELECT dedup.complete('k5', NULL, 'idem_own')").1.contains("is not claimed"));
        // Only the last claim is remembered: an earlier one is looked up.
        assert_eq!(claimed("dedup.claim('k6', inbox => 'idem_own')"), "new -");
        assert_eq!(claimed("dedup.claim('k7', inbox => 'idem_own')"), "new -");
        run("SELECT dedup.complete('k6', '6', 'idem_own'); SELECT dedup.complete('k7', '7', 'idem_own')");
        assert_eq!(column("SELECT result::text FROM dedup.inbox_idem_own WHERE completed ORDER BY id"), ["6", "7"]);
    }

    #[pg_test]
    fn idem_claim_returns_one_row_in_every_documented_form() {
        assert_eq!(column("SELECT state FROM dedup.claim('f1')"), ["new"]);
        assert_eq!(column("SELECT dedup.claim('f1')::text"), ["(in_progress,)"]);
        run("SELECT dedup.complete('f1', '{\"a\": 1}')");
        assert_eq!(column("SELECT state || ' ' || result::text FROM dedup.claim('f1')"), ["completed {\"a\": 1}"]);
        assert_eq!(column("SELECT format('%s', c) FROM dedup.claim('f1') c"), ["(completed,\"{\"\"a\"\": 1}\")"]);
        assert_eq!(one::<String>("SELECT pg_get_function_result('dedup.claim'::regproc)"), "dedup.claim_result");
    }

    #[pg_test]
    fn idem_a_certainly_new_key_goes_straight_in() {
        run("SELECT dedup.create_inbox('idem_direct')");
        let calls = trigger_calls();
        assert_eq!(claimed("dedup.claim('d1', 'fp', inbox => 'idem_direct', lease => '1 minute')"), "new -");
        assert_eq!(trigger_calls(), calls, "the speculative insertion wrote the claim");
        assert_eq!(
            one::<String>("SELECT format('%s %s %s', fingerprint, completed, lease_until IS NOT NULL) FROM dedup.inbox_idem_direct"),
            "fp f t"
        );
        assert!(one::<bool>("SELECT dedup.seen('d1', 'idem_direct')"));
    }
}
