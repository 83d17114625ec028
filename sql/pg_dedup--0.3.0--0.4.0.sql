-- pg_dedup 0.3.0 -> 0.4.0.
--
-- What changes:
\echo Use "ALTER EXTENSION pg_dedup UPDATE TO '0.4.0'" to load this file. \quit
