//! Jepsen-style histories under faults. Each scenario drives real `redis-server` and
//! proxy processes (or library instances where the property is not about processes),
//! records every operation, and runs the history checker, which prints its figures:
//! run with `cargo test --test histories -- --nocapture` to see them.
//!
//! `IDEMPROXY_SOAK=1 cargo test --test histories -- --ignored soak --nocapture` runs
//! for 10 minutes: every 30 s a fresh storm with the next of the four Redis faults.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idemproxy::idempotency::{parse_key_value, store_key};
use idemproxy::store::memory::Plant;
use idemproxy::store::redis::ScriptName;
use idemproxy::store::{AnyStore, MemoryStore, RecordStore, RedisStore};
use support::client::{metric, until_metric, until_not};
use support::history::{Contract, History, check};
use support::storm::{Storm, until_progress};
use support::{ChildProxy, Mode, RedisServer, Relay, StoreKind, TestConfig, Upstream, post_key, send};
use tokio::time::Instant;

const RETENTION: Duration = Duration::from_secs(3600);

fn storm_config(redis: &str, upstream: &str, store_timeout: &str) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Redis(redis.to_string()), upstream);
    config.store_timeout = store_timeout.into();
    config.idempotency = "scope_headers = [\"authorization\"]".into();
    config
}

/// Records every request a scenario sends, for the history checker.
#[derive(Clone, Default)]
struct Recorder {
    history: Arc<History>,
    started: Arc<std::sync::OnceLock<Instant>>,
}

impl Recorder {
    async fn post(&self, addr: SocketAddr, headers: &[(&str, &str)]) -> support::TestResponse {
        let response = self.try_post(addr, headers).await;
        response.unwrap_or_else(|error| panic!("POST via {addr} failed: {error}"))
    }

    /// A transport failure is recorded as an unknown outcome.
    async fn try_post(&self, addr: SocketAddr, headers: &[(&str, &str)]) -> Result<support::TestResponse, String> {
        let started = Instant::now();
        self.started.get_or_init(|| started);
        let key = headers
            .iter()
            .find(|(name, _)| *name == "idempotency-key")
            .map_or("", |(_, value)| *value);
        let outcome = support::client::try_send(addr, "POST", "/v1/payments", headers, "{}")
            .await
            .map_err(|error| error.to_string());
        self.history.record("", key, started, outcome.clone());
        outcome
    }

    /// Runs the checker over what was recorded, prints the figures, and fails on any
    /// violation.
    fn check(&self, scenario: &str, upstream: &Upstream, redis: &RedisServer) {
        let keys = self.history.ops().into_iter().map(|op| op.key).collect();
        let report = check(
            &self.history,
            &upstream.log(),
            &redis.dump_ttls(),
            &Contract {
                retention: RETENTION,
                remember: RETENTION,
                run_started: self.started.get().copied().unwrap_or_else(Instant::now),
                raw_keys: keys,
                outage_windows: vec![],
                resolving: false,
            },
        );
        report.assert_clean(scenario);
    }
}

// === 1. a duplicate storm across three proxy processes ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_across_three_proxy_processes_runs_each_key_once() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let config = storm_config(&redis.url(), &upstream.url(), "2s");
    let proxies = [
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
    ];
    faultless_storm(&proxies, "storm", 20, &upstream, &redis).await;
}

/// Streamed answers (docs/design.md §25) raced by their retries: every answer is five
/// server-sent events 5 ms apart, which the proxies stream as they record them; the
/// duplicates that arrive meanwhile on the same process join the live stream, those on
/// the others wait for the record. No key runs twice, and every answer a key got is the
/// same, streamed, joined or replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_streamed_answers_raced_by_their_retries_runs_each_key_once() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = storm_config(&redis.url(), &upstream.url(), "2s");
    config.idempotency += "\nwait_for_in_flight = \"5s\"";
    let proxies = [
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
    ];
    let storm = Storm {
        name: "streamed",
        targets: proxies.iter().map(|p| p.addr).collect(),
        logical: 300,
        duplicates: 10,
        concurrency: 96,
        jitter_ms: 20,
        streamed: true,
    };
    let run = storm.start();
    storm.run(&run).await;
    let liveness = storm.settle(&run).await;
    let report = storm.check(&run, &upstream.log(), &redis.dump_ttls(), RETENTION, vec![]);
    let joined: f64 = {
        let mut total = 0.0;
        for proxy in &proxies {
            total += metric(proxy.admin, "idemproxy_waits_total{result=\"joined\"}")
                .await
                .unwrap_or(0.0);
        }
        total
    };
    println!(
        "streamed: {} ops in {:.1?}, {joined} joined a live stream",
        storm.total(),
        run.started.elapsed()
    );
    report.assert_clean("streamed storm: 3 processes, 300 keys x 10");
    liveness.assert_live("streamed storm", 1.0);
    assert_eq!(report.max_executions_per_key, 1);
    assert_eq!(
        report.executions, storm.logical,
        "every logical operation ran exactly once"
    );
    assert!(joined > 0.0, "some retries joined a live stream");
}

/// A storm of 1,000 keys with `duplicates` each through `proxies`, with no fault:
/// every key runs exactly once and ends in a success, and the history is clean.
/// `name` prefixes the storm's keys, so it is a valid key itself.
async fn faultless_storm(
    proxies: &[ChildProxy],
    name: &'static str,
    duplicates: usize,
    upstream: &Upstream,
    redis: &RedisServer,
) {
    let storm = Storm {
        name,
        targets: proxies.iter().map(|p| p.addr).collect(),
        logical: 1000,
        duplicates,
        concurrency: 96,
        jitter_ms: 50,
        streamed: false,
    };
    let run = storm.start();
    storm.run(&run).await;
    let liveness = storm.settle(&run).await;
    let report = storm.check(&run, &upstream.log(), &redis.dump_ttls(), RETENTION, vec![]);
    println!("{name}: {} ops in {:.1?}", storm.total(), run.started.elapsed());
    let scenario = format!("{name}: {} processes, 1000 keys x {duplicates}", proxies.len());
    report.assert_clean(&scenario);
    // Nothing fails here, so every key must end in a success.
    liveness.assert_live(&scenario, 1.0);
    assert_eq!(report.ops, storm.total() + storm.logical);
    assert_eq!(report.max_executions_per_key, 1);
    assert_eq!(
        report.executions, storm.logical,
        "every logical operation ran exactly once"
    );
    assert_eq!(
        report.unknown, 0,
        "no key ended unknown (a sealed one: none was unreadable)"
    );
}

/// Retries that come after the retention and within `remember` (docs/design.md §24):
/// a storm of 300 keys × 5 through three processes on one Redis, then the same storm
/// again once every key's retention has passed. Every late retry is a 410, each key
/// ran once, and the checker finds no 410 for a key that never ran; every record key
/// still lives `remember`, and no response key (`…:r`) is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_after_the_retention_run_no_key_twice_within_remember() {
    let (report, total) = late_storm(Some("1h")).await;
    report.assert_clean("late: 3 processes, 300 keys x 5, then x 5 past the retention");
    assert_eq!(report.executions, 300, "each key ran once");
    assert_eq!(
        report.expired, total,
        "every late retry is a 410: {:?}",
        report.failures
    );
}

/// The negative control: without `remember` the late storm runs every key again, and
/// the checker says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_late_storm_catches_keys_forgotten_at_the_retention() {
    let (report, _) = late_storm(None).await;
    report.print("late, without remember");
    assert_eq!(report.max_executions_per_key, 2, "the late storm cannot fail");
    assert_eq!(report.expired, 0);
}

/// The late storm, with the route's `remember` (`None`: the retention); its report,
/// and how many late retries it sent.
async fn late_storm(remember: Option<&str>) -> (support::history::Report, usize) {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = storm_config(&redis.url(), &upstream.url(), "2s");
    config.upstream_timeout = "1s".into();
    config.retention = "3s".into();
    if let Some(remember) = remember {
        config.idempotency.push_str(&format!("\nremember = \"{remember}\""));
    }
    let proxies = [
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
    ];
    let storm = Storm {
        name: "late",
        targets: proxies.iter().map(|p| p.addr).collect(),
        logical: 300,
        duplicates: 5,
        concurrency: 64,
        jitter_ms: 20,
        streamed: false,
    };
    let run = storm.start();
    storm.run(&run).await;
    storm.settle(&run).await.assert_live("late: the first storm", 1.0);
    // Every key was claimed before the storm ended: its retention is over 3 s after.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    storm.run(&run).await;
    let store = redis.dump_ttls();
    assert!(
        !store.iter().any(|(name, _)| name.ends_with(":r")),
        "a response outlived its retention"
    );
    let remember = remember.map_or(Duration::from_secs(3), |_| Duration::from_secs(3600));
    let report = storm.check_within(&run, &upstream.log(), &store, Duration::from_secs(3), remember);
    (report, storm.total())
}

/// The same storm with sealed records (docs/design.md §20), in the middle of a
/// rolling key rotation: two processes seal with key 1 and open key 2, the third seals
/// with key 2 and opens key 1, so that every record is opened by a process that did not
/// seal it. Each key runs once, every duplicate replays (none is unreadable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_storm_across_a_rolling_key_rotation_runs_each_key_once() {
    use base64::Engine as _;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let key = |byte: u8| base64::engine::general_purpose::STANDARD.encode([byte; 32]);
    let sealed = |current: u8, previous: u8| {
        let mut config = storm_config(&redis.url(), &upstream.url(), "2s");
        config.store_extra = "[store.encryption]\nkey_env = \"STORM_KEY\"\nprevious_keys_env = \"STORM_OLD\"".into();
        config.env = vec![("STORM_KEY".into(), key(current)), ("STORM_OLD".into(), key(previous))];
        config
    };
    let proxies = [
        ChildProxy::start(&sealed(1, 2)).await,
        ChildProxy::start(&sealed(2, 1)).await,
        ChildProxy::start(&sealed(1, 2)).await,
    ];
    faultless_storm(&proxies, "sealed-rotation", 10, &upstream, &redis).await;
    for proxy in &proxies {
        let unreadable = support::client::metric(proxy.admin, "idemproxy_records_unreadable_total").await;
        assert_eq!(unreadable, Some(0.0));
    }
}

// === 2. Redis faults mid-storm ===

#[derive(Clone, Copy, Debug)]
enum RedisFault {
    KillAndRestart,
    Pause,
    ClientPauseWrite,
    ScriptFlush,
}

impl RedisFault {
    /// The share of keys that must end in a success after this fault. A key ends
    /// unknown only when its first request was forwarded and the proxy could not record
    /// the answer before the lease (here 6 s) ran out; these outages last well under a
    /// second, so every key has succeeded in every run so far (see docs/guarantees.md). The
    /// bound leaves room for a slow machine, and still fails a proxy that turns even
    /// one key in twenty into a 409 for good.
    fn min_success(self) -> f64 {
        match self {
            RedisFault::ScriptFlush => 1.0,
            RedisFault::KillAndRestart | RedisFault::Pause | RedisFault::ClientPauseWrite => 0.95,
        }
    }
}

async fn storm_with_redis_fault(fault: RedisFault) {
    let mut redis = RedisServer::start_persistent();
    let upstream = Upstream::start().await;
    let config = storm_config(&redis.url(), &upstream.url(), "300ms");
    let a = config.start().await;
    let b = config.start().await;
    let storm = Storm {
        name: "fault",
        targets: vec![a.addr(), b.addr()],
        logical: 200,
        duplicates: 10,
        concurrency: 48,
        jitter_ms: 20,
        streamed: false,
    };
    let run = storm.start();
    let mut outages = Vec::new();
    let inject = async {
        until_progress(&run, storm.total() * 3 / 10).await;
        let from = Instant::now();
        match fault {
            RedisFault::KillAndRestart => {
                redis.kill();
                until_progress(&run, storm.total() * 4 / 10).await;
                redis.restart();
                outages.push((from, Instant::now()));
            }
            RedisFault::Pause => {
                redis.pause();
                until_progress(&run, storm.total() * 4 / 10).await;
                redis.resume();
                outages.push((from, Instant::now()));
            }
            RedisFault::ClientPauseWrite => {
                let _: () = redis::cmd("CLIENT")
                    .arg("PAUSE")
                    .arg("1000")
                    .arg("WRITE")
                    .query(&mut redis.connection())
                    .expect("CLIENT PAUSE");
                outages.push((from, from + Duration::from_millis(1000)));
            }
            RedisFault::ScriptFlush => {
                let _: () = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query(&mut redis.connection())
                    .expect("SCRIPT FLUSH");
            }
        }
    };
    tokio::join!(storm.run(&run), inject);
    let liveness = storm.settle(&run).await;
    let report = storm.check(&run, &upstream.log(), &redis.dump_ttls(), RETENTION, outages);
    report.assert_clean(&format!("redis {fault:?}"));
    liveness.assert_live(&format!("redis {fault:?}"), fault.min_success());
    if matches!(fault, RedisFault::ScriptFlush) {
        assert!(
            !report.failures.contains_key("store-unavailable"),
            "SCRIPT FLUSH must cost nothing"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_mid_storm() {
    storm_with_redis_fault(RedisFault::KillAndRestart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_mid_storm() {
    storm_with_redis_fault(RedisFault::Pause).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_client_pause_write_mid_storm() {
    storm_with_redis_fault(RedisFault::ClientPauseWrite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_script_flush_mid_storm() {
    storm_with_redis_fault(RedisFault::ScriptFlush).await;
}

// === 3. the proxy killed before forwarding ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_before_forwarding_never_runs_the_request() {
    let rec = Recorder::default();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    // A's way to the upstream swallows the request: it is killed before anything
    // reaches the upstream, with its claim written.
    let upstream_relay = Relay::start(upstream.addr).await;
    upstream_relay.set(Mode::Blackhole);
    let mut config_a = storm_config(&redis.url(), &upstream_relay.url("http"), "2s");
    config_a.upstream_timeout = "2s".into();
    let mut a = ChildProxy::start(&config_a).await;
    let headers = [("idempotency-key", "before"), ("authorization", "Bearer t")];
    let addr = a.addr;
    let client = {
        let rec = rec.clone();
        tokio::spawn(async move { rec.try_post(addr, &headers).await })
    };
    // Wait until A's request bytes are in the relay: the claim came first.
    let started = Instant::now();
    while upstream_relay.sent.load(Ordering::SeqCst) == 0 && upstream_relay.connections.load(Ordering::SeqCst) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "A never forwarded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.kill();
    assert!(client.await.expect("client").is_err());
    upstream_relay.set(Mode::Pass);

    let mut config_b = storm_config(&redis.url(), &upstream.url(), "2s");
    config_b.upstream_timeout = "2s".into();
    let b = config_b.start().await;
    let first = rec.post(b.addr(), &headers).await;
    assert_eq!(first.status, 409);
    // Poll past the lease: the key turns unknown, never free.
    let after = until_not(|| rec.post(b.addr(), &headers), &[(409, "request-in-progress")]).await;
    assert_eq!(
        (after.status.as_u16(), after.problem()),
        (409, "outcome-unknown".into())
    );
    assert_eq!(upstream.executions("before"), 0);
    rec.check("proxy killed before forwarding", &upstream, &redis);
}

// === 4. upstream faults through the relay ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_faults_end_in_the_states_the_contract_names() {
    let rec = Recorder::default();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let relay = Relay::start(upstream.addr).await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &relay.url("http"));
    config.upstream_timeout = "1s".into();
    let proxy = config.start().await;
    let post = |key: &'static str, extra: Option<(&'static str, &'static str)>| {
        let addr = proxy.addr();
        let rec = rec.clone();
        async move {
            let mut headers = vec![("idempotency-key", key)];
            headers.extend(extra);
            rec.post(addr, &headers).await
        }
    };

    // A timeout after the request was sent: 504, then unknown.
    relay.set(Mode::Blackhole);
    let timeout = post("timeout", None).await;
    assert_eq!(
        (timeout.status.as_u16(), timeout.problem()),
        (504, "upstream-timeout".into())
    );
    relay.set(Mode::Pass);
    assert_eq!(post("timeout", None).await.problem(), "outcome-unknown");

    // A reset while the upstream holds the request: 502, then unknown, one execution.
    let held = tokio::spawn(post("reset", Some(("x-test-hold", "reset"))));
    upstream.wait_for_key("reset").await;
    relay.set(Mode::Reset);
    upstream.release("reset");
    let reset = held.await.expect("request");
    assert_eq!(
        (reset.status.as_u16(), reset.problem()),
        (502, "upstream-failed".into())
    );
    relay.set(Mode::Pass);
    assert_eq!(post("reset", None).await.problem(), "outcome-unknown");
    assert_eq!(upstream.executions("reset"), 1);

    // The connection cut right after the response head: 502, then unknown.
    let head = response_head_len(&upstream).await;
    relay.set(Mode::CutAfter(head as u64 + 10));
    let cut = post("cut", Some(("x-test-body-bytes", "5000"))).await;
    assert_eq!((cut.status.as_u16(), cut.problem()), (502, "upstream-failed".into()));
    relay.set(Mode::Pass);
    assert_eq!(post("cut", None).await.problem(), "outcome-unknown");
    assert_eq!(upstream.executions("cut"), 1);

    // A refusal: nothing was sent, so the key is released and a retry runs.
    relay.set(Mode::Refuse);
    let refused = post("refused", None).await;
    assert_eq!(
        (refused.status.as_u16(), refused.problem()),
        (502, "upstream-unavailable".into())
    );
    relay.set(Mode::Pass);
    let retry = post("refused", None).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(upstream.executions("refused"), 1);
    assert_eq!(upstream.executions("timeout"), 0, "the blackhole swallowed it");
    rec.check("upstream faults through the relay", &upstream, &redis);
}

/// The length of the fake upstream's response head for a 5000-byte body.
async fn response_head_len(upstream: &Upstream) -> usize {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(upstream.addr).await.expect("connect");
    stream
        .write_all(b"GET /probe HTTP/1.1\r\nhost: x\r\nx-test-body-bytes: 5000\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("read");
    response.windows(4).position(|w| w == b"\r\n\r\n").expect("head") + 4
}

// === 5. clients that leave ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_aborts_mid_upload_leaves_no_claim() {
    use tokio::io::AsyncWriteExt;
    let rec = Recorder::default();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let proxy = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url())
        .start()
        .await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(
            b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nidempotency-key: abort\r\ncontent-length: 100\r\n\r\n0123456789",
        )
        .await
        .expect("write");
    drop(stream);
    // The key must be usable at once: no claim was written for a body never received.
    let response = rec.post(proxy.addr(), &[("idempotency-key", "abort")]).await;
    assert_eq!(response.status, 201, "{response:?}");
    assert_eq!(upstream.executions("abort"), 1);
    assert_eq!(redis.keys().len(), 1);
    rec.check("client aborts mid-upload", &upstream, &redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_disconnect_while_held_change_nothing() {
    let rec = Recorder::default();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let proxy = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url())
        .start()
        .await;
    let addr = proxy.addr();
    let mut clients = Vec::new();
    for i in 0..5 {
        let key = format!("left-{i}");
        let request = format!(
            "POST /v1/payments HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\nx-test-hold: left\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
            .await
            .expect("write");
        clients.push(stream);
    }
    upstream.wait_for_total(5).await;
    drop(clients);
    upstream.release("left");
    for i in 0..5 {
        let key = format!("left-{i}");
        let headers = [("idempotency-key", key.as_str())];
        let replay = until_not(|| rec.post(addr, &headers), &[(409, "request-in-progress")]).await;
        assert!(replay.replayed(), "{key}: {replay:?}");
        assert_eq!(upstream.executions(&key), 1);
    }
    rec.check("clients disconnect while held", &upstream, &redis);
}

/// A client that leaves while its claim is still inside Redis (held there by
/// `CLIENT PAUSE WRITE`): the claim, applied after the client left, is released in
/// the background, so the key is not left behind as a ghost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_its_claim_is_in_the_store_leaves_no_ghost() {
    use tokio::io::AsyncWriteExt;
    let rec = Recorder::default();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.store_timeout = "10s".into();
    let proxy = config.start().await;
    // Load the scripts, so the claim below is one EVALSHA.
    let warm = post_key(proxy.addr(), "warm").await;
    assert_eq!(warm.status, 201);

    let mut control = redis.connection();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(10_000)
        .arg("WRITE")
        .query(&mut control)
        .expect("CLIENT PAUSE");
    let mut stream = tokio::net::TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nidempotency-key: left\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .expect("write");
    // Wait until the claim is blocked inside Redis: a condition, bounded.
    let started = Instant::now();
    loop {
        let info: String = redis::cmd("INFO").arg("clients").query(&mut control).expect("INFO");
        if info.lines().any(|line| line.trim() == "blocked_clients:1") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the claim never reached Redis: {info}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(stream);
    // Resume only once the proxy has seen its client go: the dropped claim then waits
    // in the background to be released (the gauge), behind the claim inside Redis.
    until_metric(proxy.admin(), "idemproxy_pending_releases", 1.0).await;
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut control)
        .expect("CLIENT UNPAUSE");

    // The key settles: released (a retry runs) or forwarded and recorded (a replay).
    let settled = until_not(
        || rec.post(proxy.addr(), &[("idempotency-key", "left")]),
        &[(409, "request-in-progress")],
    )
    .await;
    assert_eq!(settled.status, 201, "{settled:?}");
    // hyper drops the request's future when its client leaves, so the claim written
    // for it is released and this request is the first to run the key.
    assert!(!settled.replayed(), "the abandoned request was forwarded: {settled:?}");
    assert_eq!(upstream.executions("left"), 1);
    rec.check("client leaves mid-claim", &upstream, &redis);
}

// === 6. stale owners, end to end ===
//
// Each fencing rule of the store (docs/design.md §4.2) seen from the outside: a late write by
// an owner that lost its record never changes what clients see. Each race runs once as
// is and once with the rule planted out (a mutated script loaded on the side, or a
// memory-store plant), which must be noticed: that is how each test shows it can fail.

/// Starts a proxy on `config` whose every worker's Redis store has `script` swapped in.
async fn start_with_script(config: &TestConfig, script: Option<(ScriptName, &str)>) -> idemproxy::Running {
    let StoreKind::Redis(url) = &config.store else {
        panic!("a Redis config");
    };
    let url = url.clone();
    let script = script.map(|(name, lua)| (name, lua.to_string()));
    let timeout = humantime::parse_duration(&config.store_timeout).expect("store timeout");
    let factory: idemproxy::StoreFactory = Arc::new(move || {
        let store = RedisStore::standalone(&url, timeout)?;
        Ok(AnyStore::from(match &script {
            Some((name, lua)) => store.with_script(*name, lua),
            None => store,
        }))
    });
    idemproxy::start_with_store(config.config(), factory)
        .await
        .expect("start the proxy")
}

/// Waits until the record for `key` (unscoped, on the payments route) is in Redis: a
/// poll on a condition, bounded at 10 s.
async fn until_recorded(redis: &RedisServer, key: &str) {
    let record = store_key(
        "idemproxy",
        "payments",
        &[],
        &parse_key_value(key.as_bytes()).expect("key"),
    );
    let started = Instant::now();
    loop {
        let exists: bool = redis::cmd("EXISTS")
            .arg(record.as_str())
            .query(&mut redis.connection())
            .expect("EXISTS");
        if exists {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{key} never reached Redis");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const PLAIN_WRITE_COMPLETE: &str = "local record = redis.call('GET', KEYS[1]) \
    redis.call('SET', KEYS[1], '2C' .. string.sub(record, 3, 66) .. ARGV[2], 'KEEPTTL') return 1";

/// A's store traffic is delayed while A's lease runs out, the record is purged and B
/// claims the key; then A's complete arrives. Returns whether B's record survived.
async fn stale_owner_race(complete_script: Option<&str>) -> bool {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let mut config_a = TestConfig::new(StoreKind::Redis(relay.url("redis")), &upstream.url());
    config_a.store_timeout = "10s".into();
    config_a.upstream_timeout = "1s".into();
    let a = start_with_script(&config_a, complete_script.map(|lua| (ScriptName::Complete, lua))).await;
    // B's own exchange may take long: its record must stay in flight meanwhile.
    let mut config_b = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config_b.upstream_timeout = "30s".into();
    let b = config_b.start().await;
    let a_addr = a.addr;

    // One full request through A loads its scripts into Redis, so the late complete
    // below is one round trip, not NOSCRIPT, SCRIPT LOAD and a second try.
    let warm = post_key(a_addr, "warm").await;
    assert_eq!(warm.status, 201);
    let _: () = redis::cmd("DEL")
        .arg(redis.keys())
        .query(&mut redis.connection())
        .expect("DEL");

    // A claims and forwards; the upstream holds it.
    let a_request = tokio::spawn(async move {
        send(
            a_addr,
            "POST",
            "/v1/payments",
            &[("idempotency-key", "race"), ("x-test-hold", "a")],
            "{}",
        )
        .await
    });
    upstream.wait_for_key("race").await;
    // A's complete will sit in the relay for 4 s each way.
    relay.set(Mode::Delay(Duration::from_secs(4)));
    upstream.release("a");
    // Through B: in flight until A's lease (1 s + 1 s) ends, then unknown.
    let b_headers = [("idempotency-key", "race"), ("x-test-hold", "b")];
    let unknown = until_not(
        || send(b.addr(), "POST", "/v1/payments", &b_headers, "{}"),
        &[(409, "request-in-progress")],
    )
    .await;
    assert_eq!(
        (unknown.status.as_u16(), unknown.problem()),
        (409, "outcome-unknown".into())
    );
    // The record is purged (as retention would), and B claims the key anew.
    for key in redis.keys() {
        let _: () = redis::cmd("DEL").arg(&key).query(&mut redis.connection()).expect("DEL");
    }
    let b_addr = b.addr();
    let b_request = tokio::spawn(async move { send(b_addr, "POST", "/v1/payments", &b_headers, "{}").await });
    let started = Instant::now();
    while upstream.executions("race") < 2 {
        assert!(started.elapsed() < Duration::from_secs(10), "B never forwarded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Now A's late complete arrives: A's client gets its answer only after the store
    // answered the complete, so this await means the write was tried.
    let a_response = a_request.await.expect("A");
    assert_eq!(a_response.status, 201);
    if complete_script.is_none() {
        // The refusal is visible to operators.
        let admin = a.admin_addr.expect("A has an admin listener");
        let metrics = send(admin, "GET", "/metrics", &[], "").await;
        let text = String::from_utf8_lossy(&metrics.body);
        assert!(
            text.contains("idemproxy_fenced_writes_total{op=\"complete\"} 1"),
            "{text}"
        );
    }
    relay.set(Mode::Pass);
    // B's record must still be B's, in flight.
    let check = send(b.addr(), "POST", "/v1/payments", &b_headers, "{}").await;
    println!(
        "stale-owner race: B sees {} {}",
        check.status,
        String::from_utf8_lossy(&check.body)
    );
    let intact = check.status == 409 && check.problem() == "request-in-progress";
    upstream.release("b");
    let b_response = b_request.await.expect("B");
    if intact {
        let replay = send(b.addr(), "POST", "/v1/payments", &b_headers, "{}").await;
        assert_eq!(replay.body, b_response.body, "the replay must be B's response");
    }
    a.shutdown().await;
    intact
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_cannot_clobber_the_new_owners_record() {
    assert!(stale_owner_race(None).await, "A's late complete overwrote B's record");
}

/// The negative control: with the complete script swapped for a plain write, the same
/// race must corrupt B's record, which proves the test can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stale_owner_race_catches_a_plain_write_complete() {
    assert!(
        !stale_owner_race(Some(PLAIN_WRITE_COMPLETE)).await,
        "a plain-write complete went unnoticed: the race test cannot fail"
    );
}

/// A's lease (500 ms + 1 s) runs out while A's complete sits in the relay: the claim is
/// applied 1.5 s after it is sent, the complete 4.5 s after, past the lease. Clients
/// must then read the key as unknown for good, never as a replay of A's late answer.
/// Returns whether they did.
async fn late_complete_race(complete_script: Option<&str>) -> bool {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let mut config_a = TestConfig::new(StoreKind::Redis(format!("{}/0", relay.url("redis"))), &upstream.url());
    config_a.store_timeout = "10s".into();
    config_a.upstream_timeout = "500ms".into();
    let a = start_with_script(&config_a, complete_script.map(|lua| (ScriptName::Complete, lua))).await;
    let b = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url())
        .start()
        .await;
    // A full request through A loads its scripts, so each late write is one round trip.
    assert_eq!(post_key(a.addr, "warm").await.status, 201);

    relay.set(Mode::Delay(Duration::from_millis(1500)));
    let a_addr = a.addr;
    let a_request = tokio::spawn(async move { post_key(a_addr, "late").await });
    until_recorded(&redis, "late").await;
    // Through B: in flight until A's lease ends, then unknown.
    let unknown = until_not(|| post_key(b.addr(), "late"), &[(409, "request-in-progress")]).await;
    assert_eq!(
        (unknown.status.as_u16(), unknown.problem()),
        (409, "outcome-unknown".into())
    );
    // A's client is answered once the store has answered A's complete.
    assert_eq!(a_request.await.expect("A").status, 201);
    relay.set(Mode::Pass);
    let after = post_key(b.addr(), "late").await;
    println!(
        "late complete: B then sees {} {}",
        after.status,
        String::from_utf8_lossy(&after.body)
    );
    let admin = a.admin_addr.expect("A has an admin listener");
    let fenced = metric(admin, "idemproxy_fenced_writes_total{op=\"complete\"}").await;
    assert_eq!(upstream.executions("late"), 1);
    a.shutdown().await;
    let held = after.status == 409 && after.problem() == "outcome-unknown";
    if held {
        assert_eq!(fenced, Some(1.0), "the refused complete is counted");
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_that_arrives_after_the_lease_is_refused() {
    assert!(
        late_complete_race(None).await,
        "a complete after the lease turned an unknown key into a replay"
    );
}

/// The negative control: complete.lua without its lease check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_late_complete_race_catches_a_complete_without_the_lease_check() {
    let lua = include_str!("../src/store/scripts/complete.lua");
    let planted = lua.replace("if not rest or pttl <= tonumber(rest) then", "if false then");
    assert_ne!(planted, lua, "the plant no longer fits complete.lua");
    assert!(
        !late_complete_race(Some(&planted)).await,
        "a complete without the lease check went unnoticed: the race test cannot fail"
    );
}

/// A's upstream answers 503 (a retryable status: the claim is released), and A's
/// release sits in the relay while the record is purged (as retention would) and B
/// claims the key and forwards. A's late release must not delete B's record: a third
/// request C must find B's claim in flight. Returns whether it did.
async fn stale_release_race(release_script: Option<&str>) -> bool {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let mut config_a = TestConfig::new(StoreKind::Redis(format!("{}/0", relay.url("redis"))), &upstream.url());
    config_a.store_timeout = "10s".into();
    let a = start_with_script(&config_a, release_script.map(|lua| (ScriptName::Release, lua))).await;
    let b = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url())
        .start()
        .await;
    // Requests through A load its claim, complete and release scripts, so that each
    // late write is one round trip, not NOSCRIPT, SCRIPT LOAD and a second try.
    assert_eq!(post_key(a.addr, "warm").await.status, 201);
    let retryable = [("idempotency-key", "warm-release"), ("x-test-status", "503")];
    assert_eq!(send(a.addr, "POST", "/v1/payments", &retryable, "{}").await.status, 503);
    let headers_a = [
        ("idempotency-key", "release"),
        ("x-test-hold", "a"),
        ("x-test-status", "503"),
    ];
    let a_addr = a.addr;
    let a_request = tokio::spawn(async move { send(a_addr, "POST", "/v1/payments", &headers_a, "{}").await });
    upstream.wait_for_key("release").await;
    relay.set(Mode::Delay(Duration::from_secs(1)));
    upstream.release("a");
    // While A's release is in the relay: the record goes, and B claims and forwards.
    let _: () = redis::cmd("DEL")
        .arg(redis.keys())
        .query(&mut redis.connection())
        .expect("DEL");
    let b_addr = b.addr();
    let headers_b = [("idempotency-key", "release"), ("x-test-hold", "b")];
    let b_request = tokio::spawn(async move { send(b_addr, "POST", "/v1/payments", &headers_b, "{}").await });
    upstream.wait_for_total(4).await;
    // A's client is answered once the store has answered A's release.
    assert_eq!(a_request.await.expect("A").status, 503);
    relay.set(Mode::Pass);
    let c = post_key(b.addr(), "release").await;
    println!(
        "stale release: C sees {} {}",
        c.status,
        String::from_utf8_lossy(&c.body)
    );
    let intact = c.status == 409 && c.problem() == "request-in-progress";
    upstream.release("b");
    assert_eq!(b_request.await.expect("B").status, 201);
    let admin = a.admin_addr.expect("A has an admin listener");
    let fenced = metric(admin, "idemproxy_fenced_writes_total{op=\"release\"}").await;
    a.shutdown().await;
    if intact {
        assert_eq!(upstream.executions("release"), 2, "A's and B's, never C's");
        assert_eq!(fenced, Some(1.0), "the refused release is counted");
    }
    intact
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_release_cannot_free_the_new_owners_key() {
    assert!(
        stale_release_race(None).await,
        "A's late release deleted B's record and a retry ran again"
    );
}

/// The negative control: release.lua without compare-and-set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stale_release_race_catches_a_release_without_compare_and_set() {
    let lua = include_str!("../src/store/scripts/release.lua");
    let planted = lua.replace(
        "if not record or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[1] then",
        "if false then",
    );
    assert_ne!(planted, lua, "the plant no longer fits release.lua");
    assert!(
        !stale_release_race(Some(&planted)).await,
        "a release without compare-and-set went unnoticed: the race test cannot fail"
    );
}

/// The memory store: A is held at the upstream, its record is purged and B claims the
/// key and is held too; then A's complete arrives. B's claim must stand: a third
/// request C finds it in flight, and then replays B's answer. Returns whether it did.
async fn memory_stale_complete_race(plant: Option<Plant>) -> bool {
    let upstream = Upstream::start().await;
    let store = match plant {
        Some(plant) => MemoryStore::with_plant(1000, plant),
        None => MemoryStore::new(1000, usize::MAX),
    };
    let shared = AnyStore::from(store);
    let factory: idemproxy::StoreFactory = {
        let shared = shared.clone();
        Arc::new(move || Ok(shared.clone()))
    };
    let config = TestConfig::new(StoreKind::Memory, &upstream.url());
    let proxy = idemproxy::start_with_store(config.config(), factory)
        .await
        .expect("start the proxy");
    let addr = proxy.addr;
    let post = |hold: Option<&'static str>| async move {
        let mut headers = vec![("idempotency-key", "memory")];
        headers.extend(hold.map(|hold| ("x-test-hold", hold)));
        send(addr, "POST", "/v1/payments", &headers, "{}").await
    };
    let a_request = tokio::spawn(post(Some("a")));
    upstream.wait_for_key("memory").await;
    let key = store_key("idemproxy", "payments", &[], &parse_key_value(b"memory").expect("key"));
    assert!(shared.purge(&key).await.expect("purge"));
    let b_request = tokio::spawn(post(Some("b")));
    upstream.wait_for_total(2).await;
    upstream.release("a");
    let a_response = a_request.await.expect("A");
    assert_eq!(a_response.status, 201);
    let c = post(None).await;
    println!(
        "memory stale complete: C sees {} {}",
        c.status,
        String::from_utf8_lossy(&c.body)
    );
    let intact = c.status == 409 && c.problem() == "request-in-progress";
    upstream.release("b");
    let b_response = b_request.await.expect("B");
    if intact {
        let replay = post(None).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, b_response.body, "the replay must be B's response");
        assert_eq!(upstream.executions("memory"), 2);
    }
    proxy.shutdown().await;
    intact
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_cannot_complete_the_new_owners_memory_record() {
    assert!(
        memory_stale_complete_race(None).await,
        "A's late complete overwrote B's record in the memory store"
    );
}

/// The negative control: the memory store without its owner check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_race_catches_a_store_without_the_owner_check() {
    assert!(
        !memory_stale_complete_race(Some(Plant::OwnerCheckDropped)).await,
        "a memory store without the owner check went unnoticed: the race test cannot fail"
    );
}

// === soak ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 10-minute soak: IDEMPROXY_SOAK=1 cargo test --test histories -- --ignored soak --nocapture"]
async fn soak() {
    assert_eq!(
        std::env::var("IDEMPROXY_SOAK").as_deref(),
        Ok("1"),
        "set IDEMPROXY_SOAK=1 to run the soak"
    );
    let faults = [
        RedisFault::KillAndRestart,
        RedisFault::Pause,
        RedisFault::ClientPauseWrite,
        RedisFault::ScriptFlush,
    ];
    let until = Instant::now() + Duration::from_secs(600);
    let mut round = 0;
    while Instant::now() < until {
        let fault = faults[round % faults.len()];
        println!("soak round {round}: {fault:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        storm_with_redis_fault(fault).await;
        tokio::time::sleep_until(deadline).await;
        round += 1;
    }
}
