//! Tokens for the `scope_jwt` tests: RS256 with the test-only RSA key in
//! `tests/fixtures`, its JWKS, and forgeries.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::rand::SystemRandom;
use ring::signature::{self, RsaKeyPair};
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

pub struct Issuer {
    key: RsaKeyPair,
}

impl Issuer {
    pub fn new() -> Issuer {
        let pem = include_bytes!("../fixtures/jwt-test-rsa-key.pem");
        let PrivateKeyDer::Pkcs8(der) = PrivateKeyDer::from_pem_slice(pem).expect("the test RSA key") else {
            panic!("the test RSA key is PKCS#8");
        };
        Issuer {
            key: RsaKeyPair::from_pkcs8(der.secret_pkcs8_der()).expect("an RSA key"),
        }
    }

    /// The JWKS that verifies this issuer's tokens.
    pub fn jwks(&self) -> String {
        let public = signature::RsaPublicKeyComponents::<Vec<u8>>::from(self.key.public());
        json!({"keys": [{"kty": "RSA", "kid": "test", "alg": "RS256", "use": "sig", "n": b64(&public.n), "e": b64(&public.e)}]})
            .to_string()
    }

    fn sign(&self, header: &Value, payload: &Value) -> String {
        let signed = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(payload.to_string().as_bytes())
        );
        let mut signature = vec![0; self.key.public().modulus_len()];
        self.key
            .sign(
                &signature::RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                signed.as_bytes(),
                &mut signature,
            )
            .expect("sign");
        format!("{signed}.{}", b64(&signature))
    }

    /// A token for `sub`, valid for ten minutes, issued now (with `jti` to make each
    /// one different, as a refreshed token is).
    pub fn token(&self, sub: &str, jti: &str) -> String {
        self.sign(&json!({"alg": "RS256", "kid": "test"}), &claims(sub, jti, 600))
    }

    /// Signed correctly, with these claims.
    pub fn token_with(&self, payload: &Value) -> String {
        self.sign(&json!({"alg": "RS256", "kid": "test"}), payload)
    }

    /// A token that names no algorithm's signature: `alg: none`.
    pub fn unsigned(&self, sub: &str) -> String {
        format!(
            "{}.{}.",
            b64(json!({"alg": "none"}).to_string().as_bytes()),
            b64(claims(sub, "none", 600).to_string().as_bytes())
        )
    }

    /// An HS256 token keyed with this issuer's public modulus: the HS/RS confusion.
    pub fn confused(&self, sub: &str) -> String {
        let public = signature::RsaPublicKeyComponents::<Vec<u8>>::from(self.key.public());
        let header = b64(json!({"alg": "HS256"}).to_string().as_bytes());
        let payload = b64(claims(sub, "confused", 600).to_string().as_bytes());
        let signed = format!("{header}.{payload}");
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &public.n);
        format!("{signed}.{}", b64(ring::hmac::sign(&key, signed.as_bytes()).as_ref()))
    }
}

/// The `iss` of every token `claims` makes.
pub const ISSUER: &str = "https://auth.example.com/";

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

pub fn claims(sub: &str, jti: &str, valid_for: i64) -> Value {
    json!({
        "sub": sub, "jti": jti, "iat": now(), "exp": now().saturating_add_signed(valid_for),
        "aud": "payments", "iss": ISSUER,
    })
}
