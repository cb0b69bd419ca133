//! The record store: claim, complete, mark unknown and release, each one atomic
//! operation on one record under one store key. `redis` and `memory` implement the
//! same trait with the same semantics, and one test suite runs against both.
//! The store knows nothing of HTTP routing or of how store keys are derived.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use crate::error::StoreError;

pub mod memory;
pub mod redis;

pub use self::memory::MemoryStore;
pub use self::redis::RedisStore;

/// The name of one record in the store. Only `idempotency::store_key` makes these,
/// so writer and reader always agree on it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct StoreKey(String);

impl StoreKey {
    pub(crate) fn from_derived(key: String) -> StoreKey {
        StoreKey(key)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A random 128-bit token naming the one proxy request that owns a claim.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken([u8; 16]);

impl OwnerToken {
    pub fn generate() -> OwnerToken {
        use ring::rand::SecureRandom;
        let mut bytes = [0u8; 16];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .expect("the operating system's random source failed");
        OwnerToken(bytes)
    }

    pub fn to_hex(self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({})", &self.to_hex()[..8])
    }
}

/// SHA-256 over everything that makes two requests "the same request".
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn to_hex(self) -> String {
        hex(&self.0)
    }

    pub fn from_hex(text: &[u8]) -> Option<Fingerprint> {
        let bytes = unhex(text)?;
        bytes.try_into().ok().map(Fingerprint)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..12])
    }
}

/// An upstream response as recorded for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, Bytes)>,
    pub body: Bytes,
}

/// Why a record became unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownReason {
    UpstreamTimeout,
    UpstreamFailed,
    ResponseTooLarge,
}

impl UnknownReason {
    pub fn as_str(self) -> &'static str {
        match self {
            UnknownReason::UpstreamTimeout => "upstream-timeout",
            UnknownReason::UpstreamFailed => "upstream-failed",
            UnknownReason::ResponseTooLarge => "response-too-large",
        }
    }

    pub fn parse(text: &[u8]) -> Option<UnknownReason> {
        match text {
            b"upstream-timeout" => Some(UnknownReason::UpstreamTimeout),
            b"upstream-failed" => Some(UnknownReason::UpstreamFailed),
            b"response-too-large" => Some(UnknownReason::ResponseTooLarge),
            _ => None,
        }
    }
}

/// What a claim asks for.
#[derive(Debug, Clone)]
pub struct Claim {
    pub key: StoreKey,
    pub owner: OwnerToken,
    pub fingerprint: Fingerprint,
    /// The whole record lives exactly this long from the claim.
    pub retention: Duration,
    /// The owner's lease: after it the record reads as unknown.
    pub lease: Duration,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The record is now in flight and owned by the claimant.
    Acquired,
    /// Another request owns or owned the key.
    Existing {
        fingerprint: Fingerprint,
        state: RecordState,
    },
}

/// The state of a record that somebody else claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    InFlight {
        lease_remaining: Duration,
    },
    /// In flight, but its lease has run out: its owner died or lost the store.
    LeaseExpired,
    Completed(StoredResponse),
    Unknown(UnknownReason),
}

/// Whether a compare-and-set write changed the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    Applied,
    /// The record no longer belongs to this owner, or is no longer in flight.
    Fenced,
}

/// The record lifecycle of DESIGN §4. Every write is a compare-and-set on the owner
/// token and the `in_flight` state, and no write moves the record's expiry.
pub trait RecordStore: Send + Sync + 'static {
    /// Creates an `in_flight` record if none exists, else returns the existing one.
    /// Finding one's own in-flight claim counts as acquired.
    fn claim(&self, claim: &Claim) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// `in_flight` -> `completed`, while the lease holds.
    fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<Write, StoreError>> + Send;

    /// `in_flight` -> `unknown`.
    fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> impl Future<Output = Result<Write, StoreError>> + Send;

    /// Removes an `in_flight` record whose request was never forwarded.
    fn release(&self, key: &StoreKey, owner: OwnerToken) -> impl Future<Output = Result<Write, StoreError>> + Send;

    /// Removes a record whatever its state: an operator's tool, never on the request path.
    fn purge(&self, key: &StoreKey) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Answers when the store is reachable.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The configured store: one of the two backends.
#[derive(Clone)]
pub enum AnyStore {
    Memory(MemoryStore),
    Redis(RedisStore),
}

macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($store) => $call.await,
            AnyStore::Redis($store) => $call.await,
        }
    };
}

impl RecordStore for AnyStore {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        delegate!(self, store => store.claim(claim))
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        delegate!(self, store => store.complete(key, owner, response))
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<Write, StoreError> {
        delegate!(self, store => store.mark_unknown(key, owner, reason))
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        delegate!(self, store => store.release(key, owner))
    }

    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        delegate!(self, store => store.purge(key))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        delegate!(self, store => store.ping())
    }
}

// === record encoding ===

/// Encodes response headers as a sequence of (u32 length, name, u32 length, value).
pub fn encode_headers(headers: &[(String, Bytes)]) -> Vec<u8> {
    let size = headers.iter().map(|(n, v)| 8 + n.len() + v.len()).sum();
    let mut out = Vec::with_capacity(size);
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// The inverse of `encode_headers`; `None` on any malformed input.
pub fn decode_headers(mut input: &[u8]) -> Option<Vec<(String, Bytes)>> {
    fn take<'a>(input: &mut &'a [u8]) -> Option<&'a [u8]> {
        let (len, rest) = input.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        if rest.len() < len {
            return None;
        }
        let (field, rest) = rest.split_at(len);
        *input = rest;
        Some(field)
    }
    let mut headers = Vec::new();
    while !input.is_empty() {
        let name = std::str::from_utf8(take(&mut input)?).ok()?.to_string();
        let value = Bytes::copy_from_slice(take(&mut input)?);
        headers.push((name, value));
    }
    Some(headers)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Appends `bytes` to `out` as lower-case hex.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut buffer = [0u8; 64];
    for chunk in bytes.chunks(32) {
        for (pair, byte) in buffer.chunks_exact_mut(2).zip(chunk) {
            pair[0] = DIGITS[usize::from(byte >> 4)];
            pair[1] = DIGITS[usize::from(byte & 0xf)];
        }
        // Only ASCII digits were written.
        out.push_str(std::str::from_utf8(&buffer[..chunk.len() * 2]).unwrap_or_default());
    }
}

fn unhex(text: &[u8]) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let headers = vec![
            ("content-type".to_string(), Bytes::from_static(b"application/json")),
            ("x-empty".to_string(), Bytes::new()),
            ("set-cookie".to_string(), Bytes::from_static(b"a=1")),
            ("set-cookie".to_string(), Bytes::from_static(b"b=2")),
        ];
        assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
    }

    #[test]
    fn truncated_headers_are_rejected() {
        let encoded = encode_headers(&[("a".to_string(), Bytes::from_static(b"bc"))]);
        for cut in 1..encoded.len() {
            assert_eq!(decode_headers(&encoded[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn fingerprint_hex_round_trip() {
        let fingerprint = Fingerprint([0xab; 32]);
        assert_eq!(
            Fingerprint::from_hex(fingerprint.to_hex().as_bytes()),
            Some(fingerprint)
        );
        assert_eq!(Fingerprint::from_hex(b"zz"), None);
    }

    #[test]
    fn owner_tokens_differ() {
        assert_ne!(OwnerToken::generate(), OwnerToken::generate());
    }
}
