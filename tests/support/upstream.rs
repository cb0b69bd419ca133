//! A fake upstream on a real socket. It counts executions per idempotency key, gives
//! each execution a unique id that its response echoes, logs the headers it saw, and
//! does what the request's `x-test-*` headers ask:
//!
//! - `x-test-hold: NAME`   wait until the test calls `release(NAME)`
//! - `x-test-status: N`    answer with status N (default 201)
//! - `x-test-jitter-ms: N` wait a pseudo-random 0..N ms before answering
//! - `x-test-body-bytes: N` answer with a body of N bytes instead of the JSON echo
//! - `x-test-fail: reset`  close the connection instead of answering
//! - `x-test-fail: truncate` send the head, then close mid-body
//! - `x-test-response-header: NAME: VALUE` add that field to the response (repeatable)
//! - `x-test-stream: N`    answer with server-sent events: N events
//!   (`data: {"execution":ID,"event":I}`), as they are sent, with no length
//! - `x-test-stream-hold: NAME` send the first event, then wait for `release(NAME)`
//! - `x-test-stream-fail: reset` after the first event (and the hold), break the stream
//! - `x-test-stream-event-bytes: N` pad each event to N bytes
//! - `x-test-stream-gap-ms: N` send the events N ms apart (pacing, not synchronisation)
//! - `x-test-effect: never` the request is executed (logged) but never takes effect
//! - a path ending in `/slow` answers after 1.5 s
//! - a path ending in `/rpc` answers a JSON-RPC 2.0 call with its own `id` and the
//!   result `{"execution":ID}` (a batch with an array of them)
//!
//! It also answers the lookups a reconciliation probe makes, without logging them as
//! executions: `GET` or `HEAD /v1/payments/by-key/{key}` is 200 with the execution of
//! `key` that took effect (every one but `x-test-effect: never`, from the moment it
//! arrives), else 404; `set_lookups` makes them fail or hold.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

#[derive(Debug, Clone)]
pub struct Execution {
    pub id: u64,
    pub at: tokio::time::Instant,
    pub key: String,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Whether it took effect (`x-test-effect: never` is executed without effect).
    pub effect: bool,
}

#[derive(Default)]
struct State {
    next_id: AtomicU64,
    executions: Mutex<Vec<Execution>>,
    arrived: Notify,
    gates: Mutex<HashMap<String, watch::Sender<bool>>>,
    /// The key each execution that took effect was sent with, and its id.
    applied: Mutex<HashMap<String, u64>>,
    lookups: Mutex<Vec<Lookup>>,
    lookup_mode: Mutex<Lookups>,
    lookups_in_flight: AtomicU64,
    max_lookups_in_flight: AtomicU64,
    looked_up: Notify,
}

/// One probe's lookup, as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Lookup {
    pub at: tokio::time::Instant,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body_bytes: usize,
}

/// How the upstream answers lookups.
#[derive(Debug, Clone, Default)]
pub enum Lookups {
    /// 200 with the execution that took effect, or 404.
    #[default]
    Answer,
    /// Always this status.
    Fail(u16),
    /// Wait at gate `NAME` (see `release`), then answer.
    Hold(String),
    /// Take this long, then answer.
    Slow(std::time::Duration),
}

#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<State>,
    stop: watch::Sender<bool>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        Upstream::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    pub async fn start_on(addr: SocketAddr) -> Upstream {
        Upstream::start_with(addr, None).await
    }

    /// An upstream that speaks HTTPS with `tls`.
    pub async fn start_tls(tls: tokio_rustls::TlsAcceptor) -> Upstream {
        Upstream::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), Some(tls)).await
    }

    async fn start_with(addr: SocketAddr, tls: Option<tokio_rustls::TlsAcceptor>) -> Upstream {
        let listener = TcpListener::bind(addr).await.expect("bind the fake upstream");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(State::default());
        let (stop, mut stopped) = watch::channel(false);
        let accept_state = state.clone();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stopped.wait_for(|stop| *stop) => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let state = accept_state.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| handle(state.clone(), request));
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                        }
                        Some(tls) => {
                            if let Ok(stream) = tls.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                            }
                        }
                    }
                });
            }
        });
        Upstream { addr, state, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL of an upstream started with `start_tls`, by the name its certificate has.
    pub fn https_url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }

    /// Stops accepting new connections.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }

    /// How many times requests with this idempotency key were executed.
    pub fn executions(&self, key: &str) -> usize {
        self.log().iter().filter(|execution| execution.key == key).count()
    }

    /// Every execution, in arrival order.
    pub fn log(&self) -> Vec<Execution> {
        self.state.executions.lock().expect("log lock").clone()
    }

    /// Whether an execution with this key took effect.
    pub fn applied(&self, key: &str) -> bool {
        self.state.applied.lock().expect("applied lock").contains_key(key)
    }

    pub fn set_lookups(&self, mode: Lookups) {
        *self.state.lookup_mode.lock().expect("mode lock") = mode;
    }

    /// Every lookup, in arrival order.
    pub fn lookups(&self) -> Vec<Lookup> {
        self.state.lookups.lock().expect("lookups lock").clone()
    }

    /// The most lookups that were ever in flight at once.
    pub fn max_lookups_in_flight(&self) -> u64 {
        self.state.max_lookups_in_flight.load(Ordering::SeqCst)
    }

    /// Waits until at least `count` lookups have arrived.
    pub async fn wait_for_lookups(&self, count: usize) {
        loop {
            let notified = self.state.looked_up.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.lookups().len() >= count {
                return;
            }
            notified.await;
        }
    }

    pub fn total(&self) -> usize {
        self.state.executions.lock().expect("log lock").len()
    }

    /// Waits until at least `count` executions have arrived.
    pub async fn wait_for_total(&self, count: usize) {
        loop {
            let notified = self.state.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.total() >= count {
                return;
            }
            notified.await;
        }
    }

    /// Waits until at least one execution with this key has arrived.
    pub async fn wait_for_key(&self, key: &str) {
        loop {
            let notified = self.state.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.executions(key) >= 1 {
                return;
            }
            notified.await;
        }
    }

    /// Lets every request held at gate `name`, now or later, go on.
    pub fn release(&self, name: &str) {
        // `send` would drop the value while no request waits yet; this keeps it.
        self.gate(name).send_replace(true);
    }

    fn gate(&self, name: &str) -> watch::Sender<bool> {
        gate(&self.state, name)
    }
}

fn gate(state: &State, name: &str) -> watch::Sender<bool> {
    state
        .gates
        .lock()
        .expect("gates lock")
        .entry(name.to_string())
        .or_insert_with(|| watch::channel(false).0)
        .clone()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

fn whole(body: Bytes) -> TestBody {
    Full::new(body).map_err(|never| match never {}).boxed_unsync()
}

/// A body sent frame by frame from a task: each event as it is written.
struct ChannelBody(tokio::sync::mpsc::Receiver<Result<Bytes, BoxError>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|next| next.map(|next| next.map(http_body::Frame::data)))
    }
}

/// The events of execution `id`, as `x-test-stream*` ask.
fn events(state: Arc<State>, id: u64, headers: &HeaderMap, count: usize) -> Response<TestBody> {
    let pad = header(headers, "x-test-stream-event-bytes").and_then(|n| n.parse::<usize>().ok());
    let hold = header(headers, "x-test-stream-hold").map(str::to_string);
    let fail = header(headers, "x-test-stream-fail") == Some("reset");
    let gap = header(headers, "x-test-stream-gap-ms").and_then(|n| n.parse::<u64>().ok());
    let event = move |index: usize| {
        let mut text = format!("data: {{\"execution\":{id},\"event\":{index}}}");
        if let Some(pad) = pad {
            let fill = pad.saturating_sub(text.len() + 2);
            text.push_str(&" ".repeat(fill));
        }
        text.push_str("\n\n");
        Bytes::from(text)
    };
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        for index in 0..count {
            if index == 1 {
                if let Some(name) = &hold {
                    let mut released = gate(&state, name).subscribe();
                    let _ = released.wait_for(|open| *open).await;
                }
                if fail {
                    let _ = sender.send(Err("the stream broken by the test".into())).await;
                    return;
                }
            }
            if let Some(gap) = gap.filter(|_| index > 0) {
                tokio::time::sleep(std::time::Duration::from_millis(gap)).await;
            }
            if sender.send(Ok(event(index))).await.is_err() {
                return;
            }
        }
    });
    let mut response = Response::new(ChannelBody(receiver).boxed_unsync());
    response
        .headers_mut()
        .insert("content-type", "text/event-stream".parse().expect("header"));
    response
        .headers_mut()
        .insert("x-execution-id", id.to_string().parse().expect("header"));
    response
}

const LOOKUP_PREFIX: &str = "/v1/payments/by-key/";

/// A probe's lookup: answered from what took effect, as `lookup_mode` says.
async fn lookup(state: Arc<State>, parts: http::request::Parts, body: Bytes) -> Response<Full<Bytes>> {
    let in_flight = state.lookups_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_lookups_in_flight.fetch_max(in_flight, Ordering::SeqCst);
    state.lookups.lock().expect("lookups lock").push(Lookup {
        at: tokio::time::Instant::now(),
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        headers: parts.headers.clone(),
        body_bytes: body.len(),
    });
    state.looked_up.notify_waiters();
    let mode = state.lookup_mode.lock().expect("mode lock").clone();
    let fixed = match mode {
        Lookups::Answer => None,
        Lookups::Fail(status) => Some(status),
        Lookups::Hold(name) => {
            let mut released = gate(&state, &name).subscribe();
            let _ = released.wait_for(|open| *open).await;
            None
        }
        Lookups::Slow(pause) => {
            tokio::time::sleep(pause).await;
            None
        }
    };
    let key = parts.uri.path().strip_prefix(LOOKUP_PREFIX).unwrap_or_default();
    let key = percent_encoding::percent_decode_str(key)
        .decode_utf8_lossy()
        .into_owned();
    let found = state.applied.lock().expect("applied lock").get(&key).copied();
    let (status, body) = match (fixed, found) {
        (Some(status), _) => (status, Bytes::from_static(b"{\"error\":\"lookup failed\"}")),
        (None, Some(id)) => (
            200,
            Bytes::from(format!("{{\"execution\":{id},\"key\":{key:?},\"found\":true}}")),
        ),
        (None, None) => (404, Bytes::from_static(b"{\"found\":false}")),
    };
    state.lookups_in_flight.fetch_sub(1, Ordering::SeqCst);
    let mut response = Response::new(Full::new(body));
    // The execution it found, as an execution's own answer names it.
    if let (None, Some(id)) = (fixed, found) {
        response
            .headers_mut()
            .insert("x-execution-id", id.to_string().parse().expect("header"));
    }
    *response.status_mut() = StatusCode::from_u16(status).expect("a status");
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().expect("header"));
    response
}

async fn handle(state: Arc<State>, request: Request<Incoming>) -> Result<Response<TestBody>, BoxError> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map(|body| body.to_bytes()).unwrap_or_default();
    if parts.uri.path().starts_with(LOOKUP_PREFIX) {
        return Ok(lookup(state, parts, body)
            .await
            .map(|body| body.map_err(|never| match never {}).boxed_unsync()));
    }
    let id = state.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    let key = header(&parts.headers, "idempotency-key").unwrap_or("").to_string();
    let effect = header(&parts.headers, "x-test-effect") != Some("never");
    if effect {
        state.applied.lock().expect("applied lock").insert(key.clone(), id);
    }
    state.executions.lock().expect("log lock").push(Execution {
        effect,
        id,
        at: tokio::time::Instant::now(),
        key: key.clone(),
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    state.arrived.notify_waiters();

    if parts.uri.path().ends_with("/slow") {
        tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    }
    if let Some(name) = header(&parts.headers, "x-test-hold") {
        let mut released = gate(&state, name).subscribe();
        let _ = released.wait_for(|open| *open).await;
    }
    if let Some(jitter) = header(&parts.headers, "x-test-jitter-ms").and_then(|n| n.parse::<u64>().ok()) {
        let pause = splitmix(id) % (jitter + 1);
        tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
    }
    match header(&parts.headers, "x-test-fail") {
        // Answering with an error makes hyper drop the connection without a response.
        Some("reset") => return Err("reset requested by the test".into()),
        Some("truncate") => return Ok(truncated().map(|body| body.map_err(|never| match never {}).boxed_unsync())),
        _ => {}
    }
    if let Some(count) = header(&parts.headers, "x-test-stream").and_then(|n| n.parse::<usize>().ok()) {
        return Ok(events(state.clone(), id, &parts.headers, count));
    }
    let status = header(&parts.headers, "x-test-status")
        .and_then(|status| status.parse().ok())
        .and_then(|status| StatusCode::from_u16(status).ok())
        .unwrap_or(StatusCode::CREATED);
    let body = match header(&parts.headers, "x-test-body-bytes").and_then(|n| n.parse::<usize>().ok()) {
        Some(size) => Bytes::from(vec![b'x'; size]),
        None if parts.uri.path().ends_with("/rpc") => jsonrpc_answer(id, &body),
        None => Bytes::from(format!(
            "{{\"execution\":{id},\"key\":{key:?},\"method\":\"{}\",\"body_bytes\":{}}}",
            parts.method,
            body.len()
        )),
    };
    let mut response = Response::new(whole(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().expect("header"));
    response
        .headers_mut()
        .insert("x-execution-id", id.to_string().parse().expect("header"));
    for field in parts.headers.get_all("x-test-response-header") {
        if let Some((name, value)) = field.to_str().ok().and_then(|field| field.split_once(':')) {
            response.headers_mut().append(
                http::HeaderName::from_bytes(name.trim().as_bytes()).expect("a header name"),
                value.trim().parse().expect("a header value"),
            );
        }
    }
    Ok(response)
}

/// The answer to a JSON-RPC call (or a batch of them): each call's own `id`, and the
/// execution as the result.
fn jsonrpc_answer(execution: u64, body: &[u8]) -> Bytes {
    let answer = |call: &serde_json::Value| serde_json::json!({"jsonrpc": "2.0", "id": call.get("id").cloned().unwrap_or_default(), "result": {"execution": execution}});
    let answered = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Array(calls)) => serde_json::Value::Array(calls.iter().map(answer).collect()),
        Ok(call) => answer(&call),
        Err(_) => {
            serde_json::json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "parse error"}})
        }
    };
    Bytes::from(answered.to_string())
}

/// A response whose body ends before its `Content-Length`: hyper sends the head and
/// what body there is, then closes the connection.
fn truncated() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(b"never sent in full")));
    response
        .headers_mut()
        .insert("content-length", "1000".parse().expect("header"));
    response
}

/// A small deterministic mixer, so jitter needs no RNG crate.
pub fn splitmix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
