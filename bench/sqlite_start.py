"""What the SQLite store's index of keys in memory costs at start (issue 54, schema
step 6): a file of N completed records (rows written with Python's sqlite3 as the
proxy writes them), the release binary started on it until /readyz answers, three
times, with its RSS; beside the same on an empty file. And the copy schema step 6
makes of an older file's table, timed on N such rows in a schema-5 table.

    cargo build --release && python3 bench/sqlite_start.py [--records 1000000]

Runs on this machine's disk (under target/). Prints figures; asserts nothing."""

import argparse
import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
import urllib.request

from common import IDEMPROXY, ROOT, free_port, rss_kib

COLUMNS = ("key TEXT NOT NULL{unique}, fingerprint BLOB NOT NULL, expires_at INTEGER NOT NULL, scope INTEGER, "
           "client INTEGER, state TEXT NOT NULL, owner BLOB, lease_until INTEGER, status INTEGER, headers BLOB, "
           "body BLOB, reason TEXT, probe_due INTEGER, probe_give_up INTEGER, probe_key TEXT, "
           "size INTEGER NOT NULL, response_until INTEGER, completed_at INTEGER")
NAMES = ("key, fingerprint, expires_at, scope, client, state, owner, lease_until, status, headers, body, reason, "
         "probe_due, probe_give_up, probe_key, size, response_until, completed_at")


def rows(count):
    """Completed records as the proxy writes them: a hashed key, a small JSON answer."""
    now = int(time.time() * 1000)
    body = b'{"id":"pay_123","amount":100,"currency":"EUR","status":"paid"}'
    headers = b"\x00\x0ccontent-type\x00\x10application/json"
    for n in range(count):
        digest = hashlib.sha256(str(n).encode()).hexdigest()
        yield (f"idemproxy:payments:{{{digest}}}", bytes(32), now + 86_400_000, "completed", 201, headers, body,
               400, now)


def fill(path, table, count):
    conn = sqlite3.connect(path)
    conn.execute("BEGIN")
    conn.executemany(f"INSERT INTO {table} (key, fingerprint, expires_at, state, status, headers, body, size, "
                     "completed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows(count))
    if table == "records":
        conn.execute("UPDATE shares SET records = records + ?, bytes = bytes + ? WHERE kind = 0",
                     (count, 400 * count))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def start(config, admin):
    """Starts the proxy, waits for /readyz: the seconds it took and its RSS then."""
    began = time.monotonic()
    proxy = subprocess.Popen([IDEMPROXY, "serve", "--config", config], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1):
                    break
            except OSError:
                if proxy.poll() is not None:
                    raise SystemExit("the proxy exited before it was ready")
                time.sleep(0.02)
        return time.monotonic() - began, rss_kib(proxy.pid) / 1024
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="idemproxy-start-", dir=os.path.join(ROOT, "target"))
    try:
        database = os.path.join(directory, "records.db")
        admin = free_port()
        config = os.path.join(directory, "proxy.toml")
        with open(config, "w") as f:
            f.write(f'[server]\nlisten = "127.0.0.1:{free_port()}"\n[admin]\nlisten = "127.0.0.1:{admin}"\n'
                    f'[store]\nbackend = "sqlite"\npath = "{database}"\nmax_bytes = "16GiB"\n'
                    'max_records = 50000000\n[[route]]\nname = "payments"\npath_prefix = "/v1/payments"\n'
                    'upstream = "http://127.0.0.1:9"\n')
        empty = [start(config, admin) for _ in range(3)]
        fill(database, "records", args.records)
        full = [start(config, admin) for _ in range(3)]
        size = os.path.getsize(database) / 1e6
        print(f"| file | ready in s (3 starts) | RSS MiB |")
        print(f"|---|---|---|")
        print(f"| empty | {', '.join(f'{s:.2f}' for s, _ in empty)} | {empty[-1][1]:.1f} |")
        print(f"| {args.records:,} records, {size:.0f} MB | {', '.join(f'{s:.2f}' for s, _ in full)} | "
              f"{full[-1][1]:.1f} |")

        older = os.path.join(directory, "v5.db")
        conn = sqlite3.connect(older)
        conn.execute(f"CREATE TABLE records5 ({COLUMNS.format(unique=' UNIQUE')}) STRICT")
        conn.execute("CREATE INDEX records5_expiry ON records5 (expires_at)")
        conn.close()
        fill(older, "records5", args.records)
        conn = sqlite3.connect(older)
        began = time.monotonic()
        conn.execute("BEGIN")
        conn.execute(f"CREATE TABLE records6 ({COLUMNS.format(unique='')}) STRICT")
        conn.execute(f"INSERT INTO records6 (rowid, {NAMES}) SELECT rowid, {NAMES} FROM records5")
        conn.execute("DROP TABLE records5")
        conn.execute("CREATE INDEX records6_expiry ON records6 (expires_at)")
        conn.execute("COMMIT")
        print(f"\nschema step 6's copy of {args.records:,} records (Python's sqlite3): "
              f"{time.monotonic() - began:.1f} s")
        conn.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
