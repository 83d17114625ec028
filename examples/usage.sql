-- pg_dedup from plain SQL and PL/pgSQL. Runs top to bottom in a fresh database with the extension installed:
--   psql -X -q -v ON_ERROR_STOP=1 -d DB -f examples/usage.sql
-- Its output is examples/usage.out (tests/examples.rs checks that it still is).

\echo == 1. An inbox per consumer, with its default TTL
-- Each consumer of a stream gets its own inbox (its own namespace of ids). The TTL must outlast the longest time
-- a duplicate can arrive after the original (docs/ttl.md).
SELECT dedup.create_inbox('orders', '7 days');

-- The business data of this example: stock, and the shipments that take from it.
CREATE TABLE stock (item text PRIMARY KEY, quantity int NOT NULL);
INSERT INTO stock VALUES ('widget', 100), ('gadget', 50);
CREATE TABLE shipments (order_id text NOT NULL, item text NOT NULL, quantity int NOT NULL);

\echo == 2. mark() and the business write in one transaction
-- mark() returns true the first time it sees an id, false for a duplicate; the write depends on it. In one
-- statement: INSERT ... SELECT ... WHERE dedup.mark(...) (no FROM: the call runs exactly once).
BEGIN;
INSERT INTO shipments SELECT 'order-1', 'widget', 2 WHERE dedup.mark('order-1-shipped', NULL, 'orders');
COMMIT;
-- The same event delivered again: mark() says false, nothing is inserted.
BEGIN;
INSERT INTO shipments SELECT 'order-1', 'widget', 2 WHERE dedup.mark('order-1-shipped', NULL, 'orders');
COMMIT;
SELECT * FROM shipments;

\echo == 3. A rolled-back transaction takes its mark with it
BEGIN;
SELECT dedup.mark('order-2-shipped', NULL, 'orders') AS new;
-- ... the business write fails, or the consumer dies here ...
ROLLBACK;
-- So the redelivery is new, and processed.
SELECT dedup.mark('order-2-shipped', NULL, 'orders') AS new;

\echo == 4. A batch: mark_many() returns the ids that are new, each once
-- One poll of the broker, one transaction. order-1 is a duplicate of section 2; order-5 comes twice in the batch.
BEGIN;
WITH batch (event_id, order_id, item, quantity) AS (
  VALUES ('order-1-shipped', 'order-1', 'widget', 2),
         ('order-5-shipped', 'order-5', 'gadget', 1),
         ('order-6-shipped', 'order-6', 'widget', 3),
         ('order-5-shipped', 'order-5', 'gadget', 1)),
new AS (
  SELECT event_id FROM dedup.mark_many(ARRAY(SELECT event_id FROM batch), NULL, 'orders') AS m (event_id))
INSERT INTO shipments
SELECT DISTINCT ON (event_id) order_id, item, quantity FROM batch JOIN new USING (event_id);
COMMIT;
SELECT * FROM shipments ORDER BY order_id;

\echo == 5. A PL/pgSQL function that processes an event idempotently
CREATE FUNCTION ship(event_id text, ship_item text, ship_quantity int) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT dedup.mark(event_id, NULL, 'orders') THEN
    RETURN false;                                  -- a duplicate: already done
  END IF;
  UPDATE stock SET quantity = quantity - ship_quantity WHERE item = ship_item;
  IF NOT FOUND THEN
    -- An error rolls back the mark with everything else: fix the data, and the redelivery is processed.
    RAISE EXCEPTION 'unknown item %', ship_item;
  END IF;
  RETURN true;
END
$$;
SELECT ship('order-7-shipped', 'widget', 4) AS applied;
SELECT ship('order-7-shipped', 'widget', 4) AS applied;
SELECT * FROM stock ORDER BY item;

\echo == 6. A TTL for one call, and seen()
-- NULL ttl means the inbox's default; a call can give its own (here: a short-lived notification id).
SELECT dedup.mark('sms-42', '10 minutes', 'orders') AS new;
-- seen() only reads: is there a live mark? (a cheap pre-check, e.g. before fetching a large payload)
SELECT dedup.seen('sms-42', 'orders') AS sms_42, dedup.seen('sms-43', 'orders') AS sms_43;
SELECT id, expires_at <= now() + interval '10 minutes' AS within_10_minutes FROM dedup.inbox_orders
 WHERE id = 'sms-42';

\echo == 7. forget(): process an event again
-- An operator reverted order-7's shipment by hand and wants the next delivery processed again.
UPDATE stock SET quantity = quantity + 4 WHERE item = 'widget';
SELECT dedup.forget('order-7-shipped', 'orders') AS forgotten;
SELECT ship('order-7-shipped', 'widget', 4) AS applied;
SELECT * FROM stock ORDER BY item;

\echo == 8. Monitoring (more in docs/monitoring.md)
SELECT name, default_ttl FROM dedup.inboxes ORDER BY name;
-- Live and expired marks of one inbox (expired ones count as absent; the purge deletes them).
SELECT count(*) FILTER (WHERE expires_at > now()) AS live,
       count(*) FILTER (WHERE expires_at <= now()) AS expired
  FROM dedup.inbox_orders;
-- Traffic, duplicate rate and purging per inbox: counters in shared memory, NULL unless pg_dedup is in
-- shared_preload_libraries.
SELECT inbox, marks, duplicates,
       round(100.0 * duplicates / nullif(marks + duplicates, 0), 1) AS duplicate_pct,
       purged, filter_trusted
  FROM dedup.stats
 ORDER BY inbox;
-- Delete expired marks now (the background worker does it by itself when preloaded; or call this from cron).
SELECT dedup.purge('orders') AS purged;
