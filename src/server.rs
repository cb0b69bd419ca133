//! The process: one worker thread per core, each with its own single-threaded runtime
//! serving its own listening socket (`listen`), the admin listener on the caller's
//! runtime, and the handle (`Running`) that reloads and stops them.
//!
//! Every task and thread that outlives the call that starts it, where it is started,
//! and what stops it (a test holds every file that spawns one to this list):
//! - a worker thread (`server.rs`): its accept loop stops at shutdown; its runtime then
//!   drains the connections and waits for its exchanges, and ends.
//! - a client connection (a task of its worker, `server.rs`): asked to close at
//!   shutdown, dropped at `shutdown_grace`; it also closes when idle past
//!   `header_read_timeout`.
//! - an exchange and a background store write (the worker's `TaskTracker`): they write
//!   to the store, so shutdown waits for them, within `shutdown_grace`, after the
//!   connections; a background write also stops when its record has expired.
//! - a worker's reload listener, and its one-shot script warm-up and resumption of
//!   unsettled records (`server.rs`): end with the worker's runtime.
//! - the task that waits for the workers to stop (`server.rs`): ends once they have,
//!   after stopping the store's background work.
//! - an upstream connection (the pool's task, `upstream/pool.rs`): ends when the
//!   connection closes, or with the worker's runtime.
//! - the admin listener (the caller's runtime, `server.rs`): stops at shutdown and
//!   drains like a worker's.
//! - the memory store's sweeper (`store/memory.rs`): ends when the last handle on the
//!   store is dropped.
//! - the SQLite store's writer and checkpointer threads (`idemproxy-sqlite-writer`,
//!   `idemproxy-checkpoints`; `store/sqlite/writer.rs`): the writer ends when the last
//!   handle on the store is dropped (its job queue closes), after committing what was
//!   asked; the checkpointer ends when the writer does, and the writer's connection,
//!   closed last, checkpoints the log. A test's hold on the writer (`store/sqlite.rs`,
//!   `test-util` only) ends when the test releases it.
//! - the Redis subscriber and the Postgres listener (`store/redis/subscriber.rs`,
//!   `store/postgres/listen.rs`, each running the loop in `store/notify.rs`): end when
//!   the last watcher is dropped (their command channel closes). The listener's
//!   connection task ends with its connection.
//! - the Postgres sweeper (`store/postgres/sweep.rs`, run by `store::Background`):
//!   stopped by the task that waits for the workers, once they have stopped.
//! - a Postgres connection's task (`store/postgres/connect.rs`): ends when its client
//!   (a pool's, the sweeper's) is dropped or the server closes it.
//! - a chain of reconciliation probes (one per unknown record, on the worker that
//!   marked it or found it due; `proxy/reconcile.rs`): not tracked for shutdown, since
//!   a chain may wait minutes between probes. It ends when the record is resolved,
//!   another instance holds its probe lease, the probe gives up, or its schedule is
//!   past; at shutdown it ends with its worker's runtime, and its probe lease runs out
//!   for another instance (or this one, restarted) to take over.
//! - the trace export thread (`idemproxy-trace`, only with `[tracing]`;
//!   `trace/export.rs`): the binary shuts it down after the proxy stops, sending what
//!   is queued within 3 s.
//! - the binary's SIGHUP reloader and its shutdown signal task (`main.rs`): end with
//!   the binary's runtime, once the proxy has stopped.
//! - the CLI's connection to the admin listener (`records.rs`, `idemproxy records`):
//!   ends with its one exchange.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::Request;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::body::ClientInfo;
use crate::bounds::GuardedRequests;
use crate::config::Config;
use crate::error::StoreError;
use crate::metrics::Metrics;
use crate::proxy::{Probes, Proxy, Waiting};
use crate::store::notify::Watcher;
use crate::store::{self, StoreFactory};
use crate::store::{AnyStore, RecordStore};

use self::listen::{ADMIN_CONNECTIONS, Limits, Listening, Seat, Spread, bind, bind_workers, serve};
use self::reload::WorkerReload;
pub use self::reload::{ReloadError, Reloaded, Reloader};

mod limits;
mod listen;
mod reload;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up the store")]
    Store(#[source] StoreError),
    #[error("cannot start a worker runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot start a worker thread")]
    Spawn(#[source] std::io::Error),
    #[error("cannot set up TLS for upstream connections")]
    UpstreamTls(#[source] rustls::Error),
    #[error("a worker thread stopped while starting")]
    Worker,
}

/// A running proxy: its bound addresses, and the handle that stops it.
pub struct Running {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    #[cfg(feature = "test-util")]
    store: AnyStore,
    shutdown: CancellationToken,
    reloader: Reloader,
    done: tokio::task::JoinHandle<()>,
}

impl Running {
    /// The handle that reloads the config (what SIGHUP does).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// Stops accepting, lets open requests finish within `shutdown_grace`, and returns
    /// when everything has stopped.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.done.await;
    }

    /// Resolves when the proxy has stopped.
    pub async fn stopped(self) {
        let _ = self.done.await;
    }

    /// A token that stops the proxy when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// A handle on the store (the shared one, for the memory backend).
    #[cfg(feature = "test-util")]
    pub fn store(&self) -> &AnyStore {
        &self.store
    }
}

/// Binds the listeners and starts serving: one worker thread per core (or
/// `server.workers`), each with its own single-threaded runtime, its own listening
/// socket (see `bind_workers`), its own upstream connection pool and its own store
/// connection, as nginx runs one worker process per core. Requests never hop between
/// threads. Must be called inside a Tokio runtime, which runs the admin
/// listener, the memory store's sweeper and the Redis subscriber.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let opened = store::open(&config.store).await.map_err(StartError::Store)?;
    launch(config, opened).await
}

/// Like `start`, with stores made by `factory` instead of from `config.store`. Its
/// waiters get no notifications: they re-read at their deadlines.
#[cfg(feature = "test-util")]
pub async fn start_with_store(config: Config, factory: StoreFactory) -> Result<Running, StartError> {
    let opened = store::Opened {
        factory,
        watcher: Watcher::None,
        background: store::Background::default(),
    };
    launch(config, opened).await
}

/// What every worker and the admin listener share: the metrics, the shutdown signal,
/// the listener limits and the process-wide bounds (connections, guarded requests,
/// waiters), and the listener's TLS configuration, which reload swaps.
#[derive(Clone)]
struct Process {
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    limits: Limits,
    connections: Arc<Semaphore>,
    guarded: GuardedRequests,
    waiting: Waiting,
    probes: Probes,
    tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    /// The open-files limit before and after the start raised it.
    open_files: Option<limits::OpenFiles>,
    /// The client connections the process holds at once.
    capacity: usize,
}

impl Process {
    /// The shared state for `config`; the connection bound is what the open-files
    /// limit (raised here to its hard limit) can hold of `max_connections`.
    fn new(config: &Config, watcher: Watcher, store: &AnyStore) -> Process {
        let open_files = limits::raise_open_files_limit();
        let capacity = limits::capacity(config.server.max_connections, open_files);
        if capacity < config.server.max_connections {
            tracing::warn!(
                max_connections = config.server.max_connections,
                open_files = open_files.map_or(0, |files| files.after),
                capacity,
                "the open-files limit holds fewer connections than server.max_connections"
            );
        }
        let mut metrics = Metrics::new();
        if let Some(stats) = store.commit_figures() {
            metrics.register_commits(stats);
        }
        Process {
            metrics: Arc::new(metrics),
            shutdown: CancellationToken::new(),
            limits: Limits {
                header_read_timeout: config.server.header_read_timeout,
                grace: config.server.shutdown_grace,
            },
            connections: Arc::new(Semaphore::new(capacity)),
            guarded: GuardedRequests::new(config.server.max_guarded_requests, config.server.max_buffered_bytes),
            waiting: Waiting::new(watcher, config.server.max_waiters),
            probes: Probes::default(),
            tls: config
                .server
                .tls
                .as_ref()
                .map(|tls| Arc::new(ArcSwap::new(tls.config.clone()))),
            open_files,
            capacity,
        }
    }

    fn listening(&self) -> Listening {
        Listening {
            limits: self.limits,
            connections: self.connections.clone(),
            tls: self.tls.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// Binds, starts the workers, then the admin listener; a failure on the way stops
/// what has started.
async fn launch(config: Config, opened: store::Opened) -> Result<Running, StartError> {
    let store = (opened.factory)().map_err(StartError::Store)?;
    let process = Process::new(&config, opened.watcher, &store);
    // A memory store is one process's: a second instance must not share its port.
    let (addr, listeners) = bind_workers(config.server.listen, config.server.workers, store.shared_by_instances())?;
    let config = Arc::new(config);
    let live = Arc::new(ArcSwap::new(config.clone()));
    process.metrics.config_loaded(&config.sha256, &config.sha256);
    let seats = Spread::seats(listeners.len(), &process.metrics);
    let started = start_workers(&process, &config, &opened.factory, listeners.into_iter().zip(seats)).await;
    let (mut stopped, reloads) = started.inspect_err(|_| process.shutdown.cancel())?;
    let admin_addr = match &config.admin {
        None => None,
        Some(admin) => {
            let service = Admin::new(
                store.clone(),
                process.metrics.clone(),
                live.clone(),
                process.guarded.clone(),
            );
            let (admin_addr, done) = start_admin(admin.listen, service, &process)
                .await
                .inspect_err(|_| process.shutdown.cancel())?;
            stopped.push(done);
            Some(admin_addr)
        }
    };
    tracing::info!(
        %addr,
        connections = process.capacity,
        open_files_limit = process.open_files.map(|files| files.after),
        open_files_limit_was = process.open_files.map(|files| files.before),
        admin = %admin_addr.map_or_else(|| "off".to_string(), |a| a.to_string()),
        store = config.store.backend.name(),
        workers = config.server.workers,
        routes = config.routes.len(),
        "idemproxy listening"
    );
    Ok(Running {
        addr,
        admin_addr,
        #[cfg(feature = "test-util")]
        store,
        shutdown: process.shutdown.clone(),
        reloader: Reloader {
            live,
            workers: reloads,
            tls: process.tls.clone(),
            metrics: process.metrics.clone(),
            one_at_a_time: Arc::default(),
        },
        done: tokio::spawn(async move {
            for done in stopped {
                let _ = done.await;
            }
            opened.background.stop().await;
        }),
    })
}

/// Starts a worker on each of `listeners`, one by one, so that a worker's start-up
/// error stops the start: what says when each has stopped, and each one's reloads.
async fn start_workers(
    process: &Process,
    config: &Arc<Config>,
    factory: &StoreFactory,
    listeners: impl ExactSizeIterator<Item = (std::net::TcpListener, Seat)>,
) -> Result<(Vec<oneshot::Receiver<()>>, Vec<mpsc::UnboundedSender<WorkerReload>>), StartError> {
    let mut stopped = Vec::with_capacity(listeners.len() + 1);
    let mut reloads = Vec::with_capacity(listeners.len());
    for (index, (listener, seat)) in listeners.enumerate() {
        let (reload, reloaded) = mpsc::unbounded_channel();
        reloads.push(reload);
        let worker = Worker {
            config: config.clone(),
            factory: factory.clone(),
            process: process.clone(),
            reloads: reloaded,
        };
        stopped.push(worker.start(index, listener, seat).await?);
    }
    Ok((stopped, reloads))
}

/// Serves the admin endpoints on the caller's runtime until shutdown; the receiver
/// answers when it has stopped.
async fn start_admin(
    addr: SocketAddr,
    admin: Admin,
    process: &Process,
) -> Result<(SocketAddr, oneshot::Receiver<()>), StartError> {
    let (listener, bound) = bind(addr).await?;
    let service = move |request: Request<Incoming>, _: ClientInfo| {
        let admin = admin.clone();
        async move { Ok::<_, Infallible>(admin.handle(request).await) }
    };
    let (finished, done) = oneshot::channel();
    let listening = Listening {
        connections: Arc::new(Semaphore::new(ADMIN_CONNECTIONS)),
        tls: None,
        ..process.listening()
    };
    let shutdown = process.shutdown.clone();
    tokio::spawn(async move {
        serve(listener, listening, shutdown, service, None).await;
        let _ = finished.send(());
    });
    Ok((bound, done))
}

/// What one worker thread needs.
struct Worker {
    config: Arc<Config>,
    factory: StoreFactory,
    process: Process,
    /// Reloads for this worker's routes.
    reloads: mpsc::UnboundedReceiver<WorkerReload>,
}

impl Worker {
    /// Starts the worker's thread and waits until it serves, so that its start-up
    /// errors surface here; the receiver answers when the thread has stopped.
    async fn start(
        self,
        index: usize,
        listener: std::net::TcpListener,
        seat: Seat,
    ) -> Result<oneshot::Receiver<()>, StartError> {
        let (started, ready) = oneshot::channel();
        let (finished, done) = oneshot::channel();
        std::thread::Builder::new()
            .name(format!("idemproxy-worker-{index}"))
            .spawn(move || {
                self.run(listener, seat, started, index == 0);
                let _ = finished.send(());
            })
            .map_err(StartError::Spawn)?;
        match ready.await {
            Ok(Ok(())) => Ok(done),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(StartError::Worker),
        }
    }

    /// Runs on the worker's own thread: sets up, says whether that worked, serves
    /// until shutdown, then drains. The `first` worker also schedules the probes the last run left (see
    /// `Proxy::resume_unsettled`).
    fn run(
        self,
        listener: std::net::TcpListener,
        seat: Seat,
        started: oneshot::Sender<Result<(), StartError>>,
        first: bool,
    ) {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(source) => {
                let _ = started.send(Err(StartError::Runtime(source)));
                return;
            }
        };
        runtime.block_on(async move {
            let tasks = TaskTracker::new();
            let (listener, proxy) = match self.setup(listener, &tasks) {
                Ok(ready) => ready,
                Err(error) => {
                    let _ = started.send(Err(error));
                    return;
                }
            };
            let _ = started.send(Ok(()));
            if first {
                let resuming = proxy.clone();
                tokio::spawn(async move { resuming.resume_unsettled().await });
            }
            tokio::spawn(reload_on(self.reloads, proxy.clone()));
            let service = move |request: Request<Incoming>, client: ClientInfo| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(proxy.handle(request, client).await) }
            };
            let grace = self.process.limits.grace;
            serve(
                listener,
                self.process.listening(),
                self.process.shutdown.clone(),
                service,
                Some(seat),
            )
            .await;
            // Connections are drained; let exchanges and background store writes finish.
            tasks.close();
            if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
                tracing::warn!(left = tasks.len(), "shutdown grace over; abandoning background work");
            }
        });
    }

    /// On the worker's runtime: its store handle (warmed up in the background), its
    /// listener, and its proxy (its exchanges tracked by `tasks`).
    fn setup(&self, listener: std::net::TcpListener, tasks: &TaskTracker) -> Result<(TcpListener, Proxy), StartError> {
        let store = (self.factory)().map_err(StartError::Store)?;
        let warming = store.clone();
        tokio::spawn(async move { warming.warm_up().await });
        let listener = TcpListener::from_std(listener).map_err(|source| StartError::Bind {
            addr: self.config.server.listen,
            source,
        })?;
        let process = &self.process;
        let previous = crate::proxy::PreviousStore::open(&self.config).map_err(StartError::Store)?;
        let proxy = Proxy::new(
            &self.config,
            crate::proxy::Stores { store, previous },
            process.metrics.clone(),
            process.guarded.clone(),
            process.waiting.clone(),
            process.probes.clone(),
            tasks.clone(),
        )
        .map_err(StartError::UpstreamTls)?;
        Ok((listener, proxy))
    }
}

/// Swaps in each config a reload sends this worker, until the reloader is gone.
async fn reload_on(mut reloads: mpsc::UnboundedReceiver<WorkerReload>, proxy: Proxy) {
    while let Some(reload) = reloads.recv().await {
        let _ = reload.done.send(proxy.reload(&reload.config));
    }
}
