//! A slow upstream for the benchmarks (`bench/load.py`): answers every request with 201
//! and a small JSON body after `--delay-ms`, holding as many requests at once as come,
//! as a legacy API that takes its time does. With `--events N` (`bench/stream.py`) it
//! answers 200 with N server-sent events instead, `--gap-ms` apart, the first at once,
//! with no length: how a model API answers with `stream: true`. Not a test helper: it
//! only serves load.
//!
//!     cargo run --release --example slow-upstream -- --port 9000 --delay-ms 200
//!     cargo run --release --example slow-upstream -- --port 9000 --delay-ms 0 --events 5 --gap-ms 2

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

fn argument(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|arg| arg == name)
        .and_then(|at| args.get(at + 1))
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn main() -> std::io::Result<()> {
    let port = u16::try_from(argument("--port", 9000)).unwrap_or(9000);
    let delay = Duration::from_millis(argument("--delay-ms", 200));
    let threads = usize::try_from(argument("--threads", 1)).unwrap_or(1);
    let events = argument("--events", 0);
    let gap = Duration::from_millis(argument("--gap-ms", 0));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port)).await?;
        println!("slow upstream on 127.0.0.1:{port}, {delay:?} per request");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<hyper::body::Incoming>| async move {
                    // Read the body first, as an API does before it answers.
                    let _ = request.into_body().collect().await;
                    tokio::time::sleep(delay).await;
                    if events > 0 {
                        return Ok::<_, Infallible>(event_stream(events, gap));
                    }
                    let mut response = Response::new(
                        Full::new(Bytes::from_static(b"{\"ok\":true}"))
                            .map_err(|never| match never {})
                            .boxed(),
                    );
                    *response.status_mut() = StatusCode::CREATED;
                    response
                        .headers_mut()
                        .insert("content-type", http::HeaderValue::from_static("application/json"));
                    Ok::<_, Infallible>(response)
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let _ = builder.serve_connection(TokioIo::new(stream), service).await;
            });
        }
    })
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// `count` server-sent events, `gap` apart, the first at once, with no length.
fn event_stream(count: u64, gap: Duration) -> Response<Body> {
    let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
    tokio::spawn(async move {
        for index in 0..count {
            if index > 0 && !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            let event = Bytes::from(format!("data: {{\"event\":{index},\"text\":\"a token or two\"}}\n\n"));
            if sender.send(event).await.is_err() {
                return;
            }
        }
    });
    let frames = futures_util::stream::unfold(receiver, |mut receiver| async move {
        let event = receiver.recv().await?;
        Some((Ok::<_, Infallible>(http_body::Frame::data(event)), receiver))
    });
    let mut response = Response::new(http_body_util::StreamBody::new(frames).boxed());
    response
        .headers_mut()
        .insert("content-type", http::HeaderValue::from_static("text/event-stream"));
    response
}
