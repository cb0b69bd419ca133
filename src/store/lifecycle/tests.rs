//! The lifecycle's transitions, each branch on its own, with the file's clock
//! (milliseconds); the store suite and the model conformance run the same steps
//! through the memory and SQLite stores.

use super::*;
use crate::store::StoredResponse;
use bytes::Bytes;
use http::StatusCode;

const NOW: i64 = 1_000_000;

fn owner(byte: u8) -> OwnerToken {
    OwnerToken::from_bytes(&[byte; 16]).expect("16 bytes")
}

fn in_flight(holder: u8, lease_until: i64) -> State<i64, &'static str> {
    State::InFlight {
        owner: owner(holder),
        lease_until,
    }
}

fn unknown(holder: u8, schedule: Option<Schedule<i64>>) -> State<i64, &'static str> {
    State::Unknown {
        reason: UnknownReason::UpstreamTimeout,
        owner: owner(holder),
        schedule,
    }
}

fn schedule(due: Option<i64>, give_up_at: i64) -> Option<Schedule<i64>> {
    Some(Schedule { due, give_up_at })
}

fn probes() -> ProbeSchedule {
    ProbeSchedule {
        first_after: Duration::from_secs(1),
        give_up_after: Duration::from_secs(60),
    }
}

fn stored(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: Bytes::from_static(body.as_bytes()),
        trace: None,
        replay_until: None,
    }
}

fn claimed(state: State<i64, &'static str>, claimant: u8) -> ClaimOutcome {
    claim(Fingerprint([9; 32]), state, owner(claimant), NOW, |body| {
        Ok::<_, StoreError>(RecordState::Completed(stored(body)))
    })
    .expect("claim")
}

fn existing(state: RecordState) -> ClaimOutcome {
    ClaimOutcome::Existing(Existing {
        fingerprint: Fingerprint([9; 32]),
        state,
    })
}

#[test]
fn a_claim_reads_each_state_as_its_claimant_sees_it() {
    assert_eq!(claimed(in_flight(1, NOW + 1), 1), ClaimOutcome::Acquired(()));
    assert_eq!(
        claimed(in_flight(1, NOW + 1_500), 2),
        existing(RecordState::InFlight {
            lease_remaining: Duration::from_millis(1_500)
        })
    );
    // A lapsed lease is lapsed for its own owner too: the claim is not taken again.
    for claimant in [1, 2] {
        assert_eq!(
            claimed(in_flight(1, NOW), claimant),
            existing(RecordState::LeaseExpired)
        );
    }
    assert_eq!(
        claimed(State::Completed("done"), 1),
        existing(RecordState::Completed(stored("done")))
    );
    let probe_of = |schedule| match claimed(unknown(1, schedule), 1) {
        ClaimOutcome::Existing(Existing {
            state: RecordState::Unknown { reason, probe },
            ..
        }) => {
            assert_eq!(reason, UnknownReason::UpstreamTimeout);
            probe
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(probe_of(None), Probe::Unscheduled);
    assert_eq!(
        probe_of(schedule(Some(NOW + 2_000), NOW + 9_000)),
        Probe::Next(Duration::from_secs(2))
    );
    assert_eq!(
        probe_of(schedule(Some(NOW - 5), NOW + 9_000)),
        Probe::Next(Duration::ZERO)
    );
    assert_eq!(probe_of(schedule(None, NOW + 9_000)), Probe::GaveUp);
    assert_eq!(probe_of(schedule(Some(NOW + 1), NOW)), Probe::GaveUp);
}

#[test]
fn a_summary_names_the_claim_only_where_its_outcome_is_unknown() {
    let summarise = |state| {
        summary(state, NOW, |body: &str| {
            Ok::<_, StoreError>(SummaryState::Completed {
                status: 201,
                response_bytes: body.len() as u64,
                trace_id: None,
            })
        })
        .expect("summary")
    };
    assert_eq!(
        summarise(in_flight(1, NOW + 10)),
        (
            SummaryState::InFlight {
                lease_remaining: Duration::from_millis(10)
            },
            None
        )
    );
    assert_eq!(
        summarise(in_flight(1, NOW)),
        (SummaryState::LeaseExpired, Some(owner(1)))
    );
    assert_eq!(
        summarise(State::Completed("four")),
        (
            SummaryState::Completed {
                status: 201,
                response_bytes: 4,
                trace_id: None
            },
            None
        )
    );
    assert_eq!(
        summarise(unknown(3, None)),
        (
            SummaryState::Unknown {
                reason: UnknownReason::UpstreamTimeout,
                probe: Probe::Unscheduled
            },
            Some(owner(3))
        )
    );
}

#[test]
fn only_an_unknown_record_is_resolved_and_only_for_the_claim_named() {
    assert_eq!(resolvable(&unknown(1, None), None, NOW), Ok(()));
    assert_eq!(resolvable(&unknown(1, None), Some(owner(1)), NOW), Ok(()));
    assert_eq!(
        resolvable(&unknown(1, None), Some(owner(2)), NOW),
        Err(Resolved::OtherClaim)
    );
    assert_eq!(resolvable(&in_flight(1, NOW), Some(owner(1)), NOW), Ok(()));
    assert_eq!(
        resolvable(&in_flight(1, NOW), Some(owner(2)), NOW),
        Err(Resolved::OtherClaim)
    );
    assert_eq!(resolvable(&in_flight(1, NOW + 1), None, NOW), Err(Resolved::NotUnknown));
    assert_eq!(
        resolvable(&State::<i64, &str>::Completed("done"), None, NOW),
        Err(Resolved::NotUnknown)
    );
}

#[test]
fn a_probe_begins_only_when_due_and_gives_up_at_its_time() {
    let lease = Duration::from_secs(5);
    // A lapsed claim becomes unknown, its probe leased from now.
    let (start, change) = begin_probe(&in_flight(1, NOW), probes(), lease, NOW);
    assert_eq!(start, ProbeStart::Leased(owner(1)));
    let leased = Schedule {
        due: Some(NOW + 5_000),
        give_up_at: NOW + 60_000,
    };
    assert_eq!(change, Some(Change::LeaseExpired(leased)));
    let mut state = in_flight(1, NOW);
    state.apply(change.expect("a change"));
    assert_eq!(state, unknown_lapsed(1, leased));

    assert_eq!(
        begin_probe(&in_flight(1, NOW + 1), probes(), lease, NOW),
        (ProbeStart::Settled, None)
    );
    assert_eq!(
        begin_probe(&State::<i64, &str>::Completed("x"), probes(), lease, NOW),
        (ProbeStart::Settled, None)
    );
    // Unscheduled: scheduled now, and leased at once.
    assert_eq!(
        begin_probe(&unknown(2, None), probes(), lease, NOW),
        (
            ProbeStart::Leased(owner(2)),
            Some(Change::Reschedule(Schedule {
                due: Some(NOW + 5_000),
                give_up_at: NOW + 60_000
            }))
        )
    );
    assert_eq!(
        begin_probe(
            &unknown(2, schedule(Some(NOW + 700), NOW + 9_000)),
            probes(),
            lease,
            NOW
        ),
        (ProbeStart::NotDue(Duration::from_millis(700)), None)
    );
    assert_eq!(
        begin_probe(&unknown(2, schedule(None, NOW + 9_000)), probes(), lease, NOW),
        (ProbeStart::GaveUp, None)
    );
    // Due, but past its time: it gives up, and says so from then on.
    assert_eq!(
        begin_probe(&unknown(2, schedule(Some(NOW), NOW)), probes(), lease, NOW),
        (
            ProbeStart::GaveUp,
            Some(Change::Reschedule(Schedule {
                due: None,
                give_up_at: NOW
            }))
        )
    );
    assert_eq!(
        begin_probe(&unknown(2, schedule(Some(NOW), NOW + 1)), probes(), lease, NOW),
        (
            ProbeStart::Leased(owner(2)),
            Some(Change::Reschedule(Schedule {
                due: Some(NOW + 5_000),
                give_up_at: NOW + 1
            }))
        )
    );
}

fn unknown_lapsed(holder: u8, leased: Schedule<i64>) -> State<i64, &'static str> {
    State::Unknown {
        reason: UnknownReason::LeaseExpired,
        owner: owner(holder),
        schedule: Some(leased),
    }
}

#[test]
fn a_deferred_probe_is_rescheduled_for_its_own_claim_until_its_time_runs_out() {
    let every = Duration::from_secs(10);
    let mut state = unknown(1, schedule(Some(NOW), NOW + 10_001));
    let (deferred, change) = defer_probe(&state, owner(1), every, NOW);
    assert_eq!(deferred, Deferred::Scheduled);
    state.apply(change.expect("a change"));
    assert_eq!(state, unknown(1, schedule(Some(NOW + 10_000), NOW + 10_001)));

    assert_eq!(
        defer_probe(&unknown(1, schedule(Some(NOW), NOW + 10_000)), owner(1), every, NOW),
        (
            Deferred::GaveUp,
            Some(Change::Reschedule(Schedule {
                due: None,
                give_up_at: NOW + 10_000
            }))
        )
    );
    assert_eq!(
        defer_probe(&unknown(1, schedule(None, NOW + 99_000)), owner(1), every, NOW).0,
        Deferred::GaveUp
    );
    for settled in [
        unknown(1, schedule(Some(NOW), NOW + 99_000)),
        unknown(2, None),
        in_flight(1, NOW),
        State::Completed("x"),
    ] {
        let named = if matches!(settled, State::Unknown { .. }) { 2 } else { 1 };
        assert_eq!(
            defer_probe(&settled, owner(named), every, NOW),
            (Deferred::Settled, None),
            "{settled:?}"
        );
    }
}

#[test]
fn a_change_is_made_only_to_the_state_it_was_decided_on() {
    let leased = Schedule {
        due: Some(NOW),
        give_up_at: NOW,
    };
    let mut completed = State::<i64, &str>::Completed("x");
    completed.apply(Change::LeaseExpired(leased));
    completed.apply(Change::Reschedule(leased));
    assert_eq!(completed, State::Completed("x"));
    let mut flying = in_flight(1, NOW);
    flying.apply(Change::Reschedule(leased));
    assert_eq!(flying, in_flight(1, NOW));
}

/// A ledger that answers from fixed shares and writes down what it is asked.
#[derive(Default)]
struct Book {
    /// Full before a sweep, and after it.
    full: Vec<(Share, Option<Held>, Option<Held>)>,
    swept: Vec<Share>,
    asked: Vec<Share>,
    reserve: Option<Duration>,
}

impl Ledger for Book {
    fn full(&mut self, share: Share) -> Result<Option<Held>, StoreError> {
        self.asked.push(share);
        let swept = self.swept.contains(&share);
        Ok(self
            .full
            .iter()
            .find(|(of, ..)| *of == share)
            .and_then(|(_, before, after)| if swept { *after } else { *before }))
    }

    fn sweep(&mut self, share: Share) -> Result<(), StoreError> {
        self.swept.push(share);
        Ok(())
    }

    fn first_expiry(&mut self, share: Share) -> Result<Duration, StoreError> {
        Ok(match share {
            Share::Store => Duration::from_millis(300),
            Share::Scope(_) => Duration::from_secs(7),
            Share::Client(_) => Duration::from_secs(9),
        })
    }

    fn reserve(&mut self, _: &ClaimRequest) -> Result<Option<Duration>, StoreError> {
        Ok(self.reserve)
    }
}

fn request() -> ClaimRequest {
    ClaimRequest {
        key: crate::store::StoreKey::from_derived("idemproxy:r:{k}".to_string()),
        scope: Some(ScopeId(4)),
        client: Some(ClientId(5)),
        owner: owner(1),
        fingerprint: Fingerprint([1; 32]),
        retention: Duration::from_secs(60),
        remember: Duration::from_secs(60),
        lease: Duration::from_secs(5),
        response_limit: 0,
        probe_key: None,
    }
}

fn limits() -> StoreLimits {
    StoreLimits {
        max_records: 10,
        max_bytes: 1_000,
        max_records_per_scope: 5,
        max_bytes_per_scope: 500,
        max_records_per_client: 7,
    }
}

fn admitted(book: &mut Book) -> Result<(), String> {
    admit(book, &request(), &limits()).map_err(|error| format!("{error:?}"))
}

#[test]
fn admission_asks_store_then_scope_then_client_and_sweeps_before_it_refuses() {
    let (store, scope, client) = (Share::Store, Share::Scope(ScopeId(4)), Share::Client(ClientId(5)));
    let mut free = Book::default();
    assert_eq!(admitted(&mut free), Ok(()));
    assert_eq!(free.asked, [store, scope, client]);
    assert!(free.swept.is_empty(), "nothing swept while there is room");

    // Full until swept: admitted, each share swept once.
    let mut sweepable = Book {
        full: vec![
            (store, Some(Held::Records), None),
            (scope, Some(Held::Bytes), None),
            (client, Some(Held::Records), None),
        ],
        ..Book::default()
    };
    assert_eq!(admitted(&mut sweepable), Ok(()));
    assert_eq!(sweepable.swept, [store, scope, client]);

    let refused = |full: Vec<(Share, Option<Held>, Option<Held>)>, reserve| {
        let mut book = Book {
            full,
            reserve,
            ..Book::default()
        };
        admitted(&mut book).expect_err("refused")
    };
    let error = refused(vec![(store, Some(Held::Records), Some(Held::Records))], None);
    assert!(error.contains("what: Records, limit: 10, retry_after: 1s"), "{error}");
    let error = refused(vec![(store, Some(Held::Bytes), Some(Held::Bytes))], None);
    assert!(error.contains("what: Bytes, limit: 1000, retry_after: 1s"), "{error}");
    let error = refused(Vec::new(), Some(Duration::from_secs(3)));
    assert!(error.contains("what: Bytes, limit: 1000, retry_after: 3s"), "{error}");
    let error = refused(vec![(scope, Some(Held::Bytes), Some(Held::Bytes))], None);
    assert!(
        error.starts_with("ScopeFull") && error.contains("retry_after: 7s"),
        "{error}"
    );
    let error = refused(
        vec![
            (scope, Some(Held::Records), Some(Held::Records)),
            (client, Some(Held::Records), Some(Held::Records)),
        ],
        None,
    );
    assert!(
        error.starts_with("ScopeFull"),
        "the scope is asked before the client: {error}"
    );
    let error = refused(vec![(client, Some(Held::Records), Some(Held::Records))], None);
    assert!(
        error.starts_with("ClientFull") && error.contains("retry_after: 9s"),
        "{error}"
    );
    // The store's bound comes before the room kept for claims in flight.
    let error = refused(
        vec![(store, Some(Held::Records), Some(Held::Records))],
        Some(Duration::from_secs(3)),
    );
    assert!(error.contains("what: Records"), "{error}");
}

#[test]
fn the_file_clock_saturates_and_never_counts_back() {
    assert_eq!(NOW.until(NOW - 1), Duration::ZERO);
    assert_eq!(NOW.until(NOW + 1_234), Duration::from_millis(1_234));
    assert_eq!(NOW.plus(Duration::from_millis(5)), NOW + 5);
    assert_eq!(i64::MAX.plus(Duration::from_secs(1)), i64::MAX);
}
