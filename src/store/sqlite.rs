//! The durable embedded store: every record in one SQLite file that this process owns
//! (docs/design.md §21). The same lifecycle as the memory store and Redis, each step a
//! compare-and-set in one transaction, and every write on disk before its caller
//! hears of it: a claim before its request is forwarded, a response before it is
//! sent. Writes go through one writer thread that commits whatever is waiting as one
//! transaction (see `writer`); reads (a retry finding its record, an operator's view)
//! take a connection of their own and see the last commit, never waiting for the
//! writer. Times are on the wall clock, so that retention, leases and probe
//! schedules count across a restart. The file has no index of the keys: where each
//! key's row is, is kept in memory (`keys`), read from the file when it opens.
//!
//! Bounded as the memory store is: `max_records`, the per-scope and per-client shares
//! (counted in the file itself, written back with each commit: `shares`, so they hold
//! across restarts), and
//! `max_bytes`, which here bounds the file: SQLite refuses to grow it past that
//! (`max_page_count`), and new claims stop at seven eighths of it, so that the
//! responses of requests already forwarded still fit. Expired records are deleted in
//! the background and their pages reused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use self::file::FileLock;
use self::keys::Keys;
use self::shares::Counted;
use self::writer::{Clock, Millis, Tx, Wait, Writer, disk};
use super::lifecycle::{self, Change, Schedule, Share};
use super::notify::{Hub, Watcher};
use super::{
    Background, ClaimOutcome, ClaimRequest, ClientId, CommitFigures, Deferred, Existing, Fingerprint, Handles,
    OwnerToken, ProbeSchedule, ProbeStart, RecordState, RecordStore, RecordSummary, Resolution, Resolved, ScopeId,
    Spent, Started, StoreKey, StoreUsage, StoredResponse, SummaryState, UnknownReason, Unsettled, Write,
};
use crate::config::{SqliteConfig, StoreLimits};
use crate::error::{Held, StoreError};

mod file;
mod keys;
mod moving;
mod replays;
mod shares;
mod writer;

#[cfg(feature = "test-util")]
pub use self::file::create_at_version;

pub use self::file::{APPLICATION_ID, VERSION};

/// What one record costs besides its key and response, as the per-scope byte share
/// counts it (the same estimate as the memory store's).
const RECORD_OVERHEAD: usize = 160;
/// Read connections kept open between reads; each caches `cache_bytes / 16`.
const KEPT_READERS: usize = 8;
/// Most expired records a claim deletes to make room before it is refused.
const ROOM_BATCH: i64 = 10_000;
/// Most unsettled records listed at start for their probes.
const MAX_UNSETTLED: i64 = 65_536;

#[derive(Clone, Debug)]
pub struct SqliteStore {
    shared: Arc<Shared>,
    /// Where a claim that read a completed record stops before it keeps the response.
    #[cfg(feature = "test-util")]
    read_pause: Option<ReadPause>,
}

/// Where a claim that read a completed record from the file stops before it keeps the
/// response in memory, for a test that purges the record in between (`test-util`).
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Default)]
pub struct ReadPause {
    /// Told when a claim has read a completed record.
    pub reached: Arc<tokio::sync::Notify>,
    /// Waited for before the claim keeps what it read.
    pub resume: Arc<tokio::sync::Notify>,
}

#[derive(Debug)]
struct Shared {
    // Dropped in this order: the writer (its thread finishes and closes the file), the
    // readers, and last the lock, so that no other process opens the file before this
    // one has let go of it.
    writer: Writer,
    readers: Mutex<Vec<Connection>>,
    /// Where each key's row is (keys.rs): changed by the writer, read by every read.
    keys: Arc<Keys>,
    /// Recorded responses read lately, for their next replays.
    replays: replays::Replays,
    path: PathBuf,
    limits: StoreLimits,
    reader_cache_kib: i64,
    /// Claims stop once the file's pages in use reach this many.
    admit_pages: i64,
    page_size: i64,
    /// What claims in flight may still write, kept as room in the file.
    reserved: Arc<Mutex<Reserved>>,
    timeout: Duration,
    hub: Arc<Hub>,
    clock: Clock,
    stats: CommitFigures,
    _lock: FileLock,
}

/// A record as its row holds it.
struct Row {
    rowid: i64,
    /// The scope its shares count it under, as the row keeps it.
    scope: Option<i64>,
    fingerprint: Fingerprint,
    expires_at: Millis,
    /// When a completed record's response is dropped (`None`: with the record).
    response_until: Option<Millis>,
    state: RowState,
}

impl Row {
    /// Whether its response is past its retention at `now` (dropped, or about to be).
    fn spent(&self, now: Millis) -> bool {
        self.response_until.is_some_and(|until| until <= now)
    }
}

/// A `DELETE` that returns what the shares count of each record it deleted.
macro_rules! deleting {
    ($sql:literal) => {
        concat!(
            $sql,
            " RETURNING scope, client, size, state = 'completed' AND body IS NULL AND response_until IS NOT NULL, \
             rowid, key"
        )
    };
}
use deleting;

/// Drops the responses of up to `limit` records past their retention (their headers
/// and body go, and their size is the record's without them: `record_size`), for the
/// sweeper: how many it dropped.
fn drop_responses(tx: &Tx<'_>, now: Millis, limit: i64) -> Result<usize, StoreError> {
    let found: Vec<(i64, i64, Option<i64>, i64)> = tx
        .prepare_cached(
            "SELECT rowid, length(key), scope, size FROM records \
             WHERE response_until <= ?1 AND body IS NOT NULL LIMIT ?2",
        )
        .and_then(|mut statement| {
            statement
                .query_map((now, limit), |row| {
                    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
                })?
                .collect()
        })
        .map_err(|error| disk(&error, false))?;
    let mut shares = tx.shares.borrow_mut();
    for (rowid, key_length, scope, size) in &found {
        let without = i64::try_from(RECORD_OVERHEAD)
            .unwrap_or(i64::MAX)
            .saturating_add(*key_length);
        execute(
            tx,
            "UPDATE records SET headers = NULL, body = NULL, size = ?2 WHERE rowid = ?1",
            params![rowid, without],
        )?;
        let counted = shares
            .resized(tx, *scope, without - size)
            .and_then(|()| shares.spent(tx));
        counted.map_err(|error| disk(&error, false))?;
    }
    Ok(found.len())
}

/// Deletes up to `limit` expired records, the first to expire first: how many.
fn delete_expired(tx: &Tx<'_>, now: Millis, limit: i64) -> Result<usize, StoreError> {
    delete(
        tx,
        deleting!(
            "DELETE FROM records WHERE rowid IN \
             (SELECT rowid FROM records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)"
        ),
        (now, limit),
    )
}

/// Runs a `deleting!` statement, and takes what it deleted off the shares: how many.
fn delete(tx: &Tx<'_>, sql: &str, params: impl rusqlite::Params) -> Result<usize, StoreError> {
    let mut statement = tx.prepare_cached(sql).map_err(|error| disk(&error, false))?;
    let mut rows = statement.query(params).map_err(|error| disk(&error, false))?;
    let mut shares = tx.shares.borrow_mut();
    let mut deleted = 0;
    while let Some(row) = rows.next().map_err(|error| disk(&error, false))? {
        let read = |row: &rusqlite::Row<'_>| -> rusqlite::Result<(Counted, i64, bool, i64, String)> {
            Ok((
                Counted {
                    scope: row.get(0)?,
                    client: row.get(1)?,
                },
                row.get(2)?,
                row.get(3)?,
                row.get(4)?,
                row.get(5)?,
            ))
        };
        let (counted, size, spent, rowid, key) = read(row).map_err(|error| disk(&error, false))?;
        tx.deleted(&key, rowid);
        shares
            .removed(tx, counted, size, spent)
            .map_err(|error| disk(&error, false))?;
        deleted += 1;
    }
    Ok(deleted)
}

/// Deletes `key`'s record, if any: whether there was one.
fn delete_key(tx: &Tx<'_>, key: &StoreKey) -> Result<bool, StoreError> {
    let mut deleted = 0;
    for rowid in tx.rows(key.as_str()) {
        deleted += delete(
            tx,
            deleting!("DELETE FROM records WHERE rowid = ?1 AND key = ?2"),
            params![rowid, key.as_str()],
        )?;
    }
    Ok(deleted > 0)
}

/// Where a row's record stands: what it completed with is kept in its columns.
type RowState = lifecycle::State<Millis, Completed>;

/// A completed row's response, as its columns keep it.
struct Completed {
    status: i64,
    /// When the operation completed (`None`: written before this was kept).
    completed_at: Option<Millis>,
    headers: Vec<u8>,
    /// The body, or only its length where the read did not ask for it.
    body: Body,
}

enum Body {
    Bytes(Vec<u8>),
    Length(u64),
}

impl Completed {
    /// What a claim reads: the response, or past its retention what is left.
    fn state(self, spent: bool) -> Result<RecordState, StoreError> {
        if spent {
            return Ok(RecordState::Spent(self.spent()?));
        }
        Ok(RecordState::Completed(self.response()?))
    }

    /// What the guard reads of it past its retention.
    fn spent(&self) -> Result<Spent, StoreError> {
        Spent::kept(self.status, self.completed_at).ok_or(StoreError::Protocol(
            "a recorded status in the store's file does not decode",
        ))
    }

    /// The response, body and all.
    fn response(self) -> Result<StoredResponse, StoreError> {
        match self.body {
            Body::Bytes(body) => response(self.status, &self.headers, body),
            Body::Length(_) => Err(StoreError::Protocol("a replay read without its body")),
        }
    }

    /// What an operator sees of it.
    fn summary(self, spent: bool) -> Result<SummaryState, StoreError> {
        if spent {
            return Ok(SummaryState::Spent(self.spent()?));
        }
        let trace = response(self.status, &self.headers, Vec::new())?.trace;
        Ok(SummaryState::Completed {
            status: u16::try_from(self.status).unwrap_or(0),
            response_bytes: match self.body {
                Body::Length(length) => length,
                Body::Bytes(body) => body.len() as u64,
            },
            trace_id: trace.map(crate::record::ExecutionTrace::trace_id_hex),
        })
    }
}

fn millis(duration: Duration) -> Millis {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 4)
}

/// How long from `now` until `then` (zero once it has passed).
fn until(now: Millis, then: Millis) -> Duration {
    Duration::from_millis(u64::try_from(then - now).unwrap_or(0))
}

const ROW: &str = "SELECT fingerprint, expires_at, state, owner, lease_until, status, headers, body, reason, \
                   probe_due, probe_give_up, response_until, completed_at, scope FROM records \
                   WHERE rowid = ?1 AND key = ?2";
const ROW_HEAD: &str = "SELECT fingerprint, expires_at, state, owner, lease_until, status, headers, length(body), \
                        reason, probe_due, probe_give_up, response_until, completed_at, scope FROM records \
                        WHERE rowid = ?1 AND key = ?2";

/// The record under `key`, expired or not, in the writer's transaction; `body`: with
/// its body, else its length.
fn load(tx: &Tx<'_>, key: &StoreKey, body: bool) -> Result<Option<Row>, StoreError> {
    load_from(tx, &tx.rows(key.as_str()), key, body)
}

/// The record under `key`, expired or not, on a read connection. The index is read
/// before the file: should the key's row have been deleted and written again between
/// the two (a release and a new claim), the rowid read is gone and the index is read
/// again, so that a read never finds a key absent that was never so.
fn load_read(conn: &Connection, keys: &Keys, key: &StoreKey, body: bool) -> Result<Option<Row>, StoreError> {
    let hash = keys.hash(key.as_str());
    let mut rows = keys.rows(hash);
    for _ in 0..3 {
        let found = load_from(conn, &rows, key, body)?;
        let now = keys.rows(hash);
        if found.is_some() || now == rows {
            return Ok(found);
        }
        rows = now;
    }
    load_from(conn, &rows, key, body)
}

/// The record under `key` among the rows `rows` (those under its hash).
fn load_from(conn: &Connection, rows: &[i64], key: &StoreKey, body: bool) -> Result<Option<Row>, StoreError> {
    for rowid in rows {
        if let Some(row) = load_row(conn, *rowid, key, body)? {
            return Ok(Some(row));
        }
    }
    Ok(None)
}

fn load_row(conn: &Connection, rowid: i64, key: &StoreKey, body: bool) -> Result<Option<Row>, StoreError> {
    let mut statement = conn
        .prepare_cached(if body { ROW } else { ROW_HEAD })
        .map_err(|error| disk(&error, false))?;
    let row = statement
        .query_row(params![rowid, key.as_str()], |row| {
            let blob = |index: usize| row.get::<_, Option<Vec<u8>>>(index);
            let state: String = row.get(2)?;
            let owner = blob(3)?.and_then(|owner| OwnerToken::from_bytes(&owner));
            let decoded = match (state.as_str(), owner) {
                ("in_flight", Some(owner)) => row
                    .get::<_, Option<i64>>(4)?
                    .map(|lease_until| RowState::InFlight { owner, lease_until }),
                ("completed", _) => match row.get::<_, Option<i64>>(5)? {
                    None => None,
                    Some(status) => Some(RowState::Completed(Completed {
                        status,
                        completed_at: row.get(12)?,
                        headers: blob(6)?.unwrap_or_default(),
                        body: match body {
                            true => Body::Bytes(blob(7)?.unwrap_or_default()),
                            false => {
                                Body::Length(row.get::<_, Option<i64>>(7)?.map_or(0, |length| length.unsigned_abs()))
                            }
                        },
                    })),
                },
                ("unknown", Some(owner)) => {
                    let reason: String = row.get(8)?;
                    let (due, give_up) = (row.get::<_, Option<i64>>(9)?, row.get::<_, Option<i64>>(10)?);
                    UnknownReason::parse(reason.as_bytes()).map(|reason| RowState::Unknown {
                        reason,
                        owner,
                        schedule: give_up.map(|give_up_at| Schedule { due, give_up_at }),
                    })
                }
                _ => None,
            };
            let fingerprint = Fingerprint::from_bytes(&row.get::<_, Vec<u8>>(0)?);
            let expires_at: i64 = row.get(1)?;
            let response_until: Option<i64> = row.get(11)?;
            let scope: Option<i64> = row.get(13)?;
            Ok(decoded.zip(fingerprint).map(|(state, fingerprint)| Row {
                rowid,
                scope,
                fingerprint,
                expires_at,
                response_until,
                state,
            }))
        })
        .optional()
        .map_err(|error| disk(&error, false))?;
    match row {
        None => Ok(None),
        Some(None) => Err(StoreError::Protocol("a record in the store's file does not decode")),
        Some(Some(row)) => Ok(Some(row)),
    }
}

/// The response a completed row holds.
fn response(status: i64, headers: &[u8], body: Vec<u8>) -> Result<StoredResponse, StoreError> {
    StoredResponse::decode(status.to_string().as_bytes(), headers, Bytes::from(body)).ok_or(StoreError::Protocol(
        "a recorded response in the store's file does not decode",
    ))
}

/// What a claim finds in a live record.
fn existing(row: Row, claimant: OwnerToken, now: Millis) -> Result<ClaimOutcome, StoreError> {
    let spent = row.spent(now);
    lifecycle::claim(row.fingerprint, row.state, claimant, now, |completed| {
        completed.state(spent)
    })
}

/// The bytes a record counts against its scope's share.
fn record_size(key: &StoreKey, response: Option<&StoredResponse>) -> i64 {
    let size = RECORD_OVERHEAD + key.as_str().len() + response.map_or(0, StoredResponse::size);
    i64::try_from(size).unwrap_or(i64::MAX)
}

/// What one share holds: (records, bytes). The `shares` table keeps each under its
/// kind (0: the store, 1: a scope, 2: a client address) and its id.
fn share(conn: &Connection, share: Share) -> Result<(i64, i64), StoreError> {
    shares::read(conn, shares::row(share)).map_err(|error| disk(&error, false))
}

/// The file's pages in use: its pages less the free ones, in one cached statement (on
/// the writer, every claim asks; two pragma statements were about 7% of its time).
fn used_pages(conn: &Connection) -> Result<i64, StoreError> {
    conn.prepare_cached("SELECT page_count - freelist_count FROM pragma_page_count(), pragma_freelist_count()")
        .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
        .map_err(|error| disk(&error, false))
}

fn execute(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<usize, StoreError> {
    conn.prepare_cached(sql)
        .and_then(|mut statement| statement.execute(params))
        .map_err(|error| disk(&error, false))
}

/// How long until the first of the records `column` = `id` expires (at least 1 s).
fn first_expiry(conn: &Connection, column: &str, id: i64, now: Millis) -> Result<Duration, StoreError> {
    let sql = format!("SELECT min(expires_at) FROM records WHERE {column} = ?1");
    let first: Option<i64> = conn
        .prepare_cached(&sql)
        .and_then(|mut statement| statement.query_row([id], |row| row.get(0)))
        .map_err(|error| disk(&error, false))?;
    Ok(first
        .map_or(Duration::ZERO, |first| until(now, first))
        .max(Duration::from_secs(1)))
}

/// How long until the first record expires and its room is free (at least 1 s).
fn space_due(conn: &Connection, now: Millis) -> Result<Duration, StoreError> {
    let first: Option<i64> = conn
        .prepare_cached("SELECT min(expires_at) FROM records")
        .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
        .map_err(|error| disk(&error, false))?;
    Ok(first
        .map_or(Duration::ZERO, |first| until(now, first))
        .max(Duration::from_secs(1)))
}

/// The process's SQLite store (`SqliteStore::open`), shared by every worker; its writer
/// and checkpointer threads end with its last handle.
pub(crate) fn open(config: &SqliteConfig, timeout: Duration) -> Result<Started<SqliteStore>, StoreError> {
    let store = SqliteStore::open(config, timeout)?;
    Ok(Started {
        watcher: store.watcher(),
        handles: Handles::Shared(store),
        background: Background::default(),
    })
}

impl SqliteStore {
    /// Opens (or creates) the store's file, under its lock, and starts its writer.
    /// Refuses a file that is not this store's, naming it and leaving it as it is.
    pub fn open(config: &SqliteConfig, timeout: Duration) -> Result<SqliteStore, StoreError> {
        let lock = file::lock(&config.path)?;
        let conn = file::open(&config.path)?;
        let setup = |conn: &Connection| -> rusqlite::Result<(i64, i64)> {
            // A commit writes the log; the syncer fsyncs it before any caller hears
            // (writer.rs). A checkpoint still fsyncs the log before it copies it.
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.pragma_update(None, "busy_timeout", 5000)?;
            conn.pragma_update(None, "temp_store", "MEMORY")?;
            // A cleared value (a probe key, a response purged) is zeroed in its page
            // where that costs no I/O of its own.
            conn.pragma_update(None, "secure_delete", "FAST")?;
            // The writer's statements name each state they write as a literal (here
            // and in moving.rs); the file's `CHECK (state IN (...))` still holds every
            // other connection to the three. On the writer it built a temporary table
            // of them on every insert and update: about 9% of its time.
            conn.pragma_update(None, "ignore_check_constraints", true)?;
            conn.pragma_update(None, "mmap_size", 0)?;
            conn.pragma_update(None, "journal_size_limit", 64 * 1024 * 1024)?;
            conn.pragma_update(None, "cache_size", -kib(config.cache_bytes / 2))?;
            let page_size: i64 = conn.pragma_query_value(None, "page_size", |row| row.get(0))?;
            let max_pages = i64::try_from(config.limits.max_bytes).unwrap_or(i64::MAX) / page_size;
            conn.pragma_update(None, "max_page_count", max_pages)?;
            // The checkpointer copies the log into the file (writer.rs), not the commits.
            conn.pragma_update(None, "wal_autocheckpoint", 0)?;
            Ok((page_size, max_pages))
        };
        let (page_size, max_pages) = setup(&conn).map_err(|error| disk(&error, false))?;
        let checkpoints = Connection::open_with_flags(
            &config.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .and_then(|checkpoints| {
            checkpoints.pragma_update(None, "synchronous", "FULL")?;
            // Only the checkpoint that starts the log over waits (for the writer's
            // commit and for readers): briefly, since it holds the writer meanwhile.
            checkpoints.pragma_update(None, "busy_timeout", 100)?;
            checkpoints.pragma_update(None, "mmap_size", 0)?;
            checkpoints.pragma_update(None, "cache_size", -64)?;
            Ok(checkpoints)
        })
        .map_err(|error| disk(&error, false))?;
        let identity = identity_key(&conn)?;
        super::identity::adopt(identity, &config.path.display());
        let clock = Clock::default();
        let stats = CommitFigures::default();
        let log = file::suffixed(&config.path, "-wal");
        // Every row's key, read once: the table has no index of them (keys.rs).
        let keys = Arc::new(Keys::read(&conn).map_err(|error| disk(&error, false))?);
        let writer = Writer::start(conn, checkpoints, log, keys.clone(), clock.clone(), stats.clone());
        let writer = writer.map_err(|source| {
            StoreError::File(crate::error::StoreFileError::Io {
                path: config.path.clone(),
                what: "start its writer thread",
                source,
            })
        })?;
        Ok(SqliteStore {
            #[cfg(feature = "test-util")]
            read_pause: None,
            shared: Arc::new(Shared {
                writer,
                readers: Mutex::new(Vec::new()),
                keys,
                replays: replays::Replays::new(config.cache_bytes / 4),
                path: config.path.clone(),
                limits: config.limits,
                reader_cache_kib: kib(config.cache_bytes / 32),
                admit_pages: max_pages / 8 * 7,
                page_size,
                reserved: Arc::new(Mutex::new(Reserved {
                    claims: HashMap::new(),
                    bytes: 0,
                    room: usize::try_from(max_pages.saturating_mul(page_size)).unwrap_or(usize::MAX),
                    budget: config.response_budget,
                })),
                timeout,
                hub: Arc::default(),
                clock,
                stats,
                _lock: lock,
            }),
        })
    }

    /// Where this store's waiters are woken.
    pub(crate) fn watcher(&self) -> Watcher {
        Watcher::Local(self.shared.hub.clone())
    }

    /// The file the store keeps its records in.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// What the writer's commits cost.
    pub fn commit_figures(&self) -> &CommitFigures {
        &self.shared.stats
    }

    /// What the store holds: its records (expired ones until the sweep) and the bytes
    /// of the file's pages in use, and its bounds.
    pub fn usage(&self) -> Result<StoreUsage, StoreError> {
        let (records, pages, spent) = self.read(|conn, _| {
            let spent: i64 = conn
                .prepare_cached("SELECT coalesce(max(records), 0) FROM shares WHERE kind = 3")
                .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
                .map_err(|error| disk(&error, false))?;
            Ok((share(conn, Share::Store)?.0, used_pages(conn)?, spent))
        })?;
        Ok(StoreUsage {
            backend: "sqlite",
            records: usize::try_from(records).unwrap_or(0),
            bytes: usize::try_from(pages * self.shared.page_size).unwrap_or(0),
            max_records: self.shared.limits.max_records,
            max_bytes: self.shared.limits.max_bytes,
            spent: usize::try_from(spent).unwrap_or(0),
        })
    }

    /// The records whose outcome is unknown or whose claim is still in flight, with
    /// when each one's probe is due: at start, every one of them was this process's
    /// before it stopped (one process per file), so each is a probe to schedule. Those
    /// whose probe has given up are left to an operator.
    pub fn unsettled(&self) -> Result<Vec<Unsettled>, StoreError> {
        self.read(|conn, now| {
            let mut statement = conn
                .prepare_cached(
                    "SELECT key, probe_key, state, lease_until, probe_due, probe_give_up FROM records \
                     WHERE state != 'completed' AND expires_at > ?1 LIMIT ?2",
                )
                .map_err(|error| disk(&error, false))?;
            let rows = statement
                .query_map((now, MAX_UNSETTLED), |row| {
                    let state: String = row.get(2)?;
                    let due = match state.as_str() {
                        "in_flight" => row.get::<_, Option<i64>>(3)?,
                        // Unscheduled (written on a route without a probe then): due now.
                        _ => match row.get::<_, Option<i64>>(5)? {
                            None => Some(now),
                            Some(_) => row.get::<_, Option<i64>>(4)?,
                        },
                    };
                    let (key, probe_key): (String, Option<String>) = (row.get(0)?, row.get(1)?);
                    Ok(due.map(|due| Unsettled {
                        key: StoreKey::from_derived(key),
                        probe_key,
                        due_in: until(now, due),
                    }))
                })
                .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
                .map_err(|error| disk(&error, false))?;
            Ok(rows.into_iter().flatten().collect())
        })
    }

    /// Stops each claim that reads a completed record from the file at `pause`, before
    /// it keeps the response.
    #[cfg(feature = "test-util")]
    pub fn with_read_pause(mut self, pause: ReadPause) -> SqliteStore {
        self.read_pause = Some(pause);
        self
    }

    /// Moves the store's clock forward, as if that much time had passed.
    #[cfg(feature = "test-util")]
    pub fn advance_clock(&self, by: Duration) {
        self.shared.clock.advance(by);
    }

    /// Holds the writer until the returned sender is dropped: writes asked for meanwhile
    /// wait (within the store's timeout), and go into the commit after it together.
    /// For the group-commit test.
    #[cfg(feature = "test-util")]
    pub async fn hold_writer(&self) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (began, begun) = tokio::sync::oneshot::channel::<()>();
        // A write may be run twice (writer.rs): the hold is taken once.
        let hold = Mutex::new(Some((began, held)));
        let store = self.clone();
        tokio::spawn(async move {
            let _ = store
                .write(move |_, _| {
                    let taken = hold.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
                    if let Some((began, held)) = taken {
                        let _ = began.send(());
                        let _ = held.recv();
                    }
                    Ok(())
                })
                .await;
        });
        // Returned once the writer is inside the hold.
        let _ = begun.await;
        release
    }

    /// Holds the syncer until the returned guard is dropped: writes are committed, and
    /// those that wait for the disk wait. For the tests of what waits for an fsync.
    #[cfg(feature = "test-util")]
    pub async fn hold_fsyncs(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.shared.writer.fsyncs.clone().write_owned().await
    }

    /// Reports the next commit that lands as an I/O error that may have landed.
    #[cfg(feature = "test-util")]
    pub fn fail_next_commit(&self) {
        self.shared
            .writer
            .failing
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The number of records the file holds, expired or not.
    #[cfg(feature = "test-util")]
    pub fn len(&self) -> usize {
        self.read(|conn, _| Ok(share(conn, Share::Store)?.0))
            .map_or(0, |records| usize::try_from(records).unwrap_or(0))
    }

    #[cfg(feature = "test-util")]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the index of keys in memory holds every row of the file and nothing else,
    /// and no key has two rows: `Err` names the first difference (for the tests of every
    /// path that inserts or deletes a row).
    #[cfg(feature = "test-util")]
    pub fn check_keys(&self) -> Result<(), String> {
        let keys = self.shared.keys.clone();
        let rows: Vec<(i64, String)> = self
            .read(|conn, _| {
                let mut statement = conn
                    .prepare("SELECT rowid, key FROM records")
                    .map_err(|e| disk(&e, false))?;
                let rows = statement.query_map([], |row| Ok((row.get(0)?, row.get(1)?)));
                rows.and_then(|rows| rows.collect())
                    .map_err(|error| disk(&error, false))
            })
            .map_err(|error| error.to_string())?;
        let mut seen = std::collections::HashSet::new();
        for (rowid, key) in &rows {
            if !seen.insert(key) {
                return Err(format!("two rows hold one key (row {rowid})"));
            }
            if !keys.rows(keys.hash(key)).contains(rowid) {
                return Err(format!("row {rowid} is not in the index"));
            }
        }
        match keys.len() == rows.len() {
            true => Ok(()),
            false => Err(format!("the index holds {} rows, the file {}", keys.len(), rows.len())),
        }
    }

    /// Runs `read` on a read connection: it sees the last commit, and never waits for
    /// the writer.
    fn read<R>(&self, read: impl FnOnce(&Connection, Millis) -> Result<R, StoreError>) -> Result<R, StoreError> {
        let conn = match self.shared.lock_readers().pop() {
            Some(conn) => conn,
            None => self.reader()?,
        };
        let result = read(&conn, self.shared.clock.now());
        let mut readers = self.shared.lock_readers();
        if readers.len() < KEPT_READERS {
            readers.push(conn);
        }
        result
    }

    fn reader(&self) -> Result<Connection, StoreError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.shared.path, flags).map_err(|error| disk(&error, false))?;
        let setup = |conn: &Connection| -> rusqlite::Result<()> {
            conn.pragma_update(None, "query_only", true)?;
            conn.pragma_update(None, "busy_timeout", 5000)?;
            conn.pragma_update(None, "mmap_size", 0)?;
            conn.pragma_update(None, "cache_size", -self.shared.reader_cache_kib)
        };
        setup(&conn).map_err(|error| disk(&error, false))?;
        Ok(conn)
    }

    /// Runs `op` in the writer's next commit, answered once it is on disk.
    async fn write<R, F>(&self, op: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: Fn(&Tx<'_>, Millis) -> Result<R, StoreError> + Send + 'static,
    {
        self.shared.writer.write(self.shared.timeout, Wait::OnDisk, op).await
    }

    /// Runs a read on a read connection off the runtime, in tokio's blocking pool: a
    /// busy file holds that thread, never a worker.
    async fn read_off<R, F>(&self, read: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&Connection, Millis) -> Result<R, StoreError> + Send + 'static,
    {
        let store = self.clone();
        super::blocking(move || store.read(read)).await?
    }

    /// Runs a compare-and-set on `key`'s record, and wakes its waiters if it changed it
    /// (once the commit is read by every read, on disk or not: `wait`).
    async fn change<R, F>(
        &self,
        key: &StoreKey,
        wait: Wait,
        changed: impl Fn(&R) -> bool,
        op: F,
    ) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: Fn(&Tx<'_>, Millis) -> Result<R, StoreError> + Send + 'static,
    {
        let result = self.shared.writer.write(self.shared.timeout, wait, op).await?;
        if changed(&result) {
            self.shared.hub.wake(key.as_str());
            // Completed, marked unknown, released or purged: no longer in flight.
            lock(&self.shared.reserved).end(key);
        }
        Ok(result)
    }
}

/// The room claims in flight may still write in the file: each one's response limit,
/// until it ends or its lease lapses, in all at most `budget` (what the proxy buffers
/// at once: no more responses than that can be waiting to be written).
#[derive(Debug)]
struct Reserved {
    claims: HashMap<StoreKey, (usize, Millis)>,
    bytes: usize,
    /// The file's bound, `max_bytes`.
    room: usize,
    budget: usize,
}

impl Reserved {
    /// Whether a claim that may write `limit` bytes is refused with `used` bytes of the
    /// file in use: `Some` with when room is due (a lease's end, at least 1 s).
    /// `used` is asked only when the room kept could matter: with the pages in use
    /// below 7/8 (the claim's other bound), room kept within the last eighth always
    /// fits, and the claim pays no page count of its own.
    fn refuses(
        &mut self,
        used: impl FnOnce() -> Result<usize, StoreError>,
        limit: usize,
        now: Millis,
    ) -> Result<Option<Duration>, StoreError> {
        if self.bytes.saturating_add(limit).min(self.budget) <= self.room / 8 {
            return Ok(None);
        }
        let used = used()?;
        let over = |reserved: &Reserved| {
            let wanted = reserved.bytes.saturating_add(limit).min(reserved.budget);
            used.saturating_add(wanted) > reserved.room
        };
        if !over(self) {
            return Ok(None);
        }
        // Claims whose lease lapsed will write nothing more: let their room go.
        let before = self.claims.len();
        self.claims.retain(|_, (_, until)| *until > now);
        if self.claims.len() != before {
            self.bytes = self.claims.values().map(|(bytes, _)| *bytes).sum();
        }
        if !over(self) {
            return Ok(None);
        }
        let first = self.claims.values().map(|(_, until)| *until).min();
        Ok(Some(
            first
                .map_or(Duration::ZERO, |first| until(now, first))
                .max(Duration::from_secs(1)),
        ))
    }

    fn hold(&mut self, key: &StoreKey, limit: usize, until: Millis) {
        if let Some((old, _)) = self.claims.insert(key.clone(), (limit, until)) {
            self.bytes -= old;
        }
        self.bytes += limit;
    }

    fn end(&mut self, key: &StoreKey) {
        if let Some((bytes, _)) = self.claims.remove(key) {
            self.bytes -= bytes;
        }
    }
}

fn lock(reserved: &Mutex<Reserved>) -> MutexGuard<'_, Reserved> {
    // Every change is whole before the lock is let go.
    reserved.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    fn lock_readers(&self) -> MutexGuard<'_, Vec<Connection>> {
        // Only pushes and pops: a poisoned list is whole.
        self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn kib(bytes: usize) -> i64 {
    i64::try_from(bytes / 1024).unwrap_or(i64::MAX)
}

/// The file's key for client and scope numbers, made when the file is: so that a
/// scope's records count against the same share after a restart.
fn identity_key(conn: &Connection) -> Result<[u8; 16], StoreError> {
    let stored: Option<Vec<u8>> = conn
        .query_row("SELECT value FROM meta WHERE name = 'identity_key'", [], |row| {
            row.get(0)
        })
        .optional()
        .map_err(|error| disk(&error, false))?;
    if let Some(key) = stored.and_then(|key| <[u8; 16]>::try_from(key).ok()) {
        return Ok(key);
    }
    let key =
        super::identity::random_key().ok_or(StoreError::Unready("the operating system's random source failed"))?;
    conn.execute(
        "INSERT OR REPLACE INTO meta (name, value) VALUES ('identity_key', ?1)",
        [&key[..]],
    )
    .map_err(|error| disk(&error, true))?;
    Ok(key)
}

/// The owner's live in-flight record's row and lease deadline, if it still is one.
fn owned(tx: &Tx<'_>, key: &StoreKey, owner: OwnerToken, now: Millis) -> Result<Option<(At, Millis)>, StoreError> {
    Ok(match load(tx, key, false)? {
        Some(Row {
            rowid,
            scope,
            expires_at,
            state: RowState::InFlight {
                owner: holder,
                lease_until,
            },
            ..
        }) if expires_at > now && holder == owner => Some((At { rowid, scope }, lease_until)),
        _ => None,
    })
}

/// Where a record read in the writer's transaction is: its row, and the scope its
/// shares count it under.
#[derive(Clone, Copy)]
struct At {
    rowid: i64,
    scope: Option<i64>,
}

/// What a claim is admitted against besides the bounds: the pages in use (claims stop
/// at `admit_pages`), and the room kept for the claims in flight.
struct Room<'a> {
    admit_pages: i64,
    page_size: i64,
    reserved: &'a mut Reserved,
}

/// The file's shares, as `lifecycle::admit` asks for them.
struct Ledger<'a> {
    tx: &'a Tx<'a>,
    limits: StoreLimits,
    room: Room<'a>,
    now: Millis,
}

impl lifecycle::Ledger for Ledger<'_> {
    fn full(&mut self, of: Share) -> Result<Option<Held>, StoreError> {
        let bound = |limit: usize| i64::try_from(limit).unwrap_or(i64::MAX);
        let (records, bytes) = self
            .tx
            .shares
            .borrow_mut()
            .get(self.tx, of)
            .map_err(|error| disk(&error, false))?;
        let (full_of_records, full_of_bytes) = match of {
            // The store's bytes are the file's pages in use, asked only when its
            // records leave room.
            Share::Store => {
                let full_of_records = records >= bound(self.limits.max_records);
                (
                    full_of_records,
                    !full_of_records && used_pages(self.tx)? >= self.room.admit_pages,
                )
            }
            Share::Scope(_) => (
                records >= bound(self.limits.max_records_per_scope),
                bytes >= bound(self.limits.max_bytes_per_scope),
            ),
            Share::Client(_) => (records >= bound(self.limits.max_records_per_client), false),
        };
        Ok(if full_of_records {
            Some(Held::Records)
        } else if full_of_bytes {
            Some(Held::Bytes)
        } else {
            None
        })
    }

    fn sweep(&mut self, share: Share) -> Result<(), StoreError> {
        let (tx, now) = (self.tx, self.now);
        match share {
            Share::Store => delete_expired(tx, now, ROOM_BATCH),
            Share::Scope(ScopeId(scope)) => delete(
                tx,
                deleting!("DELETE FROM records WHERE scope = ?1 AND expires_at <= ?2"),
                (scope as i64, now),
            ),
            Share::Client(ClientId(client)) => delete(
                tx,
                deleting!("DELETE FROM records WHERE client = ?1 AND expires_at <= ?2"),
                (client as i64, now),
            ),
        }
        .map(drop)
    }

    fn first_expiry(&mut self, share: Share) -> Result<Duration, StoreError> {
        let (conn, now): (&Connection, Millis) = (self.tx, self.now);
        match share {
            Share::Store => space_due(conn, now),
            Share::Scope(ScopeId(scope)) => first_expiry(conn, "scope", scope as i64, now),
            Share::Client(ClientId(client)) => first_expiry(conn, "client", client as i64, now),
        }
    }

    /// What claims in flight may still write is room this claim cannot take (issue 49
    /// L5: six 100 KiB responses were admitted on a 5/8-full 1 MiB file, and three
    /// went unrecorded).
    fn reserve(&mut self, claim: &ClaimRequest) -> Result<Option<Duration>, StoreError> {
        let (conn, page_size): (&Connection, i64) = (self.tx, self.room.page_size);
        let used = || Ok(usize::try_from(used_pages(conn)?.saturating_mul(page_size)).unwrap_or(usize::MAX));
        self.room.reserved.refuses(used, claim.response_limit, self.now)
    }
}

/// A claim, in the writer: what the key's live record says, with when a replay of it
/// kept in memory stops; or, the key free, the claim takes it if the bounds have room.
fn claim_free(
    tx: &Tx<'_>,
    claim: &ClaimRequest,
    limits: StoreLimits,
    room: Room<'_>,
    now: Millis,
) -> Result<(ClaimOutcome, Option<Millis>), StoreError> {
    if let Some(row) = load(tx, &claim.key, true)? {
        if row.expires_at > now {
            // A replay kept in memory answers until the response's retention ends.
            let replay_until = row.response_until.unwrap_or(row.expires_at);
            return Ok((existing(row, claim.owner, now)?, Some(replay_until)));
        }
        delete_key(tx, &claim.key)?;
    }
    let mut ledger = Ledger { tx, limits, room, now };
    lifecycle::admit(&mut ledger, claim, &limits)?;
    let counted = Counted {
        scope: claim.scope.map(|ScopeId(scope)| scope as i64),
        client: claim.client.map(|ClientId(client)| client as i64),
    };
    let size = record_size(&claim.key, None);
    execute(
        tx,
        "INSERT INTO records (key, fingerprint, expires_at, scope, client, state, owner, lease_until, probe_key, size, \
         response_until) VALUES (?1, ?2, ?3, ?4, ?5, 'in_flight', ?6, ?7, ?8, ?9, ?10)",
        params![
            claim.key.as_str(),
            &claim.fingerprint.0[..],
            now + millis(claim.remember.max(claim.retention)),
            counted.scope,
            counted.client,
            &claim.owner.as_bytes()[..],
            now + millis(claim.lease),
            claim.probe_key,
            size,
            // Only a record that outlives its response has its drop to sweep.
            (claim.remember > claim.retention).then(|| now + millis(claim.retention)),
        ],
    )?;
    tx.inserted(claim.key.as_str(), tx.last_insert_rowid());
    tx.shares
        .borrow_mut()
        .added(tx, counted, size)
        .map_err(|error| disk(&error, false))?;
    ledger
        .room
        .reserved
        .hold(&claim.key, claim.response_limit, now + millis(claim.lease));
    Ok((ClaimOutcome::Acquired(()), None))
}

/// Makes `key`'s record the completed `response` at `now` (its expiry and the end of
/// its retention kept: past it, the sweeper drops the response within a second, and
/// every read reads it as spent meanwhile).
///
/// Only a record without a response is completed (one in flight, or unknown:
/// `lifecycle::resolvable`), so it was the size of its key alone, and the shares grow by
/// the response's size.
///
/// A plain `UPDATE` (the scope comes from the read before it): with `RETURNING`,
/// SQLite buffered the returned row in a temporary table and kept a statement journal,
/// which cost a fifth of the writer's time under fresh keys (perf, docs/performance.md).
fn set_completed(
    tx: &Tx<'_>,
    (key, at): (&StoreKey, At),
    response: &StoredResponse,
    now: Millis,
) -> Result<(), StoreError> {
    let size = record_size(key, Some(response));
    execute(
        tx,
        "UPDATE records SET state = 'completed', owner = NULL, lease_until = NULL, reason = NULL, \
         probe_due = NULL, probe_give_up = NULL, probe_key = NULL, status = ?2, headers = ?3, body = ?4, \
         size = ?5, completed_at = ?6 WHERE rowid = ?1",
        params![
            at.rowid,
            response.status.as_u16(),
            response.encode_headers(),
            &response.body[..],
            size,
            now,
        ],
    )?;
    tx.shares
        .borrow_mut()
        .resized(tx, at.scope, size - record_size(key, None))
        .map_err(|error| disk(&error, false))
}

/// Writes a change the lifecycle decided on the record in row `rowid`, with one
/// statement.
fn write_change(conn: &Connection, rowid: i64, change: Option<Change<Millis>>) -> Result<(), StoreError> {
    match change {
        None => Ok(()),
        Some(Change::LeaseExpired(leased)) => execute(
            conn,
            "UPDATE records SET state = 'unknown', lease_until = NULL, reason = ?2, probe_due = ?3, \
             probe_give_up = ?4 WHERE rowid = ?1",
            params![
                rowid,
                UnknownReason::LeaseExpired.as_str(),
                leased.due,
                leased.give_up_at
            ],
        )
        .map(drop),
        Some(Change::Reschedule(schedule)) => execute(
            conn,
            "UPDATE records SET probe_due = ?2, probe_give_up = ?3 WHERE rowid = ?1",
            params![rowid, schedule.due, schedule.give_up_at],
        )
        .map(drop),
    }
}

impl RecordStore for SqliteStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        // A retry (the common case after the first request) is answered from a response
        // kept in memory; every other claim goes to the writer, which reads the key's
        // record and takes the key if it is free, with no read of its own on the runtime
        // (docs/design.md §27). A claim that finds its record writes nothing, and is
        // answered at its commit without waiting for an fsync.
        let replays = &self.shared.replays;
        if let Some((fingerprint, response)) = replays.get(&claim.key, self.shared.clock.now()) {
            return Ok(ClaimOutcome::Existing(Existing {
                fingerprint,
                state: RecordState::Completed(response),
            }));
        }
        let ticket = replays.ticket();
        let (request, limits, admit) = (claim.clone(), self.shared.limits, self.shared.admit_pages);
        let (reserved, page_size) = (self.shared.reserved.clone(), self.shared.page_size);
        let (found, replay_until) = self
            .write(move |conn, now| {
                let mut reserved = lock(&reserved);
                let room = Room {
                    admit_pages: admit,
                    page_size,
                    reserved: &mut reserved,
                };
                claim_free(conn, &request, limits, room, now)
            })
            .await?;
        if let ClaimOutcome::Existing(Existing {
            fingerprint,
            state: RecordState::Completed(response),
        }) = &found
        {
            #[cfg(feature = "test-util")]
            if let Some(pause) = &self.read_pause {
                pause.reached.notify_one();
                pause.resume.notified().await;
            }
            if let Some(until) = replay_until {
                replays.keep(ticket, &claim.key, *fingerprint, until, response);
            }
        }
        Ok(found)
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        let (record, response) = (key.clone(), response.clone());
        self.change(
            key,
            Wait::Committed,
            |write| *write == Write::Applied,
            move |conn, now| {
                Ok(match owned(conn, &record, owner, now)? {
                    Some((at, lease_until)) if lease_until > now => {
                        set_completed(conn, (&record, at), &response, now)?;
                        Write::Applied
                    }
                    _ => Write::Fenced,
                })
            },
        )
        .await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
        schedule: Option<ProbeSchedule>,
    ) -> Result<Write, StoreError> {
        let record = key.clone();
        self.change(
            key,
            Wait::Committed,
            |write| *write == Write::Applied,
            move |conn, now| {
                let Some((At { rowid, .. }, _)) = owned(conn, &record, owner, now)? else {
                    return Ok(Write::Fenced);
                };
                let schedule = schedule.map(|schedule| Schedule::new(now, schedule.first_after, schedule));
                execute(
                    conn,
                    "UPDATE records SET state = 'unknown', lease_until = NULL, reason = ?2, probe_due = ?3, \
                 probe_give_up = ?4 WHERE rowid = ?1",
                    params![
                        rowid,
                        reason.as_str(),
                        schedule.and_then(|schedule| schedule.due),
                        schedule.map(|schedule| schedule.give_up_at),
                    ],
                )?;
                Ok(Write::Applied)
            },
        )
        .await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let record = key.clone();
        self.change(
            key,
            Wait::Committed,
            |write| *write == Write::Applied,
            move |conn, now| {
                if owned(conn, &record, owner, now)?.is_none() {
                    return Ok(Write::Fenced);
                }
                delete_key(conn, &record)?;
                Ok(Write::Applied)
            },
        )
        .await
    }

    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let record = key.clone();
        let purged = self
            .change(key, Wait::OnDisk, |_| true, move |conn, _| delete_key(conn, &record))
            .await;
        // Forgotten however the write ended: a purge that may have landed is not undone
        // by a replay from memory.
        self.shared.replays.forget(key);
        purged
    }

    async fn response(&self, key: &StoreKey) -> Result<Option<StoredResponse>, StoreError> {
        let (key, keys) = (key.clone(), self.shared.keys.clone());
        self.read_off(
            move |conn, now| match load_read(conn, &keys, &key, true)?.filter(|row| row.expires_at > now) {
                Some(row) if !row.spent(now) => match row.state {
                    RowState::Completed(completed) => Ok(Some(completed.response()?)),
                    _ => Ok(None),
                },
                _ => Ok(None),
            },
        )
        .await
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<RecordSummary>, StoreError> {
        let (key, keys) = (key.clone(), self.shared.keys.clone());
        self.read_off(move |conn, now| {
            let Some(row) = load_read(conn, &keys, &key, false)?.filter(|row| row.expires_at > now) else {
                return Ok(None);
            };
            let spent = row.spent(now);
            let (state, owner) = lifecycle::summary(row.state, now, |completed| completed.summary(spent))?;
            Ok(Some(RecordSummary {
                fingerprint: row.fingerprint,
                ttl: until(now, row.expires_at),
                state,
                owner,
            }))
        })
        .await
    }

    async fn resolve(
        &self,
        key: &StoreKey,
        owner: Option<OwnerToken>,
        resolution: &Resolution,
    ) -> Result<Resolved, StoreError> {
        let (record, resolution) = (key.clone(), resolution.clone());
        self.change(
            key,
            Wait::OnDisk,
            |resolved| *resolved == Resolved::Resolved,
            move |conn, now| {
                let Some(row) = load(conn, &record, false)?.filter(|row| row.expires_at > now) else {
                    return Ok(Resolved::Absent);
                };
                if let Err(answer) = lifecycle::resolvable(&row.state, owner, now) {
                    return Ok(answer);
                }
                match &resolution {
                    Resolution::Applied(response) => {
                        let at = At {
                            rowid: row.rowid,
                            scope: row.scope,
                        };
                        set_completed(conn, (&record, at), response, now)?;
                    }
                    Resolution::NotApplied => {
                        delete_key(conn, &record)?;
                    }
                }
                Ok(Resolved::Resolved)
            },
        )
        .await
    }

    async fn begin_probe(
        &self,
        key: &StoreKey,
        schedule: ProbeSchedule,
        lease: Duration,
    ) -> Result<ProbeStart, StoreError> {
        let record = key.clone();
        self.write(move |conn, now| {
            let Some(row) = load(conn, &record, false)?.filter(|row| row.expires_at > now) else {
                return Ok(ProbeStart::Settled);
            };
            let (start, change) = lifecycle::begin_probe(&row.state, schedule, lease, now);
            write_change(conn, row.rowid, change)?;
            Ok(start)
        })
        .await
    }

    async fn defer_probe(&self, key: &StoreKey, named: OwnerToken, every: Duration) -> Result<Deferred, StoreError> {
        let record = key.clone();
        self.write(move |conn, now| {
            let Some(row) = load(conn, &record, false)?.filter(|row| row.expires_at > now) else {
                return Ok(Deferred::Settled);
            };
            let (deferred, change) = lifecycle::defer_probe(&row.state, named, every, now);
            write_change(conn, row.rowid, change)?;
            Ok(deferred)
        })
        .await
    }

    /// A write through the writer, committed: the store is ready only while its file
    /// takes writes.
    async fn ping(&self) -> Result<(), StoreError> {
        self.write(|conn, now| {
            execute(
                conn,
                "INSERT INTO meta (name, value) VALUES ('ping', ?1) \
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                [&now.to_be_bytes()[..]],
            )
            .map(drop)
        })
        .await
    }

    fn usage(&self) -> Option<StoreUsage> {
        SqliteStore::usage(self)
            .inspect_err(|error| tracing::warn!(%error, "cannot read what the store's file holds"))
            .ok()
    }

    fn commit_figures(&self) -> Option<&CommitFigures> {
        Some(&self.shared.stats)
    }

    fn unsettled(&self) -> Result<Vec<Unsettled>, StoreError> {
        SqliteStore::unsettled(self)
    }
}
