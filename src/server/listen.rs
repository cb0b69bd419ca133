//! The listening sockets and the connections on them: binding (one socket per
//! worker, or one shared), the accept loop with its connection permits and back-off,
//! the TLS handshake, and serving HTTP/1 and HTTP/2 through hyper-util's auto builder
//! with a header-read timer, until the client leaves, the connection idles, or
//! shutdown drains it. It knows nothing of what the service behind it does.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::FutureExt as _;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::StartError;
use super::limits::{self, Activity, Backoff};
use crate::body::{ClientInfo, ProxyBody};
use crate::metrics::Metrics;

/// `response`, with `in_flight` held until it is ready. `map`, not an async block: a
/// block holds the future twice (as it was given, and as awaited), and hyper moves it
/// whole into each connection's slot (10,800 bytes against 5,632). In a generic function
/// because a closure over the concrete response type does not compile (its boxed
/// error's lifetime is not general enough).
fn counted<F: Future, G>(response: F, in_flight: G) -> impl Future<Output = F::Output> {
    response.map(move |ready| {
        drop(in_flight);
        ready
    })
}

/// How long an idle connection asked to close may take to do so before it is dropped.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);
/// The connections the admin listener holds at once.
pub(super) const ADMIN_CONNECTIONS: usize = 64;

/// hyper's HTTP/1 read buffer, which bounds the request head; a larger head gets 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most header fields a request may carry; more get 431.
const MAX_HEADERS: usize = 100;
/// The HTTP/2 streams one connection may have open at once.
const MAX_STREAMS: u32 = 128;
/// HTTP/2 streams reset by the client before being served, at once, before the
/// connection is closed with ENHANCE_YOUR_CALM.
const MAX_PENDING_RESETS: usize = 20;

/// One listening socket per worker. With `share_port` (the Redis store), each has its
/// own socket with `SO_REUSEPORT`, and the kernel spreads new connections across them
/// (and across a second idemproxy on the same address, which is safe with a shared
/// store). Without it (the memory store), the workers share one socket, so a second
/// instance fails to start instead of splitting traffic over two separate stores.
/// Port 0 is resolved by the first socket, whose address is returned.
pub(super) fn bind_workers(
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

/// How the workers share the client connections (docs/design.md §7): each connection a worker accepts
/// is served by the worker serving fewest at that moment (the one that accepted it on
/// a tie), handed over to it when that is another. Without it, whichever worker the
/// kernel woke first took every connection a burst of clients opened (the workers of
/// an embedded store share one socket, and `SO_REUSEPORT` spreads by a hash of the
/// client's address, not by load): a benchmark's 32 connections all went to one
/// worker, and the process ran on one core of two. The counts are the
/// `idemproxy_worker_connections` gauges.
pub(super) struct Spread {
    open: Box<[Gauge]>,
    inboxes: Box<[mpsc::UnboundedSender<Handed>]>,
}

/// One worker's place in the spread: its index, and the connections handed to it.
pub(super) struct Seat {
    index: usize,
    spread: Arc<Spread>,
    inbox: mpsc::UnboundedReceiver<Handed>,
}

/// A connection accepted by one worker for another to serve, with its permit and its
/// count in the serving worker's gauge.
pub(super) struct Handed {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
    open: Open,
}

/// A connection counted in its worker's gauge until it is dropped.
struct Open(Gauge);

impl Open {
    fn new(gauge: &Gauge) -> Open {
        gauge.inc();
        Open(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Spread {
    /// The spread over `workers` workers, and each worker's seat in it.
    pub(super) fn seats(workers: usize, metrics: &Metrics) -> Vec<Seat> {
        let (inboxes, receivers): (Vec<_>, Vec<_>) = (0..workers).map(|_| mpsc::unbounded_channel()).unzip();
        let spread = Arc::new(Spread {
            open: (0..workers).map(|index| metrics.worker_connections(index)).collect(),
            inboxes: inboxes.into_boxed_slice(),
        });
        receivers
            .into_iter()
            .enumerate()
            .map(|(index, inbox)| Seat {
                index,
                spread: spread.clone(),
                inbox,
            })
            .collect()
    }
}

impl Seat {
    /// The worker to serve a new connection: the one serving fewest, this one on a tie.
    fn choose(&self) -> usize {
        let open = &self.spread.open;
        let here = open[self.index].get();
        open.iter()
            .enumerate()
            .min_by_key(|(_, gauge)| gauge.get())
            .filter(|(_, gauge)| gauge.get() < here)
            .map_or(self.index, |(index, _)| index)
    }

    /// Counts `stream` to the worker that is to serve it; hands it over when that is
    /// another, else gives it back to be served here. A connection that cannot be
    /// handed over (the other worker has stopped, at shutdown) is served here.
    fn place(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        permit: OwnedSemaphorePermit,
    ) -> Option<(TcpStream, OwnedSemaphorePermit, Open)> {
        let (target, here) = (self.choose(), &self.spread.open[self.index]);
        if target == self.index {
            return Some((stream, permit, Open::new(here)));
        }
        let stream = stream
            .into_std()
            .inspect_err(|error| tracing::debug!(%peer, %error, "cannot hand a connection to another worker"))
            .ok()?;
        let handed = Handed {
            stream,
            peer,
            permit,
            open: Open::new(&self.spread.open[target]),
        };
        let Err(mpsc::error::SendError(back)) = self.spread.inboxes[target].send(handed) else {
            return None;
        };
        // The other worker has stopped: its count is given back as `back.open` drops.
        let stream = TcpStream::from_std(back.stream)
            .inspect_err(|error| tracing::debug!(%peer, %error, "cannot serve a connection"))
            .ok()?;
        Some((stream, back.permit, Open::new(here)))
    }
}

/// The next connection handed to `seat`'s worker; never, without a seat.
async fn handed(seat: &mut Option<Seat>) -> Handed {
    match seat {
        Some(seat) => match seat.inbox.recv().await {
            Some(handed) => handed,
            // Every seat holds the spread, and so a sender of its own inbox.
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// What a listener serves with: its limits, the connection permits it draws from, TLS
/// if it terminates TLS, and the metrics its handshakes are counted in.
#[derive(Clone)]
pub(super) struct Listening {
    pub(super) limits: Limits,
    pub(super) connections: Arc<Semaphore>,
    /// The configuration each new connection's handshake takes (reload swaps it).
    pub(super) tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    pub(super) metrics: Arc<Metrics>,
}

/// How long a connection may go without a request, and how long shutdown waits.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) header_read_timeout: Duration,
    pub(super) grace: Duration,
}

pub(super) async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr, source })?;
    Ok((listener, local))
}

/// The HTTP/1 and HTTP/2 server settings every connection is served with: the
/// header-read timer, and the bounds on a request head and on HTTP/2 streams.
fn http_builder(limits: Limits) -> auto::Builder<TokioExecutor> {
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
    builder
}

/// Accepts connections until `shutdown`, then drains them for up to `limits.grace`.
/// With a `seat` (a worker's), each connection is served by the worker serving fewest,
/// and the connections other workers hand to this one are served too.
/// A connection is served with one of `connections`' permits, shared by every worker,
/// and taken only once it is accepted: an idle worker holds none, so while fewer than
/// the limit are open no connection waits, whichever worker's socket it came to. At
/// the limit, the worker holds the connection it accepted until a permit frees, and new
/// clients wait in the kernel's backlog, neither served nor refused.
pub(super) async fn serve<S, F>(
    listener: TcpListener,
    listening: Listening,
    shutdown: CancellationToken,
    service: S,
    mut seat: Option<Seat>,
) where
    S: Fn(Request<Incoming>, ClientInfo) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let limits = listening.limits;
    let builder = Arc::new(http_builder(limits));
    let open = TaskTracker::new();
    let mut backoff = Backoff::new();
    loop {
        let (stream, peer, permit, counted) =
            match next(&listener, &listening, &shutdown, &mut backoff, &mut seat).await {
                Next::Serve(stream, peer, permit, counted) => (stream, peer, permit, counted),
                Next::Elsewhere => continue,
                Next::Stop => break,
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
            drop((permit, counted));
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

/// What the accept loop does next.
enum Next {
    /// Serve this connection here, with its permit (and its count, with a seat).
    Serve(TcpStream, SocketAddr, OwnedSemaphorePermit, Option<Open>),
    /// The connection was handed to another worker, or could not be served.
    Elsewhere,
    /// Shutdown.
    Stop,
}

/// The next connection to serve here: one accepted (once a permit is free) that this
/// worker is to serve, or one another worker handed over.
async fn next(
    listener: &TcpListener,
    listening: &Listening,
    shutdown: &CancellationToken,
    backoff: &mut Backoff,
    seat: &mut Option<Seat>,
) -> Next {
    tokio::select! {
        () = shutdown.cancelled() => Next::Stop,
        accepted = limits::accept_with_backoff(backoff, || listener.accept()) => {
            let (stream, peer) = accepted;
            let permit = match listening.connections.clone().try_acquire_owned() {
                Ok(permit) => permit,
                Err(_) => tokio::select! {
                    () = shutdown.cancelled() => return Next::Stop,
                    permit = listening.connections.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => return Next::Stop,
                    },
                },
            };
            match seat {
                None => Next::Serve(stream, peer, permit, None),
                Some(seat) => match seat.place(stream, peer, permit) {
                    Some((stream, permit, counted)) => Next::Serve(stream, peer, permit, Some(counted)),
                    None => Next::Elsewhere,
                },
            }
        }
        handed = handed(seat) => match TcpStream::from_std(handed.stream) {
            Ok(stream) => Next::Serve(stream, handed.peer, handed.permit, Some(handed.open)),
            Err(error) => {
                tracing::debug!(peer = %handed.peer, %error, "cannot serve a connection handed over");
                Next::Elsewhere
            }
        },
    }
}

/// The connection as it is served: plain, or once its TLS handshake is done within
/// `header_read_timeout` (part of the time a connection has to send its request head).
/// `None` when the handshake failed or took too long, which is counted.
async fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    listening: &Listening,
) -> Option<Either<TcpStream, tokio_rustls::server::TlsStream<TcpStream>>> {
    let Some(tls) = &listening.tls else {
        return Some(Either::Left(stream));
    };
    let acceptor = TlsAcceptor::from(tls.load_full());
    let deadline = Instant::now() + listening.limits.header_read_timeout;
    match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => Some(Either::Right(tls)),
        Ok(Err(error)) => {
            listening.metrics.tls_handshake_failed();
            tracing::debug!(%peer, %error, "TLS handshake failed");
            None
        }
        Err(_) => {
            listening.metrics.tls_handshake_failed();
            tracing::debug!(%peer, "TLS handshake not finished within header_read_timeout");
            None
        }
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
    let Some(stream) = handshake(stream, peer, &listening).await else {
        return;
    };
    let client = ClientInfo::new(peer.ip(), listening.tls.is_some());
    let watched = activity.clone();
    let service = service_fn(move |request| {
        let in_flight = watched.request();
        counted(service(request, client.clone()), in_flight)
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
