#!/usr/bin/env python3
"""Load shaped like a slow legacy API (docs/design.md §13), idemproxy beside nginx in front of
the same upstream, in one run, on this machine:

1. A slow upstream (bench/slow_upstream.rs: 201 after 200 ms or 2 s) under 2,000 and
   10,000 concurrent HTTP/1.1 clients (bench/loadgen.rs), each request with a fresh
   idempotency key, idemproxy on Redis: requests per second, p50 and p99, the 503s,
   and the proxy's peak RSS (VmHWM; nginx: its workers' sum). Then docs/design.md §13's own
   case, open loop: 2,000 requests per second to the 2 s upstream (4,000 in flight)
   over 5,000 connections. idemproxy runs on its defaults (store.timeout 500 ms).
2. HTTP/2 at 32, 256 and 1,000 connections x 10 streams (320, 2,560 and 10,000 in
   flight), replays of one key and fresh keys, idemproxy on Redis, beside nginx's HTTP/2
   pass-through of the same POST, in front of a fast upstream (nginx answering 201):
   requests per second, non-2xx, and the claim's latency p50 and p99 at each (from
   idemproxy_store_operation_seconds{op="claim"}, a histogram with buckets a factor 2
   apart: the figure is the bucket's upper bound).

    cargo build --release --bin idemproxy --examples && python3 bench/load.py \
        [--duration SECONDS] [--only slow|h2] [--store-connections N] [--store-timeout 2s]

The machine's open-files limit (ulimit -Hn) bounds the 10,000-client case: idemproxy,
one process, holds (limit - 256) / 2 client connections; the others wait in its
backlog (the table says how many were served). Figures, not a test: nothing here
asserts a time.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import start_nginx, wait_port  # noqa: E402
from common import IDEMPROXY, ROOT, free_port  # noqa: E402

EXAMPLES = os.path.join(ROOT, "target", "release", "examples")
LOADGEN = os.path.join(EXAMPLES, "loadgen")
SLOW = os.path.join(EXAMPLES, "slow-upstream")


def peak_kib(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass
    return total


def children_of(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def metrics(admin):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as response:
        return response.read().decode()


def claim_buckets(text):
    """The claim histogram's cumulative bucket counts, by upper bound."""
    buckets = {}
    for line in text.splitlines():
        match = re.match(r'idemproxy_store_operation_seconds_bucket\{le="([^"]+)",op="claim",result="ok"\} (\S+)', line)
        if match:
            bound = float("inf") if match.group(1) == "+Inf" else float(match.group(1))
            buckets[bound] = float(match.group(2))
    return buckets


def quantile(before, after, q):
    """The upper bound of the bucket holding the q-th claim between two scrapes."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    for bound, count in zip(bounds, counts):
        if count >= q * total:
            return bound
    return bounds[-1]


def redis_cpu(port):
    """Redis's CPU seconds so far (INFO cpu: user and system)."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "cpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return float(fields.get("used_cpu_user", 0)) + float(fields.get("used_cpu_sys", 0))


def loadgen(url, connections, duration, keys, h2=False, streams=1, rate=0):
    args = [LOADGEN, "--url", url, "--connections", str(connections), "--duration", str(duration),
            "--keys", keys, "--threads", "1"]
    if rate:
        args += ["--rate", str(rate)]
    if h2:
        args += ["--h2", "--streams", str(streams)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=duration * 4 + 120)
    if out.returncode != 0:
        sys.exit(f"load: loadgen failed: {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def idemproxy(workdir, name, upstream, redis, store_connections, store_timeout=None):
    listen, admin = free_port(), free_port()
    config = os.path.join(workdir, f"{name}.toml")
    with open(config, "w") as f:
        f.write(textwrap.dedent(f"""
            [server]
            listen = "127.0.0.1:{listen}"
            [admin]
            listen = "127.0.0.1:{admin}"
            [store]
            backend = "redis"
            url = "redis://127.0.0.1:{redis}"
            connections = {store_connections}
            {f'timeout = "{store_timeout}"' if store_timeout else ""}
            [[route]]
            name = "payments"
            path_prefix = "/v1/payments"
            upstream = "http://127.0.0.1:{upstream}"
            [route.idempotency]
            """))
    process = subprocess.Popen([IDEMPROXY, "serve", "--config", config], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    wait_port(listen, what="idemproxy")
    wait_port(admin, what="idemproxy's admin")
    return process, listen, admin


def nginx_proxy(workdir, name, upstream, connections, buffering=True):
    """nginx proxy_pass to `upstream` with keep-alive, on HTTP/1.1 and HTTP/2 (h2c);
    with `buffering` off, each response is passed on as it comes (bench/stream.py)."""
    port, h2 = free_port(), free_port()
    unbuffered = "" if buffering else "proxy_buffering off;"
    process = start_nginx(workdir, name, textwrap.dedent(f"""
        upstream backend {{
          server 127.0.0.1:{upstream};
          keepalive 1024;
        }}
        server {{
          listen 127.0.0.1:{port} reuseport backlog=4096;
          location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 30s;
            {unbuffered}
          }}
        }}
        server {{
          listen 127.0.0.1:{h2} http2 reuseport backlog=4096;
          location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
          }}
        }}"""), workers=2, connections=connections)
    wait_port(port, what="nginx")
    return process, port, h2


def row(label, result, rss_mib, rejected=None, extra=""):
    statuses = result["status"]
    ok = sum(v for k, v in statuses.items() if k.startswith("2"))
    non2xx = sum(v for k, v in statuses.items() if not k.startswith("2"))
    five = statuses.get("503", 0)
    print(f"| {label} | {result['rps']:,.0f} | {result['p50_ms']:.0f} | {result['p99_ms']:.0f} | {ok:,} | "
          f"{non2xx:,} | {five:,} | {result['errors']:,} | {rss_mib:.0f} |{extra}", flush=True)


def slow_cases(workdir, args, redis):
    print("\n### A slow upstream, HTTP/1.1, fresh keys, Redis\n")
    print("| case | req/s | p50 ms | p99 ms | 2xx | non-2xx | 503 | errors | peak RSS MiB | claim p50 ms | claim p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for delay, clients_list, rate in ((200, (2000, 10000), 0), (2000, (2000, 10000), 0), (2000, (5000,), 2000)):
        upstream_port = free_port()
        upstream = subprocess.Popen([SLOW, "--port", str(upstream_port), "--delay-ms", str(delay), "--threads", "1"],
                                    stdout=subprocess.DEVNULL)
        wait_port(upstream_port, what="the slow upstream")
        for clients in clients_list:
            duration = max(args.duration, delay * 5 // 1000)
            shape = f"{rate:,} req/s open loop over {clients:,} connections" if rate else f"{clients:,} clients"
            # nginx: its two workers, and the same upstream.
            nginx, port, _ = nginx_proxy(workdir, f"nginx-{delay}-{clients}", upstream_port, clients + 256)
            time.sleep(0.5)
            result = loadgen(f"http://127.0.0.1:{port}/v1/payments", clients, duration, "fresh", rate=rate)
            rss = peak_kib(children_of(nginx.pid)) / 1024
            row(f"nginx, {delay} ms upstream, {shape}", result, rss)
            nginx.terminate()
            nginx.wait()
            proxy, listen, admin = idemproxy(workdir, f"idemproxy-{delay}-{clients}", upstream_port, redis,
                                             args.store_connections, args.store_timeout)
            before = claim_buckets(metrics(admin))
            result = loadgen(f"http://127.0.0.1:{listen}/v1/payments", clients, duration, "fresh", rate=rate)
            after = claim_buckets(metrics(admin))
            rss = peak_kib([proxy.pid]) / 1024
            p50, p99 = quantile(before, after, 0.5), quantile(before, after, 0.99)
            extra = f" {p50 * 1000:.1f} | {p99 * 1000:.1f} |" if p50 is not None else " - | - |"
            row(f"idemproxy, {delay} ms upstream, {shape}", result, rss, extra=extra)
            proxy.terminate()
            proxy.wait()
        upstream.terminate()
        upstream.wait()


def h2_cases(workdir, args, redis):
    print("\n### HTTP/2, 10 streams a connection, Redis, a fast upstream\n")
    print("| case | req/s | p50 ms | p99 ms | 2xx | non-2xx | 503 | errors | peak RSS MiB | claim p50 ms | claim p99 ms | Redis CPU % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    upstream_port = free_port()
    upstream = start_nginx(workdir, "fast-upstream", textwrap.dedent(f"""
        server {{
          listen 127.0.0.1:{upstream_port} reuseport;
          location / {{ default_type application/json; return 201 '{{"ok":true}}'; }}
        }}"""), workers=1, connections=8192)
    wait_port(upstream_port, what="the fast upstream")
    nginx, _, nginx_h2 = nginx_proxy(workdir, "nginx-h2", upstream_port, 12000)
    proxy, listen, admin = idemproxy(workdir, "idemproxy-h2", upstream_port, redis, args.store_connections,
                                     args.store_timeout)
    try:
        for connections in (32, 256, 1000):
            result = loadgen(f"http://127.0.0.1:{nginx_h2}/v1/payments", connections, args.duration, "none", True, 10)
            row(f"nginx HTTP/2 pass-through, {connections} x 10", result, peak_kib(children_of(nginx.pid)) / 1024)
            for keys, label in (("fixed", "replays of one key"), ("fresh", "fresh keys")):
                before, cpu = claim_buckets(metrics(admin)), redis_cpu(redis)
                result = loadgen(f"http://127.0.0.1:{listen}/v1/payments", connections, args.duration, keys, True, 10)
                after, cpu = claim_buckets(metrics(admin)), redis_cpu(redis) - cpu
                p50, p99 = quantile(before, after, 0.5), quantile(before, after, 0.99)
                busy = 100 * cpu / result["seconds"]
                extra = f" {p50 * 1000:.1f} | {p99 * 1000:.1f} | {busy:.0f} |" if p50 is not None else " - | - | - |"
                row(f"idemproxy HTTP/2 {label}, {connections} x 10", result, peak_kib([proxy.pid]) / 1024,
                    extra=extra)
    finally:
        for process in (proxy, nginx, upstream):
            process.terminate()
            process.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--only", choices=["slow", "h2"])
    parser.add_argument("--store-connections", type=int, default=1)
    parser.add_argument("--store-timeout", help='store.timeout for idemproxy, e.g. "2s" (default: its default)')
    args = parser.parse_args()
    for binary in (IDEMPROXY, LOADGEN, SLOW):
        if not os.path.exists(binary):
            sys.exit(f"load: {binary} is missing: cargo build --release --bin idemproxy --examples")
    workdir = tempfile.mkdtemp(prefix="idemproxy-load-")
    os.chmod(workdir, 0o755)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--maxclients", "20000", "--dir", workdir],
                             stdout=subprocess.DEVNULL)
    wait_port(redis_port, what="redis")
    print(f"load: {time.strftime('%Y-%m-%d %H:%M')}, open-files limit {os.sysconf('SC_OPEN_MAX')}, "
          f"store.connections = {args.store_connections}, store.timeout = {args.store_timeout or 'the default'}")
    try:
        if args.only in (None, "slow"):
            slow_cases(workdir, args, redis_port)
        if args.only in (None, "h2"):
            h2_cases(workdir, args, redis_port)
    finally:
        redis.terminate()
        redis.wait()


if __name__ == "__main__":
    main()
