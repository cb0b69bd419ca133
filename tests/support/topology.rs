//! Redis topologies for one test, on free ports, from the same `redis-server` binary:
//! a Sentinel group (one primary, two replicas, three sentinels) and a Redis Cluster
//! (three primaries, three replicas, made with `redis-cli --cluster create`). Each
//! waits until it is whole before it returns, and is torn down when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::proxy::free_port;
use super::redis_server::{RedisServer, ServerTls, binary};
use super::relay::Relay;

/// How long a topology may take to become whole, or to fail over.
const SETTLE: Duration = Duration::from_secs(30);

/// Polls `condition` every 50 ms until it holds: a wait on a condition, bounded.
pub fn until(what: &str, bound: Duration, mut condition: impl FnMut() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < bound, "{what}: not after {bound:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn query<T: redis::FromRedisValue>(port: u16, command: &mut redis::Cmd) -> redis::RedisResult<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut connection = client.get_connection_with_timeout(Duration::from_millis(500))?;
    command.query(&mut connection)
}

/// `INFO replication` of the node on `port`, as `field:value` lines.
pub fn replication(port: u16) -> String {
    query(port, redis::cmd("INFO").arg("replication")).unwrap_or_default()
}

/// The role the node on `port` reports: `master` or `slave`.
pub fn role(port: u16) -> Option<String> {
    replication(port)
        .lines()
        .find_map(|line| line.strip_prefix("role:").map(|role| role.trim().to_string()))
}

// === Sentinel ===

/// One `redis-server --sentinel` process.
pub struct Sentinel {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    /// With TLS: the port it listens on for TLS, beside the plain `port`.
    tls_port: Option<u16>,
}

impl Sentinel {
    /// A sentinel on a free port, started again on another if it exits at once (its
    /// port was taken in between).
    fn start(master_name: &str, primary: u16) -> Sentinel {
        Sentinel::start_on(master_name, primary, 2, None)
    }

    /// The only sentinel of a primary that speaks TLS only to it (on `primary_tls_port`)
    /// and also listens for TLS itself (`tls_url`), with `tls`'s certificate.
    pub fn start_tls(master_name: &str, primary_tls_port: u16, tls: &ServerTls) -> Sentinel {
        Sentinel::start_on(master_name, primary_tls_port, 1, Some(tls))
    }

    fn start_on(master_name: &str, primary: u16, quorum: u8, tls: Option<&ServerTls>) -> Sentinel {
        for _ in 0..5 {
            let port = free_port();
            let tls_port = tls.map(|_| free_port());
            let tls_lines = match (tls, tls_port) {
                (Some(tls), Some(tls_port)) => format!(
                    "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
                     tls-auth-clients {}\ntls-replication yes\n",
                    tls.cert_file.display(),
                    tls.key_file.display(),
                    tls.ca_file.display(),
                    if tls.auth_clients { "yes" } else { "no" }
                ),
                _ => String::new(),
            };
            let dir = std::env::temp_dir().join(format!("idemproxy-sentinel-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create a directory for the sentinel");
            // The sentinel rewrites its own config file: each has one of its own.
            let config = dir.join("sentinel.conf");
            std::fs::write(
                &config,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel resolve-hostnames no\n\
                     sentinel monitor {master_name} 127.0.0.1 {primary} {quorum}\n\
                     sentinel down-after-milliseconds {master_name} 1000\n\
                     sentinel failover-timeout {master_name} 10000\n\
                     sentinel parallel-syncs {master_name} 2\n{tls_lines}",
                    dir.display()
                ),
            )
            .expect("write the sentinel config");
            let child = Command::new(binary())
                .arg(&config)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server --sentinel");
            let mut sentinel = Sentinel {
                child: Some(child),
                port,
                dir,
                tls_port,
            };
            let mut exited = false;
            until("a sentinel answers or exits", SETTLE, || {
                if let Some(child) = &mut sentinel.child
                    && let Ok(Some(_)) = child.try_wait()
                {
                    exited = true;
                    return true;
                }
                query::<String>(port, &mut redis::cmd("PING")).is_ok()
            });
            if !exited {
                return sentinel;
            }
            sentinel.child = None;
        }
        panic!("redis-server --sentinel exited at start on five free ports in a row");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn tls_url(&self) -> String {
        format!(
            "rediss://127.0.0.1:{}",
            self.tls_port.expect("a sentinel started with start_tls")
        )
    }

    /// The primary this sentinel names, as `(ip, port)`.
    pub fn primary(&self, master_name: &str) -> Option<(String, u16)> {
        let named: Vec<String> = query(
            self.port,
            redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg(master_name),
        )
        .ok()?;
        Some((named.first()?.clone(), named.get(1)?.parse().ok()?))
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn replica_of(port: u16) -> RedisServer {
    RedisServer::start_with_args(false, vec!["--replicaof".into(), "127.0.0.1".into(), port.to_string()])
}

/// One primary, two replicas and three sentinels that monitor them as `MASTER_NAME`,
/// with a quorum of two and a primary declared down after 1 s without an answer.
pub struct SentinelGroup {
    /// The data nodes, the first the primary at the start.
    pub nodes: Vec<RedisServer>,
    pub sentinels: Vec<Sentinel>,
    /// With `start_relayed`: the relay each replica's replication link runs through,
    /// so that a test can cut replication off (a blackhole) without the replica
    /// catching up from its socket buffers later, as it would after SIGSTOP.
    pub relays: Vec<Relay>,
}

pub const MASTER_NAME: &str = "idemproxy";

impl SentinelGroup {
    pub fn start() -> SentinelGroup {
        let primary = RedisServer::start_with_args(false, Vec::new());
        let replicas = (0..2).map(|_| replica_of(primary.port)).collect();
        SentinelGroup::assemble(primary, replicas, Vec::new())
    }

    /// Like `start`, with each replica replicating through a relay of its own.
    pub async fn start_relayed() -> SentinelGroup {
        let primary = RedisServer::start_with_args(false, Vec::new());
        let mut relays = Vec::new();
        let mut replicas = Vec::new();
        for _ in 0..2 {
            let relay = Relay::start(([127, 0, 0, 1], primary.port).into()).await;
            replicas.push(replica_of(relay.addr.port()));
            relays.push(relay);
        }
        SentinelGroup::assemble(primary, replicas, relays)
    }

    fn assemble(primary: RedisServer, replicas: Vec<RedisServer>, relays: Vec<Relay>) -> SentinelGroup {
        let primary_port = primary.port;
        let mut nodes = vec![primary];
        nodes.extend(replicas);
        let group = SentinelGroup {
            sentinels: (0..3).map(|_| Sentinel::start(MASTER_NAME, primary_port)).collect(),
            nodes,
            relays,
        };
        group.until_whole(primary_port);
        group
    }

    /// Waits until `primary` serves two replicas in sync and every sentinel knows the
    /// two replicas and the two other sentinels.
    pub fn until_whole(&self, primary: u16) {
        until("the primary has two replicas in sync", SETTLE, || {
            let info = replication(primary);
            info.contains("connected_slaves:2")
                && self
                    .nodes
                    .iter()
                    .filter(|node| node.port != primary && node.is_running())
                    .all(|node| replication(node.port).contains("master_link_status:up"))
        });
        for sentinel in &self.sentinels {
            until("every sentinel knows the group", SETTLE, || {
                let replicas: Vec<redis::Value> =
                    query(sentinel.port, redis::cmd("SENTINEL").arg("REPLICAS").arg(MASTER_NAME)).unwrap_or_default();
                let sentinels: Vec<redis::Value> =
                    query(sentinel.port, redis::cmd("SENTINEL").arg("SENTINELS").arg(MASTER_NAME)).unwrap_or_default();
                replicas.len() == 2 && sentinels.len() == 2 && self.primary_by(sentinel.port) == Some(primary)
            });
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Sentinel::url).collect()
    }

    /// The primary's port as the sentinel on `port` names it.
    fn primary_by(&self, port: u16) -> Option<u16> {
        let addr: Vec<String> = query(
            port,
            redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(MASTER_NAME),
        )
        .ok()?;
        addr.get(1)?.parse().ok()
    }

    /// The primary's port, as most sentinels name it.
    pub fn primary(&self) -> Option<u16> {
        let named: Vec<u16> = self.sentinels.iter().filter_map(|s| self.primary_by(s.port)).collect();
        named
            .iter()
            .copied()
            .find(|port| named.iter().filter(|other| *other == port).count() >= 2)
    }

    /// Waits until the sentinels name a primary other than `old` that says it is one,
    /// and returns it.
    pub fn until_promoted(&self, old: u16) -> u16 {
        let mut promoted = 0;
        until("the sentinels promote a replica", SETTLE, || match self.primary() {
            Some(port) if port != old && role(port).as_deref() == Some("master") => {
                promoted = port;
                true
            }
            _ => false,
        });
        promoted
    }

    pub fn node(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of the group")
    }

    /// Every key of the current primary with its PTTL, for the history checker.
    pub fn dump_ttls(&self) -> Vec<(String, i64)> {
        let primary = self.primary().expect("a primary");
        self.nodes
            .iter()
            .find(|node| node.port == primary)
            .expect("the primary is a node of the group")
            .dump_ttls()
    }

    /// The replicas of the current primary.
    pub fn replica_ports(&self, primary: u16) -> Vec<u16> {
        self.nodes
            .iter()
            .map(|node| node.port)
            .filter(|port| *port != primary)
            .collect()
    }
}

// === Cluster ===

/// Three primaries and three replicas, a node declared failed after 1 s.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start_with_args(
                    false,
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                    ]
                    .map(String::from)
                    .to_vec(),
                )
            })
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|node| format!("127.0.0.1:{}", node.port)))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run redis-cli --cluster create (Debian: apt-get install redis-tools)");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = RedisCluster { nodes };
        cluster.until_whole();
        cluster
    }

    /// Three primaries, no replicas, that speak TLS to clients and on the cluster bus
    /// (`tls-cluster yes`) with `tls`'s certificate; made over TLS with `redis-cli`.
    pub fn start_tls(tls: &ServerTls) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_tls_with_args(
                    tls,
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--tls-cluster",
                        "yes",
                    ]
                    .map(String::from)
                    .to_vec(),
                )
            })
            .collect();
        let mut command = Command::new("redis-cli");
        command.args(["--tls", "--cacert"]).arg(&tls.ca_file);
        if tls.auth_clients {
            command
                .arg("--cert")
                .arg(&tls.cert_file)
                .arg("--key")
                .arg(&tls.key_file);
        }
        let output = command
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|node| format!("127.0.0.1:{}", node.tls_port())))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create (Debian: apt-get install redis-tools)");
        assert!(
            output.status.success(),
            "redis-cli --tls --cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        for node in &nodes {
            until("every node sees cluster_state:ok", SETTLE, || {
                let info: String = query(node.port, redis::cmd("CLUSTER").arg("INFO")).unwrap_or_default();
                info.contains("cluster_state:ok")
            });
        }
        RedisCluster { nodes }
    }

    /// Seed URLs for a cluster started with `start_tls`.
    pub fn tls_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| format!("rediss://127.0.0.1:{}", node.tls_port()))
            .collect()
    }

    /// Waits until every running node sees every slot served and each primary has a
    /// replica in sync.
    pub fn until_whole(&self) {
        for node in self.nodes.iter().filter(|node| node.is_running()) {
            until("every node sees cluster_state:ok", SETTLE, || {
                let info: String = query(node.port, redis::cmd("CLUSTER").arg("INFO")).unwrap_or_default();
                info.contains("cluster_state:ok")
            });
        }
        until("each primary has a replica in sync", SETTLE, || {
            self.primaries()
                .iter()
                .all(|primary| replication(*primary).contains("connected_slaves:1"))
                && self
                    .replicas()
                    .iter()
                    .all(|replica| replication(*replica).contains("master_link_status:up"))
        });
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .take(3)
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect()
    }

    fn with_role(&self, wanted: &str) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|node| node.is_running())
            .map(|node| node.port)
            .filter(|port| role(*port).as_deref() == Some(wanted))
            .collect()
    }

    pub fn primaries(&self) -> Vec<u16> {
        self.with_role("master")
    }

    pub fn replicas(&self) -> Vec<u16> {
        self.with_role("slave")
    }

    /// The replica of `primary`.
    pub fn replica_of(&self, primary: u16) -> Option<u16> {
        self.replicas().into_iter().find(|replica| {
            replication(*replica)
                .lines()
                .any(|line| line.trim() == format!("master_port:{primary}"))
        })
    }

    pub fn node(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of the cluster")
    }

    /// Every key of every primary with its PTTL, for the history checker.
    pub fn dump_ttls(&self) -> Vec<(String, i64)> {
        let primaries = self.primaries();
        self.nodes
            .iter()
            .filter(|node| primaries.contains(&node.port))
            .flat_map(RedisServer::dump_ttls)
            .collect()
    }

    /// The node id of the node on `port`.
    pub fn id(&self, port: u16) -> String {
        query(port, redis::cmd("CLUSTER").arg("MYID")).expect("CLUSTER MYID")
    }

    /// Runs a command on the node on `port`.
    pub fn on<T: redis::FromRedisValue>(&self, port: u16, command: &mut redis::Cmd) -> redis::RedisResult<T> {
        query(port, command)
    }
}

/// Returns the moment something is true, polled every 10 ms, bounded.
pub async fn when(what: &str, bound: Duration, mut condition: impl AsyncFnMut() -> bool) -> Instant {
    let started = Instant::now();
    loop {
        if condition().await {
            return Instant::now();
        }
        assert!(started.elapsed() < bound, "{what}: not after {bound:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
