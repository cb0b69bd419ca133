//! `[[route]]` and `[route.idempotency]` (with `reconcile` and `scope_jwt`): what each
//! route matches, where it sends requests, and the policy that guards them.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use toml::Spanned;

use crate::config::key::{self, KeySource as KeyFrom};
use crate::config::raw::{
    HumanDuration, RawCors, RawFingerprintBody, RawIdempotency, RawReconcile, RawRefetch, RawRoute, RawScopeJwt,
};
use crate::config::{
    Calls, Cors, FingerprintBody, IdempotencyPolicy, JsonPointer, LEASE_GRACE, ProbePath, ProbePiece, Reconcile,
    Refetch, ReplayKind, Route, ServerConfig, Upstream, UpstreamKey,
};
use crate::error::ConfigError;
use crate::jwt::{JwtVerifier, KeySource};
use crate::tls::{self};

use super::{Validator, is_name_byte};

impl Validator<'_> {
    pub(super) fn route(&self, index: usize, raw: RawRoute, server: &ServerConfig) -> Result<Route, ConfigError> {
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
        match crate::request_target::canonical_path(prefix, &server.paths) {
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
        let cors = match &raw.cors {
            None => None,
            Some(cors) => Some(Arc::new(self.cors(cors, idempotency.as_deref(), &field("cors"))?)),
        };
        Ok(Route {
            cors,
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

    pub(super) fn upstream(&self, raw: &Spanned<String>, field: String) -> Result<Upstream, ConfigError> {
        let uri: http::Uri = raw
            .get_ref()
            .parse()
            .map_err(|_| self.error(raw.span(), field.clone(), "not a valid URL"))?;
        Upstream::try_from(uri).map_err(|reason| self.error(raw.span(), field, reason))
    }

    pub(super) fn policy(
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
        let calls = self.calls(&raw, &field)?;
        let mut fingerprint_body = self.fingerprint_body(&raw, &field("fingerprint_ignore"))?;
        // A retry of a JSON-RPC call carries an id of its own: the fingerprint is the
        // call's without it (with bytes, `calls::CallId::without` leaves its value out).
        if let (Some(Calls::JsonRpc { .. }), FingerprintBody::Json { ignore }) = (&calls, &mut fingerprint_body) {
            let id = JsonPointer::parse("/id").map_err(|reason| self.error(0..0, field("jsonrpc_methods"), reason))?;
            ignore.push(id);
        }
        let key = self.key_sources(&raw, &header, &fingerprint_body, &field("key"))?;
        let dedup_window = self.dedup_window(&raw, &key, upstream_timeout, &field("dedup_window"))?;
        let header = key
            .iter()
            .find_map(|source| match source {
                KeyFrom::Header(name) => Some(name.clone()),
                _ => None,
            })
            .unwrap_or(header);
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
        // Two customers' identical bodies (the same amount to the same merchant, the
        // payer in a header the fingerprint does not read) are one record unless a
        // scope tells them apart: the second would be answered with the first's receipt.
        if key.contains(&KeyFrom::Body) && scope_headers.is_empty() && scope_jwt.is_none() {
            let span = raw.key.as_ref().map_or(0..0, Spanned::span);
            return Err(self.error(
                span,
                field("key"),
                "the body source needs a scope (scope_headers or scope_jwt): without one, two clients' identical requests are one operation, and the second is answered with the first's response",
            ));
        }
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
        let remember = match &raw.remember {
            None => retention,
            Some(remember) if remember.get_ref().0 < retention => {
                return Err(self.error(
                    remember.span(),
                    field("remember"),
                    format!(
                        "{} is shorter than retention ({}): the key must be known at least as long as its response is replayed",
                        humantime::format_duration(remember.get_ref().0),
                        humantime::format_duration(retention)
                    ),
                ));
            }
            Some(remember) => remember.get_ref().0,
        };
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
        if raw.max_response_body_bytes.get_ref().0 == 0 {
            return Err(self.error(
                raw.max_response_body_bytes.span(),
                field("max_response_body_bytes"),
                "must be greater than 0",
            ));
        }
        if raw.max_response_body_bytes.get_ref().0 > max_buffered_bytes {
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
            Some(reconcile) => {
                let scoped = !scope_headers.is_empty() || scope_jwt.is_some();
                Some(self.reconcile(index, reconcile, upstream_timeout, raw.upstream_key, scoped)?)
            }
        };
        let replay = *raw.replay.get_ref();
        let replay_headers = match (&raw.replay_headers, replay) {
            (Some(headers), ReplayKind::Stored) => {
                return Err(self.error(
                    headers.span(),
                    field("replay_headers"),
                    "only replay = \"status\" or \"refetch\" takes it: replay = \"stored\" records every field but replay_exclude_headers",
                ));
            }
            (Some(headers), _) => self.header_names(headers, field("replay_headers"))?,
            (None, ReplayKind::Stored) => Vec::new(),
            (None, _) => vec![http::header::LOCATION],
        };
        let replay_headers: Vec<_> = replay_headers
            .into_iter()
            .filter(|name| !replay_exclude_headers.contains(name))
            .collect();
        let refetch = match (&raw.refetch, replay) {
            (Some(refetch), ReplayKind::Refetch) => {
                let scoped = !scope_headers.is_empty() || scope_jwt.is_some();
                Some(self.refetch(index, refetch, upstream_timeout, raw.upstream_key, scoped)?)
            }
            (None, ReplayKind::Refetch) => {
                return Err(self.error(
                    raw.replay.span(),
                    field("refetch"),
                    "replay = \"refetch\" needs refetch = { method = \"GET\", path = \"/…/{key}\" }: how a retry asks the upstream for the operation",
                ));
            }
            (Some(refetch), _) => {
                return Err(self.error(refetch.span(), field("refetch"), "only replay = \"refetch\" takes it"));
            }
            (None, _) => None,
        };
        Ok(IdempotencyPolicy {
            methods,
            header,
            key,
            dedup_window,
            required: raw.required,
            retention,
            remember,
            wait_for_in_flight,
            fingerprint_headers,
            mode: raw.mode,
            fingerprint_body,
            scope_headers,
            replay_exclude_headers,
            scope_jwt,
            max_response_body_bytes: raw.max_response_body_bytes.into_inner().0,
            on_server_error: raw.on_server_error,
            on_unauthorized: raw.on_unauthorized,
            on_store_error: raw.on_store_error,
            upstream_key: raw.upstream_key,
            upstream_key_header,
            reconcile,
            profile: raw.profile,
            replay,
            replay_headers,
            refetch,
            stream: raw.stream,
            calls,
        })
    }

    /// `jsonrpc_methods` or `graphql` (one of them), with `graphql_unparsable`.
    fn calls(&self, raw: &RawIdempotency, field: &dyn Fn(&str) -> String) -> Result<Option<Calls>, ConfigError> {
        match (&raw.jsonrpc_methods, &raw.graphql, &raw.graphql_unparsable) {
            (Some(methods), Some(_), _) => Err(self.error(
                methods.span(),
                field("jsonrpc_methods"),
                "a route is JSON-RPC or GraphQL, not both: give one of jsonrpc_methods and graphql",
            )),
            (Some(_), None, Some(unparsable)) | (None, None, Some(unparsable)) => Err(self.error(
                unparsable.span(),
                field("graphql_unparsable"),
                "only a route with graphql = \"mutations\" takes it",
            )),
            (Some(methods), None, None) => {
                let names = methods.get_ref();
                if names.is_empty() || names.iter().any(String::is_empty) {
                    return Err(self.error(
                        methods.span(),
                        field("jsonrpc_methods"),
                        "must name at least one method, none of them empty",
                    ));
                }
                Ok(Some(Calls::JsonRpc { methods: names.clone() }))
            }
            (None, Some(_), unparsable) => Ok(Some(Calls::GraphQl {
                unparsable: unparsable.as_ref().map(|u| *u.get_ref()).unwrap_or_default(),
            })),
            (None, None, None) => Ok(None),
        }
    }

    /// `[route.cors]`: exact origins (or `"*"` alone, without credentials), methods,
    /// headers (with the route's key and scope headers added), the preflight's age.
    fn cors(
        &self,
        raw: &Spanned<RawCors>,
        policy: Option<&IdempotencyPolicy>,
        field: &str,
    ) -> Result<Cors, ConfigError> {
        let span = raw.span();
        let raw = raw.get_ref();
        let at = |name: &str| format!("{field}.{name}");
        let listed = raw.allow_origins.get_ref();
        let origins = if listed.iter().any(|origin| origin == "*") {
            if listed.len() > 1 || raw.allow_credentials {
                return Err(self.error(
                    raw.allow_origins.span(),
                    at("allow_origins"),
                    "\"*\" stands alone, and never with allow_credentials (a browser refuses it)",
                ));
            }
            None
        } else {
            for origin in listed {
                crate::cors::check_origin(origin)
                    .map_err(|reason| self.error(raw.allow_origins.span(), at("allow_origins"), reason))?;
            }
            if listed.is_empty() {
                return Err(self.error(
                    raw.allow_origins.span(),
                    at("allow_origins"),
                    "must name at least one origin",
                ));
            }
            Some(listed.clone())
        };
        let mut methods = Vec::new();
        for method in raw.allow_methods.get_ref() {
            let parsed = Method::from_bytes(method.as_bytes()).map_err(|_| {
                self.error(
                    raw.allow_methods.span(),
                    at("allow_methods"),
                    format!("{method:?} is not an HTTP method"),
                )
            })?;
            methods.push(parsed.to_string());
        }
        let mut headers = self.header_names(&raw.allow_headers, at("allow_headers"))?;
        if let Some(policy) = policy {
            let keyed = policy.key.iter().filter_map(|source| match source {
                KeyFrom::Header(name) => Some(name.clone()),
                _ => None,
            });
            let extra: Vec<_> = std::iter::once(policy.header.clone())
                .chain(keyed)
                .chain(policy.scope_headers.iter().cloned())
                .collect();
            for name in extra {
                if !headers.contains(&name) {
                    headers.push(name);
                }
            }
        }
        let joined = |items: Vec<String>| {
            http::HeaderValue::try_from(items.join(", "))
                .map_err(|_| self.error(span.clone(), field.to_string(), "not a header value"))
        };
        Ok(Cors {
            origins,
            methods: joined(methods)?,
            headers: joined(headers.iter().map(|name| name.as_str().to_string()).collect())?,
            max_age: raw.max_age.get_ref().0.as_secs(),
            credentials: raw.allow_credentials,
        })
    }

    /// `[route.idempotency.refetch]`: a read-only method and a path like a probe's.
    fn refetch(
        &self,
        index: usize,
        raw: &Spanned<RawRefetch>,
        upstream_timeout: Duration,
        upstream_key: UpstreamKey,
        scoped: bool,
    ) -> Result<Refetch, ConfigError> {
        let field = |name: &str| format!("route[{index}].idempotency.refetch.{name}");
        let raw = raw.get_ref();
        let never = "a refetch must never run the operation again";
        let asker = Asker {
            who: "a refetch",
            never,
            scoped,
        };
        let (method, path) = self.lookup(&raw.method, &raw.path, upstream_key, &field, &asker)?;
        let timeout = self.lookup_timeout(raw.timeout.as_ref(), upstream_timeout, &field)?;
        Ok(Refetch { method, path, timeout })
    }

    /// A read-only request to the route's upstream about one record (a probe's or a
    /// refetch's): `GET` or `HEAD` (`asker.never` says why nothing else), and a path
    /// whose `{key}` the upstream is sent, never the client's own key on a scoped route.
    fn lookup(
        &self,
        method: &Spanned<String>,
        path: &Spanned<String>,
        upstream_key: UpstreamKey,
        field: &dyn Fn(&str) -> String,
        asker: &Asker<'_>,
    ) -> Result<(Method, ProbePath), ConfigError> {
        let never = asker.never;
        let method = match method.get_ref().to_ascii_uppercase().as_str() {
            "GET" => Method::GET,
            "HEAD" => Method::HEAD,
            other => {
                return Err(self.error(
                    method.span(),
                    field("method"),
                    format!("{other:?} is not GET or HEAD: {never}"),
                ));
            }
        };
        let parsed = self.probe_path(path, field("path"))?;
        // Two tenants may send the same key: the upstream, asked by the client's key
        // alone (a probe or a refetch carries no credentials), could answer about the
        // other's operation, and that answer would be replayed to this one.
        if parsed.names_key() && upstream_key == UpstreamKey::Client && asker.scoped {
            return Err(self.error(
                path.span(),
                field("path"),
                format!(
                    "names {{key}} with upstream_key = \"client\" on a scoped route: two tenants may send the same key, and {} (which carries no credentials) could learn the other tenant's operation; use upstream_key = \"derived\" (a key unique per tenant) or {{record}}",
                    asker.who
                ),
            ));
        }
        if parsed.names_key() && upstream_key == UpstreamKey::None {
            return Err(self.error(
                path.span(),
                field("path"),
                "names {key}, but upstream_key = \"none\" sends the upstream no key to look up; use {record} with upstream_key = \"derived\", or forward a key",
            ));
        }
        Ok((method, parsed))
    }

    /// A lookup's `timeout`: greater than 0, the route's `upstream_timeout` if not given.
    fn lookup_timeout(
        &self,
        timeout: Option<&Spanned<HumanDuration>>,
        upstream_timeout: Duration,
        field: &dyn Fn(&str) -> String,
    ) -> Result<Duration, ConfigError> {
        match timeout {
            None => Ok(upstream_timeout),
            Some(timeout) if timeout.get_ref().0.is_zero() => {
                Err(self.error(timeout.span(), field("timeout"), "must be greater than 0"))
            }
            Some(timeout) => Ok(timeout.get_ref().0),
        }
    }

    /// `[route.idempotency.reconcile]`: a read-only method, a path whose only
    /// placeholders are `{key}` and `{record}`, status lists that do not overlap, and a
    /// schedule that can run.
    pub(super) fn reconcile(
        &self,
        index: usize,
        raw: &Spanned<RawReconcile>,
        upstream_timeout: Duration,
        upstream_key: UpstreamKey,
        scoped: bool,
    ) -> Result<Reconcile, ConfigError> {
        let field = |name: &str| format!("route[{index}].idempotency.reconcile.{name}");
        let span = raw.span();
        let raw = raw.get_ref();
        let asker = Asker {
            who: "a probe",
            never: "a probe must never run the operation it asks about",
            scoped,
        };
        let (method, path) = self.lookup(&raw.method, &raw.path, upstream_key, &field, &asker)?;
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
        let timeout = self.lookup_timeout(raw.timeout.as_ref(), upstream_timeout, &field)?;
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
    pub(super) fn docs_url(&self, raw: &Spanned<String>, field: String) -> Result<Arc<str>, ConfigError> {
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
    pub(super) fn probe_path(&self, raw: &Spanned<String>, field: String) -> Result<ProbePath, ConfigError> {
        let text = raw.get_ref();
        let bad = |reason: String| self.error(raw.span(), field.clone(), reason);
        if !text.starts_with('/') {
            return Err(bad(format!("{text:?} does not begin with /")));
        }
        // A fragment is never sent: every probe would ask one URL.
        if text.contains('#') {
            return Err(bad(format!(
                "{text:?} has a '#': a fragment is never sent to the upstream"
            )));
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
        if !path.names_key() && !path.0.contains(&ProbePiece::Record) {
            return Err(bad(format!(
                "{text:?} names neither {{key}} nor {{record}}: every probe would ask about one URL, not about the record"
            )));
        }
        path.render("k", "0")
            .parse::<http::uri::PathAndQuery>()
            .map_err(|_| bad(format!("{text:?} is not a valid path and query")))?;
        Ok(path)
    }

    /// `key`: its sources, each parsed, or `header:` and `header` by default. Refused:
    /// an empty list, a source that does not parse, `header` set beside `key`, a
    /// source after `body` (never read: `body` is always present), and a pointer that
    /// `fingerprint_ignore` drops (the key would not be in the fingerprint).
    fn key_sources(
        &self,
        raw: &RawIdempotency,
        header: &http::HeaderName,
        fingerprint_body: &FingerprintBody,
        field: &str,
    ) -> Result<Vec<KeyFrom>, ConfigError> {
        let Some(list) = &raw.key else {
            return Ok(vec![KeyFrom::Header(header.clone())]);
        };
        let refuse = |reason: String| Err(self.error(list.span(), field.to_string(), reason));
        if raw.header.span() != (0..0) {
            return refuse("give key or header, not both: write the header in key as \"header:NAME\"".into());
        }
        if list.get_ref().is_empty() {
            return refuse(
                "must name at least one source (header:NAME, json:/pointer, form:NAME, query:NAME or body)".into(),
            );
        }
        let mut sources = Vec::with_capacity(list.get_ref().len());
        for text in list.get_ref() {
            match KeyFrom::parse(text) {
                Ok(source) => sources.push(source),
                Err(reason) => return refuse(reason),
            }
        }
        if let Some(at) = sources.iter().position(|source| *source == KeyFrom::Body)
            && at + 1 < sources.len()
        {
            return refuse(format!(
                "{} comes after body, which every request has, so it is never read: put body last",
                sources[at + 1]
            ));
        }
        if let FingerprintBody::Json { ignore } = fingerprint_body {
            for source in &sources {
                let KeyFrom::Json(pointers) = source else { continue };
                for pointer in pointers {
                    if let Some(dropped) = ignore.iter().find(|ignored| pointer.is_within(ignored)) {
                        return refuse(format!(
                            "{source}: fingerprint_ignore drops {dropped}, so the key would not be in the fingerprint (the same key with another value there would replay)"
                        ));
                    }
                }
            }
        }
        Ok(sources)
    }

    /// `dedup_window`: required by the `body` source and taken by nothing else, and,
    /// like `retention`, longer than the lease.
    fn dedup_window(
        &self,
        raw: &RawIdempotency,
        sources: &[KeyFrom],
        upstream_timeout: Duration,
        field: &str,
    ) -> Result<Option<Duration>, ConfigError> {
        let body = sources.contains(&KeyFrom::Body);
        let window = match (&raw.dedup_window, body) {
            (None, false) => return Ok(None),
            (Some(window), false) => {
                return Err(self.error(
                    window.span(),
                    field.to_string(),
                    "only the body source takes it: add \"body\" to key, last",
                ));
            }
            (None, true) => {
                let span = raw.key.as_ref().map_or(0..0, Spanned::span);
                return Err(self.error(
                    span,
                    field.to_string(),
                    format!(
                        "the body source ({}) needs dedup_window: how long two identical requests are one operation",
                        key::describe(sources)
                    ),
                ));
            }
            (Some(window), true) => window,
        };
        let length = window.get_ref().0;
        if length <= upstream_timeout + LEASE_GRACE {
            return Err(self.error(
                window.span(),
                field.to_string(),
                format!(
                    "{} does not exceed the lease (upstream_timeout {} + 1s); a record would expire while its request may still be in flight",
                    humantime::format_duration(length),
                    humantime::format_duration(upstream_timeout)
                ),
            ));
        }
        Ok(Some(length))
    }

    /// `fingerprint_body` with its `fingerprint_ignore` pointers (only with `"json"`).
    pub(super) fn fingerprint_body(&self, raw: &RawIdempotency, field: &str) -> Result<FingerprintBody, ConfigError> {
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
    pub(super) fn scope_jwt(&self, index: usize, raw: &RawScopeJwt) -> Result<JwtVerifier, ConfigError> {
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
}

/// Who asks the upstream about a record by a path (`lookup`): named in refusals.
struct Asker<'a> {
    /// "a probe", "a refetch".
    who: &'a str,
    /// Why only a read-only method will do.
    never: &'a str,
    /// Whether the route has a scope (`scope_headers` or `scope_jwt`).
    scoped: bool,
}
