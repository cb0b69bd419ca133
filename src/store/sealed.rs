//! Sealed records (docs/design.md §20): with `[store.encryption]`, every recorded
//! response's fields and body are sealed with AES-256-GCM before any backend sees
//! them, and every fingerprint is an HMAC under the same key, so that what the store
//! holds (a Redis RDB, a replica, a backup, the SQLite file) reveals neither a response
//! nor a low-entropy request body. The status, state, expiry, owner and probe schedule
//! stay clear, so each backend's atomic steps are unchanged: `AnyStore`, which every
//! caller holds, seals with its `Sealer` on the way in and opens on the way out, the
//! same for every backend.
//!
//! A sealed response is stored as a response whose only field is `idemproxy-sealed:
//! <key id>` and whose body is `[version][nonce][ciphertext and tag]`; the plaintext is
//! the length of the encoded fields, the fields, then the body. The associated data
//! binds the version, the key id, the status and the store key, so a sealed value moved
//! to another record, or given another status, does not open. A record that does not
//! open, or whose key is no longer configured, is never run again: the claim reads it
//! as unknown (`unreadable`), and the probe leaves it to an operator.
//!
//! A record kept in clear is one written before encryption was on, or a forgery by
//! whoever can write the store: it is unreadable unless `accept_clear_records`, and
//! always when its fingerprint was made under a record key (only a sealed record has
//! one).

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use prometheus_client::metrics::counter::Counter;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use ring::{hkdf, hmac};

use super::{ClaimOutcome, ClaimRequest, Existing, Fingerprint, Probe, RecordState, StoreKey, StoredResponse};
use super::{Resolution, UnknownReason};
use crate::config::{Encryption, RecordKey};
use crate::error::StoreError;
use crate::record::{SEALED, decode_headers, encode_headers};

/// The envelope's version, the first byte of a sealed body and part of what it is
/// bound to.
const VERSION: u8 = 1;
const TAG_LEN: usize = 16;
const HEADER_LEN: usize = 1 + NONCE_LEN;

/// One record key's two uses, derived from it apart (HKDF-SHA256): sealing and
/// fingerprints never share a key.
struct Cipher {
    id: String,
    /// The id as the first four bytes of every fingerprint made under the key.
    id_bytes: [u8; 4],
    aead: LessSafeKey,
    mac: hmac::Key,
}

impl Cipher {
    fn new(key: &RecordKey) -> Cipher {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"idemproxy record key v1").extract(key.bytes());
        // Both lengths are what the algorithms take: neither expansion can fail.
        let seal = prk.expand(&[b"seal"], &AES_256_GCM).map(UnboundKey::from);
        let mac = prk.expand(&[b"fingerprint"], hmac::HMAC_SHA256).map(hmac::Key::from);
        match (seal, mac) {
            (Ok(seal), Ok(mac)) => Cipher {
                id: key.id().to_string(),
                id_bytes: const_hex::decode_to_array(key.id()).unwrap_or_default(),
                aead: LessSafeKey::new(seal),
                mac,
            },
            _ => unreachable!("HKDF-SHA256 expands to 32 bytes"),
        }
    }

    /// The key's id, then the first 28 bytes of the HMAC of `plain`: a fingerprint
    /// says which key made it, so that one made under a dropped key is known as such.
    fn fingerprint(&self, plain: Fingerprint) -> Fingerprint {
        let tag = hmac::sign(&self.mac, &plain.0);
        let mut out = [0u8; 32];
        out[..4].copy_from_slice(&self.id_bytes);
        out[4..].copy_from_slice(&tag.as_ref()[..28]);
        Fingerprint(out)
    }
}

/// What a sealed value is bound to besides its own bytes.
fn associated(id: &str, status: StatusCode, key: &StoreKey) -> Vec<u8> {
    let mut aad = Vec::with_capacity(32 + id.len() + key.as_str().len());
    aad.extend_from_slice(b"idemproxy sealed record\0");
    aad.push(VERSION);
    aad.extend_from_slice(id.as_bytes());
    aad.push(0);
    aad.extend_from_slice(&status.as_u16().to_be_bytes());
    aad.extend_from_slice(key.as_str().as_bytes());
    aad
}

/// What a record's fingerprint says of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recognised {
    Same,
    /// Another request's.
    Other,
    /// Made under a key no longer configured, or (before encryption was on) another
    /// request's: which one cannot be told.
    Unverifiable,
}

/// A completed record's response as an operator asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    /// The id of the key that sealed it; `None`: kept in clear.
    pub sealed_by: Option<String>,
    pub response: Result<StoredResponse, Unreadable>,
}

/// Why a recorded response cannot be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unreadable {
    /// Sealed under a key that is not configured (dropped from `previous_keys_env`).
    UnknownKey(String),
    /// Sealed under a configured key, and does not open: tampered, truncated, moved
    /// from another record.
    Broken(String),
    /// Sealed, and no key is configured at all.
    NoKeys(String),
    /// Opens, but its fingerprint names a key that is not configured: which request
    /// made it cannot be told.
    UncheckedFingerprint,
    /// Kept in clear, and clear records are refused (`accept_clear_records = false`).
    Clear,
    /// Kept in clear, yet its fingerprint was made under the record key `0`: a sealed
    /// record rewritten.
    ClearUnderKey(String),
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreadable::UnknownKey(id) => write!(f, "sealed under key {id}, which is not configured"),
            Unreadable::Broken(id) => write!(f, "sealed under key {id}, and does not open (altered or truncated)"),
            Unreadable::NoKeys(id) => write!(f, "sealed under key {id}, and [store.encryption] is not configured"),
            Unreadable::UncheckedFingerprint => f.write_str("its fingerprint names a key that is not configured"),
            Unreadable::Clear => f.write_str(
                "kept in clear, and [store.encryption] refuses clear records (accept_clear_records = false)",
            ),
            Unreadable::ClearUnderKey(id) => write!(
                f,
                "kept in clear, yet its fingerprint was made under key {id}: only a sealed record has one (rewritten?)"
            ),
        }
    }
}

/// The configured record keys: the current one seals, every one opens.
pub struct Sealer {
    current: Cipher,
    previous: Vec<Cipher>,
    random: SystemRandom,
    accept_clear: bool,
}

/// Records found that could not be opened, by any store of this process
/// (`idemproxy_records_unreadable_total`).
pub(crate) static UNREADABLE: std::sync::LazyLock<Counter> = std::sync::LazyLock::new(Counter::default);

impl Sealer {
    pub fn new(encryption: &Encryption) -> Sealer {
        Sealer {
            current: Cipher::new(&encryption.current),
            previous: encryption.previous.iter().map(Cipher::new).collect(),
            random: SystemRandom::new(),
            accept_clear: encryption.accept_clear_records,
        }
    }

    fn ciphers(&self) -> impl Iterator<Item = &Cipher> {
        std::iter::once(&self.current).chain(&self.previous)
    }

    /// The fingerprint a new record keeps: an HMAC of the request's under the current key.
    pub fn fingerprint(&self, plain: Fingerprint) -> Fingerprint {
        self.current.fingerprint(plain)
    }

    /// Whether the fingerprint a record kept is the one a request with `plain` makes:
    /// under the configured key it names, or `plain` itself (written before
    /// encryption was on); `Unverifiable` when it names no configured key.
    pub fn recognise(&self, stored: Fingerprint, plain: Fingerprint) -> Recognised {
        if stored == plain {
            return Recognised::Same;
        }
        match self.named_key(stored) {
            Some(cipher) if cipher.fingerprint(plain) == stored => Recognised::Same,
            Some(_) => Recognised::Other,
            None => Recognised::Unverifiable,
        }
    }

    /// `response` sealed for the record `key` under the current key.
    pub fn seal(&self, key: &StoreKey, response: &StoredResponse) -> Result<StoredResponse, StoreError> {
        let cipher = &self.current;
        let fields = encode_headers(&response.headers);
        let mut sealed = Vec::with_capacity(HEADER_LEN + 4 + fields.len() + response.body.len() + TAG_LEN);
        sealed.push(VERSION);
        let mut nonce = [0u8; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .map_err(|_| StoreError::Unready("no random source to seal the record with"))?;
        sealed.extend_from_slice(&nonce);
        // Fields are below 64 KiB each and few: their encoding fits in 32 bits.
        sealed.extend_from_slice(&u32::try_from(fields.len()).unwrap_or(u32::MAX).to_be_bytes());
        sealed.extend_from_slice(&fields);
        sealed.extend_from_slice(&response.body);
        let aad = associated(&cipher.id, response.status, key);
        let tag = cipher
            .aead
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad),
                &mut sealed[HEADER_LEN..],
            )
            .map_err(|_| StoreError::Unready("the record could not be sealed"))?;
        sealed.extend_from_slice(tag.as_ref());
        let marker =
            HeaderValue::from_str(&cipher.id).map_err(|_| StoreError::Protocol("a key id is not a field value"))?;
        Ok(StoredResponse {
            status: response.status,
            headers: vec![(SEALED, marker)],
            body: Bytes::from(sealed),
            // Not secret, and what the records API and a replay's span link to.
            trace: response.trace,
            // Not secret: what every replay tells its client.
            replay_until: response.replay_until,
        })
    }

    /// The configured key a fingerprint names by its first four bytes, if any.
    fn named_key(&self, fingerprint: Fingerprint) -> Option<&Cipher> {
        self.ciphers().find(|cipher| fingerprint.0[..4] == cipher.id_bytes)
    }

    /// The response `stored` holds, opened; one kept in clear (written before
    /// encryption was on) is as it was where `accept_clear_records` allows it.
    pub fn open(&self, key: &StoreKey, stored: StoredResponse) -> Result<StoredResponse, Unreadable> {
        let Some(id) = sealed_by(&stored) else {
            return if self.accept_clear {
                Ok(stored)
            } else {
                Err(Unreadable::Clear)
            };
        };
        let Some(cipher) = self.ciphers().find(|cipher| cipher.id == id) else {
            return Err(Unreadable::UnknownKey(id));
        };
        open_with(cipher, key, stored).ok_or(Unreadable::Broken(id))
    }
}

/// What a sealed probe key is bound to besides its own bytes: the key id and the record.
fn associated_text(id: &str, key: &StoreKey) -> Vec<u8> {
    let mut aad = Vec::with_capacity(40 + id.len() + key.as_str().len());
    aad.extend_from_slice(b"idemproxy sealed probe key\0");
    aad.push(VERSION);
    aad.extend_from_slice(id.as_bytes());
    aad.push(0);
    aad.extend_from_slice(key.as_str().as_bytes());
    aad
}

/// How a sealed probe key begins: a space, which no client key holds, so a key kept in
/// clear by an earlier release is never taken for one.
const SEALED_TEXT: &str = "sealed ";

impl Sealer {
    /// A client's key kept with its record for the probe (`probe_key`), sealed under
    /// the current key and bound to the record: `sealed <key id> <base64>`.
    pub fn seal_text(&self, key: &StoreKey, text: &str) -> Result<String, StoreError> {
        use base64::Engine as _;
        let cipher = &self.current;
        let mut nonce = [0u8; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .map_err(|_| StoreError::Unready("no random source to seal the record with"))?;
        let mut sealed = text.as_bytes().to_vec();
        let aad = associated_text(&cipher.id, key);
        cipher
            .aead
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(&aad), &mut sealed)
            .map_err(|_| StoreError::Unready("the record could not be sealed"))?;
        let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode([&nonce[..], &sealed].concat());
        Ok(format!("{SEALED_TEXT}{} {encoded}", cipher.id))
    }

    /// A probe key as `seal_text` kept it, opened; one kept in clear (by an earlier
    /// release) as it is. `None` when it does not open (its key dropped, or altered).
    pub fn open_text(&self, key: &StoreKey, kept: &str) -> Option<String> {
        use base64::Engine as _;
        let Some(rest) = kept.strip_prefix(SEALED_TEXT) else {
            return Some(kept.to_string());
        };
        let (id, encoded) = rest.split_once(' ')?;
        let cipher = self.ciphers().find(|cipher| cipher.id == id)?;
        let bytes = base64::engine::general_purpose::STANDARD_NO_PAD.decode(encoded).ok()?;
        let (nonce, sealed) = bytes.split_at_checked(NONCE_LEN)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut sealed = sealed.to_vec();
        let aad = associated_text(&cipher.id, key);
        let plain = cipher.aead.open_in_place(nonce, Aad::from(&aad), &mut sealed).ok()?;
        String::from_utf8(plain.to_vec()).ok()
    }
}

/// The id of the key that sealed `stored`, if it is sealed. A response whose fields
/// are anything but the one marker is not sealed (from_parts never records the
/// marker's name).
pub fn sealed_by(stored: &StoredResponse) -> Option<String> {
    match stored.headers.as_slice() {
        [(name, value)] if *name == SEALED => Some(String::from_utf8_lossy(value.as_bytes()).into_owned()),
        _ => None,
    }
}

/// Opens a record sealed under `cipher`; `None` if it does not open or does not
/// decode.
fn open_with(cipher: &Cipher, key: &StoreKey, stored: StoredResponse) -> Option<StoredResponse> {
    let (&version, rest) = stored.body.split_first()?;
    if version != VERSION || rest.len() < NONCE_LEN + 4 + TAG_LEN {
        return None;
    }
    let nonce = Nonce::try_assume_unique_for_key(&rest[..NONCE_LEN]).ok()?;
    let mut sealed = rest[NONCE_LEN..].to_vec();
    let aad = associated(&cipher.id, stored.status, key);
    let plain_len = cipher
        .aead
        .open_in_place(nonce, Aad::from(&aad), &mut sealed)
        .ok()?
        .len();
    sealed.truncate(plain_len);
    let (length, rest) = sealed.split_first_chunk::<4>()?;
    let length = usize::try_from(u32::from_be_bytes(*length)).ok()?;
    let fields = rest.get(..length)?;
    let headers = decode_headers(fields)?;
    let body = Bytes::from(sealed).slice(4 + length..);
    Some(StoredResponse {
        status: stored.status,
        headers,
        body,
        trace: stored.trace,
        replay_until: stored.replay_until,
    })
}

/// A claim's outcome with the record's fingerprint recognised and its response opened.
/// `sent`: the fingerprint the claim was sent with (its HMAC under the current key),
/// the one most records were written with: found, it needs no HMAC made again.
pub(super) fn opened(
    sealer: Option<&Sealer>,
    key: &StoreKey,
    plain: Fingerprint,
    sent: Fingerprint,
    outcome: ClaimOutcome,
) -> ClaimOutcome {
    let ClaimOutcome::Existing(Existing { fingerprint, state }) = outcome else {
        return outcome;
    };
    let recognised = match (sealer, &state) {
        (Some(_), _) if fingerprint == sent => Recognised::Same,
        (Some(sealer), _) => sealer.recognise(fingerprint, plain),
        (None, _) if fingerprint == plain => Recognised::Same,
        // Sealed, with encryption since turned off: its fingerprint is an HMAC that
        // cannot be checked.
        (None, RecordState::Completed(stored)) if sealed_by(stored).is_some() => Recognised::Unverifiable,
        (None, _) => Recognised::Other,
    };
    let unreadable = || RecordState::Unknown {
        reason: UnknownReason::Unreadable,
        probe: Probe::GaveUp,
    };
    // A record whose fingerprint cannot be checked is never replayed: a completed
    // one under a key no longer configured is unreadable (its response is sealed
    // under that key too); one kept in clear is another request's, written before
    // encryption was on. Any other state refuses whoever asks alike (409), so it is
    // answered as the same request's.
    let (fingerprint, state) = match (recognised, state) {
        (Recognised::Unverifiable, RecordState::Completed(stored))
            if sealed_by(&stored).is_none() && sealer.is_none_or(|sealer| sealer.accept_clear) =>
        {
            (fingerprint, RecordState::Completed(stored))
        }
        // Another request's is refused by `decide` whatever it holds, and opened all
        // the same, so that a store never hands out a sealed response.
        (recognised, RecordState::Completed(stored)) => {
            let shown = if recognised == Recognised::Other {
                fingerprint
            } else {
                plain
            };
            // Only a sealed record has a fingerprint made under a record key: one in
            // clear with such a fingerprint was rewritten by whoever can write the
            // store, with the status, fields and body of their choosing.
            let keyed = sealer
                .filter(|_| fingerprint != plain && sealed_by(&stored).is_none())
                .and_then(|sealer| sealer.named_key(fingerprint));
            let opened = match keyed {
                Some(cipher) => Err(Unreadable::ClearUnderKey(cipher.id.clone())),
                None => open_quietly(sealer, key, stored),
            };
            let opened = opened.and_then(|response| match recognised {
                // Opened, yet its fingerprint names a key not configured (resolved by
                // a process with another key): which request made it is unknown.
                Recognised::Unverifiable => Err(Unreadable::UncheckedFingerprint),
                Recognised::Same | Recognised::Other => Ok(response),
            });
            match opened {
                Ok(response) => (shown, RecordState::Completed(response)),
                Err(why) => {
                    reported(key, &why);
                    (shown, unreadable())
                }
            }
        }
        (Recognised::Other, state) => (fingerprint, state),
        (Recognised::Same | Recognised::Unverifiable, state) => (plain, state),
    };
    ClaimOutcome::Existing(Existing { fingerprint, state })
}

/// Opens `stored` with `sealer`, or finds it sealed with no sealer; counted and logged
/// when it cannot be opened.
pub(super) fn open(
    sealer: Option<&Sealer>,
    key: &StoreKey,
    stored: StoredResponse,
) -> Result<StoredResponse, Unreadable> {
    let opened = open_quietly(sealer, key, stored);
    if let Err(why) = &opened {
        reported(key, why);
    }
    opened
}

fn open_quietly(sealer: Option<&Sealer>, key: &StoreKey, stored: StoredResponse) -> Result<StoredResponse, Unreadable> {
    match sealer {
        Some(sealer) => sealer.open(key, stored),
        None => match sealed_by(&stored) {
            Some(id) => Err(Unreadable::NoKeys(id)),
            None => Ok(stored),
        },
    }
}

/// Counts and logs a record that cannot be read: it is never run again, and waits for
/// an operator.
fn reported(key: &StoreKey, why: &Unreadable) {
    UNREADABLE.inc();
    tracing::error!(
        record = key.short_hash(),
        reason = %why,
        "a recorded response cannot be opened: retries get 409 outcome-unknown (unreadable) until an operator purges it"
    );
}

/// The claim as the store is sent it: its fingerprint an HMAC under the current key,
/// and the client's key kept for the probe sealed.
pub(super) fn sealed_claim(sealer: &Sealer, claim: &ClaimRequest) -> Result<ClaimRequest, StoreError> {
    let mut claim = claim.clone();
    claim.fingerprint = sealer.fingerprint(claim.fingerprint);
    claim.probe_key = match &claim.probe_key {
        Some(text) => Some(sealer.seal_text(&claim.key, text)?),
        None => None,
    };
    Ok(claim)
}

/// A resolution as the store is sent it: an applied response sealed.
pub(super) fn sealed_resolution(
    sealer: &Sealer,
    key: &StoreKey,
    resolution: &Resolution,
) -> Result<Resolution, StoreError> {
    Ok(match resolution {
        Resolution::Applied(response) => Resolution::Applied(sealer.seal(key, response)?),
        Resolution::NotApplied => Resolution::NotApplied,
    })
}

/// The sealer of a config, shared by every worker's handle.
pub(crate) fn sealer(encryption: Option<&Encryption>) -> Option<Arc<Sealer>> {
    encryption.map(|encryption| Arc::new(Sealer::new(encryption)))
}

#[cfg(test)]
mod tests;
