//! `GET /.well-known/idempotency` (`server.contract_path`): the published contract of
//! the guarded routes a request's host may reach (`crate::contract`), answered by the
//! proxy itself and never forwarded, with an `ETag` and a minute of caching.

use bytes::Bytes;
use http::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE, ETAG, IF_NONE_MATCH};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use super::Proxy;
use crate::body::{ProxyBody, full};
use crate::contract;

impl Proxy {
    /// The contract for `host`: 200 with the document, 304 when `If-None-Match` names
    /// its tag, 405 for a method other than GET and HEAD.
    pub(super) fn contract(&self, request: &Request<Incoming>, host: Option<&str>) -> Response<ProxyBody> {
        let router = self.shared.router.load();
        let routes: Vec<&crate::config::Route> = router.configs().collect();
        let matching = routes.iter().copied().filter(|route| {
            route
                .host
                .as_deref()
                .is_none_or(|only| host.is_some_and(|host| only.eq_ignore_ascii_case(host)))
        });
        let mut body = contract::document(matching).to_string();
        body.push('\n');
        let digest = ring::digest::digest(&ring::digest::SHA256, body.as_bytes());
        let tag = format!("\"{}\"", const_hex::encode(&digest.as_ref()[..16]));
        let mut response = Response::new(full(Bytes::new()));
        let headers = response.headers_mut();
        if let Ok(tag) = HeaderValue::try_from(tag.as_str()) {
            headers.insert(ETAG, tag);
        }
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("max-age=60"));
        if request.method() != Method::GET && request.method() != Method::HEAD {
            *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return response;
        }
        if matches_tag(request.headers().get_all(IF_NONE_MATCH), &tag) {
            *response.status_mut() = StatusCode::NOT_MODIFIED;
            return response;
        }
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if request.method() == Method::GET {
            *response.body_mut() = full(Bytes::from(body));
        } else {
            let length = HeaderValue::from(body.len());
            response.headers_mut().insert(http::header::CONTENT_LENGTH, length);
        }
        response
    }
}

/// Whether `If-None-Match` names `tag` (or is `*`), weak or strong (RFC 9110 §13.1.2
/// compares weakly).
fn matches_tag(values: http::header::GetAll<'_, HeaderValue>, tag: &str) -> bool {
    values
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .any(|candidate| candidate == "*" || candidate.trim_start_matches("W/") == tag)
}
