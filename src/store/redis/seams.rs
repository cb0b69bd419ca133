//! The Redis store's test seams (`test-util`): a bug planted in the native claim, for
//! the conformance test's negative controls (the claim has no script to swap), and a
//! pause inside the claim, for a test that changes the record between its two round
//! trips. They are one field of the store and one hook per site in the claim; without
//! the feature every hook is a no-op and the types do not exist.

use std::time::Duration;

use super::RedisStore;
use crate::error::StoreError;
use crate::store::{ClaimOutcome, ClaimRequest};

#[cfg(feature = "test-util")]
pub(super) use self::planted::Seams;
#[cfg(feature = "test-util")]
pub use self::planted::{ClaimPause, ClaimPlant};

#[cfg(not(feature = "test-util"))]
pub(super) use self::none::Seams;

#[cfg(not(feature = "test-util"))]
mod none {
    use super::*;

    /// No seams: each hook does what the claim does anyway.
    #[derive(Clone, Default)]
    pub(in crate::store::redis) struct Seams {}

    impl Seams {
        pub(in crate::store::redis) fn expiry(&self, claim: &ClaimRequest) -> Duration {
            claim.remember
        }

        pub(in crate::store::redis) async fn before_lease_read(&self) {}

        pub(in crate::store::redis) async fn after_claim(
            &self,
            _: &RedisStore,
            _: &ClaimRequest,
            outcome: ClaimOutcome,
        ) -> Result<ClaimOutcome, StoreError> {
            Ok(outcome)
        }
    }
}

#[cfg(feature = "test-util")]
mod planted {
    use std::sync::Arc;

    use super::*;
    use crate::store::redis::{Retry, layout, millis};
    use crate::store::{Existing, RecordState};

    /// A bug planted in the native claim.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ClaimPlant {
        /// A record whose lease ran out is taken over by the next claim.
        TakesOverExpiredLeases,
        /// The record's expiry is set to the lease instead of the retention.
        ExpiresWithTheLease,
    }

    /// Where a claim that found a record in flight stops before it reads that record's
    /// TTL, for a test that changes the record in between.
    #[derive(Debug, Clone, Default)]
    pub struct ClaimPause {
        /// Told when a claim has found a record in flight.
        pub reached: Arc<tokio::sync::Notify>,
        /// Waited for before the claim reads the record's TTL.
        pub resume: Arc<tokio::sync::Notify>,
    }

    /// What a test planted in the store's claim.
    #[derive(Clone, Default)]
    pub(in crate::store::redis) struct Seams {
        pub(in crate::store::redis) plant: Option<ClaimPlant>,
        pub(in crate::store::redis) pause: Option<ClaimPause>,
    }

    impl Seams {
        /// The expiry the claim writes.
        pub(in crate::store::redis) fn expiry(&self, claim: &ClaimRequest) -> Duration {
            match self.plant {
                Some(ClaimPlant::ExpiresWithTheLease) => claim.lease,
                _ => claim.remember,
            }
        }

        /// Between the claim's write and its read of an in-flight record's TTL.
        pub(in crate::store::redis) async fn before_lease_read(&self) {
            if let Some(pause) = &self.pause {
                pause.reached.notify_one();
                pause.resume.notified().await;
            }
        }

        /// What the claim answers, once decoded: the planted take-over overwrites a
        /// record whose lease ran out.
        pub(in crate::store::redis) async fn after_claim(
            &self,
            store: &RedisStore,
            claim: &ClaimRequest,
            outcome: ClaimOutcome,
        ) -> Result<ClaimOutcome, StoreError> {
            let expired = matches!(
                outcome,
                ClaimOutcome::Existing(Existing {
                    state: RecordState::LeaseExpired,
                    ..
                })
            );
            if self.plant != Some(ClaimPlant::TakesOverExpiredLeases) || !expired {
                return Ok(outcome);
            }
            let rest = claim.remember.saturating_sub(claim.lease);
            let keep = claim.remember.saturating_sub(claim.retention);
            let value = layout::in_flight(claim.fingerprint, claim.owner, rest, keep);
            let _: () = store
                .attempt(Retry::Refused, store.timeout, |mut connection| {
                    let value = value.clone();
                    async move {
                        redis::cmd("SET")
                            .arg(claim.key.as_str())
                            .arg(value)
                            .arg("PX")
                            .arg(millis(claim.remember))
                            .query_async(&mut connection)
                            .await
                    }
                })
                .await?;
            Ok(ClaimOutcome::Acquired(()))
        }
    }
}
