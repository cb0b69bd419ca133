//! `[server]` and `[server.tls]`: the listener, its bounds and its certificates.

use std::ops::Range;

use toml::Spanned;

use crate::config::raw::{RawServer, RawTls};
use crate::config::{PathPolicy, ServerConfig, ServerTls};
use crate::error::ConfigError;
use crate::tls::{self, TlsError};

use super::Validator;

impl Validator<'_> {
    /// `server.contract_path`: `""` (off), or a canonical path with no query or
    /// fragment, since it is matched against a request's canonical path: a spelling
    /// that is not canonical could never match.
    fn contract_path(&self, raw: &Spanned<String>, paths: &PathPolicy) -> Result<Option<String>, ConfigError> {
        let path = raw.get_ref().as_str();
        let bad = |reason: String| self.error(raw.span(), "server.contract_path", reason);
        if path.is_empty() {
            return Ok(None);
        }
        if !path.starts_with('/') || path.contains(['?', '#']) || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(bad(format!(
                "{path:?} is not a path (it must begin with /, with no query or fragment); \"\" turns the document off"
            )));
        }
        match crate::request_target::canonical_path(path, paths) {
            Ok(canonical) if canonical == path => Ok(Some(path.to_string())),
            Ok(canonical) => Err(bad(format!(
                "{path:?} is not a canonical path, so no request could ever match it: write {canonical:?}"
            ))),
            Err(error) => Err(bad(format!("{path:?}: {error}"))),
        }
    }

    pub(super) fn server(&self, raw: RawServer) -> Result<ServerConfig, ConfigError> {
        if raw.max_request_body_bytes.get_ref().0 == 0 {
            return Err(self.error(
                raw.max_request_body_bytes.span(),
                "server.max_request_body_bytes",
                "must be greater than 0",
            ));
        }
        for (field, value) in [
            ("server.header_read_timeout", &raw.header_read_timeout),
            ("server.request_body_timeout", &raw.request_body_timeout),
            ("server.request_body_idle_timeout", &raw.request_body_idle_timeout),
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
        let max_buffered_bytes = raw.max_buffered_bytes.get_ref().0;
        if max_buffered_bytes / 4 * 3 < raw.max_request_body_bytes.get_ref().0 {
            return Err(self.error(
                raw.max_buffered_bytes.span(),
                "server.max_buffered_bytes",
                format!(
                    "{max_buffered_bytes} leaves less than max_request_body_bytes ({}) for request bodies, which may take three quarters of it",
                    raw.max_request_body_bytes.get_ref().0
                ),
            ));
        }
        let paths = PathPolicy {
            merge_slashes: raw.merge_slashes,
            escaped_slashes: raw.escaped_slashes,
            path_parameters: raw.path_parameters,
        };
        let contract_path = self.contract_path(&raw.contract_path, &paths)?;
        Ok(ServerConfig {
            contract_path,
            tls,
            workers,
            max_connections: raw.max_connections.into_inner(),
            max_guarded_requests: raw.max_guarded_requests.into_inner(),
            max_buffered_bytes,
            max_waiters: raw.max_waiters.into_inner(),
            access_log: raw.access_log,
            paths,
            listen: raw.listen,
            max_request_body_bytes: raw.max_request_body_bytes.into_inner().0,
            header_read_timeout: raw.header_read_timeout.into_inner().0,
            request_body_timeout: raw.request_body_timeout.into_inner().0,
            request_body_idle_timeout: raw.request_body_idle_timeout.into_inner().0,
            shutdown_grace: raw.shutdown_grace.0,
        })
    }

    /// Reads the listener's certificate, key and client CA, each named by its own field
    /// when it fails, and makes its configuration.
    pub(super) fn server_tls(&self, raw: &RawTls) -> Result<ServerTls, ConfigError> {
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
}
