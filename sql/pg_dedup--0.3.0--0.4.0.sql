-- pg_dedup 0.3.0 -> 0.4.0.
--
-- What changes:
-- 1. attach() (docs/ingest.md): an attachment's trigger names the key in its WHEN clause (always true, and free),
--    so that PostgreSQL records what the key depends on, as for an index expression: dropping a function or a
--    column the key uses is refused (or, with CASCADE, takes the trigger and so the attachment). Every attachment
--    is made again here with attach(), which re-creates its trigger that way. Before that, attachments whose table
--    is gone or no longer has its trigger (a temporary table attached with 0.3.0 whose session ended, a table
--    dropped while the event trigger was disabled) are removed: 0.3.0 kept them, and drop_inbox() then refused their
--    inbox for good. attach() now refuses temporary tables; one attached with 0.3.0 is left as it is (its session's
--    end takes it, and the next attach(), detach() or drop_inbox() removes its attachment).
\echo Use "ALTER EXTENSION pg_dedup UPDATE TO '0.4.0'" to load this file. \quit

DELETE FROM dedup.attachment_registry a
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                    WHERE t.tgrelid OPERATOR(pg_catalog.=) a.tbl
                      AND t.tgname OPERATOR(pg_catalog.=) 'zz_dedup_attached'
                      AND t.tgparentid OPERATOR(pg_catalog.=) 0);
SELECT dedup.attach(a.tbl, a.key, a.ttl, a.inbox, a.on_duplicate)
  FROM dedup.attachment_registry a
  JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) a.tbl
 WHERE c.relpersistence OPERATOR(pg_catalog.<>) 't';
