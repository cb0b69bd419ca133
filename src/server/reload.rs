//! Reload (SIGHUP): the config file read again and swapped in without a restart.
//! Every worker rebuilds its routes on its own thread and swaps them at once; the
//! listener's TLS configuration and the admin listener's config are swapped after the
//! last worker. A request takes its route when it starts, so requests in flight finish
//! under the config they started with. A file that does not validate, or that changes
//! what only a restart can change, is refused and the old config keeps serving.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::{mpsc, oneshot};

use crate::config::Config;
use crate::error::ConfigError;
use crate::metrics::{Metrics, ReloadResult};

/// Asks one worker to serve `config`; it answers once it does.
pub(super) struct WorkerReload {
    pub(super) config: Arc<Config>,
    pub(super) done: oneshot::Sender<Result<(), rustls::Error>>,
}

/// The handle that reloads a running proxy. Reloads are taken one at a time.
#[derive(Clone)]
pub struct Reloader {
    pub(super) live: Arc<ArcSwap<Config>>,
    pub(super) workers: Vec<mpsc::UnboundedSender<WorkerReload>>,
    /// The listener's TLS configuration, when it terminates TLS.
    pub(super) tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) one_at_a_time: Arc<tokio::sync::Mutex<()>>,
}

/// What a reload swapped in.
#[derive(Debug)]
pub struct Reloaded {
    /// SHA-256 of the file now serving, hex.
    pub sha256: String,
    pub routes: usize,
    /// What `Config::warnings` says of the new config.
    pub warnings: Vec<String>,
}

/// Why a reload was refused; the old config keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("the new config is invalid")]
    Invalid(#[source] ConfigError),
    #[error("{} cannot change without a restart", .0.join(", "))]
    NeedsRestart(Vec<&'static str>),
    #[error("a worker could not build the new routes")]
    Worker(#[source] rustls::Error),
    #[error("a worker thread has stopped")]
    WorkerGone,
    #[error("[store.previous] cannot be used")]
    Previous(#[source] crate::error::StoreError),
}

impl ReloadError {
    fn result(&self) -> ReloadResult {
        match self {
            ReloadError::Invalid(_) => ReloadResult::Invalid,
            ReloadError::NeedsRestart(_) => ReloadResult::Refused,
            ReloadError::Worker(_) | ReloadError::WorkerGone | ReloadError::Previous(_) => ReloadResult::Failed,
        }
    }
}

impl Reloader {
    /// Reads the config at `path` and, unless it is refused, serves it from now on.
    /// Counted in `idemproxy_config_reloads_total{result}`.
    pub async fn reload(&self, path: &Path) -> Result<Reloaded, ReloadError> {
        let _one = self.one_at_a_time.lock().await;
        let result = self.swap(path).await;
        let counted = match &result {
            Ok(_) => ReloadResult::Ok,
            Err(error) => error.result(),
        };
        self.metrics.config_reloaded(counted);
        result
    }

    async fn swap(&self, path: &Path) -> Result<Reloaded, ReloadError> {
        let new = Arc::new(Config::load(path).map_err(ReloadError::Invalid)?);
        let old = self.live.load_full();
        let changed = old.needs_restart(&new);
        if !changed.is_empty() {
            return Err(ReloadError::NeedsRestart(changed));
        }
        // A `[store.previous]` whose handle cannot be made (its TLS files) is refused
        // here, before any worker swaps: a worker then never loses the one it reads.
        if let Some(previous) = &new.store.previous {
            crate::store::previous(previous).map_err(ReloadError::Previous)?;
        }
        // Every worker builds its routes first and swaps them when built. A failure
        // here is one no start-up could have passed (the routes' TLS is validated
        // with the config): it is reported, and the workers that did swap serve the
        // new routes, as the next successful reload will make all of them do.
        let mut answers = Vec::with_capacity(self.workers.len());
        for worker in &self.workers {
            let (done, answer) = oneshot::channel();
            let reload = WorkerReload {
                config: new.clone(),
                done,
            };
            worker.send(reload).map_err(|_| ReloadError::WorkerGone)?;
            answers.push(answer);
        }
        for answer in answers {
            answer
                .await
                .map_err(|_| ReloadError::WorkerGone)?
                .map_err(ReloadError::Worker)?;
        }
        if let (Some(swap), Some(tls)) = (&self.tls, &new.server.tls) {
            swap.store(tls.config.clone());
        }
        self.live.store(new.clone());
        self.metrics.config_loaded(&old.sha256, &new.sha256);
        Ok(Reloaded {
            sha256: new.sha256.clone(),
            routes: new.routes.len(),
            warnings: new.warnings(),
        })
    }
}
