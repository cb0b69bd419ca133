//! Where the records live: one Redis primary, a primary found through Sentinel, or a
//! Redis Cluster. Each is a `Connection` the Lua scripts run on unchanged (it is a
//! `ConnectionLike`), always to a primary, never a replica; a pipeline goes to the node
//! of its first key. This room also says whether the topology can serve (readiness). It
//! knows nothing of records or scripts.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisFuture,
    RedisResult, ServerErrorKind, TlsMode, Value,
};
use tokio::sync::OnceCell;

use crate::config::RedisTopology;

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
    /// down, `/readyz` says so, and the first operation connects.
    pub(super) fn new(topology: &RedisTopology, timeout: Duration) -> RedisResult<Connection> {
        match topology {
            RedisTopology::Standalone { url } => {
                let client = redis::Client::open(url.as_str())?;
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
                timeout,
            )?)),
            RedisTopology::Cluster { urls } => {
                let client = ClusterClient::builder(urls.iter().map(String::as_str))
                    .connection_timeout(timeout)
                    // The store bounds each operation itself and retries before forwarding;
                    // the client's own retries cover redirections and a failover's first
                    // moments within that bound.
                    .retries(4)
                    .min_retry_wait(10)
                    .max_retry_wait(200)
                    .build()?;
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

/// Whether `error` is one that a moment later may not be: the store is failing over,
/// loading, migrating a slot, or the connection was lost. An operation that failed so
/// is tried again within the store's timeout.
pub(super) fn is_transient(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::MasterDown
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ) | ErrorKind::MasterNameNotFoundBySentinel
            | ErrorKind::ClusterConnectionNotFound
    ) || error.code() == Some("NOREPLICAS")
        || error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
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

impl SentinelConnection {
    fn new(urls: &[String], master_name: &str, timeout: Duration) -> RedisResult<SentinelConnection> {
        // The data nodes take the sentinels' scheme and credentials (database 0).
        let first = urls
            .first()
            .ok_or_else(|| RedisError::from((ErrorKind::InvalidClientConfig, "no sentinel url")))?
            .as_str()
            .into_connection_info()?;
        let tls = match first.addr() {
            ConnectionAddr::TcpTls { .. } => Some(TlsMode::Secure),
            _ => None,
        };
        let mut node =
            SentinelNodeConnectionInfo::default().set_redis_connection_info(first.redis_settings().clone().set_db(0));
        if let Some(tls) = tls {
            node = node.set_tls_mode(tls);
        }
        let client = SentinelClient::build(
            urls.iter().map(String::as_str).collect(),
            master_name,
            Some(node),
            SentinelServerType::Master,
        )?;
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
