# syntax=docker/dockerfile:1
# Multi-stage build: compile with the Rust toolchain, run from a small distroless
# image as a non-root user. No OpenSSL is needed: TLS is rustls with ring.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Build the dependencies first, so that source edits do not rebuild them.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --bin idemproxy \
    && rm -rf src
COPY src ./src
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin idemproxy
# The shipped proxy.toml, listening on every interface as a container must.
COPY proxy.toml ./
# Its SQLite store in the image's volume, /var/lib/idemproxy, owned by the user it
# runs as: the records survive a restart, and the root filesystem can be read-only.
RUN sed -e 's/"127.0.0.1:8080"/"0.0.0.0:8080"/' -e 's/"127.0.0.1:9090"/"0.0.0.0:9090"/' \
        -e 's|^path = "records.db"$|path = "/var/lib/idemproxy/records.db"|' proxy.toml > container.toml \
    && grep -q '"0.0.0.0:8080"' container.toml && grep -q '"0.0.0.0:9090"' container.toml \
    && grep -q '^path = "/var/lib/idemproxy/records.db"$' container.toml \
    && mkdir -p /out/var/lib/idemproxy

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY --from=build /src/container.toml /etc/idemproxy/proxy.toml
COPY --from=build --chown=65532:65532 /out/var/lib/idemproxy /var/lib/idemproxy
# The records: mount a volume here (an anonymous one is made if you do not), and keep
# it across restarts and upgrades. One container per volume: a second proxy on the same
# file refuses to start.
VOLUME /var/lib/idemproxy
ENV IDEMPROXY_CONFIG=/etc/idemproxy/proxy.toml
# 8080: the proxy. 9090: admin (/healthz, /readyz, /metrics). Mount your own config
# over /etc/idemproxy/proxy.toml; the shipped one proxies to 127.0.0.1:9000.
EXPOSE 8080 9090
# distroless's nonroot user, by number: Kubernetes' runAsNonRoot can only verify a
# numeric user ("cannot verify user is non-root" otherwise).
USER 65532:65532
# distroless has no shell or curl: orchestrators should probe GET :9090/healthz
# (liveness) and GET :9090/readyz (readiness) directly.
ENTRYPOINT ["/usr/local/bin/idemproxy"]
CMD ["serve"]
