//! A guarded request's context and the steps that make it: the record it names
//! (`identify`), its place among the guarded requests in flight (`enter`, bounded by
//! `GuardedRequests`), and its body read and fingerprinted (`prepare`). Nothing here
//! touches the store or the upstream.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::Bytes;
use http::{Request, request};
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Proxy;
use crate::body::{self, ClientInfo, ProxyBody, full};
use crate::config::IdempotencyPolicy;
use crate::error::{Bound, KeyError, ProxyError, Rejection};
use crate::idempotency::{self, IdempotencyKey};
use crate::metrics::Metrics;
use crate::record::ExecutionTrace;
use crate::router::RouteState;
use crate::scope;
use crate::store::{ClaimRequest, Fingerprint, OwnerToken, ScopeId, StoreKey};

/// What bounds the guarded requests in flight, process-wide (the workers share it):
/// their number (`max_guarded_requests`), and the bytes their bodies hold while they
/// are buffered (`max_buffered_bytes`): a request body as it is read (by its
/// `Content-Length` up front when it has one, chunk by chunk when it has not), a
/// response as it is read for recording. Request bodies may take three quarters of the
/// budget; the last quarter is kept for the responses of requests already forwarded,
/// which cannot be refused any more.
#[derive(Clone, Debug)]
pub(crate) struct GuardedRequests {
    permits: Arc<Semaphore>,
    max: usize,
    budget: Arc<Budget>,
}

#[derive(Debug)]
struct Budget {
    held: AtomicU64,
    max: u64,
}

impl Budget {
    /// Takes `bytes` if what is held stays at most `cap`.
    fn take(&self, bytes: u64, cap: u64) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= cap)
            })
            .is_ok()
    }
}

impl GuardedRequests {
    pub(crate) fn new(max: usize, max_bytes: u64) -> GuardedRequests {
        GuardedRequests {
            permits: Arc::new(Semaphore::new(max)),
            max,
            budget: Arc::new(Budget {
                held: AtomicU64::new(0),
                max: max_bytes,
            }),
        }
    }

    /// A share for one more guarded request, unless `max` are in flight.
    pub(super) fn try_enter(&self) -> Result<Share, Rejection> {
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| Rejection::Overloaded(Bound::Requests(self.max)))?;
        Ok(Share {
            _permit: permit,
            budget: self.budget.clone(),
            bytes: 0,
        })
    }

    /// Reports the guarded requests in flight now, the bytes their bodies hold, and the
    /// bounds on both, in `metrics`.
    pub(crate) fn report(&self, metrics: &Metrics) {
        let in_flight = self.max - self.permits.available_permits();
        let held = self.budget.held.load(Ordering::Acquire);
        metrics.guarded(in_flight, self.max, held, self.budget.max);
    }
}

/// One guarded request's place among those in flight, and the bytes of the budget it
/// holds: all given back when it is dropped, once its bodies are recorded or handed on.
#[derive(Debug)]
pub(super) struct Share {
    _permit: OwnedSemaphorePermit,
    budget: Arc<Budget>,
    bytes: u64,
}

impl Share {
    /// Takes `bytes` for the request body, unless request bodies would hold more than
    /// their three quarters of the budget.
    pub(super) fn take_for_request(&mut self, bytes: u64) -> bool {
        let cap = self.budget.max / 4 * 3;
        self.take(bytes, cap)
    }

    /// Takes `bytes` for a response buffered for recording, unless the budget is spent.
    pub(super) fn take_for_response(&mut self, bytes: u64) -> bool {
        let cap = self.budget.max;
        self.take(bytes, cap)
    }

    fn take(&mut self, bytes: u64, cap: u64) -> bool {
        let taken = self.budget.take(bytes, cap);
        if taken {
            self.bytes += bytes;
        }
        taken
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A guarded request's context, shared by its steps: its route and policy, the client,
/// the record it names, and its share of the bounds on guarded requests (given back
/// when the context is dropped: once its bodies are recorded or handed on).
pub(super) struct Guarded {
    pub(super) route: Arc<RouteState>,
    pub(super) policy: Arc<IdempotencyPolicy>,
    pub(super) client: ClientInfo,
    pub(super) record: StoreKey,
    pub(super) scope: Option<ScopeId>,
    /// The client's key: what a probe's `{key}` is, with `upstream_key = "client"`.
    pub(super) key: IdempotencyKey,
    pub(super) share: Share,
    /// The trace of this request's span, which the record keeps, with tracing on.
    pub(super) execution: Option<ExecutionTrace>,
}

/// The record a guarded request names, and the client (route and scope) it is
/// counted against.
pub(super) struct Named {
    pub(super) record: StoreKey,
    pub(super) scope: Option<ScopeId>,
    pub(super) key: IdempotencyKey,
}

/// A guarded request, read and fingerprinted, and the claim it asks for.
pub(super) struct Prepared {
    parts: request::Parts,
    body: Bytes,
    pub(super) fingerprint: Fingerprint,
    pub(super) claim: ClaimRequest,
}

impl Prepared {
    /// Fingerprints the request read into `parts` and `body`, and names its claim.
    pub(super) fn new(guarded: &Guarded, parts: request::Parts, body: Bytes) -> Result<Prepared, Rejection> {
        let policy = &guarded.policy;
        let fingerprint = idempotency::fingerprint(
            &parts.method,
            &parts.uri,
            &parts.headers,
            &policy.fingerprint_headers,
            &policy.fingerprint_body,
            &body,
        );
        let claim = ClaimRequest {
            key: guarded.record.clone(),
            scope: guarded.scope,
            owner: OwnerToken::generate().map_err(|_| ProxyError::Random)?,
            fingerprint,
            retention: policy.retention,
            lease: guarded.route.route.lease(),
        };
        Ok(Prepared {
            parts,
            body,
            fingerprint,
            claim,
        })
    }

    /// The request again, its body whole, to forward.
    pub(super) fn into_request(self) -> Request<ProxyBody> {
        Request::from_parts(self.parts, full(self.body))
    }
}

impl Proxy {
    /// The record a guarded request names: its key, within its scope (the
    /// `scope_headers` and the verified `scope_jwt` claim).
    pub(super) fn identify(
        &self,
        route: &RouteState,
        policy: &IdempotencyPolicy,
        headers: &http::HeaderMap,
    ) -> Result<Named, Rejection> {
        let key = idempotency::parse_key(headers.get_all(&policy.header))?.ok_or(KeyError::Missing)?;
        let claim = match &policy.scope_jwt {
            None => None,
            Some(verifier) => Some(verifier.verify(headers, SystemTime::now())?),
        };
        let scope = scope::values(headers, &policy.scope_headers, claim.as_ref());
        Ok(Named {
            record: idempotency::store_key(&self.shared.key_prefix, &route.name, &scope, &key),
            scope: idempotency::scope_id(&route.name, &scope),
            key,
        })
    }

    /// The context of a guarded request that names `record`, once it has its place
    /// among the guarded requests in flight.
    pub(super) fn enter(
        &self,
        route: &Arc<RouteState>,
        policy: &Arc<IdempotencyPolicy>,
        client: &ClientInfo,
        named: Named,
        execution: Option<ExecutionTrace>,
    ) -> Result<Guarded, Rejection> {
        Ok(Guarded {
            share: self.shared.guarded.try_enter()?,
            route: route.clone(),
            policy: policy.clone(),
            client: client.clone(),
            record: named.record,
            scope: named.scope,
            key: named.key,
            execution,
        })
    }

    /// Reads the body within its limits and its share of the byte budget, and works
    /// out what the claim asks for.
    pub(super) async fn prepare(
        &self,
        guarded: &mut Guarded,
        request: Request<Incoming>,
    ) -> Result<Prepared, Rejection> {
        let (parts, body) = request.into_parts();
        let limits = guarded.route.body;
        let share = &mut guarded.share;
        let body = body::read_request_body(body, &parts.headers, limits.max_bytes, limits.timeout, |bytes| {
            share.take_for_request(bytes)
        })
        .await?;
        Prepared::new(guarded, parts, body)
    }
}
