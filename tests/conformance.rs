//! Model-based conformance: the real stores (the memory store on a paused Tokio clock,
//! the SQLite store on its own clock moved forward, and a real `redis-server`) are driven through sequences of the record protocol's
//! events (claims, completes, mark-unknowns and releases from several owners; leases
//! and retention running out) and held, at every step, to `protocol::Record::apply`,
//! the function the model check (`tests/model.rs`) proves safe. The sequences are the
//! model's own explored traces plus random ones from proptest. On Redis every step also
//! checks the record's TTL: the retention from its claim, never moved, and no key once
//! the model says the record is gone.
//!
//! Negative controls: bugs planted in mutated copies of the Lua scripts (loaded on the
//! side) and in the memory store (the `test-util` plants) must each be caught.
//!
//! The clock: the memory store runs on Tokio's paused clock, advanced past the lease or
//! the retention. Redis's clock cannot be moved, so the lease runs out by moving the
//! record's lease deadline into the past (the scripts read it from that field and
//! nothing else), and the retention by `PEXPIREAT` in the past.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idemproxy::idempotency::{parse_key_value, store_key};
use idemproxy::store::memory::Plant;
use idemproxy::store::redis::{ClaimPlant, ScriptName};
use idemproxy::store::{
    AnyStore, ClaimOutcome, ClaimRequest, Existing, Fingerprint, MemoryStore, OwnerToken, PostgresStore, RecordState,
    RecordStore, RedisStore, Resolution, Resolved, SqliteStore, StoreKey, StoreLimits, StoredResponse, UnknownReason,
    Write,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestError, TestRunner};
use support::model::explore;
use support::protocol::{CORRECT, Event, Op, Record, Reply};
use support::{PostgresServer, RedisServer};

/// Owners 0..OWNERS write; the last token observes the final state with a claim.
const OWNERS: u8 = 3;
const OBSERVER: u8 = OWNERS;
/// On Redis the lease is real and long (it only runs out when a step says so), and
/// shorter than the retention, so an expiry set to the lease shows in the TTL check.
const LEASE: Duration = Duration::from_secs(3600);
const RETENTION: Duration = Duration::from_secs(7200);
/// How long a record outlives its response in the sequences that remember (every
/// other one: the rest have `remember` = `retention`, the default).
const REMEMBER: Duration = Duration::from_secs(3 * 7200);

// === what each owner writes ===

fn fingerprint(owner: u8) -> Fingerprint {
    Fingerprint([owner + 1; 32])
}

fn response(owner: u8) -> StoredResponse {
    StoredResponse {
        status: StatusCode::from_u16(200 + u16::from(owner)).expect("status"),
        headers: vec![(HeaderName::from_static("x-owner"), HeaderValue::from(u16::from(owner)))],
        body: Bytes::from(format!("from owner {owner}")),
        trace: None,
        replay_until: None,
    }
}

/// What every resolution as applied records: no owner's response (nor status).
fn learned() -> StoredResponse {
    StoredResponse {
        status: StatusCode::from_u16(250).expect("status"),
        headers: vec![(HeaderName::from_static("x-learned"), HeaderValue::from_static("yes"))],
        body: Bytes::from_static(b"learned from the upstream"),
        trace: None,
        replay_until: None,
    }
}

fn reason(owner: u8) -> UnknownReason {
    [
        UnknownReason::UpstreamTimeout,
        UnknownReason::UpstreamFailed,
        UnknownReason::ResponseTooLarge,
    ][usize::from(owner % 3)]
}

/// The owner whose fingerprint this is.
fn owner_of(fingerprint: Fingerprint) -> Option<u8> {
    (0..=OBSERVER).find(|owner| self::fingerprint(*owner) == fingerprint)
}

/// What a store answered a claim, in the model's terms; `Err` when the answer cannot
/// be one the model gives (a fingerprint, response or reason of the wrong owner).
fn observed_claim(outcome: ClaimOutcome) -> Result<Reply, String> {
    let Existing { fingerprint, state } = match outcome {
        ClaimOutcome::Acquired(()) => return Ok(Reply::Acquired),
        ClaimOutcome::Existing(existing) => existing,
    };
    let owner = owner_of(fingerprint).ok_or_else(|| format!("a fingerprint no owner sent: {fingerprint:?}"))?;
    let record = match state {
        RecordState::InFlight { .. } => Record::InFlight {
            owner,
            lease_valid: true,
        },
        RecordState::LeaseExpired => Record::InFlight {
            owner,
            lease_valid: false,
        },
        RecordState::Completed(stored) if stored == response(owner) => Record::Completed { owner },
        RecordState::Completed(stored) if stored == learned() => Record::Reconciled { owner },
        RecordState::Completed(stored) => return Err(format!("owner {owner}'s record holds {stored:?}")),
        RecordState::Spent(spent) if [response(owner).status, learned().status].contains(&spent.status) => {
            Record::Spent { owner }
        }
        RecordState::Spent(spent) => return Err(format!("owner {owner}'s spent record has {spent:?}")),
        RecordState::Unknown { reason: why, .. } if why == reason(owner) => Record::Unknown { owner },
        RecordState::Unknown { reason: why, .. } => {
            return Err(format!("owner {owner}'s record is unknown for {why:?}"));
        }
    };
    Ok(Reply::Existing(record))
}

fn observed_resolution(resolved: Resolved) -> Reply {
    match resolved {
        Resolved::Resolved => Reply::Applied,
        Resolved::NotUnknown | Resolved::OtherClaim | Resolved::Absent => Reply::Fenced,
    }
}

fn observed_write(write: Write) -> Reply {
    match write {
        Write::Applied => Reply::Applied,
        Write::Fenced => Reply::Fenced,
    }
}

// === the stores under test ===

/// One store, one record, and the clock that runs it.
trait Driver {
    async fn apply(&mut self, owner: u8, op: Op) -> Result<Reply, String>;
    async fn expire_lease(&mut self);
    /// Whether its records outlive their responses (`remember` > `retention`); without,
    /// a response's retention is its record's, and `ResponseExpires` is not driven.
    fn remembers(&self) -> bool;
    /// Passes the retention of the completed record `model` says is there.
    async fn expire_response(&mut self);
    async fn expire_retention(&mut self);
    /// Checks what can be seen of the record besides the answers (Redis: its TTL).
    async fn check(&mut self, model: Record) -> Result<(), String>;
}

/// A store and the tokens and key of one sequence.
struct Subject<S> {
    store: S,
    key: StoreKey,
    /// What its claims ask to be remembered for: `RETENTION` or `REMEMBER`.
    remember: Duration,
    tokens: Vec<OwnerToken>,
    /// Where records are sealed: another owner's fingerprint comes back as its HMAC,
    /// named here by the owner who sent it.
    sealer: Option<std::sync::Arc<idemproxy::store::Sealer>>,
}

impl<S: RecordStore> Subject<S> {
    /// Sequence `n`'s subject: a record of its own, remembered past its response's
    /// retention on every other sequence.
    fn new(store: S, n: usize) -> Subject<S> {
        let tokens = (0..=OBSERVER)
            .map(|_| OwnerToken::generate().expect("random bytes"))
            .collect();
        Subject {
            store,
            key: key(n),
            remember: if n % 2 == 1 { REMEMBER } else { RETENTION },
            tokens,
            sealer: None,
        }
    }

    /// The fingerprint a claim found, as the owner that sent it wrote it.
    fn unsealed(&self, outcome: ClaimOutcome) -> ClaimOutcome {
        let (Some(sealer), ClaimOutcome::Existing(existing)) = (&self.sealer, &outcome) else {
            return outcome;
        };
        let sender = (0..=OBSERVER).find(|owner| sealer.fingerprint(fingerprint(*owner)) == existing.fingerprint);
        match sender {
            Some(owner) => ClaimOutcome::Existing(Existing {
                fingerprint: fingerprint(owner),
                state: existing.state.clone(),
            }),
            None => outcome,
        }
    }

    async fn apply(&self, owner: u8, op: Op, lease: Duration) -> Result<Reply, String> {
        let token = self.tokens[usize::from(owner)];
        let failed = |error| format!("the store failed: {error}");
        match op {
            Op::Claim => {
                let request = ClaimRequest {
                    key: self.key.clone(),
                    scope: None,
                    client: None,
                    owner: token,
                    fingerprint: fingerprint(owner),
                    retention: RETENTION,
                    remember: self.remember,
                    lease,
                    response_limit: 0,
                    probe_key: None,
                };
                observed_claim(self.unsealed(self.store.claim(&request).await.map_err(failed)?))
            }
            Op::Complete => Ok(observed_write(
                self.store
                    .complete(&self.key, token, &response(owner))
                    .await
                    .map_err(failed)?,
            )),
            Op::MarkUnknown => Ok(observed_write(
                self.store
                    .mark_unknown(&self.key, token, reason(owner), None)
                    .await
                    .map_err(failed)?,
            )),
            Op::Release => Ok(observed_write(
                self.store.release(&self.key, token).await.map_err(failed)?,
            )),
            Op::ResolveApplied | Op::ResolveNotApplied => {
                let resolution = match op {
                    Op::ResolveApplied => Resolution::Applied(learned()),
                    _ => Resolution::NotApplied,
                };
                // Fenced on the claim of `owner`, as an operator names the one it checked.
                let resolved = self
                    .store
                    .resolve(&self.key, Some(token), &resolution)
                    .await
                    .map_err(failed)?;
                Ok(observed_resolution(resolved))
            }
        }
    }
}

/// The memory store, on Tokio's paused clock: on its own, or as `AnyStore` behind
/// `[store.encryption]` (docs/design.md §20), every response sealed on the way in and
/// opened on the way out, every fingerprint an HMAC, which the model must not observe.
struct Memory<S = MemoryStore>(Subject<S>);

/// The memory store's lease: short, so that a few lease expiries never reach the
/// retention.
const MEMORY_LEASE: Duration = Duration::from_secs(1);

impl<S: RecordStore> Driver for Memory<S> {
    async fn apply(&mut self, owner: u8, op: Op) -> Result<Reply, String> {
        self.0.apply(owner, op, MEMORY_LEASE).await
    }

    async fn expire_lease(&mut self) {
        tokio::time::advance(MEMORY_LEASE).await;
    }

    fn remembers(&self) -> bool {
        self.0.remember > RETENTION
    }

    /// A record's leases pass in seconds: the retention from the claim has passed
    /// once as much again has, and `remember` (three times as long) has not.
    async fn expire_response(&mut self) {
        tokio::time::advance(RETENTION).await;
    }

    async fn expire_retention(&mut self) {
        tokio::time::advance(self.0.remember).await;
    }

    async fn check(&mut self, _: Record) -> Result<(), String> {
        Ok(())
    }
}

/// The SQLite store, on its wall clock moved forward past the lease or the retention
/// (`advance_clock`): one file for a whole run, a record of its own per sequence.
struct Sqlite(Subject<SqliteStore>);

impl Driver for Sqlite {
    async fn apply(&mut self, owner: u8, op: Op) -> Result<Reply, String> {
        self.0.apply(owner, op, MEMORY_LEASE).await
    }

    async fn expire_lease(&mut self) {
        self.0.store.advance_clock(MEMORY_LEASE);
    }

    fn remembers(&self) -> bool {
        self.0.remember > RETENTION
    }

    /// As the memory store's: the leases passed are seconds against hours.
    async fn expire_response(&mut self) {
        self.0.store.advance_clock(RETENTION);
    }

    async fn expire_retention(&mut self) {
        self.0.store.advance_clock(self.0.remember);
    }

    async fn check(&mut self, _: Record) -> Result<(), String> {
        Ok(())
    }
}

/// A real `redis-server`, with a connection of the test's own for the clock and the
/// TTL checks.
struct Redis {
    subject: Subject<RedisStore>,
    control: redis::aio::MultiplexedConnection,
    /// Whether the record's lease was made to run out (its TTL then is shorter).
    aged: bool,
}

impl Driver for Redis {
    fn remembers(&self) -> bool {
        self.subject.remember > RETENTION
    }

    /// The response kept beside the record expires by itself: made to, at once.
    async fn expire_response(&mut self) {
        let _: () = redis::cmd("PEXPIREAT")
            .arg(format!("{}:r", self.subject.key.as_str()))
            .arg(1)
            .query_async(&mut self.control)
            .await
            .expect("PEXPIREAT");
    }

    async fn apply(&mut self, owner: u8, op: Op) -> Result<Reply, String> {
        self.subject.apply(owner, op, LEASE).await
    }

    /// Redis's clock cannot be moved, and the lease is read off the record's remaining
    /// TTL: the TTL is set to what is left of the retention once the lease has run out,
    /// as the passing of the lease would leave it.
    async fn expire_lease(&mut self) {
        let key = self.subject.key.as_str();
        let record: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut self.control)
            .await
            .expect("GET");
        if record.is_some_and(|record| record.starts_with(b"2F")) {
            let _: () = redis::cmd("PEXPIRE")
                .arg(key)
                .arg(millis(self.subject.remember - LEASE))
                .query_async(&mut self.control)
                .await
                .expect("PEXPIRE");
            self.aged = true;
        }
    }

    /// `remember` passes: the record is gone, and any response kept beside it (whose
    /// retention, shorter, passed before).
    async fn expire_retention(&mut self) {
        let key = self.subject.key.as_str();
        let _: () = redis::pipe()
            .cmd("PEXPIREAT")
            .arg(key)
            .arg(1)
            .ignore()
            .cmd("PEXPIREAT")
            .arg(format!("{key}:r"))
            .arg(1)
            .ignore()
            .query_async(&mut self.control)
            .await
            .expect("PEXPIREAT");
    }

    /// The record's TTL is `remember` from its claim, and its response's (kept beside
    /// it where the record outlives it) the retention from the claim: present exactly
    /// while the model's record is completed.
    async fn check(&mut self, model: Record) -> Result<(), String> {
        let key = self.subject.key.as_str();
        let (ttl, response_ttl): (i64, i64) = redis::pipe()
            .cmd("PTTL")
            .arg(key)
            .cmd("PTTL")
            .arg(format!("{key}:r"))
            .query_async(&mut self.control)
            .await
            .expect("PTTL");
        // The TTL the record should have: `remember`, or what is left of it once the
        // lease has (been made to) run out.
        let remember = millis(self.subject.remember);
        let expected = if self.aged {
            millis(self.subject.remember - LEASE)
        } else {
            remember
        };
        let record = match (model, ttl) {
            (Record::Free, -2) => {
                self.aged = false;
                Ok(())
            }
            (Record::Free, ttl) => Err(format!("the model has no record, Redis has one with PTTL {ttl}")),
            (_, ttl) if ttl > expected - 60_000 && ttl <= expected => Ok(()),
            (_, ttl) => Err(format!("PTTL {ttl} ms is not the {expected} ms remember leaves")),
        };
        record?;
        let completed = matches!(model, Record::Completed { .. } | Record::Reconciled { .. });
        match (completed && self.remembers(), response_ttl) {
            (false, -2) => Ok(()),
            (false, ttl) => Err(format!("{model:?} has a response kept beside it, PTTL {ttl}")),
            // The claim's retention: what the record's TTL has left past `keep`.
            (true, ttl) if (ttl - (expected - (remember - millis(RETENTION)))).abs() < 60_000 => Ok(()),
            (true, ttl) => Err(format!(
                "the response kept beside the record has PTTL {ttl}, not what the retention leaves"
            )),
        }
    }
}

/// A Postgres server of the test's own, with a connection of the test's own that moves
/// a record's lease and expiry into the past (the server's clock cannot be moved) and
/// reads back what the row holds.
struct Postgres {
    subject: Subject<PostgresStore>,
    control: std::sync::Arc<tokio_postgres::Client>,
}

impl Driver for Postgres {
    fn remembers(&self) -> bool {
        self.subject.remember > RETENTION
    }

    async fn expire_response(&mut self) {
        self.control
            .execute(
                "UPDATE idemproxy.records SET response_until = clock_timestamp() - interval '1 ms' WHERE key = $1",
                &[&self.subject.key.as_str()],
            )
            .await
            .expect("age the response");
    }

    async fn apply(&mut self, owner: u8, op: Op) -> Result<Reply, String> {
        self.subject.apply(owner, op, LEASE).await
    }

    async fn expire_lease(&mut self) {
        self.control
            .execute(
                "UPDATE idemproxy.records SET lease_until = clock_timestamp() - interval '1 ms' \
                 WHERE key = $1 AND state = 'in_flight'",
                &[&self.subject.key.as_str()],
            )
            .await
            .expect("age the lease");
    }

    async fn expire_retention(&mut self) {
        self.control
            .execute(
                "UPDATE idemproxy.records SET expires_at = clock_timestamp() - interval '1 ms' WHERE key = $1",
                &[&self.subject.key.as_str()],
            )
            .await
            .expect("age the record");
    }

    async fn check(&mut self, model: Record) -> Result<(), String> {
        let row = self
            .control
            .query_opt(
                "SELECT floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint, \
                 floor(extract(epoch FROM response_until - clock_timestamp()) * 1000)::bigint \
                 FROM idemproxy.records WHERE key = $1 AND expires_at > clock_timestamp()",
                &[&self.subject.key.as_str()],
            )
            .await
            .expect("read the row");
        // A record that outlives its response drops it the retention after its claim.
        let response_ttl = row.as_ref().and_then(|row| row.get::<_, Option<i64>>(1));
        let response = match (self.remembers(), model, response_ttl) {
            (false, _, None) | (true, Record::Free, _) => Ok(()),
            (false, _, Some(ttl)) => Err(format!(
                "a record that does not outlive its response drops it in {ttl} ms"
            )),
            (true, Record::Spent { .. }, Some(ttl)) if ttl < 0 => Ok(()),
            (true, Record::Spent { .. }, ttl) => Err(format!("a spent record's response drops in {ttl:?} ms")),
            (true, _, Some(ttl)) if (ttl - millis(RETENTION)).abs() < 60_000 => Ok(()),
            (true, _, ttl) => Err(format!("the response drops in {ttl:?} ms, not the retention")),
        };
        response?;
        let expected = millis(self.subject.remember);
        match (model, row.map(|row| row.get::<_, i64>(0))) {
            (Record::Free, None) => Ok(()),
            (Record::Free, Some(ttl)) => Err(format!(
                "the model has no record, Postgres has one expiring in {ttl} ms"
            )),
            (_, None) => Err("the model has a record, Postgres has none".into()),
            (_, Some(ttl)) if ttl > expected - 60_000 && ttl <= expected => Ok(()),
            (_, Some(ttl)) => Err(format!(
                "the row expires in {ttl} ms, not the {expected} ms remember leaves"
            )),
        }
    }
}

/// Runs `events` (then the observer's claim) on `driver` and on the model side by side;
/// `Err` names the first step where they part.
async fn conform(driver: &mut impl Driver, events: &[Event]) -> Result<(), String> {
    let mut model = Record::Free;
    let observe = Event::Apply {
        owner: OBSERVER,
        op: Op::Claim,
    };
    for (step, event) in events.iter().chain([&observe]).enumerate() {
        if *event == Event::ResponseExpires && !driver.remembers() {
            continue;
        }
        let before_completed = matches!(model, Record::Completed { .. } | Record::Reconciled { .. });
        let expected = model.step(*event, CORRECT);
        let actual = match *event {
            Event::Apply { owner, op } => Some(driver.apply(owner, op).await),
            Event::LeaseExpires => {
                driver.expire_lease().await;
                None
            }
            Event::ResponseExpires => {
                // Driven only on a completed record: the model changes nothing else.
                if matches!(model, Record::Spent { .. }) && before_completed {
                    driver.expire_response().await;
                }
                None
            }
            Event::RetentionExpires => {
                driver.expire_retention().await;
                None
            }
        };
        let parted = |why: String| format!("step {step} ({event:?}) of {events:?}: {why}");
        if let Some(actual) = actual {
            let actual = actual.map_err(parted)?;
            if Some(actual) != expected {
                return Err(parted(format!("the store answered {actual:?}, the model {expected:?}")));
            }
        }
        driver.check(model).await.map_err(parted)?;
    }
    Ok(())
}

// === the sequences ===

fn events() -> impl Strategy<Value = Vec<Event>> {
    let op = prop_oneof![
        7 => Just(Op::Claim),
        4 => Just(Op::Complete),
        3 => Just(Op::MarkUnknown),
        3 => Just(Op::Release),
        2 => Just(Op::ResolveApplied),
        2 => Just(Op::ResolveNotApplied),
    ];
    let event = prop_oneof![
        17 => (0..OWNERS, op).prop_map(|(owner, op)| Event::Apply { owner, op }),
        2 => Just(Event::LeaseExpires),
        2 => Just(Event::ResponseExpires),
        1 => Just(Event::RetentionExpires),
    ];
    proptest::collection::vec(event, 1..40)
}

/// What a conformance run covered, for the figures the tests print.
#[derive(Debug, Default)]
struct Coverage {
    traces: usize,
    trace_steps: usize,
    random: usize,
}

fn key(n: usize) -> StoreKey {
    let key = parse_key_value(format!("conformance-{n}").as_bytes()).expect("key");
    store_key("conformance", "payments", &[], &key)
}

/// The model's explored store traces with `proxies` proxies.
fn model_traces(proxies: usize) -> (usize, Vec<Vec<Event>>) {
    let outcome = explore(proxies, CORRECT);
    assert!(outcome.counterexample.is_none(), "the model itself is unsafe");
    (outcome.states, outcome.store_traces())
}

/// Runs every trace, then `cases` random sequences, each on a fresh store (memory) or
/// a fresh record (Redis) made by `make`; returns the first failure, if any.
fn run<D: Driver>(
    runtime: &tokio::runtime::Runtime,
    traces: &[Vec<Event>],
    cases: u32,
    mut make: impl FnMut(usize) -> D,
) -> (Coverage, Result<(), String>) {
    let mut coverage = Coverage::default();
    for (n, trace) in traces.iter().enumerate() {
        coverage.traces += 1;
        coverage.trace_steps += trace.len();
        if let Err(error) = runtime.block_on(conform(&mut make(n), trace)) {
            return (coverage, Err(format!("model trace: {error}")));
        }
    }
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    // proptest's runner takes an `Fn`: the counters and the maker go in cells.
    let n = std::cell::Cell::new(traces.len());
    let random = std::cell::Cell::new(0);
    let make = std::cell::RefCell::new(make);
    let result = runner.run(&events(), |events| {
        n.set(n.get() + 1);
        random.set(random.get() + 1);
        let mut driver = (make.borrow_mut())(n.get());
        runtime
            .block_on(conform(&mut driver, &events))
            .map_err(TestCaseError::fail)
    });
    coverage.random = random.get();
    let result = match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(why, minimal)) => Err(format!("random, shrunk to {minimal:?}: {why}")),
        Err(TestError::Abort(why)) => Err(format!("proptest aborted: {why}")),
    };
    (coverage, result)
}

fn memory_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}

fn memory_driver(runtime: &tokio::runtime::Runtime, plant: Option<Plant>, n: usize) -> Memory {
    let _entered = runtime.enter();
    let store = match plant {
        Some(plant) => MemoryStore::with_plant(1000, plant),
        None => MemoryStore::new(1000, usize::MAX),
    };
    Memory(Subject::new(store, n))
}

/// A bug planted in the Redis store: a mutated script, or one in the native claim.
enum RedisPlant<'a> {
    Script(ScriptName, &'a str),
    Claim(ClaimPlant),
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).expect("ms")
}

/// One `redis-server` for a whole run; every sequence gets a record of its own.
struct RedisRun {
    _server: RedisServer,
    runtime: tokio::runtime::Runtime,
    store: RedisStore,
    control: redis::aio::MultiplexedConnection,
}

impl RedisRun {
    fn start(plant: Option<RedisPlant<'_>>) -> RedisRun {
        let server = RedisServer::start();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let (store, control) = runtime.block_on(async {
            let store = RedisStore::standalone(&server.url(), Duration::from_secs(5)).expect("store");
            let store = match plant {
                Some(RedisPlant::Script(name, lua)) => store.with_script(name, lua),
                Some(RedisPlant::Claim(plant)) => store.with_claim_plant(plant),
                None => store,
            };
            let control = redis::Client::open(server.url())
                .expect("url")
                .get_multiplexed_async_connection()
                .await
                .expect("control connection");
            (store, control)
        });
        RedisRun {
            _server: server,
            runtime,
            store,
            control,
        }
    }

    fn run(&self, traces: &[Vec<Event>], cases: u32) -> (Coverage, Result<(), String>) {
        run(&self.runtime, traces, cases, |n| Redis {
            subject: Subject::new(self.store.clone(), n),
            control: self.control.clone(),
            aged: false,
        })
    }
}

// === the tests ===

#[test]
fn the_memory_store_conforms_to_the_model() {
    let (states_2, traces_2) = model_traces(2);
    let (states_3, traces_3) = model_traces(3);
    let runtime = memory_runtime();
    let traces: Vec<_> = traces_2.iter().chain(&traces_3).cloned().collect();
    let (coverage, result) = run(&runtime, &traces, 512, |n| memory_driver(&runtime, None, n));
    println!(
        "conformance (memory): model traces from {states_2} + {states_3} states: {} traces, {} steps; \
         {} random sequences; {result:?}",
        coverage.traces, coverage.trace_steps, coverage.random
    );
    result.expect("the memory store strays from the model");
    assert_eq!(coverage.random, 512);
}

#[test]
fn the_memory_store_with_sealed_records_conforms_to_the_model() {
    let (states, traces) = model_traces(2);
    let runtime = memory_runtime();
    let sealer = std::sync::Arc::new(idemproxy::store::Sealer::new(&idemproxy::config::Encryption {
        key_env: "K".into(),
        previous_keys_env: None,
        current: idemproxy::config::RecordKey::from_bytes([7; 32]),
        previous: Vec::new(),
        accept_clear_records: false,
    }));
    let (coverage, result) = run(&runtime, &traces, 256, |n| {
        let _entered = runtime.enter();
        let store = AnyStore::from(MemoryStore::new(1000, usize::MAX)).sealed(Some(sealer.clone()));
        let mut subject = Subject::new(store, n);
        subject.sealer = Some(sealer.clone());
        Memory(subject)
    });
    println!(
        "conformance (memory, sealed): model traces from {states} states: {} traces, {} steps; {} random sequences; \
         {result:?}",
        coverage.traces, coverage.trace_steps, coverage.random
    );
    result.expect("the sealed memory store strays from the model");
    assert_eq!(coverage.random, 256);
}

#[test]
fn the_sqlite_store_conforms_to_the_model() {
    let (states, traces) = model_traces(2);
    // On a tmpfs where there is one: the semantics are under test here, not the fsyncs.
    let shm = std::path::Path::new("/dev/shm");
    let dir = match shm.is_dir() {
        true => tempfile::tempdir_in(shm),
        false => tempfile::tempdir(),
    }
    .expect("a temporary directory");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let config = idemproxy::config::SqliteConfig {
        path: dir.path().join("records.db"),
        limits: StoreLimits::unbounded(1_000_000),
        cache_bytes: 4 << 20,
        response_budget: usize::MAX,
    };
    let store = SqliteStore::open(&config, Duration::from_secs(5)).expect("the sqlite store");
    let (coverage, result) = run(&runtime, &traces, 256, |n| Sqlite(Subject::new(store.clone(), n)));
    println!(
        "conformance (sqlite): model traces from {states} states: {} traces, {} steps; {} random sequences; \
         {result:?}",
        coverage.traces, coverage.trace_steps, coverage.random
    );
    result.expect("the SQLite store strays from the model");
    assert_eq!(coverage.random, 256);
}

#[test]
fn the_redis_store_conforms_to_the_model() {
    let (states, traces) = model_traces(2);
    let run = RedisRun::start(None);
    let (coverage, result) = run.run(&traces, 256);
    println!(
        "conformance (redis): model traces from {states} states: {} traces, {} steps; {} random sequences; \
         {result:?}",
        coverage.traces, coverage.trace_steps, coverage.random
    );
    result.expect("the Redis store strays from the model");
    assert_eq!(coverage.random, 256);
}

#[test]
fn the_postgres_store_conforms_to_the_model() {
    let (states, traces) = model_traces(2);
    let server = PostgresServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (store, control) = runtime.block_on(async {
        let config = idemproxy::config::PostgresConfig::at(&server.url()).expect("the test server's URL");
        let store = PostgresStore::open(&config, Duration::from_secs(5))
            .await
            .expect("the postgres store");
        let (control, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
            .await
            .expect("control connection");
        tokio::spawn(connection);
        (store, std::sync::Arc::new(control))
    });
    let (coverage, result) = run(&runtime, &traces, 256, |n| Postgres {
        subject: Subject::new(store.clone(), n),
        control: control.clone(),
    });
    println!(
        "conformance (postgres): model traces from {states} states: {} traces, {} steps; {} random sequences; \
         {result:?}",
        coverage.traces, coverage.trace_steps, coverage.random
    );
    result.expect("the Postgres store strays from the model");
    assert_eq!(coverage.random, 256);
}

// === negative controls ===

/// A plant as listed: a script's name and its mutated text, or a claim plant.
enum RedisPlantSpec {
    Script(ScriptName, String),
    Claim(ClaimPlant),
}

const COMPLETE_LUA: &str = include_str!("../src/store/scripts/complete.lua");
const MARK_UNKNOWN_LUA: &str = include_str!("../src/store/scripts/mark_unknown.lua");
const RELEASE_LUA: &str = include_str!("../src/store/scripts/release.lua");
const RESOLVE_LUA: &str = include_str!("../src/store/scripts/resolve.lua");

/// `lua` with `from` replaced by `to`, which must occur exactly once: a plant that no
/// longer applies to the script must fail loudly, not test the correct script.
fn plant(lua: &str, from: &str, to: &str) -> String {
    assert_eq!(
        lua.matches(from).count(),
        1,
        "the plant no longer fits the script: {from:?}"
    );
    lua.replace(from, to)
}

#[test]
fn bugs_planted_in_the_lua_scripts_are_caught() {
    let owner_check = "string.sub(record, 67, 98) ~= ARGV[1]";
    let plants: Vec<(&str, RedisPlantSpec)> = vec![
        (
            "complete without the owner check",
            RedisPlantSpec::Script(ScriptName::Complete, plant(COMPLETE_LUA, owner_check, "false")),
        ),
        (
            "complete without the lease check",
            RedisPlantSpec::Script(
                ScriptName::Complete,
                plant(
                    COMPLETE_LUA,
                    "if not rest or pttl <= tonumber(rest) then",
                    "if false then",
                ),
            ),
        ),
        (
            "mark_unknown without the owner check",
            RedisPlantSpec::Script(ScriptName::MarkUnknown, plant(MARK_UNKNOWN_LUA, owner_check, "false")),
        ),
        (
            "release without compare-and-set",
            RedisPlantSpec::Script(
                ScriptName::Release,
                plant(
                    RELEASE_LUA,
                    "if not record or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[1] then",
                    "if not record then",
                ),
            ),
        ),
        (
            "resolve without compare-and-set from unknown",
            RedisPlantSpec::Script(
                ScriptName::Resolve,
                plant(
                    RESOLVE_LUA,
                    "if not (tag == '2U' or (tag == '2F' and pttl <= tonumber(rest))) then",
                    "if false then",
                ),
            ),
        ),
        (
            "resolve that takes a live lease for unknown",
            RedisPlantSpec::Script(
                ScriptName::Resolve,
                plant(RESOLVE_LUA, "(tag == '2F' and pttl", "(tag == '2F' or pttl"),
            ),
        ),
        (
            "complete keeps the response in a record that outlives it",
            RedisPlantSpec::Script(
                ScriptName::Complete,
                plant(COMPLETE_LUA, "if keep == '' then", "if true then"),
            ),
        ),
        (
            "complete keeps the response for the record's whole life",
            RedisPlantSpec::Script(
                ScriptName::Complete,
                plant(COMPLETE_LUA, "ARGV[2], 'PX', kept)", "ARGV[2], 'PX', pttl)"),
            ),
        ),
        (
            "claim takes over an expired lease",
            RedisPlantSpec::Claim(ClaimPlant::TakesOverExpiredLeases),
        ),
        (
            "claim sets the expiry to the lease",
            RedisPlantSpec::Claim(ClaimPlant::ExpiresWithTheLease),
        ),
    ];
    let (_, traces) = model_traces(2);
    for (name, spec) in plants {
        let run = RedisRun::start(Some(match &spec {
            RedisPlantSpec::Script(script, lua) => RedisPlant::Script(*script, lua),
            RedisPlantSpec::Claim(claim) => RedisPlant::Claim(*claim),
        }));
        let (coverage, result) = run.run(&traces, 256);
        let caught = result.expect_err(&format!("a planted bug went unnoticed: {name}"));
        println!(
            "negative control (redis: {name}), caught after {} traces and {} random sequences: {caught}",
            coverage.traces, coverage.random
        );
    }
}

#[test]
fn bugs_planted_in_the_memory_store_are_caught() {
    let (_, traces) = model_traces(2);
    let runtime = memory_runtime();
    for plant in [
        Plant::OwnerCheckDropped,
        Plant::LeaseCheckDropped,
        Plant::ExpiredLeaseTakenOver,
        Plant::ResolveCheckDropped,
    ] {
        let (coverage, result) = run(&runtime, &traces, 512, |n| memory_driver(&runtime, Some(plant), n));
        let caught = result.expect_err(&format!("a planted bug went unnoticed: {plant:?}"));
        println!(
            "negative control (memory: {plant:?}), caught after {} traces and {} random sequences: {caught}",
            coverage.traces, coverage.random
        );
    }
}
