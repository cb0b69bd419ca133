//! The access log (docs/design.md §8), read back line by line from the binary's own output in
//! both log formats: one line per request, with no raw key, query or header value.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use support::{ChildProxy, StoreKind, TestConfig, TestResponse, Upstream, send};

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

/// Under the Stripe profile a reused key is answered 400, not 422 (problem.rs, the
/// profile's status): the proxy's own line about the problem names the status the
/// client got, as the access line does, never the IETF one.
#[tokio::test]
async fn a_problem_is_logged_with_the_status_its_profile_answered() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.idempotency = "profile = \"stripe\"".into();
    config.server = "access_log = true".into();
    let log = dir.path().join("proxy.log");
    let proxy = ChildProxy::start_logged(&config, &log, &[]).await;
    let post = |body: &'static str| send(proxy.addr, "POST", "/v1/payments", &[("idempotency-key", "k-1")], body);
    assert_eq!(post("{\"amount\":1}").await.status, 201);
    let reused = post("{\"amount\":2}").await;
    assert_eq!(reused.status, 400, "{reused:?}");
    // The access line is written once the response is sent: the problem line before it.
    let access = access_lines(&log, 2, parse_text).await;
    assert_eq!(access[1].status, 400);
    let problem = support::proxy::log_line(&log, "problem response");
    assert!(problem.contains("status=400"), "{problem}");
}
