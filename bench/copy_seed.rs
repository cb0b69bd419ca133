//! Fills the store a config names with N completed records (realistic keys, a small
//! JSON response, an hour to live), a page of 5,000 at a time through the store's own
//! import: the source for `bench/copy.py`. Prints how long it took.
//!
//!     cargo run --release --example copy-seed -- CONFIG N

use std::time::Duration;

use bytes::Bytes;
use idemproxy::store::Fingerprint;
use idemproxy::store::moving::{Carried, CarriedState, RawResponse};
use tokio::time::Instant;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(config), Some(count)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: copy-seed CONFIG N");
    };
    let count: usize = count.parse()?;
    let config = idemproxy::Config::load(std::path::Path::new(&config))?;
    let store = idemproxy::store::open_for_tools(&config.store).await?;
    let started = Instant::now();
    let mut next = 0;
    while next < count {
        let page = (next..count.min(next + 5000))
            .map(record)
            .collect::<anyhow::Result<Vec<Carried>>>()?;
        next += page.len();
        store.import(page).await?;
    }
    println!("seeded {count} records in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn record(n: usize) -> anyhow::Result<Carried> {
    let key = idemproxy::idempotency::parse_key_value(format!("order-{n}").as_bytes())
        .map_err(|error| anyhow::anyhow!("a key: {error:?}"))?;
    Ok(Carried {
        key: idemproxy::idempotency::store_key("idemproxy", "payments", &[], &key),
        fingerprint: Fingerprint([7; 32]),
        ttl: Duration::from_secs(3600),
        response_ttl: None,
        state: CarriedState::Completed {
            status: 201,
            completed_at: None,
            response: Some(RawResponse {
                headers: Bytes::from_static(b"\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json"),
                body: Bytes::from(format!(
                    r#"{{"id":"pay_{n:012}","amount":100,"currency":"EUR","status":"paid"}}"#
                )),
            }),
        },
    })
}
