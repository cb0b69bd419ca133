//! The JSON Web Token verifier behind `scope_jwt`: a token's signature, expiry,
//! issuer and audience are checked here, and the claim that scopes a record is read
//! from it (the scope itself is `scope`'s). It owns its keys, read once from a JWKS
//! document or an HS256 secret; it does no I/O.
//!
//! JWTs are verified on ring, the project's one crypto library (no maintained JWT crate
//! runs on it): HS256 with a secret, or RS256, ES256 and EdDSA with the keys of a JWKS
//! file. The algorithm a token names must be the one its key is for (a JWKS verifier
//! never accepts HS256, so a public key cannot be used as an HMAC secret), `none` is
//! never accepted, and a token without `exp` is refused.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use ring::{hmac, signature};
use serde_json::Value;

/// Why a token does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    #[error("the request carries no bearer token")]
    Missing,
    #[error("the token is not a well-formed JWT")]
    Malformed,
    #[error("the token's algorithm is not accepted here")]
    Algorithm,
    #[error("the token's signature does not verify")]
    Signature,
    #[error("the token has expired or carries no expiry")]
    Expired,
    #[error("the token is not valid yet")]
    NotYetValid,
    #[error("the token's issuer is not the expected one")]
    Issuer,
    #[error("the token's audience is not the expected one")]
    Audience,
    #[error("the token lacks the scope claim")]
    Claim,
}

/// Why a JWT verifier cannot be built from its keys: the sentence `check` prints.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct KeysError(String);

/// The keys a token may be signed with.
#[derive(Clone)]
enum Keys {
    Hs256(hmac::Key),
    Jwks(Vec<Jwk>),
}

/// One public key of a JWKS.
#[derive(Clone, Debug)]
struct Jwk {
    kid: Option<String>,
    key: PublicKey,
}

#[derive(Clone, Debug)]
enum PublicKey {
    Rs256(signature::RsaPublicKeyComponents<Vec<u8>>),
    /// An uncompressed P-256 point.
    Es256(Vec<u8>),
    Ed25519(Vec<u8>),
}

impl PublicKey {
    fn alg(&self) -> &'static str {
        match self {
            PublicKey::Rs256(_) => "RS256",
            PublicKey::Es256(_) => "ES256",
            PublicKey::Ed25519(_) => "EdDSA",
        }
    }

    fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        match self {
            PublicKey::Rs256(components) => components
                .verify(&signature::RSA_PKCS1_2048_8192_SHA256, message, signature)
                .is_ok(),
            PublicKey::Es256(point) => signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, point)
                .verify(message, signature)
                .is_ok(),
            PublicKey::Ed25519(key) => signature::UnparsedPublicKey::new(&signature::ED25519, key)
                .verify(message, signature)
                .is_ok(),
        }
    }
}

/// Verifies the bearer token of a request and reads the claim that scopes its records.
#[derive(Clone)]
pub struct JwtVerifier {
    header: HeaderName,
    /// The name of the claim whose value scopes the records.
    scope_claim: String,
    keys: Keys,
    issuer: Option<String>,
    audience: Option<String>,
    leeway: Duration,
}

impl JwtVerifier {
    /// The name of the claim that scopes the records (`sub` unless configured).
    pub fn scope_claim(&self) -> &str {
        &self.scope_claim
    }
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = match &self.keys {
            Keys::Hs256(_) => "HS256 secret".to_string(),
            Keys::Jwks(keys) => format!("{} JWKS key(s)", keys.len()),
        };
        f.debug_struct("JwtVerifier")
            .field("header", &self.header)
            .field("scope_claim", &self.scope_claim)
            .field("keys", &keys)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .finish()
    }
}

/// A verifier's keys, as read from the config: a JWKS document or an HS256 secret.
pub enum KeySource {
    /// A JWKS document (`{"keys": [...]}`), as read from a file.
    Jwks(String),
    /// An HS256 secret.
    Secret(Vec<u8>),
}

impl JwtVerifier {
    pub fn new(
        header: HeaderName,
        scope_claim: String,
        keys: KeySource,
        issuer: Option<String>,
        audience: Option<String>,
        leeway: Duration,
    ) -> Result<JwtVerifier, KeysError> {
        let keys = match keys {
            KeySource::Secret(secret) if secret.len() < 32 => {
                return Err(KeysError(
                    "an HS256 secret must be at least 32 bytes (RFC 7518 §3.2)".into(),
                ));
            }
            KeySource::Secret(secret) => Keys::Hs256(hmac::Key::new(hmac::HMAC_SHA256, &secret)),
            KeySource::Jwks(text) => Keys::Jwks(parse_jwks(&text)?),
        };
        Ok(JwtVerifier {
            header,
            scope_claim,
            keys,
            issuer,
            audience,
            leeway,
        })
    }

    /// A short description for `idemproxy check`.
    pub fn describe(&self) -> String {
        let keys = match &self.keys {
            Keys::Hs256(_) => "an HS256 secret".to_string(),
            Keys::Jwks(keys) => {
                let algs: Vec<&str> = keys.iter().map(|jwk| jwk.key.alg()).collect();
                format!("{} JWKS key(s) ({})", keys.len(), algs.join(", "))
            }
        };
        format!(
            "claim {:?} of the bearer token in {}, verified with {keys}",
            self.scope_claim, self.header
        )
    }

    /// The scope claim of the request's token, once the token verifies at `now`.
    pub fn verify(&self, headers: &HeaderMap, now: SystemTime) -> Result<ScopeClaim, JwtError> {
        let mut values = headers.get_all(&self.header).iter();
        let value = values.next().ok_or(JwtError::Missing)?;
        if values.next().is_some() {
            return Err(JwtError::Malformed);
        }
        let token = bearer(value).ok_or(JwtError::Missing)?;
        let mut parts = token.split('.');
        let (Some(header_b64), Some(payload_b64), Some(signature_b64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(JwtError::Malformed);
        };
        let header: Value = decode_json(header_b64)?;
        let payload: Value = decode_json(payload_b64)?;
        let signature = URL_SAFE_NO_PAD.decode(signature_b64).map_err(|_| JwtError::Malformed)?;
        // What was signed: the two encoded parts and the dot between them.
        let signed = token
            .as_bytes()
            .get(..header_b64.len() + 1 + payload_b64.len())
            .ok_or(JwtError::Malformed)?;
        if header.get("crit").is_some() {
            // Extensions this verifier does not know must not be ignored (RFC 7515 §4.1.11).
            return Err(JwtError::Algorithm);
        }
        let alg = header.get("alg").and_then(Value::as_str).ok_or(JwtError::Malformed)?;
        self.verify_signature(alg, header.get("kid").and_then(Value::as_str), signed, &signature)?;
        self.check_claims(&payload, now)
    }

    fn verify_signature(&self, alg: &str, kid: Option<&str>, signed: &[u8], signature: &[u8]) -> Result<(), JwtError> {
        match &self.keys {
            Keys::Hs256(key) => {
                if alg != "HS256" {
                    return Err(JwtError::Algorithm);
                }
                hmac::verify(key, signed, signature).map_err(|_| JwtError::Signature)
            }
            Keys::Jwks(keys) => {
                if !matches!(alg, "RS256" | "ES256" | "EdDSA") {
                    return Err(JwtError::Algorithm);
                }
                let mut candidates = keys
                    .iter()
                    .filter(|jwk| jwk.key.alg() == alg)
                    .filter(|jwk| kid.is_none() || jwk.kid.as_deref() == kid)
                    .peekable();
                if candidates.peek().is_none() {
                    return Err(JwtError::Algorithm);
                }
                if candidates.any(|jwk| jwk.key.verifies(signed, signature)) {
                    Ok(())
                } else {
                    Err(JwtError::Signature)
                }
            }
        }
    }

    fn check_claims(&self, payload: &Value, now: SystemTime) -> Result<ScopeClaim, JwtError> {
        let now = now.duration_since(UNIX_EPOCH).map_or(0.0, |since| since.as_secs_f64());
        let leeway = self.leeway.as_secs_f64();
        // A NumericDate is any JSON number of seconds (RFC 7519 §2), fractions included.
        let time = |name: &str| {
            payload.get(name).map(|value| {
                value
                    .as_f64()
                    .filter(|seconds| seconds.is_finite())
                    .ok_or(JwtError::Malformed)
            })
        };
        let exp = time("exp").ok_or(JwtError::Expired)??;
        if now >= exp + leeway {
            return Err(JwtError::Expired);
        }
        if let Some(nbf) = time("nbf")
            && now + leeway < nbf?
        {
            return Err(JwtError::NotYetValid);
        }
        if let Some(issuer) = &self.issuer
            && payload.get("iss").and_then(Value::as_str) != Some(issuer.as_str())
        {
            return Err(JwtError::Issuer);
        }
        if let Some(audience) = &self.audience {
            let matches = match payload.get("aud") {
                Some(Value::String(aud)) => aud == audience,
                Some(Value::Array(auds)) => auds.iter().any(|aud| aud.as_str() == Some(audience.as_str())),
                _ => false,
            };
            if !matches {
                return Err(JwtError::Audience);
            }
        }
        match payload.get(&self.scope_claim) {
            Some(Value::String(value)) if !value.is_empty() => Ok(ScopeClaim::String(value.clone())),
            Some(Value::Number(value)) => Ok(ScopeClaim::Number(value.to_string())),
            _ => Err(JwtError::Claim),
        }
    }
}

/// The verified claim that scopes a record, with its JSON type: the number `123` and
/// the string `"123"` name two scopes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeClaim {
    String(String),
    /// A JSON number, as serde_json writes it back.
    Number(String),
}

impl From<&str> for ScopeClaim {
    fn from(value: &str) -> ScopeClaim {
        ScopeClaim::String(value.to_string())
    }
}

impl From<String> for ScopeClaim {
    fn from(value: String) -> ScopeClaim {
        ScopeClaim::String(value)
    }
}

/// The token of a `Bearer` credential (the scheme in any case, RFC 9110 §11.1).
pub(crate) fn bearer(value: &HeaderValue) -> Option<&str> {
    let value = value.to_str().ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn decode_json(part: &str) -> Result<Value, JwtError> {
    let bytes = URL_SAFE_NO_PAD.decode(part).map_err(|_| JwtError::Malformed)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|_| JwtError::Malformed)?;
    if value.is_object() {
        Ok(value)
    } else {
        Err(JwtError::Malformed)
    }
}

/// The bit length of a big-endian modulus, leading zero bytes and bits left out.
fn modulus_bits(n: &[u8]) -> usize {
    let significant = n
        .iter()
        .position(|byte| *byte != 0)
        .map_or(&[][..], |first| &n[first..]);
    significant.first().map_or(0, |top| {
        (significant.len() - 1) * 8 + (8 - usize::try_from(top.leading_zeros()).unwrap_or(8))
    })
}

/// The signing keys of a JWKS: RSA (RS256), EC P-256 (ES256) and OKP Ed25519 (EdDSA);
/// keys for encryption, or of other types and curves, are left out.
fn parse_jwks(text: &str) -> Result<Vec<Jwk>, KeysError> {
    let document: Value = serde_json::from_str(text).map_err(|error| KeysError(format!("not JSON: {error}")))?;
    let keys = document
        .get("keys")
        .and_then(Value::as_array)
        .ok_or_else(|| KeysError("no \"keys\" array".into()))?;
    let field = |key: &Value, name: &str| -> Option<Vec<u8>> { URL_SAFE_NO_PAD.decode(key.get(name)?.as_str()?).ok() };
    let mut usable = Vec::new();
    for key in keys {
        if key
            .get("use")
            .and_then(Value::as_str)
            .is_some_and(|usage| usage != "sig")
        {
            continue;
        }
        let kty = key.get("kty").and_then(Value::as_str);
        let crv = key.get("crv").and_then(Value::as_str);
        let public = match (kty, crv) {
            (Some("RSA"), _) => match (field(key, "n"), field(key, "e")) {
                (Some(n), Some(e)) => {
                    // ring refuses to verify with a shorter key: every token signed
                    // with it would be a 401, so the config is refused instead.
                    let bits = modulus_bits(&n);
                    if bits < 2048 {
                        let kid = key.get("kid").and_then(Value::as_str).unwrap_or("(no kid)");
                        return Err(KeysError(format!(
                            "the RSA key {kid:?} has a {bits}-bit modulus; RS256 needs at least 2048 bits"
                        )));
                    }
                    Some(PublicKey::Rs256(signature::RsaPublicKeyComponents { n, e }))
                }
                _ => None,
            },
            (Some("EC"), Some("P-256")) => match (field(key, "x"), field(key, "y")) {
                (Some(x), Some(y)) if x.len() == 32 && y.len() == 32 => {
                    let mut point = Vec::with_capacity(65);
                    point.push(0x04);
                    point.extend_from_slice(&x);
                    point.extend_from_slice(&y);
                    Some(PublicKey::Es256(point))
                }
                _ => None,
            },
            (Some("OKP"), Some("Ed25519")) => field(key, "x").filter(|x| x.len() == 32).map(PublicKey::Ed25519),
            _ => None,
        };
        let Some(public) = public else { continue };
        // A key that names its algorithm must name the one it is used for here.
        if key
            .get("alg")
            .and_then(Value::as_str)
            .is_some_and(|alg| alg != public.alg())
        {
            continue;
        }
        usable.push(Jwk {
            kid: key.get("kid").and_then(Value::as_str).map(str::to_string),
            key: public,
        });
    }
    if usable.is_empty() {
        return Err(KeysError(
            "no usable signing key (RSA for RS256, EC P-256 for ES256, OKP Ed25519 for EdDSA)".into(),
        ));
    }
    Ok(usable)
}

#[cfg(test)]
mod tests;
