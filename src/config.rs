//! Configuration: the validated `Config` the rest of the proxy reads, loaded from one
//! TOML file, and the summary `idemproxy check` prints. The raw structs live in `raw`,
//! the rules that turn them into this in `validate`. Every error names the file, the
//! line and the field. This module does no I/O beyond reading the file it is given and
//! the certificate, key and CA files that file names (relative to its directory).

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use http::Method;
use http::header::HeaderName;
use serde::Deserialize;

pub use crate::canonical_json::JsonPointer;
use crate::error::ConfigError;
use crate::jwt::JwtVerifier;
pub use crate::problem::Profile;
pub use crate::request_target::{PathPolicy, Spelling};

pub mod key;
mod raw;
pub mod reference;
mod upstream;
mod validate;

pub use self::key::KeySource;
pub use self::upstream::Upstream;

/// One second beyond the upstream timeout: how long an owner may hold a claim.
pub const LEASE_GRACE: Duration = Duration::from_secs(1);

// === validated configuration ===

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: Option<AdminConfig>,
    pub store: StoreConfig,
    /// `[tracing]` with an `otlp_endpoint`: traces exported; `None`: no traces.
    pub tracing: Option<TracingConfig>,
    pub routes: Vec<Route>,
    /// SHA-256 of the file's bytes, hex: what `sha256sum` prints for it, and what
    /// `/metrics` reports as loaded.
    pub sha256: String,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_request_body_bytes: u64,
    pub header_read_timeout: Duration,
    pub request_body_timeout: Duration,
    /// A guarded body with no byte for this long is cut, 408.
    pub request_body_idle_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Worker threads, each with its own runtime and listening socket.
    pub workers: usize,
    /// Client connections the process holds at once; more wait in the kernel backlog.
    pub max_connections: usize,
    /// Guarded requests in flight at once, from reading the body to recording the
    /// response; more get 503 `overloaded`.
    pub max_guarded_requests: usize,
    /// The bytes guarded requests' bodies may hold at once while they are buffered
    /// (request bodies three quarters of it); past it, 503 `overloaded`.
    pub max_buffered_bytes: u64,
    /// Duplicates waiting for their first request at once (`wait_for_in_flight`);
    /// more get 409 at once.
    pub max_waiters: usize,
    /// One log line per request, with target `idemproxy::access`.
    pub access_log: bool,
    /// Where the proxy answers with its published idempotency contract
    /// (`/.well-known/idempotency`); `None` when `contract_path = ""`.
    pub contract_path: Option<String>,
    /// How request paths are made canonical before they are routed and forwarded.
    pub paths: PathPolicy,
    /// TLS on the listener, when configured.
    pub tls: Option<ServerTls>,
}

/// TLS on the listener: the files it came from, and the configuration made of them.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// When set, every client must present a certificate this CA signed.
    pub client_ca_file: Option<PathBuf>,
    pub config: Arc<rustls::ServerConfig>,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// With `token_file`: the records API is on, for this Bearer token.
    pub token: Option<AdminToken>,
}

/// The admin token, kept only as its SHA-256: the comparison then takes the same time
/// whatever the presented token shares with it.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken {
    pub file: PathBuf,
    digest: [u8; 32],
}

impl AdminToken {
    /// The token in `text` (surrounding whitespace ignored), from `file`.
    pub(crate) fn new(file: PathBuf, text: &str) -> AdminToken {
        AdminToken {
            file,
            digest: sha256(text.trim().as_bytes()),
        }
    }

    /// Whether `presented` is the token.
    pub fn verify(&self, presented: &[u8]) -> bool {
        sha256(presented) == self.digest
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AdminToken({})", self.file.display())
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// `[tracing]` (docs/design.md §16): where spans go, under what service name, and the share of
/// the traces started here that are sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// OTLP over HTTP (protobuf): `/v1/traces` is appended to an endpoint given as a
    /// bare origin, as OpenTelemetry's own `OTEL_EXPORTER_OTLP_ENDPOINT` does.
    pub otlp_endpoint: http::Uri,
    pub service_name: String,
    /// Parent-based: a client's sampled (or not) trace context decides for its
    /// request; this ratio decides for the traces the proxy starts.
    pub sample_ratio: f64,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub backend: Backend,
    pub key_prefix: String,
    pub timeout: Duration,
    /// `[store.encryption]`: the keys recorded responses are sealed with.
    pub encryption: Option<Encryption>,
    /// `[store.previous]`: the shared store a fleet is switching from, read for keys
    /// this one does not hold until `until` (docs/design.md §26). A reload may add,
    /// change or drop it.
    pub previous: Option<Previous>,
}

/// `[store.previous]`: a Redis or Postgres store, read only, with the key prefix and
/// record keys of the store it precedes.
#[derive(Debug, Clone, PartialEq)]
pub struct Previous {
    pub backend: Backend,
    pub timeout: Duration,
    /// Past this time it is not read.
    pub until: std::time::SystemTime,
}

/// `[store.encryption]` (docs/design.md §20): new records are sealed with `current`;
/// records sealed with one of `previous` still open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encryption {
    /// The variable `current` was read from, and the one `previous` was, for `check`.
    pub key_env: String,
    pub previous_keys_env: Option<String>,
    pub current: RecordKey,
    pub previous: Vec<RecordKey>,
    /// Whether a record kept in clear (written before encryption was on) replays; by
    /// default it is unreadable, since anyone who can write the store can write one.
    pub accept_clear_records: bool,
}

/// One record key: 32 bytes, never printed; named by its id.
#[derive(Clone, PartialEq, Eq)]
pub struct RecordKey {
    bytes: [u8; 32],
    id: String,
}

impl RecordKey {
    /// A key given as base64 of exactly 32 bytes (with or without padding).
    pub fn from_base64(text: &str) -> Option<RecordKey> {
        use base64::Engine as _;
        let text = text.trim();
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(text)
            .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(text))
            .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(text))
            .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(text))
            .ok()?;
        Some(RecordKey::from_bytes(<[u8; 32]>::try_from(decoded).ok()?))
    }

    pub fn from_bytes(bytes: [u8; 32]) -> RecordKey {
        // The id is an HMAC of a fixed text under the key: it names the key, and tells
        // nothing of it.
        let mac = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes);
        let tag = ring::hmac::sign(&mac, b"idemproxy record key id v1");
        RecordKey {
            bytes,
            id: const_hex::encode(&tag.as_ref()[..4]),
        }
    }

    /// 8 hex digits that name the key in a record, in `check` and in the records API.
    pub fn id(&self) -> &str {
        &self.id
    }

    pub(crate) fn bytes(&self) -> &[u8; 32] {
        &self.bytes
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({})", self.id)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// In this process's memory: forgets every record when the process ends.
    Memory(StoreLimits),
    /// A SQLite file this process owns: every record survives a restart.
    Sqlite(SqliteConfig),
    Redis(RedisConfig),
    /// A Postgres schema that every instance on the database shares (docs/design.md §22).
    /// Boxed: its parsed connection settings are several times the size of the others.
    Postgres(Box<PostgresConfig>),
}

/// The Postgres store: where it is, how it connects and what it may hold per tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresConfig {
    /// Where the store is and as whom: `store.url` as libpq reads it (several hosts
    /// with `target_session_attrs=read-write`; `sslmode` `verify-ca` and `verify-full`
    /// read as `require`, which over rustls verifies as strictly), parsed once, at
    /// load, with `password_env`'s password set in it. Its `Debug` shows no password.
    pub server: tokio_postgres::Config,
    /// The variable the password was read from, if not from the URL.
    pub password_env: Option<String>,
    /// The schema the tables and functions live in: `[a-z_][a-z0-9_]*`, at most 48.
    pub schema: String,
    /// Create or upgrade the schema at start (else only check its version).
    pub migrate: bool,
    /// Connections each worker keeps (a pool; each statement takes one).
    pub connections: usize,
    /// What a TLS connection trusts and presents (`sslmode` in the URL says when).
    pub tls: Option<StoreTls>,
    /// More than 0: a claim commits only with this many synchronous standbys
    /// streaming, and every commit waits for them to apply it (`remote_apply`).
    pub min_replica_acks: u32,
    /// The live records one scope may hold; its new keys then get 429 `scope-full`.
    pub max_records_per_scope: usize,
}

impl PostgresConfig {
    /// The store at `url` (libpq's syntax, as tokio-postgres reads it) with every other
    /// setting at its default.
    pub fn at(url: &str) -> Result<PostgresConfig, tokio_postgres::Error> {
        Ok(PostgresConfig {
            server: url.parse()?,
            password_env: None,
            schema: "idemproxy".to_string(),
            migrate: true,
            connections: DEFAULT_POSTGRES_CONNECTIONS,
            tls: None,
            min_replica_acks: 0,
            max_records_per_scope: DEFAULT_POSTGRES_MAX_RECORDS_PER_SCOPE,
        })
    }

    /// Where the store is, as `check` and the logs show it: user, hosts, ports and
    /// database, never a password.
    pub fn shown(&self) -> String {
        let pg = &self.server;
        let hosts: Vec<String> = pg
            .get_hosts()
            .iter()
            .zip(pg.get_ports().iter().chain(std::iter::repeat(&5432)))
            .map(|(host, port)| match host {
                tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                tokio_postgres::config::Host::Unix(path) => format!("{}:{port}", path.display()),
            })
            .collect();
        format!(
            "postgres://{}@{}/{}",
            pg.get_user().unwrap_or("(the system user)"),
            hosts.join(","),
            pg.get_dbname().unwrap_or("(the user's database)")
        )
    }
}

/// What an embedded store (memory or SQLite) may hold, in all and per client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    pub max_records: usize,
    pub max_bytes: usize,
    /// The live records, and the bytes they hold, that one scope (a route's client, as
    /// `scope_headers` and `scope_jwt` name it) may have at once.
    pub max_records_per_scope: usize,
    pub max_bytes_per_scope: usize,
    /// The records one client address may hold, across the scopes it sends and on routes without scope.
    pub max_records_per_client: usize,
}

/// The SQLite store: its file, its bounds, and the memory SQLite may cache pages in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteConfig {
    /// The database file (relative paths are resolved against the config's directory).
    pub path: PathBuf,
    /// `max_bytes` bounds the file's pages in use (claims stop at seven eighths of
    /// it); the rest bound the records as on the memory store.
    pub limits: StoreLimits,
    /// What SQLite's page caches may hold, across all of this process's connections.
    pub cache_bytes: usize,
    /// The most the responses being recorded at once may hold (`server.max_buffered_bytes`:
    /// each is buffered whole before it is written): the room kept for claims in flight
    /// is never more than this.
    pub response_budget: usize,
}

/// A Redis store: where it is, and how durable a claim must be before it counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub topology: RedisTopology,
    /// More than 0: a claim counts only once this many replicas acknowledged it
    /// (`WAIT`); fewer within `replica_ack_timeout` releases it and answers 503.
    pub min_replica_acks: u32,
    pub replica_ack_timeout: Duration,
    /// What a `rediss://` connection trusts and presents, when configured.
    pub tls: Option<StoreTls>,
    /// Connections each worker keeps to the store (multiplexed, taken in turn).
    pub connections: usize,
}

/// TLS to the store, beyond the `rediss://` scheme: the CAs a Redis node's certificate
/// must chain to (instead of the webpki roots), and a client certificate for Redis's
/// `tls-auth-clients`. The files are read when store connections are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreTls {
    pub ca_file: Option<PathBuf>,
    pub client: Option<ClientIdentity>,
}

/// A client certificate chain and its key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// The three shapes of a Redis deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTopology {
    /// One primary: `url`.
    Standalone { url: String },
    /// A primary found through Sentinel: `urls` are the sentinels.
    Sentinel { urls: Vec<String>, master_name: String },
    /// A Redis Cluster: `urls` are seed nodes.
    Cluster { urls: Vec<String> },
}

impl Backend {
    /// The backend as `store.backend` names it: what `check`, the start-up line and
    /// the logs call it.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Memory(_) => "memory",
            Backend::Sqlite(_) => "sqlite",
            Backend::Redis(redis) => redis.topology.name(),
            Backend::Postgres(_) => "postgres",
        }
    }
}

impl RedisConfig {
    /// One primary at `url`, claims not waiting for replicas.
    pub fn standalone(url: &str) -> RedisConfig {
        RedisConfig {
            topology: RedisTopology::Standalone { url: url.to_string() },
            min_replica_acks: 0,
            replica_ack_timeout: DEFAULT_REPLICA_ACK_TIMEOUT,
            tls: None,
            connections: DEFAULT_STORE_CONNECTIONS,
        }
    }
}

impl RedisTopology {
    /// The topology as `store.backend` names it.
    pub fn name(&self) -> &'static str {
        match self {
            RedisTopology::Standalone { .. } => "redis",
            RedisTopology::Sentinel { .. } => "redis-sentinel",
            RedisTopology::Cluster { .. } => "redis-cluster",
        }
    }

    /// Every URL the topology is reached by: the primary, the sentinels or the seeds.
    pub fn urls(&self) -> &[String] {
        match self {
            RedisTopology::Standalone { url } => std::slice::from_ref(url),
            RedisTopology::Sentinel { urls, .. } | RedisTopology::Cluster { urls } => urls,
        }
    }
}

impl std::fmt::Display for RedisTopology {
    /// The topology by its name and URLs, passwords redacted: for `check` and logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls = self
            .urls()
            .iter()
            .map(|url| redact_url(url))
            .collect::<Vec<_>>()
            .join(", ");
        match self {
            RedisTopology::Standalone { .. } => write!(f, "redis (one primary) {urls}"),
            RedisTopology::Sentinel { master_name, .. } => {
                write!(f, "redis-sentinel (master {master_name:?} via sentinels {urls})")
            }
            RedisTopology::Cluster { .. } => write!(f, "redis-cluster (seed nodes {urls})"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path_prefix: String,
    pub host: Option<String>,
    pub upstream: Upstream,
    pub upstream_timeout: Duration,
    /// An HTTPS upstream's extra roots (`upstream_ca_file`), beside the webpki roots.
    pub upstream_tls: Option<Arc<rustls::ClientConfig>>,
    /// Where the route's API documents its errors: problem responses carry
    /// `Link: <docs_url>; rel="describedby"` and a `type` of `docs_url#slug`.
    pub docs_url: Option<Arc<str>>,
    /// Shared, so a guarded request holds its policy without borrowing the route.
    pub idempotency: Option<Arc<IdempotencyPolicy>>,
    /// `[route.cors]`: the origins whose preflights the proxy answers (docs/design.md §29).
    pub cors: Option<Arc<Cors>>,
}

/// `[route.cors]`, checked: what the proxy answers a browser's preflight with, and
/// adds to the answers an allowed origin reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cors {
    /// Exact origins (`scheme://host[:port]`), or `None` for any origin (`"*"`).
    pub origins: Option<Vec<String>>,
    /// `Access-Control-Allow-Methods`.
    pub methods: HeaderValue,
    /// `Access-Control-Allow-Headers`: the configured ones, the route's key header and
    /// its header key sources and scope headers.
    pub headers: HeaderValue,
    /// `Access-Control-Max-Age`, in seconds.
    pub max_age: u64,
    pub credentials: bool,
}

/// `route.idempotency.jsonrpc_methods` or `graphql` (docs/design.md §28): which calls
/// on one endpoint are guarded; the rest pass as unguarded requests do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Calls {
    /// JSON-RPC 2.0: a call to one of these methods.
    JsonRpc { methods: Vec<String> },
    /// GraphQL: a mutation; `unparsable` says what a body the parser cannot read gets.
    GraphQl { unparsable: Unparsable },
}

/// `graphql_unparsable`: a GraphQL body whose operation the proxy cannot tell
/// (not JSON with a `query`, a document that does not parse, no operation by that
/// name, or several and no `operationName`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Unparsable {
    /// 400 `call-unreadable`: nothing is forwarded.
    #[default]
    Refuse,
    /// Forwarded unguarded: the upstream answers what it makes of it.
    Pass,
}

#[derive(Debug, Clone)]
pub struct IdempotencyPolicy {
    pub methods: Vec<Method>,
    /// The first header source of `key`, or `header` when `key` has none: the header
    /// a derived upstream key replaces.
    pub header: HeaderName,
    /// Where the key is found, the first source present winning (docs/design.md §23).
    pub key: Vec<KeySource>,
    /// With the `body` source: how long two identical requests are one operation.
    pub dedup_window: Option<Duration>,
    pub required: bool,
    /// How long a recorded response is kept and replayed (docs/design.md §24).
    pub retention: Duration,
    /// How long the key is known: past `retention` the record keeps what the guard
    /// needs (its fingerprint, status and completion time) and a retry gets 410
    /// `response-expired`, never a second run. At least `retention`.
    pub remember: Duration,
    /// How long a duplicate waits for the first request in flight before 409.
    pub wait_for_in_flight: Duration,
    pub fingerprint_headers: Vec<HeaderName>,
    /// `"enforce"`, or `"shadow"`: forward everything, write records, count what
    /// enforce would have done.
    pub mode: Mode,
    /// How the body counts in the fingerprint.
    pub fingerprint_body: FingerprintBody,
    pub scope_headers: Vec<HeaderName>,
    /// Response fields the first client gets and no replay ever does.
    pub replay_exclude_headers: Vec<HeaderName>,
    /// Scope records by a verified claim of the request's bearer token.
    pub scope_jwt: Option<JwtVerifier>,
    pub max_response_body_bytes: u64,
    pub on_server_error: OnServerError,
    /// A 401 or 403 from the upstream: released (the default) or recorded.
    pub on_unauthorized: OnUnauthorized,
    pub on_store_error: OnStoreError,
    /// The key the upstream is sent with a guarded request, and the field it is in.
    pub upstream_key: UpstreamKey,
    pub upstream_key_header: HeaderName,
    /// `[route.idempotency.reconcile]`: how to ask the upstream what became of a
    /// request whose outcome is unknown.
    pub reconcile: Option<Reconcile>,
    /// The statuses and error bodies the route's clients expect.
    pub profile: Profile,
    /// What a record keeps of a response, and how a retry is answered from it.
    pub replay: ReplayKind,
    /// With `replay = "status"` or `"refetch"`: the response fields a record keeps.
    pub replay_headers: Vec<HeaderName>,
    /// With `replay = "refetch"`: how a retry asks the upstream.
    pub refetch: Option<Refetch>,
    /// Which responses reach the first client as the upstream sends them, recorded as
    /// they pass, instead of read whole first.
    pub stream: StreamMode,
    /// On a JSON-RPC or GraphQL route: which calls are guarded.
    pub calls: Option<Calls>,
}

impl IdempotencyPolicy {
    /// Whether the body is read before the claim: the key may be in it, or on a
    /// JSON-RPC or GraphQL route, whether the call is guarded is.
    pub fn key_needs_body(&self) -> bool {
        self.calls.is_some() || self.key.iter().any(KeySource::needs_body)
    }

    /// Whether a probe or a refetch puts the key in a path (`{key}`).
    pub fn key_in_path(&self) -> bool {
        self.reconcile
            .as_ref()
            .is_some_and(|reconcile| reconcile.path.names_key())
            || self.refetch.as_ref().is_some_and(|refetch| refetch.path.names_key())
    }

    /// Whether the key is in one header only, as it is by default: the route answers a
    /// missing or bad key as it always has.
    pub fn key_is_one_header(&self) -> bool {
        matches!(self.key.as_slice(), [KeySource::Header(_)])
    }

    /// The key's sources as `check` says them: the header alone by default.
    pub fn describe_key(&self) -> String {
        let window = self.dedup_window.map(humantime::format_duration);
        let sources = key::describe(&self.key);
        match (self.key.as_slice(), window) {
            ([KeySource::Header(name)], _) => name.to_string(),
            (_, Some(window)) => format!(
                "the key from the first of {sources} (the body read before the claim; body: two identical requests within {window} are one operation, the second replayed)"
            ),
            _ if self.key_needs_body() => {
                format!("the key from the first of {sources} (the body read before the claim)")
            }
            _ => format!("the key from the first of {sources}"),
        }
    }

    /// How a retry is answered, as `check` says it: nothing for `"stored"`.
    pub fn describe_replay(&self) -> String {
        let kept = || {
            let names: Vec<&str> = self.replay_headers.iter().map(HeaderName::as_str).collect();
            match names.as_slice() {
                [] => "the status only".to_string(),
                names => format!("the status and {}", names.join(", ")),
            }
        };
        match (self.replay, &self.refetch) {
            (ReplayKind::Stored, _) => String::new(),
            (ReplayKind::Status, _) => format!(", replays {} with no body", kept()),
            (ReplayKind::Refetch, Some(refetch)) => format!(
                ", no body recorded: retries answered by {} {} with their own headers",
                refetch.method,
                refetch.path.template()
            ),
            (ReplayKind::Refetch, None) => ", retries refetched".to_string(),
        }
    }
}

/// `route.idempotency.stream` (docs/design.md §25): which responses are streamed to
/// the first client and recorded as they pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum StreamMode {
    /// A `text/event-stream` response, and one with no declared length.
    #[default]
    Auto,
    /// Every response.
    Always,
    /// None: each is read whole (within `max_response_body_bytes`), then sent.
    Never,
}

impl StreamMode {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamMode::Auto => "auto",
            StreamMode::Always => "always",
            StreamMode::Never => "never",
        }
    }
}

/// `route.idempotency.replay` (docs/design.md §20).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReplayKind {
    /// The whole response is recorded and replayed.
    #[default]
    Stored,
    /// Only the status and `replay_headers`: replays have an empty body.
    Status,
    /// No body: a retry is answered by the upstream's answer to `refetch`, asked with
    /// the retrying client's own headers.
    Refetch,
}

impl ReplayKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayKind::Stored => "stored",
            ReplayKind::Status => "status",
            ReplayKind::Refetch => "refetch",
        }
    }
}

/// `[route.idempotency.refetch]`: a read-only request for the operation's current
/// state, sent with the retrying request's headers and no body.
#[derive(Debug, Clone)]
pub struct Refetch {
    /// `GET` or `HEAD`: a refetch never runs the operation.
    pub method: Method,
    /// With `{key}` and `{record}`, as a probe's.
    pub path: ProbePath,
    pub timeout: Duration,
}

/// A route's reconciliation probe (docs/design.md §14): a read-only request to the route's
/// upstream that says whether an operation whose outcome is unknown took effect.
#[derive(Debug, Clone)]
pub struct Reconcile {
    /// `GET` or `HEAD`: a probe never runs the operation.
    pub method: Method,
    pub path: ProbePath,
    /// Took effect: this answer becomes the record's response.
    pub applied: Vec<http::StatusCode>,
    /// Did not: the key is released.
    pub not_applied: Vec<http::StatusCode>,
    pub first_after: Duration,
    pub every: Duration,
    pub give_up_after: Duration,
    /// How long one probe may take, its body included.
    pub timeout: Duration,
    /// How many probes of this route may run at once in one process.
    pub max_concurrent: usize,
}

impl Reconcile {
    /// How long one probe holds the record's probe lease: its timeout, and a second
    /// beyond it for the store round trips around it.
    pub fn lease(&self) -> Duration {
        self.timeout + LEASE_GRACE
    }
}

/// A probe's path and query, with `{key}` (the key as forwarded upstream,
/// percent-encoded) and `{record}` (the record's operation id) to fill in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePath(pub(crate) Vec<ProbePiece>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ProbePiece {
    Literal(String),
    Key,
    Record,
}

impl ProbePath {
    /// The path with `key` and `record` in their places. A key is visible ASCII; every
    /// byte of it but letters, digits, `-`, `_` and `~` is percent-encoded, `.` too,
    /// so that it stays one path segment (or one query value): never a `.` or `..`
    /// segment that an upstream which normalises paths would remove.
    pub fn render(&self, key: &str, record: &str) -> String {
        const ENCODED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
            .remove(b'-')
            .remove(b'_')
            .remove(b'~');
        let mut path = String::new();
        for piece in &self.0 {
            match piece {
                ProbePiece::Literal(text) => path.push_str(text),
                ProbePiece::Key => path.extend(percent_encoding::utf8_percent_encode(key, ENCODED)),
                ProbePiece::Record => path.push_str(record),
            }
        }
        path
    }

    /// Whether the path names the key as forwarded upstream.
    pub fn names_key(&self) -> bool {
        self.0.contains(&ProbePiece::Key)
    }

    /// The template as configured, for logs: never a key.
    pub fn template(&self) -> String {
        self.0
            .iter()
            .map(|piece| match piece {
                ProbePiece::Literal(text) => text.as_str(),
                ProbePiece::Key => "{key}",
                ProbePiece::Record => "{record}",
            })
            .collect()
    }
}

/// `upstream_key`: which idempotency key a guarded request carries to the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamKey {
    /// The client's own key, as it sent it.
    Client,
    /// The record's operation id (`StoreKey::operation_id`): unique per route, scope
    /// and client key, so an upstream that deduplicates on it never confuses two
    /// tenants' keys; it reveals none of them.
    Derived,
    /// No key: the field is removed.
    None,
}

/// A guarded route's `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Claims, replays and refusals as the contract says.
    Enforce,
    /// Every request forwarded as on an unguarded route; claims and records written as
    /// in enforce mode; `idemproxy_shadow_decisions_total{would}` counts what enforce
    /// would have done.
    Shadow,
}

/// `fingerprint_body` (with `fingerprint_ignore`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintBody {
    /// Every byte counts.
    Bytes,
    /// The canonical JSON value counts, without what `ignore` points at; a body that
    /// is not JSON counts by its bytes.
    Json { ignore: Vec<JsonPointer> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnServerError {
    Release,
    Store,
}

/// `on_unauthorized`: what a 401 or 403 from the upstream does to the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnauthorized {
    /// The request was refused, not executed: the key is released, and nothing is kept.
    Release,
    /// Recorded and replayed like any other answer.
    Store,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    Reject,
    Forward,
}

impl Route {
    /// Whether the route is guarded in shadow mode.
    pub fn shadow(&self) -> bool {
        self.idempotency
            .as_ref()
            .is_some_and(|policy| policy.mode == Mode::Shadow)
    }

    /// The route's probe, when it is guarded in enforce mode and has one: shadow mode
    /// forwards every retry anyway, so it never probes.
    pub fn reconcile(&self) -> Option<&Reconcile> {
        self.idempotency
            .as_ref()
            .filter(|policy| policy.mode == Mode::Enforce)
            .and_then(|policy| policy.reconcile.as_ref())
    }

    /// How long a claim's owner may hold it before the record reads as unknown.
    pub fn lease(&self) -> Duration {
        self.upstream_timeout + LEASE_GRACE
    }
}

impl Config {
    /// What `check` and the start warn about: settings that are valid and probably
    /// not what the operator wants.
    pub fn warnings(&self) -> Vec<String> {
        let forgets = matches!(self.store.backend, Backend::Memory(_)).then(|| {
            "store.backend = \"memory\" forgets every record when the process stops: a retry across a restart, \
             a deploy or a crash runs again; use \"sqlite\" (one instance, its records in a file) or a Redis backend"
                .to_string()
        });
        forgets
            .into_iter()
            .chain(
                self.routes
                    .iter()
                    .filter(|route| {
                        route
                            .idempotency
                            .as_ref()
                            .is_some_and(|policy| policy.scope_headers.is_empty() && policy.scope_jwt.is_none())
                    })
                    .map(|route| {
                        format!(
                            "route {}: no scope_headers or scope_jwt: all clients share one key space, so a client \
                     that knows another's key gets that client's recorded response",
                            route.name
                        )
                    }),
            )
            .collect()
    }

    /// The settings that differ between `self` and `new` and that only a restart can
    /// change, as their config names: the listeners, the workers and every bound
    /// fixed at start, and the store. A reload (SIGHUP) swaps everything else: routes,
    /// their policies and upstreams, the request body limits, the access log, the
    /// listener's certificates and client CA, and the admin token.
    pub fn needs_restart(&self, new: &Config) -> Vec<&'static str> {
        let (server, next) = (&self.server, &new.server);
        let admin_listen = |config: &Config| config.admin.as_ref().map(|admin| admin.listen);
        [
            ("server.listen", server.listen != next.listen),
            ("server.workers", server.workers != next.workers),
            ("server.max_connections", server.max_connections != next.max_connections),
            (
                "server.max_guarded_requests",
                server.max_guarded_requests != next.max_guarded_requests,
            ),
            (
                "server.max_buffered_bytes",
                server.max_buffered_bytes != next.max_buffered_bytes,
            ),
            ("server.max_waiters", server.max_waiters != next.max_waiters),
            (
                "server.header_read_timeout",
                server.header_read_timeout != next.header_read_timeout,
            ),
            ("server.shutdown_grace", server.shutdown_grace != next.shutdown_grace),
            (
                "server.tls (on or off; its files reload)",
                server.tls.is_some() != next.tls.is_some(),
            ),
            ("admin.listen", admin_listen(self) != admin_listen(new)),
            ("store", self.store.backend != new.store.backend),
            ("store.key_prefix", self.store.key_prefix != new.store.key_prefix),
            ("store.timeout", self.store.timeout != new.store.timeout),
            ("store.encryption", self.store.encryption != new.store.encryption),
            ("tracing", self.tracing != new.tracing),
        ]
        .into_iter()
        .filter_map(|(name, changed)| changed.then_some(name))
        .collect()
    }

    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let source = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&source, path)
    }

    /// Validates `source`; `path` is only used to name the file in errors.
    pub fn parse(source: &str, path: &Path) -> Result<Config, ConfigError> {
        validate::parse(source, path)
    }
}

/// The memory store's bound when `store.max_records` is not set.
pub const DEFAULT_MAX_RECORDS: usize = 100_000;

/// The SQLite store's bound on records when `store.max_records` is not set: its bound
/// on bytes (`max_bytes`) is the one that matters on disk.
pub const DEFAULT_SQLITE_MAX_RECORDS: usize = 10_000_000;

/// The SQLite store's bound on its file when `store.max_bytes` is not set: 1 GiB.
pub const DEFAULT_SQLITE_MAX_BYTES: usize = 1024 * 1024 * 1024;

/// SQLite's page caches when `store.cache_bytes` is not set: 32 MiB.
pub const DEFAULT_SQLITE_CACHE_BYTES: usize = 32 * 1024 * 1024;

/// Guarded requests in flight at once when `server.max_guarded_requests` is not set:
/// four times the 4,000 a 2 s API at 2,000 requests a second keeps in flight. What
/// each costs besides its bodies (its state, its head) is bounded by it; the bodies
/// are bounded by `max_buffered_bytes`.
pub const DEFAULT_MAX_GUARDED_REQUESTS: usize = 16_384;

/// The bytes buffered bodies hold at once when `server.max_buffered_bytes` is not set:
/// 256 MiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 256 * 1024 * 1024;

/// Waiters at once when `server.max_waiters` is not set.
pub const DEFAULT_MAX_WAITERS: usize = 10_000;

/// The memory store's byte bound when `store.max_bytes` is not set: 256 MiB.
pub const DEFAULT_MAX_BYTES: usize = 256 * 1024 * 1024;

/// The live records one scope may hold on the Postgres store when
/// `store.max_records_per_scope` is not set.
pub const DEFAULT_POSTGRES_MAX_RECORDS_PER_SCOPE: usize = 1_000_000;

/// Connections each worker keeps to a Postgres store when `store.connections` is not set.
pub const DEFAULT_POSTGRES_CONNECTIONS: usize = 4;

/// Connections each worker keeps to a Redis store when `store.connections` is not set.
pub const DEFAULT_STORE_CONNECTIONS: usize = 1;

/// How long a claim waits for its replicas when `store.replica_ack_timeout` is not set.
pub const DEFAULT_REPLICA_ACK_TIMEOUT: Duration = Duration::from_millis(100);

impl std::fmt::Display for Config {
    /// The summary `idemproxy check` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.server.tls {
            None => writeln!(f, "listen {}", self.server.listen)?,
            Some(tls) => writeln!(
                f,
                "listen {} (TLS, certificate {}{})",
                self.server.listen,
                tls.cert_file.display(),
                tls.client_ca_file
                    .as_ref()
                    .map_or_else(String::new, |ca| format!(", client certificates from {}", ca.display()))
            )?,
        }
        if let Some(admin) = &self.admin {
            match &admin.token {
                None => writeln!(f, "admin  {} (records API off: no token_file)", admin.listen)?,
                Some(token) => writeln!(
                    f,
                    "admin  {} (records API on, token from {})",
                    admin.listen,
                    token.file.display()
                )?,
            }
        }
        writeln!(
            f,
            "limits max_connections {}, max_buffered_bytes {} (request bodies at most {} of it), \
             max_guarded_requests {}, max_request_body_bytes {}",
            self.server.max_connections,
            size(self.server.max_buffered_bytes),
            unit(self.server.max_buffered_bytes / 4 * 3),
            self.server.max_guarded_requests,
            size(self.server.max_request_body_bytes),
        )?;
        writeln!(f, "paths  {}", self.server.paths)?;
        match &self.tracing {
            None => writeln!(f, "traces off (no [tracing] otlp_endpoint)")?,
            Some(tracing) => writeln!(
                f,
                "traces OTLP/HTTP to {} as service {:?}, sampling {} of new traces (a client's sampled flag wins)",
                tracing.otlp_endpoint, tracing.service_name, tracing.sample_ratio
            )?,
        }
        match &self.store.backend {
            Backend::Memory(limits) => {
                writeln!(f, "store  memory ({}) forgets every record on restart", limits.show())?
            }
            Backend::Sqlite(sqlite) => writeln!(
                f,
                "store  sqlite {} ({}; page cache {})",
                sqlite.path.display(),
                sqlite.limits.show(),
                unit(sqlite.cache_bytes as u64),
            )?,
            Backend::Redis(redis) => writeln!(f, "store  {redis}")?,
            Backend::Postgres(postgres) => writeln!(f, "store  {postgres}")?,
        }
        if let Some(previous) = &self.store.previous {
            let until = humantime::format_rfc3339_seconds(previous.until);
            match &previous.backend {
                Backend::Redis(redis) => write!(f, "previous {redis}")?,
                Backend::Postgres(postgres) => write!(f, "previous {postgres}")?,
                Backend::Memory(_) | Backend::Sqlite(_) => write!(f, "previous (embedded)")?,
            }
            writeln!(f, ", read for keys the store does not hold until {until}")?;
        }
        match &self.store.encryption {
            None => writeln!(
                f,
                "sealed no: recorded responses are kept in clear (see [store.encryption])"
            )?,
            Some(encryption) => {
                write!(
                    f,
                    "sealed new records with key {} (from {})",
                    encryption.current.id(),
                    encryption.key_env
                )?;
                match &encryption.previous_keys_env {
                    Some(variable) if !encryption.previous.is_empty() => writeln!(
                        f,
                        "; records under {} (from {variable}) still open",
                        encryption
                            .previous
                            .iter()
                            .map(RecordKey::id)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )?,
                    _ => writeln!(f, "; no previous keys")?,
                }
            }
        }
        for route in &self.routes {
            let guard = match &route.idempotency {
                None => "unguarded".to_string(),
                Some(policy) => format!(
                    "{} {} by {} (retention {}{}){}{}",
                    match policy.mode {
                        Mode::Enforce => "guards",
                        Mode::Shadow => "shadows",
                    },
                    policy.methods.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
                    policy.describe_key(),
                    humantime::format_duration(policy.retention),
                    match policy.remember > policy.retention {
                        true => format!(", remember {}", humantime::format_duration(policy.remember)),
                        false => String::new(),
                    },
                    policy
                        .scope_jwt
                        .as_ref()
                        .map_or_else(String::new, |jwt| format!(", scoped by the {}", jwt.describe())),
                    match &policy.fingerprint_body {
                        FingerprintBody::Bytes => String::new(),
                        FingerprintBody::Json { ignore } =>
                            format!(", JSON bodies ({} pointers ignored)", ignore.len()),
                    } + &if policy.wait_for_in_flight.is_zero() {
                        String::new()
                    } else {
                        format!(
                            ", duplicates wait {}",
                            humantime::format_duration(policy.wait_for_in_flight)
                        )
                    } + &match policy.upstream_key {
                        UpstreamKey::Client
                            if policy.key_is_one_header() && policy.upstream_key_header == policy.header =>
                            String::new(),
                        UpstreamKey::Client =>
                            format!(", the client's key sent upstream as {}", policy.upstream_key_header),
                        UpstreamKey::Derived =>
                            format!(", the operation id sent upstream as {}", policy.upstream_key_header),
                        UpstreamKey::None => ", no key sent upstream".to_string(),
                    } + &match (&policy.reconcile, policy.mode) {
                        (Some(reconcile), Mode::Enforce) => format!(
                            ", unknown outcomes probed by {} {} after {}, every {} for {}",
                            reconcile.method,
                            reconcile.path.template(),
                            humantime::format_duration(reconcile.first_after),
                            humantime::format_duration(reconcile.every),
                            humantime::format_duration(reconcile.give_up_after),
                        ),
                        (Some(_), Mode::Shadow) => ", its probe idle in shadow mode".to_string(),
                        (None, _) => String::new(),
                    } + &policy.describe_replay()
                        + match policy.profile {
                            Profile::Ietf => "",
                            Profile::Stripe => ", Stripe-style errors",
                        }
                ),
            };
            let docs = route
                .docs_url
                .as_deref()
                .map_or_else(String::new, |docs| format!(", errors documented at {docs}"));
            writeln!(
                f,
                "route  {} {}{} -> {} ({guard}{docs})",
                route.name,
                route.host.as_deref().unwrap_or(""),
                route.path_prefix,
                route.upstream
            )?;
        }
        Ok(())
    }
}

impl std::fmt::Display for StoreTls {
    /// What a store connection trusts and presents, as `check` prints it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "; TLS trusting {}",
            self.ca_file
                .as_ref()
                .map_or_else(|| "the webpki roots".to_string(), |ca| ca.display().to_string())
        )?;
        if let Some(client) = &self.client {
            write!(f, ", client certificate {}", client.cert_file.display())?;
        }
        Ok(())
    }
}

impl std::fmt::Display for RedisConfig {
    /// The topology as `idemproxy check` prints it, passwords redacted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.topology)?;
        if let Some(tls) = &self.tls {
            write!(f, "{tls}")?;
        }
        match self.min_replica_acks {
            0 => write!(f, "; claims are not replica-acknowledged"),
            acks => write!(
                f,
                "; a claim waits for {acks} replica acknowledgement(s) within {}",
                humantime::format_duration(self.replica_ack_timeout)
            ),
        }
    }
}

impl std::fmt::Display for PostgresConfig {
    /// The store as `idemproxy check` prints it: never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "postgres {} schema {}", self.shown(), self.schema)?;
        let in_url = self.server.get_password().is_some();
        match (&self.password_env, in_url) {
            (Some(variable), _) => write!(f, "; password from ${variable}")?,
            (None, true) => write!(f, "; password in the URL")?,
            (None, false) => {}
        }
        write!(
            f,
            "; {}",
            if self.migrate {
                "creates or upgrades its schema at start"
            } else {
                "its schema applied by hand (migrate = false)"
            }
        )?;
        write!(f, "; {} connection(s) per worker", self.connections)?;
        if let Some(tls) = &self.tls {
            write!(f, "{tls}")?;
        }
        write!(f, "; at most {} live records per scope", self.max_records_per_scope)?;
        match self.min_replica_acks {
            0 => write!(f, "; claims are not standby-acknowledged"),
            acks => write!(
                f,
                "; a claim needs {acks} synchronous standby(s) and every commit waits for them to apply it (synchronous_commit = remote_apply)"
            ),
        }
    }
}

impl StoreLimits {
    /// At most `max_records` records, and no other bound: for tests and benchmarks.
    pub fn unbounded(max_records: usize) -> StoreLimits {
        StoreLimits {
            max_records,
            max_bytes: usize::MAX,
            max_records_per_scope: max_records,
            max_bytes_per_scope: usize::MAX,
            max_records_per_client: max_records,
        }
    }

    /// The bounds as `check` prints them.
    fn show(&self) -> String {
        format!(
            "max_records {}, max_bytes {}; per scope {} records, {}; per client address {} records",
            self.max_records,
            size(self.max_bytes as u64),
            self.max_records_per_scope,
            unit(self.max_bytes_per_scope as u64),
            self.max_records_per_client,
        )
    }
}

/// A size as `check` prints it: its bytes, and in the largest binary unit that fits
/// (`268435456 = 256 MiB`), as it may be written in the config.
fn size(bytes: u64) -> String {
    match unit(bytes) {
        unit if unit.ends_with(" B") => unit,
        unit => format!("{bytes} = {unit}"),
    }
}

/// `bytes` in the largest binary unit that fits: whole (`256 MiB`) or to a tenth
/// (`1.5 MiB`).
fn unit(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match UNITS.iter().find(|(_, size)| bytes >= *size) {
        None => format!("{bytes} B"),
        Some((name, size)) if bytes.is_multiple_of(*size) => format!("{} {name}", bytes / size),
        Some((name, size)) => format!("{:.1} {name}", bytes as f64 / *size as f64),
    }
}

/// A Redis URL with its password, if any, replaced by `***`.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}://{user}:***{}", &url[..scheme_end], &url[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests;
