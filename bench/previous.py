#!/usr/bin/env python3
"""What `[store.previous]` costs a fresh key during a switch between shared stores, as
figures: every fresh key misses in the store, wins its claim there, and is looked up in
the previous store (where it is absent) before it is forwarded. Four idemproxy
instances side by side in one run, in front of the same upstream (bench/slow_upstream.rs
with no delay): Postgres alone, Postgres reading Redis as its previous store, Redis
alone, Redis reading Postgres. Each round gives each instance the same closed-loop load
of fresh keys (bench/loadgen.rs, HTTP/1.1) at each connection count, in turn; the
figures are the medians over the rounds: req/s and the latency p50/p99, and the extra
p50 of the miss. Redis runs without persistence, Postgres with its defaults. Runs the
release binaries (cargo build --release --examples --bins). Prints figures; asserts
nothing.

    python3 bench/previous.py [--duration 4] [--rounds 3] [--connections 1,32]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(__file__))
from bench import Postgres, wait_port  # noqa: E402
from common import IDEMPROXY, free_port  # noqa: E402
from load import SLOW, loadgen  # noqa: E402


def idemproxy(workdir, name, upstream, store, previous):
    listen, admin = free_port(), free_port()
    config = os.path.join(workdir, f"{name}.toml")
    previous = f"[store.previous]\n{previous}\nuntil = \"2099-01-01T00:00:00Z\"" if previous else ""
    with open(config, "w") as f:
        f.write(textwrap.dedent("""
            [server]
            listen = "127.0.0.1:{listen}"
            [admin]
            listen = "127.0.0.1:{admin}"
            [store]
            {store}
            timeout = "2s"
            {previous}
            [[route]]
            name = "payments"
            path_prefix = "/v1/payments"
            upstream = "http://127.0.0.1:{upstream}"
            [route.idempotency]
            retention = "1h"
            """).format(listen=listen, admin=admin, store=store, previous=previous, upstream=upstream))
    process = subprocess.Popen([IDEMPROXY, "serve", "--config", config], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    wait_port(listen, what="idemproxy")
    return process, listen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", default="1,32")
    args = parser.parse_args()
    connections = [int(c) for c in args.connections.split(",")]
    workdir = tempfile.mkdtemp(prefix="idemproxy-previous-bench-", dir=os.path.join(os.path.dirname(IDEMPROXY), ".."))
    children = []
    try:
        upstream_port = free_port()
        children.append(subprocess.Popen([SLOW, "--port", str(upstream_port), "--delay-ms", "0", "--threads", "1"],
                                         stdout=subprocess.DEVNULL))
        wait_port(upstream_port, what="the upstream")
        redis_port = free_port()
        children.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL))
        wait_port(redis_port, what="redis")
        pg = Postgres(workdir, free_port(), children)
        redis = f'backend = "redis"\nurl = "redis://127.0.0.1:{redis_port}/0"'
        postgres = f'backend = "postgres"\nurl = "postgres://postgres@127.0.0.1:{pg.port}/postgres"'
        targets = []
        for name, store, previous in [("postgres", postgres, None), ("postgres, previous redis", postgres, redis),
                                      ("redis", redis, None), ("redis, previous postgres", redis, postgres)]:
            process, port = idemproxy(workdir, name.replace(", ", "-").replace(" ", "-"), upstream_port, store,
                                      previous)
            children.append(process)
            targets.append((name, port))
        results = {}
        for _ in range(args.rounds):
            for conns in connections:
                for name, port in targets:
                    result = loadgen(f"http://127.0.0.1:{port}/v1/payments", conns, args.duration, "fresh")
                    results.setdefault((name, conns), []).append(result)
        print(f"{'instance':<28} {'conns':>5} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'extra p50':>9}")
        for conns in connections:
            base = {}
            for name, _ in targets:
                runs = results[(name, conns)]
                rps = statistics.median(r["rps"] for r in runs)
                p50 = statistics.median(r["p50_ms"] for r in runs)
                p99 = statistics.median(r["p99_ms"] for r in runs)
                store = name.split(",")[0]
                extra = "" if store == name else f"{p50 - base[store]:+.2f} ms"
                base.setdefault(store, p50)
                statuses = {k: v for r in runs for k, v in r["status"].items()}
                print(f"{name:<28} {conns:>5} {rps:>8.0f} {p50:>7.2f} {p99:>7.2f} {extra:>9}   {statuses}")
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
