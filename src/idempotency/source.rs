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
    let typed = sources.iter().any(|source| matches!(source, KeySource::Json(_)));
    // A form body on a route that reads forms is not a JSON body that failed.
    let form = is_form(input.headers) && sources.iter().any(|source| matches!(source, KeySource::Form(_)));
    for source in sources {
        let value = match source {
            KeySource::Header(name) => parse_key(input.headers.get_all(name)).transpose().map(spelled),
            KeySource::Json(_) if form => None,
            KeySource::Json(pointers) => match input.body.filter(|body| !body.is_empty()) {
                None => None,
                // A body the strict parser refuses (a duplicate member, NaN, a BOM,
                // deep nesting, UTF-16) may still be read by the upstream: before any
                // source the request carries, it is refused, never forwarded unguarded
                // with its key unread.
                Some(body) => match canonical_json::find(body, pointers) {
                    None => {
                        return Err(SourceError::NotJson {
                            sources: describe(sources),
                        }
                        .into());
                    }
                    Some(found) => composite(found),
                },
            },
            KeySource::Form(name) => input
                .body
                .filter(|_| is_form(input.headers))
                .and_then(|body| field(body, name))
                .map(spelled),
            KeySource::Query(name) => input.query.and_then(|query| field(query.as_bytes(), name)).map(spelled),
            KeySource::Body => return Ok(Some(Keyed::Body)),
        };
        match value {
            None => continue,
            Some(Ok(Spelled { key, by_client })) if typed && by_client => return Ok(Some(Keyed::Key(untyped(key)))),
            Some(Ok(Spelled { key, .. })) => return Ok(Some(Keyed::Key(key))),
            Some(Err(error)) if one_header => return Err(error.into()),
            Some(Err(error)) => {
                let from = source.to_string();
                return Err(SourceError::Invalid { from, error }.into());
            }
        }
    }
    Ok(None)
}

/// A key as a source found it: `by_client` when the client spelled it as text (a
/// header, a form or query field, a JSON string), not made from a JSON value.
struct Spelled {
    key: IdempotencyKey,
    by_client: bool,
}

fn spelled(key: Result<IdempotencyKey, KeyError>) -> Result<Spelled, KeyError> {
    key.map(|key| Spelled { key, by_client: true })
}

/// On a route with a `json:` source, a key spelled as text that reads as the
/// canonical form of another JSON value (`1234e0`, `true`, `["a",1]`) is tagged, so
/// that the string `"1234e0"` and the number `1234` are two keys, not one: the tag
/// holds a space, which no client key can. Values keep their own names, so records
/// made before the tag are found as they were.
fn untyped(key: IdempotencyKey) -> IdempotencyKey {
    let text = key.as_str();
    // Only a number, `true`, `false`, an array or an object can (a JSON `null` is no
    // key): most keys are not parsed at all.
    let could_be = text
        .bytes()
        .next()
        .is_some_and(|first| first.is_ascii_digit() || b"-tf[{".contains(&first));
    let reads_as_a_value =
        could_be && canonical_json::canonical(text.as_bytes(), &[]).is_some_and(|form| form == text.as_bytes());
    if reads_as_a_value {
        IdempotencyKey(format!("string {text}"))
    } else {
        key
    }
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
/// identical requests name one record in one scope. Named `body <hex>`: the space is
/// one no client key can hold, so a client cannot name (and block) a key-less record.
pub fn body_key(fingerprint: Fingerprint) -> IdempotencyKey {
    IdempotencyKey(format!("body {}", fingerprint.to_hex()))
}

/// The key a JSON source's values make: one value alone (a string as it is, another
/// value in canonical form), or the canonical JSON array of several. `None` unless
/// every value is present.
fn composite(found: Vec<Option<Found>>) -> Option<Result<Spelled, KeyError>> {
    let mut parts = found.into_iter().collect::<Option<Vec<Found>>>()?;
    if parts.len() == 1 {
        return Some(match parts.pop()? {
            Found::String(text) => spelled(plain_key(text.as_bytes())),
            Found::Other(bytes) => made(plain_key(&bytes)),
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
    Some(made(plain_key(&key)))
}

/// A key made from JSON values (not spelled by the client as text).
fn made(key: Result<IdempotencyKey, KeyError>) -> Result<Spelled, KeyError> {
    key.map(|key| Spelled { key, by_client: false })
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
        assert!(
            key(&all, &[], None, b"ref=f").is_err_and(|refused| refused.contains("not JSON")),
            "a form needs its content type: without it, it is a body the json: source cannot read"
        );
        assert_eq!(
            key(&all, &[], Some("ref=a&ref=b"), b"").map_err(|e| e.contains("query:ref")),
            Err(true)
        );
        // 255 characters is a key (cargo-mutants: `>` as `>=` at the bound was missed).
        let longest = format!(r#"{{"ref":"{}"}}"#, "r".repeat(255));
        assert_eq!(key(&all, &[], None, longest.as_bytes()), Ok(Some("r".repeat(255))));
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
        assert!(
            key(&mixed, &[], None, b"{broken").is_err_and(|refused| refused.contains("not JSON")),
            "a json: source before the first the request carries: refused, as an all-json route does"
        );
        assert_eq!(key(&mixed, &[], Some("ref=q"), b""), Ok(Some("q".into())), "no body");
        assert_eq!(
            key(&sources(&["json:/ref", "body"]), &[], None, b"{}"),
            Ok(Some("<body>".into()))
        );
    }

    /// Issue 49 L2: with `json:` before the header and `required = false`, bodies the
    /// upstream may read but the strict parser refuses were forwarded unguarded (7 of 7
    /// ran again on retry). Each is refused before anything is forwarded, header or not;
    /// a form body on a route that reads forms is not one of them.
    #[test]
    fn a_body_the_json_source_cannot_read_is_refused_before_later_sources() {
        let first = sources(&["json:/ref", "header:Idempotency-Key"]);
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let utf16: Vec<u8> = r#"{"ref":"r-1"}"#.encode_utf16().flat_map(u16::to_le_bytes).collect();
        let bodies: Vec<Vec<u8>> = vec![
            br#"{"ref":"r-1","ref":"r-2"}"#.to_vec(),
            br#"{"ref":"r-1","amount":NaN}"#.to_vec(),
            [&b"\xef\xbb\xbf"[..], br#"{"ref":"r-1"}"#].concat(),
            format!(r#"{{"ref":"r-1","deep":{deep}}}"#).into_bytes(),
            br#"{"ref":"r-1","note":"\ud800"}"#.to_vec(),
            br#"{"ref":"r-1","amount":1e1000000000000000000}"#.to_vec(),
            utf16,
        ];
        for body in &bodies {
            for headers in [&[][..], &[("idempotency-key", "h-1")][..]] {
                let refused = key(&first, headers, None, body).expect_err("refused");
                assert!(refused.contains("not JSON"), "{refused}");
            }
        }
        // The header first: the request carries it, and the body is not read for a key.
        let header_first = sources(&["header:Idempotency-Key", "json:/ref"]);
        assert_eq!(
            key(&header_first, &[("idempotency-key", "h-1")], None, &bodies[0]),
            Ok(Some("h-1".into()))
        );
        // A form body where a form source is listed: the form's key.
        let with_form = sources(&["json:/ref", "form:ref"]);
        let form = [("content-type", "application/x-www-form-urlencoded")];
        assert_eq!(key(&with_form, &form, None, b"ref=f-1"), Ok(Some("f-1".into())));
    }

    /// Issue 49 L3: a JSON key carried no type, so `{"ref":1234}` and `{"ref":"1234e0"}`
    /// were one key (the second, another operation, got 422), as were `true` and
    /// `"true"`. A key spelled as text that reads as another value's canonical form is
    /// tagged; values keep their names (records made before are found as they were).
    #[test]
    fn a_json_value_and_a_string_that_spells_it_are_two_keys() {
        let json = sources(&["json:/ref", "header:Idempotency-Key"]);
        for (value, text) in [
            (r#"{"ref":1234}"#, r#"{"ref":"1234e0"}"#),
            (r#"{"ref":true}"#, r#"{"ref":"true"}"#),
            (r#"{"ref":false}"#, r#"{"ref":"false"}"#),
        ] {
            let (value, text) = (
                key(&json, &[], None, value.as_bytes()),
                key(&json, &[], None, text.as_bytes()),
            );
            assert_ne!(value, text, "one key for a value and its spelling");
        }
        assert_eq!(key(&json, &[], None, br#"{"ref":1234}"#), Ok(Some("1234e0".into())));
        assert_eq!(key(&json, &[], None, br#"{"ref":"1234"}"#), Ok(Some("1234".into())));
        assert_eq!(
            key(&json, &[("idempotency-key", "true")], None, b""),
            Ok(Some("string true".into())),
            "a header that spells a value, on a route with a json: source"
        );
        let composite = sources(&["json:/a&/b", "header:Idempotency-Key"]);
        assert_ne!(
            key(&composite, &[], None, br#"{"a":"x","b":1}"#),
            key(&composite, &[("idempotency-key", r#"["x",1e0]"#)], None, b""),
            "a header that spells a composite key"
        );
        // On a route without a json: source, nothing is tagged: header keys keep their
        // records' names.
        let header = sources(&["header:Idempotency-Key", "query:ref"]);
        assert_eq!(
            key(&header, &[("idempotency-key", "true")], None, b""),
            Ok(Some("true".into()))
        );
    }

    /// Issue 49 L1: `Idempotency-Key: body:<fingerprint>` (computable offline) named a
    /// key-less record, blocking another client's known payment with 422. A key-less
    /// record's key holds a space, which no client key can.
    #[test]
    fn no_client_key_can_name_a_key_less_record() {
        let named = body_key(Fingerprint([7; 32]));
        assert!(named.as_str().starts_with("body "), "{named:?}");
        let header = [("idempotency-key", named.as_str())];
        let one = sources(&["header:Idempotency-Key", "body"]);
        assert!(key(&one, &header, None, b"").is_err(), "a header cannot spell it");
        let quoted = format!("\"{}\"", named.as_str());
        assert!(key(&one, &[("idempotency-key", quoted.as_str())], None, b"").is_err());
        let json = sources(&["json:/ref", "body"]);
        let body = format!(r#"{{"ref":"{}"}}"#, named.as_str());
        assert!(key(&json, &[], None, body.as_bytes()).is_err(), "nor a JSON string");
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
            // A value that reads as another JSON value (`0`, `true`) is tagged on a route
            // with a json: source, by design (`untyped`, and its own test above).
            proptest::prop_assume!(untyped(IdempotencyKey(value.clone())).as_str() == value);
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
