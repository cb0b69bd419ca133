//! How the store connects: the URL's settings (hosts, `target_session_attrs`,
//! `sslmode`, database and user), the password from `store.password_env`, the
//! session's bounds (`statement_timeout`, and `synchronous_commit = remote_apply` where
//! claims need standbys), and rustls on ring with the store's CA and client
//! certificate. No error names the password.

use std::time::Duration;

use tokio_postgres::Client;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::PostgresConfig;
use crate::error::{PostgresError, StoreError};

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
    .map_err(|error| StoreError::Postgres(PostgresError::setup(error.to_string())))?;
    Ok(MakeRustlsConnect::new(built))
}

/// One connection, its connection task spawned; within `timeout`.
pub(super) async fn connect(
    pg: &tokio_postgres::Config,
    connector: &MakeRustlsConnect,
    timeout: Duration,
) -> Result<Client, StoreError> {
    let (client, connection) = match tokio::time::timeout(timeout, pg.connect(connector.clone())).await {
        Err(_) => return Err(StoreError::Timeout(timeout)),
        Ok(result) => result.map_err(|error| StoreError::Postgres(PostgresError::from_connect(&error)))?,
    };
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "a Postgres connection ended");
        }
    });
    Ok(client)
}

/// A pool that could not hand out a connection.
pub(super) fn pool_error(error: deadpool_postgres::PoolError) -> PostgresError {
    use deadpool_postgres::PoolError;
    match error {
        PoolError::Backend(error) => PostgresError::from_connect(&error),
        PoolError::Timeout(_) => PostgresError::unreachable("no connection to Postgres within store.timeout"),
        PoolError::Closed | PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_) => {
            PostgresError::unreachable("the pool of Postgres connections cannot connect")
        }
    }
}
