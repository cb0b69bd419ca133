//! Starts the proxy library on `127.0.0.1:0` from a TOML config built per test, with
//! three routes: `payments` (guarded, key required), `orders` (guarded, key optional)
//! and `reads` (unguarded). Any other path has no route.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;

use idemproxy::{Config, Running};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("find a free port")
}

#[derive(Debug, Clone)]
pub enum StoreKind {
    Memory,
    /// The SQLite store on this file.
    Sqlite(std::path::PathBuf),
    Redis(String),
    /// Sentinel URLs, and the master name they monitor.
    Sentinel(Vec<String>, String),
    /// Seed node URLs.
    Cluster(Vec<String>),
    /// The Postgres store at this URL (schema `idemproxy` unless `store_extra` says).
    Postgres(String),
}

#[derive(Debug, Clone)]
pub struct TestConfig {
    pub listen: String,
    pub admin_listen: String,
    pub store: StoreKind,
    pub store_timeout: String,
    pub upstream: String,
    pub upstream_timeout: String,
    pub retention: String,
    /// Extra lines in the payments route's `[route.idempotency]` table.
    pub idempotency: String,
    /// Extra lines in `[server]`.
    pub server: String,
    /// Extra lines in `[store]`.
    pub store_extra: String,
    /// Extra lines in the payments route's own table (e.g. `upstream_ca_file`).
    pub upstream_extra: String,
    /// Extra lines in `[admin]` (e.g. `token_file`).
    pub admin_extra: String,
    /// More `[[route]]` tables, after the three.
    pub extra_routes: String,
    /// Environment variables a child proxy is started with (e.g. record keys).
    pub env: Vec<(String, String)>,
}

impl TestConfig {
    pub fn new(store: StoreKind, upstream: &str) -> TestConfig {
        TestConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            store,
            store_timeout: "300ms".into(),
            upstream: upstream.into(),
            upstream_timeout: "5s".into(),
            retention: "1h".into(),
            idempotency: String::new(),
            server: String::new(),
            store_extra: String::new(),
            upstream_extra: String::new(),
            admin_extra: String::new(),
            extra_routes: String::new(),
            env: Vec::new(),
        }
    }

    pub fn toml(&self) -> String {
        let list = |urls: &[String]| urls.iter().map(|url| format!("{url:?}")).collect::<Vec<_>>().join(", ");
        let store = match &self.store {
            StoreKind::Memory => "backend = \"memory\"".to_string(),
            StoreKind::Sqlite(path) => format!("backend = \"sqlite\"\npath = {:?}", path.display().to_string()),
            StoreKind::Redis(url) => format!("backend = \"redis\"\nurl = \"{url}\""),
            StoreKind::Sentinel(urls, master) => {
                format!(
                    "backend = \"redis-sentinel\"\nurls = [{}]\nmaster_name = \"{master}\"",
                    list(urls)
                )
            }
            StoreKind::Cluster(urls) => format!("backend = \"redis-cluster\"\nurls = [{}]", list(urls)),
            StoreKind::Postgres(url) => format!("backend = \"postgres\"\nurl = \"{url}\""),
        };
        format!(
            r#"
[server]
listen = "{listen}"
{server}

[admin]
listen = "{admin}"
{admin_extra}

[store]
{store}
timeout = "{store_timeout}"
{store_extra}

[[route]]
name = "payments"
path_prefix = "/v1/payments"
upstream = "{upstream}"
upstream_timeout = "{upstream_timeout}"
{upstream_extra}

[route.idempotency]
retention = "{retention}"
{idempotency}

[[route]]
name = "orders"
path_prefix = "/v1/orders"
upstream = "{upstream}"
upstream_timeout = "{upstream_timeout}"

[route.idempotency]
required = false
retention = "{retention}"

[[route]]
name = "reads"
path_prefix = "/v1/reads"
upstream = "{upstream}"
upstream_timeout = "{upstream_timeout}"

{extra_routes}
"#,
            extra_routes = self.extra_routes,
            listen = self.listen,
            server = self.server,
            admin = self.admin_listen,
            admin_extra = self.admin_extra,
            store_timeout = self.store_timeout,
            store_extra = self.store_extra,
            upstream_extra = self.upstream_extra,
            upstream = self.upstream,
            upstream_timeout = self.upstream_timeout,
            retention = self.retention,
            idempotency = self.idempotency,
        )
    }

    pub fn config(&self) -> Config {
        Config::parse(&self.toml(), Path::new("test.toml")).unwrap_or_else(|error| panic!("test config: {error}"))
    }

    pub async fn start(&self) -> ProxyHandle {
        let running = idemproxy::start(self.config()).await.expect("start the proxy");
        ProxyHandle { running }
    }

    /// Writes the config to a file of its own, for tests that run the binary; the
    /// file is removed when the returned handle drops.
    pub fn write_temp(&self) -> tempfile::NamedTempFile {
        let file = tempfile::Builder::new()
            .prefix("idemproxy-")
            .suffix(".toml")
            .tempfile()
            .expect("create a temporary config file");
        std::fs::write(file.path(), self.toml()).expect("write the test config");
        file
    }
}

pub struct ProxyHandle {
    pub running: Running,
}

/// The proxy's worker threads outlive the test's runtime: stop them with the test.
impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.running.shutdown_token().cancel();
    }
}

impl ProxyHandle {
    pub fn addr(&self) -> SocketAddr {
        self.running.addr
    }

    pub fn admin(&self) -> SocketAddr {
        self.running.admin_addr.expect("the test config has an admin listener")
    }
}

/// The first line of the proxy's log at `log` that contains `needle`; the whole log in
/// the failure when none does.
pub fn log_line(log: &Path, needle: &str) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_else(|error| panic!("read {}: {error}", log.display()));
    text.lines()
        .find(|line| line.contains(needle))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no line with {needle:?} in the log:\n{text}"))
}

/// Where a child proxy's log goes: nowhere, or with `IDEMPROXY_TEST_LOGS=DIR` set (to
/// debug a failing test) into `DIR/idemproxy-PORT.log`.
fn child_log(port: u16) -> std::process::Stdio {
    match std::env::var_os("IDEMPROXY_TEST_LOGS") {
        Some(dir) => std::fs::File::create(std::path::Path::new(&dir).join(format!("idemproxy-{port}.log")))
            .map_or_else(|_| std::process::Stdio::null(), std::process::Stdio::from),
        None => std::process::Stdio::null(),
    }
}

/// How a child proxy is started: through what, logging where, with which global
/// arguments, and ready when which admin path answers 200.
struct Launch<'a> {
    launcher: &'a [&'a str],
    log: Option<&'a Path>,
    args: &'a [&'a str],
    up: &'a str,
}

/// The idemproxy binary as a child process, killed when dropped.
pub struct ChildProxy {
    pub child: std::process::Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// The config file the child reads, removed with it.
    _config: tempfile::NamedTempFile,
}

impl ChildProxy {
    /// Starts the binary with `config` on fresh ports and waits until `/readyz`
    /// answers 200 (a poll on a condition, bounded at 20 s).
    pub async fn start(config: &TestConfig) -> ChildProxy {
        ChildProxy::start_via(config, &[], None).await
    }

    /// Like `start`, with the binary run by `launcher` (e.g. `prlimit --nofile=...`)
    /// and its log, at `RUST_LOG=info`, written to `log` if given. Ports that were
    /// free a moment ago may be taken when the child binds them: a child that exits
    /// at once is started again on other ports.
    pub async fn start_via(config: &TestConfig, launcher: &[&str], log: Option<&Path>) -> ChildProxy {
        let launch = Launch {
            launcher,
            log,
            args: &[],
            up: "/readyz",
        };
        ChildProxy::start_until(config, &launch).await
    }

    /// Like `start_via` with no launcher, waiting only until `/healthz` answers: for a
    /// proxy whose store cannot serve.
    pub async fn start_live(config: &TestConfig, log: Option<&Path>) -> ChildProxy {
        let launch = Launch {
            launcher: &[],
            log,
            args: &[],
            up: "/healthz",
        };
        ChildProxy::start_until(config, &launch).await
    }

    /// Like `start`, logging at `RUST_LOG=info` to `log`, with `args` (e.g.
    /// `--log-format json`) before the subcommand.
    pub async fn start_logged(config: &TestConfig, log: &Path, args: &[&str]) -> ChildProxy {
        let launch = Launch {
            launcher: &[],
            log: Some(log),
            args,
            up: "/readyz",
        };
        ChildProxy::start_until(config, &launch).await
    }

    async fn start_until(config: &TestConfig, launch: &Launch<'_>) -> ChildProxy {
        for _ in 0..5 {
            if let Some(proxy) = ChildProxy::try_start(config, launch).await {
                return proxy;
            }
        }
        panic!("the idemproxy binary exited at start on five sets of free ports in a row");
    }

    async fn try_start(config: &TestConfig, launch: &Launch<'_>) -> Option<ChildProxy> {
        let Launch {
            launcher,
            log,
            args,
            up,
        } = *launch;
        let mut config = config.clone();
        let port = free_port();
        let admin_port = free_port();
        config.listen = format!("127.0.0.1:{port}");
        config.admin_listen = format!("127.0.0.1:{admin_port}");
        let file = config.write_temp();
        let mut command = binary_command(launcher);
        let stderr = match log {
            Some(path) => std::process::Stdio::from(std::fs::File::create(path).expect("create the log file")),
            None => child_log(port),
        };
        let child = command
            .args(args)
            .args(["serve", "--config"])
            .arg(file.path())
            .env("RUST_LOG", if log.is_some() { "info" } else { "warn" })
            .envs(config.env.iter().map(|(name, value)| (name, value)))
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start the idemproxy binary");
        let mut proxy = ChildProxy {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            admin: ([127, 0, 0, 1], admin_port).into(),
            _config: file,
        };
        let started = tokio::time::Instant::now();
        loop {
            let ready = super::client::try_send(proxy.admin, "GET", up, &[], "").await;
            if ready.map(|r| r.status == 200).unwrap_or(false) {
                return Some(proxy);
            }
            if let Ok(Some(_)) = proxy.child.try_wait() {
                return None;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "the idemproxy binary did not answer {up} with 200"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// The config file the child reads (with the ports it was given).
    pub fn config_path(&self) -> &Path {
        self._config.path()
    }

    /// Writes `config` (on this child's ports) over the file the child reads.
    pub fn rewrite(&self, config: &TestConfig) {
        let mut config = config.clone();
        config.listen = self.addr.to_string();
        config.admin_listen = self.admin.to_string();
        self.write(&config.toml());
    }

    /// Writes `text` over the file the child reads.
    pub fn write(&self, text: &str) {
        std::fs::write(self._config.path(), text).expect("rewrite the child's config");
    }

    /// Sends `signal` (e.g. "HUP") to the child.
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildProxy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The built binary as a command, run through `launcher` (a program and its arguments,
/// e.g. `setpriv` to run it as another user) when one is given.
pub fn binary_command(launcher: &[&str]) -> std::process::Command {
    let binary = env!("CARGO_BIN_EXE_idemproxy");
    match launcher.split_first() {
        Some((program, args)) => {
            let mut command = std::process::Command::new(program);
            command.args(args).arg(binary);
            command
        }
        None => std::process::Command::new(binary),
    }
}
