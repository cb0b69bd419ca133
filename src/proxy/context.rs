//! A guarded request's context and the steps that make it: the record it names
//! (`identify`), its place among the guarded requests in flight (`enter`, bounded by
//! `GuardedRequests`), and its body read and fingerprinted (`prepare`). Nothing here
//! touches the store or the upstream.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{Request, request};
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Proxy;
use crate::body::{self, ClientInfo, ProxyBody, full};
use crate::config::IdempotencyPolicy;
use crate::error::{KeyError, ProxyError, Rejection};
use crate::idempotency;
use crate::router::RouteState;
use crate::scope;
use crate::store::{ClaimRequest, Fingerprint, OwnerToken, ScopeId, StoreKey};

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
    pub(super) fn try_enter(&self) -> Result<OwnedSemaphorePermit, Rejection> {
        self.permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| Rejection::Overloaded(self.max))
    }

    /// The guarded requests in flight now.
    pub(crate) fn in_flight(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}

/// A guarded request's context, shared by its steps: its route and policy, the client,
/// the record it names, and its place among the guarded requests in flight (given back
/// when the context is dropped: once its bodies are recorded or handed on).
pub(super) struct Guarded {
    pub(super) route: Arc<RouteState>,
    pub(super) policy: Arc<IdempotencyPolicy>,
    pub(super) client: ClientInfo,
    pub(super) record: StoreKey,
    pub(super) scope: Option<ScopeId>,
    _permit: OwnedSemaphorePermit,
}

/// The record a guarded request names, and the client (route and scope) it is
/// counted against.
pub(super) struct Named {
    pub(super) record: StoreKey,
    pub(super) scope: Option<ScopeId>,
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
    ) -> Result<Guarded, Rejection> {
        Ok(Guarded {
            _permit: self.shared.guarded.try_enter()?,
            route: route.clone(),
            policy: policy.clone(),
            client: client.clone(),
            record: named.record,
            scope: named.scope,
        })
    }

    /// Reads the body within its limits and works out what the claim asks for.
    pub(super) async fn prepare(&self, guarded: &Guarded, request: Request<Incoming>) -> Result<Prepared, Rejection> {
        let (parts, body) = request.into_parts();
        let limits = guarded.route.body;
        let body = body::read_request_body(body, &parts.headers, limits.max_bytes, limits.timeout).await?;
        Prepared::new(guarded, parts, body)
    }
}
