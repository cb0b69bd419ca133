//! The problems the proxy answers with itself, as data: one `ProblemKind` per problem
//! slug, and for each its one row (`ProblemKind::row`): status, slug, title, what it
//! means (as the published contract says it), what a client reads, whose fault it is,
//! how it is counted, what shadow mode counts it as, how the Stripe profile spells it,
//! and on which guarded routes it can occur. Rendering a problem under a route's
//! profile (RFC 9457 problem details, or Stripe's error object) is here too. A leaf:
//! it imports nothing of the proxy's, so that every module can read a row. A new
//! refusal is one variant and one row.

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, LINK, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderValue, Response, StatusCode};

label_values! {
    /// Every problem the proxy answers with, by its slug: the guarded routes' own
    /// first, in the order the published contract lists them, then the ones any
    /// request can get.
    pub(crate) enum ProblemKind {
        MissingKey => "missing-idempotency-key",
        InvalidKey => "invalid-idempotency-key",
        KeyReused => "idempotency-key-reused",
        InProgress => "request-in-progress",
        OutcomeUnknown => "outcome-unknown",
        ResponseExpired => "response-expired",
        UnverifiedScope => "unverified-scope",
        BodyTooLarge => "request-body-too-large",
        BodyTimeout => "request-body-timeout",
        BodyIncomplete => "request-body-incomplete",
        CallUnreadable => "call-unreadable",
        ScopeFull => "scope-full",
        ClientFull => "client-full",
        Overloaded => "overloaded",
        StoreUnavailable => "store-unavailable",
        StoreFull => "store-full",
        UpstreamUnavailable => "upstream-unavailable",
        UpstreamTimeout => "upstream-timeout",
        UpstreamFailed => "upstream-failed",
        ReplayUnavailable => "replay-unavailable",
        NoRoute => "no-route",
        InvalidPath => "invalid-path",
        InvalidHost => "invalid-host",
        InvalidMethod => "invalid-method",
        Internal => "internal-error",
    }
}

/// Everything about one problem kind.
#[derive(Debug)]
pub(crate) struct Row {
    /// Under the IETF profile; `stripe.status` may differ.
    pub(crate) status: StatusCode,
    pub(crate) title: &'static str,
    /// What it means for a client, as the published contract says it.
    pub(crate) meaning: &'static str,
    /// What a client reads in `detail` (`message` under the Stripe profile).
    pub(crate) detail: Detail,
    pub(crate) fault: Fault,
    pub(crate) outcome: Outcome,
    /// What a shadow-mode route counts a request enforce mode refuses so as.
    pub(crate) would: Would,
    pub(crate) stripe: Stripe,
    /// On which guarded routes the published contract lists it.
    pub(crate) listed: Listed,
    /// Whether a shadow-mode route can answer it: one that forwards every request as
    /// an unguarded route would answers only the upstream's failures and a body the
    /// client broke.
    pub(crate) in_shadow: bool,
}

/// What a client reads about a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Detail {
    /// The client's own mistake, described by the rejection's text.
    Own,
    /// A fixed sentence: what the store, the upstream or the proxy failed at is for the
    /// log, never a client (no address, capacity or cause).
    Fixed(&'static str),
}

/// How the Stripe profile answers a problem: `{"error": {"type", "code", "message"}}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stripe {
    pub(crate) kind: &'static str,
    pub(crate) code: &'static str,
    /// Where Stripe answers with another status than the IETF profile.
    pub(crate) status: Option<StatusCode>,
}

/// On which guarded routes a problem can occur.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listed {
    /// Every guarded route.
    Always,
    /// A route whose key is `required`.
    WhenRequired,
    /// A route scoped by `scope_jwt`.
    WhenScopeJwt,
    /// A route with `replay = "refetch"`.
    WhenRefetch,
    /// A JSON-RPC or GraphQL route (`jsonrpc_methods`, `graphql`).
    WhenCalls,
    /// A route whose records outlive their responses (`remember` past `retention`).
    WhenRemembered,
    /// Not a guarded route's own: any request may get it (no route, a bad path).
    Never,
}

const IDEMPOTENCY_ERROR: &str = "idempotency_error";
const INVALID_REQUEST: &str = "invalid_request_error";
const API_ERROR: &str = "api_error";

/// A client's mistake: 400-class, logged at info, counted as rejected, a shadow route's
/// `would = rejected`, Stripe's `invalid_request_error` with the slug as its code.
const fn client(status: StatusCode, title: &'static str, code: &'static str, meaning: &'static str) -> Row {
    Row {
        status,
        title,
        meaning,
        detail: Detail::Own,
        fault: Fault::Client,
        outcome: Outcome::Rejected,
        would: Would::Rejected,
        stripe: Stripe {
            kind: INVALID_REQUEST,
            code,
            status: None,
        },
        listed: Listed::Always,
        in_shadow: false,
    }
}

/// A failure of the store, the upstream or the proxy: a fixed sentence, Stripe's
/// `api_error` with the slug as its code.
const fn failure(status: StatusCode, title: &'static str, code: &'static str, fault: Fault, outcome: Outcome) -> Row {
    Row {
        status,
        title,
        meaning: "",
        detail: Detail::Fixed(""),
        fault,
        outcome,
        would: Would::Rejected,
        stripe: Stripe {
            kind: API_ERROR,
            code,
            status: None,
        },
        listed: Listed::Always,
        in_shadow: false,
    }
}

impl ProblemKind {
    /// The problem's one row. Exhaustive: a new kind cannot be answered before it has
    /// its row here.
    pub(crate) const fn row(self) -> &'static Row {
        use StatusCode as S;
        match self {
            ProblemKind::MissingKey => {
                const {
                    &Row {
                        listed: Listed::WhenRequired,
                        would: Would::MissingKey,
                        ..client(
                            S::BAD_REQUEST,
                            "Missing idempotency key",
                            "missing_idempotency_key",
                            "the route requires a key and the request has none; nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::InvalidKey => {
                const {
                    &Row {
                        would: Would::InvalidKey,
                        ..client(
                            S::BAD_REQUEST,
                            "Invalid idempotency key",
                            "invalid_idempotency_key",
                            "the key is empty, too long, repeated, a list, not visible ASCII, or (on a route whose probe names the key in its path) only dots; nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::KeyReused => {
                const {
                    &Row {
                        outcome: Outcome::Mismatch,
                        would: Would::Mismatch,
                        stripe: Stripe {
                            kind: IDEMPOTENCY_ERROR,
                            code: "idempotency_key_reused",
                            status: Some(S::BAD_REQUEST),
                        },
                        ..client(
                            S::UNPROCESSABLE_ENTITY,
                            "Idempotency key reused",
                            "",
                            "the key was first used with a different request (method, path, query, fingerprinted headers or body); nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::InProgress => {
                const {
                    &Row {
                        outcome: Outcome::Conflict,
                        would: Would::Conflict,
                        stripe: Stripe {
                            kind: IDEMPOTENCY_ERROR,
                            code: "idempotency_key_in_use",
                            status: None,
                        },
                        ..client(
                            S::CONFLICT,
                            "Request in progress",
                            "",
                            "the first request with this key is still in flight; retry after Retry-After",
                        )
                    }
                }
            }
            ProblemKind::OutcomeUnknown => {
                const {
                    &Row {
                        outcome: Outcome::Conflict,
                        would: Would::Conflict,
                        stripe: Stripe {
                            kind: IDEMPOTENCY_ERROR,
                            code: "outcome_unknown",
                            status: None,
                        },
                        ..client(
                            S::CONFLICT,
                            "Outcome unknown",
                            "",
                            "the first request with this key was sent but its outcome could not be learned; `operation` names it, and `reconciling` says whether the proxy is asking the upstream (retry after Retry-After) or an operator must resolve it",
                        )
                    }
                }
            }
            ProblemKind::ResponseExpired => {
                const {
                    &Row {
                        outcome: Outcome::Expired,
                        would: Would::Expired,
                        listed: Listed::WhenRemembered,
                        stripe: Stripe {
                            kind: IDEMPOTENCY_ERROR,
                            code: "response_expired",
                            status: None,
                        },
                        ..client(
                            S::GONE,
                            "Response expired",
                            "",
                            "the first request with this key completed (`completed_at`, with `completed_status`) and its response is past the route's retention, while the key is still remembered; nothing was forwarded and it was not run again. A new operation needs a new key",
                        )
                    }
                }
            }
            ProblemKind::UnverifiedScope => {
                const {
                    &Row {
                        listed: Listed::WhenScopeJwt,
                        ..client(
                            S::UNAUTHORIZED,
                            "Unverified scope",
                            "unverified_scope",
                            "the bearer token that scopes the key is missing or does not verify; nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::BodyTooLarge => {
                const {
                    &client(
                        S::PAYLOAD_TOO_LARGE,
                        "Request body too large",
                        "request_body_too_large",
                        "the body is over the proxy's limit; nothing was forwarded",
                    )
                }
            }
            ProblemKind::BodyTimeout => {
                const {
                    &client(
                        S::REQUEST_TIMEOUT,
                        "Request body too slow",
                        "request_body_timeout",
                        "the body did not arrive in time; nothing was forwarded",
                    )
                }
            }
            ProblemKind::BodyIncomplete => {
                const {
                    &Row {
                        in_shadow: true,
                        ..client(
                            S::BAD_REQUEST,
                            "Request body incomplete",
                            "request_body_incomplete",
                            "the body broke off; nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::CallUnreadable => {
                const {
                    &Row {
                        listed: Listed::WhenCalls,
                        in_shadow: true,
                        ..client(
                            S::BAD_REQUEST,
                            "Call cannot be read",
                            "call_unreadable",
                            "on a JSON-RPC or GraphQL route: the body is not a JSON-RPC 2.0 request, a batch holds a guarded call (send those one at a time), or the GraphQL operation cannot be told on a route that refuses what it cannot parse; nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::ScopeFull => {
                const {
                    &Row {
                        detail: Detail::Fixed(
                            "this client's live idempotency keys hold its share of the store; nothing was forwarded, retry after the oldest expires",
                        ),
                        would: Would::StoreError,
                        ..client(
                            S::TOO_MANY_REQUESTS,
                            "Too many live keys for this client",
                            "scope_full",
                            "this client's live keys hold its share of the store; retry after Retry-After, nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::ClientFull => {
                const {
                    &Row {
                        detail: Detail::Fixed(
                            "the records made from this client address hold its share of the store; nothing was forwarded, retry after the oldest expires",
                        ),
                        would: Would::StoreError,
                        ..client(
                            S::TOO_MANY_REQUESTS,
                            "Too many live keys from this client address",
                            "client_full",
                            "the records made from this client's address, across the scopes it sends, hold its share of the store; retry after Retry-After, nothing was forwarded",
                        )
                    }
                }
            }
            ProblemKind::Overloaded => {
                const {
                    &Row {
                        meaning: "the proxy is at its bound on guarded requests in flight; retry, nothing was forwarded",
                        detail: Detail::Fixed(
                            "the proxy is at its bound on guarded requests in flight or the bytes they hold; nothing was forwarded",
                        ),
                        would: Would::Overloaded,
                        ..failure(
                            S::SERVICE_UNAVAILABLE,
                            "Too many guarded requests in flight",
                            "overloaded",
                            Fault::Capacity,
                            Outcome::Rejected,
                        )
                    }
                }
            }
            ProblemKind::StoreUnavailable => {
                const {
                    &Row {
                        meaning: "the idempotency store did not answer; retry, nothing was forwarded",
                        detail: Detail::Fixed(
                            "the idempotency store did not answer (unreachable, too slow, or unable to replicate the claim in time); nothing was forwarded",
                        ),
                        would: Would::StoreError,
                        ..failure(
                            S::SERVICE_UNAVAILABLE,
                            "Idempotency store unavailable",
                            "store_unavailable",
                            Fault::Store,
                            Outcome::StoreError,
                        )
                    }
                }
            }
            ProblemKind::StoreFull => {
                const {
                    &Row {
                        meaning: "the idempotency store is full; retry, nothing was forwarded",
                        detail: Detail::Fixed("the idempotency store is full; nothing was forwarded"),
                        would: Would::StoreError,
                        ..failure(
                            S::SERVICE_UNAVAILABLE,
                            "Idempotency store full",
                            "store_full",
                            Fault::Store,
                            Outcome::StoreError,
                        )
                    }
                }
            }
            ProblemKind::UpstreamUnavailable => {
                const {
                    &Row {
                        in_shadow: true,
                        meaning: "the upstream refused the connection; nothing was sent, and a retry runs again",
                        detail: Detail::Fixed(
                            "the upstream refused the connection; nothing was sent, a retry runs again",
                        ),
                        ..failure(
                            S::BAD_GATEWAY,
                            "Upstream unavailable",
                            "upstream_unavailable",
                            Fault::Upstream,
                            Outcome::UpstreamError,
                        )
                    }
                }
            }
            ProblemKind::UpstreamTimeout => {
                const {
                    &Row {
                        in_shadow: true,
                        meaning: "the upstream did not answer in time; the outcome is unknown, and retries get 409 outcome-unknown until it is learned",
                        detail: Detail::Fixed(
                            "the upstream did not answer in time; its outcome is unknown, and retries with this key get 409",
                        ),
                        ..failure(
                            S::GATEWAY_TIMEOUT,
                            "Upstream timeout",
                            "upstream_timeout",
                            Fault::Upstream,
                            Outcome::UpstreamError,
                        )
                    }
                }
            }
            ProblemKind::ReplayUnavailable => {
                const {
                    &Row {
                        listed: Listed::WhenRefetch,
                        meaning: "the request was a retry of one that completed, and the upstream could not be asked for its result (`replay = \"refetch\"`: refused, timed out or a 5xx); the operation was not run again, retry after Retry-After",
                        detail: Detail::Fixed(
                            "this key's operation completed, and its result could not be fetched from the upstream; it was not run again, retry later",
                        ),
                        ..failure(
                            S::SERVICE_UNAVAILABLE,
                            "Replay unavailable",
                            "replay_unavailable",
                            Fault::Upstream,
                            Outcome::UpstreamError,
                        )
                    }
                }
            }
            ProblemKind::UpstreamFailed => {
                const {
                    &Row {
                        in_shadow: true,
                        meaning: "the exchange broke after the request was sent; the outcome is unknown, and retries get 409 outcome-unknown until it is learned",
                        detail: Detail::Fixed(
                            "the upstream exchange broke after the request was sent; its outcome is unknown, and retries with this key get 409",
                        ),
                        ..failure(
                            S::BAD_GATEWAY,
                            "Upstream failed",
                            "upstream_failed",
                            Fault::Upstream,
                            Outcome::UpstreamError,
                        )
                    }
                }
            }
            ProblemKind::NoRoute => {
                const {
                    &Row {
                        listed: Listed::Never,
                        ..client(
                            S::NOT_FOUND,
                            "No route",
                            "no_route",
                            "no route matches the request's host and path",
                        )
                    }
                }
            }
            ProblemKind::InvalidPath => {
                const {
                    &Row {
                        listed: Listed::Never,
                        ..client(
                            S::BAD_REQUEST,
                            "Invalid path",
                            "invalid_path",
                            "the path has a malformed escape, an encoded slash, a parameter, or differs from a guarded route's only in letter case",
                        )
                    }
                }
            }
            ProblemKind::InvalidHost => {
                const {
                    &Row {
                        listed: Listed::Never,
                        ..client(
                            S::BAD_REQUEST,
                            "Invalid host",
                            "invalid_host",
                            "the request has no Host, more than one, one that is not a host and port, or one its :authority disagrees with",
                        )
                    }
                }
            }
            ProblemKind::InvalidMethod => {
                const {
                    &Row {
                        listed: Listed::Never,
                        ..client(
                            S::BAD_REQUEST,
                            "Invalid method",
                            "invalid_method",
                            "the method differs from a guarded one only in letter case",
                        )
                    }
                }
            }
            ProblemKind::Internal => {
                const {
                    &Row {
                        meaning: "the proxy broke its own invariant; nothing more is said to a client",
                        detail: Detail::Fixed("the proxy failed"),
                        listed: Listed::Never,
                        ..failure(
                            S::INTERNAL_SERVER_ERROR,
                            "Internal error",
                            "internal_error",
                            Fault::Proxy,
                            Outcome::InternalError,
                        )
                    }
                }
            }
        }
    }

    /// The problem's slug, the end of its `type`.
    pub(crate) fn slug(self) -> &'static str {
        self.as_str()
    }
}

/// Whose fault a problem is, as pingora's `ErrorSource` says it: it decides the level
/// the problem is logged at.
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
    /// The level a problem with this fault is logged at.
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
        /// 410: the key's response is past its retention, the key still remembered.
        Expired => "expired",
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

label_values! {
    /// What enforce mode would have done with a request a shadow-mode route forwarded
    /// (`idemproxy_shadow_decisions_total{route, would}`).
    pub(crate) enum Would {
        /// Claimed it and forwarded it.
        Forward => "forward",
        /// Replayed the recorded response.
        Replay => "replay",
        /// Replayed the recorded response of the first of two identical requests (the
        /// `body` key source).
        Deduplicate => "deduplicate",
        /// 409: in progress, or outcome unknown.
        Conflict => "conflict",
        /// 422: the key was used with another request.
        Mismatch => "mismatch",
        /// 410: the key's response is past its retention (`response-expired`).
        Expired => "expired",
        /// 400: no key on a route that requires one.
        MissingKey => "missing_key",
        /// 400: a key that is not valid.
        InvalidKey => "invalid_key",
        /// Refused the request for the guard's other reasons: a body too large or too
        /// slow to read, a scope token that does not verify.
        Rejected => "rejected",
        /// 503: at `max_guarded_requests`.
        Overloaded => "overloaded",
        /// 503: the store failed.
        StoreError => "store_error",
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

    /// The status `kind` is answered with under this profile.
    pub(crate) fn status(self, kind: ProblemKind) -> StatusCode {
        let row = kind.row();
        match self {
            Profile::Ietf => row.status,
            Profile::Stripe => row.stripe.status.unwrap_or(row.status),
        }
    }
}

/// A JSON-RPC 2.0 error response for call `id` (its raw JSON text): `-32600`
/// (invalid request) for a call the proxy cannot read, `-32000` (a server error) for
/// every other refusal, the problem's fields in `data`.
fn jsonrpc_error(id: &[u8], kind: ProblemKind, detail: &str, data: serde_json::Value) -> String {
    let code = if kind == ProblemKind::CallUnreadable {
        -32600
    } else {
        -32000
    };
    let error = serde_json::json!({ "code": code, "message": detail, "data": data });
    let id = std::str::from_utf8(id).unwrap_or("null");
    format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"error\":{error}}}")
}

pub(crate) const PROBLEM_TYPE_PREFIX: &str = "urn:idemproxy:problem:";

/// A problem's `type`: `docs_url#slug` on a route with a `docs_url`, else the URN.
pub(crate) fn problem_type(docs_url: Option<&str>, slug: &str) -> String {
    match docs_url {
        Some(docs) => format!("{docs}#{slug}"),
        None => format!("{PROBLEM_TYPE_PREFIX}{slug}"),
    }
}

/// What a 410 `response-expired` names of the operation that ran: its status, and
/// when it completed (where the store kept it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completion {
    pub(crate) status: u16,
    pub(crate) at: Option<std::time::SystemTime>,
}

/// One problem as it is about to be answered: its kind, and what this occurrence of it
/// adds (the sentence, when to retry, the operation, the route's documentation and
/// profile).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) kind: ProblemKind,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<u64>,
    /// `WWW-Authenticate`, on a 401.
    pub(crate) authenticate: Option<&'static str>,
    /// The record's operation id, on a 409 `outcome-unknown`.
    pub(crate) operation: Option<String>,
    /// On a 409 `outcome-unknown`: whether the route's probe is reconciling it.
    pub(crate) reconciling: Option<bool>,
    /// On a 409 `outcome-unknown`: why, where the record says (`unreadable`: its
    /// recorded response cannot be opened).
    pub(crate) reason: Option<&'static str>,
    /// On a 410 `response-expired`: the status the operation completed with, and when.
    pub(crate) completed: Option<Completion>,
    /// The route's `docs_url`: the problem's `type` is `docs_url#slug`, and a `Link`
    /// names it as what describes the response.
    pub(crate) docs_url: Option<std::sync::Arc<str>>,
    /// The shape the route's clients expect.
    pub(crate) profile: Profile,
    /// On a JSON-RPC route: the call's id as it was sent (`null` where it is not
    /// known). The problem is then a JSON-RPC error object, its fields in `data`.
    pub(crate) jsonrpc: Option<Bytes>,
}

impl Problem {
    pub(crate) fn row(&self) -> &'static Row {
        self.kind.row()
    }

    /// Renders the problem as its profile says: an `application/problem+json`
    /// response, or Stripe's error object.
    pub(crate) fn into_response(self) -> Response<Bytes> {
        let row = self.kind.row();
        let kind = problem_type(self.docs_url.as_deref(), self.kind.slug());
        let status = self.profile.status(self.kind);
        let mut fields = match self.profile {
            Profile::Ietf => serde_json::json!({
                "type": kind,
                "title": row.title,
                "status": status.as_u16(),
                "detail": self.detail,
            }),
            Profile::Stripe => {
                let mut error = serde_json::json!({
                    "type": row.stripe.kind,
                    "code": row.stripe.code,
                    "message": self.detail,
                });
                if self.docs_url.is_some() {
                    error["doc_url"] = serde_json::Value::String(kind);
                }
                error
            }
        };
        if let Some(operation) = &self.operation {
            fields["operation"] = serde_json::Value::String(operation.clone());
        }
        if let Some(reconciling) = self.reconciling {
            fields["reconciling"] = serde_json::Value::Bool(reconciling);
        }
        if let Some(reason) = self.reason {
            fields["reason"] = serde_json::Value::String(reason.into());
        }
        if let Some(completed) = self.completed {
            fields["completed_status"] = serde_json::Value::from(completed.status);
            if let Some(at) = completed.at {
                fields["completed_at"] = serde_json::Value::String(humantime::format_rfc3339_seconds(at).to_string());
            }
        }
        let body = match (&self.jsonrpc, self.profile) {
            (Some(id), _) => {
                fields["slug"] = serde_json::Value::String(self.kind.slug().into());
                ("application/json", jsonrpc_error(id, self.kind, &self.detail, fields))
            }
            (None, Profile::Ietf) => ("application/problem+json", fields.to_string()),
            (None, Profile::Stripe) => ("application/json", serde_json::json!({ "error": fields }).to_string()),
        };
        let (content_type, body) = body;
        let mut response = Response::new(Bytes::from(body));
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
            headers.insert(LINK, link);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row says what it is: a title, a meaning for the contract, a fixed
    /// sentence where the client does not read its own mistake, and a Stripe code; the
    /// slugs and Stripe codes are one to one.
    #[test]
    fn every_row_is_whole_and_every_slug_its_own() {
        let mut codes = std::collections::BTreeSet::new();
        for kind in ProblemKind::ALL {
            let row = kind.row();
            assert!(!row.title.is_empty(), "{kind:?}");
            assert!(!row.meaning.is_empty(), "{kind:?}");
            assert_ne!(row.detail, Detail::Fixed(""), "{kind:?}");
            assert!(codes.insert(row.stripe.code), "{kind:?}: {}", row.stripe.code);
            assert_eq!(
                row.stripe.code,
                kind.slug()
                    .replace('-', "_")
                    .replace("request_in_progress", "idempotency_key_in_use")
            );
            let client_class = (400..500).contains(&row.status.as_u16());
            assert_eq!(client_class, row.fault == Fault::Client, "{kind:?}");
        }
        assert_eq!(ProblemKind::ALL.len(), 25);
    }

    #[test]
    fn stripe_answers_key_reuse_with_400_and_the_idempotency_problems_as_its_idempotency_error() {
        assert_eq!(Profile::Stripe.status(ProblemKind::KeyReused), StatusCode::BAD_REQUEST);
        assert_eq!(
            Profile::Ietf.status(ProblemKind::KeyReused),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        for kind in ProblemKind::ALL {
            let idempotency = matches!(
                kind,
                ProblemKind::KeyReused
                    | ProblemKind::InProgress
                    | ProblemKind::OutcomeUnknown
                    | ProblemKind::ResponseExpired
            );
            let expected = match (idempotency, kind.row().fault) {
                (true, _) => IDEMPOTENCY_ERROR,
                (false, Fault::Client) => INVALID_REQUEST,
                (false, _) => API_ERROR,
            };
            assert_eq!(kind.row().stripe.kind, expected, "{kind:?}");
            if kind != ProblemKind::KeyReused {
                assert_eq!(Profile::Stripe.status(kind), Profile::Ietf.status(kind), "{kind:?}");
            }
        }
    }
}
