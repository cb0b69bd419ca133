//! What the records hold, in all and per scope and client address (the `shares`
//! table: docs/design.md §21), kept by the writer in memory between its commits and
//! written back once per commit, in the same transaction as the records that changed
//! them (docs/design.md §27). Triggers kept them before schema step 5: three statements
//! on every write, each in a statement journal of its own.
//!
//! A share is read from the table the first time a commit needs it, and kept. Each
//! change is undone if the write that made it is (a write run alone in a savepoint
//! that failed), and all of them are forgotten when a transaction is rolled back: the
//! table, as last committed, is then what holds.

use std::collections::{HashMap, HashSet};

use rusqlite::{Connection, OptionalExtension};

use crate::store::lifecycle::Share;
use crate::store::{ClientId, ScopeId};

/// A share's row in the table: its kind (0: the store, 1: a scope, 2: a client
/// address, 3: the records whose response was dropped) and its id.
pub(super) type Row = (i64, i64);

const STORE: Row = (0, 0);
const SPENT: Row = (3, 0);

/// How many shares are kept between commits; past it, the kept ones are let go.
const KEPT: usize = 4096;

#[derive(Debug, Default)]
pub(super) struct Shares {
    /// (records, bytes) of each share read or changed.
    kept: HashMap<Row, (i64, i64)>,
    /// Those changed since the last write-back.
    dirty: HashSet<Row>,
    /// What each change replaced, newest last: undone back to a mark.
    undo: Vec<(Row, (i64, i64))>,
}

/// Where a record is counted: its scope and client address, as the row keeps them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Counted {
    pub(super) scope: Option<i64>,
    pub(super) client: Option<i64>,
}

impl Shares {
    /// What `share` holds: (records, bytes).
    pub(super) fn get(&mut self, conn: &Connection, share: Share) -> rusqlite::Result<(i64, i64)> {
        self.read(conn, row(share))
    }

    /// A record of `size` bytes was written.
    pub(super) fn added(&mut self, conn: &Connection, counted: Counted, size: i64) -> rusqlite::Result<()> {
        self.add(conn, STORE, 1, size)?;
        if let Some(scope) = counted.scope {
            self.add(conn, (1, scope), 1, size)?;
        }
        if let Some(client) = counted.client {
            self.add(conn, (2, client), 1, 0)?;
        }
        Ok(())
    }

    /// A record of `size` bytes was deleted; `spent`: its response had been dropped.
    pub(super) fn removed(
        &mut self,
        conn: &Connection,
        counted: Counted,
        size: i64,
        spent: bool,
    ) -> rusqlite::Result<()> {
        self.add(conn, STORE, -1, -size)?;
        if let Some(scope) = counted.scope {
            self.add(conn, (1, scope), -1, -size)?;
        }
        if let Some(client) = counted.client {
            self.add(conn, (2, client), -1, 0)?;
        }
        if spent {
            self.add(conn, SPENT, -1, 0)?;
        }
        Ok(())
    }

    /// A record in `scope` changed size by `by` bytes.
    pub(super) fn resized(&mut self, conn: &Connection, scope: Option<i64>, by: i64) -> rusqlite::Result<()> {
        if by == 0 {
            return Ok(());
        }
        self.add(conn, STORE, 0, by)?;
        if let Some(scope) = scope {
            self.add(conn, (1, scope), 0, by)?;
        }
        Ok(())
    }

    /// A record's response was dropped (or a record came without it): it is spent.
    pub(super) fn spent(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        self.add(conn, SPENT, 1, 0)
    }

    /// Where the changes stand now, to undo back to.
    pub(super) fn mark(&self) -> usize {
        self.undo.len()
    }

    /// Undoes the changes made since `mark`.
    pub(super) fn undo_to(&mut self, mark: usize) {
        while self.undo.len() > mark {
            if let Some((row, was)) = self.undo.pop() {
                self.kept.insert(row, was);
            }
        }
    }

    /// Writes every changed share into the table, in the commit's transaction: a share
    /// of a scope or an address that holds no record is deleted.
    pub(super) fn write_back(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        for row in self.dirty.drain() {
            let (records, bytes) = self.kept.get(&row).copied().unwrap_or_default();
            let written = match row.0 > 0 && records == 0 {
                true => conn
                    .prepare_cached("DELETE FROM shares WHERE kind = ?1 AND id = ?2")
                    .and_then(|mut statement| statement.execute(row)),
                false => conn
                    .prepare_cached(
                        "INSERT INTO shares (kind, id, records, bytes) VALUES (?1, ?2, ?3, ?4) \
                         ON CONFLICT (kind, id) DO UPDATE SET records = excluded.records, bytes = excluded.bytes",
                    )
                    .and_then(|mut statement| statement.execute((row.0, row.1, records, bytes))),
            };
            written?;
        }
        self.undo.clear();
        if self.kept.len() > KEPT {
            self.kept.clear();
        }
        Ok(())
    }

    /// The transaction was rolled back: the table holds what is true.
    pub(super) fn forget(&mut self) {
        self.kept.clear();
        self.dirty.clear();
        self.undo.clear();
    }

    fn add(&mut self, conn: &Connection, row: Row, records: i64, bytes: i64) -> rusqlite::Result<()> {
        let was = self.read(conn, row)?;
        self.undo.push((row, was));
        self.kept.insert(row, (was.0 + records, was.1 + bytes));
        self.dirty.insert(row);
        Ok(())
    }

    fn read(&mut self, conn: &Connection, row: Row) -> rusqlite::Result<(i64, i64)> {
        if let Some(held) = self.kept.get(&row) {
            return Ok(*held);
        }
        let held = read(conn, row)?;
        self.kept.insert(row, held);
        Ok(held)
    }
}

/// The row in the table that keeps `share`.
pub(super) fn row(share: Share) -> Row {
    match share {
        Share::Store => STORE,
        Share::Scope(ScopeId(scope)) => (1, scope as i64),
        Share::Client(ClientId(client)) => (2, client as i64),
    }
}

/// What `row` holds in the table, as last committed: (records, bytes).
pub(super) fn read(conn: &Connection, row: Row) -> rusqlite::Result<(i64, i64)> {
    conn.prepare_cached("SELECT records, bytes FROM shares WHERE kind = ?1 AND id = ?2")
        .and_then(|mut statement| {
            statement
                .query_row(row, |found| Ok((found.get(0)?, found.get(1)?)))
                .optional()
        })
        .map(Option::unwrap_or_default)
}
