//! The published contract (docs/design.md §15) over real sockets: `/.well-known/idempotency`
//! per host with its caching, `Link` and `type` on every problem of a route with a
//! `docs_url`, the Stripe profile (raw, and through Stripe's own Python SDK), the
//! `contract` command's OpenAPI fragment validated against the OpenAPI 3.1 schema, and
//! the `conformance` command green against the proxy and red against a bare upstream.
//!
//! The Python checks need `stripe` and `openapi-spec-validator` from PyPI; `.ci/run`
//! installs them, and without them those tests fail and say how to install them.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::process::Command;

use support::{StoreKind, TestConfig, TestResponse, Upstream, post_key, send};

const DOCS: &str = "https://docs.example.com/errors";

/// A partner route only for `partner.example`, a Stripe-profile route, and `docs_url`
/// on payments.
fn config(upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.upstream_extra = format!("docs_url = {DOCS:?}");
    config.idempotency = "fingerprint_body = \"json\"\nfingerprint_ignore = [\"/trace\"]".into();
    config.extra_routes = format!(
        r#"
[[route]]
name = "partner"
host = "partner.example"
path_prefix = "/v2/transfers"
upstream = "{url}"

[route.idempotency]
retention = "2h"

[[route]]
name = "customers"
path_prefix = "/v1/customers"
upstream = "{url}"

[route.idempotency]
profile = "stripe"
"#,
        url = upstream.url()
    );
    config
}

fn json(response: &TestResponse) -> serde_json::Value {
    serde_json::from_slice(&response.body).expect("a JSON body")
}

fn names(document: &serde_json::Value) -> Vec<String> {
    document["routes"]
        .as_array()
        .expect("routes")
        .iter()
        .map(|route| route["name"].as_str().expect("a name").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_well_known_document_lists_the_routes_of_the_requests_host_and_is_cached() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let get = |host: &'static str, extra: Vec<(&'static str, String)>| {
        let addr = proxy.addr();
        async move {
            let mut headers: Vec<(&str, &str)> = vec![("host", host)];
            headers.extend(extra.iter().map(|(name, value)| (*name, value.as_str())));
            send(addr, "GET", "/.well-known/idempotency", &headers, "").await
        }
    };
    let any = get("api.example", vec![]).await;
    assert_eq!(any.status, 200, "{any:?}");
    assert_eq!(any.header("content-type"), Some("application/json"));
    assert_eq!(any.header("cache-control"), Some("max-age=60"));
    let document = json(&any);
    assert_eq!(names(&document), ["customers", "payments", "orders"], "{document}");
    let payments = &document["routes"][1];
    assert_eq!(payments["header"], "Idempotency-Key");
    assert_eq!(payments["required"], true);
    assert_eq!(payments["retention_seconds"], 3600);
    assert_eq!(payments["key"]["max_length"], 255);
    assert_eq!(payments["fingerprint"]["body"], "json");
    assert_eq!(payments["fingerprint"]["ignored_json_pointers"][0], "/trace");
    assert_eq!(payments["wait_for_in_flight_ms"], 0);
    assert_eq!(payments["docs_url"], DOCS);
    let responses = payments["responses"].as_array().expect("responses");
    let answer = |slug: &str| {
        responses
            .iter()
            .find(|answer| answer["problem"] == slug)
            .unwrap_or_else(|| panic!("{slug} not listed: {responses:?}"))
            .clone()
    };
    assert_eq!(answer("request-in-progress")["status"], 409);
    assert_eq!(answer("idempotency-key-reused")["status"], 422);
    assert_eq!(answer("outcome-unknown")["type"], format!("{DOCS}#outcome-unknown"));
    assert!(
        responses.iter().all(|answer| answer["problem"] != "unverified-scope"),
        "no scope_jwt here"
    );
    // The Stripe-profile route answers key reuse with 400.
    let customers = &document["routes"][0];
    assert_eq!(customers["profile"], "stripe");
    let reuse = customers["responses"]
        .as_array()
        .expect("responses")
        .iter()
        .find(|answer| answer["problem"] == "idempotency-key-reused")
        .expect("listed")
        .clone();
    assert_eq!(reuse["status"], 400);

    // Another host sees its own route too; a route for one host is not shown to others.
    let partner = json(&get("partner.example", vec![]).await);
    assert_eq!(names(&partner), ["partner", "customers", "payments", "orders"]);
    assert_eq!(partner["routes"][0]["retention_seconds"], 7200);

    // Cached: the tag comes back as 304, weak or strong; another tag gets the document.
    let tag = any.header("etag").expect("an ETag").to_string();
    assert!(tag.starts_with('"') && tag.ends_with('"'), "{tag}");
    // A list is split on its commas, with or without spaces (RFC 9110 §8.8.3).
    for matching in [
        tag.clone(),
        format!("W/{tag}"),
        format!("\"other\", {tag}"),
        format!("\"other\",{tag}"),
        format!("\"other\" ,\tW/{tag}"),
        "*".into(),
    ] {
        let again = get("api.example", vec![("if-none-match", matching.clone())]).await;
        assert_eq!(again.status, 304, "{matching}: {again:?}");
        assert!(again.body.is_empty());
        assert_eq!(again.header("etag"), Some(tag.as_str()));
    }
    let other = get("api.example", vec![("if-none-match", "\"other\"".into())]).await;
    assert_eq!(other.status, 200);
    assert_ne!(
        get("partner.example", vec![]).await.header("etag"),
        Some(tag.as_str()),
        "per host"
    );

    // Only GET and HEAD; another spelling of the path is answered too; never forwarded.
    let post = send(proxy.addr(), "POST", "/.well-known/idempotency", &[], "{}").await;
    assert_eq!(post.status, 405);
    assert_eq!(post.header("allow"), Some("GET, HEAD"));
    let head = send(proxy.addr(), "HEAD", "/.well-known/idempotency", &[], "").await;
    assert_eq!((head.status.as_u16(), head.body.len()), (200, 0));
    let spelled = send(proxy.addr(), "GET", "/.well-known//idempotency", &[], "").await;
    assert_eq!(spelled.status, 200, "{spelled:?}");
    assert_eq!(upstream.total(), 0, "the contract is the proxy's, never the upstream's");
}

/// A request that names no host (HTTP/1.0 without `Host`, HTTP/2 without
/// `:authority`) is shown only the routes for any host: a route bound to one host is
/// that host's, and a client that names none has not reached it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_names_no_host_is_shown_only_the_routes_for_any_host() {
    use support::h2raw::{self, DATA, END_HEADERS, END_STREAM, HEADERS, frame};
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let for_any_host = ["customers", "payments", "orders"];

    let raw = support::send_raw(
        proxy.addr(),
        b"GET /.well-known/idempotency HTTP/1.0\r\n\r\n",
        std::time::Duration::from_secs(5),
    )
    .await;
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response");
    assert!(head.starts_with("HTTP/1.0 200"), "{head}");
    let document: serde_json::Value = serde_json::from_str(body).expect("a JSON document");
    assert_eq!(names(&document), for_any_host, "HTTP/1.0 without Host: {document}");

    let mut connection = h2raw::Connection::open(proxy.addr()).await;
    let block = h2raw::request_for("GET", "/.well-known/idempotency", None, &[]);
    use tokio::io::AsyncWriteExt as _;
    connection
        .writer
        .write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &block))
        .await
        .expect("send the request");
    let (mut status, mut body) = (None, Vec::new());
    while let Some(received) = connection.next(std::time::Duration::from_secs(5)).await {
        match received.kind {
            // `:status: 200` is the static table's entry 8, indexed: 0x88.
            HEADERS if received.stream == 1 => status = received.payload.first().copied(),
            DATA if received.stream == 1 => {
                body.extend_from_slice(&received.payload);
                if received.flags & END_STREAM != 0 {
                    break;
                }
            }
            _ => {}
        }
    }
    assert_eq!(status, Some(0x88), "HTTP/2 without :authority answers 200");
    let document: serde_json::Value = serde_json::from_slice(&body).expect("a JSON document");
    assert_eq!(names(&document), for_any_host, "HTTP/2 without :authority: {document}");
    assert_eq!(upstream.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_contract_path_empty_there_is_no_document() {
    let upstream = Upstream::start().await;
    let mut config = config(&upstream);
    config.server = "contract_path = \"\"".into();
    let proxy = config.start().await;
    let answer = send(proxy.addr(), "GET", "/.well-known/idempotency", &[], "").await;
    assert_eq!((answer.status.as_u16(), answer.problem().as_str()), (404, "no-route"));
    assert_eq!(upstream.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_problem_of_a_route_with_docs_links_them_and_names_its_slug_there() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let link = format!("<{DOCS}>; rel=\"describedby\"");
    let assert_documented = |response: &TestResponse, status: u16, slug: &str| {
        assert_eq!(response.status, status, "{response:?}");
        assert_eq!(response.header("link"), Some(link.as_str()), "{response:?}");
        assert_eq!(json(response)["type"], format!("{DOCS}#{slug}"), "{response:?}");
    };
    let missing = send(proxy.addr(), "POST", "/v1/payments", &[], "{}").await;
    assert_documented(&missing, 400, "missing-idempotency-key");
    let long = "k".repeat(256);
    let invalid = post_key(proxy.addr(), &long).await;
    assert_documented(&invalid, 400, "invalid-idempotency-key");
    assert_eq!(post_key(proxy.addr(), "doc-1").await.status, 201);
    let reused = send(
        proxy.addr(),
        "POST",
        "/v1/payments",
        &[("idempotency-key", "doc-1")],
        "{\"a\":1}",
    )
    .await;
    assert_documented(&reused, 422, "idempotency-key-reused");
    let held = tokio::spawn(send(
        proxy.addr(),
        "POST",
        "/v1/payments",
        &[("idempotency-key", "doc-2"), ("x-test-hold", "doc-2")],
        "{}",
    ));
    upstream.wait_for_key("doc-2").await;
    let in_flight = post_key(proxy.addr(), "doc-2").await;
    assert_documented(&in_flight, 409, "request-in-progress");
    upstream.release("doc-2");
    assert_eq!(held.await.expect("the first").status, 201);
    // A route without docs_url keeps the URN and sends no Link.
    let orders = send(
        proxy.addr(),
        "POST",
        "/v1/orders",
        &[("idempotency-key", &"k".repeat(256))],
        "{}",
    )
    .await;
    assert_eq!(orders.problem(), "invalid-idempotency-key");
    assert_eq!(orders.header("link"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_profile_answers_as_stripe_does() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let post = |key: Option<&'static str>, body: &'static str, extra: &'static [(&'static str, &'static str)]| {
        let addr = proxy.addr();
        async move {
            let mut headers: Vec<(&str, &str)> = key.map(|key| ("idempotency-key", key)).into_iter().collect();
            headers.extend_from_slice(extra);
            send(addr, "POST", "/v1/customers", &headers, body).await
        }
    };
    let error = |response: &TestResponse| json(response)["error"].clone();
    assert_eq!(post(Some("cus-1"), "name=a", &[]).await.status, 201);
    let reused = post(Some("cus-1"), "name=b", &[]).await;
    assert_eq!(reused.status, 400, "{reused:?}");
    assert_eq!(reused.header("content-type"), Some("application/json"));
    assert_eq!(error(&reused)["type"], "idempotency_error");
    assert_eq!(error(&reused)["code"], "idempotency_key_reused");
    assert!(
        error(&reused)["message"]
            .as_str()
            .is_some_and(|message| !message.is_empty())
    );
    let missing = post(None, "name=a", &[]).await;
    assert_eq!(missing.status, 400);
    assert_eq!(error(&missing)["type"], "invalid_request_error");
    let held = tokio::spawn(post(Some("cus-2"), "name=c", &[("x-test-hold", "cus-2")]));
    upstream.wait_for_key("cus-2").await;
    let in_flight = post(Some("cus-2"), "name=c", &[]).await;
    assert_eq!(in_flight.status, 409);
    assert_eq!(error(&in_flight)["type"], "idempotency_error");
    assert_eq!(error(&in_flight)["code"], "idempotency_key_in_use");
    upstream.release("cus-2");
    assert_eq!(held.await.expect("the first").status, 201);
}

/// An unknown outcome on a Stripe-profile route keeps what the contract publishes for
/// it: Stripe's `idempotency_error`, and beside it the operation and whether the probe
/// is reconciling it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_on_a_stripe_route_names_its_operation_and_reconciliation() {
    let upstream = Upstream::start().await;
    upstream.set_lookups(support::upstream::Lookups::Hold("stripe-lookup".into()));
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.upstream_timeout = "500ms".into();
    config.idempotency = "profile = \"stripe\"\n\
        reconcile = { path = \"/v1/payments/by-key/{key}\", first_after = \"100ms\", give_up_after = \"30s\" }"
        .into();
    let proxy = config.start().await;
    let headers = [("idempotency-key", "stripe-unknown"), ("x-test-hold", "forever")];
    let timed_out = send(proxy.addr(), "POST", "/v1/payments", &headers, "name=a").await;
    assert_eq!(timed_out.status, 504, "{timed_out:?}");
    assert_eq!(json(&timed_out)["error"]["type"], "api_error", "{timed_out:?}");
    upstream.wait_for_lookups(1).await;
    let retry = send(
        proxy.addr(),
        "POST",
        "/v1/payments",
        &[("idempotency-key", "stripe-unknown")],
        "name=a",
    )
    .await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.header("content-type"), Some("application/json"));
    let error = json(&retry)["error"].clone();
    assert_eq!(error["type"], "idempotency_error", "{error}");
    assert_eq!(error["code"], "outcome_unknown", "{error}");
    assert_eq!(error["reconciling"], true, "{error}");
    let operation = error["operation"].as_str().expect("the operation");
    assert!(
        operation.len() == 32 && operation.bytes().all(|byte| byte.is_ascii_hexdigit()),
        "{error}"
    );
    assert!(retry.header("retry-after").is_some(), "{retry:?}");
    upstream.release("stripe-lookup");
    assert_eq!(upstream.executions("stripe-unknown"), 1);
}

/// Runs `python3 -c script args…` and returns its stdout, failing with how to install
/// what it imports when it cannot.
fn python(script: &str, args: &[&str]) -> String {
    let output = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs (apt-get install python3)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("ModuleNotFoundError"),
        "{stderr}\ninstall the Python packages the tests use: python3 -m pip install stripe==16.1.0 openapi-spec-validator==0.8.5 (.ci/run does)"
    );
    assert!(output.status.success(), "python3 failed: {stderr}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripes_own_sdk_sees_its_idempotency_error_through_the_proxy() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let script = r#"
import sys
import stripe
stripe.api_key = "sk_test_idemproxy"
stripe.api_base = sys.argv[1]
stripe.max_network_retries = 0
first = stripe.Customer.create(name="ada", idempotency_key="sdk-1")
again = stripe.Customer.create(name="ada", idempotency_key="sdk-1")
headers = {name.lower(): value for name, value in again.last_response.headers.items()}
print("replayed", first["execution"] == again["execution"], headers.get("idempotent-replayed"))
try:
    stripe.Customer.create(name="grace", idempotency_key="sdk-1")
    print("no error")
except stripe.IdempotencyError as error:
    print("IdempotencyError", error.http_status, error.error.type)
try:
    stripe.Customer.create(name="ada", idempotency_key="k" * 256)
    print("no error")
except stripe.InvalidRequestError as error:
    print("InvalidRequestError", error.http_status, error.code)
"#;
    let url = format!("http://{}", proxy.addr());
    let out = tokio::task::spawn_blocking(move || python(script, &[&url]))
        .await
        .expect("the SDK script");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "replayed True true",
            "IdempotencyError 400 idempotency_error",
            "InvalidRequestError 400 invalid_idempotency_key",
        ],
        "{out}"
    );
    assert_eq!(upstream.total(), 1, "the SDK's customer was created once");
}

#[test]
fn the_contract_command_prints_a_valid_openapi_fragment_the_document_and_a_page() {
    let upstream_url = "http://127.0.0.1:9";
    let mut config = TestConfig::new(StoreKind::Memory, upstream_url);
    config.upstream_extra = format!("docs_url = {DOCS:?}");
    // Keys in the body, a form and the query as well: each an input of its own kind.
    config.extra_routes = format!(
        r#"
[[route]]
name = "transfers"
path_prefix = "/v1/transfers"
upstream = "{upstream_url}"

[route.idempotency]
key = ["json:/tenant&/order/id", "form:ref", "query:request_id", "header:Idempotency-Key", "body"]
dedup_window = "1m"
scope_headers = ["authorization"]
"#
    );
    let file = config.write_temp();
    let run = |format: &str| {
        let output = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["contract", "--config"])
            .arg(file.path())
            .args(["--format", format])
            .output()
            .expect("run idemproxy contract");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).expect("UTF-8")
    };
    let openapi = run("openapi");
    let fragment: serde_json::Value = serde_json::from_str(&openapi).expect("JSON");
    assert_eq!(fragment["openapi"], "3.1.0");
    let post = &fragment["paths"]["/v1/payments"]["post"];
    assert!(
        post["responses"]["409"]["description"]
            .as_str()
            .is_some_and(|text| text.contains("request-in-progress") && text.contains("outcome-unknown"))
    );
    assert_eq!(
        post["parameters"][0]["$ref"],
        "#/components/parameters/PaymentsIdempotencyKey"
    );
    let transfers = &fragment["paths"]["/v1/transfers"]["post"];
    assert_eq!(transfers["parameters"].as_array().map(Vec::len), Some(2), "{transfers}");
    let content = &transfers["requestBody"]["content"];
    assert!(
        content["application/json"]["schema"]["properties"]["order"]["properties"]["id"].is_object(),
        "{transfers}"
    );
    assert!(content["application/x-www-form-urlencoded"]["schema"]["properties"]["ref"].is_object());
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("fragment.json");
    std::fs::write(&path, &openapi).expect("write the fragment");
    let checked = python(
        "import json, sys\nfrom openapi_spec_validator import validate\nvalidate(json.load(open(sys.argv[1])))\nprint('valid')",
        &[path.to_str().expect("a UTF-8 path")],
    );
    assert_eq!(checked.trim(), "valid");
    // The validator refuses a broken fragment, so "valid" means something.
    let mut broken = fragment.clone();
    broken["paths"]["/v1/payments"]["post"]["responses"] = serde_json::json!("none");
    std::fs::write(&path, broken.to_string()).expect("write the broken fragment");
    let refused = Command::new("python3")
        .arg("-c")
        .arg("import json, sys\nfrom openapi_spec_validator import validate\nvalidate(json.load(open(sys.argv[1])))")
        .arg(&path)
        .output()
        .expect("python3");
    assert!(!refused.status.success(), "a broken fragment validated");

    let document: serde_json::Value = serde_json::from_str(&run("json")).expect("JSON");
    assert_eq!(names(&document), ["payments", "orders", "transfers"]);
    assert_eq!(document["routes"][2]["key"]["sources"][0], "json:/tenant&/order/id");
    let page = run("markdown");
    assert!(page.starts_with("# Idempotency"), "{page}");
    assert!(page.contains("| 409 | `request-in-progress` |"), "{page}");
    assert!(page.contains(&format!("<{DOCS}>")), "{page}");
    assert!(
        page.contains("- Key: the first of `json:/tenant&/order/id`, `form:ref`"),
        "{page}"
    );
}

/// A third party's reading of the contract: schemathesis (PyPI) generates requests
/// from the proxy's own OpenAPI fragment, sends them through the proxy, and checks that
/// every status, content type, header and problem body it gets back is one the
/// fragment documents. The same run against the fragment without its `default`
/// response (the upstream's own answers and their replays) fails, so the check bites.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_the_proxy_answering_as_its_own_fragment_says() {
    let upstream = Upstream::start().await;
    let config = TestConfig::new(StoreKind::Memory, &upstream.url());
    let file = config.write_temp();
    let proxy = support::ChildProxy::start(&config).await;
    let output = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["contract", "--config"])
        .arg(file.path())
        .args(["--format", "openapi"])
        .output()
        .expect("run idemproxy contract");
    assert!(output.status.success());
    let fragment: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let dir = tempfile::tempdir().expect("a directory");
    let run = |fragment: &serde_json::Value, name: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, fragment.to_string()).expect("write the fragment");
        let output = Command::new("schemathesis")
            .arg("run")
            .arg(&path)
            .args(["--url", &format!("http://{}", proxy.addr)])
            .args([
                "--checks",
                "status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,negative_data_rejection",
            ])
            .args(["--phases", "examples,coverage,fuzzing", "--max-examples", "30", "--seed", "7"])
            .current_dir(dir.path())
            .output()
            .unwrap_or_else(|error| {
                panic!("run schemathesis ({error}): python3 -m pip install schemathesis==4.32.5 (.ci/run does)")
            });
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let (passed, report) = run(&fragment, "fragment.json");
    assert!(
        passed,
        "schemathesis found the proxy answering otherwise than its fragment says:\n{report}"
    );
    let mut bare = fragment.clone();
    for operations in bare["paths"].as_object_mut().expect("paths").values_mut() {
        for operation in operations.as_object_mut().expect("operations").values_mut() {
            operation["responses"]
                .as_object_mut()
                .expect("responses")
                .remove("default");
        }
    }
    let (passed, report) = run(&bare, "bare.json");
    assert!(
        !passed,
        "without its default response the fragment should not pass:\n{report}"
    );
    assert!(report.contains("Undocumented status code"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_passes_against_the_proxy_and_fails_against_a_bare_upstream() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let run = |url: String| {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_idemproxy"))
                .args([
                    "conformance",
                    &url,
                    "--path",
                    "/v1/payments",
                    "--slow-path",
                    "/v1/payments/slow",
                ])
                .output()
                .expect("run idemproxy conformance")
        })
    };
    let through = run(format!("http://{}", proxy.addr())).await.expect("the run");
    let out = String::from_utf8_lossy(&through.stdout);
    assert!(through.status.success(), "{out}");
    let passed: Vec<&str> = out
        .lines()
        .filter(|line| line.trim_start().starts_with("pass"))
        .collect();
    assert_eq!(passed.len(), 8, "every case passes through the proxy:\n{out}");
    assert!(out.contains("8 passed, 0 failed, 0 could not tell"), "{out}");

    let bare = run(upstream.url()).await.expect("the run");
    let out = String::from_utf8_lossy(&bare.stdout);
    assert_eq!(bare.status.code(), Some(1), "{out}");
    for case in [
        "replay",
        "expiry header",
        "key reuse",
        "in-flight duplicate",
        "missing key",
        "over-long key",
        "key sent twice",
    ] {
        assert!(
            out.lines().any(|line| line.contains("FAIL") && line.contains(case)),
            "{case} should fail against the bare upstream:\n{out}"
        );
    }
    assert!(out.contains("the operation ran again"), "it says why:\n{out}");
}

/// `--key-from`: the cases send their key where the route takes it, a JSON field (the
/// key sent twice is the member written twice) or a query parameter, and all pass
/// through the proxy; a key in the header instead is not the route's key, so the first
/// use is refused and nothing can be told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_sends_its_key_where_the_route_takes_it() {
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.idempotency = r#"key = ["json:/payment/ref"]"#.into();
    config.extra_routes = format!(
        "[[route]]\nname = \"refs\"\npath_prefix = \"/v1/refs\"\nupstream = \"{}\"\n[route.idempotency]\nkey = [\"query:request_id\"]\n",
        upstream.url()
    );
    let proxy = config.start().await;
    let url = format!("http://{}", proxy.addr());
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_idemproxy"))
                .arg("conformance")
                .args(args)
                .output()
                .expect("run idemproxy conformance")
        })
    };
    for (path, source, body) in [
        ("/v1/payments", "json:/payment/ref", r#"{"amount":5}"#),
        ("/v1/refs", "query:request_id", "{}"),
    ] {
        let args = [
            url.as_str(),
            "--path",
            path,
            "--slow-path",
            &format!("{path}/slow"),
            "--key-from",
            source,
            "--body",
            body,
        ];
        let output = run(args.iter().map(ToString::to_string).collect())
            .await
            .expect("the run");
        let out = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{source}: {out}");
        assert!(out.contains("8 passed, 0 failed, 0 could not tell"), "{source}: {out}");
    }
    assert_eq!(
        upstream.total(),
        4,
        "per source, the first use and the first in-flight request ran, nothing else"
    );

    let header = run(vec![url.clone(), "--path".into(), "/v1/payments".into()])
        .await
        .expect("the run");
    let out = String::from_utf8_lossy(&header.stdout);
    assert!(
        out.lines()
            .any(|line| line.contains("could not tell") && line.contains("first use")),
        "a header key on a json: route: {out}"
    );

    let refused = run(vec![url, "--key-from".into(), "body".into()])
        .await
        .expect("the run");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no key to send"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
