#!/usr/bin/env python3
"""User-space instructions per request, idemproxy against nginx, under callgrind.

Wall-clock figures on a shared 2-core machine move by ±10 % between runs; callgrind
counts the instructions a process executes, which repeat to within about 1 % for the
same binary and load whatever else the machine is doing. This runs nginx (proxy_pass
with upstream keep-alive, one worker) and idemproxy (`workers = 1`, the `profiling`
build: release code with line tables) under `valgrind --tool=callgrind` in front of
the same nginx upstream, warms each up, zeroes the counters, sends --requests requests
over --connections keep-alive connections, and reads the dump: instructions per
request (the proxy process only: not the kernel, the client, the upstream or Redis),
the ratio to nginx, and for idemproxy where they go, grouped by crate.

Cases: GET pass-through (idemproxy and nginx), POST with a fresh key every request,
POST replaying one recorded key. Redis is a redis-server of its own.

    bench/instructions.py [--requests 4000] [--connections 16] [--top 0] [--keep]
                          [--store redis|memory] [--binary PATH]

--store memory runs the guarded cases on the memory store instead of Redis. --binary
measures another build of idemproxy (a copy of an earlier `target/profiling/idemproxy`,
say), to compare two builds by their counts. It builds `cargo build --profile
profiling` itself, unless given --binary. Needs valgrind, nginx and
redis-server (bench/run.sh installs the last two).
"""

import argparse
import base64
import collections
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from bench import BODY, nginx_command, start_nginx, wait_port
from common import ROOT, free_port

PROFILING = os.path.join(ROOT, "target", "profiling", "idemproxy")

# Crates by symbol prefix, in the order they are tried: the first match names the group.
GROUPS = [
    ("memcpy/memmove/memset (futures and buffers moved)", re.compile(r"__mem(cpy|move|set)")),
    ("allocator", re.compile(r"^(_?mi_|malloc|free|_int_)")),
    ("hyper-util (server connection)", re.compile(r"^<?hyper_util::")),
    ("hyper + httparse (HTTP/1 codec, dispatch)", re.compile(r"^<?(hyper|httparse)::")),
    ("http (HeaderMap, names, URIs)", re.compile(r"^<?http::")),
    ("redis (client, RESP codec)", re.compile(r"^<?(redis|combine)::")),
    ("SHA-256 (ring: the fingerprint, the record key)", re.compile(r"^<?ring(_core_\w+)?(::|_)")),
    ("tokio (I/O readiness, timers, tasks)", re.compile(r"^<?tokio(_util)?::")),
    ("idemproxy's own code", re.compile(r"^<?idemproxy::")),
    ("std/core/alloc (Instant math, iterators, drops)", re.compile(r"^<?(std|core|alloc)::|Timespec")),
]


def self_costs(path):
    """Instructions executed in each function itself (callees excluded) in a dump
    written with --compress-strings=no."""
    costs = collections.Counter()
    function, after_call = None, False
    with open(path) as dump:
        for line in dump:
            if line.startswith("fn="):
                function = line[3:].strip()
            elif line.startswith("calls="):
                after_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if after_call:
                    after_call = False  # the callee's inclusive cost, counted in the callee
                    continue
                fields = line.split()
                if len(fields) >= 2 and function is not None:
                    costs[function] += int(fields[1])
    return costs


def group(costs):
    groups = collections.Counter()
    for function, cost in costs.items():
        name = next((name for name, pattern in GROUPS if pattern.search(function)), "other (libc, ...)")
        groups[name] += cost
    return groups


def load(port, method, path, key, requests, connections):
    """`requests` requests over `connections` keep-alive connections; every answer must be 2xx.
    key: None (no header), a string (the same key), or "fresh" (a new key each time)."""
    failures = []
    if key not in (None, "fresh") and connections > 1:
        # Record it first: concurrent firsts would meet it in flight (409).
        load(port, method, path, key, 1, 1)

    def client(worker, count):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for n in range(count):
            headers = {"Content-Type": "application/json"}
            if key == "fresh":
                headers["Idempotency-Key"] = f"instr-{os.getpid()}-{time.monotonic_ns()}-{worker}-{n}"
            elif key is not None:
                headers["Idempotency-Key"] = key
            body = b'{"amount":1000}' if method == "POST" else None
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            if not 200 <= response.status < 300:
                failures.append(response.status)
        conn.close()

    share = [requests // connections + (1 if i < requests % connections else 0) for i in range(connections)]
    threads = [threading.Thread(target=client, args=(i, count)) for i, count in enumerate(share)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        sys.exit(f"instructions: {len(failures)} answers were not 2xx (first {failures[0]})")


def measure(command, port, cases, args, workdir, name):
    """Starts `command` under callgrind and returns {case: (instructions/request, groups)}."""
    out = os.path.join(workdir, f"{name}.callgrind")
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--compress-strings=no", "--compress-pos=no",
         f"--callgrind-out-file={out}", *command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    try:
        wait_port(port, timeout=120, what=name)
        results = {}
        for number, (case, method, path, key) in enumerate(cases, start=1):
            load(port, method, path, key, max(200, args.requests // 10), args.connections)  # warm-up
            subprocess.run(["callgrind_control", "-z", str(process.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            load(port, method, path, key, args.requests, args.connections)
            subprocess.run(["callgrind_control", "-d", str(process.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            dump = f"{out}.{number}"
            deadline = time.time() + 30
            while not os.path.exists(dump) and time.time() < deadline:
                time.sleep(0.1)
            costs = self_costs(dump)
            results[case] = (sum(costs.values()) / args.requests, group(costs), costs)
        return results
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest functions per case")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind dumps (for callgrind_annotate)")
    parser.add_argument("--sealed", action="store_true",
                        help="also POST with 1 KiB and 64 KiB response bodies, on idemproxy in clear and with "
                             "[store.encryption]")
    parser.add_argument("--store", choices=("redis", "memory"), default="redis",
                        help="the store of the guarded cases (default redis)")
    parser.add_argument("--binary", help="an idemproxy build to measure instead of building the profiling one")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if not shutil.which(tool):
            sys.exit(f"instructions: {tool} is missing")
    binary = args.binary or PROFILING
    if not args.binary:
        subprocess.run(["cargo", "build", "--profile", "profiling", "--locked", "--bin", "idemproxy"],
                       cwd=ROOT, check=True)
    store = 'backend = "memory"' if args.store == "memory" else 'backend = "redis"\nurl = "redis://127.0.0.1:{}/0"'

    workdir = tempfile.mkdtemp(prefix="idemproxy-instructions-")
    os.chmod(workdir, 0o755)
    ports = {name: free_port() for name in ("upstream", "nginx", "idemproxy", "admin", "redis")}
    children = []
    try:
        children.append(subprocess.Popen(
            ["redis-server", "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        children.append(start_nginx(workdir, "upstream", textwrap.dedent(f"""
            server {{
              listen 127.0.0.1:{ports["upstream"]};
              location / {{ default_type application/json; return 201 '{BODY}'; }}
              location ~ ^/v1/payments/(1k|64k)$ {{
                root {workdir}/bodies; default_type application/octet-stream; error_page 405 =201 $uri;
              }}
            }}"""), workers=1))
        os.makedirs(os.path.join(workdir, "bodies", "v1", "payments"))
        for name, size in (("1k", 1024), ("64k", 64 * 1024)):
            with open(os.path.join(workdir, "bodies", "v1", "payments", name), "w") as f:
                f.write("x" * size)
        for name in ("redis", "upstream"):
            wait_port(ports[name], what=name)

        # nginx as in bench.py, but one process (no master) so callgrind sees it all.
        command = nginx_command(workdir, "proxy", textwrap.dedent(f"""
            upstream backend {{ server 127.0.0.1:{ports["upstream"]}; keepalive 256; }}
            server {{
              listen 127.0.0.1:{ports["nginx"]};
              location / {{ proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }}
            }}"""), workers=1, master=False)
        nginx = measure(command, ports["nginx"],
                        [("GET pass-through", "GET", "/v1/payments", None)], args, workdir, "nginx")

        def idemproxy_config(name, extra=""):
            config = os.path.join(workdir, f"{name}.toml")
            with open(config, "w") as f:
                f.write(textwrap.dedent(f"""
                [server]
                listen = "127.0.0.1:{ports["idemproxy"]}"
                workers = 1
                [admin]
                listen = "127.0.0.1:{ports["admin"]}"
                [store]
                {store.format(ports["redis"]).replace(chr(10), chr(10) + " " * 16)}
                timeout = "30s"
                [[route]]
                name = "payments"
                path_prefix = "/v1/payments"
                upstream = "http://127.0.0.1:{ports["upstream"]}"
                upstream_timeout = "30s"
                [route.idempotency]
                """).replace("[[route]]", extra + "\n[[route]]"))
            return config
        bodies = [(f"POST, fresh key, {size}", "POST", f"/v1/payments/{size.replace(' KiB', 'k')}", "fresh")
                  for size in ("1 KiB", "64 KiB")]
        bodies += [(f"POST, replay, {size}", "POST", f"/v1/payments/{size.replace(' KiB', 'k')}",
                    f"instructions-replay-{size.replace(' KiB', 'k')}") for size in ("1 KiB", "64 KiB")]
        idemproxy = measure(
            [binary, "serve", "--config", idemproxy_config("idemproxy")], ports["idemproxy"],
            [("GET pass-through", "GET", "/v1/payments", None),
             ("POST, fresh key", "POST", "/v1/payments", "fresh"),
             ("POST, replay", "POST", "/v1/payments", "instructions-replay")]
            + (bodies if args.sealed else []),
            args, workdir, "idemproxy")
        sealed = {}
        if args.sealed:
            os.environ["INSTRUCTIONS_RECORD_KEY"] = base64.b64encode(os.urandom(32)).decode()
            config = idemproxy_config("sealed", 'key_prefix = "sealed"\n')
            with open(config, "a") as f:
                f.write('\n[store.encryption]\nkey_env = "INSTRUCTIONS_RECORD_KEY"\n')
            sealed = measure([binary, "serve", "--config", config], ports["idemproxy"], bodies, args, workdir,
                             "sealed")
    finally:
        for child in reversed(children):
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(timeout=10)
        if args.keep:
            print(f"instructions: the dumps are in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    baseline = nginx["GET pass-through"][0]
    print(f"\nUser-space instructions per request (callgrind; {args.requests} requests over "
          f"{args.connections} connections after a warm-up)\n")
    print(f"{'case':<34}{'instructions/req':>18}{'vs nginx':>10}")
    print(f"{'nginx proxy_pass, GET':<34}{baseline:>18,.0f}{1:>9.2f}×")
    for case, (per_request, _, _) in idemproxy.items():
        print(f"{'idemproxy ' + case:<34}{per_request:>18,.0f}{per_request / baseline:>9.2f}×")
    for case, (per_request, _, _) in sealed.items():
        clear = idemproxy[case][0]
        print(f"{'idemproxy ' + case + ', sealed':<34}{per_request:>18,.0f}{per_request / baseline:>9.2f}×"
              f"   {per_request - clear:+,.0f} ({per_request / clear - 1:+.1%}) vs in clear")
    for case, (per_request, groups, costs) in idemproxy.items():
        total = sum(groups.values())
        print(f"\nidemproxy {case}: where the {per_request:,.0f} instructions go")
        for name, cost in groups.most_common():
            print(f"  {cost / args.requests:>8,.0f}  {100 * cost / total:5.1f} %  {name}")
        for function, cost in costs.most_common(args.top):
            print(f"  {cost / args.requests:>8,.0f}  {function[:110]}")


if __name__ == "__main__":
    main()
