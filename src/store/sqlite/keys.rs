//! Where each key's record is in the file, kept in memory (docs/design.md §27): the
//! records table has no index of its keys (schema step 6). The keys are hashes, so an
//! index of them put every fresh key's entry on a page of its own: each claim's commit
//! wrote about a page to the log for it, and the checkpoint wrote it again into the
//! file, some 10 KB of disk writes a fresh request (docs/performance.md). Without it a
//! claim appends its row to the table's last pages and its completion rewrites them.
//!
//! The index maps a 64-bit SipHash of the key (keyed at random when the store opens:
//! no client can aim two keys at one entry) to the rowids of the rows under that
//! hash, one almost always. Every read compares the row's key with its own
//! (`WHERE rowid = ?1 AND key = ?2`), so two keys that share a hash cost a second
//! read, never a wrong record. It is built from the file when the store opens (one
//! scan of the table's keys) and changed only by the writer: a write stages what it
//! changes (`Staged`); a write undone in its savepoint undoes its part, a transaction
//! rolled back forgets all of it, and a commit publishes it, before any caller of
//! that commit is answered, for the readers.
//!
//! Every row is in the index: each statement that inserts or deletes a row stages
//! it. Nothing else keeps a key to one live row (the table has no `UNIQUE` on it), so
//! a row the index did not know of could be claimed again: `tests/store.rs` runs every
//! path that inserts or deletes rows and checks the index against a scan of the file.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::{PoisonError, RwLock};

use rusqlite::Connection;

/// The index's shards: a shard that grows copies 1/64 of the index while it holds its
/// lock, not all of it (the memory store's stalls: docs/performance.md).
const SHARDS: usize = 64;

/// A key's hash, as the index keeps it.
pub(super) type Hash = u64;

/// The rowids under every key hash.
#[derive(Debug)]
pub(super) struct Keys {
    hasher: RandomState,
    shards: Box<[RwLock<Shard>]>,
}

/// The hashes are SipHash already: the shard's maps use them as they are.
type Hashed<V> = HashMap<Hash, V, BuildHasherDefault<AsIs>>;

#[derive(Debug, Default)]
struct Shard {
    /// Hashes with one row: almost all of them.
    one: Hashed<i64>,
    /// Hashes with more than one (two keys that share a hash).
    many: Hashed<Vec<i64>>,
}

/// A `Hasher` that takes a `u64` as its hash.
#[derive(Debug, Default)]
struct AsIs(u64);

impl Hasher for AsIs {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64`s are hashed here; anything else is folded in whole.
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

impl Keys {
    /// The index of every row the file holds, read with `conn`.
    pub(super) fn read(conn: &Connection) -> rusqlite::Result<Keys> {
        let keys = Keys {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
        };
        keys.fill(conn)?;
        Ok(keys)
    }

    fn fill(&self, conn: &Connection) -> rusqlite::Result<()> {
        let mut statement = conn.prepare("SELECT rowid, key FROM records")?;
        let mut rows = statement.query([])?;
        while let Some(row) = rows.next()? {
            let (rowid, key): (i64, String) = (row.get(0)?, row.get(1)?);
            let hash = self.hash(&key);
            let mut under = self.rows(hash);
            under.push(rowid);
            self.set(hash, under);
        }
        Ok(())
    }

    pub(super) fn hash(&self, key: &str) -> Hash {
        self.hasher.hash_one(key)
    }

    /// The rows under `hash`, as last committed.
    pub(super) fn rows(&self, hash: Hash) -> Vec<i64> {
        let shard = read(self.shard(hash));
        match shard.one.get(&hash) {
            Some(rowid) => vec![*rowid],
            None => shard.many.get(&hash).cloned().unwrap_or_default(),
        }
    }

    /// How many rows the index holds (for the tests that check it against the file).
    #[cfg(feature = "test-util")]
    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                let shard = read(shard);
                shard.one.len() + shard.many.values().map(Vec::len).sum::<usize>()
            })
            .sum()
    }

    fn set(&self, hash: Hash, rows: Vec<i64>) {
        let mut shard = write(self.shard(hash));
        match rows[..] {
            [] => {
                shard.one.remove(&hash);
                shard.many.remove(&hash);
            }
            [rowid] => {
                shard.many.remove(&hash);
                shard.one.insert(hash, rowid);
            }
            _ => {
                shard.one.remove(&hash);
                shard.many.insert(hash, rows);
            }
        }
    }

    fn shard(&self, hash: Hash) -> &RwLock<Shard> {
        // The top bits: the maps inside a shard take theirs from the bottom.
        &self.shards[(hash >> 58) as usize % SHARDS]
    }
}

fn read(shard: &RwLock<Shard>) -> std::sync::RwLockReadGuard<'_, Shard> {
    // Every change to a shard is whole before its lock is let go.
    shard.read().unwrap_or_else(PoisonError::into_inner)
}

fn write(shard: &RwLock<Shard>) -> std::sync::RwLockWriteGuard<'_, Shard> {
    shard.write().unwrap_or_else(PoisonError::into_inner)
}

/// What the writer's open transaction changed in the index, published at its commit.
#[derive(Debug, Default)]
pub(super) struct Staged {
    /// Each hash the transaction changed, with its rows as they are now.
    touched: HashMap<Hash, Vec<i64>>,
    /// What each change replaced, newest last: undone back to a mark.
    undo: Vec<(Hash, Option<Vec<i64>>)>,
}

impl Staged {
    /// The rows under `hash` as the open transaction sees them.
    pub(super) fn rows(&self, keys: &Keys, hash: Hash) -> Vec<i64> {
        match self.touched.get(&hash) {
            Some(rows) => rows.clone(),
            None => keys.rows(hash),
        }
    }

    /// A row was inserted under `hash`.
    pub(super) fn added(&mut self, keys: &Keys, hash: Hash, rowid: i64) {
        let mut rows = self.rows(keys, hash);
        rows.push(rowid);
        self.set(hash, rows);
    }

    /// A row was deleted from under `hash`.
    pub(super) fn removed(&mut self, keys: &Keys, hash: Hash, rowid: i64) {
        let mut rows = self.rows(keys, hash);
        rows.retain(|row| *row != rowid);
        self.set(hash, rows);
    }

    fn set(&mut self, hash: Hash, rows: Vec<i64>) {
        let was = self.touched.insert(hash, rows);
        self.undo.push((hash, was));
    }

    /// Where the changes stand now, to undo back to.
    pub(super) fn mark(&self) -> usize {
        self.undo.len()
    }

    /// Undoes the changes made since `mark`.
    pub(super) fn undo_to(&mut self, mark: usize) {
        while self.undo.len() > mark {
            if let Some((hash, was)) = self.undo.pop() {
                match was {
                    Some(rows) => self.touched.insert(hash, rows),
                    None => self.touched.remove(&hash),
                };
            }
        }
    }

    /// The transaction committed: its changes are what the readers see.
    pub(super) fn publish(&mut self, keys: &Keys) {
        for (hash, rows) in self.touched.drain() {
            keys.set(hash, rows);
        }
        self.undo.clear();
    }

    /// The transaction was rolled back: the index as last published holds.
    pub(super) fn forget(&mut self) {
        self.touched.clear();
        self.undo.clear();
    }
}
