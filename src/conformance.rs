//! `idemproxy conformance URL`: the published contract's black-box cases, run against
//! any endpoint (docs/design.md §15): first use, a replay identical and marked, the key reused
//! with another request, a duplicate while the first is in flight, a missing key, an
//! over-long key, a key sent twice. A dozen requests at most, each with a fresh random
//! key. Every case passes, fails (the endpoint did what the contract rules out), or
//! could not tell (the endpoint answered something that decides neither way).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::BodyExt;

use crate::body::full;
use crate::config::KeySource;
use crate::upstream::{self, HttpClient};

/// What to run the cases against.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The endpoint's base URL, `http://` or `https://`.
    pub base: String,
    /// The guarded path the cases POST to.
    pub path: String,
    /// A path under the same guard that answers slowly, for the in-flight case.
    pub slow_path: Option<String>,
    /// Sent with every request (a token, a content type).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The request body (`{}` by default).
    pub body: String,
    /// Where the cases send their key: a header (`header:Idempotency-Key` by default),
    /// a JSON field of the body, a form field or a query parameter, as the route's
    /// `key` says (docs/design.md §23).
    pub key_from: KeySource,
    /// How long one request may take.
    pub timeout: Duration,
}

/// How a case ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finding {
    Pass,
    Fail,
    /// The answers decide neither way (the endpoint refused the first request, say).
    Unknown,
}

impl Finding {
    pub fn as_str(self) -> &'static str {
        match self {
            Finding::Pass => "pass",
            Finding::Fail => "FAIL",
            Finding::Unknown => "could not tell",
        }
    }
}

/// One case's result: its name, finding and what was seen.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub finding: Finding,
    pub saw: String,
}

/// What one request got back.
struct Seen {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|value| value == "true")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    #[error("{0:?} is not an http:// or https:// URL with a host")]
    Url(String),
    #[error("cannot make the HTTP client: {0}")]
    Client(#[source] rustls::Error),
    #[error("cannot make a random key")]
    Random,
}

struct Runner {
    client: HttpClient,
    endpoint: Endpoint,
    base: Uri,
    prefix: String,
}

/// Runs every case against `endpoint`, in order.
pub async fn run(endpoint: Endpoint) -> Result<Vec<Case>, ConformanceError> {
    let base: Uri = endpoint
        .base
        .parse()
        .map_err(|_| ConformanceError::Url(endpoint.base.clone()))?;
    if !matches!(base.scheme_str(), Some("http" | "https")) || base.authority().is_none() {
        return Err(ConformanceError::Url(endpoint.base.clone()));
    }
    let token = crate::store::OwnerToken::generate().map_err(|_| ConformanceError::Random)?;
    let runner = Runner {
        client: upstream::client(None).map_err(ConformanceError::Client)?,
        prefix: format!("conformance-{}", &token.to_hex()[..12]),
        endpoint,
        base,
    };
    Ok(runner.cases().await)
}

impl Runner {
    fn key(&self, case: &str) -> String {
        format!("{}-{case}", self.prefix)
    }

    async fn send(&self, path: &str, keys: &[&str], body: &str) -> Result<Seen, String> {
        let (path, body) = place(&self.endpoint.key_from, path, keys, body)?;
        let base = self.endpoint.base.trim_end_matches('/');
        let uri: Uri = format!("{base}{path}")
            .parse()
            .map_err(|_| format!("{base}{path} is not a URL"))?;
        let mut request = Request::new(full(Bytes::from(body)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri;
        let headers = request.headers_mut();
        if let Some(authority) = self.base.authority()
            && let Ok(host) = HeaderValue::try_from(authority.as_str())
        {
            headers.insert(http::header::HOST, host);
        }
        let media = match self.endpoint.key_from {
            KeySource::Form(_) => "application/x-www-form-urlencoded",
            _ => "application/json",
        };
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(media));
        for (name, value) in &self.endpoint.headers {
            headers.insert(name.clone(), value.clone());
        }
        if let KeySource::Header(name) = &self.endpoint.key_from {
            for key in keys {
                let value = HeaderValue::try_from(*key).map_err(|_| "a key that is not a header value".to_string())?;
                headers.append(name.clone(), value);
            }
        }
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|error| format!("{error:?}"))?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|error| error.to_string())?.to_bytes();
            Ok(Seen {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(self.endpoint.timeout, exchange)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.endpoint.timeout)))
    }

    async fn cases(&self) -> Vec<Case> {
        let path = &self.endpoint.path;
        let body = &self.endpoint.body;
        let mut cases = Vec::new();
        let case = |name, finding, saw: String| Case { name, finding, saw };

        // First use, and its replay.
        let key = self.key("first");
        let first = self.send(path, &[&key], body).await;
        let first = match first {
            Ok(seen) if seen.status.is_success() => {
                cases.push(case("first use", Finding::Pass, format!("{}", seen.status)));
                Some(seen)
            }
            Ok(seen) => {
                cases.push(case(
                    "first use",
                    Finding::Unknown,
                    format!("{} (not a 2xx: check --path, --header and --body)", seen.status),
                ));
                None
            }
            Err(error) => {
                cases.push(case("first use", Finding::Unknown, error));
                None
            }
        };
        match &first {
            None => cases.push(case("replay", Finding::Unknown, "no first answer to replay".into())),
            Some(first) => cases.push(match self.send(path, &[&key], body).await {
                Err(error) => case("replay", Finding::Unknown, error),
                Ok(again) if again.status != first.status || again.body != first.body => case(
                    "replay",
                    Finding::Fail,
                    format!(
                        "{} with another body: the operation ran again (first {})",
                        again.status, first.status
                    ),
                ),
                Ok(again) if !again.replayed() => case(
                    "replay",
                    Finding::Fail,
                    format!("{}, the same body, but no Idempotent-Replayed: true", again.status),
                ),
                Ok(again) => case(
                    "replay",
                    Finding::Pass,
                    format!("{}, the same body, Idempotent-Replayed: true", again.status),
                ),
            }),
        }

        cases.push(match &first {
            None => case("expiry header", Finding::Unknown, "no first answer".into()),
            Some(first) => match self.send(path, &[&key], body).await {
                Err(error) => case("expiry header", Finding::Unknown, error),
                Ok(again) => expiry_header(first, &again),
            },
        });

        // The same key with another request.
        let other = other_body(body);
        cases.push(match (&first, self.send(path, &[&key], &other).await) {
            (_, Err(error)) => case("key reuse", Finding::Unknown, error),
            (_, Ok(seen)) if matches!(seen.status.as_u16(), 400 | 409 | 422) => {
                case("key reuse", Finding::Pass, format!("{}", seen.status))
            }
            (_, Ok(seen)) if seen.status.is_success() => case(
                "key reuse",
                Finding::Fail,
                format!("{}: another request with the same key was accepted", seen.status),
            ),
            (_, Ok(seen)) => case("key reuse", Finding::Unknown, format!("{}", seen.status)),
        });

        cases.push(self.in_flight().await);

        // Keys the contract refuses.
        let long = "k".repeat(crate::idempotency::MAX_KEY_LEN + 1);
        let twice = [self.key("twice-a"), self.key("twice-b")];
        for (name, keys) in [
            ("missing key", Vec::new()),
            ("over-long key", vec![long.as_str()]),
            ("key sent twice", vec![twice[0].as_str(), twice[1].as_str()]),
        ] {
            cases.push(match self.send(path, &keys, body).await {
                Err(error) => case(name, Finding::Unknown, error),
                Ok(seen) if seen.status == StatusCode::BAD_REQUEST => {
                    case(name, Finding::Pass, format!("{}", seen.status))
                }
                Ok(seen) if seen.status.is_success() => case(
                    name,
                    Finding::Fail,
                    format!("{}: accepted, so it ran unguarded", seen.status),
                ),
                Ok(seen) => case(name, Finding::Unknown, format!("{}", seen.status)),
            });
        }
        cases
    }

    /// A duplicate sent while the first request (to the slow path) is in flight must
    /// be refused, not run a second time.
    async fn in_flight(&self) -> Case {
        const NAME: &str = "in-flight duplicate";
        let Some(slow) = &self.endpoint.slow_path else {
            return Case {
                name: NAME,
                finding: Finding::Unknown,
                saw: "no --slow-path given: nothing stays in flight long enough".into(),
            };
        };
        let key = self.key("in-flight");
        let keys = [key.as_str()];
        let body = &self.endpoint.body;
        let first = self.send(slow, &keys, body);
        let duplicate = async {
            // Sent once the first has had time to reach the endpoint.
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.send(slow, &keys, body).await
        };
        let (first, duplicate) = tokio::join!(first, duplicate);
        let (finding, saw) = match (first, duplicate) {
            (_, Err(error)) => (Finding::Unknown, error),
            (_, Ok(seen)) if seen.status == StatusCode::CONFLICT => {
                (Finding::Pass, format!("{} while the first was in flight", seen.status))
            }
            (Ok(first), Ok(seen)) if seen.status.is_success() && seen.replayed() && seen.body == first.body => (
                Finding::Unknown,
                format!(
                    "{} replayed: the first had already finished (use a slower --slow-path)",
                    seen.status
                ),
            ),
            (_, Ok(seen)) if seen.status.is_success() => (
                Finding::Fail,
                format!("{}: the duplicate ran while the first was in flight", seen.status),
            ),
            (_, Ok(seen)) => (Finding::Unknown, format!("{}", seen.status)),
        };
        Case {
            name: NAME,
            finding,
            saw,
        }
    }
}

/// The path and body of a request that carries `keys` (none, one, or the same field
/// twice) in `source`; a header source leaves both as they are (`send` adds the
/// header lines).
/// The first answer and a replay say when replays stop, in `Idempotency-Expires`: the
/// same HTTP date on both, in the future (docs/design.md §24).
fn expiry_header(first: &Seen, replay: &Seen) -> Case {
    const NAME: &str = "expiry header";
    let read = |seen: &Seen| {
        let value = seen.headers.get("idempotency-expires")?.to_str().ok()?;
        Some((value.to_string(), httpdate::parse_http_date(value).ok()))
    };
    let (finding, saw) = match (read(first), read(replay)) {
        (None, _) | (_, None) => (
            Finding::Fail,
            "no Idempotency-Expires on the first answer or its replay: a client cannot tell when replays stop"
                .to_string(),
        ),
        (Some((text, None)), _) | (_, Some((text, None))) => (
            Finding::Fail,
            format!("Idempotency-Expires {text:?} is not an HTTP date"),
        ),
        (Some((a, _)), Some((b, _))) if a != b => {
            (Finding::Fail, format!("the first answer says {a:?}, its replay {b:?}"))
        }
        (Some((text, Some(at))), _) if at <= std::time::SystemTime::now() => {
            (Finding::Fail, format!("Idempotency-Expires {text:?} has passed"))
        }
        (Some((text, _)), _) => (Finding::Pass, format!("{text}, on the first answer and its replay")),
    };
    Case {
        name: NAME,
        finding,
        saw,
    }
}

fn place(source: &KeySource, path: &str, keys: &[&str], body: &str) -> Result<(String, String), String> {
    let pairs = |name: &str| {
        let mut pairs = form_urlencoded::Serializer::new(String::new());
        for key in keys {
            pairs.append_pair(name, key);
        }
        pairs.finish()
    };
    let join = |text: &str, separator: char, more: String| match (text.is_empty(), more.is_empty()) {
        (_, true) => text.to_string(),
        (true, false) => more,
        (false, false) => format!("{text}{separator}{more}"),
    };
    match source {
        KeySource::Header(_) => Ok((path.to_string(), body.to_string())),
        KeySource::Query(name) => {
            let (path, query) = path.split_once('?').unwrap_or((path, ""));
            Ok((format!("{path}?{}", join(query, '&', pairs(name))), body.to_string()))
        }
        KeySource::Form(name) => Ok((path.to_string(), join(body, '&', pairs(name)))),
        KeySource::Json(pointers) => Ok((path.to_string(), json_with_keys(pointers, keys, body)?)),
        KeySource::Body => {
            Err("the body source has no key to send: give --key-from header:, json:, form: or query:".into())
        }
    }
}

/// `body` (a JSON object) with each pointer's field set to the key; with two keys, the
/// first pointer's member written twice, as a client that sends the field twice does.
fn json_with_keys(
    pointers: &[crate::canonical_json::JsonPointer],
    keys: &[&str],
    body: &str,
) -> Result<String, String> {
    use serde_json::Value;
    let mut document: Value =
        serde_json::from_str(body).map_err(|_| "--body is not JSON, so it cannot carry a json: key".to_string())?;
    let Some(first) = keys.first() else {
        return Ok(body.to_string());
    };
    // A stand-in for the first pointer's value when the field is sent twice.
    const TWICE: &str = "idemproxy-conformance-twice";
    for (index, pointer) in pointers.iter().enumerate() {
        let value = if index == 0 && keys.len() > 1 { TWICE } else { first };
        let mut at = &mut document;
        for token in pointer.tokens() {
            if at.is_null() {
                *at = Value::Object(serde_json::Map::new());
            }
            if !at.is_object() {
                return Err(format!("--body has no object at {pointer} to hold the key"));
            }
            at = &mut at[token.as_str()];
        }
        *at = Value::String(value.to_string());
    }
    let text = document.to_string();
    match (keys, pointers.first().and_then(|pointer| pointer.tokens().last())) {
        ([one, two], Some(name)) => {
            let quoted = |text: &str| Value::String(text.to_string()).to_string();
            let members = format!("{},{}:{}", quoted(one), quoted(name), quoted(two));
            Ok(text.replacen(&quoted(TWICE), &members, 1))
        }
        _ => Ok(text),
    }
}

/// Another request body: a JSON object with one more member, else the body with a
/// suffix.
fn other_body(body: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut object)) => {
            object.insert("idemproxy_conformance".into(), serde_json::Value::Bool(true));
            serde_json::Value::Object(object).to_string()
        }
        _ => format!("{body} "),
    }
}
