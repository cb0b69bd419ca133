//! A guarded request's context and the steps that make it: the record it names
//! (`identify`), its place among the guarded requests in flight (`enter`, bounded by
//! `bounds::GuardedRequests`), and its body read and fingerprinted (`prepare`).
//! Nothing here touches the store or the upstream.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, request};
use hyper::body::Incoming;

use super::Proxy;
use crate::body::{self, ClientInfo, ProxyBody, full};
use crate::bounds::Share;
use crate::calls::CallId;
use crate::config::{FingerprintBody, IdempotencyPolicy, ReplayKind, UpstreamKey};
use crate::error::{KeyError, ProxyError, Rejection};
use crate::idempotency::source::{self, KeyInput, Keyed};
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
    /// With the `body` source, the request's fingerprint, which is its key: a replay
    /// is then a deduplicated request.
    pub(super) by_body: Option<Fingerprint>,
    pub(super) share: Share,
    /// The trace of this request's span, which the record keeps, with tracing on.
    pub(super) execution: Option<ExecutionTrace>,
    /// On a JSON-RPC route, the call's id as it was sent: what its replay answers with.
    pub(super) call: Option<CallId>,
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

    /// How long its response is kept and replayed: the route's `retention`, or its
    /// `dedup_window` for a key made from the request itself; on a `replay =
    /// "refetch"` route, which keeps no body, the whole of `remember`.
    pub(super) fn retention(&self) -> Duration {
        match self.by_body {
            Some(_) => self.policy.dedup_window.unwrap_or(self.policy.retention),
            None if self.policy.replay == ReplayKind::Refetch => self.policy.remember,
            None => self.policy.retention,
        }
    }

    /// How long its key is known (docs/design.md §24): the route's `remember`; a key
    /// made from the request itself lives its `dedup_window`, whole (two identical
    /// requests after it are two operations, never a 410).
    pub(super) fn remember(&self) -> Duration {
        match self.by_body {
            Some(_) => self.retention(),
            None => self.policy.remember.max(self.retention()),
        }
    }
}

/// The record a guarded request names, and the client (route and scope) it is
/// counted against.
pub(super) struct Named {
    pub(super) record: StoreKey,
    pub(super) scope: Option<ScopeId>,
    pub(super) key: IdempotencyKey,
    /// With the `body` source, the request's fingerprint, which is its key.
    pub(super) by_body: Option<Fingerprint>,
    /// On a JSON-RPC route, the call's id as it was sent.
    pub(super) call: Option<CallId>,
}

/// A guarded request as it arrived: its body unread (a route whose key sources are all
/// in the head), or read first, within its share of the bounds, because the key may
/// be in it.
pub(super) enum Arrival {
    Unread(Request<Incoming>),
    Read(Read),
}

/// A guarded request read whole, and its share of the bounds, which holds its body.
pub(super) struct Read {
    pub(super) parts: request::Parts,
    pub(super) body: Bytes,
    pub(super) share: Share,
}

impl Arrival {
    /// The request again, to forward as it was sent: its body streamed, or whole.
    pub(super) fn into_request(self) -> Request<ProxyBody> {
        match self {
            Arrival::Unread(request) => body::streamed(request),
            Arrival::Read(read) => Request::from_parts(read.parts, full(read.body)),
        }
    }
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
        // A JSON-RPC call is fingerprinted without its id: a retry carries its own.
        let without_id = match (&guarded.call, &policy.fingerprint_body) {
            (Some(id), FingerprintBody::Bytes) => Some(id.without(&body)),
            _ => None,
        };
        // A key made from the request itself was its fingerprint already.
        let fingerprint = guarded.by_body.unwrap_or_else(|| {
            idempotency::fingerprint(
                &parts.method,
                &parts.uri,
                &parts.headers,
                &policy.fingerprint_headers,
                &policy.fingerprint_body,
                without_id.as_deref().unwrap_or(&body),
            )
        });
        let claim = ClaimRequest {
            key: guarded.record.clone(),
            scope: guarded.scope,
            client: Some(idempotency::client_id(guarded.client.addr)),
            owner: OwnerToken::generate().map_err(|_| ProxyError::Random)?,
            fingerprint,
            retention: guarded.retention(),
            remember: guarded.remember(),
            lease: guarded.route.config.lease(),
            response_limit: usize::try_from(policy.max_response_body_bytes).unwrap_or(usize::MAX),
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
    /// The record a guarded request names: its key from the route's sources, within
    /// its scope (the `scope_headers` and the verified `scope_jwt` claim). `body` is
    /// the body, read first on a route whose key may be in it. `Ok(None)`: no key, on a
    /// route that does not require one.
    pub(super) fn identify(
        &self,
        route: &RouteState,
        policy: &IdempotencyPolicy,
        head: &request::Parts,
        body: Option<&[u8]>,
    ) -> Result<Option<Named>, Rejection> {
        let headers = &head.headers;
        let input = KeyInput {
            headers,
            query: head.uri.query(),
            body,
        };
        let (key, by_body) = match source::find_key(&policy.key, &input)? {
            Some(Keyed::Key(key)) => (key, None),
            Some(Keyed::Body) => {
                let fingerprint = idempotency::fingerprint(
                    &head.method,
                    &head.uri,
                    headers,
                    &policy.fingerprint_headers,
                    &policy.fingerprint_body,
                    body.unwrap_or_default(),
                );
                (source::body_key(fingerprint), Some(fingerprint))
            }
            None if policy.required => return Err(source::missing(&policy.key)),
            None => return Ok(None),
        };
        if policy.upstream_key == UpstreamKey::Client && policy.key_in_path() && key.has_dot_segment() {
            return Err(KeyError::DotSegment.into());
        }
        let scope_claim = match &policy.scope_jwt {
            None => None,
            Some(verifier) => Some(verifier.verify(headers, SystemTime::now())?),
        };
        let scope = scope::values(headers, &policy.scope_headers, scope_claim.as_ref());
        Ok(Some(Named {
            record: idempotency::store_key(&self.shared.key_prefix, &route.name, &scope, &key),
            scope: idempotency::scope_id(&route.name, &scope),
            key,
            by_body,
            call: None,
        }))
    }

    /// The context of a guarded request that names `record`, with the share of the
    /// bounds its body was read in.
    pub(super) fn enter(
        &self,
        route: &Arc<RouteState>,
        policy: &Arc<IdempotencyPolicy>,
        client: &ClientInfo,
        named: Named,
        execution: Option<ExecutionTrace>,
        share: Share,
    ) -> Guarded {
        Guarded {
            share,
            route: route.clone(),
            policy: policy.clone(),
            client: client.clone(),
            record: named.record,
            scope: named.scope,
            key: named.key,
            by_body: named.by_body,
            execution,
            call: named.call,
        }
    }

    /// A guarded request's place among the guarded requests in flight, then its body
    /// read within its limits and that share of the byte budget: before its key is
    /// looked for on a route whose key may be in the body, else once it is named.
    pub(super) async fn read_first(
        &self,
        route: &RouteState,
        request: Request<Incoming>,
        client: &ClientInfo,
    ) -> Result<Read, Rejection> {
        let mut share = self.shared.guarded.try_enter()?;
        let (parts, body) = request.into_parts();
        let body = body::read_request_body(body, &parts.headers, route.body, Some(&client.allowance), |bytes| {
            share.take_for_request(bytes)
        })
        .await?;
        Ok(Read { parts, body, share })
    }
}
