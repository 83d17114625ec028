-- pg_dedup: objects that need the Rust functions, then privileges.

-- The inbox that exists after CREATE EXTENSION, made like any other (table, indexes, filter trigger). Created by
-- this script, it belongs to the extension, so pg_dump keeps its rows through pg_extension_config_dump; inboxes
-- made later by dedup.create_inbox() are ordinary tables, dumped as such.
SELECT dedup.create_inbox('default', interval '3 days');
SELECT pg_catalog.pg_extension_config_dump('dedup.inbox_default', '');

-- Every inbox, with its table; `distributed` when Citus distributes it (docs/scale-out.md).
CREATE VIEW dedup.inboxes AS
SELECT r.name,
       r.default_ttl,
       c.oid::pg_catalog.regclass AS relation,
       r.created_at,
       dedup.is_distributed(c.oid) AS distributed
  FROM dedup.inbox_registry r
  LEFT JOIN pg_catalog.pg_class c
         ON c.relname OPERATOR(pg_catalog.=) ('inbox_' OPERATOR(pg_catalog.||) r.name)
        AND c.relnamespace OPERATOR(pg_catalog.=) 'dedup'::pg_catalog.regnamespace;

-- The columns of pg_dedup 0.2.0 first, then those added since (so an update can CREATE OR REPLACE the view). The
-- counters come by name (src/shmem.rs lists them; a #[pg_test] in src/stats.rs checks that each is a column here).
CREATE VIEW dedup.stats AS
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

-- The counts of delivery attempts (dedup.attempt()) of the inboxes the reader may read, whose window has not passed:
-- those shared memory holds now, and the durable ones (written by the workers every dedup.attempts_flush_interval)
-- of the other ids. A barrier, so that no function of the reader's query sees the rows of other inboxes.
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

-- The filter holds the key (inbox and id) of every row of dedup.attempt_counts too, so that attempt() of an id the
-- table certainly lacks need not read it: the same trigger as an inbox table's, keyed by both columns
-- (src/trigger.rs, Key::InboxAndId).
CREATE TRIGGER dedup_filter AFTER INSERT OR UPDATE OF inbox, id ON dedup.attempt_counts
  FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger('inbox_and_id');
ALTER TABLE dedup.attempt_counts ENABLE ALWAYS TRIGGER dedup_filter;

-- Any DDL that may change an inbox table's filter trigger (disable it, put it in origin mode, drop or re-create it)
-- makes the filter stop trusting that inbox at once, inside the transaction that changed it; the background worker
-- repairs the trigger and reloads the inbox (src/trigger.rs). Event triggers run whoever issues the command, and
-- need no privilege on the function.
CREATE EVENT TRIGGER dedup_watch_ddl ON ddl_command_end
  WHEN TAG IN ('ALTER TABLE', 'CREATE TRIGGER', 'DROP TRIGGER', 'ALTER TRIGGER')
  EXECUTE FUNCTION dedup.watch_ddl();
-- Also under session_replication_role = replica (logical replication's apply, some restores).
ALTER EVENT TRIGGER dedup_watch_ddl ENABLE ALWAYS;

-- DROP TABLE of an attached table (dedup.attach()) removes its attachment (src/attach/mod.rs).
CREATE EVENT TRIGGER dedup_watch_drop ON sql_drop EXECUTE FUNCTION dedup.watch_drop();
ALTER EVENT TRIGGER dedup_watch_drop ENABLE ALWAYS;

-- Nothing is granted to PUBLIC: a role can use pg_dedup only once an administrator grants it (see README,
-- "Privileges"). Functions are EXECUTE-able by PUBLIC by default in Postgres, so take that back. (Firing a trigger
-- needs no privilege.) Schema dedup and its tables are written only by the extension's owner: create_inbox() and
-- drop_inbox() act as that owner for callers they let in (see docs/privileges.md).
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON SCHEMA dedup FROM PUBLIC;
-- Except helpers that reveal nothing and that anyone's statements call: dedup.inboxes reads is_distributed()
-- with its reader's rights, claim()'s lookup, where it runs as SQL, calls xmin_is_mine(), and dedup.attempts reads
-- attempts_in_memory(), which shows each caller only the inboxes it may read.
GRANT EXECUTE ON FUNCTION dedup.is_distributed(oid), dedup.xmin_is_mine(xid), dedup.attempts_in_memory() TO PUBLIC;
