//! The upstream side: each worker's pool of keep-alive HTTP/1.1 connections (`pool`;
//! HTTPS through rustls with ring and the webpki roots, or a route's own CAs), where a
//! route sends its requests, the header rules for both directions, and the bounded
//! exchange. It never decides what to record: it reports
//! what happened, and who was at fault.

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, Version};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::body::{ClientInfo, ProxyBody};
use crate::config::Upstream;
use crate::error::UpstreamError;

mod pool;

pub(crate) use self::pool::HttpClient;
pub(crate) use self::pool::SendError;

/// Builds an upstream client: HTTPS verified against the webpki roots, or with `tls`
/// (a route's extra roots) when given. Each worker has its own.
pub(crate) fn client(tls: Option<Arc<rustls::ClientConfig>>) -> Result<HttpClient, rustls::Error> {
    let mut config = match tls {
        Some(tls) => rustls::ClientConfig::clone(&tls),
        None => {
            let roots = rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            };
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots)
                .with_no_client_auth()
        }
    };
    // The pool speaks HTTP/1.1 to upstreams.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(HttpClient::new(Arc::new(config)))
}

// === header rules ===

/// RFC 9110 §7.6.1 connection-specific fields, plus `Proxy-Connection`. A `static`:
/// a `const` array would be built (and dropped) at every use.
static HOP_BY_HOP: [HeaderName; 7] = [
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

/// Whether `name` frames a message or names a hop (`Content-Length` and the
/// hop-by-hop fields): what a recorded response never holds, since every replay is
/// framed anew.
pub(crate) fn is_framing_or_hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONTENT_LENGTH || HOP_BY_HOP.contains(name)
}

/// Removes the hop-by-hop fields and every field named in `Connection`. A message
/// that came with `Transfer-Encoding` also loses any `Content-Length`, which the
/// transfer coding overrode (RFC 9112 §6.3): passing it on would give the next hop a
/// framing the body does not have.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds which of them are present, without hashing: most
    // messages carry none, and most of the rest only `Connection`.
    let mut present = 0u8;
    for name in headers.keys() {
        if let Some(index) = HOP_BY_HOP.iter().position(|hop| hop == name) {
            present |= 1 << index;
        }
    }
    if present == 0 {
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
    for name in &listed {
        headers.remove(name);
    }
    for (index, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << index) != 0 {
            headers.remove(name);
        }
    }
}

/// Rewrites a client request for the upstream: the URI, `Host`, the hop-by-hop
/// fields, and the `X-Forwarded-*` fields.
pub(crate) fn prepare_request<B>(
    request: &mut Request<B>,
    target: &Upstream,
    client: &ClientInfo,
) -> Result<(), http::Error> {
    let original_host = match request.headers().get(header::HOST) {
        Some(host) => Some(host.clone()),
        None => request
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
    };
    let path_and_query = match (target.base_path(), request.uri().path_and_query()) {
        (None, Some(path_and_query)) => path_and_query.clone(),
        (None, None) => PathAndQuery::from_static("/"),
        (Some(base), path_and_query) => {
            format!("{base}{}", path_and_query.map_or("/", PathAndQuery::as_str)).parse()?
        }
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(target.scheme().clone());
    parts.authority = Some(target.authority().clone());
    parts.path_and_query = Some(path_and_query);
    *request.uri_mut() = Uri::from_parts(parts)?;
    *request.version_mut() = Version::HTTP_11;

    let headers = request.headers_mut();
    strip_hop_by_hop(headers);
    headers.insert(header::HOST, target.host().clone());
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
    headers.insert(X_FORWARDED_PROTO, client.proto.clone());
    match original_host {
        Some(host) => headers.insert(X_FORWARDED_HOST, host),
        None => headers.remove(X_FORWARDED_HOST),
    };
    Ok(())
}

// === exchanges ===

/// One exchange's clock: when it began, and the deadline its route's
/// `upstream_timeout` sets for all of it, the response body included.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    /// What the deadline stands for, for the error when it passes.
    pub(crate) timeout: Duration,
}

impl Clock {
    pub(crate) fn start(timeout: Duration) -> Clock {
        let started = Instant::now();
        Clock {
            started,
            deadline: started + timeout,
            timeout,
        }
    }
}

/// Sends `request` and waits for the response head, within `clock`'s deadline.
pub(crate) async fn send(
    client: &HttpClient,
    request: Request<ProxyBody>,
    clock: &Clock,
) -> Result<Response<Incoming>, UpstreamError> {
    match tokio::time::timeout_at(clock.deadline, client.request(request)).await {
        Err(_) => Err(UpstreamError::Timeout(clock.timeout)),
        Ok(Err(SendError::Connect(error))) => Err(UpstreamError::Unavailable(error)),
        Ok(Err(SendError::Failed(error))) => Err(UpstreamError::Failed(error)),
        Ok(Ok(response)) => Ok(response),
    }
}
