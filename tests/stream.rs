//! Streamed responses, recorded as they pass (docs/design.md §25): the first client
//! gets each event as the upstream sends it, on HTTP/1.1 and HTTP/2 and on every store;
//! a retry replays the recorded body byte for byte; a broken stream is never replayed;
//! a client that leaves does not stop the recording; waiting retries join the live
//! stream; `stream = "never"` buffers as before; the byte budget holds under many
//! stalled streams. Each race is driven by the fake upstream, which sends the first
//! event and holds the rest until the test releases it.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::client::{metric, post};
use support::{RedisServer, StoreKind, TestConfig, Upstream};

/// Five events, the first sent at once and the rest held at gate `gate`.
fn held_stream(gate: &str) -> Vec<(&'static str, String)> {
    vec![("x-test-stream", "5".into()), ("x-test-stream-hold", gate.into())]
}

/// How long a step that should be immediate may take before the test says it hung.
const STEP: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug)]
enum Version {
    Http1,
    Http2,
    /// HTTP/2 with a 4 KiB stream window: a client that does not read holds the proxy
    /// to what the window allows, as a slow reader on a real network does.
    Http2Narrow,
}

/// A response whose head has arrived, its body still to read frame by frame.
struct Streaming {
    response: Response<Incoming>,
    /// Keeps the connection's task alive with the response.
    _connection: tokio::task::JoinHandle<()>,
}

impl Streaming {
    /// Opens a connection and sends `POST /v1/payments` with `key` and `extra`.
    async fn open(addr: SocketAddr, version: Version, key: &str, extra: &[(&str, String)]) -> Streaming {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect to the proxy");
        let io = TokioIo::new(stream);
        let mut request = Request::post(format!("http://{addr}/v1/payments")).header("idempotency-key", key);
        for (name, value) in extra {
            request = request.header(*name, value.as_str());
        }
        let request = request.body(Full::new(Bytes::from_static(b"{}"))).expect("a request");
        let (response, connection) = match version {
            Version::Http1 => {
                let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await.expect("handshake");
                let connection = tokio::spawn(async move {
                    let _ = connection.await;
                });
                (within(sender.send_request(request)).await, connection)
            }
            Version::Http2 | Version::Http2Narrow => {
                let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
                if let Version::Http2Narrow = version {
                    builder.initial_stream_window_size(4096);
                }
                let (mut sender, connection) = builder.handshake(io).await.expect("handshake");
                let connection = tokio::spawn(async move {
                    let _ = connection.await;
                });
                (within(sender.send_request(request)).await, connection)
            }
        };
        let response = response.expect("a response head");
        Streaming {
            response,
            _connection: connection,
        }
    }

    fn status(&self) -> StatusCode {
        self.response.status()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.response.headers().get(name).and_then(|value| value.to_str().ok())
    }

    /// The next chunk of the body: `None` at its end; a panic if it broke or hung.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            let frame = tokio::time::timeout(STEP, self.response.body_mut().frame())
                .await
                .expect("the next chunk within the step")?;
            if let Ok(data) = frame.expect("a chunk, not a broken stream").into_data() {
                return Some(data);
            }
        }
    }

    /// The rest of the body, or the error it broke with.
    async fn rest(mut self) -> Result<Bytes, String> {
        let mut body = BytesMut::new();
        loop {
            let frame = tokio::time::timeout(STEP, self.response.body_mut().frame())
                .await
                .expect("the rest within the step");
            match frame {
                None => return Ok(body.freeze()),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        body.extend_from_slice(&data);
                    }
                }
                Some(Err(error)) => return Err(error.to_string()),
            }
        }
    }
}

/// `future`'s output, or a panic if it takes longer than a step: a head that waits for
/// the whole body fails the test rather than hanging it.
async fn within<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, future).await.expect("within the step")
}

fn event(execution: &str, index: usize) -> String {
    format!("data: {{\"execution\":{execution},\"event\":{index}}}\n\n")
}

/// The whole stream a reader got: the first event, read on its own, and `rest`.
fn after_first(execution: &str, rest: &[u8]) -> String {
    format!("{}{}", event(execution, 0), String::from_utf8_lossy(rest))
}

fn events(execution: &str, count: usize) -> String {
    (0..count).map(|index| event(execution, index)).collect()
}

fn streaming_config(store: StoreKind, upstream: &Upstream, extra: &str) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.idempotency = extra.to_string();
    config
}

/// The first event reaches the client while the upstream holds the other four; the
/// rest follows on release; the record completes with all five, and a retry replays
/// them byte for byte; the upstream ran once.
async fn the_first_event_arrives_while_the_rest_is_held(store: StoreKind, version: Version) {
    let upstream = Upstream::start().await;
    let proxy = streaming_config(store, &upstream, "").start().await;
    let addr = proxy.addr();
    let key = format!("s1-{version:?}");
    let mut first = Streaming::open(addr, version, &key, &held_stream("s1")).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.header("content-type"), Some("text/event-stream"));
    assert_eq!(first.header("content-length"), None);
    assert!(first.header("idempotency-expires").is_some());
    let execution = first.header("x-execution-id").expect("the execution id").to_string();
    let chunk = first.next().await.expect("the first event");
    assert_eq!(chunk, event(&execution, 0), "the first event, while the rest is held");
    upstream.release("s1");
    let rest = first.rest().await.expect("the rest of the stream");
    let whole = after_first(&execution, &rest);
    assert_eq!(whole, events(&execution, 5));

    let retry = post(addr, Some(&key), "{}", &[]).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(
        retry.body,
        whole.as_bytes(),
        "the replay is the recorded body, byte for byte"
    );
    assert_eq!(retry.header("content-type"), Some("text/event-stream"));
    assert_eq!(upstream.executions(&key), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn on_memory_over_http1_the_first_event_arrives_while_the_rest_is_held() {
    the_first_event_arrives_while_the_rest_is_held(StoreKind::Memory, Version::Http1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_memory_over_http2_the_first_event_arrives_while_the_rest_is_held() {
    the_first_event_arrives_while_the_rest_is_held(StoreKind::Memory, Version::Http2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_sqlite_the_first_event_arrives_while_the_rest_is_held() {
    let directory = tempfile::tempdir().expect("a directory");
    let store = || StoreKind::Sqlite(directory.path().join("records.db"));
    the_first_event_arrives_while_the_rest_is_held(store(), Version::Http1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_sqlite_over_http2_the_first_event_arrives_while_the_rest_is_held() {
    let directory = tempfile::tempdir().expect("a directory");
    let store = StoreKind::Sqlite(directory.path().join("records.db"));
    the_first_event_arrives_while_the_rest_is_held(store, Version::Http2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_redis_the_first_event_arrives_while_the_rest_is_held() {
    let redis = RedisServer::start();
    the_first_event_arrives_while_the_rest_is_held(StoreKind::Redis(redis.url()), Version::Http1).await;
    the_first_event_arrives_while_the_rest_is_held(StoreKind::Redis(redis.url()), Version::Http2).await;
}

/// The upstream breaks the stream after its first event: the client's stream breaks
/// too (not a clean end), the record is unknown (`stream-broken`), and a retry gets
/// 409, never the part that was sent as if it were whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_broken_mid_body_is_unknown_and_never_replayed() {
    let upstream = Upstream::start().await;
    let proxy = streaming_config(StoreKind::Memory, &upstream, "").start().await;
    let addr = proxy.addr();
    let mut extra = held_stream("b1");
    extra.push(("x-test-stream-fail", "reset".into()));
    let mut first = Streaming::open(addr, Version::Http1, "b1", &extra).await;
    let execution = first.header("x-execution-id").expect("the execution id").to_string();
    assert_eq!(first.next().await.expect("the first event"), event(&execution, 0));
    upstream.release("b1");
    let error = first
        .rest()
        .await
        .expect_err("the client's stream breaks, as the upstream's did");
    assert!(!error.is_empty());

    let retry = post(addr, Some("b1"), "{}", &[]).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert!(retry.problem().ends_with("outcome-unknown"), "{retry:?}");
    let body: serde_json::Value = serde_json::from_slice(&retry.body).expect("a problem body");
    assert_eq!(body["reason"], "stream-broken");
    assert_eq!(upstream.executions("b1"), 1);
}

/// The client reads the first event and goes away; the proxy reads the upstream's
/// stream to its end and completes the record, so that the retry gets all five.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_after_the_first_event_leaves_the_whole_answer_for_its_retry() {
    let upstream = Upstream::start().await;
    let proxy = streaming_config(StoreKind::Memory, &upstream, "wait_for_in_flight = \"5s\"")
        .start()
        .await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let mut first = Streaming::open(addr, Version::Http1, "g1", &held_stream("g1")).await;
    let execution = first.header("x-execution-id").expect("the execution id").to_string();
    assert_eq!(first.next().await.expect("the first event"), event(&execution, 0));
    drop(first);
    upstream.release("g1");
    // The retry joins the stream, or replays it if it has ended: all five either way.
    let retry = post(addr, Some("g1"), "{}", &[]).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert_eq!(retry.body, events(&execution, 5).as_bytes());
    // And once the record is complete, a replay has the whole answer too.
    support::client::until_metric(admin, "idemproxy_guarded_requests_in_flight", 0.0).await;
    let replay = post(addr, Some("g1"), "{}", &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, events(&execution, 5).as_bytes());
    assert_eq!(upstream.executions("g1"), 1);
}

/// Twenty retries that wait join the stream while the upstream still holds it: each
/// gets the head and the first event at once, the upstream runs once, and when it is
/// released every reader but the one that never reads gets the whole stream.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_waiting_retries_join_the_live_stream_and_the_upstream_runs_once() {
    let upstream = Upstream::start().await;
    let proxy = streaming_config(StoreKind::Memory, &upstream, "wait_for_in_flight = \"5s\"")
        .start()
        .await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let mut first = Streaming::open(addr, Version::Http1, "j1", &held_stream("j1")).await;
    let execution = first.header("x-execution-id").expect("the execution id").to_string();
    assert_eq!(first.next().await.expect("the first event"), event(&execution, 0));
    let mut joined = Vec::new();
    for index in 0..20 {
        let version = if index % 2 == 0 { Version::Http1 } else { Version::Http2 };
        let retry = Streaming::open(addr, version, "j1", &[]).await;
        if retry.status() != StatusCode::OK {
            let status = retry.status();
            panic!("{status}: {:?}", retry.rest().await);
        }
        let mut retry = retry;
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        // While the upstream still holds the rest: it joined the live stream.
        assert_eq!(retry.next().await.expect("the first event"), event(&execution, 0));
        joined.push(retry);
    }
    assert_eq!(
        metric(admin, "idemproxy_waits_total{result=\"joined\"}").await,
        Some(20.0)
    );
    // One reader never reads on.
    let stalled = joined.pop().expect("a reader");
    upstream.release("j1");
    let whole = events(&execution, 5);
    let rest = first.rest().await.expect("the first client's stream");
    assert_eq!(after_first(&execution, &rest), whole);
    for retry in joined {
        let rest = retry.rest().await.expect("a joined reader's stream");
        assert_eq!(after_first(&execution, &rest), whole);
    }
    assert_eq!(upstream.executions("j1"), 1);
    drop(stalled);
}

/// `stream = "never"`: the response is read whole first and sent with its length, as
/// before streaming existed; the replay is the same.
#[tokio::test(flavor = "multi_thread")]
async fn stream_never_buffers_the_response_as_before() {
    let upstream = Upstream::start().await;
    let proxy = streaming_config(StoreKind::Memory, &upstream, "stream = \"never\"")
        .start()
        .await;
    let addr = proxy.addr();
    let extra = [("x-test-stream", "5")];
    let first = post(addr, Some("n1"), "{}", &extra).await;
    let execution = first.header("x-execution-id").expect("the execution id").to_string();
    assert_eq!(first.body, events(&execution, 5).as_bytes());
    assert_eq!(
        first.header("content-length"),
        Some(first.body.len().to_string().as_str()),
        "read whole, then sent with its length"
    );
    let retry = post(addr, Some("n1"), "{}", &extra).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.executions("n1"), 1);
}

/// Past `max_response_body_bytes`, the first client still gets the whole stream, but
/// the record is unknown (`response-too-large`): a retry gets 409, never a part.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_past_the_record_cap_reaches_its_client_and_its_key_is_unknown() {
    let upstream = Upstream::start().await;
    let proxy = streaming_config(StoreKind::Memory, &upstream, "max_response_body_bytes = \"2KiB\"")
        .start()
        .await;
    let addr = proxy.addr();
    let mut extra = held_stream("c1");
    extra.push(("x-test-stream-event-bytes", "1024".into()));
    let mut first = Streaming::open(addr, Version::Http1, "c1", &extra).await;
    let head = first.next().await.expect("the first event");
    upstream.release("c1");
    let rest = first.rest().await.expect("the first client gets the whole stream");
    assert_eq!(head.len() + rest.len(), 5 * 1024);
    let retry = post(addr, Some("c1"), "{}", &[]).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    let body: serde_json::Value = serde_json::from_slice(&retry.body).expect("a problem body");
    assert_eq!(body["reason"], "response-too-large");
    assert_eq!(upstream.executions("c1"), 1);
}

/// 200 streams at once whose clients read the first event and stall (their first
/// events fit the budget; all five of every stream do not): the recordings hold their
/// bytes within `max_buffered_bytes` (those that cannot be given budget are handed on
/// unrecorded, their keys unknown), and once the clients read, every one gets its
/// whole stream; a retry gets the replay or 409, never a part; and every byte is
/// given back.
#[tokio::test(flavor = "multi_thread")]
async fn the_byte_budget_holds_under_two_hundred_stalled_streams() {
    let upstream = Upstream::start().await;
    let mut config = streaming_config(StoreKind::Memory, &upstream, "max_response_body_bytes = \"64KiB\"");
    config.server =
        "max_buffered_bytes = \"1MiB\"\nmax_request_body_bytes = \"64KiB\"\nmax_guarded_requests = 1000".into();
    // Each stream's whole exchange is bounded by the upstream timeout, counted from its
    // request: 200 streams opened one after another on a loaded machine may take more
    // than the default 5 s before the test reads them (it then saw a broken stream).
    config.upstream_timeout = "60s".into();
    let proxy = config.start().await;
    let (addr, admin) = (proxy.addr(), proxy.admin());
    let mut streams = Vec::new();
    for index in 0..200 {
        let key = format!("m{index}");
        let mut extra = held_stream("m");
        extra.push(("x-test-stream-event-bytes", "2048".into()));
        let mut stream = Streaming::open(addr, Version::Http2Narrow, &key, &extra).await;
        assert_eq!(
            stream.status(),
            StatusCode::OK,
            "{key}: its head while the upstream holds the rest"
        );
        let head = stream.next().await.expect("the first event");
        streams.push((key, head, stream));
    }
    // Every upstream sends the rest while no client reads: each recording takes it
    // until the budget is spent, then hands the rest to its (stalled) client. Once
    // every exchange has ended that way, no guarded request is in flight.
    upstream.release("m");
    support::client::until_metric(admin, "idemproxy_guarded_requests_in_flight", 0.0).await;
    let held = metric(admin, "idemproxy_buffered_bytes").await.expect("the gauge");
    assert!(held <= 1024.0 * 1024.0, "{held} bytes held, past the budget");
    assert!(
        held >= 512.0 * 1024.0,
        "{held} bytes held: the stalled readers hold their recordings"
    );
    let mut keys = Vec::new();
    for (key, head, stream) in streams {
        let rest = stream.rest().await.expect("a whole stream");
        assert_eq!(head.len() + rest.len(), 5 * 2048, "{key}");
        keys.push(key);
    }
    let mut recorded = 0;
    for key in keys {
        let retry = post(addr, Some(&key), "{}", &[]).await;
        match retry.status.as_u16() {
            200 => {
                recorded += 1;
                assert_eq!(retry.body.len(), 5 * 2048, "{key}: a replay is whole");
            }
            409 => {
                let body: serde_json::Value = serde_json::from_slice(&retry.body).expect("a problem body");
                assert_eq!(body["reason"], "over-budget", "{key}");
            }
            status => panic!("{key}: {status}"),
        }
        assert_eq!(upstream.executions(&key), 1, "{key}");
    }
    // How many fit depends on how the 200 recordings interleaved; never all of them.
    assert!(recorded < 200, "the budget could not hold them all");
    // Every byte is given back once the readers are done.
    support::client::until_metric(admin, "idemproxy_buffered_bytes", 0.0).await;
}

/// Shutdown while a response streams: the proxy stops accepting, and waits (within
/// `shutdown_grace`) for the recording to end and its record to be written. The client
/// gets the whole stream, and after a restart on the same SQLite file the retry gets
/// the replay: the upstream ran once.
#[tokio::test(flavor = "multi_thread")]
async fn shutdown_waits_for_a_recording_in_progress() {
    let upstream = Upstream::start().await;
    let directory = tempfile::tempdir().expect("a directory");
    let config = streaming_config(StoreKind::Sqlite(directory.path().join("records.db")), &upstream, "");
    let running = idemproxy::start(config.config()).await.expect("start the proxy");
    let mut first = Streaming::open(running.addr, Version::Http1, "d1", &held_stream("d1")).await;
    let execution = first.header("x-execution-id").expect("the execution id").to_string();
    assert_eq!(first.next().await.expect("the first event"), event(&execution, 0));
    let token = running.shutdown_token();
    let stopped = tokio::spawn(running.stopped());
    token.cancel();
    upstream.release("d1");
    let rest = first.rest().await.expect("the whole stream, through the shutdown");
    assert_eq!(after_first(&execution, &rest), events(&execution, 5));
    within(stopped).await.expect("the proxy stopped");

    let proxy = config.start().await;
    let retry = post(proxy.addr(), Some("d1"), "{}", &[]).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, events(&execution, 5).as_bytes());
    assert_eq!(upstream.executions("d1"), 1);
}
