-- pg_dedup: objects that need the Rust functions, then privileges.

-- Every row written to an inbox table passes this trigger first, which puts its id into the shared Bloom filter.
-- ENABLE ALWAYS: it fires for logical replication and session_replication_role = replica too.
CREATE TRIGGER dedup_filter BEFORE INSERT OR UPDATE ON dedup.inbox_default
    FOR EACH ROW EXECUTE FUNCTION dedup.inbox_filter_trigger();
ALTER TABLE dedup.inbox_default ENABLE ALWAYS TRIGGER dedup_filter;

CREATE VIEW dedup.stats AS
SELECT i.*, f.*
  FROM dedup.inbox_stats() AS i
 CROSS JOIN dedup.filter_stats() AS f;

-- Nothing is granted to PUBLIC: a role can use pg_dedup only once an administrator grants it (see README,
-- "Privileges"). Functions are EXECUTE-able by PUBLIC by default in Postgres, so take that back. (Firing the trigger
-- needs no privilege; creating one, in dedup.create_inbox(), needs EXECUTE on its function.)
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON SCHEMA dedup FROM PUBLIC;
