//! Prometheus metrics, in one `prometheus-client` registry. Labels carry only
//! configured names and fixed words: never a key, a path or any other client value.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

use crate::error::StoreCause;
use crate::problem::{Outcome, Would};
use crate::store::StoreUsage;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
}

label_values! {
    /// A store operation, as `idemproxy_store_operation_seconds{op}` names it.
    pub(crate) enum StoreOp {
        Claim => "claim",
        Complete => "complete",
        MarkUnknown => "mark_unknown",
        Release => "release",
        Resolve => "resolve",
        BeginProbe => "begin_probe",
        DeferProbe => "defer_probe",
        Ping => "ping",
        /// A `[store.previous]` read of a key the store does not hold.
        PreviousRead => "previous_read",
        /// What that read found, written over the claim that looked.
        TakeOver => "take_over",
    }
}

impl StoreOp {
    /// Whether the operation is a compare-and-set, which the store may fence off.
    fn fenceable(self) -> bool {
        matches!(self, StoreOp::Complete | StoreOp::MarkUnknown | StoreOp::Release)
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShadowLabels {
    route: String,
    would: &'static str,
}

label_values! {
    /// How a duplicate's wait for its first request ended
    /// (`idemproxy_waits_total{result}`).
    pub(crate) enum WaitEnd {
        /// The first request completed: the waiter got its replay.
        Replayed => "replayed",
        /// The first request's response was streaming from this process: the waiter
        /// joined the stream.
        Joined => "joined",
        /// The key was released: this waiter claimed it and forwarded its own request.
        Claimed => "claimed",
        /// The first request's outcome became unknown: 409 `outcome-unknown`.
        Unknown => "unknown",
        /// The deadline came first: 409 `request-in-progress`.
        Timeout => "timeout",
        /// The client went away while waiting.
        Gone => "gone",
        /// At `server.max_waiters`: 409 at once, without waiting.
        Full => "full",
        /// Anything else: a mismatch, the store failing.
        Other => "other",
    }
}

label_values! {
    /// How one probe of an unknown record ended
    /// (`idemproxy_reconciliations_total{route, result}`).
    pub(crate) enum Reconciliation {
        /// The upstream says it took effect: its answer is the record's response.
        Applied => "applied",
        /// The upstream says it did not: the key is released.
        NotApplied => "not_applied",
        /// The probe learned nothing (another status, a timeout, a refused connection,
        /// the store failing): another is scheduled.
        Retry => "retry",
        /// Past `give_up_after`: the record stays unknown, for an operator.
        GaveUp => "gave_up",
        /// Someone else resolved the record first (an operator, or another probe).
        LostRace => "lost_race",
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    route: String,
    result: &'static str,
}

label_values! {
    /// How a reload ended (`idemproxy_config_reloads_total{result}`).
    pub(crate) enum ReloadResult {
        /// Swapped in.
        Ok => "ok",
        /// The file did not validate.
        Invalid => "invalid",
        /// It changed what only a restart can.
        Refused => "refused",
        /// A worker could not build or take the new routes.
        Failed => "failed",
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConfigLabels {
    sha256: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabels {
    op: &'static str,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreErrorLabels {
    op: &'static str,
    cause: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    shadow_decisions: Family<ShadowLabels, Counter>,
    upstream_latency: Family<RouteLabels, Histogram>,
    /// Handles by [op][ok], made once: the request path never looks labels up.
    store_latency: [[Histogram; 2]; StoreOp::ALL.len()],
    /// Writes refused by compare-and-set, by op: only for the ops that compare and set.
    fenced_writes: [Option<Counter>; StoreOp::ALL.len()],
    /// Failed store operations by op and cause (`StoreError::kind`), the same words on
    /// every backend; a series appears with its first failure.
    store_errors: Family<StoreErrorLabels, Counter>,
    pending_releases: Gauge,
    worker_connections: Family<WorkerLabels, Gauge>,
    replica_acks_missed: Counter,
    tls_handshakes_failed: Counter,
    /// What the embedded store holds and its bounds, set at each scrape. Labelled by
    /// backend so that nothing shows with Redis, whose memory is Redis's to report.
    store_held: [Family<BackendLabels, Gauge>; 5],
    guarded_in_flight: Gauge,
    /// The guarded-request bounds and what is held of them, set at each scrape.
    max_guarded_requests: Gauge,
    buffered_bytes: Gauge,
    max_buffered_bytes: Gauge,
    config_reloads: [Counter; ReloadResult::ALL.len()],
    waiters: Gauge,
    /// `[store.previous]`: whether it is read, and the records found there.
    previous_reading: Gauge,
    previous_records: Counter,
    waits: [Counter; WaitEnd::ALL.len()],
    wait_seconds: Histogram,
    reconciliations: Family<ReconcileLabels, Counter>,
    probe_latency: Family<RouteLabels, Histogram>,
    probes_waiting: Family<RouteLabels, Gauge>,
    config_info: Family<ConfigLabels, Gauge>,
}

/// One route's metric handles, made once so a request only bumps atomics.
#[derive(Clone)]
pub(crate) struct RouteMetrics {
    requests: [Counter; Outcome::ALL.len()],
    /// For a shadow-mode route: what enforce would have done.
    shadow: Option<[Counter; Would::ALL.len()]>,
    upstream_latency: Histogram,
    /// For a route with a probe: how its probes ended, how long they took, and how many
    /// wait for a place among the route's `max_concurrent`.
    reconcile: Option<ProbeMetrics>,
}

#[derive(Clone)]
struct ProbeMetrics {
    results: [Counter; Reconciliation::ALL.len()],
    latency: Histogram,
    waiting: Gauge,
}

/// A probe waiting for its place among the route's `max_concurrent`, counted in
/// `idemproxy_probes_waiting` until it is dropped.
pub(crate) struct WaitingProbe(Option<Gauge>);

impl Drop for WaitingProbe {
    fn drop(&mut self) {
        if let Some(gauge) = &self.0 {
            gauge.dec();
        }
    }
}

impl RouteMetrics {
    pub(crate) fn request(&self, outcome: Outcome) {
        self.requests[outcome as usize].inc();
    }

    pub(crate) fn upstream(&self, elapsed: Duration) {
        self.upstream_latency.observe(elapsed.as_secs_f64());
    }

    pub(crate) fn shadow(&self, would: Would) {
        if let Some(counters) = &self.shadow {
            counters[would as usize].inc();
        }
    }

    pub(crate) fn reconciled(&self, result: Reconciliation) {
        if let Some(probes) = &self.reconcile {
            probes.results[result as usize].inc();
        }
    }

    pub(crate) fn probe(&self, elapsed: Duration) {
        if let Some(probes) = &self.reconcile {
            probes.latency.observe(elapsed.as_secs_f64());
        }
    }

    /// A probe begins to wait for its place among the route's `max_concurrent`.
    pub(crate) fn probe_waiting(&self) -> WaitingProbe {
        let gauge = self.reconcile.as_ref().map(|probes| probes.waiting.clone());
        if let Some(gauge) = &gauge {
            gauge.inc();
        }
        WaitingProbe(gauge)
    }
}

/// Registers `metric` as `name`, and hands back its handle.
fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A counter family `name` labelled by `result`, registered, with one handle per value
/// in `results` (each shown from the start, at zero).
fn result_counters<const N: usize>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    results: [&'static str; N],
) -> [Counter; N] {
    let family = register(registry, name, help, Family::<ResultLabels, Counter>::default());
    results.map(|result| family.get_or_create(&ResultLabels { result }).clone())
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::with_prefix("idemproxy");
        let r = &mut registry;
        let store_family = register(
            r,
            "store_operation_seconds",
            "Latency of store operations",
            Family::<StoreLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            }),
        );
        let store_latency = StoreOp::ALL.map(|op| {
            [false, true].map(|ok| {
                let result = if ok { "ok" } else { "error" };
                store_family
                    .get_or_create(&StoreLabels {
                        op: op.as_str(),
                        result,
                    })
                    .clone()
            })
        });
        register(
            r,
            "records_unreadable",
            "Recorded responses that could not be opened (sealed under a key no longer configured, or altered): each retry of one gets 409 outcome-unknown",
            crate::store::sealed::UNREADABLE.clone(),
        );
        let fenced_family = register(
            r,
            "fenced_writes",
            "Store writes refused because the record no longer belonged to the writer or was no longer in flight",
            Family::<OpLabels, Counter>::default(),
        );
        let store_errors = register(
            r,
            "store_errors",
            "Failed store operations, by op and cause (unreachable, handshake, timeout, refused, full, scope_full, client_full, disk, protocol, not_replicated, unready), the same on every backend",
            Family::<StoreErrorLabels, Counter>::default(),
        );
        let fenced_writes = StoreOp::ALL.map(|op| {
            op.fenceable()
                .then(|| fenced_family.get_or_create(&OpLabels { op: op.as_str() }).clone())
        });
        let store_held = [
            (
                "store_records",
                "Records the store holds, live or expired and not yet swept",
            ),
            (
                "store_bytes",
                "Bytes the store's records hold: bodies, headers, keys and bookkeeping",
            ),
            ("store_max_records", "The store's bound on records (store.max_records)"),
            ("store_max_bytes", "The store's bound on bytes held (store.max_bytes)"),
            (
                "store_spent_records",
                "Records past their retention, kept without their response until remember ends (of store_records)",
            ),
        ]
        .map(|(name, help)| register(r, name, help, Family::<BackendLabels, Gauge>::default()));
        // Registered only: the trace export counts them, process-wide.
        r.register(
            "trace_spans_dropped",
            "Finished spans not exported: the queue was full, or the collector did not take their batch in time",
            crate::trace::spans_dropped().clone(),
        );
        r.register(
            "trace_spans_exported",
            "Finished spans the collector took",
            crate::trace::spans_exported().clone(),
        );
        Metrics {
            requests: register(r, "requests", "Requests by route and outcome", Family::default()),
            shadow_decisions: register(
                r,
                "shadow_decisions",
                "Requests a shadow-mode route forwarded, by what enforce mode would have done",
                Family::default(),
            ),
            store_latency,
            upstream_latency: register(
                r,
                "upstream_seconds",
                "Latency of upstream exchanges, to the response head",
                Family::<RouteLabels, Histogram>::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
                }),
            ),
            fenced_writes,
            store_errors,
            pending_releases: register(
                r,
                "pending_releases",
                "Claims waiting for the store to come back so they can be released",
                Gauge::default(),
            ),
            worker_connections: register(
                r,
                "worker_connections",
                "Client connections each worker serves now (a new one goes to the worker serving fewest)",
                Family::default(),
            ),
            replica_acks_missed: register(
                r,
                "replica_acks_missed",
                "Claims released because fewer replicas than min_replica_acks acknowledged them in time",
                Counter::default(),
            ),
            tls_handshakes_failed: register(
                r,
                "tls_handshakes_failed",
                "TLS handshakes on the listener that failed or did not finish within header_read_timeout",
                Counter::default(),
            ),
            store_held,
            guarded_in_flight: register(
                r,
                "guarded_requests_in_flight",
                "Guarded requests between reading their body and recording their response (bound: server.max_guarded_requests)",
                Gauge::default(),
            ),
            max_guarded_requests: register(
                r,
                "max_guarded_requests",
                "The bound on guarded requests in flight (server.max_guarded_requests)",
                Gauge::default(),
            ),
            buffered_bytes: register(
                r,
                "buffered_bytes",
                "Body bytes guarded requests hold now while buffered: request bodies read, responses read for recording (bound: server.max_buffered_bytes)",
                Gauge::default(),
            ),
            max_buffered_bytes: register(
                r,
                "max_buffered_bytes",
                "The bound on buffered body bytes (server.max_buffered_bytes); request bodies may hold three quarters of it",
                Gauge::default(),
            ),
            config_reloads: result_counters(
                r,
                "config_reloads",
                "Config reloads (SIGHUP) by result: ok, invalid, refused (needs a restart), failed",
                ReloadResult::ALL.map(ReloadResult::as_str),
            ),
            waiters: register(
                r,
                "waiters",
                "Duplicates waiting now for their first request (wait_for_in_flight; bound: server.max_waiters)",
                Gauge::default(),
            ),
            previous_reading: register(
                r,
                "store_previous_reading",
                "1 while [store.previous] is read for keys the store does not hold; 0 without one, or past its until",
                Gauge::default(),
            ),
            previous_records: register(
                r,
                "store_previous_records",
                "Records found in [store.previous] for keys the store did not hold, and copied into it",
                Counter::default(),
            ),
            waits: result_counters(
                r,
                "waits",
                "Waits for a first request by how they ended: replayed, claimed, unknown, timeout, gone, full, other",
                WaitEnd::ALL.map(WaitEnd::as_str),
            ),
            wait_seconds: register(
                r,
                "wait_seconds",
                "How long duplicates waited for their first request, from the wait's start to its end",
                Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            ),
            reconciliations: register(
                r,
                "reconciliations",
                "Probes of records whose outcome was unknown, by route and result: applied, not_applied, retry, gave_up, lost_race",
                Family::default(),
            ),
            probe_latency: register(
                r,
                "probe_seconds",
                "Latency of reconciliation probes to the upstream, by route, to the end of the answer's body",
                Family::<RouteLabels, Histogram>::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
                }),
            ),
            probes_waiting: register(
                r,
                "probes_waiting",
                "Reconciliation probes due and waiting for a place among their route's max_concurrent, by route",
                Family::default(),
            ),
            config_info: register(
                r,
                "config_info",
                "1 for the SHA-256 of the config file serving now",
                Family::default(),
            ),
            registry,
        }
    }

    /// The handles for one route (with shadow decisions for a shadow-mode route).
    /// Every outcome shows in the exposition from the start, at zero.
    pub(crate) fn route(&self, route: &str, shadow: bool, reconcile: bool) -> RouteMetrics {
        RouteMetrics {
            reconcile: reconcile.then(|| {
                let results = Reconciliation::ALL.map(|result| {
                    self.reconciliations
                        .get_or_create(&ReconcileLabels {
                            route: route.to_string(),
                            result: result.as_str(),
                        })
                        .clone()
                });
                let labels = RouteLabels {
                    route: route.to_string(),
                };
                ProbeMetrics {
                    results,
                    latency: self.probe_latency.get_or_create(&labels).clone(),
                    waiting: self.probes_waiting.get_or_create(&labels).clone(),
                }
            }),
            shadow: shadow.then(|| {
                Would::ALL.map(|would| {
                    self.shadow_decisions
                        .get_or_create(&ShadowLabels {
                            route: route.to_string(),
                            would: would.as_str(),
                        })
                        .clone()
                })
            }),
            requests: Outcome::ALL.map(|outcome| {
                self.requests
                    .get_or_create(&RequestLabels {
                        route: route.to_string(),
                        outcome: outcome.as_str(),
                    })
                    .clone()
            }),
            upstream_latency: self
                .upstream_latency
                .get_or_create(&RouteLabels {
                    route: route.to_string(),
                })
                .clone(),
        }
    }

    pub(crate) fn store_op(&self, op: StoreOp, ok: bool, elapsed: Duration) {
        self.store_latency[op as usize][usize::from(ok)].observe(elapsed.as_secs_f64());
    }

    pub(crate) fn store_error(&self, op: StoreOp, cause: StoreCause) {
        self.store_errors
            .get_or_create(&StoreErrorLabels {
                op: op.as_str(),
                cause: cause.as_str(),
            })
            .inc();
    }

    pub(crate) fn fenced_write(&self, op: StoreOp) {
        if let Some(counter) = &self.fenced_writes[op as usize] {
            counter.inc();
        }
    }

    pub(crate) fn tls_handshake_failed(&self) {
        self.tls_handshakes_failed.inc();
    }

    pub(crate) fn replica_acks_missed(&self) {
        self.replica_acks_missed.inc();
    }

    /// Sets the guarded requests in flight and the bytes they hold, with their bounds;
    /// called at each scrape.
    pub(crate) fn guarded(&self, in_flight: usize, max: usize, buffered: u64, max_buffered: u64) {
        let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        self.guarded_in_flight.set(gauge(in_flight as u64));
        self.max_guarded_requests.set(gauge(max as u64));
        self.buffered_bytes.set(gauge(buffered));
        self.max_buffered_bytes.set(gauge(max_buffered));
    }

    /// Sets the embedded store's gauges; called at each scrape.
    pub(crate) fn embedded_store(&self, usage: StoreUsage) {
        let labels = BackendLabels { backend: usage.backend };
        let values = [
            usage.records,
            usage.bytes,
            usage.max_records,
            usage.max_bytes,
            usage.spent,
        ];
        for (family, value) in self.store_held.iter().zip(values) {
            family
                .get_or_create(&labels)
                .set(i64::try_from(value).unwrap_or(i64::MAX));
        }
    }

    /// Whether `[store.previous]` is read now.
    pub(crate) fn previous_reading(&self, reading: bool) {
        self.previous_reading.set(i64::from(reading));
    }

    /// A record found in `[store.previous]` was copied into the store.
    pub(crate) fn previous_record(&self) {
        self.previous_records.inc();
    }

    pub(crate) fn waiters(&self) -> &Gauge {
        &self.waiters
    }

    /// A wait ended as `end` after `waited` (`Full` waits never start: not timed).
    pub(crate) fn wait_ended(&self, end: WaitEnd, waited: Duration) {
        self.waits[end as usize].inc();
        if end != WaitEnd::Full {
            self.wait_seconds.observe(waited.as_secs_f64());
        }
    }

    pub(crate) fn config_reloaded(&self, result: ReloadResult) {
        self.config_reloads[result as usize].inc();
    }

    /// The config file serving now is `sha256`, in place of `old` (the same at start).
    pub(crate) fn config_loaded(&self, old: &str, sha256: &str) {
        self.config_info.remove(&ConfigLabels {
            sha256: old.to_string(),
        });
        self.config_info
            .get_or_create(&ConfigLabels {
                sha256: sha256.to_string(),
            })
            .set(1);
    }

    pub(crate) fn pending_releases(&self) -> &Gauge {
        &self.pending_releases
    }

    /// The gauge of the connections worker `index` serves.
    pub(crate) fn worker_connections(&self, index: usize) -> Gauge {
        self.worker_connections
            .get_or_create(&WorkerLabels {
                worker: index.to_string(),
            })
            .clone()
    }

    /// Registers what the SQLite store's commits cost: its own counters, counted by its
    /// writer thread.
    pub(crate) fn register_commits(&mut self, stats: &crate::store::CommitFigures) {
        let r = &mut self.registry;
        register(
            r,
            "store_commits",
            "Transactions the SQLite store's writer committed (one fsync of its write-ahead log covers one or more)",
            stats.commits.clone(),
        );
        register(
            r,
            "store_committed_writes",
            "Store writes those commits held (a commit takes every write waiting for it)",
            stats.writes.clone(),
        );
        register(
            r,
            "store_commit_seconds",
            "How long each SQLite commit that wrote took to be on disk: its COMMIT, then the fsync of its write-ahead log that covers it",
            stats.commit_seconds.clone(),
        );
        register(
            r,
            "store_swept_records",
            "Expired records the SQLite store deleted",
            stats.swept.clone(),
        );
        register(
            r,
            "store_dropped_responses",
            "Responses the SQLite store dropped at the end of their retention, their records kept until remember ends",
            stats.dropped.clone(),
        );
    }

    /// The Prometheus text exposition of every metric. Every route's outcomes are
    /// there from the start, at zero, so `rate()` works from the first scrape.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
