-- pg_dedup 0.3.0 -> 0.4.0.
--
-- What changes:
-- 1. attach() (docs/ingest.md): PostgreSQL records what an attachment's key uses (functions, operators, types,
--    columns) as dependencies of its trigger, as for an index expression, so dropping one is refused (or, with
--    CASCADE, takes the trigger and so the attachment); and the trigger fires for UPDATE and DELETE too, so that a
--    row an UPDATE moves to another partition is not dropped as a duplicate of itself. Every attachment is made
--    again here with attach() (which analyses the key as the table's owner, in a security-restricted operation);
--    one whose key no longer fits its table stays as 0.3.0 made it, with a WARNING naming it. Before that,
--    attachments whose table is gone or no longer has its trigger (a temporary table attached with 0.3.0 whose
--    session ended, a table dropped while the event trigger was disabled) are removed: 0.3.0 kept them, and
--    drop_inbox() then refused their inbox for good. attach() now refuses temporary tables; one attached with 0.3.0
--    is left as it is (its session's end takes it, and the next attach(), detach() or drop_inbox() removes its
--    attachment).
-- 2. dedup.stats reads the counters by name, from dedup.inbox_figures() (src/shmem.rs holds their one list), in
--    place of dedup.inbox_counters(), whose row every new counter had to be added to. The view's columns stay as
--    they were (CREATE OR REPLACE keeps its grants).
-- 3. Delivery attempts (docs/poison-messages.md): dedup.attempt() counts them outside the caller's transaction, in
--    shared memory, and the workers make the counts durable in dedup.attempt_counts; dedup.attempts shows each role
--    those of the inboxes it may read, and dedup.stats counts attempt() calls (a new column, attempts, at the end).
--    The Bloom filter holds the keys of dedup.attempt_counts (its dedup_filter trigger), so attempt() of a new id
--    does not read the table.
-- 4. Batched attachments, the bulk road of ingest (docs/ingest.md): dedup.attach_batched() takes attach()'s
--    arguments; dedup.attachment_registry and dedup.attachments get a column, batched, at the end.
-- 5. dedup.claim() returns one row of a new composite type, dedup.claim_result (state, result), instead of a set
--    of the same two columns: a named type's result descriptor comes from the type cache, where a set of OUT
--    parameters had it built from pg_proc twice per call. Every documented form reads it as before
--    (SELECT * FROM dedup.claim(...), SELECT state, result FROM dedup.claim(...), SELECT dedup.claim(...)). The
--    function is made again (a function's result type cannot be changed in place), with the EXECUTE grants it had
--    (given anew by the extension's owner); a view or a SQL function body (BEGIN ATOMIC) of yours that uses it
--    makes the update fail, naming it: drop it, update, and create it again. `SELECT dedup.claim(...)` without
--    FROM now returns a dedup.claim_result (was record), and a session that prepared a statement calling claim()
--    before the update gets "cached plan must not change result type" once.
\echo Use "ALTER EXTENSION pg_dedup UPDATE TO '0.4.0'" to load this file. \quit

-- 4. (Before 1., whose attach() calls write the new column.) Batched attachments (docs/ingest.md, "The bulk road"):
--    dedup.attach_batched(), with attach()'s arguments; the registry keeps which attachments are batched, and
--    dedup.attachments shows it (a new column, batched, at the end).
ALTER TABLE dedup.attachment_registry ADD COLUMN batched boolean NOT NULL DEFAULT false;
CREATE FUNCTION dedup.attach_batched(tbl regclass, key text, ttl interval DEFAULT NULL,
                                     inbox text DEFAULT 'default', on_duplicate text DEFAULT 'skip') RETURNS void
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'attach_batched_wrapper';
-- As finalize.sql does for every function of a fresh install: callers get EXECUTE by grant.
REVOKE ALL ON FUNCTION dedup.attach_batched(regclass, text, interval, text, text) FROM PUBLIC;
CREATE OR REPLACE VIEW dedup.attachments AS
SELECT tbl, key, inbox, ttl, on_duplicate, batched FROM dedup.attachment_registry;

DELETE FROM dedup.attachment_registry a
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                    WHERE t.tgrelid OPERATOR(pg_catalog.=) a.tbl
                      AND t.tgname OPERATOR(pg_catalog.=) 'zz_dedup_attached'
                      AND t.tgparentid OPERATOR(pg_catalog.=) 0);
DO $reattach$
DECLARE
    a record;
BEGIN
    FOR a IN
        SELECT r.tbl, r.key, r.ttl, r.inbox, r.on_duplicate
          FROM dedup.attachment_registry r
          JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) r.tbl
         WHERE c.relpersistence OPERATOR(pg_catalog.<>) 't'
    LOOP
        BEGIN
            PERFORM dedup.attach(a.tbl, a.key, a.ttl, a.inbox, a.on_duplicate);
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'pg_dedup: % stays attached as pg_dedup 0.3.0 attached it: %', a.tbl, SQLERRM
                USING HINT = 'What its key uses is not recorded, and an UPDATE that moves its rows between '
                             'partitions drops them. Attach it again with a key that fits the table, or detach it.';
        END;
    END LOOP;
END
$reattach$;

CREATE FUNCTION dedup.inbox_figures() RETURNS TABLE (
	"inbox" TEXT,
	"backlog" bigint,
	"filter_trusted" bool,
	"filter_trigger" TEXT,
	"counters" jsonb
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'inbox_figures_wrapper';
REVOKE ALL ON FUNCTION dedup.inbox_figures() FROM PUBLIC;
-- Whoever reads dedup.stats needs EXECUTE on its functions: roles that could execute the old one may execute the new.
DO $grants$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                             ELSE a.grantee::pg_catalog.regrole::text END
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid OPERATOR(pg_catalog.=) 'dedup.inbox_counters()'::pg_catalog.regprocedure
           AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION dedup.inbox_figures() TO %s', grantee);
    END LOOP;
END
$grants$;
CREATE OR REPLACE VIEW dedup.stats AS
SELECT i.inbox, c.marks, c.duplicates, c.renewals, c.purged, i.backlog, c.lookups, c.certainly_new,
       c.false_positives, i.filter_trusted,
       w.*, f.*,
       i.filter_trigger, c.claims_new, c.claims_completed, c.claims_in_progress, c.fingerprint_mismatches,
       c.lease_takeovers, c.advances, c.stale_advances, c.rows_passed, c.rows_dropped, c.attempts
  FROM dedup.inbox_figures() AS i
  LEFT JOIN LATERAL pg_catalog.jsonb_to_record(i.counters)
         AS c(marks bigint, duplicates bigint, renewals bigint, purged bigint, lookups bigint, certainly_new bigint,
              false_positives bigint, claims_new bigint, claims_completed bigint, claims_in_progress bigint,
              fingerprint_mismatches bigint, lease_takeovers bigint, advances bigint, stale_advances bigint,
              rows_passed bigint, rows_dropped bigint, attempts bigint) ON true
 CROSS JOIN dedup.worker_stats() AS w
 CROSS JOIN dedup.filter_stats() AS f;
DROP FUNCTION dedup.inbox_counters();

-- Keyed by id first, both columns bytewise: the worker's inserts compare ids, and an inbox's name only between equal
-- ids (the inbox first, in the database's collation, cost every comparison a call for the inbox and a fetch of the
-- id past it: 8% more of the worker's CPU per count written, measured under attempt() at pgbench speed).
CREATE TABLE dedup.attempt_counts (
    inbox         text COLLATE "C" NOT NULL,
    id            text COLLATE "C" NOT NULL,
    attempts      integer NOT NULL CHECK (attempts > 0),
    first_attempt timestamptz NOT NULL,
    last_attempt  timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (id, inbox)
);
CREATE INDEX ON dedup.attempt_counts (inbox, expires_at);
SELECT pg_catalog.pg_extension_config_dump('dedup.attempt_counts', '');
-- Keyed in the Bloom filter by inbox and id, like an inbox table by id (finalize.sql, the same statements).
CREATE TRIGGER dedup_filter AFTER INSERT OR UPDATE OF inbox, id ON dedup.attempt_counts
  FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger('inbox_and_id');
ALTER TABLE dedup.attempt_counts ENABLE ALWAYS TRIGGER dedup_filter;

CREATE FUNCTION dedup.attempts_in_memory() RETURNS TABLE (
	"inbox" TEXT,
	"id" TEXT,
	"attempts" INT,
	"first_attempt" timestamp with time zone,
	"last_attempt" timestamp with time zone,
	"expires_at" timestamp with time zone
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'attempts_in_memory_wrapper';
-- It shows each caller only the inboxes it may read: anyone's, like in a fresh install (finalize.sql, which revokes
-- every function from PUBLIC first: the same privileges, in the same order).
REVOKE ALL ON FUNCTION dedup.attempts_in_memory() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION dedup.attempts_in_memory() TO PUBLIC;

CREATE VIEW dedup.attempts WITH (security_barrier) AS
WITH live AS MATERIALIZED (SELECT * FROM dedup.attempts_in_memory())
SELECT a.inbox, a.id, a.attempts, a.first_attempt, a.last_attempt
  FROM (SELECT l.* FROM live l WHERE l.attempts OPERATOR(pg_catalog.>) 0
        UNION ALL
        SELECT d.inbox, d.id, d.attempts, d.first_attempt, d.last_attempt, d.expires_at
          FROM dedup.attempt_counts d
         WHERE NOT EXISTS (SELECT FROM live l WHERE l.inbox OPERATOR(pg_catalog.=) d.inbox
                                                AND l.id OPERATOR(pg_catalog.=) d.id)
           AND pg_catalog.has_table_privilege(
                 pg_catalog.to_regclass('dedup.' OPERATOR(pg_catalog.||)
                                        pg_catalog.quote_ident('inbox_' OPERATOR(pg_catalog.||) d.inbox)),
                 'SELECT')) a
 WHERE a.expires_at OPERATOR(pg_catalog.>) pg_catalog.now();
REVOKE ALL ON dedup.attempt_counts, dedup.attempts FROM PUBLIC;

CREATE FUNCTION dedup.attempt(
	"id" TEXT,
	"inbox" TEXT DEFAULT 'default'
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'attempt_wrapper';
REVOKE ALL ON FUNCTION dedup.attempt(text, text) FROM PUBLIC;

-- 5. claim() returns one row of dedup.claim_result.
CREATE TYPE dedup.claim_result AS (
    state  text,
    result jsonb
);
DO $claim$
DECLARE
    grants text[];
    g text;
BEGIN
    -- Who may execute it now (beside its owner), kept across its re-creation.
    -- (regrole's text is the name quoted as an identifier already.)
    SELECT pg_catalog.array_agg(CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                     ELSE a.grantee::pg_catalog.regrole::text END
                                OPERATOR(pg_catalog.||)
                                CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
      INTO grants
      FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
     WHERE p.oid OPERATOR(pg_catalog.=)
           'dedup.claim(text, text, interval, text, boolean, interval)'::pg_catalog.regprocedure
       AND a.grantee OPERATOR(pg_catalog.<>) p.proowner;
    DROP FUNCTION dedup.claim(text, text, interval, text, boolean, interval);
    CREATE FUNCTION dedup.claim(id text, fingerprint text DEFAULT NULL, ttl interval DEFAULT NULL,
                                inbox text DEFAULT 'default', wait boolean DEFAULT true,
                                lease interval DEFAULT NULL)
    RETURNS dedup.claim_result VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'claim_wrapper';
    REVOKE ALL ON FUNCTION dedup.claim(text, text, interval, text, boolean, interval) FROM PUBLIC;
    FOREACH g IN ARRAY COALESCE(grants, '{}') LOOP
        EXECUTE 'GRANT EXECUTE ON FUNCTION dedup.claim(text, text, interval, text, boolean, interval) TO '
                OPERATOR(pg_catalog.||) g;
    END LOOP;
END
$claim$;
