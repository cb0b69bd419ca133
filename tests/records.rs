//! The records API and `idemproxy records` (docs/design.md §8): an operator shows, purges and
//! releases records through the admin listener, against the memory store and a real
//! `redis-server`, with the token rules, and the CLI's output and exit codes.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;

use serde_json::Value;
use support::{ChildProxy, Mode, RedisServer, Relay, StoreKind, TestConfig, TestResponse, Upstream, send};

const TOKEN: &str = "s3cret-admin-token-for-tests";
/// The route's scope: records are per `Authorization`.
const ALICE: (&str, &str) = ("authorization", "Bearer alice");

/// A config whose admin listener has the records API on, and whose payments route is
/// scoped by `Authorization` with a 500 ms upstream timeout. The token file lives as
/// long as the returned directory.
fn config(store: StoreKind, upstream: &Upstream) -> (TestConfig, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    let mut config = TestConfig::new(store, &upstream.url());
    config.admin_extra = format!("token_file = {:?}", token_file.display().to_string());
    config.idempotency = "scope_headers = [\"authorization\"]".into();
    config.upstream_timeout = "500ms".into();
    (config, dir)
}

async fn admin(admin: SocketAddr, method: &str, path: &str, token: Option<&str>) -> TestResponse {
    let bearer = token.map(|token| format!("Bearer {token}"));
    let headers: Vec<(&str, &str)> = bearer.iter().map(|bearer| ("authorization", bearer.as_str())).collect();
    send(admin, method, path, &headers, "").await
}

fn json(response: &TestResponse) -> Value {
    serde_json::from_slice(&response.body).unwrap_or_else(|_| panic!("not JSON: {response:?}"))
}

async fn post(addr: SocketAddr, key: &str, extra: &[(&str, &str)]) -> TestResponse {
    let mut headers = vec![("idempotency-key", key), ALICE];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/v1/payments", &headers, "{\"amount\":1}").await
}

#[tokio::test]
async fn the_records_api_is_off_without_a_token_and_refuses_a_wrong_one() {
    let upstream = Upstream::start().await;
    let off = TestConfig::new(StoreKind::Memory, &upstream.url()).start().await;
    let answer = admin(off.admin(), "GET", "/records/payments?key=k", Some(TOKEN)).await;
    assert_eq!(answer.status, 404, "no token_file, no records API: {answer:?}");

    let (config, _dir) = config(StoreKind::Memory, &upstream);
    let proxy = config.start().await;
    let at = proxy.admin();
    let missing = admin(at, "GET", "/records/payments?key=k", None).await;
    assert_eq!(missing.status, 401);
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    assert_eq!(
        admin(at, "GET", "/records/payments?key=k", Some("wrong-token-of-some-length"))
            .await
            .status,
        401
    );
    let prefix = &TOKEN[..TOKEN.len() - 1];
    assert_eq!(
        admin(at, "GET", "/records/payments?key=k", Some(prefix)).await.status,
        401
    );

    for (method, path, status, error) in [
        (
            "GET",
            "/records/payments?key=k&scope=authorization:Bearer%20alice",
            404,
            "no record for this key",
        ),
        ("GET", "/records/nope?key=k", 404, "no such route"),
        ("GET", "/records/reads?key=k", 404, "the route guards nothing"),
        ("GET", "/records/payments", 400, "key is required"),
        ("GET", "/records/payments?key=", 400, "key:"),
        ("GET", "/records/payments?key=a&key=b", 400, "key is given twice"),
        (
            "GET",
            "/records/payments?key=k&scope=authorization:Bearer%20alice&scope=authorization:Bearer%20bob",
            400,
            "scope authorization is given twice",
        ),
        (
            "GET",
            "/records/payments?key=k&scope=cookie:x",
            400,
            "the route's scope names are authorization",
        ),
        (
            "GET",
            "/records/payments?key=k&scope=nocolon",
            400,
            "scope must be NAME:VALUE",
        ),
        ("GET", "/records/payments?key=k&limit=1", 400, "unknown parameter"),
        ("PUT", "/records/payments?key=k", 405, "use GET to show"),
        ("GET", "/records/payments/release?key=k", 405, "use POST to release"),
    ] {
        let answer = admin(at, method, path, Some(TOKEN)).await;
        assert_eq!(answer.status, status, "{method} {path}: {answer:?}");
        let body = json(&answer);
        assert!(
            body["error"].as_str().is_some_and(|text| text.contains(error)),
            "{method} {path}: {body}"
        );
    }
}

/// The token's scheme is case-insensitive (RFC 9110 §11.1), as `scope_jwt` reads it.
#[tokio::test]
async fn the_admin_token_is_taken_whatever_the_case_of_its_scheme() {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Memory, &upstream);
    let proxy = config.start().await;
    for scheme in ["bearer", "BEARER", "bEaReR", "Bearer"] {
        let value = format!("{scheme} {TOKEN}");
        let answer = send(
            proxy.admin(),
            "GET",
            "/records/payments?key=k",
            &[("authorization", &value)],
            "",
        )
        .await;
        assert_eq!(
            answer.status, 404,
            "{scheme}: the token is accepted, no such record: {answer:?}"
        );
    }
    let basic = send(
        proxy.admin(),
        "GET",
        "/records/payments?key=k",
        &[("authorization", &format!("Basic {TOKEN}"))],
        "",
    )
    .await;
    assert_eq!(basic.status, 401);
}

/// Show, purge and release on a completed, an in-flight and an unknown record.
async fn each_state(store: StoreKind) {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(store, &upstream);
    let proxy = config.start().await;
    let (addr, at) = (proxy.addr(), proxy.admin());
    let path =
        |key: &str, action: &str| format!("/records/payments{action}?key={key}&scope=authorization:Bearer%20alice");

    // Completed: shown without its body; the scope is part of its name.
    let first = post(addr, "done", &[]).await;
    assert_eq!(first.status, 201);
    let shown = admin(at, "GET", &path("done", ""), Some(TOKEN)).await;
    assert_eq!(shown.status, 200, "{shown:?}");
    let body = json(&shown);
    assert_eq!(body["state"], "completed", "{body}");
    assert_eq!(body["status"], 201);
    assert_eq!(body["response_bytes"], first.body.len() as u64);
    assert_eq!(body["route"], "payments");
    assert_eq!(body["record"].as_str().map(str::len), Some(12));
    assert_eq!(body["fingerprint"].as_str().map(str::len), Some(64));
    let ttl = body["ttl_ms"].as_u64().expect("ttl_ms");
    assert!((3_590_000..=3_600_000).contains(&ttl), "{ttl}");
    assert!(
        body["lease_remaining_ms"].is_null() && body["reason"].is_null(),
        "{body}"
    );
    assert!(
        !String::from_utf8_lossy(&shown.body).contains("execution"),
        "the body is never shown"
    );
    let unscoped = admin(at, "GET", "/records/payments?key=done", Some(TOKEN)).await;
    assert_eq!(unscoped.status, 404, "another scope names another record");
    // Release refuses a completed record and changes nothing.
    assert_eq!(
        admin(at, "POST", &path("done", "/release"), Some(TOKEN)).await.status,
        409
    );
    assert!(post(addr, "done", &[]).await.replayed());
    // Purge removes it: the next request runs again.
    assert_eq!(admin(at, "DELETE", &path("done", ""), Some(TOKEN)).await.status, 204);
    assert_eq!(admin(at, "DELETE", &path("done", ""), Some(TOKEN)).await.status, 404);
    let again = post(addr, "done", &[]).await;
    assert_eq!((again.status.as_u16(), again.replayed()), (201, false));
    assert_eq!(upstream.executions("done"), 2);

    // In flight: the lease is shown; release refuses it.
    let held = tokio::spawn(async move { post(addr, "held", &[("x-test-hold", "held")]).await });
    upstream.wait_for_key("held").await;
    let body = json(&admin(at, "GET", &path("held", ""), Some(TOKEN)).await);
    assert_eq!(body["state"], "in_flight", "{body}");
    let lease = body["lease_remaining_ms"].as_u64().expect("lease_remaining_ms");
    assert!((1..=1_500).contains(&lease), "{lease}");
    assert_eq!(
        admin(at, "POST", &path("held", "/release"), Some(TOKEN)).await.status,
        409
    );
    upstream.release("held");
    assert_eq!(held.await.expect("held request").status, 201);

    // Unknown (the upstream timed out): the reason is shown; release frees the key, and
    // the retry runs.
    let timed_out = post(addr, "slow", &[("x-test-hold", "slow")]).await;
    assert_eq!(timed_out.status, 504);
    let body = json(&admin(at, "GET", &path("slow", ""), Some(TOKEN)).await);
    assert_eq!(
        (body["state"].as_str(), body["reason"].as_str()),
        (Some("unknown"), Some("upstream-timeout")),
        "{body}"
    );
    assert_eq!(post(addr, "slow", &[]).await.problem(), "outcome-unknown");
    let released = admin(at, "POST", &path("slow", "/release"), Some(TOKEN)).await;
    assert_eq!(released.status, 200, "{released:?}");
    assert_eq!(json(&released)["released"], true);
    let retry = post(addr, "slow", &[]).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false));
    assert_eq!(upstream.executions("slow"), 2);
    upstream.release("slow");
    assert_eq!(
        admin(at, "POST", &path("absent", "/release"), Some(TOKEN)).await.status,
        404
    );
}

#[tokio::test]
async fn show_purge_and_release_on_each_state_with_the_memory_store() {
    each_state(StoreKind::Memory).await;
}

/// The SQLite store on a file in a directory of its own, kept while the test runs.
fn sqlite() -> (StoreKind, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    (StoreKind::Sqlite(dir.path().join("records.db")), dir)
}

#[tokio::test]
async fn show_purge_and_release_on_each_state_with_the_sqlite_store() {
    let (store, _dir) = sqlite();
    each_state(store).await;
}

#[tokio::test]
async fn show_purge_and_release_on_each_state_with_redis() {
    let redis = RedisServer::start();
    each_state(StoreKind::Redis(redis.url())).await;
}

/// Runs `idemproxy records ...` against `config_path`; returns its exit code, stdout
/// and stderr.
fn cli(config_path: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("records")
        .args(args)
        .arg("--config")
        .arg(config_path)
        .output()
        .expect("run idemproxy records");
    (
        output.status.code().expect("an exit code"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The CLI reads the admin address and token from the same config the proxy runs with.
/// Every call is logged with the route and record hash, never the key.
#[tokio::test]
async fn the_cli_shows_purges_and_releases_with_exit_codes_scripts_can_use() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let (config, dir) = config(StoreKind::Redis(redis.url()), &upstream);
    let log = dir.path().join("proxy.log");
    let proxy = ChildProxy::start_via(&config, &[], Some(&log)).await;
    let file = proxy.config_path();
    let key = "cli-key-7f3a";
    let scope = ["--scope", "authorization:Bearer alice"];
    let target = |action: &'static str| -> Vec<&str> {
        let mut args = vec![action, "--route", "payments", "--key", key];
        args.extend_from_slice(&scope);
        args
    };

    let (code, _, stderr) = cli(file, &target("show"));
    assert_eq!(code, 3, "no record yet: {stderr}");
    assert!(stderr.contains("no record for this key"), "{stderr}");

    assert_eq!(post(proxy.addr, key, &[]).await.status, 201);
    let (code, stdout, stderr) = cli(file, &target("show"));
    assert_eq!(code, 0, "{stderr}");
    for line in [
        "route        payments",
        "state        completed",
        "status       201",
        "expires in   59m",
    ] {
        assert!(stdout.contains(line), "{line:?} not in:\n{stdout}");
    }
    let mut json_args = target("show");
    json_args.push("--json");
    let (code, stdout, _) = cli(file, &json_args);
    assert_eq!(code, 0);
    let body: Value = serde_json::from_str(&stdout).expect("--json prints JSON");
    assert_eq!(body["state"], "completed");

    let (code, _, stderr) = cli(file, &target("release"));
    assert_eq!(code, 4, "a completed record is not released: {stderr}");
    assert!(stderr.contains("is not unknown"), "{stderr}");
    let (code, stdout, _) = cli(file, &target("purge"));
    assert_eq!(
        (code, stdout.trim()),
        (0, "purged: the next request with this key runs")
    );
    assert_eq!(cli(file, &target("show")).0, 3);

    // A config whose token is not the proxy's: 401, exit 1.
    let wrong_token = dir.path().join("wrong-token");
    std::fs::write(&wrong_token, "another-token-entirely").expect("write");
    let text = std::fs::read_to_string(file).expect("read the config");
    let token_line = text
        .lines()
        .find(|line| line.starts_with("token_file"))
        .expect("token_file line");
    let wrong = dir.path().join("wrong.toml");
    std::fs::write(
        &wrong,
        text.replace(
            token_line,
            &format!("token_file = {:?}", wrong_token.display().to_string()),
        ),
    )
    .expect("write");
    let (code, _, stderr) = cli(&wrong, &target("show"));
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("401"), "{stderr}");

    drop(proxy);
    let text = std::fs::read_to_string(&log).expect("read the log");
    let calls: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("records API route="))
        .collect();
    let actions: Vec<&str> = calls
        .iter()
        .filter_map(|line| line.split("action=").nth(1)?.split_whitespace().next())
        .collect();
    assert_eq!(
        actions,
        [
            "\"show\"",
            "\"show\"",
            "\"show\"",
            "\"release\"",
            "\"purge\"",
            "\"show\""
        ],
        "{text}"
    );
    assert!(
        calls
            .iter()
            .all(|line| line.contains("route=payments") && line.contains("record=")),
        "{text}"
    );
    assert!(
        text.lines().any(|line| line.contains("missing or wrong token")),
        "{text}"
    );
    assert!(!text.contains(key), "the raw key reached the log:\n{text}");
}

/// An admin call with a body.
async fn admin_with(admin: SocketAddr, path: &str, body: &str) -> TestResponse {
    let bearer = format!("Bearer {TOKEN}");
    send(
        admin,
        "POST",
        path,
        &[("authorization", &bearer), ("content-type", "application/json")],
        body,
    )
    .await
}

/// Resolve on both stores: an unknown record resolved as applied replays the
/// recorded response, marked reconciled, and the upstream ran once; a second
/// resolution is refused (only one ever wins); one resolved as not applied runs again;
/// a completed or in-flight record, a bad verdict or a bad response is refused.
async fn resolutions(store: StoreKind) {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(store, &upstream);
    let proxy = config.start().await;
    let (addr, at) = (proxy.addr(), proxy.admin());
    let path = |key: &str, verdict: &str| {
        format!("/records/payments/resolve?key={key}&scope=authorization:Bearer%20alice&as={verdict}")
    };
    let recorded = r#"{"status":201,"headers":[["content-type","application/json"],["x-charge","ch_9"]],"body":"eyJwYWlkIjp0cnVlfQ=="}"#;

    let first = post(addr, "applied", &[("x-test-hold", "applied")]).await;
    assert_eq!(first.status, 504, "{first:?}");
    upstream.release("applied");
    let resolved = admin_with(at, &path("applied", "applied"), recorded).await;
    assert_eq!(resolved.status, 200, "{resolved:?}");
    let body = json(&resolved);
    assert_eq!(body["resolved"], "applied", "{body}");
    assert_eq!(body["operation"].as_str().map(str::len), Some(32), "{body}");
    let replay = post(addr, "applied", &[]).await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"), "{replay:?}");
    assert_eq!(replay.header("x-charge"), Some("ch_9"));
    assert_eq!(&replay.body[..], b"{\"paid\":true}");
    assert_eq!(upstream.executions("applied"), 1, "the upstream ran it again");
    // Already resolved: neither verdict wins a second time.
    assert_eq!(admin_with(at, &path("applied", "applied"), recorded).await.status, 409);
    assert_eq!(admin_with(at, &path("applied", "not-applied"), "").await.status, 409);

    let first = post(addr, "not-applied", &[("x-test-hold", "not-applied")]).await;
    assert_eq!(first.status, 504);
    upstream.release("not-applied");
    let resolved = admin_with(at, &path("not-applied", "not-applied"), "").await;
    assert_eq!(
        (resolved.status.as_u16(), json(&resolved)["resolved"].as_str()),
        (200, Some("not-applied"))
    );
    let retry = post(addr, "not-applied", &[]).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false));
    assert_eq!(upstream.executions("not-applied"), 2);

    // Refusals, each with its reason.
    assert_eq!(admin_with(at, &path("never", "applied"), recorded).await.status, 404);
    for (path, body, why) in [
        (path("x", "maybe"), "", "as must be applied or not-applied"),
        (
            "/records/payments/resolve?key=x&scope=authorization:Bearer%20alice".to_string(),
            "",
            "resolve needs as=applied",
        ),
        (path("x", "applied"), "{\"status\":99}", "a final status"),
        (path("x", "applied"), "{\"status\":201,\"body\":\"%%%\"}", "not base64"),
        (
            path("x", "applied"),
            "{\"status\":201,\"headers\":[[\"content-length\",\"3\"]]}",
            "set by the proxy",
        ),
        (path("x", "not-applied"), "{}", "takes no body"),
    ] {
        let refused = admin_with(at, &path, body).await;
        assert_eq!(refused.status, 400, "{path} {body}: {refused:?}");
        let error = json(&refused)["error"].as_str().unwrap_or_default().to_string();
        assert!(error.contains(why), "{path} {body}: {error}");
    }
}

#[tokio::test]
async fn resolve_settles_an_unknown_record_once_with_the_memory_store() {
    resolutions(StoreKind::Memory).await;
}

#[tokio::test]
async fn resolve_settles_an_unknown_record_once_with_the_sqlite_store() {
    let (store, _dir) = sqlite();
    resolutions(store).await;
}

#[tokio::test]
async fn resolve_settles_an_unknown_record_once_with_redis() {
    let redis = RedisServer::start();
    resolutions(StoreKind::Redis(redis.url())).await;
}

/// `claim=` fences a release or a resolution on the request it names: with another
/// request's claim each is 409 and changes nothing; with the record's own (as `show`
/// gives it) it wins. Through the API.
async fn claim_fences(store: StoreKind) {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(store, &upstream);
    let proxy = config.start().await;
    let (addr, at) = (proxy.addr(), proxy.admin());
    let scope = "scope=authorization:Bearer%20alice";
    assert_eq!(post(addr, "fenced", &[("x-test-hold", "fenced")]).await.status, 504);
    upstream.release("fenced");
    let shown = json(&admin(at, "GET", &format!("/records/payments?key=fenced&{scope}"), Some(TOKEN)).await);
    let own = shown["claim"]
        .as_str()
        .unwrap_or_else(|| panic!("an unknown record shows its claim: {shown}"))
        .to_string();
    let other = "0123456789abcdef0123456789abcdef";
    assert_ne!(own, other);
    let recorded = r#"{"status":201,"headers":[],"body":""}"#;
    for (path, body) in [
        (
            format!("/records/payments/release?key=fenced&{scope}&claim={other}"),
            "",
        ),
        (
            format!("/records/payments/resolve?key=fenced&{scope}&as=not-applied&claim={other}"),
            "",
        ),
        (
            format!("/records/payments/resolve?key=fenced&{scope}&as=applied&claim={other}"),
            recorded,
        ),
    ] {
        let refused = admin_with(at, &path, body).await;
        assert_eq!(refused.status, 409, "{path}: {refused:?}");
        let error = json(&refused)["error"].as_str().unwrap_or_default().to_string();
        assert!(
            error.contains("another request than the claim named"),
            "{path}: {error}"
        );
    }
    let after = json(&admin(at, "GET", &format!("/records/payments?key=fenced&{scope}"), Some(TOKEN)).await);
    assert_eq!(
        (after["state"].as_str(), after["claim"].as_str()),
        (Some("unknown"), Some(own.as_str())),
        "{after}"
    );
    assert_eq!(post(addr, "fenced", &[]).await.problem(), "outcome-unknown");
    let released = admin_with(
        at,
        &format!("/records/payments/release?key=fenced&{scope}&claim={own}"),
        "",
    )
    .await;
    assert_eq!(released.status, 200, "{released:?}");
    let retry = post(addr, "fenced", &[]).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false));
    assert_eq!(upstream.executions("fenced"), 2);
}

#[tokio::test]
async fn a_release_or_resolution_fenced_on_another_claim_is_refused_with_the_memory_store() {
    claim_fences(StoreKind::Memory).await;
}

#[tokio::test]
async fn a_release_or_resolution_fenced_on_another_claim_is_refused_with_the_sqlite_store() {
    let (store, _dir) = sqlite();
    claim_fences(store).await;
}

#[tokio::test]
async fn a_release_or_resolution_fenced_on_another_claim_is_refused_with_redis() {
    let redis = RedisServer::start();
    claim_fences(StoreKind::Redis(redis.url())).await;
}

/// `--claim` on the CLI fences as `claim=` does: another request's claim exits 4 and
/// changes nothing, on release and on resolve; the record's own wins.
#[tokio::test]
async fn the_cli_fences_release_and_resolve_on_the_claim_named() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Redis(redis.url()), &upstream);
    let proxy = ChildProxy::start_via(&config, &[], None).await;
    let file = proxy.config_path();
    let args = |action: &'static str, rest: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = [action, "--route", "payments", "--key", "cli-fence", "--scope"]
            .iter()
            .map(ToString::to_string)
            .collect();
        args.push("authorization:Bearer alice".into());
        args.extend(rest.iter().map(ToString::to_string));
        args
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cli(file, &args)
    };
    assert_eq!(
        post(proxy.addr, "cli-fence", &[("x-test-hold", "cli-fence")])
            .await
            .status,
        504
    );
    upstream.release("cli-fence");
    let (code, stdout, _) = run(args("show", &["--json"]));
    assert_eq!(code, 0);
    let shown: Value = serde_json::from_str(&stdout).expect("--json prints JSON");
    let own = shown["claim"].as_str().expect("the claim").to_string();
    let other = "fedcba9876543210fedcba9876543210";
    for refused in [
        args("release", &["--claim", other]),
        args("resolve", &["--not-applied", "--claim", other]),
    ] {
        let (code, _, stderr) = run(refused.clone());
        assert_eq!(code, 4, "{refused:?}: {stderr}");
        assert!(stderr.contains("another request than the claim named"), "{stderr}");
    }
    let (code, stdout, _) = run(args("show", &["--json"]));
    assert_eq!(code, 0);
    let still: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(
        (still["state"].as_str(), still["claim"].as_str()),
        (Some("unknown"), Some(own.as_str()))
    );
    let (code, stdout, stderr) = run(args("resolve", &["--not-applied", "--claim", &own]));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("resolved as not applied"), "{stdout}");
    assert!(!post(proxy.addr, "cli-fence", &[]).await.replayed());
    assert_eq!(upstream.executions("cli-fence"), 2);
}

/// A response an operator records is held to what the route records of an upstream's:
/// `Set-Cookie` (the route's `replay_exclude_headers`) and the proxy's own field are not
/// recorded, a 204 or 304 with a body is refused (a replay of it would be malformed),
/// and a body over `max_response_body_bytes` is refused.
#[tokio::test]
async fn an_operators_resolution_is_held_to_what_the_route_records() {
    let upstream = Upstream::start().await;
    let (mut config, _dir) = config(StoreKind::Memory, &upstream);
    config.idempotency = format!("{}\nmax_response_body_bytes = 1024", config.idempotency);
    let proxy = config.start().await;
    let (addr, at) = (proxy.addr(), proxy.admin());
    let unknown = |key: &'static str| async move {
        assert_eq!(post(addr, key, &[("x-test-hold", key)]).await.status, 504);
    };
    let path = |key: &str| format!("/records/payments/resolve?key={key}&scope=authorization:Bearer%20alice&as=applied");
    use base64::Engine as _;
    let encode = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);

    for (status, why) in [(204, "has no body"), (304, "has no body")] {
        let refused = admin_with(
            at,
            &path("x"),
            &format!("{{\"status\":{status},\"body\":\"{}\"}}", encode(b"hi")),
        )
        .await;
        assert_eq!(refused.status, 400, "{status}: {refused:?}");
        assert!(
            json(&refused)["error"].as_str().unwrap_or_default().contains(why),
            "{refused:?}"
        );
    }
    let large = encode(&[b'x'; 2048]);
    let refused = admin_with(at, &path("x"), &format!("{{\"status\":200,\"body\":\"{large}\"}}")).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    assert!(
        json(&refused)["error"]
            .as_str()
            .unwrap_or_default()
            .contains("max_response_body_bytes")
    );

    unknown("cookies").await;
    upstream.release("cookies");
    let recorded = format!(
        "{{\"status\":201,\"headers\":[[\"set-cookie\",\"session=stolen\"],[\"idemproxy-execution-trace\",\"forged\"],[\"x-charge\",\"ch_1\"]],\"body\":\"{}\"}}",
        encode(b"{}")
    );
    let resolved = admin_with(at, &path("cookies"), &recorded).await;
    assert_eq!(resolved.status, 200, "{resolved:?}");
    let replay = post(addr, "cookies", &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.header("x-charge"), Some("ch_1"));
    assert_eq!(
        replay.header("set-cookie"),
        None,
        "replay_exclude_headers holds for a resolution too"
    );
    assert_eq!(
        replay.header("idemproxy-execution-trace"),
        None,
        "the proxy's own field is never recorded"
    );
    // A 204 without a body is a resolution like another.
    unknown("empty").await;
    upstream.release("empty");
    assert_eq!(admin_with(at, &path("empty"), "{\"status\":204}").await.status, 200);
    assert_eq!(post(addr, "empty", &[]).await.status, 204);
}

/// The records API asks for its token before it reads a byte of the body: an
/// unauthenticated upload is refused at once, never held until its body times out.
#[tokio::test]
async fn the_records_api_refuses_a_missing_token_before_it_reads_the_body() {
    let upstream = Upstream::start().await;
    let (config, _dir) = config(StoreKind::Memory, &upstream);
    let proxy = config.start().await;
    let head = "POST /records/payments/resolve?key=k&as=applied HTTP/1.1\r\nhost: admin\r\n\
                content-type: application/json\r\ncontent-length: 1000000\r\n\r\n";
    // The body never comes; a listener that waited for it would answer only after its
    // body timeout (10 s), well past this read's 3 s.
    let answer = support::send_raw(proxy.admin(), head.as_bytes(), std::time::Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer:?}");
}

#[tokio::test]
async fn the_cli_resolves_as_applied_or_not_applied() {
    let upstream = Upstream::start().await;
    let (config, dir) = config(StoreKind::Memory, &upstream);
    let proxy = ChildProxy::start_via(&config, &[], None).await;
    let file = proxy.config_path();
    let args = |key: &'static str, rest: &[&'static str]| -> Vec<&'static str> {
        let mut args = vec![
            "resolve",
            "--route",
            "payments",
            "--key",
            key,
            "--scope",
            "authorization:Bearer alice",
        ];
        args.extend_from_slice(rest);
        args
    };
    let body_file = dir.path().join("body.json");
    std::fs::write(&body_file, "{\"paid\":true}").expect("write");
    let body_path: &'static str = Box::leak(body_file.display().to_string().into_boxed_str());

    assert_eq!(post(proxy.addr, "cli-a", &[("x-test-hold", "cli-a")]).await.status, 504);
    upstream.release("cli-a");
    let (code, stdout, stderr) = cli(
        file,
        &args(
            "cli-a",
            &[
                "--applied",
                "--status",
                "201",
                "--header",
                "content-type: application/json",
                "--body-file",
                body_path,
            ],
        ),
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("resolved as applied"), "{stdout}");
    let replay = post(proxy.addr, "cli-a", &[]).await;
    assert_eq!((replay.status.as_u16(), replay.replayed()), (201, true));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(&replay.body[..], b"{\"paid\":true}");
    let (code, _, stderr) = cli(file, &args("cli-a", &["--not-applied"]));
    assert_eq!(code, 4, "a resolved record is not unknown: {stderr}");

    assert_eq!(post(proxy.addr, "cli-b", &[("x-test-hold", "cli-b")]).await.status, 504);
    upstream.release("cli-b");
    let (code, stdout, stderr) = cli(file, &args("cli-b", &["--not-applied"]));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("resolved as not applied"), "{stdout}");
    assert!(
        !post(proxy.addr, "cli-b", &[]).await.replayed(),
        "the retry after not-applied must run"
    );
    assert_eq!(upstream.executions("cli-b"), 2);

    // Arguments that do not fit: exit 1 with a reason, nothing sent.
    let (code, _, stderr) = cli(file, &args("cli-c", &[]));
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("resolve needs --applied"), "{stderr}");
    let (code, _, stderr) = cli(file, &["show", "--route", "payments", "--key", "k", "--not-applied"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("are for resolve"), "{stderr}");
}

/// With the store gone (a relay that resets every connection to Redis), every records
/// call answers 503 and says the store failed, nothing else; once the store is back
/// the same calls answer as before.
#[tokio::test]
async fn each_records_call_answers_503_while_the_store_is_gone() {
    let redis = RedisServer::start();
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let upstream = Upstream::start().await;
    let (mut config, _dir) = config(StoreKind::Redis(relay.url("redis")), &upstream);
    config.store_timeout = "200ms".into();
    let proxy = config.start().await;
    let (addr, at) = (proxy.addr(), proxy.admin());
    assert_eq!(post(addr, "kept", &[]).await.status, 201);
    let query = "key=kept&scope=authorization:Bearer%20alice";
    let calls = [
        ("GET", format!("/records/payments?{query}")),
        ("DELETE", format!("/records/payments?{query}")),
        ("POST", format!("/records/payments/release?{query}")),
        ("POST", format!("/records/payments/resolve?{query}&as=not-applied")),
    ];
    relay.set(Mode::Reset);
    for (method, path) in &calls {
        let answer = admin(at, method, path, Some(TOKEN)).await;
        assert_eq!(answer.status, 503, "{method} {path}: {answer:?}");
        assert_eq!(json(&answer)["error"], "the store failed; try again", "{method} {path}");
    }
    relay.set(Mode::Pass);
    let shown = admin(at, "GET", &calls[0].1, Some(TOKEN)).await;
    assert_eq!(
        (shown.status.as_u16(), json(&shown)["state"].as_str()),
        (200, Some("completed"))
    );
    assert_eq!(admin(at, "DELETE", &calls[1].1, Some(TOKEN)).await.status, 204);
}
