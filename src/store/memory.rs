//! The embedded store, for one proxy instance: the same lifecycle as the Redis store,
//! behind one mutex that is never held across an `.await`. It is bounded: when
//! `max_records` live records exist, new claims are refused and nothing live is ever
//! evicted. Expired records are swept in the background and on demand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::{
    ClaimOutcome, ClaimRequest, Existing, Fingerprint, OwnerToken, RecordState, RecordStore, StoreKey, StoredResponse,
    UnknownReason, Write,
};
use crate::error::StoreError;

/// How often the background sweeper drops expired records.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    records: Mutex<HashMap<StoreKey, Record>>,
    max_records: usize,
    #[cfg(feature = "test-util")]
    plant: Option<Plant>,
}

/// A bug planted on purpose, so that a test can show it catches it. Only with the
/// `test-util` feature; without it, every `planted!` is `false` and compiles away.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// Complete, mark unknown and release accept any owner of an in-flight record.
    OwnerCheckDropped,
    /// Complete is accepted after the lease has run out.
    LeaseCheckDropped,
    /// A claim takes over a record whose lease has run out.
    ExpiredLeaseTakenOver,
}

#[cfg(feature = "test-util")]
macro_rules! planted {
    ($store:expr, $plant:ident) => {
        $store.shared.plant == Some(Plant::$plant)
    };
}

#[cfg(not(feature = "test-util"))]
macro_rules! planted {
    ($store:expr, $plant:ident) => {
        false
    };
}

#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    expires_at: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    InFlight { owner: OwnerToken, lease_until: Instant },
    Completed(StoredResponse),
    Unknown(UnknownReason),
}

impl MemoryStore {
    /// A store holding at most `max_records` live records. Must be called inside a
    /// Tokio runtime: it starts the sweeper, which stops when the last handle drops.
    pub fn new(max_records: usize) -> MemoryStore {
        let shared = Arc::new(Shared {
            records: Mutex::new(HashMap::new()),
            max_records,
            #[cfg(feature = "test-util")]
            plant: None,
        });
        tokio::spawn(sweep_forever(Arc::downgrade(&shared)));
        MemoryStore { shared }
    }

    /// A store with `plant` in it, for the negative controls of the conformance test.
    #[cfg(feature = "test-util")]
    pub fn with_plant(max_records: usize, plant: Plant) -> MemoryStore {
        let shared = Arc::new(Shared {
            records: Mutex::new(HashMap::new()),
            max_records,
            plant: Some(plant),
        });
        tokio::spawn(sweep_forever(Arc::downgrade(&shared)));
        MemoryStore { shared }
    }

    /// The number of records held, expired or not.
    #[cfg(feature = "test-util")]
    pub fn len(&self) -> usize {
        self.shared.lock().len()
    }

    #[cfg(feature = "test-util")]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The owner's live in-flight record and its lease deadline, if it still is one.
    fn owned<'a>(
        &self,
        records: &'a mut HashMap<StoreKey, Record>,
        key: &StoreKey,
        owner: OwnerToken,
        now: Instant,
    ) -> Option<(&'a mut Record, Instant)> {
        let record = records.get_mut(key).filter(|record| record.expires_at > now)?;
        match record.state {
            State::InFlight {
                owner: holder,
                lease_until,
            } if holder == owner || planted!(self, OwnerCheckDropped) => Some((record, lease_until)),
            _ => None,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<StoreKey, Record>> {
        // A panic while holding this lock leaves the map consistent: every change is a
        // single insert or remove. So a poisoned lock is still safe to use.
        self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn sweep(records: &mut HashMap<StoreKey, Record>, now: Instant) {
        records.retain(|_, record| record.expires_at > now);
    }
}

async fn sweep_forever(shared: Weak<Shared>) {
    let mut ticks = tokio::time::interval(SWEEP_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else { return };
        Shared::sweep(&mut shared.lock(), Instant::now());
    }
}

impl RecordStore for MemoryStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut records = self.shared.lock();
        let now = Instant::now();
        let taken_over = |record: &Record| {
            planted!(self, ExpiredLeaseTakenOver)
                && matches!(record.state, State::InFlight { lease_until, .. } if lease_until <= now)
        };
        if let Some(record) = records
            .get(&claim.key)
            .filter(|record| record.expires_at > now && !taken_over(record))
        {
            let state = match &record.state {
                State::InFlight { lease_until, .. } if *lease_until <= now => RecordState::LeaseExpired,
                State::InFlight { owner, .. } if *owner == claim.owner => return Ok(ClaimOutcome::Acquired(())),
                State::InFlight { lease_until, .. } => RecordState::InFlight {
                    lease_remaining: *lease_until - now,
                },
                State::Completed(response) => RecordState::Completed(response.clone()),
                State::Unknown(reason) => RecordState::Unknown(*reason),
            };
            return Ok(ClaimOutcome::Existing(Existing {
                fingerprint: record.fingerprint,
                state,
            }));
        }
        if records.len() >= self.shared.max_records {
            Shared::sweep(&mut records, now);
            if records.len() >= self.shared.max_records {
                return Err(StoreError::Full(self.shared.max_records));
            }
        }
        records.insert(
            claim.key.clone(),
            Record {
                fingerprint: claim.fingerprint,
                expires_at: now + claim.retention,
                state: State::InFlight {
                    owner: claim.owner,
                    lease_until: now + claim.lease,
                },
            },
        );
        Ok(ClaimOutcome::Acquired(()))
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        let mut records = self.shared.lock();
        let now = Instant::now();
        Ok(match self.owned(&mut records, key, owner, now) {
            Some((record, lease_until)) if lease_until > now || planted!(self, LeaseCheckDropped) => {
                record.state = State::Completed(response.clone());
                Write::Applied
            }
            _ => Write::Fenced,
        })
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<Write, StoreError> {
        let mut records = self.shared.lock();
        Ok(match self.owned(&mut records, key, owner, Instant::now()) {
            Some((record, _)) => {
                record.state = State::Unknown(reason);
                Write::Applied
            }
            None => Write::Fenced,
        })
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let mut records = self.shared.lock();
        if self.owned(&mut records, key, owner, Instant::now()).is_none() {
            return Ok(Write::Fenced);
        }
        records.remove(key);
        Ok(Write::Applied)
    }

    #[cfg(feature = "test-util")]
    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        Ok(self.shared.lock().remove(key).is_some())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
