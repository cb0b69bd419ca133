//! The hyper service: routes a request, and runs a guarded one through its steps:
//! prepare (key, record, body, fingerprint), claim, decide, then forward or answer from
//! the record. The upstream exchange and the record update run in their own task, so
//! a client that goes away changes nothing. This is the only module that ties the
//! store and the upstream together; the claim's lifecycle lives in `claim`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header;
use http::{Request, Response, request};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use self::claim::{Ledger, OwnedClaim};
use crate::body::{self, Buffered, ClientInfo, ProxyBody, StreamedBody, full, streamed};
use crate::config::{Config, IdempotencyPolicy, Mode, OnStoreError};
use crate::error::{KeyError, Outcome, ProxyError, Rejection, UpstreamError};
use crate::idempotency::{self, Decision, Recording};
use crate::metrics::Metrics;
use crate::router::{BodyLimits, RouteState, Router, host_without_port};
use crate::scope;
use crate::store::{AnyStore, ClaimRequest, Fingerprint, OwnerToken, StoreKey, StoredResponse, UnknownReason};
use crate::upstream::{self, HttpClient};

mod access;
mod claim;
mod shadow;
mod wait;

pub(crate) use self::wait::Waiting;

/// A cheap-to-clone handle on everything a request needs.
#[derive(Clone)]
pub(crate) struct Proxy {
    shared: Arc<Shared>,
}

struct Shared {
    /// The routes as the config loaded last made them. A request takes its route out
    /// once, so a reload never changes a request in flight.
    router: ArcSwap<Router>,
    /// The client of every route without roots of its own: kept across reloads, and
    /// its pooled connections with it.
    client: HttpClient,
    metrics: Arc<Metrics>,
    ledger: Ledger,
    key_prefix: String,
    guarded: GuardedRequests,
    waiting: Waiting,
    /// `server.access_log`: gather what the access log says, and write it.
    access_log: AtomicBool,
    /// Exchanges and background store work, so shutdown can wait for them.
    tasks: TaskTracker,
}

/// One permit per guarded request in flight, from reading its body to recording its
/// response: what bounds the bodies the proxy holds at once. Shared by the workers.
#[derive(Clone, Debug)]
pub(crate) struct GuardedRequests {
    permits: Arc<Semaphore>,
    max: usize,
}

impl GuardedRequests {
    pub(crate) fn new(max: usize) -> GuardedRequests {
        GuardedRequests {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A permit for one more guarded request, unless `max` are in flight.
    fn try_enter(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// The guarded requests in flight now.
    pub(crate) fn in_flight(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}

impl Prepared {
    /// Fingerprints the request read into `parts` and `body`, and names its claim.
    fn new(
        parts: request::Parts,
        body: Bytes,
        route: &RouteState,
        policy: &IdempotencyPolicy,
        record: StoreKey,
    ) -> Result<Prepared, Rejection> {
        let fingerprint = idempotency::fingerprint(
            &parts.method,
            &parts.uri,
            &parts.headers,
            &policy.fingerprint_headers,
            &policy.fingerprint_body,
            &body,
        );
        let owner = OwnerToken::generate().map_err(|_| ProxyError::Random)?;
        let claim = ClaimRequest {
            key: record,
            owner,
            fingerprint,
            retention: policy.retention,
            lease: route.route.lease(),
        };
        Ok(Prepared {
            parts,
            body,
            fingerprint,
            claim,
        })
    }
}

/// The routes of `config`, each with its metric handles and its upstream's client:
/// `client` unless it has roots of its own.
fn routes(config: &Config, metrics: &Metrics, client: &HttpClient) -> Result<Router, rustls::Error> {
    let body = BodyLimits {
        max_bytes: config.server.max_request_body_bytes,
        timeout: config.server.request_body_timeout,
    };
    let mut routes = Vec::with_capacity(config.routes.len());
    for route in &config.routes {
        let client = match &route.upstream_tls {
            None => client.clone(),
            Some(tls) => upstream::client(Some(tls.clone()))?,
        };
        routes.push(RouteState::new(route, metrics, client, body));
    }
    Ok(Router::new(routes))
}

/// A guarded request, prepared for its claim: read, fingerprinted, and named.
struct Prepared {
    parts: request::Parts,
    body: Bytes,
    fingerprint: Fingerprint,
    claim: ClaimRequest,
}

impl Proxy {
    pub(crate) fn new(
        config: &Config,
        store: AnyStore,
        metrics: Arc<Metrics>,
        guarded: GuardedRequests,
        waiting: Waiting,
        tasks: TaskTracker,
    ) -> Result<Proxy, rustls::Error> {
        let client = upstream::client(None)?;
        let router = routes(config, &metrics, &client)?;
        Ok(Proxy {
            shared: Arc::new(Shared {
                router: ArcSwap::from_pointee(router),
                client,
                metrics: metrics.clone(),
                ledger: Ledger::new(store, metrics, tasks.clone()),
                key_prefix: config.store.key_prefix.clone(),
                guarded,
                waiting,
                access_log: AtomicBool::new(config.server.access_log),
                tasks,
            }),
        })
    }

    /// Serves the requests that start from now on with `config`'s routes, policies,
    /// upstreams, body limits and access log; requests in flight keep what they have.
    /// The store, its key prefix and the guarded-request bound do not change here.
    pub(crate) fn reload(&self, config: &Config) -> Result<(), rustls::Error> {
        let router = routes(config, &self.shared.metrics, &self.shared.client)?;
        self.shared.router.store(Arc::new(router));
        self.shared
            .access_log
            .store(config.server.access_log, Ordering::Relaxed);
        Ok(())
    }

    fn access_log(&self) -> bool {
        self.shared.access_log.load(Ordering::Relaxed)
    }

    /// Serves one request. Never fails: every error becomes a problem response. With
    /// the access log on, its line is written when the response body ends.
    pub(crate) async fn handle(&self, request: Request<Incoming>, client: ClientInfo) -> Response<ProxyBody> {
        if !self.access_log() {
            return self.serve(request, client).await;
        }
        let (started, method) = (Instant::now(), request.method().clone());
        let response = self.serve(request, client).await;
        access::logged(response, method, started)
    }

    async fn serve(&self, request: Request<Incoming>, client: ClientInfo) -> Response<ProxyBody> {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|host| host.to_str().ok())
            .or_else(|| request.uri().authority().map(|a| a.as_str()))
            .map(host_without_port);
        let Some(route) = self.shared.router.load().route(host, request.uri().path()).cloned() else {
            return self.reject(None, Rejection::NoRoute);
        };
        match &route.route.idempotency {
            // A keyless request on a `required = false` route passes unguarded.
            Some(policy)
                if policy.methods.contains(request.method())
                    && (policy.required || request.headers().contains_key(&policy.header)) =>
            {
                // Boxed: the guarded path's state is large, and the pass-through
                // future should not carry (and move) it.
                match policy.mode {
                    Mode::Enforce => Box::pin(self.guarded(route.clone(), policy.clone(), request, client)).await,
                    Mode::Shadow => Box::pin(self.shadow(route.clone(), policy.clone(), request, client)).await,
                }
            }
            _ => self.pass(&route, streamed(request), &client).await,
        }
    }

    /// Forwards a request that needs no idempotency work, streaming both bodies.
    async fn pass(
        &self,
        route: &RouteState,
        mut request: Request<ProxyBody>,
        client: &ClientInfo,
    ) -> Response<ProxyBody> {
        if let Err(error) = upstream::prepare_request(&mut request, &route.route.upstream, client) {
            return self.reject(Some(route), ProxyError::Rewrite(error).into());
        }
        let timeout = route.route.upstream_timeout;
        let started = Instant::now();
        let deadline = started + timeout;
        let result = upstream::send(&route.client, request, deadline).await;
        let elapsed = started.elapsed();
        route.metrics.upstream(elapsed);
        let response = match result {
            Ok(response) => {
                let (mut parts, body) = response.into_parts();
                upstream::strip_hop_by_hop(&mut parts.headers);
                let body = StreamedBody::new(None, body, deadline, timeout);
                self.served(
                    route,
                    Outcome::Forwarded,
                    Response::from_parts(parts, body.boxed_unsync()),
                )
            }
            Err(error) => self.reject(Some(route), error.into()),
        };
        self.noted(response, access::UpstreamTime(elapsed))
    }

    /// Counts `outcome` on `route`, and notes it for the access log.
    fn served(&self, route: &RouteState, outcome: Outcome, response: Response<ProxyBody>) -> Response<ProxyBody> {
        route.metrics.request(outcome);
        self.noted(
            response,
            access::Served {
                outcome,
                route: Some(route.name.clone()),
            },
        )
    }

    /// Notes `note` on `response` for the access log, when it is on.
    fn noted<T: Clone + Send + Sync + 'static>(
        &self,
        mut response: Response<ProxyBody>,
        note: T,
    ) -> Response<ProxyBody> {
        if self.access_log() {
            response.extensions_mut().insert(note);
        }
        response
    }

    /// What the access log says of the record a guarded request names, when it is on.
    fn record_note(&self, record: &StoreKey) -> Option<access::RecordHash> {
        self.access_log()
            .then(|| access::RecordHash(record.short_hash().to_string()))
    }

    /// Notes `hash` (from `record_note`) on `response`.
    fn noted_record(&self, response: Response<ProxyBody>, hash: Option<access::RecordHash>) -> Response<ProxyBody> {
        match hash {
            Some(hash) => self.noted(response, hash),
            None => response,
        }
    }

    /// A guarded request: prepare, claim, decide, then forward or answer. Everything
    /// after the key is parsed is logged in a span naming the route and the record.
    async fn guarded(
        &self,
        route: Arc<RouteState>,
        policy: Arc<IdempotencyPolicy>,
        request: Request<Incoming>,
        client: ClientInfo,
    ) -> Response<ProxyBody> {
        let record = match self.identify(&route, &policy, request.headers()) {
            Ok(record) => record,
            Err(rejection) => return self.reject(Some(&route), rejection),
        };
        let span = tracing::info_span!("guarded", route = %route.route.name, record = %record.short_hash());
        let hash = self.record_note(&record);
        // Refused at once rather than queued: nothing is read, claimed or forwarded, and
        // the client may retry with the same key.
        let Some(permit) = self.shared.guarded.try_enter() else {
            return self.reject(Some(&route), Rejection::Overloaded(self.shared.guarded.max));
        };
        let response = async move {
            let prepared = match self.prepare(&route, &policy, record, request).await {
                Ok(prepared) => prepared,
                Err(rejection) => return self.reject(Some(&route), rejection),
            };
            let outcome = match self.shared.ledger.claim(&prepared.claim, &Span::current()).await {
                Ok(outcome) => outcome,
                Err(error) if policy.on_store_error == OnStoreError::Forward => {
                    tracing::warn!(%error, "store unavailable; forwarding unguarded (on_store_error = forward)");
                    let request = Request::from_parts(prepared.parts, full(prepared.body));
                    return self.pass(&route, request, &client).await;
                }
                Err(error) => return self.reject(Some(&route), error.into()),
            };
            match idempotency::decide(outcome, prepared.fingerprint) {
                Decision::Forward(claim) => self.forward(route, policy, claim, prepared, &client, permit).await,
                Decision::Replay(stored) => self.served(&route, Outcome::Replayed, stored.into_response()),
                Decision::Reject(rejection @ Rejection::InProgress { .. }) if !policy.wait_for_in_flight.is_zero() => {
                    self.wait(route, policy, prepared, &client, permit, rejection).await
                }
                Decision::Reject(rejection) => self.reject(Some(&route), rejection),
            }
        }
        .instrument(span)
        .await;
        self.noted_record(response, hash)
    }

    /// The record a guarded request names: its key, within its scope (the
    /// `scope_headers` and the verified `scope_jwt` claim).
    fn identify(
        &self,
        route: &RouteState,
        policy: &IdempotencyPolicy,
        headers: &http::HeaderMap,
    ) -> Result<StoreKey, Rejection> {
        let key = idempotency::parse_key(headers.get_all(&policy.header))?.ok_or(KeyError::Missing)?;
        let claim = match &policy.scope_jwt {
            None => None,
            Some(verifier) => Some(verifier.verify(headers, SystemTime::now())?),
        };
        let scope = scope::values(headers, &policy.scope_headers, claim.as_deref());
        Ok(idempotency::store_key(
            &self.shared.key_prefix,
            &route.route.name,
            &scope,
            &key,
        ))
    }

    /// Reads the body within its limits and works out what the claim asks for.
    async fn prepare(
        &self,
        route: &RouteState,
        policy: &IdempotencyPolicy,
        record: StoreKey,
        request: Request<Incoming>,
    ) -> Result<Prepared, Rejection> {
        let (parts, body) = request.into_parts();
        let body = body::read_request_body(body, &parts.headers, route.body.max_bytes, route.body.timeout).await?;
        Prepared::new(parts, body, route, policy, record)
    }

    /// Sends the claimed request from a task of its own, and returns its response once
    /// the record is updated, so that a retry that follows it sees the record.
    async fn forward(
        &self,
        route: Arc<RouteState>,
        policy: Arc<IdempotencyPolicy>,
        claim: OwnedClaim,
        prepared: Prepared,
        client: &ClientInfo,
        permit: OwnedSemaphorePermit,
    ) -> Response<ProxyBody> {
        let mut request = Request::from_parts(prepared.parts, full(prepared.body));
        if let Err(error) = upstream::prepare_request(&mut request, &route.route.upstream, client) {
            claim.release_in_background();
            return self.reject(Some(&route), ProxyError::Rewrite(error).into());
        }
        let (sender, receiver) = oneshot::channel();
        let proxy = self.clone();
        let state = route.clone();
        let exchange = async move {
            let response = proxy.exchange(&state, &policy, claim, request).await;
            // The bodies are recorded or handed on: the request no longer counts.
            drop(permit);
            // The client may have gone: the record is already updated.
            let _ = sender.send(response);
        };
        // Boxed once here: the exchange's state is kilobytes, which spawning would
        // otherwise copy through each wrapper into the task.
        self.shared.tasks.spawn(Box::pin(exchange).in_current_span());
        match receiver.await {
            Ok(response) => response,
            Err(_) => self.reject(Some(&route), ProxyError::ExchangeLost.into()),
        }
    }

    /// Runs in its own task: forwards the claimed request, then resolves the claim by
    /// what came back.
    async fn exchange(
        &self,
        route: &RouteState,
        policy: &IdempotencyPolicy,
        mut claim: OwnedClaim,
        request: Request<ProxyBody>,
    ) -> Response<ProxyBody> {
        let timeout = route.route.upstream_timeout;
        let started = Instant::now();
        let deadline = started + timeout;
        claim.forwarding();
        let sent = upstream::send(&route.client, request, deadline).await;
        let elapsed = started.elapsed();
        route.metrics.upstream(elapsed);
        let response = match sent {
            Ok(response) => response,
            Err(error) => {
                let response = self.upstream_failed(route, claim, error).await;
                return self.noted(response, access::UpstreamTime(elapsed));
            }
        };
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        let recording = idempotency::recording_for(parts.status, policy.on_server_error);
        let body = match body::buffer_response(body, policy.max_response_body_bytes, deadline, timeout).await {
            Err(error) => {
                let response = self.upstream_failed(route, claim, error).await;
                return self.noted(response, access::UpstreamTime(elapsed));
            }
            Ok(Buffered::Whole(body)) => {
                match recording {
                    Recording::Record => {
                        let stored = StoredResponse::from_parts(&parts, body.clone(), &policy.replay_exclude_headers);
                        claim.complete(stored).await;
                    }
                    Recording::Release => claim.release().await,
                }
                full(body)
            }
            Ok(Buffered::TooLarge { head, rest }) => {
                match recording {
                    Recording::Record => {
                        tracing::warn!(
                            limit = policy.max_response_body_bytes,
                            "response too large to record; the key's outcome is now unknown"
                        );
                        claim.mark_unknown(UnknownReason::ResponseTooLarge).await;
                    }
                    Recording::Release => claim.release().await,
                }
                StreamedBody::new(Some(head), rest, deadline, timeout).boxed_unsync()
            }
        };
        let response = self.served(route, Outcome::Forwarded, Response::from_parts(parts, body));
        self.noted(response, access::UpstreamTime(elapsed))
    }

    /// The upstream failed: free the key if nothing was sent, else mark it unknown.
    async fn upstream_failed(
        &self,
        route: &RouteState,
        claim: OwnedClaim,
        error: UpstreamError,
    ) -> Response<ProxyBody> {
        match &error {
            UpstreamError::Unavailable(_) => claim.release().await,
            UpstreamError::Timeout(_) => claim.mark_unknown(UnknownReason::UpstreamTimeout).await,
            UpstreamError::Failed(_) => claim.mark_unknown(UnknownReason::UpstreamFailed).await,
        }
        self.reject(Some(route), error.into())
    }

    /// Renders a problem, counts it on its route, and logs it at the level its fault
    /// deserves.
    fn reject(&self, route: Option<&RouteState>, rejection: Rejection) -> Response<ProxyBody> {
        let problem = rejection.problem();
        let name = route.map_or("-", |route| route.route.name.as_str());
        let (status, slug) = (problem.status.as_u16(), problem.slug);
        let error: &dyn std::error::Error = &rejection;
        match problem.fault.level() {
            tracing::Level::ERROR => {
                tracing::error!(route = name, status, problem = slug, error = %DisplayChain(error), "problem response")
            }
            tracing::Level::WARN => {
                tracing::warn!(route = name, status, problem = slug, error = %DisplayChain(error), "problem response")
            }
            _ => tracing::info!(route = name, status, problem = slug, "problem response"),
        }
        let outcome = problem.outcome;
        let response = problem.into_response().map(full);
        match route {
            Some(route) => self.served(route, outcome, response),
            None => self.noted(response, access::Served { outcome, route: None }),
        }
    }
}

/// Displays an error followed by its sources, for logs. A source whose text its error
/// already ends with (the redis crate prints its cause, then gives it as the source) is
/// not repeated.
pub(crate) struct DisplayChain<'a>(pub(crate) &'a dyn std::error::Error);

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut previous = self.0.to_string();
        f.write_str(&previous)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !previous.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            previous = text;
            source = cause.source();
        }
        Ok(())
    }
}
