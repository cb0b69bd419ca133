//! One request to a route's upstream, as the proxy sends every one (a claimed request,
//! a pass-through, a probe): within its timeout, in an `upstream` span whose trace
//! context the upstream gets as its parent, recording its status or its failure.

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Duration;
use tracing::Instrument;

use crate::body::ProxyBody;
use crate::error::UpstreamError;
use crate::router::RouteState;
use crate::trace::Spans;
use crate::upstream::{self, Clock, HttpClient};

/// Sends `request` on `route`'s upstream within its timeout, and times the response
/// head in the route's metrics.
pub(super) async fn send(
    route: &RouteState,
    request: Request<ProxyBody>,
    spans: Spans,
) -> (Result<Response<Incoming>, UpstreamError>, Clock, Duration) {
    let clock = Clock::start(route.config.upstream_timeout);
    let sent = send_within(&route.client, request, &clock, spans).await;
    let elapsed = clock.started.elapsed();
    route.metrics.upstream(elapsed);
    (sent, clock, elapsed)
}

/// `upstream::send` in an `upstream` span: its trace context replaces the client's in
/// `request`, and it records the status, or the kind of failure.
pub(super) async fn send_within(
    client: &HttpClient,
    mut request: Request<ProxyBody>,
    clock: &Clock,
    spans: Spans,
) -> Result<Response<Incoming>, UpstreamError> {
    let authority = request.uri().authority().map_or("", |authority| authority.as_str());
    let span = spans.upstream(request.method(), authority);
    spans.inject(&span, request.headers_mut());
    let sent = upstream::send(client, request, clock).instrument(span.clone()).await;
    match &sent {
        Ok(response) => {
            span.record("http.response.status_code", response.status().as_u16());
        }
        Err(error) => {
            span.record("error.type", error.kind());
        }
    }
    sent
}
