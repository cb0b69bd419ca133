//! The records API on the admin listener: an operator looks at one record, purges it,
//! or frees a key whose outcome is unknown after checking with the upstream. A record
//! is named as the proxy names it: route, key and the scope values the route's
//! `scope_headers` and `scope_jwt` would have produced, through the same derivation
//! (`scope::values`, `idempotency::store_key`). Only with `admin.token_file`; every
//! call is logged with the route and the record hash, never the key.

use http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode};

use crate::body::{ProxyBody, full};
use crate::config::{Config, IdempotencyPolicy};
use crate::error::DisplayChain;
use crate::idempotency;
use crate::jwt::{self, ScopeClaim};
use crate::records::{
    RecordView, RecordedResponse, RecordsAction, RecordsError, RecordsQuery, Released, ResolvedView, Verdict, ViewState,
};
use crate::scope;
use crate::store::{AnyStore, OwnerToken, RecordStore, Resolution, Resolved, StoreKey, StoredResponse};

/// Serves `/records/...`; `None` when the records API is off, so that the caller
/// answers 404 as for any unknown path.
pub(crate) async fn handle(
    config: &Config,
    store: &AnyStore,
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: &[u8],
) -> Option<Response<ProxyBody>> {
    if let Err(refused) = door(config, path, headers)? {
        return Some(refused);
    }
    let rest = path.strip_prefix("/records/")?;
    let (action, route_name) = match RecordsAction::parse(method, rest) {
        Ok(named) => named,
        Err(allowed) => return Some(error(StatusCode::METHOD_NOT_ALLOWED, &allowed)),
    };
    let Some(route) = config.routes.iter().find(|route| route.name == route_name) else {
        return Some(error(StatusCode::NOT_FOUND, "no such route"));
    };
    let Some(policy) = &route.idempotency else {
        return Some(error(
            StatusCode::NOT_FOUND,
            "the route guards nothing: it has no records",
        ));
    };
    let Target {
        record,
        verdict,
        owner,
        body: with_body,
    } = match record_key(config, &route.name, policy, query.unwrap_or(""), action) {
        Ok(named) => named,
        Err(reason) => return Some(error(StatusCode::BAD_REQUEST, &reason)),
    };
    let resolution = match verdict.map(|verdict| resolution(verdict, policy, body)).transpose() {
        Ok(resolution) => resolution,
        Err(reason) => return Some(error(StatusCode::BAD_REQUEST, &reason)),
    };
    let response = run(store, action, &route.name, &record, owner, resolution, with_body).await;
    tracing::info!(
        route = %route.name,
        record = %record.short_hash(),
        action = action.as_str(),
        result = response.status().as_u16(),
        "records API"
    );
    Some(response)
}

/// The records API's door: `None` when it is off (no `token_file`: the caller answers
/// 404 as for any unknown path), the 401 for a missing or wrong token, or open. Asked
/// before anything of the request's body is read.
pub(crate) fn door(config: &Config, path: &str, headers: &HeaderMap) -> Option<Result<(), Response<ProxyBody>>> {
    let token = config.admin.as_ref()?.token.as_ref()?;
    // The scheme in any case (RFC 9110 §11.1), as `scope_jwt` reads it.
    let presented = headers.get(AUTHORIZATION).and_then(jwt::bearer);
    if presented.is_some_and(|presented| token.verify(presented.as_bytes())) {
        return Some(Ok(()));
    }
    tracing::warn!(path, "records API: missing or wrong token");
    let mut response = error(StatusCode::UNAUTHORIZED, "a valid admin token is required");
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Some(Err(response))
}

/// What a records call's query names: the record, and for `release` and `resolve` the
/// owner of the claim it is fenced on (`claim=`, as `show` gives it; none: whichever
/// claim is unknown when the store resolves it), and `resolve`'s verdict.
struct Target {
    record: StoreKey,
    verdict: Option<Verdict>,
    owner: Option<OwnerToken>,
    /// `show` with `body=true`.
    body: bool,
}

/// The store key the query names (`RecordsQuery`): its key within the scope its
/// `scope=NAME:VALUE` values make, where NAME is one of the route's `scope_headers`, or
/// `jwt.CLAIM` for its `scope_jwt`; with the claim to fence on and the verdict.
fn record_key(
    config: &Config,
    route: &str,
    policy: &IdempotencyPolicy,
    query: &str,
    action: RecordsAction,
) -> Result<Target, String> {
    let query = RecordsQuery::parse(action, query)?;
    let key = idempotency::parse_key_value(query.key.as_bytes()).map_err(|error| format!("key: {error}"))?;
    let mut headers = HeaderMap::new();
    let mut scope_claim: Option<ScopeClaim> = None;
    let mut named: Vec<String> = Vec::new();
    let jwt_name = policy
        .scope_jwt
        .as_ref()
        .map(|jwt| format!("jwt.{}", jwt.scope_claim()));
    for value in &query.scopes {
        // The claim by its exact name (which may hold ':'): `jwt.sub:alice` is the
        // string, `jwt.sub=123` the number.
        if let Some(jwt) = &jwt_name
            && let Some(given) = jwt_claim(value, jwt)?
        {
            if scope_claim.replace(given).is_some() {
                return Err(format!("scope {jwt} is given twice"));
            }
            continue;
        }
        let Some((scope_name, scope_value)) = value.split_once(':') else {
            return Err("scope must be NAME:VALUE".into());
        };
        let scope_name = scope_name.trim().to_ascii_lowercase();
        let header = HeaderName::from_bytes(scope_name.as_bytes())
            .ok()
            .filter(|header| policy.scope_headers.contains(header))
            .ok_or_else(|| scope_names(policy, jwt_name.as_deref(), &scope_name))?;
        if named.contains(&scope_name) {
            return Err(format!("scope {scope_name} is given twice"));
        }
        let value =
            HeaderValue::from_str(scope_value).map_err(|_| format!("scope {scope_name}: not a header value"))?;
        headers.append(header, value);
        named.push(scope_name);
    }
    if let (Some(name), None) = (&jwt_name, &scope_claim) {
        return Err(format!(
            "the route scopes records by a verified token: give scope={name}:VALUE (a string claim) or scope={name}=NUMBER"
        ));
    }
    let scope = scope::values(&headers, &policy.scope_headers, scope_claim.as_ref());
    Ok(Target {
        record: idempotency::store_key(&config.store.key_prefix, route, &scope, &key),
        verdict: query.verdict,
        body: query.body,
        owner: query
            .owner
            .as_deref()
            .and_then(|owner| OwnerToken::from_hex(owner.as_bytes())),
    })
}

/// The resolution `verdict` and the request's `body` make: for `applied`, the
/// response to record, as JSON (`RecordedResponse`), held to what the route records of
/// an upstream's response (within `max_response_body_bytes`, without the fields in
/// `replay_exclude_headers` or the proxy's own), and marked `Idempotency-Reconciled:
/// true` so that every replay of it says how it was learned.
fn resolution(verdict: Verdict, policy: &IdempotencyPolicy, body: &[u8]) -> Result<Resolution, String> {
    if verdict == Verdict::NotApplied {
        return match body {
            [] => Ok(Resolution::NotApplied),
            _ => Err("as=not-applied takes no body".into()),
        };
    }
    let given: RecordedResponse = serde_json::from_slice(body).map_err(|error| {
        format!("as=applied needs the response as JSON {{\"status\", \"headers\": [[name, value]], \"body\": base64}}: {error}")
    })?;
    let status = StatusCode::from_u16(given.status)
        .ok()
        .filter(|status| (200..600).contains(&status.as_u16()))
        .ok_or_else(|| format!("status {}: a final status, 200 to 599", given.status))?;
    let mut parts = http::Response::new(()).into_parts().0;
    parts.status = status;
    for (name, value) in &given.headers {
        let header =
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("header {name:?}: not a field name"))?;
        if crate::upstream::is_framing_or_hop_by_hop(&header) {
            return Err(format!("header {name}: set by the proxy when it replays, not recorded"));
        }
        let value = HeaderValue::from_str(value).map_err(|_| format!("header {name}: not a field value"))?;
        parts.headers.append(header, value);
    }
    use base64::Engine as _;
    let body = base64::engine::general_purpose::STANDARD
        .decode(given.body.as_bytes())
        .map_err(|_| "body: not base64".to_string())?;
    // RFC 9110 §15.3.5, §15.4.5: these never carry content; a replay of one would be
    // malformed (on HTTP/2, DATA on a 204).
    if !body.is_empty() && matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED) {
        return Err(format!("status {}: a {} has no body", status.as_u16(), status.as_u16()));
    }
    let limit = policy.max_response_body_bytes;
    if body.len() as u64 > limit {
        return Err(format!(
            "body: {} bytes, more than the route records (max_response_body_bytes = {limit})",
            body.len()
        ));
    }
    // As an upstream's response is recorded: without `Content-Length` (derived again),
    // the proxy's own fields, and what `replay_exclude_headers` names.
    let stored = StoredResponse::recorded(&parts, body.into(), policy);
    Ok(Resolution::Applied(stored.reconciled()))
}

/// The claim `value` gives when it names the route's claim `jwt` (`jwt.CLAIM`):
/// `jwt.CLAIM:VALUE` a string, `jwt.CLAIM=NUMBER` a JSON number.
fn jwt_claim(value: &str, jwt: &str) -> Result<Option<ScopeClaim>, String> {
    let Some(rest) = value.strip_prefix(jwt) else {
        return Ok(None);
    };
    if let Some(text) = rest.strip_prefix(':') {
        return Ok(Some(ScopeClaim::String(text.to_string())));
    }
    let Some(number) = rest.strip_prefix('=') else {
        return Ok(None);
    };
    let number: serde_json::Number =
        serde_json::from_str(number).map_err(|_| format!("scope {jwt}={number}: not a JSON number"))?;
    Ok(Some(ScopeClaim::Number(number.to_string())))
}

fn scope_names(policy: &IdempotencyPolicy, jwt: Option<&str>, given: &str) -> String {
    let names: Vec<&str> = jwt
        .into_iter()
        .chain(policy.scope_headers.iter().map(HeaderName::as_str))
        .collect();
    if names.is_empty() {
        format!("scope {given}: the route has no scope")
    } else {
        format!("scope {given}: the route's scope names are {}", names.join(", "))
    }
}

/// A record's view: its metadata, which key seals it, and with `with_body` the
/// response it recorded, opened.
async fn show(
    store: &AnyStore,
    route: &str,
    record: &StoreKey,
    with_body: bool,
) -> Result<Option<RecordView>, crate::error::StoreError> {
    let Some(summary) = store.inspect(record).await? else {
        return Ok(None);
    };
    let mut view = RecordView::new(route, record, summary);
    if view.state != ViewState::Completed {
        return Ok(Some(view));
    }
    // Read again for the body: the record may have been purged or expired between.
    let Some(opened) = store.opened_response(record).await? else {
        return Ok(Some(view));
    };
    view.sealed_by = opened.sealed_by;
    match opened.response {
        Ok(response) => {
            view.response_bytes = Some(response.body.len() as u64);
            if with_body {
                view.response = Some(RecordedResponse::from_stored(&response));
            }
        }
        Err(why) => view.unreadable = Some(why.to_string()),
    }
    Ok(Some(view))
}

async fn run(
    store: &AnyStore,
    action: RecordsAction,
    route: &str,
    record: &StoreKey,
    owner: Option<OwnerToken>,
    resolution: Option<Resolution>,
    with_body: bool,
) -> Response<ProxyBody> {
    let absent = || error(StatusCode::NOT_FOUND, "no record for this key");
    match action {
        RecordsAction::Show => match show(store, route, record, with_body).await {
            Ok(Some(view)) => json_response(StatusCode::OK, &view),
            Ok(None) => absent(),
            Err(failure) => store_failed(&failure),
        },
        RecordsAction::Purge => match store.purge(record).await {
            Ok(true) => {
                let mut response = Response::new(full(""));
                *response.status_mut() = StatusCode::NO_CONTENT;
                response
            }
            Ok(false) => absent(),
            Err(failure) => store_failed(&failure),
        },
        // A release is a resolution as not applied that answers as it always did.
        RecordsAction::Release | RecordsAction::Resolve => {
            let resolution = match (action, resolution) {
                (RecordsAction::Release, _) => Resolution::NotApplied,
                (_, Some(resolution)) => resolution,
                (_, None) => return error(StatusCode::BAD_REQUEST, "resolve needs as=applied or as=not-applied"),
            };
            match store.resolve(record, owner, &resolution).await {
                Ok(Resolved::Resolved) if action == RecordsAction::Release => {
                    let released = Released {
                        route: route.to_string(),
                        record: record.short_hash().to_string(),
                        released: true,
                    };
                    json_response(StatusCode::OK, &released)
                }
                Ok(Resolved::Resolved) => {
                    let resolved = ResolvedView {
                        route: route.to_string(),
                        record: record.short_hash().to_string(),
                        operation: record.operation_id(),
                        resolved: match resolution {
                            Resolution::Applied(_) => Verdict::Applied,
                            Resolution::NotApplied => Verdict::NotApplied,
                        },
                    };
                    json_response(StatusCode::OK, &resolved)
                }
                Ok(Resolved::NotUnknown) => error(
                    StatusCode::CONFLICT,
                    "the record is not unknown (completed, or in flight with its lease running): nothing was changed",
                ),
                Ok(Resolved::OtherClaim) => error(
                    StatusCode::CONFLICT,
                    "the record is unknown for another request than the claim named: check that one with the upstream; nothing was changed",
                ),
                Ok(Resolved::Absent) => absent(),
                Err(failure) => store_failed(&failure),
            }
        }
    }
}

fn store_failed(failure: &crate::error::StoreError) -> Response<ProxyBody> {
    tracing::warn!(error = %DisplayChain(failure), "records API: the store failed");
    error(StatusCode::SERVICE_UNAVAILABLE, "the store failed; try again")
}

pub(super) fn error(status: StatusCode, message: &str) -> Response<ProxyBody> {
    json_response(
        status,
        &RecordsError {
            error: message.to_string(),
        },
    )
}

fn json_response(status: StatusCode, body: &impl serde::Serialize) -> Response<ProxyBody> {
    // Serializing these plain structs cannot fail.
    let mut text = serde_json::to_string(body).unwrap_or_default();
    text.push('\n');
    let mut response = Response::new(full(text));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records API's door, below HTTP: only the configured token, presented whole
    /// as a Bearer token (the scheme in any case), gets past it.
    #[tokio::test]
    async fn only_the_configured_token_opens_the_records_api() {
        const TOKEN: &str = "0123456789abcdef-the-token";
        let dir = tempfile::tempdir().expect("a directory");
        let file = dir.path().join("token");
        std::fs::write(&file, format!("{TOKEN}\n")).expect("write the token");
        let source = format!(
            "[admin]\ntoken_file = {:?}\n[[route]]\nname = \"payments\"\npath_prefix = \"/v1/payments\"\n\
             upstream = \"http://127.0.0.1:9\"\n[route.idempotency]\n",
            file.display().to_string()
        );
        let config = Config::parse(&source, &dir.path().join("t.toml")).expect("a valid config");
        let store = AnyStore::from(crate::store::MemoryStore::new(100, 1 << 20));
        let status = async |authorization: Option<String>| {
            let mut headers = HeaderMap::new();
            if let Some(value) = authorization {
                headers.insert(AUTHORIZATION, HeaderValue::try_from(value).expect("a header value"));
            }
            let path = "/records/payments";
            let answer = handle(&config, &store, &Method::GET, path, Some("key=k"), &headers, b"").await;
            answer.expect("the records API is on").status()
        };
        for refused in [
            None,
            Some(format!("Bearer {}", &TOKEN[..TOKEN.len() - 1])),
            Some(format!("Bearer {TOKEN}x")),
            Some(format!("Bearer {}", TOKEN.to_uppercase())),
            Some(format!("Basic {TOKEN}")),
            Some(TOKEN.to_string()),
            Some("Bearer ".into()),
        ] {
            assert_eq!(status(refused.clone()).await, StatusCode::UNAUTHORIZED, "{refused:?}");
        }
        for taken in [format!("Bearer {TOKEN}"), format!("bearer {TOKEN}")] {
            // Past the door: the key has no record.
            assert_eq!(status(Some(taken.clone())).await, StatusCode::NOT_FOUND, "{taken}");
        }
    }

    /// Each action takes its own parameters and, given another, names the ones it
    /// takes: `claim` on release and resolve only, `as` on resolve only.
    #[test]
    fn each_action_takes_its_own_parameters_and_names_them() {
        use RecordsAction::{Purge, Release, Resolve, Show};
        let source = "[[route]]\nname = \"payments\"\npath_prefix = \"/v1/payments\"\n\
                      upstream = \"http://127.0.0.1:9\"\n[route.idempotency]\n";
        let config = Config::parse(source, std::path::Path::new("t.toml")).expect("a valid config");
        let policy = config.routes[0].idempotency.as_ref().expect("a guarded route");
        let claim = "0123456789abcdef0123456789abcdef";
        let name = |action, query: &str| record_key(&config, "payments", policy, query, action);
        let refused = |action, query: &str| match name(action, query) {
            Ok(_) => panic!("{action:?} took {query}"),
            Err(reason) => reason,
        };
        let released = name(Release, &format!("key=k&claim={claim}")).expect("release takes a claim");
        assert_eq!(released.owner.map(OwnerToken::to_hex).as_deref(), Some(claim));
        assert_eq!(released.verdict, None);
        let resolved = name(Resolve, &format!("key=k&claim={claim}&as=not-applied")).expect("resolve takes both");
        assert_eq!(resolved.owner.map(OwnerToken::to_hex).as_deref(), Some(claim));
        assert_eq!(resolved.verdict, Some(Verdict::NotApplied));
        let takes = [
            (Show, "key, scope and body"),
            (Purge, "key and scope"),
            (Release, "key, scope and claim"),
            (Resolve, "key, scope, claim and as"),
        ];
        for (action, parameters) in takes {
            let unknown = |parameter: &str| format!("unknown parameter {parameter:?}: the query takes {parameters}");
            assert_eq!(refused(action, "key=k&other=1"), unknown("other"), "{action:?}");
            if !matches!(action, Release | Resolve) {
                assert_eq!(
                    refused(action, &format!("key=k&claim={claim}")),
                    unknown("claim"),
                    "{action:?}"
                );
            }
            if action != Resolve {
                assert_eq!(refused(action, "key=k&as=applied"), unknown("as"), "{action:?}");
            }
        }
    }

    #[test]
    fn a_jwt_scope_names_its_claim_exactly_and_its_json_type() {
        assert_eq!(
            jwt_claim("jwt.sub:alice", "jwt.sub"),
            Ok(Some(ScopeClaim::String("alice".into())))
        );
        assert_eq!(
            jwt_claim("jwt.sub:123", "jwt.sub"),
            Ok(Some(ScopeClaim::String("123".into())))
        );
        assert_eq!(
            jwt_claim("jwt.sub=123", "jwt.sub"),
            Ok(Some(ScopeClaim::Number("123".into())))
        );
        assert_eq!(
            jwt_claim("jwt.sub=1.5", "jwt.sub"),
            Ok(Some(ScopeClaim::Number("1.5".into())))
        );
        assert!(jwt_claim("jwt.sub=abc", "jwt.sub").is_err());
        assert_eq!(jwt_claim("jwt.subway:x", "jwt.sub"), Ok(None));
        assert_eq!(jwt_claim("authorization:x", "jwt.sub"), Ok(None));
        // A claim named by a URL holds ':' itself.
        let url = "jwt.https://example.com/tenant";
        assert_eq!(
            jwt_claim("jwt.https://example.com/tenant:acme", url),
            Ok(Some(ScopeClaim::String("acme".into())))
        );
    }
}
