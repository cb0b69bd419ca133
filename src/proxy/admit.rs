//! Admission: a request made into the one the guard decides on and the upstream gets
//! (`target`: its path canonical and in origin form, its one validated authority its
//! only `Host`), routed, and given the policy that guards it, if any. A spelling that
//! would let a guarded request pass unguarded (a method that differs from one some
//! route guards only in letter case, or a path that differs from a guarded route's
//! only in letter case) is refused here, before anything is read.

use std::borrow::Cow;
use std::sync::Arc;

use http::{Request, header};
use hyper::body::Incoming;

use super::Proxy;
use crate::config::{IdempotencyPolicy, KeySource};
use crate::error::{ProxyError, Rejection};
use crate::request_target::{self, RequestTargetError};
use crate::router::{RouteState, Router};

/// A request admitted: as forwarded, its route, and the policy that guards it.
pub(super) struct Admitted {
    pub(super) request: Request<Incoming>,
    pub(super) route: Arc<RouteState>,
    pub(super) guard: Option<Arc<IdempotencyPolicy>>,
}

/// What admission makes of a request: one for a route, or one for the published
/// contract, answered by the proxy itself and never forwarded.
pub(super) enum Admission {
    Route(Admitted),
    Contract {
        request: Request<Incoming>,
        /// The request's host, without its port.
        host: Option<String>,
    },
}

/// Why a request is not admitted, and the route it matched, when it got that far.
pub(super) struct NotAdmitted {
    pub(super) route: Option<Arc<RouteState>>,
    pub(super) rejection: Rejection,
}

impl From<Rejection> for NotAdmitted {
    fn from(rejection: Rejection) -> NotAdmitted {
        NotAdmitted { route: None, rejection }
    }
}

impl From<RequestTargetError> for NotAdmitted {
    fn from(error: RequestTargetError) -> NotAdmitted {
        Rejection::from(error).into()
    }
}

impl Proxy {
    pub(super) fn admit(&self, mut request: Request<Incoming>) -> Result<Admission, NotAdmitted> {
        let router = self.shared.router.load();
        let authority = request_target::authority(request.version(), request.uri(), request.headers())?;
        if let Cow::Owned(path) = request_target::canonical_path(request.uri().path(), &router.paths)? {
            let uri = request_target::with_path(request.uri(), &path)
                .map_err(|error| Rejection::from(ProxyError::Rewrite(error)))?;
            *request.uri_mut() = uri;
        }
        if let Some(authority) = &authority
            && request.headers().get(header::HOST) != Some(authority)
        {
            request.headers_mut().insert(header::HOST, authority.clone());
        }
        let host = authority
            .as_ref()
            .and_then(|host| host.to_str().ok())
            .map(request_target::host_of);
        let path = request.uri().path();
        // Matched on the canonical path, so no other spelling of it is forwarded.
        if router.contract_path.as_deref() == Some(path) {
            let host = host.map(str::to_string);
            return Ok(Admission::Contract { request, host });
        }
        let route = router.route(host, path).cloned().ok_or(Rejection::NoRoute)?;
        let refused = |route: &Arc<RouteState>, error: RequestTargetError| NotAdmitted {
            route: Some(route.clone()),
            rejection: error.into(),
        };
        let method = request.method();
        if method.as_str().bytes().any(|byte| byte.is_ascii_lowercase())
            && router
                .guarded_methods
                .iter()
                .any(|guarded| guarded.as_str().eq_ignore_ascii_case(method.as_str()))
        {
            return Err(refused(&route, RequestTargetError::MethodCase));
        }
        let guard = guard(&route, &request);
        if guard.is_none() && case_variant_guards(&router, host, &request, &route) {
            return Err(refused(&route, RequestTargetError::CaseVariant));
        }
        Ok(Admission::Route(Admitted { request, route, guard }))
    }
}

/// The route's policy, when it guards `request`: its method is guarded, and it may
/// carry a key or the route requires one (a keyless request on a `required = false`
/// route passes unguarded; one whose key may be in its body or query is looked at).
fn guard(route: &RouteState, request: &Request<Incoming>) -> Option<Arc<IdempotencyPolicy>> {
    let policy = route.config.idempotency.as_ref()?;
    let guarded = policy.methods.contains(request.method()) && (policy.required || may_carry_key(policy, request));
    guarded.then(|| policy.clone())
}

/// Whether `request` may carry a key from one of the route's sources: one of its
/// headers is present, it has a query, or a source is in the body.
fn may_carry_key(policy: &IdempotencyPolicy, request: &Request<Incoming>) -> bool {
    policy.key.iter().any(|source| match source {
        KeySource::Header(name) => request.headers().contains_key(name),
        KeySource::Query(_) => request.uri().query().is_some(),
        KeySource::Json(_) | KeySource::Form(_) | KeySource::Body => true,
    })
}

/// Whether a route other than `route` would guard `request` if its path's letter case
/// were ignored. Only asked for a method some route guards.
fn case_variant_guards(router: &Router, host: Option<&str>, request: &Request<Incoming>, route: &RouteState) -> bool {
    if !router.guarded_methods.contains(request.method()) {
        return false;
    }
    router
        .case_variant(host, request.uri().path(), route)
        .is_some_and(|variant| guard(variant, request).is_some())
}
