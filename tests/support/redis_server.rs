//! A real `redis-server` child process on a free port, that a test can kill, restart
//! on the same port, pause with SIGSTOP and resume. It never skips: without a
//! `redis-server` binary the test fails and says how to install one.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::proxy::free_port;

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    persistent: bool,
    /// More arguments, e.g. `--replicaof` or `--cluster-enabled`.
    extra: Vec<String>,
    /// With TLS: the port it listens on for TLS, beside the plain `port` the test's own
    /// checks use.
    tls: Option<(ServerTls, u16)>,
}

/// TLS on a test server: its certificate and key, the CA its clients' certificates
/// must chain to, and whether a client must present one (`tls-auth-clients`).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub ca_file: PathBuf,
    pub auth_clients: bool,
}

impl ServerTls {
    fn args(&self, port: u16) -> Vec<String> {
        let path = |path: &PathBuf| path.display().to_string();
        vec![
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            path(&self.cert_file),
            "--tls-key-file".into(),
            path(&self.key_file),
            "--tls-ca-cert-file".into(),
            path(&self.ca_file),
            "--tls-auth-clients".into(),
            if self.auth_clients { "yes" } else { "no" }.into(),
        ]
    }
}

/// The `redis-server` binary: `$IDEMPROXY_REDIS_SERVER`, else the one on PATH.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("IDEMPROXY_REDIS_SERVER") {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("redis-server"))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "these tests need a real redis-server, and none is on PATH. Install one \
             (Debian/Ubuntu: `apt-get install redis-server`; macOS: `brew install redis`), \
             or set IDEMPROXY_REDIS_SERVER to its path. .ci/run installs it automatically."
        )
    })
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(false)
    }

    /// A server that keeps an append-only file fsynced on every write, so a restart
    /// after SIGKILL finds every acknowledged record.
    pub fn start_persistent() -> RedisServer {
        RedisServer::start_with(true)
    }

    fn start_with(persistent: bool) -> RedisServer {
        RedisServer::start_with_args(persistent, Vec::new())
    }

    /// A server that also listens for TLS (`tls_url`). A `redis-server` built without
    /// TLS fails the test and says so; it never skips.
    pub fn start_tls(tls: &ServerTls) -> RedisServer {
        RedisServer::start_on(false, Vec::new(), Some(tls))
    }

    /// Like `start_tls`, with `extra` arguments.
    pub fn start_tls_with_args(tls: &ServerTls, extra: Vec<String>) -> RedisServer {
        RedisServer::start_on(false, extra, Some(tls))
    }

    /// A server with `extra` arguments after the usual ones. A port that was free a
    /// moment ago may be taken by the time the server binds it (many servers start at
    /// once in the topology tests): a server that exits at once is started again on
    /// another port.
    pub fn start_with_args(persistent: bool, extra: Vec<String>) -> RedisServer {
        RedisServer::start_on(persistent, extra, None)
    }

    fn start_on(persistent: bool, extra: Vec<String>, tls: Option<&ServerTls>) -> RedisServer {
        let mut log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir = std::env::temp_dir().join(format!("idemproxy-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create a directory for redis-server");
            let mut server = RedisServer {
                child: None,
                port,
                dir,
                persistent,
                extra: extra.clone(),
                tls: tls.map(|tls| (tls.clone(), free_port())),
            };
            if server.try_spawn() {
                return server;
            }
            log = std::fs::read_to_string(server.dir.join("redis.log")).unwrap_or_default();
            if tls.is_some() && !log.contains("Address already in use") {
                panic!(
                    "{} did not start with --tls-port; these tests need a redis-server built with TLS \
                     (Debian's and Ubuntu's redis-server 6 and later are): set IDEMPROXY_REDIS_SERVER \
                     to one. Its log:\n{log}",
                    binary().display()
                );
            }
        }
        panic!("redis-server exited at start on five free ports in a row; the last log:\n{log}");
    }

    fn spawn(&mut self) {
        assert!(self.try_spawn(), "redis-server on port {} exited at start", self.port);
    }

    /// Starts the process and waits until it answers; `false` if it exited first.
    fn try_spawn(&mut self) -> bool {
        let child = Command::new(binary())
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(if self.persistent {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "everysec"]
            })
            .args(["--maxmemory-policy", "noeviction"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(self.tls.as_ref().map(|(tls, port)| tls.args(*port)).unwrap_or_default())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        self.wait_ready()
    }

    /// Waits until the server answers PING: a poll on a condition, bounded at 10 s;
    /// `false` if the process exited (its port was taken).
    fn wait_ready(&mut self) -> bool {
        let started = Instant::now();
        loop {
            if let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut connection) = client.get_connection_with_timeout(Duration::from_millis(200))
                && redis::cmd("PING").query::<String>(&mut connection).is_ok()
            {
                return true;
            }
            if let Some(child) = &mut self.child
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis-server on port {} did not answer PING within 10s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The TLS port's URL, by the name its certificate is for.
    pub fn tls_url(&self) -> String {
        format!("rediss://localhost:{}/0", self.tls_port())
    }

    pub fn tls_port(&self) -> u16 {
        self.tls.as_ref().expect("a server started with start_tls").1
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("redis-server is running").id()
    }

    /// SIGKILL, and wait until the process is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a fresh, empty server on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Whether the process is running (it was not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// A synchronous connection for the test's own checks.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("connect to the test redis-server")
    }

    /// Every key with its PTTL in milliseconds (-1: no TTL).
    pub fn dump_ttls(&self) -> Vec<(String, i64)> {
        let mut connection = self.connection();
        self.keys()
            .into_iter()
            .map(|key| {
                let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut connection).expect("PTTL");
                (key, ttl)
            })
            .collect()
    }

    /// Every key in the database.
    pub fn keys(&self) -> Vec<String> {
        redis::cmd("KEYS").arg("*").query(&mut self.connection()).expect("KEYS")
    }
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid} failed");
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A paused server ignores SIGKILL until resumed on some kernels: resume first.
            let _ = Command::new("kill").args(["-CONT", &child.id().to_string()]).status();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
