//! Connections (docs/design.md §7, §10): every connection bounded in time from its accept,
//! the connection limit and the open-files limit, HTTP/2 floods. Real sockets, a real
//! child process where the property is about the process.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use support::client::join_all;
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
    let closes = join_all(silent.into_iter().map(|stream| closed_by(stream, limit))).await;
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

// === 2. the connection limit ===

/// The number of connections waiting in the accept queue of the socket listening on
/// `port`, from `/proc/net/tcp` (for a listening socket, `rx_queue` is that queue).
fn accept_queue(port: u16) -> usize {
    support::client::tcp_sockets(port)
        .into_iter()
        .filter(|(state, _)| state == "0A")
        .map(|(_, rx)| rx)
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
    // A third connects and asks: the worker accepts it and holds it unserved, with no
    // slot for it. A fourth is not accepted: it waits in the listening socket's accept
    // queue (the kernel completed its handshake).
    let third = tokio::spawn(async move { post_key(addr, "third").await });
    let fourth = tokio::spawn(async move { post_key(addr, "fourth").await });
    let started = Instant::now();
    while accept_queue(addr.port()) < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the fourth client never reached the backlog"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(upstream.total(), 2, "a request was served past the limit");
    // A slot frees: the held one is served, and the one in the backlog is accepted.
    upstream.release("first");
    assert_eq!(first.await.expect("first").status, 201);
    upstream.wait_for_total(3).await;
    upstream.release("second");
    assert_eq!(second.await.expect("second").status, 201);
    for answer in [third.await.expect("third"), fourth.await.expect("fourth")] {
        assert_eq!(answer.status, 201, "{answer:?}");
    }
    assert_eq!(accept_queue(addr.port()), 0);
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

// === 4. HTTP/2 under abuse ===

use support::h2raw::{self, CANCEL, CONTINUATION, END_HEADERS, END_STREAM, GOAWAY, HEADERS, RST_STREAM, frame};
use tokio::io::AsyncWriteExt;

/// What a flood cost the proxy process.
fn cost(pid: u32, rss_before: u64, cpu_before: u64) -> (u64, u64) {
    let rss_growth = h2raw::rss_kib(pid).saturating_sub(rss_before);
    let cpu_ms = (h2raw::cpu_ticks(pid) - cpu_before) * 10;
    (rss_growth, cpu_ms)
}

/// Reads what the server sends until it closes the connection; returns the GOAWAY
/// error code, if one came, and every RST_STREAM error code.
async fn until_closed(connection: &mut h2raw::Connection) -> (Option<u32>, Vec<u32>) {
    let mut goaway = None;
    let mut resets = Vec::new();
    while let Some(frame) = connection.next(Duration::from_secs(10)).await {
        match frame.kind {
            GOAWAY => goaway = frame.error_code(),
            RST_STREAM => resets.extend(frame.error_code()),
            _ => {}
        }
    }
    (goaway, resets)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rapid_reset_flood_is_cut_off_and_other_clients_are_served() {
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&TestConfig::new(StoreKind::Memory, &upstream.url())).await;
    let pid = proxy.child.id();
    let (rss_before, cpu_before) = (h2raw::rss_kib(pid), h2raw::cpu_ticks(pid));
    let mut connection = h2raw::Connection::open(proxy.addr).await;
    let block = h2raw::request("GET", "/v1/reads/flood", &[]);
    // 10,000 streams, each opened and reset at once, in batches of 100.
    let mut opened = 0;
    'flood: for batch in 0..100u32 {
        let mut bytes = Vec::new();
        for index in 0..100u32 {
            let stream = 1 + 2 * (batch * 100 + index);
            bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, stream, &block));
            bytes.extend(frame(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()));
        }
        if connection.writer.write_all(&bytes).await.is_err() {
            break 'flood;
        }
        opened += 100;
    }
    let (goaway, _) = until_closed(&mut connection).await;
    let (rss_growth, cpu_ms) = cost(pid, rss_before, cpu_before);
    let forwarded = upstream
        .log()
        .iter()
        .filter(|execution| execution.path == "/v1/reads/flood")
        .count();
    println!(
        "rapid reset: {opened} streams written before the close, GOAWAY {goaway:?}, {forwarded} reached the \
         upstream; proxy RSS +{rss_growth} KiB, CPU {cpu_ms} ms"
    );
    assert_eq!(goaway, Some(0xb), "the flood must end with GOAWAY ENHANCE_YOUR_CALM");
    assert!(forwarded < 1000, "{forwarded} flood requests reached the upstream");
    assert!(rss_growth < 32 * 1024, "RSS grew {rss_growth} KiB");
    // Another client is served, and so is a new connection of the same kind.
    assert_eq!(post_key(proxy.addr, "after-reset-flood").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_flood_is_cut_off_without_buffering_it() {
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&TestConfig::new(StoreKind::Memory, &upstream.url())).await;
    let pid = proxy.child.id();
    let (rss_before, cpu_before) = (h2raw::rss_kib(pid), h2raw::cpu_ticks(pid));
    let mut connection = h2raw::Connection::open(proxy.addr).await;
    // A header block that never ends: HEADERS without END_HEADERS, then up to 16 MiB of
    // CONTINUATION frames of 16 KiB of literal fields each.
    let block = h2raw::request("POST", "/v1/reads/continuation", &[]);
    connection
        .writer
        .write_all(&frame(HEADERS, 0, 1, &block))
        .await
        .expect("headers");
    let mut chunk = Vec::new();
    while chunk.len() < 16_000 {
        h2raw::literal(&mut chunk, "x-flood", &"a".repeat(200));
    }
    let mut written = 0;
    for _ in 0..1024 {
        if connection
            .writer
            .write_all(&frame(CONTINUATION, 0, 1, &chunk))
            .await
            .is_err()
        {
            break;
        }
        written += 1;
    }
    let (goaway, _) = until_closed(&mut connection).await;
    let (rss_growth, cpu_ms) = cost(pid, rss_before, cpu_before);
    println!(
        "CONTINUATION flood: {written} frames of {} bytes written before the close, GOAWAY {goaway:?}; proxy RSS \
         +{rss_growth} KiB, CPU {cpu_ms} ms",
        chunk.len()
    );
    assert!(goaway.is_some(), "the flood must end with a GOAWAY");
    assert!(written < 1024, "the server read all 16 MiB of one header block");
    assert!(rss_growth < 16 * 1024, "RSS grew {rss_growth} KiB");
    assert_eq!(upstream.total(), 0);
    assert_eq!(post_key(proxy.addr, "after-continuation-flood").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_beyond_the_limit_are_refused_and_other_clients_are_served() {
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&TestConfig::new(StoreKind::Memory, &upstream.url())).await;
    let pid = proxy.child.id();
    let (rss_before, cpu_before) = (h2raw::rss_kib(pid), h2raw::cpu_ticks(pid));
    let mut connection = h2raw::Connection::open(proxy.addr).await;
    // 300 streams on one connection, each a complete request held at the upstream:
    // the server advertises 128.
    let block = h2raw::request("POST", "/v1/reads/held", &[("x-test-hold", "streams")]);
    let mut bytes = Vec::new();
    for index in 0..300u32 {
        bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * index, &block));
    }
    connection.writer.write_all(&bytes).await.expect("write the streams");
    let mut refused = 0;
    while refused < 300 - 128 {
        let frame = connection
            .next(Duration::from_secs(10))
            .await
            .expect("the server answers");
        if frame.kind == RST_STREAM && frame.error_code() == Some(h2raw::REFUSED_STREAM) {
            refused += 1;
        }
    }
    upstream.wait_for_total(128).await;
    let (rss_growth, cpu_ms) = cost(pid, rss_before, cpu_before);
    println!(
        "300 streams on one connection: 128 served, {refused} refused; proxy RSS +{rss_growth} KiB, CPU {cpu_ms} ms"
    );
    assert_eq!(
        upstream.total(),
        128,
        "more streams than the limit reached the upstream"
    );
    // Others are served meanwhile.
    assert_eq!(post_key(proxy.addr, "beside-the-streams").await.status, 201);
    upstream.release("streams");
    assert_eq!(upstream.total(), 129);
}
