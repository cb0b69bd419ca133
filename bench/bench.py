#!/usr/bin/env python3
"""idemproxy against nginx, side by side, on loopback. Prints one table.

Everything runs on this machine: nginx as the upstream (201 + a fixed JSON body for
any method), nginx as a plain proxy_pass reverse proxy with upstream keep-alive (the
baseline), idemproxy with the Redis store on its own redis-server, and wrk with one
thread as the load. Cases run in alternating rounds (a b c d e f, a b c d e f, ...),
and each figure is the median over the rounds. Ratios are to the nginx proxy (b) at
the same connection count, from the same run.

Besides requests/s and latency, each case reports, per request: Redis read events
(INFO stats total_reads_processed: below one per round trip when the proxy's
multiplexed connections send several requests' commands in one write), Redis commands (INFO commandstats, those
scripts run included), and the Redis process's CPU time (user + system from INFO cpu,
network I/O included): what one request costs the store. Cases (i) to (p) answer with
1 KiB and 64 KiB bodies, each compared with nginx serving the same body; (m) and (n)
are HTTP/2 (h2c, prior knowledge) through h2load with 10 streams per connection,
against nginx with `http2` on, in front of the same upstream.

Run it through bench/run.sh, which builds the release binary and installs what is
missing. Options: --duration SECONDS per case and round (default 5), --rounds N
(default 3), --connections LIST (default 32,256), --cluster (also run cases (g) and (h)
against a second idemproxy on a Redis Cluster of three primaries and three replicas),
--traces (also run cases (q) to (t): tracing on at sample ratios 1.0 and 0.01, beside
(c) and (d) with tracing off), --stores (also run cases (u) to (x): fresh keys and
replays on the memory store and on the SQLite store, beside (d) and (e) on Redis, with
the SQLite store's commits and fsyncs per second), --sealed (also run fresh keys and
replays with 1 KiB and 64 KiB bodies on an idemproxy with [store.encryption], beside
the same cases in clear), --postgres (also run fresh keys and replays on the Postgres
store, beside (d) and (e) on Redis, with statements and Postgres CPU per request, and
pgbench on the same server in the same rounds: (gf) the proxy's own two statements,
(gb) a bare INSERT and UPDATE, (gs) one SELECT, bench/pgbench/*.sql;
--pg-connections N sets its store.connections, default 4), --keys (also run cases (kh)
and (kj): fresh keys with a 1 KiB request body, the key in the header beside the key in
a JSON field of the body),
--remember (also run fresh keys and replays with `remember = "30d"` on every store, beside
the same cases without it: Redis (rd, re vs d, e), memory (ru, rv vs u, v), SQLite (rw, rx
vs w, x) and Postgres (rpf, rpr vs pf, pr), starting those stores as --stores and
--postgres do; and (rs): fresh keys on SQLite with a 3 s retention, so that the sweeper
drops responses all through the run, with what it dropped a second and the proxy's CPU
per request, beside (rw)), --durable (also run (af) and (ae): fresh keys and replays on
Redis with `appendonly yes` and `appendfsync always`, its log on this disk, beside the
--stores cases, with the SQLite writer thread's CPU per write), --calls (also run (jq) and
(jr): replays of the same JSON-RPC answer on the Redis idemproxy, a plain route replaying
its record as it is beside a `jsonrpc_methods` route replaying it with a new `id` on every
request, issue 55's held to 0.9x),
--cases LIST (only these cases, e.g.
b,c,d,q,r,s,t).

Every run also prints where each case's CPU goes per request (the proxy, the upstream,
wrk, Redis or Postgres) and the cores kept busy: on two shared cores a case's rate is
about the busy cores over that total, so the table says which process holds a case back.
Case (bf) is nginx proxying the same keyed POSTs as (d) and (u), made by the same wrk
script; with it among the cases, the keyed POSTs are also compared with it.
"""

import argparse
import base64
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request

from common import IDEMPROXY, cpu_seconds, free_port, rss_kib
BODY = '{"id":"pay_123","status":"succeeded","amount":1000,"currency":"eur"}'

CASES = [
    ("a", "upstream directly", "upstream", "get.lua", "/v1/payments"),
    ("b", "nginx proxy", "nginx", "get.lua", "/v1/payments"),
    ("bf", "nginx proxy, POST with a fresh key", "nginx", "fresh.lua", "/v1/payments"),
    ("c", "idemproxy GET pass-through", "idemproxy", "get.lua", "/v1/payments"),
    ("d", "idemproxy POST, fresh key", "idemproxy", "fresh.lua", "/v1/payments"),
    ("e", "idemproxy POST, replay", "idemproxy", "replay.lua", "/v1/payments"),
    ("f", "idemproxy POST, no key, required=false", "idemproxy", "nokey.lua", "/v1/orders"),
    ("i", "nginx proxy, 1 KiB body", "nginx", "get.lua", "/v1/payments/1k"),
    ("j", "idemproxy GET pass-through, 1 KiB body", "idemproxy", "get.lua", "/v1/payments/1k"),
    ("k", "idemproxy POST, replay, 1 KiB body", "idemproxy", "replay1k.lua", "/v1/payments/1k"),
    ("l", "nginx proxy, 64 KiB body", "nginx", "get.lua", "/v1/payments/64k"),
    ("o", "idemproxy GET pass-through, 64 KiB body", "idemproxy", "get.lua", "/v1/payments/64k"),
    ("p", "idemproxy POST, replay, 64 KiB body", "idemproxy", "replay64k.lua", "/v1/payments/64k"),
    ("m", "nginx proxy, HTTP/2 (h2load -m 10)", "nginx-h2", "h2", "/v1/payments"),
    ("n", "idemproxy GET pass-through, HTTP/2 (h2load -m 10)", "idemproxy", "h2", "/v1/payments"),
]

# The baseline each case is compared with: nginx with the same body, or over HTTP/2.
BASELINE = {"i": "i", "j": "i", "k": "i", "l": "l", "o": "l", "p": "l", "m": "m", "n": "m"}

# With (bf) among the cases: the keyed POSTs beside nginx proxying the same requests,
# made by the same wrk script (its Lua and the POST's body cost wrk and the upstream
# more than (b)'s GETs do).
SAME_POSTS = {"f": "bf", "d": "bf", "u": "bf", "w": "bf", "af": "bf", "pf": "bf"}

# With --cluster: the same guarded cases on an idemproxy whose store is a Redis Cluster.
CLUSTER_CASES = [
    ("g", "idemproxy POST, fresh key, Redis Cluster 3+3", "cluster", "fresh.lua", "/v1/payments"),
    ("h", "idemproxy POST, replay, Redis Cluster 3+3", "cluster", "replay.lua", "/v1/payments"),
]

# With --traces: the GET and fresh-key cases again on idemproxy instances that export
# traces (sample_ratio 1.0 and 0.01) to a collector (nginx answering 200 to every
# export), each compared with the same case untraced, (c) or (d), from the same run.
TRACE_CASES = [
    ("q", "idemproxy GET pass-through, traces 1.0", "traced", "get.lua", "/v1/payments"),
    ("r", "idemproxy POST, fresh key, traces 1.0", "traced", "fresh.lua", "/v1/payments"),
    ("s", "idemproxy GET pass-through, traces 0.01", "traced-1pct", "get.lua", "/v1/payments"),
    ("t", "idemproxy POST, fresh key, traces 0.01", "traced-1pct", "fresh.lua", "/v1/payments"),
]
UNTRACED = {"q": "c", "r": "d", "s": "c", "t": "d"}

# With --stores: the guarded cases again on an idemproxy with the memory store and one
# with the SQLite store (its file on this machine's disk, not a tmpfs: each commit is a
# real fsync), beside (d) and (e) on Redis, from the same run.
STORE_CASES = [
    ("u", "idemproxy POST, fresh key, memory store", "memory", "fresh.lua", "/v1/payments"),
    ("v", "idemproxy POST, replay, memory store", "memory", "replay.lua", "/v1/payments"),
    ("w", "idemproxy POST, fresh key, SQLite store", "sqlite", "fresh.lua", "/v1/payments"),
    ("x", "idemproxy POST, replay, SQLite store", "sqlite", "replay.lua", "/v1/payments"),
]
# Each SQLite case and what it is held to: the memory store's same case, and Redis'.
ON_SQLITE = {"w": ("u", "d"), "x": ("v", "e")}

# With --durable (issue 54): the store a team would run instead of SQLite for the same
# durability on one machine, Redis with `appendonly yes` and `appendfsync always` (its
# log on this machine's disk), beside the --stores cases, from the same run.
DURABLE_CASES = [
    ("af", "idemproxy POST, fresh key, Redis appendfsync always", "redis-aof", "fresh.lua", "/v1/payments"),
    ("ae", "idemproxy POST, replay, Redis appendfsync always", "redis-aof", "replay.lua", "/v1/payments"),
]
# Each SQLite case and its case on Redis with appendfsync always.
ON_AOF = {"w": "af", "x": "ae"}

# With --sealed: fresh keys and replays with 1 KiB and 64 KiB response bodies, on the
# Redis idemproxy (records in clear) and on one with [store.encryption] (records
# sealed with AES-256-GCM) on the same redis-server, from the same run.
SEALED_CASES = [
    ("y1", "idemproxy POST, fresh key, 1 KiB body", "idemproxy", "fresh.lua", "/v1/payments/1k"),
    ("z1", "idemproxy POST, fresh key, 1 KiB body, sealed", "sealed", "fresh.lua", "/v1/payments/1k"),
    ("k", "idemproxy POST, replay, 1 KiB body", "idemproxy", "replay1k.lua", "/v1/payments/1k"),
    ("zk", "idemproxy POST, replay, 1 KiB body, sealed", "sealed", "replay1k.lua", "/v1/payments/1k"),
    ("y64", "idemproxy POST, fresh key, 64 KiB body", "idemproxy", "fresh.lua", "/v1/payments/64k"),
    ("z64", "idemproxy POST, fresh key, 64 KiB body, sealed", "sealed", "fresh.lua", "/v1/payments/64k"),
    ("p", "idemproxy POST, replay, 64 KiB body", "idemproxy", "replay64k.lua", "/v1/payments/64k"),
    ("zp", "idemproxy POST, replay, 64 KiB body, sealed", "sealed", "replay64k.lua", "/v1/payments/64k"),
]
# Each sealed case and the same case in clear.
UNSEALED = {"z1": "y1", "zk": "k", "z64": "y64", "zp": "p"}
BASELINE.update({"y1": "i", "z1": "i", "zk": "i", "y64": "l", "z64": "l", "zp": "l"})

# With --postgres: fresh keys and replays on an idemproxy with the Postgres store (a
# server of the bench's own, fsync and synchronous_commit on, its data on this
# machine's disk), beside (d) and (e) on Redis, from the same run.
POSTGRES_CASES = [
    ("pf", "idemproxy POST, fresh key, Postgres store", "postgres", "fresh.lua", "/v1/payments"),
    ("pr", "idemproxy POST, replay, Postgres store", "postgres", "replay.lua", "/v1/payments"),
    # pgbench -M prepared on the same server, as many clients as wrk has connections (at
    # most 200): (gf) a fresh request's two statements as the proxy sends them
    # (bench/pgbench/fresh.sql), (gb) a bare INSERT and UPDATE of the same row, (gs) one
    # SELECT of the response the replay cases replay.
    ("gf", "pgbench: the store's claim and complete, fresh key", "pgbench", "fresh.sql", None),
    ("gb", "pgbench: bare INSERT + UPDATE, fresh key", "pgbench", "bare.sql", None),
    ("gs", "pgbench: SELECT of a recorded response", "pgbench", "select.sql", None),
]
ON_POSTGRES = {"pf": "d", "pr": "e"}
# What each Postgres case is held to: its pgbench ceiling.
PGBENCH_CEILING = {"pf": ["gf", "gb"], "pr": ["gs"]}

# With --remember: the fresh-key and replay cases again on an idemproxy per store whose
# routes remember their keys 30 days past a 24 h retention, each beside the same case
# without remember, from the same run; and (rs), fresh keys on SQLite with a 3 s
# retention, whose sweeper drops responses throughout, beside (rw).
REMEMBER_CASES = [
    ("rd", "idemproxy POST, fresh key, Redis, remember 30d", "remember-redis", "fresh.lua", "/v1/payments"),
    ("re", "idemproxy POST, replay, Redis, remember 30d", "remember-redis", "replay.lua", "/v1/payments"),
    ("ru", "idemproxy POST, fresh key, memory, remember 30d", "remember-memory", "fresh.lua", "/v1/payments"),
    ("rv", "idemproxy POST, replay, memory, remember 30d", "remember-memory", "replay.lua", "/v1/payments"),
    ("rw", "idemproxy POST, fresh key, SQLite, remember 30d", "remember-sqlite", "fresh.lua", "/v1/payments"),
    ("rx", "idemproxy POST, replay, SQLite, remember 30d", "remember-sqlite", "replay.lua", "/v1/payments"),
    ("rpf", "idemproxy POST, fresh key, Postgres, remember 30d", "remember-postgres", "fresh.lua", "/v1/payments"),
    ("rpr", "idemproxy POST, replay, Postgres, remember 30d", "remember-postgres", "replay.lua", "/v1/payments"),
    ("rs", "idemproxy POST, fresh key, SQLite, retention 3s, remember 30d", "sweeping-sqlite", "fresh.lua",
     "/v1/payments"),
]
REMEMBERED = {"rd": "d", "re": "e", "ru": "u", "rv": "v", "rw": "w", "rx": "x", "rpf": "pf", "rpr": "pr",
              "rs": "rw"}

# With --keys: a fresh key per POST with a 1 KiB JSON request body, the key in the
# Idempotency-Key header (the "payments" route) beside the same key in a JSON field of
# the same body (the "refs" route, key = ["json:/client_reference"]), on one idemproxy,
# from the same run: what reading the key from the body costs.
KEY_CASES = [
    ("kh", "idemproxy POST, fresh key in the header, 1 KiB request", "idemproxy", "freshheader1k.lua", "/v1/payments"),
    ("kj", "idemproxy POST, fresh key in a JSON field, 1 KiB request", "idemproxy", "freshjson1k.lua", "/v1/refs"),
]
IN_HEADER = {"kj": "kh"}

# With --calls (issue 55): a JSON-RPC tools/call replayed with a new id on every request
# (the "rpc" route, jsonrpc_methods = ["tools/call"]: the call parsed, its fingerprint
# without its id, the recorded answer's id replaced), beside the same bytes replayed on
# a plain route ("rpcplain"), from the same run; both upstreams answer the same body.
CALL_CASES = [
    ("jq", "idemproxy POST, replay of a JSON-RPC answer, plain route", "idemproxy", "rpcplain.lua", "/v1/rpcplain"),
    ("jr", "idemproxy POST, JSON-RPC tools/call replay, a new id each", "idemproxy", "rpcreplay.lua", "/v1/rpc"),
]
ON_PLAIN = {"jr": "jq"}
RPC_ANSWER = '{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"paid 1000 eur"}],"isError":false}}'
RPC_CALL = '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1000}}}'
RPC_SCRIPT = textwrap.dedent(f"""
    local counter = 0
    local call = '{RPC_CALL}'
    wrk.method = "POST"
    wrk.headers["Content-Type"] = "application/json"
    wrk.headers["Idempotency-Key"] = "bench-rpc"
    request = function()
      counter = counter + 1
      return wrk.format(nil, nil, nil, (call:gsub('"id":1,', '"id":' .. NEXT_ID .. ',', 1)))
    end
""")

# A 1 KiB request body with the key in its client_reference field: the same bytes in
# both key cases, so that only where the proxy finds the key differs.
FRESH_1K = textwrap.dedent("""
    -- A per-run salt from the command line (run_wrk): LuaJIT's own generator repeats
    -- its draws across runs, and keys would repeat with it.
    local prefix = "k"
    init = function(args) prefix = table.concat(args, "-") end
    local counter = 0
    local memo = string.rep("x", 960)
    wrk.method = "POST"
    wrk.headers["Content-Type"] = "application/json"
    request = function()
      counter = counter + 1
      local key = prefix .. "-" .. counter
      local body = '{"client_reference":"' .. key .. '","amount":1000,"memo":"' .. memo .. '"}'
      HEADER
      return wrk.format(nil, nil, nil, body)
    end
""")

# wrk prints one machine-readable line at the end of each run.
DONE = """
done = function(summary, latency, requests)
  io.write(string.format("RESULT %d %d %d %d %d %d %d %d\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    summary.errors.status, summary.errors.connect, summary.errors.read + summary.errors.write,
    summary.errors.timeout))
end
"""

SCRIPTS = {
    "get.lua": 'wrk.method = "GET"\n',
    # A fresh key on every request: a per-run random prefix plus a counter.
    "fresh.lua": textwrap.dedent("""
        -- A per-run salt from the command line (run_wrk): LuaJIT's own generator
        -- repeats its draws across runs, and keys would repeat with it.
        local prefix = "k"
        init = function(args) prefix = table.concat(args, "-") end
        local counter = 0
        wrk.method = "POST"
        wrk.body = '{"amount":1000}'
        wrk.headers["Content-Type"] = "application/json"
        request = function()
          counter = counter + 1
          wrk.headers["Idempotency-Key"] = prefix .. "-" .. counter
          return wrk.format()
        end
    """),
    "replay.lua": textwrap.dedent("""
        wrk.method = "POST"
        wrk.body = '{"amount":1000}'
        wrk.headers["Content-Type"] = "application/json"
        wrk.headers["Idempotency-Key"] = "bench-replay"
    """),
    "replay1k.lua": textwrap.dedent("""
        wrk.method = "POST"
        wrk.body = '{"amount":1000}'
        wrk.headers["Content-Type"] = "application/json"
        wrk.headers["Idempotency-Key"] = "bench-replay-1k"
    """),
    "replay64k.lua": textwrap.dedent("""
        wrk.method = "POST"
        wrk.body = '{"amount":1000}'
        wrk.headers["Content-Type"] = "application/json"
        wrk.headers["Idempotency-Key"] = "bench-replay-64k"
    """),
    "freshheader1k.lua": FRESH_1K.replace("HEADER", 'wrk.headers["Idempotency-Key"] = key'),
    "freshjson1k.lua": FRESH_1K.replace("HEADER", "-- the key is in the body only"),
    # Both JSON-RPC scripts make each request in Lua the same way (wrk's own cost per
    # request is then the same); only the id differs: always 1 here, a new one in (jr).
    "rpcplain.lua": RPC_SCRIPT.replace("NEXT_ID", "1"),
    "rpcreplay.lua": RPC_SCRIPT.replace("NEXT_ID", "counter"),
    "nokey.lua": textwrap.dedent("""
        wrk.method = "POST"
        wrk.body = '{"amount":1000}'
        wrk.headers["Content-Type"] = "application/json"
    """),
}


def wait_port(port, timeout=15, what="a server"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"bench: {what} does not listen on {port} after {timeout}s")


def nginx_binary():
    return shutil.which("nginx") or "/usr/sbin/nginx"


def nginx_command(workdir, name, server_block, workers, master=True, connections=4096):
    """Writes an nginx config under workdir/name and returns the command that runs it
    in the foreground. master=False: one process and no master, for a profiler;
    `connections` per worker (each proxied request takes two)."""
    prefix = os.path.join(workdir, name)
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(textwrap.dedent(f"""
            daemon off;
            master_process {"on" if master else "off"};
            worker_processes {workers};
            pid {prefix}/nginx.pid;
            error_log {prefix}/logs/error.log warn;
            worker_rlimit_nofile {max(1024, 2 * connections + 64)};
            events {{ worker_connections {connections}; }}
            http {{
              access_log off;
              client_body_temp_path {prefix}/body;
              proxy_temp_path {prefix}/proxy;
              fastcgi_temp_path {prefix}/fastcgi;
              uwsgi_temp_path {prefix}/uwsgi;
              scgi_temp_path {prefix}/scgi;
              keepalive_requests 1000000;
              {server_block}
            }}
        """))
    return [nginx_binary(), "-p", prefix, "-c", conf]


def start_nginx(workdir, name, server_block, workers, connections=4096):
    return subprocess.Popen(nginx_command(workdir, name, server_block, workers, connections=connections),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Commands the cluster client sends to keep its own slot map, and replicas' replication
# traffic: not round trips of the request path.
CLUSTER_HOUSEKEEPING = {"cluster|slots", "cluster|shards", "cluster|nodes", "cluster|info", "ping",
                        "replconf", "psync", "command|docs", "client|setinfo", "hello"}


def commandstats(*redis_ports):
    """Calls of every command these Redis servers ran, those the scripts run inside
    included (INFO and cluster housekeeping aside): Redis's own count of its work."""
    total = 0
    for redis_port in redis_ports:
        out = subprocess.run(["redis-cli", "-p", str(redis_port), "INFO", "commandstats"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            name = line.split(":", 1)[0].removeprefix("cmdstat_")
            if (line.startswith("cmdstat_") and name != "info"
                    and name not in CLUSTER_HOUSEKEEPING):
                fields = dict(kv.split("=") for kv in line.split(":", 1)[1].split(","))
                total += int(fields["calls"])
    return total


def redis_reads(*redis_ports):
    """Read events Redis processed (INFO stats total_reads_processed): one per batch
    of commands that arrived at once on a connection, however many requests' commands
    it holds and whatever the scripts run inside."""
    total = 0
    for redis_port in redis_ports:
        out = subprocess.run(["redis-cli", "-p", str(redis_port), "INFO", "stats"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("total_reads_processed:"):
                total += int(line.split(":", 1)[1])
    return total


def redis_cpu_seconds(*redis_ports):
    """User + system CPU seconds the Redis processes have used (INFO cpu)."""
    total = 0.0
    for redis_port in redis_ports:
        out = subprocess.run(["redis-cli", "-p", str(redis_port), "INFO", "cpu"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
                total += float(line.split(":", 1)[1])
    return total


def run_h2load(port, path, connections, duration):
    """h2load over h2c with 10 streams per connection; requests/s, no percentiles."""
    out = subprocess.run(
        ["h2load", "-t1", f"-c{connections}", "-m10", f"-D{duration}", f"http://127.0.0.1:{port}{path}"],
        capture_output=True, text=True)
    succeeded = status_2xx = 0
    rps = None
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("finished in"):
            rps = float(line.split(",")[1].split()[0])
        if line.startswith("requests:"):
            succeeded = int(line.split()[7])
        if line.startswith("status codes:"):
            status_2xx = int(line.split()[2])
    if rps is None:
        sys.exit(f"bench: h2load printed no result:\n{out.stdout}\n{out.stderr}")
    # h2load counts requests still in flight at the deadline in "total" but not in the
    # status codes: only the failed ones count.
    return {"requests": succeeded, "seconds": duration, "rps": rps, "p50_ms": float("nan"), "p99_ms": float("nan"),
            "non2xx": max(0, succeeded - status_2xx), "socket_errors": 0}


def free_cluster_port():
    """A free port whose cluster bus port (10,000 above it) is free and exists: a node
    on a port above 55535 does not start."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def start_cluster(workdir, children):
    """Six redis-server processes made into a cluster of three primaries, each with a
    replica, by redis-cli --cluster create. Returns the primaries' ports."""
    ports = [free_cluster_port() for _ in range(6)]
    for port in ports:
        node_dir = os.path.join(workdir, f"cluster-{port}")
        os.makedirs(node_dir)
        children.append(subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", node_dir,
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", "2000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for port in ports:
        wait_port(port, what="a cluster node")
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{port}" for port in ports],
                    "--cluster-replicas", "1", "--cluster-yes"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        states = [subprocess.run(["redis-cli", "-p", str(port), "CLUSTER", "INFO"],
                                 capture_output=True, text=True).stdout for port in ports]
        if all("cluster_state:ok" in state for state in states):
            break
        time.sleep(0.2)
    else:
        sys.exit("bench: the cluster did not come up")
    return [port for port in ports
            if "role:master" in subprocess.run(["redis-cli", "-p", str(port), "INFO", "replication"],
                                               capture_output=True, text=True).stdout]


class RssSampler:
    """Samples a process's resident set every 50 ms; `peak` is the largest seen."""

    def __init__(self, pid):
        self.pid, self.peak, self.running = pid, 0, True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            self.peak = max(self.peak, rss_kib(self.pid))
            time.sleep(0.05)

    def stop(self):
        self.running = False
        self.thread.join()
        return self.peak


def tree_cpu_seconds(pid):
    """CPU time of process `pid` and of its children (nginx's master and workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(kid) for kid in f.read().split()]
    except OSError:
        kids = []
    return cpu_seconds(pid) + sum(tree_cpu_seconds(kid) for kid in kids)


def children_cpu_seconds():
    """CPU time of the children this program has waited for (wrk's, around its run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_wrk(port, script, path, connections, duration):
    wrk_before = children_cpu_seconds()
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", script,
         f"http://127.0.0.1:{port}{path}", "--", os.urandom(8).hex()],
        capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            requests, micros, p50, p99, status, connect, rw, timeout = map(int, line.split()[1:])
            return {
                "requests": requests,
                "seconds": micros / 1e6,
                "rps": requests / (micros / 1e6),
                "p50_ms": p50 / 1000,
                "p99_ms": p99 / 1000,
                "non2xx": status,
                "socket_errors": connect + rw + timeout,
                "client_cpu": children_cpu_seconds() - wrk_before,
            }
    sys.exit(f"bench: wrk printed no result:\n{out.stdout}\n{out.stderr}")


def run_pgbench(postgres, script, clients, duration, variables):
    """pgbench -M prepared on `postgres` with bench/pgbench/`script` for `duration` s:
    its transactions a second, and their mean latency as p50 and p99 both (pgbench's
    per-transaction log reads a lazily kept clock here, most fast transactions as 0 µs,
    so no percentile is taken from it)."""
    defines = [arg for name, value in variables.items() for arg in ("-D", f"{name}={value}")]
    out = subprocess.run(
        [f"{postgres.bin}/pgbench", "-n", "-M", "prepared", "-h", "127.0.0.1", "-p", str(postgres.port),
         "-U", "postgres", "-c", str(min(clients, 200)), "-j", "2", "-T", str(duration), *defines,
         "-f", os.path.join(os.path.dirname(os.path.abspath(__file__)), "pgbench", script), "postgres"],
        capture_output=True, text=True)
    found = dict(line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)
    if out.returncode != 0 or "tps" not in found or "latency average" not in found:
        sys.exit(f"bench: pgbench failed:\n{out.stdout}\n{out.stderr}")
    tps, mean = float(found["tps"].split()[0]), float(found["latency average"].split()[0])
    return {
        "requests": round(tps * duration),
        "seconds": duration,
        "rps": tps,
        "p50_ms": mean,
        "p99_ms": mean,
        "non2xx": 0,
        "socket_errors": 0,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", default="32,256")
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--traces", action="store_true")
    parser.add_argument("--stores", action="store_true")
    parser.add_argument("--sealed", action="store_true")
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--keys", action="store_true")
    parser.add_argument("--remember", action="store_true")
    parser.add_argument("--durable", action="store_true")
    parser.add_argument("--calls", action="store_true")
    parser.add_argument("--pg-connections", type=int, default=4)
    parser.add_argument("--cases", default="")
    args = parser.parse_args()
    connection_counts = [int(c) for c in args.connections.split(",")]
    cases = (CASES + (CLUSTER_CASES if args.cluster else []) + (TRACE_CASES if args.traces else [])
             + (STORE_CASES if args.stores else []) + (POSTGRES_CASES if args.postgres else [])
             + (KEY_CASES if args.keys else []))
    if args.remember:
        # The cases each remembering case is compared with, and the stores they need.
        args.stores = args.postgres = True
        cases = (CASES + (CLUSTER_CASES if args.cluster else []) + (TRACE_CASES if args.traces else [])
                 + STORE_CASES + POSTGRES_CASES + (KEY_CASES if args.keys else []) + REMEMBER_CASES)
    if args.durable:
        args.stores = True
        known = {case[0] for case in cases}
        cases += [case for case in STORE_CASES + DURABLE_CASES if case[0] not in known]
    if args.calls:
        cases += CALL_CASES
    if args.sealed:
        # (k) and (p) are already among CASES: each case runs once.
        known = {case[0] for case in cases}
        cases += [case for case in SEALED_CASES if case[0] not in known]
    if args.cases:
        wanted = set(args.cases.split(","))
        # The baselines the chosen cases are compared with run too.
        wanted |= {BASELINE.get(case, "b") for case in wanted} | {UNTRACED[c] for c in wanted if c in UNTRACED}
        wanted |= {other for c in wanted if c in ON_SQLITE for other in ON_SQLITE[c]}
        wanted |= {ON_AOF[c] for c in wanted if c in ON_AOF and args.durable}
        wanted |= {UNSEALED[c] for c in wanted if c in UNSEALED}
        wanted |= {ON_POSTGRES[c] for c in wanted if c in ON_POSTGRES}
        wanted |= {IN_HEADER[c] for c in wanted if c in IN_HEADER}
        wanted |= {ON_PLAIN[c] for c in wanted if c in ON_PLAIN}
        # Twice: (rs) is held to (rw), which is held to (w).
        wanted |= {REMEMBERED[c] for c in wanted if c in REMEMBERED}
        wanted |= {REMEMBERED[c] for c in wanted if c in REMEMBERED}
        wanted |= {BASELINE.get(case, "b") for case in wanted}
        cases = [case for case in cases if case[0] in wanted]

    workdir = tempfile.mkdtemp(prefix="idemproxy-bench-")
    ports = {name: free_port() for name in ("upstream", "nginx", "nginx-h2", "idemproxy", "admin",
                                            "redis", "cluster", "cluster-admin", "collector", "traced",
                                            "traced-admin", "traced-1pct", "traced-1pct-admin", "memory",
                                            "memory-admin", "sqlite", "sqlite-admin", "sealed", "sealed-admin",
                                            "postgres", "postgres-admin", "pg", "remember-redis",
                                            "remember-redis-admin", "remember-memory", "remember-memory-admin",
                                            "remember-sqlite", "remember-sqlite-admin", "remember-postgres",
                                            "remember-postgres-admin", "sweeping-sqlite",
                                            "sweeping-sqlite-admin", "redis-aof", "redis-aof-admin",
                                            "redis-aof-server")}
    # The SQLite file where commits are fsyncs: beside the build, on the repository's disk.
    disk_dir = tempfile.mkdtemp(prefix="idemproxy-bench-sqlite-",
                                dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target"))
    children = []
    writers_to_disk = {}
    try:
        for name, text in SCRIPTS.items():
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text + DONE)

        children.append(subprocess.Popen(
            ["redis-server", "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # nginx's workers run as an unprivileged user: they must be able to read them.
        os.chmod(workdir, 0o755)
        bodies = os.path.join(workdir, "bodies")
        os.makedirs(os.path.join(bodies, "v1", "payments"))
        for name, size in (("1k", 1024), ("64k", 64 * 1024)):
            with open(os.path.join(bodies, "v1", "payments", name), "w") as f:
                f.write("x" * size)
        children.append(start_nginx(workdir, "upstream", textwrap.dedent(f"""
            server {{
              listen 127.0.0.1:{ports["upstream"]} reuseport;
              location / {{
                default_type application/json;
                return 201 '{BODY}';
              }}
              # The JSON-RPC cases: one answer for both routes.
              location /v1/rpc {{
                default_type application/json;
                return 200 '{RPC_ANSWER}';
              }}
              # The body cases: a file, for POST too (error_page turns the static
              # module's 405 into a GET of the same file, answered 201).
              location ~ ^/v1/payments/(1k|64k)$ {{
                root {bodies};
                default_type application/octet-stream;
                error_page 405 =201 $uri;
              }}
            }}
            # The trace collector of the --traces cases: takes every export.
            server {{
              listen 127.0.0.1:{ports["collector"]} reuseport;
              location / {{
                return 200;
              }}
            }}"""), workers=1))
        nginx_pids = {"upstream": children[-1].pid}
        children.append(start_nginx(workdir, "proxy", textwrap.dedent(f"""
            upstream backend {{
              server 127.0.0.1:{ports["upstream"]};
              keepalive 256;
            }}
            server {{
              listen 127.0.0.1:{ports["nginx"]} reuseport;
              location / {{
                proxy_pass http://backend;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
              }}
            }}
            server {{
              listen 127.0.0.1:{ports["nginx-h2"]} http2 reuseport;
              location / {{
                proxy_pass http://backend;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
              }}
            }}"""), workers=2))
        nginx_pids["nginx"] = nginx_pids["nginx-h2"] = children[-1].pid
        for name in ("redis", "upstream", "nginx", "nginx-h2"):
            wait_port(ports[name], what=name)

        def idemproxy_config(name, listen, admin, store, extra="", env=None, idempotency="", route=""):
            config = os.path.join(workdir, f"{name}.toml")
            with open(config, "w") as f:
                f.write(textwrap.dedent(f"""
                [server]
                listen = "127.0.0.1:{listen}"
                [admin]
                listen = "127.0.0.1:{admin}"
                [store]
                {store}
                timeout = "2s"
                [[route]]
                name = "payments"
                path_prefix = "/v1/payments"
                upstream = "http://127.0.0.1:{ports["upstream"]}"
                {route}
                [route.idempotency]
                {idempotency}
                [[route]]
                name = "refs"
                path_prefix = "/v1/refs"
                upstream = "http://127.0.0.1:{ports["upstream"]}"
                [route.idempotency]
                key = ["json:/client_reference"]
                [[route]]
                name = "rpc"
                path_prefix = "/v1/rpc"
                upstream = "http://127.0.0.1:{ports["upstream"]}"
                [route.idempotency]
                jsonrpc_methods = ["tools/call"]
                [[route]]
                name = "rpcplain"
                path_prefix = "/v1/rpcplain"
                upstream = "http://127.0.0.1:{ports["upstream"]}"
                [route.idempotency]
                [[route]]
                name = "orders"
                path_prefix = "/v1/orders"
                upstream = "http://127.0.0.1:{ports["upstream"]}"
                [route.idempotency]
                required = false
                """) + extra)
            proxy = subprocess.Popen([IDEMPROXY, "serve", "--config", config],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "RUST_LOG": "warn", **(env or {})})
            children.append(proxy)
            wait_port(listen, what=f"idemproxy ({name})")
            # Record the keys that the replay cases replay, and warm the script cache.
            for key, path in (("bench-replay", "/v1/payments"), ("bench-replay-1k", "/v1/payments/1k"),
                              ("bench-replay-64k", "/v1/payments/64k")):
                request = urllib.request.Request(
                    f"http://127.0.0.1:{listen}{path}", data=b'{"amount":1000}',
                    headers={"Idempotency-Key": key, "Content-Type": "application/json"})
                urllib.request.urlopen(request).read()
            for path in ("/v1/rpc", "/v1/rpcplain"):
                request = urllib.request.Request(
                    f"http://127.0.0.1:{listen}{path}", data=RPC_CALL.encode(),
                    headers={"Idempotency-Key": "bench-rpc", "Content-Type": "application/json"})
                urllib.request.urlopen(request).read()
            return proxy

        proxies = {"idemproxy": idemproxy_config(
            "idemproxy", ports["idemproxy"], ports["admin"],
            f'backend = "redis"\n                url = "redis://127.0.0.1:{ports["redis"]}/0"')}
        redis_ports = {"idemproxy": [ports["redis"]]}
        if args.traces:
            redis_url = f'backend = "redis"\n                url = "redis://127.0.0.1:{ports["redis"]}/0"'
            for name, ratio in (("traced", "1.0"), ("traced-1pct", "0.01")):
                tracing = (f'\n[tracing]\notlp_endpoint = "http://127.0.0.1:{ports["collector"]}"\n'
                           f'sample_ratio = {ratio}\n')
                proxies[name] = idemproxy_config(name, ports[name], ports[f"{name}-admin"], redis_url, tracing)
                redis_ports[name] = [ports["redis"]]
        if args.cluster:
            primaries = start_cluster(workdir, children)
            seeds = ", ".join(f'"redis://127.0.0.1:{port}"' for port in primaries)
            proxies["cluster"] = idemproxy_config(
                "cluster", ports["cluster"], ports["cluster-admin"],
                f'backend = "redis-cluster"\n                urls = [{seeds}]')
            redis_ports["cluster"] = primaries

        if args.sealed:
            # Its own key prefix on the same redis-server, so that its records are its own.
            sealed_store = (f'backend = "redis"\n                url = "redis://127.0.0.1:{ports["redis"]}/0"\n'
                            '                key_prefix = "sealed"')
            key = base64.b64encode(os.urandom(32)).decode()
            proxies["sealed"] = idemproxy_config("sealed", ports["sealed"], ports["sealed-admin"], sealed_store,
                                                 '\n[store.encryption]\nkey_env = "BENCH_RECORD_KEY"\n',
                                                 env={"BENCH_RECORD_KEY": key})
            redis_ports["sealed"] = [ports["redis"]]
        if args.stores:
            # Bounds no run reaches (a fresh-key case records 100,000 keys a round or
            # more): a full store would answer 503s, not what the store costs.
            for name, store in (("memory", 'backend = "memory"\n                max_records = 50000000\n'
                                           '                max_bytes = "16GiB"'),
                                ("sqlite", f'backend = "sqlite"\n                path = "{disk_dir}/records.db"\n'
                                f'                max_records = 50000000\n                max_bytes = "16GiB"')):
                proxies[name] = idemproxy_config(name, ports[name], ports[f"{name}-admin"], store)
                redis_ports[name] = []

        if args.durable:
            aof_dir = tempfile.mkdtemp(prefix="aof-", dir=disk_dir)
            aof_server = subprocess.Popen(
                ["redis-server", "--port", str(ports["redis-aof-server"]), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction",
                 "--dir", aof_dir],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            children.append(aof_server)
            writers_to_disk["redis-aof"] = aof_server.pid
            wait_port(ports["redis-aof-server"], what="redis (appendfsync always)")
            proxies["redis-aof"] = idemproxy_config(
                "redis-aof", ports["redis-aof"], ports["redis-aof-admin"],
                f'backend = "redis"\n                url = "redis://127.0.0.1:{ports["redis-aof-server"]}/0"')
            redis_ports["redis-aof"] = [ports["redis-aof-server"]]

        postgres = None
        # The process that writes each durable store's disk: SQLite's is the proxy.
        if "sqlite" in proxies:
            writers_to_disk["sqlite"] = proxies["sqlite"].pid
        if args.postgres:
            postgres = Postgres(disk_dir, ports["pg"], children)
            proxies["postgres"] = idemproxy_config(
                "postgres", ports["postgres"], ports["postgres-admin"],
                f'backend = "postgres"\n                url = "postgres://postgres@127.0.0.1:{ports["pg"]}/postgres"\n'
                f'                connections = {args.pg_connections}')
            redis_ports["postgres"] = []

        if args.remember:
            remember = 'retention = "24h"\n                remember = "30d"'
            stores = {
                "remember-redis": f'backend = "redis"\n                url = "redis://127.0.0.1:{ports["redis"]}/0"\n'
                                  '                key_prefix = "remember"',
                "remember-memory": 'backend = "memory"\n                max_records = 50000000\n'
                                   '                max_bytes = "16GiB"',
                "remember-sqlite": f'backend = "sqlite"\n                path = "{disk_dir}/remember.db"\n'
                                   '                max_records = 50000000\n                max_bytes = "16GiB"',
                "remember-postgres": f'backend = "postgres"\n                url = "postgres://postgres@127.0.0.1:{ports["pg"]}/postgres"\n'
                                     f'                schema = "remember"\n                connections = {args.pg_connections}',
                "sweeping-sqlite": f'backend = "sqlite"\n                path = "{disk_dir}/sweeping.db"\n'
                                   '                max_records = 50000000\n                max_bytes = "16GiB"',
            }
            for name, store in stores.items():
                sweeping = name == "sweeping-sqlite"
                retained = remember if not sweeping else 'retention = "3s"\n                remember = "30d"'
                proxies[name] = idemproxy_config(name, ports[name], ports[f"{name}-admin"], store,
                                                 idempotency=retained,
                                                 route='upstream_timeout = "1s"' if sweeping else "")
                redis_ports[name] = [ports["redis"]] if name == "remember-redis" else []

        results = {}  # (case, connections) -> list of runs
        for round_number in range(args.rounds):
            for connections in connection_counts:
                for case, _, target, script, path in cases:
                    sampler = RssSampler(proxies.get(target, proxies["idemproxy"]).pid)
                    counted = redis_ports.get(target, redis_ports["idemproxy"])
                    before, cpu_before = commandstats(*counted), redis_cpu_seconds(*counted)
                    reads_before = redis_reads(*counted)
                    commits_before = commits(ports, target)
                    fsyncs = FsyncCounter(proxies["sqlite"].pid) if target == "sqlite" and args.stores else None
                    pg_before = postgres.counters() if target in ("postgres", "pgbench") else None
                    proxy_pid = nginx_pids.get(target) or proxies.get(target, proxies["idemproxy"]).pid
                    proxy_cpu_before = tree_cpu_seconds(proxy_pid)
                    upstream_cpu_before = tree_cpu_seconds(nginx_pids["upstream"])
                    writer_before = thread_cpu_seconds(proxies[target].pid, WRITER) if target == "sqlite" else 0
                    syncer_before = thread_cpu_seconds(proxies[target].pid, SYNCER) if target == "sqlite" else 0
                    dropped_before = dropped(ports, target)
                    disk_before = written_bytes(writers_to_disk.get(target))
                    if target == "pgbench":
                        run = run_pgbench(postgres, script, connections, args.duration,
                                          postgres.bench_variables())
                    elif script == "h2":
                        run = run_h2load(ports[target], path, connections, args.duration)
                    else:
                        run = run_wrk(ports[target], os.path.join(workdir, script), path, connections,
                                      args.duration)
                    run["commands"] = commandstats(*counted) - before
                    run["redis_cpu"] = redis_cpu_seconds(*counted) - cpu_before
                    # The INFO calls themselves are three reads.
                    run["reads"] = redis_reads(*counted) - reads_before - 3 * len(counted)
                    run["rss_mib"] = sampler.stop() / 1024
                    run["commits"] = [after - first for after, first in zip(commits(ports, target), commits_before)]
                    run["fsyncs"] = fsyncs.stop() if fsyncs else 0
                    run["proxy_cpu"] = tree_cpu_seconds(proxy_pid) - proxy_cpu_before
                    run["upstream_cpu"] = tree_cpu_seconds(nginx_pids["upstream"]) - upstream_cpu_before
                    run["dropped"] = dropped(ports, target) - dropped_before
                    run["disk_bytes"] = written_bytes(writers_to_disk.get(target)) - disk_before
                    run["writer_cpu"] = (thread_cpu_seconds(proxies[target].pid, WRITER) - writer_before
                                         if target == "sqlite" else 0)
                    run["syncer_cpu"] = (thread_cpu_seconds(proxies[target].pid, SYNCER) - syncer_before
                                         if target == "sqlite" else 0)
                    if pg_before is not None:
                        after = postgres.counters()
                        run["pg_statements"], run["pg_cpu"] = after[0] - pg_before[0], after[1] - pg_before[1]
                    results.setdefault((case, connections), []).append(run)
                    print(f"round {round_number + 1} c={connections} ({case}) {run['rps']:.0f} req/s",
                          file=sys.stderr, flush=True)

        print_table(results, connection_counts, args, cases)
        if args.traces:
            print()
            for name in ("traced", "traced-1pct"):
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[name + '-admin']}/metrics") as answer:
                    text = answer.read().decode()
                counts = {line.split()[0]: line.split()[1] for line in text.splitlines()
                          if line.startswith("idemproxy_trace_spans_")}
                print(f"{name}: spans exported {counts.get('idemproxy_trace_spans_exported_total', '?')}, "
                      f"dropped {counts.get('idemproxy_trace_spans_dropped_total', '?')}")
    finally:
        for child in reversed(children):
            child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)


class Postgres:
    """A Postgres server of the bench's own: initdb into `parent` (this machine's disk,
    so that commits are real fsyncs), the server's defaults for durability, run as the
    postgres user when the bench runs as root; pg_stat_statements counts the store's
    statements."""

    def __init__(self, parent, port, children):
        bins = sorted(os.listdir("/usr/lib/postgresql"), key=int)
        self.bin = f"/usr/lib/postgresql/{bins[-1]}/bin"
        self.port = port
        self.variables = None  # bench_variables, read once
        self.dir = tempfile.mkdtemp(prefix="pg-", dir=parent)
        as_owner = ["setpriv", "--reuid", "postgres", "--regid", "postgres", "--init-groups", "--"] \
            if os.getuid() == 0 else []
        if os.getuid() == 0:
            # The postgres user must reach its directory through the bench's own.
            os.chmod(parent, 0o755)
            shutil.chown(self.dir, "postgres", "postgres")
        data = os.path.join(self.dir, "data")
        subprocess.run(as_owner + [f"{self.bin}/initdb", "-D", data, "-U", "postgres", "--auth=trust",
                                   "-E", "UTF8", "--locale=C"], check=True, stdout=subprocess.DEVNULL)
        self.process = subprocess.Popen(
            as_owner + [f"{self.bin}/postgres", "-D", data, "-p", str(port), "-c", "listen_addresses=127.0.0.1",
                        "-c", f"unix_socket_directories={self.dir}", "-c", "max_connections=300",
                        "-c", "shared_buffers=256MB", "-c", "shared_preload_libraries=pg_stat_statements"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        children.append(self.process)
        wait_port(port, what="postgres")
        for _ in range(100):
            if subprocess.run([f"{self.bin}/pg_isready", "-q", "-h", "127.0.0.1", "-p", str(port)]).returncode == 0:
                break
            time.sleep(0.1)
        self.psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def psql(self, sql):
        return subprocess.run([f"{self.bin}/psql", "-X", "-At", "-h", "127.0.0.1", "-p", str(self.port),
                               "-U", "postgres", "-d", "postgres", "-c", sql],
                              check=True, capture_output=True, text=True).stdout.strip()

    def bench_variables(self):
        """pgbench's values for bench/pgbench/*.sql: the headers and body of the
        response the replay cases replay (the first the bench recorded), its key, and
        an owner and fingerprint of the proxy's sizes."""
        if self.variables is None:
            key, headers, body = self.psql(
                "SELECT key, encode(headers, 'hex'), encode(body, 'hex') FROM idemproxy.records "
                "WHERE state = 'completed' ORDER BY completed_at LIMIT 1").split("|")
            self.variables = {"owner": "\\x" + os.urandom(16).hex(), "fingerprint": "\\x" + os.urandom(32).hex(),
                              "retention": 86_400_000, "remember": 86_400_000, "lease": 30_000, "status": 201,
                              "headers": "\\x" + headers, "body": "\\x" + body, "replayed": key}
        return self.variables

    def counters(self):
        """The store's statements so far (claims, completes and every other function
        call, from pg_stat_statements), and the CPU seconds of every Postgres process."""
        calls = self.psql("SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query LIKE '%idemproxy.%'")
        pids = [self.process.pid] + [int(pid) for pid in subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout.split()]
        cpu = 0.0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                if pid == self.process.pid:
                    # Backends that have exited (pgbench's, once it disconnects).
                    cpu += (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
        return int(calls), cpu


def written_bytes(pid):
    """The bytes process `pid` has had written to disk (`/proc/<pid>/io`), 0 for none."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0


def disk_per_request(runs):
    """The disk writes of these runs, in KB a request."""
    requests = sum(run["requests"] for run in runs)
    return f"{sum(run['disk_bytes'] for run in runs) / max(requests, 1) / 1000:.2f}"


def commits(ports, target):
    """The SQLite store's commits and the writes they held, from its metrics (zeros
    for any other store)."""
    if target != "sqlite":
        return [0, 0]
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['sqlite-admin']}/metrics") as answer:
        text = answer.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("idemproxy_")}
    return [values.get("idemproxy_store_commits_total", 0), values.get("idemproxy_store_committed_writes_total", 0)]


class FsyncCounter:
    """The fsync and fdatasync calls of a process's threads while a case runs, counted by
    `perf stat` on their syscall tracepoints (which cost the process nothing it would
    notice, unlike strace). Zero where perf cannot count them (then the commits, one
    log fsync each, are the figure)."""

    def __init__(self, pid):
        self.output = tempfile.NamedTemporaryFile(prefix="perf-", suffix=".txt", delete=False)
        self.output.close()
        self.process = None
        if shutil.which("perf"):
            self.process = subprocess.Popen(
                ["perf", "stat", "-x", ",", "-o", self.output.name, "-e",
                 "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync", "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.2)  # perf attaches before the load starts

    def stop(self):
        if self.process is None:
            return 0
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=10)
        total = 0
        with open(self.output.name) as f:
            for line in f:
                fields = line.strip().split(",")
                if len(fields) > 2 and fields[0].isdigit():
                    total += int(fields[0])
        os.unlink(self.output.name)
        return total


# The SQLite store's writer thread, as /proc shows its name (15 bytes), and the thread
# that fsyncs its log (issue 54).
WRITER = "idemproxy-sqlite-writer"[:15]
SYNCER = "idemproxy-fsync"


def thread_cpu_seconds(pid, name):
    """The CPU seconds (user and system) of the threads of `pid` named `name`."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def dropped(ports, target):
    """The responses a SQLite store's sweeper has dropped at the end of their retention."""
    if target not in ("sqlite", "remember-sqlite", "sweeping-sqlite"):
        return 0
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[target + '-admin']}/metrics") as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("idemproxy_store_dropped_responses_total "):
                return float(line.split()[1])
    return 0


def median(runs, field):
    return statistics.median(run[field] for run in runs)


def number(value, spec, suffix=""):
    return "-" if math.isnan(value) else format(value, spec) + suffix


def ratio_table(results, connection_counts, cases, against, kind, plain_name):
    """Each case in `against` beside the case it is compared with, from the same run."""
    chosen = [case for case in cases if case[0] in against]
    if not chosen:
        return
    print()
    print(f"| {kind} case | conns | req/s vs {plain_name} | p50 vs {plain_name} | p99 vs {plain_name} |")
    print("|---|---|---|---|---|")
    for connections in connection_counts:
        for case, label, _, _, _ in chosen:
            runs, plain = results[(case, connections)], results[(against[case], connections)]
            print(f"| ({case}) {label} vs ({against[case]}) | {connections} | "
                  f"{median(runs, 'rps') / median(plain, 'rps'):.2f}x | "
                  f"{median(runs, 'p50_ms') / median(plain, 'p50_ms'):.2f}x | "
                  f"{median(runs, 'p99_ms') / median(plain, 'p99_ms'):.2f}x |")


def cpu_table(results, connection_counts, cases):
    """Where each case's CPU goes, per request: the proxy (idemproxy, or nginx's master
    and workers), the upstream nginx, wrk and the store's server (Redis, or Postgres:
    every server process). On two cores that every process
    shares, a case's rate is about the cores kept busy over the total; so the total
    beside nginx's says how far a case can get from nginx's rate, and which process
    holds it back."""
    print()
    print("| case | conns | proxy CPU µs/req | upstream µs/req | wrk µs/req | Redis or Postgres µs/req | "
          "total µs/req | total vs nginx | cores busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for connections in connection_counts:
        totals = {}
        for case, label, target, script, _ in cases:
            runs = results[(case, connections)]
            if script == "h2" or target == "pgbench":
                continue
            requests = sum(run["requests"] for run in runs)
            per = {name: sum(run.get(name, 0) for run in runs) / requests * 1e6
                   for name in ("proxy_cpu", "upstream_cpu", "client_cpu", "redis_cpu", "pg_cpu")}
            total = sum(per.values())
            totals[case] = total
            baseline = totals.get(BASELINE.get(case, "b"))
            seconds = sum(run["seconds"] for run in runs)
            print(f"| ({case}) {label} | {connections} | {per['proxy_cpu']:.1f} | {per['upstream_cpu']:.1f} | "
                  f"{per['client_cpu']:.1f} | {per['redis_cpu'] + per['pg_cpu']:.1f} | {total:.1f} | "
                  f"{number(total / baseline if baseline else math.nan, '.2f', 'x')} | "
                  f"{total * requests / seconds / 1e6:.2f} |")


def print_table(results, connection_counts, args, cases):
    print()
    print(f"idemproxy vs nginx on loopback: {os.cpu_count()} cores, wrk -t1, {args.duration}s per case, "
          f"median of {args.rounds} alternating rounds")
    print()
    print("| case | conns | req/s | p50 ms | p99 ms | req/s vs nginx | p99 vs nginx | non-2xx | "
          "Redis reads/req | Redis cmds/req | Redis CPU µs/req | idemproxy peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for connections in connection_counts:
        for case, label, target, _, _ in cases:
            baseline = results[(BASELINE.get(case, "b"), connections)]
            base_rps, base_p99 = median(baseline, "rps"), median(baseline, "p99_ms")
            runs = results[(case, connections)]
            rps, p99 = median(runs, "rps"), median(runs, "p99_ms")
            requests = sum(run["requests"] for run in runs)
            non2xx = sum(run["non2xx"] + run["socket_errors"] for run in runs)
            if target in ("idemproxy", "cluster", "traced", "traced-1pct", "sealed", "remember-redis", "redis-aof"):
                commands = f"{sum(run['commands'] for run in runs) / requests:.3f}"
                trips = f"{max(0, sum(run['reads'] for run in runs)) / requests:.3f}"
                cpu = f"{sum(run['redis_cpu'] for run in runs) / requests * 1e6:.1f}"
                rss = f"{max(run['rss_mib'] for run in runs):.1f}"
            elif target in ("memory", "sqlite"):
                trips, commands, cpu = "-", "-", "-"
                rss = f"{max(run['rss_mib'] for run in runs):.1f}"
            else:
                trips, commands, cpu, rss = "-", "-", "-", "-"
            # h2load gives no percentiles: those cells are "-".
            p50, p99_ratio = median(runs, "p50_ms"), p99 / base_p99
            print(f"| ({case}) {label} | {connections} | {rps:,.0f} | {number(p50, '.2f')} | "
                  f"{number(p99, '.2f')} | {rps / base_rps:.2f}x | {number(p99_ratio, '.2f', 'x')} | {non2xx} | "
                  f"{trips} | {commands} | {cpu} | {rss} |")
    cpu_table(results, connection_counts, cases)
    if any(case[0] == "bf" for case in cases):
        ratio_table(results, connection_counts, cases, SAME_POSTS, "keyed POST", "nginx, same POSTs")
    ratio_table(results, connection_counts, cases, UNTRACED, "traced", "untraced")
    ratio_table(results, connection_counts, cases, UNSEALED, "sealed", "in clear")
    ratio_table(results, connection_counts, cases, IN_HEADER, "key in the body", "key in the header")
    ratio_table(results, connection_counts, cases, ON_PLAIN, "JSON-RPC", "plain")
    ratio_table(results, connection_counts, cases, REMEMBERED, "remember 30d", "without")
    if any(case[0] == "rs" for case in cases):
        print()
        print("| sweeping case | conns | responses dropped/s | idemproxy CPU µs/req | vs (rw) | "
              "sweep CPU µs per dropped response |")
        print("|---|---|---|---|---|---|")
        for connections in connection_counts:
            runs, plain = results[("rs", connections)], results[("rw", connections)]
            per = lambda rows: sum(r["proxy_cpu"] for r in rows) / sum(r["requests"] for r in rows) * 1e6
            seconds = sum(r["seconds"] for r in runs)
            dropped_count = sum(r["dropped"] for r in runs)
            extra = (per(runs) - per(plain)) * sum(r["requests"] for r in runs) / max(dropped_count, 1)
            print(f"| (rs) vs (rw) | {connections} | {dropped_count / seconds:,.0f} | {per(runs):.1f} | "
                  f"{per(plain):.1f} | {extra:.1f} |")
    on_sqlite = [case for case in cases if case[0] in ON_SQLITE]
    if on_sqlite:
        print()
        print("| SQLite case | conns | req/s vs memory | req/s vs Redis | req/s vs Redis AOF always | "
              "p99 vs Redis AOF always | p50 / p99 ms added to nginx's | commits/s | writes per commit | "
              "fsyncs/s | writer CPU µs/write | fsync thread CPU µs/write | disk KB/req (Redis AOF always's) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for connections in connection_counts:
            base = results[("b", connections)]
            for case, label, _, _, _ in on_sqlite:
                runs = results[(case, connections)]
                memory, redis = (results[(other, connections)] for other in ON_SQLITE[case])
                seconds = sum(run["seconds"] for run in runs)
                commit_count = sum(run["commits"][0] for run in runs)
                writes = sum(run["commits"][1] for run in runs)
                fsync_count = sum(run["fsyncs"] for run in runs)
                writer = (f"{sum(run['writer_cpu'] for run in runs) / writes * 1e6:.1f}" if writes else "-")
                syncer = (f"{sum(run['syncer_cpu'] for run in runs) / writes * 1e6:.1f}" if writes else "-")
                aof = results.get((ON_AOF[case], connections))
                versus_aof = (f"{median(runs, 'rps') / median(aof, 'rps'):.2f}x | "
                              f"{median(runs, 'p99_ms') / median(aof, 'p99_ms'):.2f}x" if aof else "- | -")
                disk = disk_per_request(runs) + (f" ({disk_per_request(aof)})" if aof else "")
                print(f"| ({case}) {label} | {connections} | "
                      f"{median(runs, 'rps') / median(memory, 'rps'):.2f}x | "
                      f"{median(runs, 'rps') / median(redis, 'rps'):.2f}x | {versus_aof} | "
                      f"{median(runs, 'p50_ms') - median(base, 'p50_ms'):.2f} / "
                      f"{median(runs, 'p99_ms') - median(base, 'p99_ms'):.2f} | "
                      f"{commit_count / seconds:,.0f} | {writes / max(commit_count, 1):.1f} | "
                      f"{fsync_count / seconds:,.0f} | {writer} | {syncer} | {disk} |")
    on_postgres = [case for case in cases if case[0] in ON_POSTGRES or case[2] == "pgbench"]
    if on_postgres:
        print()
        print("| Postgres case | conns | req/s (tx/s) | p50 ms | p99 ms | req/s vs Redis | req/s vs its pgbench "
              "ceilings | statements/req | Postgres CPU µs/req |")
        print("|---|---|---|---|---|---|---|---|---|")
        for connections in connection_counts:
            for case, label, _, _, _ in on_postgres:
                runs = results[(case, connections)]
                redis = results.get((ON_POSTGRES.get(case), connections))
                versus_redis = f"{median(runs, 'rps') / median(redis, 'rps'):.2f}x" if redis else "-"
                ceilings = ", ".join(
                    f"{median(runs, 'rps') / median(results[(other, connections)], 'rps'):.2f}x "
                    f"({other})"
                    for other in PGBENCH_CEILING.get(case, []) if (other, connections) in results) or "-"
                requests = sum(run["requests"] for run in runs)
                statements = sum(run["pg_statements"] for run in runs) / requests
                cpu = sum(run["pg_cpu"] for run in runs) / requests * 1e6
                print(f"| ({case}) {label} | {connections} | {median(runs, 'rps'):,.0f} | "
                      f"{median(runs, 'p50_ms'):.2f} | {median(runs, 'p99_ms'):.2f} | {versus_redis} | {ceilings} | "
                      f"{statements:.2f} | {cpu:.1f} |")
    idemproxy_cases = [case for case, _, target, _, _ in cases if target == "idemproxy"]
    print()
    # Only where a case ran on the Redis idemproxy (`--cases` may leave it out).
    for connections in connection_counts if idemproxy_cases else []:
        per_round = [max(results[(case, connections)][r]["rss_mib"] for case in idemproxy_cases)
                     for r in range(args.rounds)]
        print(f"idemproxy peak RSS per round at c={connections}: "
              + ", ".join(f"{rss:.1f} MiB" for rss in per_round))


if __name__ == "__main__":
    main()
