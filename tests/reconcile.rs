//! The reconciliation probe of docs/design.md §14, end to end over real sockets: the proxy in
//! front of a fake upstream that remembers which forwarded keys took effect and answers
//! the probe's lookups (`GET /v1/payments/by-key/{key}`), on the embedded store and a
//! real `redis-server`. Every first request here outlives the upstream timeout, held at
//! the upstream, so its outcome is unknown; what happens next is the probe's.
//!
//! `IDEMPROXY_SOAK=1 cargo test --test reconcile -- --ignored soak --nocapture` runs the
//! storm with 1,000 unknown records instead of 200.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::client::{metric, until_metric, until_not};
use support::upstream::Lookups;
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::time::Instant;

const TOKEN: &str = "s3cret-admin-token-for-tests";

/// The payments route with a probe that looks the key up, soon and often.
fn config(store: StoreKind, upstream: &Upstream, reconcile: &str) -> (TestConfig, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    let mut config = TestConfig::new(store, &upstream.url());
    config.upstream_timeout = "500ms".into();
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    config.server = "access_log = true".into();
    let first_after = if reconcile.contains("first_after") {
        ""
    } else {
        "first_after = \"200ms\", "
    };
    config.idempotency = format!(
        "reconcile = {{ path = \"/v1/payments/by-key/{{key}}\", {first_after}every = \"200ms\", {reconcile} }}"
    );
    (config, dir)
}

fn counter(result: &str) -> String {
    format!("idemproxy_reconciliations_total{{route=\"payments\",result=\"{result}\"}}")
}

/// The first request: it takes effect at the upstream (or, with `effect = false`,
/// never does) and is held there past the upstream timeout, so the proxy answers 504.
async fn first(addr: SocketAddr, key: &str, effect: bool) -> TestResponse {
    let mut headers = vec![("idempotency-key", key), ("x-test-hold", "forever")];
    if !effect {
        headers.push(("x-test-effect", "never"));
    }
    let response = send(addr, "POST", "/v1/payments", &headers, "{\"amount\":1}").await;
    assert_eq!(response.status, 504, "{response:?}");
    response
}

async fn retry(addr: SocketAddr, key: &str) -> TestResponse {
    send(
        addr,
        "POST",
        "/v1/payments",
        &[("idempotency-key", key)],
        "{\"amount\":1}",
    )
    .await
}

fn body(response: &TestResponse) -> serde_json::Value {
    serde_json::from_slice(&response.body).expect("a JSON body")
}

/// The 409 `outcome-unknown` while a probe is reconciling: it names the operation,
/// says it is being reconciled, and when to come back: within `most` seconds (the
/// next probe, or the end of a probe lease held now).
fn assert_reconciling(response: &TestResponse, most: u64) {
    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.problem(), "outcome-unknown");
    let body = body(response);
    assert_eq!(body["reconciling"], true, "{body}");
    assert_eq!(body["operation"].as_str().map(str::len), Some(32), "{body}");
    let retry_after: u64 = response
        .header("retry-after")
        .and_then(|value| value.parse().ok())
        .expect("a Retry-After while reconciling");
    assert!((1..=most).contains(&retry_after), "{retry_after}");
}

async fn applied_after_the_effect(store: StoreKind, upstream_key: &str) {
    let upstream = Upstream::start().await;
    // Held until the client has seen that it is being reconciled.
    upstream.set_lookups(Lookups::Hold("lookup".into()));
    let (mut config, _dir) = config(store, &upstream, "give_up_after = \"30s\"");
    config.idempotency = format!("upstream_key = \"{upstream_key}\"\n{}", config.idempotency);
    let proxy = config.start().await;
    // A key that needs encoding in a path: the probe sends it percent-encoded.
    let key = "pay/1?x=%";
    first(proxy.addr(), key, true).await;
    // The probe's lease (its timeout and a second) or the first probe is next.
    assert_reconciling(&retry(proxy.addr(), key).await, 2);
    upstream.release("lookup");

    until_metric(proxy.admin(), &counter("applied"), 1.0).await;
    let replay = retry(proxy.addr(), key).await;
    assert_eq!(replay.status, 200, "the probe's answer is replayed: {replay:?}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"));
    let log = upstream.log();
    assert_eq!(log.len(), 1, "the operation ran once: {log:?}");
    assert_eq!(
        body(&replay)["execution"],
        log[0].id,
        "the probe found the one execution"
    );
    assert_eq!(body(&replay)["found"], true);
    // Every replay after it is the same bytes.
    assert_eq!(retry(proxy.addr(), key).await.body, replay.body);

    // The probe sent no body, no client field, and the key as forwarded upstream,
    // encoded as one path segment.
    let lookups = upstream.lookups();
    assert!(!lookups.is_empty());
    let forwarded = &log[0].key;
    for lookup in &lookups {
        assert_eq!((lookup.method.as_str(), lookup.body_bytes), ("GET", 0), "{lookup:?}");
        assert!(lookup.headers.get("x-test-hold").is_none(), "{lookup:?}");
        assert!(lookup.headers.get("idempotency-key").is_none(), "{lookup:?}");
        let encoded: String = forwarded
            .bytes()
            .map(|byte| match byte {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'~' => char::from(byte).to_string(),
                byte => format!("%{byte:02X}"),
            })
            .collect();
        assert_eq!(lookup.path, format!("/v1/payments/by-key/{encoded}"));
    }
    if upstream_key == "derived" {
        assert_eq!(forwarded.len(), 32, "the derived key, not the client's: {forwarded}");
    } else {
        assert_eq!(forwarded, key);
    }
    let seconds = metric(proxy.admin(), "idemproxy_probe_seconds_count{route=\"payments\"}").await;
    assert_eq!(seconds, Some(lookups.len() as f64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_the_effect_ends_in_a_replay_of_the_probes_answer_memory() {
    applied_after_the_effect(StoreKind::Memory, "client").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_the_effect_ends_in_a_replay_of_the_probes_answer_redis() {
    let redis = RedisServer::start();
    applied_after_the_effect(StoreKind::Redis(redis.url()), "derived").await;
}

async fn not_applied_before_the_effect(store: StoreKind) {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(store, &upstream, "give_up_after = \"30s\"");
    let proxy = config.start().await;
    first(proxy.addr(), "k-lost", false).await;
    until_metric(proxy.admin(), &counter("not_applied"), 1.0).await;
    // Released: the retry runs, once more, and takes effect this time.
    let fresh = retry(proxy.addr(), "k-lost").await;
    assert_eq!(fresh.status, 201, "{fresh:?}");
    assert!(!fresh.replayed());
    assert_eq!(upstream.executions("k-lost"), 2, "one more execution after the release");
    assert!(upstream.applied("k-lost"));
    let replay = retry(proxy.addr(), "k-lost").await;
    assert!(replay.replayed() && replay.header("idempotency-reconciled").is_none());
    assert_eq!(replay.execution(), fresh.execution());
    assert_eq!(upstream.executions("k-lost"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_before_the_effect_releases_the_key_and_the_retry_runs_memory() {
    not_applied_before_the_effect(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_before_the_effect_releases_the_key_and_the_retry_runs_redis() {
    let redis = RedisServer::start();
    not_applied_before_the_effect(StoreKind::Redis(redis.url())).await;
}

/// A record the probe released can become unknown again, and the same process probes
/// it again: a chain gives up its place when it ends. The first request never takes
/// effect (the probe releases the key); the retry takes effect and times out too; a
/// second chain finds that execution, and its answer is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_unknown_a_second_time_is_probed_again_by_the_same_process() {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Memory, &upstream, "give_up_after = \"30s\"");
    let proxy = config.start().await;
    first(proxy.addr(), "k-twice", false).await;
    until_metric(proxy.admin(), &counter("not_applied"), 1.0).await;
    first(proxy.addr(), "k-twice", true).await;
    until_metric(proxy.admin(), &counter("applied"), 1.0).await;
    let replay = retry(proxy.addr(), "k-twice").await;
    assert_eq!(replay.status, 200, "{replay:?}");
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"));
    assert_eq!(upstream.executions("k-twice"), 2);
}

/// A retry that comes before the first probe is due is told when it is (its
/// `Retry-After` is the time to that probe, not a second) and begins no probe itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_before_the_first_probe_is_due_is_told_when_it_is() {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(
        StoreKind::Memory,
        &upstream,
        "first_after = \"5s\", give_up_after = \"30s\"",
    );
    let proxy = config.start().await;
    first(proxy.addr(), "k-later", true).await;
    let early = retry(proxy.addr(), "k-later").await;
    assert_eq!(early.status, 409, "{early:?}");
    let retry_after: u64 = early
        .header("retry-after")
        .and_then(|value| value.parse().ok())
        .expect("a Retry-After while reconciling");
    assert!((4..=5).contains(&retry_after), "Retry-After {retry_after}");
    assert!(upstream.lookups().is_empty(), "no probe before it is due");
}

async fn gives_up(store: StoreKind) {
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Fail(503));
    let (config, _dir) = config(store, &upstream, "give_up_after = \"2s\"");
    let proxy = config.start().await;
    first(proxy.addr(), "k-stuck", true).await;
    assert_reconciling(&retry(proxy.addr(), "k-stuck").await, 2);
    until_metric(proxy.admin(), &counter("gave_up"), 1.0).await;
    let retries = metric(proxy.admin(), &counter("retry")).await.expect("retries counted");
    assert!(retries >= 1.0, "every failed probe before it is a retry: {retries}");
    let left = retry(proxy.addr(), "k-stuck").await;
    assert_eq!(
        (left.status.as_u16(), left.problem().as_str()),
        (409, "outcome-unknown")
    );
    assert_eq!(body(&left)["reconciling"], false, "{left:?}");
    assert_eq!(left.header("retry-after"), None, "nothing to come back for");
    assert_eq!(upstream.executions("k-stuck"), 1);
    // No probe after giving up, however many retries come.
    let probes = upstream.lookups().len();
    for _ in 0..3 {
        assert_eq!(retry(proxy.addr(), "k-stuck").await.status, 409);
    }
    assert_eq!(upstream.lookups().len(), probes);
    // The operator's view says so too.
    let shown = send(
        proxy.admin(),
        "GET",
        "/records/payments?key=k-stuck",
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .await;
    assert_eq!(body(&shown)["reconciling"], false, "{shown:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_keeps_failing_gives_up_and_leaves_the_key_unknown_memory() {
    gives_up(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_keeps_failing_gives_up_and_leaves_the_key_unknown_redis() {
    let redis = RedisServer::start();
    gives_up(StoreKind::Redis(redis.url())).await;
}

/// The probe's answer is held at the upstream while an operator resolves the record:
/// the operator wins, and the probe's answer, arriving after, changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_and_an_operator_racing_never_both_win() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Hold("lookup".into()));
    let (config, _dir) = config(
        StoreKind::Redis(redis.url()),
        &upstream,
        "give_up_after = \"30s\", timeout = \"10s\"",
    );
    let proxy = config.start().await;
    first(proxy.addr(), "k-race", false).await;
    upstream.wait_for_lookups(1).await;
    let resolved = send(
        proxy.admin(),
        "POST",
        "/records/payments/resolve?key=k-race&as=not-applied",
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .await;
    assert_eq!(resolved.status, 200, "{resolved:?}");
    upstream.release("lookup");
    until_metric(proxy.admin(), &counter("lost_race"), 1.0).await;
    assert_eq!(metric(proxy.admin(), &counter("applied")).await, Some(0.0));
    // The operator's decision stands (the probe's, a 404, agreed but came second): the
    // key was freed and the retry runs.
    let fresh = retry(proxy.addr(), "k-race").await;
    assert_eq!(fresh.status, 201, "{fresh:?}");
    assert!(fresh.header("idempotency-reconciled").is_none());
    assert_eq!(upstream.executions("k-race"), 2);
}

/// A probe's answer is about the claim it was leased for. Its lookup is held at the
/// upstream while an operator frees the key and the retry times out in turn (a new
/// claim, unknown too); the held answer then arrives and must not settle the retry's
/// record: it counts `lost_race`, and the retry's record stays unknown for its own
/// claim.
async fn a_late_probe_answer_is_fenced_on_its_claim(store: StoreKind) {
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Hold("late".into()));
    let (config, _dir) = config(store, &upstream, "give_up_after = \"30s\", timeout = \"20s\"");
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let bearer = format!("Bearer {TOKEN}");
    let show = || async {
        let shown = send(
            admin,
            "GET",
            "/records/payments?key=k-late",
            &[("authorization", &bearer)],
            "",
        )
        .await;
        body(&shown)
    };
    first(addr, "k-late", true).await;
    upstream.wait_for_lookups(1).await;
    let first_claim = show().await["claim"].as_str().expect("a claim").to_string();
    let released = send(
        admin,
        "POST",
        "/records/payments/release?key=k-late",
        &[("authorization", &bearer)],
        "",
    )
    .await;
    assert_eq!(released.status, 200, "{released:?}");
    // The retry runs, and its outcome is unknown too: a new claim.
    first(addr, "k-late", false).await;
    let shown = show().await;
    let retry_claim = shown["claim"].as_str().expect("a claim").to_string();
    assert_eq!(shown["state"], "unknown", "{shown}");
    assert_ne!(retry_claim, first_claim);
    // The first probe's answer (the first execution took effect) arrives now.
    upstream.release("late");
    until_metric(admin, &counter("lost_race"), 1.0).await;
    assert_eq!(metric(admin, &counter("applied")).await, Some(0.0));
    let after = show().await;
    assert_eq!(
        (after["state"].as_str(), after["claim"].as_str()),
        (Some("unknown"), Some(retry_claim.as_str())),
        "the first probe's answer settled the retry's record: {after}"
    );
    assert_eq!(upstream.executions("k-late"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_probe_answer_never_settles_a_later_claim_memory() {
    a_late_probe_answer_is_fenced_on_its_claim(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_probe_answer_never_settles_a_later_claim_redis() {
    let redis = RedisServer::start();
    a_late_probe_answer_is_fenced_on_its_claim(StoreKind::Redis(redis.url())).await;
}

/// Two proxy processes on one Redis: the one that began probing is SIGKILLed with its
/// probe in flight; once its probe lease ends, a retry at the other finds the probe due
/// and takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_mid_probe_is_taken_over_by_another() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Hold("first-probe".into()));
    let (config, _dir) = config(
        StoreKind::Redis(redis.url()),
        &upstream,
        "give_up_after = \"60s\", timeout = \"2s\"",
    );
    let mut prober = ChildProxy::start(&config).await;
    let survivor = ChildProxy::start(&config).await;
    first(prober.addr, "k-orphan", true).await;
    upstream.wait_for_lookups(1).await;
    prober.kill();
    // The killed instance's lease still holds the probe: reconciling, not due yet.
    assert_reconciling(&retry(survivor.addr, "k-orphan").await, 3);
    upstream.set_lookups(Lookups::Answer);
    let replay = until_not(|| retry(survivor.addr, "k-orphan"), &[(409, "outcome-unknown")]).await;
    assert_eq!(replay.status, 200, "{replay:?}");
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"));
    assert_eq!(upstream.executions("k-orphan"), 1);
    assert_eq!(metric(survivor.admin, &counter("applied")).await, Some(1.0));
    let lookups = upstream.lookups();
    assert!(lookups.len() >= 2, "the survivor probed again: {lookups:?}");
    // Not before the killed instance's lease (the probe timeout and a second) ended.
    let gap = lookups[1].at - lookups[0].at;
    assert!(gap >= Duration::from_millis(2_500), "taken over after {gap:?}");
    upstream.release("first-probe");
}

/// SQLite, one process per file: a proxy SIGKILLed while its requests are held at the
/// upstream leaves their records in flight, and no other instance will find them.
/// Restarted on its file, it probes them itself once their leases are over, with no
/// client retry (docs/design.md §21): the payments probe (by `{key}`, the key its
/// record kept) finds the one execution, and the retry that comes later replays it;
/// the refunds probe (by `{record}`, no key kept) finds nothing and releases its key.
/// The orders route has no probe: its two records are left for an operator, and the
/// start's log line counts them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_a_killed_proxy_left_in_flight_are_probed_when_it_restarts_on_its_file() {
    let upstream = Upstream::start().await;
    let files = tempfile::tempdir().expect("a directory");
    let store = StoreKind::Sqlite(files.path().join("records.db"));
    let (mut config, _dir) = config(store, &upstream, "give_up_after = \"60s\"");
    config.extra_routes = format!(
        "[[route]]\nname = \"refunds\"\npath_prefix = \"/v1/refunds\"\nupstream = \"{}\"\nupstream_timeout = \"500ms\"\n\n\
         [route.idempotency]\nreconcile = {{ path = \"/v1/payments/by-key/{{record}}\", first_after = \"200ms\", \
         every = \"200ms\", give_up_after = \"60s\" }}\n",
        upstream.url()
    );
    let mut killed = ChildProxy::start(&config).await;
    let held = [
        ("/v1/payments", "k-left"),
        ("/v1/refunds", "k-refund"),
        ("/v1/orders", "k-orders"),
        ("/v1/orders", "k-orders-2"),
    ];
    for (path, key) in held {
        let addr = killed.addr;
        let headers = [("idempotency-key", key), ("x-test-hold", "left")];
        tokio::spawn(async move { support::client::try_send(addr, "POST", path, &headers, "{\"amount\":1}").await });
        upstream.wait_for_key(key).await;
    }
    killed.kill();
    upstream.release("left");
    let log = files.path().join("restarted.log");
    let restarted = ChildProxy::start_logged(&config, &log, &[]).await;
    until_metric(restarted.admin, &counter("applied"), 1.0).await;
    let refunds = "idemproxy_reconciliations_total{route=\"refunds\",result=\"not_applied\"}";
    until_metric(restarted.admin, refunds, 1.0).await;
    let replay = retry(restarted.addr, "k-left").await;
    assert_eq!(replay.status, 200, "{replay:?}");
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"));
    assert_eq!(upstream.executions("k-left"), 1);
    assert_eq!(upstream.lookups().len(), 2, "one probe of each, by the restarted proxy");
    let again = |path: &'static str, key: &'static str| {
        let addr = restarted.addr;
        async move { send(addr, "POST", path, &[("idempotency-key", key)], "{\"amount\":1}").await }
    };
    let refund = again("/v1/refunds", "k-refund").await;
    assert_eq!(refund.status, 201, "released, so the retry runs: {refund:?}");
    assert_eq!(upstream.executions("k-refund"), 2);
    let orders = again("/v1/orders", "k-orders").await;
    assert_eq!(
        (orders.status.as_u16(), orders.problem()),
        (409, "outcome-unknown".to_string())
    );
    assert_eq!(upstream.executions("k-orders"), 1);
    drop(restarted);
    let counted = support::proxy::log_line(&log, "records the last run left unknown or in flight");
    assert!(counted.contains("scheduled=2 left=2"), "{counted}");
}

/// Three proxy processes on one Redis. The one whose request timed out is SIGKILLed
/// before its first probe, so the record stays due with nobody probing it; once it is
/// overdue by more than a probe lease, retries reach the two others at once and each
/// asks for the probe lease. One gets it: one lookup, one probe, one resolution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_finding_an_overdue_probe_at_once_probe_it_once() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Hold("overdue".into()));
    // A probe lease of 3 s (the probe's timeout and a second).
    let (config, _dir) = config(
        StoreKind::Redis(redis.url()),
        &upstream,
        "first_after = \"2s\", give_up_after = \"60s\", timeout = \"2s\"",
    );
    let mut prober = ChildProxy::start(&config).await;
    let others = [ChildProxy::start(&config).await, ChildProxy::start(&config).await];
    first(prober.addr, "k-overdue", true).await;
    prober.kill();
    // Elapsed time is the precondition here, not a synchronisation: due 2 s after the
    // 504, then overdue for more than the 3 s lease before anyone looks.
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    assert!(upstream.lookups().is_empty(), "the killed instance never probed");
    let (b, c) = (others[0].addr, others[1].addr);
    let (at_b, at_c) = tokio::join!(retry(b, "k-overdue"), retry(c, "k-overdue"));
    assert_reconciling(&at_b, 3);
    assert_reconciling(&at_c, 3);
    // Each instance whose retry found the probe overdue begins a chain and asks for the
    // lease at once, and answers `Retry-After: 1`; one whose retry read the record after
    // the other had taken the lease (a loaded machine can order them so) is told the
    // next probe is 2 or 3 s away and begins none. Every chain begun has asked before
    // the held lookup is let go: the lease is what keeps them to one lookup.
    let begun = "idemproxy_store_operation_seconds_count{op=\"begin_probe\",result=\"ok\"}";
    let chains = [&at_b, &at_c]
        .iter()
        .filter(|answer| answer.header("retry-after") == Some("1"))
        .count();
    println!("overdue probe: {chains} of the two retries began a chain");
    let started = Instant::now();
    loop {
        let mut asked = 0.0;
        for other in &others {
            asked += metric(other.admin, begun).await.unwrap_or(0.0);
        }
        if asked >= chains.max(1) as f64 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "only {asked} of {chains} asked for the lease"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    upstream.wait_for_lookups(1).await;
    upstream.release("overdue");
    let replay = until_not(|| retry(b, "k-overdue"), &[(409, "outcome-unknown")]).await;
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"), "{replay:?}");
    let mut probes = 0.0;
    let mut lost = 0.0;
    for other in &others {
        let admin = other.admin;
        probes += metric(admin, "idemproxy_probe_seconds_count{route=\"payments\"}")
            .await
            .unwrap_or(0.0);
        lost += metric(admin, &counter("lost_race")).await.unwrap_or(0.0);
    }
    let lookups = upstream.lookups();
    assert_eq!(lookups.len(), 1, "two instances probed one record: {lookups:?}");
    assert_eq!((probes, lost), (1.0, 0.0), "probes and lost races across the two");
    assert_eq!(upstream.max_lookups_in_flight(), 1);
    assert_eq!(upstream.executions("k-overdue"), 1);
}

/// A probe asks with the method its route names, never the client's: a `PATCH` whose
/// outcome is unknown is looked up with `HEAD`, and the `HEAD` answer (no body) is
/// what the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_asks_with_its_own_method_whatever_the_client_used() {
    let upstream = Upstream::start().await;
    let (mut config, _dir) = config(
        StoreKind::Memory,
        &upstream,
        "method = \"HEAD\", give_up_after = \"30s\"",
    );
    config.idempotency = format!("methods = [\"POST\", \"PATCH\"]\n{}", config.idempotency);
    let proxy = config.start().await;
    let headers = [("idempotency-key", "k-patch"), ("x-test-hold", "forever")];
    let timed_out = send(proxy.addr(), "PATCH", "/v1/payments/7", &headers, "{\"amount\":2}").await;
    assert_eq!(timed_out.status, 504, "{timed_out:?}");
    until_metric(proxy.admin(), &counter("applied"), 1.0).await;
    let lookups = upstream.lookups();
    assert!(!lookups.is_empty());
    for lookup in &lookups {
        assert_eq!(
            (lookup.method.as_str(), lookup.path.as_str(), lookup.body_bytes),
            ("HEAD", "/v1/payments/by-key/k-patch", 0),
            "{lookup:?}"
        );
    }
    let retry = send(
        proxy.addr(),
        "PATCH",
        "/v1/payments/7",
        &[("idempotency-key", "k-patch")],
        "{\"amount\":2}",
    )
    .await;
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(retry.header("idempotency-reconciled"), Some("true"));
    assert!(retry.body.is_empty(), "a HEAD answer has no body to replay: {retry:?}");
    assert_eq!(upstream.executions("k-patch"), 1);
}

/// The key the upstream is sent and the key a probe asks about are one: a key sent as
/// an RFC 8941 string (`"order-7"`, the draft's own form; with an escape, `"k\"x"`) is
/// forwarded in its canonical form, unquoted, and the probe's lookup names that same
/// key, so an operation that took effect is found, recorded and replayed, never run
/// again. A key with a dot in it is probed with the dot encoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quoted_key_is_forwarded_and_probed_as_the_same_key() {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Memory, &upstream, "give_up_after = \"30s\"");
    let proxy = config.start().await;
    let cases = [("\"order-7\"", "order-7"), ("\"k\\\"x\"", "k\"x"), ("pay.1", "pay.1")];
    for (n, (sent, canonical)) in cases.iter().enumerate() {
        first(proxy.addr(), sent, true).await;
        until_metric(proxy.admin(), &counter("applied"), (n + 1) as f64).await;
        let log = upstream.log();
        assert_eq!(log[n].key, *canonical, "the upstream is sent the canonical key");
        // The retry may spell the key either way: it is one key.
        for spelling in [*sent, *canonical] {
            let replay = retry(proxy.addr(), spelling).await;
            assert_eq!(replay.status, 200, "{sent} retried as {spelling}: {replay:?}");
            assert_eq!(replay.header("idempotency-reconciled"), Some("true"));
        }
        assert_eq!(upstream.executions(canonical), 1, "{sent} ran once");
    }
    let dotted = upstream
        .lookups()
        .into_iter()
        .find(|lookup| lookup.path.contains("pay%2E") || lookup.path.contains("pay."));
    assert_eq!(
        dotted.map(|lookup| lookup.path),
        Some("/v1/payments/by-key/pay%2E1".to_string()),
        "a dot goes out encoded"
    );
}

/// A key of dots only would be a dot segment in a probe's path (`/by-key/..` is
/// `/by-key/` to an upstream that normalises paths), and so would a key holding one
/// between slashes (`a/../../admin` goes out as one escaped segment, but an upstream
/// that decodes every escape before removing dot segments, as nginx's location
/// matching does, reads `/admin`): on a route whose probe or refetch names the key it
/// is refused before anything is forwarded; elsewhere it is a key like another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_a_dot_segment_is_refused_where_a_probe_or_refetch_would_put_it_in_a_path() {
    let upstream = Upstream::start().await;
    let (mut config, _dir) = config(StoreKind::Memory, &upstream, "give_up_after = \"30s\"");
    config.extra_routes = format!(
        "[[route]]\nname = \"unprobed\"\npath_prefix = \"/v1/unprobed\"\nupstream = \"{0}\"\n\n[route.idempotency]\n\n\
         [[route]]\nname = \"refetched\"\npath_prefix = \"/v1/refetched\"\nupstream = \"{0}\"\n\n[route.idempotency]\n\
         replay = \"refetch\"\nrefetch = {{ path = \"/v1/refetched/by-key/{{key}}\" }}\n",
        upstream.url()
    );
    let proxy = config.start().await;
    let keys = [
        ".",
        "..",
        "...",
        "a/../../admin",
        "a\\..\\admin",
        "a%2F..%2Fadmin",
        "a%5c%2e%2E%5cadmin",
        "x/./y",
        "../",
    ];
    for key in keys {
        let refused = retry(proxy.addr(), key).await;
        assert_eq!(
            (refused.status.as_u16(), refused.problem().as_str()),
            (400, "invalid-idempotency-key"),
            "{key}: {refused:?}"
        );
        let refetched = send(proxy.addr(), "POST", "/v1/refetched", &[("idempotency-key", key)], "{}").await;
        assert_eq!(
            (refetched.status.as_u16(), refetched.problem().as_str()),
            (400, "invalid-idempotency-key"),
            "{key} on a refetch route: {refetched:?}"
        );
        let elsewhere = send(proxy.addr(), "POST", "/v1/unprobed", &[("idempotency-key", key)], "{}").await;
        assert_eq!(elsewhere.status, 201, "{key} on a route without a probe: {elsewhere:?}");
    }
    // Dots within a segment are a key like another.
    for key in ["a..b", "v1.2", "a/..b/c"] {
        let taken = send(proxy.addr(), "POST", "/v1/refetched", &[("idempotency-key", key)], "{}").await;
        assert_eq!(taken.status, 201, "{key}: {taken:?}");
    }
    assert_eq!(
        upstream.log().len(),
        keys.len() + 3,
        "only the route without a probe forwarded them"
    );
}

/// A probe holds its place among `max_concurrent` until its answer is in: with one
/// place and two unknown records, the second probe waits (counted in
/// `idemproxy_probes_waiting`) while the first's lookup is held at the upstream, and
/// goes once it is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_keeps_its_place_until_its_answer_is_in() {
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Hold("one-place".into()));
    let (config, _dir) = config(
        StoreKind::Memory,
        &upstream,
        "give_up_after = \"30s\", timeout = \"20s\", max_concurrent = 1",
    );
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    tokio::join!(first(addr, "k-one", true), first(addr, "k-two", true));
    upstream.wait_for_lookups(1).await;
    let waiting = "idemproxy_probes_waiting{route=\"payments\"}";
    until_metric(admin, waiting, 1.0).await;
    assert_eq!(upstream.lookups().len(), 1, "the second probe went past max_concurrent");
    upstream.release("one-place");
    until_metric(admin, &counter("applied"), 2.0).await;
    assert_eq!(metric(admin, waiting).await, Some(0.0));
    assert_eq!(upstream.lookups().len(), 2);
    assert_eq!(upstream.max_lookups_in_flight(), 1, "two probes at once");
}

/// `max_concurrent` lowered by a reload holds from then on, for the chains of probes
/// that began before it too: five records become unknown under a bound of 4, the
/// bound is reloaded to 1 before their first probes, and their lookups (held at the
/// upstream) then go one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_max_concurrent_holds_for_chains_that_began_before_it() {
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Hold("capped".into()));
    let settings = |max: usize| {
        format!("first_after = \"2s\", give_up_after = \"60s\", timeout = \"20s\", max_concurrent = {max}")
    };
    let (config, _dir) = config(StoreKind::Memory, &upstream, &settings(4));
    let file = config.write_temp();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let firsts: Vec<_> = (0..5)
        .map(|n| tokio::spawn(async move { first(addr, &format!("k-capped-{n}"), true).await }))
        .collect();
    for first in firsts {
        first.await.expect("a first request");
    }
    let (lowered, _dir2) = config_for_reload(&upstream, &settings(1), &config);
    std::fs::write(file.path(), lowered).expect("rewrite the config");
    proxy
        .running
        .reloader()
        .reload(file.path())
        .await
        .expect("the reload is taken");
    upstream.wait_for_lookups(1).await;
    until_metric(admin, "idemproxy_probes_waiting{route=\"payments\"}", 4.0).await;
    assert_eq!(
        upstream.lookups().len(),
        1,
        "more probes at once than the reloaded bound"
    );
    upstream.release("capped");
    until_metric(admin, &counter("applied"), 5.0).await;
    assert_eq!(upstream.max_lookups_in_flight(), 1);
}

/// `config`'s text with its probe settings replaced by `reconcile` (its ports kept).
fn config_for_reload(upstream: &Upstream, reconcile: &str, running: &TestConfig) -> (String, tempfile::TempDir) {
    let (mut next, dir) = config(running.store.clone(), upstream, reconcile);
    next.admin_extra = running.admin_extra.clone();
    next.listen = running.listen.clone();
    next.admin_listen = running.admin_listen.clone();
    (next.toml(), dir)
}

/// Many records become unknown at once: their probes run at most `max_concurrent` at
/// a time per instance, every client gets its answer, and the operations ran once.
/// Prints how long, from its 504, each client took to get its answer.
async fn storm(records: usize) {
    let upstream = Upstream::start().await;
    upstream.set_lookups(Lookups::Slow(Duration::from_millis(20)));
    let (config, _dir) = config(
        StoreKind::Memory,
        &upstream,
        // Under a storm the first requests reach the upstream late: the first probe
        // waits until every one that will arrive has (see `first_after` in docs/configuration.md).
        "give_up_after = \"5m\", max_concurrent = 4, first_after = \"2s\"",
    );
    let proxy = config.start().await;
    let addr = proxy.addr();
    let mut clients = Vec::new();
    for n in 0..records {
        clients.push(tokio::spawn(async move {
            let key = format!("storm-{n}");
            first(addr, &key, true).await;
            let timed_out = Instant::now();
            // As a client that honours Retry-After does.
            let answer = loop {
                let answer = retry(addr, &key).await;
                if answer.status != 409 {
                    break answer;
                }
                let seconds: u64 = answer
                    .header("retry-after")
                    .and_then(|value| value.parse().ok())
                    .expect("a Retry-After while reconciling");
                assert!(timed_out.elapsed() < Duration::from_secs(120), "no answer in 2 minutes");
                tokio::time::sleep(Duration::from_secs(seconds)).await;
            };
            // Reconciled as applied; or, for a first request that never reached the
            // upstream in time (its connection still being made when the proxy gave
            // up: it is never sent), released as not applied and run by this retry.
            let reconciled = answer.header("idempotency-reconciled") == Some("true");
            assert!(
                (answer.status == 200 && reconciled) || (answer.status == 201 && !answer.replayed()),
                "{answer:?}"
            );
            (timed_out.elapsed(), reconciled)
        }));
    }
    let mut waited = Vec::new();
    let mut applied = 0;
    for client in clients {
        let (took, reconciled) = client.await.expect("a client");
        waited.push(took);
        applied += usize::from(reconciled);
    }
    waited.sort();
    let at = |q: f64| waited[((waited.len() - 1) as f64 * q).round() as usize];
    println!(
        "reconcile storm: {records} unknown records, max_concurrent 4: time to answer from the 504: p50 {:?} p99 {:?} max {:?}; {applied} applied, {} not applied; {} lookups, at most {} at once",
        at(0.5),
        at(0.99),
        at(1.0),
        records - applied,
        upstream.lookups().len(),
        upstream.max_lookups_in_flight()
    );
    assert!(
        upstream.max_lookups_in_flight() <= 4,
        "more probes at once than max_concurrent"
    );
    // Every operation took effect exactly once: a first request that arrived, or the
    // retry after one that never did.
    let log = upstream.log();
    assert_eq!(log.len(), records, "{} executions for {records} operations", log.len());
    let keys: std::collections::HashSet<&str> = log.iter().map(|run| run.key.as_str()).collect();
    assert_eq!(keys.len(), records, "a key ran twice");
    assert_eq!(metric(proxy.admin(), &counter("applied")).await, Some(applied as f64));
    assert_eq!(
        metric(proxy.admin(), &counter("not_applied")).await,
        Some((records - applied) as f64)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_unknown_outcomes_is_probed_within_max_concurrent() {
    storm(200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a soak: IDEMPROXY_SOAK=1 cargo test --test reconcile -- --ignored soak --nocapture"]
async fn soak_a_storm_of_a_thousand_unknown_outcomes() {
    assert_eq!(
        std::env::var("IDEMPROXY_SOAK").as_deref(),
        Ok("1"),
        "set IDEMPROXY_SOAK=1 to run the soak"
    );
    storm(1_000).await;
}

/// The probe's scripts on the other Redis topologies: through Sentinel to its primary,
/// and on a cluster, where each record's scripts run on the shard of its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_reconciles_through_sentinel_and_on_a_cluster() {
    let group = support::topology::SentinelGroup::start();
    let sentinel = StoreKind::Sentinel(group.urls(), support::topology::MASTER_NAME.into());
    applied_after_the_effect(sentinel.clone(), "derived").await;
    not_applied_before_the_effect(sentinel).await;
    drop(group);
    let cluster = support::topology::RedisCluster::start();
    let store = StoreKind::Cluster(cluster.urls());
    applied_after_the_effect(store.clone(), "client").await;
    not_applied_before_the_effect(store.clone()).await;
    gives_up(store).await;
}

// === the history checker, with resolutions ===

/// Two proxy processes on one Redis, a route with a probe: 40 keys whose first request
/// outlives the upstream timeout, half after taking effect and half before; each
/// client retries at either proxy until it gets an answer. Every answer is recorded
/// and held by the checker to UnknownSticky as restated: each resolution agrees with
/// what the upstream did, and no operation took effect twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_resolution_agrees_with_what_the_upstream_did() {
    use support::history::{Contract, History, check};
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Redis(redis.url()), &upstream, "give_up_after = \"1m\"");
    let proxies = [ChildProxy::start(&config).await, ChildProxy::start(&config).await];
    let targets = [proxies[0].addr, proxies[1].addr];
    let history = std::sync::Arc::new(History::default());
    let run_started = Instant::now();
    let keys: Vec<String> = (0..40).map(|n| format!("history-{n}")).collect();
    let mut clients = Vec::new();
    for (n, key) in keys.iter().cloned().enumerate() {
        let history = history.clone();
        clients.push(tokio::spawn(async move {
            let effect = if n % 2 == 0 { "always" } else { "never" };
            let headers = [
                ("idempotency-key", key.as_str()),
                ("x-test-hold", "forever"),
                ("x-test-effect", effect),
            ];
            let started = Instant::now();
            let sent = support::client::try_send(targets[n % 2], "POST", "/v1/payments", &headers, "{}").await;
            history.record("", &key, started, sent.map_err(|error| error.to_string()));
            let deadline = Instant::now() + Duration::from_secs(20);
            for attempt in 1.. {
                let started = Instant::now();
                let retry = [("idempotency-key", key.as_str())];
                let sent =
                    support::client::try_send(targets[(n + attempt) % 2], "POST", "/v1/payments", &retry, "{}").await;
                let settled = matches!(&sent, Ok(response) if response.status != 409);
                history.record("", &key, started, sent.map_err(|error| error.to_string()));
                if settled {
                    return;
                }
                assert!(Instant::now() < deadline, "{key}: no answer in 20 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }
    for client in clients {
        client.await.expect("a client");
    }
    let report = check(
        &history,
        &upstream.log(),
        &redis.dump_ttls(),
        &Contract {
            retention: Duration::from_secs(3600),
            remember: Duration::from_secs(3600),
            run_started,
            raw_keys: keys.clone(),
            outage_windows: vec![],
            resolving: true,
        },
    );
    report.print("probes on two proxy processes");
    report.assert_clean("probes on two proxy processes");
    // Half were applied (replayed, reconciled), half released and run again.
    let reconciled = history
        .ops()
        .iter()
        .filter(|op| matches!(op.result, support::history::OpResult::Ok { reconciled: true, .. }))
        .count();
    assert_eq!(reconciled, 20, "{report:?}");
    assert_eq!(upstream.total(), 60, "20 ran once, 20 ran again after a release");
}

/// The checker catches resolutions that disagree with the upstream: a reconciled
/// replay of an operation that never took effect, and a key released (and run again)
/// after its first execution took effect; and, on a run without resolutions, any
/// change to an unknown key.
#[tokio::test]
async fn the_checker_catches_a_resolution_that_lies() {
    use support::history::{Contract, History, check};
    use support::upstream::Execution;
    let at = Instant::now();
    let execution = |id: u64, effect: bool, offset_ms: u64| Execution {
        id,
        at: at + Duration::from_millis(offset_ms),
        key: "k".into(),
        method: "POST".into(),
        path: "/v1/payments".into(),
        headers: http::HeaderMap::new(),
        body: bytes::Bytes::new(),
        effect,
    };
    let answer = |status: u16, headers: &[(&'static str, &str)], body: &str| {
        let mut map = http::HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, value.parse().expect("a header"));
        }
        Ok(TestResponse {
            status: http::StatusCode::from_u16(status).expect("a status"),
            headers: map,
            body: bytes::Bytes::from(body.to_string()),
        })
    };
    let unknown = || {
        answer(
            504,
            &[
                ("content-type", "application/problem+json"),
                ("cache-control", "no-store"),
            ],
            "{\"type\":\"urn:idemproxy:problem:upstream-timeout\",\"title\":\"t\",\"status\":504,\"detail\":\"d\"}",
        )
    };
    let contract = |resolving| Contract {
        retention: Duration::from_secs(3600),
        remember: Duration::from_secs(3600),
        run_started: at,
        raw_keys: vec![],
        outage_windows: vec![],
        resolving,
    };
    let reconciled = [
        ("x-execution-id", "1"),
        ("idempotent-replayed", "true"),
        ("idempotency-reconciled", "true"),
    ];

    // Applied, but the one execution never took effect.
    let lie = History::default();
    lie.record("", "k", at, unknown());
    lie.record("", "k", Instant::now(), answer(200, &reconciled, "{}"));
    let report = check(&lie, &[execution(1, false, 0)], &[], &contract(true));
    assert_eq!(report.unknown_sticky_violations, 1, "{report:?}");
    // The same answer, when it did take effect, is the truth.
    let truth = check(&lie, &[execution(1, true, 0)], &[], &contract(true));
    assert_eq!(truth.unknown_sticky_violations, 0, "{truth:?}");

    // Released as not applied and run again, though the first took effect.
    let released = History::default();
    released.record("", "k", at, unknown());
    tokio::time::sleep(Duration::from_millis(5)).await;
    released.record("", "k", Instant::now(), answer(201, &[("x-execution-id", "2")], "{}"));
    let runs = [execution(1, true, 0), execution(2, true, 50)];
    let report = check(&released, &runs, &[], &contract(true));
    assert!(report.unknown_sticky_violations >= 1, "{report:?}");
    assert_eq!(report.max_executions_per_key, 2);
    let honest = [execution(1, false, 0), execution(2, true, 50)];
    assert_eq!(
        check(&released, &honest, &[], &contract(true)).unknown_sticky_violations,
        0
    );
    // Without resolutions in the run, even an honest release is a change.
    assert!(check(&released, &honest, &[], &contract(false)).unknown_sticky_violations >= 1);
}
