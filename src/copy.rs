//! `idemproxy store copy --from A.toml --to B.toml`: every record of one store into
//! another (docs/design.md §26), through `store::moving`. It checks first that the
//! two configs can share records (not the same store, neither a memory store, the same
//! `key_prefix`, the same record keys where records are sealed), then reads the source
//! a page at a time and writes each page into the target, so that memory stays bounded
//! by one page. A key the target already holds keeps the target's record, and is
//! counted; so a copy that was interrupted is run again from the start, and skips what
//! it wrote before. Progress goes to stderr once a second; the summary says what was
//! and was not copied.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{Backend, Config};
use crate::error::StoreError;
use crate::store::moving::{CarriedState, Cursor};
use crate::store::{AnyStore, UnknownReason};

/// Records read and written a page at a time.
pub const PAGE: usize = 1000;
/// The least time a page's read or write is given.
const PAGE_TIMEOUT: Duration = Duration::from_secs(30);
/// How many times a page whose write failed is tried again before the copy stops.
const TRIES: u32 = 3;

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Copied {
    /// Live records read from the source.
    pub read: u64,
    /// Written into the target.
    pub written: u64,
    /// Kept as the target held them (copied before, or claimed there since).
    pub kept: u64,
    /// Of those written, records that were in flight and arrive unknown.
    pub in_flight: u64,
    pub elapsed: Duration,
}

impl fmt::Display for Copied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} records read, {} written ({} of them in flight, now unknown), {} kept as the target held them, in {:.1} s",
            self.read,
            self.written,
            self.in_flight,
            self.kept,
            self.elapsed.as_secs_f64()
        )
    }
}

/// Why a copy did not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{0}")]
    Refused(String),
    #[error("cannot open the {side} store: {source}")]
    Open { side: &'static str, source: StoreError },
    /// Stopped part way: what was copied until then, and why it stopped.
    #[error("stopped: {source}; until then {copied}. Run the copy again to finish: it skips what is there")]
    Stopped { copied: Copied, source: StoreError },
}

/// Whether records can move from `from` to `to`: refused with what to change.
pub fn check(from: &Config, to: &Config) -> Result<(), CopyError> {
    let refuse = |why: String| Err(CopyError::Refused(why));
    for (side, config) in [("--from", from), ("--to", to)] {
        if matches!(config.store.backend, Backend::Memory(_)) {
            return refuse(format!(
                "{side} names a memory store, which lives in its process: there is nothing to copy to or from"
            ));
        }
    }
    if format!("{:?}", from.store.backend) == format!("{:?}", to.store.backend) {
        return refuse("--from and --to name the same store".to_owned());
    }
    if from.store.key_prefix != to.store.key_prefix {
        return refuse(format!(
            "store.key_prefix differs ({:?} in --from, {:?} in --to): the target would not find the records copied",
            from.store.key_prefix, to.store.key_prefix
        ));
    }
    let keys = |config: &Config| {
        let mut ids: Vec<[u8; 32]> = config
            .store
            .encryption
            .iter()
            .flat_map(|encryption| std::iter::once(&encryption.current).chain(&encryption.previous))
            .map(|key| *key.bytes())
            .collect();
        ids.sort();
        ids
    };
    if keys(from) != keys(to) {
        return refuse(
            "[store.encryption] differs: both configs must name the same record keys (fingerprints are HMACs and \
             responses are sealed under them, and move as they are)"
                .to_owned(),
        );
    }
    Ok(())
}

/// Copies every live record of `from`'s store into `to`'s, telling `progress` how far
/// it has come about once a second.
pub async fn run(from: &Config, to: &Config, mut progress: impl FnMut(&Progress)) -> Result<Copied, CopyError> {
    check(from, to)?;
    let (source, source_tasks) = open("--from", from).await?;
    let (target, target_tasks) = open("--to", to).await?;
    let total = source.count().await.ok();
    let copied = pages(&source, &target, &from.store.key_prefix, total, &mut progress).await;
    source_tasks.stop().await;
    target_tasks.stop().await;
    copied
}

/// The store `config` names, and the tasks it runs until the copy ends. Each page
/// is given `PAGE_TIMEOUT` at least, whatever `store.timeout` gives a request.
async fn open(side: &'static str, config: &Config) -> Result<(AnyStore, crate::store::Background), CopyError> {
    let mut store = config.store.clone();
    store.timeout = store.timeout.max(PAGE_TIMEOUT);
    let opened = crate::store::open(&store)
        .await
        .map_err(|source| CopyError::Open { side, source })?;
    let store = (opened.factory)().map_err(|source| CopyError::Open { side, source })?;
    Ok((store, opened.background))
}

/// How far a copy has come.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub copied: &'a Copied,
    /// About how many records the source holds (Redis: every key of its database).
    pub total: Option<u64>,
}

impl fmt::Display for Progress<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let copied = self.copied;
        let rate = copied.read as f64 / copied.elapsed.as_secs_f64().max(0.001);
        write!(
            f,
            "{} records read ({} written, {} kept), {rate:.0} records/s",
            copied.read, copied.written, copied.kept
        )?;
        if let Some(total) = self.total.filter(|total| *total >= copied.read && rate > 0.0) {
            let left = (total - copied.read) as f64 / rate;
            write!(f, ", about {left:.0} s left of at most {total}")?;
        }
        Ok(())
    }
}

async fn pages(
    source: &AnyStore,
    target: &AnyStore,
    prefix: &str,
    total: Option<u64>,
    progress: &mut impl FnMut(&Progress),
) -> Result<Copied, CopyError> {
    let started = Instant::now();
    let mut told = started;
    let mut copied = Copied::default();
    // Each page is written while the next is read.
    let mut page = retried(|| source.export(prefix, &Cursor::Start, PAGE)).await;
    loop {
        let (records, cursor) = match page {
            Ok(page) => page,
            Err(source) => return Err(stopped(copied, started, source)),
        };
        let in_flight = records.iter().filter(|record| arrives_unknown(record)).count() as u64;
        let read = records.len() as u64;
        let write = retried(|| target.import(records.clone()));
        let imported = if cursor == Cursor::End {
            page = Ok((Vec::new(), Cursor::End));
            write.await
        } else {
            let (imported, next) = tokio::join!(write, retried(|| source.export(prefix, &cursor, PAGE)));
            page = next;
            imported
        };
        let imported = match imported {
            Ok(imported) => imported,
            Err(source) => return Err(stopped(copied, started, source)),
        };
        copied.read += read;
        copied.written += imported.written as u64;
        copied.kept += imported.kept as u64;
        // Each record in flight is written unless the target held the key.
        copied.in_flight += in_flight.min(imported.written as u64);
        copied.elapsed = started.elapsed();
        if told.elapsed() >= Duration::from_secs(1) {
            told = Instant::now();
            progress(&Progress { copied: &copied, total });
        }
        if cursor == Cursor::End {
            break;
        }
    }
    copied.elapsed = started.elapsed();
    Ok(copied)
}

/// Whether a record arrives unknown because it was in flight when read.
fn arrives_unknown(record: &crate::store::moving::Carried) -> bool {
    matches!(
        record.state,
        CarriedState::Unknown {
            reason: UnknownReason::MovedInFlight | UnknownReason::LeaseExpired,
            ..
        }
    )
}

fn stopped(mut copied: Copied, started: Instant, source: StoreError) -> CopyError {
    copied.elapsed = started.elapsed();
    CopyError::Stopped { copied, source }
}

/// `op`, tried again after a failure up to `TRIES` times in all, a second apart.
async fn retried<T, F, Fut>(mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut tries = 1;
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(error) if tries >= TRIES => return Err(error),
            Err(error) => {
                tracing::warn!(%error, "a page of the copy failed; trying it again");
                tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
