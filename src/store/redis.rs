//! The Redis store: one hash per record, and one Lua script per lifecycle step, so
//! each step is a single atomic round trip on the node that holds the record, whatever
//! the topology (`topology`: one primary, Sentinel, Cluster). Deadlines come from
//! Redis `TIME`, never from this process's clock. Scripts run by EVALSHA and fall back
//! to loading them when Redis has lost them (restart, failover, `SCRIPT FLUSH`).
//! Replies are decoded here, once, into the store's types: a reply or record that does
//! not decode is a store error.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use redis::{ErrorKind, RedisError, RedisResult, Script, ServerErrorKind};
use tokio::time::Instant;

use self::topology::{Connection, Unready, is_transient};
use super::{
    ClaimOutcome, ClaimRequest, Existing, Fingerprint, Forget, OwnerToken, RecordState, RecordStore, RecordSummary,
    StoreKey, StoredResponse, SummaryState, UnknownReason, Write,
};
use crate::config::{RedisConfig, RedisTopology};
use crate::error::StoreError;
use crate::record::FORMAT_VERSION;

mod subscriber;
mod topology;

pub(crate) use self::subscriber::{publish_command, start as start_subscriber};

/// The first pause between two tries of an operation the store refused for a moment,
/// and the longest.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
const MAX_PAUSE: Duration = Duration::from_millis(100);

static SCRIPTS: LazyLock<Arc<Scripts>> = LazyLock::new(|| {
    Arc::new(Scripts {
        claim: Script::new(include_str!("scripts/claim.lua")),
        complete: Script::new(include_str!("scripts/complete.lua")),
        mark_unknown: Script::new(include_str!("scripts/mark_unknown.lua")),
        release: Script::new(include_str!("scripts/release.lua")),
        inspect: Script::new(include_str!("scripts/inspect.lua")),
        forget: Script::new(include_str!("scripts/forget.lua")),
    })
});

/// The four lifecycle scripts and the operator's two. Every store shares the ones in
/// `scripts/`; tests may load a mutated one on the side to show that the suite catches
/// it.
#[derive(Clone)]
struct Scripts {
    claim: Script,
    complete: Script,
    mark_unknown: Script,
    release: Script,
    inspect: Script,
    forget: Script,
}

/// One of the lifecycle scripts, to swap in a test.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptName {
    Claim,
    Complete,
    MarkUnknown,
    Release,
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
    connection: Connection,
    scripts: Arc<Scripts>,
    timeout: Duration,
    durability: Option<Durability>,
    topology: Arc<RedisTopology>,
    /// How the scripts tell waiters that a record changed.
    publish: &'static str,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let topology = match &*self.topology {
            RedisTopology::Standalone { url } => crate::config::redact_url(url),
            RedisTopology::Sentinel { master_name, .. } => format!("sentinel master {master_name:?}"),
            RedisTopology::Cluster { .. } => "cluster".into(),
        };
        f.debug_struct("RedisStore")
            .field("topology", &topology)
            .field("timeout", &self.timeout)
            .field("durability", &self.durability)
            .finish()
    }
}

impl RedisStore {
    /// Prepares the store described by `config`. It connects lazily, so the proxy
    /// starts while Redis is down and `/readyz` reports it; every operation is bounded
    /// by `timeout`, and a claim that waits for replicas by `timeout` plus the
    /// configured wait.
    pub fn new(config: &RedisConfig, timeout: Duration) -> Result<RedisStore, StoreError> {
        let connection = Connection::new(&config.topology, config.tls.as_ref(), timeout).map_err(unavailable)?;
        Ok(RedisStore {
            connection,
            scripts: SCRIPTS.clone(),
            timeout,
            durability: (config.min_replica_acks > 0).then_some(Durability {
                acks: config.min_replica_acks,
                timeout: config.replica_ack_timeout,
            }),
            topology: Arc::new(config.topology.clone()),
            publish: publish_command(&config.topology),
        })
    }

    /// One primary at `url`, claims not waiting for replicas.
    pub fn standalone(url: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        let config = RedisConfig {
            topology: RedisTopology::Standalone { url: url.to_string() },
            min_replica_acks: 0,
            replica_ack_timeout: crate::config::DEFAULT_REPLICA_ACK_TIMEOUT,
            tls: None,
        };
        RedisStore::new(&config, timeout)
    }

    /// Replaces one lifecycle script with `lua`, for tests that must show a broken
    /// script is caught (a plain write without compare-and-set, a dropped check).
    #[cfg(feature = "test-util")]
    pub fn with_script(mut self, name: ScriptName, lua: &str) -> RedisStore {
        let mut scripts = Scripts::clone(&self.scripts);
        let slot = match name {
            ScriptName::Claim => &mut scripts.claim,
            ScriptName::Complete => &mut scripts.complete,
            ScriptName::MarkUnknown => &mut scripts.mark_unknown,
            ScriptName::Release => &mut scripts.release,
        };
        *slot = Script::new(lua);
        self.scripts = Arc::new(scripts);
        self
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
        loop {
            let error = match tokio::time::timeout_at(deadline, op(self.connection.clone())).await {
                Err(_) => return Err(StoreError::Timeout(budget)),
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(error)) => error,
            };
            let again = match retry {
                Retry::Refused => is_refused(&error),
                Retry::Transient => is_transient(&error),
            };
            if !again || Instant::now() + pause >= deadline {
                return Err(unavailable(error));
            }
            tracing::debug!(%error, "the store refused for a moment; trying again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    async fn fenced_write(&self, invocation: redis::ScriptInvocation<'_>) -> Result<Write, StoreError> {
        let applied: i64 = self
            .attempt(Retry::Refused, self.timeout, |mut connection| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut connection).await }
            })
            .await?;
        Ok(if applied == 1 { Write::Applied } else { Write::Fenced })
    }

    /// The claim and a `WAIT` for `durability.acks` replicas, in one pipeline on one
    /// connection: `WAIT` counts the writes of the connection it runs on, so on a
    /// connection made after the claim's it would count nothing and answer at once.
    async fn claim_durably(
        &self,
        claim: &ClaimRequest,
        durability: Durability,
    ) -> Result<(Vec<Bytes>, u32), StoreError> {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg(self.scripts.claim.get_hash())
            .arg(1)
            .arg(claim.key.as_str());
        for arg in claim_args(claim) {
            evalsha.arg(arg);
        }
        let mut pipeline = redis::pipe();
        pipeline
            .add_command(evalsha)
            .cmd("WAIT")
            .arg(durability.acks)
            .arg(u64::try_from(durability.timeout.as_millis()).unwrap_or(u64::MAX));
        let budget = self.timeout + durability.timeout;
        let (reply, acks): (Vec<Bytes>, i64) = self
            .attempt(Retry::Transient, budget, |mut connection| {
                let (pipeline, script) = (&pipeline, &self.scripts.claim);
                async move {
                    match pipeline.query_async(&mut connection).await {
                        Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                            script.load_async(&mut connection).await?;
                            pipeline.query_async(&mut connection).await
                        }
                        result => result,
                    }
                }
            })
            .await?;
        Ok((reply, u32::try_from(acks).unwrap_or(0)))
    }
}

/// The claim script's arguments after its key.
fn claim_args(claim: &ClaimRequest) -> [String; 5] {
    [
        claim.owner.to_hex(),
        claim.fingerprint.to_hex(),
        millis(claim.retention).to_string(),
        millis(claim.lease).to_string(),
        FORMAT_VERSION.to_string(),
    ]
}

/// Whether the store said it did not run the command, and a moment later may.
/// The store error for a Redis error that ends an operation: a TLS failure is told
/// apart, because nothing reached Redis and only the configuration can fix it.
fn unavailable(error: RedisError) -> StoreError {
    if topology::tls_failure(&error).is_some() {
        StoreError::Tls(error)
    } else {
        StoreError::Unavailable(error)
    }
}

fn is_refused(error: &RedisError) -> bool {
    if topology::tls_failure(error).is_some() {
        return false;
    }
    matches!(
        error.kind(),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::MasterDown
        ) | ErrorKind::MasterNameNotFoundBySentinel
    ) || error.code() == Some("NOREPLICAS")
        || error.is_connection_refusal()
}

impl RecordStore for RedisStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let Some(durability) = self.durability else {
            let mut invocation = self.scripts.claim.key(claim.key.as_str());
            for arg in claim_args(claim) {
                invocation.arg(arg);
            }
            let reply: Vec<Bytes> = self
                .attempt(Retry::Transient, self.timeout, |mut connection| {
                    let invocation = &invocation;
                    async move { invocation.invoke_async(&mut connection).await }
                })
                .await?;
            return parse_claim_reply(reply);
        };
        let (reply, acks) = self.claim_durably(claim, durability).await?;
        let outcome = parse_claim_reply(reply)?;
        // Only a claim this request wrote needs its replicas; another's record was
        // acknowledged (or not) when it was written.
        if outcome == ClaimOutcome::Acquired(()) && acks < durability.acks {
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
            .arg(response.status.as_u16())
            .arg(response.encode_headers())
            .arg(response.body.as_ref())
            .arg(self.publish);
        self.fenced_write(invocation).await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<Write, StoreError> {
        let mut invocation = self.scripts.mark_unknown.key(key.as_str());
        invocation.arg(owner.to_hex()).arg(reason.as_str()).arg(self.publish);
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
        let invocation = self.scripts.inspect.key(key.as_str());
        let reply: Vec<Bytes> = self
            .attempt(Retry::Refused, self.timeout, |mut connection| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut connection).await }
            })
            .await?;
        parse_inspect_reply(&reply)
    }

    async fn forget_unknown(&self, key: &StoreKey) -> Result<Forget, StoreError> {
        let mut invocation = self.scripts.forget.key(key.as_str());
        invocation.arg(self.publish);
        let result: i64 = self
            .attempt(Retry::Refused, self.timeout, |mut connection| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut connection).await }
            })
            .await?;
        Ok(match result {
            1 => Forget::Released,
            0 => Forget::NotUnknown,
            _ => Forget::Absent,
        })
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        match tokio::time::timeout(self.timeout, connection.readiness()).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(Ok(())) => Ok(()),
            Ok(Err(Unready::Redis(error))) => Err(unavailable(error)),
            Ok(Err(Unready::Topology(why))) => Err(StoreError::Unready(why)),
        }
    }
}

/// The reply of `inspect.lua`: empty when there is no record, else eight fields.
fn parse_inspect_reply(reply: &[Bytes]) -> Result<Option<RecordSummary>, StoreError> {
    let [state, _version, fingerprint, lease, status, reason, ttl, body] = reply else {
        return if reply.is_empty() {
            Ok(None)
        } else {
            Err(StoreError::Protocol("inspect reply of the wrong length"))
        };
    };
    let number = |field: &Bytes| -> Result<i64, StoreError> {
        std::str::from_utf8(field)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or(StoreError::Protocol("inspect reply with a malformed number"))
    };
    let millis = |value: i64| Duration::from_millis(u64::try_from(value).unwrap_or(0));
    let fingerprint =
        Fingerprint::from_hex(fingerprint).ok_or(StoreError::Protocol("record with a malformed fingerprint"))?;
    let state = match state.as_ref() {
        b"in_flight" => match number(lease)? {
            remaining if remaining > 0 => SummaryState::InFlight {
                lease_remaining: millis(remaining),
            },
            _ => SummaryState::LeaseExpired,
        },
        b"completed" => SummaryState::Completed {
            status: u16::try_from(number(status)?)
                .map_err(|_| StoreError::Protocol("record with a malformed status"))?,
            response_bytes: u64::try_from(number(body)?).unwrap_or(0),
        },
        b"unknown" => SummaryState::Unknown(
            UnknownReason::parse(reason).ok_or(StoreError::Protocol("record with an unknown reason"))?,
        ),
        _ => return Err(StoreError::Protocol("record in an unknown state")),
    };
    Ok(Some(RecordSummary {
        fingerprint,
        ttl: millis(number(ttl)?),
        state,
    }))
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Decodes the reply shapes documented in `scripts/claim.lua`.
fn parse_claim_reply(reply: Vec<Bytes>) -> Result<ClaimOutcome, StoreError> {
    let mut fields = reply.into_iter();
    let kind = fields.next().ok_or(StoreError::Protocol("an empty claim reply"))?;
    if kind.as_ref() == b"acquired" {
        return Ok(ClaimOutcome::Acquired(()));
    }
    let version = fields
        .next()
        .ok_or(StoreError::Protocol("a claim reply without a version"))?;
    if version.as_ref() != FORMAT_VERSION.as_bytes() {
        return Err(StoreError::Protocol(
            "a record in a format this idemproxy does not understand",
        ));
    }
    let fingerprint = fields
        .next()
        .and_then(|fingerprint| Fingerprint::from_hex(&fingerprint))
        .ok_or(StoreError::Protocol("a record with a malformed fingerprint"))?;
    let rest: Vec<Bytes> = fields.collect();
    let state = match (kind.as_ref(), rest.as_slice()) {
        (b"in_flight", [remaining]) => std::str::from_utf8(remaining)
            .ok()
            .and_then(|remaining| remaining.parse().ok())
            .map(|remaining| RecordState::InFlight {
                lease_remaining: Duration::from_millis(remaining),
            }),
        (b"lease_expired", []) => Some(RecordState::LeaseExpired),
        (b"completed", [status, headers, body]) => {
            StoredResponse::decode(status, headers, body.clone()).map(RecordState::Completed)
        }
        (b"unknown", [reason]) => UnknownReason::parse(reason).map(RecordState::Unknown),
        _ => None,
    };
    let state = state.ok_or(StoreError::Protocol("a record that does not decode"))?;
    Ok(ClaimOutcome::Existing(Existing { fingerprint, state }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(fields: &[&str]) -> Vec<Bytes> {
        fields
            .iter()
            .map(|field| Bytes::copy_from_slice(field.as_bytes()))
            .collect()
    }

    #[test]
    fn claim_replies_decode() {
        let fp = Fingerprint([7; 32]).to_hex();
        assert_eq!(
            parse_claim_reply(reply(&["acquired"])).ok(),
            Some(ClaimOutcome::Acquired(()))
        );
        assert_eq!(
            parse_claim_reply(reply(&["in_flight", "1", &fp, "1500"])).ok(),
            Some(ClaimOutcome::Existing(Existing {
                fingerprint: Fingerprint([7; 32]),
                state: RecordState::InFlight {
                    lease_remaining: Duration::from_millis(1500)
                }
            }))
        );
        assert_eq!(
            parse_claim_reply(reply(&["unknown", "1", &fp, "upstream-timeout"])).ok(),
            Some(ClaimOutcome::Existing(Existing {
                fingerprint: Fingerprint([7; 32]),
                state: RecordState::Unknown(UnknownReason::UpstreamTimeout),
            }))
        );
    }

    #[test]
    fn malformed_or_foreign_replies_are_store_errors() {
        let fp = Fingerprint([7; 32]).to_hex();
        for bad in [
            reply(&[]),
            reply(&["in_flight", "1", &fp]),
            reply(&["bogus", "1", &fp]),
            reply(&["in_flight", "2", &fp, "1500"]),
            reply(&["in_flight", "", &fp, "1500"]),
            reply(&["completed", "1", &fp, "1000", "", ""]),
            reply(&["completed", "1", &fp, "abc", "", ""]),
            reply(&["unknown", "1", &fp, "because"]),
            reply(&["lease_expired", "1", "not-hex"]),
        ] {
            assert!(
                matches!(parse_claim_reply(bad.clone()), Err(StoreError::Protocol(_))),
                "{bad:?}"
            );
        }
    }
}
