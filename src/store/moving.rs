//! Records as they move between stores (docs/design.md §26): `idemproxy store copy`
//! reads every record of one store and writes it into another, and a store with a
//! `[store.previous]` reads a key it does not hold from the old one and keeps it.
//!
//! A record moves as its store keeps it: the fingerprint as stored (an HMAC stays an
//! HMAC), the response as its raw parts (a sealed one stays sealed: status, encoded
//! headers with their hidden fields, body), and every time as what is left of it when
//! it was read, so that a copy keeps each record's remaining lifetimes whatever the two
//! clocks. A record in flight arrives unknown (`moved-in-flight`), for the claim that
//! owned it: its forwarder may still be running, and nobody will learn its outcome in
//! the new store, so it must never run again. A store writes a moved record only where
//! it holds none under that key: a key the target already holds keeps the target's
//! record. The one exception is the claim a `[store.previous]` lookup made itself,
//! which the record it found takes over.

use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::{Fingerprint, OwnerToken, StoreKey, UnknownReason};

/// A record on its way from one store to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    pub key: StoreKey,
    /// As the source keeps it: an HMAC where the source seals its records.
    pub fingerprint: Fingerprint,
    /// What is left of the whole record's life (`remember`).
    pub ttl: Duration,
    /// What is left of its response's retention (`None`: it ends with the record).
    /// Kept on unknown records too, for the response a resolution records.
    pub response_ttl: Option<Duration>,
    pub state: CarriedState,
}

/// Where a moved record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CarriedState {
    /// Completed: its response (spent past its retention: `response` is `None`), the
    /// status, and when it completed where the source kept it.
    Completed {
        status: u16,
        completed_at: Option<SystemTime>,
        response: Option<RawResponse>,
    },
    /// Unknown for the claim `owner` made (`None`: written before owners were kept),
    /// with its probe's schedule where one was made.
    Unknown {
        reason: UnknownReason,
        owner: Option<OwnerToken>,
        schedule: Option<CarriedSchedule>,
    },
}

/// A recorded response as every store keeps it: the status, the headers encoded
/// (`StoredResponse::encode_headers`, hidden fields and a seal included), the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawResponse {
    pub headers: Bytes,
    pub body: Bytes,
}

/// An unknown record's probe schedule, from the moment it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CarriedSchedule {
    /// Until the next probe may begin (`None`: the probe gave up).
    pub due_in: Option<Duration>,
    /// Until the probe gives up.
    pub give_up_in: Duration,
}

impl Carried {
    /// A record read in flight, as it moves: unknown for the claim that owned it.
    pub(crate) fn in_flight(
        key: StoreKey,
        fingerprint: Fingerprint,
        ttl: Duration,
        response_ttl: Option<Duration>,
        owner: OwnerToken,
    ) -> Carried {
        Carried {
            key,
            fingerprint,
            ttl,
            response_ttl,
            state: CarriedState::Unknown {
                reason: UnknownReason::MovedInFlight,
                owner: Some(owner),
                schedule: None,
            },
        }
    }

    /// Its response's retention, never past the record's end: zero once it is over.
    pub(crate) fn response_left(&self) -> Duration {
        self.response_ttl.map_or(self.ttl, |left| left.min(self.ttl))
    }

    /// Whether its response outlives the record's end: kept with it to the end.
    pub(crate) fn response_with_record(&self) -> bool {
        self.response_ttl.is_none_or(|left| left >= self.ttl)
    }

    /// The response it replays, if it is completed and within its retention.
    pub(crate) fn live_response(&self) -> Option<&RawResponse> {
        match &self.state {
            CarriedState::Completed {
                response: Some(response),
                ..
            } if !self.response_left().is_zero() => Some(response),
            _ => None,
        }
    }

    /// The owner an unknown record is written with: its claim's, or (written before
    /// owners were kept) a fresh one no resolution names, so that only an unfenced
    /// one settles it.
    pub(crate) fn unknown_owner(owner: Option<OwnerToken>) -> Result<OwnerToken, super::StoreError> {
        match owner {
            Some(owner) => Ok(owner),
            None => OwnerToken::generate()
                .map_err(|_| super::StoreError::Unready("the operating system's random source failed")),
        }
    }
}

/// Where a copy has read to in its source: the next page starts after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cursor {
    Start,
    /// After this key (SQLite, Postgres: read in key order).
    After(String),
    /// Redis `SCAN`'s cursor (never zero: zero is the start and the end).
    Scan(u64),
    /// After this row (SQLite: read in the file's order).
    Row(i64),
    /// Every record has been read.
    End,
}

/// What a store's import did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Written.
    pub written: usize,
    /// Kept as the target held them.
    pub kept: usize,
}

/// Milliseconds, for a store that counts in them.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 4)
}

/// A count of milliseconds left (zero when negative).
pub(crate) fn left(millis: i64) -> Duration {
    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}
