//! The store-level behaviour suite: every test here runs against the embedded memory
//! store, the SQLite store on a file of its own, and a real `redis-server` (plain and
//! over TLS), so the backends keep one semantics. Checks of one backend (the memory
//! store's bounds, TTLs read with PTTL, script cache loss, the SQLite file) follow.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idemproxy::config::{
    ClientIdentity, Encryption, PostgresConfig, RecordKey, RedisConfig, RedisTopology, SqliteConfig, StoreTls,
};
use idemproxy::error::{Held, StoreError};
use idemproxy::idempotency::{parse_key_value, store_key};
use idemproxy::record::ExecutionTrace;
use idemproxy::store::redis::ClaimPause;
use idemproxy::store::sqlite::ReadPause;
use idemproxy::store::{
    AnyStore, ClaimOutcome, ClaimRequest, ClientId, Deferred, Existing, Fingerprint, MemoryStore, OwnerToken,
    PostgresStore, Probe, ProbeSchedule, ProbeStart, RecordState, RecordStore, RedisStore, Resolution, Resolved,
    ScopeId, Sealer, SqliteStore, StoreKey, StoreLimits, StoreUsage, StoredResponse, SummaryState, UnknownReason,
    Write,
};
use support::pki::Pki;
use support::redis_server::ServerTls;
use support::{PostgresServer, RedisServer};

fn key(name: &str) -> StoreKey {
    let key = parse_key_value(name.as_bytes()).expect("valid key");
    store_key("test", "payments", &[], &key)
}

/// A fresh owner token.
fn new_owner() -> OwnerToken {
    OwnerToken::generate().expect("random bytes")
}

fn claim(key: &StoreKey, owner: OwnerToken, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        scope: None,
        client: None,
        owner,
        fingerprint: Fingerprint([1; 32]),
        retention: Duration::from_secs(60),
        remember: Duration::from_secs(60),
        lease,
        response_limit: 0,
        probe_key: None,
    }
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            ),
            (HeaderName::from_static("set-cookie"), HeaderValue::from_static("a=1")),
            (HeaderName::from_static("set-cookie"), HeaderValue::from_static("b=2")),
        ],
        body: Bytes::from_static(body.as_bytes()),
        // Every record these tests complete keeps an execution's trace, so each store
        // is shown to give it back with the response.
        trace: Some(ExecutionTrace {
            trace_id: [0x4b; 16],
            span_id: [0x1f; 8],
        }),
        // And when its replays stop, which every replay tells its client.
        replay_until: Some(std::time::UNIX_EPOCH + Duration::from_millis(1_900_000_000_123)),
    }
}

const LONG: Duration = Duration::from_secs(30);

/// Claims `key` with a new owner and completes it with `body`: a completed record.
/// Returns the owner.
async fn completed<S: RecordStore>(store: &S, key: &StoreKey, body: &'static str) -> OwnerToken {
    let owner = new_owner();
    store.claim(&claim(key, owner, LONG)).await.expect("claim");
    assert_eq!(
        store.complete(key, owner, &response(body)).await.expect("complete"),
        Write::Applied
    );
    owner
}

async fn state_of<S: RecordStore>(store: &S, key: &StoreKey) -> RecordState {
    match store.claim(&claim(key, new_owner(), LONG)).await.expect("claim") {
        ClaimOutcome::Existing(existing) => existing.state,
        ClaimOutcome::Acquired(()) => panic!("the key was free"),
    }
}

/// Polls until the record's lease has run out, checking that until then it reads
/// as in flight and never as free. Bounded at 10 s.
async fn until_lease_expires<S: RecordStore>(store: &S, key: &StoreKey) {
    let started = tokio::time::Instant::now();
    loop {
        match state_of(store, key).await {
            RecordState::LeaseExpired => return,
            RecordState::InFlight { .. } => {}
            other => panic!("unexpected state while waiting for the lease: {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the lease never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every write `owner` tries on `key` is refused by compare-and-set.
async fn assert_all_writes_fenced<S: RecordStore>(store: &S, key: &StoreKey, owner: OwnerToken) {
    let complete = store.complete(key, owner, &response("late")).await.expect("complete");
    let mark = store
        .mark_unknown(key, owner, UnknownReason::UpstreamFailed, None)
        .await
        .expect("mark");
    let release = store.release(key, owner).await.expect("release");
    assert_eq!((complete, mark, release), (Write::Fenced, Write::Fenced, Write::Fenced));
}

// === the suite ===

/// Issue 49 H2: whoever can write the store rewrites a sealed record in the clear
/// layout, keeping its fingerprint (an HMAC under the record key, which they cannot
/// make but can copy) and choosing the status, fields and body. Through the sealed
/// store the retry reads it as unreadable, never as a replay, even where clear records
/// are accepted; a record with a plain fingerprint in clear is refused by default.
async fn a_sealed_record_rewritten_in_clear_is_never_replayed<S>(store: &S)
where
    S: RecordStore + Clone + Into<AnyStore>,
{
    let encryption = |accept_clear_records| Encryption {
        key_env: "K".into(),
        previous_keys_env: None,
        current: RecordKey::from_bytes([7; 32]),
        previous: Vec::new(),
        accept_clear_records,
    };
    let plain = claim(&key("x"), new_owner(), LONG).fingerprint;
    let forged = StoredResponse {
        status: StatusCode::FOUND,
        headers: vec![(
            HeaderName::from_static("location"),
            HeaderValue::from_static("https://evil.example/"),
        )],
        body: Bytes::from_static(b"forged"),
        trace: None,
        replay_until: None,
    };
    // Writes `response` in clear for `key` under `fingerprint`, as a forger would.
    let rewrite = |key: StoreKey, fingerprint: Fingerprint| {
        let forged = forged.clone();
        async move {
            store.purge(&key).await.expect("purge");
            let owner = new_owner();
            let mut forgery = claim(&key, owner, LONG);
            forgery.fingerprint = fingerprint;
            assert_eq!(store.claim(&forgery).await.expect("claim"), ClaimOutcome::Acquired(()));
            let written = store.complete(&key, owner, &forged).await.expect("complete");
            assert_eq!(written, Write::Applied);
        }
    };
    for accept in [false, true] {
        let sealer = std::sync::Arc::new(Sealer::new(&encryption(accept)));
        let sealed: AnyStore = store.clone().into().sealed(Some(sealer.clone()));
        let record = key(&format!("forged-{accept}"));
        let owner = new_owner();
        let first = sealed.claim(&claim(&record, owner, LONG)).await.expect("claim");
        assert_eq!(first, ClaimOutcome::Acquired(()));
        let honest = response("honest");
        assert_eq!(
            sealed.complete(&record, owner, &honest).await.expect("complete"),
            Write::Applied
        );
        assert_eq!(
            state_of(&sealed, &record).await,
            RecordState::Completed(honest),
            "the sealed record replays"
        );
        let unreadable = RecordState::Unknown {
            reason: UnknownReason::Unreadable,
            probe: Probe::GaveUp,
        };
        rewrite(record.clone(), sealer.fingerprint(plain)).await;
        assert_eq!(
            state_of(&sealed, &record).await,
            unreadable,
            "accept_clear_records = {accept}: a clear record under a keyed fingerprint"
        );
        // The control: in clear under the plain fingerprint (written before encryption
        // was on) it replays only where clear records are accepted.
        rewrite(record.clone(), plain).await;
        let expected = if accept {
            RecordState::Completed(forged.clone())
        } else {
            unreadable
        };
        assert_eq!(
            state_of(&sealed, &record).await,
            expected,
            "accept_clear_records = {accept}"
        );
    }
}

async fn first_claim_acquires_and_others_see_it_in_flight<S: RecordStore>(store: &S) {
    let key = key("first");
    let owner = new_owner();
    assert_eq!(
        store.claim(&claim(&key, owner, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    match store.claim(&claim(&key, new_owner(), LONG)).await.expect("claim") {
        ClaimOutcome::Existing(Existing {
            fingerprint,
            state: RecordState::InFlight { lease_remaining },
        }) => {
            assert_eq!(fingerprint, Fingerprint([1; 32]));
            assert!(
                lease_remaining > Duration::from_secs(25) && lease_remaining <= LONG,
                "{lease_remaining:?}"
            );
        }
        other => panic!("expected in flight, got {other:?}"),
    }
}

async fn a_claim_retried_by_its_owner_counts_as_acquired<S: RecordStore>(store: &S) {
    let key = key("retry");
    let owner = new_owner();
    assert_eq!(
        store.claim(&claim(&key, owner, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    assert_eq!(
        store.claim(&claim(&key, owner, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
}

async fn a_completed_record_replays_exactly<S: RecordStore>(store: &S) {
    let key = key("complete");
    let owner = new_owner();
    store.claim(&claim(&key, owner, LONG)).await.expect("claim");
    let stored = response("{\"ok\":true}");
    assert_eq!(
        store.complete(&key, owner, &stored).await.expect("complete"),
        Write::Applied
    );
    assert_eq!(state_of(store, &key).await, RecordState::Completed(stored.clone()));
    // A completed record is never overwritten, not even by its owner.
    assert_all_writes_fenced(store, &key, owner).await;
    assert_eq!(state_of(store, &key).await, RecordState::Completed(stored));
}

async fn an_empty_response_round_trips<S: RecordStore>(store: &S) {
    let key = key("empty");
    let owner = new_owner();
    store.claim(&claim(&key, owner, LONG)).await.expect("claim");
    let stored = StoredResponse {
        status: StatusCode::NO_CONTENT,
        headers: vec![],
        body: Bytes::new(),
        trace: None,
        replay_until: None,
    };
    assert_eq!(
        store.complete(&key, owner, &stored).await.expect("complete"),
        Write::Applied
    );
    assert_eq!(state_of(store, &key).await, RecordState::Completed(stored));
}

async fn marked_unknown_stays_unknown<S: RecordStore>(store: &S) {
    let key = key("unknown");
    let owner = new_owner();
    store.claim(&claim(&key, owner, LONG)).await.expect("claim");
    assert_eq!(
        store
            .mark_unknown(&key, owner, UnknownReason::UpstreamTimeout, None)
            .await
            .expect("mark"),
        Write::Applied
    );
    assert_eq!(
        state_of(store, &key).await,
        RecordState::Unknown {
            reason: UnknownReason::UpstreamTimeout,
            probe: Probe::Unscheduled
        }
    );
    assert_eq!(
        store.complete(&key, owner, &response("late")).await.expect("complete"),
        Write::Fenced
    );
    assert_eq!(store.release(&key, owner).await.expect("release"), Write::Fenced);
    assert_eq!(
        state_of(store, &key).await,
        RecordState::Unknown {
            reason: UnknownReason::UpstreamTimeout,
            probe: Probe::Unscheduled
        }
    );
}

async fn a_released_key_is_free_again<S: RecordStore>(store: &S) {
    let key = key("release");
    let owner = new_owner();
    store.claim(&claim(&key, owner, LONG)).await.expect("claim");
    assert_eq!(store.release(&key, owner).await.expect("release"), Write::Applied);
    assert_eq!(store.release(&key, owner).await.expect("release"), Write::Fenced);
    let next = new_owner();
    assert_eq!(
        store.claim(&claim(&key, next, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
}

async fn only_the_owner_can_write<S: RecordStore>(store: &S) {
    let key = key("owner");
    let owner = new_owner();
    let stranger = new_owner();
    store.claim(&claim(&key, owner, LONG)).await.expect("claim");
    assert_all_writes_fenced(store, &key, stranger).await;
    assert!(matches!(state_of(store, &key).await, RecordState::InFlight { .. }));
}

async fn an_expired_lease_reads_as_unknown_and_is_never_taken_over<S: RecordStore>(store: &S) {
    let key = key("lease");
    let owner = new_owner();
    store
        .claim(&claim(&key, owner, Duration::from_millis(300)))
        .await
        .expect("claim");
    until_lease_expires(store, &key).await;
    // Not even the owner gets it back, and its late complete is refused.
    match store.claim(&claim(&key, owner, LONG)).await.expect("claim") {
        ClaimOutcome::Existing(Existing {
            state: RecordState::LeaseExpired,
            ..
        }) => {}
        other => panic!("expected lease expired, got {other:?}"),
    }
    assert_eq!(
        store.complete(&key, owner, &response("late")).await.expect("complete"),
        Write::Fenced
    );
    assert_eq!(state_of(store, &key).await, RecordState::LeaseExpired);
    // The owner may still say why, and may still free a claim it never forwarded.
    assert_eq!(
        store
            .mark_unknown(&key, owner, UnknownReason::UpstreamTimeout, None)
            .await
            .expect("mark"),
        Write::Applied
    );
    assert_eq!(
        state_of(store, &key).await,
        RecordState::Unknown {
            reason: UnknownReason::UpstreamTimeout,
            probe: Probe::Unscheduled
        }
    );
}

/// A claims; A's record is removed and B claims the key; A's late complete,
/// mark-unknown and release all fail; B's record is intact.
async fn a_stale_owner_is_fenced_off<S: RecordStore>(store: &S) {
    let key = key("fencing");
    let a = new_owner();
    let b = new_owner();
    assert_eq!(
        store.claim(&claim(&key, a, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    assert!(store.purge(&key).await.expect("purge"));
    assert_eq!(
        store.claim(&claim(&key, b, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );

    assert_all_writes_fenced(store, &key, a).await;

    assert!(matches!(state_of(store, &key).await, RecordState::InFlight { .. }));
    let from_b = response("from B");
    assert_eq!(
        store.complete(&key, b, &from_b).await.expect("complete"),
        Write::Applied
    );
    assert_eq!(
        store.complete(&key, a, &response("from A")).await.expect("complete"),
        Write::Fenced
    );
    assert_eq!(state_of(store, &key).await, RecordState::Completed(from_b));
}

async fn the_fingerprint_is_kept_with_every_state<S: RecordStore>(store: &S) {
    let key = key("fingerprint");
    let owner = new_owner();
    let mut first = claim(&key, owner, LONG);
    first.fingerprint = Fingerprint([9; 32]);
    store.claim(&first).await.expect("claim");
    store.complete(&key, owner, &response("x")).await.expect("complete");
    match store.claim(&claim(&key, new_owner(), LONG)).await.expect("claim") {
        ClaimOutcome::Existing(existing) => assert_eq!(existing.fingerprint, Fingerprint([9; 32])),
        other => panic!("{other:?}"),
    }
}

// === the operator's view ===

async fn an_operator_sees_every_state_and_never_the_body<S: RecordStore>(store: &S) {
    let done = key("op-done");
    assert_eq!(store.inspect(&done).await.expect("inspect"), None);
    let owner = new_owner();
    store.claim(&claim(&done, owner, LONG)).await.expect("claim");
    let summary = store.inspect(&done).await.expect("inspect").expect("a record");
    assert_eq!(summary.fingerprint, Fingerprint([1; 32]));
    assert!(
        Duration::from_secs(58) <= summary.ttl && summary.ttl <= Duration::from_secs(60),
        "{summary:?}"
    );
    match summary.state {
        SummaryState::InFlight { lease_remaining } => {
            assert!(
                Duration::from_secs(28) <= lease_remaining && lease_remaining <= LONG,
                "{lease_remaining:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    store
        .complete(&done, owner, &response("twelve bytes"))
        .await
        .expect("complete");
    assert_eq!(
        store.inspect(&done).await.expect("inspect").expect("a record").state,
        SummaryState::Completed {
            status: 201,
            response_bytes: 12,
            trace_id: Some("4b".repeat(16)),
        }
    );

    let unknown = key("op-unknown");
    let owner = new_owner();
    store.claim(&claim(&unknown, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&unknown, owner, UnknownReason::ResponseTooLarge, None)
        .await
        .expect("mark");
    assert_eq!(
        store.inspect(&unknown).await.expect("inspect").expect("a record").state,
        SummaryState::Unknown {
            reason: UnknownReason::ResponseTooLarge,
            probe: Probe::Unscheduled
        }
    );

    let expired = key("op-expired");
    store
        .claim(&claim(&expired, new_owner(), Duration::from_millis(300)))
        .await
        .expect("claim");
    until_lease_expires(store, &expired).await;
    assert_eq!(
        store.inspect(&expired).await.expect("inspect").expect("a record").state,
        SummaryState::LeaseExpired
    );
    // Inspecting changes nothing.
    assert_eq!(
        state_of(store, &done).await,
        RecordState::Completed(response("twelve bytes"))
    );
}

async fn an_operator_frees_only_an_unknown_record_and_purges_any<S: RecordStore>(store: &S) {
    let live = key("op-live");
    let live_owner = new_owner();
    store.claim(&claim(&live, live_owner, LONG)).await.expect("claim");
    assert_eq!(
        store
            .resolve(&live, Some(live_owner), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::NotUnknown
    );
    assert!(matches!(state_of(store, &live).await, RecordState::InFlight { .. }));

    let done = key("op-done");
    let owner = completed(store, &done, "x").await;
    assert_eq!(
        store
            .resolve(&done, Some(owner), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::NotUnknown
    );
    assert_eq!(state_of(store, &done).await, RecordState::Completed(response("x")));

    let unknown = key("op-unknown");
    let owner = new_owner();
    store.claim(&claim(&unknown, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&unknown, owner, UnknownReason::UpstreamTimeout, None)
        .await
        .expect("mark");
    // Fenced on the claim: the unknown outcome is this owner's, and what was learned
    // about another claim does not resolve it.
    assert_eq!(
        store
            .resolve(&unknown, Some(new_owner()), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::OtherClaim
    );
    let shown = store.inspect(&unknown).await.expect("inspect").expect("a record");
    assert_eq!(shown.owner, Some(owner), "show names the claim to fence on");
    assert_eq!(
        store
            .resolve(&unknown, Some(owner), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::Resolved
    );
    assert_eq!(
        store
            .resolve(&unknown, Some(owner), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::Absent
    );
    // The next request with the key runs.
    assert_eq!(
        store.claim(&claim(&unknown, new_owner(), LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );

    // Naming no claim resolves whichever is unknown, and still nothing else: not a
    // live claim, not a recorded response.
    for (record, state) in [(&live, "live"), (&done, "completed")] {
        assert_eq!(
            store
                .resolve(record, None, &Resolution::NotApplied)
                .await
                .expect("resolve"),
            Resolved::NotUnknown,
            "{state}"
        );
    }
    let unnamed = key("op-unnamed");
    let owner = new_owner();
    store.claim(&claim(&unnamed, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&unnamed, owner, UnknownReason::UpstreamFailed, None)
        .await
        .expect("mark");
    assert_eq!(
        store
            .resolve(&unnamed, None, &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::Resolved
    );
    assert_eq!(
        store.claim(&claim(&unnamed, new_owner(), LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );

    // Resolved as applied: the response becomes the record's, under the first
    // request's fingerprint and expiry; a second resolution (a probe's after an
    // operator's) finds nothing unknown, and the owner's late write is fenced.
    let applied = key("op-applied");
    let owner = new_owner();
    store.claim(&claim(&applied, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&applied, owner, UnknownReason::UpstreamFailed, None)
        .await
        .expect("mark");
    let ttl_before = store.inspect(&applied).await.expect("inspect").expect("a record").ttl;
    let learned = Resolution::Applied(response("learned"));
    assert_eq!(
        store.resolve(&applied, Some(owner), &learned).await.expect("resolve"),
        Resolved::Resolved
    );
    assert_eq!(
        state_of(store, &applied).await,
        RecordState::Completed(response("learned"))
    );
    let ttl_after = store.inspect(&applied).await.expect("inspect").expect("a record").ttl;
    assert!(
        ttl_after <= ttl_before,
        "the expiry moved: {ttl_before:?} -> {ttl_after:?}"
    );
    assert_eq!(
        store
            .resolve(&applied, Some(owner), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::NotUnknown
    );
    assert_eq!(
        store
            .resolve(&applied, Some(owner), &Resolution::Applied(response("other")))
            .await
            .expect("resolve"),
        Resolved::NotUnknown
    );
    assert_eq!(
        state_of(store, &applied).await,
        RecordState::Completed(response("learned"))
    );
    assert_eq!(
        store
            .complete(&applied, owner, &response("late"))
            .await
            .expect("complete"),
        Write::Fenced
    );

    let expired = key("op-expired");
    let expired_owner = new_owner();
    store
        .claim(&claim(&expired, expired_owner, Duration::from_millis(300)))
        .await
        .expect("claim");
    until_lease_expires(store, &expired).await;
    assert_eq!(
        store
            .resolve(&expired, Some(expired_owner), &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::Resolved
    );
    // Its old owner's late write finds nothing of its own.
    assert_eq!(
        store
            .complete(&expired, expired_owner, &response("late"))
            .await
            .expect("complete"),
        Write::Fenced
    );

    // Purge removes whatever is there, live claims included.
    assert!(store.purge(&live).await.expect("purge"));
    assert!(!store.purge(&live).await.expect("purge"));
    assert_eq!(store.inspect(&live).await.expect("inspect"), None);
    assert_eq!(
        store
            .complete(&live, live_owner, &response("late"))
            .await
            .expect("complete"),
        Write::Fenced
    );
}

/// A probe schedule: due at once, giving up after `give_up`.
fn schedule(give_up: Duration) -> ProbeSchedule {
    ProbeSchedule {
        first_after: Duration::ZERO,
        give_up_after: give_up,
    }
}

/// The probe state of an unknown record, as a retry reads it.
async fn probe_of<S: RecordStore>(store: &S, key: &StoreKey) -> Probe {
    match state_of(store, key).await {
        RecordState::Unknown { probe, .. } => probe,
        other => panic!("not unknown: {other:?}"),
    }
}

/// Whether the probe lease is exclusive: once one caller holds it, nobody else may
/// begin a probe until it ends or is deferred, and a deferred probe is not due before
/// `every`. (A function that answers, so a broken script can be shown to fail it.)
async fn probe_lease_is_exclusive<S: RecordStore>(store: &S) -> bool {
    let record = key(&format!("probe-exclusive-{}", new_owner().to_hex()));
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule(LONG * 4)))
        .await
        .expect("mark");
    assert_eq!(
        probe_of(store, &record).await,
        Probe::Next(Duration::ZERO),
        "due at once"
    );
    let first = store
        .begin_probe(&record, schedule(LONG * 4), LONG)
        .await
        .expect("begin");
    let second = store
        .begin_probe(&record, schedule(LONG * 4), LONG)
        .await
        .expect("begin");
    let leased_once =
        first == ProbeStart::Leased(owner) && matches!(second, ProbeStart::NotDue(wait) if wait > LONG / 2);
    let deferred = store.defer_probe(&record, owner, LONG).await.expect("defer");
    let third = store
        .begin_probe(&record, schedule(LONG * 4), LONG)
        .await
        .expect("begin");
    leased_once && deferred == Deferred::Scheduled && matches!(third, ProbeStart::NotDue(wait) if wait > LONG / 2)
}

async fn a_probe_lease_is_held_by_one_caller_at_a_time<S: RecordStore>(store: &S) {
    assert!(probe_lease_is_exclusive(store).await);
}

async fn a_probe_is_fenced_on_its_claim_and_ends_with_the_record<S: RecordStore>(store: &S) {
    let record = key("probe-fenced");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamFailed, Some(schedule(LONG * 4)))
        .await
        .expect("mark");
    assert_eq!(
        store
            .begin_probe(&record, schedule(LONG * 4), LONG)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    match probe_of(store, &record).await {
        Probe::Next(wait) => assert!(wait > LONG / 2, "the lease shows as the next probe: {wait:?}"),
        other => panic!("{other:?}"),
    }
    // Deferring another claim's probe changes nothing.
    assert_eq!(
        store.defer_probe(&record, new_owner(), LONG).await.expect("defer"),
        Deferred::Settled
    );
    assert_eq!(
        store
            .resolve(&record, Some(owner), &Resolution::Applied(response("probed")))
            .await
            .expect("resolve"),
        Resolved::Resolved
    );
    assert_eq!(
        store
            .begin_probe(&record, schedule(LONG * 4), LONG)
            .await
            .expect("begin"),
        ProbeStart::Settled
    );
    assert_eq!(
        store.defer_probe(&record, owner, LONG).await.expect("defer"),
        Deferred::Settled
    );
    assert_eq!(
        state_of(store, &record).await,
        RecordState::Completed(response("probed"))
    );

    // Nothing to probe: a live claim, a recorded response, no record.
    let live = key("probe-live");
    store.claim(&claim(&live, new_owner(), LONG)).await.expect("claim");
    let done = key("probe-done");
    let done_owner = new_owner();
    store.claim(&claim(&done, done_owner, LONG)).await.expect("claim");
    store
        .complete(&done, done_owner, &response("done"))
        .await
        .expect("complete");
    for record in [&live, &done, &key("probe-absent")] {
        assert_eq!(
            store.begin_probe(record, schedule(LONG), LONG).await.expect("begin"),
            ProbeStart::Settled,
            "{record:?}"
        );
    }
}

async fn an_ended_probe_lease_is_taken_over<S: RecordStore>(store: &S) {
    let record = key("probe-takeover");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule(LONG)))
        .await
        .expect("mark");
    let lease = Duration::from_millis(300);
    assert_eq!(
        store.begin_probe(&record, schedule(LONG), lease).await.expect("begin"),
        ProbeStart::Leased(owner)
    );
    // Its instance died: nobody defers or resolves. Until the lease ends the probe is
    // not due; then the next caller takes it, for the same claim.
    let started = tokio::time::Instant::now();
    loop {
        match store.begin_probe(&record, schedule(LONG), LONG).await.expect("begin") {
            ProbeStart::Leased(claim) => {
                assert_eq!(claim, owner);
                assert!(started.elapsed() >= lease / 2, "taken before the lease ended");
                break;
            }
            ProbeStart::NotDue(wait) => assert!(wait <= lease, "{wait:?}"),
            other => panic!("{other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the probe lease never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether a probe taken long after it fell due (overdue by more than a lease: nobody
/// retried for a while) is leased from now, not from when it was due, so that a second
/// caller finds it not due and two instances never probe it together. (A function
/// that answers, so a broken script can be shown to fail it.)
async fn an_overdue_probe_lease_starts_now<S: RecordStore>(store: &S) -> bool {
    let record = key(&format!("probe-overdue-{}", new_owner().to_hex()));
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule(LONG * 4)))
        .await
        .expect("mark");
    let lease = Duration::from_millis(200);
    // Due at once, and left due for three leases.
    tokio::time::sleep(lease * 3).await;
    assert_eq!(probe_of(store, &record).await, Probe::Next(Duration::ZERO));
    assert_eq!(
        store
            .begin_probe(&record, schedule(LONG * 4), lease)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    let second = store
        .begin_probe(&record, schedule(LONG * 4), lease)
        .await
        .expect("begin");
    matches!(second, ProbeStart::NotDue(wait) if wait > lease / 2)
}

/// An overdue probe is leased from now; and a deferred probe is next due `every` from
/// now, whatever the lease was (an interval far from the lease, so that a reschedule
/// that kept the lease's due time shows).
async fn an_overdue_probe_is_leased_from_now_and_deferred_by_its_interval<S: RecordStore>(store: &S) {
    assert!(
        an_overdue_probe_lease_starts_now(store).await,
        "a second caller took an overdue probe's lease"
    );
    let record = key("probe-deferred");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule(LONG * 4)))
        .await
        .expect("mark");
    let lease = Duration::from_millis(200);
    assert_eq!(
        store
            .begin_probe(&record, schedule(LONG * 4), lease)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    let every = Duration::from_secs(20);
    assert_eq!(
        store.defer_probe(&record, owner, every).await.expect("defer"),
        Deferred::Scheduled
    );
    let near = |wait: Duration| wait > every - Duration::from_secs(2) && wait <= every;
    match store
        .begin_probe(&record, schedule(LONG * 4), lease)
        .await
        .expect("begin")
    {
        ProbeStart::NotDue(wait) => assert!(near(wait), "deferred by {every:?}, due in {wait:?}"),
        other => panic!("{other:?}"),
    }
    match probe_of(store, &record).await {
        Probe::Next(wait) => assert!(near(wait), "deferred by {every:?}, due in {wait:?}"),
        other => panic!("{other:?}"),
    }
}

/// A late `mark_unknown` from a claim's owner (its exchange ended after its lease, and
/// a probe has taken the record over as `lease-expired`) is fenced: the record is not
/// in flight any more, so its reason and its probe lease stand. And an owner cannot
/// mark its record unknown twice.
async fn a_late_mark_unknown_never_rewrites_an_unknown_record<S: RecordStore>(store: &S) {
    let record = key("late-mark");
    let owner = new_owner();
    store
        .claim(&claim(&record, owner, Duration::from_millis(300)))
        .await
        .expect("claim");
    until_lease_expires(store, &record).await;
    assert_eq!(
        store
            .begin_probe(&record, schedule(LONG * 4), LONG)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    assert_eq!(
        store
            .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule(LONG * 4)))
            .await
            .expect("mark"),
        Write::Fenced
    );
    match state_of(store, &record).await {
        RecordState::Unknown {
            reason: UnknownReason::LeaseExpired,
            probe: Probe::Next(wait),
        } => assert!(wait > LONG / 2, "the probe's lease stands: {wait:?}"),
        other => panic!("the late mark rewrote the record: {other:?}"),
    }

    let twice = key("marked-twice");
    let owner = new_owner();
    store.claim(&claim(&twice, owner, LONG)).await.expect("claim");
    let mark = |reason| store.mark_unknown(&twice, owner, reason, Some(schedule(LONG * 4)));
    assert_eq!(mark(UnknownReason::UpstreamFailed).await.expect("mark"), Write::Applied);
    assert_eq!(
        store
            .begin_probe(&twice, schedule(LONG * 4), LONG)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    assert_eq!(mark(UnknownReason::UpstreamTimeout).await.expect("mark"), Write::Fenced);
    match state_of(store, &twice).await {
        RecordState::Unknown {
            reason: UnknownReason::UpstreamFailed,
            probe: Probe::Next(wait),
        } => assert!(wait > LONG / 2, "{wait:?}"),
        other => panic!("{other:?}"),
    }
}

/// A probe is given up once `give_up_after` has passed, however it was found: a probe
/// due and not taken until past it gives up at once (and stays given up), and a record
/// that none was scheduled for counts `give_up_after` from when it was first probed.
async fn a_probe_gives_up_at_its_give_up_after_however_it_is_found<S: RecordStore>(store: &S) {
    let give_up = Duration::from_millis(400);
    let overdue = key("gives-up-when-found");
    let owner = new_owner();
    store.claim(&claim(&overdue, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&overdue, owner, UnknownReason::UpstreamTimeout, Some(schedule(give_up)))
        .await
        .expect("mark");
    tokio::time::sleep(give_up + Duration::from_millis(200)).await;
    for _ in 0..2 {
        assert_eq!(
            store
                .begin_probe(&overdue, schedule(give_up), LONG)
                .await
                .expect("begin"),
            ProbeStart::GaveUp
        );
        assert_eq!(probe_of(store, &overdue).await, Probe::GaveUp);
    }

    let unscheduled = key("gives-up-unscheduled");
    let owner = new_owner();
    store.claim(&claim(&unscheduled, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&unscheduled, owner, UnknownReason::ResponseTooLarge, None)
        .await
        .expect("mark");
    let lease = Duration::from_millis(100);
    assert_eq!(
        store
            .begin_probe(&unscheduled, schedule(give_up), lease)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    assert_eq!(
        store.defer_probe(&unscheduled, owner, lease).await.expect("defer"),
        Deferred::Scheduled
    );
    tokio::time::sleep(give_up + Duration::from_millis(200)).await;
    assert_eq!(
        store
            .begin_probe(&unscheduled, schedule(give_up), lease)
            .await
            .expect("begin"),
        ProbeStart::GaveUp
    );
}

async fn a_probe_gives_up_past_its_schedule<S: RecordStore>(store: &S) {
    let record = key("probe-gives-up");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    let give_up = Duration::from_millis(400);
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule(give_up)))
        .await
        .expect("mark");
    assert_eq!(
        store
            .begin_probe(&record, schedule(give_up), Duration::from_millis(100))
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    // The next probe would begin past give_up_after: given up, and it stays so.
    assert_eq!(
        store
            .defer_probe(&record, owner, Duration::from_secs(1))
            .await
            .expect("defer"),
        Deferred::GaveUp
    );
    assert_eq!(probe_of(store, &record).await, Probe::GaveUp);
    assert_eq!(
        store
            .begin_probe(&record, schedule(give_up), LONG)
            .await
            .expect("begin"),
        ProbeStart::GaveUp
    );
    // An operator still resolves it.
    assert_eq!(
        store
            .resolve(&record, None, &Resolution::NotApplied)
            .await
            .expect("resolve"),
        Resolved::Resolved
    );
}

async fn a_lapsed_lease_or_an_unscheduled_record_is_probed_when_found<S: RecordStore>(store: &S) {
    // A claim whose owner died: the probe takes it over as unknown, for that claim.
    let lapsed = key("probe-lapsed");
    let owner = new_owner();
    store
        .claim(&claim(&lapsed, owner, Duration::from_millis(300)))
        .await
        .expect("claim");
    until_lease_expires(store, &lapsed).await;
    assert_eq!(
        store
            .begin_probe(&lapsed, schedule(LONG * 4), LONG)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    match state_of(store, &lapsed).await {
        RecordState::Unknown {
            reason: UnknownReason::LeaseExpired,
            probe: Probe::Next(wait),
        } => assert!(wait > LONG / 2, "{wait:?}"),
        other => panic!("{other:?}"),
    }
    // Its old owner's late write is still fenced.
    assert_eq!(
        store
            .complete(&lapsed, owner, &response("late"))
            .await
            .expect("complete"),
        Write::Fenced
    );

    // Marked unknown where the route had no probe: scheduled when first found.
    let unscheduled = key("probe-unscheduled");
    let owner = new_owner();
    store.claim(&claim(&unscheduled, owner, LONG)).await.expect("claim");
    store
        .mark_unknown(&unscheduled, owner, UnknownReason::ResponseTooLarge, None)
        .await
        .expect("mark");
    assert_eq!(probe_of(store, &unscheduled).await, Probe::Unscheduled);
    assert_eq!(
        store
            .begin_probe(&unscheduled, schedule(LONG * 4), LONG)
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    assert!(matches!(probe_of(store, &unscheduled).await, Probe::Next(_)));
}

macro_rules! against_every_store {
    ($($name:ident),* $(,)?) => {
        mod memory_store {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(&super::MemoryStore::new(1000, usize::MAX)).await;
                }
            )*
        }
        /// A fresh file in a directory of its own, closed (its writer joined) before
        /// the directory goes.
        mod sqlite_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let dir = tempfile::tempdir().expect("temporary directory");
                    let store = super::sqlite_store(&dir.path().join("records.db"), super::StoreLimits::unbounded(1000));
                    super::$name(&store).await;
                    drop(store);
                }
            )*
        }
        mod redis_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let server = super::RedisServer::start();
                    let store = super::RedisStore::standalone(&server.url(), super::Duration::from_secs(2)).expect("store");
                    super::$name(&store).await;
                }
            )*
        }
        /// A Postgres server of the test's own, the schema made by the store's migration.
        mod postgres_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let server = super::PostgresServer::start();
                    let store = super::postgres_store(&server).await;
                    super::$name(&store).await;
                    drop(server);
                }
            )*
        }
        /// Over TLS to a server that requires a client certificate, both from a
        /// private CA made for the test.
        mod redis_tls_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let (_pki, server, store) = super::tls_store();
                    super::$name(&store).await;
                    drop(server);
                }
            )*
        }
    };
}

/// A SQLite store on `path`, with `limits` and a 2 s timeout.
fn sqlite_store(path: &std::path::Path, limits: StoreLimits) -> SqliteStore {
    let config = SqliteConfig {
        path: path.to_path_buf(),
        limits,
        cache_bytes: 4 << 20,
        response_budget: usize::MAX,
    };
    SqliteStore::open(&config, Duration::from_secs(2)).expect("open the sqlite store")
}

/// A Postgres store on `server`'s `postgres` database, schema `idemproxy`, 2 s timeout.
async fn postgres_store(server: &PostgresServer) -> PostgresStore {
    PostgresStore::open(
        &PostgresConfig::at(&server.url()).expect("the test server's URL"),
        Duration::from_secs(2),
    )
    .await
    .expect("open the postgres store")
}

/// A `redis-server` with `tls-auth-clients yes` and a store that trusts its private CA
/// and presents a client certificate.
fn tls_store() -> (Pki, RedisServer, RedisStore) {
    let pki = Pki::new("store suite CA");
    let issued = pki.server();
    let server = RedisServer::start_tls(&ServerTls {
        cert_file: issued.cert_file,
        key_file: issued.key_file,
        ca_file: pki.ca_file.clone(),
        auth_clients: true,
    });
    let client = pki.client("idemproxy", false);
    let config = RedisConfig {
        topology: RedisTopology::Standalone { url: server.tls_url() },
        min_replica_acks: 0,
        replica_ack_timeout: Duration::from_millis(100),
        tls: Some(StoreTls {
            ca_file: Some(pki.ca_file.clone()),
            client: Some(ClientIdentity {
                cert_file: client.cert_file,
                key_file: client.key_file,
            }),
        }),
        connections: 2,
    };
    let store = RedisStore::new(&config, Duration::from_secs(2)).expect("store");
    (pki, server, store)
}

against_every_store!(
    a_sealed_record_rewritten_in_clear_is_never_replayed,
    first_claim_acquires_and_others_see_it_in_flight,
    a_claim_retried_by_its_owner_counts_as_acquired,
    a_completed_record_replays_exactly,
    an_empty_response_round_trips,
    marked_unknown_stays_unknown,
    a_released_key_is_free_again,
    only_the_owner_can_write,
    an_expired_lease_reads_as_unknown_and_is_never_taken_over,
    a_stale_owner_is_fenced_off,
    the_fingerprint_is_kept_with_every_state,
    an_operator_sees_every_state_and_never_the_body,
    an_operator_frees_only_an_unknown_record_and_purges_any,
    a_probe_lease_is_held_by_one_caller_at_a_time,
    a_probe_is_fenced_on_its_claim_and_ends_with_the_record,
    an_ended_probe_lease_is_taken_over,
    an_overdue_probe_is_leased_from_now_and_deferred_by_its_interval,
    a_probe_gives_up_past_its_schedule,
    a_late_mark_unknown_never_rewrites_an_unknown_record,
    a_probe_gives_up_at_its_give_up_after_however_it_is_found,
    a_lapsed_lease_or_an_unscheduled_record_is_probed_when_found,
);

// === memory only ===

/// Claims `name` with a 200 ms lease and a 400 ms retention.
fn short(name: &str) -> ClaimRequest {
    ClaimRequest {
        retention: Duration::from_millis(400),
        remember: Duration::from_millis(400),
        ..claim(&key(name), new_owner(), Duration::from_millis(200))
    }
}

/// A full memory store is swept by a refused claim only once a record can have
/// expired: a sweep walks every record under the lock every request takes, and once
/// per refusal it made a full store answer its 503s at 2,400 a second (100,000
/// records) and slowed every replay with them.
#[tokio::test(start_paused = true)]
async fn a_full_memory_store_is_not_swept_for_every_claim_it_refuses() {
    let store = MemoryStore::new(2, usize::MAX);
    for name in ["a", "b"] {
        assert_eq!(
            store.claim(&short(name)).await.expect("claim"),
            ClaimOutcome::Acquired(())
        );
    }
    let before = store.sweeps();
    for n in 0..1000 {
        assert!(matches!(
            store.claim(&short(&format!("refused-{n}"))).await,
            Err(StoreError::Full { .. })
        ));
    }
    assert!(
        store.sweeps() - before <= 1,
        "{} sweeps for 1,000 refusals",
        store.sweeps() - before
    );
    // At the first expiry, the next refused claim sweeps, and takes its key.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        store.claim(&short("after")).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
}

/// Tokio's paused clock makes the expiry exact: the refusal holds until the retention
/// has passed, and not a moment longer.
#[tokio::test(start_paused = true)]
async fn a_full_memory_store_refuses_new_claims_and_never_evicts_live_records() {
    let store = MemoryStore::new(2, usize::MAX);
    for name in ["a", "b"] {
        assert_eq!(
            store.claim(&short(name)).await.expect("claim"),
            ClaimOutcome::Acquired(())
        );
    }
    assert_eq!(store.len(), 2);
    assert!(!store.is_empty());
    let refused = store.claim(&short("c")).await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Full {
                what: Held::Records,
                limit: 2,
                ..
            })
        ),
        "{refused:?}"
    );
    // Both live records are still there, and an existing key is still answered.
    for name in ["a", "b"] {
        assert!(matches!(
            state_of(&store, &key(name)).await,
            RecordState::InFlight { .. }
        ));
    }
    tokio::time::sleep(Duration::from_millis(399)).await;
    assert!(matches!(store.claim(&short("c")).await, Err(StoreError::Full { .. })));
    // Once they expire, a claim sweeps them and takes its key.
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        store.claim(&short("c")).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    assert_eq!(store.len(), 1);
}

/// The byte bound counts what records hold: every completed body, its headers and its
/// key. Claims are refused once the sum reaches `max_bytes`, and admitted again when
/// records expire.
#[tokio::test(start_paused = true)]
async fn a_memory_store_at_its_byte_bound_refuses_new_claims_until_records_expire() {
    const BODY: usize = 256 * 1024;
    const MAX: usize = 1024 * 1024;
    let store = MemoryStore::new(1000, MAX);
    let big = |seed: u8| StoredResponse {
        status: StatusCode::OK,
        headers: vec![(HeaderName::from_static("x-seed"), HeaderValue::from(u16::from(seed)))],
        body: Bytes::from(vec![seed; BODY]),
        trace: None,
        replay_until: None,
    };
    assert_eq!((store.usage().records, store.usage().bytes), (0, 0));
    // Four 256 KiB bodies and their bookkeeping exceed 1 MiB; the fourth claim is
    // still admitted (the bound is checked before a body is known), the fifth is not.
    let mut held = 0;
    for seed in 0..4u8 {
        let request = short(&format!("big-{seed}"));
        assert_eq!(store.claim(&request).await.expect("claim"), ClaimOutcome::Acquired(()));
        let claimed = store.usage().bytes;
        let response = big(seed);
        assert_eq!(
            store
                .complete(&request.key, request.owner, &response)
                .await
                .expect("complete"),
            Write::Applied
        );
        let StoreUsage { records, bytes, .. } = store.usage();
        assert_eq!(records, usize::from(seed) + 1);
        assert_eq!(
            bytes - claimed,
            response.encode_headers().len() + response.body.len(),
            "completing adds exactly the response as packed: its fields' encoding and its body"
        );
        assert_eq!(response.size(), BODY + "x-seed".len() + seed.to_string().len());
        held = bytes;
    }
    assert!((MAX..MAX + 4 * 1024).contains(&held), "{held}");
    let refused = store.claim(&short("one-more")).await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Full {
                what: Held::Bytes,
                limit: MAX,
                ..
            })
        ),
        "{refused:?}"
    );
    // A retry of a recorded key is still answered from the store.
    match store.claim(&short("big-2")).await.expect("claim") {
        ClaimOutcome::Existing(Existing {
            state: RecordState::Completed(response),
            ..
        }) => {
            assert_eq!(response.body, big(2).body);
        }
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        store.claim(&short("after")).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    let StoreUsage { records, bytes, .. } = store.usage();
    assert_eq!(records, 1, "the expired records were swept");
    assert!(bytes < 1024, "{bytes}");
    // Releasing a claim gives its bytes back at once.
    let after = short("after-2");
    store.claim(&after).await.expect("claim");
    let before_release = store.usage().bytes;
    assert_eq!(
        store.release(&after.key, after.owner).await.expect("release"),
        Write::Applied
    );
    assert!(store.usage().bytes < before_release);
}

/// The sweeper drops expired records on its own, one sweep after they expire, without
/// waiting for the store to fill up. Tokio's paused clock makes the sweep's timing exact.
#[tokio::test(start_paused = true)]
async fn the_memory_store_sweeps_expired_records_in_the_background() {
    let store = MemoryStore::new(100, usize::MAX);
    let claim = ClaimRequest {
        retention: Duration::from_secs(5),
        remember: Duration::from_secs(5),
        ..claim(&key("swept"), new_owner(), Duration::from_secs(2))
    };
    store.claim(&claim).await.expect("claim");
    assert_eq!(store.len(), 1);
    // Just before the expiry the record is still held.
    tokio::time::sleep(Duration::from_millis(4_900)).await;
    assert_eq!(store.len(), 1, "swept before it expired");
    // One sweep period (1 s) after the expiry it is gone.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert!(store.is_empty(), "an expired record was never swept");
}

// === redis only ===

fn pttl(server: &RedisServer, key: &StoreKey) -> i64 {
    redis::cmd("PTTL")
        .arg(key.as_str())
        .query(&mut server.connection())
        .expect("PTTL")
}

fn assert_retention_ttl(server: &RedisServer, key: &StoreKey, when: &str) {
    let ttl = pttl(server, key);
    assert!(
        (58_000..=60_000).contains(&ttl),
        "{when}: PTTL {ttl} ms is not the 60 s retention (± 2 s)"
    );
}

#[tokio::test]
async fn every_record_key_carries_the_retention_ttl_never_the_lease() {
    let server = RedisServer::start();
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2)).expect("store");
    let lease = Duration::from_secs(1);

    let done = key("ttl-done");
    let owner = new_owner();
    store.claim(&claim(&done, owner, lease)).await.expect("claim");
    assert_retention_ttl(&server, &done, "in flight");
    assert_eq!(
        store.complete(&done, owner, &response("x")).await.expect("complete"),
        Write::Applied
    );
    assert_retention_ttl(&server, &done, "completed");

    let unknown = key("ttl-unknown");
    let owner = new_owner();
    store.claim(&claim(&unknown, owner, lease)).await.expect("claim");
    store
        .mark_unknown(&unknown, owner, UnknownReason::UpstreamTimeout, None)
        .await
        .expect("mark");
    assert_retention_ttl(&server, &unknown, "unknown");

    // Past the lease the record is still there, with its retention.
    let expired = key("ttl-expired");
    store
        .claim(&claim(&expired, new_owner(), Duration::from_millis(200)))
        .await
        .expect("claim");
    until_lease_expires(&store, &expired).await;
    assert_retention_ttl(&server, &expired, "lease expired");

    // One store key per record, and nothing else.
    let mut keys = server.keys();
    keys.sort();
    let mut expected = vec![
        done.as_str().to_string(),
        unknown.as_str().to_string(),
        expired.as_str().to_string(),
    ];
    expected.sort();
    assert_eq!(keys, expected);
}

/// A claim that finds a record in flight reads its lease in a second round trip. If
/// the record is released in between, the claim must write its own record and own
/// the key, never report it owned without having written it (then a third claim
/// would own it too). The pause is a test seam in the store, on a real Redis.
#[tokio::test]
async fn a_record_released_between_a_claim_and_its_lease_read_is_claimed_again() {
    let server = RedisServer::start();
    let first = RedisStore::standalone(&server.url(), Duration::from_secs(2)).expect("store");
    let pause = ClaimPause::default();
    let second = RedisStore::standalone(&server.url(), Duration::from_secs(2))
        .expect("store")
        .with_claim_pause(pause.clone());
    let key = key("vanishing");
    let (a, b) = (new_owner(), new_owner());
    assert_eq!(
        first.claim(&claim(&key, a, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );

    let racing = tokio::spawn({
        let (second, key) = (second.clone(), key.clone());
        async move { second.claim(&claim(&key, b, LONG)).await }
    });
    pause.reached.notified().await;
    assert_eq!(first.release(&key, a).await.expect("release"), Write::Applied);
    pause.resume.notify_one();
    assert_eq!(racing.await.expect("join").expect("claim"), ClaimOutcome::Acquired(()));

    // The record is b's: a third claim finds it in flight, and only b can complete it.
    let third = new_owner();
    assert!(matches!(
        first.claim(&claim(&key, third, LONG)).await.expect("claim"),
        ClaimOutcome::Existing(Existing {
            state: RecordState::InFlight { .. },
            ..
        })
    ));
    assert_eq!(
        first.complete(&key, a, &response("a")).await.expect("complete"),
        Write::Fenced
    );
    assert_eq!(
        first.complete(&key, b, &response("b")).await.expect("complete"),
        Write::Applied
    );
    assert_eq!(state_of(&first, &key).await, RecordState::Completed(response("b")));
}

#[tokio::test]
async fn scripts_survive_a_script_flush_and_a_restart() {
    let mut server = RedisServer::start();
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2)).expect("store");
    let key = key("flush");
    let owner = new_owner();
    store.claim(&claim(&key, owner, LONG)).await.expect("claim");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.connection())
        .expect("SCRIPT FLUSH");
    assert_eq!(
        store.complete(&key, owner, &response("x")).await.expect("complete"),
        Write::Applied
    );

    server.restart();
    // The store reconnects by itself; the fresh server has neither scripts nor records.
    let started = tokio::time::Instant::now();
    let outcome = loop {
        match store.claim(&claim(&key, owner, LONG)).await {
            Ok(outcome) => break outcome,
            Err(error) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "never reconnected: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(outcome, ClaimOutcome::Acquired(()));
}

/// One scope's share of the memory store: past `max_records_per_scope` live records its
/// claims are refused with the time until its oldest record expires, other scopes and
/// unscoped claims are not, and the share comes back as the scope's records expire, are
/// released or purged (the counts return to zero).
/// One client address's scoped records, across every scope it sends, are bounded by
/// `max_records_per_client`: a client that makes up a new scope for each key (a
/// header value it picks) is refused once it holds its share, until its oldest
/// expires; other addresses, and unscoped records, are not counted against it.
#[tokio::test(start_paused = true)]
async fn a_client_address_past_its_share_of_scopes_is_refused_until_its_records_go() {
    let store = MemoryStore::with_limits(StoreLimits {
        max_records: 100,
        max_bytes: usize::MAX,
        max_records_per_scope: 100,
        max_bytes_per_scope: usize::MAX,
        max_records_per_client: 3,
    });
    let from = |name: &str, scope: u64, client: u64| ClaimRequest {
        scope: Some(ScopeId(scope)),
        client: Some(ClientId(client)),
        ..claim(&key(name), new_owner(), Duration::from_secs(2))
    };
    store.claim(&from("c1-a", 1, 1)).await.expect("claim");
    tokio::time::sleep(Duration::from_secs(10)).await;
    for (n, scope) in [(2, 2), (3, 3)] {
        store.claim(&from(&format!("c1-{n}"), scope, 1)).await.expect("claim");
    }
    match store.claim(&from("c1-d", 4, 1)).await {
        Err(StoreError::ClientFull { retry_after }) => {
            assert!(
                retry_after > Duration::from_secs(40) && retry_after <= Duration::from_secs(50),
                "{retry_after:?}"
            )
        }
        other => panic!("a fourth scope from one address was taken: {other:?}"),
    }
    // Another address is not counted; an unscoped record from the same one is
    // (issue 49 M5), and refused alike.
    store.claim(&from("c2-a", 5, 2)).await.expect("another address");
    let unscoped = ClaimRequest {
        client: Some(ClientId(1)),
        ..claim(&key("c1-unscoped"), new_owner(), Duration::from_secs(2))
    };
    assert!(matches!(
        store.claim(&unscoped).await,
        Err(StoreError::ClientFull { .. })
    ));
    // Once the oldest expires, the address has room again.
    tokio::time::sleep(Duration::from_secs(51)).await;
    store.claim(&from("c1-d", 4, 1)).await.expect("room again");
    assert!(matches!(
        store.claim(&from("c1-e", 6, 1)).await,
        Err(StoreError::ClientFull { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_scope_past_its_share_of_the_memory_store_is_refused_until_its_records_go() {
    let store = MemoryStore::with_limits(StoreLimits {
        max_records: 100,
        max_bytes: usize::MAX,
        max_records_per_scope: 2,
        max_bytes_per_scope: usize::MAX,
        max_records_per_client: 100,
    });
    let scoped = |name: &str, scope: u64| ClaimRequest {
        scope: Some(ScopeId(scope)),
        ..claim(&key(name), new_owner(), Duration::from_secs(2))
    };
    let first = scoped("s1-a", 1);
    store.claim(&first).await.expect("claim");
    tokio::time::sleep(Duration::from_secs(10)).await;
    store.claim(&scoped("s1-b", 1)).await.expect("claim");
    match store.claim(&scoped("s1-c", 1)).await {
        Err(StoreError::ScopeFull {
            what: Held::Records,
            retry_after,
        }) => {
            assert_eq!(retry_after, Duration::from_secs(50), "until s1-a expires")
        }
        other => panic!("a third record of scope 1: {other:?}"),
    }
    store.claim(&scoped("s2-a", 2)).await.expect("another scope");
    store
        .claim(&claim(&key("unscoped-a"), new_owner(), Duration::from_secs(2)))
        .await
        .expect("unscoped");
    store
        .claim(&claim(&key("unscoped-b"), new_owner(), Duration::from_secs(2)))
        .await
        .expect("unscoped");
    store
        .claim(&claim(&key("unscoped-c"), new_owner(), Duration::from_secs(2)))
        .await
        .expect("unscoped");
    // A release gives its place back at once.
    assert_eq!(
        store.release(&first.key, first.owner).await.expect("release"),
        Write::Applied
    );
    store.claim(&scoped("s1-c", 1)).await.expect("s1-a's place");
    assert!(store.claim(&scoped("s1-d", 1)).await.is_err());
    // Expiry gives them back too, without waiting for the sweeper.
    tokio::time::sleep(Duration::from_secs(60)).await;
    store.claim(&scoped("s1-d", 1)).await.expect("after the retention");
    assert!(store.purge(&key("s1-d")).await.expect("purge"));
    tokio::time::sleep(Duration::from_secs(60)).await;
    store.claim(&scoped("s1-e", 1)).await.expect("claim");
    store.purge(&key("s1-e")).await.expect("purge");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        (store.usage().records, store.usage().bytes),
        (0, 0),
        "every count back to zero"
    );
}

/// The exclusivity check catches a `begin_probe` that hands out the lease without
/// looking at when the next probe is due.
#[tokio::test]
async fn a_begin_probe_without_its_due_check_is_caught() {
    let server = RedisServer::start();
    let lua = include_str!("../src/store/scripts/begin_probe.lua");
    let broken = lua.replace("if pttl > due then", "if false then");
    assert_ne!(broken, lua, "the planted bug must change the script");
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2))
        .expect("store")
        .with_script(idemproxy::store::redis::ScriptName::BeginProbe, &broken);
    assert!(
        !probe_lease_is_exclusive(&store).await,
        "a probe leased twice at once went unnoticed"
    );
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2)).expect("store");
    assert!(probe_lease_is_exclusive(&store).await);
}

/// The store suite catches a `begin_probe` that leases an overdue probe from its old
/// due time instead of from now (so the new due time is still in the past).
#[tokio::test]
async fn a_begin_probe_that_leases_from_the_old_due_time_is_caught() {
    let server = RedisServer::start();
    let lua = include_str!("../src/store/scripts/begin_probe.lua");
    let fixed = "reason .. ':' .. math.max(pttl - lease, 0) .. ':' .. give_up .. keep, 'KEEPTTL')";
    let broken = lua.replace(
        fixed,
        "reason .. ':' .. math.max((due or pttl) - lease, 0) .. ':' .. give_up .. keep, 'KEEPTTL')",
    );
    assert_ne!(broken, lua, "the planted bug must change the script");
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2))
        .expect("store")
        .with_script(idemproxy::store::redis::ScriptName::BeginProbe, &broken);
    assert!(
        !an_overdue_probe_lease_starts_now(&store).await,
        "an overdue probe leased twice at once went unnoticed"
    );
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2)).expect("store");
    assert!(an_overdue_probe_lease_starts_now(&store).await);
}

/// Every completion on Postgres is a heap-only (HOT) update: no index of the records
/// table names a column a completion writes (schema version 3), and each page keeps
/// room for a row's second version. Counted by the server's own table statistics.
#[tokio::test]
async fn postgres_completions_update_no_index() {
    let server = PostgresServer::start();
    let store = postgres_store(&server).await;
    let completions = 50;
    for n in 0..completions {
        let (record, owner) = (key(&format!("hot-{n}")), new_owner());
        let outcome = store
            .claim(&claim(&record, owner, Duration::from_secs(30)))
            .await
            .expect("claim");
        assert!(matches!(outcome, ClaimOutcome::Acquired(())), "{outcome:?}");
        let written = store.complete(&record, owner, &response("{}")).await.expect("complete");
        assert_eq!(written, Write::Applied);
    }
    // A backend sends its table counts to the statistics when it exits (or after ten
    // idle seconds): the store's connections are closed.
    drop(store);
    let counts = "SELECT n_tup_upd || ' ' || n_tup_hot_upd FROM pg_stat_user_tables \
                  WHERE schemaname = 'idemproxy' AND relname = 'records'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (updates, heap_only) = loop {
        let read = server.psql(counts);
        let (updates, heap_only) = read.split_once(' ').expect("two counts");
        let (updates, heap_only): (u64, u64) = (updates.parse().expect("n"), heap_only.parse().expect("n"));
        if updates >= completions || tokio::time::Instant::now() >= deadline {
            break (updates, heap_only);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (updates, heap_only),
        (completions, completions),
        "every completion heap-only"
    );
}

/// A claim whose key another transaction inserts while the claim's statement runs. The
/// claim waits on that insert; when it commits, the claim finds the row live, leaves it,
/// and reads it as the record found (the plain claim statement runs again for that,
/// `codes::claim::RACED`): the other claim's record, never taken over, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_claim_racing_another_claim_of_its_key_finds_that_record() {
    use std::io::{BufRead, Write};
    let server = PostgresServer::start();
    let store = postgres_store(&server).await;
    let raced = key("raced");
    let mut other = server.hold(&format!(
        "BEGIN;\nINSERT INTO idemproxy.records (key, fingerprint, state, owner, expires_at, lease_until) \
         VALUES ('{}', '\\x{}', 'in_flight', '\\x{}', now() + interval '1 minute', now() + interval '1 minute');\n\
         SELECT 'inserted';\n",
        raced.as_str(),
        "02".repeat(32),
        "07".repeat(16),
    ));
    let mut said = std::io::BufReader::new(other.stdout.take().expect("psql's stdout"));
    let mut line = String::new();
    said.read_line(&mut line).expect("psql says it inserted");
    assert_eq!(line.trim(), "inserted");
    let claiming = {
        let (store, raced) = (store.clone(), raced.clone());
        tokio::spawn(async move { store.claim(&claim(&raced, new_owner(), Duration::from_secs(30))).await })
    };
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%take_claim(%'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while server.psql(waiting) != "1" {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim never waited on the other insert"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stdin = other.stdin.as_mut().expect("psql's stdin");
    stdin.write_all(b"COMMIT;\nSELECT 'committed';\n").expect("commit");
    stdin.flush().expect("commit");
    line.clear();
    said.read_line(&mut line).expect("psql says it committed");
    assert_eq!(line.trim(), "committed");
    let outcome = claiming.await.expect("the claim's task").expect("the claim");
    match outcome {
        ClaimOutcome::Existing(existing) => {
            assert_eq!(existing.fingerprint, Fingerprint([2; 32]), "the other claim's record");
            assert!(
                matches!(existing.state, RecordState::InFlight { .. }),
                "{:?}",
                existing.state
            );
        }
        other => panic!("the claim took the key another claim holds: {other:?}"),
    }
    let _ = other.kill();
    let _ = other.wait();
}

/// A replay's claim statement on Postgres reads and inserts nothing: the plain claim
/// calls `take_claim` (the insert) only where the key holds no live record. Checked by
/// a trap: `take_claim` replaced by one that raises. Replays of a recorded key, an
/// in-flight key and its owner's own claim still answer; a fresh key meets the trap.
#[tokio::test]
async fn a_postgres_replay_never_calls_the_claims_insert() {
    let server = PostgresServer::start();
    let store = postgres_store(&server).await;
    let (recorded, held, owner) = (key("recorded"), key("held"), new_owner());
    for record in [&recorded, &held] {
        let outcome = store
            .claim(&claim(record, owner, Duration::from_secs(30)))
            .await
            .expect("claim");
        assert!(matches!(outcome, ClaimOutcome::Acquired(())), "{outcome:?}");
    }
    let written = store
        .complete(&recorded, owner, &response("{}"))
        .await
        .expect("complete");
    assert_eq!(written, Write::Applied);
    server.psql(
        "CREATE OR REPLACE FUNCTION idemproxy.take_claim(p_key text, p_owner bytea, p_fingerprint bytea, \
         p_retention_ms bigint, p_remember_ms bigint, p_lease_ms bigint) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'take_claim was called'; END $$",
    );
    for _ in 0..20 {
        match store
            .claim(&claim(&recorded, new_owner(), Duration::from_secs(30)))
            .await
        {
            Ok(ClaimOutcome::Existing(existing)) => {
                assert!(
                    matches!(existing.state, RecordState::Completed(_)),
                    "{:?}",
                    existing.state
                );
            }
            other => panic!("a replay's claim called the insert, or failed: {other:?}"),
        }
        match store.claim(&claim(&held, new_owner(), Duration::from_secs(30))).await {
            Ok(ClaimOutcome::Existing(existing)) => {
                assert!(
                    matches!(existing.state, RecordState::InFlight { .. }),
                    "{:?}",
                    existing.state
                );
            }
            other => panic!("a claim of an in-flight key called the insert, or failed: {other:?}"),
        }
        let own = store.claim(&claim(&held, owner, Duration::from_secs(30))).await;
        assert!(matches!(own, Ok(ClaimOutcome::Acquired(()))), "{own:?}");
    }
    let fresh = store
        .claim(&claim(&key("fresh"), new_owner(), Duration::from_secs(30)))
        .await;
    assert!(
        fresh.is_err(),
        "a fresh key's claim did not reach the trapped insert: {fresh:?}"
    );
}

/// The same two planted bugs in the Postgres store's `begin_probe` function, applied to
/// the test's server over the right one: each is caught, and the right one passes.
#[tokio::test]
async fn postgres_begin_probe_bugs_are_caught() {
    let server = PostgresServer::start();
    let store = postgres_store(&server).await;
    let ddl = idemproxy::store::postgres::schema::ddl("idemproxy");
    let no_due_check = ddl.replace("IF r.probe_due > now_ THEN", "IF false THEN");
    let old_due = ddl.replace(
        "UPDATE {schema}.records SET probe_due = now_ + p_lease_ms * interval '1 ms' WHERE key = p_key;"
            .replace("{schema}", "idemproxy")
            .as_str(),
        "UPDATE idemproxy.records SET probe_due = r.probe_due + p_lease_ms * interval '1 ms' WHERE key = p_key;",
    );
    assert!(
        no_due_check != ddl && old_due != ddl,
        "the planted bugs must change the functions"
    );
    server.psql(&no_due_check);
    assert!(
        !probe_lease_is_exclusive(&store).await,
        "a probe leased twice at once went unnoticed"
    );
    server.psql(&old_due);
    assert!(
        !an_overdue_probe_lease_starts_now(&store).await,
        "an overdue probe leased twice at once went unnoticed"
    );
    server.psql(&ddl);
    assert!(probe_lease_is_exclusive(&store).await);
    assert!(an_overdue_probe_lease_starts_now(&store).await);
}

/// An unknown record written before unknown records kept their owner
/// (`2U<fingerprint><reason>`) has no claim to fence a resolution on: a probe leaves it
/// alone (for an operator), never leases it with its reason read as an owner.
#[tokio::test]
async fn an_unknown_record_written_before_owners_were_kept_is_not_probed() {
    let server = RedisServer::start();
    let store = RedisStore::standalone(&server.url(), Duration::from_secs(2)).expect("store");
    let record = key("old-format-unknown");
    let value = format!("2U{}upstream-timeout", Fingerprint([7; 32]).to_hex());
    let _: () = redis::cmd("SET")
        .arg(record.as_str())
        .arg(&value)
        .arg("PX")
        .arg(60_000)
        .query(&mut server.connection())
        .expect("SET");
    assert_eq!(
        store.begin_probe(&record, schedule(LONG), LONG).await.expect("begin"),
        ProbeStart::Settled
    );
    assert_eq!(
        state_of(&store, &record).await,
        RecordState::Unknown {
            reason: UnknownReason::UpstreamTimeout,
            probe: Probe::Unscheduled
        }
    );
}

/// The memory store's probe lease holds against a paused clock too: the lease and
/// the schedule are read off the same clock as the record's expiry.
#[tokio::test(start_paused = true)]
async fn the_memory_store_keeps_the_probe_schedule_on_its_clock() {
    let store = MemoryStore::new(10, usize::MAX);
    let record = key("probe-clock");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    let schedule = ProbeSchedule {
        first_after: Duration::from_secs(1),
        give_up_after: Duration::from_secs(10),
    };
    store
        .mark_unknown(&record, owner, UnknownReason::UpstreamTimeout, Some(schedule))
        .await
        .expect("mark");
    assert_eq!(
        store
            .begin_probe(&record, schedule, Duration::from_secs(2))
            .await
            .expect("begin"),
        ProbeStart::NotDue(Duration::from_secs(1))
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        store
            .begin_probe(&record, schedule, Duration::from_secs(2))
            .await
            .expect("begin"),
        ProbeStart::Leased(owner)
    );
    // Deferred every 4 s: probes at 1 s, 5 s and 9 s; the one after would be at 13 s,
    // past give_up_after.
    for _ in 0..2 {
        assert_eq!(
            store
                .defer_probe(&record, owner, Duration::from_secs(4))
                .await
                .expect("defer"),
            Deferred::Scheduled
        );
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(
            store
                .begin_probe(&record, schedule, Duration::from_secs(2))
                .await
                .expect("begin"),
            ProbeStart::Leased(owner)
        );
    }
    assert_eq!(
        store
            .defer_probe(&record, owner, Duration::from_secs(4))
            .await
            .expect("defer"),
        Deferred::GaveUp
    );
}

/// `min_replica_acks` reads `WAIT`'s own reply: a primary with no replica acknowledges
/// none (the claim is refused as not replicated, with 0 of 1); with one replica in
/// sync, a claim that wants one is acquired, and one that wants two is refused with
/// the one that came.
#[tokio::test]
async fn a_claim_counts_the_replicas_that_wait_reports() {
    let primary = RedisServer::start();
    let store = |acks: u32| {
        let config = RedisConfig {
            topology: RedisTopology::Standalone { url: primary.url() },
            min_replica_acks: acks,
            replica_ack_timeout: Duration::from_millis(200),
            tls: None,
            connections: 1,
        };
        RedisStore::new(&config, Duration::from_secs(2)).expect("store")
    };
    match store(1).claim(&claim(&key("wait-0"), new_owner(), LONG)).await {
        Err(StoreError::NotReplicated { acks: 0, wanted: 1 }) => {}
        other => panic!("no replica, yet {other:?}"),
    }
    let _replica = RedisServer::start_with_args(
        false,
        vec!["--replicaof".into(), "127.0.0.1".into(), primary.port.to_string()],
    );
    let client = redis::Client::open(primary.url()).expect("a client");
    let mut connection = client.get_connection().expect("connect");
    let started = tokio::time::Instant::now();
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut connection)
            .expect("INFO");
        if info.contains("state=online") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the replica never came online: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(matches!(
        store(1).claim(&claim(&key("wait-1"), new_owner(), LONG)).await,
        Ok(ClaimOutcome::Acquired(()))
    ));
    match store(2).claim(&claim(&key("wait-2"), new_owner(), LONG)).await {
        Err(StoreError::NotReplicated { acks: 1, wanted: 2 }) => {}
        other => panic!("one replica, yet {other:?}"),
    }
}

// === sqlite only ===

fn sha256_of(path: &std::path::Path) -> Vec<u8> {
    let bytes = std::fs::read(path).expect("read the file");
    ring::digest::digest(&ring::digest::SHA256, &bytes).as_ref().to_vec()
}

fn sqlite_config(path: &std::path::Path, limits: StoreLimits) -> SqliteConfig {
    SqliteConfig {
        path: path.to_path_buf(),
        limits,
        cache_bytes: 4 << 20,
        response_budget: usize::MAX,
    }
}

/// Closed and opened again (what a restart does to the file), the store holds what it
/// held: a completed record replays byte for byte with its fingerprint, an unknown one
/// stays unknown with its schedule, one in flight reads as in flight until its lease
/// (counted on the wall clock) is over and is never free, and the retention runs on.
/// Replays are answered from memory once read (replays.rs): a purge, an expiry, and the
/// file's own state still decide. A response kept past its purge or its expiry would
/// replay a record that is gone.
#[tokio::test]
async fn a_sqlite_store_replays_from_memory_only_what_the_file_still_holds() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = sqlite_store(&dir.path().join("records.db"), StoreLimits::unbounded(100));
    let record = key("remembered");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    assert_eq!(
        store
            .complete(&record, owner, &response("first"))
            .await
            .expect("complete"),
        Write::Applied
    );
    // Read twice: the second is answered from memory.
    for _ in 0..2 {
        assert_eq!(
            state_of(&store, &record).await,
            RecordState::Completed(response("first"))
        );
    }
    assert!(store.purge(&record).await.expect("purge"));
    let again = new_owner();
    assert!(
        matches!(
            store.claim(&claim(&record, again, LONG)).await.expect("claim"),
            ClaimOutcome::Acquired(())
        ),
        "a purged record is free, not replayed from memory"
    );
    assert_eq!(
        store
            .complete(&record, again, &response("second"))
            .await
            .expect("complete"),
        Write::Applied
    );
    assert_eq!(
        state_of(&store, &record).await,
        RecordState::Completed(response("second"))
    );
    assert_eq!(
        state_of(&store, &record).await,
        RecordState::Completed(response("second"))
    );
    // Past its retention (the store's clock moved on), it is free again.
    store.advance_clock(Duration::from_secs(61));
    assert!(
        matches!(
            store.claim(&claim(&record, new_owner(), LONG)).await.expect("claim"),
            ClaimOutcome::Acquired(())
        ),
        "an expired record is free, not replayed from memory"
    );
}

/// A replay read from the file just before a purge commits must not be kept in memory
/// after it (replays.rs, the purge epoch): the read may answer its own claim (it came
/// first), but the next retry finds the key free. The claim is stopped between its
/// read and its keep by a test seam, and the purge runs in between.
#[tokio::test]
async fn a_replay_read_before_a_purge_is_not_kept_after_it() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = sqlite_store(&dir.path().join("records.db"), StoreLimits::unbounded(100));
    let record = key("purged-mid-read");
    let owner = new_owner();
    store.claim(&claim(&record, owner, LONG)).await.expect("claim");
    assert_eq!(
        store
            .complete(&record, owner, &response("old"))
            .await
            .expect("complete"),
        Write::Applied
    );
    let pause = ReadPause::default();
    let racing = tokio::spawn({
        let (paused, record) = (store.clone().with_read_pause(pause.clone()), record.clone());
        async move { paused.claim(&claim(&record, new_owner(), LONG)).await }
    });
    pause.reached.notified().await;
    assert!(store.purge(&record).await.expect("purge"));
    pause.resume.notify_one();
    assert_eq!(
        racing.await.expect("join").expect("claim"),
        ClaimOutcome::Existing(Existing {
            fingerprint: Fingerprint([1; 32]),
            state: RecordState::Completed(response("old")),
        }),
        "the read that came before the purge answers its own claim"
    );
    assert_eq!(
        store.claim(&claim(&record, new_owner(), LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(()),
        "a purged record is free, not replayed from what a read kept after the purge"
    );
}

/// The store's writer leaves the file's `CHECK` on the record's state unchecked (it
/// writes only the three states, each a literal in its statements: about 9% of its
/// time went to building a table of them on every write); the check still holds every
/// other connection to the file.
#[tokio::test]
async fn a_sqlite_files_state_check_still_holds_every_other_connection() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    let (done, held) = (key("checked-done"), key("checked-held"));
    completed(&store, &done, "kept").await;
    store.claim(&claim(&held, new_owner(), LONG)).await.expect("claim");

    let other = rusqlite::Connection::open(&path).expect("open the file beside the store");
    other.busy_timeout(Duration::from_secs(5)).expect("busy timeout");
    for state in ["done", "", "Completed"] {
        match other.execute("UPDATE records SET state = ?1", [state]) {
            Err(error) => assert!(
                error.to_string().contains("CHECK constraint failed"),
                "{state}: {error}"
            ),
            Ok(rows) => panic!("{rows} rows took the state {state:?}"),
        }
    }
    drop(other);
    assert_eq!(state_of(&store, &done).await, RecordState::Completed(response("kept")));
    assert!(matches!(state_of(&store, &held).await, RecordState::InFlight { .. }));
}

#[tokio::test]
async fn a_sqlite_store_keeps_its_records_when_it_is_reopened() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    let (done, held, unknown) = (key("reopen-done"), key("reopen-held"), key("reopen-unknown"));
    completed(&store, &done, "kept").await;
    let held_owner = new_owner();
    store
        .claim(&claim(&held, held_owner, Duration::from_millis(400)))
        .await
        .expect("claim");
    let unknown_owner = new_owner();
    store.claim(&claim(&unknown, unknown_owner, LONG)).await.expect("claim");
    let marked = store
        .mark_unknown(
            &unknown,
            unknown_owner,
            UnknownReason::UpstreamTimeout,
            Some(schedule(Duration::from_secs(60))),
        )
        .await
        .expect("mark");
    assert_eq!(marked, Write::Applied);
    let ttl_before = store.inspect(&done).await.expect("inspect").expect("held").ttl;
    drop(store);

    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    assert_eq!(state_of(&store, &done).await, RecordState::Completed(response("kept")));
    match store.claim(&claim(&done, new_owner(), LONG)).await.expect("claim") {
        ClaimOutcome::Existing(existing) => assert_eq!(existing.fingerprint, Fingerprint([1; 32])),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        state_of(&store, &unknown).await,
        RecordState::Unknown {
            reason: UnknownReason::UpstreamTimeout,
            probe: Probe::Next(_)
        }
    ));
    let listed = store.unsettled().expect("unsettled");
    let mut names: Vec<&StoreKey> = listed.iter().map(|record| &record.key).collect();
    names.sort();
    let mut expected = vec![&held, &unknown];
    expected.sort();
    assert_eq!(names, expected, "the records left unsettled, and only those");
    until_lease_expires(&store, &held).await;
    assert_eq!(
        store
            .complete(&held, held_owner, &response("late"))
            .await
            .expect("complete"),
        Write::Fenced,
        "the dead owner's late answer is fenced"
    );
    let ttl_after = store.inspect(&done).await.expect("inspect").expect("held").ttl;
    assert!(
        ttl_after < ttl_before,
        "{ttl_after:?} after {ttl_before:?}: the retention ran on"
    );
}

/// Issue 49 M5: on a route without scope, one client address filled the store for
/// everyone (only scoped records were counted per address). Each embedded store counts
/// every record an address makes: past `max_records_per_client` its new keys are
/// refused with the time until its first record expires, while another address is
/// still admitted; and a full store says when space is due, not 1 s.
async fn one_address_cannot_fill_an_embedded_store<S: RecordStore>(store: &S, advance: impl AsyncFn(Duration)) {
    let from = |name: &str, client: u64| ClaimRequest {
        client: Some(ClientId(client)),
        ..claim(&key(name), new_owner(), Duration::from_secs(2))
    };
    store.claim(&from("a-0", 1)).await.expect("claim");
    advance(Duration::from_secs(10)).await;
    for n in 1..3 {
        store.claim(&from(&format!("a-{n}"), 1)).await.expect("claim");
    }
    match store.claim(&from("a-3", 1)).await {
        Err(StoreError::ClientFull { retry_after }) => assert!(
            retry_after > Duration::from_secs(45) && retry_after <= Duration::from_secs(50),
            "until a-0 expires: {retry_after:?}"
        ),
        other => panic!("a fourth record from one address: {other:?}"),
    }
    for n in 0..3 {
        store.claim(&from(&format!("b-{n}"), 2)).await.expect("another address");
    }
    // Six records: the store (max 6) is full for a third address, until a-0 expires.
    match store.claim(&from("c-0", 3)).await {
        Err(StoreError::Full { retry_after, .. }) => assert!(
            retry_after > Duration::from_secs(45) && retry_after <= Duration::from_secs(50),
            "until a-0 expires: {retry_after:?}"
        ),
        other => panic!("a seventh record: {other:?}"),
    }
}

const ONE_ADDRESS: StoreLimits = StoreLimits {
    max_records: 6,
    max_bytes: usize::MAX,
    max_records_per_scope: 6,
    max_bytes_per_scope: usize::MAX,
    max_records_per_client: 3,
};

#[tokio::test(start_paused = true)]
async fn one_address_cannot_fill_the_memory_store() {
    let store = MemoryStore::with_limits(ONE_ADDRESS);
    one_address_cannot_fill_an_embedded_store(&store, async |by| tokio::time::advance(by).await).await;
}

#[tokio::test]
async fn one_address_cannot_fill_the_sqlite_store() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = sqlite_store(&dir.path().join("records.db"), ONE_ADDRESS);
    one_address_cannot_fill_an_embedded_store(&store, async |by| store.advance_clock(by)).await;
    drop(store);
}

/// One process per file: a second store on it is refused while the first is open,
/// naming the file and the holder's pid; once the first is closed, it opens.
#[tokio::test]
async fn a_second_store_on_one_file_is_refused_naming_its_holder() {
    use idemproxy::error::StoreFileError;
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let first = sqlite_store(&path, StoreLimits::unbounded(10));
    match SqliteStore::open(&sqlite_config(&path, StoreLimits::unbounded(10)), LONG) {
        Err(StoreError::File(error @ StoreFileError::InUse { .. })) => {
            let message = error.to_string();
            assert!(message.contains(&path.display().to_string()), "{message}");
            assert!(message.contains(&format!("pid {}", std::process::id())), "{message}");
        }
        other => panic!("a second store opened the file: {:?}", other.map(|_| ())),
    }
    drop(first);
    sqlite_store(&path, StoreLimits::unbounded(10));
}

/// Issue 49 L6: one process per file however the file is named. A hard link to a
/// store another store holds is refused naming the holder; a symbolic link to it is
/// refused as a link.
#[tokio::test]
async fn a_store_reached_through_a_link_is_refused_while_another_holds_it() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let first = sqlite_store(&path, StoreLimits::unbounded(10));
    let hard = dir.path().join("hard.db");
    std::fs::hard_link(&path, &hard).expect("hard link");
    let message = refusal(&hard);
    assert!(
        message.contains("in use by another idemproxy") && message.contains(&format!("pid {}", std::process::id())),
        "{message}"
    );
    let soft = dir.path().join("soft.db");
    std::os::unix::fs::symlink(&path, &soft).expect("symlink");
    assert!(refusal(&soft).contains("symbolic link"), "{}", refusal(&soft));
    drop(first);
}

/// What opening a SQLite store on `path` is refused with.
fn refusal(path: &std::path::Path) -> String {
    match SqliteStore::open(&sqlite_config(path, StoreLimits::unbounded(10)), LONG) {
        Err(error) => error.to_string(),
        Ok(_) => panic!("{} opened", path.display()),
    }
}

fn mode(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::symlink_metadata(path).expect("metadata").permissions().mode() & 0o7777
}

/// A companion file (`-wal`, `-shm`, `.lock`) whose metadata cannot be read is refused
/// by name before anything is opened, never taken for absent: a database named with
/// 252 bytes opens, but its `-wal` is a name too long for the file system, which
/// SQLite would only trip on later (cargo-mutants: the `NotFound` guard in `lock`).
#[test]
fn a_companion_file_that_cannot_be_read_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join(format!("{}.db", "r".repeat(249)));
    let message = refusal(&path);
    assert!(
        message.contains(&format!("{}-wal: cannot read its metadata", path.display())),
        "{message}"
    );
    assert!(!path.exists(), "nothing made before the companions were read");
}

/// Issue 49 M1 to M3: the store refuses what other local users may write, and creates
/// its files for its owner only. A directory others can write is refused (so nobody
/// can plant a link there); a lock file or database that is a symbolic link is refused
/// and its target left untouched (today's code truncated the target and wrote its pid
/// in it); a database that group or others can write, or that another user owns, is
/// refused; every file the store makes is 0600 whatever the umask, and one an older
/// release left 0644 is made 0600.
#[tokio::test]
async fn the_sqlite_store_refuses_what_others_may_write_and_keeps_its_files_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let chmod = |path: &std::path::Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    let root = tempfile::tempdir().expect("temporary directory");

    // A directory others (or its group) can write, sticky or not.
    for open_mode in [0o777, 0o1777, 0o770] {
        let dir = root.path().join(format!("open-{open_mode:o}"));
        std::fs::create_dir(&dir).expect("mkdir");
        chmod(&dir, open_mode);
        let message = refusal(&dir.join("records.db"));
        assert!(message.contains("is writable by"), "{open_mode:o}: {message}");
        assert!(!dir.join("records.db").exists(), "nothing made there");
    }

    let dir = root.path().join("store");
    std::fs::create_dir(&dir).expect("mkdir");
    chmod(&dir, 0o755);
    let path = dir.join("records.db");

    // A lock file planted as a link to a file of the proxy user's.
    let victim = root.path().join("important.conf");
    std::fs::write(&victim, "keep me\n".repeat(2000)).expect("write");
    std::os::unix::fs::symlink(&victim, dir.join("records.db.lock")).expect("symlink");
    let message = refusal(&path);
    assert!(
        message.contains("records.db.lock") && message.contains("symbolic link"),
        "{message}"
    );
    assert_eq!(
        std::fs::read_to_string(&victim).expect("read"),
        "keep me\n".repeat(2000)
    );
    std::fs::remove_file(dir.join("records.db.lock")).expect("rm");

    // A dangling link where the database goes: nothing is made where it points.
    let elsewhere = root.path().join("elsewhere.db");
    std::os::unix::fs::symlink(&elsewhere, &path).expect("symlink");
    assert!(refusal(&path).contains("symbolic link"), "{}", refusal(&path));
    assert!(!elsewhere.exists(), "created through the link");
    std::fs::remove_file(&path).expect("rm");

    // An empty database that group or others can write (another user made it 0666).
    std::fs::write(&path, b"").expect("touch");
    chmod(&path, 0o666);
    let message = refusal(&path);
    assert!(message.contains("writable by group and others"), "{message}");
    std::fs::remove_file(&path).expect("rm");

    // A database another user owns (only root can make one here).
    if rustix::process::geteuid().is_root() {
        std::fs::write(&path, b"").expect("touch");
        chmod(&path, 0o600);
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).expect("chown");
        let message = refusal(&path);
        assert!(message.contains("owned by uid 65534"), "{message}");
        std::fs::remove_file(&path).expect("rm");
    }

    // Made by the store: every file 0600, though the umask lets others read.
    let store = sqlite_store(&path, StoreLimits::unbounded(10));
    let owner = new_owner();
    store.claim(&claim(&key("private"), owner, LONG)).await.expect("claim");
    for name in ["records.db", "records.db-wal", "records.db-shm", "records.db.lock"] {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }
    drop(store);

    // Left 0644 by an older release: made 0600 once found to be the store's own.
    chmod(&path, 0o644);
    chmod(&dir.join("records.db.lock"), 0o644);
    drop(sqlite_store(&path, StoreLimits::unbounded(10)));
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&dir.join("records.db.lock")), 0o600);
}

/// A file that is not this store's is refused with what is wrong with it, and left
/// byte for byte as it was: never replaced by an empty store.
#[tokio::test]
async fn a_file_that_is_not_this_stores_is_refused_and_left_as_it_is() {
    use idemproxy::error::StoreFileError;
    let dir = tempfile::tempdir().expect("temporary directory");
    let not_sqlite = dir.path().join("not-sqlite.db");
    std::fs::write(&not_sqlite, vec![0x5a; 8192]).expect("write");
    let foreign = dir.path().join("foreign.db");
    {
        let conn = rusqlite::Connection::open(&foreign).expect("open");
        conn.execute_batch(
            "CREATE TABLE invoices (id INTEGER PRIMARY KEY, total INTEGER); INSERT INTO invoices VALUES (1, 100);",
        )
        .expect("write");
    }
    let newer = dir.path().join("newer.db");
    {
        let conn =
            idemproxy::store::sqlite::create_at_version(&newer, idemproxy::store::sqlite::VERSION).expect("create");
        conn.pragma_update(None, "user_version", idemproxy::store::sqlite::VERSION + 1)
            .expect("version");
    }
    let corrupt = dir.path().join("corrupt.db");
    {
        let store = sqlite_store(&corrupt, StoreLimits::unbounded(1000));
        for n in 0..200 {
            let (record, owner) = (key(&format!("corrupt-{n}")), new_owner());
            store.claim(&claim(&record, owner, LONG)).await.expect("claim");
            let mut stored = response("x");
            stored.body = Bytes::from(vec![b'x'; 2048]);
            store.complete(&record, owner, &stored).await.expect("complete");
        }
    }
    {
        // Pages 3 to 10 overwritten: b-tree pages and overflow pages alike.
        let mut bytes = std::fs::read(&corrupt).expect("read");
        assert!(
            bytes.len() > 4096 * 12,
            "the file holds the records: {} bytes",
            bytes.len()
        );
        bytes[4096 * 2..4096 * 10].fill(0xa5);
        std::fs::write(&corrupt, bytes).expect("write");
    }
    for (path, what) in [
        (&not_sqlite, "not a SQLite database"),
        (&foreign, "another application's SQLite database (application_id 0x0"),
        (&newer, "written by a newer idemproxy"),
        (&corrupt, "is corrupt"),
    ] {
        let before = sha256_of(path);
        let refused = SqliteStore::open(&sqlite_config(path, StoreLimits::unbounded(10)), LONG);
        let message = match refused {
            Err(StoreError::File(error)) => error.to_string(),
            other => panic!("{}: opened: {:?}", path.display(), other.map(|_| ())),
        };
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(message.contains(what), "{what:?} not in {message}");
        assert!(message.contains("left as it is"), "{message}");
        assert_eq!(sha256_of(path), before, "{}: the file was changed", path.display());
    }
    let directory = dir.path().join("a-directory");
    std::fs::create_dir(&directory).expect("mkdir");
    assert!(matches!(
        SqliteStore::open(&sqlite_config(&directory, StoreLimits::unbounded(10)), LONG),
        Err(StoreError::File(StoreFileError::CannotOpen { .. }))
    ));
}

/// A file of an older schema is migrated forward in one transaction, and what it
/// holds is counted as if this version had written it (its scopes' shares included).
/// A migration that fails changes nothing: the file stays at its version.
#[tokio::test]
async fn an_older_file_is_migrated_forward_and_a_failed_migration_changes_nothing() {
    use idemproxy::store::sqlite::{VERSION, create_at_version};
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("v1.db");
    let old = key("from-v1");
    let stored = response("from v1");
    {
        let conn = create_at_version(&path, 1).expect("create");
        let expires_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as i64
            + 60_000;
        conn.execute(
            "INSERT INTO records (key, fingerprint, expires_at, scope, state, status, headers, body, size) \
             VALUES (?1, ?2, ?3, 7, 'completed', 201, ?4, ?5, 500)",
            rusqlite::params![
                old.as_str(),
                &[1u8; 32][..],
                expires_at,
                stored.encode_headers(),
                &stored.body[..]
            ],
        )
        .expect("a record as version 1 wrote it");
    }
    let limits = StoreLimits {
        max_records_per_scope: 1,
        ..StoreLimits::unbounded(100)
    };
    let store = sqlite_store(&path, limits);
    assert_eq!(state_of(&store, &old).await, RecordState::Completed(stored));
    let scoped = ClaimRequest {
        scope: Some(ScopeId(7)),
        ..claim(&key("same-scope"), new_owner(), LONG)
    };
    assert!(
        matches!(
            store.claim(&scoped).await,
            Err(StoreError::ScopeFull {
                what: Held::Records,
                ..
            })
        ),
        "the migrated record counts against its scope's share"
    );
    drop(store);
    let version = |path: &std::path::Path| -> i32 {
        let conn =
            rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open");
        conn.pragma_query_value(None, "user_version", |row| row.get(0))
            .expect("version")
    };
    assert_eq!(version(&path), VERSION);

    let failing = dir.path().join("v1-failing.db");
    {
        let conn = create_at_version(&failing, 1).expect("create");
        // The next step creates this table: it fails halfway through.
        conn.execute_batch("CREATE TABLE shares (x INTEGER)")
            .expect("a table in the way");
    }
    let before = sha256_of(&failing);
    match SqliteStore::open(&sqlite_config(&failing, StoreLimits::unbounded(10)), LONG) {
        Err(StoreError::File(error)) => {
            let message = error.to_string();
            assert!(
                message.contains(&format!(
                    "the migration from schema version 1 to {VERSION} failed, and nothing was changed"
                )),
                "{message}"
            );
        }
        other => panic!("opened: {:?}", other.map(|_| ())),
    }
    assert_eq!(version(&failing), 1);
    assert_eq!(sha256_of(&failing), before);
}

/// The per-scope and per-client shares and `max_records` hold as on the memory store,
/// counted in the file itself: they hold after the store is reopened, and give room
/// back as records expire (the store's clock moved on, not the test's).
#[tokio::test]
async fn a_sqlite_store_holds_its_shares_across_a_reopen_and_gives_room_back_as_records_expire() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let limits = StoreLimits {
        max_records: 6,
        max_records_per_scope: 2,
        max_records_per_client: 3,
        ..StoreLimits::unbounded(100)
    };
    let scoped = |name: &str, scope: u64, client: u64| ClaimRequest {
        scope: Some(ScopeId(scope)),
        client: Some(ClientId(client)),
        ..claim(&key(name), new_owner(), Duration::from_secs(2))
    };
    let store = sqlite_store(&path, limits);
    store.claim(&scoped("s1-a", 1, 1)).await.expect("claim");
    store.advance_clock(Duration::from_secs(10));
    store.claim(&scoped("s1-b", 1, 1)).await.expect("claim");
    match store.claim(&scoped("s1-c", 1, 2)).await {
        Err(StoreError::ScopeFull {
            what: Held::Records,
            retry_after,
        }) => assert!(
            retry_after > Duration::from_secs(49) && retry_after <= Duration::from_secs(50),
            "until s1-a expires: {retry_after:?}"
        ),
        other => panic!("a third record of scope 1: {other:?}"),
    }
    store.claim(&scoped("s2-a", 2, 1)).await.expect("another scope");
    match store.claim(&scoped("s3-a", 3, 1)).await {
        Err(StoreError::ClientFull { retry_after }) => {
            assert!(retry_after > Duration::from_secs(40), "{retry_after:?}")
        }
        other => panic!("a fourth scoped record from one address: {other:?}"),
    }
    drop(store);

    let store = sqlite_store(&path, limits);
    assert!(
        matches!(
            store.claim(&scoped("s1-c", 1, 2)).await,
            Err(StoreError::ScopeFull { .. })
        ),
        "the scope's share is counted in the file"
    );
    assert!(matches!(
        store.claim(&scoped("s3-a", 3, 1)).await,
        Err(StoreError::ClientFull { .. })
    ));
    for name in ["u-1", "u-2", "u-3"] {
        store
            .claim(&claim(&key(name), new_owner(), Duration::from_secs(2)))
            .await
            .expect("unscoped");
    }
    assert!(matches!(
        store.claim(&claim(&key("u-4"), new_owner(), LONG)).await,
        Err(StoreError::Full {
            what: Held::Records,
            limit: 6,
            ..
        })
    ));
    // Past every retention: the refused claims are taken, without waiting for a sweep.
    store.advance_clock(Duration::from_secs(120));
    store.claim(&scoped("s1-c", 1, 2)).await.expect("s1's room back");
    store
        .claim(&scoped("s3-a", 3, 1))
        .await
        .expect("the address's room back");
    store
        .claim(&claim(&key("u-4"), new_owner(), LONG))
        .await
        .expect("room back");
    for name in ["s1-c", "s3-a", "u-4"] {
        assert!(store.purge(&key(name)).await.expect("purge"));
    }
    // The sweeper deletes the rest; every count is back to zero.
    let started = tokio::time::Instant::now();
    while !store.is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} records never swept",
            store.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let usage = store.usage().expect("usage");
    assert_eq!(usage.records, 0);
}

/// `max_bytes` bounds the file: claims stop once seven eighths of it are in use, every
/// response of a claim taken before still records, and the pages of expired records
/// are reused: the file does not grow past the bound however often it fills.
#[tokio::test]
async fn a_sqlite_file_stays_within_max_bytes_and_reuses_the_space_of_expired_records() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let max_bytes = 2 << 20;
    let limits = StoreLimits {
        max_bytes,
        ..StoreLimits::unbounded(1_000_000)
    };
    let store = sqlite_store(&path, limits);
    let mut body = response("x");
    body.body = Bytes::from(vec![b'x'; 16 * 1024]);
    let mut rounds = Vec::new();
    for round in 0..3 {
        let mut taken = 0;
        loop {
            let (record, owner) = (key(&format!("bytes-{round}-{taken}")), new_owner());
            match store.claim(&claim(&record, owner, LONG)).await {
                Ok(ClaimOutcome::Acquired(())) => {}
                Err(StoreError::Full { what: Held::Bytes, .. }) => break,
                other => panic!("{other:?}"),
            }
            assert_eq!(
                store
                    .complete(&record, owner, &body)
                    .await
                    .expect("a taken claim records"),
                Write::Applied
            );
            taken += 1;
            assert!(taken < 1000, "the byte bound never refused a claim");
        }
        let usage = store.usage().expect("usage");
        assert!(
            usage.bytes <= max_bytes && usage.bytes >= max_bytes / 8 * 7 - 64 * 1024,
            "{} bytes in use against a bound of {max_bytes}",
            usage.bytes
        );
        rounds.push(taken);
        store.advance_clock(Duration::from_secs(120));
        let started = tokio::time::Instant::now();
        while !store.is_empty() {
            assert!(started.elapsed() < Duration::from_secs(10), "never swept");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(
        rounds.iter().all(|taken| *taken >= rounds[0] * 9 / 10),
        "each round takes as many records: {rounds:?}"
    );
    let file = std::fs::metadata(&path).expect("file").len();
    assert!(file <= max_bytes as u64, "the file grew to {file} bytes");
}

/// Group commit: a thousand claims asked for while the writer is busy go into one
/// commit together, not a thousand.
#[tokio::test]
async fn a_thousand_claims_at_once_share_one_commit() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = sqlite_store(&dir.path().join("records.db"), StoreLimits::unbounded(10_000));
    let stats = store.commit_figures().clone();
    let hold = store.hold_writer().await;
    let (commits, writes) = (stats.commits.get(), stats.writes.get());
    let asked = Arc::new(AtomicUsize::new(0));
    let claims: Vec<_> = (0..1000)
        .map(|n| {
            let (store, asked) = (store.clone(), asked.clone());
            tokio::spawn(async move {
                let request = claim(&key(&format!("group-{n}")), new_owner(), LONG);
                // Nothing awaits between this and the claim's send to the writer.
                asked.fetch_add(1, Ordering::SeqCst);
                store.claim(&request).await
            })
        })
        .collect();
    while asked.load(Ordering::SeqCst) < 1000 {
        tokio::task::yield_now().await;
    }
    drop(hold);
    for claim in claims {
        assert_eq!(claim.await.expect("task").expect("claim"), ClaimOutcome::Acquired(()));
    }
    assert_eq!(stats.writes.get() - writes, 1001, "the hold and the thousand claims");
    assert!(
        stats.commits.get() - commits <= 2,
        "{} commits for a thousand claims",
        stats.commits.get() - commits
    );
}

/// A full disk: a claim that cannot be written is refused (503 upstream of here) with
/// nothing written, recorded keys still replay, and once there is room again the store
/// takes writes by itself.
#[tokio::test]
async fn a_full_disk_refuses_claims_keeps_replays_and_recovers_by_itself() {
    let disk = support::disk::SmallDisk::mount(8 << 20);
    let store = sqlite_store(&disk.path().join("records.db"), StoreLimits::unbounded(100_000));
    let kept = key("disk-kept");
    completed(&store, &kept, "kept").await;
    disk.fill();
    let mut refused = None;
    for n in 0..10_000 {
        match store.claim(&claim(&key(&format!("disk-{n}")), new_owner(), LONG)).await {
            Ok(_) => {}
            Err(error) => {
                refused = Some(error);
                break;
            }
        }
    }
    match refused {
        Some(StoreError::Disk(failure)) => {
            assert!(!failure.may_have_written, "a full disk undoes the write: {failure}");
            assert!(failure.to_string().contains("full"), "{failure}");
        }
        other => panic!("a full disk took every claim: {other:?}"),
    }
    assert_eq!(state_of(&store, &kept).await, RecordState::Completed(response("kept")));
    assert!(store.ping().await.is_err(), "ready with a full disk");
    disk.free();
    store.ping().await.expect("ready again");
    store
        .claim(&claim(&key("disk-after"), new_owner(), LONG))
        .await
        .expect("a claim once there is room");
}

/// On Postgres a scope past `max_records_per_scope` is refused (429 `scope-full` at
/// the proxy) until a record of its own goes, while other scopes, unscoped claims and
/// the scope's own replays go on; a release, a purge and the sweeper give room back.
#[tokio::test]
async fn a_scope_past_its_share_of_the_postgres_store_is_refused_until_its_records_go() {
    let server = PostgresServer::start();
    let mut config = PostgresConfig::at(&server.url()).expect("the test server's URL");
    config.max_records_per_scope = 2;
    let store = PostgresStore::open(&config, Duration::from_secs(2))
        .await
        .expect("open the postgres store");
    let scoped = |name: &str, scope: u64| ClaimRequest {
        scope: Some(ScopeId(scope)),
        ..claim(&key(name), new_owner(), LONG)
    };
    let first = scoped("s1-a", 1);
    store.claim(&first).await.expect("claim");
    store.claim(&scoped("s1-b", 1)).await.expect("claim");
    match store.claim(&scoped("s1-c", 1)).await {
        Err(StoreError::ScopeFull { what, retry_after }) => {
            assert_eq!(what, Held::Records);
            assert!(
                retry_after > Duration::from_secs(50),
                "until s1-a expires: {retry_after:?}"
            );
        }
        other => panic!("a third record of scope 1: {other:?}"),
    }
    // The scope's own records still answer; other scopes and unscoped claims go on.
    assert!(matches!(
        store.claim(&scoped("s1-a", 1)).await.expect("claim"),
        ClaimOutcome::Existing(_)
    ));
    store.claim(&scoped("s2-a", 2)).await.expect("another scope");
    store
        .claim(&claim(&key("unscoped"), new_owner(), LONG))
        .await
        .expect("unscoped");
    // A release gives its place back at once; so does a purge.
    assert_eq!(
        store.release(&first.key, first.owner).await.expect("release"),
        Write::Applied
    );
    store.claim(&scoped("s1-c", 1)).await.expect("s1-a's place");
    assert!(store.claim(&scoped("s1-d", 1)).await.is_err());
    assert!(store.purge(&key("s1-c")).await.expect("purge"));
    store.claim(&scoped("s1-d", 1)).await.expect("s1-c's place");
    // An expired record counts until the sweeper deletes it; the schema's sweep does.
    server
        .psql("UPDATE idemproxy.records SET expires_at = clock_timestamp() - interval '1 ms' WHERE scope IS NOT NULL");
    assert_eq!(server.psql("SELECT idemproxy.sweep(500)"), "3");
    assert_eq!(
        server.psql("SELECT coalesce(sum(records), 0) FROM idemproxy.shares"),
        "0",
        "every count back to zero"
    );
    store.claim(&scoped("s1-e", 1)).await.expect("after the sweep");
}

/// A claim of `name` whose record expires a second after it is made.
fn expiring_in_a_second(name: &str, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        retention: Duration::from_secs(1),
        remember: Duration::from_secs(1),
        ..claim(&key(name), new_owner(), lease)
    }
}

/// Waits (10 s at most) until the SQLite sweeper has deleted a record. It runs within
/// a second when idle.
async fn until_swept(store: &SqliteStore) {
    let started = tokio::time::Instant::now();
    while store.commit_figures().swept.get() < 1 {
        assert!(started.elapsed() < Duration::from_secs(10), "the sweeper never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 49 (the Postgres sweep plant, on the other store that sweeps): a claim whose
/// lease lapsed (its proxy died) but whose retention runs on survives the sweeper,
/// which deletes only what has expired, and reads as a lapsed lease: never free.
#[tokio::test]
async fn the_sqlite_sweeper_leaves_a_claim_whose_lease_lapsed() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = sqlite_store(&dir.path().join("records.db"), StoreLimits::unbounded(100));
    let lapsed = key("sweep-lapsed");
    store
        .claim(&claim(&lapsed, new_owner(), Duration::from_millis(300)))
        .await
        .expect("claim");
    let expiring = expiring_in_a_second("sweep-expiring", Duration::from_millis(300));
    store.claim(&expiring).await.expect("claim");
    store.advance_clock(Duration::from_secs(5));
    // Once the sweeper has deleted the expired record, it has looked at the lapsed one too.
    until_swept(&store).await;
    assert_eq!(store.len(), 1, "only the expired record is gone");
    assert_eq!(state_of(&store, &lapsed).await, RecordState::LeaseExpired);
    drop(store);
}

/// Issue 49 (a plant the suite missed: the SQLite writer running and committing a
/// write whose caller timed out or left, so that under overload it no longer sheds
/// work). With the writer stalled, claims whose callers give up at the store's timeout
/// are never committed once it goes on: their keys are free, and the file holds only
/// what a caller still waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_caller_gave_up_is_never_committed() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let config = sqlite_config(&dir.path().join("records.db"), StoreLimits::unbounded(100));
    let store = SqliteStore::open(&config, Duration::from_millis(200)).expect("open");
    let release = store.hold_writer().await;
    let abandoned: Vec<StoreKey> = (0..5).map(|n| key(&format!("abandoned-{n}"))).collect();
    for record in &abandoned {
        match store.claim(&claim(record, new_owner(), LONG)).await {
            Err(StoreError::Timeout { .. }) => {}
            other => panic!("a claim past the stalled writer: {other:?}"),
        }
    }
    drop(release);
    // Queued behind the abandoned writes: once it is answered, they were dealt with.
    let kept = key("kept");
    assert_eq!(
        store.claim(&claim(&kept, new_owner(), LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    assert_eq!(store.len(), 1, "only the claim a caller waited for is in the file");
    for record in &abandoned {
        assert_eq!(
            store.claim(&claim(record, new_owner(), LONG)).await.expect("claim"),
            ClaimOutcome::Acquired(()),
            "an abandoned claim was committed"
        );
    }
    drop(store);
}

/// Issue 49 L5: the 7/8 reserve ignored claims in flight: six concurrent 100 KiB
/// responses on a 5/8-full 1 MiB store were all admitted, three went unrecorded, and
/// their retries got 409 for the retention. Claims now keep room for what each in
/// flight may still write: those the file cannot hold are refused (503, nothing
/// forwarded), and every one admitted records its response.
#[tokio::test]
async fn a_sqlite_store_admits_no_claim_whose_response_could_not_be_recorded() {
    const BODY: usize = 100 * 1024;
    let dir = tempfile::tempdir().expect("temporary directory");
    let limits = StoreLimits {
        max_bytes: 1 << 20,
        ..StoreLimits::unbounded(1000)
    };
    let store = sqlite_store(&dir.path().join("records.db"), limits);
    let body = Bytes::from(vec![b'x'; BODY]);
    let big = |body: &Bytes| StoredResponse {
        body: body.clone(),
        ..response("")
    };
    let limited = |name: &str| ClaimRequest {
        response_limit: BODY,
        ..claim(&key(name), new_owner(), LONG)
    };
    // About 5/8 of the file in use.
    for n in 0..5 {
        let request = limited(&format!("fill-{n}"));
        assert_eq!(store.claim(&request).await.expect("claim"), ClaimOutcome::Acquired(()));
        let written = store
            .complete(&request.key, request.owner, &big(&body))
            .await
            .expect("complete");
        assert_eq!(written, Write::Applied);
    }
    // Six claims in flight at once, each of which may write 100 KiB.
    let mut admitted = Vec::new();
    let mut refused = 0;
    for n in 0..6 {
        let request = limited(&format!("flight-{n}"));
        match store.claim(&request).await {
            Ok(ClaimOutcome::Acquired(())) => admitted.push(request),
            Err(StoreError::Full { what: Held::Bytes, .. }) => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(refused > 0, "every one admitted: the file cannot hold them all");
    assert!(!admitted.is_empty(), "none admitted though there is room");
    for request in &admitted {
        let written = store.complete(&request.key, request.owner, &big(&body)).await;
        assert!(
            matches!(written, Ok(Write::Applied)),
            "an admitted claim's response went unrecorded: {written:?}"
        );
    }
    drop(store);
}

/// A copy of the SQLite store's files in `dir` (`records.db` and its log), in `dir`'s
/// `snapshot`: what a power cut would leave if no fsync came after it.
fn snapshot_of(dir: &std::path::Path) -> std::path::PathBuf {
    let snapshot = dir.join("snapshot");
    std::fs::create_dir(&snapshot).expect("snapshot directory");
    for suffix in ["", "-wal"] {
        let name = format!("records.db{suffix}");
        std::fs::copy(dir.join(&name), snapshot.join(&name)).expect("copy");
    }
    snapshot
}

/// Issue 54 (docs/design.md §27, docs/stores.md "What is on disk when"): a release and
/// an unknown mark wait for their commit, not for an fsync. With the syncer held, both
/// are answered and every read sees them at once (the released key is free, the marked
/// one unknown). A copy of the files taken after both claims were on disk and before
/// the release and the mark (the worst a power cut may leave of them, whose fsync had
/// not come) reads both records as in flight, as their claims wrote them: a retry is
/// refused (409, then `outcome-unknown` once the lease is over), never given the key to
/// run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_release_and_unknown_mark_lost_with_the_unsynced_log_leave_their_claims() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    let (released, marked) = (key("lost-release"), key("lost-mark"));
    let (releaser, marker) = (new_owner(), new_owner());
    for (record, owner) in [(&released, releaser), (&marked, marker)] {
        assert_eq!(
            store.claim(&claim(record, owner, LONG)).await.expect("claim"),
            ClaimOutcome::Acquired(())
        );
    }
    let held = store.hold_fsyncs().await;
    let snapshot = snapshot_of(dir.path());
    let release = tokio::time::timeout(LONG, store.release(&released, releaser))
        .await
        .expect("a release waited for an fsync")
        .expect("release");
    let mark = tokio::time::timeout(
        LONG,
        store.mark_unknown(&marked, marker, UnknownReason::UpstreamTimeout, None),
    )
    .await
    .expect("an unknown mark waited for an fsync")
    .expect("mark");
    assert_eq!((release, mark), (Write::Applied, Write::Applied));
    assert_eq!(
        store.inspect(&released).await.expect("inspect"),
        None,
        "released at its commit"
    );
    match store
        .inspect(&marked)
        .await
        .expect("inspect")
        .map(|summary| summary.state)
    {
        Some(SummaryState::Unknown {
            reason: UnknownReason::UpstreamTimeout,
            ..
        }) => {}
        other => panic!("the mark is not read at its commit: {other:?}"),
    }
    drop(held);
    drop(store);

    let lost = sqlite_store(&snapshot.join("records.db"), StoreLimits::unbounded(100));
    for record in [&released, &marked] {
        match state_of(&lost, record).await {
            RecordState::InFlight { .. } => {}
            other => panic!("a release or mark lost with the log's unsynced tail left {other:?}"),
        }
    }
    drop(lost);
}

/// Issue 54 (docs/design.md §27): only what a forward depends on waits for the fsync.
/// With the syncer held, a claim of a free key is committed but not answered, while a
/// completion committed after it is answered, and read by every claim, at once; the
/// claim is answered once the fsync may run. A copy of the files taken after the claim
/// was on disk and before the completion (the worst a power cut may leave of the
/// completion's commit, whose fsync had not come) reads the record as in flight: a
/// retry is refused, never given the key to run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_claim_waits_for_its_fsync_and_a_completion_only_for_its_commit() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    let (done, waiting) = (key("fsync-done"), key("fsync-waiting"));
    let owner = new_owner();
    assert_eq!(
        store.claim(&claim(&done, owner, LONG)).await.expect("claim"),
        ClaimOutcome::Acquired(())
    );
    // What is on disk now: the claim, fsync'd before it was answered.
    let held = store.hold_fsyncs().await;
    let snapshot = snapshot_of(dir.path());
    let claiming = {
        let (store, waiting) = (store.clone(), waiting.clone());
        tokio::spawn(async move { store.claim(&claim(&waiting, new_owner(), LONG)).await })
    };
    let completed = tokio::time::timeout(LONG, store.complete(&done, owner, &response("kept")))
        .await
        .expect("a completion waited for an fsync")
        .expect("complete");
    assert_eq!(completed, Write::Applied);
    assert!(!claiming.is_finished(), "a claim was answered before its fsync");
    match store.claim(&claim(&done, new_owner(), LONG)).await.expect("retry") {
        ClaimOutcome::Existing(Existing {
            state: RecordState::Completed(replayed),
            ..
        }) => assert_eq!(replayed, response("kept")),
        other => panic!("a retry after the completion's commit: {other:?}"),
    }
    drop(held);
    let claimed = claiming.await.expect("the claim's task").expect("claim");
    assert_eq!(claimed, ClaimOutcome::Acquired(()));
    drop(store);

    let lost = sqlite_store(&snapshot.join("records.db"), StoreLimits::unbounded(100));
    match lost
        .claim(&claim(&done, new_owner(), LONG))
        .await
        .expect("retry after the loss")
    {
        ClaimOutcome::Existing(Existing {
            state: RecordState::InFlight { .. },
            ..
        }) => {}
        other => panic!("a completion lost with the log's unsynced tail: {other:?}"),
    }
    drop(lost);
}

/// Issue 54 (schema step 6): the SQLite table has no index of its keys; the store
/// keeps where each key's row is in memory. Every path that inserts or deletes a row
/// keeps that index whole (checked against a scan of the file after each), a key
/// claimed twice in one commit is taken once, and a reopened store reads the index
/// again from the file: what was recorded replays, what was freed is free.
#[tokio::test]
async fn the_sqlite_stores_index_of_keys_follows_every_insert_and_delete() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    let checked = |store: &SqliteStore, after: &str| {
        if let Err(difference) = store.check_keys() {
            panic!("after {after}: {difference}");
        }
    };
    let (completed, released, resolved, purged) = (key("completed"), key("released"), key("resolved"), key("purged"));
    for record in [&completed, &released, &resolved, &purged] {
        let owner = new_owner();
        assert_eq!(
            store.claim(&claim(record, owner, LONG)).await.expect("claim"),
            ClaimOutcome::Acquired(())
        );
        match record {
            r if r == &completed => {
                let written = store.complete(record, owner, &response("kept")).await;
                assert_eq!(written.expect("complete"), Write::Applied);
            }
            r if r == &released => assert_eq!(store.release(record, owner).await.expect("release"), Write::Applied),
            r if r == &resolved => {
                let marked = store
                    .mark_unknown(record, owner, UnknownReason::UpstreamTimeout, None)
                    .await;
                assert_eq!(marked.expect("mark"), Write::Applied);
                let resolution = store.resolve(record, None, &Resolution::NotApplied).await;
                assert_eq!(resolution.expect("resolve"), Resolved::Resolved);
            }
            _ => assert!(store.purge(record).await.expect("purge")),
        }
        checked(&store, "a claim and its end");
    }
    // An expired record is replaced by the next claim of its key.
    let expiring = expiring_in_a_second("expiring", Duration::from_millis(500));
    store.claim(&expiring).await.expect("claim");
    store.advance_clock(Duration::from_secs(2));
    let again = claim(&key("expiring"), new_owner(), LONG);
    assert_eq!(store.claim(&again).await.expect("claim"), ClaimOutcome::Acquired(()));
    checked(&store, "an expired record replaced");
    // One the sweeper deletes leaves the index with it.
    let swept = expiring_in_a_second("swept", Duration::from_millis(500));
    store.claim(&swept).await.expect("claim");
    store.advance_clock(Duration::from_secs(2));
    until_swept(&store).await;
    checked(&store, "a sweep");
    // A key claimed twice in one commit: the second claim reads the first's row.
    let twice = key("twice");
    let hold = store.hold_writer().await;
    let asked = Arc::new(AtomicUsize::new(0));
    let claims: Vec<_> = (0..2)
        .map(|_| {
            let (store, asked, request) = (store.clone(), asked.clone(), claim(&twice, new_owner(), LONG));
            tokio::spawn(async move {
                asked.fetch_add(1, Ordering::SeqCst);
                store.claim(&request).await
            })
        })
        .collect();
    while asked.load(Ordering::SeqCst) < 2 {
        tokio::task::yield_now().await;
    }
    drop(hold);
    let mut acquired = 0;
    for claim in claims {
        match claim.await.expect("task").expect("claim") {
            ClaimOutcome::Acquired(()) => acquired += 1,
            ClaimOutcome::Existing(existing) => assert!(matches!(existing.state, RecordState::InFlight { .. })),
        }
    }
    assert_eq!(acquired, 1, "a key claimed twice in one commit is taken once");
    checked(&store, "two claims of a key in one commit");
    assert_eq!(store.len(), 3, "completed, expiring and twice");
    drop(store);

    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    checked(&store, "the store reopened");
    assert_eq!(
        state_of(&store, &completed).await,
        RecordState::Completed(response("kept"))
    );
    for free in [&released, &resolved, &purged] {
        let outcome = store.claim(&claim(free, new_owner(), LONG)).await.expect("claim");
        assert_eq!(
            outcome,
            ClaimOutcome::Acquired(()),
            "a freed key is free after a restart"
        );
    }
    assert!(matches!(
        store.claim(&claim(&twice, new_owner(), LONG)).await.expect("claim"),
        ClaimOutcome::Existing(_)
    ));
    checked(&store, "claims after the restart");
}

/// Issue 54: a commit that failed where it may have landed (an I/O error, not a full
/// disk) stops the SQLite store's writes until a restart. The index of keys in memory
/// does not know the rows such a commit may have written, so a second claim of its key
/// would write a second row and be forwarded again; after a restart the index is read
/// from the file, and the claim that landed is found.
#[tokio::test]
async fn a_sqlite_commit_that_may_have_landed_stops_writes_until_a_restart() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("records.db");
    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    let landed = key("landed");
    store.fail_next_commit();
    match store.claim(&claim(&landed, new_owner(), LONG)).await {
        Err(StoreError::Disk(failure)) => assert!(failure.may_have_written, "{failure}"),
        other => panic!("the planted failure was not reported: {other:?}"),
    }
    let again = store.claim(&claim(&landed, new_owner(), LONG)).await;
    assert!(
        matches!(again, Err(StoreError::Disk(_))),
        "a claim after a commit that may have landed: {again:?}"
    );
    assert!(store.ping().await.is_err(), "ready after a commit that may have landed");
    drop(store);

    let store = sqlite_store(&path, StoreLimits::unbounded(100));
    if let Err(difference) = store.check_keys() {
        panic!("after the restart: {difference}");
    }
    let found = store.claim(&claim(&landed, new_owner(), LONG)).await.expect("claim");
    assert!(
        matches!(found, ClaimOutcome::Existing(_)),
        "the claim that landed is found after the restart: {found:?}"
    );
}
