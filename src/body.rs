//! Bodies and what the proxy knows about a client connection: the one body type the
//! proxy sends both ways, a request body read whole within its limits, a response body
//! read as far as it may be recorded, and one streamed on with a deadline. Nothing here
//! decides what to record or where to send.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::Request;
use http::header::{self, HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::error::{Bound, BoxError, Rejection, UpstreamError};

/// The body type of everything the proxy sends, both ways.
pub(crate) type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body that is all there already.
pub(crate) fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A client request with its body streamed on as it arrives. An error of the body
/// (the client broke its framing, or left) reaches the upstream client as a
/// `ClientBodyError`, so that the exchange it fails is the client's fault.
pub(crate) fn streamed(request: Request<Incoming>) -> Request<ProxyBody> {
    request.map(|body| client_body(body).boxed_unsync())
}

/// `body` as streamed on: its errors marked as the client's.
pub(crate) fn client_body(body: Incoming) -> impl Body<Data = Bytes, Error = BoxError> + Send + 'static {
    body.map_err(|error| BoxError::from(ClientBodyError(error)))
}

/// The client's request body failed while it was streamed upstream.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body broke off or was malformed")]
pub(crate) struct ClientBodyError(#[source] hyper::Error);

/// Whether `error` failed because the client's streamed body did: anywhere in its chain
/// of sources is a `ClientBodyError`.
pub(crate) fn broken_by_client(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |error| error.source()).any(|error| error.is::<ClientBodyError>())
}

/// What the proxy knows about the client side of a connection, worked out once per
/// connection rather than once per request.
#[derive(Debug, Clone)]
pub(crate) struct ClientInfo {
    /// The client's address.
    pub(crate) addr: IpAddr,
    /// What this connection's requests may take of the byte budget for bytes they
    /// declared and have not sent.
    pub(crate) allowance: Arc<Allowance>,
    /// The client's address as a header value, for `X-Forwarded-For`.
    pub(crate) forwarded_for: HeaderValue,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub(crate) proto: HeaderValue,
}

impl ClientInfo {
    pub(crate) fn new(addr: IpAddr, tls: bool) -> ClientInfo {
        // An IP address is always a valid header value: the fallback is never taken.
        let forwarded_for =
            HeaderValue::from_str(&addr.to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        let proto = HeaderValue::from_static(if tls { "https" } else { "http" });
        ClientInfo {
            addr,
            allowance: Arc::default(),
            forwarded_for,
            proto,
        }
    }
}

/// One connection's reservations for request body bytes it has declared
/// (`Content-Length`) and not sent yet: at most one body's worth however many streams
/// it opens, so that declaring costs a client nothing it has not sent. Bytes past it
/// are taken as they arrive.
#[derive(Debug, Default)]
pub(crate) struct Allowance {
    held: AtomicU64,
}

impl Allowance {
    /// Up to `want` bytes, as far as what the connection holds stays within `max`.
    fn grant(&self, want: u64, max: u64) -> Grant<'_> {
        let mut granted = 0;
        let _ = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            granted = want.min(max.saturating_sub(held));
            Some(held + granted)
        });
        Grant {
            allowance: self,
            bytes: granted,
        }
    }
}

/// What one body was granted of its connection's allowance, given back when its read
/// ends.
struct Grant<'a> {
    allowance: &'a Allowance,
    bytes: u64,
}

impl Drop for Grant<'_> {
    fn drop(&mut self) {
        self.allowance.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// How a guarded request's body may be read: at most `max_bytes`, all of it within
/// `timeout`, and no longer than `idle` without a byte.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyLimits {
    pub(crate) max_bytes: u64,
    pub(crate) timeout: Duration,
    pub(crate) idle: Duration,
}

/// Reads a guarded request's whole body within `limits` (a declared length over them
/// is refused before reading), each byte first taken from the byte budget by `reserve`
/// (refused, 503 `overloaded`, before anything is claimed).
pub(crate) async fn read_request_body(
    body: Incoming,
    headers: &HeaderMap,
    limits: BodyLimits,
    allowance: Option<&Allowance>,
    reserve: impl FnMut(u64) -> bool,
) -> Result<Bytes, Rejection> {
    match peek_request_body(body, headers, limits, allowance, reserve).await? {
        Peeked::Whole(body) => Ok(body),
        Peeked::Partial { cut: Cut::TooLarge, .. } => Err(Rejection::BodyTooLarge(limits.max_bytes)),
        Peeked::Partial { cut: Cut::TooSlow, .. } => Err(Rejection::BodyTimeout(limits.timeout)),
        Peeked::Partial { cut: Cut::Idle, .. } => Err(Rejection::BodyIdle(limits.idle)),
        Peeked::Partial {
            cut: Cut::OverBudget, ..
        } => Err(Rejection::Overloaded(Bound::Bytes)),
    }
}

/// A request body read as far as a guarded request may hold it: the whole of it, or
/// what arrived before it passed `max` bytes, the read timeout or the byte budget, with
/// the rest still to stream (shadow mode forwards it; enforce mode refuses it).
pub(crate) enum Peeked {
    Whole(Bytes),
    Partial { head: Bytes, rest: Incoming, cut: Cut },
}

/// Why a body was not read whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    TooLarge,
    TooSlow,
    /// No byte came for the idle limit.
    Idle,
    /// The byte budget could not hold it.
    OverBudget,
}

/// Reads `body` up to `limits.max_bytes` (a declared larger length is not read at
/// all), within its timeouts, taking its bytes from the budget with `reserve` first: of
/// a declared length, as much up front as the connection's `allowance` grants (all of
/// it without one), and every byte past that as it comes. A body the client broke is
/// refused.
pub(crate) async fn peek_request_body(
    mut body: Incoming,
    headers: &HeaderMap,
    limits: BodyLimits,
    allowance: Option<&Allowance>,
    mut reserve: impl FnMut(u64) -> bool,
) -> Result<Peeked, Rejection> {
    let max = limits.max_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    // Held until the body is read: the bytes it stands for are then real, and taken.
    let grant = match (declared, allowance) {
        (Some(length), Some(allowance)) if length <= max => Some(allowance.grant(length, max)),
        _ => None,
    };
    let up_front = match (declared, &grant) {
        (Some(length), None) => length,
        (_, Some(grant)) => grant.bytes,
        (None, None) => 0,
    };
    let refused = match declared {
        Some(length) if length > max => Some(Cut::TooLarge),
        Some(_) if up_front > 0 && !reserve(up_front) => Some(Cut::OverBudget),
        _ => None,
    };
    if let Some(cut) = refused {
        return Ok(Peeked::Partial {
            head: Bytes::new(),
            rest: body,
            cut,
        });
    }
    // A body that comes in one frame (the common case) is kept as it came, uncopied;
    // one in several is joined into one allocation of its declared length.
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    let mut read: u64 = 0;
    let head = |first: Option<Bytes>, joined: BytesMut| first.unwrap_or_else(|| joined.freeze());
    let deadline = tokio::time::sleep(limits.timeout);
    tokio::pin!(deadline);
    loop {
        // `frame()` only polls the body, so a deadline that wins loses nothing.
        let frame = tokio::select! {
            frame = body.frame() => frame,
            () = &mut deadline => {
                return Ok(Peeked::Partial { head: head(first, joined), rest: body, cut: Cut::TooSlow });
            }
            () = tokio::time::sleep(limits.idle) => {
                return Ok(Peeked::Partial { head: head(first, joined), rest: body, cut: Cut::Idle });
            }
        };
        let Some(frame) = frame else {
            return Ok(Peeked::Whole(head(first, joined)));
        };
        let frame = frame.map_err(|error| Rejection::BodyIncomplete(error.into()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let length = data.len() as u64;
        // What of this frame lies past the bytes taken up front is taken now.
        let past = (read + length).saturating_sub(up_front.max(read));
        read += length;
        let over_budget = read <= max && past > 0 && !reserve(past);
        match first.take() {
            None if joined.is_empty() => first = Some(data),
            earlier => {
                if let Some(earlier) = earlier {
                    let length = declared.and_then(|length| usize::try_from(length).ok());
                    joined.reserve(length.unwrap_or(earlier.len() + data.len()));
                    joined.extend_from_slice(&earlier);
                }
                joined.extend_from_slice(&data);
            }
        }
        if read > max || over_budget {
            let cut = if read > max { Cut::TooLarge } else { Cut::OverBudget };
            return Ok(Peeked::Partial {
                head: head(first, joined),
                rest: body,
                cut,
            });
        }
    }
}

/// A response body read as far as the proxy may record it.
pub(crate) enum Buffered {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// The limit was passed, or the byte budget could not hold more: what was read so
    /// far, and the rest, still to stream.
    Cut {
        head: Bytes,
        rest: Incoming,
        over_budget: bool,
    },
}

/// Reads `body` until it ends or passes `limit` bytes, within `deadline`, taking its
/// bytes from the budget with `reserve` first (all of a declared length up front, else
/// each frame as it comes); `timeout` is what the deadline stands for, for the error.
pub(crate) async fn buffer_response(
    mut body: Incoming,
    limit: u64,
    deadline: Instant,
    timeout: Duration,
    mut reserve: impl FnMut(u64) -> bool,
) -> Result<Buffered, UpstreamError> {
    let declared = body.size_hint().exact().filter(|length| *length <= limit);
    if let Some(length) = declared
        && !reserve(length)
    {
        return Ok(Buffered::Cut {
            head: Bytes::new(),
            rest: body,
            over_budget: true,
        });
    }
    let read = async {
        // Sized from Content-Length when the upstream sent one, so a body is read into
        // one allocation of its own size.
        let expected = body.size_hint().exact().unwrap_or(0).min(limit.saturating_add(1));
        let mut collected = BytesMut::with_capacity(usize::try_from(expected).unwrap_or(0));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| UpstreamError::Failed(error.into()))?;
            if let Ok(data) = frame.into_data() {
                let over_budget = declared.is_none() && !reserve(data.len() as u64);
                collected.extend_from_slice(&data);
                if collected.len() as u64 > limit || over_budget {
                    return Ok((collected.freeze(), Some(over_budget)));
                }
            }
        }
        Ok::<_, UpstreamError>((exact(collected), None))
    };
    // `read` borrows `body`; the borrow ends with this statement.
    let outcome = tokio::time::timeout_at(deadline, read).await;
    match outcome {
        Err(_) => Err(UpstreamError::Timeout(timeout)),
        Ok(Err(error)) => Err(error),
        Ok(Ok((whole, None))) => Ok(Buffered::Whole(whole)),
        Ok(Ok((head, Some(over_budget)))) => Ok(Buffered::Cut {
            head,
            rest: body,
            over_budget,
        }),
    }
}

/// `bytes` in an allocation of exactly its length: a record keeps its body for the whole
/// retention, and a buffer that grew by doubling would keep up to twice its size.
fn exact(bytes: BytesMut) -> Bytes {
    if bytes.capacity() == bytes.len() {
        bytes.freeze()
    } else {
        Bytes::copy_from_slice(&bytes)
    }
}

/// A streamed response body: an optional head already read, then the rest, cut off
/// with an error if `deadline` passes first.
pub(crate) struct StreamedBody {
    head: Option<Bytes>,
    rest: Incoming,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
}

impl StreamedBody {
    pub(crate) fn new(head: Option<Bytes>, rest: Incoming, deadline: Instant, timeout: Duration) -> StreamedBody {
        StreamedBody {
            head,
            rest,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            timeout,
        }
    }
}

impl Body for StreamedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.rest).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| frame.map_err(BoxError::from)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(UpstreamError::Timeout(self.timeout).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let head = self.head.as_ref().map_or(0, |head| head.len() as u64);
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint.set_lower(rest.lower() + head);
        hint
    }
}
