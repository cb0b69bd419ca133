//! How the store connects: the URL's settings (hosts, `target_session_attrs`,
//! `sslmode`, database and user), the password from `store.password_env`, the
//! session's bounds (`statement_timeout`, and `synchronous_commit = remote_apply` where
//! claims need standbys), and rustls on ring with the store's CA and client
//! certificate. No error names the password.

use std::time::Duration;

use tokio_postgres::Client;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::PostgresConfig;
use crate::error::{BoxError, StoreError, StoreFailure};

/// How much longer than `store.timeout` the proxy waits for a statement, so that the
/// server's cancellation at `statement_timeout` (which rolls it back) comes first.
pub(super) const CANCEL_GRACE: Duration = Duration::from_millis(250);

/// The connection settings of `config`, bounded by `timeout`.
pub(super) fn pg_config(config: &PostgresConfig, timeout: Duration) -> tokio_postgres::Config {
    let mut pg = config.server.clone();
    let mut options = pg.get_options().map(str::to_string).unwrap_or_default();
    let bound = timeout.as_millis().max(1);
    options.push_str(&format!(
        " -c statement_timeout={bound} -c idle_in_transaction_session_timeout={bound}"
    ));
    if config.min_replica_acks > 0 {
        options.push_str(" -c synchronous_commit=remote_apply");
    }
    pg.options(options.trim());
    if pg.get_application_name().is_none() {
        pg.application_name("idemproxy");
    }
    pg.connect_timeout(timeout.max(Duration::from_millis(100)));
    pg.keepalives_idle(Duration::from_secs(30));
    pg
}

/// rustls on ring, trusting `store.tls_ca_file` (else the webpki roots), presenting
/// `store.tls_cert_file` when set. Used where the URL's `sslmode` asks for TLS.
pub fn connector(config: &PostgresConfig) -> Result<MakeRustlsConnect, StoreError> {
    let tls = config.tls.as_ref();
    let client = tls.and_then(|tls| tls.client.as_ref());
    let built = crate::tls::store_client_config(
        tls.and_then(|tls| tls.ca_file.as_deref()),
        client.map(|client| (client.cert_file.as_path(), client.key_file.as_path())),
    )
    .map_err(|error| StoreError::Handshake(failure(error.to_string())))?;
    Ok(MakeRustlsConnect::new(built))
}

/// One connection, its connection task spawned; within `timeout`.
pub(super) async fn connect(
    pg: &tokio_postgres::Config,
    connector: &MakeRustlsConnect,
    timeout: Duration,
) -> Result<Client, StoreError> {
    let (client, connection) = match tokio::time::timeout(timeout, pg.connect(connector.clone())).await {
        Err(_) => return Err(no_connection_within(timeout)),
        Ok(result) => result.map_err(|error| connect_failed(&error))?,
    };
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "a Postgres connection ended");
        }
    });
    Ok(client)
}

/// A pool that could not hand out a connection: nothing was sent.
pub(super) fn pool_failed(error: deadpool_postgres::PoolError, timeout: Duration) -> StoreError {
    use deadpool_postgres::PoolError;
    match error {
        PoolError::Backend(error) => connect_failed(&error),
        PoolError::Timeout(_) => no_connection_within(timeout),
        PoolError::Closed | PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_) => StoreError::Unreachable {
            source: failure("the pool of Postgres connections cannot connect"),
            may_have_written: false,
        },
    }
}

fn no_connection_within(timeout: Duration) -> StoreError {
    StoreError::Unreachable {
        source: failure(format!("no connection within {timeout:?}")),
        may_have_written: false,
    }
}

/// A connection that could not be made, so nothing was sent: its TLS handshake or its
/// login failed (a password, a role or a database the server does not know), which
/// only the configuration fixes; or the server could not be reached or took no more
/// connections.
pub(super) fn connect_failed(error: &tokio_postgres::Error) -> StoreError {
    let login = error.as_db_error().is_some_and(|db| {
        let code = db.code().code();
        code.starts_with("28") || code == tokio_postgres::error::SqlState::INVALID_CATALOG_NAME.code()
    });
    if login || is_tls(error) {
        StoreError::Handshake(failure(describe(error)))
    } else {
        StoreError::Unreachable {
            source: failure(describe(error)),
            may_have_written: false,
        }
    }
}

/// A statement that failed: refused by the server (rolled back, so nothing was
/// written), cancelled by it at `statement_timeout` (`timeout`; rolled back too), or
/// lost with its connection after it was `sent` (it may have run; a TLS error there is
/// the established connection's, not a handshake's: those come from `connect_failed`).
pub(super) fn query_failed(error: &tokio_postgres::Error, sent: bool, timeout: Duration) -> StoreError {
    match error.as_db_error() {
        Some(db) if db.code() == &tokio_postgres::error::SqlState::QUERY_CANCELED => StoreError::Timeout {
            after: timeout,
            may_have_written: false,
        },
        Some(_) => StoreError::Refused {
            source: failure(describe(error)),
            may_have_written: false,
        },
        None => StoreError::Unreachable {
            source: failure(describe(error)),
            may_have_written: sent,
        },
    }
}

/// Whether the connection failed in its TLS handshake: tokio-postgres's own TLS error
/// (a server that offers no TLS where it is required, among them), or a rustls
/// handshake error under it.
fn is_tls(error: &tokio_postgres::Error) -> bool {
    error.to_string().starts_with("error performing TLS handshake") || crate::tls::handshake_failure(error).is_some()
}

/// The server's message and SQLSTATE, or the connection's failure: never a password.
/// (A statement the server cancelled at `statement_timeout` is a timeout, named by
/// `query_failed` without it.)
fn describe(error: &tokio_postgres::Error) -> String {
    use std::error::Error as _;
    match error.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => match error.source() {
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        },
    }
}

/// `detail` as a Postgres failure, the source of a `StoreError`.
pub(super) fn failure(detail: impl Into<String>) -> BoxError {
    StoreFailure::boxed("postgres", detail)
}
