//! What bounds a listener: how many connections it holds (the open-files limit, raised
//! at start, and `server.max_connections`), how long a connection may stay without a
//! request (`Activity`), and how it backs off when accepting fails. Nothing here reads
//! or writes a socket.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// File descriptors kept back from client connections: listeners, the store's and the
/// upstream pools' connections, log and config files.
const RESERVED_FILES: u64 = 256;

/// The open-files limit before and after the start raised it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenFiles {
    pub(crate) before: u64,
    pub(crate) after: u64,
}

/// Raises the soft open-files limit to the hard one, so that the process can hold as
/// many connections as the host allows it; `None` if the limit cannot be read.
pub(crate) fn raise_open_files_limit() -> Option<OpenFiles> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let before = limit.current?;
    let Some(hard) = limit.maximum else {
        // No hard limit: keep the soft one, which is a choice someone made.
        return Some(OpenFiles { before, after: before });
    };
    if hard <= before {
        return Some(OpenFiles { before, after: before });
    }
    let raised = rustix::process::Rlimit {
        current: Some(hard),
        maximum: Some(hard),
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => Some(OpenFiles { before, after: hard }),
        Err(error) => {
            tracing::warn!(%error, soft = before, hard, "cannot raise the open-files limit");
            Some(OpenFiles { before, after: before })
        }
    }
}

/// How many client connections a process holds at once: `max_connections`, or fewer
/// when the open-files limit could not hold them (each connection may need a second
/// descriptor for its upstream connection).
pub(crate) fn capacity(max_connections: usize, open_files: Option<OpenFiles>) -> usize {
    let Some(files) = open_files else {
        return max_connections;
    };
    let by_files = files.after.saturating_sub(RESERVED_FILES) / 2;
    max_connections
        .min(usize::try_from(by_files).unwrap_or(usize::MAX))
        .max(1)
}

// === accept back-off ===

/// Pauses between failed accepts: 10 ms, doubling to 1 s, reset by a success. A
/// failing accept (no file descriptor left, most often) would otherwise spin a core.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    pub(crate) fn new() -> Backoff {
        Backoff { next: Backoff::FIRST }
    }

    /// The pause before the next try after a failure.
    pub(crate) fn failed(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(Backoff::MAX);
        pause
    }

    pub(crate) fn succeeded(&mut self) {
        self.next = Backoff::FIRST;
    }
}

/// Accepts with `accept`, pausing after each failure as `backoff` says, until it
/// succeeds.
pub(crate) async fn accept_with_backoff<T, F, Fut>(backoff: &mut Backoff, mut accept: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<T>>,
{
    loop {
        match accept().await {
            Ok(accepted) => {
                backoff.succeeded();
                return accepted;
            }
            Err(error) => {
                // Usually EMFILE: no file descriptor left for the new connection.
                let pause = backoff.failed();
                tracing::warn!(%error, ?pause, "accept failed");
                tokio::time::sleep(pause).await;
            }
        }
    }
}

// === connection activity ===

/// When a connection last started or answered a request, and how many it is serving:
/// a connection serving none for `header_read_timeout` is closed, whatever its
/// protocol, including one that never sent a byte. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Activity {
    shared: Arc<ActivityState>,
}

#[derive(Debug)]
struct ActivityState {
    since: Instant,
    /// Milliseconds after `since` of the last start or answer.
    last: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    /// A connection accepted now.
    pub(crate) fn new() -> Activity {
        Activity {
            shared: Arc::new(ActivityState {
                since: Instant::now(),
                last: AtomicU64::new(0),
                in_flight: AtomicUsize::new(0),
            }),
        }
    }

    fn touch(&self) {
        let elapsed = u64::try_from(self.shared.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.shared.last.fetch_max(elapsed, Ordering::Relaxed);
    }

    /// A request has started; the returned guard marks its answer when dropped.
    pub(crate) fn request(&self) -> InFlight {
        self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        self.touch();
        InFlight { activity: self.clone() }
    }

    /// Resolves once the connection has served no request for `timeout`.
    pub(crate) async fn idle(&self, timeout: Duration) {
        loop {
            let last = self.shared.last.load(Ordering::Relaxed);
            tokio::time::sleep_until(self.shared.since + Duration::from_millis(last) + timeout).await;
            let busy = self.shared.in_flight.load(Ordering::Relaxed) > 0;
            if busy {
                // Time is counted from the answer, which has not come yet.
                self.touch();
            } else if self.shared.last.load(Ordering::Relaxed) == last {
                return;
            }
        }
    }
}

/// One request being served; dropping it (answered or abandoned) counts as activity.
#[derive(Debug)]
pub(crate) struct InFlight {
    activity: Activity,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.activity.touch();
        self.activity.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_to_a_second_and_resets() {
        let mut backoff = Backoff::new();
        let pauses: Vec<u128> = (0..9).map(|_| backoff.failed().as_millis()).collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        backoff.succeeded();
        assert_eq!(backoff.failed(), Duration::from_millis(10));
    }

    /// An accept that fails at once, forever (EMFILE), costs ten tries in two seconds,
    /// not a spinning core.
    #[tokio::test(start_paused = true)]
    async fn an_accept_error_storm_backs_off() {
        let mut tries = 0;
        let mut backoff = Backoff::new();
        let storm = accept_with_backoff(&mut backoff, || {
            tries += 1;
            std::future::ready(Err::<(), _>(std::io::Error::from_raw_os_error(24)))
        });
        assert!(tokio::time::timeout(Duration::from_secs(2), storm).await.is_err());
        assert!((8..=10).contains(&tries), "{tries} accepts in 2 s");
    }

    #[test]
    fn capacity_leaves_room_for_upstream_connections_and_the_rest() {
        let files = |after| Some(OpenFiles { before: 1024, after });
        assert_eq!(capacity(10_000, files(1_048_576)), 10_000);
        assert_eq!(capacity(10_000, files(1024)), (1024 - 256) / 2);
        assert_eq!(capacity(10_000, None), 10_000);
        assert_eq!(capacity(10_000, files(100)), 1, "never zero");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_after_a_quiet_timeout() {
        let activity = Activity::new();
        let timeout = Duration::from_secs(2);
        let started = Instant::now();
        // Nothing at all: idle two seconds after the accept.
        activity.idle(timeout).await;
        assert_eq!(started.elapsed(), timeout);

        // A request that takes 5 s: idle two seconds after its answer.
        let activity = Activity::new();
        let started = Instant::now();
        let request = activity.request();
        let answered = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(request);
        });
        activity.idle(timeout).await;
        answered.await.expect("request task");
        assert!(started.elapsed() >= Duration::from_secs(7), "{:?}", started.elapsed());
        assert!(started.elapsed() < Duration::from_secs(8), "{:?}", started.elapsed());
    }
}
