//! The record store: claim, complete, mark unknown and release, and the resolution and
//! probe lease of an unknown record, each one atomic operation on one record under one
//! store key. Four backends implement `RecordStore` with the same semantics, and one
//! test suite runs against each: `memory` and `sqlite` decide in Rust, through the pure
//! transitions of `lifecycle`; `redis` in Lua scripts and `postgres` in SQL functions,
//! whose numeric answers `codes` decodes for both. What a backend can do besides the
//! lifecycle (usage, commit figures, unsettled records, warm-up) is a default method it
//! overrides. `AnyStore` is what callers hold: it dispatches to the backend and seals
//! and opens records (`sealed`). `open` picks the backend the config names, so that
//! nothing outside this module names one; `notify` tells waiters that a record changed;
//! `moving` carries records from one store to another (`store copy`, `[store.previous]`).
//! The store knows nothing of HTTP routing or of how store keys are derived.

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Backend, StoreConfig};
use crate::error::StoreError;
pub use crate::record::StoredResponse;

mod codes;
mod lifecycle;
pub mod memory;
pub mod moving;
pub(crate) mod notify;
pub mod postgres;
pub mod redis;
pub mod sealed;
pub mod sqlite;

pub use self::memory::MemoryStore;
use self::notify::Watcher;
pub use self::postgres::PostgresStore;
pub use self::redis::RedisStore;
pub use self::sealed::Sealer;
pub use self::sqlite::SqliteStore;
pub use crate::config::StoreLimits;

/// Makes a store handle. Each worker thread calls it once, inside its own runtime, so
/// every worker has its own Redis connection; the memory store is one shared map, and
/// the SQLite store one shared file (its writer, and read connections taken in turn).
pub type StoreFactory = Arc<dyn Fn() -> Result<AnyStore, StoreError> + Send + Sync>;

/// What `open` hands the server: the factory each worker makes its handle with (sealed
/// with the process's one sealer), where waiters learn that records changed, and the
/// store's background work, which the server stops once its workers have stopped.
pub(crate) struct Opened {
    pub factory: StoreFactory,
    pub watcher: Watcher,
    pub background: Background,
}

/// Opens the store `config` names, through its backend's `open`, and makes the one
/// factory every backend's handles come from. Must be called inside a Tokio runtime,
/// which runs the memory store's sweeper, the Redis subscriber, or Postgres's listener
/// and sweeper. Postgres is connected to here, and its schema made ready (or checked),
/// before anything is served.
pub(crate) async fn open(config: &StoreConfig) -> Result<Opened, StoreError> {
    // One sealer for the process: its counter of unreadable records is one.
    let sealer = sealed::sealer(config.encryption.as_ref());
    let timeout = config.timeout;
    Ok(match &config.backend {
        Backend::Memory(limits) => memory::open(*limits).opened(sealer),
        Backend::Sqlite(sqlite) => self::sqlite::open(sqlite, timeout)?.opened(sealer),
        Backend::Redis(redis) => self::redis::open(redis, timeout)?.opened(sealer),
        Backend::Postgres(postgres) => self::postgres::open(postgres, timeout).await?.opened(sealer),
    })
}

/// The store `config` names, as one handle, for a tool that reads or writes records
/// itself (`store copy`, tests): its background work (a sweeper) does not run.
pub async fn open_for_tools(config: &StoreConfig) -> Result<AnyStore, StoreError> {
    let opened = open(config).await?;
    (opened.factory)()
}

/// A handle on a `[store.previous]`, made in the worker that reads it: it connects on
/// its first lookup (the previous store may be down at start or at a reload), and
/// nothing of it is written but by `carried`'s reads.
pub(crate) fn previous(previous: &crate::config::Previous) -> Result<AnyStore, StoreError> {
    match &previous.backend {
        Backend::Redis(redis) => Ok(RedisStore::new(redis, previous.timeout)?.into()),
        Backend::Postgres(postgres) => Ok(PostgresStore::lazy(postgres, previous.timeout)?.into()),
        Backend::Memory(_) | Backend::Sqlite(_) => Err(StoreError::Unready(NOT_SHARED)),
    }
}

/// How a backend hands out handles: one shared by every worker (the memory map, the
/// SQLite file's writer and readers), or one made for each worker (its own Redis
/// connection, its own Postgres pool).
pub(crate) enum Handles<S> {
    Shared(S),
    PerWorker(Box<dyn Fn() -> Result<S, StoreError> + Send + Sync>),
}

/// A backend as its `open` makes it: its handles, where waiters learn that records
/// changed, and the tasks it runs for the whole process.
pub(crate) struct Started<S> {
    pub handles: Handles<S>,
    pub watcher: Watcher,
    pub background: Background,
}

impl<S: Into<AnyStore> + 'static> Started<S> {
    fn opened(self, sealer: Option<Arc<Sealer>>) -> Opened {
        let factory: StoreFactory = match self.handles {
            Handles::Shared(store) => {
                let shared = store.into().sealed(sealer);
                Arc::new(move || Ok(shared.clone()))
            }
            Handles::PerWorker(make) => Arc::new(move || Ok(make()?.into().sealed(sealer.clone()))),
        };
        Opened {
            factory,
            watcher: self.watcher,
            background: self.background,
        }
    }
}

/// The tasks a store runs for the whole process that no handle's drop ends (Postgres's
/// sweeper): each runs until `stop`, which the server calls once its workers have
/// stopped, until this is dropped (a start that failed), or until its runtime ends.
#[derive(Debug, Default)]
pub(crate) struct Background {
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl Background {
    /// Runs `task` on the current runtime until it ends or `stop` is called.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            stop.run_until_cancelled(task).await;
        });
    }

    /// Stops every task and returns once each has ended.
    pub(crate) async fn stop(self) {
        let tasks = self.tasks.clone();
        drop(self);
        tasks.close();
        tasks.wait().await;
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A record that is unknown for a claim that is not yet on record: an unknown record
/// the probe can find at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsettled {
    pub key: StoreKey,
    /// The key as the upstream was sent it, where the route's probe path names it.
    pub probe_key: Option<String>,
    /// How long until its probe is due: the rest of its lease, or of its schedule.
    pub due_in: Duration,
}

/// What a store's own commits cost, for `/metrics`: kept by a store that commits
/// writes itself (SQLite's writer thread), and counted there.
#[derive(Debug, Clone)]
pub struct CommitFigures {
    pub commits: Counter,
    /// Writes committed (several per commit under load).
    pub writes: Counter,
    /// How long each `COMMIT` took: the write-ahead log's fsync, mostly.
    pub commit_seconds: Histogram,
    /// Expired records the sweeper deleted.
    pub swept: Counter,
    /// Responses the sweeper dropped at the end of their retention, their records kept.
    pub dropped: Counter,
}

impl Default for CommitFigures {
    fn default() -> CommitFigures {
        CommitFigures {
            commits: Counter::default(),
            writes: Counter::default(),
            commit_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            swept: Counter::default(),
            dropped: Counter::default(),
        }
    }
}

/// What an embedded store holds and its bounds, as `/metrics` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreUsage {
    pub backend: &'static str,
    /// Records held, expired ones until the sweep.
    pub records: usize,
    /// Memory: what the records hold (bodies, header names and values, keys, and a
    /// fixed estimate of each record's bookkeeping). SQLite: the file's pages in use.
    pub bytes: usize,
    pub max_records: usize,
    pub max_bytes: usize,
    /// Of `records`, those past their retention whose response was dropped: kept
    /// until `remember` ends (docs/design.md §24).
    pub spent: usize,
}

/// The key that client and scope numbers (`idempotency::scope_id`, `client_id`) are
/// made with: random for the process, or the SQLite store's own, kept in its file so
/// that a scope's records count against the same share after a restart. Only this
/// process and the file know it, so no client can aim at another's number.
pub(crate) mod identity {
    use std::sync::OnceLock;

    static KEY: OnceLock<[u8; 16]> = OnceLock::new();

    /// The process's key: the store file's, once one is open; else a random one.
    pub(crate) fn key() -> &'static [u8; 16] {
        // Without a random source no claim can be made (see `OwnerToken::generate`):
        // the zero key then only spreads shares less evenly.
        KEY.get_or_init(|| random_key().unwrap_or_default())
    }

    pub(crate) fn random_key() -> Option<[u8; 16]> {
        use ring::rand::SecureRandom;
        let mut key = [0u8; 16];
        ring::rand::SystemRandom::new().fill(&mut key).ok()?;
        Some(key)
    }

    /// Makes the key of the store at `place` (a file, a Postgres schema) the
    /// process's. A process opens one store; a second (tests do) keeps the first's
    /// key, and that store's earlier records are then counted against shares of their own.
    pub(crate) fn adopt(file_key: [u8; 16], place: &dyn std::fmt::Display) {
        if KEY.set(file_key).is_err() && KEY.get() != Some(&file_key) {
            tracing::warn!(
                store = %place,
                "client numbers keep another store file's key: this file's earlier records count against shares of their own"
            );
        }
    }
}

/// The name of one record in the store. Only `idempotency::store_key` makes these,
/// so writer and reader always agree on it. Shared, not copied: a request's claim, the
/// memory store's map and its queues of expiries each hold the one string.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoreKey(Arc<str>);

impl StoreKey {
    pub(crate) fn from_derived(key: String) -> StoreKey {
        StoreKey(Arc::from(key))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The route the record belongs to: the middle of `prefix:route:{hash}` (neither
    /// a prefix nor a route name may hold a `:`).
    pub fn route(&self) -> Option<&str> {
        let mut parts = self.0.split(':');
        let (_prefix, route, hash) = (parts.next()?, parts.next()?, parts.next()?);
        (parts.next().is_none() && hash.starts_with('{')).then_some(route)
    }

    /// The first 12 hex digits of the record hash: how a record is named in logs. It
    /// identifies the record (route, scope and key) and reveals none of them.
    pub fn short_hash(&self) -> &str {
        let hash = self.0.rsplit(':').next().unwrap_or_default();
        let hash = hash.trim_start_matches('{');
        hash.get(..12).unwrap_or(hash)
    }
}

impl StoreKey {
    /// The record's operation id: 32 hex digits, the first 128 bits of SHA-256 over
    /// the whole store key (prefix, route, and the record hash of scope and client
    /// key). Unique per route, scope and client key, and revealing none of them: what a
    /// 409 `outcome-unknown` names, the records API shows, and `upstream_key =
    /// "derived"` sends the upstream.
    pub fn operation_id(&self) -> String {
        let digest = ring::digest::digest(&ring::digest::SHA256, self.0.as_bytes());
        const_hex::encode(&digest.as_ref()[..16])
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
    /// A fresh token from this thread's ChaCha12 generator (rand's `StdRng`), seeded
    /// from the operating system's random source the first time the thread draws one.
    /// Without that seed no claim may be made, since two requests could then share a
    /// token. Each token was a `getrandom` system call of its own: 1.3 % of the
    /// proxy's CPU on the guarded path (docs/performance.md).
    pub fn generate() -> Result<OwnerToken, ring::error::Unspecified> {
        use rand::{RngCore, SeedableRng, rngs::StdRng};
        thread_local! {
            static SOURCE: RefCell<Option<StdRng>> = const { RefCell::new(None) };
        }
        SOURCE.with_borrow_mut(|source| {
            let source = match source {
                Some(seeded) => seeded,
                None => source.insert(StdRng::try_from_os_rng().map_err(|_| ring::error::Unspecified)?),
            };
            let mut bytes = [0u8; 16];
            source.fill_bytes(&mut bytes);
            Ok(OwnerToken(bytes))
        })
    }

    pub fn to_hex(self) -> String {
        const_hex::encode(self.0)
    }

    pub fn from_hex(text: &[u8]) -> Option<OwnerToken> {
        const_hex::decode_to_array(text).ok().map(OwnerToken)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<OwnerToken> {
        <[u8; 16]>::try_from(bytes).ok().map(OwnerToken)
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({})", const_hex::encode(&self.0[..4]))
    }
}

/// SHA-256 over everything that makes two requests "the same request".
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn to_hex(self) -> String {
        const_hex::encode(self.0)
    }

    pub fn from_hex(text: &[u8]) -> Option<Fingerprint> {
        const_hex::decode_to_array(text).ok().map(Fingerprint)
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Fingerprint> {
        <[u8; 32]>::try_from(bytes).ok().map(Fingerprint)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", const_hex::encode(&self.0[..6]))
    }
}

/// Why a record became unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownReason {
    UpstreamTimeout,
    UpstreamFailed,
    ResponseTooLarge,
    /// The byte budget could not hold the response while it was read for recording.
    OverBudget,
    /// A streamed response broke mid-body (the upstream reset it, or did not end it
    /// within its timeout): its first client got part of it.
    StreamBroken,
    /// The claim's lease ran out with its owner gone (a proxy crashed or lost the
    /// store mid-request): written when a probe takes the record over.
    LeaseExpired,
    /// The recorded response cannot be opened: sealed under a key no longer
    /// configured, or altered. Never written: what a claim reads such a record as.
    Unreadable,
    /// In flight when it was moved from another store (`store copy`, a
    /// `[store.previous]` lookup): its forwarder may still have been running.
    MovedInFlight,
}

impl UnknownReason {
    pub fn as_str(self) -> &'static str {
        match self {
            UnknownReason::UpstreamTimeout => "upstream-timeout",
            UnknownReason::UpstreamFailed => "upstream-failed",
            UnknownReason::ResponseTooLarge => "response-too-large",
            UnknownReason::OverBudget => "over-budget",
            UnknownReason::StreamBroken => "stream-broken",
            UnknownReason::LeaseExpired => "lease-expired",
            UnknownReason::Unreadable => "unreadable",
            UnknownReason::MovedInFlight => "moved-in-flight",
        }
    }

    pub fn parse(text: &[u8]) -> Option<UnknownReason> {
        match text {
            b"upstream-timeout" => Some(UnknownReason::UpstreamTimeout),
            b"upstream-failed" => Some(UnknownReason::UpstreamFailed),
            b"response-too-large" => Some(UnknownReason::ResponseTooLarge),
            b"over-budget" => Some(UnknownReason::OverBudget),
            b"stream-broken" => Some(UnknownReason::StreamBroken),
            b"lease-expired" => Some(UnknownReason::LeaseExpired),
            b"unreadable" => Some(UnknownReason::Unreadable),
            b"moved-in-flight" => Some(UnknownReason::MovedInFlight),
            _ => None,
        }
    }
}

/// Which client of which route a record belongs to, as a number only this process
/// knows (see `idempotency::scope_id`): what the memory store bounds per client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScopeId(pub u64);

/// Which client address a record was made from, as a number only this process knows
/// (see `idempotency::client_id`): what the memory store bounds per client, across the
/// scopes it sends (a scope made of a header is a value the client picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId(pub u64);

/// What a claim asks for.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub key: StoreKey,
    /// The client the record is counted against; `None` on a route without scope.
    pub scope: Option<ScopeId>,
    /// The address it came from; `None` where no client is counted (an operator, a test).
    pub client: Option<ClientId>,
    pub owner: OwnerToken,
    pub fingerprint: Fingerprint,
    /// The response recorded for it is kept exactly this long from the claim: its
    /// replays stop then, and the store drops it on its own clock.
    pub retention: Duration,
    /// The whole record lives exactly this long from the claim (at least
    /// `retention`): past `retention` it is spent, and keeps only what the guard needs
    /// (docs/design.md §24).
    pub remember: Duration,
    /// The owner's lease: after it the record reads as unknown.
    pub lease: Duration,
    /// The most the response recorded for this claim may hold (the route's
    /// `max_response_body_bytes`): the SQLite store keeps room for it in its file while
    /// the claim is in flight, so that a response forwarded is never left unrecorded for
    /// want of room. The other stores take no notice.
    pub response_limit: usize,
    /// The key as the upstream is sent it, where the route's probe path names it
    /// (`{key}` with `upstream_key = "client"`): kept by the SQLite store until the
    /// record completes, so that a probe can run after a restart with no retry. The
    /// other stores keep nothing of it.
    pub probe_key: Option<String>,
}

/// What a claim found. `C` is what the claimant holds once the key is its own: nothing
/// at the store, the owned claim in the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome<C = ()> {
    /// The record is now in flight and owned by the claimant.
    Acquired(C),
    /// Another request owns or owned the key.
    Existing(Existing),
}

/// A record that another request claimed: the fingerprint of that request, and where
/// its record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Existing {
    pub fingerprint: Fingerprint,
    pub state: RecordState,
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
    /// Completed, and past its retention: the response is gone, the key is known.
    Spent(Spent),
    Unknown {
        reason: UnknownReason,
        probe: Probe,
    },
}

/// What a completed record keeps past its retention, until `remember` ends: the
/// status its operation completed with, and when (on the clock of the store, or of
/// the proxy, that recorded it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spent {
    pub status: http::StatusCode,
    /// `None` for a record written before completion times were kept.
    pub completed_at: Option<SystemTime>,
}

impl Spent {
    /// What a store keeps of a spent record: its status, and when it completed in
    /// milliseconds since the Unix epoch. `None` for a status that is not one.
    pub(crate) fn kept(status: i64, completed_ms: Option<i64>) -> Option<Spent> {
        let status = http::StatusCode::from_u16(u16::try_from(status).ok()?).ok()?;
        Some(Spent {
            status,
            completed_at: completed_ms.and_then(crate::record::from_epoch_millis),
        })
    }
}

/// When an unknown record's reconciliation probe runs (docs/design.md §14), as its record keeps
/// it: counted on the store's clock from the moment the record becomes unknown, so that
/// every instance reads the same schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeSchedule {
    /// Until the first probe.
    pub first_after: Duration,
    /// Until the probe gives up; no probe begins after it.
    pub give_up_after: Duration,
}

/// Where the reconciliation of an unknown record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// None was scheduled: the record became unknown on a route without a probe (or
    /// before this version kept one), or its claim's lease ran out.
    Unscheduled,
    /// The next probe may begin in this long: a probe is running under its lease, or
    /// the next one is scheduled. Zero: it is due, and whoever finds it takes it over.
    Next(Duration),
    /// The probe gave up: the record waits for an operator.
    GaveUp,
}

/// What `begin_probe` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeStart {
    /// The probe lease is the caller's: probe, then resolve fenced on this claim (or
    /// `defer_probe`).
    Leased(OwnerToken),
    /// Not due for this long: another instance holds the lease, or the next probe is
    /// scheduled later.
    NotDue(Duration),
    /// The probe has given up (now, if its time ran out while nobody probed).
    GaveUp,
    /// Nothing to probe: the record is completed, in flight with its lease running,
    /// gone, or unknown without a claim to fence on (written before claims were kept).
    Settled,
}

/// What `defer_probe` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deferred {
    /// The next probe is due `every` from now.
    Scheduled,
    /// The next probe would begin past `give_up_after`: the probe has given up.
    GaveUp,
    /// The record is no longer unknown for this claim (resolved by someone else).
    Settled,
}

/// What a record holds, as an operator sees it: never its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordSummary {
    pub fingerprint: Fingerprint,
    /// How long until the whole record expires.
    pub ttl: Duration,
    pub state: SummaryState,
    /// The owner of the claim whose outcome is unknown, for a resolution to be fenced on
    /// (what the records API calls its `claim`): set on an unknown record, and on one in
    /// flight past its lease. `None` on other states, and on an unknown record written
    /// before owners were kept.
    pub owner: Option<OwnerToken>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SummaryState {
    InFlight {
        lease_remaining: Duration,
    },
    /// In flight, its lease run out: clients get `outcome-unknown`.
    LeaseExpired,
    Completed {
        status: u16,
        response_bytes: u64,
        /// The trace id of the request that executed it, hex, when tracing was on.
        trace_id: Option<String>,
    },
    /// Completed, past its retention: its response is gone.
    Spent(Spent),
    Unknown {
        reason: UnknownReason,
        probe: Probe,
    },
}

/// What was learned of an operation whose outcome was unknown: by an operator who
/// checked with the upstream, or by the route's probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// It took effect: this response becomes the record's, and retries replay it.
    Applied(StoredResponse),
    /// It did not: the record is removed, and the next retry runs.
    NotApplied,
}

/// What a resolution did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// The record was unknown (or its lease had run out) and is resolved.
    Resolved,
    /// The record is completed, or in flight with its lease running: left as it is.
    NotUnknown,
    /// The record is unknown, but for another claim than the one named: what was
    /// learned is about an operation that is no longer this record's. Left as it is.
    OtherClaim,
    Absent,
}

/// Whether a compare-and-set write changed the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    Applied,
    /// The record no longer belongs to this owner, or is no longer in flight.
    Fenced,
}

/// The record lifecycle of docs/design.md §4. Every write is a compare-and-set on the owner
/// token and the `in_flight` state, and no write moves the record's expiry.
pub trait RecordStore: Send + Sync + 'static {
    /// Creates an `in_flight` record if none exists, else returns the existing one.
    /// Finding one's own in-flight claim counts as acquired.
    fn claim(&self, claim: &ClaimRequest) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// `in_flight` -> `completed`, while the lease holds.
    fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<Write, StoreError>> + Send;

    /// `in_flight` -> `unknown`, with the route's probe scheduled when it has one.
    fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
        schedule: Option<ProbeSchedule>,
    ) -> impl Future<Output = Result<Write, StoreError>> + Send;

    /// Removes an `in_flight` record whose request was never forwarded.
    fn release(&self, key: &StoreKey, owner: OwnerToken) -> impl Future<Output = Result<Write, StoreError>> + Send;

    /// Removes a record whatever its state: an operator's tool, never on the request
    /// path. `false` when there was none.
    fn purge(&self, key: &StoreKey) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// What the record holds, without its body: an operator's view.
    fn inspect(&self, key: &StoreKey) -> impl Future<Output = Result<Option<RecordSummary>, StoreError>> + Send;

    /// The response a completed record holds, body and all: an operator's tool, never
    /// on the request path. `None` when the record is absent or not completed.
    fn response(&self, key: &StoreKey) -> impl Future<Output = Result<Option<StoredResponse>, StoreError>> + Send;

    /// `unknown` -> `completed` with the resolution's response, or -> gone: only if
    /// the record reads as unknown (marked so, or in flight with its lease run out),
    /// and, when `owner` names one, for that claim (`None`: whichever claim is unknown
    /// now, as for a call that names none). A compare-and-set in one step, so that two
    /// resolutions (a probe's and an operator's) never both win, no resolution
    /// replaces a recorded response or a live claim, and a named one never lands on a
    /// later claim of the same key whose outcome is unknown in turn.
    fn resolve(
        &self,
        key: &StoreKey,
        owner: Option<OwnerToken>,
        resolution: &Resolution,
    ) -> impl Future<Output = Result<Resolved, StoreError>> + Send;

    /// Takes the record's probe lease for `lease`, if a probe is due: a record marked
    /// unknown whose next probe is due (or that none was scheduled for, which
    /// `schedule` then schedules), or one in flight past its lease, which becomes
    /// unknown for `lease-expired`. A compare-and-set in one step, so that two
    /// instances never probe one record at once; a lease that ends unrenewed (its
    /// instance died) leaves the probe due for whoever finds it next. Past its
    /// `give_up_after`, the probe has given up.
    fn begin_probe(
        &self,
        key: &StoreKey,
        schedule: ProbeSchedule,
        lease: Duration,
    ) -> impl Future<Output = Result<ProbeStart, StoreError>> + Send;

    /// The probe learned nothing: ends its lease and makes the next probe due `every`
    /// from now, unless that would be past `give_up_after` (then it has given up).
    /// Only while the record is unknown for the claim `owner` made.
    fn defer_probe(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        every: Duration,
    ) -> impl Future<Output = Result<Deferred, StoreError>> + Send;

    /// Answers when the store is reachable.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    // === What a backend can do besides the lifecycle: declared, each with its default ===

    /// Gets a new handle ready for its first request (Redis loads its scripts, so that
    /// the first write does not pay `NOSCRIPT`, a load and a second try).
    fn warm_up(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Whether several proxy instances may share this store (Redis, Postgres), or it
    /// is one process's own (memory, SQLite).
    fn shared_by_instances(&self) -> bool {
        false
    }

    /// What the store holds and its bounds, where it keeps them itself (the embedded
    /// stores; Redis and Postgres report their own).
    fn usage(&self) -> Option<StoreUsage> {
        None
    }

    /// What the store's own commits cost, where it commits writes itself.
    fn commit_figures(&self) -> Option<&CommitFigures> {
        None
    }

    /// The records whose probe a fresh start must schedule: only a store that owns
    /// all of its records (SQLite) knows that nobody else will find them.
    fn unsettled(&self) -> Result<Vec<Unsettled>, StoreError> {
        Ok(Vec::new())
    }
}

/// The one match on the backend: every call to `AnyStore` is passed on by it.
macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match &$self.engine {
            Engine::Memory($store) => $call,
            Engine::Sqlite($store) => $call,
            Engine::Redis($store) => $call,
            Engine::Postgres($store) => $call,
        }
    };
}
/// `delegate!` for the store's calls, awaited: each engine's own future is boxed but
/// the memory store's, so that the store's future is the size of the memory store's (a
/// few hundred bytes), not of the largest engine's (2.7 KB), which every future that
/// awaits a store call would otherwise carry and move.
macro_rules! delegate_boxed {
    ($self:ident, $store:ident => $call:expr) => {
        match &$self.engine {
            Engine::Memory($store) => $call.await,
            Engine::Sqlite($store) => Box::pin($call).await,
            Engine::Redis($store) => Box::pin($call).await,
            Engine::Postgres($store) => Box::pin($call).await,
        }
    };
}

/// Why a memory store has no records to move.
const NOT_MOVED: &str = "a memory store lives in its process: it has no records to copy to or from";

/// Why an embedded store is not looked up as a previous store.
const NOT_SHARED: &str = "only a shared store (redis, postgres) is read as a previous store";

/// The configured store: one of the four backends, and the keys its records are
/// sealed with, if any (`sealed`). Every response it is given is sealed before the
/// backend sees it, every one it returns opened, and every fingerprint kept as an HMAC.
#[derive(Clone)]
pub struct AnyStore {
    engine: Engine,
    sealer: Option<Arc<Sealer>>,
}

/// Runs a read of a store's file in tokio's blocking pool, off the runtime that
/// called (docs/design.md §27): a busy file holds that thread, never a worker.
pub(crate) async fn blocking<R: Send + 'static>(read: impl FnOnce() -> R + Send + 'static) -> Result<R, StoreError> {
    tokio::task::spawn_blocking(read)
        .await
        .map_err(|_| StoreError::Unready("a read of the store's file did not finish"))
}

impl AnyStore {
    /// What an embedded store holds, read off the runtime.
    pub async fn usage_off_runtime(&self) -> Option<StoreUsage> {
        let store = self.clone();
        blocking(move || store.usage()).await.ok().flatten()
    }

    /// The records a fresh start must probe, read off the runtime.
    pub async fn unsettled_off_runtime(&self) -> Result<Vec<Unsettled>, StoreError> {
        let store = self.clone();
        blocking(move || store.unsettled()).await?
    }
}

/// One of the four backends.
#[derive(Clone)]
pub enum Engine {
    Memory(MemoryStore),
    Sqlite(SqliteStore),
    Redis(RedisStore),
    Postgres(PostgresStore),
}

impl From<PostgresStore> for AnyStore {
    fn from(store: PostgresStore) -> AnyStore {
        AnyStore::new(Engine::Postgres(store))
    }
}

impl From<MemoryStore> for AnyStore {
    fn from(store: MemoryStore) -> AnyStore {
        AnyStore::new(Engine::Memory(store))
    }
}

impl From<SqliteStore> for AnyStore {
    fn from(store: SqliteStore) -> AnyStore {
        AnyStore::new(Engine::Sqlite(store))
    }
}

impl From<RedisStore> for AnyStore {
    fn from(store: RedisStore) -> AnyStore {
        AnyStore::new(Engine::Redis(store))
    }
}

impl AnyStore {
    pub fn new(engine: Engine) -> AnyStore {
        AnyStore { engine, sealer: None }
    }

    /// This store with its records sealed by `sealer` (`None`: kept in clear).
    pub fn sealed(mut self, sealer: Option<Arc<Sealer>>) -> AnyStore {
        self.sealer = sealer;
        self
    }

    /// The backend, for what only one of them does (and for tests).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn sealer(&self) -> Option<&Sealer> {
        self.sealer.as_deref()
    }

    /// The response a completed record holds, opened, and the id of the key that
    /// sealed it: for an operator who asks. `Ok(None)` when the record is absent or
    /// not completed.
    pub async fn opened_response(&self, key: &StoreKey) -> Result<Option<sealed::Opened>, StoreError> {
        let stored = delegate!(self, store => store.response(key).await)?;
        Ok(stored.map(|stored| sealed::Opened {
            sealed_by: sealed::sealed_by(&stored),
            response: sealed::open(self.sealer(), key, stored),
        }))
    }

    /// Up to about `limit` records from `cursor`, as they move to another store
    /// (`moving`), and where the next page starts; `prefix` is `store.key_prefix`. The
    /// memory store lives in its process, and has nothing to move.
    pub async fn export(
        &self,
        prefix: &str,
        cursor: &moving::Cursor,
        limit: usize,
    ) -> Result<(Vec<moving::Carried>, moving::Cursor), StoreError> {
        match &self.engine {
            Engine::Memory(_) => Err(StoreError::Unready(NOT_MOVED)),
            Engine::Sqlite(store) => {
                let (store, cursor) = (store.clone(), cursor.clone());
                blocking(move || store.export(&cursor, limit)).await?
            }
            Engine::Redis(store) => store.export(prefix, cursor, limit).await,
            Engine::Postgres(store) => store.export(cursor, limit).await,
        }
    }

    /// About how many records it holds, for a copy's progress (Redis: at most).
    pub async fn count(&self) -> Result<u64, StoreError> {
        match &self.engine {
            Engine::Memory(_) => Err(StoreError::Unready(NOT_MOVED)),
            Engine::Sqlite(store) => {
                let store = store.clone();
                Ok(blocking(move || store.usage()).await??.records as u64)
            }
            Engine::Redis(store) => store.count().await,
            Engine::Postgres(store) => store.count().await,
        }
    }

    /// Writes moved records where their keys hold none (`moving`).
    pub async fn import(&self, records: Vec<moving::Carried>) -> Result<moving::Imported, StoreError> {
        match &self.engine {
            Engine::Memory(_) => Err(StoreError::Unready(NOT_MOVED)),
            Engine::Sqlite(store) => store.import(records).await,
            Engine::Redis(store) => store.import(&records, None).await,
            Engine::Postgres(store) => store.import(&records, None).await,
        }
    }

    /// The record under `key` as it would move: what a `[store.previous]` lookup
    /// reads. Only the shared stores are looked up so.
    pub(crate) async fn carried(&self, key: &StoreKey) -> Result<Option<moving::Carried>, StoreError> {
        match &self.engine {
            Engine::Redis(store) => store.carried(key).await,
            Engine::Postgres(store) => store.carried(key).await,
            Engine::Memory(_) | Engine::Sqlite(_) => Err(StoreError::Unready(NOT_SHARED)),
        }
    }

    /// Writes `record` over the in-flight claim `owner` made on its key (or where the
    /// key holds none): a `[store.previous]` lookup keeps what it found. `false` when
    /// the key holds another record.
    pub(crate) async fn take_over(&self, record: moving::Carried, owner: OwnerToken) -> Result<bool, StoreError> {
        let records = std::slice::from_ref(&record);
        let imported = match &self.engine {
            Engine::Redis(store) => store.import(records, Some(owner)).await?,
            Engine::Postgres(store) => store.import(records, Some(owner)).await?,
            Engine::Memory(_) | Engine::Sqlite(_) => return Err(StoreError::Unready(NOT_SHARED)),
        };
        Ok(imported.written == 1)
    }

    fn seal(&self, key: &StoreKey, response: &StoredResponse) -> Result<Option<StoredResponse>, StoreError> {
        self.sealer().map(|sealer| sealer.seal(key, response)).transpose()
    }
}

impl RecordStore for AnyStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let (outcome, sent) = match self.sealer() {
            None => (delegate_boxed!(self, store => store.claim(claim))?, claim.fingerprint),
            Some(sealer) => {
                let sealed = sealed::sealed_claim(sealer, claim)?;
                (
                    delegate_boxed!(self, store => store.claim(&sealed))?,
                    sealed.fingerprint,
                )
            }
        };
        Ok(sealed::opened(
            self.sealer(),
            &claim.key,
            claim.fingerprint,
            sent,
            outcome,
        ))
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        match self.seal(key, response)? {
            None => delegate_boxed!(self, store => store.complete(key, owner, response)),
            Some(sealed) => delegate_boxed!(self, store => store.complete(key, owner, &sealed)),
        }
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
        schedule: Option<ProbeSchedule>,
    ) -> Result<Write, StoreError> {
        delegate_boxed!(self, store => store.mark_unknown(key, owner, reason, schedule))
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        delegate_boxed!(self, store => store.release(key, owner))
    }

    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        delegate_boxed!(self, store => store.purge(key))
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<RecordSummary>, StoreError> {
        delegate_boxed!(self, store => store.inspect(key))
    }

    async fn response(&self, key: &StoreKey) -> Result<Option<StoredResponse>, StoreError> {
        match self.opened_response(key).await?.map(|opened| opened.response) {
            None => Ok(None),
            Some(Ok(response)) => Ok(Some(response)),
            Some(Err(_)) => Err(StoreError::Protocol("the recorded response cannot be opened")),
        }
    }

    async fn resolve(
        &self,
        key: &StoreKey,
        owner: Option<OwnerToken>,
        resolution: &Resolution,
    ) -> Result<Resolved, StoreError> {
        match self.sealer() {
            None => delegate_boxed!(self, store => store.resolve(key, owner, resolution)),
            Some(sealer) => {
                let sealed = sealed::sealed_resolution(sealer, key, resolution)?;
                delegate_boxed!(self, store => store.resolve(key, owner, &sealed))
            }
        }
    }

    async fn begin_probe(
        &self,
        key: &StoreKey,
        schedule: ProbeSchedule,
        lease: Duration,
    ) -> Result<ProbeStart, StoreError> {
        delegate_boxed!(self, store => store.begin_probe(key, schedule, lease))
    }

    async fn defer_probe(&self, key: &StoreKey, owner: OwnerToken, every: Duration) -> Result<Deferred, StoreError> {
        delegate_boxed!(self, store => store.defer_probe(key, owner, every))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        delegate_boxed!(self, store => store.ping())
    }

    async fn warm_up(&self) {
        delegate_boxed!(self, store => store.warm_up());
    }

    fn shared_by_instances(&self) -> bool {
        delegate!(self, store => store.shared_by_instances())
    }

    fn usage(&self) -> Option<StoreUsage> {
        delegate!(self, store => RecordStore::usage(store))
    }

    fn commit_figures(&self) -> Option<&CommitFigures> {
        delegate!(self, store => RecordStore::commit_figures(store))
    }

    /// A probe key sealed with the records is opened; one that does not open is left
    /// out (its record then waits for a retry or an operator).
    fn unsettled(&self) -> Result<Vec<Unsettled>, StoreError> {
        let mut unsettled = delegate!(self, store => RecordStore::unsettled(store))?;
        if let Some(sealer) = self.sealer() {
            for record in &mut unsettled {
                record.probe_key = match record.probe_key.take() {
                    Some(kept) => sealer.open_text(&record.key, &kept),
                    None => None,
                };
            }
        }
        Ok(unsettled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_hex_round_trip() {
        let fingerprint = Fingerprint([0xab; 32]);
        assert_eq!(
            Fingerprint::from_hex(fingerprint.to_hex().as_bytes()),
            Some(fingerprint)
        );
        assert_eq!(Fingerprint::from_hex(b"zz"), None);
        assert_eq!(Fingerprint::from_hex(&fingerprint.to_hex().as_bytes()[2..]), None);
    }

    #[test]
    fn owner_tokens_differ() {
        assert_ne!(OwnerToken::generate(), OwnerToken::generate());
        assert!(OwnerToken::generate().is_ok());
    }

    /// Each thread seeds its own generator from the operating system: tokens drawn on
    /// several threads at once (a worker each) never repeat one another's.
    #[test]
    fn owner_tokens_from_many_threads_never_repeat() {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..5_000)
                        .map(|_| *OwnerToken::generate().expect("a token").as_bytes())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        for thread in threads {
            for token in thread.join().expect("drawn") {
                assert!(seen.insert(token), "a token repeated");
            }
        }
        assert_eq!(seen.len(), 20_000);
    }

    /// A guarded request's claim and completion futures are carried and moved by
    /// every guarded request's future: each engine's own future is boxed where it is
    /// large (Redis, Postgres, SQLite), so that the store's future is the size of the
    /// memory store's, not of the largest engine's (2.6 and 2.7 KB before;
    /// docs/performance.md, "Futures moved per request").
    #[tokio::test]
    async fn the_stores_claim_and_complete_futures_are_small() {
        let store = AnyStore::from(MemoryStore::new(16, 1 << 20));
        let claim = ClaimRequest {
            key: StoreKey::from_derived("idemproxy:r:{00}".into()),
            scope: None,
            client: None,
            owner: OwnerToken::generate().expect("owner"),
            fingerprint: Fingerprint([0; 32]),
            retention: Duration::from_secs(1),
            remember: Duration::from_secs(1),
            lease: Duration::from_secs(1),
            response_limit: 0,
            probe_key: None,
        };
        let response = StoredResponse {
            status: http::StatusCode::OK,
            headers: Vec::new(),
            body: bytes::Bytes::new(),
            trace: None,
            replay_until: None,
        };
        let sizes = [
            std::mem::size_of_val(&store.claim(&claim)),
            std::mem::size_of_val(&store.complete(&claim.key, claim.owner, &response)),
        ];
        assert!(
            sizes.iter().all(|&size| size <= 512),
            "claim and complete futures of {sizes:?} bytes"
        );
    }

    #[test]
    fn a_store_key_is_logged_by_its_record_hash_only() {
        let key = StoreKey::from_derived(format!("idemproxy:payments:{{{}}}", "ab".repeat(32)));
        assert_eq!(key.short_hash(), "abababababab");
    }
}
