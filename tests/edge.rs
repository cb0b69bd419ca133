//! The edge (DESIGN §7, §10): every connection bounded in time from its accept, the
//! connection limit and the open-files limit. Real sockets, a real child process where
//! the property is about the process.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use support::{ChildProxy, StoreKind, TestConfig, Upstream, post_key, send};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Waits until the server closes `stream` (EOF or reset), and returns when it did;
/// `None` if it is still open at `limit`.
async fn closed_by(mut stream: TcpStream, limit: Instant) -> Option<Instant> {
    let mut buffer = [0u8; 256];
    loop {
        match tokio::time::timeout_at(limit, stream.read(&mut buffer)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(Instant::now()),
            Ok(Ok(_)) => {}
        }
    }
}

// === 1. every connection is bounded in time ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_nothing_are_closed_within_the_header_read_timeout() {
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "header_read_timeout = \"1s\"".into();
    let proxy = config.start().await;
    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..200 {
        silent.push(TcpStream::connect(proxy.addr()).await.expect("connect"));
    }
    // header_read_timeout + 1 s, from the last connect.
    let limit = Instant::now() + Duration::from_secs(2);
    let closes = futures_join(silent.into_iter().map(|stream| closed_by(stream, limit))).await;
    let open = closes.iter().filter(|closed| closed.is_none()).count();
    assert_eq!(
        open, 0,
        "{open} of 200 silent connections still open after header_read_timeout + 1 s"
    );
    let latest = closes.iter().flatten().max().expect("some closed");
    println!(
        "200 silent connections closed {:.2?} after the first was opened",
        *latest - opened
    );
    // The proxy still serves.
    assert_eq!(post_key(proxy.addr(), "after").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_after_the_header_read_timeout() {
    use http_body_util::{BodyExt, Full};
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "header_read_timeout = \"1s\"".into();
    let proxy = config.start().await;
    let stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2c handshake");
    let connection = tokio::spawn(connection);
    let request = http::Request::get(format!("http://{}/v1/reads/x", proxy.addr()))
        .body(Full::new(bytes::Bytes::new()))
        .expect("request");
    let response = sender.send_request(request).await.expect("h2 request");
    assert_eq!(response.status(), 201);
    response.into_body().collect().await.expect("body");
    let answered = Instant::now();
    // No stream open now: the server must end the connection by itself.
    let ended = tokio::time::timeout(Duration::from_secs(3), connection).await;
    assert!(
        ended.is_ok(),
        "an idle HTTP/2 connection stayed open 3 s after its last answer"
    );
    println!(
        "idle h2 connection closed {:.2?} after its last answer",
        answered.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http1_keep_alive_connection_is_closed_after_the_header_read_timeout() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "header_read_timeout = \"1s\"".into();
    let proxy = config.start().await;
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(b"GET /v1/reads/x HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.expect("a response");
    assert_eq!(&head, b"HTTP/1.1 201");
    let closed = closed_by(stream, Instant::now() + Duration::from_secs(2)).await;
    assert!(closed.is_some(), "an idle keep-alive connection stayed open");
}

/// `join_all` without a futures dependency: spawn each, await in order.
async fn futures_join<T: Send + 'static>(
    futures: impl IntoIterator<Item = impl std::future::Future<Output = T> + Send + 'static>,
) -> Vec<T> {
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}

// === 2. the connection limit ===

/// The number of connections waiting in the accept queue of the socket listening on
/// `port`, from `/proc/net/tcp` (for a listening socket, `rx_queue` is that queue).
fn accept_queue(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("read /proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = fields.get(1)?;
            let state = fields.get(3)?;
            let queues = fields.get(4)?;
            let local_port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            let rx = usize::from_str_radix(queues.split(':').nth(1)?, 16).ok()?;
            (local_port == port && *state == "0A").then_some(rx)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_connections_new_clients_wait_in_the_backlog_and_are_served_when_a_slot_frees() {
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "max_connections = 2\nworkers = 1".into();
    let proxy = config.start().await;
    let addr = proxy.addr();
    // Two clients hold both slots with a request held at the upstream.
    let held = |gate: &'static str| {
        tokio::spawn(async move { send(addr, "POST", "/v1/reads/held", &[("x-test-hold", gate)], "").await })
    };
    let first = held("first");
    let second = held("second");
    upstream.wait_for_total(2).await;
    // A third connects (the kernel completes its handshake) and asks: it is not
    // accepted, so it waits in the listening socket's accept queue.
    let third = tokio::spawn(async move { post_key(addr, "third").await });
    let started = Instant::now();
    while accept_queue(addr.port()) < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the third client never reached the backlog"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(upstream.total(), 2, "the third request was served past the limit");
    // A slot frees: the third is accepted and served.
    upstream.release("first");
    assert_eq!(first.await.expect("first").status, 201);
    let third = third.await.expect("third");
    assert_eq!(third.status, 201, "{third:?}");
    assert_eq!(accept_queue(addr.port()), 0);
    upstream.release("second");
    assert_eq!(second.await.expect("second").status, 201);
}

// === 3. the open-files limit ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_files_limit_is_raised_to_the_hard_one_and_the_capacity_logged() {
    let upstream = Upstream::start().await;
    let config = TestConfig::new(StoreKind::Memory, &upstream.url());
    let log = tempfile::NamedTempFile::new().expect("log file");
    let proxy = ChildProxy::start_via(&config, &["prlimit", "--nofile=300:4096"], Some(log.path())).await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", proxy.child.id())).expect("limits");
    let open_files = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("the open-files line");
    let numbers: Vec<&str> = open_files.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, ["4096", "4096"], "{open_files}");
    let logged = std::fs::read_to_string(log.path()).expect("read the log");
    let line = logged
        .lines()
        .find(|line| line.contains("idemproxy listening"))
        .expect("the start-up line");
    assert!(
        line.contains("connections=1920")
            && line.contains("open_files_limit=4096")
            && line.contains("open_files_limit_was=300"),
        "{line}"
    );
}
