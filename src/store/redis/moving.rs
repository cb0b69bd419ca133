//! Moving records into and out of Redis (`store::moving`): a page of records by
//! `SCAN`, each read with its `PTTL` and the response kept beside it in one pipeline;
//! one read for a `[store.previous]` lookup; and a write by `import.lua`, only where
//! the key holds no record.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::{RedisStore, Retry, layout};
use crate::config::RedisTopology;
use crate::error::StoreError;
use crate::store::StoreKey;
use crate::store::moving::{self, Carried, Cursor, Imported};

/// How many imports are in flight at once.
const AT_ONCE: usize = 64;

/// Every record's key and what a pipeline reads of it: value, PTTL, response, its PTTL.
type Read = (Option<Vec<u8>>, i64, Option<Vec<u8>>, i64);

impl RedisStore {
    /// Up to about `limit` records whose keys start with `prefix:`, from `cursor`.
    /// Not on a cluster, whose keys are spread over its primaries.
    pub(crate) async fn export(
        &self,
        prefix: &str,
        cursor: &Cursor,
        limit: usize,
    ) -> Result<(Vec<Carried>, Cursor), StoreError> {
        if matches!(*self.topology, RedisTopology::Cluster { .. }) {
            return Err(StoreError::Unready(
                "copying from a Redis Cluster is not supported: copy from each primary as a standalone store",
            ));
        }
        let from = match cursor {
            Cursor::Start => 0,
            Cursor::Scan(at) => *at,
            Cursor::After(_) | Cursor::Row(_) | Cursor::End => return Ok((Vec::new(), Cursor::End)),
        };
        let pattern = format!("{}:*", glob_escaped(prefix));
        let (next, keys): (u64, Vec<String>) = self
            .attempt(Retry::Transient, self.timeout, |mut connection| {
                let pattern = &pattern;
                async move {
                    redis::cmd("SCAN")
                        .arg(from)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(limit)
                        .query_async(&mut connection)
                        .await
                }
            })
            .await?;
        let keys: Vec<StoreKey> = keys
            .into_iter()
            .map(StoreKey::from_derived)
            .filter(|key| key.route().is_some())
            .collect();
        let records = self.read_moving(&keys).await?;
        Ok((records, if next == 0 { Cursor::End } else { Cursor::Scan(next) }))
    }

    /// At most how many records it holds: every key of the database (responses kept
    /// beside their records, and other applications' keys, included).
    pub(crate) async fn count(&self) -> Result<u64, StoreError> {
        self.attempt(Retry::Transient, self.timeout, |mut connection| async move {
            redis::cmd("DBSIZE").query_async(&mut connection).await
        })
        .await
    }

    /// The record under `key`, as it would move.
    pub(crate) async fn carried(&self, key: &StoreKey) -> Result<Option<Carried>, StoreError> {
        Ok(self.read_moving(std::slice::from_ref(key)).await?.pop())
    }

    async fn read_moving(&self, keys: &[StoreKey]) -> Result<Vec<Carried>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let reads: Vec<Read> = self
            .attempt(Retry::Transient, self.timeout, |mut connection| async move {
                let mut pipeline = redis::pipe();
                for key in keys {
                    let beside = layout::response_key(key.as_str());
                    pipeline.cmd("GET").arg(key.as_str()).cmd("PTTL").arg(key.as_str());
                    pipeline.cmd("GET").arg(&beside).cmd("PTTL").arg(&beside);
                }
                pipeline.query_async(&mut connection).await
            })
            .await?;
        let mut records = Vec::with_capacity(keys.len());
        for (key, (value, pttl, response, response_pttl)) in keys.iter().zip(reads) {
            let record = layout::carried(
                key.clone(),
                value.map(Bytes::from),
                pttl,
                response.map(Bytes::from),
                response_pttl,
            )?;
            records.extend(record);
        }
        Ok(records)
    }

    /// Writes each record where its key holds none; the one `replacing` names may
    /// take over an in-flight claim that owner made.
    pub(crate) async fn import(
        &self,
        records: &[Carried],
        replacing: Option<crate::store::OwnerToken>,
    ) -> Result<Imported, StoreError> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, moving::millis);
        let replacing = replacing.map(crate::store::OwnerToken::to_hex).unwrap_or_default();
        let mut imported = Imported::default();
        let live: Vec<&Carried> = records.iter().filter(|record| !record.ttl.is_zero()).collect();
        // A batch is written `AT_ONCE` scripts at a time, each its own round trip on
        // the worker's multiplexed connections.
        for batch in live.chunks(AT_ONCE) {
            let writes = batch.iter().map(|record| self.import_one(record, now, &replacing));
            for written in futures_util::future::join_all(writes).await {
                match written? {
                    true => imported.written += 1,
                    false => imported.kept += 1,
                }
            }
        }
        Ok(imported)
    }
}

impl RedisStore {
    async fn import_one(&self, record: &Carried, now: i64, replacing: &str) -> Result<bool, StoreError> {
        let (value, beside) = layout::moved(record, now);
        let (response, response_ttl) = beside.unwrap_or_default();
        let mut invocation = self.scripts.import.key(record.key.as_str());
        invocation
            .arg(value)
            .arg(moving::millis(record.ttl).max(1))
            .arg(response)
            .arg(moving::millis(response_ttl.max(Duration::from_millis(1))))
            .arg(replacing)
            .arg(self.publish);
        Ok(self.invoke::<i64>(&invocation).await? == 1)
    }
}

/// `text` with the characters `SCAN … MATCH` treats as a pattern escaped.
fn glob_escaped(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        if matches!(character, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(character);
    }
    escaped
}
