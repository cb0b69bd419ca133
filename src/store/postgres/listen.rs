//! The process's one listening connection (see `store::notify`): it `LISTEN`s on the
//! schema's channel, and for each waiter marks the claim waited on (the schema's
//! `watch`), so that the function that next changes that claim notifies. Each
//! notification's payload is the record's key; the subscriber wakes its waiters. The
//! connection is made when a record first has waiters, and made again after it is
//! lost, every waiter then woken to re-read; while it cannot be made, waiters poll.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::schema;
use crate::store::notify::{self, Hub, Subscription, Watcher};

/// Starts the listener on the current runtime; nothing connects until the first waiter.
pub(super) fn start(
    pg: tokio_postgres::Config,
    connector: MakeRustlsConnect,
    schema_name: &str,
    timeout: Duration,
) -> Watcher {
    let hub = Arc::new(Hub::default());
    let (commands, received) = mpsc::unbounded_channel();
    let watch = format!("SELECT {schema_name}.watch($1)");
    let listen = format!("LISTEN {}", schema::channel(schema_name));
    let source = Arc::new((pg, connector, watch, listen));
    tokio::spawn(notify::subscriber(hub.clone(), received, move || {
        let source = source.clone();
        async move {
            let (pg, connector, watch, listen) = &*source;
            connect(pg, connector, watch, listen, timeout).await
        }
    }));
    Watcher::Remote { hub, commands }
}

/// A listening connection: its client (for `watch`), and the keys notified on it.
struct Listening {
    client: Client,
    notified: mpsc::UnboundedReceiver<String>,
    watch: String,
    timeout: Duration,
}

/// Why the listener has no connection.
#[derive(Debug)]
struct Lost(String);

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

async fn connect(
    pg: &tokio_postgres::Config,
    connector: &MakeRustlsConnect,
    watch: &str,
    listen: &str,
    timeout: Duration,
) -> Result<Listening, Lost> {
    let lost = |error: &dyn std::fmt::Display| Lost(error.to_string());
    let (client, mut connection) = match tokio::time::timeout(timeout, pg.connect(connector.clone())).await {
        Err(_) => return Err(Lost(format!("no connection within {timeout:?}"))),
        Ok(result) => result.map_err(|error| lost(&error))?,
    };
    let (notify, notified) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(notification)) => {
                    if notify.send(notification.payload().to_string()).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(%error, "the store's listening connection ended");
                    return;
                }
            }
        }
    });
    match tokio::time::timeout(timeout, client.batch_execute(listen)).await {
        Err(_) => return Err(Lost(format!("LISTEN did not answer within {timeout:?}"))),
        Ok(result) => result.map_err(|error| lost(&error))?,
    }
    Ok(Listening {
        client,
        notified,
        watch: watch.to_string(),
        timeout,
    })
}

impl Subscription for Listening {
    type Error = Lost;

    /// Marks the record's claim as waited on; the channel is the record's key and `:w`.
    async fn subscribe(&mut self, channel: String) -> Result<(), Lost> {
        let key = channel.strip_suffix(":w").unwrap_or(&channel);
        match tokio::time::timeout(self.timeout, self.client.execute(&self.watch, &[&key])).await {
            Err(_) => Err(Lost(format!("watch did not answer within {:?}", self.timeout))),
            Ok(result) => result.map(drop).map_err(|error| Lost(error.to_string())),
        }
    }

    /// Nothing to undo: a mark ends with its claim.
    async fn unsubscribe(&mut self, _channel: String) -> Result<(), Lost> {
        Ok(())
    }

    /// The mark ended with the claim that was released: the claim that took the key
    /// is marked, so that its end notifies the waiters still waiting.
    async fn renew(&mut self, channel: String) -> Result<(), Lost> {
        self.subscribe(channel).await
    }

    async fn next(&mut self) -> Option<String> {
        self.notified.recv().await.map(|key| notify::channel(&key))
    }
}
