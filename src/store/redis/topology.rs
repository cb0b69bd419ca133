//! Where the records live: one Redis primary, a primary found through Sentinel, or a
//! Redis Cluster. Each is a `Connection` the Lua scripts run on unchanged (it is a
//! `ConnectionLike`), always to a primary, never a replica; a pipeline goes to the node
//! of its first key. This room also says whether the topology can serve (readiness). It
//! knows nothing of records or scripts.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ClientTlsConfig, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, ServerErrorKind, TlsCertificates, TlsMode, Value,
};
use tokio::sync::OnceCell;

use crate::config::{RedisTopology, StoreTls};

/// A connection to the primary that holds a record, whatever the topology. Cheap to
/// clone: every clone shares the same underlying connections.
#[derive(Clone)]
pub(super) enum Connection {
    /// One primary, through a self-reconnecting multiplexed connection.
    Standalone(ConnectionManager),
    /// The primary the sentinels name, asked again after a lost connection or a
    /// `READONLY` (the node was demoted).
    Sentinel(SentinelConnection),
    /// A Redis Cluster: the client follows `MOVED` and `ASK`, waits on `TRYAGAIN`,
    /// `CLUSTERDOWN` and `LOADING`, and refreshes its slot map on `READONLY`.
    Cluster(LazyCluster),
}

impl Connection {
    /// Prepares the connection. Nothing connects yet: the proxy starts while Redis is
    /// down, `/readyz` says so, and the first operation connects. `tls`'s files are
    /// read now, for every connection this store makes.
    pub(super) fn new(topology: &RedisTopology, tls: Option<&StoreTls>, timeout: Duration) -> RedisResult<Connection> {
        let certificates = tls.map(certificates).transpose()?;
        match topology {
            RedisTopology::Standalone { url } => {
                let client = match certificates {
                    Some(certificates) => redis::Client::build_with_tls(url.as_str(), certificates)?,
                    None => redis::Client::open(url.as_str())?,
                };
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    // Each call is bounded by the store's timeout instead: a response
                    // timeout inside the driver would not tell us more, and must not tear
                    // the connection down while a release is queued behind a slow claim.
                    .set_response_timeout(None)
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_millis(500));
                Ok(Connection::Standalone(ConnectionManager::new_lazy_with_config(
                    client, config,
                )?))
            }
            RedisTopology::Sentinel { urls, master_name } => Ok(Connection::Sentinel(SentinelConnection::new(
                urls,
                master_name,
                certificates,
                timeout,
            )?)),
            RedisTopology::Cluster { urls } => {
                let client = cluster_builder(urls, certificates, timeout).build()?;
                Ok(Connection::Cluster(LazyCluster {
                    client: Arc::new(client),
                    connection: Arc::new(OnceCell::new()),
                }))
            }
        }
    }

    /// Whether the topology can serve guarded requests now: the primary answers (and,
    /// through Sentinel, is still a primary), or every slot of the cluster is covered
    /// and every primary answers. `Err` says why not.
    pub(super) async fn readiness(&mut self) -> Result<(), Unready> {
        match self {
            Connection::Standalone(connection) => {
                let _: String = redis::cmd("PING").query_async(connection).await?;
                Ok(())
            }
            Connection::Sentinel(connection) => {
                let role: Vec<Value> = redis::cmd("ROLE").query_async(connection).await?;
                match role.first() {
                    Some(Value::BulkString(role)) if role.as_slice() == b"master" => Ok(()),
                    _ => {
                        connection.forget();
                        Err(Unready::Topology("the node the sentinels named is not a primary"))
                    }
                }
            }
            Connection::Cluster(cluster) => {
                let mut connection = cluster.connection().await?;
                // PING goes to every primary, and fails if one does not answer.
                let _: Value = redis::cmd("PING").query_async(&mut connection).await?;
                let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut connection).await?;
                if info.lines().any(|line| line.trim() == "cluster_state:ok") {
                    Ok(())
                } else {
                    Err(Unready::Topology(
                        "the cluster does not serve every slot (cluster_state is not ok)",
                    ))
                }
            }
        }
    }
}

/// The store's CA and client certificate, read from their files, in the form the
/// redis crate takes them (PEM).
pub(super) fn certificates(tls: &StoreTls) -> RedisResult<TlsCertificates> {
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|error| {
            RedisError::from((
                ErrorKind::InvalidClientConfig,
                "cannot read a store TLS file",
                format!("{}: {error}", path.display()),
            ))
        })
    };
    Ok(TlsCertificates {
        root_cert: tls.ca_file.as_deref().map(read).transpose()?,
        client_tls: match &tls.client {
            None => None,
            Some(client) => Some(ClientTlsConfig {
                client_cert: read(&client.cert_file)?,
                client_key: read(&client.key_file)?,
            }),
        },
    })
}

/// Why the store cannot serve.
#[derive(Debug)]
pub(super) enum Unready {
    Redis(RedisError),
    Topology(&'static str),
}

impl From<RedisError> for Unready {
    fn from(error: RedisError) -> Unready {
        Unready::Redis(error)
    }
}

/// Whether the store said it did not run the command, and a moment later may: it is
/// failing over or loading, or refused the connection. Any write may be tried again
/// after one.
pub(super) fn is_refused(error: &RedisError) -> bool {
    if tls_failure(error).is_some() {
        return false;
    }
    matches!(
        error.kind(),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::MasterDown
        ) | ErrorKind::MasterNameNotFoundBySentinel
    ) || error.code() == Some("NOREPLICAS")
        || error.is_connection_refusal()
}

/// Whether `error` is one that a moment later may not be: a refusal (`is_refused`),
/// a slot moving, or a lost connection, after which the command may or may not have
/// run. Only an operation that may run twice is tried again after one.
pub(super) fn is_transient(error: &RedisError) -> bool {
    if tls_failure(error).is_some() {
        return false;
    }
    is_refused(error)
        || matches!(
            error.kind(),
            ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask) | ErrorKind::ClusterConnectionNotFound
        )
        || error.is_io_error()
        || error.is_connection_dropped()
}

/// Whether the connection failed (could not be made, was lost, or timed out), rather
/// than Redis answering with an error.
pub(super) fn is_connection(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || error.kind() == ErrorKind::ClusterConnectionNotFound
}

/// Whether the command that failed with `error` may have run: a connection lost after
/// it was sent, or an error reply other than a refusal Redis gives before running
/// anything (a script's own error may follow its writes). A failed handshake or login,
/// or a refused connection, sent nothing.
pub(super) fn may_have_run(error: &RedisError) -> bool {
    if tls_failure(error).is_some() || error.kind() == ErrorKind::AuthenticationFailed || error.is_connection_refusal()
    {
        return false;
    }
    if is_connection(error) {
        return true;
    }
    let before_running = is_refused(error)
        || matches!(
            error.kind(),
            ErrorKind::Server(
                ServerErrorKind::NoScript | ServerErrorKind::NoPerm | ServerErrorKind::Moved | ServerErrorKind::Ask
            )
        )
        || matches!(error.code(), Some("OOM" | "NOPERM" | "WRONGPASS"));
    !before_running
}

/// The TLS error under `error`, if the connection failed in its handshake or was
/// refused by the node's TLS layer (`tls::handshake_failure`).
pub(super) fn tls_failure(error: &RedisError) -> Option<&rustls::Error> {
    crate::tls::handshake_failure(error)
}

// === impl ConnectionLike ===

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Standalone(connection) => connection.req_packed_command(cmd),
            Connection::Sentinel(connection) => connection.req_packed_command(cmd),
            Connection::Cluster(cluster) => cluster.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Standalone(connection) => connection.req_packed_commands(pipeline, offset, count),
            Connection::Sentinel(connection) => connection.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(cluster) => cluster.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        0
    }
}

// === Sentinel ===

/// The primary the sentinels name. A multiplexed connection never reconnects by
/// itself: when it is lost, or the node answers `READONLY` (it was demoted), it is
/// forgotten and the next operation asks the sentinels again.
#[derive(Clone)]
pub(super) struct SentinelConnection {
    shared: Arc<SentinelShared>,
}

struct SentinelShared {
    /// Asking the sentinels takes `&mut`; one task asks at a time.
    client: tokio::sync::Mutex<SentinelClient>,
    /// The primary's connection while it is good. Never held across an `.await`.
    current: Mutex<Option<MultiplexedConnection>>,
    config: AsyncConnectionConfig,
}

/// A client for the sentinels at `urls`; the data nodes take the first sentinel's
/// scheme and credentials (database 0). `certificates` serve every `rediss://`
/// connection: to a sentinel and to a data node.
pub(super) fn sentinel_client(
    urls: &[String],
    master_name: &str,
    certificates: Option<TlsCertificates>,
) -> RedisResult<SentinelClient> {
    let sentinels = urls
        .iter()
        .map(|url| match (&certificates, url.starts_with("rediss://")) {
            (Some(certificates), true) => Ok(redis::Client::build_with_tls(url.as_str(), certificates.clone())?
                .get_connection_info()
                .clone()),
            _ => url.as_str().into_connection_info(),
        })
        .collect::<RedisResult<Vec<_>>>()?;
    let first = sentinels
        .first()
        .ok_or_else(|| RedisError::from((ErrorKind::InvalidClientConfig, "no sentinel url")))?;
    let settings = first.redis_settings().clone();
    let tls = matches!(first.addr(), ConnectionAddr::TcpTls { .. });
    let mut builder = SentinelClientBuilder::new(
        sentinels.iter().map(|sentinel| sentinel.addr().clone()),
        master_name,
        SentinelServerType::Master,
    )?
    .set_client_to_redis_db(0)
    .set_client_to_redis_protocol(settings.protocol());
    if let Some(username) = settings.username() {
        builder = builder
            .set_client_to_redis_username(username)
            .set_client_to_sentinel_username(username);
    }
    if let Some(password) = settings.password() {
        builder = builder
            .set_client_to_redis_password(password)
            .set_client_to_sentinel_password(password);
    }
    if tls {
        builder = builder.set_client_to_redis_tls_mode(TlsMode::Secure);
        if let Some(certificates) = certificates {
            builder = builder.set_client_to_redis_certificates(certificates);
        }
    }
    builder.build()
}

impl SentinelConnection {
    /// The sentinels at `urls`; the data nodes take the first sentinel's scheme and
    /// credentials (database 0). `certificates` serve every `rediss://` connection: to a
    /// sentinel and to a data node.
    fn new(
        urls: &[String],
        master_name: &str,
        certificates: Option<TlsCertificates>,
        timeout: Duration,
    ) -> RedisResult<SentinelConnection> {
        let client = sentinel_client(urls, master_name, certificates)?;
        Ok(SentinelConnection {
            shared: Arc::new(SentinelShared {
                client: tokio::sync::Mutex::new(client),
                current: Mutex::new(None),
                config: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(None),
            }),
        })
    }

    fn current(&self) -> MutexGuard<'_, Option<MultiplexedConnection>> {
        // Every change is one assignment, so a poisoned lock still holds a valid value.
        self.shared
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The primary's connection, asking the sentinels for the primary if there is none.
    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        if let Some(connection) = self.current().clone() {
            return Ok(connection);
        }
        let mut client = self.shared.client.lock().await;
        // Another task may have asked while this one waited for the lock.
        if let Some(connection) = self.current().clone() {
            return Ok(connection);
        }
        let primary = client.async_get_client().await?;
        let connection = primary
            .get_multiplexed_async_connection_with_config(&self.shared.config)
            .await?;
        tracing::info!(primary = ?primary.get_connection_info().addr(), "connected to the primary the sentinels name");
        *self.current() = Some(connection.clone());
        Ok(connection)
    }

    /// Drops the primary's connection, so the next operation asks the sentinels again.
    fn forget(&self) {
        *self.current() = None;
    }

    /// Forgets the connection after an error that says it no longer reaches a primary.
    fn judge<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(error) = &result
            && (error.is_io_error()
                || error.is_connection_dropped()
                || error.is_connection_refusal()
                || matches!(
                    error.kind(),
                    ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                ))
        {
            self.forget();
        }
        result
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            let result = connection.req_packed_command(cmd).await;
            self.judge(result)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            let result = connection.req_packed_commands(pipeline, offset, count).await;
            self.judge(result)
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

// === Cluster ===

/// A client for the cluster whose seed nodes are `urls`.
pub(super) fn cluster_builder(
    urls: &[String],
    certificates: Option<TlsCertificates>,
    timeout: Duration,
) -> ClusterClientBuilder {
    let mut builder = ClusterClient::builder(urls.iter().map(String::as_str));
    if let Some(certificates) = certificates {
        builder = builder.certs(certificates);
    }
    builder
        .connection_timeout(timeout)
        // The store bounds each operation itself and retries before forwarding; the
        // client's own retries cover redirections and a failover's first moments
        // within that bound.
        .retries(4)
        .min_retry_wait(10)
        .max_retry_wait(200)
}

/// A cluster connection made on first use: building one needs a seed node to answer,
/// and the proxy must start while the cluster is down. A failed attempt leaves it
/// unmade, and the next operation tries again.
#[derive(Clone)]
pub(super) struct LazyCluster {
    client: Arc<ClusterClient>,
    connection: Arc<OnceCell<ClusterConnection>>,
}

impl LazyCluster {
    async fn connection(&self) -> RedisResult<ClusterConnection> {
        self.connection
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
    }
}

impl ConnectionLike for LazyCluster {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move { self.connection().await?.req_packed_command(cmd).await })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            self.connection()
                .await?
                .req_packed_commands(pipeline, offset, count)
                .await
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
