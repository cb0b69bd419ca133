//! The Redis store: one hash per record, and one Lua script per lifecycle step, so
//! each step is a single atomic round trip. Deadlines come from Redis `TIME`, never
//! from this process's clock. Scripts run by EVALSHA and fall back to EVAL when
//! Redis has lost them (restart, `SCRIPT FLUSH`).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};

use super::{
    Claim, ClaimOutcome, Fingerprint, OwnerToken, RecordState, RecordStore, StoreKey, StoredResponse, UnknownReason,
    Write, decode_headers, encode_headers,
};
use crate::error::StoreError;

static CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/claim.lua")));
static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/complete.lua")));
static MARK_UNKNOWN: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/mark_unknown.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/release.lua")));

/// A cheap-to-clone handle on one multiplexed, self-reconnecting Redis connection.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    complete: Arc<Script>,
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
            complete: Arc::new(COMPLETE.clone()),
            timeout,
            url: url.into(),
        })
    }

    /// Replaces the complete script. Only for fault-injection tests that must show a
    /// broken script is caught (for example, a plain write without compare-and-set).
    #[doc(hidden)]
    pub fn with_complete_script_for_fault_injection(mut self, lua: &str) -> RedisStore {
        self.complete = Arc::new(Script::new(lua));
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
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let mut connection = self.connection.clone();
        let mut invocation = CLAIM.key(claim.key.as_str());
        invocation
            .arg(claim.owner.to_hex())
            .arg(claim.fingerprint.to_hex())
            .arg(millis(claim.retention))
            .arg(millis(claim.lease));
        let reply: Vec<Bytes> = self.bounded(invocation.invoke_async(&mut connection)).await?;
        parse_claim_reply(&reply).ok_or(StoreError::Protocol("malformed claim reply"))
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        let mut invocation = self.complete.key(key.as_str());
        invocation
            .arg(owner.to_hex())
            .arg(response.status)
            .arg(encode_headers(&response.headers))
            .arg(response.body.as_ref());
        self.fenced_write(invocation).await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<Write, StoreError> {
        let mut invocation = MARK_UNKNOWN.key(key.as_str());
        invocation.arg(owner.to_hex()).arg(reason.as_str());
        self.fenced_write(invocation).await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let mut invocation = RELEASE.key(key.as_str());
        invocation.arg(owner.to_hex());
        self.fenced_write(invocation).await
    }

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

/// Parses the reply shapes documented in `scripts/claim.lua`.
fn parse_claim_reply(reply: &[Bytes]) -> Option<ClaimOutcome> {
    let (kind, rest) = reply.split_first()?;
    if kind.as_ref() == b"acquired" {
        return Some(ClaimOutcome::Acquired);
    }
    let (fingerprint, rest) = rest.split_first()?;
    let fingerprint = Fingerprint::from_hex(fingerprint)?;
    let state = match (kind.as_ref(), rest) {
        (b"in_flight", [remaining]) => RecordState::InFlight {
            lease_remaining: Duration::from_millis(std::str::from_utf8(remaining).ok()?.parse().ok()?),
        },
        (b"lease_expired", []) => RecordState::LeaseExpired,
        (b"completed", [status, headers, body]) => RecordState::Completed(StoredResponse {
            status: std::str::from_utf8(status).ok()?.parse().ok()?,
            headers: decode_headers(headers)?,
            body: body.clone(),
        }),
        (b"unknown", [reason]) => RecordState::Unknown(UnknownReason::parse(reason)?),
        _ => return None,
    };
    Some(ClaimOutcome::Existing { fingerprint, state })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_replies_parse() {
        let fp = Fingerprint([7; 32]).to_hex();
        let b = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        assert_eq!(parse_claim_reply(&[b("acquired")]), Some(ClaimOutcome::Acquired));
        assert_eq!(
            parse_claim_reply(&[b("in_flight"), b(&fp), b("1500")]),
            Some(ClaimOutcome::Existing {
                fingerprint: Fingerprint([7; 32]),
                state: RecordState::InFlight {
                    lease_remaining: Duration::from_millis(1500)
                }
            })
        );
        assert_eq!(parse_claim_reply(&[b("in_flight"), b(&fp)]), None);
        assert_eq!(parse_claim_reply(&[b("bogus"), b(&fp)]), None);
        assert_eq!(parse_claim_reply(&[]), None);
    }
}
