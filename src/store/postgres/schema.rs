//! The store's schema (`schema.sql`): its text with the schema's name filled in, what
//! `idemproxy store schema` prints, and the start's migration or check. The version is
//! kept in `<schema>.meta`; a schema at a newer version than this build's is refused,
//! never changed.

use tokio_postgres::Client;

use std::time::Duration;

use crate::error::StoreError;

/// The schema version this build creates and reads.
pub const VERSION: i32 = 4;

/// Any 64-bit number the proxies on one database agree on, for the advisory lock that
/// makes instances starting at once migrate one after another.
const MIGRATION_LOCK: i64 = 0x6964_656d_7072_7879;

const SCHEMA: &str = include_str!("schema.sql");

/// The channel waiters of `schema` listen on.
pub(crate) fn channel(schema: &str) -> String {
    format!("{schema}_changed")
}

/// The DDL of `schema`, every statement of it safe to run again.
pub fn ddl(schema: &str) -> String {
    SCHEMA
        .replace("{schema}", schema)
        .replace("{channel}", &channel(schema))
}

/// The statement that records this version and `identity` in a schema that has none.
fn meta_row(schema: &str, identity: [u8; 16]) -> String {
    format!(
        "INSERT INTO {schema}.meta AS m (version, identity) VALUES ({VERSION}, '\\x{}')\n    ON CONFLICT (singleton) DO UPDATE SET version = greatest(m.version, excluded.version);\n",
        const_hex::encode(identity)
    )
}

/// The DDL as a DBA applies it by hand (`store.migrate = false`): in one transaction,
/// recording this version and a fresh key for scope numbers.
pub fn script(schema: &str, identity: [u8; 16]) -> String {
    format!("BEGIN;\n{}\n{}COMMIT;\n", ddl(schema), meta_row(schema, identity))
}

/// A fresh key for scope numbers, for a schema made by hand.
pub fn fresh_identity() -> Option<[u8; 16]> {
    super::super::identity::random_key()
}

/// A statement of the start's that failed; `timeout` is the session's
/// `statement_timeout`.
fn failed(error: &tokio_postgres::Error, timeout: Duration) -> StoreError {
    super::connect::query_failed(error, false, timeout)
}

/// A schema the store cannot use as it is: nothing is changed.
fn refused(detail: String) -> StoreError {
    StoreError::Refused {
        source: super::connect::failure(detail),
        may_have_written: false,
    }
}

/// The version `schema` is at and its key, `None` when it has no meta table.
async fn version(client: &Client, schema: &str, timeout: Duration) -> Result<Option<(i32, Vec<u8>)>, StoreError> {
    let exists = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&format!("{schema}.meta")])
        .await
        .map_err(|error| failed(&error, timeout))?;
    if !exists.get::<_, bool>(0) {
        return Ok(None);
    }
    let row = client
        .query_opt(&format!("SELECT version, identity FROM {schema}.meta"), &[])
        .await
        .map_err(|error| failed(&error, timeout))?;
    Ok(row.map(|row| (row.get(0), row.get(1))))
}

fn newer(schema: &str, found: i32) -> StoreError {
    refused(format!(
        "the schema {schema} is at version {found}, newer than this idemproxy's ({VERSION}): run a newer idemproxy, or another store.schema"
    ))
}

fn identity(bytes: &[u8]) -> Result<[u8; 16], StoreError> {
    <[u8; 16]>::try_from(bytes).map_err(|_| StoreError::Protocol("the schema's identity is not 16 bytes"))
}

/// Makes `schema` ready for this version and returns its key for scope numbers. With
/// `migrate`, creates or upgrades it in one transaction under an advisory lock (its
/// functions replaced by this version's); without, only checks that it is at this
/// version, and says how to create it when it is not. `timeout` is the session's
/// `statement_timeout`.
pub(crate) async fn prepare(
    client: &Client,
    schema: &str,
    migrate: bool,
    timeout: Duration,
) -> Result<[u8; 16], StoreError> {
    if !migrate {
        return match version(client, schema, timeout).await? {
            Some((found, _)) if found > VERSION => Err(newer(schema, found)),
            Some((VERSION, key)) => identity(&key),
            Some((found, _)) => Err(refused(format!(
                "the schema {schema} is at version {found}, and store.migrate = false: apply `idemproxy store schema --config F` (or set migrate = true) to bring it to version {VERSION}"
            ))),
            None => Err(refused(format!(
                "the schema {schema} has no idemproxy tables, and store.migrate = false: apply the output of `idemproxy store schema --config F`, or set migrate = true"
            ))),
        };
    }
    let fresh =
        super::super::identity::random_key().ok_or_else(|| refused("no random source for the schema's key".into()))?;
    client
        .batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))
        .await
        .map_err(|error| failed(&error, timeout))?;
    let migrated = async {
        // Checked under the lock, before anything is changed.
        if let Some((found, _)) = version(client, schema, timeout).await?
            && found > VERSION
        {
            return Err(newer(schema, found));
        }
        let apply = format!("{}\n{}", ddl(schema), meta_row(schema, fresh));
        client.batch_execute(&apply).await.map_err(|error| {
            let cause = failed(&error, timeout);
            let detail = std::error::Error::source(&cause).map_or_else(|| cause.to_string(), ToString::to_string);
            refused(format!("cannot create or upgrade the schema {schema}: {detail}"))
        })
    }
    .await;
    let ended = client
        .batch_execute(if migrated.is_ok() { "COMMIT" } else { "ROLLBACK" })
        .await;
    migrated?;
    ended.map_err(|error| failed(&error, timeout))?;
    match version(client, schema, timeout).await? {
        Some((VERSION, key)) => identity(&key),
        Some((found, _)) if found > VERSION => Err(newer(schema, found)),
        _ => Err(StoreError::Protocol("the schema's version did not take")),
    }
}
