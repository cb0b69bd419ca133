//! A storm: many logical operations, each sent several times across proxy instances
//! by concurrent clients, every answer recorded for the history checker; then a
//! settling pass that retries each key until it ends in a success or a definite
//! `outcome-unknown` (liveness).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::client::{PooledClient, pooled_client, pooled_send};
use super::history::{Contract, History, Report, check};
use super::upstream::Execution;

/// Many logical operations, each sent `duplicates` times across the targets.
pub struct Storm {
    pub name: &'static str,
    pub targets: Vec<SocketAddr>,
    pub logical: usize,
    pub duplicates: usize,
    pub concurrency: usize,
    pub jitter_ms: u64,
    /// Each answer is five server-sent events, 5 ms apart, which the proxy streams.
    pub streamed: bool,
}

pub struct StormRun {
    pub history: Arc<History>,
    pub progress: Arc<AtomicUsize>,
    pub started: Instant,
}

impl Storm {
    /// Two tenants share each key name, so a replay across scopes would show.
    pub fn scope_and_key(&self, logical: usize) -> (String, String) {
        let half = self.logical.div_ceil(2);
        (
            format!("Bearer tenant-{}", logical / half),
            format!("{}-{}", self.name, logical % half),
        )
    }

    pub fn raw_keys(&self) -> Vec<String> {
        (0..self.logical).map(|l| self.scope_and_key(l).1).collect()
    }

    /// Checks what `run` recorded against the upstream's executions and the store's
    /// keys with their TTLs, under the contract of this storm: its raw keys, the
    /// retention its proxies use, and the windows in which the store was really out.
    pub fn check(
        &self,
        run: &StormRun,
        executions: &[Execution],
        store: &[(String, i64)],
        retention: Duration,
        outage_windows: Vec<(Instant, Instant)>,
    ) -> Report {
        self.check_against(run, executions, store, retention, retention, outage_windows)
    }

    /// `check`, for proxies whose records outlive their responses: each response lives
    /// `retention` from its claim, each record `remember`.
    pub fn check_within(
        &self,
        run: &StormRun,
        executions: &[Execution],
        store: &[(String, i64)],
        retention: Duration,
        remember: Duration,
    ) -> Report {
        self.check_against(run, executions, store, retention, remember, vec![])
    }

    fn check_against(
        &self,
        run: &StormRun,
        executions: &[Execution],
        store: &[(String, i64)],
        retention: Duration,
        remember: Duration,
        outage_windows: Vec<(Instant, Instant)>,
    ) -> Report {
        check(
            &run.history,
            executions,
            store,
            &Contract {
                retention,
                remember,
                run_started: run.started,
                raw_keys: self.raw_keys(),
                outage_windows,
                resolving: false,
            },
        )
    }

    pub fn start(&self) -> StormRun {
        StormRun {
            history: Arc::new(History::default()),
            progress: Arc::new(AtomicUsize::new(0)),
            started: Instant::now(),
        }
    }

    pub async fn run(&self, run: &StormRun) {
        let client = pooled_client();
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let mut tasks = tokio::task::JoinSet::new();
        let jitter = self.jitter_ms.to_string();
        let streamed = self.streamed;
        for logical in 0..self.logical {
            for copy in 0..self.duplicates {
                let permit = permits.clone().acquire_owned().await.expect("semaphore");
                let (scope, key) = self.scope_and_key(logical);
                let target = self.targets[(logical + copy) % self.targets.len()];
                let (client, history, progress, jitter) = (
                    client.clone(),
                    run.history.clone(),
                    run.progress.clone(),
                    jitter.clone(),
                );
                tasks.spawn(async move {
                    one_op(&client, target, &scope, &key, &jitter, streamed, &history).await;
                    progress.fetch_add(1, Ordering::SeqCst);
                    drop(permit);
                });
            }
        }
        while tasks.join_next().await.is_some() {}
    }

    pub fn total(&self) -> usize {
        self.logical * self.duplicates
    }

    /// Liveness, after the storm and its fault: each key is retried (through its first
    /// target) while it is still in progress or the store refuses it, and must end in a
    /// success or a definite `outcome-unknown`. The retries are recorded in the history,
    /// so the checker sees them too.
    pub async fn settle(&self, run: &StormRun) -> Liveness {
        let client = pooled_client();
        let permits = Arc::new(Semaphore::new(32));
        let mut tasks = tokio::task::JoinSet::new();
        for logical in 0..self.logical {
            let permit = permits.clone().acquire_owned().await.expect("semaphore");
            let (scope, key) = self.scope_and_key(logical);
            let target = self.targets[logical % self.targets.len()];
            let (client, history) = (client.clone(), run.history.clone());
            tasks.spawn(async move {
                let settled = settle_one(&client, target, &scope, &key, &history).await;
                drop(permit);
                settled
            });
        }
        let mut liveness = Liveness::default();
        while let Some(settled) = tasks.join_next().await {
            liveness.keys += 1;
            match settled.expect("settle task") {
                Settled::Succeeded => liveness.succeeded += 1,
                Settled::Unknown => liveness.unknown += 1,
                Settled::Not(what) => liveness.unsettled.push(what),
            }
        }
        liveness
    }
}

pub enum Settled {
    Succeeded,
    Unknown,
    /// Still not settled after 20 s, or an answer that is neither.
    Not(String),
}

async fn settle_one(client: &PooledClient, target: SocketAddr, scope: &str, key: &str, history: &History) -> Settled {
    let headers = [
        ("idempotency-key", key),
        ("authorization", scope),
        ("content-type", "application/json"),
    ];
    let started = Instant::now();
    loop {
        let sent = Instant::now();
        let outcome = pooled_send(
            client,
            target,
            "/v1/payments",
            &headers,
            "{\"amount\":1}",
            Duration::from_secs(15),
        )
        .await;
        history.record(scope, key, sent, outcome.clone());
        let last = match outcome {
            Ok(response) if response.status.is_success() => return Settled::Succeeded,
            Ok(response) if response.status == 409 && response.problem() == "outcome-unknown" => {
                return Settled::Unknown;
            }
            Ok(response) if matches!(response.status.as_u16(), 409 | 503) => {
                format!("{} {}", response.status, response.problem())
            }
            Ok(response) => return Settled::Not(format!("{key}: {response:?}")),
            Err(error) => error,
        };
        if started.elapsed() > Duration::from_secs(20) {
            return Settled::Not(format!("{key}: still {last} after 20 s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How the keys of a storm ended.
#[derive(Debug, Default)]
pub struct Liveness {
    pub keys: usize,
    pub succeeded: usize,
    pub unknown: usize,
    pub unsettled: Vec<String>,
}

impl Liveness {
    /// Prints the figures, then fails unless every key settled and at least
    /// `min_success` of them succeeded.
    pub fn assert_live(&self, scenario: &str, min_success: f64) {
        let share = self.succeeded as f64 / self.keys.max(1) as f64;
        println!(
            "liveness[{scenario}]: keys={} succeeded={} ({:.1} %) unknown={} unsettled={}",
            self.keys,
            self.succeeded,
            share * 100.0,
            self.unknown,
            self.unsettled.len()
        );
        assert!(
            self.unsettled.is_empty(),
            "{scenario}: keys that never settled: {:?}",
            self.unsettled
        );
        assert!(
            share >= min_success,
            "{scenario}: only {:.1} % of the keys succeeded (at least {:.1} % expected)",
            share * 100.0,
            min_success * 100.0
        );
    }
}

async fn one_op(
    client: &PooledClient,
    target: SocketAddr,
    scope: &str,
    key: &str,
    jitter: &str,
    streamed: bool,
    history: &History,
) {
    let mut headers = vec![
        ("idempotency-key", key),
        ("authorization", scope),
        ("content-type", "application/json"),
        ("x-test-jitter-ms", jitter),
    ];
    if streamed {
        headers.extend([("x-test-stream", "5"), ("x-test-stream-gap-ms", "5")]);
    }
    let started = Instant::now();
    let outcome = pooled_send(
        client,
        target,
        "/v1/payments",
        &headers,
        "{\"amount\":1}",
        Duration::from_secs(15),
    )
    .await;
    history.record(scope, key, started, outcome);
}

/// Waits until the storm has made `count` more operations: a condition, bounded.
pub async fn until_progress(run: &StormRun, count: usize) {
    let started = Instant::now();
    while run.progress.load(Ordering::SeqCst) < count {
        assert!(started.elapsed() < Duration::from_secs(60), "the storm stalled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
