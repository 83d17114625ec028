#!/usr/bin/env python3
"""A Kafka consumer that applies payment events exactly once with pg_dedup (confluent-kafka + psycopg 3).

Reads the records of a topic, whose values are JSON payments {"id": "pay-1", "account": 3, "amount": 120}, in a
consumer group, and adds each amount to its account's balance once, however often Kafka delivers the record and
however often the producer published the event. Each poll's batch (up to --batch records) is one transaction.
Two roads (docs/kafka.md):

  --road ids      (the default) dedup.mark_many() of the event ids in the transaction; the offsets are committed
                  to Kafka after COMMIT. A crash in between means a re-read, answered as duplicates.
  --road offsets  no offset commits: dedup.advance('<topic>/<partition>', offset) in the transaction, and every
                  assigned partition starts at dedup.position() + 1. For records without an id of their own; a
                  producer's retry is a record of its own here, and is applied.

Prints one line per transaction: "applied NEW new DUP duplicates"; refused offset commits go to stderr. Stops,
leaving the group, on SIGTERM or SIGINT.

    DATABASE_URL="dbname=shop" python3 consumer.py --bootstrap 127.0.0.1:9092 --topic payments --group ledger
"""

import argparse
import json
import os
import random
import signal
import sys
import time

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

INBOX = "payments"
# Errors that mean "the transaction lost a race; run it again": serialization failure, deadlock.
RETRYABLE = {"40001", "40P01"}
MAX_ATTEMPTS = 5


def position_key(topic, partition):
    return f"{topic}/{partition}"


def claim(cur, road, records):
    """The records of the batch seen for the first time, claimed in the open transaction."""
    if road == "ids":
        payments = [json.loads(r.value()) for r in records]
        new_ids = {row[0] for row in cur.execute(
            "SELECT dedup.mark_many(%s, NULL, %s)", ([p["id"] for p in payments], INBOX))}
        new = []
        for payment in payments:
            # A repeat inside the batch is a duplicate of its first occurrence: take each new id once.
            if payment["id"] in new_ids:
                new_ids.discard(payment["id"])
                new.append(payment)
        return new
    # Offsets: advance() refuses an offset at or below the stored one. In order of partition, then offset, so that
    # two consumers holding the same partitions for a moment (during a rebalance) take their locks in one order.
    new = []
    for r in sorted(records, key=lambda r: (r.partition(), r.offset())):
        key = position_key(r.topic(), r.partition())
        if cur.execute("SELECT dedup.advance(%s, %s, %s)", (key, r.offset(), INBOX)).fetchone()[0]:
            new.append(json.loads(r.value()))
    return new


def apply(conn, road, records):
    """One transaction for the batch: the claims and the business write commit together, or neither does."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            with conn.transaction(), conn.cursor() as cur:
                new = claim(cur, road, records)
                totals = {}
                for payment in new:
                    totals[payment["account"]] = totals.get(payment["account"], 0) + int(payment["amount"])
                # In account order: batches updating the same accounts in different orders would deadlock.
                for account in sorted(totals):
                    cur.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (totals[account], account))
            return len(new)
        except psycopg.Error as e:
            if e.sqlstate in RETRYABLE and attempt < MAX_ATTEMPTS:
                time.sleep(random.uniform(0, 0.01 * 2**attempt))
                continue
            # Anything else: stop without committing offsets; the partition's next owner reads the batch again.
            raise


def commit_offsets(consumer, records):
    """After COMMIT: the offset after each partition's last record. Refused when the group has rebalanced since
    (the partition may be someone else's now); its new owner then reads the records again, and finds their marks."""
    last = {}
    for r in records:
        last[(r.topic(), r.partition())] = max(last.get((r.topic(), r.partition()), -1), r.offset())
    offsets = [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]
    try:
        consumer.commit(offsets=offsets, asynchronous=False)
    except KafkaException as e:
        print(f"offset commit refused: {e}", file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", default="payments")
    parser.add_argument("--group", default="ledger")
    parser.add_argument("--road", choices=["ids", "offsets"], default="ids")
    parser.add_argument("--batch", type=int, default=100)
    # How long the group waits for a silent consumer (a crashed one) before moving its partitions: Kafka's default
    # is 45 s. Tansu holds each join for half of it, so its tests pass 1500.
    parser.add_argument("--session-timeout-ms", type=int, default=45000)
    args = parser.parse_args()

    running = True

    def stop(*_):
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # An empty conninfo means libpq's defaults and PG* environment variables.
    conn = psycopg.connect(os.environ.get("DATABASE_URL", ""), autocommit=True)

    def on_assign(consumer, partitions):
        if args.road == "offsets":
            # Start after the position stored with the data, whatever Kafka has committed (nothing, here).
            for p in partitions:
                stored = conn.execute("SELECT dedup.position(%s, %s)",
                                      (position_key(p.topic, p.partition), INBOX)).fetchone()[0]
                p.offset = OFFSET_BEGINNING if stored is None else stored + 1
        consumer.assign(partitions)

    consumer = Consumer({
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        # Offsets are committed by hand, after COMMIT (ids), or never (offsets).
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": args.session_timeout_ms,
        # A third of the session at most (librdkafka's default, 3 s, is for Kafka's 45 s).
        "heartbeat.interval.ms": min(3000, args.session_timeout_ms // 3),
    })
    consumer.subscribe([args.topic], on_assign=on_assign)
    try:
        while running:
            records = [r for r in consumer.consume(num_messages=args.batch, timeout=0.5) if not r.error()]
            if not records:
                continue
            new = apply(conn, args.road, records)
            if args.road == "ids":
                commit_offsets(consumer, records)
            print(f"applied {new} new {len(records) - new} duplicates", flush=True)
    finally:
        # Leaves the group at once, so its partitions move to the others without waiting for a session timeout.
        consumer.close()
        conn.close()


if __name__ == "__main__":
    main()
