use super::*;
use http::HeaderMap;

fn key(text: &str) -> IdempotencyKey {
    parse_key_value(text.as_bytes()).expect("valid key")
}

#[test]
fn bare_and_quoted_keys_name_the_same_key() {
    assert_eq!(key("abc"), key("\"abc\""));
    assert_eq!(key("  abc "), key("abc"));
    assert_eq!(parse_key_value(br#""a\"b""#), Ok(IdempotencyKey("a\"b".into())));
}

#[test]
fn bad_keys_are_refused_with_their_reason() {
    let long = "k".repeat(256);
    let cases: &[(&[u8], KeyError)] = &[
        (b"", KeyError::Empty),
        (b"\"\"", KeyError::Empty),
        (long.as_bytes(), KeyError::TooLong),
        (b"a b", KeyError::NotVisibleAscii),
        (b"\"a b\"", KeyError::NotVisibleAscii),
        (b"caf\xc3\xa9", KeyError::NotVisibleAscii),
        (b"a\x01b", KeyError::NotVisibleAscii),
        (b"a,b", KeyError::Repeated),
        (b"\"a\", \"b\"", KeyError::Repeated),
        (b"\"open", KeyError::MalformedString),
        (b"\"a\";p=1", KeyError::MalformedString),
        (b"\"a\\q\"", KeyError::MalformedString),
    ];
    for (raw, expected) in cases {
        assert_eq!(parse_key_value(raw), Err(*expected), "{}", String::from_utf8_lossy(raw));
    }
    assert!(parse_key_value("k".repeat(255).as_bytes()).is_ok());
}

#[test]
fn a_repeated_header_is_refused() {
    let mut headers = HeaderMap::new();
    assert_eq!(parse_key(headers.get_all("idempotency-key")), Ok(None));
    headers.append("idempotency-key", HeaderValue::from_static("a"));
    assert_eq!(parse_key(headers.get_all("idempotency-key")), Ok(Some(key("a"))));
    headers.append("idempotency-key", HeaderValue::from_static("a"));
    assert_eq!(parse_key(headers.get_all("idempotency-key")), Err(KeyError::Repeated));
}

#[test]
fn keys_never_print_themselves() {
    let printed = format!("{:?}", key("secret-customer-42"));
    assert!(!printed.contains("secret"), "{printed}");
    assert!(printed.starts_with("key#") && printed.len() == 4 + 12, "{printed}");
}

#[test]
fn store_keys_hide_client_bytes_and_never_collide_across_boundaries() {
    let k = key("order-1");
    let derived = store_key("idemproxy", "payments", &[], &k);
    assert!(derived.as_str().starts_with("idemproxy:payments:"));
    assert!(!derived.as_str().contains("order-1"));
    assert_eq!(derived.as_str().len(), "idemproxy:payments:{}".len() + 64);
    // The record hash is the key's cluster hash tag: nothing before it has braces.
    assert_eq!(derived.as_str().find('{'), Some("idemproxy:payments:".len()));
    assert!(derived.as_str().ends_with('}'));
    // Length prefixes keep ("a:b", "c") and ("a", "b:c") apart.
    let one = store_key("p", "r", &[vec![b"a:b"], vec![b"c"]], &k);
    let two = store_key("p", "r", &[vec![b"a"], vec![b"b:c"]], &k);
    assert_ne!(one, two);
    // An absent scope header is not an empty one.
    assert_ne!(
        store_key("p", "r", &[vec![]], &k),
        store_key("p", "r", &[vec![b""]], &k)
    );
    // Same inputs, same key: one derivation for writer and reader.
    assert_eq!(
        store_key("p", "r", &[vec![b"x"]], &k),
        store_key("p", "r", &[vec![b"x"]], &k)
    );
    assert_ne!(store_key("p", "r1", &[], &k), store_key("p", "r2", &[], &k));
}

#[test]
fn the_fingerprint_covers_method_path_query_headers_and_body() {
    let uri: Uri = "/v1/pay?x=1".parse().expect("uri");
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let names = [HeaderName::from_static("content-type")];
    let base = fingerprint(&Method::POST, &uri, &headers, &names, &FingerprintBody::Bytes, b"{}");
    assert_eq!(
        base,
        fingerprint(&Method::POST, &uri, &headers, &names, &FingerprintBody::Bytes, b"{}")
    );
    assert_ne!(
        base,
        fingerprint(&Method::PATCH, &uri, &headers, &names, &FingerprintBody::Bytes, b"{}")
    );
    assert_ne!(
        base,
        fingerprint(
            &Method::POST,
            &"/v1/pay?x=2".parse().expect("uri"),
            &headers,
            &names,
            &FingerprintBody::Bytes,
            b"{}"
        )
    );
    assert_ne!(
        base,
        fingerprint(
            &Method::POST,
            &"/v1/pay".parse().expect("uri"),
            &headers,
            &names,
            &FingerprintBody::Bytes,
            b"{}"
        )
    );
    assert_ne!(
        base,
        fingerprint(&Method::POST, &uri, &headers, &names, &FingerprintBody::Bytes, b"{ }")
    );
    assert_ne!(
        base,
        fingerprint(
            &Method::POST,
            &uri,
            &HeaderMap::new(),
            &names,
            &FingerprintBody::Bytes,
            b"{}"
        )
    );
    // A header outside `fingerprint_headers` does not count.
    let mut other = headers.clone();
    other.insert("x-request-id", HeaderValue::from_static("1"));
    assert_eq!(
        base,
        fingerprint(&Method::POST, &uri, &other, &names, &FingerprintBody::Bytes, b"{}")
    );
}

#[test]
fn the_recording_rules_follow_the_status() {
    use OnServerError::{Release, Store};
    for (status, on_server_error, expected) in [
        (200, Release, Recording::Record),
        (201, Release, Recording::Record),
        (302, Release, Recording::Record),
        (400, Release, Recording::Record),
        (404, Release, Recording::Record),
        (422, Release, Recording::Record),
        (408, Store, Recording::Release),
        (409, Store, Recording::Release),
        (425, Store, Recording::Release),
        (429, Store, Recording::Release),
        (500, Release, Recording::Release),
        (503, Release, Recording::Release),
        (500, Store, Recording::Record),
        (504, Store, Recording::Record),
        (401, Store, Recording::Release),
        (403, Release, Recording::Release),
    ] {
        let status = StatusCode::from_u16(status).expect("status");
        assert_eq!(
            recording_for(status, on_server_error, OnUnauthorized::Release),
            expected,
            "{status} {on_server_error:?}"
        );
    }
    for status in [401, 403] {
        let status = StatusCode::from_u16(status).expect("status");
        assert_eq!(recording_for(status, Release, OnUnauthorized::Store), Recording::Record);
    }
}

#[test]
fn decisions_follow_the_record() {
    let mine = Fingerprint([1; 32]);
    let other = Fingerprint([2; 32]);
    let existing = |fingerprint, state| ClaimOutcome::<()>::Existing(crate::store::Existing { fingerprint, state });
    assert!(matches!(
        decide(ClaimOutcome::Acquired(()), mine),
        Decision::Forward(())
    ));
    let stored = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: vec![],
        body: bytes::Bytes::from_static(b"ok"),
        trace: None,
        replay_until: None,
    };
    assert!(matches!(
        decide(existing(mine, RecordState::Completed(stored.clone())), mine),
        Decision::Replay(_)
    ));
    assert!(matches!(
        decide(existing(other, RecordState::Completed(stored)), mine),
        Decision::Reject(Rejection::KeyReused)
    ));
    assert!(matches!(
        decide(existing(mine, RecordState::InFlight { lease_remaining: Duration::from_secs(30) }), mine),
        Decision::Reject(Rejection::InProgress { retry_after, .. }) if retry_after == Duration::from_secs(1)
    ));
    assert!(matches!(
        decide(existing(mine, RecordState::LeaseExpired), mine),
        Decision::Unknown(
            crate::store::Probe::Unscheduled,
            crate::store::UnknownReason::LeaseExpired
        )
    ));
    let next = crate::store::Probe::Next(Duration::from_secs(3));
    assert!(matches!(
        decide(
            existing(
                mine,
                RecordState::Unknown {
                    reason: crate::store::UnknownReason::UpstreamTimeout,
                    probe: next
                }
            ),
            mine
        ),
        Decision::Unknown(probe, _) if probe == next
    ));
    assert!(matches!(
        decide(
            existing(
                other,
                RecordState::InFlight {
                    lease_remaining: Duration::from_secs(5)
                }
            ),
            mine
        ),
        Decision::Reject(Rejection::KeyReused)
    ));
}

#[test]
fn a_json_fingerprint_ignores_spelling_and_ignored_fields_but_not_values() {
    let uri: Uri = "/v1/pay".parse().expect("uri");
    let json = FingerprintBody::Json {
        ignore: vec![crate::canonical_json::JsonPointer::parse("/request_id").expect("pointer")],
    };
    let of = |rule: &FingerprintBody, body: &[u8]| fingerprint(&Method::POST, &uri, &HeaderMap::new(), &[], rule, body);
    let base = of(&json, br#"{"amount":10,"currency":"EUR","request_id":"a"}"#);
    assert_eq!(
        base,
        of(&json, br#"{ "currency": "EUR", "amount": 10.0, "request_id": "b" }"#)
    );
    assert_ne!(base, of(&json, br#"{"amount":11,"currency":"EUR","request_id":"a"}"#));
    // Bytes: every byte counts, and the two rules never meet.
    let bytes = br#"{"amount":10}"#;
    assert_ne!(
        of(&FingerprintBody::Bytes, bytes),
        of(&FingerprintBody::Bytes, br#"{ "amount":10}"#)
    );
    assert_ne!(of(&FingerprintBody::Bytes, bytes), of(&json, bytes));
    // Not JSON: fingerprinted by its bytes.
    assert_eq!(of(&json, b"amount=10"), of(&json, b"amount=10"));
    assert_ne!(of(&json, b"amount=10"), of(&json, b"amount=11"));
}
