//! The Postgres store: every record a row of `<schema>.records`, shared by every
//! instance on the database (docs/design.md §22). Each step of the lifecycle is one
//! SQL function (`postgres/schema.sql`), called in one round trip and run as one
//! transaction, on the server's clock: the same compare-and-set on the owner token and
//! the in-flight state as the Redis scripts. Each worker keeps its own pool of
//! `store.connections` connections (deadpool), over rustls when the URL's `sslmode`
//! asks for it. Every operation is bounded by `store.timeout`, on the server too (its
//! `statement_timeout`), so that a statement the proxy gave up on does not commit
//! later as a claim nobody owns.
//!
//! Waiters are told of changes by `LISTEN`/`NOTIFY` (`listen`): a waiter marks the
//! claim it waits on, and only a change to a marked claim notifies, so that a request
//! nobody waits on never takes Postgres's notification lock. Expired rows read as
//! absent in every function and are deleted in small batches by a sweeper (`sweep`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::codes;
use super::{
    Background, ClaimOutcome, ClaimRequest, Deferred, Existing, Fingerprint, Handles, OwnerToken, Probe, ProbeSchedule,
    ProbeStart, RecordState, RecordStore, RecordSummary, Resolution, Resolved, Spent, Started, StoreKey,
    StoredResponse, SummaryState, UnknownReason, Write,
};
use crate::config::PostgresConfig;
use crate::error::{Held, StoreError};

mod connect;
mod listen;
mod moving;
pub mod schema;
mod sweep;

pub use self::connect::connector;

/// A cheap-to-clone handle on the Postgres store: one worker's pool.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    calls: Arc<Calls>,
    moving: Arc<moving::MovingCalls>,
    timeout: Duration,
    /// `store.max_records_per_scope`.
    scope_max: i64,
    /// `store.min_replica_acks`: the synchronous standbys a claim needs.
    min_acks: i32,
    /// How its connections are made, for the process's listener and sweeper.
    dial: Arc<(tokio_postgres::Config, tokio_postgres_rustls::MakeRustlsConnect)>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("timeout", &self.timeout)
            .field("min_acks", &self.min_acks)
            .finish_non_exhaustive()
    }
}

/// The statements that call the schema's functions, in its schema.
struct Calls {
    claim: String,
    complete: String,
    mark_unknown: String,
    release: String,
    resolve: String,
    begin_probe: String,
    defer_probe: String,
    inspect: String,
    response: String,
    purge: String,
}

impl Calls {
    fn new(schema: &str) -> Calls {
        Calls {
            claim: format!("SELECT * FROM {schema}.claim($1, $2, $3, $4, $5, $6, $7, $8, $9)"),
            complete: format!("SELECT {schema}.complete($1, $2, $3, $4, $5)"),
            mark_unknown: format!("SELECT {schema}.mark_unknown($1, $2, $3, $4, $5)"),
            release: format!("SELECT {schema}.release($1, $2)"),
            resolve: format!("SELECT {schema}.resolve($1, $2, $3, $4, $5)"),
            begin_probe: format!("SELECT * FROM {schema}.begin_probe($1, $2, $3)"),
            defer_probe: format!("SELECT {schema}.defer_probe($1, $2, $3)"),
            inspect: format!("SELECT * FROM {schema}.inspect($1)"),
            response: format!(
                "SELECT status, headers, body FROM {schema}.records \
                 WHERE key = $1 AND state = 'completed' AND expires_at > clock_timestamp() \
                 AND (response_until IS NULL OR response_until > clock_timestamp())"
            ),
            purge: format!(
                "WITH gone AS (DELETE FROM {schema}.records WHERE key = $1 RETURNING expires_at) \
                 SELECT count(*) FILTER (WHERE expires_at > clock_timestamp()) FROM gone"
            ),
        }
    }
}

/// Opens the store `config` names (`PostgresStore::open`), and starts the process's
/// listener (it ends when the last watcher is dropped) and its sweeper (a background
/// task, stopped with the server). Each worker makes its own pool.
pub(crate) async fn open(config: &PostgresConfig, timeout: Duration) -> Result<Started<PostgresStore>, StoreError> {
    let first = PostgresStore::open(config, timeout).await?;
    let (pg, connector) = first.dial.as_ref().clone();
    let watcher = listen::start(pg.clone(), connector.clone(), &config.schema, timeout);
    let background = Background::default();
    background.spawn(sweep::run(pg.clone(), connector.clone(), &config.schema, timeout));
    let config = config.clone();
    Ok(Started {
        handles: Handles::PerWorker(Box::new(move || {
            Ok(PostgresStore::new(&config, pg.clone(), connector.clone(), timeout))
        })),
        watcher,
        background,
    })
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 4)
}

/// Milliseconds as a duration (zero once passed).
fn remaining(ms: Option<i64>) -> Duration {
    Duration::from_millis(ms.map_or(0, |ms| u64::try_from(ms).unwrap_or(0)))
}

/// Where an unknown record's probe stands, from its schedule's times.
fn probe(due_ms: Option<i64>, give_up_ms: Option<i64>) -> Probe {
    match (due_ms, give_up_ms) {
        (_, None) => Probe::Unscheduled,
        (None, Some(_)) => Probe::GaveUp,
        (Some(_), Some(give_up)) if give_up <= 0 => Probe::GaveUp,
        (Some(due), Some(_)) => Probe::Next(remaining(Some(due))),
    }
}

fn protocol(what: &'static str) -> StoreError {
    StoreError::Protocol(what)
}

/// The response a completed row holds.
fn stored(status: Option<i16>, headers: Option<Vec<u8>>, body: Option<Vec<u8>>) -> Result<StoredResponse, StoreError> {
    let status = status.ok_or_else(|| protocol("a completed record in Postgres has no status"))?;
    StoredResponse::decode(
        status.to_string().as_bytes(),
        &headers.unwrap_or_default(),
        Bytes::from(body.unwrap_or_default()),
    )
    .ok_or_else(|| protocol("a recorded response in Postgres does not decode"))
}

/// What a completed row past its retention keeps: its status and completion time.
fn spent(row: &Row) -> Result<Spent, StoreError> {
    let status = get::<Option<i16>>(row, "status")?.map_or(-1, i64::from);
    Spent::kept(status, get(row, "completed_ms")?)
        .ok_or_else(|| protocol("a completed record in Postgres has no status"))
}

fn owner_of(bytes: Option<Vec<u8>>) -> Option<OwnerToken> {
    bytes.as_deref().and_then(OwnerToken::from_bytes)
}

fn reason_of(text: Option<String>) -> Result<UnknownReason, StoreError> {
    text.as_deref()
        .map(str::as_bytes)
        .and_then(UnknownReason::parse)
        .ok_or_else(|| protocol("an unknown record in Postgres has no reason this version knows"))
}

fn get<'a, T: tokio_postgres::types::FromSql<'a>>(row: &'a Row, column: &str) -> Result<T, StoreError> {
    row.try_get(column)
        .map_err(|_| protocol("Postgres answered a store function with columns of another version"))
}

fn status_of(response: &StoredResponse) -> i16 {
    i16::try_from(response.status.as_u16()).unwrap_or(i16::MAX)
}

impl PostgresStore {
    /// Connects once (within `timeout`, and at least 10 s), creates or upgrades the
    /// schema (`store.migrate`) or checks that it is this version's, adopts the
    /// schema's key for scope numbers, and returns a store whose pool connects lazily.
    /// A wrong URL, a refused password, a missing database or schema, or a schema of a
    /// newer version is an error naming it.
    pub async fn open(config: &PostgresConfig, timeout: Duration) -> Result<PostgresStore, StoreError> {
        let connector = connector(config)?;
        let pg = connect::pg_config(config, timeout);
        let client = connect::connect(&pg, &connector, timeout.max(Duration::from_secs(10))).await?;
        let identity = schema::prepare(&client, &config.schema, config.migrate, timeout).await?;
        drop(client);
        super::identity::adopt(identity, &format!("postgres schema {}", config.schema));
        Ok(PostgresStore::new(config, pg, connector, timeout))
    }

    /// A store that connects on its first use and neither makes nor checks the schema:
    /// a `[store.previous]`, read only, that may be down when the proxy starts.
    pub fn lazy(config: &PostgresConfig, timeout: Duration) -> Result<PostgresStore, StoreError> {
        let connector = connector(config)?;
        let pg = connect::pg_config(config, timeout);
        Ok(PostgresStore::new(config, pg, connector, timeout))
    }

    /// A worker's store: a pool of `config.connections`, connecting lazily.
    pub fn new(
        config: &PostgresConfig,
        pg: tokio_postgres::Config,
        connector: tokio_postgres_rustls::MakeRustlsConnect,
        timeout: Duration,
    ) -> PostgresStore {
        let manager = Manager::from_config(
            pg.clone(),
            connector.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.connections.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .build()
            .unwrap_or_else(|_| unreachable!("a pool with a runtime and its timeouts always builds"));
        PostgresStore {
            pool,
            dial: Arc::new((pg, connector)),
            calls: Arc::new(Calls::new(&config.schema)),
            moving: Arc::new(moving::MovingCalls::new(&config.schema)),
            timeout,
            scope_max: i64::try_from(config.max_records_per_scope).unwrap_or(i64::MAX),
            min_acks: i32::try_from(config.min_replica_acks).unwrap_or(i32::MAX),
        }
    }

    /// Runs `sql` with `params` on one of the pool's connections, within the store's
    /// timeout (the server cancels it at the same bound: `statement_timeout`).
    async fn query(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, StoreError> {
        let timeout = self.timeout;
        let work = async {
            let client = self
                .pool
                .get()
                .await
                .map_err(|error| connect::pool_failed(error, timeout))?;
            let statement = client
                .prepare_cached(sql)
                .await
                .map_err(|error| connect::query_failed(&error, false, timeout))?;
            client
                .query(&statement, params)
                .await
                .map_err(|error| connect::query_failed(&error, true, timeout))
        };
        // A little past the server's own bound, so that a statement stalled on a lock
        // is cancelled there (and rolled back) before the proxy gives up on it.
        match tokio::time::timeout(timeout + connect::CANCEL_GRACE, work).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout {
                after: timeout,
                may_have_written: true,
            }),
        }
    }

    /// The one row a function returns.
    async fn one(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Row, StoreError> {
        self.query(sql, params)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| protocol("a store function in Postgres returned no row"))
    }

    /// The integer a function returns.
    async fn code(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<i64, StoreError> {
        let row = self.one(sql, params).await?;
        row.try_get::<_, i32>(0)
            .map(i64::from)
            .map_err(|_| protocol("a store function in Postgres answered with another type"))
    }

    /// What a claim found in a live record that is not the claimant's.
    fn existing(row: &Row) -> Result<ClaimOutcome, StoreError> {
        let fingerprint = Fingerprint::from_bytes(&get::<Vec<u8>>(row, "fingerprint")?)
            .ok_or_else(|| protocol("a record's fingerprint in Postgres is not 32 bytes"))?;
        let state = match get::<String>(row, "state")?.as_str() {
            "in_flight" => match get::<Option<i64>>(row, "lease_ms")? {
                Some(lease) if lease > 0 => RecordState::InFlight {
                    lease_remaining: remaining(Some(lease)),
                },
                _ => RecordState::LeaseExpired,
            },
            "completed" if get::<Option<bool>>(row, "spent")? == Some(true) => RecordState::Spent(spent(row)?),
            "completed" => {
                RecordState::Completed(stored(get(row, "status")?, get(row, "headers")?, get(row, "body")?)?)
            }
            "unknown" => RecordState::Unknown {
                reason: reason_of(get(row, "reason")?)?,
                probe: probe(get(row, "due_ms")?, get(row, "give_up_ms")?),
            },
            _ => {
                return Err(protocol(
                    "a record in Postgres is in a state this version does not know",
                ));
            }
        };
        Ok(ClaimOutcome::Existing(Existing { fingerprint, state }))
    }
}

impl RecordStore for PostgresStore {
    async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let scope = claim.scope.map(|scope| i64::from_ne_bytes(scope.0.to_ne_bytes()));
        let row = self
            .one(
                &self.calls.claim,
                &[
                    &claim.key.as_str(),
                    &&claim.owner.as_bytes()[..],
                    &&claim.fingerprint.0[..],
                    &millis(claim.retention),
                    &millis(claim.remember),
                    &millis(claim.lease),
                    &scope,
                    &self.scope_max,
                    &self.min_acks,
                ],
            )
            .await?;
        match i64::from(get::<i32>(&row, "code")?) {
            codes::claim::ACQUIRED => Ok(ClaimOutcome::Acquired(())),
            codes::claim::EXISTING => PostgresStore::existing(&row),
            codes::claim::SCOPE_FULL => Err(StoreError::ScopeFull {
                what: Held::Records,
                retry_after: remaining(get(&row, "retry_ms")?),
            }),
            codes::claim::NOT_REPLICATED => Err(StoreError::NotReplicated {
                acks: 0,
                wanted: self.min_acks.unsigned_abs(),
            }),
            _ => Err(protocol("the claim in Postgres answered a code it has none for")),
        }
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: &StoredResponse,
    ) -> Result<Write, StoreError> {
        let headers = response.encode_headers();
        let code = self
            .code(
                &self.calls.complete,
                &[
                    &key.as_str(),
                    &&owner.as_bytes()[..],
                    &status_of(response),
                    &headers,
                    &&response.body[..],
                ],
            )
            .await?;
        codes::write(code)
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
        schedule: Option<ProbeSchedule>,
    ) -> Result<Write, StoreError> {
        let first = schedule.map(|schedule| millis(schedule.first_after));
        let give_up = schedule.map(|schedule| millis(schedule.give_up_after));
        let code = self
            .code(
                &self.calls.mark_unknown,
                &[
                    &key.as_str(),
                    &&owner.as_bytes()[..],
                    &reason.as_str(),
                    &first,
                    &give_up,
                ],
            )
            .await?;
        codes::write(code)
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<Write, StoreError> {
        let code = self
            .code(&self.calls.release, &[&key.as_str(), &&owner.as_bytes()[..]])
            .await?;
        codes::write(code)
    }

    async fn purge(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let row = self.one(&self.calls.purge, &[&key.as_str()]).await?;
        let live: i64 = row
            .try_get(0)
            .map_err(|_| protocol("a purge in Postgres answered with another type"))?;
        Ok(live > 0)
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<RecordSummary>, StoreError> {
        let row = self.one(&self.calls.inspect, &[&key.as_str()]).await?;
        let Some(state) = get::<Option<String>>(&row, "state")? else {
            return Ok(None);
        };
        let fingerprint = Fingerprint::from_bytes(&get::<Vec<u8>>(&row, "fingerprint")?)
            .ok_or_else(|| protocol("a record's fingerprint in Postgres is not 32 bytes"))?;
        let owner = owner_of(get(&row, "owner")?);
        let lease = get::<Option<i64>>(&row, "lease_ms")?;
        let (state, owner) = match state.as_str() {
            "in_flight" if lease.is_some_and(|lease| lease > 0) => (
                SummaryState::InFlight {
                    lease_remaining: remaining(lease),
                },
                None,
            ),
            "in_flight" => (SummaryState::LeaseExpired, owner),
            "completed" if get::<Option<bool>>(&row, "spent")? == Some(true) => {
                (SummaryState::Spent(spent(&row)?), None)
            }
            "completed" => {
                let response = stored(get(&row, "status")?, get(&row, "headers")?, None)?;
                let length = get::<Option<i64>>(&row, "body_length")?.unwrap_or(0);
                (
                    SummaryState::Completed {
                        status: response.status.as_u16(),
                        response_bytes: u64::try_from(length).unwrap_or(0),
                        trace_id: response.trace.map(|trace| trace.trace_id_hex()),
                    },
                    None,
                )
            }
            "unknown" => (
                SummaryState::Unknown {
                    reason: reason_of(get(&row, "reason")?)?,
                    probe: probe(get(&row, "due_ms")?, get(&row, "give_up_ms")?),
                },
                owner,
            ),
            _ => {
                return Err(protocol(
                    "a record in Postgres is in a state this version does not know",
                ));
            }
        };
        Ok(Some(RecordSummary {
            fingerprint,
            ttl: remaining(get(&row, "ttl_ms")?),
            state,
            owner,
        }))
    }

    async fn response(&self, key: &StoreKey) -> Result<Option<StoredResponse>, StoreError> {
        let rows = self.query(&self.calls.response, &[&key.as_str()]).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        stored(get(row, "status")?, get(row, "headers")?, get(row, "body")?).map(Some)
    }

    async fn resolve(
        &self,
        key: &StoreKey,
        owner: Option<OwnerToken>,
        resolution: &Resolution,
    ) -> Result<Resolved, StoreError> {
        let owner = owner.map(|owner| owner.as_bytes().to_vec());
        let (status, headers, body) = match resolution {
            Resolution::Applied(response) => (
                Some(status_of(response)),
                Some(response.encode_headers()),
                Some(response.body.to_vec()),
            ),
            Resolution::NotApplied => (None, None, None),
        };
        let code = self
            .code(&self.calls.resolve, &[&key.as_str(), &owner, &status, &headers, &body])
            .await?;
        codes::resolved(code)
    }

    async fn begin_probe(
        &self,
        key: &StoreKey,
        schedule: ProbeSchedule,
        lease: Duration,
    ) -> Result<ProbeStart, StoreError> {
        let row = self
            .one(
                &self.calls.begin_probe,
                &[&key.as_str(), &millis(lease), &millis(schedule.give_up_after)],
            )
            .await?;
        let code = i64::from(get::<i32>(&row, "code")?);
        let wait_ms = match code {
            codes::probe::NOT_DUE => get::<Option<i64>>(&row, "wait_ms")?.unwrap_or(0),
            _ => 0,
        };
        codes::probe_start(code, || owner_of(get(&row, "owner").ok()?), wait_ms)
    }

    async fn defer_probe(&self, key: &StoreKey, owner: OwnerToken, every: Duration) -> Result<Deferred, StoreError> {
        let code = self
            .code(
                &self.calls.defer_probe,
                &[&key.as_str(), &&owner.as_bytes()[..], &millis(every)],
            )
            .await?;
        codes::deferred(code)
    }

    /// Ready only if a claim would be taken: the claim function run in a transaction
    /// that is rolled back, on a key no request names. `SELECT 1` answered on a
    /// standby, or for a role that may not write, while every claim was 503.
    async fn ping(&self) -> Result<(), StoreError> {
        let owner = OwnerToken::generate().map_err(|_| StoreError::Unready("no random source"))?;
        let key = format!("idemproxy readiness {}", const_hex::encode(owner.as_bytes()));
        let second = 1000_i64;
        let no_scope: Option<i64> = None;
        let timeout = self.timeout;
        let failed = |error: tokio_postgres::Error| connect::query_failed(&error, false, timeout);
        let work = async {
            let mut client = self
                .pool
                .get()
                .await
                .map_err(|error| connect::pool_failed(error, timeout))?;
            let statement = client.prepare_cached(&self.calls.claim).await.map_err(failed)?;
            let transaction = client.transaction().await.map_err(failed)?;
            let row = transaction
                .query_one(
                    &statement,
                    &[
                        &key,
                        &&owner.as_bytes()[..],
                        &&[0u8; 32][..],
                        &second,
                        &second,
                        &second,
                        &no_scope,
                        &self.scope_max,
                        &self.min_acks,
                    ],
                )
                .await
                .map_err(failed)?;
            // Rolled back: the readiness claim never commits.
            transaction.rollback().await.map_err(failed)?;
            Ok::<_, StoreError>(row)
        };
        let row = match tokio::time::timeout(timeout + connect::CANCEL_GRACE, work).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(StoreError::Timeout {
                    after: timeout,
                    may_have_written: false,
                });
            }
        };
        match i64::from(get::<i32>(&row, "code")?) {
            codes::claim::ACQUIRED => Ok(()),
            codes::claim::NOT_REPLICATED => Err(StoreError::NotReplicated {
                acks: 0,
                wanted: self.min_acks.unsigned_abs(),
            }),
            _ => Err(protocol("the readiness claim in Postgres was not taken")),
        }
    }

    fn shared_by_instances(&self) -> bool {
        true
    }
}
