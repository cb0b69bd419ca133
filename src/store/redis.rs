//! The Redis store: one string per record (`layout`), claimed with one native
//! `SET … NX PX … GET` (and, for a record found in flight, a `GET` + `PTTL` that reads
//! its lease), and changed by one Lua script per
//! compare-and-set step (complete, mark unknown, release, the operator's release), so
//! each step is a single atomic round trip on the node that holds the record, whatever
//! the topology (`topology`: one primary, Sentinel, Cluster). The lease is read off
//! the record's remaining TTL, on Redis's clock, never this process's. Scripts are
//! loaded when a worker starts, run by EVALSHA, and loaded again when Redis has lost
//! them (restart, failover, `SCRIPT FLUSH`). Replies are decoded here, once, into the
//! store's types: a reply or record that does not decode is a store error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use redis::{RedisError, RedisResult, Script};
use tokio::time::Instant;

use self::topology::{Connection, Unready, is_connection, is_refused, is_transient, may_have_run, tls_failure};
use super::codes;
use super::{
    Background, ClaimOutcome, ClaimRequest, Deferred, Handles, OwnerToken, ProbeSchedule, ProbeStart, RecordStore,
    RecordSummary, Resolution, Resolved, Started, StoreKey, StoredResponse, UnknownReason, Write,
};
use crate::config::{RedisConfig, RedisTopology};
use crate::error::StoreError;

mod layout;
mod moving;
mod seams;
mod subscriber;
mod topology;

use self::seams::Seams;
#[cfg(feature = "test-util")]
pub use self::seams::{ClaimPause, ClaimPlant};

pub(crate) use self::subscriber::publish_command;

/// The first pause between two tries of an operation the store refused for a moment,
/// and the longest.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
const MAX_PAUSE: Duration = Duration::from_millis(100);
/// How many times a claim writes again after the in-flight record it found was gone
/// by the time its TTL was read (released or expired in between), before it gives up.
const MAX_VANISHED: u32 = 3;

static SCRIPTS: LazyLock<Arc<Scripts>> = LazyLock::new(|| {
    Arc::new(Scripts {
        complete: Script::new(include_str!("scripts/complete.lua")),
        mark_unknown: Script::new(include_str!("scripts/mark_unknown.lua")),
        release: Script::new(include_str!("scripts/release.lua")),
        resolve: Script::new(include_str!("scripts/resolve.lua")),
        begin_probe: Script::new(include_str!("scripts/begin_probe.lua")),
        defer_probe: Script::new(include_str!("scripts/defer_probe.lua")),
        import: Script::new(include_str!("scripts/import.lua")),
    })
});

/// The writes that must compare and set: three lifecycle scripts, the resolution of an
/// unknown record (an operator's, or a probe's), and the probe's lease and schedule.
/// (The claim is a native `SET … NX GET`; an operator's show is `GET`.)
/// Every store shares the ones in `scripts/`; tests may load a mutated one on the side
/// to show that the suite catches it.
#[derive(Clone)]
struct Scripts {
    complete: Script,
    mark_unknown: Script,
    release: Script,
    resolve: Script,
    begin_probe: Script,
    defer_probe: Script,
    /// A record moved from another store (`moving`).
    import: Script,
}

/// One of the lifecycle scripts, to swap in a test.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptName {
    Complete,
    MarkUnknown,
    Release,
    Resolve,
    BeginProbe,
    DeferProbe,
}

/// How many replicas must hold a claim before it counts, and how long to wait for them.
#[derive(Debug, Clone, Copy)]
struct Durability {
    acks: u32,
    timeout: Duration,
}

/// Which failures an operation is tried again after, within the store's timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Only refusals that say the command did not run (a failover, a slot moving, a
    /// load): any write may be tried again after one.
    Refused,
    /// Those, and a lost connection, after which the command may or may not have run:
    /// only for the claim, which finds its own token when it did.
    Transient,
}

/// A cheap-to-clone handle on the Redis store.
#[derive(Clone)]
pub struct RedisStore {
    /// The worker's connections to the store, taken in turn.
    connections: Arc<[Connection]>,
    next: Arc<AtomicUsize>,
    scripts: Arc<Scripts>,
    timeout: Duration,
    durability: Option<Durability>,
    topology: Arc<RedisTopology>,
    /// How the scripts tell waiters that a record changed.
    publish: &'static str,
    /// What a test planted in the claim (`test-util`); nothing otherwise.
    seams: Seams,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("topology", &format_args!("{}", self.topology))
            .field("timeout", &self.timeout)
            .field("durability", &self.durability)
            .finish()
    }
}

/// The process's Redis store: each worker makes its own handle, with its own
/// connections, and the process's one subscriber, started here, tells waiters of
/// changes (it ends when the last watcher is dropped).
pub(crate) fn open(config: &RedisConfig, timeout: Duration) -> Result<Started<RedisStore>, StoreError> {
    let watcher = subscriber::start(config, timeout)?;
    let config = config.clone();
    Ok(Started {
        handles: Handles::PerWorker(Box::new(move || RedisStore::new(&config, timeout))),
        watcher,
        background: Background::default(),
    })
}

impl RedisStore {
    /// Prepares the store described by `config`. It connects lazily, so the proxy
    /// starts while Redis is down and `/readyz` reports it; every operation is bounded
    /// by `timeout`, and a claim that waits for replicas by `timeout` plus the
    /// configured wait.
    pub fn new(config: &RedisConfig, timeout: Duration) -> Result<RedisStore, StoreError> {
        let connections = (0..config.connections.max(1))
            .map(|_| Connection::new(&config.topology, config.tls.as_ref(), timeout))
            .collect::<RedisResult<Vec<_>>>()
            .map_err(failed)?;
        Ok(RedisStore {
            connections: connections.into(),
            next: Arc::default(),
            scripts: SCRIPTS.clone(),
            timeout,
            durability: (config.min_replica_acks > 0).then_some(Durability {
                acks: config.min_replica_acks,
                timeout: config.replica_ack_timeout,
            }),
            topology: Arc::new(config.topology.clone()),
            publish: publish_command(&config.topology),
            seams: Seams::default(),
        })
    }

    /// One primary at `url`, claims not waiting for replicas.
    pub fn standalone(url: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        RedisStore::new(&RedisConfig::standalone(url), timeout)
    }

    /// Replaces one lifecycle script with `lua`, for tests that must show a broken
    /// script is caught (a plain write without compare-and-set, a dropped check).
    #[cfg(feature = "test-util")]
    pub fn with_script(mut self, name: ScriptName, lua: &str) -> RedisStore {
        let mut scripts = Scripts::clone(&self.scripts);
        let slot = match name {
            ScriptName::Complete => &mut scripts.complete,
            ScriptName::MarkUnknown => &mut scripts.mark_unknown,
            ScriptName::Release => &mut scripts.release,
            ScriptName::Resolve => &mut scripts.resolve,
            ScriptName::BeginProbe => &mut scripts.begin_probe,
            ScriptName::DeferProbe => &mut scripts.defer_probe,
        };
        *slot = Script::new(lua);
        self.scripts = Arc::new(scripts);
        self
    }

    /// Plants `plant` in the claim, for a negative control.
    #[cfg(feature = "test-util")]
    pub fn with_claim_plant(mut self, plant: ClaimPlant) -> RedisStore {
        self.seams.plant = Some(plant);
        self
    }

    /// Stops each claim that finds a record in flight at `pause`.
    #[cfg(feature = "test-util")]
    pub fn with_claim_pause(mut self, pause: ClaimPause) -> RedisStore {
        self.seams.pause = Some(pause);
        self
    }

    /// The next of the worker's connections, in turn.
    fn connection(&self) -> Connection {
        let at = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        self.connections[at].clone()
    }

    /// Loads the scripts into Redis (every primary, on a cluster), so that the first
    /// write on a connection does not pay `NOSCRIPT`, a load and a second try. Redis
    /// forgets them on a restart or `SCRIPT FLUSH`; the writes load them again then.
    pub(crate) async fn preload(&self) {
        for script in [
            &self.scripts.complete,
            &self.scripts.mark_unknown,
            &self.scripts.release,
            &self.scripts.resolve,
            &self.scripts.begin_probe,
            &self.scripts.defer_probe,
            &self.scripts.import,
        ] {
            let mut connection = self.connection();
            let loaded = tokio::time::timeout(self.timeout, script.prepare_invoke().load_async(&mut connection)).await;
            if !matches!(loaded, Ok(Ok(_))) {
                tracing::debug!("cannot load the scripts yet; the first writes will");
                return;
            }
        }
    }

    /// Runs `op` until it answers, trying again after the failures `retry` names while
    /// `budget` lasts; then the last error, or a timeout.
    async fn attempt<T, F, Fut>(&self, retry: Retry, budget: Duration, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut(Connection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let deadline = Instant::now() + budget;
        let mut pause = FIRST_PAUSE;
        // Whether an attempt that failed may have run all the same.
        let mut ran = false;
        loop {
            let error = match tokio::time::timeout_at(deadline, op(self.connection())).await {
                Err(_) => return Err(timed_out(budget)),
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(error)) => error,
            };
            let again = match retry {
                Retry::Refused => is_refused(&error),
                Retry::Transient => is_transient(&error),
            };
            if !again || Instant::now() + pause >= deadline {
                return Err(failed_after(error, ran));
            }
            ran |= may_have_run(&error);
            tracing::debug!(%error, "the store refused for a moment; trying again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    /// Runs one script, tried again while Redis refuses for a moment (never after a
    /// lost connection: a script may have run).
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        self.attempt(Retry::Refused, self.timeout, |mut connection| async move {
            invocation.invoke_async(&mut connection).await
        })
        .await
    }

    async fn fenced_write(&self, invocation: redis::ScriptInvocation<'_>) -> Result<Write, StoreError> {
        codes::write(self.invoke(&invocation).await?)
    }

    /// The claim's write: `SET key value NX PX retention GET` (one command, one round
    /// trip), and with `durability` a `WAIT` for its replicas in the same pipeline
    /// (`WAIT` counts the writes of the connection it runs on). Tried again after a
    /// lost connection: a claim that did land is found with its own token.
    async fn native_claim(
        &self,
        claim: &ClaimRequest,
        durability: Option<Durability>,
        budget: Duration,
    ) -> Result<(Option<Bytes>, Option<Option<Bytes>>, u32), StoreError> {
        let remember = self.seams.expiry(claim);
        let rest = remember.saturating_sub(claim.lease);
        let keep = claim.remember.saturating_sub(claim.retention);
        let value = layout::in_flight(claim.fingerprint, claim.owner, rest, keep);
        let mut pipeline = redis::pipe();
        pipeline
            .cmd("SET")
            .arg(claim.key.as_str())
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(millis(remember))
            .arg("GET");
        // A record that outlives its response keeps it beside it: read in the same
        // round trip, so that a replay still takes one.
        let beside = !keep.is_zero();
        if beside {
            pipeline.cmd("GET").arg(layout::response_key(claim.key.as_str()));
        }
        let mut budget = budget;
        if let Some(durability) = durability {
            pipeline
                .cmd("WAIT")
                .arg(durability.acks)
                .arg(millis(durability.timeout));
            budget += durability.timeout;
        }
        let reply: Vec<redis::Value> = self
            .attempt(Retry::Transient, budget, |mut connection| {
                let pipeline = &pipeline;
                async move { pipeline.query_async(&mut connection).await }
            })
            .await?;
        let bad = || StoreError::Protocol("a claim reply of the wrong shape");
        let mut reply = reply.into_iter();
        let string = |reply: Option<redis::Value>| match reply.ok_or_else(bad)? {
            redis::Value::Nil => Ok(None),
            redis::Value::BulkString(value) => Ok(Some(Bytes::from(value))),
            _ => Err(bad()),
        };
        let found = string(reply.next())?;
        let response = match beside {
            true => Some(string(reply.next())?),
            false => None,
        };
        let acks = match reply.next() {
            None => 0,
            Some(redis::Value::Int(acks)) => u32::try_from(acks).unwrap_or(0),
            Some(_) => return Err(bad()),
        };
        Ok((found, response, acks))
    }

    /// What `<key>:r` holds: the response of a record kept beside it, until its
    /// retention ends. Read-only, so tried again after a lost connection too.
    async fn read_response(&self, key: &StoreKey, budget: Duration) -> Result<Option<Bytes>, StoreError> {
        let response: Option<Vec<u8>> = self
            .attempt(Retry::Transient, budget, |mut connection| async move {
                redis::cmd("GET")
                    .arg(layout::response_key(key.as_str()))
                    .query_async(&mut connection)
                    .await
            })
            .await?;
        Ok(response.map(Bytes::from))
    }

    /// A record, its remaining TTL and the response kept beside it (if any), read
    /// together, for an operator.
    async fn read_whole(&self, key: &StoreKey) -> Result<(Option<Bytes>, i64, Option<Bytes>), StoreError> {
        let (found, pttl, response): (Option<Vec<u8>>, i64, Option<Vec<u8>>) = self
            .attempt(Retry::Transient, self.timeout, |mut connection| async move {
                redis::pipe()
                    .cmd("GET")
                    .arg(key.as_str())
                    .cmd("PTTL")
                    .arg(key.as_str())
                    .cmd("GET")
                    .arg(layout::response_key(key.as_str()))
                    .query_async(&mut connection)
                    .await
            })
            .await?;
        Ok((found.map(Bytes::from), pttl, response.map(Bytes::from)))
    }

    /// A record and its remaining TTL, read together (`GET` and `PTTL` in one
    /// pipeline, which Redis runs back to back). Read-only, so tried again after a
    /// lost connection too.
    async fn read_with_ttl(&self, key: &StoreKey, budget: Duration) -> Result<(Option<Bytes>, i64), StoreError> {
        let (found, pttl): (Option<Vec<u8>>, i64) = self
            .attempt(Retry::Transient, budget, |mut connection| async move {
                redis::pipe()
                    .cmd("GET")
                    .arg(key.as_str())
                    .cmd("PTTL")
                    .arg(key.as_str())
                    .query_async(&mut connection)
                    .await
            })
            .await?;
        Ok((found.map(Bytes::from), pttl))
    }
}

/// No answer within `after`: a command sent may have run.
fn timed_out(after: Duration) -> StoreError {
    StoreError::Timeout {
        after,
        may_have_written: true,
    }
}

/// The store error for a Redis error that ends an operation, by its cause: a failed
/// TLS handshake or login (only the configuration fixes it); an error reply (a
/// refusal Redis gave before running the command writes nothing: a replica, no memory
/// left, a cluster that is down, no permission; a script's own error may follow a
/// write); or a connection that could not be made or was lost.
pub(super) fn failed(error: RedisError) -> StoreError {
    failed_after(error, false)
}

/// `failed`, for the last of several attempts: when an earlier one may have run
/// (`ran`), so may the operation, whatever the last one says.
fn failed_after(error: RedisError, ran: bool) -> StoreError {
    let may_have_written = ran || may_have_run(&error);
    let handshake = tls_failure(&error).is_some() || error.kind() == redis::ErrorKind::AuthenticationFailed;
    if handshake && !may_have_written {
        StoreError::Handshake(Box::new(error))
    } else if handshake || is_connection(&error) {
        StoreError::Unreachable {
            source: Box::new(error),
            may_have_written,
        }
    } else {
        StoreError::Refused {
            source: Box::new(error),
            may_have_written,
        }
    }
}

impl RecordStore for RedisStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        // One deadline over all the claim's round trips (the wait for replicas comes on
        // top); a timeout names the whole budget, not what was left of it.
        let deadline = Instant::now() + self.timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let budget = self.timeout + self.durability.map_or(Duration::ZERO, |durability| durability.timeout);
        let timed_out = |error| match error {
            StoreError::Timeout { .. } => timed_out(budget),
            error => error,
        };
        let mut vanished = 0;
        let (found, pttl, response, acks) = loop {
            let (found, response, acks) = self
                .native_claim(claim, self.durability, left())
                .await
                .map_err(timed_out)?;
            match found {
                // Only an in-flight record's reading needs the store's clock (its lease
                // is read off the TTL): a second round trip for it alone, so that a
                // fresh key and a replay take one command.
                Some(value) if layout::lease_depends_on_ttl(&value) => {
                    self.seams.before_lease_read().await;
                    match self.read_with_ttl(&claim.key, left()).await.map_err(timed_out)? {
                        // Read again: what `<key>:r` held then is not this value's.
                        (Some(value), pttl) => break (Some(value), Some(pttl), None, acks),
                        // Released or expired in between: the key is free to claim again.
                        (None, _) if vanished < MAX_VANISHED => vanished += 1,
                        (None, _) => return Err(StoreError::Protocol("the record kept vanishing under the claim")),
                    }
                }
                found => break (found, None, response, acks),
            }
        };
        // A record kept beside its response, found by a claim that did not read the
        // response with it (the route's `remember` changed, or the record was read
        // again): read it now.
        let response = match (&found, response) {
            (Some(value), None) if layout::kept_beside(value) => {
                self.read_response(&claim.key, left()).await.map_err(timed_out)?
            }
            (_, response) => response.flatten(),
        };
        let outcome = layout::claim_outcome(found, pttl, response, claim.owner)?;
        let outcome = self.seams.after_claim(self, claim, outcome).await?;
        // Only a claim this request wrote needs its replicas; another's record was
        // acknowledged (or not) when it was written.
        if let Some(durability) = self.durability
            && outcome == ClaimOutcome::Acquired(())
            && acks < durability.acks
        {
            return Err(StoreError::NotReplicated {
                acks,
                wanted: durability.acks,
            });
        }
        Ok(outcome)
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        let mut invocation = self.scripts.complete.key(key.as_str());
        invocation
            .arg(owner.to_hex())
            .arg(layout::completed_tail(response))
            .arg(self.publish);
        self.fenced_write(invocation).await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
        schedule: Option<ProbeSchedule>,
    ) -> Result<Write, StoreError> {
        let mut invocation = self.scripts.mark_unknown.key(key.as_str());
        invocation.arg(owner.to_hex()).arg(reason.as_str()).arg(self.publish);
        if let Some(schedule) = schedule {
            invocation
                .arg(millis(schedule.first_after))
                .arg(millis(schedule.give_up_after));
        }
        self.fenced_write(invocation).await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let mut invocation = self.scripts.release.key(key.as_str());
        invocation.arg(owner.to_hex()).arg(self.publish);
        self.fenced_write(invocation).await
    }

    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let removed: i64 = self
            .attempt(Retry::Refused, self.timeout, |mut connection| async move {
                let channel = super::notify::channel(key.as_str());
                redis::pipe()
                    .cmd("DEL")
                    .arg(key.as_str())
                    .cmd("DEL")
                    .arg(layout::response_key(key.as_str()))
                    .ignore()
                    .cmd(self.publish)
                    .arg(channel)
                    .arg("purged")
                    .ignore()
                    .query_async::<(i64,)>(&mut connection)
                    .await
                    .map(|(removed,)| removed)
            })
            .await?;
        Ok(removed == 1)
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<RecordSummary>, StoreError> {
        let (found, pttl, response) = self.read_whole(key).await?;
        layout::summary(found, pttl, response)
    }

    async fn response(&self, key: &StoreKey) -> Result<Option<StoredResponse>, StoreError> {
        let (found, pttl, response) = self.read_whole(key).await?;
        layout::response(found, pttl, response)
    }

    async fn resolve(
        &self,
        key: &StoreKey,
        owner: Option<OwnerToken>,
        resolution: &Resolution,
    ) -> Result<Resolved, StoreError> {
        let mut invocation = self.scripts.resolve.key(key.as_str());
        invocation.arg(self.publish);
        invocation.arg(owner.map(OwnerToken::to_hex).unwrap_or_default());
        if let Resolution::Applied(response) = resolution {
            invocation.arg(layout::completed_tail(response));
        }
        codes::resolved(self.invoke(&invocation).await?)
    }

    async fn begin_probe(
        &self,
        key: &StoreKey,
        schedule: ProbeSchedule,
        lease: Duration,
    ) -> Result<ProbeStart, StoreError> {
        let mut invocation = self.scripts.begin_probe.key(key.as_str());
        invocation.arg(millis(lease)).arg(millis(schedule.give_up_after));
        let (code, owner, wait): (i64, String, i64) = self.invoke(&invocation).await?;
        codes::probe_start(code, || OwnerToken::from_hex(owner.as_bytes()), wait)
    }

    async fn defer_probe(&self, key: &StoreKey, owner: OwnerToken, every: Duration) -> Result<Deferred, StoreError> {
        let mut invocation = self.scripts.defer_probe.key(key.as_str());
        invocation.arg(owner.to_hex()).arg(millis(every));
        codes::deferred(self.invoke(&invocation).await?)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection();
        match tokio::time::timeout(self.timeout, connection.readiness()).await {
            Err(_) => Err(timed_out(self.timeout)),
            Ok(Ok(())) => Ok(()),
            Ok(Err(Unready::Redis(error))) => Err(failed(error)),
            Ok(Err(Unready::Topology(why))) => Err(StoreError::Unready(why)),
        }
    }

    async fn warm_up(&self) {
        self.preload().await;
    }

    fn shared_by_instances(&self) -> bool {
        true
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use redis::{ErrorKind, RedisError, ServerErrorKind};

    use super::*;

    fn server(kind: ServerErrorKind) -> RedisError {
        RedisError::from((ErrorKind::Server(kind), "refused"))
    }

    fn io(kind: std::io::ErrorKind) -> RedisError {
        RedisError::from(std::io::Error::from(kind))
    }

    /// Each Redis failure by its cause, and whether what was sent may have run: a
    /// refusal Redis gives before running anything wrote nothing; a script's error, or
    /// a connection lost once the command was sent, may have.
    #[test]
    fn a_redis_failure_is_classified_by_its_cause() {
        let named = |error: StoreError| (error.kind(), error.may_have_written());
        for kind in [
            ServerErrorKind::ReadOnly,
            ServerErrorKind::ClusterDown,
            ServerErrorKind::BusyLoading,
            ServerErrorKind::TryAgain,
            ServerErrorKind::MasterDown,
            ServerErrorKind::Moved,
            ServerErrorKind::NoScript,
            ServerErrorKind::NoPerm,
        ] {
            assert_eq!(named(failed(server(kind))), ("refused", false), "{kind:?}");
        }
        assert_eq!(
            named(failed(server(ServerErrorKind::ResponseError))),
            ("refused", true),
            "a script's error may follow its writes"
        );
        assert_eq!(
            named(failed(io(std::io::ErrorKind::ConnectionRefused))),
            ("unreachable", false)
        );
        assert_eq!(
            named(failed(io(std::io::ErrorKind::ConnectionReset))),
            ("unreachable", true)
        );
        assert_eq!(
            named(failed(RedisError::from((
                ErrorKind::AuthenticationFailed,
                "wrong password"
            )))),
            ("handshake", false)
        );
        // The last of several attempts: an earlier one lost with its connection may
        // have run, whatever the last says.
        assert_eq!(
            named(failed_after(server(ServerErrorKind::ReadOnly), true)),
            ("refused", true)
        );
        assert_eq!(
            named(failed_after(io(std::io::ErrorKind::ConnectionRefused), true)),
            ("unreachable", true)
        );
    }
}
