//! idemproxy: a reverse proxy that makes retries safe for HTTP APIs that were never
//! built for them. For each guarded request that carries an idempotency key it claims
//! the key in a store, forwards once, records the response and replays it to retries.
//!
//! Data flows one way: `server` -> `proxy` -> `router` -> `idempotency` -> `store`
//! -> `upstream`. The binary in `main.rs` only parses the command line.

#![forbid(unsafe_code)]

pub mod admin;
pub mod config;
pub mod error;
pub mod idempotency;
pub mod metrics;
pub mod proxy;
pub mod router;
pub mod server;
pub mod store;
pub mod upstream;

pub use config::Config;
pub use server::{Running, StoreFactory, start, start_with_store};
