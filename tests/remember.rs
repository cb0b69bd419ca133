//! A key outlives its response (`remember`, docs/design.md §24), through the proxy on
//! every backend: within `retention` a retry replays (saying until when, in
//! `Idempotency-Expires`); past it, within `remember`, the same request gets 410
//! `response-expired` naming the status and completion time, another request with the
//! key 422, and an unknown outcome 409, and the upstream runs nothing again; once
//! `remember` ends the key is free. The stores are inspected directly: past retention
//! the response is gone from Redis (its `…:r` key) and from Postgres's row, while the
//! record is there. SQLite keeps the horizon across a SIGKILL.
//!
//! The clock is real: each test waits out a retention of a few seconds (no race is
//! timed: a wait is for a deadline the test itself set).

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use support::{ChildProxy, PostgresServer, RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::time::Instant;

const RETENTION: Duration = Duration::from_secs(3);
const REMEMBER: Duration = Duration::from_secs(7);
const KEY: &str = "order-1001";

fn config(store: StoreKind, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "2s".into();
    config.upstream_timeout = "1s".into();
    config.retention = "3s".into();
    config.idempotency = "remember = \"7s\"".into();
    config
}

async fn pay(addr: SocketAddr, body: &str, extra: &[(&str, &str)]) -> TestResponse {
    let mut headers = vec![("idempotency-key", KEY), ("content-type", "application/json")];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/v1/payments", &headers, body).await
}

/// `Idempotency-Expires`, read as the time it names.
fn expires(response: &TestResponse) -> SystemTime {
    let value = response
        .header("idempotency-expires")
        .unwrap_or_else(|| panic!("no Idempotency-Expires on {response:?}"));
    httpdate::parse_http_date(value).unwrap_or_else(|_| panic!("not an HTTP date: {value:?}"))
}

/// Waits until `deadline` (a time the test set, not a race).
async fn until(deadline: Instant) {
    tokio::time::sleep_until(deadline).await;
}

/// The whole horizon of one key on the proxy at `addr`: replays within retention,
/// 410 past it, 422 for another request, and a fresh run once `remember` ends. `inspect`
/// is called in the spent phase, to look into the store. Returns the upstream's count
/// of executions of the key after each phase.
async fn horizon<F: AsyncFnMut()>(addr: SocketAddr, upstream: &Upstream, mut inspect: F) {
    let claimed = Instant::now();
    let before = SystemTime::now();
    let first = pay(addr, r#"{"amount":100}"#, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let until_replays_stop = expires(&first);
    // An HTTP date has whole seconds: the claim's time plus the retention, rounded down.
    let expected = before + RETENTION;
    assert!(
        until_replays_stop <= expected + Duration::from_secs(1)
            && until_replays_stop + Duration::from_secs(2) >= expected,
        "Idempotency-Expires {until_replays_stop:?} is not the claim's time plus the retention ({expected:?})"
    );

    let replay = pay(addr, r#"{"amount":100}"#, &[]).await;
    assert_eq!((replay.status.as_u16(), replay.replayed()), (201, true), "{replay:?}");
    assert_eq!(replay.execution(), first.execution());
    assert_eq!(
        expires(&replay),
        until_replays_stop,
        "every replay says when replays stop"
    );

    until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(addr, r#"{"amount":100}"#, &[]).await;
    assert_eq!(late.status, 410, "{late:?}");
    assert_eq!(late.problem(), "response-expired");
    let problem: serde_json::Value = serde_json::from_slice(&late.body).expect("a JSON problem");
    assert_eq!(problem["completed_status"], 201, "{problem}");
    let completed_at = problem["completed_at"].as_str().expect("completed_at");
    let completed_at = humantime::parse_rfc3339(completed_at).expect("an RFC 3339 time");
    assert!(
        completed_at + Duration::from_secs(2) >= before && completed_at <= SystemTime::now(),
        "completed_at {completed_at:?} is not when the operation completed"
    );
    assert_eq!(problem["operation"].as_str().map(str::len), Some(32), "{problem}");
    assert!(late.header("idempotent-replayed").is_none());
    let reused = pay(addr, r#"{"amount":999}"#, &[]).await;
    assert_eq!(reused.status, 422, "another request with the key: {reused:?}");
    inspect().await;
    assert_eq!(upstream.executions(KEY), 1, "a late retry ran the operation again");

    until(claimed + REMEMBER + Duration::from_millis(1500)).await;
    let fresh = pay(addr, r#"{"amount":100}"#, &[]).await;
    assert_eq!((fresh.status.as_u16(), fresh.replayed()), (201, false), "{fresh:?}");
    assert_eq!(upstream.executions(KEY), 2, "past remember the key is free, and runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_retry_gets_410_on_the_memory_store_and_the_key_is_free_after_remember() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream).start().await;
    horizon(proxy.addr(), &upstream, async || {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_retry_gets_410_on_the_sqlite_store_and_the_key_is_free_after_remember() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = dir.path().join("records.db");
    let proxy = config(StoreKind::Sqlite(file.clone()), &upstream).start().await;
    horizon(proxy.addr(), &upstream, async || {
        // The sweeper drops the response on its own within a second of the retention:
        // the row is there, without its body.
        let conn = rusqlite::Connection::open_with_flags(&file, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open the file");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (state, body): (String, Option<Vec<u8>>) = conn
                .query_row("SELECT state, body FROM records", [], |row| {
                    Ok((row.get(0)?, row.get(1)?))
                })
                .expect("the record is there");
            assert_eq!(state, "completed");
            if body.is_none() {
                break;
            }
            assert!(Instant::now() < deadline, "the sweeper never dropped the response");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_retry_gets_410_on_redis_whose_response_key_expired_by_itself() {
    let upstream = Upstream::start().await;
    let redis = RedisServer::start();
    let proxy = config(StoreKind::Redis(redis.url()), &upstream).start().await;
    let mut control = redis::Client::open(redis.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("control connection");
    horizon(proxy.addr(), &upstream, async || {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut control)
            .await
            .expect("KEYS");
        let records: Vec<&String> = keys.iter().filter(|key| key.ends_with('}')).collect();
        assert_eq!(records.len(), 1, "one record, and no response beside it: {keys:?}");
        assert!(
            !keys.iter().any(|key| key.ends_with(":r")),
            "the response key outlived the retention: {keys:?}"
        );
        let value: Vec<u8> = redis::cmd("GET")
            .arg(records[0])
            .query_async(&mut control)
            .await
            .expect("GET");
        assert!(value.starts_with(b"2K"), "{:?}", String::from_utf8_lossy(&value));
        assert!(
            value.len() < 120,
            "a spent record keeps no response: {} bytes",
            value.len()
        );
        let ttl: i64 = redis::cmd("PTTL")
            .arg(records[0])
            .query_async(&mut control)
            .await
            .expect("PTTL");
        assert!(
            ttl > 0 && ttl <= 7000,
            "the record lives remember from its claim: PTTL {ttl}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_retry_gets_410_on_postgres_whose_sweeper_dropped_the_response() {
    let upstream = Upstream::start().await;
    let server = PostgresServer::start();
    let proxy = config(StoreKind::Postgres(server.url()), &upstream).start().await;
    let (control, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .expect("control connection");
    tokio::spawn(connection);
    horizon(proxy.addr(), &upstream, async || {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let row = control
                .query_one(
                    "SELECT state, headers IS NULL AND body IS NULL FROM idemproxy.records",
                    &[],
                )
                .await
                .expect("the record is there");
            assert_eq!(row.get::<_, String>(0), "completed");
            if row.get::<_, bool>(1) {
                break;
            }
            assert!(Instant::now() < deadline, "the sweeper never dropped the response");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// An unknown outcome answers 409 for the whole horizon, past the retention too, and
/// never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_answers_409_past_the_retention() {
    let upstream = Upstream::start().await;
    let proxy = config(StoreKind::Memory, &upstream).start().await;
    let claimed = Instant::now();
    let broken = pay(proxy.addr(), "{}", &[("x-test-fail", "reset")]).await;
    assert_eq!(broken.status, 502, "{broken:?}");
    until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(proxy.addr(), "{}", &[]).await;
    assert_eq!(
        (late.status.as_u16(), late.problem().as_str()),
        (409, "outcome-unknown"),
        "{late:?}"
    );
    assert_eq!(upstream.executions(KEY), 1);
}

/// The horizon holds across a SIGKILL: the proxy on the same file still answers 410,
/// and the upstream ran the key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_horizon_survives_a_sigkill_on_sqlite() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = config(StoreKind::Sqlite(dir.path().join("records.db")), &upstream);
    let mut proxy = ChildProxy::start(&config).await;
    let claimed = Instant::now();
    let first = pay(proxy.addr, "{}", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    proxy.signal("KILL");
    let _ = proxy.child.wait();
    let proxy = ChildProxy::start(&config).await;
    until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(proxy.addr, "{}", &[]).await;
    assert_eq!(
        (late.status.as_u16(), late.problem().as_str()),
        (410, "response-expired"),
        "{late:?}"
    );
    assert_eq!(upstream.executions(KEY), 1);
}

/// `check` refuses a `remember` shorter than the retention, naming both.
#[test]
fn remember_shorter_than_the_retention_is_refused_naming_both() {
    let source = "[[route]]\nname = \"a\"\npath_prefix = \"/a\"\nupstream = \"http://127.0.0.1:9\"\n\
                  [route.idempotency]\nretention = \"2h\"\nremember = \"1h\"\n";
    let error = idemproxy::Config::parse(source, std::path::Path::new("t.toml"))
        .expect_err("remember below retention must be refused")
        .to_string();
    assert!(
        error.contains("remember") && error.contains("1h") && error.contains("2h"),
        "{error}"
    );
}

// === what a record past its retention costs ===

/// Keys of the realistic length (`idemproxy:payments:{64 hex}`), one per record.
fn store_key(n: usize) -> idemproxy::store::StoreKey {
    let key = idemproxy::idempotency::parse_key_value(format!("cost-{n}").as_bytes()).expect("a key");
    idemproxy::idempotency::store_key("idemproxy", "payments", &[], &key)
}

/// Claims and completes `records` keys with a `BODY`-byte response, retained for
/// `retention` and remembered for an hour, 64 at a time.
async fn fill<S: idemproxy::store::RecordStore + Clone>(store: &S, records: usize, retention: Duration) {
    use idemproxy::store::{ClaimOutcome, ClaimRequest, Fingerprint, OwnerToken, StoredResponse, Write};
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )],
        // Bytes that do not compress (Postgres compresses what it stores out of line).
        body: bytes::Bytes::from(
            (0..BODY as u64)
                .map(|n| (support::upstream::splitmix(n) >> 24) as u8)
                .collect::<Vec<u8>>(),
        ),
        trace: None,
        replay_until: Some(SystemTime::now() + retention),
    };
    for chunk in (0..records).collect::<Vec<_>>().chunks(64) {
        let writes = chunk.iter().map(|n| {
            let (store, response) = (store.clone(), response.clone());
            let n = *n;
            async move {
                let owner = OwnerToken::generate().expect("random bytes");
                let claim = ClaimRequest {
                    key: store_key(n),
                    scope: None,
                    client: None,
                    owner,
                    fingerprint: Fingerprint([7; 32]),
                    retention,
                    remember: Duration::from_secs(3600),
                    lease: retention / 2,
                    response_limit: 0,
                    probe_key: None,
                };
                assert_eq!(store.claim(&claim).await.expect("claim"), ClaimOutcome::Acquired(()));
                let written = store.complete(&claim.key, owner, &response).await.expect("complete");
                assert_eq!(written, Write::Applied);
            }
        });
        futures_util::future::join_all(writes).await;
    }
}

const BODY: usize = 4096;
const RECORDS: usize = 2000;

/// Polls `measure` until it settles below `ceiling` (the store drops responses on its
/// own clock, a sweep at a time), or gives up after 20 s and returns the last figure.
async fn settled<F: AsyncFnMut() -> u64>(mut measure: F, ceiling: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let figure = measure().await;
        if figure <= ceiling || Instant::now() > deadline {
            return figure;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Prints one store's figures, and holds it to the point of the horizon: a record past
/// its retention costs a small fraction of one within it (no body is left behind).
fn report(store: &str, what: &str, empty: u64, completed: u64, spent: u64) -> (u64, u64) {
    let per = |total: u64| total.saturating_sub(empty) / RECORDS as u64;
    let (completed, spent) = (per(completed), per(spent));
    println!(
        "remember cost ({store}, {what}): {RECORDS} records, a {BODY}-byte body each: {completed} bytes per record within its retention, {spent} past it"
    );
    assert!(
        spent * 4 < completed,
        "{store}: a record past its retention still costs {spent} bytes, against {completed} within it"
    );
    (completed, spent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_record_past_its_retention_costs_on_each_store() {
    use idemproxy::store::{MemoryStore, PostgresStore, RedisStore, SqliteStore};
    let retention = Duration::from_secs(2);

    // Memory: what the store counts (bodies, names and values, keys, and a fixed
    // estimate of each record's bookkeeping).
    let memory = MemoryStore::new(1_000_000, usize::MAX);
    let empty = memory.usage().bytes as u64;
    fill(&memory, RECORDS, retention).await;
    let completed = memory.usage().bytes as u64;
    let spent = settled(async || memory.usage().bytes as u64, completed / 8).await;
    report("memory", "the store's own count", empty, completed, spent);
    assert_eq!(
        memory.usage().spent,
        RECORDS,
        "idemproxy_store_spent_records counts them"
    );

    // SQLite: the file's pages in use.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = idemproxy::config::SqliteConfig {
        path: dir.path().join("records.db"),
        limits: idemproxy::store::StoreLimits::unbounded(1_000_000),
        cache_bytes: 4 << 20,
        response_budget: usize::MAX,
    };
    let sqlite = SqliteStore::open(&config, Duration::from_secs(30)).expect("the sqlite store");
    let bytes = |store: &SqliteStore| store.usage().expect("usage").bytes as u64;
    let empty = bytes(&sqlite);
    fill(&sqlite, RECORDS, Duration::from_secs(30)).await;
    let completed = bytes(&sqlite);
    sqlite.advance_clock(Duration::from_secs(31));
    let spent = settled(async || bytes(&sqlite), completed / 4).await;
    report("sqlite", "file pages in use", empty, completed, spent);
    assert_eq!(
        sqlite.usage().expect("usage").spent,
        RECORDS,
        "idemproxy_store_spent_records counts them"
    );

    // Redis: `used_memory`, the `…:r` keys expiring by themselves.
    let redis = RedisServer::start();
    let store = RedisStore::standalone(&redis.url(), Duration::from_secs(5)).expect("the redis store");
    let mut control = redis::Client::open(redis.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("control connection");
    let used = async |control: &mut redis::aio::MultiplexedConnection| -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(control)
            .await
            .expect("INFO");
        info.lines()
            .find_map(|line| line.strip_prefix("used_memory:")?.trim().parse().ok())
            .expect("used_memory")
    };
    let empty = used(&mut control).await;
    fill(&store, RECORDS, retention).await;
    let completed = used(&mut control).await;
    let spent = settled(
        async || {
            let keys: u64 = redis::cmd("DBSIZE").query_async(&mut control).await.expect("DBSIZE");
            match keys > RECORDS as u64 {
                true => u64::MAX,
                false => used(&mut control).await,
            }
        },
        completed / 8,
    )
    .await;
    let sample: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(store_key(0).as_str())
        .query_async(&mut control)
        .await
        .expect("MEMORY USAGE");
    report("redis", "used_memory", empty, completed, spent);
    println!("remember cost (redis): MEMORY USAGE of one record past its retention: {sample} bytes");

    // Postgres: the table's size with its indexes and TOAST, each rewritten compact
    // (`VACUUM FULL`) before it is measured.
    let server = PostgresServer::start();
    let config = idemproxy::config::PostgresConfig::at(&server.url()).expect("the test server's URL");
    let store = PostgresStore::open(&config, Duration::from_secs(5))
        .await
        .expect("the postgres store");
    let size = || -> u64 {
        server.psql("VACUUM FULL idemproxy.records");
        server
            .psql("SELECT pg_total_relation_size('idemproxy.records')")
            .parse()
            .expect("a size")
    };
    let empty = size();
    fill(&store, RECORDS, retention).await;
    let completed = size();
    tokio::time::sleep(retention).await;
    server.psql("SELECT idemproxy.sweep(100000)");
    let spent = size();
    report("postgres", "pg_total_relation_size", empty, completed, spent);
}

// === the 410 as the Stripe profile, shadow mode and the metrics count it ===

/// Under the Stripe profile the 410 is Stripe's error object (`idempotency_error`,
/// `response_expired`) with the same fields; a 410 is counted as `outcome="expired"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_profile_answers_410_with_its_own_error_object_and_the_metrics_count_it() {
    let upstream = Upstream::start().await;
    let mut config = config(StoreKind::Memory, &upstream);
    config.idempotency.push_str("\nprofile = \"stripe\"");
    let proxy = config.start().await;
    let claimed = Instant::now();
    let first = pay(proxy.addr(), "{}", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(proxy.addr(), "{}", &[]).await;
    assert_eq!(late.status, 410, "{late:?}");
    assert_eq!(late.header("content-type"), Some("application/json"));
    let body: serde_json::Value = serde_json::from_slice(&late.body).expect("JSON");
    let error = &body["error"];
    assert_eq!(error["type"], "idempotency_error", "{body}");
    assert_eq!(error["code"], "response_expired", "{body}");
    assert_eq!(error["completed_status"], 201, "{body}");
    assert!(
        error["completed_at"].is_string() && error["message"].is_string(),
        "{body}"
    );
    let expired = "idemproxy_requests_total{route=\"payments\",outcome=\"expired\"}";
    assert_eq!(support::client::metric(proxy.admin(), expired).await, Some(1.0));
    let spent = "idemproxy_store_spent_records{backend=\"memory\"}";
    assert_eq!(support::client::metric(proxy.admin(), spent).await, Some(1.0));
    assert_eq!(upstream.executions(KEY), 1);
}

/// Shadow mode forwards the late retry, as an unguarded route would, and counts what
/// enforce would have done: `would="expired"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_counts_a_late_retry_as_would_expired() {
    let upstream = Upstream::start().await;
    let mut config = config(StoreKind::Memory, &upstream);
    config.idempotency.push_str("\nmode = \"shadow\"");
    let proxy = config.start().await;
    let claimed = Instant::now();
    let first = pay(proxy.addr(), "{}", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(
        first.header("idempotency-expires").is_none(),
        "shadow mode adds nothing of its own"
    );
    until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(proxy.addr(), "{}", &[]).await;
    assert_eq!((late.status.as_u16(), late.replayed()), (201, false), "{late:?}");
    let would = "idemproxy_shadow_decisions_total{route=\"payments\",would=\"expired\"}";
    assert_eq!(support::client::metric(proxy.admin(), would).await, Some(1.0));
}

/// An operator's purge acts on the one record: on Redis it removes the record and the
/// response kept beside it, so that nothing of the key is left and a retry runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_removes_the_record_and_the_response_kept_beside_it() {
    use idemproxy::store::{ClaimOutcome, ClaimRequest, Fingerprint, OwnerToken, RecordStore, RedisStore, Write};
    let redis = RedisServer::start();
    let store = RedisStore::standalone(&redis.url(), Duration::from_secs(5)).expect("the redis store");
    let owner = OwnerToken::generate().expect("random bytes");
    let claim = ClaimRequest {
        key: store_key(1),
        scope: None,
        client: None,
        owner,
        fingerprint: Fingerprint([7; 32]),
        retention: Duration::from_secs(600),
        remember: Duration::from_secs(3600),
        lease: Duration::from_secs(30),
        response_limit: 0,
        probe_key: None,
    };
    assert_eq!(store.claim(&claim).await.expect("claim"), ClaimOutcome::Acquired(()));
    let response = idemproxy::store::StoredResponse {
        status: http::StatusCode::CREATED,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
        trace: None,
        replay_until: None,
    };
    assert_eq!(
        store.complete(&claim.key, owner, &response).await.expect("complete"),
        Write::Applied
    );
    let mut control = redis::Client::open(redis.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("control connection");
    let keys = async |control: &mut redis::aio::MultiplexedConnection| -> u64 {
        redis::cmd("DBSIZE").query_async(control).await.expect("DBSIZE")
    };
    assert_eq!(keys(&mut control).await, 2, "the record and its response beside it");
    assert!(store.purge(&claim.key).await.expect("purge"));
    assert_eq!(keys(&mut control).await, 0, "a purge leaves nothing of the key");
    let again = ClaimRequest {
        owner: OwnerToken::generate().expect("random bytes"),
        ..claim
    };
    assert_eq!(store.claim(&again).await.expect("claim"), ClaimOutcome::Acquired(()));
}
