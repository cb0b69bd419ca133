//! A real browser (docs/design.md §29): headless Chromium loads a page from one
//! origin whose script POSTs twice with one `Idempotency-Key` through the proxy, on
//! another origin, to the fake upstream, and reads `Idempotent-Replayed` from
//! `fetch()`. The page reports what it read to the server that served it; the test
//! reads that report, never a mock. The same page from an origin the route does not
//! list cannot send the key at all (the preflight is not allowed). Needs Debian's
//! `chromium` (`.ci/run` installs it).

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::{StoreKind, TestConfig, Upstream};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// The page: two keyed POSTs to the proxy, then what it read, POSTed home.
const PAGE: &str = r#"<!doctype html>
<html><body><script>
(async () => {
  const query = new URLSearchParams(location.search);
  const request = {
    method: "POST",
    headers: {"Content-Type": "application/json", "Idempotency-Key": query.get("key")},
    body: JSON.stringify({amount: 5}),
  };
  const seen = [];
  try {
    for (let i = 0; i < 2; i++) {
      const response = await fetch(query.get("target"), request);
      seen.push({
        status: response.status,
        replayed: response.headers.get("Idempotent-Replayed"),
        expires: response.headers.get("Idempotency-Expires"),
        body: await response.text(),
      });
    }
  } catch (error) {
    seen.push({error: String(error)});
  }
  await fetch("/result", {method: "POST", body: JSON.stringify(seen)});
})();
</script></body></html>"#;

/// The page's own origin: serves the page, and sends on each report it gets.
async fn page_server(reports: mpsc::Sender<String>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the page server");
    let addr = listener.local_addr().expect("its address");
    let reports = Arc::new(reports);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let reports = reports.clone();
            let service = service_fn(move |request: Request<Incoming>| {
                let reports = reports.clone();
                async move {
                    let path = request.uri().path().to_string();
                    let body = request
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    if path == "/result" {
                        let _ = reports.send(String::from_utf8_lossy(&body).into_owned()).await;
                        return Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())));
                    }
                    let mut response = Response::new(Full::new(Bytes::from_static(PAGE.as_bytes())));
                    response
                        .headers_mut()
                        .insert("content-type", "text/html; charset=utf-8".parse().expect("a value"));
                    Ok(response)
                }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Debian's `chromium`, or the same browser under another name.
fn chromium() -> String {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(name)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return name.to_string();
        }
    }
    panic!("no chromium on PATH: install Debian's chromium (apt-get install chromium), as .ci/run does");
}

/// Headless Chromium on `url`, with a profile of its own (removed after it); killed
/// when dropped.
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn open(url: &str) -> Browser {
        let profile = tempfile::tempdir().expect("a profile directory");
        let child = Command::new(chromium())
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
            ])
            .args([
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(url)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromium");
        Browser {
            child,
            _profile: profile,
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the page read: one entry per `fetch`, or the error that stopped it.
async fn report(reports: &mut mpsc::Receiver<String>) -> Vec<serde_json::Value> {
    let text = tokio::time::timeout(Duration::from_secs(60), reports.recv())
        .await
        .expect("the page reported within 60 s")
        .expect("a report");
    serde_json::from_str(&text).unwrap_or_else(|_| panic!("a JSON report: {text}"))
}

#[tokio::test]
async fn a_browser_on_an_allowed_origin_sends_a_key_and_reads_the_replay() {
    let upstream = Upstream::start().await;
    let (sender, mut reports) = mpsc::channel(4);
    let allowed = page_server(sender.clone()).await;
    let other = page_server(sender).await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.upstream_extra = format!("[route.cors]\nallow_origins = [\"http://{allowed}\"]\n");
    let proxy = config.start().await;
    let target = format!("http://{}/v1/payments", proxy.addr());

    let _browser = Browser::open(&format!("http://{allowed}/page?key=browser-1&target={target}"));
    let seen = report(&mut reports).await;
    assert_eq!(seen.len(), 2, "two answers read: {seen:?}");
    assert_eq!(seen[0]["status"], 201, "{seen:?}");
    assert_eq!(
        seen[0]["replayed"],
        serde_json::Value::Null,
        "the first is not a replay: {seen:?}"
    );
    assert_eq!(seen[1]["status"], 201, "{seen:?}");
    assert_eq!(seen[1]["replayed"], "true", "the page reads the replay: {seen:?}");
    assert!(
        seen[1]["expires"].is_string(),
        "Idempotency-Expires is exposed: {seen:?}"
    );
    assert_eq!(seen[0]["body"], seen[1]["body"], "the same answer");
    assert_eq!(upstream.executions("browser-1"), 1, "one execution upstream");
    assert_eq!(upstream.total(), 1, "the preflights stopped at the proxy");

    // The same page from an origin the route does not list: the browser's preflight
    // is not allowed, so the keyed POST is never sent.
    let _browser = Browser::open(&format!("http://{other}/page?key=browser-2&target={target}"));
    let seen = report(&mut reports).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen[0]["error"]
            .as_str()
            .is_some_and(|error| error.contains("Failed to fetch")),
        "{seen:?}"
    );
    assert_eq!(upstream.executions("browser-2"), 0);
    assert_eq!(upstream.total(), 1);
}
