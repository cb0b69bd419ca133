//! `[store]`: the backend and its bounds, and for Redis its topology, durability and TLS.

use std::ops::Range;
use std::time::Duration;

use toml::Spanned;

use crate::config::raw::{BackendKind, RawEncryption, RawPrevious, RawStore};
use crate::config::reference::{Backends, SETTINGS};
use crate::config::{
    Backend, ClientIdentity, DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS, DEFAULT_POSTGRES_CONNECTIONS,
    DEFAULT_POSTGRES_MAX_RECORDS_PER_SCOPE, DEFAULT_REPLICA_ACK_TIMEOUT, DEFAULT_SQLITE_CACHE_BYTES,
    DEFAULT_SQLITE_MAX_BYTES, DEFAULT_SQLITE_MAX_RECORDS, DEFAULT_STORE_CONNECTIONS, Encryption, PostgresConfig,
    Previous, RecordKey, RedisConfig, RedisTopology, SqliteConfig, StoreConfig, StoreLimits, StoreTls,
};
use crate::error::ConfigError;
use crate::tls::{self, TlsError};

use super::{Validator, is_name_byte};

impl Validator<'_> {
    pub(super) fn store(&self, raw: RawStore) -> Result<StoreConfig, ConfigError> {
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
        self.refuse_settings_of_other_backends(&raw)?;
        let backend = match *raw.backend.get_ref() {
            BackendKind::Memory => Backend::Memory(self.limits(&raw, DEFAULT_MAX_RECORDS, DEFAULT_MAX_BYTES)?),
            BackendKind::Sqlite => {
                let Some(path) = &raw.path else {
                    return Err(self.error(
                        raw.backend.span(),
                        "store.path",
                        "the sqlite backend needs the file it keeps its records in, e.g. path = \"records.db\"",
                    ));
                };
                if path.get_ref().is_empty() {
                    return Err(self.error(path.span(), "store.path", "must name a file"));
                }
                let cache_bytes = match &raw.cache_bytes {
                    Some(cache) if cache.get_ref().0 < 1024 * 1024 => {
                        return Err(self.error(cache.span(), "store.cache_bytes", "must be at least 1048576 (1 MiB)"));
                    }
                    Some(cache) => cache.get_ref().as_usize(),
                    None => DEFAULT_SQLITE_CACHE_BYTES,
                };
                Backend::Sqlite(SqliteConfig {
                    path: self.file(path.get_ref()),
                    limits: self.limits(&raw, DEFAULT_SQLITE_MAX_RECORDS, DEFAULT_SQLITE_MAX_BYTES)?,
                    cache_bytes,
                    // Set from server.max_buffered_bytes once the server is read.
                    response_budget: usize::MAX,
                })
            }
            BackendKind::Postgres => Backend::Postgres(Box::new(self.postgres(&raw)?)),
            kind => Backend::Redis(self.redis(kind, &raw)?),
        };
        let encryption = match &raw.encryption {
            None => None,
            Some(encryption) => Some(self.encryption(encryption.get_ref())?),
        };
        let previous = match raw.previous {
            None => None,
            Some(previous) => Some(self.previous(previous, &raw.key_prefix)?),
        };
        Ok(StoreConfig {
            backend,
            key_prefix: raw.key_prefix.into_inner(),
            timeout: raw.timeout.into_inner().0,
            encryption,
            previous,
        })
    }

    /// `[store.previous]`: a shared store (an embedded one is moved with `store copy`
    /// during a stop), read with this store's key prefix and record keys, until a time.
    fn previous(&self, raw: Spanned<RawPrevious>, key_prefix: &Spanned<String>) -> Result<Previous, ConfigError> {
        let span = raw.span();
        let mut raw = raw.into_inner();
        let Some(until) = raw.until.take() else {
            return Err(self.error(
                span,
                "store.previous.until",
                "is required: the time (RFC 3339, e.g. \"2027-01-31T00:00:00Z\") after which the previous store is no longer read",
            ));
        };
        let until = humantime::parse_rfc3339_weak(until.get_ref()).map_err(|error| {
            self.error(
                until.span(),
                "store.previous.until",
                format!("is not an RFC 3339 time: {error}"),
            )
        })?;
        if matches!(raw.backend.get_ref(), BackendKind::Memory | BackendKind::Sqlite) {
            return Err(self.error(
                raw.backend.span(),
                "store.previous.backend",
                format!(
                    "a {} store is one process's own: move its records with `idemproxy store copy` during a stop; \
                     [store.previous] reads a shared store (redis, redis-sentinel, redis-cluster, postgres)",
                    raw.backend.get_ref().name()
                ),
            ));
        }
        let raw = raw.into_store(key_prefix);
        let store = self.store(raw)?;
        Ok(Previous {
            backend: store.backend,
            timeout: store.timeout,
            until,
        })
    }

    /// `[store.encryption]`: the current key from `key_env`, the keys records may still
    /// be sealed with from `previous_keys_env` (comma-separated). Each is base64 of 32
    /// bytes; an unset variable, or a value that is not, refuses the config naming the
    /// variable (never its value).
    fn encryption(&self, raw: &RawEncryption) -> Result<Encryption, ConfigError> {
        let key = |text: &str, variable: &Spanned<String>, field: &str| {
            RecordKey::from_base64(text).ok_or_else(|| {
                self.error(
                    variable.span(),
                    field,
                    format!(
                        "the environment variable {} does not hold 32 bytes in base64 (make one with `openssl rand -base64 32`)",
                        variable.get_ref()
                    ),
                )
            })
        };
        if raw.key_env.get_ref().is_empty() {
            return Err(self.error(raw.key_env.span(), "store.encryption.key_env", "must name a variable"));
        }
        let current = key(
            &self.environment(&raw.key_env, "store.encryption.key_env")?,
            &raw.key_env,
            "store.encryption.key_env",
        )?;
        let mut previous: Vec<RecordKey> = Vec::new();
        if let Some(variable) = &raw.previous_keys_env {
            let field = "store.encryption.previous_keys_env";
            let text = self.environment(variable, field)?;
            for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
                let old = key(part, variable, field)?;
                if old.id() != current.id() && !previous.iter().any(|known| known.id() == old.id()) {
                    previous.push(old);
                }
            }
        }
        Ok(Encryption {
            key_env: raw.key_env.get_ref().clone(),
            previous_keys_env: raw
                .previous_keys_env
                .as_ref()
                .map(|variable| variable.get_ref().clone()),
            current,
            previous,
            accept_clear_records: raw.accept_clear_records,
        })
    }

    /// The value of the environment variable `variable` names (for `field`); unset or
    /// not text refuses the config, naming the variable, never a value.
    fn environment(&self, variable: &Spanned<String>, field: &str) -> Result<String, ConfigError> {
        std::env::var(variable.get_ref()).map_err(|error| {
            let reason = match error {
                std::env::VarError::NotPresent => "is not set",
                std::env::VarError::NotUnicode(_) => "is not text",
            };
            self.error(
                variable.span(),
                field,
                format!("the environment variable {} {reason}", variable.get_ref()),
            )
        })
    }

    /// An embedded store's bounds, with the backend's defaults.
    fn limits(&self, raw: &RawStore, default_records: usize, default_bytes: usize) -> Result<StoreLimits, ConfigError> {
        let max_records = match &raw.max_records {
            Some(max) if *max.get_ref() == 0 => {
                return Err(self.error(max.span(), "store.max_records", "must be greater than 0"));
            }
            Some(max) => *max.get_ref(),
            None => default_records,
        };
        let max_bytes = match &raw.max_bytes {
            Some(max) if max.get_ref().0 < 1024 * 1024 => {
                return Err(self.error(max.span(), "store.max_bytes", "must be at least 1048576 (1 MiB)"));
            }
            Some(max) => max.get_ref().as_usize(),
            None => default_bytes,
        };
        // A quarter of each bound by default: one client cannot take the store from
        // the others.
        let per_scope = |value: Option<(usize, Range<usize>)>, field: &str, default: usize| match value {
            Some((0, span)) => Err(self.error(span, field, "must be greater than 0")),
            Some((max, _)) => Ok(max),
            None => Ok((default / 4).max(1)),
        };
        let records = raw
            .max_records_per_scope
            .as_ref()
            .map(|max| (*max.get_ref(), max.span()));
        let max_records_per_scope = per_scope(records, "store.max_records_per_scope", max_records)?;
        let bytes = raw
            .max_bytes_per_scope
            .as_ref()
            .map(|max| (max.get_ref().as_usize(), max.span()));
        let max_bytes_per_scope = per_scope(bytes, "store.max_bytes_per_scope", max_bytes)?;
        let client = raw
            .max_records_per_client
            .as_ref()
            .map(|max| (*max.get_ref(), max.span()));
        // Half the store by default: two scopes' worth, so that two tenants behind one
        // address (a gateway) each get their own share, while one address (on a route
        // with or without scope) never takes the whole store from the others.
        let max_records_per_client = match per_scope(client, "store.max_records_per_client", max_records)? {
            _ if raw.max_records_per_client.is_none() => (max_records / 2).max(1),
            set => set,
        };
        Ok(StoreLimits {
            max_records,
            max_bytes,
            max_records_per_scope,
            max_bytes_per_scope,
            max_records_per_client,
        })
    }

    /// A setting the chosen backend does not take is refused, naming the backends that
    /// do (the reference's `backends` column) and what this one uses instead.
    fn refuse_settings_of_other_backends(&self, raw: &RawStore) -> Result<(), ConfigError> {
        let backend = raw.backend.get_ref().name();
        for (key, span) in raw.given() {
            let Some(setting) = SETTINGS.iter().find(|setting| setting.key == key) else {
                continue;
            };
            if let Backends::Only { backends, instead } = setting.backends
                && !setting.backends.take(backend)
            {
                let verb = if backends.len() == 1 { "uses" } else { "use" };
                let mut reason = format!(
                    "the {backend} backend has no such setting ({} {verb} it)",
                    setting.backends.named()
                );
                if !instead.is_empty() {
                    reason = format!("{reason}; {instead}");
                }
                return Err(self.error(span, key, reason));
            }
        }
        Ok(())
    }

    /// The Postgres backend: its URL (libpq's syntax), password, schema, pool, TLS,
    /// standbys and per-scope share.
    fn postgres(&self, raw: &RawStore) -> Result<PostgresConfig, ConfigError> {
        let Some(url) = &raw.url else {
            return Err(self.error(
                raw.backend.span(),
                "store.url",
                "the postgres backend needs url = \"postgres://user@host:5432/database\"",
            ));
        };
        let scheme_ok = url.get_ref().starts_with("postgres://") || url.get_ref().starts_with("postgresql://");
        let Some(url_text) = libpq_sslmode(url.get_ref()) else {
            return Err(self.error(
                url.span(),
                "store.url",
                "sslmode must be disable, prefer (the default: TLS when the server offers it), require, verify-ca or verify-full (the last three: TLS or no connection); whenever TLS is used, the certificate and host name are verified",
            ));
        };
        let parsed = match url_text.parse::<tokio_postgres::Config>() {
            Ok(parsed) if scheme_ok => parsed,
            // The parser's message may quote the URL, and with it a password.
            _ => {
                return Err(self.error(
                    url.span(),
                    "store.url",
                    "must be a postgres:// or postgresql:// URL in libpq's syntax (postgres://user@host:5432/database?sslmode=require)",
                ));
            }
        };
        if parsed.get_hosts().is_empty() {
            return Err(self.error(url.span(), "store.url", "must name a host"));
        }
        let mut server = parsed;
        if let Some(variable) = &raw.password_env {
            if variable.get_ref().is_empty() {
                return Err(self.error(variable.span(), "store.password_env", "must name a variable"));
            }
            if server.get_password().is_some() {
                return Err(self.error(
                    variable.span(),
                    "store.password_env",
                    "store.url holds a password too: keep it in one place",
                ));
            }
            server.password(self.environment(variable, "store.password_env")?);
        }
        let schema = match &raw.schema {
            None => "idemproxy".to_string(),
            Some(schema) => {
                let name = schema.get_ref();
                let first_ok = name
                    .bytes()
                    .next()
                    .is_some_and(|byte| byte.is_ascii_lowercase() || byte == b'_');
                let rest_ok = name
                    .bytes()
                    .all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_');
                if !first_ok || !rest_ok || name.len() > 48 || name.starts_with("pg_") {
                    return Err(self.error(
                        schema.span(),
                        "store.schema",
                        "must be 1 to 48 of a-z 0-9 _, starting with a letter or _, and not pg_ (a Postgres identifier that needs no quoting)",
                    ));
                }
                name.clone()
            }
        };
        let connections = match &raw.connections {
            Some(count) if !(1..=64).contains(count.get_ref()) => {
                return Err(self.error(count.span(), "store.connections", "must be between 1 and 64"));
            }
            Some(count) => *count.get_ref(),
            None => DEFAULT_POSTGRES_CONNECTIONS,
        };
        let max_records_per_scope = match &raw.max_records_per_scope {
            Some(max) if *max.get_ref() == 0 => {
                return Err(self.error(max.span(), "store.max_records_per_scope", "must be greater than 0"));
            }
            Some(max) => *max.get_ref(),
            None => DEFAULT_POSTGRES_MAX_RECORDS_PER_SCOPE,
        };
        let tls = self.store_tls(
            raw,
            server.get_ssl_mode() != tokio_postgres::config::SslMode::Disable,
            "TLS settings with sslmode=disable in store.url would never be used",
        )?;
        Ok(PostgresConfig {
            server,
            password_env: raw.password_env.as_ref().map(|variable| variable.get_ref().clone()),
            schema,
            migrate: raw.migrate.as_ref().is_none_or(|migrate| *migrate.get_ref()),
            connections,
            tls,
            min_replica_acks: raw.min_replica_acks.as_ref().map_or(0, |acks| *acks.get_ref()),
            max_records_per_scope,
        })
    }

    /// The Redis backends: which fields each topology takes, every URL checked.
    pub(super) fn redis(&self, kind: BackendKind, raw: &RawStore) -> Result<RedisConfig, ConfigError> {
        let topology = match kind {
            BackendKind::Redis => {
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
            // `store` validates the other backends itself and never asks for this.
            BackendKind::Memory | BackendKind::Sqlite | BackendKind::Postgres => {
                return Err(self.error(raw.backend.span(), "store.backend", "not a Redis backend"));
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
        let rediss = topology.urls().iter().any(|url| url.starts_with("rediss://"));
        let tls = self.store_tls(
            raw,
            rediss,
            "TLS settings need a rediss:// store URL; with redis:// they would never be used",
        )?;
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
    pub(super) fn store_tls(&self, raw: &RawStore, used: bool, unused: &str) -> Result<Option<StoreTls>, ConfigError> {
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
        if !used {
            return Err(self.error(span, first, unused));
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
    pub(super) fn redis_url(&self, url: &str, span: Range<usize>, field: &str) -> Result<(), ConfigError> {
        let scheme_ok = url.starts_with("redis://") || url.starts_with("rediss://");
        if !scheme_ok || redis::Client::open(url).is_err() {
            return Err(self.error(span, field, "must be a redis:// or rediss:// URL"));
        }
        Ok(())
    }
}

/// `url` with libpq's `sslmode=verify-ca` or `verify-full` written as tokio-postgres
/// takes it, `require`: over rustls the server's certificate and host name are always
/// verified, so each is as strict as verify-full. `None` for an sslmode libpq does not
/// have, or `allow` (plain text first), which tokio-postgres does not do.
fn libpq_sslmode(url: &str) -> Option<String> {
    let Some((base, query)) = url.split_once('?') else {
        return Some(url.to_string());
    };
    let mut pairs = Vec::new();
    for pair in query.split('&') {
        pairs.push(match pair.strip_prefix("sslmode=") {
            None | Some("disable" | "prefer" | "require") => pair,
            Some("verify-ca" | "verify-full") => "sslmode=require",
            Some(_) => return None,
        });
    }
    Some(format!("{base}?{}", pairs.join("&")))
}
