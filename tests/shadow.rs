//! Shadow mode (docs/design.md §9): a guarded route that forwards everything and counts what
//! enforce mode would have done, against a real `redis-server` that the test takes away
//! through a relay.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use support::client::{metric, post};
use support::{Mode, RedisServer, Relay, StoreKind, TestConfig, Upstream};

/// A scripted mix on a shadow-mode route: every request is forwarded and answered by
/// the upstream, and each `would` counter ends at exactly what the mix holds.
#[tokio::test]
async fn shadow_mode_forwards_every_request_and_counts_what_enforce_would_have_done() {
    let redis = RedisServer::start();
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(relay.url("redis")), &upstream.url());
    config.idempotency = "mode = \"shadow\"".into();
    config.server = "max_request_body_bytes = 1024".into();
    let proxy = config.start().await;
    let addr = proxy.addr();
    let mut answers = Vec::new();

    // 10 fresh keys: claimed, forwarded and recorded.
    for index in 0..10 {
        answers.push(post(addr, Some(&format!("fresh-{index}")), "{}", &[]).await);
    }
    // 5 duplicates: enforce would replay; shadow runs them again.
    for index in 0..5 {
        let duplicate = post(addr, Some(&format!("fresh-{index}")), "{}", &[]).await;
        assert!(!duplicate.replayed(), "shadow mode never replays: {duplicate:?}");
        answers.push(duplicate);
    }
    // 3 mismatches, 2 missing keys, 2 invalid keys.
    for index in 0..3 {
        answers.push(post(addr, Some(&format!("fresh-{index}")), "{\"other\":1}", &[]).await);
    }
    for _ in 0..2 {
        answers.push(post(addr, None, "{}", &[]).await);
    }
    let too_long = "k".repeat(300);
    answers.push(post(addr, Some(&too_long), "{}", &[]).await);
    answers.push(post(addr, Some("\"unterminated"), "{}", &[]).await);
    // A duplicate while the first is held at the upstream: enforce would answer 409.
    let held = tokio::spawn(async move { post(addr, Some("held"), "{}", &[("x-test-hold", "held")]).await });
    upstream.wait_for_key("held").await;
    answers.push(post(addr, Some("held"), "{}", &[]).await);
    upstream.release("held");
    answers.push(held.await.expect("the held request"));
    // A body over max_request_body_bytes: enforce would answer 413; it is forwarded whole.
    let large = "x".repeat(4096);
    let forwarded = post(addr, Some("large"), &large, &[]).await;
    assert!(
        String::from_utf8_lossy(&forwarded.body).contains("\"body_bytes\":4096"),
        "{forwarded:?}"
    );
    answers.push(forwarded);
    // The store gone: enforce would answer 503.
    relay.set(Mode::Reset);
    for index in 0..3 {
        answers.push(post(addr, Some(&format!("down-{index}")), "{}", &[]).await);
    }
    relay.set(Mode::Pass);

    for answer in &answers {
        assert_eq!(answer.status, 201, "every request reaches the upstream: {answer:?}");
    }
    assert_eq!(upstream.total(), answers.len(), "one execution per request");
    let expected = [
        ("forward", 11.0),
        ("replay", 5.0),
        ("mismatch", 3.0),
        ("missing_key", 2.0),
        ("invalid_key", 2.0),
        ("conflict", 1.0),
        ("rejected", 1.0),
        ("store_error", 3.0),
        ("overloaded", 0.0),
    ];
    for (would, count) in expected {
        let line = format!("idemproxy_shadow_decisions_total{{route=\"payments\",would=\"{would}\"}}");
        assert_eq!(metric(proxy.admin(), &line).await, Some(count), "{line}");
    }
    let forwarded = "idemproxy_requests_total{route=\"payments\",outcome=\"forwarded\"}";
    assert_eq!(metric(proxy.admin(), forwarded).await, Some(answers.len() as f64));
    // Only shadow routes have the counters.
    let orders = "idemproxy_shadow_decisions_total{route=\"orders\",would=\"forward\"}";
    assert_eq!(metric(proxy.admin(), orders).await, None);
    // The claims were real: the fresh keys' records are completed in Redis.
    let records = redis
        .keys()
        .into_iter()
        .filter(|key| key.starts_with("idemproxy:payments:"))
        .count();
    assert_eq!(records, 11, "ten fresh keys and the held one");
}

/// Reads from `stream` into `buffer` until `done` holds of it or the peer closes.
async fn read_until(stream: &mut tokio::net::TcpStream, buffer: &mut Vec<u8>, done: impl Fn(&[u8]) -> bool) {
    use tokio::io::AsyncReadExt;
    let mut chunk = [0u8; 8192];
    while !done(buffer) {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(read) => buffer.extend_from_slice(&chunk[..read]),
        }
    }
}

fn head_end(buffer: &[u8]) -> Option<usize> {
    buffer
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .map(|at| at + 4)
}

/// A body too large to peek on a shadow route is streamed to the upstream as it
/// comes, within the upstream timeout from then: the last 3,096 of its 4,096 bytes,
/// sent only once the upstream has the request's head, still reach it, and the
/// client gets the upstream's answer.
#[tokio::test]
async fn a_body_too_large_to_peek_is_streamed_to_the_upstream_as_it_comes() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let upstream_addr = listener.local_addr().expect("addr");
    let mut config = TestConfig::new(StoreKind::Memory, &format!("http://{upstream_addr}"));
    config.idempotency = "mode = \"shadow\"".into();
    config.server = "max_request_body_bytes = 1024".into();
    let proxy = config.start().await;
    let (head_seen, head_arrived) = tokio::sync::oneshot::channel();
    let upstream = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("the forwarded connection");
        let mut buffer = Vec::new();
        read_until(&mut stream, &mut buffer, |buffer| head_end(buffer).is_some()).await;
        let _ = head_seen.send(());
        let end = head_end(&buffer).expect("a request head");
        read_until(&mut stream, &mut buffer, |buffer| buffer.len() >= end + 4096).await;
        let body = buffer.len() - end;
        let _ = stream
            .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
            .await;
        body
    });
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.expect("connect");
    let head = "POST /v1/payments HTTP/1.1\r\nhost: proxy\r\nidempotency-key: streamed\r\ncontent-length: 4096\r\n\r\n";
    client.write_all(head.as_bytes()).await.expect("write the head");
    client.write_all(&[b'x'; 1000]).await.expect("write the first part");
    tokio::time::timeout(std::time::Duration::from_secs(10), head_arrived)
        .await
        .expect("the upstream never had the request's head")
        .expect("the upstream task");
    client.write_all(&[b'x'; 3096]).await.expect("write the rest");
    let mut answer = Vec::new();
    read_until(&mut client, &mut answer, |answer| head_end(answer).is_some()).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(
        upstream.await.expect("the upstream task"),
        4096,
        "the whole body reached the upstream"
    );
}

/// What enforce mode did with a request, as the shadow decision it names.
fn enforced(answer: &support::TestResponse) -> &'static str {
    let body = String::from_utf8_lossy(&answer.body);
    match answer.status.as_u16() {
        201 if answer.replayed() => "replay",
        201 => "forward",
        409 => "conflict",
        422 => "mismatch",
        400 if body.contains("missing-idempotency-key") => "missing_key",
        400 if body.contains("invalid-idempotency-key") => "invalid_key",
        413 => "rejected",
        _ => panic!("enforce answered something the mix does not hold: {answer:?}"),
    }
}

/// The shadow decisions, by `would`, on the payments route.
async fn decisions(admin: std::net::SocketAddr) -> std::collections::BTreeMap<String, f64> {
    let metrics = support::client::send(admin, "GET", "/metrics", &[], "").await;
    let prefix = "idemproxy_shadow_decisions_total{route=\"payments\",would=\"";
    String::from_utf8_lossy(&metrics.body)
        .lines()
        .filter_map(|line| line.strip_prefix(prefix))
        .filter_map(|rest| {
            let (would, count) = rest.split_once("\"} ")?;
            Some((would.to_string(), count.parse().ok()?))
        })
        .collect()
}

/// The shadow counters checked against enforce mode itself, on the memory store: the
/// same requests go to an enforcing proxy and then to a shadow one, and after each the
/// shadow proxy has counted exactly one decision, the one that names what the
/// enforcing proxy answered.
#[tokio::test]
async fn each_shadow_decision_is_what_an_enforcing_proxy_answers() {
    let (upstream, shadowed) = (Upstream::start().await, Upstream::start().await);
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "max_request_body_bytes = 1024".into();
    let enforcing = config.start().await;
    config.upstream = shadowed.url();
    config.idempotency = "mode = \"shadow\"".into();
    let shadow = config.start().await;
    let large = "x".repeat(4096);
    let too_long = "k".repeat(300);
    let mix: Vec<(Option<&str>, &str)> = vec![
        (Some("a"), "{}"),
        (Some("a"), "{}"),
        (Some("a"), "{\"other\":1}"),
        (None, "{}"),
        (Some(&too_long), "{}"),
        (Some("\"unterminated"), "{}"),
        (Some("b"), &large),
        (Some("c"), "{}"),
        (Some("b"), "{}"),
        (Some("c"), "{}"),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (index, (key, body)) in mix.into_iter().enumerate() {
        let want = enforced(&post(enforcing.addr(), key, body, &[]).await);
        let before = decisions(shadow.admin()).await;
        let answer = post(shadow.addr(), key, body, &[]).await;
        assert!(!answer.replayed(), "request {index}: shadow mode never replays");
        let after = decisions(shadow.admin()).await;
        let counted: Vec<(&String, f64)> = after
            .iter()
            .map(|(would, count)| (would, count - before.get(would).copied().unwrap_or(0.0)))
            .filter(|(_, delta)| *delta != 0.0)
            .collect();
        assert_eq!(
            counted,
            vec![(&want.to_string(), 1.0)],
            "request {index}: enforce did {want}"
        );
        seen.insert(want);
    }
    // A duplicate of a request held upstream: enforce answers 409.
    let (addr, shadow_addr) = (enforcing.addr(), shadow.addr());
    let held = tokio::spawn(async move { post(addr, Some("held"), "{}", &[("x-test-hold", "held")]).await });
    upstream.wait_for_key("held").await;
    let want = enforced(&post(addr, Some("held"), "{}", &[]).await);
    upstream.release("held");
    held.await.expect("the held request");
    let held = tokio::spawn(async move { post(shadow_addr, Some("held"), "{}", &[("x-test-hold", "held")]).await });
    shadowed.wait_for_key("held").await;
    let before = decisions(shadow.admin()).await;
    post(shadow_addr, Some("held"), "{}", &[]).await;
    let after = decisions(shadow.admin()).await;
    shadowed.release("held");
    held.await.expect("the held shadow request");
    assert_eq!(want, "conflict");
    assert_eq!(after[want] - before.get(want).copied().unwrap_or(0.0), 1.0, "{after:?}");
    seen.insert(want);
    assert_eq!(seen.len(), 7, "the mix covers seven decisions: {seen:?}");
}
