//! Bodies and what the proxy knows about a client connection: the one body type the
//! proxy sends both ways, a request body read whole within its limits, a response body
//! read as far as it may be recorded, and one streamed on with a deadline. Nothing here
//! decides what to record or where to send.

use std::collections::VecDeque;
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
    Partial { head: Vec<Bytes>, rest: Incoming, cut: Cut },
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
            head: Vec::new(),
            rest: body,
            cut,
        });
    }
    // A body that comes in one frame (the common case) is kept as it came, uncopied.
    let mut gathered = Gathered::new(declared);
    let mut read: u64 = 0;
    let deadline = tokio::time::sleep(limits.timeout);
    tokio::pin!(deadline);
    loop {
        // `frame()` only polls the body, so a deadline that wins loses nothing.
        let frame = tokio::select! {
            frame = body.frame() => frame,
            () = &mut deadline => {
                return Ok(Peeked::Partial { head: gathered.into_frames(), rest: body, cut: Cut::TooSlow });
            }
            () = tokio::time::sleep(limits.idle) => {
                return Ok(Peeked::Partial { head: gathered.into_frames(), rest: body, cut: Cut::Idle });
            }
        };
        let Some(frame) = frame else {
            return Ok(Peeked::Whole(gathered.into_bytes()));
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
        gathered.push(data);
        if read > max || over_budget {
            let cut = if read > max { Cut::TooLarge } else { Cut::OverBudget };
            return Ok(Peeked::Partial {
                head: gathered.into_frames(),
                rest: body,
                cut,
            });
        }
    }
}

/// A body's frames gathered so that what a buffered body holds in memory is about the
/// length the byte budget took for it. A body of one frame is kept as it came. From the
/// second frame on, the frames are copied: a body of a declared length into one
/// allocation of that length, one without into segments that grow with the body to at
/// most `SEGMENT` bytes each, joined into one allocation of exactly its length when asked
/// for. Never into a buffer grown by doubling, which holds up to twice the length and
/// frees the smaller buffers it outgrew on the way; and never by keeping every frame,
/// which a client sending one-byte chunks would make cost many times their bytes.
struct Gathered {
    declared: Option<usize>,
    first: Option<Bytes>,
    segments: Vec<BytesMut>,
    /// The bytes in `segments`.
    copied: usize,
}

/// The largest segment a body without a declared length is copied into.
const SEGMENT: usize = 64 * 1024;

impl Gathered {
    fn new(declared: Option<u64>) -> Gathered {
        Gathered {
            declared: declared.and_then(|length| usize::try_from(length).ok()),
            first: None,
            segments: Vec::new(),
            copied: 0,
        }
    }

    fn len(&self) -> usize {
        self.first.as_ref().map_or(self.copied, Bytes::len)
    }

    fn push(&mut self, data: Bytes) {
        if self.first.is_none() && self.segments.is_empty() {
            self.first = Some(data);
            return;
        }
        if let Some(first) = self.first.take() {
            self.copy_in(&first);
        }
        self.copy_in(&data);
    }

    fn copy_in(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let room = self
                .segments
                .last()
                .map_or(0, |segment| segment.capacity() - segment.len());
            if room == 0 {
                let size = match self.declared {
                    Some(declared) if declared > self.copied => declared - self.copied,
                    _ => (self.copied + data.len()).clamp(4096, SEGMENT),
                };
                self.segments.push(BytesMut::with_capacity(size));
                continue;
            }
            let (now, later) = data.split_at(room.min(data.len()));
            if let Some(segment) = self.segments.last_mut() {
                segment.extend_from_slice(now);
            }
            self.copied += now.len();
            data = later;
        }
    }

    /// What was read, uncopied, for a body cut off and streamed on (or dropped).
    fn into_frames(mut self) -> Vec<Bytes> {
        match self.first.take() {
            Some(first) => vec![first],
            None => self.segments.into_iter().map(BytesMut::freeze).collect(),
        }
    }

    /// The body, a single frame as it came: it may hold the rest of the buffer it was
    /// read into, so this is for a body held only while its request is served.
    fn into_bytes(mut self) -> Bytes {
        match (self.first.take(), self.segments.len()) {
            (Some(first), _) => first,
            (None, 1) => self.segments.pop().unwrap_or_default().freeze(),
            (None, _) => self.into_owned(),
        }
    }

    /// The body in an allocation of exactly its length and of its own, for a record,
    /// which keeps it for the whole retention.
    fn into_owned(mut self) -> Bytes {
        if let Some(first) = self.first.take() {
            return Bytes::copy_from_slice(&first);
        }
        if let [segment] = self.segments.as_slice()
            && segment.capacity() == segment.len()
        {
            return self.segments.pop().unwrap_or_default().freeze();
        }
        let mut owned = BytesMut::with_capacity(self.copied);
        for segment in &self.segments {
            owned.extend_from_slice(segment);
        }
        owned.freeze()
    }
}

/// A response body read as far as the proxy may record it.
pub(crate) enum Buffered {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// The limit was passed, or the byte budget could not hold more: what was read so
    /// far, and the rest, still to stream.
    Cut {
        head: Vec<Bytes>,
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
            head: Vec::new(),
            rest: body,
            over_budget: true,
        });
    }
    let read = async {
        let mut gathered = Gathered::new(declared);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| UpstreamError::Failed(error.into()))?;
            if let Ok(data) = frame.into_data() {
                let over_budget = declared.is_none() && !reserve(data.len() as u64);
                gathered.push(data);
                if gathered.len() as u64 > limit || over_budget {
                    return Ok(Err((gathered.into_frames(), over_budget)));
                }
            }
        }
        Ok::<_, UpstreamError>(Ok(gathered.into_owned()))
    };
    // `read` borrows `body`; the borrow ends with this statement.
    let outcome = tokio::time::timeout_at(deadline, read).await;
    match outcome {
        Err(_) => Err(UpstreamError::Timeout(timeout)),
        Ok(Err(error)) => Err(error),
        Ok(Ok(Ok(whole))) => Ok(Buffered::Whole(whole)),
        Ok(Ok(Err((head, over_budget)))) => Ok(Buffered::Cut {
            head,
            rest: body,
            over_budget,
        }),
    }
}

/// A streamed body: what was already read of it (its head, in the frames it was read
/// in), then the rest, cut off with an error if `deadline` passes first.
pub(crate) struct StreamedBody {
    head: VecDeque<Bytes>,
    rest: Incoming,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
}

impl StreamedBody {
    pub(crate) fn new(head: Vec<Bytes>, rest: Incoming, deadline: Instant, timeout: Duration) -> StreamedBody {
        StreamedBody {
            head: head.into(),
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
        if let Some(head) = self.head.pop_front() {
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
        self.head.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let head = self.head.iter().map(|frame| frame.len() as u64).sum::<u64>();
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint.set_lower(rest.lower() + head);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(sizes: &[usize]) -> Vec<Bytes> {
        let mut next = 0u8;
        sizes
            .iter()
            .map(|size| {
                let frame: Vec<u8> = (0..*size)
                    .map(|_| {
                        next = next.wrapping_add(7);
                        next
                    })
                    .collect();
                Bytes::from(frame)
            })
            .collect()
    }

    fn gather(declared: Option<u64>, frames: &[Bytes]) -> Gathered {
        let mut gathered = Gathered::new(declared);
        for frame in frames {
            gathered.push(frame.clone());
        }
        gathered
    }

    fn allocated(gathered: &Gathered) -> usize {
        gathered.segments.iter().map(BytesMut::capacity).sum()
    }

    #[test]
    fn a_body_without_a_declared_length_holds_about_its_length_however_it_is_framed() {
        for sizes in [vec![65_536; 16], vec![1; 100_000], vec![3, 70_000, 1, 200_000, 5, 17]] {
            let frames = frames(&sizes);
            let whole: Vec<u8> = frames.iter().flat_map(|frame| frame.iter().copied()).collect();
            let gathered = gather(None, &frames);
            assert_eq!(gathered.len(), whole.len());
            // A buffer grown by doubling would hold up to twice the length.
            assert!(
                allocated(&gathered) <= whole.len() + SEGMENT,
                "{} bytes allocated for {}",
                allocated(&gathered),
                whole.len()
            );
            let head: Vec<u8> = gather(None, &frames).into_frames().concat();
            assert_eq!(head, whole);
            assert_eq!(gathered.into_owned(), whole);
        }
    }

    #[test]
    fn a_body_of_a_declared_length_is_copied_once_into_one_allocation_of_it() {
        let frames = frames(&[10, 5_000, 100_000, 1]);
        let length: usize = frames.iter().map(Bytes::len).sum();
        let gathered = gather(Some(length as u64), &frames);
        assert_eq!((gathered.segments.len(), allocated(&gathered)), (1, length));
        let at = gathered.segments[0].as_ptr();
        let owned = gathered.into_owned();
        assert_eq!(owned.as_ptr(), at, "copied again");
        assert_eq!(owned, frames.concat());
    }

    #[test]
    fn a_body_of_one_frame_is_kept_as_it_came_and_a_record_gets_its_own_copy() {
        for declared in [None, Some(4_096)] {
            let frame = frames(&[4_096]).remove(0);
            assert_eq!(
                gather(declared, std::slice::from_ref(&frame)).into_bytes().as_ptr(),
                frame.as_ptr()
            );
            let owned = gather(declared, std::slice::from_ref(&frame)).into_owned();
            assert_ne!(owned.as_ptr(), frame.as_ptr());
            assert_eq!(owned, frame);
        }
    }
}
