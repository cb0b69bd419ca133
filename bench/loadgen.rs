//! The benchmarks' load generator for what wrk and h2load cannot send: thousands of
//! HTTP/1.1 connections or HTTP/2 streams, each request with an idempotency key of its
//! own (`--keys fresh`), one shared key (`--keys fixed`) or none. Prints one JSON line:
//! requests, seconds, requests per second, answers by status, errors, and latency
//! percentiles, to the whole response and to its first body byte (`ttfb`). Not a test
//! helper: `bench/load.py` and `bench/stream.py` run it.
//!
//!     cargo run --release --example loadgen -- --url http://127.0.0.1:8080/v1/payments \
//!         --connections 2000 --duration 10 --keys fresh [--h2 --streams 10]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::time::Instant;

struct Options {
    url: http::Uri,
    h2: bool,
    connections: usize,
    streams: usize,
    duration: Duration,
    keys: String,
    body: Bytes,
    threads: usize,
    /// Requests a second, spread evenly over the lanes (open loop); 0: each lane sends
    /// its next request when its last is answered (closed loop).
    rate: f64,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|arg| arg == name)
            .and_then(|at| args.get(at + 1))
            .cloned()
    };
    let number = |name: &str, default: usize| value(name).and_then(|v| v.parse().ok()).unwrap_or(default);
    Options {
        url: value("--url")
            .and_then(|url| url.parse().ok())
            .unwrap_or_else(|| http::Uri::from_static("http://127.0.0.1:8080/v1/payments")),
        h2: args.iter().any(|arg| arg == "--h2"),
        connections: number("--connections", 32),
        streams: number("--streams", 1),
        duration: Duration::from_secs_f64(value("--duration").and_then(|v| v.parse().ok()).unwrap_or(10.0)),
        keys: value("--keys").unwrap_or_else(|| "fresh".into()),
        body: Bytes::from(value("--body").unwrap_or_else(|| "{}".into())),
        threads: number("--threads", 1),
        rate: value("--rate").and_then(|v| v.parse().ok()).unwrap_or(0.0),
    }
}

/// What one request loop saw.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    /// To the first byte of the body.
    first_bytes_us: Vec<u32>,
    statuses: BTreeMap<u16, u64>,
    errors: u64,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type H2Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

enum Conn {
    H1(Sender),
    H2(H2Sender),
}

async fn connect(options: &Options) -> Option<Conn> {
    let authority = options.url.authority()?.as_str().to_string();
    let stream = TcpStream::connect(&authority).await.ok()?;
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(stream);
    if options.h2 {
        let (sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .ok()?;
        tokio::spawn(connection);
        Some(Conn::H2(sender))
    } else {
        let (sender, connection) = hyper::client::conn::http1::handshake(io).await.ok()?;
        tokio::spawn(connection);
        Some(Conn::H1(sender))
    }
}

fn request(options: &Options, key: Option<String>) -> Request<Full<Bytes>> {
    let mut builder = Request::post(options.url.clone()).header("content-type", "application/json");
    if !options.h2 {
        builder = builder.header("host", options.url.authority().map_or("localhost", |a| a.as_str()));
    }
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(options.body.clone()))
        .unwrap_or_else(|_| Request::new(Full::new(Bytes::new())))
}

fn key(options: &Options, run: u64, lane: usize, n: u64) -> Option<String> {
    match options.keys.as_str() {
        "fresh" => Some(format!("load-{run}-{lane}-{n}")),
        "fixed" => Some("load-fixed".into()),
        _ => None,
    }
}

/// Where a lane stands among all of them, for an open loop's schedule.
#[derive(Clone, Copy)]
struct Slot {
    index: usize,
    of: usize,
    start: Instant,
}

/// Sends requests one after another on `conn` until `stop`, as lane `lane`: in an open
/// loop, each at its turn in the schedule (`slot`), timed from when it was due.
async fn lane(
    options: Arc<Options>,
    mut conn: Conn,
    lane: usize,
    run: u64,
    stop: Arc<AtomicBool>,
    slot: Slot,
) -> Tally {
    let mut tally = Tally::default();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let request = request(&options, key(&options, run, lane, n));
        let started = if options.rate > 0.0 {
            let due = slot.start
                + Duration::from_secs_f64((slot.index as f64 + (n - 1) as f64 * slot.of as f64) / options.rate);
            tokio::time::sleep_until(due).await;
            if stop.load(Ordering::Relaxed) {
                break;
            }
            due
        } else {
            Instant::now()
        };
        let sent = match &mut conn {
            Conn::H1(sender) => {
                if sender.ready().await.is_err() {
                    tally.errors += 1;
                    break;
                }
                sender.send_request(request).await
            }
            Conn::H2(sender) => sender.send_request(request).await,
        };
        match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                let mut body = response.into_body();
                let mut first = None;
                let mut failed = false;
                while let Some(frame) = body.frame().await {
                    match frame {
                        Ok(frame) if frame.is_data() && first.is_none() => first = Some(started.elapsed()),
                        Ok(_) => {}
                        Err(_) => {
                            failed = true;
                            break;
                        }
                    }
                }
                if failed {
                    tally.errors += 1;
                    continue;
                }
                let first = first.unwrap_or_else(|| started.elapsed());
                tally
                    .first_bytes_us
                    .push(u32::try_from(first.as_micros()).unwrap_or(u32::MAX));
                tally
                    .latencies_us
                    .push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
                *tally.statuses.entry(status).or_default() += 1;
            }
            Err(_) => {
                tally.errors += 1;
                if let Conn::H1(_) = conn {
                    break;
                }
            }
        }
    }
    tally
}

fn main() {
    let options = Arc::new(options());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.threads.max(1))
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("loadgen: {error}");
            std::process::exit(1);
        }
    };
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    let tallies = runtime.block_on(async {
        let mut conns = Vec::with_capacity(options.connections);
        for _ in 0..options.connections {
            match connect(&options).await {
                Some(conn) => conns.push(conn),
                None => {
                    eprintln!("loadgen: cannot connect to {}", options.url);
                    std::process::exit(1);
                }
            }
        }
        // One key for all: its first request runs alone, so that the others replay it
        // (rather than find it in flight).
        if options.keys == "fixed"
            && let Some(mut conn) = connect(&options).await
        {
            let first = request(&options, key(&options, run, 0, 0));
            let _ = match &mut conn {
                Conn::H1(sender) => sender.send_request(first).await.map(|_| ()),
                Conn::H2(sender) => sender.send_request(first).await.map(|_| ()),
            };
        }
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let mut lanes = Vec::new();
        let per = if options.h2 { options.streams.max(1) } else { 1 };
        let of = conns.len() * per;
        let slot = |index: usize| Slot {
            index,
            of,
            start: started,
        };
        for (index, conn) in conns.into_iter().enumerate() {
            match conn {
                Conn::H1(sender) => {
                    let lane = lane(options.clone(), Conn::H1(sender), index, run, stop.clone(), slot(index));
                    lanes.push(tokio::spawn(lane));
                }
                Conn::H2(sender) => {
                    for stream in 0..per {
                        let (id, at) = (index * 1000 + stream, slot(index * per + stream));
                        let lane = lane(options.clone(), Conn::H2(sender.clone()), id, run, stop.clone(), at);
                        lanes.push(tokio::spawn(lane));
                    }
                }
            }
        }
        tokio::time::sleep(options.duration).await;
        stop.store(true, Ordering::Relaxed);
        let mut tallies = Vec::new();
        for lane in lanes {
            if let Ok(tally) = lane.await {
                tallies.push(tally);
            }
        }
        (tallies, started.elapsed())
    });
    let (tallies, elapsed) = tallies;
    let mut latencies: Vec<u32> = tallies.iter().flat_map(|t| t.latencies_us.iter().copied()).collect();
    latencies.sort_unstable();
    let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
    for tally in &tallies {
        for (status, count) in &tally.statuses {
            *statuses.entry(*status).or_default() += count;
        }
    }
    let errors: u64 = tallies.iter().map(|t| t.errors).sum();
    let mut first_bytes: Vec<u32> = tallies.iter().flat_map(|t| t.first_bytes_us.iter().copied()).collect();
    first_bytes.sort_unstable();
    let quantile = |sorted: &[u32], q: f64| {
        sorted
            .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
            .map_or(0.0, |us| f64::from(*us) / 1000.0)
    };
    let at = |q: f64| quantile(&latencies, q);
    let seconds = elapsed.as_secs_f64();
    let statuses: Vec<String> = statuses.iter().map(|(s, c)| format!("\"{s}\":{c}")).collect();
    println!(
        "{{\"requests\":{},\"seconds\":{seconds:.3},\"rps\":{:.1},\"status\":{{{}}},\"errors\":{errors},\"p50_ms\":{:.2},\"p99_ms\":{:.2},\"max_ms\":{:.2},\"ttfb_p50_ms\":{:.3},\"ttfb_p99_ms\":{:.3}}}",
        latencies.len(),
        latencies.len() as f64 / seconds,
        statuses.join(","),
        at(0.5),
        at(0.99),
        at(1.0),
        quantile(&first_bytes, 0.5),
        quantile(&first_bytes, 0.99)
    );
}
