//! One error enum per boundary, each saying whose fault it is, and the one exhaustive
//! function that turns a rejection into an RFC 9457 problem response. No internal error
//! text ever reaches a response body: details go to the log.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

/// Any error, boxed, where the cause only goes to the log.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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

/// The client sent an unusable idempotency key: the client's fault.
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

/// The store did not answer as it should: the store's fault.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the store is unreachable")]
    Unavailable(#[source] redis::RedisError),
    #[error("the memory store holds its maximum of {0} live records")]
    Full(usize),
    #[error("the store returned an unexpected reply: {0}")]
    Protocol(&'static str),
}

/// The upstream failed the exchange: the upstream's fault.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Nothing was sent: the connection could not be made.
    #[error("cannot connect to the upstream")]
    Unavailable(#[source] hyper_util::client::legacy::Error),
    /// The request may have been sent, and no full response came within the timeout.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The request may have been sent, and the exchange broke.
    #[error("the upstream exchange failed")]
    Failed(#[source] BoxError),
}

impl UpstreamError {
    /// True when the upstream cannot have seen the request.
    pub fn nothing_sent(&self) -> bool {
        matches!(self, UpstreamError::Unavailable(_))
    }
}

/// Everything the proxy answers itself instead of forwarding.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    #[error("no route matches the request")]
    NoRoute,
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
    #[error("the first request with this key is still in flight")]
    InProgress { retry_after: Duration },
    #[error("the outcome of the first request with this key is unknown")]
    OutcomeUnknown,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The proxy broke its own invariant: its fault, never the client's.
    #[error("the proxy failed")]
    Internal(#[source] BoxError),
}

/// What a problem response says, before it is rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: StatusCode,
    pub slug: &'static str,
    pub title: &'static str,
    pub detail: String,
    pub retry_after: Option<u64>,
}

pub const PROBLEM_TYPE_PREFIX: &str = "urn:idemproxy:problem:";

impl Rejection {
    /// The one mapping from a rejection to its status code and problem slug.
    pub fn problem(&self) -> Problem {
        let (status, slug, title, retry_after) = match self {
            Rejection::NoRoute => (StatusCode::NOT_FOUND, "no-route", "No route", None),
            Rejection::Key(KeyError::Missing) => (
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Missing idempotency key",
                None,
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
                None,
            ),
            Rejection::BodyTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-body-too-large",
                "Request body too large",
                None,
            ),
            Rejection::BodyTimeout(_) => (
                StatusCode::REQUEST_TIMEOUT,
                "request-body-timeout",
                "Request body too slow",
                None,
            ),
            Rejection::BodyIncomplete(_) => (
                StatusCode::BAD_REQUEST,
                "request-body-incomplete",
                "Request body incomplete",
                None,
            ),
            Rejection::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency key reused",
                None,
            ),
            Rejection::InProgress { retry_after } => (
                StatusCode::CONFLICT,
                "request-in-progress",
                "Request in progress",
                Some(retry_after.as_secs().max(1)),
            ),
            Rejection::OutcomeUnknown => (StatusCode::CONFLICT, "outcome-unknown", "Outcome unknown", None),
            Rejection::Store(StoreError::Full(_)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-full",
                "Idempotency store full",
                Some(1),
            ),
            Rejection::Store(StoreError::Timeout(_) | StoreError::Unavailable(_) | StoreError::Protocol(_)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Idempotency store unavailable",
                Some(1),
            ),
            Rejection::Upstream(UpstreamError::Unavailable(_)) => (
                StatusCode::BAD_GATEWAY,
                "upstream-unavailable",
                "Upstream unavailable",
                None,
            ),
            Rejection::Upstream(UpstreamError::Timeout(_)) => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream-timeout",
                "Upstream timeout",
                None,
            ),
            Rejection::Upstream(UpstreamError::Failed(_)) => {
                (StatusCode::BAD_GATEWAY, "upstream-failed", "Upstream failed", None)
            }
            Rejection::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal-error",
                "Internal error",
                None,
            ),
        };
        Problem {
            status,
            slug,
            title,
            detail: self.public_detail(),
            retry_after,
        }
    }

    /// The sentence a client may read: the error's own text, never its sources.
    fn public_detail(&self) -> String {
        match self {
            Rejection::Store(StoreError::Unavailable(_)) | Rejection::Store(StoreError::Protocol(_)) => {
                "the idempotency store is unreachable; nothing was forwarded".into()
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
            other => other.to_string(),
        }
    }
}

impl Problem {
    /// Renders the problem as an `application/problem+json` response.
    pub fn into_response(self) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": format!("{PROBLEM_TYPE_PREFIX}{}", self.slug),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(seconds) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
