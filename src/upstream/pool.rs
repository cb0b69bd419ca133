//! The upstream client: a pool of HTTP/1.1 keep-alive connections of one worker, on
//! hyper's `client::conn`. Each worker has its own (its runtime is single-threaded), so
//! the lock is never contended and a checkout is a scan of a short list, with no
//! hashing and no hop to a pool task: what hyper-util's pooled client spent a fifth of
//! the pass-through instructions on.
//!
//! A connection goes back to its list with the response head; it is taken again once
//! hyper says it is ready (its previous response read to the end). A request sent on
//! an idle connection that turns out closed is sent again on another, as long as none
//! of it was written (hyper hands it back): the only kind of retry a proxy may make
//! without knowing what the upstream did.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;

use crate::body::ProxyBody;
use crate::error::BoxError;

/// How long a TCP connect (and TLS handshake) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 1024;

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
    idle: Mutex<Vec<(Key, Vec<SendRequest<ProxyBody>>)>>,
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

    fn idle(&self) -> MutexGuard<'_, Vec<(Key, Vec<SendRequest<ProxyBody>>)>> {
        // A panic while the list was held leaves a valid list.
        self.shared.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
        while let Some(mut sender) = self.checkout(&key) {
            match sender.try_send_request(request).await {
                Ok(response) => {
                    self.checkin(key, sender);
                    return Ok(response);
                }
                Err(mut error) => match error.take_message() {
                    // Closed while idle, before any of the request was written.
                    Some(unsent) => request = unsent,
                    None => return Err(SendError::Failed(error.into_error().into())),
                },
            }
        }
        let mut sender = self.connect(&key).await.map_err(SendError::Connect)?;
        match sender.try_send_request(request).await {
            Ok(response) => {
                self.checkin(key, sender);
                Ok(response)
            }
            Err(error) if error.message().is_some() => Err(SendError::Connect(error.into_error().into())),
            Err(error) => Err(SendError::Failed(error.into_error().into())),
        }
    }

    /// An idle connection to `key` that can take a request now; closed ones are
    /// dropped on the way.
    fn checkout(&self, key: &Key) -> Option<SendRequest<ProxyBody>> {
        let mut idle = self.idle();
        let (_, senders) = idle.iter_mut().find(|(held, _)| held == key)?;
        senders.retain(|sender| !sender.is_closed());
        let ready = senders.iter().rposition(SendRequest::is_ready)?;
        Some(senders.swap_remove(ready))
    }

    fn checkin(&self, key: Key, sender: SendRequest<ProxyBody>) {
        let mut idle = self.idle();
        match idle.iter_mut().find(|(held, _)| *held == key) {
            Some((_, senders)) if senders.len() < MAX_IDLE => senders.push(sender),
            Some(_) => {}
            None => idle.push((key, vec![sender])),
        }
    }

    /// A new connection to `key`, its HTTP/1.1 handshake done and its task spawned.
    async fn connect(&self, key: &Key) -> Result<SendRequest<ProxyBody>, BoxError> {
        let connecting = async {
            let address = (key.authority.host(), port(key));
            let stream = TcpStream::connect(address).await?;
            stream.set_nodelay(true)?;
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
            Ok::<_, BoxError>(sender)
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
