//! idemproxy: a reverse proxy that makes retries safe for HTTP APIs that were never
//! built for them. For each guarded request that carries an idempotency key it claims
//! the key in a store, forwards once, records the response and replays it to retries.
//!
//! `server` accepts connections and hands each request to `proxy`, the one module that
//! ties the others together: it asks `router` for the route, `idempotency` (with
//! `scope` and `jwt`) for the record and the decision, `store` to claim and resolve the
//! record, and `upstream` to forward. Below them sit the leaves that import nothing
//! upward: `config` and the values it owns, `error`, `record`, `body`,
//! `canonical_json`, `tls`. `admin` serves health, metrics and the records API, whose
//! contract (`records`) the CLI shares. `trace` makes the spans and exports them. A unit test below keeps the modules free of
//! import cycles. The binary in `main.rs` only parses the command line. Test seams sit
//! behind the `test-util` feature.

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
pub mod canonical_json;
pub mod config;
pub mod conformance;
pub mod contract;
pub mod error;
pub mod idempotency;
pub mod jwt;
mod metrics;
mod proxy;
pub mod record;
pub mod records;
mod router;
pub mod scope;
pub mod server;
pub mod store;
pub mod target;
pub mod tls;
pub mod trace;
mod upstream;

pub use config::Config;

/// The access log's `tracing` target (`server.access_log`): what the proxy writes its
/// lines under, and what the binary's filter keeps on.
pub const ACCESS_LOG: &str = "idemproxy::access";
#[cfg(feature = "test-util")]
pub use server::start_with_store;
pub use server::{Running, StartError, start};
#[cfg(feature = "test-util")]
pub use store::StoreFactory;

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

    /// The crate's top-level modules and the ones each names through `crate::`, in
    /// its code outside tests (a `tests.rs` file, or the `#[cfg(test)] mod tests`
    /// that closes a file).
    fn module_graph() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
        use std::collections::{BTreeMap, BTreeSet};
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
        let top = |path: &std::path::Path| {
            let relative = path.strip_prefix(&src).expect("under src/");
            let first = relative.components().next().expect("a component");
            first.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()
        };
        let modules: BTreeSet<String> = all
            .iter()
            .map(|path| top(path))
            .filter(|name| name != "lib" && name != "main")
            .collect();
        let ident = |text: &str| -> String {
            text.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for path in &all {
            let from = top(path);
            if !modules.contains(&from) || path.file_name().is_some_and(|name| name == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(path).expect("read a source file");
            let code = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or_default();
            for (at, _) in code.match_indices("crate::") {
                let rest = &code[at + "crate::".len()..];
                let named: Vec<String> = match rest.strip_prefix('{') {
                    // `crate::{a::X, b}`: every name in the group.
                    Some(group) => group
                        .split('}')
                        .next()
                        .unwrap_or_default()
                        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .map(str::to_string)
                        .collect(),
                    None => vec![ident(rest)],
                };
                for name in named {
                    if name != from && modules.contains(&name) {
                        graph.entry(from.clone()).or_default().insert(name);
                    }
                }
            }
        }
        graph
    }

    /// No top-level module reaches itself through `crate::` references: the layers
    /// (`error` and the leaves at the bottom, the proxy and the server at the top)
    /// stay layers.
    #[test]
    fn no_import_cycle_between_top_level_modules() {
        let graph = module_graph();
        assert!(
            graph.get("proxy").is_some_and(|named| named.contains("store")),
            "{graph:?}"
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
}
