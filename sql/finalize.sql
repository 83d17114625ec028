-- pg_dedup: objects that need the Rust functions, then privileges.

-- The inbox that exists after CREATE EXTENSION, made like any other (table, indexes, filter trigger). Created by
-- this script, it belongs to the extension, so pg_dump keeps its rows through pg_extension_config_dump; inboxes
-- made later by dedup.create_inbox() are ordinary tables, dumped as such.
SELECT dedup.create_inbox('default', interval '3 days');
SELECT pg_catalog.pg_extension_config_dump('dedup.inbox_default', '');

CREATE VIEW dedup.stats AS
SELECT i.*, w.*, f.*
  FROM dedup.inbox_stats() AS i
 CROSS JOIN dedup.worker_stats() AS w
 CROSS JOIN dedup.filter_stats() AS f;

-- Nothing is granted to PUBLIC: a role can use pg_dedup only once an administrator grants it (see README,
-- "Privileges"). Functions are EXECUTE-able by PUBLIC by default in Postgres, so take that back. (Firing the trigger
-- needs no privilege; creating one, in dedup.create_inbox(), needs EXECUTE on its function.)
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON SCHEMA dedup FROM PUBLIC;
