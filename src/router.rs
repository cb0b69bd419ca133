//! Routing: picks the route for a request by its Host and the longest matching path
//! prefix, and hands back the route as the request path uses it (its config, its
//! parsed upstream and its metric handles), so nothing is looked up by name. Pure: the
//! router does no I/O and never looks at the body.

use std::sync::Arc;

use http::Method;

use crate::body::BodyLimits;
use crate::config::{PathPolicy, Route};
use crate::metrics::{Metrics, RouteMetrics};
use crate::upstream::HttpClient;

/// A configured route with everything a request on it needs, made once per config.
#[derive(Clone)]
pub(crate) struct RouteState {
    /// The route as configured.
    pub(crate) config: Route,
    /// The route's name, shared with what a request notes for the access log.
    pub(crate) name: Arc<str>,
    pub(crate) metrics: RouteMetrics,
    /// The client its upstream is reached with (its own when it has extra roots).
    pub(crate) client: HttpClient,
    /// The server's bounds on reading a guarded request's body.
    pub(crate) body: BodyLimits,
    /// The permits of the route's probes in this process (its `max_concurrent`),
    /// shared by every worker: for a route with a probe.
    pub(crate) probes: Option<Arc<crate::bounds::ProbeLimit>>,
}

impl RouteState {
    pub(crate) fn new(
        route: &Route,
        metrics: &Metrics,
        client: HttpClient,
        body: BodyLimits,
        probes: Option<Arc<crate::bounds::ProbeLimit>>,
    ) -> RouteState {
        RouteState {
            config: route.clone(),
            name: Arc::from(route.name.as_str()),
            metrics: metrics.route(&route.name, route.shadow(), route.reconcile().is_some()),
            client,
            body,
            probes,
        }
    }
}

#[derive(Clone)]
pub(crate) struct Router {
    /// Sorted so that the first match is the best one: host-specific routes first,
    /// then longer prefixes first.
    routes: Arc<[Arc<RouteState>]>,
    /// How request paths are made canonical before they are matched.
    pub(crate) paths: PathPolicy,
    /// Every method some route guards.
    pub(crate) guarded_methods: Vec<Method>,
    /// `server.contract_path`: where the proxy answers with its published contract.
    pub(crate) contract_path: Option<String>,
}

impl Router {
    pub(crate) fn new(routes: Vec<RouteState>, paths: PathPolicy, contract_path: Option<String>) -> Router {
        let mut routes: Vec<Arc<RouteState>> = routes.into_iter().map(Arc::new).collect();
        routes.sort_by(|a, b| {
            let (a, b) = (&a.config, &b.config);
            b.host
                .is_some()
                .cmp(&a.host.is_some())
                .then(b.path_prefix.len().cmp(&a.path_prefix.len()))
        });
        let mut guarded_methods: Vec<Method> = Vec::new();
        for policy in routes.iter().filter_map(|state| state.config.idempotency.as_ref()) {
            for method in &policy.methods {
                if !guarded_methods.contains(method) {
                    guarded_methods.push(method.clone());
                }
            }
        }
        Router {
            routes: routes.into(),
            paths,
            guarded_methods,
            contract_path,
        }
    }

    /// The route called `name`.
    pub(crate) fn named(&self, name: &str) -> Option<&Arc<RouteState>> {
        self.routes.iter().find(|state| &*state.name == name)
    }

    /// Every route's config, best match first.
    pub(crate) fn configs(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter().map(|state| &state.config)
    }

    /// The route for `host` (without port, any case) and `path`, if one matches.
    ///
    /// A prefix matches at a segment boundary: `/v1/pay` matches `/v1/pay`,
    /// `/v1/pay/x` and `/v1/pay;x`, but not `/v1/payments`, unless the prefix itself
    /// ends in `/`.
    pub(crate) fn route(&self, host: Option<&str>, path: &str) -> Option<&Arc<RouteState>> {
        self.find(host, path, false)
    }

    /// The guarded route whose prefix `path` matches only when letter case is ignored
    /// (`/V1/Payments` for `/v1/payments`), if the route `path` matches is another:
    /// a spelling that an upstream which ignores case (Express, ASP.NET) runs as the
    /// guarded route.
    pub(crate) fn case_variant(&self, host: Option<&str>, path: &str, exact: &RouteState) -> Option<&Arc<RouteState>> {
        let loose = self.find(host, path, true)?;
        (loose.name != exact.name && loose.config.idempotency.is_some()).then_some(loose)
    }

    fn find(&self, host: Option<&str>, path: &str, ignore_case: bool) -> Option<&Arc<RouteState>> {
        self.routes.iter().find(|state| {
            let route = &state.config;
            let host_ok = match (&route.host, host) {
                (None, _) => true,
                (Some(want), Some(have)) => want.eq_ignore_ascii_case(have),
                (Some(_), None) => false,
            };
            host_ok && prefix_matches(&route.path_prefix, path, ignore_case)
        })
    }
}

/// Whether `path` starts with `prefix` at a segment boundary (`/`, `;` or the end),
/// or anywhere when the prefix ends in `/`.
fn prefix_matches(prefix: &str, path: &str, ignore_case: bool) -> bool {
    let Some(head) = path.get(..prefix.len()) else {
        return false;
    };
    let same = if ignore_case {
        head.eq_ignore_ascii_case(prefix)
    } else {
        head == prefix
    };
    let rest = &path[prefix.len()..];
    same && (prefix.ends_with('/') || rest.is_empty() || rest.starts_with(['/', ';', '?']))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Upstream;
    use crate::metrics::Metrics;
    use std::time::Duration;

    fn route(name: &str, prefix: &str, host: Option<&str>) -> Route {
        Route {
            name: name.into(),
            path_prefix: prefix.into(),
            host: host.map(Into::into),
            upstream: Upstream::try_from("http://127.0.0.1:9".parse::<http::Uri>().expect("uri")).expect("target"),
            upstream_timeout: Duration::from_secs(1),
            upstream_tls: None,
            docs_url: None,
            idempotency: None,
            cors: None,
        }
    }

    fn router(routes: &[Route]) -> Router {
        let metrics = Metrics::new();
        let client = crate::upstream::client(None).expect("client");
        Router::new(
            routes
                .iter()
                .map(|route| {
                    let body = BodyLimits {
                        max_bytes: 1024,
                        timeout: Duration::from_secs(1),
                        idle: Duration::from_secs(1),
                    };
                    RouteState::new(route, &metrics, client.clone(), body, None)
                })
                .collect(),
            PathPolicy::default(),
            None,
        )
    }

    #[test]
    fn longest_prefix_wins_and_host_routes_come_first() {
        let router = router(&[
            route("root", "/", None),
            route("v1", "/v1", None),
            route("payments", "/v1/payments", None),
            route("api-host", "/v1", Some("api.example.com")),
        ]);
        let name = |host, path| router.route(host, path).map(|r| r.name.to_string());
        assert_eq!(name(None, "/v1/payments/42").as_deref(), Some("payments"));
        assert_eq!(name(None, "/v1/paymentsx").as_deref(), Some("v1"));
        assert_eq!(name(None, "/v1").as_deref(), Some("v1"));
        assert_eq!(name(None, "/other").as_deref(), Some("root"));
        assert_eq!(
            name(Some("API.example.com"), "/v1/payments").as_deref(),
            Some("api-host")
        );
    }

    #[test]
    fn no_match_is_none() {
        let router = router(&[route("v1", "/v1", None)]);
        assert!(router.route(None, "/v2").is_none());
        assert!(router.route(None, "/v10").is_none());
    }
}
