//! The guard and the upstream see the same request (docs/design.md §3, issue 27): a path
//! spelled otherwise than a guarded route's (dot segments, slash runs, encodings,
//! letter case, parameters), a method in another case, and a second, missing,
//! invalid or conflicting `Host` are each guarded under the canonical request or
//! refused, never forwarded unguarded. Raw bytes over real sockets where a client
//! library would normalise for us, and HTTP/2 as well.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use support::client::metric;
use support::{StoreKind, TestConfig, Upstream, send_raw};

/// The probe's layout: the guarded `payments` route beside an unguarded catch-all to
/// the same upstream, and a guarded route on one host only.
fn config(upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.extra_routes = format!(
        r#"
[[route]]
name = "open"
path_prefix = "/"
upstream = "{upstream}"

[[route]]
name = "hosted"
host = "pay.example"
path_prefix = "/v2/pay"
upstream = "{upstream}"

[route.idempotency]
retention = "1h"
"#,
        upstream = upstream.url()
    );
    config
}

/// The status of a raw HTTP/1.1 answer and its problem slug, if it is a problem.
fn answer(raw: &str) -> (u16, String) {
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {raw:?}"));
    let slug = raw
        .split("\r\n\r\n")
        .nth(1)
        .and_then(|body| serde_json::from_str::<serde_json::Value>(body).ok())
        .and_then(|body| body["type"].as_str().map(str::to_string))
        .map(|kind| kind.trim_start_matches("urn:idemproxy:problem:").to_string())
        .unwrap_or_default();
    (status, slug)
}

/// `method path` over HTTP/1.1 with `head` lines and an empty JSON body, on a fresh
/// connection: the answer's status and slug.
async fn raw(addr: SocketAddr, method: &str, path: &str, head: &str) -> (u16, String) {
    let request = format!("{method} {path} HTTP/1.1\r\n{head}content-length: 2\r\nconnection: close\r\n\r\n{{}}");
    answer(&send_raw(addr, request.as_bytes(), Duration::from_secs(5)).await)
}

/// The same over HTTP/2 (prior knowledge), the path as given.
async fn h2(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2c handshake");
    tokio::spawn(connection);
    let mut request = http::Request::builder()
        .method(method)
        .uri(format!("http://localhost:{}{path}", addr.port()));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(bytes::Bytes::from_static(b"{}")))
        .expect("request");
    let response = sender.send_request(request).await.expect("an h2 answer");
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    let slug = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|body| body["type"].as_str().map(str::to_string))
        .map(|kind| kind.trim_start_matches("urn:idemproxy:problem:").to_string())
        .unwrap_or_default();
    (status, slug)
}

/// The path the upstream is sent is the canonical one the guard decided on, byte for
/// byte: a trailing dot segment leaves its directory's slash, and with
/// `escaped_slashes = "keep"` an encoded slash stays encoded (never a separator
/// upstream). Over a real socket, as the upstream logs it.
#[tokio::test]
async fn the_upstream_is_sent_the_canonical_path() {
    let upstream = Upstream::start().await;
    let default = config(&upstream).start().await;
    let mut keep = config(&upstream);
    keep.server = "escaped_slashes = \"keep\"\nmerge_slashes = false".into();
    let keep = keep.start().await;
    let cases = [
        (default.addr(), "/v1/reads/a/b/..", "/v1/reads/a/"),
        (default.addr(), "/v1/reads/a/b/.", "/v1/reads/a/b/"),
        (default.addr(), "/v1/reads/a/./b/../c", "/v1/reads/a/c"),
        (default.addr(), "/v1//reads/x", "/v1/reads/x"),
        (keep.addr(), "/v1/reads/a%2Fb", "/v1/reads/a%2Fb"),
        (keep.addr(), "/v1/reads/a%2fb/..", "/v1/reads/"),
        (keep.addr(), "/v1/reads//a", "/v1/reads//a"),
    ];
    for (n, (addr, sent, forwarded)) in cases.iter().enumerate() {
        let request = format!("GET {sent} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
        let raw = send_raw(*addr, request.as_bytes(), Duration::from_secs(5)).await;
        assert_eq!(answer(&raw).0, 201, "{sent}: {raw}");
        let log = upstream.log();
        assert_eq!(log.len(), n + 1, "{sent}");
        assert_eq!(log[n].path, *forwarded, "{sent} was forwarded as {}", log[n].path);
    }
}

/// Escapes that do not decode to UTF-8, such as the overlong spellings of `.` and `/`
/// (`%C0%AE`, `%E0%80%AE`, `%C0%AF`) that lenient decoders read as dot segments or
/// slashes, are refused before routing, even on an unguarded catch-all; UTF-8 that is
/// well formed passes, encoded as sent.
#[tokio::test]
async fn escapes_that_are_not_utf8_are_refused_even_unguarded() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    for path in [
        "/open/%C0%AE%C0%AE/v1/payments",
        "/open/%E0%80%AE%E0%80%AE/v1/payments",
        "/open%C0%AFv1/payments",
    ] {
        assert_eq!(
            raw(proxy.addr(), "GET", path, "host: localhost\r\n").await,
            (400, "invalid-path".to_string()),
            "{path}"
        );
    }
    assert_eq!(upstream.total(), 0, "none reached the upstream");
    let (status, _) = raw(proxy.addr(), "GET", "/open/caf%C3%A9", "host: localhost\r\n").await;
    assert_eq!(status, 201);
    assert_eq!(upstream.log()[0].path, "/open/caf%C3%A9");
}

/// The probe's spellings of the guarded path, none with an idempotency key: each is
/// guarded (400 for the missing key) or refused as a path, over HTTP/1.1 and HTTP/2,
/// and the upstream sees none of them.
#[tokio::test]
async fn differently_spelled_paths_never_pass_the_guard() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let addr = proxy.addr();
    let guarded = ("missing-idempotency-key", "invalid-path");
    for path in [
        "/open/../v1/payments",
        "/v1/./payments",
        "/open/%2e%2e/v1/payments",
        "/open/%2E%2E/v1/payments",
        "//v1/payments",
        "/v1//payments",
        "/%761/payments",
        "/v1/%70ayments",
        "/v1/payments;x",
        "/v1/payments/.",
        "/v1/payments%2F",
        "/v1%2Fpayments",
        "/V1/PAYMENTS",
        "/v1/Payments",
    ] {
        for (protocol, (status, slug)) in [
            ("HTTP/1.1", raw(addr, "POST", path, "host: localhost\r\n").await),
            ("HTTP/2", h2(addr, "POST", path, &[]).await),
        ] {
            assert_eq!(status, 400, "{protocol} POST {path}: {slug}");
            assert!(slug == guarded.0 || slug == guarded.1, "{protocol} POST {path}: {slug}");
        }
    }
    assert_eq!(
        upstream.total(),
        0,
        "a spelling reached the upstream unguarded: {:?}",
        upstream.log()
    );

    // The canonical request is what is guarded and what the upstream gets.
    let (status, _) = raw(
        addr,
        "POST",
        "/v1/./x/../payments",
        "host: localhost\r\nidempotency-key: k1\r\n",
    )
    .await;
    assert_eq!(status, 201);
    assert_eq!(upstream.log()[0].path, "/v1/payments");
    // A retry spelled otherwise is the same request: replayed, not run again.
    let retry = raw(
        addr,
        "POST",
        "//v1/%70ayments",
        "host: localhost\r\nidempotency-key: k1\r\n",
    )
    .await;
    assert_eq!((retry.0, upstream.executions("k1")), (201, 1));
    // And the catch-all still passes what it should.
    assert_eq!(raw(addr, "POST", "/open/x", "host: localhost\r\n").await.0, 201);
    assert_eq!(upstream.total(), 2);
}

/// A method that equals a guarded one but for letter case is refused, never passed:
/// some upstreams read `post` as POST.
#[tokio::test]
async fn a_guarded_method_in_another_case_is_refused() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let addr = proxy.addr();
    for method in ["post", "Post", "pOST", "patch"] {
        assert_eq!(
            raw(addr, method, "/v1/payments", "host: localhost\r\n").await,
            (400, "invalid-method".into()),
            "HTTP/1.1 {method}"
        );
        assert_eq!(
            h2(addr, method, "/v1/payments", &[]).await,
            (400, "invalid-method".into()),
            "HTTP/2 {method}"
        );
    }
    assert_eq!(upstream.total(), 0);
    // Methods the route does not guard pass in any case, as before.
    assert_eq!(raw(addr, "get", "/v1/payments", "host: localhost\r\n").await.0, 201);
}

/// RFC 9112 §3.2: an HTTP/1.1 request without `Host`, with two, or with one that is
/// not a host and port is a 400, and `X-Forwarded-Host` only ever carries a
/// validated authority.
#[tokio::test]
async fn one_valid_host_or_400() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let addr = proxy.addr();
    for head in [
        "",
        "host: a.example\r\nhost: b.example\r\n",
        "host: a.example, b.example\r\n",
        "host: user@a.example\r\n",
        "host: a.example/x\r\n",
        "host: a.example:99999999\r\n",
    ] {
        for path in ["/open/x", "/v1/reads/x"] {
            assert_eq!(
                raw(addr, "GET", path, head).await,
                (400, "invalid-host".into()),
                "{head:?} {path}"
            );
        }
    }
    assert_eq!(upstream.total(), 0);
    let (status, _) = raw(addr, "GET", "/open/x", "host: a.example:8080\r\n").await;
    assert_eq!(status, 201);
    let seen = &upstream.log()[0].headers;
    assert_eq!(
        seen.get("x-forwarded-host").map(|v| v.as_bytes()),
        Some(&b"a.example:8080"[..])
    );
    assert_eq!(seen.get_all("x-forwarded-host").iter().count(), 1);
}

/// An absolute-form target routes by its own authority, not by `Host` (RFC 9112
/// §3.2.2), and `X-Forwarded-Host` carries that authority.
#[tokio::test]
async fn an_absolute_form_target_routes_by_its_authority() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let addr = proxy.addr();
    // Guarded on pay.example: routed there by the target, not by `Host`.
    assert_eq!(
        raw(addr, "POST", "http://pay.example/v2/pay", "host: other.example\r\n").await,
        (400, "missing-idempotency-key".into())
    );
    let (status, _) = raw(
        addr,
        "POST",
        "http://pay.example/v2/pay",
        "host: other.example\r\nidempotency-key: abs-1\r\n",
    )
    .await;
    assert_eq!(status, 201);
    let seen = &upstream.log()[0];
    assert_eq!(seen.path, "/v2/pay");
    assert_eq!(
        seen.headers.get("x-forwarded-host").map(|v| v.as_bytes()),
        Some(&b"pay.example"[..])
    );
    // A trailing dot names the same host.
    assert_eq!(
        raw(addr, "POST", "/v2/pay", "host: pay.example.\r\n").await,
        (400, "missing-idempotency-key".into())
    );
}

/// On HTTP/2 a `host` that disagrees with `:authority` is refused (it used to win for
/// routing and `X-Forwarded-Host`).
#[tokio::test]
async fn an_http2_host_that_disagrees_with_the_authority_is_refused() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let addr = proxy.addr();
    // `:authority` is `localhost:PORT`; a `host` naming pay.example disagrees.
    assert_eq!(
        h2(addr, "POST", "/v2/pay", &[("host", "pay.example")]).await,
        (400, "invalid-host".into())
    );
    let before = upstream.total();
    assert_eq!(
        h2(addr, "GET", "/open/x", &[("host", "elsewhere.example")]).await.0,
        400
    );
    assert_eq!(upstream.total(), before);
}

/// A request body with broken chunked framing on an unguarded route is the client's
/// error (400, counted as rejected), as it is on a guarded one, not an upstream
/// failure.
#[tokio::test]
async fn broken_framing_on_an_unguarded_route_is_the_clients_fault() {
    let upstream = Upstream::start().await;
    let proxy = config(&upstream).start().await;
    let addr = proxy.addr();
    for (route, path) in [("open", "/open/x"), ("payments", "/v1/payments")] {
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: localhost\r\nidempotency-key: chunky\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{{}}\r\nzz\r\n"
        );
        let answered = answer(&send_raw(addr, request.as_bytes(), Duration::from_secs(5)).await);
        assert_eq!(answered, (400, "request-body-incomplete".into()), "{route}");
        let rejected = format!("idemproxy_requests_total{{route=\"{route}\",outcome=\"rejected\"}}");
        let failed = format!("idemproxy_requests_total{{route=\"{route}\",outcome=\"upstream_error\"}}");
        assert_eq!(metric(proxy.admin(), &rejected).await, Some(1.0), "{route}");
        assert_eq!(metric(proxy.admin(), &failed).await, Some(0.0), "{route}");
    }
}

/// A spelling of a guarded path: dot segments, slash runs, escapes of unreserved
/// characters in either hex case, letter case, `;` parameters and escaped slashes,
/// drawn at random, with the method in any case.
fn spelling() -> impl Strategy<Value = (String, String)> {
    let segment = |name: &'static str| {
        proptest::collection::vec((any::<bool>(), any::<bool>(), any::<bool>()), name.len()).prop_map(move |flips| {
            name.chars()
                .zip(flips)
                .map(|(c, (encode, lower_hex, upper))| match (encode, upper) {
                    (true, _) if lower_hex => format!("%{:02x}", u32::from(c)),
                    (true, _) => format!("%{:02X}", u32::from(c)),
                    (false, true) => c.to_ascii_uppercase().to_string(),
                    (false, false) => c.to_string(),
                })
                .collect::<String>()
        })
    };
    let filler = prop_oneof![
        Just(String::new()),
        Just("/".to_string()),
        Just("/.".to_string()),
        Just("/x/..".to_string()),
        Just("/%2e".to_string()),
        Just("/x/%2E%2e".to_string()),
        Just("//".to_string()),
    ];
    let end = prop_oneof![
        Just(String::new()),
        Just("/".to_string()),
        Just("/.".to_string()),
        Just(";p=1".to_string()),
        Just("%2F".to_string()),
        Just("%2f/x".to_string()),
        Just("/x/..".to_string()),
    ];
    let method = proptest::collection::vec(any::<bool>(), 4).prop_map(|upper| {
        "post"
            .chars()
            .zip(upper)
            .map(|(c, up)| if up { c.to_ascii_uppercase() } else { c })
            .collect::<String>()
    });
    (filler.clone(), segment("v1"), filler, segment("payments"), end, method)
        .prop_map(|(a, v1, b, payments, end, method)| (format!("{a}/{v1}{b}/{payments}{end}"), method))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// No spelling in the family reaches the upstream unguarded: each is guarded (400
    /// for the missing key) or refused (400).
    #[test]
    fn no_spelling_of_a_guarded_path_reaches_the_upstream_unguarded((path, method) in spelling()) {
        let runtime = RUNTIME.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a runtime")
        });
        let (upstream, addr) = runtime.block_on(async {
            let mut shared = SHARED.lock().await;
            if shared.is_none() {
                let upstream = Upstream::start().await;
                let proxy = config(&upstream).start().await;
                *shared = Some((upstream, proxy));
            }
            let (upstream, proxy) = shared.as_ref().expect("started");
            (upstream.clone(), proxy.addr())
        });
        let (status, slug) = runtime.block_on(raw(addr, &method, &path, "host: localhost\r\n"));
        prop_assert_eq!(status, 400, "{} {}: {}", method, path, slug);
        prop_assert!(
            ["missing-idempotency-key", "invalid-path", "invalid-method"].contains(&slug.as_str()),
            "{} {}: {}", method, path, slug
        );
        prop_assert_eq!(upstream.total(), 0, "{} {} reached the upstream", method, path);
    }
}

static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
static SHARED: tokio::sync::Mutex<Option<(Upstream, support::ProxyHandle)>> = tokio::sync::Mutex::const_new(None);
