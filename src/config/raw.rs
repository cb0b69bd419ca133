//! The configuration exactly as users write it: serde structs with the defaults of
//! docs/design.md §2, unknown keys refused, and spans kept where validation may need to point
//! at a value. Nothing here checks a value; `validate` does.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{Mode, OnServerError, OnStoreError, OnUnauthorized, ReplayKind, StreamMode, Unparsable, UpstreamKey};
use crate::problem::Profile;
use crate::request_target::Spelling;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) server: RawServer,
    pub(super) admin: Option<RawAdmin>,
    #[serde(default)]
    pub(super) store: RawStore,
    pub(super) tracing: Option<RawTracing>,
    #[serde(rename = "route")]
    pub(super) routes: Option<Spanned<Vec<RawRoute>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawServer {
    pub(super) listen: SocketAddr,
    pub(super) max_request_body_bytes: Spanned<ByteSize>,
    pub(super) header_read_timeout: Spanned<HumanDuration>,
    pub(super) request_body_timeout: Spanned<HumanDuration>,
    pub(super) request_body_idle_timeout: Spanned<HumanDuration>,
    pub(super) shutdown_grace: HumanDuration,
    pub(super) workers: Option<Spanned<usize>>,
    pub(super) max_connections: Spanned<usize>,
    pub(super) max_guarded_requests: Spanned<usize>,
    pub(super) max_buffered_bytes: Spanned<ByteSize>,
    pub(super) max_waiters: Spanned<usize>,
    pub(super) access_log: bool,
    pub(super) contract_path: Spanned<String>,
    pub(super) merge_slashes: bool,
    pub(super) escaped_slashes: Spelling,
    pub(super) path_parameters: Spelling,
    pub(super) tls: Option<RawTls>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) cert_file: Spanned<String>,
    pub(super) key_file: Spanned<String>,
    pub(super) client_ca_file: Option<Spanned<String>>,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_request_body_bytes: Spanned::new(0..0, ByteSize(1024 * 1024)),
            header_read_timeout: Spanned::new(0..0, HumanDuration(Duration::from_secs(10))),
            request_body_timeout: Spanned::new(0..0, HumanDuration(Duration::from_secs(30))),
            request_body_idle_timeout: Spanned::new(0..0, HumanDuration(Duration::from_secs(10))),
            shutdown_grace: HumanDuration(Duration::from_secs(30)),
            workers: None,
            max_connections: Spanned::new(0..0, 10_000),
            max_guarded_requests: Spanned::new(0..0, super::DEFAULT_MAX_GUARDED_REQUESTS),
            max_buffered_bytes: Spanned::new(0..0, ByteSize(super::DEFAULT_MAX_BUFFERED_BYTES)),
            max_waiters: Spanned::new(0..0, super::DEFAULT_MAX_WAITERS),
            access_log: false,
            contract_path: Spanned::new(0..0, "/.well-known/idempotency".into()),
            merge_slashes: true,
            escaped_slashes: Spelling::Reject,
            path_parameters: Spelling::Reject,
            tls: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    #[serde(default = "default_admin_listen")]
    pub(super) listen: SocketAddr,
    pub(super) token_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    pub(super) otlp_endpoint: Option<Spanned<String>>,
    #[serde(default = "default_service_name")]
    pub(super) service_name: Spanned<String>,
    #[serde(default = "default_sample_ratio")]
    pub(super) sample_ratio: Spanned<f64>,
}

fn default_service_name() -> Spanned<String> {
    Spanned::new(0..0, "idemproxy".into())
}

fn default_sample_ratio() -> Spanned<f64> {
    Spanned::new(0..0, 1.0)
}

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum BackendKind {
    Memory,
    Sqlite,
    Redis,
    RedisSentinel,
    RedisCluster,
    Postgres,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawStore {
    pub(super) backend: Spanned<BackendKind>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) urls: Option<Spanned<Vec<String>>>,
    pub(super) master_name: Option<Spanned<String>>,
    pub(super) key_prefix: Spanned<String>,
    pub(super) timeout: Spanned<HumanDuration>,
    pub(super) max_records: Option<Spanned<usize>>,
    pub(super) max_bytes: Option<Spanned<ByteSize>>,
    pub(super) max_records_per_scope: Option<Spanned<usize>>,
    pub(super) max_bytes_per_scope: Option<Spanned<ByteSize>>,
    pub(super) max_records_per_client: Option<Spanned<usize>>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) cache_bytes: Option<Spanned<ByteSize>>,
    pub(super) min_replica_acks: Option<Spanned<u32>>,
    pub(super) replica_ack_timeout: Option<Spanned<HumanDuration>>,
    pub(super) connections: Option<Spanned<usize>>,
    pub(super) tls_ca_file: Option<Spanned<String>>,
    pub(super) tls_cert_file: Option<Spanned<String>>,
    pub(super) tls_key_file: Option<Spanned<String>>,
    pub(super) encryption: Option<Spanned<RawEncryption>>,
    pub(super) password_env: Option<Spanned<String>>,
    pub(super) schema: Option<Spanned<String>>,
    pub(super) migrate: Option<Spanned<bool>>,
    /// `[store.previous]`: the store being moved from, read only (docs/design.md §26).
    pub(super) previous: Option<Spanned<RawPrevious>>,
}

/// `[store.previous]`: where the previous store is and as whom, as `[store]` says it
/// for those backends, and until when it is read.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrevious {
    pub(super) backend: Spanned<BackendKind>,
    pub(super) until: Option<Spanned<String>>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) urls: Option<Spanned<Vec<String>>>,
    pub(super) master_name: Option<Spanned<String>>,
    pub(super) schema: Option<Spanned<String>>,
    pub(super) password_env: Option<Spanned<String>>,
    pub(super) connections: Option<Spanned<usize>>,
    pub(super) timeout: Option<Spanned<HumanDuration>>,
    pub(super) tls_ca_file: Option<Spanned<String>>,
    pub(super) tls_cert_file: Option<Spanned<String>>,
    pub(super) tls_key_file: Option<Spanned<String>>,
}

impl RawPrevious {
    /// The previous store as a `[store]` table of its own, for the same checks.
    pub(super) fn into_store(self, key_prefix: &Spanned<String>) -> RawStore {
        let defaults = RawStore::default();
        let postgres = *self.backend.get_ref() == BackendKind::Postgres;
        RawStore {
            backend: self.backend,
            url: self.url,
            urls: self.urls,
            master_name: self.master_name,
            schema: self.schema,
            password_env: self.password_env,
            connections: self.connections,
            timeout: self.timeout.unwrap_or(defaults.timeout),
            tls_ca_file: self.tls_ca_file,
            tls_cert_file: self.tls_cert_file,
            tls_key_file: self.tls_key_file,
            key_prefix: key_prefix.clone(),
            // Never written: the store it reads is not migrated.
            migrate: postgres.then(|| Spanned::new(0..0, false)),
            ..defaults
        }
    }
}

impl BackendKind {
    /// The backend as `store.backend` names it.
    pub(super) fn name(self) -> &'static str {
        match self {
            BackendKind::Memory => "memory",
            BackendKind::Sqlite => "sqlite",
            BackendKind::Redis => "redis",
            BackendKind::RedisSentinel => "redis-sentinel",
            BackendKind::RedisCluster => "redis-cluster",
            BackendKind::Postgres => "postgres",
        }
    }
}

impl RawStore {
    /// Each setting of the table that the file gives, by its key, with where.
    pub(super) fn given(&self) -> Vec<(&'static str, Range<usize>)> {
        let spans = [
            ("store.url", self.url.as_ref().map(Spanned::span)),
            ("store.urls", self.urls.as_ref().map(Spanned::span)),
            ("store.master_name", self.master_name.as_ref().map(Spanned::span)),
            ("store.max_records", self.max_records.as_ref().map(Spanned::span)),
            ("store.max_bytes", self.max_bytes.as_ref().map(Spanned::span)),
            (
                "store.max_records_per_scope",
                self.max_records_per_scope.as_ref().map(Spanned::span),
            ),
            (
                "store.max_bytes_per_scope",
                self.max_bytes_per_scope.as_ref().map(Spanned::span),
            ),
            (
                "store.max_records_per_client",
                self.max_records_per_client.as_ref().map(Spanned::span),
            ),
            ("store.path", self.path.as_ref().map(Spanned::span)),
            ("store.cache_bytes", self.cache_bytes.as_ref().map(Spanned::span)),
            (
                "store.min_replica_acks",
                self.min_replica_acks.as_ref().map(Spanned::span),
            ),
            (
                "store.replica_ack_timeout",
                self.replica_ack_timeout.as_ref().map(Spanned::span),
            ),
            ("store.connections", self.connections.as_ref().map(Spanned::span)),
            ("store.tls_ca_file", self.tls_ca_file.as_ref().map(Spanned::span)),
            ("store.tls_cert_file", self.tls_cert_file.as_ref().map(Spanned::span)),
            ("store.tls_key_file", self.tls_key_file.as_ref().map(Spanned::span)),
            ("store.password_env", self.password_env.as_ref().map(Spanned::span)),
            ("store.schema", self.schema.as_ref().map(Spanned::span)),
            ("store.migrate", self.migrate.as_ref().map(Spanned::span)),
        ];
        spans
            .into_iter()
            .filter_map(|(key, span)| span.map(|span| (key, span)))
            .collect()
    }
}

/// `[store.encryption]`: the environment variables the record keys are read from.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEncryption {
    pub(super) key_env: Spanned<String>,
    pub(super) previous_keys_env: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) accept_clear_records: bool,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            backend: Spanned::new(0..0, BackendKind::Memory),
            url: None,
            urls: None,
            master_name: None,
            key_prefix: Spanned::new(0..0, "idemproxy".to_string()),
            timeout: Spanned::new(0..0, HumanDuration(Duration::from_millis(500))),
            max_records: None,
            max_bytes: None,
            max_records_per_scope: None,
            max_bytes_per_scope: None,
            max_records_per_client: None,
            path: None,
            cache_bytes: None,
            min_replica_acks: None,
            replica_ack_timeout: None,
            connections: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            encryption: None,
            password_env: None,
            schema: None,
            migrate: None,
            previous: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: Spanned<String>,
    pub(super) path_prefix: Spanned<String>,
    pub(super) host: Option<Spanned<String>>,
    pub(super) upstream: Spanned<String>,
    #[serde(default = "default_upstream_timeout")]
    pub(super) upstream_timeout: Spanned<HumanDuration>,
    pub(super) upstream_ca_file: Option<Spanned<String>>,
    pub(super) docs_url: Option<Spanned<String>>,
    pub(super) idempotency: Option<RawIdempotency>,
    pub(super) cors: Option<Spanned<RawCors>>,
}

/// `[route.cors]`: the browsers' origins whose preflights the proxy answers itself.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCors {
    pub(super) allow_origins: Spanned<Vec<String>>,
    #[serde(default = "default_cors_methods")]
    pub(super) allow_methods: Spanned<Vec<String>>,
    #[serde(default = "default_cors_headers")]
    pub(super) allow_headers: Spanned<Vec<String>>,
    #[serde(default = "default_cors_max_age")]
    pub(super) max_age: Spanned<HumanDuration>,
    #[serde(default)]
    pub(super) allow_credentials: bool,
}

fn default_cors_methods() -> Spanned<Vec<String>> {
    Spanned::new(
        0..0,
        ["GET", "POST", "PUT", "PATCH", "DELETE"].map(String::from).to_vec(),
    )
}

fn default_cors_headers() -> Spanned<Vec<String>> {
    Spanned::new(0..0, vec!["Content-Type".into(), "Authorization".into()])
}

fn default_cors_max_age() -> Spanned<HumanDuration> {
    Spanned::new(0..0, HumanDuration(Duration::from_secs(600)))
}

fn default_upstream_timeout() -> Spanned<HumanDuration> {
    Spanned::new(0..0, HumanDuration(Duration::from_secs(30)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawIdempotency {
    pub(super) methods: Spanned<Vec<String>>,
    pub(super) header: Spanned<String>,
    pub(super) key: Option<Spanned<Vec<String>>>,
    pub(super) dedup_window: Option<Spanned<HumanDuration>>,
    pub(super) required: bool,
    pub(super) retention: Spanned<HumanDuration>,
    pub(super) remember: Option<Spanned<HumanDuration>>,
    pub(super) wait_for_in_flight: Spanned<HumanDuration>,
    pub(super) fingerprint_headers: Spanned<Vec<String>>,
    pub(super) mode: Mode,
    pub(super) fingerprint_body: RawFingerprintBody,
    pub(super) fingerprint_ignore: Spanned<Vec<String>>,
    pub(super) scope_headers: Spanned<Vec<String>>,
    pub(super) replay_exclude_headers: Spanned<Vec<String>>,
    pub(super) scope_jwt: Option<RawScopeJwt>,
    pub(super) max_response_body_bytes: Spanned<ByteSize>,
    pub(super) on_server_error: OnServerError,
    pub(super) on_unauthorized: OnUnauthorized,
    pub(super) on_store_error: OnStoreError,
    pub(super) upstream_key: UpstreamKey,
    pub(super) upstream_key_header: Spanned<String>,
    pub(super) reconcile: Option<Spanned<RawReconcile>>,
    pub(super) profile: Profile,
    pub(super) replay: Spanned<ReplayKind>,
    pub(super) replay_headers: Option<Spanned<Vec<String>>>,
    pub(super) refetch: Option<Spanned<RawRefetch>>,
    pub(super) stream: StreamMode,
    pub(super) jsonrpc_methods: Option<Spanned<Vec<String>>>,
    pub(super) graphql: Option<Spanned<RawGraphql>>,
    pub(super) graphql_unparsable: Option<Spanned<Unparsable>>,
}

/// `graphql`: which operations of a GraphQL route are guarded.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawGraphql {
    Mutations,
}

/// `[route.idempotency.refetch]`: how a `replay = "refetch"` route asks its upstream
/// for an operation's current state.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRefetch {
    #[serde(default = "default_probe_method")]
    pub(super) method: Spanned<String>,
    pub(super) path: Spanned<String>,
    pub(super) timeout: Option<Spanned<HumanDuration>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReconcile {
    #[serde(default = "default_probe_method")]
    pub(super) method: Spanned<String>,
    pub(super) path: Spanned<String>,
    #[serde(default = "default_applied")]
    pub(super) applied: Spanned<Vec<u16>>,
    #[serde(default = "default_not_applied")]
    pub(super) not_applied: Spanned<Vec<u16>>,
    #[serde(default = "default_first_after")]
    pub(super) first_after: Spanned<HumanDuration>,
    #[serde(default = "default_every")]
    pub(super) every: Spanned<HumanDuration>,
    #[serde(default = "default_give_up_after")]
    pub(super) give_up_after: Spanned<HumanDuration>,
    pub(super) timeout: Option<Spanned<HumanDuration>>,
    #[serde(default = "default_max_concurrent")]
    pub(super) max_concurrent: Spanned<usize>,
}

fn default_probe_method() -> Spanned<String> {
    Spanned::new(0..0, "GET".into())
}

fn default_applied() -> Spanned<Vec<u16>> {
    Spanned::new(0..0, vec![200])
}

fn default_not_applied() -> Spanned<Vec<u16>> {
    Spanned::new(0..0, vec![404])
}

fn default_first_after() -> Spanned<HumanDuration> {
    Spanned::new(0..0, HumanDuration(Duration::from_secs(1)))
}

fn default_every() -> Spanned<HumanDuration> {
    Spanned::new(0..0, HumanDuration(Duration::from_secs(5)))
}

fn default_give_up_after() -> Spanned<HumanDuration> {
    Spanned::new(0..0, HumanDuration(Duration::from_secs(600)))
}

fn default_max_concurrent() -> Spanned<usize> {
    Spanned::new(0..0, 8)
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawFingerprintBody {
    Bytes,
    Json,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        RawIdempotency {
            methods: Spanned::new(0..0, vec!["POST".into(), "PATCH".into()]),
            header: Spanned::new(0..0, "Idempotency-Key".into()),
            key: None,
            dedup_window: None,
            required: true,
            retention: Spanned::new(0..0, HumanDuration(Duration::from_secs(24 * 3600))),
            remember: None,
            wait_for_in_flight: Spanned::new(0..0, HumanDuration(Duration::ZERO)),
            fingerprint_headers: Spanned::new(0..0, vec!["content-type".into()]),
            mode: Mode::Enforce,
            fingerprint_body: RawFingerprintBody::Bytes,
            fingerprint_ignore: Spanned::new(0..0, Vec::new()),
            scope_headers: Spanned::new(0..0, Vec::new()),
            replay_exclude_headers: Spanned::new(0..0, vec!["set-cookie".into()]),
            scope_jwt: None,
            max_response_body_bytes: Spanned::new(0..0, ByteSize(1024 * 1024)),
            on_server_error: OnServerError::Release,
            on_unauthorized: OnUnauthorized::Release,
            on_store_error: OnStoreError::Reject,
            upstream_key: UpstreamKey::Client,
            upstream_key_header: Spanned::new(0..0, "Idempotency-Key".into()),
            reconcile: None,
            jsonrpc_methods: None,
            graphql: None,
            graphql_unparsable: None,
            profile: Profile::Ietf,
            replay: Spanned::new(0..0, ReplayKind::Stored),
            replay_headers: None,
            refetch: None,
            stream: StreamMode::Auto,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawScopeJwt {
    pub(super) header: Spanned<String>,
    pub(super) claim: Spanned<String>,
    pub(super) jwks_file: Option<Spanned<String>>,
    pub(super) hs256_secret_env: Option<Spanned<String>>,
    pub(super) issuer: Option<String>,
    pub(super) audience: Option<String>,
    pub(super) leeway: HumanDuration,
}

impl Default for RawScopeJwt {
    fn default() -> Self {
        RawScopeJwt {
            header: Spanned::new(0..0, "authorization".into()),
            claim: Spanned::new(0..0, "sub".into()),
            jwks_file: None,
            hs256_secret_env: None,
            issuer: None,
            audience: None,
            leeway: HumanDuration(Duration::from_secs(30)),
        }
    }
}

/// A humantime duration string such as `"250ms"`, `"30s"` or `"24h"`.
#[derive(Debug, Clone, Copy)]
pub(super) struct HumanDuration(pub(super) Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text).map(HumanDuration).map_err(|error| {
            serde::de::Error::custom(format!(
                "invalid duration {text:?}: {error} (write e.g. \"250ms\", \"30s\", \"24h\")"
            ))
        })
    }
}

/// A size in bytes: an integer, or a string with a unit as `"256MiB"`, `"64KiB"`,
/// `"1GiB"` (binary) or `"10MB"` (decimal), as durations are `"30s"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ByteSize(pub(super) u64);

impl ByteSize {
    /// The size as a `usize` (the memory store's bounds), saturating on a 32-bit host.
    pub(super) fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of bytes, or a size such as \"256MiB\"")
            }

            fn visit_u64<E: serde::de::Error>(self, bytes: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(bytes))
            }

            fn visit_i64<E: serde::de::Error>(self, bytes: i64) -> Result<ByteSize, E> {
                u64::try_from(bytes)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size {bytes}: a size cannot be negative")))
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<ByteSize, E> {
                parse_size::parse_size(text).map(ByteSize).map_err(|error| {
                    E::custom(format!(
                        "invalid size {text:?}: {error} (write e.g. \"256MiB\", \"64KiB\", \"1GiB\", or a number of bytes)"
                    ))
                })
            }
        }

        deserializer.deserialize_any(Visitor)
    }
}
