//! Inbox storage. An inbox is an independent namespace of marks: a real table `dedup.inbox_<name>` of the row
//! type `dedup.inbox_row` (id text COLLATE "C" PRIMARY KEY, expires_at timestamptz), listed with its default TTL
//! in `dedup.inbox_registry`. The UNIQUE index on `id` is the single source of truth for "already seen".
//!
//! Each backend keeps a small cache from inbox name to table, default TTL and prepared statements, so a call
//! neither parses nor plans SQL. Relcache invalidations (DROP TABLE, ALTER TABLE, ...) mark entries stale; they
//! are reloaded at the next call, never freed from inside the invalidation callback (a plan may be running).

use crate::errors::{internal, raise};
use crate::filter;
use crate::shmem;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiTupleTable};
use pgrx::PgOid;
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

pub const SCHEMA: &str = "dedup";
pub const DEFAULT_INBOX: &str = "default";

/// Every SQL statement pg_dedup runs against an inbox table. Names and operators are schema-qualified so that
/// nothing on the caller's `search_path` can take their place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stmt {
    /// $1 id, $2 expires_at → a row if the id was inserted.
    Insert,
    /// $1 ids (sorted, distinct), $2 expires_at → the ids inserted.
    InsertMany,
    /// $1 ids → (id, expires_at) of every row visible now, live or expired.
    Probe,
    /// The same for one id ($1 text). A plan of its own because the plan cache never settles on a generic plan for
    /// `= ANY ($1)`, and re-planning every duplicate's lookup cost more than the lookup.
    ProbeOne,
    /// $1 ids, $2 new expires_at, $3 now → the ids whose expired row this call renewed.
    Renew,
    /// $1 id, $2 now → a row if a live mark is visible.
    Seen,
    /// $1 id, $2 now → one boolean per deleted row: was it live?
    Forget,
    /// $1 now, $2 batch size → deletes up to that many expired rows, skipping rows other transactions hold.
    PurgeBatch,
    /// The same without row locks (what a hand-written purge does): it would wait for a row another transaction
    /// holds, so it runs under a short lock_timeout and falls back to `PurgeBatch`.
    PurgeBatchUnlocked,
}

const STATEMENT_COUNT: usize = 9;

impl Stmt {
    fn index(self) -> usize {
        self as usize
    }

    fn sql(self, table: &str) -> String {
        match self {
            Stmt::Insert => format!(
                "INSERT INTO {table} (id, expires_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING RETURNING true"
            ),
            Stmt::InsertMany => format!(
                "INSERT INTO {table} (id, expires_at) SELECT u.id, $2 FROM pg_catalog.unnest($1) WITH ORDINALITY \
                 AS u(id, n) ORDER BY u.n ON CONFLICT (id) DO NOTHING RETURNING id"
            ),
            Stmt::Probe => format!(
                "SELECT id, expires_at FROM {table} WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
            ),
            Stmt::ProbeOne => format!("SELECT id, expires_at FROM {table} WHERE id OPERATOR(pg_catalog.=) $1"),
            Stmt::Renew => format!(
                "UPDATE {table} SET expires_at = $2 WHERE id OPERATOR(pg_catalog.=) ANY ($1) \
                 AND expires_at OPERATOR(pg_catalog.<=) $3 RETURNING id"
            ),
            Stmt::Seen => format!(
                "SELECT true FROM {table} WHERE id OPERATOR(pg_catalog.=) $1 AND expires_at OPERATOR(pg_catalog.>) $2"
            ),
            Stmt::Forget => format!(
                "DELETE FROM {table} WHERE id OPERATOR(pg_catalog.=) $1 RETURNING expires_at OPERATOR(pg_catalog.>) $2"
            ),
            Stmt::PurgeBatch => format!(
                "DELETE FROM {table} WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT ctid FROM {table} \
                 WHERE expires_at OPERATOR(pg_catalog.<=) $1 LIMIT $2 FOR UPDATE SKIP LOCKED))"
            ),
            Stmt::PurgeBatchUnlocked => format!(
                "DELETE FROM {table} WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT ctid FROM {table} \
                 WHERE expires_at OPERATOR(pg_catalog.<=) $1 LIMIT $2))"
            ),
        }
    }

    fn arg_types(self) -> Vec<PgOid> {
        use pgrx::pg_sys::BuiltinOid::*;
        let oids = match self {
            Stmt::Insert => vec![TEXTOID, TIMESTAMPTZOID],
            Stmt::InsertMany => vec![TEXTARRAYOID, TIMESTAMPTZOID],
            Stmt::Probe => vec![TEXTARRAYOID],
            Stmt::ProbeOne => vec![TEXTOID],
            Stmt::Renew => vec![TEXTARRAYOID, TIMESTAMPTZOID, TIMESTAMPTZOID],
            Stmt::Seen | Stmt::Forget => vec![TEXTOID, TIMESTAMPTZOID],
            Stmt::PurgeBatch | Stmt::PurgeBatchUnlocked => vec![TIMESTAMPTZOID, INT8OID],
        };
        oids.into_iter().map(PgOid::BuiltIn).collect()
    }
}

/// What a caller is about to do with an inbox; decides the privileges checked and the lock taken.
#[derive(Clone, Copy)]
pub enum Access {
    Read,
    Mark,
    Delete,
}

impl Access {
    fn acl_mask(self) -> pg_sys::AclMode {
        (match self {
            Access::Read => pg_sys::ACL_SELECT,
            Access::Mark => pg_sys::ACL_SELECT | pg_sys::ACL_INSERT | pg_sys::ACL_UPDATE,
            Access::Delete => pg_sys::ACL_SELECT | pg_sys::ACL_DELETE | pg_sys::ACL_UPDATE,
        }) as pg_sys::AclMode
    }

    fn lock_mode(self) -> pg_sys::LOCKMODE {
        (match self {
            Access::Read => pg_sys::AccessShareLock,
            Access::Mark | Access::Delete => pg_sys::RowExclusiveLock,
        }) as pg_sys::LOCKMODE
    }

    fn grant_hint(self, table: &str) -> String {
        let privileges = match self {
            Access::Read => "SELECT",
            Access::Mark => "SELECT, INSERT, UPDATE",
            Access::Delete => "SELECT, UPDATE, DELETE",
        };
        format!("An administrator can run: GRANT {privileges} ON {table} TO <role>; (see README, \"Privileges\").")
    }
}

pub struct Inbox {
    pub name: String,
    pub relid: pg_sys::Oid,
    /// Schema-qualified, quoted table name, ready to splice into SQL.
    pub table: String,
    pub default_ttl: Interval,
    /// The inbox's key namespace in the shared filter (database and table).
    pub ns: u64,
    /// Its state and counters in shared memory (None without preloading, or when that table is full), looked up
    /// once per backend rather than on every count.
    entry: Option<&'static shmem::Entry>,
    stale: Cell<bool>,
    plans: [OnceCell<OwnedPreparedStatement>; STATEMENT_COUNT],
}

impl Inbox {
    /// Adds `n` to one of the inbox's counters in `dedup.stats` (nothing without preloading).
    pub fn count(&self, counter: shmem::Counter, n: u64) {
        if let (Some(entry), true) = (self.entry, n > 0) {
            entry.counters[counter as usize].fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Records the expired marks left after a purge cycle (-1: unknown).
    pub fn set_backlog(&self, backlog: i64) {
        if let Some(entry) = self.entry {
            entry.backlog.store(backlog, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Runs one of the inbox's statements through its cached plan (prepared on first use).
    pub fn run<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stmt: Stmt,
        args: &[pgrx::datum::DatumWithOid<'_>],
    ) -> SpiTupleTable<'conn> {
        let plan = self.plans[stmt.index()].get_or_init(|| {
            client
                .prepare_mut(stmt.sql(&self.table).as_str(), &stmt.arg_types())
                .unwrap_or_else(|e| internal("preparing a statement", e))
                .keep()
        });
        // `select` on a plan prepared with `prepare_mut` runs it read-write (a fresh snapshot per statement under
        // READ COMMITTED) without forcing a transaction id onto duplicates, which must write no WAL.
        client.select(plan, None, args).unwrap_or_else(|e| internal("running a statement", e))
    }
}

thread_local! {
    static CACHE: RefCell<HashMap<String, Rc<Inbox>>> = RefCell::new(HashMap::new());
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    CACHE.with(|cache| {
        if let Ok(cache) = cache.try_borrow() {
            for inbox in cache.values() {
                if relid == pg_sys::InvalidOid || relid == inbox.relid {
                    inbox.stale.set(true);
                }
            }
        }
    });
}

fn table_name(name: &str) -> String {
    format!("inbox_{name}")
}

fn qualified(name: &str) -> String {
    pgrx::spi::quote_qualified_identifier(SCHEMA, &table_name(name))
}

fn schema_oid() -> pg_sys::Oid {
    let schema = std::ffi::CString::new(SCHEMA).expect("no NUL in schema name");
    unsafe { pg_sys::get_namespace_oid(schema.as_ptr(), false) }
}

/// The table of inbox `name`, looked up without locking it (None if it has none).
pub fn relid(name: &str) -> Option<pg_sys::Oid> {
    Some(relation_oid(name)).filter(|oid| *oid != pg_sys::InvalidOid)
}

fn relation_oid(name: &str) -> pg_sys::Oid {
    dedup_relation_oid(&table_name(name))
}

/// A relation of schema dedup by name (InvalidOid if there is none).
fn dedup_relation_oid(relname: &str) -> pg_sys::Oid {
    let rel = std::ffi::CString::new(relname).expect("validated names have no NUL");
    unsafe { pg_sys::get_relname_relid(rel.as_ptr(), schema_oid()) }
}

/// Finding an inbox (once per inbox and session) or listing them reads the registry: a caller who may not read it
/// gets a dedup error saying which grant is missing, instead of a raw permission error from inside SPI. (Column privileges on
/// the registry do not count: grant SELECT on the table.)
fn check_registry_readable() {
    let relid = dedup_relation_oid("inbox_registry");
    let readable = unsafe { pg_sys::pg_class_aclcheck(relid, pg_sys::GetUserId(), pg_sys::ACL_SELECT as pg_sys::AclMode) };
    if readable != pg_sys::AclResult::ACLCHECK_OK {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "permission denied for dedup.inbox_registry, where every call looks up its inbox",
            "An administrator can run: GRANT SELECT ON dedup.inbox_registry TO <role>; (see docs/privileges.md).",
        )
    }
}

fn unknown_inbox(name: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
        format!("inbox \"{name}\" does not exist"),
        format!("Create it first: SELECT dedup.create_inbox('{name}', '3 days'); existing ones are in dedup.inboxes."),
    )
}

fn load(name: &str) -> Inbox {
    check_registry_readable();
    let default_ttl = Spi::connect(|client| {
        client
            .select(
                "SELECT default_ttl FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1",
                None,
                &[name.into()],
            )
            .and_then(|rows| if rows.is_empty() { Ok(None) } else { rows.first().get_one::<Interval>() })
            .unwrap_or_else(|e| internal("reading dedup.inbox_registry", e))
    });
    let Some(default_ttl) = default_ttl else { unknown_inbox(name) };
    let relid = relation_oid(name);
    if relid == pg_sys::InvalidOid {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!("inbox \"{name}\" is registered but its table {} is missing", qualified(name)),
            format!("Recreate it: SELECT dedup.drop_inbox('{name}'); SELECT dedup.create_inbox('{name}');"),
        )
    }
    let ns = shmem::namespace(relid);
    Inbox {
        name: name.to_owned(),
        relid,
        table: qualified(name),
        default_ttl,
        ns,
        entry: shmem::region().and_then(|r| r.entry(ns, true)),
        stale: Cell::new(false),
        plans: Default::default(),
    }
}

/// Finds an inbox, checks the caller's privileges on its table and locks it for `access`.
pub fn open(name: &str, access: Access) -> Rc<Inbox> {
    if !CALLBACK_REGISTERED.with(|r| r.replace(true)) {
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(on_relcache_invalidation), pg_sys::Datum::from(0)) };
    }
    loop {
        let cached = CACHE.with(|c| c.borrow().get(name).cloned()).filter(|inbox| !inbox.stale.get());
        let inbox = cached.unwrap_or_else(|| {
            let inbox = Rc::new(load(name));
            CACHE.with(|c| c.borrow_mut().insert(name.to_owned(), inbox.clone()));
            inbox
        });
        let mask = access.acl_mask();
        let granted = unsafe { pg_sys::pg_class_aclmask(inbox.relid, pg_sys::GetUserId(), mask, pg_sys::AclMaskHow::ACLMASK_ALL) };
        if granted != mask {
            raise(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!("permission denied for inbox \"{name}\""),
                access.grant_hint(&inbox.table),
            )
        }
        // Lock as the executor would, before running any plan: taking the lock processes pending invalidations,
        // so an inbox dropped concurrently shows up here as stale (and then unknown), not as a raw error deep
        // inside a cached plan.
        unsafe { pg_sys::LockRelationOid(inbox.relid, access.lock_mode()) };
        if !inbox.stale.get() {
            return inbox;
        }
    }
}

/// Runs `f` with the rights of the inbox table's owner, as a security-restricted operation, the way VACUUM and
/// autovacuum do: the background worker is a superuser, and a trigger or rule the owner put on the table must not
/// run with superuser rights.
pub fn as_owner<R>(relid: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    let owner = unsafe {
        let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::RELOID as i32, relid.into_datum().unwrap());
        if tuple.is_null() {
            internal("finding an inbox table's owner", "no such table")
        }
        let data = (*tuple).t_data;
        let owner = (*((data as *const u8).add((*data).t_hoff as usize) as *const pg_sys::FormData_pg_class)).relowner;
        pg_sys::ReleaseSysCache(tuple);
        owner
    };
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(owner, context | pg_sys::SECURITY_RESTRICTED_OPERATION as i32);
    }
    // On an ERROR, aborting the transaction restores the user, as it does for VACUUM.
    let result = f();
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    result
}

/// Creates the inbox's table and registers it. The table is an ordinary (non-extension) table so pg_dump keeps its
/// definition and rows; being typed `OF dedup.inbox_row`, it depends on the extension, so `DROP EXTENSION` refuses
/// to orphan it (and `DROP EXTENSION ... CASCADE` removes it). The btree on `expires_at` lets a purge batch find
/// expired marks without scanning the table; autovacuum runs early because purging leaves dead rows steadily.
pub fn create(name: &str, default_ttl: Interval) {
    let table = qualified(name);
    Spi::connect_mut(|client| {
        serialize_registry_changes(client);
        if is_registered(client, name) || relation_oid(name) != pg_sys::InvalidOid {
            raise(
                PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT,
                format!("inbox \"{name}\" already exists"),
                "Pick another name, or drop the old inbox first with dedup.drop_inbox().",
            )
        }
        client
            .update(
                &format!(
                    "CREATE TABLE {table} OF dedup.inbox_row \
                     (id WITH OPTIONS PRIMARY KEY, expires_at WITH OPTIONS NOT NULL) \
                     WITH (autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_insert_scale_factor = 0.05); \
                     CREATE INDEX ON {table} (expires_at)"
                ),
                None,
                &[],
            )
            .unwrap_or_else(|e| internal("creating the inbox table", e));
        client
            .update(
                &format!(
                    "CREATE TRIGGER dedup_filter BEFORE INSERT OR UPDATE ON {table} \
                     FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger(); \
                     ALTER TABLE {table} ENABLE ALWAYS TRIGGER dedup_filter"
                ),
                None,
                &[],
            )
            .unwrap_or_else(|e| internal("creating the inbox trigger", e));
        client
            .update(
                "INSERT INTO dedup.inbox_registry (name, default_ttl) VALUES ($1, $2)",
                None,
                &[name.into(), default_ttl.into()],
            )
            .unwrap_or_else(|e| internal("registering the inbox", e));
    });
    // Empty, and every future row passes the trigger: the filter can answer for it at once.
    filter::trust_new_inbox(shmem::namespace(relation_oid(name)));
}

pub fn drop(name: &str) {
    if name == DEFAULT_INBOX {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "the default inbox cannot be dropped",
            "Empty it instead with TRUNCATE dedup.inbox_default, or use your own inboxes.",
        )
    }
    Spi::connect_mut(|client| {
        serialize_registry_changes(client);
        if !is_registered(client, name) {
            unknown_inbox(name)
        }
        // A table someone dropped by hand must not make the inbox impossible to unregister.
        let relid = relation_oid(name);
        if relid != pg_sys::InvalidOid {
            let table = qualified(name);
            let owner = client
                .select(
                    "SELECT pg_catalog.pg_has_role(relowner, 'USAGE') FROM pg_catalog.pg_class \
                     WHERE oid OPERATOR(pg_catalog.=) $1",
                    None,
                    &[relid.into()],
                )
                .and_then(|rows| rows.first().get_one::<bool>())
                .unwrap_or_else(|e| internal("checking the inbox owner", e));
            if owner != Some(true) {
                raise(
                    PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                    format!("only the owner of {table} can drop inbox \"{name}\""),
                    "Run dedup.drop_inbox() as the role that created the inbox, or as a superuser.",
                )
            }
            client
                .update(&format!("DROP TABLE {table}"), None, &[])
                .unwrap_or_else(|e| internal("dropping the inbox table", e));
        }
        client
            .update("DELETE FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1", None, &[name.into()])
            .unwrap_or_else(|e| internal("unregistering the inbox", e));
    });
}

fn is_registered(client: &SpiClient<'_>, name: &str) -> bool {
    client
        .select("SELECT 1 FROM dedup.inbox_registry WHERE name OPERATOR(pg_catalog.=) $1", None, &[name.into()])
        .map(|rows| !rows.is_empty())
        .unwrap_or_else(|e| internal("reading dedup.inbox_registry", e))
}

/// Creating and dropping inboxes take turns (readers are not blocked), so two sessions creating the same inbox
/// get a clean "already exists" instead of a raw catalog error.
fn serialize_registry_changes(client: &mut SpiClient<'_>) {
    client
        .update("LOCK TABLE dedup.inbox_registry IN SHARE ROW EXCLUSIVE MODE", None, &[])
        .unwrap_or_else(|e| internal("locking dedup.inbox_registry", e));
}

/// Names of every registered inbox, for `purge()` over all of them.
pub fn all_names() -> Vec<String> {
    check_registry_readable();
    Spi::connect(|client| {
        client
            .select("SELECT name FROM dedup.inbox_registry ORDER BY name", None, &[])
            .map(|rows| rows.filter_map(|row| row.get::<String>(1).ok().flatten()).collect())
            .unwrap_or_else(|e| internal("reading dedup.inbox_registry", e))
    })
}
