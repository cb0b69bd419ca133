use super::*;
use http::header;

fn key(byte: u8) -> RecordKey {
    RecordKey::from_bytes([byte; 32])
}

fn sealer(current: u8, previous: &[u8]) -> Sealer {
    Sealer::new(&encryption(current, previous, false))
}

/// A sealer that still replays records kept in clear (`accept_clear_records`).
fn accepting(current: u8) -> Sealer {
    Sealer::new(&encryption(current, &[], true))
}

fn encryption(current: u8, previous: &[u8], accept_clear_records: bool) -> Encryption {
    Encryption {
        key_env: "K".into(),
        previous_keys_env: None,
        current: key(current),
        previous: previous.iter().map(|byte| key(*byte)).collect(),
        accept_clear_records,
    }
}

fn store_key(name: &str) -> StoreKey {
    StoreKey::from_derived(format!("idemproxy:payments:{{{name}}}"))
}

fn response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (header::CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (
                header::LOCATION,
                HeaderValue::from_static("/v1/payments/SECRET-LOCATION"),
            ),
        ],
        body: Bytes::from_static(b"{\"card_token\":\"SECRET-TOKEN-4242\"}"),
        trace: Some(crate::record::ExecutionTrace {
            trace_id: [7; 16],
            span_id: [9; 8],
        }),
        replay_until: Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_900_000_000)),
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

#[test]
fn a_sealed_record_holds_nothing_of_the_response_in_clear_and_opens_to_it() {
    let sealer = sealer(1, &[]);
    let record = store_key("a");
    let sealed = sealer.seal(&record, &response()).expect("seals");
    let stored = [sealed.body.as_ref(), &sealed.encode_headers()].concat();
    for secret in [&b"SECRET"[..], b"application/json", b"card_token", b"location"] {
        assert!(
            !contains(&stored, secret),
            "{} in clear",
            String::from_utf8_lossy(secret)
        );
    }
    assert_eq!(sealed.status, StatusCode::CREATED, "the status stays clear");
    assert_eq!(sealed.trace, response().trace, "the trace stays clear");
    assert_eq!(sealed_by(&sealed).as_deref(), Some(key(1).id()));
    assert_eq!(sealer.open(&record, sealed), Ok(response()));
}

#[test]
fn each_seal_takes_a_fresh_nonce() {
    let sealer = sealer(1, &[]);
    let record = store_key("a");
    let first = sealer.seal(&record, &response()).expect("seals");
    let second = sealer.seal(&record, &response()).expect("seals");
    assert_ne!(first.body[1..1 + NONCE_LEN], second.body[1..1 + NONCE_LEN]);
    assert_ne!(first.body, second.body);
}

#[test]
fn a_sealed_value_opens_only_where_and_as_it_was_sealed() {
    let sealer = sealer(1, &[]);
    let record = store_key("a");
    let sealed = sealer.seal(&record, &response()).expect("seals");
    let id = key(1).id().to_string();
    // Moved to another record.
    assert_eq!(
        sealer.open(&store_key("b"), sealed.clone()),
        Err(Unreadable::Broken(id.clone()))
    );
    // Given another status.
    let mut restatused = sealed.clone();
    restatused.status = StatusCode::OK;
    assert_eq!(sealer.open(&record, restatused), Err(Unreadable::Broken(id.clone())));
    // Any byte flipped, and any cut.
    for at in 0..sealed.body.len() {
        let mut flipped = sealed.body.to_vec();
        flipped[at] ^= 0x01;
        let altered = StoredResponse {
            body: flipped.into(),
            ..sealed.clone()
        };
        assert_eq!(
            sealer.open(&record, altered),
            Err(Unreadable::Broken(id.clone())),
            "byte {at}"
        );
    }
    for cut in 0..sealed.body.len() {
        let truncated = StoredResponse {
            body: sealed.body.slice(..cut),
            ..sealed.clone()
        };
        assert_eq!(
            sealer.open(&record, truncated),
            Err(Unreadable::Broken(id.clone())),
            "cut {cut}"
        );
    }
}

#[test]
fn rotation_opens_old_records_and_a_dropped_key_opens_none() {
    let record = store_key("a");
    let old = sealer(1, &[]).seal(&record, &response()).expect("seals");
    let rotated = sealer(2, &[1]);
    assert_eq!(rotated.open(&record, old.clone()), Ok(response()));
    let new = rotated.seal(&record, &response()).expect("seals");
    assert_eq!(
        sealed_by(&new).as_deref(),
        Some(key(2).id()),
        "new records under the new key"
    );
    let dropped = sealer(2, &[]);
    assert_eq!(
        dropped.open(&record, old),
        Err(Unreadable::UnknownKey(key(1).id().to_string()))
    );
    assert_eq!(dropped.open(&record, new), Ok(response()));
}

#[test]
fn a_sealed_record_found_without_keys_is_unreadable_and_a_clear_one_opens_as_it_is() {
    let record = store_key("a");
    let sealed = sealer(1, &[]).seal(&record, &response()).expect("seals");
    assert_eq!(
        open(None, &record, sealed),
        Err(Unreadable::NoKeys(key(1).id().to_string()))
    );
    assert_eq!(open(None, &record, response()), Ok(response()));
    assert_eq!(
        accepting(1).open(&record, response()),
        Ok(response()),
        "written before encryption was on, and accepted"
    );
    assert_eq!(
        sealer(1, &[]).open(&record, response()),
        Err(Unreadable::Clear),
        "refused by default: anyone who can write the store can write one"
    );
}

#[test]
fn a_fingerprint_is_kept_as_an_hmac_and_recognised_under_every_configured_key() {
    let plain = Fingerprint([5; 32]);
    let other = Fingerprint([6; 32]);
    let old = sealer(1, &[]);
    let kept = old.fingerprint(plain);
    assert_ne!(kept, plain, "never the plain digest");
    assert_ne!(kept, sealer(2, &[]).fingerprint(plain), "keyed");
    assert_eq!(
        &kept.0[..4],
        &const_hex::decode_to_array::<_, 4>(key(1).id()).expect("hex")[..],
        "names its key"
    );
    let rotated = sealer(2, &[1]);
    assert_eq!(rotated.recognise(kept, plain), Recognised::Same, "under a previous key");
    assert_eq!(rotated.recognise(rotated.fingerprint(plain), plain), Recognised::Same);
    assert_eq!(
        rotated.recognise(plain, plain),
        Recognised::Same,
        "a record from before encryption"
    );
    assert_eq!(rotated.recognise(kept, other), Recognised::Other, "another request's");
    assert_eq!(
        rotated.recognise(plain, other),
        Recognised::Unverifiable,
        "from before encryption, another's"
    );
    assert_eq!(
        sealer(3, &[]).recognise(kept, plain),
        Recognised::Unverifiable,
        "a dropped key's"
    );
}

#[test]
fn key_ids_name_keys_and_reveal_nothing_of_them() {
    assert_eq!(key(1).id().len(), 8);
    assert_ne!(key(1).id(), key(2).id());
    assert_eq!(key(1).id(), RecordKey::from_bytes([1; 32]).id());
    assert!(format!("{:?}", key(1)).contains(key(1).id()));
    assert!(!format!("{:?}", key(1)).contains("[1, 1"));
    use base64::Engine as _;
    let text = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
    assert_eq!(RecordKey::from_base64(&text), Some(key(1)));
    assert_eq!(RecordKey::from_base64(text.trim_end_matches('=')), Some(key(1)));
    assert_eq!(
        RecordKey::from_base64(&base64::engine::general_purpose::STANDARD.encode([1u8; 31])),
        None
    );
    assert_eq!(RecordKey::from_base64("not base64!"), None);
}

#[test]
fn an_upstream_field_of_the_marker_name_is_never_recorded() {
    let mut parts = http::Response::new(()).into_parts().0;
    parts.headers.insert(SEALED, HeaderValue::from_static("forged"));
    let stored = StoredResponse::from_parts(&parts, Bytes::new(), &[]);
    assert!(stored.headers.is_empty());
    assert_eq!(sealed_by(&stored), None);
}

/// What a claim's outcome reads as, for each way a record's fingerprint and response
/// can stand: nothing is replayed whose fingerprint cannot be checked, and a record
/// that does not open is unreadable rather than another request's.
#[test]
fn a_claim_reads_a_record_it_cannot_check_as_unreadable_never_as_a_replay() {
    let record = store_key("a");
    let plain = Fingerprint([5; 32]);
    let other = Fingerprint([6; 32]);
    let old = sealer(1, &[]);
    let current = sealer(2, &[]);
    let existing = |fingerprint, state| ClaimOutcome::Existing(Existing { fingerprint, state });
    let completed = |sealer: &Sealer| RecordState::Completed(sealer.seal(&record, &response()).expect("seals"));
    let unreadable = RecordState::Unknown {
        reason: UnknownReason::Unreadable,
        probe: Probe::GaveUp,
    };
    let sent = |sealer: Option<&Sealer>, asked: Fingerprint| sealer.map_or(asked, |sealer| sealer.fingerprint(asked));
    // What a claim by a request with `asked` reads, sent as a sealer sends it.
    let asked = |sealer: Option<&Sealer>, asked: Fingerprint, outcome| {
        opened(sealer, &record, asked, sent(sealer, asked), outcome)
    };
    let read = |sealer: Option<&Sealer>, outcome| asked(sealer, plain, outcome);
    // Sealed and fingerprinted under the current key: replayed, opened.
    assert_eq!(
        read(
            Some(&current),
            existing(current.fingerprint(plain), completed(&current))
        ),
        existing(plain, RecordState::Completed(response()))
    );
    // Another request's, under the current key: left to `decide` to refuse (422).
    match read(
        Some(&current),
        existing(current.fingerprint(other), completed(&current)),
    ) {
        ClaimOutcome::Existing(Existing { fingerprint, .. }) => {
            assert_eq!(fingerprint, current.fingerprint(other), "left as stored");
        }
        acquired => panic!("{acquired:?}"),
    }
    // Under a dropped key: unreadable, whoever asks.
    for who in [plain, other] {
        assert_eq!(
            asked(Some(&current), who, existing(old.fingerprint(plain), completed(&old))),
            existing(who, unreadable.clone())
        );
    }
    // Fingerprinted under a dropped key, sealed under the current one: unreadable too.
    assert_eq!(
        read(Some(&current), existing(old.fingerprint(plain), completed(&current))),
        existing(plain, unreadable.clone())
    );
    // Written before encryption, another request's: still another's where clear
    // records are accepted, unreadable where they are not.
    assert_eq!(
        asked(
            Some(&accepting(2)),
            other,
            existing(plain, RecordState::Completed(response()))
        ),
        existing(plain, RecordState::Completed(response()))
    );
    assert_eq!(
        asked(
            Some(&current),
            other,
            existing(plain, RecordState::Completed(response()))
        ),
        existing(other, unreadable.clone())
    );
    // Written before encryption, this request's: replayed only where accepted.
    assert_eq!(
        read(Some(&accepting(2)), existing(plain, RecordState::Completed(response()))),
        existing(plain, RecordState::Completed(response()))
    );
    assert_eq!(
        read(Some(&current), existing(plain, RecordState::Completed(response()))),
        existing(plain, unreadable.clone())
    );
    // Issue 49 H2: a sealed record rewritten in clear, its fingerprint (an HMAC under
    // the current key, this request's or another's) kept: unreadable, even where clear
    // records are accepted.
    for sealer in [&current, &accepting(2)] {
        for fingerprint in [sealer.fingerprint(plain), sealer.fingerprint(other)] {
            assert_eq!(
                read(Some(sealer), existing(fingerprint, RecordState::Completed(response()))),
                existing(
                    if fingerprint == sealer.fingerprint(plain) {
                        plain
                    } else {
                        fingerprint
                    },
                    unreadable.clone()
                )
            );
        }
    }
    // Unknown under a dropped key: still unknown, answered as the asker's (409).
    let unknown = RecordState::Unknown {
        reason: UnknownReason::UpstreamTimeout,
        probe: Probe::Next(std::time::Duration::ZERO),
    };
    assert_eq!(
        asked(Some(&current), other, existing(old.fingerprint(plain), unknown.clone())),
        existing(other, unknown)
    );
    // Sealed, then encryption turned off: unreadable for whoever asks, never 422.
    assert_eq!(
        asked(None, other, existing(current.fingerprint(plain), completed(&current))),
        existing(other, unreadable.clone())
    );
    // In clear, no keys, another request's: left to `decide` (422), as before.
    match asked(None, other, existing(plain, RecordState::Completed(response()))) {
        ClaimOutcome::Existing(Existing { fingerprint, .. }) => assert_eq!(fingerprint, plain),
        acquired => panic!("{acquired:?}"),
    }
    // Sealed, and no keys at all: unreadable.
    assert_eq!(
        read(None, existing(plain, completed(&current))),
        existing(plain, unreadable)
    );
}
