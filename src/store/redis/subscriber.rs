//! The process's one subscriber connection to the node(s) that publish record changes
//! (see `store::notify`): a pub/sub connection to the primary (one primary, or the one
//! the sentinels name now), or a RESP3 cluster connection subscribed to shard channels,
//! which the cluster routes to the node that holds each record's slot.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{ProtocolVersion, PushInfo, PushKind, RedisResult, TlsCertificates, Value};
use tokio::sync::{Mutex, mpsc};

use super::topology::{certificates, cluster_builder, sentinel_client};
use crate::config::{RedisConfig, RedisTopology};
use crate::error::StoreError;
use crate::store::notify::{self, Hub, Subscription, Watcher};

/// The command the scripts publish a record's change with, on this topology.
pub(crate) fn publish_command(topology: &RedisTopology) -> &'static str {
    match topology {
        RedisTopology::Standalone { .. } | RedisTopology::Sentinel { .. } => "PUBLISH",
        RedisTopology::Cluster { .. } => "SPUBLISH",
    }
}

/// Where the subscriber connects.
enum Source {
    Standalone(redis::Client),
    Sentinel(Mutex<SentinelClient>),
    Cluster {
        urls: Vec<String>,
        certificates: Option<TlsCertificates>,
        timeout: Duration,
    },
}

/// Starts the process's subscriber on the current runtime and returns the watcher the
/// proxy's waiters use. Nothing connects until the first waiter.
pub(super) fn start(config: &RedisConfig, timeout: Duration) -> Result<Watcher, StoreError> {
    let certificates = config
        .tls
        .as_ref()
        .map(certificates)
        .transpose()
        .map_err(super::failed)?;
    let source = match &config.topology {
        RedisTopology::Standalone { url } => Source::Standalone(
            match certificates {
                Some(certificates) => redis::Client::build_with_tls(url.as_str(), certificates),
                None => redis::Client::open(url.as_str()),
            }
            .map_err(super::failed)?,
        ),
        RedisTopology::Sentinel { urls, master_name } => Source::Sentinel(Mutex::new(
            sentinel_client(urls, master_name, certificates).map_err(super::failed)?,
        )),
        RedisTopology::Cluster { urls } => Source::Cluster {
            urls: urls.clone(),
            certificates,
            timeout,
        },
    };
    let hub = Arc::new(Hub::default());
    let (commands, received) = mpsc::unbounded_channel();
    let source = Arc::new(source);
    tokio::spawn(notify::subscriber(hub.clone(), received, move || {
        let source = source.clone();
        async move { connect(&source, timeout).await }
    }));
    Ok(Watcher::Remote { hub, commands })
}

async fn connect(source: &Source, timeout: Duration) -> RedisResult<Connection> {
    let pubsub = |client: redis::Client| async move {
        let pubsub = tokio::time::timeout(timeout, client.get_async_pubsub())
            .await
            .map_err(|_| redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)))??;
        let (sink, stream) = pubsub.split();
        Ok::<_, redis::RedisError>(Connection::PubSub { sink, stream })
    };
    match source {
        Source::Standalone(client) => pubsub(client.clone()).await,
        Source::Sentinel(sentinels) => {
            let primary = sentinels.lock().await.async_get_client().await?;
            pubsub(primary).await
        }
        Source::Cluster {
            urls,
            certificates,
            timeout,
        } => {
            let (pushes, received) = mpsc::unbounded_channel();
            let client = cluster_builder(urls, certificates.clone(), *timeout)
                .use_protocol(ProtocolVersion::RESP3)
                .push_sender(pushes)
                .build()?;
            let connection = client.get_async_connection().await?;
            Ok(Connection::Cluster {
                connection,
                pushes: received,
            })
        }
    }
}

enum Connection {
    PubSub {
        sink: PubSubSink,
        stream: PubSubStream,
    },
    Cluster {
        connection: ClusterConnection,
        pushes: mpsc::UnboundedReceiver<PushInfo>,
    },
}

impl Subscription for Connection {
    type Error = redis::RedisError;

    async fn subscribe(&mut self, channel: String) -> RedisResult<()> {
        match self {
            Connection::PubSub { sink, .. } => sink.subscribe(channel).await,
            Connection::Cluster { connection, .. } => connection.ssubscribe(channel).await,
        }
    }

    async fn unsubscribe(&mut self, channel: String) -> RedisResult<()> {
        match self {
            Connection::PubSub { sink, .. } => sink.unsubscribe(channel).await,
            Connection::Cluster { connection, .. } => connection.sunsubscribe(channel).await,
        }
    }

    async fn next(&mut self) -> Option<String> {
        match self {
            Connection::PubSub { stream, .. } => stream
                .next()
                .await
                .map(|message| message.get_channel_name().to_string()),
            Connection::Cluster { pushes, .. } => loop {
                let push = pushes.recv().await?;
                match push.kind {
                    PushKind::SMessage | PushKind::Message => {
                        if let Some(Value::BulkString(channel)) = push.data.first() {
                            return Some(String::from_utf8_lossy(channel).into_owned());
                        }
                    }
                    // The cluster client resubscribes by itself, but a message may have
                    // been lost meanwhile: report the loss, so that every waiter re-reads.
                    PushKind::Disconnection => return None,
                    _ => {}
                }
            },
        }
    }
}
