//! The SQLite store's one writer: a thread that owns the connection every write goes
//! through, and commits whatever is waiting as one transaction (group commit). Should
//! a write fail (a full disk), the transaction is run again with each write in a
//! savepoint of its own, so that it is undone alone and the others still commit. A
//! thousand claims at once cost a few commits, not a thousand. Between batches, the
//! writer deletes expired records, a thousand at a time.
//!
//! Each caller that wrote is answered only once the commit that holds its write is on
//! disk, but the writer does not wait for that (docs/design.md §27): its `COMMIT`
//! writes the write-ahead log (`synchronous = NORMAL`), and a second thread, the
//! syncer, fsyncs the log and then answers the callers of every commit the fsync
//! covers, while the writer runs the next batch. One fsync covers every commit
//! written before it, in order, so a caller is never answered before a write it
//! depends on is on disk. A caller whose write changed nothing (a claim that found
//! its record) is answered at its commit. A failed fsync leaves what is on disk
//! unknown (the kernel may have dropped the pages it could not write): every caller
//! it covers hears that its write may have landed, and the store takes no write
//! again until it is restarted and SQLite recovers the log; so does a commit that
//! failed where it may have landed (the index of keys in memory would not know its
//! rows: keys.rs). The log is copied into the database file (checkpointed) by a
//! third thread with a connection of its own, so that no commit waits for it.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::cell::RefCell;
use std::ops::Deref;

use super::keys::{Keys, Staged};
use super::shares::Shares;
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
/// The log's size past which a checkpoint holds the writer until the log starts over.
/// Under fresh keys that never pause, a passive checkpoint never catches up, and a
/// long log slows every read of a page (SQLite looks for it in the log's index, one
/// table of 4,096 frames after another): with a bound of 1 GiB, commits of a few
/// writes took 0.4 s once the log passed 800 MB, and the p99 of fresh keys rose from
/// 30 to 300-470 ms over four 8 s runs; with 16 MiB it stayed within 24-66 ms, at the
/// same rate (docs/performance.md).
const LOG_BOUND: i64 = 16 * 1024 * 1024;
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

/// What a write's caller waits for before it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// The commit that holds it on disk: what a claim needs before its request is
    /// forwarded, and what an operator's change is told.
    OnDisk,
    /// The commit that holds it, which every read then sees; on disk with the next
    /// fsync, a moment later (docs/design.md §27 says what a crash in between costs).
    Committed,
}

/// The writer's connection inside a commit, with the shares it keeps between
/// commits (shares.rs) and the index of the file's keys with what the commit changed
/// in it (keys.rs). A write reads and writes through it as through the connection.
pub(super) struct Tx<'a> {
    conn: &'a Connection,
    pub(super) shares: &'a RefCell<Shares>,
    keys: &'a Keys,
    staged: &'a RefCell<Staged>,
    /// Set once a commit failed where it may have landed (or an fsync failed): no
    /// write is taken again until a restart.
    broken: &'a AtomicBool,
    #[cfg(feature = "test-util")]
    failing: &'a AtomicBool,
}

impl Tx<'_> {
    /// The transaction was rolled back: the shares and the index as last committed hold.
    fn forget(&self) {
        self.shares.borrow_mut().forget();
        self.staged.borrow_mut().forget();
    }

    /// The rows that may be `key`'s, as this transaction sees them.
    pub(super) fn rows(&self, key: &str) -> Vec<i64> {
        self.staged.borrow().rows(self.keys, self.keys.hash(key))
    }

    /// `key`'s row `rowid` was inserted.
    pub(super) fn inserted(&self, key: &str, rowid: i64) {
        self.staged.borrow_mut().added(self.keys, self.keys.hash(key), rowid);
    }

    /// `key`'s row `rowid` was deleted.
    pub(super) fn deleted(&self, key: &str, rowid: i64) {
        self.staged.borrow_mut().removed(self.keys, self.keys.hash(key), rowid);
    }
}

impl Deref for Tx<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// One write waiting for the writer.
trait Job: Send {
    /// Whether its caller still waits for it (a write nobody waits for is not run).
    fn wanted(&self) -> bool;

    /// Whether its caller waits for it to be on disk, not only committed.
    fn durable(&self) -> bool;

    /// Runs the write inside the batch's transaction (in a savepoint of its own when
    /// `alone`), keeping its result to answer with: whether it succeeded.
    fn run(&mut self, tx: &Tx<'_>, now: Millis, alone: bool) -> bool;

    /// Answers with the kept result once the commit is known.
    fn answer(self: Box<Self>, commit: &Result<(), DiskError>);

    /// Answers a write whose transaction could not begin with the failure; never run.
    fn refuse(self: Box<Self>, failure: &DiskError);
}

struct Pending<R, F> {
    op: F,
    wait: Wait,
    reply: oneshot::Sender<Result<R, StoreError>>,
    result: Option<Result<R, StoreError>>,
}

impl<R, F> Job for Pending<R, F>
where
    R: Send + 'static,
    F: Fn(&Tx<'_>, Millis) -> Result<R, StoreError> + Send + 'static,
{
    fn wanted(&self) -> bool {
        !self.reply.is_closed()
    }

    fn durable(&self) -> bool {
        self.wait == Wait::OnDisk
    }

    fn run(&mut self, tx: &Tx<'_>, now: Millis, alone: bool) -> bool {
        let result = match alone {
            true => in_savepoint(tx, |tx| (self.op)(tx, now)),
            false => (self.op)(tx, now),
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

/// Runs `op` in a savepoint: undone alone if it fails, with what it changed in the
/// shares and the index.
fn in_savepoint<R>(tx: &Tx<'_>, op: impl FnOnce(&Tx<'_>) -> Result<R, StoreError>) -> Result<R, StoreError> {
    tx.execute_batch("SAVEPOINT write")
        .map_err(|error| disk(&error, false))?;
    let mark = (tx.shares.borrow().mark(), tx.staged.borrow().mark());
    let result = op(tx);
    let ended = match result {
        Ok(_) => tx.execute_batch("RELEASE write"),
        Err(_) => {
            tx.shares.borrow_mut().undo_to(mark.0);
            tx.staged.borrow_mut().undo_to(mark.1);
            tx.execute_batch("ROLLBACK TO write; RELEASE write")
        }
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
    /// Held, the syncer fsyncs nothing (`test-util`: `SqliteStore::hold_fsyncs`).
    #[cfg(feature = "test-util")]
    pub(super) fsyncs: Arc<tokio::sync::RwLock<()>>,
    /// Set, the next commit that lands is reported as an I/O error that may have
    /// landed (`test-util`: `SqliteStore::fail_next_commit`).
    #[cfg(feature = "test-util")]
    pub(super) failing: Arc<AtomicBool>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Writer")
    }
}

impl Writer {
    /// Starts the writer on `conn`, the syncer on the write-ahead log at `log`, and the
    /// checkpointer on `checkpoints`, a second connection to the same file: SQLite's
    /// automatic checkpoint is turned off on the writer, and every commit wakes the
    /// checkpointer instead.
    pub(super) fn start(
        conn: Connection,
        checkpoints: Connection,
        log: PathBuf,
        keys: Arc<Keys>,
        clock: Clock,
        stats: CommitFigures,
    ) -> std::io::Result<Writer> {
        let (jobs, queue) = mpsc::channel();
        let (pokes, poked) = mpsc::sync_channel(1);
        let (synced, to_sync) = mpsc::channel();
        let broken = Arc::new(AtomicBool::new(false));
        let checkpointer = std::thread::Builder::new()
            .name("idemproxy-checkpoints".into())
            .spawn(move || checkpoint_on(&checkpoints, &poked))?;
        #[cfg(feature = "test-util")]
        let fsyncs = Arc::new(tokio::sync::RwLock::new(()));
        #[cfg(feature = "test-util")]
        let failing = Arc::new(AtomicBool::new(false));
        #[cfg(feature = "test-util")]
        let planted = failing.clone();
        let syncer = Syncer {
            log,
            stats: stats.clone(),
            broken: broken.clone(),
            #[cfg(feature = "test-util")]
            fsyncs: fsyncs.clone(),
        };
        let syncer = std::thread::Builder::new()
            .name("idemproxy-fsync".into())
            .spawn(move || syncer.run(&to_sync))?;
        let thread = std::thread::Builder::new()
            .name("idemproxy-sqlite-writer".into())
            .spawn(move || {
                let writes = Writes {
                    pokes,
                    synced,
                    broken,
                    #[cfg(feature = "test-util")]
                    failing: planted,
                };
                let conn = run(conn, &keys, &queue, &writes, &clock, &stats);
                // The syncer answers what is left once the writer is gone, and the
                // checkpointer stops once the pokes are gone; the writer's connection,
                // closed last, then checkpoints what is left and removes the log.
                drop(writes);
                let _ = syncer.join();
                let _ = checkpointer.join();
                drop(conn);
            })?;
        Ok(Writer {
            jobs: Some(jobs),
            thread: Some(thread),
            #[cfg(feature = "test-util")]
            fsyncs,
            #[cfg(feature = "test-util")]
            failing,
        })
    }

    /// Runs `op` in the next commit, and answers once that commit is on disk (or only
    /// committed: `wait`), or with `StoreError::Timeout` after `timeout` (a write not
    /// begun by then is never run).
    pub(super) async fn write<R, F>(&self, timeout: Duration, wait: Wait, op: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: Fn(&Tx<'_>, Millis) -> Result<R, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: Box<dyn Job> = Box::new(Pending {
            op,
            wait,
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

/// Where the writer's commits go: to the syncer, and a poke to the checkpointer.
struct Writes {
    pokes: SyncSender<()>,
    synced: mpsc::Sender<Written>,
    /// Set by the syncer once an fsync failed, or by the writer once a commit failed
    /// where it may have landed: no write is taken again.
    broken: Arc<AtomicBool>,
    #[cfg(feature = "test-util")]
    failing: Arc<AtomicBool>,
}

/// A commit written to the log, with the callers that wait for it to be on disk.
struct Written {
    jobs: Vec<Box<dyn Job>>,
    /// When its `COMMIT` began.
    began: Instant,
}

fn run(
    conn: Connection,
    keys: &Keys,
    queue: &mpsc::Receiver<Box<dyn Job>>,
    writes: &Writes,
    clock: &Clock,
    stats: &CommitFigures,
) -> Connection {
    let shares = RefCell::new(Shares::default());
    let staged = RefCell::new(Staged::default());
    let tx = Tx {
        conn: &conn,
        shares: &shares,
        keys,
        staged: &staged,
        broken: &writes.broken,
        #[cfg(feature = "test-util")]
        failing: &writes.failing,
    };
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
            if writes.broken.load(Ordering::Acquire) {
                refuse_all(batch, &broken());
            } else {
                commit(&tx, batch, clock.now(), writes, stats);
                // Full: a checkpoint is already due, and takes this commit too.
                let _ = writes.pokes.try_send(());
            }
        }
        if Instant::now() >= next_sweep && !writes.broken.load(Ordering::Acquire) {
            let full = sweep(&tx, clock.now(), stats);
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

/// Runs `batch` as one transaction, then answers each write that changed nothing and
/// hands the others to the syncer. The writes run one after another, without
/// savepoints (each would journal every page it touches a second time); should one
/// fail (a full disk), the transaction is undone and run again with each write in a
/// savepoint of its own, so that the one that failed is undone alone and the others
/// still commit.
fn commit(tx: &Tx<'_>, mut batch: Vec<Box<dyn Job>>, now: Millis, writes: &Writes, stats: &CommitFigures) {
    let conn = tx.conn;
    batch.retain(|job| job.wanted());
    if batch.is_empty() {
        return;
    }
    let begin = |batch: Vec<Box<dyn Job>>| match conn.execute_batch("BEGIN IMMEDIATE") {
        Ok(()) => Some(batch),
        Err(error) => {
            refuse_all(batch, &disk_error(&error, false));
            None
        }
    };
    let Some(mut batch) = begin(batch) else {
        return;
    };
    // Which writes changed a row: only those wait for the fsync.
    let mut wrote = vec![false; batch.len()];
    let mut run_all = |batch: &mut [Box<dyn Job>], alone: bool| {
        for (job, wrote) in batch.iter_mut().zip(wrote.iter_mut()) {
            let before = conn.total_changes();
            let succeeded = job.run(tx, now, alone);
            *wrote = conn.total_changes() != before;
            if !succeeded && !alone {
                return false;
            }
        }
        true
    };
    if !run_all(&mut batch, false) {
        let _ = conn.execute_batch("ROLLBACK");
        tx.forget();
        let Some(again) = begin(batch) else {
            return;
        };
        batch = again;
        run_all(&mut batch, true);
    }
    let began = Instant::now();
    if let Err(failure) = finish(tx) {
        for job in batch {
            job.answer(&Err(failure.clone()));
        }
        return;
    }
    stats.commits.inc();
    stats.writes.inc_by(batch.len() as u64);
    // What changed nothing, or need only be committed, is answered now.
    let mut written = Vec::with_capacity(batch.len());
    for (job, wrote) in batch.into_iter().zip(wrote) {
        match wrote && job.durable() {
            true => written.push(job),
            false => job.answer(&Ok(())),
        }
    }
    if written.is_empty() {
        return;
    }
    if let Err(mpsc::SendError(lost)) = writes.synced.send(Written { jobs: written, began }) {
        for job in lost.jobs {
            job.answer(&Err(broken()));
        }
    }
}

/// Answers every write in `batch` with `failure`; none is run.
fn refuse_all(batch: Vec<Box<dyn Job>>, failure: &DiskError) {
    for job in batch {
        job.refuse(failure);
    }
}

/// What a write hears once a commit (where it may have landed) or an fsync of the log
/// failed.
fn broken() -> DiskError {
    DiskError {
        message: "a commit or an fsync of the store's log failed: what is on disk is unknown until the proxy is \
                  restarted"
            .into(),
        may_have_written: true,
    }
}

/// The syncer: fsyncs the write-ahead log once for every commit the writer wrote
/// since its last fsync, then answers their callers, oldest first.
struct Syncer {
    log: PathBuf,
    stats: CommitFigures,
    broken: Arc<AtomicBool>,
    #[cfg(feature = "test-util")]
    fsyncs: Arc<tokio::sync::RwLock<()>>,
}

impl Syncer {
    fn run(self, to_sync: &Receiver<Written>) {
        let mut log: Option<File> = None;
        while let Ok(first) = to_sync.recv() {
            let mut commits = vec![first];
            commits.extend(to_sync.try_iter());
            let synced = match self.broken.load(Ordering::Acquire) {
                true => Err(broken()),
                false => self.sync(&mut log),
            };
            if synced.is_err() {
                self.broken.store(true, Ordering::Release);
            }
            for commit in commits {
                if synced.is_ok() {
                    self.stats.commit_seconds.observe(commit.began.elapsed().as_secs_f64());
                }
                for job in commit.jobs {
                    job.answer(&synced);
                }
            }
        }
    }

    /// One fsync of the log (its data and size: `fdatasync`), opened at the first.
    fn sync(&self, log: &mut Option<File>) -> Result<(), DiskError> {
        #[cfg(feature = "test-util")]
        let _open = self.fsyncs.blocking_read();
        let failed = |error: std::io::Error| {
            tracing::error!(%error, log = %self.log.display(), "cannot fsync the store's log: \
                            the store takes no write until the proxy is restarted");
            broken()
        };
        let file = match log {
            Some(file) => file,
            // SQLite made the log when the store opened the file in write-ahead mode,
            // and keeps it while any connection is open (file.rs refuses a link).
            None => log.insert(File::open(&self.log).map_err(failed)?),
        };
        file.sync_data().map_err(failed)
    }
}

/// Deletes up to `SWEEP_BATCH` expired records, and drops up to as many responses
/// past their retention (their record kept: docs/design.md §24), each in a
/// transaction of its own: whether either found as many (more may be left).
fn sweep(tx: &Tx<'_>, now: Millis, stats: &CommitFigures) -> bool {
    let dropped = in_transaction(tx, |tx| super::drop_responses(tx, now, SWEEP_BATCH));
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
    let deleted = in_transaction(tx, |tx| super::delete_expired(tx, now, SWEEP_BATCH));
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

/// Runs `op` in a transaction of its own, the shares it changed written back with it.
fn in_transaction(tx: &Tx<'_>, op: impl FnOnce(&Tx<'_>) -> Result<usize, StoreError>) -> Result<usize, StoreError> {
    tx.execute_batch("BEGIN IMMEDIATE")
        .map_err(|error| disk(&error, false))?;
    match op(tx) {
        Ok(done) => finish(tx).map(|()| done).map_err(StoreError::Disk),
        Err(error) => {
            let _ = tx.execute_batch("ROLLBACK");
            tx.forget();
            Err(error)
        }
    }
}

/// Ends the open transaction: writes the shares it changed back and commits it, and
/// publishes what it changed in the index of keys; or, should either fail, rolls it
/// back and forgets what the shares and the index kept of it. A commit that failed
/// where it may have landed (an I/O error, not a full disk) leaves the rows it wrote
/// unknown, and the index of keys with them: the store takes no write again until a
/// restart reads both from the file, as after a failed fsync.
fn finish(tx: &Tx<'_>) -> Result<(), DiskError> {
    let committed = match tx.shares.borrow_mut().write_back(tx) {
        Ok(()) => tx.execute_batch("COMMIT").map_err(|error| disk_error(&error, true)),
        Err(error) => Err(disk_error(&error, false)),
    };
    // A commit that landed and was reported failed, as an I/O error after the write can.
    #[cfg(feature = "test-util")]
    let committed = match committed {
        Ok(()) if tx.failing.swap(false, Ordering::AcqRel) => Err(DiskError {
            message: "disk I/O error (planted by the test)".into(),
            may_have_written: true,
        }),
        other => other,
    };
    match &committed {
        Ok(()) => tx.staged.borrow_mut().publish(tx.keys),
        Err(failure) => {
            if !tx.is_autocommit() {
                let _ = tx.execute_batch("ROLLBACK");
            }
            tx.forget();
            if failure.may_have_written {
                tracing::error!(%failure, "a commit of the store failed where it may have landed: \
                                the store takes no write until the proxy is restarted");
                tx.broken.store(true, Ordering::Release);
            }
        }
    }
    committed
}
