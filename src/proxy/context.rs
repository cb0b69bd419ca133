//! A guarded request's context and the steps that make it: the record it names
//! (`identify`), its place among the guarded requests in flight (`enter`, bounded by
//! `bounds::GuardedRequests`), and its body read and fingerprinted (`prepare`).
//! Nothing here touches the store or the upstream.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{Request, request};
use hyper::body::Incoming;

use super::Proxy;
use crate::body::{self, ClientInfo, ProxyBody, full};
use crate::bounds::Share;
use crate::config::{IdempotencyPolicy, UpstreamKey};
use crate::error::{KeyError, ProxyError, Rejection};
use crate::idempotency::{self, IdempotencyKey};
use crate::record::ExecutionTrace;
use crate::router::RouteState;
use crate::scope;
use crate::store::{ClaimRequest, Fingerprint, OwnerToken, ScopeId, StoreKey};

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

impl Guarded {
    /// The key as the upstream is sent it: what a probe's or a refetch's `{key}` is.
    pub(super) fn upstream_key(&self) -> String {
        match self.policy.upstream_key {
            UpstreamKey::Client => self.key.as_str().to_string(),
            UpstreamKey::Derived => self.record.operation_id(),
            // The config refuses `{key}` in a path with no key sent upstream.
            UpstreamKey::None => String::new(),
        }
    }
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
            client: Some(idempotency::client_id(guarded.client.addr)),
            owner: OwnerToken::generate().map_err(|_| ProxyError::Random)?,
            fingerprint,
            retention: policy.retention,
            lease: guarded.route.config.lease(),
            // Only a key the probe cannot derive from the record is kept with it.
            probe_key: guarded
                .route
                .config
                .reconcile()
                .filter(|reconcile| reconcile.path.names_key() && policy.upstream_key == UpstreamKey::Client)
                .map(|_| guarded.key.as_str().to_string()),
        };
        Ok(Prepared {
            parts,
            body,
            fingerprint,
            claim,
        })
    }

    /// The request's head: a refetch sends its headers.
    pub(super) fn head(&self) -> &request::Parts {
        &self.parts
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
        if route
            .config
            .reconcile()
            .is_some_and(|reconcile| reconcile.path.names_key())
            && policy.upstream_key == UpstreamKey::Client
            && key.as_str().bytes().all(|byte| byte == b'.')
        {
            return Err(KeyError::OnlyDots.into());
        }
        let scope_claim = match &policy.scope_jwt {
            None => None,
            Some(verifier) => Some(verifier.verify(headers, SystemTime::now())?),
        };
        let scope = scope::values(headers, &policy.scope_headers, scope_claim.as_ref());
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
        let (limits, allowance) = (guarded.route.body, guarded.client.allowance.clone());
        let share = &mut guarded.share;
        let body = body::read_request_body(body, &parts.headers, limits, Some(&allowance), |bytes| {
            share.take_for_request(bytes)
        })
        .await?;
        Prepared::new(guarded, parts, body)
    }
}
