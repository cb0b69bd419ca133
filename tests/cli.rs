//! The command line, run as the real binary: `check` and `serve` on good and bad
//! configs, and the promise that every config error names the file, line and field.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

fn idemproxy() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
}

/// Writes `text` to `name` in `dir`, a temporary directory removed when it drops.
fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("idemproxy-cli-")
        .tempdir()
        .expect("temp dir")
}

/// Runs `check` and returns (success, stdout, stderr).
fn check(path: &PathBuf) -> (bool, String, String) {
    check_with(path, &[])
}

/// `idemproxy check` with `args` before `--config`.
fn check_with(path: &PathBuf, args: &[&str]) -> (bool, String, String) {
    let output = idemproxy()
        .arg("check")
        .args(args)
        .arg("--config")
        .arg(path)
        .output()
        .expect("run idemproxy");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

const ROUTE: &str =
    "[[route]]\nname = \"payments\"\npath_prefix = \"/v1/payments\"\nupstream = \"http://127.0.0.1:9000\"\n";

#[test]
fn the_shipped_proxy_toml_checks_and_lists_its_routes() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proxy.toml");
    let (ok, stdout, stderr) = check(&path);
    assert!(ok, "check failed: {stderr}");
    assert!(
        stdout.contains("route  payments /v1/payments -> http://127.0.0.1:9000/"),
        "{stdout}"
    );
    let records = path.with_file_name("records.db");
    assert!(
        stdout.contains(&format!("store  sqlite {} (", records.display())),
        "the shipped config keeps its records beside it: {stdout}"
    );
    assert!(!stderr.contains("forgets every record"), "{stderr}");
}

/// What `check` warns about when a config leaves `[store]` out: the memory store.
const FORGETS: &str = "idemproxy: warning: store.backend = \"memory\" forgets every record when the process stops";

/// `stderr` without the memory store's warning, which every config here without a
/// `[store]` draws.
fn other_warnings(stderr: &str) -> String {
    stderr
        .lines()
        .filter(|line| !line.starts_with(FORGETS))
        .map(|line| format!("{line}\n"))
        .collect()
}

#[test]
fn config_errors_name_the_file_the_line_and_the_field() {
    let cases: &[(&str, String, &str, &str)] = &[
        (
            "unknown-key.toml",
            format!("[server]\nlisten = \"127.0.0.1:0\"\nlisen = 1\n{ROUTE}"),
            ":3: server.lisen:",
            "unknown field",
        ),
        (
            "no-routes.toml",
            "[server]\nlisten = \"127.0.0.1:0\"\n".into(),
            ":3: route:",
            "at least one [[route]]",
        ),
        (
            "dup.toml",
            format!("{ROUTE}{}", ROUTE.replace("/v1/payments", "/v2")),
            ":6: route[1].name:",
            "duplicate route name",
        ),
        (
            "scheme.toml",
            ROUTE.replace("http://", "ftp://"),
            ":4: route[0].upstream:",
            "http or https",
        ),
        (
            "retention.toml",
            format!("{ROUTE}upstream_timeout = \"30s\"\n[route.idempotency]\nretention = \"10s\"\n"),
            ":7: route[0].idempotency.retention:",
            "does not exceed the lease",
        ),
        (
            "enum.toml",
            format!("{ROUTE}[route.idempotency]\non_store_error = \"ignore\"\n"),
            ":6: route[0].idempotency.on_store_error:",
            "unknown variant",
        ),
        (
            "duration.toml",
            format!("[store]\ntimeout = \"soon\"\n{ROUTE}"),
            ":2: store.timeout:",
            "invalid duration",
        ),
        (
            "backend.toml",
            format!("[store]\nbackend = \"etcd\"\n{ROUTE}"),
            ":2: store.backend:",
            "unknown variant",
        ),
        (
            "redis-url.toml",
            format!("[store]\nbackend = \"redis\"\n{ROUTE}"),
            ":2: store.url:",
            "redis backend needs url",
        ),
        (
            "syntax.toml",
            format!("[server\n{ROUTE}"),
            ":1: server:",
            "unclosed table",
        ),
    ];
    let dir = temp_dir();
    for (name, text, location, reason) in cases {
        let path = write(&dir, name, text);
        let (ok, _, stderr) = check(&path);
        assert!(!ok, "{name} was accepted");
        let expected_location = format!("{}{location}", path.display());
        assert!(
            stderr.contains(&expected_location),
            "{name}: expected {expected_location:?} in {stderr:?}"
        );
        assert!(stderr.contains(reason), "{name}: expected {reason:?} in {stderr:?}");
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "{name}: one line expected, got {stderr:?}"
        );
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
}

#[test]
fn serve_with_a_bad_config_exits_non_zero_with_one_line() {
    let dir = temp_dir();
    let path = write(&dir, "serve-bad.toml", &ROUTE.replace("http://", "gopher://"));
    let output = idemproxy()
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .expect("run idemproxy");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("route[0].upstream"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

#[test]
fn a_missing_config_file_is_named() {
    let output = idemproxy()
        .args(["check", "--config", "/nonexistent/idemproxy.toml"])
        .output()
        .expect("run idemproxy");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nonexistent/idemproxy.toml: cannot read the config"),
        "{stderr}"
    );
}

#[test]
fn the_config_path_comes_from_the_environment() {
    let dir = temp_dir();
    let path = write(&dir, "env.toml", ROUTE);
    let output = idemproxy()
        .arg("check")
        .env("IDEMPROXY_CONFIG", &path)
        .output()
        .expect("run idemproxy");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("route  payments"));
}

#[test]
fn check_prints_the_redis_topology_and_its_durability() {
    let dir = temp_dir();
    for (store, expected) in [
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://10.0.0.1:26379\", \"redis://10.0.0.2:26379\"]\nmaster_name = \"orders\"\nmin_replica_acks = 1",
            "store  redis-sentinel (master \"orders\" via sentinels redis://10.0.0.1:26379, redis://10.0.0.2:26379); a claim waits for 1 replica acknowledgement(s) within 100ms",
        ),
        (
            "backend = \"redis-cluster\"\nurls = [\"redis://:secret@10.0.1.1:6379\"]",
            "store  redis-cluster (seed nodes redis://:***@10.0.1.1:6379); claims are not replica-acknowledged",
        ),
    ] {
        let path = write(&dir, "topology.toml", &format!("[store]\n{store}\n{ROUTE}"));
        let (ok, stdout, stderr) = check(&path);
        assert!(ok, "{stderr}");
        assert!(stdout.contains(expected), "{expected:?} not in {stdout:?}");
        assert!(!stdout.contains("secret"), "{stdout}");
    }
}

/// `check --rate` prints each guarded route's horizon at that rate of fresh keys, and
/// warns where the store's bounds cannot hold it; a rate it cannot read is refused.
#[test]
fn check_with_a_rate_prints_the_horizon_and_warns_when_the_store_cannot_hold_it() {
    let dir = temp_dir();
    let route = format!("{ROUTE}[route.idempotency]\nretention = \"1h\"\nremember = \"30d\"\n");
    let store = |max_bytes: &str| {
        let file = dir.path().join("records.db");
        format!(
            "[store]\nbackend = \"sqlite\"\npath = {:?}\nmax_bytes = \"{max_bytes}\"\nmax_records = 100000000\n{route}",
            file.display().to_string()
        )
    };
    let run = |path: &PathBuf, rate: &str| check_with(path, &["--rate", rate]);
    let small = write(&dir, "small.toml", &store("1GiB"));
    let (ok, stdout, stderr) = run(&small, "6000/min");
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("horizon payments at 100 fresh keys/s: 259.2 million records, about 154.0 GiB of sqlite store"),
        "{stdout}"
    );
    assert!(
        stderr.contains("more than store.max_records (100000000)")
            && stderr.contains("more than store.max_bytes (1.0 GiB)"),
        "{stderr}"
    );
    let large = write(&dir, "large.toml", &store("1TiB"));
    let (ok, _, stderr) = run(&large, "1/s");
    assert!(
        ok && !stderr.contains("horizons"),
        "a horizon the store holds warns of nothing: {stderr}"
    );
    let (ok, _, stderr) = run(&large, "ten/s");
    assert!(!ok && stderr.contains("--rate \"ten/s\""), "{stderr}");
}

#[test]
fn check_warns_about_guarded_routes_every_client_shares() {
    let dir = temp_dir();
    let unscoped = write(&dir, "unscoped.toml", &format!("{ROUTE}[route.idempotency]\n"));
    let (ok, _, stderr) = check(&unscoped);
    assert!(ok, "a warning is not an error: {stderr}");
    assert!(
        stderr.contains("warning: route payments: no scope_headers or scope_jwt: all clients share one key space"),
        "{stderr}"
    );
    let scoped = write(
        &dir,
        "scoped.toml",
        &format!("{ROUTE}[route.idempotency]\nscope_headers = [\"authorization\"]\n"),
    );
    let (ok, _, stderr) = check(&scoped);
    assert!(ok && other_warnings(&stderr).is_empty(), "{stderr}");
    let plain = write(&dir, "plain.toml", ROUTE);
    let (ok, _, stderr) = check(&plain);
    assert!(
        ok && other_warnings(&stderr).is_empty(),
        "an unguarded route shares nothing: {stderr}"
    );
    // Without [store], the memory store: check says that it forgets on restart.
    assert_eq!(
        stderr.lines().filter(|line| line.starts_with(FORGETS)).count(),
        1,
        "{stderr}"
    );
    let durable = write(
        &dir,
        "durable.toml",
        &format!("[store]\nbackend = \"sqlite\"\npath = \"records.db\"\n{ROUTE}"),
    );
    let (ok, _, stderr) = check(&durable);
    assert!(ok && stderr.is_empty(), "the SQLite store draws no warning: {stderr}");
}

#[test]
fn scope_jwt_keys_are_checked_and_named() {
    let dir = temp_dir();
    let jwt = |body: &str| format!("{ROUTE}[route.idempotency]\n[route.idempotency.scope_jwt]\n{body}\n");
    let secret = "0123456789abcdef0123456789abcdef";
    let with_env = write(
        &dir,
        "env.toml",
        &jwt("hs256_secret_env = \"IDEMPROXY_TEST_JWT_SECRET\""),
    );
    let output = idemproxy()
        .args(["check", "--config"])
        .arg(&with_env)
        .env("IDEMPROXY_TEST_JWT_SECRET", secret)
        .output()
        .expect("run idemproxy");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        stdout.contains(
            "scoped by the claim \"sub\" of the bearer token in authorization, verified with an HS256 secret"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains(secret));
    // Scoped routes draw no warning.
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(other_warnings(&stderr).is_empty(), "{stderr}");
    // A 1024-bit RSA key: ring would refuse every token signed with it.
    let modulus = base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, [0xc5u8; 128]);
    write(
        &dir,
        "weak.json",
        &format!(r#"{{"keys": [{{"kty": "RSA", "kid": "weak-1", "n": "{modulus}", "e": "AQAB"}}]}}"#),
    );
    for (name, body, env, needle) in [
        (
            "no-env.toml",
            "hs256_secret_env = \"IDEMPROXY_TEST_UNSET\"",
            None,
            ":7: route[0].idempotency.scope_jwt.hs256_secret_env: the environment variable IDEMPROXY_TEST_UNSET is not set",
        ),
        (
            "short.toml",
            "hs256_secret_env = \"IDEMPROXY_TEST_JWT_SECRET\"",
            Some("short"),
            ":7: route[0].idempotency.scope_jwt.hs256_secret_env: an HS256 secret must be at least 32 bytes",
        ),
        (
            "neither.toml",
            "claim = \"sub\"",
            None,
            ":7: route[0].idempotency.scope_jwt.jwks_file: scope_jwt needs jwks_file",
        ),
        (
            "both.toml",
            "jwks_file = \"jwks.json\"\nhs256_secret_env = \"X\"",
            None,
            ":7: route[0].idempotency.scope_jwt.jwks_file: give jwks_file or hs256_secret_env, not both",
        ),
        (
            "missing.toml",
            "jwks_file = \"nowhere.json\"",
            None,
            ":7: route[0].idempotency.scope_jwt.jwks_file: cannot read",
        ),
        (
            "weak-rsa.toml",
            "jwks_file = \"weak.json\"",
            None,
            ":7: route[0].idempotency.scope_jwt.jwks_file: the RSA key \"weak-1\" has a 1024-bit modulus; RS256 needs at least 2048 bits",
        ),
    ] {
        let path = write(&dir, name, &jwt(body));
        let mut command = idemproxy();
        command.args(["check", "--config"]).arg(&path);
        if let Some(value) = env {
            command.env("IDEMPROXY_TEST_JWT_SECRET", value);
        }
        let output = command.output().expect("run idemproxy");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{name} was accepted");
        assert!(stderr.contains(needle), "{name}: {needle:?} not in {stderr:?}");
    }
}

/// `[store.encryption]` (docs/design.md §20): `check` names the keys by their ids,
/// never by their bytes; an unset variable or a value that is not 32 bytes of base64
/// refuses the config naming the variable, never its value. The replay mode of each
/// route is printed, and the replay settings that do not fit together are refused.
#[test]
fn record_keys_and_replay_modes_are_checked_and_named() {
    use base64::Engine as _;
    let dir = temp_dir();
    let b64 = |byte: u8| base64::engine::general_purpose::STANDARD.encode([byte; 32]);
    let (current, old) = (b64(1), b64(2));
    let id = |byte: u8| idemproxy::config::RecordKey::from_bytes([byte; 32]).id().to_string();
    let encryption = "[store.encryption]\nkey_env = \"IDEMPROXY_TEST_RECORD_KEY\"\nprevious_keys_env = \"IDEMPROXY_TEST_RECORD_KEYS_OLD\"\n";
    let policy = "[route.idempotency]\nreplay = \"refetch\"\nrefetch = { path = \"/v1/payments/by-key/{key}\" }\n";
    let path = write(&dir, "sealed.toml", &format!("{encryption}{ROUTE}{policy}"));
    let run = |current: Option<&str>, old: Option<&str>| {
        let mut command = idemproxy();
        command.args(["check", "--config"]).arg(&path);
        command
            .env_remove("IDEMPROXY_TEST_RECORD_KEY")
            .env_remove("IDEMPROXY_TEST_RECORD_KEYS_OLD");
        if let Some(current) = current {
            command.env("IDEMPROXY_TEST_RECORD_KEY", current);
        }
        if let Some(old) = old {
            command.env("IDEMPROXY_TEST_RECORD_KEYS_OLD", old);
        }
        let output = command.output().expect("run idemproxy");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr),
        )
    };
    let (ok, out) = run(Some(&current), Some(&format!("{old}, {current}")));
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!(
            "sealed new records with key {} (from IDEMPROXY_TEST_RECORD_KEY); records under {} (from IDEMPROXY_TEST_RECORD_KEYS_OLD) still open",
            id(1),
            id(2)
        )),
        "{out}"
    );
    assert!(
        out.contains("no body recorded: retries answered by GET /v1/payments/by-key/{key} with their own headers"),
        "{out}"
    );
    assert!(!out.contains(&current) && !out.contains(&old), "a key printed: {out}");
    for (current, old, needle) in [
        (
            None,
            None,
            "store.encryption.key_env: the environment variable IDEMPROXY_TEST_RECORD_KEY is not set",
        ),
        (
            Some("c2hvcnQ="),
            None,
            "store.encryption.key_env: the environment variable IDEMPROXY_TEST_RECORD_KEY does not hold 32 bytes in base64",
        ),
        (
            Some(current.as_str()),
            None,
            "store.encryption.previous_keys_env: the environment variable IDEMPROXY_TEST_RECORD_KEYS_OLD is not set",
        ),
        (
            Some(current.as_str()),
            Some("not-a-key!"),
            "store.encryption.previous_keys_env: the environment variable IDEMPROXY_TEST_RECORD_KEYS_OLD does not hold 32 bytes in base64",
        ),
    ] {
        let (ok, out) = run(current, old);
        assert!(!ok && out.contains(needle), "{needle:?} not in {out}");
        assert!(
            !out.contains("c2hvcnQ=") && !out.contains("not-a-key!"),
            "a value printed: {out}"
        );
    }
    let plain = write(
        &dir,
        "plain.toml",
        &format!("{ROUTE}[route.idempotency]\nreplay = \"status\"\n"),
    );
    let (ok, stdout, stderr) = check(&plain);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("sealed no: recorded responses are kept in clear"),
        "{stdout}"
    );
    assert!(
        stdout.contains("replays the status and location with no body"),
        "{stdout}"
    );
    for (body, needle) in [
        (
            "replay = \"refetch\"\n",
            "route[0].idempotency.refetch: replay = \"refetch\" needs refetch",
        ),
        (
            "refetch = { path = \"/x/{key}\" }\n",
            "route[0].idempotency.refetch: only replay = \"refetch\" takes it",
        ),
        (
            "replay_headers = [\"location\"]\n",
            "route[0].idempotency.replay_headers: only replay = \"status\" or \"refetch\" takes it",
        ),
        (
            "replay = \"refetch\"\nrefetch = { method = \"POST\", path = \"/x/{key}\" }\n",
            "route[0].idempotency.refetch.method: \"POST\" is not GET or HEAD",
        ),
        (
            "replay = \"refetch\"\nupstream_key = \"none\"\nrefetch = { path = \"/x/{key}\" }\n",
            "route[0].idempotency.refetch.path: names {key}, but upstream_key = \"none\"",
        ),
        (
            "replay = \"sometimes\"\n",
            "route[0].idempotency.replay: unknown variant `sometimes`",
        ),
    ] {
        let bad = write(&dir, "bad.toml", &format!("{ROUTE}[route.idempotency]\n{body}"));
        let (ok, stdout, stderr) = check(&bad);
        assert!(!ok && stderr.contains(needle), "{needle:?} not in {stdout}{stderr}");
    }
}
