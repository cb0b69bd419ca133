//! Load shaped like a slow legacy API (docs/design.md §13): thousands of guarded requests held
//! at the upstream at once, a byte budget that refuses what it cannot hold and never a
//! small request for what others might send, memory that stays inside the budget, and
//! a connection limit that holds exactly whichever worker's socket a client reaches.
//! Real sockets, a real `redis-server` where the workers must have sockets of their own.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::client::{join_all, metric, until_metric};
use support::h2raw::rss_kib;
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn held_post(addr: SocketAddr, key: String, gate: &'static str) -> TestResponse {
    send(
        addr,
        "POST",
        "/v1/payments",
        &[("idempotency-key", &key), ("x-test-hold", gate)],
        "{\"a\":1}",
    )
    .await
}

/// 1,500 small guarded requests held at the upstream at once, on the defaults: every
/// one is forwarded (the old count bound of 1,024 refused 476 of them with 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifteen_hundred_small_requests_in_flight_are_all_served_on_the_defaults() {
    let upstream = Upstream::start().await;
    let proxy = TestConfig::new(StoreKind::Memory, &upstream.url()).start().await;
    let addr = proxy.addr();
    let answers = tokio::spawn(join_all(
        (0..1500).map(move |n| held_post(addr, format!("many-{n}"), "many")),
    ));
    let reached = tokio::time::timeout(Duration::from_secs(60), upstream.wait_for_total(1500)).await;
    if reached.is_err() {
        upstream.release("many");
        let answers = answers.await.expect("answers");
        let refused = answers.iter().filter(|answer| answer.status == 503).count();
        panic!("{} of 1500 reached the upstream; {refused} got 503", upstream.total());
    }
    until_metric(proxy.admin(), "idemproxy_guarded_requests_in_flight", 1500.0).await;
    let held = metric(proxy.admin(), "idemproxy_buffered_bytes")
        .await
        .expect("the gauge");
    assert_eq!(held, 1500.0 * 7.0, "each holds its 7-byte body, and nothing more");
    upstream.release("many");
    let answers = answers.await.expect("answers");
    let created = answers.iter().filter(|answer| answer.status == 201).count();
    assert_eq!(
        created,
        1500,
        "{:?}",
        answers.iter().find(|answer| answer.status != 201)
    );
    until_metric(proxy.admin(), "idemproxy_buffered_bytes", 0.0).await;
}

/// One request with a body of `size` bytes, its length declared or chunked.
async fn big_post(addr: SocketAddr, key: String, size: usize, chunked: bool) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let framing = if chunked {
        "transfer-encoding: chunked".to_string()
    } else {
        format!("content-length: {size}")
    };
    let head = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: localhost\r\nidempotency-key: {key}\r\nx-test-hold: big\r\n{framing}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("head");
    let piece = vec![b'x'; 64 * 1024];
    let mut sent = 0;
    while sent < size {
        let n = piece.len().min(size - sent);
        let written = if chunked {
            let mut frame = format!("{n:x}\r\n").into_bytes();
            frame.extend_from_slice(&piece[..n]);
            frame.extend_from_slice(b"\r\n");
            stream.write_all(&frame).await
        } else {
            stream.write_all(&piece[..n]).await
        };
        if written.is_err() {
            break;
        }
        sent += n;
    }
    if chunked {
        let _ = stream.write_all(b"0\r\n\r\n").await;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer);
    text.split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or(0)
}

/// Past the byte budget large bodies get 503 `overloaded` (declared ones before a byte
/// is read, chunked ones once the budget is spent), small requests are still served,
/// and the process's memory stays inside the budget plus a bounded overhead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_byte_budget_large_bodies_get_503_and_small_requests_still_pass() {
    const MIB: usize = 1024 * 1024;
    const BODY: usize = 1_000_000;
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    // 16 MiB: request bodies may hold 12 MiB of it, twelve of these 1,000,000-byte ones.
    config.server = format!("max_buffered_bytes = {}\nmax_request_body_bytes = {MIB}", 16 * MIB);
    config.idempotency = format!("max_response_body_bytes = {MIB}");
    let proxy = ChildProxy::start(&config).await;
    let pid = proxy.child.id();
    let addr = proxy.addr;
    let before = rss_kib(pid);
    let large = tokio::spawn(join_all(
        (0..40).map(move |n| big_post(addr, format!("big-{n}"), BODY, n % 4 == 3)),
    ));
    // Twelve are admitted and held at the upstream; the others are refused.
    tokio::time::timeout(Duration::from_secs(30), upstream.wait_for_total(12))
        .await
        .unwrap_or_else(|_| panic!("only {} large bodies reached the upstream", upstream.total()));
    let overloaded = "idemproxy_requests_total{route=\"payments\",outcome=\"rejected\"}";
    until_metric(proxy.admin, overloaded, 28.0).await;
    assert_eq!(upstream.total(), 12);
    // Small requests still pass: the budget they need is there.
    let small = join_all((0..50).map(move |n| async move {
        send(
            addr,
            "POST",
            "/v1/payments",
            &[("idempotency-key", &format!("small-{n}"))],
            "{\"b\":2}",
        )
        .await
    }))
    .await;
    assert!(
        small.iter().all(|answer| answer.status == 201),
        "{:?}",
        small.iter().find(|a| a.status != 201)
    );
    let held_rss = rss_kib(pid);
    upstream.release("big");
    let statuses = large.await.expect("large requests");
    let served = statuses.iter().filter(|status| **status == 201).count();
    let refused = statuses.iter().filter(|status| **status == 503).count();
    assert_eq!((served, refused), (12, 28), "{statuses:?}");
    let peak = peak_rss_kib(pid);
    eprintln!(
        "rss: {before} KiB before, {held_rss} KiB with 12 MB of bodies held, peak {peak} KiB (budget {} KiB)",
        16 * 1024
    );
    // The budget plus what 40 connections and their requests cost besides their bodies:
    // 64 KiB of read buffer each, the copy a chunked body is joined into, the allocator's
    // free pages. Measured 18-26 MiB over `before` (docs/performance.md, "A buffered
    // body's memory"); 32-41 MiB while a chunked body grew by doubling.
    assert!(
        peak < before + 16 * 1024 + 20 * 1024,
        "peak RSS {peak} KiB passed {before} KiB + the 16 MiB budget + 20 MiB"
    );
    until_metric(proxy.admin, "idemproxy_buffered_bytes", 0.0).await;
}

fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("read the process status")
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:")?.split_whitespace().next()?.parse().ok())
        .expect("VmHWM")
}

/// Responses read for recording draw on the whole budget, request bodies on three
/// quarters of it; a response the budget cannot hold any more still reaches its client
/// in full, streamed, and its key becomes unknown (it could not be recorded), as a
/// response too large to record does. Once the budget is free again, the same
/// response is recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_budget_cannot_hold_is_streamed_and_its_key_becomes_unknown() {
    const MIB: usize = 1024 * 1024;
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = format!("max_buffered_bytes = {}\nmax_request_body_bytes = {}", 4 * MIB, 3 * MIB);
    config.idempotency = format!("max_response_body_bytes = {}", 2 * MIB);
    let proxy = config.start().await;
    let addr = proxy.addr();
    // A held request whose body takes 2.9 of the 4 MiB.
    let body = "x".repeat(29 * MIB / 10);
    let held = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/v1/payments",
            &[("idempotency-key", "holds"), ("x-test-hold", "holds")],
            &body,
        )
        .await
    });
    upstream.wait_for_key("holds").await;
    let size = 3 * MIB / 2;
    let wide = |key: &'static str| async move {
        let bytes = size.to_string();
        let headers = [("idempotency-key", key), ("x-test-body-bytes", bytes.as_str())];
        send(addr, "POST", "/v1/payments", &headers, "{}").await
    };
    // 1.5 MiB more does not fit: the client gets it all, streamed; the key is unknown.
    let first = wide("wide-1").await;
    assert_eq!((first.status.as_u16(), first.body.len()), (201, size));
    let retry = wide("wide-1").await;
    assert_eq!(
        (retry.status.as_u16(), retry.problem()),
        (409, "outcome-unknown".into())
    );
    upstream.release("holds");
    assert_eq!(held.await.expect("held").status, 201);
    until_metric(proxy.admin(), "idemproxy_buffered_bytes", 0.0).await;
    // With the budget free, the same response is recorded and replayed.
    let second = wide("wide-2").await;
    assert_eq!((second.status.as_u16(), second.body.len()), (201, size));
    let replay = wide("wide-2").await;
    assert!(replay.replayed() && replay.body == second.body, "{:?}", replay.status);
}

/// `max_connections` holds exactly: while fewer are open, no client waits, whichever
/// worker's own `SO_REUSEPORT` socket (the Redis store gives each worker one) the
/// kernel handed its connection to. Four workers, a limit of four, four clients held
/// at the upstream, in five rounds: all four are served each time. (Before, each idle
/// worker held a permit while it waited to accept, so a client that reached a worker
/// without one waited in that socket's backlog: most rounds served fewer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_holds_exactly_across_the_workers_sockets() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.server = "workers = 4\nmax_connections = 4".into();
    let proxy = config.start().await;
    let addr = proxy.addr();
    for round in 0..5 {
        let gate: &'static str = Box::leak(format!("round-{round}").into_boxed_str());
        let before = upstream.total();
        let clients: Vec<_> = (0..4)
            .map(|_| tokio::spawn(async move { send(addr, "GET", "/v1/reads/x", &[("x-test-hold", gate)], "").await }))
            .collect();
        let reached = tokio::time::timeout(Duration::from_secs(5), upstream.wait_for_total(before + 4)).await;
        assert!(
            reached.is_ok(),
            "round {round}: only {} of 4 clients were served under a limit of 4",
            upstream.total() - before
        );
        upstream.release(gate);
        for client in clients {
            assert_eq!(client.await.expect("client").status, 201);
        }
    }
}

/// The workers share the connections evenly, whichever way they reach the process:
/// each new connection goes to the worker serving fewest (docs/design.md §7). On the
/// memory store the two workers share one socket, and before, the worker the kernel
/// woke first took a whole burst (a benchmark's 32 connections all went to one worker,
/// and the process ran on one core of two); on Redis each has its own `SO_REUSEPORT`
/// socket, which spreads by a hash of the client's address. Sixteen clients held at the
/// upstream at once: each worker serves eight, in each of three rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_spread_evenly_over_the_workers() {
    let redis = RedisServer::start();
    for store in [StoreKind::Memory, StoreKind::Redis(redis.url())] {
        let upstream = Upstream::start().await;
        let mut config = TestConfig::new(store, &upstream.url());
        config.server = "workers = 2".into();
        let proxy = config.start().await;
        let (addr, admin) = (proxy.addr(), proxy.admin());
        for round in 0..3 {
            let gate: &'static str = Box::leak(format!("spread-{round}").into_boxed_str());
            let before = upstream.total();
            let clients: Vec<_> = (0..16)
                .map(|_| {
                    tokio::spawn(async move { send(addr, "GET", "/v1/reads/x", &[("x-test-hold", gate)], "").await })
                })
                .collect();
            upstream.wait_for_total(before + 16).await;
            let served = [
                metric(admin, r#"idemproxy_worker_connections{worker="0"}"#).await,
                metric(admin, r#"idemproxy_worker_connections{worker="1"}"#).await,
            ];
            assert_eq!(
                served,
                [Some(8.0), Some(8.0)],
                "round {round}: the workers serve {served:?} of 16 connections"
            );
            upstream.release(gate);
            for client in clients {
                assert_eq!(client.await.expect("client").status, 201);
            }
            // Each client's connection closes after its answer: both gauges come back to 0.
            until_metric(admin, r#"idemproxy_worker_connections{worker="0"}"#, 0.0).await;
            until_metric(admin, r#"idemproxy_worker_connections{worker="1"}"#, 0.0).await;
        }
    }
}

/// The connections that reached the proxy on `port` and wait for it, from
/// `/proc/net/tcp`: in a listening socket's accept queue, or accepted with their
/// request's bytes still unread.
fn waiting_clients(port: u16) -> usize {
    support::client::tcp_sockets(port)
        .into_iter()
        .map(|(state, rx)| match state.as_str() {
            "0A" => rx,
            "01" => usize::from(rx > 0),
            _ => 0,
        })
        .sum()
}

/// `max_connections` bounds from above too, across the workers' sockets: with four
/// held, a fifth client is accepted or queued but not read, whichever worker's socket
/// it reached, until one of the four ends; then it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_holds_a_fifth_client_until_a_slot_frees() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.server = "workers = 4\nmax_connections = 4".into();
    let proxy = config.start().await;
    let addr = proxy.addr();
    let held: Vec<_> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|gate| tokio::spawn(async move { send(addr, "GET", "/v1/reads/x", &[("x-test-hold", gate)], "").await }))
        .collect();
    upstream.wait_for_total(4).await;
    let fifth = tokio::spawn(async move { send(addr, "GET", "/v1/reads/fifth", &[], "").await });
    let started = tokio::time::Instant::now();
    while waiting_clients(addr.port()) < 1 {
        assert_eq!(upstream.total(), 4, "a fifth connection was served under a limit of 4");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the fifth client never reached the proxy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(upstream.total(), 4, "a fifth connection was served under a limit of 4");
    upstream.release("a");
    assert_eq!(fifth.await.expect("the fifth").status, 201);
    for gate in ["b", "c", "d"] {
        upstream.release(gate);
    }
    for client in held {
        assert_eq!(client.await.expect("a held client").status, 201);
    }
}

/// One HTTP/2 connection's requests: `streams` guarded POSTs at once, keys
/// `h2-{connection}-{stream}`, each held at the upstream behind `gate` when one is given.
async fn h2_posts(addr: SocketAddr, connection: usize, streams: usize, gate: Option<&'static str>) -> Vec<(u16, bool)> {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (sender, driver) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2c handshake");
    tokio::spawn(driver);
    let requests = (0..streams).map(|n| {
        let mut sender = sender.clone();
        async move {
            let mut request = http::Request::post(format!("http://{addr}/v1/payments"))
                .header("idempotency-key", format!("h2-{connection}-{n}"))
                .header("content-type", "application/json");
            if let Some(gate) = gate {
                request = request.header("x-test-hold", gate);
            }
            let request = request
                .body(Full::new(bytes::Bytes::from_static(b"{\"a\":1}")))
                .expect("request");
            let response = sender.send_request(request).await.expect("h2 request");
            let status = response.status().as_u16();
            let replayed = response
                .headers()
                .get("idempotent-replayed")
                .is_some_and(|value| value == "true");
            response.into_body().collect().await.expect("body");
            (status, replayed)
        }
    });
    futures_util::future::join_all(requests).await
}

/// 256 HTTP/2 connections x 10 streams on Redis: 2,560 guarded requests held at the
/// upstream at once all reach it (the old count bound of 1,024 answered the rest 503
/// `overloaded`, 65-72 % of a replay storm at this concurrency), are all answered 201
/// once released, and all 2,560 keys then replay over HTTP/2 with no refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_five_hundred_http2_streams_on_redis_are_all_served_then_all_replayed() {
    const CONNECTIONS: usize = 256;
    const STREAMS: usize = 10;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    // What is under test is the bounds, not how fast a debug build on a busy machine
    // reads 2,560 claims' replies that arrive at once: the store's timeout is the
    // docs/performance.md's advice for bursts (a claim that timed out would be a 503
    // `store-unavailable`, not `overloaded`).
    config.store_timeout = "5s".into();
    let proxy = config.start().await;
    let addr = proxy.addr();
    let first = tokio::spawn(join_all(
        (0..CONNECTIONS).map(move |connection| h2_posts(addr, connection, STREAMS, Some("h2-many"))),
    ));
    let reached = tokio::time::timeout(Duration::from_secs(60), upstream.wait_for_total(CONNECTIONS * STREAMS)).await;
    if reached.is_err() {
        upstream.release("h2-many");
        let answers: Vec<_> = first.await.expect("answers").into_iter().flatten().collect();
        let refused = answers.iter().filter(|(status, _)| *status == 503).count();
        panic!("{} of 2560 reached the upstream; {refused} got 503", upstream.total());
    }
    upstream.release("h2-many");
    let answers: Vec<_> = first.await.expect("answers").into_iter().flatten().collect();
    let created = answers
        .iter()
        .filter(|(status, replayed)| *status == 201 && !replayed)
        .count();
    assert_eq!(
        created,
        CONNECTIONS * STREAMS,
        "{:?}",
        answers.iter().find(|(status, _)| *status != 201)
    );
    let replays: Vec<_> = join_all((0..CONNECTIONS).map(move |connection| h2_posts(addr, connection, STREAMS, None)))
        .await
        .into_iter()
        .flatten()
        .collect();
    let replayed = replays
        .iter()
        .filter(|(status, replayed)| *status == 201 && *replayed)
        .count();
    assert_eq!(
        replayed,
        CONNECTIONS * STREAMS,
        "{:?}",
        replays.iter().find(|(_, replayed)| !replayed)
    );
    assert_eq!(upstream.total(), CONNECTIONS * STREAMS, "a replay reached the upstream");
}
