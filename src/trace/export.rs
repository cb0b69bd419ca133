//! The export of the proxy's spans over OTLP/HTTP (`[tracing] otlp_endpoint`): the
//! `tracing-opentelemetry` layer the binary installs, and a bounded span processor of
//! our own. A finished span goes into a queue of `QUEUE` with `try_send`, and one thread
//! of its own (`idemproxy-trace`) sends batches to the collector, one at a time, each
//! within `EXPORT_TIMEOUT`; a span the queue has no room for, or whose batch the
//! collector did not take, is counted in `idemproxy_trace_spans_dropped_total`, and
//! that is all it costs. Never on a request's path.

use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::BodyExt;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::TARGET;
use crate::body::full;
use crate::config::TracingConfig;
use crate::upstream::{HttpClient, SendError};

/// The spans queued for export at most; past it, a finished span is dropped.
const QUEUE: usize = 8192;
/// The spans one export sends at most.
const BATCH: usize = 1024;
/// How long a batch waits to fill before it is sent anyway.
const DELAY: Duration = Duration::from_millis(500);
/// How long the collector has to take one batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// `idemproxy_trace_spans_dropped_total` and `idemproxy_trace_spans_exported_total`:
/// process-wide, as the layer that feeds them is.
static DROPPED: LazyLock<Counter> = LazyLock::new(Counter::default);
static EXPORTED: LazyLock<Counter> = LazyLock::new(Counter::default);

pub(crate) fn spans_dropped() -> &'static Counter {
    &DROPPED
}

pub(crate) fn spans_exported() -> &'static Counter {
    &EXPORTED
}

/// The export a `layer` feeds: shut it down to send what is queued.
pub struct Export {
    provider: SdkTracerProvider,
}

impl Export {
    /// Sends what is queued (within a few seconds) and stops exporting.
    pub fn shutdown(self) {
        let _ = self.provider.shutdown_with_timeout(Duration::from_secs(3));
    }
}

/// Why the export could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot set up TLS for the OTLP endpoint")]
    Tls(#[source] rustls::Error),
    #[error("cannot build the OTLP exporter")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    #[error("cannot start the export thread")]
    Thread(#[source] std::io::Error),
}

/// The `tracing` layer that exports `config`'s spans (the proxy's and the trace-only
/// ones, at INFO and above, and WARN and ERROR events as span events), and the export
/// it feeds. Starts the export thread.
pub fn layer<S>(config: &TracingConfig) -> Result<(impl tracing_subscriber::Layer<S>, Export), TraceError>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    use tracing_subscriber::Layer as _;

    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .build();
    let client = crate::upstream::client(None).map_err(TraceError::Tls)?;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(config.otlp_endpoint.to_string())
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(OtlpClient(client))
        .build()
        .map_err(TraceError::Exporter)?;
    exporter.set_resource(&resource);
    let processor = Processor::start(exporter)?;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("idemproxy");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_threads(false)
        .with_location(false)
        .with_target(false)
        .with_filter(tracing_subscriber::filter::filter_fn(traced));
    Ok((layer, Export { provider }))
}

/// What the trace layer sees: the proxy's spans at INFO and above (but a probe chain's
/// `reconcile` span, which lives for minutes: each probe in it has a span of its own),
/// and its WARN and ERROR events, which become span events. Not the access log.
fn traced(metadata: &tracing::Metadata<'_>) -> bool {
    let ours = metadata.target().starts_with("idemproxy") && metadata.target() != super::ACCESS_LOG;
    if metadata.is_span() {
        ours && *metadata.level() <= tracing::Level::INFO && metadata.name() != "reconcile"
    } else {
        ours && *metadata.level() <= tracing::Level::WARN
    }
}

/// What the log sees of the spans: not the trace-only ones.
pub fn logged(metadata: &tracing::Metadata<'_>) -> bool {
    !(metadata.is_span() && metadata.target() == TARGET)
}

/// A bounded span processor: `on_end` queues without waiting, one thread exports.
#[derive(Debug)]
struct Processor {
    queue: mpsc::Sender<SpanData>,
    stop: CancellationToken,
    /// Disconnected when the export thread ends.
    ended: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Processor {
    fn start<E: SpanExporter + 'static>(exporter: E) -> Result<Processor, TraceError> {
        let (queue, received) = mpsc::channel(QUEUE);
        let stop = CancellationToken::new();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(TraceError::Thread)?;
        let stopping = stop.clone();
        let (ending, ended) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("idemproxy-trace".into())
            .spawn(move || {
                let _ending = ending;
                runtime.block_on(export(exporter, received, stopping));
            })
            .map_err(TraceError::Thread)?;
        Ok(Processor {
            queue,
            stop,
            ended: Mutex::new(ended),
        })
    }
}

impl SpanProcessor for Processor {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.queue.try_send(span).is_err() {
            DROPPED.inc();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.stop.cancel();
        // The thread sends what is queued, each batch within its own timeout; waited on
        // for `timeout` at most.
        let Ok(ended) = self.ended.lock() else {
            return Ok(());
        };
        match ended.recv_timeout(timeout) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(OTelSdkError::Timeout(timeout)),
            _ => Ok(()),
        }
    }
}

/// The export thread: sends a batch when it is full or `DELAY` after its first span,
/// one batch at a time; at `stop`, sends what is queued and ends.
async fn export<E: SpanExporter>(exporter: E, mut received: mpsc::Receiver<SpanData>, stop: CancellationToken) {
    let mut batch = Vec::with_capacity(BATCH);
    // A batch's first span, then what comes within `DELAY`, up to `BATCH`.
    while tokio::select! {
        biased;
        () = stop.cancelled() => false,
        received = received.recv_many(&mut batch, BATCH) => received > 0,
    } {
        let deadline = tokio::time::sleep(DELAY);
        tokio::pin!(deadline);
        while batch.len() < BATCH && !stop.is_cancelled() {
            let room = BATCH - batch.len();
            tokio::select! {
                received = received.recv_many(&mut batch, room) => if received == 0 { break },
                () = &mut deadline => break,
                () = stop.cancelled() => break,
            }
        }
        send(&exporter, &mut batch).await;
    }
    // Stopping (or every sender gone): what is queued goes out, in batches.
    received.close();
    while received.recv_many(&mut batch, BATCH).await > 0 {
        send(&exporter, &mut batch).await;
    }
    let _ = exporter.shutdown();
}

async fn send<E: SpanExporter>(exporter: &E, batch: &mut Vec<SpanData>) {
    if batch.is_empty() {
        return;
    }
    let spans: Vec<SpanData> = std::mem::replace(batch, Vec::with_capacity(BATCH));
    let count = spans.len() as u64;
    match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(spans)).await {
        Ok(Ok(())) => {
            EXPORTED.inc_by(count);
        }
        Ok(Err(error)) => {
            DROPPED.inc_by(count);
            tracing::debug!(%error, spans = count, "the collector did not take a batch of spans");
        }
        Err(_) => {
            DROPPED.inc_by(count);
            tracing::debug!(spans = count, "the collector did not take a batch of spans in time");
        }
    }
}

/// The OTLP exporter's HTTP client: the proxy's own pooled client, so an `https://`
/// endpoint uses the same rustls stack as the upstreams.
struct OtlpClient(HttpClient);

impl std::fmt::Debug for OtlpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OtlpClient")
    }
}

/// The most of a collector's answer that is read.
const MAX_ANSWER: usize = 64 * 1024;

impl opentelemetry_http::HttpClient for OtlpClient {
    fn send_bytes<'client, 'call>(
        &'client self,
        request: Request<Bytes>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Response<Bytes>, opentelemetry_http::HttpError>> + Send + 'call>>
    where
        'client: 'call,
        Self: 'call,
    {
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            if let Some(authority) = parts.uri.authority()
                && let Ok(host) = HeaderValue::from_str(authority.as_str())
            {
                parts.headers.insert(header::HOST, host);
            }
            let response = self.0.request(Request::from_parts(parts, full(body))).await.map_err(
                |error| -> opentelemetry_http::HttpError {
                    match error {
                        SendError::Connect(error) | SendError::Failed(error) => error,
                    }
                },
            )?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::Limited::new(body, MAX_ANSWER)
                .collect()
                .await?
                .to_bytes();
            Ok(Response::from_parts(parts, body))
        })
    }
}
