//! `[route.cors]` (docs/design.md §29): a browser sends `Idempotency-Key` to another
//! origin only after a preflight that allows it, and reads `Idempotent-Replayed` only
//! when it is exposed. The proxy answers the preflights of a route with `[route.cors]`
//! itself, and owns the route's CORS fields: the upstream's own are dropped from every
//! answer (a second `Access-Control-Allow-Origin` makes a browser refuse the answer, and
//! a recorded one would be replayed to another origin). An origin not listed gets no
//! CORS field at all. Written here rather than taken from tower-http's `CorsLayer`: the
//! proxy is a hyper service with its routes inside it, not a tower stack, and the
//! allowed headers depend on each route's key and scope headers.

use bytes::Bytes;
use http::header::{
    ACCESS_CONTROL_ALLOW_CREDENTIALS, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_METHOD,
    ORIGIN, VARY,
};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};

use crate::config::Cors;

/// What a script on an allowed origin may read of an answer besides the safelisted
/// fields: whether it is a replay, when its record's key is forgotten, whether an
/// operator or a probe reconciled it, and when to retry a 409 or a 503.
const EXPOSED: &str = "Idempotent-Replayed, Idempotency-Expires, Idempotency-Reconciled, Retry-After";

/// Whether `origin` is one a browser sends: `scheme://host` or `scheme://host:port`,
/// lower case, with no path, and no `/` at its end.
pub(crate) fn check_origin(origin: &str) -> Result<(), String> {
    let bad = || format!("{origin:?} is not an origin: write scheme://host or scheme://host:port, in lower case");
    let (scheme, rest) = origin.split_once("://").ok_or_else(bad)?;
    let host_ok = !rest.is_empty()
        && rest
            .bytes()
            .all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || b".-:[]".contains(&byte));
    if !matches!(scheme, "http" | "https") || !host_ok {
        return Err(bad());
    }
    Ok(())
}

/// Whether a request is a CORS preflight: `OPTIONS` with an `Origin` and the method
/// the browser asks leave for.
pub(crate) fn is_preflight(method: &Method, headers: &HeaderMap) -> bool {
    method == Method::OPTIONS && headers.contains_key(ORIGIN) && headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD)
}

/// The `Access-Control-Allow-Origin` an origin gets: itself when listed, `*` on a
/// route open to every origin, nothing otherwise.
fn allowed(cors: &Cors, origin: Option<&HeaderValue>) -> Option<HeaderValue> {
    let origin = origin?;
    match &cors.origins {
        None => Some(HeaderValue::from_static("*")),
        Some(origins) => origins
            .iter()
            .any(|listed| listed.as_bytes() == origin.as_bytes())
            .then(|| origin.clone()),
    }
}

/// The proxy's answer to a preflight: 204, with the route's methods, headers and age
/// for an allowed origin, and no CORS field for another (the browser then refuses
/// to send the request).
pub(crate) fn preflight(cors: &Cors, origin: Option<&HeaderValue>) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    *response.status_mut() = StatusCode::NO_CONTENT;
    let headers = response.headers_mut();
    headers.insert(
        VARY,
        HeaderValue::from_static("Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
    );
    if let Some(allow) = allowed(cors, origin) {
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        headers.insert(ACCESS_CONTROL_ALLOW_METHODS, cors.methods.clone());
        headers.insert(ACCESS_CONTROL_ALLOW_HEADERS, cors.headers.clone());
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(cors.max_age));
        if cors.credentials {
            headers.insert(ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
        }
    }
    response
}

/// An answer on a CORS route, the proxy's own or the upstream's, forwarded or
/// replayed: the upstream's CORS fields dropped, and for an allowed origin the
/// route's, with the idempotency fields exposed.
pub(crate) fn answer(cors: &Cors, origin: Option<&HeaderValue>, headers: &mut HeaderMap) {
    let theirs: Vec<_> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("access-control-"))
        .cloned()
        .collect();
    for name in theirs {
        headers.remove(name);
    }
    headers.append(VARY, HeaderValue::from_static("Origin"));
    if let Some(allow) = allowed(cors, origin) {
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        headers.insert(ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static(EXPOSED));
        if cors.credentials {
            headers.insert(ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: Option<Vec<&str>>) -> Cors {
        Cors {
            origins: origins.map(|list| list.into_iter().map(String::from).collect()),
            methods: HeaderValue::from_static("POST"),
            headers: HeaderValue::from_static("content-type, idempotency-key"),
            max_age: 600,
            credentials: false,
        }
    }

    #[test]
    fn origins_are_checked_as_a_browser_sends_them() {
        for good in ["https://app.example.com", "http://127.0.0.1:8080", "http://[::1]:3000"] {
            assert_eq!(check_origin(good), Ok(()), "{good}");
        }
        for bad in [
            "app.example.com",
            "https://app.example.com/",
            "https://App.example.com",
            "ftp://x",
            "https://",
        ] {
            assert!(check_origin(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_listed_origin_gets_the_fields_and_another_none() {
        let cors = cors(Some(vec!["https://app.example.com"]));
        let listed = HeaderValue::from_static("https://app.example.com");
        let allowed = preflight(&cors, Some(&listed));
        assert_eq!(allowed.status(), StatusCode::NO_CONTENT);
        assert_eq!(allowed.headers()[ACCESS_CONTROL_ALLOW_ORIGIN], listed);
        assert_eq!(
            allowed.headers()[ACCESS_CONTROL_ALLOW_HEADERS],
            "content-type, idempotency-key"
        );
        assert_eq!(allowed.headers()[ACCESS_CONTROL_MAX_AGE], "600");
        let other = preflight(&cors, Some(&HeaderValue::from_static("https://evil.example")));
        assert!(
            other
                .headers()
                .keys()
                .all(|name| !name.as_str().starts_with("access-control-"))
        );

        let mut headers = HeaderMap::new();
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
        headers.insert(VARY, HeaderValue::from_static("Accept-Encoding"));
        answer(&cors, Some(&listed), &mut headers);
        assert_eq!(
            headers.get_all(ACCESS_CONTROL_ALLOW_ORIGIN).iter().count(),
            1,
            "never two"
        );
        assert_eq!(headers[ACCESS_CONTROL_ALLOW_ORIGIN], listed);
        assert!(
            headers[ACCESS_CONTROL_EXPOSE_HEADERS]
                .to_str()
                .is_ok_and(|v| v.contains("Idempotent-Replayed"))
        );
        assert_eq!(headers.get_all(VARY).iter().count(), 2, "the upstream's Vary is kept");

        let mut headers = HeaderMap::new();
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
        answer(&cors, None, &mut headers);
        assert!(
            !headers.contains_key(ACCESS_CONTROL_ALLOW_ORIGIN),
            "no origin, no CORS field"
        );
    }
}
