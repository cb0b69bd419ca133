//! Notifications that a record changed, for requests waiting on it
//! (`wait_for_in_flight`). The store tells the process, not the waiters' polls: the
//! memory store wakes the record's waiters itself; on Redis, the scripts that change a
//! record publish on the record's channel (its key and `:w`, in the record's own slot),
//! and one subscriber connection per process fans the messages out.
//!
//! A notification only says "read the record again": a waiter re-reads by claiming
//! again, so a lost notification costs time, never a wrong answer. After the
//! subscriber reconnects, every waiter is woken to re-read; a waiter re-reads at its
//! deadline too.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot};

use super::StoreKey;

/// The channel a record's changes are published on.
pub(crate) fn channel(key: &str) -> String {
    format!("{key}:w")
}

/// The waiters of each record that has some, each record with one `Notify`.
#[derive(Default, Debug)]
pub(crate) struct Hub {
    records: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
}

impl Hub {
    fn records(&self) -> MutexGuard<'_, HashMap<String, (Arc<Notify>, usize)>> {
        // Every change is one insert, increment or removal: a poisoned map is whole.
        self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers one more waiter on `key`, and hands back what wakes it.
    fn enter(&self, key: &str) -> Arc<Notify> {
        let mut records = self.records();
        let entry = records
            .entry(key.to_string())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        entry.0.clone()
    }

    /// One waiter on `key` fewer; whether it was the last.
    fn leave(&self, key: &str) -> bool {
        let mut records = self.records();
        let Some(entry) = records.get_mut(key) else {
            return false;
        };
        entry.1 -= 1;
        if entry.1 > 0 {
            return false;
        }
        records.remove(key);
        true
    }

    /// Wakes the waiters of `key`, if it has any.
    pub(crate) fn wake(&self, key: &str) {
        if let Some((notify, _)) = self.records().get(key) {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter: after a reconnect, when a notification may have been lost.
    fn wake_all(&self) {
        for (notify, _) in self.records().values() {
            notify.notify_waiters();
        }
    }

    fn keys(&self) -> Vec<String> {
        self.records().keys().cloned().collect()
    }
}

/// Where a process learns that records changed.
#[derive(Clone)]
pub(crate) enum Watcher {
    /// No notifications (a test's own store): waiters re-read only at their deadline.
    #[cfg_attr(not(feature = "test-util"), allow(dead_code))]
    None,
    /// The memory store wakes its own waiters.
    Local(Arc<Hub>),
    /// Redis or Postgres: the subscriber task's hub, and its commands.
    Remote {
        hub: Arc<Hub>,
        commands: mpsc::UnboundedSender<Command>,
    },
}

/// What a waiter asks of the subscriber task.
pub(crate) enum Command {
    /// Subscribe to the record's channel (if no one is); answer once subscribed, or
    /// `false` when there is no connection to subscribe on.
    Subscribe(String, oneshot::Sender<bool>),
    Unsubscribe(String),
    /// The record's claim changed hands (released, then claimed again): subscribe to
    /// the new claim where a subscription is to a claim rather than to a channel
    /// (`Subscription::renew`). Answers as `Subscribe` does.
    Renew(String, oneshot::Sender<bool>),
}

/// One waiter's registration on a record: woken when the record changes. Leaving it
/// (dropping it) unsubscribes with the record's last waiter.
pub(crate) struct Watch {
    notify: Arc<Notify>,
    key: String,
    watcher: Watcher,
}

impl Watch {
    /// What wakes this waiter.
    pub(crate) fn notify(&self) -> Arc<Notify> {
        self.notify.clone()
    }

    /// Called when the waiter, woken, finds the record in flight again (its claim
    /// released and claimed by another): makes sure the new claim's end wakes it too.
    /// Returns once done (or once the subscriber has said it cannot).
    pub(crate) async fn renew(&self) {
        if let Watcher::Remote { commands, .. } = &self.watcher {
            let (ack, done) = oneshot::channel();
            if commands.send(Command::Renew(self.key.clone(), ack)).is_ok() {
                let _done = done.await;
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let (hub, commands) = match &self.watcher {
            Watcher::None => return,
            Watcher::Local(hub) => (hub, None),
            Watcher::Remote { hub, commands } => (hub, Some(commands)),
        };
        if hub.leave(&self.key)
            && let Some(commands) = commands
        {
            let _ = commands.send(Command::Unsubscribe(self.key.clone()));
        }
    }
}

impl Watcher {
    /// Registers a waiter on `key`. On Redis it returns once the process is subscribed
    /// to the record's channel, or once the subscriber has said it cannot connect: the
    /// waiter stays registered, and when the subscriber connects it subscribes and
    /// wakes it to re-read.
    pub(crate) async fn watch(&self, key: &StoreKey) -> Option<Watch> {
        let key = key.as_str().to_string();
        let hub = match self {
            Watcher::None => {
                return Some(Watch {
                    notify: Arc::new(Notify::new()),
                    key,
                    watcher: Watcher::None,
                });
            }
            Watcher::Local(hub) | Watcher::Remote { hub, .. } => hub,
        };
        let notify = hub.enter(&key);
        let watch = Watch {
            notify,
            key: key.clone(),
            watcher: self.clone(),
        };
        if let Watcher::Remote { commands, .. } = self {
            let (ack, subscribed) = oneshot::channel();
            commands.send(Command::Subscribe(key, ack)).ok()?;
            // Awaited so that the waiter counts as waiting only once subscribed; without a
            // connection (the answer is then `false`), it re-reads when the subscriber
            // connects, as every waiter does.
            let _subscribed = subscribed.await;
        }
        Some(watch)
    }
}

/// A connection that delivers a record channel's messages.
pub(crate) trait Subscription: Send {
    /// What a failed subscription or connection says.
    type Error: std::fmt::Display + Send;
    fn subscribe(&mut self, channel: String) -> impl Future<Output = Result<(), Self::Error>> + Send;
    fn unsubscribe(&mut self, channel: String) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Subscribes again to a channel this connection is subscribed to, after the
    /// record's claim changed hands. Nothing to do where a subscription is to a channel
    /// (Redis); where it is a mark on one claim (Postgres), the new claim is marked.
    fn renew(&mut self, _channel: String) -> impl Future<Output = Result<(), Self::Error>> + Send {
        std::future::ready(Ok(()))
    }
    /// The next message's channel; `None` when the connection is lost.
    fn next(&mut self) -> impl Future<Output = Option<String>> + Send;
}

/// Runs the process's subscriber: connects with `connect` when a record first has
/// waiters (never while none wait), subscribes to the channel of every record with
/// waiters, and wakes a record's waiters on each message on its channel. After a lost
/// connection it connects again (while some wait), subscribes again and wakes every
/// waiter, so that each re-reads its record. While it cannot connect, waiters are told
/// at once, and every waiter is woken to re-read at each try to connect again (every
/// 50 ms at first, then at most every 2 s): polling, bounded, until notifications
/// come back.
pub(crate) async fn subscriber<S, F, Fut>(hub: Arc<Hub>, mut commands: mpsc::UnboundedReceiver<Command>, connect: F)
where
    S: Subscription,
    F: Fn() -> Fut,
    Fut: Future<Output = Result<S, S::Error>>,
{
    let mut pause = Duration::from_millis(50);
    let mut failing = false;
    // A subscription asked for before there was a connection to make it on.
    let mut pending: Option<(String, oneshot::Sender<bool>)> = None;
    loop {
        if pending.is_none() && hub.keys().is_empty() {
            match commands.recv().await {
                None => return,
                Some(Command::Subscribe(key, ack) | Command::Renew(key, ack)) => pending = Some((key, ack)),
                Some(Command::Unsubscribe(_)) => continue,
            }
        }
        let mut connection = match connect().await {
            Ok(connection) => connection,
            Err(error) => {
                if !failing {
                    tracing::warn!(%error, "cannot connect the store's subscriber; waiters re-read at their lease's end and deadline");
                }
                failing = true;
                if let Some((_, ack)) = pending.take() {
                    let _ = ack.send(false);
                }
                // Waiters that ask meanwhile are told there is no subscription.
                let deadline = tokio::time::sleep(pause);
                tokio::pin!(deadline);
                loop {
                    tokio::select! {
                        () = &mut deadline => break,
                        command = commands.recv() => match command {
                            None => return,
                            Some(Command::Subscribe(_, ack) | Command::Renew(_, ack)) => { let _ = ack.send(false); }
                            Some(Command::Unsubscribe(_)) => {}
                        },
                    }
                }
                pause = (pause * 2).min(Duration::from_secs(2));
                hub.wake_all();
                continue;
            }
        };
        if failing {
            tracing::info!("the store's subscriber is connected again");
        }
        (pause, failing) = (Duration::from_millis(50), false);
        let mut subscribed = HashSet::new();
        let mut lost = false;
        for key in hub.keys() {
            if !subscribe(&mut connection, &mut subscribed, key).await {
                lost = true;
                break;
            }
        }
        // The pending waiter's key was in the hub before it asked: subscribed above.
        if let Some((_, ack)) = pending.take() {
            let _ = ack.send(!lost);
        }
        // A change published while there was no subscription: every waiter re-reads.
        hub.wake_all();
        while !lost {
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Subscribe(key, ack)) => {
                        let done = subscribe(&mut connection, &mut subscribed, key).await;
                        lost |= !done;
                        let _ = ack.send(done);
                    }
                    Some(Command::Renew(key, ack)) => {
                        let done = if subscribed.contains(&key) {
                            connection.renew(channel(&key)).await.is_ok()
                        } else {
                            subscribe(&mut connection, &mut subscribed, key).await
                        };
                        lost |= !done;
                        let _ = ack.send(done);
                    }
                    Some(Command::Unsubscribe(key)) => {
                        if subscribed.remove(&key) && connection.unsubscribe(channel(&key)).await.is_err() {
                            lost = true;
                        }
                    }
                },
                message = connection.next() => match message {
                    Some(channel) => {
                        if let Some(key) = channel.strip_suffix(":w") {
                            hub.wake(key);
                        }
                    }
                    None => lost = true,
                },
            }
        }
        // Every waiter re-reads once the subscriptions are back (or, when none waits
        // any more, the next waiter connects again).
        tracing::warn!("the store's subscriber lost its connection");
    }
}

/// Subscribes `connection` to `key`'s channel unless it already is; whether it is now.
async fn subscribe<S: Subscription>(connection: &mut S, subscribed: &mut HashSet<String>, key: String) -> bool {
    if subscribed.contains(&key) {
        return true;
    }
    let done = connection.subscribe(channel(&key)).await.is_ok();
    if done {
        subscribed.insert(key);
    }
    done
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use redis::RedisResult;

    use super::*;

    /// A subscription the test drives: its messages (`None`: the connection is lost),
    /// and, for a connection made again, a gate its first subscribe waits at.
    struct Fake {
        messages: mpsc::UnboundedReceiver<Option<String>>,
        gate: Option<oneshot::Receiver<()>>,
    }

    impl Subscription for Fake {
        type Error = redis::RedisError;

        async fn subscribe(&mut self, _channel: String) -> RedisResult<()> {
            if let Some(gate) = self.gate.take() {
                let _ = gate.await;
            }
            Ok(())
        }

        async fn unsubscribe(&mut self, _channel: String) -> RedisResult<()> {
            Ok(())
        }

        async fn next(&mut self) -> Option<String> {
            self.messages.recv().await.flatten()
        }
    }

    /// A notification published while the subscriber was reconnecting is lost; so
    /// after a reconnect every waiter is woken to re-read its record.
    #[tokio::test]
    async fn a_reconnected_subscriber_wakes_every_waiter() {
        let (first_messages, first) = mpsc::unbounded_channel();
        let (_second_messages, second) = mpsc::unbounded_channel();
        let (open, gate) = oneshot::channel();
        let connections = Arc::new(Mutex::new(VecDeque::from([
            Fake {
                messages: first,
                gate: None,
            },
            Fake {
                messages: second,
                gate: Some(gate),
            },
        ])));
        let (connected, mut connects) = mpsc::unbounded_channel();
        let hub = Arc::new(Hub::default());
        let (commands, received) = mpsc::unbounded_channel();
        tokio::spawn(subscriber(hub.clone(), received, move || {
            let connections = connections.clone();
            let connected = connected.clone();
            async move {
                let _ = connected.send(());
                let next = connections
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .pop_front();
                next.ok_or_else(|| redis::RedisError::from((redis::ErrorKind::Io, "no more connections")))
            }
        }));
        let watcher = Watcher::Remote { hub, commands };
        let key = StoreKey::from_derived("test:payments:{ab}".into());
        let watch = watcher.watch(&key).await.expect("registered");
        connects.recv().await.expect("the first connection");
        // The connection is lost; the subscriber connects again and, before its first
        // subscribe there answers, this waiter starts waiting.
        first_messages.send(None).expect("the subscriber reads");
        connects.recv().await.expect("connected again");
        let notify = watch.notify();
        let woken = notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        open.send(()).expect("the subscriber subscribes again");
        tokio::time::timeout(Duration::from_secs(10), woken)
            .await
            .expect("the waiter is woken after the reconnect");
    }
}
