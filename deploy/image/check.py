#!/usr/bin/env python3
"""Builds idemproxy's image from the Dockerfile, unchanged, and tests it as a user runs
it: with podman (and runc), each container on its own bridge network with its ports
published, as `docker run -p` would.

    python3 deploy/image/check.py [--keep] [--no-compose]

1. The two base images the Dockerfile names are pulled when a registry answers, else
   made here as local stand-ins under the same names (and kept for the next run):
   the build one a `debootstrap --variant=minbase` bookworm rootfs with gcc and
   libc6-dev, this host's Rust toolchain and the CA certificates this host trusts; the
   runtime one bookworm's libc6, libgcc-s1, ca-certificates, netbase and tzdata
   extracted into a rootfs with distroless's `nonroot` user (65532).
2. `podman build` of the Dockerfile (layers cached between runs).
3. The image's smoke test, with its shipped SQLite store (in the image's volume) and
   with Redis: the user is the number 65532, it runs `--read-only` with every
   capability dropped, `/healthz`, `/readyz` and `/metrics` answer, a guarded POST and
   its byte-identical replay, 400 without a key, a SIGHUP reload, and `podman stop`
   (SIGTERM) with a 2 s request in flight: the request gets its 201, the drain is
   logged, the exit status is 0; then `podman start`, and both keys replay.
4. The compose stack (`deploy/compose/compose.yaml`, stand-ins for its Redis and
   Python images) brought up with podman-compose, a replay served through it, and
   brought down, each service stopping on SIGTERM.

It prints the image's size, the time from `run` to a ready `/readyz`, and what each
step took; it exits 1 on the first check that fails, saying which, and removes the
containers, processes and files it made (not the images: they are the cache).
"""

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "deploy", "image")
IMAGE = "localhost/idemproxy:check"
# What the stand-ins are made of; a stand-in made by another recipe is made again.
RUNTIME_PACKAGES = ["libc6", "libgcc-s1", "ca-certificates", "netbase", "tzdata"]
BUILD_PACKAGES = ["gcc", "libc6-dev", "ca-certificates"]
SERVICE_PACKAGES = ["redis-server", "redis-tools", "python3"]
STAND_IN_LABEL = "org.idemproxy.stand-in"
RECIPE = "2"
CACHE = os.environ.get("IDEMPROXY_IMAGE_CACHE", "/var/tmp/idemproxy-image")

ENV = dict(os.environ, CONTAINERS_CONF=os.path.join(HERE, "containers.conf"))


class Failed(Exception):
    """A check that did not hold."""


def log(message):
    print(f"image: {message}", flush=True)


def run(*args, check=True, capture=False, timeout=None, input=None):
    """Runs a command; with `capture` returns its stdout."""
    result = subprocess.run(
        args,
        env=ENV,
        check=False,
        text=True,
        input=input,
        timeout=timeout,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
    )
    if check and result.returncode != 0:
        detail = (result.stderr or "").strip() if capture else ""
        raise Failed(f"{' '.join(args)} exited {result.returncode} {detail}")
    return result.stdout if capture else result.returncode


def podman(*args, **kwargs):
    return run("podman", *args, **kwargs)


def expect(condition, what):
    if not condition:
        raise Failed(what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# === tools ===


def ensure_tools():
    """podman with runc (crun fails on this kind's cgroups), and debootstrap for the
    build stand-in, from Debian's packages when missing."""
    missing = [p for p, cmd in [("podman", "podman"), ("runc", "runc"), ("debootstrap", "debootstrap")]
               if shutil.which(cmd) is None and not os.path.exists(f"/usr/sbin/{cmd}")]
    if missing:
        log(f"installing {' '.join(missing)}")
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
        subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", *missing], check=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), stdout=subprocess.DEVNULL)
    podman("--version")


# === base images ===


def dockerfile_bases():
    """The build and runtime bases the Dockerfile names, in order."""
    bases = []
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        for line in f:
            words = line.split()
            if words and words[0].upper() == "FROM":
                bases.append(words[1])
    expect(len(bases) == 2, f"the Dockerfile names two stages, not {bases}")
    return bases


def qualified(name):
    """`rust:1.95` as podman stores it (`docker.io/library/rust:1.95`)."""
    first = name.split("/", 1)[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def stand_in_key(kind):
    if kind == "build":
        toolchain = subprocess.run(["rustc", "--version"], capture_output=True, text=True, check=True).stdout.strip()
        return f"{RECIPE} {kind} {' '.join(BUILD_PACKAGES)} {toolchain}"
    if kind == "services":
        return f"{RECIPE} {kind} {' '.join(SERVICE_PACKAGES)} protected-mode-no"
    return f"{RECIPE} {kind} {' '.join(RUNTIME_PACKAGES)}"


def have(name, kind):
    """Whether `name` is here already: pulled, or a stand-in of this recipe."""
    if podman("image", "exists", name, check=False) != 0:
        return False
    labels = podman("image", "inspect", "--format", "{{json .Labels}}", name, capture=True)
    label = (json.loads(labels or "null") or {}).get(STAND_IN_LABEL)
    return label is None or label == stand_in_key(kind)


def ensure_base(name, kind):
    name = qualified(name)
    if have(name, kind):
        log(f"{kind} base {name}: present")
        return "cached"
    if podman("pull", "--quiet", name, check=False, capture=True, timeout=300) == 0 or have(name, kind):
        log(f"{kind} base {name}: pulled")
        return "pulled"
    log(f"{kind} base {name}: no registry answers; making a local stand-in")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"idemproxy-{kind}-", dir=scratch()) as work:
        rootfs = os.path.join(work, "rootfs")
        os.makedirs(rootfs)
        changes = build_rootfs(rootfs, work) if kind == "build" else runtime_rootfs(rootfs, work)
        changes.append(f"LABEL {STAND_IN_LABEL}=\"{stand_in_key(kind)}\"")
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        args = ["podman", "import", "--quiet"]
        for change in changes:
            args += ["--change", change]
        subprocess.run([*args, "-", name], stdin=tar.stdout, env=ENV, check=True, stdout=subprocess.DEVNULL)
        expect(tar.wait() == 0, "tar of the stand-in rootfs failed")
    log(f"{kind} base {name}: stand-in made in {time.monotonic() - started:.0f} s")
    return "stand-in"


def scratch():
    os.makedirs(CACHE, exist_ok=True)
    return CACHE


def runtime_rootfs(rootfs, work):
    """distroless/cc's contents, from bookworm's packages: glibc, libgcc, CA
    certificates, /etc/services and zoneinfo, and the nonroot user."""
    debs = os.path.join(work, "debs")
    os.makedirs(debs)
    # As root, apt would download as _apt, who cannot write into this private directory.
    subprocess.run(["apt-get", "download", "-qq", "-o", "APT::Sandbox::User=root", *RUNTIME_PACKAGES], cwd=debs,
                   check=True)
    for deb in sorted(os.listdir(debs)):
        subprocess.run(["dpkg-deb", "-x", os.path.join(debs, deb), rootfs], check=True)
    etc = os.path.join(rootfs, "etc")
    with open(os.path.join(etc, "passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/sbin/nologin\n"
                "nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
                "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")
    with open(os.path.join(etc, "group"), "w") as f:
        f.write("root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n")
    certs = os.path.join(etc, "ssl", "certs")
    os.makedirs(certs, exist_ok=True)
    mozilla = os.path.join(rootfs, "usr", "share", "ca-certificates", "mozilla")
    with open(os.path.join(certs, "ca-certificates.crt"), "w") as bundle:
        for name in sorted(os.listdir(mozilla)):
            with open(os.path.join(mozilla, name)) as cert:
                bundle.write(cert.read())
    home = os.path.join(rootfs, "home", "nonroot")
    os.makedirs(home)
    os.chown(home, 65532, 65532)
    tmp = os.path.join(rootfs, "tmp")
    os.makedirs(tmp)
    os.chmod(tmp, 0o1777)
    return ["USER 65532:65532", "WORKDIR /home/nonroot",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"]


def build_rootfs(rootfs, work):
    """The rust image's part that the Dockerfile uses: a bookworm with gcc, cargo and
    rustc on PATH, and the CA certificates this host trusts (a TLS-intercepting
    egress proxy's among them, or cargo cannot reach the registry)."""
    mirror = debian_mirror()
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BUILD_PACKAGES)}",
                    "bookworm", rootfs, mirror], check=True, stdout=subprocess.DEVNULL)
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True, check=True).stdout.strip()
    rust = os.path.join(rootfs, "usr", "local", "rust")
    os.makedirs(rust)
    copy = subprocess.Popen(["tar", "-C", sysroot, "--exclude=./share/doc", "--exclude=./share/man", "-c", "."],
                            stdout=subprocess.PIPE)
    subprocess.run(["tar", "-C", rust, "-x"], stdin=copy.stdout, check=True)
    expect(copy.wait() == 0, "copying the Rust toolchain failed")
    bin_dir = os.path.join(rootfs, "usr", "local", "cargo", "bin")
    os.makedirs(bin_dir)
    for tool in ["cargo", "rustc", "rustdoc"]:
        os.symlink(f"/usr/local/rust/bin/{tool}", os.path.join(bin_dir, tool))
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", os.path.join(rootfs, "etc", "ssl", "certs", "ca-certificates.crt"))
    return ["ENV CARGO_HOME=/usr/local/cargo",
            "ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


def debian_mirror():
    """The Debian mirror this host's apt uses."""
    for path in ["/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"]:
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    words = line.split()
                    if words[:1] == ["URIs:"] and "security" not in words[1]:
                        return words[1]
                    if words[:1] == ["deb"] and "security" not in line:
                        return next(w for w in words[1:] if w.startswith("http"))
    return "http://deb.debian.org/debian"


# === the image ===


def build_image():
    started = time.monotonic()
    podman("build", "--network", "host", "--pull=never", "--quiet", "-t", IMAGE, "-f",
           os.path.join(ROOT, "Dockerfile"), ROOT, capture=True, timeout=1800)
    took = time.monotonic() - started
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE, capture=True).strip())
    user = podman("image", "inspect", "--format", "{{.Config.User}}", IMAGE, capture=True).strip()
    log(f"built {IMAGE} in {took:.0f} s: {size / 1e6:.1f} MB, USER {user}")
    # Kubernetes' runAsNonRoot can only verify a numeric user.
    expect(user == "65532:65532", f"the image's USER is {user!r}, not the numeric 65532:65532")
    return took, size


def shipped_config():
    """The config the image ships, as the image holds it."""
    container = podman("create", IMAGE, capture=True).strip()
    try:
        with tempfile.TemporaryDirectory(dir=scratch()) as work:
            podman("cp", f"{container}:/etc/idemproxy/proxy.toml", os.path.join(work, "proxy.toml"), capture=True)
            with open(os.path.join(work, "proxy.toml")) as f:
                return f.read()
    finally:
        podman("rm", "-f", container, capture=True)


class Http:
    """A client for the container's published ports."""

    def __init__(self, port):
        self.port = port

    def request(self, method, path, headers=None, body=None, timeout=10):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()


def until_ready(admin, limit=30):
    """Polls `/readyz` until it answers 200 (bounded): the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            if admin.request("GET", "/readyz", timeout=2)[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.02)
    raise Failed(f"/readyz did not answer 200 within {limit} s")


def until_upstream(proxy, limit=30):
    """Polls a GET through the proxy (not guarded, so nothing is recorded) until the
    upstream answers rather than the proxy's 502 (bounded): the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            if proxy.request("GET", "/", timeout=2)[0] != 502:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.05)
    raise Failed(f"the upstream did not answer through the proxy within {limit} s")


def metric(admin, line):
    _, _, body = admin.request("GET", "/metrics")
    for text in body.decode().splitlines():
        if text.startswith(line + " "):
            return float(text.split()[-1])
    return None


def until_metric(admin, line, value, limit=10):
    started = time.monotonic()
    while metric(admin, line) != value:
        expect(time.monotonic() - started < limit, f"{line} never reached {value}: {metric(admin, line)}")
        time.sleep(0.02)


class Processes:
    """Everything the smoke test starts, stopped at the end."""

    def __init__(self):
        self.containers = []
        self.children = []

    def child(self, *args):
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.children.append(process)
        return process

    def close(self):
        for name in self.containers:
            podman("rm", "-f", "-t", "0", name, check=False, capture=True)
        for process in self.children:
            process.kill()
            process.wait()


def start_upstream(processes):
    """The example upstream on this host, where containers reach it as
    host.containers.internal."""
    port = free_port()
    processes.child(sys.executable, os.path.join(ROOT, "examples", "upstream.py"), str(port), "0.0.0.0")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return port
        except OSError:
            time.sleep(0.05)
    raise Failed("the example upstream did not start")


def start_redis(processes):
    port = free_port()
    redis = os.environ.get("IDEMPROXY_REDIS_SERVER", "redis-server")
    processes.child(redis, "--port", str(port), "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "",
                    "--appendonly", "no")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() == "PONG":
            return port
        time.sleep(0.05)
    raise Failed("redis-server did not start")


def smoke(processes, shipped, store, upstream_port, redis_port=None):
    """The image run as docs/container.md says: the shipped config (its upstream pointed at
    this host), read-only, no capabilities, ports published. Returns the seconds
    from `run` to a ready `/readyz`."""
    config_dir = tempfile.mkdtemp(prefix=f"idemproxy-{store}-", dir=scratch())
    os.chmod(config_dir, 0o755)
    config = shipped.replace("http://127.0.0.1:9000", f"http://host.containers.internal:{upstream_port}")
    expect(config != shipped, "the shipped config no longer proxies to 127.0.0.1:9000")
    sqlite = 'backend = "sqlite"\npath = "/var/lib/idemproxy/records.db"\nmax_bytes = "1GiB"\n'
    expect(sqlite in shipped, "the shipped config does not keep its SQLite store in /var/lib/idemproxy")
    if redis_port is not None:
        config = config.replace(sqlite, f'backend = "redis"\nurl = "redis://host.containers.internal:{redis_port}"\n')
    path = os.path.join(config_dir, "proxy.toml")
    with open(path, "w") as f:
        f.write(config)
    os.chmod(path, 0o644)
    name = f"idemproxy-check-{store}"
    proxy_port, admin_port = free_port(), free_port()
    podman("rm", "-f", name, check=False, capture=True)
    processes.containers.append(name)
    started = time.monotonic()
    # No volume given for /var/lib/idemproxy: podman makes the image's VOLUME an
    # anonymous one, kept with the container across `podman stop` and `start`.
    podman("run", "-d", "--name", name, "--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges",
           "-p", f"127.0.0.1:{proxy_port}:8080", "-p", f"127.0.0.1:{admin_port}:9090",
           "-v", f"{config_dir}:/etc/idemproxy:ro", IMAGE, capture=True)
    proxy, admin = Http(proxy_port), Http(admin_port)
    until_ready(admin)
    ready = time.monotonic() - started
    log(f"[{store}] ready {ready:.2f} s after run")

    uid = podman("top", name, "huser", capture=True).split()[-1]
    expect(uid == "65532", f"[{store}] the process runs as {uid}, not 65532")
    status, _, body = admin.request("GET", "/healthz")
    expect((status, body) == (200, b"ok\n"), f"[{store}] /healthz: {status} {body!r}")
    status, headers, body = admin.request("GET", "/metrics")
    expect(status == 200 and b"idemproxy_requests_total" in body, f"[{store}] /metrics: {status}")

    key = {"idempotency-key": f"image-{store}-1", "content-type": "application/json"}
    first = proxy.request("POST", "/v1/payments", key, b'{"amount":1}')
    expect(first[0] == 201, f"[{store}] the first POST: {first[0]} {first[2]!r}")
    replay = proxy.request("POST", "/v1/payments", key, b'{"amount":1}')
    expect(replay[0] == 201 and replay[1].get("idempotent-replayed") == "true", f"[{store}] the replay: {replay}")
    expect(replay[2] == first[2], f"[{store}] the replay is not byte-identical: {replay[2]!r} vs {first[2]!r}")
    missing = proxy.request("POST", "/v1/payments", {"content-type": "application/json"}, b"{}")
    expect(missing[0] == 400 and b"missing-idempotency-key" in missing[2], f"[{store}] without a key: {missing}")
    if redis_port is not None:
        keys = subprocess.run(["redis-cli", "-p", str(redis_port), "--scan", "--pattern", "idemproxy:*"],
                              capture_output=True, text=True).stdout.split()
        # One record; with the shipped remember past the retention, its response is
        # kept beside it until the retention ends (docs/remember.md), and nothing else.
        records = [key for key in keys if not key.endswith(":r")]
        expect(len(records) == 1 and all(key in (records[0], records[0] + ":r") for key in keys),
               f"[{store}] Redis holds {keys}, not the one record (and its response beside it)")

    # SIGHUP: the edited file is read again, in place (the directory is mounted).
    with open(path, "w") as f:
        f.write(config.replace('retention = "24h"', 'retention = "12h"'))
    podman("kill", "--signal", "HUP", name, capture=True)
    until_metric(admin, 'idemproxy_config_reloads_total{result="ok"}', 1.0)

    # SIGTERM with a request in flight: it still gets its answer, and the exit is 0.
    held = {}
    in_flight = threading.Thread(target=lambda: held.update(
        answer=proxy.request("POST", "/v1/payments?sleep=2", {"idempotency-key": f"image-{store}-held"}, b"{}",
                             timeout=30)))
    in_flight.start()
    until_metric(admin, "idemproxy_guarded_requests_in_flight", 1.0)
    stop_started = time.monotonic()
    podman("stop", "-t", "25", name, capture=True)
    stopped = time.monotonic() - stop_started
    in_flight.join(30)
    expect(held.get("answer", (None,))[0] == 201, f"[{store}] the request in flight at SIGTERM: {held}")
    code = podman("inspect", "--format", "{{.State.ExitCode}}", name, capture=True).strip()
    expect(code == "0", f"[{store}] the container exited {code}")
    output = subprocess.run(["podman", "logs", name], env=ENV, capture_output=True, text=True)
    logs = output.stdout + output.stderr
    expect("shutting down: draining connections" in logs and "stopped" in logs, f"[{store}] the drain is not logged:\n{logs}")

    # Started again: the records are still there (the volume for SQLite, Redis itself
    # for Redis). The first key replays byte for byte, and the request that was in
    # flight at SIGTERM replays its 201 rather than running again.
    podman("start", name, capture=True)
    until_ready(admin)
    again = proxy.request("POST", "/v1/payments", key, b'{"amount":1}')
    expect(again[0] == 201 and again[1].get("idempotent-replayed") == "true" and again[2] == first[2],
           f"[{store}] the replay after a restart: {again}, first {first}")
    held_again = proxy.request("POST", "/v1/payments?sleep=2", {"idempotency-key": f"image-{store}-held"}, b"{}",
                               timeout=30)
    expect(held_again[0] == 201 and held_again[1].get("idempotent-replayed") == "true"
           and held_again[2] == held["answer"][2], f"[{store}] the held request after a restart: {held_again}")
    podman("stop", "-t", "25", name, capture=True)
    log(f"[{store}] /healthz, /readyz, /metrics, POST + byte-identical replay, 400 without a key, uid 65532, "
        f"read-only with no capabilities, SIGHUP reload: ok; SIGTERM with a 2 s request in flight: "
        f"201, exit 0, stopped in {stopped:.1f} s; both keys replay after a restart")
    shutil.rmtree(config_dir, ignore_errors=True)
    return ready


# === the compose stack ===


def compose_check(processes):
    """podman-compose up with stand-ins for the stack's other images, a replay through
    it, and down: every service stops on SIGTERM, none is killed."""
    compose = os.path.join(ROOT, "deploy", "compose", "compose.yaml")
    ensure_service_image()
    env = dict(ENV, IDEMPROXY_ADMIN_TOKEN="compose-check-token-0123456789abcdef")
    project = "idemproxy-check"
    # The stack's own ports may be taken on this host: it publishes on free ones.
    proxy_port, admin_port = free_port(), free_port()
    env["IDEMPROXY_PORT"], env["IDEMPROXY_ADMIN_PORT"] = str(proxy_port), str(admin_port)
    podman("tag", IMAGE, "localhost/idemproxy:latest")
    # podman-compose cannot give a container a secret from the environment (Compose
    # v2 can): the check gives it the same token from a file instead.
    token = os.path.join(scratch(), "compose-admin-token")
    with open(token, "w") as f:
        f.write(env["IDEMPROXY_ADMIN_TOKEN"] + "\n")
    override = os.path.join(scratch(), "compose.check.yaml")
    with open(override, "w") as f:
        f.write(f"secrets:\n  admin_token: !override\n    file: {token}\n")
    base = ["podman-compose", "-p", project, "-f", compose, "-f", override]
    subprocess.run([*base, "down", "-v", "-t", "0"], env=env, capture_output=True)
    started = time.monotonic()
    up = subprocess.run([*base, "up", "-d", "--no-build"], env=env, capture_output=True, text=True)
    expect(up.returncode == 0, f"podman-compose up: {up.stderr[-2000:]}")
    try:
        admin, proxy = Http(admin_port), Http(proxy_port)
        until_ready(admin, limit=60)
        log(f"[compose] ready {time.monotonic() - started:.1f} s after up")
        # podman-compose before podman 4.6 ignores `condition: service_healthy`, so the
        # proxy can be ready before the upstream listens (502, nothing sent): wait for it.
        upstream = until_upstream(proxy, limit=60)
        log(f"[compose] the upstream answered through the proxy {upstream:.1f} s after ready")
        key = {"idempotency-key": "compose-1", "content-type": "application/json"}
        first = proxy.request("POST", "/v1/payments", key, b'{"amount":1}')
        replay = proxy.request("POST", "/v1/payments", key, b'{"amount":1}')
        expect(first[0] == 201 and replay[0] == 201 and replay[2] == first[2]
               and replay[1].get("idempotent-replayed") == "true", f"[compose] the replay: {first} / {replay}")
        down_started = time.monotonic()
        names = subprocess.run(["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                                "--format", "{{.Names}}"], env=ENV, capture_output=True, text=True).stdout.split()
        for name in names:
            subprocess.run(["podman", "stop", "-t", "20", name], env=ENV, capture_output=True)
        codes = {name: subprocess.run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name], env=ENV,
                                      capture_output=True, text=True).stdout.strip() for name in names}
        log(f"[compose] a replay through the stack: ok; stopped in {time.monotonic() - down_started:.1f} s, "
            f"exit codes {codes}")
        killed = {name: code for name, code in codes.items() if code not in ("0",)}
        expect(not killed, f"[compose] services did not stop cleanly on SIGTERM: {killed}")
    finally:
        subprocess.run([*base, "down", "-v", "-t", "0"], env=env, capture_output=True)


def ensure_service_image():
    """One bookworm with redis-server, redis-cli and python3, under the names the
    compose file gives its Redis and Python images, where a registry cannot give them."""
    with open(os.path.join(ROOT, "deploy", "compose", "compose.yaml")) as f:
        images = [qualified(line.split(":", 1)[1].strip()) for line in f
                  if line.strip().startswith("image:") and "idemproxy" not in line]
    missing = [name for name in images if not have(name, "services")
               and podman("pull", "--quiet", name, check=False, capture=True, timeout=300) != 0]
    if not missing:
        return
    log(f"compose images {', '.join(missing)}: no registry answers; making a local stand-in")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="idemproxy-services-", dir=scratch()) as work:
        rootfs = os.path.join(work, "rootfs")
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(SERVICE_PACKAGES)}",
                        "bookworm", rootfs, debian_mirror()], check=True, stdout=subprocess.DEVNULL)
        os.makedirs(os.path.join(rootfs, "data"), exist_ok=True)
        # The official Redis image is built without protected mode, which would refuse
        # every connection from another container (no password is set).
        wrapper = os.path.join(rootfs, "usr", "local", "bin", "redis-server")
        with open(wrapper, "w") as f:
            f.write('#!/bin/sh\nexec /usr/bin/redis-server "$@" --protected-mode no\n')
        os.chmod(wrapper, 0o755)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "--quiet", "--change", "WORKDIR /data", "--change",
                        f"LABEL {STAND_IN_LABEL}=\"{stand_in_key('services')}\"", "-", missing[0]],
                       stdin=tar.stdout, env=ENV, check=True, stdout=subprocess.DEVNULL)
        expect(tar.wait() == 0, "tar of the services stand-in failed")
    for name in missing[1:]:
        podman("tag", missing[0], name)
    log(f"compose stand-in made in {time.monotonic() - started:.0f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-compose", action="store_true", help="skip the compose stack")
    options = parser.parse_args()
    ensure_tools()
    begun = time.monotonic()
    build_base, runtime_base = dockerfile_bases()
    ensure_base(build_base, "build")
    ensure_base(runtime_base, "runtime")
    took, size = build_image()
    shipped = shipped_config()
    processes = Processes()
    try:
        upstream = start_upstream(processes)
        ready_sqlite = smoke(processes, shipped, "sqlite", upstream)
        ready_redis = smoke(processes, shipped, "redis", upstream, start_redis(processes))
        if not options.no_compose:
            compose_check(processes)
    finally:
        processes.close()
    log(f"image {size / 1e6:.1f} MB; built in {took:.0f} s; run to ready /readyz: {ready_sqlite:.2f} s (sqlite), "
        f"{ready_redis:.2f} s (redis); whole check {time.monotonic() - begun:.0f} s")


if __name__ == "__main__":
    try:
        main()
    except (Failed, subprocess.CalledProcessError, subprocess.TimeoutExpired) as failure:
        print(f"image: FAILED: {failure}", file=sys.stderr, flush=True)
        sys.exit(1)
