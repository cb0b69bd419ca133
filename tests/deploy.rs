//! The deployment files in `deploy/` cannot rot: each is parsed, every config they
//! embed goes through `idemproxy check`, the manifests agree with those configs and
//! with the Dockerfile (ports, paths, user, grace periods), and every metric the alert
//! rules and the dashboard name is one the proxy exports.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idemproxy::Config;
use serde_json::Value;
use support::{StoreKind, TestConfig, send};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|error| panic!("read {path}: {error}"))
}

/// Every YAML document in `path`, as JSON values.
fn yaml(path: &str) -> Vec<Value> {
    serde_saphyr::from_multiple(&read(path)).unwrap_or_else(|error| panic!("{path} is not YAML: {error}"))
}

fn one_yaml(path: &str) -> Value {
    let mut documents = yaml(path);
    assert_eq!(documents.len(), 1, "{path} holds one document");
    documents.remove(0)
}

fn text<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value}"))
}

/// A config embedded in a deployment file, with the token file it names (a path
/// inside the container) replaced by a real one holding `token`: checked with the
/// binary's `check`, which must succeed, and parsed for the other checks.
struct Embedded {
    config: Config,
    /// The container path of the token file.
    token_file: String,
    check_output: String,
    _dir: tempfile::TempDir,
}

fn embedded(source: &str, what: &str) -> Embedded {
    let raw: toml::Value = toml::from_str(source).unwrap_or_else(|error| panic!("{what}: {error}"));
    let token_file = raw["admin"]["token_file"]
        .as_str()
        .unwrap_or_else(|| panic!("{what} sets admin.token_file"))
        .to_string();
    let dir = tempfile::tempdir().expect("temp dir");
    let token = dir.path().join("token");
    std::fs::write(&token, "a-token-of-thirty-two-characters").expect("write the token");
    let local = source.replace(&token_file, &token.display().to_string());
    let file = dir.path().join("proxy.toml");
    std::fs::write(&file, &local).expect("write the config");
    let (ok, check_output) = check(&file);
    assert!(ok, "idemproxy check refused {what}:\n{check_output}");
    let config = Config::parse(&local, &file).unwrap_or_else(|error| panic!("{what}: {error}"));
    Embedded {
        config,
        token_file,
        check_output,
        _dir: dir,
    }
}

/// Runs `idemproxy check --config path`: whether it succeeded, and what it printed.
fn check(path: &Path) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check", "--config"])
        .arg(path)
        .output()
        .expect("run idemproxy check");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), printed)
}

/// The value after `flag` in an argument list.
fn argument<'a>(args: &'a Value, flag: &str) -> &'a str {
    let args: Vec<&str> = args
        .as_array()
        .expect("an argument list")
        .iter()
        .map(|arg| text(arg, "an argument"))
        .collect();
    let at = args
        .iter()
        .position(|arg| *arg == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args.get(at + 1).unwrap_or_else(|| panic!("nothing after {flag}"))
}

/// The numeric user the Dockerfile's runtime stage runs as.
fn image_user() -> u64 {
    let dockerfile = read("Dockerfile");
    let user = dockerfile
        .lines()
        .filter_map(|line| line.strip_prefix("USER "))
        .next_back()
        .expect("the Dockerfile sets USER");
    let (uid, _) = user.trim().split_once(':').expect("USER uid:gid");
    uid.parse()
        .unwrap_or_else(|_| panic!("USER {user} is not numeric: runAsNonRoot cannot verify a name"))
}

#[test]
fn the_compose_file_runs_its_config_with_redis_that_keeps_and_never_evicts_records() {
    let compose = one_yaml("deploy/compose/compose.yaml");
    let services = &compose["services"];
    let redis: Vec<&str> = services["redis"]["command"]
        .as_array()
        .expect("redis's command is a list")
        .iter()
        .map(|arg| text(arg, "a redis argument"))
        .collect();
    let flag = |name: &str| {
        redis
            .iter()
            .position(|arg| *arg == name)
            .and_then(|at| redis.get(at + 1))
            .copied()
    };
    assert_eq!(flag("--appendonly"), Some("yes"), "{redis:?}");
    assert_eq!(flag("--maxmemory-policy"), Some("noeviction"), "{redis:?}");
    assert!(
        services["upstream"]["volumes"][0]
            .as_str()
            .is_some_and(|volume| volume.starts_with("../../examples/upstream.py:"))
    );
    assert!(root().join("examples/upstream.py").exists());

    let proxy = &services["idemproxy"];
    let config_path = argument(&proxy["command"], "--config");
    let mounted = proxy["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|volume| text(volume, "a volume"))
        .find_map(|volume| volume.strip_prefix("./proxy.toml:")?.strip_suffix(":ro"))
        .expect("proxy.toml is mounted read-only");
    assert_eq!(mounted, config_path);
    let embedded = embedded(&read("deploy/compose/proxy.toml"), "deploy/compose/proxy.toml");
    assert!(embedded.check_output.contains("payments"), "{}", embedded.check_output);
    let secret = text(&proxy["secrets"][0], "the secret");
    assert_eq!(embedded.token_file, format!("/run/secrets/{secret}"));
    assert!(compose["secrets"][secret]["environment"].is_string());
    let config = &embedded.config;
    assert!(config.server.access_log);
    let ports: Vec<&str> = proxy["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|port| text(port, "a port"))
        .collect();
    let admin = config.admin.as_ref().expect("an admin listener");
    for port in [config.server.listen.port(), admin.listen.port()] {
        assert!(
            ports.iter().any(|mapping| mapping.ends_with(&format!(":{port}"))),
            "{port} is published: {ports:?}"
        );
    }
    assert_eq!(proxy["read_only"], true);
    assert_eq!(proxy["cap_drop"][0], "ALL");
    let stop = humantime::parse_duration(text(&proxy["stop_grace_period"], "stop_grace_period")).expect("a duration");
    assert!(stop > config.server.shutdown_grace, "{stop:?} leaves no time to drain");
}

#[test]
fn the_kubernetes_manifests_agree_with_their_config_and_the_image() {
    let kustomization = one_yaml("deploy/kubernetes/kustomization.yaml");
    let documents: Vec<Value> = kustomization["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .flat_map(|file| yaml(&format!("deploy/kubernetes/{}", text(file, "a resource"))))
        .collect();
    let of_kind = |kind: &str| -> &Value {
        let found: Vec<&Value> = documents.iter().filter(|document| document["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found.first().copied().unwrap_or(&Value::Null)
    };
    let (config_map, secret, deployment) = (of_kind("ConfigMap"), of_kind("Secret"), of_kind("Deployment"));
    let (service, budget) = (of_kind("Service"), of_kind("PodDisruptionBudget"));

    let embedded = embedded(
        text(&config_map["data"]["proxy.toml"], "the ConfigMap's proxy.toml"),
        "the ConfigMap's proxy.toml",
    );
    let config = &embedded.config;
    let pod = &deployment["spec"]["template"];
    let spec = &pod["spec"];
    let container = &spec["containers"][0];
    let mount = |volume_name: &str| -> String {
        let mounted = container["volumeMounts"]
            .as_array()
            .expect("volumeMounts")
            .iter()
            .find(|mount| mount["name"] == volume_name)
            .expect("the volume is mounted");
        assert_eq!(mounted["readOnly"], true);
        text(&mounted["mountPath"], "mountPath").to_string()
    };
    let config_volume = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|volume| volume["configMap"]["name"] == config_map["metadata"]["name"])
        .expect("the ConfigMap is a volume");
    let config_dir = mount(text(&config_volume["name"], "the volume's name"));
    assert_eq!(
        argument(&container["args"], "--config"),
        format!("{config_dir}/proxy.toml")
    );
    let secret_volume = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|volume| volume["secret"]["secretName"] == secret["metadata"]["name"])
        .expect("the Secret is a volume");
    let secret_dir = mount(text(&secret_volume["name"], "the volume's name"));
    let key = secret["stringData"]
        .as_object()
        .and_then(|data| data.keys().next())
        .expect("the Secret's key");
    assert_eq!(embedded.token_file, format!("{secret_dir}/{key}"));

    // The shipped Secret is a placeholder: left as it is, the proxy refuses to start.
    let dir = tempfile::tempdir().expect("temp dir");
    let empty = dir.path().join("token");
    std::fs::write(&empty, text(&secret["stringData"][key], "the token")).expect("write");
    let source = text(&config_map["data"]["proxy.toml"], "proxy.toml")
        .replace(&embedded.token_file, &empty.display().to_string());
    let file = dir.path().join("proxy.toml");
    std::fs::write(&file, source).expect("write");
    let (ok, printed) = check(&file);
    assert!(
        !ok && printed.contains("token_file"),
        "an empty token is refused: {printed}"
    );

    // Probes on the admin port, by name.
    let port = |name: &str| -> u64 {
        container["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|port| port["name"] == name)
            .and_then(|port| port["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("a container port named {name}"))
    };
    let admin = config.admin.as_ref().expect("an admin listener");
    assert_eq!(port("admin"), u64::from(admin.listen.port()));
    assert_eq!(port("http"), u64::from(config.server.listen.port()));
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(container[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(container[probe]["httpGet"]["port"], "admin", "{probe}");
    }
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"],
        port("admin").to_string()
    );

    // Non-root by number, as the image is; nothing writable, no capabilities.
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(spec["securityContext"]["runAsUser"].as_u64(), Some(image_user()));
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"][0], "ALL");
    for resource in ["cpu", "memory"] {
        assert!(
            container["resources"]["requests"][resource].is_string(),
            "{resource} request"
        );
    }

    // SIGTERM drains within the grace period, after the preStop pause.
    let grace = Duration::from_secs(spec["terminationGracePeriodSeconds"].as_u64().expect("a grace period"));
    let pause = Duration::from_secs(
        container["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_u64()
            .unwrap_or(0),
    );
    assert!(
        grace >= pause + config.server.shutdown_grace + Duration::from_secs(5),
        "{grace:?} does not cover the preStop pause {pause:?} and shutdown_grace {:?}",
        config.server.shutdown_grace
    );

    // The budget and the service select the pods.
    let labels = &pod["metadata"]["labels"];
    for selector in [
        &deployment["spec"]["selector"]["matchLabels"],
        &budget["spec"]["selector"]["matchLabels"],
        &service["spec"]["selector"],
    ] {
        let selector = selector.as_object().expect("a selector");
        assert!(!selector.is_empty());
        for (name, value) in selector {
            assert_eq!(&labels[name], value, "selector {name}");
        }
    }
    assert!(budget["spec"]["maxUnavailable"].as_u64().is_some_and(|max| max >= 1));
}

/// The series names and `label="value"` pairs the proxy exports: scraped from a
/// running proxy, with each family's sample names (`_total`, `_bucket`, ...).
async fn exported() -> (BTreeSet<String>, BTreeSet<String>) {
    let mut names = BTreeSet::new();
    let mut pairs = BTreeSet::new();
    let dir = tempfile::tempdir().expect("a temporary directory");
    for store in [StoreKind::Memory, StoreKind::Sqlite(dir.path().join("records.db"))] {
        let (more_names, more_pairs) = exported_with(store).await;
        names.extend(more_names);
        pairs.extend(more_pairs);
    }
    (names, pairs)
}

/// What one proxy on `store` exports: the names (with their suffixes) and the label pairs.
async fn exported_with(store: StoreKind) -> (BTreeSet<String>, BTreeSet<String>) {
    let upstream = support::Upstream::start().await;
    // With a shadow-mode route and a route with a probe, so that their counters exist.
    let mut config = TestConfig::new(store, &upstream.url());
    config.idempotency = "mode = \"shadow\"".into();
    config.extra_routes = format!(
        "[[route]]\nname = \"probed\"\npath_prefix = \"/v1/probed\"\nupstream = \"{}\"\n\n[route.idempotency]\n\n[route.idempotency.reconcile]\npath = \"/v1/probed/{{key}}\"\n",
        upstream.url()
    );
    let proxy = config.start().await;
    let metrics = send(proxy.admin(), "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics.body).to_string();
    let mut names = BTreeSet::new();
    let mut pairs = BTreeSet::new();
    for line in metrics.lines() {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            let (name, kind) = family.split_once(' ').expect("# TYPE name kind");
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|suffix| format!("{name}{suffix}")));
        } else if let Some((_, labels)) = line.split_once('{') {
            let labels = labels.split('}').next().unwrap_or_default();
            pairs.extend(labels.split(',').map(str::to_string));
        }
    }
    (names, pairs)
}

/// The `idemproxy_*` names and the `label="value"` pairs (for labels the proxy sets)
/// in a PromQL expression.
fn referenced(expr: &str) -> (Vec<String>, Vec<String>) {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let names = expr
        .split(|c: char| !is_name(c))
        .filter(|word| word.starts_with("idemproxy_"))
        .map(str::to_string)
        .collect();
    let mut pairs = Vec::new();
    for label in ["outcome", "op", "result", "backend"] {
        let mut rest = expr;
        while let Some(at) = rest.find(&format!("{label}=\"")) {
            let after = rest.get(at..).unwrap_or_default();
            let end = after
                .get(label.len() + 2..)
                .and_then(|value| value.find('"'))
                .expect("a closing quote");
            pairs.push(after.get(..label.len() + 3 + end).unwrap_or_default().to_string());
            rest = after.get(label.len() + 3 + end..).unwrap_or_default();
        }
    }
    (names, pairs)
}

fn assert_exported(expr: &str, what: &str, exported: &(BTreeSet<String>, BTreeSet<String>)) {
    let (names, pairs) = referenced(expr);
    for name in names {
        assert!(
            exported.0.contains(&name),
            "{what}: {name} is not a metric the proxy exports"
        );
    }
    for pair in pairs {
        assert!(exported.1.contains(&pair), "{what}: no series has {pair}");
    }
}

#[tokio::test]
async fn the_alert_rules_name_only_metrics_the_proxy_exports() {
    let exported = exported().await;
    let rules = one_yaml("deploy/prometheus/alerts.yaml");
    let mut alerts = BTreeSet::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let alert = text(&rule["alert"], "alert").to_string();
            let expr = text(&rule["expr"], "expr");
            assert_exported(expr, &alert, &exported);
            assert!(
                ["critical", "warning", "info"].contains(&text(&rule["labels"]["severity"], "severity")),
                "{alert}"
            );
            for annotation in ["summary", "description"] {
                assert!(
                    rule["annotations"][annotation].is_string(),
                    "{alert} has a {annotation}"
                );
            }
            if let Some(duration) = rule["for"].as_str() {
                humantime::parse_duration(duration).unwrap_or_else(|_| panic!("{alert}: for {duration}"));
            }
            assert!(alerts.insert(alert.clone()), "{alert} twice");
        }
    }
    // The failure modes the issue names, each with its rule.
    for needed in [
        "IdemproxyStoreErrors",
        "IdemproxyFencedWrites",
        "IdemproxyPendingReleases",
        "IdemproxyUnknownOutcomesRising",
    ] {
        assert!(alerts.contains(needed), "no {needed} rule");
    }
    // The check itself bites: a misspelt metric is caught.
    let (names, _) = referenced("rate(idemproxy_fenced_write_total[5m])");
    assert!(names.iter().any(|name| !exported.0.contains(name)));
}

#[tokio::test]
async fn the_dashboard_queries_only_metrics_the_proxy_exports() {
    let exported = exported().await;
    let dashboard: Value = serde_json::from_str(&read("deploy/grafana/idemproxy.json")).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8, "{} panels", panels.len());
    let mut ids = BTreeSet::new();
    for panel in panels {
        let title = text(&panel["title"], "title");
        assert!(ids.insert(panel["id"].as_u64().expect("an id")), "{title}: id reused");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        for target in targets {
            assert_exported(text(&target["expr"], "expr"), title, &exported);
        }
    }
    for variable in dashboard["templating"]["list"].as_array().expect("variables") {
        if let Some(query) = variable["query"].as_str() {
            assert_exported(query, "a variable", &exported);
        }
    }
}
