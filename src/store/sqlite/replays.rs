//! Recorded responses kept in memory for the replays that follow them. This process
//! owns the file (one process per file), and a completed record changes only when it
//! is purged or expires, so a response read once can answer its next retries without a
//! read transaction (each of which takes the log's shared-memory locks, a system call
//! apiece). Bounded by bytes, oldest first out; an entry is judged against its expiry
//! on every use, and a purge forgets it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use super::writer::Millis;
use crate::store::{Fingerprint, StoreKey, StoredResponse};

/// What an entry costs besides its response's bytes: its key twice, the map's and the
/// queue's slots.
const ENTRY_OVERHEAD: usize = 160;

#[derive(Debug)]
pub(super) struct Replays {
    max_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    kept: HashMap<StoreKey, Kept>,
    /// Keys in the order they were kept, each with the number it was kept under: an
    /// entry kept again or forgotten leaves its old number behind, skipped when it
    /// comes up.
    order: VecDeque<(u64, StoreKey)>,
    bytes: usize,
    next: u64,
    /// Moved by every purge: a response read before it is not kept after it.
    epoch: u64,
}

#[derive(Debug)]
struct Kept {
    number: u64,
    fingerprint: Fingerprint,
    expires_at: Millis,
    response: StoredResponse,
    size: usize,
}

/// The epoch a read began in: what it read may be kept only if no purge came since.
#[derive(Clone, Copy)]
pub(super) struct Ticket(u64);

impl Replays {
    pub(super) fn new(max_bytes: usize) -> Replays {
        Replays {
            max_bytes,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every change is whole before the lock is let go: a poisoned map is sound.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The recorded response for `key`, with the fingerprint it was recorded for, if it
    /// is kept and has not expired by `now`.
    pub(super) fn get(&self, key: &StoreKey, now: Millis) -> Option<(Fingerprint, StoredResponse)> {
        let inner = self.lock();
        let kept = inner.kept.get(key).filter(|kept| kept.expires_at > now)?;
        Some((kept.fingerprint, kept.response.clone()))
    }

    /// Taken before a read whose answer may be kept.
    pub(super) fn ticket(&self) -> Ticket {
        Ticket(self.lock().epoch)
    }

    /// Keeps a completed record read under `ticket`, unless a purge came since.
    pub(super) fn keep(
        &self,
        ticket: Ticket,
        key: &StoreKey,
        fingerprint: Fingerprint,
        expires_at: Millis,
        response: &StoredResponse,
    ) {
        let size = ENTRY_OVERHEAD + 2 * key.as_str().len() + response.size();
        if size > self.max_bytes / 8 {
            return;
        }
        let mut inner = self.lock();
        if inner.epoch != ticket.0 {
            return;
        }
        let number = inner.next;
        inner.next += 1;
        let kept = Kept {
            number,
            fingerprint,
            expires_at,
            response: response.clone(),
            size,
        };
        if let Some(old) = inner.kept.insert(key.clone(), kept) {
            inner.bytes -= old.size;
        }
        inner.bytes += size;
        inner.order.push_back((number, key.clone()));
        while inner.bytes > self.max_bytes
            && let Some((number, key)) = inner.order.pop_front()
        {
            inner.remove_if(&key, number);
        }
        // Numbers left behind by keys kept again: dropped once they outnumber the keys.
        if inner.order.len() > 2 * inner.kept.len() + 1024 {
            let Inner { kept, order, .. } = &mut *inner;
            order.retain(|(number, key)| kept.get(key).is_some_and(|kept| kept.number == *number));
        }
    }

    /// Forgets `key` once a purge of it has committed; reads begun before it are not
    /// kept.
    pub(super) fn forget(&self, key: &StoreKey) {
        let mut inner = self.lock();
        inner.epoch += 1;
        if let Some(old) = inner.kept.remove(key) {
            inner.bytes -= old.size;
        }
    }

    /// The bytes kept now, for tests.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

impl Inner {
    fn remove_if(&mut self, key: &StoreKey, number: u64) {
        if self.kept.get(key).is_some_and(|kept| kept.number == number)
            && let Some(old) = self.kept.remove(key)
        {
            self.bytes -= old.size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::StatusCode;

    fn response(body: usize) -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: Bytes::from(vec![b'x'; body]),
            trace: None,
            replay_until: None,
        }
    }

    fn fp(byte: u8) -> Fingerprint {
        Fingerprint::from_bytes(&[byte; 32]).expect("32 bytes")
    }

    fn key(name: &str) -> StoreKey {
        StoreKey::from_derived(format!("idemproxy:r:{{{name}}}"))
    }

    #[test]
    fn a_kept_response_answers_until_it_expires() {
        let replays = Replays::new(1 << 20);
        let ticket = replays.ticket();
        replays.keep(ticket, &key("a"), fp(7), 1_000, &response(10));
        let (fingerprint, kept) = replays.get(&key("a"), 999).expect("kept");
        assert_eq!(fingerprint, fp(7));
        assert_eq!(kept.body.len(), 10);
        assert!(replays.get(&key("a"), 1_000).is_none(), "expired at its expiry");
        assert!(replays.get(&key("b"), 0).is_none());
    }

    #[test]
    fn a_read_from_before_a_purge_is_not_kept_and_a_purge_forgets() {
        let replays = Replays::new(1 << 20);
        let before = replays.ticket();
        replays.keep(before, &key("a"), fp(1), 1_000, &response(10));
        replays.forget(&key("a"));
        assert!(replays.get(&key("a"), 0).is_none());
        replays.keep(before, &key("a"), fp(1), 1_000, &response(10));
        assert!(replays.get(&key("a"), 0).is_none(), "read before the purge");
        assert_eq!(replays.bytes(), 0);
    }

    #[test]
    fn the_oldest_go_first_and_the_bound_holds() {
        let entry = ENTRY_OVERHEAD + 2 * key("k-00").as_str().len() + 1000;
        let replays = Replays::new(10 * entry);
        for n in 0..25 {
            let ticket = replays.ticket();
            replays.keep(ticket, &key(&format!("k-{n:02}")), fp(0), 1_000, &response(1000));
            assert!(replays.bytes() <= 10 * entry);
        }
        assert!(replays.get(&key("k-14"), 0).is_none());
        assert!((15..25).all(|n| replays.get(&key(&format!("k-{n:02}")), 0).is_some()));
        // A response over an eighth of the bound is not kept at all.
        let ticket = replays.ticket();
        replays.keep(ticket, &key("big"), fp(0), 1_000, &response(2 * entry));
        assert!(replays.get(&key("big"), 0).is_none());
    }

    #[test]
    fn keeping_one_key_again_and_again_leaves_no_trail() {
        let replays = Replays::new(1 << 20);
        for _ in 0..10_000 {
            let ticket = replays.ticket();
            replays.keep(ticket, &key("a"), fp(0), 1_000, &response(10));
        }
        let inner = replays.lock();
        assert_eq!(inner.kept.len(), 1);
        assert!(inner.order.len() <= 1026, "{}", inner.order.len());
        assert_eq!(inner.bytes, inner.kept.values().map(|kept| kept.size).sum::<usize>());
    }
}
