//! The upstream client: a pool of HTTP/1.1 keep-alive connections of one worker, on
//! hyper's `client::conn`. Each worker has its own (its runtime is single-threaded), so
//! the lock is never contended and a checkout is a scan of a short list, with no
//! hashing and no hop to a pool task: what hyper-util's pooled client spent a fifth of
//! the pass-through instructions on.
//!
//! A connection goes back to its list with the response head; it is taken again once
//! hyper says it is ready (its previous response read to the end). Before it is taken,
//! one non-blocking peek at its socket asks the kernel whether the upstream has closed
//! it while it sat idle (a keep-alive timeout, a graceful restart): hyper's connection
//! task only learns that when the runtime next polls the socket, and a request written
//! into that window dies with no response, which on a guarded route makes its outcome
//! unknown. Connections idle for longer than `IDLE_TIMEOUT` are not reused either (a
//! NAT or load balancer may have forgotten them without a word). A request handed to
//! a connection that closed all the same is sent again on another, as long as none of
//! it was written (hyper hands it back): the only kind of retry a proxy may make without
//! knowing what the upstream did.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustix::io::Errno;
use rustix::net::RecvFlags;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;

use crate::body::ProxyBody;
use crate::error::BoxError;

/// How long a TCP connect (and TLS handshake) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 1024;
/// A connection idle for longer is closed rather than reused (nginx's upstream
/// `keepalive_timeout` default), below the idle timeouts of common NATs and load balancers.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What went wrong with an exchange: whether anything of the request was sent.
#[derive(Debug)]
pub(crate) enum SendError {
    /// Nothing was sent: the connection (or its TLS) could not be made.
    Connect(BoxError),
    /// The request may have reached the upstream.
    Failed(BoxError),
}

/// One worker's upstream client. Cheap to clone.
#[derive(Clone)]
pub(crate) struct HttpClient {
    shared: Arc<Shared>,
}

struct Shared {
    tls: TlsConnector,
    /// Connections by upstream; a worker talks to a handful of upstreams at most.
    idle: Mutex<Vec<(Key, Vec<Pooled>)>>,
}

/// A connection of the pool: hyper's sender, and a weak handle on its socket for the
/// peek before reuse (the socket closes when hyper drops the connection, not when the
/// pool gets round to it, and costs one file descriptor, not two).
struct Pooled {
    sender: SendRequest<ProxyBody>,
    socket: Weak<Mutex<TcpStream>>,
    /// When it last came back to the pool.
    since: Instant,
}

impl Pooled {
    /// Whether the upstream has left the idle connection open, as far as the kernel
    /// knows now: no end of stream and no error waiting on the socket.
    fn still_open(&self, https: bool) -> bool {
        let Some(socket) = self.socket.upgrade() else {
            return false;
        };
        let socket = lock(&socket);
        let mut byte = [0u8; 1];
        match rustix::net::recv(&*socket, &mut byte[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Err(Errno::AGAIN | Errno::INTR) => true,
            Ok((_, 0)) => false,
            // Over TLS these may be records rustls has not read yet (TLS 1.3 session
            // tickets); in plain HTTP, bytes before a request mean a broken exchange.
            Ok(_) => https,
            Err(_) => false,
        }
    }
}

/// One upstream connection's TCP stream as hyper (or rustls under it) reads and
/// writes it, shared with the pool's weak handle for the peek. The lock is never
/// contended: the connection and the pool belong to one worker's single thread.
struct Stream(Arc<Mutex<TcpStream>>);

impl Stream {
    fn lock(&self) -> MutexGuard<'_, TcpStream> {
        lock(&self.0)
    }
}

/// Locks `mutex`; a panic while it was held leaves its value valid (a list of
/// connections, a socket), so a poisoned lock is taken all the same.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.lock()).poll_read(cx, buf)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.lock()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.lock()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.lock().is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.lock()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.lock()).poll_shutdown(cx)
    }
}

#[derive(Clone, PartialEq, Eq)]
struct Key {
    https: bool,
    authority: Authority,
}

impl HttpClient {
    /// A client whose HTTPS connections trust `tls` (which must not offer HTTP/2).
    pub(crate) fn new(tls: Arc<rustls::ClientConfig>) -> HttpClient {
        HttpClient {
            shared: Arc::new(Shared {
                tls: TlsConnector::from(tls),
                idle: Mutex::new(Vec::new()),
            }),
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<(Key, Vec<Pooled>)>> {
        lock(&self.shared.idle)
    }

    /// Sends `request` (with an absolute URI) and returns the response head.
    pub(crate) async fn request(&self, mut request: Request<ProxyBody>) -> Result<Response<Incoming>, SendError> {
        let key = key(request.uri()).ok_or_else(|| SendError::Connect("the upstream URI has no host".into()))?;
        // HTTP/1.1 to an origin server takes the origin form.
        let origin = request
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or(PathAndQuery::from_static("/"));
        *request.uri_mut() = Uri::from(origin);
        while let Some(mut pooled) = self.checkout(&key) {
            match pooled.sender.try_send_request(request).await {
                Ok(response) => {
                    self.checkin(key, pooled);
                    return Ok(response);
                }
                Err(mut error) => match error.take_message() {
                    // Closed while idle, before any of the request was written.
                    Some(unsent) => request = unsent,
                    None => return Err(SendError::Failed(error.into_error().into())),
                },
            }
        }
        let mut pooled = Box::pin(self.connect(&key)).await.map_err(SendError::Connect)?;
        match pooled.sender.try_send_request(request).await {
            Ok(response) => {
                self.checkin(key, pooled);
                Ok(response)
            }
            Err(error) if error.message().is_some() => Err(SendError::Connect(error.into_error().into())),
            Err(error) => Err(SendError::Failed(error.into_error().into())),
        }
    }

    /// An idle connection to `key` that can take a request now; closed ones, and
    /// ones idle for too long, are dropped on the way.
    fn checkout(&self, key: &Key) -> Option<Pooled> {
        let now = Instant::now();
        let mut idle = self.idle();
        let (_, pooled) = idle.iter_mut().find(|(held, _)| held == key)?;
        pooled.retain(|held| !held.sender.is_closed() && now.duration_since(held.since) < IDLE_TIMEOUT);
        loop {
            let ready = pooled.iter().rposition(|held| held.sender.is_ready())?;
            let candidate = pooled.swap_remove(ready);
            if candidate.still_open(key.https) {
                return Some(candidate);
            }
        }
    }

    fn checkin(&self, key: Key, mut pooled: Pooled) {
        pooled.since = Instant::now();
        let mut idle = self.idle();
        match idle.iter_mut().find(|(held, _)| *held == key) {
            Some((_, held)) if held.len() < MAX_IDLE => held.push(pooled),
            Some(_) => {}
            None => idle.push((key, vec![pooled])),
        }
    }

    /// A new connection to `key`, its HTTP/1.1 handshake done and its task spawned.
    async fn connect(&self, key: &Key) -> Result<Pooled, BoxError> {
        let connecting = async {
            let address = (key.authority.host(), port(key));
            let stream = TcpStream::connect(address).await?;
            stream.set_nodelay(true)?;
            let stream = Stream(Arc::new(Mutex::new(stream)));
            let socket = Arc::downgrade(&stream.0);
            let stream = if key.https {
                let host = key.authority.host().trim_start_matches('[').trim_end_matches(']');
                let name = ServerName::try_from(host.to_string())?;
                Either::Right(self.shared.tls.connect(name, stream).await?)
            } else {
                Either::Left(stream)
            };
            let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "upstream connection ended");
                }
            });
            Ok::<_, BoxError>(Pooled {
                sender,
                socket,
                since: Instant::now(),
            })
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(result) => result,
            Err(_) => Err("the upstream did not accept a connection within 5s".into()),
        }
    }
}

fn key(uri: &Uri) -> Option<Key> {
    Some(Key {
        https: uri.scheme() == Some(&Scheme::HTTPS),
        authority: uri.authority()?.clone(),
    })
}

fn port(key: &Key) -> u16 {
    key.authority.port_u16().unwrap_or(if key.https { 443 } else { 80 })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::net::{TcpListener, TcpStream as StdStream};
    use std::sync::mpsc;

    use http_body_util::BodyExt;

    use super::*;

    /// Reads one request head (these requests have no body) and returns its request line.
    fn read_head(reader: &mut BufReader<StdStream>) -> String {
        let mut first = String::new();
        reader.read_line(&mut first).unwrap();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                return first.trim_end().to_string();
            }
        }
    }

    /// Whether the local IPv4 socket on `port` is in CLOSE_WAIT (its peer has closed).
    fn close_wait(port: u16) -> bool {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let local = format!("0100007F:{port:04X}");
        table
            .lines()
            .skip(1)
            .any(|line| line.split_whitespace().nth(1) == Some(&local) && line.split_whitespace().nth(3) == Some("08"))
    }

    fn answer(stream: &mut StdStream, body: &str) {
        write!(
            stream,
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    }

    /// An idle connection the upstream has closed (its FIN already on the socket) is
    /// not reused: the request goes once, on a new connection. The upstream closes the
    /// first connection while the test holds the (single) runtime thread, so hyper's
    /// connection task has not seen the FIN when the next request is checked out, as
    /// in production when the I/O driver has not turned yet: the order is fixed, not
    /// timed. Without the peek the request is written into the dead connection and
    /// fails with `IncompleteMessage`, which on a guarded route is an unknown outcome.
    #[tokio::test(flavor = "current_thread")]
    async fn an_idle_connection_the_upstream_closed_is_not_reused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let (close, close_requested) = mpsc::channel::<()>();
        let (closed, closed_seen) = mpsc::channel::<std::net::SocketAddr>();
        let upstream = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let (first, peer) = listener.accept().unwrap();
            let mut reader = BufReader::new(first.try_clone().unwrap());
            seen.push((1, read_head(&mut reader)));
            answer(&mut reader.get_mut().try_clone().unwrap(), "one");
            close_requested.recv().unwrap();
            first.shutdown(std::net::Shutdown::Both).unwrap();
            drop((first, reader));
            closed.send(peer).unwrap();
            let (second, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(second.try_clone().unwrap());
            seen.push((2, read_head(&mut reader)));
            answer(&mut reader.get_mut().try_clone().unwrap(), "two");
            seen
        });

        let client = crate::upstream::client(None).unwrap();
        let get = |path: &str| {
            Request::get(format!("http://{address}{path}"))
                .body(crate::body::full(bytes::Bytes::new()))
                .unwrap()
        };
        let first = client.request(get("/first")).await.unwrap();
        assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "one");
        let key = key(&format!("http://{address}/").parse().unwrap()).unwrap();
        // The connection task marks the connection ready once it has seen the end of
        // the response; let it run until it has.
        let mut turns = 0;
        while !client
            .idle()
            .iter()
            .any(|(held, pooled)| *held == key && pooled.iter().any(|p| p.sender.is_ready()))
        {
            assert!(turns < 10_000, "the first connection never became ready");
            turns += 1;
            tokio::task::yield_now().await;
        }

        // From here to the request, nothing yields to the connection task.
        close.send(()).unwrap();
        let port = closed_seen.recv().unwrap().port();
        // Until the kernel has the upstream's FIN on the pool's socket (CLOSE_WAIT).
        let mut reads = 0;
        while !close_wait(port) {
            assert!(reads < 100_000, "the upstream's FIN never arrived");
            reads += 1;
            std::thread::yield_now();
        }
        let second = client.request(get("/second")).await.unwrap();
        assert_eq!(second.into_body().collect().await.unwrap().to_bytes(), "two");

        let seen = upstream.join().unwrap();
        assert_eq!(
            seen,
            [
                (1, "GET /first HTTP/1.1".to_string()),
                (2, "GET /second HTTP/1.1".to_string())
            ],
            "each request reached the upstream once, the second on a new connection"
        );
    }

    /// One file descriptor per upstream connection: the server's connection capacity
    /// is computed on one for the client and one upstream, so the pool's handle for the
    /// peek must not be a second (a `dup` would be).
    #[tokio::test(flavor = "current_thread")]
    async fn a_pooled_connection_holds_one_file_descriptor() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let (peer, peer_seen) = mpsc::channel();
        let (done, finished) = mpsc::channel::<()>();
        let upstream = std::thread::spawn(move || {
            let (stream, from) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            read_head(&mut reader);
            answer(&mut reader.get_mut().try_clone().unwrap(), "ok");
            peer.send(from).unwrap();
            finished.recv().unwrap();
        });

        let client = crate::upstream::client(None).unwrap();
        let request = Request::get(format!("http://{address}/"))
            .body(crate::body::full(bytes::Bytes::new()))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
        let port = peer_seen.recv().unwrap().port();

        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let local = format!("0100007F:{port:04X}");
        let inode = table
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            // The established connection: an earlier one on the same port may linger
            // in TIME_WAIT, with no socket (inode 0).
            .find(|fields| fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"01"))
            .and_then(|fields| fields.get(9).map(|inode| inode.to_string()))
            .expect("the pool's connection in /proc/net/tcp");
        let socket = format!("socket:[{inode}]");
        let descriptors = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
            .filter(|target| target.to_str() == Some(socket.as_str()))
            .count();
        done.send(()).unwrap();
        upstream.join().unwrap();
        assert_eq!(descriptors, 1, "file descriptors on the pooled connection's socket");
    }
}
