//! An OTLP/HTTP trace collector for tests: it takes `POST /v1/traces` exports
//! (protobuf), keeps each body's raw bytes (to search them for what must never be
//! there), and decodes them with the `opentelemetry-proto` types into flat spans.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use tokio::net::TcpListener;

/// One exported span, flattened: ids in lowercase hex, as `traceparent` writes them.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    pub attributes: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service: String,
}

impl Span {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.as_str())
    }
}

#[derive(Default)]
struct State {
    bodies: Vec<Bytes>,
    spans: Vec<Span>,
}

pub struct Collector {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|value| value.value.as_ref()) {
        Some(Value::StringValue(text)) => text.clone(),
        Some(Value::IntValue(number)) => number.to_string(),
        Some(Value::BoolValue(flag)) => flag.to_string(),
        Some(Value::DoubleValue(number)) => number.to_string(),
        other => format!("{other:?}"),
    }
}

fn decode(body: &[u8]) -> Vec<Span> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export decodes");
    let mut spans = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .and_then(|resource| resource.attributes.iter().find(|kv| kv.key == "service.name"))
            .map(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                spans.push(Span {
                    name: span.name,
                    trace_id: const_hex::encode(&span.trace_id),
                    span_id: const_hex::encode(&span.span_id),
                    parent_span_id: const_hex::encode(&span.parent_span_id),
                    links: span
                        .links
                        .iter()
                        .map(|link| (const_hex::encode(&link.trace_id), const_hex::encode(&link.span_id)))
                        .collect(),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                        .collect(),
                    service: service.clone(),
                });
            }
        }
    }
    spans
}

async fn handle(state: Arc<Mutex<State>>, request: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let path = request.uri().path().to_string();
    let body = request.into_body().collect().await?.to_bytes();
    if path != "/v1/traces" {
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = http::StatusCode::NOT_FOUND;
        return Ok(response);
    }
    let spans = decode(&body);
    let mut state = state.lock().expect("collector state");
    state.bodies.push(body);
    state.spans.extend(spans);
    // An empty ExportTraceServiceResponse.
    Ok(Response::new(Full::new(Bytes::new())))
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the collector");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State::default()));
        let accept_state = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = accept_state.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| handle(state.clone(), request));
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        Collector { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<Span> {
        self.state.lock().expect("collector state").spans.clone()
    }

    /// Every export body as it arrived.
    pub fn bodies(&self) -> Vec<Bytes> {
        self.state.lock().expect("collector state").bodies.clone()
    }

    /// The spans once `done` holds of them: polled, bounded at 20 s (spans are sent in
    /// batches, half a second after the first span of each).
    pub async fn until(&self, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let started = tokio::time::Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the collector never got {what}: {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
