//! The key a guarded request carries upstream (docs/design.md §14, `upstream_key`): the
//! client's own, moved to `upstream_key_header` when that names another field; the
//! record's operation id, unique per route, scope and client key; or none. And the
//! operation id a 409 `outcome-unknown` names, the same the records API shows. Real
//! sockets, the memory store and a real `redis-server`.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;

use serde_json::Value;
use support::{RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};

const TOKEN: &str = "upstream-key-admin-token";

/// The payments route scoped by `x-tenant`, with `lines` in its idempotency table and
/// the records API on. The token file lives as long as the returned directory.
fn config(store: StoreKind, upstream: &Upstream, lines: &str) -> (TestConfig, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    let mut config = TestConfig::new(store, &upstream.url());
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    config.idempotency = format!("scope_headers = [\"x-tenant\"]\n{lines}");
    config.upstream_timeout = "500ms".into();
    (config, dir)
}

async fn post(addr: SocketAddr, tenant: &str, key: &str, extra: &[(&str, &str)]) -> TestResponse {
    let mut headers = vec![("idempotency-key", key), ("x-tenant", tenant)];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/v1/payments", &headers, "{\"amount\":1}").await
}

fn json(response: &TestResponse) -> Value {
    serde_json::from_slice(&response.body).unwrap_or_else(|_| panic!("not JSON: {response:?}"))
}

/// The operation id the records API shows for `tenant`'s `key`.
async fn operation(admin: SocketAddr, tenant: &str, key: &str) -> String {
    let path = format!("/records/payments?key={key}&scope=x-tenant:{tenant}");
    let shown = send(
        admin,
        "GET",
        &path,
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .await;
    assert_eq!(shown.status, 200, "{shown:?}");
    json(&shown)["operation"].as_str().expect("operation").to_string()
}

/// What the upstream saw in `field` on its `n`th execution (from 0): every value of it,
/// which must be at most one (a key set beside the client's, not in its place, would
/// be a second).
fn seen(upstream: &Upstream, n: usize, field: &str) -> Option<String> {
    let log = upstream.log();
    let execution = log.get(n).expect("that many executions");
    let values: Vec<String> = execution
        .headers
        .get_all(field)
        .iter()
        .map(|value| value.to_str().expect("visible ASCII").to_string())
        .collect();
    assert!(
        values.len() <= 1,
        "{field} went upstream {} times: {values:?}",
        values.len()
    );
    values.into_iter().next()
}

async fn derived_keys_are_per_tenant(store: StoreKind) {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(store, &upstream, "upstream_key = \"derived\"");
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    // Two tenants, one client key; the second also tries to choose the upstream's key.
    assert_eq!(post(addr, "alice", "order-17", &[]).await.status, 201);
    let bob = post(addr, "bob", "order-17", &[("idempotency-key", "order-17")]).await;
    assert_eq!(bob.status, 400, "a repeated key field is refused: {bob:?}");
    assert_eq!(post(addr, "bob", "order-17", &[]).await.status, 201);
    let (alice_key, bob_key) = (
        seen(&upstream, 0, "idempotency-key").expect("alice's forwarded key"),
        seen(&upstream, 1, "idempotency-key").expect("bob's forwarded key"),
    );
    assert_ne!(alice_key, bob_key, "two tenants' keys were confused");
    for key in [&alice_key, &bob_key] {
        assert_eq!(key.len(), 32, "{key}");
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
        assert!(
            !key.contains("order-17"),
            "the client's key reached the upstream: {key}"
        );
    }
    assert_eq!(operation(admin, "alice", "order-17").await, alice_key);
    assert_eq!(operation(admin, "bob", "order-17").await, bob_key);
    // A retry replays; the upstream saw each operation once.
    let again = post(addr, "alice", "order-17", &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(upstream.total(), 2);
}

#[tokio::test]
async fn derived_keys_differ_per_tenant_and_never_carry_the_clients_key_in_memory() {
    derived_keys_are_per_tenant(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derived_keys_differ_per_tenant_and_never_carry_the_clients_key_on_redis() {
    let redis = RedisServer::start();
    derived_keys_are_per_tenant(StoreKind::Redis(redis.url())).await;
}

#[tokio::test]
async fn a_client_cannot_choose_the_derived_key_in_another_field() {
    let upstream = Upstream::start().await;
    let lines = "upstream_key = \"derived\"\nupstream_key_header = \"x-operation\"";
    let (config, _dir) = config(StoreKind::Memory, &upstream, lines);
    let proxy = config.start().await;
    let answer = post(proxy.addr(), "alice", "k1", &[("x-operation", "chosen-by-the-client")]).await;
    assert_eq!(answer.status, 201, "{answer:?}");
    let forwarded = seen(&upstream, 0, "x-operation").expect("the derived key");
    assert_eq!(forwarded, operation(proxy.admin(), "alice", "k1").await);
    assert_eq!(
        seen(&upstream, 0, "idempotency-key"),
        None,
        "the client's key went upstream too"
    );
}

#[tokio::test]
async fn upstream_key_none_strips_the_key_and_client_moves_it_to_its_field() {
    let upstream = Upstream::start().await;
    let (none, _dir) = config(StoreKind::Memory, &upstream, "upstream_key = \"none\"");
    let proxy = none.start().await;
    assert_eq!(post(proxy.addr(), "alice", "k1", &[]).await.status, 201);
    assert_eq!(seen(&upstream, 0, "idempotency-key"), None);

    let lines = "upstream_key = \"client\"\nupstream_key_header = \"x-request-key\"";
    let (moved, _dir) = config(StoreKind::Memory, &upstream, lines);
    let proxy = moved.start().await;
    assert_eq!(post(proxy.addr(), "alice", "k2", &[]).await.status, 201);
    assert_eq!(seen(&upstream, 1, "x-request-key").as_deref(), Some("k2"));
    assert_eq!(seen(&upstream, 1, "idempotency-key"), None);

    // The default: the client's key, as it sent it.
    let (default, _dir) = config(StoreKind::Memory, &upstream, "");
    let proxy = default.start().await;
    assert_eq!(post(proxy.addr(), "alice", "k3", &[]).await.status, 201);
    assert_eq!(seen(&upstream, 2, "idempotency-key").as_deref(), Some("k3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_names_its_operation_as_the_records_api_and_the_upstream_do() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Redis(redis.url()), &upstream, "upstream_key = \"derived\"");
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    // Held past the 500 ms upstream timeout: 504, and the record is unknown.
    let first = post(addr, "alice", "slow", &[("x-test-hold", "slow")]).await;
    assert_eq!(first.status, 504, "{first:?}");
    upstream.release("slow");
    let retry = post(addr, "alice", "slow", &[]).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    let problem = json(&retry);
    assert_eq!(problem["type"], "urn:idemproxy:problem:outcome-unknown", "{problem}");
    let named = problem["operation"].as_str().expect("operation").to_string();
    assert_eq!(named, operation(admin, "alice", "slow").await);
    assert_eq!(Some(named), seen(&upstream, 0, "idempotency-key"));
    // Other refusals name none.
    let missing = send(addr, "POST", "/v1/payments", &[("x-tenant", "alice")], "{}").await;
    assert_eq!(missing.status, 400);
    assert!(json(&missing).get("operation").is_none(), "{missing:?}");
}

/// Shadow mode forwards every request as an unguarded route would, so the upstream
/// gets the client's key as sent even where enforce would send the derived one (it
/// once got the derived key on a shadow route's first request and the client's on
/// its retries).
#[tokio::test]
async fn shadow_mode_forwards_the_clients_own_key() {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(
        StoreKind::Memory,
        &upstream,
        "upstream_key = \"derived\"\nmode = \"shadow\"",
    );
    let proxy = config.start().await;
    // The first request is claimed (to be recorded), the retry is not: both carry it.
    for n in 0..2 {
        assert_eq!(post(proxy.addr(), "alice", "k-shadow", &[]).await.status, 201);
        assert_eq!(
            seen(&upstream, n, "idempotency-key").as_deref(),
            Some("k-shadow"),
            "request {n}"
        );
    }
}

/// In enforce mode every forward carries the route's upstream key: claimed, and
/// unguarded with `on_store_error = "forward"` while the store is down, so that an
/// upstream that deduplicates on it sees one key per operation either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_derived_key_goes_upstream_also_when_the_store_is_down_and_forward_is_chosen() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let lines = "upstream_key = \"derived\"\non_store_error = \"forward\"";
    let (config, _dir) = config(StoreKind::Redis(redis.url()), &upstream, lines);
    let proxy = config.start().await;
    assert_eq!(post(proxy.addr(), "alice", "k-claimed", &[]).await.status, 201);
    let claimed = seen(&upstream, 0, "idempotency-key").expect("the derived key");
    assert_eq!(claimed, operation(proxy.admin(), "alice", "k-claimed").await);
    redis.kill();
    assert_eq!(post(proxy.addr(), "alice", "k-claimed", &[]).await.status, 201);
    assert_eq!(
        seen(&upstream, 1, "idempotency-key"),
        Some(claimed),
        "forwarded unguarded with another key"
    );
}

/// The key the upstream is to see is set after the hop-by-hop fields are stripped: a
/// client that names it in `Connection` does not take it off the request. For the
/// derived key in its own field, and for the client's key in its own.
#[tokio::test]
async fn a_client_cannot_strip_the_upstream_key_by_naming_it_in_connection() {
    let upstream = Upstream::start().await;
    let lines = "upstream_key = \"derived\"\nupstream_key_header = \"x-op-id\"";
    let (derived, _dir) = config(StoreKind::Memory, &upstream, lines);
    let proxy = derived.start().await;
    let answer = post(proxy.addr(), "alice", "k-conn", &[("connection", "x-op-id")]).await;
    assert_eq!(answer.status, 201, "{answer:?}");
    assert_eq!(
        seen(&upstream, 0, "x-op-id"),
        Some(operation(proxy.admin(), "alice", "k-conn").await),
        "the derived key was stripped"
    );

    let (client, _dir) = config(StoreKind::Memory, &upstream, "");
    let proxy = client.start().await;
    let answer = post(
        proxy.addr(),
        "alice",
        "\"k-conn-2\"",
        &[("connection", "idempotency-key")],
    )
    .await;
    assert_eq!(answer.status, 201, "{answer:?}");
    assert_eq!(
        seen(&upstream, 1, "idempotency-key").as_deref(),
        Some("k-conn-2"),
        "the client's key, canonical, reaches the upstream"
    );
}
