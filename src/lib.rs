//! idemproxy: a reverse proxy that makes retries safe for HTTP APIs that were never
//! built for them. For each guarded request that carries an idempotency key it claims
//! the key in a store, forwards once, records the response and replays it to retries.
//!
//! `server` accepts connections and hands each request to `proxy`, the one module that
//! ties the others together: it asks `router` for the route (over the canonical path
//! `request_target` makes), `idempotency` (with `scope` and `jwt`) for the record and
//! the decision, `bounds` for a place among the guarded requests in flight, `store` to
//! claim and resolve the record, `upstream` to forward, and `stream` to record a
//! streamed response as it passes and let retries join it; it answers its own refusals
//! as `problem` rows say and counts in `metrics`. Below them sit the leaves that import
//! nothing upward: `config` and the values it owns, `error`, `problem`, `record`,
//! `body`, `canonical_json`, `tls`. `admin` serves health, metrics and the records API,
//! whose contract (`records`) the CLI shares. `contract` makes the published
//! idempotency contract from the config (the well-known document, OpenAPI, Markdown);
//! `conformance` runs that contract's black-box cases against any endpoint; `horizon`
//! estimates the store each route's `remember` holds at a rate (`check --rate`); `copy`
//! moves every record of one store into another (`store copy`). `trace`
//! makes the spans and exports them. A unit test below keeps the modules free of import
//! cycles. The binary in `main.rs` only parses the command line. Test seams sit behind
//! the `test-util` feature.

#![forbid(unsafe_code)]

/// An enum whose variants are the values of a metric label: each variant with its doc
/// and its label text, `ALL` in declaration order, `as_str`, and `#[repr(usize)]`, so
/// that a variant indexes the handles made for it. Defined before the modules, so each
/// of them can use it.
macro_rules! label_values {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$variant_meta:meta])* $variant:ident => $text:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
        #[repr(usize)]
        $vis enum $name {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $name {
            #[allow(dead_code)]
            pub(crate) const ALL: [$name; [$($text),+].len()] = [$($name::$variant),+];

            #[allow(dead_code)]
            pub(crate) fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }
    };
}

mod admin;
mod body;
mod bounds;
mod calls;
pub mod canonical_json;
pub mod config;
pub mod conformance;
pub mod contract;
pub mod copy;
mod cors;
pub mod error;
pub mod horizon;
pub mod idempotency;
pub mod jwt;
mod metrics;
mod problem;
mod proxy;
pub mod record;
pub mod records;
pub mod request_target;
mod router;
pub mod scope;
pub mod server;
pub mod store;
mod stream;
pub mod tls;
pub mod trace;
mod upstream;

pub use config::Config;

#[cfg(feature = "test-util")]
pub use server::start_with_store;
pub use server::{Running, StartError, start};
#[cfg(feature = "test-util")]
pub use store::StoreFactory;
pub use trace::ACCESS_LOG;

#[cfg(test)]
mod tests {
    /// Cargo.toml lists the test targets by hand (`autotests = false`, so that
    /// `tests/support.rs` is a module, not a test binary): a test file left out of the
    /// list would silently never run. Every `tests/*.rs` but `support.rs` must be listed.
    #[test]
    fn every_test_file_is_a_test_target() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("read Cargo.toml");
        let mut files: Vec<String> = std::fs::read_dir(root.join("tests"))
            .expect("list tests/")
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".rs") && name != "support.rs")
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no test files found");
        for file in files {
            let listed = format!("path = \"tests/{file}\"");
            assert!(
                manifest.contains(&listed),
                "tests/{file} is not a [[test]] in Cargo.toml, so it never runs"
            );
        }
    }

    /// The crate's modules, one per file (`proxy/exchange.rs` is `proxy::exchange`),
    /// and the code of each outside its tests (a `tests.rs` file, or the
    /// `#[cfg(test)] mod tests` that closes a file).
    fn modules() -> std::collections::BTreeMap<String, String> {
        fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for entry in std::fs::read_dir(dir).expect("list src/") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    files(&path, out);
                } else if path.extension().is_some_and(|ext| ext == "rs") {
                    out.push(path);
                }
            }
        }
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut all = Vec::new();
        files(&src, &mut all);
        let mut modules = std::collections::BTreeMap::new();
        for path in all {
            let relative = path.strip_prefix(&src).expect("under src/").with_extension("");
            let name = relative
                .components()
                .map(|part| part.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("::");
            if name == "lib" || name == "main" || name.ends_with("tests") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            let code = text
                .split("#[cfg(test)]\nmod tests {")
                .next()
                .unwrap_or_default()
                .to_string();
            modules.insert(name, code);
        }
        modules
    }

    /// Which modules each module names (`crate::a::b`, `super::x`, `self::y`, and the
    /// groups in braces), leaving out a module's own ancestors: a file may use what the
    /// module it belongs to defines.
    fn module_graph() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
        let modules = modules();
        let ident = |text: &str| -> String {
            text.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect::<String>()
                .trim_end_matches(':')
                .to_string()
        };
        // The longest module that `path` (under `base`) names.
        let resolve = |base: &str, path: &str| -> Option<String> {
            let full = if base.is_empty() {
                path.to_string()
            } else {
                format!("{base}::{path}")
            };
            let parts: Vec<&str> = full.split("::").collect();
            (1..=parts.len())
                .rev()
                .map(|n| parts[..n].join("::"))
                .find(|name| modules.contains_key(name))
        };
        let mut graph = std::collections::BTreeMap::new();
        for (from, code) in &modules {
            let parent = from.rsplit_once("::").map_or("", |(parent, _)| parent);
            let mut named = std::collections::BTreeSet::new();
            for (prefix, base) in [("crate::", ""), ("super::", parent), ("self::", from.as_str())] {
                for (at, _) in code.match_indices(prefix) {
                    // `crate::` inside `super::crate::` cannot occur; a prefix that is the
                    // tail of a longer path (`a::self::`) is not one.
                    if code[..at].ends_with("::")
                        || code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                    {
                        continue;
                    }
                    let rest = &code[at + prefix.len()..];
                    let paths: Vec<String> = match rest.strip_prefix('{') {
                        Some(group) => group
                            .split('}')
                            .next()
                            .unwrap_or_default()
                            .split(',')
                            .map(|item| ident(item.trim()))
                            .collect(),
                        None => vec![ident(rest)],
                    };
                    for path in paths.iter().filter(|path| !path.is_empty() && path.as_str() != "self") {
                        if let Some(to) = resolve(base, path) {
                            let ancestor = from == &to || from.starts_with(&format!("{to}::"));
                            if !ancestor {
                                named.insert(to);
                            }
                        }
                    }
                }
            }
            graph.insert(from.clone(), named);
        }
        graph
    }

    /// No module reaches itself through the modules it names, file by file: the layers
    /// (`problem`, `error` and the other leaves at the bottom, the proxy and the server
    /// at the top) stay layers, and no two files of one module lean on each other.
    #[test]
    fn no_import_cycle_between_modules() {
        let graph = module_graph();
        assert!(
            graph.get("proxy").is_some_and(|named| named.contains("store")),
            "{graph:?}"
        );
        assert!(
            graph
                .get("proxy::exchange")
                .is_some_and(|named| named.contains("proxy::send")),
            "files are modules: {graph:?}"
        );
        fn visit(
            node: &str,
            graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut std::collections::BTreeSet<String>,
        ) {
            if let Some(at) = path.iter().position(|seen| seen == node) {
                panic!("an import cycle: {} -> {node}", path[at..].join(" -> "));
            }
            if done.contains(node) {
                return;
            }
            path.push(node.to_string());
            for next in graph.get(node).into_iter().flatten() {
                visit(next, graph, path, done);
            }
            path.pop();
            done.insert(node.to_string());
        }
        let mut done = std::collections::BTreeSet::new();
        for node in graph.keys() {
            visit(node, &graph, &mut Vec::new(), &mut done);
        }
    }

    /// Every file that starts a task or a thread (`tokio::spawn(`, `thread::Builder`)
    /// outside its tests is named in `server.rs`'s list of what runs and what stops
    /// it, so that a new one cannot be left out of the map.
    #[test]
    fn every_file_that_spawns_is_in_the_servers_list_of_tasks() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let main = std::fs::read_to_string(src.join("main.rs")).expect("read main.rs");
        let mut spawning: Vec<String> = modules()
            .into_iter()
            .map(|(name, code)| (format!("{}.rs", name.replace("::", "/")), code))
            .chain(std::iter::once(("main.rs".to_string(), main)))
            .filter(|(_, code)| code.contains("tokio::spawn(") || code.contains("thread::Builder"))
            .map(|(file, _)| file)
            .collect();
        spawning.sort();
        let server = std::fs::read_to_string(src.join("server.rs")).expect("read server.rs");
        let list: String = server
            .lines()
            .take_while(|line| line.starts_with("//!"))
            .collect::<Vec<_>>()
            .join("\n");
        let missing: Vec<&String> = spawning
            .iter()
            .filter(|file| !list.contains(&format!("`{file}`")))
            .collect();
        assert!(spawning.len() >= 12, "only {spawning:?} found");
        assert!(missing.is_empty(), "not in server.rs's list of tasks: {missing:?}");
    }

    /// The hub and the server read as steps: no function in `src/proxy*` or
    /// `src/server*` is longer than 60 lines (its signature to its closing brace).
    #[test]
    fn no_function_in_the_proxy_or_the_server_is_over_60_lines() {
        let mut long = Vec::new();
        for (name, code) in modules() {
            if !(name == "proxy" || name == "server" || name.starts_with("proxy::") || name.starts_with("server::")) {
                continue;
            }
            let lines: Vec<&str> = code.lines().collect();
            for (at, line) in lines.iter().enumerate() {
                let trimmed = line.trim_start();
                let is_fn = [
                    "fn ",
                    "pub fn ",
                    "pub(crate) fn ",
                    "pub(super) fn ",
                    "async fn ",
                    "pub(crate) async fn ",
                    "pub(super) async fn ",
                    "pub async fn ",
                ]
                .iter()
                .any(|start| trimmed.starts_with(start));
                if !is_fn || trimmed.ends_with(';') {
                    continue;
                }
                let indent = line.len() - trimmed.len();
                let closing = " ".repeat(indent) + "}";
                let Some(end) = lines[at..].iter().position(|line| *line == closing) else {
                    continue;
                };
                if end + 1 > 60 {
                    long.push(format!("{name}: {} ({} lines)", trimmed, end + 1));
                }
            }
        }
        assert!(long.is_empty(), "functions over 60 lines:\n{}", long.join("\n"));
    }
}
