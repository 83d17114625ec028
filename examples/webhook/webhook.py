#!/usr/bin/env python3
"""A webhook receiver made idempotent with pg_dedup: Python's standard HTTP server and psycopg 3, no framework.

Providers (Stripe, GitHub, Shopify, ...) deliver each event at least once and retry until they get a 2xx. So:
  - 200 for a new event, once its effect has committed;
  - 200 for a duplicate too (already processed: the provider must stop retrying), with nothing done;
  - 400 for a payload that can never be processed (retrying will not fix it);
  - 5xx when the database failed: nothing was committed, and the provider's retry will process the event.
The key is the provider's event id: Stripe's body field "id" ("evt_..."), or a header such as Standard Webhooks'
"webhook-id" or GitHub's "X-GitHub-Delivery". Never a hash of the body: a retried event may be re-serialised.

A real receiver first checks the provider's signature (e.g. the Stripe-Signature header) and rejects forgeries.

The other way round, as an API that *receives* retries (POST /charges, with a client's Idempotency-Key header, the
way Stripe's API takes them): dedup.claim() records the key with the request's fingerprint, the charge and
dedup.complete() with the HTTP response commit together, and a retry gets the stored response back, byte for byte:
  - 201 and the response for a new key; the same status and body again for a retry (header Idempotent-Replayed);
  - 409 while another request with the key is being processed (claim(..., wait => false) answers at once);
  - 422 when the key comes back with another body (SQLSTATE PD001: a key is for one request only).

    DATABASE_URL="host=/var/run/postgresql dbname=shop" python3 webhook.py --port 8000
    curl -X POST localhost:8000/webhook -d '{"id": "evt_1", "type": "payment.succeeded",
                                            "data": {"account": 3, "amount": 120}}'
    curl -X POST localhost:8000/charges -H 'Idempotency-Key: k1' -d '{"account": 3, "amount": 120}'
"""

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from psycopg.types.json import Jsonb

INBOX = "webhooks"
KEYS = "idempotency_keys"
# An empty conninfo means libpq's defaults and PG* environment variables.
DATABASE_URL = os.environ.get("DATABASE_URL", "")
ID_HEADERS = ("webhook-id", "X-GitHub-Delivery")


class BadRequest(Exception):
    pass


def event_id(headers, event):
    for name in ID_HEADERS:
        if headers.get(name):
            return headers[name]
    if isinstance(event.get("id"), str) and event["id"]:
        return event["id"]
    raise BadRequest("no event id")


def apply(conn, key, event):
    """Mark and business write in one transaction. Returns False for a duplicate."""
    with conn.transaction():
        if not conn.execute("SELECT dedup.mark(%s, NULL, %s)", (key, INBOX)).fetchone()[0]:
            return False
        if event.get("type") == "payment.succeeded":
            data = event.get("data") or {}
            try:
                account, amount = int(data["account"]), int(data["amount"])
            except (KeyError, TypeError, ValueError):
                raise BadRequest("payment.succeeded needs data.account and data.amount") from None
            conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account))
        # Other event types: nothing to do, but they are marked too, so their retries are answered at once.
    return True


def charge(conn, key, request):
    """One charge per idempotency key. Returns (status, body text, replayed): the body is stored as the text sent,
    so a replay is the same bytes."""
    try:
        account, amount = int(request["account"]), int(request["amount"])
    except (KeyError, TypeError, ValueError):
        raise BadRequest("a charge needs account and amount") from None
    with conn.transaction():
        state, stored = conn.execute(
            "SELECT state, result FROM dedup.claim(%s, dedup.fingerprint(%s), NULL, %s, wait => false)",
            (key, Jsonb(request), KEYS),
        ).fetchone()
        if state == "completed":
            return stored["status"], stored["body"], True
        if state == "in_progress":
            return 409, json.dumps({"error": "a request with this Idempotency-Key is being processed"}), False
        balance = conn.execute(
            "UPDATE accounts SET balance = balance + %s WHERE id = %s RETURNING balance", (amount, account)
        ).fetchone()
        if balance is None:
            # An answer too: stored, so a retry gets the same 404 (and the rollback-free path keeps it simple).
            response = {"status": 404, "body": json.dumps({"error": f"no account {account}"})}
        else:
            body = {"account": account, "charged": amount, "balance": balance[0]}
            response = {"status": 201, "body": json.dumps(body)}
        conn.execute("SELECT dedup.complete(%s, %s, %s)", (key, Jsonb(response), KEYS))
    return response["status"], response["body"], False


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path == "/charges":
            return self.charges()
        if self.path != "/webhook":
            return self.reply(404, "not found")
        try:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            event = json.loads(body)
            if not isinstance(event, dict):
                raise BadRequest("the payload is not a JSON object")
            key = event_id(self.headers, event)
            # One connection per request keeps the example short; a service would take it from a pool
            # (psycopg_pool.ConnectionPool: `with pool.connection() as conn:`, the rest unchanged).
            with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
                new = apply(conn, key, event)
            self.reply(200, "processed" if new else "duplicate")
        except (ValueError, BadRequest) as e:  # bad JSON (ValueError), missing fields
            self.reply(400, str(e))
        except psycopg.Error as e:
            message = e.diag.message_primary or ""
            if message.startswith("dedup:"):
                # An id pg_dedup refuses (empty, over 2 KiB): the same id will be refused on every retry.
                self.reply(400, message)
            elif isinstance(e, psycopg.OperationalError):
                self.reply(503, "database unavailable")  # connection lost or refused: the provider retries
            else:
                self.log_error("database error: %s", e)
                self.reply(500, "database error")  # rolled back, mark included: the provider's retry redoes it

    def charges(self):
        key = self.headers.get("Idempotency-Key")
        if not key:
            return self.send(400, {"error": "an Idempotency-Key header is required"})
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if not isinstance(request, dict):
                raise BadRequest("the payload is not a JSON object")
            with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
                status, body, replayed = charge(conn, key, request)
            self.send_text(status, body, {"Idempotent-Replayed": "true"} if replayed else {})
        except (ValueError, BadRequest) as e:
            self.send(400, {"error": str(e)})
        except psycopg.Error as e:
            if e.sqlstate == "PD001":  # the key was used for another request: never answer with that one's result
                self.send(422, {"error": "this Idempotency-Key was used with another request"})
            elif (e.diag.message_primary or "").startswith("dedup:"):
                self.send(400, {"error": e.diag.message_primary})
            elif isinstance(e, psycopg.OperationalError):
                self.send(503, {"error": "database unavailable"})
            else:
                self.log_error("database error: %s", e)
                self.send(500, {"error": "database error"})  # rolled back, claim included: a retry redoes it

    def reply(self, status, text):
        self.send(status, {"status": text})

    def send(self, status, payload):
        self.send_text(status, json.dumps(payload))

    def send_text(self, status, text, headers=None):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed on start)")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"listening on http://127.0.0.1:{server.server_port}/webhook", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
