//! The access log (`server.access_log`): one line per request, target
//! `idemproxy::access`, written when the response body has been sent (or the client
//! went away). What it says besides the method, status and time is noted on the
//! response, once, where the request ends (`Proxy::finish`): the outcome, the route,
//! the upstream's time, the record hash, and with tracing on the trace id. Never a raw
//! key, a query string or a header value.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::body::ProxyBody;
use crate::error::BoxError;
use crate::error::Outcome;
use crate::record::ExecutionTrace;
use crate::trace::ACCESS_LOG;

/// What the access log says of a request besides its method, status and time: how it
/// ended, on which route, how long the upstream took to its response head (when it was
/// asked), and the record it named (the first 12 hex digits of its hash). Noted on the
/// response by `Proxy::finish`.
#[derive(Clone)]
pub(crate) struct Note {
    pub(crate) outcome: Outcome,
    pub(crate) route: Option<Arc<str>>,
    pub(crate) upstream: Option<Duration>,
    pub(crate) record: Option<String>,
    /// A replay's: the trace of the request that executed it (for its span's link).
    pub(crate) execution: Option<ExecutionTrace>,
}

/// Wraps `response`'s body so that one line is logged when it ends; `trace_id` is the
/// request's trace, when tracing is on.
pub(crate) fn logged(
    response: Response<ProxyBody>,
    method: Method,
    started: Instant,
    trace_id: Option<String>,
) -> Response<ProxyBody> {
    let (mut parts, body) = response.into_parts();
    let note = parts.extensions.remove::<Note>();
    let line = Line {
        started,
        method,
        status: parts.status.as_u16(),
        note,
        trace_id,
    };
    let body = AccessBody {
        inner: body,
        bytes: 0,
        line: Some(line),
    };
    Response::from_parts(parts, body.boxed_unsync())
}

struct Line {
    started: Instant,
    method: Method,
    status: u16,
    note: Option<Note>,
    trace_id: Option<String>,
}

impl Line {
    fn write(self, bytes: u64, complete: bool) {
        let note = self.note.as_ref();
        Entry {
            route: note.and_then(|note| note.route.as_deref()).unwrap_or("-"),
            method: self.method.as_str(),
            status: Some(self.status),
            outcome: note.map_or("-", |note| note.outcome.as_str()),
            result: None,
            duration: self.started.elapsed(),
            upstream: note.and_then(|note| note.upstream),
            record: note.and_then(|note| note.record.as_deref()),
            trace_id: self.trace_id.as_deref(),
            sent: Some((bytes, complete)),
        }
        .write();
    }
}

/// One access line, a request's or a probe's: the one place a line is written.
pub(super) struct Entry<'a> {
    pub(super) route: &'a str,
    pub(super) method: &'a str,
    /// `None`: a probe that got no answer.
    pub(super) status: Option<u16>,
    pub(super) outcome: &'a str,
    /// A probe's: what it learned.
    pub(super) result: Option<&'a str>,
    pub(super) duration: Duration,
    pub(super) upstream: Option<Duration>,
    pub(super) record: Option<&'a str>,
    pub(super) trace_id: Option<&'a str>,
    /// A request's: the body bytes sent, and whether the body ended.
    pub(super) sent: Option<(u64, bool)>,
}

impl Entry<'_> {
    pub(super) fn write(&self) {
        // Milliseconds to the microsecond, printed without float noise.
        let millis = |duration: Duration| duration.as_micros() as f64 / 1000.0;
        tracing::info!(
            target: ACCESS_LOG,
            route = self.route,
            method = self.method,
            status = self.status,
            outcome = self.outcome,
            result = self.result,
            duration_ms = millis(self.duration),
            upstream_ms = self.upstream.map(millis),
            record = self.record,
            trace_id = self.trace_id,
            bytes = self.sent.map(|(bytes, _)| bytes),
            complete = self.sent.map(|(_, complete)| complete),
            "access"
        );
    }
}

/// A response body that counts what it sends and writes the line at its end: after
/// the last frame, on an error, or when dropped before the end (the client left).
struct AccessBody {
    inner: ProxyBody,
    bytes: u64,
    line: Option<Line>,
}

impl Body for AccessBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.bytes += data.len() as u64;
                }
            }
            Poll::Ready(None) => self.finish(true),
            Poll::Ready(Some(Err(_))) => self.finish(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl AccessBody {
    fn finish(&mut self, complete: bool) {
        if let Some(line) = self.line.take() {
            line.write(self.bytes, complete);
        }
    }
}

impl Drop for AccessBody {
    fn drop(&mut self) {
        // A body hyper never polled to its end: empty (hyper may not poll one whose
        // size is known to be 0), or the client went away.
        let complete = self.inner.is_end_stream();
        self.finish(complete);
    }
}
