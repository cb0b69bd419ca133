//! Production Redis topologies under faults (docs/design.md §6): a Sentinel group (one primary,
//! two replicas, three sentinels) and a Redis Cluster (three primaries, three
//! replicas), each started by the test from the same `redis-server` binary. Storms of
//! three proxy processes run through them while primaries are killed, failovers happen,
//! slots migrate and scripts are flushed, and the history checker holds every run to
//! the same properties as the single-primary histories. Run with `--nocapture` to see
//! the figures, including the time from a promotion to the first guarded success.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use std::collections::BTreeSet;

use idemproxy::idempotency::{parse_key_value, store_key};
use support::client::until_not;
use support::storm::{Storm, until_progress};
use support::topology::{MASTER_NAME, RedisCluster, SentinelGroup, role, when};
use support::{ChildProxy, Mode, StoreKind, TestConfig, Upstream, post_key, send};
use tokio::time::Instant;

/// How long a failover may take before the test gives up on it.
const FAILOVER: Duration = Duration::from_secs(60);

const RETENTION: Duration = Duration::from_secs(3600);

fn config(store: StoreKind, upstream: &Upstream, store_extra: &str) -> TestConfig {
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "1s".into();
    config.store_extra = store_extra.into();
    config.idempotency = "scope_headers = [\"authorization\"]".into();
    config
}

/// A claim needs one replica's acknowledgement. The wait for it is the store's
/// timeout, not the 100 ms default: a replica that has just rejoined (after a full
/// resync) on a loaded two-core machine can take longer than that to acknowledge, and
/// the 503 the proxy then rightly answers would fall after the outage window ends.
const REPLICA_ACKS: &str = "min_replica_acks = 1\nreplica_ack_timeout = \"1s\"";

fn sentinel_store(group: &SentinelGroup) -> StoreKind {
    StoreKind::Sentinel(group.urls(), MASTER_NAME.into())
}

fn cluster_store(cluster: &RedisCluster) -> StoreKind {
    StoreKind::Cluster(cluster.urls())
}

async fn three_proxies(config: &TestConfig) -> Vec<ChildProxy> {
    vec![
        ChildProxy::start(config).await,
        ChildProxy::start(config).await,
        ChildProxy::start(config).await,
    ]
}

fn storm(name: &'static str, proxies: &[ChildProxy], logical: usize) -> Storm {
    Storm {
        name,
        targets: proxies.iter().map(|proxy| proxy.addr).collect(),
        logical,
        duplicates: 10,
        concurrency: 48,
        jitter_ms: 20,
        streamed: false,
    }
}

/// Runs the checker over a storm and asserts every property, liveness included.
#[allow(clippy::too_many_arguments)]
fn assert_clean(
    scenario: &str,
    storm: &Storm,
    run: &support::storm::StormRun,
    upstream: &Upstream,
    ttls: &[(String, i64)],
    outages: Vec<(Instant, Instant)>,
    liveness: &support::storm::Liveness,
    min_success: f64,
) -> support::history::Report {
    let report = storm.check(run, &upstream.log(), ttls, RETENTION, outages);
    report.assert_clean(scenario);
    liveness.assert_live(scenario, min_success);
    report
}

// === 1. storms without a fault ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_through_sentinel_runs_each_key_once() {
    let group = SentinelGroup::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(sentinel_store(&group), &upstream, "")).await;
    let storm = storm("sentinel", &proxies, 300);
    let run = storm.start();
    storm.run(&run).await;
    let liveness = storm.settle(&run).await;
    let ttls = group.dump_ttls();
    let report = assert_clean(
        "sentinel, no fault",
        &storm,
        &run,
        &upstream,
        &ttls,
        vec![],
        &liveness,
        1.0,
    );
    assert_eq!(
        report.executions, storm.logical,
        "every logical operation ran exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_through_a_cluster_runs_each_key_once_and_spreads_over_the_shards() {
    let cluster = RedisCluster::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(cluster_store(&cluster), &upstream, "")).await;
    let storm = storm("cluster", &proxies, 300);
    let run = storm.start();
    storm.run(&run).await;
    let liveness = storm.settle(&run).await;
    let ttls = cluster.dump_ttls();
    let report = assert_clean(
        "cluster, no fault",
        &storm,
        &run,
        &upstream,
        &ttls,
        vec![],
        &liveness,
        1.0,
    );
    assert_eq!(
        report.executions, storm.logical,
        "every logical operation ran exactly once"
    );
    // The hash tag spreads records over every primary.
    let per_primary: Vec<i64> = cluster
        .primaries()
        .into_iter()
        .map(|port| cluster.on(port, &mut redis::cmd("DBSIZE")).expect("DBSIZE"))
        .collect();
    println!("cluster: records per primary {per_primary:?}");
    assert_eq!(per_primary.iter().sum::<i64>(), 300);
    assert!(
        per_primary.iter().all(|count| *count > 50),
        "records are not spread: {per_primary:?}"
    );
}

/// Waits until every proxy has answered a fresh guarded request with a success, and
/// returns the moment the last one did.
async fn until_every_proxy_serves(proxies: &[ChildProxy], tag: &str) -> Instant {
    let mut last = Instant::now();
    for (index, proxy) in proxies.iter().enumerate() {
        let mut attempt = 0;
        last = when("a proxy serves again", FAILOVER, async || {
            attempt += 1;
            post_key(proxy.addr, &format!("{tag}-{index}-{attempt}")).await.status == 201
        })
        .await;
    }
    last
}

/// When a fault was injected, when the new primary took over, and when every proxy
/// served a guarded request again.
#[derive(Debug, Clone, Copy)]
struct Failover {
    fault: Instant,
    promoted: Instant,
    served: Instant,
}

impl Failover {
    fn print(&self, scenario: &str) {
        println!(
            "failover[{scenario}]: promotion {:.2?} after the fault; every proxy served a guarded request \
             {:.2?} after the promotion",
            self.promoted - self.fault,
            self.served - self.promoted
        );
    }
}

// === 2. Sentinel: the primary killed mid-storm ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_the_primary_killed_mid_storm_fails_over_without_a_restart() {
    let mut group = SentinelGroup::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(sentinel_store(&group), &upstream, REPLICA_ACKS)).await;
    let storm = storm("sentinel-kill", &proxies, 300);
    let run = storm.start();
    let mut failover = None;
    let inject =
        async {
            until_progress(&run, storm.total() * 3 / 10).await;
            let old = group.primary().expect("a primary");
            let fault = Instant::now();
            group.node(old).kill();
            let promoted = when("the sentinels promote a replica", FAILOVER, async || {
            matches!(group.primary(), Some(port) if port != old && role(port).as_deref() == Some("master"))
        })
        .await;
            let served = until_every_proxy_serves(&proxies, "after-kill").await;
            failover = Some(Failover {
                fault,
                promoted,
                served,
            });
        };
    tokio::join!(storm.run(&run), inject);
    let failover = failover.expect("the fault was injected");
    let liveness = storm.settle(&run).await;
    let ttls = group.dump_ttls();
    let scenario = "sentinel, primary SIGKILL";
    failover.print(scenario);
    assert_clean(
        scenario,
        &storm,
        &run,
        &upstream,
        &ttls,
        vec![(failover.fault, failover.served)],
        &liveness,
        0.8,
    );
}

// === 3. Cluster: a primary killed, and a graceful failover, mid-storm ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_primary_killed_mid_storm_its_replica_takes_over() {
    let mut cluster = RedisCluster::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(cluster_store(&cluster), &upstream, REPLICA_ACKS)).await;
    let storm = storm("cluster-kill", &proxies, 300);
    let run = storm.start();
    let mut failover = None;
    let inject = async {
        until_progress(&run, storm.total() * 3 / 10).await;
        let victim = cluster.primaries()[0];
        let replica = cluster.replica_of(victim).expect("the primary has a replica");
        let fault = Instant::now();
        cluster.node(victim).kill();
        let promoted = when("the replica is promoted", FAILOVER, async || {
            role(replica).as_deref() == Some("master")
        })
        .await;
        let served = until_every_proxy_serves(&proxies, "after-kill").await;
        // The promoted primary has no replica: with min_replica_acks = 1 its shard
        // refuses new claims until the old primary is back, as its replica.
        cluster.node(victim).restart();
        cluster.until_whole();
        let rejoined = Instant::now();
        failover = Some(Failover {
            fault,
            promoted,
            served,
        });
        rejoined
    };
    let (_, rejoined) = tokio::join!(storm.run(&run), inject);
    let failover = failover.expect("the fault was injected");
    println!(
        "cluster, primary SIGKILL: the old primary rejoined as a replica {:.2?} after the promotion",
        rejoined - failover.promoted
    );
    let liveness = storm.settle(&run).await;
    let ttls = cluster.dump_ttls();
    let scenario = "cluster, primary SIGKILL";
    failover.print(scenario);
    assert_clean(
        scenario,
        &storm,
        &run,
        &upstream,
        &ttls,
        vec![(failover.fault, rejoined)],
        &liveness,
        0.8,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_graceful_failover_mid_storm() {
    let cluster = RedisCluster::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(cluster_store(&cluster), &upstream, REPLICA_ACKS)).await;
    let storm = storm("cluster-failover", &proxies, 300);
    let run = storm.start();
    let mut failover = None;
    let inject = async {
        until_progress(&run, storm.total() * 3 / 10).await;
        let primary = cluster.primaries()[0];
        let replica = cluster.replica_of(primary).expect("the primary has a replica");
        let fault = Instant::now();
        let _: () = cluster
            .on(replica, redis::cmd("CLUSTER").arg("FAILOVER"))
            .expect("CLUSTER FAILOVER");
        let promoted = when("the replica is promoted", FAILOVER, async || {
            role(replica).as_deref() == Some("master")
        })
        .await;
        let served = until_every_proxy_serves(&proxies, "after-failover").await;
        failover = Some(Failover {
            fault,
            promoted,
            served,
        });
    };
    tokio::join!(storm.run(&run), inject);
    let failover = failover.expect("the failover was started");
    let liveness = storm.settle(&run).await;
    let ttls = cluster.dump_ttls();
    let scenario = "cluster, CLUSTER FAILOVER";
    failover.print(scenario);
    assert_clean(
        scenario,
        &storm,
        &run,
        &upstream,
        &ttls,
        vec![(failover.fault, failover.served)],
        &liveness,
        0.95,
    );
}

// === 4. Cluster: slots migrated mid-storm ===

/// The record key of a storm's logical operation, as the proxy derives it.
fn record_key(storm: &Storm, logical: usize) -> String {
    let (scope, key) = storm.scope_and_key(logical);
    let key = parse_key_value(key.as_bytes()).expect("key");
    store_key("idemproxy", "payments", &[vec![scope.as_bytes()]], &key)
        .as_str()
        .to_string()
}

/// The port of the primary that serves `slot`, from `CLUSTER SLOTS`.
fn slot_owner(cluster: &RedisCluster, slot: u16) -> u16 {
    let any = cluster.primaries()[0];
    // Each range is [start, end, [ip, port, id, ...] of the primary, replicas...].
    let ranges: Vec<Vec<redis::Value>> = cluster
        .on(any, redis::cmd("CLUSTER").arg("SLOTS"))
        .expect("CLUSTER SLOTS");
    ranges
        .into_iter()
        .find_map(|range| {
            let start: u16 = redis::from_redis_value(range.first()?.clone()).ok()?;
            let end: u16 = redis::from_redis_value(range.get(1)?.clone()).ok()?;
            let primary: Vec<redis::Value> = redis::from_redis_value(range.get(2)?.clone()).ok()?;
            let port: u16 = redis::from_redis_value(primary.get(1)?.clone()).ok()?;
            (start..=end).contains(&slot).then_some(port)
        })
        .expect("every slot has a primary")
}

/// Moves `slot` from its primary to `to` with `CLUSTER SETSLOT ... MIGRATING/IMPORTING`
/// and `MIGRATE`, the way `redis-cli --cluster reshard` does; returns the keys moved.
fn migrate_slot(cluster: &RedisCluster, slot: u16, to: u16) -> usize {
    let from = slot_owner(cluster, slot);
    if from == to {
        return 0;
    }
    let (from_id, to_id) = (cluster.id(from), cluster.id(to));
    let set = |port: u16, how: &str, id: &str| {
        let _: () = cluster
            .on(port, redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg(how).arg(id))
            .expect("CLUSTER SETSLOT");
    };
    set(to, "IMPORTING", &from_id);
    set(from, "MIGRATING", &to_id);
    let mut moved = 0;
    loop {
        let keys: Vec<String> = cluster
            .on(from, redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(100))
            .expect("GETKEYSINSLOT");
        if keys.is_empty() {
            break;
        }
        moved += keys.len();
        let _: () = cluster
            .on(
                from,
                redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(to)
                    .arg("")
                    .arg(0)
                    .arg(5000)
                    .arg("KEYS")
                    .arg(&keys),
            )
            .expect("MIGRATE");
    }
    for port in cluster.primaries() {
        set(port, "NODE", &to_id);
    }
    moved
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_slots_migrated_mid_storm() {
    let cluster = RedisCluster::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(cluster_store(&cluster), &upstream, "")).await;
    let storm = storm("cluster-migrate", &proxies, 300);
    let run = storm.start();
    let mut migrated = (0, 0);
    let inject = async {
        until_progress(&run, storm.total() * 2 / 10).await;
        // The slots of the keys the storm is about to reach: their records are
        // claimed, completed and replayed while they move.
        let slots: BTreeSet<u16> = (60..120)
            .map(|logical| {
                cluster
                    .on(
                        cluster.primaries()[0],
                        redis::cmd("CLUSTER").arg("KEYSLOT").arg(record_key(&storm, logical)),
                    )
                    .expect("CLUSTER KEYSLOT")
            })
            .collect();
        let primaries = cluster.primaries();
        for (index, slot) in slots.iter().enumerate() {
            migrated.1 += migrate_slot(&cluster, *slot, primaries[index % primaries.len()]);
            migrated.0 += 1;
            tokio::task::yield_now().await;
        }
    };
    tokio::join!(storm.run(&run), inject);
    let liveness = storm.settle(&run).await;
    let ttls = cluster.dump_ttls();
    let scenario = "cluster, slots migrated";
    println!(
        "{scenario}: {} slots moved with {} records in them",
        migrated.0, migrated.1
    );
    let report = assert_clean(scenario, &storm, &run, &upstream, &ttls, vec![], &liveness, 1.0);
    assert_eq!(report.executions, storm.logical);
    assert!(migrated.0 >= 30, "too few slots moved to mean anything: {migrated:?}");
}

// === 5. Cluster: SCRIPT FLUSH on every node mid-storm ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_script_flush_on_every_node_mid_storm_costs_nothing() {
    let cluster = RedisCluster::start();
    let upstream = Upstream::start().await;
    let proxies = three_proxies(&config(cluster_store(&cluster), &upstream, "")).await;
    let storm = storm("cluster-flush", &proxies, 300);
    let run = storm.start();
    let inject = async {
        until_progress(&run, storm.total() * 3 / 10).await;
        for node in &cluster.nodes {
            let _: () = cluster
                .on(node.port, redis::cmd("SCRIPT").arg("FLUSH"))
                .expect("SCRIPT FLUSH");
        }
    };
    tokio::join!(storm.run(&run), inject);
    let liveness = storm.settle(&run).await;
    let ttls = cluster.dump_ttls();
    let report = assert_clean(
        "cluster, SCRIPT FLUSH everywhere",
        &storm,
        &run,
        &upstream,
        &ttls,
        vec![],
        &liveness,
        1.0,
    );
    assert!(
        !report.failures.contains_key("store-unavailable"),
        "SCRIPT FLUSH must cost nothing: {:?}",
        report.failures
    );
}

// === 6. The failover window, made deterministic ===

/// What one run of the failover window saw.
#[derive(Debug)]
struct Window {
    /// Answers to the first requests while replication was stopped.
    before: Vec<u16>,
    /// Keys the upstream ran twice.
    duplicates: usize,
    /// `idemproxy_replica_acks_missed_total`, summed over the proxies, before the fault.
    acks_missed: f64,
    failover: Failover,
}

/// Replication is cut off (each replica's link runs through a relay, now a blackhole),
/// so the primary acknowledges claims its replicas never see; `KEYS` requests are
/// sent; the primary is SIGKILLed and a stale replica promoted; then the same keys are
/// retried until they settle. (SIGSTOP on the replicas would not do: the stream waits in
/// their socket buffers and is applied when they resume.)
/// `idemproxy_replica_acks_missed_total`, summed over `proxies`.
async fn replica_acks_missed(proxies: &[ChildProxy]) -> f64 {
    let mut missed = 0.0;
    for proxy in proxies {
        let metrics = send(proxy.admin, "GET", "/metrics", &[], "").await;
        missed += String::from_utf8_lossy(&metrics.body)
            .lines()
            .find_map(|line| {
                line.strip_prefix("idemproxy_replica_acks_missed_total ")?
                    .parse::<f64>()
                    .ok()
            })
            .expect("the replica_acks_missed metric");
    }
    missed
}

async fn failover_window(min_replica_acks: u32) -> Window {
    const KEYS: usize = 40;
    let mut group = SentinelGroup::start_relayed().await;
    let upstream = Upstream::start().await;
    let store_extra = format!("min_replica_acks = {min_replica_acks}");
    let proxies = three_proxies(&config(sentinel_store(&group), &upstream, &store_extra)).await;
    // Each proxy resolves the primary and loads its scripts first.
    until_every_proxy_serves(&proxies, "warm").await;
    let primary = group.primary().expect("a primary");
    for relay in &group.relays {
        relay.set(Mode::Blackhole);
    }
    let key = |n: usize| format!("window-{n}");
    let mut before = Vec::new();
    for n in 0..KEYS {
        before.push(post_key(proxies[n % proxies.len()].addr, &key(n)).await.status.as_u16());
    }
    // The claims refused for want of an acknowledgement, counted before the fault:
    // while the promoted primary's replicas reattach after it, a retry may miss its
    // acknowledgement too, and is counted as well.
    let acks_missed = replica_acks_missed(&proxies).await;
    let fault = Instant::now();
    group.node(primary).kill();
    let promoted = when(
        "the sentinels promote a stale replica",
        FAILOVER,
        async || matches!(group.primary(), Some(port) if port != primary && role(port).as_deref() == Some("master")),
    )
    .await;
    let served = until_every_proxy_serves(&proxies, "after-window").await;
    for n in 0..KEYS {
        let name = key(n);
        let settled = until_not(
            || post_key(proxies[(n + 1) % proxies.len()].addr, &name),
            &[(503, "store-unavailable"), (409, "request-in-progress")],
        )
        .await;
        assert!(settled.status.is_success(), "{}: {settled:?}", key(n));
    }
    let duplicates = (0..KEYS).filter(|n| upstream.executions(&key(*n)) > 1).count();
    Window {
        before,
        duplicates,
        acks_missed,
        failover: Failover {
            fault,
            promoted,
            served,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replica_acknowledgements_a_failover_runs_acknowledged_requests_again() {
    let window = failover_window(0).await;
    window.failover.print("failover window, min_replica_acks = 0");
    println!(
        "failover window, min_replica_acks = 0: {} of {} first requests answered 201 while replication was stopped; \
         {} keys ran twice after the stale replica took over",
        window.before.iter().filter(|status| **status == 201).count(),
        window.before.len(),
        window.duplicates
    );
    assert!(window.before.iter().all(|status| *status == 201), "{:?}", window.before);
    // The negative control: this is the window that min_replica_acks closes.
    assert!(
        window.duplicates > 0,
        "no duplicates: the window was not reproduced, so the test proves nothing"
    );
    assert_eq!(window.acks_missed, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_replica_acknowledgement_required_the_failover_window_is_closed() {
    let window = failover_window(1).await;
    window.failover.print("failover window, min_replica_acks = 1");
    println!(
        "failover window, min_replica_acks = 1: {} of {} first requests answered 503 while replication was stopped; \
         {} keys ran twice",
        window.before.iter().filter(|status| **status == 503).count(),
        window.before.len(),
        window.duplicates
    );
    assert!(
        window.before.iter().all(|status| *status == 503),
        "a claim no replica acknowledged was forwarded: {:?}",
        window.before
    );
    assert_eq!(window.duplicates, 0);
    assert_eq!(window.acks_missed, 40.0, "each refused claim is counted");
}

// === readiness ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_topology() {
    let upstream = Upstream::start().await;

    let mut cluster = RedisCluster::start();
    let proxy = ChildProxy::start(&config(cluster_store(&cluster), &upstream, "")).await;
    // A primary and its replica gone: their slots are not served, the cluster is down.
    let victim = cluster.primaries()[0];
    let replica = cluster.replica_of(victim).expect("a replica");
    cluster.node(victim).kill();
    cluster.node(replica).kill();
    when(
        "/readyz says 503 for a cluster with uncovered slots",
        FAILOVER,
        async || send(proxy.admin, "GET", "/readyz", &[], "").await.status == 503,
    )
    .await;

    let mut group = SentinelGroup::start();
    let proxy = ChildProxy::start(&config(sentinel_store(&group), &upstream, "")).await;
    let ports: Vec<u16> = group.nodes.iter().map(|node| node.port).collect();
    for port in ports {
        group.node(port).kill();
    }
    when("/readyz says 503 with no primary to reach", FAILOVER, async || {
        send(proxy.admin, "GET", "/readyz", &[], "").await.status == 503
    })
    .await;
}

/// On a Redis Cluster a record that outlives its response keeps it beside it, in the
/// same hash slot (`<key>:r` ends with the record's `{hash}` tag, as the record's waiters'
/// channel does), so the scripts that write both keys run on one node: the response
/// replays within the retention, and past it the retry gets 410 and runs nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_record_and_its_response_kept_beside_it_share_a_slot() {
    let cluster = RedisCluster::start();
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(cluster_store(&cluster), &upstream.url());
    config.store_timeout = "2s".into();
    config.upstream_timeout = "1s".into();
    config.retention = "3s".into();
    config.idempotency = "remember = \"1h\"".into();
    let proxy = ChildProxy::start(&config).await;
    let claimed = Instant::now();
    let first = post_key(proxy.addr, "kept-beside").await;
    assert_eq!(first.status, 201, "{first:?}");
    let replay = post_key(proxy.addr, "kept-beside").await;
    assert_eq!((replay.status.as_u16(), replay.replayed()), (201, true), "{replay:?}");
    tokio::time::sleep_until(claimed + Duration::from_millis(4500)).await;
    let late = post_key(proxy.addr, "kept-beside").await;
    assert_eq!(
        (late.status.as_u16(), late.problem().as_str()),
        (410, "response-expired"),
        "{late:?}"
    );
    assert_eq!(upstream.executions("kept-beside"), 1);
}
