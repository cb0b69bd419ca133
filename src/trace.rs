//! Traces (`[tracing]`): the spans the proxy makes and how they join the client's trace
//! and the upstream's; their export over OTLP/HTTP is `export`.
//!
//! The spans are `tracing` spans; the binary's `tracing-opentelemetry` layer (see
//! `layer`) turns them into OpenTelemetry spans, only when `[tracing]` names an
//! endpoint. The trace-only ones (the request, each store operation, the upstream
//! exchange, a wait, a probe) have the target `TARGET`, which the log leaves out, and
//! are made by `Spans`, a value made from the config: with tracing off each of them is
//! `Span::none()`, so they cost nothing and no call site asks whether tracing is on.
//! Their attributes are configured names, fixed words, statuses and record hashes:
//! never a key, a path, a query or a header value.

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::record::ExecutionTrace;

mod export;

pub use self::export::{Export, TraceError, layer, logged};
pub(crate) use self::export::{spans_dropped, spans_exported};

/// The target of the spans that exist for traces only, which the log leaves out.
pub const TARGET: &str = "idemproxy::trace";

/// The access log's `tracing` target (`server.access_log`): what the proxy writes its
/// lines under, what the binary's filter keeps on, and what the trace layer leaves out.
pub const ACCESS_LOG: &str = "idemproxy::access";

/// The spans a process makes, as its config says: with `[tracing]` each is a span of
/// its own (of target `TARGET`, which the log leaves out); without, each is
/// `Span::none()`, whose enter, exit and record do nothing. Made once at start, and
/// `Copy`, so every place that makes a span holds one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spans {
    on: bool,
}

impl Spans {
    pub(crate) fn new(on: bool) -> Spans {
        Spans { on }
    }

    /// Whether spans are made (a request's end is then recorded on its span).
    pub(crate) fn on(self) -> bool {
        self.on
    }

    /// The span of one request, continuing the client's trace context when it is
    /// valid W3C trace context.
    pub(crate) fn request(self, method: &Method, headers: &HeaderMap) -> Span {
        if !self.on {
            return Span::none();
        }
        request(method, headers)
    }

    /// Records how a request ended on its span; its trace id, for the access line.
    pub(crate) fn ended(self, span: &Span, end: RequestEnd<'_>) -> Option<String> {
        if !self.on {
            return None;
        }
        end.record(span)
    }

    /// The span of one upstream exchange, to the response head.
    pub(crate) fn upstream(self, method: &Method, authority: &str) -> Span {
        if !self.on {
            return Span::none();
        }
        upstream(method, authority)
    }

    /// Puts `span` in `headers` as the upstream's parent, in place of the client's.
    pub(crate) fn inject(self, span: &Span, headers: &mut HeaderMap) {
        if self.on {
            inject(span, headers);
        }
    }

    /// The span of one store operation.
    pub(crate) fn store(self, op: &'static str) -> Span {
        if !self.on {
            return Span::none();
        }
        store(op)
    }

    /// The span of one probe: a root, linked to the request that began its chain.
    pub(crate) fn probe(self, route: &str, record: &str, began: Option<ExecutionTrace>) -> Span {
        if !self.on {
            return Span::none();
        }
        probe(route, record, began)
    }

    /// The span of a duplicate's wait for the request that holds its key.
    pub(crate) fn wait(self) -> Span {
        if !self.on {
            return Span::none();
        }
        wait()
    }

    /// The trace id and span id of `span`, which a record keeps (`None` with tracing
    /// off).
    pub(crate) fn reference(self, span: &Span) -> Option<ExecutionTrace> {
        if !self.on {
            return None;
        }
        reference(span)
    }
}

// === trace context ===

/// The most of a client's `tracestate` a span keeps: W3C Trace Context §3.3.1.5 lets a
/// vendor drop entries past 512 characters, and every span otherwise keeps its own copy.
const TRACESTATE_KEPT: usize = 512;

/// A client's trace context as the proxy takes it: `traceparent` only when it is
/// exactly what W3C Trace Context §3.2 writes (2, 32, 16 and 2 lowercase hex digits,
/// version `00` or a later one other than `ff`, no all-zero id), and its `tracestate`
/// only with such a parent, cut to whole entries within `TRACESTATE_KEPT`.
struct ClientContext {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl ClientContext {
    fn read(headers: &HeaderMap) -> ClientContext {
        let mut parents = headers.get_all(TRACEPARENT).iter();
        let traceparent = match (parents.next(), parents.next()) {
            (Some(value), None) => value.to_str().ok().filter(|value| valid_traceparent(value)),
            _ => None,
        };
        let tracestate = traceparent
            .and(headers.get(TRACESTATE))
            .and_then(|value| value.to_str().ok());
        ClientContext {
            traceparent: traceparent.map(str::to_string),
            tracestate: tracestate.map(|state| kept_tracestate(state).to_string()),
        }
    }
}

impl Extractor for ClientContext {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent.as_deref(),
            "tracestate" => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// Whether `value` is a `traceparent` as W3C Trace Context writes it.
fn valid_traceparent(value: &str) -> bool {
    let hex = |part: &str, len: usize| {
        part.len() == len && part.bytes().all(|byte| matches!(byte, b'0'..=b'9' | b'a'..=b'f'))
    };
    let parts: Vec<&str> = value.split('-').collect();
    let [version, trace_id, span_id, flags, rest @ ..] = parts.as_slice() else {
        return false;
    };
    hex(version, 2)
        && *version != "ff"
        // Version 00 has exactly four parts; a later version may add some.
        && (rest.is_empty() || *version != "00")
        && hex(trace_id, 32)
        && trace_id.bytes().any(|byte| byte != b'0')
        && hex(span_id, 16)
        && span_id.bytes().any(|byte| byte != b'0')
        && hex(flags, 2)
}

/// The whole entries of `state` that fit in `TRACESTATE_KEPT` characters.
fn kept_tracestate(state: &str) -> &str {
    if state.len() <= TRACESTATE_KEPT {
        return state;
    }
    let mut end = 0;
    for (at, _) in state.match_indices(',').chain([(state.len(), "")]) {
        if at > TRACESTATE_KEPT {
            break;
        }
        end = at;
    }
    &state[..end]
}

struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The span of one request, continuing the trace of the client's `traceparent` and
/// `tracestate` when they are valid W3C trace context, else starting one. What the
/// request turns out to be is recorded on it by `ended`.
fn request(method: &Method, headers: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "request",
        otel.kind = "server",
        http.request.method = method.as_str(),
        idemproxy.route = tracing::field::Empty,
        idemproxy.outcome = tracing::field::Empty,
        idemproxy.record = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let parent = TraceContextPropagator::new().extract(&ClientContext::read(headers));
    if parent.span().span_context().is_valid() {
        // Only fails for a span already started, or one no layer traces.
        let _ = span.set_parent(parent);
    }
    span
}

/// What a request span records when its response is ready, and the trace id for its
/// access line. A replay's span links to the request that executed it.
pub(crate) struct RequestEnd<'a> {
    pub(crate) status: u16,
    pub(crate) route: Option<&'a str>,
    pub(crate) outcome: &'static str,
    pub(crate) record: Option<&'a str>,
    pub(crate) execution: Option<ExecutionTrace>,
}

impl RequestEnd<'_> {
    /// Records this on `span`, and returns its trace id (32 hex digits).
    fn record(self, span: &Span) -> Option<String> {
        span.record("http.response.status_code", self.status);
        span.record("idemproxy.outcome", self.outcome);
        if let Some(route) = self.route {
            span.record("idemproxy.route", route);
        }
        if let Some(record) = self.record {
            span.record("idemproxy.record", record);
        }
        if self.status >= 500 {
            span.record("otel.status_code", "ERROR");
        }
        if let Some(execution) = self.execution {
            span.add_link(execution.span_context());
        }
        reference(span).map(|trace| trace.trace_id_hex())
    }
}

/// The trace id and span id of `span`, when a layer traces it.
fn reference(span: &Span) -> Option<ExecutionTrace> {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then(|| ExecutionTrace {
        trace_id: span_context.trace_id().to_bytes(),
        span_id: span_context.span_id().to_bytes(),
    })
}

impl ExecutionTrace {
    /// The span this names, as a link's target.
    fn span_context(self) -> SpanContext {
        SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            TraceFlags::SAMPLED,
            true,
            TraceState::NONE,
        )
    }
}

/// The span of one upstream exchange, to the response head.
fn upstream(method: &Method, authority: &str) -> Span {
    tracing::info_span!(
        target: TARGET,
        "upstream",
        otel.kind = "client",
        http.request.method = method.as_str(),
        server.address = authority,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Puts `span` as the parent in `headers`' trace context, in place of the client's:
/// the upstream's spans hang off the proxy's. Nothing changes when no layer traces
/// `span`.
fn inject(span: &Span, headers: &mut HeaderMap) {
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return;
    }
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    TraceContextPropagator::new().inject_context(&context, &mut HeadersMut(headers));
    // A trace of the proxy's own has no state to pass on: no empty field.
    if headers.get(TRACESTATE).is_some_and(|state| state.is_empty()) {
        headers.remove(TRACESTATE);
    }
}

/// The span of one probe of a record whose outcome is unknown: a root, linked to the
/// request that began its chain.
fn probe(route: &str, record: &str, began: Option<ExecutionTrace>) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "probe",
        idemproxy.route = route,
        idemproxy.record = record,
    );
    if let Some(began) = began {
        span.add_link(began.span_context());
    }
    span
}

/// The span of a duplicate's wait for the request that holds its key.
fn wait() -> Span {
    tracing::info_span!(target: TARGET, "wait")
}

/// The span of one store operation.
fn store(op: &'static str) -> Span {
    tracing::info_span!(
        target: TARGET,
        "store",
        otel.name = op,
        otel.kind = "client",
        db.operation.name = op,
        error.type = tracing::field::Empty,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_traceparent_as_w3c_writes_it_is_continued() {
        let good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert!(valid_traceparent(good));
        assert!(valid_traceparent(
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later"
        ));
        for bad in [
            "00-1-1-01",
            "00-00000000000000000000000af7651916-b7ad6b7169203331-01-x",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-001",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-000000000000000000000af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert!(!valid_traceparent(bad), "{bad}");
        }
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, HeaderValue::from_static("00-1-1-01"));
        headers.insert(TRACESTATE, HeaderValue::from_static("vendor=joined"));
        let context = ClientContext::read(&headers);
        assert_eq!(
            (context.traceparent, context.tracestate),
            (None, None),
            "no state without a valid parent"
        );
    }

    #[test]
    fn a_long_tracestate_is_cut_to_whole_entries_within_512_characters() {
        let entry = |n: usize| format!("v{n:03}={}", "x".repeat(40));
        let state: Vec<String> = (0..400).map(entry).collect();
        let state = state.join(",");
        assert!(state.len() > 16_000);
        let kept = kept_tracestate(&state);
        assert!(kept.len() <= 512 && kept.len() > 400, "{}", kept.len());
        assert!(state.starts_with(kept) && state[kept.len()..].starts_with(','));
        // 45 characters an entry, a comma between: 11 entries are 505 characters.
        assert_eq!(kept.split(',').count(), (512 + 1) / (entry(0).len() + 1));
        assert_eq!(kept_tracestate("a=1,b=2"), "a=1,b=2");
    }
}
