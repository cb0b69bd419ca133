//! The exchange of a claimed request: sent from a task of its own (so a client that
//! goes away changes nothing), timed, and its claim resolved by what came back:
//! completed with the response, released, or marked unknown.

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Duration;
use tracing::Instrument;

use super::claim::OwnedClaim;
use super::{Answer, Ended, Guarded, Prepared, Proxy, Refusal};
use crate::body::{self, Buffered, ProxyBody, StreamedBody, full};
use crate::config::{IdempotencyPolicy, Mode, UpstreamKey};
use crate::error::{ProxyError, Rejection, UpstreamError};
use crate::idempotency::{self, Recording};
use crate::router::RouteState;
use crate::store::{StoreKey, StoredResponse, UnknownReason};
use crate::trace;
use crate::upstream::{self, Clock};

/// Sends `request` on `route`'s upstream within its timeout, and times the response
/// head in the route's metrics. `traced`: in a span of its own, which the upstream
/// gets as its parent.
pub(super) async fn send(
    route: &RouteState,
    request: Request<ProxyBody>,
    traced: bool,
) -> (Result<Response<Incoming>, UpstreamError>, Clock, Duration) {
    let clock = Clock::start(route.route.upstream_timeout);
    let sent = upstream_traced(&route.client, request, &clock, traced).await;
    let elapsed = clock.started.elapsed();
    route.metrics.upstream(elapsed);
    (sent, clock, elapsed)
}

/// `upstream::send`, in an `upstream` span when `traced`: its trace context replaces
/// the client's in `request`, and it records the status, or the kind of failure.
pub(super) async fn upstream_traced(
    client: &upstream::HttpClient,
    mut request: Request<ProxyBody>,
    clock: &Clock,
    traced: bool,
) -> Result<Response<Incoming>, UpstreamError> {
    if !traced {
        return upstream::send(client, request, clock).await;
    }
    let authority = request.uri().authority().map_or("", |authority| authority.as_str());
    let span = trace::upstream(request.method(), authority);
    trace::inject(&span, request.headers_mut());
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

impl Proxy {
    /// Sends the claimed request from a task of its own, and returns its response once
    /// the record is updated, so that a retry that follows it sees the record.
    pub(super) async fn forward(&self, guarded: Guarded, claim: OwnedClaim, prepared: Prepared) -> Ended {
        let mut request = prepared.into_request();
        let rewritten = upstream_key(request.headers_mut(), &guarded.policy, &guarded.record).and_then(|()| {
            upstream::prepare_request(&mut request, &guarded.route.route.upstream, &guarded.client)
                .map_err(|error| ProxyError::Rewrite(error).into())
        });
        if let Err(rejection) = rewritten {
            claim.release_in_background();
            return Err(rejection.into());
        }
        let (sender, receiver) = oneshot::channel();
        let proxy = self.clone();
        let mut guarded = guarded;
        let exchange = async move {
            let ended = proxy.exchange(&mut guarded, claim, request).await;
            // The bodies are recorded or handed on: the request no longer counts.
            drop(guarded);
            // The client may have gone: the record is already updated.
            let _ = sender.send(ended);
        };
        // Boxed once here: the exchange's state is kilobytes, which spawning would
        // otherwise copy through each wrapper into the task.
        self.shared.tasks.spawn(Box::pin(exchange).in_current_span());
        receiver.await.unwrap_or_else(|_| Err(ProxyError::ExchangeLost.into()))
    }

    /// Runs in its own task: forwards the claimed request, then resolves the claim by
    /// what came back.
    async fn exchange(&self, guarded: &mut Guarded, mut claim: OwnedClaim, request: Request<ProxyBody>) -> Ended {
        claim.forwarding();
        let (sent, clock, elapsed) = send(&guarded.route, request, self.shared.traced).await;
        let failed = |rejection: Rejection| Refusal {
            rejection,
            upstream: Some(elapsed),
            operation: None,
        };
        let schedule = guarded.route.route.reconcile().map(super::reconcile::schedule);
        let response = match sent {
            Ok(response) => response,
            Err(error) => {
                if claim.upstream_failed(&error, schedule).await {
                    self.reconcile_later(guarded);
                }
                return Err(failed(error.into()));
            }
        };
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        let policy = guarded.policy.clone();
        let recording = idempotency::recording_for(parts.status, policy.on_server_error);
        let limit = policy.max_response_body_bytes;
        let share = &mut guarded.share;
        let buffered = body::buffer_response(body, limit, clock.deadline, clock.timeout, |bytes| {
            share.take_for_response(bytes)
        });
        let body = match buffered.await {
            Err(error) => {
                if claim.upstream_failed(&error, schedule).await {
                    self.reconcile_later(guarded);
                }
                return Err(failed(error.into()));
            }
            Ok(Buffered::Whole(body)) => {
                match recording {
                    Recording::Record => {
                        let stored = StoredResponse::from_parts(&parts, body.clone(), &policy.replay_exclude_headers)
                            .traced(guarded.execution);
                        claim.complete(stored).await;
                    }
                    Recording::Release => claim.release().await,
                }
                full(body)
            }
            Ok(Buffered::Cut {
                head,
                rest,
                over_budget,
            }) => {
                match recording {
                    Recording::Record if over_budget => {
                        tracing::warn!(
                            "no budget left to buffer the response for recording; the key's outcome is now unknown"
                        );
                        if claim.mark_unknown(UnknownReason::OverBudget, schedule).await {
                            self.reconcile_later(guarded);
                        }
                    }
                    Recording::Record => {
                        tracing::warn!(limit, "response too large to record; the key's outcome is now unknown");
                        if claim.mark_unknown(UnknownReason::ResponseTooLarge, schedule).await {
                            self.reconcile_later(guarded);
                        }
                    }
                    Recording::Release => claim.release().await,
                }
                StreamedBody::new(Some(head), rest, clock.deadline, clock.timeout).boxed_unsync()
            }
        };
        Ok(Answer::forwarded(Response::from_parts(parts, body), elapsed))
    }
}

/// Puts the key the upstream is to see in a claimed request's `headers`, as the
/// route's `upstream_key` says: the client's own (moved to `upstream_key_header` when
/// that is another field), the record's operation id, or none. Whatever the client
/// sent in `upstream_key_header` itself is replaced, so a client cannot choose the
/// derived key. Every request enforce mode forwards (claimed, or unguarded with
/// `on_store_error = "forward"`) carries it, so that an upstream that deduplicates on
/// it sees one key per operation; shadow mode sends every request as an unguarded
/// route would, the client's key included.
pub(super) fn upstream_key(
    headers: &mut http::HeaderMap,
    policy: &IdempotencyPolicy,
    record: &StoreKey,
) -> Result<(), Rejection> {
    // Shadow mode forwards its retries unguarded, with the client's key: its first
    // request, claimed to be recorded, carries the same one.
    if policy.mode == Mode::Shadow {
        return Ok(());
    }
    let target = &policy.upstream_key_header;
    match policy.upstream_key {
        UpstreamKey::Client if *target == policy.header => {}
        UpstreamKey::Client => match headers.remove(&policy.header) {
            Some(key) => {
                headers.insert(target.clone(), key);
            }
            None => {
                headers.remove(target);
            }
        },
        UpstreamKey::Derived => {
            let id = http::HeaderValue::try_from(record.operation_id())
                .map_err(|error| ProxyError::Rewrite(error.into()))?;
            headers.remove(&policy.header);
            headers.insert(target.clone(), id);
        }
        UpstreamKey::None => {
            headers.remove(&policy.header);
            headers.remove(target);
        }
    }
    Ok(())
}
