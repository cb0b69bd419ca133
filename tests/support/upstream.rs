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
}

#[derive(Default)]
struct State {
    next_id: AtomicU64,
    executions: Mutex<Vec<Execution>>,
    arrived: Notify,
    gates: Mutex<HashMap<String, watch::Sender<bool>>>,
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

async fn handle(state: Arc<State>, request: Request<Incoming>) -> Result<Response<Full<Bytes>>, BoxError> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map(|body| body.to_bytes()).unwrap_or_default();
    let id = state.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    let key = header(&parts.headers, "idempotency-key").unwrap_or("").to_string();
    state.executions.lock().expect("log lock").push(Execution {
        id,
        at: tokio::time::Instant::now(),
        key: key.clone(),
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    state.arrived.notify_waiters();

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
        Some("truncate") => return Ok(truncated()),
        _ => {}
    }
    let status = header(&parts.headers, "x-test-status")
        .and_then(|status| status.parse().ok())
        .and_then(|status| StatusCode::from_u16(status).ok())
        .unwrap_or(StatusCode::CREATED);
    let body = match header(&parts.headers, "x-test-body-bytes").and_then(|n| n.parse::<usize>().ok()) {
        Some(size) => Bytes::from(vec![b'x'; size]),
        None => Bytes::from(format!(
            "{{\"execution\":{id},\"key\":{key:?},\"method\":\"{}\",\"body_bytes\":{}}}",
            parts.method,
            body.len()
        )),
    };
    let mut response = Response::new(Full::new(body));
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
