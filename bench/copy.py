#!/usr/bin/env python3
"""How fast `idemproxy store copy` moves records between each pair of backends, as
figures: records/s for SQLite -> Postgres, SQLite -> Redis, Postgres -> Redis, Redis ->
Postgres, Redis -> SQLite and Postgres -> SQLite, each from a source seeded with
--records completed records (bench/copy_seed.rs), and what a stop takes for 1 and 10
million records at that rate. Redis runs without persistence, Postgres with its
defaults (fsync on) and SQLite on this machine's disk. Runs the release binaries
(build them first: cargo build --release --examples --bins). Prints figures; asserts
nothing.

    python3 bench/copy.py [--records 1000000] [--pairs sqlite-postgres,redis-sqlite,...]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench import Postgres
from common import IDEMPROXY, free_port

SEED = os.path.join(os.path.dirname(IDEMPROXY), "examples", "copy-seed")


def config(path, store):
    with open(path, "w") as f:
        f.write(f"""
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
{store}
timeout = "30s"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
upstream = "http://127.0.0.1:9"
[route.idempotency]
retention = "1h"
""")
    return path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--pairs", default="sqlite-postgres,sqlite-redis,postgres-redis,redis-postgres,redis-sqlite,"
                                           "postgres-sqlite")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="copy-bench-", dir=os.path.join(os.path.dirname(IDEMPROXY), ".."))
    children = []
    try:
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        children.append(redis)
        pg = Postgres(work, free_port(), children)
        stores = {
            "sqlite": lambda n: f'backend = "sqlite"\npath = "{work}/records-{n}.db"\nmax_bytes = "64GiB"\n'
                                f'max_records = 100000000',
            "postgres": lambda n: f'backend = "postgres"\nurl = "postgres://postgres@127.0.0.1:{pg.port}/postgres"\nschema = "s{n}"',
            "redis": lambda n: f'backend = "redis"\nurl = "redis://127.0.0.1:{redis_port}/{n}"',
        }
        pairs = [tuple(pair.split("-")) for pair in args.pairs.split(",")]
        print(f"{'from':<10} {'to':<10} {'records':>9} {'seconds':>8} {'records/s':>10} {'1 M':>8} {'10 M':>8}")
        for n, (source, target) in enumerate(pairs):
            time.sleep(0.5)
            src = config(f"{work}/from-{n}.toml", stores[source](2 * n))
            dst = config(f"{work}/to-{n}.toml", stores[target](2 * n + 1))
            subprocess.run([SEED, src, str(args.records)], check=True, stdout=subprocess.DEVNULL)
            started = time.monotonic()
            out = subprocess.run([IDEMPROXY, "store", "copy", "--from", src, "--to", dst], check=True,
                                 capture_output=True, text=True)
            seconds = time.monotonic() - started
            rate = args.records / seconds
            print(f"{source:<10} {target:<10} {args.records:>9} {seconds:>8.1f} {rate:>10.0f} "
                  f"{1e6 / rate:>7.0f}s {1e7 / rate:>7.0f}s   ({out.stdout.strip()})", flush=True)
            subprocess.run(["redis-cli", "-p", str(redis_port), "FLUSHALL"], check=True, stdout=subprocess.DEVNULL)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
