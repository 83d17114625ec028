-- pg_dedup: the objects every inbox relies on. Runs first in CREATE EXTENSION (schema "dedup" already exists:
-- the control file names it and Postgres creates it).

-- The inbox table type: every inbox is a table OF this type. Ids compare byte-wise (COLLATE "C"): they are opaque
-- keys, C comparison is the fastest, and no OS collation upgrade can ever corrupt the UNIQUE index that decides
-- what is a duplicate. Being typed, user inboxes depend on the extension: DROP EXTENSION cannot orphan them.
-- A mark fills id and expires_at; a claim (dedup.claim(), docs/idempotency-keys.md) also the rest: the request's
-- fingerprint, the stored result, the end of its lease, and whether it was completed (NULL for a mark). NULLs cost
-- no bytes here: a row's null bitmap fits in the padding of its header.
CREATE TYPE dedup.inbox_row AS (
    id          text COLLATE "C",
    expires_at  timestamptz,
    fingerprint text,
    result      jsonb,
    lease_until timestamptz,
    completed   boolean
);

-- What dedup.claim() returns: one row, not a set. A function returning a named composite type gets its result's
-- descriptor from the type cache; one returning a set of OUT parameters had it built from pg_proc twice per call.
CREATE TYPE dedup.claim_result AS (
    state  text,
    result jsonb
);

-- One row per inbox. The table of inbox <name> is dedup.inbox_<name>.
CREATE TABLE dedup.inbox_registry (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z_][a-z0-9_]{0,47}$'),
    default_ttl interval NOT NULL CHECK (default_ttl > interval '0'),
    created_at  timestamptz NOT NULL DEFAULT pg_catalog.now()
);
-- pg_dump keeps the registry rows; the default inbox's row is recreated by CREATE EXTENSION itself (finalize.sql).
SELECT pg_catalog.pg_extension_config_dump('dedup.inbox_registry', 'WHERE name <> ''default''');


-- Per-key positions of dedup.advance() (docs/ingest.md), for every inbox, apart from the inbox tables: a key of
-- advance() and an id of mark() never meet. Written and read only by the extension's owner, on behalf of callers
-- whose rights on the inbox's table advance() and position() check (src/positions.rs). pg_dump keeps the rows.
CREATE TABLE dedup.positions (
    inbox       text NOT NULL,
    key         text COLLATE "C" NOT NULL,
    position    bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (inbox, key)
);
CREATE INDEX ON dedup.positions (inbox, expires_at);
SELECT pg_catalog.pg_extension_config_dump('dedup.positions', '');

-- Counts of delivery attempts (dedup.attempt(), docs/poison-messages.md), as the workers last made them durable:
-- shared memory holds the current ones (src/attempts/). Like dedup.positions, apart from the inbox tables, written
-- by the workers and read by attempt() and forget() straight through the primary key; only the extension's owner
-- reads it (dedup.attempts shows each role the inboxes it may read). pg_dump keeps the rows.
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

-- Tables whose inserts are deduplicated (dedup.attach(), docs/ingest.md): the key expression over the table's
-- columns, the inbox that holds the keys, their window (NULL: the inbox's default), what happens to a duplicate
-- row, and whether keys are loaded in batches (dedup.attach_batched()). `tbl` is a regclass, so pg_dump writes the
-- table's name and a restore finds the new table by it.
CREATE TABLE dedup.attachment_registry (
    tbl          pg_catalog.regclass PRIMARY KEY,
    key          text NOT NULL,
    inbox        text NOT NULL,
    ttl          interval,
    on_duplicate text NOT NULL CHECK (on_duplicate IN ('skip', 'error')),
    batched      boolean NOT NULL DEFAULT false
);
SELECT pg_catalog.pg_extension_config_dump('dedup.attachment_registry', '');

CREATE VIEW dedup.attachments AS
SELECT tbl, key, inbox, ttl, on_duplicate, batched FROM dedup.attachment_registry;
