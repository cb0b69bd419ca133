//! Property tests with proptest: key parsing, key derivation, the record encoding, and
//! the config loader. They run inside `cargo test` with proptest's default 256 cases.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

use std::path::Path;

use http::{HeaderName, HeaderValue};
use idemproxy::config::Config;
use idemproxy::error::KeyError;
use idemproxy::idempotency::{parse_key_value, store_key};
use idemproxy::record::{decode_headers, encode_headers};
use proptest::prelude::*;

/// What the contract says a bare key is: 1 to 255 visible ASCII characters, no comma.
fn is_acceptable_bare(raw: &[u8]) -> bool {
    let trimmed = raw.trim_ascii();
    !trimmed.is_empty()
        && trimmed.len() <= 255
        && trimmed.first() != Some(&b'"')
        && trimmed.iter().all(|b| (0x21..=0x7e).contains(b) && *b != b',')
}

proptest! {
    #[test]
    fn key_parsing_never_panics_and_accepts_exactly_the_contract(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
        let parsed = parse_key_value(&raw);
        if raw.trim_ascii().first() != Some(&b'"') {
            prop_assert_eq!(parsed.is_ok(), is_acceptable_bare(&raw), "{:?} -> {:?}", raw, parsed);
        }
        if let Ok(key) = parsed {
            prop_assert!(!key.as_str().is_empty() && key.as_str().len() <= 255);
            prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
        }
    }

    #[test]
    fn visible_ascii_keys_are_accepted_up_to_255_characters_and_no_further(
        key in "[!#-+--~]{230,280}",
        quoted in any::<bool>(),
    ) {
        // Any visible ASCII but '"' and ','; a backslash is escaped in the quoted form.
        let raw = if quoted { format!("\"{}\"", key.replace('\\', "\\\\")) } else { key.clone() };
        let parsed = parse_key_value(raw.as_bytes());
        if key.len() <= 255 {
            prop_assert_eq!(parsed.map(|k| k.as_str().to_string()), Ok(key));
        } else {
            prop_assert_eq!(parsed, Err(KeyError::TooLong));
        }
    }

    #[test]
    fn quoted_and_bare_forms_name_the_same_key(key in "[!#-+--~]{1,255}") {
        // Any visible ASCII but '"', ',' and '\\' (the class above skips them).
        prop_assume!(!key.contains('\\'));
        let quoted = format!("\"{key}\"");
        prop_assert_eq!(parse_key_value(key.as_bytes()), parse_key_value(quoted.as_bytes()));
    }

    #[test]
    fn control_space_and_non_ascii_bytes_inside_a_key_are_refused(
        prefix in "[a-z]{1,5}",
        bad in prop_oneof![0u8..=0x20, 0x7fu8..=0xff],
        suffix in "[a-z]{1,5}",
    ) {
        let mut raw = prefix.into_bytes();
        raw.push(bad);
        raw.extend_from_slice(suffix.as_bytes());
        let parsed = parse_key_value(&raw);
        prop_assert_eq!(parsed, Err(KeyError::NotVisibleAscii), "{:?}", raw);
    }

    #[test]
    fn key_derivation_is_injective(
        a in proptest::collection::vec(proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 0..3), 0..3),
        b in proptest::collection::vec(proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 0..3), 0..3),
        key_a in "[a-c:]{1,4}",
        key_b in "[a-c:]{1,4}",
    ) {
        let (sa, sb) = (a, b);
        let ka = parse_key_value(key_a.as_bytes()).expect("key");
        let kb = parse_key_value(key_b.as_bytes()).expect("key");
        let da = store_key("p", "r", &as_refs(&sa), &ka);
        let db = store_key("p", "r", &as_refs(&sb), &kb);
        prop_assert_eq!(da == db, sa == sb && key_a == key_b);
        // The raw client bytes never appear in the store key.
        let hash = da.as_str().strip_prefix("p:r:{").and_then(|rest| rest.strip_suffix('}'));
        prop_assert!(hash.is_some_and(|hash| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit())), "{:?}", da);
    }

    #[test]
    fn record_headers_round_trip(headers in proptest::collection::vec(("[a-z-]{1,20}", proptest::collection::vec(field_value_byte(), 0..40)), 0..12)) {
        let headers: Vec<(HeaderName, HeaderValue)> = headers
            .into_iter()
            .map(|(name, value)| {
                let name = HeaderName::from_bytes(name.as_bytes()).expect("a token is a header name");
                (name, HeaderValue::from_bytes(&value).expect("field-value bytes make a header value"))
            })
            .collect();
        prop_assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
    }

    #[test]
    fn record_header_decoding_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_headers(&raw);
    }

    #[test]
    fn the_config_loader_never_panics_on_any_text(text in "\\PC{0,400}") {
        let _ = Config::parse(&text, Path::new("fuzz.toml"));
    }

    #[test]
    fn the_config_loader_never_panics_on_mutated_configs(cut in 0usize..900, insert in "[\\[\\]=\"a-z0-9._ \n-]{0,12}") {
        let valid = include_str!("../proxy.toml");
        let cut = valid.char_indices().map(|(i, _)| i).nth(cut % valid.chars().count()).unwrap_or(0);
        let mutated = format!("{}{}{}", &valid[..cut], insert, &valid[cut..]);
        match Config::parse(&mutated, Path::new("fuzz.toml")) {
            Ok(_) => {}
            Err(error) => {
                let message = error.to_string();
                prop_assert!(message.starts_with("fuzz.toml:"), "{}", message);
            }
        }
    }
}

/// A byte a header field value may hold (RFC 9110 §5.5: visible ASCII, space, tab,
/// and obs-text).
fn field_value_byte() -> impl Strategy<Value = u8> {
    prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff]
}

fn as_refs(scope: &[Vec<Vec<u8>>]) -> Vec<Vec<&[u8]>> {
    scope
        .iter()
        .map(|values| values.iter().map(Vec::as_slice).collect())
        .collect()
}
