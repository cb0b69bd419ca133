//! Wait, then replay (`wait_for_in_flight`): a duplicate that finds its key in flight
//! waits for the first request instead of getting 409 at once. It is woken by the
//! store when the record changes (see `store::notify`), never by polling it, and
//! re-reads the record by claiming again: completed → the replay; released → it owns
//! the key and forwards its own request (the claim is atomic, so one waiter wins);
//! unknown → 409 `outcome-unknown`; in flight with its response streaming from this
//! process → it joins the stream (`stream`); still in flight at the deadline → 409
//! `request-in-progress`. A lost notification costs time, not a wrong answer: a
//! waiter re-reads at the end of the first request's lease and at its deadline.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::{Answer, Guarded, Handled, Prepared, Proxy, Refusal};
use crate::error::Rejection;
use crate::idempotency::Decision;
use crate::metrics::{Metrics, WaitEnd};
use crate::store::notify::{Watch, Watcher};
use crate::stream::Streams;

/// How soon a waiter whose store failed reads its record again, unless woken first.
const STORE_RETRY: Duration = Duration::from_millis(100);

/// The process's waiters: where they learn that a record changed, their bound, and
/// the responses streaming here that they may join. Shared by the workers.
#[derive(Clone)]
pub(crate) struct Waiting {
    watcher: Watcher,
    slots: Arc<Semaphore>,
    pub(super) streams: Arc<Streams>,
}

impl Waiting {
    pub(crate) fn new(watcher: Watcher, max: usize) -> Waiting {
        Waiting {
            watcher,
            slots: Arc::new(Semaphore::new(max)),
            streams: Arc::default(),
        }
    }
}

/// Counts one wait: the waiters gauge from the moment the waiter will be woken (its
/// subscription in place) to its end, and how it ended. A wait dropped before it ended
/// is a client that went away.
struct Tally {
    metrics: Arc<Metrics>,
    started: Instant,
    ended: bool,
    /// In the waiters gauge: the waiter is subscribed.
    counted: bool,
    _slot: OwnedSemaphorePermit,
}

impl Tally {
    fn new(metrics: Arc<Metrics>, slot: OwnedSemaphorePermit) -> Tally {
        Tally {
            metrics,
            started: Instant::now(),
            ended: false,
            counted: false,
            _slot: slot,
        }
    }

    /// The waiter is subscribed (or has no subscription to wait for): it counts as
    /// waiting from now on.
    fn subscribed(&mut self) {
        self.counted = true;
        self.metrics.waiters().inc();
    }

    fn end(&mut self, end: WaitEnd) {
        self.ended = true;
        self.metrics.wait_ended(end, self.started.elapsed());
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        if !self.ended {
            self.metrics.wait_ended(WaitEnd::Gone, self.started.elapsed());
        }
        if self.counted {
            self.metrics.waiters().dec();
        }
    }
}

impl Proxy {
    /// A duplicate found its key in flight (`first` is the 409 it would get) on a route
    /// that waits: it waits for the record to change, up to `wait_for_in_flight`, and
    /// answers as the record then says. It keeps its context (its place among the
    /// guarded requests, and its body) throughout, in case it wins the key.
    pub(super) async fn wait(&self, guarded: Guarded, prepared: Prepared, first: Rejection) -> Handled {
        let waiting = &self.shared.waiting;
        let Ok(slot) = waiting.slots.clone().try_acquire_owned() else {
            self.shared.metrics.wait_ended(WaitEnd::Full, Duration::ZERO);
            return Err(first.into());
        };
        let mut tally = Tally::new(self.shared.metrics.clone(), slot);
        let deadline = Instant::now() + guarded.policy.wait_for_in_flight;
        let (watch, notify) = watched(&waiting.watcher, &prepared.claim.key).await;
        tally.subscribed();
        let mut changed = false; // woken by a change, to find the key in flight again: `renew`
        loop {
            // Registered before the record is read, so a change between the read and
            // the wait still wakes it; and a response that begins to stream here.
            let (notified, streamed) = (armed(&notify), armed(self.shared.waiting.streams.announced()));
            let wake = match self.claimed(&prepared).await {
                Ok(Decision::Forward(claim)) => {
                    tally.end(WaitEnd::Claimed);
                    drop(watch);
                    return self.forward(guarded, claim, prepared).await;
                }
                Ok(Decision::Replay(stored)) => {
                    tally.end(WaitEnd::Replayed);
                    return self.replay(guarded, &prepared, stored).await;
                }
                Ok(Decision::Reject(Rejection::InProgress { .. })) if std::mem::take(&mut changed) => {
                    renew(watch.as_ref()).await;
                    continue;
                }
                Ok(Decision::Reject(Rejection::InProgress { lease_remaining, .. })) if Instant::now() < deadline => {
                    if let Some(joined) = self.join(&guarded, &prepared, &mut tally) {
                        return Ok(joined);
                    }
                    Instant::now() + lease_remaining
                }
                // The store failing for a moment (a restart, a failover) does not end
                // the wait: the waiter reads again when woken, or a moment later.
                Err(error) if Instant::now() < deadline => {
                    tracing::debug!(%error, "a waiter cannot read its record; waiting on");
                    Instant::now() + STORE_RETRY
                }
                Ok(Decision::Reject(rejection)) => {
                    tally.end(match rejection {
                        Rejection::InProgress { .. } => WaitEnd::Timeout,
                        _ => WaitEnd::Other,
                    });
                    return Err(Refusal::about(rejection, &guarded.record));
                }
                Ok(Decision::Unknown(probe, reason)) => {
                    tally.end(WaitEnd::Unknown);
                    return Err(self.unknown(&guarded, probe, reason));
                }
                Err(error) => {
                    tally.end(WaitEnd::Other);
                    return Err(error.into());
                }
            };
            changed = woken(notified, streamed, deadline.min(wake)).await;
        }
    }
}

impl Proxy {
    /// The answer of a waiter whose key's response is streaming from this process: it
    /// joins the stream. Not on a JSON-RPC route: the stream has the first call's id, and
    /// a retry waits for the record, which it gets with its own.
    fn join(&self, guarded: &Guarded, prepared: &Prepared, tally: &mut Tally) -> Option<Answer> {
        if matches!(guarded.policy.calls, Some(crate::config::Calls::JsonRpc { .. })) {
            return None;
        }
        let (head, reader) = self.shared.waiting.streams.join(&prepared.claim.key)?;
        tally.end(WaitEnd::Joined);
        Some(Answer::joined(head, reader))
    }
}

/// A waiter woken by a change that finds the key in flight again saw its claim
/// released and taken by another: it renews its watch on the new claim (on Postgres a
/// mark on the claim, which ended with the old one), then reads once more, so that an
/// end between its read and the renewal is not missed.
async fn renew(watch: Option<&Watch>) {
    if let Some(watch) = watch {
        watch.renew().await;
    }
}

/// The waiter's watch on `key` and what wakes it. Without a subscription (the store's
/// subscriber cannot connect), the waiter still re-reads at the lease's end and at its
/// deadline.
async fn watched(watcher: &Watcher, key: &crate::store::StoreKey) -> (Option<Watch>, Arc<Notify>) {
    let watch = watcher.watch(key).await;
    let notify = watch.as_ref().map_or_else(|| Arc::new(Notify::new()), Watch::notify);
    (watch, notify)
}

/// A wake-up from `notify`, registered now: a notification from here on wakes it.
fn armed(notify: &Notify) -> Pin<Box<Notified<'_>>> {
    let mut notified = Box::pin(notify.notified());
    notified.as_mut().enable();
    notified
}

/// Waits for a change, a stream to join, or until `until`: whether a change of the
/// record woke it.
async fn woken(notified: Pin<Box<Notified<'_>>>, streamed: Pin<Box<Notified<'_>>>, until: Instant) -> bool {
    tokio::select! {
        () = notified => true,
        () = streamed => false,
        () = tokio::time::sleep_until(until) => false,
    }
}
