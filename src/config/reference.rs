//! Every setting the config file takes, with its default and what it means: the one
//! list that `idemproxy config reference` prints as the book's configuration page
//! (`docs/configuration.md`), and that tests hold to what the validator accepts, table
//! by table, and to the defaults it applies. A new setting is one row here.

/// A setting's default, as the page shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultValue {
    /// A TOML value, exactly what leaving the setting out means.
    Toml(&'static str),
    /// A default that depends on something else, in words.
    Text(&'static str),
    /// No default: the setting must be given where its table is.
    Required,
}

/// One setting: its dotted key, its default, what it means (Markdown), and which
/// store backends take it.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    pub key: &'static str,
    pub default: DefaultValue,
    pub meaning: &'static str,
    pub backends: Backends,
}

/// Which store backends take a setting: the validator refuses it on the others, naming
/// these, with `instead` (what those others use, if anything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backends {
    /// Every backend, and every setting outside `[store]`.
    All,
    /// These, by the names `store.backend` takes.
    Only {
        backends: &'static [&'static str],
        instead: &'static str,
    },
}

impl Backends {
    /// Whether the backend `name` takes the setting.
    pub fn take(self, name: &str) -> bool {
        match self {
            Backends::All => true,
            Backends::Only { backends, .. } => backends.contains(&name),
        }
    }

    /// The backends that take it, as a sentence names them: `a, b and c`.
    pub fn named(self) -> String {
        match self {
            Backends::All => "every backend".to_string(),
            Backends::Only { backends, .. } => match backends.split_last() {
                None => String::new(),
                Some((last, [])) => (*last).to_string(),
                Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            },
        }
    }
}

/// The tables settings live in, besides the top level's: a key in one of them is
/// `table.name`.
pub const TABLES: &[&str] = &[
    "server",
    "server.tls",
    "admin",
    "store",
    "store.encryption",
    "store.previous",
    "tracing",
    "route",
    "route.idempotency",
    "route.idempotency.reconcile",
    "route.idempotency.refetch",
    "route.idempotency.scope_jwt",
    "route.cors",
];

/// Every setting, in the page's order.
pub const SETTINGS: &[Setting] = &[
    Setting {
        key: "server.listen",
        default: DefaultValue::Toml("\"127.0.0.1:8080\""),
        meaning: "the proxy's address",
        backends: Backends::All,
    },
    Setting {
        key: "server.max_request_body_bytes",
        default: DefaultValue::Toml("\"1MiB\""),
        meaning: "a larger body on a guarded request gets 413",
        backends: Backends::All,
    },
    Setting {
        key: "server.header_read_timeout",
        default: DefaultValue::Toml("\"10s\""),
        meaning: "a client must send its request head within this",
        backends: Backends::All,
    },
    Setting {
        key: "server.request_body_timeout",
        default: DefaultValue::Toml("\"30s\""),
        meaning: "a guarded request's whole body must arrive within this, else 408",
        backends: Backends::All,
    },
    Setting {
        key: "server.request_body_idle_timeout",
        default: DefaultValue::Toml("\"10s\""),
        meaning: "a guarded request's body that sends no byte for this long is cut, 408, and what it held of the byte budget given back: a client that declares a body and never sends it holds nothing for long",
        backends: Backends::All,
    },
    Setting {
        key: "server.shutdown_grace",
        default: DefaultValue::Toml("\"30s\""),
        meaning: "how long shutdown waits for open requests",
        backends: Backends::All,
    },
    Setting {
        key: "server.workers",
        default: DefaultValue::Text("the number of cores"),
        meaning: "worker threads; each has its own runtime, upstream pool and store connection (and, with Redis, its own `SO_REUSEPORT` socket)",
        backends: Backends::All,
    },
    Setting {
        key: "server.max_connections",
        default: DefaultValue::Toml("10000"),
        meaning: "client connections the process holds at once, exactly, whichever worker's socket they reach; past it, each worker holds the connection it accepted unserved and more wait in the kernel's accept queue until one closes (also bounded by the open-files limit, see [The edge](edge.md))",
        backends: Backends::All,
    },
    Setting {
        key: "server.max_buffered_bytes",
        default: DefaultValue::Toml("\"256MiB\""),
        meaning: "the body bytes guarded requests hold at once while they are buffered: a request body as it is read (its `Content-Length` up front when it has one, chunk by chunk when not; request bodies may take three quarters), a response as it is read for recording; past it, 503 `overloaded` before the request is read, claimed or forwarded (see [Memory and limits](limits.md)); at least 4/3 of `max_request_body_bytes`",
        backends: Backends::All,
    },
    Setting {
        key: "server.max_guarded_requests",
        default: DefaultValue::Toml("16384"),
        meaning: "guarded requests in flight at once, from reading the body to recording the response; more get 503 `overloaded`. It bounds what each costs besides its bodies (see [Memory and limits](limits.md))",
        backends: Backends::All,
    },
    Setting {
        key: "server.max_waiters",
        default: DefaultValue::Toml("10000"),
        meaning: "duplicates waiting for their first request at once (`wait_for_in_flight`); past it a duplicate gets its 409 at once",
        backends: Backends::All,
    },
    Setting {
        key: "server.access_log",
        default: DefaultValue::Toml("false"),
        meaning: "one log line per request, target `idemproxy::access` (see [Operations](operations.md))",
        backends: Backends::All,
    },
    Setting {
        key: "tracing.otlp_endpoint",
        default: DefaultValue::Text("unset"),
        meaning: "OTLP/HTTP endpoint for traces (see [Traces](traces.md)); unset: no traces",
        backends: Backends::All,
    },
    Setting {
        key: "tracing.service_name",
        default: DefaultValue::Toml("\"idemproxy\""),
        meaning: "the traces' `service.name`",
        backends: Backends::All,
    },
    Setting {
        key: "tracing.sample_ratio",
        default: DefaultValue::Toml("1.0"),
        meaning: "share of the traces the proxy starts that are sampled (0.0 to 1.0); a client's `traceparent` flag decides for its own",
        backends: Backends::All,
    },
    Setting {
        key: "server.contract_path",
        default: DefaultValue::Toml("\"/.well-known/idempotency\""),
        meaning: "where the proxy answers with the published contract of the guarded routes the request's host may reach, itself, never forwarded (see [Publishing the contract](contract.md)); `\"\"` turns it off",
        backends: Backends::All,
    },
    Setting {
        key: "server.merge_slashes",
        default: DefaultValue::Toml("true"),
        meaning: "runs of `/` in a path are one `/` before it is routed and forwarded; `false` keeps them (see [The request the guard matches](behaviour.md#the-request-the-guard-matches-is-the-request-forwarded))",
        backends: Backends::All,
    },
    Setting {
        key: "server.escaped_slashes",
        default: DefaultValue::Toml("\"reject\""),
        meaning: "`%2F`, `%5C` or a raw `\\` in a path: `\"reject\"` (400 `invalid-path`) or `\"keep\"` (forwarded, part of a segment)",
        backends: Backends::All,
    },
    Setting {
        key: "server.path_parameters",
        default: DefaultValue::Toml("\"reject\""),
        meaning: "a `;` in a path (`/v1/pay;jsessionid=1`): `\"reject\"` (400 `invalid-path`) or `\"keep\"` (forwarded; a prefix matches at `;` as at `/`)",
        backends: Backends::All,
    },
    Setting {
        key: "server.tls.cert_file",
        default: DefaultValue::Required,
        meaning: "with `[server.tls]`: the listener's certificate chain, PEM",
        backends: Backends::All,
    },
    Setting {
        key: "server.tls.key_file",
        default: DefaultValue::Required,
        meaning: "its private key, PEM (PKCS#8, RSA or SEC1)",
        backends: Backends::All,
    },
    Setting {
        key: "server.tls.client_ca_file",
        default: DefaultValue::Text("none"),
        meaning: "PEM CA certificates: every client must present a certificate one of them signed (mTLS)",
        backends: Backends::All,
    },
    Setting {
        key: "admin.listen",
        default: DefaultValue::Toml("\"127.0.0.1:9090\""),
        meaning: "admin endpoints; leave out `[admin]` to disable",
        backends: Backends::All,
    },
    Setting {
        key: "admin.token_file",
        default: DefaultValue::Text("none"),
        meaning: "a file holding the records API's Bearer token (at least 16 characters, surrounding whitespace ignored); without it `/records` does not exist",
        backends: Backends::All,
    },
    Setting {
        key: "store.backend",
        default: DefaultValue::Toml("\"memory\""),
        meaning: "`\"sqlite\"` (one instance, every record in a file that survives restarts: what the shipped `proxy.toml` and the image use), `\"memory\"` (one instance, every record forgotten when the process ends: for tests), `\"redis\"` (one primary), `\"redis-sentinel\"` or `\"redis-cluster\"` (several instances), `\"postgres\"` (several instances on one Postgres database, every record durable: see [Stores](stores.md#the-postgres-store))",
        backends: Backends::All,
    },
    Setting {
        key: "store.path",
        default: DefaultValue::Required,
        meaning: "the database file (relative to the config file's directory); created when missing, with `<path>-wal`, `<path>-shm` and `<path>.lock` beside it. A file that is not this store's is refused, never replaced (see [Stores](stores.md#the-sqlite-store))",
        backends: Backends::Only {
            backends: &["sqlite"],
            instead: "",
        },
    },
    Setting {
        key: "store.cache_bytes",
        default: DefaultValue::Toml("\"32MiB\""),
        meaning: "at least 1 MiB: the store's memory: SQLite's page caches (half for the writer's connection, a quarter across the read connections) and the recorded responses read lately, kept for their next replays (a quarter); besides it, the process keeps where each record's row is (20-40 bytes a record, read from the file at start)",
        backends: Backends::Only {
            backends: &["sqlite"],
            instead: "",
        },
    },
    Setting {
        key: "store.url",
        default: DefaultValue::Required,
        meaning: "`\"redis\"`: `redis://host:6379/0` or `rediss://` (TLS). `\"postgres\"`: a libpq-style URL, `postgres://user@host:5432/database`, with `sslmode` (`disable`; `prefer`, the default, TLS when the server offers it; `require`, `verify-ca` or `verify-full`, TLS or no connection; whenever TLS is used the certificate and host name are verified) and several hosts for failover (`postgres://user@a,b/db?target_session_attrs=read-write`). A password in it is used, never shown",
        backends: Backends::Only {
            backends: &["redis", "postgres"],
            instead: "redis-sentinel and redis-cluster take urls = [...]",
        },
    },
    Setting {
        key: "store.urls",
        default: DefaultValue::Required,
        meaning: "`\"redis-sentinel\"`: the sentinels; `\"redis-cluster\"`: seed nodes (`redis://` or `rediss://` each)",
        backends: Backends::Only {
            backends: &["redis-sentinel", "redis-cluster"],
            instead: "redis takes one url; postgres takes several hosts in its one url (postgres://a,b/db?target_session_attrs=read-write)",
        },
    },
    Setting {
        key: "store.master_name",
        default: DefaultValue::Required,
        meaning: "the name the sentinels monitor",
        backends: Backends::Only {
            backends: &["redis-sentinel"],
            instead: "",
        },
    },
    Setting {
        key: "store.min_replica_acks",
        default: DefaultValue::Toml("0"),
        meaning: "Redis backends: more than 0 makes a claim count only once this many replicas acknowledged it (`WAIT`); fewer in time releases it and answers 503, nothing forwarded. Postgres: more than 0 makes every commit wait until the synchronous standbys applied it (`synchronous_commit = remote_apply`), and a claim is refused (503, nothing forwarded) while fewer than this many synchronous standbys stream (the role needs `pg_monitor` to see them)",
        backends: Backends::Only {
            backends: &["redis", "redis-sentinel", "redis-cluster", "postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.replica_ack_timeout",
        default: DefaultValue::Toml("\"100ms\""),
        meaning: "how long a claim waits for those acknowledgements (at least 1 ms)",
        backends: Backends::Only {
            backends: &["redis", "redis-sentinel", "redis-cluster"],
            instead: "postgres waits for its synchronous standbys within store.timeout",
        },
    },
    Setting {
        key: "store.connections",
        default: DefaultValue::Toml("1"),
        meaning: "Redis backends: multiplexed connections each worker keeps to the store, taken in turn (1 to 64; more did not shorten claims here, see [Performance](performance.md)). Postgres (default 4): the pool each worker keeps, one statement on each at a time",
        backends: Backends::Only {
            backends: &["redis", "redis-sentinel", "redis-cluster", "postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.tls_ca_file",
        default: DefaultValue::Text("the webpki roots"),
        meaning: "Redis backends, `rediss://`, and Postgres with TLS (`sslmode` not `disable`): PEM CA certificates the server's certificate must chain to, instead of the webpki roots",
        backends: Backends::Only {
            backends: &["redis", "redis-sentinel", "redis-cluster", "postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.tls_cert_file",
        default: DefaultValue::Text("none"),
        meaning: "with `tls_key_file`: the client certificate chain (PEM) presented to a Redis with `tls-auth-clients yes`, or to Postgres (`cert` authentication)",
        backends: Backends::Only {
            backends: &["redis", "redis-sentinel", "redis-cluster", "postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.tls_key_file",
        default: DefaultValue::Text("none"),
        meaning: "its private key, PEM (PKCS#8, RSA or SEC1)",
        backends: Backends::Only {
            backends: &["redis", "redis-sentinel", "redis-cluster", "postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.password_env",
        default: DefaultValue::Text("none"),
        meaning: "the environment variable holding the role's password (instead of one in `url`). Unset refuses start, naming the variable; the password is never logged or printed",
        backends: Backends::Only {
            backends: &["postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.schema",
        default: DefaultValue::Toml("\"idemproxy\""),
        meaning: "the schema the store's tables and functions live in (`a-z 0-9 _`, at most 48)",
        backends: Backends::Only {
            backends: &["postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.migrate",
        default: DefaultValue::Toml("true"),
        meaning: "create or upgrade the schema at start, in one transaction under an advisory lock (instances starting at once migrate once). `false`: only check it; a missing or older schema refuses start, naming `idemproxy store schema`, which prints the DDL for a DBA to apply",
        backends: Backends::Only {
            backends: &["postgres"],
            instead: "",
        },
    },
    Setting {
        key: "store.key_prefix",
        default: DefaultValue::Toml("\"idemproxy\""),
        meaning: "first part of every store key",
        backends: Backends::All,
    },
    Setting {
        key: "store.timeout",
        default: DefaultValue::Toml("\"500ms\""),
        meaning: "bound on each store operation, counted from when the request asks (the time a busy worker takes to read the reply included): raise it to `\"2s\"` where bursts of many thousands of requests arrive at once on few cores (see [Load shaped like a slow legacy API](performance.md#load-shaped-like-a-slow-legacy-api))",
        backends: Backends::All,
    },
    Setting {
        key: "store.encryption.key_env",
        default: DefaultValue::Text("— (records kept in clear)"),
        meaning: "with `[store.encryption]`: the environment variable holding the record key, 32 random bytes in base64 (`openssl rand -base64 32`). Every recorded response's fields and body are sealed with AES-256-GCM under it, and fingerprints kept as an HMAC; the status, state and expiry stay clear. An unset variable or a value that is not 32 bytes refuses start, naming the variable. Changing it takes a restart. See [What is stored](stored-data.md)",
        backends: Backends::All,
    },
    Setting {
        key: "store.encryption.previous_keys_env",
        default: DefaultValue::Text("none"),
        meaning: "the variable holding earlier keys, comma-separated: records sealed under them still open and replay; new ones are sealed under `key_env`. A record under a key in neither is never run again: 409 `outcome-unknown` with `reason` `unreadable` (dropping a key erases its records)",
        backends: Backends::All,
    },
    Setting {
        key: "store.encryption.accept_clear_records",
        default: DefaultValue::Text("`false`"),
        meaning: "whether a record kept in clear (written before `[store.encryption]` was on) still replays. By default it is unreadable (409 `outcome-unknown`, `reason` `unreadable`, never run again): whoever can write the store could write a clear record with any status, fields and body. Set it to `true` only while records from before encryption are within their retention. A clear record whose fingerprint was made under a record key is refused either way",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.backend",
        default: DefaultValue::Text("— (no previous store)"),
        meaning: "with `[store.previous]`, while a fleet switches between shared stores online: the store it switches from, read only (`redis`, `redis-sentinel`, `redis-cluster`, `postgres`). A key this store does not hold is looked up there: a completed record replays (and is copied here with its lifetimes), one in flight or unknown answers 409 (copied as unknown), an absent key is claimed here. If it cannot be read, such a key gets 503 `store-unavailable` and nothing is forwarded. A reload may add, change or drop it. An embedded store (`sqlite`) is moved with `idemproxy store copy` during a stop, and `check` says so. See [Moving to another store](moving.md)",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.until",
        default: DefaultValue::Text("— (required)"),
        meaning: "when the previous store stops being read (RFC 3339, e.g. `\"2027-01-31T00:00:00Z\"`): at least the longest `remember` after the switch. Past it a log line says so and `idemproxy_store_previous_reading` is 0",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.url",
        default: DefaultValue::Text("none"),
        meaning: "as `store.url`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.urls",
        default: DefaultValue::Text("none"),
        meaning: "as `store.urls`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.master_name",
        default: DefaultValue::Text("none"),
        meaning: "as `store.master_name`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.schema",
        default: DefaultValue::Text("`\"idemproxy\"`"),
        meaning: "as `store.schema`, for the previous store (never migrated)",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.password_env",
        default: DefaultValue::Text("none"),
        meaning: "as `store.password_env`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.connections",
        default: DefaultValue::Text("as `store.connections`"),
        meaning: "as `store.connections`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.timeout",
        default: DefaultValue::Text("`\"500ms\"`"),
        meaning: "bound on each lookup in the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.tls_ca_file",
        default: DefaultValue::Text("none"),
        meaning: "as `store.tls_ca_file`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.tls_cert_file",
        default: DefaultValue::Text("none"),
        meaning: "as `store.tls_cert_file`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.previous.tls_key_file",
        default: DefaultValue::Text("none"),
        meaning: "as `store.tls_key_file`, for the previous store",
        backends: Backends::All,
    },
    Setting {
        key: "store.max_records",
        default: DefaultValue::Text("`100000` (memory), `10000000` (sqlite)"),
        meaning: "live records held at most; then new claims get 503 `store-full`",
        backends: Backends::Only {
            backends: &["memory", "sqlite"],
            instead: "bound Redis with maxmemory; Postgres is bounded by its disk, and per tenant by max_records_per_scope",
        },
    },
    Setting {
        key: "store.max_bytes",
        default: DefaultValue::Text("`\"256MiB\"` (memory), `\"1GiB\"` (sqlite)"),
        meaning: "at least 1 MiB. Memory: once live records hold this many bytes (bodies, header names and values, keys, and 416 bytes of bookkeeping each: about what the process holds for a record besides its key and response), new claims get 503 `store-full`. SQLite: the most the file may hold; new claims get 503 `store-full` once seven eighths of it is in use, or once what is in use and what the claims in flight may still write (each its route's `max_response_body_bytes`, in all at most `server.max_buffered_bytes`) would not fit, so that every response forwarded is recorded (so it must be at least 8 times every route's `max_response_body_bytes`); expired records are deleted and their space reused",
        backends: Backends::Only {
            backends: &["memory", "sqlite"],
            instead: "bound Redis with maxmemory; Postgres is bounded by its disk, and per tenant by max_records_per_scope",
        },
    },
    Setting {
        key: "store.max_records_per_scope",
        default: DefaultValue::Text("a quarter of `max_records`"),
        meaning: "live records one scope (a route's client, as its `scope_headers` and `scope_jwt` name it) may hold; its new keys then get 429 `scope-full`. Routes without scope are not bounded by it; on postgres the default is `1000000`",
        backends: Backends::Only {
            backends: &["memory", "sqlite", "postgres"],
            instead: "bound Redis with maxmemory",
        },
    },
    Setting {
        key: "store.max_bytes_per_scope",
        default: DefaultValue::Text("a quarter of `max_bytes`"),
        meaning: "the bytes one scope's live records may hold, likewise",
        backends: Backends::Only {
            backends: &["memory", "sqlite"],
            instead: "bound Redis with maxmemory; on Postgres a tenant is bounded by max_records_per_scope",
        },
    },
    Setting {
        key: "store.max_records_per_client",
        default: DefaultValue::Text("half of `max_records`"),
        meaning: "the records one client address (an IPv4 address, or an IPv6 /64) may hold, across every scope it sends and on routes without scope, so that one address can neither fill the store for every other nor open scopes without end with made-up `scope_headers` values; past it its new keys get 429 `client-full`, with a `Retry-After` of when its first record expires. Half the store by default: two scopes' worth, so two tenants behind one address each get their share. Where every client comes through one gateway (or one backend calls the proxy), raise it to `max_records`. See [Limits](limits.md)",
        backends: Backends::Only {
            backends: &["memory", "sqlite"],
            instead: "bound Redis with maxmemory; on Postgres a tenant is bounded by max_records_per_scope",
        },
    },
    Setting {
        key: "route.name",
        default: DefaultValue::Required,
        meaning: "unique, `A-Z a-z 0-9 _ - .`; part of every record's scope",
        backends: Backends::All,
    },
    Setting {
        key: "route.path_prefix",
        default: DefaultValue::Required,
        meaning: "the longest matching prefix wins, at a `/` (or `;`) boundary; it must be a canonical path (`check` names the canonical spelling)",
        backends: Backends::All,
    },
    Setting {
        key: "route.host",
        default: DefaultValue::Text("any"),
        meaning: "exact `Host` match (port ignored); host routes are tried first",
        backends: Backends::All,
    },
    Setting {
        key: "route.upstream",
        default: DefaultValue::Required,
        meaning: "`http://` or `https://` base URL; the request path is appended",
        backends: Backends::All,
    },
    Setting {
        key: "route.upstream_timeout",
        default: DefaultValue::Toml("\"30s\""),
        meaning: "bound on the whole upstream exchange",
        backends: Backends::All,
    },
    Setting {
        key: "route.upstream_ca_file",
        default: DefaultValue::Text("none"),
        meaning: "PEM CA certificates an `https://` upstream may be signed by, beside the webpki roots",
        backends: Backends::All,
    },
    Setting {
        key: "route.docs_url",
        default: DefaultValue::Text("none"),
        meaning: "where the route's API documents its errors (an absolute `http`/`https` URL, no fragment): every problem response on the route carries `Link: <docs_url>; rel=\"describedby\"`, and its `type` is `docs_url#slug` instead of `urn:idemproxy:problem:slug`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.methods",
        default: DefaultValue::Toml("[\"POST\", \"PATCH\"]"),
        meaning: "the guarded methods",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.profile",
        default: DefaultValue::Toml("\"ietf\""),
        meaning: "the error shape the route's clients expect: `\"ietf\"` (RFC 9457 problems, 422 on key reuse, as the draft says) or `\"stripe\"` (as Stripe's API answers: `{\"error\": {\"type\", \"code\", \"message\"}}` with `application/json`, key reuse a 400 `idempotency_error`, a duplicate in flight a 409 `idempotency_error` with code `idempotency_key_in_use`, a client's other mistakes `invalid_request_error`, the rest `api_error`); statuses, headers and `Retry-After` are otherwise the same",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.header",
        default: DefaultValue::Toml("\"Idempotency-Key\""),
        meaning: "where the key is read (the same as `key = [\"header:NAME\"]`; give one of `header` and `key`)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.key",
        default: DefaultValue::Text("`[\"header:<header>\"]`"),
        meaning: "where the key is found, the first source a request carries winning: `\"header:NAME\"`, `\"json:/pointer\"` (RFC 6901 into a JSON body; a string as it is, another value in canonical form; `\"json:/a&/b\"` makes one key of several values, all of them present), `\"form:NAME\"` (an `application/x-www-form-urlencoded` body), `\"query:NAME\"`, and last `\"body\"`: no key, the request itself is one, kept for `dedup_window`. A source in the body has the body read before the claim. See [Keys](keys.md)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.dedup_window",
        default: DefaultValue::Text("none; required by the `body` key source"),
        meaning: "with `key = [..., \"body\"]` (which needs `scope_headers` or `scope_jwt`): how long two identical requests (as the fingerprint sees them, in one scope) are one operation, the second answered with the first's response; must exceed `upstream_timeout + 1s`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.required",
        default: DefaultValue::Toml("true"),
        meaning: "`false`: a request without a key passes unguarded",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.retention",
        default: DefaultValue::Toml("\"24h\""),
        meaning: "how long the recorded response is kept and replayed (`Idempotency-Expires` says until when); must exceed `upstream_timeout + 1s`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.remember",
        default: DefaultValue::Text("`retention`"),
        meaning: "how long the key is known: past `retention` the response is dropped, the record keeps only its fingerprint, status and completion time, and a retry gets 410 `response-expired` instead of running again (see [Two horizons](remember.md)); at least `retention`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.fingerprint_headers",
        default: DefaultValue::Toml("[\"content-type\"]"),
        meaning: "headers that, with method, path, query and body, make two requests \"the same\"",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.wait_for_in_flight",
        default: DefaultValue::Toml("\"0s\""),
        meaning: "a duplicate that finds its first request in flight waits up to this long for its answer instead of 409 (see [Wait, then replay](beyond.md#wait-then-replay)); at most the lease (`upstream_timeout + 1s`)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.mode",
        default: DefaultValue::Toml("\"enforce\""),
        meaning: "`\"shadow\"`: forward every request as an unguarded route would, write claims and records, and count what enforce would have done (see [Shadow mode](beyond.md#shadow-mode))",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.fingerprint_body",
        default: DefaultValue::Toml("\"bytes\""),
        meaning: "`\"json\"`: a body counts by its JSON value (key order, whitespace, escapes and number spelling ignored; see [JSON fingerprint](beyond.md#json-fingerprint)); a body that is not JSON counts by its bytes",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.fingerprint_ignore",
        default: DefaultValue::Toml("[]"),
        meaning: "with `\"json\"`: JSON pointers (RFC 6901) left out of the fingerprint, e.g. `[\"/sent_at\", \"/meta/request_id\"]`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_headers",
        default: DefaultValue::Toml("[]"),
        meaning: "e.g. `[\"authorization\"]`: hashed into the record's scope, so tenants never share keys",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.max_response_body_bytes",
        default: DefaultValue::Toml("\"1MiB\""),
        meaning: "the largest response that can be recorded",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.on_server_error",
        default: DefaultValue::Toml("\"release\""),
        meaning: "a 5xx: `\"release\"` (a retry runs again) or `\"store\"` (replayed)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.on_unauthorized",
        default: DefaultValue::Toml("\"release\""),
        meaning: "a 401 or 403 from the upstream: `\"release\"` (the request was refused, not executed: nothing is kept, and a retry runs again; so a made-up credential in a `scope_headers` scope never takes a record) or `\"store\"` (replayed like any other answer)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.on_store_error",
        default: DefaultValue::Toml("\"reject\""),
        meaning: "store unreachable: `\"reject\"` (503) or `\"forward\"` (unguarded)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.upstream_key",
        default: DefaultValue::Toml("\"client\""),
        meaning: "the key a guarded request carries upstream: `\"client\"` (the client's own), `\"derived\"` (the record's operation id: unique per route, scope and client key, so an upstream that deduplicates on it never confuses two tenants' keys; it contains none of the client's bytes) or `\"none\"` (removed). Whatever a client sent in `upstream_key_header` is replaced. Every request enforce mode forwards carries it, also unguarded with `on_store_error = \"forward\"`, so an upstream that deduplicates sees one key per operation; shadow mode forwards every request as an unguarded route does, the client's key as sent",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.upstream_key_header",
        default: DefaultValue::Toml("\"Idempotency-Key\""),
        meaning: "the field the upstream finds that key in (the client's `header` is removed when this names another field)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.path",
        default: DefaultValue::Text("— (no probe)"),
        meaning: "with `[route.idempotency.reconcile]`: the probe's path and query on the route's upstream; `{key}` is the key as sent upstream (percent-encoded; refused with `upstream_key = \"none\"`), `{record}` the operation id. See [When the outcome is unknown](unknown-outcomes.md)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.method",
        default: DefaultValue::Toml("\"GET\""),
        meaning: "`GET` or `HEAD`, nothing else: a probe never runs the operation it asks about, and never sends the client's body or headers",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.applied",
        default: DefaultValue::Toml("[200]"),
        meaning: "statuses that mean \"it took effect\": the probe's answer (status, headers, body within `max_response_body_bytes`) becomes the record's response",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.not_applied",
        default: DefaultValue::Toml("[404]"),
        meaning: "statuses that mean \"it did not\": the key is released and the next retry runs. Any other answer, a timeout or a refused connection means \"ask again\"",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.first_after",
        default: DefaultValue::Toml("\"1s\""),
        meaning: "from the moment the outcome became unknown to the first probe. Make it longer than the upstream may go on working on a request the proxy gave up on: a \"not found\" from an upstream that commits a second later releases a key whose operation then takes effect",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.every",
        default: DefaultValue::Toml("\"5s\""),
        meaning: "between probes that learned nothing",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.give_up_after",
        default: DefaultValue::Toml("\"10m\""),
        meaning: "from the moment the outcome became unknown: no probe begins after it, and the record waits for an operator (`reconciling: false`)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.timeout",
        default: DefaultValue::Text("the route's `upstream_timeout`"),
        meaning: "one probe, its answer's body included; the probe lease is this plus 1 s",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.reconcile.max_concurrent",
        default: DefaultValue::Toml("8"),
        meaning: "probes of this route running at once in one process (the rest wait their turn), so that a storm of timeouts does not flood the upstream",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.replay_exclude_headers",
        default: DefaultValue::Toml("[\"set-cookie\"]"),
        meaning: "response fields the first client gets and that are never recorded, so never replayed to anyone",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.replay",
        default: DefaultValue::Toml("\"stored\""),
        meaning: "what a record keeps and a retry gets: `\"stored\"` the whole response; `\"status\"` only the status and `replay_headers`, replayed with an empty body; `\"refetch\"` no body: a retry is answered by the upstream's answer to `refetch`, asked with the retry's own headers. See [What is stored](stored-data.md)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.stream",
        default: DefaultValue::Toml("\"auto\""),
        meaning: "which responses reach the first client as the upstream sends them, recorded as they pass (see [Streaming](streaming.md)): `\"auto\"` a `text/event-stream` response and one with no `Content-Length`; `\"always\"` every response; `\"never\"` none: each is read whole, then sent",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.jsonrpc_methods",
        default: DefaultValue::Text("none: every request of the route's `methods` is guarded"),
        meaning: "on a JSON-RPC 2.0 route (MCP, A2A): only calls to these methods are guarded, and every other call passes unguarded (the body is read first to tell). The fingerprint is the call without its `id` (its bytes without the id's value; with `fingerprint_body = \"json\"`, its canonical JSON without `/id`); a replay is the recorded answer with the retry's `id`; the proxy's own refusals are JSON-RPC error objects (the problem in `data`); a batch that holds a guarded call gets 400 `call-unreadable`. See [Agents](agents.md)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.graphql",
        default: DefaultValue::Text("none"),
        meaning: "`\"mutations\"`: on a GraphQL route only mutations are guarded; queries and subscriptions pass unguarded. The operation is read with a GraphQL parser, the one `operationName` names or the document's only one. See [Agents](agents.md)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.graphql_unparsable",
        default: DefaultValue::Toml("\"refuse\""),
        meaning: "with `graphql`: a body whose operation cannot be told (not JSON with a `query`, a document that does not parse, no operation by `operationName`, several and none named): `\"refuse\"` (400 `call-unreadable`, nothing forwarded) or `\"pass\"` (forwarded unguarded)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.replay_headers",
        default: DefaultValue::Text("`[\"location\"]` with `replay = \"status\"` or `\"refetch\"`"),
        meaning: "the response fields a `status` or `refetch` record keeps (never one in `replay_exclude_headers`); refused with `replay = \"stored\"`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.refetch.path",
        default: DefaultValue::Text("— (required with `replay = \"refetch\"`)"),
        meaning: "the path and query a retry of a completed request is answered from, on the route's upstream; `{key}` and `{record}` as in a probe's path. Sent with the retry's own headers (its `Authorization`) and no body; a 5xx, a timeout or a refused connection answers 503 `replay-unavailable` and never runs the operation again; any other answer (a 401 or 403 too) is the client's, with `Idempotent-Replayed: true`",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.refetch.method",
        default: DefaultValue::Toml("\"GET\""),
        meaning: "`GET` or `HEAD`: a refetch never runs the operation",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.refetch.timeout",
        default: DefaultValue::Text("the route's `upstream_timeout`"),
        meaning: "how long a refetch may take, its body included",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.header",
        default: DefaultValue::Toml("\"authorization\""),
        meaning: "with `[route.idempotency.scope_jwt]`: where the `Bearer` token is",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.claim",
        default: DefaultValue::Toml("\"sub\""),
        meaning: "the verified claim that scopes the records",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.jwks_file",
        default: DefaultValue::Required,
        meaning: "a JWKS file: RS256, ES256 and EdDSA keys (give this or `hs256_secret_env`)",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.hs256_secret_env",
        default: DefaultValue::Required,
        meaning: "the environment variable holding an HS256 secret of 32 bytes or more",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.issuer",
        default: DefaultValue::Text("none"),
        meaning: "when set, `iss` must equal it",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.audience",
        default: DefaultValue::Text("none"),
        meaning: "when set, `aud` must equal or contain it",
        backends: Backends::All,
    },
    Setting {
        key: "route.cors.allow_origins",
        default: DefaultValue::Required,
        meaning: "the browser origins (`https://app.example.com`, exact, lower case) whose CORS preflights the proxy answers itself, and whose answers carry `Access-Control-Allow-Origin` and expose `Idempotent-Replayed`, `Idempotency-Expires`, `Idempotency-Reconciled` and `Retry-After`; `[\"*\"]` alone is every origin (never with `allow_credentials`). Another origin gets no CORS field, and the upstream's own CORS fields are dropped from every answer on the route. See [Browsers](browsers.md)",
        backends: Backends::All,
    },
    Setting {
        key: "route.cors.allow_methods",
        default: DefaultValue::Toml("[\"GET\", \"POST\", \"PUT\", \"PATCH\", \"DELETE\"]"),
        meaning: "`Access-Control-Allow-Methods` of a preflight's answer",
        backends: Backends::All,
    },
    Setting {
        key: "route.cors.allow_headers",
        default: DefaultValue::Toml("[\"Content-Type\", \"Authorization\"]"),
        meaning: "`Access-Control-Allow-Headers` of a preflight's answer; the route's key `header`, its `header:` key sources and its `scope_headers` are always added",
        backends: Backends::All,
    },
    Setting {
        key: "route.cors.max_age",
        default: DefaultValue::Toml("\"10m\""),
        meaning: "how long a browser may keep a preflight's answer (`Access-Control-Max-Age`)",
        backends: Backends::All,
    },
    Setting {
        key: "route.cors.allow_credentials",
        default: DefaultValue::Toml("false"),
        meaning: "`Access-Control-Allow-Credentials: true`: a browser sends cookies and reads the answer",
        backends: Backends::All,
    },
    Setting {
        key: "route.idempotency.scope_jwt.leeway",
        default: DefaultValue::Toml("\"30s\""),
        meaning: "clock skew allowed on `exp` and `nbf`",
        backends: Backends::All,
    },
];

/// What the page says before the table.
const INTRO: &str = "# Configuration reference

One TOML file (`idemproxy serve --config PATH`; `idemproxy check --config PATH`
validates it and prints what it understood). Durations are strings such as `\"250ms\"`,
`\"30s\"`, `\"24h\"`. Sizes are a number of bytes or a string with a unit, such as
`\"64KiB\"`, `\"256MiB\"`, `\"1GiB\"` (binary) or `\"10MB\"` (decimal); `check` prints
both. Unknown keys are errors, and every error names the file, the line and the field.
Only `route.name`, `route.path_prefix`, `route.upstream`, and the store's address
(`store.path` with SQLite, `store.url` with Redis or Postgres, or `store.urls` and
`store.master_name`) are required. The `[store]` table's column `backends` names the
backends that take each setting: any other refuses it, naming those.

This page is printed by `idemproxy config reference` from the code's own list of
settings; a test fails when the two disagree.
";

/// What the page says after the table.
const OUTRO: &str = "
Paths (`cert_file`, `key_file`, the CA files, the store's TLS files, `jwks_file`) are
relative to the config file's directory. `idemproxy check` reads every one of them and
names a bad one by its field; it also warns about each guarded route with neither
`scope_headers` nor `scope_jwt` (every client then shares one key space).

A route without a `[route.idempotency]` table is a plain reverse-proxy route.
";

/// The configuration reference, as Markdown: the book's configuration page. The
/// `[store]` settings are a table of their own, with the backends that take each.
pub fn markdown() -> String {
    let mut page = String::from(INTRO);
    let mut in_store = None;
    for setting in SETTINGS {
        let store = setting.key.starts_with("store.");
        if in_store != Some(store) {
            page.push_str(if store {
                "\n| key | backends | default | meaning |\n|---|---|---|---|\n"
            } else {
                "\n| key | default | meaning |\n|---|---|---|\n"
            });
            in_store = Some(store);
        }
        let default = match setting.default {
            DefaultValue::Toml(value) => format!("`{value}`"),
            DefaultValue::Text(text) => text.to_string(),
            DefaultValue::Required => "—".to_string(),
        };
        let backends = match setting.backends {
            _ if !store => String::new(),
            Backends::All => "all | ".to_string(),
            Backends::Only { backends, .. } => {
                let named: Vec<String> = backends.iter().map(|name| format!("`{name}`")).collect();
                format!("{} | ", named.join(", "))
            }
        };
        page.push_str(&format!(
            "| `{}` | {backends}{default} | {} |\n",
            setting.key, setting.meaning
        ));
    }
    page.push_str(OUTRO);
    page
}

/// The table `key` is in (`server` for `server.listen`), and its own name in it.
pub fn split(key: &str) -> (&str, &str) {
    key.rsplit_once('.').unwrap_or(("", key))
}
