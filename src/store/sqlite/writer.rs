//! The SQLite store's one writer: a thread that owns the connection every write goes
//! through, and commits whatever is waiting as one transaction (group commit). Should
//! a write fail (a full disk), the transaction is run again with each write in a
//! savepoint of its own, so that it is undone alone and the others still commit. Each
//! caller is answered only once the commit that holds its write is on disk
//! (`synchronous = FULL`: the write-ahead log is fsync'd before `COMMIT` returns). A thousand claims at once cost
//! a few commits, not a thousand. Between batches, the writer deletes expired records,
//! a thousand at a time. The log is copied into the database file (checkpointed) by a
//! second thread with a connection of its own, so that no commit waits for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::store::CommitFigures;
use rusqlite::Connection;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{DiskError, StoreError};

/// A time on the wall clock: milliseconds since the Unix epoch. Records keep their
/// times so, so that retention, leases and probe schedules count across a restart.
pub(super) type Millis = i64;

/// Most writes one commit takes.
const MAX_BATCH: usize = 1024;
/// How often expired records are looked for when nothing else is written.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Most expired records one sweep deletes; more left, the next sweep comes at once.
const SWEEP_BATCH: i64 = 1000;
/// The log's size past which a checkpoint holds the writer until the log starts over:
/// far past what a request load writes between two checkpoints that catch up (a
/// bound of 64 MiB held the writer often enough under fresh keys to raise their p99
/// from 5 to 60-110 ms), and far short of a full disk.
const LOG_BOUND: i64 = 1024 * 1024 * 1024;
/// How long the checkpointer lets commits gather before it copies them into the file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// The wall clock the store counts on; a test may move it forward.
#[derive(Debug, Clone, Default)]
pub(super) struct Clock {
    offset: Arc<AtomicI64>,
}

impl Clock {
    pub(super) fn now(&self) -> Millis {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| i64::try_from(since.as_millis()).unwrap_or(i64::MAX));
        wall.saturating_add(self.offset.load(Ordering::Relaxed))
    }

    #[cfg(feature = "test-util")]
    pub(super) fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.offset.fetch_add(by, Ordering::Relaxed);
    }
}

/// One write waiting for the writer.
trait Job: Send {
    /// Whether its caller still waits for it (a write nobody waits for is not run).
    fn wanted(&self) -> bool;

    /// Runs the write inside the batch's transaction (in a savepoint of its own when
    /// `alone`), keeping its result to answer with: whether it succeeded.
    fn run(&mut self, conn: &Connection, now: Millis, alone: bool) -> bool;

    /// Answers with the kept result once the commit is known.
    fn answer(self: Box<Self>, commit: &Result<(), DiskError>);

    /// Answers a write whose transaction could not begin with the failure; never run.
    fn refuse(self: Box<Self>, failure: &DiskError);
}

struct Pending<R, F> {
    op: F,
    reply: oneshot::Sender<Result<R, StoreError>>,
    result: Option<Result<R, StoreError>>,
}

impl<R, F> Job for Pending<R, F>
where
    R: Send + 'static,
    F: Fn(&Connection, Millis) -> Result<R, StoreError> + Send + 'static,
{
    fn wanted(&self) -> bool {
        !self.reply.is_closed()
    }

    fn run(&mut self, conn: &Connection, now: Millis, alone: bool) -> bool {
        let result = match alone {
            true => in_savepoint(conn, |conn| (self.op)(conn, now)),
            false => (self.op)(conn, now),
        };
        let succeeded = result.is_ok();
        self.result = Some(result);
        succeeded
    }

    fn answer(self: Box<Self>, commit: &Result<(), DiskError>) {
        let answer = match (commit, self.result) {
            (Ok(()), Some(result)) => result,
            (Ok(()), None) => Err(StoreError::Unready("the store's writer did not run the write")),
            // The write was undone with its transaction, or may have landed (an I/O
            // error while the log was synced): the error says which.
            (Err(error), _) => Err(StoreError::Disk(error.clone())),
        };
        let _ = self.reply.send(answer);
    }

    fn refuse(self: Box<Self>, failure: &DiskError) {
        let _ = self.reply.send(Err(StoreError::Disk(failure.clone())));
    }
}

/// Runs `op` in a savepoint: undone alone if it fails.
fn in_savepoint<R>(conn: &Connection, op: impl FnOnce(&Connection) -> Result<R, StoreError>) -> Result<R, StoreError> {
    conn.execute_batch("SAVEPOINT write")
        .map_err(|error| disk(&error, false))?;
    let result = op(conn);
    let ended = match result {
        Ok(_) => conn.execute_batch("RELEASE write"),
        Err(_) => conn.execute_batch("ROLLBACK TO write; RELEASE write"),
    };
    ended.map_err(|error| disk(&error, false))?;
    result
}

/// A SQLite failure as a store error. `during_commit`: an I/O error then may have left
/// the write on disk; before it, the transaction is undone.
pub(super) fn disk(error: &rusqlite::Error, during_commit: bool) -> StoreError {
    StoreError::Disk(disk_error(error, during_commit))
}

fn disk_error(error: &rusqlite::Error, during_commit: bool) -> DiskError {
    use rusqlite::ErrorCode;
    let code = error.sqlite_error_code();
    let may_have_written = during_commit && !matches!(code, Some(ErrorCode::DiskFull | ErrorCode::DatabaseBusy));
    let message = match code {
        Some(ErrorCode::DiskFull) => "the disk (or store.max_bytes) is full".to_string(),
        _ => error.to_string(),
    };
    DiskError {
        message,
        may_have_written,
    }
}

/// The writer thread's handle: dropped, it lets the thread finish what is queued and
/// waits for it (and for the checkpointer), so that the file is closed before its lock
/// is let go.
pub(super) struct Writer {
    jobs: Option<mpsc::Sender<Box<dyn Job>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Writer")
    }
}

impl Writer {
    /// Starts the writer on `conn` and the checkpointer on `checkpoints`, a second
    /// connection to the same file: SQLite's automatic checkpoint is turned off on the
    /// writer, and every commit wakes the checkpointer instead.
    pub(super) fn start(
        conn: Connection,
        checkpoints: Connection,
        clock: Clock,
        stats: CommitFigures,
    ) -> std::io::Result<Writer> {
        let (jobs, queue) = mpsc::channel();
        let (pokes, poked) = mpsc::sync_channel(1);
        let checkpointer = std::thread::Builder::new()
            .name("idemproxy-checkpoints".into())
            .spawn(move || checkpoint_on(&checkpoints, &poked))?;
        let thread = std::thread::Builder::new()
            .name("idemproxy-sqlite-writer".into())
            .spawn(move || {
                let conn = run(conn, &queue, &pokes, &clock, &stats);
                // The checkpointer stops once the pokes are gone; the writer's connection,
                // closed last, then checkpoints what is left and removes the log.
                drop(pokes);
                let _ = checkpointer.join();
                drop(conn);
            })?;
        Ok(Writer {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Runs `op` in the next commit, and answers once that commit is on disk, or with
    /// `StoreError::Timeout` after `timeout` (a write not begun by then is never run).
    pub(super) async fn write<R, F>(&self, timeout: Duration, op: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: Fn(&Connection, Millis) -> Result<R, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: Box<dyn Job> = Box::new(Pending {
            op,
            reply,
            result: None,
        });
        let sent = self.jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok());
        if !sent {
            return Err(StoreError::Unready("the store's writer has stopped"));
        }
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError::Unready("the store's writer has stopped")),
            Err(_) => Err(StoreError::Timeout {
                after: timeout,
                may_have_written: true,
            }),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    conn: Connection,
    queue: &mpsc::Receiver<Box<dyn Job>>,
    pokes: &SyncSender<()>,
    clock: &Clock,
    stats: &CommitFigures,
) -> Connection {
    let mut next_sweep = Instant::now() + SWEEP_EVERY;
    loop {
        let wait = next_sweep.saturating_duration_since(Instant::now());
        let mut batch = Vec::new();
        match queue.recv_timeout(wait) {
            Ok(job) => batch.push(job),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            commit(&conn, batch, clock.now(), stats);
            // Full: a checkpoint is already due, and takes this commit too.
            let _ = pokes.try_send(());
        }
        if Instant::now() >= next_sweep {
            let full = sweep(&conn, clock.now(), stats);
            next_sweep = Instant::now() + if full { Duration::ZERO } else { SWEEP_EVERY };
        }
    }
    conn
}

/// The checkpointer: woken by commits, it lets them gather for `CHECKPOINT_EVERY`, then
/// copies the log into the database file (`PASSIVE`: it never blocks the writer or a
/// reader, and the writer starts the log over once all of it is copied). Under writes
/// that never pause (a copy into the store: `store::moving`), a passive checkpoint never
/// catches up and the log would grow without bound; once it holds more than
/// `LOG_BOUND`, the checkpoint is a `RESTART`, which waits for the writer's commit in
/// progress, holds the next one while it copies the rest and waits (100 ms at most)
/// for readers to leave the log, and has the log started over (and cut to
/// `journal_size_limit`).
fn checkpoint_on(conn: &Connection, poked: &Receiver<()>) {
    let page_size: i64 = conn
        .pragma_query_value(None, "page_size", |row| row.get(0))
        .unwrap_or(4096);
    while poked.recv().is_ok() {
        // A throttle, not a wait for anything: the commits of the next 100 ms are copied
        // by this one checkpoint (the pokes they send meanwhile are taken below).
        std::thread::sleep(CHECKPOINT_EVERY);
        while poked.try_recv().is_ok() {}
        let copied = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get::<_, i64>(1));
        let copied = match copied {
            Ok(frames) if frames.saturating_mul(page_size) > LOG_BOUND => {
                conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |row| row.get::<_, i64>(0))
            }
            other => other,
        };
        if let Err(error) = copied {
            tracing::warn!(%error, "cannot copy the store's log into its file; trying again after the next commit");
        }
    }
}

/// Runs `batch` as one transaction, then answers each write. The writes run one after
/// another, without savepoints (each would journal every page it touches a second
/// time); should one fail (a full disk), the transaction is undone and run again with
/// each write in a savepoint of its own, so that the one that failed is undone alone and
/// the others still commit.
fn commit(conn: &Connection, mut batch: Vec<Box<dyn Job>>, now: Millis, stats: &CommitFigures) {
    batch.retain(|job| job.wanted());
    if batch.is_empty() {
        return;
    }
    let begin = |batch: Vec<Box<dyn Job>>| match conn.execute_batch("BEGIN IMMEDIATE") {
        Ok(()) => Some(batch),
        Err(error) => {
            let failure = disk_error(&error, false);
            for job in batch {
                job.refuse(&failure);
            }
            None
        }
    };
    let Some(mut batch) = begin(batch) else {
        return;
    };
    if !batch.iter_mut().all(|job| job.run(conn, now, false)) {
        let _ = conn.execute_batch("ROLLBACK");
        let Some(again) = begin(batch) else {
            return;
        };
        batch = again;
        for job in &mut batch {
            job.run(conn, now, true);
        }
    }
    let started = Instant::now();
    let committed = conn.execute_batch("COMMIT").map_err(|error| disk_error(&error, true));
    stats.commit_seconds.observe(started.elapsed().as_secs_f64());
    if committed.is_ok() {
        stats.commits.inc();
        stats.writes.inc_by(batch.len() as u64);
    } else if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    for job in batch {
        job.answer(&committed);
    }
}

/// Deletes up to `SWEEP_BATCH` expired records, and drops up to as many responses
/// past their retention (their record kept: docs/design.md §24), each in a
/// transaction of its own: whether either found as many (more may be left).
fn sweep(conn: &Connection, now: Millis, stats: &CommitFigures) -> bool {
    let dropped = conn
        .prepare_cached(super::DROP_RESPONSES)
        .and_then(|mut statement| statement.execute((now, SWEEP_BATCH)));
    let more = match dropped {
        Ok(dropped) => {
            stats.dropped.inc_by(dropped as u64);
            i64::try_from(dropped).is_ok_and(|dropped| dropped >= SWEEP_BATCH)
        }
        Err(error) => {
            tracing::warn!(%error, "cannot drop responses past their retention; trying again in a second");
            false
        }
    };
    let deleted = conn
        .prepare_cached(
            "DELETE FROM records WHERE rowid IN \
             (SELECT rowid FROM records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
        )
        .and_then(|mut statement| statement.execute((now, SWEEP_BATCH)));
    match deleted {
        Ok(deleted) => {
            stats.swept.inc_by(deleted as u64);
            more || i64::try_from(deleted).is_ok_and(|deleted| deleted >= SWEEP_BATCH)
        }
        Err(error) => {
            tracing::warn!(%error, "cannot delete expired records; trying again in a second");
            more
        }
    }
}
