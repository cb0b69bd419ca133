//! The SQLite store through the binary (docs/design.md §21): what survives a stop of
//! the process (SIGTERM, SIGKILL at any moment), one process per file, files that are
//! not the store's, a full disk, and the probes a fresh start schedules. Every test
//! runs real proxy processes on a real file; the storm runs its keys through the
//! history checker across several SIGKILLs.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use support::client::{metric, try_send};
use support::disk::SmallDisk;
use support::storm::{Storm, StormRun, until_progress};
use support::upstream::splitmix;
use support::{ChildProxy, StoreKind, TestConfig, TestResponse, Upstream, send};
use tokio::time::Instant;

const RETENTION: Duration = Duration::from_secs(3600);

fn sqlite_config(file: &Path, upstream: &Upstream) -> TestConfig {
    let mut config = TestConfig::new(StoreKind::Sqlite(file.to_path_buf()), &upstream.url());
    config.store_timeout = "2s".into();
    config
}

async fn pay(proxy: &ChildProxy, key: &str, body: &str) -> TestResponse {
    send(
        proxy.addr,
        "POST",
        "/v1/payments",
        &[("idempotency-key", key), ("content-type", "application/json")],
        body,
    )
    .await
}

/// Stops the child with `signal` and waits for it to exit.
fn stop(proxy: &mut ChildProxy, signal: &str) {
    proxy.signal(signal);
    let status = proxy.child.wait().expect("wait for the proxy");
    if signal == "TERM" {
        assert!(status.success(), "the proxy did not exit cleanly on SIGTERM: {status}");
    }
}

/// A key recorded, the proxy stopped with `signal` and started again on the same
/// file: the retry replays the recorded answer byte for byte (no second execution),
/// and the key with another request is still refused. How many times the upstream
/// ran the key.
async fn restart_and_retry(store: StoreKind, signal: &str) -> usize {
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(store, &upstream.url());
    config.store_timeout = "2s".into();
    let mut proxy = ChildProxy::start(&config).await;
    let first = pay(&proxy, "order-1001", "{\"amount\":1000}").await;
    assert_eq!(first.status, 201, "{first:?}");
    stop(&mut proxy, signal);
    let proxy = ChildProxy::start(&config).await;
    let retry = pay(&proxy, "order-1001", "{\"amount\":1000}").await;
    if upstream.executions("order-1001") == 1 {
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, first.body, "replayed byte for byte");
        assert_eq!(retry.header("x-execution-id"), first.header("x-execution-id"));
        let reused = pay(&proxy, "order-1001", "{\"amount\":9999}").await;
        assert_eq!(
            (reused.status.as_u16(), reused.problem()),
            (422, "idempotency-key-reused".into())
        );
    }
    upstream.executions("order-1001")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_key_replays_after_sigterm_and_a_restart() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let runs = restart_and_retry(StoreKind::Sqlite(dir.path().join("records.db")), "TERM").await;
    assert_eq!(runs, 1, "the retry after the restart ran the operation again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_key_replays_after_sigkill_and_a_restart() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let runs = restart_and_retry(StoreKind::Sqlite(dir.path().join("records.db")), "KILL").await;
    assert_eq!(runs, 1, "the retry after the restart ran the operation again");
}

/// The control: the memory store forgets on restart, and the same steps see the
/// operation run twice. This is what the SQLite store is for (and why `check` warns).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_forgets_its_records_on_restart() {
    assert_eq!(restart_and_retry(StoreKind::Memory, "TERM").await, 2);
}

/// A request held at the upstream when the proxy is SIGKILLed: its claim was on disk
/// before it was forwarded, so after the restart its retries are 409 (in progress
/// until its lease is over, then outcome-unknown), and it never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_when_the_proxy_is_killed_runs_once() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let upstream = Upstream::start().await;
    let mut config = sqlite_config(&dir.path().join("records.db"), &upstream);
    config.upstream_timeout = "2s".into();
    let mut proxy = ChildProxy::start(&config).await;
    let addr = proxy.addr;
    let held = tokio::spawn(async move {
        try_send(
            addr,
            "POST",
            "/v1/payments",
            &[
                ("idempotency-key", "held-1"),
                ("content-type", "application/json"),
                ("x-test-hold", "held"),
            ],
            "{}",
        )
        .await
    });
    upstream.wait_for_key("held-1").await;
    proxy.kill();
    assert!(held.await.expect("task").is_err(), "the killed proxy answered");
    upstream.release("held");
    let proxy = ChildProxy::start(&config).await;
    let started = Instant::now();
    let mut seen = Vec::new();
    loop {
        let retry = pay(&proxy, "held-1", "{}").await;
        assert_eq!(retry.status, 409, "{retry:?}");
        let slug = retry.problem();
        if seen.last() != Some(&slug) {
            seen.push(slug.clone());
        }
        if slug == "outcome-unknown" {
            break;
        }
        assert_eq!(slug, "request-in-progress");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never outcome-unknown: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(upstream.executions("held-1"), 1, "forwarded again after the restart");
}

/// One process per file: a second proxy on the file refuses to start, naming the file
/// and the first one's pid, and the first goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_proxy_on_the_same_file_refuses_to_start() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let upstream = Upstream::start().await;
    let file = dir.path().join("records.db");
    let config = sqlite_config(&file, &upstream);
    let first = ChildProxy::start(&config).await;
    let (code, stderr) = run_refused(&config, dir.path());
    assert_ne!(code, 0);
    assert!(stderr.contains(&file.display().to_string()), "{stderr}");
    assert!(stderr.contains("is in use by another idemproxy"), "{stderr}");
    assert!(stderr.contains(&format!("pid {}", first.child.id())), "{stderr}");
    assert_eq!(pay(&first, "still-serving", "{}").await.status, 201);
}

/// Runs `serve` on `config` (its ports fresh) and waits for it to exit: its exit code
/// and what it printed. It must exit within 20 s.
fn run_refused(config: &TestConfig, dir: &Path) -> (i32, String) {
    run_refused_as(config, dir, &[])
}

fn run_refused_as(config: &TestConfig, dir: &Path, launcher: &[&str]) -> (i32, String) {
    let mut config = config.clone();
    config.listen = format!("127.0.0.1:{}", support::free_port());
    config.admin_listen = format!("127.0.0.1:{}", support::free_port());
    let path = dir.join("second.toml");
    std::fs::write(&path, config.toml()).expect("write the config");
    let mut child = support::proxy::binary_command(launcher)
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the binary");
    let started = tokio::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr).expect("read");
            return (status.code().unwrap_or(-1), stderr);
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("the binary started where it must refuse");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sha256_of(path: &Path) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, &std::fs::read(path).expect("read"))
        .as_ref()
        .to_vec()
}

/// A file that is not the store's keeps the proxy from starting, with an error that
/// names the file and what is wrong, and the file is left as it was: not a database,
/// and (run as an unprivileged user, as the image runs) a file it may not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_the_store_cannot_use_keeps_the_proxy_from_starting() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let upstream = Upstream::start().await;
    let garbage = dir.path().join("garbage.db");
    std::fs::write(&garbage, b"these are the notes of another program, not a database\n").expect("write");
    let before = sha256_of(&garbage);
    let (code, stderr) = run_refused(&sqlite_config(&garbage, &upstream), dir.path());
    assert_ne!(code, 0);
    assert!(
        stderr.contains(&format!(
            "{}: is not a SQLite database; left as it is",
            garbage.display()
        )),
        "{stderr}"
    );
    assert_eq!(sha256_of(&garbage), before);

    // The image's user (65532), in a directory of its own, on its file made unreadable.
    use std::os::unix::fs::PermissionsExt;
    let shared = tempfile::tempdir().expect("temporary directory");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let locked = shared.path().join("records.db");
    {
        let config = sqlite_config(&locked, &upstream);
        let proxy = ChildProxy::start(&config).await;
        assert_eq!(pay(&proxy, "before-locking", "{}").await.status, 201);
    }
    for name in ["", "records.db", "records.db-wal", "records.db-shm", "records.db.lock"] {
        let path = shared.path().join(name);
        if path.exists() {
            std::os::unix::fs::chown(&path, Some(65532), Some(65532)).expect("chown");
        }
    }
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).expect("chmod");
    let before = sha256_of(&locked);
    let (code, stderr) = run_refused_as(
        &sqlite_config(&locked, &upstream),
        shared.path(),
        &["setpriv", "--reuid=65532", "--regid=65532", "--clear-groups"],
    );
    assert_ne!(code, 0);
    assert!(
        stderr.contains(&format!(
            "{}: cannot open the store file: Permission denied",
            locked.display()
        )),
        "{stderr}"
    );
    assert_eq!(sha256_of(&locked), before);
}

/// A full disk: new keys get 503 `store-unavailable` and nothing is forwarded,
/// recorded keys still replay, `/readyz` says the store is unavailable; once there is
/// room again the proxy takes claims and is ready, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_answers_503_replays_recorded_keys_and_recovers_by_itself() {
    let disk = SmallDisk::mount(8 << 20);
    let upstream = Upstream::start().await;
    let proxy = ChildProxy::start(&sqlite_config(&disk.path().join("records.db"), &upstream)).await;
    let kept = pay(&proxy, "kept", "{}").await;
    assert_eq!(kept.status, 201);
    disk.fill();
    let mut refused = 0;
    for n in 0..20 {
        let key = format!("full-{n}");
        let response = pay(&proxy, &key, "{}").await;
        if response.status == 503 {
            assert_eq!(response.problem(), "store-unavailable");
            assert_eq!(upstream.executions(&key), 0, "forwarded without a claim on disk");
            refused += 1;
        }
    }
    assert!(refused >= 19, "only {refused} of 20 claims refused on a full disk");
    let replay = pay(&proxy, "kept", "{}").await;
    assert!(replay.replayed() && replay.body == kept.body, "{replay:?}");
    let ready = send(proxy.admin, "GET", "/readyz", &[], "").await;
    assert_eq!(ready.status, 503, "ready on a full disk");
    disk.free();
    let ready = send(proxy.admin, "GET", "/readyz", &[], "").await;
    assert_eq!(ready.status, 200, "not ready once there is room");
    assert_eq!(pay(&proxy, "after", "{}").await.status, 201);
    assert_eq!(upstream.executions("after"), 1);
}

/// The probe a fresh start schedules: a request held at the upstream (which applies it)
/// when the proxy is SIGKILLed. Started again, with no client retrying, the proxy
/// probes the record once its lease is over and records what the upstream says it
/// did (the lookup's answer, naming the execution); the retry that comes later is a
/// reconciled replay of it, and the operation ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_start_probes_the_records_its_last_run_left_in_flight() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let upstream = Upstream::start().await;
    let mut config = sqlite_config(&dir.path().join("records.db"), &upstream);
    config.upstream_timeout = "1s".into();
    config.idempotency = "[route.idempotency.reconcile]\npath = \"/v1/payments/by-key/{key}\"\n\
                          first_after = \"100ms\"\nevery = \"200ms\"\ngive_up_after = \"1m\""
        .into();
    let mut proxy = ChildProxy::start(&config).await;
    let addr = proxy.addr;
    let sent = Instant::now();
    let held = tokio::spawn(async move {
        try_send(
            addr,
            "POST",
            "/v1/payments",
            &[
                ("idempotency-key", "swept-1"),
                ("content-type", "application/json"),
                ("x-test-hold", "swept"),
            ],
            "{}",
        )
        .await
    });
    upstream.wait_for_key("swept-1").await;
    proxy.kill();
    let _ = held.await;
    upstream.release("swept");
    let proxy = ChildProxy::start(&config).await;
    upstream.wait_for_lookups(1).await;
    let lookup = &upstream.lookups()[0];
    assert_eq!(lookup.path, "/v1/payments/by-key/swept-1");
    // The lease: the upstream timeout (1 s) and a second's grace, from the claim.
    assert!(
        lookup.at.duration_since(sent) >= Duration::from_millis(1900),
        "probed {:?} after the claim, before the dead request's lease was over",
        lookup.at.duration_since(sent)
    );
    support::client::until_metric(
        proxy.admin,
        "idemproxy_reconciliations_total{route=\"payments\",result=\"applied\"}",
        1.0,
    )
    .await;
    // The lookup's answer is what the record holds now: the execution it found.
    let retry = pay(&proxy, "swept-1", "{}").await;
    assert_eq!(retry.status, 200, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.execution(), 1);
    assert_eq!(retry.header("idempotency-reconciled"), Some("true"));
    assert_eq!(upstream.executions("swept-1"), 1);
}

/// What the store's file holds, as the history checker reads a store: each record's
/// key and the milliseconds it has left.
fn sqlite_ttls(file: &Path) -> Vec<(String, i64)> {
    let conn = rusqlite::Connection::open_with_flags(file, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let mut statement = conn.prepare("SELECT key, expires_at FROM records").expect("query");
    statement
        .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)? - now)))
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("rows")
}

/// A storm of 1,000 keys, each sent three times in each of four rounds, with the proxy
/// SIGKILLed at a random moment of every round and started again on the same file,
/// then every key retried until it settles: through the history checker, no key runs
/// twice, no retry gets another key's answer, and every record keeps its retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_across_sigkills_runs_each_key_at_most_once() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let upstream = Upstream::start().await;
    let file = dir.path().join("records.db");
    let mut config = sqlite_config(&file, &upstream);
    config.idempotency = "scope_headers = [\"authorization\"]".into();
    config.upstream_timeout = "2s".into();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64;
    println!("storm seed {seed}");
    let history = Arc::new(support::history::History::default());
    let started = Instant::now();
    let mut last = None;
    for round in 0..4u64 {
        let mut proxy = ChildProxy::start(&config).await;
        let storm = Storm {
            name: "durable",
            targets: vec![proxy.addr],
            logical: 1000,
            duplicates: 3,
            concurrency: 64,
            jitter_ms: 20,
            streamed: false,
        };
        let total = storm.total();
        let run = StormRun {
            history: history.clone(),
            progress: Arc::new(AtomicUsize::new(0)),
            started,
        };
        let kill_at = total / 10 + (splitmix(seed ^ round) as usize) % (total * 8 / 10);
        let progress = run.progress.clone();
        let storming = tokio::spawn(async move {
            storm.run(&run).await;
            (storm, run)
        });
        let watch = StormRun {
            history: history.clone(),
            progress,
            started,
        };
        until_progress(&watch, kill_at).await;
        proxy.kill();
        println!("round {round}: killed after {kill_at} of {total} operations");
        last = Some(storming.await.expect("storm"));
    }
    let proxy = ChildProxy::start(&config).await;
    let (storm, run) = last.expect("four rounds");
    let storm = Storm {
        targets: vec![proxy.addr],
        ..storm
    };
    let liveness = storm.settle(&run).await;
    let report = storm.check(&run, &upstream.log(), &sqlite_ttls(&file), RETENTION, vec![]);
    report.assert_clean("storm across four SIGKILLs, 1000 keys x 3 x 4");
    // A key whose request was forwarded when its proxy was killed stays unknown (the
    // route has no probe): at most the 64 in flight of each of the four rounds.
    liveness.assert_live("storm across four SIGKILLs", 0.7);
    assert_eq!(report.max_executions_per_key, 1);
    let records = metric(proxy.admin, "idemproxy_store_records{backend=\"sqlite\"}").await;
    assert_eq!(records, Some(1000.0), "one record per key");
}
