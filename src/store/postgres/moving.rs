//! Moving records into and out of Postgres (`store::moving`): a page of live records
//! in key order, one record for a `[store.previous]` lookup, and a batch written by
//! one `INSERT … SELECT FROM unnest(…)`, each row only where the key holds no live
//! record (or, for a lookup, where it holds the caller's own in-flight claim). Times
//! are counted on the server's clock both ways.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio_postgres::Row;

use super::{PostgresStore, get, owner_of, protocol, reason_of};
use crate::error::StoreError;
use crate::store::moving::{self, Carried, CarriedSchedule, CarriedState, Cursor, Imported, RawResponse};
use crate::store::{Fingerprint, OwnerToken, StoreKey};

/// The columns a moved record is read with: its times as milliseconds from now.
fn select(schema: &str, filter: &str) -> String {
    format!(
        "SELECT key, fingerprint, state, owner, {schema}.ms(expires_at, t) AS ttl_ms, \
         {schema}.ms(lease_until, t) AS lease_ms, status, headers, body, reason, \
         {schema}.ms(probe_due, t) AS due_ms, {schema}.ms(probe_give_up, t) AS give_up_ms, \
         {schema}.ms(response_until, t) AS response_ms, \
         floor(extract(epoch FROM completed_at) * 1000)::bigint AS completed_ms \
         FROM {schema}.records, clock_timestamp() AS t WHERE expires_at > t AND {filter}"
    )
}

/// The statements records move with, in the store's schema.
pub(super) struct MovingCalls {
    count: String,
    page: String,
    one: String,
    import: String,
}

impl MovingCalls {
    pub(super) fn new(schema: &str) -> MovingCalls {
        let at = |column: &str| format!("t + {column} * interval '1 millisecond'");
        MovingCalls {
            count: format!("SELECT count(*) FROM {schema}.records WHERE expires_at > clock_timestamp()"),
            page: select(schema, "key > $1 ORDER BY key LIMIT $2"),
            one: select(schema, "key = $1"),
            // A waiter on the claim a record is written over is told, as the
            // functions tell it of any change to a claim it marked.
            import: format!(
                "WITH written AS (INSERT INTO {schema}.records AS r (key, fingerprint, state, owner, expires_at, status, headers, body, \
                 reason, probe_due, probe_give_up, response_until, completed_at) \
                 SELECT key, fingerprint, state, owner, {ttl}, status, headers, body, reason, {due}, {give_up}, \
                 {response}, to_timestamp(completed_ms / 1000.0) \
                 FROM clock_timestamp() AS t, unnest($1::text[], $2::bytea[], $3::text[], $4::bytea[], $5::bigint[], \
                 $6::smallint[], $7::bytea[], $8::bytea[], $9::text[], $10::bigint[], $11::bigint[], $12::bigint[], \
                 $13::bigint[]) AS m (key, fingerprint, state, owner, ttl_ms, status, headers, body, reason, due_ms, \
                 give_up_ms, response_ms, completed_ms) \
                 ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, state = excluded.state, \
                 owner = excluded.owner, expires_at = excluded.expires_at, lease_until = NULL, \
                 status = excluded.status, headers = excluded.headers, body = excluded.body, \
                 reason = excluded.reason, probe_due = excluded.probe_due, probe_give_up = excluded.probe_give_up, \
                 response_until = excluded.response_until, completed_at = excluded.completed_at, scope = NULL \
                 WHERE r.expires_at <= clock_timestamp() OR (r.state = 'in_flight' AND r.owner = $14) \
                 RETURNING key, waited) \
                 SELECT key FROM written WHERE NOT waited \
                 UNION ALL SELECT key FROM (SELECT key, pg_notify('{channel}', key) FROM written WHERE waited) AS told",
                channel = super::schema::channel(schema),
                ttl = at("ttl_ms"),
                due = at("due_ms"),
                give_up = at("give_up_ms"),
                response = at("response_ms"),
            ),
        }
    }
}

impl PostgresStore {
    /// Up to `limit` live records after `cursor`, in key order.
    pub(crate) async fn export(&self, cursor: &Cursor, limit: usize) -> Result<(Vec<Carried>, Cursor), StoreError> {
        let after = match cursor {
            Cursor::Start => String::new(),
            Cursor::After(key) => key.clone(),
            Cursor::Scan(_) | Cursor::Row(_) | Cursor::End => return Ok((Vec::new(), Cursor::End)),
        };
        let rows = self
            .query(&self.moving.page, &[&after, &i64::try_from(limit).unwrap_or(i64::MAX)])
            .await?;
        let records = rows.iter().map(carried).collect::<Result<Vec<_>, _>>()?;
        let next = match records.last() {
            Some(last) if records.len() == limit => Cursor::After(last.key.as_str().to_owned()),
            _ => Cursor::End,
        };
        Ok((records, next))
    }

    /// How many live records it holds.
    pub(crate) async fn count(&self) -> Result<u64, StoreError> {
        let row = self.one(&self.moving.count, &[]).await?;
        let count: i64 = row
            .try_get(0)
            .map_err(|_| protocol("a count in Postgres answered with another type"))?;
        Ok(count.unsigned_abs())
    }

    /// The record under `key`, as it would move.
    pub(crate) async fn carried(&self, key: &StoreKey) -> Result<Option<Carried>, StoreError> {
        let rows = self.query(&self.moving.one, &[&key.as_str()]).await?;
        rows.first().map(carried).transpose()
    }

    /// Writes each record where its key holds no live one, in one statement; where
    /// `replacing` names an owner, over that owner's in-flight claim too.
    pub(crate) async fn import(
        &self,
        records: &[Carried],
        replacing: Option<OwnerToken>,
    ) -> Result<Imported, StoreError> {
        let records: Vec<&Carried> = records.iter().filter(|record| !record.ttl.is_zero()).collect();
        if records.is_empty() {
            return Ok(Imported::default());
        }
        let columns = Columns::of(&records)?;
        let replacing = replacing.map(|owner| owner.as_bytes().to_vec());
        let rows = self
            .query(
                &self.moving.import,
                &[
                    &columns.key,
                    &columns.fingerprint,
                    &columns.state,
                    &columns.owner,
                    &columns.ttl_ms,
                    &columns.status,
                    &columns.headers,
                    &columns.body,
                    &columns.reason,
                    &columns.due_ms,
                    &columns.give_up_ms,
                    &columns.response_ms,
                    &columns.completed_ms,
                    &replacing,
                ],
            )
            .await?;
        Ok(Imported {
            written: rows.len(),
            kept: records.len() - rows.len(),
        })
    }
}

/// A batch of moved records as the columns `unnest` takes.
#[derive(Default)]
struct Columns {
    key: Vec<String>,
    fingerprint: Vec<Vec<u8>>,
    state: Vec<&'static str>,
    owner: Vec<Option<Vec<u8>>>,
    ttl_ms: Vec<i64>,
    status: Vec<Option<i16>>,
    headers: Vec<Option<Vec<u8>>>,
    body: Vec<Option<Vec<u8>>>,
    reason: Vec<Option<&'static str>>,
    due_ms: Vec<Option<i64>>,
    give_up_ms: Vec<Option<i64>>,
    response_ms: Vec<Option<i64>>,
    completed_ms: Vec<Option<i64>>,
}

impl Columns {
    fn of(records: &[&Carried]) -> Result<Columns, StoreError> {
        let mut columns = Columns::default();
        for record in records {
            columns.key.push(record.key.as_str().to_owned());
            columns.fingerprint.push(record.fingerprint.0.to_vec());
            columns.ttl_ms.push(moving::millis(record.ttl));
            let response_ms = (!record.response_with_record()).then(|| moving::millis(record.response_left()));
            columns.response_ms.push(response_ms);
            let live = record.live_response();
            columns.headers.push(live.map(|response| response.headers.to_vec()));
            columns.body.push(live.map(|response| response.body.to_vec()));
            match &record.state {
                CarriedState::Completed {
                    status, completed_at, ..
                } => {
                    let completed = completed_at.unwrap_or_else(SystemTime::now);
                    let completed = completed.duration_since(UNIX_EPOCH).map_or(0, moving::millis);
                    columns.state.push("completed");
                    columns.owner.push(None);
                    columns.status.push(Some(i16::try_from(*status).unwrap_or(0)));
                    columns.completed_ms.push(Some(completed));
                    columns.reason.push(None);
                    columns.due_ms.push(None);
                    columns.give_up_ms.push(None);
                }
                CarriedState::Unknown {
                    reason,
                    owner,
                    schedule,
                } => {
                    columns.state.push("unknown");
                    columns
                        .owner
                        .push(Some(Carried::unknown_owner(*owner)?.as_bytes().to_vec()));
                    columns.status.push(None);
                    columns.completed_ms.push(None);
                    columns.reason.push(Some(reason.as_str()));
                    let due = schedule.and_then(|schedule| schedule.due_in).map(moving::millis);
                    columns.due_ms.push(due);
                    columns
                        .give_up_ms
                        .push(schedule.map(|schedule| moving::millis(schedule.give_up_in)));
                }
            }
        }
        Ok(columns)
    }
}

/// A record as `select` reads it.
fn carried(row: &Row) -> Result<Carried, StoreError> {
    let key = StoreKey::from_derived(get::<String>(row, "key")?);
    let fingerprint = Fingerprint::from_bytes(&get::<Vec<u8>>(row, "fingerprint")?)
        .ok_or_else(|| protocol("a record's fingerprint in Postgres is not 32 bytes"))?;
    let ttl = moving::left(get::<Option<i64>>(row, "ttl_ms")?.unwrap_or(0));
    let response_ttl = get::<Option<i64>>(row, "response_ms")?.map(moving::left);
    let owner = owner_of(get(row, "owner")?);
    let state = match get::<String>(row, "state")?.as_str() {
        "in_flight" => {
            let owner = owner.ok_or_else(|| protocol("an in-flight record in Postgres without its owner"))?;
            let mut moved = Carried::in_flight(key.clone(), fingerprint, ttl, response_ttl, owner);
            if get::<Option<i64>>(row, "lease_ms")?.is_none_or(|lease| lease <= 0)
                && let CarriedState::Unknown { reason, .. } = &mut moved.state
            {
                *reason = crate::store::UnknownReason::LeaseExpired;
            }
            moved.state
        }
        "completed" => {
            let status = get::<Option<i16>>(row, "status")?.and_then(|status| u16::try_from(status).ok());
            let body = get::<Option<Vec<u8>>>(row, "body")?;
            let headers = get::<Option<Vec<u8>>>(row, "headers")?.unwrap_or_default();
            CarriedState::Completed {
                status: status.ok_or_else(|| protocol("a completed record in Postgres without its status"))?,
                completed_at: get::<Option<i64>>(row, "completed_ms")?.and_then(crate::record::from_epoch_millis),
                response: body.map(|body| RawResponse {
                    headers: Bytes::from(headers),
                    body: Bytes::from(body),
                }),
            }
        }
        "unknown" => {
            let give_up = get::<Option<i64>>(row, "give_up_ms")?;
            let due = get::<Option<i64>>(row, "due_ms")?;
            CarriedState::Unknown {
                reason: reason_of(get(row, "reason")?)?,
                owner,
                schedule: give_up.map(|give_up| CarriedSchedule {
                    due_in: due.map(moving::left),
                    give_up_in: moving::left(give_up),
                }),
            }
        }
        _ => {
            return Err(protocol(
                "a record in Postgres is in a state this version does not know",
            ));
        }
    };
    Ok(Carried {
        key,
        fingerprint,
        ttl,
        response_ttl,
        state,
    })
}
