-- pg_dedup 0.1.0 -> 0.2.0.
--
-- 0.2.0 changed only the library: mark_many() writes ids the Bloom filter calls certainly new with a bulk insert,
-- duplicates of mark() use a single-id lookup plan, filter batches prefetch, and subtransactions release their
-- resources. The SQL objects are the same as 0.1.0's (tests/upgrade.rs checks that an upgraded database has exactly
-- the objects of a fresh 0.2.0 install), so there is nothing to change here.
\echo Use "ALTER EXTENSION pg_dedup UPDATE TO '0.2.0'" to load this file. \quit
