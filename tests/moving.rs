//! Moving between stores without forgetting (`idemproxy store copy`, docs/design.md
//! §26): every record keeps its state, fingerprint, response and remaining lifetimes
//! across every backend; records copied from a SQLite file replay through a proxy on
//! Postgres and on Redis, a reused key is 422 there, an in-flight record arrives
//! unknown (409), and a short retention still ends on time; a copy is refused while a
//! proxy holds the file; and a copy killed part way and run again ends with every
//! record once. Real Redis and Postgres servers, the real binary.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idemproxy::store::moving::{Carried, CarriedSchedule, CarriedState, Cursor, RawResponse};
use idemproxy::store::{AnyStore, Fingerprint, OwnerToken, UnknownReason};
use support::proxy::binary_command;
use support::{ChildProxy, PostgresServer, RedisServer, StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::time::Instant;

const RETENTION: Duration = Duration::from_secs(6);

fn config(store: StoreKind, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "2s".into();
    config.upstream_timeout = "4s".into();
    config.retention = "6s".into();
    config.idempotency = "remember = \"1h\"".into();
    config
}

async fn pay(addr: SocketAddr, key: &str, body: &str, extra: &[(&str, &str)]) -> TestResponse {
    let mut headers = vec![("idempotency-key", key), ("content-type", "application/json")];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/v1/payments", &headers, body).await
}

/// `idemproxy store copy` from one config file to the other.
fn copy_command(from: &std::path::Path, to: &std::path::Path) -> Command {
    let mut command = binary_command(&[]);
    command.args(["store", "copy", "--from"]).arg(from).arg("--to").arg(to);
    command
}

/// Runs `idemproxy store copy` from one config to the other.
fn copy(from: &TestConfig, to: &TestConfig) -> Output {
    let (from, to) = (from.write_temp(), to.write_temp());
    copy_command(from.path(), to.path())
        .output()
        .expect("run idemproxy store copy")
}

/// How many records the Postgres store's table holds.
fn records_in(postgres: &PostgresServer) -> usize {
    let count = postgres.psql("SELECT count(*) FROM idemproxy.records");
    count.parse().unwrap_or_else(|_| panic!("not a count: {count:?}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A SQLite store's records, copied into `target`: the completed one replays there
/// with the same execution, a different request with its key is 422, the one that was
/// in flight (its proxy killed while the upstream held it) is 409, and past the
/// retention the completed one is 410, on time.
async fn through_a_copy(target: StoreKind) {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let from = config(StoreKind::Sqlite(dir.path().join("records.db")), &upstream);
    let to = config(target, &upstream);
    let mut proxy = ChildProxy::start(&from).await;
    let claimed = Instant::now();
    let paid = pay(proxy.addr, "paid", r#"{"amount":100}"#, &[]).await;
    assert_eq!(paid.status, 201, "{paid:?}");
    let addr = proxy.addr;
    let held =
        tokio::spawn(async move { support::client::try_send_key(addr, "held", &[("x-test-hold", "held")]).await });
    upstream.wait_for_key("held").await;

    let refused = copy(&from, &to);
    assert!(
        !refused.status.success(),
        "a copy from a file a proxy holds must be refused"
    );
    let stderr = text(&refused.stderr);
    assert!(
        stderr.contains(&proxy.child.id().to_string()),
        "names the proxy's pid: {stderr}"
    );

    proxy.signal("KILL");
    let _ = proxy.child.wait();
    let _ = held.await;
    let copied = copy(&from, &to);
    let stdout = text(&copied.stdout);
    assert!(copied.status.success(), "{stdout}{}", text(&copied.stderr));
    assert!(
        stdout.contains("2 records read, 2 written (1 of them in flight, now unknown), 0 kept"),
        "{stdout}"
    );
    let again = copy(&from, &to);
    let stdout = text(&again.stdout);
    assert!(
        again.status.success() && stdout.contains("2 records read, 0 written"),
        "{stdout}"
    );
    assert!(stdout.contains("2 kept as the target held them"), "{stdout}");

    let proxy = ChildProxy::start(&to).await;
    let replay = pay(proxy.addr, "paid", r#"{"amount":100}"#, &[]).await;
    assert_eq!((replay.status.as_u16(), replay.replayed()), (201, true), "{replay:?}");
    assert_eq!(replay.execution(), paid.execution());
    assert_eq!(replay.body, paid.body);
    let reused = pay(proxy.addr, "paid", r#"{"amount":999}"#, &[]).await;
    assert_eq!(reused.status, 422, "{reused:?}");
    let unknown = pay(proxy.addr, "held", "{}", &[]).await;
    assert_eq!(
        (unknown.status.as_u16(), unknown.problem().as_str()),
        (409, "outcome-unknown")
    );
    // In flight when copied (its lease of 5 s still running, as it is unless the
    // machine stalls for seconds), else past its lease: never run again either way.
    let body = text(&unknown.body);
    assert!(
        body.contains("moved-in-flight") || body.contains("lease-expired"),
        "{body}"
    );

    tokio::time::sleep_until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(proxy.addr, "paid", r#"{"amount":100}"#, &[]).await;
    assert_eq!(
        (late.status.as_u16(), late.problem().as_str()),
        (410, "response-expired"),
        "{late:?}"
    );
    assert_eq!(upstream.executions("paid"), 1);
    assert_eq!(upstream.executions("held"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_copied_from_sqlite_to_postgres_replay_there_with_their_lifetimes() {
    let postgres = PostgresServer::start();
    through_a_copy(StoreKind::Postgres(postgres.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_copied_from_sqlite_to_redis_replay_there_with_their_lifetimes() {
    let redis = RedisServer::start();
    through_a_copy(StoreKind::Redis(redis.url())).await;
}

/// Keys of the realistic form (`idemproxy:payments:{64 hex}`).
fn store_key(name: &str) -> idemproxy::store::StoreKey {
    let key = idemproxy::idempotency::parse_key_value(name.as_bytes()).expect("a key");
    idemproxy::idempotency::store_key("idemproxy", "payments", &[], &key)
}

fn record(name: &str, ttl: Duration, response_ttl: Option<Duration>, state: CarriedState) -> Carried {
    Carried {
        key: store_key(name),
        fingerprint: Fingerprint([name.len() as u8; 32]),
        ttl,
        response_ttl,
        state,
    }
}

fn response(body: &'static str) -> Option<RawResponse> {
    Some(RawResponse {
        headers: Bytes::from_static(b"\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json"),
        body: Bytes::from_static(body.as_bytes()),
    })
}

/// One record of each state a store keeps.
fn every_state() -> Vec<Carried> {
    let minute = Duration::from_secs(60);
    let owner = OwnerToken::from_bytes(&[3; 16]);
    let completed_at = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_790_000_000));
    vec![
        record(
            "completed",
            minute,
            None,
            CarriedState::Completed {
                status: 201,
                completed_at: None,
                response: response(r#"{"paid":1}"#),
            },
        ),
        record(
            "kept-beside",
            minute,
            Some(Duration::from_secs(30)),
            CarriedState::Completed {
                status: 200,
                completed_at,
                response: response(r#"{"paid":2}"#),
            },
        ),
        record(
            "spent",
            minute,
            Some(Duration::ZERO),
            CarriedState::Completed {
                status: 202,
                completed_at,
                response: None,
            },
        ),
        record(
            "probed",
            minute,
            Some(Duration::from_secs(30)),
            CarriedState::Unknown {
                reason: UnknownReason::UpstreamTimeout,
                owner,
                schedule: Some(CarriedSchedule {
                    due_in: Some(Duration::from_secs(5)),
                    give_up_in: Duration::from_secs(40),
                }),
            },
        ),
        record(
            "gave-up",
            minute,
            None,
            CarriedState::Unknown {
                reason: UnknownReason::StreamBroken,
                owner,
                schedule: Some(CarriedSchedule {
                    due_in: None,
                    give_up_in: Duration::from_secs(20),
                }),
            },
        ),
        record(
            "unscheduled",
            minute,
            None,
            CarriedState::Unknown {
                reason: UnknownReason::MovedInFlight,
                owner,
                schedule: None,
            },
        ),
    ]
}

/// Every record `store` holds, a page at a time, in key order.
async fn all(store: &AnyStore) -> Vec<Carried> {
    let (mut records, mut cursor) = (Vec::new(), Cursor::Start);
    while cursor != Cursor::End {
        let (page, next) = store.export("idemproxy", &cursor, 2).await.expect("export");
        records.extend(page);
        cursor = next;
    }
    records.sort_by(|a, b| a.key.cmp(&b.key));
    records
}

/// Whether two durations are the same lifetime read a little apart.
fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) <= Duration::from_secs(3)
}

fn assert_same(moved: &[Carried], original: &[Carried], hop: &str) {
    assert_eq!(moved.len(), original.len(), "{hop}: {moved:#?}");
    for (moved, original) in moved.iter().zip(original) {
        let what = format!("{hop}: {moved:#?} was {original:#?}");
        assert_eq!(
            (&moved.key, moved.fingerprint),
            (&original.key, original.fingerprint),
            "{what}"
        );
        assert!(close(moved.ttl, original.ttl), "{what}");
        match (moved.response_ttl, original.response_ttl) {
            (None, None) => {}
            (Some(a), Some(b)) => assert!(close(a, b), "{what}"),
            _ => panic!("the response's lifetime changed: {what}"),
        }
        match (&moved.state, &original.state) {
            (
                CarriedState::Unknown {
                    reason,
                    owner,
                    schedule,
                },
                CarriedState::Unknown {
                    reason: r,
                    owner: o,
                    schedule: s,
                },
            ) => {
                assert_eq!((reason, owner), (r, o), "{what}");
                match (schedule, s) {
                    (None, None) => {}
                    (Some(a), Some(b)) => {
                        assert!(close(a.give_up_in, b.give_up_in), "{what}");
                        assert_eq!(a.due_in.is_some(), b.due_in.is_some(), "{what}");
                        assert!(a.due_in.zip(b.due_in).is_none_or(|(a, b)| close(a, b)), "{what}");
                    }
                    _ => panic!("the probe's schedule changed: {what}"),
                }
            }
            (
                CarriedState::Completed {
                    status,
                    completed_at,
                    response,
                },
                CarriedState::Completed {
                    status: s,
                    completed_at: c,
                    response: r,
                },
            ) => {
                assert_eq!((status, response), (s, r), "{what}");
                // A store that keeps no completion time (Redis's `2C`) gives none back.
                assert!(completed_at.is_none() || c.is_none() || completed_at == c, "{what}");
            }
            _ => panic!("the state changed: {what}"),
        }
    }
}

async fn store(kind: &StoreKind) -> AnyStore {
    let upstream = "http://127.0.0.1:9";
    let config = TestConfig::new(kind.clone(), upstream).config();
    idemproxy::store::open_for_tools(&config.store)
        .await
        .expect("open the store")
}

/// Each state moves Redis → Postgres → SQLite → Redis and reads the same at every hop
/// (its lifetimes as they were, less the time between); a record in flight moves as
/// unknown for its claim; a second import keeps what the target holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_state_moves_between_every_pair_of_backends() {
    let (redis, other_redis, postgres) = (RedisServer::start(), RedisServer::start(), PostgresServer::start());
    let dir = tempfile::tempdir().expect("a temporary directory");
    let hops = [
        StoreKind::Redis(redis.url()),
        StoreKind::Postgres(postgres.url()),
        StoreKind::Sqlite(dir.path().join("records.db")),
        StoreKind::Redis(other_redis.url()),
    ];
    let first = store(&hops[0]).await;
    let mut original = every_state();
    let imported = first.import(original.clone()).await.expect("import");
    assert_eq!((imported.written, imported.kept), (original.len(), 0));
    let again = first.import(original.clone()).await.expect("import");
    assert_eq!(
        (again.written, again.kept),
        (0, original.len()),
        "a key the target holds keeps its record"
    );
    // A claim in flight moves as unknown for the claim that made it.
    let owner = OwnerToken::generate().expect("random bytes");
    let claim = idemproxy::store::ClaimRequest {
        key: store_key("in-flight"),
        scope: None,
        client: None,
        owner,
        fingerprint: Fingerprint([9; 32]),
        retention: Duration::from_secs(60),
        remember: Duration::from_secs(60),
        lease: Duration::from_secs(30),
        response_limit: 1 << 20,
        probe_key: None,
    };
    use idemproxy::store::RecordStore;
    first.claim(&claim).await.expect("claim");
    original.push(record(
        "in-flight",
        Duration::from_secs(60),
        None,
        CarriedState::Unknown {
            reason: UnknownReason::MovedInFlight,
            owner: Some(owner),
            schedule: None,
        },
    ));
    original.last_mut().expect("one").fingerprint = Fingerprint([9; 32]);
    original.sort_by(|a, b| a.key.cmp(&b.key));

    let mut moved = all(&first).await;
    assert_same(&moved, &original, "read from redis");
    for (from, to) in hops.iter().zip(&hops[1..]) {
        let target = store(to).await;
        let imported = target.import(moved.clone()).await.expect("import");
        assert_eq!(imported.written, original.len(), "{from:?} -> {to:?}");
        moved = all(&target).await;
        assert_same(&moved, &original, &format!("{from:?} -> {to:?}"));
    }
}

/// A copy killed part way (SIGKILL) and run again ends with every record in the
/// target once: the second run writes what the first did not, and keeps the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_killed_part_way_and_run_again_copies_every_record_once() {
    const RECORDS: usize = 40_000;
    let upstream = Upstream::start().await;
    let postgres = PostgresServer::start();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let from = config(StoreKind::Sqlite(dir.path().join("records.db")), &upstream);
    let to = config(StoreKind::Postgres(postgres.url()), &upstream);
    {
        let source = store(&from.store).await;
        let records: Vec<Carried> = (0..RECORDS)
            .map(|n| {
                record(
                    &format!("key-{n}"),
                    Duration::from_secs(3600),
                    None,
                    CarriedState::Completed {
                        status: 201,
                        completed_at: None,
                        response: response(r#"{"amount":100,"currency":"EUR","status":"paid"}"#),
                    },
                )
            })
            .collect();
        for chunk in records.chunks(5000) {
            source.import(chunk.to_vec()).await.expect("seed the source");
        }
    }
    // The target's schema, made before the copy starts, so that it can be counted.
    drop(store(&to.store).await);
    let (from_file, to_file) = (from.write_temp(), to.write_temp());
    let mut first = copy_command(from_file.path(), to_file.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the copy");
    let count = || records_in(&postgres);
    // Killed once the target holds some records but not all (a poll on a condition).
    let deadline = Instant::now() + Duration::from_secs(60);
    while count() < 2000 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill().expect("kill the copy");
    let status = first.wait().expect("the copy ends");
    let at_kill = count();
    assert!(!status.success(), "the copy was killed");
    assert!(
        (2000..RECORDS).contains(&at_kill),
        "the copy was killed part way: the target held {at_kill} of {RECORDS}"
    );
    let output = copy_command(from_file.path(), to_file.path())
        .output()
        .expect("run the copy again");
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
    let written: usize = stdout
        .split(" written")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the summary says how many were written");
    assert!(stdout.contains(&format!("{RECORDS} records read")), "{stdout}");
    assert!(written <= RECORDS - at_kill, "{stdout}: {at_kill} were there already");
    assert_eq!(count(), RECORDS, "{stdout}");
    let distinct = postgres.psql("SELECT count(DISTINCT key) FROM idemproxy.records");
    assert_eq!(distinct.trim(), RECORDS.to_string());
    eprintln!("killed with {at_kill} of {RECORDS} copied; the second run: {stdout}");
}

/// `[store.previous]` in a config: `backend` at `url`, read until `until`.
fn previous(config: &mut TestConfig, old: &StoreKind, until: SystemTime) {
    let (backend, url) = match old {
        StoreKind::Redis(url) => ("redis", url),
        StoreKind::Postgres(url) => ("postgres", url),
        other => panic!("not a shared store: {other:?}"),
    };
    let until = humantime::format_rfc3339_seconds(until);
    config.store_extra = format!("[store.previous]\nbackend = \"{backend}\"\nurl = \"{url}\"\nuntil = \"{until}\"");
}

fn a_day() -> SystemTime {
    SystemTime::now() + Duration::from_secs(86_400)
}

/// An online switch from `old` to `new`: a proxy on the old store records `paid` and
/// holds `held` at the upstream; a proxy on the new store with the old as its
/// previous replays `paid` (422 for another request), answers 409 for `held`, claims
/// a fresh key in the new store alone, and keeps what it found: the records are in the
/// new store afterwards (`held_in_new` counts the switch's keys there).
async fn online(old: StoreKind, new: StoreKind, held_in_new: impl Fn() -> usize) {
    let upstream = Upstream::start().await;
    let old_config = config(old.clone(), &upstream);
    let old_proxy = ChildProxy::start(&old_config).await;
    let claimed = Instant::now();
    let paid = pay(old_proxy.addr, "paid", r#"{"amount":100}"#, &[]).await;
    assert_eq!(paid.status, 201, "{paid:?}");
    let addr = old_proxy.addr;
    let held =
        tokio::spawn(async move { support::client::try_send_key(addr, "held", &[("x-test-hold", "held")]).await });
    upstream.wait_for_key("held").await;

    let mut new_config = config(new, &upstream);
    previous(&mut new_config, &old, a_day());
    let proxy = ChildProxy::start(&new_config).await;
    let replay = pay(proxy.addr, "paid", r#"{"amount":100}"#, &[]).await;
    assert_eq!((replay.status.as_u16(), replay.replayed()), (201, true), "{replay:?}");
    assert_eq!((replay.execution(), &replay.body), (paid.execution(), &paid.body));
    let reused = pay(proxy.addr, "paid", r#"{"amount":999}"#, &[]).await;
    assert_eq!(reused.status, 422, "{reused:?}");
    let unknown = pay(proxy.addr, "held", "{}", &[]).await;
    assert_eq!(
        (unknown.status.as_u16(), unknown.problem().as_str()),
        (409, "outcome-unknown")
    );
    assert!(
        text(&unknown.body).contains("moved-in-flight"),
        "{}",
        text(&unknown.body)
    );
    let fresh = pay(proxy.addr, "fresh", "{}", &[]).await;
    assert_eq!((fresh.status.as_u16(), fresh.replayed()), (201, false), "{fresh:?}");
    assert_eq!(held_in_new(), 3, "paid, held and fresh are the new store's now");
    let metrics = support::client::metric(proxy.admin, "idemproxy_store_previous_records_total").await;
    assert_eq!(metrics, Some(2.0), "two records found in the previous store");

    // The old proxy's request ends there; the new store keeps what it copied (unknown).
    upstream.release("held");
    let _ = held.await;
    let still = pay(proxy.addr, "held", "{}", &[]).await;
    assert_eq!(still.status, 409, "{still:?}");
    // The retention copied with the record still ends on time in the new store.
    tokio::time::sleep_until(claimed + RETENTION + Duration::from_millis(1500)).await;
    let late = pay(proxy.addr, "paid", r#"{"amount":100}"#, &[]).await;
    assert_eq!(
        (late.status.as_u16(), late.problem().as_str()),
        (410, "response-expired"),
        "{late:?}"
    );
    assert_eq!(
        (
            upstream.executions("paid"),
            upstream.executions("held"),
            upstream.executions("fresh")
        ),
        (1, 1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_online_switch_from_redis_to_postgres_replays_what_redis_recorded() {
    let (redis, postgres) = (RedisServer::start(), PostgresServer::start());
    let count = || records_in(&postgres);
    online(
        StoreKind::Redis(redis.url()),
        StoreKind::Postgres(postgres.url()),
        count,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_online_switch_from_postgres_to_redis_replays_what_postgres_recorded() {
    let (redis, postgres) = (RedisServer::start(), PostgresServer::start());
    let count = || redis.keys().iter().filter(|key| !key.ends_with(":r")).count();
    online(
        StoreKind::Postgres(postgres.url()),
        StoreKind::Redis(redis.url()),
        count,
    )
    .await;
}

/// A previous store that stops answering mid-switch: a key the new store does not
/// hold gets 503 and is neither forwarded nor left claimed in the new store; once the
/// previous store answers again, the key it holds replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_store_that_stops_answering_refuses_the_keys_it_might_hold() {
    let (redis, postgres) = (RedisServer::start(), PostgresServer::start());
    let upstream = Upstream::start().await;
    let old = config(StoreKind::Redis(redis.url()), &upstream);
    let old_proxy = ChildProxy::start(&old).await;
    let paid = pay(old_proxy.addr, "paid", "{}", &[]).await;
    assert_eq!(paid.status, 201);
    drop(old_proxy);
    let mut new = config(StoreKind::Postgres(postgres.url()), &upstream);
    previous(&mut new, &old.store, a_day());
    // Forwarding on a store error must not forward a key the previous store may hold.
    new.idempotency.push_str("\non_store_error = \"forward\"");
    let proxy = ChildProxy::start(&new).await;
    redis.pause();
    for key in ["paid", "never-seen"] {
        let refused = pay(proxy.addr, key, "{}", &[]).await;
        assert_eq!(
            (refused.status.as_u16(), refused.problem().as_str()),
            (503, "store-unavailable"),
            "{refused:?}"
        );
    }
    assert_eq!((upstream.executions("paid"), upstream.executions("never-seen")), (1, 0));
    // The claims that looked are released (in the background: polled).
    let deadline = Instant::now() + Duration::from_secs(10);
    while records_in(&postgres) != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(records_in(&postgres), 0, "a claim was left in the new store");
    redis.resume();
    let replay = pay(proxy.addr, "paid", "{}", &[]).await;
    assert_eq!((replay.status.as_u16(), replay.replayed()), (201, true), "{replay:?}");
    assert_eq!(upstream.executions("paid"), 1);
}

/// Past `until` the previous store is not read: a log line and the gauge say so. A
/// reload drops it, and adds it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_until_the_previous_store_is_not_read_and_a_reload_adds_or_drops_it() {
    let (redis, postgres) = (RedisServer::start(), PostgresServer::start());
    let upstream = Upstream::start().await;
    let old = config(StoreKind::Redis(redis.url()), &upstream);
    let mut new = config(StoreKind::Postgres(postgres.url()), &upstream);
    let until = SystemTime::now() + Duration::from_secs(4);
    previous(&mut new, &old.store, until);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let log = dir.path().join("proxy.log");
    let mut proxy = ChildProxy::start_logged(&new, &log, &[]).await;
    let gauge = "idemproxy_store_previous_reading";
    assert_eq!(support::client::metric(proxy.admin, gauge).await, Some(1.0));
    let before = pay(proxy.addr, "before", "{}", &[]).await;
    assert_eq!(before.status, 201);
    let reads = "idemproxy_store_operation_seconds_count{op=\"previous_read\",result=\"ok\"}";
    let read_before = support::client::metric(proxy.admin, reads).await.unwrap_or(0.0);
    assert!(read_before >= 1.0, "the fresh key was looked up in the previous store");
    // Waits for the time the test set (the clock is the subject, not a race).
    tokio::time::sleep(until.duration_since(SystemTime::now()).unwrap_or_default() + Duration::from_millis(200)).await;
    let after = pay(proxy.addr, "after", "{}", &[]).await;
    assert_eq!(after.status, 201);
    assert_eq!(
        support::client::metric(proxy.admin, reads).await,
        Some(read_before),
        "read past until"
    );
    assert_eq!(support::client::metric(proxy.admin, gauge).await, Some(0.0));
    support::proxy::log_line(&log, "is past its until and is no longer read");

    // A reload with a later until reads it again; one without it drops it.
    previous(&mut new, &old.store, a_day());
    proxy.rewrite(&new);
    proxy.signal("HUP");
    support::client::until_metric(proxy.admin, gauge, 1.0).await;
    new.store_extra = String::new();
    proxy.rewrite(&new);
    proxy.signal("HUP");
    support::client::until_metric(proxy.admin, gauge, 0.0).await;
    proxy.kill();
}

/// `check` refuses an embedded previous store, saying to copy during a stop, and a
/// previous store without `until`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_an_embedded_previous_store_and_one_without_until() {
    let upstream = Upstream::start().await;
    let mut config = config(StoreKind::Redis("redis://127.0.0.1:6379".into()), &upstream);
    let check = |config: &TestConfig| {
        let file = config.write_temp();
        let output = binary_command(&[])
            .args(["check", "--config"])
            .arg(file.path())
            .output()
            .expect("run idemproxy check");
        (output.status.success(), text(&output.stderr))
    };
    config.store_extra = "[store.previous]\nbackend = \"sqlite\"\nuntil = \"2030-01-01T00:00:00Z\"".into();
    let (passed, stderr) = check(&config);
    assert!(!passed && stderr.contains("store.previous.backend"), "{stderr}");
    assert!(stderr.contains("idemproxy store copy"), "{stderr}");
    config.store_extra = "[store.previous]\nbackend = \"postgres\"\nurl = \"postgres://old/db\"".into();
    let (passed, stderr) = check(&config);
    assert!(
        !passed && stderr.contains("store.previous.until: is required"),
        "{stderr}"
    );
    config.store_extra =
        "[store.previous]\nbackend = \"postgres\"\nurl = \"postgres://old/db\"\nuntil = \"2030-01-01T00:00:00Z\""
            .into();
    let (passed, stderr) = check(&config);
    assert!(passed, "{stderr}");
}

/// The switch storms' proxies: scoped by tenant (two share each key name), a store
/// timeout that a loaded machine meets.
fn storm_config(store: StoreKind, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "2s".into();
    config.idempotency = "scope_headers = [\"authorization\"]".into();
    config
}

fn storm(name: &'static str, targets: &[ChildProxy]) -> support::storm::Storm {
    support::storm::Storm {
        name,
        targets: targets.iter().map(|proxy| proxy.addr).collect(),
        logical: 1000,
        duplicates: 3,
        concurrency: 64,
        jitter_ms: 5,
        streamed: false,
    }
}

/// The upstream's executions of one storm's keys.
fn executions_of(upstream: &Upstream, name: &str) -> Vec<support::upstream::Execution> {
    upstream
        .log()
        .into_iter()
        .filter(|run| run.key.starts_with(name))
        .collect()
}

/// Every record in the Postgres store with its TTL in milliseconds, for the checker.
fn postgres_ttls(postgres: &PostgresServer) -> Vec<(String, i64)> {
    postgres
        .psql("SELECT key || ' ' || floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000) FROM idemproxy.records")
        .lines()
        .filter_map(|line| line.rsplit_once(' '))
        .map(|(key, ttl)| (key.to_string(), ttl.parse().unwrap_or(-1)))
        .collect()
}

async fn start_three(config: &TestConfig) -> Vec<ChildProxy> {
    vec![
        ChildProxy::start(config).await,
        ChildProxy::start(config).await,
        ChildProxy::start(config).await,
    ]
}

/// A storm on one SQLite proxy (1,000 keys x 3; two tenants share each key name), a stop, a copy into Postgres, and the
/// same storm again through three proxies on Postgres: each key ran once, every answer
/// of a key is byte-identical, and every record kept its lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_across_a_copy_from_sqlite_to_postgres_runs_no_key_twice() {
    let postgres = PostgresServer::start();
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sqlite = storm_config(StoreKind::Sqlite(dir.path().join("records.db")), &upstream);
    let target = storm_config(StoreKind::Postgres(postgres.url()), &upstream);
    let mut first = vec![ChildProxy::start(&sqlite).await];
    let before = storm("copy", &first);
    let run = before.start();
    before.run(&run).await;
    before.settle(&run).await.assert_live("before the copy", 1.0);
    first[0].signal("TERM");
    let _ = first[0].child.wait();
    let copied = copy(&sqlite, &target);
    assert!(copied.status.success(), "{}", text(&copied.stderr));
    assert!(
        text(&copied.stdout).contains("1000 records read, 1000 written"),
        "{}",
        text(&copied.stdout)
    );
    let proxies = start_three(&target).await;
    let after = storm("copy", &proxies);
    after.run(&run).await;
    let report = after.check(
        &run,
        &upstream.log(),
        &postgres_ttls(&postgres),
        Duration::from_secs(3600),
        vec![],
    );
    report.assert_clean("across a copy: 1 process on SQLite, then 3 on Postgres, 1000 keys x 3 each side");
    assert_eq!(report.executions, 1000, "each key ran once");
    drop(first);
}

/// An online switch and back: three proxies on Redis (storm A), then three on Postgres
/// reading Redis as their previous store (storm A again, and a fresh storm B at once),
/// then three on Redis reading Postgres (A and B again). No key of either storm runs
/// twice, and every answer of a key is byte-identical across the switches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_across_an_online_switch_to_postgres_and_back_runs_no_key_twice() {
    let (redis, postgres) = (RedisServer::start(), PostgresServer::start());
    let upstream = Upstream::start().await;
    let on_redis = storm_config(StoreKind::Redis(redis.url()), &upstream);
    let mut on_postgres = storm_config(StoreKind::Postgres(postgres.url()), &upstream);
    previous(&mut on_postgres, &on_redis.store, a_day());
    let mut back_on_redis = on_redis.clone();
    previous(&mut back_on_redis, &on_postgres.store, a_day());

    let proxies = start_three(&on_redis).await;
    let (run_a, run_b) = (storm("online-a", &proxies).start(), storm("online-b", &proxies).start());
    storm("online-a", &proxies).run(&run_a).await;
    storm("online-a", &proxies)
        .settle(&run_a)
        .await
        .assert_live("A on Redis", 1.0);
    drop(proxies);

    let proxies = start_three(&on_postgres).await;
    let (a, b) = (storm("online-a", &proxies), storm("online-b", &proxies));
    tokio::join!(a.run(&run_a), b.run(&run_b));
    b.settle(&run_b).await.assert_live("B on Postgres", 1.0);
    drop(proxies);

    let proxies = start_three(&back_on_redis).await;
    let (a, b) = (storm("online-a", &proxies), storm("online-b", &proxies));
    tokio::join!(a.run(&run_a), b.run(&run_b));
    let mut store = redis.dump_ttls();
    store.extend(postgres_ttls(&postgres));
    for (storm, run, scenario) in [
        (
            &a,
            &run_a,
            "A: Redis, then Postgres reading Redis, then Redis reading Postgres",
        ),
        (&b, &run_b, "B: Postgres reading Redis, then Redis reading Postgres"),
    ] {
        let runs = executions_of(&upstream, storm.name);
        let report = storm.check(run, &runs, &store, Duration::from_secs(3600), vec![]);
        report.assert_clean(scenario);
        assert_eq!(report.executions, 1000, "{scenario}: each key ran once");
        report.print(scenario);
    }
}
