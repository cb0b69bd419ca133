//! Traces (docs/design.md §16), end to end: the idemproxy binary exports to an OTLP/HTTP
//! collector inside the test, whose exports are decoded with the `opentelemetry-proto`
//! types. A client's trace continues through the proxy's spans to the `traceparent`
//! the upstream receives; a replay's span links to the request that executed it, and
//! the records API names that trace; nothing the client sent in its key, query or
//! headers is in any export; and a collector that is gone or never answers costs a
//! counter, never a request.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;

use support::client::{metric, until_metric};
use support::collector::{Collector, Span};
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, Upstream, send};

const TOKEN: &str = "s3cret-admin-token-for-tests";
/// A client's trace context (W3C's own example ids).
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
/// What must never leave the proxy in a span.
const SECRET_KEY: &str = "key-SECRET-a1b2c3";
const SECRET_QUERY: &str = "query-SECRET-d4e5";
const SECRET_HEADER: &str = "header-SECRET-f6a7";

fn config(store: StoreKind, upstream: &Upstream, tracing: &str) -> (TestConfig, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    let mut config = TestConfig::new(store, &upstream.url());
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    config.server = "access_log = true".into();
    config.extra_routes = format!("[tracing]\n{tracing}\n");
    (config, dir)
}

fn traceparent(trace: &str, span: &str, flags: &str) -> String {
    format!("00-{trace}-{span}-{flags}")
}

/// The (trace id, parent id, flags) of a `traceparent`.
fn parse_traceparent(value: &str) -> (String, String, String) {
    let parts: Vec<&str> = value.split('-').collect();
    assert_eq!(parts.len(), 4, "{value}");
    assert_eq!(parts[0], "00", "{value}");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

fn one<'a>(spans: &'a [Span], what: &str, matches: impl Fn(&Span) -> bool) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|span| matches(span)).collect();
    assert_eq!(found.len(), 1, "one {what} span: {spans:#?}");
    found[0]
}

fn by_id<'a>(spans: &'a [Span], id: &str) -> &'a Span {
    one(spans, id, |span| span.span_id == id)
}

/// The span ids from `span` up to its trace's root among `spans`.
fn ancestry<'a>(spans: &'a [Span], mut span: &'a Span) -> Vec<&'a str> {
    let mut chain = vec![span.name.as_str()];
    while !span.parent_span_id.is_empty() {
        match spans.iter().find(|parent| parent.span_id == span.parent_span_id) {
            Some(parent) => {
                chain.push(parent.name.as_str());
                span = parent;
            }
            None => break,
        }
    }
    chain
}

async fn trace_through_the_proxy(store: StoreKind) {
    let collector = Collector::start().await;
    let upstream = Upstream::start().await;
    let tracing = format!(
        "otlp_endpoint = \"{}\"\nservice_name = \"payments-edge\"",
        collector.url()
    );
    let (config, dir) = config(store, &upstream, &tracing);
    let log = dir.path().join("proxy.log");
    let proxy = ChildProxy::start_logged(&config, &log, &[]).await;

    let client_parent = traceparent(CLIENT_TRACE, CLIENT_SPAN, "01");
    let path = format!("/v1/payments?q={SECRET_QUERY}");
    let headers = [
        ("idempotency-key", SECRET_KEY),
        ("traceparent", client_parent.as_str()),
        ("tracestate", "vendor=opaque"),
        ("x-secret", SECRET_HEADER),
    ];
    let first = send(proxy.addr, "POST", &path, &headers, "{\"amount\":1}").await;
    assert_eq!(first.status, 201, "{first:?}");

    // The upstream got the proxy's span as its parent, in the client's trace, with the
    // client's trace state.
    let executions = upstream.log();
    assert_eq!(executions.len(), 1);
    let seen = executions[0]
        .headers
        .get("traceparent")
        .expect("a traceparent upstream");
    let (trace, upstream_parent, flags) = parse_traceparent(seen.to_str().expect("ascii"));
    assert_eq!((trace.as_str(), flags.as_str()), (CLIENT_TRACE, "01"));
    assert_ne!(upstream_parent, CLIENT_SPAN, "the proxy's span, not the client's");
    assert_eq!(
        executions[0].headers.get("tracestate").map(|v| v.as_bytes()),
        Some(&b"vendor=opaque"[..])
    );

    // A retry, in another client trace, gets the replay.
    let retry_trace = "0af7651916cd43dd8448eb211c80319c";
    let retry_parent = traceparent(retry_trace, "b7ad6b7169203331", "01");
    let headers = [
        ("idempotency-key", SECRET_KEY),
        ("traceparent", retry_parent.as_str()),
        ("x-secret", SECRET_HEADER),
    ];
    let replay = send(proxy.addr, "POST", &path, &headers, "{\"amount\":1}").await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.log().len(), 1, "the replay never reached the upstream");

    let spans = collector
        .until("both requests' spans", |spans| {
            spans.iter().filter(|span| span.name == "request").count() == 2
                && spans.iter().any(|span| span.name == "complete")
                && spans.iter().any(|span| span.name == "upstream")
        })
        .await;

    // The chain: client span -> request -> guarded -> upstream, whose id is what the
    // upstream received as its parent.
    let executed = one(&spans, "first request", |span| {
        span.name == "request" && span.trace_id == CLIENT_TRACE
    });
    assert_eq!(
        executed.parent_span_id, CLIENT_SPAN,
        "the request continues the client's span"
    );
    assert_eq!(executed.service, "payments-edge");
    assert_eq!(executed.attribute("idemproxy.route"), Some("payments"));
    assert_eq!(executed.attribute("http.request.method"), Some("POST"));
    assert_eq!(executed.attribute("http.response.status_code"), Some("201"));
    assert_eq!(executed.attribute("idemproxy.outcome"), Some("forwarded"));
    let record = executed.attribute("idemproxy.record").expect("the record's hash");
    assert_eq!(record.len(), 12, "{record}");
    let exchange = by_id(&spans, &upstream_parent);
    assert_eq!(exchange.name, "upstream");
    assert_eq!(exchange.trace_id, CLIENT_TRACE);
    assert_eq!(exchange.attribute("http.response.status_code"), Some("201"));
    assert_eq!(ancestry(&spans, exchange), ["upstream", "guarded", "request"]);
    for op in ["claim", "complete"] {
        let store_op = one(&spans, op, |span| span.name == op && span.trace_id == CLIENT_TRACE);
        assert_eq!(store_op.attribute("db.operation.name"), Some(op));
        assert_eq!(ancestry(&spans, store_op), [op, "guarded", "request"]);
    }

    // The replay: its own trace, linked to the request that executed it.
    let replayed = one(&spans, "replay", |span| {
        span.name == "request" && span.trace_id == retry_trace
    });
    assert_eq!(replayed.attribute("idemproxy.outcome"), Some("replayed"));
    assert_eq!(replayed.attribute("idemproxy.record"), Some(record));
    assert_eq!(
        replayed.links,
        [(CLIENT_TRACE.to_string(), executed.span_id.clone())],
        "the replay links to its execution's request span"
    );
    assert!(
        !spans
            .iter()
            .any(|span| span.trace_id == retry_trace && span.name == "upstream"),
        "a replay has no upstream span"
    );

    // The records API names the execution's trace.
    let shown = send(
        proxy.admin,
        "GET",
        &format!("/records/payments?key={SECRET_KEY}"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .await;
    assert_eq!(shown.status, 200, "{shown:?}");
    let view: serde_json::Value = serde_json::from_slice(&shown.body).expect("JSON");
    assert_eq!(view["trace_id"], CLIENT_TRACE, "{view}");

    // Nothing the client sent as a key, a query or a header value is in any export.
    let bodies = collector.bodies();
    assert!(!bodies.is_empty());
    for body in &bodies {
        for secret in [SECRET_KEY, SECRET_QUERY, SECRET_HEADER] {
            assert!(
                !body.windows(secret.len()).any(|window| window == secret.as_bytes()),
                "{secret} in an export"
            );
        }
    }

    // Each access line carries its request's trace id.
    let log = std::fs::read_to_string(&log).expect("the log");
    let access: Vec<&str> = log.lines().filter(|line| line.contains("access")).collect();
    assert!(
        access
            .iter()
            .any(|line| line.contains(&format!("trace_id=\"{CLIENT_TRACE}\""))
                || line.contains(&format!("trace_id={CLIENT_TRACE}"))),
        "{log}"
    );
    assert!(access.iter().any(|line| line.contains(retry_trace)), "{log}");
    // The log leaves out the trace-only spans.
    assert!(!log.contains("request{"), "{log}");
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trace_runs_through_the_proxy_and_a_replay_links_to_its_execution() {
    trace_through_the_proxy(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_record_keeps_its_execution_trace_for_the_replay() {
    let redis = RedisServer::start();
    trace_through_the_proxy(StoreKind::Redis(redis.url())).await;
}

/// With `sample_ratio = 0`, a trace the proxy starts is not sampled (its `traceparent`
/// upstream says so, and nothing is exported), while a client's sampled trace stays
/// sampled: the ratio is parent-based.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_follows_the_client_and_the_ratio_decides_the_rest() {
    let collector = Collector::start().await;
    let upstream = Upstream::start().await;
    let tracing = format!("otlp_endpoint = \"{}\"\nsample_ratio = 0.0", collector.url());
    let (config, _dir) = config(StoreKind::Memory, &upstream, &tracing);
    let proxy = ChildProxy::start(&config).await;

    let unsampled = send(proxy.addr, "GET", "/v1/reads/started-here", &[], "").await;
    assert_eq!(unsampled.status, 201);
    let client_parent = traceparent(CLIENT_TRACE, CLIENT_SPAN, "01");
    let sampled = send(
        proxy.addr,
        "GET",
        "/v1/reads/client",
        &[("traceparent", client_parent.as_str())],
        "",
    )
    .await;
    assert_eq!(sampled.status, 201);

    let log = upstream.log();
    let parent_of = |path: &str| {
        let execution = log.iter().find(|execution| execution.path == path).expect("forwarded");
        let value = execution.headers.get("traceparent").expect("a traceparent upstream");
        parse_traceparent(value.to_str().expect("ascii"))
    };
    let (started, _, flags) = parent_of("/v1/reads/started-here");
    assert_ne!(started, CLIENT_TRACE);
    assert_eq!(flags, "00", "a trace the proxy started at ratio 0 is not sampled");
    let (continued, _, flags) = parent_of("/v1/reads/client");
    assert_eq!((continued.as_str(), flags.as_str()), (CLIENT_TRACE, "01"));

    let spans = collector
        .until("the sampled request", |spans| {
            spans
                .iter()
                .any(|span| span.name == "request" && span.trace_id == CLIENT_TRACE)
                && spans.iter().any(|span| span.name == "upstream")
        })
        .await;
    assert!(
        spans.iter().all(|span| span.trace_id == CLIENT_TRACE),
        "only the client's sampled trace is exported: {spans:#?}"
    );
    let request = one(&spans, "request", |span| span.name == "request");
    assert_eq!(request.attribute("idemproxy.route"), Some("reads"));
    assert_eq!(request.attribute("idemproxy.outcome"), Some("forwarded"));
}

async fn no_collector_costs_no_request(collector: SocketAddr, what: &str) {
    let upstream = Upstream::start().await;
    let tracing = format!("otlp_endpoint = \"http://{collector}\"");
    let (config, _dir) = config(StoreKind::Memory, &upstream, &tracing);
    let proxy = ChildProxy::start(&config).await;
    let dropped = "idemproxy_trace_spans_dropped_total";
    assert_eq!(metric(proxy.admin, dropped).await, Some(0.0));
    let mut clients = Vec::new();
    for client in 0..8 {
        let addr = proxy.addr;
        clients.push(tokio::spawn(async move {
            for n in 0..25 {
                let key = format!("k-{client}-{n}");
                let response = send(addr, "POST", "/v1/payments", &[("idempotency-key", &key)], "{}").await;
                assert_eq!(response.status, 201, "{response:?}");
            }
        }));
    }
    for client in clients {
        client.await.expect("a client");
    }
    assert_eq!(upstream.total(), 200);
    // Every request made spans (request, guarded, claim, upstream, complete): with
    // nobody taking them, they are dropped and counted.
    let started = tokio::time::Instant::now();
    loop {
        let count = metric(proxy.admin, dropped).await.unwrap_or(0.0);
        if count >= 200.0 {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "{what}: only {count} spans counted dropped"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    until_metric(proxy.admin, "idemproxy_trace_spans_exported_total", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_gone_costs_a_counter_never_a_request() {
    let closed = support::free_port();
    no_collector_costs_no_request(SocketAddr::from(([127, 0, 0, 1], closed)), "port closed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_costs_a_counter_never_a_request() {
    // Accepts connections and reads nothing: each export waits out its timeout.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            open.push(stream);
        }
    });
    no_collector_costs_no_request(addr, "collector silent").await;
    held.abort();
}

/// A first request that times out after taking effect: its trace has the `mark_unknown`;
/// the probe is a trace of its own, linked to that request, with its lease, its lookup
/// upstream and its resolution inside; and the replay of what the probe learned links
/// to the probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_is_traced_and_the_replay_of_its_answer_links_to_it() {
    let collector = Collector::start().await;
    let upstream = Upstream::start().await;
    let tracing = format!("otlp_endpoint = \"{}\"", collector.url());
    let (mut config, _dir) = config(StoreKind::Memory, &upstream, &tracing);
    config.upstream_timeout = "300ms".into();
    config.idempotency =
        "reconcile = { path = \"/v1/payments/by-key/{key}\", first_after = \"100ms\", every = \"100ms\" }".into();
    let proxy = ChildProxy::start(&config).await;

    let client_parent = traceparent(CLIENT_TRACE, CLIENT_SPAN, "01");
    let headers = [
        ("idempotency-key", "probed"),
        ("x-test-hold", "forever"),
        ("traceparent", client_parent.as_str()),
    ];
    let first = send(proxy.addr, "POST", "/v1/payments", &headers, "{}").await;
    assert_eq!(first.status, 504, "{first:?}");
    let replay = support::client::until_not(
        || {
            send(
                proxy.addr,
                "POST",
                "/v1/payments",
                &[("idempotency-key", "probed")],
                "{}",
            )
        },
        &[(409, "outcome-unknown")],
    )
    .await;
    assert_eq!(replay.status, 200, "{replay:?}");
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"));

    let spans = collector
        .until("the probe and the replay", |spans| {
            spans.iter().any(|span| span.name == "resolve")
                && spans
                    .iter()
                    .any(|span| span.name == "request" && span.attribute("idemproxy.outcome") == Some("replayed"))
        })
        .await;
    let executed = one(&spans, "first request", |span| {
        span.name == "request" && span.trace_id == CLIENT_TRACE
    });
    assert_eq!(executed.attribute("http.response.status_code"), Some("504"));
    let unknown = one(&spans, "mark_unknown", |span| span.name == "mark_unknown");
    assert_eq!(unknown.trace_id, CLIENT_TRACE);
    let timed_out = one(&spans, "the timed-out exchange", |span| {
        span.name == "upstream" && span.trace_id == CLIENT_TRACE
    });
    assert_eq!(timed_out.attribute("error.type"), Some("timeout"));

    let resolve = one(&spans, "resolve", |span| span.name == "resolve");
    let probe = by_id(&spans, &resolve.parent_span_id);
    assert_eq!(probe.name, "probe");
    assert!(probe.parent_span_id.is_empty(), "a probe is a trace of its own");
    assert_ne!(probe.trace_id, CLIENT_TRACE);
    assert_eq!(
        probe.links,
        [(CLIENT_TRACE.to_string(), executed.span_id.clone())],
        "the probe links to the request whose outcome it learns"
    );
    for name in ["begin_probe", "upstream"] {
        let inside = one(&spans, name, |span| {
            span.name == name && span.trace_id == probe.trace_id
        });
        assert_eq!(inside.parent_span_id, probe.span_id, "{name}");
    }
    let replayed = one(&spans, "replay", |span| {
        span.name == "request" && span.attribute("idemproxy.outcome") == Some("replayed")
    });
    assert_eq!(
        replayed.links,
        [(probe.trace_id.clone(), probe.span_id.clone())],
        "the replay of a learned answer links to the probe that learned it"
    );
}

/// A client's trace context is continued only when it is what W3C Trace Context
/// writes: a malformed `traceparent` (short ids, upper case, a sign, a long flags
/// field) starts a trace of the proxy's own and its `tracestate` is dropped with it,
/// so no client joins a trace it cannot spell; a long `tracestate` is cut to whole
/// entries within 512 characters before any span keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_valid_trace_context_is_continued_and_a_long_tracestate_is_cut() {
    let collector = Collector::start().await;
    let upstream = Upstream::start().await;
    let tracing = format!("otlp_endpoint = \"{}\"", collector.url());
    let (config, _dir) = config(StoreKind::Memory, &upstream, &tracing);
    let proxy = ChildProxy::start(&config).await;
    let padded = format!("00-{}-{CLIENT_SPAN}-01", "0".repeat(30) + "ab");
    let invalid = [
        "00-1-1-01".to_string(),
        format!("00-{}-{CLIENT_SPAN}-01", CLIENT_TRACE.to_uppercase()),
        format!("00-+{}-{CLIENT_SPAN}-01", &CLIENT_TRACE[1..]),
        format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-001"),
    ];
    for (n, parent) in invalid.iter().chain([&padded]).enumerate() {
        let key = format!("tc-{n}");
        let headers = [
            ("idempotency-key", key.as_str()),
            ("traceparent", parent.as_str()),
            ("tracestate", "joined=yes"),
        ];
        let answer = send(proxy.addr, "POST", "/v1/payments", &headers, "{}").await;
        assert_eq!(answer.status, 201, "{answer:?}");
        let execution = upstream
            .log()
            .into_iter()
            .find(|execution| execution.key == key)
            .expect("forwarded");
        let seen = execution
            .headers
            .get("traceparent")
            .expect("a traceparent")
            .to_str()
            .expect("ascii")
            .to_string();
        let (trace, _, _) = parse_traceparent(&seen);
        let continued = parent.contains(&trace);
        if parent == &padded {
            assert!(continued, "a valid parent is continued: {seen}");
            assert_eq!(
                execution.headers.get("tracestate").map(|v| v.to_str().ok()),
                Some(Some("joined=yes"))
            );
        } else {
            assert!(!continued, "{parent} was continued as {seen}");
            assert!(
                execution.headers.get("tracestate").is_none(),
                "{parent}: its tracestate went on: {:?}",
                execution.headers
            );
        }
    }
    let long: Vec<String> = (0..400).map(|n| format!("v{n:03}={}", "x".repeat(40))).collect();
    let long = long.join(",");
    let parent = traceparent(CLIENT_TRACE, CLIENT_SPAN, "01");
    let headers = [
        ("idempotency-key", "tc-long"),
        ("traceparent", parent.as_str()),
        ("tracestate", long.as_str()),
    ];
    assert_eq!(
        send(proxy.addr, "POST", "/v1/payments", &headers, "{}").await.status,
        201
    );
    let execution = upstream
        .log()
        .into_iter()
        .find(|execution| execution.key == "tc-long")
        .expect("forwarded");
    let state = execution
        .headers
        .get("tracestate")
        .expect("a tracestate")
        .to_str()
        .expect("ascii");
    assert!(
        state.len() <= 512 && long.starts_with(state) && long[state.len()..].starts_with(','),
        "{}",
        state.len()
    );
}
