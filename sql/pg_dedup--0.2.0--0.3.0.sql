-- pg_dedup 0.2.0 -> 0.3.0.
--
-- What changes (see docs/privileges.md, "Upgrading from 0.2.0"):
-- 1. Only the extension's owner writes schema dedup and its registry. 0.2.0's docs had inbox administrators
--    granted CREATE on the schema and INSERT/DELETE on dedup.inbox_registry, which let them plant functions and
--    operators in the schema, rewrite the registry, and reach superuser rights through the background worker.
--    Those grants are revoked from every role; create_inbox() and drop_inbox() now check their callers themselves.
-- 2. Inbox tables belong to the extension's owner. Each table a role other than that owner owns is handed over,
--    and that role keeps every privilege on it but TRIGGER and REFERENCES, WITH GRANT OPTION (it can still grant
--    on it and drop it). A table that carries triggers, rules or row security policies of its own is left as it
--    is, with a WARNING: review what is on it, then hand it over by hand.
-- 3. The filter trigger fires AFTER the row is written (it hashes the id as stored, and filter rotations need not
--    wait for running transactions any more), so every inbox table's dedup_filter trigger is re-created.
-- 4. dedup.stats shows the state of each inbox's filter trigger (a new column, filter_trigger), and an event
--    trigger stops the filter from answering for an inbox whose trigger DDL disables or removes.
-- 5. Idempotency keys (docs/idempotency-keys.md): claim(), complete(), release() and fingerprint(), stored in the
--    inboxes' own rows, which gain four columns (NULL for marks: no rewrite, and no byte more per mark), and
--    dedup.stats gains their counters.
-- 6. Ingest (docs/ingest.md): attach()/detach() and the dedup.attachments view deduplicate a table's inserts, and
--    advance()/position() keep per-key positions in a table of their own, dedup.positions; dedup.stats counts
--    both.
-- 7. Scale-out (docs/scale-out.md): distribute_inbox() and undistribute_inbox() for Citus, and dedup.inboxes says
--    which inboxes are distributed (a new column).
\echo Use "ALTER EXTENSION pg_dedup UPDATE TO '0.3.0'" to load this file. \quit

ALTER TYPE dedup.inbox_row
    ADD ATTRIBUTE fingerprint text CASCADE,
    ADD ATTRIBUTE result jsonb CASCADE,
    ADD ATTRIBUTE lease_until timestamptz CASCADE,
    ADD ATTRIBUTE completed boolean CASCADE;

CREATE FUNCTION dedup.claim(
	"id" TEXT,
	"fingerprint" TEXT DEFAULT NULL,
	"ttl" interval DEFAULT NULL,
	"inbox" TEXT DEFAULT 'default',
	"wait" bool DEFAULT true,
	"lease" interval DEFAULT NULL
) RETURNS TABLE (
	"state" TEXT,
	"result" jsonb
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'claim_wrapper';
CREATE FUNCTION dedup.complete(
	"id" TEXT,
	"result" jsonb DEFAULT NULL,
	"inbox" TEXT DEFAULT 'default'
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'complete_wrapper';
CREATE FUNCTION dedup.release(
	"id" TEXT,
	"inbox" TEXT DEFAULT 'default'
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'release_wrapper';
CREATE FUNCTION dedup.fingerprint("payload" jsonb) RETURNS TEXT
IMMUTABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'fingerprint_jsonb_wrapper';
CREATE FUNCTION dedup.fingerprint("payload" TEXT) RETURNS TEXT
IMMUTABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'fingerprint_text_wrapper';
CREATE FUNCTION dedup.fingerprint("payload" bytea) RETURNS TEXT
IMMUTABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'fingerprint_bytea_wrapper';
REVOKE ALL ON FUNCTION dedup.claim(text, text, interval, text, boolean, interval), dedup.complete(text, jsonb, text),
    dedup.release(text, text), dedup.fingerprint(jsonb), dedup.fingerprint(text), dedup.fingerprint(bytea) FROM PUBLIC;

-- dedup.stats keeps its columns and gains new ones at the end, from a new function (the old one's row changed):
-- CREATE OR REPLACE keeps the view, its grants and whatever depends on it (a monitoring wrapper returning SETOF
-- dedup.stats). Whoever could execute the old function may execute the new one.
CREATE FUNCTION dedup.inbox_counters() RETURNS TABLE (
	"inbox" TEXT,
	"marks" bigint,
	"duplicates" bigint,
	"renewals" bigint,
	"purged" bigint,
	"backlog" bigint,
	"lookups" bigint,
	"certainly_new" bigint,
	"false_positives" bigint,
	"filter_trusted" bool,
	"filter_trigger" TEXT,
	"claims_new" bigint,
	"claims_completed" bigint,
	"claims_in_progress" bigint,
	"fingerprint_mismatches" bigint,
	"lease_takeovers" bigint,
	"advances" bigint,
	"stale_advances" bigint,
	"rows_passed" bigint,
	"rows_dropped" bigint
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'inbox_counters_wrapper';
REVOKE ALL ON FUNCTION dedup.inbox_counters() FROM PUBLIC;
CREATE OR REPLACE VIEW dedup.stats AS
SELECT i.inbox, i.marks, i.duplicates, i.renewals, i.purged, i.backlog, i.lookups, i.certainly_new,
       i.false_positives, i.filter_trusted,
       w.*, f.*,
       i.filter_trigger, i.claims_new, i.claims_completed, i.claims_in_progress, i.fingerprint_mismatches,
       i.lease_takeovers, i.advances, i.stale_advances, i.rows_passed, i.rows_dropped
  FROM dedup.inbox_counters() AS i
 CROSS JOIN dedup.worker_stats() AS w
 CROSS JOIN dedup.filter_stats() AS f;
DO $grants$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                             ELSE a.grantee::pg_catalog.regrole::text END
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid OPERATOR(pg_catalog.=) 'dedup.inbox_stats()'::pg_catalog.regprocedure
           AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION dedup.inbox_counters() TO %s', grantee);
    END LOOP;
END
$grants$;
DROP FUNCTION dedup.inbox_stats();

CREATE FUNCTION dedup.watch_ddl() RETURNS event_trigger LANGUAGE c
AS 'MODULE_PATHNAME', 'watch_ddl_wrapper';
REVOKE ALL ON FUNCTION dedup.watch_ddl() FROM PUBLIC;

DO $upgrade$
DECLARE
    owner pg_catalog.oid := (SELECT e.extowner FROM pg_catalog.pg_extension e
                              WHERE e.extname OPERATOR(pg_catalog.=) 'pg_dedup');
    grantee text;
    t record;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                             ELSE a.grantee::pg_catalog.regrole::text END
          FROM pg_catalog.pg_namespace n, pg_catalog.aclexplode(n.nspacl) a
         WHERE n.nspname OPERATOR(pg_catalog.=) 'dedup' AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
           AND a.grantee OPERATOR(pg_catalog.<>) n.nspowner
    LOOP
        EXECUTE pg_catalog.format('REVOKE CREATE ON SCHEMA dedup FROM %s', grantee);
    END LOOP;
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                             ELSE a.grantee::pg_catalog.regrole::text END
          FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid OPERATOR(pg_catalog.=) 'dedup.inbox_registry'::pg_catalog.regclass
           AND a.privilege_type OPERATOR(pg_catalog.<>) 'SELECT' AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
    LOOP
        EXECUTE pg_catalog.format(
            'REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON dedup.inbox_registry FROM %s', grantee);
    END LOOP;
    -- EXECUTE on the trigger function was needed to create an inbox's trigger; create_inbox() now does that as the
    -- extension's owner.
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                             ELSE a.grantee::pg_catalog.regrole::text END
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid OPERATOR(pg_catalog.=) 'dedup.inbox_filter_trigger()'::pg_catalog.regprocedure
           AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION dedup.inbox_filter_trigger() FROM %s', grantee);
    END LOOP;

    -- Functions and operators someone planted in schema dedup under the old grants (an overload of mark() that
    -- varchar arguments would pick, say) are not ours to drop: say where they are.
    FOR t IN
        SELECT pg_catalog.format('function dedup.%I(%s)', p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid))
                   AS what,
               pg_catalog.format('DROP FUNCTION dedup.%I(%s)', p.proname,
                                 pg_catalog.pg_get_function_identity_arguments(p.oid)) AS fix
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace OPERATOR(pg_catalog.=) 'dedup'::pg_catalog.regnamespace
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
                            WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                              AND d.objid OPERATOR(pg_catalog.=) p.oid AND d.deptype OPERATOR(pg_catalog.=) 'e')
        UNION ALL
        SELECT pg_catalog.format('operator dedup.%s (%s, %s)', o.oprname, pg_catalog.format_type(o.oprleft, NULL),
                                 pg_catalog.format_type(o.oprright, NULL)),
               pg_catalog.format('DROP OPERATOR dedup.%s (%s, %s)', o.oprname, pg_catalog.format_type(o.oprleft, NULL),
                                 pg_catalog.format_type(o.oprright, NULL))
          FROM pg_catalog.pg_operator o
         WHERE o.oprnamespace OPERATOR(pg_catalog.=) 'dedup'::pg_catalog.regnamespace
    LOOP
        RAISE WARNING 'pg_dedup: % in schema dedup was not created by pg_dedup', t.what
            USING HINT = 'Schema dedup is pg_dedup''s alone; unless you know why it is there, run: ' || t.fix || ';';
    END LOOP;

    FOR t IN
        SELECT c.oid, pg_catalog.format('dedup.%I', c.relname) AS tbl, c.relowner,
               (c.relrowsecurity
                OR EXISTS (SELECT 1 FROM pg_catalog.pg_trigger g
                            WHERE g.tgrelid OPERATOR(pg_catalog.=) c.oid AND NOT g.tgisinternal
                              AND g.tgname OPERATOR(pg_catalog.<>) 'dedup_filter')
                OR EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite r WHERE r.ev_class OPERATOR(pg_catalog.=) c.oid)
                OR EXISTS (SELECT 1 FROM pg_catalog.pg_policy p WHERE p.polrelid OPERATOR(pg_catalog.=) c.oid))
                   AS has_code_of_its_own
          FROM pg_catalog.pg_class c
         WHERE c.relnamespace OPERATOR(pg_catalog.=) 'dedup'::pg_catalog.regnamespace
           AND c.reloftype OPERATOR(pg_catalog.=) 'dedup.inbox_row'::pg_catalog.regtype
           AND c.relkind OPERATOR(pg_catalog.=) 'r'
    LOOP
        EXECUTE pg_catalog.format('DROP TRIGGER IF EXISTS dedup_filter ON %s', t.tbl);
        EXECUTE pg_catalog.format('CREATE TRIGGER dedup_filter AFTER INSERT OR UPDATE OF id ON %s '
                                  'FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger()', t.tbl);
        EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE ALWAYS TRIGGER dedup_filter', t.tbl);
        IF t.relowner OPERATOR(pg_catalog.<>) owner THEN
            IF t.has_code_of_its_own THEN
                RAISE WARNING 'pg_dedup: % stays owned by %: it has triggers, rules or row security policies of its own',
                    t.tbl, t.relowner::pg_catalog.regrole
                    USING HINT = pg_catalog.format('Review them, then run: ALTER TABLE %s OWNER TO %s; GRANT SELECT, '
                                 'INSERT, UPDATE, DELETE, TRUNCATE ON %s TO %s WITH GRANT OPTION;', t.tbl,
                                 owner::pg_catalog.regrole, t.tbl, t.relowner::pg_catalog.regrole);
            ELSE
                EXECUTE pg_catalog.format('ALTER TABLE %s OWNER TO %s', t.tbl, owner::pg_catalog.regrole);
                EXECUTE pg_catalog.format('GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON %s TO %s WITH GRANT OPTION',
                                          t.tbl, t.relowner::pg_catalog.regrole);
            END IF;
        END IF;
    END LOOP;
END
$upgrade$;

CREATE EVENT TRIGGER dedup_watch_ddl ON ddl_command_end
  WHEN TAG IN ('ALTER TABLE', 'CREATE TRIGGER', 'DROP TRIGGER', 'ALTER TRIGGER')
  EXECUTE FUNCTION dedup.watch_ddl();
-- Also under session_replication_role = replica (logical replication's apply, some restores).
ALTER EVENT TRIGGER dedup_watch_ddl ENABLE ALWAYS;

-- 6. Ingest: per-key positions and attached tables (as in bootstrap.sql and finalize.sql).
CREATE TABLE dedup.positions (
    inbox       text NOT NULL,
    key         text COLLATE "C" NOT NULL,
    position    bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (inbox, key)
);
CREATE INDEX ON dedup.positions (inbox, expires_at);
SELECT pg_catalog.pg_extension_config_dump('dedup.positions', '');
CREATE TABLE dedup.attachment_registry (
    tbl          pg_catalog.regclass PRIMARY KEY,
    key          text NOT NULL,
    inbox        text NOT NULL,
    ttl          interval,
    on_duplicate text NOT NULL CHECK (on_duplicate IN ('skip', 'error'))
);
SELECT pg_catalog.pg_extension_config_dump('dedup.attachment_registry', '');
CREATE VIEW dedup.attachments AS
SELECT tbl, key, inbox, ttl, on_duplicate FROM dedup.attachment_registry;
REVOKE ALL ON dedup.positions, dedup.attachment_registry, dedup.attachments FROM PUBLIC;
CREATE FUNCTION dedup.advance(
	"key" TEXT,
	"position" bigint,
	"inbox" TEXT DEFAULT 'default',
	"ttl" interval DEFAULT NULL
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'advance_wrapper';
CREATE FUNCTION dedup."position"(
	"key" TEXT,
	"inbox" TEXT DEFAULT 'default'
) RETURNS bigint
STABLE PARALLEL RESTRICTED
LANGUAGE c
AS 'MODULE_PATHNAME', 'position_wrapper';
CREATE FUNCTION dedup.attach(tbl regclass, key text, ttl interval DEFAULT NULL, inbox text DEFAULT 'default',
                             on_duplicate text DEFAULT 'skip') RETURNS void
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'attach_wrapper';
CREATE FUNCTION dedup.detach(tbl regclass) RETURNS void
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'detach_wrapper';
CREATE FUNCTION dedup.attached_insert() RETURNS TRIGGER LANGUAGE c AS 'MODULE_PATHNAME', 'attached_insert_wrapper';
CREATE FUNCTION dedup.watch_drop() RETURNS event_trigger LANGUAGE c AS 'MODULE_PATHNAME', 'watch_drop_wrapper';
REVOKE ALL ON FUNCTION dedup.advance(text, bigint, text, interval), dedup."position"(text, text),
    dedup.attach(regclass, text, interval, text, text), dedup.detach(regclass), dedup.attached_insert(),
    dedup.watch_drop() FROM PUBLIC;
CREATE EVENT TRIGGER dedup_watch_drop ON sql_drop EXECUTE FUNCTION dedup.watch_drop();
ALTER EVENT TRIGGER dedup_watch_drop ENABLE ALWAYS;

-- 7. Scale-out: Citus (as in src/citus.rs and finalize.sql).
CREATE FUNCTION dedup.distribute_inbox(name text, colocate_with regclass DEFAULT NULL) RETURNS void
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'distribute_inbox_wrapper';
CREATE FUNCTION dedup.undistribute_inbox("name" TEXT) RETURNS void
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'undistribute_inbox_wrapper';
CREATE FUNCTION dedup.is_distributed("relid" oid) RETURNS bool
STABLE PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'is_distributed_wrapper';
CREATE FUNCTION dedup.xmin_is_mine("xmin" xid) RETURNS bool
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'xmin_is_mine_wrapper';
-- As finalize.sql does it (revoked, then granted back), so the ACLs read the same as after a fresh install.
REVOKE ALL ON FUNCTION dedup.distribute_inbox(text, regclass), dedup.undistribute_inbox(text),
    dedup.is_distributed(oid), dedup.xmin_is_mine(xid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION dedup.is_distributed(oid), dedup.xmin_is_mine(xid) TO PUBLIC;
CREATE OR REPLACE VIEW dedup.inboxes AS
SELECT r.name,
       r.default_ttl,
       c.oid::pg_catalog.regclass AS relation,
       r.created_at,
       dedup.is_distributed(c.oid) AS distributed
  FROM dedup.inbox_registry r
  LEFT JOIN pg_catalog.pg_class c
         ON c.relname OPERATOR(pg_catalog.=) ('inbox_' OPERATOR(pg_catalog.||) r.name)
        AND c.relnamespace OPERATOR(pg_catalog.=) 'dedup'::pg_catalog.regnamespace;
