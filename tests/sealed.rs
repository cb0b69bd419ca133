//! Records that keep no secrets (docs/design.md §20), through the binary against a real
//! `redis-server` and a real SQLite file: with `[store.encryption]` nothing of a
//! response is readable in the store while every replay gets it back; rotation; a
//! record whose key was dropped, or whose bytes were altered, is never run again; the
//! `status` and `refetch` replay modes; the records API's metadata and `body=true`.
//! Each property is shown against a control (the same run without the key, or with the
//! stored mode) so that the check itself can fail.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::path::Path;

use base64::Engine as _;
use serde_json::Value;
use support::client::metric;
use support::upstream::Lookups;
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};

/// In the response's body (the upstream echoes the key) and in one of its fields.
const MARKER: &str = "SECRET-7f3a9c";
const KEY_VAR: &str = "IDEMPROXY_RECORD_KEY";
const OLD_VAR: &str = "IDEMPROXY_RECORD_KEYS_OLD";
const TOKEN: &str = "s3cret-admin-token-for-tests";

fn record_key(byte: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([byte; 32])
}

fn key_id(byte: u8) -> String {
    idemproxy::config::RecordKey::from_bytes([byte; 32]).id().to_string()
}

/// `config` sealing with `current`, opening `previous` too.
fn sealed(mut config: TestConfig, current: u8, previous: &[u8]) -> TestConfig {
    config.store_extra.push_str(&format!(
        "\n[store.encryption]\nkey_env = \"{KEY_VAR}\"\nprevious_keys_env = \"{OLD_VAR}\"\n"
    ));
    let old: Vec<String> = previous.iter().map(|byte| record_key(*byte)).collect();
    config.env = vec![(KEY_VAR.into(), record_key(current)), (OLD_VAR.into(), old.join(","))];
    config
}

/// The records API on, with its token in a file that lives as long as the directory.
fn with_records_api(mut config: TestConfig) -> (TestConfig, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    (config, dir)
}

async fn pay(proxy: &ChildProxy, key: &str, extra: &[(&str, &str)]) -> TestResponse {
    let mut headers = vec![
        ("idempotency-key", key),
        ("content-type", "application/json"),
        ("x-test-response-header", "x-card-token: SECRET-7f3a9c-card"),
    ];
    headers.extend_from_slice(extra);
    send(proxy.addr, "POST", "/v1/payments", &headers, "{\"amount\":100}").await
}

/// What the SQLite store's file and its write-ahead log hold.
fn file_bytes(file: &Path) -> Vec<u8> {
    let mut all = std::fs::read(file).expect("read the store file");
    all.extend(std::fs::read(file.with_extension("db-wal")).unwrap_or_default());
    all
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle.as_bytes())
}

/// Every value Redis holds, each read by `GET` (a string) or `DUMP` (anything else),
/// over a `SCAN` of the whole keyspace.
fn every_redis_value(redis: &RedisServer) -> Vec<Vec<u8>> {
    let mut connection = redis.connection();
    let mut cursor = 0u64;
    let mut values = Vec::new();
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query(&mut connection)
            .expect("SCAN");
        for key in keys {
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut connection).expect("TYPE");
            let value: Option<Vec<u8>> = match kind.as_str() {
                "string" => redis::cmd("GET").arg(&key).query(&mut connection).expect("GET"),
                _ => redis::cmd("DUMP").arg(&key).query(&mut connection).expect("DUMP"),
            };
            values.push([key, value.unwrap_or_default()].concat());
        }
        cursor = next;
        if cursor == 0 {
            return values;
        }
    }
}

/// A proxy on a redis-server of its own, sealing with key 1 if `encrypted`.
async fn on_redis(encrypted: bool) -> (RedisServer, Upstream, ChildProxy) {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let plain = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    let config = if encrypted { sealed(plain, 1, &[]) } else { plain };
    let proxy = ChildProxy::start(&config).await;
    (redis, upstream, proxy)
}

fn assert_replays(first: &TestResponse, retry: &TestResponse) {
    assert_eq!(retry.status, first.status, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body, "replayed byte for byte");
    assert_eq!(retry.header("x-card-token"), Some("SECRET-7f3a9c-card"));
}

/// With a key, no value in Redis holds the marker the response carries (body and
/// field), and the replay has it; without one (the control), Redis holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_a_response_is_readable_in_redis_and_every_replay_gets_it() {
    for encrypted in [false, true] {
        let (redis, upstream, proxy) = on_redis(encrypted).await;
        let key = format!("{MARKER}-order-1");
        let first = pay(&proxy, &key, &[]).await;
        assert_eq!(first.status, 201, "{first:?}");
        assert!(contains(&first.body, MARKER), "the upstream echoes the key: {first:?}");
        let retry = pay(&proxy, &key, &[]).await;
        assert_replays(&first, &retry);
        assert!(contains(&retry.body, MARKER), "{retry:?}");
        assert_eq!(upstream.executions(&key), 1);
        let values = every_redis_value(&redis);
        assert!(!values.is_empty(), "the record is in Redis");
        let found = values
            .iter()
            .any(|value| contains(value, MARKER) || contains(value, "x-card-token"));
        assert_eq!(found, !encrypted, "encrypted {encrypted}: the marker in a Redis value");
        // The same request with another body is still refused: the HMAC fingerprint
        // tells requests apart as the digest did.
        let reused = send(
            proxy.addr,
            "POST",
            "/v1/payments",
            &[("idempotency-key", &key), ("content-type", "application/json")],
            "{\"amount\":999}",
        )
        .await;
        assert_eq!(
            (reused.status.as_u16(), reused.problem()),
            (422, "idempotency-key-reused".into())
        );
    }
}

/// The SQLite file (and its write-ahead log) holds nothing of a sealed response,
/// across a restart the replay still has it; the control file holds the marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_a_response_is_readable_in_the_sqlite_file() {
    for encrypted in [false, true] {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("records.db");
        let upstream = Upstream::start().await;
        let mut plain = TestConfig::new(StoreKind::Sqlite(file.clone()), &upstream.url());
        plain.store_timeout = "2s".into();
        let config = if encrypted { sealed(plain, 1, &[]) } else { plain };
        let mut proxy = ChildProxy::start(&config).await;
        let key = format!("{MARKER}-order-2");
        let first = pay(&proxy, &key, &[]).await;
        assert_eq!(first.status, 201, "{first:?}");
        let found = contains(&file_bytes(&file), MARKER) || contains(&file_bytes(&file), "x-card-token");
        assert_eq!(found, !encrypted, "encrypted {encrypted}: the marker in the file");
        proxy.signal("TERM");
        proxy.child.wait().expect("wait for the proxy");
        let found = contains(&file_bytes(&file), MARKER);
        assert_eq!(
            found, !encrypted,
            "encrypted {encrypted}: the marker in the checkpointed file"
        );
        let proxy = ChildProxy::start(&config).await;
        let retry = pay(&proxy, &key, &[]).await;
        assert_replays(&first, &retry);
        assert_eq!(upstream.executions(&key), 1);
    }
}

/// A record sealed under key 1 replays after the key rotates to 2 with 1 listed as
/// previous (and the records API names the key that seals each record); once key 1 is
/// dropped, its record is never run again: 409 `outcome-unknown` with reason
/// `unreadable`, counted and logged at error naming the record by its hash, while a
/// record under key 2 still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_keeps_old_records_and_a_dropped_key_makes_them_unreadable_never_run_again() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let (plain, _token) = with_records_api(TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url()));
    let old = ChildProxy::start(&sealed(plain.clone(), 1, &[])).await;
    let first = pay(&old, "order-old", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    drop(old);

    let rotated = ChildProxy::start(&sealed(plain.clone(), 2, &[1])).await;
    assert_replays(&first, &pay(&rotated, "order-old", &[]).await);
    let second = pay(&rotated, "order-new", &[]).await;
    assert_eq!(second.status, 201);
    for (key, sealer) in [("order-old", 1), ("order-new", 2)] {
        let view = show(&rotated, key, false).await;
        assert_eq!(view["sealed_by"], Value::String(key_id(sealer)), "{view}");
    }
    drop(rotated);

    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("proxy.log");
    let dropped = ChildProxy::start_logged(&sealed(plain, 2, &[]), &log, &[]).await;
    for _ in 0..2 {
        let retry = pay(&dropped, "order-old", &[]).await;
        assert_unreadable(&retry);
    }
    assert_eq!(upstream.executions("order-old"), 1, "never run again");
    assert_replays(&second, &pay(&dropped, "order-new", &[]).await);
    assert_eq!(
        metric(dropped.admin, "idemproxy_records_unreadable_total").await,
        Some(2.0)
    );
    let view = show(&dropped, "order-old", false).await;
    assert_eq!(view["sealed_by"], Value::String(key_id(1)), "{view}");
    let why = view["unreadable"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("not configured"), "{view}");
    let text = std::fs::read_to_string(&log).expect("read the log");
    let line = text
        .lines()
        .find(|line| line.contains("cannot be opened"))
        .unwrap_or_else(|| panic!("no log line: {text}"));
    assert!(line.contains("ERROR"), "{line}");
    let hash = view["record"].as_str().expect("a record hash");
    assert!(line.contains(hash), "{line}");
    assert!(
        !text.contains("order-old") && !text.contains(&record_key(2)),
        "a key in the log: {text}"
    );
}

fn assert_unreadable(retry: &TestResponse) {
    assert_eq!(
        (retry.status.as_u16(), retry.problem()),
        (409, "outcome-unknown".into()),
        "{retry:?}"
    );
    let body: Value = serde_json::from_slice(&retry.body).expect("JSON");
    assert_eq!(body["reason"], "unreadable", "{body}");
    assert_eq!(body["reconciling"], false, "{body}");
    assert!(!contains(&retry.body, MARKER));
}

/// A sealed record with one byte flipped in Redis (its tag, the value's last byte)
/// does not open: 409 `unreadable`, and the operation ran once. The same flip on a
/// record kept in clear is replayed altered (the control: nothing checks it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_altered_in_the_store_is_unreadable_and_never_run_again() {
    for encrypted in [false, true] {
        let (redis, upstream, proxy) = on_redis(encrypted).await;
        let first = pay(&proxy, "order-flip", &[]).await;
        assert_eq!(first.status, 201, "{first:?}");
        let mut connection = redis.connection();
        let keys = redis.keys();
        let record = keys.iter().find(|key| key.contains(":payments:")).expect("the record");
        let mut value: Vec<u8> = redis::cmd("GET").arg(record).query(&mut connection).expect("GET");
        let last = value.len() - 1;
        value[last] ^= 0x01;
        let () = redis::cmd("SET")
            .arg(record)
            .arg(&value)
            .arg("KEEPTTL")
            .query(&mut connection)
            .expect("SET");
        let retry = pay(&proxy, "order-flip", &[]).await;
        if encrypted {
            assert_unreadable(&retry);
        } else {
            assert!(retry.replayed(), "{retry:?}");
            assert_ne!(retry.body, first.body, "the control replays what was altered");
        }
        assert_eq!(upstream.executions("order-flip"), 1);
    }
}

/// `replay = "status"`: the first client gets the whole response; a retry gets the
/// status and `location`, with an empty body; the store keeps no body, even in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_replays_keep_no_body() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.idempotency = "replay = \"status\"".into();
    let proxy = ChildProxy::start(&config).await;
    let location = ("x-test-response-header", "location: /v1/payments/p-77");
    let first = pay(&proxy, "order-status", &[location]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(contains(&first.body, "order-status"), "{first:?}");
    let retry = pay(&proxy, "order-status", &[location]).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert!(retry.body.is_empty(), "{retry:?}");
    assert_eq!(retry.header("location"), Some("/v1/payments/p-77"));
    assert_eq!(retry.header("x-card-token"), None, "only replay_headers are kept");
    assert_eq!(retry.header("content-length"), Some("0"));
    assert_eq!(upstream.executions("order-status"), 1);
    let values = every_redis_value(&redis);
    assert!(!values.is_empty());
    assert!(
        !values
            .iter()
            .any(|value| contains(value, "execution") || contains(value, "SECRET")),
        "a body or a field in the store"
    );
}

fn refetch_config(redis: &RedisServer, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url());
    config.idempotency =
        "replay = \"refetch\"\nrefetch = { path = \"/v1/payments/by-key/{key}\", timeout = \"2s\" }".into();
    config
}

/// `replay = "refetch"`: a retry is answered by the upstream's lookup, asked with the
/// retrying client's own `Authorization` (not the first's) and no body, marked as
/// replayed; the operation runs once. A 401 from the lookup is the client's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refetch_replays_ask_the_upstream_with_the_retrys_credentials() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&refetch_config(&redis, &upstream)).await;
    let first = pay(&proxy, "order-refetch", &[("authorization", "Bearer first-client")]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(upstream.lookups().is_empty(), "the first request is not refetched");
    let retry = pay(&proxy, "order-refetch", &[("authorization", "Bearer second-client")]).await;
    assert_eq!(retry.status, 200, "the lookup's own answer: {retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(
        retry.header("x-execution-id"),
        first.header("x-execution-id"),
        "the same operation"
    );
    let body: Value = serde_json::from_slice(&retry.body).expect("JSON");
    assert_eq!(body["found"], true, "{body}");
    assert_eq!(upstream.executions("order-refetch"), 1);
    let lookups = upstream.lookups();
    assert_eq!(lookups.len(), 1, "{lookups:?}");
    let lookup = &lookups[0];
    assert_eq!(
        (lookup.method.as_str(), lookup.path.as_str()),
        ("GET", "/v1/payments/by-key/order-refetch")
    );
    assert_eq!(
        lookup
            .headers
            .get("authorization")
            .and_then(|value| value.to_str().ok()),
        Some("Bearer second-client")
    );
    assert_eq!(lookup.body_bytes, 0);
    assert!(lookup.headers.get("content-length").is_none_or(|length| length == "0"));
    // The store keeps no body of the first answer.
    assert!(
        !every_redis_value(&redis)
            .iter()
            .any(|value| contains(value, "execution"))
    );

    upstream.set_lookups(Lookups::Fail(401));
    let refused = pay(&proxy, "order-refetch", &[("authorization", "Bearer revoked")]).await;
    assert_eq!(refused.status, 401, "the client's answer: {refused:?}");
    assert!(refused.replayed());
    assert_eq!(upstream.executions("order-refetch"), 1);
}

/// A refetch that fails (a 5xx, or no upstream at all) answers 503
/// `replay-unavailable` with `Retry-After`, and never runs the operation again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_refetch_is_503_never_a_second_run() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut config = refetch_config(&redis, &upstream);
    config.idempotency = config.idempotency.replace("timeout = \"2s\"", "timeout = \"200ms\"");
    let proxy = ChildProxy::start(&config).await;
    let first = pay(&proxy, "order-down", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    upstream.set_lookups(Lookups::Fail(503));
    let failed = pay(&proxy, "order-down", &[]).await;
    assert_eq!(
        (failed.status.as_u16(), failed.problem()),
        (503, "replay-unavailable".into()),
        "{failed:?}"
    );
    assert_eq!(failed.header("retry-after"), Some("1"));
    // A lookup held past the refetch's timeout (200 ms): 503, the same way.
    upstream.set_lookups(Lookups::Hold("never".into()));
    let slow = pay(&proxy, "order-down", &[]).await;
    assert_eq!(
        (slow.status.as_u16(), slow.problem()),
        (503, "replay-unavailable".into()),
        "{slow:?}"
    );
    upstream.stop();
    let refused = pay(&proxy, "order-down", &[]).await;
    assert_eq!(
        (refused.status.as_u16(), refused.problem()),
        (503, "replay-unavailable".into())
    );
    assert_eq!(upstream.executions("order-down"), 1, "never run again");
}

async fn show(proxy: &ChildProxy, key: &str, body: bool) -> Value {
    let path = format!("/records/payments?key={key}{}", if body { "&body=true" } else { "" });
    let bearer = format!("Bearer {TOKEN}");
    let answer = send(proxy.admin, "GET", &path, &[("authorization", &bearer)], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    serde_json::from_slice(&answer.body).expect("JSON")
}

/// The records API shows metadata and the key that seals a record, never its body,
/// unless asked with `body=true`: then the response, opened. The CLI's `--body` says
/// the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_api_shows_metadata_and_the_body_only_when_asked() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let (plain, _token) = with_records_api(TestConfig::new(StoreKind::Redis(redis.url()), &upstream.url()));
    let config = sealed(plain, 1, &[]);
    let proxy = ChildProxy::start(&config).await;
    let first = pay(&proxy, "order-shown", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let view = show(&proxy, "order-shown", false).await;
    assert_eq!(view["state"], "completed", "{view}");
    assert_eq!(view["sealed_by"], Value::String(key_id(1)), "{view}");
    assert_eq!(view["response"], Value::Null, "no body unless asked: {view}");
    assert_eq!(
        view["response_bytes"].as_u64(),
        Some(first.body.len() as u64),
        "the opened size"
    );
    assert!(!view.to_string().contains("SECRET"), "{view}");
    let full = show(&proxy, "order-shown", true).await;
    let response = &full["response"];
    assert_eq!(response["status"], 201, "{full}");
    let body = base64::engine::general_purpose::STANDARD
        .decode(response["body"].as_str().expect("base64"))
        .expect("base64");
    assert_eq!(body, first.body.to_vec());
    assert!(response["headers"].to_string().contains("SECRET-7f3a9c-card"), "{full}");

    // The CLI, against the same admin listener.
    let file = config.write_temp();
    let config_text = std::fs::read_to_string(file.path())
        .expect("read")
        .replace("127.0.0.1:0", &proxy.admin.to_string());
    std::fs::write(file.path(), config_text).expect("write");
    let cli = |extra: &[&str]| {
        let output = support::proxy::binary_command(&[])
            .args([
                "records",
                "show",
                "--route",
                "payments",
                "--key",
                "order-shown",
                "--config",
            ])
            .arg(file.path())
            .args(extra)
            .envs(config.env.iter().map(|(name, value)| (name, value)))
            .output()
            .expect("run idemproxy records");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let brief = cli(&[]);
    assert!(brief.contains(&format!("sealed by    key {}", key_id(1))), "{brief}");
    assert!(!brief.contains("body (base64)"), "{brief}");
    let shown = cli(&["--body"]);
    assert!(shown.contains("x-card-token: SECRET-7f3a9c-card"), "{shown}");
    assert!(shown.contains("body (base64)"), "{shown}");
}

/// Issue 49 L7: a sealed SQLite file kept clients' keys in clear in `probe_key` on
/// routes whose probe names `{key}`. Sealed, the file (and its log) holds nothing of
/// the key while the record is in flight, and a fresh start, with no client retrying,
/// still probes the upstream by the key, opened. The control (no key) holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_sqlite_file_keeps_no_clients_key_for_its_probe() {
    for encrypted in [false, true] {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("records.db");
        let upstream = Upstream::start().await;
        let mut plain = TestConfig::new(StoreKind::Sqlite(file.clone()), &upstream.url());
        plain.store_timeout = "2s".into();
        plain.upstream_timeout = "1s".into();
        plain.idempotency = "[route.idempotency.reconcile]\npath = \"/v1/payments/by-key/{key}\"\n\
                             first_after = \"100ms\"\nevery = \"200ms\"\ngive_up_after = \"1m\""
            .into();
        let config = if encrypted { sealed(plain, 1, &[]) } else { plain };
        let mut proxy = ChildProxy::start(&config).await;
        let key = format!("{MARKER}-probed");
        let addr = proxy.addr;
        let sent = key.clone();
        let held = tokio::spawn(async move {
            let headers = [("idempotency-key", sent.as_str()), ("x-test-hold", "probed")];
            support::client::try_send(addr, "POST", "/v1/payments", &headers, "{}").await
        });
        upstream.wait_for_key(&key).await;
        proxy.kill();
        let _ = held.await;
        assert_eq!(
            contains(&file_bytes(&file), MARKER),
            !encrypted,
            "encrypted {encrypted}: the client's key in the file"
        );
        upstream.release("probed");
        let _proxy = ChildProxy::start(&config).await;
        upstream.wait_for_lookups(1).await;
        assert_eq!(
            upstream.lookups()[0].path,
            format!("/v1/payments/by-key/{key}"),
            "encrypted {encrypted}: the probe asks by the key, opened"
        );
    }
}

/// Issue 49 (a second catcher, through the binary, for a sealed value bound to its
/// record): two records with the same request's fingerprint, the first's sealed value
/// copied over the second's in Redis (its tag and fingerprint intact). The second's
/// retry is unreadable, 409, never the first's response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_value_moved_to_another_record_does_not_open() {
    let (redis, upstream, proxy) = on_redis(true).await;
    let first = pay(&proxy, "order-moved-a", &[]).await;
    let second = pay(&proxy, "order-moved-b", &[]).await;
    assert_eq!((first.status.as_u16(), second.status.as_u16()), (201, 201));
    let mut connection = redis.connection();
    let records: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|key| key.contains(":payments:"))
        .collect();
    assert_eq!(records.len(), 2, "{records:?}");
    let values: Vec<Vec<u8>> = records
        .iter()
        .map(|key| redis::cmd("GET").arg(key).query(&mut connection).expect("GET"))
        .collect();
    // Each record over the other: whichever is order-moved-b's now holds a's value.
    for (key, value) in records.iter().zip(values.iter().rev()) {
        let () = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .arg("KEEPTTL")
            .query(&mut connection)
            .expect("SET");
    }
    for key in ["order-moved-a", "order-moved-b"] {
        assert_unreadable(&pay(&proxy, key, &[]).await);
        assert_eq!(upstream.executions(key), 1);
    }
}
