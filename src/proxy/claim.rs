//! The claim a guarded request holds, from the moment it is sent to the store until it
//! ends in exactly one of complete, mark unknown or release. `Ledger` is the store as
//! the request path uses it: every operation timed, every fenced write counted, and
//! writes the store could not take retried in the background. `OwnedClaim` owns one
//! claim; dropped before it is resolved, it releases itself if nothing was forwarded.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwapOption;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use crate::config::Config;
use crate::error::StoreError;
use crate::metrics::{Metrics, StoreOp};
use crate::store::{AnyStore, ClaimOutcome, ClaimRequest, OwnerToken, RecordStore, StoreKey, StoredResponse};
use crate::store::{ProbeSchedule, UnknownReason, Write};
use crate::trace::Spans;

/// The first pause between two tries of a background write, and the longest.
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// The store, with the metrics its operations are counted in and the tracker that
/// shutdown waits on for background writes. Cheap to clone.
#[derive(Clone)]
pub(super) struct Ledger {
    store: AnyStore,
    /// `[store.previous]`, while a fleet switches stores; a reload swaps it.
    previous: Arc<ArcSwapOption<PreviousStore>>,
    metrics: Arc<Metrics>,
    tasks: TaskTracker,
    /// Each operation runs in a span of its own (`Span::none()` with tracing off).
    spans: Spans,
}

/// The stores a worker's requests use: its handle on the store, and on the store a
/// fleet is switching from, if any.
pub(crate) struct Stores {
    pub(crate) store: AnyStore,
    pub(crate) previous: Option<PreviousStore>,
}

/// The store a fleet is switching from (docs/design.md §26): read for a key the store
/// does not hold, until `until`.
pub(crate) struct PreviousStore {
    store: AnyStore,
    until: SystemTime,
    /// Whether this worker has said that `until` has passed.
    told: AtomicBool,
}

impl PreviousStore {
    /// A handle on `config.store.previous`, if it names one (connecting on first use).
    pub(crate) fn open(config: &Config) -> Result<Option<PreviousStore>, StoreError> {
        let Some(previous) = &config.store.previous else {
            return Ok(None);
        };
        Ok(Some(PreviousStore {
            store: crate::store::previous(previous)?,
            until: previous.until,
            told: AtomicBool::new(false),
        }))
    }

    /// Whether it is read now; past `until`, says so once (a log line, the gauge).
    fn reading(&self, metrics: &Metrics) -> bool {
        if SystemTime::now() < self.until {
            return true;
        }
        if !self.told.swap(true, Ordering::Relaxed) {
            metrics.previous_reading(false);
            tracing::info!(
                until = %humantime::format_rfc3339_seconds(self.until),
                "[store.previous] is past its until and is no longer read; remove it from the config"
            );
        }
        false
    }
}

impl Ledger {
    pub(super) fn new(stores: Stores, metrics: Arc<Metrics>, tasks: TaskTracker, spans: Spans) -> Ledger {
        let Stores { store, previous } = stores;
        let ledger = Ledger {
            store,
            previous: Arc::new(ArcSwapOption::empty()),
            metrics,
            tasks,
            spans,
        };
        ledger.set_previous(previous);
        ledger
    }

    /// Reads `previous` from now on (a reload).
    pub(super) fn set_previous(&self, previous: Option<PreviousStore>) {
        let reading = previous
            .as_ref()
            .is_some_and(|previous| SystemTime::now() < previous.until);
        self.metrics.previous_reading(reading);
        self.previous.store(previous.map(Arc::new));
    }

    /// Claims `request.key` for `request.owner`. Acquired, the claim is the caller's to
    /// resolve. Until the store answers, the claim may already be written: if this
    /// future is dropped (the client went away), or the store fails in a way that may
    /// have written it, the claim is released in the background.
    pub(super) async fn claim(
        &self,
        request: &ClaimRequest,
        span: &Span,
    ) -> Result<ClaimOutcome<OwnedClaim>, StoreError> {
        match self.claim_here(request, span).await? {
            // Boxed: read only during a switch of stores, its state (two stores'
            // lookups) would otherwise be carried, and moved, by every claim's future.
            ClaimOutcome::Acquired(claim) if self.previous.load().is_some() => {
                Box::pin(self.before_previous(request, claim)).await
            }
            existing => Ok(existing),
        }
    }

    /// An acquired claim on a key the store did not hold, where `[store.previous]` is
    /// read: the key is looked up there. Absent, the claim stands. Found, the record is
    /// written over the claim (in flight there, it arrives unknown) and read back as
    /// any claim reads a record it finds. Unreadable, the claim is released and the
    /// request refused: the key may be recorded there, so nothing is forwarded.
    async fn before_previous(
        &self,
        request: &ClaimRequest,
        claim: OwnedClaim,
    ) -> Result<ClaimOutcome<OwnedClaim>, StoreError> {
        let Some(previous) = self.previous.load_full() else {
            return Ok(ClaimOutcome::Acquired(claim));
        };
        if !previous.reading(&self.metrics) {
            return Ok(ClaimOutcome::Acquired(claim));
        }
        let found = match self
            .timed(StoreOp::PreviousRead, previous.store.carried(&request.key))
            .await
        {
            Ok(None) => return Ok(ClaimOutcome::Acquired(claim)),
            Ok(Some(found)) => found,
            Err(error) => {
                claim.release_in_background();
                return Err(StoreError::Previous(Box::new(error)));
            }
        };
        if let Err(error) = self
            .timed(StoreOp::TakeOver, self.store.take_over(found, request.owner))
            .await
        {
            // Fenced on this claim: a release after the record landed changes nothing.
            claim.release_in_background();
            return Err(error);
        }
        self.metrics.previous_record();
        let span = claim.span.clone();
        claim.disown();
        // What the store now holds for the key: the record found, read as any claim
        // reads one (or, had it expired in between, a claim of this request's own).
        self.claim_here(request, &span).await
    }

    /// The claim in this store alone.
    async fn claim_here(&self, request: &ClaimRequest, span: &Span) -> Result<ClaimOutcome<OwnedClaim>, StoreError> {
        let claim = OwnedClaim {
            ledger: self.clone(),
            record: request.key.clone(),
            owner: request.owner,
            lease: request.lease,
            retention: request.retention,
            replay_until: SystemTime::now() + request.retention,
            span: span.clone(),
            stage: Stage::Claimed,
        };
        // Not boxed: the store boxes the large backends' claims itself (`AnyStore`).
        match self.timed(StoreOp::Claim, self.store.claim(request)).await {
            Ok(ClaimOutcome::Acquired(())) => Ok(ClaimOutcome::Acquired(claim)),
            Ok(ClaimOutcome::Existing(existing)) => {
                claim.disown();
                Ok(ClaimOutcome::Existing(existing))
            }
            Err(error) if error.may_have_written() => {
                if let StoreError::NotReplicated { acks, wanted } = error {
                    self.metrics.replica_acks_missed();
                    tracing::warn!(acks, wanted, "too few replicas acknowledged the claim; releasing it");
                }
                claim.release_in_background();
                Err(error)
            }
            Err(error) => {
                claim.disown();
                Err(error)
            }
        }
    }

    pub(super) fn store(&self) -> &AnyStore {
        &self.store
    }

    /// Runs one store operation in a span of its own, and records its latency.
    pub(super) async fn timed<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let span = self.spans.store(op.as_str());
        let result = call.instrument(span.clone()).await;
        if let Err(error) = &result {
            span.record("error.type", error.kind());
            self.metrics.store_error(op, error.cause());
        }
        self.metrics.store_op(op, result.is_ok(), started.elapsed());
        result
    }

    /// Runs one compare-and-set write, recording its latency and whether it was fenced.
    async fn write(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<Write, StoreError>>,
    ) -> Result<Write, StoreError> {
        let result = self.timed(op, call).await;
        if let Ok(Write::Fenced) = result {
            self.metrics.fenced_write(op);
        }
        result
    }

    /// Tries `write` in a task of its own until the store answers or `until` passes,
    /// backing off between tries.
    fn retry_in_background<F, Fut>(&self, op: StoreOp, until: Instant, span: Span, mut write: F)
    where
        F: FnMut(&AnyStore) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Write, StoreError>> + Send,
    {
        let ledger = self.clone();
        let retry = async move {
            let pending = (op == StoreOp::Release).then(|| ledger.metrics.pending_releases().clone());
            if let Some(pending) = &pending {
                pending.inc();
            }
            let mut pause = FIRST_RETRY_PAUSE;
            let answered = loop {
                if Instant::now() >= until {
                    break false;
                }
                match ledger.write(op, write(&ledger.store)).await {
                    Ok(outcome) => {
                        tracing::info!(?op, ?outcome, "background store write answered");
                        break true;
                    }
                    Err(error) => tracing::debug!(?op, %error, "background store write failed; will retry"),
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_RETRY_PAUSE);
            };
            if !answered {
                tracing::warn!(?op, "gave up a background store write: the record has expired by now");
            }
            if let Some(pending) = &pending {
                pending.dec();
            }
        };
        self.tasks.spawn(retry.instrument(span));
    }
}

/// How far an owned claim has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Written (or maybe written), and nothing forwarded: releasing it is safe.
    Claimed,
    /// The request may have reached the upstream: the claim must never be released
    /// for a reason the upstream did not give.
    Forwarded,
    /// Completed, marked unknown, released, or never the claimant's.
    Resolved,
}

/// One claim, owned by the request that made it. It ends in exactly one of `complete`,
/// `mark_unknown` and `release`, each consuming it. Dropped unresolved before
/// `forwarding`, it releases itself in the background; after, the record reads as
/// unknown once its lease ends, which is the only safe reading.
pub(super) struct OwnedClaim {
    ledger: Ledger,
    record: StoreKey,
    owner: OwnerToken,
    lease: Duration,
    retention: Duration,
    /// When the response recorded for it stops being replayed: the claim's time (on
    /// this process's wall clock) plus the retention.
    replay_until: SystemTime,
    span: Span,
    stage: Stage,
}

impl OwnedClaim {
    /// When the response recorded for this claim stops being replayed.
    pub(super) fn replay_until(&self) -> SystemTime {
        self.replay_until
    }

    /// Marks the moment the request leaves for the upstream: from here on, only the
    /// upstream's answer can free the key.
    pub(super) fn forwarding(&mut self) {
        self.stage = Stage::Forwarded;
    }

    /// Records the upstream's response; if the store cannot take it now, keeps trying
    /// in the background until the lease ends (after which complete is refused).
    pub(super) async fn complete(mut self, response: StoredResponse) {
        self.stage = Stage::Resolved;
        // Not boxed, as a claim is not: the store boxes the large backends' own.
        let write = self.ledger.store.complete(&self.record, self.owner, &response);
        match self.ledger.write(StoreOp::Complete, write).await {
            Ok(Write::Applied) => {}
            Ok(Write::Fenced) => tracing::warn!(
                "complete was fenced off: the claim expired or was taken; retries get 409 outcome-unknown"
            ),
            Err(error) => {
                tracing::warn!(%error, "cannot record the response; retrying in the background until the lease ends");
                let (record, owner) = (self.record.clone(), self.owner);
                let until = Instant::now() + self.lease;
                self.ledger
                    .retry_in_background(StoreOp::Complete, until, self.span.clone(), move |store| {
                        let (record, response, store) = (record.clone(), response.clone(), store.clone());
                        async move { store.complete(&record, owner, &response).await }
                    });
            }
        }
    }

    /// The request was forwarded and its outcome cannot be learned: the record is
    /// marked unknown, with the route's probe scheduled when it has one. If the store
    /// cannot take it, the record reads as unknown anyway once its lease ends. `true`
    /// when the record is marked (and its probe, if any, is to be run).
    pub(super) async fn mark_unknown(mut self, reason: UnknownReason, schedule: Option<ProbeSchedule>) -> bool {
        self.stage = Stage::Resolved;
        let write = self
            .ledger
            .store
            .mark_unknown(&self.record, self.owner, reason, schedule);
        match self.ledger.write(StoreOp::MarkUnknown, write).await {
            Ok(Write::Applied) => true,
            Ok(Write::Fenced) => false,
            Err(error) => {
                tracing::warn!(%error, "cannot mark the record unknown; it reads as unknown when its lease ends");
                false
            }
        }
    }

    /// Frees the key: nothing was forwarded, or the upstream's answer says a retry may
    /// run again. Retried in the background while the store is down.
    pub(super) async fn release(mut self) {
        self.stage = Stage::Resolved;
        let write = self.ledger.store.release(&self.record, self.owner);
        if let Err(error) = self.ledger.write(StoreOp::Release, write).await {
            tracing::warn!(%error, "cannot release the claim; retrying in the background");
            self.retry_release();
        }
    }

    /// Frees the key from a task of its own, so the caller answers at once.
    pub(super) fn release_in_background(mut self) {
        self.stage = Stage::Resolved;
        self.retry_release();
    }

    /// The claim was never this request's: there is nothing to resolve.
    fn disown(mut self) {
        self.stage = Stage::Resolved;
    }

    fn retry_release(&self) {
        let (record, owner) = (self.record.clone(), self.owner);
        let until = Instant::now() + self.retention;
        self.ledger
            .retry_in_background(StoreOp::Release, until, self.span.clone(), move |store| {
                let (record, store) = (record.clone(), store.clone());
                async move { store.release(&record, owner).await }
            });
    }
}

impl Drop for OwnedClaim {
    fn drop(&mut self) {
        match self.stage {
            Stage::Resolved => {}
            Stage::Claimed => {
                let _entered = self.span.enter();
                tracing::debug!("the request went away before it was forwarded; releasing its claim");
                self.retry_release();
            }
            Stage::Forwarded => {
                let _entered = self.span.enter();
                tracing::warn!(
                    "the exchange was abandoned after forwarding; the key reads as unknown when its lease ends"
                );
            }
        }
    }
}
