use super::*;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair};
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use serde_json::json;

const NOW: u64 = 1_800_000_000;

fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(NOW)
}

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// `header.payload` and the signing function's signature over it.
fn token(header: &Value, payload: &Value, sign: impl FnOnce(&[u8]) -> Vec<u8>) -> String {
    let signed = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(payload.to_string().as_bytes())
    );
    let signature = sign(signed.as_bytes());
    format!("{signed}.{}", b64(&signature))
}

fn claims() -> Value {
    json!({"sub": "alice", "exp": NOW + 600, "iss": "https://auth.example.com/", "aud": "payments"})
}

fn headers(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).expect("value"),
    );
    headers
}

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

fn hs256(secret: &[u8]) -> impl FnOnce(&[u8]) -> Vec<u8> {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    move |message| hmac::sign(&key, message).as_ref().to_vec()
}

fn secret_verifier() -> JwtVerifier {
    JwtVerifier::new(
        HeaderName::from_static("authorization"),
        "sub".into(),
        KeySource::Secret(SECRET.to_vec()),
        Some("https://auth.example.com/".into()),
        Some("payments".into()),
        Duration::from_secs(30),
    )
    .expect("verifier")
}

struct Signers {
    rsa: RsaKeyPair,
    ec: EcdsaKeyPair,
    ed: Ed25519KeyPair,
}

fn signers() -> Signers {
    let rng = SystemRandom::new();
    let pem = include_bytes!("../../tests/fixtures/jwt-test-rsa-key.pem");
    let PrivateKeyDer::Pkcs8(rsa) = PrivateKeyDer::from_pem_slice(pem).expect("the test RSA key") else {
        panic!("the test RSA key is PKCS#8");
    };
    let ec = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, &rng).expect("ec");
    let ed = Ed25519KeyPair::generate_pkcs8(&rng).expect("ed25519");
    Signers {
        rsa: RsaKeyPair::from_pkcs8(rsa.secret_pkcs8_der()).expect("rsa"),
        ec: EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, ec.as_ref(), &rng).expect("ec"),
        ed: Ed25519KeyPair::from_pkcs8(ed.as_ref()).expect("ed25519"),
    }
}

impl Signers {
    fn jwks(&self) -> String {
        let rsa = signature::RsaPublicKeyComponents::<Vec<u8>>::from(self.rsa.public());
        let point = self.ec.public_key().as_ref();
        json!({"keys": [
            {"kty": "RSA", "kid": "rsa-1", "use": "sig", "alg": "RS256", "n": b64(&rsa.n), "e": b64(&rsa.e)},
            {"kty": "EC", "kid": "ec-1", "crv": "P-256", "x": b64(&point[1..33]), "y": b64(&point[33..65])},
            {"kty": "OKP", "kid": "ed-1", "crv": "Ed25519", "x": b64(self.ed.public_key().as_ref())},
            {"kty": "RSA", "kid": "enc", "use": "enc", "n": b64(&rsa.n), "e": b64(&rsa.e)},
            {"kty": "EC", "crv": "P-384", "x": "AA", "y": "AA"}
        ]})
        .to_string()
    }

    fn verifier(&self) -> JwtVerifier {
        JwtVerifier::new(
            HeaderName::from_static("authorization"),
            "sub".into(),
            KeySource::Jwks(self.jwks()),
            None,
            None,
            Duration::ZERO,
        )
        .expect("verifier")
    }

    fn rs256(&self) -> impl FnOnce(&[u8]) -> Vec<u8> + '_ {
        |message| {
            let mut signature = vec![0; self.rsa.public().modulus_len()];
            self.rsa
                .sign(
                    &signature::RSA_PKCS1_SHA256,
                    &SystemRandom::new(),
                    message,
                    &mut signature,
                )
                .expect("sign");
            signature
        }
    }

    fn es256(&self) -> impl FnOnce(&[u8]) -> Vec<u8> + '_ {
        |message| {
            self.ec
                .sign(&SystemRandom::new(), message)
                .expect("sign")
                .as_ref()
                .to_vec()
        }
    }

    fn eddsa(&self) -> impl FnOnce(&[u8]) -> Vec<u8> + '_ {
        |message| self.ed.sign(message).as_ref().to_vec()
    }
}

#[test]
fn hs256_tokens_verify_with_their_secret_and_nothing_else() {
    let verifier = secret_verifier();
    let good = token(&json!({"alg": "HS256", "typ": "JWT"}), &claims(), hs256(SECRET));
    assert_eq!(verifier.verify(&headers(&good), now()), Ok(ScopeClaim::from("alice")));
    let forged = token(
        &json!({"alg": "HS256"}),
        &claims(),
        hs256(b"another secret, also 32 bytes lo"),
    );
    assert_eq!(verifier.verify(&headers(&forged), now()), Err(JwtError::Signature));
    let none = format!(
        "{}.{}.",
        b64(br#"{"alg":"none"}"#),
        b64(claims().to_string().as_bytes())
    );
    assert_eq!(verifier.verify(&headers(&none), now()), Err(JwtError::Algorithm));
    // A payload changed after signing.
    let (signed, signature) = good.rsplit_once('.').expect("three parts");
    let (header, _) = signed.split_once('.').expect("parts");
    let mut other = claims();
    other["sub"] = json!("mallory");
    let tampered = format!("{header}.{}.{signature}", b64(other.to_string().as_bytes()));
    assert_eq!(verifier.verify(&headers(&tampered), now()), Err(JwtError::Signature));
}

#[test]
fn the_time_issuer_audience_and_claim_rules() {
    let verifier = secret_verifier();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut payload = claims();
        change(&mut payload);
        verifier.verify(
            &headers(&token(&json!({"alg": "HS256"}), &payload, hs256(SECRET))),
            now(),
        )
    };
    assert_eq!(with(&|p| p["exp"] = json!(NOW - 31)), Err(JwtError::Expired));
    assert_eq!(
        with(&|p| p["exp"] = json!(NOW - 29)),
        Ok("alice".into()),
        "within the leeway"
    );
    assert_eq!(
        with(&|p| p.as_object_mut().map(|o| o.remove("exp")).map_or((), |_| ())),
        Err(JwtError::Expired)
    );
    assert_eq!(with(&|p| p["exp"] = json!("soon")), Err(JwtError::Malformed));
    assert_eq!(with(&|p| p["nbf"] = json!(NOW + 60)), Err(JwtError::NotYetValid));
    assert_eq!(with(&|p| p["nbf"] = json!(NOW - 60)), Ok("alice".into()));
    assert_eq!(
        with(&|p| p["iss"] = json!("https://evil.example.com/")),
        Err(JwtError::Issuer)
    );
    assert_eq!(with(&|p| p["aud"] = json!("orders")), Err(JwtError::Audience));
    assert_eq!(with(&|p| p["aud"] = json!(["orders", "payments"])), Ok("alice".into()));
    assert_eq!(
        with(&|p| p.as_object_mut().map(|o| o.remove("sub")).map_or((), |_| ())),
        Err(JwtError::Claim)
    );
    assert_eq!(with(&|p| p["sub"] = json!("")), Err(JwtError::Claim));
    assert_eq!(with(&|p| p["sub"] = json!(42)), Ok(ScopeClaim::Number("42".into())));
    assert_ne!(with(&|p| p["sub"] = json!(42)), with(&|p| p["sub"] = json!("42")));
    // NumericDate is any JSON number (RFC 7519 §2).
    assert_eq!(with(&|p| p["exp"] = json!(NOW as f64 + 0.5)), Ok("alice".into()));
    assert_eq!(with(&|p| p["exp"] = json!(NOW as f64 - 31.5)), Err(JwtError::Expired));
    assert_eq!(with(&|p| p["nbf"] = json!(NOW as f64 - 0.25)), Ok("alice".into()));
    assert_eq!(
        with(&|p| p["nbf"] = json!(NOW as f64 + 60.5)),
        Err(JwtError::NotYetValid)
    );
    assert_eq!(with(&|p| p["iat"] = json!(NOW as f64 - 1.5)), Ok("alice".into()));
}

#[test]
fn jwks_keys_verify_their_own_algorithm_only() {
    let signers = signers();
    let verifier = signers.verifier();
    for (alg, kid, token) in [
        (
            "RS256",
            "rsa-1",
            token(&json!({"alg": "RS256", "kid": "rsa-1"}), &claims(), signers.rs256()),
        ),
        (
            "ES256",
            "ec-1",
            token(&json!({"alg": "ES256", "kid": "ec-1"}), &claims(), signers.es256()),
        ),
        (
            "EdDSA",
            "ed-1",
            token(&json!({"alg": "EdDSA"}), &claims(), signers.eddsa()),
        ),
    ] {
        assert_eq!(
            verifier.verify(&headers(&token), now()),
            Ok("alice".into()),
            "{alg} {kid}"
        );
    }
    // HS/RS confusion: an HS256 token keyed with the RSA public key is never accepted.
    let rsa = signature::RsaPublicKeyComponents::<Vec<u8>>::from(signers.rsa.public());
    let confused = token(&json!({"alg": "HS256"}), &claims(), hs256(&rsa.n));
    assert_eq!(verifier.verify(&headers(&confused), now()), Err(JwtError::Algorithm));
    // A signature by one key presented as another's algorithm, or another's kid.
    let es_as_rs = token(&json!({"alg": "RS256"}), &claims(), signers.es256());
    assert_eq!(verifier.verify(&headers(&es_as_rs), now()), Err(JwtError::Signature));
    let wrong_kid = token(&json!({"alg": "RS256", "kid": "enc"}), &claims(), signers.rs256());
    assert_eq!(
        verifier.verify(&headers(&wrong_kid), now()),
        Err(JwtError::Algorithm),
        "an encryption key never verifies"
    );
    let unknown = token(&json!({"alg": "RS384"}), &claims(), signers.rs256());
    assert_eq!(verifier.verify(&headers(&unknown), now()), Err(JwtError::Algorithm));
    let critical = token(&json!({"alg": "RS256", "crit": ["exp"]}), &claims(), signers.rs256());
    assert_eq!(verifier.verify(&headers(&critical), now()), Err(JwtError::Algorithm));
}

#[test]
fn malformed_or_missing_tokens_are_refused() {
    let verifier = secret_verifier();
    let good = token(&json!({"alg": "HS256"}), &claims(), hs256(SECRET));
    assert_eq!(verifier.verify(&HeaderMap::new(), now()), Err(JwtError::Missing));
    let mut lower = HeaderMap::new();
    lower.insert(
        "authorization",
        HeaderValue::from_str(&format!("bearer {good}")).expect("value"),
    );
    assert_eq!(
        verifier.verify(&lower, now()),
        Ok("alice".into()),
        "the scheme is case-insensitive"
    );
    let mut basic = HeaderMap::new();
    basic.insert("authorization", HeaderValue::from_static("Basic YWxpY2U6c2VjcmV0"));
    assert_eq!(verifier.verify(&basic, now()), Err(JwtError::Missing));
    let mut twice = headers(&good);
    twice.append(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {good}")).expect("value"),
    );
    assert_eq!(verifier.verify(&twice, now()), Err(JwtError::Malformed));
    for broken in [
        "a.b",
        "a.b.c.d",
        "!!!.e30.",
        "e30.e30.!!!",
        "W10.e30.",
        &format!("{good}x"),
    ] {
        let result = verifier.verify(&headers(broken), now());
        assert!(
            matches!(result, Err(JwtError::Malformed | JwtError::Signature)),
            "{broken}: {result:?}"
        );
    }
}

#[test]
fn verifiers_refuse_weak_secrets_and_useless_jwks() {
    let make = |keys: KeySource| {
        JwtVerifier::new(
            HeaderName::from_static("authorization"),
            "sub".into(),
            keys,
            None,
            None,
            Duration::ZERO,
        )
    };
    assert!(make(KeySource::Secret(b"short".to_vec())).is_err());
    assert!(make(KeySource::Jwks("not json".into())).is_err());
    assert!(make(KeySource::Jwks(r#"{"keys": []}"#.into())).is_err());
    assert!(make(KeySource::Jwks(r#"{"keys": [{"kty": "oct", "k": "AAAA"}]}"#.into())).is_err());
}

/// ring refuses RS256 with a modulus under 2048 bits, so such a key in a JWKS would
/// make every token signed with it a 401: the verifier (and so `check` and reload)
/// refuses it, naming its kid.
#[test]
fn an_rsa_key_under_2048_bits_is_refused_by_its_kid() {
    let jwks = |bytes: usize, top: u8| {
        let mut n = vec![0xab; bytes];
        n[0] = top;
        json!({"keys": [{"kty": "RSA", "kid": "weak-1", "n": b64(&n), "e": "AQAB"}]}).to_string()
    };
    let make = |text: String| {
        JwtVerifier::new(
            HeaderName::from_static("authorization"),
            "sub".into(),
            KeySource::Jwks(text),
            None,
            None,
            Duration::ZERO,
        )
    };
    let error = make(jwks(128, 0xc0)).expect_err("a 1024-bit key").to_string();
    assert!(error.contains("\"weak-1\"") && error.contains("1024-bit"), "{error}");
    // A leading zero byte does not count; 2047 bits is still short, 2048 is enough.
    let mut padded = vec![0u8];
    padded.extend(vec![0xff; 256]);
    assert_eq!(modulus_bits(&padded), 2048);
    assert!(make(jwks(256, 0x7f)).is_err(), "2047 bits");
    assert!(make(jwks(256, 0x80)).is_ok(), "2048 bits");
}
