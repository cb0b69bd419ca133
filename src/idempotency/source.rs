//! Finding a request's key in its route's sources (docs/design.md §23): a header, a
//! JSON value (one pointer, or several as one key), a form field or a query
//! parameter; the first source the request carries wins, and its value is validated
//! as a header's is. Pure: the body has been read by the caller.

use http::HeaderMap;
use http::header::CONTENT_TYPE;

use super::{IdempotencyKey, MAX_KEY_LEN, parse_key};
use crate::canonical_json::{self, Found};
use crate::config::KeySource;
use crate::config::key::describe;
use crate::error::{KeyError, Rejection, SourceError};
use crate::store::Fingerprint;

/// What a request offers its key sources: its headers, its query, and its body once
/// read (`None` on a route whose sources never read it).
pub struct KeyInput<'a> {
    pub headers: &'a HeaderMap,
    pub query: Option<&'a str>,
    pub body: Option<&'a [u8]>,
}

/// Where a request's key came from.
#[derive(Debug, PartialEq, Eq)]
pub enum Keyed {
    /// A key the request carries.
    Key(IdempotencyKey),
    /// The `body` source: the request itself is its key (see `body_key`).
    Body,
}

/// The key from the first of `sources` that `input` carries, or `None` when it
/// carries none (the caller knows whether that is allowed: `missing`).
///
/// A route whose one source is a header answers as it always has: a bad value is a
/// plain `KeyError`. With other sources, the error names the source (never the value),
/// and a body that is not JSON on a route whose every source is `json:` is refused.
pub(crate) fn find_key(sources: &[KeySource], input: &KeyInput<'_>) -> Result<Option<Keyed>, Rejection> {
    let one_header = matches!(sources, [KeySource::Header(_)]);
    let mut not_json = false;
    for source in sources {
        let value = match source {
            KeySource::Header(name) => parse_key(input.headers.get_all(name)).transpose(),
            KeySource::Json(pointers) => match input.body.filter(|body| !body.is_empty()) {
                None => None,
                Some(body) => match canonical_json::find(body, pointers) {
                    None => {
                        not_json = true;
                        None
                    }
                    Some(found) => composite(found),
                },
            },
            KeySource::Form(name) => input
                .body
                .filter(|_| is_form(input.headers))
                .and_then(|body| field(body, name)),
            KeySource::Query(name) => input.query.and_then(|query| field(query.as_bytes(), name)),
            KeySource::Body => return Ok(Some(Keyed::Body)),
        };
        match value {
            None => continue,
            Some(Ok(key)) => return Ok(Some(Keyed::Key(key))),
            Some(Err(error)) if one_header => return Err(error.into()),
            Some(Err(error)) => {
                let from = source.to_string();
                return Err(SourceError::Invalid { from, error }.into());
            }
        }
    }
    if not_json && sources.iter().all(|source| matches!(source, KeySource::Json(_))) {
        return Err(SourceError::NotJson {
            sources: describe(sources),
        }
        .into());
    }
    Ok(None)
}

/// The refusal of a request that carries no key on a route that requires one.
pub(crate) fn missing(sources: &[KeySource]) -> Rejection {
    match sources {
        [KeySource::Header(_)] => KeyError::Missing.into(),
        _ => SourceError::Missing {
            sources: describe(sources),
        }
        .into(),
    }
}

/// The key of a request on the `body` source: its fingerprint (method, canonical path
/// and query, the fingerprinted headers and the body as `fingerprint_body` reads it), so that two
/// identical requests name one record in one scope.
pub fn body_key(fingerprint: Fingerprint) -> IdempotencyKey {
    IdempotencyKey(format!("body:{}", fingerprint.to_hex()))
}

/// The key a JSON source's values make: one value alone (a string as it is, another
/// value in canonical form), or the canonical JSON array of several. `None` unless
/// every value is present.
fn composite(found: Vec<Option<Found>>) -> Option<Result<IdempotencyKey, KeyError>> {
    let mut parts = found.into_iter().collect::<Option<Vec<Found>>>()?;
    if parts.len() == 1 {
        return Some(match parts.pop()? {
            Found::String(text) => plain_key(text.as_bytes()),
            Found::Other(bytes) => plain_key(&bytes),
        });
    }
    let mut key = vec![b'['];
    for (index, part) in parts.into_iter().enumerate() {
        if index > 0 {
            key.push(b',');
        }
        match part {
            Found::String(text) => key.extend_from_slice(&canonical_json::quoted(&text)),
            Found::Other(bytes) => key.extend_from_slice(&bytes),
        }
    }
    key.push(b']');
    Some(plain_key(&key))
}

/// A key taken as it is: 1 to 255 visible ASCII characters.
fn plain_key(bytes: &[u8]) -> Result<IdempotencyKey, KeyError> {
    if bytes.is_empty() {
        return Err(KeyError::Empty);
    }
    if bytes.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    match std::str::from_utf8(bytes) {
        Ok(text) if bytes.iter().all(|byte| (0x21..=0x7e).contains(byte)) => Ok(IdempotencyKey(text.to_string())),
        _ => Err(KeyError::NotVisibleAscii),
    }
}

/// The one value of `name` in URL-encoded `pairs`; a name given twice is refused, as a
/// repeated header is.
fn field(pairs: &[u8], name: &str) -> Option<Result<IdempotencyKey, KeyError>> {
    let mut values = form_urlencoded::parse(pairs).filter(|(field, _)| field == name);
    let (_, value) = values.next()?;
    if values.next().is_some() {
        return Some(Err(KeyError::Repeated));
    }
    Some(plain_key(value.as_bytes()))
}

/// Whether the body is a form (`application/x-www-form-urlencoded`, any parameters).
fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/x-www-form-urlencoded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(list: &[&str]) -> Vec<KeySource> {
        list.iter()
            .map(|text| KeySource::parse(text).expect("a source"))
            .collect()
    }

    fn key(
        sources: &[KeySource],
        headers: &[(&str, &str)],
        query: Option<&str>,
        body: &[u8],
    ) -> Result<Option<String>, String> {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).expect("a name"),
                value.parse().expect("a value"),
            );
        }
        let input = KeyInput {
            headers: &map,
            query,
            body: Some(body),
        };
        match find_key(sources, &input) {
            Ok(Some(Keyed::Key(key))) => Ok(Some(key.as_str().to_string())),
            Ok(Some(Keyed::Body)) => Ok(Some("<body>".into())),
            Ok(None) => Ok(None),
            Err(rejection) => Err(rejection.to_string()),
        }
    }

    #[test]
    fn the_first_source_present_wins_and_each_value_is_validated() {
        let all = sources(&["header:Idempotency-Key", "json:/ref", "form:ref", "query:ref"]);
        let form = [("content-type", "application/x-www-form-urlencoded; charset=utf-8")];
        assert_eq!(
            key(&all, &[("idempotency-key", "h")], Some("ref=q"), br#"{"ref":"j"}"#),
            Ok(Some("h".into()))
        );
        assert_eq!(key(&all, &[], Some("ref=q"), br#"{"ref":"j"}"#), Ok(Some("j".into())));
        assert_eq!(key(&all, &form, Some("ref=q"), b"a=1&ref=f%21"), Ok(Some("f!".into())));
        assert_eq!(key(&all, &[], Some("x=1&ref=q"), b""), Ok(Some("q".into())));
        assert_eq!(
            key(&all, &[], None, b"ref=f"),
            Ok(None),
            "a form needs its content type"
        );
        assert_eq!(
            key(&all, &[], Some("ref=a&ref=b"), b"").map_err(|e| e.contains("query:ref")),
            Err(true)
        );
        let long = format!(r#"{{"ref":"{}"}}"#, "r".repeat(256));
        let refused = key(&all, &[], None, long.as_bytes()).expect_err("too long");
        assert!(refused.contains("json:/ref") && refused.contains("255"), "{refused}");
        assert!(!refused.contains("rrrr"), "the value is never named: {refused}");
        assert_eq!(key(&all, &[], None, br#"{"ref":12345}"#), Ok(Some("12345e0".into())));
        assert!(
            key(&all, &[], None, br#"{"ref":"a b"}"#).is_err(),
            "a space is not visible ASCII"
        );
    }

    #[test]
    fn a_composite_needs_every_part_and_json_only_routes_refuse_other_bodies() {
        let composite = sources(&["json:/tenant&/order"]);
        assert_eq!(
            key(&composite, &[], None, br#"{"order":7,"tenant":"t-1"}"#),
            Ok(Some(r#"["t-1",7e0]"#.into()))
        );
        assert_eq!(key(&composite, &[], None, br#"{"tenant":"t-1"}"#), Ok(None));
        let refused = key(&composite, &[], None, b"{broken").expect_err("not JSON");
        assert!(refused.contains("not JSON"), "{refused}");
        assert_eq!(key(&composite, &[], None, b""), Ok(None), "no body is no key");
        let mixed = sources(&["json:/ref", "query:ref"]);
        assert_eq!(key(&mixed, &[], None, b"{broken"), Ok(None));
        assert_eq!(
            key(&sources(&["json:/ref", "body"]), &[], None, b"{}"),
            Ok(Some("<body>".into()))
        );
    }

    #[test]
    fn one_header_answers_as_it_always_has() {
        let one = sources(&["header:Idempotency-Key"]);
        assert_eq!(missing(&one).to_string(), KeyError::Missing.to_string());
        assert_eq!(
            key(&one, &[("idempotency-key", "")], None, b""),
            Err(KeyError::Empty.to_string())
        );
        let two = sources(&["header:Idempotency-Key", "json:/ref"]);
        let text = missing(&two).to_string();
        assert!(text.contains("header:idempotency-key, json:/ref"), "{text}");
    }

    /// A key's verdict as a client sees it: the key, or the problem's type.
    fn verdict(sources: &[KeySource], headers: &[(&str, &[u8])], body: &[u8]) -> Result<Option<String>, &'static str> {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).expect("a name"),
                http::HeaderValue::from_bytes(value).expect("a header value"),
            );
        }
        let input = KeyInput {
            headers: &map,
            query: None,
            body: Some(body),
        };
        match find_key(sources, &input) {
            Ok(Some(Keyed::Key(key))) => Ok(Some(key.as_str().to_string())),
            Ok(Some(Keyed::Body)) => Ok(Some("<body>".into())),
            Ok(None) => Ok(None),
            Err(rejection) => Err(rejection.kind().slug()),
        }
    }

    /// Characters a key may be made of, and some it may not: a space, a tab, a
    /// control character, a letter outside ASCII. Not `"` or `,`, which a header
    /// reads as a structured string or a list and a JSON string does not.
    fn character() -> impl proptest::strategy::Strategy<Value = char> {
        use proptest::prelude::*;
        prop_oneof![
            8 => proptest::char::range('!', '~').prop_filter("header syntax", |c| !matches!(c, '"' | ',')),
            1 => Just(' '),
            1 => Just('\t'),
            1 => Just('\u{1}'),
            1 => Just('é'),
        ]
    }

    proptest::proptest! {
        /// The same value gives the same verdict (the same key, or the same problem)
        /// whether it comes in the header or in a JSON field: length, emptiness and
        /// characters are judged alike. A header's own syntax (surrounding space
        /// trimmed, a quoted string, a list) is the header's, so the value is generated
        /// without it.
        #[test]
        fn a_json_key_and_the_header_give_the_same_verdicts(
            raw in proptest::collection::vec(character(), 0..300),
        ) {
            let value: String = raw.into_iter().collect::<String>().trim_matches([' ', '\t']).to_string();
            let body = [br#"{"amount":5,"ref":"#.as_slice(), &canonical_json::quoted(&value), b"}"].concat();
            let json = verdict(&sources(&["json:/ref"]), &[], &body);
            let named = verdict(&sources(&["header:Idempotency-Key", "json:/ref"]), &[], &body);
            if let Ok(header_value) = http::HeaderValue::from_bytes(value.as_bytes()) {
                let header = verdict(&sources(&["header:Idempotency-Key"]), &[("idempotency-key", header_value.as_bytes())], b"{}");
                proptest::prop_assert_eq!(&json, &header, "{:?}", value);
            }
            proptest::prop_assert_eq!(&named, &json, "{:?}", value);
            if let Ok(Some(key)) = &json {
                proptest::prop_assert_eq!(key, &value);
            }
        }
    }
}
