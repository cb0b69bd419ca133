//! The Postgres store through real proxy processes and a Postgres of the test's own
//! (docs/design.md §22): storms of 1,000 keys through the history checker with no
//! fault, with Postgres restarted (`-m fast`, `-m immediate`) and with its connections
//! reset mid-storm; a statement stalled past `store.timeout` on a lock the test holds;
//! a synchronous standby promoted after its primary is killed; waiters woken by
//! `NOTIFY`; and each bad setting named at start. Run with `-- --nocapture` for the
//! figures.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use std::path::Path;

use support::client::post;
use support::pki::{Issued, Pki};
use support::storm::{Storm, until_progress};
use support::topology::until;
use support::{ChildProxy, Mode, PostgresServer, Relay, StoreKind, TestConfig, Upstream};
use tokio::time::Instant;

const RETENTION: Duration = Duration::from_secs(3600);

fn config(url: &str, upstream: &str, store_timeout: &str) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Postgres(url.to_string()), upstream);
    config.store_timeout = store_timeout.into();
    config.idempotency = "scope_headers = [\"authorization\"]".into();
    config
}

/// A storm of 1,000 keys (two tenants each) with `duplicates` each through
/// `proxies`, `fault` run once a third of it is sent; the history is checked against
/// what the schema holds after.
async fn storm(
    name: &'static str,
    proxies: &[ChildProxy],
    duplicates: usize,
    upstream: &Upstream,
    server: &mut PostgresServer,
    fault: impl AsyncFnOnce(&mut PostgresServer, &support::storm::StormRun, usize),
) -> (support::history::Report, support::storm::Liveness) {
    let storm = Storm {
        name,
        targets: proxies.iter().map(|proxy| proxy.addr).collect(),
        logical: 1000,
        duplicates,
        concurrency: 64,
        jitter_ms: 30,
        streamed: false,
    };
    let run = storm.start();
    let from = Instant::now();
    let total = storm.total();
    let ((), ()) = tokio::join!(storm.run(&run), fault(server, &run, total));
    let outage = (from, Instant::now());
    let liveness = storm.settle(&run).await;
    let report = storm.check(
        &run,
        &upstream.log(),
        &server.dump_ttls("idemproxy"),
        RETENTION,
        vec![outage],
    );
    println!(
        "{name}: {} ops in {:.1?}: {report:?}",
        storm.total(),
        run.started.elapsed()
    );
    (report, liveness)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_across_three_proxy_processes_on_postgres_runs_each_key_once() {
    let mut server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let config = config(&server.url(), &upstream.url(), "2s");
    let proxies = [
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
        ChildProxy::start(&config).await,
    ];
    let (report, liveness) = storm("pg-storm", &proxies, 10, &upstream, &mut server, async |_, _, _| {}).await;
    report.assert_clean("postgres storm: 3 processes, 1000 keys x 10");
    liveness.assert_live("postgres storm", 1.0);
    assert_eq!(report.max_executions_per_key, 1);
    assert_eq!(report.executions, 1000, "every logical operation ran exactly once");
    assert_eq!(report.unknown, 0);
}

/// Postgres stopped (`mode`) when 30 % of the storm is sent and started again at 40 %:
/// requests meanwhile get 503 with nothing forwarded, and no key runs twice.
async fn postgres_restarted_mid_storm(mode: &'static str) {
    let mut server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let config = config(&server.url(), &upstream.url(), "500ms");
    let proxies = [ChildProxy::start(&config).await, ChildProxy::start(&config).await];
    let (report, liveness) = storm(
        "pg-restart",
        &proxies,
        5,
        &upstream,
        &mut server,
        async |server, run, total| {
            until_progress(run, total * 3 / 10).await;
            server.stop(mode);
            until_progress(run, total * 4 / 10).await;
            server.start_again();
        },
    )
    .await;
    report.assert_clean(&format!("postgres stopped -m {mode} and started mid-storm"));
    // A key whose request was forwarded while its answer could not be recorded ends
    // unknown (409, never run again): the few in flight at the stop.
    liveness.assert_live(&format!("postgres -m {mode}"), 0.95);
    assert!(report.max_executions_per_key <= 1, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_fast_and_started_mid_storm() {
    postgres_restarted_mid_storm("fast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_immediate_and_started_mid_storm() {
    postgres_restarted_mid_storm("immediate").await;
}

/// Every connection between the proxies and Postgres reset by the relay for a moment
/// mid-storm: no key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_reset_mid_storm_run_no_key_twice() {
    let mut server = PostgresServer::start();
    let relay = Relay::start(format!("127.0.0.1:{}", server.port).parse().expect("address")).await;
    let upstream = Upstream::start().await;
    let url = format!("postgres://postgres@{}/postgres", relay.addr);
    let config = config(&url, &upstream.url(), "500ms");
    let proxies = [ChildProxy::start(&config).await, ChildProxy::start(&config).await];
    let (report, liveness) = storm(
        "pg-reset",
        &proxies,
        5,
        &upstream,
        &mut server,
        async |_, run, total| {
            until_progress(run, total * 3 / 10).await;
            relay.set(Mode::Reset);
            until_progress(run, total * 4 / 10).await;
            relay.set(Mode::Pass);
        },
    )
    .await;
    report.assert_clean("postgres connections reset mid-storm");
    liveness.assert_live("postgres connections reset", 0.95);
    assert!(report.max_executions_per_key <= 1, "{report:?}");
}

/// A claim that waits on a lock the test holds past `store.timeout` is cancelled by
/// the server and rolled back: 503 `store-unavailable`, nothing forwarded, and once the
/// lock goes no claim is left behind (the next try runs).
#[tokio::test]
async fn a_statement_stalled_past_the_timeout_forwards_nothing_and_leaves_no_claim() {
    let server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let proxy = config(&server.url(), &upstream.url(), "300ms").start().await;
    let scope = [("authorization", "Bearer t")];
    let first = post(proxy.addr(), Some("stalled-warm"), "{}", &scope).await;
    assert_eq!(first.status, 201);
    let mut lock = server.hold("BEGIN;\nLOCK TABLE idemproxy.records IN ACCESS EXCLUSIVE MODE;\nSELECT 'locked';\n");
    {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(lock.stdout.as_mut().expect("psql's stdout"))
            .read_line(&mut line)
            .expect("psql says the lock is held");
        assert_eq!(line.trim(), "locked");
    }
    let stalled = post(proxy.addr(), Some("stalled"), "{}", &scope).await;
    assert_eq!(
        (stalled.status.as_u16(), stalled.problem()),
        (503, "store-unavailable".to_string())
    );
    assert_eq!(upstream.executions("stalled"), 0, "nothing was forwarded");
    let _ = lock.kill();
    let _ = lock.wait();
    assert_eq!(
        server.psql("SELECT count(*) FROM idemproxy.records"),
        "1",
        "only the first key's record: no ghost claim"
    );
    let after = post(proxy.addr(), Some("stalled"), "{}", &scope).await;
    assert_eq!(after.status, 201);
    assert_eq!(upstream.executions("stalled"), 1);
}

/// A primary with a synchronous standby, and proxies whose URL names both with
/// `target_session_attrs=read-write` and `min_replica_acks = 1`: 1,000 keys recorded,
/// the primary killed, the standby promoted. Every key's retry replays from the
/// promoted standby (none lost, none run twice), and a new key is refused (503, nothing
/// forwarded) while no synchronous standby streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_promoted_after_the_primary_is_killed_keeps_every_recorded_key() {
    let mut primary = PostgresServer::start();
    let upstream = Upstream::start().await;
    // The schema first, so that the standby's copy has it.
    let proxy_url = |primary: u16, standby: u16| {
        format!("postgres://postgres@127.0.0.1:{primary},127.0.0.1:{standby}/postgres?target_session_attrs=read-write")
    };
    primary.psql("SELECT 1");
    let standby = primary.synchronous_standby();
    let mut config = config(&proxy_url(primary.port, standby.port), &upstream.url(), "2s");
    config.store_extra = "min_replica_acks = 1".into();
    let proxies = [ChildProxy::start(&config).await, ChildProxy::start(&config).await];
    let targets: Vec<_> = proxies.iter().map(|proxy| proxy.addr).collect();
    let keys: Vec<String> = (0..1000).map(|n| format!("promoted-{n}")).collect();
    let scope = [("authorization", "Bearer t")];
    let send_all = |round: usize| {
        let targets = targets.clone();
        let keys = keys.clone();
        async move {
            let mut answers = Vec::new();
            for chunk in keys.chunks(50) {
                let sent = chunk.iter().enumerate().map(|(n, key)| {
                    let target = targets[(n + round) % targets.len()];
                    async move {
                        (
                            key.clone(),
                            post(target, Some(key), "{}", &[("authorization", "Bearer t")]).await,
                        )
                    }
                });
                answers.extend(futures_util::future::join_all(sent).await);
            }
            answers
        }
    };
    for (key, answer) in send_all(0).await {
        assert_eq!(answer.status, 201, "{key}: {}", String::from_utf8_lossy(&answer.body));
    }
    assert_eq!(upstream.total(), 1000);
    primary.kill();
    standby.promote();
    // The proxies' connections to the old primary fail; new ones find the promoted one.
    let started = Instant::now();
    let mut replays = send_all(1).await;
    while replays.iter().any(|(_, answer)| answer.status == 503) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the proxies never reached the promoted standby"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        replays = send_all(1).await;
    }
    for (key, answer) in &replays {
        assert_eq!(answer.status, 201, "{key}: {}", String::from_utf8_lossy(&answer.body));
        assert!(answer.replayed(), "{key} ran again after the failover");
    }
    assert_eq!(upstream.total(), 1000, "nothing ran twice");
    for key in &keys {
        assert_eq!(upstream.executions(key), 1, "{key}");
    }
    // The promoted standby has no synchronous standby of its own: new claims are refused.
    let fresh = post(targets[0], Some("after-promotion"), "{}", &scope).await;
    assert_eq!(
        (fresh.status.as_u16(), fresh.problem()),
        (503, "store-unavailable".to_string())
    );
    assert_eq!(upstream.executions("after-promotion"), 0);
}

/// A duplicate on a route that waits is woken by `NOTIFY` when the first request's
/// response is recorded, and replays it: it does not wait out its 20 s.
#[tokio::test]
async fn a_waiting_duplicate_is_woken_by_notify_and_replays() {
    let server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let mut config = config(&server.url(), &upstream.url(), "2s");
    config.idempotency = "scope_headers = [\"authorization\"]\nwait_for_in_flight = \"20s\"".into();
    config.upstream_timeout = "30s".into();
    let proxy = ChildProxy::start(&config).await;
    let addr = proxy.addr;
    let headers = [("authorization", "Bearer t"), ("x-test-hold", "waited")];
    let first = tokio::spawn(async move { post(addr, Some("waited"), "{}", &headers).await });
    upstream.wait_for_key("waited").await;
    let second = tokio::spawn(async move { post(addr, Some("waited"), "{}", &headers).await });
    // The duplicate is waiting once the claim it waits on is marked.
    let started = Instant::now();
    while server.psql("SELECT count(*) FROM idemproxy.records WHERE waited") != "1" {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the duplicate never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    upstream.release("waited");
    let (first, second) = (
        first.await.expect("first"),
        tokio::time::timeout(Duration::from_secs(10), second),
    );
    assert_eq!(first.status, 201);
    let second = second
        .await
        .expect("woken well before its 20 s deadline")
        .expect("second");
    assert_eq!(second.status, 201);
    assert!(second.replayed());
    assert_eq!(upstream.executions("waited"), 1);
}

/// The store's work for the process stops with the proxy: once a proxy in this
/// process has shut down, Postgres holds none of its connections: not its workers'
/// pools, not its listener, and not its sweeper, which once ran on for as long as the
/// runtime that started it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_has_shut_down_holds_no_connection_to_postgres() {
    let server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let running = idemproxy::start(config(&server.url(), &upstream.url(), "2s").config())
        .await
        .expect("start the proxy");
    let served = post(running.addr, Some("stop-1"), "{}", &[("authorization", "Bearer t")]).await;
    assert_eq!(served.status, 201, "{served:?}");
    let held = |what: &str| {
        server.psql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemproxy' AND {what}"
        ))
    };
    until("the sweeper has swept", Duration::from_secs(20), || {
        held("query LIKE '%.sweep(%'") == "1"
    });
    running.shutdown().await;
    until(
        "every connection of the proxy is closed",
        Duration::from_secs(10),
        || held("true") == "0",
    );
}

/// How a proxy named the failure of its next guarded request after `fault`: the
/// problem it answered, the `cause` of its log line, and the causes counted in
/// `idemproxy_store_errors_total{op="claim"}`.
async fn failure_named(
    store: StoreKind,
    upstream: &Upstream,
    tag: &str,
    fault: impl FnOnce(),
) -> (String, Vec<String>, Vec<String>) {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "1s".into();
    let dir = tempfile::tempdir().expect("a directory");
    let log = dir.path().join("proxy.log");
    let proxy = ChildProxy::start_logged(&config, &log, &[]).await;
    assert_eq!(
        support::post_key(proxy.addr, &format!("{tag}-before")).await.status,
        201
    );
    fault();
    let failed = support::post_key(proxy.addr, &format!("{tag}-after")).await;
    assert_eq!(failed.status, 503, "{tag}: {failed:?}");
    let metrics = support::send(proxy.admin, "GET", "/metrics", &[], "").await;
    let counted: Vec<String> = String::from_utf8_lossy(&metrics.body)
        .lines()
        .filter(|line| line.starts_with("idemproxy_store_errors_total{") && line.contains("op=\"claim\""))
        .filter_map(|line| Some(line.split("cause=\"").nth(1)?.split('"').next()?.to_string()))
        .collect();
    drop(proxy);
    let logged: Vec<String> = std::fs::read_to_string(&log)
        .expect("read the proxy's log")
        .lines()
        .filter(|line| line.contains("problem response"))
        .filter_map(|line| Some(line.split("cause=\"").nth(1)?.split('"').next()?.to_string()))
        .collect();
    (failed.problem(), logged, counted)
}

/// The same failure is named alike on Redis and on Postgres (the store's errors are by
/// cause, not by backend): a store that is gone is `unreachable`, and one that answers
/// but refuses every write (a Redis made a replica, a Postgres whose records table a
/// trigger guards) is `refused`, in the problem's log line and in the metric's label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_is_named_by_its_cause_alike_on_redis_and_postgres() {
    let upstream = Upstream::start().await;
    let mut redis = support::RedisServer::start();
    let gone = failure_named(StoreKind::Redis(redis.url()), &upstream, "redis-gone", || redis.kill()).await;
    let replica = support::RedisServer::start();
    let read_only = failure_named(StoreKind::Redis(replica.url()), &upstream, "redis-replica", || {
        let _: () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(1)
            .query(&mut replica.connection())
            .expect("REPLICAOF");
    })
    .await;
    let store_unavailable = "store-unavailable".to_string();
    let named = |cause: &str| {
        (
            store_unavailable.clone(),
            vec![cause.to_string()],
            vec![cause.to_string()],
        )
    };
    assert_eq!((gone, read_only), (named("unreachable"), named("refused")), "redis");

    let mut server = PostgresServer::start();
    let gone = failure_named(StoreKind::Postgres(server.url()), &upstream, "pg-gone", || {
        server.stop("fast")
    })
    .await;
    server.start_again();
    let read_only = failure_named(StoreKind::Postgres(server.url()), &upstream, "pg-read-only", || {
        server.psql(
            "CREATE FUNCTION public.no_writes() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no writes here'; END $$; \
             CREATE TRIGGER no_writes BEFORE INSERT OR UPDATE ON idemproxy.records FOR EACH ROW EXECUTE FUNCTION public.no_writes()",
        );
    })
    .await;
    assert_eq!((gone, read_only), (named("unreachable"), named("refused")), "postgres");
}

/// `idemproxy serve` with `config`: it must exit non-zero; its stderr.
fn refused_at_start(config: &TestConfig) -> String {
    let file = config.write_temp();
    let mut command = support::proxy::binary_command(&[]);
    command.args(["serve", "--config"]).arg(file.path());
    for (name, value) in &config.env {
        command.env(name, value);
    }
    let output = command.output().expect("run idemproxy");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "it started: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// A wrong port, a refused password, a missing database, a schema of a newer version
/// and a missing schema with `migrate = false`: each refuses start with a line naming
/// it, and the password is in no line. The DBA's path then works: the DDL `store
/// schema` prints, applied with psql, is what a `migrate = false` proxy serves on.
#[tokio::test]
async fn each_bad_setting_is_named_at_start_and_the_dbas_schema_serves() {
    let server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let unused = support::free_port();
    let wrong = "wrong-secret-7f3a";
    let mut cases: Vec<(TestConfig, &str)> = Vec::new();
    cases.push((
        config(
            &format!("postgres://postgres@127.0.0.1:{unused}/postgres"),
            &upstream.url(),
            "300ms",
        ),
        "Connection refused",
    ));
    let mut password = config(&server.password_url(), &upstream.url(), "300ms");
    password.store_extra = "password_env = \"PG_TEST_PASSWORD\"".into();
    password.env = vec![("PG_TEST_PASSWORD".into(), wrong.into())];
    cases.push((password, "password authentication failed for user \"idemproxy_pw\""));
    cases.push((
        config(
            &format!("postgres://postgres@127.0.0.1:{}/nope", server.port),
            &upstream.url(),
            "300ms",
        ),
        "database \"nope\" does not exist",
    ));
    let mut by_hand = config(&server.url(), &upstream.url(), "300ms");
    by_hand.store_extra = "schema = \"by_hand\"\nmigrate = false".into();
    cases.push((by_hand.clone(), "the schema by_hand has no idemproxy tables, and store.migrate = false: apply the output of `idemproxy store schema --config F`"));
    server.psql(
        "CREATE SCHEMA future; CREATE TABLE future.meta (singleton boolean PRIMARY KEY DEFAULT true, version integer, identity bytea); \
         INSERT INTO future.meta VALUES (true, 99, '\\x00000000000000000000000000000000')",
    );
    let mut future = config(&server.url(), &upstream.url(), "300ms");
    future.store_extra = "schema = \"future\"".into();
    let newer = format!(
        "the schema future is at version 99, newer than this idemproxy's ({})",
        idemproxy::store::postgres::schema::VERSION
    );
    cases.push((future, newer.as_str()));
    for (case, expected) in &cases {
        let stderr = refused_at_start(case);
        assert!(!stderr.contains(wrong), "the password was shown: {stderr}");
        // One line says why (beside the config's warnings, logged before).
        let errors: Vec<&str> = stderr.lines().filter(|line| line.starts_with("idemproxy: ")).collect();
        assert_eq!(errors.len(), 1, "one line: {stderr}");
        assert!(errors[0].contains(expected), "expected {expected:?} in {stderr}");
    }
    assert_eq!(
        server.psql("SELECT version FROM future.meta"),
        "99",
        "a newer schema is never changed"
    );
    // The same role with its right password connects.
    let mut right = config(&server.password_url(), &upstream.url(), "2s");
    right.store_extra = "password_env = \"PG_TEST_PASSWORD\"".into();
    right.env = vec![("PG_TEST_PASSWORD".into(), support::postgres_server::PASSWORD.into())];
    let proxy = ChildProxy::start(&right).await;
    let answer = post(
        proxy.addr,
        Some("with-password"),
        "{}",
        &[("authorization", "Bearer t")],
    )
    .await;
    assert_eq!(answer.status, 201);
    drop(proxy);
    // The DBA's path: the printed DDL applied by hand, then a proxy that migrates nothing.
    let file = by_hand.write_temp();
    let printed = support::proxy::binary_command(&[])
        .args(["store", "schema", "--config"])
        .arg(file.path())
        .output()
        .expect("run idemproxy store schema");
    assert!(printed.status.success(), "{}", String::from_utf8_lossy(&printed.stderr));
    server.psql(&String::from_utf8_lossy(&printed.stdout));
    // As a role with only the grants the book lists: no superuser, no CREATE.
    server.psql(
        "CREATE ROLE idemproxy_app LOGIN; GRANT USAGE ON SCHEMA by_hand TO idemproxy_app; \
         GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA by_hand TO idemproxy_app; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA by_hand TO idemproxy_app",
    );
    let mut by_hand = config(
        &format!("postgres://idemproxy_app@127.0.0.1:{}/postgres", server.port),
        &upstream.url(),
        "300ms",
    );
    by_hand.store_extra = "schema = \"by_hand\"\nmigrate = false".into();
    let proxy = ChildProxy::start(&by_hand).await;
    let first = post(proxy.addr, Some("by-hand"), "{}", &[("authorization", "Bearer t")]).await;
    let again = post(proxy.addr, Some("by-hand"), "{}", &[("authorization", "Bearer t")]).await;
    assert_eq!((first.status.as_u16(), again.status.as_u16()), (201, 201));
    assert!(again.replayed());
    assert_eq!(upstream.executions("by-hand"), 1);
    assert_eq!(server.psql("SELECT count(*) FROM by_hand.records"), "1");
}

/// The role that logs in by its client certificate alone (its CN), in the TLS tests.
const CERT_ROLE: &str = "idemproxy_cert";

/// pg_hba.conf for the TLS tests: over TCP, TLS or nothing; `CERT_ROLE` by its
/// certificate, every other role by trust.
fn tls_hba() -> String {
    format!(
        "local all all trust\nhostssl all {CERT_ROLE} 127.0.0.1/32 cert\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n"
    )
}

fn tls_config(url: &str, upstream: &Upstream, ca: Option<&Path>, client: Option<&Issued>) -> TestConfig {
    let mut config = config(url, &upstream.url(), "2s");
    config.store_extra.push_str(&support::pki::store_tls_lines(ca, client));
    config
}

/// How many of the proxy's connections to `server` are (`true`) or are not over TLS.
fn proxy_connections(server: &PostgresServer, tls: bool) -> u32 {
    server
        .psql(&format!(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
             WHERE application_name = 'idemproxy' AND ssl = {tls}"
        ))
        .parse()
        .expect("a count")
}

/// A Postgres with `ssl = on` and a private CA, plain text refused: with libpq's
/// `sslmode=verify-full` and the CA in `tls_ca_file` the store serves over TLS (every
/// connection it holds is TLS) and a retry replays; a role that logs in by client
/// certificate serves with `tls_cert_file`/`tls_key_file`, and without them the proxy
/// refuses to start, naming the server's reason.
#[tokio::test]
async fn a_postgres_over_tls_with_a_private_ca_and_a_client_certificate_serves() {
    let pki = Pki::new("postgres CA");
    let mut server = PostgresServer::start();
    server.psql(&format!("CREATE ROLE {CERT_ROLE} LOGIN SUPERUSER"));
    server.enable_tls(&pki.server(), &pki.ca_file, &tls_hba());
    let upstream = Upstream::start().await;
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full",
        server.port
    );
    let proxy = ChildProxy::start(&tls_config(&url, &upstream, Some(&pki.ca_file), None)).await;
    let tenant = [("authorization", "Bearer t")];
    let first = post(proxy.addr, Some("tls-1"), "{}", &tenant).await;
    let again = post(proxy.addr, Some("tls-1"), "{}", &tenant).await;
    assert_eq!((first.status.as_u16(), again.status.as_u16()), (201, 201), "{first:?}");
    assert!(again.replayed());
    assert_eq!(upstream.executions("tls-1"), 1);
    assert!(
        proxy_connections(&server, true) >= 1,
        "the proxy holds a TLS connection"
    );
    assert_eq!(proxy_connections(&server, false), 0, "and no plain one");
    drop(proxy);

    let client = pki.client(CERT_ROLE, false);
    let url = format!(
        "postgres://{CERT_ROLE}@127.0.0.1:{}/postgres?sslmode=require",
        server.port
    );
    let proxy = ChildProxy::start(&tls_config(&url, &upstream, Some(&pki.ca_file), Some(&client))).await;
    let by_certificate = post(proxy.addr, Some("tls-2"), "{}", &tenant).await;
    assert_eq!(by_certificate.status, 201, "{by_certificate:?}");
    assert_eq!(upstream.executions("tls-2"), 1);
    drop(proxy);

    let stderr = refused_at_start(&tls_config(&url, &upstream, Some(&pki.ca_file), None));
    assert!(
        stderr.contains("connection requires a valid client certificate"),
        "{stderr}"
    );
    assert_eq!(server.psql("SELECT count(*) FROM idemproxy.records"), "2");
}

/// A certificate the store does not trust (another private CA, or only the webpki
/// roots) refuses start with a line naming it, also with `sslmode=prefer` (never a
/// fall back to plain text); `sslmode=disable` against a server that takes TLS only is
/// refused with the server's reason. Nothing is claimed.
#[tokio::test]
async fn an_untrusted_postgres_certificate_or_plain_text_is_refused_at_start() {
    let pki = Pki::new("postgres CA");
    let other = Pki::new("another CA");
    let mut server = PostgresServer::start();
    server.enable_tls(&pki.server(), &pki.ca_file, &tls_hba());
    let upstream = Upstream::start().await;
    let port = server.port;
    let cases = [
        (
            "require",
            Some(other.ca_file.as_path()),
            "invalid peer certificate: UnknownIssuer",
        ),
        (
            "prefer",
            Some(other.ca_file.as_path()),
            "invalid peer certificate: UnknownIssuer",
        ),
        ("require", None, "invalid peer certificate: UnknownIssuer"),
        ("disable", None, "no encryption"),
    ];
    for (mode, ca, expected) in cases {
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode={mode}");
        let stderr = refused_at_start(&tls_config(&url, &upstream, ca, None));
        let errors: Vec<&str> = stderr.lines().filter(|line| line.starts_with("idemproxy: ")).collect();
        assert_eq!(errors.len(), 1, "{mode}: one line: {stderr}");
        assert!(
            errors[0].contains(expected),
            "{mode}: expected {expected:?} in {stderr}"
        );
        println!("sslmode={mode}: {}", errors[0]);
    }
    assert_eq!(
        server.psql("SELECT count(*) FROM pg_namespace WHERE nspname = 'idemproxy'"),
        "0",
        "nothing was made"
    );
}

/// Issue 49 L4: `/readyz` was `SELECT 1`, so with the store's database read-only
/// (`default_transaction_read_only = on`, as on a standby) it answered 200 while every
/// claim was 503. Readiness now runs the claim itself in a transaction rolled back: it
/// answers 503 while claims would fail, and 200 again once they would not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_what_a_claim_would_do_on_a_read_only_database() {
    let server = PostgresServer::start();
    server.psql("CREATE DATABASE app");
    let url = format!("{}/app", server.url().strip_suffix("/postgres").expect("a database"));
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&config(&url, &upstream.url(), "2s")).await;
    let ready = || async { support::send(proxy.admin, "GET", "/readyz", &[], "").await.status };
    assert_eq!(ready().await, 200);
    let reconnect = || {
        server.psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = 'app'");
    };
    // Until `/readyz` gives `want` three times in a row (the pool's connections made
    // again with the database's setting), bounded at 10 s.
    let settle = |want: u16| async move {
        let started = Instant::now();
        let mut run = 0;
        while run < 3 {
            run = if ready().await == want { run + 1 } else { 0 };
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "/readyz never settled at {want}"
            );
        }
    };
    server.psql("ALTER DATABASE app SET default_transaction_read_only = on");
    reconnect();
    settle(503).await;
    let headers = [("authorization", "Bearer t")];
    let refused = post(proxy.addr, Some("read-only"), "{}", &headers).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(upstream.executions("read-only"), 0, "nothing forwarded");

    server.psql("ALTER DATABASE app RESET default_transaction_read_only");
    reconnect();
    settle(200).await;
    let taken = post(proxy.addr, Some("writable"), "{}", &headers).await;
    assert_eq!(taken.status, 201, "{taken:?}");
}

/// Issue 49 (a plant the suite missed: the sweep also deleting in-flight records whose
/// lease lapsed ran an operation twice after an instance died mid-request). A proxy is
/// SIGKILLed while its request is held upstream; once the claim's lease has lapsed
/// (retention not), the sweep leaves it, and another proxy's retry is 409, never
/// forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_record_whose_proxy_died_survives_the_sweep_and_its_retry_is_409() {
    let server = PostgresServer::start();
    let upstream = Upstream::start().await;
    let mut config = config(&server.url(), &upstream.url(), "2s");
    config.upstream_timeout = "1s".into();
    let mut first = ChildProxy::start(&config).await;
    let addr = first.addr;
    let headers = [("authorization", "Bearer t"), ("x-test-hold", "died")];
    let held = tokio::spawn(async move { support::client::try_send_key(addr, "died", &headers).await });
    upstream.wait_for_key("died").await;
    first.kill();
    let _ = held.await;
    let lapsed = "SELECT count(*) FROM idemproxy.records \
                  WHERE state = 'in_flight' AND lease_until <= clock_timestamp() AND expires_at > clock_timestamp()";
    let started = Instant::now();
    while server.psql(lapsed) != "1" {
        assert!(started.elapsed() < Duration::from_secs(10), "the lease never lapsed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        server.psql("SELECT idemproxy.sweep(500)"),
        "0",
        "the sweep deleted a live record"
    );
    assert_eq!(server.psql(lapsed), "1");
    let second = ChildProxy::start(&config).await;
    let retry = support::client::try_send_key(second.addr, "died", &[("authorization", "Bearer t")])
        .await
        .expect("the retry");
    assert_eq!(
        (retry.status.as_u16(), retry.problem()),
        (409, "outcome-unknown".into()),
        "{retry:?}"
    );
    assert_eq!(upstream.executions("died"), 1, "never forwarded again");
    upstream.release("died");
}
