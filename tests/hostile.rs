//! Hostile HTTP input over raw sockets: request smuggling attempts, an upstream that
//! frames its response two ways, header limits, slow clients, hostile idempotency keys.
//! Each case checks what reaches the upstream, not only what the client sees.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use support::{StoreKind, TestConfig, Upstream, send, send_raw};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(5);

/// A request hidden behind ambiguous framing (`/v1/reads/smuggled`) must never reach
/// the upstream, and a guarded request never goes out without its key.
fn assert_nothing_smuggled(upstream: &Upstream, case: &str) {
    for execution in upstream.log() {
        assert!(
            !execution.path.contains("smuggled"),
            "{case}: a smuggled request reached the upstream"
        );
        if execution.path.starts_with("/v1/payments") {
            assert!(
                execution.headers.contains_key("idempotency-key"),
                "{case}: a guarded request was forwarded without its key"
            );
        }
    }
}

#[tokio::test]
async fn smuggling_attempts_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let proxy = TestConfig::new(StoreKind::Memory, &upstream.url()).start().await;
    let smuggled = "GET /v1/reads/smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    for path in ["/v1/reads/ok", "/v1/payments/ok"] {
        let cases: Vec<(&str, String)> = vec![
            (
                "CL then TE",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: cl-te\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "TE then CL",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: te-cl\r\ntransfer-encoding: chunked\r\ncontent-length: 40\r\n\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "two differing CL",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: cl-cl\r\ncontent-length: 0\r\ncontent-length: 38\r\n\r\n{smuggled}"
                ),
            ),
            (
                "obfuscated TE",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: te-x\r\ntransfer-encoding: xchunked\r\ncontent-length: 0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "TE with a space before the colon",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: te-sp\r\ntransfer-encoding : chunked\r\n\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "TE chunked, identity",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: te-list\r\ntransfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "TE on HTTP/1.0",
                format!(
                    "POST {path} HTTP/1.0\r\nhost: x\r\nidempotency-key: te-10\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
                ),
            ),
        ];
        for (case, bytes) in cases {
            let answer = send_raw(proxy.addr(), bytes.as_bytes(), LIMIT).await;
            println!("{path} {case}: {:?}", answer.lines().next().unwrap_or("(closed)"));
            assert_nothing_smuggled(&upstream, case);
        }
    }
}

/// Bare LF line ends are legal to accept (RFC 9112 §2.2). What must hold is that
/// proxy and upstream agree: every request the upstream sees is one the client got
/// its own response for, because the proxy frames each request anew.
#[tokio::test]
async fn bare_lf_requests_are_framed_anew_and_accounted_for() {
    let upstream = Upstream::start().await;
    let proxy = TestConfig::new(StoreKind::Memory, &upstream.url()).start().await;
    let bytes = "POST /v1/reads/one HTTP/1.1\nhost: x\ncontent-length: 0\n\nGET /v1/reads/two HTTP/1.1\nhost: x\nconnection: close\n\n";
    let answer = send_raw(proxy.addr(), bytes.as_bytes(), LIMIT).await;
    let responses = answer.matches("HTTP/1.1 ").count();
    assert_eq!(responses, upstream.total(), "{answer}");
    for execution in upstream.log() {
        assert!(execution.path == "/v1/reads/one" || execution.path == "/v1/reads/two");
    }
}

/// An upstream that answers every request with both `Content-Length` and chunked
/// `Transfer-Encoding`, the chunked body being longer than the length.
async fn double_framed_upstream() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 8192];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buffer[..n]),
                    }
                }
                let response = b"HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n";
                let _ = stream.write_all(response).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_double_framed_upstream_response_reaches_the_client_with_one_framing() {
    let upstream = double_framed_upstream().await;
    let proxy = TestConfig::new(StoreKind::Memory, &format!("http://{upstream}"))
        .start()
        .await;
    for (path, key) in [("/v1/reads/x", None), ("/v1/payments", Some("framing"))] {
        let headers: Vec<(&str, &str)> = key.map(|k| vec![("idempotency-key", k)]).unwrap_or_default();
        let first = send(proxy.addr(), "POST", path, &headers, "{}").await;
        assert_eq!(first.status, 201, "{path}");
        assert_eq!(&first.body[..], b"hello world", "{path}");
        let framings = usize::from(first.headers.contains_key("content-length"))
            + usize::from(first.headers.contains_key("transfer-encoding"));
        assert_eq!(framings, 1, "{path}: {:?}", first.headers);
        if let Some(length) = first.header("content-length") {
            assert_eq!(length, "11", "{path}");
        }
        if key.is_some() {
            let replay = send(proxy.addr(), "POST", path, &headers, "{}").await;
            assert!(replay.replayed());
            assert_eq!(&replay.body[..], b"hello world");
            assert_eq!(replay.header("content-length"), Some("11"));
            assert!(!replay.headers.contains_key("transfer-encoding"));
        }
    }
}

#[tokio::test]
async fn a_one_byte_per_second_header_sender_is_closed_in_time() {
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "header_read_timeout = \"1s\"".into();
    let proxy = config.start().await;
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    let started = Instant::now();
    let head = b"GET /v1/reads HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut closed_after = None;
    for byte in head {
        if stream.write_all(&[*byte]).await.is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        let mut probe = [0u8; 256];
        // Wait a second for the next byte. Any answer (EOF, an error, or a 408) means
        // the proxy gave up on the head.
        if tokio::time::timeout(Duration::from_secs(1), stream.read(&mut probe))
            .await
            .is_ok()
        {
            closed_after = Some(started.elapsed());
            break;
        }
    }
    let closed_after = closed_after.expect("the proxy never closed a 1 byte/s sender");
    assert!(
        closed_after < Duration::from_secs(2) + Duration::from_millis(500),
        "closed after {closed_after:?}"
    );
    assert_eq!(upstream.total(), 0);
}

#[tokio::test]
async fn a_trickling_body_is_bounded_by_the_body_read_timeout() {
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "request_body_timeout = \"1s\"".into();
    let proxy = config.start().await;
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    let started = Instant::now();
    stream
        .write_all(b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nidempotency-key: trickle\r\ncontent-length: 100\r\n\r\n")
        .await
        .expect("write head");
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    for _ in 0..100 {
        let _ = stream.write_all(b"x").await;
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(250), stream.read(&mut buffer)).await {
            answer.extend_from_slice(&buffer[..n]);
            break;
        }
    }
    let elapsed = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request-body-timeout"), "{answer}");
    assert!(elapsed < Duration::from_secs(2), "answered after {elapsed:?}");
    assert_eq!(upstream.total(), 0);
}

#[tokio::test]
async fn hostile_keys_get_400_with_no_store_write_and_no_upstream_call() {
    let upstream = Upstream::start().await;
    let proxy = TestConfig::new(StoreKind::Memory, &upstream.url()).start().await;
    let long = "k".repeat(256);
    let heads: Vec<Vec<u8>> = vec![
        b"idempotency-key: \r\n".to_vec(),
        format!("idempotency-key: {long}\r\n").into_bytes(),
        b"idempotency-key: caf\xc3\xa9\r\n".to_vec(),
        b"idempotency-key: a\x01b\r\n".to_vec(),
        b"idempotency-key: a\tb\r\n".to_vec(),
        b"idempotency-key: a\r\nidempotency-key: a\r\n".to_vec(),
        b"idempotency-key: a, b\r\n".to_vec(),
        b"idempotency-key: \"a\", \"b\"\r\n".to_vec(),
        b"idempotency-key: \"a\r\n".to_vec(),
    ];
    for head in heads {
        let mut request =
            b"POST /v1/payments HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n".to_vec();
        request.extend_from_slice(&head);
        request.extend_from_slice(b"\r\n");
        let answer = send_raw(proxy.addr(), &request, LIMIT).await;
        let shown = String::from_utf8_lossy(&head).into_owned();
        assert!(answer.starts_with("HTTP/1.1 400"), "{shown:?}: {answer}");
        // A control character is refused by hyper's parser before the proxy sees it.
        let refused_by_parser = !answer.contains("application/problem+json");
        assert!(
            answer.contains("invalid-idempotency-key") || (refused_by_parser && shown.contains('\u{1}')),
            "{shown:?}: {answer}"
        );
    }
    assert_eq!(upstream.total(), 0);
    match proxy.running.store().engine() {
        idemproxy::store::Engine::Memory(store) => assert!(store.is_empty(), "a hostile key reached the store"),
        _ => unreachable!("a memory proxy"),
    }
}

/// A client that declares bodies it never sends holds no more of the byte budget than
/// one body per connection, and not for long: two HTTP/2 connections with 96 streams
/// each declaring 1 MiB and sending no DATA hold at most 2 MiB of a 16 MiB budget, so a
/// small guarded request beside them is served; and the idle bodies are cut (408) once
/// no byte has come for `request_body_idle_timeout`, and what they held comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_bodies_that_never_come_hold_one_body_per_connection_and_are_cut() {
    use support::client::{metric, until_metric};
    use support::h2raw::{self, END_HEADERS, HEADERS, frame};
    const MIB: u64 = 1024 * 1024;
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = format!(
        "max_buffered_bytes = {}\nmax_request_body_bytes = {MIB}\nrequest_body_idle_timeout = \"2s\"",
        16 * MIB
    );
    let proxy = config.start().await;
    let mut connections = Vec::new();
    for n in 0..2 {
        let mut connection = h2raw::Connection::open(proxy.addr()).await;
        for stream in 0..96u32 {
            let key = format!("held-{n}-{stream}");
            let block = h2raw::request_for(
                "POST",
                "/v1/payments",
                Some("localhost"),
                &[("idempotency-key", &key), ("content-length", "1048576")],
            );
            connection
                .writer
                .write_all(&frame(HEADERS, END_HEADERS, 1 + 2 * stream, &block))
                .await
                .expect("send a request head");
        }
        connections.push(connection);
    }
    until_metric(proxy.admin(), "idemproxy_guarded_requests_in_flight", 192.0).await;
    let held = metric(proxy.admin(), "idemproxy_buffered_bytes")
        .await
        .expect("the budget held");
    assert!(held <= (2 * MIB) as f64, "{held} bytes held for bodies nobody sent");
    let small = send(
        proxy.addr(),
        "POST",
        "/v1/payments",
        &[("idempotency-key", "small")],
        "{}",
    )
    .await;
    assert_eq!(small.status, 201, "a small request beside them: {small:?}");
    // Cut once idle: every stream is answered 408, and the budget is given back.
    until_metric(proxy.admin(), "idemproxy_guarded_requests_in_flight", 0.0).await;
    until_metric(proxy.admin(), "idemproxy_buffered_bytes", 0.0).await;
    let timed_out = "idemproxy_requests_total{route=\"payments\",outcome=\"rejected\"}";
    assert_eq!(metric(proxy.admin(), timed_out).await, Some(192.0));
    assert_eq!(upstream.log().len(), 1, "only the small request was forwarded");
}

/// Replays held for clients that do not read count in the byte budget: a 512 KiB
/// response recorded, then two HTTP/2 connections that give the proxy no window
/// (`SETTINGS_INITIAL_WINDOW_SIZE = 0`) ask for it 50 times each and never read. The
/// replays held take at most `max_buffered_bytes` (past it, 503 `overloaded`), not one
/// copy per stream without end; and they are given back when the client goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_that_nobody_reads_are_held_within_the_byte_budget() {
    use support::client::{metric, until_metric};
    use support::h2raw::{self, END_HEADERS, END_STREAM, HEADERS, PREFACE, SETTINGS, frame};
    const MIB: u64 = 1024 * 1024;
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = format!("max_buffered_bytes = {}", 16 * MIB);
    let proxy = config.start().await;
    let headers = [("idempotency-key", "big-replay"), ("x-test-body-bytes", "524288")];
    let first = send(proxy.addr(), "POST", "/v1/payments", &headers, "").await;
    assert_eq!((first.status.as_u16(), first.body.len()), (201, 512 * 1024));
    let mut connections = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
        // SETTINGS_INITIAL_WINDOW_SIZE (0x4) = 0: the proxy may send no DATA.
        let mut settings = PREFACE.to_vec();
        settings.extend_from_slice(&frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0, 0]));
        stream.write_all(&settings).await.expect("the preface");
        for n in 0..50u32 {
            let block = h2raw::request_for(
                "POST",
                "/v1/payments",
                Some("localhost"),
                &[("idempotency-key", "big-replay")],
            );
            stream
                .write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * n, &block))
                .await
                .expect("a replay request");
        }
        connections.push(stream);
    }
    let replayed = "idemproxy_requests_total{route=\"payments\",outcome=\"replayed\"}";
    let refused = "idemproxy_requests_total{route=\"payments\",outcome=\"rejected\"}";
    let started = Instant::now();
    loop {
        let answered =
            metric(proxy.admin(), replayed).await.unwrap_or(0.0) + metric(proxy.admin(), refused).await.unwrap_or(0.0);
        if answered >= 100.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "only {answered} of 100 answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held = metric(proxy.admin(), "idemproxy_buffered_bytes")
        .await
        .expect("the budget");
    let replays = metric(proxy.admin(), replayed).await.expect("replays");
    assert!(held <= (16 * MIB) as f64, "{held} bytes held");
    assert!(
        (20.0..100.0).contains(&replays),
        "{replays} of 100 replays held for clients that do not read"
    );
    drop(connections);
    until_metric(proxy.admin(), "idemproxy_buffered_bytes", 0.0).await;
    assert_eq!(upstream.executions("big-replay"), 1);
}
