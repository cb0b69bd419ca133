//! The admin listener's service: liveness, readiness (the store answers a ping within
//! its timeout), Prometheus metrics, and, with a token, the records API.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use arc_swap::ArcSwap;

use crate::body::{self, ProxyBody, full};
use crate::bounds::GuardedRequests;
use crate::config::Config;
use crate::error::DisplayChain;
use crate::error::StoreError;
use crate::metrics::{Metrics, StoreOp};
use crate::store::{AnyStore, RecordStore};

mod records;

#[derive(Clone)]
pub(crate) struct Admin {
    store: AnyStore,
    metrics: Arc<Metrics>,
    /// The configuration served now: the records API reads routes and token from it.
    live: Arc<ArcSwap<Config>>,
    guarded: GuardedRequests,
    /// What the last `/readyz` found: `UNKNOWN` before the first.
    ready: Arc<AtomicU8>,
}

/// What a resolution's JSON may hold beyond its response body's base64.
const RESOLUTION_OVERHEAD: u64 = 64 * 1024;
/// How long the records API waits for a request's body.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

const UNKNOWN: u8 = 0;
const READY: u8 = 1;
const UNREADY: u8 = 2;

impl Admin {
    pub(crate) fn new(
        store: AnyStore,
        metrics: Arc<Metrics>,
        live: Arc<ArcSwap<Config>>,
        guarded: GuardedRequests,
    ) -> Admin {
        Admin {
            store,
            metrics,
            live,
            guarded,
            ready: Arc::new(AtomicU8::new(UNKNOWN)),
        }
    }

    /// Logs readiness when it changes, with the reason it was lost: one line per
    /// change, however often the probe asks.
    fn readiness_changed(&self, ping: &Result<(), StoreError>) {
        let state = if ping.is_ok() { READY } else { UNREADY };
        if self.ready.swap(state, Ordering::Relaxed) == state {
            return;
        }
        match ping {
            Ok(()) => tracing::info!("ready: the store serves"),
            Err(error) => tracing::warn!(error = %DisplayChain(error), "not ready: the store cannot serve"),
        }
    }

    pub(crate) async fn handle(&self, request: Request<Incoming>) -> Response<ProxyBody> {
        if request.uri().path().starts_with("/records/") {
            let config = self.live.load_full();
            let (parts, body) = request.into_parts();
            // The token first: nothing of an unauthenticated request's body is read.
            match records::door(&config, parts.uri.path(), &parts.headers) {
                None => return text(StatusCode::NOT_FOUND, "not found\n"),
                Some(Err(refused)) => return refused,
                Some(Ok(())) => {}
            }
            // A resolution's response, base64 in JSON: at most the largest a route
            // records, and some room around it.
            let limit = config
                .routes
                .iter()
                .filter_map(|route| route.idempotency.as_ref())
                .map(|policy| policy.max_response_body_bytes)
                .max()
                .unwrap_or(0)
                .saturating_mul(4)
                / 3
                + RESOLUTION_OVERHEAD;
            let limits = body::BodyLimits {
                max_bytes: limit,
                timeout: BODY_TIMEOUT,
                idle: BODY_TIMEOUT,
            };
            let body = match body::read_request_body(body, &parts.headers, limits, None, |_| true).await {
                Ok(body) => body,
                Err(rejection) => {
                    let problem = rejection.problem();
                    return records::error(problem.row().status, &problem.detail);
                }
            };
            let answer = records::handle(
                &config,
                &self.store,
                &parts.method,
                parts.uri.path(),
                parts.uri.query(),
                &parts.headers,
                &body,
            )
            .await;
            return answer.unwrap_or_else(|| text(StatusCode::NOT_FOUND, "not found\n"));
        }
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        }
        match request.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => {
                let started = tokio::time::Instant::now();
                // Bounded by `store.timeout`: every store operation is.
                let ping = self.store.ping().await;
                let ok = ping.is_ok();
                self.metrics.store_op(StoreOp::Ping, ok, started.elapsed());
                if let Err(error) = &ping {
                    self.metrics.store_error(StoreOp::Ping, error.cause());
                }
                self.readiness_changed(&ping);
                if ok {
                    text(StatusCode::OK, "ready\n")
                } else {
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                }
            }
            "/metrics" => {
                self.guarded.report(&self.metrics);
                if let Some(usage) = self.store.usage_off_runtime().await {
                    self.metrics.embedded_store(usage);
                }
                let mut response = text(StatusCode::OK, "");
                *response.body_mut() = full(self.metrics.encode());
                response.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                response
            }
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
