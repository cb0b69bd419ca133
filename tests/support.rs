//! Test support shared by every integration test: a real `redis-server` on a free
//! port, a fake upstream that counts executions per key and can hold a request until
//! the test releases it, the proxy started on `127.0.0.1:0`, and a plain HTTP client.
#![allow(dead_code, unused_imports, unreachable_pub)]

pub mod client;
pub mod collector;
pub mod disk;
pub mod h2raw;
pub mod history;
pub mod jwt;
pub mod model;
pub mod pki;
pub mod postgres_server;
pub mod protocol;
pub mod proxy;
pub mod redis_server;
pub mod relay;
pub mod storm;
pub mod topology;
pub mod upstream;

pub use client::{TestResponse, post_key, send, send_raw};
pub use postgres_server::PostgresServer;
pub use proxy::{ChildProxy, ProxyHandle, StoreKind, TestConfig, free_port};
pub use redis_server::RedisServer;
pub use relay::{Mode, Relay};
pub use upstream::Upstream;
