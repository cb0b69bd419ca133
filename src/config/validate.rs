//! Validation: turns the raw TOML into the `Config` the proxy runs on, producing the
//! runtime values the hot path uses (a parsed upstream `Upstream`, typed methods and
//! header names), so nothing is parsed twice. Every error names the file, the line and
//! the field: the field's path comes from `serde_path_to_error` for anything the TOML
//! types refuse, and from the validator for anything its rules refuse.

use std::ops::Range;
use std::path::{Path, PathBuf};

use http::header::HeaderName;
use toml::Spanned;

use super::raw::{RawConfig, RawTracing};
use super::{AdminConfig, AdminToken, Config, Route, TracingConfig};
use crate::error::ConfigError;

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

mod route;
mod server;
mod store;

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
        let contract_span = raw.server.contract_path.span();
        let server = self.server(raw.server)?;
        let store_bytes_span = raw
            .store
            .max_bytes
            .as_ref()
            .map_or_else(|| raw.store.backend.span(), Spanned::span);
        let mut store = self.store(raw.store)?;
        if let crate::config::Backend::Sqlite(sqlite) = &mut store.backend {
            sqlite.response_budget = usize::try_from(server.max_buffered_bytes).unwrap_or(usize::MAX);
        }
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
        // The contract is answered at its path before any route: a guarded route whose
        // prefix it is would have its own requests answered 405.
        if let Some(path) = &server.contract_path
            && let Some(route) = routes
                .iter()
                .find(|route| route.idempotency.is_some() && route.path_prefix == *path)
        {
            return Err(self.error(
                contract_span,
                "server.contract_path",
                format!(
                    "{path:?} is route {}'s path_prefix: its guarded requests would be answered with the contract's 405; choose another path, or \"\"",
                    route.name
                ),
            ));
        }
        // The SQLite store stops taking claims at seven eighths of its file, so that the
        // responses of requests already forwarded still fit: each must fit in that eighth.
        if let super::Backend::Sqlite(sqlite) = &store.backend
            && let Some((route, largest)) = routes
                .iter()
                .filter_map(|route| Some((route, route.idempotency.as_ref()?.max_response_body_bytes)))
                .max_by_key(|(_, bytes)| *bytes)
            && largest > (sqlite.limits.max_bytes / 8) as u64
        {
            return Err(self.error(
                store_bytes_span,
                "store.max_bytes",
                format!(
                    "must be at least 8 times route {}'s max_response_body_bytes ({largest}): claims stop at seven eighths of the file, and the last eighth holds the responses of requests already forwarded",
                    route.name
                ),
            ));
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

    /// A path in the config, relative to the config file's directory.
    fn file(&self, raw: &str) -> PathBuf {
        let path = Path::new(raw);
        match self.path.parent() {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_path_buf(),
        }
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
