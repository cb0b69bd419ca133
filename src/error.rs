//! One error enum per boundary, and the one exhaustive function that turns a rejection
//! into an RFC 9457 problem: its status, its slug, whose fault it is (which decides the
//! log level) and the outcome it is counted as. No internal error text ever reaches a
//! response body: details go to the log.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderValue, Response, StatusCode};

use crate::jwt::JwtError;
use crate::target::TargetError;

/// Any error, boxed, where the cause only goes to the log.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The configuration file is wrong or unreadable: the operator's fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read the config: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: {field}: {reason}", path.display())]
    Invalid {
        path: PathBuf,
        line: usize,
        field: String,
        reason: String,
    },
}

/// The client sent an unusable idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the request carries no idempotency key")]
    Missing,
    #[error("the idempotency key is empty")]
    Empty,
    #[error("the idempotency key is longer than 255 characters")]
    TooLong,
    #[error("the idempotency key has characters other than visible ASCII")]
    NotVisibleAscii,
    #[error("the idempotency key header appears more than once or holds a list")]
    Repeated,
    #[error("the idempotency key is a malformed structured-field string")]
    MalformedString,
}

/// The store did not answer as it should.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the store is unreachable")]
    Unavailable(#[source] redis::RedisError),
    /// The TLS handshake with a store node failed, or the node refused our certificate:
    /// nothing reached Redis, and every attempt fails alike until the configuration
    /// changes.
    #[error(
        "the store's TLS handshake failed (see store.url or urls, store.tls_ca_file, store.tls_cert_file and store.tls_key_file)"
    )]
    Tls(#[source] redis::RedisError),
    #[error("the memory store holds its maximum of {limit} {what}")]
    Full { what: &'static str, limit: usize },
    /// One client's records hold its share of the memory store (`max_records_per_scope`
    /// or `max_bytes_per_scope`); its oldest expires in `retry_after`.
    #[error("the client's records hold their share of the memory store ({what})")]
    ScopeFull { what: &'static str, retry_after: Duration },
    #[error("the store returned an unexpected reply: {0}")]
    Protocol(&'static str),
    /// A claim was written, and fewer replicas than `min_replica_acks` acknowledged it
    /// in time: a failover could lose it.
    #[error("only {acks} of the {wanted} replica acknowledgements the claim needs arrived in time")]
    NotReplicated { acks: u32, wanted: u32 },
    /// The store answers but cannot serve (a cluster with uncovered slots, a sentinel's
    /// primary that is not a primary).
    #[error("the store cannot serve: {0}")]
    Unready(&'static str),
}

impl StoreError {
    /// The failure in one word, as a span's `error.type` says it.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Tls(_) => "tls",
            StoreError::Full { .. } => "full",
            StoreError::ScopeFull { .. } => "scope_full",
            StoreError::Protocol(_) => "protocol",
            StoreError::NotReplicated { .. } => "not_replicated",
            StoreError::Unready(_) => "unready",
        }
    }

    /// Whether the operation may have been applied although it failed: a timeout or a
    /// lost connection says nothing about what the store did. Only a refusal the store
    /// itself gave before writing (a full memory store), or a connection that never
    /// passed its TLS handshake, rules it out.
    pub fn may_have_written(&self) -> bool {
        match self {
            StoreError::Timeout(_)
            | StoreError::Unavailable(_)
            | StoreError::Protocol(_)
            | StoreError::NotReplicated { .. } => true,
            StoreError::Full { .. } | StoreError::ScopeFull { .. } | StoreError::Unready(_) | StoreError::Tls(_) => {
                false
            }
        }
    }
}

/// The upstream failed the exchange.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// Nothing was sent: the connection could not be made.
    #[error("cannot connect to the upstream")]
    Unavailable(#[source] BoxError),
    /// The request may have been sent, and no full response came within the timeout.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The request may have been sent, and the exchange broke.
    #[error("the upstream exchange failed")]
    Failed(#[source] BoxError),
}

impl UpstreamError {
    /// The failure in one word, as a span's `error.type` says it.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Unavailable(_) => "unavailable",
            UpstreamError::Timeout(_) => "timeout",
            UpstreamError::Failed(_) => "failed",
        }
    }
}

/// The proxy broke its own invariant: its fault, never the client's.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error("cannot rewrite the request for the upstream")]
    Rewrite(#[source] http::Error),
    #[error("the exchange task ended without a response")]
    ExchangeLost,
    #[error("the operating system's random source failed")]
    Random,
}

/// Everything the proxy answers itself instead of forwarding.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Rejection {
    #[error("no route matches the request")]
    NoRoute,
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("the request body is larger than {0} bytes")]
    BodyTooLarge(u64),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(Duration),
    #[error("the request body could not be read")]
    BodyIncomplete(#[source] BoxError),
    #[error("the idempotency key was used with a different request")]
    KeyReused,
    #[error("the request's token does not verify: {0}")]
    UnverifiedScope(#[from] JwtError),
    #[error("the first request with this key is still in flight")]
    InProgress {
        retry_after: Duration,
        /// How long the first request's lease still runs: a waiter's latest re-read.
        lease_remaining: Duration,
    },
    #[error("the outcome of the first request with this key is unknown")]
    OutcomeUnknown {
        /// Being reconciled by the route's probe: the next probe begins in this long.
        /// `None`: the route has no probe, or it gave up; an operator must resolve it.
        reconciling: Option<Duration>,
    },
    #[error("the proxy is at its bound on {0}")]
    Overloaded(Bound),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    Internal(#[from] ProxyError),
}

/// Which bound on guarded requests in flight was reached (503 `overloaded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Bound {
    #[error("guarded requests in flight ({0}, server.max_guarded_requests)")]
    Requests(usize),
    /// The body reader knows the byte budget only through what it may take, so the
    /// setting is named, not its value.
    #[error("the bytes buffered bodies may hold (server.max_buffered_bytes)")]
    Bytes,
}

/// Whose fault a rejection is, as pingora's `ErrorSource` says it. It decides the level
/// a rejection is logged at; the status and the metric outcome come with it from
/// `Rejection::problem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The client sent something the proxy must refuse, or raced its own retry.
    Client,
    /// The upstream failed the exchange.
    Upstream,
    /// The store failed or is full.
    Store,
    /// The proxy is at a configured bound.
    Capacity,
    /// The proxy broke its own invariant.
    Proxy,
}

impl Fault {
    /// The level a rejection with this fault is logged at.
    pub(crate) fn level(self) -> tracing::Level {
        match self {
            Fault::Client => tracing::Level::INFO,
            Fault::Upstream | Fault::Store | Fault::Capacity => tracing::Level::WARN,
            Fault::Proxy => tracing::Level::ERROR,
        }
    }
}

label_values! {
    /// How a request ended, as counted in `idemproxy_requests_total`.
    pub(crate) enum Outcome {
        /// Sent to the upstream, guarded or not.
        Forwarded => "forwarded",
        /// Answered from a recorded response.
        Replayed => "replayed",
        /// 409: in progress or outcome unknown.
        Conflict => "conflict",
        /// 422: the key was reused with a different request.
        Mismatch => "mismatch",
        /// Refused before the store: no route, a bad key, a body too large or too slow.
        Rejected => "rejected",
        /// 503: the store failed or is full.
        StoreError => "store_error",
        /// 502 or 504: the upstream failed.
        UpstreamError => "upstream_error",
        /// 500: the proxy broke its own invariant.
        InternalError => "internal_error",
    }
}

/// What a problem response says, before it is rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) status: StatusCode,
    pub(crate) slug: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<u64>,
    /// `WWW-Authenticate`, on a 401.
    pub(crate) authenticate: Option<&'static str>,
    /// The record's operation id, on a 409 `outcome-unknown`.
    pub(crate) operation: Option<String>,
    /// On a 409 `outcome-unknown`: whether the route's probe is reconciling it.
    pub(crate) reconciling: Option<bool>,
    /// The route's `docs_url`: the problem's `type` is `docs_url#slug`, and a `Link`
    /// names it as what describes the response.
    pub(crate) docs_url: Option<std::sync::Arc<str>>,
    /// The shape the route's clients expect.
    pub(crate) profile: Profile,
    pub(crate) fault: Fault,
    pub(crate) outcome: Outcome,
}

pub(crate) const PROBLEM_TYPE_PREFIX: &str = "urn:idemproxy:problem:";

/// A problem's `type`: `docs_url#slug` on a route with a `docs_url`, else the URN.
pub(crate) fn problem_type(docs_url: Option<&str>, slug: &str) -> String {
    match docs_url {
        Some(docs) => format!("{docs}#{slug}"),
        None => format!("{PROBLEM_TYPE_PREFIX}{slug}"),
    }
}

/// `route.idempotency.profile`: the statuses and error bodies a route's clients
/// expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// RFC 9457 problem details, as the Idempotency-Key draft answers (422 on reuse).
    #[default]
    Ietf,
    /// As Stripe's API answers: `{"error": {"type", "code", "message"}}`, key reuse a
    /// 400 `idempotency_error`, so clients written against it handle it unchanged.
    Stripe,
}

impl Profile {
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Ietf => "ietf",
            Profile::Stripe => "stripe",
        }
    }

    /// The status `slug` is answered with under this profile: Stripe answers key
    /// reuse with 400, not 422.
    pub(crate) fn status(self, status: StatusCode, slug: &str) -> StatusCode {
        match (self, slug) {
            (Profile::Stripe, "idempotency-key-reused") => StatusCode::BAD_REQUEST,
            _ => status,
        }
    }
}

/// Stripe's error `type` for a problem: the idempotency problems are
/// `idempotency_error`, a client's other mistakes `invalid_request_error`, and what the
/// proxy, the store or the upstream failed at `api_error`.
fn stripe_type(slug: &str, fault: Fault) -> &'static str {
    match (slug, fault) {
        ("idempotency-key-reused" | "request-in-progress" | "outcome-unknown", _) => "idempotency_error",
        (_, Fault::Client) => "invalid_request_error",
        _ => "api_error",
    }
}

/// Stripe's error `code`: its own word for a key in use by a request in flight, else
/// the slug with underscores.
fn stripe_code(slug: &str) -> String {
    match slug {
        "request-in-progress" => "idempotency_key_in_use".into(),
        slug => slug.replace('-', "_"),
    }
}

impl Rejection {
    /// The one mapping from a rejection to its status, problem slug, the sentence a
    /// client may read, whose fault it is and how it is counted. Exhaustive: a new
    /// variant cannot reach a client before it is given its own row here.
    pub(crate) fn problem(&self) -> Problem {
        use Fault::{Capacity, Client, Proxy, Store, Upstream};
        let (status, slug, title, fault, outcome) = match self {
            Rejection::NoRoute => (StatusCode::NOT_FOUND, "no-route", "No route", Client, Outcome::Rejected),
            Rejection::Target(
                TargetError::MalformedEscape
                | TargetError::EscapedSlash
                | TargetError::Parameter
                | TargetError::CaseVariant,
            ) => (
                StatusCode::BAD_REQUEST,
                "invalid-path",
                "Invalid path",
                Client,
                Outcome::Rejected,
            ),
            Rejection::Target(
                TargetError::MissingHost
                | TargetError::RepeatedHost
                | TargetError::InvalidHost
                | TargetError::ConflictingHost,
            ) => (
                StatusCode::BAD_REQUEST,
                "invalid-host",
                "Invalid host",
                Client,
                Outcome::Rejected,
            ),
            Rejection::Target(TargetError::MethodCase) => (
                StatusCode::BAD_REQUEST,
                "invalid-method",
                "Invalid method",
                Client,
                Outcome::Rejected,
            ),
            Rejection::Key(KeyError::Missing) => (
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Missing idempotency key",
                Client,
                Outcome::Rejected,
            ),
            Rejection::Key(
                KeyError::Empty
                | KeyError::TooLong
                | KeyError::NotVisibleAscii
                | KeyError::Repeated
                | KeyError::MalformedString,
            ) => (
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "Invalid idempotency key",
                Client,
                Outcome::Rejected,
            ),
            Rejection::BodyTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-body-too-large",
                "Request body too large",
                Client,
                Outcome::Rejected,
            ),
            Rejection::BodyTimeout(_) => (
                StatusCode::REQUEST_TIMEOUT,
                "request-body-timeout",
                "Request body too slow",
                Client,
                Outcome::Rejected,
            ),
            Rejection::BodyIncomplete(_) => (
                StatusCode::BAD_REQUEST,
                "request-body-incomplete",
                "Request body incomplete",
                Client,
                Outcome::Rejected,
            ),
            Rejection::UnverifiedScope(_) => (
                StatusCode::UNAUTHORIZED,
                "unverified-scope",
                "Unverified scope",
                Client,
                Outcome::Rejected,
            ),
            Rejection::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency key reused",
                Client,
                Outcome::Mismatch,
            ),
            Rejection::InProgress { .. } => (
                StatusCode::CONFLICT,
                "request-in-progress",
                "Request in progress",
                Client,
                Outcome::Conflict,
            ),
            Rejection::OutcomeUnknown { .. } => (
                StatusCode::CONFLICT,
                "outcome-unknown",
                "Outcome unknown",
                Client,
                Outcome::Conflict,
            ),
            Rejection::Overloaded(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "Too many guarded requests in flight",
                Capacity,
                Outcome::Rejected,
            ),
            Rejection::Store(StoreError::Full { .. }) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-full",
                "Idempotency store full",
                Store,
                Outcome::StoreError,
            ),
            Rejection::Store(StoreError::ScopeFull { .. }) => (
                StatusCode::TOO_MANY_REQUESTS,
                "scope-full",
                "Too many live keys for this client",
                Client,
                Outcome::Rejected,
            ),
            Rejection::Store(
                StoreError::Unavailable(_)
                | StoreError::Tls(_)
                | StoreError::Protocol(_)
                | StoreError::Timeout(_)
                | StoreError::NotReplicated { .. }
                | StoreError::Unready(_),
            ) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Idempotency store unavailable",
                Store,
                Outcome::StoreError,
            ),
            Rejection::Upstream(UpstreamError::Unavailable(_)) => (
                StatusCode::BAD_GATEWAY,
                "upstream-unavailable",
                "Upstream unavailable",
                Upstream,
                Outcome::UpstreamError,
            ),
            Rejection::Upstream(UpstreamError::Timeout(_)) => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream-timeout",
                "Upstream timeout",
                Upstream,
                Outcome::UpstreamError,
            ),
            Rejection::Upstream(UpstreamError::Failed(_)) => (
                StatusCode::BAD_GATEWAY,
                "upstream-failed",
                "Upstream failed",
                Upstream,
                Outcome::UpstreamError,
            ),
            Rejection::Internal(ProxyError::Rewrite(_) | ProxyError::ExchangeLost | ProxyError::Random) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal-error",
                "Internal error",
                Proxy,
                Outcome::InternalError,
            ),
        };
        // RFC 9110 §15.5.2: a 401 names the scheme that would be accepted.
        let authenticate = match self {
            Rejection::UnverifiedScope(JwtError::Missing) => Some("Bearer"),
            Rejection::UnverifiedScope(_) => Some("Bearer error=\"invalid_token\""),
            _ => None,
        };
        let retry_after = match self {
            Rejection::InProgress { retry_after, .. } => Some(retry_after.as_secs().max(1)),
            Rejection::Store(StoreError::ScopeFull { retry_after, .. }) => {
                Some(retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0))
            }
            Rejection::Store(_) | Rejection::Overloaded(_) => Some(1),
            // The next probe, in whole seconds rounded up: a retry then may find it settled.
            Rejection::OutcomeUnknown {
                reconciling: Some(next),
            } => Some((next.as_secs() + u64::from(next.subsec_nanos() > 0)).max(1)),
            _ => None,
        };
        let reconciling = match self {
            Rejection::OutcomeUnknown { reconciling } => Some(reconciling.is_some()),
            _ => None,
        };
        Problem {
            status,
            slug,
            title,
            detail: self.public_detail(),
            retry_after,
            authenticate,
            operation: None,
            reconciling,
            docs_url: None,
            profile: Profile::Ietf,
            fault,
            outcome,
        }
    }

    /// The sentence a client may read. Exhaustive, like `problem`: a client's own
    /// mistakes are described by their `Display`; the store's, the upstream's and the
    /// proxy's by a fixed sentence, so that no internal detail (an address, a capacity,
    /// a cause) reaches a client.
    fn public_detail(&self) -> String {
        match self {
            Rejection::NoRoute
            | Rejection::Target(_)
            | Rejection::Key(_)
            | Rejection::BodyTooLarge(_)
            | Rejection::BodyTimeout(_)
            | Rejection::BodyIncomplete(_)
            | Rejection::KeyReused
            | Rejection::UnverifiedScope(_)
            | Rejection::InProgress { .. }
            | Rejection::OutcomeUnknown { .. } => self.to_string(),
            Rejection::Overloaded(_) => {
                "the proxy is at its bound on guarded requests in flight or the bytes they hold; nothing was forwarded"
                    .into()
            }
            Rejection::Store(StoreError::Full { .. }) => "the idempotency store is full; nothing was forwarded".into(),
            Rejection::Store(StoreError::ScopeFull { .. }) => {
                "this client's live idempotency keys hold its share of the store; nothing was forwarded, retry after the oldest expires".into()
            }
            Rejection::Store(
                StoreError::Unavailable(_) | StoreError::Tls(_) | StoreError::Protocol(_) | StoreError::Unready(_),
            ) => {
                "the idempotency store is unreachable; nothing was forwarded".into()
            }
            Rejection::Store(StoreError::NotReplicated { .. }) => {
                "the idempotency store could not replicate the claim in time; nothing was forwarded".into()
            }
            Rejection::Store(StoreError::Timeout(_)) => {
                "the idempotency store did not answer in time; nothing was forwarded".into()
            }
            Rejection::Upstream(UpstreamError::Unavailable(_)) => {
                "the upstream refused the connection; nothing was sent, a retry runs again".into()
            }
            Rejection::Upstream(UpstreamError::Timeout(_)) => {
                "the upstream did not answer in time; its outcome is unknown, and retries with this key get 409".into()
            }
            Rejection::Upstream(UpstreamError::Failed(_)) => {
                "the upstream exchange broke after the request was sent; its outcome is unknown, and retries with this key get 409".into()
            }
            Rejection::Internal(ProxyError::Rewrite(_) | ProxyError::ExchangeLost | ProxyError::Random) => "the proxy failed".into(),
        }
    }
}

impl Problem {
    /// Renders the problem as its profile says: an `application/problem+json`
    /// response, or Stripe's error object.
    pub(crate) fn into_response(self) -> Response<Bytes> {
        let kind = problem_type(self.docs_url.as_deref(), self.slug);
        let status = self.profile.status(self.status, self.slug);
        let (content_type, body) = match self.profile {
            Profile::Ietf => {
                let mut body = serde_json::json!({
                    "type": kind,
                    "title": self.title,
                    "status": status.as_u16(),
                    "detail": self.detail,
                });
                if let Some(operation) = &self.operation {
                    body["operation"] = serde_json::Value::String(operation.clone());
                }
                if let Some(reconciling) = self.reconciling {
                    body["reconciling"] = serde_json::Value::Bool(reconciling);
                }
                ("application/problem+json", body)
            }
            Profile::Stripe => {
                let mut error = serde_json::json!({
                    "type": stripe_type(self.slug, self.fault),
                    "code": stripe_code(self.slug),
                    "message": self.detail,
                });
                if self.docs_url.is_some() {
                    error["doc_url"] = serde_json::Value::String(kind);
                }
                if let Some(operation) = &self.operation {
                    error["operation"] = serde_json::Value::String(operation.clone());
                }
                if let Some(reconciling) = self.reconciling {
                    error["reconciling"] = serde_json::Value::Bool(reconciling);
                }
                ("application/json", serde_json::json!({ "error": error }))
            }
        };
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(seconds) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(challenge) = self.authenticate {
            headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
        }
        if let Some(link) = self
            .docs_url
            .as_deref()
            .and_then(|docs| HeaderValue::try_from(format!("<{docs}>; rel=\"describedby\"")).ok())
        {
            headers.insert(http::header::LINK, link);
        }
        response
    }
}

/// Displays an error followed by its sources, for logs. A source whose text its error
/// already ends with (the redis crate prints its cause, then gives it as the source) is
/// not repeated.
pub(crate) struct DisplayChain<'a>(pub(crate) &'a dyn std::error::Error);

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut previous = self.0.to_string();
        f.write_str(&previous)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !previous.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            previous = text;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_store_capacity_never_reaches_a_client() {
        let problem = Rejection::Store(StoreError::Full {
            what: "records",
            limit: 12345,
        })
        .problem();
        assert_eq!(problem.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!problem.detail.contains("12345"), "{}", problem.detail);
    }

    #[test]
    fn overload_is_a_503_of_its_own_with_a_retry_after_and_no_capacity_in_it() {
        let problem = Rejection::Overloaded(Bound::Requests(4321)).problem();
        assert_eq!(
            (problem.status, problem.slug),
            (StatusCode::SERVICE_UNAVAILABLE, "overloaded")
        );
        assert_eq!(problem.retry_after, Some(1));
        assert_eq!(
            (problem.fault.level(), problem.outcome),
            (tracing::Level::WARN, Outcome::Rejected)
        );
        assert!(!problem.detail.contains("4321"), "{}", problem.detail);
        // The log names the bound reached; a body over the budget was once logged
        // with the request body limit as if it were the budget.
        let bytes = Rejection::Overloaded(Bound::Bytes);
        assert_eq!(bytes.problem().slug, "overloaded");
        assert!(DisplayChain(&bytes).to_string().contains("server.max_buffered_bytes"));
        assert!(
            DisplayChain(&Rejection::Overloaded(Bound::Requests(4321)))
                .to_string()
                .contains("4321")
        );
    }

    #[test]
    fn an_unknown_outcome_says_whether_it_is_being_reconciled_and_when_to_retry() {
        let reconciling = Rejection::OutcomeUnknown {
            reconciling: Some(Duration::from_millis(4_200)),
        }
        .problem();
        assert_eq!(
            (reconciling.retry_after, reconciling.reconciling),
            (Some(5), Some(true))
        );
        let due = Rejection::OutcomeUnknown {
            reconciling: Some(Duration::ZERO),
        }
        .problem();
        assert_eq!(due.retry_after, Some(1));
        let left = Rejection::OutcomeUnknown { reconciling: None }.problem();
        assert_eq!((left.retry_after, left.reconciling), (None, Some(false)));
        let body: serde_json::Value = serde_json::from_slice(left.into_response().body()).expect("a JSON problem");
        assert_eq!(body["reconciling"], serde_json::Value::Bool(false));
        assert_eq!(Rejection::KeyReused.problem().reconciling, None);
    }

    #[test]
    fn internal_errors_are_the_proxys_fault_and_counted_as_such() {
        let problem = Rejection::Internal(ProxyError::ExchangeLost).problem();
        assert_eq!(problem.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!((problem.fault, problem.outcome), (Fault::Proxy, Outcome::InternalError));
        assert_eq!(problem.fault.level(), tracing::Level::ERROR);
    }

    #[test]
    fn only_a_full_store_or_a_failed_handshake_rules_out_a_write() {
        assert!(
            !StoreError::Full {
                what: "bytes",
                limit: 1
            }
            .may_have_written()
        );
        let refused = || redis::RedisError::from((redis::ErrorKind::Io, "handshake"));
        assert!(
            !StoreError::Tls(refused()).may_have_written(),
            "a failed handshake wrote nothing"
        );
        assert!(StoreError::Unavailable(refused()).may_have_written());
        assert!(StoreError::Timeout(Duration::from_secs(1)).may_have_written());
        assert!(StoreError::Protocol("x").may_have_written());
    }
}
