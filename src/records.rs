//! The records API's contract, both ends of it: the actions an operator takes on one
//! record (each with its method and path), the view of a record the admin listener
//! answers with and `idemproxy records` prints, and the client the CLI calls it
//! through, with the token from the config's `token_file`. The admin side builds the
//! types here and the client side parses them, so that neither names a field by string.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::store::{Probe, RecordSummary, StoreKey, SummaryState};

/// What an operator does to one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RecordsAction {
    /// The record's state, TTL, lease, status, reason, size and fingerprint.
    Show,
    /// Remove the record, whatever its state: the next request with the key runs.
    Purge,
    /// Free a key whose outcome is unknown, after checking with the upstream that the
    /// request did not take effect: the next request with the key runs.
    Release,
    /// Settle a key whose outcome is unknown with what the upstream says: applied
    /// (record the response it gave; retries replay it) or not applied (free the key).
    Resolve,
}

impl RecordsAction {
    const ALL: [RecordsAction; 4] = [
        RecordsAction::Show,
        RecordsAction::Purge,
        RecordsAction::Release,
        RecordsAction::Resolve,
    ];

    /// How the access log and the admin's log line name it.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordsAction::Show => "show",
            RecordsAction::Purge => "purge",
            RecordsAction::Release => "release",
            RecordsAction::Resolve => "resolve",
        }
    }

    pub fn method(self) -> Method {
        match self {
            RecordsAction::Show => Method::GET,
            RecordsAction::Purge => Method::DELETE,
            RecordsAction::Release | RecordsAction::Resolve => Method::POST,
        }
    }

    /// What follows the route in the action's path: `/records/{route}{suffix}`.
    fn suffix(self) -> &'static str {
        match self {
            RecordsAction::Show | RecordsAction::Purge => "",
            RecordsAction::Release => "/release",
            RecordsAction::Resolve => "/resolve",
        }
    }

    /// The action's path for `route`, its name percent-encoded.
    pub fn path(self, route: &str) -> String {
        let route: String = form_urlencoded::byte_serialize(route.as_bytes()).collect();
        format!("/records/{route}{}", self.suffix())
    }

    /// The action and the route that `method` and the path after `/records/` name, or
    /// why none does: the methods that path takes, for a 405.
    pub fn parse<'a>(method: &Method, rest: &'a str) -> Result<(RecordsAction, &'a str), String> {
        let named = |action: &RecordsAction| match action.suffix() {
            "" => Some(rest),
            suffix => rest.strip_suffix(suffix),
        };
        // The longest suffix first: `x/release` names the route `x`, not `x/release`.
        let mut candidates: Vec<(RecordsAction, &str)> = RecordsAction::ALL
            .iter()
            .filter_map(|action| named(action).map(|route| (*action, route)))
            .collect();
        candidates.sort_by_key(|(action, _)| std::cmp::Reverse(action.suffix().len()));
        let longest = candidates.first().map(|(action, _)| action.suffix().len());
        candidates.retain(|(action, _)| Some(action.suffix().len()) == longest);
        if let Some(found) = candidates.iter().find(|(action, _)| action.method() == method) {
            return Ok(*found);
        }
        let allowed: Vec<String> = candidates
            .iter()
            .map(|(action, _)| format!("{} to {}", action.method(), action.as_str()))
            .collect();
        Err(format!("use {}", allowed.join(", ")))
    }
}

/// Where a record stands, as an operator reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViewState {
    InFlight,
    Completed,
    /// Completed and past its retention: its response is gone, the key remembered
    /// (retries get 410 `response-expired`).
    Spent,
    Unknown,
}

impl ViewState {
    fn as_str(self) -> &'static str {
        match self {
            ViewState::InFlight => "in_flight",
            ViewState::Completed => "completed",
            ViewState::Spent => "spent",
            ViewState::Unknown => "unknown",
        }
    }
}

/// One record, as `GET /records/{route}` answers it and `records show` prints it:
/// metadata, never its body unless asked for (`body=true`, `--body`). Absent fields are
/// `null`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordView {
    pub route: String,
    /// The record hash's first 12 hex digits: how the logs name it.
    pub record: String,
    /// The record's operation id (`StoreKey::operation_id`): what a 409
    /// `outcome-unknown` names and `upstream_key = "derived"` sends the upstream.
    pub operation: String,
    pub state: ViewState,
    /// Unknown: the claim whose outcome is unknown (32 hex digits), to fence a
    /// `resolve` or `release` on with `claim=` (`--claim`).
    pub claim: Option<String>,
    pub ttl_ms: u64,
    /// In flight: what is left of its lease; 0 once it has run out (then `unknown`).
    pub lease_remaining_ms: Option<u64>,
    /// Completed (or spent): the recorded status.
    pub status: Option<u16>,
    /// Spent: when its operation completed (RFC 3339), where the store kept it.
    #[serde(default)]
    pub completed_at: Option<String>,
    /// Unknown: why (`upstream-timeout`, `upstream-failed`, `response-too-large`,
    /// `lease-expired`).
    pub reason: Option<String>,
    /// Unknown: whether the route's probe is reconciling it (`false`: none was
    /// scheduled, or it gave up; an operator must resolve it).
    pub reconciling: Option<bool>,
    /// Reconciling: how long until the next probe may begin (0: due now).
    pub next_probe_ms: Option<u64>,
    /// Completed: the recorded body's size.
    pub response_bytes: Option<u64>,
    /// Completed, with tracing on: the trace id (32 hex digits) of the request that
    /// executed it, which every replay's span links to.
    pub trace_id: Option<String>,
    /// The first request's fingerprint, hex (an HMAC under the record key, with
    /// `[store.encryption]`).
    pub fingerprint: String,
    /// Completed and sealed: the id of the key that sealed it (`check` lists the
    /// configured ones).
    pub sealed_by: Option<String>,
    /// Completed, and its response cannot be opened: why (a key no longer configured,
    /// or altered). Retries get 409 `outcome-unknown` with reason `unreadable`.
    pub unreadable: Option<String>,
    /// Asked for with `body=true`: the recorded response, opened.
    pub response: Option<RecordedResponse>,
}

impl RecordView {
    /// The view of `summary`, the record `record` of `route`.
    pub fn new(route: &str, record: &StoreKey, summary: RecordSummary) -> RecordView {
        let millis = |duration: Duration| u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        let mut view = RecordView {
            route: route.to_string(),
            record: record.short_hash().to_string(),
            operation: record.operation_id(),
            state: ViewState::Unknown,
            claim: summary.owner.map(crate::store::OwnerToken::to_hex),
            ttl_ms: millis(summary.ttl),
            lease_remaining_ms: None,
            status: None,
            completed_at: None,
            reason: None,
            reconciling: None,
            next_probe_ms: None,
            response_bytes: None,
            trace_id: None,
            fingerprint: summary.fingerprint.to_hex(),
            sealed_by: None,
            unreadable: None,
            response: None,
        };
        match summary.state {
            SummaryState::InFlight { lease_remaining } => {
                view.state = ViewState::InFlight;
                view.lease_remaining_ms = Some(millis(lease_remaining));
            }
            SummaryState::LeaseExpired => {
                view.lease_remaining_ms = Some(0);
                view.reason = Some("lease-expired".into());
            }
            SummaryState::Completed {
                status,
                response_bytes,
                trace_id,
            } => {
                view.state = ViewState::Completed;
                view.status = Some(status);
                view.response_bytes = Some(response_bytes);
                view.trace_id = trace_id;
            }
            SummaryState::Spent(spent) => {
                view.state = ViewState::Spent;
                view.status = Some(spent.status.as_u16());
                view.completed_at = spent
                    .completed_at
                    .map(|at| humantime::format_rfc3339_seconds(at).to_string());
            }
            SummaryState::Unknown { reason, probe } => {
                view.reason = Some(reason.as_str().into());
                view.reconciling = Some(matches!(probe, Probe::Next(_)));
                if let Probe::Next(next) = probe {
                    view.next_probe_ms = Some(millis(next));
                }
            }
        }
        view
    }
}

impl std::fmt::Display for RecordView {
    /// What `idemproxy records show` prints: one field a line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "route        {}", self.route)?;
        writeln!(f, "record       {}", self.record)?;
        writeln!(f, "operation    {}", self.operation)?;
        writeln!(f, "state        {}", self.state.as_str())?;
        if let Some(status) = self.status {
            writeln!(f, "status       {status}")?;
        }
        if let Some(at) = &self.completed_at {
            writeln!(f, "completed    {at} (its response is past retention: retries get 410)")?;
        }
        if let Some(reason) = &self.reason {
            writeln!(f, "reason       {reason}")?;
        }
        if let Some(claim) = &self.claim {
            writeln!(f, "claim        {claim}")?;
        }
        match (self.reconciling, self.next_probe_ms) {
            (Some(true), Some(next)) => {
                let next = humantime::format_duration(Duration::from_millis(next));
                writeln!(f, "reconciling  next probe in {next}")?;
            }
            (Some(false), _) => writeln!(
                f,
                "reconciling  no: resolve it with `records resolve` or `records release`"
            )?,
            _ => {}
        }
        if let Some(bytes) = self.response_bytes {
            writeln!(f, "response     {bytes} bytes")?;
        }
        if let Some(trace_id) = &self.trace_id {
            writeln!(f, "trace        {trace_id} (the request that executed it)")?;
        }
        if let Some(key) = &self.sealed_by {
            writeln!(f, "sealed by    key {key}")?;
        }
        if let Some(why) = &self.unreadable {
            writeln!(f, "unreadable   {why}: retries get 409 outcome-unknown")?;
        }
        if let Some(response) = &self.response {
            writeln!(f, "recorded     {}", response.status)?;
            for (name, value) in &response.headers {
                writeln!(f, "  {name}: {value}")?;
            }
            writeln!(f, "  body (base64) {}", response.body)?;
        }
        if let Some(lease) = self.lease_remaining_ms {
            let lease = humantime::format_duration(Duration::from_millis(lease));
            writeln!(f, "lease        {lease} left")?;
        }
        let expires = humantime::format_duration(Duration::from_secs(self.ttl_ms / 1000));
        writeln!(f, "expires in   {expires}")?;
        writeln!(f, "fingerprint  {}", self.fingerprint)
    }
}

/// The answer to a release: the record named, and that it is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    pub route: String,
    pub record: String,
    pub released: bool,
}

/// The response an operator records when resolving an unknown record as applied: what
/// the upstream answered the operation, as the body of `POST
/// /records/{route}/resolve?as=applied`. `body` is base64 (standard, padded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedResponse {
    pub status: u16,
    /// Name and value pairs, in order.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    #[serde(default)]
    pub body: String,
}

impl RecordedResponse {
    /// A recorded response as the records API shows it (`body=true`): its fields as
    /// text (a byte that is not UTF-8 shown as U+FFFD), its body in base64.
    pub fn from_stored(response: &crate::store::StoredResponse) -> RecordedResponse {
        use base64::Engine as _;
        RecordedResponse {
            status: response.status.as_u16(),
            headers: response
                .headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_string(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: base64::engine::general_purpose::STANDARD.encode(&response.body),
        }
    }
}

/// What a resolution decided: the `as=` of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Applied,
    NotApplied,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Applied => "applied",
            Verdict::NotApplied => "not-applied",
        }
    }

    pub fn parse(text: &str) -> Option<Verdict> {
        match text {
            "applied" => Some(Verdict::Applied),
            "not-applied" => Some(Verdict::NotApplied),
            _ => None,
        }
    }
}

/// The answer to a resolution: the record named, and how it was resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedView {
    pub route: String,
    pub record: String,
    pub operation: String,
    pub resolved: Verdict,
}

/// Any refusal of the records API: a sentence for the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordsError {
    pub error: String,
}

/// A records call's query, both ends of it: the key, the scope values as the route's
/// scope would have produced them, and for `release` and `resolve` the claim to fence
/// on (`claim=`, the owner token `show` gives), and for `resolve` the verdict (`as=`).
/// The CLI writes it with `to_query`; the admin listener reads it with `parse`, which
/// holds each action to its own parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordsQuery {
    pub key: String,
    /// `NAME:VALUE` (a scope header), or `jwt.CLAIM:VALUE` / `jwt.CLAIM=NUMBER`.
    pub scopes: Vec<String>,
    /// The claim to fence on: the owner token, 32 hex digits.
    pub owner: Option<String>,
    pub verdict: Option<Verdict>,
    /// `show` only (`body=true`): the recorded response, body and fields, opened.
    pub body: bool,
}

impl RecordsQuery {
    /// The query string, `key=K&scope=…&claim=…&as=…`, percent-encoded.
    pub fn to_query(&self) -> String {
        let mut query = form_urlencoded::Serializer::new(String::new());
        query.append_pair("key", &self.key);
        for scope in &self.scopes {
            query.append_pair("scope", scope);
        }
        if let Some(owner) = &self.owner {
            query.append_pair("claim", owner);
        }
        if let Some(verdict) = self.verdict {
            query.append_pair("as", verdict.as_str());
        }
        if self.body {
            query.append_pair("body", "true");
        }
        query.finish()
    }

    /// Reads `query` for `action`: each parameter once (`scope` any number of times),
    /// `claim` only on release and resolve, `as` only on resolve and required there,
    /// `key` always; otherwise a sentence that names what the action takes.
    pub fn parse(action: RecordsAction, query: &str) -> Result<RecordsQuery, String> {
        let mut parsed = RecordsQuery::default();
        let mut key = None;
        let fenced = matches!(action, RecordsAction::Release | RecordsAction::Resolve);
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            match name.as_ref() {
                "key" if key.is_some() => return Err("key is given twice".into()),
                "key" => key = Some(value.into_owned()),
                "scope" => parsed.scopes.push(value.into_owned()),
                "claim" if fenced => {
                    if crate::store::OwnerToken::from_hex(value.as_bytes()).is_none() {
                        return Err("claim must be 32 hex digits, as show gives it".into());
                    }
                    if parsed.owner.replace(value.into_owned()).is_some() {
                        return Err("claim is given twice".into());
                    }
                }
                "body" if action == RecordsAction::Show => {
                    parsed.body = match value.as_ref() {
                        "true" => true,
                        "false" => false,
                        _ => return Err("body must be true or false".into()),
                    };
                }
                "as" if action == RecordsAction::Resolve => {
                    let given = Verdict::parse(&value).ok_or("as must be applied or not-applied")?;
                    if parsed.verdict.replace(given).is_some() {
                        return Err("as is given twice".into());
                    }
                }
                other => {
                    let takes = match action {
                        RecordsAction::Resolve => "key, scope, claim and as",
                        RecordsAction::Release => "key, scope and claim",
                        RecordsAction::Show => "key, scope and body",
                        RecordsAction::Purge => "key and scope",
                    };
                    return Err(format!("unknown parameter {other:?}: the query takes {takes}"));
                }
            }
        }
        parsed.key = key.ok_or("key is required")?;
        if action == RecordsAction::Resolve && parsed.verdict.is_none() {
            return Err("resolve needs as=applied or as=not-applied".into());
        }
        Ok(parsed)
    }
}

// === the client ===

/// One records call: what to do, to which record, and for `resolve as=applied` the
/// response to record.
#[derive(Debug, Clone)]
pub struct RecordsCall {
    pub action: RecordsAction,
    pub route: String,
    pub query: RecordsQuery,
    pub response: Option<RecordedResponse>,
}

/// What the admin listener answered, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered {
    Shown(Box<RecordView>),
    Purged,
    Released(Released),
    Resolved(ResolvedView),
    /// 404: no such record (or route).
    NotFound(String),
    /// 409: the record is not in the state the action needs.
    Refused(String),
    /// Anything else: the status and what the listener said.
    Failed(StatusCode, String),
}

/// An answer and the JSON it came as (`records --json` prints that).
#[derive(Debug, Clone)]
pub struct Reply {
    pub answer: Answered,
    pub body: Bytes,
}

/// Why a records call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("the config has no [admin] section: the records API is off")]
    NoAdmin,
    #[error("the config's [admin] has no token_file: the records API is off")]
    NoToken,
    #[error("cannot read the admin token from {}", .0.display())]
    Token(PathBuf, #[source] std::io::Error),
    #[error("cannot connect to the admin listener at {0}")]
    Connect(SocketAddr, #[source] std::io::Error),
    #[error("the admin listener at {0} did not answer over HTTP/1.1")]
    Exchange(SocketAddr, #[source] hyper::Error),
    #[error("the admin listener at {0} did not answer within {TIMEOUT:?}")]
    Timeout(SocketAddr),
    #[error("the admin listener answered {0} with a body that is not the records API's: {1}")]
    Unexpected(StatusCode, String),
    #[error("cannot build the request")]
    Request(#[source] http::Error),
}

/// How long the CLI waits for the admin listener.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Makes `call` against the admin listener `config` names.
pub async fn call(config: &Config, call: &RecordsCall) -> Result<Reply, CallError> {
    let admin = config.admin.as_ref().ok_or(CallError::NoAdmin)?;
    let token = admin.token.as_ref().ok_or(CallError::NoToken)?;
    let secret = std::fs::read_to_string(&token.file).map_err(|error| CallError::Token(token.file.clone(), error))?;
    let body = match &call.response {
        Some(response) => Bytes::from(serde_json::to_vec(response).unwrap_or_default()),
        None => Bytes::new(),
    };
    let addr = reachable(admin.listen);
    let request = Request::builder()
        .method(call.action.method())
        .uri(format!("{}?{}", call.action.path(&call.route), call.query.to_query()))
        .header(http::header::HOST, addr.to_string())
        .header(http::header::AUTHORIZATION, format!("Bearer {}", secret.trim()))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(CallError::Request)?;
    let (status, body) = tokio::time::timeout(TIMEOUT, exchange(addr, request))
        .await
        .map_err(|_| CallError::Timeout(addr))??;
    Ok(Reply {
        answer: decode(call.action, status, &body)?,
        body,
    })
}

async fn exchange(addr: SocketAddr, request: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), CallError> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|error| CallError::Connect(addr, error))?;
    let failed = |error| CallError::Exchange(addr, error);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(failed)?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await.map_err(failed)?;
    let status = response.status();
    let body = response.into_body().collect().await.map_err(failed)?.to_bytes();
    Ok((status, body))
}

/// The answer to `action` that `status` and `body` make.
fn decode(action: RecordsAction, status: StatusCode, body: &[u8]) -> Result<Answered, CallError> {
    let unexpected = || CallError::Unexpected(status, String::from_utf8_lossy(body).into_owned());
    let error = || {
        serde_json::from_slice::<RecordsError>(body)
            .map(|refusal| refusal.error)
            .map_err(|_| unexpected())
    };
    Ok(match (status, action) {
        (StatusCode::OK, RecordsAction::Show) => {
            Answered::Shown(Box::new(serde_json::from_slice(body).map_err(|_| unexpected())?))
        }
        (StatusCode::NO_CONTENT, RecordsAction::Purge) => Answered::Purged,
        (StatusCode::OK, RecordsAction::Release) => {
            Answered::Released(serde_json::from_slice(body).map_err(|_| unexpected())?)
        }
        (StatusCode::OK, RecordsAction::Resolve) => {
            Answered::Resolved(serde_json::from_slice(body).map_err(|_| unexpected())?)
        }
        (StatusCode::NOT_FOUND, _) => Answered::NotFound(error()?),
        (StatusCode::CONFLICT, _) => Answered::Refused(error()?),
        (status, _) => Answered::Failed(
            status,
            error().unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned()),
        ),
    })
}

/// The admin listener's address as a client reaches it: a wildcard is this host.
fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), listen.port()),
        _ => listen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the CLI writes, the admin listener reads back: every parameter, with the
    /// bytes that need encoding.
    #[test]
    fn a_records_query_reads_back_what_it_writes() {
        let query = RecordsQuery {
            key: "order 7&x=%".into(),
            scopes: vec!["authorization:Bearer a+b".into(), "jwt.sub=12".into()],
            owner: Some("0123456789abcdef0123456789abcdef".into()),
            verdict: Some(Verdict::NotApplied),
            body: false,
        };
        let text = query.to_query();
        assert!(!text.contains(' ') && !text.contains("&x="), "{text}");
        assert_eq!(RecordsQuery::parse(RecordsAction::Resolve, &text), Ok(query.clone()));
        let released = RecordsQuery {
            verdict: None,
            ..query.clone()
        };
        assert_eq!(
            RecordsQuery::parse(RecordsAction::Release, &released.to_query()),
            Ok(released)
        );
        let shown = RecordsQuery {
            owner: None,
            verdict: None,
            body: true,
            ..query
        };
        assert_eq!(
            RecordsQuery::parse(RecordsAction::Show, &shown.to_query()),
            Ok(shown.clone())
        );
        assert!(
            RecordsQuery::parse(RecordsAction::Purge, &shown.to_query()).is_err(),
            "body is for show only"
        );
        assert_eq!(
            RecordsQuery::parse(RecordsAction::Release, "key=k&claim=zz"),
            Err("claim must be 32 hex digits, as show gives it".into())
        );
    }

    #[test]
    fn each_action_parses_back_from_its_own_method_and_path() {
        for action in RecordsAction::ALL {
            let path = action.path("pay-ments.v1");
            let rest = path.strip_prefix("/records/").expect("under /records/");
            assert_eq!(
                RecordsAction::parse(&action.method(), rest),
                Ok((action, "pay-ments.v1"))
            );
        }
        assert_eq!(
            RecordsAction::parse(&Method::PUT, "payments"),
            Err("use GET to show, DELETE to purge".into())
        );
        assert_eq!(
            RecordsAction::parse(&Method::GET, "payments/release"),
            Err("use POST to release".into())
        );
    }

    #[test]
    fn a_view_reads_back_as_itself_and_prints_each_field() {
        let view = RecordView {
            route: "payments".into(),
            record: "abcdefabcdef".into(),
            operation: "0123456789abcdef".repeat(2),
            state: ViewState::Completed,
            claim: None,
            ttl_ms: 3_540_500,
            lease_remaining_ms: None,
            status: Some(201),
            completed_at: None,
            reason: None,
            reconciling: None,
            next_probe_ms: None,
            response_bytes: Some(81),
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
            fingerprint: "ab".repeat(32),
            sealed_by: Some("0a1b2c3d".into()),
            unreadable: None,
            response: Some(RecordedResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: "e30=".into(),
            }),
        };
        let json = serde_json::to_vec(&view).expect("serialize");
        assert_eq!(
            decode(RecordsAction::Show, StatusCode::OK, &json).expect("decode"),
            Answered::Shown(Box::new(view.clone()))
        );
        let printed = view.to_string();
        for line in [
            "operation    0123456789abcdef0123456789abcdef",
            "state        completed",
            "status       201",
            "response     81 bytes",
            "trace        4bf92f3577b34da6a3ce929d0e0e4736 (the request that executed it)",
            "sealed by    key 0a1b2c3d",
            "recorded     201",
            "  content-type: application/json",
            "  body (base64) e30=",
            "expires in   59m",
        ] {
            assert!(printed.contains(line), "{line:?} not in {printed}");
        }
        assert!(!printed.contains("lease"), "{printed}");
    }
}
