//! The listeners: one worker thread per core, each accepting on its own listening
//! socket and serving HTTP/1 and HTTP/2 through hyper-util's auto builder with a
//! header-read timer, then draining on shutdown. The admin listener shares the accept
//! loop; neither knows what the other serves.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::body::{ClientInfo, ProxyBody};
use crate::config::Config;
use crate::error::StoreError;
use crate::metrics::Metrics;
use crate::proxy::{GuardedRequests, Proxy, Waiting};
#[cfg(feature = "test-util")]
use crate::store::AnyStore;
use crate::store::notify::Watcher;
use crate::store::{self, StoreFactory};

use self::limits::{Activity, Backoff};
use self::reload::WorkerReload;
pub use self::reload::{ReloadError, Reloaded, Reloader};

mod limits;
mod reload;

/// How long an idle connection asked to close may take to do so before it is dropped.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);
/// The connections the admin listener holds at once.
const ADMIN_CONNECTIONS: usize = 64;

/// hyper's HTTP/1 read buffer, which bounds the request head; a larger head gets 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most header fields a request may carry; more get 431.
const MAX_HEADERS: usize = 100;
/// The HTTP/2 streams one connection may have open at once.
const MAX_STREAMS: u32 = 128;
/// HTTP/2 streams reset by the client before being served, at once, before the
/// connection is closed with ENHANCE_YOUR_CALM.
const MAX_PENDING_RESETS: usize = 20;

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
/// listener and the memory store's sweeper.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let (factory, watcher) = store::open(&config.store).map_err(StartError::Store)?;
    launch(config, factory, watcher).await
}

/// Like `start`, with stores made by `factory` instead of from `config.store`. Its
/// waiters get no notifications: they re-read at their deadlines.
#[cfg(feature = "test-util")]
pub async fn start_with_store(config: Config, factory: StoreFactory) -> Result<Running, StartError> {
    launch(config, factory, Watcher::None).await
}

/// Binds, starts the workers one by one (so that a worker's start-up error stops the
/// start), then the admin listener.
async fn launch(config: Config, factory: StoreFactory, watcher: Watcher) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let shutdown = CancellationToken::new();
    let limits = Limits {
        header_read_timeout: config.server.header_read_timeout,
        grace: config.server.shutdown_grace,
    };
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
    let connections = Arc::new(Semaphore::new(capacity));
    let guarded = GuardedRequests::new(config.server.max_guarded_requests);
    let waiting = Waiting::new(watcher, config.server.max_waiters);
    let store = factory().map_err(StartError::Store)?;
    // A memory store is one process's: a second instance must not share its port.
    let share_port = store.shared_by_instances();
    let (addr, listeners) = bind_workers(config.server.listen, config.server.workers, share_port)?;

    let config = Arc::new(config);
    let live = Arc::new(ArcSwap::new(config.clone()));
    metrics.config_loaded(&config.sha256, &config.sha256);
    let tls = config
        .server
        .tls
        .as_ref()
        .map(|tls| Arc::new(ArcSwap::new(tls.config.clone())));
    let mut stopped = Vec::with_capacity(listeners.len() + 1);
    let mut reloads = Vec::with_capacity(listeners.len());
    for (index, listener) in listeners.into_iter().enumerate() {
        let (reload, reloaded) = mpsc::unbounded_channel();
        reloads.push(reload);
        let worker = Worker {
            config: config.clone(),
            factory: factory.clone(),
            metrics: metrics.clone(),
            shutdown: shutdown.clone(),
            limits,
            connections: connections.clone(),
            guarded: guarded.clone(),
            waiting: waiting.clone(),
            tls: tls.clone(),
            reloads: reloaded,
        };
        match worker.start(index, listener).await {
            Ok(done) => stopped.push(done),
            Err(error) => {
                shutdown.cancel();
                return Err(error);
            }
        }
    }
    let admin_addr = match &config.admin {
        Some(admin) => {
            let service = Admin::new(store.clone(), metrics.clone(), live.clone(), guarded);
            let (admin_addr, done) =
                start_admin(admin.listen, service, limits, metrics.clone(), shutdown.clone()).await?;
            stopped.push(done);
            Some(admin_addr)
        }
        None => None,
    };
    tracing::info!(
        %addr,
        connections = capacity,
        open_files_limit = open_files.map(|files| files.after),
        open_files_limit_was = open_files.map(|files| files.before),
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
        shutdown,
        reloader: Reloader {
            live,
            workers: reloads,
            tls,
            metrics,
            one_at_a_time: Arc::default(),
        },
        done: tokio::spawn(async move {
            for done in stopped {
                let _ = done.await;
            }
        }),
    })
}

/// Serves the admin endpoints on the caller's runtime until shutdown; the receiver
/// answers when it has stopped.
async fn start_admin(
    addr: SocketAddr,
    admin: Admin,
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, oneshot::Receiver<()>), StartError> {
    let (listener, bound) = bind(addr).await?;
    let service = move |request: Request<Incoming>, _: ClientInfo| {
        let admin = admin.clone();
        async move { Ok::<_, Infallible>(admin.handle(request).await) }
    };
    let (finished, done) = oneshot::channel();
    let listening = Listening {
        limits,
        connections: Arc::new(Semaphore::new(ADMIN_CONNECTIONS)),
        tls: None,
        metrics,
    };
    tokio::spawn(async move {
        serve(listener, listening, shutdown, service).await;
        let _ = finished.send(());
    });
    Ok((bound, done))
}

/// What one worker thread needs.
struct Worker {
    config: Arc<Config>,
    factory: StoreFactory,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    limits: Limits,
    /// The process's connection permits, shared by every worker.
    connections: Arc<Semaphore>,
    /// The process's guarded-request permits, shared by every worker.
    guarded: GuardedRequests,
    /// The process's waiters, shared by every worker.
    waiting: Waiting,
    /// The listener's TLS configuration, shared by every worker and swapped on reload.
    tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    /// Reloads for this worker's routes.
    reloads: mpsc::UnboundedReceiver<WorkerReload>,
}

impl Worker {
    /// Starts the worker's thread and waits until it serves, so that its start-up
    /// errors surface here; the receiver answers when the thread has stopped.
    async fn start(self, index: usize, listener: std::net::TcpListener) -> Result<oneshot::Receiver<()>, StartError> {
        let (started, ready) = oneshot::channel();
        let (finished, done) = oneshot::channel();
        std::thread::Builder::new()
            .name(format!("idemproxy-worker-{index}"))
            .spawn(move || {
                self.run(listener, started);
                let _ = finished.send(());
            })
            .map_err(StartError::Spawn)?;
        match ready.await {
            Ok(Ok(())) => Ok(done),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(StartError::Worker),
        }
    }

    /// Runs on the worker's own thread until shutdown, then drains.
    fn run(self, listener: std::net::TcpListener, started: oneshot::Sender<Result<(), StartError>>) {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(source) => {
                let _ = started.send(Err(StartError::Runtime(source)));
                return;
            }
        };
        runtime.block_on(async move {
            let store = match (self.factory)() {
                Ok(store) => store,
                Err(error) => {
                    let _ = started.send(Err(StartError::Store(error)));
                    return;
                }
            };
            let warming = store.clone();
            tokio::spawn(async move { warming.warm_up().await });
            let listener = match TcpListener::from_std(listener) {
                Ok(listener) => listener,
                Err(source) => {
                    let _ = started.send(Err(StartError::Bind {
                        addr: self.config.server.listen,
                        source,
                    }));
                    return;
                }
            };
            let tasks = TaskTracker::new();
            let proxy = match Proxy::new(
                &self.config,
                store,
                self.metrics.clone(),
                self.guarded,
                self.waiting,
                tasks.clone(),
            ) {
                Ok(proxy) => proxy,
                Err(error) => {
                    let _ = started.send(Err(StartError::UpstreamTls(error)));
                    return;
                }
            };
            let _ = started.send(Ok(()));
            let reloading = proxy.clone();
            let mut reloads = self.reloads;
            tokio::spawn(async move {
                while let Some(reload) = reloads.recv().await {
                    let _ = reload.done.send(reloading.reload(&reload.config));
                }
            });
            let service = move |request: Request<Incoming>, client: ClientInfo| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(proxy.handle(request, client).await) }
            };
            let listening = Listening {
                limits: self.limits,
                connections: self.connections,
                tls: self.tls,
                metrics: self.metrics.clone(),
            };
            serve(listener, listening, self.shutdown, service).await;
            // Connections are drained; let exchanges and background store writes finish.
            tasks.close();
            if tokio::time::timeout(self.limits.grace, tasks.wait()).await.is_err() {
                tracing::warn!(left = tasks.len(), "shutdown grace over; abandoning background work");
            }
        });
    }
}

/// One listening socket per worker. With `share_port` (the Redis store), each has its
/// own socket with `SO_REUSEPORT`, and the kernel spreads new connections across them
/// (and across a second idemproxy on the same address, which is safe with a shared
/// store). Without it (the memory store), the workers share one socket, so a second
/// instance fails to start instead of splitting traffic over two separate stores.
/// Port 0 is resolved by the first socket, whose address is returned.
fn bind_workers(
    addr: SocketAddr,
    count: usize,
    share_port: bool,
) -> Result<(SocketAddr, Vec<std::net::TcpListener>), StartError> {
    let error = |source| StartError::Bind { addr, source };
    let open = |bound: SocketAddr| -> Result<std::net::TcpListener, StartError> {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .map_err(error)?;
        socket.set_reuseaddr(true).map_err(error)?;
        socket.set_reuseport(share_port).map_err(error)?;
        socket.set_nodelay(true).map_err(error)?;
        socket.bind(bound).map_err(error)?;
        socket.listen(4096).map_err(error)?.into_std().map_err(error)
    };
    let first = open(addr)?;
    let bound = first.local_addr().map_err(error)?;
    let mut listeners = Vec::with_capacity(count.max(1));
    for _ in 1..count.max(1) {
        let listener = if share_port {
            open(bound)?
        } else {
            first.try_clone().map_err(error)?
        };
        listeners.push(listener);
    }
    listeners.insert(0, first);
    Ok((bound, listeners))
}

/// What a listener serves with: its limits, the connection permits it draws from, TLS
/// if it terminates TLS, and the metrics its handshakes are counted in.
#[derive(Clone)]
struct Listening {
    limits: Limits,
    connections: Arc<Semaphore>,
    /// The configuration each new connection's handshake takes (reload swaps it).
    tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    metrics: Arc<Metrics>,
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    header_read_timeout: Duration,
    grace: Duration,
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr, source })?;
    Ok((listener, local))
}

/// Accepts connections until `shutdown`, then drains them for up to `limits.grace`.
/// A connection is accepted only once one of `connections`' permits is free: at the
/// limit, new clients wait in the kernel's backlog, neither accepted nor refused.
async fn serve<S, F>(listener: TcpListener, listening: Listening, shutdown: CancellationToken, service: S)
where
    S: Fn(Request<Incoming>, ClientInfo) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let limits = listening.limits;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        // The same bound on a request head as HTTP/1's; it also bounds how many
        // CONTINUATION frames a header block may take.
        .max_header_list_size(MAX_HEAD_BYTES as u32)
        // Streams a client opens and resets before they are served (the "rapid
        // reset" of CVE-2023-44487): past this many at once, the connection is closed.
        .max_pending_accept_reset_streams(MAX_PENDING_RESETS);
    let builder = Arc::new(builder);
    let open = TaskTracker::new();
    let mut backoff = Backoff::new();
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            permit = listening.connections.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = limits::accept_with_backoff(&mut backoff, || listener.accept()) => accepted,
        };
        let connection = serve_connection(
            builder.clone(),
            stream,
            peer,
            listening.clone(),
            shutdown.clone(),
            service.clone(),
        );
        open.spawn(async move {
            connection.await;
            drop(permit);
        });
    }
    drop(listener);
    open.close();
    if tokio::time::timeout(limits.grace, open.wait()).await.is_err() {
        tracing::warn!(
            left = open.len(),
            "shutdown grace over; closing the remaining connections"
        );
    }
}

/// Serves one connection until the client closes it, it stays without a request for
/// `header_read_timeout` (from its accept, including a client that never sends a
/// byte, or from its last answer), or the server shuts down.
async fn serve_connection<S, F>(
    builder: Arc<auto::Builder<TokioExecutor>>,
    stream: TcpStream,
    peer: SocketAddr,
    listening: Listening,
    shutdown: CancellationToken,
    service: S,
) where
    S: Fn(Request<Incoming>, ClientInfo) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
    let limits = listening.limits;
    let activity = Activity::new();
    // The handshake is part of the time a connection has to send its request head.
    let stream = match &listening.tls {
        None => Either::Left(stream),
        Some(tls) => {
            let acceptor = TlsAcceptor::from(tls.load_full());
            let deadline = Instant::now() + limits.header_read_timeout;
            match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => Either::Right(tls),
                Ok(Err(error)) => {
                    listening.metrics.tls_handshake_failed();
                    tracing::debug!(%peer, %error, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    listening.metrics.tls_handshake_failed();
                    tracing::debug!(%peer, "TLS handshake not finished within header_read_timeout");
                    return;
                }
            }
        }
    };
    let client = ClientInfo::new(peer.ip(), listening.tls.is_some());
    let watched = activity.clone();
    let service = service_fn(move |request| {
        let in_flight = watched.request();
        let response = service(request, client.clone());
        async move {
            let response = response.await;
            drop(in_flight);
            response
        }
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let idle = activity.idle(limits.header_read_timeout);
    tokio::pin!(idle);
    // After asking the connection to close, how long it may take before it is dropped.
    let mut closing: Option<Instant> = None;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
                return;
            }
            () = shutdown.cancelled(), if closing.is_none() => {
                connection.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + limits.grace);
            }
            () = &mut idle, if closing.is_none() => {
                tracing::debug!(%peer, "closing a connection that sent no request in time");
                connection.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + IDLE_CLOSE_GRACE);
            }
            () = tokio::time::sleep_until(closing.unwrap_or_else(Instant::now)), if closing.is_some() => return,
        }
    }
}
