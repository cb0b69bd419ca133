//! Redis over TLS with a private CA and client certificates (`store.tls_ca_file`,
//! `store.tls_cert_file`, `store.tls_key_file`), against a real `redis-server
//! --tls-port` with certificates made in the test (rcgen). The store behaviour suite
//! over TLS is in `tests/store.rs` (`redis_tls_store`).

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::path::Path;

use support::pki::{Issued, Pki};
use support::redis_server::ServerTls;
use support::topology::{RedisCluster, Sentinel};
use support::{ChildProxy, RedisServer, StoreKind, TestConfig, Upstream, send};

/// A TLS `redis-server` whose certificate `pki` signed; with `auth_clients`, it takes
/// only clients whose certificate `pki` signed.
fn tls_redis(pki: &Pki, auth_clients: bool) -> RedisServer {
    RedisServer::start_tls(&node_tls(pki, auth_clients))
}

/// A node certificate `pki` signed, for a Redis node or sentinel.
fn node_tls(pki: &Pki, auth_clients: bool) -> ServerTls {
    let issued = pki.node();
    ServerTls {
        cert_file: issued.cert_file,
        key_file: issued.key_file,
        ca_file: pki.ca_file.clone(),
        auth_clients,
    }
}

/// A proxy config on `redis`'s TLS port with these `[store]` TLS settings.
fn config(upstream: &Upstream, redis: &RedisServer, ca: Option<&Path>, client: Option<&Issued>) -> TestConfig {
    store_config(StoreKind::Redis(redis.tls_url()), upstream, ca, client)
}

fn store_config(store: StoreKind, upstream: &Upstream, ca: Option<&Path>, client: Option<&Issued>) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_extra.push_str(&support::pki::store_tls_lines(ca, client));
    config
}

async fn post(proxy: &ChildProxy, key: &str) -> support::TestResponse {
    send(proxy.addr, "POST", "/v1/payments", &[("idempotency-key", key)], "{}").await
}

/// The store's CA accepted: the claim and the record travel over TLS, the retry replays,
/// and the record is in that Redis.
#[tokio::test]
async fn a_redis_with_a_private_ca_is_used_over_tls() {
    let pki = Pki::new("redis CA");
    let redis = tls_redis(&pki, false);
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&config(&upstream, &redis, Some(&pki.ca_file), None)).await;
    let first = post(&proxy, "tls-1").await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = post(&proxy, "tls-1").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("tls-1"), 1);
    assert_eq!(redis.keys().len(), 1, "the record is in the TLS server's database");
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut redis.connection())
        .expect("CLIENT LIST");
    assert!(
        clients
            .lines()
            .any(|line| line.contains("flags=") && !line.contains("cmd=client")),
        "the proxy holds a connection: {clients}"
    );
}

/// The user's report: a Redis certificate from a CA the store does not trust (the
/// webpki roots only, or another private CA) is refused. Every guarded request gets
/// 503 with nothing forwarded, `/readyz` says 503, and the log names the problem.
#[tokio::test]
async fn a_redis_certificate_from_an_untrusted_ca_is_refused_and_nothing_is_forwarded() {
    let pki = Pki::new("redis CA");
    let other = Pki::new("another CA");
    let redis = tls_redis(&pki, false);
    let upstream = Upstream::start().await;
    let logs = tempfile::tempdir().expect("temp dir");
    for (name, ca) in [("webpki-roots", None), ("another-ca", Some(other.ca_file.as_path()))] {
        let log = logs.path().join(format!("{name}.log"));
        let mut proxy = ChildProxy::start_live(&config(&upstream, &redis, ca, None), Some(&log)).await;
        let key = format!("refused-{name}");
        let refused = post(&proxy, &key).await;
        assert_eq!(refused.status, 503, "{name}: {refused:?}");
        assert_eq!(refused.problem(), "store-unavailable", "{name}");
        assert_eq!(upstream.executions(&key), 0, "{name}: nothing was forwarded");
        let ready = send(proxy.admin, "GET", "/readyz", &[], "").await;
        assert_eq!(ready.status, 503, "{name}: {ready:?}");
        proxy.kill();
        let text = std::fs::read_to_string(&log).expect("read the log");
        // One line for the refused request and one for readiness lost, each naming the
        // certificate problem once, at WARN.
        let named: Vec<_> = text.lines().filter(|line| line.contains("UnknownIssuer")).collect();
        assert_eq!(named.len(), 2, "{name}:\n{text}");
        assert!(
            named[0].contains("WARN")
                && named[0].contains("problem=\"store-unavailable\"")
                && named[0].contains("cause=\"handshake\"")
                && named[0].contains("the store's handshake failed"),
            "{name}: {}",
            named[0]
        );
        assert!(
            named[1].contains("WARN") && named[1].contains("not ready"),
            "{name}: {}",
            named[1]
        );
        for line in named {
            assert_eq!(
                line.matches("invalid peer certificate").count(),
                1,
                "said twice: {line}"
            );
        }
    }
    assert!(redis.keys().is_empty(), "nothing was claimed");
}

/// `tls-auth-clients yes`: without a client certificate the server closes the
/// handshake (503, nothing forwarded); with one the CA signed, the store serves.
#[tokio::test]
async fn a_redis_that_requires_client_certificates_takes_the_configured_one() {
    let pki = Pki::new("redis CA");
    let redis = tls_redis(&pki, true);
    let upstream = Upstream::start().await;

    let without = ChildProxy::start_live(&config(&upstream, &redis, Some(&pki.ca_file), None), None).await;
    let refused = post(&without, "mtls").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(upstream.executions("mtls"), 0);
    assert_eq!(send(without.admin, "GET", "/readyz", &[], "").await.status, 503);
    drop(without);

    let strangers = Pki::new("a stranger's CA");
    let stranger = strangers.client("stranger", false);
    let foreign = ChildProxy::start_live(&config(&upstream, &redis, Some(&pki.ca_file), Some(&stranger)), None).await;
    assert_eq!(
        post(&foreign, "mtls").await.status,
        503,
        "a certificate from another CA"
    );
    assert_eq!(upstream.executions("mtls"), 0);
    drop(foreign);

    let client = pki.client("idemproxy", false);
    let with = ChildProxy::start(&config(&upstream, &redis, Some(&pki.ca_file), Some(&client))).await;
    let accepted = post(&with, "mtls").await;
    assert_eq!(accepted.status, 201, "{accepted:?}");
    assert!(post(&with, "mtls").await.replayed());
    assert_eq!(upstream.executions("mtls"), 1);
}

/// Sentinel over TLS: the proxy asks a sentinel that takes only TLS clients with a
/// certificate, and speaks TLS with the same certificate to the primary it names, which
/// also requires one. Without the certificate, neither answers.
#[tokio::test]
async fn a_sentinel_and_its_primary_over_tls_with_client_certificates() {
    let pki = Pki::new("redis CA");
    let tls = node_tls(&pki, true);
    let primary = RedisServer::start_tls(&tls);
    let sentinel = Sentinel::start_tls("tls-group", primary.tls_port(), &tls);
    assert_eq!(
        sentinel.primary("tls-group"),
        Some(("127.0.0.1".to_string(), primary.tls_port())),
        "the sentinel names the primary's TLS port"
    );
    let upstream = Upstream::start().await;
    let client = pki.client("idemproxy", false);
    let store = StoreKind::Sentinel(vec![sentinel.tls_url()], "tls-group".into());

    let without = ChildProxy::start_live(&store_config(store.clone(), &upstream, Some(&pki.ca_file), None), None).await;
    assert_eq!(post(&without, "sentinel-tls").await.status, 503);
    assert_eq!(upstream.executions("sentinel-tls"), 0);
    drop(without);

    let proxy = ChildProxy::start(&store_config(store, &upstream, Some(&pki.ca_file), Some(&client))).await;
    let first = post(&proxy, "sentinel-tls").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(post(&proxy, "sentinel-tls").await.replayed());
    assert_eq!(upstream.executions("sentinel-tls"), 1);
    assert_eq!(
        primary.keys().len(),
        1,
        "the record is on the primary the sentinel names"
    );
}

/// A Redis Cluster over TLS (clients and cluster bus), with client certificates: the
/// seed and every node the slot map names are reached with the configured CA and
/// certificate, and records spread over the primaries.
#[tokio::test]
async fn a_redis_cluster_over_tls_with_client_certificates() {
    let pki = Pki::new("redis CA");
    let cluster = RedisCluster::start_tls(&node_tls(&pki, true));
    let upstream = Upstream::start().await;
    let client = pki.client("idemproxy", false);
    let store = StoreKind::Cluster(cluster.tls_urls());
    let without = ChildProxy::start_live(&store_config(store.clone(), &upstream, Some(&pki.ca_file), None), None).await;
    assert_eq!(
        post(&without, "cluster-tls-0").await.status,
        503,
        "no client certificate"
    );
    assert_eq!(send(without.admin, "GET", "/readyz", &[], "").await.status, 503);
    drop(without);
    let proxy = ChildProxy::start(&store_config(store, &upstream, Some(&pki.ca_file), Some(&client))).await;
    let keys: Vec<String> = (0..12).map(|n| format!("cluster-tls-{n}")).collect();
    for key in &keys {
        let first = post(&proxy, key).await;
        assert_eq!(first.status, 201, "{key}: {first:?}");
        assert!(post(&proxy, key).await.replayed(), "{key}");
        assert_eq!(upstream.executions(key), 1, "{key}");
    }
    let per_node: Vec<usize> = cluster.nodes.iter().map(|node| node.keys().len()).collect();
    assert_eq!(per_node.iter().sum::<usize>(), keys.len(), "{per_node:?}");
    assert!(
        per_node.iter().filter(|count| **count > 0).count() >= 2,
        "records on one node only: {per_node:?}"
    );
}

/// `idemproxy check` reads each store TLS file and names a bad one by `file:line: field:`.
#[test]
fn bad_store_tls_files_are_named_by_their_field() {
    let pki = Pki::new("redis CA");
    let client = pki.client("idemproxy", false);
    let other = pki.client("other", false);
    let route = "[[route]]\nname = \"r\"\npath_prefix = \"/\"\nupstream = \"http://127.0.0.1:9\"\n";
    let store = |url: &str, lines: &[(&str, &Path)]| {
        let mut text = format!("[store]\nbackend = \"redis\"\nurl = \"{url}\"\n");
        for (field, path) in lines {
            text.push_str(&format!("{field} = \"{}\"\n", path.display()));
        }
        format!("{text}{route}")
    };
    let tls_url = "rediss://localhost:6380/0";
    let missing = Path::new("/nonexistent/ca.pem");
    let (cert, key) = (client.cert_file.as_path(), client.key_file.as_path());
    for (text, needle) in [
        (
            store(tls_url, &[("tls_ca_file", missing)]),
            "t.toml:4: store.tls_ca_file: cannot read /nonexistent/ca.pem",
        ),
        (store(tls_url, &[("tls_ca_file", key)]), "t.toml:4: store.tls_ca_file:"),
        (
            store(tls_url, &[("tls_cert_file", key), ("tls_key_file", key)]),
            "t.toml:4: store.tls_cert_file:",
        ),
        (
            store(tls_url, &[("tls_cert_file", cert), ("tls_key_file", cert)]),
            "t.toml:5: store.tls_key_file:",
        ),
        (
            store(
                tls_url,
                &[("tls_cert_file", cert), ("tls_key_file", other.key_file.as_path())],
            ),
            "t.toml:5: store.tls_key_file: does not go with store.tls_cert_file",
        ),
        (
            store(tls_url, &[("tls_cert_file", cert)]),
            "t.toml:4: store.tls_cert_file: needs store.tls_key_file",
        ),
        (
            store(tls_url, &[("tls_key_file", key)]),
            "t.toml:4: store.tls_key_file: needs store.tls_cert_file",
        ),
        (
            store("redis://localhost:6379/0", &[("tls_ca_file", pki.ca_file.as_path())]),
            "t.toml:4: store.tls_ca_file: TLS settings need a rediss:// store URL",
        ),
        (
            format!("[store]\ntls_ca_file = \"{}\"\n{route}", pki.ca_file.display()),
            "t.toml:2: store.tls_ca_file: the memory backend has no such setting (redis, redis-sentinel, redis-cluster and postgres use it)",
        ),
    ] {
        let error = idemproxy::Config::parse(&text, Path::new("t.toml")).expect_err("refused");
        assert!(error.to_string().contains(needle), "{needle:?} not in {error}");
    }
    let good = store(
        tls_url,
        &[
            ("tls_ca_file", pki.ca_file.as_path()),
            ("tls_cert_file", cert),
            ("tls_key_file", key),
        ],
    );
    let config = idemproxy::Config::parse(&good, Path::new("t.toml")).expect("valid");
    let summary = config.to_string();
    assert!(
        summary.contains(&format!(
            "TLS trusting {}, client certificate {}",
            pki.ca_file.display(),
            client.cert_file.display()
        )),
        "{summary}"
    );
}
