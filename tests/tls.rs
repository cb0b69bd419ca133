//! TLS on the listener and to the upstream (docs/design.md §7), with a private CA made in the
//! test: HTTP/1.1 and HTTP/2 chosen by ALPN, client certificates required and refused,
//! handshakes that never finish or are not TLS at all, and an HTTPS upstream verified
//! against a private CA, end to end.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use support::pki::{Issued, Pki, acceptor, localhost};
use support::{StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

fn tls_lines(server: &Issued, client_ca: Option<&Pki>) -> String {
    let mut lines = format!(
        "header_read_timeout = \"1s\"\n[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        server.cert_file.display(),
        server.key_file.display()
    );
    if let Some(ca) = client_ca {
        lines.push_str(&format!("client_ca_file = \"{}\"\n", ca.ca_file.display()));
    }
    lines
}

/// One request over TLS, with HTTP/1.1 or HTTP/2 as ALPN chose; returns the answer and
/// the protocol the server picked.
async fn https(
    addr: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
    headers: &[(&str, &str)],
) -> Result<(TestResponse, String), Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(addr).await?;
    let tls = connector.connect(localhost(), stream).await?;
    let alpn = String::from_utf8_lossy(tls.get_ref().1.alpn_protocol().unwrap_or_default()).into_owned();
    let io = hyper_util::rt::TokioIo::new(tls);
    let mut request = http::Request::post(format!("https://localhost:{}/v1/payments", addr.port()));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from_static(b"{}")))?;
    let response = if alpn == "h2" {
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await?;
        tokio::spawn(connection);
        sender.send_request(request).await?
    } else {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(connection);
        sender.send_request(request).await?
    };
    let (parts, body) = response.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok((
        TestResponse {
            status: parts.status,
            headers: parts.headers,
            body,
        },
        alpn,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_and_http2_over_tls_are_guarded_and_replayed() {
    let pki = Pki::new("proxy CA");
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = tls_lines(&pki.server(), None);
    let proxy = config.start().await;
    for (protocol, key) in [("http/1.1", "tls-h1"), ("h2", "tls-h2")] {
        let connector = pki.connector(&[protocol], None);
        let headers = [("idempotency-key", key)];
        let (first, alpn) = https(proxy.addr(), &connector, &headers).await.expect("first");
        let (replay, _) = https(proxy.addr(), &connector, &headers).await.expect("replay");
        assert_eq!(alpn, protocol, "ALPN");
        assert_eq!(first.status, 201);
        assert!(!first.replayed() && replay.replayed(), "{protocol}: {replay:?}");
        assert_eq!(first.body, replay.body);
        assert_eq!(upstream.executions(key), 1);
    }
    let seen = upstream.log();
    assert!(
        seen.iter()
            .all(|execution| execution.headers.get("x-forwarded-proto").map(|v| v.as_bytes()) == Some(b"https")),
        "X-Forwarded-Proto must say https"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_with_a_valid_certificate_get_through() {
    let pki = Pki::new("proxy CA");
    let clients = Pki::new("client CA");
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = tls_lines(&pki.server(), Some(&clients));
    let proxy = config.start().await;

    let valid = clients.client("alice", false);
    let (response, _) = https(
        proxy.addr(),
        &pki.connector(&["http/1.1"], Some(&valid)),
        &[("idempotency-key", "mtls")],
    )
    .await
    .expect("a valid client certificate is accepted");
    assert_eq!(response.status, 201);

    let refused = [
        ("no certificate", None),
        ("an expired certificate", Some(clients.client("mallory", true))),
        ("a certificate another CA signed", Some(pki.client("eve", false))),
        ("a self-signed certificate", Some(clients.self_signed_client())),
    ];
    for (what, identity) in refused {
        let connector = pki.connector(&["http/1.1"], identity.as_ref());
        let attempt = https(proxy.addr(), &connector, &[("idempotency-key", "refused")]).await;
        assert!(attempt.is_err(), "{what} got through: {attempt:?}");
    }
    assert_eq!(
        upstream.executions("refused"),
        0,
        "a refused client reached the upstream"
    );
    // The client learns of its refusal from the alert, a moment before the server
    // counts it: wait for the count, not for the client.
    support::client::until_metric(proxy.admin(), "idemproxy_tls_handshakes_failed_total", 4.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_that_never_finishes_is_closed_by_the_deadline() {
    let pki = Pki::new("proxy CA");
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = tls_lines(&pki.server(), None);
    let proxy = config.start().await;
    // The first bytes of a ClientHello, then nothing; and nothing at all.
    let mut partial = TcpStream::connect(proxy.addr()).await.expect("connect");
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .expect("write");
    let silent = TcpStream::connect(proxy.addr()).await.expect("connect");
    let started = Instant::now();
    for mut stream in [partial, silent] {
        let mut buffer = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(3), async {
            loop {
                match stream.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "an unfinished handshake was still open after 3 s");
    }
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_millis(2500), "closed after {elapsed:?}");
    println!("unfinished handshakes closed {elapsed:.2?} after they opened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_client_hello_costs_only_the_socket() {
    let pki = Pki::new("proxy CA");
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.server = tls_lines(&pki.server(), None);
    let proxy = config.start().await;
    for garbage in [
        &b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nidempotency-key: plain\r\n\r\n"[..],
        &[0xff; 512][..],
    ] {
        let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
        stream.write_all(garbage).await.expect("write");
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut answer)).await;
        assert!(
            !String::from_utf8_lossy(&answer).contains("HTTP/1.1"),
            "answered in plain text"
        );
    }
    assert_eq!(upstream.total(), 0);
    // Real clients are still served.
    let (response, _) = https(
        proxy.addr(),
        &pki.connector(&["http/1.1"], None),
        &[("idempotency-key", "after")],
    )
    .await
    .expect("a TLS client after the garbage");
    assert_eq!(response.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_with_a_private_ca_works_end_to_end() {
    let pki = Pki::new("upstream CA");
    let upstream = Upstream::start_tls(acceptor(&pki.server())).await;
    // Without the CA, the upstream's certificate is not trusted: nothing was sent.
    let untrusted = TestConfig::new(StoreKind::Memory, &upstream.https_url()).start().await;
    let refused = support::post_key(untrusted.addr(), "private").await;
    assert_eq!(
        (refused.status.as_u16(), refused.problem()),
        (502, "upstream-unavailable".into())
    );
    assert_eq!(upstream.total(), 0);

    let mut config = TestConfig::new(StoreKind::Memory, &upstream.https_url());
    config.upstream_extra = format!("upstream_ca_file = \"{}\"", pki.ca_file.display());
    let proxy = config.start().await;
    let first = support::post_key(proxy.addr(), "private").await;
    let replay = support::post_key(proxy.addr(), "private").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.executions("private"), 1);
    let pass = send(proxy.addr(), "GET", "/v1/payments/1", &[], "").await;
    assert_eq!(pass.status, 201, "pass-through over HTTPS too");
}

#[tokio::test]
async fn bad_tls_files_are_named_by_their_field() {
    let pki = Pki::new("proxy CA");
    let server = pki.server();
    let other = pki.server();
    let route = "[[route]]\nname = \"r\"\npath_prefix = \"/\"\nupstream = \"http://127.0.0.1:9\"\n";
    let tls = |cert: &std::path::Path, key: &std::path::Path, ca: Option<&std::path::Path>| {
        let mut text = format!(
            "[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            cert.display(),
            key.display()
        );
        if let Some(ca) = ca {
            text.push_str(&format!("client_ca_file = \"{}\"\n", ca.display()));
        }
        format!("{text}{route}")
    };
    let missing = std::path::Path::new("/nonexistent/cert.pem");
    for (text, needle) in [
        (
            tls(missing, &server.key_file, None),
            "t.toml:2: server.tls.cert_file: cannot read /nonexistent/cert.pem",
        ),
        (
            tls(&server.key_file, &server.key_file, None),
            "t.toml:2: server.tls.cert_file:",
        ),
        (
            tls(&server.cert_file, &server.cert_file, None),
            "t.toml:3: server.tls.key_file:",
        ),
        (
            tls(&server.cert_file, &other.key_file, None),
            "t.toml:3: server.tls.key_file:",
        ),
        (
            tls(&server.cert_file, &server.key_file, Some(missing)),
            "t.toml:4: server.tls.client_ca_file:",
        ),
    ] {
        let error = idemproxy::Config::parse(&text, std::path::Path::new("t.toml")).expect_err("refused");
        assert!(error.to_string().contains(needle), "{needle:?} not in {error}");
    }
    let upstream_ca = format!("{route}upstream_ca_file = \"/nonexistent/ca.pem\"\n");
    let error = idemproxy::Config::parse(&upstream_ca, std::path::Path::new("t.toml")).expect_err("refused");
    assert!(
        error
            .to_string()
            .contains("t.toml:5: route[0].upstream_ca_file: cannot read"),
        "{error}"
    );
}
