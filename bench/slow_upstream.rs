//! A slow upstream for the benchmarks (`bench/load.py`): answers every request with 201
//! and a small JSON body after `--delay-ms`, holding as many requests at once as come,
//! as a legacy API that takes its time does. Not a test helper: it only serves load.
//!
//!     cargo run --release --example slow-upstream -- --port 9000 --delay-ms 200

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
                    let mut response = Response::new(Full::new(Bytes::from_static(b"{\"ok\":true}")));
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
