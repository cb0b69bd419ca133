//! The hyper service: routes a request, and runs a guarded one through its steps:
//! identify (key and scope), enter (its permit), prepare (body and fingerprint), claim
//! and decide, then forward or answer from the record. Every step returns a `Result`;
//! one function, `finish`, ends every request: it counts the outcome, renders a refusal
//! as its problem (logged by whose fault it is) and notes what the access log reads.
//! The upstream exchange and the record update run in their own task, so a client that
//! goes away changes nothing. This is the only module that ties the store and the
//! upstream together; the claim's lifecycle lives in `claim`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use self::admit::{Admission, Admitted};
use self::claim::{Ledger, OwnedClaim};
pub(crate) use self::claim::{PreviousStore, Stores};
use self::send::send;
use crate::body::BodyLimits;
use crate::body::{self, ClientInfo, ProxyBody, StreamedBody, full, streamed};
use crate::bounds::{GuardedRequests, HeldBody, Share};
use crate::calls::{self, Call, CallId};
use crate::config::{Calls, Config, IdempotencyPolicy, Mode, OnStoreError, ReplayKind};
use crate::error::{Bound, DisplayChain, Outcome, ProxyError, Rejection, StoreError};
use crate::idempotency::{self, Decision};
use crate::metrics::Metrics;
use crate::record::ExecutionTrace;
use crate::router::{RouteState, Router};
use crate::store::{StoreKey, StoredResponse};
use crate::stream::Reader;
use crate::trace::{self, Spans};
use crate::upstream::{self, HttpClient};

mod access;
mod admit;
mod claim;
mod context;
mod exchange;
mod reconcile;
mod refetch;
mod send;
mod shadow;
mod wait;
mod well_known;

use self::context::{Arrival, Guarded, Named, Prepared};
pub(crate) use self::reconcile::Probes;
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
    /// What this process's reconciliation probes share across its workers.
    probes: Probes,
    /// The spans requests get (none without `[tracing]`), and with them the trace
    /// context upstreams get. Fixed at start, as the export is.
    spans: Spans,
}

/// How a request's steps end, for `finish`.
type Handled = Result<Answer, Refusal>;

/// A response to send on, and what it is counted as.
struct Answer {
    response: Response<ProxyBody>,
    outcome: Outcome,
    /// How long the upstream took to its response head, when it was asked.
    upstream: Option<Duration>,
    /// A replay's: the trace of the request that executed it.
    execution: Option<ExecutionTrace>,
}

impl Answer {
    fn forwarded(response: Response<ProxyBody>, upstream: Duration) -> Answer {
        Answer {
            response,
            outcome: Outcome::Forwarded,
            upstream: Some(upstream),
            execution: None,
        }
    }

    /// A retry that joined the stream of the request that holds its key: `head` (the
    /// recorded status and fields, marked as replayed) and the stream from its start.
    fn joined(head: StoredResponse, reader: Reader) -> Answer {
        let execution = head.trace;
        let (parts, _) = head.into_response().into_parts();
        Answer {
            execution,
            response: Response::from_parts(parts, reader.boxed_unsync()),
            outcome: Outcome::Replayed,
            upstream: None,
        }
    }

    /// A replay of `stored`, its body holding its bytes of the byte budget (in the
    /// guarded request's `share`) until the client has taken the last of them: a
    /// client that does not read holds them against `max_buffered_bytes`, never beside
    /// it. Past the budget, 503 `overloaded`; a retry later gets the replay.
    fn replayed(stored: StoredResponse, mut share: Share) -> Result<Answer, Rejection> {
        if !share.take_for_response(stored.body.len() as u64) {
            return Err(Rejection::Overloaded(Bound::Bytes));
        }
        let execution = stored.trace;
        Ok(Answer {
            execution,
            response: stored
                .into_response()
                .map(|body| HeldBody::new(body, share).boxed_unsync()),
            outcome: Outcome::Replayed,
            upstream: None,
        })
    }
}

/// What the proxy answers itself instead, and how long the upstream took before it
/// failed, when it was asked.
struct Refusal {
    rejection: Rejection,
    upstream: Option<Duration>,
    /// The record's operation id, for a 409 `outcome-unknown` to name.
    operation: Option<String>,
}

impl Refusal {
    /// `rejection` of a request that named `record`: an `outcome-unknown` names the
    /// record's operation, so that client and operator speak of the same one.
    fn about(rejection: Rejection, record: &StoreKey) -> Refusal {
        let operation = matches!(
            rejection,
            Rejection::OutcomeUnknown { .. } | Rejection::ResponseExpired(_)
        )
        .then(|| record.operation_id());
        Refusal {
            rejection,
            upstream: None,
            operation,
        }
    }
}

impl<E: Into<Rejection>> From<E> for Refusal {
    fn from(error: E) -> Refusal {
        Refusal {
            rejection: error.into(),
            upstream: None,
            operation: None,
        }
    }
}

/// The routes of `config`, each with its metric handles, its upstream's client
/// (`client` unless it has roots of its own) and the permits of its probes.
fn routes(config: &Config, metrics: &Metrics, client: &HttpClient, probes: &Probes) -> Result<Router, rustls::Error> {
    let body = BodyLimits {
        max_bytes: config.server.max_request_body_bytes,
        timeout: config.server.request_body_timeout,
        idle: config.server.request_body_idle_timeout,
    };
    let mut routes = Vec::with_capacity(config.routes.len());
    for route in &config.routes {
        let client = match &route.upstream_tls {
            None => client.clone(),
            Some(tls) => upstream::client(Some(tls.clone()))?,
        };
        let limit = route
            .reconcile()
            .map(|reconcile| probes.limit(&route.name, reconcile.max_concurrent));
        routes.push(RouteState::new(route, metrics, client, body, limit));
    }
    Ok(Router::new(
        routes,
        config.server.paths,
        config.server.contract_path.clone(),
    ))
}

impl Proxy {
    pub(crate) fn new(
        config: &Config,
        stores: Stores,
        metrics: Arc<Metrics>,
        guarded: GuardedRequests,
        waiting: Waiting,
        probes: Probes,
        tasks: TaskTracker,
    ) -> Result<Proxy, rustls::Error> {
        let client = upstream::client(None)?;
        let router = routes(config, &metrics, &client, &probes)?;
        Ok(Proxy {
            shared: Arc::new(Shared {
                router: ArcSwap::from_pointee(router),
                client,
                metrics: metrics.clone(),
                ledger: Ledger::new(stores, metrics, tasks.clone(), Spans::new(config.tracing.is_some())),
                key_prefix: config.store.key_prefix.clone(),
                guarded,
                waiting,
                access_log: AtomicBool::new(config.server.access_log),
                tasks,
                probes,
                spans: Spans::new(config.tracing.is_some()),
            }),
        })
    }

    /// Serves the requests that start from now on with `config`'s routes, policies,
    /// upstreams, body limits and access log; requests in flight keep what they have.
    /// The store, its key prefix and the guarded-request bound do not change here.
    pub(crate) fn reload(&self, config: &Config) -> Result<(), rustls::Error> {
        let router = routes(config, &self.shared.metrics, &self.shared.client, &self.shared.probes)?;
        self.shared.router.store(Arc::new(router));
        self.shared
            .access_log
            .store(config.server.access_log, Ordering::Relaxed);
        // The reloader made a handle of the same config before any worker swapped.
        match PreviousStore::open(config) {
            Ok(previous) => self.shared.ledger.set_previous(previous),
            Err(error) => tracing::error!(%error, "[store.previous] cannot be used; the one read before is kept"),
        }
        Ok(())
    }

    fn access_log(&self) -> bool {
        self.shared.access_log.load(Ordering::Relaxed)
    }

    /// Whether a response is noted with how it ended: for the access log, or for the
    /// request's span.
    fn noted(&self) -> bool {
        self.shared.spans.on() || self.access_log()
    }

    /// Serves one request. Never fails: every error becomes a problem response. With
    /// the access log on, its line is written when the response body ends; with
    /// tracing on, the request has its span, which says how it ended.
    pub(crate) async fn handle(&self, request: Request<Incoming>, client: ClientInfo) -> Response<ProxyBody> {
        if !self.noted() {
            return self.serve(request, client).await;
        }
        let (started, method, spans) = (tokio::time::Instant::now(), request.method().clone(), self.shared.spans);
        let span = spans.request(&method, request.headers());
        let response = self.serve(request, client).instrument(span.clone()).await;
        let note = response.extensions().get::<access::Note>();
        let end = trace::RequestEnd {
            status: response.status().as_u16(),
            route: note.and_then(|note| note.route.as_deref()),
            outcome: note.map_or("-", |note| note.outcome.as_str()),
            record: note.and_then(|note| note.record.as_deref()),
            execution: note.and_then(|note| note.execution),
        };
        let trace_id = spans.ended(&span, end);
        if !self.access_log() {
            return response;
        }
        access::logged(response, method, started, trace_id)
    }

    async fn serve(&self, request: Request<Incoming>, client: ClientInfo) -> Response<ProxyBody> {
        let Admitted { request, route, guard } = match self.admit(request) {
            Ok(Admission::Route(admitted)) => admitted,
            Ok(Admission::Contract { request, host }) => return self.contract(&request, host.as_deref()),
            Err(refused) => return self.finish(refused.route.as_deref(), None, Err(refused.rejection.into()), None),
        };
        // On a route with `[route.cors]` the proxy answers preflights and owns the
        // CORS fields of every answer.
        let Some(cors) = route.config.cors.clone() else {
            return self.route(route, guard, request, client).await;
        };
        let origin = request.headers().get(http::header::ORIGIN).cloned();
        if crate::cors::is_preflight(request.method(), request.headers()) {
            return crate::cors::preflight(&cors, origin.as_ref()).map(full);
        }
        let mut response = self.route(route, guard, request, client).await;
        crate::cors::answer(&cors, origin.as_ref(), response.headers_mut());
        response
    }

    /// A request on its route: guarded, or passed.
    async fn route(
        &self,
        route: Arc<RouteState>,
        guard: Option<Arc<IdempotencyPolicy>>,
        request: Request<Incoming>,
        client: ClientInfo,
    ) -> Response<ProxyBody> {
        match guard {
            // Boxed: the guarded path's state is large, and the pass-through future
            // should not carry (and move) it.
            Some(policy) => Box::pin(self.guarded(route, policy, request, client)).await,
            None => {
                let ended = self.pass(&route, streamed(request), &client).await;
                self.finish(Some(&route), None, ended, None)
            }
        }
    }

    /// Forwards a request that needs no idempotency work, streaming both bodies.
    async fn pass(&self, route: &RouteState, mut request: Request<ProxyBody>, client: &ClientInfo) -> Handled {
        upstream::prepare_request(&mut request, &route.config.upstream, client).map_err(ProxyError::Rewrite)?;
        self.pass_prepared(route, request).await
    }

    /// `pass`, boxed: for a guarded route's request that goes through unguarded (no key
    /// on a route that does not require one, a call the route does not guard), so that
    /// the guarded path's future does not carry the pass-through's state.
    async fn pass_boxed(&self, route: &RouteState, request: Request<ProxyBody>, client: &ClientInfo) -> Handled {
        Box::pin(self.pass(route, request, client)).await
    }

    /// `pass` for a request already rewritten for the upstream.
    async fn pass_prepared(&self, route: &RouteState, request: Request<ProxyBody>) -> Handled {
        let (sent, clock, elapsed) = send(route, request, self.shared.spans).await;
        let response = sent.map_err(|error| Refusal {
            // A body the client broke while it streamed is the client's fault.
            rejection: if body::broken_by_client(&error) {
                Rejection::BodyIncomplete(error.into())
            } else {
                error.into()
            },
            upstream: Some(elapsed),
            operation: None,
        })?;
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        let body = StreamedBody::new(Vec::new(), body, clock.deadline, clock.timeout).boxed_unsync();
        Ok(Answer::forwarded(Response::from_parts(parts, body), elapsed))
    }

    /// A guarded request, in its route's mode, inside a span that names the route and
    /// the record (once its key is read); finished there too, so that its problem is
    /// logged with them.
    async fn guarded(
        &self,
        route: Arc<RouteState>,
        policy: Arc<IdempotencyPolicy>,
        request: Request<Incoming>,
        client: ClientInfo,
    ) -> Response<ProxyBody> {
        let span = match policy.mode {
            Mode::Enforce => tracing::info_span!("guarded", route = %route.name, record = tracing::field::Empty),
            Mode::Shadow => tracing::info_span!("shadow", route = %route.name, record = tracing::field::Empty),
        };
        // The request's span (`handle`'s), whose trace and id a record keeps.
        let execution = self.shared.spans.reference(&Span::current());
        async move {
            let (ended, record, call) = self.arrive(&route, &policy, request, client, execution).await;
            self.finish(Some(&route), record, ended, call.map(|id| id.text))
        }
        .instrument(span)
        .await
    }

    /// A guarded request in its span: named from its head, or on a route whose key may
    /// be in the body, from its head and its body read first; then handled in its
    /// route's mode. A request with no key on a route that does not require one is
    /// forwarded as it was sent, and so is a call a JSON-RPC or GraphQL route does not
    /// guard. Also returns the record's short hash, for the access log, and a JSON-RPC
    /// call's id, for the proxy's own errors.
    async fn arrive(
        &self,
        route: &Arc<RouteState>,
        policy: &Arc<IdempotencyPolicy>,
        request: Request<Incoming>,
        client: ClientInfo,
        execution: Option<ExecutionTrace>,
    ) -> (Handled, Option<String>, Option<CallId>) {
        let mut call = None;
        let (arrival, identified) = if policy.key_needs_body() {
            let read = match policy.mode {
                Mode::Enforce => self
                    .read_first(route, request, &client)
                    .await
                    .map_err(|rejection| Err(rejection.into())),
                Mode::Shadow => Box::pin(self.shadow_read_first(route, request, &client)).await,
            };
            let read = match read {
                Ok(read) => read,
                Err(handled) => return (handled, None, None),
            };
            match policy.calls.as_ref().map(|calls| calls::classify(calls, &read.body)) {
                None => {}
                Some(Ok(Call::Guarded { id })) => call = id,
                Some(Ok(Call::Passed)) => {
                    let request = Arrival::Read(read).into_request();
                    return (self.pass_boxed(route, request, &client).await, None, None);
                }
                Some(Err(error)) => return (Err(Rejection::from(error).into()), None, None),
            }
            let identified = self.identify(route, policy, &read.parts, Some(&read.body));
            (Arrival::Read(read), identified)
        } else {
            let (parts, body) = request.into_parts();
            let identified = self.identify(route, policy, &parts, None);
            (Arrival::Unread(Request::from_parts(parts, body)), identified)
        };
        let named = match identified {
            Ok(Some(mut named)) => {
                named.call.clone_from(&call);
                Ok(named)
            }
            Ok(None) => {
                let request = arrival.into_request();
                return (self.pass_boxed(route, request, &client).await, None, call);
            }
            Err(rejection) => Err(rejection),
        };
        let record = named.as_ref().ok().map(|named| named.record.short_hash().to_string());
        if let Some(record) = &record {
            Span::current().record("record", record.as_str());
        }
        let ended = match policy.mode {
            Mode::Enforce => self.enforce(route, policy, named, arrival, client, execution).await,
            // Boxed, as the rarer paths below are: a future carries the state of its
            // largest path, and is moved whole as it is built and boxed.
            Mode::Shadow => Box::pin(self.shadow(route, policy, named, arrival, client, execution)).await,
        };
        (ended, record.filter(|_| self.noted()), call)
    }

    /// A guarded request in enforce mode: claimed, then forwarded, replayed, refused or
    /// left to wait for the request that holds its key.
    async fn enforce(
        &self,
        route: &Arc<RouteState>,
        policy: &Arc<IdempotencyPolicy>,
        identified: Result<Named, Rejection>,
        arrival: Arrival,
        client: ClientInfo,
        execution: Option<ExecutionTrace>,
    ) -> Handled {
        // Refused at once rather than queued: nothing more is read, claimed or
        // forwarded, and the client may retry with the same key.
        let named = identified?;
        let read = match arrival {
            Arrival::Read(read) => read,
            Arrival::Unread(request) => self.read_first(route, request, &client).await?,
        };
        let guarded = self.enter(route, policy, &client, named, execution, read.share);
        let prepared = Prepared::new(&guarded, read.parts, read.body)?;
        let decision = match self.claimed(&prepared).await {
            Ok(decision) => decision,
            // A previous store that cannot be read may hold the key: never forwarded.
            Err(error) if policy.on_store_error == OnStoreError::Forward && !error.is_previous() => {
                tracing::warn!(%error, "store unavailable; forwarding unguarded (on_store_error = forward)");
                // With the key the upstream always gets on this route, so that an
                // upstream that deduplicates still can.
                let mut request = prepared.into_request();
                upstream::prepare_request(&mut request, &route.config.upstream, &client)
                    .map_err(ProxyError::Rewrite)?;
                exchange::upstream_key(request.headers_mut(), policy, &guarded.record, &guarded.key)?;
                return self.pass_prepared(route, request).await;
            }
            Err(error) => return Err(error.into()),
        };
        match decision {
            Decision::Forward(claim) => self.forward(guarded, claim, prepared).await,
            Decision::Replay(stored) => self.replay(guarded, &prepared, stored).await,
            Decision::Reject(first @ Rejection::InProgress { .. }) if !policy.wait_for_in_flight.is_zero() => {
                let span = self.shared.spans.wait();
                Box::pin(self.wait(guarded, prepared, first)).instrument(span).await
            }
            Decision::Reject(rejection) => Err(Refusal::about(rejection, &guarded.record)),
            Decision::Unknown(probe, reason) => Err(self.unknown(&guarded, probe, reason)),
        }
    }

    /// A retry of a completed record: its recorded response, or on a `replay =
    /// "refetch"` route the upstream's answer to the refetch.
    async fn replay(&self, guarded: Guarded, prepared: &Prepared, stored: StoredResponse) -> Handled {
        match guarded.policy.replay {
            ReplayKind::Refetch => self.refetch(&guarded, prepared, stored).await,
            ReplayKind::Stored | ReplayKind::Status => {
                let stored = match &guarded.call {
                    Some(id) => stored.with_call_id(&id.text),
                    None => stored,
                };
                Ok(Answer::replayed(stored, guarded.share)?)
            }
        }
    }

    /// The 409 `outcome-unknown` of a request whose record's outcome is unknown: it
    /// names the operation, and says whether the route's probe is reconciling it.
    fn unknown(&self, guarded: &Guarded, probe: crate::store::Probe, reason: crate::store::UnknownReason) -> Refusal {
        let reconciling = self.reconciling(guarded, probe);
        let reason = Some(reason.as_str());
        Refusal::about(Rejection::OutcomeUnknown { reconciling, reason }, &guarded.record)
    }

    /// The step enforce mode, shadow mode and a waiter share: claims the record, and
    /// decides what the claim's outcome means for this request.
    async fn claimed(&self, prepared: &Prepared) -> Result<Decision<OwnedClaim>, StoreError> {
        let outcome = self.shared.ledger.claim(&prepared.claim, &Span::current()).await?;
        Ok(idempotency::decide(outcome, prepared.fingerprint))
    }

    /// How every request ends: counts its outcome on its route, renders a refusal as its
    /// problem (logged at the level its fault deserves), and notes what the access log
    /// reads. `record` is the record's short hash, for the access log; `call`, a
    /// JSON-RPC call's id, which the proxy's own error on a JSON-RPC route answers.
    fn finish(
        &self,
        route: Option<&RouteState>,
        record: Option<String>,
        ended: Handled,
        call: Option<Bytes>,
    ) -> Response<ProxyBody> {
        let (mut response, outcome, upstream, execution) = match ended {
            Ok(answer) => (answer.response, answer.outcome, answer.upstream, answer.execution),
            Err(refusal) => {
                let mut problem = refusal.rejection.problem();
                problem.operation = refusal.operation;
                if let Some(route) = route {
                    let policy = route.config.idempotency.as_ref();
                    problem.docs_url = route.config.docs_url.clone();
                    problem.profile = policy.map(|policy| policy.profile).unwrap_or_default();
                    if let Some(Calls::JsonRpc { .. }) = policy.and_then(|policy| policy.calls.as_ref()) {
                        problem.jsonrpc = Some(call.unwrap_or_else(|| Bytes::from_static(b"null")));
                    }
                }
                let name = route.map_or("-", |route| &*route.name);
                let row = problem.row();
                // The status the client gets: the profile's (Stripe answers 400 where
                // the row says 422).
                let (status, slug) = (problem.profile.status(problem.kind).as_u16(), problem.kind.slug());
                let (error, cause) = (DisplayChain(&refusal.rejection), refusal.rejection.cause());
                match row.fault.level() {
                    tracing::Level::ERROR => {
                        tracing::error!(route = name, status, problem = slug, cause, %error, "problem response")
                    }
                    tracing::Level::WARN => {
                        tracing::warn!(route = name, status, problem = slug, cause, %error, "problem response")
                    }
                    _ => tracing::info!(route = name, status, problem = slug, "problem response"),
                }
                (problem.into_response().map(full), row.outcome, refusal.upstream, None)
            }
        };
        if let Some(route) = route {
            route.metrics.request(outcome);
        }
        if self.noted() {
            let route = route.map(|route| route.name.clone());
            let note = access::Note {
                outcome,
                route,
                upstream,
                record,
                execution,
            };
            response.extensions_mut().insert(note);
        }
        response
    }
}
