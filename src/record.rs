//! The recorded response, as every retry sees it: a status, the end-to-end headers and
//! the body. It is made once from the upstream's response, encoded for the store, and
//! decoded once at the store boundary into a value that cannot hold a bad status or a
//! bad header: a record that does not decode is a store error, never a made-up answer.

use bytes::Bytes;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{self, HeaderName, HeaderValue};
use http::{Response, StatusCode, response};

use crate::config::{IdempotencyPolicy, ReplayKind};

/// Set on every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Recorded with every response a resolution of an unknown outcome wrote (an
/// operator's or a probe's), so every replay of it says so.
pub const IDEMPOTENCY_RECONCILED: HeaderName = HeaderName::from_static("idempotency-reconciled");

/// Set on the first response and every replay of a recorded one: when replays stop
/// (an HTTP date), after which a retry gets 410 `response-expired` (docs/design.md §24).
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// The field a record keeps when its replays stop in (milliseconds since the Unix
/// epoch), inside the store's header encoding like the execution's trace: never
/// replayed as it is, but as `Idempotency-Expires`.
const REPLAY_UNTIL: HeaderName = HeaderName::from_static("idemproxy-replay-until");

/// The field a record keeps its execution's trace in, inside the store's header
/// encoding (so neither store's layout changes): never replayed, and an upstream's own
/// field of that name is never recorded.
const EXECUTION_TRACE: HeaderName = HeaderName::from_static("idemproxy-execution-trace");

/// The one field of a sealed record (`store::sealed`), naming the key that sealed it:
/// never replayed, and an upstream's own field of that name is never recorded.
pub(crate) const SEALED: HeaderName = HeaderName::from_static("idemproxy-sealed");

/// `<trace id>-<span id>` in hex: 32 digits, a dash, 16 digits.
const TRACE_TEXT: usize = 32 + 1 + 16;

/// The trace of the request that executed a recorded response (its trace id and the
/// id of its request span), for a replay's span to link to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutionTrace {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

impl ExecutionTrace {
    /// The trace id, as 32 lowercase hex digits (as a `traceparent` writes it).
    pub fn trace_id_hex(self) -> String {
        const_hex::encode(self.trace_id)
    }

    /// `<trace id>-<span id>` in hex.
    fn encode(self) -> [u8; TRACE_TEXT] {
        let mut text = [b'-'; TRACE_TEXT];
        // Both halves are exactly twice their bytes' length: encoding cannot fail.
        let _ = const_hex::encode_to_slice(self.trace_id, &mut text[..32]);
        let _ = const_hex::encode_to_slice(self.span_id, &mut text[33..]);
        text
    }

    fn decode(text: &[u8]) -> Option<ExecutionTrace> {
        let (trace_id, rest) = text.split_at_checked(32)?;
        let span_id = rest.strip_prefix(b"-")?;
        Some(ExecutionTrace {
            trace_id: const_hex::decode_to_array(trace_id).ok()?,
            span_id: const_hex::decode_to_array(span_id).ok()?,
        })
    }
}

/// An upstream response as recorded for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: StatusCode,
    /// The end-to-end fields, in the order the upstream sent them; no `Content-Length`,
    /// which is derived again from the body.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
    /// The trace of the request that executed it, when tracing was on.
    pub trace: Option<ExecutionTrace>,
    /// When its replays stop: its claim's time plus the route's retention, as the
    /// proxy that recorded it counted (`None`: recorded by an operator, or before
    /// this was kept).
    pub replay_until: Option<SystemTime>,
}

/// The names a record keeps for itself and never replays: an upstream's own field of
/// one of these names is never recorded.
fn reserved(name: &HeaderName) -> bool {
    *name == EXECUTION_TRACE || *name == SEALED || *name == REPLAY_UNTIL
}

/// `time` as whole milliseconds since the Unix epoch (zero before it): how records
/// keep times of the wall clock.
fn epoch_millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

/// The inverse of `epoch_millis`; `None` for a negative count or one past the clock's
/// range.
pub(crate) fn from_epoch_millis(millis: i64) -> Option<SystemTime> {
    UNIX_EPOCH.checked_add(Duration::from_millis(u64::try_from(millis).ok()?))
}

impl StoredResponse {
    /// A recorded JSON-RPC answer as the retry whose call's id is `id` (its JSON text)
    /// reads it: its `id` replaced, every other byte as recorded.
    pub(crate) fn with_call_id(mut self, id: &[u8]) -> StoredResponse {
        let event_stream = self.headers.iter().any(|(name, value)| {
            name == http::header::CONTENT_TYPE && value.as_bytes().starts_with(b"text/event-stream")
        });
        self.body = crate::calls::with_id(&self.body, event_stream, id);
        self
    }

    /// This response as a resolution of an unknown outcome records it (an operator's or
    /// a probe's): marked, so that every replay says so.
    pub fn reconciled(mut self) -> StoredResponse {
        self.headers
            .push((IDEMPOTENCY_RECONCILED, HeaderValue::from_static("true")));
        self
    }

    /// The record of a response whose hop-by-hop fields are already removed, without
    /// the fields in `exclude` (the route's `replay_exclude_headers`: a `Set-Cookie`
    /// reaches the first client and nobody else).
    pub fn from_parts(parts: &response::Parts, body: Bytes, exclude: &[HeaderName]) -> StoredResponse {
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| {
                *name != header::CONTENT_LENGTH
                    && *name != IDEMPOTENCY_EXPIRES
                    && !reserved(name)
                    && !exclude.contains(name)
            })
            // Copied: a parsed value may be a slice of the connection's read buffer,
            // which a record would otherwise keep alive for its whole retention.
            .map(|(name, value)| {
                (
                    name.clone(),
                    HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone()),
                )
            })
            .collect();
        StoredResponse {
            status: parts.status,
            headers,
            body,
            trace: None,
            replay_until: None,
        }
    }

    /// What a record of a route keeps of a response whose hop-by-hop fields are
    /// already removed, as its `replay` says: the whole response but
    /// `replay_exclude_headers` (`"stored"`), or only the status and `replay_headers`,
    /// without a body (`"status"`, `"refetch"`).
    pub fn recorded(parts: &response::Parts, body: Bytes, policy: &IdempotencyPolicy) -> StoredResponse {
        match policy.replay {
            ReplayKind::Stored => StoredResponse::from_parts(parts, body, &policy.replay_exclude_headers),
            ReplayKind::Status | ReplayKind::Refetch => {
                let headers = policy
                    .replay_headers
                    .iter()
                    .flat_map(|name| parts.headers.get_all(name).iter().map(move |value| (name, value)))
                    .filter(|(name, _)| {
                        !reserved(name) && **name != header::CONTENT_LENGTH && **name != IDEMPOTENCY_EXPIRES
                    })
                    .map(|(name, value)| (name.clone(), value.clone()))
                    .collect();
                StoredResponse {
                    status: parts.status,
                    headers,
                    body: Bytes::new(),
                    trace: None,
                    replay_until: None,
                }
            }
        }
    }

    /// This response, as executed by the request `trace` names.
    pub fn traced(mut self, trace: Option<ExecutionTrace>) -> StoredResponse {
        self.trace = trace;
        self
    }

    /// This response, replayed until `until`.
    pub fn replayed_until(mut self, until: Option<SystemTime>) -> StoredResponse {
        self.replay_until = until;
        self
    }

    /// The response a retry gets: the recorded one, marked as replayed, and saying
    /// until when it is.
    pub(crate) fn into_response(self) -> Response<Bytes> {
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        if let Some(until) = self.replay_until {
            headers.insert(IDEMPOTENCY_EXPIRES, http_date(until));
        }
        response
    }

    /// The bytes this record holds: its body, every header name and value, and its
    /// execution's trace.
    pub fn size(&self) -> usize {
        let trace = self.trace.map_or(0, |_| EXECUTION_TRACE.as_str().len() + TRACE_TEXT);
        let until = self.replay_until.map_or(0, |until| {
            REPLAY_UNTIL.as_str().len() + epoch_millis(until).to_string().len()
        });
        trace
            + until
            + self.body.len()
            + self
                .headers
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len())
                .sum::<usize>()
    }

    /// The headers in the store's encoding: a sequence of (u32 length, name, u32
    /// length, value), big-endian; the execution's trace last, as one more field.
    pub fn encode_headers(&self) -> Vec<u8> {
        self.encode_headers_with_room(0)
    }

    /// `encode_headers`, allocated with `room` bytes to spare after the fields.
    fn encode_headers_with_room(&self, room: usize) -> Vec<u8> {
        let fields = self
            .headers
            .iter()
            .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes()));
        let trace = self.trace.map(ExecutionTrace::encode);
        let until = self.replay_until.map(|until| epoch_millis(until).to_string());
        let kept = trace
            .as_ref()
            .map(|text| (&b"idemproxy-execution-trace"[..], &text[..]))
            .into_iter()
            .chain(
                until
                    .as_ref()
                    .map(|text| (&b"idemproxy-replay-until"[..], text.as_bytes())),
            );
        encode_fields(fields.chain(kept), room)
    }

    /// Rebuilds a record from the store's fields; `None` when any of them is not what
    /// `encode_headers` and a valid status would have written.
    pub fn decode(status: &[u8], headers: &[u8], body: Bytes) -> Option<StoredResponse> {
        let status = std::str::from_utf8(status).ok()?.parse::<u16>().ok()?;
        StoredResponse::from_fields(StatusCode::from_u16(status).ok()?, decode_headers(headers)?, body)
    }

    /// A record of `status`, the fields `encode_headers` wrote (the execution's trace
    /// and the end of its replays among them) and `body`.
    fn from_fields(
        status: StatusCode,
        mut headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
    ) -> Option<StoredResponse> {
        debug_assert_eq!(EXECUTION_TRACE.as_str(), "idemproxy-execution-trace");
        debug_assert_eq!(REPLAY_UNTIL.as_str(), "idemproxy-replay-until");
        let replay_until = match headers.pop_if(|(name, _)| *name == REPLAY_UNTIL) {
            Some((_, value)) => Some(from_epoch_millis(
                std::str::from_utf8(value.as_bytes()).ok()?.parse().ok()?,
            )?),
            None => None,
        };
        let trace = match headers.pop_if(|(name, _)| *name == EXECUTION_TRACE) {
            Some((_, value)) => Some(ExecutionTrace::decode(value.as_bytes())?),
            None => None,
        };
        Some(StoredResponse {
            status,
            headers,
            body,
            trace,
            replay_until,
        })
    }
}

/// A recorded response packed into one allocation, as the memory store keeps it: its
/// fields in the store's encoding, then its body. Kept as a `StoredResponse`, a record
/// held a vector of fields, an allocation per value and its body's slice of the
/// upstream connection's read buffer (which kept the rest of that buffer alive): about
/// 550 bytes for a 70-byte answer with three fields, against 180 packed. Each replay
/// unpacks it, its values slices of the one buffer.
#[derive(Debug, Clone)]
pub(crate) struct PackedResponse {
    status: StatusCode,
    /// The fields' encoded length: the body follows them.
    fields: usize,
    bytes: Bytes,
}

impl PackedResponse {
    pub(crate) fn pack(response: &StoredResponse) -> PackedResponse {
        let mut bytes = response.encode_headers_with_room(response.body.len());
        let fields = bytes.len();
        bytes.extend_from_slice(&response.body);
        PackedResponse {
            status: response.status,
            fields,
            bytes: Bytes::from(bytes),
        }
    }

    /// The response as it was packed; `None` only if the packing was not `pack`'s.
    pub(crate) fn unpack(&self) -> Option<StoredResponse> {
        let fields = decode_shared_headers(self.bytes.slice(..self.fields))?;
        StoredResponse::from_fields(self.status, fields, self.bytes.slice(self.fields..))
    }

    /// The bytes it holds: its fields' encoding and its body.
    pub(crate) fn size(&self) -> usize {
        self.bytes.len()
    }
}

/// `time` as an HTTP date (RFC 9110 §5.6.7), for `Idempotency-Expires`.
pub(crate) fn http_date(time: SystemTime) -> HeaderValue {
    // An IMF-fixdate is visible ASCII: always a valid field value.
    HeaderValue::try_from(httpdate::fmt_http_date(time)).unwrap_or(HeaderValue::from_static("0"))
}

/// Encodes response headers as a sequence of (u32 length, name, u32 length, value).
pub fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> Vec<u8> {
    encode_fields(
        headers
            .iter()
            .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes())),
        0,
    )
}

/// `encode_headers` over (name, value) byte pairs, allocated once at its exact size and
/// `room` bytes more (for what the caller appends).
fn encode_fields<'a>(fields: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone, room: usize) -> Vec<u8> {
    let size: usize = fields.clone().map(|(name, value)| 8 + name.len() + value.len()).sum();
    let mut out = Vec::with_capacity(size + room);
    for (name, value) in fields {
        for field in [name, value] {
            // Header names and values are far below 4 GiB: hyper refuses heads over 64 KiB.
            out.extend_from_slice(&u32::try_from(field.len()).unwrap_or(u32::MAX).to_be_bytes());
            out.extend_from_slice(field);
        }
    }
    out
}

/// The inverse of `encode_headers`; `None` on any malformed input, including a name
/// or a value that is not a valid header field. The values share one copy of `input`.
pub fn decode_headers(input: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
    decode_shared_headers(Bytes::copy_from_slice(input))
}

/// `decode_headers` over a shared buffer: each value is a slice of `input`, not a copy.
fn decode_shared_headers(mut input: Bytes) -> Option<Vec<(HeaderName, HeaderValue)>> {
    use bytes::Buf;
    fn take(input: &mut Bytes) -> Option<Bytes> {
        let len = usize::try_from(u32::from_be_bytes(input.get(..4)?.try_into().ok()?)).ok()?;
        input.advance(4);
        (len <= input.len()).then(|| input.split_to(len))
    }
    let mut headers = Vec::new();
    while !input.is_empty() {
        let name = HeaderName::from_bytes(&take(&mut input)?).ok()?;
        let value = HeaderValue::from_maybe_shared(take(&mut input)?).ok()?;
        headers.push((name, value));
    }
    Some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> Vec<(HeaderName, HeaderValue)> {
        vec![
            (header::CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (HeaderName::from_static("x-empty"), HeaderValue::from_static("")),
            (header::SET_COOKIE, HeaderValue::from_static("a=1")),
            (header::SET_COOKIE, HeaderValue::from_static("b=2")),
        ]
    }

    #[test]
    fn headers_round_trip() {
        assert_eq!(decode_headers(&encode_headers(&headers())), Some(headers()));
    }

    #[test]
    fn the_encoding_is_allocated_once_at_its_exact_size() {
        let encoded = encode_headers(&headers());
        let expected: usize = headers().iter().map(|(n, v)| 8 + n.as_str().len() + v.len()).sum();
        assert_eq!(encoded.len(), expected);
        assert_eq!(encoded.capacity(), encoded.len(), "no growth, no spare capacity");
    }

    /// A packed response unpacks to what was packed, its trace and the end of its
    /// replays included, in one allocation at its exact size; the body no longer shares
    /// the buffer it came in.
    #[test]
    fn a_packed_response_unpacks_to_what_was_packed() {
        let read_buffer = Bytes::from(vec![b'x'; 8192]);
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: headers(),
            body: read_buffer.slice(100..170),
            trace: Some(ExecutionTrace {
                trace_id: [7; 16],
                span_id: [9; 8],
            }),
            replay_until: from_epoch_millis(1_796_554_220_000),
        };
        let packed = PackedResponse::pack(&response);
        assert_eq!(packed.unpack(), Some(response.clone()));
        assert_eq!(packed.size(), response.encode_headers().len() + 70);
        assert_eq!(packed.bytes.len(), packed.size());
        let plain = StoredResponse {
            headers: Vec::new(),
            body: Bytes::new(),
            trace: None,
            replay_until: None,
            ..response
        };
        assert_eq!(PackedResponse::pack(&plain).unpack(), Some(plain));
    }

    #[test]
    fn truncated_headers_are_rejected() {
        let encoded = encode_headers(&[(HeaderName::from_static("a"), HeaderValue::from_static("bc"))]);
        for cut in 1..encoded.len() {
            assert_eq!(decode_headers(&encoded[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_corrupt_record_is_refused_never_guessed() {
        let good = encode_headers(&headers());
        assert!(StoredResponse::decode(b"201", &good, Bytes::new()).is_some());
        assert_eq!(
            StoredResponse::decode(b"1000", &good, Bytes::new()),
            None,
            "status out of range"
        );
        assert_eq!(StoredResponse::decode(b"abc", &good, Bytes::new()), None);
        assert_eq!(StoredResponse::decode(b"", &good, Bytes::new()), None);
        // A name with a space and a value with a newline are not header fields.
        let mut bad_name = 3u32.to_be_bytes().to_vec();
        bad_name.extend_from_slice(b"a b");
        bad_name.extend_from_slice(&1u32.to_be_bytes());
        bad_name.push(b'v');
        assert_eq!(StoredResponse::decode(b"200", &bad_name, Bytes::new()), None);
        let mut bad_value = 1u32.to_be_bytes().to_vec();
        bad_value.push(b'a');
        bad_value.extend_from_slice(&3u32.to_be_bytes());
        bad_value.extend_from_slice(b"x\ny");
        assert_eq!(StoredResponse::decode(b"200", &bad_value, Bytes::new()), None);
    }

    #[test]
    fn a_record_keeps_its_execution_trace_and_never_replays_it() {
        let trace = ExecutionTrace {
            trace_id: *b"0123456789abcdef",
            span_id: *b"spanid!!",
        };
        let mut parts = Response::new(()).into_parts().0;
        parts.headers = headers().into_iter().collect();
        // An upstream's own field of the reserved name is not recorded.
        parts
            .headers
            .insert(EXECUTION_TRACE, HeaderValue::from_static("forged"));
        let stored = StoredResponse::from_parts(&parts, Bytes::from_static(b"{}"), &[]).traced(Some(trace));
        assert_eq!(stored.headers.len(), headers().len(), "{:?}", stored.headers);
        let encoded = stored.encode_headers();
        assert_eq!(encoded.capacity(), encoded.len(), "allocated once, at its exact size");
        let decoded = StoredResponse::decode(b"201", &encoded, Bytes::from_static(b"{}"));
        let decoded = decoded.expect("decodes");
        assert_eq!(decoded.trace, Some(trace));
        assert_eq!(decoded.headers, stored.headers);
        assert_eq!(trace.trace_id_hex(), const_hex::encode(b"0123456789abcdef"));
        let replay = decoded.into_response();
        assert!(replay.headers().get(&EXECUTION_TRACE).is_none());
        // Without a trace, the encoding is what it always was.
        let plain = StoredResponse::from_parts(&parts, Bytes::new(), &[]);
        assert_eq!(plain.encode_headers(), encode_headers(&headers()));
        // A malformed trace is a record that does not decode, never a guess.
        let mut bad = headers();
        bad.push((EXECUTION_TRACE, HeaderValue::from_static("0123-xyz")));
        assert_eq!(
            StoredResponse::decode(b"201", &encode_headers(&bad), Bytes::new()),
            None
        );
    }

    #[test]
    fn a_replay_carries_the_record_and_the_marker() {
        let mut parts = Response::new(()).into_parts().0;
        parts.status = StatusCode::PAYMENT_REQUIRED;
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        for (name, value) in headers() {
            parts.headers.append(name, value);
        }
        let stored = StoredResponse::from_parts(&parts, Bytes::from_static(b"{}"), &[]);
        assert_eq!(
            stored.headers,
            headers(),
            "content-length is derived again, never recorded"
        );
        let without_cookies = StoredResponse::from_parts(&parts, Bytes::new(), &[header::SET_COOKIE]);
        assert!(
            without_cookies
                .headers
                .iter()
                .all(|(name, _)| name != header::SET_COOKIE)
        );
        assert_eq!(without_cookies.headers.len(), headers().len() - 2);
        let replay = stored.into_response();
        assert_eq!(replay.status(), StatusCode::PAYMENT_REQUIRED);
        assert_eq!(replay.headers().get_all(header::SET_COOKIE).iter().count(), 2);
        assert_eq!(
            replay.headers().get(&IDEMPOTENT_REPLAYED).map(HeaderValue::as_bytes),
            Some(&b"true"[..])
        );
    }
}
