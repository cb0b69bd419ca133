//! The exchange of a claimed request: sent from a task of its own (so a client that
//! goes away changes nothing), timed, and its claim resolved by what came back:
//! completed with the response, released, or (`unknown_outcome`, in `reconcile`) marked
//! unknown and handed to the probe.

use std::time::SystemTime;

use bytes::Bytes;
use http::{Request, Response, StatusCode, response};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::claim::OwnedClaim;
use super::send::send;
use super::{Answer, Guarded, Handled, Prepared, Proxy, Refusal};
use crate::body::{self, Buffered, ProxyBody, StreamedBody, full};
use crate::config::{IdempotencyPolicy, Mode, ReplayKind, StreamMode, UpstreamKey};
use crate::error::{ProxyError, Rejection, UpstreamError};
use crate::idempotency::{self, IdempotencyKey, Recording};
use crate::record::{IDEMPOTENCY_EXPIRES, http_date};
use crate::store::{StoreKey, StoredResponse, UnknownReason};
use crate::{stream, upstream};

impl Proxy {
    /// Sends the claimed request from a task of its own, and returns its response once
    /// the record is updated, so that a retry that follows it sees the record; a
    /// streamed response as soon as its head comes, its record updated before its body
    /// ends.
    pub(super) async fn forward(&self, guarded: Guarded, claim: OwnedClaim, prepared: Prepared) -> Handled {
        let mut request = prepared.into_request();
        let rewritten = upstream::prepare_request(&mut request, &guarded.route.config.upstream, &guarded.client)
            .map_err(|error| Rejection::from(ProxyError::Rewrite(error)))
            .and_then(|()| upstream_key(request.headers_mut(), &guarded.policy, &guarded.record, &guarded.key));
        if let Err(rejection) = rewritten {
            claim.release_in_background();
            return Err(rejection.into());
        }
        let (sender, receiver) = oneshot::channel();
        let proxy = self.clone();
        let mut guarded = guarded;
        let exchange = async move {
            proxy.exchange(&mut guarded, claim, request, sender).await;
            // The bodies are recorded or handed on: the request no longer counts.
            drop(guarded);
        };
        // Boxed once here: the exchange's state is kilobytes, which spawning would
        // otherwise copy through each wrapper into the task.
        self.shared.tasks.spawn(Box::pin(exchange).in_current_span());
        receiver.await.unwrap_or_else(|_| Err(ProxyError::ExchangeLost.into()))
    }

    /// Runs in its own task: forwards the claimed request, answers on `answer` (the
    /// client may have gone), and resolves the claim by what came back.
    async fn exchange(
        &self,
        guarded: &mut Guarded,
        mut claim: OwnedClaim,
        request: Request<ProxyBody>,
        answer: oneshot::Sender<Handled>,
    ) {
        claim.forwarding();
        let (sent, clock, elapsed) = send(&guarded.route, request, self.shared.spans).await;
        let failed = |rejection: Rejection| Refusal {
            rejection,
            upstream: Some(elapsed),
            operation: None,
        };
        let response = match sent {
            Ok(response) => response,
            Err(error) => {
                self.upstream_failed(guarded, claim, &error).await;
                let _ = answer.send(Err(failed(error.into())));
                return;
            }
        };
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        if streams(guarded.policy.stream, &parts.headers, &body) {
            // Boxed: a streamed response's state is kilobytes that every exchange
            // would otherwise carry and move.
            return Box::pin(self.stream(guarded, claim, (parts, body), &clock, elapsed, answer)).await;
        }
        let limit = guarded.policy.max_response_body_bytes;
        let share = &mut guarded.share;
        let buffered = body::buffer_response(body, limit, clock.deadline, clock.timeout, |bytes| {
            share.take_for_response(bytes)
        });
        let body = match buffered.await {
            Err(error) => {
                self.upstream_failed(guarded, claim, &error).await;
                let _ = answer.send(Err(failed(error.into())));
                return;
            }
            Ok(Buffered::Whole(body)) => {
                if let Some(until) = self.record(guarded, claim, &parts, &body).await {
                    parts.headers.insert(IDEMPOTENCY_EXPIRES, http_date(until));
                }
                full(body)
            }
            Ok(Buffered::Cut {
                head,
                rest,
                over_budget,
            }) => {
                self.unrecordable(guarded, claim, parts.status, over_budget).await;
                StreamedBody::new(head, rest, clock.deadline, clock.timeout).boxed_unsync()
            }
        };
        let _ = answer.send(Ok(Answer::forwarded(Response::from_parts(parts, body), elapsed)));
    }

    /// A response streamed to its client as it comes, and recorded as it passes
    /// (docs/design.md §25): the client gets the head at once and each chunk as the
    /// upstream sends it; the record completes once the body has ended, before the
    /// client's does. A body that breaks is never recorded as whole: its record is
    /// unknown, and its readers' streams break too. Past `max_response_body_bytes` or
    /// the byte budget, the rest goes to the first client alone, unrecorded. The
    /// upstream's body is read to its end (or its deadline) whether or not the client
    /// stays, so that a retry gets the whole answer.
    async fn stream(
        &self,
        guarded: &mut Guarded,
        claim: OwnedClaim,
        (mut parts, mut body): (response::Parts, Incoming),
        clock: &upstream::Clock,
        elapsed: std::time::Duration,
        answer: oneshot::Sender<Handled>,
    ) {
        let (policy, status) = (guarded.policy.clone(), parts.status);
        let passed = |parts, body| Ok(Answer::forwarded(Response::from_parts(parts, body), elapsed));
        if idempotency::recording_for(status, policy.on_server_error, policy.on_unauthorized) == Recording::Release {
            claim.release().await;
            let body = StreamedBody::new(Vec::new(), body, clock.deadline, clock.timeout).boxed_unsync();
            let _ = answer.send(passed(parts, body));
            return;
        }
        let until = claim.replay_until();
        let head = StoredResponse::recorded(&parts, Bytes::new(), &policy)
            .traced(guarded.execution)
            .replayed_until(Some(until));
        if policy.mode == Mode::Enforce {
            parts.headers.insert(IDEMPOTENCY_EXPIRES, http_date(until));
        }
        let (recording, first) = stream::Recording::start(guarded.share.hold(), head.clone());
        // A retry that waits joins it (a `status` or `refetch` record replays no body,
        // so its retries wait for the record instead).
        let joinable = policy.mode == Mode::Enforce && policy.replay == ReplayKind::Stored;
        if joinable {
            self.shared.waiting.streams.register(&guarded.record, &recording);
        }
        let _ = answer.send(passed(parts, first.boxed_unsync()));
        let ended = pump(&recording, &mut body, clock, policy.max_response_body_bytes).await;
        if joinable {
            self.shared.waiting.streams.unregister(&guarded.record, &recording);
        }
        match ended {
            Ok(None) => {
                let body = match policy.replay {
                    ReplayKind::Stored => recording.body(),
                    ReplayKind::Status | ReplayKind::Refetch => Bytes::new(),
                };
                claim.complete(StoredResponse { body, ..head }).await;
                recording.whole();
            }
            Ok(Some(refused)) => {
                let (chunk, over_budget) = match refused {
                    stream::Refused::TooLarge(chunk) => (chunk, false),
                    stream::Refused::OverBudget(chunk) => (chunk, true),
                };
                recording.hand_on(StreamedBody::new(vec![chunk], body, clock.deadline, clock.timeout));
                self.unrecordable(guarded, claim, status, over_budget).await;
            }
            Err(broken) => {
                tracing::warn!(error = %broken, "the streamed response broke; the key's outcome is now unknown");
                self.unknown_outcome(guarded, claim, UnknownReason::StreamBroken).await;
                recording.broken(broken);
            }
        }
    }

    /// The upstream's whole response: recorded, or the key released, as its status says.
    /// Recorded, it is replayed until the time returned (its claim's time plus the
    /// retention), which the first response tells its client as every replay does.
    async fn record(
        &self,
        guarded: &Guarded,
        claim: OwnedClaim,
        parts: &response::Parts,
        body: &Bytes,
    ) -> Option<SystemTime> {
        let policy = &guarded.policy;
        match idempotency::recording_for(parts.status, policy.on_server_error, policy.on_unauthorized) {
            Recording::Record => {
                let until = claim.replay_until();
                let stored = StoredResponse::recorded(parts, body.clone(), policy)
                    .traced(guarded.execution)
                    .replayed_until(Some(until));
                claim.complete(stored).await;
                // Shadow mode answers as an unguarded route would: nothing of its own.
                (policy.mode == Mode::Enforce).then_some(until)
            }
            Recording::Release => {
                claim.release().await;
                None
            }
        }
    }

    /// A response that reaches the client but cannot be recorded (over
    /// `max_response_body_bytes`, or over the byte budget while it was read): its
    /// outcome is unknown, unless its status releases the key anyway.
    async fn unrecordable(&self, guarded: &Guarded, claim: OwnedClaim, status: StatusCode, over_budget: bool) {
        let policy = &guarded.policy;
        if idempotency::recording_for(status, policy.on_server_error, policy.on_unauthorized) == Recording::Release {
            return claim.release().await;
        }
        let reason = if over_budget {
            tracing::warn!("no budget left to buffer the response for recording; the key's outcome is now unknown");
            UnknownReason::OverBudget
        } else {
            let limit = guarded.policy.max_response_body_bytes;
            tracing::warn!(limit, "response too large to record; the key's outcome is now unknown");
            UnknownReason::ResponseTooLarge
        };
        self.unknown_outcome(guarded, claim, reason).await;
    }

    /// The upstream failed the exchange: the key is freed if nothing was sent, else its
    /// outcome is unknown.
    async fn upstream_failed(&self, guarded: &Guarded, claim: OwnedClaim, error: &UpstreamError) {
        let reason = match error {
            UpstreamError::Unavailable(_) => return claim.release().await,
            UpstreamError::Timeout(_) => UnknownReason::UpstreamTimeout,
            UpstreamError::Failed(_) => UnknownReason::UpstreamFailed,
        };
        self.unknown_outcome(guarded, claim, reason).await;
    }
}

/// How a streamed body's reading ended: whole, past what may be recorded (the chunk
/// that did not fit, and why), or broken.
type Pumped = Result<Option<stream::Refused>, stream::Broken>;

/// Reads `body` into `recording` until it ends, breaks, passes its deadline, or passes
/// `limit` bytes or the byte budget.
async fn pump(recording: &stream::Recording, body: &mut Incoming, clock: &upstream::Clock, limit: u64) -> Pumped {
    loop {
        let frame = match tokio::time::timeout_at(clock.deadline, body.frame()).await {
            Err(_) => return Err(stream::Broken::TimedOut(clock.timeout)),
            Ok(None) => return Ok(None),
            Ok(Some(Err(_))) => return Err(stream::Broken::Upstream),
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers are not recorded, as a buffered response's are not.
        let Ok(chunk) = frame.into_data() else { continue };
        if let Err(refused) = recording.push(chunk, limit) {
            return Ok(Some(refused));
        }
    }
}

/// Whether a response with `headers` and `body` streams to its client as it comes, as
/// the route's `stream` says: `"auto"` streams server-sent events and a body of no
/// declared length.
fn streams(mode: StreamMode, headers: &http::HeaderMap, body: &Incoming) -> bool {
    match mode {
        StreamMode::Never => false,
        StreamMode::Always => true,
        StreamMode::Auto => {
            let events = headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.split(';').next())
                .is_some_and(|kind| kind.trim().eq_ignore_ascii_case("text/event-stream"));
            events || body.size_hint().exact().is_none()
        }
    }
}

/// Puts the key the upstream is to see in a claimed request's `headers`, as the
/// route's `upstream_key` says: the client's own, in its canonical form (a quoted key
/// unquoted, as the guard read it, and as a probe's `{key}` names it), in
/// `upstream_key_header`; the record's operation id; or none. Whatever the client sent
/// in `upstream_key_header` itself is replaced, so a client cannot choose the derived
/// key. Set after the hop-by-hop fields are stripped, so that a client cannot strip it
/// by naming it in `Connection`. Every request enforce mode forwards (claimed, or
/// unguarded with `on_store_error = "forward"`) carries it, so that an upstream that
/// deduplicates on it sees one key per operation; shadow mode sends every request as
/// an unguarded route would, the client's key included.
pub(super) fn upstream_key(
    headers: &mut http::HeaderMap,
    policy: &IdempotencyPolicy,
    record: &StoreKey,
    key: &IdempotencyKey,
) -> Result<(), Rejection> {
    // Shadow mode forwards its retries unguarded, with the client's key: its first
    // request, claimed to be recorded, carries the same one.
    if policy.mode == Mode::Shadow {
        return Ok(());
    }
    let target = &policy.upstream_key_header;
    match policy.upstream_key {
        UpstreamKey::Client => {
            // Visible ASCII, as the guard accepted it: always a valid field value.
            let key = http::HeaderValue::try_from(key.as_str()).map_err(|error| ProxyError::Rewrite(error.into()))?;
            headers.remove(&policy.header);
            headers.insert(target.clone(), key);
        }
        UpstreamKey::Derived => {
            let id = http::HeaderValue::try_from(record.operation_id())
                .map_err(|error| ProxyError::Rewrite(error.into()))?;
            strip_key_headers(headers, policy);
            headers.insert(target.clone(), id);
        }
        UpstreamKey::None => {
            strip_key_headers(headers, policy);
            headers.remove(target);
        }
    }
    Ok(())
}

/// Removes every header the route takes a key from, so that no client key reaches an
/// upstream that is sent the operation id or no key at all.
fn strip_key_headers(headers: &mut http::HeaderMap, policy: &IdempotencyPolicy) {
    headers.remove(&policy.header);
    for source in &policy.key {
        if let crate::config::KeySource::Header(name) = source {
            headers.remove(name);
        }
    }
}
