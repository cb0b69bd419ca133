//! Reload on SIGHUP (docs/design.md §8): routes, policies and upstreams swapped under load
//! with no failure and no duplicate; a renewed certificate and a rotated admin token
//! picked up; what cannot reload refused.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;
use support::client::until_metric;
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, Upstream, send};
use tokio::sync::watch;

/// The admin token the reload tests rotate.
const TOKEN: &str = "s3cret-admin-token-for-tests";

/// Guarded requests from `TASKS` clients, each key sent, then sent again once it has
/// its answer, plus an unguarded read per key, until `stop`. Every answer must be the
/// first execution's (201) or its replay; anything else is a failure, kept for the
/// report. `done` counts the keys finished.
struct Storm {
    stop: Arc<AtomicBool>,
    done: watch::Receiver<usize>,
    tasks: Vec<tokio::task::JoinHandle<Vec<String>>>,
}

const TASKS: usize = 8;

impl Storm {
    fn start(addr: SocketAddr) -> Storm {
        let stop = Arc::new(AtomicBool::new(false));
        let (count, done) = watch::channel(0);
        let count = Arc::new(count);
        let tasks = (0..TASKS)
            .map(|task| {
                let (stop, count) = (stop.clone(), count.clone());
                tokio::spawn(async move {
                    let mut failures = Vec::new();
                    let mut index = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let key = format!("storm-{task}-{index}");
                        let headers = [("idempotency-key", key.as_str())];
                        let first = send(addr, "POST", "/v1/payments", &headers, "{\"amount\":1}").await;
                        let again = send(addr, "POST", "/v1/payments", &headers, "{\"amount\":1}").await;
                        let read = send(addr, "GET", "/v1/reads/item", &[], "").await;
                        let answered = (first.status.as_u16(), again.status.as_u16(), read.status.as_u16());
                        if answered != (201, 201, 201)
                            || first.replayed()
                            || !again.replayed()
                            || first.execution() != again.execution()
                        {
                            failures.push(format!("{key}: {first:?} then {again:?}, read {read:?}"));
                        }
                        index += 1;
                        count.send_modify(|done| *done += 1);
                    }
                    failures
                })
            })
            .collect();
        Storm { stop, done, tasks }
    }

    /// Waits until `more` keys beyond those finished now have finished.
    async fn run_for(&mut self, more: usize) -> usize {
        let target = *self.done.borrow() + more;
        let reached = self
            .done
            .wait_for(|done| *done >= target)
            .await
            .expect("the storm runs");
        *reached
    }

    async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut failures = Vec::new();
        for task in self.tasks {
            failures.extend(task.await.expect("a storm task"));
        }
        failures
    }
}

/// Waits until `idemproxy_config_reloads_total{result}` reaches `count`: the reload
/// is counted once every worker serves the new config.
async fn reloaded(admin: SocketAddr, result: &str, count: f64) {
    let line = format!("idemproxy_config_reloads_total{{result=\"{result}\"}}");
    until_metric(admin, &line, count).await;
}

/// The config hash `/metrics` reports: the one series of `idemproxy_config_info`.
async fn loaded_sha256(admin: SocketAddr) -> String {
    let metrics = send(admin, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics.body).to_string();
    let hashes: Vec<&str> = metrics
        .lines()
        .filter_map(|line| {
            line.strip_prefix("idemproxy_config_info{sha256=\"")?
                .strip_suffix("\"} 1")
        })
        .collect();
    assert_eq!(hashes.len(), 1, "one config is loaded:\n{metrics}");
    hashes.first().map(|hash| hash.to_string()).unwrap_or_default()
}

fn file_sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).expect("read the config");
    const_hex::encode(ring::digest::digest(&ring::digest::SHA256, &bytes))
}

/// The record's remaining retention, from the records API.
async fn ttl_ms(admin: SocketAddr, key: &str) -> u64 {
    let bearer = format!("Bearer {TOKEN}");
    let path = format!("/records/payments?key={key}");
    let shown = send(admin, "GET", &path, &[("authorization", &bearer)], "").await;
    let body: Value = serde_json::from_slice(&shown.body).expect("the records API answers JSON");
    body["ttl_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no ttl for {key}: {body}"))
}

/// A storm of guarded requests across two reloads that move the payments route from
/// upstream A to B and back, with a shorter retention each time, on two workers
/// sharing a real Redis; an invalid file and one that moves the listener are refused
/// between them. A request held at A across the first reload finishes there.
#[tokio::test]
async fn reload_under_load_swaps_upstream_and_retention_without_a_failure_or_a_duplicate() {
    let redis = RedisServer::start();
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).expect("write the token");
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &a.url());
    config.server = "workers = 2".into();
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    let proxy = ChildProxy::start(&config).await;
    let (addr, admin) = (proxy.addr, proxy.admin);
    assert_eq!(loaded_sha256(admin).await, file_sha256(proxy.config_path()));
    let post = |key: &'static str, hold: Option<&'static str>| async move {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend(hold.map(|gate| ("x-test-hold", gate)));
        send(addr, "POST", "/v1/payments", &headers, "{\"amount\":1}").await
    };

    let mut storm = Storm::start(addr);
    storm.run_for(150).await;
    let held = tokio::spawn(post("held", Some("held")));
    a.wait_for_key("held").await;

    // Reload 1: upstream B, retention 30 minutes.
    let mut to_b = config.clone();
    to_b.upstream = b.url();
    to_b.retention = "30m".into();
    proxy.rewrite(&to_b);
    proxy.signal("HUP");
    reloaded(admin, "ok", 1.0).await;
    let at_reload = *storm.done.borrow();
    let probe = post("probe-1", None).await;
    assert_eq!(probe.status, 201);
    assert_eq!((a.executions("probe-1"), b.executions("probe-1")), (0, 1));
    assert!(ttl_ms(admin, "probe-1").await <= 30 * 60 * 1000);
    assert!(
        ttl_ms(admin, "storm-0-0").await > 30 * 60 * 1000,
        "a record keeps the retention it was made with"
    );
    // The request in flight at the reload finishes under the config it started with.
    a.release("held");
    let held = held.await.expect("the held request");
    assert_eq!((held.status.as_u16(), held.replayed()), (201, false));
    assert!(post("held", None).await.replayed());
    assert_eq!((a.executions("held"), b.executions("held")), (1, 0));
    storm.run_for(150).await;

    // Refused: a file that does not parse, and one that moves the listener. The
    // config of reload 1 keeps serving.
    let serving = loaded_sha256(admin).await;
    assert_eq!(serving, file_sha256(proxy.config_path()));
    proxy.write("[server\nlisten = ");
    proxy.signal("HUP");
    reloaded(admin, "invalid", 1.0).await;
    let mut moved = to_b.clone();
    moved.listen = "127.0.0.1:1".into();
    moved.admin_listen = admin.to_string();
    proxy.write(&moved.toml());
    proxy.signal("HUP");
    reloaded(admin, "refused", 1.0).await;
    assert_eq!(loaded_sha256(admin).await, serving);
    assert_eq!(post("probe-2", None).await.status, 201);
    assert_eq!((a.executions("probe-2"), b.executions("probe-2")), (0, 1));
    storm.run_for(150).await;

    // Reload 2: back to A, retention 20 minutes.
    let mut to_a = config.clone();
    to_a.retention = "20m".into();
    proxy.rewrite(&to_a);
    proxy.signal("HUP");
    reloaded(admin, "ok", 2.0).await;
    assert_eq!(post("probe-3", None).await.status, 201);
    assert_eq!((a.executions("probe-3"), b.executions("probe-3")), (1, 0));
    assert!(ttl_ms(admin, "probe-3").await <= 20 * 60 * 1000);
    assert_eq!(loaded_sha256(admin).await, file_sha256(proxy.config_path()));
    let total = storm.run_for(150).await;
    let failures = storm.stop().await;

    assert!(failures.is_empty(), "{} failed requests: {failures:#?}", failures.len());
    let keys: BTreeSet<String> = a.log().into_iter().chain(b.log()).map(|run| run.key).collect();
    let storm_keys: Vec<&String> = keys.iter().filter(|key| key.starts_with("storm-")).collect();
    assert!(
        storm_keys.len() >= total,
        "{} keys ran, {total} finished",
        storm_keys.len()
    );
    for key in &storm_keys {
        assert_eq!(a.executions(key) + b.executions(key), 1, "{key} ran more than once");
    }
    let on_b = storm_keys.iter().filter(|key| b.executions(key) == 1).count();
    assert!(on_b > 0, "B got none of the storm after the reload at {at_reload} keys");
    eprintln!(
        "reload storm: {} keys ({} on B), {} requests, 0 failed, 0 duplicates",
        storm_keys.len(),
        on_b,
        storm_keys.len() * 3
    );
}

/// Whether a TLS handshake with `addr` succeeds for a client trusting only `pki`.
async fn handshake(addr: SocketAddr, pki: &support::pki::Pki) -> bool {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    pki.connector(&["http/1.1"], None)
        .connect(support::pki::localhost(), stream)
        .await
        .is_ok()
}

/// Renewed files under the same names, as a certificate manager writes them: a reload
/// with an unchanged config file serves the new certificate on new connections, and
/// the admin listener takes the new token.
#[tokio::test]
async fn reload_picks_up_a_renewed_certificate_and_a_rotated_admin_token() {
    let upstream = Upstream::start().await;
    let (old_ca, new_ca) = (support::pki::Pki::new("old CA"), support::pki::Pki::new("new CA"));
    let dir = tempfile::tempdir().expect("temp dir");
    let (cert, key, token) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("token"),
    );
    let install = |issued: &support::pki::Issued| {
        std::fs::copy(&issued.cert_file, &cert).expect("copy the certificate");
        std::fs::copy(&issued.key_file, &key).expect("copy the key");
    };
    install(&old_ca.server());
    std::fs::write(&token, TOKEN).expect("write the token");
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = format!(
        "[server.tls]\ncert_file = {:?}\nkey_file = {:?}",
        cert.display().to_string(),
        key.display().to_string()
    );
    config.admin_extra = format!("token_file = {:?}", token.display().to_string());
    let proxy = ChildProxy::start(&config).await;
    let records = |token: &'static str| async move {
        let bearer = format!("Bearer {token}");
        send(
            proxy.admin,
            "GET",
            "/records/payments?key=k",
            &[("authorization", &bearer)],
            "",
        )
        .await
        .status
        .as_u16()
    };
    assert!(handshake(proxy.addr, &old_ca).await);
    assert!(!handshake(proxy.addr, &new_ca).await);
    assert_eq!(records(TOKEN).await, 404, "the token is accepted: no such record");

    install(&new_ca.server());
    const ROTATED: &str = "a-rotated-admin-token-0123456789";
    std::fs::write(&token, ROTATED).expect("rotate the token");
    // Nothing happens until the reload.
    assert!(handshake(proxy.addr, &old_ca).await);
    proxy.signal("HUP");
    reloaded(proxy.admin, "ok", 1.0).await;
    assert!(handshake(proxy.addr, &new_ca).await);
    assert!(!handshake(proxy.addr, &old_ca).await);
    assert_eq!(records(TOKEN).await, 401);
    assert_eq!(records(ROTATED).await, 404);
}

/// Every worker serves a reloaded config, and a reload that changes the store is
/// refused. Two workers, each with its own socket on the port, so that the kernel
/// spreads new connections over both: after a reload that moves the payments route
/// from A to B, 64 requests on 64 new connections all reach B (had one worker kept
/// the old routes, about half would reach A). Then a file that also names another
/// Redis is refused, said so in the log, and changes nothing: the requests after it
/// still reach B and their records are in the first Redis, none in the second.
#[tokio::test]
async fn a_reload_reaches_every_worker_and_one_that_changes_the_store_is_refused() {
    let (redis, other) = (RedisServer::start(), RedisServer::start());
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("proxy.log");
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &a.url());
    config.server = "workers = 2".into();
    let proxy = ChildProxy::start_logged(&config, &log, &[]).await;
    let (addr, admin) = (proxy.addr, proxy.admin);
    let post = |key: String| async move {
        send(addr, "POST", "/v1/payments", &[("idempotency-key", key.as_str())], "{}").await
    };
    for index in 0..8 {
        assert_eq!(post(format!("before-{index}")).await.status, 201);
    }
    assert_eq!(a.total(), 8);

    let mut to_b = config.clone();
    to_b.upstream = b.url();
    proxy.rewrite(&to_b);
    proxy.signal("HUP");
    reloaded(admin, "ok", 1.0).await;
    for index in 0..64 {
        let answer = post(format!("after-{index}")).await;
        assert_eq!((answer.status.as_u16(), answer.replayed()), (201, false));
    }
    assert_eq!(
        (a.total(), b.total()),
        (8, 64),
        "every worker serves the reloaded routes"
    );

    let serving = loaded_sha256(admin).await;
    let mut moved = to_b.clone();
    moved.store = StoreKind::Redis(other.url());
    moved.upstream = a.url();
    proxy.rewrite(&moved);
    proxy.signal("HUP");
    reloaded(admin, "refused", 1.0).await;
    assert_eq!(loaded_sha256(admin).await, serving, "the refused file is not serving");
    // Logged just after it is counted.
    support::topology::until("the log says why", std::time::Duration::from_secs(10), || {
        std::fs::read_to_string(&log)
            .expect("the proxy's log")
            .contains("store cannot change without a restart")
    });
    for index in 0..16 {
        assert_eq!(post(format!("refused-{index}")).await.status, 201);
    }
    assert_eq!((a.total(), b.total()), (8, 80), "the refused file changed no route");
    let records = |server: &RedisServer| {
        server
            .keys()
            .into_iter()
            .filter(|key| key.starts_with("idemproxy:payments:"))
            .count()
    };
    assert_eq!((records(&redis), records(&other)), (88, 0), "the store did not change");
}
