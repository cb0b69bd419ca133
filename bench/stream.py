#!/usr/bin/env python3
"""Streamed responses (docs/design.md §25), idemproxy beside nginx in front of the same
upstream, in one run, on this machine: an upstream that answers every POST with five
server-sent events (bench/slow_upstream.rs --events 5, `--gap-ms` apart, the first at
once, no length), nginx `proxy_pass` with `proxy_buffering off` (the baseline), and
idemproxy with `stream = "auto"` on the memory store and on the default SQLite store,
each request with a fresh idempotency key (bench/loadgen.rs, HTTP/1.1). For each, at
32 and 256 connections: time to the first body byte (TTFB) p50 and p99, to the whole
response p50, requests per second, and the ratios to nginx at the same connection
count. Cases run in alternating rounds, and each figure is the median over the
rounds. Figures, not a test: nothing here asserts a time.

    bench/run.sh builds what this needs; then
    cargo build --release --bin idemproxy --examples && python3 bench/stream.py \
        [--duration SECONDS] [--rounds N] [--connections 32,256] [--gap-ms 2]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import wait_port  # noqa: E402
from common import IDEMPROXY, free_port  # noqa: E402
from load import SLOW, loadgen, nginx_proxy  # noqa: E402


def idemproxy(workdir, name, upstream, store):
    listen, admin = free_port(), free_port()
    config = os.path.join(workdir, f"{name}.toml")
    stores = {
        "memory": 'backend = "memory"\nmax_records = 10000000\nmax_bytes = "8GiB"',
        "sqlite": f'backend = "sqlite"\npath = "{os.path.join(workdir, name + ".db")}"',
    }
    with open(config, "w") as f:
        f.write(textwrap.dedent("""
            [server]
            listen = "127.0.0.1:{listen}"
            [admin]
            listen = "127.0.0.1:{admin}"
            [store]
            {store}
            [[route]]
            name = "chat"
            path_prefix = "/v1/chat"
            upstream = "http://127.0.0.1:{upstream}"
            [route.idempotency]
            stream = "auto"
            """).format(listen=listen, admin=admin, store=stores[store], upstream=upstream))
    process = subprocess.Popen([IDEMPROXY, "serve", "--config", config], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    wait_port(listen, what="idemproxy")
    return process, listen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", default="32,256")
    parser.add_argument("--gap-ms", type=int, default=2)
    args = parser.parse_args()
    connections = [int(c) for c in args.connections.split(",")]
    workdir = tempfile.mkdtemp(prefix="idemproxy-stream-bench-")
    upstream_port = free_port()
    upstream = subprocess.Popen([SLOW, "--port", str(upstream_port), "--delay-ms", "0", "--events", "5",
                                 "--gap-ms", str(args.gap_ms), "--threads", "1"], stdout=subprocess.DEVNULL)
    wait_port(upstream_port, what="the event-stream upstream")
    nginx, nginx_port, _ = nginx_proxy(workdir, "nginx-sse", upstream_port, max(connections) * 2 + 256,
                                       buffering=False)
    memory, memory_port = idemproxy(workdir, "memory", upstream_port, "memory")
    sqlite, sqlite_port = idemproxy(workdir, "sqlite", upstream_port, "sqlite")
    targets = [("nginx proxy_pass, proxy_buffering off", nginx_port),
               ("idemproxy, memory store", memory_port),
               ("idemproxy, SQLite store (the default)", sqlite_port)]
    results = {}
    try:
        for _ in range(args.rounds):
            for conns in connections:
                for label, port in targets:
                    result = loadgen(f"http://127.0.0.1:{port}/v1/chat", conns, args.duration, "fresh")
                    results.setdefault((label, conns), []).append(result)
    finally:
        for process in (memory, sqlite, nginx, upstream):
            process.terminate()
            process.wait()
    median = lambda rows, field: statistics.median(row[field] for row in rows)  # noqa: E731
    print(f"\n### Server-sent events: 5 events {args.gap_ms} ms apart, fresh keys, HTTP/1.1 "
          f"(median of {args.rounds} rounds of {args.duration:g} s)\n")
    print("| case | conns | req/s | TTFB p50 ms | TTFB p99 ms | whole p50 ms | non-2xx | errors "
          "| vs nginx: req/s | TTFB p99 − nginx's, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for conns in connections:
        base = results[(targets[0][0], conns)]
        for label, _ in targets:
            rows = results[(label, conns)]
            rps, p99 = median(rows, "rps"), median(rows, "ttfb_p99_ms")
            non2xx = sum(sum(v for k, v in row["status"].items() if not k.startswith("2")) for row in rows)
            errors = sum(row["errors"] for row in rows)
            print(f"| {label} | {conns} | {rps:,.0f} | {median(rows, 'ttfb_p50_ms'):.2f} | {p99:.2f} | "
                  f"{median(rows, 'p50_ms'):.2f} | {non2xx} | {errors} | {rps / median(base, 'rps'):.2f}x | "
                  f"{p99 - median(base, 'ttfb_p99_ms'):+.2f} |", flush=True)


if __name__ == "__main__":
    main()
