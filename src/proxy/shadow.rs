//! Shadow mode (`mode = "shadow"`): a guarded route that forwards every request as an
//! unguarded route would (no 400, 409, 413, 422 or replay for the guard's reasons),
//! while claims and records are written as in enforce mode and
//! `idemproxy_shadow_decisions_total{route, would}` counts what enforce would have
//! done. A team turns it on in front of a legacy API, reads the numbers, then
//! enforces. It never adds a failure: a store that fails is counted and the request
//! forwarded.

use std::sync::Arc;

use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::context::Read;
use super::{Arrival, Handled, Named, Prepared, Proxy};
use crate::body::{self, ClientInfo, Peeked, ProxyBody, StreamedBody, streamed};
use crate::config::IdempotencyPolicy;
use crate::error::Rejection;
use crate::idempotency::Decision;
use crate::problem::Would;
use crate::record::ExecutionTrace;
use crate::router::RouteState;

impl Proxy {
    /// A request on a shadow-mode route: named, read, claimed and decided as in
    /// enforce mode, and forwarded whatever the decision. Only a claimed request is
    /// recorded; the others leave the record as it is.
    pub(super) async fn shadow(
        &self,
        route: &Arc<RouteState>,
        policy: &Arc<IdempotencyPolicy>,
        identified: Result<Named, Rejection>,
        arrival: Arrival,
        client: ClientInfo,
        execution: Option<ExecutionTrace>,
    ) -> Handled {
        let named = match identified {
            Ok(named) => named,
            Err(rejection) => {
                return self
                    .unguarded(route, would(&rejection), arrival.into_request(), &client)
                    .await;
            }
        };
        let read = match arrival {
            Arrival::Read(read) => read,
            Arrival::Unread(request) => match self.shadow_read_first(route, request, &client).await {
                Ok(read) => read,
                Err(handled) => return handled,
            },
        };
        let guarded = self.enter(route, policy, &client, named, execution, read.share);
        let prepared = Prepared::new(&guarded, read.parts, read.body)?;
        let would = match self.claimed(&prepared).await {
            Ok(Decision::Forward(claim)) => {
                route.metrics.shadow(Would::Forward);
                return self.forward(guarded, claim, prepared).await;
            }
            Ok(Decision::Replay(_)) if guarded.by_body.is_some() => Would::Deduplicate,
            Ok(Decision::Replay(_)) => Would::Replay,
            Ok(Decision::Reject(rejection)) => would(&rejection),
            Ok(Decision::Unknown(..)) => Would::Conflict,
            Err(error) => {
                tracing::warn!(%error, "store unavailable; forwarding (shadow mode)");
                Would::StoreError
            }
        };
        drop(guarded);
        self.unguarded(route, would, prepared.into_request(), &client).await
    }

    /// `read_first` in shadow mode, where nothing the guard refuses is refused: a
    /// request past the bounds, or whose body is past its limits, goes on unguarded
    /// (the body read so far, then the rest as it streams).
    pub(super) async fn shadow_read_first(
        &self,
        route: &RouteState,
        request: Request<Incoming>,
        client: &ClientInfo,
    ) -> Result<Read, Handled> {
        let mut share = match self.shared.guarded.try_enter() {
            Ok(share) => share,
            Err(rejection) => {
                return Err(self
                    .unguarded(route, would(&rejection), streamed(request), client)
                    .await);
            }
        };
        let (parts, body) = request.into_parts();
        let peeked = body::peek_request_body(body, &parts.headers, route.body, Some(&client.allowance), |bytes| {
            share.take_for_request(bytes)
        });
        match peeked.await {
            Err(rejection) => {
                // The body could not be read (the client broke it or stalled, or the
                // budget could not hold it): answered as enforce mode answers it.
                let refused: Handled = Err(rejection.into());
                Err(refused)
            }
            Ok(Peeked::Whole(body)) => Ok(Read { parts, body, share }),
            Ok(Peeked::Partial { head, rest, .. }) => {
                drop(share);
                Err(self.unguarded_partial(route, parts, head, rest, client).await)
            }
        }
    }

    /// Forwards unguarded a request whose body was cut at a limit: what was read, then
    /// the rest as it streams.
    async fn unguarded_partial(
        &self,
        route: &RouteState,
        parts: http::request::Parts,
        head: Vec<bytes::Bytes>,
        rest: Incoming,
        client: &ClientInfo,
    ) -> Handled {
        let timeout = route.config.upstream_timeout;
        let body = StreamedBody::new(head, rest, Instant::now() + timeout, timeout);
        let request = Request::from_parts(parts, body.boxed_unsync());
        self.unguarded(route, Would::Rejected, request, client).await
    }

    /// Counts what enforce mode `would` have done, and forwards the request unguarded.
    async fn unguarded(
        &self,
        route: &RouteState,
        would: Would,
        request: Request<ProxyBody>,
        client: &ClientInfo,
    ) -> Handled {
        route.metrics.shadow(would);
        self.pass(route, request, client).await
    }
}

/// What enforce mode does with a request it refuses, as a shadow decision: its kind's.
fn would(rejection: &Rejection) -> Would {
    rejection.kind().row().would
}
