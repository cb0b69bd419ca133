//! Keys for clients that cannot send a header (docs/design.md §23): `route.idempotency.key`
//! takes the key from a header, a JSON value (one pointer, or several as one key), a
//! form field or the query, the first source present winning; `body` makes the request
//! itself the key for `dedup_window`. Real sockets, the fake upstream, the memory store
//! and a real `redis-server`.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;

use support::client::metric;
use support::{RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};

const ALL: &str =
    r#"key = ["header:Idempotency-Key", "json:/client_reference", "form:request_id", "query:request_id"]"#;
const FORM: (&str, &str) = ("content-type", "application/x-www-form-urlencoded");
const JSON: (&str, &str) = ("content-type", "application/json");

fn config(store: StoreKind, upstream: &Upstream, lines: &str) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.idempotency = lines.to_string();
    config
}

async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> TestResponse {
    send(addr, "POST", path, headers, body).await
}

/// One request of [`each_source_guards_and_replays`]: its path, headers, body and the
/// key the upstream should see.
type Case = (&'static str, Vec<(&'static str, &'static str)>, String, &'static str);

/// Each source guards: the first request runs once upstream, carrying its key in the
/// upstream's key field, and its retry (the same key from the same source) is replayed.
async fn each_source_guards_and_replays(store: StoreKind) {
    let upstream = Upstream::start().await;
    let proxy = config(store, &upstream, ALL).start().await;
    let addr = proxy.addr();
    let cases: [Case; 4] = [
        (
            "/v1/payments",
            vec![("idempotency-key", "h-1"), JSON],
            r#"{"amount":5}"#.into(),
            "h-1",
        ),
        (
            "/v1/payments",
            vec![JSON],
            r#"{"client_reference":"r-1","amount":5}"#.into(),
            "r-1",
        ),
        ("/v1/payments", vec![FORM], "amount=5&request_id=f-1".into(), "f-1"),
        (
            "/v1/payments?request_id=q-1",
            vec![JSON],
            r#"{"amount":5}"#.into(),
            "q-1",
        ),
    ];
    for (path, headers, body, key) in &cases {
        let first = post(addr, path, headers, body).await;
        assert_eq!(first.status, 201, "{key}: {first:?}");
        assert!(!first.replayed());
        let retry = post(addr, path, headers, body).await;
        assert_eq!(retry.status, 201, "{key}: {retry:?}");
        assert!(retry.replayed(), "{key}: the retry is replayed: {retry:?}");
        assert_eq!(retry.execution(), first.execution(), "{key}");
        assert_eq!(upstream.executions(key), 1, "{key} ran once upstream, under its key");
    }
    // The body went upstream as it was sent.
    let log = upstream.log();
    assert_eq!(&log[1].body[..], cases[1].2.as_bytes());
    assert_eq!(upstream.total(), 4);
}

#[tokio::test]
async fn each_source_guards_and_replays_on_the_memory_store() {
    each_source_guards_and_replays(StoreKind::Memory).await;
}

#[tokio::test]
async fn each_source_guards_and_replays_on_redis() {
    let redis = RedisServer::start();
    each_source_guards_and_replays(StoreKind::Redis(redis.url())).await;
}

/// The header wins over a field of the body when a request has both; the same
/// reference with another amount is 422, and nothing more runs.
#[tokio::test]
async fn the_header_wins_and_the_same_reference_with_another_amount_is_422() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream, ALL).start().await;
    let addr = proxy.addr();
    let both = post(
        addr,
        "/v1/payments",
        &[("idempotency-key", "from-header"), JSON],
        r#"{"client_reference":"from-body","amount":5}"#,
    )
    .await;
    assert_eq!(both.status, 201, "{both:?}");
    assert_eq!(upstream.executions("from-header"), 1);
    assert_eq!(upstream.executions("from-body"), 0);

    let first = post(
        addr,
        "/v1/payments",
        &[JSON],
        r#"{"client_reference":"r-9","amount":5}"#,
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    // The same value spelled another way is the same request (fingerprint_body = bytes
    // here, so only the exact bytes are): another amount is another request.
    let other = post(
        addr,
        "/v1/payments",
        &[JSON],
        r#"{"client_reference":"r-9","amount":500}"#,
    )
    .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.problem(), "idempotency-key-reused");
    assert_eq!(upstream.executions("r-9"), 1);
}

/// A composite key (`json:/tenant&/order_id`): one order id in two tenants is two
/// operations, the same pair is one, and a body with only one part has no key.
#[tokio::test]
async fn a_composite_key_spans_its_parts_and_needs_them_all() {
    let upstream = Upstream::start().await;
    let lines = r#"key = ["json:/tenant&/order_id"]"#;
    let proxy = config(StoreKind::Memory, &upstream, lines).start().await;
    let addr = proxy.addr();
    let a = r#"{"tenant":"acme","order_id":7,"amount":5}"#;
    let b = r#"{"tenant":"globex","order_id":7,"amount":5}"#;
    let first_a = post(addr, "/v1/payments", &[JSON], a).await;
    let first_b = post(addr, "/v1/payments", &[JSON], b).await;
    assert_eq!((first_a.status.as_u16(), first_b.status.as_u16()), (201, 201));
    assert!(!first_b.replayed(), "another tenant's order 7 is another operation");
    let retry_a = post(addr, "/v1/payments", &[JSON], a).await;
    assert!(retry_a.replayed(), "{retry_a:?}");
    assert_eq!(retry_a.execution(), first_a.execution());
    // The key the upstream is sent: the canonical JSON array of the parts.
    assert_eq!(upstream.executions(r#"["acme",7e0]"#), 1);
    assert_eq!(upstream.executions(r#"["globex",7e0]"#), 1);
    let partial = post(addr, "/v1/payments", &[JSON], r#"{"tenant":"acme","amount":5}"#).await;
    assert_eq!(partial.status, 400, "{partial:?}");
    assert_eq!(partial.problem(), "missing-idempotency-key");
    assert!(String::from_utf8_lossy(&partial.body).contains("json:/tenant&/order_id"));
    assert_eq!(upstream.total(), 2);
}

/// Missing and invalid values are refused before anything runs, naming the source and
/// never the value; a number is a key by its canonical form; a broken body on a
/// json-only route is 400, never forwarded unguarded; a route that does not require a
/// key forwards a request without one as it was sent.
#[tokio::test]
async fn missing_invalid_and_broken_values_are_refused_and_name_their_source() {
    let upstream = Upstream::start().await;
    let mut config = config(StoreKind::Memory, &upstream, r#"key = ["json:/client_reference"]"#);
    config.extra_routes = r#"
[[route]]
name = "optional"
path_prefix = "/v1/optional"
upstream = "UPSTREAM"
[route.idempotency]
required = false
key = ["json:/client_reference", "query:request_id"]
"#
    .replace("UPSTREAM", &upstream.url());
    let proxy = config.start().await;
    let addr = proxy.addr();
    let long = format!(r#"{{"client_reference":"{}"}}"#, "r".repeat(300));
    for (body, problem) in [
        (long.as_str(), "invalid-idempotency-key"),
        (r#"{"client_reference":{"a": "b c"}}"#, "invalid-idempotency-key"),
        (r#"{"client_reference":""}"#, "invalid-idempotency-key"),
        (
            r#"{"client_reference":"a","client_reference":"b"}"#,
            "invalid-idempotency-key",
        ),
        (r#"{"client_reference":"#, "invalid-idempotency-key"),
        ("not json", "invalid-idempotency-key"),
        (r#"{"amount":5}"#, "missing-idempotency-key"),
        (r#"{"client_reference":null}"#, "missing-idempotency-key"),
    ] {
        let refused = post(addr, "/v1/payments", &[JSON], body).await;
        assert_eq!(refused.status, 400, "{body}: {refused:?}");
        assert_eq!(refused.problem(), problem, "{body}");
        let text = String::from_utf8_lossy(&refused.body);
        assert!(
            text.contains("json:/client_reference"),
            "{body}: names the source: {text}"
        );
        assert!(
            !text.contains("rrrr") && !text.contains("b c"),
            "never the value: {text}"
        );
    }
    assert_eq!(upstream.total(), 0, "nothing refused ran");

    // A number is its canonical form: 12345 and 12345.0 are one key.
    let number = post(addr, "/v1/payments", &[JSON], r#"{"client_reference":12345}"#).await;
    assert_eq!(number.status, 201, "{number:?}");
    assert_eq!(upstream.executions("12345e0"), 1);
    let spelled = post(addr, "/v1/payments", &[JSON], r#"{"client_reference":12345.0}"#).await;
    assert_eq!(spelled.status, 422, "the same key, another body: {spelled:?}");

    // Not required: a request with no key is forwarded as sent, a broken body too when
    // another source could have held the key; one with a key is guarded.
    let keyless = post(addr, "/v1/optional", &[JSON], r#"{"amount":1}"#).await;
    assert_eq!(keyless.status, 201, "{keyless:?}");
    assert!(!keyless.replayed());
    let again = post(addr, "/v1/optional", &[JSON], r#"{"amount":1}"#).await;
    assert!(!again.replayed() && again.execution() != keyless.execution());
    let keyed = post(addr, "/v1/optional?request_id=o-1", &[JSON], r#"{"amount":1}"#).await;
    let retry = post(addr, "/v1/optional?request_id=o-1", &[JSON], r#"{"amount":1}"#).await;
    assert!(retry.replayed() && retry.execution() == keyed.execution(), "{retry:?}");
}

/// The record a Redis instance holds for a key, and the milliseconds it has to live.
fn records_ttl(redis: &RedisServer) -> Vec<(String, i64)> {
    let client = redis::Client::open(redis.url()).expect("a client");
    let mut connection = client.get_connection().expect("a connection");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("idemproxy:payments:*")
        .query(&mut connection)
        .expect("KEYS");
    keys.into_iter()
        .map(|key| {
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut connection).expect("PTTL");
            (key, ttl)
        })
        .collect()
}

/// Key-less deduplication (`"body"` with `dedup_window`): a second identical request
/// inside the window replays the first; another body, or another scope, runs; once the
/// window has passed (the record gone from Redis) the same request runs again. A
/// request with a key is keyed by it, for `retention`.
#[tokio::test]
async fn key_less_deduplication_replays_inside_its_window_only() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let lines = "key = [\"header:Idempotency-Key\", \"body\"]\ndedup_window = \"3s\"\nscope_headers = [\"x-tenant\"]";
    let mut config = config(StoreKind::Redis(redis.url()), &upstream, lines);
    config.upstream_timeout = "1s".into();
    let proxy = config.start().await;
    let addr = proxy.addr();
    let pay = |tenant: &'static str, body: &'static str| async move {
        post(addr, "/v1/payments", &[JSON, ("x-tenant", tenant)], body).await
    };
    let first = pay("acme", r#"{"amount":5}"#).await;
    assert_eq!(first.status, 201, "{first:?}");
    let second = pay("acme", r#"{"amount":5}"#).await;
    assert!(second.replayed(), "the same payment in the window is one: {second:?}");
    assert_eq!(second.execution(), first.execution());
    assert!(!pay("acme", r#"{"amount":6}"#).await.replayed(), "another body runs");
    assert!(!pay("globex", r#"{"amount":5}"#).await.replayed(), "another scope runs");
    assert_eq!(upstream.total(), 3);
    let keyed = post(
        addr,
        "/v1/payments",
        &[JSON, ("x-tenant", "acme"), ("idempotency-key", "k-1")],
        "{}",
    )
    .await;
    assert_eq!(keyed.status, 201);

    // The window is the records' lifetime: the three body-keyed records live at most
    // 3 s, the keyed one its retention (1 h).
    let ttls = records_ttl(&redis);
    let short: Vec<i64> = ttls
        .iter()
        .map(|(_, ttl)| *ttl)
        .filter(|ttl| (0..=3_000).contains(ttl))
        .collect();
    let long = ttls.iter().filter(|(_, ttl)| *ttl > 3_000_000).count();
    assert_eq!((short.len(), long), (3, 1), "{ttls:?}");

    // Once Redis has expired it, the same request runs again.
    let started = tokio::time::Instant::now();
    while records_ttl(&redis).len() > 1 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the window never ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let after = pay("acme", r#"{"amount":5}"#).await;
    assert!(!after.replayed(), "{after:?}");
    assert_ne!(after.execution(), first.execution());
    assert_eq!(upstream.total(), 5);
}

/// In shadow mode, key-less deduplication forwards every request and counts what it
/// would have deduplicated, so that it can be measured before it is enforced.
#[tokio::test]
async fn shadow_mode_counts_what_key_less_deduplication_would_have_replayed() {
    let upstream = Upstream::start().await;
    let lines = "mode = \"shadow\"\nkey = [\"header:Idempotency-Key\", \"body\"]\ndedup_window = \"1m\"\nscope_headers = [\"authorization\"]";
    let proxy = config(StoreKind::Memory, &upstream, lines).start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    for _ in 0..3 {
        let answer = post(addr, "/v1/payments", &[JSON], r#"{"amount":5}"#).await;
        assert_eq!(answer.status, 201);
        assert!(!answer.replayed(), "shadow mode never replays");
    }
    let keyed = [("idempotency-key", "k-1"), JSON];
    post(addr, "/v1/payments", &keyed, "{}").await;
    post(addr, "/v1/payments", &keyed, "{}").await;
    assert_eq!(upstream.total(), 5, "every request ran");
    let count = |would: &'static str| async move {
        let line = format!("idemproxy_shadow_decisions_total{{route=\"payments\",would=\"{would}\"}}");
        metric(admin, &line).await
    };
    assert_eq!(count("forward").await, Some(2.0));
    assert_eq!(
        count("deduplicate").await,
        Some(2.0),
        "two identical requests deduplicated"
    );
    assert_eq!(
        count("replay").await,
        Some(1.0),
        "the keyed retry is a replay, not a dedup"
    );
}

/// `check` says where each route's key is found, and what `body` means, in one line.
#[tokio::test]
async fn check_names_the_key_sources_and_what_deduplication_means() {
    let upstream = Upstream::start().await;
    let lines = "key = [\"header:Idempotency-Key\", \"json:/ref\", \"body\"]\ndedup_window = \"5m\"\nscope_headers = [\"authorization\"]";
    let file = config(StoreKind::Memory, &upstream, lines).write_temp();
    let output = support::proxy::binary_command(&[])
        .args(["check", "--config"])
        .arg(file.path())
        .output()
        .expect("run check");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = said
        .lines()
        .find(|line| line.contains("payments"))
        .expect("the payments route");
    assert!(
        line.contains("by the key from the first of header:idempotency-key, json:/ref, body")
            && line.contains("two identical requests within 5m are one operation"),
        "{said}"
    );
}

/// Everything else applies to a key from the body as to the header's: `upstream_key =
/// "derived"` sends the upstream the record's operation id in `upstream_key_header`,
/// and the body exactly as sent; a duplicate in flight waits and gets the replay; a
/// request whose outcome is unknown is probed with `{key}` the key as forwarded, and
/// its retry is the probe's answer, reconciled. One execution each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_key_waiting_and_the_probe_apply_to_a_key_from_the_body() {
    let upstream = Upstream::start().await;
    let lines = "key = [\"json:/ref\"]\nupstream_key = \"derived\"\nwait_for_in_flight = \"3s\"\n\
                 [route.idempotency.reconcile]\npath = \"/v1/payments/by-key/{key}\"\n\
                 first_after = \"100ms\"\nevery = \"200ms\"\ngive_up_after = \"30s\"";
    let mut config = config(StoreKind::Memory, &upstream, lines);
    config.upstream_timeout = "2s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    const BODY: &str = r#"{ "amount": 5, "ref": "r-wait" }"#;

    let first = tokio::spawn(async move { post(addr, "/v1/payments", &[JSON, ("x-test-hold", "wait")], BODY).await });
    upstream.wait_for_total(1).await;
    let duplicate = tokio::spawn(async move { post(addr, "/v1/payments", &[JSON], BODY).await });
    support::client::until_metric(admin, "idemproxy_waiters", 1.0).await;
    upstream.release("wait");
    let first = first.await.expect("the first request");
    let duplicate = duplicate.await.expect("the duplicate");
    assert_eq!((first.status.as_u16(), first.replayed()), (201, false), "{first:?}");
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
    let log = upstream.log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0].key.len(), 32, "the derived key, not r-wait: {}", log[0].key);
    assert!(log[0].key.bytes().all(|byte| byte.is_ascii_hexdigit()));
    assert_eq!(log[0].body, BODY.as_bytes(), "the body as sent, its key in it");

    // Held past the upstream timeout: the outcome is unknown, and the probe asks the
    // upstream by the key it was sent.
    let lost = post(
        addr,
        "/v1/payments",
        &[JSON, ("x-test-hold", "lost")],
        r#"{"ref":"r-lost"}"#,
    )
    .await;
    assert_eq!(lost.status, 504, "{lost:?}");
    upstream.release("lost");
    support::client::until_metric(
        admin,
        "idemproxy_reconciliations_total{route=\"payments\",result=\"applied\"}",
        1.0,
    )
    .await;
    let log = upstream.log();
    assert_eq!(log.len(), 2, "{log:?}");
    let forwarded = &log[1].key;
    assert_eq!(forwarded.len(), 32, "{forwarded}");
    assert!(
        upstream
            .lookups()
            .iter()
            .all(|lookup| lookup.path == format!("/v1/payments/by-key/{forwarded}")),
        "{:?}",
        upstream.lookups()
    );
    let retry = post(addr, "/v1/payments", &[JSON], r#"{"ref":"r-lost"}"#).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.header("idempotency-reconciled"), Some("true"));
    assert_eq!(upstream.total(), 2, "each operation ran once");
}

/// Issue 49 (a plant the suite missed: `form:` dropped from `needs_body` passed every
/// test, since each that configured `form:` also had a `json:` source). On a form-only
/// route the body is read before the claim: the form's key guards (one execution, the
/// retry replayed), and with `required = false` a keyed form is never forwarded
/// unguarded. And (L2) with `json:` before the header, a body the strict parser refuses
/// is 400, never forwarded unguarded with its key unread.
#[tokio::test]
async fn a_form_only_route_reads_its_key_and_a_body_the_json_source_cannot_read_is_refused() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream, "key = [\"form:ref\"]\nrequired = false")
        .start()
        .await;
    let first = post(proxy.addr(), "/v1/payments", &[FORM], "amount=5&ref=f-only").await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = post(proxy.addr(), "/v1/payments", &[FORM], "amount=5&ref=f-only").await;
    assert!(retry.replayed(), "the form's key guards: {retry:?}");
    assert_eq!(upstream.executions("f-only"), 1, "one execution");

    let upstream = Upstream::start().await;
    let lines = "key = [\"json:/ref\", \"header:Idempotency-Key\"]\nrequired = false";
    let proxy = config(StoreKind::Memory, &upstream, lines).start().await;
    for body in [r#"{"ref":"r-1","ref":"r-2"}"#, r#"{"ref":"r-1","amount":NaN}"#] {
        for _ in 0..2 {
            let refused = post(proxy.addr(), "/v1/payments", &[JSON], body).await;
            assert_eq!(
                (refused.status.as_u16(), refused.problem()),
                (400, "invalid-idempotency-key".into()),
                "{body}: {refused:?}"
            );
        }
    }
    assert_eq!(upstream.total(), 0, "nothing forwarded");
}
