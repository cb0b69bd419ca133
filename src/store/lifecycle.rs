//! The record's lifecycle (docs/design.md §4) as pure functions, for the two stores
//! that decide in their own process: the memory store applies each change in place,
//! and SQLite writes it with one statement. Redis decides the same steps in its
//! scripts and Postgres in its functions (`schema.sql`); the store suite and the model
//! conformance hold all four to one answer. Nothing here does I/O, takes a lock or
//! reads a clock: every function is given `now`.

use std::time::Duration;

use super::{
    ClaimOutcome, ClaimRequest, ClientId, Deferred, Existing, Fingerprint, OwnerToken, Probe, ProbeSchedule,
    ProbeStart, RecordState, Resolved, ScopeId, StoreLimits, SummaryState, UnknownReason,
};
use crate::error::{Held, StoreError};

/// A store's clock: the memory store's `Instant`, the SQLite file's milliseconds.
pub(crate) trait Moment: Copy + Ord {
    /// This moment, `by` later.
    fn plus(self, by: Duration) -> Self;
    /// How long from this moment until `then` (zero once it has passed).
    fn until(self, then: Self) -> Duration;
}

impl Moment for tokio::time::Instant {
    fn plus(self, by: Duration) -> Self {
        self + by
    }

    fn until(self, then: Self) -> Duration {
        then.saturating_duration_since(self)
    }
}

/// Milliseconds since the Unix epoch, as the SQLite file keeps them.
impl Moment for i64 {
    fn plus(self, by: Duration) -> Self {
        self.saturating_add(i64::try_from(by.as_millis()).unwrap_or(i64::MAX / 4))
    }

    fn until(self, then: Self) -> Duration {
        Duration::from_millis(u64::try_from(then.saturating_sub(self)).unwrap_or(0))
    }
}

/// Where a record stands: `C` is what a completed record holds (the response, or the
/// columns it is kept in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State<T, C> {
    InFlight {
        owner: OwnerToken,
        lease_until: T,
    },
    Completed(C),
    /// Its claim is kept, for a resolution to be fenced on.
    Unknown {
        reason: UnknownReason,
        owner: OwnerToken,
        schedule: Option<Schedule<T>>,
    },
}

/// An unknown record's probe schedule: when the next probe may begin (`None` once it
/// has given up), and when it gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule<T> {
    pub(crate) due: Option<T>,
    pub(crate) give_up_at: T,
}

impl<T: Moment> Schedule<T> {
    /// The first probe due `first_after` from `now`; giving up `give_up_after` from it.
    pub(crate) fn new(now: T, first_after: Duration, schedule: ProbeSchedule) -> Schedule<T> {
        Schedule {
            due: Some(now.plus(first_after)),
            give_up_at: now.plus(schedule.give_up_after),
        }
    }

    fn probe(&self, now: T) -> Probe {
        match self.due {
            None => Probe::GaveUp,
            Some(_) if self.give_up_at <= now => Probe::GaveUp,
            Some(due) => Probe::Next(now.until(due)),
        }
    }
}

/// Where an unknown record's probe stands.
fn probe<T: Moment>(schedule: Option<&Schedule<T>>, now: T) -> Probe {
    schedule.map_or(Probe::Unscheduled, |schedule| schedule.probe(now))
}

/// A change a transition makes to a live record (besides those of complete, mark
/// unknown, release and resolve, which the stores write as they are asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change<T> {
    /// The record in flight whose lease ran out becomes unknown for `lease-expired`,
    /// for the claim that owned it, with its probe leased by this schedule.
    LeaseExpired(Schedule<T>),
    /// The unknown record's probe schedule becomes this one.
    Reschedule(Schedule<T>),
}

impl<T: Copy, C> State<T, C> {
    /// This state, its completed part borrowed.
    pub(crate) fn as_ref(&self) -> State<T, &C> {
        match self {
            State::InFlight { owner, lease_until } => State::InFlight {
                owner: *owner,
                lease_until: *lease_until,
            },
            State::Completed(completed) => State::Completed(completed),
            State::Unknown {
                reason,
                owner,
                schedule,
            } => State::Unknown {
                reason: *reason,
                owner: *owner,
                schedule: *schedule,
            },
        }
    }

    /// Makes `change` in place (the memory store's way to apply it).
    pub(crate) fn apply(&mut self, change: Change<T>) {
        match (change, &mut *self) {
            (Change::LeaseExpired(leased), State::InFlight { owner, .. }) => {
                *self = State::Unknown {
                    reason: UnknownReason::LeaseExpired,
                    owner: *owner,
                    schedule: Some(leased),
                };
            }
            (Change::Reschedule(next), State::Unknown { schedule, .. }) => *schedule = Some(next),
            // A change is made only to the state it was decided on.
            (Change::LeaseExpired(_) | Change::Reschedule(_), _) => {}
        }
    }
}

/// What a claim finds in a live record: its own claim counts as acquired; any other is
/// the existing record as the claimant sees it. `completed` reads what a completed
/// record holds: its response, or what is left of it past its retention
/// (`RecordState::Spent`).
pub(crate) fn claim<T: Moment, C, E>(
    fingerprint: Fingerprint,
    state: State<T, C>,
    claimant: OwnerToken,
    now: T,
    completed: impl FnOnce(C) -> Result<RecordState, E>,
) -> Result<ClaimOutcome, E> {
    let state = match state {
        State::InFlight { lease_until, .. } if lease_until <= now => RecordState::LeaseExpired,
        State::InFlight { owner, .. } if owner == claimant => return Ok(ClaimOutcome::Acquired(())),
        State::InFlight { lease_until, .. } => RecordState::InFlight {
            lease_remaining: now.until(lease_until),
        },
        State::Completed(kept) => completed(kept)?,
        State::Unknown { reason, schedule, .. } => RecordState::Unknown {
            reason,
            probe: probe(schedule.as_ref(), now),
        },
    };
    Ok(ClaimOutcome::Existing(Existing { fingerprint, state }))
}

/// What an operator sees of a live record, and the claim whose outcome is unknown (on
/// an unknown record, and on one in flight past its lease). `completed` summarises
/// what a completed record holds.
pub(crate) fn summary<T: Moment, C, E>(
    state: State<T, C>,
    now: T,
    completed: impl FnOnce(C) -> Result<SummaryState, E>,
) -> Result<(SummaryState, Option<OwnerToken>), E> {
    Ok(match state {
        State::InFlight { lease_until, .. } if lease_until > now => (
            SummaryState::InFlight {
                lease_remaining: now.until(lease_until),
            },
            None,
        ),
        State::InFlight { owner, .. } => (SummaryState::LeaseExpired, Some(owner)),
        State::Completed(kept) => (completed(kept)?, None),
        State::Unknown {
            reason,
            owner,
            schedule,
        } => (
            SummaryState::Unknown {
                reason,
                probe: probe(schedule.as_ref(), now),
            },
            Some(owner),
        ),
    })
}

/// Whether a resolution naming `named` (or none) may settle a live record: only one
/// that reads as unknown (marked so, or in flight past its lease), and only for the
/// claim named. `Err` is the answer when it may not.
pub(crate) fn resolvable<T: Moment, C>(state: &State<T, C>, named: Option<OwnerToken>, now: T) -> Result<(), Resolved> {
    let holder = match state {
        State::Unknown { owner, .. } => *owner,
        State::InFlight { lease_until, owner } if *lease_until <= now => *owner,
        State::InFlight { .. } | State::Completed(_) => return Err(Resolved::NotUnknown),
    };
    match named {
        Some(named) if named != holder => Err(Resolved::OtherClaim),
        _ => Ok(()),
    }
}

/// Takes a live record's probe lease for `lease`, if a probe is due: see
/// `RecordStore::begin_probe`.
pub(crate) fn begin_probe<T: Moment, C>(
    state: &State<T, C>,
    schedule: ProbeSchedule,
    lease: Duration,
    now: T,
) -> (ProbeStart, Option<Change<T>>) {
    match state {
        State::InFlight { owner, lease_until } if *lease_until <= now => (
            ProbeStart::Leased(*owner),
            Some(Change::LeaseExpired(Schedule::new(now, lease, schedule))),
        ),
        State::InFlight { .. } | State::Completed(_) => (ProbeStart::Settled, None),
        State::Unknown {
            owner,
            schedule: scheduled,
            ..
        } => {
            let current = scheduled.unwrap_or_else(|| Schedule::new(now, Duration::ZERO, schedule));
            match current.due {
                None => (ProbeStart::GaveUp, None),
                Some(due) if due > now => (ProbeStart::NotDue(now.until(due)), None),
                Some(_) if current.give_up_at <= now => (
                    ProbeStart::GaveUp,
                    Some(Change::Reschedule(Schedule { due: None, ..current })),
                ),
                Some(_) => (
                    ProbeStart::Leased(*owner),
                    Some(Change::Reschedule(Schedule {
                        due: Some(now.plus(lease)),
                        ..current
                    })),
                ),
            }
        }
    }
}

/// Ends a live record's probe lease with the next probe due `every` from now, unless
/// that is past its `give_up_after`: see `RecordStore::defer_probe`.
pub(crate) fn defer_probe<T: Moment, C>(
    state: &State<T, C>,
    named: OwnerToken,
    every: Duration,
    now: T,
) -> (Deferred, Option<Change<T>>) {
    let State::Unknown {
        owner,
        schedule: Some(schedule),
        ..
    } = state
    else {
        return (Deferred::Settled, None);
    };
    if *owner != named {
        return (Deferred::Settled, None);
    }
    let next = now.plus(every);
    if schedule.due.is_none() || next >= schedule.give_up_at {
        return (
            Deferred::GaveUp,
            Some(Change::Reschedule(Schedule { due: None, ..*schedule })),
        );
    }
    (
        Deferred::Scheduled,
        Some(Change::Reschedule(Schedule {
            due: Some(next),
            ..*schedule
        })),
    )
}

/// The shares a claim is admitted against, in the order they are asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Share {
    /// The whole store: `max_records`, and `max_bytes` (SQLite: the file's pages).
    Store,
    /// The claim's scope: `max_records_per_scope`, `max_bytes_per_scope`.
    Scope(ScopeId),
    /// The claim's client address: `max_records_per_client`.
    Client(ClientId),
}

/// What an embedded store knows of its shares, for `admit`.
pub(crate) trait Ledger {
    /// Which bound of `share` is reached (its records or its bytes), counting records
    /// that expired but are not yet removed.
    fn full(&mut self, share: Share) -> Result<Option<Held>, StoreError>;
    /// Removes `share`'s expired records (where that may make room).
    fn sweep(&mut self, share: Share) -> Result<(), StoreError>;
    /// How long until the first of `share`'s records expires.
    fn first_expiry(&mut self, share: Share) -> Result<Duration, StoreError>;
    /// Whether the room what claims in flight may still write is kept from refuses
    /// this claim: `Some` with when room is due.
    fn reserve(&mut self, _claim: &ClaimRequest) -> Result<Option<Duration>, StoreError> {
        Ok(None)
    }
}

/// Admits a claim of a free key, or refuses it with the first bound it reaches, in the
/// order records → bytes → room kept for claims in flight → scope → client. A share
/// found full is swept of its expired records and asked again before it refuses;
/// `Retry-After` is when its first record expires (at least 1 s).
pub(crate) fn admit(ledger: &mut impl Ledger, claim: &ClaimRequest, limits: &StoreLimits) -> Result<(), StoreError> {
    let shares = [
        Some(Share::Store),
        claim.scope.map(Share::Scope),
        claim.client.map(Share::Client),
    ];
    for share in shares.into_iter().flatten() {
        if ledger.full(share)?.is_some() {
            ledger.sweep(share)?;
            if let Some(what) = ledger.full(share)? {
                let retry_after = ledger.first_expiry(share)?.max(Duration::from_secs(1));
                return Err(match share {
                    Share::Store => StoreError::Full {
                        what,
                        limit: match what {
                            Held::Records => limits.max_records,
                            Held::Bytes => limits.max_bytes,
                        },
                        retry_after,
                    },
                    Share::Scope(_) => StoreError::ScopeFull { what, retry_after },
                    Share::Client(_) => StoreError::ClientFull { retry_after },
                });
            }
        }
        if share == Share::Store
            && let Some(retry_after) = ledger.reserve(claim)?
        {
            return Err(StoreError::Full {
                what: Held::Bytes,
                limit: limits.max_bytes,
                retry_after,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
