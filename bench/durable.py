#!/usr/bin/env python3
"""What the SQLite store's file costs the process, as figures: its peak RSS serving a
file that holds 1 GiB of records against the same load on an empty file, and the time
from start to a ready /readyz on each (the start inspects the file, `PRAGMA
quick_check` included).

An upstream answers POST /big with 64 KiB of distinct random bytes. First the file is
filled: --fill-mib of recorded bodies (distinct keys from 8 clients) through one
proxy, which is then stopped. Then, for the full file and for an empty one, a fresh
proxy is started and given the same load: --keys fresh keys and as many replays of
keys the file already holds (on the empty file, of keys recorded in the same run).
The peak RSS is the process's VmHWM. The file lives under target/, on this machine's
disk. Runs the release binary (build it first: cargo build --release). Prints figures;
asserts nothing.

    python3 bench/durable.py [--fill-mib 1024] [--keys 2000] [--cache '32MiB']
"""

import argparse
import http.server
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from common import IDEMPROXY, free_port

BODY_BYTES = 64 * 1024


def upstream(port):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", "0")))
            body = os.urandom(BODY_BYTES)
            self.send_response(201)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Proxy:
    def __init__(self, workdir, path, upstream_port, cache):
        self.port, self.admin = free_port(), free_port()
        config = os.path.join(workdir, f"durable-{self.port}.toml")
        with open(config, "w") as f:
            f.write(f"""
[server]
listen = "127.0.0.1:{self.port}"
max_guarded_requests = 1024
[admin]
listen = "127.0.0.1:{self.admin}"
[store]
backend = "sqlite"
path = "{path}"
max_bytes = "2GiB"
cache_bytes = "{cache}"
timeout = "5s"
[[route]]
name = "big"
path_prefix = "/big"
upstream = "http://127.0.0.1:{upstream_port}"
[route.idempotency]
retention = "7d"
max_response_body_bytes = 131072
""")
        started = time.monotonic()
        self.process = subprocess.Popen([IDEMPROXY, "serve", "--config", config], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, env={**os.environ, "RUST_LOG": "warn"})
        deadline = started + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if self.process.poll() is not None:
                sys.exit(f"bench: the proxy exited: {self.process.stderr.read().decode()}")
            if time.monotonic() > deadline:
                sys.exit("bench: the proxy was not ready within 300 s")
            time.sleep(0.02)
        self.ready_seconds = time.monotonic() - started

    def post(self, key):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/big", data=b"{}", method="POST",
                                         headers={"Idempotency-Key": key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.headers.get("idempotent-replayed") == "true", len(response.read())
        except urllib.error.HTTPError as error:
            return error.code, False, 0

    def load(self, keys):
        """Posts each key (8 at a time); returns how many got 201 in full, and how many
        of those were replays."""
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(self.post, keys))
        ok = [replayed for status, replayed, length in results if status == 201 and length == BODY_BYTES]
        return len(ok), sum(ok)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fill-mib", type=int, default=1024)
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--cache", default="32MiB")
    args = parser.parse_args()
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target")
    os.makedirs(target, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="idemproxy-durable-", dir=target)
    upstream_port = free_port()
    server = upstream(upstream_port)
    try:
        full_path = os.path.join(workdir, "full.db")
        filled = args.fill_mib * 2**20 // BODY_BYTES
        proxy = Proxy(workdir, full_path, upstream_port, args.cache)
        started = time.monotonic()
        ok, _ = proxy.load([f"fill-{n}" for n in range(filled)])
        fill_seconds = time.monotonic() - started
        proxy.stop()
        size = os.path.getsize(full_path)
        print(f"filled: {ok} / {filled} records of 64 KiB in {fill_seconds:.0f} s ({ok / fill_seconds:.0f}/s); "
              f"file {size / 2**20:.0f} MiB")
        print()
        print(f"| file | start to ready /readyz | fresh 201 | replays 201 | RSS after | peak RSS (VmHWM) |")
        print(f"|---|---|---|---|---|---|")
        peaks = {}
        for name, path, replay_from in (("empty", os.path.join(workdir, "empty.db"), None),
                                        ("full", full_path, filled)):
            proxy = Proxy(workdir, path, upstream_port, args.cache)
            fresh = [f"{name}-fresh-{n}" for n in range(args.keys)]
            fresh_ok, _ = proxy.load(fresh)
            pool = [f"fill-{n}" for n in range(replay_from)] if replay_from else fresh
            replay_ok, replayed = proxy.load(random.Random(7).choices(pool, k=args.keys))
            rss, peak = status_kib(proxy.process.pid, "VmRSS"), status_kib(proxy.process.pid, "VmHWM")
            proxy.stop()
            peaks[name] = peak
            size = os.path.getsize(path)
            print(f"| {name} ({size / 2**20:.0f} MiB) | {proxy.ready_seconds:.2f} s | {fresh_ok} / {args.keys} | "
                  f"{replayed} / {args.keys} | {rss / 1024:.1f} MiB | {peak / 1024:.1f} MiB |")
        print()
        print(f"peak RSS, full file against empty: {(peaks['full'] - peaks['empty']) / 1024:+.1f} MiB "
              f"(cache_bytes {args.cache})")
    finally:
        server.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
