//! The record protocol of docs/design.md §4 as a model: one record, the owners that write it,
//! and what the store answers each operation. The model check (`tests/model.rs`) proves
//! the protocol safe over every interleaving of proxies with `Record::apply`; the
//! conformance test (`tests/conformance.rs`) checks that the real stores answer exactly
//! as `Record::apply` does. One function serves both, so a store that strays from the
//! model that was proven safe fails a test.

/// The one record, as the store holds it. `owner` is the claimant: its fingerprint,
/// response and unknown-reason are functions of it (see `tests/conformance.rs`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Record {
    Free,
    InFlight {
        owner: u8,
        lease_valid: bool,
    },
    Completed {
        owner: u8,
    },
    Unknown {
        owner: u8,
    },
    /// Completed by a resolution of its unknown outcome (an operator's or a probe's):
    /// `owner`'s fingerprint, and the response the resolution recorded.
    Reconciled {
        owner: u8,
    },
    /// Completed (by its owner or a resolution), and past the retention: the response
    /// is dropped, the key still known until `remember` ends (docs/design.md §24).
    Spent {
        owner: u8,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Op {
    Claim,
    Complete,
    MarkUnknown,
    Release,
    /// A resolution of an unknown outcome, by an operator or a probe, fenced on the
    /// claim it learned about (the `owner` it is applied as): applied records the
    /// learned response, not applied frees the key.
    ResolveApplied,
    ResolveNotApplied,
}

/// What the store answers.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Reply {
    /// The claim is the caller's (new, or its own live one).
    Acquired,
    /// Another claim holds or held the record; this is what the caller was told.
    Existing(Record),
    /// A compare-and-set write changed the record.
    Applied,
    /// A compare-and-set write was refused.
    Fenced,
}

/// Which rules the store keeps; everything but `CORRECT` is a negative control.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    pub compare_and_set: bool,
    pub takeover_expired_leases: bool,
    /// Whether a resolution is fenced on the claim it learned about, or lands on
    /// whatever unknown record the key holds when it arrives.
    pub resolutions_fenced_on_their_claim: bool,
}

pub const CORRECT: Variant = Variant {
    compare_and_set: true,
    takeover_expired_leases: false,
    resolutions_fenced_on_their_claim: true,
};

impl Record {
    /// The store applies `op` from `owner`, as its script would.
    pub fn apply(&mut self, owner: u8, op: Op, variant: Variant) -> Reply {
        let owned_in_flight = matches!(*self, Record::InFlight { owner: holder, .. } if holder == owner);
        let write = |allowed: bool, record: &mut Record, next: Record| {
            if allowed || !variant.compare_and_set {
                *record = next;
                Reply::Applied
            } else {
                Reply::Fenced
            }
        };
        match op {
            Op::Claim => match *self {
                Record::Free => {
                    *self = Record::InFlight {
                        owner,
                        lease_valid: true,
                    };
                    Reply::Acquired
                }
                Record::InFlight {
                    owner: holder,
                    lease_valid: true,
                } if holder == owner => Reply::Acquired,
                Record::InFlight { lease_valid: false, .. } if variant.takeover_expired_leases => {
                    *self = Record::InFlight {
                        owner,
                        lease_valid: true,
                    };
                    Reply::Acquired
                }
                existing => Reply::Existing(existing),
            },
            Op::Complete => {
                let allowed = matches!(*self, Record::InFlight { owner: holder, lease_valid: true } if holder == owner);
                write(allowed, self, Record::Completed { owner })
            }
            Op::MarkUnknown => write(owned_in_flight, self, Record::Unknown { owner }),
            Op::Release => write(owned_in_flight, self, Record::Free),
            Op::ResolveApplied | Op::ResolveNotApplied => {
                // Compare-and-set from "unknown": marked so, or in flight past its lease.
                // Fenced on the claim it names, `owner`.
                let first = match *self {
                    Record::Unknown { owner: holder }
                    | Record::InFlight {
                        owner: holder,
                        lease_valid: false,
                    } if holder == owner || !variant.compare_and_set || !variant.resolutions_fenced_on_their_claim => {
                        Some(holder)
                    }
                    Record::InFlight { owner, .. }
                    | Record::Completed { owner }
                    | Record::Reconciled { owner }
                    | Record::Spent { owner }
                        if !variant.compare_and_set =>
                    {
                        Some(owner)
                    }
                    _ => None,
                };
                match (first, op) {
                    (Some(owner), Op::ResolveApplied) => {
                        *self = Record::Reconciled { owner };
                        Reply::Applied
                    }
                    (Some(_), _) => {
                        *self = Record::Free;
                        Reply::Applied
                    }
                    (None, _) => Reply::Fenced,
                }
            }
        }
    }

    /// The store's clock passes the retention of a completed record: its response is
    /// dropped, the record kept. Nothing else changes (the clock steps of a record
    /// in flight or unknown are the lease's and `remember`'s).
    pub fn expire_response(&mut self) {
        if let Record::Completed { owner } | Record::Reconciled { owner } = *self {
            *self = Record::Spent { owner };
        }
    }

    /// The store's clock passes the lease of an in-flight record.
    pub fn expire_lease(&mut self) {
        if let Record::InFlight { owner, .. } = *self {
            *self = Record::InFlight {
                owner,
                lease_valid: false,
            };
        }
    }
}

/// Something the store sees: an operation from an owner, or its clock passing a
/// deadline.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Event {
    Apply {
        owner: u8,
        op: Op,
    },
    /// The clock passes the lease of the record in flight, if there is one.
    LeaseExpires,
    /// The clock passes a completed record's retention: its response is dropped.
    ResponseExpires,
    /// The clock passes the record's `remember`: it is gone.
    RetentionExpires,
}

impl Record {
    /// What the store answers to `event` (`None` for the clock), and the record after.
    pub fn step(&mut self, event: Event, variant: Variant) -> Option<Reply> {
        match event {
            Event::Apply { owner, op } => Some(self.apply(owner, op, variant)),
            Event::LeaseExpires => {
                self.expire_lease();
                None
            }
            Event::ResponseExpires => {
                self.expire_response();
                None
            }
            Event::RetentionExpires => {
                *self = Record::Free;
                None
            }
        }
    }
}
