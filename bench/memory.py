#!/usr/bin/env python3
"""What a recorded response costs the embedded store, as a figure: RSS per MiB of
recorded bodies. An upstream answers GET /big with 512 KiB of distinct random bytes
(with a Content-Length, or chunked with --chunked); 600 distinct keys from 8 clients
are recorded by idemproxy with the memory store; the process's RSS before and after is
compared with the bytes recorded. Keys refused with 503 (the store at max_bytes) are
counted apart and not in the bytes recorded.

Runs the release binary (build it first: cargo build --release), or the one given
with --binary (to compare two builds in one run). Prints figures; asserts nothing.

    python3 bench/memory.py [--keys 600] [--body-kib 512] [--chunked] [--binary PATH ...]
                            [--store 'max_bytes = 1073741824']
"""

import argparse
import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from common import IDEMPROXY, free_port, rss_kib


def upstream(port, body_bytes, chunked):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = os.urandom(body_bytes)
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            if not chunked:
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for at in range(0, len(body), 16 * 1024):
                chunk = body[at:at + 16 * 1024]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(binary, keys, body_bytes, upstream_port, workdir, extra_store):
    port, admin = free_port(), free_port()
    config = os.path.join(workdir, f"memory-{port}.toml")
    with open(config, "w") as f:
        f.write(f"""
[server]
listen = "127.0.0.1:{port}"
[admin]
listen = "127.0.0.1:{admin}"
[store]
backend = "memory"
{extra_store}
[[route]]
name = "big"
path_prefix = "/big"
upstream = "http://127.0.0.1:{upstream_port}"
[route.idempotency]
methods = ["POST", "GET"]
""")
    proxy = subprocess.Popen([binary, "serve", "--config", config], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    try:
        deadline = time.time() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit(f"bench: {binary} did not start")
                time.sleep(0.05)
        time.sleep(0.5)
        before = rss_kib(proxy.pid)

        def fetch(n):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/big",
                                             headers={"Idempotency-Key": f"big-{n}"})
            try:
                with urllib.request.urlopen(request) as response:
                    return response.status, len(response.read())
            except urllib.error.HTTPError as error:
                return error.code, 0

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(fetch, range(keys)))
        time.sleep(0.5)
        after = rss_kib(proxy.pid)
        ok = sum(1 for status, length in results if status == 200 and length == body_bytes)
        full = sum(1 for status, _ in results if status == 503)
        return before, after, ok, full
    finally:
        proxy.terminate()
        proxy.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=600)
    parser.add_argument("--body-kib", type=int, default=512)
    parser.add_argument("--chunked", action="store_true", help="the upstream sends no Content-Length")
    parser.add_argument("--binary", action="append")
    parser.add_argument("--store", default="", help="extra [store] lines, e.g. 'max_bytes = 1073741824'")
    args = parser.parse_args()
    binaries = args.binary or [IDEMPROXY]
    body_bytes = args.body_kib * 1024
    upstream_port = free_port()
    server = upstream(upstream_port, body_bytes, args.chunked)
    print(f"| binary | answered 200 in full | 503 | RSS before | RSS after | bodies recorded | RSS per recorded MiB |")
    print(f"|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="idemproxy-memory-") as workdir:
        for binary in binaries:
            before, after, ok, full = run(binary, args.keys, body_bytes, upstream_port, workdir, args.store)
            recorded_mib = ok * body_bytes / 2**20
            per_mib = (after - before) / 1024 / recorded_mib if ok else float("nan")
            print(f"| {binary} | {ok} / {args.keys} | {full} | {before / 1024:.0f} MiB | {after / 1024:.0f} MiB | "
                  f"{recorded_mib:.0f} MiB | {per_mib:.2f} MiB |")
    server.shutdown()


if __name__ == "__main__":
    main()
