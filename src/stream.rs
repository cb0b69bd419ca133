//! A response streamed to its client as the upstream sends it, and recorded as it
//! passes (docs/design.md §25): one `Recording` per streamed exchange, which the
//! exchange's task feeds and ends, and any number of `Reader`s (the first client, and
//! the retries that join it) that take its chunks from the start, each at its own pace.
//! A reader holds no copy: the chunks are shared, and their bytes are held of the byte
//! budget until the last reader lets go. `Streams` is where a retry finds a recording
//! of its key. No I/O here; the exchange decides what is recorded and when it ends.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use tokio::sync::Notify;

use crate::body::StreamedBody;
use crate::bounds::Held;
use crate::error::BoxError;
use crate::record::StoredResponse;
use crate::store::StoreKey;

/// How a stream broke, as every reader that had not reached its end is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Broken {
    /// The upstream reset the stream, or its connection broke, mid-body.
    #[error("the upstream's stream broke off")]
    Upstream,
    /// The upstream did not end the stream within the route's `upstream_timeout`.
    #[error("the upstream's stream did not end within {0:?}")]
    TimedOut(Duration),
    /// A reader that joined: the stream passed what may be recorded (or the byte
    /// budget), so only the first client gets the rest. A retry gets 409.
    #[error("the stream could not be recorded whole; only its first client gets the rest")]
    NotRecorded,
    /// The exchange ended without saying how: the proxy's own failure.
    #[error("the recording of the stream was abandoned")]
    Abandoned,
}

/// A chunk a recording could not take, and why.
#[derive(Debug)]
pub(crate) enum Refused {
    /// It would pass the record's cap (`max_response_body_bytes`).
    TooLarge(Bytes),
    /// The byte budget cannot hold it.
    OverBudget(Bytes),
}

/// How a recording ended.
#[derive(Debug, Clone, Copy)]
enum End {
    /// The whole body came, and the record says so.
    Whole,
    Broken(Broken),
    /// Not recorded past its chunks: the rest of the upstream's body is the first
    /// reader's alone.
    HandedOn,
}

/// What the exchange and the readers share.
struct Live {
    state: Mutex<State>,
    /// What a joining reader is answered with: the recorded status and fields, marked
    /// as replayed; its body is the stream.
    head: StoredResponse,
}

struct State {
    chunks: Vec<Bytes>,
    /// The bytes in `chunks`.
    bytes: u64,
    end: Option<End>,
    /// After `End::HandedOn`: the rest of the upstream's body, until the first reader
    /// takes it.
    rest: Option<StreamedBody>,
    /// The readers waiting for a chunk or the end.
    wakers: Vec<Waker>,
    /// The chunks' bytes, of the byte budget.
    held: Held,
}

impl Live {
    fn state(&self) -> MutexGuard<'_, State> {
        // A reader or the exchange that panicked holding the lock left nothing half
        // done: every change is one push or one assignment.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl State {
    fn wake(&mut self) {
        for waker in self.wakers.drain(..) {
            waker.wake();
        }
    }
}

/// The exchange's end of a streamed response: it pushes each chunk as it comes, and
/// ends it once. Dropped without an end (its task cancelled), every reader is told the
/// stream broke.
pub(crate) struct Recording {
    live: Arc<Live>,
}

impl Recording {
    /// A recording whose chunks hold their bytes in `held`, and the first client's
    /// reader of it. `head` is what a reader that joins is answered with.
    pub(crate) fn start(held: Held, head: StoredResponse) -> (Recording, Reader) {
        let live = Arc::new(Live {
            state: Mutex::new(State {
                chunks: Vec::new(),
                bytes: 0,
                end: None,
                rest: None,
                wakers: Vec::new(),
                held,
            }),
            head,
        });
        let first = Reader::new(live.clone(), true);
        (Recording { live }, first)
    }

    /// Records `chunk` and hands it to the readers, if the recording stays within
    /// `limit` bytes and the byte budget can hold it; else gives it back, saying which.
    pub(crate) fn push(&self, chunk: Bytes, limit: u64) -> Result<(), Refused> {
        let mut state = self.live.state();
        if state.bytes + chunk.len() as u64 > limit {
            return Err(Refused::TooLarge(chunk));
        }
        if !state.held.take(chunk.len() as u64) {
            return Err(Refused::OverBudget(chunk));
        }
        state.bytes += chunk.len() as u64;
        state.chunks.push(chunk);
        state.wake();
        Ok(())
    }

    /// The body recorded, in one allocation.
    pub(crate) fn body(&self) -> Bytes {
        let state = self.live.state();
        match state.chunks.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            chunks => {
                let mut body = BytesMut::with_capacity(usize::try_from(state.bytes).unwrap_or(0));
                for chunk in chunks {
                    body.extend_from_slice(chunk);
                }
                body.freeze()
            }
        }
    }

    /// The whole body came and the record holds it: every reader ends cleanly.
    pub(crate) fn whole(self) {
        self.end(End::Whole, None);
    }

    /// The stream broke: every reader ends with `broken` once it has the chunks before.
    pub(crate) fn broken(self, broken: Broken) {
        self.end(End::Broken(broken), None);
    }

    /// Past what may be recorded: the rest of the upstream's body (from the chunk that
    /// did not fit) goes to the first reader alone; a reader that joined ends with
    /// `Broken::NotRecorded`.
    /// `rest` is the upstream's body past `chunk`, already cut off at its deadline.
    pub(crate) fn hand_on(self, rest: StreamedBody) {
        self.end(End::HandedOn, Some(rest));
    }

    fn end(&self, end: End, rest: Option<StreamedBody>) {
        let mut state = self.live.state();
        if state.end.is_none() {
            state.end = Some(end);
            state.rest = rest;
        }
        state.wake();
    }

    /// Whether `live` is this recording's.
    fn is(&self, live: &Weak<Live>) -> bool {
        Weak::ptr_eq(&Arc::downgrade(&self.live), live)
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.end(End::Broken(Broken::Abandoned), None);
    }
}

/// One reader of a recording: the chunks from the first, then the rest live, then the
/// recording's end. The first client's reader takes the upstream's body on itself when
/// the recording hands it on.
pub(crate) struct Reader {
    live: Arc<Live>,
    next: usize,
    first: bool,
    rest: Option<StreamedBody>,
    done: bool,
}

impl Reader {
    fn new(live: Arc<Live>, first: bool) -> Reader {
        Reader {
            live,
            next: 0,
            first,
            rest: None,
            done: false,
        }
    }

    /// A reader of the same recording from its start, and the head it is answered
    /// with: a retry that joins the stream.
    fn joined(live: Arc<Live>) -> (StoredResponse, Reader) {
        (live.head.clone(), Reader::new(live, false))
    }
}

impl Body for Reader {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(rest) = this.rest.as_mut() {
            return Pin::new(rest).poll_frame(cx);
        }
        if this.done {
            return Poll::Ready(None);
        }
        let mut state = this.live.state();
        if let Some(chunk) = state.chunks.get(this.next) {
            let chunk = chunk.clone();
            this.next += 1;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        let broken = match state.end {
            None => {
                if !state.wakers.iter().any(|waker| waker.will_wake(cx.waker())) {
                    state.wakers.push(cx.waker().clone());
                }
                return Poll::Pending;
            }
            Some(End::Whole) => {
                this.done = true;
                return Poll::Ready(None);
            }
            Some(End::HandedOn) if this.first => match state.rest.take() {
                Some(rest) => {
                    drop(state);
                    let rest = this.rest.insert(rest);
                    return Pin::new(rest).poll_frame(cx);
                }
                None => Broken::Abandoned,
            },
            Some(End::HandedOn) => Broken::NotRecorded,
            Some(End::Broken(broken)) => broken,
        };
        this.done = true;
        Poll::Ready(Some(Err(broken.into())))
    }

    fn is_end_stream(&self) -> bool {
        match &self.rest {
            Some(rest) => rest.is_end_stream(),
            None => self.done,
        }
    }
}

/// The recordings of this process that a retry may join, by record: registered while
/// they stream. A retry on another instance waits for the record instead.
#[derive(Default)]
pub(crate) struct Streams {
    live: Mutex<HashMap<StoreKey, Weak<Live>>>,
    /// Woken when a recording is registered: a waiter that found the key in flight
    /// before its response began looks again.
    announced: Notify,
}

impl Streams {
    fn map(&self) -> MutexGuard<'_, HashMap<StoreKey, Weak<Live>>> {
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `recording` streams `key`'s response: retries of it may join.
    pub(crate) fn register(&self, key: &StoreKey, recording: &Recording) {
        self.map().insert(key.clone(), Arc::downgrade(&recording.live));
        self.announced.notify_waiters();
    }

    /// `recording` has ended: no retry joins it any more (one that has, reads on).
    pub(crate) fn unregister(&self, key: &StoreKey, recording: &Recording) {
        let mut map = self.map();
        if map.get(key).is_some_and(|live| recording.is(live)) {
            map.remove(key);
        }
    }

    /// A reader of `key`'s recording, from its start, and the head to answer it with,
    /// if this process is streaming it.
    pub(crate) fn join(&self, key: &StoreKey) -> Option<(StoredResponse, Reader)> {
        let live = self.map().get(key)?.upgrade()?;
        Some(Reader::joined(live))
    }

    /// What wakes a waiter when a recording is registered.
    pub(crate) fn announced(&self) -> &Notify {
        &self.announced
    }
}
