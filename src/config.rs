//! Configuration: the raw TOML structs exactly as users write them, and the validated
//! `Config` the rest of the proxy reads. Every error names the file, the line and the
//! field. This module does no I/O beyond reading the one file it is given.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Uri};
use serde::Deserialize;
use toml::Spanned;

use crate::error::ConfigError;

/// One second beyond the upstream timeout: how long an owner may hold a claim.
pub const LEASE_GRACE: Duration = Duration::from_secs(1);

// === validated configuration ===

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: Option<AdminConfig>,
    pub store: StoreConfig,
    pub routes: Vec<Route>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_request_body_bytes: u64,
    pub header_read_timeout: Duration,
    pub request_body_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Worker threads, each with its own runtime and listening socket.
    pub workers: usize,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub backend: Backend,
    pub key_prefix: String,
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub enum Backend {
    Memory { max_records: usize },
    Redis { url: String },
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path_prefix: String,
    pub host: Option<String>,
    pub upstream: Uri,
    pub upstream_timeout: Duration,
    /// Shared, so a guarded request can hold its policy without borrowing the route.
    pub idempotency: Option<Arc<IdempotencyPolicy>>,
}

#[derive(Debug, Clone)]
pub struct IdempotencyPolicy {
    pub methods: Vec<Method>,
    pub header: HeaderName,
    pub required: bool,
    pub retention: Duration,
    pub fingerprint_headers: Vec<HeaderName>,
    pub scope_headers: Vec<HeaderName>,
    pub max_response_body_bytes: u64,
    pub on_server_error: OnServerError,
    pub on_store_error: OnStoreError,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnServerError {
    Release,
    Store,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    Reject,
    Forward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum BackendKind {
    Memory,
    Redis,
}

impl Route {
    /// How long a claim's owner may hold it before the record reads as unknown.
    pub fn lease(&self) -> Duration {
        self.upstream_timeout + LEASE_GRACE
    }
}

impl Config {
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
        let raw: RawConfig = toml::from_str(source).map_err(|error| {
            let span = error.span().unwrap_or(0..0);
            ConfigError::Invalid {
                path: path.to_path_buf(),
                line: line_of(source, span.start),
                field: field_at(source, span.start),
                reason: error.message().trim().to_string(),
            }
        })?;
        Validator { source, path }.config(raw)
    }
}

// === raw configuration, as written ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    admin: Option<RawAdmin>,
    #[serde(default)]
    store: RawStore,
    #[serde(rename = "route")]
    routes: Option<Spanned<Vec<RawRoute>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawServer {
    listen: SocketAddr,
    max_request_body_bytes: Spanned<u64>,
    header_read_timeout: Spanned<HumanDuration>,
    request_body_timeout: Spanned<HumanDuration>,
    shutdown_grace: HumanDuration,
    workers: Option<Spanned<usize>>,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_request_body_bytes: Spanned::new(0..0, 1024 * 1024),
            header_read_timeout: Spanned::new(0..0, HumanDuration(Duration::from_secs(10))),
            request_body_timeout: Spanned::new(0..0, HumanDuration(Duration::from_secs(30))),
            shutdown_grace: HumanDuration(Duration::from_secs(30)),
            workers: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    #[serde(default = "default_admin_listen")]
    listen: SocketAddr,
}

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawStore {
    backend: Spanned<BackendKind>,
    url: Option<Spanned<String>>,
    key_prefix: Spanned<String>,
    timeout: Spanned<HumanDuration>,
    max_records: Option<Spanned<usize>>,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            backend: Spanned::new(0..0, BackendKind::Memory),
            url: None,
            key_prefix: Spanned::new(0..0, "idemproxy".to_string()),
            timeout: Spanned::new(0..0, HumanDuration(Duration::from_millis(500))),
            max_records: None,
        }
    }
}

/// The memory store's bound when `store.max_records` is not set.
pub const DEFAULT_MAX_RECORDS: usize = 100_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: Spanned<String>,
    path_prefix: Spanned<String>,
    host: Option<Spanned<String>>,
    upstream: Spanned<String>,
    #[serde(default = "default_upstream_timeout")]
    upstream_timeout: Spanned<HumanDuration>,
    idempotency: Option<RawIdempotency>,
}

fn default_upstream_timeout() -> Spanned<HumanDuration> {
    Spanned::new(0..0, HumanDuration(Duration::from_secs(30)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawIdempotency {
    methods: Spanned<Vec<String>>,
    header: Spanned<String>,
    required: bool,
    retention: Spanned<HumanDuration>,
    fingerprint_headers: Spanned<Vec<String>>,
    scope_headers: Spanned<Vec<String>>,
    max_response_body_bytes: Spanned<u64>,
    on_server_error: OnServerError,
    on_store_error: OnStoreError,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        RawIdempotency {
            methods: Spanned::new(0..0, vec!["POST".into(), "PATCH".into()]),
            header: Spanned::new(0..0, "Idempotency-Key".into()),
            required: true,
            retention: Spanned::new(0..0, HumanDuration(Duration::from_secs(24 * 3600))),
            fingerprint_headers: Spanned::new(0..0, vec!["content-type".into()]),
            scope_headers: Spanned::new(0..0, Vec::new()),
            max_response_body_bytes: Spanned::new(0..0, 1024 * 1024),
            on_server_error: OnServerError::Release,
            on_store_error: OnStoreError::Reject,
        }
    }
}

/// A humantime duration string such as `"250ms"`, `"30s"` or `"24h"`.
#[derive(Debug, Clone, Copy)]
struct HumanDuration(Duration);

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

// === impl Validator ===

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
            let route = self.route(index, raw_route)?;
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
        Ok(Config {
            server,
            admin: raw.admin.map(|admin| AdminConfig { listen: admin.listen }),
            store,
            routes,
        })
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
        Ok(ServerConfig {
            workers,
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
                if let Some(url) = &raw.url {
                    return Err(self.error(url.span(), "store.url", "only the redis backend takes a url"));
                }
                let max_records = match &raw.max_records {
                    Some(max) if *max.get_ref() == 0 => {
                        return Err(self.error(max.span(), "store.max_records", "must be greater than 0"));
                    }
                    Some(max) => *max.get_ref(),
                    None => DEFAULT_MAX_RECORDS,
                };
                Backend::Memory { max_records }
            }
            BackendKind::Redis => {
                if let Some(max) = &raw.max_records {
                    return Err(self.error(
                        max.span(),
                        "store.max_records",
                        "only the memory backend takes max_records; bound Redis with maxmemory",
                    ));
                }
                let Some(url) = raw.url else {
                    return Err(self.error(
                        raw.backend.span(),
                        "store.url",
                        "the redis backend needs url = \"redis://host:6379/0\"",
                    ));
                };
                let scheme_ok = url.get_ref().starts_with("redis://") || url.get_ref().starts_with("rediss://");
                if !scheme_ok || redis::Client::open(url.get_ref().as_str()).is_err() {
                    return Err(self.error(url.span(), "store.url", "must be a redis:// or rediss:// URL"));
                }
                Backend::Redis { url: url.into_inner() }
            }
        };
        Ok(StoreConfig {
            backend,
            key_prefix: raw.key_prefix.into_inner(),
            timeout: raw.timeout.into_inner().0,
        })
    }

    fn route(&self, index: usize, raw: RawRoute) -> Result<Route, ConfigError> {
        let field = |name: &str| format!("route[{index}].{name}");
        let name = raw.name.get_ref();
        if name.is_empty() || name.len() > 64 || !name.bytes().all(is_name_byte) {
            return Err(self.error(
                raw.name.span(),
                field("name"),
                "must be 1 to 64 of the characters A-Z a-z 0-9 _ - .",
            ));
        }
        if !raw.path_prefix.get_ref().starts_with('/') {
            return Err(self.error(raw.path_prefix.span(), field("path_prefix"), "must start with /"));
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
        let idempotency = match raw.idempotency {
            Some(policy) => Some(Arc::new(self.policy(index, policy, upstream_timeout)?)),
            None => None,
        };
        Ok(Route {
            name: raw.name.into_inner(),
            path_prefix: raw.path_prefix.into_inner(),
            host,
            upstream,
            upstream_timeout,
            idempotency,
        })
    }

    fn upstream(&self, raw: &Spanned<String>, field: String) -> Result<Uri, ConfigError> {
        let uri: Uri = raw
            .get_ref()
            .parse()
            .map_err(|_| self.error(raw.span(), field.clone(), "not a valid URL"))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            _ => {
                return Err(self.error(raw.span(), field, "the scheme must be http or https"));
            }
        }
        if uri.authority().is_none() {
            return Err(self.error(raw.span(), field, "the URL needs a host"));
        }
        if uri.query().is_some() {
            return Err(self.error(raw.span(), field, "the URL must not have a query"));
        }
        Ok(uri)
    }

    fn policy(
        &self,
        index: usize,
        raw: RawIdempotency,
        upstream_timeout: Duration,
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
        let scope_headers = self.header_names(&raw.scope_headers, field("scope_headers"))?;
        let retention = raw.retention.get_ref().0;
        if retention < upstream_timeout + LEASE_GRACE {
            return Err(self.error(
                raw.retention.span(),
                field("retention"),
                format!(
                    "{} is shorter than the lease (upstream_timeout {} + 1s); a record would expire while its request is in flight",
                    humantime::format_duration(retention),
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
        Ok(IdempotencyPolicy {
            methods,
            header,
            required: raw.required,
            retention,
            fingerprint_headers,
            scope_headers,
            max_response_body_bytes: raw.max_response_body_bytes.into_inner(),
            on_server_error: raw.on_server_error,
            on_store_error: raw.on_store_error,
        })
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

/// The 1-based line that holds byte `offset` of `source`.
fn line_of(source: &str, offset: usize) -> usize {
    let offset = offset.min(source.len());
    source.as_bytes()[..offset].iter().filter(|&&b| b == b'\n').count() + 1
}

/// Names the field at byte `offset`: the table path above it plus the key on its line,
/// e.g. `route[1].upstream`. Used for errors that the TOML parser reports by position.
fn field_at(source: &str, offset: usize) -> String {
    let offset = offset.min(source.len());
    let line_start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line_end = source[offset..].find('\n').map_or(source.len(), |i| offset + i);
    let line = source[line_start..line_end].trim();
    let key = if line.starts_with('[') {
        None
    } else {
        line.split_once('=')
            .map(|(key, _)| key.trim().trim_matches('"').to_string())
    };
    let mut table = String::new();
    let mut route_index: Option<usize> = None;
    let upto = if key.is_none() { line_end } else { line_start };
    for header in source[..upto].lines().map(str::trim) {
        if header == "[[route]]" {
            route_index = Some(route_index.map_or(0, |i| i + 1));
            table = "route".into();
        } else if let Some(name) = header.strip_prefix('[').and_then(|h| h.split(']').next()) {
            table = name.trim_start_matches('[').trim().to_string();
        }
    }
    if let (Some(index), Some(rest)) = (route_index, table.strip_prefix("route")) {
        table = format!("route[{index}]{rest}");
    }
    match (table.is_empty(), key) {
        (true, Some(key)) => key,
        (true, None) => "(top level)".into(),
        (false, Some(key)) => format!("{table}.{key}"),
        (false, None) => table,
    }
}

impl std::fmt::Display for Config {
    /// The summary `idemproxy check` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "listen {}", self.server.listen)?;
        if let Some(admin) = &self.admin {
            writeln!(f, "admin  {}", admin.listen)?;
        }
        match &self.store.backend {
            Backend::Memory { max_records } => writeln!(f, "store  memory (max_records {max_records})")?,
            Backend::Redis { url } => writeln!(f, "store  redis {}", redact_url(url))?,
        }
        for route in &self.routes {
            let guard = match &route.idempotency {
                None => "unguarded".to_string(),
                Some(policy) => format!(
                    "guards {} by {} (retention {})",
                    policy.methods.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
                    policy.header,
                    humantime::format_duration(policy.retention)
                ),
            };
            writeln!(
                f,
                "route  {} {}{} -> {} ({guard})",
                route.name,
                route.host.as_deref().unwrap_or(""),
                route.path_prefix,
                route.upstream
            )?;
        }
        Ok(())
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
