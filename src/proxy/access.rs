//! The access log (`server.access_log`): one line per request, target
//! `idemproxy::access`, written when the response body has been sent (or the client
//! went away). What it says is gathered while the request is served, in the response's
//! extensions, by the code that decides it: the outcome, the upstream's time, the
//! record hash. Never a raw key, a query string or a header value.

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

/// How a request ended, and on which route.
#[derive(Clone)]
pub(crate) struct Served {
    pub(crate) outcome: Outcome,
    pub(crate) route: Option<Arc<str>>,
}

/// How long the upstream took, to its response head.
#[derive(Clone, Copy)]
pub(crate) struct UpstreamTime(pub(crate) Duration);

/// The record a guarded request named: the first 12 hex digits of its hash.
#[derive(Clone)]
pub(crate) struct RecordHash(pub(crate) String);

/// Wraps `response`'s body so that one line is logged when it ends.
pub(crate) fn logged(response: Response<ProxyBody>, method: Method, started: Instant) -> Response<ProxyBody> {
    let (parts, body) = response.into_parts();
    let served = parts.extensions.get::<Served>();
    let line = Line {
        started,
        method,
        status: parts.status.as_u16(),
        route: served.and_then(|served| served.route.clone()),
        outcome: served.map(|served| served.outcome.as_str()),
        upstream: parts.extensions.get::<UpstreamTime>().map(|time| time.0),
        record: parts.extensions.get::<RecordHash>().map(|hash| hash.0.clone()),
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
    route: Option<Arc<str>>,
    outcome: Option<&'static str>,
    upstream: Option<Duration>,
    record: Option<String>,
}

impl Line {
    fn write(self, bytes: u64, complete: bool) {
        // Milliseconds to the microsecond, printed without float noise.
        let millis = |duration: Duration| duration.as_micros() as f64 / 1000.0;
        tracing::info!(
            target: "idemproxy::access",
            route = self.route.as_deref().unwrap_or("-"),
            method = self.method.as_str(),
            status = self.status,
            outcome = self.outcome.unwrap_or("-"),
            duration_ms = millis(self.started.elapsed()),
            upstream_ms = self.upstream.map(millis),
            record = self.record.as_deref(),
            bytes,
            complete,
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
