//! Faults in real processes: the Redis process killed and restarted on the same port,
//! Redis frozen with SIGSTOP past the store timeout, and the proxy binary killed with
//! SIGKILL while its request is held at the upstream.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use std::sync::atomic::Ordering;

use support::client::until_not;
use support::{RedisServer, Relay, StoreKind, TestConfig, Upstream, free_port, post_key, send};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_then_restarted_on_the_same_port() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    let proxy = config.start().await;
    let before = post_key(proxy.addr(), "before").await;
    assert_eq!(before.status, 201);

    redis.kill();
    for attempt in 0..3 {
        let started = Instant::now();
        let response = post_key(proxy.addr(), "during").await;
        let elapsed = started.elapsed();
        assert_eq!(response.status, 503, "attempt {attempt}");
        assert_eq!(response.problem(), "store-unavailable");
        assert_eq!(response.header("retry-after"), Some("1"));
        assert!(
            elapsed < Duration::from_millis(1300),
            "503 took {elapsed:?}, over store.timeout + 1 s"
        );
    }
    assert_eq!(
        upstream.executions("during"),
        0,
        "a request was forwarded without a claim"
    );
    let read = send(proxy.addr(), "GET", "/v1/reads/1", &[], "").await;
    assert_eq!(read.status, 201, "unguarded traffic must not depend on the store");
    assert_eq!(send(proxy.admin(), "GET", "/readyz", &[], "").await.status, 503);

    redis.restart();
    let after = until_not(|| post_key(proxy.addr(), "during"), &[(503, "store-unavailable")]).await;
    assert_eq!(after.status, 201, "{after:?}");
    assert!(!after.replayed());
    assert_eq!(upstream.executions("during"), 1);
    assert_eq!(send(proxy.admin(), "GET", "/readyz", &[], "").await.status, 200);
}

/// Redis frozen with SIGSTOP while a claim is on its way: the proxy answers 503 in
/// time, and the claim, applied when Redis resumes, is released in the background so
/// the key is not left behind as a ghost. The precondition that makes the test mean
/// something is asserted: the claim's bytes reached Redis's socket while it was frozen
/// (one worker, whose connection is open, and a relay that counts what it passes on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_past_the_store_timeout_leaves_no_ghost_claim() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let mut config = TestConfig::new(StoreKind::Redis(format!("{}/0", relay.url("redis"))), &upstream.url());
    config.server = "workers = 1".into();
    let proxy = config.start().await;
    // Opens the one worker's connection and loads the scripts.
    let warm = post_key(proxy.addr(), "warm").await;
    assert_eq!(warm.status, 201);

    redis.pause();
    let before = relay.sent.load(Ordering::SeqCst);
    let started = Instant::now();
    let paused = post_key(proxy.addr(), "ghost").await;
    assert_eq!(paused.status, 503);
    assert_eq!(paused.problem(), "store-unavailable");
    assert!(started.elapsed() < Duration::from_millis(1300));
    let claim_bytes = relay.sent.load(Ordering::SeqCst) - before;
    assert!(
        claim_bytes > 0,
        "precondition: the claim never reached Redis, so this run proves nothing"
    );
    assert_eq!(upstream.executions("ghost"), 0);
    redis.resume();

    // The claim sent while Redis was frozen is applied on resume; the proxy's
    // background release then removes it, so the key becomes usable again.
    let after = until_not(
        || post_key(proxy.addr(), "ghost"),
        &[(503, "store-unavailable"), (409, "request-in-progress")],
    )
    .await;
    assert_eq!(after.status, 201, "the ghost claim was never released: {after:?}");
    assert!(!after.replayed());
    assert_eq!(upstream.executions("ghost"), 1);
    let keys = redis.keys();
    assert_eq!(keys.len(), 2, "one record each for warm and ghost: {keys:?}");
}

struct ChildProxy(Child);

impl Drop for ChildProxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_mid_request_never_lets_the_request_run_twice() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    let port = free_port();
    let admin_port = free_port();
    config.listen = format!("127.0.0.1:{port}");
    config.admin_listen = format!("127.0.0.1:{admin_port}");
    config.upstream_timeout = "2s".into();
    let file = config.write_temp();

    let mut child = ChildProxy(
        Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["serve", "--config"])
            .arg(file.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the idemproxy binary"),
    );
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let admin: std::net::SocketAddr = ([127, 0, 0, 1], admin_port).into();
    // Wait until the child serves: a poll on a condition, bounded at 15 s.
    let started = Instant::now();
    while support::client::try_send(admin, "GET", "/readyz", &[], "")
        .await
        .map(|r| r.status)
        .ok()
        != Some(http::StatusCode::OK)
    {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the idemproxy binary did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let headers = [("idempotency-key", "crash"), ("x-test-hold", "crash")];
    let client =
        tokio::spawn(async move { support::client::try_send(addr, "POST", "/v1/payments", &headers, "{}").await });
    upstream.wait_for_key("crash").await;
    child.0.kill().expect("SIGKILL the proxy");
    child.0.wait().expect("reap the proxy");
    assert!(client.await.expect("client task").is_err(), "the killed proxy answered");

    // A second instance on the same Redis: in progress until the lease ends, then
    // unknown. Never forwarded again.
    let second = config_for_second(&redis, &upstream).start().await;
    let during = send(second.addr(), "POST", "/v1/payments", &headers, "{}").await;
    assert_eq!(during.status, 409);
    assert_eq!(during.problem(), "request-in-progress");
    let after = until_not(
        || send(second.addr(), "POST", "/v1/payments", &headers, "{}"),
        &[(409, "request-in-progress")],
    )
    .await;
    assert_eq!(after.status, 409);
    assert_eq!(after.problem(), "outcome-unknown");

    upstream.release("crash");
    let later = send(second.addr(), "POST", "/v1/payments", &headers, "{}").await;
    assert_eq!(later.problem(), "outcome-unknown");
    assert_eq!(upstream.executions("crash"), 1);
}

fn config_for_second(redis: &RedisServer, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.upstream_timeout = "2s".into();
    config
}

#[tokio::test]
async fn on_store_error_forward_forwards_unguarded_while_redis_is_down() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.idempotency = "on_store_error = \"forward\"".into();
    let proxy = config.start().await;
    redis.kill();
    let response = post_key(proxy.addr(), "open").await;
    assert_eq!(response.status, 201);
    assert_eq!(upstream.executions("open"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_requests_in_flight_then_exits_cleanly() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    let mut proxy = support::ChildProxy::start(&config).await;
    let addr = proxy.addr;
    let headers = [("idempotency-key", "drain"), ("x-test-hold", "drain")];
    let held = tokio::spawn(async move { send(addr, "POST", "/v1/payments", &headers, "{}").await });
    upstream.wait_for_key("drain").await;

    let status = Command::new("kill")
        .args(["-TERM", &proxy.child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    // New connections are refused once the listeners close: poll for it, bounded.
    let started = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still accepting after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    upstream.release("drain");
    let response = held.await.expect("held request");
    assert_eq!(
        response.status, 201,
        "the request in flight was not drained: {response:?}"
    );
    let exit = tokio::task::spawn_blocking(move || proxy.child.wait())
        .await
        .expect("join")
        .expect("wait");
    assert!(exit.success(), "exit status {exit}");
    // The drained request's record was completed before the process left.
    let replay_proxy = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url())
        .start()
        .await;
    let replay = send(replay_proxy.addr(), "POST", "/v1/payments", &headers, "{}").await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(upstream.executions("drain"), 1);
}
