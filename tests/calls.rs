//! The clients of today (docs/design.md §28, §29): JSON-RPC routes guard only their
//! listed methods and answer a retry with its own `id`; GraphQL routes guard only
//! mutations, read by a parser; `[route.cors]` answers browsers' preflights. Real
//! sockets, the fake upstream (which answers a path ending in `/rpc` as a JSON-RPC
//! server), the memory store and a real `redis-server`.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;

use support::client::try_send;
use support::{RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};

const JSON: (&str, &str) = ("content-type", "application/json");

fn config(store: StoreKind, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    let url = upstream.url();
    config.extra_routes = format!(
        r#"
[[route]]
name = "mcp"
path_prefix = "/mcp"
upstream = "{url}"
[route.idempotency]
jsonrpc_methods = ["tools/call"]
key = ["header:Idempotency-Key", "json:/params/arguments/idempotency_key"]

[[route]]
name = "graphql"
path_prefix = "/graphql"
upstream = "{url}"
[route.idempotency]
graphql = "mutations"

[[route]]
name = "web"
path_prefix = "/web"
upstream = "{url}"
[route.idempotency]
scope_headers = ["x-tenant"]
[route.cors]
allow_origins = ["http://app.example.test"]
"#
    );
    config
}

fn rpc(id: &str, method: &str, arguments: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{{"name":"pay","arguments":{arguments}}}}}"#)
}

fn json(response: &TestResponse) -> serde_json::Value {
    serde_json::from_slice(&response.body).unwrap_or_else(|_| panic!("a JSON body: {response:?}"))
}

/// The proxy's own JSON-RPC error: its id, and the problem's slug in `data`.
fn rpc_error(response: &TestResponse) -> (serde_json::Value, i64, String) {
    assert_eq!(
        response.header("content-type"),
        Some("application/json"),
        "{response:?}"
    );
    let body = json(response);
    assert_eq!(body["jsonrpc"], "2.0", "{body}");
    assert!(body.get("result").is_none(), "{body}");
    let code = body["error"]["code"].as_i64().expect("an error code");
    let slug = body["error"]["data"]["slug"].as_str().expect("a slug").to_string();
    assert!(body["error"]["message"].is_string(), "{body}");
    (body["id"].clone(), code, slug)
}

async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> TestResponse {
    send(addr, "POST", path, headers, body).await
}

async fn jsonrpc_tools(store: StoreKind) {
    let upstream = Upstream::start().await;
    let proxy = config(store, &upstream).start().await;
    let addr = proxy.addr();

    // A read is not guarded: twice sent, twice executed, no key needed.
    for id in ["1", "2"] {
        let list = post(addr, "/mcp/rpc", &[JSON], &rpc(id, "tools/list", "{}")).await;
        assert_eq!(list.status, 201, "{list:?}");
        assert!(!list.replayed());
        assert_eq!(json(&list)["id"].to_string(), id);
    }
    assert_eq!(upstream.total(), 2, "tools/list ran twice");

    // A tool call with its key in the arguments, retried with a new id: one execution,
    // and the retry reads the recorded answer with its own id, byte for byte otherwise.
    let arguments = r#"{"amount":5,"idempotency_key":"call-1"}"#;
    let first = post(addr, "/mcp/rpc", &[JSON], &rpc("7", "tools/call", arguments)).await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = post(addr, "/mcp/rpc", &[JSON], &rpc("\"retry-8\"", "tools/call", arguments)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(json(&retry)["id"], "retry-8");
    assert_eq!(
        std::str::from_utf8(&retry.body)
            .expect("utf-8")
            .replace("\"retry-8\"", "7"),
        std::str::from_utf8(&first.body).expect("utf-8"),
        "only the id differs"
    );
    assert_eq!(upstream.executions("call-1"), 1, "the tool ran once");
    // The same key with other arguments is another request: refused as a JSON-RPC error.
    let other = post(
        addr,
        "/mcp/rpc",
        &[JSON],
        &rpc("9", "tools/call", r#"{"amount":6,"idempotency_key":"call-1"}"#),
    )
    .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(
        rpc_error(&other),
        (serde_json::json!(9), -32000, "idempotency-key-reused".into())
    );

    // A tool call without a key is refused, in the call's id.
    let keyless = post(
        addr,
        "/mcp/rpc",
        &[JSON],
        &rpc("\"k\"", "tools/call", r#"{"amount":5}"#),
    )
    .await;
    assert_eq!(keyless.status, 400, "{keyless:?}");
    assert_eq!(
        rpc_error(&keyless),
        (serde_json::json!("k"), -32000, "missing-idempotency-key".into())
    );

    // A batch: refused if it holds a guarded call, forwarded if none.
    let total = upstream.total();
    let mixed = format!(
        "[{},{}]",
        rpc("1", "tools/list", "{}"),
        rpc("2", "tools/call", arguments)
    );
    let refused = post(addr, "/mcp/rpc", &[JSON], &mixed).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    assert_eq!(
        rpc_error(&refused),
        (serde_json::Value::Null, -32600, "call-unreadable".into())
    );
    assert_eq!(upstream.total(), total, "nothing of the batch was forwarded");
    let reads = format!(
        "[{},{}]",
        rpc("1", "tools/list", "{}"),
        rpc("2", "resources/list", "{}")
    );
    let passed = post(addr, "/mcp/rpc", &[JSON], &reads).await;
    assert_eq!(passed.status, 201, "{passed:?}");
    assert_eq!(json(&passed).as_array().map(Vec::len), Some(2));

    // Not JSON-RPC at all: refused, with a JSON-RPC error a client can read.
    let garbage = post(addr, "/mcp/rpc", &[JSON], "{\"method\":1}").await;
    assert_eq!(rpc_error(&garbage).2, "call-unreadable");
}

#[tokio::test]
async fn a_jsonrpc_route_guards_only_its_methods_and_replays_with_the_retrys_id_on_the_memory_store() {
    jsonrpc_tools(StoreKind::Memory).await;
}

#[tokio::test]
async fn a_jsonrpc_route_guards_only_its_methods_and_replays_with_the_retrys_id_on_redis() {
    let redis = RedisServer::start();
    jsonrpc_tools(StoreKind::Redis(redis.url())).await;
}

/// A retry while the first call is in flight gets a JSON-RPC error in its own id,
/// with the HTTP status the transport needs (409, `Retry-After`).
#[tokio::test]
async fn a_jsonrpc_retry_in_flight_gets_its_own_id_in_a_409() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream).start().await;
    let addr = proxy.addr();
    let held = [JSON, ("idempotency-key", "held-1"), ("x-test-hold", "first")];
    let first = tokio::spawn(async move { post(addr, "/mcp/rpc", &held, &rpc("1", "tools/call", "{}")).await });
    upstream.wait_for_key("held-1").await;
    let retry = post(
        addr,
        "/mcp/rpc",
        &[JSON, ("idempotency-key", "held-1")],
        &rpc("2", "tools/call", "{}"),
    )
    .await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert!(retry.header("retry-after").is_some(), "{retry:?}");
    assert_eq!(
        rpc_error(&retry),
        (serde_json::json!(2), -32000, "request-in-progress".into())
    );
    upstream.release("first");
    let first = first.await.expect("the first call");
    assert_eq!(json(&first)["id"], 1);
    assert_eq!(upstream.executions("held-1"), 1);
}

fn graphql(query: &str, operation: Option<&str>) -> String {
    serde_json::json!({"query": query, "operationName": operation, "variables": {}}).to_string()
}

#[tokio::test]
async fn a_graphql_route_guards_mutations_only_as_its_parser_reads_them() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream).start().await;
    let addr = proxy.addr();

    // A query twice: two executions, no key needed.
    let query = graphql("query Me { me { id } }", None);
    for _ in 0..2 {
        let answer = post(addr, "/graphql", &[JSON], &query).await;
        assert_eq!(answer.status, 201, "{answer:?}");
        assert!(!answer.replayed());
    }
    assert_eq!(upstream.total(), 2);

    // A mutation retried: one execution.
    let pay = graphql("mutation Pay { pay(amount: 5) { id } }", None);
    let keyed = [JSON, ("idempotency-key", "m-1")];
    let first = post(addr, "/graphql", &keyed, &pay).await;
    let retry = post(addr, "/graphql", &keyed, &pay).await;
    assert_eq!((first.status.as_u16(), retry.status.as_u16()), (201, 201));
    assert!(retry.replayed() && retry.execution() == first.execution());
    assert_eq!(upstream.executions("m-1"), 1);
    // Without a key a mutation is refused; a query in a mutation's clothes is not one.
    assert_eq!(
        post(addr, "/graphql", &[JSON], &pay).await.problem(),
        "missing-idempotency-key"
    );
    let sly = graphql(r#"query Q { search(text: "mutation { pay }") { id } }"#, None);
    assert_eq!(post(addr, "/graphql", &[JSON], &sly).await.status, 201);

    // One document, two operations: operationName picks which runs.
    let both = "query Read { me { id } } mutation Pay { pay(amount: 5) { id } }";
    let read = post(addr, "/graphql", &[JSON], &graphql(both, Some("Read"))).await;
    assert_eq!(read.status, 201, "the query passes without a key: {read:?}");
    let keyed = [JSON, ("idempotency-key", "m-2")];
    let pay = post(addr, "/graphql", &keyed, &graphql(both, Some("Pay"))).await;
    let again = post(addr, "/graphql", &keyed, &graphql(both, Some("Pay"))).await;
    assert!(!pay.replayed() && again.replayed(), "{pay:?} {again:?}");
    assert_eq!(upstream.executions("m-2"), 1);

    // A document that does not parse, or two operations and no name: refused.
    let total = upstream.total();
    for body in [graphql("mutation { pay(", None), graphql(both, None), "not json".into()] {
        let refused = post(addr, "/graphql", &[JSON, ("idempotency-key", "m-3")], &body).await;
        assert_eq!(refused.problem(), "call-unreadable", "{body}");
    }
    assert_eq!(upstream.total(), total, "nothing was forwarded");
}

#[tokio::test]
async fn a_cors_route_answers_preflights_for_its_origins_only_and_exposes_the_replay() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream).start().await;
    let addr = proxy.addr();
    let preflight = |origin: &'static str| async move {
        let headers = [
            ("origin", origin),
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "content-type, idempotency-key, x-tenant",
            ),
        ];
        try_send(addr, "OPTIONS", "/web/orders", &headers, "").await
    };
    let allowed = preflight("http://app.example.test").await.expect("a preflight");
    assert_eq!(allowed.status, 204, "{allowed:?}");
    assert_eq!(
        allowed.header("access-control-allow-origin"),
        Some("http://app.example.test")
    );
    let headers = allowed
        .header("access-control-allow-headers")
        .expect("allowed headers")
        .to_ascii_lowercase();
    for name in ["content-type", "idempotency-key", "x-tenant"] {
        assert!(
            headers.split(", ").any(|allowed| allowed == name),
            "{name} in {headers}"
        );
    }
    assert!(
        allowed
            .header("access-control-allow-methods")
            .is_some_and(|m| m.contains("POST"))
    );
    assert_eq!(allowed.header("access-control-max-age"), Some("600"));
    let refused = preflight("http://evil.example.test").await.expect("a preflight");
    assert!(
        refused
            .headers
            .keys()
            .all(|name| !name.as_str().starts_with("access-control-")),
        "{refused:?}"
    );
    assert_eq!(upstream.total(), 0, "no preflight reached the upstream");

    // The answers: the upstream's own CORS field dropped, the route's given to the
    // allowed origin, on the first answer and on its replay.
    let request = [
        JSON,
        ("origin", "http://app.example.test"),
        ("idempotency-key", "web-1"),
        ("x-test-response-header", "access-control-allow-origin: *"),
    ];
    for replayed in [false, true] {
        let answer = post(addr, "/web/orders", &request, "{}").await;
        assert_eq!(
            (answer.status.as_u16(), answer.replayed()),
            (201, replayed),
            "{answer:?}"
        );
        let origins: Vec<_> = answer.headers.get_all("access-control-allow-origin").iter().collect();
        assert_eq!(origins, ["http://app.example.test"], "{answer:?}");
        let exposed = answer.header("access-control-expose-headers").expect("exposed");
        assert!(exposed.contains("Idempotent-Replayed") && exposed.contains("Idempotency-Expires"));
    }
    let other = post(
        addr,
        "/web/orders",
        &[
            JSON,
            ("origin", "http://evil.example.test"),
            ("idempotency-key", "web-1"),
        ],
        "{}",
    )
    .await;
    assert!(other.replayed());
    assert!(other.header("access-control-allow-origin").is_none(), "{other:?}");
    // A proxy's own refusal is readable by the allowed origin too.
    let missing = post(
        addr,
        "/web/orders",
        &[JSON, ("origin", "http://app.example.test")],
        "{}",
    )
    .await;
    assert_eq!(
        missing.header("access-control-allow-origin"),
        Some("http://app.example.test")
    );
    assert_eq!(missing.problem(), "missing-idempotency-key");
    assert_eq!(upstream.executions("web-1"), 1);
}
