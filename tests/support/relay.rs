//! A fault relay: a TCP proxy written with tokio that sits between the proxy and Redis
//! or between the proxy and the upstream, with a mode that can be switched while
//! traffic flows. No root, no docker, no netem.
//!
//! Modes apply to bytes as they pass, in both directions, except `CutAfter`, which
//! counts the bytes coming back from the target on each connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, watch};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Hold each chunk this long before forwarding it.
    Delay(Duration),
    /// Accept and read, but forward nothing either way.
    Blackhole,
    /// Reset every open connection (RST), and every new one at once.
    Reset,
    /// Forward the first N bytes the target sends on each connection, then close it.
    CutAfter(u64),
    /// Stop listening: new connections are refused by the kernel.
    Refuse,
}

pub struct Relay {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Bytes forwarded client -> target, over all connections.
    pub sent: Arc<AtomicU64>,
    pub connections: Arc<AtomicU64>,
    stop: Arc<Notify>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = listen(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind the relay");
        let addr = listener.local_addr().expect("relay addr");
        let (mode, _) = watch::channel(Mode::Pass);
        let relay = Relay {
            addr,
            mode,
            sent: Arc::new(AtomicU64::new(0)),
            connections: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(Notify::new()),
        };
        tokio::spawn(accept_loop(
            listener,
            addr,
            target,
            relay.mode.clone(),
            relay.sent.clone(),
            relay.connections.clone(),
            relay.stop.clone(),
        ));
        relay
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    pub fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.notify_waiters();
        self.mode.send_replace(Mode::Reset);
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn accept_loop(
    listener: TcpListener,
    addr: SocketAddr,
    target: SocketAddr,
    mode: watch::Sender<Mode>,
    sent: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    stop: Arc<Notify>,
) {
    let mut listener = Some(listener);
    let mut modes = mode.subscribe();
    loop {
        let current = *modes.borrow_and_update();
        match (&listener, current) {
            (Some(_), Mode::Refuse) => listener = None,
            (None, mode) if mode != Mode::Refuse => listener = listen(addr).ok(),
            _ => {}
        }
        let accepted = async {
            match &listener {
                Some(listener) => listener.accept().await.ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.notified() => return,
            changed = modes.changed() => if changed.is_err() { return },
            accepted = accepted => {
                if let Some((client, _)) = accepted {
                    connections.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(relay_connection(client, target, mode.subscribe(), sent.clone()));
                }
            }
        }
    }
}

async fn relay_connection(client: TcpStream, target: SocketAddr, modes: watch::Receiver<Mode>, sent: Arc<AtomicU64>) {
    if *modes.borrow() == Mode::Reset {
        reset(client);
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        reset(client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let upstream = pump(client_read, server_write, modes.clone(), None, Some(sent));
    let downstream = pump(server_read, client_write, modes, Some(0), None);
    // When either direction ends, the other is dropped too, and both sockets close.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

/// Copies `from` to `to` under the current mode. `cut` counts bytes for `CutAfter`
/// (only on the target -> client direction). Returns when either side ends, or when
/// the mode resets or cuts the connection.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut modes: watch::Receiver<Mode>,
    mut cut: Option<u64>,
    sent: Option<Arc<AtomicU64>>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            changed = modes.changed() => {
                if changed.is_err() || *modes.borrow() == Mode::Reset {
                    abort(&from, &to);
                    return;
                }
                continue;
            }
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mode = *modes.borrow();
        let chunk = &buffer[..n];
        match mode {
            Mode::Pass | Mode::Refuse => {}
            Mode::Delay(pause) => tokio::time::sleep(pause).await,
            Mode::Blackhole => continue,
            Mode::Reset => {
                abort(&from, &to);
                return;
            }
            Mode::CutAfter(limit) => {
                if let Some(count) = cut.as_mut() {
                    let room = limit.saturating_sub(*count) as usize;
                    if room < chunk.len() {
                        let _ = to.write_all(&chunk[..room]).await;
                        abort(&from, &to);
                        return;
                    }
                    *count += chunk.len() as u64;
                }
            }
        }
        if *modes.borrow() == Mode::Reset {
            abort(&from, &to);
            return;
        }
        if to.write_all(chunk).await.is_err() {
            return;
        }
        if let Some(sent) = &sent {
            sent.fetch_add(chunk.len() as u64, Ordering::SeqCst);
        }
    }
}

/// Makes both sockets this direction touches close with RST once their halves drop.
fn abort(from: &tokio::net::tcp::OwnedReadHalf, to: &tokio::net::tcp::OwnedWriteHalf) {
    let _ = AsRef::<TcpStream>::as_ref(from).set_zero_linger();
    let _ = AsRef::<TcpStream>::as_ref(to).set_zero_linger();
}

/// Closes with RST instead of FIN.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
