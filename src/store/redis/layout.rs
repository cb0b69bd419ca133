//! How a record is laid out in Redis: one string, so that a claim is one native
//! `SET key value NX PX remember GET` instead of a script (and, only when it finds a
//! record in flight, a `GET` + `PTTL` to read that record's lease). The scripts that
//! must compare and set (complete, mark unknown, release, resolve) read the same layout
//! with `string.sub`.
//!
//! ```text
//! 2F<fingerprint: 64 hex><owner: 32 hex><rest: decimal ms>[/<keep>]   in flight
//! 2C<fingerprint: 64 hex><status: 3 digits><headers length: decimal>:<headers><body>
//! 2K<fingerprint: 64 hex><status: 3 digits><completed at: ms since the epoch>
//! 2U<fingerprint: 64 hex><owner: 32 hex><reason>[/<keep>]              unknown
//! 2U<fingerprint: 64 hex><owner: 32 hex><reason>:<due>:<give up>[/<keep>]  unknown, with a probe
//! ```
//!
//! An unknown record keeps its claim's owner, for a resolution to be fenced on; one
//! written before it did (`2U<fingerprint><reason>`) still reads, without it. On a
//! route with a reconciliation probe it keeps the probe's schedule, read off the TTL as
//! the lease is: the next probe is due once the TTL is at most `due` (`-1`: never, the
//! probe gave up), and gives up once it is at most `give up`.
//!
//! `2` is the format version. The expiry is set once, at the claim, to `remember`, and
//! never moved; the lease is not stored as a time but read off the store's own clock:
//! `rest` is `remember` minus the lease, so the lease has run out once the record's
//! remaining TTL is at most `rest`. A record that outlives its response (`remember`
//! past `retention`, docs/design.md §24) keeps `keep`, `remember` minus `retention`:
//! the TTL at which its response expires. Completed, it is `2K`, and its response
//! (`<status><headers length>:<headers><body>`, as `2C` holds it) is a second key
//! beside it, `<key>:r`, in the same hash slot, which expires by itself when the
//! record's TTL reaches `keep`: Redis drops the response on its own clock, and a `2K`
//! record without it is spent. Without `keep` nothing changes: a `2C` record holds its
//! response, and both expire together.

use std::time::Duration;

use bytes::Bytes;

use crate::error::StoreError;
use crate::store::moving::{self, Carried, CarriedSchedule, CarriedState, RawResponse};
use crate::store::{
    ClaimOutcome, Existing, Fingerprint, OwnerToken, Probe, RecordState, RecordSummary, Spent, StoreKey,
    StoredResponse, SummaryState, UnknownReason,
};

/// The format version, the first byte of every record: the one place it is named (the
/// scripts spell it in their tags, and a unit test holds them to it).
const VERSION: u8 = b'2';
/// The second byte: the record's state.
const IN_FLIGHT: u8 = b'F';
const COMPLETED: u8 = b'C';
/// Completed, its response kept beside it (`<key>:r`) until its retention ends.
const KEPT: u8 = b'K';
const UNKNOWN: u8 = b'U';
const FINGERPRINT: std::ops::Range<usize> = 2..66;
const OWNER: std::ops::Range<usize> = 66..98;

/// The value a claim writes: in flight for `owner`, its lease ending when `rest`
/// of `remember` is left, and its response to expire when `keep` is (zero: with the
/// record).
pub(super) fn in_flight(fingerprint: Fingerprint, owner: OwnerToken, rest: Duration, keep: Duration) -> Vec<u8> {
    let mut value = Vec::with_capacity(OWNER.end + 24);
    value.extend_from_slice(&[VERSION, IN_FLIGHT]);
    value.extend_from_slice(fingerprint.to_hex().as_bytes());
    value.extend_from_slice(owner.to_hex().as_bytes());
    value.extend_from_slice(super::millis(rest).to_string().as_bytes());
    if !keep.is_zero() {
        value.push(b'/');
        value.extend_from_slice(super::millis(keep).to_string().as_bytes());
    }
    value
}

/// Where a record's response is kept while it outlives it: `<key>:r`, in its hash
/// slot (the key ends with its `{hash}` tag).
pub(super) fn response_key(key: &str) -> String {
    format!("{key}:r")
}

/// Whether `value` is a completed record whose response is kept beside it.
pub(super) fn kept_beside(value: &[u8]) -> bool {
    value.get(1) == Some(&KEPT)
}

/// `tail` without its `/<keep>` suffix, where it has one.
fn without_keep(tail: &[u8]) -> &[u8] {
    match tail.iter().rposition(|byte| *byte == b'/') {
        Some(slash) if tail[slash + 1..].iter().all(u8::is_ascii_digit) => &tail[..slash],
        _ => tail,
    }
}

/// What `complete.lua` appends after the tag and the fingerprint it keeps.
pub(super) fn completed_tail(response: &StoredResponse) -> Vec<u8> {
    let headers = response.encode_headers();
    let length = headers.len().to_string();
    let mut tail = Vec::with_capacity(3 + length.len() + 1 + headers.len() + response.body.len());
    tail.extend_from_slice(format!("{:03}", response.status.as_u16()).as_bytes());
    tail.extend_from_slice(length.as_bytes());
    tail.push(b':');
    tail.extend_from_slice(&headers);
    tail.extend_from_slice(&response.body);
    tail
}

/// Whether reading `value` needs its remaining TTL: an in-flight record's does (its
/// lease is read off it), and an unknown record's with a probe schedule; completed and
/// other unknown records read the same at any TTL.
pub(super) fn lease_depends_on_ttl(value: &[u8]) -> bool {
    match value.get(1) {
        Some(&IN_FLIGHT) => true,
        Some(&UNKNOWN) => value.get(OWNER.end..).is_some_and(|tail| tail.contains(&b':')),
        _ => false,
    }
}

/// A record as read, with the remaining TTL Redis gave beside it.
struct Decoded {
    fingerprint: Fingerprint,
    state: Read,
}

enum Read {
    /// In flight for `owner`; `lease` is what is left of it, `None` once it has run out.
    InFlight {
        owner: Vec<u8>,
        lease: Option<Duration>,
    },
    Completed(StoredResponse),
    /// Completed, its response kept beside it until its retention ends (then spent).
    Kept(Spent),
    Unknown {
        reason: UnknownReason,
        owner: Option<Vec<u8>>,
        probe: Probe,
    },
}

fn decode(value: Bytes, pttl: Option<i64>) -> Result<Decoded, StoreError> {
    let bad = |what| StoreError::Protocol(what);
    if value.first() != Some(&VERSION) {
        return Err(bad("a record in a format this idemproxy does not understand"));
    }
    let fingerprint = value
        .get(FINGERPRINT)
        .and_then(Fingerprint::from_hex)
        .ok_or(bad("a record with a malformed fingerprint"))?;
    let state = match value.get(1) {
        Some(&IN_FLIGHT) => {
            let owner = value
                .get(OWNER)
                .ok_or(bad("an in-flight record without an owner"))?
                .to_vec();
            let rest: i64 = value
                .get(OWNER.end..)
                .map(without_keep)
                .and_then(|rest| std::str::from_utf8(rest).ok())
                .and_then(|rest| rest.parse().ok())
                .ok_or(bad("an in-flight record without its lease"))?;
            let pttl = pttl.ok_or(bad("an in-flight record read without its TTL"))?;
            let remaining = pttl.max(0) - rest;
            Read::InFlight {
                owner,
                lease: (remaining > 0).then(|| Duration::from_millis(u64::try_from(remaining).unwrap_or(0))),
            }
        }
        Some(&COMPLETED) => Read::Completed(decode_response(value.slice(FINGERPRINT.end..))?),
        Some(&KEPT) => {
            let tail = value.get(FINGERPRINT.end..).unwrap_or_default();
            let number = |digits: Option<&[u8]>| std::str::from_utf8(digits?).ok()?.parse::<i64>().ok();
            let completed_at = number(tail.get(3..)).ok_or(bad("a completed record without its completion time"))?;
            let spent = number(tail.get(..3)).and_then(|status| Spent::kept(status, Some(completed_at)));
            Read::Kept(spent.ok_or(bad("a completed record without a status"))?)
        }
        Some(&UNKNOWN) => {
            // The owner, when the record kept it: 32 hex digits, where no reason starts.
            let owner = value
                .get(OWNER)
                .filter(|owner| owner.iter().all(u8::is_ascii_hexdigit))
                .map(<[u8]>::to_vec);
            let reason_at = if owner.is_some() { OWNER.end } else { FINGERPRINT.end };
            let tail = without_keep(value.get(reason_at..).unwrap_or_default());
            let (reason, schedule) = match tail.iter().position(|byte| *byte == b':') {
                None => (tail, None),
                Some(colon) => (&tail[..colon], Some(&tail[colon + 1..])),
            };
            let reason = UnknownReason::parse(reason).ok_or(bad("an unknown record with an unknown reason"))?;
            let probe = match schedule {
                None => Probe::Unscheduled,
                Some(schedule) => {
                    let pttl = pttl.ok_or(bad("an unknown record with a probe read without its TTL"))?;
                    probe(schedule, pttl).ok_or(bad("an unknown record with a malformed probe schedule"))?
                }
            };
            Read::Unknown { reason, owner, probe }
        }
        _ => return Err(bad("a record in an unknown state")),
    };
    Ok(Decoded { fingerprint, state })
}

/// A recorded response as `2C` holds it after its fingerprint, and `<key>:r` whole:
/// `<status><headers length>:<headers><body>`.
fn decode_response(tail: Bytes) -> Result<StoredResponse, StoreError> {
    let (status, headers, body) = split_response(&tail)?;
    StoredResponse::decode(status, &headers, body)
        .ok_or(StoreError::Protocol("a completed record that does not decode"))
}

/// A recorded response's parts as kept: its status's three digits, its encoded
/// headers, its body.
fn split_response(tail: &Bytes) -> Result<(&[u8], Bytes, Bytes), StoreError> {
    let bad = |what| StoreError::Protocol(what);
    let status = tail.get(..3).ok_or(bad("a completed record without a status"))?;
    let colon = tail
        .iter()
        .position(|byte| *byte == b':')
        .ok_or(bad("a completed record without its headers' length"))?;
    let length: usize = tail
        .get(3..colon)
        .and_then(|length| std::str::from_utf8(length).ok())
        .and_then(|length| length.parse().ok())
        .ok_or(bad("a completed record with a malformed headers' length"))?;
    let headers_end = colon + 1 + length;
    if tail.len() < headers_end {
        return Err(bad("a completed record cut short"));
    }
    Ok((status, tail.slice(colon + 1..headers_end), tail.slice(headers_end..)))
}

/// A `2K` record read with what `<key>:r` held: its response, or past its retention
/// what is left.
fn kept(spent: Spent, response: Option<Bytes>) -> Result<Result<StoredResponse, Spent>, StoreError> {
    Ok(match response {
        Some(response) => Ok(decode_response(response)?),
        None => Err(spent),
    })
}

/// Where the probe of an unknown record stands, from its schedule (`<due>:<give up>`)
/// and its remaining TTL.
fn probe(schedule: &[u8], pttl: i64) -> Option<Probe> {
    let schedule = std::str::from_utf8(schedule).ok()?;
    let (due, give_up) = schedule.split_once(':')?;
    let (due, give_up): (i64, i64) = (due.parse().ok()?, give_up.parse().ok()?);
    let millis = |value: i64| Duration::from_millis(u64::try_from(value).unwrap_or(0));
    Some(if due < 0 || pttl <= give_up {
        Probe::GaveUp
    } else {
        Probe::Next(millis(pttl - due))
    })
}

/// What a claim by `owner` found: `None` when its `SET … NX` wrote the record; `pttl`
/// is the record's remaining TTL, read with it, which an in-flight record needs;
/// `response` what `<key>:r` held, read with it, which a `2K` record needs.
pub(super) fn claim_outcome(
    found: Option<Bytes>,
    pttl: Option<i64>,
    response: Option<Bytes>,
    owner: OwnerToken,
) -> Result<ClaimOutcome, StoreError> {
    let Some(value) = found else {
        return Ok(ClaimOutcome::Acquired(()));
    };
    let Decoded { fingerprint, state } = decode(value, pttl)?;
    let state = match state {
        Read::InFlight { lease: None, .. } => RecordState::LeaseExpired,
        // Its own claim, retried after a lost reply: the claim is still the caller's.
        Read::InFlight { owner: held, .. } if held == owner.to_hex().as_bytes() => {
            return Ok(ClaimOutcome::Acquired(()));
        }
        Read::InFlight {
            lease: Some(lease_remaining),
            ..
        } => RecordState::InFlight { lease_remaining },
        Read::Completed(response) => RecordState::Completed(response),
        Read::Kept(spent) => match kept(spent, response)? {
            Ok(response) => RecordState::Completed(response),
            Err(spent) => RecordState::Spent(spent),
        },
        Read::Unknown { reason, probe, .. } => RecordState::Unknown { reason, probe },
    };
    Ok(ClaimOutcome::Existing(Existing { fingerprint, state }))
}

/// The response of the completed record `GET` found, with its `PTTL` and what
/// `<key>:r` held.
pub(super) fn response(
    found: Option<Bytes>,
    pttl: i64,
    response: Option<Bytes>,
) -> Result<Option<StoredResponse>, StoreError> {
    let Some(value) = found else {
        return Ok(None);
    };
    Ok(match decode(value, Some(pttl))?.state {
        Read::Completed(response) => Some(response),
        Read::Kept(spent) => kept(spent, response)?.ok(),
        Read::InFlight { .. } | Read::Unknown { .. } => None,
    })
}

/// What an operator sees of the record `GET` found, with its `PTTL` and what
/// `<key>:r` held.
pub(super) fn summary(
    found: Option<Bytes>,
    pttl: i64,
    response: Option<Bytes>,
) -> Result<Option<RecordSummary>, StoreError> {
    let Some(value) = found else {
        return Ok(None);
    };
    let Decoded { fingerprint, state } = decode(value, Some(pttl))?;
    let state = match state {
        Read::Kept(spent) => match kept(spent, response)? {
            Ok(response) => Read::Completed(response),
            Err(spent) => Read::Kept(spent),
        },
        state => state,
    };
    let millis = |value: i64| Duration::from_millis(u64::try_from(value).unwrap_or(0));
    let owner = match &state {
        Read::InFlight { lease: None, owner } | Read::Unknown { owner: Some(owner), .. } => OwnerToken::from_hex(owner),
        Read::InFlight { .. } | Read::Completed(_) | Read::Kept(_) | Read::Unknown { owner: None, .. } => None,
    };
    let state = match state {
        Read::InFlight { lease: None, .. } => SummaryState::LeaseExpired,
        Read::InFlight {
            lease: Some(lease_remaining),
            ..
        } => SummaryState::InFlight { lease_remaining },
        Read::Completed(response) => SummaryState::Completed {
            status: response.status.as_u16(),
            response_bytes: response.body.len() as u64,
            trace_id: response.trace.map(crate::record::ExecutionTrace::trace_id_hex),
        },
        Read::Kept(spent) => SummaryState::Spent(spent),
        Read::Unknown { reason, probe, .. } => SummaryState::Unknown { reason, probe },
    };
    Ok(Some(RecordSummary {
        fingerprint,
        ttl: millis(pttl),
        state,
        owner,
    }))
}

/// A record as it moves to another store (`store::moving`), from its value, its
/// `PTTL`, and what `<key>:r` held with its `PTTL`. `None` when it was gone.
pub(super) fn carried(
    key: StoreKey,
    value: Option<Bytes>,
    pttl: i64,
    response: Option<Bytes>,
    response_pttl: i64,
) -> Result<Option<Carried>, StoreError> {
    let bad = |what| StoreError::Protocol(what);
    let Some(value) = value.filter(|_| pttl > 0) else {
        return Ok(None);
    };
    let Decoded { fingerprint, state } = decode(value.clone(), Some(pttl))?;
    let ttl = moving::left(pttl);
    // The TTL at which a record's response expires (`/<keep>`), as what is left of it.
    let keep = |tail: &[u8]| {
        let slash = tail.iter().rposition(|byte| *byte == b'/')?;
        let keep: i64 = std::str::from_utf8(&tail[slash + 1..]).ok()?.parse().ok()?;
        Some(moving::left(pttl - keep))
    };
    let carried = |response_ttl, state| Carried {
        key: key.clone(),
        fingerprint,
        ttl,
        response_ttl,
        state,
    };
    Ok(Some(match state {
        Read::InFlight { owner, lease } => {
            let owner = OwnerToken::from_hex(&owner).ok_or(bad("an in-flight record with a malformed owner"))?;
            let tail = value.get(OWNER.end..).unwrap_or_default();
            let mut moved = Carried::in_flight(key.clone(), fingerprint, ttl, keep(tail), owner);
            if let (None, CarriedState::Unknown { reason, .. }) = (lease, &mut moved.state) {
                *reason = UnknownReason::LeaseExpired;
            }
            moved
        }
        // Moved with its headers as encoded (hidden fields, a seal), not as decoded.
        Read::Completed(_) => {
            let kept = value.slice(FINGERPRINT.end..);
            let (status, headers, body) = split_response(&kept)?;
            let status = std::str::from_utf8(status).ok().and_then(|status| status.parse().ok());
            let status = status.ok_or(bad("a completed record without a status"))?;
            let response = Some(RawResponse { headers, body });
            carried(
                None,
                CarriedState::Completed {
                    status,
                    completed_at: None,
                    response,
                },
            )
        }
        Read::Kept(spent) => {
            let beside = response.filter(|_| response_pttl > 0);
            let (response_ttl, response) = match beside {
                None => (Some(Duration::ZERO), None),
                Some(beside) => {
                    let (_, headers, body) = split_response(&beside)?;
                    (Some(moving::left(response_pttl)), Some(RawResponse { headers, body }))
                }
            };
            let status = spent.status.as_u16();
            carried(
                response_ttl,
                CarriedState::Completed {
                    status,
                    completed_at: spent.completed_at,
                    response,
                },
            )
        }
        Read::Unknown { reason, owner, .. } => {
            let owner = owner.as_deref().and_then(OwnerToken::from_hex);
            let tail = value
                .get(if owner.is_some() { OWNER.end } else { FINGERPRINT.end }..)
                .unwrap_or_default();
            let schedule = without_keep(tail)
                .splitn(3, |byte| *byte == b':')
                .skip(1)
                .map(|number| std::str::from_utf8(number).ok()?.parse::<i64>().ok())
                .collect::<Option<Vec<i64>>>()
                .and_then(|numbers| match numbers[..] {
                    [due, give_up] => Some(CarriedSchedule {
                        due_in: (due >= 0).then(|| moving::left(pttl - due)),
                        give_up_in: moving::left(pttl - give_up),
                    }),
                    _ => None,
                });
            carried(
                keep(tail),
                CarriedState::Unknown {
                    reason,
                    owner,
                    schedule,
                },
            )
        }
    }))
}

/// The value a moved record is written with, and the response kept beside it
/// (`<key>:r`, with its PTTL) where the record outlives it; `now` is when it is
/// written, in milliseconds since the epoch (a completion time the source did not keep).
pub(super) fn moved(record: &Carried, now: i64) -> (Vec<u8>, Option<(Vec<u8>, Duration)>) {
    let mut value = Vec::with_capacity(OWNER.end + 64);
    let fingerprint = record.fingerprint.to_hex();
    let response_part = |status: u16, response: &RawResponse| {
        let mut part = format!("{status:03}{}:", response.headers.len()).into_bytes();
        part.extend_from_slice(&response.headers);
        part.extend_from_slice(&response.body);
        part
    };
    let ttl = moving::millis(record.ttl);
    let keep = ttl - moving::millis(record.response_left());
    match &record.state {
        CarriedState::Completed {
            status,
            response: Some(response),
            ..
        } if record.live_response().is_some() && record.response_with_record() => {
            value.extend_from_slice(&[VERSION, COMPLETED]);
            value.extend_from_slice(fingerprint.as_bytes());
            value.extend_from_slice(&response_part(*status, response));
            (value, None)
        }
        CarriedState::Completed {
            status, completed_at, ..
        } => {
            value.extend_from_slice(&[VERSION, KEPT]);
            value.extend_from_slice(fingerprint.as_bytes());
            let completed = completed_at.map_or(now, |at| {
                at.duration_since(std::time::UNIX_EPOCH).map_or(0, moving::millis)
            });
            value.extend_from_slice(format!("{status:03}{completed}").as_bytes());
            let beside = record
                .live_response()
                .map(|response| (response_part(*status, response), record.response_left()));
            (value, beside)
        }
        CarriedState::Unknown {
            reason,
            owner,
            schedule,
        } => {
            value.extend_from_slice(&[VERSION, UNKNOWN]);
            value.extend_from_slice(fingerprint.as_bytes());
            if let Some(owner) = owner {
                value.extend_from_slice(owner.to_hex().as_bytes());
            }
            value.extend_from_slice(reason.as_str().as_bytes());
            if let Some(schedule) = schedule {
                let due = schedule
                    .due_in
                    .map_or(-1, |due_in| (ttl - moving::millis(due_in)).max(0));
                let give_up = (ttl - moving::millis(schedule.give_up_in)).max(0);
                value.extend_from_slice(format!(":{due}:{give_up}").as_bytes());
            }
            if keep > 0 {
                value.extend_from_slice(format!("/{keep}").as_bytes());
            }
            (value, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue, StatusCode};

    use super::*;

    const OWNER_TOKEN: OwnerToken = OwnerToken([9; 16]);

    #[test]
    fn each_state_round_trips() {
        let fingerprint = Fingerprint([7; 32]);
        let value = Bytes::from(in_flight(
            fingerprint,
            OWNER_TOKEN,
            Duration::from_millis(3_000),
            Duration::ZERO,
        ));
        assert_eq!(value.len(), 98 + 4);
        let found = |value: &Bytes, pttl| claim_outcome(Some(value.clone()), Some(pttl), None, OwnerToken([1; 16]));
        assert_eq!(
            found(&value, 4_500).ok(),
            Some(ClaimOutcome::Existing(Existing {
                fingerprint,
                state: RecordState::InFlight {
                    lease_remaining: Duration::from_millis(1_500)
                }
            }))
        );
        assert!(matches!(
            found(&value, 3_000),
            Ok(ClaimOutcome::Existing(Existing {
                state: RecordState::LeaseExpired,
                ..
            }))
        ));
        assert_eq!(
            claim_outcome(Some(value.clone()), Some(4_500), None, OWNER_TOKEN).ok(),
            Some(ClaimOutcome::Acquired(()))
        );
        assert_eq!(
            claim_outcome(None, None, None, OWNER_TOKEN).ok(),
            Some(ClaimOutcome::Acquired(()))
        );
        // An in-flight record cannot be read without its TTL.
        assert!(matches!(
            claim_outcome(Some(value.clone()), None, None, OWNER_TOKEN),
            Err(StoreError::Protocol(_))
        ));

        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(HeaderName::from_static("x-a"), HeaderValue::from_static("b:c"))],
            body: Bytes::from_static(b"body with : colons"),
            trace: None,
            replay_until: None,
        };
        let mut completed = value.get(..66).expect("prefix").to_vec();
        completed[1] = b'C';
        completed.extend_from_slice(&completed_tail(&response));
        // Completed and unknown records read the same without their TTL.
        assert!(!lease_depends_on_ttl(&completed) && lease_depends_on_ttl(&value));
        assert_eq!(
            claim_outcome(Some(Bytes::from(completed)), None, None, OWNER_TOKEN).ok(),
            Some(ClaimOutcome::Existing(Existing {
                fingerprint,
                state: RecordState::Completed(response)
            }))
        );
        let mut unknown = value.get(..66).expect("prefix").to_vec();
        unknown[1] = b'U';
        unknown.extend_from_slice(b"upstream-timeout");
        assert!(!lease_depends_on_ttl(&unknown));
        assert!(matches!(
            claim_outcome(Some(Bytes::from(unknown.clone())), None, None, OWNER_TOKEN),
            Ok(ClaimOutcome::Existing(Existing {
                state: RecordState::Unknown {
                    reason: UnknownReason::UpstreamTimeout,
                    probe: Probe::Unscheduled
                },
                ..
            }))
        ));
        // Written before unknown records kept their claim: read, with no claim to
        // fence on. Written now: the claim is the in-flight record's owner.
        let old = summary(Some(Bytes::from(unknown)), 1_000, None)
            .expect("decodes")
            .expect("a record");
        assert_eq!(
            (old.state, old.owner),
            (
                SummaryState::Unknown {
                    reason: UnknownReason::UpstreamTimeout,
                    probe: Probe::Unscheduled
                },
                None
            )
        );
        let mut kept = value.get(..98).expect("prefix").to_vec();
        kept[1] = b'U';
        kept.extend_from_slice(b"over-budget");
        let new = summary(Some(Bytes::from(kept)), 1_000, None)
            .expect("decodes")
            .expect("a record");
        assert_eq!(
            (new.state, new.owner),
            (
                SummaryState::Unknown {
                    reason: UnknownReason::OverBudget,
                    probe: Probe::Unscheduled
                },
                Some(OWNER_TOKEN)
            )
        );
        // With a probe schedule, read off the TTL: due in 700 ms, given up once the TTL
        // reaches 200 ms; `-1`: given up.
        let scheduled = |tail: &[u8]| {
            let mut record = value.get(..98).expect("prefix").to_vec();
            record[1] = b'U';
            record.extend_from_slice(tail);
            record
        };
        let due = scheduled(b"upstream-timeout:300:200");
        assert!(lease_depends_on_ttl(&due));
        let probe_at = |record: &[u8], pttl| match summary(Some(Bytes::copy_from_slice(record)), pttl, None) {
            Ok(Some(RecordSummary {
                state: SummaryState::Unknown { probe, .. },
                ..
            })) => probe,
            other => panic!("{other:?}"),
        };
        assert_eq!(probe_at(&due, 1_000), Probe::Next(Duration::from_millis(700)));
        assert_eq!(probe_at(&due, 250), Probe::Next(Duration::ZERO));
        assert_eq!(probe_at(&due, 200), Probe::GaveUp);
        assert_eq!(probe_at(&scheduled(b"lease-expired:-1:200"), 1_000), Probe::GaveUp);
        assert!(matches!(
            summary(Some(Bytes::from(scheduled(b"upstream-timeout:x:200"))), 1_000, None),
            Err(StoreError::Protocol(_))
        ));
    }

    /// The scripts read and write this layout with `string.sub`: every tag they
    /// compare or write is this version and a state of it, and every slice they take is
    /// one of the fields above (Lua counts from 1, both ends included).
    #[test]
    fn the_scripts_spell_this_layout() {
        let scripts = [
            ("complete", include_str!("../scripts/complete.lua")),
            ("mark_unknown", include_str!("../scripts/mark_unknown.lua")),
            ("release", include_str!("../scripts/release.lua")),
            ("resolve", include_str!("../scripts/resolve.lua")),
            ("begin_probe", include_str!("../scripts/begin_probe.lua")),
            ("defer_probe", include_str!("../scripts/defer_probe.lua")),
            ("import", include_str!("../scripts/import.lua")),
        ];
        let tags: Vec<String> = [IN_FLIGHT, COMPLETED, KEPT, UNKNOWN]
            .iter()
            .map(|state| format!("'{}{}'", char::from(VERSION), char::from(*state)))
            .collect();
        let slices = [
            "string.sub(record, 1, 2)".to_string(),
            format!("string.sub(record, {}, {})", FINGERPRINT.start + 1, FINGERPRINT.end),
            format!("string.sub(record, {}, {})", OWNER.start + 1, OWNER.end),
            // The fingerprint and the owner together: what an unknown record keeps.
            format!("string.sub(record, {}, {})", FINGERPRINT.start + 1, OWNER.end),
            format!("string.sub(record, {})", OWNER.end + 1),
        ];
        for (name, lua) in scripts {
            let code: String = lua
                .lines()
                .filter(|line| !line.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut quoted = code.split('\'').skip(1).step_by(2);
            let used: Vec<&str> = quoted
                .by_ref()
                .filter(|text| text.len() == 2 && text.as_bytes()[0].is_ascii_digit())
                .collect();
            assert!(!used.is_empty(), "{name} compares no tag");
            for tag in used {
                assert!(
                    tags.contains(&format!("'{tag}'")),
                    "{name} uses the tag {tag:?}, not one of {tags:?}"
                );
            }
            let mut rest = code.as_str();
            while let Some(at) = rest.find("string.sub(") {
                let call = &rest[at..];
                let end = call.find(')').expect("a closed call") + 1;
                assert!(
                    slices.contains(&call[..end].to_string()),
                    "{name}: {} is not a field",
                    &call[..end]
                );
                rest = &call[end..];
            }
        }
    }

    #[test]
    fn malformed_or_foreign_records_are_store_errors() {
        let good = in_flight(
            Fingerprint([7; 32]),
            OWNER_TOKEN,
            Duration::from_millis(5),
            Duration::ZERO,
        );
        let with = |at: usize, byte: u8| {
            let mut value = good.clone();
            value[at] = byte;
            Bytes::from(value)
        };
        for bad in [
            Bytes::new(),
            with(0, b'1'),
            with(1, b'X'),
            with(10, b'z'),
            Bytes::copy_from_slice(good.get(..98).expect("prefix")),
            Bytes::from_static(b"2C"),
            Bytes::from([&good[..2], &[b'0'; 64], b"2011"].concat()),
        ] {
            assert!(
                matches!(
                    claim_outcome(Some(bad.clone()), Some(10), None, OWNER_TOKEN),
                    Err(StoreError::Protocol(_))
                ),
                "{bad:?}"
            );
        }
    }
}
