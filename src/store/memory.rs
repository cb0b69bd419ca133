//! The embedded store, for one proxy instance: the same lifecycle as the Redis store,
//! behind one mutex that is never held across an `.await`. It is bounded: when
//! `max_records` live records exist, or they hold `max_bytes`, new claims are refused
//! and nothing live is ever evicted; and so that one client cannot take it from the
//! others, a client's records (its scope) are bounded too, by `max_records_per_scope`
//! and `max_bytes_per_scope`; and so that one client address cannot open scopes
//! without end (a scope made of a header is a value the client picks), its scoped
//! records are bounded too, by `max_records_per_client`. Expired records are swept in
//! the background and on demand.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::lifecycle::{self, Schedule, Share};
use super::notify::{Hub, Watcher};
use super::{
    Background, ClaimOutcome, ClaimRequest, ClientId, Deferred, Fingerprint, Handles, OwnerToken, ProbeSchedule,
    ProbeStart, RecordState, RecordStore, RecordSummary, Resolution, Resolved, ScopeId, Spent, Started, StoreKey,
    StoreLimits, StoreUsage, StoredResponse, SummaryState, UnknownReason, Write,
};
use crate::error::{Held, StoreError};
use crate::record::PackedResponse;
use table::Table;

mod table;

/// How often the background sweeper drops expired records.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The most expired records (or dropped responses) one hold of the lock sweeps: the
/// background sweeper lets other requests in between such chunks.
const SWEEP_CHUNK: usize = 4096;

/// The process's memory store, shared by every worker; its sweeper ends with its last
/// handle. Must be called inside a Tokio runtime.
pub(crate) fn open(limits: StoreLimits) -> Started<MemoryStore> {
    let store = MemoryStore::with_limits(limits);
    Started {
        watcher: store.watcher(),
        handles: Handles::Shared(store),
        background: Background::default(),
    }
}

#[derive(Clone, Debug)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

/// What one record costs besides its key and its packed response: the map entry with
/// the map's spare slots, the key's allocation, its entries in the expiry queue and in
/// its client address's, and the allocator's rounding. Measured, not derived: the
/// process's RSS grew by 714 bytes a record over 370,000 records of a 70-byte answer
/// (`bench/bench.py --stores --cases u`, 2026-12-06) of which key and packed response
/// were 300; at 160, as it was, `store.max_bytes` let the RSS grow to 1.55 times it
/// (2.4 times before responses were packed).
const RECORD_OVERHEAD: usize = 416;

/// What a scoped record costs besides the rest: its entry among its scope's expiries.
const SCOPE_OVERHEAD: usize = 48;

#[derive(Debug)]
struct Shared {
    records: Mutex<Records>,
    limits: StoreLimits,
    /// The waiters of records, woken by every change to theirs.
    hub: Arc<Hub>,
    #[cfg(feature = "test-util")]
    plant: Option<Plant>,
}

/// The records, and the bytes they hold (kept equal to the sum of `Record::size` on
/// every insert, change and removal), in all and per scope.
#[derive(Debug, Default)]
struct Records {
    map: Table<Record>,
    bytes: usize,
    scopes: HashMap<ScopeId, ScopeUsage>,
    /// When each client address's records expire (their bytes are not counted
    /// per client: only their number is bounded).
    clients: HashMap<ClientId, ScopeUsage>,
    /// When each record expires, earliest first, so that a sweep touches only what is
    /// due (a walk over every record held the lock every request takes for tens of
    /// milliseconds at a million records). An entry whose record has gone or changed
    /// since is skipped when it comes up.
    expiries: Due,
    /// When each record's retention ends, for a record that is remembered past it:
    /// its response, if it has one by then, is dropped.
    retentions: Due,
    /// Sweeps so far, for tests.
    sweeps: u64,
    /// Records whose response the sweeper dropped, kept until they expire.
    spent: usize,
}

/// What one scope's records hold, and when each expires (for a `Retry-After`).
#[derive(Debug, Default)]
struct ScopeUsage {
    bytes: usize,
    expiries: BTreeSet<(Instant, StoreKey)>,
}

impl Records {
    /// The record under `key`, unless it has expired by `now` (the sweep may not have
    /// removed it yet).
    fn live(&self, key: &StoreKey, now: Instant) -> Option<&Record> {
        self.map.get(key).filter(|record| record.expires_at > now)
    }

    fn live_mut(&mut self, key: &StoreKey, now: Instant) -> Option<&mut Record> {
        self.map.get_mut(key).filter(|record| record.expires_at > now)
    }

    fn insert(&mut self, key: StoreKey, record: Record) {
        if record.response_until < record.expires_at {
            self.retentions.push(Reverse((record.response_until, key.clone())));
        }
        self.expiries.push(Reverse((record.expires_at, key.clone())));
        count(&mut self.bytes, &mut self.scopes, &mut self.clients, &key, &record);
        if let Some(old) = self.map.insert(key.clone(), record) {
            self.spent -= usize::from(old.spent());
            uncount(&mut self.bytes, &mut self.scopes, &mut self.clients, &key, &old);
        }
    }

    fn remove(&mut self, key: &StoreKey) -> Option<Record> {
        let record = self.map.remove(key)?;
        self.spent -= usize::from(record.spent());
        uncount(&mut self.bytes, &mut self.scopes, &mut self.clients, key, &record);
        Some(record)
    }

    /// Gives `key`'s record the state `state`, keeping the counts right.
    fn set_state(&mut self, key: &StoreKey, state: State) {
        if let Some(record) = self.map.get_mut(key) {
            let before = record.size(key);
            self.spent -= usize::from(record.spent());
            record.state = state;
            self.spent += usize::from(record.spent());
            let after = record.size(key);
            self.bytes = self.bytes - before + after;
            if let Some(usage) = record.scope.and_then(|scope| self.scopes.get_mut(&scope)) {
                usage.bytes = usage.bytes - before + after;
            }
        }
    }

    /// Drops at most `SWEEP_CHUNK` records expired by `now` and as many responses
    /// past their retention; whether more are due.
    fn sweep(&mut self, now: Instant) -> bool {
        self.sweeps += 1;
        for _ in 0..SWEEP_CHUNK {
            let Some(key) = due(&mut self.expiries, now) else { break };
            if self.map.get(&key).is_some_and(|record| record.expires_at <= now) {
                self.remove(&key);
            }
        }
        for _ in 0..SWEEP_CHUNK {
            let Some(key) = due(&mut self.retentions, now) else {
                break;
            };
            self.drop_response(&key, now);
        }
        [&self.expiries, &self.retentions]
            .iter()
            .any(|queue| queue.peek().is_some_and(|Reverse((at, _))| *at <= now))
    }

    /// Past its retention a completed record's response is dropped, on the store's own
    /// clock, whether or not a retry ever reads it.
    fn drop_response(&mut self, key: &StoreKey, now: Instant) {
        let Some(record) = self.map.get_mut(key) else { return };
        if record.response_until <= now
            && let State::Completed(done) = &mut record.state
            && let Some(response) = done.response.take()
        {
            let dropped = response.size();
            self.bytes -= dropped;
            self.spent += 1;
            if let Some(usage) = record.scope.and_then(|scope| self.scopes.get_mut(&scope)) {
                usage.bytes -= dropped;
            }
        }
    }

    /// When the first live record expires (`None`: none is held); the entries of
    /// records gone or changed since are dropped on the way.
    fn next_expiry(&mut self) -> Option<Instant> {
        while let Some(Reverse((at, key))) = self.expiries.peek() {
            if self.map.get(key).is_some_and(|record| record.expires_at == *at) {
                return Some(*at);
            }
            self.expiries.pop();
        }
        None
    }

    /// The keys of `usage`'s records that expired by `now`.
    fn expired(usage: Option<&ScopeUsage>, now: Instant) -> Vec<StoreKey> {
        usage
            .map(|usage| {
                usage
                    .expiries
                    .iter()
                    .take_while(|(expires_at, _)| *expires_at <= now)
                    .map(|(_, key)| key.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Records' keys by a time of theirs, earliest first.
type Due = BinaryHeap<Reverse<(Instant, StoreKey)>>;

/// The key of `queue`'s first entry, taken, if it is due by `now`.
fn due(queue: &mut Due, now: Instant) -> Option<StoreKey> {
    if queue.peek()?.0.0 > now {
        return None;
    }
    queue.pop().map(|Reverse((_, key))| key)
}

/// Adds `record`'s bytes to the store's and its scope's, and its expiry to its scope's
/// and its client address's (scoped or not: on a route without scope one address
/// could otherwise fill the store for every other).
fn count(
    bytes: &mut usize,
    scopes: &mut HashMap<ScopeId, ScopeUsage>,
    clients: &mut HashMap<ClientId, ScopeUsage>,
    key: &StoreKey,
    record: &Record,
) {
    let size = record.size(key);
    *bytes += size;
    if let Some(scope) = record.scope {
        let usage = scopes.entry(scope).or_default();
        usage.bytes += size;
        usage.expiries.insert((record.expires_at, key.clone()));
    }
    if let Some(client) = record.client {
        clients
            .entry(client)
            .or_default()
            .expiries
            .insert((record.expires_at, key.clone()));
    }
}

/// The inverse of `count`; a scope or a client with no record left is forgotten.
fn uncount(
    bytes: &mut usize,
    scopes: &mut HashMap<ScopeId, ScopeUsage>,
    clients: &mut HashMap<ClientId, ScopeUsage>,
    key: &StoreKey,
    record: &Record,
) {
    let size = record.size(key);
    *bytes -= size;
    if let Some(scope) = record.scope
        && let Some(usage) = scopes.get_mut(&scope)
    {
        usage.bytes -= size;
        usage.expiries.remove(&(record.expires_at, key.clone()));
        if usage.expiries.is_empty() {
            scopes.remove(&scope);
        }
    }
    if let Some(client) = record.client
        && let Some(usage) = clients.get_mut(&client)
    {
        usage.expiries.remove(&(record.expires_at, key.clone()));
        if usage.expiries.is_empty() {
            clients.remove(&client);
        }
    }
}

/// A bug planted on purpose, so that a test can show it catches it: one field of the
/// store, and one `planted!` at each site. Without the `test-util` feature there is
/// nothing to plant, and every `planted!` is `false` and compiles away.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// Complete, mark unknown and release accept any owner of an in-flight record.
    OwnerCheckDropped,
    /// Complete is accepted after the lease has run out.
    LeaseCheckDropped,
    /// A claim takes over a record whose lease has run out.
    ExpiredLeaseTakenOver,
    /// A resolution changes a record that is not unknown.
    ResolveCheckDropped,
}

#[cfg(feature = "test-util")]
macro_rules! planted {
    ($store:expr, $plant:ident) => {
        $store.shared.plant == Some(Plant::$plant)
    };
}

/// Nothing can be planted without the feature.
#[cfg(not(feature = "test-util"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plant {}

#[cfg(not(feature = "test-util"))]
macro_rules! planted {
    ($store:expr, $plant:ident) => {
        false
    };
}

#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    /// The end of `remember`: the record is gone.
    expires_at: Instant,
    /// The end of `retention`: a completed record's response is dropped.
    response_until: Instant,
    scope: Option<ScopeId>,
    client: Option<ClientId>,
    state: State,
}

impl Record {
    /// The bytes this record holds: its key, its response if it has one, and the
    /// bookkeeping around it (with its scope's copy of its key, when it has a scope).
    fn size(&self, key: &StoreKey) -> usize {
        let response = match &self.state {
            State::Completed(done) => done.response.as_ref().map_or(0, PackedResponse::size),
            State::InFlight { .. } | State::Unknown { .. } => 0,
        };
        let scoped = self.scope.map_or(0, |_| SCOPE_OVERHEAD + key.as_str().len());
        RECORD_OVERHEAD + key.as_str().len() + scoped + response
    }
}

/// Where a record stands: what it completed with is `Done`.
type State = lifecycle::State<Instant, Done>;

/// What a completed record keeps: its response until its retention ends (`None`
/// after), packed into one allocation, and what the guard reads past it.
#[derive(Debug)]
struct Done {
    response: Option<PackedResponse>,
    spent: Spent,
}

impl Done {
    /// The completed state of a record whose retention ends at `response_until`.
    fn new(response: &StoredResponse, response_until: Instant, now: Instant) -> State {
        State::Completed(Done {
            response: (response_until > now).then(|| PackedResponse::pack(response)),
            spent: Spent {
                status: response.status,
                completed_at: Some(SystemTime::now()),
            },
        })
    }
}

impl Record {
    /// Whether it is completed and its response was dropped.
    fn spent(&self) -> bool {
        matches!(&self.state, State::Completed(done) if done.response.is_none())
    }

    /// What a claim reads of its completed state: the response within its retention,
    /// what is left past it.
    fn completed(&self, done: &Done, now: Instant) -> Result<RecordState, StoreError> {
        Ok(match &done.response {
            Some(response) if self.response_until > now => RecordState::Completed(
                response
                    .unpack()
                    .ok_or(StoreError::Protocol("a recorded response did not unpack"))?,
            ),
            _ => RecordState::Spent(done.spent),
        })
    }
}

impl MemoryStore {
    /// A store holding at most `max_records` live records, and admitting no claim once
    /// they hold `max_bytes`. Must be called inside a
    /// Tokio runtime: it starts the sweeper, which stops when the last handle drops.
    pub fn new(max_records: usize, max_bytes: usize) -> MemoryStore {
        MemoryStore::with_limits(StoreLimits {
            max_records,
            max_bytes,
            max_records_per_scope: max_records,
            max_bytes_per_scope: max_bytes,
            max_records_per_client: max_records,
        })
    }

    /// A store with every bound of `limits`. Must be called inside a Tokio runtime.
    pub fn with_limits(limits: StoreLimits) -> MemoryStore {
        MemoryStore::open(limits, None)
    }

    /// A store with `plant` in it, for the negative controls of the conformance test.
    #[cfg(feature = "test-util")]
    pub fn with_plant(max_records: usize, plant: Plant) -> MemoryStore {
        let limits = StoreLimits {
            max_records,
            max_bytes: usize::MAX,
            max_records_per_scope: max_records,
            max_bytes_per_scope: usize::MAX,
            max_records_per_client: max_records,
        };
        MemoryStore::open(limits, Some(plant))
    }

    fn open(limits: StoreLimits, plant: Option<Plant>) -> MemoryStore {
        // Without the feature `Plant` has no value: `plant` is `None`, and unused.
        #[cfg(not(feature = "test-util"))]
        let _ = plant;
        let shared = Arc::new(Shared {
            records: Mutex::new(Records::default()),
            limits,
            hub: Arc::default(),
            #[cfg(feature = "test-util")]
            plant,
        });
        tokio::spawn(sweep_forever(Arc::downgrade(&shared)));
        MemoryStore { shared }
    }

    /// Where this store's waiters are woken.
    pub(crate) fn watcher(&self) -> Watcher {
        Watcher::Local(self.shared.hub.clone())
    }

    /// The sweeps of the records so far: the background one's and those of claims
    /// that found the store full.
    #[cfg(feature = "test-util")]
    pub fn sweeps(&self) -> u64 {
        self.shared.lock().sweeps
    }

    /// The number of records held, expired or not.
    #[cfg(feature = "test-util")]
    pub fn len(&self) -> usize {
        self.shared.lock().map.len()
    }

    #[cfg(feature = "test-util")]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the store holds, expired records not yet swept included, and its bounds.
    pub fn usage(&self) -> StoreUsage {
        let records = self.shared.lock();
        StoreUsage {
            backend: "memory",
            records: records.map.len(),
            bytes: records.bytes,
            max_records: self.shared.limits.max_records,
            max_bytes: self.shared.limits.max_bytes,
            spent: records.spent,
        }
    }

    /// The lease deadline of the owner's live in-flight record, if it still is one.
    fn owned(&self, records: &Records, key: &StoreKey, owner: OwnerToken, now: Instant) -> Option<Instant> {
        let record = records.live(key, now)?;
        match record.state {
            State::InFlight {
                owner: holder,
                lease_until,
            } if holder == owner || planted!(self, OwnerCheckDropped) => Some(lease_until),
            _ => None,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Records> {
        // A panic while holding this lock leaves the map consistent: every change is a
        // single insert or remove. So a poisoned lock is still safe to use.
        self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

async fn sweep_forever(shared: Weak<Shared>) {
    let mut ticks = tokio::time::interval(SWEEP_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else { return };
        // A chunk at a time, letting requests in between.
        loop {
            let more = shared.lock().sweep(Instant::now());
            if !more {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

/// The memory store's shares, as `lifecycle::admit` asks for them.
struct Ledger<'a> {
    records: &'a mut Records,
    limits: StoreLimits,
    now: Instant,
}

impl lifecycle::Ledger for Ledger<'_> {
    fn full(&mut self, share: Share) -> Result<Option<Held>, StoreError> {
        let (records, bytes, max_records, max_bytes) = match share {
            Share::Store => (
                self.records.map.len(),
                self.records.bytes,
                self.limits.max_records,
                self.limits.max_bytes,
            ),
            Share::Scope(scope) => match self.records.scopes.get(&scope) {
                None => return Ok(None),
                Some(usage) => (
                    usage.expiries.len(),
                    usage.bytes,
                    self.limits.max_records_per_scope,
                    self.limits.max_bytes_per_scope,
                ),
            },
            // A client address's bytes are not counted: only its number of records.
            Share::Client(client) => match self.records.clients.get(&client) {
                None => return Ok(None),
                Some(usage) => (usage.expiries.len(), 0, self.limits.max_records_per_client, usize::MAX),
            },
        };
        Ok(if records >= max_records {
            Some(Held::Records)
        } else if bytes >= max_bytes {
            Some(Held::Bytes)
        } else {
            None
        })
    }

    fn sweep(&mut self, share: Share) -> Result<(), StoreError> {
        let now = self.now;
        let expired = match share {
            // Only once a record has expired, not on every refusal.
            Share::Store => {
                if self.records.next_expiry().is_some_and(|next| next <= now) {
                    self.records.sweep(now);
                }
                return Ok(());
            }
            Share::Scope(scope) => Records::expired(self.records.scopes.get(&scope), now),
            Share::Client(client) => Records::expired(self.records.clients.get(&client), now),
        };
        for key in &expired {
            self.records.remove(key);
        }
        Ok(())
    }

    fn first_expiry(&mut self, share: Share) -> Result<Duration, StoreError> {
        let now = self.now;
        let first = match share {
            Share::Store => self.records.next_expiry(),
            Share::Scope(scope) => self.records.scopes.get(&scope).and_then(ScopeUsage::first),
            Share::Client(client) => self.records.clients.get(&client).and_then(ScopeUsage::first),
        };
        Ok(first.map_or(Duration::ZERO, |first| first.saturating_duration_since(now)))
    }
}

impl ScopeUsage {
    fn first(&self) -> Option<Instant> {
        self.expiries.first().map(|(expires_at, _)| *expires_at)
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
            .map
            .get(&claim.key)
            .filter(|record| record.expires_at > now && !taken_over(record))
        {
            return lifecycle::claim(record.fingerprint, record.state.as_ref(), claim.owner, now, |done| {
                record.completed(done, now)
            });
        }
        let limits = self.shared.limits;
        lifecycle::admit(
            &mut Ledger {
                records: &mut records,
                limits,
                now,
            },
            claim,
            &limits,
        )?;
        records.insert(
            claim.key.clone(),
            Record {
                fingerprint: claim.fingerprint,
                expires_at: now + claim.remember.max(claim.retention),
                response_until: now + claim.retention,
                scope: claim.scope,
                client: claim.client,
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
        Ok(match self.owned(&records, key, owner, now) {
            Some(lease_until) if lease_until > now || planted!(self, LeaseCheckDropped) => {
                let until = records.map.get(key).map_or(now, |record| record.response_until);
                records.set_state(key, Done::new(response, until, now));
                self.shared.hub.wake(key.as_str());
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
        schedule: Option<ProbeSchedule>,
    ) -> Result<Write, StoreError> {
        let mut records = self.shared.lock();
        let now = Instant::now();
        Ok(match self.owned(&records, key, owner, now) {
            Some(_) => {
                let schedule = schedule.map(|schedule| Schedule::new(now, schedule.first_after, schedule));
                records.set_state(
                    key,
                    State::Unknown {
                        reason,
                        owner,
                        schedule,
                    },
                );
                self.shared.hub.wake(key.as_str());
                Write::Applied
            }
            None => Write::Fenced,
        })
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let mut records = self.shared.lock();
        if self.owned(&records, key, owner, Instant::now()).is_none() {
            return Ok(Write::Fenced);
        }
        records.remove(key);
        self.shared.hub.wake(key.as_str());
        Ok(Write::Applied)
    }

    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let removed = self.shared.lock().remove(key).is_some();
        self.shared.hub.wake(key.as_str());
        Ok(removed)
    }

    async fn response(&self, key: &StoreKey) -> Result<Option<StoredResponse>, StoreError> {
        let records = self.shared.lock();
        let now = Instant::now();
        Ok(match records.live(key, now) {
            Some(record) => match &record.state {
                State::Completed(done) => match record.completed(done, now)? {
                    RecordState::Completed(response) => Some(response),
                    _ => None,
                },
                _ => None,
            },
            None => None,
        })
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<RecordSummary>, StoreError> {
        let records = self.shared.lock();
        let now = Instant::now();
        let Some(record) = records.live(key, now) else {
            return Ok(None);
        };
        let (state, owner) = lifecycle::summary(record.state.as_ref(), now, |done| {
            Ok::<_, StoreError>(match record.completed(done, now)? {
                RecordState::Completed(response) => SummaryState::Completed {
                    status: response.status.as_u16(),
                    response_bytes: response.body.len() as u64,
                    trace_id: response.trace.map(crate::record::ExecutionTrace::trace_id_hex),
                },
                _ => SummaryState::Spent(done.spent),
            })
        })?;
        Ok(Some(RecordSummary {
            fingerprint: record.fingerprint,
            ttl: record.expires_at - now,
            state,
            owner,
        }))
    }

    async fn resolve(
        &self,
        key: &StoreKey,
        owner: Option<OwnerToken>,
        resolution: &Resolution,
    ) -> Result<Resolved, StoreError> {
        let mut records = self.shared.lock();
        let now = Instant::now();
        let Some(record) = records.live(key, now) else {
            return Ok(Resolved::Absent);
        };
        match lifecycle::resolvable(&record.state, owner, now) {
            Ok(()) => {}
            Err(Resolved::NotUnknown) if planted!(self, ResolveCheckDropped) => {}
            Err(answer) => return Ok(answer),
        }
        match resolution {
            Resolution::Applied(response) => {
                let state = Done::new(response, record.response_until, now);
                records.set_state(key, state);
            }
            Resolution::NotApplied => {
                records.remove(key);
            }
        }
        self.shared.hub.wake(key.as_str());
        Ok(Resolved::Resolved)
    }

    async fn begin_probe(
        &self,
        key: &StoreKey,
        schedule: ProbeSchedule,
        lease: Duration,
    ) -> Result<ProbeStart, StoreError> {
        let mut records = self.shared.lock();
        let now = Instant::now();
        let Some(record) = records.live_mut(key, now) else {
            return Ok(ProbeStart::Settled);
        };
        let (start, change) = lifecycle::begin_probe(&record.state, schedule, lease, now);
        if let Some(change) = change {
            record.state.apply(change);
        }
        Ok(start)
    }

    async fn defer_probe(&self, key: &StoreKey, named: OwnerToken, every: Duration) -> Result<Deferred, StoreError> {
        let mut records = self.shared.lock();
        let now = Instant::now();
        let Some(record) = records.live_mut(key, now) else {
            return Ok(Deferred::Settled);
        };
        let (deferred, change) = lifecycle::defer_probe(&record.state, named, every, now);
        if let Some(change) = change {
            record.state.apply(change);
        }
        Ok(deferred)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn usage(&self) -> Option<StoreUsage> {
        Some(MemoryStore::usage(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(expires_at: Instant, response_until: Instant) -> Record {
        Record {
            fingerprint: Fingerprint([0; 32]),
            expires_at,
            response_until,
            scope: None,
            client: None,
            state: State::InFlight {
                owner: OwnerToken::generate().expect("a token"),
                lease_until: expires_at,
            },
        }
    }

    fn key(n: usize) -> StoreKey {
        StoreKey::from_derived(format!("test:payments:{{{n}}}"))
    }

    /// A sweep takes only what is due, a chunk at a time, and skips the queue entries of
    /// records that changed since they were queued.
    #[test]
    fn a_sweep_takes_what_is_due_a_chunk_at_a_time() {
        let now = Instant::now();
        let soon = now + Duration::from_secs(1);
        let later = now + Duration::from_secs(60);
        let mut records = Records::default();
        for n in 0..SWEEP_CHUNK + 10 {
            records.insert(key(n), record(soon, soon));
        }
        for n in SWEEP_CHUNK + 10..SWEEP_CHUNK + 20 {
            records.insert(key(n), record(later, later));
        }
        // Queued to expire soon, then taken again with a later expiry.
        records.insert(key(0), record(later, later));
        assert!(!records.sweep(now), "nothing is due yet");
        assert_eq!(records.map.len(), SWEEP_CHUNK + 20);
        assert_eq!(records.next_expiry(), Some(soon));

        assert!(records.sweep(soon), "more than a chunk is due");
        assert!(!records.sweep(soon), "the rest fits in the next chunk");
        assert_eq!(records.map.len(), 11, "the 10 kept for later, and the one taken again");
        assert!(records.map.get(&key(0)).is_some());
        assert_eq!(records.bytes, records_bytes(&records), "what is left is counted");
        assert_eq!(records.next_expiry(), Some(later));
    }

    /// A record remembered past its retention loses its response when the retention
    /// ends, and is counted as spent; it is dropped when it expires.
    #[test]
    fn a_sweep_drops_a_response_at_the_end_of_its_retention() {
        let now = Instant::now();
        let retained = now + Duration::from_secs(1);
        let remembered = now + Duration::from_secs(60);
        let mut records = Records::default();
        records.insert(key(1), record(remembered, retained));
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: Vec::new(),
            body: bytes::Bytes::from_static(b"{}"),
            trace: None,
            replay_until: None,
        };
        records.set_state(&key(1), Done::new(&response, retained, now));
        let with_response = records.bytes;
        assert!(!records.sweep(now));
        assert_eq!((records.spent, records.bytes), (0, with_response));

        assert!(!records.sweep(retained));
        assert_eq!(records.spent, 1);
        assert_eq!(records.bytes, with_response - response.size());
        assert!(records.map.get(&key(1)).is_some_and(Record::spent));

        assert!(!records.sweep(remembered));
        assert_eq!((records.map.len(), records.spent, records.bytes), (0, 0, 0));
    }

    fn records_bytes(records: &Records) -> usize {
        (0..SWEEP_CHUNK + 20)
            .filter_map(|n| records.map.get(&key(n)).map(|record| record.size(&key(n))))
            .sum()
    }
}
