-- A feed loader, re-run as loaders are (after a crash, a retry, a replayed file): dedup.attach() makes every row of
-- the feed land once, whatever reaches the table and however often; dedup.advance() applies each shipment's status
-- only when it is newer than the last one applied. Run from this directory: psql -f load.sql
\set ON_ERROR_STOP 1
SET client_min_messages = warning;

-- Raw events, deduplicated by carrier and event id (two carriers may use the same event id) for 7 days.
CREATE TABLE shipment_events (event_id text NOT NULL, carrier text NOT NULL, shipment text NOT NULL,
                              status text NOT NULL, version bigint NOT NULL);
SELECT dedup.attach('shipment_events', 'carrier || '':'' || event_id', ttl => '7 days');
SELECT * FROM dedup.attachments;

-- The feed has 9 lines: 2 repeat an earlier event, 1 more event id is reused by another carrier.
\copy shipment_events FROM 'feed.csv' WITH (FORMAT csv, HEADER)
SELECT count(*) AS events_after_first_load FROM shipment_events;
-- The loader runs again over the same file: nothing new.
\copy shipment_events FROM 'feed.csv' WITH (FORMAT csv, HEADER)
SELECT count(*) AS events_after_second_load FROM shipment_events;
-- A single INSERT of a known event is dropped too (RETURNING shows what went in).
INSERT INTO shipment_events VALUES ('e-2002', 'ups', 'shp-2', 'in_transit', 2), ('e-2003', 'ups', 'shp-2', 'delivered', 3)
RETURNING carrier, event_id;

-- Current status per shipment: events arrive out of order (shp-1's version 4 before its version 3), so each is
-- applied only if its version moves the shipment forward.
CREATE TABLE shipment_status (shipment text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL);
CREATE FUNCTION apply_status(shipment text, status text, version bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF NOT dedup.advance(shipment, version) THEN
        RETURN false;  -- stale or repeated: this shipment is already further along
    END IF;
    INSERT INTO shipment_status VALUES (shipment, status, version)
    ON CONFLICT ON CONSTRAINT shipment_status_pkey DO UPDATE SET status = excluded.status, version = excluded.version;
    RETURN true;
END $$;
-- The events in the order they arrive (a VALUES list is read, and each row's call made, in order).
SELECT shipment, version, apply_status(shipment, status, version) AS applied
  FROM (VALUES ('shp-1', 'picked_up', 1), ('shp-1', 'in_transit', 2), ('shp-1', 'delivered', 4),
               ('shp-1', 'in_transit', 3), ('shp-2', 'picked_up', 1), ('shp-2', 'delivered', 3),
               ('shp-2', 'in_transit', 2), ('shp-3', 'picked_up', 1), ('shp-1', 'delivered', 4))
       AS arrival(shipment, status, version);
SELECT * FROM shipment_status ORDER BY shipment;
SELECT dedup.position('shp-1') AS shp_1_position, dedup.position('shp-9') AS never_seen;
