//! Records scoped by a verified identity (`scope_jwt`, docs/design.md §7): a client's retry
//! still replays after its token was refreshed, another identity never reads its
//! record, and a token that does not verify gets 401 with nothing forwarded or stored.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use serde_json::json;
use support::jwt::{Issuer, claims, now};
use support::{StoreKind, TestConfig, Upstream, send};

struct Setup {
    issuer: Issuer,
    upstream: Upstream,
    proxy: support::ProxyHandle,
    _jwks: tempfile::NamedTempFile,
}

async fn setup() -> Setup {
    let issuer = Issuer::new();
    let jwks = tempfile::NamedTempFile::new().expect("jwks file");
    std::fs::write(jwks.path(), issuer.jwks()).expect("write the JWKS");
    let upstream = Upstream::start().await;
    let mut config = TestConfig::new(StoreKind::Memory, &upstream.url());
    config.idempotency = format!(
        "[route.idempotency.scope_jwt]\njwks_file = \"{}\"\naudience = \"payments\"\nissuer = \"{}\"\nleeway = \"0s\"",
        jwks.path().display(),
        support::jwt::ISSUER
    );
    let proxy = config.start().await;
    Setup {
        issuer,
        upstream,
        proxy,
        _jwks: jwks,
    }
}

async fn pay(setup: &Setup, key: &str, token: &str) -> support::TestResponse {
    let bearer = format!("Bearer {token}");
    send(
        setup.proxy.addr(),
        "POST",
        "/v1/payments",
        &[("idempotency-key", key), ("authorization", &bearer)],
        "{\"amount\":10}",
    )
    .await
}

#[tokio::test]
async fn a_retry_with_a_refreshed_token_replays_and_another_identity_gets_its_own() {
    let setup = setup().await;
    let first = pay(&setup, "order-1", &setup.issuer.token("alice", "t1")).await;
    assert_eq!(first.status, 201, "{first:?}");
    // The token was refreshed between the request and its retry: same sub, new token.
    let retry = pay(&setup, "order-1", &setup.issuer.token("alice", "t2")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    // Bob, with the same key and body, is another scope: his own execution.
    let bob = pay(&setup, "order-1", &setup.issuer.token("bob", "t3")).await;
    assert_eq!(bob.status, 201);
    assert!(!bob.replayed(), "bob must never read alice's record");
    assert_ne!(bob.execution(), first.execution());
    assert_eq!(setup.upstream.executions("order-1"), 2);
}

#[tokio::test]
async fn tokens_that_do_not_verify_get_401_and_nothing_is_forwarded_or_stored() {
    let setup = setup().await;
    let issuer = &setup.issuer;
    let mut tampered = issuer.token("alice", "t");
    tampered.replace_range(tampered.len() - 8.., "AAAAAAAA");
    let other_key = {
        // Signed by a key the JWKS does not hold.
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng).expect("key");
        let key = ring::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("key");
        let b64 = |bytes: &[u8]| base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, bytes);
        let signed = format!(
            "{}.{}",
            b64(json!({"alg": "EdDSA"}).to_string().as_bytes()),
            b64(claims("alice", "x", 600).to_string().as_bytes())
        );
        format!("{signed}.{}", b64(key.sign(signed.as_bytes()).as_ref()))
    };
    let cases = [
        ("alg none", issuer.unsigned("alice")),
        ("HS/RS confusion", issuer.confused("alice")),
        ("a tampered signature", tampered),
        ("another key", other_key),
        ("expired", issuer.token_with(&claims("alice", "old", -3600))),
        (
            "no exp",
            issuer.token_with(&json!({"sub": "alice", "aud": "payments", "iss": support::jwt::ISSUER})),
        ),
        (
            "no sub",
            issuer.token_with(&json!({"exp": now() + 600, "aud": "payments", "iss": support::jwt::ISSUER})),
        ),
        (
            "another audience",
            issuer
                .token_with(&json!({"sub": "alice", "exp": now() + 600, "aud": "orders", "iss": support::jwt::ISSUER})),
        ),
        (
            "another issuer",
            issuer.token_with(
                &json!({"sub": "alice", "exp": now() + 600, "aud": "payments", "iss": "https://evil.example.com/"}),
            ),
        ),
        (
            "no iss",
            issuer.token_with(&json!({"sub": "alice", "exp": now() + 600, "aud": "payments"})),
        ),
        ("not a JWT", "garbage".to_string()),
    ];
    for (what, token) in cases {
        let response = pay(&setup, "forged", &token).await;
        assert_eq!(response.status, 401, "{what}: {response:?}");
        assert_eq!(response.problem(), "unverified-scope", "{what}");
        assert_eq!(
            response.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\""),
            "{what}"
        );
    }
    let missing = send(
        setup.proxy.addr(),
        "POST",
        "/v1/payments",
        &[("idempotency-key", "forged")],
        "{}",
    )
    .await;
    assert_eq!(
        (missing.status.as_u16(), missing.header("www-authenticate")),
        (401, Some("Bearer"))
    );
    assert_eq!(
        setup.upstream.total(),
        0,
        "a request with an unverified token was forwarded"
    );
    match setup.proxy.running.store().engine() {
        idemproxy::store::Engine::Memory(store) => assert!(store.is_empty(), "an unverified request was stored"),
        _ => unreachable!("a memory proxy"),
    }
    // Reads on the route are not guarded, so not checked either.
    assert_eq!(
        send(setup.proxy.addr(), "GET", "/v1/payments/1", &[], "").await.status,
        201
    );
}

/// The scope carries the claim's JSON type: `123` and `"123"` are two identities, so a
/// token whose `sub` is the number never reads the record of one whose `sub` is the
/// string. And a NumericDate is any JSON number: an `exp` with a fraction is honoured.
#[tokio::test]
async fn a_numeric_claim_is_its_own_scope_and_fractional_dates_verify() {
    let setup = setup().await;
    let issued = |sub: serde_json::Value, exp: serde_json::Value| {
        setup
            .issuer
            .token_with(&json!({"sub": sub, "exp": exp, "aud": "payments", "iss": support::jwt::ISSUER}))
    };
    let later = now() + 600;
    let number = pay(&setup, "typed-1", &issued(json!(123), json!(later))).await;
    assert_eq!(number.status, 201, "{number:?}");
    let string = pay(&setup, "typed-1", &issued(json!("123"), json!(later))).await;
    assert_eq!(string.status, 201, "{string:?}");
    assert!(!string.replayed(), "the string 123 read the number 123's record");
    assert_eq!(setup.upstream.executions("typed-1"), 2);
    // Each replays its own.
    let again = pay(&setup, "typed-1", &issued(json!(123), json!(later as f64 + 0.5))).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.execution(), number.execution());
    let expired = pay(&setup, "typed-2", &issued(json!("alice"), json!(now() as f64 - 0.5))).await;
    assert_eq!(
        (expired.status.as_u16(), expired.problem()),
        (401, "unverified-scope".into())
    );
}
