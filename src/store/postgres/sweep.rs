//! The sweeper: every instance deletes expired rows in batches of at most `BATCH`,
//! skipping rows another sweeper or a claim holds (`sweep` in the schema), so that no
//! statement holds many locks or holds them long. Every function already reads an
//! expired row as absent: the sweep only gives the space back.

use std::time::Duration;

use tokio_postgres_rustls::MakeRustlsConnect;

/// Most rows one statement deletes.
const BATCH: i32 = 500;
/// Between two rounds of batches.
const EVERY: Duration = Duration::from_secs(1);

/// The sweeper, to run until the store's background work is stopped: its own
/// connection, made again when lost.
pub(super) fn run(
    pg: tokio_postgres::Config,
    connector: MakeRustlsConnect,
    schema: &str,
    timeout: Duration,
) -> impl Future<Output = ()> + Send + 'static {
    let sweep = format!("SELECT {schema}.sweep({BATCH})");
    async move {
        let mut client = None;
        loop {
            tokio::time::sleep(EVERY).await;
            if client.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
                client = super::connect::connect(&pg, &connector, timeout).await.ok();
            }
            let Some(connected) = &client else { continue };
            // Batch after batch while each comes back full, so that a backlog is
            // worked off without one long statement.
            loop {
                match tokio::time::timeout(timeout, connected.query_one(&sweep, &[])).await {
                    Ok(Ok(row)) if row.get::<_, i32>(0) >= BATCH => {}
                    Ok(Ok(_)) => break,
                    Ok(Err(error)) => {
                        tracing::debug!(%error, "the store's sweep failed; it runs again in a moment");
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
    }
}
