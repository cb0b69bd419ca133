//! Validation: turns the raw TOML into the `Config` the proxy runs on, producing the
//! runtime values the hot path uses (a parsed upstream `Target`, typed methods and
//! header names), so nothing is parsed twice. Every error names the file, the line and
//! the field: the field's path comes from `serde_path_to_error` for anything the TOML
//! types refuse, and from the validator for anything its rules refuse.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http::header::HeaderName;
use toml::Spanned;

use super::raw::{
    BackendKind, RawConfig, RawFingerprintBody, RawIdempotency, RawReconcile, RawRoute, RawScopeJwt, RawServer,
    RawStore, RawTls, RawTracing,
};
use super::{
    AdminConfig, AdminToken, Backend, ClientIdentity, Config, DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS,
    DEFAULT_REPLICA_ACK_TIMEOUT, DEFAULT_STORE_CONNECTIONS, FingerprintBody, IdempotencyPolicy, JsonPointer,
    LEASE_GRACE, PathPolicy, ProbePath, ProbePiece, Reconcile, RedisConfig, RedisTopology, Route, ServerConfig,
    ServerTls, StoreConfig, StoreTls, Target, TracingConfig, UpstreamKey,
};
use crate::error::ConfigError;
use crate::jwt::{JwtVerifier, KeySource};
use crate::tls::{self, TlsError};

/// Parses and validates `source`; `path` only names the file in errors.
pub(super) fn parse(source: &str, path: &Path) -> Result<Config, ConfigError> {
    let invalid = |span: Option<Range<usize>>, field: String, reason: &str| ConfigError::Invalid {
        path: path.to_path_buf(),
        line: line_of(source, span.map_or(0, |span| span.start)),
        field,
        reason: reason.trim().to_string(),
    };
    let deserializer = toml::de::Deserializer::parse(source).map_err(|error| {
        let field = syntax_field(source, error.span().map_or(0, |span| span.start));
        invalid(error.span(), field, error.message())
    })?;
    let raw: RawConfig = serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let field = field_path(error.path());
        let error = error.into_inner();
        invalid(error.span(), field, error.message())
    })?;
    Validator { source, path }.config(raw)
}

/// A deserializer path as users name fields: `route[1].idempotency.retention`, with
/// the segments `toml::Spanned` adds left out.
fn field_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } if key.starts_with("$__serde_spanned_private") => {}
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => out.push_str(".?"),
        }
    }
    if out.is_empty() { "(top level)".into() } else { out }
}

/// Names the field at a syntax error, which the parser reports before any path exists:
/// the table on that line (`[server` names `server`), or the key before its `=`.
fn syntax_field(source: &str, offset: usize) -> String {
    let (before, after) = source.split_at_checked(offset).unwrap_or((source, ""));
    let line_start = before.rsplit('\n').next().unwrap_or_default();
    let line_end = after.split('\n').next().unwrap_or_default();
    let line = format!("{line_start}{line_end}");
    let line = line.trim();
    let field = match line.strip_prefix('[') {
        Some(table) => table.trim_matches(|c| c == '[' || c == ']' || c == ' '),
        None => line.split_once('=').map_or("", |(key, _)| key.trim().trim_matches('"')),
    };
    if field.is_empty() {
        "(syntax)".into()
    } else {
        field.to_string()
    }
}

/// The 1-based line that holds byte `offset` of `source`.
fn line_of(source: &str, offset: usize) -> usize {
    let before = source.as_bytes().get(..offset).unwrap_or(source.as_bytes());
    before.iter().filter(|&&b| b == b'\n').count() + 1
}

struct Validator<'a> {
    source: &'a str,
    path: &'a Path,
}

impl Validator<'_> {
    fn error(&self, span: Range<usize>, field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_path_buf(),
            line: line_of(self.source, span.start),
            field: field.into(),
            reason: reason.into(),
        }
    }

    fn config(&self, raw: RawConfig) -> Result<Config, ConfigError> {
        let server = self.server(raw.server)?;
        let store = self.store(raw.store)?;
        let (routes_span, raw_routes) = match raw.routes {
            Some(routes) => (routes.span(), routes.into_inner()),
            None => (self.source.len()..self.source.len(), Vec::new()),
        };
        if raw_routes.is_empty() {
            return Err(self.error(routes_span, "route", "at least one [[route]] is required"));
        }
        let mut routes: Vec<Route> = Vec::with_capacity(raw_routes.len());
        for (index, raw_route) in raw_routes.into_iter().enumerate() {
            let name_span = raw_route.name.span();
            let route = self.route(index, raw_route, &server)?;
            if routes.iter().any(|r| r.name == route.name) {
                return Err(self.error(
                    name_span,
                    format!("route[{index}].name"),
                    format!("duplicate route name {:?}", route.name),
                ));
            }
            if routes
                .iter()
                .any(|r| r.path_prefix == route.path_prefix && r.host == route.host)
            {
                return Err(self.error(
                    name_span,
                    format!("route[{index}].path_prefix"),
                    format!(
                        "another route already has path_prefix {:?} for the same host",
                        route.path_prefix
                    ),
                ));
            }
            routes.push(route);
        }
        let admin = match raw.admin {
            None => None,
            Some(admin) => Some(AdminConfig {
                listen: admin.listen,
                token: admin.token_file.map(|file| self.admin_token(&file)).transpose()?,
            }),
        };
        let tracing = raw.tracing.map(|raw| self.tracing(raw)).transpose()?.flatten();
        Ok(Config {
            server,
            admin,
            store,
            tracing,
            routes,
            sha256: const_hex::encode(ring::digest::digest(&ring::digest::SHA256, self.source.as_bytes())),
        })
    }

    /// `[tracing]`: `None` without an `otlp_endpoint` (no export, nothing traced).
    fn tracing(&self, raw: RawTracing) -> Result<Option<TracingConfig>, ConfigError> {
        let ratio = *raw.sample_ratio.get_ref();
        if !(0.0..=1.0).contains(&ratio) {
            return Err(self.error(
                raw.sample_ratio.span(),
                "tracing.sample_ratio",
                "must be between 0.0 and 1.0",
            ));
        }
        let name = raw.service_name.get_ref().trim();
        if name.is_empty() {
            return Err(self.error(raw.service_name.span(), "tracing.service_name", "must not be empty"));
        }
        let Some(endpoint) = raw.otlp_endpoint else {
            return Ok(None);
        };
        let field = "tracing.otlp_endpoint";
        let bad = |reason: &str| self.error(endpoint.span(), field, reason.to_string());
        let uri: http::Uri = endpoint.get_ref().parse().map_err(|_| bad("not a valid URL"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(bad("must be an http:// or https:// URL with a host (OTLP over HTTP)"));
        }
        if uri.query().is_some() {
            return Err(bad("must not have a query"));
        }
        let uri = match uri.path() {
            "" | "/" => {
                let mut parts = uri.into_parts();
                parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/v1/traces"));
                http::Uri::from_parts(parts).map_err(|_| bad("not a valid URL"))?
            }
            _ => uri,
        };
        Ok(Some(TracingConfig {
            otlp_endpoint: uri,
            service_name: name.to_string(),
            sample_ratio: ratio,
        }))
    }

    /// The admin token: at least 16 bytes, read now so that `check` tells a bad file.
    fn admin_token(&self, file: &Spanned<String>) -> Result<AdminToken, ConfigError> {
        let path = self.file(file.get_ref());
        let text = std::fs::read_to_string(&path).map_err(|error| {
            self.error(
                file.span(),
                "admin.token_file",
                format!("cannot read {}: {error}", path.display()),
            )
        })?;
        if text.trim().len() < 16 {
            return Err(self.error(
                file.span(),
                "admin.token_file",
                format!("{} must hold a token of at least 16 characters", path.display()),
            ));
        }
        Ok(AdminToken::new(path, &text))
    }

    fn server(&self, raw: RawServer) -> Result<ServerConfig, ConfigError> {
        if *raw.max_request_body_bytes.get_ref() == 0 {
            return Err(self.error(
                raw.max_request_body_bytes.span(),
                "server.max_request_body_bytes",
                "must be greater than 0",
            ));
        }
        for (field, value) in [
            ("server.header_read_timeout", &raw.header_read_timeout),
            ("server.request_body_timeout", &raw.request_body_timeout),
        ] {
            if value.get_ref().0.is_zero() {
                return Err(self.error(value.span(), field, "must be greater than 0"));
            }
        }
        let workers = match raw.workers {
            Some(workers) if *workers.get_ref() == 0 || *workers.get_ref() > 1024 => {
                return Err(self.error(workers.span(), "server.workers", "must be between 1 and 1024"));
            }
            Some(workers) => workers.into_inner(),
            None => std::thread::available_parallelism().map_or(1, usize::from),
        };
        let tls = match &raw.tls {
            None => None,
            Some(tls) => Some(self.server_tls(tls)?),
        };
        for (value, field) in [
            (&raw.max_connections, "server.max_connections"),
            (&raw.max_guarded_requests, "server.max_guarded_requests"),
            (&raw.max_waiters, "server.max_waiters"),
        ] {
            if *value.get_ref() == 0 {
                return Err(self.error(value.span(), field, "must be greater than 0"));
            }
        }
        // A request body of the largest size must fit the request bodies' three
        // quarters, or such a request could never be admitted.
        let max_buffered_bytes = *raw.max_buffered_bytes.get_ref();
        if max_buffered_bytes / 4 * 3 < *raw.max_request_body_bytes.get_ref() {
            return Err(self.error(
                raw.max_buffered_bytes.span(),
                "server.max_buffered_bytes",
                format!(
                    "{max_buffered_bytes} leaves less than max_request_body_bytes ({}) for request bodies, which may take three quarters of it",
                    raw.max_request_body_bytes.get_ref()
                ),
            ));
        }
        let contract_path = match raw.contract_path.get_ref().as_str() {
            "" => None,
            path if path.starts_with('/') && path.parse::<http::uri::PathAndQuery>().is_ok() && !path.contains('?') => {
                Some(path.to_string())
            }
            path => {
                return Err(self.error(
                    raw.contract_path.span(),
                    "server.contract_path",
                    format!(
                        "{path:?} is not a path (it must begin with /, with no query); \"\" turns the document off"
                    ),
                ));
            }
        };
        Ok(ServerConfig {
            contract_path,
            tls,
            workers,
            max_connections: raw.max_connections.into_inner(),
            max_guarded_requests: raw.max_guarded_requests.into_inner(),
            max_buffered_bytes,
            max_waiters: raw.max_waiters.into_inner(),
            access_log: raw.access_log,
            paths: PathPolicy {
                merge_slashes: raw.merge_slashes,
                escaped_slashes: raw.escaped_slashes,
                path_parameters: raw.path_parameters,
            },
            listen: raw.listen,
            max_request_body_bytes: raw.max_request_body_bytes.into_inner(),
            header_read_timeout: raw.header_read_timeout.into_inner().0,
            request_body_timeout: raw.request_body_timeout.into_inner().0,
            shutdown_grace: raw.shutdown_grace.0,
        })
    }

    fn store(&self, raw: RawStore) -> Result<StoreConfig, ConfigError> {
        let key_prefix = raw.key_prefix.get_ref();
        if key_prefix.is_empty() || !key_prefix.bytes().all(is_name_byte) {
            return Err(self.error(
                raw.key_prefix.span(),
                "store.key_prefix",
                "must be 1 or more of the characters A-Z a-z 0-9 _ - .",
            ));
        }
        if raw.timeout.get_ref().0.is_zero() {
            return Err(self.error(raw.timeout.span(), "store.timeout", "must be greater than 0"));
        }
        let backend = match *raw.backend.get_ref() {
            BackendKind::Memory => {
                let redis_only = [
                    ("store.url", raw.url.as_ref().map(Spanned::span)),
                    ("store.urls", raw.urls.as_ref().map(Spanned::span)),
                    ("store.master_name", raw.master_name.as_ref().map(Spanned::span)),
                    (
                        "store.min_replica_acks",
                        raw.min_replica_acks.as_ref().map(Spanned::span),
                    ),
                    (
                        "store.replica_ack_timeout",
                        raw.replica_ack_timeout.as_ref().map(Spanned::span),
                    ),
                    ("store.tls_ca_file", raw.tls_ca_file.as_ref().map(Spanned::span)),
                    ("store.tls_cert_file", raw.tls_cert_file.as_ref().map(Spanned::span)),
                    ("store.tls_key_file", raw.tls_key_file.as_ref().map(Spanned::span)),
                    ("store.connections", raw.connections.as_ref().map(Spanned::span)),
                ];
                if let Some((field, Some(span))) = redis_only.into_iter().find(|(_, span)| span.is_some()) {
                    return Err(self.error(span, field, "only the redis backends take this"));
                }
                let max_records = match &raw.max_records {
                    Some(max) if *max.get_ref() == 0 => {
                        return Err(self.error(max.span(), "store.max_records", "must be greater than 0"));
                    }
                    Some(max) => *max.get_ref(),
                    None => DEFAULT_MAX_RECORDS,
                };
                let max_bytes = match &raw.max_bytes {
                    Some(max) if *max.get_ref() < 1024 * 1024 => {
                        return Err(self.error(max.span(), "store.max_bytes", "must be at least 1048576 (1 MiB)"));
                    }
                    Some(max) => *max.get_ref(),
                    None => DEFAULT_MAX_BYTES,
                };
                // A quarter of each bound by default: one client cannot take the store
                // from the others.
                let per_scope = |value: &Option<Spanned<usize>>, field: &str, default: usize| match value {
                    Some(max) if *max.get_ref() == 0 => Err(self.error(max.span(), field, "must be greater than 0")),
                    Some(max) => Ok(*max.get_ref()),
                    None => Ok((default / 4).max(1)),
                };
                let max_records_per_scope =
                    per_scope(&raw.max_records_per_scope, "store.max_records_per_scope", max_records)?;
                let max_bytes_per_scope = per_scope(&raw.max_bytes_per_scope, "store.max_bytes_per_scope", max_bytes)?;
                Backend::Memory {
                    max_records,
                    max_bytes,
                    max_records_per_scope,
                    max_bytes_per_scope,
                }
            }
            kind => Backend::Redis(self.redis(kind, &raw)?),
        };
        Ok(StoreConfig {
            backend,
            key_prefix: raw.key_prefix.into_inner(),
            timeout: raw.timeout.into_inner().0,
        })
    }

    /// A path in the config, relative to the config file's directory.
    fn file(&self, raw: &str) -> PathBuf {
        let path = Path::new(raw);
        match self.path.parent() {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_path_buf(),
        }
    }

    /// Reads the listener's certificate, key and client CA, each named by its own field
    /// when it fails, and makes its configuration.
    fn server_tls(&self, raw: &RawTls) -> Result<ServerTls, ConfigError> {
        let cert_file = self.file(raw.cert_file.get_ref());
        let key_file = self.file(raw.key_file.get_ref());
        let client_ca_file = raw.client_ca_file.as_ref().map(|ca| self.file(ca.get_ref()));
        let failed =
            |span: Range<usize>, field: &'static str| move |error: TlsError| self.error(span, field, error.to_string());
        let chain = tls::certificates(&cert_file).map_err(failed(raw.cert_file.span(), "server.tls.cert_file"))?;
        let key = tls::private_key(&key_file).map_err(failed(raw.key_file.span(), "server.tls.key_file"))?;
        let client_roots = match (&raw.client_ca_file, &client_ca_file) {
            (Some(raw_ca), Some(ca_file)) => {
                Some(tls::roots(ca_file).map_err(failed(raw_ca.span(), "server.tls.client_ca_file"))?)
            }
            _ => None,
        };
        // What rustls refuses now is the pair: a key that does not go with the chain.
        let config = tls::server_config(chain, key, client_roots).map_err(|error| {
            self.error(
                raw.key_file.span(),
                "server.tls.key_file",
                format!("{} cannot serve {}: {error}", key_file.display(), cert_file.display()),
            )
        })?;
        Ok(ServerTls {
            cert_file,
            key_file,
            client_ca_file,
            config,
        })
    }

    /// The Redis backends: which fields each topology takes, every URL checked.
    fn redis(&self, kind: BackendKind, raw: &RawStore) -> Result<RedisConfig, ConfigError> {
        for (field, span) in [
            ("store.max_records", raw.max_records.as_ref().map(Spanned::span)),
            ("store.max_bytes", raw.max_bytes.as_ref().map(Spanned::span)),
            (
                "store.max_records_per_scope",
                raw.max_records_per_scope.as_ref().map(Spanned::span),
            ),
            (
                "store.max_bytes_per_scope",
                raw.max_bytes_per_scope.as_ref().map(Spanned::span),
            ),
        ] {
            if let Some(span) = span {
                return Err(self.error(
                    span,
                    field,
                    "only the memory backend takes this; bound Redis with maxmemory",
                ));
            }
        }
        let refuse = |value: Option<Range<usize>>, field: &str, reason: &str| match value {
            Some(span) => Err(self.error(span, field, reason)),
            None => Ok(()),
        };
        let topology = match kind {
            BackendKind::Redis => {
                refuse(
                    raw.urls.as_ref().map(Spanned::span),
                    "store.urls",
                    "the redis backend takes one url; urls is for redis-sentinel and redis-cluster",
                )?;
                refuse(
                    raw.master_name.as_ref().map(Spanned::span),
                    "store.master_name",
                    "only the redis-sentinel backend takes master_name",
                )?;
                let Some(url) = &raw.url else {
                    return Err(self.error(
                        raw.backend.span(),
                        "store.url",
                        "the redis backend needs url = \"redis://host:6379/0\"",
                    ));
                };
                self.redis_url(url.get_ref(), url.span(), "store.url")?;
                RedisTopology::Standalone {
                    url: url.get_ref().clone(),
                }
            }
            BackendKind::RedisSentinel | BackendKind::RedisCluster => {
                let name = if kind == BackendKind::RedisSentinel {
                    "redis-sentinel"
                } else {
                    "redis-cluster"
                };
                refuse(
                    raw.url.as_ref().map(Spanned::span),
                    "store.url",
                    &format!("the {name} backend takes urls = [...], not url"),
                )?;
                let urls = match &raw.urls {
                    Some(urls) if !urls.get_ref().is_empty() => urls,
                    Some(urls) => return Err(self.error(urls.span(), "store.urls", "must name at least one node")),
                    None => {
                        let example = if kind == BackendKind::RedisSentinel {
                            "the redis-sentinel backend needs urls = [\"redis://sentinel:26379\", ...] and master_name"
                        } else {
                            "the redis-cluster backend needs urls = [\"redis://node:6379\", ...] (seed nodes)"
                        };
                        return Err(self.error(raw.backend.span(), "store.urls", example));
                    }
                };
                for (index, url) in urls.get_ref().iter().enumerate() {
                    self.redis_url(url, urls.span(), &format!("store.urls[{index}]"))?;
                }
                let urls = urls.get_ref().clone();
                if kind == BackendKind::RedisCluster {
                    refuse(
                        raw.master_name.as_ref().map(Spanned::span),
                        "store.master_name",
                        "only the redis-sentinel backend takes master_name",
                    )?;
                    RedisTopology::Cluster { urls }
                } else {
                    let master_name = match &raw.master_name {
                        Some(name) if !name.get_ref().is_empty() => name.get_ref().clone(),
                        Some(name) => return Err(self.error(name.span(), "store.master_name", "must not be empty")),
                        None => {
                            return Err(self.error(
                                raw.backend.span(),
                                "store.master_name",
                                "the redis-sentinel backend needs master_name, the name the sentinels monitor",
                            ));
                        }
                    };
                    RedisTopology::Sentinel { urls, master_name }
                }
            }
            // `store` validates the memory backend itself and never asks for this.
            BackendKind::Memory => {
                return Err(self.error(raw.backend.span(), "store.backend", "memory is not a Redis backend"));
            }
        };
        let replica_ack_timeout = match &raw.replica_ack_timeout {
            Some(timeout) if timeout.get_ref().0 < Duration::from_millis(1) => {
                return Err(self.error(
                    timeout.span(),
                    "store.replica_ack_timeout",
                    "must be at least 1ms (WAIT 0 would wait forever)",
                ));
            }
            Some(timeout) => timeout.get_ref().0,
            None => DEFAULT_REPLICA_ACK_TIMEOUT,
        };
        let tls = self.store_tls(raw, &topology)?;
        let connections = match &raw.connections {
            Some(count) if !(1..=64).contains(count.get_ref()) => {
                return Err(self.error(count.span(), "store.connections", "must be between 1 and 64"));
            }
            Some(count) => *count.get_ref(),
            None => DEFAULT_STORE_CONNECTIONS,
        };
        Ok(RedisConfig {
            topology,
            min_replica_acks: raw.min_replica_acks.as_ref().map_or(0, |acks| *acks.get_ref()),
            replica_ack_timeout,
            tls,
            connections,
        })
    }

    /// The store's CA and client certificate, each file read and checked and named by
    /// its own field: only with a `rediss://` URL, a certificate only with its key.
    fn store_tls(&self, raw: &RawStore, topology: &RedisTopology) -> Result<Option<StoreTls>, ConfigError> {
        let fields = [
            ("store.tls_ca_file", &raw.tls_ca_file),
            ("store.tls_cert_file", &raw.tls_cert_file),
            ("store.tls_key_file", &raw.tls_key_file),
        ];
        let Some((first, span)) = fields
            .iter()
            .find_map(|(field, value)| value.as_ref().map(|value| (*field, value.span())))
        else {
            return Ok(None);
        };
        if !topology.urls().iter().any(|url| url.starts_with("rediss://")) {
            return Err(self.error(
                span,
                first,
                "TLS settings need a rediss:// store URL; with redis:// they would never be used",
            ));
        }
        let failed =
            |span: Range<usize>, field: &'static str| move |error: TlsError| self.error(span, field, error.to_string());
        let ca_file = match &raw.tls_ca_file {
            None => None,
            Some(ca) => {
                let path = self.file(ca.get_ref());
                tls::roots(&path).map_err(failed(ca.span(), "store.tls_ca_file"))?;
                Some(path)
            }
        };
        let client = match (&raw.tls_cert_file, &raw.tls_key_file) {
            (None, None) => None,
            (Some(cert), None) => {
                return Err(self.error(cert.span(), "store.tls_cert_file", "needs store.tls_key_file, its key"));
            }
            (None, Some(key)) => {
                return Err(self.error(
                    key.span(),
                    "store.tls_key_file",
                    "needs store.tls_cert_file, its certificate",
                ));
            }
            (Some(cert), Some(key)) => {
                let (cert_file, key_file) = (self.file(cert.get_ref()), self.file(key.get_ref()));
                let chain = tls::certificates(&cert_file).map_err(failed(cert.span(), "store.tls_cert_file"))?;
                let private = tls::private_key(&key_file).map_err(failed(key.span(), "store.tls_key_file"))?;
                tls::client_identity(chain, private).map_err(|error| {
                    self.error(
                        key.span(),
                        "store.tls_key_file",
                        format!("does not go with store.tls_cert_file: {error}"),
                    )
                })?;
                Some(ClientIdentity { cert_file, key_file })
            }
        };
        Ok(Some(StoreTls { ca_file, client }))
    }

    /// A `redis://` or `rediss://` URL the redis crate can open.
    fn redis_url(&self, url: &str, span: Range<usize>, field: &str) -> Result<(), ConfigError> {
        let scheme_ok = url.starts_with("redis://") || url.starts_with("rediss://");
        if !scheme_ok || redis::Client::open(url).is_err() {
            return Err(self.error(span, field, "must be a redis:// or rediss:// URL"));
        }
        Ok(())
    }

    fn route(&self, index: usize, raw: RawRoute, server: &ServerConfig) -> Result<Route, ConfigError> {
        let field = |name: &str| format!("route[{index}].{name}");
        let name = raw.name.get_ref();
        if name.is_empty() || name.len() > 64 || !name.bytes().all(is_name_byte) {
            return Err(self.error(
                raw.name.span(),
                field("name"),
                "must be 1 to 64 of the characters A-Z a-z 0-9 _ - .",
            ));
        }
        let prefix = raw.path_prefix.get_ref();
        if !prefix.starts_with('/') {
            return Err(self.error(raw.path_prefix.span(), field("path_prefix"), "must start with /"));
        }
        // Requests are routed by their canonical path: a prefix spelled otherwise
        // would match none of them.
        match crate::target::canonical_path(prefix, &server.paths) {
            Ok(canonical) if canonical == *prefix => {}
            Ok(canonical) => {
                return Err(self.error(
                    raw.path_prefix.span(),
                    field("path_prefix"),
                    format!("must be a canonical path: write {canonical:?}"),
                ));
            }
            Err(error) => return Err(self.error(raw.path_prefix.span(), field("path_prefix"), error.to_string())),
        }
        let host = match raw.host {
            Some(host) if host.get_ref().is_empty() => {
                return Err(self.error(host.span(), field("host"), "must not be empty"));
            }
            Some(host) => Some(host.into_inner().to_ascii_lowercase()),
            None => None,
        };
        let upstream = self.upstream(&raw.upstream, field("upstream"))?;
        let upstream_timeout = raw.upstream_timeout.get_ref().0;
        if upstream_timeout.is_zero() {
            return Err(self.error(
                raw.upstream_timeout.span(),
                field("upstream_timeout"),
                "must be greater than 0",
            ));
        }
        let upstream_tls = match &raw.upstream_ca_file {
            None => None,
            Some(ca) => Some(
                tls::upstream_client_config(&self.file(ca.get_ref()))
                    .map_err(|error| self.error(ca.span(), field("upstream_ca_file"), error.to_string()))?,
            ),
        };
        let idempotency = match raw.idempotency {
            Some(policy) => Some(Arc::new(self.policy(
                index,
                policy,
                upstream_timeout,
                server.max_buffered_bytes,
            )?)),
            None => None,
        };
        let docs_url = match &raw.docs_url {
            None => None,
            Some(url) => Some(self.docs_url(url, field("docs_url"))?),
        };
        Ok(Route {
            docs_url,
            name: raw.name.into_inner(),
            path_prefix: raw.path_prefix.into_inner(),
            host,
            upstream,
            upstream_timeout,
            upstream_tls,
            idempotency,
        })
    }

    fn upstream(&self, raw: &Spanned<String>, field: String) -> Result<Target, ConfigError> {
        let uri: http::Uri = raw
            .get_ref()
            .parse()
            .map_err(|_| self.error(raw.span(), field.clone(), "not a valid URL"))?;
        Target::try_from(uri).map_err(|reason| self.error(raw.span(), field, reason))
    }

    fn policy(
        &self,
        index: usize,
        raw: RawIdempotency,
        upstream_timeout: Duration,
        max_buffered_bytes: u64,
    ) -> Result<IdempotencyPolicy, ConfigError> {
        let field = |name: &str| format!("route[{index}].idempotency.{name}");
        let mut methods = Vec::new();
        for method in raw.methods.get_ref() {
            let parsed = Method::from_bytes(method.to_ascii_uppercase().as_bytes()).map_err(|_| {
                self.error(
                    raw.methods.span(),
                    field("methods"),
                    format!("{method:?} is not an HTTP method"),
                )
            })?;
            methods.push(parsed);
        }
        if methods.is_empty() {
            return Err(self.error(raw.methods.span(), field("methods"), "must name at least one method"));
        }
        let header = self.header_name(&raw.header.span(), raw.header.get_ref(), field("header"))?;
        let fingerprint_headers = self.header_names(&raw.fingerprint_headers, field("fingerprint_headers"))?;
        let fingerprint_body = self.fingerprint_body(&raw, &field("fingerprint_ignore"))?;
        let scope_headers = self.header_names(&raw.scope_headers, field("scope_headers"))?;
        let replay_exclude_headers = self.header_names(&raw.replay_exclude_headers, field("replay_exclude_headers"))?;
        let upstream_key_header = self.header_name(
            &raw.upstream_key_header.span(),
            raw.upstream_key_header.get_ref(),
            field("upstream_key_header"),
        )?;
        let scope_jwt = match &raw.scope_jwt {
            None => None,
            Some(jwt) => Some(self.scope_jwt(index, jwt)?),
        };
        let retention = raw.retention.get_ref().0;
        if retention <= upstream_timeout + LEASE_GRACE {
            return Err(self.error(
                raw.retention.span(),
                field("retention"),
                format!(
                    "{} does not exceed the lease (upstream_timeout {} + 1s); a record would expire while its request may still be in flight",
                    humantime::format_duration(retention),
                    humantime::format_duration(upstream_timeout)
                ),
            ));
        }
        let wait_for_in_flight = raw.wait_for_in_flight.get_ref().0;
        if wait_for_in_flight > upstream_timeout + LEASE_GRACE {
            return Err(self.error(
                raw.wait_for_in_flight.span(),
                field("wait_for_in_flight"),
                format!(
                    "{} is longer than the lease (upstream_timeout {} + 1s): past the lease a waiter can only get 409 outcome-unknown",
                    humantime::format_duration(wait_for_in_flight),
                    humantime::format_duration(upstream_timeout)
                ),
            ));
        }
        if *raw.max_response_body_bytes.get_ref() == 0 {
            return Err(self.error(
                raw.max_response_body_bytes.span(),
                field("max_response_body_bytes"),
                "must be greater than 0",
            ));
        }
        if *raw.max_response_body_bytes.get_ref() > max_buffered_bytes {
            return Err(self.error(
                raw.max_response_body_bytes.span(),
                field("max_response_body_bytes"),
                format!(
                    "is more than server.max_buffered_bytes ({max_buffered_bytes}): no such response could be recorded"
                ),
            ));
        }
        let reconcile = match &raw.reconcile {
            None => None,
            Some(reconcile) => Some(self.reconcile(index, reconcile, upstream_timeout, raw.upstream_key)?),
        };
        Ok(IdempotencyPolicy {
            methods,
            header,
            required: raw.required,
            retention,
            wait_for_in_flight,
            fingerprint_headers,
            mode: raw.mode,
            fingerprint_body,
            scope_headers,
            replay_exclude_headers,
            scope_jwt,
            max_response_body_bytes: raw.max_response_body_bytes.into_inner(),
            on_server_error: raw.on_server_error,
            on_store_error: raw.on_store_error,
            upstream_key: raw.upstream_key,
            upstream_key_header,
            reconcile,
            profile: raw.profile,
        })
    }

    /// `[route.idempotency.reconcile]`: a read-only method, a path whose only
    /// placeholders are `{key}` and `{record}`, status lists that do not overlap, and a
    /// schedule that can run.
    fn reconcile(
        &self,
        index: usize,
        raw: &Spanned<RawReconcile>,
        upstream_timeout: Duration,
        upstream_key: UpstreamKey,
    ) -> Result<Reconcile, ConfigError> {
        let field = |name: &str| format!("route[{index}].idempotency.reconcile.{name}");
        let span = raw.span();
        let raw = raw.get_ref();
        let method = match raw.method.get_ref().to_ascii_uppercase().as_str() {
            "GET" => Method::GET,
            "HEAD" => Method::HEAD,
            other => {
                return Err(self.error(
                    raw.method.span(),
                    field("method"),
                    format!("{other:?} is not GET or HEAD: a probe must never run the operation it asks about"),
                ));
            }
        };
        let path = self.probe_path(&raw.path, field("path"))?;
        if path.names_key() && upstream_key == UpstreamKey::None {
            return Err(self.error(
                raw.path.span(),
                field("path"),
                "names {key}, but upstream_key = \"none\" sends the upstream no key to look up; use {record} with upstream_key = \"derived\", or forward a key",
            ));
        }
        let statuses = |list: &Spanned<Vec<u16>>, name: &str| {
            list.get_ref()
                .iter()
                .map(|code| {
                    http::StatusCode::from_u16(*code)
                        .ok()
                        .filter(|status| (200..600).contains(&status.as_u16()))
                        .ok_or_else(|| {
                            self.error(
                                list.span(),
                                field(name),
                                format!("{code} is not a final status (200 to 599)"),
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let applied = statuses(&raw.applied, "applied")?;
        let not_applied = statuses(&raw.not_applied, "not_applied")?;
        if applied.is_empty() && not_applied.is_empty() {
            return Err(self.error(
                span,
                field("applied"),
                "and not_applied are both empty: no answer could settle an operation",
            ));
        }
        if let Some(both) = applied.iter().find(|status| not_applied.contains(status)) {
            return Err(self.error(
                raw.not_applied.span(),
                field("not_applied"),
                format!("{} is also in applied: one answer cannot mean both", both.as_u16()),
            ));
        }
        let every = raw.every.get_ref().0;
        if every.is_zero() {
            return Err(self.error(raw.every.span(), field("every"), "must be greater than 0"));
        }
        let (first_after, give_up_after) = (raw.first_after.get_ref().0, raw.give_up_after.get_ref().0);
        if give_up_after <= first_after {
            return Err(self.error(
                raw.give_up_after.span(),
                field("give_up_after"),
                format!(
                    "{} does not exceed first_after ({}): no probe would ever run",
                    humantime::format_duration(give_up_after),
                    humantime::format_duration(first_after)
                ),
            ));
        }
        let timeout = match &raw.timeout {
            None => upstream_timeout,
            Some(timeout) if timeout.get_ref().0.is_zero() => {
                return Err(self.error(timeout.span(), field("timeout"), "must be greater than 0"));
            }
            Some(timeout) => timeout.get_ref().0,
        };
        let max_concurrent = *raw.max_concurrent.get_ref();
        if max_concurrent == 0 {
            return Err(self.error(raw.max_concurrent.span(), field("max_concurrent"), "must be at least 1"));
        }
        Ok(Reconcile {
            method,
            path,
            applied,
            not_applied,
            first_after,
            every,
            give_up_after,
            timeout,
            max_concurrent,
        })
    }

    /// A `docs_url`: an absolute `http` or `https` URL without a fragment (the
    /// problem's slug becomes its fragment), usable as a `Link` target.
    fn docs_url(&self, raw: &Spanned<String>, field: String) -> Result<Arc<str>, ConfigError> {
        let text = raw.get_ref();
        let bad = |reason: &str| self.error(raw.span(), field.clone(), format!("{text:?} {reason}"));
        if text.contains('#') {
            return Err(bad("has a fragment: the problem's slug is appended as one"));
        }
        let uri: http::Uri = text.parse().map_err(|_| bad("is not an absolute http or https URL"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(bad("is not an absolute http or https URL"));
        }
        if text.bytes().any(|byte| matches!(byte, b'<' | b'>' | b'"' | b' ')) {
            return Err(bad("has a character a Link header cannot carry"));
        }
        Ok(Arc::from(text.as_str()))
    }

    /// A probe path: begins with `/`, and every `{…}` in it is `{key}` or `{record}`;
    /// filled in, it must be a valid path and query.
    fn probe_path(&self, raw: &Spanned<String>, field: String) -> Result<ProbePath, ConfigError> {
        let text = raw.get_ref();
        let bad = |reason: String| self.error(raw.span(), field.clone(), reason);
        if !text.starts_with('/') {
            return Err(bad(format!("{text:?} does not begin with /")));
        }
        let mut pieces = Vec::new();
        let mut rest = text.as_str();
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(ProbePiece::Literal(rest[..open].to_string()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| bad(format!("{text:?} has a {{ without its }}")))?;
            pieces.push(match &rest[open + 1..open + close] {
                "key" => ProbePiece::Key,
                "record" => ProbePiece::Record,
                other => {
                    return Err(bad(format!(
                        "{{{other}}} is not a placeholder: use {{key}} or {{record}}"
                    )));
                }
            });
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(bad(format!("{text:?} has a }} without its {{")));
        }
        if !rest.is_empty() {
            pieces.push(ProbePiece::Literal(rest.to_string()));
        }
        let path = ProbePath(pieces);
        path.render("k", "0")
            .parse::<http::uri::PathAndQuery>()
            .map_err(|_| bad(format!("{text:?} is not a valid path and query")))?;
        Ok(path)
    }

    /// `fingerprint_body` with its `fingerprint_ignore` pointers (only with `"json"`).
    fn fingerprint_body(&self, raw: &RawIdempotency, field: &str) -> Result<FingerprintBody, ConfigError> {
        let span = raw.fingerprint_ignore.span();
        let pointers = raw.fingerprint_ignore.get_ref();
        if raw.fingerprint_body == RawFingerprintBody::Bytes {
            if !pointers.is_empty() {
                return Err(self.error(span, field.to_string(), "needs fingerprint_body = \"json\""));
            }
            return Ok(FingerprintBody::Bytes);
        }
        let ignore = pointers
            .iter()
            .map(|pointer| JsonPointer::parse(pointer))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|reason| self.error(span, field.to_string(), reason))?;
        Ok(FingerprintBody::Json { ignore })
    }

    /// The route's JWT verifier: its keys read from the JWKS file or the secret taken
    /// from the environment, exactly one of them.
    fn scope_jwt(&self, index: usize, raw: &RawScopeJwt) -> Result<JwtVerifier, ConfigError> {
        let field = |name: &str| format!("route[{index}].idempotency.scope_jwt.{name}");
        let header = self.header_name(&raw.header.span(), raw.header.get_ref(), field("header"))?;
        let invalid = |span: Range<usize>, name: &str, reason: String| self.error(span, field(name), reason);
        let (keys, span, name) = match (&raw.jwks_file, &raw.hs256_secret_env) {
            (Some(file), None) => {
                let path = self.file(file.get_ref());
                let text = std::fs::read_to_string(&path).map_err(|error| {
                    invalid(
                        file.span(),
                        "jwks_file",
                        format!("cannot read {}: {error}", path.display()),
                    )
                })?;
                (KeySource::Jwks(text), file.span(), "jwks_file")
            }
            (None, Some(variable)) => {
                let secret = std::env::var(variable.get_ref()).map_err(|_| {
                    invalid(
                        variable.span(),
                        "hs256_secret_env",
                        format!("the environment variable {} is not set", variable.get_ref()),
                    )
                })?;
                (
                    KeySource::Secret(secret.into_bytes()),
                    variable.span(),
                    "hs256_secret_env",
                )
            }
            (Some(file), Some(_)) => {
                return Err(invalid(
                    file.span(),
                    "jwks_file",
                    "give jwks_file or hs256_secret_env, not both".into(),
                ));
            }
            (None, None) => {
                return Err(invalid(
                    raw.claim.span(),
                    "jwks_file",
                    "scope_jwt needs jwks_file (RS256, ES256, EdDSA) or hs256_secret_env (HS256)".into(),
                ));
            }
        };
        JwtVerifier::new(
            header,
            raw.claim.get_ref().clone(),
            keys,
            raw.issuer.clone(),
            raw.audience.clone(),
            raw.leeway.0,
        )
        .map_err(|error| invalid(span, name, error.to_string()))
    }

    fn header_name(&self, span: &Range<usize>, name: &str, field: String) -> Result<HeaderName, ConfigError> {
        HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| self.error(span.clone(), field, format!("{name:?} is not a header name")))
    }

    fn header_names(&self, raw: &Spanned<Vec<String>>, field: String) -> Result<Vec<HeaderName>, ConfigError> {
        raw.get_ref()
            .iter()
            .map(|name| self.header_name(&raw.span(), name, field.clone()))
            .collect()
    }
}

fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.')
}
