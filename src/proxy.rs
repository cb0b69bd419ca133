//! The hyper service: routes a request, and for a guarded one reads the key and the
//! body, claims, then forwards, replays or rejects. The upstream exchange and the
//! record update run in their own task, so a client that goes away changes nothing.
//! This is the only module that ties the store and the upstream together.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::config::{Config, IdempotencyPolicy, OnStoreError, Route};
use crate::error::{BoxError, Rejection, StoreError, UpstreamError};
use crate::idempotency::{self, Decision, IdempotencyKey, Recording};
use crate::metrics::{Metrics, Outcome, RouteMetrics, StoreOp};
use crate::router::{Router, host_without_port};
use crate::store::{AnyStore, Claim, OwnerToken, RecordStore, StoreKey, StoredResponse, UnknownReason, Write};
use crate::upstream::{self, Buffered, ClientInfo, HttpClient, ProxyBody, StreamedBody, Target, full};

/// Set on every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The longest pause between two tries of a background release or complete.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// A cheap-to-clone handle on everything a request needs.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

struct Shared {
    router: Router,
    store: AnyStore,
    client: HttpClient,
    metrics: Arc<Metrics>,
    /// Per route, made once: metric handles and the parsed upstream.
    routes: std::collections::HashMap<String, RouteState>,
    key_prefix: String,
    max_request_body_bytes: u64,
    request_body_timeout: Duration,
    /// Exchanges and background store work, so shutdown can wait for them.
    tasks: TaskTracker,
}

struct RouteState {
    metrics: RouteMetrics,
    target: Target,
}

/// One guarded request, once its key is parsed and its body read.
struct Guarded {
    route: Arc<Route>,
    policy: Arc<IdempotencyPolicy>,
    key: StoreKey,
    idempotency_key: IdempotencyKey,
    owner: OwnerToken,
}

impl Proxy {
    pub fn new(config: &Config, store: AnyStore, metrics: Arc<Metrics>, tasks: TaskTracker) -> Proxy {
        Proxy {
            shared: Arc::new(Shared {
                router: Router::new(&config.routes),
                store,
                client: upstream::client(),
                routes: config
                    .routes
                    .iter()
                    .map(|route| {
                        let state = RouteState {
                            metrics: metrics.route(&route.name),
                            target: Target::new(&route.upstream).expect("config validation requires an upstream host"),
                        };
                        (route.name.clone(), state)
                    })
                    .collect(),
                metrics,
                key_prefix: config.store.key_prefix.clone(),
                max_request_body_bytes: config.server.max_request_body_bytes,
                request_body_timeout: config.server.request_body_timeout,
                tasks,
            }),
        }
    }

    /// Serves one request. Never fails: every error becomes a problem response.
    pub async fn handle(&self, request: Request<Incoming>, client: ClientInfo) -> Response<ProxyBody> {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|host| host.to_str().ok())
            .or_else(|| request.uri().authority().map(|a| a.as_str()))
            .map(host_without_port);
        let Some(route) = self.shared.router.route(host, request.uri().path()).cloned() else {
            return self.reject("", None, Rejection::NoRoute);
        };
        match &route.idempotency {
            Some(policy) if policy.methods.contains(request.method()) => {
                if !policy.required && !request.headers().contains_key(&policy.header) {
                    return self.pass(&route, streamed(request), &client).await;
                }
                let policy = policy.clone();
                // Boxed: the guarded path's state is large, and the pass-through
                // future should not carry (and move) it.
                Box::pin(self.guarded(route, policy, request, client)).await
            }
            _ => self.pass(&route, streamed(request), &client).await,
        }
    }

    /// Forwards a request that needs no idempotency work, streaming both bodies.
    async fn pass(&self, route: &Route, mut request: Request<ProxyBody>, client: &ClientInfo) -> Response<ProxyBody> {
        let state = self.route_state(&route.name);
        if let Err(error) = upstream::prepare_request(&mut request, &state.target, client) {
            return self.reject(&route.name, None, Rejection::Internal(error.into()));
        }
        let started = Instant::now();
        let deadline = started + route.upstream_timeout;
        let result = upstream::send(&self.shared.client, request, deadline).await;
        state.metrics.upstream(started.elapsed());
        match result {
            Ok(response) => {
                state.metrics.request(Outcome::Forwarded);
                let (mut parts, body) = response.into_parts();
                upstream::strip_hop_by_hop(&mut parts.headers);
                let body = StreamedBody::new(None, body, deadline, route.upstream_timeout);
                Response::from_parts(parts, body.boxed_unsync())
            }
            Err(error) => self.reject(&route.name, None, Rejection::Upstream(error)),
        }
    }

    async fn guarded(
        &self,
        route: Arc<Route>,
        policy: Arc<IdempotencyPolicy>,
        request: Request<Incoming>,
        client: ClientInfo,
    ) -> Response<ProxyBody> {
        // `handle` sends keyless requests on `required = false` routes on unguarded.
        let key = match idempotency::parse_key(request.headers().get_all(&policy.header)) {
            Ok(Some(key)) => key,
            Ok(None) => return self.reject(&route.name, None, crate::error::KeyError::Missing.into()),
            Err(error) => return self.reject(&route.name, None, error.into()),
        };
        let (parts, body) = request.into_parts();
        let body = match self.read_body(body, &parts.headers).await {
            Ok(body) => body,
            Err(rejection) => return self.reject(&route.name, Some(&key), rejection),
        };
        let fingerprint = idempotency::fingerprint(
            &parts.method,
            &parts.uri,
            &parts.headers,
            &policy.fingerprint_headers,
            &body,
        );
        let scope = idempotency::scope_values(&parts.headers, &policy.scope_headers);
        let store_key = idempotency::store_key(&self.shared.key_prefix, &route.name, &scope, &key);
        let guarded = Guarded {
            route: route.clone(),
            policy: policy.clone(),
            key: store_key,
            idempotency_key: key,
            owner: OwnerToken::generate(),
        };
        let claim = Claim {
            key: guarded.key.clone(),
            owner: guarded.owner,
            fingerprint,
            retention: policy.retention,
            lease: route.lease(),
        };

        // Until the claim answers, a client that goes away leaves a claim that may
        // have been written and will never be forwarded: the guard releases it.
        let mut pending = PendingClaim {
            proxy: self,
            guarded: &guarded,
            armed: true,
        };
        let outcome = self.timed(StoreOp::Claim, self.shared.store.claim(&claim)).await;
        // A failed claim may still have been written, unless the store said it is full.
        if !matches!(&outcome, Err(error) if !matches!(error, StoreError::Full(_))) {
            pending.disarm();
        }
        drop(pending);
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                return match policy.on_store_error {
                    OnStoreError::Reject => self.reject(&route.name, Some(&guarded.idempotency_key), error.into()),
                    OnStoreError::Forward => {
                        tracing::warn!(route = %route.name, key = ?guarded.idempotency_key, %error,
                            "store unavailable; forwarding unguarded (on_store_error = forward)");
                        let request = Request::from_parts(parts, full(body));
                        self.pass(&route, request, &client).await
                    }
                };
            }
        };

        match idempotency::decide(outcome, fingerprint) {
            Decision::Forward => {
                let mut request = Request::from_parts(parts, full(body));
                if let Err(error) =
                    upstream::prepare_request(&mut request, &self.route_state(&route.name).target, &client)
                {
                    self.release_in_background(&guarded);
                    return self.reject(
                        &route.name,
                        Some(&guarded.idempotency_key),
                        Rejection::Internal(error.into()),
                    );
                }
                let (sender, receiver) = oneshot::channel();
                let proxy = self.clone();
                self.shared.tasks.spawn(async move {
                    let response = proxy.exchange(&guarded, request).await;
                    // The client may have gone: the record is already updated.
                    let _ = sender.send(response);
                });
                match receiver.await {
                    Ok(response) => response,
                    Err(_) => self.reject(
                        &route.name,
                        None,
                        Rejection::Upstream(UpstreamError::Failed(
                            "the exchange task ended without a response".into(),
                        )),
                    ),
                }
            }
            Decision::Replay(stored) => {
                self.route_state(&route.name).metrics.request(Outcome::Replayed);
                replay(stored)
            }
            Decision::Reject(rejection) => self.reject(&route.name, Some(&guarded.idempotency_key), rejection),
        }
    }

    /// Reads a guarded request's whole body, within the size and time limits.
    async fn read_body(&self, body: Incoming, headers: &HeaderMap) -> Result<Bytes, Rejection> {
        let max = self.shared.max_request_body_bytes;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse::<u64>().ok());
        if declared.is_some_and(|length| length > max) {
            return Err(Rejection::BodyTooLarge(max));
        }
        let limit = usize::try_from(max).unwrap_or(usize::MAX);
        let timeout = self.shared.request_body_timeout;
        match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
            Err(_) => Err(Rejection::BodyTimeout(timeout)),
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => Err(Rejection::BodyTooLarge(max)),
            Ok(Err(error)) => Err(Rejection::BodyIncomplete(error)),
        }
    }

    /// Runs in its own task: forwards the claimed request, updates the record, and
    /// only then returns the response, so a retry that follows it sees the record.
    async fn exchange(&self, guarded: &Guarded, request: Request<ProxyBody>) -> Response<ProxyBody> {
        let route = &guarded.route;
        let policy = &guarded.policy;
        let started = Instant::now();
        let deadline = started + route.upstream_timeout;
        let sent = upstream::send(&self.shared.client, request, deadline).await;
        self.route_state(&route.name).metrics.upstream(started.elapsed());
        let response = match sent {
            Ok(response) => response,
            Err(error) => return self.upstream_failed(guarded, error).await,
        };
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        let recording = idempotency::recording_for(parts.status, policy.on_server_error);
        let buffered = upstream::buffer(body, policy.max_response_body_bytes, deadline, route.upstream_timeout).await;
        match buffered {
            Err(error) => self.upstream_failed(guarded, error).await,
            Ok(Buffered::TooLarge { head, rest }) => {
                match recording {
                    Recording::Record => {
                        tracing::warn!(route = %route.name, key = ?guarded.idempotency_key,
                            limit = policy.max_response_body_bytes,
                            "response too large to record; the key's outcome is now unknown");
                        self.mark_unknown(guarded, UnknownReason::ResponseTooLarge).await;
                    }
                    Recording::Release => self.release(guarded).await,
                }
                self.route_state(&route.name).metrics.request(Outcome::Forwarded);
                let body = StreamedBody::new(Some(head), rest, deadline, route.upstream_timeout);
                Response::from_parts(parts, body.boxed_unsync())
            }
            Ok(Buffered::Whole(body)) => {
                match recording {
                    Recording::Record => {
                        let stored = StoredResponse {
                            status: parts.status.as_u16(),
                            headers: recordable_headers(&parts.headers),
                            body: body.clone(),
                        };
                        self.complete(guarded, stored).await;
                    }
                    Recording::Release => self.release(guarded).await,
                }
                self.route_state(&route.name).metrics.request(Outcome::Forwarded);
                Response::from_parts(parts, full(body))
            }
        }
    }

    /// The upstream failed: free the key if nothing was sent, else mark it unknown.
    async fn upstream_failed(&self, guarded: &Guarded, error: UpstreamError) -> Response<ProxyBody> {
        match &error {
            UpstreamError::Unavailable(_) => self.release(guarded).await,
            UpstreamError::Timeout(_) => self.mark_unknown(guarded, UnknownReason::UpstreamTimeout).await,
            UpstreamError::Failed(_) => self.mark_unknown(guarded, UnknownReason::UpstreamFailed).await,
        }
        self.reject(&guarded.route.name, Some(&guarded.idempotency_key), error.into())
    }

    async fn complete(&self, guarded: &Guarded, stored: StoredResponse) {
        let result = self
            .write(
                StoreOp::Complete,
                self.shared.store.complete(&guarded.key, guarded.owner, &stored),
            )
            .await;
        match result {
            Ok(Write::Applied) => {}
            Ok(Write::Fenced) => tracing::warn!(route = %guarded.route.name, key = ?guarded.idempotency_key,
                "complete was fenced off: the claim expired or was taken; retries get 409 outcome-unknown"),
            Err(error) => {
                tracing::warn!(route = %guarded.route.name, key = ?guarded.idempotency_key, %error,
                    "cannot record the response; retrying in the background until the lease ends");
                let proxy = self.clone();
                let key = guarded.key.clone();
                let owner = guarded.owner;
                let until = Instant::now() + guarded.route.lease();
                self.shared.tasks.spawn(async move {
                    proxy
                        .retry_until(StoreOp::Complete, until, || {
                            proxy.shared.store.complete(&key, owner, &stored)
                        })
                        .await;
                });
            }
        }
    }

    async fn mark_unknown(&self, guarded: &Guarded, reason: UnknownReason) {
        let result = self
            .write(
                StoreOp::MarkUnknown,
                self.shared.store.mark_unknown(&guarded.key, guarded.owner, reason),
            )
            .await;
        if let Err(error) = result {
            // The record stays in flight, and reads as unknown once its lease ends.
            tracing::warn!(route = %guarded.route.name, key = ?guarded.idempotency_key, %error,
                "cannot mark the record unknown; it reads as unknown when its lease ends");
        }
    }

    /// Releases a claim whose request was not forwarded (or whose response is not
    /// kept), retrying in the background while the store is down.
    async fn release(&self, guarded: &Guarded) {
        let result = self
            .write(StoreOp::Release, self.shared.store.release(&guarded.key, guarded.owner))
            .await;
        if let Err(error) = result {
            tracing::warn!(route = %guarded.route.name, key = ?guarded.idempotency_key, %error,
                "cannot release the claim; retrying in the background");
            self.release_in_background(guarded);
        }
    }

    fn release_in_background(&self, guarded: &Guarded) {
        let proxy = self.clone();
        let key = guarded.key.clone();
        let owner = guarded.owner;
        let until = Instant::now() + guarded.policy.retention;
        self.shared.tasks.spawn(async move {
            let pending = proxy.shared.metrics.pending_releases().clone();
            pending.inc();
            proxy
                .retry_until(StoreOp::Release, until, || proxy.shared.store.release(&key, owner))
                .await;
            pending.dec();
        });
    }

    /// Tries a fenced write until the store answers or `until` passes.
    async fn retry_until<F, Fut>(&self, op: StoreOp, until: Instant, mut write: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Write, StoreError>>,
    {
        let mut pause = Duration::from_millis(50);
        while Instant::now() < until {
            match self.write(op, write()).await {
                Ok(outcome) => {
                    tracing::info!(?op, ?outcome, "background store write answered");
                    return;
                }
                Err(error) => tracing::debug!(?op, %error, "background store write failed; will retry"),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
        }
        tracing::warn!(?op, "gave up a background store write: the record has expired by now");
    }

    /// Runs one compare-and-set write, recording its latency and whether it was fenced.
    async fn write(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<Write, StoreError>>,
    ) -> Result<Write, StoreError> {
        let result = self.timed(op, call).await;
        if let Ok(Write::Fenced) = result {
            self.shared.metrics.fenced_write(op);
        }
        result
    }

    /// Runs one store operation and records its latency.
    async fn timed<T>(&self, op: StoreOp, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = call.await;
        self.shared.metrics.store_op(op, result.is_ok(), started.elapsed());
        result
    }

    /// Renders a problem, counts it, and logs it at the level its fault deserves.
    fn reject(&self, route: &str, key: Option<&IdempotencyKey>, rejection: Rejection) -> Response<ProxyBody> {
        let outcome = match &rejection {
            Rejection::InProgress { .. } | Rejection::OutcomeUnknown => Outcome::Conflict,
            Rejection::KeyReused => Outcome::Mismatch,
            Rejection::Store(_) => Outcome::StoreError,
            Rejection::Upstream(_) | Rejection::Internal(_) => Outcome::UpstreamError,
            Rejection::NoRoute
            | Rejection::Key(_)
            | Rejection::BodyTooLarge(_)
            | Rejection::BodyTimeout(_)
            | Rejection::BodyIncomplete(_) => Outcome::Rejected,
        };
        let problem = rejection.problem();
        let key = key.map_or_else(|| "-".to_string(), |key| format!("{key:?}"));
        let error: &dyn std::error::Error = &rejection;
        match outcome {
            Outcome::StoreError | Outcome::UpstreamError => tracing::warn!(
                route, %key, status = problem.status.as_u16(), problem = problem.slug,
                error = %DisplayChain(error), "problem response"),
            _ => tracing::info!(
                route, %key, status = problem.status.as_u16(), problem = problem.slug,
                "problem response"),
        }
        if let Some(state) = self.shared.routes.get(route) {
            state.metrics.request(outcome);
        }
        problem.into_response().map(full)
    }

    fn route_state(&self, route: &str) -> &RouteState {
        // Every configured route has its state from `Proxy::new`.
        &self.shared.routes[route]
    }
}

/// Releases a claim in the background if dropped while armed: the request's future
/// went away (the client left) while its claim was being written.
struct PendingClaim<'a> {
    proxy: &'a Proxy,
    guarded: &'a Guarded,
    armed: bool,
}

impl PendingClaim<'_> {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for PendingClaim<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.proxy.release_in_background(self.guarded);
        }
    }
}

/// A client request with its body streamed on as it arrives.
fn streamed(request: Request<Incoming>) -> Request<ProxyBody> {
    request.map(|body| body.map_err(BoxError::from).boxed_unsync())
}

/// The headers kept in a record: all end-to-end fields but `Content-Length`, which is
/// derived again from the recorded body.
fn recordable_headers(headers: &HeaderMap) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| *name != header::CONTENT_LENGTH)
        .map(|(name, value)| (name.as_str().to_string(), Bytes::copy_from_slice(value.as_bytes())))
        .collect()
}

/// A recorded response, as every retry sees it.
fn replay(stored: StoredResponse) -> Response<ProxyBody> {
    let mut response = Response::new(full(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// Displays an error followed by its sources, for logs.
struct DisplayChain<'a>(&'a dyn std::error::Error);

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}
