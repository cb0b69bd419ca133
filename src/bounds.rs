//! The process-wide bounds every worker shares: on guarded requests in flight, their
//! number (`server.max_guarded_requests`) and the bytes their bodies hold while they
//! are buffered (`server.max_buffered_bytes`), and on each route's reconciliation
//! probes at once (`max_concurrent`, which a reload may move); and the body of a replay,
//! which holds its bytes of the budget until the client has taken them. The proxy
//! takes a share or a place; the admin listener reports what is held. No I/O.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::error::{Bound, BoxError, Rejection};
use crate::metrics::Metrics;

/// What bounds the guarded requests in flight, process-wide (the workers share it):
/// their number (`max_guarded_requests`), and the bytes their bodies hold while they
/// are buffered (`max_buffered_bytes`): a request body as it is read (by its
/// `Content-Length` up front when it has one, chunk by chunk when it has not), a
/// response as it is read for recording. Request bodies may take three quarters of the
/// budget; the last quarter is kept for the responses of requests already forwarded,
/// which cannot be refused any more.
#[derive(Clone, Debug)]
pub(crate) struct GuardedRequests {
    permits: Arc<Semaphore>,
    max: usize,
    budget: Arc<Budget>,
}

#[derive(Debug)]
struct Budget {
    held: AtomicU64,
    max: u64,
}

impl Budget {
    /// Takes `bytes` if what is held stays at most `cap`.
    fn take(&self, bytes: u64, cap: u64) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= cap)
            })
            .is_ok()
    }
}

impl GuardedRequests {
    pub(crate) fn new(max: usize, max_bytes: u64) -> GuardedRequests {
        GuardedRequests {
            permits: Arc::new(Semaphore::new(max)),
            max,
            budget: Arc::new(Budget {
                held: AtomicU64::new(0),
                max: max_bytes,
            }),
        }
    }

    /// A share for one more guarded request, unless `max` are in flight.
    pub(crate) fn try_enter(&self) -> Result<Share, Rejection> {
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| Rejection::Overloaded(Bound::Requests(self.max)))?;
        Ok(Share {
            _permit: permit,
            held: Held {
                budget: self.budget.clone(),
                bytes: 0,
            },
        })
    }

    /// Reports the guarded requests in flight now, the bytes their bodies hold, and the
    /// bounds on both, in `metrics`.
    pub(crate) fn report(&self, metrics: &Metrics) {
        let in_flight = self.max - self.permits.available_permits();
        let held = self.budget.held.load(Ordering::Acquire);
        metrics.guarded(in_flight, self.max, held, self.budget.max);
    }
}

/// One guarded request's place among those in flight, and the bytes of the budget it
/// holds: all given back when it is dropped, once its bodies are recorded or handed on.
#[derive(Debug)]
pub(crate) struct Share {
    _permit: OwnedSemaphorePermit,
    held: Held,
}

impl Share {
    /// Takes `bytes` for the request body, unless request bodies would hold more than
    /// their three quarters of the budget.
    pub(crate) fn take_for_request(&mut self, bytes: u64) -> bool {
        let cap = self.held.budget.max / 4 * 3;
        self.held.take_within(bytes, cap)
    }

    /// Takes `bytes` for a response buffered for recording, unless the budget is spent.
    pub(crate) fn take_for_response(&mut self, bytes: u64) -> bool {
        self.held.take(bytes)
    }

    /// A hold on the budget apart from this request's place: for bytes that outlive the
    /// request (a streamed response's recording, which its readers share until the last
    /// lets go). It holds nothing yet.
    pub(crate) fn hold(&self) -> Held {
        Held {
            budget: self.held.budget.clone(),
            bytes: 0,
        }
    }
}

/// Bytes of the budget, given back when it is dropped: a guarded request's (in its
/// `Share`), or a streamed response's recording's (see `Share::hold`).
#[derive(Debug)]
pub(crate) struct Held {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Held {
    /// Takes `bytes` for a response read for recording, unless the budget is spent.
    pub(crate) fn take(&mut self, bytes: u64) -> bool {
        self.take_within(bytes, self.budget.max)
    }

    fn take_within(&mut self, bytes: u64, cap: u64) -> bool {
        let taken = self.budget.take(bytes, cap);
        if taken {
            self.bytes += bytes;
        }
        taken
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// How many probes of one route may run at once, and how many do: a bound that a
/// reload may move while probes hold their places.
#[derive(Debug, Default)]
pub(crate) struct ProbeLimit {
    /// (the bound, the probes running).
    places: Mutex<(usize, usize)>,
    freed: Notify,
}

impl ProbeLimit {
    pub(crate) fn set(&self, max: usize) {
        self.places.lock().unwrap_or_else(std::sync::PoisonError::into_inner).0 = max;
        self.freed.notify_waiters();
    }

    /// Waits for a place: fewer running than the bound as it is now.
    pub(crate) async fn acquire(self: &Arc<Self>) -> ProbePlace {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut places = self.places.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if places.1 < places.0 {
                    places.1 += 1;
                    return ProbePlace(self.clone());
                }
            }
            freed.await;
        }
    }
}

/// One probe's place among its route's `max_concurrent`, given back when dropped.
pub(crate) struct ProbePlace(Arc<ProbeLimit>);

impl Drop for ProbePlace {
    fn drop(&mut self) {
        self.0
            .places
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1 -= 1;
        self.0.freed.notify_waiters();
    }
}

/// A replay's body: the recorded bytes, handed on in chunks as the connection takes
/// them (HTTP/2 asks for the next only once the client's window allows), holding the
/// guarded request's `share` (its bytes of the budget) until the last is taken or the
/// client goes. So the bytes a client that does not read keeps the proxy holding count
/// in `max_buffered_bytes`.
pub(crate) struct HeldBody {
    rest: Bytes,
    share: Option<Share>,
}

/// The most one frame of a replay hands on at once.
const HELD_CHUNK: usize = 16 * 1024;

impl HeldBody {
    pub(crate) fn new(body: Bytes, share: Share) -> HeldBody {
        HeldBody {
            rest: body,
            share: Some(share),
        }
    }
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.rest.is_empty() {
            self.share = None;
            return Poll::Ready(None);
        }
        let take = self.rest.len().min(HELD_CHUNK);
        let chunk = self.rest.split_to(take);
        if self.rest.is_empty() {
            self.share = None;
        }
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.rest.len() as u64)
    }
}
