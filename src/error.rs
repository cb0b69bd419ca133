//! One error enum per boundary, and the one exhaustive function that says which
//! problem a rejection is (`Rejection::kind`): everything else about it (status, slug,
//! whose fault, how it is counted, what a client reads) is the kind's row in
//! `problem`. No internal error text ever reaches a response body: details go to the
//! log.

use std::path::PathBuf;
use std::time::Duration;

use crate::jwt::JwtError;
use crate::problem::Detail;
pub(crate) use crate::problem::{Completion, Outcome, Problem, ProblemKind, Profile};
use crate::request_target::RequestTargetError;

/// Any error, boxed, where the cause only goes to the log.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The configuration file is wrong or unreadable: the operator's fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read the config: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: {field}: {reason}", path.display())]
    Invalid {
        path: PathBuf,
        line: usize,
        field: String,
        reason: String,
    },
}

/// The client sent an unusable idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the request carries no idempotency key")]
    Missing,
    #[error("the idempotency key is empty")]
    Empty,
    #[error("the idempotency key is longer than 255 characters")]
    TooLong,
    #[error("the idempotency key has characters other than visible ASCII")]
    NotVisibleAscii,
    #[error("the idempotency key header appears more than once or holds a list")]
    Repeated,
    #[error("the idempotency key is a malformed structured-field string")]
    MalformedString,
    /// On a route whose probe or refetch names the key in its path: a `.` or `..`
    /// segment (between `/` or `\\`, escaped or not) would be a dot segment there to an
    /// upstream that decodes escapes before it normalises the path.
    #[error(
        "the idempotency key holds a '.' or '..' segment (between '/' or '\\', escaped or not), which this route's probe or refetch cannot carry in a path"
    )]
    DotSegment,
}

/// A key from a route's `key` sources (other than one header) that cannot be used.
/// It names the source as the config spells it, never the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("the idempotency key in {from} cannot be used: {error}")]
    Invalid { from: String, error: KeyError },
    #[error("the request body is not JSON, and this route takes its idempotency key from it ({sources})")]
    NotJson { sources: String },
    #[error("the request carries no idempotency key: this route takes it from {sources}")]
    Missing { sources: String },
}

/// The store did not answer as it should, by cause: the same cause has the same
/// variant, `kind`, span attribute, metric label and log field on every backend, and
/// each adapter (`store/redis.rs`, `store/postgres/connect.rs`, the SQLite writer)
/// classifies its own failures into it. Each says whether the operation may have been
/// applied all the same (`may_have_written`).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection could be made, or the one in use was lost: the store down, a node
    /// unreachable, a pool that cannot connect. Lost after the operation was sent, it
    /// may have run.
    #[error("the store is unreachable")]
    Unreachable {
        #[source]
        source: BoxError,
        may_have_written: bool,
    },
    /// A connection's handshake failed: TLS (a certificate not trusted, ours refused)
    /// or the login (a password, a role or a database the store does not know).
    /// Nothing reached the store, and every attempt fails alike until the
    /// configuration changes.
    #[error(
        "the store's handshake failed (see store.url or urls, store.password_env, store.tls_ca_file, store.tls_cert_file and store.tls_key_file)"
    )]
    Handshake(#[source] BoxError),
    /// No answer within the bound. It may have been applied, unless the store itself
    /// cancelled it (Postgres's `statement_timeout` rolls the statement back).
    #[error("the store did not answer within {after:?}")]
    Timeout { after: Duration, may_have_written: bool },
    /// The store answered, and refused the operation: a replica or a read-only
    /// database, a missing permission, no memory left, a cluster that is down. Only an
    /// error a script raised after it wrote may have written.
    #[error("the store refused the operation")]
    Refused {
        #[source]
        source: BoxError,
        may_have_written: bool,
    },
    /// An embedded store holds its maximum; its first record expires in `retry_after`.
    #[error("the store holds its maximum of {limit} {}", what.unit())]
    Full {
        what: Held,
        limit: usize,
        retry_after: Duration,
    },
    /// One client's records hold its share of the store (`max_records_per_scope` or
    /// `max_bytes_per_scope`); its oldest expires in `retry_after`.
    #[error("the client's records hold their share of the store ({})", what.per_scope())]
    ScopeFull { what: Held, retry_after: Duration },
    /// One client address's records, across the scopes it sends (or on routes without
    /// scope), hold its share of an embedded store (`max_records_per_client`); its
    /// oldest expires in `retry_after`.
    #[error("the records made from this client address hold its share of the store (store.max_records_per_client)")]
    ClientFull { retry_after: Duration },
    /// The SQLite store's file failed a read or a write (a full disk, an I/O error).
    #[error(transparent)]
    Disk(DiskError),
    /// The SQLite store's file cannot be used: at start, before anything is served.
    #[error(transparent)]
    File(#[from] StoreFileError),
    #[error("the store returned an unexpected reply: {0}")]
    Protocol(&'static str),
    /// A claim was written, and fewer replicas than `min_replica_acks` acknowledged it
    /// in time: a failover could lose it.
    #[error("only {acks} of the {wanted} replica acknowledgements the claim needs arrived in time")]
    NotReplicated { acks: u32, wanted: u32 },
    /// The store answers but cannot serve (a cluster with uncovered slots, a sentinel's
    /// primary that is not a primary).
    #[error("the store cannot serve: {0}")]
    Unready(&'static str),
    /// `[store.previous]` could not be read for a key the store does not hold: the key
    /// may be recorded there, so it is neither claimed nor forwarded.
    #[error("the previous store cannot be read: {0}")]
    Previous(Box<StoreError>),
}

/// What a store's bound counts: its records, or the bytes they hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    Records,
    Bytes,
}

impl Held {
    /// The unit, as a full store's message names it.
    pub fn unit(self) -> &'static str {
        match self {
            Held::Records => "records",
            Held::Bytes => "bytes",
        }
    }

    /// The setting that bounds one scope's share of it.
    pub fn per_scope(self) -> &'static str {
        match self {
            Held::Records => "store.max_records_per_scope",
            Held::Bytes => "store.max_bytes_per_scope",
        }
    }
}

/// What a store said or could not do, as the source of a `StoreError`: the server's
/// message (and Postgres's SQLSTATE), or the connection's failure, in words. Never a
/// password: the servers' messages name the user and the database, and the
/// connection's name the host.
#[derive(Debug, thiserror::Error)]
#[error("{backend}: {detail}")]
pub struct StoreFailure {
    pub backend: &'static str,
    pub detail: String,
}

impl StoreFailure {
    /// `detail` from `backend`, boxed as a source.
    pub(crate) fn boxed(backend: &'static str, detail: impl Into<String>) -> BoxError {
        Box::new(StoreFailure {
            backend,
            detail: detail.into(),
        })
    }
}

impl StoreError {
    /// The cause in one word: a span's `error.type`, the `cause` label of
    /// `idemproxy_store_errors_total`, and the `cause` of a problem's log line.
    pub fn kind(&self) -> &'static str {
        self.cause().as_str()
    }

    /// The cause, as a metric label.
    pub(crate) fn cause(&self) -> StoreCause {
        match self {
            StoreError::Unreachable { .. } => StoreCause::Unreachable,
            StoreError::Handshake(_) => StoreCause::Handshake,
            StoreError::Timeout { .. } => StoreCause::Timeout,
            StoreError::Refused { .. } => StoreCause::Refused,
            StoreError::Full { .. } => StoreCause::Full,
            StoreError::ScopeFull { .. } => StoreCause::ScopeFull,
            StoreError::ClientFull { .. } => StoreCause::ClientFull,
            StoreError::Disk(_) => StoreCause::Disk,
            StoreError::File(_) => StoreCause::File,
            StoreError::Protocol(_) => StoreCause::Protocol,
            StoreError::NotReplicated { .. } => StoreCause::NotReplicated,
            StoreError::Unready(_) => StoreCause::Unready,
            StoreError::Previous(_) => StoreCause::Previous,
        }
    }

    /// Whether `[store.previous]` could not be read (the store itself answered).
    pub fn is_previous(&self) -> bool {
        matches!(self, StoreError::Previous(_))
    }

    /// Whether the operation may have been applied although it failed: a timeout or a
    /// lost connection says nothing about what the store did. Only a refusal the store
    /// gave before writing, or a connection that never passed its handshake, rules it
    /// out.
    pub fn may_have_written(&self) -> bool {
        match self {
            StoreError::Unreachable { may_have_written, .. }
            | StoreError::Timeout { may_have_written, .. }
            | StoreError::Refused { may_have_written, .. } => *may_have_written,
            StoreError::Disk(failure) => failure.may_have_written,
            StoreError::Protocol(_) | StoreError::NotReplicated { .. } => true,
            StoreError::Full { .. }
            | StoreError::ScopeFull { .. }
            | StoreError::ClientFull { .. }
            | StoreError::Unready(_)
            | StoreError::Previous(_)
            | StoreError::Handshake(_)
            | StoreError::File(_) => false,
        }
    }
}

label_values! {
    /// Why a store operation failed (`StoreError::kind`).
    pub(crate) enum StoreCause {
        Unreachable => "unreachable",
        Handshake => "handshake",
        Timeout => "timeout",
        Refused => "refused",
        Full => "full",
        ScopeFull => "scope_full",
        ClientFull => "client_full",
        Disk => "disk",
        File => "file",
        Protocol => "protocol",
        NotReplicated => "not_replicated",
        Unready => "unready",
        Previous => "previous",
    }
}

/// The SQLite store's file failed: what SQLite said (never a record's contents), and
/// whether the write may have landed all the same (an I/O error while the log was
/// synced; a full disk undoes it).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the store's file failed: {message}")]
pub struct DiskError {
    pub message: String,
    pub may_have_written: bool,
}

/// Why the SQLite store's file cannot be used. Every one names the file; none
/// changes it.
#[derive(Debug, thiserror::Error)]
pub enum StoreFileError {
    #[error("{path}: is in use by another idemproxy ({holder}); one process per file, however it is named")]
    InUse { path: PathBuf, holder: String },
    /// Others may write it, or what it is reached through: refused, as Postgres
    /// refuses a data directory that others can write.
    #[error("{path}: refused: {reason}")]
    Unsafe { path: PathBuf, reason: String },
    #[error("{path}: cannot {what}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: cannot be opened: {reason}")]
    CannotOpen { path: PathBuf, reason: String },
    #[error("{path}: is not a SQLite database; left as it is")]
    NotADatabase { path: PathBuf },
    #[error("{path}: is corrupt ({detail}); left as it is: restore it from a backup, or move it aside to start empty")]
    Corrupt { path: PathBuf, detail: String },
    #[error("{path}: is another application's SQLite database ({detail}); left as it is")]
    Foreign { path: PathBuf, detail: String },
    #[error(
        "{path}: was written by a newer idemproxy (schema version {found}; this one knows up to {known}); left as it is"
    )]
    Newer { path: PathBuf, found: i32, known: i32 },
    #[error("{path}: the migration from schema version {from} to {to} failed, and nothing was changed: {reason}")]
    Migration {
        path: PathBuf,
        from: i32,
        to: i32,
        reason: String,
    },
}

/// The upstream failed the exchange.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// Nothing was sent: the connection could not be made.
    #[error("cannot connect to the upstream")]
    Unavailable(#[source] BoxError),
    /// The request may have been sent, and no full response came within the timeout.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The request may have been sent, and the exchange broke.
    #[error("the upstream exchange failed")]
    Failed(#[source] BoxError),
}

impl UpstreamError {
    /// The failure in one word, as a span's `error.type` says it.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Unavailable(_) => "unavailable",
            UpstreamError::Timeout(_) => "timeout",
            UpstreamError::Failed(_) => "failed",
        }
    }
}

/// The proxy broke its own invariant: its fault, never the client's.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error("cannot rewrite the request for the upstream")]
    Rewrite(#[source] http::Error),
    #[error("the exchange task ended without a response")]
    ExchangeLost,
    #[error("the operating system's random source failed")]
    Random,
}

/// Everything the proxy answers itself instead of forwarding.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Rejection {
    #[error("no route matches the request")]
    NoRoute,
    #[error(transparent)]
    RequestTarget(#[from] RequestTargetError),
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    KeySource(#[from] SourceError),
    #[error("the request body is larger than {0} bytes")]
    BodyTooLarge(u64),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(Duration),
    #[error("no byte of the request body arrived for {0:?}")]
    BodyIdle(Duration),
    #[error("the request body could not be read")]
    BodyIncomplete(#[source] BoxError),
    #[error("the idempotency key was used with a different request")]
    KeyReused,
    #[error("the request's token does not verify: {0}")]
    UnverifiedScope(#[from] JwtError),
    #[error("the first request with this key is still in flight")]
    InProgress {
        retry_after: Duration,
        /// How long the first request's lease still runs: a waiter's latest re-read.
        lease_remaining: Duration,
    },
    #[error("the outcome of the first request with this key is unknown")]
    OutcomeUnknown {
        /// Being reconciled by the route's probe: the next probe begins in this long.
        /// `None`: the route has no probe, or it gave up; an operator must resolve it.
        reconciling: Option<Duration>,
        /// Why it is unknown, where the record says (`unreadable`: its recorded
        /// response cannot be opened).
        reason: Option<&'static str>,
    },
    /// The same request again, after the route's retention and within its
    /// `remember`: the operation ran, its response is gone, and nothing runs again.
    #[error("{}", expired(.0))]
    ResponseExpired(Completion),
    #[error("the proxy is at its bound on {0}")]
    Overloaded(Bound),
    /// A retry on a `replay = "refetch"` route, whose refetch failed: nothing ran again.
    #[error("the refetch of a completed operation failed: {0}")]
    ReplayUnavailable(&'static str),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    Internal(#[from] ProxyError),
    #[error(transparent)]
    Call(#[from] CallError),
}

/// A body on a JSON-RPC or GraphQL route whose call cannot be told guarded or not.
/// Its texts are fixed: a method name or a document is the client's, and never logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CallError {
    #[error(
        "the body is not a JSON-RPC 2.0 request (an object with \"jsonrpc\": \"2.0\" and a string method, or a batch of them)"
    )]
    NotJsonRpc,
    #[error("the JSON-RPC batch holds a call to a guarded method: send guarded calls one at a time, each with its key")]
    GuardedInBatch,
    #[error("the GraphQL batch holds a mutation: send mutations one at a time, each with its key")]
    MutationInBatch,
    #[error("the GraphQL operation cannot be told: {0}")]
    GraphQl(&'static str),
}

/// Which bound on guarded requests in flight was reached (503 `overloaded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Bound {
    #[error("guarded requests in flight ({0}, server.max_guarded_requests)")]
    Requests(usize),
    /// The body reader knows the byte budget only through what it may take, so the
    /// setting is named, not its value.
    #[error("the bytes buffered bodies may hold (server.max_buffered_bytes)")]
    Bytes,
}

impl Rejection {
    /// Which problem this is: the one exhaustive mapping from a rejection to its kind,
    /// whose row says the rest. A new variant cannot reach a client before it has its
    /// kind here.
    pub(crate) fn kind(&self) -> ProblemKind {
        match self {
            Rejection::NoRoute => ProblemKind::NoRoute,
            Rejection::RequestTarget(
                RequestTargetError::MalformedEscape
                | RequestTargetError::InvalidUtf8
                | RequestTargetError::EscapedSlash
                | RequestTargetError::Parameter
                | RequestTargetError::CaseVariant,
            ) => ProblemKind::InvalidPath,
            Rejection::RequestTarget(
                RequestTargetError::MissingHost
                | RequestTargetError::RepeatedHost
                | RequestTargetError::InvalidHost
                | RequestTargetError::ConflictingHost,
            ) => ProblemKind::InvalidHost,
            Rejection::RequestTarget(RequestTargetError::MethodCase) => ProblemKind::InvalidMethod,
            Rejection::Key(KeyError::Missing) => ProblemKind::MissingKey,
            Rejection::Key(
                KeyError::Empty
                | KeyError::TooLong
                | KeyError::NotVisibleAscii
                | KeyError::Repeated
                | KeyError::MalformedString
                | KeyError::DotSegment,
            ) => ProblemKind::InvalidKey,
            Rejection::KeySource(SourceError::Missing { .. }) => ProblemKind::MissingKey,
            Rejection::KeySource(SourceError::Invalid { .. } | SourceError::NotJson { .. }) => ProblemKind::InvalidKey,
            Rejection::BodyTooLarge(_) => ProblemKind::BodyTooLarge,
            Rejection::BodyTimeout(_) | Rejection::BodyIdle(_) => ProblemKind::BodyTimeout,
            Rejection::BodyIncomplete(_) => ProblemKind::BodyIncomplete,
            Rejection::UnverifiedScope(_) => ProblemKind::UnverifiedScope,
            Rejection::KeyReused => ProblemKind::KeyReused,
            Rejection::InProgress { .. } => ProblemKind::InProgress,
            Rejection::OutcomeUnknown { .. } => ProblemKind::OutcomeUnknown,
            Rejection::ResponseExpired(_) => ProblemKind::ResponseExpired,
            Rejection::Overloaded(_) => ProblemKind::Overloaded,
            Rejection::ReplayUnavailable(_) => ProblemKind::ReplayUnavailable,
            Rejection::Store(StoreError::Full { .. }) => ProblemKind::StoreFull,
            Rejection::Store(StoreError::ScopeFull { .. }) => ProblemKind::ScopeFull,
            Rejection::Store(StoreError::ClientFull { .. }) => ProblemKind::ClientFull,
            Rejection::Store(
                StoreError::Unreachable { .. }
                | StoreError::Handshake(_)
                | StoreError::Timeout { .. }
                | StoreError::Refused { .. }
                | StoreError::Protocol(_)
                | StoreError::NotReplicated { .. }
                | StoreError::Unready(_)
                | StoreError::Previous(_)
                | StoreError::Disk(_)
                | StoreError::File(_),
            ) => ProblemKind::StoreUnavailable,
            Rejection::Upstream(UpstreamError::Unavailable(_)) => ProblemKind::UpstreamUnavailable,
            Rejection::Upstream(UpstreamError::Timeout(_)) => ProblemKind::UpstreamTimeout,
            Rejection::Upstream(UpstreamError::Failed(_)) => ProblemKind::UpstreamFailed,
            Rejection::Internal(ProxyError::Rewrite(_) | ProxyError::ExchangeLost | ProxyError::Random) => {
                ProblemKind::Internal
            }
            Rejection::Call(_) => ProblemKind::CallUnreadable,
        }
    }

    /// What failed under a store's or an upstream's failure, in the one word spans
    /// and metrics use (`StoreError::kind`, `UpstreamError::kind`): the `cause` of the
    /// problem's log line.
    pub(crate) fn cause(&self) -> Option<&'static str> {
        match self {
            Rejection::Store(error) => Some(error.kind()),
            Rejection::Upstream(error) => Some(error.kind()),
            _ => None,
        }
    }

    /// The problem to answer: the kind's row, and what this rejection adds to it (its
    /// own text for a client's mistake, when to retry, the challenge of a 401, whether
    /// an unknown outcome is being reconciled).
    pub(crate) fn problem(&self) -> Problem {
        let kind = self.kind();
        let detail = match kind.row().detail {
            Detail::Own => self.to_string(),
            Detail::Fixed(sentence) => sentence.to_string(),
        };
        // RFC 9110 §15.5.2: a 401 names the scheme that would be accepted.
        let authenticate = match self {
            Rejection::UnverifiedScope(JwtError::Missing) => Some("Bearer"),
            Rejection::UnverifiedScope(_) => Some("Bearer error=\"invalid_token\""),
            _ => None,
        };
        let retry_after = match self {
            Rejection::InProgress { retry_after, .. } => Some(retry_after.as_secs().max(1)),
            Rejection::Store(
                StoreError::ScopeFull { retry_after, .. }
                | StoreError::ClientFull { retry_after }
                | StoreError::Full { retry_after, .. },
            ) => Some(whole_seconds(*retry_after)),
            Rejection::Store(_) | Rejection::Overloaded(_) | Rejection::ReplayUnavailable(_) => Some(1),
            // The next probe, in whole seconds rounded up: a retry then may find it settled.
            Rejection::OutcomeUnknown {
                reconciling: Some(next),
                ..
            } => Some(whole_seconds(*next).max(1)),
            _ => None,
        };
        let (reconciling, reason) = match self {
            Rejection::OutcomeUnknown { reconciling, reason } => (Some(reconciling.is_some()), *reason),
            _ => (None, None),
        };
        let completed = match self {
            Rejection::ResponseExpired(completed) => Some(*completed),
            _ => None,
        };
        Problem {
            kind,
            detail,
            retry_after,
            authenticate,
            operation: None,
            reconciling,
            reason,
            completed,
            docs_url: None,
            profile: Profile::Ietf,
            jsonrpc: None,
        }
    }
}

/// What a 410 `response-expired` tells its client.
fn expired(completed: &Completion) -> String {
    let when = completed.at.map_or_else(String::new, |at| {
        format!(" at {}", humantime::format_rfc3339_seconds(at))
    });
    format!(
        "the operation with this key completed{when} with status {}, and its response is no longer kept; it was not run again (a new operation needs a new key)",
        completed.status
    )
}

/// `duration` in whole seconds, rounded up.
fn whole_seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// Displays an error followed by its sources, for logs. A source whose text its error
/// already ends with (the redis crate prints its cause, then gives it as the source) is
/// not repeated.
pub(crate) struct DisplayChain<'a>(pub(crate) &'a dyn std::error::Error);

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut previous = self.0.to_string();
        f.write_str(&previous)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !previous.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            previous = text;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_store_capacity_never_reaches_a_client() {
        let problem = Rejection::Store(StoreError::Full {
            what: Held::Records,
            limit: 12345,
            retry_after: Duration::from_secs(90),
        })
        .problem();
        assert_eq!(problem.row().status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(!problem.detail.contains("12345"), "{}", problem.detail);
        assert_eq!(problem.retry_after, Some(90), "when space is due, not 1 s");
    }

    #[test]
    fn overload_is_a_503_of_its_own_with_a_retry_after_and_no_capacity_in_it() {
        let problem = Rejection::Overloaded(Bound::Requests(4321)).problem();
        assert_eq!(
            (problem.row().status, problem.kind.slug()),
            (http::StatusCode::SERVICE_UNAVAILABLE, "overloaded")
        );
        assert_eq!(problem.retry_after, Some(1));
        assert_eq!(
            (problem.row().fault.level(), problem.row().outcome),
            (tracing::Level::WARN, Outcome::Rejected)
        );
        assert!(!problem.detail.contains("4321"), "{}", problem.detail);
        // The log names the bound reached; a body over the budget was once logged
        // with the request body limit as if it were the budget.
        let bytes = Rejection::Overloaded(Bound::Bytes);
        assert_eq!(bytes.problem().kind, ProblemKind::Overloaded);
        assert!(DisplayChain(&bytes).to_string().contains("server.max_buffered_bytes"));
        assert!(
            DisplayChain(&Rejection::Overloaded(Bound::Requests(4321)))
                .to_string()
                .contains("4321")
        );
    }

    #[test]
    fn an_unknown_outcome_says_whether_it_is_being_reconciled_and_when_to_retry() {
        let reconciling = Rejection::OutcomeUnknown {
            reason: None,
            reconciling: Some(Duration::from_millis(4_200)),
        }
        .problem();
        assert_eq!(
            (reconciling.retry_after, reconciling.reconciling),
            (Some(5), Some(true))
        );
        let due = Rejection::OutcomeUnknown {
            reason: None,
            reconciling: Some(Duration::ZERO),
        }
        .problem();
        assert_eq!(due.retry_after, Some(1));
        let left = Rejection::OutcomeUnknown {
            reconciling: None,
            reason: Some("unreadable"),
        }
        .problem();
        assert_eq!((left.retry_after, left.reconciling), (None, Some(false)));
        let body: serde_json::Value = serde_json::from_slice(left.into_response().body()).expect("a JSON problem");
        assert_eq!(body["reconciling"], serde_json::Value::Bool(false));
        assert_eq!(Rejection::KeyReused.problem().reconciling, None);
    }

    #[test]
    fn internal_errors_are_the_proxys_fault_and_counted_as_such() {
        let problem = Rejection::Internal(ProxyError::ExchangeLost).problem();
        assert_eq!(problem.row().status, http::StatusCode::INTERNAL_SERVER_ERROR);
        let row = problem.row();
        assert_eq!(
            (row.fault, row.outcome),
            (crate::problem::Fault::Proxy, Outcome::InternalError)
        );
        assert_eq!(row.fault.level(), tracing::Level::ERROR);
    }

    #[test]
    fn only_a_full_store_a_refusal_before_writing_or_a_failed_handshake_rules_out_a_write() {
        assert!(
            !StoreError::Full {
                what: Held::Bytes,
                limit: 1,
                retry_after: Duration::from_secs(1),
            }
            .may_have_written()
        );
        let failure = || StoreFailure::boxed("redis", "x");
        assert!(
            !StoreError::Handshake(failure()).may_have_written(),
            "a failed handshake wrote nothing"
        );
        for written in [false, true] {
            let unreachable = StoreError::Unreachable {
                source: failure(),
                may_have_written: written,
            };
            let refused = StoreError::Refused {
                source: failure(),
                may_have_written: written,
            };
            let timeout = StoreError::Timeout {
                after: Duration::from_secs(1),
                may_have_written: written,
            };
            for error in [unreachable, refused, timeout] {
                assert_eq!(error.may_have_written(), written, "{error:?}");
            }
        }
        assert!(StoreError::Protocol("x").may_have_written());
    }
}
