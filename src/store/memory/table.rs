//! The memory store's records, in shards: a hash map doubles its table when it fills,
//! copying every entry while the store's lock is held. One map of a million records
//! held that lock for hundreds of milliseconds at each doubling, and every request
//! waited behind it (a fresh-key p99 of 130 to 660 ms); a shard holds 1/256 of the
//! records, so one grows 1/256 as much at a time.

use std::hash::BuildHasher;

use foldhash::quality::RandomState;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::store::StoreKey;

const SHARDS: u64 = 256;

#[derive(Debug)]
pub(super) struct Table<V> {
    shards: Box<[HashTable<(StoreKey, V)>]>,
    /// One hash for each key, seeded per process (foldhash, as hashbrown's maps are):
    /// its middle bits pick the shard, and the shard's table takes its low and top
    /// bits. Two SipHash runs a lookup, one to pick the shard and one in the shard's
    /// map, were 2% of a fresh key's CPU. The keys are SHA-256 digests in hex, and
    /// the seed is drawn at start, so no client can aim keys at one bucket.
    hasher: RandomState,
    len: usize,
}

impl<V> Default for Table<V> {
    fn default() -> Self {
        Table {
            shards: (0..SHARDS).map(|_| HashTable::new()).collect(),
            hasher: RandomState::default(),
            len: 0,
        }
    }
}

impl<V> Table<V> {
    /// The key's hash, and the shard it picks.
    fn place(&self, key: &StoreKey) -> (usize, u64) {
        let hash = self.hasher.hash_one(key);
        // Below SHARDS, so it fits.
        (((hash >> 32) % SHARDS) as usize, hash)
    }

    pub(super) fn get(&self, key: &StoreKey) -> Option<&V> {
        let (shard, hash) = self.place(key);
        self.shards[shard]
            .find(hash, |(held, _)| held == key)
            .map(|(_, value)| value)
    }

    pub(super) fn get_mut(&mut self, key: &StoreKey) -> Option<&mut V> {
        let (shard, hash) = self.place(key);
        self.shards[shard]
            .find_mut(hash, |(held, _)| held == key)
            .map(|(_, value)| value)
    }

    pub(super) fn insert(&mut self, key: StoreKey, value: V) -> Option<V> {
        let (shard, hash) = self.place(&key);
        let hasher = &self.hasher;
        let entry = self.shards[shard].entry(hash, |(held, _)| *held == key, |(held, _)| hasher.hash_one(held));
        match entry {
            Entry::Occupied(mut held) => Some(std::mem::replace(&mut held.get_mut().1, value)),
            Entry::Vacant(free) => {
                free.insert((key, value));
                self.len += 1;
                None
            }
        }
    }

    pub(super) fn remove(&mut self, key: &StoreKey) -> Option<V> {
        let (shard, hash) = self.place(key);
        let held = self.shards[shard].find_entry(hash, |(held, _)| held == key).ok()?;
        self.len -= 1;
        Some(held.remove().0.1)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: usize) -> StoreKey {
        StoreKey::from_derived(format!("test:payments:{{{n}}}"))
    }

    #[test]
    fn it_counts_what_it_holds_across_its_shards() {
        let mut table = Table::default();
        for n in 0..1000 {
            assert_eq!(table.insert(key(n), n), None);
        }
        assert_eq!(table.insert(key(7), 70), Some(7), "a second insert replaces");
        assert_eq!(table.len(), 1000);
        assert!(table.shards.iter().filter(|shard| !shard.is_empty()).count() > 200);
        assert_eq!(table.get(&key(7)), Some(&70));
        *table.get_mut(&key(8)).expect("held") = 80;
        assert_eq!(table.remove(&key(8)), Some(80));
        assert_eq!(table.remove(&key(8)), None);
        assert_eq!(table.len(), 999);
        assert_eq!(table.get(&key(8)), None);
    }
}
