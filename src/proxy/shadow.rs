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
use tracing::{Instrument, Span};

use super::{Prepared, Proxy};
use crate::body::{self, ClientInfo, Peeked, ProxyBody, StreamedBody, full, streamed};
use crate::config::IdempotencyPolicy;
use crate::error::{KeyError, Rejection};
use crate::idempotency::{self, Decision};
use crate::metrics::Would;
use crate::router::RouteState;

impl Proxy {
    /// A request on a shadow-mode route: named, read, claimed and decided as in
    /// enforce mode, and forwarded whatever the decision. Only a claimed request is
    /// recorded; the others leave the record as it is.
    pub(super) async fn shadow(
        &self,
        route: Arc<RouteState>,
        policy: Arc<IdempotencyPolicy>,
        request: Request<Incoming>,
        client: ClientInfo,
    ) -> http::Response<ProxyBody> {
        let record = match self.identify(&route, &policy, request.headers()) {
            Ok(record) => record,
            Err(rejection) => {
                return self
                    .unguarded(&route, would(&rejection), streamed(request), &client)
                    .await;
            }
        };
        let span = tracing::info_span!("shadow", route = %route.route.name, record = %record.short_hash());
        let hash = self.record_note(&record);
        let Some(permit) = self.shared.guarded.try_enter() else {
            return self
                .unguarded(&route, Would::Overloaded, streamed(request), &client)
                .await;
        };
        let response = async move {
            let (parts, body) = request.into_parts();
            let (max, timeout) = (route.body.max_bytes, route.body.timeout);
            let body = match body::peek_request_body(body, &parts.headers, max, timeout).await {
                Ok(Peeked::Whole(body)) => body,
                Ok(Peeked::Partial { head, rest, .. }) => {
                    drop(permit);
                    let timeout = route.route.upstream_timeout;
                    let body = StreamedBody::new(Some(head), rest, Instant::now() + timeout, timeout);
                    let request = Request::from_parts(parts, body.boxed_unsync());
                    return self.unguarded(&route, Would::Rejected, request, &client).await;
                }
                Err(rejection) => return self.reject(Some(&route), rejection),
            };
            let prepared = match Prepared::new(parts, body, &route, &policy, record) {
                Ok(prepared) => prepared,
                Err(rejection) => return self.reject(Some(&route), rejection),
            };
            let outcome = match self.shared.ledger.claim(&prepared.claim, &Span::current()).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    tracing::warn!(%error, "store unavailable; forwarding (shadow mode)");
                    drop(permit);
                    let request = Request::from_parts(prepared.parts, full(prepared.body));
                    return self.unguarded(&route, Would::StoreError, request, &client).await;
                }
            };
            let would = match idempotency::decide(outcome, prepared.fingerprint) {
                Decision::Forward(claim) => {
                    route.metrics.shadow(Would::Forward);
                    return self.forward(route, policy, claim, prepared, &client, permit).await;
                }
                Decision::Replay(_) => Would::Replay,
                Decision::Reject(rejection) => would(&rejection),
            };
            drop(permit);
            let request = Request::from_parts(prepared.parts, full(prepared.body));
            self.unguarded(&route, would, request, &client).await
        }
        .instrument(span)
        .await;
        self.noted_record(response, hash)
    }

    /// Counts what enforce mode `would` have done, and forwards the request unguarded.
    async fn unguarded(
        &self,
        route: &RouteState,
        would: Would,
        request: Request<ProxyBody>,
        client: &ClientInfo,
    ) -> http::Response<ProxyBody> {
        route.metrics.shadow(would);
        self.pass(route, request, client).await
    }
}

/// What enforce mode does with a request it refuses, as a shadow decision.
fn would(rejection: &Rejection) -> Would {
    match rejection {
        Rejection::Key(KeyError::Missing) => Would::MissingKey,
        Rejection::Key(_) => Would::InvalidKey,
        Rejection::KeyReused => Would::Mismatch,
        Rejection::InProgress { .. } | Rejection::OutcomeUnknown => Would::Conflict,
        Rejection::Overloaded(_) => Would::Overloaded,
        Rejection::Store(_) => Would::StoreError,
        Rejection::NoRoute
        | Rejection::BodyTooLarge(_)
        | Rejection::BodyTimeout(_)
        | Rejection::BodyIncomplete(_)
        | Rejection::UnverifiedScope(_)
        | Rejection::Upstream(_)
        | Rejection::Internal(_) => Would::Rejected,
    }
}
