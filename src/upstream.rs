//! The upstream side: one pooled keep-alive client (HTTPS through rustls with ring and
//! webpki roots), the header rules for both directions, and the bounded exchange.
//! It never decides what to record: it reports what happened, and who was at fault.

use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::{Instant, Sleep};

pub use crate::error::BoxError;
use crate::error::UpstreamError;

/// The body type of everything the proxy sends, both ways.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub type HttpClient = Client<HttpsConnector<HttpConnector>, ProxyBody>;

/// Builds the one upstream client the proxy shares.
pub fn client() -> HttpClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
        .expect("ring supports the default TLS versions")
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(1024)
        .build(https)
}

// === header rules ===

/// RFC 9110 §7.6.1 connection-specific fields, plus `Proxy-Connection`.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes the hop-by-hop fields and every field named in `Connection`. A message
/// that came with `Transfer-Encoding` also loses any `Content-Length`, which the
/// transfer coding overrode (RFC 9112 §6.3): passing it on would give the next hop a
/// framing the body does not have.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names finds out without hashing.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    // `keep-alive` is removed below anyway, and `close` names no field: only other
    // tokens need collecting (and this allocates nothing when there are none).
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .filter(|token| !token.eq_ignore_ascii_case("keep-alive") && !token.eq_ignore_ascii_case("close"))
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect();
    for name in listed.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// What the proxy knows about the client side of a connection, worked out once per
/// connection rather than once per request.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub addr: IpAddr,
    /// `addr` as a header value, for `X-Forwarded-For`.
    forwarded_for: HeaderValue,
}

impl ClientInfo {
    pub fn new(addr: IpAddr) -> ClientInfo {
        let forwarded_for = HeaderValue::from_str(&addr.to_string()).expect("an IP address is a valid header value");
        ClientInfo { addr, forwarded_for }
    }
}

/// Where a route sends its requests, parsed once from its validated upstream URL.
#[derive(Debug, Clone)]
pub struct Target {
    scheme: Scheme,
    authority: Authority,
    /// The URL's path without its trailing `/`, when it has one to prefix.
    base_path: Option<String>,
    host: HeaderValue,
}

impl Target {
    /// `None` for a URL without a host, which config validation never lets through.
    pub fn new(upstream: &Uri) -> Option<Target> {
        let authority = upstream.authority()?.clone();
        let base = upstream.path().trim_end_matches('/');
        Some(Target {
            scheme: upstream.scheme().cloned().unwrap_or(Scheme::HTTP),
            host: HeaderValue::from_str(authority.as_str()).ok()?,
            authority,
            base_path: (!base.is_empty()).then(|| base.to_string()),
        })
    }
}

/// Rewrites a client request for the upstream: the URI, `Host`, the hop-by-hop
/// fields, and the `X-Forwarded-*` fields.
pub fn prepare_request<B>(request: &mut Request<B>, target: &Target, client: &ClientInfo) -> Result<(), http::Error> {
    let original_host = match request.headers().get(header::HOST) {
        Some(host) => Some(host.clone()),
        None => request
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
    };
    let path_and_query = match (&target.base_path, request.uri().path_and_query()) {
        (None, Some(path_and_query)) => path_and_query.clone(),
        (None, None) => PathAndQuery::from_static("/"),
        (Some(base), path_and_query) => {
            format!("{base}{}", path_and_query.map_or("/", PathAndQuery::as_str)).parse()?
        }
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(target.scheme.clone());
    parts.authority = Some(target.authority.clone());
    parts.path_and_query = Some(path_and_query);
    *request.uri_mut() = Uri::from_parts(parts)?;
    *request.version_mut() = Version::HTTP_11;

    let headers = request.headers_mut();
    strip_hop_by_hop(headers);
    headers.insert(header::HOST, target.host.clone());
    let forwarded_for = match headers.get(&X_FORWARDED_FOR).map(HeaderValue::as_bytes) {
        Some(previous) => {
            let mut joined = Vec::with_capacity(previous.len() + 2 + client.forwarded_for.len());
            joined.extend_from_slice(previous);
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(client.forwarded_for.as_bytes());
            HeaderValue::from_bytes(&joined)?
        }
        None => client.forwarded_for.clone(),
    };
    headers.insert(X_FORWARDED_FOR, forwarded_for);
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    match original_host {
        Some(host) => headers.insert(X_FORWARDED_HOST, host),
        None => headers.remove(X_FORWARDED_HOST),
    };
    Ok(())
}

// === exchanges ===

/// Sends `request` and waits for the response head, within `deadline`.
pub async fn send(
    client: &HttpClient,
    request: Request<ProxyBody>,
    deadline: Instant,
) -> Result<Response<Incoming>, UpstreamError> {
    let timeout = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout_at(deadline, client.request(request)).await {
        Err(_) => Err(UpstreamError::Timeout(timeout)),
        Ok(Err(error)) if error.is_connect() => Err(UpstreamError::Unavailable(error)),
        Ok(Err(error)) => Err(UpstreamError::Failed(error.into())),
        Ok(Ok(response)) => Ok(response),
    }
}

/// A response body read as far as the proxy may record it.
pub enum Buffered {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// The limit was passed: what was read so far, and the rest, still to stream.
    TooLarge { head: Bytes, rest: Incoming },
}

/// Reads `body` until it ends or passes `limit` bytes, within `deadline`.
pub async fn buffer(
    mut body: Incoming,
    limit: u64,
    deadline: Instant,
    timeout: Duration,
) -> Result<Buffered, UpstreamError> {
    let read = async {
        let mut collected = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| UpstreamError::Failed(error.into()))?;
            if let Ok(data) = frame.into_data() {
                collected.extend_from_slice(&data);
                if collected.len() as u64 > limit {
                    return Ok((collected.freeze(), false));
                }
            }
        }
        Ok::<_, UpstreamError>((collected.freeze(), true))
    };
    // `read` borrows `body`; the borrow ends with this statement.
    let outcome = tokio::time::timeout_at(deadline, read).await;
    match outcome {
        Err(_) => Err(UpstreamError::Timeout(timeout)),
        Ok(Err(error)) => Err(error),
        Ok(Ok((whole, true))) => Ok(Buffered::Whole(whole)),
        Ok(Ok((head, false))) => Ok(Buffered::TooLarge { head, rest: body }),
    }
}

/// A streamed response body: an optional head already read, then the rest, cut off
/// with an error if `deadline` passes first.
pub struct StreamedBody {
    head: Option<Bytes>,
    rest: Incoming,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
}

impl StreamedBody {
    pub fn new(head: Option<Bytes>, rest: Incoming, deadline: Instant, timeout: Duration) -> StreamedBody {
        StreamedBody {
            head,
            rest,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            timeout,
        }
    }
}

impl Body for StreamedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.rest).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| frame.map_err(BoxError::from)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(UpstreamError::Timeout(self.timeout).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let head = self.head.as_ref().map_or(0, |head| head.len() as u64);
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint.set_lower(rest.lower() + head);
        hint
    }
}
