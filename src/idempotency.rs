//! The idempotency rules: parsing the key, the request fingerprint, the one function
//! that derives a record's store key, what a claim's outcome means for the request
//! (`Decision`), and which upstream responses are recorded. Pure: no I/O here.

use std::time::Duration;

use http::header::GetAll;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use ring::digest;

use crate::canonical_json;
use crate::config::{FingerprintBody, OnServerError, OnUnauthorized};
use crate::error::{Completion, KeyError, Rejection};
use crate::store::{
    ClaimOutcome, ClientId, Existing, Fingerprint, Probe, RecordState, ScopeId, StoreKey, StoredResponse, UnknownReason,
};

pub mod source;

/// The `Retry-After` of a 409 `request-in-progress`, at most.
pub const IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to 255 visible ASCII characters.
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key, put in a path, could read as a dot segment to an upstream
    /// that decodes every escape before it removes dot segments (nginx's location
    /// matching does): split at `/`, `\\`, `%2F` and `%5C`, a piece that is `.` or `..`
    /// once `%2E` is decoded. `a/../../admin` sent as one escaped segment would reach
    /// `/admin`.
    pub fn has_dot_segment(&self) -> bool {
        let decoded = self
            .0
            .to_ascii_lowercase()
            .replace("%2f", "/")
            .replace("%5c", "/")
            .replace('\\', "/")
            .replace("%2e", ".");
        // Dots alone, `...` too: some servers read more than two dots as a parent.
        decoded
            .split('/')
            .any(|piece| !piece.is_empty() && piece.bytes().all(|byte| byte == b'.'))
    }
}

impl std::fmt::Debug for IdempotencyKey {
    /// Never prints the key itself: `key#` and the first 12 hex digits of its SHA-256.
    /// (Logs name a request by its record instead: `StoreKey::short_hash`.)
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let digest = digest::digest(&digest::SHA256, self.0.as_bytes());
        write!(
            f,
            "key#{}",
            const_hex::encode(digest.as_ref().get(..6).unwrap_or_default())
        )
    }
}

/// Reads the idempotency key from every field line of its header.
///
/// `Ok(None)` when the header is absent. A key is accepted bare (`abc`) or as an
/// RFC 8941 string (`"abc"`); both name the same key. Anything else is an error:
/// a repeated header, a list, an empty key, more than 255 characters, or any byte
/// that is not visible ASCII.
pub fn parse_key(values: GetAll<'_, HeaderValue>) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = values.iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_key_value(value.as_bytes()).map(Some)
}

/// Parses one field value; see `parse_key`.
pub fn parse_key_value(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
    let trimmed = raw.trim_ascii();
    let key = match trimmed.first() {
        Some(b'"') => unquote(trimmed)?,
        _ => {
            if trimmed.contains(&b',') {
                return Err(KeyError::Repeated);
            }
            trimmed.to_vec()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::NotVisibleAscii);
    }
    // Only visible ASCII remains, so this cannot fail.
    String::from_utf8(key)
        .map(IdempotencyKey)
        .map_err(|_| KeyError::NotVisibleAscii)
}

/// Decodes an RFC 8941 sf-string that must span the whole field value.
fn unquote(quoted: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(quoted.len());
    let mut bytes = quoted[1..].iter();
    loop {
        match bytes.next() {
            None => return Err(KeyError::MalformedString),
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c),
                _ => return Err(KeyError::MalformedString),
            },
            Some(b'"') => break,
            // Any other byte: the caller refuses what is not visible ASCII.
            Some(&c) => out.push(c),
        }
    }
    match bytes.as_slice() {
        [] => Ok(out),
        rest if rest.trim_ascii_start().starts_with(b",") => Err(KeyError::Repeated),
        _ => Err(KeyError::MalformedString),
    }
}

/// Appends `bytes` with a 64-bit length before it, so concatenations cannot collide.
fn put(context: &mut digest::Context, bytes: &[u8]) {
    context.update(&(bytes.len() as u64).to_be_bytes());
    context.update(bytes);
}

/// Appends every value of `name` in `headers`, with a count before them.
fn put_header(context: &mut digest::Context, headers: &HeaderMap, name: &HeaderName) {
    let values = headers.get_all(name);
    context.update(&(values.iter().count() as u64).to_be_bytes());
    for value in values {
        put(context, value.as_bytes());
    }
}

/// The fingerprint of a request: its method, path, query, the route's
/// `fingerprint_headers`, and its body: its bytes, or with `FingerprintBody::Json` its
/// canonical JSON (see `canonical_json`) when it has one.
pub fn fingerprint(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    fingerprint_headers: &[HeaderName],
    body_rule: &FingerprintBody,
    body: &[u8],
) -> Fingerprint {
    let mut context = digest::Context::new(&digest::SHA256);
    put(&mut context, method.as_str().as_bytes());
    put(&mut context, uri.path().as_bytes());
    match uri.query() {
        None => context.update(&[0]),
        Some(query) => {
            context.update(&[1]);
            put(&mut context, query.as_bytes());
        }
    }
    context.update(&(fingerprint_headers.len() as u64).to_be_bytes());
    for name in fingerprint_headers {
        put(&mut context, name.as_str().as_bytes());
        put_header(&mut context, headers, name);
    }
    match body_rule {
        // Unchanged since the first round, so records made before stay comparable.
        FingerprintBody::Bytes => put(&mut context, body),
        FingerprintBody::Json { ignore } => match canonical_json::canonical(body, ignore) {
            Some(canonical) => {
                context.update(b"J");
                put(&mut context, &canonical);
            }
            None => {
                context.update(b"B");
                put(&mut context, body);
            }
        },
    }
    Fingerprint(digest_array(&context.finish()))
}

/// A SHA-256 digest as the 32-byte array it always is.
fn digest_array(digest: &digest::Digest) -> [u8; 32] {
    digest.as_ref().try_into().unwrap_or_default()
}

/// The one derivation of a record's store key:
/// `{key_prefix}:{route}:{{hex(sha256(length-prefixed scope values and key))}}`, the
/// hash in braces (the Redis Cluster hash tag).
///
/// `scope` holds, for each of the route's `scope_headers`, all of its values. Every
/// part is length-prefixed, so ("a:b", "c") and ("a", "b:c") never meet. Raw client
/// bytes never appear in the result; `key_prefix` and `route` come from the config.
pub fn store_key(key_prefix: &str, route: &str, scope: &[Vec<&[u8]>], key: &IdempotencyKey) -> StoreKey {
    let mut context = digest::Context::new(&digest::SHA256);
    context.update(&(scope.len() as u64).to_be_bytes());
    for values in scope {
        context.update(&(values.len() as u64).to_be_bytes());
        for value in values {
            put(&mut context, value);
        }
    }
    put(&mut context, key.as_str().as_bytes());
    let mut derived = String::with_capacity(key_prefix.len() + route.len() + 4 + 64);
    derived.push_str(key_prefix);
    derived.push(':');
    derived.push_str(route);
    // The hash in braces is the key's Redis Cluster hash tag: a record's slot comes
    // from its hash alone, so records spread over every shard, and every key one record
    // may use shares the tag and the slot. No client byte can reach the tag.
    derived.push_str(":{");
    derived.push_str(const_hex::Buffer::<32>::new().format(&digest_array(&context.finish())));
    derived.push('}');
    StoreKey::from_derived(derived)
}

/// The client a record is counted against: its route and its scope, as a number only
/// this process and its store file know (SipHash keyed by `store::identity`, so no
/// client can aim at another's), or `None` on a route without scope, where every
/// client is one.
pub fn scope_id(route: &str, scope: &[Vec<&[u8]>]) -> Option<ScopeId> {
    use std::hash::Hasher;
    if scope.is_empty() {
        return None;
    }
    let mut hasher = siphasher::sip::SipHasher13::new_with_key(crate::store::identity::key());
    hasher.write_u8(b's');
    hasher.write_usize(route.len());
    hasher.write(route.as_bytes());
    hasher.write_usize(scope.len());
    for values in scope {
        hasher.write_usize(values.len());
        for value in values {
            hasher.write_usize(value.len());
            hasher.write(value);
        }
    }
    Some(ScopeId(hasher.finish()))
}

/// The client address a record is counted against: an IPv4 address, or an IPv6
/// address's /64 (what one host is usually given), as a number only this process
/// knows, keyed as `scope_id` is.
pub fn client_id(addr: std::net::IpAddr) -> ClientId {
    use std::hash::Hasher;
    let mut hasher = siphasher::sip::SipHasher13::new_with_key(crate::store::identity::key());
    hasher.write_u8(b'c');
    match addr {
        std::net::IpAddr::V4(v4) => hasher.write(&v4.octets()),
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => hasher.write(&v4.octets()),
            None => hasher.write(&v6.octets()[..8]),
        },
    }
    ClientId(hasher.finish())
}

/// What the proxy does with a guarded request once its claim has answered. `C` is what
/// an acquired claim gives the claimant (see `ClaimOutcome`).
#[derive(Debug)]
pub(crate) enum Decision<C = ()> {
    /// The claim was acquired: forward the request.
    Forward(C),
    /// A response was recorded for this key and this request: replay it.
    Replay(StoredResponse),
    /// Answer with a problem and forward nothing.
    Reject(Rejection),
    /// The first request's outcome is unknown: forward nothing, and answer 409
    /// `outcome-unknown`, reconciling as the route's probe and the record say, and
    /// saying why the outcome is unknown.
    Unknown(Probe, UnknownReason),
}

/// Turns a claim's outcome into a decision for a request with `fingerprint`.
pub(crate) fn decide<C>(outcome: ClaimOutcome<C>, fingerprint: Fingerprint) -> Decision<C> {
    let (recorded, state) = match outcome {
        ClaimOutcome::Acquired(claim) => return Decision::Forward(claim),
        ClaimOutcome::Existing(Existing { fingerprint, state }) => (fingerprint, state),
    };
    if recorded != fingerprint {
        return Decision::Reject(Rejection::KeyReused);
    }
    match state {
        RecordState::Completed(response) => Decision::Replay(response),
        // Past its retention: never run again, and never a made-up answer.
        RecordState::Spent(spent) => Decision::Reject(Rejection::ResponseExpired(Completion {
            status: spent.status.as_u16(),
            at: spent.completed_at,
        })),
        // Most requests finish long before their lease ends: ask for a retry soon.
        RecordState::InFlight { lease_remaining } => Decision::Reject(Rejection::InProgress {
            retry_after: lease_remaining.clamp(Duration::from_millis(1), IN_PROGRESS_RETRY_AFTER),
            lease_remaining,
        }),
        RecordState::LeaseExpired => Decision::Unknown(Probe::Unscheduled, UnknownReason::LeaseExpired),
        RecordState::Unknown { probe, reason } => Decision::Unknown(probe, reason),
    }
}

/// What happens to a claim once the upstream has answered with a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    /// Record the response; every retry replays it.
    Record,
    /// Free the key; a retry runs again.
    Release,
}

/// docs/design.md §3: 2xx, 3xx and 4xx are recorded, except 408, 409, 425 and 429, which
/// release the claim; a 401 or 403 follows `on_unauthorized` (released by default: the
/// request was refused, not executed, and a scope made of a credential the upstream
/// refused is nobody's); a 5xx follows `on_server_error`.
pub fn recording_for(status: StatusCode, on_server_error: OnServerError, on_unauthorized: OnUnauthorized) -> Recording {
    match status.as_u16() {
        408 | 409 | 425 | 429 => Recording::Release,
        401 | 403 => match on_unauthorized {
            OnUnauthorized::Release => Recording::Release,
            OnUnauthorized::Store => Recording::Record,
        },
        500..=599 => match on_server_error {
            OnServerError::Release => Recording::Release,
            OnServerError::Store => Recording::Record,
        },
        _ => Recording::Record,
    }
}

#[cfg(test)]
mod tests;
