//! Operating the proxy (DESIGN §8): the access log, read back line by line from the
//! binary's own output in both log formats, and reload on SIGHUP under load.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;
use support::client::until_metric;
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::sync::watch;

/// Marks in every raw key, query and header value the test sends: none may appear in
/// the access log.
const SECRETS: [&str; 3] = ["RAWKEY", "QUERYSECRET", "HEADERSECRET"];
const TOKEN: &str = "s3cret-admin-token-for-tests";

/// One access-log line, whatever the format it was written in.
#[derive(Debug)]
struct Access {
    route: String,
    method: String,
    status: u16,
    outcome: String,
    duration_ms: f64,
    upstream_ms: Option<f64>,
    record: Option<String>,
    bytes: u64,
    complete: bool,
    /// The line as written, for the secrets check and messages.
    raw: String,
}

/// The fields of one access line in the text format: `name=value` pairs after the
/// target, string values quoted.
fn parse_text(line: &str) -> Option<Access> {
    let (head, fields) = line.split_once("idemproxy::access: access ")?;
    assert!(head.contains("INFO"), "{line}");
    let timestamp = head.split_whitespace().next()?;
    assert!(
        timestamp.ends_with('Z') && timestamp.contains('T'),
        "an RFC 3339 time: {line}"
    );
    let fields: BTreeMap<&str, &str> = fields
        .split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .map(|(name, value)| (name, value.trim_matches('"')))
        .collect();
    let field = |name: &str| fields.get(name).map(|value| value.to_string());
    Some(Access {
        route: field("route")?,
        method: field("method")?,
        status: field("status")?.parse().ok()?,
        outcome: field("outcome")?,
        duration_ms: field("duration_ms")?.parse().ok()?,
        upstream_ms: field("upstream_ms").and_then(|value| value.parse().ok()),
        record: field("record"),
        bytes: field("bytes")?.parse().ok()?,
        complete: field("complete")?.parse().ok()?,
        raw: line.to_string(),
    })
}

/// The fields of one access line in the JSON format.
fn parse_json(line: &str) -> Option<Access> {
    let value: Value = serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}"));
    if value["target"] != "idemproxy::access" {
        return None;
    }
    assert_eq!(value["level"], "INFO", "{line}");
    assert!(
        value["timestamp"].as_str().is_some_and(|time| time.ends_with('Z')),
        "{line}"
    );
    let fields = &value["fields"];
    assert_eq!(fields["message"], "access", "{line}");
    let text = |name: &str| fields[name].as_str().map(str::to_string);
    Some(Access {
        route: text("route")?,
        method: text("method")?,
        status: u16::try_from(fields["status"].as_u64()?).ok()?,
        outcome: text("outcome")?,
        duration_ms: fields["duration_ms"].as_f64()?,
        upstream_ms: fields["upstream_ms"].as_f64(),
        record: text("record"),
        bytes: fields["bytes"].as_u64()?,
        complete: fields["complete"].as_bool()?,
        raw: line.to_string(),
    })
}

/// The access lines in the log at `path`, waiting (bounded) until there are `count`:
/// a line is written when its response body has been sent, just after the client has
/// read it.
async fn access_lines(path: &Path, count: usize, parse: fn(&str) -> Option<Access>) -> Vec<Access> {
    let started = tokio::time::Instant::now();
    loop {
        let log = std::fs::read_to_string(path).expect("read the proxy's log");
        let lines: Vec<Access> = log.lines().filter_map(parse).collect();
        if lines.len() >= count {
            assert_eq!(lines.len(), count, "one line per request:\n{log}");
            return lines;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{} access lines, not {count}:\n{log}",
            lines.len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// What the test expects of one line.
struct Expected<'a> {
    route: &'a str,
    method: &'a str,
    response: &'a TestResponse,
    outcome: &'a str,
    upstream: bool,
    record: Option<&'a str>,
}

/// A scripted mix of requests through a proxy with `access_log = true`, started with
/// `args`; every line is then checked field by field against what its client saw.
async fn access_log(args: &[&str], parse: fn(&str) -> Option<Access>) {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).expect("write the token");
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = "access_log = true".into();
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    let log = dir.path().join("proxy.log");
    let proxy = ChildProxy::start_logged(&config, &log, args).await;
    let addr = proxy.addr;
    let auth = ("authorization", "Bearer HEADERSECRET");
    let post = |key: &'static str, body: &'static str, extra: Option<(&'static str, &'static str)>| async move {
        let mut headers = vec![("idempotency-key", key), auth];
        headers.extend(extra);
        send(addr, "POST", "/v1/payments", &headers, body).await
    };

    let fresh = post("RAWKEY-1", "{\"amount\":1}", None).await;
    let replay = post("RAWKEY-1", "{\"amount\":1}", None).await;
    let mismatch = post("RAWKEY-1", "{\"amount\":2}", None).await;
    let no_key = send(addr, "POST", "/v1/payments", &[auth], "{}").await;
    let read = send(addr, "GET", "/v1/reads/item?token=QUERYSECRET", &[auth], "").await;
    let nowhere = send(addr, "GET", "/elsewhere?token=QUERYSECRET", &[auth], "").await;
    let held = tokio::spawn(post("RAWKEY-2", "{}", Some(("x-test-hold", "held"))));
    upstream.wait_for_key("RAWKEY-2").await;
    let conflict = post("RAWKEY-2", "{}", None).await;
    upstream.release("held");
    let held = held.await.expect("the held request");
    let statuses = [&fresh, &replay, &mismatch, &no_key, &read, &nowhere, &conflict, &held].map(|r| r.status.as_u16());
    assert_eq!(statuses, [201, 201, 422, 400, 201, 404, 409, 201]);

    // The record each guarded line names is the one the records API names.
    let record = |key: &str| {
        let path = format!("/records/payments?key={key}");
        async move {
            let bearer = format!("Bearer {TOKEN}");
            let shown = send(proxy.admin, "GET", &path, &[("authorization", &bearer)], "").await;
            let body: Value = serde_json::from_slice(&shown.body).expect("the records API answers JSON");
            body["record"].as_str().expect("a record hash").to_string()
        }
    };
    let (first, second) = (record("RAWKEY-1").await, record("RAWKEY-2").await);
    let guarded = |response, outcome, upstream, record| Expected {
        route: "payments",
        method: "POST",
        response,
        outcome,
        upstream,
        record,
    };
    let expected = [
        guarded(&fresh, "forwarded", true, Some(first.as_str())),
        guarded(&replay, "replayed", false, Some(first.as_str())),
        guarded(&mismatch, "mismatch", false, Some(first.as_str())),
        guarded(&no_key, "rejected", false, None),
        Expected {
            route: "reads",
            method: "GET",
            response: &read,
            outcome: "forwarded",
            upstream: true,
            record: None,
        },
        Expected {
            route: "-",
            method: "GET",
            response: &nowhere,
            outcome: "rejected",
            upstream: false,
            record: None,
        },
        guarded(&conflict, "conflict", false, Some(second.as_str())),
        guarded(&held, "forwarded", true, Some(second.as_str())),
    ];

    let lines = access_lines(&log, expected.len(), parse).await;
    for (line, expected) in lines.iter().zip(&expected) {
        let what = &line.raw;
        assert_eq!(line.route, expected.route, "{what}");
        assert_eq!(line.method, expected.method, "{what}");
        assert_eq!(line.status, expected.response.status.as_u16(), "{what}");
        assert_eq!(line.outcome, expected.outcome, "{what}");
        assert_eq!(line.bytes, expected.response.body.len() as u64, "{what}");
        assert!(line.complete, "{what}");
        assert_eq!(line.record.as_deref(), expected.record, "{what}");
        assert_eq!(line.upstream_ms.is_some(), expected.upstream, "{what}");
        let upstream_ms = line.upstream_ms.unwrap_or(0.0);
        assert!(
            upstream_ms >= 0.0 && line.duration_ms >= upstream_ms,
            "the upstream's time is part of the request's: {what}"
        );
        for secret in SECRETS {
            assert!(!what.contains(secret), "{secret} in the access log: {what}");
        }
    }
    // Nor anywhere else in the log.
    let log = std::fs::read_to_string(&log).expect("read the proxy's log");
    for secret in SECRETS {
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
}

#[tokio::test]
async fn the_access_log_writes_one_text_line_per_request_without_raw_keys_or_values() {
    access_log(&[], parse_text).await;
}

#[tokio::test]
async fn the_access_log_writes_one_json_line_per_request_without_raw_keys_or_values() {
    access_log(&["--log-format", "json"], parse_json).await;
}

#[tokio::test]
async fn the_access_log_is_off_unless_configured() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("proxy.log");
    let config = TestConfig::new(StoreKind::Memory, &upstream.url());
    let proxy = ChildProxy::start_logged(&config, &log, &[]).await;
    let answer = send(proxy.addr, "GET", "/v1/reads/item", &[], "").await;
    assert_eq!(answer.status, 201);
    // A later line proves the log has been written past the request: the proxy logs
    // its shutdown on SIGTERM.
    proxy.signal("TERM");
    let mut proxy = proxy;
    proxy.child.wait().expect("the proxy exits on SIGTERM");
    let log = std::fs::read_to_string(&log).expect("read the proxy's log");
    assert!(log.contains("stopped"), "the shutdown is logged:\n{log}");
    assert!(!log.contains("idemproxy::access"), "no access line:\n{log}");
}

// === reload ===

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
