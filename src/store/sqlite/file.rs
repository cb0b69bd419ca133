//! The SQLite store's file: who may open it, what it must be, and its schema.
//!
//! One process per file: the process holds an exclusive `flock` on the database file
//! itself for as long as the store is open, so a second process refuses to start
//! however it names the file (a symlink, a hard link) and names the holder (from
//! `/proc/locks`, or the pid written in `<file>.lock`). SQLite's own locks are POSIX
//! record locks, which `flock` does not meet on a local file system.
//!
//! Refuse what others may write (docs/design.md §17): a directory writable by group or
//! others, or owned by another user; a file (or its `-wal`, `-shm`, `.lock`) that is a
//! symbolic link, is owned by another user, or is writable by group or others. Files
//! are created 0600 before SQLite opens them (SQLite then makes `-wal` and `-shm`
//! alike), and a readable one left by an older release is made 0600.
//!
//! A file that is not this store's is refused
//! and left as it is: not a SQLite database, corrupt (`PRAGMA quick_check`), another
//! application's (`PRAGMA application_id`), or written by a newer version (`PRAGMA
//! user_version`). It is read by a read-only connection first, which never writes
//! it; only a file found to be this store's is opened for writing. A missing or empty
//! file becomes a new store. The schema is built by its steps, each a migration: a
//! new file runs them all, an older one the steps it lacks, all in one transaction.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::error::StoreFileError;

/// `PRAGMA application_id` of every file this store writes: "idmp".
pub const APPLICATION_ID: i32 = 0x6964_6d70;

/// The schema's steps: `user_version` is the number of them a file has run.
const STEPS: [&str; 6] = [RECORDS, SHARES, CLIENTS, REMEMBER, LEAN, KEYS];

/// The schema version this build writes.
pub const VERSION: i32 = STEPS.len() as i32;

/// Step 1: the records and the process-wide settings.
const RECORDS: &str = "
CREATE TABLE meta (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
) STRICT;
CREATE TABLE records (
    key TEXT NOT NULL UNIQUE,
    fingerprint BLOB NOT NULL,
    expires_at INTEGER NOT NULL,
    scope INTEGER,
    client INTEGER,
    state TEXT NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    owner BLOB,
    lease_until INTEGER,
    status INTEGER,
    headers BLOB,
    body BLOB,
    reason TEXT,
    probe_due INTEGER,
    probe_give_up INTEGER,
    probe_key TEXT,
    size INTEGER NOT NULL
) STRICT;
CREATE INDEX records_expiry ON records (expires_at);
CREATE INDEX records_scope ON records (scope, expires_at) WHERE scope IS NOT NULL;
CREATE INDEX records_client ON records (client, expires_at) WHERE client IS NOT NULL AND scope IS NOT NULL;
CREATE INDEX records_unsettled ON records (state) WHERE state != 'completed';
";

/// Step 2: what the records hold, in all (kind 0), per scope (1) and per client
/// address (2), kept by triggers in the same transaction as every change.
const SHARES: &str = "
CREATE TABLE shares (
    kind INTEGER NOT NULL,
    id INTEGER NOT NULL,
    records INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (kind, id)
) STRICT, WITHOUT ROWID;
INSERT INTO shares (kind, id, records, bytes)
    SELECT 0, 0, count(*), coalesce(sum(size), 0) FROM records;
INSERT INTO shares (kind, id, records, bytes)
    SELECT 1, scope, count(*), sum(size) FROM records WHERE scope IS NOT NULL GROUP BY scope;
INSERT INTO shares (kind, id, records, bytes)
    SELECT 2, client, count(*), 0 FROM records WHERE scope IS NOT NULL AND client IS NOT NULL GROUP BY client;
CREATE TRIGGER records_added AFTER INSERT ON records BEGIN
    UPDATE shares SET records = records + 1, bytes = bytes + NEW.size WHERE kind = 0;
    INSERT INTO shares (kind, id, records, bytes) SELECT 1, NEW.scope, 1, NEW.size WHERE NEW.scope IS NOT NULL
        ON CONFLICT DO UPDATE SET records = records + 1, bytes = bytes + excluded.bytes;
    INSERT INTO shares (kind, id, records, bytes) SELECT 2, NEW.client, 1, 0
        WHERE NEW.scope IS NOT NULL AND NEW.client IS NOT NULL
        ON CONFLICT DO UPDATE SET records = records + 1;
END;
CREATE TRIGGER records_removed AFTER DELETE ON records BEGIN
    UPDATE shares SET records = records - 1, bytes = bytes - OLD.size WHERE kind = 0;
    UPDATE shares SET records = records - 1, bytes = bytes - OLD.size WHERE kind = 1 AND id = OLD.scope;
    UPDATE shares SET records = records - 1
        WHERE kind = 2 AND id = OLD.client AND OLD.scope IS NOT NULL;
    DELETE FROM shares WHERE kind > 0 AND records = 0;
END;
CREATE TRIGGER records_resized AFTER UPDATE OF size ON records WHEN NEW.size != OLD.size BEGIN
    UPDATE shares SET bytes = bytes + NEW.size - OLD.size WHERE kind = 0;
    UPDATE shares SET bytes = bytes + NEW.size - OLD.size WHERE kind = 1 AND id = NEW.scope;
END;
";

/// Step 3 (issue 49): a client address's share counts every record it made, on
/// routes without scope too (one address filled the store for everyone), so the
/// client index and the triggers drop their `scope IS NOT NULL`. Records written
/// before it on routes without scope kept no client, and are counted for none.
const CLIENTS: &str = "
DROP INDEX records_client;
CREATE INDEX records_client ON records (client, expires_at) WHERE client IS NOT NULL;
DROP TRIGGER records_added;
DROP TRIGGER records_removed;
DELETE FROM shares WHERE kind = 2;
INSERT INTO shares (kind, id, records, bytes)
    SELECT 2, client, count(*), 0 FROM records WHERE client IS NOT NULL GROUP BY client;
CREATE TRIGGER records_added AFTER INSERT ON records BEGIN
    UPDATE shares SET records = records + 1, bytes = bytes + NEW.size WHERE kind = 0;
    INSERT INTO shares (kind, id, records, bytes) SELECT 1, NEW.scope, 1, NEW.size WHERE NEW.scope IS NOT NULL
        ON CONFLICT DO UPDATE SET records = records + 1, bytes = bytes + excluded.bytes;
    INSERT INTO shares (kind, id, records, bytes) SELECT 2, NEW.client, 1, 0 WHERE NEW.client IS NOT NULL
        ON CONFLICT DO UPDATE SET records = records + 1;
END;
CREATE TRIGGER records_removed AFTER DELETE ON records BEGIN
    UPDATE shares SET records = records - 1, bytes = bytes - OLD.size WHERE kind = 0;
    UPDATE shares SET records = records - 1, bytes = bytes - OLD.size WHERE kind = 1 AND id = OLD.scope;
    UPDATE shares SET records = records - 1 WHERE kind = 2 AND id = OLD.client;
    DELETE FROM shares WHERE kind > 0 AND records = 0;
END;
";

/// Step 4 (issue 51, `remember`): a record may outlive its response. `response_until`
/// is when a completed record's headers and body are dropped (NULL: with the record,
/// as before), `completed_at` when its operation completed, which a 410 names. The
/// index holds only the records whose response is still to drop, for the sweeper.
/// The records whose response was dropped are counted under kind 3 (for
/// `idemproxy_store_spent_records`), by triggers like the shares'.
const REMEMBER: &str = "
ALTER TABLE records ADD COLUMN response_until INTEGER;
ALTER TABLE records ADD COLUMN completed_at INTEGER;
CREATE INDEX records_response ON records (response_until)
    WHERE response_until IS NOT NULL AND body IS NOT NULL;
CREATE TRIGGER records_spent AFTER UPDATE OF body ON records
    WHEN OLD.body IS NOT NULL AND NEW.body IS NULL AND NEW.state = 'completed' BEGIN
    INSERT INTO shares (kind, id, records, bytes) VALUES (3, 0, 1, 0)
        ON CONFLICT DO UPDATE SET records = records + 1;
END;
CREATE TRIGGER records_spent_removed AFTER DELETE ON records
    WHEN OLD.state = 'completed' AND OLD.body IS NULL AND OLD.response_until IS NOT NULL BEGIN
    UPDATE shares SET records = records - 1 WHERE kind = 3;
END;
";

/// Step 5 (issue 54, docs/design.md §27): less work on every write. The shares are
/// kept by the writer and written back once a commit (shares.rs), where five triggers
/// ran on every write, each in a statement journal; and the index of records not
/// completed goes (only a start reads them, and it reads the table). The records stay
/// in insertion order (a rowid table with its unique key index): a fresh key's row is
/// appended to the pages the last claims wrote, and its completion rewrites them,
/// where a table keyed by the key (a hash) put each on a page of its own, and a commit
/// wrote twice the log (measured: docs/performance.md).
const LEAN: &str = "
DROP TRIGGER records_added;
DROP TRIGGER records_removed;
DROP TRIGGER records_resized;
DROP TRIGGER records_spent;
DROP TRIGGER records_spent_removed;
DROP INDEX records_unsettled;
";

/// Step 6 (issue 54, docs/design.md §27): no index of the keys. The keys are hashes,
/// so their index put each fresh key's entry on a page of its own, which its claim's
/// commit wrote to the log and the checkpoint into the file: most of the 10 KB the
/// disk took for each fresh request. The store keeps where each key's row is in
/// memory instead (keys.rs), read from the table when it opens. The table is built
/// again without `UNIQUE` on `key` (SQLite drops no column constraint in place), each
/// row under its rowid.
const KEYS: &str = "
CREATE TABLE records_without_key_index (
    key TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    expires_at INTEGER NOT NULL,
    scope INTEGER,
    client INTEGER,
    state TEXT NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    owner BLOB,
    lease_until INTEGER,
    status INTEGER,
    headers BLOB,
    body BLOB,
    reason TEXT,
    probe_due INTEGER,
    probe_give_up INTEGER,
    probe_key TEXT,
    size INTEGER NOT NULL,
    response_until INTEGER,
    completed_at INTEGER
) STRICT;
INSERT INTO records_without_key_index (rowid, key, fingerprint, expires_at, scope, client, state, owner,
    lease_until, status, headers, body, reason, probe_due, probe_give_up, probe_key, size, response_until,
    completed_at)
    SELECT rowid, key, fingerprint, expires_at, scope, client, state, owner, lease_until, status, headers, body,
        reason, probe_due, probe_give_up, probe_key, size, response_until, completed_at FROM records;
DROP TABLE records;
ALTER TABLE records_without_key_index RENAME TO records;
CREATE INDEX records_expiry ON records (expires_at);
CREATE INDEX records_scope ON records (scope, expires_at) WHERE scope IS NOT NULL;
CREATE INDEX records_client ON records (client, expires_at) WHERE client IS NOT NULL;
CREATE INDEX records_response ON records (response_until)
    WHERE response_until IS NOT NULL AND body IS NOT NULL;
";

/// The exclusive lock on a store file: held while this value lives. The database's
/// own descriptor is never closed while SQLite has it open (closing any descriptor of
/// a file drops the process's POSIX locks on it): the store drops this last.
#[derive(Debug)]
pub(crate) struct FileLock {
    _database: File,
    _pid: File,
}

/// Checks where `path` lives and what is there, takes the database file's lock (or
/// says which process holds it), and writes this process's pid in `<path>.lock`.
pub(crate) fn lock(path: &Path) -> Result<FileLock, StoreFileError> {
    check_directory(path)?;
    for companion in ["-wal", "-shm", ".lock"] {
        let companion = suffixed(path, companion);
        match std::fs::symlink_metadata(&companion) {
            Ok(_) => {
                // Opened, checked and made 0600, then closed: no SQLite connection
                // is open yet, so closing it drops no lock of SQLite's.
                own_file(&companion, "open the store's companion file")?;
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(StoreFileError::Io {
                    path: companion,
                    what: "read its metadata",
                    source,
                });
            }
        }
    }
    let database = own_file(path, "open the store file")?;
    let pid_path = suffixed(path, ".lock");
    match database.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = holder(&database, &pid_path);
            return Err(StoreFileError::InUse {
                path: path.to_path_buf(),
                holder,
            });
        }
        Err(std::fs::TryLockError::Error(source)) => {
            return Err(StoreFileError::Io {
                path: path.to_path_buf(),
                what: "lock the store file",
                source,
            });
        }
    }
    let mut pid = own_file(&pid_path, "open the lock file")?;
    let written = pid
        .set_len(0)
        .and_then(|()| pid.rewind())
        .and_then(|()| writeln!(pid, "{}", std::process::id()));
    written.map_err(|source| StoreFileError::Io {
        path: pid_path,
        what: "write the lock file",
        source,
    })?;
    Ok(FileLock {
        _database: database,
        _pid: pid,
    })
}

/// Refuses a directory that a user other than this process's (or root) owns, or that
/// group or others may write: whoever can write it can put a link or a file of their
/// own where the store's files go.
fn check_directory(path: &Path) -> Result<(), StoreFileError> {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(directory).map_err(|source| StoreFileError::Io {
        path: directory.to_path_buf(),
        what: "read the store directory's metadata",
        source,
    })?;
    let refused = |reason: String| {
        Err(StoreFileError::Unsafe {
            path: path.to_path_buf(),
            reason,
        })
    };
    let user = rustix::process::geteuid().as_raw();
    if meta.uid() != user && meta.uid() != 0 {
        return refused(format!(
            "its directory {} is owned by uid {}, not by this process's user (uid {user}) or root: put the store in a directory of its own",
            directory.display(),
            meta.uid()
        ));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return refused(format!(
            "its directory {} is writable by {} (mode {mode:o}): another user could plant a link or a file where the store's files go; `chmod go-w` it, or put the store in a directory of its own",
            directory.display(),
            writers(mode)
        ));
    }
    Ok(())
}

fn writers(mode: u32) -> &'static str {
    match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (true, true) => "group and others",
        (true, false) => "its group",
        _ => "others",
    }
}

/// Opens (creating it 0600 if missing) one of the store's files for reading and
/// writing, never through a symbolic link, and checks what was opened: a regular file
/// of this process's user that group and others cannot write.
fn own_file(path: &Path, what: &'static str) -> Result<File, StoreFileError> {
    let io = |what: &'static str| {
        move |source| StoreFileError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let refused = |reason: String| {
        Err(StoreFileError::Unsafe {
            path: path.to_path_buf(),
            reason,
        })
    };
    let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() | rustix::fs::OFlags::CLOEXEC.bits();
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nofollow.cast_signed())
        .open(path);
    let file = match opened {
        Ok(file) => file,
        // O_NOFOLLOW on a link: ELOOP, whether the link dangles or not.
        Err(error) if error.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            return refused("it is a symbolic link: the store's files are never opened through one".into());
        }
        Err(error) if error.kind() == std::io::ErrorKind::IsADirectory => {
            return Err(StoreFileError::CannotOpen {
                path: path.to_path_buf(),
                reason: "it is a directory".into(),
            });
        }
        Err(source) => return Err(io(what)(source)),
    };
    let meta = file.metadata().map_err(io("read its metadata"))?;
    if !meta.is_file() {
        return Err(StoreFileError::CannotOpen {
            path: path.to_path_buf(),
            reason: "it is not a regular file".into(),
        });
    }
    let user = rustix::process::geteuid().as_raw();
    if meta.uid() != user {
        return refused(format!(
            "it is owned by uid {}, not by this process's user (uid {user}): another user could have written its records",
            meta.uid()
        ));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return refused(format!(
            "it is writable by {} (mode {mode:o}): another user could have written its records; check it, then `chmod 600` it",
            writers(mode)
        ));
    }
    Ok(file)
}

/// Makes the store's files (found to be its own) readable by their owner only, where
/// an older release left them readable by others (0644 under umask 022).
fn tighten(path: &Path) -> Result<(), StoreFileError> {
    for name in [
        path.to_path_buf(),
        suffixed(path, "-wal"),
        suffixed(path, "-shm"),
        suffixed(path, ".lock"),
    ] {
        // Each was opened without following a link and checked by `lock`; SQLite
        // opened the rest with O_NOFOLLOW.
        let Ok(meta) = std::fs::symlink_metadata(&name) else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o7777;
        if !meta.is_file() || mode & 0o077 == 0 {
            continue;
        }
        std::fs::set_permissions(&name, std::fs::Permissions::from_mode(0o600)).map_err(|source| {
            StoreFileError::Io {
                path: name.clone(),
                what: "make it readable by its owner only",
                source,
            }
        })?;
        tracing::info!(file = %name.display(), was = format!("{mode:o}"), "made the store's file readable by its owner only (0600)");
    }
    Ok(())
}

/// Who holds the lock on `database`: the pid `/proc/locks` gives for its device and
/// inode, else the one written in the lock file.
fn holder(database: &File, pid_path: &Path) -> String {
    let from_proc = database.metadata().ok().and_then(|meta| {
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        let (dev, ino) = (meta.dev(), meta.ino());
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
        let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
        let wanted = format!("{major:02x}:{minor:02x}:{ino}");
        locks.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let at = fields.iter().position(|field| *field == "FLOCK")?;
            let (pid, file) = (fields.get(at + 3)?, fields.get(at + 4)?);
            (*file == wanted).then(|| pid.to_string())
        })
    });
    let pid = from_proc.or_else(|| {
        let mut text = String::new();
        File::open(pid_path).ok()?.read_to_string(&mut text).ok()?;
        Some(text.trim().to_string()).filter(|pid| !pid.is_empty())
    });
    match pid {
        Some(pid) => format!("pid {pid}"),
        None => "pid unknown".to_string(),
    }
}

pub(super) fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Checks the file at `path` (under its lock) and opens it for writing, creating it
/// when it is missing or empty, migrating it when it is older.
pub(crate) fn open(path: &Path) -> Result<Connection, StoreFileError> {
    let existing = match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            return Err(StoreFileError::CannotOpen {
                path: path.to_path_buf(),
                reason: "it is a directory".into(),
            });
        }
        Ok(meta) => meta.len() > 0,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => false,
        Err(source) => {
            return Err(StoreFileError::Io {
                path: path.to_path_buf(),
                what: "read its metadata",
                source,
            });
        }
    };
    if existing {
        // SQLite says only "unable to open database file": the system says why.
        File::open(path).map_err(|source| StoreFileError::Io {
            path: path.to_path_buf(),
            what: "read it",
            source,
        })?;
    }
    let version = if existing { inspect(path)? } else { 0 };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    let mut conn = Connection::open_with_flags(path, flags).map_err(|error| cannot_open(path, &error))?;
    let journal: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
        .map_err(|error| cannot_open(path, &error))?;
    if !journal.eq_ignore_ascii_case("wal") {
        return Err(StoreFileError::CannotOpen {
            path: path.to_path_buf(),
            reason: format!("SQLite would not use write-ahead logging on it (journal mode {journal})"),
        });
    }
    if version < VERSION {
        migrate(&mut conn, version).map_err(|error| StoreFileError::Migration {
            path: path.to_path_buf(),
            from: version,
            to: VERSION,
            reason: error.to_string(),
        })?;
    }
    tighten(path)?;
    Ok(conn)
}

/// Reads an existing file without writing it: its schema version, once it is known
/// to be a sound database of this store's.
fn inspect(path: &Path) -> Result<i32, StoreFileError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    let conn = Connection::open_with_flags(path, flags).map_err(|error| cannot_open(path, &error))?;
    // A file that is not a database fails its first read.
    let application: i32 = conn
        .pragma_query_value(None, "application_id", |row| row.get(0))
        .map_err(|error| refused(path, &error))?;
    let version: i32 = conn
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .map_err(|error| refused(path, &error))?;
    if application != APPLICATION_ID {
        let tables: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name LIMIT 5")
            .and_then(|mut statement| {
                statement
                    .query_map([], |row| row.get::<_, String>(0))?
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(|error| refused(path, &error))?;
        // An empty database (this store's own, cut off before its first commit, or
        // one `sqlite3` made) holds no records: starting on it loses nothing.
        if application == 0 && version == 0 && tables.is_empty() {
            return Ok(0);
        }
        let tables = match tables.is_empty() {
            true => "no tables".to_string(),
            false => format!("tables {}", tables.join(", ")),
        };
        return Err(StoreFileError::Foreign {
            path: path.to_path_buf(),
            detail: format!("application_id {application:#x}, not idemproxy's {APPLICATION_ID:#x}; {tables}"),
        });
    }
    if version > VERSION {
        return Err(StoreFileError::Newer {
            path: path.to_path_buf(),
            found: version,
            known: VERSION,
        });
    }
    let problems: Vec<String> = conn
        .prepare("PRAGMA quick_check(5)")
        .and_then(|mut statement| {
            statement
                .query_map([], |row| row.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(|error| refused(path, &error))?;
    if problems != ["ok"] {
        return Err(StoreFileError::Corrupt {
            path: path.to_path_buf(),
            detail: problems.join("; "),
        });
    }
    Ok(version)
}

/// Runs the steps after `from` in one transaction: all of them, or none.
fn migrate(conn: &mut Connection, from: i32) -> rusqlite::Result<()> {
    let transaction = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    if from == 0 {
        transaction.pragma_update(None, "application_id", APPLICATION_ID)?;
    }
    for step in STEPS.iter().skip(usize::try_from(from).unwrap_or(0)) {
        transaction.execute_batch(step)?;
    }
    transaction.pragma_update(None, "user_version", VERSION)?;
    transaction.commit()
}

/// Creates a store file at schema version `version` only, as an older idemproxy would
/// have: for the migration tests.
#[cfg(feature = "test-util")]
pub fn create_at_version(path: &Path, version: i32) -> rusqlite::Result<Connection> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    let transaction = conn.transaction()?;
    transaction.pragma_update(None, "application_id", APPLICATION_ID)?;
    for step in STEPS.iter().take(usize::try_from(version).unwrap_or(0)) {
        transaction.execute_batch(step)?;
    }
    transaction.pragma_update(None, "user_version", version)?;
    transaction.commit()?;
    Ok(conn)
}

fn cannot_open(path: &Path, error: &rusqlite::Error) -> StoreFileError {
    StoreFileError::CannotOpen {
        path: path.to_path_buf(),
        reason: error.to_string(),
    }
}

/// What a failed read of an existing file says about it.
fn refused(path: &Path, error: &rusqlite::Error) -> StoreFileError {
    use rusqlite::ErrorCode;
    match error.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => StoreFileError::NotADatabase {
            path: path.to_path_buf(),
        },
        Some(ErrorCode::DatabaseCorrupt) => StoreFileError::Corrupt {
            path: path.to_path_buf(),
            detail: error.to_string(),
        },
        _ => cannot_open(path, error),
    }
}
