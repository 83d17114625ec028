-- The tables and inboxes the consumer and webhook examples use. Run once, in a database with pg_dedup:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f examples/schema.sql

-- The business data: account balances, which every payment event adds to. An addition is not idempotent (applied
-- twice, the balance is wrong), which is the point: only the inbox makes a redelivery harmless.
CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO accounts (id) SELECT generate_series(1, 20);

-- One inbox per consumer of a stream (two services reading the same events each need their own).
-- The TTL must outlast the longest time a duplicate can arrive after the original: broker redelivery after a
-- consumer crash, a producer's retries, a replay from the log (see docs/ttl.md).
SELECT dedup.create_inbox('payments', '1 day');
-- Webhook providers retry for days (Stripe: up to 3 days): keep the ids longer than that.
SELECT dedup.create_inbox('webhooks', '30 days');
-- Idempotency keys of the webhook example's POST /charges (clients retry within minutes; keep a day).
SELECT dedup.create_inbox('idempotency_keys', '1 day');
