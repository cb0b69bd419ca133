//! A plain HTTP/1.1 client over real sockets, one connection per request, and a raw
//! socket sender for malformed input.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, Clone)]
pub struct TestResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl TestResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    /// The problem slug of an RFC 9457 response, after asserting its shape.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        assert_eq!(self.header("cache-control"), Some("no-store"), "{self:?}");
        let body: serde_json::Value = serde_json::from_slice(&self.body).expect("problem body is JSON");
        assert_eq!(body["status"].as_u64(), Some(u64::from(self.status.as_u16())), "{body}");
        assert!(body["title"].is_string() && body["detail"].is_string(), "{body}");
        let kind = body["type"].as_str().expect("problem type");
        kind.strip_prefix("urn:idemproxy:problem:")
            .unwrap_or_else(|| panic!("unexpected problem type {kind}"))
            .to_string()
    }

    /// The upstream execution id echoed in the body.
    pub fn execution(&self) -> u64 {
        let body: serde_json::Value = serde_json::from_slice(&self.body).expect("echo body is JSON");
        body["execution"].as_u64().expect("execution id")
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// Waits until `admin`'s `/metrics` shows `line` at `value` (a condition the proxy
/// reports, polled for at most 10 s): the synchronisation point for a test that must
/// act only once the proxy is in a given state.
pub async fn until_metric(admin: SocketAddr, line: &str, value: f64) {
    let started = tokio::time::Instant::now();
    while metric(admin, line).await != Some(value) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{line} never reached {value}: {:?}",
            metric(admin, line).await
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// `join_all` without a futures dependency: spawn each, await in order.
pub async fn join_all<T: Send + 'static>(
    futures: impl IntoIterator<Item = impl std::future::Future<Output = T> + Send + 'static>,
) -> Vec<T> {
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}

/// Sends one request on a fresh connection and reads the whole response.
/// The value of one metric line on `admin`'s `/metrics`, e.g.
/// `idemproxy_fenced_writes_total{op="complete"}`.
pub async fn metric(admin: SocketAddr, line: &str) -> Option<f64> {
    let metrics = send(admin, "GET", "/metrics", &[], "").await;
    String::from_utf8_lossy(&metrics.body)
        .lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.trim().parse().ok())
}

pub async fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> TestResponse {
    try_send(addr, method, path, headers, body)
        .await
        .unwrap_or_else(|error| panic!("{method} {path} via {addr} failed: {error}"))
}

pub async fn try_send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<TestResponse, Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(addr).await?;
    exchange(stream, addr, method, path, headers, body).await
}

/// A keyed `POST {}` that may fail (its proxy killed mid-request).
#[allow(dead_code)]
pub async fn try_send_key(
    addr: SocketAddr,
    key: &str,
    headers: &[(&str, &str)],
) -> Result<TestResponse, Box<dyn std::error::Error + Send + Sync>> {
    let mut all = vec![("idempotency-key", key), ("content-type", "application/json")];
    all.extend_from_slice(headers);
    try_send(addr, "POST", "/v1/payments", &all, "{}").await
}

/// `send` from the loopback address `from` (127.0.0.2, 127.0.0.3, ...): another
/// client address, as the proxy sees it.
#[allow(dead_code)]
pub async fn send_from(
    from: std::net::IpAddr,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TestResponse {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(from, 0)).expect("bind the client address");
    let stream = socket.connect(addr).await.expect("connect");
    exchange(stream, addr, method, path, headers, body)
        .await
        .unwrap_or_else(|error| panic!("{method} {path} via {addr} from {from} failed: {error}"))
}

async fn exchange(
    stream: TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<TestResponse, Box<dyn std::error::Error + Send + Sync>> {
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let mut request = Request::builder().method(method).uri(path);
    // The socket's address, unless the test names a host of its own.
    if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("host")) {
        request = request.header("host", addr.to_string());
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))?;
    let response = sender.send_request(request).await?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(TestResponse {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// Writes `bytes` on a fresh connection and returns everything read until the
/// server closes it or `limit` passes.
pub async fn send_raw(addr: SocketAddr, bytes: &[u8], limit: std::time::Duration) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A pooled keep-alive client, for storms of many requests.
pub type PooledClient =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn pooled_client() -> PooledClient {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http()
}

/// Sends one request on the pool; `Err` when no full answer came within `timeout`.
pub async fn pooled_send(
    client: &PooledClient,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &'static str,
    timeout: std::time::Duration,
) -> Result<TestResponse, String> {
    let mut request = Request::builder().method("POST").uri(format!("http://{addr}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(TestResponse {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err("client timeout".into()))
}

/// Sends with `request` until the answer is no longer one of the `interim` (status,
/// problem slug) pairs, checking that every answer before it was one of them. A poll
/// on a condition, bounded at 15 s. Returns the first other answer.
pub async fn until_not<F, Fut>(mut request: F, interim: &[(u16, &str)]) -> TestResponse
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = TestResponse>,
{
    let started = tokio::time::Instant::now();
    loop {
        let response = request().await;
        let status = response.status.as_u16();
        let waiting = interim
            .iter()
            .any(|(code, slug)| *code == status && response.problem() == *slug);
        if !waiting {
            return response;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(15),
            "still {status} after 15 s: {response:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// `POST /v1/payments` with `{}` and one idempotency key: the tests' most common request.
pub async fn post_key(addr: SocketAddr, key: &str) -> TestResponse {
    send(addr, "POST", "/v1/payments", &[("idempotency-key", key)], "{}").await
}

/// A POST to the payments route with `key` (or none), `body` and the `extra` fields.
pub async fn post(addr: SocketAddr, key: Option<&str>, body: &str, extra: &[(&str, &str)]) -> TestResponse {
    let mut headers: Vec<(&str, &str)> = key.map(|key| ("idempotency-key", key)).into_iter().collect();
    headers.extend_from_slice(extra);
    send(addr, "POST", "/v1/payments", &headers, body).await
}

/// The IPv4 sockets on local `port`, from `/proc/net/tcp`: each one's state (`0A`
/// listening, `01` established) and its receive queue (for a listening socket, the
/// connections in its accept queue; for an established one, the bytes nobody read).
pub fn tcp_sockets(port: u16) -> Vec<(String, usize)> {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("read /proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(fields.get(1)?.rsplit(':').next()?, 16).ok()?;
            let rx = usize::from_str_radix(fields.get(4)?.split(':').nth(1)?, 16).ok()?;
            let state = fields.get(3)?;
            (local_port == port).then(|| (state.to_string(), rx))
        })
        .collect()
}
