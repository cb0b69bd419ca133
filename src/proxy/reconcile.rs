//! The reconciliation probe (docs/design.md §14): when a record's outcome becomes unknown on a
//! route with `[route.idempotency.reconcile]`, a `GET` or `HEAD` to the route's
//! upstream asks what became of it, and its answer resolves the record, fenced on the
//! claim it is about, or schedules the next probe. One chain of probes per record: the
//! instance that marked it unknown begins it, and whichever instance a retry finds it
//! due on takes it over (its instance died, or it was never begun: a lease that ran
//! out). The probe lease in the record keeps two instances from probing it at once;
//! the store's compare-and-set keeps a probe and an operator from both winning. A
//! probe never sends the client's body, headers or method, and never logs its key.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HOST, USER_AGENT};
use http::{HeaderValue, Request, StatusCode, Uri};
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::claim::OwnedClaim;
use super::context::Guarded;
use super::send::send_within;
use super::{Proxy, access};
use crate::body::{self, Buffered, full};
use crate::bounds::ProbeLimit;
use crate::config::{IdempotencyPolicy, Reconcile, UpstreamKey};
use crate::error::UpstreamError;
use crate::metrics::{Reconciliation, StoreOp};
use crate::record::ExecutionTrace;
use crate::router::RouteState;
use crate::store::{
    Deferred, OwnerToken, Probe, ProbeSchedule, ProbeStart, RecordStore, Resolution, Resolved, StoreKey,
    StoredResponse, UnknownReason,
};
use crate::upstream::{self, Clock};

/// How early a probe may find itself against the store's clock and still wait for its
/// turn: a chain whose next probe is further off was taken over by another instance.
const CLOCK_SLACK: Duration = Duration::from_millis(250);
/// The most records one process keeps a chain of probes for; past it, a record waits
/// for a retry to find it due on an instance with room.
const MAX_CHAINS: usize = 65_536;

/// What the probes of one process share across its workers: the records it runs a
/// chain of probes for (so that retries that find one do not begin a second), and each
/// route's bound on probes at once (`max_concurrent`, per process).
#[derive(Clone, Default)]
pub(crate) struct Probes {
    chains: Arc<Chains>,
    limits: Arc<Mutex<HashMap<String, Arc<ProbeLimit>>>>,
}

impl Probes {
    /// The bound on `route`'s probes at once: one per route name, the same across
    /// workers and reloads, set to `max` (a reload that lowers it holds every probe
    /// that begins from then on to the new bound, whichever chain it is in).
    pub(crate) fn limit(&self, route: &str, max: usize) -> Arc<ProbeLimit> {
        let mut limits = self.limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let limit = limits.entry(route.to_string()).or_default().clone();
        limit.set(max);
        limit
    }
}

#[derive(Default)]
struct Chains {
    records: Mutex<HashSet<StoreKey>>,
}

impl Chains {
    fn enter(self: &Arc<Self>, record: &StoreKey) -> Option<ChainGuard> {
        let mut records = self.records.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if records.len() >= MAX_CHAINS || !records.insert(record.clone()) {
            return None;
        }
        Some(ChainGuard {
            chains: self.clone(),
            record: record.clone(),
        })
    }
}

/// A chain's place in `Chains`, given up when the chain ends however it ends.
struct ChainGuard {
    chains: Arc<Chains>,
    record: StoreKey,
}

impl Drop for ChainGuard {
    fn drop(&mut self) {
        let mut records = self
            .chains
            .records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        records.remove(&self.record);
    }
}

/// One record to reconcile, and what its probe needs.
struct Job {
    route: Arc<RouteState>,
    policy: Arc<IdempotencyPolicy>,
    reconcile: Reconcile,
    record: StoreKey,
    /// The key as the upstream was sent it: what `{key}` is.
    key: String,
    /// The trace of the request that began the chain, for each probe's span to link to.
    execution: Option<ExecutionTrace>,
}

/// What one probe learned.
enum Learned {
    Applied(StoredResponse),
    NotApplied,
    /// Nothing: why, for the log.
    Nothing(&'static str),
}

impl Proxy {
    /// A claimed request was forwarded and its outcome cannot be learned: its record is
    /// marked unknown, with the route's probe scheduled when it has one, and the chain
    /// of probes begins here, the first after `first_after`. The one place an exchange
    /// hands a record to reconciliation.
    pub(super) async fn unknown_outcome(&self, guarded: &Guarded, claim: OwnedClaim, reason: UnknownReason) {
        let reconcile = guarded.route.config.reconcile();
        let marked = claim.mark_unknown(reason, reconcile.map(schedule)).await;
        if let (true, Some(reconcile)) = (marked, reconcile) {
            self.begin_chain(guarded, reconcile.first_after);
        }
    }

    /// The answer to a request whose record's outcome is unknown: whether the route's
    /// probe is reconciling it, and when the next probe is. A probe that is due with
    /// nobody on it, or was never begun, is taken over by this instance now.
    pub(super) fn reconciling(&self, guarded: &Guarded, probe: Probe) -> Option<Duration> {
        guarded.route.config.reconcile()?;
        match probe {
            Probe::GaveUp => None,
            Probe::Next(next) if !next.is_zero() => Some(next),
            Probe::Next(_) | Probe::Unscheduled => {
                self.begin_chain(guarded, Duration::ZERO);
                Some(Duration::ZERO)
            }
        }
    }

    fn begin_chain(&self, guarded: &Guarded, first: Duration) {
        let Some(reconcile) = guarded.route.config.reconcile() else {
            return;
        };
        let policy = &guarded.policy;
        let key = guarded.upstream_key();
        self.begin(
            Job {
                route: guarded.route.clone(),
                policy: policy.clone(),
                reconcile: reconcile.clone(),
                record: guarded.record.clone(),
                key,
                execution: guarded.execution,
            },
            first,
        );
    }

    /// Schedules the probe of every record the last run of this process left unknown
    /// or in flight (docs/design.md §21): with one process per store file, nobody
    /// else will find them, and a client may never retry. A record in flight is probed
    /// once its lease is over; one whose probe needs the client's key is probed with
    /// the key its record kept.
    pub(crate) async fn resume_unsettled(&self) {
        let unsettled = match self.shared.ledger.store().unsettled_off_runtime().await {
            Ok(unsettled) => unsettled,
            Err(error) => {
                tracing::warn!(%error, "cannot list the records left unsettled; a retry finds each one");
                return;
            }
        };
        let router = self.shared.router.load();
        let (mut scheduled, mut left) = (0usize, 0usize);
        for record in unsettled {
            let route = record.key.route().and_then(|name| router.named(name));
            let Some((route, policy, reconcile)) = route.and_then(|route| {
                let policy = route.config.idempotency.clone()?;
                let reconcile = route.config.reconcile()?.clone();
                Some((route, policy, reconcile))
            }) else {
                left += 1;
                continue;
            };
            let key = match (policy.upstream_key, record.probe_key) {
                (UpstreamKey::Derived, _) => record.key.operation_id(),
                (_, Some(key)) => key,
                // Kept only where the probe names the key: otherwise it is not needed.
                (_, None) if !reconcile.path.names_key() => String::new(),
                (_, None) => {
                    left += 1;
                    continue;
                }
            };
            let job = Job {
                route: route.clone(),
                policy,
                reconcile,
                record: record.key,
                key,
                execution: None,
            };
            // Past the lease on the store's clock, not a moment before it.
            self.begin(job, record.due_in + CLOCK_SLACK);
            scheduled += 1;
        }
        if scheduled + left > 0 {
            tracing::info!(
                scheduled,
                left,
                "records the last run left unknown or in flight: probes scheduled for those whose route has one; \
                 the rest answer outcome-unknown until an operator resolves them"
            );
        }
    }

    /// Begins `job`'s chain of probes, the first after `first`, unless this process
    /// already runs one for its record.
    fn begin(&self, job: Job, first: Duration) {
        let Some(place) = self.shared.probes.chains.enter(&job.record) else {
            return;
        };
        let span =
            tracing::info_span!(parent: None, "reconcile", route = %job.route.name, record = job.record.short_hash());
        let proxy = self.clone();
        // Not tracked for shutdown: a chain may wait minutes between probes. A probe cut
        // off by shutdown leaves its lease to run out, and another instance (or this
        // one, restarted) takes the record over when a retry finds it due.
        tokio::spawn(
            async move {
                let _place = place;
                proxy.chain(job, first).await;
            }
            .instrument(span),
        );
    }

    /// Probes the record until the upstream's answer resolves it, someone else does,
    /// another instance takes the chain over, or the probe gives up.
    async fn chain(&self, job: Job, first: Duration) {
        let reconcile = &job.reconcile;
        let ledger = &self.shared.ledger;
        let metrics = &job.route.metrics;
        // A store that stays down does not keep the chain alive past the schedule.
        let until = Instant::now() + first + reconcile.give_up_after + reconcile.lease();
        let mut wait = first;
        loop {
            tokio::time::sleep(wait).await;
            if Instant::now() > until {
                return;
            }
            let Some(limit) = &job.route.probes else {
                return;
            };
            let waiting = metrics.probe_waiting();
            let permit = limit.acquire().await;
            drop(waiting);
            // Each probe is a trace of its own, linked to the request that began the
            // chain: a chain may last minutes.
            let span = self
                .shared
                .spans
                .probe(&job.route.name, job.record.short_hash(), job.execution);
            let start = ledger
                .store()
                .begin_probe(&job.record, schedule(reconcile), reconcile.lease());
            let owner = match ledger.timed(StoreOp::BeginProbe, start).instrument(span.clone()).await {
                Ok(ProbeStart::Leased(owner)) => owner,
                Ok(ProbeStart::NotDue(next)) if next <= CLOCK_SLACK => {
                    wait = next;
                    continue;
                }
                // Another instance runs the chain now, or there is nothing to probe.
                Ok(ProbeStart::NotDue(_) | ProbeStart::Settled) => return,
                Ok(ProbeStart::GaveUp) => {
                    metrics.reconciled(Reconciliation::GaveUp);
                    tracing::warn!("the probe gave up; the record stays unknown until an operator resolves it");
                    return;
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot take the probe lease; trying again");
                    wait = reconcile.every;
                    continue;
                }
            };
            let learned = self.probe(&job).instrument(span.clone()).await;
            drop(permit);
            wait = match self.settle(&job, owner, learned).instrument(span).await {
                Some(next) => next,
                None => return,
            };
        }
    }

    /// Writes what a probe learned about the claim `owner` made; the wait before the next
    /// probe, or `None` when the chain is over.
    async fn settle(&self, job: &Job, owner: OwnerToken, learned: Learned) -> Option<Duration> {
        let (ledger, metrics, reconcile) = (&self.shared.ledger, &job.route.metrics, &job.reconcile);
        let resolution = match learned {
            Learned::Applied(response) => Resolution::Applied(response),
            Learned::NotApplied => Resolution::NotApplied,
            Learned::Nothing(why) => {
                let deferred = ledger.store().defer_probe(&job.record, owner, reconcile.every);
                return match ledger.timed(StoreOp::DeferProbe, deferred).await {
                    Ok(Deferred::Scheduled) => {
                        metrics.reconciled(Reconciliation::Retry);
                        tracing::info!(why, "the probe learned nothing; probing again later");
                        Some(reconcile.every)
                    }
                    Ok(Deferred::GaveUp) => {
                        metrics.reconciled(Reconciliation::GaveUp);
                        tracing::warn!(
                            why,
                            "the probe gave up; the record stays unknown until an operator resolves it"
                        );
                        None
                    }
                    Ok(Deferred::Settled) => {
                        metrics.reconciled(Reconciliation::LostRace);
                        None
                    }
                    Err(error) => {
                        metrics.reconciled(Reconciliation::Retry);
                        tracing::warn!(%error, why, "cannot schedule the next probe; probing again once the lease ends");
                        Some(reconcile.lease())
                    }
                };
            }
        };
        let applied = matches!(resolution, Resolution::Applied(_));
        let resolved = ledger.store().resolve(&job.record, Some(owner), &resolution);
        match ledger.timed(StoreOp::Resolve, resolved).await {
            Ok(Resolved::Resolved) if applied => {
                metrics.reconciled(Reconciliation::Applied);
                tracing::info!("the upstream says the operation took effect; its answer is recorded and replayed");
                None
            }
            Ok(Resolved::Resolved) => {
                metrics.reconciled(Reconciliation::NotApplied);
                tracing::info!("the upstream says the operation did not take effect; the key is released");
                None
            }
            Ok(Resolved::NotUnknown | Resolved::OtherClaim | Resolved::Absent) => {
                metrics.reconciled(Reconciliation::LostRace);
                tracing::info!("the record was resolved by someone else first; the probe's answer is dropped");
                None
            }
            Err(error) => {
                metrics.reconciled(Reconciliation::Retry);
                tracing::warn!(%error, "cannot write what the probe learned; probing again once the lease ends");
                Some(reconcile.lease())
            }
        }
    }

    /// One probe: the route's `method` and `path` to its upstream, with no body, within
    /// the probe's timeout; timed, and logged as an access line of its own.
    async fn probe(&self, job: &Job) -> Learned {
        let reconcile = &job.reconcile;
        let clock = Clock::start(reconcile.timeout);
        let (learned, status) = match probe_request(job) {
            Err(_) => (Learned::Nothing("the probe's path does not make a URI"), None),
            Ok(request) => match send_within(&job.route.client, request, &clock, self.shared.spans).await {
                Err(error) => (Learned::Nothing(unsettled(&error)), None),
                Ok(response) => {
                    let status = response.status();
                    (self.read_answer(job, response, &clock).await, Some(status))
                }
            },
        };
        let elapsed = clock.started.elapsed();
        job.route.metrics.probe(elapsed);
        if self.access_log() {
            let result = match &learned {
                Learned::Applied(_) => "applied",
                Learned::NotApplied => "not_applied",
                Learned::Nothing(_) => "retry",
            };
            access::Entry {
                route: &job.route.name,
                method: reconcile.method.as_str(),
                status: status.map(|status| status.as_u16()),
                outcome: "probe",
                result: Some(result),
                duration: elapsed,
                upstream: Some(elapsed),
                record: Some(job.record.short_hash()),
                trace_id: None,
                sent: None,
            }
            .write();
        }
        learned
    }

    /// What the probe's answer says: an `applied` status with its body recorded whole
    /// (within `max_response_body_bytes`), a `not_applied` status, or nothing.
    async fn read_answer(&self, job: &Job, response: http::Response<hyper::body::Incoming>, clock: &Clock) -> Learned {
        let reconcile = &job.reconcile;
        let status = response.status();
        if reconcile.not_applied.contains(&status) {
            return Learned::NotApplied;
        }
        if !reconcile.applied.contains(&status) {
            return Learned::Nothing(other_status(status));
        }
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        // Bounded without the byte budget: at most `max_concurrent` probes per route
        // hold a body, each at most `max_response_body_bytes`.
        let limit = job.policy.max_response_body_bytes;
        match body::buffer_response(body, limit, clock.deadline, clock.timeout, |_| true).await {
            Ok(Buffered::Whole(body)) => Learned::Applied(
                StoredResponse::recorded(&parts, body, &job.policy)
                    .reconciled()
                    .traced(self.shared.spans.reference(&Span::current())),
            ),
            Ok(Buffered::Cut { .. }) => Learned::Nothing("the probe's answer is larger than max_response_body_bytes"),
            Err(error) => Learned::Nothing(unsettled(&error)),
        }
    }
}

/// What the store keeps of a route's probe schedule.
fn schedule(reconcile: &Reconcile) -> ProbeSchedule {
    ProbeSchedule {
        first_after: reconcile.first_after,
        give_up_after: reconcile.give_up_after,
    }
}

/// The probe's request: no body, no client header, to the route's upstream.
fn probe_request(job: &Job) -> Result<Request<crate::body::ProxyBody>, http::Error> {
    let target = &job.route.config.upstream;
    let path = job.reconcile.path.render(&job.key, &job.record.operation_id());
    let path_and_query = match target.base_path() {
        None => path,
        Some(base) => format!("{base}{path}"),
    };
    let uri = Uri::builder()
        .scheme(target.scheme().clone())
        .authority(target.authority().clone())
        .path_and_query(path_and_query)
        .build()?;
    Request::builder()
        .method(job.reconcile.method.clone())
        .uri(uri)
        .header(HOST, target.host().clone())
        .header(USER_AGENT, HeaderValue::from_static("idemproxy-reconcile"))
        .body(full(Bytes::new()))
}

fn unsettled(error: &UpstreamError) -> &'static str {
    match error {
        UpstreamError::Unavailable(_) => "the upstream refused the probe's connection",
        UpstreamError::Timeout(_) => "the probe timed out",
        UpstreamError::Failed(_) => "the probe's exchange broke off",
    }
}

fn other_status(status: StatusCode) -> &'static str {
    if status.is_server_error() {
        "the probe got a 5xx"
    } else {
        "the probe got a status in neither applied nor not_applied"
    }
}
