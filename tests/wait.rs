//! Wait, then replay (`wait_for_in_flight`, docs/design.md §9): duplicates that find their key
//! in flight wait for the first request's answer, woken by the store's notifications
//! (in-process on the memory store, pub/sub on Redis, shard channels on a cluster),
//! across processes, through a Redis restart, and at their bounds.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use support::client::{metric, post, until_metric};
use support::history::{History, OpResult};
use support::storm::Storm;
use support::topology::{MASTER_NAME, RedisCluster, SentinelGroup};
use support::{ChildProxy, Mode, RedisServer, Relay, StoreKind, TestConfig, TestResponse, Upstream};

const WAITERS: &str = "idemproxy_waiters";

fn waits(result: &str) -> String {
    format!("idemproxy_waits_total{{result=\"{result}\"}}")
}

fn waiting_config(store: StoreKind, upstream: &Upstream, wait: &str) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.upstream_timeout = "2s".into();
    config.idempotency = format!("wait_for_in_flight = {wait:?}");
    config
}

/// Duplicates of a request held upstream wait for it, and each gets its replay when
/// it completes: byte-identical, one execution, no 409. `channels` counts the record
/// channels the store has subscribers on (checked while they wait, and after).
async fn waiters_get_the_replay(store: StoreKind) {
    waiters_get_the_replay_subscribed(store, || None).await;
}

async fn waiters_get_the_replay_subscribed(store: StoreKind, channels: impl Fn() -> Option<usize>) {
    let upstream = Upstream::start().await;
    let proxy = waiting_config(store, &upstream, "2s").start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let first = tokio::spawn(async move { post(addr, Some("w1"), "{}", &[("x-test-hold", "w1")]).await });
    upstream.wait_for_key("w1").await;
    let duplicates: Vec<_> = (0..5)
        .map(|_| tokio::spawn(async move { post(addr, Some("w1"), "{}", &[]).await }))
        .collect();
    until_metric(admin, WAITERS, 5.0).await;
    if channels().is_some() {
        // One subscription for the record's five waiters (made when the first waited,
        // or, if the subscriber could not connect yet, when it does).
        support::topology::until(
            "the record's channel is subscribed",
            std::time::Duration::from_secs(5),
            || channels() == Some(1),
        );
    }
    upstream.release("w1");
    let first = first.await.expect("the first request");
    assert_eq!((first.status.as_u16(), first.replayed()), (201, false));
    for duplicate in duplicates {
        let duplicate = duplicate.await.expect("a duplicate");
        assert_eq!(duplicate.status, 201, "{duplicate:?}");
        assert!(duplicate.replayed());
        assert_eq!(duplicate.body, first.body);
    }
    assert_eq!(upstream.executions("w1"), 1);
    assert_eq!(metric(admin, &waits("replayed")).await, Some(5.0));
    assert_eq!(metric(admin, WAITERS).await, Some(0.0));
    if channels().is_some() {
        // The last waiter's leaving unsubscribes; the subscriber does it in a moment.
        support::topology::until(
            "the record's channel is unsubscribed",
            std::time::Duration::from_secs(5),
            || channels() == Some(0),
        );
    }
}

/// The channels with subscribers on the nodes at `ports`: shard channels on a cluster,
/// plain ones elsewhere.
fn channels(ports: &[u16], shard: bool) -> usize {
    ports
        .iter()
        .map(|port| {
            let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a client");
            let mut connection = client.get_connection().expect("connect");
            let channels: Vec<String> = redis::cmd("PUBSUB")
                .arg(if shard { "SHARDCHANNELS" } else { "CHANNELS" })
                .query(&mut connection)
                .expect("PUBSUB");
            // Sentinels talk on `__sentinel__:hello`: only the records' channels count.
            channels.iter().filter(|channel| channel.ends_with(":w")).count()
        })
        .sum()
}

#[tokio::test]
async fn waiters_get_the_replay_on_the_memory_store() {
    waiters_get_the_replay(StoreKind::Memory).await;
}

#[tokio::test]
async fn waiters_get_the_replay_on_redis() {
    let redis = RedisServer::start();
    let port = redis.port;
    waiters_get_the_replay_subscribed(StoreKind::Redis(redis.url()), || Some(channels(&[port], false))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_get_the_replay_through_sentinel() {
    let group = SentinelGroup::start();
    let primary = group.primary().expect("a primary");
    let store = StoreKind::Sentinel(group.urls(), MASTER_NAME.into());
    waiters_get_the_replay_subscribed(store, || Some(channels(&[primary], false))).await;
}

/// On a cluster the scripts publish on shard channels (`SPUBLISH`), which live on the
/// node that holds the record's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_get_the_replay_on_a_cluster_by_shard_channels() {
    let cluster = RedisCluster::start();
    let primaries = cluster.primaries();
    let store = StoreKind::Cluster(cluster.urls());
    waiters_get_the_replay_subscribed(store, || Some(channels(&primaries, true))).await;
}

/// The first request fails with a 500, which releases its key: exactly one waiter
/// claims it and runs its own request, and every other waiter replays that one.
///
/// The wait (20 s) is far longer than either request is held, so that a deadline
/// re-read cannot pass for a wake-up: while the winner is held upstream, `marked` asks
/// the store whether the winner's claim will wake the others when it ends (on
/// Postgres: the claim is marked as waited on; issue 49 found it never was, and the
/// losers waited out their whole wait, 9.99 s in 3 of 3 runs), and once it is released
/// every loser answers within 10 s, half its deadline.
async fn one_waiter_wins_a_released_key(store: StoreKind, marked: impl Fn() -> bool) {
    let upstream = Upstream::start().await;
    let mut config = waiting_config(store, &upstream, "20s");
    config.upstream_timeout = "30s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let first = tokio::spawn(async move {
        post(
            addr,
            Some("r1"),
            "{}",
            &[("x-test-hold", "r1"), ("x-test-status", "500")],
        )
        .await
    });
    upstream.wait_for_key("r1").await;
    let duplicates: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { post(addr, Some("r1"), "{}", &[("x-test-hold", "r1-winner")]).await }))
        .collect();
    until_metric(admin, WAITERS, 8.0).await;
    upstream.release("r1");
    assert_eq!(first.await.expect("the first request").status, 500);
    // The release wakes the waiters at once (10 s is half their deadline): one claims
    // and is held upstream; the seven others wait on its claim.
    tokio::time::timeout(std::time::Duration::from_secs(10), upstream.wait_for_total(2))
        .await
        .expect("the released key woke its waiters, well before their 20 s deadline");
    let started = tokio::time::Instant::now();
    while !marked() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the winner's claim is not watched: its end would wake no loser"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    upstream.release("r1-winner");
    let mut answers = Vec::new();
    for duplicate in duplicates {
        let answer = tokio::time::timeout(std::time::Duration::from_secs(10), duplicate)
            .await
            .expect("woken by the winner's end, well before the 20 s deadline");
        answers.push(answer.expect("a duplicate"));
    }
    let ran: Vec<&TestResponse> = answers.iter().filter(|answer| !answer.replayed()).collect();
    assert_eq!(ran.len(), 1, "exactly one waiter ran its request: {answers:?}");
    for answer in &answers {
        assert_eq!(answer.status, 201);
        assert_eq!(answer.body, ran[0].body, "the others replay the winner's answer");
    }
    assert_eq!(upstream.executions("r1"), 2, "the failed first request and the winner");
    assert_eq!(metric(admin, &waits("claimed")).await, Some(1.0));
    assert_eq!(metric(admin, &waits("replayed")).await, Some(7.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_waiter_wins_a_released_key_on_the_memory_store() {
    one_waiter_wins_a_released_key(StoreKind::Memory, || true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_waiter_wins_a_released_key_on_sqlite() {
    let dir = tempfile::tempdir().expect("temporary directory");
    one_waiter_wins_a_released_key(StoreKind::Sqlite(dir.path().join("records.db")), || true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_waiter_wins_a_released_key_on_redis() {
    let redis = RedisServer::start();
    one_waiter_wins_a_released_key(StoreKind::Redis(redis.url()), || true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_waiter_wins_a_released_key_on_postgres() {
    let server = support::PostgresServer::start();
    let marked = || server.psql("SELECT count(*) FROM idemproxy.records WHERE waited AND state = 'in_flight'") == "1";
    one_waiter_wins_a_released_key(StoreKind::Postgres(server.url()), marked).await;
}

/// The other endings: an unknown outcome, the deadline, the bound on waiters, and a
/// client that goes away.
#[tokio::test]
async fn waits_end_unknown_at_the_deadline_at_the_bound_or_when_the_client_leaves() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "500ms");
    config.server = "max_waiters = 2".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());

    // Unknown: the upstream drops the first request's connection once it has it; its
    // waiter learns the outcome is unknown at once.
    let first = tokio::spawn(async move {
        post(
            addr,
            Some("u1"),
            "{}",
            &[("x-test-hold", "u1"), ("x-test-fail", "reset")],
        )
        .await
    });
    upstream.wait_for_key("u1").await;
    let waiter = tokio::spawn(async move { post(addr, Some("u1"), "{}", &[]).await });
    until_metric(admin, WAITERS, 1.0).await;
    upstream.release("u1");
    assert_eq!(first.await.expect("first").status, 502);
    assert_eq!(waiter.await.expect("waiter").problem(), "outcome-unknown");
    assert_eq!(metric(admin, &waits("unknown")).await, Some(1.0));

    // The bound: two wait, the third gets 409 at once; then the deadline (500 ms) ends
    // the two while the first is still held (its lease, 3 s, runs on).
    let held = tokio::spawn(async move { post(addr, Some("d1"), "{}", &[("x-test-hold", "d1")]).await });
    upstream.wait_for_key("d1").await;
    let waiting: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { post(addr, Some("d1"), "{}", &[]).await }))
        .collect();
    until_metric(admin, WAITERS, 2.0).await;
    let refused = post(addr, Some("d1"), "{}", &[]).await;
    assert_eq!(refused.problem(), "request-in-progress");
    assert_eq!(metric(admin, &waits("full")).await, Some(1.0));
    for waiter in waiting {
        assert_eq!(waiter.await.expect("waiter").problem(), "request-in-progress");
    }
    assert_eq!(metric(admin, &waits("timeout")).await, Some(2.0));
    upstream.release("d1");
    assert_eq!(held.await.expect("held").status, 201);

    // A client that leaves: its wait ends, and its slot is free again.
    let first = tokio::spawn(async move { post(addr, Some("g1"), "{}", &[("x-test-hold", "g1")]).await });
    upstream.wait_for_key("g1").await;
    let leaving = tokio::spawn(async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = "POST /v1/payments HTTP/1.1\r\nhost: x\r\nidempotency-key: g1\r\ncontent-length: 2\r\n\r\n{}";
        tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
            .await
            .expect("send");
        stream
    });
    until_metric(admin, WAITERS, 1.0).await;
    drop(leaving.await.expect("the leaving client"));
    until_metric(admin, WAITERS, 0.0).await;
    assert_eq!(metric(admin, &waits("gone")).await, Some(1.0));
    upstream.release("g1");
    assert_eq!(first.await.expect("first").status, 201);
    assert_eq!(upstream.executions("g1"), 1);
}

// === the storm, waiting ===

/// From the first request's answer to each waiter's (a waiter: a replay that started
/// before the first request ended), in the order they came: the wake-up latency.
fn wake_up_latencies(history: &History) -> Vec<std::time::Duration> {
    let mut by_key: BTreeMap<(String, String), Vec<support::history::Op>> = BTreeMap::new();
    for op in history.ops() {
        by_key.entry((op.scope.clone(), op.key.clone())).or_default().push(op);
    }
    let mut latencies = Vec::new();
    for ops in by_key.values() {
        let Some(first) = ops
            .iter()
            .find(|op| matches!(op.result, OpResult::Ok { replayed: false, .. }))
        else {
            continue;
        };
        for op in ops {
            if matches!(op.result, OpResult::Ok { replayed: true, .. }) && op.started < first.ended {
                latencies.push(op.ended.saturating_duration_since(first.ended));
            }
        }
    }
    latencies.sort();
    latencies
}

fn percentile(sorted: &[std::time::Duration], at: f64) -> std::time::Duration {
    let index = ((sorted.len() as f64 - 1.0) * at).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

/// 1,000 keys × 20 copies with up to 50 ms upstream jitter, with
/// `wait_for_in_flight = "5s"`: every duplicate gets the replay (no 409 at all), each
/// key runs once, and the checker's properties hold.
async fn waiting_storm(name: &'static str, targets: Vec<SocketAddr>, upstream: &Upstream, redis: Option<&RedisServer>) {
    let storm = Storm {
        name,
        targets,
        logical: 1000,
        duplicates: 20,
        concurrency: 96,
        jitter_ms: 50,
        streamed: false,
    };
    let run = storm.start();
    storm.run(&run).await;
    let elapsed = run.started.elapsed();
    let store = redis.map(RedisServer::dump_ttls).unwrap_or_default();
    let report = storm.check(
        &run,
        &upstream.log(),
        &store,
        std::time::Duration::from_secs(3600),
        vec![],
    );
    report.assert_clean(name);
    assert!(
        report.failures.is_empty(),
        "{name}: no 409 nor anything else: {:?}",
        report.failures
    );
    assert_eq!(report.ok, storm.total(), "{name}: every request answered 2xx");
    assert_eq!(report.executions, storm.logical, "{name}: each key ran once");
    assert_eq!(
        report.replayed,
        storm.total() - storm.logical,
        "{name}: every duplicate replayed"
    );
    if redis.is_some() {
        assert_eq!(report.store_keys, storm.logical, "{name}: one record per key");
    }
    let latencies = wake_up_latencies(&run.history);
    println!(
        "{name}: {} ops in {elapsed:.1?}; {} waited; wake-up latency p50 {:?} p99 {:?} max {:?}",
        storm.total(),
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default(),
    );
}

fn storm_config(store: StoreKind, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "2s".into();
    config.idempotency = "scope_headers = [\"authorization\"]\nwait_for_in_flight = \"5s\"".into();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_storm_across_three_proxy_processes_replays_every_duplicate() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let config = storm_config(StoreKind::Redis(redis.url()), &upstream);
    let proxies = [
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
    ];
    let targets = proxies.iter().map(|proxy| proxy.addr).collect();
    waiting_storm("wait-redis", targets, &upstream, Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_storm_on_the_memory_store_replays_every_duplicate() {
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&storm_config(StoreKind::Memory, &upstream)).await;
    waiting_storm("wait-memory", vec![proxy.addr], &upstream, None).await;
}

/// 500 waiters (50 keys held upstream, 10 waiters each) while Redis is killed and
/// started again (its AOF keeps the records): the subscriber reconnects and every
/// waiter re-reads, so each ends with the replay of its key's one execution, or at
/// worst a 409 by its deadline; nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_survive_a_redis_restart_and_nothing_runs_twice() {
    let mut redis = RedisServer::start_persistent();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "5s");
    config.upstream_timeout = "10s".into();
    config.store_timeout = "500ms".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let keys: Vec<String> = (0..50).map(|index| format!("restart-{index}")).collect();
    let mut firsts = Vec::new();
    for key in &keys {
        let key = key.clone();
        firsts.push(tokio::spawn(async move {
            post(addr, Some(&key), "{}", &[("x-test-hold", "restart")]).await
        }));
    }
    upstream.wait_for_total(keys.len()).await;
    let mut waiters = Vec::new();
    for key in &keys {
        for _ in 0..10 {
            let key = key.clone();
            waiters.push((
                key.clone(),
                tokio::spawn(async move { post(addr, Some(&key), "{}", &[]).await }),
            ));
        }
    }
    until_metric(admin, WAITERS, 500.0).await;
    redis.restart();
    upstream.release("restart");
    let mut bodies = BTreeMap::new();
    for (key, first) in keys.iter().zip(firsts) {
        let first = first.await.expect("a first request");
        assert_eq!(first.status, 201, "{key}: {first:?}");
        bodies.insert(key.clone(), first.body);
    }
    let (mut replayed, mut in_progress) = (0, 0);
    for (key, waiter) in waiters {
        let answer = waiter.await.expect("a waiter");
        if answer.status == 201 {
            assert!(answer.replayed(), "{key}: {answer:?}");
            assert_eq!(Some(&answer.body), bodies.get(&key), "{key}: its own key's execution");
            replayed += 1;
        } else {
            assert_eq!(answer.problem(), "request-in-progress", "{key}: {answer:?}");
            in_progress += 1;
        }
    }
    for key in &keys {
        assert_eq!(upstream.executions(key), 1, "{key} ran once");
    }
    println!("redis restart with 500 waiters: {replayed} replayed, {in_progress} got 409 at their deadline");
    assert_eq!(replayed + in_progress, 500);
    assert_eq!(metric(admin, WAITERS).await, Some(0.0));
}

/// 10,000 waiters on one process: the RSS they cost, the CPU the process spends while
/// they wait (none is polling), the bound (the next duplicate gets 409 at once), and
/// how long after the release the last one has its replay. Figures, not assertions on
/// them: run by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "10,000 connections: IDEMPROXY_SOAK=1 cargo test --test wait -- --ignored ten_thousand --nocapture"]
async fn ten_thousand_waiters_on_one_process() {
    assert_eq!(
        std::env::var("IDEMPROXY_SOAK").as_deref(),
        Ok("1"),
        "set IDEMPROXY_SOAK=1 to run it"
    );
    const COUNT: usize = 10_000;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "25s");
    config.upstream_timeout = "30s".into();
    // 10,000 claims arrive at once: Redis answers the last ones after a while.
    config.store_timeout = "5s".into();
    config.server = format!("max_waiters = {COUNT}\nmax_guarded_requests = 20000\nmax_connections = 15000");
    let proxy = ChildProxy::start(&config).await;
    let (addr, admin, pid) = (proxy.addr, proxy.admin, proxy.child.id());
    let first = tokio::spawn(async move { post(addr, Some("many"), "{}", &[("x-test-hold", "many")]).await });
    upstream.wait_for_key("many").await;
    let rss_before = support::h2raw::rss_kib(pid);
    // As HTTP/2 streams, 125 on each of 80 connections: 10,000 HTTP/1 connections
    // would need more descriptors than this machine's limit of 20,000 lets the proxy
    // hold (it keeps one for the upstream per client connection).
    let mut waiters = Vec::with_capacity(COUNT);
    for _ in 0..COUNT / 125 {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .expect("an HTTP/2 connection");
        tokio::spawn(connection);
        for _ in 0..125 {
            let mut sender = sender.clone();
            waiters.push(tokio::spawn(async move {
                let request = http::Request::post(format!("http://{addr}/v1/payments"))
                    .header("idempotency-key", "many")
                    .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
                    .expect("a request");
                let response = sender.send_request(request).await.expect("a response");
                let replayed = response
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|value| value == "true");
                (response.status(), replayed)
            }));
        }
    }
    until_metric(admin, WAITERS, COUNT as f64).await;
    // Each waiter reads its record once more after it starts waiting: let those
    // settle for a second, then measure what waiting itself costs.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let rss_waiting = support::h2raw::rss_kib(pid);
    let ticks = support::h2raw::cpu_ticks(pid);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let idle_ticks = support::h2raw::cpu_ticks(pid) - ticks;
    let refused = post(addr, Some("many"), "{}", &[]).await;
    assert_eq!(refused.problem(), "request-in-progress", "the bound: {refused:?}");
    assert_eq!(metric(admin, &waits("full")).await, Some(1.0));
    let released = tokio::time::Instant::now();
    upstream.release("many");
    assert_eq!(first.await.expect("first").status, 201);
    let mut replayed = 0;
    for waiter in waiters {
        let (status, was_replayed) = waiter.await.expect("a waiter");
        assert!(status == 201 && was_replayed, "{status}");
        replayed += 1;
    }
    let drained = released.elapsed();
    assert_eq!(upstream.executions("many"), 1);
    println!(
        "{COUNT} waiters: RSS {rss_before} KiB -> {rss_waiting} KiB ({:.1} KiB per waiter); \
         CPU while they waited {idle_ticks} ticks in 2 s; {replayed} replays, the last {drained:?} after the release",
        (rss_waiting.saturating_sub(rss_before)) as f64 / COUNT as f64
    );
}

/// Waiters whose deadline (60 s) and lease (the 90 s upstream timeout and a second) are
/// far longer than any wake-up: Redis restarts while they wait, and the first request
/// completes as it comes back, so its notification may go to a subscriber that is not
/// there yet. The reconnected subscriber wakes every waiter to read again: each has
/// its replay, counted `replayed`, within seconds, never at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnected_subscriber_wakes_waiters_long_before_their_deadline() {
    let mut redis = RedisServer::start_persistent();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "60s");
    config.upstream_timeout = "90s".into();
    config.store_timeout = "500ms".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let keys: Vec<String> = (0..8).map(|index| format!("long-{index}")).collect();
    let mut firsts = Vec::new();
    for key in &keys {
        let key = key.clone();
        firsts.push(tokio::spawn(async move {
            post(addr, Some(&key), "{}", &[("x-test-hold", "long")]).await
        }));
    }
    upstream.wait_for_total(keys.len()).await;
    let mut waiters = Vec::new();
    for key in &keys {
        for _ in 0..4 {
            let key = key.clone();
            waiters.push((
                key.clone(),
                tokio::spawn(async move { post(addr, Some(&key), "{}", &[]).await }),
            ));
        }
    }
    until_metric(admin, WAITERS, 32.0).await;
    redis.restart();
    let released = tokio::time::Instant::now();
    upstream.release("long");
    for (key, first) in keys.iter().zip(firsts) {
        let first = first.await.expect("a first request");
        assert_eq!(first.status, 201, "{key}: {first:?}");
    }
    let mut slowest = std::time::Duration::ZERO;
    for (key, waiter) in waiters {
        let answer = waiter.await.expect("a waiter");
        slowest = slowest.max(released.elapsed());
        assert_eq!(answer.status, 201, "{key}: {answer:?}");
        assert!(answer.replayed(), "{key}: {answer:?}");
    }
    println!("after a Redis restart, the last of 32 waiters had its replay {slowest:?} after the release");
    assert!(
        slowest < std::time::Duration::from_secs(20),
        "a waiter was not woken: {slowest:?} (its deadline is 60 s)"
    );
    assert_eq!(metric(admin, &waits("replayed")).await, Some(32.0));
    assert_eq!(metric(admin, WAITERS).await, Some(0.0));
    for key in &keys {
        assert_eq!(upstream.executions(key), 1, "{key} ran once");
    }
}

/// The redis key a test record of `key` has on the payments route.
fn record_key(key: &str) -> String {
    let key = idemproxy::idempotency::parse_key_value(key.as_bytes()).expect("a valid key");
    idemproxy::idempotency::store_key("idemproxy", "payments", &[], &key)
        .as_str()
        .to_string()
}

/// Two keys whose records live on each primary at `ports`: a plain `EXISTS` answers on
/// the node that owns the key's slot and is redirected by every other.
fn keys_on_every_primary(ports: &[u16]) -> Vec<(u16, String)> {
    let mut found = Vec::new();
    for port in ports {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a client");
        let mut connection = client.get_connection().expect("connect");
        let mine: Vec<String> = (0..)
            .map(|index| format!("spread-{index}"))
            .filter(|key| {
                redis::cmd("EXISTS")
                    .arg(record_key(key))
                    .query::<i64>(&mut connection)
                    .is_ok()
            })
            .take(2)
            .collect();
        found.extend(mine.into_iter().map(|key| (*port, key)));
    }
    found
}

/// On a cluster, keys whose records live on every primary: each record's waiters are
/// woken by its own shard channel, which shares the record's slot (the hash tag), so
/// every waiter has its replay within seconds of the release, far from its 30 s
/// deadline and the 61 s lease, on every primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_on_every_primary_of_a_cluster() {
    let cluster = RedisCluster::start();
    let primaries = cluster.primaries();
    let keys = keys_on_every_primary(&primaries);
    assert_eq!(keys.len(), 2 * primaries.len());
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Cluster(cluster.urls()), &upstream, "30s");
    config.upstream_timeout = "60s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let mut firsts = Vec::new();
    for (_, key) in &keys {
        let key = key.clone();
        firsts.push(tokio::spawn(async move {
            post(addr, Some(&key), "{}", &[("x-test-hold", "spread")]).await
        }));
    }
    upstream.wait_for_total(keys.len()).await;
    let mut waiters = Vec::new();
    for (port, key) in &keys {
        for _ in 0..3 {
            let key = key.clone();
            waiters.push((
                *port,
                key.clone(),
                tokio::spawn(async move { post(addr, Some(&key), "{}", &[]).await }),
            ));
        }
    }
    let count = waiters.len();
    until_metric(admin, WAITERS, count as f64).await;
    let released = tokio::time::Instant::now();
    upstream.release("spread");
    for first in firsts {
        assert_eq!(first.await.expect("a first request").status, 201);
    }
    let mut slowest: BTreeMap<u16, std::time::Duration> = BTreeMap::new();
    for (port, key, waiter) in waiters {
        let answer = waiter.await.expect("a waiter");
        assert_eq!(answer.status, 201, "{key}: {answer:?}");
        assert!(answer.replayed(), "{key}: {answer:?}");
        let took = released.elapsed();
        let entry = slowest.entry(port).or_default();
        *entry = (*entry).max(took);
    }
    println!("cluster: slowest replay per primary after the release: {slowest:?}");
    assert_eq!(slowest.len(), primaries.len(), "waiters on every primary");
    for (port, took) in &slowest {
        assert!(
            *took < std::time::Duration::from_secs(10),
            "the waiters on the primary at {port} were not woken: {took:?}"
        );
    }
    assert_eq!(metric(admin, &waits("replayed")).await, Some(count as f64));
}

/// A released key across three processes on one Redis: the first request fails with a
/// 500, which releases its key, while 12 waiters (4 on each process) wait for it.
/// Exactly one of them, on whichever process, claims it and runs: each key runs twice
/// in all (the failed first and the one winner), and the 11 others replay the winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_key_runs_once_more_across_processes() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "10s");
    config.upstream_timeout = "10s".into();
    let proxies = [
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
    ];
    let keys: Vec<String> = (0..10).map(|index| format!("released-{index}")).collect();
    let first_addr = proxies[0].addr;
    let mut firsts = Vec::new();
    for key in &keys {
        let key = key.clone();
        firsts.push(tokio::spawn(async move {
            post(
                first_addr,
                Some(&key),
                "{}",
                &[("x-test-hold", "released"), ("x-test-status", "500")],
            )
            .await
        }));
    }
    upstream.wait_for_total(keys.len()).await;
    let mut waiters = Vec::new();
    for proxy in &proxies {
        for key in &keys {
            for _ in 0..4 {
                let (addr, key) = (proxy.addr, key.clone());
                waiters.push((
                    key.clone(),
                    tokio::spawn(async move { post(addr, Some(&key), "{}", &[]).await }),
                ));
            }
        }
    }
    // Each waiter is counted once its subscription is in place.
    for proxy in &proxies {
        until_metric(proxy.admin, WAITERS, 40.0).await;
    }
    upstream.release("released");
    for first in firsts {
        assert_eq!(first.await.expect("a first request").status, 500);
    }
    let mut answers: BTreeMap<String, Vec<TestResponse>> = BTreeMap::new();
    for (key, waiter) in waiters {
        answers.entry(key).or_default().push(waiter.await.expect("a waiter"));
    }
    for key in &keys {
        assert_eq!(upstream.executions(key), 2, "{key}: the failed first and one winner");
        let answers = &answers[key];
        let ran: Vec<&TestResponse> = answers.iter().filter(|answer| !answer.replayed()).collect();
        assert_eq!(ran.len(), 1, "{key}: exactly one waiter ran: {answers:?}");
        for answer in answers {
            assert_eq!(answer.status, 201, "{key}: {answer:?}");
            assert_eq!(answer.body, ran[0].body, "{key}: the others replay the winner");
        }
    }
}

/// At its deadline, a waiter whose store is gone answers 503 at once: it does not go
/// on waiting for the store past the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_store_is_gone_at_its_deadline_answers_503() {
    let redis = RedisServer::start();
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(relay.url("redis")), &upstream, "1s");
    config.upstream_timeout = "30s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let first = tokio::spawn(async move { post(addr, Some("gone"), "{}", &[("x-test-hold", "gone")]).await });
    upstream.wait_for_key("gone").await;
    let waiter = tokio::spawn(async move { post(addr, Some("gone"), "{}", &[]).await });
    until_metric(admin, WAITERS, 1.0).await;
    relay.set(Mode::Reset);
    let answer = tokio::time::timeout(std::time::Duration::from_secs(15), waiter)
        .await
        .expect("the waiter went on waiting past its deadline")
        .expect("the waiter");
    assert_eq!(
        (answer.status.as_u16(), answer.problem().as_str()),
        (503, "store-unavailable"),
        "{answer:?}"
    );
    relay.set(Mode::Pass);
    upstream.release("gone");
    assert_eq!(first.await.expect("the first").status, 201);
}

/// A waiter does not poll: between two points the test controls, it reads its record
/// exactly once, when there is news. The subscriber is connected first (by a waiter on
/// another record), so that no connect wakes the waiter; then, from the moment the
/// waiter has made its first read in the wait (the claims counted are the first
/// request's, the waiter's own and that read), until its answer, it reads once more:
/// when the first request, held upstream, times out and its record is marked unknown.
/// A wake-up computed in the past (a spin) reads many times; a missed notification
/// reads at the lease's end, after the 1 s timeout, still once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_reads_its_record_only_when_there_is_news() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "2s");
    config.upstream_timeout = "1s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let warm = tokio::spawn(async move { post(addr, Some("warm"), "{}", &[("x-test-hold", "warm")]).await });
    upstream.wait_for_key("warm").await;
    let warm_waiter = tokio::spawn(async move { post(addr, Some("warm"), "{}", &[]).await });
    until_metric(admin, WAITERS, 1.0).await;
    upstream.release("warm");
    assert_eq!(warm.await.expect("the warm-up").status, 201);
    assert!(warm_waiter.await.expect("the warm-up waiter").replayed());
    until_metric(admin, WAITERS, 0.0).await;

    let claims = "idemproxy_store_operation_seconds_count{op=\"claim\",result=\"ok\"}";
    let before = metric(admin, claims).await.expect("the claim count");
    let first = tokio::spawn(async move { post(addr, Some("quiet"), "{}", &[("x-test-hold", "quiet")]).await });
    upstream.wait_for_key("quiet").await;
    let waiter = tokio::spawn(async move { post(addr, Some("quiet"), "{}", &[]).await });
    until_metric(admin, WAITERS, 1.0).await;
    until_metric(admin, claims, before + 3.0).await;
    let answer = waiter.await.expect("the waiter");
    assert_eq!(
        (answer.status.as_u16(), answer.problem().as_str()),
        (409, "outcome-unknown"),
        "{answer:?}"
    );
    let after = metric(admin, claims).await.expect("the claim count");
    assert_eq!(
        after - before,
        4.0,
        "reads after the wait began: {}",
        after - before - 3.0
    );
    assert_eq!(first.await.expect("the first").status, 504);
    upstream.release("quiet");
}

/// `CONFIG SET name value` on a Redis the test holds a connection to.
fn config_set(connection: &mut redis::Connection, name: &str, value: &str) {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query::<()>(connection)
        .unwrap_or_else(|error| panic!("CONFIG SET {name} {value}: {error}"));
}

/// A waiter whose store fails before its deadline waits on: woken by a notification
/// (published by the test) while Redis refuses writes (`maxmemory` at 1 byte: its
/// claim gets `OOM`), it reads again a moment later, not in a spin, and once Redis
/// takes writes again it has the replay of the first request, never a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_waits_on_through_a_store_that_refuses_it_for_a_moment() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "5s");
    config.upstream_timeout = "5s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let first = tokio::spawn(async move { post(addr, Some("oom"), "{}", &[("x-test-hold", "oom")]).await });
    upstream.wait_for_key("oom").await;
    let waiter = tokio::spawn(async move { post(addr, Some("oom"), "{}", &[]).await });
    until_metric(admin, WAITERS, 1.0).await;
    let client = redis::Client::open(redis.url()).expect("a client");
    let mut connection = client.get_connection().expect("connect");
    config_set(&mut connection, "maxmemory", "1");
    let channel = format!("{}:w", record_key("oom"));
    let _: i64 = redis::cmd("PUBLISH")
        .arg(&channel)
        .arg("x")
        .query(&mut connection)
        .expect("PUBLISH");
    let failed = "idemproxy_store_operation_seconds_count{op=\"claim\",result=\"error\"}";
    let started = tokio::time::Instant::now();
    while metric(admin, failed).await.unwrap_or(0.0) < 1.0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(4),
            "the woken waiter never read"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    config_set(&mut connection, "maxmemory", "0");
    let refused = metric(admin, failed).await.unwrap_or(0.0);
    upstream.release("oom");
    assert_eq!(first.await.expect("the first").status, 201);
    let answer = waiter.await.expect("the waiter");
    assert_eq!(answer.status, 201, "{answer:?}");
    assert!(answer.replayed(), "{answer:?}");
    // One read refused, perhaps two (100 ms apart), while the test saw the first.
    assert!(refused <= 3.0, "the waiter re-read in a spin: {refused} refused reads");
    assert_eq!(upstream.executions("oom"), 1);
}

/// One waiter leaving does not take the others' notifications: with two waiting on a
/// record, one client goes away; the record's channel stays subscribed, and the other
/// waiter has its replay as soon as the first request completes, long before its
/// 20 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_leaves_keeps_the_others_subscribed() {
    let redis = RedisServer::start();
    let port = redis.port;
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Redis(redis.url()), &upstream, "20s");
    config.upstream_timeout = "30s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let first = tokio::spawn(async move { post(addr, Some("pair"), "{}", &[("x-test-hold", "pair")]).await });
    upstream.wait_for_key("pair").await;
    let leaving = tokio::spawn(async move { post(addr, Some("pair"), "{}", &[]).await });
    let staying = tokio::spawn(async move { post(addr, Some("pair"), "{}", &[]).await });
    until_metric(admin, WAITERS, 2.0).await;
    leaving.abort();
    until_metric(admin, WAITERS, 1.0).await;
    assert_eq!(channels(&[port], false), 1, "the record's channel is still subscribed");
    let released = tokio::time::Instant::now();
    upstream.release("pair");
    assert_eq!(first.await.expect("the first").status, 201);
    let answer = staying.await.expect("the staying waiter");
    assert!(answer.replayed(), "{answer:?}");
    assert!(
        released.elapsed() < std::time::Duration::from_secs(10),
        "the staying waiter was not woken: {:?}",
        released.elapsed()
    );
    assert_eq!(metric(admin, &waits("gone")).await, Some(1.0));
}

/// On a cluster, a subscriber that loses its connection to one primary while that
/// primary publishes a change: the test kills the subscriber's connection there
/// (`CLIENT KILL ID`, found by its shard subscription) and keeps it from connecting
/// again (`maxclients 1`, the test's own connection being the one) while the first
/// request completes, so its notification reaches nobody. The subscriber reports the
/// loss and connects again (to the other primaries at once, to this one once it takes
/// connections again), and each time it connects it wakes every waiter to re-read:
/// the waiter has its replay within seconds, not at its 30 s deadline, and nothing ran
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_subscriber_cut_off_from_one_primary_wakes_its_waiters() {
    let cluster = RedisCluster::start();
    let primaries = cluster.primaries();
    let (port, key) = keys_on_every_primary(&primaries).swap_remove(0);
    let upstream = Upstream::start().await;
    let mut config = waiting_config(StoreKind::Cluster(cluster.urls()), &upstream, "30s");
    config.upstream_timeout = "60s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let first = {
        let key = key.clone();
        tokio::spawn(async move { post(addr, Some(&key), "{}", &[("x-test-hold", "cut")]).await })
    };
    upstream.wait_for_key(&key).await;
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move { post(addr, Some(&key), "{}", &[]).await })
    };
    until_metric(admin, WAITERS, 1.0).await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a client");
    let mut connection = client.get_connection().expect("connect");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut connection)
        .expect("CLIENT LIST");
    let subscribers: Vec<&str> = list
        .lines()
        .filter(|line| {
            line.split(' ')
                .any(|field| field.starts_with("ssub=") && field != "ssub=0")
        })
        .filter_map(|line| line.split(' ').find_map(|field| field.strip_prefix("id=")))
        .collect();
    assert_eq!(
        subscribers.len(),
        1,
        "one shard subscriber on the primary at {port}: {list}"
    );
    config_set(&mut connection, "maxclients", "1");
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(subscribers[0])
        .query(&mut connection)
        .expect("CLIENT KILL");
    assert_eq!(killed, 1);
    upstream.release("cut");
    assert_eq!(first.await.expect("the first").status, 201);
    let completed = tokio::time::Instant::now();
    let shard_channels: Vec<String> = redis::cmd("PUBSUB")
        .arg("SHARDCHANNELS")
        .query(&mut connection)
        .expect("PUBSUB SHARDCHANNELS");
    assert!(
        shard_channels.is_empty(),
        "the notification had a subscriber: {shard_channels:?}"
    );
    config_set(&mut connection, "maxclients", "10000");
    let answer = waiter.await.expect("the waiter");
    let took = completed.elapsed();
    println!("cut off from one primary: the waiter had its replay {took:?} after the first request's answer");
    assert_eq!(answer.status, 201, "{answer:?}");
    assert!(answer.replayed(), "{answer:?}");
    assert!(
        took < std::time::Duration::from_secs(10),
        "the waiter was not woken: {took:?} (its deadline is 30 s)"
    );
    assert_eq!(metric(admin, &waits("replayed")).await, Some(1.0));
    assert_eq!(upstream.executions(&key), 1);
}
