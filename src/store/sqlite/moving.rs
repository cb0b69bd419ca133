//! Moving records into and out of the SQLite file (`store::moving`): a page of live
//! records in the file's order (by rowid: the table has no index of its keys), read
//! on a read connection; and a batch written in one of the writer's commits, each row
//! only where the key holds no live record.

use std::time::Duration;

use bytes::Bytes;
use rusqlite::{Connection, params};

use super::shares::Counted;
use super::writer::{Millis, Tx, disk};
use super::{RECORD_OVERHEAD, SqliteStore, millis, until};
use crate::error::StoreError;
use crate::store::moving::{self, Carried, CarriedSchedule, CarriedState, Cursor, Imported, RawResponse};
use crate::store::{Fingerprint, OwnerToken, StoreKey, UnknownReason};

const PAGE: &str = "SELECT key, fingerprint, expires_at, state, owner, lease_until, status, headers, body, reason, \
                    probe_due, probe_give_up, response_until, completed_at, rowid FROM records \
                    WHERE rowid > ?1 AND expires_at > ?2 ORDER BY rowid LIMIT ?3";

impl SqliteStore {
    /// Up to `limit` live records after `cursor`, in the file's order.
    pub(crate) fn export(&self, cursor: &Cursor, limit: usize) -> Result<(Vec<Carried>, Cursor), StoreError> {
        let after = match cursor {
            Cursor::Start => 0,
            Cursor::Row(rowid) => *rowid,
            Cursor::After(_) | Cursor::Scan(_) | Cursor::End => return Ok((Vec::new(), Cursor::End)),
        };
        let (records, last) = self.read(|conn, now| page(conn, after, now, limit))?;
        let next = match last {
            Some(last) if records.len() == limit => Cursor::Row(last),
            _ => Cursor::End,
        };
        Ok((records, next))
    }

    /// Writes each record where its key holds no live one, in one commit.
    pub(crate) async fn import(&self, records: Vec<Carried>) -> Result<Imported, StoreError> {
        let records = std::sync::Arc::new(records);
        self.write(move |conn, now| {
            let mut imported = Imported::default();
            for record in records.iter().filter(|record| !record.ttl.is_zero()) {
                match insert(conn, record, now)? {
                    true => imported.written += 1,
                    false => imported.kept += 1,
                }
            }
            Ok(imported)
        })
        .await
    }
}

/// The page's records, and the last one's rowid.
fn page(conn: &Connection, after: i64, now: Millis, limit: usize) -> Result<(Vec<Carried>, Option<i64>), StoreError> {
    let mut statement = conn.prepare_cached(PAGE).map_err(|error| disk(&error, false))?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = statement
        .query_map(params![after, now, limit], |row| {
            let blob = |index: usize| row.get::<_, Option<Vec<u8>>>(index);
            let number = |index: usize| row.get::<_, Option<i64>>(index);
            let key: String = row.get(0)?;
            let fingerprint = Fingerprint::from_bytes(&row.get::<_, Vec<u8>>(1)?);
            let expires_at: i64 = row.get(2)?;
            let state: String = row.get(3)?;
            let owner = blob(4)?.and_then(|owner| OwnerToken::from_bytes(&owner));
            let response_until = number(12)?;
            let (ttl, response_ttl) = (until(now, expires_at), response_until.map(|at| until(now, at)));
            let key = StoreKey::from_derived(key);
            let state = match (state.as_str(), owner) {
                ("in_flight", Some(owner)) => {
                    let expired = number(5)?.is_none_or(|lease_until| lease_until <= now);
                    let mut moved = Carried::in_flight(key.clone(), Fingerprint([0; 32]), ttl, response_ttl, owner);
                    if let (true, CarriedState::Unknown { reason, .. }) = (expired, &mut moved.state) {
                        *reason = UnknownReason::LeaseExpired;
                    }
                    Some(moved.state)
                }
                ("completed", _) => number(6)?.and_then(|status| u16::try_from(status).ok()).map(|status| {
                    let body = blob(8).ok().flatten();
                    let headers = blob(7).ok().flatten().unwrap_or_default();
                    CarriedState::Completed {
                        status,
                        completed_at: number(13).ok().flatten().and_then(crate::record::from_epoch_millis),
                        response: body.map(|body| RawResponse {
                            headers: Bytes::from(headers),
                            body: Bytes::from(body),
                        }),
                    }
                }),
                ("unknown", owner) => {
                    let reason: Option<String> = row.get(9)?;
                    let (due, give_up) = (number(10)?, number(11)?);
                    reason
                        .and_then(|reason| UnknownReason::parse(reason.as_bytes()))
                        .map(|reason| CarriedState::Unknown {
                            reason,
                            owner,
                            schedule: give_up.map(|give_up_at| CarriedSchedule {
                                due_in: due.map(|due| until(now, due)),
                                give_up_in: until(now, give_up_at),
                            }),
                        })
                }
                _ => None,
            };
            let carried = Ok::<_, rusqlite::Error>(state.zip(fingerprint).map(|(state, fingerprint)| Carried {
                key,
                fingerprint,
                ttl,
                response_ttl,
                state,
            }));
            Ok((carried?, row.get::<_, i64>(14)?))
        })
        .map_err(|error| disk(&error, false))?;
    let (mut records, mut last) = (Vec::new(), None);
    for row in rows {
        let (record, rowid) = row.map_err(|error| disk(&error, false))?;
        records.push(record.ok_or(StoreError::Protocol("a record in the store's file does not decode"))?);
        last = Some(rowid);
    }
    Ok((records, last))
}

/// Writes `record` unless its key holds a live record (an expired one is replaced);
/// `true` when it was written.
fn insert(tx: &Tx<'_>, record: &Carried, now: Millis) -> Result<bool, StoreError> {
    let at = |left: Duration| now + millis(left);
    let key = record.key.as_str();
    if let Some(row) = super::load(tx, &record.key, false)? {
        if row.expires_at > now {
            return Ok(false);
        }
        super::delete(
            tx,
            super::deleting!("DELETE FROM records WHERE rowid = ?1"),
            [row.rowid],
        )?;
    }
    let response_until = (!record.response_with_record()).then(|| at(record.response_left()));
    let (state, owner, status, completed_at, response, reason, due, give_up) = match &record.state {
        CarriedState::Completed {
            status, completed_at, ..
        } => {
            let completed_at =
                completed_at.map(|at| at.duration_since(std::time::UNIX_EPOCH).map_or(0, moving::millis));
            let status = Some(i64::from(*status));
            (
                "completed",
                None,
                status,
                completed_at,
                record.live_response(),
                None,
                None,
                None,
            )
        }
        CarriedState::Unknown {
            reason,
            owner,
            schedule,
        } => {
            let owner = Carried::unknown_owner(*owner)?;
            let due = schedule.and_then(|schedule| schedule.due_in.map(at));
            let give_up = schedule.map(|schedule| at(schedule.give_up_in));
            let reason = Some(reason.as_str());
            ("unknown", Some(owner), None, None, None, reason, due, give_up)
        }
    };
    let size =
        RECORD_OVERHEAD + key.len() + response.map_or(0, |response| response.headers.len() + response.body.len());
    let size = i64::try_from(size).unwrap_or(i64::MAX);
    let written = super::execute(
        tx,
        "INSERT INTO records (key, fingerprint, expires_at, state, owner, status, headers, body, reason, probe_due, \
         probe_give_up, size, response_until, completed_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        params![
            key,
            &record.fingerprint.0[..],
            at(record.ttl),
            state,
            owner.as_ref().map(|owner| &owner.as_bytes()[..]),
            status,
            response.map(|response| &response.headers[..]),
            response.map(|response| &response.body[..]),
            reason,
            due,
            give_up,
            size,
            response_until,
            completed_at,
        ],
    )?;
    if written == 1 {
        tx.inserted(key, tx.last_insert_rowid());
        // A moved record counts against no scope or address (it keeps neither).
        let mut shares = tx.shares.borrow_mut();
        let uncounted = Counted {
            scope: None,
            client: None,
        };
        let mut counted = shares.added(tx, uncounted, size);
        if state == "completed" && response.is_none() {
            // Counted as the sweeper's drop of a response counts it.
            counted = counted.and_then(|()| shares.spent(tx));
        }
        counted.map_err(|error| disk(&error, false))?;
    }
    Ok(written == 1)
}
