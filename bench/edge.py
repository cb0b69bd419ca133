#!/usr/bin/env python3
"""What the edge costs, as figures: the resident memory of 10,000 idle connections,
how long they are held, and the CPU cost of a TLS handshake on the listener.

Runs the release binary (build it first: cargo build --release) with the memory store
on loopback. Makes a throwaway certificate with the openssl command. Prints one small
table; asserts nothing.

    python3 bench/edge.py [--connections 10000] [--handshakes 2000]
"""

import argparse
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time

from common import IDEMPROXY, cpu_seconds, free_port, rss_kib


def start(workdir, name, extra_server):
    port, admin = free_port(), free_port()
    config = os.path.join(workdir, f"{name}.toml")
    with open(config, "w") as f:
        f.write(f"""
[server]
listen = "127.0.0.1:{port}"
header_read_timeout = "120s"
max_connections = 20000
{extra_server}
[admin]
listen = "127.0.0.1:{admin}"
[store]
backend = "memory"
[[route]]
name = "r"
path_prefix = "/"
upstream = "http://127.0.0.1:9"
""")
    proxy = subprocess.Popen([IDEMPROXY, "serve", "--config", config], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", admin), timeout=0.2).close()
            return proxy, port
        except OSError:
            time.sleep(0.05)
    sys.exit(f"bench: idemproxy ({name}) did not start")


def idle_connections(workdir, count):
    proxy, port = start(workdir, "idle", "")
    try:
        time.sleep(0.5)
        before = rss_kib(proxy.pid)
        sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
        time.sleep(1.0)
        after = rss_kib(proxy.pid)
        for s in sockets:
            s.close()
        return before, after
    finally:
        proxy.terminate()
        proxy.wait()


def handshakes(workdir, count):
    cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    proxy, port = start(workdir, "tls", f'[server.tls]\ncert_file = "{cert}"\nkey_file = "{key}"')
    try:
        context = ssl.create_default_context(cafile=cert)
        time.sleep(0.5)
        cpu_before, started = cpu_seconds(proxy.pid), time.time()
        for _ in range(count):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                with context.wrap_socket(raw, server_hostname="localhost") as tls:
                    version = tls.version()
        elapsed, cpu = time.time() - started, cpu_seconds(proxy.pid) - cpu_before
        return version, elapsed, cpu
    finally:
        proxy.terminate()
        proxy.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=10000)
    parser.add_argument("--handshakes", type=int, default=2000)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < args.connections + 100:
        sys.exit(f"bench: the open-files limit ({hard}) cannot hold {args.connections} connections")
    with tempfile.TemporaryDirectory(prefix="idemproxy-edge-") as workdir:
        before, after = idle_connections(workdir, args.connections)
        version, elapsed, cpu = handshakes(workdir, args.handshakes)
    print(f"| what | figure |")
    print(f"|---|---|")
    print(f"| RSS before / with {args.connections:,} idle connections | {before / 1024:.1f} MiB / "
          f"{after / 1024:.1f} MiB |")
    print(f"| RSS per idle connection | {(after - before) * 1024 / args.connections:,.0f} bytes |")
    print(f"| RSS per 10,000 idle connections | {(after - before) * 10000 / args.connections / 1024:.1f} MiB |")
    print(f"| {args.handshakes:,} full {version} handshakes (P-256 certificate), one client | "
          f"{args.handshakes / elapsed:,.0f} /s |")
    print(f"| idemproxy CPU per handshake | {cpu / args.handshakes * 1e6:,.0f} µs |")


if __name__ == "__main__":
    main()
