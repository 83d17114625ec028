#!/usr/bin/env python3
"""An idempotent payment consumer with pg_dedup and psycopg 3.

Reads payment events as JSON lines on stdin, {"id": "pay-1", "account": 3, "amount": 120}, and adds each amount to
its account's balance exactly once, however often the event is delivered. Stdin stands in for the broker: replace
deliveries() and ack() with your client's receive and acknowledge calls (Kafka offset commit, RabbitMQ basic_ack,
SQS DeleteMessage). Everything between them stays the same.

Prints one line per delivery: "new ID", "dup ID" or "dead ID SQLSTATE/reason"; retries go to stderr.

    DATABASE_URL="host=/var/run/postgresql dbname=shop" python3 consumer.py < events.jsonl
"""

import json
import os
import random
import sys
import time

import psycopg

INBOX = "payments"
# Errors that mean "the transaction lost a race; run it again": serialization failure, deadlock.
RETRYABLE = {"40001", "40P01"}
MAX_ATTEMPTS = 5


class DeadLetter(Exception):
    """A delivery that can never succeed: park it, acknowledge it, go on."""


def deliveries():
    """The broker: one JSON line per delivery."""
    for line in sys.stdin:
        if line.strip():
            yield line


def ack(line, outcome):
    """The broker acknowledgement. It runs only after COMMIT: a crash before it means a redelivery, which the inbox
    answers as a duplicate. Acknowledging before COMMIT would lose the event if the transaction then failed."""
    print(outcome, flush=True)


def parse(line):
    try:
        event = json.loads(line)
        return str(event["id"]), int(event["account"]), int(event["amount"])
    except (ValueError, KeyError, TypeError) as e:
        raise DeadLetter(f"bad payload: {e}") from None


def apply(conn, event_id, account, amount):
    """One transaction: the mark and the business write commit together, or neither does."""
    with conn.transaction():
        # NULL ttl: the inbox's default (1 day for 'payments', see ../schema.sql).
        new = conn.execute("SELECT dedup.mark(%s, NULL, %s)", (event_id, INBOX)).fetchone()[0]
        if new:
            conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account))
    return new


def handle(conn, line):
    event_id, account, amount = parse(line)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return event_id, apply(conn, event_id, account, amount)
        except psycopg.Error as e:
            if e.sqlstate in RETRYABLE and attempt < MAX_ATTEMPTS:
                # The whole transaction again, mark included: the failed one was rolled back, mark and all.
                print(f"retry {event_id} {e.sqlstate}", file=sys.stderr)
                time.sleep(random.uniform(0, 0.01 * 2**attempt))
                continue
            # dedup's own errors are about the input (too long or empty id, ...): retrying cannot help.
            if e.diag.message_primary and e.diag.message_primary.startswith("dedup:"):
                raise DeadLetter(f"{e.sqlstate} {e.diag.message_primary}") from None
            # Anything else (the database is down, a bug): stop without acknowledging; the broker redelivers.
            raise


def main():
    # An empty conninfo means libpq's defaults and PG* environment variables.
    with psycopg.connect(os.environ.get("DATABASE_URL", ""), autocommit=True) as conn:
        for line in deliveries():
            try:
                event_id, new = handle(conn, line)
                outcome = f"{'new' if new else 'dup'} {event_id}"
            except DeadLetter as e:
                # A real consumer publishes the message to a dead-letter queue here, then acknowledges it.
                outcome = f"dead {line.strip()[:40]} {e}"
            ack(line, outcome)


if __name__ == "__main__":
    main()
