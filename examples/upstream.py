#!/usr/bin/env python3
"""A toy upstream for trying idemproxy by hand: answers every method with 201 and a
JSON body that counts executions, so a replay is easy to tell from a second run.

    python3 examples/upstream.py [PORT [HOST]]   (default 9000 on 127.0.0.1)

`?sleep=SECONDS` (or an `X-Sleep: SECONDS` header, which is not part of the request's
fingerprint) holds the answer, to see 409 request-in-progress, or an upstream timeout.
"""
import itertools
import json
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

COUNTER = itertools.count(1)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        query = parse_qs(urlparse(self.path).query)
        time.sleep(float(query.get("sleep", [self.headers.get("x-sleep") or "0"])[0]))
        out = json.dumps({
            "execution": next(COUNTER),
            "method": self.command,
            "path": self.path,
            "received_bytes": len(body),
        }).encode() + b"\n"
        self.send_response(201)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = answer


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    # As a container's PID 1, Python gets no default action for SIGTERM: stop on it,
    # so that `docker compose stop` does not wait out its grace and kill.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"toy upstream on http://{host}:{port}", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()
