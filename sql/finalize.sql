-- pg_dedup: privileges. Nothing is granted to PUBLIC: a role can use pg_dedup only once an administrator grants
-- it (see README, "Privileges"). Functions are EXECUTE-able by PUBLIC by default in Postgres, so take that back.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dedup FROM PUBLIC;
REVOKE ALL ON SCHEMA dedup FROM PUBLIC;
