//! The listeners: accept connections, serve HTTP/1 and HTTP/2 through hyper-util's
//! auto builder with a header-read timer, and drain on shutdown. The proxy listener
//! and the admin listener share this accept loop; neither knows what the other serves.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::config::{Backend, Config};
use crate::error::StoreError;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::store::{AnyStore, MemoryStore, RedisStore};
use crate::upstream::{ClientInfo, ProxyBody};

/// hyper's HTTP/1 read buffer, which bounds the request head; a larger head gets 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most header fields a request may carry; more get 431.
const MAX_HEADERS: usize = 100;

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
}

/// A running proxy: its bound addresses, and the handle that stops it.
pub struct Running {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub proxy: Proxy,
    shutdown: CancellationToken,
    done: tokio::task::JoinHandle<()>,
}

impl Running {
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
}

/// Builds the configured store.
pub fn build_store(config: &Config) -> Result<AnyStore, StoreError> {
    Ok(match &config.store.backend {
        Backend::Memory { max_records } => AnyStore::Memory(MemoryStore::new(*max_records)),
        Backend::Redis { url } => AnyStore::Redis(RedisStore::new(url, config.store.timeout)?),
    })
}

/// Binds the listeners and starts serving. Must run inside a Tokio runtime.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let store = build_store(&config).map_err(StartError::Store)?;
    start_with_store(config, store).await
}

/// Like `start`, with a store built by the caller instead of from `config.store`.
pub async fn start_with_store(config: Config, store: AnyStore) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let tasks = TaskTracker::new();
    let proxy = Proxy::new(&config, store.clone(), metrics.clone(), tasks.clone());
    let shutdown = CancellationToken::new();
    let limits = Limits {
        header_read_timeout: config.server.header_read_timeout,
        grace: config.server.shutdown_grace,
    };

    let (listener, addr) = bind(config.server.listen).await?;
    let admin = match &config.admin {
        Some(admin) => Some(bind(admin.listen).await?),
        None => None,
    };
    let admin_addr = admin.as_ref().map(|(_, addr)| *addr);

    let mut servers = tokio::task::JoinSet::new();
    let service = {
        let proxy = proxy.clone();
        move |request: Request<Incoming>, client: ClientInfo| {
            let proxy = proxy.clone();
            async move { Ok::<_, Infallible>(proxy.handle(request, client).await) }
        }
    };
    servers.spawn(serve(listener, limits, shutdown.clone(), service));
    if let Some((listener, _)) = admin {
        let admin = Admin::new(store, metrics, config.store.timeout);
        let service = move |request: Request<Incoming>, _: ClientInfo| {
            let admin = admin.clone();
            async move { Ok::<_, Infallible>(admin.handle(request).await) }
        };
        servers.spawn(serve(listener, limits, shutdown.clone(), service));
    }
    let done = tokio::spawn(async move {
        while servers.join_next().await.is_some() {}
        // Connections are drained; let exchanges and background store writes finish.
        tasks.close();
        if tokio::time::timeout(limits.grace, tasks.wait()).await.is_err() {
            tracing::warn!(left = tasks.len(), "shutdown grace over; abandoning background work");
        }
    });
    tracing::info!(
        %addr,
        admin = %admin_addr.map_or_else(|| "off".to_string(), |a| a.to_string()),
        store = store_name(&config),
        routes = config.routes.len(),
        "idemproxy listening"
    );
    Ok(Running {
        addr,
        admin_addr,
        proxy,
        shutdown,
        done,
    })
}

fn store_name(config: &Config) -> &'static str {
    match config.store.backend {
        Backend::Memory { .. } => "memory",
        Backend::Redis { .. } => "redis",
    }
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
async fn serve<S, F>(listener: TcpListener, limits: Limits, shutdown: CancellationToken, service: S)
where
    S: Fn(Request<Incoming>, ClientInfo) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Usually EMFILE: back off briefly instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        serve_connection(&builder, &graceful, stream, peer, service.clone());
    }
    drop(listener);
    if tokio::time::timeout(limits.grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("shutdown grace over; closing the remaining connections");
    }
}

fn serve_connection<S, F>(
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    stream: TcpStream,
    peer: SocketAddr,
    service: S,
) where
    S: Fn(Request<Incoming>, ClientInfo) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
    let client = ClientInfo { addr: peer.ip() };
    let service = service_fn(move |request| service(request, client));
    let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
    let connection = graceful.watch(connection);
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%peer, error = %error, "connection ended with an error");
        }
    });
}
