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

/// The statements of each lifecycle step, in the store's schema: the schema's functions,
/// and for the two steps of every fresh request (a claim without a scope or standbys to
/// wait for, and the completion) one statement each that does what those functions do,
/// the claim's insert alone in a function of its own (docs/performance.md, "The
/// Postgres store").
struct Calls {
    claim: String,
    /// `claim` for a claim with no scope, where no standby is waited for.
    claim_plain: String,
    complete: String,
    /// The notification `complete` sends when a waiter marked the claim.
    notify: String,
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
            claim_plain: claim_plain(schema),
            complete: complete_plain(schema),
            notify: format!("SELECT pg_notify('{}', $1::text)", schema::channel(schema)),
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

/// The schema's `claim` for an unscoped claim with no standby to wait for, as one
/// statement: the live record is read (`r`), and only where there is none does the
/// statement call `take_claim`, which inserts the claimant's (over an expired one). A
/// `CASE` evaluates only the branch it takes, so a replay's statement is a plain read:
/// no insert is planned or started for it, and it commits nothing. Times are the
/// statement's start on the server's clock, as the function's `now_` is. The same
/// columns as `claim` returns, its codes and one more: `RACED`, when another claim of
/// the key committed between this statement's snapshot and the insert (the insert
/// finds the row and leaves it): the statement is run again, and its new snapshot
/// reads that record, as the function's second `SELECT` does.
fn claim_plain(schema: &str) -> String {
    format!(
        "SELECT CASE WHEN r.key IS NOT NULL THEN \
                         CASE WHEN r.state = 'in_flight' AND r.owner = $2::bytea \
                                   AND r.lease_until > statement_timestamp() THEN {acquired} \
                              ELSE {existing} END \
                     WHEN {schema}.take_claim($1::text, $2::bytea, $3::bytea, $4::bigint, $5::bigint, $6::bigint) \
                         THEN {acquired} \
                     ELSE {raced} END AS code, \
                r.fingerprint, r.state, r.owner, {schema}.ms(r.lease_until, statement_timestamp()) AS lease_ms, \
                r.status, r.reason, \
                r.state = 'completed' AND r.response_until <= statement_timestamp() AS spent, \
                CASE WHEN r.response_until IS NULL OR r.response_until > statement_timestamp() \
                     THEN r.headers END AS headers, \
                CASE WHEN r.response_until IS NULL OR r.response_until > statement_timestamp() \
                     THEN r.body END AS body, \
                floor(extract(epoch FROM r.completed_at) * 1000)::bigint AS completed_ms, \
                {schema}.ms(r.probe_due, statement_timestamp()) AS due_ms, \
                {schema}.ms(r.probe_give_up, statement_timestamp()) AS give_up_ms \
         FROM (SELECT) AS one \
         LEFT JOIN {schema}.records AS r ON r.key = $1::text AND r.expires_at > statement_timestamp()",
        acquired = codes::claim::ACQUIRED,
        raced = codes::claim::RACED,
        existing = codes::claim::EXISTING,
    )
}

/// The schema's `complete` as one plain `UPDATE`: the same compare-and-set. It returns
/// whether a waiter marked the claim, and only then does the store send the function's
/// notification, as a second statement (`notify`) once the completion has committed:
/// a notification lost between the two costs the waiter time, never a wrong answer
/// (`store::notify`). Wrapping the notification into the same statement (a CTE around
/// the `UPDATE`) cost every completion 7-17 % of pgbench's pairs a second.
fn complete_plain(schema: &str) -> String {
    format!(
        "UPDATE {schema}.records SET state = 'completed', owner = NULL, lease_until = NULL, \
             status = $3::smallint, headers = $4::bytea, body = $5::bytea, completed_at = statement_timestamp() \
         WHERE key = $1::text AND state = 'in_flight' AND owner = $2::bytea \
             AND lease_until > statement_timestamp() AND expires_at > statement_timestamp() \
         RETURNING waited"
    )
}

/// The parameters both claim statements begin with ($1 to $6): the key, the owner, the
/// fingerprint, and the retention, `remember` and lease in milliseconds.
struct ClaimArgs<'a> {
    key: &'a str,
    owner: &'a [u8],
    fingerprint: &'a [u8],
    times: [i64; 3],
}

impl<'a> ClaimArgs<'a> {
    fn of(claim: &'a ClaimRequest) -> ClaimArgs<'a> {
        ClaimArgs {
            key: claim.key.as_str(),
            owner: &claim.owner.as_bytes()[..],
            fingerprint: &claim.fingerprint.0[..],
            times: [millis(claim.retention), millis(claim.remember), millis(claim.lease)],
        }
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 6] {
        let [retention, remember, lease] = &self.times;
        [&self.key, &self.owner, &self.fingerprint, retention, remember, lease]
    }
}

/// How many times a plain claim runs again when it raced another claim of its key
/// (each time, that claim's record had gone again before the statement read it).
const CLAIM_RACES: usize = 3;

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

    /// An unscoped claim by the plain statement, run again while it races another
    /// claim of its key (`codes::claim::RACED`), at most `CLAIM_RACES` times.
    async fn claim_plain(&self, claim: &ClaimRequest) -> Result<Row, StoreError> {
        let args = ClaimArgs::of(claim);
        for _ in 0..CLAIM_RACES {
            let row = self.one(&self.calls.claim_plain, &args.params()).await?;
            if i64::from(get::<i32>(&row, "code")?) != codes::claim::RACED {
                return Ok(row);
            }
        }
        Err(protocol(
            "a claim in Postgres kept racing other claims of its key, whose records vanished each time",
        ))
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
        let row = if claim.scope.is_none() && self.min_acks == 0 {
            self.claim_plain(claim).await?
        } else {
            let (args, scope) = (
                ClaimArgs::of(claim),
                claim.scope.map(|scope| i64::from_ne_bytes(scope.0.to_ne_bytes())),
            );
            let [key, owner, fingerprint, retention, remember, lease] = args.params();
            self.one(
                &self.calls.claim,
                &[
                    key,
                    owner,
                    fingerprint,
                    retention,
                    remember,
                    lease,
                    &scope,
                    &self.scope_max,
                    &self.min_acks,
                ],
            )
            .await?
        };
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
        let rows = self
            .query(
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
        let Some(row) = rows.first() else {
            return Ok(Write::Fenced);
        };
        if get::<bool>(row, "waited")? {
            // Committed already: a notification that fails to go is a waiter's time.
            if let Err(error) = self.query(&self.calls.notify, &[&key.as_str()]).await {
                tracing::debug!(%error, "the completion's notification to waiters on Postgres failed");
            }
        }
        Ok(Write::Applied)
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

#[cfg(test)]
mod tests {
    /// The pgbench script of a fresh request's two statements, as the store sends them,
    /// with pgbench's variables for their parameters (`bench/pgbench/fresh.sql`).
    fn pgbench_fresh() -> String {
        let calls = super::Calls::new("idemproxy");
        let with = |statement: &str, names: &[&str]| {
            let mut statement = statement.to_string();
            for (at, name) in names.iter().enumerate().rev() {
                statement = statement.replace(&format!("${}", at + 1), &format!(":{name}"));
            }
            statement
        };
        format!(
            "-- A fresh request's two statements on the Postgres store, as idemproxy sends them\n\
             -- (src/store/postgres.rs; a unit test there keeps this file the same), for\n\
             -- bench/bench.py's pgbench cases: a fresh key per transaction, the rest given\n\
             -- with -D.\n\
             \\set key random(1, 9000000000000000000)\n{};\n{};\n",
            with(
                &calls.claim_plain,
                &["key", "owner", "fingerprint", "retention", "remember", "lease"]
            ),
            with(&calls.complete, &["key", "owner", "status", "headers", "body"]),
        )
    }

    #[test]
    fn the_benchs_pgbench_script_is_what_a_fresh_request_sends() {
        let expected = pgbench_fresh();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/pgbench/fresh.sql");
        if std::env::var_os("IDEMPROXY_WRITE_PGBENCH").is_some() {
            std::fs::write(path, &expected).expect("write bench/pgbench/fresh.sql");
        }
        let found = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            found == expected,
            "bench/pgbench/fresh.sql is not what a fresh request sends: run this test with \
             IDEMPROXY_WRITE_PGBENCH=1 to write it again"
        );
    }
}
