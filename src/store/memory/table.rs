//! The memory store's records, in shards: a hash map doubles its table when it fills,
//! copying every entry while the store's lock is held. One map of a million records
//! held that lock for hundreds of milliseconds at each doubling, and every request
//! waited behind it (a fresh-key p99 of 130 to 660 ms); a shard holds 1/256 of the
//! records, so one grows 1/256 as much at a time.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

use crate::store::StoreKey;

const SHARDS: u64 = 256;

#[derive(Debug)]
pub(super) struct Table<V> {
    shards: Box<[HashMap<StoreKey, V>]>,
    /// Which shard holds a key: seeded per process, like the maps' own hashers.
    router: RandomState,
    len: usize,
}

impl<V> Default for Table<V> {
    fn default() -> Self {
        Table {
            shards: (0..SHARDS).map(|_| HashMap::new()).collect(),
            router: RandomState::new(),
            len: 0,
        }
    }
}

impl<V> Table<V> {
    fn shard(&self, key: &StoreKey) -> usize {
        // Below SHARDS, so it fits.
        (self.router.hash_one(key) % SHARDS) as usize
    }

    pub(super) fn get(&self, key: &StoreKey) -> Option<&V> {
        self.shards[self.shard(key)].get(key)
    }

    pub(super) fn get_mut(&mut self, key: &StoreKey) -> Option<&mut V> {
        let shard = self.shard(key);
        self.shards[shard].get_mut(key)
    }

    pub(super) fn insert(&mut self, key: StoreKey, value: V) -> Option<V> {
        let shard = self.shard(&key);
        let old = self.shards[shard].insert(key, value);
        self.len += usize::from(old.is_none());
        old
    }

    pub(super) fn remove(&mut self, key: &StoreKey) -> Option<V> {
        let shard = self.shard(key);
        let old = self.shards[shard].remove(key);
        self.len -= usize::from(old.is_some());
        old
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
