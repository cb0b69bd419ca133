//! idemproxy: a reverse proxy that makes retries safe for HTTP APIs that were never
//! built for them. For each guarded request that carries an idempotency key it claims
//! the key in a store, forwards once, records the response and replays it to retries.
//!
//! Data flows one way: `server` -> `proxy` -> `router` -> `idempotency` -> `store`
//! -> `upstream`. The binary in `main.rs` only parses the command line. The public
//! modules are what the binary and the tests need: the config, the errors, the record
//! rules and store, and `start`. Test seams sit behind the `test-util` feature.

#![forbid(unsafe_code)]

mod admin;
mod body;
pub mod config;
pub mod error;
pub mod idempotency;
mod metrics;
pub mod ops;
mod proxy;
pub mod record;
mod router;
pub mod scope;
pub mod server;
pub mod store;
pub mod tls;
mod upstream;

pub use config::Config;
pub use server::{Running, StartError, start};
#[cfg(feature = "test-util")]
pub use server::{StoreFactory, start_with_store};

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
}
