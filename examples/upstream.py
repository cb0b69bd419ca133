#!/usr/bin/env python3
"""A toy upstream for trying idemproxy by hand: answers every method with 201 and a
JSON body that counts executions, so a replay is easy to tell from a second run.

    python3 examples/upstream.py [PORT [HOST]]   (default 9000 on 127.0.0.1)

`?sleep=SECONDS` (or an `X-Sleep: SECONDS` header, which is not part of the request's
fingerprint) holds the answer, to see 409 request-in-progress, or an upstream timeout.

It remembers what each `Idempotency-Key` did, from the moment the request arrives, and
answers a reconciliation probe's lookup: `GET /v1/payments/by-key/KEY` is 200 with that
execution's body, or 404 when no request with KEY took effect. `X-Effect: never` makes
a request that is executed (and answered) but never takes effect: a payment lost
before it committed.
"""
import itertools
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

COUNTER = itertools.count(1)
LOOKUP = "/v1/payments/by-key/"
# What each idempotency key did: the body its execution answered with.
EFFECTS = {}
EFFECTS_LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def send(self, status, out):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    def lookup(self):
        key = unquote(urlparse(self.path).path[len(LOOKUP):])
        with EFFECTS_LOCK:
            found = EFFECTS.get(key)
        if found is None:
            self.send(404, b'{"found": false}\n')
        else:
            self.send(200, found)

    def answer(self):
        if self.command in ("GET", "HEAD") and self.path.startswith(LOOKUP):
            return self.lookup()
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        query = parse_qs(urlparse(self.path).query)
        out = json.dumps({
            "execution": next(COUNTER),
            "method": self.command,
            "path": self.path,
            "received_bytes": len(body),
        }).encode() + b"\n"
        key = self.headers.get("idempotency-key")
        if key is not None and self.headers.get("x-effect") != "never":
            with EFFECTS_LOCK:
                EFFECTS[key] = out
        time.sleep(float(query.get("sleep", [self.headers.get("x-sleep") or "0"])[0]))
        self.send(201, out)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = answer


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    # As a container's PID 1, Python gets no default action for SIGTERM: stop on it,
    # so that `docker compose stop` does not wait out its grace and kill.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"toy upstream on http://{host}:{port}", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()
