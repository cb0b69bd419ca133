use super::*;

const ROUTE: &str =
    "[[route]]\nname = \"payments\"\npath_prefix = \"/v1/payments\"\nupstream = \"http://127.0.0.1:9000\"\n";

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("t.toml"))
}

fn error(text: &str) -> String {
    parse(text).expect_err("should be refused").to_string()
}

#[test]
fn defaults_match_the_design() {
    let config = parse(&format!("{ROUTE}[route.idempotency]\n")).expect("valid");
    assert_eq!(config.server.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
    assert_eq!(config.server.max_request_body_bytes, 1024 * 1024);
    assert_eq!(config.server.header_read_timeout, Duration::from_secs(10));
    assert_eq!(config.server.shutdown_grace, Duration::from_secs(30));
    assert!(config.admin.is_none());
    assert!(matches!(
        config.store.backend,
        Backend::Memory(StoreLimits {
            max_records: DEFAULT_MAX_RECORDS,
            max_bytes: DEFAULT_MAX_BYTES,
            max_records_per_scope: 25_000,
            max_bytes_per_scope: 67_108_864,
            max_records_per_client: 50_000,
        })
    ));
    assert_eq!(config.store.key_prefix, "idemproxy");
    assert_eq!(config.store.timeout, Duration::from_millis(500));
    let route = &config.routes[0];
    assert_eq!(route.upstream_timeout, Duration::from_secs(30));
    assert_eq!(route.lease(), Duration::from_secs(31));
    let policy = route.idempotency.as_ref().expect("guarded");
    assert_eq!(policy.methods, vec![Method::POST, Method::PATCH]);
    assert_eq!(policy.header, "idempotency-key");
    assert!(policy.required);
    assert_eq!(policy.retention, Duration::from_secs(24 * 3600));
    assert_eq!(
        policy.fingerprint_headers,
        vec![HeaderName::from_static("content-type")]
    );
    assert!(policy.scope_headers.is_empty());
    assert_eq!(policy.max_response_body_bytes, 1024 * 1024);
    assert_eq!(policy.on_server_error, OnServerError::Release);
    assert_eq!(policy.on_store_error, OnStoreError::Reject);
}

#[test]
fn a_route_without_an_idempotency_table_is_plain() {
    let config = parse(ROUTE).expect("valid");
    assert!(config.routes[0].idempotency.is_none());
}

#[test]
fn the_redis_backend_needs_a_redis_url() {
    let ok = parse(&format!(
        "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379/0\"\n{ROUTE}"
    ))
    .expect("valid");
    assert!(matches!(ok.store.backend, Backend::Redis { .. }));
    assert!(
        error(&format!("[store]\nbackend = \"redis\"\nurl = \"http://x\"\n{ROUTE}")).contains("t.toml:3: store.url:")
    );
    assert!(
        error(&format!("[store]\nurl = \"redis://x\"\n{ROUTE}"))
            .contains("store.url: the memory backend has no such setting (redis and postgres use it)")
    );
    assert!(
        error(&format!(
            "[store]\nbackend = \"redis\"\nurl = \"redis://x\"\nmax_records = 5\n{ROUTE}"
        ))
        .contains("store.max_records")
    );
}

#[test]
fn bad_values_are_refused_with_their_field() {
    for (text, needle) in [
        (
            ROUTE.replace("payments\"\npath", "pay:ments\"\npath"),
            "route[0].name: must be",
        ),
        (
            ROUTE.replace("/v1/payments", "v1"),
            "route[0].path_prefix: must start with /",
        ),
        (
            ROUTE.replace("http://127.0.0.1:9000", "http://127.0.0.1:9000/?q=1"),
            "route[0].upstream: the URL must not have a query",
        ),
        (
            format!("{ROUTE}[route.idempotency]\nmethods = []\n"),
            "route[0].idempotency.methods",
        ),
        (
            format!("{ROUTE}[route.idempotency]\nmethods = [\"PO ST\"]\n"),
            "route[0].idempotency.methods",
        ),
        (
            format!("{ROUTE}[route.idempotency]\nheader = \"bad header\"\n"),
            "route[0].idempotency.header",
        ),
        (
            format!("{ROUTE}[route.idempotency]\nmax_response_body_bytes = 0\n"),
            "max_response_body_bytes: must be greater than 0",
        ),
        (
            format!("[server]\nmax_request_body_bytes = 0\n{ROUTE}"),
            "t.toml:2: server.max_request_body_bytes",
        ),
        (format!("[store]\nkey_prefix = \"a b\"\n{ROUTE}"), "store.key_prefix"),
        (
            format!("[store]\ntimeout = \"0s\"\n{ROUTE}"),
            "store.timeout: must be greater than 0",
        ),
        (
            format!("{ROUTE}{}", ROUTE.replace("name = \"payments\"", "name = \"other\"")),
            "another route already has path_prefix",
        ),
    ] {
        let message = error(&text);
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
}

#[test]
fn type_errors_name_the_field_through_nested_and_repeated_tables() {
    let second = ROUTE.replace("payments", "other").replace("/v1/other", "/v2");
    for (text, needle) in [
        (format!("[server]\nlisten = 1\n{ROUTE}"), "t.toml:2: server.listen:"),
        (
            ROUTE.replace("name = \"payments\"", "name = 1"),
            "t.toml:2: route[0].name:",
        ),
        (
            format!("{ROUTE}[route.idempotency]\nretention = 'x'\n"),
            "t.toml:6: route[0].idempotency.retention: invalid duration",
        ),
        (
            format!("{ROUTE}{}", second.replace("name = \"other\"", "name = 1")),
            "t.toml:6: route[1].name:",
        ),
        (
            format!("{ROUTE}[route.idempotency]\nscope_headers = 'authorization'\n"),
            "t.toml:6: route[0].idempotency.scope_headers:",
        ),
    ] {
        let message = error(&text);
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
}

#[test]
fn bounds_are_inclusive_where_the_design_says_so() {
    let name = |length: usize| ROUTE.replace("payments\"\npath", &format!("{}\"\npath", "n".repeat(length)));
    assert!(parse(&name(64)).is_ok(), "a 64-character route name is allowed");
    assert!(error(&name(65)).contains("route[0].name: must be 1 to 64"));
    for workers in [1, 1024] {
        let config = parse(&format!("[server]\nworkers = {workers}\n{ROUTE}")).expect("valid");
        assert_eq!(config.server.workers, workers);
    }
    for workers in [0, 1025] {
        let message = error(&format!("[server]\nworkers = {workers}\n{ROUTE}"));
        assert!(
            message.contains("t.toml:2: server.workers: must be between 1 and 1024"),
            "{message}"
        );
    }
    let one = parse(&format!("[store]\nmax_records = 1\n{ROUTE}")).expect("valid");
    assert!(matches!(
        one.store.backend,
        Backend::Memory(StoreLimits { max_records: 1, .. })
    ));
    assert!(
        error(&format!("[store]\nmax_records = 0\n{ROUTE}"))
            .contains("t.toml:2: store.max_records: must be greater than 0")
    );
    let bytes = parse(&format!("[store]\nmax_bytes = 1048576\n{ROUTE}")).expect("valid");
    assert!(matches!(
        bytes.store.backend,
        Backend::Memory(StoreLimits {
            max_bytes: 1_048_576,
            ..
        })
    ));
    let message = error(&format!("[store]\nmax_bytes = 1048575\n{ROUTE}"));
    assert!(
        message.contains("t.toml:2: store.max_bytes: must be at least 1048576 (1 MiB)"),
        "{message}"
    );
    let message = error(&format!(
        "[store]\nbackend = \"redis\"\nurl = \"redis://x\"\nmax_bytes = 5000000\n{ROUTE}"
    ));
    assert!(
        message.contains("store.max_bytes: the redis backend has no such setting (memory and sqlite use it); bound Redis with maxmemory"),
        "{message}"
    );
}

#[test]
fn the_byte_budget_bounds_the_bodies_and_a_count_bounds_the_rest() {
    let config = parse(&format!("{ROUTE}[route.idempotency]\n")).expect("valid");
    assert_eq!(config.server.max_guarded_requests, DEFAULT_MAX_GUARDED_REQUESTS);
    assert_eq!(config.server.max_guarded_requests, 16_384);
    assert_eq!(config.server.max_buffered_bytes, 256 * 1024 * 1024);
    assert!(
        config.to_string().contains(
            "max_buffered_bytes 268435456 = 256 MiB (request bodies at most 192 MiB of it), max_guarded_requests 16384, \
             max_request_body_bytes 1048576 = 1 MiB"
        ),
        "{config}"
    );
    let config = parse(&format!(
        "[server]\nmax_guarded_requests = 10\nmax_buffered_bytes = 4000\nmax_request_body_bytes = 3000\n{ROUTE}[route.idempotency]\nmax_response_body_bytes = 4000\n"
    ))
    .expect("valid");
    assert_eq!(
        (config.server.max_guarded_requests, config.server.max_buffered_bytes),
        (10, 4000)
    );
    // Request bodies take three quarters: the largest one must fit them.
    let message = error(&format!(
        "[server]\nmax_buffered_bytes = 3999\nmax_request_body_bytes = 3000\n{ROUTE}"
    ));
    assert!(
        message.contains("t.toml:2: server.max_buffered_bytes: 3999 leaves less than max_request_body_bytes (3000)"),
        "{message}"
    );
    // A response the budget cannot hold could never be recorded.
    let message = error(&format!(
        "[server]\nmax_buffered_bytes = 4000\nmax_request_body_bytes = 3000\n{ROUTE}[route.idempotency]\nmax_response_body_bytes = 4001\n"
    ));
    assert!(
        message.contains("route[0].idempotency.max_response_body_bytes: is more than server.max_buffered_bytes (4000)"),
        "{message}"
    );
    let message = error(&format!("[server]\nmax_guarded_requests = 0\n{ROUTE}"));
    assert!(
        message.contains("t.toml:2: server.max_guarded_requests: must be greater than 0"),
        "{message}"
    );
}

#[test]
fn retention_must_exceed_the_lease() {
    let with = |retention: &str| {
        format!("{ROUTE}upstream_timeout = \"30s\"\n[route.idempotency]\nretention = \"{retention}\"\n")
    };
    let message = error(&with("31s"));
    assert!(
        message.contains("t.toml:7: route[0].idempotency.retention: 31s does not exceed the lease"),
        "{message}"
    );
    let config = parse(&with("31s 1ms")).expect("valid");
    let policy = config.routes[0].idempotency.as_ref().expect("guarded");
    assert_eq!(policy.retention, Duration::from_millis(31_001));
}

#[test]
fn a_host_must_not_be_empty() {
    let host = |value: &str| ROUTE.replace("upstream =", &format!("host = \"{value}\"\nupstream ="));
    assert!(error(&host("")).contains("route[0].host: must not be empty"));
    let config = parse(&host("API.example.com")).expect("valid");
    assert_eq!(
        config.routes[0].host.as_deref(),
        Some("api.example.com"),
        "hosts are matched lower-case"
    );
}

#[test]
fn a_redis_url_needs_the_redis_scheme_and_must_parse() {
    for url in [
        "unix:///tmp/redis.sock",
        "valkey://127.0.0.1/0",
        "redis://127.0.0.1:99999/0",
    ] {
        let message = error(&format!("[store]\nbackend = \"redis\"\nurl = \"{url}\"\n{ROUTE}"));
        assert!(
            message.contains("t.toml:3: store.url: must be a redis:// or rediss:// URL"),
            "{url}: {message}"
        );
    }
    assert!(
        parse(&format!(
            "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6380/0\"\n{ROUTE}"
        ))
        .is_ok()
    );
}

#[test]
fn syntax_errors_name_the_table_or_key_on_their_line() {
    assert!(error(&format!("[server\n{ROUTE}")).contains("t.toml:1: server:"));
    assert!(error(&format!("[[route]\n{}", &ROUTE["[[route]]\n".len()..])).contains("t.toml:1: route:"));
    assert!(error(&format!("[store]\ntimeout = \"5s\n{ROUTE}")).contains("t.toml:2: timeout:"));
}

#[test]
fn redact_url_hides_passwords() {
    assert_eq!(redact_url("redis://:hunter2@host:6379/0"), "redis://:***@host:6379/0");
    assert_eq!(redact_url("redis://user:hunter2@host/0"), "redis://user:***@host/0");
    assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
}

#[test]
fn the_three_redis_topologies_and_their_fields() {
    let sentinel = parse(&format!(
        "[store]\nbackend = \"redis-sentinel\"\nurls = [\"redis://10.0.0.1:26379\", \"redis://:pw@10.0.0.2:26379\"]\n\
         master_name = \"idemproxy\"\nmin_replica_acks = 1\nreplica_ack_timeout = \"250ms\"\n{ROUTE}"
    ))
    .expect("valid");
    let Backend::Redis(redis) = &sentinel.store.backend else {
        panic!("a redis backend")
    };
    assert_eq!(
        redis.topology,
        RedisTopology::Sentinel {
            urls: vec!["redis://10.0.0.1:26379".into(), "redis://:pw@10.0.0.2:26379".into()],
            master_name: "idemproxy".into()
        }
    );
    assert_eq!(
        (redis.min_replica_acks, redis.replica_ack_timeout),
        (1, Duration::from_millis(250))
    );
    let printed = sentinel.to_string();
    assert!(
        printed.contains("store  redis-sentinel (master \"idemproxy\" via sentinels redis://10.0.0.1:26379, redis://:***@10.0.0.2:26379); a claim waits for 1 replica acknowledgement(s) within 250ms"),
        "{printed}"
    );

    let cluster = parse(&format!(
        "[store]\nbackend = \"redis-cluster\"\nurls = [\"redis://10.0.1.1:6379\"]\n{ROUTE}"
    ))
    .expect("valid");
    let Backend::Redis(redis) = &cluster.store.backend else {
        panic!("a redis backend")
    };
    assert_eq!(
        redis.topology,
        RedisTopology::Cluster {
            urls: vec!["redis://10.0.1.1:6379".into()]
        }
    );
    assert_eq!(
        (redis.min_replica_acks, redis.replica_ack_timeout),
        (0, DEFAULT_REPLICA_ACK_TIMEOUT)
    );
    assert!(
        cluster
            .to_string()
            .contains("redis-cluster (seed nodes redis://10.0.1.1:6379); claims are not replica-acknowledged")
    );
}

#[test]
fn each_topology_refuses_the_fields_of_the_others() {
    for (store, needle) in [
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://s:26379\"]",
            "t.toml:2: store.master_name: the redis-sentinel backend needs master_name",
        ),
        (
            "backend = \"redis-sentinel\"\nmaster_name = \"m\"",
            "t.toml:2: store.urls: the redis-sentinel backend needs urls",
        ),
        (
            "backend = \"redis-sentinel\"\nurl = \"redis://s:26379\"\nmaster_name = \"m\"",
            "t.toml:3: store.url: the redis-sentinel backend has no such setting (redis and postgres use it); redis-sentinel and redis-cluster take urls = [...]",
        ),
        (
            "backend = \"redis-sentinel\"\nurls = []\nmaster_name = \"m\"",
            "t.toml:3: store.urls: must name at least one node",
        ),
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://s:26379\"]\nmaster_name = \"\"",
            "t.toml:4: store.master_name: must not be empty",
        ),
        (
            "backend = \"redis-cluster\"\nurls = [\"redis://n:6379\", \"http://n:6379\"]",
            "t.toml:3: store.urls[1]: must be a redis:// or rediss:// URL",
        ),
        (
            "backend = \"redis-cluster\"\nurls = [\"redis://n:6379\"]\nmaster_name = \"m\"",
            "t.toml:4: store.master_name: the redis-cluster backend has no such setting (redis-sentinel uses it)",
        ),
        (
            "backend = \"redis\"\nurl = \"redis://n:6379\"\nurls = [\"redis://n:6379\"]",
            "t.toml:4: store.urls: the redis backend has no such setting (redis-sentinel and redis-cluster use it); redis takes one url",
        ),
        (
            "backend = \"redis\"\nurl = \"redis://n\"\nreplica_ack_timeout = \"500us\"",
            "t.toml:4: store.replica_ack_timeout: must be at least 1ms",
        ),
        (
            "min_replica_acks = 1",
            "t.toml:2: store.min_replica_acks: the memory backend has no such setting (redis, redis-sentinel, redis-cluster and postgres use it)",
        ),
        (
            "urls = [\"redis://n:6379\"]",
            "t.toml:2: store.urls: the memory backend has no such setting",
        ),
    ] {
        let message = error(&format!("[store]\n{store}\n{ROUTE}"));
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
}

#[test]
fn the_admin_token_is_read_and_checked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let admin = |path: &std::path::Path| format!("[admin]\ntoken_file = {:?}\n{ROUTE}", path.display().to_string());
    let missing = dir.path().join("missing");
    assert!(error(&admin(&missing)).contains("t.toml:2: admin.token_file: cannot read"));
    let short = dir.path().join("short");
    std::fs::write(&short, "  fifteen-chars!\n").expect("write");
    assert!(error(&admin(&short)).contains("must hold a token of at least 16 characters"));
    let good = dir.path().join("good");
    std::fs::write(&good, "sixteen-chars-ok\n").expect("write");
    let config = parse(&admin(&good)).expect("valid");
    let token = config.admin.and_then(|admin| admin.token).expect("a token");
    assert!(
        token.verify(b"sixteen-chars-ok"),
        "whitespace around the token is not part of it"
    );
    assert!(!token.verify(b"sixteen-chars-o"));
    assert!(!token.verify(b"sixteen-chars-ok\n"));
    assert_eq!(config.sha256.len(), 64);
}

#[test]
fn a_reload_names_each_setting_only_a_restart_can_change() {
    let base = parse(&format!(
        "[admin]\nlisten = \"127.0.0.1:9090\"\n{ROUTE}[route.idempotency]\n"
    ))
    .expect("valid");
    // What a reload swaps: routes, policies, upstreams, body limits, the access log.
    let swappable = format!(
        "[server]\nmax_request_body_bytes = 10\nrequest_body_timeout = \"1s\"\naccess_log = true\n\
         [admin]\nlisten = \"127.0.0.1:9090\"\n{}[route.idempotency]\nretention = \"1h\"\n",
        ROUTE.replace("9000", "9001")
    );
    assert_eq!(
        base.needs_restart(&parse(&swappable).expect("valid")),
        Vec::<&str>::new()
    );
    for (changed, name) in [
        ("[server]\nlisten = \"127.0.0.1:8081\"\n", "server.listen"),
        ("[server]\nworkers = 3\n", "server.workers"),
        ("[server]\nmax_connections = 5\n", "server.max_connections"),
        ("[server]\nmax_guarded_requests = 5\n", "server.max_guarded_requests"),
        ("[server]\nmax_waiters = 5\n", "server.max_waiters"),
        ("[server]\nheader_read_timeout = \"2s\"\n", "server.header_read_timeout"),
        ("[server]\nshutdown_grace = \"2s\"\n", "server.shutdown_grace"),
        ("[store]\nkey_prefix = \"other\"\n", "store.key_prefix"),
        ("[store]\ntimeout = \"1s\"\n", "store.timeout"),
        ("[store]\nmax_records = 5\n", "store"),
        (
            "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n",
            "store",
        ),
    ] {
        let text = format!("{changed}[admin]\nlisten = \"127.0.0.1:9090\"\n{ROUTE}[route.idempotency]\n");
        let new = parse(&text).expect("valid");
        assert_eq!(base.needs_restart(&new), vec![name], "{changed}");
    }
    let moved = parse(&format!("[admin]\nlisten = \"127.0.0.1:9091\"\n{ROUTE}")).expect("valid");
    assert_eq!(base.needs_restart(&moved), vec!["admin.listen"]);
    let no_admin = parse(ROUTE).expect("valid");
    assert_eq!(base.needs_restart(&no_admin), vec!["admin.listen"]);
}

#[test]
fn fingerprint_body_and_its_ignore_pointers_are_validated() {
    let with = |lines: &str| format!("{ROUTE}[route.idempotency]\n{lines}\n");
    let policy = |config: &Config| config.routes[0].idempotency.clone().expect("guarded");
    let default = parse(&with("")).expect("valid");
    assert_eq!(policy(&default).fingerprint_body, FingerprintBody::Bytes);
    let json = parse(&with(
        "fingerprint_body = \"json\"\nfingerprint_ignore = [\"/request_id\", \"/meta/a~1b\"]",
    ))
    .expect("valid");
    assert_eq!(
        policy(&json).fingerprint_body,
        FingerprintBody::Json {
            ignore: vec![
                JsonPointer::parse("/request_id").expect("pointer"),
                JsonPointer::parse("/meta/a~1b").expect("pointer"),
            ]
        }
    );
    assert!(
        error(&with("fingerprint_ignore = [\"/a\"]"))
            .contains("route[0].idempotency.fingerprint_ignore: needs fingerprint_body = \"json\"")
    );
    assert!(
        error(&with("fingerprint_body = \"json\"\nfingerprint_ignore = [\"a\"]"))
            .contains("route[0].idempotency.fingerprint_ignore: \"a\" is not a JSON pointer")
    );
    assert!(error(&with("fingerprint_body = \"xml\"")).contains("route[0].idempotency.fingerprint_body"));
}

#[test]
fn key_sources_parse_and_each_bad_one_is_named() {
    let with = |lines: &str| format!("{ROUTE}[route.idempotency]\n{lines}\n");
    let policy = |config: &Config| config.routes[0].idempotency.clone().expect("guarded");
    let default = policy(&parse(&with("")).expect("valid"));
    assert_eq!(
        default.key,
        vec![KeySource::Header(HeaderName::from_static("idempotency-key"))]
    );
    assert!(!default.key_needs_body() && default.key_is_one_header());
    let header = policy(&parse(&with("header = \"X-Request-Id\"")).expect("valid"));
    assert_eq!(
        header.key,
        vec![KeySource::Header(HeaderName::from_static("x-request-id"))]
    );
    let all = parse(&with(
        "key = [\"header:X-Key\", \"json:/ref\", \"json:/tenant&/order\", \"form:ref\", \"query:ref\", \"body\"]\ndedup_window = \"5m\"\nscope_headers = [\"authorization\"]",
    ))
    .expect("valid");
    let sources = policy(&all).key.clone();
    assert_eq!(sources.len(), 6);
    assert_eq!(
        key::describe(&sources),
        "header:x-key, json:/ref, json:/tenant&/order, form:ref, query:ref, body"
    );
    assert_eq!(policy(&all).header, HeaderName::from_static("x-key"));
    assert_eq!(policy(&all).dedup_window, Some(Duration::from_secs(300)));
    let check = all.to_string();
    assert!(
        check.contains("guards POST,PATCH by the key from the first of header:x-key, json:/ref")
            && check.contains("two identical requests within 5m are one operation"),
        "{check}"
    );
    for (lines, said) in [
        ("key = []", "key: must name at least one source"),
        ("key = [\"cookie:a\"]", "\"cookie\" is not a kind of key source"),
        ("key = [\"json:\"]", "names no json"),
        ("key = [\"header:\"]", "names no header"),
        ("key = [\"header:a b\"]", "is not a header name"),
        ("key = [\"json:ref\"]", "must start with '/'"),
        ("key = [\"query:a b\"]", "a field name is visible ASCII"),
        ("key = [\"ref\"]", "is not a key source"),
        ("header = \"X\"\nkey = [\"json:/ref\"]", "give key or header, not both"),
        ("key = [\"body\", \"json:/ref\"]", "json:/ref comes after body"),
        (
            "key = [\"body\"]",
            "dedup_window: the body source (body) needs dedup_window",
        ),
        (
            "key = [\"json:/ref\"]\ndedup_window = \"5m\"",
            "dedup_window: only the body source takes it",
        ),
        // Issue 49 H1: two customers' identical bodies are one record unless the route
        // has a scope, so the second would be replayed the first one's receipt.
        (
            "key = [\"body\"]\ndedup_window = \"5m\"",
            "key: the body source needs a scope (scope_headers or scope_jwt)",
        ),
        (
            "key = [\"body\"]\ndedup_window = \"10s\"\nscope_headers = [\"authorization\"]",
            "dedup_window: 10s does not exceed the lease",
        ),
        (
            "key = [\"json:/meta/ref\"]\nfingerprint_body = \"json\"\nfingerprint_ignore = [\"/meta\"]",
            "json:/meta/ref: fingerprint_ignore drops /meta",
        ),
    ] {
        let refused = error(&with(lines));
        assert!(refused.contains("route[0].idempotency."), "{lines}: {refused}");
        assert!(refused.contains(said), "{lines}: {refused}");
    }
}

#[test]
fn mode_is_enforce_unless_shadow_is_asked_for() {
    let with = |lines: &str| format!("{ROUTE}[route.idempotency]\n{lines}\n");
    let mode = |config: &Config| config.routes[0].idempotency.as_ref().expect("guarded").mode;
    assert_eq!(mode(&parse(&with("")).expect("valid")), Mode::Enforce);
    let shadow = parse(&with("mode = \"shadow\"")).expect("valid");
    assert_eq!(mode(&shadow), Mode::Shadow);
    assert!(shadow.routes[0].shadow());
    assert!(shadow.to_string().contains("shadows POST,PATCH"));
    assert!(error(&with("mode = \"audit\"")).contains("route[0].idempotency.mode"));
}

#[test]
fn wait_for_in_flight_is_at_most_the_lease() {
    let with = |lines: &str| format!("{ROUTE}upstream_timeout = \"5s\"\n[route.idempotency]\n{lines}\n");
    let waits = parse(&with("wait_for_in_flight = \"6s\"")).expect("the lease itself is allowed");
    assert_eq!(
        waits.routes[0]
            .idempotency
            .as_ref()
            .expect("guarded")
            .wait_for_in_flight,
        Duration::from_secs(6)
    );
    assert!(waits.to_string().contains("duplicates wait 6s"));
    assert!(
        error(&with("wait_for_in_flight = \"6001ms\""))
            .contains("route[0].idempotency.wait_for_in_flight: 6s 1ms is longer than the lease")
    );
    let default = parse(&with("")).expect("valid");
    assert_eq!(
        default.routes[0]
            .idempotency
            .as_ref()
            .expect("guarded")
            .wait_for_in_flight,
        Duration::ZERO
    );
    assert_eq!(default.server.max_waiters, DEFAULT_MAX_WAITERS);
    assert!(
        error(&format!("[server]\nmax_waiters = 0\n{ROUTE}")).contains("server.max_waiters: must be greater than 0")
    );
}

#[test]
fn upstream_key_is_the_clients_unless_derived_or_none_is_asked_for() {
    let with = |lines: &str| format!("{ROUTE}[route.idempotency]\n{lines}\n");
    let policy = |config: &Config| config.routes[0].idempotency.clone().expect("guarded");
    let default = parse(&with("")).expect("valid");
    assert_eq!(policy(&default).upstream_key, UpstreamKey::Client);
    assert_eq!(policy(&default).upstream_key_header, "idempotency-key");
    assert!(!default.to_string().contains("sent upstream"), "{default}");
    let derived = parse(&with(
        "upstream_key = \"derived\"\nupstream_key_header = \"X-Operation\"",
    ))
    .expect("valid");
    assert_eq!(policy(&derived).upstream_key, UpstreamKey::Derived);
    assert_eq!(policy(&derived).upstream_key_header, "x-operation");
    assert!(
        derived
            .to_string()
            .contains("the operation id sent upstream as x-operation"),
        "{derived}"
    );
    let none = parse(&with("upstream_key = \"none\"")).expect("valid");
    assert!(none.to_string().contains("no key sent upstream"), "{none}");
    assert!(error(&with("upstream_key = \"hashed\"")).contains("route[0].idempotency.upstream_key"));
    assert!(error(&with("upstream_key_header = \"bad header\"")).contains("route[0].idempotency.upstream_key_header"));
}

#[test]
fn a_reconcile_probe_is_read_only_and_names_only_what_it_may() {
    let with = |lines: &str| format!("{ROUTE}[route.idempotency]\n{lines}\n");
    let probe = |config: &Config| {
        config.routes[0]
            .idempotency
            .clone()
            .and_then(|policy| policy.reconcile.clone())
            .expect("a probe")
    };
    let table = |fields: &str| {
        with(&format!(
            "[route.idempotency.reconcile]\npath = \"/v1/by-key/{{key}}\"\n{fields}"
        ))
    };
    let defaults = parse(&table("")).expect("valid");
    let reconcile = probe(&defaults);
    assert_eq!(reconcile.method, Method::GET);
    assert_eq!(
        (reconcile.applied[0].as_u16(), reconcile.not_applied[0].as_u16()),
        (200, 404)
    );
    assert_eq!(
        (reconcile.first_after, reconcile.every, reconcile.give_up_after),
        (Duration::from_secs(1), Duration::from_secs(5), Duration::from_secs(600))
    );
    assert_eq!(
        reconcile.timeout, defaults.routes[0].upstream_timeout,
        "the upstream's timeout"
    );
    assert_eq!(reconcile.max_concurrent, 8);
    assert!(
        defaults
            .to_string()
            .contains("unknown outcomes probed by GET /v1/by-key/{key} after 1s, every 5s for 10m"),
        "{defaults}"
    );
    // {key} is percent-encoded into one segment; {record} is the operation id.
    let both = parse(&with(
        "[route.idempotency.reconcile]\nmethod = \"head\"\npath = \"/v1/ops/{record}?key={key}\"",
    ))
    .expect("valid");
    let reconcile = probe(&both);
    assert_eq!(reconcile.method, Method::HEAD);
    assert_eq!(
        reconcile.path.render("a/b c?%", "0f0f"),
        "/v1/ops/0f0f?key=a%2Fb%20c%3F%25"
    );

    for (fields, field, says) in [
        ("method = \"POST\"", "reconcile.method", "not GET or HEAD"),
        ("method = \"DELETE\"", "reconcile.method", "never run the operation"),
        (
            "applied = [200]\nnot_applied = [404, 200]",
            "reconcile.not_applied",
            "also in applied",
        ),
        ("applied = []\nnot_applied = []", "reconcile.applied", "both empty"),
        ("applied = [99]", "reconcile.applied", "not a final status"),
        ("every = \"0s\"", "reconcile.every", "greater than 0"),
        (
            "first_after = \"1m\"\ngive_up_after = \"30s\"",
            "reconcile.give_up_after",
            "does not exceed first_after",
        ),
        ("max_concurrent = 0", "reconcile.max_concurrent", "at least 1"),
        ("timeout = \"0s\"", "reconcile.timeout", "greater than 0"),
        ("body = \"x\"", "reconcile", "unknown field"),
    ] {
        let message = error(&table(fields));
        assert!(
            message.contains(&format!("route[0].idempotency.{field}")) || message.contains(field),
            "{fields}: {message}"
        );
        assert!(message.contains(says), "{fields}: {message}");
    }
    for (path, says) in [
        ("v1/{key}", "does not begin with /"),
        ("/v1/{id}", "{id} is not a placeholder"),
        ("/v1/{key", "without its }"),
        ("/v1/key}", "without its {"),
        ("/v1/a b/{key}", "not a valid path"),
    ] {
        let message = error(&with(&format!("[route.idempotency.reconcile]\npath = {path:?}")));
        assert!(
            message.contains("route[0].idempotency.reconcile.path") && message.contains(says),
            "{path}: {message}"
        );
    }
    // No key sent upstream: nothing to look up by {key}; {record} still works.
    let none = |path: &str| {
        with(&format!(
            "upstream_key = \"none\"\n[route.idempotency.reconcile]\npath = {path:?}"
        ))
    };
    assert!(error(&none("/v1/by-key/{key}")).contains("upstream_key = \"none\""));
    assert!(parse(&none("/v1/ops/{record}")).is_ok());
}

#[test]
fn docs_url_profile_and_contract_path_are_checked() {
    let route = |lines: &str, policy: &str| format!("[server]\n{lines}\n{ROUTE}{policy}\n");
    let docs = parse(&route(
        "",
        "docs_url = \"https://docs.example.com/errors\"\n[route.idempotency]\nprofile = \"stripe\"",
    ))
    .expect("valid");
    assert_eq!(
        docs.routes[0].docs_url.as_deref(),
        Some("https://docs.example.com/errors")
    );
    assert_eq!(
        docs.routes[0].idempotency.as_ref().map(|policy| policy.profile),
        Some(crate::error::Profile::Stripe)
    );
    assert_eq!(docs.server.contract_path.as_deref(), Some("/.well-known/idempotency"));
    let summary = docs.to_string();
    assert!(
        summary.contains(", Stripe-style errors, errors documented at https://docs.example.com/errors)"),
        "{summary}"
    );
    for (url, says) in [
        ("docs.example.com/errors", "not an absolute http or https URL"),
        ("ftp://docs.example.com/", "not an absolute http or https URL"),
        ("https://docs.example.com/errors#top", "has a fragment"),
    ] {
        let message = error(&route("", &format!("docs_url = {url:?}")));
        assert!(
            message.contains("route[0].docs_url") && message.contains(says),
            "{url}: {message}"
        );
    }
    assert!(error(&route("", "[route.idempotency]\nprofile = \"paypal\"")).contains("route[0].idempotency.profile"));
    let off = parse(&route("contract_path = \"\"", "")).expect("valid");
    assert_eq!(off.server.contract_path, None);
    let message = error(&route("contract_path = \"idempotency\"", ""));
    assert!(message.contains("server.contract_path"), "{message}");
}

#[test]
fn tracing_is_off_without_an_endpoint_and_defaults_as_the_design_says() {
    assert_eq!(parse(ROUTE).expect("valid").tracing, None);
    let empty = parse(&format!("[tracing]\nservice_name = \"edge\"\n{ROUTE}")).expect("valid");
    assert_eq!(empty.tracing, None, "no otlp_endpoint: no export");
    let on = parse(&format!(
        "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n{ROUTE}"
    ))
    .expect("valid");
    let tracing = on.tracing.clone().expect("on");
    assert_eq!(tracing.otlp_endpoint.to_string(), "http://127.0.0.1:4318/v1/traces");
    assert_eq!(tracing.service_name, "idemproxy");
    assert_eq!(tracing.sample_ratio, 1.0);
    assert!(
        on.to_string()
            .contains("traces OTLP/HTTP to http://127.0.0.1:4318/v1/traces")
    );
    // A path of its own is kept as given.
    let path = parse(&format!(
        "[tracing]\notlp_endpoint = \"https://otel.example.com/ingest/traces\"\nsample_ratio = 0.01\n{ROUTE}"
    ))
    .expect("valid")
    .tracing
    .expect("on");
    assert_eq!(path.otlp_endpoint.to_string(), "https://otel.example.com/ingest/traces");
    assert_eq!(path.sample_ratio, 0.01);
}

#[test]
fn a_bad_tracing_table_is_refused_with_its_field() {
    for (table, field, reason) in [
        (
            "otlp_endpoint = \"grpc://127.0.0.1:4317\"",
            "tracing.otlp_endpoint",
            "http:// or https://",
        ),
        (
            "otlp_endpoint = \"not a url\"",
            "tracing.otlp_endpoint",
            "not a valid URL",
        ),
        (
            "otlp_endpoint = \"http://c/v1/traces?x=1\"",
            "tracing.otlp_endpoint",
            "query",
        ),
        ("sample_ratio = 1.5", "tracing.sample_ratio", "between 0.0 and 1.0"),
        ("sample_ratio = -0.1", "tracing.sample_ratio", "between 0.0 and 1.0"),
        ("service_name = \" \"", "tracing.service_name", "must not be empty"),
        ("otlp = \"http://c\"", "otlp", "unknown field"),
    ] {
        let message = error(&format!("[tracing]\n{table}\n{ROUTE}"));
        assert!(
            message.contains(field) && message.contains(reason),
            "{table}: {message}"
        );
    }
}

#[test]
fn a_tracing_change_needs_a_restart() {
    let off = parse(ROUTE).expect("valid");
    let on = parse(&format!(
        "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n{ROUTE}"
    ))
    .expect("valid");
    assert_eq!(off.needs_restart(&on), ["tracing"]);
    assert!(on.needs_restart(&on.clone()).is_empty());
}

/// Every byte setting takes a number of bytes or a size with a unit, as durations take
/// `"30s"`; a size that does not parse names its setting; `check` prints both forms.
#[test]
fn byte_sizes_read_like_durations() {
    let config = parse(&format!(
        "[server]\nmax_buffered_bytes = \"1GiB\"\nmax_request_body_bytes = \"64KiB\"\n\
         [store]\nmax_bytes = \"512 MiB\"\nmax_bytes_per_scope = \"10MB\"\n\
         {ROUTE}[route.idempotency]\nmax_response_body_bytes = \"1.5MiB\"\n"
    ))
    .expect("valid");
    assert_eq!(config.server.max_buffered_bytes, 1 << 30);
    assert_eq!(config.server.max_request_body_bytes, 64 * 1024);
    match config.store.backend {
        Backend::Memory(StoreLimits {
            max_bytes,
            max_bytes_per_scope,
            ..
        }) => assert_eq!((max_bytes, max_bytes_per_scope), (512 << 20, 10_000_000)),
        other => panic!("{other:?}"),
    }
    let policy = config.routes[0].idempotency.as_ref().expect("guarded");
    assert_eq!(policy.max_response_body_bytes, 1024 * 1024 * 3 / 2);
    let printed = config.to_string();
    for shown in [
        "max_buffered_bytes 1073741824 = 1 GiB (request bodies at most 768 MiB of it)",
        "max_request_body_bytes 65536 = 64 KiB",
        "max_bytes 536870912 = 512 MiB; per scope 25000 records, 9.5 MiB",
    ] {
        assert!(printed.contains(shown), "{shown:?} not in {printed}");
    }
    for (setting, bad) in [
        ("server.max_buffered_bytes", "\"256MiBs\""),
        ("server.max_request_body_bytes", "\"lots\""),
        ("server.max_request_body_bytes", "-1"),
        ("store.max_bytes", "\"1 XB\""),
    ] {
        let (table, key) = setting.rsplit_once('.').expect("a table and a key");
        let error = parse(&format!("[{table}]\n{key} = {bad}\n{ROUTE}"))
            .map(|_| ())
            .expect_err("refused");
        let text = error.to_string();
        assert!(text.contains(&format!("t.toml:2: {setting}:")), "{text}");
        assert!(text.contains("invalid size"), "{text}");
    }
}

/// The keys the validator accepts in `table`, as its refusal of an unknown one lists
/// them (`expected one of `a`, `b``): what serde's `deny_unknown_fields` knows.
fn accepted(table: &str) -> std::collections::BTreeSet<String> {
    let unknown = "zzz_not_a_setting = 1\n";
    let source = match table {
        "" => format!("{unknown}{ROUTE}"),
        "route" => {
            format!("[[route]]\n{unknown}name = \"a\"\npath_prefix = \"/a\"\nupstream = \"http://127.0.0.1:9\"\n")
        }
        "route.idempotency" => format!("{ROUTE}[route.idempotency]\n{unknown}"),
        "route.idempotency.reconcile" | "route.idempotency.scope_jwt" => {
            format!("{ROUTE}[route.idempotency]\n[{table}]\n{unknown}")
        }
        "route.idempotency.refetch" => {
            format!("{ROUTE}[route.idempotency]\nreplay = \"refetch\"\n[{table}]\n{unknown}")
        }
        "route.cors" => format!("{ROUTE}[route.cors]\nallow_origins = [\"https://a.test\"]\n{unknown}"),
        table => format!("[{table}]\n{unknown}{ROUTE}"),
    };
    let error = parse(&source)
        .map(|_| ())
        .expect_err("an unknown key is refused")
        .to_string();
    let expected = error
        .split("expected")
        .nth(1)
        .unwrap_or_else(|| panic!("{table}: {error}"));
    expected.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// Every key the validator accepts, in every table, is in the configuration
/// reference, and the reference lists nothing the validator would refuse.
#[test]
fn the_reference_lists_every_setting_the_validator_accepts() {
    use super::reference::{SETTINGS, TABLES, split};
    let tables = std::iter::once("").chain(TABLES.iter().copied());
    for table in tables {
        let accepted = accepted(table);
        let mut listed: std::collections::BTreeSet<String> = SETTINGS
            .iter()
            .filter(|setting| split(setting.key).0 == table)
            .map(|setting| split(setting.key).1.to_string())
            .collect();
        // The tables inside this one are keys of it too.
        listed.extend(
            TABLES
                .iter()
                .filter(|child| split(child).0 == table)
                .map(|child| split(child).1.to_string()),
        );
        assert_eq!(
            accepted, listed,
            "[{table}]: what the validator accepts and what the reference lists"
        );
    }
    let mut keys: Vec<&str> = SETTINGS.iter().map(|setting| setting.key).collect();
    let count = keys.len();
    keys.dedup();
    assert_eq!(keys.len(), count, "a setting listed twice");
}

/// The reference's `backends` column is what the validator does: each `[store]`
/// setting it limits, given to each of the six backends, is refused by exactly those
/// the column leaves out, naming the ones it lists.
#[test]
fn each_store_setting_is_taken_by_the_backends_the_reference_names() {
    use super::reference::{Backends, SETTINGS, split};
    let backends: [(&str, &[(&str, &str)]); 6] = [
        ("memory", &[]),
        ("sqlite", &[("path", "\"r.db\"")]),
        ("redis", &[("url", "\"redis://127.0.0.1:6379\"")]),
        (
            "redis-sentinel",
            &[("urls", "[\"redis://127.0.0.1:26379\"]"), ("master_name", "\"m\"")],
        ),
        ("redis-cluster", &[("urls", "[\"redis://127.0.0.1:7000\"]")]),
        ("postgres", &[("url", "\"postgres://app@db/orders\"")]),
    ];
    let sample = |name: &str| match name {
        "url" => "\"redis://127.0.0.1:6379\"",
        "urls" => "[\"redis://127.0.0.1:6379\"]",
        "master_name" | "schema" => "\"m\"",
        "min_replica_acks" | "connections" => "2",
        "replica_ack_timeout" => "\"250ms\"",
        "tls_ca_file" | "tls_cert_file" | "tls_key_file" => "\"missing.pem\"",
        "password_env" => "\"IDEMPROXY_TEST_UNSET\"",
        "migrate" => "false",
        "max_records" | "max_records_per_scope" | "max_records_per_client" => "10",
        "max_bytes" | "max_bytes_per_scope" | "cache_bytes" => "\"2MiB\"",
        "path" => "\"x.db\"",
        other => panic!("no sample value for store.{other}"),
    };
    let mut refused = 0;
    let mut limited = 0;
    for setting in SETTINGS {
        let Backends::Only { .. } = setting.backends else {
            continue;
        };
        limited += 1;
        let name = split(setting.key).1;
        for (backend, base) in backends {
            let mut without = format!("[store]\nbackend = \"{backend}\"\n");
            for (key, value) in base.iter().filter(|(key, _)| *key != name) {
                without.push_str(&format!("{key} = {value}\n"));
            }
            let with = format!("{without}{name} = {}\n{ROUTE}", sample(name));
            let parsed = parse(&with);
            let outcome = parsed.as_ref().err().map(ToString::to_string);
            let refusal = format!("{}: the {backend} backend has no such setting (", setting.key);
            let named = outcome.as_deref().is_some_and(|message| message.contains(&refusal));
            if setting.backends.take(backend) {
                assert!(!named, "{backend} refused {}: {outcome:?}", setting.key);
                // A backend the column names reads the setting: it changes what is
                // loaded, or is refused for its value, by its name.
                let read = match (parsed, parse(&format!("{without}{ROUTE}"))) {
                    (Ok(with), Ok(without)) => format!("{:?}", with.store) != format!("{:?}", without.store),
                    (Ok(_), Err(_)) => true,
                    (Err(error), _) => error.to_string().contains(&format!("{}:", setting.key)),
                };
                assert!(read, "{backend} ignores {}: {outcome:?}", setting.key);
            } else {
                assert!(named, "{backend} took {}: {outcome:?}", setting.key);
                let message = outcome.unwrap_or_default();
                assert!(
                    message.contains(&format!("{refusal}{} use", setting.backends.named())),
                    "{message}"
                );
                refused += 1;
            }
        }
    }
    assert_eq!(limited, 19, "the [store] settings some backends refuse");
    assert!(refused > 50, "only {refused} refusals checked");
}

/// Each default the reference gives as a value is the default the validator applies:
/// writing it out changes nothing.
#[test]
fn the_reference_defaults_are_the_ones_applied() {
    use super::reference::{DefaultValue, SETTINGS, split};
    let redis = "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n";
    let dir = tempfile::tempdir().expect("a directory");
    let jwks = dir.path().join("jwks.json");
    let ed25519 = "{\"keys\": [{\"kty\": \"OKP\", \"crv\": \"Ed25519\", \"x\": \"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo\"}]}";
    std::fs::write(&jwks, ed25519).expect("write the JWKS");
    let bases = |table: &str| -> Vec<(String, String)> {
        let route = "[[route]]\nname = \"a\"\npath_prefix = \"/a\"\nupstream = \"http://127.0.0.1:9\"\n";
        let policy = format!("{route}[route.idempotency]\n");
        match table {
            "route" => vec![(route.to_string(), String::new())],
            "route.idempotency" => vec![
                (policy.clone(), String::new()),
                (format!("{policy}graphql = \"mutations\"\n"), String::new()),
            ],
            "route.cors" => vec![(
                format!("{policy}[route.cors]\nallow_origins = [\"https://app.example.com\"]\n"),
                String::new(),
            )],
            "route.idempotency.reconcile" => vec![(
                format!("{policy}[route.idempotency.reconcile]\npath = \"/by-key/{{record}}\"\n"),
                String::new(),
            )],
            "route.idempotency.refetch" => vec![(
                format!("{policy}replay = \"refetch\"\n[route.idempotency.refetch]\npath = \"/by-key/{{record}}\"\n"),
                String::new(),
            )],
            "route.idempotency.scope_jwt" => vec![(
                format!(
                    "{policy}[route.idempotency.scope_jwt]\njwks_file = {:?}\n",
                    jwks.display().to_string()
                ),
                String::new(),
            )],
            "tracing" => vec![(
                format!("[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n__SETTING__{route}"),
                String::new(),
            )],
            "store" => vec![
                (format!("[store]\n__SETTING__{route}"), String::new()),
                (format!("{redis}__SETTING__{route}"), String::new()),
                (
                    format!("[store]\nbackend = \"sqlite\"\npath = \"records.db\"\n__SETTING__{route}"),
                    String::new(),
                ),
                (
                    format!(
                        "[store]\nbackend = \"postgres\"\nurl = \"postgres://idemproxy@db/app\"\n__SETTING__{route}"
                    ),
                    String::new(),
                ),
            ],
            table => vec![(format!("[{table}]\n__SETTING__{route}"), String::new())],
        }
    };
    let debug = |mut config: super::Config| {
        config.sha256.clear();
        format!("{config:?}")
    };
    let mut checked = 0;
    for setting in SETTINGS {
        let DefaultValue::Toml(value) = setting.default else {
            continue;
        };
        let (table, name) = split(setting.key);
        let line = format!("{name} = {value}\n");
        let mut matched = false;
        for (base, _) in bases(table) {
            let (with, without) = if base.contains("__SETTING__") {
                (base.replace("__SETTING__", &line), base.replace("__SETTING__", ""))
            } else {
                (format!("{base}{line}"), base.clone())
            };
            if let (Ok(with), Ok(without)) = (parse(&with), parse(&without)) {
                assert_eq!(
                    debug(with),
                    debug(without),
                    "{}: the default {value} is not the one applied",
                    setting.key
                );
                matched = true;
                break;
            }
        }
        assert!(matched, "{}: no config takes {value}", setting.key);
        checked += 1;
    }
    assert!(checked > 50, "only {checked} defaults checked");
}

/// A probe that asks by `{key}` with the client's key, on a route that scopes keys per
/// tenant, could learn another tenant's operation (it carries no credentials): refused,
/// naming what to use instead. `{record}` or `upstream_key = "derived"` is unique per
/// tenant, and a route without scope has one key space anyway.
#[test]
fn a_probe_by_the_clients_key_is_refused_on_a_scoped_route() {
    // Issue 49 M4: a refetch by the client's key is refused alike (it replayed Bob's
    // response to Mallory, who reused Bob's key).
    let refetch = "replay = \"refetch\"\nrefetch = { path = \"/by-key/{key}\" }\n";
    for scope in [
        "scope_headers = [\"authorization\"]\n",
        "scope_headers = [\"x-tenant\"]\nupstream_key = \"client\"\n",
    ] {
        let error = parse(&format!("{ROUTE}[route.idempotency]\n{scope}{refetch}"))
            .map(|_| ())
            .expect_err("refused")
            .to_string();
        assert!(error.contains("route[0].idempotency.refetch.path"), "{error}");
        assert!(error.contains("a refetch (which carries no credentials)"), "{error}");
    }
    parse(&format!(
        "{ROUTE}[route.idempotency]\nscope_headers = [\"a\"]\nupstream_key = \"derived\"\n{refetch}"
    ))
    .expect("derived keys are unique per tenant");
    parse(&format!("{ROUTE}[route.idempotency]\n{refetch}")).expect("one key space without a scope");
    let probe = "[route.idempotency.reconcile]\npath = \"/by-key/{key}\"\n";
    for scope in [
        "scope_headers = [\"authorization\"]\n",
        "scope_headers = [\"x-tenant\"]\nupstream_key = \"client\"\n",
    ] {
        let error = parse(&format!("{ROUTE}[route.idempotency]\n{scope}{probe}"))
            .map(|_| ())
            .expect_err("refused")
            .to_string();
        assert!(error.contains("route[0].idempotency.reconcile.path"), "{error}");
        assert!(error.contains("upstream_key = \"derived\""), "{error}");
    }
    for accepted in [
        format!("{ROUTE}[route.idempotency]\nscope_headers = [\"authorization\"]\nupstream_key = \"derived\"\n{probe}"),
        format!(
            "{ROUTE}[route.idempotency]\nscope_headers = [\"authorization\"]\n[route.idempotency.reconcile]\npath = \"/ops/{{record}}\"\n"
        ),
        format!("{ROUTE}[route.idempotency]\n{probe}"),
    ] {
        parse(&accepted).unwrap_or_else(|error| panic!("{accepted}: {error}"));
    }
}

/// A probe path must identify the record: a fragment is never sent (every probe would
/// ask one URL), and a template with neither placeholder asks about no record.
#[test]
fn a_probe_path_must_name_the_record() {
    for (path, why) in [
        ("/v1/lookup#{key}", "fragment"),
        ("/v1/lookup", "neither {key} nor {record}"),
        ("/v1/lookup?x=1", "neither {key} nor {record}"),
    ] {
        let error = parse(&format!(
            "{ROUTE}[route.idempotency]\n[route.idempotency.reconcile]\npath = {path:?}\n"
        ))
        .map(|_| ())
        .expect_err("refused")
        .to_string();
        assert!(
            error.contains("reconcile.path") && error.contains(why),
            "{path}: {error}"
        );
    }
}

/// `contract_path` is matched against canonical paths before any route: a spelling
/// that is not canonical could never match, and a guarded route's own prefix would
/// have its requests answered 405.
#[test]
fn the_contract_path_is_canonical_and_no_guarded_routes_prefix() {
    for (path, why) in [
        ("/.well-known/../x", "write \"/x\""),
        ("//x", "write \"/x\""),
        ("/x#y", "fragment"),
        ("/x?y", "query"),
        ("/v1/%70ay", "write \"/v1/pay\""),
    ] {
        let error = parse(&format!("[server]\ncontract_path = {path:?}\n{ROUTE}"))
            .map(|_| ())
            .expect_err("refused")
            .to_string();
        assert!(
            error.contains("server.contract_path") && error.contains(why),
            "{path}: {error}"
        );
    }
    let prefix = ROUTE
        .lines()
        .find_map(|line| line.strip_prefix("path_prefix = "))
        .expect("the test route's prefix");
    let error = parse(&format!(
        "[server]\ncontract_path = {prefix}\n{ROUTE}[route.idempotency]\n"
    ))
    .map(|_| ())
    .expect_err("refused")
    .to_string();
    assert!(
        error.contains("server.contract_path") && error.contains("405"),
        "{error}"
    );
    // An unguarded route's prefix, or a path under a guarded one, is the operator's call.
    parse(&format!("[server]\ncontract_path = {prefix}\n{ROUTE}")).expect("an unguarded route's prefix");
    parse(&format!(
        "[server]\ncontract_path = \"/idempotency\"\n{ROUTE}[route.idempotency]\n"
    ))
    .expect("valid");
}

/// The SQLite backend: its file is required and resolved against the config's
/// directory, it takes the embedded bounds (with its own defaults) and none of Redis's
/// settings, and its byte bound must leave room for a route's largest response.
#[test]
fn the_sqlite_backend_takes_a_file_and_the_embedded_bounds() {
    let sqlite = "[store]\nbackend = \"sqlite\"\n";
    let config = Config::parse(
        &format!("{sqlite}path = \"data/records.db\"\n{ROUTE}"),
        Path::new("/etc/idemproxy/proxy.toml"),
    )
    .expect("valid");
    let Backend::Sqlite(store) = &config.store.backend else {
        panic!("{:?}", config.store.backend);
    };
    assert_eq!(store.path, Path::new("/etc/idemproxy/data/records.db"));
    assert_eq!(
        store.limits,
        StoreLimits {
            max_records: DEFAULT_SQLITE_MAX_RECORDS,
            max_bytes: DEFAULT_SQLITE_MAX_BYTES,
            max_records_per_scope: DEFAULT_SQLITE_MAX_RECORDS / 4,
            max_bytes_per_scope: DEFAULT_SQLITE_MAX_BYTES / 4,
            max_records_per_client: DEFAULT_SQLITE_MAX_RECORDS / 2,
        }
    );
    assert_eq!(store.cache_bytes, DEFAULT_SQLITE_CACHE_BYTES);
    let absolute = parse(&format!("{sqlite}path = \"/var/lib/idemproxy/records.db\"\n{ROUTE}")).expect("valid");
    assert!(
        matches!(&absolute.store.backend, Backend::Sqlite(store) if store.path == Path::new("/var/lib/idemproxy/records.db"))
    );
    let printed = absolute.to_string();
    assert!(
        printed.contains(
            "store  sqlite /var/lib/idemproxy/records.db (max_records 10000000, max_bytes 1073741824 = 1 GiB;"
        ),
        "{printed}"
    );
    let memory = parse(ROUTE).expect("valid").to_string();
    assert!(memory.contains("forgets every record on restart"), "{memory}");
    for (text, expected) in [
        (
            format!("{sqlite}{ROUTE}"),
            "t.toml:2: store.path: the sqlite backend needs the file",
        ),
        (
            format!("{sqlite}path = \"\"\n{ROUTE}"),
            "t.toml:3: store.path: must name a file",
        ),
        (
            format!("{sqlite}path = \"r.db\"\nurl = \"redis://x\"\n{ROUTE}"),
            "store.url: the sqlite backend has no such setting (redis and postgres use it)",
        ),
        (
            format!("{sqlite}path = \"r.db\"\ncache_bytes = \"512KiB\"\n{ROUTE}"),
            "store.cache_bytes: must be at least 1048576 (1 MiB)",
        ),
        (
            format!("[store]\npath = \"r.db\"\n{ROUTE}"),
            "store.path: the memory backend has no such setting (sqlite uses it)",
        ),
        (
            format!("[store]\nbackend = \"redis\"\nurl = \"redis://x\"\ncache_bytes = \"8MiB\"\n{ROUTE}"),
            "store.cache_bytes: the redis backend has no such setting (sqlite uses it)",
        ),
        (
            format!("{sqlite}path = \"r.db\"\nmax_bytes = \"4MiB\"\n{ROUTE}[route.idempotency]\n"),
            "t.toml:4: store.max_bytes: must be at least 8 times route payments's max_response_body_bytes (1048576)",
        ),
    ] {
        let message = error(&text);
        assert!(message.contains(expected), "{expected:?} not in {message}");
    }
    // Eight times the largest response fits.
    parse(&format!(
        "{sqlite}path = \"r.db\"\nmax_bytes = \"8MiB\"\n{ROUTE}[route.idempotency]\n"
    ))
    .expect("valid");
}

/// The Postgres backend: its settings, each refusal naming the field, and a password
/// (in the URL or from `password_env`) never in `check`'s output nor in an error.
#[test]
fn the_postgres_backend_takes_its_settings_and_never_shows_a_password() {
    let with = |lines: &str| format!("[store]\nbackend = \"postgres\"\n{lines}\n{ROUTE}");
    let config = parse(&with(
        "url = \"postgres://app:hunter2-secret@db1,db2:5433/orders?target_session_attrs=read-write\"\nschema = \"idem_1\"\nmigrate = false\nconnections = 8\nmax_records_per_scope = 50\nmin_replica_acks = 1",
    ))
    .expect("valid");
    let Backend::Postgres(postgres) = &config.store.backend else {
        panic!("not postgres: {:?}", config.store.backend);
    };
    assert_eq!(
        (postgres.schema.as_str(), postgres.migrate, postgres.connections),
        ("idem_1", false, 8)
    );
    assert_eq!((postgres.max_records_per_scope, postgres.min_replica_acks), (50, 1));
    let shown = config.to_string();
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(
        shown.contains("postgres postgres://app@db1:5432,db2:5433/orders schema idem_1; password in the URL"),
        "{shown}"
    );
    assert!(shown.contains("remote_apply"), "{shown}");
    let defaults = parse(&with("url = \"postgres://app@db/orders\"")).expect("valid");
    let Backend::Postgres(postgres) = &defaults.store.backend else {
        panic!("not postgres");
    };
    assert_eq!(
        (postgres.schema.as_str(), postgres.migrate, postgres.connections),
        ("idemproxy", true, DEFAULT_POSTGRES_CONNECTIONS)
    );
    assert!(!format!("{defaults:?}").contains("hunter2"));
    // libpq's verify modes are taken: over rustls every TLS connection verifies both
    // the chain and the host name, as verify-full does.
    for mode in ["verify-full", "verify-ca", "require"] {
        let strict = parse(&with(&format!(
            "url = \"postgres://app@db/orders?application_name=x&sslmode={mode}\""
        )))
        .expect("valid");
        let Backend::Postgres(postgres) = &strict.store.backend else {
            panic!("not postgres");
        };
        assert_eq!(
            (postgres.server.get_ssl_mode(), postgres.server.get_application_name()),
            (tokio_postgres::config::SslMode::Require, Some("x"))
        );
    }
    for (lines, expected) in [
        ("", "store.url: the postgres backend needs url"),
        (
            "url = \"redis://db:6379\"",
            "store.url: must be a postgres:// or postgresql:// URL",
        ),
        (
            "url = \"postgres://a:hunter2@db/x?sslmode=sometimes\"",
            "store.url: sslmode must be disable, prefer",
        ),
        (
            "url = \"postgres://a@db/x?sslmode=allow\"",
            "store.url: sslmode must be disable, prefer",
        ),
        (
            "url = \"postgres://a:hunter2@db/x?connect_timeout=soon\"",
            "store.url: must be a postgres://",
        ),
        (
            "url = \"postgres://a@db/x\"\nschema = \"Bad-Name\"",
            "store.schema: must be 1 to 48",
        ),
        ("url = \"postgres://a@db/x\"\nschema = \"pg_catalog\"", "store.schema"),
        (
            "url = \"postgres://a@db/x\"\nmax_records = 5",
            "store.max_records: the postgres backend has no such setting (memory and sqlite use it); bound Redis with maxmemory; Postgres is bounded by its disk",
        ),
        (
            "url = \"postgres://a@db/x\"\npath = \"r.db\"",
            "store.path: the postgres backend has no such setting (sqlite uses it)",
        ),
        (
            "url = \"postgres://a@db/x\"\nconnections = 0",
            "store.connections: must be between 1 and 64",
        ),
        (
            "url = \"postgres://a@db/x\"\nmax_records_per_scope = 0",
            "store.max_records_per_scope: must be greater than 0",
        ),
        (
            "url = \"postgres://a@db/x\"\npassword_env = \"IDEMPROXY_TEST_SURELY_UNSET_PG\"",
            "store.password_env: the environment variable IDEMPROXY_TEST_SURELY_UNSET_PG is not set",
        ),
        (
            "url = \"postgres://a:hunter2@db/x\"\npassword_env = \"PATH\"",
            "store.password_env: store.url holds a password too",
        ),
        (
            "url = \"postgres://a@db/x?sslmode=disable\"\ntls_ca_file = \"ca.pem\"",
            "store.tls_ca_file: TLS settings with sslmode=disable",
        ),
    ] {
        let refused = error(&with(lines));
        assert!(refused.contains(expected), "{lines}: {refused}");
        assert!(!refused.contains("hunter2"), "{refused}");
    }
    assert!(
        error(&format!("[store]\nschema = \"x\"\n{ROUTE}"))
            .contains("store.schema: the memory backend has no such setting (postgres uses it)")
    );
}
