//! The Redis store: one hash per record, and one Lua script per lifecycle step, so
//! each step is a single atomic round trip. Deadlines come from Redis `TIME`, never
//! from this process's clock. Scripts run by EVALSHA and fall back to EVAL when
//! Redis has lost them (restart, `SCRIPT FLUSH`). Replies are decoded here, once, into
//! the store's types: a reply or record that does not decode is a store error.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};

use super::{
    ClaimOutcome, ClaimRequest, Existing, Fingerprint, OwnerToken, RecordState, RecordStore, StoreKey, StoredResponse,
    UnknownReason, Write,
};
use crate::error::StoreError;
use crate::record::FORMAT_VERSION;

static SCRIPTS: LazyLock<Arc<Scripts>> = LazyLock::new(|| {
    Arc::new(Scripts {
        claim: Script::new(include_str!("scripts/claim.lua")),
        complete: Script::new(include_str!("scripts/complete.lua")),
        mark_unknown: Script::new(include_str!("scripts/mark_unknown.lua")),
        release: Script::new(include_str!("scripts/release.lua")),
    })
});

/// The four lifecycle scripts. Every store shares the ones in `scripts/`; tests may
/// load a mutated one on the side to show that the suite catches it.
#[derive(Clone)]
struct Scripts {
    claim: Script,
    complete: Script,
    mark_unknown: Script,
    release: Script,
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

/// A cheap-to-clone handle on one multiplexed, self-reconnecting Redis connection.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    scripts: Arc<Scripts>,
    timeout: Duration,
    url: Arc<str>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &crate::config::redact_url(&self.url))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RedisStore {
    /// Prepares a connection to `url`. It connects lazily, so the proxy starts while
    /// Redis is down and `/readyz` reports it; every operation is bounded by `timeout`.
    pub fn new(url: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(StoreError::Unavailable)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            // Each call is bounded by `timeout` below instead: a response timeout inside
            // the driver would not tell us more, and must not tear the connection down
            // while a release is queued behind a slow claim.
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let connection = ConnectionManager::new_lazy_with_config(client, config).map_err(StoreError::Unavailable)?;
        Ok(RedisStore {
            connection,
            scripts: SCRIPTS.clone(),
            timeout,
            url: url.into(),
        })
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

    async fn bounded<T>(&self, call: impl Future<Output = Result<T, RedisError>>) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(StoreError::Unavailable(error)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    async fn fenced_write(&self, invocation: redis::ScriptInvocation<'_>) -> Result<Write, StoreError> {
        let mut connection = self.connection.clone();
        let applied: i64 = self.bounded(invocation.invoke_async(&mut connection)).await?;
        Ok(if applied == 1 { Write::Applied } else { Write::Fenced })
    }
}

impl RecordStore for RedisStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut connection = self.connection.clone();
        let mut invocation = self.scripts.claim.key(claim.key.as_str());
        invocation
            .arg(claim.owner.to_hex())
            .arg(claim.fingerprint.to_hex())
            .arg(millis(claim.retention))
            .arg(millis(claim.lease))
            .arg(FORMAT_VERSION);
        let reply: Vec<Bytes> = self.bounded(invocation.invoke_async(&mut connection)).await?;
        parse_claim_reply(reply)
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
            .arg(response.body.as_ref());
        self.fenced_write(invocation).await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<Write, StoreError> {
        let mut invocation = self.scripts.mark_unknown.key(key.as_str());
        invocation.arg(owner.to_hex()).arg(reason.as_str());
        self.fenced_write(invocation).await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let mut invocation = self.scripts.release.key(key.as_str());
        invocation.arg(owner.to_hex());
        self.fenced_write(invocation).await
    }

    #[cfg(feature = "test-util")]
    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let mut connection = self.connection.clone();
        let removed: i64 = self
            .bounded(redis::cmd("DEL").arg(key.as_str()).query_async(&mut connection))
            .await?;
        Ok(removed == 1)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let _: String = self.bounded(redis::cmd("PING").query_async(&mut connection)).await?;
        Ok(())
    }
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
